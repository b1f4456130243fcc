#pragma once
// Catch2's assertion macros are not thread-safe. Code running on rank threads (comm::threads)
// asserts through these wrappers, which serialise the Catch2 call with one mutex. The
// expression of a throw-check runs outside the lock: it is usually a collective, and holding
// the lock across it would deadlock the other ranks.
#include <exception>
#include <mutex>
#include <string>

#include "catch.hpp"

namespace gradapt_test {
inline std::mutex& catch_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace gradapt_test

#define RANK_REQUIRE(...)                                         \
  do {                                                            \
    std::lock_guard gradapt_lock_(::gradapt_test::catch_mutex()); \
    REQUIRE(__VA_ARGS__);                                         \
  } while (0)

#define RANK_CHECK(...)                                           \
  do {                                                            \
    std::lock_guard gradapt_lock_(::gradapt_test::catch_mutex()); \
    CHECK(__VA_ARGS__);                                           \
  } while (0)

#define RANK_REQUIRE_THROWS_WITH(expr, matcher)                   \
  do {                                                            \
    bool gradapt_threw_ = false;                                  \
    std::string gradapt_what_;                                    \
    try {                                                         \
      static_cast<void>(expr);                                    \
    } catch (const std::exception& gradapt_e_) {                  \
      gradapt_threw_ = true;                                      \
      gradapt_what_ = gradapt_e_.what();                          \
    }                                                             \
    std::lock_guard gradapt_lock_(::gradapt_test::catch_mutex()); \
    REQUIRE(gradapt_threw_);                                      \
    REQUIRE_THAT(gradapt_what_, matcher);                         \
  } while (0)

#pragma once
// The message of the gradapt::error a call throws: the one body behind the `error_of` helpers
// of the MPI, NCCL, CUDA and hierarchical-scenario tests.
#include <string>
#include <utility>

#include "gradapt/core/error.hpp"

namespace gradapt_test {

/// Runs f and returns the message of the gradapt::error it throws, or `none` when it throws
/// nothing; any other exception propagates (and fails the test).
template <class F>
std::string thrown_message(F&& f, std::string none = "no error") {
  try {
    std::forward<F>(f)();
  } catch (const gradapt::error& e) {
    return e.what();
  }
  return none;
}

}  // namespace gradapt_test

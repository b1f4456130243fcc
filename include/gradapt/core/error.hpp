#pragma once
/// @file
/// The one exception type gradapt throws, and helpers that build actionable messages.

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace gradapt {

/// Thrown for every invalid argument, inconsistent state or engine failure.
///
/// The message names what was wrong (tensor name, rank, sizes) and what was expected, for
/// example `gradapt: allreduce on rank 2: buffer has 10 elements but rank 0 has 12`.
class error : public std::runtime_error {
 public:
  /// Builds the error from a complete message; `what()` returns it unchanged. Library code
  /// builds messages with the "gradapt: " prefix; user code may pass any text.
  explicit error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

/// Concatenates any streamable values into one message prefixed with "gradapt: ".
template <class... Args>
[[nodiscard]] std::string message(Args&&... args) {
  std::ostringstream os;
  os << "gradapt: ";
  (os << ... << std::forward<Args>(args));
  return os.str();
}

/// Throws gradapt::error built from the streamed arguments.
template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  throw error(message(std::forward<Args>(args)...));
}

/// Throws gradapt::error unless `cond` holds.
template <class... Args>
void require(bool cond, Args&&... args) {
  if (!cond) fail(std::forward<Args>(args)...);
}

}  // namespace detail
}  // namespace gradapt

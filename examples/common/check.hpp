#pragma once
// The examples' input checks: throw gradapt::error (the library's public exception type) with
// a message built from the streamed arguments.
#include <sstream>
#include <utility>

#include "gradapt/core/error.hpp"

namespace examples {

/// Throws gradapt::error with the streamed arguments as its message.
template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw gradapt::error(os.str());
}

/// Throws gradapt::error unless `ok`.
template <class... Args>
void require(bool ok, Args&&... args) {
  if (!ok) fail(std::forward<Args>(args)...);
}

}  // namespace examples

#pragma once
/// @file
/// Names of enumerators for messages and logs, from one array per enumeration.

#include <array>
#include <cstddef>
#include <string_view>

namespace gradapt::detail {

/// The name of enumerator `e` from the names of the enumerators `first`, `first + 1`, ...;
/// "unknown" for a value outside them.
template <class E, std::size_t N>
constexpr std::string_view enum_name(E e, const std::array<std::string_view, N>& names,
                                     std::size_t first = 0) {
  const auto i = static_cast<std::size_t>(e);
  return i >= first && i - first < N ? names[i - first] : std::string_view("unknown");
}

}  // namespace gradapt::detail

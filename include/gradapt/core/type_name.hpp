#pragma once
/// @file
/// The name of a type as the compiler spells it, for error messages that name an algorithm
/// ("gradapt::sgd", "gradapt::chain<gradapt::transform::trace, ...>"), and a readable form
/// without the library's namespaces. Read from the compiler's function signature string
/// (GCC, Clang, MSVC), at compile time.

#include <cstddef>
#include <string>
#include <string_view>

namespace gradapt::detail {

/// The compiler's spelling of T (e.g. "gradapt::sgd"); "unknown type" on another compiler.
template <class T>
constexpr std::string_view type_name() {
#if defined(__clang__) || defined(__GNUC__)
  constexpr std::string_view f = __PRETTY_FUNCTION__;
  constexpr std::string_view key = "T = ";
  constexpr std::size_t begin = f.find(key);
  if constexpr (begin == std::string_view::npos) {
    return "unknown type";
  } else {
    constexpr std::size_t from = begin + key.size();
    constexpr std::size_t semi = f.find(';', from);
    constexpr std::size_t end = semi == std::string_view::npos ? f.rfind(']') : semi;
    return f.substr(from, end - from);
  }
#elif defined(_MSC_VER)
  constexpr std::string_view f = __FUNCSIG__;
  constexpr std::string_view key = "type_name<";
  constexpr std::size_t from = f.find(key) + key.size();
  constexpr std::size_t end = f.rfind(">(void)");
  return f.substr(from, end - from);
#else
  return "unknown type";
#endif
}

/// type_name<T>() without the prefixes "gradapt::", "transform::" and "detail::" (for messages).
template <class T>
std::string short_type_name() {
  std::string s(type_name<T>());
  for (const std::string_view prefix : {"gradapt::", "transform::", "optim::", "detail::"}) {
    for (std::size_t at = s.find(prefix); at != std::string::npos; at = s.find(prefix, at))
      s.erase(at, prefix.size());
  }
  return s;
}

}  // namespace gradapt::detail

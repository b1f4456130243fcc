#pragma once
/// @file
/// The one exception type gradapt throws, and helpers that build actionable messages.

#include <initializer_list>
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

/// `what` without a leading "gradapt: " (to embed one message in another).
inline std::string_view without_prefix(std::string_view what) {
  constexpr std::string_view prefix = "gradapt: ";
  return what.substr(0, prefix.size()) == prefix ? what.substr(prefix.size()) : what;
}

/// Rethrows `e` as raised by `who`: "gradapt: <who>: <message>", where the message is e's
/// without its "gradapt: " prefix, and a leading "<stage>: <name>" found in `renames` is
/// replaced by the public option name it stands for. The presets use it so that an option an
/// inner stage rejects is reported under the algorithm's and the option's public names
/// (`lamb({.max_grad_norm = -1})` → "gradapt: lamb: max_grad_norm is -1 ...").
[[noreturn]] inline void rethrow_in(
    std::string_view who, const error& e,
    std::initializer_list<std::pair<std::string_view, std::string_view>> renames = {}) {
  const std::string_view m = without_prefix(e.what());
  if (m.substr(0, who.size()) == who && m.substr(who.size(), 2) == ": ") throw error(message(m));
  for (const auto& [inner, outer] : renames)
    if (m.substr(0, inner.size()) == inner) throw error(message(who, ": ", outer, m.substr(inner.size())));
  throw error(message(who, ": ", m));
}

/// The options held by `{}` or `{options}`: lets `T({})` pick T's options constructor. An
/// options constructor `explicit T(const O& = {})` alone makes `T({})` ambiguous with T's move
/// constructor; a `T(std::initializer_list<O>)` constructor that forwards here is an exact
/// match for the empty braces.
template <class O>
O options_from(std::initializer_list<O> list, std::string_view who) {
  if (list.size() > 1) fail(who, ": ", list.size(), " option sets given (expected one)");
  return list.size() ? *list.begin() : O{};
}

}  // namespace detail
}  // namespace gradapt

#pragma once
/// @file
/// Hooks: how the library calls a user's object at named events. One mechanism serves both
/// places that take such objects: the hooks of `train::data_parallel_step` (events
/// `before_step`, `after_step`, `on_overflow`, `on_rescale`) and the policies of
/// `elastic::adaptive_job` (events `before_train`, `before_epoch`, `after_step`,
/// `after_epoch`, `after_train`, `on_world_change`).
///
/// An *event* is a tag type E declared with `GRADAPT_HOOK_EVENT(member, Args...)`: it names
/// the member function a hook defines to handle it and the arguments the library passes. A
/// type H *handles* E (`handles<H, E>`) when `h.member(args...)` compiles for those argument
/// types; an object (or a `std::reference_wrapper` to one, which the library calls through)
/// is a hook of an event set (`hook_for<H, event_set<E...>>`) when it handles at least one of
/// them, detected at compile time as ensmallen detects callbacks. Events an object does not
/// handle cost nothing: no call, no branch.
///
/// `notify<E>(hooks, args...)` calls E on each hook of a tuple that handles it, in the tuple's
/// order. One object may handle events of both sets (a step hook that is also a job policy)
/// and be passed to both, by `std::ref`, to keep one state.
///
/// Example (tests/test_train_policy.cpp, "one object as step hook and job policy"):
///
///     struct lr_warmup {                       // a step hook: handles train's before_step
///       void before_step(gradapt::train::step_settings& s, const gradapt::train::step_metrics& m);
///     };
///     static_assert(gradapt::train::step_hook<lr_warmup>);

#include <cstddef>
#include <functional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace gradapt {

/// The argument types an event passes to its member (reference types as the member sees them).
template <class... A>
struct event_args {};

/// A set of events (the events one component raises).
template <class... E>
struct event_set {};

/// Declares the event tag `member` in the current namespace: a hook handles it with a member
/// function `member(Args...)`. The tag has `name` (the member's name, for messages), `args`
/// (`event_args<Args...>`) and `call(h, args...)`.
#define GRADAPT_HOOK_EVENT(member, ...)                          \
  struct member {                                                \
    static constexpr std::string_view name = #member;            \
    using args = ::gradapt::event_args<__VA_ARGS__>;             \
    template <class GradaptHook, class... GradaptArgs>           \
    static auto call(GradaptHook& h, GradaptArgs&&... a)         \
        -> decltype(h.member(std::forward<GradaptArgs>(a)...)) { \
      return h.member(std::forward<GradaptArgs>(a)...);          \
    }                                                            \
  }

namespace detail {
template <class H, class E, class Args>
struct handles_event : std::false_type {};
template <class H, class E, class... A>
    struct handles_event<H, E, event_args<A...>> : std::bool_constant < requires(H& h, A&&... a) {
  E::call(h, std::forward<A>(a)...);
} > {};

template <class H, class Set>
struct hooks_any : std::false_type {};
template <class H, class... E>
struct hooks_any<H, event_set<E...>>
    : std::bool_constant<(handles_event<H, E, typename E::args>::value || ...)> {};
}  // namespace detail

/// The object a hook value stands for: `h.get()` for a `std::reference_wrapper`, else `h`.
template <class H>
constexpr decltype(auto) hook_object(H& h) {
  if constexpr (std::is_same_v<std::unwrap_reference_t<std::remove_const_t<H>>, std::remove_const_t<H>>)
    return (h);
  else
    return h.get();
}

/// The type `hook_object` returns a reference to, for a hook value of type H.
template <class H>
using hook_object_t = std::unwrap_reference_t<std::remove_cvref_t<H>>;

/// H (or the object a std::reference_wrapper H refers to) handles event E.
template <class H, class E>
concept handles = detail::handles_event < hook_object_t<H>,
        E,
typename E::args > ::value;

/// H handles at least one event of the set Set (an `event_set`).
template <class H, class Set>
concept hook_for = detail::hooks_any<hook_object_t<H>, Set>::value;

/// Some hook of the tuple type Hooks handles event E.
template <class E, class Hooks>
inline constexpr bool any_handles = false;
/// Some hook of the tuple handles event E.
template <class E, class... H>
inline constexpr bool any_handles<E, std::tuple<H...>> = (handles<H, E> || ...);

/// Calls event E on every hook in `hooks` (a std::tuple) that handles it, in order, with
/// `args`. When `position` is given it holds the index of the hook being called (so a caller
/// that catches an exception can name the hook).
template <class E, class... H, class... A>
void notify_tracked(std::tuple<H...>& hooks, [[maybe_unused]] std::size_t& position,
                    [[maybe_unused]] A&&... args) {
  if constexpr (any_handles<E, std::tuple<H...>>) {
    std::apply(
        [&](auto&... h) {
          std::size_t i = 0;
          (
              [&](auto& x) {
                if constexpr (handles<std::remove_reference_t<decltype(x)>, E>) {
                  position = i;
                  E::call(hook_object(x), args...);
                }
                ++i;
              }(h),
              ...);
        },
        hooks);
  }
}

/// Calls event E on every hook in `hooks` (a std::tuple) that handles it, in order.
template <class E, class... H, class... A>
void notify(std::tuple<H...>& hooks, A&&... args) {
  std::size_t position = 0;
  notify_tracked<E>(hooks, position, std::forward<A>(args)...);
}

}  // namespace gradapt

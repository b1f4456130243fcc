#pragma once
/// @file
/// What `train::data_parallel_step` is built from: the optimizer concept it accepts
/// (`step_optimizer`), the rules that carry its settings to another world size
/// (`rescale_rule`), and the factory's slot machinery (which argument fills which slot, the
/// runtime each slot holds).
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/enum_name.hpp"
#include "gradapt/optim/stage.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "gradapt/train/policies.hpp"

namespace gradapt::train {

/// How `data_parallel_step::restore` carries the settings from a checkpoint of N ranks to a
/// world of M ranks (the learning-rate rules of Krizhevsky 2014 and Goyal et al. 2017; AdaScale,
/// Johnson et al. 2020). On N = M every rule keeps the settings.
enum class rescale_rule : unsigned char {
  /// The same global batch: accumulation_steps × N / M (must be a whole number); lr kept.
  keep_global_batch,
  /// The global batch follows the ranks; lr × M / N.
  linear_lr,
  /// The global batch follows the ranks; lr × √(M / N).
  sqrt_lr,
  /// The global batch follows the ranks; lr kept, AdaScale's gain follows the new batch (needs
  /// the adapt slot's adascale_policy).
  adascale,
};

/// The rule's name ("keep_global_batch", ...), "unknown" for another value.
inline const char* name(rescale_rule r) {
  constexpr std::array<std::string_view, 4> names{"keep_global_batch", "linear_lr", "sqrt_lr", "adascale"};
  return gradapt::detail::enum_name(r, names).data();  // the names are NUL-terminated literals
}

/// The state type an optimizer creates for backend B and parameter list PL.
template <class O, class B, class PL>
using optimizer_state_t = std::remove_cvref_t<decltype(std::declval<const O&>().init(
    std::declval<const B&>(), std::declval<const PL&>()))>;

/// An optimizer with the chain interface (gradapt::lamb, adamw, sgd, lars, any gradapt::chain):
/// `init(backend, params)` creates a state; `step(backend, params, state, step_args)` steps;
/// the state counts steps and saves to / loads from bytes.
template <class O, class B, class PL>
concept step_optimizer = requires(const O& o, const B& b, const PL& p) {
  o.init(b, p);
}
&&requires(const O& o, const B& b, const PL& p, optimizer_state_t<O, B, PL>& st,
           const optimizer_state_t<O, B, PL>& cst, std::span<const std::byte> bytes) {
  o.step(b, p, st, step_args{});
  { cst.save(b) } -> std::same_as<std::vector<std::byte>>;
  st.load(b, bytes);
  { cst.steps() } -> std::convertible_to<std::uint64_t>;
};

namespace detail {

/// The optimizer state the step holds: Opt's own state, or with a ZeRO state slot the
/// sharded optimizer's state of this rank's shard.
template <bool Sharded, class Opt, class Comm, class B, class PL>
struct state_of {
  using type = optimizer_state_t<Opt, B, PL>;
};
template <class Opt, class Comm, class B, class PL>
struct state_of<true, Opt, Comm, B, PL> {
  using type = std::remove_cvref_t<decltype(std::declval<const shard::sharded_optimizer<Opt>&>().init(
      std::declval<Comm&>(), std::declval<const B&>(), std::declval<const PL&>()))>;
};
/// The ZeRO stage of a state policy (0: replicated).
template <class P>
inline constexpr int zero_stage_v = 0;
template <int Stage>
inline constexpr int zero_stage_v<zero_state<Stage>> = Stage;

/// An empty member for a slot that is off.
struct nothing {};

/// The reduce slot's members, named only when the slot is on.
template <bool On, class Comm, class B>
struct hierarchy_slot {
  using type = nothing;
};
template <class Comm, class B>
struct hierarchy_slot<true, Comm, B> {
  using type = std::optional<comm::hierarchy<Comm, B>>;
};
template <bool On, class Comm, class G, class B>
struct reducer_slot {
  using type = nothing;
};
template <class Comm, class G, class B>
struct reducer_slot<true, Comm, G, B> {
  using type = std::optional<bucket::reducer<Comm, G, B>>;
};

/// What the optimizer's step returns (a Shampoo chain: shampoo_step_report), or nothing.
template <class O>
struct report_of {
  using type = nothing;
};
template <class O>
requires requires {
  typename O::step_result;
} &&(!std::is_void_v<typename O::step_result>)struct report_of<O> {
  using type = typename O::step_result;
};

template <class T>
struct schedule_of {
  using type = fixed_period;  // unused placeholder when the sync slot is off
};
template <class S>
struct schedule_of<local_sgd_policy<S>> {
  using type = S;
};

/// The bound preconditioner of slot P (nothing when the slot is off).
template <class P, class Comm, class B, class PL>
struct preconditioner_of {
  using type = bound_preconditioner_t<P, Comm, B, PL>;
};
template <class Comm, class B, class PL>
struct preconditioner_of<no_preconditioner, Comm, B, PL> {
  using type = nothing;
};

/// The runtime of the adapt slot: the estimator, AdaScale and the policy's options.
struct adapt_runtime {
  adascale_policy policy;
  gradient_noise_scale gns;
  adascale ada;
};

/// The runtime of the sync slot: the driver (rebuilt when a fixed period changes).
template <class C, class S>
struct sync_runtime {
  local_sgd_options options;
  S schedule;
  std::optional<local_sgd<C, S>> driver;
  bool was_synchronous = false;  ///< step_settings::synchronous at the latest step
};

/// Fingerprint of a list's tensor shapes (rank and extents, in order; below 2^50, exact in a
/// double).
template <class L>
double fingerprint(const L& list) {
  std::uint64_t h = 1469598103ULL;
  std::uint64_t t = 0;
  for (const auto& v : list) {
    h = (h * 1099511ULL + (++t) * 7919ULL + static_cast<std::uint64_t>(v.rank())) % (std::uint64_t{1} << 50);
    for (int d = 0; d < v.rank(); ++d)
      h = (h * 1099511ULL + static_cast<std::uint64_t>(v.dim(d))) % (std::uint64_t{1} << 50);
  }
  return static_cast<double>(h);
}

template <slot K, class Default>
Default pick() {
  return Default{};
}
template <slot K, class Default, class A0, class... A>
auto pick(A0&& a0, A&&... a) {
  if constexpr (slot_v<A0> == K)
    return std::remove_cvref_t<A0>(std::forward<A0>(a0));
  else
    return pick<K, Default>(std::forward<A>(a)...);
}

/// How many of the arguments A fill slot K.
template <slot K, class... A>
inline constexpr int count_slot = ((slot_v<A> == K ? 1 : 0) + ... + 0);

/// True when at most one of the arguments A fills slot K; otherwise a compile-time error whose
/// instantiation names the slot (K).
template <slot K, class... A>
constexpr bool at_most_one() {
  static_assert(count_slot<K, A...> <= 1,
                "train::make_data_parallel_step: more than one policy for one slot (the slot is this "
                "instantiation's K)");
  return true;
}

template <class A>
auto hook_tuple(A&& a) {
  if constexpr (slot_v<A> == slot::hook)
    return std::tuple<std::remove_cvref_t<A>>(std::forward<A>(a));
  else
    return std::tuple<>();
}

}  // namespace detail

}  // namespace gradapt::train

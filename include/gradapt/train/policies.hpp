#pragma once
/// @file
/// The policy slots of `gradapt::train::data_parallel_step`, the settings hooks may change, the
/// metrics a step reports, and the hook interface.
///
/// A data-parallel step is the recipe
///
///     unscale + overflow check (loss scaler)  →  local statistics  →  combine across ranks
///     (allreduce-mean, or Adasum)  →  noise scale and AdaScale gain  →  preconditioner
///     (K-FAC) at lr × gain  →  optimizer step at lr × gain  →  LocalSGD averaging when due
///
/// Each stage is a *slot* filled by one policy value passed to `make_data_parallel_step`; a
/// slot left out takes its "off" policy, which costs nothing (no member, no branch):
///
/// | slot         | off (default)       | on                                                        |
/// |--------------|---------------------|-----------------------------------------------------------|
/// | scaler       | `no_loss_scaling`   | `gradapt::loss_scaler` (Micikevicius et al. 2018)         |
/// | combine      | `allreduce_mean`    | `adasum_combine` (Maleki et al. 2021), or a user's policy |
/// | adapt        | `no_adascale`       | `adascale_policy` (McCandlish et al. 2018; Johnson 2020)  |
/// | precondition | `no_preconditioner` | `kfac_policy<State>` (train/kfac_policy.hpp; K-FAC)       |
/// | sync         | `no_local_sgd`      | `local_sgd_policy<Schedule>` (post-local SGD, Lin 2018)   |
/// | state        | `replicated_state`  | `zero_state<1>`, `zero_state<2>` (ZeRO, Rajbhandari 2020) |
/// | reduce       | `one_buffer_reduce` | `bucket_reduce` (buckets overlapped with the backward),   |
///  |              |                     | `hierarchical_reduce` (Horovod's hierarchical allreduce)  |
///
/// A policy names its slot (`static constexpr policy_slot slot = ...`, or a specialisation of
/// `policy_traits` for a type that cannot be edited). The combine slot is open: any type that
/// models `combine_policy` fills it, so a user's combiner (gradient compression, a
/// sparsifier with error feedback, PowerSGD) plugs in without editing the library; see
/// `combine_policy` for the contract and tests/test_train_policy.cpp for one written outside
/// include/. The precondition slot is open the same way (`precondition_policy`).
///
/// Any other value passed to the factory is a *hook*: an object with one or more of the member
/// functions `before_step`, `after_step`, `on_overflow`, `on_rescale` (detected at compile
/// time, as ensmallen detects callbacks). Hooks see `step_metrics` and may change
/// `step_settings` (learning rate, batch size, LocalSGD period), the way KungFu's adaptation
/// policies act on a running job. A combiner or hook with `save(archive_writer&) const` and
/// `load(archive_reader&)` (`saves_state`) has its state in the step's checkpoint.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/bucket/plan.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/hooks.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/stats/allreduce_with_norms.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"

namespace gradapt::train {

// ---- the slots ------------------------------------------------------------------------------

/// The slot a policy fills in `make_data_parallel_step`.
enum class policy_slot : unsigned char { scaler, combine, adapt, sync, precondition, state, reduce };

/// Which slot a policy type fills: `T::slot` when T declares it. Specialise it (with a
/// `static constexpr policy_slot slot`) for a type that cannot declare it.
template <class T>
struct policy_traits {};
/// A type that declares `static constexpr policy_slot slot`.
template <class T>
requires requires {
  { T::slot } -> std::convertible_to<policy_slot>;
}
struct policy_traits<T> {
  static constexpr policy_slot slot = T::slot;  ///< the slot it fills
};
/// `gradapt::loss_scaler` (precision/) fills the scaler slot.
template <>
struct policy_traits<loss_scaler> {
  static constexpr policy_slot slot = policy_slot::scaler;  ///< the slot it fills
};

/// A type with a slot (`policy_traits<T>::slot` exists).
template <class T>
concept policy = requires {
  { policy_traits<std::remove_cvref_t<T>>::slot } -> std::convertible_to<policy_slot>;
};

/// State a step keeps in its checkpoint: `save(archive_writer&) const` writes it into the
/// open section, `load(archive_reader&)` reads it back (all or nothing; throw gradapt::error
/// naming the field that does not fit).
template <class T>
concept saves_state = requires(const T& c, T& m, archive_writer& w, archive_reader& r) {
  c.save(w);
  m.load(r);
};

/// Scaler slot, off: the gradients carry no loss scale and are used as they are.
struct no_loss_scaling {
  static constexpr policy_slot slot = policy_slot::scaler;  ///< fills the scaler slot
};

namespace detail {
/// Element functor of the mean: g ← g / n in the compute type, one rounding.
}  // namespace detail

/// The bound form of combine policy P: `p.bind(comm, backend, params)` when P has it (a
/// combiner that keeps buffers or a communicator of its own), else a copy of p.
template <class P, class Comm, class B, class PL>
auto bind_combiner(const P& p, Comm& comm, const B& backend, const PL& params) {
  if constexpr (requires { p.bind(comm, backend, params); })
    return p.bind(comm, backend, params);
  else
    return p;
}
/// The type `bind_combiner` returns.
template <class P, class Comm, class B, class PL>
using bound_combiner_t = decltype(bind_combiner(std::declval<const P&>(), std::declval<Comm&>(),
                                                std::declval<const B&>(), std::declval<const PL&>()));

/// The combine slot's contract. A combine policy P declares `static constexpr policy_slot slot
/// = policy_slot::combine`; the step binds it once, when it is built (collectively, after the
/// ranks agreed on the parameter list), with `bind_combiner(p, comm, backend, params)`, and
/// calls the bound combiner c on every synchronous step, on every rank:
///
///     c.combine(comm, backend, params.grads());   // grads ← the combined gradient, in place
///
/// Optional members of c:
///  - `allreduce_norms combine_mean_with_norms(comm, backend, grads)`: forms the rank mean
///    (1/N) Σ_r g_r in place and returns Σ_r |g_r|² and |Σ_r g_r|² (what the data-parallel
///    noise scale needs); required with `adascale_policy`, called only with N > 1 ranks;
///  - `save(archive_writer&) const` / `load(archive_reader&)` (`saves_state`): its state (an
///    error-feedback residual, say) in the step's checkpoint, section "combine".
///
/// Every rank must bind the same policy with the same options: the step cannot see inside a
/// user's combiner, so a combiner whose ranks may disagree checks that itself.
template <class P, class Comm, class B, class PL>
concept combine_policy = policy<P> && policy_traits<std::remove_cvref_t<P>>::slot ==
                         policy_slot::combine&& requires(bound_combiner_t<P, Comm, B, PL>& c, Comm& comm,
                                                         const B& b, const PL& params) {
  c.combine(comm, b, params.grads());
};

/// A bound combiner that forms the rank mean and its two squared norms (`adascale_policy`
/// needs them).
template <class C, class Comm, class B, class PL>
concept mean_combiner = requires(C& c, Comm& comm, const B& b, const PL& params) {
  { c.combine_mean_with_norms(comm, b, params.grads()) } -> std::same_as<allreduce_norms>;
};

/// Combine slot (default): gradients are summed over the ranks with one allreduce per tensor
/// and divided by the rank count, g ← (1/N) Σ_r g_r. With `adascale_policy` on, the summing
/// allreduce is `gradapt::allreduce_with_norms`, which also yields the two squared norms of the
/// data-parallel noise scale (no extra pass on comm::threads).
struct allreduce_mean {
  static constexpr policy_slot slot = policy_slot::combine;  ///< fills the combine slot

  /// g ← (1/N) Σ_r g_r for every tensor (nothing with one rank): the sum, then g / N in the
  /// compute type; in one collective per tensor when the communicator has `allreduce_mean`
  /// (mean_allreduce_communicator: the same bits).
  template <class Comm, class B, class L>
  void combine(Comm& comm, const B& backend, const L& grads) const {
    const int n = comm.size();
    if (n == 1) return;
    if constexpr (mean_allreduce_communicator<Comm>) {
      for (const auto& g : grads) comm.allreduce_mean(g);
    } else {
      for (const auto& g : grads) comm.allreduce(g, reduce_op::sum);
      backend.apply_list(gradapt::detail::divide_by_ranks{n}, grads);
    }
  }
  /// `combine`, returning Σ_r |g_r|² and |Σ_r g_r|² summed over the tensors.
  template <class Comm, class B, class L>
  allreduce_norms combine_mean_with_norms(Comm& comm, const B& backend, const L& grads) const {
    allreduce_norms norms{0.0, 0.0};
    for (const auto& g : grads) {
      const allreduce_norms t = allreduce_with_norms(comm, backend, g);
      norms.sum_local_sq += t.sum_local_sq;
      norms.result_sq += t.result_sq;
    }
    backend.apply_list(gradapt::detail::divide_by_ranks{comm.size()}, grads);
    return norms;
  }
};

namespace detail {
/// `adasum_combine` bound to a communicator: the Adasum operator and its workspace (on the
/// host owning its memory; in another memory space over buffers allocated from the backend).
template <class Comm, class G, class B>
struct adasum_runtime {
  using space = typename Comm::space;
  static constexpr bool on_host = std::same_as<space, host_space>;
  struct none {};
  template <class T>
  using buffer =
      std::conditional_t<on_host, none, decltype(std::declval<const B&>().template allocate<T>(1))>;
  adasum<Comm> op;
  [[no_unique_address]] buffer<G> elements;
  [[no_unique_address]] buffer<double> scalars;
  adasum_workspace<G, space> ws;
  template <class L>
  adasum_runtime(Comm& comm, const adasum_options& o, const L& grads, const B& b)
      : op(comm, o),
        elements(make<G>(b, adasum_workspace<G, space>::elements_needed(grads))),
        scalars(make<double>(b, adasum_workspace<G, space>::scalars_needed(grads))),
        ws(workspace(grads)) {}
  template <class L>
  void combine(Comm&, const B& backend, const L& grads) {
    op.allreduce(backend, grads, ws);
  }

 private:
  template <class T>
  static buffer<T> make(const B& b, std::size_t n) {
    if constexpr (on_host) {
      (void)b;
      (void)n;
      return {};
    } else {
      return b.template allocate<T>(n);
    }
  }
  template <class L>
  adasum_workspace<G, space> workspace(const L& grads) {
    if constexpr (on_host)
      return adasum_workspace<G, space>(grads);
    else
      return adasum_workspace<G, space>(
          grads, tensor_view<G, space>::vector(elements.data(), static_cast<std::int64_t>(elements.size())),
          tensor_view<double, space>::vector(scalars.data(), static_cast<std::int64_t>(scalars.size())));
  }
};
}  // namespace detail

/// Combine slot: Adasum (Maleki et al., MLSys 2021), g ← g_0 ⊕ g_1 ⊕ … ⊕ g_{N−1} with the
/// pairwise operator a ⊕ b = (1 − a·b/2|a|²) a + (1 − a·b/2|b|²) b per tensor (see
/// combine/adasum.hpp). Binding builds the `gradapt::adasum` combiner and its workspace
/// once. The data-parallel noise scale needs the rank MEAN of the gradients, which Adasum does
/// not form, so this slot cannot be combined with `adascale_policy` (a compile-time error).
struct adasum_combine {
  static constexpr policy_slot slot = policy_slot::combine;  ///< fills the combine slot
  adasum_options options{};  ///< flat or hierarchical, zero threshold, layout check

  /// The Adasum operator over `comm` (a hierarchical one splits it: collective) and its
  /// workspace for the list's gradients.
  template <class Comm, class B, class PL>
  auto bind(Comm& comm, const B& backend, const PL& params) const {
    return detail::adasum_runtime<Comm, typename PL::grad_type, B>(comm, options, params.grads(), backend);
  }
};

/// Adapt slot, off: no noise-scale statistics; gain 1; the learning rate is `step_settings::lr`.
struct no_adascale {
  static constexpr policy_slot slot = policy_slot::adapt;  ///< fills the adapt slot
};

/// Adapt slot: the data-parallel gradient noise scale (McCandlish et al. 2018, appendix A.1)
/// measured from every synchronous step's gradient allreduce, and the AdaScale gain
/// (Johnson et al., ICML 2020) derived from it:
///
///     S = N · local_batch · accumulation_steps / base_batch        (AdaScale's scale, >= 1)
///     σ² = tr(Σ) / base_batch,  r = (σ² + |G|²) / (σ²/S + |G|²) ∈ [1, S]
///     lr_step = lr · r   (or lr · √r with sqrt_gain),   τ ← τ + r
///
/// S follows the batch: a hook that changes `step_settings::local_batch` changes S, and the
/// step reports it through `on_rescale`. With one rank no noise-scale sample exists (one batch
/// size cannot separate noise from signal), so r = 1.
///
/// | name       | type                         | default  | meaning                          |
/// |------------|------------------------------|----------|----------------------------------|
/// | base_batch | double                       | required | B_0 (examples, > 0)              |
/// | noise      | gradient_noise_scale_options | {}       | EMA smoothing of the estimates   |
/// | sqrt_gain  | bool                         | false    | lr factor √r (AdaptDL AdamScale) |
/// | scale_lr   | bool                         | true     | false: report r and τ, step at η |
struct adascale_policy {
  static constexpr policy_slot slot = policy_slot::adapt;  ///< fills the adapt slot
  double base_batch = 0.0;                                 ///< B_0 (> 0, required)
  gradient_noise_scale_options noise = {};                 ///< smoothing of the noise-scale EMAs
  bool sqrt_gain = false;                                  ///< lr factor √r instead of r
  bool scale_lr = true;                                    ///< multiply the learning rate by the gain factor
};

/// Precondition slot, off: the optimizer steps on the combined gradients as they are.
struct no_preconditioner {
  static constexpr policy_slot slot = policy_slot::precondition;  ///< fills the precondition slot
};

/// The bound form of precondition policy P: `std::move(p).bind(comm, backend, params)` (P may
/// own move-only state, e.g. K-FAC's factors, which move into the step).
template <class P, class Comm, class B, class PL>
using bound_preconditioner_t = decltype(std::declval<P&&>().bind(
    std::declval<Comm&>(), std::declval<const B&>(), std::declval<const PL&>()));

/// The precondition slot's contract. A precondition policy P declares `static constexpr
/// policy_slot slot = policy_slot::precondition` and `bind(comm, backend, params) &&`, called
/// once when the step is built (after the ranks agreed on the parameter list; an error it
/// throws on any rank is thrown on every rank). The step calls the bound preconditioner c on
/// every rank:
///
///     c.precondition(comm, backend, params.grads(), lr);  // after the combine: rewrites the
///                                                        // combined gradients in place; lr is
///                                                        // the one the optimizer steps at
///     c.discard();                                       // on a skipped (overflow) step instead
///
/// Optional: `agreed_options(agreed_list<64>&) const` on P (values every rank must pass equal,
/// checked with the step's construction agreement), and `save`/`load` on c (`saves_state`):
/// its state in the step's checkpoint, section "precondition". The preconditioner sees the
/// same combined gradient on every rank, so it cannot be combined with `local_sgd_policy`
/// (a compile-time error).
template <class P, class Comm, class B, class PL>
concept precondition_policy = policy<P> && policy_traits<std::remove_cvref_t<P>>::slot ==
                              policy_slot::precondition&& requires(bound_preconditioner_t<P, Comm, B, PL>& c,
                                                                   Comm& comm, const B& b, const PL& params) {
  c.precondition(comm, b, params.grads(), 1.0);
  c.discard();
};

/// Sync slot, off: every step combines gradients.
struct no_local_sgd {
  static constexpr policy_slot slot = policy_slot::sync;  ///< fills the sync slot
};

/// Sync slot: local SGD with a synchronous start (`gradapt::local_sgd`). Steps before
/// `options.start_step` combine gradients; later steps are local and the parameters are
/// averaged over the ranks when `schedule` says so (fixed_period, adaptive_period,
/// hierarchical_period). With `fixed_period`, a hook may change the period at run time through
/// `step_settings::period`. During local steps the noise scale is not updated and the AdaScale
/// gain is 1 (a local step is one base step).
template <averaging_schedule S>
struct local_sgd_policy {
  static constexpr policy_slot slot = policy_slot::sync;  ///< fills the sync slot
  local_sgd_options options{};                            ///< start_step, list check
  S schedule{};                                           ///< when to average
};
/// Deduces the schedule type: `local_sgd_policy{{.start_step = 100}, gradapt::fixed_period({.period = 8})}`.
template <averaging_schedule S>
local_sgd_policy(local_sgd_options, S) -> local_sgd_policy<S>;

/// State slot, the default: every rank holds the optimizer's whole state and steps every
/// parameter (plain data parallelism).
struct replicated_state {
  static constexpr policy_slot slot = policy_slot::state;  ///< fills the state slot
};

/// State slot: the optimizer state sharded over the ranks (`shard::sharded_optimizer`; ZeRO,
/// Rajbhandari et al. 2020). Each rank keeps the state (and master values) of its shard of the
/// elements: the gradients are reduce-scattered and averaged, each rank steps its shard, the
/// parameters are allgathered. The same bits as the replicated step on the same gradients (see
/// docs/algorithms/sharded-state.md for the partition rules a chain needs: Adafactor and SM3
/// need `granularity::tensor`).
///
/// - `zero_state<1>`: the reduce-scatter runs inside `step()`.
/// - `zero_state<2>`: the framework calls `data_parallel_step::mark_ready(t)` as each gradient
///   is produced during the backward pass; full buckets are reduce-scattered at once (their
///   gradient buffers are then free: `released(t)`) and `step()` finishes the step.
template <int Stage>
struct zero_state {
  static_assert(Stage == 1 || Stage == 2,
                "train::zero_state<Stage>: Stage is 1 (sharded optimizer state) or 2 (and gradients "
                "reduce-scattered bucket by bucket during the backward pass); stage 3 (sharded "
                "parameters) is not offered");
  static constexpr policy_slot slot = policy_slot::state;  ///< fills the state slot
  static constexpr int stage = Stage;                      ///< the ZeRO stage
  /// The partition, round and bucket options (their defaults: element granularity cut at
  /// multiples of 4096 elements, 2^20-element rounds, DDP's bucket sizes).
  shard::sharded_options sharding{};
  /// False (default): building the step throws, on every rank, when the partition leaves a
  /// rank without elements (a small model at the default 4096-element alignment on many ranks);
  /// true accepts such ranks (they hold no state and step nothing).
  bool allow_empty_shards = false;
};

/// Reduce slot, the default: the combine slot's combiner runs over all gradients at `step()`.
struct one_buffer_reduce {
  static constexpr policy_slot slot = policy_slot::reduce;  ///< fills the reduce slot
};

/// Reduce slot: the gradients averaged bucket by bucket as the backward pass produces them
/// (`bucket::reducer`, PyTorch DDP's Reducer): the framework calls
/// `data_parallel_step::mark_ready(t)` for each gradient, in any order (different per rank);
/// each full bucket is reduced at once (over `comm::mpi` with a non-blocking allreduce that
/// overlaps the rest of the backward pass) and `step()` completes the rest. With the
/// replicated state; `zero_state<2>` has buckets of its own.
struct bucket_reduce {
  static constexpr policy_slot slot = policy_slot::reduce;  ///< fills the reduce slot
  bucket::bucket_options buckets{};                         ///< bucket sizes (DDP's defaults)
  bool overlap = true;  ///< start buckets without waiting where the communicator can (MPI)
};

/// Reduce slot: Horovod's hierarchical allreduce (`comm::hierarchy`): the world cut into equal
/// groups (the ranks of one host, or `hierarchy.group_size` consecutive ranks), each gradient
/// reduce-scattered inside its group, its block allreduced across the groups and allgathered
/// inside the group, so that only 1/L of the buffer (L ranks per group) crosses groups; then
/// divided by the rank count. With the replicated state and the mean (`allreduce_mean`), on
/// any communicator with `split` (comm::threads, comm::mpi, comm::nccl). The sum's order is the hierarchy's
/// (groups, then across them), not the flat allreduce's: the same bits on every rank, and a flat reduction's
/// bits where every partial sum is exact.
struct hierarchical_reduce {
  static constexpr policy_slot slot = policy_slot::reduce;  ///< fills the reduce slot
  comm::hierarchy_options hierarchy{};                      ///< the groups (agreed across ranks)
};

// ---- settings, metrics, hook events ------------------------------------------------------------

/// What a hook may change. Values must be equal on every rank (hooks run on every rank and see
/// the same metrics, so a deterministic hook keeps them equal). Changes made in `before_step`
/// apply to the step being taken; changes made in `after_step` or `on_overflow` apply from the
/// next step.
struct step_settings {
  /// Base learning rate η (finite, >= 0). The optimizer steps at η × the AdaScale factor; a
  /// schedule written for the base batch is followed by setting η = schedule(progress) in
  /// `before_step` (progress is AdaScale's τ, or the optimizer step count without AdaScale).
  double lr = 1e-3;
  /// Examples in one micro-batch on one rank (> 0). Read by the noise scale and by AdaScale's
  /// S; ignored without `adascale_policy`.
  double local_batch = 1.0;
  /// Micro-batches accumulated into one step's gradient (>= 1).
  int accumulation_steps = 1;
  /// LocalSGD period K (local steps between averaging rounds) when the sync slot holds a
  /// `local_sgd_policy<fixed_period>`; 0 otherwise. A hook that sets another value changes the
  /// period from the next round on.
  std::int64_t period = 0;
  /// Heterogeneous batches: examples in one micro-batch on each rank, in rank order (one
  /// finite value > 0 per rank), or empty for `local_batch` on every rank. When set, the
  /// combine forms the mean weighted by the ranks' examples, Σ_r b_r g_r / Σ_r b_r, and the
  /// noise scale and AdaScale's S count Σ_r b_r (see train-step.md, "Heterogeneous batches");
  /// it needs the default combiner (allreduce_mean). `local_batch` is then not read.
  std::vector<double> rank_batches{};
  /// With a `local_sgd_policy` in the sync slot: true combines the gradients at every step
  /// and pauses LocalSGD (no local steps, no averaging rounds, its counters unchanged); false
  /// follows its schedule. Without LocalSGD every step is synchronous and this is not read.
  bool synchronous = false;
};

/// What one step did (passed to `after_step` and `on_overflow`; the previous step's metrics
/// are passed to `before_step`). Identical on every rank.
struct step_metrics {
  std::uint64_t step = 0;             ///< calls of step() so far, this one included (taken + skipped)
  std::uint64_t optimizer_steps = 0;  ///< steps the optimizer has taken (skipped steps excluded)
  /// The mean over the ranks of `step_args::loss` (summed in rank order, then divided by the
  /// number of ranks), identical on every rank: NaN when some rank gave no loss or a NaN.
  double loss = std::numeric_limits<double>::quiet_NaN();
  double loss_scale = 1.0;  ///< loss scale for the NEXT backward pass (after this step's update)
  double noise_scale = std::numeric_limits<double>::quiet_NaN();  ///< B_simple; NaN while undefined
  double gain = 1.0;         ///< AdaScale gain r of this step (1 when off, skipped or local)
  double lr = 0.0;           ///< learning rate the optimizer used (0 on a skipped step)
  double progress = 0.0;     ///< τ after the step (optimizer steps without AdaScale)
  double scale = 1.0;        ///< AdaScale's S for this step (1 without AdaScale)
  bool found_inf = false;    ///< some rank's gradient was not finite: the step was skipped
  bool stepped = false;      ///< the optimizer stepped
  bool synchronous = false;  ///< the gradients were combined across ranks this step
  bool averaged = false;     ///< LocalSGD averaged the parameters after this step
  /// Examples behind this step's gradient over all ranks: Σ_r b_r × accumulation_steps, with
  /// b_r = step_settings::rank_batches[r], or local_batch on every rank.
  double global_batch = 0.0;
  /// Bytes of optimizer state on this rank (the chain's state buffers, and master values when
  /// kept): the whole state with `replicated_state`, this rank's shard with `zero_state`. Not
  /// in the checkpoint (set again by every step and by load); differs by rank under ZeRO.
  std::uint64_t state_bytes = 0;

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(step_metrics, step, optimizer_steps, loss, loss_scale, noise_scale, gain,
                                  lr, progress, scale, found_inf, stepped, synchronous, averaged);
  }
};

/// The AdaScale scale changed (the batch changed): S went from `old_scale` to `new_scale`
/// before step `step` (1-based).
struct rescale_event {
  double old_scale = 1.0;  ///< S before the change
  double new_scale = 1.0;  ///< S from this step on
  std::uint64_t step = 0;  ///< the step (1-based) that runs at new_scale
};

// ---- hook detection ---------------------------------------------------------------------------

/// The events the step raises (core/hooks.hpp: a hook handles an event with the member of the
/// event's name, taking the listed arguments).
namespace events {
/// `h.before_step(settings, last_metrics)`: before the step, after the previous step's metrics.
GRADAPT_HOOK_EVENT(before_step, step_settings&, const step_metrics&);
/// `h.after_step(settings, metrics)`: after every step, taken or skipped.
GRADAPT_HOOK_EVENT(after_step, step_settings&, const step_metrics&);
/// `h.on_overflow(settings, metrics)`: a step was skipped because a gradient was not finite
/// (before `after_step`; `metrics.loss_scale` is already backed off).
GRADAPT_HOOK_EVENT(on_overflow, step_settings&, const step_metrics&);
/// `h.on_rescale(settings, event)`: AdaScale's S changed because the batch changed.
GRADAPT_HOOK_EVENT(on_rescale, step_settings&, const rescale_event&);
}  // namespace events

/// Every event of the step, in the order a step meets them.
using step_events =
    event_set<events::before_step, events::on_rescale, events::on_overflow, events::after_step>;

/// A hook: an object (or a std::reference_wrapper to one) that handles at least one of the
/// step's events (`hook_for`, core/hooks.hpp, the concept elastic::job_policy also uses;
/// `handles<H, events::before_step>` asks about one event).
template <class H>
concept step_hook = hook_for<H, step_events>;

namespace detail {

using gradapt::detail::fail;
using gradapt::detail::message;
using gradapt::detail::require;

/// Which slot a value passed to the factory fills.
enum class slot : unsigned char { scaler, combine, adapt, sync, precondition, state, reduce, hook, none };

template <class T>
constexpr slot slot_of() {
  if constexpr (policy<T>) {
    switch (policy_traits<T>::slot) {
      case policy_slot::scaler:
        return slot::scaler;
      case policy_slot::combine:
        return slot::combine;
      case policy_slot::adapt:
        return slot::adapt;
      case policy_slot::sync:
        return slot::sync;
      case policy_slot::precondition:
        return slot::precondition;
      case policy_slot::state:
        return slot::state;
      case policy_slot::reduce:
        return slot::reduce;
    }
    return slot::none;
  } else {
    return step_hook<T> ? slot::hook : slot::none;
  }
}

template <class T>
inline constexpr slot slot_v = slot_of<std::remove_cvref_t<T>>();

}  // namespace detail
}  // namespace gradapt::train

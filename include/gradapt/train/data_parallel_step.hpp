#pragma once
/// @file
/// `gradapt::train::data_parallel_step`: one data-parallel training step composed from the
/// library's policies, for users who want the whole recipe rather than the stages one by one.
///
/// After the framework's backward pass, one call of `step()` runs, on every rank:
///
///  0. agreement: one small allreduce checks the step number, the learning rate and the
///              settings on every rank, and shares each rank's time-to-ready
///              (`step_args::ready_seconds`) and previous step time (`rank_times()`,
///              `rank_step_seconds()`);
///
///  1. scaler:  g ← g / S_loss and the overflow check agreed by all ranks
///              (`loss_scaler::unscale`); an overflow skips the step (optimizer step count,
///              AdaScale progress and LocalSGD counters unchanged) and backs S_loss off;
///  2. combine: g ← (1/N) Σ_r g_r (`allreduce_mean`; with AdaScale on, through
///              `allreduce_with_norms`, which also yields Σ_r |g_r|² and |Σ_r g_r|²), or
///              g ← Adasum_r(g_r) (`adasum_combine`); skipped on LocalSGD's local steps
///              (unless `step_settings::synchronous` pauses LocalSGD). With
///              `step_settings::rank_batches` the mean is weighted by the ranks' examples;
///  3. adapt:   noise-scale update (McCandlish et al. 2018) from those norms, AdaScale gain
///              r = (σ² + |G|²)/(σ²/S + |G|²) and progress τ ← τ + r (Johnson et al. 2020);
///  4. precondition: the combined gradients rewritten in place at lr = η · r (or η · √r),
///              η = `step_settings::lr` (`kfac_policy`: `kfac::step(comm, ...)`, whose KL
///              clipping takes that lr); on a skipped step the preconditioner discards what was
///              collected for it (K-FAC's accumulated a and g terms);
///  5. optimizer step at that lr;
///  6. sync:    LocalSGD counts the step and averages the parameters when its schedule says so.
///
/// Each stage is a slot (see train/policies.hpp) whose policy is chosen by the values passed
/// to `make_data_parallel_step`; a slot left out compiles to nothing. Hooks passed to the
/// factory watch the metrics and change the settings (learning rate, batch, LocalSGD period).
///
///     auto step = gradapt::train::make_data_parallel_step(
///         comm, backend, params, gradapt::lamb({.weight_decay = 0.01}),
///         {.lr = 1e-3, .local_batch = 32},
///         gradapt::loss_scaler({.init_scale = 65536}),
///         gradapt::train::adascale_policy{.base_batch = 32},
///         my_schedule_hook{});
///     for (...) {
///       backward(loss * step.loss_scale());     // the framework's own backward pass
///       const auto& m = step.step({.loss = loss});  // gradapt::step_args
///     }
///
/// The step owns the optimizer state and the policies; it references (never copies) the
/// communicator and the parameter list, which must outlive it. Checkpoints: `save()` writes the
/// whole step's state (settings, counters, optimizer state, scaler, noise scale, AdaScale,
/// LocalSGD, the preconditioner's state, and a combiner's or hook's own state) into one byte
/// vector and `load()` restores it exactly; the parameters themselves are the framework's and
/// are saved by it.

#include <array>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/stage.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/stats/allreduce_with_norms.hpp"
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

/// Fingerprint of a list's tensor sizes (below 2^50, exact in a double).
template <class L>
double fingerprint(const L& list) {
  std::uint64_t h = 1469598103ULL;
  std::uint64_t t = 0;
  for (const auto& v : list) {
    h = (h * 1099511ULL + (++t) * 7919ULL + static_cast<std::uint64_t>(v.size())) % (std::uint64_t{1} << 50);
  }
  return static_cast<double>(h);
}

template <class H>
decltype(auto) unwrap(H& h) {
  if constexpr (std::is_same_v<std::unwrap_reference_t<H>, H>)
    return (h);
  else
    return h.get();
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

/// One data-parallel step composed from policies; build it with `make_data_parallel_step`
/// (the template arguments are deduced from the policies and hooks passed there).
///
/// @tparam Comm   communicator (comm::single, comm::threads, comm::mpi), host memory
/// @tparam B      backend (gradapt::host)
/// @tparam PL     the parameter list type (gradapt::param_list<V, G>)
/// @tparam Opt    optimizer with the chain interface (`step_optimizer`)
/// @tparam Scaler no_loss_scaling | gradapt::loss_scaler
/// @tparam Combine allreduce_mean | adasum_combine | a user's `combine_policy`
/// @tparam Adapt  no_adascale | adascale_policy
/// @tparam Sync   no_local_sgd | local_sgd_policy<Schedule>
/// @tparam Hooks  std::tuple of hook objects, called in the order they were passed
/// @tparam Precond no_preconditioner | kfac_policy<State> | a user's `precondition_policy`
/// @tparam StateP replicated_state | zero_state<1> | zero_state<2>
/// @tparam ReduceP one_buffer_reduce | bucket_reduce
///
/// Construction is collective: the ranks agree with one small allreduce that they hold the
/// same number of tensors with the same sizes (every rank throws the same gradapt::error
/// otherwise), a preconditioner's binding is checked with a second one (an error on one rank,
/// such as a K-FAC mapping that does not fit, is thrown on every rank), and an Adasum policy
/// in hierarchical mode splits the communicator. `step()` is
/// collective. Hooks run on every rank with identical metrics and must act identically (a
/// hook that throws on one rank only leaves the others in a collective: comm::threads then
/// aborts them with comm::peer_failure). The steady-state step allocates nothing beyond what
/// hooks do. Device memory (CUDA/NCCL) is not wired here yet: call the stages one by one.
template <class Comm, class B, class PL, class Opt, class Scaler, class Combine, class Adapt, class Sync,
          class Hooks, class Precond = no_preconditioner, class StateP = replicated_state,
          class ReduceP = one_buffer_reduce>
class data_parallel_step {
 public:
  using comm_type = Comm;      ///< the communicator
  using backend_type = B;      ///< the backend
  using params_type = PL;      ///< the parameter list
  using optimizer_type = Opt;  ///< the optimizer
  /// The ZeRO stage of the state slot (0: `replicated_state`).
  static constexpr int zero_stage = detail::zero_stage_v<StateP>;
  /// The state slot holds a `zero_state`: the optimizer state is sharded over the ranks.
  static constexpr bool has_sharded_state = zero_stage != 0;
  /// The reduce slot holds `bucket_reduce`: gradients reduced bucket by bucket as they are marked.
  static constexpr bool has_buckets = std::is_same_v<ReduceP, bucket_reduce>;
  /// The framework marks each gradient ready during its backward pass (`mark_ready`):
  /// `zero_state<2>` or `bucket_reduce`.
  static constexpr bool marks_gradients = zero_stage == 2 || has_buckets;
  /// What Opt::init returns, or with `zero_state` this rank's `shard::sharded_state`.
  using optimizer_state_type = typename detail::state_of<has_sharded_state, Opt, Comm, B, PL>::type;
  using value_type = typename PL::value_type;                      ///< parameter element type
  using grad_type = typename PL::grad_type;                        ///< gradient element type
  using schedule_type = typename detail::schedule_of<Sync>::type;  ///< LocalSGD schedule (sync slot on)
  using hooks_type = Hooks;                                        ///< std::tuple of the hooks

  /// The scaler slot holds a loss_scaler.
  static constexpr bool has_loss_scaling = std::is_same_v<Scaler, loss_scaler>;
  /// The combine slot holds a combiner other than allreduce_mean (adasum_combine, a user's).
  static constexpr bool has_custom_combine = !std::is_same_v<Combine, allreduce_mean>;
  /// The combine slot's policy bound to the communicator (`bind_combiner`).
  using combiner_type = bound_combiner_t<Combine, Comm, B, PL>;
  /// The adapt slot holds adascale_policy.
  static constexpr bool has_adascale = std::is_same_v<Adapt, adascale_policy>;
  /// The sync slot holds a local_sgd_policy.
  static constexpr bool has_local_sgd = !std::is_same_v<Sync, no_local_sgd>;
  /// The sync slot holds a local_sgd_policy<fixed_period> (step_settings::period is live).
  static constexpr bool has_settable_period = has_local_sgd && std::is_same_v<schedule_type, fixed_period>;
  /// The precondition slot holds a preconditioner (kfac_policy, a user's).
  static constexpr bool has_preconditioner = !std::is_same_v<Precond, no_preconditioner>;
  /// The precondition slot's policy bound to the step (`detail::nothing` when the slot is off).
  using preconditioner_type = typename detail::preconditioner_of<Precond, Comm, B, PL>::type;

  static_assert(communicator<Comm> && backend<B>,
                "train::data_parallel_step: Comm and B must model the concepts");
  static_assert(
      std::is_same_v<typename Comm::space, host_space> && std::is_same_v<typename B::space, host_space> &&
          std::is_same_v<typename PL::space, host_space>,
      "train::data_parallel_step runs on host memory (gradapt::host with comm::single, threads or "
      "mpi); on a device, call the stages (loss_scaler, adasum, gradient_noise_scale, adascale, the "
      "optimizer, local_sgd) one by one");
  static_assert(step_optimizer<Opt, B, PL>,
                "train::data_parallel_step: the optimizer needs the chain interface (init, step with "
                "step_args, a state with save/load/steps), e.g. gradapt::lamb, adamw, sgd, lars");
  static_assert(combine_policy<Combine, Comm, B, PL>,
                "train::data_parallel_step: the combine slot's policy must model train::combine_policy "
                "(a bound combiner with combine(comm, backend, grads))");
  static_assert(!has_adascale || mean_combiner<combiner_type, Comm, B, PL>,
                "train::data_parallel_step: adascale_policy needs the rank MEAN of the gradients and its "
                "norms for the noise scale (combine_mean_with_norms), which this combiner (adasum_combine "
                "or a user's) does not form; use allreduce_mean with AdaScale");
  static_assert(!has_preconditioner || precondition_policy<Precond, Comm, B, PL>,
                "train::data_parallel_step: the precondition slot's policy must model "
                "train::precondition_policy (bind(comm, backend, params) && returning an object with "
                "precondition(comm, backend, grads, lr) and discard())");
  static_assert((std::is_same_v<StateP, replicated_state> || has_sharded_state) &&
                    (std::is_same_v<ReduceP, one_buffer_reduce> || has_buckets),
                "train::data_parallel_step: the state slot holds replicated_state, zero_state<1> or "
                "zero_state<2>, and the reduce slot one_buffer_reduce or bucket_reduce");
  // The slot combinations that cannot work, each message naming both slots.
  static_assert(!((has_sharded_state || has_buckets) && has_custom_combine),
                "train::data_parallel_step: the state slot's zero_state and the reduce slot's bucket_reduce "
                "form the rank MEAN of the gradients (reduce-scattered, or bucket by bucket); the combine "
                "slot's adasum_combine (or a user's combiner) forms something else: use allreduce_mean "
                "with them, or replicated_state and one_buffer_reduce with this combiner");
  static_assert(!(has_local_sgd && (has_sharded_state || has_buckets || has_preconditioner)),
                "train::data_parallel_step: the sync slot's local_sgd_policy steps each replica alone on its "
                "local steps, with no combined gradient, while the state slot's zero_state (one state "
                "spread over the ranks), the reduce slot's bucket_reduce (every marked gradient reduced) "
                "and a precondition slot's policy (K-FAC averages its factors over the ranks) need the "
                "same combined gradient on every rank at every step: drop one of the two");
  static_assert(!(has_buckets && has_sharded_state),
                "train::data_parallel_step: the reduce slot's bucket_reduce averages whole gradients on "
                "every rank; the state slot's zero_state reduce-scatters them into shards: for buckets with "
                "sharded state use zero_state<2> (its sharding.buckets) without bucket_reduce");
  static_assert(!(has_sharded_state && has_preconditioner),
                "train::data_parallel_step: the precondition slot's policy (kfac_policy) rewrites the whole "
                "combined gradient on every rank, which the state slot's zero_state holds only as shards: "
                "use replicated_state with a preconditioner");

  /// Builds the step (collective; see the class comment). Prefer `make_data_parallel_step`.
  /// @throws gradapt::error when the parameter lists differ across ranks or are empty, a
  ///         setting or option is invalid, or AdaScale's initial scale is below 1
  data_parallel_step(Comm& comm, const B& b, const PL& params, Opt opt, step_settings settings, Scaler scaler,
                     Combine combine, Adapt adapt, Sync sync, Hooks hooks, Precond precond = Precond(),
                     StateP state = StateP(), ReduceP reduce = ReduceP())
      : comm_(&comm),
        backend_(b),
        params_(&params),
        opt_(std::move(opt)),
        scaler_(std::move(scaler)),
        settings_(settings),
        hooks_(std::move(hooks)) {
    agree_on_construction(adapt, sync, precond);
    tensors_ = params.size();
    total_ = params.total_elements();
    if constexpr (has_sharded_state) {
      sharded_.emplace(opt_, state.sharding);
      state_.emplace(sharded_->init(comm, backend_, params));  // collective; agrees the options
      check_empty_shards(state);
    } else {
      (void)state;
      state_ = opt_.init(backend_, params);
    }
    if constexpr (has_buckets) {  // collective: the ranks agree on the plan and options
      std::vector<bucket::tensor_info> infos(params.size());
      std::vector<tensor_view<grad_type, host_space>> grads(params.grads().begin(), params.grads().end());
      for (std::size_t t = 0; t < infos.size(); ++t) infos[t] = {grads[t].size(), dtype_of_v<grad_type>};
      reducer_.emplace(comm, bucket::bucket_plan::make(infos, reduce.buckets), std::move(grads),
                       bucket::reducer_options{.average = true, .overlap = reduce.overlap});
    } else {
      (void)reduce;
    }
    if constexpr (marks_gradients && has_loss_scaling) unscaled_.assign(params.size(), 0);
    combiner_.emplace(bind_combiner(combine, comm, backend_, params));
    if constexpr (has_preconditioner) {
      // A mapping error on one rank is thrown on every rank (the others name that rank).
      std::string bad;
      try {
        pre_.emplace(std::move(precond).bind(comm, backend_, params));
      } catch (const error& e) {
        bad = e.what();
      }
      agree_values(comm, "train::data_parallel_step (binding the preconditioner)",
                   std::span<const agreed_value>(), bad);
    } else {
      (void)precond;
    }
    if constexpr (has_adascale) {
      detail::require(std::isfinite(adapt.base_batch) && adapt.base_batch > 0.0,
                      "train::adascale_policy: base_batch is ", adapt.base_batch,
                      " (expected the positive number of examples the learning rate was tuned for)");
      adapt_.policy = adapt;
      check_batch("train::data_parallel_step");
      const double s0 = adascale_scale();
      check_scale(s0, "train::data_parallel_step");
      adapt_.gns = gradient_noise_scale(adapt.noise);
      adapt_.ada = adascale({.scale = s0, .sqrt_gain = adapt.sqrt_gain});
      last_.scale = s0;
    } else {
      (void)adapt;
    }
    if constexpr (has_local_sgd) {
      sync_.options = sync.options;
      sync_.schedule = sync.schedule;
      if constexpr (has_settable_period) {
        if (settings_.period == 0)
          settings_.period = sync.schedule.options().period;
        else
          sync_.schedule = with_period(settings_.period);
      }
      sync_.driver.emplace(comm, sync_.options, sync_.schedule);
    } else {
      (void)sync;
    }
    if constexpr (!has_settable_period)
      detail::require(settings_.period == 0, "train::data_parallel_step: step_settings::period is ",
                      settings_.period,
                      " but the sync slot holds no local_sgd_policy<fixed_period> (leave it 0)");
    check_lr("train::data_parallel_step");
    check_rank_batches("train::data_parallel_step");
    if constexpr (has_local_sgd) sync_.was_synchronous = settings_.synchronous;
    if constexpr (has_loss_scaling) last_.loss_scale = scaler_.scale();
  }

  /// Movable (the optimizer state and the workspaces move with it), not copyable.
  data_parallel_step(data_parallel_step&&) = default;
  /// Move assignment.
  data_parallel_step& operator=(data_parallel_step&&) = default;
  data_parallel_step(const data_parallel_step&) = delete;
  data_parallel_step& operator=(const data_parallel_step&) = delete;

  /// One step (collective). The gradients in the parameter list must hold this rank's
  /// gradient of its local batch, multiplied by `loss_scale()` when loss scaling is on; they
  /// are unscaled and combined in place, then the optimizer updates the parameters.
  /// @return the metrics of this step (also `metrics()`)
  /// @throws gradapt::error on invalid settings (naming the setting), a parameter list that
  ///         changed since construction, or an error of a stage (overflow at the minimum loss
  ///         scale, a list mismatch across ranks found by a collective)
  const step_metrics& step(const step_args& in = {}) {
    constexpr const char* fn = "train::data_parallel_step::step";
    detail::require(params_->size() == tensors_ && params_->total_elements() == total_, fn, " on rank ",
                    comm_->rank(), ": the parameter list now holds ", params_->size(), " tensors (",
                    params_->total_elements(), " elements) but the step was built for ", tensors_, " (",
                    total_, "); build a new step when the model changes");
    const auto entered = std::chrono::steady_clock::now();
    const double busy_before = busy_;
    busy_ = -1.0;  // this call's time, known at its end
    const std::uint64_t call = calls_ + 1;
    for_each_hook([&](auto& h) {
      if constexpr (before_step_hook<std::remove_reference_t<decltype(h)>>) h.before_step(settings_, last_);
    });
    const double eta = in.lr.value_or(settings_.lr);
    std::string bad;
    if (!(std::isfinite(eta) && eta >= 0.0))
      bad = detail::message(fn, " on rank ", comm_->rank(), ": ",
                            in.lr ? "step_args::lr" : "step_settings::lr", " is ", eta,
                            " (expected a finite learning rate >= 0; set by the caller or a hook)");
    const bool timed = !std::isnan(in.ready_seconds);
    if (timed && !(std::isfinite(in.ready_seconds) && in.ready_seconds >= 0.0) && bad.empty())
      bad = detail::message(fn, " on rank ", comm_->rank(), ": step_args::ready_seconds is ",
                            in.ready_seconds, " (expected finite seconds >= 0, or NaN when not measured)");
    agree_on_step(call, eta, timed ? in.ready_seconds : -1.0, busy_before, bad);
    apply_settings(call);

    step_metrics m;
    m.step = call;
    m.loss = in.loss;
    m.global_batch = global_batch();
    if constexpr (has_adascale) m.scale = adapt_.ada.scale();

    if constexpr (has_loss_scaling) {
      bool ok = false;
      if constexpr (marks_gradients) {  // unscaled gradient by gradient in mark_ready
        std::string missing;
        if (marks_ != tensors_)
          missing = detail::message(fn, " on rank ", comm_->rank(), ": ", marks_, " of ", tensors_,
                                    " gradients were marked ready before step() (",
                                    has_buckets ? "bucket_reduce" : "zero_state<2>",
                                    " needs mark_ready(t) for every gradient in every step)");
        ok = scaler_.decide(*comm_, nonfinite_, missing);
        nonfinite_ = 0.0;
        std::fill(unscaled_.begin(), unscaled_.end(), char{0});
        if (!ok) {  // the round ends without a step on every rank
          if constexpr (has_buckets)
            reducer_->wait();
          else
            sharded_->discard_round(*state_);
          local_sq_ = 0.0;
          marks_ = 0;
        }
      } else {
        ok = scaler_.unscale(backend_, *comm_, *params_);
      }
      m.loss_scale = scaler_.scale();
      if (!ok) {
        m.found_inf = true;
        if constexpr (has_preconditioner) pre_->discard();  // this step's collected terms
        return finish_step(m, call, entered);
      }
    }

    bool sync = true;
    bool paused = false;  // LocalSGD paused by step_settings::synchronous
    if constexpr (has_local_sgd) {
      sync = sync_.driver->sync_gradients();
      paused = settings_.synchronous && !sync;
      // Entering a pause in LocalSGD's local phase: the replicas may differ, so they are
      // averaged once (as a round would) before the synchronous steps.
      if (paused && !sync_.was_synchronous) average_models(*comm_, backend_, params_->values());
      sync_.was_synchronous = settings_.synchronous;
      sync = sync || paused;
    }
    m.synchronous = sync;
    if constexpr (has_sharded_state)
      reduce_sharded();
    else if constexpr (has_buckets)
      reduce_buckets();
    else if (sync)
      combine();

    double lr = eta;
    double gain = 1.0;
    if constexpr (has_adascale) {
      gain = sync ? adapt_.ada.advance(adapt_.gns, adapt_.policy.base_batch) : adapt_.ada.advance(0.0, 0.0);
      if (adapt_.policy.scale_lr) lr = eta * adapt_.ada.lr_factor(gain);
    }
    // The preconditioner sees the combined gradient (no local steps: see the static_assert) and
    // the lr the optimizer steps at (K-FAC's KL clipping bounds lr²·⟨V, M⟩ at that lr).
    if constexpr (has_preconditioner) pre_->precondition(*comm_, backend_, params_->grads(), lr);
    if constexpr (has_sharded_state)
      sharded_->step(*comm_, backend_, *params_, *state_, step_args{.lr = lr});
    else
      opt_.step(backend_, *params_, state_, step_args{.lr = lr});

    if constexpr (has_local_sgd) {
      if (!paused) {
        local_sgd_result res;
        if constexpr (schedule_type::uses_loss)
          res = sync_.driver->step(*comm_, backend_, local_sgd_input{.loss = in.loss, .lr = lr},
                                   params_->values());
        else
          res = sync_.driver->step(*comm_, backend_, params_->values());
        m.averaged = res.averaged;
      }
    } else {
      (void)paused;
    }

    m.stepped = true;
    check_replicas(m);
    m.gain = gain;
    m.lr = lr;
    return finish_step(m, call, entered);
  }

  /// The factor to multiply the loss by before the backward pass (1 without loss scaling).
  double loss_scale() const {
    if constexpr (has_loss_scaling)
      return scaler_.scale();
    else
      return 1.0;
  }

  /// The settings (learning rate, batch, period); changes apply at the next step.
  step_settings& settings() { return settings_; }
  /// The settings (read only).
  const step_settings& settings() const { return settings_; }
  /// The metrics of the latest step (default values before the first).
  const step_metrics& metrics() const { return last_; }
  /// Calls of step() so far (taken and skipped).
  std::uint64_t steps() const { return calls_; }
  /// Every rank's time-to-ready (step_args::ready_seconds) at the latest step, in rank order,
  /// the same on every rank (shared by the step's per-step agreement); empty when the ranks
  /// gave none.
  std::span<const double> rank_times() const { return rank_times_; }
  /// Every rank's time in seconds inside its previous call of step() (its collectives, its
  /// optimizer update and its waits for the other ranks), in rank order, the same on every
  /// rank; shared at the latest step, empty at the first step after construction or a load.
  std::span<const double> rank_step_seconds() const { return rank_busy_; }
  /// The communicator the step runs on.
  Comm& comm() const { return *comm_; }

  /// How often the replica check runs: on the first step that leaves the replicas identical
  /// and then every `every` such steps (0 turns it off). Default 1000: one extra read of the
  /// parameters per thousand steps. Every rank must set the same value.
  void set_replica_check_interval(std::uint64_t every) { replica_every_ = every; }
  /// The replica check interval (see set_replica_check_interval).
  std::uint64_t replica_check_interval() const { return replica_every_; }

  /// The optimizer (its options).
  const Opt& optimizer() const { return opt_; }
  /// The optimizer's state (moments etc.), e.g. for inspection or averaging.
  const optimizer_state_type& optimizer_state() const { return st(); }
  /// ZeRO stage 2 or `bucket_reduce`: gradient t of this rank is final for this step (call it
  /// during the backward pass, as the framework produces each gradient, in any order; every
  /// gradient once per step). Full buckets are reduced (reduce-scattered with ZeRO) at once, or
  /// started without waiting over `comm::mpi` with `bucket_reduce::overlap`; `step()` finishes
  /// the step. Collective per bucket: every rank marks every gradient before `step()`.
  /// @throws gradapt::error when t is out of range or already marked in this step
  /// With the loss scaler, the gradient is unscaled here (g ← g / S, its non-finite elements
  /// counted) before its bucket is reduced; `step()` agrees on the count (one allreduce, as
  /// `loss_scaler::unscale`) and skips the step on every rank after an overflow.
  void mark_ready(std::size_t t) requires marks_gradients {
    if constexpr (has_loss_scaling) {
      detail::require(t < tensors_, "train::data_parallel_step::mark_ready on rank ", comm_->rank(),
                      ": gradient ", t, " is out of range (", tensors_, " gradients)");
      detail::require(unscaled_[t] == 0, "train::data_parallel_step::mark_ready on rank ", comm_->rank(),
                      ": gradient ", t, " ('", (*params_)[t].name,
                      "') is already marked ready in this step (call step() to end it)");
      unscaled_[t] = 1;
      nonfinite_ += unscale_count_nonfinite(backend_, params_->grads().subspan(t, 1), scaler_.inv_scale());
    }
    if constexpr (has_adascale)
      if (t < tensors_) local_sq_ += backend_.reduce(reduction::sum_squares, (*params_)[t].grad);
    if constexpr (has_buckets)
      reducer_->mark_ready(t);
    else
      sharded_->mark_ready(*comm_, backend_, *params_, *state_, t);
    ++marks_;
  }
  /// ZeRO stage 2: gradient t's bucket has been reduce-scattered in this step, so its buffer
  /// is not read again before the next step and may be reused.
  bool released(std::size_t t) const requires(zero_stage == 2) { return state_->released(t); }
  /// Bytes of optimizer state on this rank (also `step_metrics::state_bytes`).
  std::uint64_t state_bytes() const {
    if constexpr (has_sharded_state)
      return state_->state_bytes();
    else if constexpr (requires { state_.state_elements(); })
      return state_.state_elements() * sizeof(typename optimizer_state_type::state_element);
    else
      return 0;
  }
  /// The loss scaler (scaler slot on).
  const loss_scaler& scaler() const requires has_loss_scaling { return scaler_; }
  /// The noise-scale estimator (adapt slot on).
  const gradient_noise_scale& noise_scale() const requires has_adascale { return adapt_.gns; }
  /// AdaScale's gain, scale and progress (adapt slot on).
  const adascale& ada_scale() const requires has_adascale { return adapt_.ada; }
  /// The LocalSGD driver (sync slot on).
  const local_sgd<Comm, schedule_type>& local() const requires has_local_sgd { return *sync_.driver; }
  /// The precondition slot's bound preconditioner (slot on). With `kfac_policy`, a
  /// `kfac_preconditioner`: ask `factor_update_due()` and call `accumulate` before `step()`.
  preconditioner_type& preconditioner() requires has_preconditioner { return *pre_; }
  /// The bound preconditioner (read only).
  const preconditioner_type& preconditioner() const requires has_preconditioner { return *pre_; }
  /// The combine slot's bound combiner (its state, e.g. an error-feedback residual).
  const combiner_type& combiner() const { return *combiner_; }
  /// The hooks, in the order they were passed.
  Hooks& hooks() { return hooks_; }
  /// The hooks (read only).
  const Hooks& hooks() const { return hooks_; }

  /// The whole state as one byte vector: a header (format, rank count, slots, parameter
  /// layout), the settings, the step counter and latest metrics, the optimizer state
  /// (`chain_state::save`), and the states of the loss scaler, noise scale, AdaScale,
  /// LocalSGD and the preconditioner (K-FAC's factors and decompositions) when those slots are
  /// on. Not collective. The parameters are not included (they are the framework's buffers;
  /// save them with the framework). With LocalSGD the replicas and
  /// their optimizer states differ between rounds: every rank saves its own.
  std::vector<std::byte> save() const {
    archive_writer w{archive_kind, archive_version};
    w.put("ranks", static_cast<std::uint64_t>(comm_->size()));
    w.put("slots", slot_mask());
    w.put("tensors", static_cast<std::uint64_t>(tensors_));
    w.put("elements", static_cast<std::uint64_t>(total_));
    w.begin("settings");
    w.put("lr", settings_.lr);
    w.put("local_batch", settings_.local_batch);
    w.put("accumulation_steps", static_cast<std::int64_t>(settings_.accumulation_steps));
    w.put("period", settings_.period);
    w.put("synchronous", settings_.synchronous);
    w.put_tensor("rank_batches", std::span<const double>(settings_.rank_batches));
    w.end();
    w.put("calls", calls_);
    put_metrics(w, last_);
    w.put("global_batch", last_.global_batch);
    w.begin("optimizer");
    if constexpr (has_sharded_state) {  // this rank's shard, as the sharded optimizer saves it
      const std::vector<std::byte> shard = state_->save(backend_);
      w.put("shard", std::string_view(reinterpret_cast<const char*>(shard.data()), shard.size()));
    } else {
      state_.save(backend_, w);
    }
    w.end();
    for_each_section(*this, [&](const char* section, const auto& st) { put_section(w, section, st); });
    return w.finish();
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.train_step";
  static constexpr std::uint32_t archive_version = 2;  ///< see archive_kind

  /// Restores, on this step's world of M ranks, a state written by `save()` of a step with the
  /// same slots, optimizer and parameter layout on any number N of ranks (Horovod Elastic's
  /// commit / restore): the optimizer state, the loss scale, the noise-scale estimates,
  /// AdaScale's progress, LocalSGD's counters, the preconditioner's state and the hooks' states
  /// move unchanged; the settings follow `rule`. Collective: every rank passes the same bytes
  /// (agreed by a hash, with the rule), so every rank resumes at the same step, or every rank
  /// throws. The next steps are those of a step on M ranks holding that state. All or nothing:
  /// on a throw the step's state is unchanged on every rank.
  /// @throws gradapt::error naming the first field that does not match, a rule that does not
  ///         apply (keep_global_batch with accumulation_steps × N not divisible by M; adascale
  ///         without the adapt slot), or ranks that passed other bytes or another rule
  void restore(std::span<const std::byte> bytes, rescale_rule rule) {
    static_assert(!has_sharded_state,
                  "train::data_parallel_step::restore: with zero_state the state is in every old rank's "
                  "checkpoint; pass them as restore(archive_source, rule)");
    const std::vector<std::byte> backup = save();
    std::string bad;
    try {
      load_impl(bytes, &rule);
    } catch (const error& e) {
      bad = e.what();
      load_impl(backup, nullptr);
    }
    agree_on_restore(bytes, rule, bad, [&] { load_impl(backup, nullptr); });
  }

  /// Old rank r's checkpoint (the bytes its `save()` wrote), for `restore(archive_source, rule)`.
  /// The bytes must stay valid until the next call.
  using archive_source = std::function<std::span<const std::byte>(int old_rank)>;

  /// Restores, on this step's world of M ranks, the checkpoints `save()` wrote on each of N
  /// ranks, for every state slot: `archive(r)` returns old rank r's bytes. With
  /// `replicated_state` it is `restore(archive(0), rule)`. With `zero_state` (any N, M, stage
  /// and sharding options) the step's own sections come from old rank 0's checkpoint, agreed
  /// across the ranks by a hash as above, and each new rank reads its new shard of the
  /// optimizer state from the old ranks' checkpoints that overlap it (old rank 0's for the
  /// plan, then only those), as `shard::sharded_optimizer::load` does. The continuation is
  /// then that of an M-rank run holding the same state. Collective and all or nothing: an error
  /// anywhere (a damaged or missing checkpoint of any old rank, checkpoints of different steps
  /// or world sizes, a rule that does not apply, the callback's own exception) is thrown on
  /// every rank, and every rank keeps its state.
  void restore(const archive_source& archive, rescale_rule rule) {
    if constexpr (has_sharded_state) {
      restore_sharded(archive, rule);
    } else {
      std::span<const std::byte> bytes;
      std::string bad;
      try {
        bytes = archive(0);
      } catch (const std::exception& e) {
        bad = detail::message("train::data_parallel_step::restore on rank ", comm_->rank(),
                              ": the archive source threw for old rank 0: ", gradapt::detail::without_prefix(e.what()));
      }
      if (bad.empty()) {
        restore(bytes, rule);
      } else {
        agree_on_restore({}, rule, bad, [] {});
      }
    }
  }

  /// Restores a state written by `save()` of a step with the same slots, optimizer, rank
  /// count and parameter layout; the following steps are then bit for bit those of the run
  /// that saved it (given the same parameters and gradients). Not collective; call it on
  /// every rank. All or nothing: on a throw the step's state is unchanged.
  /// @throws gradapt::error naming the first field that does not match
  ///
  /// With `zero_state` each rank's checkpoint holds its own shard: every rank loads its own
  /// checkpoint of the same step on the same world size and options, and load is collective
  /// (an error on one rank is thrown on every rank, and every rank keeps its state).
  void load(std::span<const std::byte> bytes) {
    if constexpr (has_sharded_state) {
      load_sharded(bytes);
      return;
    }
    // A damaged, truncated or foreign archive is rejected by the reader (checksum, kind,
    // version, index) before anything changes; only a later mismatch needs the backup.
    (void)archive_reader{bytes, archive_kind, archive_version};
    const std::vector<std::byte> backup = save();
    try {
      load_impl(bytes, nullptr);
    } catch (...) {
      load_impl(backup, nullptr);
      throw;
    }
  }

 private:
  static std::uint64_t slot_mask() {
    return (has_loss_scaling ? 1u : 0u) | (has_custom_combine ? 2u : 0u) | (has_adascale ? 4u : 0u) |
           (has_local_sgd ? 8u : 0u) | (has_preconditioner ? 16u : 0u) | (zero_stage == 1 ? 32u : 0u) |
           (zero_stage == 2 ? 64u : 0u) | (has_buckets ? 128u : 0u);
  }

  const optimizer_state_type& st() const {
    if constexpr (has_sharded_state)
      return *state_;
    else
      return state_;
  }

  // The partition is the same on every rank, so every rank finds the same empty ranks; the
  // ranks agree on allow_empty_shards (one small allreduce), so a rank that allows them and one
  // that does not both throw instead of one of them going on alone.
  void check_empty_shards(const StateP& o) const {
    const auto& plan = state_->plan();
    std::string empty, bad;
    int count = 0;
    for (int r = 0; r < plan.world(); ++r)
      if (plan.pieces(r).empty()) {
        if (count < 8) empty += (count ? ", " : "") + std::to_string(r);
        ++count;
      }
    if (count != 0 && !o.allow_empty_shards)
      bad =
          detail::message("train::data_parallel_step: zero_state leaves ", count, " of ", plan.world(),
                          " ranks without elements (ranks ", empty, count > 8 ? ", ..." : "", ") for ",
                          total_, " elements in ", tensors_, " tensors at partition_options::alignment ",
                          o.sharding.partition.alignment,
                          ": lower the alignment (a chain without per-tensor or global sums takes any), use "
                          "fewer ranks, or set zero_state::allow_empty_shards");
    agree_values(*comm_, "train::data_parallel_step",
                 {{"zero_state::allow_empty_shards", o.allow_empty_shards ? 1.0 : 0.0}}, bad);
  }

  template <class F>
  void for_each_hook(F&& f) {
    std::apply([&](auto&... h) { (f(detail::unwrap(h)), ...); }, hooks_);
  }
  template <class F>
  void for_each_hook(F&& f) const {
    std::apply([&](const auto&... h) { (f(detail::unwrap(h)), ...); }, hooks_);
  }
  static std::string hook_section(std::size_t i) {
    std::string s = "hook";
    s += std::to_string(i);
    return s;
  }

  double progress() const {
    if constexpr (has_adascale)
      return adapt_.ada.progress();
    else
      return static_cast<double>(st().steps());
  }

  double noise_scale_value() const {
    if constexpr (has_adascale) {
      const auto b = adapt_.gns.b_simple();
      if (b) return *b;
    }
    return std::numeric_limits<double>::quiet_NaN();
  }

  // The end of call `call`, taken or skipped (m.found_inf): completes m with the counters,
  // records it as the latest metrics, runs the overflow hooks (skipped) and then the
  // after-step hooks, and returns the recorded metrics.
  const step_metrics& finish_step(step_metrics& m, std::uint64_t call,
                                  std::chrono::steady_clock::time_point entered) {
    m.optimizer_steps = st().steps();
    m.state_bytes = state_bytes();
    m.progress = progress();
    m.noise_scale = noise_scale_value();
    calls_ = call;
    last_ = m;
    if (m.found_inf)
      for_each_hook([&](auto& h) {
        if constexpr (overflow_hook<std::remove_reference_t<decltype(h)>>) h.on_overflow(settings_, last_);
      });
    for_each_hook([&](auto& h) {
      if constexpr (after_step_hook<std::remove_reference_t<decltype(h)>>) h.after_step(settings_, last_);
    });
    busy_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - entered).count();
    return last_;
  }

  // Examples in one micro-batch over all ranks: Σ_r rank_batches[r], or N × local_batch.
  double micro_batch_sum() const {
    if (settings_.rank_batches.empty()) return static_cast<double>(comm_->size()) * settings_.local_batch;
    double sum = 0.0;
    for (const double b : settings_.rank_batches) sum += b;
    return sum;
  }
  double global_batch() const {
    return micro_batch_sum() * static_cast<double>(settings_.accumulation_steps);
  }
  double adascale_scale() const { return global_batch() / adapt_policy_base_batch(); }
  double adapt_policy_base_batch() const {
    if constexpr (has_adascale)
      return adapt_.policy.base_batch;
    else
      return 1.0;
  }

  void check_rank_batches(const char* fn) const {
    const auto& rb = settings_.rank_batches;
    if constexpr (marks_gradients)
      detail::require(
          rb.empty(), fn, ": step_settings::rank_batches is set but ",
          has_buckets ? "the reduce slot holds bucket_reduce" : "the state slot holds zero_state<2>",
          ", which reduces the gradients during the backward pass, before step() could weight "
          "them: reduce at step() (one_buffer_reduce, zero_state<1>) with per-rank batch sizes");
    detail::require(rb.empty() || rb.size() == static_cast<std::size_t>(comm_->size()), fn,
                    ": step_settings::rank_batches holds ", rb.size(), " batch sizes but the world has ",
                    comm_->size(),
                    " ranks (one per rank in rank order, or empty for local_batch everywhere)");
    for (std::size_t r = 0; r < rb.size(); ++r)
      detail::require(std::isfinite(rb[r]) && rb[r] > 0.0, fn, ": step_settings::rank_batches[", r, "] is ",
                      rb[r], " (expected the positive number of examples in rank ", r, "'s micro-batch)");
    if constexpr (has_custom_combine)
      detail::require(rb.empty(), fn,
                      ": step_settings::rank_batches is set but the combine slot holds a combiner other than "
                      "allreduce_mean, which cannot weight the ranks by their batches (leave rank_batches "
                      "empty or combine with allreduce_mean)");
  }

  void check_batch(const char* fn) const {
    check_rank_batches(fn);
    detail::require(settings_.accumulation_steps >= 1, fn, ": step_settings::accumulation_steps is ",
                    settings_.accumulation_steps, " (expected >= 1 micro-batches per step)");
    if (!settings_.rank_batches.empty()) return;
    detail::require(
        std::isfinite(settings_.local_batch) && settings_.local_batch > 0.0, fn,
        ": step_settings::local_batch is ", settings_.local_batch,
        " (expected the positive number of examples in one rank's micro-batch; set by the caller or a "
        "hook)");
  }

  void check_lr(const char* fn) const {
    detail::require(std::isfinite(settings_.lr) && settings_.lr >= 0.0, fn, ": step_settings::lr is ",
                    settings_.lr, " (expected a finite learning rate >= 0; set by the caller or a hook)");
  }

  void check_scale(double s, const char* fn) const {
    detail::require(
        std::isfinite(s) && s >= 1.0, fn, ": AdaScale's scale S = ranks ", comm_->size(), " x local_batch ",
        settings_.local_batch, " x accumulation_steps ", settings_.accumulation_steps, " / base_batch ",
        adapt_policy_base_batch(), " = ", s,
        " is below 1 (expected the step's batch to be at least the base batch: lower base_batch or "
        "raise the batch)");
  }

  fixed_period with_period(std::int64_t k) const requires has_settable_period {
    fixed_period_options o = sync_.schedule.options();
    o.period = k;
    return fixed_period(o);  // validates k >= 1
  }

  /// Replaces the LocalSGD driver by one whose fixed period is k, carrying its state: the next
  /// round is k local steps after the last one (or at the next step if that is already past).
  void change_period(std::int64_t k) requires has_settable_period {
    auto ck = sync_.driver->state();
    const std::uint64_t done = sync_.driver->local_steps();
    const fixed_period next = with_period(k);
    const std::uint64_t last = ck.schedule.next_due - sync_.schedule.period_of_round(ck.schedule.rounds);
    std::uint64_t due = last + next.period_of_round(ck.schedule.rounds);
    if (due <= done) due = done + 1;
    ck.schedule.next_due = due;
    sync_.schedule = next;
    sync_.driver.emplace(*comm_, sync_.options, sync_.schedule);
    sync_.driver->restore(ck);
  }

  /// Validates the settings after the before_step hooks and applies batch and period changes.
  void apply_settings(std::uint64_t call) {
    constexpr const char* fn = "train::data_parallel_step::step";
    check_rank_batches(fn);
    if constexpr (has_adascale) {
      check_batch(fn);
      const double s = adascale_scale();
      if (s != adapt_.ada.scale()) {
        check_scale(s, fn);
        const rescale_event e{adapt_.ada.scale(), s, call};
        adapt_.ada.set_scale(s);
        for_each_hook([&](auto& h) {
          if constexpr (rescale_hook<std::remove_reference_t<decltype(h)>>) h.on_rescale(settings_, e);
        });
      }
    }
    if constexpr (has_settable_period) {
      detail::require(settings_.period >= 1, fn, ": step_settings::period is ", settings_.period,
                      " (expected K >= 1 local steps between averaging rounds)");
      if (settings_.period != sync_.schedule.options().period) change_period(settings_.period);
    } else {
      detail::require(settings_.period == 0, fn, ": step_settings::period is ", settings_.period,
                      " but the sync slot holds no local_sgd_policy<fixed_period> (leave it 0)");
    }
    check_lr(fn);
  }

  /// The construction agreement (gradapt::agree_values, one small allreduce): the parameter
  /// list (tensor count, element count, a size fingerprint), which slots are on, the settings,
  /// the slot options and the optimizer's stage options (`agreed_options`) that must match, so
  /// that a rank built with another learning rate, momentum, batch, base batch or period
  /// throws with every other rank instead of drifting apart.
  template <class A, class Y, class P>
  void agree_on_construction(const A& adapt, const Y& sync, const P& precond) {
    agreed_list<64> v;
    v.push("parameter tensors", static_cast<double>(params_->size()));
    v.push("parameter elements", static_cast<double>(params_->total_elements()));
    v.push("parameter shapes (fingerprint)", detail::fingerprint(params_->grads()));
    v.push("loss scaling on", has_loss_scaling ? 1.0 : 0.0);
    v.push("adascale on", has_adascale ? 1.0 : 0.0);
    v.push("local sgd on", has_local_sgd ? 1.0 : 0.0);
    v.push("preconditioner on", has_preconditioner ? 1.0 : 0.0);
    v.push("state slot (0 replicated_state, 1 or 2 zero_state<stage>)", static_cast<double>(zero_stage));
    v.push("reduce slot bucket_reduce on", has_buckets ? 1.0 : 0.0);
    v.push("step_settings::lr", settings_.lr);
    v.push("step_settings::local_batch", settings_.local_batch);
    v.push("step_settings::accumulation_steps", static_cast<double>(settings_.accumulation_steps));
    v.push("step_settings::period", static_cast<double>(settings_.period));
    if constexpr (has_adascale) {
      v.push("adascale_policy::base_batch", adapt.base_batch);
      v.push("adascale_policy::sqrt_gain", adapt.sqrt_gain ? 1.0 : 0.0);
      v.push("adascale_policy::scale_lr", adapt.scale_lr ? 1.0 : 0.0);
    }
    if constexpr (has_local_sgd)
      v.push("local_sgd_options::start_step", static_cast<double>(sync.options.start_step));
    if constexpr (requires { opt_.agreed_options(v); }) opt_.agreed_options(v);
    if constexpr (requires { precond.agreed_options(v); }) precond.agreed_options(v);
    agree_values(*comm_, "train::data_parallel_step", v.view());
    detail::require(params_->size() > 0, "train::data_parallel_step on rank ", comm_->rank(),
                    ": the parameter list is empty (add the model's parameters before building the step)");
  }

  /// The per-step agreement (one small allreduce, before anything is unscaled or combined): the
  /// step number, this step's learning rate and the settings as the hooks left them, AdaScale's
  /// scale and the loss scale. `bad` is this rank's error for an invalid step_args::lr.
  ///
  /// The same allreduce shares two numbers of every rank (`agree_values_and_share`, 2N more
  /// words): its time-to-ready (`ready`, step_args::ready_seconds; -1 when not given) and the
  /// time it spent in the previous call of step() (`busy`; -1 before the first call).
  void agree_on_step(std::uint64_t call, double eta, double ready, double busy, const std::string& bad) {
    agreed_list<12> v;
    v.push("step", static_cast<double>(call));
    v.push("learning rate (step_args::lr or step_settings::lr)", bad.empty() ? eta : 0.0);
    v.push("step_settings::local_batch", settings_.local_batch);
    v.push("step_settings::accumulation_steps", static_cast<double>(settings_.accumulation_steps));
    v.push("step_settings::period", static_cast<double>(settings_.period));
    v.push("step_settings::synchronous", settings_.synchronous ? 1.0 : 0.0);
    v.push("step_settings::rank_batches (count)", static_cast<double>(settings_.rank_batches.size()));
    v.push(
        "step_settings::rank_batches (a 52-bit hash of the values)",
        static_cast<double>(gradapt::detail::hash_bytes(0x9E3779B97F4A7C15ull, settings_.rank_batches.data(),
                                                        settings_.rank_batches.size()) >>
                            12));
    v.push("step_args::ready_seconds given (1) or not (0)", ready >= 0.0 ? 1.0 : 0.0);
    if constexpr (has_adascale) v.push("AdaScale scale", adapt_.ada.scale());
    if constexpr (has_loss_scaling) v.push("loss scale", scaler_.scale());
    const double mine[2] = {ready, busy};
    shared_.resize(2 * static_cast<std::size_t>(comm_->size()));
    agree_values_and_share(*comm_, "train::data_parallel_step::step", v.view(), std::span<const double>(mine),
                           std::span<double>(shared_), bad, &agree_ws_);
    const auto n = static_cast<std::size_t>(comm_->size());
    rank_times_.clear();
    rank_busy_.clear();
    bool all_busy = true;
    for (std::size_t r = 0; r < n; ++r) all_busy = all_busy && shared_[2 * r + 1] >= 0.0;
    for (std::size_t r = 0; r < n && ready >= 0.0; ++r) rank_times_.push_back(shared_[2 * r]);
    for (std::size_t r = 0; r < n && all_busy; ++r) rank_busy_.push_back(shared_[2 * r + 1]);
  }

  /// The replica check: after a step that leaves the replicas identical (a synchronous step,
  /// or a LocalSGD averaging round), on the first such step and then every
  /// replica_check_interval() such steps, the sum of every parameter (in double, the backend's
  /// deterministic reduction) is agreed across ranks. Replicas that drifted apart (other
  /// optimizer options on one rank, a hook that changed something on one rank only, a
  /// combiner that returns different gradients) are an error on every rank.
  void check_replicas(const step_metrics& m) {
    if (replica_every_ == 0 || !(m.synchronous || m.averaged)) return;
    if (replica_checks_++ % replica_every_ != 0) return;
    const double sum = backend_.reduce(reduction::sum, params_->values(), std::span<double>());
    agree_values(*comm_, "train::data_parallel_step replica check",
                 {{"the sum of the parameters after the step (the replicas differ: optimizer options, a "
                   "hook or the combiner differ across ranks)",
                   sum}});
  }

  /// Stage 2 (and the statistics of stage 3): combine the gradients across the ranks through
  /// the combine slot's combiner.
  ///
  /// Heterogeneous batches (rank_batches set, N > 1): rank r first multiplies its gradient by
  /// c_r = N e_r / Σ_q e_q (e_r its examples), so the mean of the c_r g_r is the example-weighted
  /// mean Σ_r e_r g_r / Σ_r e_r. The noise scale then reads Σ_r |c_r g_r|² / Σ_r c_r², whose
  /// expectation is |G|² + tr(Σ)/B_small with B_small = Σ_r e_r² / Σ_r e_r, and |mean|², with
  /// B_big = Σ_r e_r (both unbiased two-batch inputs; equal batches give B_small = e).
  // With rank_batches: g_r ← c_r g_r, c_r = N e_r / Σ_s e_s, so that the mean of the c_r g_r is
  // the examples-weighted mean. Returns whether the batches are weighted and Σ_r c_r², Σ_r e_r².
  struct weights {
    bool weighted = false;
    double c2 = 0.0, e2 = 0.0;
  };
  weights weight_for_mean() {
    const int n = comm_->size();
    weights w;
    w.weighted = !settings_.rank_batches.empty() && n > 1;
    if (w.weighted) {
      const double sum = micro_batch_sum();
      for (const double b : settings_.rank_batches) {
        const double c = static_cast<double>(n) * b / sum;
        w.c2 += c * c;
        w.e2 += b * b;
      }
      const double mine =
          static_cast<double>(n) * settings_.rank_batches[static_cast<std::size_t>(comm_->rank())] / sum;
      if (mine != 1.0) backend_.apply_list(gradapt::detail::multiply_by{mine}, params_->grads());
    }
    return w;
  }

  // bucket_reduce: completes the buckets (the gradients then hold the rank mean). With AdaScale,
  // Σ_r |g_r|² from the marks (each gradient read as it was marked) and |ḡ|² from one read of
  // the averaged gradients, the local sums added over the ranks by one allreduce of a double.
  void reduce_buckets() {
    reducer_->wait();
    marks_ = 0;
    if constexpr (has_adascale) {
      const int n = comm_->size();
      double local = local_sq_;
      local_sq_ = 0.0;
      if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
      const double global = backend_.reduce(reduction::sum_squares, params_->grads(), std::span<double>());
      comm_->allreduce(tensor_view<double, host_space>::vector(&local, 1), reduce_op::sum);
      adapt_.gns.update_reduced(local / static_cast<double>(n), global, n,
                                noise_batch{.micro_batch = settings_.local_batch,
                                            .accumulation_steps = settings_.accumulation_steps,
                                            .loss_scale = 1.0});
    }
  }

  // zero_state: the sharded optimizer's reduction (its step then skips it). With AdaScale, the
  // noise scale's inputs come from this rank's local gradient (Σ g_r², taken at step() for
  // stage 1, gradient by gradient in mark_ready for stage 2) and its averaged gradient shard
  // (Σ ḡ² over the shard), added over the ranks by one allreduce of two doubles.
  void reduce_sharded() {
    marks_ = 0;
    [[maybe_unused]] const weights w = zero_stage == 1 ? weight_for_mean() : weights{};
    if constexpr (has_adascale) {
      const int n = comm_->size();
      if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
      double local = local_sq_;
      if constexpr (zero_stage == 1)
        local = backend_.reduce(reduction::sum_squares, params_->grads(), std::span<double>());
      local_sq_ = 0.0;
      sharded_->reduce(*comm_, backend_, *params_, *state_);
      double sums[2] = {local, sharded_->gradient_sum_squares(backend_, *state_)};
      comm_->allreduce(tensor_view<double, host_space>::vector(sums, 2), reduce_op::sum);
      if (w.weighted) {
        const double acc = static_cast<double>(settings_.accumulation_steps);
        adapt_.gns.update(sums[0] / w.c2, acc * w.e2 / micro_batch_sum(), sums[1], global_batch());
      } else {
        adapt_.gns.update_reduced(sums[0] / static_cast<double>(n), sums[1], n,
                                  noise_batch{.micro_batch = settings_.local_batch,
                                              .accumulation_steps = settings_.accumulation_steps,
                                              .loss_scale = 1.0});
      }
    }
  }

  void combine() {
    const int n = comm_->size();
    [[maybe_unused]] const auto [weighted, c2, e2] = weight_for_mean();
    if constexpr (has_adascale) {
      if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
      const allreduce_norms norms = combiner_->combine_mean_with_norms(*comm_, backend_, params_->grads());
      if (weighted) {
        const double acc = static_cast<double>(settings_.accumulation_steps);
        const double p = static_cast<double>(n);
        adapt_.gns.update(norms.sum_local_sq / c2, acc * e2 / micro_batch_sum(), norms.result_sq / (p * p),
                          global_batch());
      } else {
        adapt_.gns.update(norms, n,
                          noise_batch{.micro_batch = settings_.local_batch,
                                      .accumulation_steps = settings_.accumulation_steps,
                                      .loss_scale = 1.0});
      }
    } else {
      combiner_->combine(*comm_, backend_, params_->grads());
    }
  }

  // Calls f(section, component) for every component with a state section of its own, in
  // archive order: loss scaler, noise scale, AdaScale, LocalSGD, combiner, preconditioner, then
  // the hooks that save state ("hook0", "hook1", ... by position). `self` is *this, const for save().
  template <class Self, class F>
  static void for_each_section(Self& self, F&& f) {
    if constexpr (has_loss_scaling) f("loss_scaler", self.scaler_);
    if constexpr (has_adascale) {
      f("noise_scale", self.adapt_.gns);
      f("adascale", self.adapt_.ada);
    }
    if constexpr (has_local_sgd) f("local_sgd", *self.sync_.driver);
    if constexpr (saves_state<combiner_type>) f("combine", *self.combiner_);
    if constexpr (has_preconditioner && saves_state<preconditioner_type>) f("precondition", *self.pre_);
    std::size_t h = 0;
    self.for_each_hook([&](auto& hook) {
      if constexpr (saves_state<std::remove_cvref_t<decltype(hook)>>) f(hook_section(h).c_str(), hook);
      ++h;
    });
  }

  template <class State>
  static void put_section(archive_writer& w, const char* section, const State& st) {
    w.begin(section);
    st.save(w);
    w.end();
  }

  static void put_metrics(archive_writer& w, const step_metrics& m) {
    w.begin("metrics");
    put_fields(w, m, step_metrics::archive_fields());
    w.end();
  }
  static step_metrics get_metrics(archive_reader& r) {
    r.begin("metrics");
    const step_metrics m = get_fields(r, step_metrics::archive_fields());
    r.end();
    return m;
  }

  // Reads the archive into this step. Component loads validate their own sections and
  // commit one by one, so `load` restores a backup when anything throws.
  // With `resize`, a checkpoint of another rank count is accepted and the settings follow the rule.
  void load_impl(std::span<const std::byte> bytes, const rescale_rule* resize, std::string* shard = nullptr,
                 std::uint64_t* old_ranks = nullptr) {
    constexpr const char* fn = "train::data_parallel_step::load";
    archive_reader r{bytes, archive_kind, archive_version};
    const auto expect = [&](const char* field, const char* what, std::uint64_t want, const char* hint) {
      const auto got = r.get<std::uint64_t>(field);
      detail::require(got == want, fn, ": the checkpoint's ", what, " is ", got, " but this step's is ", want,
                      " (", hint, ")");
    };
    const auto saved_ranks = r.get<std::uint64_t>("ranks");
    const auto ranks = static_cast<std::uint64_t>(comm_->size());
    detail::require(resize || saved_ranks == ranks, fn, ": the checkpoint's rank count is ", saved_ranks,
                    " but this step's is ", ranks,
                    " (restore on as many ranks as saved, or resize with restore(bytes, rescale_rule))");
    detail::require(saved_ranks >= 1, fn, ": the checkpoint's rank count is 0");
    expect("slots",
           "slot mask (1 loss scaling, 2 a combiner other than allreduce_mean, 4 AdaScale, 8 LocalSGD, 16 "
           "a preconditioner, 32 zero_state<1>, 64 zero_state<2>, 128 bucket_reduce)",
           slot_mask(), "restore into a step built with the same policies");
    expect("tensors", "tensor count", static_cast<std::uint64_t>(tensors_),
           "restore for the same parameters");
    expect("elements", "element count", static_cast<std::uint64_t>(total_),
           "restore for the same parameters");
    step_settings s;
    r.begin("settings");
    s.lr = r.get<double>("lr");
    s.local_batch = r.get<double>("local_batch");
    s.accumulation_steps = r.get<int>("accumulation_steps");
    s.period = r.get<std::int64_t>("period");
    if (r.version() >= 2) {
      s.synchronous = r.get<bool>("synchronous");
      s.rank_batches = r.get_tensor<double>("rank_batches");
    }
    r.end();
    detail::require(std::isfinite(s.lr) && s.lr >= 0.0, fn, ": the checkpoint's learning rate is ", s.lr,
                    " (expected finite and >= 0)");
    detail::require(std::isfinite(s.local_batch) && s.local_batch > 0.0 && s.accumulation_steps >= 1, fn,
                    ": the checkpoint's batch settings are local_batch ", s.local_batch,
                    ", accumulation_steps ", s.accumulation_steps, " (expected finite > 0 and >= 1)");
    const auto calls = r.get<std::uint64_t>("calls");
    detail::require(calls < std::numeric_limits<std::uint64_t>::max(), fn, ": step counter ", calls,
                    " cannot grow");
    step_metrics m = get_metrics(r);
    if (r.version() >= 2) m.global_batch = r.get<double>("global_batch");
    detail::require(s.rank_batches.empty() || s.rank_batches.size() == saved_ranks, fn,
                    ": the checkpoint's rank_batches holds ", s.rank_batches.size(), " sizes for ",
                    saved_ranks, " ranks");
    for (const double b : s.rank_batches)
      detail::require(std::isfinite(b) && b > 0.0, fn, ": the checkpoint's rank_batches holds ", b,
                      " (expected finite sizes > 0)");
    if (resize) s = rescaled(s, *resize, saved_ranks, ranks);
    if constexpr (!has_settable_period)
      detail::require(s.period == 0, fn, ": the checkpoint's period is ", s.period,
                      " but this step has no fixed LocalSGD period");
    if constexpr (has_local_sgd && has_settable_period)
      detail::require(s.period >= 1, fn, ": the checkpoint's period is ", s.period, " (expected >= 1)");
    // Apply (component loads validate their own sections).
    r.begin("optimizer");
    if constexpr (has_sharded_state) {
      detail::require(shard != nullptr, fn, ": a sharded state loads through load()");
      *shard = r.get<std::string>("shard");  // loaded by load_sharded, collectively
    } else {
      state_.load(backend_, r);
    }
    r.end();
    if constexpr (has_local_sgd && has_settable_period) {
      if (s.period != sync_.schedule.options().period) {
        sync_.schedule = with_period(s.period);
        sync_.driver.emplace(*comm_, sync_.options, sync_.schedule);
      }
    }
    for_each_section(*this, [&](const char* section, auto& st) { load_section(r, section, st); });
    r.finish();
    settings_ = s;
    calls_ = calls;
    last_ = m;
    busy_ = -1.0;
    rank_times_.clear();
    rank_busy_.clear();
    if constexpr (has_local_sgd) sync_.was_synchronous = settings_.synchronous;
    if (old_ranks != nullptr) *old_ranks = saved_ranks;
    std::fill(unscaled_.begin(), unscaled_.end(), char{0});  // a load starts a step afresh
    nonfinite_ = 0.0;
    local_sq_ = 0.0;
    marks_ = 0;
  }

  // load() with zero_state: the step's own sections on each rank, agreed, then the optimizer
  // shard through the sharded optimizer's collective load; a failure anywhere restores the
  // backup on every rank and throws on every rank.
  void load_sharded(std::span<const std::byte> bytes) {
    constexpr const char* fn = "train::data_parallel_step::load";
    const std::vector<std::byte> backup = save();
    const auto undo = [&] {
      std::string ignored;
      load_impl(backup, nullptr, &ignored);
    };
    std::string shard, bad;
    try {
      load_impl(bytes, nullptr, &shard);
    } catch (const error& e) {
      bad = detail::message(fn, " on rank ", comm_->rank(), ": ", gradapt::detail::without_prefix(e.what()));
      undo();
    }
    try {
      agree_values(*comm_, fn, std::span<const agreed_value>(), bad);
    } catch (...) {
      if (bad.empty()) undo();
      throw;
    }
    const int me = comm_->rank();
    const std::span<const std::byte> mine(reinterpret_cast<const std::byte*>(shard.data()), shard.size());
    try {
      // This rank's checkpoint holds its own shard; on the same plan no other old rank's
      // shard overlaps this rank's, and old rank 0's archive is read only for the plan, which
      // every rank's archive holds.
      state_ = sharded_->load(*comm_, backend_, *params_, [&](int r) -> std::span<const std::byte> {
        detail::require(r == me || r == 0, fn, " on rank ", me,
                        ": the checkpoint's partition differs from this step's (old rank ", r,
                        "'s shard is needed); load a checkpoint saved with the same world size and "
                        "zero_state options, or restore(archive_source, rule) from every old rank's");
        return mine;
      });
    } catch (...) {
      undo();
      throw;
    }
    last_.state_bytes = state_bytes();
  }

  // restore's agreement: every rank passed the same checkpoint bytes and rule, or every rank
  // throws (`bad`: this rank's error; `undo` puts the state back where it was changed).
  template <class Undo>
  void agree_on_restore(std::span<const std::byte> bytes, rescale_rule rule, const std::string& bad, Undo undo) {
    // (Not the archive's CRC32C: a CRC over bytes that end with their own CRC is a constant.)
    const std::uint64_t hash = gradapt::detail::hash_bytes(0x9E3779B97F4A7C15ull, bytes.data(), bytes.size());
    try {
      agree_values(*comm_, "train::data_parallel_step::restore",
                   {{"checkpoint (a 52-bit hash of its bytes)", static_cast<double>(hash >> 12)},
                    {"checkpoint size in bytes", static_cast<double>(bytes.size())},
                    {"rescale rule", static_cast<double>(rule)}},
                   bad);
    } catch (...) {
      if (bad.empty()) undo();
      throw;
    }
  }

  // restore() with zero_state: the step's sections from old rank 0's checkpoint (agreed), then
  // the new shard through the sharded optimizer's collective load from the old ranks'
  // checkpoints that overlap it.
  void restore_sharded(const archive_source& archive, rescale_rule rule) {
    constexpr const char* fn = "train::data_parallel_step::restore";
    const std::vector<std::byte> backup = save();
    const auto undo = [&] {
      std::string ignored;
      load_impl(backup, nullptr, &ignored);
    };
    const int me = comm_->rank();
    std::vector<std::string> shards(1);
    std::span<const std::byte> first;
    std::string bad;
    std::uint64_t old_ranks = 0;
    try {
      first = archive(0);
      load_impl(first, &rule, shards.data(), &old_ranks);
    } catch (const std::exception& e) {  // also what the archive source throws
      bad = detail::message(fn, " on rank ", me, ": old rank 0's checkpoint: ", gradapt::detail::without_prefix(e.what()));
      undo();
      first = {};
    }
    agree_on_restore(first, rule, bad, undo);
    shards.resize(static_cast<std::size_t>(old_ranks));
    std::vector<char> read(shards.size(), char{0});
    read[0] = 1;
    try {
      state_ = sharded_->load(*comm_, backend_, *params_, [&](int r) -> std::span<const std::byte> {
        detail::require(r >= 0 && static_cast<std::uint64_t>(r) < old_ranks, fn, " on rank ", me,
                        ": old rank ", r, " is outside the checkpoint's world of ", old_ranks, " ranks");
        const auto i = static_cast<std::size_t>(r);
        if (read[i] == 0) {
          shards[i] = shard_in(archive(r), r, old_ranks);
          read[i] = 1;
        }
        return {reinterpret_cast<const std::byte*>(shards[i].data()), shards[i].size()};
      });
    } catch (...) {  // thrown on every rank by the sharded optimizer's agreement
      undo();
      throw;
    }
    last_.state_bytes = state_bytes();
  }

  // Old rank r's shard from its checkpoint, which must be of the same world size and step as
  // old rank 0's (already read into this step).
  std::string shard_in(std::span<const std::byte> bytes, int r, std::uint64_t old_ranks) const {
    constexpr const char* fn = "train::data_parallel_step::restore";
    std::uint64_t n = 0, calls = 0;
    std::string shard;
    try {
      archive_reader rd{bytes, archive_kind, archive_version};
      n = rd.get<std::uint64_t>("ranks");
      calls = rd.get<std::uint64_t>("calls");
      rd.begin("optimizer");
      shard = rd.get<std::string>("shard");
    } catch (const error& e) {
      detail::fail(fn, ": old rank ", r, "'s checkpoint: ", gradapt::detail::without_prefix(e.what()));
    }
    detail::require(n == old_ranks, fn, ": old rank ", r, "'s checkpoint was saved on ", n,
                    " ranks but old rank 0's on ", old_ranks, " (checkpoints of different runs)");
    detail::require(calls == calls_, fn, ": old rank ", r, "'s checkpoint is of step ", calls,
                    " but old rank 0's of step ", calls_, " (checkpoints of different steps)");
    return shard;
  }

  // The settings of a checkpoint of n ranks on m ranks under `rule`.
  static step_settings rescaled(step_settings s, rescale_rule rule, std::uint64_t n, std::uint64_t m) {
    constexpr const char* fn = "train::data_parallel_step::restore";
    if (n != m && !s.rank_batches.empty()) {
      // Per-rank sizes do not carry to another world: their mean becomes every rank's local
      // batch (the same global batch on n ranks), then the rule applies.
      double sum = 0.0;
      for (const double b : s.rank_batches) sum += b;
      s.local_batch = sum / static_cast<double>(n);
      s.rank_batches.clear();
    }
    switch (rule) {
      case rescale_rule::keep_global_batch: {
        const auto micro = static_cast<std::uint64_t>(s.accumulation_steps) * n;
        detail::require(micro % m == 0, fn, ": keep_global_batch: ", s.accumulation_steps,
                        " accumulation steps on ", n, " ranks are ", micro, " micro-batches per step, which ",
                        m,
                        " ranks cannot split evenly (choose linear_lr, sqrt_lr or adascale, or a world size "
                        "dividing ",
                        micro, ")");
        detail::require(micro / m <= static_cast<std::uint64_t>(std::numeric_limits<int>::max()), fn,
                        ": keep_global_batch: ", micro / m, " accumulation steps");
        s.accumulation_steps = static_cast<int>(micro / m);
        return s;
      }
      case rescale_rule::linear_lr:
        s.lr = s.lr * double(m) / double(n);
        return s;
      case rescale_rule::sqrt_lr:
        s.lr = s.lr * std::sqrt(double(m) / double(n));
        return s;
      case rescale_rule::adascale:
        detail::require(has_adascale, fn,
                        ": rescale_rule::adascale needs the adapt slot's adascale_policy (its gain follows "
                        "the new global batch); choose another rule");
        return s;
    }
    detail::fail(fn, ": rescale rule ", int(rule), " (expected a rescale_rule)");
  }

  template <class State>
  static void load_section(archive_reader& r, const char* section, State& st) {
    detail::require(!r.names(section).empty(), "train::data_parallel_step::load: the checkpoint has no ",
                    section, " state (written by a step with other policies?)");
    r.begin(section);
    st.load(r);
    r.end();
  }

  Comm* comm_;
  B backend_;
  const PL* params_;
  Opt opt_;
  /// The sharded optimizer (state slot zero_state).
  [[no_unique_address]] std::conditional_t<has_sharded_state, std::optional<shard::sharded_optimizer<Opt>>,
                                           detail::nothing>
      sharded_;
  /// zero_state<2> with the loss scaler: the gradients unscaled in this step (by mark_ready)
  /// and the non-finite elements counted.
  std::vector<char> unscaled_;
  double nonfinite_ = 0.0;
  double local_sq_ = 0.0;  ///< marks with AdaScale: Σ g² of the gradients marked so far
  std::size_t marks_ = 0;  ///< gradients marked ready in this step (zero_state<2>, bucket_reduce)
  /// The bucket reducer (reduce slot bucket_reduce).
  [[no_unique_address]] std::conditional_t<has_buckets, std::optional<bucket::reducer<Comm, grad_type>>,
                                           detail::nothing>
      reducer_;
  /// The optimizer state (with zero_state: this rank's shard, made by the collective init).
  std::conditional_t<has_sharded_state, std::optional<optimizer_state_type>, optimizer_state_type> state_;
  [[no_unique_address]] Scaler scaler_;
  std::optional<combiner_type> combiner_;  ///< bound after the ranks agree on the list
  /// The bound preconditioner (bound after the ranks agree on the list; slot on).
  [[no_unique_address]] std::conditional_t<has_preconditioner, std::optional<preconditioner_type>,
                                           detail::nothing>
      pre_;
  [[no_unique_address]] std::conditional_t<has_adascale, detail::adapt_runtime, detail::nothing> adapt_;
  [[no_unique_address]] std::conditional_t<has_local_sgd, detail::sync_runtime<Comm, schedule_type>,
                                           detail::nothing>
      sync_;
  step_settings settings_;
  step_metrics last_;
  std::uint64_t replica_every_ = 1000;  ///< see set_replica_check_interval
  std::uint64_t replica_checks_ = 0;    ///< steps eligible for the replica check so far
  std::uint64_t calls_ = 0;
  std::size_t tensors_ = 0;
  std::size_t total_ = 0;
  double busy_ = -1.0;                          ///< seconds in the latest call of step() (-1: none)
  std::vector<double> shared_;                  ///< the per-step agreement's shared words
  std::vector<double> agree_ws_;                ///< its allreduce words beyond 64
  std::vector<double> rank_times_, rank_busy_;  ///< see rank_times(), rank_step_seconds()
  Hooks hooks_;
};

/// Builds a `data_parallel_step` from an optimizer, the initial settings and any number of
/// policies and hooks, in any order: each policy fills its slot (at most one per slot; slots
/// left out are off), every other argument must be a hook (see `step_hook`).
///
///     auto step = gradapt::train::make_data_parallel_step(comm, backend, params, gradapt::sgd(),
///                                                         {.lr = 0.1});   // plain allreduce-mean SGD
///
/// Collective over `comm` (see data_parallel_step). `comm` and `params` must outlive the step.
template <communicator Comm, backend B, class PL, class Opt, class... Args>
auto make_data_parallel_step(Comm& comm, const B& backend, const PL& params, Opt optimizer,
                             step_settings settings, Args&&... args) {
  using detail::count_slot;
  using detail::slot;
  using detail::slot_v;
  static_assert(step_optimizer<Opt, B, PL>,
                "train::make_data_parallel_step: the fourth argument must be an optimizer with the chain "
                "interface (gradapt::sgd, adamw, lamb, lars, adafactor, sm3 or a gradapt::chain), "
                "e.g. gradapt::lamb({.lr = 1e-3}) rather than a gradapt::lamb_options");
  static_assert(
      (detail::at_most_one<slot::scaler, Args...>() && detail::at_most_one<slot::combine, Args...>() &&
       detail::at_most_one<slot::adapt, Args...>() && detail::at_most_one<slot::sync, Args...>() &&
       detail::at_most_one<slot::precondition, Args...>() && detail::at_most_one<slot::state, Args...>() &&
       detail::at_most_one<slot::reduce, Args...>()));
  static_assert(
      count_slot<slot::none, Args...> == 0,
      "train::make_data_parallel_step: an argument is neither a policy (no_loss_scaling, loss_scaler, "
      "allreduce_mean, adasum_combine, no_adascale, adascale_policy, no_local_sgd, local_sgd_policy, "
      "no_preconditioner, kfac_policy, replicated_state, zero_state, one_buffer_reduce, bucket_reduce, or a "
      "type declaring `static constexpr "
      "train::policy_slot slot`) "
      "nor a hook (an object with before_step, after_step, on_overflow or on_rescale)");
  auto scaler = detail::pick<slot::scaler, no_loss_scaling>(args...);
  auto combine = detail::pick<slot::combine, allreduce_mean>(args...);
  auto adapt = detail::pick<slot::adapt, no_adascale>(args...);
  auto sync = detail::pick<slot::sync, no_local_sgd>(args...);
  // Moved from an rvalue argument (a preconditioner may own move-only state, e.g. K-FAC's);
  // pick moves only the argument filling this slot, hook_tuple only the hooks.
  auto precond = detail::pick<slot::precondition, no_preconditioner>(std::forward<Args>(args)...);
  auto state = detail::pick<slot::state, replicated_state>(args...);
  auto reduce = detail::pick<slot::reduce, one_buffer_reduce>(args...);
  auto hooks = std::tuple_cat(detail::hook_tuple(std::forward<Args>(args))...);
  return data_parallel_step<Comm, B, PL, Opt, decltype(scaler), decltype(combine), decltype(adapt),
                            decltype(sync), decltype(hooks), decltype(precond), decltype(state),
                            decltype(reduce)>(comm, backend, params, std::move(optimizer), settings,
                                              std::move(scaler), std::move(combine), std::move(adapt),
                                              std::move(sync), std::move(hooks), std::move(precond),
                                              std::move(state), std::move(reduce));
}

}  // namespace gradapt::train

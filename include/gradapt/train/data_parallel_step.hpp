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
///
/// Device memory (gradapt::cuda with comm::nccl, every operation on the framework's stream): the
/// same step, its agreements and the loss scaler's flags staged through backend buffers; the
/// host waits for the stream only at its agreement points (docs/algorithms/train-step.md, CUDA).
/// `kfac_policy` there needs a K-FAC state in device memory (`kfac::init(backend, la, layers)`).

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
#include "gradapt/core/type_name.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/stage.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/stats/allreduce_with_norms.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "gradapt/train/policies.hpp"
#include "gradapt/train/step_traits.hpp"

namespace gradapt::train {

/// One data-parallel step composed from policies; build it with `make_data_parallel_step`
/// (the template arguments are deduced from the policies and hooks passed there).
///
/// @tparam Comm   communicator: comm::single, comm::threads or comm::mpi (host memory), or
///                comm::nccl (device memory)
/// @tparam B      backend of the same memory space (gradapt::host; gradapt::cuda with NCCL)
/// @tparam PL     the parameter list type (gradapt::param_list<V, G, Space>)
/// @tparam Opt    optimizer with the chain interface (`step_optimizer`)
/// @tparam Scaler no_loss_scaling | gradapt::loss_scaler
/// @tparam Combine allreduce_mean | adasum_combine | a user's `combine_policy`
/// @tparam Adapt  no_adascale | adascale_policy
/// @tparam Sync   no_local_sgd | local_sgd_policy<Schedule>
/// @tparam Hooks  std::tuple of hook objects, called in the order they were passed
/// @tparam Precond no_preconditioner | kfac_policy<State> | a user's `precondition_policy`
/// @tparam StateP replicated_state | zero_state<1> | zero_state<2>
/// @tparam ReduceP one_buffer_reduce | bucket_reduce | hierarchical_reduce
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
  /// The reduce slot's `hierarchical_reduce`: the mean through Horovod's hierarchical allreduce.
  static constexpr bool has_hierarchy = std::is_same_v<ReduceP, hierarchical_reduce>;
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
  /// The step runs on device memory (the CUDA backend with comm::nccl): the parameter list,
  /// the backend and the communicator are in a memory space other than the host's.
  static constexpr bool on_device = !std::is_same_v<typename Comm::space, host_space>;
  static_assert(std::is_same_v<typename Comm::space, typename B::space> &&
                    std::is_same_v<typename PL::space, typename B::space>,
                "train::data_parallel_step: the communicator, the backend and the parameter list must be "
                "in the same memory space (gradapt::host with comm::single, threads or mpi on host memory; "
                "gradapt::cuda with comm::nccl on device memory)");
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
                    (std::is_same_v<ReduceP, one_buffer_reduce> || has_buckets || has_hierarchy),
                "train::data_parallel_step: the state slot holds replicated_state, zero_state<1> or "
                "zero_state<2>, and the reduce slot one_buffer_reduce, bucket_reduce or hierarchical_reduce");
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
  static_assert(!(has_hierarchy && has_custom_combine),
                "train::data_parallel_step: the reduce slot's hierarchical_reduce forms the rank MEAN in "
                "three steps (inside groups, across them, inside again); the combine slot's adasum_combine "
                "(or a user's combiner) forms something else: use allreduce_mean with it (Adasum has a "
                "hierarchical mode of its own, adasum_options)");
  static_assert(!(has_hierarchy && has_sharded_state),
                "train::data_parallel_step: the state slot's zero_state reduce-scatters the gradients "
                "over the whole world into shards; the reduce slot's hierarchical_reduce allreduces whole "
                "gradients: use one of the two");
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
                     StateP state = StateP(), ReduceP reduce = ReduceP());

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
    // The gradients were written on the framework's producer stream (nccl_options::producer):
    // the step's element work on the communicator's stream comes after it.
    if constexpr (stream_ordered_communicator<Comm>) comm_->after_producer();
    const double busy_before = busy_;
    busy_ = -1.0;  // this call's time, known at its end
    const std::uint64_t call = calls_ + 1;
    notify<events::before_step>(hooks_, settings_, std::as_const(last_));
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
    if constexpr (marks_gradients) {
      std::string marks = complete_marks();  // every rank's bucket collectives run, none waits
      if (bad.empty()) bad = std::move(marks);
      try {
        agree_on_step(call, eta, timed ? in.ready_seconds : -1.0, busy_before, in.loss, bad);
      } catch (...) {
        abandon_round();
        throw;
      }
    } else {
      agree_on_step(call, eta, timed ? in.ready_seconds : -1.0, busy_before, in.loss, bad);
    }
    apply_settings(call);

    step_metrics m;
    m.step = call;
    m.loss = mean_loss_;
    m.global_batch = global_batch();
    if constexpr (has_adascale) m.scale = adapt_.ada.scale();

    if constexpr (has_loss_scaling) {
      bool ok = false;
      if constexpr (marks_gradients) {  // unscaled gradient by gradient in mark_ready
        if constexpr (on_device) {
          ok = scaler_.decide(*comm_, backend_, read_flag(), std::string());
          clear_flag();
        } else {
          ok = scaler_.decide(*comm_, nonfinite_, std::string());
        }
        nonfinite_ = 0.0;
        if (!ok) abandon_round();  // the round ends without a step on every rank
      } else if constexpr (on_device) {
        ok = scaler_.unscale(backend_, *comm_, params_->grads(), flag_view(2));
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
    if constexpr (has_sharded_state &&
                  !std::is_same_v<typename detail::report_of<Opt>::type, detail::nothing>)
      last_report_ = sharded_->step(*comm_, backend_, *params_, *state_, step_args{.lr = lr});  // by block
    else if constexpr (has_sharded_state)
      sharded_->step(*comm_, backend_, *params_, *state_, step_args{.lr = lr});
    else if constexpr (!std::is_same_v<typename detail::report_of<Opt>::type, detail::nothing>) {
      // A preconditioner chain (Shampoo): its roots divided among the ranks while every rank
      // steps on the same gradients; under LocalSGD (replicas that differ between averages)
      // each rank computes all of its roots.
      if constexpr (!has_local_sgd &&
                    requires { opt_.step(*comm_, backend_, *params_, state_, step_args{}); })
        last_report_ = opt_.step(*comm_, backend_, *params_, state_, step_args{.lr = lr});
      else
        last_report_ = opt_.step(backend_, *params_, state_, step_args{.lr = lr});
    } else {
      opt_.step(backend_, *params_, state_, step_args{.lr = lr});
    }

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
  /// The optimizer's report of the latest step, for an optimizer whose step returns one (a
  /// Shampoo chain: the blocks whose roots were installed and every failed root computation,
  /// `shampoo_step_report`).
  const auto& optimizer_report() const
      requires(!std::is_same_v<typename detail::report_of<Opt>::type, detail::nothing>) {
    return last_report_;
  }
  /// ZeRO stage 2 or `bucket_reduce`: gradient t of this rank is final for this step (call it
  /// during the backward pass, as the framework produces each gradient, in any order; every
  /// gradient once per step). Full buckets are reduced (reduce-scattered with ZeRO) at once, or
  /// started without waiting over `comm::mpi` with `bucket_reduce::overlap`; `step()` finishes
  /// the step. Collective per bucket: every rank marks every gradient before `step()`.
  /// With the loss scaler, the gradient is unscaled here (g ← g / S, its non-finite elements
  /// counted) before its bucket is reduced; `step()` agrees on the count (one allreduce, as
  /// `loss_scaler::unscale`) and skips the step on every rank after an overflow.
  ///
  /// A mark out of range or repeated in the step, and a gradient left unmarked at `step()`, are
  /// errors on every rank, thrown by `step()` (the rank at fault names the gradient, the others
  /// name that rank): `mark_ready` itself does not throw for them, and `step()` first marks what
  /// this rank left unmarked, so that every rank runs the same bucket collectives and none is
  /// left waiting in one. The round then ends without a step; mark every gradient again.
  void mark_ready(std::size_t t) requires marks_gradients {
    if (t >= tensors_ || marked_[t] != 0) {
      if (mark_error_.empty())
        mark_error_ = t >= tensors_
                          ? detail::message("train::data_parallel_step::mark_ready on rank ", comm_->rank(),
                                            ": gradient ", t, " is out of range (", tensors_, " gradients)")
                          : detail::message("train::data_parallel_step::mark_ready on rank ", comm_->rank(),
                                            ": gradient ", t, " ('", (*params_)[t].name,
                                            "') was marked ready twice in this step");
      return;
    }
    if constexpr (stream_ordered_communicator<Comm>) comm_->after_producer();  // gradient t was written there
    if constexpr (has_loss_scaling && on_device)  // a flag in device memory, read at step()
      unscale_flag_nonfinite(backend_, params_->grads().subspan(t, 1), scaler_.inv_scale(), flag_view(1));
    else if constexpr (has_loss_scaling)
      nonfinite_ += unscale_count_nonfinite(backend_, params_->grads().subspan(t, 1), scaler_.inv_scale());
    if constexpr (has_adascale) local_sq_ += backend_.reduce(reduction::sum_squares, (*params_)[t].grad);
    forward_mark(t);
  }
  /// `bucket_reduce`: lets the bucket collectives in flight advance (`bucket::reducer::progress`:
  /// over `comm::mpi` each outstanding request is tested, which moves Open MPI's non-blocking
  /// allreduce on). `mark_ready` does this too; a framework whose backward pass leaves long
  /// gaps between gradients can call it while it waits (docs/algorithms/buckets.md measures
  /// the exposed communication with and without it). Not collective.
  void progress() requires has_buckets { reducer_->progress(); }
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
  std::vector<std::byte> save() const;

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
  void restore(std::span<const std::byte> bytes, rescale_rule rule);

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
  void restore(const archive_source& archive, rescale_rule rule);

  /// Restores a state written by `save()` of a step with the same slots, optimizer, rank
  /// count and parameter layout; the following steps are then bit for bit those of the run
  /// that saved it (given the same parameters and gradients). Not collective; call it on
  /// every rank. All or nothing: on a throw the step's state is unchanged.
  /// @throws gradapt::error naming the first field that does not match
  ///
  /// With `zero_state` each rank's checkpoint holds its own shard: every rank loads its own
  /// checkpoint of the same step on the same world size and options, and load is collective
  /// (an error on one rank is thrown on every rank, and every rank keeps its state).
  void load(std::span<const std::byte> bytes);

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
  void check_empty_shards(const StateP& o) const;

  // The step's agreements and small sums: on a device communicator the words travel through a
  // buffer of the backend (copied in and out, the copy back waiting for the stream), on a host
  // communicator directly (comm/agree.hpp).
  void agree(std::string_view who, std::span<const agreed_value> values, const std::string& bad = {}) const {
    agree_values(*comm_, backend_, who, values, bad);
  }
  void sum_over_ranks(std::span<double> v) const {
    gradapt::detail::allreduce_host_values(*comm_, backend_, v, reduce_op::sum);
  }

  // The loss scaler on a device: flags_[0] is the overflow flag of the marks (zero_state<2>) or
  // of unscale, flags_[1] unscale's error flag, both in the backend's memory.
  tensor_view<float, typename B::space> flag_view(std::size_t n) requires(has_loss_scaling&& on_device) {
    return tensor_view<float, typename B::space>::vector(flags_.data(), static_cast<std::int64_t>(n));
  }
  double read_flag() requires(has_loss_scaling&& on_device) {
    float f = 0.0f;
    backend_.copy(tensor_view<const float, typename B::space>::vector(flags_.data(), 1),
                  tensor_view<float, host_space>::scalar(&f));
    return static_cast<double>(f);
  }
  void clear_flag() requires(has_loss_scaling&& on_device) {
    backend_.apply(gradapt::detail::loss_scale::set_value{0.0f}, flag_view(1));
  }

  template <class F>
  void for_each_hook(F&& f) {
    std::apply([&](auto&... h) { (f(hook_object(h)), ...); }, hooks_);
  }
  template <class F>
  void for_each_hook(F&& f) const {
    std::apply([&](const auto&... h) { (f(hook_object(h)), ...); }, hooks_);
  }
  static std::string hook_section(std::size_t i) {
    std::string s = "hook";
    s += std::to_string(i);
    return s;
  }

  double progress_value() const {
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
    m.progress = progress_value();
    m.noise_scale = noise_scale_value();
    if constexpr (stream_ordered_communicator<Comm>) comm_->join_producer();  // the parameters, for it
    calls_ = call;
    last_ = m;
    if (m.found_inf) notify<events::on_overflow>(hooks_, settings_, std::as_const(last_));
    notify<events::after_step>(hooks_, settings_, std::as_const(last_));
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

  void check_rank_batches(const char* fn) const;

  void check_batch(const char* fn) const;

  void check_lr(const char* fn) const;

  void check_scale(double s, const char* fn) const;

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
  void apply_settings(std::uint64_t call);

  /// The construction agreement (gradapt::agree_values, one small allreduce): the parameter
  /// list (tensor count, element count, a size fingerprint), which slots are on, the settings,
  /// the slot options and the optimizer's stage options (`agreed_options`) that must match, so
  /// that a rank built with another learning rate, momentum, batch, base batch or period
  /// throws with every other rank instead of drifting apart.
  template <class A, class Y, class P>
  void agree_on_construction(const A& adapt, const Y& sync, const P& precond);

  /// The per-step agreement (one small allreduce, before anything is unscaled or combined): the
  /// step number, this step's learning rate and the settings as the hooks left them, AdaScale's
  /// scale and the loss scale. `bad` is this rank's error for an invalid step_args::lr.
  ///
  /// The same allreduce shares two numbers of every rank (`agree_values_and_share`, 2N more
  /// words): its time-to-ready (`ready`, step_args::ready_seconds; -1 when not given) and the
  /// time it spent in the previous call of step() (`busy`; -1 before the first call).
  // "<what> (this rank's: <type>; a hash of the type)": the name of a structure value in the
  // construction agreement, so that each rank's message names its own algorithm.
  template <class T>
  static std::string_view structure_name(std::string_view what) {
    static const std::string name = [&] {
      std::string t = gradapt::detail::short_type_name<T>();
      if constexpr (requires { typename T::chain_type; })
        t += " = " + gradapt::detail::short_type_name<typename T::chain_type>();
      return std::string(what) + " (this rank's: " + t + "; a hash of the type)";
    }();
    return name;
  }
  void agree_on_step(std::uint64_t call, double eta, double ready, double busy, double loss,
                     const std::string& bad);

  /// The replica check: after a step that leaves the replicas identical (a synchronous step,
  /// or a LocalSGD averaging round), on the first such step and then every
  /// replica_check_interval() such steps, the sum of every parameter (in double, the backend's
  /// deterministic reduction) is agreed across ranks. Replicas that drifted apart (other
  /// optimizer options on one rank, a hook that changed something on one rank only, a
  /// combiner that returns different gradients) are an error on every rank.
  void check_replicas(const step_metrics& m);

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
  weights weight_for_mean();

  // bucket_reduce: completes the buckets (the gradients then hold the rank mean). With AdaScale,
  // Σ_r |g_r|² from the marks (each gradient read as it was marked) and |ḡ|² from one read of
  // the averaged gradients, the local sums added over the ranks by one allreduce of a double.
  void reduce_buckets();

  // zero_state: the sharded optimizer's reduction (its step then skips it). With AdaScale, the
  // noise scale's inputs come from this rank's local gradient (Σ g_r², taken at step() for
  // stage 1, gradient by gradient in mark_ready for stage 2) and its averaged gradient shard
  // (Σ ḡ² over the shard), added over the ranks by one allreduce of two doubles.
  void reduce_sharded();

  void combine();

  // zero_state<2> and bucket_reduce: gradient t marked (this rank's bucket collectives go on).
  void forward_mark(std::size_t t);
  // At step(): marks what this rank left unmarked (so that every rank runs the same bucket
  // collectives) and returns this rank's marking error ("" when every gradient was marked once).
  std::string complete_marks();
  // After an error agreed on every rank or an overflow: the round ends without a step (its
  // bucket collectives completed) and the marks start afresh.
  void abandon_round();

  // hierarchical_reduce: Σ_r g_r through the hierarchy, tensor by tensor, then g / N as
  // allreduce_mean divides; with `Norms`, Σ_r |g_r|² (one allreduce of a double) and |Σ_r g_r|².
  template <bool Norms>
  allreduce_norms hierarchical_mean();

  // Calls f(section, component) for every component with a state section of its own, in
  // archive order: loss scaler, noise scale, AdaScale, LocalSGD, combiner, preconditioner, then
  // the hooks that save state ("hook0", "hook1", ... by position). `self` is *this, const for save().
  template <class Self, class F>
  static void for_each_section(Self& self, F&& f);

  template <class State>
  static void put_section(archive_writer& w, const char* section, const State& st);

  static void put_metrics(archive_writer& w, const step_metrics& m);
  static step_metrics get_metrics(archive_reader& r);

  // Reads the archive into this step. Component loads validate their own sections and
  // commit one by one, so `load` restores a backup when anything throws.
  // With `resize`, a checkpoint of another rank count is accepted and the settings follow the rule.
  void load_impl(std::span<const std::byte> bytes, const rescale_rule* resize,
                 std::string_view* shard = nullptr, std::uint64_t* old_ranks = nullptr);

  // load() with zero_state: the step's own sections on each rank, agreed, then the optimizer
  // shard through the sharded optimizer's collective load; a failure anywhere restores the
  // backup on every rank and throws on every rank.
  void load_sharded(std::span<const std::byte> bytes);

  // restore's agreement: every rank passed the same checkpoint bytes and rule, or every rank
  // throws (`bad`: this rank's error; `undo` puts the state back where it was changed).
  template <class Undo>
  void agree_on_restore(std::span<const std::byte> bytes, rescale_rule rule, const std::string& bad,
                        Undo undo);

  // restore() with zero_state: the step's sections from old rank 0's checkpoint (agreed), then
  // the new shard through the sharded optimizer's collective load from the old ranks'
  // checkpoints that overlap it.
  void restore_sharded(const archive_source& archive, rescale_rule rule);

  // Old rank r's shard, a view into its checkpoint's bytes, which must be of the same world
  // size and step as old rank 0's (already read into this step).
  std::string_view shard_in(std::span<const std::byte> bytes, int r, std::uint64_t old_ranks) const;

  // The settings of a checkpoint of n ranks on m ranks under `rule`.
  static step_settings rescaled(step_settings s, rescale_rule rule, std::uint64_t n, std::uint64_t m);

  template <class State>
  static void load_section(archive_reader& r, const char* section, State& st);

  Comm* comm_;
  B backend_;
  const PL* params_;
  Opt opt_;
  /// The sharded optimizer (state slot zero_state).
  [[no_unique_address]] std::conditional_t<has_sharded_state, std::optional<shard::sharded_optimizer<Opt>>,
                                           detail::nothing>
      sharded_;
  /// zero_state<2> or bucket_reduce: the gradients marked in this step (with the loss scaler,
  /// unscaled), the first marking error, and with the scaler the non-finite elements counted.
  std::vector<char> marked_;
  /// The loss scaler's flags in the backend's memory (a device step with the scaler on).
  [[no_unique_address]] std::conditional_t<
      has_loss_scaling && on_device,
      decltype(std::declval<const B&>().template allocate<float>(std::size_t{2})), detail::nothing>
      flags_;
  std::string mark_error_;
  double nonfinite_ = 0.0;
  double local_sq_ = 0.0;  ///< marks with AdaScale: Σ g² of the gradients marked so far
  std::size_t marks_ = 0;  ///< gradients marked ready in this step (zero_state<2>, bucket_reduce)
  /// The bucket reducer (reduce slot bucket_reduce).
  /// The groups and their communicators (reduce slot hierarchical_reduce).
  [[no_unique_address]] typename detail::hierarchy_slot<has_hierarchy, Comm, B>::type hier_;
  [[no_unique_address]] typename detail::reducer_slot<has_buckets, Comm, grad_type, B>::type reducer_;
  /// The optimizer's report of the latest step (a Shampoo chain's), or nothing.
  [[no_unique_address]] typename detail::report_of<Opt>::type last_report_{};
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
  double mean_loss_ = 0.0;                      ///< the ranks' mean loss of the latest step
  std::vector<double> agree_ws_;                ///< its allreduce words beyond 64
  std::vector<double> rank_times_, rank_busy_;  ///< see rank_times(), rank_step_seconds()
  Hooks hooks_;
};

}  // namespace gradapt::train

// The member bodies of the construction and agreements, the checkpoint and the reduction (out
// of the class by concern), written against these two names.
/// @cond
#define GRADAPT_TRAIN_STEP_TEMPLATE                                                                         \
  template <class Comm, class B, class PL, class Opt, class Scaler, class Combine, class Adapt, class Sync, \
            class Hooks, class Precond, class StateP, class ReduceP>
#define GRADAPT_TRAIN_STEP \
  data_parallel_step<Comm, B, PL, Opt, Scaler, Combine, Adapt, Sync, Hooks, Precond, StateP, ReduceP>
/// @endcond
#include "gradapt/train/detail/step_checkpoint.hpp"
#include "gradapt/train/detail/step_reduce.hpp"
#include "gradapt/train/detail/step_setup.hpp"
#undef GRADAPT_TRAIN_STEP
#undef GRADAPT_TRAIN_STEP_TEMPLATE
#include "gradapt/train/make_step.hpp"

#pragma once
/// @file
/// Local SGD with a synchronous start (post-local SGD) and a pluggable averaging schedule.
///
/// Every rank trains its own replica. For the first `start_step` steps the ranks allreduce
/// their gradients every step (ordinary data parallelism, so the replicas stay identical);
/// from then on each rank steps on its own gradients ("local steps") and the replicas are
/// averaged, x ← (1/N) Σ_r x_r, at the rounds its schedule picks:
///  - fixed_period: every K local steps, optionally after a warm-up at period 1 and a doubling
///    ramp (Lin, Stich, Patel and Jaggi 2018, "Don't Use Large Mini-Batches, Use Local SGD",
///    which also introduces the synchronous start as post-local SGD);
///  - adaptive_period: K_l = ⌈sqrt((η_0/η_l)(F_l/F_0)) K_0⌉ clamped to [1, K_max] from the
///    smoothed rank-mean loss (Wang and Joshi 2018, "Adaptive Communication Strategies to
///    Achieve the Best Error-Runtime Trade-off in Local-Update SGD");
///  - hierarchical_period: small groups often, larger groups rarely (PyTorch's
///    HierarchicalModelAverager semantics, with the differences listed in
///    hierarchical_period.hpp).
///
/// One number decides the hand-over. `sync_gradients()` (gradient allreduce this step) and the
/// averaging rounds are both derived from the same step counter and the same
/// `local_sgd_options::start_step`; schedules count local steps from there, so a schedule's
/// warm-up cannot start before or after the gradient synchronisation ends. (PyTorch's
/// post-local SGD takes the same boundary twice, as PostLocalSGDState's start_localSGD_iter and
/// as the averager's warmup_steps, and its documentation asks the user to keep them equal.)

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/sync/adaptive_period.hpp"
#include "gradapt/sync/average_models.hpp"
#include "gradapt/sync/averaging_schedule.hpp"
#include "gradapt/sync/fixed_period.hpp"
#include "gradapt/sync/hierarchical_period.hpp"

namespace gradapt {

static_assert(averaging_schedule<fixed_period>);
static_assert(averaging_schedule<adaptive_period>);
static_assert(averaging_schedule<hierarchical_period>);

/// Options of local_sgd, e.g. `gradapt::local_sgd_options{.start_step = 1000}`.
///
/// | name        | type   | default | meaning                                                     |
/// |-------------|--------|---------|-------------------------------------------------------------|
/// | start_step  | uint64 | 0       | steps 0 .. start_step − 1 allreduce gradients; local steps after |
/// | check_lists | bool   | true    | at every round, agree on lists, counters and schedule across ranks |
struct local_sgd_options {
  /// Index of the first local step. Steps 0 .. start_step − 1 are synchronous: the caller
  /// allreduces gradients (sync_gradients() is true) and nothing is averaged. 0 starts local SGD
  /// at once (the replicas must then start identical, e.g. broadcast from rank 0).
  std::uint64_t start_step = 0;
  /// Before every averaging round, one small allreduce (gradapt::agree_values) checks that every
  /// rank averages the same number of tensors and bytes, at the same step, round and level,
  /// with the same start_step and schedule options, so that a rank with a tensor more or less,
  /// another period or another start step throws (naming what differs) instead of pairing its
  /// collectives with the wrong ones. On a device communicator the words travel through a
  /// buffer of the backend passed to `step` (the copy back waits for its stream).
  bool check_lists = true;
};

/// What the caller reports at each step for schedules that read the loss (adaptive_period).
///
/// Only the values passed on an averaging step are used. By default they are this rank's
/// values and local_sgd averages them over the ranks with one allreduce of three doubles;
/// with `.global = true` they are already rank means, identical on every rank (no allreduce).
/// On a device communicator the three doubles travel through a buffer of the backend.
struct local_sgd_input {
  /// Training loss of this step on this rank (or a running mean since the last round); >= 0.
  /// inf or NaN on any rank makes the round's loss sample skipped (counted, period unchanged).
  double loss = std::numeric_limits<double>::quiet_NaN();
  /// Learning rate in effect at this step (> 0, finite). The rank mean is used.
  double lr = std::numeric_limits<double>::quiet_NaN();
  /// The values are rank means already, identical on every rank: no allreduce.
  bool global = false;
};

/// What one call of local_sgd::step did.
struct local_sgd_result {
  bool averaged = false;  ///< the model was averaged after this step
  int level = -1;         ///< the schedule level that averaged (-1: none)
  int group_size = 0;     ///< ranks in this rank's averaging group (0: none)
};

/// The counters of a local_sgd run: plain data, part of its checkpoint.
///
/// Bytes: the *payload* of a round is the bytes of all averaged tensors (elements × element
/// size), what one rank hands to the allreduces; *ring* bytes are what one rank sends in a
/// bandwidth-optimal ring allreduce of that payload in its group of n ranks,
/// ⌊2 (n − 1) payload / n⌋ (ring_allreduce_bytes). The every-step counters add, for every
/// local step, what averaging the same tensors over the whole world after that step would
/// have cost, the baseline local SGD saves against.
struct local_sgd_state {
  std::uint64_t steps = 0;                                       ///< steps completed (synchronous and local)
  std::uint64_t rounds = 0;                                      ///< averaging rounds at any level
  std::array<std::uint64_t, max_average_levels> level_rounds{};  ///< rounds per schedule level
  std::uint64_t payload_bytes = 0;                               ///< Σ payload over rounds
  std::uint64_t ring_bytes = 0;                                  ///< Σ ring bytes over rounds
  std::uint64_t every_step_payload_bytes = 0;                    ///< Σ payload over local steps
  std::uint64_t every_step_ring_bytes = 0;                       ///< Σ world ring bytes over local steps
};

/// A complete local_sgd checkpoint: the driver's counters and the schedule's state.
template <class ScheduleState>
struct local_sgd_checkpoint {
  local_sgd_state driver;  ///< step, round and byte counters
  ScheduleState schedule;  ///< the schedule's state()
};

/// Local SGD driver over communicator type C with schedule S.
///
/// Use, each step, after the framework's backward pass:
///
///     if (lsgd.sync_gradients()) { /* allreduce-mean the gradients */ }
///     optimizer.step(...);
///     lsgd.step(comm, backend, params.values(), momentum_views);              // fixed, hierarchical
///     lsgd.step(comm, backend, {.loss = loss, .lr = lr}, params.values());    // adaptive
///
/// `step` counts the step and, when the schedule says so, averages every list passed (the
/// parameters, and whatever else must agree across replicas: buffers such as batch-norm
/// statistics, optimizer state) over the ranks of the round's group. Every rank must call it
/// at every step with the same lists. It is collective only on averaging steps, and for
/// every rank at the same steps (the schedule's decision depends only on values that are
/// equal on every rank), so a step without a round costs no communication.
///
/// Construction is collective when a schedule level has groups smaller than the world
/// (comm.split is called once per such level, in level order). The steady-state step
/// allocates nothing. state()/restore() and save()/load() round-trip the complete state exactly.
template <communicator C, averaging_schedule S>
class local_sgd {
 public:
  using schedule_type = S;  ///< the averaging schedule (fixed_period, adaptive_period, ...)
  /// What state() returns and restore() takes: the driver's counters and the schedule's state.
  using checkpoint_type = local_sgd_checkpoint<typename S::state_type>;

  /// Builds the averaging groups of every schedule level on `comm`.
  /// @throws gradapt::error when the schedule has no or too many levels, a group size is
  ///         outside [1, world], groups do not nest, or the last level is not the world.
  local_sgd(C& comm, local_sgd_options options, S schedule)
      : opt_(options), sched_(std::move(schedule)), world_(comm.size()), rank_(comm.rank()) {
    const std::size_t levels = sched_.levels();
    detail::require(levels >= 1 && levels <= max_average_levels, "local_sgd: the schedule has ", levels,
                    " levels (expected 1 to ", max_average_levels, ")");
    levels_ = levels;
    for (std::size_t l = 0; l < levels; ++l) {
      const int g = sched_.group_size(l, world_);
      detail::require(g >= 1 && g <= world_, "local_sgd on rank ", rank_, ": schedule level ", l,
                      " has group size ", g, " (expected 1 to ", world_,
                      " ranks, the size of the communicator)");
      if (l > 0) {
        const int below = group_sizes_[l - 1];
        detail::require(g == world_ || g % below == 0, "local_sgd on rank ", rank_, ": level ", l,
                        " has group size ", g, " but level ", l - 1, " has ", below,
                        " (groups must nest: a multiple of the level below, or the whole world)");
      }
      group_sizes_[l] = g;
    }
    detail::require(group_sizes_[levels - 1] == world_, "local_sgd on rank ", rank_, ": the last level has ",
                    "group size ", group_sizes_[levels - 1], " but the communicator has ", world_,
                    " ranks (the last level must average the whole world, or the replicas never meet)");
    for (std::size_t l = 0; l < levels; ++l) {
      const int g = group_sizes_[l];
      if (g == world_ || g == 1) {
        comm_index_[l] = g == 1 ? self_group : world_group;
      } else {
        comm_index_[l] = static_cast<int>(subs_.size());
        subs_.push_back(comm.split(rank_ / g, rank_));
      }
    }
  }

  /// The options this driver was built with.
  const local_sgd_options& options() const { return opt_; }
  /// The schedule (its period, loss statistics, levels).
  const S& schedule() const { return sched_; }
  /// Number of schedule levels.
  std::size_t levels() const { return levels_; }
  /// Ranks in this rank's group at level l (the last group of a level may be smaller than the
  /// level's nominal size when the world size is not a multiple of it).
  int group_size(std::size_t level) const {
    detail::require(level < levels_, "local_sgd::group_size: level ", level, " out of range (", levels_,
                    " levels)");
    const int g = group_sizes_[level];
    const int first = rank_ / g * g;
    return world_ - first < g ? world_ - first : g;
  }

  /// True when step `step` (0-based) is synchronous: the caller allreduces gradients.
  bool sync_gradients_at(std::uint64_t step) const { return step < opt_.start_step; }
  /// True when the step about to run (index steps()) is synchronous: allreduce the gradients
  /// before the optimizer step. From start_step on it is false and averaging takes over.
  bool sync_gradients() const { return sync_gradients_at(st_.steps); }

  /// One step of a schedule that does not read the loss: counts the step and averages `lists`
  /// if a round is due. See the class comment.
  template <backend B, class... Ls>
  requires(!S::uses_loss) && std::same_as<typename B::space, typename C::space> &&
      (averageable_list<Ls, typename C::space> && ...) local_sgd_result
      step(C& comm, const B& b, const Ls&... lists) {
    static_assert(sizeof...(Ls) > 0, "local_sgd::step needs at least one list of tensors to average");
    return step_impl(comm, b, nullptr, lists...);
  }

  /// One step with this rank's loss and learning rate (required by adaptive_period, ignored by
  /// the other schedules). On an averaging step of a loss-reading schedule the inputs are
  /// checked on every rank and averaged over the world with one allreduce of three doubles
  /// (none with `.global = true`); invalid input on any rank (lr not positive and finite, a
  /// finite negative loss) makes every rank throw before anything is averaged.
  template <backend B, class... Ls>
  requires std::same_as<typename B::space, typename C::space> &&
      (averageable_list<Ls, typename C::space>&&...)local_sgd_result
      step(C& comm, const B& b, const local_sgd_input& input, const Ls&... lists) {
    static_assert(sizeof...(Ls) > 0, "local_sgd::step needs at least one list of tensors to average");
    return step_impl(comm, b, &input, lists...);
  }

  /// Steps completed (synchronous and local).
  std::uint64_t steps() const { return st_.steps; }
  /// Synchronous steps completed (gradient allreduce, no averaging).
  std::uint64_t synchronous_steps() const {
    return st_.steps < opt_.start_step ? st_.steps : opt_.start_step;
  }
  /// Local steps completed.
  std::uint64_t local_steps() const { return st_.steps - synchronous_steps(); }
  /// Averaging rounds at any level.
  std::uint64_t rounds() const { return st_.rounds; }
  /// Averaging rounds at level l.
  std::uint64_t rounds_at(std::size_t level) const {
    detail::require(level < levels_, "local_sgd::rounds_at: level ", level, " out of range (", levels_,
                    " levels)");
    return st_.level_rounds[level];
  }
  /// Σ over rounds of the payload (bytes of the averaged tensors).
  std::uint64_t payload_bytes() const { return st_.payload_bytes; }
  /// Σ over rounds of ring_allreduce_bytes(payload, group size): bytes this rank sent under
  /// the ring model.
  std::uint64_t ring_bytes() const { return st_.ring_bytes; }
  /// What averaging over the whole world after every local step would have handed over.
  std::uint64_t every_step_payload_bytes() const { return st_.every_step_payload_bytes; }
  /// What averaging over the whole world after every local step would have sent (ring model).
  std::uint64_t every_step_ring_bytes() const { return st_.every_step_ring_bytes; }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.local_sgd";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The complete state: the driver's counters and the schedule's state (plain data).
  checkpoint_type state() const { return {st_, sched_.state()}; }

  /// Sets a state from state() of a local_sgd with the same options, schedule and
  /// communicator size; the run then continues exactly as the saved one would have. Call it
  /// on every rank (the list agreement of check_lists runs again at the next round).
  /// @throws gradapt::error when the state is inconsistent (counters, schedule state); the
  ///         local_sgd is then unchanged
  void restore(const checkpoint_type& ck) {
    S next = sched_;
    next.restore(ck.schedule, check_driver(ck.driver));
    sched_ = std::move(next);
    st_ = ck.driver;
  }
  /// Writes the driver's counters and, in section "schedule", the schedule's state.
  void save(archive_writer& w) const {
    w.put("steps", st_.steps);
    w.put("rounds", st_.rounds);
    w.put_tensor<std::uint64_t>("level_rounds", st_.level_rounds);
    w.put("payload_bytes", st_.payload_bytes);
    w.put("ring_bytes", st_.ring_bytes);
    w.put("every_step_payload_bytes", st_.every_step_payload_bytes);
    w.put("every_step_ring_bytes", st_.every_step_ring_bytes);
    w.begin("schedule");
    sched_.save(w);
    w.end();
  }
  /// Reads what `save(archive_writer&)` wrote and restores it (all or nothing).
  void load(archive_reader& r) {
    local_sgd_state d;
    d.steps = r.get<std::uint64_t>("steps");
    d.rounds = r.get<std::uint64_t>("rounds");
    r.get_tensor<std::uint64_t>("level_rounds", std::span<std::uint64_t>(d.level_rounds));
    d.payload_bytes = r.get<std::uint64_t>("payload_bytes");
    d.ring_bytes = r.get<std::uint64_t>("ring_bytes");
    d.every_step_payload_bytes = r.get<std::uint64_t>("every_step_payload_bytes");
    d.every_step_ring_bytes = r.get<std::uint64_t>("every_step_ring_bytes");
    const std::uint64_t local = check_driver(d);
    S next = sched_;
    r.begin("schedule");
    next.load(r, local);
    r.end();
    r.finish_section();
    sched_ = std::move(next);
    st_ = d;
  }
  /// The state as one archive of kind "gradapt.local_sgd" (core/archive.hpp).
  std::vector<std::byte> save() const { return save_archive(*this); }
  /// Restores a state from `save()`; all or nothing.
  void load(std::span<const std::byte> bytes) { load_archive(*this, bytes); }

 private:
  // Validates the driver's counters; returns the local-step count they belong to.
  std::uint64_t check_driver(const local_sgd_state& d) const {
    const std::uint64_t local = d.steps < opt_.start_step ? 0 : d.steps - opt_.start_step;
    std::uint64_t sum = 0;
    for (std::size_t l = 0; l < max_average_levels; ++l) {
      detail::require(l < levels_ || d.level_rounds[l] == 0, "local_sgd::load: ", d.level_rounds[l],
                      " rounds at level ", l, " but the schedule has ", levels_, " levels");
      detail::require(d.level_rounds[l] <= d.rounds, "local_sgd::load: ", d.level_rounds[l],
                      " rounds at level ", l, " but ", d.rounds, " in all");
      sum += d.level_rounds[l];
    }
    detail::require(
        sum == d.rounds && d.rounds <= local, "local_sgd::load: ", d.rounds, " rounds (", sum,
        " by level) after ", local,
        " local steps (expected the level counts to add up and at most one round per local step)");
    detail::require(d.steps < std::numeric_limits<std::uint64_t>::max(), "local_sgd::load: step count ",
                    d.steps, " would overflow at the next step");
    return local;
  }

  static constexpr int world_group = -1;
  static constexpr int self_group = -2;

  template <class... Ls>
  static void list_shape(std::uint64_t& tensors, std::uint64_t& bytes, const Ls&... lists) {
    tensors = (std::uint64_t{0} + ... + detail::sync::list_tensors(lists));
    bytes = gradapt::payload_bytes(lists...);
  }

  /// The round agreement (with check_lists; on a device communicator through a buffer of the
  /// backend): one small allreduce per
  /// averaging round over the world on the lists' tensor count and bytes, the step counts, the
  /// round and its level, start_step and the schedule's options. Ranks whose schedules or
  /// counters differ therefore meet in this allreduce at their first differing round and all
  /// throw (naming what differs), instead of averaging the wrong rounds and hanging.
  template <class B, class... Ls>
  void check_lists(C& comm, const B& b, std::uint64_t c, int level, const Ls&... lists) {
    {
      std::uint64_t tensors = 0, bytes = 0;
      list_shape(tensors, bytes, lists...);
      agreed_list<7 + 1 + 2 * max_average_levels> v;
      v.push("tensors averaged", static_cast<double>(tensors));
      v.push("bytes averaged", static_cast<double>(bytes));
      v.push("start_step", static_cast<double>(opt_.start_step));
      // The schedule's options before the counters: a rank with another period reaches its
      // round at another step, and the message names the option, not only the step.
      if constexpr (requires { sched_.agreed_options(v); }) sched_.agreed_options(v);
      v.push("step", static_cast<double>(st_.steps));
      v.push("local step of this round", static_cast<double>(c));
      v.push("rounds", static_cast<double>(st_.rounds));
      v.push("level", static_cast<double>(level));
      agree_values(comm, b, "local_sgd::step", v.view());
    }
  }

  /// The rank means of loss and learning rate for a loss-reading schedule.
  template <class B>
  round_observation observe(C& comm, const B& b, const local_sgd_input& in) const {
    std::string bad;
    if (!(std::isfinite(in.lr) && in.lr > 0.0))
      bad = detail::message("local_sgd::step on rank ", rank_, ": learning rate is ", in.lr,
                            " (expected a positive, finite learning rate in local_sgd_input::lr)");
    else if (std::isfinite(in.loss) && in.loss < 0.0)
      bad = detail::message("local_sgd::step on rank ", rank_, ": loss is ", in.loss,
                            " (expected a loss >= 0: the adaptive period compares loss ratios; shift a loss "
                            "that can be negative)");
    if (in.global) {
      if (!bad.empty()) throw error(bad);
      return {in.loss, in.lr};
    }
    {
      double v[3] = {bad.empty() ? in.loss : 0.0, bad.empty() ? in.lr : 0.0, bad.empty() ? 0.0 : 1.0};
      detail::allreduce_host_values(comm, b, std::span<double>(v, 3), reduce_op::sum);
      if (!bad.empty()) throw error(bad);
      detail::require(v[2] == 0.0, "local_sgd::step on rank ", rank_, ": ", v[2],
                      " other rank(s) passed an invalid loss or learning rate (see the error raised on those "
                      "ranks); nothing was averaged");
      const auto n = static_cast<double>(world_);
      return {v[0] / n, v[1] / n};
    }
  }

  template <backend B, class... Ls>
  local_sgd_result step_impl(C& comm, const B& b, const local_sgd_input* in, const Ls&... lists) {
    detail::require(comm.size() == world_ && comm.rank() == rank_, "local_sgd::step: communicator has rank ",
                    comm.rank(), " of ", comm.size(), " but this local_sgd was built on rank ", rank_, " of ",
                    world_, " (pass the same communicator every step)");
    if (st_.steps < opt_.start_step) {
      ++st_.steps;
      return {};
    }
    const std::uint64_t payload = gradapt::payload_bytes(lists...);
    const std::uint64_t c = st_.steps - opt_.start_step + 1;
    const int level = sched_.due(c);
    local_sgd_result result;
    if (level >= 0) {
      const auto l = static_cast<std::size_t>(level);
      detail::require(l < levels_, "local_sgd::step: the schedule named level ", level, " of ", levels_);
      if (opt_.check_lists) check_lists(comm, b, c, level, lists...);
      round_observation obs{};
      if constexpr (S::uses_loss) obs = observe(comm, b, *in);
      const auto next = sched_.advance(c, l, obs);
      const int idx = comm_index_[l];
      if (idx == world_group)
        average_models(comm, b, lists...);
      else if (idx != self_group)
        average_models(subs_[static_cast<std::size_t>(idx)], b, lists...);
      sched_.commit(next);
      const int g = group_size(l);
      ++st_.rounds;
      ++st_.level_rounds[l];
      st_.payload_bytes += payload;
      st_.ring_bytes += ring_allreduce_bytes(payload, g);
      result = {true, level, g};
    }
    ++st_.steps;
    st_.every_step_payload_bytes += payload;
    st_.every_step_ring_bytes += ring_allreduce_bytes(payload, world_);
    return result;
  }

  local_sgd_options opt_;
  S sched_;
  int world_ = 1;
  int rank_ = 0;
  std::size_t levels_ = 0;
  std::array<int, max_average_levels> group_sizes_{};
  std::array<int, max_average_levels> comm_index_{};
  std::vector<C> subs_;
  local_sgd_state st_;
};

}  // namespace gradapt

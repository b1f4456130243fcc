#pragma once
/// @file
/// The job that runs adaptation policies: the monitors a policy sees (`job_view`), what it asks
/// for (`job_action`), the agreed resize requests (`job_decision`), the detection of a policy's
/// hooks (`job_policy`, `job_event`), the vote that agrees an action across the ranks, and the
/// driver `adaptive_job`. elastic/policy.hpp describes the events, the vote and how the
/// framework applies a decision.

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/hooks.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/optim/stage.hpp"
#include "gradapt/train/policies.hpp"

namespace gradapt::elastic {

// ---- monitors and actions ---------------------------------------------------------------------

/// What a policy sees: read-only monitors of the job, identical on every rank (the step agrees
/// its metrics, settings and per-rank times across the ranks).
struct job_view {
  const train::step_metrics& metrics;    ///< the latest step's metrics (defaults before the first)
  const train::step_settings& settings;  ///< the settings the next step runs with
  int ranks = 1;                         ///< ranks in the current world
  int rank = 0;                          ///< this rank
  std::int64_t epoch = 0;                ///< the epoch of the latest begin_epoch (0 before)
  std::uint64_t steps = 0;               ///< calls of step() in this job so far
  /// Every rank's time-to-ready (seconds) of the latest step, in rank order; empty when the
  /// framework passes no `step_args::ready_seconds`.
  std::span<const double> rank_times{};
  /// Every rank's time inside the previous call of `step()` (seconds); empty before the second
  /// step or when no times are passed.
  std::span<const double> rank_step_seconds{};
  /// Examples in the latest step over all ranks (`step_metrics::global_batch`).
  double global_batch = 0.0;
  /// global_batch / max over ranks of (time-to-ready + time inside step()), examples per second;
  /// NaN when either time is missing.
  double throughput = std::numeric_limits<double>::quiet_NaN();
};

/// What the policies of one event ask for. Every field left empty asks for nothing.
struct job_action {
  std::optional<double> lr;               ///< step_settings::lr (finite, >= 0)
  std::optional<double> local_batch;      ///< step_settings::local_batch (finite, > 0)
  std::optional<int> accumulation_steps;  ///< step_settings::accumulation_steps (>= 1)
  std::optional<std::int64_t> period;     ///< step_settings::period (>= 1)
  std::optional<bool> synchronous;        ///< step_settings::synchronous
  std::optional<std::vector<double>>
      rank_batches;               ///< step_settings::rank_batches (one per rank, > 0; or empty)
  std::vector<int> drop_ranks;    ///< ranks the framework should remove (resize request; distinct, in range)
  std::optional<int> world_size;  ///< world size the framework should move to (resize request; >= 1)

  /// True when no field is set.
  bool empty() const {
    return !lr && !local_batch && !accumulation_steps && !period && !synchronous && !rank_batches &&
           drop_ranks.empty() && !world_size;
  }
};

/// The resize requests the ranks agreed on since the last `world_changed()` (or
/// `clear_decision()`): the framework reads it, resizes the world, restores the step and calls
/// `world_changed()`.
struct job_decision {
  std::vector<int> drop_ranks;    ///< ranks to remove (ascending, distinct), in the current world's numbering
  std::optional<int> world_size;  ///< the latest requested world size
  std::uint64_t step = 0;         ///< the job's step count when the latest request was agreed

  /// True when the framework is asked to change the world.
  bool resize() const { return !drop_ranks.empty() || world_size.has_value(); }
};

// ---- policy detection -------------------------------------------------------------------------

/// The events the job raises (core/hooks.hpp: a policy handles an event with the member of the
/// event's name, taking `(const job_view&, job_action&)`).
namespace events {
GRADAPT_HOOK_EVENT(before_train, const job_view&, job_action&);     ///< once, before the first step
GRADAPT_HOOK_EVENT(before_epoch, const job_view&, job_action&);     ///< before an epoch's first step
GRADAPT_HOOK_EVENT(after_step, const job_view&, job_action&);       ///< after every step
GRADAPT_HOOK_EVENT(after_epoch, const job_view&, job_action&);      ///< after an epoch's last step
GRADAPT_HOOK_EVENT(after_train, const job_view&, job_action&);      ///< once, after the last step
GRADAPT_HOOK_EVENT(on_world_change, const job_view&, job_action&);  ///< after a restore on a new world
}  // namespace events

/// Every event of the job, in the order of `job_event`.
using job_events = event_set<events::before_train, events::before_epoch, events::after_step,
                             events::after_epoch, events::after_train, events::on_world_change>;

/// An adaptation policy: an object (or a std::reference_wrapper to one) that handles at least
/// one of the job's events (`hook_for`, core/hooks.hpp, the concept train::step_hook also uses;
/// `handles<P, events::after_step>` asks about one event).
template <class P>
concept job_policy = hook_for<P, job_events>;

/// The job's events, in the order a run meets them.
enum class job_event : unsigned char {
  before_train,
  before_epoch,
  after_step,
  after_epoch,
  after_train,
  world_change
};

/// The event's name ("before_train", ...), "unknown" for another value.
inline const char* name(job_event e) {
  constexpr std::array<std::string_view, 6> names{"before_train", "before_epoch", "after_step",
                                                  "after_epoch",  "after_train",  "on_world_change"};
  return gradapt::detail::enum_name(e, names).data();  // the names are NUL-terminated literals
}

/// A step `adaptive_job` can drive: `train::data_parallel_step` has these members.
template <class S>
concept adaptive_step = requires(S& s, const S& cs, const step_args& args) {
  s.step(args);
  { cs.metrics() } -> std::convertible_to<const train::step_metrics&>;
  { s.settings() } -> std::same_as<train::step_settings&>;
  { cs.steps() } -> std::convertible_to<std::uint64_t>;
  { s.comm().size() } -> std::convertible_to<int>;
  { s.comm().rank() } -> std::convertible_to<int>;
  { cs.rank_times() } -> std::convertible_to<std::span<const double>>;
  { cs.rank_step_seconds() } -> std::convertible_to<std::span<const double>>;
};

namespace detail {

using gradapt::detail::fail;
using gradapt::detail::message;
using gradapt::detail::require;

/// The event tag of E.
template <job_event E>
using event_of =
    std::tuple_element_t<static_cast<std::size_t>(E),
                         std::tuple<events::before_train, events::before_epoch, events::after_step,
                                    events::after_epoch, events::after_train, events::on_world_change>>;

/// A 52-bit hash of a vector's elements, exact in a double (0 for an empty vector).
template <class T>
double vector_hash(const std::vector<T>& v) {
  if (v.empty()) return 0.0;
  const std::uint64_t h = gradapt::detail::hash_bytes(0x9E3779B97F4A7C15ull, v.data(), v.size());
  return static_cast<double>(h >> 12);
}

/// The operation name of an event's vote, for agree_values and its messages.
constexpr std::string_view vote_name(job_event e) {
  constexpr std::array<std::string_view, 6> names{"gradapt::elastic::adaptive_job vote (before_train)",
                                                  "gradapt::elastic::adaptive_job vote (before_epoch)",
                                                  "gradapt::elastic::adaptive_job vote (after_step)",
                                                  "gradapt::elastic::adaptive_job vote (after_epoch)",
                                                  "gradapt::elastic::adaptive_job vote (after_train)",
                                                  "gradapt::elastic::adaptive_job vote (on_world_change)"};
  const auto i = static_cast<std::size_t>(e);
  return i < names.size() ? names[i] : std::string_view("gradapt::elastic::adaptive_job vote");
}

/// This rank's error for an invalid action (empty when it is valid); sorts drop_ranks.
inline std::string check_action(job_action& a, int ranks, int rank, std::string_view where) {
  const auto bad = [&](auto&&... what) { return message(where, " on rank ", rank, ": ", what...); };
  if (a.lr && !(std::isfinite(*a.lr) && *a.lr >= 0.0))
    return bad("job_action::lr is ", *a.lr, " (expected a finite learning rate >= 0)");
  if (a.local_batch && !(std::isfinite(*a.local_batch) && *a.local_batch > 0.0))
    return bad("job_action::local_batch is ", *a.local_batch, " (expected a finite number of examples > 0)");
  if (a.accumulation_steps && *a.accumulation_steps < 1)
    return bad("job_action::accumulation_steps is ", *a.accumulation_steps, " (expected >= 1)");
  if (a.period && *a.period < 1)
    return bad("job_action::period is ", *a.period,
               " (expected K >= 1 local steps between averaging rounds)");
  if (a.rank_batches) {
    const auto& b = *a.rank_batches;
    if (!b.empty() && b.size() != static_cast<std::size_t>(ranks))
      return bad("job_action::rank_batches holds ", b.size(), " sizes for ", ranks,
                 " ranks (one per rank in rank order, or none for local_batch everywhere)");
    for (std::size_t r = 0; r < b.size(); ++r)
      if (!(std::isfinite(b[r]) && b[r] > 0.0))
        return bad("job_action::rank_batches[", r, "] is ", b[r],
                   " (expected a finite number of examples > 0)");
  }
  std::sort(a.drop_ranks.begin(), a.drop_ranks.end());
  for (std::size_t i = 0; i < a.drop_ranks.size(); ++i) {
    const int r = a.drop_ranks[i];
    if (r < 0 || r >= ranks)
      return bad("job_action::drop_ranks holds rank ", r, " (expected 0 to ", ranks - 1, ")");
    if (i > 0 && a.drop_ranks[i - 1] == r) return bad("job_action::drop_ranks holds rank ", r, " twice");
  }
  if (a.drop_ranks.size() >= static_cast<std::size_t>(ranks))
    return bad("job_action::drop_ranks asks to drop all ", ranks, " ranks (at least one must stay)");
  if (a.world_size && *a.world_size < 1)
    return bad("job_action::world_size is ", *a.world_size, " (expected >= 1 ranks)");
  return {};
}

/// Pushes the action's fields (presence and value; vectors by size and hash) for the vote.
inline void push_action(agreed_list<24>& v, const job_action& a) {
  const auto opt = [&](std::string_view set, std::string_view value, bool has, double x) {
    v.push(set, has ? 1.0 : 0.0);
    v.push(value, has ? x : 0.0);
  };
  opt("job_action::lr (set or not)", "job_action::lr", a.lr.has_value(), a.lr.value_or(0.0));
  opt("job_action::local_batch (set or not)", "job_action::local_batch", a.local_batch.has_value(),
      a.local_batch.value_or(0.0));
  opt("job_action::accumulation_steps (set or not)", "job_action::accumulation_steps",
      a.accumulation_steps.has_value(), static_cast<double>(a.accumulation_steps.value_or(0)));
  opt("job_action::period (set or not)", "job_action::period", a.period.has_value(),
      static_cast<double>(a.period.value_or(0)));
  opt("job_action::synchronous (set or not)", "job_action::synchronous", a.synchronous.has_value(),
      a.synchronous.value_or(false) ? 1.0 : 0.0);
  v.push("job_action::rank_batches (set or not)", a.rank_batches ? 1.0 : 0.0);
  v.push("job_action::rank_batches (size)",
         a.rank_batches ? static_cast<double>(a.rank_batches->size()) : 0.0);
  v.push("job_action::rank_batches (a hash of the values)",
         a.rank_batches ? vector_hash(*a.rank_batches) : 0.0);
  v.push("job_action::drop_ranks (size)", static_cast<double>(a.drop_ranks.size()));
  v.push("job_action::drop_ranks (a hash of the ranks)", vector_hash(a.drop_ranks));
  opt("job_action::world_size (set or not)", "job_action::world_size", a.world_size.has_value(),
      static_cast<double>(a.world_size.value_or(0)));
}

}  // namespace detail

// ---- the driver -------------------------------------------------------------------------------

/// Drives adaptation policies over a data-parallel step (see elastic/policy.hpp).
///
///     auto step = gradapt::train::make_data_parallel_step(comm, backend, params, opt, settings, ...);
///     gradapt::elastic::adaptive_job job(step, gradapt::elastic::straggler_policy({...}),
///                                        gradapt::elastic::sync_switch_policy({...}));
///     job.begin_train();
///     for (std::int64_t e = 0; e < epochs; ++e) {
///       job.begin_epoch(e);
///       for (...) {
///         forward_backward();
///         job.step({.loss = loss, .ready_seconds = seconds_since_the_step_began});
///         if (job.decision().resize()) { /* commit, resize, restore, job.world_changed(); */ }
///       }
///       job.end_epoch(e);
///     }
///     job.end_train();
///
/// Every call is collective over the step's communicator. An event with no policy hook costs
/// nothing; an event with one costs one `allreduce(max)` of 41 doubles (the vote). The job
/// references the step, which must outlive it (or be rebound with `world_changed(step)`), and
/// owns the policies.
///
/// @tparam Step     `train::data_parallel_step` (any type modelling `adaptive_step`)
/// @tparam Policies policy types (`job_policy`), called in this order
template <adaptive_step Step, class... Policies>
class adaptive_job {
  static_assert(((job_policy<Policies> || !train::step_hook<Policies>)&&...),
                "gradapt::elastic::adaptive_job: a policy handles only the step's events (before_step, "
                "after_step(step_settings&, const step_metrics&), on_overflow, on_rescale): pass it to "
                "train::make_data_parallel_step as a hook, or give it a job event");
  static_assert((job_policy<Policies> && ...),
                "gradapt::elastic::adaptive_job: every policy needs at least one of the members "
                "before_train, before_epoch, after_step, after_epoch, after_train, on_world_change, each "
                "taking (const job_view&, job_action&)");

 public:
  /// The step type.
  using step_type = Step;
  /// The policies, in the order they run.
  using policies_type = std::tuple<Policies...>;

  /// A job over `step` (referenced) running `policies` (owned, in this order). Not collective.
  explicit adaptive_job(Step& step, Policies... policies) : step_(&step), policies_(std::move(policies)...) {}

  /// The before_train event (collective).
  /// @throws gradapt::error on every rank when the ranks' actions differ, an action is invalid
  ///         or a policy threw on some rank; nothing is applied then
  void begin_train() { run<job_event::before_train>({}); }

  /// Begins epoch `e` (>= 0) and runs the before_epoch event (collective).
  /// @throws gradapt::error as begin_train, or when an epoch is still open or e < 0
  void begin_epoch(std::int64_t e) {
    std::string bad;
    if (in_epoch_)
      bad = detail::message(where(), ": begin_epoch(", e, ") while epoch ", epoch_,
                            " is open (call end_epoch first)");
    else if (e < 0)
      bad = detail::message(where(), ": begin_epoch(", e, ") (expected an epoch >= 0)");
    else {
      epoch_ = e;
      in_epoch_ = true;
    }
    run<job_event::before_epoch>(std::move(bad));
  }

  /// One training step (`step.step(args)`, collective) followed by the after_step event.
  /// @return the step's metrics
  /// @throws gradapt::error from the step, or as begin_train (the step has then been taken;
  ///         the action is not applied)
  const train::step_metrics& step(const step_args& args = {}) {
    step_->step(args);
    run<job_event::after_step>({});
    return step_->metrics();
  }

  /// Runs the after_epoch event and closes epoch `e` (collective).
  /// @throws gradapt::error as begin_train, or when `e` is not the open epoch
  void end_epoch(std::int64_t e) {
    std::string bad;
    if (!in_epoch_ || e != epoch_)
      bad = detail::message(
          where(), ": end_epoch(", e, ") but ",
          in_epoch_ ? "the open epoch is " + std::to_string(epoch_) : std::string("no epoch is open"),
          " (call begin_epoch(e) and end_epoch(e) in pairs)");
    run<job_event::after_epoch>(std::move(bad));
    in_epoch_ = false;
  }

  /// The after_train event (collective).
  /// @throws gradapt::error as begin_train
  void end_train() { run<job_event::after_train>({}); }

  /// The framework restored the step on a new world (`Step::restore`): clears the decision and
  /// runs the on_world_change event on the new world (collective over the new communicator).
  /// @throws gradapt::error as begin_train
  void world_changed() {
    decision_ = {};
    run<job_event::world_change>({});
  }
  /// As world_changed(), with the job rebound to `step` (a step built for the new world).
  void world_changed(Step& step) {
    step_ = &step;
    world_changed();
  }

  /// The resize requests agreed since the last world_changed() or clear_decision().
  const job_decision& decision() const { return decision_; }
  /// Forgets the resize requests (the framework declined them).
  void clear_decision() { decision_ = {}; }
  /// The action agreed and applied at the latest event that ran policies.
  const job_action& last_action() const { return last_; }

  /// The monitors as the policies see them now.
  job_view view() const {
    const auto& m = step_->metrics();
    job_view v{.metrics = m, .settings = std::as_const(*step_).settings()};
    v.ranks = step_->comm().size();
    v.rank = step_->comm().rank();
    v.epoch = epoch_;
    v.steps = static_cast<std::uint64_t>(step_->steps());
    v.rank_times = std::as_const(*step_).rank_times();
    v.rank_step_seconds = std::as_const(*step_).rank_step_seconds();
    v.global_batch = m.global_batch;
    if (!v.rank_times.empty() && v.rank_times.size() == v.rank_step_seconds.size()) {
      double slowest = 0.0;
      for (std::size_t r = 0; r < v.rank_times.size(); ++r)
        slowest = std::max(slowest, v.rank_times[r] + v.rank_step_seconds[r]);
      if (slowest > 0.0 && v.global_batch > 0.0) v.throughput = v.global_batch / slowest;
    }
    return v;
  }

  /// The step.
  Step& train_step() { return *step_; }
  /// The step (read only).
  const Step& train_step() const { return *step_; }
  /// The policies, in the order they run.
  policies_type& policies() { return policies_; }
  /// The policies (read only).
  const policies_type& policies() const { return policies_; }
  /// Policy I.
  template <std::size_t I>
  auto& policy() {
    return std::get<I>(policies_);
  }
  /// Policy I (read only).
  template <std::size_t I>
  const auto& policy() const {
    return std::get<I>(policies_);
  }

  /// Kind and format version of the archive save_policies() writes.
  static constexpr std::string_view archive_kind = "gradapt.elastic.policies";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The state of every policy with `save(archive_writer&) const` / `load(archive_reader&)`
  /// (`train::saves_state`), section "policy<i>" for the i-th policy. Not collective.
  std::vector<std::byte> save_policies() const {
    archive_writer w{archive_kind, archive_version};
    w.put("policies", static_cast<std::uint64_t>(sizeof...(Policies)));
    for_each_saved(*this, [&](const std::string& section, const auto& p) {
      w.begin(section);
      p.save(w);
      w.end();
    });
    return w.finish();
  }

  /// Restores the policies' states written by save_policies() of a job with the same policy
  /// types. Not collective (every rank loads the same bytes). All or nothing: on a throw every
  /// policy's state is unchanged.
  /// @throws gradapt::error naming what does not fit (archive, policy count, a policy's field)
  void load_policies(std::span<const std::byte> bytes) {
    const std::vector<std::byte> backup = save_policies();
    try {
      load_impl(bytes);
    } catch (...) {
      load_impl(backup);
      throw;
    }
  }

 private:
  static constexpr const char* where() { return "gradapt::elastic::adaptive_job"; }

  template <class Self, class F>
  static void for_each_saved(Self& self, F&& f) {
    std::size_t i = 0;
    std::apply(
        [&](auto&... p) {
          (
              [&] {
                if constexpr (train::saves_state<hook_object_t<decltype(p)>>)
                  f("policy" + std::to_string(i), hook_object(p));
                ++i;
              }(),
              ...);
        },
        self.policies_);
  }

  void load_impl(std::span<const std::byte> bytes) {
    archive_reader r{bytes, archive_kind, archive_version};
    const auto n = r.get<std::uint64_t>("policies");
    detail::require(n == sizeof...(Policies), where(), "::load_policies: the archive holds ", n,
                    " policies but this job has ", sizeof...(Policies),
                    " (load into a job with the same policies in the same order)");
    for_each_saved(*this, [&](const std::string& section, auto& p) {
      r.begin(section);
      p.load(r);
      r.end();
    });
    r.finish();
  }

  template <job_event E>
  void run(std::string bad) {
    using event = detail::event_of<E>;
    if constexpr (!any_handles<event, policies_type>) {
      if (!bad.empty()) throw error(bad);
    } else {
      const job_view v = view();
      job_action a;
      if (bad.empty()) {
        std::size_t i = 0;
        try {
          notify_tracked<event>(policies_, i, v, a);
        } catch (const std::exception& e) {
          bad = detail::message(where(), " on rank ", v.rank, ": policy ", i, "'s ", event::name,
                                " threw: ", e.what());
        }
      }
      if (bad.empty()) bad = detail::check_action(a, v.ranks, v.rank, where());
      agreed_list<24> list;
      list.push("the job's step count", static_cast<double>(v.steps));
      list.push("the epoch", static_cast<double>(v.epoch));
      detail::push_action(list, a);
      agree_values(step_->comm(), detail::vote_name(E), list.view(), bad);
      apply(a, v.steps);
    }
  }

  void apply(job_action& a, std::uint64_t steps) {
    train::step_settings& s = step_->settings();
    if (a.lr) s.lr = *a.lr;
    if (a.local_batch) s.local_batch = *a.local_batch;
    if (a.accumulation_steps) s.accumulation_steps = *a.accumulation_steps;
    if (a.period) s.period = *a.period;
    if (a.synchronous) s.synchronous = *a.synchronous;
    if (a.rank_batches) s.rank_batches = *a.rank_batches;
    if (!a.drop_ranks.empty()) {
      std::vector<int> merged;
      std::set_union(decision_.drop_ranks.begin(), decision_.drop_ranks.end(), a.drop_ranks.begin(),
                     a.drop_ranks.end(), std::back_inserter(merged));
      decision_.drop_ranks = std::move(merged);
      decision_.step = steps;
    }
    if (a.world_size) {
      decision_.world_size = a.world_size;
      decision_.step = steps;
    }
    last_ = std::move(a);
  }

  Step* step_;
  policies_type policies_;
  std::int64_t epoch_ = 0;
  bool in_epoch_ = false;
  job_decision decision_;
  job_action last_;
};

}  // namespace gradapt::elastic

#pragma once
/// @file
/// The built-in adaptation policies of `adaptive_job` (elastic/job.hpp): `straggler_policy`
/// (detect, rebalance or drop slow ranks), `sync_switch_policy` (switch to LocalSGD's local
/// steps while the throughput is low) and `goodput_policy` (Pollux's batch re-planning with
/// `search_goodput`), each with its options.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/elastic/job.hpp"
#include "gradapt/elastic/straggler.hpp"
#include "gradapt/scaling/goodput.hpp"

namespace gradapt::elastic {

// ---- straggler_policy -------------------------------------------------------------------------

/// What `straggler_policy` does when its detector raises a rank.
enum class straggler_response : unsigned char {
  report,     ///< nothing: the report is read with `straggler_policy::report()`
  rebalance,  ///< per-rank batches proportional to each rank's speed (`job_action::rank_batches`)
  drop,       ///< ask the framework to remove the flagged ranks (`job_action::drop_ranks`)
};

/// Options of `straggler_policy`; `straggler_policy::validate` names the first invalid one.
struct straggler_policy_options {
  straggler_response response = straggler_response::report;  ///< what to do on a raise
  straggler_options detector{};                              ///< the detector's options
  /// rebalance: the examples of one micro-batch over all ranks that the per-rank batches
  /// (`step_settings::rank_batches`) sum to (>= ranks × min_batch; required for rebalance).
  std::int64_t global_batch = 0;
  std::int64_t min_batch = 1;  ///< rebalance: the smallest batch a rank gets (>= 1)
};

/// Watches every rank's time-to-ready with a `straggler_detector` (after_step; the times come
/// from the step's agreement, identical on every rank) and, when the detector raises a rank,
/// reports it, rebalances the batches or asks for the rank to be dropped.
///
/// With `rebalance` the detector is fed each rank's time per example (time-to-ready / the
/// rank's batch), so a rank keeps its speed after its batch shrinks and the shares do not
/// oscillate. It proposes `straggler_detector::rebalance(global_batch, min_batch)` when a rank
/// is raised or cleared, and once more `window` steps later, when the speeds (medians over the
/// window) hold only steps after the change. With `drop` it proposes the flagged ranks as
/// `drop_ranks` at every raise. The detector is not saved (it has no checkpoint): it restarts
/// after a world change, and a policy loaded by load_policies has no state to restore.
class straggler_policy {
 public:
  /// A policy with options `o`. @throws gradapt::error naming the first invalid option
  explicit straggler_policy(const straggler_policy_options& o = {}) : o_(o) { validate(o_); }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const straggler_policy_options& o) {
    straggler_detector::validate(o.detector);
    detail::require(o.response == straggler_response::report || o.response == straggler_response::rebalance ||
                        o.response == straggler_response::drop,
                    "straggler_policy_options: response is ", int(o.response),
                    " (expected report, rebalance or drop)");
    detail::require(o.min_batch >= 1, "straggler_policy_options: min_batch is ", o.min_batch,
                    " (expected >= 1)");
    if (o.response == straggler_response::rebalance)
      detail::require(o.global_batch >= o.min_batch, "straggler_policy_options: global_batch is ",
                      o.global_batch,
                      " (rebalance needs the examples per step over all ranks, >= ranks x min_batch)");
  }

  /// Observes the latest step's times and acts on a raise.
  /// @throws gradapt::error when the step reported no per-rank times, or as the detector
  void after_step(const job_view& v, job_action& a) {
    detail::require(!v.rank_times.empty(),
                    "straggler_policy: the step reported no per-rank times (pass step_args::ready_seconds on "
                    "every rank)");
    if (!det_ || det_->ranks() != v.ranks) det_.emplace(v.ranks, o_.detector);
    const straggler_report* rep = nullptr;
    if (o_.response == straggler_response::rebalance) {
      per_example_.assign(v.rank_times.begin(), v.rank_times.end());
      for (std::size_t r = 0; r < per_example_.size(); ++r) per_example_[r] /= batch_of(v, r);
      rep = &det_->observe(per_example_);
    } else {
      rep = &det_->observe(v.rank_times);
    }
    switch (o_.response) {
      case straggler_response::report:
        break;
      case straggler_response::rebalance: {
        const bool changed = !rep->raised.empty() || !rep->cleared.empty();
        if (changed || det_->steps() == settle_at_) {
          const auto b = det_->rebalance(o_.global_batch, o_.min_batch);
          a.rank_batches = std::vector<double>(b.begin(), b.end());
          // Once more when the window holds only steps after the change.
          settle_at_ = changed ? det_->steps() + o_.detector.window : 0;
        }
        break;
      }
      case straggler_response::drop:
        if (!rep->raised.empty()) a.drop_ranks = rep->flagged;
        break;
    }
  }

  /// A fresh detector for the new world's size.
  void on_world_change(const job_view& v, job_action&) {
    det_.emplace(v.ranks, o_.detector);
    settle_at_ = 0;
  }

  /// The options.
  const straggler_policy_options& options() const { return o_; }
  /// Whether a detector exists (after the first step or a world change).
  bool watching() const { return det_.has_value(); }
  /// The detector. @throws gradapt::error before the first step or world change
  const straggler_detector& detector() const {
    detail::require(det_.has_value(), "straggler_policy::detector: no step observed yet");
    return *det_;
  }
  /// The detector's latest report. @throws gradapt::error before the first step or world change
  const straggler_report& report() const { return detector().report(); }

 private:
  static double batch_of(const job_view& v, std::size_t r) {
    if (v.settings.rank_batches.size() == static_cast<std::size_t>(v.ranks))
      return v.settings.rank_batches[r];
    return v.settings.local_batch;
  }

  straggler_policy_options o_;
  std::optional<straggler_detector> det_;
  std::vector<double> per_example_;
  std::uint64_t settle_at_ = 0;  ///< rebalance: the detector step of the settled rebalance (0: none)
};

// ---- sync_switch_policy -----------------------------------------------------------------------

/// Options of `sync_switch_policy`; `sync_switch_policy::validate` names the first invalid one.
struct sync_switch_options {
  /// Steps with a throughput whose median becomes the reference (>= 1), unless `reference` is set.
  std::size_t warmup = 10;
  /// The reference throughput in examples per second (> 0), or 0 to measure it over `warmup` steps.
  double reference = 0.0;
  /// Switch to local steps when the throughput is below fraction × reference (0 < fraction < 1).
  double fraction = 0.8;
  /// Switch back when the throughput is above fraction_back × reference (>= fraction, finite).
  double fraction_back = 0.95;
  /// Consecutive slow steps before switching to local steps (>= 1).
  std::size_t patience = 5;
};

/// KungFu's adaptive synchronisation over a step with a `local_sgd_policy` in its sync slot:
/// while the job's throughput stays low (a congested network), follow LocalSGD's schedule
/// (`synchronous = false`: local steps, fewer collectives), and combine at every step
/// (`synchronous = true`, LocalSGD paused) while it is high.
///
/// The reference throughput is the median of the first `warmup` synchronous steps that have a
/// throughput (or `options.reference`); while it is measured the policy asks for
/// `synchronous = true` when the settings hold false. Then, in synchronous mode, `patience`
/// consecutive steps below fraction × reference propose `synchronous = false`; in local mode,
/// the first step above fraction_back × reference proposes `synchronous = true`. The mode is
/// the step's `settings.synchronous`. Steps without a throughput (the first step: no time
/// inside step() yet) are skipped. Deterministic from the agreed monitors, so every rank
/// proposes the same. Saves its reference, the warm-up samples and the slow count.
class sync_switch_policy {
 public:
  /// A policy with options `o`. @throws gradapt::error naming the first invalid option
  explicit sync_switch_policy(const sync_switch_options& o = {}) : o_(o) {
    validate(o_);
    reference_ = o_.reference;
  }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const sync_switch_options& o) {
    constexpr const char* w = "sync_switch_options";
    detail::require(o.warmup >= 1, w, ": warmup is ", o.warmup, " (expected >= 1 steps)");
    detail::require(std::isfinite(o.reference) && o.reference >= 0.0, w, ": reference is ", o.reference,
                    " (expected examples per second > 0, or 0 to measure it)");
    detail::require(std::isfinite(o.fraction) && o.fraction > 0.0 && o.fraction < 1.0, w, ": fraction is ",
                    o.fraction, " (expected 0 < fraction < 1)");
    detail::require(std::isfinite(o.fraction_back) && o.fraction_back >= o.fraction, w, ": fraction_back is ",
                    o.fraction_back, " (expected finite and >= fraction = ", o.fraction, ")");
    detail::require(o.patience >= 1, w, ": patience is ", o.patience, " (expected >= 1 steps)");
  }

  /// Measures the reference, counts slow steps and proposes a switch.
  /// @throws gradapt::error when the step reported no per-rank times
  void after_step(const job_view& v, job_action& a) {
    detail::require(!v.rank_times.empty(),
                    "sync_switch_policy: the step reported no per-rank times, so the job has no throughput "
                    "(pass step_args::ready_seconds on every rank)");
    const double t = v.throughput;
    if (!(reference_ > 0.0)) {
      if (!v.settings.synchronous) a.synchronous = true;  // the reference is a synchronous one
      if (!std::isfinite(t) || !v.metrics.synchronous) return;
      samples_.push_back(t);
      if (samples_.size() == o_.warmup) {
        reference_ = detail::median(samples_);  // cleared next
        samples_.clear();
      }
      return;
    }
    if (!std::isfinite(t)) return;
    if (v.settings.synchronous) {
      slow_ = t < o_.fraction * reference_ ? slow_ + 1 : 0;
      if (slow_ >= o_.patience) {
        a.synchronous = false;
        slow_ = 0;
      }
    } else if (t > o_.fraction_back * reference_) {
      a.synchronous = true;
      slow_ = 0;
    }
  }

  /// The options.
  const sync_switch_options& options() const { return o_; }
  /// The reference throughput (0 while warming up).
  double reference() const { return reference_; }
  /// Consecutive slow steps counted so far.
  std::size_t slow_steps() const { return slow_; }

  /// Writes the reference, the warm-up samples and the slow count.
  void save(archive_writer& w) const {
    w.put("reference", reference_);
    w.put_tensor<double>("samples", std::span<const double>(samples_));
    w.put("slow", static_cast<std::uint64_t>(slow_));
  }
  /// Reads what save wrote (all or nothing).
  /// @throws gradapt::error when a field is missing or invalid
  void load(archive_reader& r) {
    const double ref = r.get<double>("reference");
    std::vector<double> samples = r.get_tensor<double>("samples");
    const auto slow = r.get<std::uint64_t>("slow");
    detail::require(std::isfinite(ref) && ref >= 0.0, "sync_switch_policy::load: reference is ", ref,
                    " (expected >= 0)");
    detail::require(samples.size() < o_.warmup, "sync_switch_policy::load: ", samples.size(),
                    " warm-up samples but warmup is ", o_.warmup);
    reference_ = ref;
    samples_ = std::move(samples);
    slow_ = static_cast<std::size_t>(slow);
  }

 private:
  sync_switch_options o_;
  double reference_ = 0.0;
  std::vector<double> samples_;
  std::size_t slow_ = 0;
};

// ---- goodput_policy ---------------------------------------------------------------------------

/// Options of `goodput_policy`; `goodput_policy::validate` names the first invalid one.
struct goodput_policy_options {
  throughput_params model{};        ///< the step-time model (fitted by the user or by goodput_fit)
  goodput_search_options search{};  ///< the ranges searched and the hysteresis
  double base_batch = 0.0;          ///< M0, the global batch the learning rate was tuned for (> 0)
  std::uint64_t every = 100;        ///< re-plan every this many steps (>= 1), and on every world change
  /// Ranks per node (0: every rank on one node); the replicas span ceil(ranks / ranks_per_node) nodes.
  int ranks_per_node = 0;
};

/// Pollux's co-adaptation: on every world change and every `every` steps, searches the
/// micro-batch and accumulation steps of the highest predicted goodput at the current world
/// size (`search_goodput` with the step's noise scale and the base batch) and, when the search
/// switches (hysteresis), proposes `local_batch` and `accumulation_steps`. While the noise
/// scale is undefined (NaN) or negative (too few samples) it does nothing. The step's
/// `local_batch` must be a whole number of examples.
class goodput_policy {
 public:
  /// A policy with options `o`. @throws gradapt::error naming the first invalid option
  explicit goodput_policy(const goodput_policy_options& o) : o_(o) { validate(o_); }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const goodput_policy_options& o) {
    constexpr const char* w = "goodput_policy_options";
    gradapt::validate(o.model);
    detail::require(std::isfinite(o.base_batch) && o.base_batch > 0.0, w, ": base_batch is ", o.base_batch,
                    " (expected the positive global batch M0 the learning rate was tuned for)");
    detail::require(o.every >= 1, w, ": every is ", o.every, " (expected >= 1 steps between re-plans)");
    detail::require(o.ranks_per_node >= 0, w, ": ranks_per_node is ", o.ranks_per_node,
                    " (expected >= 1, or 0 for one node)");
    const auto& s = o.search;
    detail::require(s.min_atomic_batch >= 1, w, ": search.min_atomic_batch is ", s.min_atomic_batch,
                    " (expected >= 1)");
    detail::require(s.max_atomic_batch >= s.min_atomic_batch, w, ": search.max_atomic_batch is ",
                    s.max_atomic_batch, " (expected >= min_atomic_batch = ", s.min_atomic_batch,
                    ": the largest micro-batch that fits in memory)");
    detail::require(s.atomic_batch_step >= 1, w, ": search.atomic_batch_step is ", s.atomic_batch_step,
                    " (expected >= 1)");
    detail::require(s.min_accum_steps >= 1, w, ": search.min_accum_steps is ", s.min_accum_steps,
                    " (expected >= 1)");
    detail::require(s.max_accum_steps >= s.min_accum_steps, w, ": search.max_accum_steps is ",
                    s.max_accum_steps, " (expected >= min_accum_steps = ", s.min_accum_steps, ")");
    detail::require(!std::isnan(s.max_global_batch) && s.max_global_batch > 0.0, w,
                    ": search.max_global_batch is ", s.max_global_batch, " (expected > 0, +inf for none)");
    detail::require(std::isfinite(s.hysteresis) && s.hysteresis >= 0.0, w, ": search.hysteresis is ",
                    s.hysteresis, " (expected finite and >= 0)");
  }

  /// Re-plans every `every` steps.
  void after_step(const job_view& v, job_action& a) {
    if (v.steps % o_.every == 0) plan(v, a);
  }
  /// Re-plans for the new world.
  void on_world_change(const job_view& v, job_action& a) { plan(v, a); }

  /// The options.
  const goodput_policy_options& options() const { return o_; }
  /// The latest search (none before the first re-plan with a defined noise scale).
  const std::optional<goodput_search_result>& last_search() const { return last_; }
  /// The number of nodes `ranks` replicas span under the options.
  int nodes(int ranks) const {
    return o_.ranks_per_node == 0 ? 1 : (ranks + o_.ranks_per_node - 1) / o_.ranks_per_node;
  }

 private:
  void plan(const job_view& v, job_action& a) {
    const double noise = v.metrics.noise_scale;
    if (std::isnan(noise) || noise < 0.0) return;
    const double m = v.settings.local_batch;
    detail::require(m >= 1.0 && m == std::floor(m) && m <= double(std::numeric_limits<int>::max()),
                    "goodput_policy: step_settings::local_batch is ", m,
                    " (expected a whole number of examples >= 1 to search from)");
    const goodput_config current{.atomic_batch = static_cast<int>(m),
                                 .accum_steps = v.settings.accumulation_steps,
                                 .replicas = v.ranks,
                                 .nodes = nodes(v.ranks)};
    last_ = search_goodput(o_.model, {.noise_scale = noise, .base_batch = o_.base_batch}, v.ranks,
                           nodes(v.ranks), current, o_.search);
    if (last_->switched) {
      a.local_batch = static_cast<double>(last_->config.atomic_batch);
      a.accumulation_steps = last_->config.accum_steps;
    }
  }

  goodput_policy_options o_;
  std::optional<goodput_search_result> last_;
};

}  // namespace gradapt::elastic

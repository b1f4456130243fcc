#pragma once
/// @file
/// Straggler detection (Or et al., "Resource Elasticity in Distributed Deep Learning", MLSys
/// 2020; KungFu's monitors, OSDI 2020): each rank's time-to-ready, measured before the
/// collective that would hide it (an allreduce makes every rank's step as slow as the slowest,
/// so a straggler shows only in the time before it), shared among the ranks, judged by robust
/// statistics and a persistence filter.
///
/// Per step, rank r is *slow* when its time t_r exceeds both
///
///     m_r + z · max(1.4826 · MAD_r, floor · m_r)    and    min_ratio · m_r
///
/// where m_r and MAD_r are the median and the median absolute deviation of the OTHER ranks'
/// times over the last `window` steps (leave-one-out: a straggler does not shift its own
/// baseline, and two ranks compare with each other). A rank is *flagged* while it was slow in
/// at least `persistence` of the last `window` steps; a single slow step (a pause, a page
/// fault) raises nothing. docs/algorithms/elastic.md has the options, the costs and the tests.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::elastic {

namespace detail {
using gradapt::detail::require;

/// The median of v (the mean of the two middle values for an even count; v non-empty),
/// reordering v. Shared by the detector and the policies (elastic/builtin_policies.hpp).
inline double median(std::vector<double>& v) {
  const std::size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(h), v.end());
  const double hi = v[h];
  if (v.size() % 2) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(h));
  return lo + (hi - lo) / 2;
}
}  // namespace detail

/// Options of `straggler_detector`; `validate` names the first invalid one.
struct straggler_options {
  /// W: steps of history each decision looks at (>= 2). Default 20.
  std::size_t window = 20;
  /// K: a rank is flagged while slow in at least K of the last W steps (1..W). Default 5.
  std::size_t persistence = 5;
  /// z: robust standard deviations above the other ranks' median (> 0). Default 4.
  double threshold = 4.0;
  /// A slow step is also at least this multiple of the other ranks' median (>= 1). Default 1.5.
  double min_ratio = 1.5;
  /// The spread is at least floor × median, so ranks with near-identical times do not turn
  /// tiny differences into slow steps (>= 0). Default 0.05.
  double floor = 0.05;
};

/// What one step changed: the flagged ranks after it, and the ranks raised and cleared by it
/// (ascending rank order).
struct straggler_report {
  std::uint64_t step = 0;    ///< steps observed, this one included
  std::vector<int> flagged;  ///< ranks flagged after this step
  std::vector<int> raised;   ///< ranks flagged at this step and not before
  std::vector<int> cleared;  ///< ranks flagged before this step and not after
  std::vector<bool> slow;    ///< per rank: slow at this step
};

/// Flags ranks whose time-to-ready is persistently above the others' (see the file comment).
/// Every rank keeps its own detector; `observe(comm, t)` gives every rank the same times, so
/// every rank reaches the same decisions at the same step.
class straggler_detector {
 public:
  /// A detector for `ranks` ranks.
  /// @throws gradapt::error for ranks < 1 or an invalid option, naming it
  explicit straggler_detector(int ranks, const straggler_options& o = {}) : o_(o), n_(ranks) {
    validate(o_);
    detail::require(ranks >= 1, "straggler_detector: ranks is ", ranks, " (expected >= 1)");
    const auto n = static_cast<std::size_t>(ranks);
    times_.assign(o_.window * n, 0.0);
    slow_.assign(o_.window * n, 0);
    count_.assign(n, 0);
    flag_.assign(n, false);
    rep_.slow.assign(n, false);
  }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const straggler_options& o) {
    constexpr const char* w = "straggler_options";
    detail::require(o.window >= 2, w, ": window is ", o.window, " (expected >= 2 steps)");
    detail::require(o.persistence >= 1 && o.persistence <= o.window, w, ": persistence is ", o.persistence,
                    " (expected 1 to window = ", o.window, ")");
    detail::require(std::isfinite(o.threshold) && o.threshold > 0, w, ": threshold is ", o.threshold,
                    " (expected finite and > 0)");
    detail::require(std::isfinite(o.min_ratio) && o.min_ratio >= 1, w, ": min_ratio is ", o.min_ratio,
                    " (expected finite and >= 1)");
    detail::require(std::isfinite(o.floor) && o.floor >= 0, w, ": floor is ", o.floor,
                    " (expected finite and >= 0)");
  }

  /// The options.
  const straggler_options& options() const { return o_; }
  /// Ranks watched.
  int ranks() const { return n_; }
  /// Steps observed.
  std::uint64_t steps() const { return steps_; }
  /// The last step's report.
  const straggler_report& report() const { return rep_; }
  /// Whether rank r is flagged. @throws gradapt::error when r is out of range
  bool flagged(int r) const { return flag_[idx(r)]; }
  /// Median of rank r's own times over the window (0 before any step).
  double typical_time(int r) const {
    const auto i = idx(r);
    const std::size_t filled = std::min<std::uint64_t>(steps_, o_.window);
    scratch_.clear();
    for (std::size_t s = 0; s < filled; ++s) scratch_.push_back(times_[s * static_cast<std::size_t>(n_) + i]);
    return filled ? median(scratch_) : 0.0;
  }

  /// Records one step: every rank's time-to-ready in seconds (finite, >= 0), in rank order.
  /// @throws gradapt::error for a count other than ranks() or a time that is not finite and
  ///         >= 0 (nothing recorded)
  const straggler_report& observe(std::span<const double> times) {
    detail::require(times.size() == static_cast<std::size_t>(n_),
                    "straggler_detector::observe: ", times.size(), " times for ", n_,
                    " ranks (one per rank, in rank order)");
    for (std::size_t r = 0; r < times.size(); ++r)
      detail::require(std::isfinite(times[r]) && times[r] >= 0, "straggler_detector::observe: rank ", r,
                      "'s time is ", times[r], " (expected finite seconds >= 0)");
    const auto n = static_cast<std::size_t>(n_);
    const std::size_t slot = static_cast<std::size_t>(steps_ % o_.window);
    const std::size_t filled = static_cast<std::size_t>(std::min<std::uint64_t>(steps_ + 1, o_.window));
    for (std::size_t r = 0; r < n; ++r) times_[slot * n + r] = times[r];
    rep_.raised.clear();
    rep_.cleared.clear();
    rep_.flagged.clear();
    for (std::size_t r = 0; r < n; ++r) {
      bool slow = false;
      if (n > 1) {
        scratch_.clear();
        for (std::size_t s = 0; s < filled; ++s)
          for (std::size_t q = 0; q < n; ++q)
            if (q != r) scratch_.push_back(times_[s * n + q]);
        const double m = median(scratch_);
        for (double& x : scratch_) x = std::fabs(x - m);
        const double spread = std::max(1.4826 * median(scratch_), o_.floor * m);
        slow = times[r] > m + o_.threshold * spread && times[r] > o_.min_ratio * m;
      }
      // The window's oldest mark leaves as the new one enters.
      if (steps_ >= o_.window) count_[r] -= slow_[slot * n + r];
      slow_[slot * n + r] = slow ? 1 : 0;
      count_[r] += slow_[slot * n + r];
      rep_.slow[r] = slow;
      const bool now = count_[r] >= o_.persistence;
      if (now && !flag_[r]) rep_.raised.push_back(static_cast<int>(r));
      if (!now && flag_[r]) rep_.cleared.push_back(static_cast<int>(r));
      flag_[r] = now;
      if (now) rep_.flagged.push_back(static_cast<int>(r));
    }
    rep_.step = ++steps_;
    return rep_;
  }

  /// Every rank passes its own time-to-ready (measured before the step's collective); one
  /// allgather of two doubles per rank (the time and this detector's step count) gives every
  /// rank every time, then `observe(times)`. A rank with an invalid time, or detectors at
  /// different steps, is an error on every rank naming the rank.
  /// @throws gradapt::error as observe(times), for a communicator of another size, or as above
  template <communicator Comm>
  requires std::same_as<typename Comm::space, host_space>
  const straggler_report& observe(Comm& comm, double my_time) {
    detail::require(comm.size() == n_, "straggler_detector::observe: the communicator has ", comm.size(),
                    " ranks but the detector watches ", n_, " (make a detector for the new world)");
    const double mine[2] = {my_time, static_cast<double>(steps_)};
    all_.resize(2 * static_cast<std::size_t>(n_));
    comm.allgather(tensor_view<const double, host_space>::vector(mine, 2),
                   tensor_view<double, host_space>::vector(all_.data(), 2 * static_cast<std::int64_t>(n_)));
    auto& times = gathered_;
    times.resize(static_cast<std::size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      detail::require(all_[2 * i + 1] == all_[1], "straggler_detector::observe on rank ", comm.rank(),
                      ": rank ", r, "'s detector has observed ", all_[2 * i + 1], " steps but rank 0's ",
                      all_[1], " (every rank observes every step)");
      times[i] = all_[2 * i];
    }
    return observe(times);
  }

  /// Per-rank batch sizes proportional to each rank's speed (1 / typical_time), each at least
  /// `min_batch`, summing exactly to `global_batch`. The speeds are quantised to integers
  /// (2^20 for the fastest rank, each other in proportion, rounded) and the spare examples
  /// (global_batch − ranks() · min_batch) are shared in exact integer arithmetic: each rank's
  /// floor of spare · q_r / Σ q, and the few left over one each to the largest remainders
  /// (ties to the faster rank, then the lower rank). So a faster rank never gets fewer
  /// examples than a slower one, and any int64 global batch is handled exactly. A rank whose
  /// typical time is 0 is the fastest possible: the ranks at 0 share the spare examples equally
  /// and the others get min_batch. Equal shares before any step.
  /// @throws gradapt::error when min_batch < 1 or global_batch < ranks() · min_batch
  std::vector<std::int64_t> rebalance(std::int64_t global_batch, std::int64_t min_batch = 1) const {
    // min_batch · n <= global_batch, without forming the product (it may overflow).
    detail::require(min_batch >= 1 && global_batch >= 0 && min_batch <= global_batch / n_,
                    "straggler_detector::rebalance: ", "global_batch ", global_batch, " cannot give ", n_,
                    " ranks at least ", min_batch, " each (min_batch >= 1)");
    const auto n = static_cast<std::size_t>(n_);
    std::vector<std::int64_t> q(n, 1);  // quantised speeds
    if (steps_ > 0) {
      std::vector<double> t(n);
      bool zero = false;
      double fastest = 0.0;  // the largest finite speed 1 / t
      for (std::size_t r = 0; r < n; ++r) {
        t[r] = typical_time(static_cast<int>(r));
        zero = zero || t[r] == 0.0;
        if (t[r] > 0.0 && std::isfinite(t[r])) fastest = std::max(fastest, 1.0 / t[r]);
      }
      for (std::size_t r = 0; r < n; ++r) {
        if (zero)
          q[r] = t[r] == 0.0 ? 1 : 0;
        else if (fastest > 0.0 && std::isfinite(fastest))
          q[r] = t[r] > 0.0 && std::isfinite(t[r]) ? std::llround(std::ldexp(1.0 / t[r] / fastest, 20)) : 0;
      }
      if (std::all_of(q.begin(), q.end(), [](std::int64_t v) { return v == 0; })) q.assign(n, 1);
    }
    std::int64_t total = 0;  // at most n · 2^20
    for (const std::int64_t v : q) total += v;
    const std::int64_t spare = global_batch - min_batch * n_;  // the product fits: checked above
    const std::int64_t whole = spare / total, part = spare % total;
    std::vector<std::int64_t> out(n), rem(n);
    std::int64_t given = 0;
    for (std::size_t r = 0; r < n; ++r) {
      // spare · q / total = whole · q + part · q / total, with part · q < n · 2^40 (no overflow)
      out[r] = whole * q[r] + part * q[r] / total;
      rem[r] = part * q[r] % total;
      given += out[r];
    }
    std::vector<std::size_t> order(n);
    for (std::size_t r = 0; r < n; ++r) order[r] = r;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return rem[a] != rem[b] ? rem[a] > rem[b] : q[a] > q[b];
    });
    for (std::size_t k = 0; given < spare; ++k, ++given) ++out[order[k]];  // fewer than n left
    for (auto& b : out) b += min_batch;
    return out;
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.straggler";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// Writes the detector into the open section of `w`: ranks, window, persistence, steps, the
  /// window's times and slow marks (window × ranks, ring by step) and the flags.
  void save(archive_writer& w) const {
    const auto n = static_cast<std::int64_t>(n_), win = static_cast<std::int64_t>(o_.window);
    w.put("ranks", static_cast<std::uint64_t>(n_));
    w.put("window", static_cast<std::uint64_t>(o_.window));
    w.put("persistence", static_cast<std::uint64_t>(o_.persistence));
    w.put("steps", steps_);
    const std::int64_t sh[2] = {win, n};
    w.put_tensor<double>("times", std::span<const double>(times_), sh);
    std::vector<std::int64_t> marks(slow_.begin(), slow_.end()), flags(flag_.begin(), flag_.end());
    w.put_tensor<std::int64_t>("slow", std::span<const std::int64_t>(marks), sh);
    w.put_tensor<std::int64_t>("flagged", std::span<const std::int64_t>(flags));
  }

  /// Reads what `save(w)` wrote into a detector made for the same ranks and options (window,
  /// persistence). All or nothing: the counts must match, every time must be finite and >= 0,
  /// every mark and flag 0 or 1, the rows not yet filled (fewer steps than the window) all
  /// zero, and each flag must be what its marks give (at least `persistence` of them). The
  /// last step's report comes back with its slow marks and flags; its raised and cleared lists
  /// are empty (they describe a transition the checkpoint does not hold).
  /// @throws gradapt::error naming the first field that does not fit
  void load(archive_reader& r) {
    constexpr const char* who = "straggler_detector::load";
    const auto n = static_cast<std::size_t>(n_), win = o_.window;
    const auto ranks = r.get<std::uint64_t>("ranks");
    detail::require(ranks == n, who, ": the checkpoint watches ", ranks, " ranks but this detector ", n,
                    " (make a detector for the checkpoint's world)");
    const auto window = r.get<std::uint64_t>("window"), persistence = r.get<std::uint64_t>("persistence");
    detail::require(window == win && persistence == o_.persistence, who, ": the checkpoint has window ",
                    window, " and persistence ", persistence, " but this detector ", win, " and ",
                    o_.persistence, " (restore with the same straggler_options)");
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), who, ": steps is ", steps,
                    " (the count could not grow)");
    const std::int64_t sh[2] = {static_cast<std::int64_t>(win), static_cast<std::int64_t>(n)};
    std::vector<double> times(win * n);
    std::vector<std::int64_t> marks(win * n), flags(n);
    r.get_tensor<double>("times", std::span<double>(times), sh);
    r.get_tensor<std::int64_t>("slow", std::span<std::int64_t>(marks), sh);
    r.get_tensor<std::int64_t>("flagged", std::span<std::int64_t>(flags));
    const std::size_t filled = static_cast<std::size_t>(std::min<std::uint64_t>(steps, win));
    std::vector<std::size_t> count(n, 0);
    for (std::size_t s = 0; s < win; ++s)
      for (std::size_t q = 0; q < n; ++q) {
        const double t = times[s * n + q];
        const std::int64_t m = marks[s * n + q];
        detail::require(std::isfinite(t) && t >= 0, who, ": field times[", s, "][", q, "] is ", t,
                        " (expected finite seconds >= 0)");
        detail::require(m == 0 || m == 1, who, ": field slow[", s, "][", q, "] is ", m, " (expected 0 or 1)");
        detail::require(s < filled || (t == 0 && m == 0), who, ": field times/slow[", s, "][", q,
                        "] is set but only ", filled, " of the window's rows have been filled (", steps,
                        " steps)");
        count[q] += static_cast<std::size_t>(m);
      }
    for (std::size_t q = 0; q < n; ++q) {
      detail::require(flags[q] == 0 || flags[q] == 1, who, ": field flagged[", q, "] is ", flags[q],
                      " (expected 0 or 1)");
      detail::require((flags[q] == 1) == (count[q] >= o_.persistence), who, ": field flagged[", q, "] is ",
                      flags[q], " but rank ", q, " has ", count[q], " slow marks in the window (flagged at ",
                      o_.persistence, ")");
    }
    times_ = std::move(times);
    for (std::size_t i = 0; i < slow_.size(); ++i) slow_[i] = static_cast<unsigned char>(marks[i]);
    count_ = std::move(count);
    steps_ = steps;
    rep_ = {};
    rep_.step = steps;
    rep_.slow.assign(n, false);
    const std::size_t last = steps == 0 ? 0 : static_cast<std::size_t>((steps - 1) % win);
    for (std::size_t q = 0; q < n; ++q) {
      flag_[q] = flags[q] == 1;
      if (steps > 0) rep_.slow[q] = slow_[last * n + q] != 0;
      if (flag_[q]) rep_.flagged.push_back(static_cast<int>(q));
    }
  }

  /// The detector as one archive of kind "gradapt.straggler" (core/archive.hpp).
  std::vector<std::byte> save() const { return save_archive(*this); }
  /// Restores a detector written by `save()` (all or nothing; see `load(reader)`).
  /// @throws gradapt::error for a damaged archive or one that does not fit this detector
  void load(std::span<const std::byte> bytes) { load_archive(*this, bytes); }

 private:
  std::size_t idx(int r) const {
    detail::require(r >= 0 && r < n_, "straggler_detector: rank ", r, " out of range (", n_, " ranks)");
    return static_cast<std::size_t>(r);
  }
  static double median(std::vector<double>& v) { return detail::median(v); }

  straggler_options o_;
  int n_ = 1;
  std::uint64_t steps_ = 0;
  std::vector<double> times_;        ///< window × ranks, ring by step
  std::vector<unsigned char> slow_;  ///< window × ranks: slow marks
  std::vector<std::size_t> count_;   ///< per rank: slow marks in the window
  std::vector<bool> flag_;
  straggler_report rep_;
  std::vector<double> all_, gathered_;  ///< observe(comm, t): the allgather, the times
  mutable std::vector<double> scratch_;
};

}  // namespace gradapt::elastic

#pragma once
/// @file
/// Fixed averaging period for local SGD, with an optional warm-up at period 1 and an optional
/// doubling ramp: the rounds after local SGD begins use the periods
///
///     1, 1, ..., 1 (warmup_rounds times),  then 2, 4, 8, ... (one round each, if ramp),  then K.
///
/// Lin, Stich, Patel and Jaggi (2018), "Don't Use Large Mini-Batches, Use Local SGD", average
/// every H steps (here K). The warm-up counts averaging rounds *after* local SGD has begun
/// (local_sgd_options::start_step), so it cannot disagree with the synchronous phase: see
/// local_sgd.hpp.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/sync/averaging_schedule.hpp"
#include "gradapt/sync/whole_world_schedule.hpp"

namespace gradapt {

/// Hyperparameters of fixed_period, e.g. `gradapt::fixed_period_options{.period = 16}`.
///
/// | name          | type    | default | meaning                                                   |
/// |---------------|---------|---------|-----------------------------------------------------------|
/// | period        | int64   | 8       | K: local steps between averaging rounds (>= 1)            |
/// | warmup_rounds | int64   | 0       | rounds at period 1 right after local SGD begins (>= 0)    |
/// | ramp          | bool    | false   | after the warm-up, one round each at 2, 4, 8, ... below K |
struct fixed_period_options {
  std::int64_t period = 8;         ///< K, local steps per averaging round once warmed up
  std::int64_t warmup_rounds = 0;  ///< averaging rounds at period 1 before the ramp
  bool ramp = false;               ///< periods 2, 4, 8, ... (one round each, capped at K) after the warm-up
};

/// The complete state of a fixed_period: plain data.
struct fixed_period_state {
  std::uint64_t rounds = 0;    ///< averaging rounds completed under this schedule
  std::uint64_t next_due = 0;  ///< local-step count c at which the next round happens

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(fixed_period_state, rounds, next_due);
  }
};

/// Averages the whole world every K local steps, after an optional warm-up and ramp.
///
/// Local steps are counted from the first step after local_sgd_options::start_step
/// (c = 1, 2, ...). Round r (0-based) comes `period_of_round(r)` local steps after round r − 1
/// (or after local SGD began, for r = 0):
///
///     period_of_round(r) = 1                       for r < W (W = warmup_rounds)
///                        = min(2^(r − W + 1), K)   for r >= W, with ramp
///                        = K                       for r >= W, without ramp
///
/// With warmup_rounds = 1 and ramp the periods are 1, 2, 4, ..., K, K, ...
class fixed_period : public whole_world_schedule<fixed_period, fixed_period_options, fixed_period_state> {
 public:
  /// This schedule does not read the training loss.
  static constexpr bool uses_loss = false;

  /// `fixed_period(options)` (throws gradapt::error when period < 1 or warmup_rounds < 0) and
  /// `fixed_period({})` (the default options).
  using whole_world_schedule::whole_world_schedule;

  /// The options every rank must share, named for local_sgd's round agreement.
  template <std::size_t N>
  void agreed_options(agreed_list<N>& out) const {
    out.push("fixed_period period", static_cast<double>(opt_.period));
    out.push("fixed_period warmup_rounds", static_cast<double>(opt_.warmup_rounds));
    out.push("fixed_period ramp", opt_.ramp ? 1.0 : 0.0);
  }

  /// Local steps between round r − 1 and round r (see the class comment).
  std::uint64_t period_of_round(std::uint64_t r) const { return period_of_round(opt_, r); }

  /// The period of the interval now running (the one that ends at the next round).
  std::uint64_t period() const { return period_of_round(st_.rounds); }

  /// The state after a round at local step c (no side effect).
  fixed_period_state advance(std::uint64_t c, std::size_t, const round_observation&) const {
    fixed_period_state s = st_;
    ++s.rounds;
    s.next_due = c + period_of_round(s.rounds);
    return s;
  }
  /// Sets a state from state(); `local_steps` is the local-step count of the run it belongs
  /// to. @throws gradapt::error when the next round is not within the current period ahead.
  void restore(const fixed_period_state& s, std::uint64_t local_steps) {
    const std::uint64_t p = period_of_round(s.rounds);
    detail::require(s.next_due > local_steps && s.next_due - local_steps <= p,
                    "fixed_period::load: next round at local step ", s.next_due, " after ", local_steps,
                    " local steps and ", s.rounds, " rounds (expected within the current period of ", p,
                    " steps ahead; was the state saved with other options?)");
    st_ = s;
  }

 private:
  friend class configured<fixed_period, fixed_period_options, fixed_period_state>;

  static constexpr std::string_view name = "fixed_period";

  static fixed_period_options validated(const fixed_period_options& o) {
    detail::require(o.period >= 1, "fixed_period: period is ", o.period,
                    " (expected K >= 1 local steps between averaging rounds)");
    detail::require(o.warmup_rounds >= 0, "fixed_period: warmup_rounds is ", o.warmup_rounds,
                    " (expected >= 0 rounds at period 1)");
    return o;
  }
  static fixed_period_state start(const fixed_period_options& o) {
    fixed_period_state s;
    s.next_due = period_of_round(o, 0);
    return s;
  }
  static std::uint64_t period_of_round(const fixed_period_options& o, std::uint64_t r) {
    const auto w = static_cast<std::uint64_t>(o.warmup_rounds);
    const auto k = static_cast<std::uint64_t>(o.period);
    if (r < w) return 1;
    if (!o.ramp) return k;
    const std::uint64_t j = r - w + 1;  // 1, 2, ...: period 2^j
    if (j >= 63) return k;
    const std::uint64_t p = std::uint64_t{1} << j;
    return p < k ? p : k;
  }
};

}  // namespace gradapt

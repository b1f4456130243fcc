#pragma once
/// @file
/// Adaptive averaging period for local SGD (AdaComm: Wang and Joshi 2018, "Adaptive
/// Communication Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update SGD",
/// arXiv:1810.08313, SysML 2019). Average rarely while the loss is high, more often as it
/// falls, and less often again when the learning rate decays:
///
///     K_l = ⌈ sqrt( (η_0 / η_l) · (F_l / F_0) ) · K_0 ⌉   clamped to [1, K_max],
///
/// where F_l is the smoothed, rank-averaged training loss at averaging round l, η_l the
/// learning rate there, and F_0, η_0 the same quantities at the reference round (the first
/// round with a positive smoothed loss).
///
/// Where gradapt departs from the paper, and why:
///  - The paper re-evaluates the period at fixed wall-clock intervals; gradapt evaluates it at
///    every averaging round (the loss must be averaged over ranks, and a round is the one
///    moment every rank communicates anyway).
///  - F_l is an exponential moving average over the rounds of the rank-mean loss (bias
///    corrected, factor β = smoothing) instead of a single mini-batch loss, which is too noisy
///    to set a period from. β = 0 uses the latest round's rank-mean loss alone.
///
/// PaddlePaddle Fleet's adaptive LocalSGD (AdaptiveLocalSGDOptimizer in
/// python/paddle/distributed/fleet/meta_optimizers/localsgd_optimizer.py) computes
/// ⌈ sqrt( η_0 F_l / (η_l F_0) · K_0 ) ⌉, i.e. K_0 *inside* the square root, with K clamped to
/// [1, 16], F_0 and η_0 taken at the first training step and F_l the unsmoothed rank-mean loss
/// of the averaging step. With K_0 inside the root the period scales like sqrt(K_0): K_0 = 16
/// gives 4 at the reference point, not 16. gradapt follows the paper (K_0 outside the root), so
/// K_l = K_0 whenever the loss and learning rate are back at their reference values.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/sync/averaging_schedule.hpp"
#include "gradapt/sync/whole_world_schedule.hpp"

namespace gradapt {

/// Hyperparameters of adaptive_period, e.g.
/// `gradapt::adaptive_period_options{.initial_period = 4, .max_period = 64}`.
///
/// | name           | type   | default | meaning                                                 |
/// |----------------|--------|---------|---------------------------------------------------------|
/// | initial_period | int64  | 4       | K_0: period at the reference loss and rate (>= 1)       |
/// | max_period     | int64  | 64      | K_max: upper clamp of the period (>= K_0)               |
/// | smoothing      | double | 0.9     | β of the loss EMA over rounds, in [0, 1); 0: no EMA     |
struct adaptive_period_options {
  std::int64_t initial_period = 4;  ///< K_0
  std::int64_t max_period = 64;     ///< K_max
  double smoothing = 0.9;           ///< β: F ← β F + (1 − β) loss, bias corrected
};

/// The complete state of an adaptive_period: plain data.
struct adaptive_period_state {
  std::uint64_t period = 0;     ///< K of the interval now running
  std::uint64_t next_due = 0;   ///< local-step count c at which the next round happens
  double ema = 0.0;             ///< biased EMA of the accepted rank-mean losses
  double beta_power = 1.0;      ///< β^t for t accepted samples
  std::uint64_t samples = 0;    ///< accepted loss samples t
  std::uint64_t skipped = 0;    ///< rounds whose rank-mean loss was not finite (no update)
  double loss = 0.0;            ///< F_l, the latest smoothed loss (0 before the first sample)
  double reference_loss = 0.0;  ///< F_0 (valid when has_reference)
  double reference_lr = 0.0;    ///< η_0 (valid when has_reference)
  bool has_reference = false;   ///< F_0 and η_0 are set

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(adaptive_period_state, period, next_due, ema, beta_power, samples, skipped,
                                  loss, reference_loss, reference_lr, has_reference);
  }
};

/// AdaComm's adaptive period (Wang and Joshi 2018), evaluated at every averaging round.
///
/// At a round at local step c, with rank means `loss` and `lr` of what the ranks passed:
///  1. a non-finite loss (an overflowed or NaN mini-batch on some rank) is skipped: the EMA
///     and the period stay as they are and `skipped()` grows; the next round is one period on;
///  2. otherwise F ← bias-corrected EMA with factor β (F = loss when β = 0);
///  3. the first round with F > 0 sets the reference F_0 = F, η_0 = lr (so its period is K_0);
///     while no reference exists the period stays K_0;
///  4. K = period_formula(K_0, K_max, η_0, lr, F_0, F); the next round is K local steps on.
///
/// The loss must be >= 0 (a loss that can be negative must be shifted by the caller: the
/// formula compares ratios of losses); the learning rate must be > 0 and finite. local_sgd
/// checks both on every rank before the round and throws on every rank together.
class adaptive_period
    : public whole_world_schedule<adaptive_period, adaptive_period_options, adaptive_period_state> {
 public:
  /// This schedule reads the rank-mean loss and learning rate at every round.
  static constexpr bool uses_loss = true;

  /// `adaptive_period(options)` (throws gradapt::error when K_0 < 1, K_max < K_0 or smoothing
  /// is outside [0, 1)) and `adaptive_period({})` (the default options).
  using whole_world_schedule::whole_world_schedule;

  /// The options every rank must share, named for local_sgd's round agreement.
  template <std::size_t N>
  void agreed_options(agreed_list<N>& out) const {
    out.push("adaptive_period initial_period", static_cast<double>(opt_.initial_period));
    out.push("adaptive_period max_period", static_cast<double>(opt_.max_period));
    out.push("adaptive_period smoothing", opt_.smoothing);
  }

  /// The period formula of Wang and Joshi (2018):
  /// K = ⌈ sqrt((lr0 / lr) · (loss / loss0)) · k0 ⌉ clamped to [1, k_max].
  ///
  /// The product x = sqrt(·) · k0 is computed in double; an x within a relative 1e-9 of an
  /// integer is taken as that integer before the ceiling, so that exact ratios (4, 1/9, ...)
  /// give the mathematically exact period instead of one more after a last-bit rounding.
  /// Requires lr0, lr, loss0 > 0 and loss >= 0, all finite (an infinite x gives k_max).
  static std::uint64_t period_formula(std::uint64_t k0, std::uint64_t k_max, double lr0, double lr,
                                      double loss0, double loss) {
    double x = std::sqrt((lr0 / lr) * (loss / loss0)) * static_cast<double>(k0);
    if (!(x < static_cast<double>(k_max))) return k_max;  // also inf
    const double r = std::nearbyint(x);
    if (std::fabs(x - r) <= 1e-9 * (r > 1.0 ? r : 1.0)) x = r;
    const double k = std::ceil(x);
    if (k < 1.0) return 1;
    const auto ki = static_cast<std::uint64_t>(k);
    return ki < k_max ? ki : k_max;
  }

  /// K of the interval now running.
  std::uint64_t period() const { return st_.period; }
  /// F_l, the smoothed rank-mean loss of the latest accepted round; empty before the first.
  std::optional<double> loss() const {
    if (st_.samples == 0) return std::nullopt;
    return st_.loss;
  }
  /// F_0, the reference loss; empty until set.
  std::optional<double> reference_loss() const {
    if (!st_.has_reference) return std::nullopt;
    return st_.reference_loss;
  }
  /// η_0, the reference learning rate; empty until set.
  std::optional<double> reference_lr() const {
    if (!st_.has_reference) return std::nullopt;
    return st_.reference_lr;
  }
  /// Rounds whose loss entered the EMA.
  std::uint64_t samples() const { return st_.samples; }
  /// Rounds whose rank-mean loss was not finite (skipped, period unchanged).
  std::uint64_t skipped() const { return st_.skipped; }

  /// The state after a round at local step c with rank means `obs` (no side effect).
  /// A non-finite loss (inf, −inf, NaN) is a skipped sample, not an error.
  /// @throws gradapt::error when obs.lr is not a positive finite number or obs.loss is a
  ///         finite negative number.
  adaptive_period_state advance(std::uint64_t c, std::size_t, const round_observation& obs) const {
    detail::require(std::isfinite(obs.lr) && obs.lr > 0.0, "adaptive_period: learning rate is ", obs.lr,
                    " at local step ", c, " (expected a positive, finite learning rate)");
    detail::require(!(std::isfinite(obs.loss) && obs.loss < 0.0), "adaptive_period: loss is ", obs.loss,
                    " at local step ", c, " (expected a loss >= 0; shift a loss that can be negative)");
    adaptive_period_state s = st_;
    const double beta = opt_.smoothing;
    const double ema = beta * s.ema + (1.0 - beta) * obs.loss;
    const double beta_power = s.beta_power * beta;
    const double f = ema / (1.0 - beta_power);
    if (!std::isfinite(obs.loss) || !std::isfinite(f)) {
      ++s.skipped;
    } else {
      s.ema = ema;
      s.beta_power = beta_power;
      s.loss = f;
      ++s.samples;
      if (!s.has_reference && f > 0.0) {
        s.has_reference = true;
        s.reference_loss = f;
        s.reference_lr = obs.lr;
      }
      if (s.has_reference)
        s.period = period_formula(static_cast<std::uint64_t>(opt_.initial_period),
                                  static_cast<std::uint64_t>(opt_.max_period), s.reference_lr, obs.lr,
                                  s.reference_loss, f);
    }
    s.next_due = c + s.period;
    return s;
  }
  /// Sets a state from state(); `local_steps` is the local-step count of the run it belongs
  /// to. @throws gradapt::error when the state is inconsistent with the options or the count.
  void restore(const adaptive_period_state& s, std::uint64_t local_steps) {
    const auto k_max = static_cast<std::uint64_t>(opt_.max_period);
    detail::require(s.period >= 1 && s.period <= k_max, "adaptive_period::load: period is ", s.period,
                    " (expected 1 to K_max = ", k_max, "; was the state saved with other options?)");
    detail::require(s.next_due > local_steps && s.next_due - local_steps <= s.period,
                    "adaptive_period::load: next round at local step ", s.next_due, " after ", local_steps,
                    " local steps with period ", s.period, " (expected within one period ahead)");
    detail::require(std::isfinite(s.ema) && std::isfinite(s.loss) && s.beta_power >= 0.0 &&
                        s.beta_power <= 1.0 && (s.samples > 0 || s.beta_power == 1.0),
                    "adaptive_period::load: inconsistent loss average (", s.samples, " samples, beta_power ",
                    s.beta_power, "; expected finite values and beta_power = 1 with no samples)");
    detail::require(!s.has_reference || (std::isfinite(s.reference_loss) && s.reference_loss > 0.0 &&
                                         std::isfinite(s.reference_lr) && s.reference_lr > 0.0),
                    "adaptive_period::load: reference loss ", s.reference_loss, " and learning rate ",
                    s.reference_lr, " (expected both positive and finite once set)");
    st_ = s;
  }

 private:
  friend class configured<adaptive_period, adaptive_period_options, adaptive_period_state>;

  static constexpr std::string_view name = "adaptive_period";

  static adaptive_period_options validated(const adaptive_period_options& o) {
    detail::require(o.initial_period >= 1, "adaptive_period: initial_period is ", o.initial_period,
                    " (expected K_0 >= 1 local steps)");
    detail::require(o.max_period >= 1, "adaptive_period: max_period is ", o.max_period,
                    " (expected K_max >= 1 local steps)");
    detail::require(o.max_period >= o.initial_period, "adaptive_period: max_period is ", o.max_period,
                    " but initial_period is ", o.initial_period, " (expected K_max >= K_0)");
    detail::require(std::isfinite(o.smoothing) && o.smoothing >= 0.0 && o.smoothing < 1.0,
                    "adaptive_period: smoothing is ", o.smoothing,
                    " (expected 0 <= smoothing < 1; 0 disables the EMA)");
    return o;
  }
  static adaptive_period_state start(const adaptive_period_options& o) {
    adaptive_period_state s;
    s.period = static_cast<std::uint64_t>(o.initial_period);
    s.next_due = s.period;
    return s;
  }
};

}  // namespace gradapt

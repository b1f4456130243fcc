#pragma once
/// @file
/// AdaScale (Johnson, Agrawal, Gu & Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
/// Distributed Training", ICML 2020): learning-rate gain and scale-invariant progress for
/// training with S times the base batch.
///
/// With base batch B_base and per-step batch S × B_base, the gain of a step is
///
///     r = (σ² + |G|²) / (σ²/S + |G|²)  ∈ [1, S],
///
/// where |G|² is the squared norm of the true gradient and σ² = E|g_base − G|² is the gradient
/// variance AT THE BASE BATCH. The step uses learning rate r · lr(τ), and the progress
/// ("scale-invariant iterations") advances τ ← τ + r, so a schedule written for the base batch
/// (as a function of base-batch iterations) is followed at any scale.
///
/// Relation to gradient_noise_scale: that estimator reports tr(Σ), the trace of the
/// PER-EXAMPLE gradient covariance. The variance of a mean over B_base examples is
/// σ² = tr(Σ) / B_base. Hence σ²/|G|² = B_simple / B_base and
/// r = (B_simple + B_base) / (B_simple/S + B_base).
///
/// Variant for adaptive optimizers (Adam, AdamW, RMSProp): AdaptDL's AdamScale multiplies the
/// learning rate by r^0.5 instead of r (`adascale_options::sqrt_gain`). The progress still
/// advances by the full gain r: τ counts base-batch-equivalent iterations, a property of the
/// gradient statistics, not of the optimizer.

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"

namespace gradapt {

/// Hyperparameters of adascale, e.g. `gradapt::adascale_options{.scale = 8.0}`.
///
/// | name      | type   | default | meaning                                                        |
/// |-----------|--------|---------|----------------------------------------------------------------|
/// | scale     | double | 1       | S = batch per step / base batch (>= 1, finite); may change     |
/// | sqrt_gain | bool   | false   | learning-rate factor r^0.5 (adaptive optimizers) instead of r  |
struct adascale_options {
  double scale = 1.0;      ///< S, the batch of one step over the base batch
  bool sqrt_gain = false;  ///< AdamScale-style factor r^0.5 (AdaptDL) for adaptive optimizers
};

/// The complete state of an adascale: plain data, copied bit for bit by save/load.
struct adascale_state {
  double scale = 1.0;         ///< current S (changes with set_scale)
  double progress = 0.0;      ///< τ, the sum of the gains of all steps taken
  double last_gain = 1.0;     ///< r of the latest step
  std::uint64_t steps = 0;    ///< steps taken with advance / step
  std::uint64_t skipped = 0;  ///< steps whose statistics were not finite (gain 1 used)

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(adascale_state, scale, progress, last_gain, steps, skipped);
  }
};

/// What one AdaScale step used: the gain, the learning-rate factor and the learning rate.
struct adascale_step {
  double gain;       ///< r of this step
  double lr_factor;  ///< r, or r^0.5 with sqrt_gain
  double lr;         ///< schedule(τ before the step) × lr_factor
  double progress;   ///< τ before the step (where the schedule was evaluated)
};

/// AdaScale gain and progress (Johnson et al., ICML 2020).
///
/// Per step, with the statistics of that step's gradient:
///     auto s = ada.step(schedule, sigma_sq, grad_sq);   // s.lr = schedule(τ) · r, then τ += r
/// or in pieces: `gain(...)`, `learning_rate(...)`, `advance(...)`.
///
/// Gain limits: σ² = 0 → 1 (noise-free: a larger batch buys nothing); |G|² = 0 with σ² > 0 → S
/// (pure noise: the step is worth S base steps); S = 1 → 1. Negative statistics (unbiased
/// estimators can be negative) are clamped to 0 before the gain is computed, as AdaptDL does;
/// the result lies in [1, S]. Non-finite statistics: `gain` throws, while `advance` and `step`
/// skip them: the step's gain is 1 (a plain base-batch step; the learning rate is never
/// inflated on bad data), τ advances by 1, and `skipped()` counts it.
class adascale : public archived_state<adascale, adascale_state> {
 public:
  using options_type = adascale_options;  ///< the hyperparameters (adascale_options)
  using state_type = adascale_state;      ///< what state() returns and restore() takes (plain data)

  /// `adascale({})`: the default options (an exact match for the empty braces, which the
  /// options constructor alone would leave ambiguous with the move constructor).
  adascale(std::initializer_list<adascale_options> o) : adascale(detail::options_from(o, "adascale")) {}
  /// @throws gradapt::error when scale is not finite or < 1.
  explicit adascale(adascale_options options = {}) : sqrt_gain_(options.sqrt_gain) {
    set_scale(options.scale);
  }

  /// r = (σ² + |G|²) / (σ²/S + |G|²) with negative inputs clamped to 0 and the limits above.
  /// @throws gradapt::error for non-finite inputs or S < 1.
  static double gain(double sigma_sq, double grad_sq, double scale) {
    check_scale(scale, "adascale::gain");
    detail::require(std::isfinite(sigma_sq) && std::isfinite(grad_sq), "adascale::gain: sigma_sq is ",
                    sigma_sq, " and grad_sq is ", grad_sq,
                    " (expected finite statistics; advance() and step() skip non-finite ones)");
    const double v = sigma_sq > 0.0 ? sigma_sq : 0.0;
    const double g = grad_sq > 0.0 ? grad_sq : 0.0;
    if (v == 0.0 || scale == 1.0) return 1.0;
    if (g == 0.0) return scale;
    const double r = (v + g) / (v / scale + g);
    return r < 1.0 ? 1.0 : (r > scale ? scale : r);  // rounding guard: r ∈ [1, S] exactly
  }

  /// Gain at the current scale.
  double gain(double sigma_sq, double grad_sq) const { return gain(sigma_sq, grad_sq, st_.scale); }

  /// Gain at the current scale from a noise-scale estimator: σ² = tr(Σ) / base_batch,
  /// |G|² = smoothed |G|². Returns 1 while the estimator has no sample.
  /// @param gns        the estimator fed with the scaled batch's gradients; its smoothed tr(Σ)
  ///                   and |G|² are used
  /// @param base_batch B_base, the batch size S is measured against (examples, > 0)
  /// @throws gradapt::error when base_batch is not finite or not > 0
  double gain(const gradient_noise_scale& gns, double base_batch) const {
    const auto [v, g] = statistics(gns, base_batch, "adascale::gain");
    if (!v) return 1.0;
    return gain(*v, *g);
  }

  /// The learning-rate factor of a gain: r, or r^0.5 with sqrt_gain.
  double lr_factor(double gain_value) const { return sqrt_gain_ ? std::sqrt(gain_value) : gain_value; }

  /// schedule(τ) × lr_factor(r) for the current progress τ, without advancing. Non-finite
  /// statistics use r = 1. `schedule` is any callable double(double τ).
  template <class F>
  requires std::is_invocable_r_v<double, const F&, double>
  double learning_rate(const F& schedule, double sigma_sq, double grad_sq) const {
    return evaluate(schedule) * lr_factor(safe_gain(sigma_sq, grad_sq));
  }

  /// Ends a step: r from the statistics (1 when not finite, counted in skipped()), τ += r.
  /// @return r
  double advance(double sigma_sq, double grad_sq) {
    const double r = safe_gain(sigma_sq, grad_sq);
    if (!(std::isfinite(sigma_sq) && std::isfinite(grad_sq))) ++st_.skipped;
    st_.progress += r;
    st_.last_gain = r;
    ++st_.steps;
    return r;
  }

  /// advance() with σ² = tr(Σ)/base_batch and |G|² from a noise-scale estimator; r = 1 (not a
  /// skip) while the estimator has no sample.
  double advance(const gradient_noise_scale& gns, double base_batch) {
    const auto [v, g] = statistics(gns, base_batch, "adascale::advance");
    if (!v) return advance(0.0, 0.0);
    return advance(*v, *g);
  }

  /// One whole step: evaluates `schedule` at the current τ, returns the gain, factor and
  /// learning rate, then advances τ by the gain.
  template <class F>
  requires std::is_invocable_r_v<double, const F&, double> adascale_step step(const F& schedule,
                                                                              double sigma_sq,
                                                                              double grad_sq) {
    const double tau = st_.progress;
    const double r = safe_gain(sigma_sq, grad_sq);
    const double lr = evaluate(schedule) * lr_factor(r);
    advance(sigma_sq, grad_sq);
    return {r, lr_factor(r), lr, tau};
  }

  /// step() with the statistics of a noise-scale estimator (see gain(gns, base_batch)).
  template <class F>
  requires std::is_invocable_r_v<double, const F&, double> adascale_step step(const F& schedule,
                                                                              const gradient_noise_scale& gns,
                                                                              double base_batch) {
    const auto [v, g] = statistics(gns, base_batch, "adascale::step");
    return v ? step(schedule, *v, *g) : step(schedule, 0.0, 0.0);
  }

  /// Changes S (the batch grew or shrank mid-run); τ and the counters are kept.
  /// @throws gradapt::error when scale is not finite or < 1.
  void set_scale(double scale) {
    check_scale(scale, "adascale::set_scale");
    st_.scale = scale;
    if (st_.last_gain > scale) st_.last_gain = scale;
  }

  /// S, the current batch-size ratio (>= 1) the gain is bounded by.
  double scale() const { return st_.scale; }
  /// τ: scale-invariant iterations (sum of gains) so far.
  double progress() const { return st_.progress; }
  /// r of the latest advance / step, in [1, S] (1 before the first step; capped at the new S
  /// when set_scale lowered S since).
  double last_gain() const { return st_.last_gain; }
  /// Steps taken with advance / step (skipped ones included).
  std::uint64_t steps() const { return st_.steps; }
  /// Steps whose statistics were not finite; each used gain 1 and advanced τ by 1.
  std::uint64_t skipped() const { return st_.skipped; }
  /// True when the learning-rate factor is r^0.5 (adascale_options::sqrt_gain), false for r.
  bool sqrt_gain() const { return sqrt_gain_; }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.adascale";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The complete state (plain data).
  const adascale_state& state() const { return st_; }
  /// Sets the state; later results are bit-identical to the run it was taken from.
  /// @throws gradapt::error when the state is inconsistent (state unchanged)
  void restore(const adascale_state& s) {
    check_scale(s.scale, "adascale::load (field scale)");
    detail::require(std::isfinite(s.progress) && s.progress >= 0.0, "adascale::load: field progress is ",
                    s.progress, " (expected a finite progress >= 0)");
    detail::require(std::isfinite(s.last_gain) && s.last_gain >= 1.0 && s.last_gain <= s.scale,
                    "adascale::load: field last_gain is ", s.last_gain, " with scale ", s.scale,
                    " (expected 1 <= last_gain <= scale: the gain is bounded by S)");
    detail::require(s.steps < std::numeric_limits<std::uint64_t>::max(), "adascale::load: field steps is ",
                    s.steps, " (cannot grow)");
    detail::require(s.skipped <= s.steps, "adascale::load: field skipped is ", s.skipped, " with steps ",
                    s.steps, " (expected skipped <= steps)");
    st_ = s;
  }

 private:
  static void check_scale(double scale, const char* fn) {
    detail::require(std::isfinite(scale) && scale >= 1.0, fn, ": scale is ", scale,
                    " (expected S >= 1: the step's batch divided by the base batch)");
  }

  double safe_gain(double sigma_sq, double grad_sq) const {
    if (!(std::isfinite(sigma_sq) && std::isfinite(grad_sq))) return 1.0;
    return gain(sigma_sq, grad_sq);
  }

  template <class F>
  double evaluate(const F& schedule) const {
    const double lr = static_cast<double>(schedule(st_.progress));
    detail::require(std::isfinite(lr), "adascale: the learning-rate schedule returned ", lr, " at progress ",
                    st_.progress, " (expected a finite value)");
    return lr;
  }

  static std::pair<std::optional<double>, std::optional<double>> statistics(const gradient_noise_scale& gns,
                                                                            double base_batch,
                                                                            const char* fn) {
    detail::require(std::isfinite(base_batch) && base_batch > 0.0, fn, ": base_batch is ", base_batch,
                    " (expected the positive number of examples S is measured against)");
    const auto t = gns.trace();
    if (!t) return {std::nullopt, std::nullopt};
    return {*t / base_batch, gns.grad_sq()};
  }

  bool sqrt_gain_;
  adascale_state st_;
};

}  // namespace gradapt

#pragma once
/// @file
/// Fitting the Pollux step-time model (scaling/goodput.hpp) to measured step times, as Pollux's
/// agent does online (Qiao et al., OSDI 2021, §3.2; AdaptDL `fit_perf_params`).
///
/// REQUIRES EIGEN 3.3 OR LATER (its unsupported Levenberg–Marquardt module
/// <unsupported/Eigen/NonLinearOptimization>). Not part of the umbrella header; link
/// `Eigen3::Eigen` (CMake) or add Eigen's include directory.
///
/// Objective: least squares of the log residuals log t̂(cᵢ; θ) − log tᵢ, i.e. relative errors, so
/// short and long steps weigh alike and multiplicative timing noise is homoscedastic (AdaptDL
/// also fits in log space). Parametrisation keeping the constraints without bounds:
/// each of α_c, β_c, α_n, β_n, α_r, β_r = exp(θ) > 0, γ = 1 + 9 · sigmoid(θ_γ) ∈ (1, 10) (AdaptDL's
/// range [1, 10]). Minimised with Eigen's LevenbergMarquardt over NumericalDiff (central
/// differences), from several starting values of γ; the best local minimum is kept.
///
/// Parameters the samples cannot identify are fixed, as AdaptDL does, and reported:
///   - no sample with N > 1:             α_n = β_n = 0;
///   - no sample with N = 1 and R > 1:   α_r = β_r = 0;
///   - no inter-/intra-node sample with R > 2: that β = 0 (the retrogression term is unseen);
///   - no sample with R > 1:             γ = 1 (overlap is unseen).
/// α_c and β_c are always fitted and need samples at two or more distinct atomic batches.
///
/// Initial guesses: α_c, β_c by linear least squares of tᵢ/sᵢ on mᵢ over single-replica samples
/// (there t_iter = s · (α_c + β_c m) exactly), or over all samples when fewer than two distinct
/// single-replica atomic batches exist; for each starting γ the sync time of every multi-replica
/// sample is solved from the model, t_sync = ((t − (s−1) t_grad)^γ − t_grad^γ)^(1/γ), and α, β of
/// each link type follow by linear least squares on max(R − 2, 0).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include <Eigen/Core>
#include <unsupported/Eigen/NonLinearOptimization>
#include <unsupported/Eigen/NumericalDiff>

#include "gradapt/core/error.hpp"
#include "gradapt/scaling/goodput.hpp"

namespace gradapt {

/// One measurement: a configuration and its measured time per optimizer step (seconds, > 0).
struct throughput_sample {
  goodput_config config;  ///< (m, s, R, N) the step ran with
  double step_time;       ///< measured seconds per optimizer step (all s micro-batches + sync)
};

/// Options of fit_throughput_params, e.g. `gradapt::throughput_fit_options{.max_evaluations = 4000}`.
///
/// | name            | type   | default | meaning                                                   |
/// |-----------------|--------|---------|-----------------------------------------------------------|
/// | max_evaluations | int    | 2000    | residual evaluations per Levenberg–Marquardt start (≥ 1)  |
/// | tolerance       | double | 1e-12   | LM ftol and xtol (relative reduction / step), > 0          |
struct throughput_fit_options {
  int max_evaluations = 2000;  ///< cap on residual evaluations of each LM run
  double tolerance = 1e-12;    ///< Eigen LM ftol = xtol
};

/// The fitted model and how well it explains the samples.
struct throughput_fit_result {
  throughput_params params;  ///< fitted coefficients (fixed ones as documented in the file comment)
  double rms_log_error;      ///< sqrt(mean (log t̂ − log t)²), ≈ the RMS relative error
  double rms_error;          ///< sqrt(mean (t̂ − t)²), seconds
  int free_parameters;       ///< how many of the 7 coefficients were fitted
  bool fitted_intra_node;    ///< α_r (and β_r when R > 2 was seen) were fitted
  bool fitted_inter_node;    ///< α_n (and β_n when R > 2 was seen) were fitted
  bool fitted_gamma;         ///< γ was fitted (some sample had R > 1)
  int lm_status;             ///< Eigen::LevenbergMarquardtSpace::Status of the kept run
};

namespace detail::goodput_fit {

enum index : int { ac, bc, an, bn, ar, br, gm, count };

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double logit(double y) { return std::log(y / (1.0 - y)); }

/// Maps the free coordinates θ onto throughput_params (fixed ones from `fixed`).
struct mapping {
  std::array<bool, count> free{};
  std::array<double, count> fixed{};

  [[nodiscard]] int n_free() const { return static_cast<int>(std::count(free.begin(), free.end(), true)); }

  [[nodiscard]] throughput_params params(const Eigen::VectorXd& theta) const {
    std::array<double, count> v = fixed;
    int k = 0;
    for (int i = 0; i < count; ++i) {
      if (!free[static_cast<std::size_t>(i)]) continue;
      const double t = theta[k++];
      v[static_cast<std::size_t>(i)] = i == gm ? 1.0 + 9.0 * sigmoid(t) : std::exp(t);
    }
    return {v[ac], v[bc], v[an], v[bn], v[ar], v[br], v[gm]};
  }

  [[nodiscard]] Eigen::VectorXd theta(const std::array<double, count>& v) const {
    Eigen::VectorXd t(n_free());
    int k = 0;
    for (int i = 0; i < count; ++i) {
      if (!free[static_cast<std::size_t>(i)]) continue;
      const double x = v[static_cast<std::size_t>(i)];
      t[k++] = i == gm ? logit(std::clamp((x - 1.0) / 9.0, 1e-6, 1.0 - 1e-6)) : std::log(x);
    }
    return t;
  }
};

/// Model step time without validation (θ-space values are valid by construction).
inline double predict(const throughput_params& p, const goodput_config& c) {
  const double tg = p.alpha_c + p.beta_c * static_cast<double>(c.atomic_batch);
  double ts = 0.0;
  if (c.replicas > 1) {
    const double extra = c.replicas > 2 ? static_cast<double>(c.replicas - 2) : 0.0;
    ts = c.nodes > 1 ? p.alpha_n + p.beta_n * extra : p.alpha_r + p.beta_r * extra;
  }
  return static_cast<double>(c.accum_steps - 1) * tg + goodput_impl::gamma_norm(tg, ts, p.gamma);
}

/// Residual functor for Eigen's LevenbergMarquardt / NumericalDiff: fᵢ = log t̂ᵢ − log tᵢ.
struct residuals {
  using Scalar = double;
  using InputType = Eigen::VectorXd;
  using ValueType = Eigen::VectorXd;
  using JacobianType = Eigen::MatrixXd;
  enum { InputsAtCompileTime = Eigen::Dynamic, ValuesAtCompileTime = Eigen::Dynamic };

  const mapping* map;
  std::span<const throughput_sample> samples;

  [[nodiscard]] int inputs() const { return map->n_free(); }
  [[nodiscard]] int values() const { return static_cast<int>(samples.size()); }

  int operator()(const Eigen::VectorXd& theta, Eigen::VectorXd& f) const {
    const throughput_params p = map->params(theta);
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const double t = predict(p, samples[i].config);
      // exp may underflow for extreme θ; a tiny floor keeps the residual finite.
      f[static_cast<Eigen::Index>(i)] =
          std::log(std::max(t, std::numeric_limits<double>::min())) - std::log(samples[i].step_time);
    }
    return 0;
  }
};

/// Least squares y ≈ a + b x; b = 0 and a = mean(y) when x has no spread.
inline void line_fit(const std::vector<double>& x, const std::vector<double>& y, double& a, double& b) {
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  double sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
  }
  b = sxx > 0 ? sxy / sxx : 0.0;
  a = my - b * mx;
}

}  // namespace detail::goodput_fit

/// Fits throughput_params to measured step times by Levenberg–Marquardt on log residuals (see the
/// file comment for the objective, the parametrisation, which parameters are fixed when the
/// samples cannot identify them, and the initial guesses).
///
/// Throws gradapt::error for an invalid configuration or a step time that is not finite and
/// positive (naming the sample), for samples at fewer than two distinct atomic batches, and for
/// fewer samples than coefficients to fit.
[[nodiscard]] inline throughput_fit_result fit_throughput_params(std::span<const throughput_sample> samples,
                                                                 const throughput_fit_options& o = {}) {
  namespace fit = detail::goodput_fit;
  constexpr const char* fn = "fit_throughput_params";
  detail::require(o.max_evaluations >= 1, fn, ": max_evaluations = ", o.max_evaluations, "; expected >= 1");
  detail::require(std::isfinite(o.tolerance) && o.tolerance > 0.0, fn, ": tolerance = ", o.tolerance,
                  "; expected a positive, finite tolerance");
  detail::require(!samples.empty(), fn, ": no samples; measure step times at two or more atomic batch sizes");

  fit::mapping map;
  map.free[fit::ac] = map.free[fit::bc] = true;
  map.fixed[fit::gm] = 1.0;
  int first_m = samples[0].config.atomic_batch;
  bool two_m = false;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& c = samples[i].config;
    detail::goodput_impl::check_config(c, fn, "sample");
    detail::require(std::isfinite(samples[i].step_time) && samples[i].step_time > 0.0, fn, ": sample ", i,
                    " has step_time = ", samples[i].step_time,
                    "; expected a positive, finite time in seconds");
    two_m = two_m || c.atomic_batch != first_m;
    if (c.replicas > 1) {
      map.free[fit::gm] = true;
      const bool inter = c.nodes > 1;
      map.free[inter ? fit::an : fit::ar] = true;
      if (c.replicas > 2) map.free[inter ? fit::bn : fit::br] = true;
    }
  }
  detail::require(two_m, fn, ": every sample has atomic_batch = ", first_m,
                  "; alpha_c and beta_c need step times at two or more distinct atomic batch sizes");
  const int n_free = map.n_free();
  detail::require(static_cast<int>(samples.size()) >= n_free, fn, ": ", samples.size(), " samples for ",
                  n_free,
                  " coefficients; provide at least as many samples as coefficients (more for a robust fit)");

  // Compute-time guess: t/s = α_c + β_c m exactly for R = 1.
  std::vector<double> xm, yt, xm1, yt1;
  for (const auto& smp : samples) {
    const double m = smp.config.atomic_batch, y = smp.step_time / smp.config.accum_steps;
    xm.push_back(m);
    yt.push_back(y);
    if (smp.config.replicas == 1) {
      xm1.push_back(m);
      yt1.push_back(y);
    }
  }
  const bool use_single =
      xm1.size() >= 2 && std::any_of(xm1.begin(), xm1.end(), [&](double m) { return m != xm1[0]; });
  double a_c = 0, b_c = 0;
  fit::line_fit(use_single ? xm1 : xm, use_single ? yt1 : yt, a_c, b_c);
  double mean_y = 0, mean_m = 0;
  for (std::size_t i = 0; i < xm.size(); ++i) {
    mean_y += yt[i];
    mean_m += xm[i];
  }
  mean_y /= static_cast<double>(xm.size());
  mean_m /= static_cast<double>(xm.size());
  a_c = std::max(a_c, 1e-3 * mean_y);
  b_c = std::max(b_c, 1e-3 * mean_y / mean_m);

  throughput_fit_result best{};
  double best_cost = std::numeric_limits<double>::infinity();
  Eigen::VectorXd best_theta;
  for (double gamma0 : {1.05, 1.5, 2.5, 5.0, 9.0}) {
    if (!map.free[fit::gm] && gamma0 != 1.05) break;  // one start suffices without sync samples
    std::array<double, fit::count> v{a_c, b_c, 0, 0, 0, 0, map.free[fit::gm] ? gamma0 : 1.0};
    // Sync-time guesses per link type from the model solved at this γ.
    for (int inter = 0; inter < 2; ++inter) {
      const auto ia = static_cast<std::size_t>(inter ? fit::an : fit::ar);
      if (!map.free[ia]) continue;
      std::vector<double> xr, ys;
      for (const auto& smp : samples) {
        const auto& c = smp.config;
        if (c.replicas == 1 || (c.nodes > 1) != (inter == 1)) continue;
        const double tg = a_c + b_c * c.atomic_batch;
        const double last = smp.step_time - (c.accum_steps - 1) * tg;
        const double g = v[fit::gm];
        const double ts = last > tg ? std::pow(std::pow(last, g) - std::pow(tg, g), 1.0 / g) : 1e-3 * tg;
        xr.push_back(c.replicas > 2 ? c.replicas - 2.0 : 0.0);
        ys.push_back(ts);
      }
      double a = 0, b = 0;
      fit::line_fit(xr, ys, a, b);
      double my = 0;
      for (double y : ys) my += y;
      my /= static_cast<double>(ys.size());
      v[ia] = std::max(a, 1e-3 * my);
      if (map.free[ia + 1]) v[ia + 1] = std::max(b, 1e-4 * my);
    }
    Eigen::VectorXd theta = map.theta(v);
    fit::residuals f{&map, samples};
    Eigen::NumericalDiff<fit::residuals, Eigen::Central> numdiff(f);
    Eigen::LevenbergMarquardt<Eigen::NumericalDiff<fit::residuals, Eigen::Central>> lm(numdiff);
    lm.parameters.maxfev = o.max_evaluations;
    lm.parameters.ftol = o.tolerance;
    lm.parameters.xtol = o.tolerance;
    const auto status = lm.minimize(theta);
    Eigen::VectorXd res(static_cast<Eigen::Index>(samples.size()));
    f(theta, res);
    const double cost = res.squaredNorm();
    if (std::isfinite(cost) && cost < best_cost) {
      best_cost = cost;
      best_theta = theta;
      best.lm_status = static_cast<int>(status);
    }
  }
  detail::require(std::isfinite(best_cost), fn, ": Levenberg-Marquardt produced no finite fit of ",
                  samples.size(), " samples; check the step times for outliers");

  best.params = map.params(best_theta);
  double sq = 0;
  for (const auto& smp : samples) {
    const double d = fit::predict(best.params, smp.config) - smp.step_time;
    sq += d * d;
  }
  const double n = static_cast<double>(samples.size());
  best.rms_log_error = std::sqrt(best_cost / n);
  best.rms_error = std::sqrt(sq / n);
  best.free_parameters = n_free;
  best.fitted_intra_node = map.free[fit::ar];
  best.fitted_inter_node = map.free[fit::an];
  best.fitted_gamma = map.free[fit::gm];
  return best;
}

}  // namespace gradapt

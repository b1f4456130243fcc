#pragma once
/// @file
/// The Pollux goodput model (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for
/// Goodput-Optimized Deep Learning", OSDI 2021; the AdaptDL project): predicted step time,
/// throughput, statistical efficiency and goodput of a data-parallel configuration, and a search
/// for the configuration with the highest goodput. Dependency-free (C++20 standard library).
///
/// A configuration is (m, s, R, N): atomic (micro-)batch m examples per replica, s micro-batches
/// per optimizer step (gradient accumulation; s = 1 means none), R replicas on N nodes. The
/// global batch of one step is M = R · m · s.
///
/// Step time (AdaptDL's `_predict`, written with s = AdaptDL's `accum_steps + 1`):
///
///     t_grad = α_c + β_c · m                                compute of one micro-batch
///     t_sync = 0                                 if R = 1
///            = α_r + β_r · max(R − 2, 0)         if R > 1 and N = 1   (intra-node)
///            = α_n + β_n · max(R − 2, 0)         if N > 1             (inter-node)
///     t_iter = (s − 1) · t_grad + (t_grad^γ + t_sync^γ)^(1/γ)
///
/// Only the last micro-batch overlaps with the all-reduce; the γ-norm models the overlap
/// (γ = 1: none, t_grad + t_sync; γ → ∞: perfect, max(t_grad, t_sync)). The retrogression term
/// counts replicas beyond 2 (a ring all-reduce of 2 replicas is the baseline): AdaptDL writes
/// `max(R − 2, 1e-8)` and uses 1e-8 instead of 0 for R = 1; we use the exact limits 0, which
/// differ from AdaptDL's values by at most 1e-8 · β and 1e-8 s.
///
/// Statistical efficiency (Pollux §3.1, from AdaScale's gain): with base batch M0 and gradient
/// noise scale B = tr(Σ)/|G|² (Σ the per-example gradient covariance, G the true gradient), the
/// gradient variance at the base batch is σ² = tr(Σ)/M0, so σ²/|G|² = B/M0. AdaScale's gain for
/// S = M/M0 is r = (σ² + |G|²)/(σ²/S + |G|²) = (B + M0)/(B/S + M0), and one step at batch M makes
/// the progress of r base steps while processing S times the examples, hence
///
///     efficiency(M) = r / S = (B + M0) / (B + M)          ∈ (0, 1] for M ≥ M0.
///
/// Limits: B → ∞ (pure noise) gives 1; B = 0 (noise-free) gives M0/M = 1/S.
///
///     throughput = M / t_iter  (examples per second),      goodput = throughput · efficiency(M).

#include <cmath>
#include <cstdint>
#include <limits>

#include "gradapt/core/error.hpp"

namespace gradapt {

/// Coefficients of the Pollux step-time model (seconds; β_* in seconds per example or per
/// replica). Every coefficient must be finite and ≥ 0, and γ finite and ≥ 1.
///
/// | name    | meaning                                                                   |
/// |---------|---------------------------------------------------------------------------|
/// | alpha_c | constant compute time of one micro-batch                                  |
/// | beta_c  | compute time per example of a micro-batch                                 |
/// | alpha_n | constant all-reduce time when the replicas span more than one node         |
/// | beta_n  | inter-node all-reduce time per replica beyond 2                           |
/// | alpha_r | constant all-reduce time when all replicas (R > 1) share one node          |
/// | beta_r  | intra-node all-reduce time per replica beyond 2                           |
/// | gamma   | overlap of the last micro-batch's compute with the all-reduce (γ-norm)    |
struct throughput_params {
  double alpha_c = 0.0;  ///< α_c, constant compute time (s)
  double beta_c = 0.0;   ///< β_c, compute time per example (s)
  double alpha_n = 0.0;  ///< α_n, inter-node sync constant (s)
  double beta_n = 0.0;   ///< β_n, inter-node sync time per replica beyond 2 (s)
  double alpha_r = 0.0;  ///< α_r, intra-node sync constant (s)
  double beta_r = 0.0;   ///< β_r, intra-node sync time per replica beyond 2 (s)
  double gamma = 1.0;    ///< γ ≥ 1, overlap exponent (1: no overlap, ∞: perfect overlap)
};

/// Statistical-efficiency inputs: the gradient noise scale B = tr(Σ)/|G|² (examples; ≥ 0, may be
/// +∞ when |G|² = 0) and the base batch M0 (> 0) the learning rate was tuned for. B is what
/// gradient_noise_scale estimates (its B_simple).
struct efficiency_params {
  double noise_scale = 0.0;  ///< B = tr(Σ)/|G|², ≥ 0 or +∞
  double base_batch = 1.0;   ///< M0, the base (initial) global batch, > 0
};

/// One data-parallel configuration (m, s, R, N); all fields must be ≥ 1 and nodes ≤ replicas.
struct goodput_config {
  int atomic_batch = 1;  ///< m, examples per micro-batch per replica
  int accum_steps = 1;   ///< s, micro-batches per optimizer step (1: no accumulation)
  int replicas = 1;      ///< R, data-parallel replicas
  int nodes = 1;         ///< N, nodes the replicas span (1 ≤ N ≤ R)

  /// M = R · m · s, the global batch of one optimizer step (as double: no overflow).
  [[nodiscard]] double global_batch() const {
    return static_cast<double>(replicas) * static_cast<double>(atomic_batch) *
           static_cast<double>(accum_steps);
  }
  /// Member-wise equality (all of replicas, nodes, atomic_batch, accum_steps).
  friend bool operator==(const goodput_config&, const goodput_config&) = default;
};

namespace detail::goodput_impl {

inline void check_coefficient(double v, const char* name, const char* fn) {
  require(std::isfinite(v) && v >= 0.0, fn, ": throughput_params.", name, " = ", v,
          "; every coefficient must be finite and >= 0 (seconds)");
}

inline void check_replicas_nodes(int replicas, int nodes, const char* fn) {
  require(replicas >= 1, fn, ": replicas = ", replicas, "; expected at least 1 replica");
  require(nodes >= 1, fn, ": nodes = ", nodes, "; expected at least 1 node");
  require(nodes <= replicas, fn, ": nodes = ", nodes, " exceeds replicas = ", replicas,
          "; every node hosts at least one replica");
}

inline void check_config(const goodput_config& c, const char* fn, const char* what = "config") {
  require(c.atomic_batch >= 1, fn, ": ", what, ".atomic_batch = ", c.atomic_batch,
          "; expected a positive number of examples per micro-batch");
  require(c.accum_steps >= 1, fn, ": ", what, ".accum_steps = ", c.accum_steps,
          "; expected at least 1 micro-batch per step (1 = no accumulation)");
  check_replicas_nodes(c.replicas, c.nodes, fn);
}

/// (a^γ + b^γ)^(1/γ) for a, b ≥ 0, computed as hi · (1 + (lo/hi)^γ)^(1/γ) so that a large γ
/// neither overflows nor underflows.
inline double gamma_norm(double a, double b, double gamma) {
  const double hi = a > b ? a : b;
  const double lo = a > b ? b : a;
  if (hi == 0.0) return 0.0;
  if (gamma == 1.0) return hi + lo;
  return hi * std::pow(1.0 + std::pow(lo / hi, gamma), 1.0 / gamma);
}

}  // namespace detail::goodput_impl

/// Throws gradapt::error unless every coefficient of `p` is finite and ≥ 0 and γ is finite and ≥ 1.
inline void validate(const throughput_params& p) {
  constexpr const char* fn = "throughput_params";
  detail::goodput_impl::check_coefficient(p.alpha_c, "alpha_c", fn);
  detail::goodput_impl::check_coefficient(p.beta_c, "beta_c", fn);
  detail::goodput_impl::check_coefficient(p.alpha_n, "alpha_n", fn);
  detail::goodput_impl::check_coefficient(p.beta_n, "beta_n", fn);
  detail::goodput_impl::check_coefficient(p.alpha_r, "alpha_r", fn);
  detail::goodput_impl::check_coefficient(p.beta_r, "beta_r", fn);
  detail::require(std::isfinite(p.gamma) && p.gamma >= 1.0, fn, ": gamma = ", p.gamma,
                  "; expected a finite overlap exponent >= 1 (1: no overlap; AdaptDL fits it in [1, 10])");
}

/// Throws gradapt::error unless the noise scale is ≥ 0 (not NaN, +∞ allowed) and the base batch
/// is finite and > 0.
inline void validate(const efficiency_params& e) {
  detail::require(!std::isnan(e.noise_scale) && e.noise_scale >= 0.0,
                  "efficiency_params: noise_scale = ", e.noise_scale,
                  "; expected the gradient noise scale tr(Sigma)/|G|^2 >= 0 (+inf allowed)");
  detail::require(std::isfinite(e.base_batch) && e.base_batch > 0.0,
                  "efficiency_params: base_batch = ", e.base_batch,
                  "; expected the positive base batch M0 the learning rate was tuned for");
}

/// Compute time of one micro-batch of m examples: t_grad = α_c + β_c · m (Pollux Eq. 7).
[[nodiscard]] inline double compute_time(const throughput_params& p, int atomic_batch) {
  validate(p);
  detail::require(atomic_batch >= 1, "compute_time: atomic_batch = ", atomic_batch,
                  "; expected a positive number of examples per micro-batch");
  return p.alpha_c + p.beta_c * static_cast<double>(atomic_batch);
}

/// All-reduce time of R replicas on N nodes: 0 for R = 1, α_r + β_r · max(R − 2, 0) on one
/// node, α_n + β_n · max(R − 2, 0) across nodes (Pollux Eq. 8, AdaptDL `_predict_network`).
[[nodiscard]] inline double sync_time(const throughput_params& p, int replicas, int nodes) {
  validate(p);
  detail::goodput_impl::check_replicas_nodes(replicas, nodes, "sync_time");
  if (replicas == 1) return 0.0;
  const double extra = replicas > 2 ? static_cast<double>(replicas - 2) : 0.0;
  return nodes > 1 ? p.alpha_n + p.beta_n * extra : p.alpha_r + p.beta_r * extra;
}

/// Predicted time of one optimizer step:
/// t_iter = (s − 1) · t_grad + (t_grad^γ + t_sync^γ)^(1/γ) (Pollux Eq. 9, AdaptDL `_predict`).
/// Throws when the prediction is 0 (all relevant coefficients 0): throughput would be infinite.
[[nodiscard]] inline double step_time(const throughput_params& p, const goodput_config& c) {
  validate(p);
  detail::goodput_impl::check_config(c, "step_time");
  const double t_grad = p.alpha_c + p.beta_c * static_cast<double>(c.atomic_batch);
  const double t_sync = sync_time(p, c.replicas, c.nodes);
  const double t = static_cast<double>(c.accum_steps - 1) * t_grad +
                   detail::goodput_impl::gamma_norm(t_grad, t_sync, p.gamma);
  detail::require(t > 0.0, "step_time: the predicted step time of (atomic_batch ", c.atomic_batch,
                  ", accum_steps ", c.accum_steps, ", replicas ", c.replicas, ", nodes ", c.nodes,
                  ") is 0; alpha_c + beta_c * atomic_batch must be positive");
  return t;
}

/// Examples processed per second: M / t_iter with M = R · m · s.
[[nodiscard]] inline double throughput(const throughput_params& p, const goodput_config& c) {
  return c.global_batch() / step_time(p, c);
}

/// Statistical efficiency of global batch M relative to base batch M0 with noise scale B:
/// r/S = (B + M0)/(B + M), the AdaScale gain r = (σ² + |G|²)/(σ²/S + |G|²) divided by S = M/M0,
/// with σ²/|G|² = B/M0 (see the file comment). B = +∞ gives 1.
[[nodiscard]] inline double statistical_efficiency(const efficiency_params& e, double global_batch) {
  validate(e);
  detail::require(std::isfinite(global_batch) && global_batch > 0.0,
                  "statistical_efficiency: global_batch = ", global_batch,
                  "; expected a positive, finite number of examples per step");
  if (std::isinf(e.noise_scale)) return 1.0;
  return (e.noise_scale + e.base_batch) / (e.noise_scale + global_batch);
}

/// Goodput of a configuration: throughput · efficiency(M) (Pollux Eq. 1), in base-batch-
/// equivalent examples per second.
[[nodiscard]] inline double goodput(const throughput_params& p, const efficiency_params& e,
                                    const goodput_config& c) {
  return throughput(p, c) * statistical_efficiency(e, c.global_batch());
}

/// Ranges and hysteresis of search_goodput, e.g.
/// `gradapt::goodput_search_options{.max_atomic_batch = 256, .max_accum_steps = 4, .hysteresis = 0.05}`.
///
/// | name             | type   | default | meaning                                                        |
/// |------------------|--------|---------|----------------------------------------------------------------|
/// | min_atomic_batch | int    | 1       | smallest m tried (≥ 1)                                         |
/// | max_atomic_batch | int    | 0       | largest m tried (required: ≥ min_atomic_batch; memory limit)   |
/// | atomic_batch_step | int | 1      | m tried: min, min + step, ... ≤ max (e.g. 8 for tensor cores)  |
/// | min_accum_steps  | int    | 1       | smallest s tried (≥ 1; AdaptDL uses 2 for R = 1 above M0)      |
/// | max_accum_steps  | int    | 1       | largest s tried (≥ min_accum_steps; 1 = no accumulation)       |
/// | max_global_batch | double | +∞      | largest M = R·m·s allowed (AdaptDL's max_batch_size)           |
/// | hysteresis       | double | 0.05    | switch only when best/current goodput > 1 + hysteresis (≥ 0)   |
///
/// Configurations with M below the base batch M0 are never proposed (AdaScale is defined for S ≥ 1).
struct goodput_search_options {
  int min_atomic_batch = 1;   ///< smallest atomic batch m tried
  int max_atomic_batch = 0;   ///< largest atomic batch m tried (must be set)
  int atomic_batch_step = 1;  ///< stride of the atomic batches tried, from min_atomic_batch
  int min_accum_steps = 1;    ///< smallest number of micro-batches s tried
  int max_accum_steps = 1;    ///< largest number of micro-batches s tried
  double max_global_batch = std::numeric_limits<double>::infinity();  ///< cap on M = R·m·s
  double hysteresis = 0.05;  ///< relative improvement needed to leave the current configuration
};

/// What search_goodput found and what it recommends.
struct goodput_search_result {
  goodput_config config;   ///< the configuration to use: `best`, or `current` when hysteresis keeps it
  double goodput;          ///< predicted goodput of `config`
  goodput_config best;     ///< the configuration with the highest predicted goodput in the ranges
  double best_goodput;     ///< predicted goodput of `best`
  double current_goodput;  ///< predicted goodput of the current configuration
  double speedup;          ///< best_goodput / current_goodput
  bool switched;           ///< true when `config` is `best` and differs from `current`
};

/// Exhaustive search over m ∈ {min_atomic_batch + k · atomic_batch_step} ∩ [min_atomic_batch,
/// max_atomic_batch] and s ∈ [min_accum_steps,
/// max_accum_steps] at R replicas on N nodes for the configuration of highest goodput with
/// M0 ≤ R·m·s ≤ max_global_batch (Pollux §4.1, AdaptDL `GoodputFunction.optimize`, which samples
/// global batches instead of enumerating (m, s)). Ties go to the smaller m, then the smaller s.
/// Costs ((max_atomic_batch − min_atomic_batch) / atomic_batch_step + 1) · (max_accum_steps −
/// min_accum_steps + 1) model evaluations. Goodput is flat near its optimum, so a coarse stride
/// loses little and gives a stable choice under small changes of the fitted model.
///
/// Hysteresis: the current configuration is kept when it is feasible (same R and N, m and s in
/// range, M within [M0, max_global_batch]) and best_goodput ≤ (1 + hysteresis) · current_goodput;
/// otherwise `best` is recommended. `current` may have any R and N (e.g. the allocation before a
/// rescale); its goodput is then only the reference of `speedup`.
[[nodiscard]] inline goodput_search_result search_goodput(const throughput_params& p,
                                                          const efficiency_params& e, int replicas, int nodes,
                                                          const goodput_config& current,
                                                          const goodput_search_options& o) {
  constexpr const char* fn = "search_goodput";
  validate(p);
  validate(e);
  detail::goodput_impl::check_replicas_nodes(replicas, nodes, fn);
  detail::goodput_impl::check_config(current, fn, "current");
  detail::require(o.min_atomic_batch >= 1, fn, ": min_atomic_batch = ", o.min_atomic_batch,
                  "; expected >= 1");
  detail::require(
      o.max_atomic_batch >= o.min_atomic_batch, fn, ": max_atomic_batch = ", o.max_atomic_batch,
      " < min_atomic_batch = ", o.min_atomic_batch,
      "; set goodput_search_options::max_atomic_batch to the largest micro-batch that fits in memory");
  detail::require(o.atomic_batch_step >= 1, fn, ": atomic_batch_step = ", o.atomic_batch_step,
                  "; expected a stride >= 1");
  detail::require(o.min_accum_steps >= 1, fn, ": min_accum_steps = ", o.min_accum_steps,
                  "; expected >= 1 (1 = no accumulation)");
  detail::require(o.max_accum_steps >= o.min_accum_steps, fn, ": max_accum_steps = ", o.max_accum_steps,
                  " < min_accum_steps = ", o.min_accum_steps, "; the range of accumulation steps is empty");
  detail::require(!std::isnan(o.max_global_batch) && o.max_global_batch > 0.0, fn,
                  ": max_global_batch = ", o.max_global_batch, "; expected a positive cap (+inf for none)");
  detail::require(std::isfinite(o.hysteresis) && o.hysteresis >= 0.0, fn, ": hysteresis = ", o.hysteresis,
                  "; expected a finite relative threshold >= 0 (e.g. 0.05 for 5%)");

  auto feasible = [&](const goodput_config& c) {
    const double m = c.global_batch();
    return c.replicas == replicas && c.nodes == nodes && c.atomic_batch >= o.min_atomic_batch &&
           c.atomic_batch <= o.max_atomic_batch && c.accum_steps >= o.min_accum_steps &&
           c.accum_steps <= o.max_accum_steps && m >= e.base_batch && m <= o.max_global_batch;
  };

  goodput_config best{};
  double best_g = -1.0;
  for (int m = o.min_atomic_batch;; m += o.atomic_batch_step) {
    for (int s = o.min_accum_steps;; ++s) {
      const goodput_config c{.atomic_batch = m, .accum_steps = s, .replicas = replicas, .nodes = nodes};
      if (feasible(c)) {
        const double g = goodput(p, e, c);
        if (g > best_g) {
          best_g = g;
          best = c;
        }
      }
      if (s == o.max_accum_steps) break;
    }
    if (o.max_atomic_batch - m < o.atomic_batch_step) break;
  }
  detail::require(best_g >= 0.0, fn, ": no configuration with replicas ", replicas, ", atomic_batch in [",
                  o.min_atomic_batch, ", ", o.max_atomic_batch, "], accum_steps in [", o.min_accum_steps,
                  ", ", o.max_accum_steps, "] has a global batch in [base_batch ", e.base_batch,
                  ", max_global_batch ", o.max_global_batch, "]; raise max_atomic_batch or max_accum_steps");

  const double current_g = goodput(p, e, current);
  goodput_search_result r{};
  r.best = best;
  r.best_goodput = best_g;
  r.current_goodput = current_g;
  r.speedup = best_g / current_g;
  const bool keep = feasible(current) && best_g <= (1.0 + o.hysteresis) * current_g;
  r.config = keep ? current : best;
  r.goodput = keep ? current_g : best_g;
  r.switched = !(r.config == current);
  return r;
}

}  // namespace gradapt

#pragma once
/// @file
/// The gradient transformations (stages) optimizers are chained from, in namespace
/// `gradapt::transform`. Each is an aggregate of options with defaults; see stage.hpp for the
/// interface a stage implements and chain.hpp for how a chain runs them.
///
/// Notation: p the parameter, g the gradient, u the update flowing through the chain (u = g
/// before the first stage; the chain ends with p ← p + u), t the 1-based step number. Stages
/// compute in the compute type C (float for float/half/bfloat16 parameters, double for
/// double); norms and their sums are accumulated in double.
///
/// | stage                   | formula                                                        | state  |
/// passes          |
/// |-------------------------|----------------------------------------------------------------|--------|-----------------|
/// | scale_by_adam           | m ← b1 m + (1−b1) u; v ← b2 v + (1−b2) u²; u ← m̂ / (√(v̂ + ε_root) + ε) | m, v
/// | element | | add_decayed_weights     | u ← u + λ p                                                    | –
/// | element         | | trace                   | τ ← u + μ τ; u ← τ (Nesterov: u + μ τ) | τ      | element
/// | | scale_by_learning_rate  | u ← −η s u (s: the group's lr_scale)                           | –      |
/// element         | | scale                   | u ← c u | –      | element         | | scale_by_trust_ratio
/// | u ← r u, r = k ‖p‖ / (‖u‖ + ε) (1 if a norm is 0), clamped      | –      | per-tensor norm | |
/// scale_by_lars           | u ← r (u + λ p), r = k ‖p‖ / (‖u + λp‖ + ε) or k ‖p‖ / (‖u‖ + λ‖p‖ + ε) | – |
/// per-tensor norm | | clip_by_global_norm     | u ← u · c/‖u‖ when ‖u‖ > c (‖·‖ over all tensors) | –      |
/// global norm     | | clip_by_block_rms       | u ← u / max(1, rms(u)/c) per tensor | –      | per-tensor
/// norm |
///
/// References: Adam, Kingma & Ba 2015 (arXiv:1412.6980); decoupled weight decay, Loshchilov &
/// Hutter 2019 (arXiv:1711.05101); LARS, You, Gitman & Ginsburg 2017 (arXiv:1708.03888); LAMB,
/// You et al. 2020 (arXiv:1904.00962); global-norm clipping, Pascanu et al. 2013
/// (arXiv:1211.5063); Nesterov momentum in the form of Sutskever et al. 2013.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>

#include "gradapt/backend/simd.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt::transform {

namespace detail {

/// A finite value in [lo, hi) (or [lo, hi] when closed).
inline void check_range(double v, double lo, double hi, bool closed, const char* stage, const char* name,
                        const char* hint) {
  const bool ok = std::isfinite(v) && v >= lo && (closed ? v <= hi : v < hi);
  gradapt::detail::require(ok, stage, ": ", name, " is ", v, " (expected ", lo, " <= ", name,
                           closed ? " <= " : " < ", hi, "; ", hint, ")");
}

inline void check_nonneg(double v, const char* stage, const char* name, const char* hint) {
  gradapt::detail::require(std::isfinite(v) && v >= 0.0, stage, ": ", name, " is ", v,
                           " (expected a finite value >= 0; ", hint, ")");
}

/// True when a mask predicate is set and returns true for the name.
inline bool predicate_says(const std::function<bool(std::string_view)>& f, std::string_view name) {
  return f && f(name);
}

/// sqrt in double, usable in host and device code.
GRADAPT_HD GRADAPT_INLINE double dsqrt(double x) { return simd::sqrt(x); }

}  // namespace detail

/// Adam's moment estimates (Kingma & Ba 2015), as optax's `scale_by_adam`:
///
///     m ← b1 m + (1 − b1) u        v ← b2 v + (1 − b2) u²
///     m̂ = m / (1 − b1^t)           v̂ = v / (1 − b2^t)      (bias correction, switchable)
///     u ← m̂ / (√(v̂ + eps_root) + eps)
///
/// eps is outside the root (the Adam paper's and optax's placement); eps_root inside. The
/// bias corrections are computed in double per step and applied as multiplications by their
/// reciprocals. Replay (after a barrier) recomputes u from the stored m and v, so the gradient
/// is not read again.
///
/// | name            | type   | default | meaning                                           |
/// |-----------------|--------|---------|---------------------------------------------------|
/// | b1              | double | 0.9     | first-moment decay, in [0, 1)                     |
/// | b2              | double | 0.999   | second-moment decay, in [0, 1)                    |
/// | eps             | double | 1e-8    | added to √v̂ (outside the root), >= 0              |
/// | eps_root        | double | 0       | added to v̂ inside the root, >= 0                  |
/// | bias_correction | bool   | true    | divide the moments by 1 − b^t (apex's switch)     |
struct scale_by_adam {
  double b1 = 0.9;
  double b2 = 0.999;
  double eps = 1e-8;
  double eps_root = 0.0;
  bool bias_correction = true;

  static constexpr std::size_t buffers = 2;  ///< m, v
  static constexpr std::size_t tensor_slots = 0;
  static constexpr bool barrier = false;
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = true;
  static constexpr bool uses_param = false;

  void validate() const {
    detail::check_range(b1, 0.0, 1.0, false, "scale_by_adam", "b1", "0.9 is typical");
    detail::check_range(b2, 0.0, 1.0, false, "scale_by_adam", "b2", "0.999 is typical");
    detail::check_nonneg(eps, "scale_by_adam", "eps", "1e-8 for Adam, 1e-6 for LAMB");
    detail::check_nonneg(eps_root, "scale_by_adam", "eps_root", "usually 0");
  }
  void tensor_constants(const tensor_setup&, double*) const {}

  /// Element math of scale_by_adam in compute type C.
  template <class C>
  struct kernel {
    C b1, omb1, b2, omb2, inv_bc1, inv_bc2, eps, eps_root;

    template <class V>
    GRADAPT_HD GRADAPT_INLINE V direction(const V& m, const V& v) const {
      return (m * inv_bc1) / (simd::sqrt(v * inv_bc2 + eps_root) + eps);
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& m, V& v) const {
      m = omb1 * u + b1 * m;
      v = omb2 * (u * u) + b2 * v;
      u = direction(m, v);
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& m, const V& v) const {
      u = direction(m, v);
    }
  };

  template <class C>
  kernel<C> prepare(const step_context& s) const {
    const double t = static_cast<double>(s.step);
    const double bc1 = bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
    return {static_cast<C>(b1),       static_cast<C>(1.0 - b1),  static_cast<C>(b2),
            static_cast<C>(1.0 - b2), static_cast<C>(1.0 / bc1), static_cast<C>(1.0 / bc2),
            static_cast<C>(eps),      static_cast<C>(eps_root)};
  }
};

/// Decoupled weight decay (Loshchilov & Hutter 2019), as optax's `add_decayed_weights`:
/// u ← u + λ p. λ is `weight_decay`, replaced by a group's `weight_decay` when the group sets
/// one, and 0 for a parameter whose `param_flags::skip_weight_decay` is set or for which the
/// `skip` predicate returns true (biases and norm layers, typically). A tensor with λ = 0 is
/// left exactly as it is (optax's mask semantics).
///
/// | name         | type                               | default | meaning                              |
/// |--------------|------------------------------------|---------|--------------------------------------|
/// | weight_decay | double                             | 0       | λ, finite                            |
/// | skip         | std::function<bool(string_view)>   | empty   | true for names that get no decay     |
struct add_decayed_weights {
  double weight_decay = 0.0;
  std::function<bool(std::string_view)> skip = {};

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 1;  ///< λ of the tensor
  static constexpr bool barrier = false;
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = true;

  void validate() const {
    gradapt::detail::require(std::isfinite(weight_decay), "add_decayed_weights: weight_decay is ",
                             weight_decay, " (expected a finite value; 0 disables decay)");
  }
  void tensor_constants(const tensor_setup& ts, double* out) const {
    const bool off = ts.flags.skip_weight_decay || detail::predicate_says(skip, ts.name);
    out[0] = off ? 0.0 : ts.weight_decay.value_or(weight_decay);
  }

  template <class C>
  struct kernel {
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V& p, const double* tc) const {
      const C wd = static_cast<C>(tc[0]);
      if (wd != C(0)) u = u + wd * p;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V& p, const double* tc) const {
      update(u, p, tc);
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {};
  }
};

/// Momentum, as optax's `trace` (heavy ball; Nesterov in the form of Sutskever et al. 2013):
///
///     τ ← u + μ τ;     u ← τ            (nesterov = false)
///                      u ← u + μ τ      (nesterov = true)
///
/// With τ starting at 0 this equals PyTorch's SGD momentum buffer (dampening 0), whose first
/// step copies the gradient. A trace with μ = 0 is switched off: it keeps no buffer and costs
/// no memory traffic.
///
/// | name     | type   | default | meaning                                 |
/// |----------|--------|---------|-----------------------------------------|
/// | decay    | double | 0.9     | μ, in [0, 1]; 0 switches the stage off  |
/// | nesterov | bool   | false   | Nesterov's look-ahead form              |
struct trace {
  double decay = 0.9;
  bool nesterov = false;

  static constexpr std::size_t buffers = 1;  ///< τ
  static constexpr std::size_t tensor_slots = 0;
  static constexpr bool barrier = false;
  static constexpr bool optional = true;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = false;

  bool enabled() const { return decay != 0.0; }
  void validate() const {
    detail::check_range(decay, 0.0, 1.0, true, "trace", "decay (momentum)", "0.9 is typical");
  }
  void tensor_constants(const tensor_setup&, double*) const {}

  template <class C>
  struct kernel {
    C decay;
    bool nesterov;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& t) const {
      t = u + decay * t;
      u = nesterov ? u + decay * t : t;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& t) const {
      u = nesterov ? u + decay * t : t;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {static_cast<C>(decay), nesterov};
  }
};

/// The learning rate, as optax's `scale_by_learning_rate`: u ← −η s u, with η the step's
/// `step_args::lr` when given (schedules), else `lr`, and s the parameter group's `lr_scale`.
///
/// | name      | type   | default | meaning                                        |
/// |-----------|--------|---------|------------------------------------------------|
/// | lr        | double | 1e-3    | η when a step passes none; finite              |
/// | flip_sign | bool   | true    | multiply by −η (descent); false: by +η         |
struct scale_by_learning_rate {
  double lr = 1e-3;
  bool flip_sign = true;

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 1;  ///< the group's lr_scale
  static constexpr bool barrier = false;
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = false;

  void validate() const {
    gradapt::detail::require(std::isfinite(lr), "scale_by_learning_rate: lr is ", lr,
                             " (expected a finite value)");
  }
  void tensor_constants(const tensor_setup& ts, double* out) const { out[0] = ts.lr_scale; }

  template <class C>
  struct kernel {
    double factor;  ///< ±η
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double* tc) const {
      u = u * static_cast<C>(factor * tc[0]);
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V& p, const double* tc) const {
      update(u, p, tc);
    }
  };
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    const double eta = s.lr.value_or(lr);
    gradapt::detail::require(std::isfinite(eta), "scale_by_learning_rate: the step's learning rate is ", eta,
                             " (expected a finite value; check the schedule)");
    return {flip_sign ? -eta : eta};
  }
};

/// A constant factor: u ← c u.
///
/// | name   | type   | default | meaning          |
/// |--------|--------|---------|------------------|
/// | factor | double | 1       | c, finite        |
struct scale {
  double factor = 1.0;

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 0;
  static constexpr bool barrier = false;
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = false;

  void validate() const {
    gradapt::detail::require(std::isfinite(factor), "scale: factor is ", factor,
                             " (expected a finite value)");
  }
  void tensor_constants(const tensor_setup&, double*) const {}

  template <class C>
  struct kernel {
    C factor;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*) const {
      u = u * factor;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*) const {
      u = u * factor;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {static_cast<C>(factor)};
  }
};

/// Layer-wise trust ratio (LAMB, You et al. 2020), as optax's `scale_by_trust_ratio` plus
/// DeepSpeed's optional clamp:
///
///     n_p = max(‖p‖, min_norm),  n_u = max(‖u‖, min_norm)      (per tensor, in double)
///     r = k n_p / (n_u + eps), clamped to [min_ratio, max_ratio];  r = 1 if n_p = 0 or n_u = 0
///     u ← r u
///
/// A tensor whose `param_flags::skip_trust_ratio` is set, or for which `skip` returns true,
/// keeps r = 1. A NaN or inf in p or u makes r NaN (the tensor's update becomes NaN), as in
/// optax and apex. The norms need the whole tensor's u, so this stage ends a pass: the chain
/// measures ‖p‖² and ‖u‖² in the pass that produces u and applies r in the next one.
///
/// | name              | type                             | default | meaning |
/// |-------------------|----------------------------------|---------|------------------------------------------|
/// | trust_coefficient | double                           | 1       | k, finite > 0 | | eps               |
/// double                           | 0       | added to n_u, >= 0                       | | min_norm |
/// double                           | 0       | floor of both norms, >= 0                | | min_ratio |
/// double                           | 0       | lower clamp of r (DeepSpeed: 0.01)       | | max_ratio |
/// double                           | +inf    | upper clamp of r (DeepSpeed: 10)         | | skip |
/// std::function<bool(string_view)> | empty   | true for names that keep r = 1           |
struct scale_by_trust_ratio {
  double trust_coefficient = 1.0;
  double eps = 0.0;
  double min_norm = 0.0;
  double min_ratio = 0.0;
  double max_ratio = std::numeric_limits<double>::infinity();
  std::function<bool(std::string_view)> skip = {};

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 1;  ///< 1 when the ratio applies, 0 when masked
  static constexpr bool barrier = true;
  static constexpr bool global = false;
  static constexpr std::size_t terms = 2;  ///< ‖p‖², ‖u‖²
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = true;

  void validate() const {
    gradapt::detail::require(std::isfinite(trust_coefficient) && trust_coefficient > 0.0,
                             "scale_by_trust_ratio: trust_coefficient is ", trust_coefficient,
                             " (expected a finite value > 0; 1 for LAMB)");
    detail::check_nonneg(eps, "scale_by_trust_ratio", "eps", "0 for LAMB");
    detail::check_nonneg(min_norm, "scale_by_trust_ratio", "min_norm", "0 disables the floor");
    gradapt::detail::require(
        min_ratio >= 0.0 && !(max_ratio < min_ratio) && min_ratio == min_ratio && max_ratio == max_ratio,
        "scale_by_trust_ratio: the clamp [min_ratio, max_ratio] is [", min_ratio, ", ", max_ratio,
        "] (expected 0 <= min_ratio <= max_ratio; DeepSpeed uses [0.01, 10], "
        "[0, inf] disables the clamp)");
  }
  void tensor_constants(const tensor_setup& ts, double* out) const {
    out[0] = ts.flags.skip_trust_ratio || detail::predicate_says(skip, ts.name) ? 0.0 : 1.0;
  }

  template <class C>
  struct kernel {
    double k, eps, min_norm, lo, hi;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 2> measure(const V& u, const V& p, const double*) const {
      simd::terms_t<V, 2> r;
      const auto pw = simd::widen(p);
      const auto uw = simd::widen(u);
      r[0] = pw * pw;
      r[1] = uw * uw;
      return r;
    }
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[0] == 0.0) return 1.0;
      const double pn = simd::max(detail::dsqrt(sums[0]), min_norm);
      const double un = simd::max(detail::dsqrt(sums[1]), min_norm);
      if (pn == 0.0 || un == 0.0) return 1.0;
      double r = k * pn / (un + eps);
      if (r < lo) r = lo;
      if (r > hi) r = hi;
      return r;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V&, C factor, const double*) const {
      u = u * factor;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {trust_coefficient, eps, min_norm, min_ratio, max_ratio};
  }
};

/// Which denominator LARS's trust ratio uses.
enum class lars_denominator : std::uint8_t {
  /// ‖g + λp‖ + eps: the norm of the decayed update (optax's `lars`).
  norm_of_sum,
  /// ‖g‖ + λ‖p‖ + eps: You, Gitman & Ginsburg 2017, eq. 6, and apex's LARC.
  sum_of_norms,
};

/// LARS's layer-wise weight decay and trust ratio (You, Gitman & Ginsburg 2017) in one stage:
///
///     d = u + λ p
///     r = k ‖p‖ / (‖d‖ + eps)              (norm_of_sum, optax; r = 1 if ‖p‖ or ‖d‖ is 0)
///     r = k ‖p‖ / (‖u‖ + λ ‖p‖ + eps)      (sum_of_norms, the paper; r = 1 if ‖p‖ or ‖u‖ is 0)
///     u ← r d
///
/// λ is masked as in add_decayed_weights (param flags, `skip_weight_decay` predicate, group
/// override); r is masked (kept at 1) by `param_flags::skip_trust_ratio` or the
/// `skip_trust_ratio` predicate. With norm_of_sum this is optax's
/// `chain(add_decayed_weights, masked(scale_by_trust_ratio))`.
///
/// | name              | type                             | default     | meaning                       |
/// |-------------------|----------------------------------|-------------|-------------------------------|
/// | weight_decay      | double                           | 0           | λ, finite                     |
/// | trust_coefficient | double                           | 0.001       | k (η in the paper), > 0       |
/// | eps               | double                           | 0           | added to the denominator      |
/// | denominator       | lars_denominator                 | norm_of_sum | see above                     |
/// | skip_weight_decay | std::function<bool(string_view)> | empty       | names with λ = 0              |
/// | skip_trust_ratio  | std::function<bool(string_view)> | empty       | names with r = 1              |
struct scale_by_lars {
  double weight_decay = 0.0;
  double trust_coefficient = 0.001;
  double eps = 0.0;
  lars_denominator denominator = lars_denominator::norm_of_sum;
  std::function<bool(std::string_view)> skip_weight_decay = {};
  std::function<bool(std::string_view)> skip_trust_ratio = {};

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 2;  ///< λ of the tensor, trust ratio on (1) / off (0)
  static constexpr bool barrier = true;
  static constexpr bool global = false;
  static constexpr std::size_t terms = 2;  ///< ‖p‖², and ‖u + λp‖² (norm_of_sum) or ‖u‖² (sum_of_norms)
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = true;

  void validate() const {
    gradapt::detail::require(std::isfinite(weight_decay), "scale_by_lars: weight_decay is ", weight_decay,
                             " (expected a finite value)");
    gradapt::detail::require(std::isfinite(trust_coefficient) && trust_coefficient > 0.0,
                             "scale_by_lars: trust_coefficient is ", trust_coefficient,
                             " (expected a finite value > 0; 0.001 is optax's default)");
    detail::check_nonneg(eps, "scale_by_lars", "eps", "0 is optax's default");
    gradapt::detail::require(
        denominator == lars_denominator::norm_of_sum || denominator == lars_denominator::sum_of_norms,
        "scale_by_lars: unknown denominator ", static_cast<int>(denominator));
  }
  void tensor_constants(const tensor_setup& ts, double* out) const {
    const bool no_wd = ts.flags.skip_weight_decay || detail::predicate_says(skip_weight_decay, ts.name);
    out[0] = no_wd ? 0.0 : ts.weight_decay.value_or(weight_decay);
    out[1] = ts.flags.skip_trust_ratio || detail::predicate_says(skip_trust_ratio, ts.name) ? 0.0 : 1.0;
  }

  template <class C>
  struct kernel {
    double k, eps;
    bool sum_of_norms;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE V decayed(const V& u, const V& p, const double* tc) const {
      const C wd = static_cast<C>(tc[0]);
      return wd != C(0) ? V(u + wd * p) : u;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 2> measure(const V& u, const V& p, const double* tc) const {
      simd::terms_t<V, 2> r;
      const auto pw = simd::widen(p);
      const auto dw = simd::widen(sum_of_norms ? u : decayed(u, p, tc));
      r[0] = pw * pw;
      r[1] = dw * dw;
      return r;
    }
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[1] == 0.0) return 1.0;
      const double pn = detail::dsqrt(sums[0]);
      const double n1 = detail::dsqrt(sums[1]);  // ‖u‖ or ‖u + λp‖
      if (pn == 0.0 || n1 == 0.0) return 1.0;
      return sum_of_norms ? k * pn / (n1 + tc[0] * pn + eps) : k * pn / (n1 + eps);
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V& p, C factor, const double* tc) const {
      u = decayed(u, p, tc) * factor;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {trust_coefficient, eps, denominator == lars_denominator::sum_of_norms};
  }
};

/// Clipping by the global norm of the update over all tensors (Pascanu et al. 2013), applied
/// before the moments as apex's FusedLAMB `max_grad_norm` does:
///
///     n = ‖u‖ over all tensors (double);   u ← u · (c / n)  when n > c
///
/// Switched off (no pass) while `max_norm` is +inf. A NaN norm leaves u as it is (the NaN
/// reaches the update anyway); an inf norm gives factor 0.
///
/// | name     | type   | default | meaning                                |
/// |----------|--------|---------|----------------------------------------|
/// | max_norm | double | +inf    | c, >= 0; +inf switches the stage off   |
struct clip_by_global_norm {
  double max_norm = std::numeric_limits<double>::infinity();

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 0;
  static constexpr bool barrier = true;
  static constexpr bool global = true;
  static constexpr std::size_t terms = 1;  ///< ‖u‖²
  static constexpr bool optional = true;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = false;

  bool enabled() const { return std::isfinite(max_norm); }
  void validate() const {
    gradapt::detail::require(max_norm >= 0.0, "clip_by_global_norm: max_norm is ", max_norm,
                             " (expected >= 0; +inf switches clipping off; apex's LAMB uses 1)");
  }
  void tensor_constants(const tensor_setup&, double*) const {}

  template <class C>
  struct kernel {
    double max_norm;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 1> measure(const V& u, const V&, const double*) const {
      simd::terms_t<V, 1> r;
      const auto uw = simd::widen(u);
      r[0] = uw * uw;
      return r;
    }
    GRADAPT_HD double finalize(const double* sums, const double*) const {
      const double n = detail::dsqrt(sums[0]);
      return n > max_norm ? max_norm / n : 1.0;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V&, C factor, const double*) const {
      u = u * factor;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {max_norm};
  }
};

/// Clipping by each tensor's root mean square, as optax's `clip_by_block_rms`:
/// u ← u / max(1, rms(u) / c), rms(u) = √(Σu² / n) per tensor. A NaN rms gives NaN (optax).
///
/// | name      | type   | default | meaning             |
/// |-----------|--------|---------|---------------------|
/// | threshold | double | 1       | c, finite > 0       |
struct clip_by_block_rms {
  double threshold = 1.0;

  static constexpr std::size_t buffers = 0;
  static constexpr std::size_t tensor_slots = 1;  ///< element count n
  static constexpr bool barrier = true;
  static constexpr bool global = false;
  static constexpr std::size_t terms = 1;  ///< ‖u‖²
  static constexpr bool optional = false;
  static constexpr bool replay_ignores_input = false;
  static constexpr bool uses_param = false;

  void validate() const {
    gradapt::detail::require(std::isfinite(threshold) && threshold > 0.0, "clip_by_block_rms: threshold is ",
                             threshold, " (expected a finite value > 0)");
  }
  void tensor_constants(const tensor_setup& ts, double* out) const { out[0] = static_cast<double>(ts.size); }

  template <class C>
  struct kernel {
    double threshold;
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 1> measure(const V& u, const V&, const double*) const {
      simd::terms_t<V, 1> r;
      const auto uw = simd::widen(u);
      r[0] = uw * uw;
      return r;
    }
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[0] == 0.0) return 1.0;
      const double d = detail::dsqrt(sums[0] / tc[0]) / threshold;
      if (d != d) return d;
      return d > 1.0 ? 1.0 / d : 1.0;
    }
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V&, C factor, const double*) const {
      u = u * factor;
    }
  };
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {threshold};
  }
};

}  // namespace gradapt::transform

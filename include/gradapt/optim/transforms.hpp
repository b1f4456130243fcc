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
/// The stages: formula; state buffers; whether the stage fuses into a pass (element-wise) or
/// ends one (it needs a norm first).
///
///  - scale_by_adam: m ← b1 m + (1−b1) u; v ← b2 v + (1−b2) u²; u ← m̂ / (√(v̂ + ε_root) + ε).
///    State m, v; element-wise.
///  - add_decayed_weights: u ← u + λ p. No state; element-wise.
///  - trace: τ ← u + μ τ; u ← τ (Nesterov: u ← u + μ τ). State τ; element-wise.
///  - scale_by_learning_rate: u ← −η s u (s: the group's lr_scale). No state; element-wise.
///  - scale: u ← c u. No state; element-wise.
///  - scale_by_trust_ratio: u ← r u, r = k ‖p‖ / (‖u‖ + ε) (1 if a norm is 0), clamped. No state;
///    ends a pass (per-tensor norms).
///  - scale_by_lars: u ← r (u + λ p), r = k ‖p‖ / (‖u + λp‖ + ε) or k ‖p‖ / (‖u‖ + λ‖p‖ + ε).
///    No state; ends a pass (per-tensor norms).
///  - clip_by_global_norm: u ← u · c/‖u‖ when ‖u‖ > c (‖·‖ over all tensors). No state; ends a
///    pass (one global norm).
///  - clip_by_block_rms: u ← u / max(1, rms(u)/c) per tensor (off when c = +inf). No state; ends
///    a pass (per-tensor norms).
///  - scale_by_param_block_rms: u ← u · max(rms(p), min_scale) per tensor. No state; ends a pass
///    (per-tensor norms of p).
///  - ema: m ← (1−β) u + β m; u ← m (optionally debiased). State m; element-wise.
///  - scale_by_factored_rms (optim/adafactor.hpp) and scale_by_sm3 (optim/sm3.hpp): the factored
///    second moments of Adafactor and SM3; the first stage of a chain (see chain.hpp).
///
/// References: Adam, Kingma & Ba 2015 (arXiv:1412.6980); decoupled weight decay, Loshchilov &
/// Hutter 2019 (arXiv:1711.05101); LARS, You, Gitman & Ginsburg 2017 (arXiv:1708.03888); LAMB,
/// You et al. 2020 (arXiv:1904.00962); global-norm clipping, Pascanu et al. 2013
/// (arXiv:1211.5063); Nesterov momentum in the form of Sutskever et al. 2013.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>

#include "gradapt/backend/simd.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
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

/// The `apply` of a barrier kernel that scales u by its factor (C: the compute type).
template <class C>
struct scales_by_factor {
  /// u ← factor · u, with `factor` rounded to C.
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V&, C factor, const double*) const {
    u = u * factor;
  }
};

/// The `measure` and `apply` of a barrier kernel that sums one square, of p (`OfParam`) or of
/// u, and scales u by its factor.
template <class C, bool OfParam>
struct measures_square : scales_by_factor<C> {
  /// The term summed in double: p² or u².
  template <class V>
  GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 1> measure(const V& u, const V& p, const double*) const {
    simd::terms_t<V, 1> r;
    const auto w = simd::widen(OfParam ? p : u);
    r[0] = w * w;
    return r;
  }
};

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
struct scale_by_adam {
  /// First-moment decay b1, in [0, 1). Default 0.9.
  double b1 = 0.9;
  /// Second-moment decay b2, in [0, 1). Default 0.999.
  double b2 = 0.999;
  /// eps, added to √v̂ outside the root; finite, >= 0. Default 1e-8 (LAMB uses 1e-6).
  double eps = 1e-8;
  /// eps_root, added to v̂ inside the root; finite, >= 0. Default 0.
  double eps_root = 0.0;
  /// Divide the moments by 1 − b^t (apex's `bias_correction` switch). Default true.
  bool bias_correction = true;

  /// Two buffers (m, v); replay needs only m and v; never reads p.
  static constexpr stage_spec traits{.buffers = 2, .replay_ignores_input = true, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_adam <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_adam, b1, b2, eps, eps_root, bias_correction);
  }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error naming the option when b1 or b2 is outside [0, 1), eps or eps_root
  ///         is negative or not finite, or both are 0
  void validate() const {
    detail::check_range(b1, 0.0, 1.0, false, "scale_by_adam", "b1", "0.9 is typical");
    detail::check_range(b2, 0.0, 1.0, false, "scale_by_adam", "b2", "0.999 is typical");
    detail::check_nonneg(eps, "scale_by_adam", "eps", "1e-8 for Adam, 1e-6 for LAMB");
    detail::check_nonneg(eps_root, "scale_by_adam", "eps_root", "usually 0");
    gradapt::detail::require(eps > 0.0 || eps_root > 0.0,
                             "scale_by_adam: eps and eps_root are both 0 (expected eps > 0 "
                             "or eps_root > 0: with both 0, an exactly zero gradient gives 0/0)");
  }

  /// Element math of scale_by_adam in compute type C.
  template <class C>
  struct kernel {
    /// @var b1
    /// First-moment decay b1, rounded to C.
    /// @var omb1
    /// 1 − b1, formed in double, then rounded to C.
    /// @var b2
    /// Second-moment decay b2, rounded to C.
    /// @var omb2
    /// 1 − b2, formed in double, then rounded to C.
    /// @var inv_bc1
    /// 1 / (1 − b1^t) for this step (1 without bias correction).
    /// @var rs_bc2
    /// 1 / √(1 − b2^t) for this step (1 without bias correction).
    /// @var eps
    /// eps, added to √v̂.
    /// @var eps_root_v
    /// eps_root · (1 − b2^t): eps_root on the scale of v, so that √(v̂ + eps_root) =
    /// √(v + eps_root_v) · rs_bc2.
    C b1, omb1, b2, omb2, inv_bc1, rs_bc2, eps, eps_root_v;

    /// The update direction m̂ / (√(v̂ + eps_root) + eps) from the advanced moments m and v,
    /// with √v̂ taken as √(v + eps_root (1 − b2^t)) / √(1 − b2^t): v̂ itself is never formed,
    /// so the division by 1 − b2^t (1000 at the first step for b2 = 0.999) cannot overflow v.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE V direction(const V& m, const V& v) const {
      return (m * inv_bc1) / (simd::sqrt(v + eps_root_v) * rs_bc2 + eps);
    }
    /// Advances m and v with the incoming u, then sets u to `direction(m, v)`. The new term of v
    /// is formed as ((1 − b2) u) u, so it is finite whenever the exact (1 − b2) u² is a finite
    /// value of C (for float and b2 = 0.999, |u| up to about 5.8e20; u² alone would overflow
    /// above 1.8e19 and freeze the parameter with v = inf).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& m, V& v) const {
      m = omb1 * u + b1 * m;
      v = (omb2 * u) * u + b2 * v;
      u = direction(m, v);
    }
    /// Sets u to `direction(m, v)` from the already advanced moments; reads no input u.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& m, const V& v) const {
      u = direction(m, v);
    }
  };

  /// The kernel for step `s.step` (t): the decays and 1 − b rounded to C, and the bias
  /// corrections 1 / (1 − b1^t) and 1 / √(1 − b2^t) computed in double with std::pow.
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    const double t = static_cast<double>(s.step);
    const double bc1 = bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
    return {static_cast<C>(b1),       static_cast<C>(1.0 - b1),      static_cast<C>(b2),
            static_cast<C>(1.0 - b2), static_cast<C>(1.0 / bc1),     static_cast<C>(1.0 / std::sqrt(bc2)),
            static_cast<C>(eps),      static_cast<C>(eps_root * bc2)};
  }
};

/// Decoupled weight decay (Loshchilov & Hutter 2019), as optax's `add_decayed_weights`:
/// u ← u + λ p. λ is `weight_decay`, replaced by a group's `weight_decay` when the group sets
/// one, and 0 for a parameter whose `param_flags::skip_weight_decay` is set or for which the
/// `skip` predicate returns true (biases and norm layers, typically). A tensor with λ = 0 is
/// left exactly as it is (optax's mask semantics).
struct add_decayed_weights {
  /// λ; finite. Default 0 (no decay).
  double weight_decay = 0.0;
  /// Returns true for parameter names that get no decay (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip = {};
  /// Multiply λ by the step's learning rate (`step_args::lr`, else `lr` below): u ← u + η λ p,
  /// PyTorch's coupling (torch.optim.Adafactor, AdamW's p ← p (1 − η λ)). Default false (optax).
  bool times_lr = false;
  /// η for `times_lr` when a step passes no `step_args::lr`; finite, >= 0. Default 1.
  double lr = 1.0;

  /// One per-tensor constant: λ of the tensor.
  static constexpr stage_spec traits{.tensor_slots = 1};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "add_decayed_weights <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(add_decayed_weights, weight_decay, times_lr, lr);
  }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when weight_decay is not finite
  void validate() const {
    gradapt::detail::require(std::isfinite(weight_decay), "add_decayed_weights: weight_decay is ",
                             weight_decay, " (expected a finite value; 0 disables decay)");
    detail::check_nonneg(lr, "add_decayed_weights", "lr", "the learning rate times_lr multiplies by");
  }
  /// out[0] = the tensor's λ: 0 when its flags or `skip` mask it, else the group's
  /// `weight_decay` when set, else `weight_decay`; with times_lr also times the group's
  /// `lr_scale` (so the decay follows the group's learning rate, as PyTorch's per-group lr).
  void tensor_constants(const tensor_setup& ts, double* out) const {
    const bool off = ts.flags.skip_weight_decay || detail::predicate_says(skip, ts.name);
    out[0] = off ? 0.0 : ts.weight_decay.value_or(weight_decay) * (times_lr ? ts.lr_scale : 1.0);
  }

  /// Element math of add_decayed_weights in compute type C; λ arrives per tensor in tc[0].
  template <class C>
  struct kernel {
    double lr_factor;  ///< η with times_lr, else 1
    /// u ← u + λ p with λ = tc[0] (times η with times_lr, in double) rounded to C; u is left
    /// untouched when λ is 0.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V& p, const double* tc) const {
      const C wd = static_cast<C>(tc[0] * lr_factor);
      if (wd != C(0)) u = u + wd * p;
    }
    /// The same as `update` (the stage has no state to replay from).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V& p, const double* tc) const {
      update(u, p, tc);
    }
  };
  /// The kernel: η (the step's learning rate) with times_lr, else 1.
  /// @throws gradapt::error when times_lr is set and the step's η is not finite and >= 0
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    if (!times_lr) return {1.0};
    const double eta = s.lr.value_or(lr);
    gradapt::detail::require(std::isfinite(eta) && eta >= 0.0,
                             "add_decayed_weights: the step's learning rate is ", eta,
                             " (expected finite and >= 0 with times_lr)");
    return {eta};
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
struct trace {
  /// μ, in [0, 1]. Default 0.9; 0 switches the stage off.
  double decay = 0.9;
  /// Nesterov's look-ahead form u ← u + μ τ instead of u ← τ. Default false.
  bool nesterov = false;

  /// One buffer (τ); off when decay is 0; never reads p.
  static constexpr stage_spec traits{.buffers = 1, .optional = true, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named by the presets' option ("momentum") and the stage's.
  static constexpr auto option_fields() {
    return std::make_tuple(archive_member{"momentum (stage trace: decay)", &trace::decay},
                           archive_member{"nesterov (stage trace)", &trace::nesterov});
  }

  /// False when decay is 0: the stage then keeps no buffer and is not run.
  bool enabled() const { return decay != 0.0; }
  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when decay is outside [0, 1] or not finite
  void validate() const {
    detail::check_range(decay, 0.0, 1.0, true, "trace", "decay (momentum)", "0.9 is typical");
  }

  /// Element math of trace in compute type C.
  template <class C>
  struct kernel {
    C decay;        ///< μ, rounded to C
    bool nesterov;  ///< use the Nesterov form
    /// τ ← u + μ τ, then u ← τ (Nesterov: u ← u + μ τ with the new τ).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& t) const {
      t = u + decay * t;
      u = nesterov ? u + decay * t : t;
    }
    /// Rebuilds the u of `update` from its input u and the advanced τ; τ is not written.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& t) const {
      u = nesterov ? u + decay * t : t;
    }
  };
  /// The kernel with μ rounded to C (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {static_cast<C>(decay), nesterov};
  }
};

/// The learning rate, as optax's `scale_by_learning_rate`: u ← −η s u, with η the step's
/// `step_args::lr` when given (schedules), else `lr`, and s the parameter group's `lr_scale`.
struct scale_by_learning_rate {
  /// η when a step passes no `step_args::lr`; finite. Default 1e-3.
  double lr = 1e-3;
  /// Multiply by −η (descent) when true, by +η when false. Default true.
  bool flip_sign = true;
  /// Adafactor's relative step size (Shazeer & Stern 2018, torch.optim.Adafactor): use
  /// η_t = min(η, 1/√t) at step t. Default false.
  bool relative_step = false;
  /// Accept a negative η (in `lr` or a step's `step_args::lr`), e.g. for gradient ascent in a
  /// chain of your own. Default true; the presets (sgd, adamw, lamb, lars, adafactor,
  /// sm3) set false, so a schedule that goes negative raises gradapt::error as the
  /// standalone optimizers and torch.optim do.
  bool allow_negative = true;

  /// One per-tensor constant: the group's lr_scale; never reads p.
  static constexpr stage_spec traits{.tensor_slots = 1, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_learning_rate <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_learning_rate, lr, flip_sign, relative_step, allow_negative);
  }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when lr is not finite, or negative without allow_negative
  void validate() const {
    gradapt::detail::require(std::isfinite(lr), "scale_by_learning_rate: lr is ", lr,
                             " (expected a finite value)");
    gradapt::detail::require(allow_negative || lr >= 0, "scale_by_learning_rate: lr is ", lr,
                             " (expected >= 0 for this optimizer)");
  }
  /// out[0] = the tensor's group `lr_scale` (1 for a tensor outside any group).
  void tensor_constants(const tensor_setup& ts, double* out) const { out[0] = ts.lr_scale; }

  /// Element math of scale_by_learning_rate in compute type C.
  template <class C>
  struct kernel {
    double factor;  ///< ±η
    /// u ← (±η · s) u, with s = tc[0]; the product is formed in double, then rounded to C.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double* tc) const {
      u = u * static_cast<C>(factor * tc[0]);
    }
    /// The same as `update` (the stage has no state to replay from).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V& p, const double* tc) const {
      update(u, p, tc);
    }
  };
  /// The kernel for this step: η = `s.lr` when set, else `lr`; negated when flip_sign.
  /// @throws gradapt::error when the step's η is not finite (a schedule gone wrong), or
  ///         negative without allow_negative
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    double eta = s.lr.value_or(lr);
    gradapt::detail::require(std::isfinite(eta), "scale_by_learning_rate: the step's learning rate is ", eta,
                             " (expected a finite value; check the schedule)");
    gradapt::detail::require(allow_negative || eta >= 0,
                             "scale_by_learning_rate: the step's learning rate is ", eta,
                             " (expected >= 0 for this optimizer; check the schedule, or build a chain with "
                             "scale_by_learning_rate{.allow_negative = true} to ascend)");
    if (relative_step) eta = std::min(eta, 1.0 / std::sqrt(static_cast<double>(s.step)));
    return {flip_sign ? -eta : eta};
  }
};

/// A constant factor: u ← c u.
struct scale {
  /// c; finite. Default 1.
  double factor = 1.0;

  /// Never reads p.
  static constexpr stage_spec traits{.uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale <option>".
  static constexpr auto option_fields() { return GRADAPT_OPTION_FIELDS(scale, factor); }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when factor is not finite
  void validate() const {
    gradapt::detail::require(std::isfinite(factor), "scale: factor is ", factor,
                             " (expected a finite value)");
  }

  /// Element math of scale in compute type C.
  template <class C>
  struct kernel {
    C factor;  ///< c, rounded to C
    /// u ← c u.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*) const {
      u = u * factor;
    }
    /// The same as `update` (the stage has no state to replay from).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*) const {
      u = u * factor;
    }
  };
  /// The kernel with c rounded to C (no per-step constants).
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
struct scale_by_trust_ratio {
  /// k; finite, > 0. Default 1 (LAMB).
  double trust_coefficient = 1.0;
  /// Added to n_u in the denominator; finite, >= 0. Default 0.
  double eps = 0.0;
  /// Floor of both norms; finite, >= 0. Default 0 (no floor).
  double min_norm = 0.0;
  /// Lower clamp of r, >= 0. Default 0 (DeepSpeed's LAMB: 0.01).
  double min_ratio = 0.0;
  /// Upper clamp of r, >= min_ratio. Default +inf (DeepSpeed's LAMB: 10).
  double max_ratio = std::numeric_limits<double>::infinity();
  /// Returns true for parameter names that keep r = 1 (in addition to
  /// `param_flags::skip_trust_ratio`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip = {};

  /// One per-tensor constant (1 when the ratio applies, 0 when masked); needs whole-tensor
  /// norms (ends a pass), one ratio per tensor from two terms, ‖p‖² and ‖u‖².
  static constexpr stage_spec traits{.tensor_slots = 1, .barrier = true, .global = false, .terms = 2};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_trust_ratio <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_trust_ratio, trust_coefficient, eps, min_norm, min_ratio,
                                 max_ratio);
  }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error naming the option when trust_coefficient is not finite and > 0, eps
  ///         or min_norm is negative or not finite, or the clamp is not 0 <= min_ratio <=
  ///         max_ratio (NaN included)
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
  /// out[0] = 0 when the tensor's flags or `skip` mask the ratio, else 1.
  void tensor_constants(const tensor_setup& ts, double* out) const {
    out[0] = ts.flags.skip_trust_ratio || detail::predicate_says(skip, ts.name) ? 0.0 : 1.0;
  }

  /// Element math and ratio of scale_by_trust_ratio; C is the compute type of the elements.
  template <class C>
  struct kernel : detail::scales_by_factor<C> {  // apply: u ← r u, r rounded to C
    /// @var k
    /// trust_coefficient.
    /// @var eps
    /// eps, added to n_u.
    /// @var min_norm
    /// Floor of both norms.
    /// @var lo
    /// min_ratio, the lower clamp of r.
    /// @var hi
    /// max_ratio, the upper clamp of r.
    double k, eps, min_norm, lo, hi;
    /// The terms summed per tensor in double: p² and u².
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 2> measure(const V& u, const V& p, const double*) const {
      simd::terms_t<V, 2> r;
      const auto pw = simd::widen(p);
      const auto uw = simd::widen(u);
      r[0] = pw * pw;
      r[1] = uw * uw;
      return r;
    }
    /// r from the tensor's sums (sums[0] = ‖p‖², sums[1] = ‖u‖²): 1 when masked (tc[0] = 0) or
    /// a floored norm is 0, else k n_p / (n_u + eps) clamped to [lo, hi].
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
  };
  /// The kernel (the options in double; no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {{}, trust_coefficient, eps, min_norm, min_ratio, max_ratio};
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
struct scale_by_lars {
  /// λ; finite. Default 0. A group's `weight_decay` replaces it for the group's tensors.
  double weight_decay = 0.0;
  /// k (η in the paper); finite, > 0. Default 0.001 (optax's).
  double trust_coefficient = 0.001;
  /// Added to the denominator; finite, >= 0. Default 0 (optax's).
  double eps = 0.0;
  /// Which norm forms the denominator (see lars_denominator). Default norm_of_sum (optax's).
  lars_denominator denominator = lars_denominator::norm_of_sum;
  /// Returns true for parameter names that get λ = 0 (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_weight_decay = {};
  /// Returns true for parameter names that keep r = 1 (in addition to
  /// `param_flags::skip_trust_ratio`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_trust_ratio = {};

  /// Two per-tensor constants (λ of the tensor, and trust ratio on (1) / off (0)); needs
  /// whole-tensor norms (ends a pass), one ratio per tensor from two terms, ‖p‖² and
  /// ‖u + λp‖² (norm_of_sum) or ‖u‖² (sum_of_norms).
  static constexpr stage_spec traits{.tensor_slots = 2, .barrier = true, .global = false, .terms = 2};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_lars <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_lars, weight_decay, trust_coefficient, eps, denominator);
  }

  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error naming the option when weight_decay is not finite, trust_coefficient
  ///         is not finite and > 0, eps is negative or not finite, or denominator is not one of
  ///         the enumerators
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
  /// out[0] = the tensor's λ (0 when its flags or `skip_weight_decay` mask it, else the group's
  /// `weight_decay` when set, else `weight_decay`); out[1] = 0 when its flags or
  /// `skip_trust_ratio` mask the ratio, else 1.
  void tensor_constants(const tensor_setup& ts, double* out) const {
    const bool no_wd = ts.flags.skip_weight_decay || detail::predicate_says(skip_weight_decay, ts.name);
    out[0] = no_wd ? 0.0 : ts.weight_decay.value_or(weight_decay);
    out[1] = ts.flags.skip_trust_ratio || detail::predicate_says(skip_trust_ratio, ts.name) ? 0.0 : 1.0;
  }

  /// Element math and ratio of scale_by_lars; C is the compute type of the elements.
  template <class C>
  struct kernel {
    /// @var k
    /// trust_coefficient.
    /// @var eps
    /// eps, added to the denominator.
    double k, eps;
    bool sum_of_norms;  ///< true: the paper's denominator ‖u‖ + λ‖p‖ + eps
    /// d = u + λ p with λ = tc[0] rounded to C (u itself when λ is 0).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE V decayed(const V& u, const V& p, const double* tc) const {
      const C wd = static_cast<C>(tc[0]);
      return wd != C(0) ? V(u + wd * p) : u;
    }
    /// The terms summed per tensor in double: p², and d² (norm_of_sum) or u² (sum_of_norms).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 2> measure(const V& u, const V& p, const double* tc) const {
      simd::terms_t<V, 2> r;
      const auto pw = simd::widen(p);
      const auto dw = simd::widen(sum_of_norms ? u : decayed(u, p, tc));
      r[0] = pw * pw;
      r[1] = dw * dw;
      return r;
    }
    /// r from the tensor's sums: 1 when the ratio is masked (tc[1] = 0) or ‖p‖ or the measured
    /// norm is 0, else k‖p‖ / (‖d‖ + eps) or k‖p‖ / (‖u‖ + λ‖p‖ + eps).
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[1] == 0.0) return 1.0;
      const double pn = detail::dsqrt(sums[0]);
      const double n1 = detail::dsqrt(sums[1]);  // ‖u‖ or ‖u + λp‖
      if (pn == 0.0 || n1 == 0.0) return 1.0;
      return sum_of_norms ? k * pn / (n1 + tc[0] * pn + eps) : k * pn / (n1 + eps);
    }
    /// u ← r (u + λ p), with `factor` the tensor's r rounded to C.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void apply(V& u, const V& p, C factor, const double* tc) const {
      u = decayed(u, p, tc) * factor;
    }
  };
  /// The kernel (the options in double; no per-step constants).
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
struct clip_by_global_norm {
  /// c, >= 0. Default +inf, which switches the stage off (apex's FusedLAMB uses 1).
  double max_norm = std::numeric_limits<double>::infinity();

  /// Needs the global norm (ends a pass): one factor for all tensors from one term, ‖u‖²; off
  /// while max_norm is +inf; never reads p.
  static constexpr stage_spec traits{
      .barrier = true, .global = true, .terms = 1, .optional = true, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "clip_by_global_norm <option>".
  static constexpr auto option_fields() { return GRADAPT_OPTION_FIELDS(clip_by_global_norm, max_norm); }

  /// False while max_norm is +inf: the stage then costs no pass.
  bool enabled() const { return std::isfinite(max_norm); }
  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when max_norm is negative or NaN
  void validate() const {
    gradapt::detail::require(max_norm >= 0.0, "clip_by_global_norm: max_norm is ", max_norm,
                             " (expected >= 0; +inf switches clipping off; apex's LAMB uses 1)");
  }

  /// Element math and factor of clip_by_global_norm; C is the compute type of the elements.
  template <class C>
  struct kernel : detail::measures_square<C, false> {  // measure: u² summed over all tensors
    double max_norm;                                   ///< c
    /// The factor from sums[0] = ‖u‖² over all tensors: c / ‖u‖ when ‖u‖ > c, else 1 (so 1
    /// for a NaN norm and 0 for an inf norm).
    GRADAPT_HD double finalize(const double* sums, const double*) const {
      const double n = detail::dsqrt(sums[0]);
      return n > max_norm ? max_norm / n : 1.0;
    }
  };
  /// The kernel (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {{}, max_norm};
  }
};

/// Clipping by each tensor's root mean square, as optax's `clip_by_block_rms`:
/// u ← u / max(1, rms(u) / c), rms(u) = √(Σu² / n) per tensor. A NaN rms gives NaN (optax).
/// c = +inf switches the stage off (Adafactor's clipping_threshold = None).
struct clip_by_block_rms {
  /// c; > 0, +inf for no clipping. Default 1.
  double threshold = 1.0;

  /// One per-tensor constant (the element count n); needs whole-tensor sums (ends a pass),
  /// one factor per tensor from one term, ‖u‖²; off when threshold is +inf; never reads p.
  static constexpr stage_spec traits{
      .tensor_slots = 1, .barrier = true, .global = false, .terms = 1, .optional = true, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "clip_by_block_rms <option>".
  static constexpr auto option_fields() { return GRADAPT_OPTION_FIELDS(clip_by_block_rms, threshold); }

  /// False when threshold is +inf: the stage then costs no pass.
  bool enabled() const { return threshold != std::numeric_limits<double>::infinity(); }
  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when threshold is not > 0 (NaN included)
  void validate() const {
    gradapt::detail::require(threshold > 0.0, "clip_by_block_rms: threshold is ", threshold,
                             " (expected a value > 0; +inf switches clipping off)");
  }
  /// out[0] = the tensor's element count n.
  void tensor_constants(const tensor_setup& ts, double* out) const { out[0] = static_cast<double>(ts.size); }

  /// Element math and factor of clip_by_block_rms; C is the compute type of the elements.
  template <class C>
  struct kernel : detail::measures_square<C, false> {  // measure: u² summed per tensor
    double threshold;                                  ///< c
    /// The factor 1 / max(1, rms / c) with rms = √(sums[0] / n), n = tc[0]: 1 for an empty
    /// tensor, NaN when rms is NaN.
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[0] == 0.0) return 1.0;
      const double d = detail::dsqrt(sums[0] / tc[0]) / threshold;
      if (d != d) return d;
      return d > 1.0 ? 1.0 / d : 1.0;
    }
  };
  /// The kernel (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {{}, threshold};
  }
};

/// Scaling by each tensor's parameter root mean square, as optax's `scale_by_param_block_rms`
/// (Adafactor's multiply_by_parameter_scale): u ← u · max(rms(p), min_scale), rms(p) = √(Σp² / n)
/// per tensor, in double. A NaN rms gives NaN. `active = false` switches the stage off.
struct scale_by_param_block_rms {
  /// Lower bound of the scale (Adafactor's eps2); finite, >= 0. Default 1e-3.
  double min_scale = 1e-3;
  /// false switches the stage off (it then costs no pass). Default true.
  bool active = true;

  /// One per-tensor constant (the element count n); needs whole-tensor sums of p (ends a
  /// pass), one factor per tensor from one term, ‖p‖²; off when `active` is false; the
  /// measure reads p only (its pass skips u) and is Σp² (a factored stage's statistics pass
  /// may take it).
  static constexpr stage_spec traits{.tensor_slots = 1,
                                     .barrier = true,
                                     .global = false,
                                     .terms = 1,
                                     .optional = true,
                                     .measure_reads_input = false,
                                     .measures_param_squares = true};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_param_block_rms <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_param_block_rms, min_scale, active);
  }

  /// `active`.
  bool enabled() const { return active; }
  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when min_scale is negative or not finite
  void validate() const {
    detail::check_nonneg(min_scale, "scale_by_param_block_rms", "min_scale", "1e-3 is optax's");
  }
  /// out[0] = the tensor's element count n.
  void tensor_constants(const tensor_setup& ts, double* out) const { out[0] = static_cast<double>(ts.size); }

  /// Element math and factor of scale_by_param_block_rms; C is the compute type.
  template <class C>
  struct kernel : detail::measures_square<C, true> {  // measure: p² summed per tensor
    double min_scale;                                 ///< the lower bound
    /// max(√(sums[0] / n), min_scale), n = tc[0]; NaN when the rms is NaN, 1 for an empty tensor.
    GRADAPT_HD double finalize(const double* sums, const double* tc) const {
      if (tc[0] == 0.0) return 1.0;
      const double rms = detail::dsqrt(sums[0] / tc[0]);
      if (rms != rms) return rms;
      return rms > min_scale ? rms : min_scale;
    }
  };
  /// The kernel (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {{}, min_scale};
  }
};

/// An exponential moving average of the update, as optax's `ema` (Adafactor's momentum):
///
///     m ← (1 − β) u + β m;   u ← m          (debias: u ← m / (1 − β^t))
///
/// β = 0 switches the stage off (no buffer). Replay rebuilds u from m alone.
struct ema {
  /// β, in [0, 1). Default 0.9; 0 switches the stage off.
  double decay = 0.9;
  /// Divide by 1 − β^t (optax's default debias=True; Adafactor uses false). Default false.
  bool debias = false;

  /// One buffer (m); off when decay is 0; replay needs only m; never reads p.
  static constexpr stage_spec traits{
      .buffers = 1, .optional = true, .replay_ignores_input = true, .uses_param = false};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "ema <option>".
  static constexpr auto option_fields() { return GRADAPT_OPTION_FIELDS(ema, decay, debias); }

  /// False when decay is 0.
  bool enabled() const { return decay != 0.0; }
  /// Checks the options (the chain calls it when it is built and at `init`).
  /// @throws gradapt::error when decay is outside [0, 1)
  void validate() const { detail::check_range(decay, 0.0, 1.0, false, "ema", "decay", "0.9 is typical"); }

  /// Element math of ema in compute type C.
  template <class C>
  struct kernel {
    C decay;      ///< β, rounded to C
    C one_minus;  ///< 1 − β, formed in double, rounded to C
    C inv_bc;     ///< 1 / (1 − β^t) with debias, else 1
    bool debias;  ///< divide by the bias correction
    /// m ← (1 − β) u + β m; u ← m (times inv_bc with debias).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& m) const {
      m = V(one_minus) * u + V(decay) * m;
      u = debias ? m * V(inv_bc) : m;
    }
    /// u from the advanced m alone.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& m) const {
      u = debias ? m * V(inv_bc) : m;
    }
  };
  /// The kernel for step t (the bias correction is formed in double).
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    const double bc = debias ? 1.0 - std::pow(decay, static_cast<double>(s.step)) : 1.0;
    return {static_cast<C>(decay), static_cast<C>(1.0 - decay), static_cast<C>(1.0 / bc), debias};
  }
};

}  // namespace gradapt::transform

#pragma once
/// @file
/// LAMB (You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer & Hsieh 2020,
/// "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
/// arXiv:1904.00962, algorithm 2), as optax's `lamb` with apex's and DeepSpeed's switches:
///
///     g ← g · c/‖g‖ when ‖g‖ > c (‖g‖ over all tensors; optional, apex's max_grad_norm)
///     m ← b1 m + (1−b1) g;  v ← b2 v + (1−b2) g²;  m̂ = m/(1−b1^t);  v̂ = v/(1−b2^t)
///     u = m̂ / (√(v̂ + eps_root) + eps) + λ p                    (eps outside the root)
///     r = ‖p‖ / ‖u‖ per tensor (1 when either is 0), optionally clamped to [r_min, r_max]
///     p ← p − η r u
///
/// Masks: a parameter whose `param_flags::skip_weight_decay` is set (or named by the
/// `skip_weight_decay` predicate) gets λ = 0; one whose `skip_trust_ratio` is set (or named by
/// `skip_trust_ratio`) gets r = 1. A group's `weight_decay` replaces λ, its `lr_scale`
/// multiplies η.
///
/// Passes: the trust ratio needs ‖u‖ of the whole tensor before any element is written, so a
/// step is two passes: (1) read p, g, m, v, write m, v, sum ‖p‖² and ‖u‖² per tensor; (2)
/// read p, m, v, rebuild u, write p. With `max_grad_norm` set, one read pass over g comes
/// first.

#include <functional>
#include <initializer_list>
#include <limits>
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/preset.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::lamb`, e.g. `gradapt::lamb({.lr = 1e-3, .weight_decay = 0.01})`.
/// The `lamb` constructor validates them and throws gradapt::error naming a bad one.
struct lamb_options {
  /// η, finite. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// First-moment decay, in [0, 1). Default 0.9.
  double b1 = 0.9;
  /// Second-moment decay, in [0, 1). Default 0.999.
  double b2 = 0.999;
  /// Added to √v̂ (outside the root: optax's and apex's place); finite, >= 0. Default 1e-6.
  double eps = 1e-6;
  /// Added to v̂ inside the root; finite, >= 0. Default 0.
  double eps_root = 0.0;
  /// λ, decoupled, inside the trust ratio; finite. Default 0 (optax: 0, apex: 0.01).
  double weight_decay = 0.0;
  /// Divide the moments by 1 − b^t (apex's switch). Default true.
  bool bias_correction = true;
  /// Clip the global gradient norm to this first; >= 0. Default +inf: no clipping, no extra
  /// pass (apex: 1.0).
  double max_grad_norm = std::numeric_limits<double>::infinity();
  /// Lower clamp of r, >= 0. Default 0 (DeepSpeed: 0.01).
  double min_trust_ratio = 0.0;
  /// Upper clamp of r, >= min_trust_ratio. Default +inf (DeepSpeed: 10).
  double max_trust_ratio = std::numeric_limits<double>::infinity();
  /// Returns true for parameter names with λ = 0 (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_weight_decay = {};
  /// Returns true for parameter names with r = 1 (in addition to
  /// `param_flags::skip_trust_ratio`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_trust_ratio = {};
};

/// The chain behind `gradapt::lamb`.
using lamb_chain =
    chain<transform::clip_by_global_norm, transform::scale_by_adam, transform::add_decayed_weights,
          transform::scale_by_trust_ratio, transform::scale_by_learning_rate>;

/// LAMB (see the file comment). State buffers: 0 = m, 1 = v.
class lamb : public detail::optim::preset<lamb, lamb_chain, lamb_options> {
 public:
  /// The chain the options give; its stages validate them.
  /// @throws gradapt::error on an invalid option, under the stage's name for it
  static lamb_chain stages(const lamb_options& o) {
    return lamb_chain(
        transform::clip_by_global_norm{.max_norm = o.max_grad_norm}, detail::optim::adam_stage(o),
        detail::optim::decay_stage(o),
        transform::scale_by_trust_ratio{
            .min_ratio = o.min_trust_ratio, .max_ratio = o.max_trust_ratio, .skip = o.skip_trust_ratio},
        detail::optim::lr_stage(o));
  }
  /// The optimizer's name in error messages.
  static constexpr std::string_view name = "lamb";
  /// `lamb(options)` (throws gradapt::error on an invalid option, naming it) and
  /// `lamb({})` (the default options).
  using preset::preset;
};

}  // namespace gradapt

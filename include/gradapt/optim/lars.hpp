#pragma once
/// @file
/// LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks",
/// arXiv:1708.03888, algorithm 1), as optax's `lars` with the paper's denominator as a switch:
///
///     d = g + λ p
///     r = k ‖p‖ / (‖d‖ + eps)              per tensor (optax; `norm_of_sum`)
///     r = k ‖p‖ / (‖g‖ + λ‖p‖ + eps)       per tensor (the paper, apex's LARC; `sum_of_norms`)
///     r = 1 when ‖p‖ or the denominator's norm is 0
///     b ← μ b − η r d;   p ← p + b          (Nesterov: p ← p + μ b − η r d)
///
/// The momentum buffer holds learning-rate-scaled updates (optax's order: the learning rate
/// before the trace, as in the paper's algorithm 1). Masks as in LAMB: `skip_weight_decay`
/// (λ = 0) and `skip_trust_ratio` (r = 1) through param_flags or name predicates; group
/// `weight_decay` and `lr_scale` apply.
///
/// Passes: (1) read p and g, sum ‖p‖² and ‖g + λp‖² (or ‖g‖²) per tensor; (2) read p, g, b, write
/// p, b. With momentum 0 the buffer is dropped.

#include <functional>
#include <initializer_list>
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/preset.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::lars`, e.g. `gradapt::lars({.lr = 1.0, .weight_decay = 1e-4})`.
/// The `lars` constructor validates them and throws gradapt::error naming a bad one.
struct lars_options {
  /// η, finite. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// λ, finite. Default 0.
  double weight_decay = 0.0;
  /// k (η in the paper); finite, > 0. Default 0.001.
  double trust_coefficient = 0.001;
  /// Added to the trust-ratio denominator; finite, >= 0. Default 0.
  double eps = 0.0;
  /// μ, in [0, 1]. Default 0.9; 0 drops the buffer.
  double momentum = 0.9;
  /// Nesterov momentum. Default false.
  bool nesterov = false;
  /// ‖g + λp‖ (norm_of_sum, optax's; the default) or ‖g‖ + λ‖p‖ (sum_of_norms: the paper,
  /// apex's LARC).
  transform::lars_denominator denominator = transform::lars_denominator::norm_of_sum;
  /// Returns true for parameter names with λ = 0 (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_weight_decay = {};
  /// Returns true for parameter names with r = 1 (in addition to
  /// `param_flags::skip_trust_ratio`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_trust_ratio = {};
};

/// The chain behind `gradapt::lars`.
using lars_chain = chain<transform::scale_by_lars, transform::scale_by_learning_rate, transform::trace>;

/// LARS (see the file comment). State buffer 0 is the momentum buffer.
class lars : public detail::optim::preset<lars, lars_chain, lars_options> {
 public:
  /// The chain the options give; its stages validate them.
  /// @throws gradapt::error on an invalid option, under the stage's name for it
  static lars_chain stages(const lars_options& o) {
    return lars_chain(transform::scale_by_lars{.weight_decay = o.weight_decay,
                                               .trust_coefficient = o.trust_coefficient,
                                               .eps = o.eps,
                                               .denominator = o.denominator,
                                               .skip_weight_decay = o.skip_weight_decay,
                                               .skip_trust_ratio = o.skip_trust_ratio},
                      detail::optim::lr_stage(o), detail::optim::momentum_stage(o));
  }
  /// The optimizer's name in error messages.
  static constexpr std::string_view name = "lars";
  /// `lars(options)` (throws gradapt::error on an invalid option, naming it) and
  /// `lars({})` (the default options).
  using preset::preset;
};

}  // namespace gradapt

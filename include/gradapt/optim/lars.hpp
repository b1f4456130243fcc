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
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::lars`, e.g. `gradapt::lars({.lr = 1.0, .weight_decay = 1e-4})`.
///
/// | name              | type                             | default     | meaning |
/// |-------------------|----------------------------------|-------------|-------------------------------------------------|
/// | lr                | double                           | 1e-3        | η (a step's `step_args::lr`
/// overrides it)      | | weight_decay      | double                           | 0           | λ | |
/// trust_coefficient | double                           | 0.001       | k (η in the paper) | | eps | double
/// | 0           | added to the trust-ratio denominator            | | momentum          | double | 0.9 | μ
/// in [0, 1]; 0 drops the buffer                 | | nesterov          | bool                             |
/// false       | Nesterov momentum                               | | denominator       |
/// transform::lars_denominator      | norm_of_sum | ‖g+λp‖ (optax) or ‖g‖+λ‖p‖ (paper, apex LARC)   | |
/// skip_weight_decay | std::function<bool(string_view)> | empty       | names with λ = 0 (with param_flags) |
/// | skip_trust_ratio  | std::function<bool(string_view)> | empty       | names with r = 1 (with param_flags)
/// |
struct lars_options {
  double lr = 1e-3;
  double weight_decay = 0.0;
  double trust_coefficient = 0.001;
  double eps = 0.0;
  double momentum = 0.9;
  bool nesterov = false;
  transform::lars_denominator denominator = transform::lars_denominator::norm_of_sum;
  std::function<bool(std::string_view)> skip_weight_decay = {};
  std::function<bool(std::string_view)> skip_trust_ratio = {};
};

/// The chain behind `gradapt::lars`.
using lars_chain = chain<transform::scale_by_lars, transform::scale_by_learning_rate, transform::trace>;

/// LARS (see the file comment). State buffer 0 is the momentum buffer.
class lars : public lars_chain {
 public:
  /// @throws gradapt::error on an invalid option, naming it
  explicit lars(const lars_options& o = {})
      : lars_chain(transform::scale_by_lars{.weight_decay = o.weight_decay,
                                            .trust_coefficient = o.trust_coefficient,
                                            .eps = o.eps,
                                            .denominator = o.denominator,
                                            .skip_weight_decay = o.skip_weight_decay,
                                            .skip_trust_ratio = o.skip_trust_ratio},
                   transform::scale_by_learning_rate{.lr = o.lr},
                   transform::trace{.decay = o.momentum, .nesterov = o.nesterov}) {}
};

}  // namespace gradapt

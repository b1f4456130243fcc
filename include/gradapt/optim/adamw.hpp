#pragma once
/// @file
/// AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization",
/// arXiv:1711.05101; Adam: Kingma & Ba 2015, arXiv:1412.6980), as optax's `adamw`: the chain
///
///     scale_by_adam(b1, b2, eps, eps_root) → add_decayed_weights(λ) → scale_by_learning_rate(η)
///
/// i.e. m ← b1 m + (1−b1) g, v ← b2 v + (1−b2) g², p ← p − η (m̂ / (√(v̂ + eps_root) + eps) + λ p)
/// with m̂ = m / (1 − b1^t), v̂ = v / (1 − b2^t). One pass over memory: it reads p, g, m, v
/// and writes p, m, v. PyTorch's `torch.optim.AdamW` computes the same step in another order
/// (p ← p(1 − ηλ) first, then the Adam update), so the two agree to rounding.

#include <functional>
#include <initializer_list>
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/preset.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::adamw`, e.g. `gradapt::adamw({.lr = 3e-4, .weight_decay = 0.1})`.
/// The `adamw` constructor validates them and throws gradapt::error naming a bad one.
struct adamw_options {
  /// η, finite. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// First-moment decay, in [0, 1). Default 0.9.
  double b1 = 0.9;
  /// Second-moment decay, in [0, 1). Default 0.999.
  double b2 = 0.999;
  /// Added to √v̂ (outside the root); finite, >= 0. Default 1e-8.
  double eps = 1e-8;
  /// Added to v̂ (inside the root); finite, >= 0. Default 0.
  double eps_root = 0.0;
  /// λ, finite. Default 1e-4 (optax's default; PyTorch's is 1e-2).
  double weight_decay = 1e-4;
  /// Divide the moments by 1 − b^t. Default true.
  bool bias_correction = true;
  /// Returns true for parameter names that get no decay (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// The chain behind `gradapt::adamw`.
using adamw_chain =
    chain<transform::scale_by_adam, transform::add_decayed_weights, transform::scale_by_learning_rate>;

/// AdamW (see the file comment). State buffers: 0 = m, 1 = v.
class adamw : public detail::optim::preset<adamw, adamw_chain, adamw_options> {
 public:
  /// The chain the options give; its stages validate them.
  /// @throws gradapt::error on an invalid option, under the stage's name for it
  static adamw_chain stages(const adamw_options& o) {
    return adamw_chain(detail::optim::adam_stage(o), detail::optim::decay_stage(o),
                       detail::optim::lr_stage(o));
  }
  /// The optimizer's name in error messages.
  static constexpr std::string_view name = "adamw";
  /// `adamw(options)` (throws gradapt::error on an invalid option, naming it) and
  /// `adamw({})` (the default options).
  using preset::preset;
};

}  // namespace gradapt

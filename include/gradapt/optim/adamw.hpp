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
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::adamw`, e.g. `gradapt::adamw({.lr = 3e-4, .weight_decay = 0.1})`.
///
/// | name              | type                             | default | meaning |
/// |-------------------|----------------------------------|---------|--------------------------------------------------|
/// | lr                | double                           | 1e-3    | η (a step's `step_args::lr` overrides
/// it)       | | b1                | double                           | 0.9     | first-moment decay | | b2
/// | double                           | 0.999   | second-moment decay                              | | eps |
/// double                           | 1e-8    | added to √v̂ (outside the root)                   | | eps_root
/// | double                           | 0       | added to v̂ (inside the root)                     | |
/// weight_decay      | double                           | 1e-4    | λ (optax's default; PyTorch's is 1e-2) |
/// | bias_correction   | bool                             | true    | divide the moments by 1 − b^t | |
/// skip_weight_decay | std::function<bool(string_view)> | empty   | names that get no decay (with
/// param_flags)       |
struct adamw_options {
  double lr = 1e-3;
  double b1 = 0.9;
  double b2 = 0.999;
  double eps = 1e-8;
  double eps_root = 0.0;
  double weight_decay = 1e-4;
  bool bias_correction = true;
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// The chain behind `gradapt::adamw`.
using adamw_chain =
    chain<transform::scale_by_adam, transform::add_decayed_weights, transform::scale_by_learning_rate>;

/// AdamW (see the file comment). State buffers: 0 = m, 1 = v.
class adamw : public adamw_chain {
 public:
  /// @throws gradapt::error on an invalid option, naming it
  explicit adamw(const adamw_options& o = {})
      : adamw_chain(
            transform::scale_by_adam{.b1 = o.b1,
                                     .b2 = o.b2,
                                     .eps = o.eps,
                                     .eps_root = o.eps_root,
                                     .bias_correction = o.bias_correction},
            transform::add_decayed_weights{.weight_decay = o.weight_decay, .skip = o.skip_weight_decay},
            transform::scale_by_learning_rate{.lr = o.lr}) {}
};

}  // namespace gradapt

#pragma once
/// @file
/// Stochastic gradient descent with optional momentum, Nesterov momentum and (coupled) weight
/// decay: the chain
///
///     add_decayed_weights(λ) → trace(μ, nesterov) → scale_by_learning_rate(η)
///
/// which is, step by step,
///
///     d = g + λ p;   b ← μ b + d;   u = b (or d + μ b with Nesterov);   p ← p − η u
///
/// PyTorch's `torch.optim.SGD` with dampening 0 computes the same (its first step copies the
/// gradient into the buffer, which equals μ·0 + d), and optax's `sgd` is the same chain
/// without the decay stage. With μ = 0 the momentum stage is switched off and keeps no
/// buffer. References: Robbins & Monro 1951; Polyak 1964 (heavy ball); Sutskever et al. 2013
/// (the Nesterov form).

#include <functional>
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::sgd`, e.g. `gradapt::sgd({.lr = 0.1, .momentum = 0.9})`.
///
/// | name              | type                             | default | meaning |
/// |-------------------|----------------------------------|---------|---------------------------------------------------|
/// | lr                | double                           | 1e-3    | η (a step's `step_args::lr` overrides
/// it)        | | momentum          | double                           | 0       | μ in [0, 1]; 0: plain SGD,
/// no buffer (optax: None) | | nesterov          | bool                             | false   | Nesterov
/// momentum (needs μ > 0, as in PyTorch)    | | weight_decay      | double                           | 0 | λ,
/// added to the gradient before momentum          | | skip_weight_decay | std::function<bool(string_view)> |
/// empty   | names that get no decay (with param_flags)        |
struct sgd_options {
  double lr = 1e-3;
  double momentum = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// The chain behind `gradapt::sgd`.
using sgd_chain = chain<transform::add_decayed_weights, transform::trace, transform::scale_by_learning_rate>;

/// SGD with momentum (see the file comment). Stage 1's buffer (state buffer 0) is the
/// momentum buffer.
class sgd : public sgd_chain {
 public:
  /// @throws gradapt::error on an invalid option (naming it), or Nesterov without momentum
  explicit sgd(const sgd_options& o = {})
      : sgd_chain(transform::add_decayed_weights{.weight_decay = o.weight_decay, .skip = o.skip_weight_decay},
                  transform::trace{.decay = o.momentum, .nesterov = o.nesterov},
                  transform::scale_by_learning_rate{.lr = o.lr}) {
    detail::require(!o.nesterov || o.momentum > 0.0, "sgd: nesterov is set but momentum is ", o.momentum,
                    " (Nesterov momentum needs momentum > 0)");
  }
};

}  // namespace gradapt

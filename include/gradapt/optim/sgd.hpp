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
#include <initializer_list>
#include <string_view>

#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/preset.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::sgd`, e.g. `gradapt::sgd({.lr = 0.1, .momentum = 0.9})`.
/// The `sgd` constructor validates them and throws gradapt::error naming a bad one.
struct sgd_options {
  /// η, finite. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// μ, in [0, 1]. Default 0: plain SGD, no buffer (optax: None).
  double momentum = 0.0;
  /// Nesterov momentum; needs μ > 0, as in PyTorch. Default false.
  bool nesterov = false;
  /// λ, finite, added to the gradient before momentum. Default 0.
  double weight_decay = 0.0;
  /// Returns true for parameter names that get no decay (in addition to
  /// `param_flags::skip_weight_decay`). Default empty: no name is skipped.
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// The chain behind `gradapt::sgd`.
using sgd_chain = chain<transform::add_decayed_weights, transform::trace, transform::scale_by_learning_rate>;

/// SGD with momentum (see the file comment). Stage 1's buffer (state buffer 0) is the
/// momentum buffer.
class sgd : public detail::optim::preset<sgd, sgd_chain, sgd_options> {
 public:
  /// The chain the options give; its stages validate them, and Nesterov needs momentum > 0.
  /// @throws gradapt::error on an invalid option, under the stage's name for it
  static sgd_chain stages(const sgd_options& o) {
    sgd_chain c(detail::optim::decay_stage(o), detail::optim::momentum_stage(o), detail::optim::lr_stage(o));
    detail::require(!o.nesterov || o.momentum > 0.0, "sgd: nesterov is set but momentum is ", o.momentum,
                    " (Nesterov momentum needs momentum > 0)");
    return c;
  }
  /// The optimizer's name in error messages.
  static constexpr std::string_view name = "sgd";
  /// `sgd(options)` (throws gradapt::error on an invalid option, naming it, or on Nesterov
  /// without momentum) and `sgd({})` (the default options).
  using preset::preset;
};

}  // namespace gradapt

#pragma once
/// @file
/// What the optimizer presets that are one `gradapt::chain` built from an options struct
/// (sgd, adamw, lamb, lars) share: the stages their common options map to, and the
/// construction that reports an option a stage rejects under the preset's name and the
/// option's public name.

#include <string_view>

#include "gradapt/core/error.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt::detail::optim {

/// The chain `make()` returns, built for the preset `who`: an error of a stage is rethrown as
/// "gradapt: <who>: <message>" with the stage's option names replaced by the presets' (e.g.
/// `lamb({.max_grad_norm = -1})` → "gradapt: lamb: max_grad_norm is -1 ..."; see
/// `detail::rethrow_in`). The table holds the stages of every preset: a chain's stages raise
/// only their own messages.
template <class Make>
auto preset_chain(std::string_view who, Make&& make) -> decltype(make()) {
  try {
    return make();
  } catch (const error& e) {
    rethrow_in(who, e,
               {{"clip_by_global_norm: max_norm", "max_grad_norm"},
                {"scale_by_adam: ", ""},
                {"scale_by_lars: ", ""},
                {"add_decayed_weights: weight_decay", "weight_decay"},
                {"trace: decay (momentum)", "momentum"},
                {"scale_by_trust_ratio: min_ratio", "min_trust_ratio"},
                {"scale_by_trust_ratio: max_ratio", "max_trust_ratio"},
                {"scale_by_trust_ratio: the clamp [min_ratio, max_ratio]",
                 "the clamp [min_trust_ratio, max_trust_ratio]"},
                {"scale_by_learning_rate: lr", "lr"}});
  }
}

/// Adam's moments from a preset's `b1`, `b2`, `eps`, `eps_root` and `bias_correction`.
template <class O>
transform::scale_by_adam adam_stage(const O& o) {
  return {.b1 = o.b1, .b2 = o.b2, .eps = o.eps, .eps_root = o.eps_root, .bias_correction = o.bias_correction};
}
/// Decoupled weight decay from a preset's `weight_decay` and `skip_weight_decay`.
template <class O>
transform::add_decayed_weights decay_stage(const O& o) {
  return {.weight_decay = o.weight_decay, .skip = o.skip_weight_decay};
}
/// Momentum from a preset's `momentum` and `nesterov`.
template <class O>
transform::trace momentum_stage(const O& o) {
  return {.decay = o.momentum, .nesterov = o.nesterov};
}
/// The learning rate from a preset's `lr`, which must not be negative (nor a step's).
template <class O>
transform::scale_by_learning_rate lr_stage(const O& o) {
  return {.lr = o.lr, .allow_negative = false};
}

}  // namespace gradapt::detail::optim

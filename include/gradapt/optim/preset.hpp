#pragma once
/// @file
/// What the optimizer presets that are one `gradapt::chain` built from an options struct
/// (sgd, adamw, lamb, lars) share: their constructors, which report an option a stage rejects
/// under the preset's name and the option's public name, and the stages their common options
/// map to.

#include <initializer_list>

#include "gradapt/core/error.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt::detail::optim {

/// A preset optimizer `Derived`: `Chain` built from `Options` by `Derived::stages(options)`
/// (whose stages validate the options), with `Derived::name` in error messages. An error of a
/// stage is rethrown as "gradapt: <name>: <message>" with the stage's option names replaced by
/// the presets' (e.g. `lamb({.max_grad_norm = -1})` → "gradapt: lamb: max_grad_norm is -1
/// ..."; see `detail::rethrow_in`); the table holds the stages of every preset, as a chain's
/// stages raise only their own messages.
template <class Derived, class Chain, class Options>
class preset : public Chain {
 public:
  /// The chain the preset builds (its stages, for messages and the agreement).
  using chain_type = Chain;
  /// @throws gradapt::error on an invalid option, naming it
  explicit preset(const Options& o = {}) : Chain(build(o)) {}
  /// `T({})`: the default options (an exact match for the empty braces, which the options
  /// constructor alone would leave ambiguous with the copy and move constructors).
  preset(std::initializer_list<Options> o) : preset(options_from(o, Derived::name)) {}

 private:
  static Chain build(const Options& o) {
    try {
      return Derived::stages(o);
    } catch (const error& e) {
      rethrow_in(Derived::name, e,
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
};

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

#pragma once
/// @file
/// configured: the constructors shared by the classes built from one options struct whose
/// complete state is one plain struct (fixed_period, adaptive_period, loss_scaler,
/// gradient_noise_scale), so that validating the options, `T({})` and the first state are
/// written once.

#include <initializer_list>

#include "gradapt/core/error.hpp"

namespace gradapt {

/// CRTP base of a class `Derived` built from the options `Options` whose complete state is the
/// plain struct `State`. `Derived` inherits the constructors (`using configured::configured;`),
/// befriends this base and provides `static constexpr std::string_view name` (its name in
/// messages), `static Options validated(const Options&)` (the options it keeps; throws
/// gradapt::error naming a bad one) and `static State start(const Options&)` (the state before
/// the first update).
template <class Derived, class Options, class State>
class configured {
 public:
  using options_type = Options;  ///< the hyperparameters
  using state_type = State;      ///< what state() returns and restore() takes (plain data)

  /// `T({})`: the default options (an exact match for the empty braces, which the options
  /// constructor alone would leave ambiguous with the move constructor).
  configured(std::initializer_list<Options> o) : configured(detail::options_from(o, Derived::name)) {}
  /// An object with `Derived::validated(options)` in the state `Derived::start` gives.
  /// @throws gradapt::error when an option is out of range (the message names it)
  explicit configured(const Options& options = {})
      : opt_(Derived::validated(options)), st_(Derived::start(opt_)) {}

 protected:
  Options opt_;  ///< the options, as `Derived::validated` returned them
  State st_;     ///< the complete state
};

}  // namespace gradapt

#pragma once
/// @file
/// The grafted methods of `gradapt::shampoo`: `shampoo_graft`, its names, and the per-element
/// kernel that computes a graft's direction D_g and advances its state.

#include <array>
#include <cmath>
#include <string_view>

#include "gradapt/core/enum_name.hpp"

namespace gradapt {

/// The method whose step size a Shampoo block takes (grafting), and which preconditions the
/// tensors Shampoo leaves diagonal. With g the gradient, a the method's per-element state and
/// ε `graft_epsilon`:
enum class shampoo_graft : unsigned char {
  none,     ///< no rescaling: D = D_s; diagonal tensors take g (SGD)
  sgd,      ///< D_g = g
  adagrad,  ///< a ← a + g²;  D_g = g / (√a + ε)
  rmsprop,  ///< a ← β·a + (1 − β)·g²;  D_g = g / (√a + ε)   (β = graft_beta2)
  adam,     ///< a ← β·a + (1 − β)·g²;  D_g = g / (√(a / (1 − β^t)) + ε): Adam's bias-corrected
            ///< second moment; Adam's first moment is the chain's `momentum`
};

/// The name of a graft ("none", "sgd", "adagrad", "rmsprop", "adam").
constexpr std::string_view to_string(shampoo_graft g) {
  return detail::enum_name(g, std::array<std::string_view, 5>{"none", "sgd", "adagrad", "rmsprop", "adam"});
}

namespace detail::shampoo_impl {

/// The grafted direction of one element, advancing its state a from the gradient g; the
/// direction divides m (the gradient, or the first moment with shampoo_options::beta1 > 0, as
/// Distributed Shampoo's graft preconditions its filtered gradient). See shampoo_graft.
template <class C>
struct graft_kernel {
  shampoo_graft kind;
  C beta, one_minus_beta, eps, bias;  ///< bias: 1 − β^t (adam)
  C operator()(C g, C m, C& a) const {
    switch (kind) {
      case shampoo_graft::none:
      case shampoo_graft::sgd:
        return m;
      case shampoo_graft::adagrad:
        a = a + g * g;
        return m / (std::sqrt(a) + eps);
      case shampoo_graft::rmsprop:
        a = beta * a + one_minus_beta * (g * g);
        return m / (std::sqrt(a) + eps);
      case shampoo_graft::adam:
        a = beta * a + one_minus_beta * (g * g);
        return m / (std::sqrt(a / bias) + eps);
    }
    return m;
  }
};

/// True when the graft keeps a per-element state.
constexpr bool graft_has_state(shampoo_graft g) {
  return g == shampoo_graft::adagrad || g == shampoo_graft::rmsprop || g == shampoo_graft::adam;
}

}  // namespace detail::shampoo_impl

}  // namespace gradapt

#pragma once
/// @file
/// The grafted methods of `gradapt::shampoo`: `shampoo_graft`, its names, and the per-element
/// kernel that computes a graft's direction D_g and advances its state.

#include <array>
#include <cmath>
#include <string_view>

#include "gradapt/backend/simd.hpp"
#include "gradapt/core/config.hpp"
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
  GRADAPT_HD C operator()(C g, C m, C& a) const {
    switch (kind) {
      case shampoo_graft::none:
      case shampoo_graft::sgd:
        return m;
      case shampoo_graft::adagrad:
        a = a + g * g;
        return m / (simd::sqrt(a) + eps);
      case shampoo_graft::rmsprop:
        a = beta * a + one_minus_beta * (g * g);
        return m / (simd::sqrt(a) + eps);
      case shampoo_graft::adam:
        a = beta * a + one_minus_beta * (g * g);
        return m / (simd::sqrt(a / bias) + eps);
    }
    return m;
  }
};

// The stage's element work as backend functors (one pass each over a tensor, or over a run of
// a block's elements), so that the same code runs on host and device memory.

/// m ← m + w·(g − m): the first moment's EMA (w = 1 − β1).
template <class C>
struct moment_update {
  C w;
  template <class M, class Gv>
  GRADAPT_HD void operator()(M& m, const Gv& g) const {
    m = m + w * (static_cast<C>(g) - m);
  }
};

/// dst ← C(src): a gradient run gathered into the block's buffer in the compute type.
template <class C>
struct gather_as {
  template <class D, class S>
  GRADAPT_HD void operator()(D& dst, const S& src) const {
    dst = static_cast<C>(src);
  }
};

/// dst ← src / c: the bias-corrected first moment m / (1 − β1^t).
template <class C>
struct divided_by {
  C c;
  template <class D>
  GRADAPT_HD void operator()(D& dst, const D& src) const {
    dst = src / c;
  }
};

/// D ← the graft's direction of g with state a (graft_kernel): (D, g) without a state or a
/// first moment, (D, g, a) with a state, (D, g, m, a) with both, dividing m / bc1 (the first
/// moment's bias correction; 1 for a block's m, already corrected when gathered).
template <class C>
struct graft_direction {
  graft_kernel<C> gk;
  C bc1;
  template <class D, class Gv>
  GRADAPT_HD void operator()(D& d, const Gv& g) const {
    C a = C(0);
    d = gk(static_cast<C>(g), static_cast<C>(g), a);
  }
  template <class D, class Gv, class A>
  GRADAPT_HD void operator()(D& d, const Gv& g, A& a) const {
    C s = a;
    d = gk(static_cast<C>(g), static_cast<C>(g), s);
    a = s;
  }
  template <class D, class Gv, class M, class A>
  GRADAPT_HD void operator()(D& d, const Gv& g, const M& m, A& a) const {
    C s = a;
    d = gk(static_cast<C>(g), m / bc1, s);
    a = s;
  }
};

/// D ← the graft's direction of g dividing m / bc1 (the first moment), without a state.
template <class C>
struct graft_direction_of_moment {
  graft_kernel<C> gk;
  C bc1;
  template <class D, class Gv, class M>
  GRADAPT_HD void operator()(D& d, const Gv& g, const M& m) const {
    C a = C(0);
    d = gk(static_cast<C>(g), m / bc1, a);
  }
};

/// True when the graft keeps a per-element state.
constexpr bool graft_has_state(shampoo_graft g) {
  return g == shampoo_graft::adagrad || g == shampoo_graft::rmsprop || g == shampoo_graft::adam;
}

}  // namespace detail::shampoo_impl

}  // namespace gradapt

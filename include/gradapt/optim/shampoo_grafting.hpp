#pragma once
/// @file
/// The grafted methods of `gradapt::shampoo`: `shampoo_graft`, its names, and the per-element
/// kernel that computes a graft's direction D_g and advances its state.

#include <array>
#include <cmath>
#include <string_view>
#include <type_traits>

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
/// Distributed Shampoo's graft preconditions its filtered gradient). See shampoo_graft; the
/// graft is the template argument of `step` (`with_graft` chooses it once per pass).
template <class C>
struct graft_kernel {
  C beta, one_minus_beta, eps, bias;  ///< bias: 1 − β^t (adam)
  /// The graft K's direction (K fixed at compile time, so an element loop has no branch), on
  /// scalars or on host SIMD packs (simd.hpp: the same bits per lane).
  template <shampoo_graft K, class V>
  GRADAPT_HD GRADAPT_INLINE V step(const V& g, const V& m, V& a) const {
    if constexpr (K == shampoo_graft::adagrad) {
      a = a + g * g;
      return m / (simd::sqrt(a) + eps);
    } else if constexpr (K == shampoo_graft::rmsprop) {
      a = beta * a + one_minus_beta * (g * g);
      return m / (simd::sqrt(a) + eps);
    } else if constexpr (K == shampoo_graft::adam) {
      a = beta * a + one_minus_beta * (g * g);
      return m / (simd::sqrt(a / bias) + eps);
    } else {  // none, sgd
      (void)g;
      (void)a;
      return m;
    }
  }
};

/// Calls f(std::integral_constant<shampoo_graft, k>{}): a pass over elements chooses its graft
/// once.
template <class F>
void with_graft(shampoo_graft k, F&& f) {
  using G = shampoo_graft;
  switch (k) {
    case G::adagrad:
      return f(std::integral_constant<G, G::adagrad>{});
    case G::rmsprop:
      return f(std::integral_constant<G, G::rmsprop>{});
    case G::adam:
      return f(std::integral_constant<G, G::adam>{});
    default:
      return f(std::integral_constant<G, G::none>{});
  }
}

// The stage's element work as backend functors (one pass each over a tensor, or over a run of
// a block's elements), so that the same code runs on host and device memory. Each takes
// scalars or, on the host, SIMD packs (`vectorizable`): the host backend runs them vectorised
// under plain -O2, lane for lane the scalar bits.

/// x in the compute type C: a scalar converted (a gradient of another type), a pack as it is
/// (packs are used only when every view's compute type is C).
template <class C, class X>
GRADAPT_HD GRADAPT_INLINE auto as_compute(const X& x) {
  if constexpr (std::is_arithmetic_v<X>)
    return static_cast<C>(x);
  else
    return x;
}

/// m ← m + w·(g − m): the first moment's EMA (w = 1 − β1).
template <class C>
struct moment_update {
  static constexpr bool vectorizable = true;
  C w;
  template <class M, class Gv>
  GRADAPT_HD void operator()(M& m, const Gv& g) const {
    m = m + w * (as_compute<C>(g) - m);
  }
};

/// dst ← C(src): a gradient run gathered into the block's buffer in the compute type.
template <class C>
struct gather_as {
  static constexpr bool vectorizable = true;
  template <class D, class S>
  GRADAPT_HD void operator()(D& dst, const S& src) const {
    dst = as_compute<C>(src);
  }
};

/// V ← β2·V + w·r² (V + w·r² when β2 = 1): eigenvalue-corrected Shampoo's second moment of
/// the rotated gradient r.
template <class C>
struct rotated_second_moment {
  static constexpr bool vectorizable = true;
  C beta2, w;
  bool accumulate;  ///< β2 = 1
  template <class V>
  GRADAPT_HD void operator()(V& v, const V& r) const {
    if (accumulate)
      v = v + w * (r * r);
    else
      v = beta2 * v + w * (r * r);
  }
};

/// x ← m / m1 / ((v / c2)^(1/p) + ε): the rotated (first moment of the) gradient divided by
/// the root of the bias-corrected second moment (square root when p = 2).
template <class C>
struct corrected_quotient {
  C m1, c2, eps, inv;  ///< inv: 1/p
  bool square_root;    ///< p = 2
  template <class X>
  GRADAPT_HD void operator()(X& x, const X& m, const X& v) const {
    if (square_root)
      x = m / m1 / (std::sqrt(v / c2) + eps);
    else
      x = m / m1 / (std::pow(v / c2, inv) + eps);
  }
};

/// dst ← src / c: the bias-corrected first moment m / (1 − β1^t).
template <class C>
struct divided_by {
  static constexpr bool vectorizable = true;
  C c;
  template <class D>
  GRADAPT_HD void operator()(D& dst, const D& src) const {
    dst = src / c;
  }
};

/// D ← graft K's direction of g with state a (graft_kernel): (D, g) without a state or a
/// first moment, (D, g, a) with a state, (D, g, m, a) with both, dividing m / bc1 (the first
/// moment's bias correction) when `Corrects` (a block's m is gathered corrected: false).
template <class C, shampoo_graft K, bool Corrects = true>
struct graft_direction {
  static constexpr bool vectorizable = true;
  graft_kernel<C> gk;
  C bc1;
  template <class D, class Gv>
  GRADAPT_HD void operator()(D& d, const Gv& g) const {
    D a = D(C(0));
    const D gc = as_compute<C>(g);
    d = gk.template step<K>(gc, gc, a);
  }
  template <class D, class Gv>
  GRADAPT_HD void operator()(D& d, const Gv& g, D& a) const {
    const D gc = as_compute<C>(g);
    d = gk.template step<K>(gc, gc, a);
  }
  template <class D, class Gv>
  GRADAPT_HD void operator()(D& d, const Gv& g, const D& m, D& a) const {
    const D gc = as_compute<C>(g);
    if constexpr (Corrects)
      d = gk.template step<K>(gc, D(m / bc1), a);
    else
      d = gk.template step<K>(gc, m, a);
  }
};

/// D ← graft K's direction of g dividing m (divided by bc1 first when `Corrects`), without a
/// state.
template <class C, shampoo_graft K, bool Corrects = true>
struct graft_direction_of_moment {
  static constexpr bool vectorizable = true;
  graft_kernel<C> gk;
  C bc1;
  template <class D, class Gv>
  GRADAPT_HD void operator()(D& d, const Gv& g, const D& m) const {
    D a = D(C(0));
    const D gc = as_compute<C>(g);
    if constexpr (Corrects)
      d = gk.template step<K>(gc, D(m / bc1), a);
    else
      d = gk.template step<K>(gc, m, a);
  }
};

/// True when the graft keeps a per-element state.
constexpr bool graft_has_state(shampoo_graft g) {
  return g == shampoo_graft::adagrad || g == shampoo_graft::rmsprop || g == shampoo_graft::adam;
}

}  // namespace detail::shampoo_impl

}  // namespace gradapt

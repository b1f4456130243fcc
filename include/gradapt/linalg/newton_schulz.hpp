#pragma once
/// @file
/// The Newton–Schulz orthogonalization of a matrix (Muon's `zeropower`; Jordan et al. 2024,
/// Bernstein & Newhouse 2024 "Old optimizer, new norm"), on any `linalg_backend` `L` with the
/// element backend `B` of the same memory space (host_lapack with gradapt::host; cuda_linalg
/// with gradapt::cuda):
///
///     X₀ = G / max(‖G‖_F, ε)
///     Xₖ₊₁ = a·Xₖ + (b·Aₖ + c·Aₖ²)·Xₖ,   Aₖ = Xₖ·Xₖᵀ          (k = 0 .. steps − 1)
///
/// a quintic polynomial iteration that maps each singular value σ of X₀ (all in [0, 1] after
/// the scaling) towards 1 while keeping the singular vectors, so X_steps ≈ U·Vᵀ for G = U·Σ·Vᵀ.
/// With Jordan's coefficients (3.4445, −4.7750, 2.0315) and 5 steps the singular values land in
/// about [0.68, 1.13] rather than at 1: the iteration trades exactness for speed, as the
/// method intends. For a tall matrix (rows > columns) the same iteration runs on Xᵀ, written
/// as Xₖ₊₁ = a·Xₖ + Xₖ·(b·Bₖ + c·Bₖ²) with Bₖ = Xₖᵀ·Xₖ, so the Gram matrix is the smaller
/// side's. Cost per step, with k = min(rows, cols) and l = max(rows, cols): one SYRK (k²·l
/// multiply-adds, half of them computed), a k × k GEMM (k³) and a k × k by k × l GEMM (k²·l).
///
/// The products are `L`'s; the norm (`B::reduce`, sum_squares in double) and the element-wise
/// scalings and copies are `B`'s, so nothing here touches the matrix's memory from the host.
/// On a device the norm is brought to the host (one wait for `B`'s stream per call); every
/// other operation is enqueued.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>

#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

namespace gradapt {

/// The iteration's constants (see the file comment). The defaults are Jordan's quintic
/// coefficients, 5 steps, ε = 1e-7 (Distributed Shampoo clamps the norm at 1e-8).
struct newton_schulz_options {
  /// Iterations, >= 1. Default 5.
  std::uint32_t steps = 5;
  /// Coefficient of X. Default 3.4445.
  double a = 3.4445;
  /// Coefficient of A·X. Default −4.7750.
  double b = -4.7750;
  /// Coefficient of A²·X. Default 2.0315.
  double c = 2.0315;
  /// The smallest norm divided by, max(‖G‖_F, ε): finite and >= 0. Default 1e-7.
  double epsilon = 1e-7;
};

/// Throws gradapt::error naming the first invalid constant; `who` prefixes the message (the
/// option's owner, e.g. "shampoo: ns").
inline void validate(const newton_schulz_options& o, const char* who) {
  const auto finite = [](double v) { return std::isfinite(v); };
  detail::require(o.steps >= 1, who, ".steps is 0 (expected >= 1 iterations)");
  detail::require(finite(o.a) && finite(o.b) && finite(o.c), who, ": the coefficients (", o.a, ", ", o.b,
                  ", ", o.c, ") must be finite");
  detail::require(finite(o.epsilon) && o.epsilon >= 0, who, ".epsilon is ", o.epsilon,
                  " (expected finite and >= 0)");
}

namespace detail::linalg {
/// dst ← c·src in the element type (c rounded to it once).
struct scaled_copy {
  double c;  ///< the factor
  template <class T>
  GRADAPT_HD void operator()(T& dst, const T& src) const {
    dst = static_cast<T>(c) * src;
  }
};
}  // namespace detail::linalg

/// Elements of scratch `newton_schulz` needs for an m × n matrix: two k × k matrices (k =
/// min(m, n)) and one m × n.
constexpr std::size_t newton_schulz_workspace(std::int64_t m, std::int64_t n) {
  const auto k = static_cast<std::size_t>(m < n ? m : n);
  return 2 * k * k + static_cast<std::size_t>(m) * static_cast<std::size_t>(n);
}

/// Replaces the m × n row-major matrix `x` by its Newton–Schulz orthogonalization (see the
/// file comment), using `ws` (a vector of at least `newton_schulz_workspace(m, n)` elements, in
/// the same memory as `x`) for scratch. A zero matrix stays zero. The norm is `b`'s
/// sum_squares reduction (in double).
/// @throws gradapt::error when `x` is not a matrix or `ws` is too small
template <linalg_backend L, class B, class C>
requires std::same_as<typename B::space, typename L::space>
void newton_schulz(const L& la, const B& b, tensor_view<C, typename L::space> x,
                   tensor_view<C, typename L::space> ws, const newton_schulz_options& o) {
  detail::linalg::require_matrix(x, "newton_schulz", "the matrix");
  const std::int64_t m = x.dim(0), n = x.dim(1);
  detail::require(ws.size() >= newton_schulz_workspace(m, n), "newton_schulz: the workspace holds ",
                  ws.size(), " elements but a ", m, " x ", n, " matrix needs ",
                  newton_schulz_workspace(m, n));
  if (m == 0 || n == 0) return;
  using cview = tensor_view<const C, typename L::space>;
  using mview = tensor_view<C, typename L::space>;
  const bool tall = m > n;
  const std::int64_t k = tall ? n : m;
  const std::int64_t kk = k * k, mn = m * n;
  C* A = ws.data();
  C* Bk = A + kk;
  C* Y = Bk + kk;
  C* X = x.data();
  const mview flat_x = mview::vector(X, mn);
  const double sq = b.reduce(reduction::sum_squares, flat_x);
  const double norm = std::max(std::sqrt(sq), o.epsilon);
  if (!(norm > 0)) return;  // a zero matrix with ε = 0 stays zero
  b.apply(detail::multiply_by{1.0 / norm}, flat_x);
  C* cur = X;
  C* nxt = Y;
  for (std::uint32_t s = 0; s < o.steps; ++s) {
    // A = X·Xᵀ (wide) or Xᵀ·X (tall); B = b·A + c·A²; X' = a·X + B·X (wide) or a·X + X·B (tall).
    la.syrk(tall ? gram::columns : gram::rows, 1.0, cview(cur, {m, n}), 0.0, mview(A, {k, k}));
    b.apply(detail::linalg::scaled_copy{o.b}, mview::vector(Bk, kk), cview::vector(A, kk));
    la.gemm(transpose::none, transpose::none, o.c, cview(A, {k, k}), cview(A, {k, k}), 1.0,
            mview(Bk, {k, k}));
    b.apply(detail::linalg::scaled_copy{o.a}, mview::vector(nxt, mn), cview::vector(cur, mn));
    if (tall)
      la.gemm(transpose::none, transpose::none, 1.0, cview(cur, {m, n}), cview(Bk, {k, k}), 1.0,
              mview(nxt, {m, n}));
    else
      la.gemm(transpose::none, transpose::none, 1.0, cview(Bk, {k, k}), cview(cur, {m, n}), 1.0,
              mview(nxt, {m, n}));
    C* t = cur;
    cur = nxt;
    nxt = t;
  }
  if (cur != X) b.apply(detail::copy_to{}, flat_x, cview::vector(cur, mn));
}

}  // namespace gradapt

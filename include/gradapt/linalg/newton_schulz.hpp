#pragma once
/// @file
/// The Newton–Schulz orthogonalization of a matrix (Muon's `zeropower`; Jordan et al. 2024,
/// Bernstein & Newhouse 2024 "Old optimizer, new norm"), on any `linalg_backend`:
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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "gradapt/core/error.hpp"
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

/// Elements of scratch `newton_schulz` needs for an m × n matrix: two k × k matrices (k =
/// min(m, n)) and one m × n.
constexpr std::size_t newton_schulz_workspace(std::int64_t m, std::int64_t n) {
  const auto k = static_cast<std::size_t>(m < n ? m : n);
  return 2 * k * k + static_cast<std::size_t>(m) * static_cast<std::size_t>(n);
}

/// Replaces the m × n row-major matrix `x` by its Newton–Schulz orthogonalization (see the
/// file comment), using `ws` (at least `newton_schulz_workspace(m, n)` elements) for scratch.
/// A zero matrix stays zero. The norm is summed in double, in element order.
/// @throws gradapt::error when `x` is not a matrix or `ws` is too small
template <linalg_backend L, class C>
void newton_schulz(const L& la, tensor_view<C, typename L::space> x, std::span<C> ws,
                   const newton_schulz_options& o) {
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
  const auto kk = static_cast<std::size_t>(k * k);
  C* A = ws.data();
  C* B = A + kk;
  C* Y = B + kk;
  C* X = x.data();
  const auto mn = static_cast<std::size_t>(m * n);
  double sq = 0;
  for (std::size_t i = 0; i < mn; ++i) sq += static_cast<double>(X[i]) * static_cast<double>(X[i]);
  const double norm = std::max(std::sqrt(sq), o.epsilon);
  if (!(norm > 0)) return;  // a zero matrix with ε = 0 stays zero
  const C inv = static_cast<C>(1.0 / norm);
  for (std::size_t i = 0; i < mn; ++i) X[i] = X[i] * inv;
  C* cur = X;
  C* nxt = Y;
  for (std::uint32_t s = 0; s < o.steps; ++s) {
    // A = X·Xᵀ (wide) or Xᵀ·X (tall); B = b·A + c·A²; X' = a·X + B·X (wide) or a·X + X·B (tall).
    la.syrk(tall ? gram::columns : gram::rows, 1.0, cview(cur, {m, n}), 0.0, mview(A, {k, k}));
    for (std::size_t i = 0; i < kk; ++i) B[i] = static_cast<C>(o.b) * A[i];
    la.gemm(transpose::none, transpose::none, o.c, cview(A, {k, k}), cview(A, {k, k}), 1.0, mview(B, {k, k}));
    for (std::size_t i = 0; i < mn; ++i) nxt[i] = static_cast<C>(o.a) * cur[i];
    if (tall)
      la.gemm(transpose::none, transpose::none, 1.0, cview(cur, {m, n}), cview(B, {k, k}), 1.0,
              mview(nxt, {m, n}));
    else
      la.gemm(transpose::none, transpose::none, 1.0, cview(B, {k, k}), cview(cur, {m, n}), 1.0,
              mview(nxt, {m, n}));
    C* t = cur;
    cur = nxt;
    nxt = t;
  }
  if (cur != X)
    for (std::size_t i = 0; i < mn; ++i) X[i] = cur[i];
}

}  // namespace gradapt

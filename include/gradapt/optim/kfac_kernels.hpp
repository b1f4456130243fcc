#pragma once
/// @file
/// The element math of `gradapt::kfac` (kfac.hpp), written once for every memory space: the
/// GRADAPT_HD functors its backend passes call (casts, the running averages, the eigenvalue
/// clamp, the Kronecker-eigenvalue division) and `rows_of`, which cuts a row-major matrix's
/// column range into one view per row, so that a strided copy (the bias column of a and of the
/// gradient) is one multi-tensor pass (`apply_list`) on the host and on a device alike.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradapt/core/config.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::detail::kfac_k {

/// y = x in y's type.
struct cast {
  template <class Y, class X>
  GRADAPT_HD void operator()(Y& y, const X& x) const {
    y = static_cast<Y>(x);
  }
};

/// y = v (a constant).
struct fill {
  double v = 0;
  template <class Y>
  GRADAPT_HD void operator()(Y& y) const {
    y = static_cast<Y>(v);
  }
};

/// y = y + x.
struct add {
  template <class Y, class X>
  GRADAPT_HD void operator()(Y& y, const X& x) const {
    y = y + static_cast<Y>(x);
  }
};

/// y = y / c (a step's terms averaged over its accumulate calls).
struct divide {
  double c = 1;
  template <class Y>
  GRADAPT_HD void operator()(Y& y) const {
    y = y / static_cast<Y>(c);
  }
};

/// The running average of a symmetric n × n factor, f = d·f + w·(b / r) with b the step's
/// terms summed over r ranks (r = 1 alone), run by `apply_factored` over f seen as
/// [1, n, 1, n, 1] with the row and column indices as the row and column entries: element
/// (i, j) takes b's element (max(i, j), min(i, j)), so f stays symmetric bit for bit even when
/// a collective summed b's two triangles in different orders.
template <class B>
struct symmetric_average {
  double d = 0, w = 0, r = 1;
  const B* b = nullptr;  ///< the terms, in the backend's memory
  std::size_t n = 0;
  template <class R, class Cl, class F>
  GRADAPT_HD void operator()(const R& ri, const Cl& ci, F& f) const {
    const auto i = static_cast<std::size_t>(ri), j = static_cast<std::size_t>(ci);
    const F v = static_cast<F>(j > i ? b[j * n + i] : b[i * n + j]) / static_cast<F>(r);
    f = static_cast<F>(d) * f + static_cast<F>(w) * v;
  }
};

/// y = max(y, 0): an eigenvalue of a Gram matrix, clamped at 0.
struct clamp_zero {
  template <class Y>
  GRADAPT_HD void operator()(Y& y) const {
    y = y < Y(0) ? Y(0) : y;
  }
};

/// y = x / (d + λ) with d the column entry: Q·diag(1 / (d + λ)), column by column.
struct scale_columns {
  double lambda = 0;
  template <class R, class Cl, class Y, class X>
  GRADAPT_HD void operator()(const R&, const Cl& d, Y& y, const X& x) const {
    y = x / (d + static_cast<Y>(lambda));
  }
};

/// y = y / (r·c + λ): V ⊘ (d_G·d_Aᵀ + λ) with r = d_G[i], c = d_A[j].
struct kron_divide {
  double lambda = 0;
  template <class R, class Cl, class Y>
  GRADAPT_HD void operator()(const R& r, const Cl& c, Y& y) const {
    y = y / (r * c + static_cast<Y>(lambda));
  }
};

/// y = 1 / (r·c + λ): the precomputed divisors (prediv_eigenvalues).
struct kron_reciprocal {
  double lambda = 0;
  template <class R, class Cl, class Y>
  GRADAPT_HD void operator()(const R& r, const Cl& c, Y& y) const {
    y = Y(1) / (r * c + static_cast<Y>(lambda));
  }
};

/// y = y · x.
struct times {
  template <class Y, class X>
  GRADAPT_HD void operator()(Y& y, const X& x) const {
    y = y * static_cast<Y>(x);
  }
};

/// y = x·s in y's type (x·s formed in x's type): V scaled by ν into the gradient.
struct scaled_cast {
  double s = 1;
  template <class Y, class X>
  GRADAPT_HD void operator()(Y& y, const X& x) const {
    y = static_cast<Y>(x * static_cast<X>(s));
  }
};

/// Columns [at, at + len) of each of `rows` rows of a row-major matrix at `p` with `pitch`
/// elements per row: one view per row, for a multi-tensor pass. The list is a vector kept per
/// thread and view type, refilled by each call (so a steady step allocates nothing once it has
/// grown): valid until the next call for the same T and Space, so one pass may take one list of
/// each view type.
template <class T, class Space>
const std::vector<tensor_view<T, Space>>& rows_of(T* p, std::int64_t rows, std::int64_t pitch,
                                                  std::int64_t at, std::int64_t len) {
  thread_local std::vector<tensor_view<T, Space>> v;
  v.clear();
  for (std::int64_t r = 0; r < rows; ++r) v.push_back(tensor_view<T, Space>::vector(p + r * pitch + at, len));
  return v;
}

}  // namespace gradapt::detail::kfac_k

#pragma once
/// @file
/// Row/column kernels of the CUDA backend for the factored optimizers (Adafactor, SM3):
/// `gradapt::cuda::reduce_factored` and `gradapt::cuda::apply_factored`. A tensor is seen as
/// the row-major shape [A, X, B, Y, C]; "rows" are indexed by (a, i, b, c) and reduce over j,
/// "columns" by (a, b, j, c) and reduce over i (see gradapt::host::reduce_factored).
/// Included only from .cu translation units.
///
/// Order (deterministic, no atomics): a row result is one block of 256 lanes, lane l folding
/// j = l, l + 256, ... in increasing order, the lanes combined by a fixed tree in shared
/// memory; a column result is one thread folding i = 0, 1, ... in order (adjacent threads read
/// adjacent columns). The sum of `apply_factored` is one block per line (the same lanes and
/// tree over the line's Y·C elements), then the line sums combined by one block with the same
/// tree. Results repeat bit for bit; they are not bitwise equal to gradapt::host's (a
/// different, equally fixed, order).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::detail::cuda_impl {

inline constexpr unsigned factored_threads = 256;

/// The five extents of the [A, X, B, Y, C] view.
struct fdims {
  std::size_t A, X, B, Y, C;
};

template <bool Max>
__device__ __forceinline__ double ffold(double a, double t) {
  if constexpr (Max)
    return (a != a || t != t) ? __longlong_as_double(0x7ff8000000000000ll) : (a < t ? t : a);
  else
    return __dadd_rn(a, t);  // a separate rounded add: never fused with the functor's last multiply
}

/// Fixed tree over the block's 256 lanes in shared memory; returns the result in lane 0.
template <bool Max>
__device__ __forceinline__ double ftree(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (unsigned w = factored_threads / 2; w >= 1; w /= 2) {
    double val = 0.0;
    if (threadIdx.x < w) val = ffold<Max>(sh[2 * threadIdx.x], sh[2 * threadIdx.x + 1]);
    __syncthreads();  // every pair of this round is read before any lane writes
    if (threadIdx.x < w) sh[threadIdx.x] = val;
    __syncthreads();
  }
  return sh[0];
}

template <class RY, class RX>
struct fvectors {
  const RY* row;  ///< null: 1
  const RX* col;  ///< null: 1
};

template <class RY>
__device__ __forceinline__ compute_t<RY> fload_or_one(const RY* p, std::size_t i) {
  return p ? load(p[i]) : compute_t<RY>(1);
}

/// over_y: one block per row result (grid-stride over the A·X·B·C results).
template <bool Max, class F, class RY, class RX, class T>
__global__ void __launch_bounds__(factored_threads)
    factored_rows_kernel(const F f, fdims d, fvectors<RY, RX> v, const T* x, double* oy) {
  __shared__ double sh[factored_threads];
  const std::size_t L = d.Y * d.C, ny = d.A * d.X * d.B * d.C;
  for (std::size_t o = blockIdx.x; o < ny; o += gridDim.x) {
    const std::size_t l = o / d.C, c = o % d.C;
    const std::size_t a = l / (d.X * d.B), b = l % d.B;
    const auto r = fload_or_one(v.row, o);
    double acc = Max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (std::size_t j = threadIdx.x; j < d.Y; j += factored_threads) {
      const std::size_t k = j * d.C + c;
      const auto cv = fload_or_one(v.col, (a * d.B + b) * L + k);
      acc = ffold<Max>(acc, static_cast<double>(f(r, cv, load(x[l * L + k]))));
    }
    const double s = ftree<Max>(acc, sh);
    if (threadIdx.x == 0) oy[o] = s;
    __syncthreads();
  }
}

/// over_x: one thread per column result, i in order.
template <bool Max, class F, class RY, class RX, class T>
__global__ void __launch_bounds__(factored_threads)
    factored_cols_kernel(const F f, fdims d, fvectors<RY, RX> v, const T* x, double* ox) {
  const std::size_t L = d.Y * d.C, nx = d.A * d.B * L;
  for (std::size_t o = blockIdx.x * std::size_t{factored_threads} + threadIdx.x; o < nx;
       o += std::size_t{gridDim.x} * factored_threads) {
    const std::size_t ab = o / L, k = o % L, a = ab / d.B, b = ab % d.B;
    const auto cv = fload_or_one(v.col, o);
    double acc = Max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (std::size_t i = 0; i < d.X; ++i) {
      const std::size_t l = (a * d.X + i) * d.B + b;
      const auto r = fload_or_one(v.row, l * d.C + k % d.C);
      acc = ffold<Max>(acc, static_cast<double>(f(r, cv, load(x[l * L + k]))));
    }
    ox[o] = acc;
  }
}

template <class T>
__device__ __forceinline__ void fstore(T* p, std::size_t e, compute_t<T> v) {
  if constexpr (!std::is_const_v<T>) store(p[e], v);
}

/// Calls f(r, c, v...) on element e (loads, call, stores of the mutable views); returns f's
/// value as a double, or 0 for a void f.
template <class F, class R, class C, class... Ts>
__device__ __forceinline__ double fcall(const F& f, R r, C c, std::size_t e, Ts*... p) {
  return [&](compute_t<Ts>... v) -> double {
    double out = 0.0;
    if constexpr (std::is_void_v<decltype(f(r, c, v...))>)
      f(r, c, v...);
    else
      out = static_cast<double>(f(r, c, v...));
    (fstore(p, e, v), ...);
    return out;
  }(load(p[e])...);
}

/// The row entry and column entry of element e.
template <class RY, class RX>
__device__ __forceinline__ void fentries(const fdims& d, const fvectors<RY, RX>& v, std::size_t e,
                                         compute_t<RY>& r, compute_t<RX>& c) {
  const std::size_t L = d.Y * d.C;
  const std::size_t l = e / L, k = e % L, a = l / (d.X * d.B), b = l % d.B;
  r = fload_or_one(v.row, l * d.C + k % d.C);
  c = fload_or_one(v.col, (a * d.B + b) * L + k);
}

/// Element-wise apply_factored (grid-stride over the n elements).
template <class F, class RY, class RX, class... Ts>
__global__ void __launch_bounds__(factored_threads)
    factored_apply_kernel(const F f, fdims d, fvectors<RY, RX> v, std::size_t n, Ts*... p) {
  for (std::size_t e = blockIdx.x * std::size_t{factored_threads} + threadIdx.x; e < n;
       e += std::size_t{gridDim.x} * factored_threads) {
    compute_t<RY> r;
    compute_t<RX> c;
    fentries(d, v, e, r, c);
    fcall(f, r, c, e, p...);
  }
}

/// apply_factored with a sum: one block per line of Y·C elements into line_sums.
template <class F, class RY, class RX, class... Ts>
__global__ void __launch_bounds__(factored_threads)
    factored_apply_sum_kernel(const F f, fdims d, fvectors<RY, RX> v, double* line_sums, Ts*... p) {
  __shared__ double sh[factored_threads];
  const std::size_t L = d.Y * d.C, lines = d.A * d.X * d.B;
  for (std::size_t l = blockIdx.x; l < lines; l += gridDim.x) {
    double acc = 0.0;
    for (std::size_t k = threadIdx.x; k < L; k += factored_threads) {
      compute_t<RY> r;
      compute_t<RX> c;
      fentries(d, v, l * L + k, r, c);
      acc = __dadd_rn(acc, fcall(f, r, c, l * L + k, p...));  // never fused with f's last multiply
    }
    const double s = ftree<false>(acc, sh);
    if (threadIdx.x == 0) line_sums[l] = s;
    __syncthreads();
  }
}

/// The sum of in[0, n) by one block (lane l folds l, l + 256, ... then the fixed tree).
__global__ void __launch_bounds__(factored_threads)
    factored_sum_kernel(const double* in, std::size_t n, double* out) {
  __shared__ double sh[factored_threads];
  double acc = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += factored_threads) acc = __dadd_rn(acc, in[i]);
  const double s = ftree<false>(acc, sh);
  if (threadIdx.x == 0) *out = s;
}

/// Blocks for a grid-stride loop over `work` items of `per_block` each.
inline unsigned factored_grid(std::size_t work, std::size_t per_block) {
  const std::size_t g = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 8192 ? 8192 : g));
}

}  // namespace gradapt::detail::cuda_impl

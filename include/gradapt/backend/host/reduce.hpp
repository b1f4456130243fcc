#pragma once
/// @file
/// The host backend's reductions (part of gradapt::host, backend/host.hpp): sums, sums of
/// squares, dot products, max-abs and non-finite counts accumulated in double over fixed
/// 4096-element blocks of 8 lanes (a fixed tree), blocks and tensors added in order, so the
/// bits do not depend on the thread count. An explicit 128-bit path (and AVX2 chosen at run
/// time) keeps the same lane assignment as the scalar loop.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/simd.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradapt::detail::host_impl {

/// Elements per reduction block. A block is reduced with `lanes` independent double
/// accumulators (lane l takes elements l, l + lanes, ... of the block), combined as a fixed
/// binary tree (pairs of neighbours first); a tensor's blocks are then added in block order. This blocking is
/// part of the determinism promise: it does not depend on the thread count.
inline constexpr std::size_t block = 4096;
inline constexpr std::size_t lanes = 8;
/// Blocks reduced in parallel per round (partials live on the stack: nothing is allocated).
inline constexpr std::size_t round_blocks = 256;
/// Element-wise work is split into chunks of this many elements across threads.
inline constexpr std::size_t apply_chunk = std::size_t{1} << 15;
/// Tensors below this size are reduced by one thread each (parallel across tensors).
inline constexpr std::size_t parallel_min = std::size_t{1} << 17;

enum class rk : unsigned char { sum, sum_squares, max_abs, nonfinite, dot };

template <rk K>
inline constexpr bool is_max = K == rk::max_abs;

/// Combines two partial results of kind K (sum, or max with NaN propagation).
template <rk K>
GRADAPT_INLINE double combine(double a, double b) {
  if constexpr (is_max<K>) {
    if (a != a || b != b) return std::numeric_limits<double>::quiet_NaN();
    return a > b ? a : b;
  } else {
    return a + b;
  }
}

/// Fixed pairwise tree over the lane accumulators: (0+1), (2+3), ... then pairs of those.
template <rk K>
GRADAPT_INLINE double combine_lanes(double (&acc)[lanes]) {
  double t[lanes];
  for (std::size_t l = 0; l < lanes; ++l) t[l] = acc[l];
  for (std::size_t w = lanes / 2; w >= 1; w /= 2)
    for (std::size_t l = 0; l < w; ++l) t[l] = combine<K>(t[2 * l], t[2 * l + 1]);
  return t[0];
}

#if defined(__GNUC__) && !defined(GRADAPT_NO_VECTOR_EXTENSIONS)
#define GRADAPT_HOST_VECTOR 1
// Explicit 128-bit vectors (GCC/Clang vector extensions): fast under the consumer's plain -O2
// with no -march. Lane assignment equals the scalar path's (lane l takes elements l mod 8), so
// both paths produce the same bits; only one of them is compiled into a given build.
typedef double v2d __attribute__((vector_size(16)));

GRADAPT_INLINE v2d load2(const double* p) {
  v2d v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
/// Two floats widened to two doubles (movq + cvtps2pd on x86-64, where SSE2 is baseline).
GRADAPT_INLINE v2d widen2(const float* p) {
#if defined(__SSE2__)
  return _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef float v2f __attribute__((vector_size(8)));
  v2f v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, v2d);
#endif
}

/// Accumulators of one block on the vector path: lanes (0,1) (2,3) (4,5) (6,7) in four double
/// pairs. `feed` takes the next 8 elements; `finish` adds a tail of fewer than 8 elements to
/// lanes 0.. and combines the lanes exactly as the scalar loop does.
template <rk K, class T>
struct vec_block {
  static_assert(lanes == 8, "the vector path holds 8 lanes in 4 double pairs");
  v2d a0 = {0, 0}, a1 = {0, 0}, a2 = {0, 0}, a3 = {0, 0};

  static GRADAPT_INLINE void step(v2d& acc, v2d v, v2d w) {
    if constexpr (K == rk::sum)
      acc += v;
    else if constexpr (K == rk::sum_squares)
      acc += v * v;
    else
      acc += v * w;
  }
  static GRADAPT_INLINE v2d get(const T* p) {
    if constexpr (std::is_same_v<T, float>)
      return widen2(p);
    else
      return load2(p);
  }
  GRADAPT_INLINE void feed(const T* x, const T* y) {
    const v2d f0 = get(x), f1 = get(x + 2), f2 = get(x + 4), f3 = get(x + 6);
    if constexpr (K == rk::dot) {
      step(a0, f0, get(y)), step(a1, f1, get(y + 2)), step(a2, f2, get(y + 4)), step(a3, f3, get(y + 6));
    } else {
      step(a0, f0, f0), step(a1, f1, f1), step(a2, f2, f2), step(a3, f3, f3);
    }
  }
  double finish(const T* x, const T* y, std::size_t rem) const {
    double acc[lanes] = {a0[0], a0[1], a1[0], a1[1], a2[0], a2[1], a3[0], a3[1]};
    for (std::size_t l = 0; l < rem; ++l) {
      const double v = static_cast<double>(x[l]);
      if constexpr (K == rk::sum)
        acc[l] += v;
      else if constexpr (K == rk::sum_squares)
        acc[l] += v * v;
      else
        acc[l] += v * static_cast<double>(y[l]);
    }
    return combine_lanes<rk::sum>(acc);
  }
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(GRADAPT_NO_AVX2_DISPATCH)
#define GRADAPT_HOST_AVX2 1
// The AVX2 functions below are compiled for AVX2 whatever the consumer's flags (function
// target attribute) and chosen at run time by simd::detail::cpu_has_avx2.
using simd::detail::cpu_has_avx2;

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/// vec_block with 256-bit registers: lanes 0-3 in `lo`, 4-7 in `hi`. Each lane sees the same
/// operations in the same order as on the SSE2 path and the scalar loop (no FMA), so the bits
/// are the same; only the instruction count halves.
template <rk K, class T>
struct avx_block {
  v4d lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};
  __attribute__((target("avx2"), always_inline)) static v4d get(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      v4f f;
      std::memcpy(&f, p, sizeof f);
      return __builtin_convertvector(f, v4d);
    } else {
      v4d d;
      std::memcpy(&d, p, sizeof d);
      return d;
    }
  }
  __attribute__((target("avx2"), always_inline)) static void step(v4d& acc, v4d v, v4d w) {
    if constexpr (K == rk::sum)
      acc += v;
    else if constexpr (K == rk::sum_squares)
      acc += v * v;
    else
      acc += v * w;
  }
  __attribute__((target("avx2"), always_inline)) void feed(const T* x, const T* y) {
    const v4d f0 = get(x), f1 = get(x + 4);
    if constexpr (K == rk::dot) {
      step(lo, f0, get(y)), step(hi, f1, get(y + 4));
    } else {
      step(lo, f0, f0), step(hi, f1, f1);
    }
  }
  __attribute__((target("avx2"))) double finish(const T* x, const T* y, std::size_t rem) const {
    double acc[lanes] = {lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]};
    for (std::size_t l = 0; l < rem; ++l) {
      const double v = static_cast<double>(x[l]);
      if constexpr (K == rk::sum)
        acc[l] += v;
      else if constexpr (K == rk::sum_squares)
        acc[l] += v * v;
      else
        acc[l] += v * static_cast<double>(y[l]);
    }
    return combine_lanes<rk::sum>(acc);
  }
};

template <rk K, class T>
__attribute__((target("avx2"))) double reduce_block_avx2(const T* x, const T* y, std::size_t n) {
  avx_block<K, T> s;
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) s.feed(x + i, K == rk::dot ? y + i : nullptr);
  return s.finish(x + i, K == rk::dot ? y + i : nullptr, n - i);
}

template <rk K, class T>
__attribute__((target("avx2"))) void reduce_block_pair_avx2(const T* xa, const T* ya, const T* xb,
                                                            const T* yb, double& ra, double& rb) {
  avx_block<K, T> A, B;
  for (std::size_t i = 0; i < block; i += lanes) {
    A.feed(xa + i, K == rk::dot ? ya + i : nullptr);
    B.feed(xb + i, K == rk::dot ? yb + i : nullptr);
  }
  ra = A.finish(xa, ya, 0);
  rb = B.finish(xb, yb, 0);
}
#endif

/// Vector form of reduce_block for float and double sum / sum_squares / dot: the same value
/// as the scalar loop.
template <rk K, class T>
double reduce_block_vec(const T* x, const T* y, std::size_t n) {
#if defined(GRADAPT_HOST_AVX2)
  if (cpu_has_avx2()) return reduce_block_avx2<K, T>(x, y, n);
#endif
  vec_block<K, T> s;
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) s.feed(x + i, K == rk::dot ? y + i : nullptr);
  return s.finish(x + i, K == rk::dot ? y + i : nullptr, n - i);
}

/// Two full blocks reduced in lockstep: two independent read streams keep more memory
/// requests in flight than one, which a single thread needs to approach the memory roof. Each
/// result equals reduce_block_vec of that block alone.
template <rk K, class T>
void reduce_block_pair_vec(const T* xa, const T* ya, const T* xb, const T* yb, double& ra, double& rb) {
#if defined(GRADAPT_HOST_AVX2)
  if (cpu_has_avx2()) return reduce_block_pair_avx2<K, T>(xa, ya, xb, yb, ra, rb);
#endif
  vec_block<K, T> A, B;
  for (std::size_t i = 0; i < block; i += lanes) {
    A.feed(xa + i, K == rk::dot ? ya + i : nullptr);
    B.feed(xb + i, K == rk::dot ? yb + i : nullptr);
  }
  ra = A.finish(xa, ya, 0);
  rb = B.finish(xb, yb, 0);
}

/// max |x| over float: exact in float, NaN tracked apart; returns what the scalar path does.
inline double max_abs_block_vec(const float* x, std::size_t n) {
  bool any_nan = false;
  double r = 0.0;
  std::size_t i = 0;
#if defined(__SSE2__)
  // maxps on |x| plus an unordered-compare mask for NaN: 5 instructions per 4 floats, in four
  // independent chains.
  const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 m[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  __m128 nan[4] = {m[0], m[0], m[0], m[0]};
  const auto body = [&]<std::size_t... Q>(std::index_sequence<Q...>) {
    for (; i + 16 <= n; i += 16)
      (
          [&] {
            const __m128 a = _mm_and_ps(_mm_loadu_ps(x + i + 4 * Q), absmask);
            nan[Q] = _mm_or_ps(nan[Q], _mm_cmpunord_ps(a, a));
            m[Q] = _mm_max_ps(m[Q], a);
          }(),
          ...);
  };
  body(std::make_index_sequence<4>{});
  const __m128 mm = _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3]));
  any_nan = _mm_movemask_ps(_mm_or_ps(_mm_or_ps(nan[0], nan[1]), _mm_or_ps(nan[2], nan[3]))) != 0;
  float lanes4[4];
  _mm_storeu_ps(lanes4, mm);
  for (float v : lanes4) r = std::max(r, static_cast<double>(v));
#endif
  for (; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    any_nan |= v != v;
    r = std::fabs(v) > r ? std::fabs(v) : r;
  }
  return any_nan ? std::numeric_limits<double>::quiet_NaN() : r;
}
#endif

/// Reduces elements [0, n) (n <= block) of x (and y for dot) with `lanes` accumulators.
template <rk K, class T, class U>
double reduce_block(const T* x, const U* y, std::size_t n) {
#if defined(GRADAPT_HOST_VECTOR)
  if constexpr ((K == rk::sum || K == rk::sum_squares || K == rk::dot) &&
                (std::is_same_v<T, float> || std::is_same_v<T, double>)&&(K != rk::dot ||
                                                                          std::is_same_v<T, U>))
    return reduce_block_vec<K, T>(x, reinterpret_cast<const T*>(y), n);
  if constexpr (K == rk::max_abs && std::is_same_v<T, float>) return max_abs_block_vec(x, n);
#endif
  double acc[lanes] = {};
  bool nan = false;
  std::size_t i = 0;
  const auto term = [&](std::size_t j, double& a) {
    const double v = static_cast<double>(load(x[j]));
    if constexpr (K == rk::sum) {
      a += v;
    } else if constexpr (K == rk::sum_squares) {
      a += v * v;
    } else if constexpr (K == rk::dot) {
      a += v * static_cast<double>(load(y[j]));
    } else if constexpr (K == rk::max_abs) {
      const double m = std::fabs(v);
      nan |= (v != v);
      a = m > a ? m : a;
    } else {
      a += std::fabs(v) <= std::numeric_limits<double>::max() ? 0.0 : 1.0;
    }
  };
  for (; i + lanes <= n; i += lanes)
    for (std::size_t l = 0; l < lanes; ++l) term(i + l, acc[l]);
  for (std::size_t l = 0; i + l < n; ++l) term(i + l, acc[l]);
  if constexpr (K == rk::max_abs)
    if (nan) return std::numeric_limits<double>::quiet_NaN();
  return combine_lanes<K>(acc);
}

template <rk K, class T, class U>
inline constexpr bool vector_pair_v =
#if defined(GRADAPT_HOST_VECTOR)
    (K == rk::sum || K == rk::sum_squares || K == rk::dot) &&
    (std::is_same_v<T, float> || std::is_same_v<T, double>)&&(K != rk::dot || std::is_same_v<T, U>);
#else
    false;
#endif

/// Partials of blocks ba and bb of a tensor of n elements: in lockstep when both are full and
/// the vector path applies, one after the other otherwise. The values do not depend on which.
template <rk K, class T, class U>
void reduce_block_pair(const T* x, const U* y, std::size_t n, std::size_t ba, std::size_t bb, double& ra,
                       double& rb) {
  const std::size_t oa = ba * block, ob = bb * block;
  const std::size_t na = std::min(block, n - oa), nb = std::min(block, n - ob);
  if constexpr (vector_pair_v<K, T, U>) {
    if (na == block && nb == block) {
      const T* ya = nullptr;
      const T* yb = nullptr;
      if constexpr (K == rk::dot) ya = y + oa, yb = y + ob;
      reduce_block_pair_vec<K, T>(x + oa, ya, x + ob, yb, ra, rb);
      return;
    }
  }
  ra = reduce_block<K>(x + oa, y ? y + oa : nullptr, na);
  rb = reduce_block<K>(x + ob, y ? y + ob : nullptr, nb);
}

/// Partials of blocks [r0, r0 + rb) into part[0, rb): block j of the round is paired with
/// block j + ceil(rb / 2). `Worksharing` makes the pair loop an OpenMP `for` (inside a
/// parallel region).
template <bool Worksharing, rk K, class T, class U>
void round_partials(const T* x, const U* y, std::size_t n, std::size_t r0, std::size_t rb, double* part) {
  const std::size_t half = (rb + 1) / 2;
  const auto body = [&](std::size_t j) {
    if (j + half < rb)
      reduce_block_pair<K>(x, y, n, r0 + j, r0 + j + half, part[j], part[j + half]);
    else
      part[j] = reduce_block<K>(x + (r0 + j) * block, y ? y + (r0 + j) * block : nullptr,
                                std::min(block, n - (r0 + j) * block));
  };
  if constexpr (Worksharing) {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
    for (std::size_t j = 0; j < half; ++j) body(j);
  } else {
    for (std::size_t j = 0; j < half; ++j) body(j);
  }
}

/// One tensor, reduced by the calling thread alone: block partials by rounds, added in block
/// order.
template <rk K, class T, class U>
double reduce_serial(const T* x, const U* y, std::size_t n) {
  const std::size_t nblocks = (n + block - 1) / block;
  double total = 0.0;
  double part[round_blocks];
  for (std::size_t r0 = 0; r0 < nblocks; r0 += round_blocks) {
    const std::size_t rb = std::min(round_blocks, nblocks - r0);
    round_partials<false, K>(x, y, n, r0, rb, part);
    for (std::size_t j = 0; j < rb; ++j) total = combine<K>(total, part[j]);
  }
  return total;
}

/// One tensor, block partials computed by `threads` threads, added in block order per round.
/// Produces exactly reduce_serial's result.
template <rk K, class T, class U>
double reduce_parallel(const T* x, const U* y, std::size_t n, [[maybe_unused]] int threads) {
#if defined(_OPENMP)
  if (threads > 1 && n >= parallel_min) {
    const std::size_t nblocks = (n + block - 1) / block;
    double total = 0.0;
    double part[round_blocks];
#pragma omp parallel num_threads(threads)
    for (std::size_t r0 = 0; r0 < nblocks; r0 += round_blocks) {
      const std::size_t rb = std::min(round_blocks, nblocks - r0);
      round_partials<true, K>(x, y, n, r0, rb, part);
#pragma omp single
      for (std::size_t j = 0; j < rb; ++j) total = combine<K>(total, part[j]);
    }
    return total;
  }
#endif
  return reduce_serial<K>(x, y, n);
}

/// Per-tensor results into out[0, count), global combination in tensor order. `ydata(t)` gives
/// tensor t's second operand (dot) or a null pointer.
template <rk K, class XS, class YGet>
double reduce_list(const XS& xs, YGet ydata, std::span<double> out, int threads) {
  const std::size_t count = std::ranges::size(xs);
  const auto* xp = std::ranges::data(xs);
  double total = 0.0;
  double stack[round_blocks];
  for (std::size_t t0 = 0; t0 < count; t0 += round_blocks) {
    const std::size_t tn = std::min(round_blocks, count - t0);
    double* res = out.empty() ? stack : out.data() + t0;
    // Large tensors: one at a time, threads inside. Small ones: threads across tensors.
    for (std::size_t j = 0; j < tn; ++j) {
      const auto& v = xp[t0 + j];
      if (v.size() >= parallel_min) res[j] = reduce_parallel<K>(v.data(), ydata(t0 + j), v.size(), threads);
    }
    [[maybe_unused]] const int nt = threads;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt) if (nt > 1 && tn > 1)
#endif
    for (std::size_t j = 0; j < tn; ++j) {
      const auto& v = xp[t0 + j];
      if (v.size() < parallel_min) res[j] = reduce_serial<K>(v.data(), ydata(t0 + j), v.size());
    }
    for (std::size_t j = 0; j < tn; ++j) total = combine<K>(total, res[j]);
  }
  return total;
}

}  // namespace gradapt::detail::host_impl

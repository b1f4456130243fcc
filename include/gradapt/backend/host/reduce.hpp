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

#if GRADAPT_SIMD_PACKS
#define GRADAPT_HOST_VECTOR 1
#if defined(__x86_64__) && GRADAPT_SIMD_AVX_ASM && !defined(GRADAPT_NO_AVX2_DISPATCH)
// The functions marked target("avx2") are compiled for AVX2 whatever the consumer's flags and
// chosen at run time by simd::detail::cpu_has_avx2. They run 32-byte packs; no FMA, so every
// lane sees the same IEEE operations as on the 16-byte and scalar paths and the bits agree.
#define GRADAPT_HOST_AVX2 1
#define GRADAPT_HOST_PACKS_AVX2 1
#endif
using simd::detail::cpu_has_avx2;

/// The accumulators of one block on the vector path: one double pack of `lanes` lanes in
/// registers of B bytes (lane l takes elements l mod 8, as on the scalar loop). `feed` takes
/// the next 8 elements; `finish` adds a tail of fewer than 8 elements to lanes 0.. and
/// combines the lanes exactly as the scalar loop does.
template <rk K, class T, std::size_t B = simd::native_bytes>
struct lane_block {
  using acc_pack = simd::pack<double, lanes, B>;
  using in_pack = simd::pack<T, lanes, B>;
  acc_pack acc;

  GRADAPT_INLINE void start() { acc = acc_pack(0.0); }
  static GRADAPT_INLINE acc_pack get(const T* p) { return simd::widen(in_pack::load(p)); }
  GRADAPT_INLINE void feed(const T* x, const T* y) {
    const acc_pack v = get(x);
    if constexpr (K == rk::sum)
      acc += v;
    else if constexpr (K == rk::sum_squares)
      acc += v * v;
    else
      acc += v * get(y);
  }
  GRADAPT_INLINE double finish(const T* x, const T* y, std::size_t rem) const {
    double a[lanes];
    acc.store(a);
    for (std::size_t l = 0; l < rem; ++l) {
      const double v = static_cast<double>(x[l]);
      if constexpr (K == rk::sum)
        a[l] += v;
      else if constexpr (K == rk::sum_squares)
        a[l] += v * v;
      else
        a[l] += v * static_cast<double>(y[l]);
    }
    return combine_lanes<rk::sum>(a);
  }
};

template <rk K, class T, std::size_t B>
GRADAPT_INLINE double reduce_block_lanes(const T* x, const T* y, std::size_t n) {
  lane_block<K, T, B> s;
  s.start();
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) s.feed(x + i, K == rk::dot ? y + i : nullptr);
  return s.finish(x + i, K == rk::dot ? y + i : nullptr, n - i);
}

template <rk K, class T, std::size_t B>
GRADAPT_INLINE void reduce_block_pair_lanes(const T* xa, const T* ya, const T* xb, const T* yb, double& ra,
                                            double& rb) {
  lane_block<K, T, B> A, C;
  A.start();
  C.start();
  for (std::size_t i = 0; i < block; i += lanes) {
    A.feed(xa + i, K == rk::dot ? ya + i : nullptr);
    C.feed(xb + i, K == rk::dot ? yb + i : nullptr);
  }
  ra = A.finish(xa, ya, 0);
  rb = C.finish(xb, yb, 0);
}

#if defined(GRADAPT_HOST_AVX2)
template <rk K, class T>
__attribute__((target("avx2"), flatten)) double reduce_block_avx2(const T* x, const T* y, std::size_t n) {
  return reduce_block_lanes<K, T, 32>(x, y, n);
}
template <rk K, class T>
__attribute__((target("avx2"), flatten)) void reduce_block_pair_avx2(const T* xa, const T* ya, const T* xb,
                                                                     const T* yb, double& ra, double& rb) {
  reduce_block_pair_lanes<K, T, 32>(xa, ya, xb, yb, ra, rb);
}
#endif

/// Vector form of reduce_block for float and double sum / sum_squares / dot: the same value
/// as the scalar loop.
template <rk K, class T>
double reduce_block_vec(const T* x, const T* y, std::size_t n) {
#if defined(GRADAPT_HOST_AVX2)
  if (cpu_has_avx2()) return reduce_block_avx2<K, T>(x, y, n);
#endif
  return reduce_block_lanes<K, T, simd::native_bytes>(x, y, n);
}

/// Two full blocks reduced in lockstep: two independent read streams keep more memory
/// requests in flight than one, which a single thread needs to approach the memory roof. Each
/// result equals reduce_block_vec of that block alone.
template <rk K, class T>
void reduce_block_pair_vec(const T* xa, const T* ya, const T* xb, const T* yb, double& ra, double& rb) {
#if defined(GRADAPT_HOST_AVX2)
  if (cpu_has_avx2()) return reduce_block_pair_avx2<K, T>(xa, ya, xb, yb, ra, rb);
#endif
  reduce_block_pair_lanes<K, T, simd::native_bytes>(xa, ya, xb, yb, ra, rb);
}

/// max |x| over float: exact in float, NaN tracked apart; returns what the scalar path does.
/// Four independent 4-lane chains of max on |x| plus an unordered-compare mask for NaN.
inline double max_abs_block_vec(const float* x, std::size_t n) {
  using P = simd::pack<float, 4>;
  using M = simd::mask<float, 4, simd::native_bytes>;
  P m[4] = {P(0.0f), P(0.0f), P(0.0f), P(0.0f)};
  M nan[4] = {m[0] != m[0], m[0] != m[0], m[0] != m[0], m[0] != m[0]};
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (std::size_t q = 0; q < 4; ++q) {
      const P a = simd::abs(P::load(x + i + 4 * q));
      nan[q] = nan[q] | (a != a);
      m[q] = simd::gt_max(a, m[q]);
    }
  const P mm = simd::gt_max(simd::gt_max(m[0], m[1]), simd::gt_max(m[2], m[3]));
  bool any_nan = ((nan[0] | nan[1]) | (nan[2] | nan[3])).any();
  double r = 0.0;
  for (std::size_t l = 0; l < 4; ++l) r = std::max(r, static_cast<double>(mm[l]));
  for (; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    any_nan |= v != v;
    r = std::fabs(v) > r ? std::fabs(v) : r;
  }
  return any_nan ? std::numeric_limits<double>::quiet_NaN() : r;
}
#endif

#if defined(GRADAPT_HOST_VECTOR)
/// Sources the fused fp32 sum-with-squares loop takes (more sources use the block path).
inline constexpr int max_fused_sources = 64;

/// out[i] = x_0[i] + ... + x_{p-1}[i] (fp32, source order) for i < n, and in double: the sum
/// of all x_k[i]^2 and the sum of out[i]^2, element i feeding lane i mod 8 of both sums; the
/// lanes are combined in the fixed tree. One 8-lane pack per step; the bits do not depend on
/// the register width B (no FMA contraction: products and sums are separate operations).
template <std::size_t B>
GRADAPT_INLINE std::pair<double, double> sum_with_squares_lanes(const float* const* xs, int p, float* out,
                                                                std::size_t n) {
  using F = simd::pack<float, lanes, B>;
  using D = simd::pack<double, lanes, B>;
  D local(0.0), result(0.0);
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    F a = F::load(xs[0] + i);
    D d = simd::widen(a);
    local += d * d;
    for (int k = 1; k < p; ++k) {
      const F b = F::load(xs[k] + i);
      a += b;
      d = simd::widen(b);
      local += d * d;
    }
    a.store(out + i);
    d = simd::widen(a);
    result += d * d;
  }
  double lo[lanes], ro[lanes];
  local.store(lo);
  result.store(ro);
  for (std::size_t l = 0; i < n; ++i, ++l) {
    float a = xs[0][i];
    lo[l] += static_cast<double>(a) * static_cast<double>(a);
    for (int k = 1; k < p; ++k) {
      const float b = xs[k][i];
      a += b;
      lo[l] += static_cast<double>(b) * static_cast<double>(b);
    }
    out[i] = a;
    ro[l] += static_cast<double>(a) * static_cast<double>(a);
  }
  return {combine_lanes<rk::sum>(lo), combine_lanes<rk::sum>(ro)};
}

#if defined(GRADAPT_HOST_AVX2)
__attribute__((target("avx2"), flatten)) inline std::pair<double, double> sum_with_squares_avx2(
    const float* const* xs, int p, float* out, std::size_t n) {
  return sum_with_squares_lanes<32>(xs, p, out, n);
}
#endif

inline std::pair<double, double> sum_with_squares(const float* const* xs, int p, float* out, std::size_t n) {
#if defined(GRADAPT_HOST_AVX2)
  if (cpu_has_avx2()) return sum_with_squares_avx2(xs, p, out, n);
#endif
  return sum_with_squares_lanes<simd::native_bytes>(xs, p, out, n);
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

/// `combine_sources`' default block hook: nothing to do with a finished block.
struct no_block_hook {
  void operator()(std::size_t, std::size_t) const {}
};

/// Element-wise combination of `p` arrays of n elements, in source order: out[i] = x_0[i] op
/// x_1[i] op ... in compute_t<T>, rounded once (max propagates NaN). With `Norms`, also the sum
/// over sources of |x_k|^2 and |out|^2 (as stored), in double, block by block (`block`
/// elements, each block's values taken while it is in cache, blocks added in order).
/// `src(k)` is source k's first element; `out` may be one of the sources (the same elements:
/// each group of elements is loaded from every source before it is stored) but may not
/// overlap one otherwise. With `Mean` (sum only, without norms), out[i] is the sum rounded to
/// T, divided by p in compute_t<T> and rounded again: exactly the sum followed by
/// detail::divide_by_ranks{p}, in the same pass. `then(b, e)` is called, in order, for each
/// block [b, e) of `block` elements (the last one shorter) once out[b, e) is stored, while it
/// is in cache.
template <bool Norms, class T, class Src, bool Mean = false, class Then = no_block_hook>
allreduce_norms combine_sources(int p, const Src& src, T* out, std::size_t n, reduce_op op,
                                std::bool_constant<Mean> = {}, const Then& then = {}) {
  using C = compute_t<T>;
  static_assert(!(Norms && Mean), "combine_sources: the mean is formed without norms");
  // The value stored for a combined `acc`: itself, or (with Mean) the stored sum over p.
  const auto result = [&](C acc) {
    if constexpr (Mean) {
      T s;
      store(s, acc);
      return static_cast<C>(load(s) / static_cast<C>(p));
    } else {
      return acc;
    }
  };
  const auto combine_range = [&](std::size_t b, std::size_t e) {
    constexpr std::size_t g = 8;
    std::size_t i = b;
    if (op == reduce_op::sum) {
      for (; i + g <= e; i += g) {
        C acc[g];
        const T* x0 = src(0) + i;
        for (std::size_t l = 0; l < g; ++l) acc[l] = load(x0[l]);
        for (int k = 1; k < p; ++k) {
          const T* xk = src(k) + i;
          C v[g];
          for (std::size_t l = 0; l < g; ++l) v[l] = load(xk[l]);
          for (std::size_t l = 0; l < g; ++l) acc[l] += v[l];
        }
        for (std::size_t l = 0; l < g; ++l) store(out[i + l], result(acc[l]));
      }
    }
    for (; i < e; ++i) {
      C acc = load(src(0)[i]);
      for (int k = 1; k < p; ++k) {
        const C v = load(src(k)[i]);
        if (op == reduce_op::sum)
          acc += v;
        else if (acc != acc || v != v)
          acc = acc != acc ? acc : v;
        else
          acc = v > acc ? v : acc;
      }
      store(out[i], result(acc));
    }
  };
  allreduce_norms norms;
  if constexpr (!Norms) {
    for (std::size_t b = 0; b < n; b += block) {
      const std::size_t e = std::min(n, b + block);
      combine_range(b, e);
      then(b, e);
    }
  } else {
    for (std::size_t b = 0; b < n; b += block) {
      const std::size_t e = std::min(n, b + block);
#if defined(GRADAPT_HOST_VECTOR)
      if constexpr (std::is_same_v<T, float>) {
        if (p <= max_fused_sources && op == reduce_op::sum) {
          // fp32: the squares are taken inside the reduction loop, on the values in registers,
          // so their arithmetic overlaps the loop's memory traffic.
          const float* xs[max_fused_sources];
          for (int k = 0; k < p; ++k) xs[k] = src(k) + b;
          const auto [l, r] = sum_with_squares(xs, p, out + b, e - b);
          norms.sum_local_sq += l;
          norms.result_sq += r;
          then(b, e);
          continue;
        }
      }
#endif
      // The sources' squares first: `out` may be one of them.
      for (int k = 0; k < p; ++k)
        norms.sum_local_sq +=
            reduce_block<rk::sum_squares>(src(k) + b, static_cast<const T*>(nullptr), e - b);
      combine_range(b, e);
      norms.result_sq += reduce_block<rk::sum_squares>(out + b, static_cast<const T*>(nullptr), e - b);
      then(b, e);
    }
  }
  return norms;
}

}  // namespace gradapt::detail::host_impl

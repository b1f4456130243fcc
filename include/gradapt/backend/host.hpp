#pragma once
/// @file
/// The host backend: element-wise functors and reductions over host memory, with optional
/// OpenMP threads. Reductions are accumulated in double with a fixed blocking, so results are
/// bitwise identical for any thread count and from run to run.

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

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/concepts.hpp"
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

namespace gradapt {

namespace detail::host_impl {

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

/// Elements handled as one group by the element loops: all loads of a group happen before
/// any store, so the compiler's straight-line (SLP) vectoriser can use vector loads and stores
/// at plain -O2 without proving that outputs and inputs do not overlap.
inline constexpr std::size_t group = 8;

/// Loads `group` consecutive elements into their compute type (no value-initialisation, so
/// the array can live in registers).
template <class T>
GRADAPT_INLINE std::array<compute_t<T>, group> load_group(const T* p) {
  std::array<compute_t<T>, group> a;
  for (std::size_t l = 0; l < group; ++l) a[l] = load(p[l]);
  return a;
}

/// The compute type shared by the views Ts (their first's).
template <class... Ts>
using first_compute_t = compute_t<std::tuple_element_t<0, std::tuple<std::remove_cv_t<Ts>...>>>;

/// True when the element loops call `f` with `simd::pack` lvalues of one register
/// (`simd::native_lanes<C>` lanes; 32 bytes on the run-time AVX2 path): `f` opts in
/// (`simd::vectorizable_v`), every view has the same compute type C (float or double), and
/// `f` is invocable with one pack per view (after the tensor index when `Indexed`). Otherwise
/// the loops call `f` per element, as before. Both give the same bits: pack lanes run the
/// element's IEEE operations. The pack loops call a const local copy of `f` (so its constants
/// stay in registers): a vectorizable functor's call operator is const.
template <bool Indexed, class F, class... Ts>
inline constexpr bool use_packs = [] {
#if GRADAPT_SIMD_PACKS
  if constexpr (simd::vectorizable_v<F> && sizeof...(Ts) > 0) {
    using C = first_compute_t<Ts...>;
    if constexpr ((std::is_same_v<compute_t<Ts>, C> && ...)) {
      using P = simd::pack<C, simd::native_lanes<C>>;
      static_assert(group % P::size == 0, "a group must hold whole packs");
      if constexpr (Indexed)
        return std::is_invocable_v<const F&, tensor_index, std::conditional_t<true, P, Ts>&...>;
      else
        return std::is_invocable_v<const F&, std::conditional_t<true, P, Ts>&...>;
    }
  }
#endif
  return false;
}();

#if GRADAPT_SIMD_PACKS
/// [b, e) in packs P: loads every view's pack, calls f once, stores the non-const packs.
/// Returns where the scalar tail (< P::size elements) starts.
template <bool Indexed, class P, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t apply_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                             std::index_sequence<I...>, Ts*... p) {
  constexpr std::size_t W = P::size;
  const F fc = f;  // a local copy: its constants stay in registers across the stores
  std::size_t i = b;
  for (; i + W <= e; i += W) {
    P v[sizeof...(Ts)] = {simd::load_as<P>(p + i)...};
    if constexpr (Indexed)
      fc(t, v[I]...);
    else
      fc(v[I]...);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) simd::store(p + i, v[I]);
        }(),
        ...);
  }
  return i;
}

/// vacc[k][s] += r[k] for every k, unrolled at compile time.
template <std::size_t s, class WD, std::size_t K, std::size_t S, std::size_t... k>
GRADAPT_INLINE void add_terms(WD (&vacc)[K][S], const simd::vterms<K, WD>& r, std::index_sequence<k...>) {
  ((vacc[k][s] += r[k]), ...);
}

/// Pack s of a group at element o (s a compile-time index, so the accumulators stay in
/// registers): load, call, add the K values to vacc[k][s], store the non-const views.
template <bool Indexed, std::size_t s, class F, class P, class WD, std::size_t K, std::size_t S, class... Ts,
          std::size_t... I>
GRADAPT_INLINE void reduce_one_pack(const F& fc, tensor_index t, std::size_t o, WD (&vacc)[K][S],
                                    std::index_sequence<I...>, Ts*... p) {
  P v[sizeof...(Ts)] = {simd::load_as<P>(p + o)...};
  simd::vterms<K, WD> r;
  if constexpr (Indexed) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(fc(t, v[I]...))>, simd::vterms<K, WD>>,
                  "gradapt::host::apply_reduce_list: a vectorizable functor called on packs must return "
                  "gradapt::simd::terms_t<V, K> (simd::vterms<K, pack<double, W>>) with its scalar form's K");
    r = fc(t, v[I]...);
  } else {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(fc(v[I]...))>, simd::vterms<K, WD>>,
                  "gradapt::host::apply_reduce_list: a vectorizable functor called on packs must return "
                  "gradapt::simd::terms_t<V, K> (simd::vterms<K, pack<double, W>>) with its scalar form's K");
    r = fc(v[I]...);
  }
  add_terms<s>(vacc, r, std::make_index_sequence<K>{});
  (
      (void)[&] {
        if constexpr (!std::is_const_v<Ts>) simd::store(p + o, v[I]);
      }(),
      ...);
}

/// All `S` packs of the group at element i.
template <bool Indexed, class P, class F, class WD, std::size_t K, std::size_t S, std::size_t... s,
          std::size_t... I, class... Ts>
GRADAPT_INLINE void reduce_group_packs(const F& fc, tensor_index t, std::size_t i, WD (&vacc)[K][S],
                                       std::index_sequence<s...>, std::index_sequence<I...> seq, Ts*... p) {
  (reduce_one_pack<Indexed, s, F, P>(fc, t, i + s * P::size, vacc, seq, p...), ...);
}

/// Full groups of [b, e) of a fused apply + reduce through the pack form of f, `group / W`
/// packs P of W lanes per group. f returns `simd::vterms<K, pack<double, W>>`; lane w of pack
/// s of value k is added to acc[k][s * W + w], the lane the scalar loop uses for that element
/// of the group, in the same order. Returns where the scalar tail starts.
template <bool Indexed, std::size_t K, class P, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t apply_reduce_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                                    double (&acc)[K][lanes], std::index_sequence<I...>,
                                                    Ts*... p) {
  constexpr std::size_t W = P::size;
  constexpr std::size_t S = group / W;
  using WD = typename simd::wide_pack<P>::type;
  const F fc = f;  // a local copy: its constants stay in registers across the stores
  WD vacc[K][S];
  // Every access to vacc has a compile-time index (no loops over k or s), so the compiler
  // keeps the accumulators in registers instead of a stack slot that each group would load,
  // add to and store (a latency chain through store forwarding).
  [&]<std::size_t... j>(std::index_sequence<j...>) { ((vacc[j / S][j % S] = WD(0.0)), ...); }
  (std::make_index_sequence<K * S>{});
  std::size_t i = b;
  for (; i + group <= e; i += group)
    reduce_group_packs<Indexed, P>(fc, t, i, vacc, std::make_index_sequence<S>{}, std::index_sequence<I...>{},
                                   p...);
  [&]<std::size_t... j>(std::index_sequence<j...>) {
    (vacc[j / S][j % S].store(&acc[j / S][(j % S) * W]), ...);
  }
  (std::make_index_sequence<K * S>{});
  return i;
}

#if defined(GRADAPT_HOST_AVX2) && GRADAPT_SIMD_AVX_ASM
#define GRADAPT_HOST_PACKS_AVX2 1
/// The pack loops compiled for AVX2 (chosen at run time, like the reductions): 32-byte packs,
/// so one instruction handles 8 floats or 4 doubles. No FMA: every lane runs the same IEEE
/// operations as the SSE2 and scalar paths, so the bits are the same.
template <bool Indexed, class F, class... Ts, std::size_t... I>
__attribute__((target("avx2"))) std::size_t apply_pack_groups_avx2(F& f, tensor_index t, std::size_t b,
                                                                   std::size_t e,
                                                                   std::index_sequence<I...> seq, Ts*... p) {
  using C = first_compute_t<Ts...>;
  return apply_pack_groups<Indexed, simd::pack<C, 32 / sizeof(C), 32>>(f, t, b, e, seq, p...);
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
__attribute__((target("avx2"))) std::size_t apply_reduce_pack_groups_avx2(F& f, tensor_index t, std::size_t b,
                                                                          std::size_t e,
                                                                          double (&acc)[K][lanes],
                                                                          std::index_sequence<I...> seq,
                                                                          Ts*... p) {
  using C = first_compute_t<Ts...>;
  return apply_reduce_pack_groups<Indexed, K, simd::pack<C, 32 / sizeof(C), 32>>(f, t, b, e, acc, seq, p...);
}
#endif

/// The pack loop for [b, e): AVX2 when the CPU has it (GCC, x86-64), one 16-byte register
/// otherwise.
template <bool Indexed, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t run_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                           std::index_sequence<I...> seq, Ts*... p) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
  if (cpu_has_avx2()) return apply_pack_groups_avx2<Indexed>(f, t, b, e, seq, p...);
#endif
  using C = first_compute_t<Ts...>;
  return apply_pack_groups<Indexed, simd::pack<C, simd::native_lanes<C>>>(f, t, b, e, seq, p...);
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t run_reduce_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                                  double (&acc)[K][lanes], std::index_sequence<I...> seq,
                                                  Ts*... p) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
  if (cpu_has_avx2()) return apply_reduce_pack_groups_avx2<Indexed, K>(f, t, b, e, acc, seq, p...);
#endif
  using C = first_compute_t<Ts...>;
  return apply_reduce_pack_groups<Indexed, K, simd::pack<C, simd::native_lanes<C>>>(f, t, b, e, acc, seq,
                                                                                    p...);
}
#else
template <bool Indexed, class F, class... Ts, std::size_t... I>
std::size_t run_pack_groups(F&, tensor_index, std::size_t b, std::size_t, std::index_sequence<I...>, Ts*...) {
  return b;
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
std::size_t run_reduce_pack_groups(F&, tensor_index, std::size_t b, std::size_t, double (&)[K][lanes],
                                   std::index_sequence<I...>, Ts*...) {
  return b;
}
#endif

/// Calls f on loaded copies of elements [b, e) of every pointer and stores back the non-const
/// ones. `Indexed` passes the tensor index first.
template <bool Indexed, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE void apply_range(F& f, tensor_index t, std::size_t b, std::size_t e, std::index_sequence<I...>,
                                Ts*... p) {
  const auto call = [&](auto&... v) {
    if constexpr (Indexed)
      f(t, v...);
    else
      f(v...);
  };
  std::size_t i = b;
  if constexpr (use_packs<Indexed, F, Ts...>) {
    i = run_pack_groups<Indexed>(f, t, b, e, std::index_sequence<I...>{}, p...);
  } else {
    for (; i + group <= e; i += group) {
      std::tuple<std::array<compute_t<Ts>, group>...> v{load_group(p + i)...};
      for (std::size_t l = 0; l < group; ++l) call(std::get<I>(v)[l]...);
      (
          (void)[&] {
            if constexpr (!std::is_const_v<Ts>)
              for (std::size_t l = 0; l < group; ++l) store(p[i + l], std::get<I>(v)[l]);
          }(),
          ...);
    }
  }
  for (; i < e; ++i) {
    std::tuple<compute_t<Ts>...> v{load(p[i])...};
    call(std::get<I>(v)...);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) store(p[i], std::get<I>(v));
        }(),
        ...);
  }
}

template <class F, class... Ts>
void apply_one(F& f, tensor_index t, std::size_t n, [[maybe_unused]] int threads, Ts*... p) {
  constexpr bool indexed = std::is_invocable_v<F&, tensor_index, compute_t<Ts>&...>;
  static_assert(indexed || std::is_invocable_v<F&, compute_t<Ts>&...>,
                "gradapt::host::apply: the functor must be callable with one compute-type lvalue "
                "reference per view (float& for float/half/bfloat16, double& for double), "
                "optionally preceded by gradapt::tensor_index");
  const auto run = [&](std::size_t b, std::size_t e) {
    apply_range<indexed>(f, t, b, e, std::index_sequence_for<Ts...>{}, p...);
  };
#if defined(_OPENMP)
  if (threads > 1 && n >= 2 * apply_chunk) {
    const std::size_t nchunks = (n + apply_chunk - 1) / apply_chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::size_t c = 0; c < nchunks; ++c) run(c * apply_chunk, std::min(n, (c + 1) * apply_chunk));
    return;
  }
#endif
  run(0, n);
}

/// Element type (with const) of the views in a list.
template <class L>
using list_elem_t = std::remove_pointer_t<decltype(std::ranges::data(std::declval<const L&>())[0].data())>;

/// Result type and value count of an apply_reduce functor called on compute-type lvalues.
template <bool Indexed, class F, class... Ts>
struct reduce_result {
  using type = typename std::conditional_t<Indexed, std::invoke_result<F&, tensor_index, compute_t<Ts>&...>,
                                           std::invoke_result<F&, compute_t<Ts>&...>>::type;
  static constexpr std::size_t size = terms_size<std::remove_cvref_t<type>>::value;
};

/// Value k of one functor result (a scalar or terms<K>) as a double.
template <class R>
GRADAPT_INLINE double term_value(const R& r, [[maybe_unused]] std::size_t k) {
  if constexpr (std::is_arithmetic_v<R>)
    return static_cast<double>(r);
  else
    return r[k];
}

/// One block (at most `block` elements starting at b) of a fused apply + reduce: the functor
/// runs on groups of `group` (== lanes) elements; the value of element l of a group goes to
/// accumulator lane l, so lane assignment, the lane tree and therefore the partials equal
/// reduce_block's for the same terms. Writes K partials into part[0, K).
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE void apply_reduce_block(F& f, tensor_index t, std::size_t b, std::size_t e, double* part,
                                       std::index_sequence<I...>, Ts*... p) {
  static_assert(group == lanes, "apply_reduce maps group position to accumulator lane");
  const auto call = [&](auto&... v) {
    if constexpr (Indexed)
      return f(t, v...);
    else
      return f(v...);
  };
  double acc[K][lanes] = {};
  std::size_t i = b;
  if constexpr (use_packs<Indexed, F, Ts...>) {
    i = run_reduce_pack_groups<Indexed, K>(f, t, b, e, acc, std::index_sequence<I...>{}, p...);
  } else {
    for (; i + group <= e; i += group) {
      std::tuple<std::array<compute_t<Ts>, group>...> v{load_group(p + i)...};
      for (std::size_t l = 0; l < group; ++l) {
        const auto r = call(std::get<I>(v)[l]...);
        for (std::size_t k = 0; k < K; ++k) acc[k][l] += term_value(r, k);
      }
      (
          (void)[&] {
            if constexpr (!std::is_const_v<Ts>)
              for (std::size_t l = 0; l < group; ++l) store(p[i + l], std::get<I>(v)[l]);
          }(),
          ...);
    }
  }
  for (std::size_t l = 0; i < e; ++i, ++l) {
    std::tuple<compute_t<Ts>...> v{load(p[i])...};
    const auto r = call(std::get<I>(v)...);
    for (std::size_t k = 0; k < K; ++k) acc[k][l] += term_value(r, k);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) store(p[i], std::get<I>(v));
        }(),
        ...);
  }
  for (std::size_t k = 0; k < K; ++k) part[k] = combine_lanes<rk::sum>(acc[k]);
}

/// Fused apply + reduce over one tensor of n elements: block partials by rounds of
/// `round_blocks` (computed by up to `threads` threads), added in block order into out[0, K).
/// The result does not depend on the thread count.
template <std::size_t K, class F, class... Ts>
void apply_reduce_one(F& f, tensor_index t, std::size_t n, [[maybe_unused]] int threads, double* out,
                      Ts*... p) {
  constexpr bool indexed = std::is_invocable_v<F&, tensor_index, compute_t<Ts>&...>;
  const std::size_t nblocks = (n + block - 1) / block;
  for (std::size_t k = 0; k < K; ++k) out[k] = 0.0;
  double part[round_blocks][K];
  const auto blk = [&](std::size_t r0, std::size_t j) {
    const std::size_t b = (r0 + j) * block;
    apply_reduce_block<indexed, K>(f, t, b, std::min(n, b + block), part[j], std::index_sequence_for<Ts...>{},
                                   p...);
  };
  const auto add = [&](std::size_t rb) {
    for (std::size_t j = 0; j < rb; ++j)
      for (std::size_t k = 0; k < K; ++k) out[k] += part[j][k];
  };
#if defined(_OPENMP)
  if (threads > 1 && n >= parallel_min) {
    // Rounds of 2 * round_blocks blocks in two alternating buffers: one thread adds round r's
    // partials (single nowait) while the others compute round r + 1 into the other buffer, so
    // a round costs one barrier (the loop's) instead of two, and there are half as many
    // rounds. Round r + 2 reuses round r's buffer only after round r + 1's loop barrier, which
    // the adding thread reaches after its additions. Same partials, same order of additions.
    constexpr std::size_t R = 2 * round_blocks;
    double twin[2][R][K];
#pragma omp parallel num_threads(threads)
    {
      std::size_t buf = 0;
      for (std::size_t r0 = 0; r0 < nblocks; r0 += R, buf ^= 1) {
        const std::size_t rb = std::min(R, nblocks - r0);
#pragma omp for schedule(static)
        for (std::size_t j = 0; j < rb; ++j) {
          const std::size_t b = (r0 + j) * block;
          apply_reduce_block<indexed, K>(f, t, b, std::min(n, b + block), twin[buf][j],
                                         std::index_sequence_for<Ts...>{}, p...);
        }
#pragma omp single nowait
        for (std::size_t j = 0; j < rb; ++j)
          for (std::size_t k = 0; k < K; ++k) out[k] += twin[buf][j][k];
      }
    }
    return;
  }
#endif
  for (std::size_t r0 = 0; r0 < nblocks; r0 += round_blocks) {
    const std::size_t rb = std::min(round_blocks, nblocks - r0);
    for (std::size_t j = 0; j < rb; ++j) blk(r0, j);
    add(rb);
  }
}

}  // namespace detail::host_impl

/// Host backend: runs element functors and reductions over `tensor_view<T, host_space>`.
///
/// `threads` is the number of OpenMP threads (0: OpenMP's default, `omp_get_max_threads()`;
/// without OpenMP every operation runs on the calling thread). Nothing is allocated.
///
/// Determinism: reductions use a fixed blocking (4096-element blocks, 8 double accumulators
/// per block, blocks added in order, tensors added in order), independent of `threads`.
struct host {
  /// Views this backend accepts: ordinary host memory.
  using space = host_space;

  /// OpenMP threads per operation: 0 (default) for OpenMP's default, else a positive count.
  /// A negative count makes the operations throw gradapt::error (`thread_count()` checks it);
  /// without OpenMP a valid count is ignored. Results do not depend on it.
  int threads = 0;

  /// Threads actually used.
  int thread_count() const {
    detail::require(threads >= 0, "host backend: threads is ", threads,
                    " (expected 0 for OpenMP's default, or a positive count)");
#if defined(_OPENMP)
    return threads == 0 ? omp_get_max_threads() : threads;
#else
    return 1;
#endif
  }
  /// A copy of this backend that runs every operation on one thread (for work inside a task
  /// of `run_tasks`).
  host single_thread() const {
    host h = *this;
    h.threads = 1;
    return h;
  }

  /// Element-wise `f` over views of equal size: for each i, loads element i of every view into
  /// its compute type, calls `f(v0, v1, ...)` with lvalue references, and stores the values of
  /// non-const views back (16-bit types round to nearest even). Views may alias only if they
  /// are the same view passed once.
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply needs at least one view");
    const std::size_t n = check_sizes(views...);
    detail::host_impl::apply_one(f, tensor_index{0}, n, thread_count(), views.data()...);
  }

  /// Element-wise `f` over lists of tensors: tensor t of every list must have the same size.
  /// When `f` is callable as `f(gradapt::tensor_index{t}, v0, v1, ...)` it gets the index.
  template <class F, class... Ls>
  requires(view_list<Ls, host_space>&&...) void apply_list(F f, const Ls&... lists) const {
    static_assert(sizeof...(Ls) > 0, "gradapt::host::apply_list needs at least one list");
    const std::size_t count = check_list_lengths(lists...);
    const int nt = thread_count();
    // All sizes are checked before any element is touched (and before a parallel region,
    // where an exception could not propagate).
    std::size_t chunks = 0;
    for (std::size_t t = 0; t < count; ++t)
      chunks += (check_list_sizes(t, lists...) + detail::host_impl::apply_chunk - 1) /
                detail::host_impl::apply_chunk;
#if defined(_OPENMP)
    // One parallel region for the whole list: the chunks of all tensors, numbered in tensor
    // order, are split into one contiguous range per thread. No barrier between tensors, and
    // small tensors are spread over the threads too. Element-wise work: the split does not
    // change any result.
    if (nt > 1 && chunks > 1) {
#pragma omp parallel num_threads(nt)
      {
        const auto T = static_cast<std::size_t>(omp_get_num_threads());
        const auto me = static_cast<std::size_t>(omp_get_thread_num());
        const std::size_t lo = chunks * me / T, hi = chunks * (me + 1) / T;
        std::size_t first = 0;  // global number of tensor t's first chunk
        for (std::size_t t = 0; t < count && first < hi; ++t) {
          const std::size_t n = std::ranges::data(first_list(lists...))[t].size();
          constexpr std::size_t C = detail::host_impl::apply_chunk;
          const std::size_t nc = (n + C - 1) / C;
          for (std::size_t c = std::max(lo, first); c < std::min(hi, first + nc); ++c)
            detail::host_impl::apply_one(f, tensor_index{t},
                                         std::min(n, (c - first + 1) * C) - (c - first) * C, 1,
                                         (std::ranges::data(lists)[t].data() + (c - first) * C)...);
          first += nc;
        }
      }
      return;
    }
#endif
    for (std::size_t t = 0; t < count; ++t)
      detail::host_impl::apply_one(f, tensor_index{t}, std::ranges::data(first_list(lists...))[t].size(), nt,
                                   std::ranges::data(lists)[t].data()...);
  }

  /// Fused element-wise apply and per-tensor sum: like `apply_list`, but `f` also returns a
  /// value per element (a `double`, or `gradapt::terms<K>` for K values) that is summed per
  /// tensor in double. Writes per-tensor sums into `per_tensor` (empty, or count * K slots;
  /// tensor t's value k at t * K + k) and returns their sum in tensor order (a `double`, or
  /// `terms<K>`).
  ///
  /// One pass over memory: the update and the statistics it needs (a gradient norm for the
  /// noise scale, a trust-ratio norm, a non-finite count) cost no extra read. The summation
  /// order is `reduce`'s (4096-element blocks, 8 lanes, fixed tree, blocks then tensors in
  /// order), so a functor returning `double(x) * double(x)` gives `reduce(sum_squares)`'s bits
  /// for any thread count. Each value is taken from the functor's return, before the element's
  /// stores.
  template <class F, class... Ls>
  requires(view_list<Ls, host_space>&&...) auto apply_reduce_list(F f, std::span<double> per_tensor,
                                                                  const Ls&... lists) const {
    static_assert(sizeof...(Ls) > 0, "gradapt::host::apply_reduce_list needs at least one list");
    using R = typename detail::host_impl::reduce_result<
        std::is_invocable_v<F&, tensor_index, compute_t<detail::host_impl::list_elem_t<Ls>>&...>, F,
        detail::host_impl::list_elem_t<Ls>...>::type;
    static_assert(std::is_arithmetic_v<std::remove_cvref_t<R>> ||
                      terms_size<std::remove_cvref_t<R>>::value > 1 ||
                      std::is_same_v<std::remove_cvref_t<R>, terms<1>>,
                  "gradapt::host::apply_reduce_list: the functor must return a double (or another "
                  "arithmetic type) or gradapt::terms<K>");
    constexpr std::size_t K = terms_size<std::remove_cvref_t<R>>::value;
    const std::size_t count = check_list_lengths(lists...);
    detail::require(per_tensor.empty() || per_tensor.size() == count * K,
                    "host backend apply_reduce_list: per_tensor has ", per_tensor.size(), " slots for ",
                    count, " tensors x ", K, " values (expected ", count * K,
                    ", or empty for the total only)");
    const int nt = thread_count();
    terms<K> total{};
    double one[K];
    for (std::size_t t = 0; t < count; ++t) {
      const std::size_t n = check_list_sizes(t, lists...);
      double* out = per_tensor.empty() ? one : per_tensor.data() + t * K;
      detail::host_impl::apply_reduce_one<K>(f, tensor_index{t}, n, nt, out,
                                             std::ranges::data(lists)[t].data()...);
      for (std::size_t k = 0; k < K; ++k) total[k] += out[k];
    }
    if constexpr (std::is_arithmetic_v<std::remove_cvref_t<R>>)
      return total[0];
    else
      return total;
  }

  /// `apply_reduce_list` over single views of equal size.
  template <class F, class... Ts>
  auto apply_reduce(F f, tensor_view<Ts, host_space>... views) const {
    return apply_reduce_list(f, std::span<double>{},
                             std::span<const tensor_view<Ts, host_space>>(&views, 1)...);
  }

  /// Reduction of one tensor, accumulated in double.
  template <class T>
  double reduce(reduction op, tensor_view<T, host_space> x) const {
    const std::span<const tensor_view<T, host_space>> one(&x, 1);
    return reduce(op, one, std::span<double>{});
  }

  /// Per-tensor reductions (into `per_tensor`, which must be empty or have one slot per
  /// tensor) and the global result: the per-tensor results combined in tensor order.
  template <class L>
  requires view_list<L, host_space>
  double reduce(reduction op, const L& xs, std::span<double> per_tensor) const {
    check_out(xs, per_tensor, "reduce");
    using namespace detail::host_impl;
    const int nt = thread_count();
    const auto no_y = [](std::size_t) { return static_cast<const float*>(nullptr); };
    switch (op) {
      case reduction::sum:
        return reduce_list<rk::sum>(xs, no_y, per_tensor, nt);
      case reduction::sum_squares:
        return reduce_list<rk::sum_squares>(xs, no_y, per_tensor, nt);
      case reduction::max_abs:
        return reduce_list<rk::max_abs>(xs, no_y, per_tensor, nt);
      case reduction::count_nonfinite:
        return reduce_list<rk::nonfinite>(xs, no_y, per_tensor, nt);
    }
    detail::fail("host backend: unknown reduction");
  }

  /// Dot product of two equal-size tensors, accumulated in double.
  template <class T, class U>
  double dot(tensor_view<T, host_space> x, tensor_view<U, host_space> y) const {
    const std::span<const tensor_view<T, host_space>> xs(&x, 1);
    const std::span<const tensor_view<U, host_space>> ys(&y, 1);
    return dot(xs, ys, std::span<double>{});
  }

  /// Per-tensor dot products and their sum in tensor order.
  template <class L1, class L2>
  requires view_list<L1, host_space> && view_list<L2, host_space>
  double dot(const L1& xs, const L2& ys, std::span<double> per_tensor) const {
    const std::size_t count = check_list_lengths(xs, ys);
    for (std::size_t t = 0; t < count; ++t) check_list_sizes(t, xs, ys);
    check_out(xs, per_tensor, "dot");
    const auto* yp = std::ranges::data(ys);
    return detail::host_impl::reduce_list<detail::host_impl::rk::dot>(
        xs, [yp](std::size_t t) { return yp[t].data(); }, per_tensor, thread_count());
  }

  /// Host work is synchronous: nothing to wait for.
  void synchronize() const {}

  /// Owning, zero-initialised memory for `n` elements of T that this backend's operations
  /// read and write (an algorithm's state between steps, e.g. optimizer moments). Allocate
  /// at set-up: a step path never calls it. `data()` and `size()` give the view's parts.
  template <element T>
  std::vector<T> allocate(std::size_t n) const {
    return std::vector<T>(n);
  }

  /// Copies `src` into `dst` (equal sizes). Here both are host memory; the CUDA backend's
  /// overloads copy between device and host memory, so state save/restore is written once.
  /// @throws gradapt::error if the sizes differ
  template <class T>
  void copy(tensor_view<const T, host_space> src, tensor_view<T, host_space> dst) const {
    detail::require(src.size() == dst.size(), "host backend copy: source has ", src.size(),
                    " elements but destination has ", dst.size(), " (expected equal sizes)");
    if (src.size() != 0) std::memcpy(static_cast<void*>(dst.data()), src.data(), src.bytes());
  }

  /// Row and column reductions of a tensor seen as the row-major shape d = [A, X, B, Y, C]
  /// (A·X·B·Y·C == x.size()): the factored statistics of Adafactor (Shazeer & Stern 2018) and
  /// the covers of SM3 (Anil et al. 2019). With t = f(r, c, x[a, i, b, j, c']) where r and c
  /// are the element's entries of the optional `row` and `col` vectors (indexed as over_y and
  /// over_x below; 1 where a vector is empty), in their compute types, and f returns a value
  /// that is widened to double (a compute-type value, or a double):
  ///
  ///     over_y[((a·X + i)·B + b)·C + c'] = ⊕_j t     (A·X·B·C values; reduce over axis Y)
  ///     over_x[((a·B + b)·Y + j)·C + c'] = ⊕_i t     (A·B·Y·C values; reduce over axis X)
  ///
  /// ⊕ is `op`: a sum (in double) or a max (NaN if any term is NaN; -inf for no terms). A 2-D
  /// [n, m] tensor is d = [1, n, 1, m, 1]: over_y holds the n row results, over_x the m column
  /// results. Either output may be empty (not computed). Fixed order, independent of
  /// `threads`: over_y with C == 1 adds term j into lane j mod 8 and combines the 8 lanes as a
  /// fixed tree, with C > 1 adds j in ascending order. over_x: when both outputs are wanted,
  /// C == 1 and Y <= `group_line_max` (4096), the lines of a slice form groups of
  /// G = max(16, 65536 / Y) consecutive i; a group's terms are added in ascending i and the
  /// group results in group order (each line is read once, by one thread; `bench_factored`'s
  /// stats_pass row times it against a plain read of the same bytes); otherwise
  /// i is added in ascending order, and on several threads lines are processed in blocks of
  /// about 256 KiB so that the column reduction re-reads them from cache. A sum through a
  /// functor with `vectorizable = true` over float data (C == 1) is computed on `simd::pack`s
  /// of 8 (f returns the float pack, widened), with the same bits. Nothing is allocated (the
  /// grouped path keeps a 32 KiB partial per thread on the stack).
  /// @throws gradapt::error if d does not describe x or a vector has the wrong size
  template <class F, class RY, class RX, class T>
  void reduce_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                       tensor_view<RX, host_space> col, tensor_view<T, host_space> x,
                       tensor_view<double, host_space> over_y, tensor_view<double, host_space> over_x,
                       reduce_op op = reduce_op::sum) const {
    const auto dd = check_factored(d, x.size(), "reduce_factored");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C;
    detail::require(row.empty() || row.size() == ny, "host backend reduce_factored: row vector has ",
                    row.size(), " elements (expected A*X*B*C = ", ny, ", or 0)");
    detail::require(col.empty() || col.size() == nx, "host backend reduce_factored: column vector has ",
                    col.size(), " elements (expected A*B*Y*C = ", nx, ", or 0)");
    detail::require(over_y.empty() || over_y.size() == ny, "host backend reduce_factored: over_y has ",
                    over_y.size(), " elements (expected A*X*B*C = ", ny, ", or 0)");
    detail::require(over_x.empty() || over_x.size() == nx, "host backend reduce_factored: over_x has ",
                    over_x.size(), " elements (expected A*B*Y*C = ", nx, ", or 0)");
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    if (op == reduce_op::max)
      reduce_factored_impl<true>(f, rp, cp, x.data(), A, X, B, Y, C, over_y.data(), over_y.empty(),
                                 over_x.data(), over_x.empty());
    else
      reduce_factored_impl<false>(f, rp, cp, x.data(), A, X, B, Y, C, over_y.data(), over_y.empty(),
                                  over_x.data(), over_x.empty());
  }

  /// `reduce_factored` (sums) that also returns Σ_k y_k² of a second view `y` of x's size,
  /// read in the same pass as x (each line of y right after the same line of x; Adafactor's
  /// parameter scale rides in its statistics pass). Each element is widened to double, then
  /// squared; line l = (a·X + i)·B + b of Y·C elements is summed in 8 lanes (element k into lane
  /// k mod 8, fixed tree) into line_sums[l], and the A·X·B line sums are added in line order,
  /// so the result is independent of `threads`. Both outputs are required. Nothing is allocated.
  /// @throws gradapt::error on a size mismatch (names the view and the expected size)
  template <class F, class RY, class RX, class T, class U>
  double reduce_factored_sumsq(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                               tensor_view<RX, host_space> col, tensor_view<T, host_space> x,
                               tensor_view<double, host_space> over_y, tensor_view<double, host_space> over_x,
                               tensor_view<U, host_space> y,
                               tensor_view<double, host_space> line_sums) const {
    const auto dd = check_factored(d, x.size(), "reduce_factored_sumsq");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C, lines = A * X * B;
    detail::require(row.empty() || row.size() == ny, "host backend reduce_factored_sumsq: row vector has ",
                    row.size(), " elements (expected A*X*B*C = ", ny, ", or 0)");
    detail::require(col.empty() || col.size() == nx, "host backend reduce_factored_sumsq: column vector has ",
                    col.size(), " elements (expected A*B*Y*C = ", nx, ", or 0)");
    detail::require(over_y.size() == ny, "host backend reduce_factored_sumsq: over_y has ", over_y.size(),
                    " elements (expected A*X*B*C = ", ny, ")");
    detail::require(over_x.size() == nx, "host backend reduce_factored_sumsq: over_x has ", over_x.size(),
                    " elements (expected A*B*Y*C = ", nx, ")");
    detail::require(y.size() == x.size(), "host backend reduce_factored_sumsq: y has ", y.size(),
                    " elements but x has ", x.size(), " (expected equal sizes)");
    detail::require(line_sums.size() >= lines, "host backend reduce_factored_sumsq: line_sums has ",
                    line_sums.size(), " elements (expected at least A*X*B = ", lines, ")");
    if (x.size() == 0) {
      reduce_factored(f, d, row, col, x, over_y, over_x);
      return 0.0;
    }
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    reduce_factored_impl<false>(f, rp, cp, x.data(), A, X, B, Y, C, over_y.data(), false, over_x.data(),
                                false, y.data(), line_sums.data());
    double total = 0.0;
    for (std::size_t l = 0; l < lines; ++l) total += line_sums.data()[l];
    return total;
  }

  /// Element-wise `f` over views of equal size seen as d = [A, X, B, Y, C] (see
  /// `reduce_factored`), with one entry of a row vector and one of a column vector per
  /// element: `f(r, c, v0, v1, ...)` where r = row[((a·X + i)·B + b)·C + c] and
  /// c = col[((a·B + b)·Y + j)·C + c] in their compute types (1 where that vector is empty),
  /// and v0, v1, ... are lvalues of the elements (non-const views are stored back). Adafactor's
  /// update: u = g · r_i · c_j.
  ///
  /// When `f` returns a value it is summed in double and returned: per line of Y·C elements
  /// in 8 lanes (element k into lane k mod 8, fixed tree), lines added in order; independent of
  /// `threads`. A functor with `vectorizable = true` is called with `simd::pack` lvalues when
  /// C == 1 and every view and vector holds float (same bits as the scalar calls).
  /// @throws gradapt::error on a size mismatch
  template <class F, class RY, class RX, class... Ts>
  double apply_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                        tensor_view<RX, host_space> col, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply_factored needs at least one view");
    const std::size_t n = check_sizes(views...);
    const auto dd = check_factored(d, n, "apply_factored");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    detail::require(row.empty() || row.size() == A * X * B * C,
                    "host backend apply_factored: row vector has ", row.size(),
                    " elements (expected A*X*B*C = ", A * X * B * C, ", or 0)");
    detail::require(col.empty() || col.size() == A * B * Y * C,
                    "host backend apply_factored: column vector has ", col.size(),
                    " elements (expected A*B*Y*C = ", A * B * Y * C, ", or 0)");
    if (n == 0) return 0.0;
    const std::size_t L = Y * C, lines = A * X * B;
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    using R = decltype(f(compute_t<RY>(1), compute_t<RX>(1), std::declval<compute_t<Ts>&>()...));
    constexpr bool reduces = !std::is_void_v<R>;
    const auto line = [&](std::size_t l) -> double {
      const std::size_t a = l / (X * B), b = l % B;
      const std::size_t cbase = (a * B + b) * L;
      return factored_line<reduces>(f, l * L, L, C, rp, rp ? l * C : 0, cp, cbase, views.data()...);
    };
    const int nt = thread_count();
    const bool par = nt > 1 && lines > 1 && n >= 2 * detail::host_impl::apply_chunk;
    if constexpr (!reduces) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(nt) if (par)
#endif
      for (std::size_t l = 0; l < lines; ++l) line(l);
      (void)par;
      return 0.0;
    } else {
      // Line sums of a round on the stack (32 KiB), added in line order after the round.
      constexpr std::size_t R0 = 4096;
      double part[R0];
      double total = 0.0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) if (par)
#endif
      for (std::size_t l0 = 0; l0 < lines; l0 += R0) {
        const std::size_t rb = std::min(R0, lines - l0);
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (std::size_t j = 0; j < rb; ++j) part[j] = line(l0 + j);
#if defined(_OPENMP)
#pragma omp single
#endif
        for (std::size_t j = 0; j < rb; ++j) total += part[j];
      }
      (void)par;
      return total;
    }
  }

  /// `apply_factored` with a value-returning `f` whose sum is stored in `sum[0]` instead of
  /// returned (the same bits). The form the optimizers call on every backend: on a device the
  /// sum stays in device memory for a later kernel, so the step never waits for the host.
  /// @throws gradapt::error on a size mismatch or when `sum` is empty
  template <class F, class RY, class RX, class... Ts>
  void apply_factored_sum(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                          tensor_view<RX, host_space> col, tensor_view<double, host_space> sum,
                          tensor_view<Ts, host_space>... views) const {
    detail::require(sum.size() >= 1,
                    "host backend apply_factored_sum: the sum view is empty (expected 1 element)");
    sum.data()[0] = apply_factored(f, d, row, col, views...);
  }

  /// Element-wise `f(r, c, v0, v1, ...)` as in `apply_factored`, where f also returns a term
  /// t (a value of a compute type) whose per-row and per-column maxima are kept in the same
  /// pass. `f.term(r, c, v0, v1, ...)` must return the same t without writing anything and
  /// from only the views f does not write (it is called again on a line that holds a NaN
  /// term, after f ran): over_y[((a·X + i)·B + b)·C + c'] = max_j t and over_x[((a·B + b)·Y + j)·C + c'] =
  /// max_i t (the indexing of `reduce_factored`), NaN when any of the terms is NaN, -inf for
  /// none. The maxima do not depend on the order the terms are taken in, so this gives
  /// `reduce_factored(term, ..., reduce_op::max)` followed by `apply_factored(f, ...)` in one
  /// read of the views (SM3's covers and update). Runs on the calling thread (the per-column
  /// maxima would need a copy per thread): a per-tensor task's operation. A functor with
  /// `vectorizable = true` over float data (C == 1) runs on `simd::pack`s of 8 (AVX2 when the
  /// CPU has it), with the same results as the scalar calls. Nothing is allocated.
  /// @throws gradapt::error on a size mismatch
  template <class F, class RY, class RX, class M, class... Ts>
  void apply_factored_max(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                          tensor_view<RX, host_space> col, tensor_view<M, host_space> over_y,
                          tensor_view<M, host_space> over_x, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply_factored_max needs at least one view");
    static_assert(std::is_floating_point_v<M>,
                  "gradapt::host::apply_factored_max: maxima are float or double");
    const std::size_t n = check_sizes(views...);
    const auto dd = check_factored(d, n, "apply_factored_max");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C;
    detail::require(row.empty() || row.size() == ny, "host backend apply_factored_max: row vector has ",
                    row.size(), " elements (expected A*X*B*C = ", ny, ", or 0)");
    detail::require(col.empty() || col.size() == nx, "host backend apply_factored_max: column vector has ",
                    col.size(), " elements (expected A*B*Y*C = ", nx, ", or 0)");
    detail::require(over_y.size() == ny && over_x.size() == nx,
                    "host backend apply_factored_max: over_y has ", over_y.size(), " and over_x ",
                    over_x.size(), " elements (expected A*X*B*C = ", ny, " and A*B*Y*C = ", nx, ")");
    M* oy = over_y.data();
    M* ox = over_x.data();
    std::fill(oy, oy + ny, -std::numeric_limits<M>::infinity());
    std::fill(ox, ox + nx, -std::numeric_limits<M>::infinity());
    const std::size_t L = Y * C, lines = A * X * B;
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    for (std::size_t l = 0; l < lines; ++l) {
      const std::size_t a = l / (X * B), b = l % B;
      const std::size_t cbase = (a * B + b) * L;
      max_line(f, l * L, L, C, rp, l * C, cp, cbase, oy + l * C, ox + cbase, views.data()...);
    }
  }

  /// Runs `fn(task, slot)` for every task in [0, n) on min(max_threads, thread_count())
  /// threads, handing tasks out one at a time in ascending order (OpenMP dynamic schedule); slot
  /// is the running thread's number (below that count), for per-thread workspace. The tasks
  /// must be independent. One parallel region, no barrier but its end: the factored optimizers
  /// run whole tensors as tasks (on a copy of the backend with threads = 1), which stays fast
  /// when other processes share the cores. The first exception a task throws is rethrown after
  /// all tasks ran. Nothing is allocated (unless a task throws).
  template <class F>
  void run_tasks(std::size_t n, std::size_t max_threads, const F& fn) const {
    const std::size_t nt = std::min(max_threads, static_cast<std::size_t>(thread_count()));
#if defined(_OPENMP)
    if (nt > 1 && n > 1) {
      std::exception_ptr err;
      const int nti = static_cast<int>(nt);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nti)
      for (std::size_t q = 0; q < n; ++q) {
        try {
          fn(q, static_cast<std::size_t>(omp_get_thread_num()));
        } catch (...) {
#pragma omp critical(gradapt_host_run_tasks)
          if (!err) err = std::current_exception();
        }
      }
      if (err) std::rethrow_exception(err);
      return;
    }
#endif
    (void)nt;
    for (std::size_t q = 0; q < n; ++q) fn(q, 0);
  }

 private:
  static std::array<std::size_t, 5> check_factored(const std::array<std::int64_t, 5>& d, std::size_t n,
                                                   const char* what) {
    std::size_t prod = 1;
    for (std::size_t k = 0; k < 5; ++k) {
      detail::require(d[k] >= 0, "host backend ", what, ": factored dim ", k, " is ", d[k],
                      " (expected non-negative [A, X, B, Y, C])");
      prod *= static_cast<std::size_t>(d[k]);
    }
    detail::require(prod == n, "host backend ", what, ": factored dims [", d[0], ", ", d[1], ", ", d[2], ", ",
                    d[3], ", ", d[4], "] hold ", prod, " elements but the tensor has ", n);
    return {static_cast<std::size_t>(d[0]), static_cast<std::size_t>(d[1]), static_cast<std::size_t>(d[2]),
            static_cast<std::size_t>(d[3]), static_cast<std::size_t>(d[4])};
  }

  /// Longest line (Y with C == 1) that reduce_factored reads once on any number of threads
  /// (a per-thread partial of this many doubles lives on the stack: 32 KiB).
  static constexpr std::size_t group_line_max = 4096;
  /// Lines per group of that path: about 256 KiB of float data, at least 16 lines. Depends
  /// only on the line length, so the results do not depend on the thread count.
  static constexpr std::size_t group_lines(std::size_t L) {
    return std::max<std::size_t>(16, (std::size_t{1} << 16) / std::max<std::size_t>(L, 1));
  }

  template <bool Max>
  static GRADAPT_INLINE double fold(double a, double t) {
    if constexpr (Max)
      return (a != a || t != t) ? std::numeric_limits<double>::quiet_NaN() : (a < t ? t : a);
    else
      return a + t;
  }

  template <bool Max, class F, class RY, class RX, class T, class U = const float>
  void reduce_factored_impl(const F& f, const RY* rp, const RX* cp, const T* x, std::size_t A, std::size_t X,
                            std::size_t B, std::size_t Y, std::size_t C, double* oy, bool skip_y, double* ox,
                            bool skip_x, U* ys = nullptr, double* ls = nullptr) const {
    const auto run = [&]<bool HasR, bool HasC>() {
      reduce_factored_loops<Max, HasR, HasC>(f, rp, cp, x, A, X, B, Y, C, oy, skip_y, ox, skip_x, ys, ls);
    };
    if (rp && cp)
      run.template operator()<true, true>();
    else if (rp)
      run.template operator()<true, false>();
    else if (cp)
      run.template operator()<false, true>();
    else
      run.template operator()<false, false>();
  }

  /// reduce_factored's loops with the presence of the row and column vectors fixed at compile
  /// time (no per-element branches or index divisions).
  /// With `ys` (and !skip_y), ls[l] = line_sumsq of line l of ys, read next to line l of x.
  template <bool Max, bool HasR, bool HasC, class F, class RY, class RX, class T, class U>
  void reduce_factored_loops(const F& f, const RY* rp, const RX* cp, const T* x, std::size_t A, std::size_t X,
                             std::size_t B, std::size_t Y, std::size_t C, double* oy, bool skip_y, double* ox,
                             bool skip_x, U* ys, double* ls) const {
    const std::size_t L = Y * C, lines = A * X * B, n = lines * L;
    const double init = Max ? -std::numeric_limits<double>::infinity() : 0.0;
    if (!skip_y)
      for (std::size_t k = 0; k < lines * C; ++k) oy[k] = init;
    if (!skip_x)
      for (std::size_t k = 0; k < A * B * L; ++k) ox[k] = init;
    if (n == 0 || (skip_x && skip_y)) return;
    const int nt = thread_count();
    const bool par = nt > 1 && n >= 2 * detail::host_impl::apply_chunk;
    (void)par;
    using CY = compute_t<RY>;
    using CX = compute_t<RX>;
    const auto rv = [&](std::size_t i) { return HasR ? load(rp[i]) : CY(1); };
    const auto cv = [&](const RX* c, std::size_t k) {
      if constexpr (HasC)
        return load(c[k]);
      else
        return CX(1);
    };
    // Lines are processed in blocks of about 256 KiB so that the column reduction re-reads them
    // from cache.
    const std::size_t per_block =
        std::max<std::size_t>(1, (std::size_t{1} << 16) / std::max<std::size_t>(L, 1));
    constexpr std::size_t chunk = 512;  // columns per task of the column reduction
    const std::size_t col_tasks = (L + chunk - 1) / chunk;
#if GRADAPT_SIMD_PACKS
    // Sums of float data through a vectorizable f: 8 lanes per call (f returns a float pack,
    // widened), the same terms in the same order as the scalar loops.
    using narrow = simd::pack<float, 8>;
    constexpr bool packs =
        !Max && simd::vectorizable_v<F> && std::is_same_v<std::remove_cv_t<T>, float> &&
        (!HasR || std::is_same_v<std::remove_cv_t<RY>, float>)&&(
            !HasC || std::is_same_v<std::remove_cv_t<RX>, float>)&&std::is_invocable_v<const F&, narrow,
                                                                                       narrow, narrow>;
#endif
    // Line l of slice `cb`'s column vector: its row result into oy[l] (and Σ y² into ls[l]), its
    // column terms folded into o[0, Y) (C == 1, both outputs).
    const auto both_line = [&](std::size_t l, const RX* cb, double* o) {
      const T* p = x + l * L;
      const CY r = rv(l);
      double acc[8] = {init, init, init, init, init, init, init, init};
      double yacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::size_t j = 0, yk = 0;
#if GRADAPT_SIMD_PACKS
      if constexpr (packs)
        j = fact_lines_y<fact_kind::both, HasC>(f, static_cast<float>(r), cb, p, Y, o, acc,
                                                ys ? ys + l * L : ys, yacc, &yk);
#endif
      for (; j + 8 <= Y; j += 8)
        for (std::size_t q = 0; q < 8; ++q) {
          const double t = static_cast<double>(f(r, cv(cb, j + q), load(p[j + q])));
          acc[q] = fold<Max>(acc[q], t);
          o[j + q] = fold<Max>(o[j + q], t);
        }
      for (std::size_t q = 0; j < Y; ++j, ++q) {
        const double t = static_cast<double>(f(r, cv(cb, j), load(p[j])));
        acc[q] = fold<Max>(acc[q], t);
        o[j] = fold<Max>(o[j], t);
      }
      for (std::size_t w = 4; w >= 1; w /= 2)
        for (std::size_t q = 0; q < w; ++q) acc[q] = fold<Max>(acc[2 * q], acc[2 * q + 1]);
      oy[l] = acc[0];
      if (ys) ls[l] = line_sumsq(ys + l * L, L, yk, yacc);
    };
    // Both outputs of a matrix-like view with lines of at most group_line_max elements, on any
    // number of threads: one read of each line feeds its row lanes and the column results. The
    // lines of a slice (a, b) form groups of G lines (G depends only on L); a group's column
    // terms are folded in ascending i into a per-thread partial, and the partials are folded
    // into the outputs in group order (an ordered loop). So the result does not depend on the
    // thread count, and no line is read twice or by two threads.
    if (C == 1 && !skip_y && !skip_x && L <= group_line_max) {
      const std::size_t G = group_lines(L), per_slice = (X + G - 1) / G, tasks = A * B * per_slice;
      // Group q (of slice q / per_slice) into part[0, L), then part into the outputs.
      const auto group = [&](std::size_t q, double* part) {
        const std::size_t sl = q / per_slice, i0 = (q % per_slice) * G, i1 = std::min(X, i0 + G);
        for (std::size_t k = 0; k < L; ++k) part[k] = init;
        for (std::size_t i = i0; i < i1; ++i)
          both_line((sl / B * X + i) * B + sl % B, HasC ? cp + sl * L : nullptr, part);
      };
      const auto add = [&](std::size_t q, const double* part) {
        double* o = ox + (q / per_slice) * L;
        for (std::size_t k = 0; k < L; ++k) o[k] = fold<Max>(o[k], part[k]);
      };
#if defined(_OPENMP)
      if (par) {
#pragma omp parallel num_threads(nt)
        {
          double part[group_line_max];
#pragma omp for ordered schedule(static, 1)
          for (std::size_t q = 0; q < tasks; ++q) {
            group(q, part);
#pragma omp ordered
            add(q, part);
          }
        }
        return;
      }
#endif
      double part[group_line_max];
      for (std::size_t q = 0; q < tasks; ++q) {
        group(q, part);
        add(q, part);
      }
      return;
    }
    // Longer lines, one thread, both outputs: one read of each line feeds its row lanes and the
    // column sums (the same terms, in the same order, as the two loops below).
    if (!par && C == 1 && !skip_y && !skip_x) {
      for (std::size_t sl = 0; sl < A * B; ++sl)
        for (std::size_t i = 0; i < X; ++i)
          both_line((sl / B * X + i) * B + sl % B, HasC ? cp + sl * L : nullptr, ox + sl * L);
      return;
    }
    // One parallel region, no barrier inside: rows are independent, and the column loop has
    // the same trip count in every block, so with schedule(static) each column chunk stays
    // with one thread, which adds the blocks in order.
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) if (par)
#endif
    for (std::size_t a = 0; a < A; ++a)
      for (std::size_t b = 0; b < B; ++b) {
        const RX* cb = HasC ? cp + (a * B + b) * L : nullptr;
        for (std::size_t i0 = 0; i0 < X; i0 += per_block) {
          const std::size_t i1 = std::min(X, i0 + per_block);
          {
            if (!skip_y) {
#if defined(_OPENMP)
#pragma omp for schedule(static) nowait
#endif
              for (std::size_t i = i0; i < i1; ++i) {
                const std::size_t l = (a * X + i) * B + b;
                const T* p = x + l * L;
                double yacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                std::size_t yk = 0;
                if (C == 1) {
                  const CY r = rv(l);
                  double acc[8] = {init, init, init, init, init, init, init, init};
                  std::size_t j = 0;
#if GRADAPT_SIMD_PACKS
                  // lane q of the double pack is acc[q]: the same terms in the same order
                  if constexpr (packs)
                    j = fact_lines_y<fact_kind::rows, HasC>(f, static_cast<float>(r), cb, p, Y, nullptr, acc,
                                                            ys ? ys + l * L : ys, yacc, &yk);
#endif
                  for (; j + 8 <= Y; j += 8)
                    for (std::size_t q = 0; q < 8; ++q)
                      acc[q] = fold<Max>(acc[q], static_cast<double>(f(r, cv(cb, j + q), load(p[j + q]))));
                  for (std::size_t q = 0; j < Y; ++j, ++q)
                    acc[q] = fold<Max>(acc[q], static_cast<double>(f(r, cv(cb, j), load(p[j]))));
                  for (std::size_t w = 4; w >= 1; w /= 2)
                    for (std::size_t q = 0; q < w; ++q) acc[q] = fold<Max>(acc[2 * q], acc[2 * q + 1]);
                  oy[l] = acc[0];
                } else {
                  double* o = oy + l * C;
                  for (std::size_t j = 0; j < Y; ++j)
                    for (std::size_t c = 0; c < C; ++c)
                      o[c] = fold<Max>(
                          o[c], static_cast<double>(f(rv(l * C + c), cv(cb, j * C + c), load(p[j * C + c]))));
                }
                if (ys) ls[l] = line_sumsq(ys + l * L, L, yk, yacc);
              }
            }
            if (!skip_x) {
#if defined(_OPENMP)
#pragma omp for schedule(static) nowait
#endif
              for (std::size_t task = 0; task < col_tasks; ++task) {
                const std::size_t k0 = task * chunk, k1 = std::min(L, k0 + chunk);
                double* o = ox + (a * B + b) * L;
                for (std::size_t i = i0; i < i1; ++i) {
                  const std::size_t l = (a * X + i) * B + b;
                  const T* p = x + l * L;
                  if (C == 1) {
                    const CY r = rv(l);
                    std::size_t k = k0;
#if GRADAPT_SIMD_PACKS
                    if constexpr (packs)
                      k = fact_lines<fact_kind::columns, HasC>(f, static_cast<float>(r), cb, p, k0, k1, o,
                                                               nullptr);
#endif
                    for (; k < k1; ++k)
                      o[k] = fold<Max>(o[k], static_cast<double>(f(r, cv(cb, k), load(p[k]))));
                  } else {
                    std::size_t c = k0 % C;
                    for (std::size_t k = k0; k < k1; ++k) {
                      o[k] = fold<Max>(o[k], static_cast<double>(f(rv(l * C + c), cv(cb, k), load(p[k]))));
                      c = c + 1 == C ? 0 : c + 1;
                    }
                  }
                }
              }
            }
          }
        }
      }
  }

#if GRADAPT_SIMD_PACKS
  /// acc += t part by part (a fold over the parts: no loop is left for -O2 to keep in memory).
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_parts(D& acc, const D& t, std::index_sequence<I...>) {
    ((acc.part[I] = acc.part[I] + t.part[I]), ...);
  }
  /// o[0, D::size) += t, part by part.
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_parts_to(double* o, const D& t, std::index_sequence<I...>) {
    (
        [&] {
          typename D::native v;
          std::memcpy(&v, o + I * D::part_lanes, sizeof v);
          v = v + t.part[I];
          std::memcpy(o + I * D::part_lanes, &v, sizeof v);
        }(),
        ...);
  }

  /// What a pack loop of reduce_factored computes for one line: its row lanes, its column sums,
  /// or both from one read.
  enum class fact_kind { rows, columns, both };

  /// reduce_factored's pack loop (sums, float data, C == 1) over elements [j0, j1) of one line
  /// p, in packs NP of 8 floats: rows: lane q of the double accumulator is acc[q] (element j
  /// into lane j mod 8); columns: o[j] += term j. With HasY, also y's squares (widened) into
  /// lane j mod 8 of yacc (line_sumsq's terms), read in the same loop. Returns the first
  /// element not done.
  template <class NP, fact_kind K, bool HasC, bool HasY, class F, class RX, class T>
  static GRADAPT_INLINE std::size_t fact_packs(const F& f, float r, const RX* cb, const T* p, std::size_t j0,
                                               std::size_t j1, double* o, double* acc, const float* y,
                                               double* yacc) {
    using D = decltype(simd::widen(std::declval<const NP&>()));
    constexpr auto I = std::make_index_sequence<D::parts>{};
    const NP rr(r), one(1.0f);
    D va(0.0), vy(0.0);
    std::size_t j = j0;
    for (; j + 8 <= j1; j += 8) {
      const D t = simd::widen(f(rr, HasC ? NP::load(cb + j) : one, NP::load(p + j)));
      if constexpr (K != fact_kind::columns) add_parts(va, t, I);
      if constexpr (K != fact_kind::rows) add_parts_to(o + j, t, I);
      if constexpr (HasY) add_squares(vy, simd::widen(NP::load(y + j)), I);
    }
    if constexpr (K != fact_kind::columns) va.store(acc);
    if constexpr (HasY) vy.store(yacc);
    return j;
  }
#if defined(GRADAPT_HOST_PACKS_AVX2)
  /// fact_packs compiled for AVX2 (8 floats per register; no FMA, same bits as SSE2).
  template <fact_kind K, bool HasC, bool HasY, class F, class RX, class T>
  __attribute__((target("avx2"))) static std::size_t fact_packs_avx2(const F& f, float r, const RX* cb,
                                                                     const T* p, std::size_t j0,
                                                                     std::size_t j1, double* o, double* acc,
                                                                     const float* y, double* yacc) {
    return fact_packs<simd::pack<float, 8, 32>, K, HasC, HasY>(f, r, cb, p, j0, j1, o, acc, y, yacc);
  }
#endif
  /// fact_packs on AVX2 when the CPU has it, else on 16-byte registers.
  template <fact_kind K, bool HasC, bool HasY = false, class F, class RX, class T>
  static GRADAPT_INLINE std::size_t fact_lines(const F& f, float r, const RX* cb, const T* p, std::size_t j0,
                                               std::size_t j1, double* o, double* acc,
                                               const float* y = nullptr, double* yacc = nullptr) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
    if (detail::host_impl::cpu_has_avx2())
      return fact_packs_avx2<K, HasC, HasY>(f, r, cb, p, j0, j1, o, acc, y, yacc);
#endif
    return fact_packs<simd::pack<float, 8>, K, HasC, HasY>(f, r, cb, p, j0, j1, o, acc, y, yacc);
  }
  /// A rows or both pass over line l (C == 1, packs), with y's squares read in the same loop
  /// when y is float and present: returns the first element not done; *yk is how many of
  /// y's elements are in yacc (0: none).
  template <fact_kind K, bool HasC, class F, class RX, class T, class U>
  static GRADAPT_INLINE std::size_t fact_lines_y(const F& f, float r, const RX* cb, const T* p, std::size_t Y,
                                                 double* o, double* acc, U* y, double* yacc,
                                                 std::size_t* yk) {
    *yk = 0;
    if constexpr (std::is_same_v<std::remove_cv_t<U>, float>) {
      if (y) {
        const std::size_t j = fact_lines<K, HasC, true>(f, r, cb, p, 0, Y, o, acc, y, yacc);
        *yk = j;
        return j;
      }
    }
    return fact_lines<K, HasC>(f, r, cb, p, 0, Y, o, acc);
  }
#endif

  /// Σ_k y_k² of one line (widened to double before squaring): element k into lane k mod 8,
  /// lanes combined as a fixed tree (the same bits on the pack and scalar paths).
  /// With k > 0, the first k elements (k a multiple of 8) are already in pre[0, 8) (lanes).
  template <class U>
  static double line_sumsq(U* y, std::size_t L, std::size_t k = 0, const double* pre = nullptr) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (k > 0)
      for (std::size_t q = 0; q < 8; ++q) acc[q] = pre[q];
#if GRADAPT_SIMD_PACKS
    if constexpr (std::is_same_v<std::remove_cv_t<U>, float>) {
      if (k == 0) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
        if (detail::host_impl::cpu_has_avx2())
          k = sumsq_packs_avx2(y, L, acc);
        else
#endif
          k = sumsq_packs<simd::pack<float, 8>>(y, L, acc);
      }
    }
#endif
    for (; k + 8 <= L; k += 8)
      for (std::size_t q = 0; q < 8; ++q) {
        const double w = static_cast<double>(load(y[k + q]));
        acc[q] += w * w;
      }
    for (std::size_t q = 0; k < L; ++k, ++q) {
      const double w = static_cast<double>(load(y[k]));
      acc[q] += w * w;
    }
    for (std::size_t w = 4; w >= 1; w /= 2)
      for (std::size_t q = 0; q < w; ++q) acc[q] = acc[2 * q] + acc[2 * q + 1];
    return acc[0];
  }
#if GRADAPT_SIMD_PACKS
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_squares(D& acc, const D& w, std::index_sequence<I...>) {
    ((acc.part[I] = acc.part[I] + w.part[I] * w.part[I]), ...);
  }
  /// line_sumsq's pack loop: lane q of the double accumulator is acc[q].
  template <class P>
  static GRADAPT_INLINE std::size_t sumsq_packs(const float* y, std::size_t L, double* acc) {
    using D = decltype(simd::widen(std::declval<const P&>()));
    D va(0.0);
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8)
      add_squares(va, simd::widen(P::load(y + k)), std::make_index_sequence<D::parts>{});
    va.store(acc);
    return k;
  }
#if defined(GRADAPT_HOST_PACKS_AVX2)
  __attribute__((target("avx2"))) static std::size_t sumsq_packs_avx2(const float* y, std::size_t L,
                                                                      double* acc) {
    return sumsq_packs<simd::pack<float, 8, 32>>(y, L, acc);
  }
#endif
#endif

  /// One group of 8 elements of apply_factored's pack path: loads, call, stores (inlined, so
  /// the packs stay in registers).
  template <class T, class P>
  static GRADAPT_INLINE void store_pack(const P& v, T* dst) {
    if constexpr (!std::is_const_v<T>) v.store(dst);
  }
  template <bool Reduces, class F, class P, class D, class... Ts, std::size_t... I>
  static GRADAPT_INLINE void factored_pack(const F& f, const P& r, const P& c, D& va, std::size_t at,
                                           std::index_sequence<I...>, Ts*... ptrs) {
    P v[sizeof...(Ts)] = {P::load(ptrs + at)...};
    if constexpr (Reduces)
      add_parts(va, simd::widen(f(r, c, v[I]...)), std::make_index_sequence<D::parts>{});
    else
      f(r, c, v[I]...);
    (store_pack(v[I], ptrs + at), ...);
  }

  /// apply_factored's pack loop over one line of L elements (C == 1, float data): packs P of
  /// 8 floats, lane q of the double accumulator is acc[q]. Returns the elements done.
  template <bool Reduces, class P, class F, class... Ts>
  static GRADAPT_INLINE std::size_t factored_packs(const F& f, float rv, const float* cp, std::size_t L,
                                                   double* acc, Ts*... ptrs) {
    using D = decltype(simd::widen(std::declval<const P&>()));
    D va(0.0);
    const P r(rv);
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8)
      factored_pack<Reduces>(f, r, P::load(cp + k), va, k, std::index_sequence_for<Ts...>{}, ptrs...);
    if constexpr (Reduces) va.store(acc);
    return k;
  }
#if defined(GRADAPT_HOST_PACKS_AVX2)
  /// factored_packs compiled for AVX2 (one 32-byte register per 8 floats; no FMA, same bits).
  template <bool Reduces, class F, class... Ts>
  __attribute__((target("avx2"))) static std::size_t factored_packs_avx2(const F& f, float rv,
                                                                         const float* cp, std::size_t L,
                                                                         double* acc, Ts*... ptrs) {
    return factored_packs<Reduces, simd::pack<float, 8, 32>>(f, rv, cp, L, acc, ptrs...);
  }
#endif

  /// One line of apply_factored: elements [base, base + L), row entries at rbase + (k mod C),
  /// column entries at cbase + k.
  template <bool Reduces, class F, class RY, class RX, class... Ts>
  static double factored_line(const F& f, std::size_t base, std::size_t L, std::size_t C, const RY* rp,
                              std::size_t rbase, const RX* cp, std::size_t cbase, Ts*... ptrs) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::size_t k = 0;
#if GRADAPT_SIMD_PACKS
    constexpr bool all_float = std::is_same_v<std::remove_cv_t<RY>, float> &&
                               std::is_same_v<std::remove_cv_t<RX>, float> &&
                               (std::is_same_v<std::remove_cv_t<Ts>, float> && ...);
    if constexpr (all_float && simd::vectorizable_v<F>) {
      using P = simd::pack<float, 8>;
      if constexpr (std::is_invocable_v<const F&, P, P, std::conditional_t<true, P, Ts>&...>) {
        if (C == 1 && cp != nullptr) {
          // lane q of the double pack is acc[q]: element k + q of each group of 8
          const float r = rp ? rp[rbase] : 1.0f;
#if defined(GRADAPT_HOST_PACKS_AVX2)
          if (detail::host_impl::cpu_has_avx2())
            k = factored_packs_avx2<Reduces>(f, r, cp + cbase, L, acc, ptrs + base...);
          else
#endif
            k = factored_packs<Reduces, P>(f, r, cp + cbase, L, acc, ptrs + base...);
        }
      }
    }
#endif
    for (; k < L; ++k) {
      const auto r = rp ? load(rp[rbase + k % C]) : compute_t<RY>(1);
      const auto c = cp ? load(cp[cbase + k]) : compute_t<RX>(1);
      auto v = std::make_tuple(load(ptrs[base + k])...);
      std::apply(
          [&](auto&... e) {
            if constexpr (Reduces)
              acc[k % 8] += static_cast<double>(f(r, c, e...));
            else
              f(r, c, e...);
            (
                [&] {
                  if constexpr (!std::is_const_v<Ts>) store(ptrs[base + k], e);
                }(),
                ...);
          },
          v);
    }
    if constexpr (Reduces) {
      for (std::size_t w = 4; w >= 1; w /= 2)
        for (std::size_t q = 0; q < w; ++q) acc[q] = acc[2 * q] + acc[2 * q + 1];
      return acc[0];
    } else {
      return 0.0;
    }
  }

  /// max(acc, t) that keeps a NaN from either side (t where acc < t or t is NaN, else acc).
  template <class V>
  static GRADAPT_INLINE V nan_max(const V& acc, const V& t) {
    return simd::select((acc < t) | (t != t), t, acc);
  }
  /// `t > m ? t : m` lane-wise (x86's maxps): m when either is NaN, so a NaN m stays.
  template <class V>
  static GRADAPT_INLINE V gt_max(const V& t, const V& m) {
#if GRADAPT_SIMD_PACKS
    if constexpr (simd::is_pack_v<V>) {
      V r;
      for (std::size_t q = 0; q < V::parts; ++q) r.part[q] = t.part[q] > m.part[q] ? t.part[q] : m.part[q];
      return r;
    } else
#endif
    {
      return t > m ? t : m;
    }
  }
#if GRADAPT_SIMD_PACKS
  /// apply_factored_max's pack loop over one line (C == 1, float data): packs P of 8 floats;
  /// the row maximum is folded into *ry, the column maxima into cx, with `t > m ? t : m` (one
  /// `maxps`, which keeps a NaN maximum m but drops a NaN term t); *bad is set when a term was
  /// NaN (max_line then puts the NaN in). Returns the elements done.
  template <class P, class F, class... Ts, std::size_t... I>
  static GRADAPT_INLINE std::size_t max_packs(const F& fr, float rv, const float* cp, std::size_t L,
                                              float* ry, float* cx, bool* bad, std::index_sequence<I...>,
                                              Ts*... ptrs) {
    const F f = fr;  // a local copy: the stores through float pointers cannot change its members
    const P r(rv), zero(0.0f);
    P ra(-std::numeric_limits<float>::infinity());
    auto nan = zero != zero;
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8) {
      P v[sizeof...(Ts)] = {P::load(ptrs + k)...};
      const P t = f(r, P::load(cp + k), v[I]...);
      nan = nan | (t != t);
      ra = gt_max(t, ra);
      gt_max(t, P::load(cx + k)).store(cx + k);
      (store_pack(v[I], ptrs + k), ...);
    }
    float lanes[8];
    ra.store(lanes);
    for (const float x : lanes) *ry = gt_max(x, *ry);
    *bad = nan.any();
    return k;
  }
#if defined(GRADAPT_HOST_PACKS_AVX2)
  /// max_packs compiled for AVX2 (one 32-byte register per 8 floats; no FMA, same results).
  template <class F, class... Ts>
  __attribute__((target("avx2"))) static std::size_t max_packs_avx2(const F& f, float rv, const float* cp,
                                                                    std::size_t L, float* ry, float* cx,
                                                                    bool* bad, Ts*... ptrs) {
    return max_packs<simd::pack<float, 8, 32>>(f, rv, cp, L, ry, cx, bad, std::index_sequence_for<Ts...>{},
                                               ptrs...);
  }
#endif
#endif

  /// One line of apply_factored_max: elements [base, base + L), row entries and row maxima at
  /// rbase + (k mod C) (maxima at ry[k mod C]), column entries at cbase + k (maxima at cx[k]).
  /// A line whose pack loop met a NaN term is looked at again through `f.term` (which reads
  /// only what f does not write): its row maximum and the maxima of the NaN terms' columns
  /// become NaN.
  template <class F, class RY, class RX, class M, class... Ts>
  static void max_line(const F& f, std::size_t base, std::size_t L, std::size_t C, const RY* rp,
                       std::size_t rbase, const RX* cp, std::size_t cbase, M* ry, M* cx, Ts*... ptrs) {
    std::size_t k = 0;
    [[maybe_unused]] bool bad = false;
#if GRADAPT_SIMD_PACKS
    constexpr bool all_float = std::is_same_v<std::remove_cv_t<RY>, float> &&
                               std::is_same_v<std::remove_cv_t<RX>, float> && std::is_same_v<M, float> &&
                               (std::is_same_v<std::remove_cv_t<Ts>, float> && ...);
    if constexpr (all_float && simd::vectorizable_v<F>) {
      using P = simd::pack<float, 8>;
      if constexpr (std::is_invocable_v<const F&, P, P, std::conditional_t<true, P, Ts>&...>) {
        if (C == 1 && cp != nullptr) {
          const float r = rp ? rp[rbase] : 1.0f;
#if defined(GRADAPT_HOST_PACKS_AVX2)
          if (detail::host_impl::cpu_has_avx2())
            k = max_packs_avx2(f, r, cp + cbase, L, ry, cx, &bad, ptrs + base...);
          else
#endif
            k = max_packs<P>(f, r, cp + cbase, L, ry, cx, &bad, std::index_sequence_for<Ts...>{},
                             ptrs + base...);
          if (bad) {
            ry[0] = std::numeric_limits<M>::quiet_NaN();
            for (std::size_t j = 0; j < k; ++j) {
              auto v = std::make_tuple(load(ptrs[base + j])...);
              const M t = std::apply(
                  [&](auto&... e) { return static_cast<M>(f.term(r, load(cp[cbase + j]), e...)); }, v);
              if (t != t) cx[j] = t;
            }
          }
        }
      }
    }
#endif
    for (; k < L; ++k) {
      const auto r = rp ? load(rp[rbase + k % C]) : compute_t<RY>(1);
      const auto c = cp ? load(cp[cbase + k]) : compute_t<RX>(1);
      auto v = std::make_tuple(load(ptrs[base + k])...);
      std::apply(
          [&](auto&... e) {
            const M t = static_cast<M>(f(r, c, e...));
            (
                [&] {
                  if constexpr (!std::is_const_v<Ts>) store(ptrs[base + k], e);
                }(),
                ...);
            ry[k % C] = nan_max(ry[k % C], t);
            cx[k] = nan_max(cx[k], t);
          },
          v);
    }
  }

  template <class V0, class... Vs>
  static std::size_t check_sizes(const V0& v0, const Vs&... vs) {
    const std::size_t n = v0.size();
    std::size_t pos = 0;
    ((++pos, detail::require(vs.size() == n, "host backend apply: view ", pos, " has ", vs.size(),
                             " elements but view 0 has ", n, " (expected equal sizes)")),
     ...);
    return n;
  }
  template <class L0, class... Ls>
  static const L0& first_list(const L0& l0, const Ls&...) {
    return l0;
  }
  template <class L0, class... Ls>
  static std::size_t check_list_lengths(const L0& l0, const Ls&... ls) {
    const std::size_t n = std::ranges::size(l0);
    std::size_t pos = 0;
    ((++pos,
      detail::require(std::ranges::size(ls) == n, "host backend: list ", pos, " holds ",
                      std::ranges::size(ls), " tensors but list 0 holds ", n, " (expected equal lengths)")),
     ...);
    return n;
  }
  template <class L0, class... Ls>
  static std::size_t check_list_sizes(std::size_t t, const L0& l0, const Ls&... ls) {
    const std::size_t n = std::ranges::data(l0)[t].size();
    std::size_t pos = 0;
    ((++pos, detail::require(std::ranges::data(ls)[t].size() == n, "host backend: tensor ", t, " has ",
                             std::ranges::data(ls)[t].size(), " elements in list ", pos, " but ", n,
                             " in list 0 (expected equal sizes)")),
     ...);
    return n;
  }
  template <class L>
  static void check_out(const L& xs, std::span<double> out, const char* what) {
    detail::require(out.empty() || out.size() == std::ranges::size(xs), "host backend ", what,
                    ": per_tensor has ", out.size(), " slots for ", std::ranges::size(xs),
                    " tensors (expected equal, or empty for the global result only)");
  }
};

static_assert(factored_sumsq_backend<host> && factored_max_backend<host> && task_backend<host>,
              "gradapt::host models optimizer_backend, factored_backend, factored_sumsq_backend, "
              "factored_max_backend and task_backend");

static_assert(backend<host>);

}  // namespace gradapt

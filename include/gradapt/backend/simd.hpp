#pragma once
/// @file
/// A small SIMD pack type for host element functors, and the scalar functions that let one
/// functor body run on scalars (device code, scalar tails) and on packs (the host fast path).
///
/// Why. A header-only library is compiled with its consumer's flags, usually plain `-O2` with
/// no `-march` and no fast-math. There an Adam-like loop that calls `std::sqrt` does not
/// vectorise (the call may set `errno`), and runs 3 to 4 times below memory bandwidth.
/// `pack<T, N>` holds N lanes in GCC/Clang vector-extension registers of 16 bytes (SSE2, the
/// x86-64 baseline; NEON on AArch64) or 32 bytes when the consumer enables AVX, and its
/// `sqrt` maps to `sqrtps`/`sqrtpd` (`vsqrtq` on AArch64), so the element math of an
/// optimizer runs vectorised under plain `-O2`.
///
/// How a functor uses it. Write the functor once as a template on the value type V and call
/// only operators and the functions of this namespace (`sqrt`, `abs`, `min`, `max`,
/// `select`, `widen`):
///
///     struct scaled_rsqrt {
///       static constexpr bool vectorizable = true;   // opt in to packs on the host
///       float eps;
///       template <class V> GRADAPT_HD void operator()(V& u, V& v) const {
///         u = u / (gradapt::simd::sqrt(v) + eps);
///       }
///     };
///
/// The host backend then calls it with `pack<float, native_lanes<float>>` lvalues (one register:
/// 4 floats with SSE2, 8 with AVX) and with `float` lvalues for the tail; the CUDA backend calls
/// it with `float`. Every lane operation is the IEEE operation the scalar code performs (add,
/// subtract, multiply, divide and square root are correctly rounded in both), so a pack lane
/// produces the same bits as the scalar call on that element, NaN payloads aside (which NaN
/// operand an x86 instruction propagates depends on operand order). A consumer that enables
/// FMA contraction (`-mfma` with GCC's default `-ffp-contract=fast`) may see the two paths
/// contract differently. A reducing functor returns `terms_t<V, K>`: `gradapt::terms<K>` on
/// scalars, `vterms<K, pack<double, N>>` on packs.
///
/// `GRADAPT_NO_VECTOR_EXTENSIONS` (or a compiler without GCC vector extensions, or a CUDA
/// translation unit) turns packs off: `GRADAPT_SIMD_PACKS` is then 0 and only the scalar
/// functions exist.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/ops.hpp"

#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__HIPCC__) && !defined(GRADAPT_NO_VECTOR_EXTENSIONS)
/// 1 when `gradapt::simd::pack` exists (GCC/Clang host compilation without
/// GRADAPT_NO_VECTOR_EXTENSIONS), 0 otherwise.
#define GRADAPT_SIMD_PACKS 1
#else
/// 0: this compilation (a device compiler, a non-GNU host compiler, or
/// GRADAPT_NO_VECTOR_EXTENSIONS) has no `gradapt::simd::pack`; only the scalar paths exist.
#define GRADAPT_SIMD_PACKS 0
#endif

#if GRADAPT_SIMD_PACKS
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#endif

namespace gradapt::simd {

// ---- scalar functions: the same names as the pack functions ------------------------------

/// Square root, correctly rounded (IEEE). `sqrtf`/`sqrt` in device code.
GRADAPT_HD GRADAPT_INLINE float sqrt(float x) {
#if GRADAPT_DEVICE_PASS
  return ::sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
/// Square root of a double, correctly rounded.
GRADAPT_HD GRADAPT_INLINE double sqrt(double x) {
#if GRADAPT_DEVICE_PASS
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}
/// |x| (clears the sign bit; NaN stays NaN).
GRADAPT_HD GRADAPT_INLINE float abs(float x) {
#if GRADAPT_DEVICE_PASS
  return ::fabsf(x);
#else
  return std::fabs(x);
#endif
}
/// |x| for double.
GRADAPT_HD GRADAPT_INLINE double abs(double x) {
#if GRADAPT_DEVICE_PASS
  return ::fabs(x);
#else
  return std::fabs(x);
#endif
}
/// `b < a ? b : a`, exactly `std::min`'s rule: if either is NaN the result is `a`.
template <class T>
requires std::is_floating_point_v<T> GRADAPT_HD GRADAPT_INLINE T min(T a, T b) { return b < a ? b : a; }
/// `a < b ? b : a`, exactly `std::max`'s rule: if either is NaN the result is `a`.
template <class T>
requires std::is_floating_point_v<T> GRADAPT_HD GRADAPT_INLINE T max(T a, T b) { return a < b ? b : a; }
/// `m ? a : b`.
template <class T>
requires std::is_floating_point_v<T> GRADAPT_HD GRADAPT_INLINE T select(bool m, T a, T b) {
  return m ? a : b;
}
/// The value in double (exact).
GRADAPT_HD GRADAPT_INLINE double widen(float x) { return static_cast<double>(x); }
/// Identity for double.
GRADAPT_HD GRADAPT_INLINE double widen(double x) { return x; }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
namespace detail {
/// Whether the AVX2 paths run (decided once per process): the run-time choice of every function
/// compiled with `__attribute__((target("avx2")))` (the host backend's loops, SM3's fused pass).
/// True when this CPU runs AVX2 code, unless the environment variable `GRADAPT_HOST_AVX2` is
/// `0`: then the 16-byte paths run, with the same bits (ctest's optim_sse_path_matches_scalar
/// runs the optimizers' bit printer so).
inline bool cpu_has_avx2() {
  static const bool yes = [] {
    const char* env = std::getenv("GRADAPT_HOST_AVX2");
    return __builtin_cpu_supports("avx2") && !(env != nullptr && env[0] == '0' && env[1] == '\0');
  }();
  return yes;
}
}  // namespace detail
#endif

#if GRADAPT_SIMD_PACKS

/// Bytes of one native vector register a pack is built from: 32 when the consumer compiles
/// with AVX, 16 otherwise (SSE2 on x86-64, NEON on AArch64, generic lowering elsewhere).
#if defined(__AVX__)
inline constexpr std::size_t native_bytes = 32;
#else
inline constexpr std::size_t native_bytes = 16;
#endif

/// 1 when 32-byte packs can be used in functions compiled for AVX2 through
/// `__attribute__((target("avx2")))` although the translation unit is not (GCC on x86-64: the
/// square root of such a pack is written as inline assembly, which GCC accepts in any function
/// that ends up inlined into an AVX function; Clang checks the operand size earlier, so it keeps
/// the 16-byte path). The AVX2 functions are marked `flatten`, so every call in them (lambdas,
/// functors) is inlined at -Og, -O1 and -Os as well; GCC ignores `flatten` where it inlines
/// nothing (-O0, -fno-inline: `__NO_INLINE__`), the assembly would stay in functions compiled
/// without AVX ("impossible constraint in 'asm'"), and such builds take the 16-byte path, which
/// gives the same bits. tests/consumer.cpp is compiled at each of these levels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX__) && \
    !defined(__NO_INLINE__)
#define GRADAPT_SIMD_AVX_ASM 1
#else
#define GRADAPT_SIMD_AVX_ASM 0
#endif

/// Lanes of T in one native vector: the pack width the host element loops use, so a pack is
/// one register (4 floats or 2 doubles with SSE2/NEON, 8 or 4 with AVX).
template <class T>
inline constexpr std::size_t native_lanes = native_bytes / sizeof(T);

namespace detail {
template <std::size_t Bytes>
struct int_of;
template <>
struct int_of<4> {
  using type = std::int32_t;
};
template <>
struct int_of<8> {
  using type = std::int64_t;
};
}  // namespace detail

template <class T, std::size_t N, std::size_t B = native_bytes>
struct mask;

/// N lanes of T (float or double) held in `parts` vectors of B bytes each (fewer bytes when the
/// whole pack is smaller; B is the native register width by default). Arithmetic is lane-wise
/// IEEE arithmetic; a scalar operand is broadcast. Loads and stores are unaligned.
///
/// The pack is built from several register-sized vectors rather than one wide vector so that
/// every operation maps to one instruction per register. B = 32 without `__AVX__` is for code
/// compiled with `__attribute__((target("avx2")))` (the host backend's run-time AVX2 path);
/// its vectors are declared 16-byte aligned so passing them by value does not change the ABI.
template <class T, std::size_t N, std::size_t B = native_bytes>
struct pack {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "gradapt::simd::pack holds float or double");
  static_assert(N >= 1 && (N & (N - 1)) == 0, "gradapt::simd::pack needs a power-of-two lane count");

  using value_type = T;
  /// Lanes in the pack.
  static constexpr std::size_t size = N;
  /// Bytes of one native vector.
  static constexpr std::size_t part_bytes = N * sizeof(T) < B ? N * sizeof(T) : B;
  /// Lanes per vector.
  static constexpr std::size_t part_lanes = part_bytes / sizeof(T);
  /// Vectors in the pack.
  static constexpr std::size_t parts = N / part_lanes;
  /// Declared alignment of a vector: its size, at most the native register's.
  static constexpr std::size_t part_align = part_bytes < native_bytes ? part_bytes : native_bytes;

  typedef T native __attribute__((vector_size(part_bytes), aligned(part_align)));
  /// The same vector with the element's alignment and `may_alias` (as `__m128_u`), for
  /// unaligned loads and stores of T arrays.
  typedef T native_unaligned __attribute__((vector_size(part_bytes), aligned(alignof(T))));
  typedef typename detail::int_of<sizeof(T)>::type lane_int;
  typedef lane_int native_int __attribute__((vector_size(part_bytes), aligned(part_align)));

  native part[parts];

  pack() = default;
  /// Every lane equal to `s`.
  GRADAPT_INLINE pack(T s) {  // NOLINT(google-explicit-constructor): broadcast keeps functor code generic
    native v;
    broadcast(s, v);
    for (std::size_t p = 0; p < parts; ++p) part[p] = v;
  }

  /// N consecutive elements from `src` (any alignment).
  static GRADAPT_INLINE pack load(const T* src) {
    pack r;
    for (std::size_t p = 0; p < parts; ++p)
      r.part[p] = *reinterpret_cast<const native_unaligned*>(src + p * part_lanes);
    return r;
  }
  /// Writes the N lanes to `dst` (any alignment).
  GRADAPT_INLINE void store(T* dst) const {
    for (std::size_t p = 0; p < parts; ++p)
      *reinterpret_cast<native_unaligned*>(dst + p * part_lanes) = part[p];
  }
  /// Sets every lane of v to `s` (one shuffle; exact for -0 and NaN). Written through a
  /// reference: returning a 32-byte vector from a function without AVX changes the ABI.
  static GRADAPT_INLINE void broadcast(T s, native& v) {
#if defined(__AVX__)
    if constexpr (part_bytes == 32 && std::is_same_v<T, float>) {
      const __m256 x = _mm256_set1_ps(s);
      std::memcpy(&v, &x, 32);
      return;
    } else if constexpr (part_bytes == 32) {
      const __m256d x = _mm256_set1_pd(s);
      std::memcpy(&v, &x, 32);
      return;
    }
#endif
#if defined(__SSE2__)
    if constexpr (part_bytes == 16 && std::is_same_v<T, float>) {
      const __m128 x = _mm_set1_ps(s);
      std::memcpy(&v, &x, 16);
      return;
    } else if constexpr (part_bytes == 16) {
      const __m128d x = _mm_set1_pd(s);
      std::memcpy(&v, &x, 16);
      return;
    }
#endif
    native r{};  // every lane is written; the zeroes keep GCC's -O1 -Wmaybe-uninitialized quiet
    for (std::size_t l = 0; l < part_lanes; ++l) r[l] = s;
    v = r;
  }

  /// Lane i (for tests and tails; not a fast path).
  GRADAPT_INLINE T operator[](std::size_t i) const {
    T a[N];
    store(a);
    return a[i];
  }

  GRADAPT_INLINE pack& operator+=(const pack& o) {
    for (std::size_t p = 0; p < parts; ++p) part[p] += o.part[p];
    return *this;
  }
  GRADAPT_INLINE pack& operator-=(const pack& o) {
    for (std::size_t p = 0; p < parts; ++p) part[p] -= o.part[p];
    return *this;
  }
  GRADAPT_INLINE pack& operator*=(const pack& o) {
    for (std::size_t p = 0; p < parts; ++p) part[p] *= o.part[p];
    return *this;
  }
  GRADAPT_INLINE pack& operator/=(const pack& o) {
    for (std::size_t p = 0; p < parts; ++p) part[p] /= o.part[p];
    return *this;
  }
  friend GRADAPT_INLINE pack operator+(pack a, const pack& b) { return a += b; }
  friend GRADAPT_INLINE pack operator-(pack a, const pack& b) { return a -= b; }
  friend GRADAPT_INLINE pack operator*(pack a, const pack& b) { return a *= b; }
  friend GRADAPT_INLINE pack operator/(pack a, const pack& b) { return a /= b; }
  friend GRADAPT_INLINE pack operator+(pack a, T b) { return a += pack(b); }
  friend GRADAPT_INLINE pack operator-(pack a, T b) { return a -= pack(b); }
  friend GRADAPT_INLINE pack operator*(pack a, T b) { return a *= pack(b); }
  friend GRADAPT_INLINE pack operator/(pack a, T b) { return a /= pack(b); }
  friend GRADAPT_INLINE pack operator+(T a, const pack& b) { return pack(a) += b; }
  friend GRADAPT_INLINE pack operator-(T a, const pack& b) { return pack(a) -= b; }
  friend GRADAPT_INLINE pack operator*(T a, const pack& b) { return pack(a) *= b; }
  friend GRADAPT_INLINE pack operator/(T a, const pack& b) { return pack(a) /= b; }
  /// Lane-wise negation (flips the sign bit, as scalar `-x` does).
  friend GRADAPT_INLINE pack operator-(const pack& a) {
    pack r;
    for (std::size_t p = 0; p < parts; ++p) r.part[p] = -a.part[p];
    return r;
  }

  friend GRADAPT_INLINE mask<T, N, B> operator<(const pack& a, const pack& b) {
    mask<T, N, B> m;
    // The comparison goes through a local and memcpy: GCC 12 at -O2 mis-compiled a direct
    // store of a vector comparison into the mask's member array (seen in test_optim_simd).
    for (std::size_t p = 0; p < parts; ++p) {
      const native_int c = a.part[p] < b.part[p];
      std::memcpy(static_cast<void*>(&m.part[p]), &c, sizeof c);
    }
    return m;
  }
  friend GRADAPT_INLINE mask<T, N, B> operator<=(const pack& a, const pack& b) {
    mask<T, N, B> m;
    for (std::size_t p = 0; p < parts; ++p) {
      const native_int c = a.part[p] <= b.part[p];
      std::memcpy(static_cast<void*>(&m.part[p]), &c, sizeof c);
    }
    return m;
  }
  friend GRADAPT_INLINE mask<T, N, B> operator>(const pack& a, const pack& b) { return b < a; }
  friend GRADAPT_INLINE mask<T, N, B> operator>=(const pack& a, const pack& b) { return b <= a; }
  friend GRADAPT_INLINE mask<T, N, B> operator==(const pack& a, const pack& b) {
    mask<T, N, B> m;
    for (std::size_t p = 0; p < parts; ++p) {
      const native_int c = a.part[p] == b.part[p];
      std::memcpy(static_cast<void*>(&m.part[p]), &c, sizeof c);
    }
    return m;
  }
  friend GRADAPT_INLINE mask<T, N, B> operator!=(const pack& a, const pack& b) {
    mask<T, N, B> m;
    for (std::size_t p = 0; p < parts; ++p) {
      const native_int c = a.part[p] != b.part[p];
      std::memcpy(static_cast<void*>(&m.part[p]), &c, sizeof c);
    }
    return m;
  }
};

/// Lane-wise truth values of a comparison of two `pack<T, N>` (all ones or all zeros per
/// lane), for `select`.
template <class T, std::size_t N, std::size_t B>
struct mask {
  using pack_type = pack<T, N, B>;
  typename pack_type::native_int part[pack_type::parts];

  friend GRADAPT_INLINE mask operator&(mask a, const mask& b) {
    for (std::size_t p = 0; p < pack_type::parts; ++p) a.part[p] &= b.part[p];
    return a;
  }
  friend GRADAPT_INLINE mask operator|(mask a, const mask& b) {
    for (std::size_t p = 0; p < pack_type::parts; ++p) a.part[p] |= b.part[p];
    return a;
  }
  friend GRADAPT_INLINE mask operator!(mask a) {
    for (std::size_t p = 0; p < pack_type::parts; ++p) a.part[p] = ~a.part[p];
    return a;
  }
  /// True when lane i is set (for tests).
  GRADAPT_INLINE bool operator[](std::size_t i) const {
    return part[i / pack_type::part_lanes][i % pack_type::part_lanes] != 0;
  }
  /// True when any lane is set.
  GRADAPT_INLINE bool any() const {
    auto acc = part[0];
    for (std::size_t p = 1; p < pack_type::parts; ++p) acc |= part[p];
    std::uint64_t w[sizeof(acc) / 8];
    std::memcpy(w, &acc, sizeof acc);
    std::uint64_t o = 0;
    for (const std::uint64_t x : w) o |= x;
    return o != 0;
  }
};

/// Lane-wise `m ? a : b` (bitwise blend: exact for every value, NaN included).
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> select(const mask<T, N, B>& m, const pack<T, N, B>& a, const pack<T, N, B>& b) {
  using P = pack<T, N, B>;
  P r;
  for (std::size_t p = 0; p < P::parts; ++p) {
    typename P::native_int ai, bi;
    std::memcpy(&ai, &a.part[p], sizeof ai);
    std::memcpy(&bi, &b.part[p], sizeof bi);
    const typename P::native_int ri = (m.part[p] & ai) | (~m.part[p] & bi);
    std::memcpy(static_cast<void*>(&r.part[p]), &ri, sizeof ri);
  }
  return r;
}

/// Lane-wise square root (sqrtps/sqrtpd, vsqrtq on AArch64), correctly rounded.
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> sqrt(const pack<T, N, B>& a) {
  using P = pack<T, N, B>;
  P r;
  for (std::size_t p = 0; p < P::parts; ++p) {
    typename P::native x = a.part[p];
    typename P::native y;
#if defined(__AVX__)
    if constexpr (P::part_bytes == 32 && std::is_same_v<T, float>) {
      __m256 v;
      std::memcpy(&v, &x, 32);
      v = _mm256_sqrt_ps(v);
      std::memcpy(&y, &v, 32);
      r.part[p] = y;
      continue;
    } else if constexpr (P::part_bytes == 32) {
      __m256d v;
      std::memcpy(&v, &x, 32);
      v = _mm256_sqrt_pd(v);
      std::memcpy(&y, &v, 32);
      r.part[p] = y;
      continue;
    }
#endif
#if GRADAPT_SIMD_AVX_ASM
    if constexpr (P::part_bytes == 32 && std::is_same_v<T, float>) {
      asm("vsqrtps %1, %0" : "=x"(y) : "x"(x));
      r.part[p] = y;
      continue;
    } else if constexpr (P::part_bytes == 32) {
      asm("vsqrtpd %1, %0" : "=x"(y) : "x"(x));
      r.part[p] = y;
      continue;
    }
#endif
#if defined(__SSE2__)
    if constexpr (P::part_bytes == 16 && std::is_same_v<T, float>) {
      __m128 v;
      std::memcpy(&v, &x, 16);
      v = _mm_sqrt_ps(v);
      std::memcpy(&y, &v, 16);
      r.part[p] = y;
      continue;
    } else if constexpr (P::part_bytes == 16) {
      __m128d v;
      std::memcpy(&v, &x, 16);
      v = _mm_sqrt_pd(v);
      std::memcpy(&y, &v, 16);
      r.part[p] = y;
      continue;
    }
#elif defined(__aarch64__) && defined(__ARM_NEON)
    if constexpr (P::part_bytes == 16 && std::is_same_v<T, float>) {
      float32x4_t v;
      std::memcpy(&v, &x, 16);
      v = vsqrtq_f32(v);
      std::memcpy(&y, &v, 16);
      r.part[p] = y;
      continue;
    } else if constexpr (P::part_bytes == 16) {
      float64x2_t v;
      std::memcpy(&v, &x, 16);
      v = vsqrtq_f64(v);
      std::memcpy(&y, &v, 16);
      r.part[p] = y;
      continue;
    }
#endif
    for (std::size_t l = 0; l < P::part_lanes; ++l) y[l] = std::sqrt(x[l]);
    r.part[p] = y;
  }
  return r;
}

/// Lane-wise |a| (clears the sign bit).
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> abs(const pack<T, N, B>& a) {
  using P = pack<T, N, B>;
  P r;
  constexpr auto magnitude = std::numeric_limits<typename P::lane_int>::max();  // all bits but the sign
  for (std::size_t p = 0; p < P::parts; ++p) {
    typename P::native_int i;
    std::memcpy(&i, &a.part[p], sizeof i);
    i &= magnitude;
    std::memcpy(static_cast<void*>(&r.part[p]), &i, sizeof i);
  }
  return r;
}

/// Lane-wise `b < a ? b : a` (`std::min`'s rule, so NaN handling matches the scalar `min`).
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> min(const pack<T, N, B>& a, const pack<T, N, B>& b) {
  return select(b < a, b, a);
}
/// Lane-wise `a < b ? b : a` (`std::max`'s rule).
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> max(const pack<T, N, B>& a, const pack<T, N, B>& b) {
  return select(a < b, b, a);
}

/// Lane-wise `a > b ? a : b`: one x86 `maxps`/`maxpd` per register. Unlike `max`, it returns
/// b when either lane is NaN (a NaN b stays, a NaN a is dropped), for loops that track NaN apart.
template <class T, std::size_t N, std::size_t B>
GRADAPT_INLINE pack<T, N, B> gt_max(const pack<T, N, B>& a, const pack<T, N, B>& b) {
  pack<T, N, B> r;
  for (std::size_t q = 0; q < pack<T, N, B>::parts; ++q)
    r.part[q] = a.part[q] > b.part[q] ? a.part[q] : b.part[q];
  return r;
}

/// The lanes converted to double (exact): cvtps2pd per half register on x86-64, register to
/// register.
template <std::size_t N, std::size_t B>
GRADAPT_INLINE pack<double, N, B> widen(const pack<float, N, B>& a) {
  using F = pack<float, N, B>;
  using D = pack<double, N, B>;
  D r;
#if defined(__AVX__)
  if constexpr (F::part_bytes == 32 && D::part_bytes == 32) {
    for (std::size_t p = 0; p < F::parts; ++p) {
      __m256 x;
      std::memcpy(&x, &a.part[p], 32);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      std::memcpy(static_cast<void*>(&r.part[2 * p]), &lo, 32);
      std::memcpy(static_cast<void*>(&r.part[2 * p + 1]), &hi, 32);
    }
    return r;
  }
#endif
#if defined(__SSE2__)
  if constexpr (F::part_bytes == 16 && D::part_bytes == 16) {
    for (std::size_t p = 0; p < F::parts; ++p) {
      __m128 x;
      std::memcpy(&x, &a.part[p], 16);
      const __m128d lo = _mm_cvtps_pd(x);
      const __m128d hi = _mm_cvtps_pd(_mm_movehl_ps(x, x));
      std::memcpy(static_cast<void*>(&r.part[2 * p]), &lo, 16);
      std::memcpy(static_cast<void*>(&r.part[2 * p + 1]), &hi, 16);
    }
    return r;
  }
#endif
#if GRADAPT_SIMD_AVX_ASM
  if constexpr (F::part_bytes == 32 && D::part_bytes == 32) {
    // 32-byte packs outside an AVX translation unit (only inlined into AVX functions).
    for (std::size_t p = 0; p < F::parts; ++p) {
      typename D::native lo, hi;
      asm("vcvtps2pd %x2, %0\n\tvextractf128 $1, %2, %x1\n\tvcvtps2pd %x1, %1"
          : "=&x"(lo), "=&x"(hi)
          : "x"(a.part[p]));
      r.part[2 * p] = lo;
      r.part[2 * p + 1] = hi;
    }
    return r;
  }
#endif
  if constexpr (F::part_lanes == 2 * D::part_lanes) {
    // Generic vectors: each float vector converts to two double vectors.
    typedef float half_f __attribute__((vector_size(F::part_bytes / 2)));
    for (std::size_t p = 0; p < F::parts; ++p) {
      half_f h[2];
      std::memcpy(static_cast<void*>(h), &a.part[p], sizeof h);
      r.part[2 * p] = __builtin_convertvector(h[0], typename D::native);
      r.part[2 * p + 1] = __builtin_convertvector(h[1], typename D::native);
    }
    return r;
  }
  float in[N];
  double out[N];
  a.store(in);
  for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<double>(in[i]);
  return D::load(out);
}
/// Identity for double packs.
template <std::size_t N, std::size_t B>
GRADAPT_INLINE const pack<double, N, B>& widen(const pack<double, N, B>& a) {
  return a;
}

// ---- loads and stores of every element type into compute-type packs ---------------------

/// N elements of float or double.
template <std::size_t N, class T>
requires(std::is_same_v<T, float> || std::is_same_v<T, double>) GRADAPT_INLINE pack<T, N> load(const T* src) {
  return pack<T, N>::load(src);
}

namespace detail {
/// A GCC vector of `Bytes / 4` lanes of type L (the lane vectors of the 16-bit loads and
/// stores; `Bytes` is a pack's `part_bytes`).
template <class L, std::size_t Bytes>
struct lanes_of_t {
  typedef L type __attribute__((vector_size(Bytes), aligned(Bytes < native_bytes ? Bytes : native_bytes)));
};
template <class L, std::size_t Bytes>
using lanes_of = typename lanes_of_t<L, Bytes>::type;

/// binary16 bit patterns (one per 32-bit lane, zero-extended) converted to float bit patterns
/// exactly, as `gradapt::half` does: normals by exponent rebias, subnormals through an exact
/// integer-to-float conversion (m · 2^-24, no subnormal float involved, so flush-to-zero modes
/// do not matter), inf and NaN with their payload; any lane count (written through `out`:
/// returning a 32-byte vector from a function without AVX changes the ABI).
template <class VI, class VF>
GRADAPT_INLINE void half_to_float_bits(const VI& x, VI& out) {
  const VI sign = (x & 0x8000) << 16;
  const VI em = x & 0x7fff;
  VI bits = (em << 13) + (112 << 23);
  bits += (em >= 0x7c00) & (112 << 23);                       // inf / NaN: exponent all ones
  const VF sub = __builtin_convertvector(em, VF) * 0x1p-24f;  // exact: m * 2^-24 is a normal float
  VI sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof sub_bits);
  const VI is_sub = em < 0x400;
  out = ((is_sub & sub_bits) | (~is_sub & bits)) | sign;
}

/// float bit patterns (VI: signed 32-bit lanes) rounded to binary16 bit patterns (in the low
/// 16 bits of each lane), bit for bit `float_to_half_bits`: round to nearest even, overflow
/// to ±inf, NaN quiet with the sign and the top 10 payload bits, subnormals exact, -0 kept.
/// Integer lane operations only, so the result does not depend on MXCSR (rounding mode,
/// FTZ/DAZ). The subnormal branch needs per-lane shifts: one instruction with AVX2, four
/// scalar shifts with SSE2, so on SSE2 it runs only when some lane is below 2^-14.
template <class VI>
GRADAPT_INLINE void float_to_half_bits(const VI& x, VI& out) {
  using VU = lanes_of<std::uint32_t, sizeof(VI)>;
  const VI a = x & 0x7fffffff;
  const VU au = (VU)a;
  const VI sign = (x >> 16) & 0x8000;
  // Normal half range (2^-14 <= |x| < 65520): round the 13 dropped bits to nearest even.
  const VI normal = (VI)((au + 0x0fffu + ((au >> 13) & 1u) - (112u << 23)) >> 13);
  const VI nan = ((a >> 13) & 0x03ff) | 0x7e00;  // quiet, top payload bits kept
  VI r = (a >= 0x38800000) & normal;
  r = (a >= 0x477ff000) ? VI{} + 0x7c00 : r;  // >= 65520 and inf: inf
  r = (a > 0x7f800000) ? nan : r;
  const VI is_sub = a < 0x38800000;
  bool any_sub = true;
#if !defined(__AVX2__)
  if constexpr (sizeof(VI) ==
                16) {  // SSE2 (or a generic target): skip the slow shifts when none is subnormal
    std::uint64_t w[2];
    std::memcpy(w, &is_sub, sizeof w);
    any_sub = (w[0] | w[1]) != 0;
  }
#endif
  if (any_sub) {
    // k = m >> s rounded to nearest even, m the 24-bit significand, s = 126 - e (14 .. 24);
    // s is clamped to 25 below 2^-25 (k = 0, no round-up) and to 0 for lanes not used.
    const VI e = a >> 23;
    VI s = 126 - e;
    s = s > 25 ? VI{} + 25 : s;
    s = s < 0 ? VI{} : s;
    const VU su = (VU)s;
    const VU m = (au & 0x007fffffu) | 0x00800000u;
    VU k = m >> su;
    const VU rem = m & (((VU{} + 1u) << su) - 1u);
    const VU halfway = ((VU{} + 1u) << su) >> 1;
    const VI up = (VI)((rem > halfway) | ((rem == halfway) & ((k & 1u) != 0u)));
    k -= (VU)up;  // up is all ones where k rounds up; k == 0x400 is the smallest normal
    r = (is_sub & (VI)k) | (~is_sub & r);
  }
  out = r | sign;
}

/// float bit patterns rounded to bfloat16 bit patterns (low 16 bits of each lane), bit for
/// bit `float_to_bfloat16_bits`: round to nearest even, NaN quiet with its sign and payload.
template <class VI>
GRADAPT_INLINE void float_to_bfloat16_bits(const VI& x, VI& out) {
  using VU = lanes_of<std::uint32_t, sizeof(VI)>;
  const VU xu = (VU)x;
  const VI rounded = (VI)((xu + 0x7fffu + ((xu >> 16) & 1u)) >> 16);
  const VI nan = (VI)((xu >> 16) | 0x0040u);
  out = ((x & 0x7fffffff) > 0x7f800000) ? nan : rounded;
}

/// Stores the lanes of float pack P into 16-bit elements through the integer lane operations
/// above (every part of the pack; any register width). The portable path of `simd::store`.
template <class T, class P>
GRADAPT_INLINE void store_16bit_int(T* dst, const P& v) {
  static_assert(std::is_same_v<typename P::value_type, float>);
  using VI = typename P::native_int;
  typedef std::uint16_t VH __attribute__((vector_size(P::part_bytes / 2), aligned(alignof(T)), may_alias));
  for (std::size_t p = 0; p < P::parts; ++p) {
    VI x, b;
    std::memcpy(&x, &v.part[p], sizeof x);
    if constexpr (std::is_same_v<T, half>)
      detail::float_to_half_bits(x, b);
    else
      detail::float_to_bfloat16_bits(x, b);
    *reinterpret_cast<VH*>(dst + p * P::part_lanes) = __builtin_convertvector(b, VH);
  }
}

#if GRADAPT_SIMD_AVX_ASM
/// Whether this CPU has F16C (`vcvtps2ph`), read once at start-up. False before the static
/// initialiser has run, which only means the integer path is used.
inline const bool cpu_has_f16c = (__builtin_cpu_init(), __builtin_cpu_supports("f16c") != 0);

/// `store_16bit_int` for 32-byte packs as an out-of-line AVX2 function (the fallback of
/// `simd::store` on AVX2 CPUs without F16C).
template <class T, class P>
__attribute__((target("avx2"), noinline)) void store_16bit_int_avx2(T* dst, const P* v) {
  store_16bit_int(dst, *v);
}

/// Stores 32-byte float packs (only inlined into the host backend's AVX2 functions) into
/// binary16 with F16C: `vcvtps2ph` with immediate 0, round to nearest even whatever MXCSR's
/// rounding mode. It gives the bits `float_to_half_bits` gives for every float (overflow,
/// subnormals, ties, -0, NaN sign and payload; checked in tests/test_simd_half.cpp, FTZ/DAZ
/// set as well). Call only when `cpu_has_f16c`.
template <class P>
GRADAPT_INLINE void store_half_f16c(half* dst, const P& v) {
  static_assert(std::is_same_v<typename P::value_type, float> && P::part_bytes == 32);
  typedef std::uint16_t VH __attribute__((vector_size(16), aligned(2), may_alias));
  for (std::size_t p = 0; p < P::parts; ++p) {
    VH h;
    asm("vcvtps2ph $0, %1, %0" : "=x"(h) : "x"(v.part[p]));
    *reinterpret_cast<VH*>(dst + p * P::part_lanes) = h;
  }
}
#endif
}  // namespace detail

/// P::size 16-bit elements (bfloat16 or half) converted exactly to a float pack P, one
/// register-to-register conversion per part (no round trip through memory, which would stall
/// on store forwarding when the part is 32 bytes).
template <class P, class T>
requires(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>) GRADAPT_INLINE P load_16bit(const T* src) {
  static_assert(std::is_same_v<typename P::value_type, float> && P::size % 4 == 0);
  using VI = typename P::native_int;
  typedef std::uint16_t VH __attribute__((vector_size(P::part_bytes / 2), aligned(alignof(T)), may_alias));
  P r;
  for (std::size_t p = 0; p < P::parts; ++p) {
    const VI x = __builtin_convertvector(*reinterpret_cast<const VH*>(src + p * P::part_lanes), VI);
    VI b;
    if constexpr (std::is_same_v<T, bfloat16>)
      b = x << 16;
    else
      detail::half_to_float_bits<VI, typename P::native>(x, b);
    std::memcpy(static_cast<void*>(&r.part[p]), &b, sizeof b);
  }
  return r;
}

/// N bfloat16 elements widened to float (exact: a 16-bit shift per lane).
template <std::size_t N>
requires(N % 4 == 0) GRADAPT_INLINE pack<float, N> load(const bfloat16* src) {
  return load_16bit<pack<float, N>>(src);
}

/// N binary16 elements converted to float exactly (see detail::half_to_float_bits).
template <std::size_t N>
requires(N % 4 == 0) GRADAPT_INLINE pack<float, N> load(const half* src) {
  return load_16bit<pack<float, N>>(src);
}

/// A pack P of the compute type loaded from elements of type T (float, double, bfloat16 or
/// half; T's compute type is P's lane type).
template <class P, class T>
GRADAPT_INLINE P load_as(const T* src) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, double>)
    return P::load(src);
  else
    return load_16bit<P>(src);
}

/// Stores N lanes into float or double elements.
template <class T, std::size_t N, std::size_t B>
requires(std::is_same_v<T, float> || std::is_same_v<T, double>) GRADAPT_INLINE
    void store(T* dst, const pack<T, N, B>& v) {
  v.store(dst);
}
/// Stores N float lanes into 16-bit elements, each rounded to nearest even exactly as
/// `gradapt::store` does (bit for bit, NaN payloads included): packed integer lane
/// operations (detail::store_16bit_int), or F16C's `vcvtps2ph` for binary16 in the host
/// backend's run-time AVX2 path when the CPU has F16C.
template <class T, std::size_t N, std::size_t B>
requires(std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) GRADAPT_INLINE
    void store(T* dst, const pack<float, N, B>& v) {
#if defined(__F16C__) && defined(__AVX__)
  // The consumer compiles for F16C (-mf16c, -march=native): vcvtps2ph with round to nearest
  // even, as in store_half_f16c.
  if constexpr (std::is_same_v<T, half>) {
    using P = pack<float, N, B>;
    for (std::size_t p = 0; p < P::parts; ++p) {
      if constexpr (P::part_bytes == 32) {
        __m256 x;
        std::memcpy(&x, &v.part[p], 32);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + p * P::part_lanes), _mm256_cvtps_ph(x, 0));
      } else {
        static_assert(P::part_bytes == 16);
        __m128 x;
        std::memcpy(&x, &v.part[p], 16);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + p * P::part_lanes), _mm_cvtps_ph(x, 0));
      }
    }
    return;
  }
#endif
#if GRADAPT_SIMD_AVX_ASM
  if constexpr (std::is_same_v<T, half> && pack<float, N, B>::part_bytes == 32) {
    if (__builtin_expect(detail::cpu_has_f16c, 1))
      detail::store_half_f16c(dst, v);
    else
      detail::store_16bit_int_avx2(dst, &v);  // out of line: its constants would crowd the loop's registers
    return;
  }
#endif
  detail::store_16bit_int(dst, v);
}

/// K per-element values of a pack functor's result, one pack<double, N> each: the pack form
/// of `gradapt::terms<K>` (lane l holds the value of element l of the group).
template <std::size_t K, class W>
struct vterms {
  W v[K];
  GRADAPT_INLINE W& operator[](std::size_t k) { return v[k]; }
  GRADAPT_INLINE const W& operator[](std::size_t k) const { return v[k]; }
};

template <class V>
struct is_pack : std::false_type {};
template <class T, std::size_t N, std::size_t B>
struct is_pack<pack<T, N, B>> : std::true_type {};

/// The double pack with V's lane count and register width (what `widen` returns).
template <class V>
struct wide_pack;
template <class T, std::size_t N, std::size_t B>
struct wide_pack<pack<T, N, B>> {
  using type = pack<double, N, B>;
};

#else  // !GRADAPT_SIMD_PACKS

template <class V>
struct is_pack : std::false_type {};

#endif  // GRADAPT_SIMD_PACKS

/// True for `pack<T, N>`.
template <class V>
inline constexpr bool is_pack_v = is_pack<std::remove_cvref_t<V>>::value;

namespace detail {
template <class V, bool = is_pack_v<V>>
struct scalar_of {
  using type = V;
};
template <class V>
struct scalar_of<V, true> {
  using type = typename V::value_type;
};
template <class V, std::size_t K, bool = is_pack_v<V>>
struct terms_of {
  using type = gradapt::terms<K>;
};
#if GRADAPT_SIMD_PACKS
template <class V, std::size_t K>
struct terms_of<V, K, true> {
  using type = vterms<K, typename wide_pack<V>::type>;
};
#endif
}  // namespace detail

/// The lane type: float for float and pack<float, N>, double for double and pack<double, N>.
template <class V>
using scalar_t = typename detail::scalar_of<std::remove_cvref_t<V>>::type;

/// What a reducing functor returns for K values per element: `gradapt::terms<K>` when called
/// on scalars, `vterms<K, pack<double, N>>` when called on packs of N lanes.
template <class V, std::size_t K>
using terms_t = typename detail::terms_of<std::remove_cvref_t<V>, K>::type;

/// True when functor type F opts in to being called with packs on the host
/// (`static constexpr bool vectorizable = true;`). Functors that do not opt in (plain
/// lambdas taking `float&`, generic lambdas written for scalars) keep the scalar path.
template <class F>
inline constexpr bool vectorizable_v = [] {
  if constexpr (requires { F::vectorizable; })
    return static_cast<bool>(F::vectorizable);
  else
    return false;
}();

}  // namespace gradapt::simd

#pragma once
/// @file
/// Element types: float, double and two 16-bit storage types (IEEE binary16 `half` and
/// `bfloat16`). The 16-bit types are storage only: element math loads them into `float`
/// (`compute_t<T>`), computes, and stores back with round-to-nearest-even.
///
/// The conversions are written as integer bit manipulation marked GRADAPT_HD, so host tests
/// exercise exactly the code that device kernels run. Both 16-bit types are standard-layout
/// structs holding one `uint16_t`, layout-compatible with CUDA's `__half` and `__nv_bfloat16`
/// (see backend/cuda/device_types.cuh for the mapping).

#include <array>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "gradapt/core/config.hpp"
#include "gradapt/core/enum_name.hpp"

namespace gradapt {

namespace detail {

GRADAPT_HD inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

GRADAPT_HD inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// binary32 -> binary16, round to nearest, ties to even. Overflow gives +-inf; NaN stays a
/// quiet NaN with the sign and the top payload bits kept; subnormals are produced exactly.
GRADAPT_HD inline std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN
    const std::uint32_t nan = a > 0x7f800000u ? (0x0200u | ((a >> 13) & 0x03ffu)) : 0u;
    return static_cast<std::uint16_t>(sign | 0x7c00u | nan);
  }
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (a >= 0x38800000u) {                                                   // normal half range: >= 2^-14
    a += 0x0fffu + ((a >> 13) & 1u);  // round to nearest even on the 13 dropped bits
    return static_cast<std::uint16_t>(sign | ((a - (112u << 23)) >> 13));
  }
  // Subnormal half (or zero): value = k * 2^-24 with k = m * 2^(e - 126), m the 24-bit
  // significand. Below 2^-25 everything rounds to zero (2^-25 itself is a tie to even 0).
  const std::uint32_t e = a >> 23;
  if (e < 102u) return static_cast<std::uint16_t>(sign);
  const std::uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const std::uint32_t s = 126u - e;  // 14 .. 24
  std::uint32_t k = m >> s;
  const std::uint32_t rem = m & ((1u << s) - 1u);
  const std::uint32_t halfway = 1u << (s - 1u);
  if (rem > halfway || (rem == halfway && (k & 1u))) ++k;  // k == 0x400 is the smallest normal
  return static_cast<std::uint16_t>(sign | k);
}

/// binary16 -> binary32, exact.
GRADAPT_HD inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x03ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e == 0u) {
    // m * 2^-24, exact in float; 2^-24 == bits 0x33800000.
    const float v = static_cast<float>(m) * bits_float(0x33800000u);
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

/// binary32 -> bfloat16, round to nearest, ties to even; NaN stays a quiet NaN with its sign.
GRADAPT_HD inline std::uint16_t float_to_bfloat16_bits(float f) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/// bfloat16 -> binary32, exact.
GRADAPT_HD inline float bfloat16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

/// The rounding and widening of IEEE binary16 (gradapt::half).
struct binary16_format {
  /// binary32 -> binary16 bits, round to nearest, ties to even (overflow gives inf).
  GRADAPT_HD static std::uint16_t round(float f) { return float_to_half_bits(f); }
  /// binary16 bits -> binary32, exact.
  GRADAPT_HD static float widen(std::uint16_t b) { return half_bits_to_float(b); }
};

/// The rounding and widening of bfloat16 (gradapt::bfloat16).
struct bfloat16_format {
  /// binary32 -> bfloat16 bits, round to nearest, ties to even.
  GRADAPT_HD static std::uint16_t round(float f) { return float_to_bfloat16_bits(f); }
  /// bfloat16 bits -> binary32, exact.
  GRADAPT_HD static float widen(std::uint16_t b) { return bfloat16_bits_to_float(b); }
};

}  // namespace detail

/// A 16-bit floating-point storage type: a bit pattern whose rounding from and widening to
/// binary32 `Format` defines. gradapt uses two, `gradapt::half` and `gradapt::bfloat16`.
template <class Format>
struct float16_storage {
  /// The raw 16-bit pattern (sign in bit 15). A default-constructed value is +0.
  std::uint16_t bits = 0;

  float16_storage() = default;
  /// Rounds `f` to the nearest value of the format (ties to even); overflow gives inf, NaN
  /// stays NaN.
  GRADAPT_HD explicit float16_storage(float f) : bits(Format::round(f)) {}
  /// Widens to binary32; exact for every value of the format (inf and NaN included).
  GRADAPT_HD explicit operator float() const { return Format::widen(bits); }
  /// A value with the bit pattern `b`, taken as is (no rounding, NaN payloads kept).
  GRADAPT_HD static float16_storage from_bits(std::uint16_t b) {
    float16_storage h;
    h.bits = b;
    return h;
  }
  /// Bitwise equality: +0 and -0 differ, and a NaN equals a NaN with the same bits (unlike
  /// IEEE comparison). Compare `float(a) == float(b)` for numeric equality.
  friend GRADAPT_HD bool operator==(float16_storage a, float16_storage b) { return a.bits == b.bits; }
};

/// IEEE 754 binary16 storage type (1 sign, 5 exponent, 10 mantissa bits).
using half = float16_storage<detail::binary16_format>;

/// bfloat16 storage type (1 sign, 8 exponent, 7 mantissa bits): float's range, less precision.
using bfloat16 = float16_storage<detail::bfloat16_format>;

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// Runtime tag of an element type.
enum class dtype : std::uint8_t { float32, float64, float16, bfloat16 };

/// True for the four element types gradapt stores.
template <class T>
inline constexpr bool is_element_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                     std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// Concept form of is_element_v (cv-qualifiers are stripped first).
template <class T>
concept element = is_element_v<std::remove_cv_t<T>>;

/// Runtime tag of element type T.
template <element T>
inline constexpr dtype dtype_of_v = std::is_same_v<std::remove_cv_t<T>, float>    ? dtype::float32
                                    : std::is_same_v<std::remove_cv_t<T>, double> ? dtype::float64
                                    : std::is_same_v<std::remove_cv_t<T>, half>   ? dtype::float16
                                                                                  : dtype::bfloat16;

/// Human-readable name of a dtype, as used in error messages.
constexpr std::string_view name(dtype t) {
  return detail::enum_name(t, std::array<std::string_view, 4>{"float32", "float64", "float16", "bfloat16"});
}

/// Bytes per element of a dtype.
constexpr std::size_t size_of(dtype t) { return t == dtype::float64 ? 8 : t == dtype::float32 ? 4 : 2; }

/// The type element math runs in: double for double, float for everything else.
template <element T>
using compute_t = std::conditional_t<std::is_same_v<std::remove_cv_t<T>, double>, double, float>;

/// Loads one stored element into its compute type.
template <class T>
GRADAPT_HD GRADAPT_INLINE compute_t<T> load(const T& x) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, double>)
    return x;
  else
    return static_cast<float>(x);
}

/// Stores a compute-type value into a stored element (rounding to nearest even for 16 bits).
template <class T>
GRADAPT_HD GRADAPT_INLINE void store(T& dst, compute_t<T> v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    dst = v;
  else
    dst = T(v);
}

}  // namespace gradapt

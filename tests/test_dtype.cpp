// fp16 / bf16 storage conversions against independent references:
//  - decoding: every one of the 65536 bit patterns against a formula evaluated with ldexp;
//  - encoding: every midpoint between adjacent representable values (ties go to even), one
//    float ulp either side of each midpoint, and a stride over all 2^32 floats, against a
//    reference that rounds in double with nearbyint (round-to-nearest-even);
//  - where the compiler has _Float16, its conversions as a second, peer reference.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>

#include "catch.hpp"
#include "gradapt/core/dtype.hpp"

namespace gradapt_test_dtype {

using gradapt::bfloat16;
using gradapt::half;

namespace {

float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Value of a binary16 pattern from its definition: (-1)^s * 2^(e-15) * (1 + m/1024), or
// subnormal (-1)^s * 2^-14 * (m/1024).
double half_reference_value(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(m / 1024.0, -14);
  else
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -v : v;
}

double bf16_reference_value(std::uint16_t b) {
  const int s = b >> 15, e = (b >> 7) & 255, m = b & 127;
  double v;
  if (e == 255)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(m / 128.0, -126);
  else
    v = std::ldexp(1.0 + m / 128.0, e - 127);
  return s ? -v : v;
}

// Round a finite double to a format with `mant` fraction bits, minimum normal exponent emin
// and largest finite value maxv, to nearest, ties to even, in double arithmetic.
double round_reference(double x, int mant, int emin, double maxv) {
  const double a = std::fabs(x);
  if (a == 0) return x;
  int e = std::ilogb(a);
  if (e < emin) e = emin;
  const double q = std::ldexp(1.0, e - mant);  // quantum at this binade
  const double r = std::nearbyint(a / q) * q;  // a / q is exact; nearbyint rounds ties to even
  // Overflow: rounding reaches the value one quantum above max with ties-to-even -> inf.
  const double top = maxv + std::ldexp(1.0, std::ilogb(maxv) - mant - 1);  // midpoint to 2^(emax+1)
  double out = a >= top ? std::numeric_limits<double>::infinity() : r;
  return x < 0 ? -out : out;
}

double half_round_reference(float f) { return round_reference(f, 10, -14, 65504.0); }
double bf16_round_reference(float f) {
  return round_reference(f, 7, -126,
                         static_cast<double>(std::numeric_limits<float>::max()) *
                             (1.0 - std::ldexp(1.0, -8)) / (1.0 - std::ldexp(1.0, -24)));
}

}  // namespace

TEST_CASE("half decodes every bit pattern exactly", "[dtype][half]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = half::from_bits(static_cast<std::uint16_t>(b));
    const double ref = half_reference_value(static_cast<std::uint16_t>(b));
    const float got = static_cast<float>(h);
    if (std::isnan(ref)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(static_cast<double>(got) == ref);
      REQUIRE(std::signbit(got) == std::signbit(ref));
    }
  }
}

TEST_CASE("bfloat16 decodes every bit pattern exactly", "[dtype][bfloat16]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const double ref = bf16_reference_value(static_cast<std::uint16_t>(b));
    const float got = static_cast<float>(bfloat16::from_bits(static_cast<std::uint16_t>(b)));
    if (std::isnan(ref))
      REQUIRE(std::isnan(got));
    else
      REQUIRE(static_cast<double>(got) == ref);
  }
}

template <class H>
void check_encoding(float f, double (*ref)(float)) {
  const H h(f);
  const float back = static_cast<float>(h);
  if (std::isnan(f)) {
    REQUIRE(std::isnan(back));
    REQUIRE(std::signbit(back) == std::signbit(f));
    return;
  }
  const double expect = ref(f);
  INFO("input bits 0x" << std::hex << float_to_bits(f) << " value " << f);
  REQUIRE(static_cast<double>(back) == expect);
  REQUIRE(std::signbit(back) == std::signbit(f));
}

TEST_CASE("half encodes midpoints, their neighbours and a stride of all floats", "[dtype][half]") {
  for (std::uint32_t b = 0; b < 0x7c00; ++b) {
    const double lo = half_reference_value(static_cast<std::uint16_t>(b));
    const double hi = half_reference_value(static_cast<std::uint16_t>(b + 1));  // 0x7c00 is inf
    const double mid = std::isinf(hi) ? 65520.0 : (lo + hi) / 2;
    const float m = static_cast<float>(mid);
    REQUIRE(static_cast<double>(m) == mid);  // midpoints are exact in float
    for (float f : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e30f), static_cast<float>(lo)}) {
      check_encoding<half>(f, half_round_reference);
      check_encoding<half>(-f, half_round_reference);
    }
  }
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 65537) {
    const float f = bits_to_float(static_cast<std::uint32_t>(u));
    if (std::isinf(f)) continue;
    check_encoding<half>(f, half_round_reference);
  }
  // Special values.
  REQUIRE(half(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  REQUIRE(half(-std::numeric_limits<float>::infinity()).bits == 0xfc00);
  REQUIRE(half(65504.0f).bits == 0x7bff);
  REQUIRE(half(65519.996f).bits == 0x7bff);
  REQUIRE(half(65520.0f).bits == 0x7c00);  // tie between 65504 and 2^16 goes to even: inf
  REQUIRE(half(1e-8f).bits == 0x0000);
  REQUIRE(half(std::ldexp(1.0f, -24)).bits == 0x0001);
  REQUIRE(half(std::ldexp(1.0f, -25)).bits == 0x0000);  // tie to even zero
  REQUIRE(half(std::ldexp(1.5f, -25)).bits == 0x0001);
  REQUIRE(half(-0.0f).bits == 0x8000);
  REQUIRE(std::isnan(static_cast<float>(half(std::numeric_limits<float>::quiet_NaN()))));
  REQUIRE(std::isnan(static_cast<float>(half(bits_to_float(0x7f800001u)))));  // signalling payload low bits
}

TEST_CASE("bfloat16 encodes midpoints, their neighbours and a stride of all floats", "[dtype][bfloat16]") {
  for (std::uint32_t b = 0; b < 0x7f80; b += 1) {
    const float lo = bits_to_float(b << 16);
    const float hi = bits_to_float((b + 1) << 16);
    if (std::isinf(hi)) continue;
    const float m = bits_to_float((b << 16) | 0x8000u);  // exact midpoint
    REQUIRE(static_cast<double>(m) == (static_cast<double>(lo) + static_cast<double>(hi)) / 2);
    for (float f : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e38f), lo}) {
      check_encoding<bfloat16>(f, bf16_round_reference);
      check_encoding<bfloat16>(-f, bf16_round_reference);
    }
  }
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 65537) {
    const float f = bits_to_float(static_cast<std::uint32_t>(u));
    if (std::isinf(f)) continue;
    check_encoding<bfloat16>(f, bf16_round_reference);
  }
  REQUIRE(bfloat16(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds up to inf
  REQUIRE(bfloat16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  REQUIRE(std::isnan(static_cast<float>(bfloat16(bits_to_float(0x7f800001u)))));  // NaN never becomes inf
  REQUIRE(std::isnan(static_cast<float>(bfloat16(bits_to_float(0xffffffffu)))));
  REQUIRE(bfloat16(1.0f).bits == 0x3f80);
}

#if defined(__FLT16_MAX__) && !defined(__clang__)
TEST_CASE("half agrees with the compiler's _Float16 conversions", "[dtype][half][peer]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    _Float16 p;
    const auto bits = static_cast<std::uint16_t>(b);
    std::memcpy(&p, &bits, 2);
    const float a = static_cast<float>(half::from_bits(bits)), c = static_cast<float>(p);
    REQUIRE((a == c || (std::isnan(a) && std::isnan(c))));
  }
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 4099) {
    const float f = bits_to_float(static_cast<std::uint32_t>(u));
    const _Float16 p = static_cast<_Float16>(f);
    std::uint16_t pb;
    std::memcpy(&pb, &p, 2);
    const half h(f);
    if (std::isnan(f))
      REQUIRE((h.bits & 0x7c00) == 0x7c00);
    else
      REQUIRE(h.bits == pb);
  }
}
#endif

TEST_CASE("dtype traits", "[dtype]") {
  STATIC_REQUIRE(gradapt::dtype_of_v<float> == gradapt::dtype::float32);
  STATIC_REQUIRE(gradapt::dtype_of_v<const double> == gradapt::dtype::float64);
  STATIC_REQUIRE(gradapt::dtype_of_v<half> == gradapt::dtype::float16);
  STATIC_REQUIRE(gradapt::dtype_of_v<bfloat16> == gradapt::dtype::bfloat16);
  STATIC_REQUIRE(std::is_same_v<gradapt::compute_t<half>, float>);
  STATIC_REQUIRE(std::is_same_v<gradapt::compute_t<double>, double>);
  STATIC_REQUIRE(gradapt::size_of(gradapt::dtype::bfloat16) == 2);
  REQUIRE(gradapt::name(gradapt::dtype::float16) == "float16");
}

}  // namespace gradapt_test_dtype

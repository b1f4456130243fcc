// The packed 16-bit conversions of gradapt::simd (backend/simd.hpp) against the scalar ones of
// core/dtype.hpp (detail::float_to_half_bits, float_to_bfloat16_bits, half_bits_to_float),
// bit for bit, in every path this machine can run: the integer lane path on 16-byte packs
// (SSE2), the same on 32-byte packs inside an AVX2 function, its out-of-line AVX2 form, F16C's
// vcvtps2ph, and the dispatching simd::store. Inputs: every binary16 value (round trip), every
// float exponent with mantissas around each rounding boundary (ties, tie ± 1 and 2 ulp, both
// signs, NaN payloads), the half-subnormal range in steps, and 10M random patterns; also
// under MXCSR FTZ/DAZ and round-toward-zero, which the conversions must ignore. Then the host
// unscale (fp16 and bf16 in place, fp16 into fp32 masters) against a scalar re-computation.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/precision/loss_scaler.hpp"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace gradapt_test_simd_half {

namespace simd = gradapt::simd;
using gradapt::bfloat16;
using gradapt::half;

namespace {

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

#if GRADAPT_SIMD_PACKS
std::uint16_t ref_bits(half, std::uint32_t x) {
  return gradapt::detail::float_to_half_bits(std::bit_cast<float>(x));
}
std::uint16_t ref_bits(bfloat16, std::uint32_t x) {
  return gradapt::detail::float_to_bfloat16_bits(std::bit_cast<float>(x));
}

/// Every float exponent (0 .. 255), both signs, mantissas around the rounding boundary of
/// every dropped-bit count a conversion can have: 13 .. 24 for binary16 (normals drop 13
/// bits, half subnormals up to 24), 16 for bfloat16. Around each multiple j·2^d: the multiple,
/// ±1, ±2 ulp, and the tie j·2^d + 2^(d-1) with ±1, ±2 ulp; j over a spread of values.
std::vector<float> boundary_inputs() {
  std::vector<float> v;
  const std::uint32_t js[] = {0,  1,  2,   3,   4,   5,   7,   8,   15,  16,   31,
                              63, 64, 100, 127, 128, 255, 256, 511, 512, 1000, 1023};
  for (std::uint32_t sign = 0; sign < 2; ++sign)
    for (std::uint32_t e = 0; e < 256; ++e)
      for (std::uint32_t d = 13; d <= 24; ++d)
        for (std::uint32_t j : js) {
          const std::uint64_t base = std::uint64_t{j} << d;
          const std::uint64_t tie = base + (std::uint64_t{1} << (d - 1));
          for (std::int64_t off = -2; off <= 2; ++off)
            for (std::uint64_t c : {base, tie}) {
              const std::int64_t m = static_cast<std::int64_t>(c) + off;
              if (m < 0 || m > 0x7fffff) continue;
              v.push_back(std::bit_cast<float>(sign << 31 | e << 23 | static_cast<std::uint32_t>(m)));
            }
        }
  return v;
}

/// |x| from 2^-26 up to 2^-14 (the half-subnormal range and its edges) in steps of 61 ulp,
/// both signs, plus the exact float value of every half subnormal.
std::vector<float> subnormal_inputs() {
  std::vector<float> v;
  for (std::uint32_t a = 0x32800000u; a <= 0x38800000u; a += 61) {
    v.push_back(std::bit_cast<float>(a));
    v.push_back(std::bit_cast<float>(a | 0x80000000u));
  }
  for (std::uint32_t m = 0; m < 0x400; ++m) {
    const float f = static_cast<float>(m) * 0x1p-24f;
    v.push_back(f);
    v.push_back(-f);
  }
  return v;
}

/// The float value of every binary16 bit pattern (exact, so each non-NaN one converts back to
/// itself).
std::vector<float> every_half() {
  std::vector<float> v(65536);
  for (std::uint32_t i = 0; i < 65536; ++i)
    v[i] = gradapt::detail::half_bits_to_float(static_cast<std::uint16_t>(i));
  return v;
}

std::vector<float> random_inputs(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) x = std::bit_cast<float>(static_cast<std::uint32_t>(splitmix(seed)));
  return v;
}

struct mismatch {
  std::size_t count = 0;
  std::uint32_t first_in = 0;
  std::uint16_t got = 0, want = 0;
};

/// Compares out[i] with the scalar conversion of in[i].
template <class T>
mismatch compare(const std::vector<float>& in, const std::vector<T>& out) {
  mismatch m;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(in[i]);
    const std::uint16_t want = ref_bits(T{}, x);
    if (out[i].bits != want) {
      if (m.count++ == 0) {
        m.first_in = x;
        m.got = out[i].bits;
        m.want = want;
      }
    }
  }
  return m;
}

/// Pads to a multiple of 8 lanes with zeros.
std::vector<float> padded(std::vector<float> v) {
  v.resize((v.size() + 7) / 8 * 8, 0.0f);
  return v;
}

/// 16-byte packs, integer lane path.
template <class T>
void convert_int16(const std::vector<float>& in, std::vector<T>& out) {
  using P = simd::pack<float, 4, 16>;
  for (std::size_t i = 0; i < in.size(); i += 4)
    simd::detail::store_16bit_int(out.data() + i, P::load(in.data() + i));
}
/// The native pack through the dispatching simd::store.
template <class T>
void convert_store(const std::vector<float>& in, std::vector<T>& out) {
  using P = simd::pack<float, simd::native_lanes<float>>;
  for (std::size_t i = 0; i < in.size(); i += P::size) simd::store(out.data() + i, P::load(in.data() + i));
}

#if GRADAPT_SIMD_AVX_ASM
bool cpu_avx2() { return __builtin_cpu_supports("avx2"); }
/// 32-byte packs in an AVX2 function: the integer path inlined.
template <class T>
__attribute__((target("avx2"))) void convert_int32(const std::vector<float>& in, std::vector<T>& out) {
  using P = simd::pack<float, 8, 32>;
  for (std::size_t i = 0; i < in.size(); i += 8) {
    const P v = P::load(in.data() + i);
    simd::detail::store_16bit_int(out.data() + i, v);
  }
}
/// 32-byte packs: the out-of-line integer fallback used on AVX2 CPUs without F16C.
template <class T>
__attribute__((target("avx2"))) void convert_int32_outofline(const std::vector<float>& in,
                                                             std::vector<T>& out) {
  using P = simd::pack<float, 8, 32>;
  for (std::size_t i = 0; i < in.size(); i += 8) {
    const P v = P::load(in.data() + i);
    simd::detail::store_16bit_int_avx2(out.data() + i, &v);
  }
}
/// 32-byte packs: F16C.
__attribute__((target("avx2"))) void convert_f16c(const std::vector<float>& in, std::vector<half>& out) {
  using P = simd::pack<float, 8, 32>;
  for (std::size_t i = 0; i < in.size(); i += 8)
    simd::detail::store_half_f16c(out.data() + i, P::load(in.data() + i));
}
/// 32-byte packs through the dispatching simd::store (F16C when the CPU has it).
template <class T>
__attribute__((target("avx2"))) void convert_store32(const std::vector<float>& in, std::vector<T>& out) {
  using P = simd::pack<float, 8, 32>;
  for (std::size_t i = 0; i < in.size(); i += 8) simd::store(out.data() + i, P::load(in.data() + i));
}
/// 32-byte 16-bit loads, bit patterns of the float lanes.
template <class T>
__attribute__((target("avx2"))) void load32(const std::vector<T>& in, std::vector<std::uint32_t>& out) {
  using P = simd::pack<float, 8, 32>;
  for (std::size_t i = 0; i < in.size(); i += 8) {
    const P v = simd::load_16bit<P>(in.data() + i);
    std::memcpy(out.data() + i, &v, sizeof v);
  }
}
#endif

/// Runs every conversion path this machine supports on `in` and checks each against the
/// scalar conversion. Returns the number of paths run.
template <class T>
int check_all_paths(const std::vector<float>& raw, const std::string& what) {
  const std::vector<float> in = padded(raw);
  std::vector<T> out(in.size());
  int paths = 0;
  auto check = [&](const char* path) {
    const mismatch m = compare(in, out);
    INFO(what << ", " << (sizeof(T) == 2 && std::is_same_v<T, half> ? "binary16" : "bfloat16") << ", path "
              << path << ": " << m.count << " mismatches; first input bits 0x" << std::hex << m.first_in
              << " gave 0x" << m.got << ", scalar 0x" << m.want);
    CHECK(m.count == 0);
    ++paths;
    std::fill(out.begin(), out.end(), T::from_bits(0x5555));
  };
  convert_int16(in, out);
  check("int, 16-byte packs");
  convert_store(in, out);
  check("simd::store, native packs");
#if GRADAPT_SIMD_AVX_ASM
  if (cpu_avx2()) {
    convert_int32(in, out);
    check("int, 32-byte packs (AVX2)");
    convert_int32_outofline(in, out);
    check("int, 32-byte packs, out of line (AVX2)");
    convert_store32(in, out);
    check("simd::store, 32-byte packs (AVX2, F16C when present)");
    if constexpr (std::is_same_v<T, half>) {
      if (simd::detail::cpu_has_f16c) {
        convert_f16c(in, out);
        check("F16C vcvtps2ph");
      }
    }
  }
#endif
  return paths;
}

template <class T>
void check_every_input_set() {
  std::vector<float> halves = every_half();
  int paths = check_all_paths<T>(halves, "every binary16 value");
  check_all_paths<T>(boundary_inputs(), "rounding boundaries of every exponent");
  check_all_paths<T>(subnormal_inputs(), "half-subnormal range");
  check_all_paths<T>(random_inputs(10'000'000, 0x5eed), "10M random patterns");
  REQUIRE(paths >= 2);
}
#endif  // GRADAPT_SIMD_PACKS

}  // namespace

TEST_CASE("the scalar binary16 conversion round-trips every non-NaN half and quiets NaNs", "[simd][dtype]") {
  // The reference itself, against properties that do not depend on it: exact round trip for
  // every half value, NaN kept NaN with the sign, the quiet bit set and the payload's top bits.
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const std::uint16_t back = gradapt::detail::float_to_half_bits(gradapt::detail::half_bits_to_float(h));
    const bool is_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
    INFO("half bits " << i);
    if (is_nan)
      REQUIRE(back == (h | 0x0200u));
    else
      REQUIRE(back == h);
  }
  // Ties to even, overflow and the subnormal edge, by value.
  CHECK(gradapt::detail::float_to_half_bits(65519.996f) == 0x7bffu);
  CHECK(gradapt::detail::float_to_half_bits(65520.0f) == 0x7c00u);
  CHECK(gradapt::detail::float_to_half_bits(-65520.0f) == 0xfc00u);
  CHECK(gradapt::detail::float_to_half_bits(0x1p-25f) == 0x0000u);                   // tie to even 0
  CHECK(gradapt::detail::float_to_half_bits(std::nextafter(0x1p-25f, 1.0f)) == 1u);  // just above the tie
  CHECK(gradapt::detail::float_to_half_bits(0x3p-25f) == 0x0002u);         // 1.5 · 2^-24: tie to even 2
  CHECK(gradapt::detail::float_to_half_bits(1.0f + 0x1p-11f) == 0x3c00u);  // tie to even 1.0
  CHECK(gradapt::detail::float_to_half_bits(1.0f + 0x3p-11f) == 0x3c02u);  // tie to even up
  CHECK(gradapt::detail::float_to_half_bits(-0.0f) == 0x8000u);
}

#if GRADAPT_SIMD_PACKS
TEST_CASE("packed binary16 stores equal the scalar conversion bit for bit in every path", "[simd][dtype]") {
  check_every_input_set<half>();
}

TEST_CASE("packed bfloat16 stores equal the scalar conversion bit for bit in every path", "[simd][dtype]") {
  check_every_input_set<bfloat16>();
}

#if defined(__SSE__)
TEST_CASE("packed 16-bit stores ignore MXCSR: FTZ, DAZ and round toward zero", "[simd][dtype]") {
  std::vector<float> in = boundary_inputs();
  const std::vector<float> sub = subnormal_inputs();
  in.insert(in.end(), sub.begin(), sub.end());
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u | 0x6000u);  // FTZ, DAZ, RC = toward zero
  check_all_paths<half>(in, "MXCSR FTZ+DAZ+RZ");
  check_all_paths<bfloat16>(in, "MXCSR FTZ+DAZ+RZ");
  _mm_setcsr(saved);
}
#endif

TEST_CASE("16-bit loads of every bit pattern equal the scalar widening in every width", "[simd][dtype]") {
  std::vector<half> h(65536);
  std::vector<bfloat16> b(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    h[i] = half::from_bits(static_cast<std::uint16_t>(i));
    b[i] = bfloat16::from_bits(static_cast<std::uint16_t>(i));
  }
  auto check = [&](const std::vector<std::uint32_t>& hb, const std::vector<std::uint32_t>& bb,
                   const char* path) {
    std::size_t bad = 0;
    for (std::uint32_t i = 0; i < 65536; ++i) {
      bad += hb[i] != std::bit_cast<std::uint32_t>(static_cast<float>(h[i]));
      bad += bb[i] != std::bit_cast<std::uint32_t>(static_cast<float>(b[i]));
    }
    INFO("path " << path);
    CHECK(bad == 0);
  };
  std::vector<std::uint32_t> hb(65536), bb(65536);
  using P4 = simd::pack<float, 4, 16>;
  for (std::size_t i = 0; i < 65536; i += 4) {
    const P4 x = simd::load_16bit<P4>(h.data() + i);
    const P4 y = simd::load_16bit<P4>(b.data() + i);
    std::memcpy(hb.data() + i, &x, sizeof x);
    std::memcpy(bb.data() + i, &y, sizeof y);
  }
  check(hb, bb, "16-byte packs");
#if GRADAPT_SIMD_AVX_ASM
  if (cpu_avx2()) {
    load32(h, hb);
    load32(b, bb);
    check(hb, bb, "32-byte packs (AVX2)");
  }
#endif
}
#endif  // GRADAPT_SIMD_PACKS

namespace {

/// Gradient values for the end-to-end checks: ordinary magnitudes, values that overflow fp16
/// once multiplied by 2, subnormal results, ties after the multiply, inf and NaN.
template <class T>
std::vector<T> grads(std::size_t n, std::uint64_t seed) {
  std::vector<T> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = splitmix(seed);
    g[i] = T::from_bits(static_cast<std::uint16_t>(r));  // every 16-bit pattern, specials included
  }
  return g;
}

/// The scalar re-computation of one unscale: the stored bits and whether they are non-finite
/// (exponent all ones), decided from the bits, not from the library's own predicate.
template <class T>
std::uint16_t unscale_ref(T g, float inv, bool& nonfinite) {
  const T r(static_cast<float>(g) * inv);
  const std::uint16_t exp_mask = std::is_same_v<T, half> ? 0x7c00u : 0x7f80u;
  nonfinite = (r.bits & exp_mask) == exp_mask;
  return r.bits;
}

template <class T>
void check_inplace(int threads, float inv) {
  const std::vector<std::size_t> sizes{1, 7, 8, 9, 31, 1000, 4099, 70001};
  std::vector<std::vector<T>> data, ref;
  std::vector<gradapt::tensor_view<T>> views;
  std::vector<double> per(sizes.size()), per_ref(sizes.size());
  double total_ref = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    data.push_back(grads<T>(sizes[t], 17 + t));
    ref.push_back(data.back());
    for (auto& x : ref.back()) {
      bool nf;
      x = T::from_bits(unscale_ref(x, inv, nf));
      per_ref[t] += nf;
    }
    total_ref += per_ref[t];
  }
  for (auto& d : data)
    views.push_back(gradapt::tensor_view<T>::vector(d.data(), static_cast<std::int64_t>(d.size())));
  const double total = gradapt::unscale_count_nonfinite(gradapt::host{.threads = threads}, views, inv, per);
  INFO("threads " << threads << ", inv_scale " << inv);
  CHECK(total == total_ref);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    CHECK(per[t] == per_ref[t]);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < sizes[t]; ++i) bad += data[t][i].bits != ref[t][i].bits;
    INFO("tensor " << t << " of " << sizes[t] << " elements");
    CHECK(bad == 0);
  }
}

void check_master(int threads, float inv) {
  const std::vector<std::size_t> sizes{3, 8, 17, 4096, 70003};
  std::vector<std::vector<half>> g;
  std::vector<std::vector<float>> m;
  std::vector<gradapt::tensor_view<half>> gv;
  std::vector<gradapt::tensor_view<float>> mv;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    g.push_back(grads<half>(sizes[t], 91 + t));
    m.emplace_back(sizes[t], 0.0f);
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    gv.push_back(gradapt::tensor_view<half>::vector(g[t].data(), static_cast<std::int64_t>(sizes[t])));
    mv.push_back(gradapt::tensor_view<float>::vector(m[t].data(), static_cast<std::int64_t>(sizes[t])));
  }
  const double total = gradapt::unscale_count_nonfinite(gradapt::host{.threads = threads}, gv, mv, inv);
  double total_ref = 0;
  std::size_t bad = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      const float want = static_cast<float>(g[t][i]) * inv;
      total_ref += (std::bit_cast<std::uint32_t>(want) & 0x7f800000u) == 0x7f800000u;
      bad += std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(m[t][i]);
    }
  INFO("threads " << threads << ", inv_scale " << inv);
  CHECK(bad == 0);
  CHECK(total == total_ref);
}

}  // namespace

TEST_CASE("host unscale of fp16 and bf16 gradients equals the scalar re-computation bit for bit",
          "[loss_scale][simd]") {
  // 1/S = 2 overflows large fp16 values, 2^-7 makes subnormals, 0.75 makes ties and odd
  // roundings, 1 is the identity (NaN inputs come out quieted, as the scalar store does).
  for (int threads : {1, 2})
    for (float inv : {2.0f, 0x1p-7f, 0.75f, 1.0f}) {
      check_inplace<half>(threads, inv);
      check_inplace<bfloat16>(threads, inv);
      check_master(threads, inv);
    }
}

}  // namespace gradapt_test_simd_half

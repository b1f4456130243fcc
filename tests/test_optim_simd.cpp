// gradapt::simd (backend/simd.hpp): every pack operation lane by lane against the scalar
// operation it stands for, bit for bit, on ordinary values and on the special ones (±0, ±inf,
// NaN, subnormals, the largest and smallest normals); the 16-bit loads against gradapt::load on
// all 65536 bit patterns; and the host backend's dispatch (packs only for functors that opt in).
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/backend/simd.hpp"

namespace gradapt_test_optim_simd {

namespace simd = gradapt::simd;

namespace {

template <class T>
auto bits(T v) {
  if constexpr (sizeof(T) == 8)
    return std::bit_cast<std::uint64_t>(v);
  else
    return std::bit_cast<std::uint32_t>(v);
}

/// Values that exercise every corner of IEEE arithmetic, then random ones.
template <class T>
std::vector<T> interesting(std::size_t random_count) {
  using L = std::numeric_limits<T>;
  std::vector<T> v{T(0),
                   -T(0),
                   T(1),
                   T(-1),
                   T(0.5),
                   T(3),
                   L::infinity(),
                   -L::infinity(),
                   L::quiet_NaN(),
                   -L::quiet_NaN(),
                   L::min(),
                   -L::min(),
                   L::denorm_min(),
                   -L::denorm_min(),
                   L::min() / 3,
                   L::max(),
                   -L::max(),
                   L::epsilon(),
                   T(1e-30),
                   T(-7.25),
                   T(1e30),
                   T(2) / 3};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(-4, 4);
  std::uniform_int_distribution<int> e(-40, 40);
  for (std::size_t i = 0; i < random_count; ++i) v.push_back(static_cast<T>(std::ldexp(u(rng), e(rng))));
  while (v.size() % 8) v.push_back(T(1.5));
  return v;
}

}  // namespace

#if GRADAPT_SIMD_PACKS

TEMPLATE_TEST_CASE("pack arithmetic equals the scalar operations lane by lane", "[simd]", float, double) {
  using T = TestType;
  constexpr std::size_t W = simd::native_lanes<T>;
  using P = simd::pack<T, W>;
  using P8 = simd::pack<T, 8>;  // several native vectors per pack
  const auto a = interesting<T>(200);
  auto b = a;
  std::rotate(b.begin(), b.begin() + 5, b.end());
  const auto check = [&]<class Q>(Q) {
    constexpr std::size_t N = Q::size;
    for (std::size_t i = 0; i + N <= a.size(); i += N) {
      const Q x = Q::load(a.data() + i), y = Q::load(b.data() + i);
      const Q sum = x + y, dif = x - y, pro = x * y, quo = x / y, neg = -x, sq = simd::sqrt(x),
              ab = simd::abs(x);
      const Q mn = simd::min(x, y), mx = simd::max(x, y), sel = simd::select(x < y, x, y);
      const Q bx = x * T(0.75) + T(2), by = T(2) - y / T(3);
      const auto w = simd::widen(x);
      const auto lt = x<y, le = x <= y, eq = x == y, ne = x != y, gt = x> y, ge = x >= y;
      for (std::size_t l = 0; l < N; ++l) {
        const T s = a[i + l], t = b[i + l];
        INFO("lanes " << N << ", x " << s << ", y " << t);
        REQUIRE(bits(sum[l]) == bits(T(s + t)));
        REQUIRE(bits(dif[l]) == bits(T(s - t)));
        REQUIRE(bits(pro[l]) == bits(T(s * t)));
        REQUIRE(bits(quo[l]) == bits(T(s / t)));
        REQUIRE(bits(neg[l]) == bits(T(-s)));
        REQUIRE(bits(sq[l]) == bits(simd::sqrt(s)));
        REQUIRE(bits(ab[l]) == bits(simd::abs(s)));
        REQUIRE(bits(mn[l]) == bits(simd::min(s, t)));
        REQUIRE(bits(mx[l]) == bits(simd::max(s, t)));
        REQUIRE(bits(sel[l]) == bits(simd::select(s < t, s, t)));
        REQUIRE(bits(bx[l]) == bits(T(s * T(0.75) + T(2))));
        REQUIRE(bits(by[l]) == bits(T(T(2) - t / T(3))));
        REQUIRE(bits(w[l]) == bits(simd::widen(s)));
        REQUIRE(lt[l] == (s < t));
        REQUIRE(le[l] == (s <= t));
        REQUIRE(eq[l] == (s == t));
        REQUIRE(ne[l] == (s != t));
        REQUIRE(gt[l] == (s > t));
        REQUIRE(ge[l] == (s >= t));
        REQUIRE((lt | eq)[l] == (s <= t));
        REQUIRE((le & ne)[l] == (s < t));
        REQUIRE((!lt)[l] == !(s < t));
      }
    }
  };
  check(P{});
  check(P8{});
  // Broadcast keeps -0 and NaN payloads; store writes exactly the lanes.
  const P z(-T(0));
  T out[W];
  z.store(out);
  for (T o : out) REQUIRE(bits(o) == bits(-T(0)));
}

#if GRADAPT_SIMD_AVX_ASM
namespace {
/// The 32-byte packs of the host's run-time AVX2 path, exercised inside an AVX2 function (the
/// only place they may live in a translation unit compiled without AVX): every operation's
/// lanes written out for the scalar comparison below.
template <class T>
__attribute__((target("avx2"))) void avx2_ops(const T* a, const T* b, std::size_t n, T* out) {
  using Q = simd::pack<T, 32 / sizeof(T), 32>;
  constexpr std::size_t N = Q::size;
  for (std::size_t i = 0; i + N <= n; i += N) {
    const Q x = Q::load(a + i), y = Q::load(b + i);
    T* o = out + 8 * i;
    (x + y).store(o), (x - y).store(o + N), (x * y).store(o + 2 * N), (x / y).store(o + 3 * N);
    simd::sqrt(x).store(o + 4 * N), simd::abs(x).store(o + 5 * N), simd::max(x, y).store(o + 6 * N);
    if constexpr (std::is_same_v<T, float>) {
      const auto w = simd::widen(x);
      double wd[N];
      w.store(wd);
      for (std::size_t l = 0; l < N; ++l)
        o[7 * N + l] = static_cast<T>(wd[l] == static_cast<double>(a[i + l]));
    }
  }
}
}  // namespace

TEMPLATE_TEST_CASE("32-byte packs (run-time AVX2 path) equal the scalar operations", "[simd][avx2]", float,
                   double) {
  if (!__builtin_cpu_supports("avx2")) return;  // the host never takes this path without AVX2
  using T = TestType;
  const auto a = interesting<T>(300);
  auto b = a;
  std::rotate(b.begin(), b.begin() + 3, b.end());
  std::vector<T> out(8 * a.size());
  avx2_ops(a.data(), b.data(), a.size(), out.data());
  constexpr std::size_t N = 32 / sizeof(T);
  for (std::size_t i = 0; i + N <= a.size(); i += N) {
    const T* o = out.data() + 8 * i;
    for (std::size_t l = 0; l < N; ++l) {
      const T s = a[i + l], t = b[i + l];
      INFO("x " << s << ", y " << t);
      REQUIRE(bits(o[l]) == bits(T(s + t)));
      REQUIRE(bits(o[N + l]) == bits(T(s - t)));
      REQUIRE(bits(o[2 * N + l]) == bits(T(s * t)));
      REQUIRE(bits(o[3 * N + l]) == bits(T(s / t)));
      REQUIRE(bits(o[4 * N + l]) == bits(simd::sqrt(s)));
      REQUIRE(bits(o[5 * N + l]) == bits(simd::abs(s)));
      REQUIRE(bits(o[6 * N + l]) == bits(simd::max(s, t)));
      if constexpr (std::is_same_v<T, float>) {
        if (s == s) REQUIRE(o[7 * N + l] == T(1));  // widen is exact
      }
    }
  }
}
#endif

TEST_CASE("16-bit loads into packs equal gradapt::load for every bit pattern", "[simd][dtype]") {
  std::vector<gradapt::half> h(65536);
  std::vector<gradapt::bfloat16> bf(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    h[i] = gradapt::half::from_bits(static_cast<std::uint16_t>(i));
    bf[i] = gradapt::bfloat16::from_bits(static_cast<std::uint16_t>(i));
  }
  for (std::size_t i = 0; i < 65536; i += 8) {
    const auto ph = simd::load<8>(h.data() + i);
    const auto pb = simd::load<8>(bf.data() + i);
    for (std::size_t l = 0; l < 8; ++l) {
      INFO("bits " << i + l);
      REQUIRE(bits(ph[l]) == bits(gradapt::load(h[i + l])));
      REQUIRE(bits(pb[l]) == bits(gradapt::load(bf[i + l])));
    }
    // Stores round exactly like gradapt::store.
    gradapt::half hs[8];
    gradapt::bfloat16 bs[8];
    simd::store(hs, ph);
    simd::store(bs, pb);
    for (std::size_t l = 0; l < 8; ++l) {
      REQUIRE(hs[l].bits == gradapt::half(ph[l]).bits);
      REQUIRE(bs[l].bits == gradapt::bfloat16(pb[l]).bits);
    }
  }
}

#endif  // GRADAPT_SIMD_PACKS

namespace {

/// y = sqrt(|x|) / (y + 1): vectorizable (opts in), counts its pack calls.
struct vec_functor {
  static constexpr bool vectorizable = true;
  int* pack_calls;
  template <class V>
  void operator()(V& y, V& x) const {
    if constexpr (simd::is_pack_v<V>) ++*pack_calls;
    y = simd::sqrt(simd::abs(x)) / (y + 1);
  }
};

/// The same math, not opted in.
struct plain_functor {
  template <class V>
  void operator()(V& y, V& x) const {
    y = simd::sqrt(simd::abs(x)) / (y + 1);
  }
};

/// Reducing form: returns x² widened, as terms<1>.
struct vec_reduce {
  static constexpr bool vectorizable = true;
  template <class V>
  simd::terms_t<V, 1> operator()(gradapt::tensor_index, V& y, const V& x) const {
    y = y + x;
    simd::terms_t<V, 1> r;
    const auto w = simd::widen(x);
    r[0] = w * w;
    return r;
  }
};

}  // namespace

TEST_CASE("host backend calls opted-in functors with packs, others with scalars; same bits", "[simd][host]") {
  for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 4099u, 70001u, 300007u}) {
    INFO("n " << n);
    std::vector<float> x(n), y1(n), y2(n);
    std::mt19937 rng(static_cast<unsigned>(n));
    std::normal_distribution<float> d(0, 3);
    for (std::size_t i = 0; i < n; ++i) x[i] = d(rng), y1[i] = y2[i] = d(rng);
    int pack_calls = 0;
    for (int threads : {1, 2}) {
      gradapt::host h{.threads = threads};
      h.apply(vec_functor{&pack_calls}, gradapt::host_view(y1), gradapt::host_view(x));
      h.apply(plain_functor{}, gradapt::host_view(y2), gradapt::host_view(x));
      REQUIRE((n == 0 || std::memcmp(y1.data(), y2.data(), n * sizeof(float)) == 0));
    }
#if GRADAPT_SIMD_PACKS
    // Packs are one register: native_lanes wide, or 8 floats on the run-time AVX2 path.
    if (n < simd::native_lanes<float>) REQUIRE(pack_calls == 0);
    if (n >= 8) REQUIRE(pack_calls > 0);
#else
    REQUIRE(pack_calls == 0);
#endif
    // The fused reduction gives reduce(sum_squares)'s bits whichever path runs.
    gradapt::host h{.threads = 2};
    std::vector<gradapt::tensor_view<float>> ys{gradapt::host_view(y1)};
    std::vector<gradapt::tensor_view<const float>> xs{gradapt::host_view(std::as_const(x))};
    std::vector<double> per(1);
    const double s = h.apply_reduce_list(vec_reduce{}, std::span<double>(per), ys, xs)[0];
    REQUIRE(bits(s) == bits(h.reduce(gradapt::reduction::sum_squares, xs, std::span<double>{})));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(bits(y1[i]) == bits(y2[i] + x[i]));
  }
}

}  // namespace gradapt_test_optim_simd

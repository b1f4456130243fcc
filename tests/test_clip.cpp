// Global-norm clipping (optim/clip.hpp).
//
// References:
//  - PyTorch torch.nn.utils.clip_grad_norm_ (tests/data/loss_scaler/torch_clip.txt, written by
//    tests/data/make_loss_scaler_refs.py): total norm and clipped gradients for float32 and
//    float64 lists, compared with eps = 1e-6 (PyTorch's constant);
//  - a long double re-computation of the norm and of the clipped values;
//  - exact cases: values that are multiples of 1/8 have exact sums of squares, so sharded and
//    serial norms, and the clipped values, agree bit for bit.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/optim/clip.hpp"
#include "peer_data.hpp"
#include "rank_check.hpp"

namespace gradapt_test_clip {

using Catch::Matchers::Contains;
using gradapt::bfloat16;
using gradapt::half;
using gradapt::tensor_view;

namespace {

template <class T>
struct grad_set {
  std::vector<std::vector<T>> data;
  std::vector<tensor_view<T>> views;
  explicit grad_set(std::vector<std::vector<T>> d) : data(std::move(d)) {
    for (auto& v : data) views.push_back(gradapt::host_view(v));
  }
  grad_set(const grad_set& o) : grad_set(o.data) {}
};

using exact::make;

template <class T>
long double ld(T v) {
  return static_cast<long double>(gradapt::load(v));
}

/// Random gradients (normal, sd 0.3) in tensors of the given sizes, rounded into T.
template <class T>
grad_set<T> random_grads(const std::vector<std::size_t>& sizes, std::uint64_t seed, double sd = 0.3) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<std::vector<T>> d;
  for (auto n : sizes) {
    std::vector<T> v(n);
    for (auto& x : v) x = make<T>(nd(rng));
    d.push_back(std::move(v));
  }
  return grad_set<T>(std::move(d));
}

template <class T>
long double ld_norm(const grad_set<T>& g) {
  long double s = 0;
  for (const auto& v : g.data)
    for (auto x : v) s += ld(x) * ld(x);
  return std::sqrt(s);
}

template <class T>
bool same_bits(const grad_set<T>& a, const grad_set<T>& b) {
  for (std::size_t t = 0; t < a.data.size(); ++t)
    for (std::size_t i = 0; i < a.data[t].size(); ++i)
      if (std::memcmp(&a.data[t][i], &b.data[t][i], sizeof(T)) != 0) return false;
  return true;
}

/// Units in the last place of float/half/bfloat16 (relative to the compute-type value).
template <class T>
long double ulp_of(long double v) {
  const int digits = std::is_same_v<T, double>  ? 53
                     : std::is_same_v<T, float> ? 24
                     : std::is_same_v<T, half>  ? 11
                                                : 8;
  // Spacing of the subnormals: the ulp never falls below it.
  const int min_exp = std::is_same_v<T, double>  ? -1074
                      : std::is_same_v<T, float> ? -149
                      : std::is_same_v<T, half>  ? -24
                                                 : -133;
  int e = 0;
  std::frexp(static_cast<double>(v), &e);
  return v == 0 ? std::ldexp(1.0L, min_exp)
                : std::max(std::ldexp(1.0L, e - digits), std::ldexp(1.0L, min_exp));
}

struct torch_case {
  std::string name, dtype;
  double max_norm = 0, norm = 0;
  std::vector<std::vector<std::uint64_t>> in, out;
};

std::vector<torch_case> read_torch_cases() {
  const std::string path = gradapt_test::test_data_path("loss_scaler/torch_clip.txt");
  std::ifstream f(path);
  if (!f) FAIL("cannot open " << path);
  std::vector<torch_case> cases;
  std::string tag;
  while (f >> tag) {
    REQUIRE(tag == "case");
    torch_case c;
    std::string max_norm, norm;
    std::size_t tensors = 0;
    f >> c.name >> c.dtype >> max_norm >> tensors >> norm;
    c.max_norm = std::strtod(max_norm.c_str(), nullptr);
    c.norm = std::strtod(norm.c_str(), nullptr);
    for (std::size_t t = 0; t < tensors; ++t) {
      std::string tt;
      std::size_t n = 0;
      f >> tt >> n;
      REQUIRE(tt == "tensor");
      std::vector<std::uint64_t> a(n), b(n);
      for (std::size_t i = 0; i < n; ++i) {
        std::string x, y;
        f >> x >> y;
        a[i] = std::stoull(x, nullptr, 16);
        b[i] = std::stoull(y, nullptr, 16);
      }
      c.in.push_back(std::move(a));
      c.out.push_back(std::move(b));
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

template <class T>
T from_bits(std::uint64_t b) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<float>(static_cast<std::uint32_t>(b));
  else
    return std::bit_cast<double>(b);
}

template <class T>
void check_torch_case(const torch_case& c) {
  std::vector<std::vector<T>> d;
  for (const auto& t : c.in) {
    std::vector<T> v;
    for (auto b : t) v.push_back(from_bits<T>(b));
    d.push_back(std::move(v));
  }
  grad_set<T> g(std::move(d));
  const grad_set<T> orig = g;
  const double norm =
      gradapt::clip_by_global_norm(gradapt::host{.threads = 2}, g.views, c.max_norm, {.eps = 1e-6});
  INFO(c.name << ": norm " << norm << " vs torch " << c.norm << ", max_norm " << c.max_norm);
  // PyTorch accumulates a float32 list in float32; gradapt in double (closer to the truth).
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  REQUIRE(std::fabs(norm - c.norm) <= tol * c.norm);
  REQUIRE(std::fabs(static_cast<long double>(norm) - ld_norm(orig)) <= 1e-15L * ld_norm(orig));
  for (std::size_t t = 0; t < g.data.size(); ++t)
    for (std::size_t i = 0; i < g.data[t].size(); ++i) {
      const T want = from_bits<T>(c.out[t][i]);
      const T got = g.data[t][i];
      INFO("tensor " << t << " element " << i << ": " << got << " vs torch " << want);
      if (c.name.rfind("noclip", 0) == 0 || c.name.rfind("zero", 0) == 0) {
        REQUIRE(std::bit_cast<std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>(got) ==
                c.out[t][i]);
      } else {
        // The factors differ in their last bits (PyTorch: float32 norm and division).
        REQUIRE(std::fabs(static_cast<long double>(got) - static_cast<long double>(want)) <=
                4 * ulp_of<T>(static_cast<long double>(want)));
      }
    }
}

}  // namespace

TEST_CASE("clip: norm and clipped gradients match torch.nn.utils.clip_grad_norm_ (eps = 1e-6)",
          "[clip][torch]") {
  const auto cases = read_torch_cases();
  REQUIRE(cases.size() == 10);
  for (const auto& c : cases) {
    if (c.dtype == "float32")
      check_torch_case<float>(c);
    else
      check_torch_case<double>(c);
  }
}

TEMPLATE_TEST_CASE("clip: against a long double re-computation, every element type", "[clip]", float, double,
                   half, bfloat16) {
  const std::vector<std::size_t> sizes = {0, 1, 17, 4096, 8193, 130, 0, 200003};
  for (double rel : {0.01, 0.5, 0.999}) {
    grad_set<TestType> g = random_grads<TestType>(sizes, 42);
    const grad_set<TestType> orig = g;
    const long double true_norm = ld_norm(orig);
    const double max_norm = static_cast<double>(true_norm) * rel;
    const double norm = gradapt::clip_by_global_norm(gradapt::host{.threads = 2}, g.views, max_norm);
    INFO("rel " << rel << ": norm " << norm << " vs " << static_cast<double>(true_norm));
    REQUIRE(std::fabs(static_cast<long double>(norm) - true_norm) <= 1e-14L * true_norm);
    // Each element: x * f with f = max_norm / norm rounded to the compute type, one rounding.
    const long double f = static_cast<long double>(max_norm) / static_cast<long double>(norm);
    std::size_t wrong = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        const long double want = ld(orig.data[t][i]) * f;
        // float factor (1/2 ulp of float) then one rounding into T (1/2 ulp of T), plus slack.
        const long double err = std::fabs(ld(g.data[t][i]) - want);
        const long double factor_rounding = std::is_same_v<TestType, double> ? 0x1p-53L : 0x1p-24L;
        const long double bound =
            ulp_of<TestType>(want) / 2 + std::fabs(want) * factor_rounding * 1.01L + 1e-40L;
        wrong += err > bound;
      }
    REQUIRE(wrong == 0);
    // The clipped gradient has norm max_norm (up to the element rounding).
    const long double after = ld_norm(g);
    const long double tol = std::is_same_v<TestType, double>  ? 1e-12L
                            : std::is_same_v<TestType, float> ? 1e-6L
                                                              : 1e-2L;
    REQUIRE(std::fabs(after - static_cast<long double>(max_norm)) <=
            tol * static_cast<long double>(max_norm));
  }
}

TEST_CASE("clip: no clipping when the norm is within max_norm; bitwise thread-count independence", "[clip]") {
  const std::vector<std::size_t> sizes = {5, 300000, 7, 131073};
  const grad_set<float> orig = random_grads<float>(sizes, 3);
  const double n0 = static_cast<double>(ld_norm(orig));
  for (double m : {n0 * 1.0001, n0 * 10, static_cast<double>(INFINITY)}) {
    grad_set<float> g = orig;
    const double norm = gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, g.views, m);
    REQUIRE(same_bits(g, orig));
    REQUIRE(std::fabs(norm - n0) <= 1e-14 * n0);
  }
  grad_set<float> a = orig, b = orig;
  const double na = gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, a.views, n0 / 3);
  const double nb = gradapt::clip_by_global_norm(gradapt::host{.threads = 2}, b.views, n0 / 3);
  REQUIRE(std::bit_cast<std::uint64_t>(na) == std::bit_cast<std::uint64_t>(nb));
  REQUIRE(same_bits(a, b));
  REQUIRE(gradapt::global_norm(gradapt::host{}, a.views) <= n0 / 3 * (1 + 1e-6));
}

TEST_CASE("clip: corner cases (max_norm 0, zero gradient, empty list, inf and NaN)", "[clip]") {
  const gradapt::host h{.threads = 1};
  SECTION("max_norm = 0 zeroes a non-zero gradient") {
    grad_set<float> g({{1.5f, -2.0f}, {}, {0.25f}});
    REQUIRE(gradapt::clip_by_global_norm(h, g.views, 0.0) == std::sqrt(1.5 * 1.5 + 4.0 + 0.0625));
    for (const auto& v : g.data)
      for (float x : v) REQUIRE(x == 0.0f);
  }
  SECTION("a zero gradient stays zero with any max_norm, and reports 0") {
    for (double m : {0.0, 1.0}) {
      grad_set<double> g({{0.0, 0.0}, {0.0}});
      REQUIRE(gradapt::clip_by_global_norm(h, g.views, m) == 0.0);
      REQUIRE(gradapt::clip_by_global_norm(h, g.views, m, {.eps = 1e-6}) == 0.0);
      for (const auto& v : g.data)
        for (double x : v) REQUIRE(std::bit_cast<std::uint64_t>(x) == 0);
    }
  }
  SECTION("an empty list has norm 0") {
    const std::vector<tensor_view<float>> none;
    REQUIRE(gradapt::clip_by_global_norm(h, none, 1.0) == 0.0);
    grad_set<half> empties({{}, {}});
    REQUIRE(gradapt::clip_by_global_norm(h, empties.views, 0.0) == 0.0);
  }
  SECTION("inf or NaN: gradients untouched, the norm returned; or an error naming the tensor") {
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      grad_set<float> g({{1.0f, 2.0f}, {3.0f, bad, 5.0f}, {6.0f}});
      const grad_set<float> orig = g;
      const double norm = gradapt::clip_by_global_norm(h, g.views, 0.1);
      REQUIRE_FALSE(std::isfinite(norm));
      REQUIRE(std::isnan(bad) == std::isnan(norm));
      REQUIRE(same_bits(g, orig));
      REQUIRE_THROWS_WITH(
          gradapt::clip_by_global_norm(h, g.views, 0.1, {.error_if_nonfinite = true}),
          Contains("tensor 1 of 3 holds 1 inf/NaN element(s)") && Contains("error_if_nonfinite"));
      REQUIRE(same_bits(g, orig));
    }
    // A double sum of squares can overflow with every element finite.
    grad_set<double> big(std::vector<std::vector<double>>{{1e200, 1e200}});
    REQUIRE(std::isinf(gradapt::clip_by_global_norm(h, big.views, 1.0)));
    REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(h, big.views, 1.0, {.error_if_nonfinite = true}),
                        Contains("overflows double"));
  }
  SECTION("invalid arguments") {
    grad_set<float> g(std::vector<std::vector<float>>{{1.0f}});
    REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(h, g.views, -1.0), Contains("max_norm is -1"));
    REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(h, g.views, NAN), Contains("max_norm is nan"));
    REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(h, g.views, 1.0, {.eps = -1e-6}),
                        Contains("eps is -1e-06"));
    REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(h, g.views, 1.0, {.eps = INFINITY}),
                        Contains("eps is inf"));
  }
  SECTION("clip_factor") {
    REQUIRE(gradapt::clip_factor(2.0, 1.0) == 0.5);
    REQUIRE(gradapt::clip_factor(0.5, 1.0) == 1.0);
    REQUIRE(gradapt::clip_factor(1.0, 1.0) == 1.0);
    REQUIRE(gradapt::clip_factor(1.0, 1.0, 1e-6) ==
            1.0 / (1.0 + 1e-6));  // PyTorch's rule clips at the boundary
    REQUIRE(gradapt::clip_factor(0.0, 0.0) == 1.0);
    REQUIRE(gradapt::clip_factor(3.0, 0.0) == 0.0);
    REQUIRE(gradapt::clip_factor(INFINITY, 1.0) == 1.0);
    REQUIRE(gradapt::clip_factor(NAN, 1.0) == 1.0);
  }
}

TEST_CASE("clip: sharded form over threads ranks equals the serial clip of the whole list",
          "[clip][threads]") {
  // Values k/8: all sums of squares are exact, so the rank-order sum equals the serial sum.
  const auto value = [](std::size_t t, std::size_t i) {
    return static_cast<double>(static_cast<int>((t * 31 + i * 7) % 41) - 20) / 8.0;
  };
  for (int n = 1; n <= 8; ++n) {
    const std::size_t tensors = 3 * static_cast<std::size_t>(n) + 1;
    std::vector<std::vector<float>> all(tensors);
    for (std::size_t t = 0; t < tensors; ++t)
      for (std::size_t i = 0; i < 10 + 13 * t; ++i) all[t].push_back(static_cast<float>(value(t, i)));
    grad_set<float> serial(all);
    const double serial_norm = gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, serial.views, 3.0);
    REQUIRE(serial_norm > 3.0);
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& comm) {
      // Rank r owns tensors r, r + n, r + 2n, ... (a disjoint shard).
      std::vector<std::vector<float>> mine;
      std::vector<std::size_t> ids;
      for (std::size_t t = static_cast<std::size_t>(comm.rank()); t < tensors;
           t += static_cast<std::size_t>(n)) {
        mine.push_back(all[t]);
        ids.push_back(t);
      }
      grad_set<float> g(mine);
      const double norm = gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, g.views, 3.0);
      RANK_REQUIRE(std::bit_cast<std::uint64_t>(norm) == std::bit_cast<std::uint64_t>(serial_norm));
      for (std::size_t k = 0; k < ids.size(); ++k)
        RANK_REQUIRE(
            std::memcmp(g.data[k].data(), serial.data[ids[k]].data(), g.data[k].size() * sizeof(float)) == 0);
    });
  }
  // Invalid arguments on one rank: every rank throws, none hangs.
  gradapt::comm::run_threads(3, [&](gradapt::comm::threads& comm) {
    std::vector<float> v(4, 1.0f);
    std::vector<tensor_view<float>> views{gradapt::host_view(v)};
    const double m = comm.rank() == 2 ? -1.0 : 1.0;
    if (comm.rank() == 2)
      RANK_REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, views, m),
                               Contains("max_norm is -1"));
    else
      RANK_REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, views, m),
                               Contains("1 other rank(s) passed invalid arguments"));
    // A NaN on one rank: every rank gets the NaN norm, and with error_if_nonfinite every rank
    // throws, saying where the NaN is.
    if (comm.rank() == 1) v[2] = NAN;
    const double norm = gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, views, 1.0);
    RANK_REQUIRE(std::isnan(norm));
    if (comm.rank() == 1)
      RANK_REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, views, 1.0,
                                                            {.error_if_nonfinite = true}),
                               Contains("tensor 0 of 1 holds 1 inf/NaN"));
    else
      RANK_REQUIRE_THROWS_WITH(gradapt::clip_by_global_norm(gradapt::host{.threads = 1}, comm, views, 1.0,
                                                            {.error_if_nonfinite = true}),
                               Contains("the local part is finite (another rank's is not)"));
  });
}

}  // namespace gradapt_test_clip

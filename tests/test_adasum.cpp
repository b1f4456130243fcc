// Adasum (gradapt/combine/adasum.hpp) on the threads communicator with 1 to 8 ranks.
//
// References written here, independently of the library's schedule:
//  - `serial`: the binary tree ((r0 (+) r1) (+) (r2 (+) r3)) ... with the fold of ranks beyond
//    the largest power of two, in the library's float/double scheme: per-tensor dot products
//    summed as a halving tree over 2^depth pieces (the backend's `dot` on each piece, the only
//    library code it uses), coefficients in double, element math in the compute type. The
//    distributed result must equal it bit for bit.
//  - `ld_tree`: the same tree in long double with whole-tensor dot products and no rounding;
//    results must agree within the rounding of the element type.
//  - closed forms: orthogonal inputs sum, equal inputs stay, parallel inputs average (a tree
//    of pairwise means), zero vectors are the identity.
#include "adasum_fixtures.hpp"

namespace gradapt_test_adasum {

using namespace adasum_test;

TEMPLATE_TEST_CASE("adasum: distributed result equals the serial tree bit for bit", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  const auto all_shapes = shapes();
  for (int n = 1; n <= 8; ++n) {
    for (std::size_t s = 0; s < all_shapes.size(); ++s) {
      const auto inputs = rank_inputs<T>(n, all_shapes[s], 100 * s + static_cast<std::uint64_t>(n));
      const auto want = serial<T>{}.tree(inputs);
      for (const bool one_buffer : {false, true})
        for (const int threads_ : {1, 2}) {
          const auto got = run_adasum(inputs, {.one_buffer = one_buffer, .host_threads = threads_});
          for (int r = 0; r < n; ++r) {
            INFO("ranks " << n << ", shape " << s << ", one buffer " << one_buffer << ", host threads "
                          << threads_ << ", rank " << r);
            REQUIRE(sizes_of(got[r]) == all_shapes[s]);
            REQUIRE(first_difference(got[r], want) == -1);
          }
        }
    }
  }
}

TEMPLATE_TEST_CASE("adasum: one-pass partials equal three dot passes bit for bit", "[adasum]", float, double,
                   gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {5000, 3, 0, 777, 1};
  for (int n : {2, 3, 4, 7}) {
    const auto inputs = rank_inputs<T>(n, sizes, 55 + static_cast<std::uint64_t>(n));
    const auto fused = run_adasum(inputs, {});
    const auto three = run_adasum(inputs, {.three_dots = true});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(fused[r], three[r]) == -1);
    REQUIRE(first_difference(fused[0], serial<T>{}.tree(inputs)) == -1);
  }
}

TEST_CASE("adasum: without the layout agreement the result is the same", "[adasum]") {
  const std::vector<std::size_t> sizes = {129, 0, 1, 40};
  for (int n : {1, 2, 3, 6}) {
    const auto inputs = rank_inputs<float>(n, sizes, 12);
    const auto got = run_adasum(inputs, {.options = {.check_layout = false}});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(got[r], serial<float>{}.tree(inputs)) == -1);
  }
}

TEMPLATE_TEST_CASE("adasum: long double reference within rounding", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {300, 1, 0, 64, 4097};
  for (int n = 1; n <= 8; ++n) {
    const auto inputs = rank_inputs<T>(n, sizes, 900 + static_cast<std::uint64_t>(n));
    const auto got = run_adasum(inputs, {});
    const auto want = ld_tree(inputs);
    INFO("ranks " << n);
    const double ratio = worst_ratio(got[0], want, inputs);
    INFO("worst error / tolerance " << ratio);
    REQUIRE(ratio <= 1.0);
  }
}

TEMPLATE_TEST_CASE("adasum: orthogonal inputs give their sum exactly", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {37, 1, 16};
  for (int n = 1; n <= 8; ++n) {
    // Rank r owns the elements i with i % n == r: disjoint supports, exact zero dot products.
    std::vector<tlist<T>> inputs;
    for (int r = 0; r < n; ++r) {
      auto l = random_list<T>(sizes, 300 + static_cast<std::uint64_t>(r), 0.25, 2.0);
      for (auto& v : l)
        for (std::size_t i = 0; i < v.size(); ++i)
          if (static_cast<int>(i % static_cast<std::size_t>(n)) != r) v[i] = from<T>(0);
      inputs.push_back(l);
    }
    const auto got = run_adasum(inputs, {.one_buffer = n % 2 == 0});
    for (int r = 0; r < n; ++r)
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          INFO("ranks " << n << ", rank " << r << ", tensor " << t << ", element " << i);
          REQUIRE(same_bits(got[r][t][i], inputs[i % static_cast<std::size_t>(n)][t][i]));
        }
  }
}

TEMPLATE_TEST_CASE("adasum: equal inputs give the input exactly", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const auto one = random_list<T>({100, 1, 0, 33}, 17);
  for (int n = 1; n <= 8; ++n) {
    const std::vector<tlist<T>> inputs(static_cast<std::size_t>(n), one);
    const auto got = run_adasum(inputs, {});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(got[r], one) == -1);
  }
}

TEMPLATE_TEST_CASE("adasum: parallel inputs give the tree of pairwise means", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  // a (+) c a = (1 + c) a / 2 for any c != 0: rank r sends c_r u with c_r a power of two (so the
  // inputs are exactly parallel); the closed form is the same tree over the scalars c_r.
  const auto u = random_list<T>({50, 1, 9}, 23, 0.5, 1.0);
  const double cs[] = {1.0, 4.0, 0.5, -2.0, 2.0, 8.0, 0.25, -1.0};
  const auto tree_mean = [&](int n) {
    const int p = floor_pow2(n);
    std::vector<long double> x(static_cast<std::size_t>(p));
    for (int i = 0; i < p; ++i) x[i] = i + p < n ? (cs[i] + cs[i + p]) / 2 : cs[i];
    for (int width = p; width > 1; width /= 2)
      for (int j = 0; j < width / 2; ++j) x[j] = (x[2 * j] + x[2 * j + 1]) / 2;
    return x[0];
  };
  for (int n = 1; n <= 8; ++n) {
    std::vector<tlist<T>> inputs;
    for (int r = 0; r < n; ++r) {
      tlist<T> l = u;
      for (auto& v : l)
        for (auto& x : v) x = from<T>(cs[r] * val(x));
      inputs.push_back(l);
    }
    const long double m = tree_mean(n);
    const auto got = run_adasum(inputs, {});
    for (std::size_t t = 0; t < u.size(); ++t)
      for (std::size_t i = 0; i < u[t].size(); ++i) {
        const long double want = m * val(u[t][i]);
        INFO("ranks " << n << ", tensor " << t << ", element " << i << ": got " << val(got[0][t][i])
                      << ", closed form " << want);
        REQUIRE(std::fabs(val(got[0][t][i]) - want) <= 8 * eps<T>() * (levels_of(n) + 1) * 8 * val(u[t][i]));
      }
  }
  // Equal norms, opposite directions: the mean is zero, and exactly so.
  const std::vector<tlist<T>> opposite = {u, [&] {
                                            tlist<T> l = u;
                                            for (auto& v : l)
                                              for (auto& x : v) x = from<T>(-val(x));
                                            return l;
                                          }()};
  const auto got = run_adasum(opposite, {});
  for (const auto& v : got[1])
    for (T x : v) REQUIRE(val(x) == 0);
}

TEMPLATE_TEST_CASE("adasum: zero vectors are the identity", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {20, 0, 7};
  for (int n = 1; n <= 8; ++n)
    for (int k = 0; k < n; ++k) {
      // Only rank k is nonzero: every combine is 0 (+) x or x (+) 0 = x, exactly.
      std::vector<tlist<T>> inputs;
      for (int r = 0; r < n; ++r) {
        auto l = random_list<T>(sizes, 40 + static_cast<std::uint64_t>(r));
        if (r != k)
          for (auto& v : l) std::fill(v.begin(), v.end(), from<T>(0));
        inputs.push_back(l);
      }
      const auto got = run_adasum(inputs, {});
      for (int r = 0; r < n; ++r) {
        INFO("ranks " << n << ", nonzero rank " << k << ", rank " << r);
        REQUIRE(first_difference(got[r], inputs[k]) == -1);
      }
    }
  // All zero: zero.
  const std::vector<tlist<T>> zeros(3, tlist<T>{std::vector<T>(5, from<T>(0))});
  const auto got = run_adasum(zeros, {});
  for (T x : got[2][0]) REQUIRE(val(x) == 0);
}

TEST_CASE("adasum: the zero threshold drops a small tensor's projection term", "[adasum]") {
  // Tensor 0 of rank 0 has |a|^2 = 16 * (1e-4)^2 = 1.6e-7 <= 1e-6: alpha = 1, so the result is
  // a + (1 - a.b / (2 |b|^2)) b; tensor 1 is above the threshold and combined as usual.
  const std::vector<std::size_t> sizes = {16, 8};
  auto a = random_list<float>(sizes, 1, 0.5, 1.0);
  for (auto& x : a[0]) x *= 1e-4f;
  const auto b = random_list<float>(sizes, 2, 0.5, 1.0);
  const double thr = 1e-6;
  const auto got = run_adasum<float>({a, b}, {.options = {.zero_threshold = thr}});
  REQUIRE(first_difference(got[0], serial<float>{.threshold = thr}.tree({a, b})) == -1);
  double ab = 0, bb = 0, aa = 0;
  for (std::size_t i = 0; i < 16; ++i) {
    ab += double(a[0][i]) * b[0][i];
    bb += double(b[0][i]) * b[0][i];
    aa += double(a[0][i]) * a[0][i];
  }
  REQUIRE(aa <= thr);
  const float beta = static_cast<float>(1.0 - 0.5 * (ab / bb));
  for (std::size_t i = 0; i < 16; ++i) REQUIRE(std::fabs(got[0][0][i] - (a[0][i] + beta * b[0][i])) <= 1e-6f);
  // Without the threshold the tiny tensor is combined normally (alpha is about -0.5 |b| / |a|).
  const auto plain = run_adasum<float>({a, b}, {});
  REQUIRE(first_difference(plain[0], serial<float>{}.tree({a, b})) == -1);
  REQUIRE(first_difference(plain[0], got[0]) != -1);
}

TEMPLATE_TEST_CASE("adasum: values near the smallest normal and near sqrt(max) stay finite", "[adasum]",
                   float, gradapt::half, gradapt::bfloat16, double) {
  using T = TestType;
  const int min_exp = std::is_same_v<T, gradapt::half> ? -14 : std::is_same_v<T, double> ? -1022 : -126;
  // For double, 2^500 rather than sqrt(max) = 2^512: a sum of 100 squares near 2^1024 overflows
  // the double accumulator (norms of double tensors need |x| below about sqrt(DBL_MAX / n)).
  const int sqrt_max_exp = std::is_same_v<T, gradapt::half> ? 7 : std::is_same_v<T, double> ? 500 : 63;
  const std::vector<std::size_t> sizes = {100, 3};
  for (const int e : {min_exp, sqrt_max_exp}) {
    for (int n : {2, 3, 5, 8}) {
      std::vector<tlist<T>> inputs;
      for (int r = 0; r < n; ++r) {
        auto l = random_list<T>(sizes, 70 + static_cast<std::uint64_t>(r), 1.0, 2.0);
        for (auto& v : l)
          for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = from<T>(std::ldexp(val(v[i]), e) * ((i + static_cast<std::size_t>(r)) % 3 == 0 ? -1 : 1));
        inputs.push_back(l);
      }
      const auto got = run_adasum(inputs, {});
      INFO("exponent " << e << ", ranks " << n);
      for (const auto& v : got[0])
        for (T x : v) REQUIRE(std::isfinite(static_cast<double>(gradapt::load(x))));
      if constexpr (!std::is_same_v<T, double>) {
        // Results near the smallest normal may be subnormal: allow a few units of the smallest
        // subnormal on top of the relative tolerance.
        const int min_sub = std::is_same_v<T, gradapt::half> ? -24 : -149;
        REQUIRE(worst_ratio(got[0], ld_tree(inputs), inputs, std::ldexp(8.0L, min_sub)) <= 1.0);
      } else {
        // In double the squared norms of values near 2^-1022 underflow to 0: the tensors then
        // count as zero vectors and are summed. The result is finite and equals the serial tree.
        REQUIRE(first_difference(got[0], serial<T>{}.tree(inputs)) == -1);
      }
    }
  }
}

TEMPLATE_TEST_CASE("adasum: inf and NaN reach only their own tensor", "[adasum]", float, gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {10, 12, 9};
  for (int n : {2, 3, 4, 6}) {
    auto inputs = rank_inputs<T>(n, sizes, 5);
    inputs[1][1][3] = from<T>(std::numeric_limits<double>::quiet_NaN());
    inputs[0][2][0] = from<T>(std::numeric_limits<double>::infinity());
    const auto want = serial<T>{}.tree(inputs);
    const auto got = run_adasum(inputs, {});
    for (int r = 0; r < n; ++r) {
      INFO("ranks " << n << ", rank " << r);
      REQUIRE(first_difference(got[r], want) == -1);
      for (T x : got[r][1]) REQUIRE(is_nan(x));
      for (T x : got[r][2]) REQUIRE(!std::isfinite(static_cast<double>(gradapt::load(x))));
      for (T x : got[r][0]) REQUIRE(std::isfinite(static_cast<double>(gradapt::load(x))));
    }
  }
}

TEMPLATE_TEST_CASE("adasum: hierarchical mode is the group mean followed by the leaders' tree", "[adasum]",
                   float, gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {333, 0, 1, 64};
  for (int n = 1; n <= 8; ++n)
    for (int g : {1, 2, 3, 4, 9}) {
      const auto inputs = rank_inputs<T>(n, sizes, 600 + static_cast<std::uint64_t>(n * 10 + g));
      const auto want = serial<T>{}.hierarchical(inputs, g);
      for (const bool one_buffer : {false, true}) {
        const auto got = run_adasum(
            inputs,
            {.one_buffer = one_buffer, .options = {.mode = adasum_mode::hierarchical, .group_size = g}});
        for (int r = 0; r < n; ++r) {
          INFO("ranks " << n << ", group size " << g << ", one buffer " << one_buffer << ", rank " << r);
          REQUIRE(first_difference(got[r], want) == -1);
        }
      }
    }
}

}  // namespace gradapt_test_adasum

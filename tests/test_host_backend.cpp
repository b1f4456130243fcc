// Host backend: element-wise apply over tensors and lists, and the double-accumulated
// reductions, for every element type. Reductions are checked against a long double
// re-computation (independent, higher precision) and exact-valued cases; determinism is
// checked bitwise across 1, 2 and 3 threads.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_host_backend {

using gradapt::host_view;
using gradapt::reduction;
using gradapt::tensor_view;

namespace {

template <class T>
std::vector<T> random_vector(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) gradapt::store(x, static_cast<gradapt::compute_t<T>>(d(rng)));
  return v;
}

template <class T>
long double ld(const T& x) {
  return static_cast<long double>(gradapt::load(x));
}

// memcmp that accepts the null data() of empty vectors.
bool same_bytes(const void* a, const void* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

std::uint64_t bits(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

// Sizes that hit empty, tails of the 8-element groups, 16 lanes and 4096-element blocks, and
// the parallel paths (apply chunks of 2^15, parallel reductions from 2^17).
const std::vector<std::size_t> sizes{0, 1, 7, 8, 9, 15, 16, 17, 4095, 4096, 4097, 70001, 300007};

}  // namespace

TEMPLATE_TEST_CASE("apply runs an axpy-like functor over every element", "[host][apply]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  for (int threads : {1, 2, 3}) {
    gradapt::host h{.threads = threads};
    for (std::size_t n : sizes) {
      auto x = random_vector<TestType>(n, 1);
      auto y = random_vector<TestType>(n, 2);
      auto expect = y;
      for (std::size_t i = 0; i < n; ++i)
        gradapt::store(expect[i], gradapt::load(expect[i]) + C(0.5) * gradapt::load(x[i]));
      const auto x_before = x;
      h.apply([](C& yy, C xx) { yy += C(0.5) * xx; }, host_view(y),
              tensor_view<const TestType>(host_view(x)));
      INFO("n = " << n << ", threads = " << threads);
      REQUIRE(same_bytes(y.data(), expect.data(), n * sizeof(TestType)));
      REQUIRE(same_bytes(x.data(), x_before.data(), n * sizeof(TestType)));
    }
  }
}

TEMPLATE_TEST_CASE("apply handles several outputs and leaves const inputs alone", "[host][apply]", float,
                   double, gradapt::half, gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  const std::size_t n = 100003;
  auto g = random_vector<TestType>(n, 3);
  std::vector<TestType> m(n), v(n);
  gradapt::host h{.threads = 2};
  // Adam-like moments: m = 0.9 m + 0.1 g ; v = 0.99 v + 0.01 g^2, twice.
  for (int step = 0; step < 2; ++step)
    h.apply([](C& mm, C& vv, C gg) { mm = C(0.9) * mm + C(0.1) * gg, vv = C(0.99) * vv + C(0.01) * gg * gg; },
            host_view(m), host_view(v), tensor_view<const TestType>(host_view(g)));
  for (std::size_t i = 0; i < n; i += 997) {
    TestType em{}, ev{};
    for (int step = 0; step < 2; ++step) {
      const C gg = gradapt::load(g[i]);
      gradapt::store(em, C(0.9) * gradapt::load(em) + C(0.1) * gg);
      gradapt::store(ev, C(0.99) * gradapt::load(ev) + C(0.01) * gg * gg);
    }
    REQUIRE(std::memcmp(&m[i], &em, sizeof em) == 0);
    REQUIRE(std::memcmp(&v[i], &ev, sizeof ev) == 0);
  }
}

TEMPLATE_TEST_CASE("apply_list covers hundreds of tensors and passes the tensor index", "[host][apply]",
                   float, double, gradapt::half, gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  std::vector<std::vector<TestType>> w, g;
  std::vector<tensor_view<TestType>> wv, gv;
  for (std::size_t t = 0; t < 300; ++t) {
    const std::size_t n = t % 17 == 0 ? 0 : (t * 37) % 1000 + (t == 5 ? 200000 : 0);
    w.push_back(std::vector<TestType>(n));
    g.push_back(random_vector<TestType>(n, static_cast<unsigned>(t)));
  }
  for (std::size_t t = 0; t < w.size(); ++t) wv.push_back(host_view(w[t])), gv.push_back(host_view(g[t]));
  gradapt::host h{.threads = 2};
  h.apply_list([](gradapt::tensor_index t, C& ww, C gg) { ww = C(static_cast<double>(t.value % 8)) * gg; },
               wv, gv);
  for (std::size_t t = 0; t < w.size(); ++t)
    for (std::size_t i = 0; i < w[t].size(); ++i) {
      TestType e;
      gradapt::store(e, C(static_cast<double>(t % 8)) * gradapt::load(g[t][i]));
      REQUIRE(std::memcmp(&w[t][i], &e, sizeof e) == 0);
    }
  // Without the index, all lists are still walked in lockstep.
  h.apply_list([](C& ww, C& gg) { ww = gg, gg = C(0); }, wv, gv);
  for (std::size_t t = 0; t < w.size(); ++t)
    for (std::size_t i = 0; i < w[t].size(); ++i) REQUIRE(gradapt::load(g[t][i]) == C(0));
}

TEMPLATE_TEST_CASE("reductions match a long double re-computation", "[host][reduce]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  for (std::size_t n : sizes) {
    const auto x = random_vector<TestType>(n, 11, 3.0);
    const auto y = random_vector<TestType>(n, 12, 2.0);
    long double s = 0, sq = 0, dt = 0, abs_sum = 0, mx = 0;
    for (std::size_t i = 0; i < n; ++i) {
      s += ld(x[i]), sq += ld(x[i]) * ld(x[i]), dt += ld(x[i]) * ld(y[i]);
      abs_sum += std::fabs(ld(x[i]) * ld(y[i])) + std::fabs(ld(x[i]));
      mx = std::max(mx, std::fabs(ld(x[i])));
    }
    // Error bound of a double accumulation of n terms: n * 2^-53 * sum |terms| (generous).
    const long double tol = static_cast<long double>(n + 1) * std::ldexp(1.0L, -52) * (abs_sum + sq);
    gradapt::host h{.threads = 2};
    const auto xv = host_view(x);
    INFO("n = " << n);
    REQUIRE(std::fabs(h.reduce(reduction::sum, xv) - s) <= tol);
    REQUIRE(std::fabs(h.reduce(reduction::sum_squares, xv) - sq) <= tol);
    REQUIRE(std::fabs(h.dot(xv, host_view(y)) - dt) <= tol);
    REQUIRE(h.reduce(reduction::max_abs, xv) == static_cast<double>(mx));  // exact
    REQUIRE(h.reduce(reduction::count_nonfinite, xv) == 0.0);
  }
}

TEMPLATE_TEST_CASE("reductions are exact on exactly representable sums", "[host][reduce]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  const std::size_t n = 250001;
  std::vector<TestType> x(n);
  double s = 0, sq = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int k = static_cast<int>(i % 9) - 4;  // -4..4: exact in every type
    gradapt::store(x[i], static_cast<gradapt::compute_t<TestType>>(k));
    s += k, sq += k * k;
  }
  gradapt::host h{.threads = 3};
  REQUIRE(h.reduce(reduction::sum, host_view(x)) == s);
  REQUIRE(h.reduce(reduction::sum_squares, host_view(x)) == sq);
  REQUIRE(h.dot(host_view(x), host_view(x)) == sq);
  REQUIRE(h.reduce(reduction::max_abs, host_view(x)) == 4.0);
}

TEMPLATE_TEST_CASE("non-finite values: max_abs propagates NaN, count_nonfinite counts", "[host][reduce]",
                   float, double, gradapt::half, gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  gradapt::host h{.threads = 2};
  for (std::size_t n : {std::size_t{5}, std::size_t{40000}, std::size_t{300007}}) {
    std::vector<TestType> x(n);
    for (std::size_t i = 0; i < n; ++i) gradapt::store(x[i], C(static_cast<double>(i % 5)) - C(2));
    REQUIRE(h.reduce(reduction::count_nonfinite, host_view(x)) == 0.0);
    gradapt::store(x[n / 2], -std::numeric_limits<C>::infinity());
    REQUIRE(std::isinf(h.reduce(reduction::max_abs, host_view(x))));
    REQUIRE(h.reduce(reduction::count_nonfinite, host_view(x)) == 1.0);
    gradapt::store(x[n - 1], std::numeric_limits<C>::quiet_NaN());
    gradapt::store(x[0], std::numeric_limits<C>::quiet_NaN());
    REQUIRE(std::isnan(h.reduce(reduction::max_abs, host_view(x))));
    REQUIRE(std::isnan(h.reduce(reduction::sum_squares, host_view(x))));
    REQUIRE(h.reduce(reduction::count_nonfinite, host_view(x)) == 3.0);
  }
  std::vector<TestType> empty;
  REQUIRE(h.reduce(reduction::max_abs, host_view(empty)) == 0.0);
  REQUIRE(h.reduce(reduction::sum_squares, host_view(empty)) == 0.0);
  // Denormal float inputs are exact in double and are not flushed.
  if constexpr (std::is_same_v<TestType, float>) {
    std::vector<float> d(33, std::numeric_limits<float>::denorm_min());
    REQUIRE(h.reduce(reduction::sum, host_view(d)) == 33.0 * std::numeric_limits<float>::denorm_min());
  }
}

TEMPLATE_TEST_CASE("reductions are bitwise identical for 1, 2 and 3 threads", "[host][reduce][determinism]",
                   float, double, gradapt::half, gradapt::bfloat16) {
  std::vector<std::vector<TestType>> data, other;
  std::vector<tensor_view<const TestType>> xs, ys;
  for (unsigned t = 0; t < 40; ++t) {
    const std::size_t n = t == 3 ? 1000003 : t == 7 ? 262147 : (t * 7919u) % 20000u;
    data.push_back(random_vector<TestType>(n, 100 + t, 1e3));
    other.push_back(random_vector<TestType>(n, 200 + t, 1e-3));
  }
  for (std::size_t t = 0; t < data.size(); ++t)
    xs.push_back(host_view(data[t])), ys.push_back(host_view(other[t]));
  std::vector<std::uint64_t> ref;
  for (int threads : {1, 2, 3}) {
    gradapt::host h{.threads = threads};
    std::vector<double> per(xs.size());
    std::vector<std::uint64_t> got;
    for (auto op : {reduction::sum, reduction::sum_squares, reduction::max_abs}) {
      got.push_back(bits(h.reduce(op, xs, per)));
      for (double p : per) got.push_back(bits(p));
      got.push_back(bits(h.reduce(op, xs[3])));
    }
    got.push_back(bits(h.dot(xs, ys, per)));
    for (double p : per) got.push_back(bits(p));
    got.push_back(bits(h.reduce(reduction::sum_squares, xs, std::span<double>{})));
    if (ref.empty())
      ref = got;
    else
      REQUIRE(got == ref);
  }
  // The global result is the per-tensor results added in tensor order.
  gradapt::host h{.threads = 2};
  std::vector<double> per(xs.size());
  const double total = h.reduce(reduction::sum_squares, xs, per);
  double acc = 0;
  for (double p : per) acc += p;
  REQUIRE(bits(total) == bits(acc));
  REQUIRE(bits(per[3]) == bits(h.reduce(reduction::sum_squares, xs[3])));
}

TEST_CASE("host backend rejects mismatched arguments", "[host][errors]") {
  gradapt::host h{.threads = 1};
  std::vector<float> a(10), b(11);
  REQUIRE_THROWS_WITH(h.apply([](float& x, float y) { x += y; }, host_view(a), host_view(b)),
                      Catch::Matchers::Contains("view 1 has 11 elements but view 0 has 10"));
  REQUIRE_THROWS_WITH(h.dot(host_view(a), host_view(b)),
                      Catch::Matchers::Contains("tensor 0 has 11 elements in list 1 but 10 in list 0"));
  std::vector<tensor_view<float>> one{host_view(a)}, two{host_view(a), host_view(b)};
  REQUIRE_THROWS_WITH(h.apply_list([](float& x, float& y) { x += y; }, one, two),
                      Catch::Matchers::Contains("list 1 holds 2 tensors but list 0 holds 1"));
  std::vector<double> per(3);
  REQUIRE_THROWS_WITH(h.reduce(reduction::sum, two, per),
                      Catch::Matchers::Contains("per_tensor has 3 slots for 2 tensors"));
  REQUIRE_THROWS_WITH((gradapt::host{.threads = -1}.reduce(reduction::sum, host_view(a))),
                      Catch::Matchers::Contains("threads is -1"));
}

TEMPLATE_TEST_CASE("apply_reduce_list updates and sums like apply_list followed by reduce, bit for bit",
                   "[host][apply_reduce][determinism]", float, double, gradapt::half, gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  // Tensor sizes cover empty, group tails, block edges and the parallel path.
  std::vector<std::vector<TestType>> x0, y0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    x0.push_back(random_vector<TestType>(sizes[t], 300 + static_cast<unsigned>(t), 10.0));
    y0.push_back(random_vector<TestType>(sizes[t], 400 + static_cast<unsigned>(t), 0.1));
  }
  x0.push_back(random_vector<TestType>(1000003, 77, 3.0));
  y0.push_back(random_vector<TestType>(1000003, 78, 3.0));
  const std::size_t count = x0.size();
  // Reference: apply_list (x += 0.5 y), then reduce over the old and the new values.
  auto xr = x0;
  std::vector<tensor_view<TestType>> xrv;
  std::vector<tensor_view<const TestType>> x0v, y0v, xrc;
  for (std::size_t t = 0; t < count; ++t) {
    xrv.push_back(host_view(xr[t]));
    xrc.push_back(host_view(std::as_const(xr[t])));
    x0v.push_back(host_view(std::as_const(x0[t])));
    y0v.push_back(host_view(std::as_const(y0[t])));
  }
  gradapt::host ref_backend{.threads = 1};
  ref_backend.apply_list([](C& x, C y) { x += C(0.5) * y; }, xrv, y0v);
  std::vector<double> ref_old(count), ref_new(count), ref_dot(count);
  const double tot_old = ref_backend.reduce(reduction::sum_squares, x0v, ref_old);
  const double tot_new = ref_backend.reduce(reduction::sum_squares, xrc, ref_new);
  const double tot_dot = ref_backend.dot(x0v, y0v, ref_dot);

  for (int threads : {1, 2, 3}) {
    INFO("threads " << threads);
    gradapt::host h{.threads = threads};
    // One value: the square of the value before the update.
    {
      auto x = x0;
      std::vector<tensor_view<TestType>> xv;
      for (auto& v : x) xv.push_back(host_view(v));
      std::vector<double> per(count);
      const double tot = h.apply_reduce_list(
          [](C& a, C b) {
            const double old = static_cast<double>(a);
            a += C(0.5) * b;
            return old * old;
          },
          per, xv, y0v);
      REQUIRE(bits(tot) == bits(tot_old));
      for (std::size_t t = 0; t < count; ++t) {
        REQUIRE(bits(per[t]) == bits(ref_old[t]));
        REQUIRE(same_bytes(x[t].data(), xr[t].data(), x[t].size() * sizeof(TestType)));
      }
    }
    // Three values (new square, old-by-y dot, a count), with the tensor index passed first.
    {
      auto x = x0;
      std::vector<tensor_view<TestType>> xv;
      for (auto& v : x) xv.push_back(host_view(v));
      std::vector<double> per(count * 3);
      std::vector<std::size_t> seen(count, 0);
      const auto tot = h.apply_reduce_list(
          [&seen](gradapt::tensor_index ti, C& a, C b) {
            gradapt::terms<3> r;
            r[1] = static_cast<double>(a) * static_cast<double>(b);
            a += C(0.5) * b;
            r[0] = static_cast<double>(gradapt::load(static_cast<TestType>(a))) *
                   static_cast<double>(gradapt::load(static_cast<TestType>(a)));
            r[2] = 1.0;
            (void)seen[ti.value];
            return r;
          },
          per, xv, y0v);
      static_assert(std::is_same_v<std::remove_const_t<decltype(tot)>, gradapt::terms<3>>);
      REQUIRE(bits(tot[0]) == bits(tot_new));
      REQUIRE(bits(tot[1]) == bits(tot_dot));
      double n_total = 0;
      for (std::size_t t = 0; t < count; ++t) {
        REQUIRE(bits(per[3 * t]) == bits(ref_new[t]));
        REQUIRE(bits(per[3 * t + 1]) == bits(ref_dot[t]));
        REQUIRE(per[3 * t + 2] == static_cast<double>(x0[t].size()));
        n_total += static_cast<double>(x0[t].size());
      }
      REQUIRE(tot[2] == n_total);
    }
  }
}

TEST_CASE("apply_reduce on single views, and its argument checks", "[host][apply_reduce][errors]") {
  gradapt::host h{.threads = 2};
  std::vector<float> a{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, b(11, 1.0f);
  const double s = h.apply_reduce(
      [](float& x, float y) {
        x -= y;
        return static_cast<double>(x);
      },
      host_view(a), host_view(std::as_const(b)));
  REQUIRE(s == 55.0);
  REQUIRE(a.front() == 0.0f);
  REQUIRE(a.back() == 10.0f);
  // Empty list: nothing to do, the total is 0.
  std::vector<tensor_view<float>> none;
  REQUIRE(h.apply_reduce_list([](float& x) { return static_cast<double>(x); }, std::span<double>{}, none) ==
          0.0);
  std::vector<float> c(12);
  std::vector<tensor_view<float>> one{host_view(a)}, other{host_view(c)};
  REQUIRE_THROWS_WITH(
      h.apply_reduce_list([](float& x, float& y) { return double(x + y); }, std::span<double>{}, one, other),
      Catch::Matchers::Contains("tensor 0 has 12 elements in list 1 but 11 in list 0"));
  std::vector<double> per(3);
  REQUIRE_THROWS_WITH(
      h.apply_reduce_list(
          [](float& x) {
            gradapt::terms<2> r{};
            r[0] = x;
            return r;
          },
          per, one),
      Catch::Matchers::Contains("per_tensor has 3 slots for 1 tensors x 2 values (expected 2"));
}

TEMPLATE_TEST_CASE(
    "combine_sources: rank order, out may be a source, the block hook sees each block in order",
    "[host][combine_sources]", float, double) {
  using T = TestType;
  constexpr int p = 3;
  // Blocks of 4096: [0, 4096), [4096, 8192), [8192, 9000). A run-time size, as a
  // communicator's slice is: with the constant 9000, GCC 12 at -O2 reports
  // -Waggressive-loop-optimizations on combine_sources' scalar tail loop.
  volatile std::size_t size = 9000;
  const std::size_t n = size;
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> mag(-20.0, 20.0);
  std::vector<std::vector<T>> x(p, std::vector<T>(n));
  for (auto& v : x)
    for (auto& e : v)
      e = static_cast<T>(std::ldexp(std::uniform_real_distribution<double>(-1, 1)(rng), int(mag(rng))));
  // The definition: x_0 + x_1 + x_2 in T, left to right.
  std::vector<T> sum(n), mean(n);
  for (std::size_t i = 0; i < n; ++i) {
    sum[i] = static_cast<T>(static_cast<T>(x[0][i] + x[1][i]) + x[2][i]);
    mean[i] = static_cast<T>(sum[i] / static_cast<T>(p));
  }
  const auto same_bits = [](const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };

  // Into a separate buffer; the hook checks each block is stored when it is called.
  {
    std::vector<T> out(n);
    std::vector<std::pair<std::size_t, std::size_t>> blocks;
    bool stored = true;
    gradapt::host::combine_sources(
        p, [&](int k) -> const T* { return x[static_cast<std::size_t>(k)].data(); }, out.data(), n,
        gradapt::reduce_op::sum,
        [&](std::size_t b, std::size_t e) {
          blocks.emplace_back(b, e);
          stored = stored && std::memcmp(out.data() + b, sum.data() + b, (e - b) * sizeof(T)) == 0;
        });
    CHECK(same_bits(out, sum));
    CHECK(stored);
    const std::vector<std::pair<std::size_t, std::size_t>> expected{{0, 4096}, {4096, 8192}, {8192, 9000}};
    CHECK(blocks == expected);
  }
  // Into source 1 itself, sum and mean.
  {
    auto y = x;
    gradapt::host::combine_sources(
        p, [&](int k) -> const T* { return y[static_cast<std::size_t>(k)].data(); }, y[1].data(), n,
        gradapt::reduce_op::sum);
    CHECK(same_bits(y[1], sum));
    y = x;
    gradapt::host::combine_sources_mean(
        p, [&](int k) -> const T* { return y[static_cast<std::size_t>(k)].data(); }, y[0].data(), n);
    CHECK(same_bits(y[0], mean));
  }
  // With norms: into source 2 gives the bits (values and both norms) of a separate output.
  {
    std::vector<T> out(n);
    const auto apart = gradapt::host::combine_sources_with_norms(
        p, [&](int k) -> const T* { return x[static_cast<std::size_t>(k)].data(); }, out.data(), n);
    auto y = x;
    std::size_t calls = 0;
    const auto inside = gradapt::host::combine_sources_with_norms(
        p, [&](int k) -> const T* { return y[static_cast<std::size_t>(k)].data(); }, y[2].data(), n,
        [&](std::size_t, std::size_t) { ++calls; });
    CHECK(same_bits(out, sum));
    CHECK(same_bits(y[2], sum));
    CHECK(std::memcmp(&apart.sum_local_sq, &inside.sum_local_sq, sizeof(double)) == 0);
    CHECK(std::memcmp(&apart.result_sq, &inside.result_sq, sizeof(double)) == 0);
    CHECK(calls == 3);
    long double local = 0;  // the definition, to the sums' rounding
    for (const auto& v : x)
      for (const T e : v) local += static_cast<long double>(e) * e;
    CHECK(std::fabs(static_cast<long double>(inside.sum_local_sq) - local) <= 1e-12L * local);
  }
}

}  // namespace gradapt_test_host_backend

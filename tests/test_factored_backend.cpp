// The host backend's row and column operations over a tensor seen as [A, X, B, Y, C]
// (reduce_factored, reduce_factored_sumsq, apply_factored, apply_factored_max), against plain
// loops, and their independence of the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "factored_layout.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_factored_backend {

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::tensor_view;
using ld = long double;

static_assert(gradapt::factored_backend<gradapt::host> && gradapt::factored_max_backend<gradapt::host>);

TEST_CASE("host reduce_factored and apply_factored against plain loops", "[optim][adafactor][backend]") {
  // [A, X, B, Y, C] = [2, 5, 3, 7, 4] and the 2-D [n, m] form, sum and max.
  host b{.threads = 2};
  for (auto d :
       {std::array<std::int64_t, 5>{2, 5, 3, 7, 4}, std::array<std::int64_t, 5>{1, 300, 1, 129, 1}}) {
    const std::size_t A = std::size_t(d[0]), X = std::size_t(d[1]), B = std::size_t(d[2]),
                      Y = std::size_t(d[3]), C = std::size_t(d[4]);
    std::vector<float> x(A * X * B * Y * C);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float((i * 37) % 101) * 0.01f - 0.3f;
    std::vector<double> oy(A * X * B * C), ox(A * B * Y * C), my(oy.size()), mx(ox.size());
    const auto sq = [](float, float, float v) { return double(v) * double(v); };
    const tensor_view<const float> none;
    b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(oy),
                      gradapt::host_view(ox));
    b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(my),
                      gradapt::host_view(mx), gradapt::reduce_op::max);
    std::vector<ld> ry(oy.size(), 0), rx(ox.size(), 0);
    std::vector<double> qy(oy.size(), -1), qx(ox.size(), -1);
    gradapt_test::for_each_factored(d, [&](std::size_t e, std::size_t iy, std::size_t ix) {
      const double t = sq(0.0f, 0.0f, x[e]);
      ry[iy] += t;
      rx[ix] += t;
      qy[iy] = std::max(qy[iy], t);
      qx[ix] = std::max(qx[ix], t);
    });
    for (std::size_t k = 0; k < oy.size(); ++k) {
      REQUIRE(std::fabs(oy[k] - double(ry[k])) <= 1e-12 * double(ry[k]) + 1e-300);
      REQUIRE(my[k] == qy[k]);
    }
    for (std::size_t k = 0; k < ox.size(); ++k) {
      REQUIRE(std::fabs(ox[k] - double(rx[k])) <= 1e-12 * double(rx[k]) + 1e-300);
      REQUIRE(mx[k] == qx[k]);
    }
    // apply_factored: y = x * r * c and the sum of y.
    std::vector<float> rv(oy.size()), cv(ox.size());
    for (std::size_t k = 0; k < rv.size(); ++k) rv[k] = 1.0f + float(k % 3);
    for (std::size_t k = 0; k < cv.size(); ++k) cv[k] = 0.5f + float(k % 5);
    std::vector<float> y = x;
    const double total = b.apply_factored(
        [](float r, float c, float& v) {
          v = v * r * c;
          return v;
        },
        d, gradapt::host_view(std::as_const(rv)), gradapt::host_view(std::as_const(cv)),
        gradapt::host_view(y));
    ld want = 0;
    gradapt_test::for_each_factored(d, [&](std::size_t e, std::size_t iy, std::size_t ix) {
      const float v = x[e] * rv[iy] * cv[ix];
      REQUIRE(y[e] == v);
      want += v;
    });
    REQUIRE(std::fabs(total - double(want)) <= 1e-9 * std::fabs(double(want)) + 1e-9);
    // apply_factored_sum: the same elements and the same sum, stored instead of returned.
    std::vector<float> y2 = x;
    std::vector<double> sum(1, -1.0);
    b.apply_factored_sum(
        [](float r, float c, float& v) {
          v = v * r * c;
          return v;
        },
        d, gradapt::host_view(std::as_const(rv)), gradapt::host_view(std::as_const(cv)),
        gradapt::host_view(sum), gradapt::host_view(y2));
    REQUIRE(y2 == y);
    REQUIRE(sum[0] == total);
  }
  {
    std::vector<float> empty;
    std::vector<double> none_sum;
    REQUIRE_THROWS_WITH(b.apply_factored_sum([](float, float, float& v) { return v; }, {1, 0, 1, 0, 1},
                                             tensor_view<const float>(), tensor_view<const float>(),
                                             gradapt::host_view(none_sum), gradapt::host_view(empty)),
                        Contains("sum view is empty"));
  }
  std::vector<float> x(10);
  std::vector<double> o(3);
  const tensor_view<const float> none;
  REQUIRE_THROWS_WITH(
      b.reduce_factored([](float, float, float v) { return double(v); }, {1, 3, 1, 3, 1}, none, none,
                        gradapt::host_view(std::as_const(x)), gradapt::host_view(o), gradapt::host_view(o)),
      Contains("hold 9 elements but the tensor has 10"));
}

TEST_CASE("host reduce_factored reads each line once on any thread count: same bits for 1 to 3 threads",
          "[optim][adafactor][backend]") {
  // Matrix-like views (C == 1) with lines of at most host's group limit take the grouped path
  // (a per-thread partial per group of lines, added in group order); longer lines and C > 1
  // take the row/column loops. Both must match plain loops and give the same bits on 1, 2 and
  // 3 threads, for sums (with Σ y² of a second view) and maxima; shapes large enough for the
  // parallel paths, with several groups per slice, A, B > 1 and tails that are not a multiple of 8.
  const auto run = [](auto tag, std::array<std::int64_t, 5> d) {
    using T = decltype(tag);
    const std::size_t A = std::size_t(d[0]), X = std::size_t(d[1]), B = std::size_t(d[2]),
                      Y = std::size_t(d[3]), C = std::size_t(d[4]);
    const std::size_t n = A * X * B * Y * C, ny = A * X * B * C, nx = A * B * Y * C;
    std::vector<T> x(n), y(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = T(float((i * 37) % 101) * 0.01f - 0.3f);
      y[i] = T(float((i * 11) % 23) * 0.5f - 2.0f);
    }
    const auto sq = [](float, float, float v) { return double(v) * double(v); };
    std::vector<ld> ry(ny, 0), rx(nx, 0);
    std::vector<double> my(ny, -1), mx(nx, -1);
    ld rp = 0;
    for (std::size_t e = 0; e < n; ++e) {
      const std::size_t c = e % C, j = (e / C) % Y, line = e / (Y * C);  // line = (a X + i) B + b
      const std::size_t bb = line % B, a = line / (X * B);
      const double t = sq(0, 0, float(x[e]));
      ry[line * C + c] += t;
      rx[((a * B + bb) * Y + j) * C + c] += t;
      my[line * C + c] = std::max(my[line * C + c], t);
      mx[((a * B + bb) * Y + j) * C + c] = std::max(mx[((a * B + bb) * Y + j) * C + c], t);
      rp += ld(float(y[e])) * ld(float(y[e]));
    }
    std::vector<std::vector<double>> first;
    for (int threads : {1, 2, 3}) {
      CAPTURE(sizeof(T), d, threads);
      host b{.threads = threads};
      std::vector<double> oy(ny, -7), ox(nx, -7), qy(ny, -7), qx(nx, -7), sy(ny, -7), sx(nx, -7),
          ls(A * X * B, -7);
      const tensor_view<const float> none;
      b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(oy),
                        gradapt::host_view(ox));
      b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(qy),
                        gradapt::host_view(qx), gradapt::reduce_op::max);
      const double psq = b.reduce_factored_sumsq(
          sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(sy),
          gradapt::host_view(sx), gradapt::host_view(std::as_const(y)), gradapt::host_view(ls));
      for (std::size_t k = 0; k < ny; ++k) {
        REQUIRE(std::fabs(oy[k] - double(ry[k])) <= 1e-12 * double(ry[k]) + 1e-300);
        REQUIRE(qy[k] == my[k]);
      }
      for (std::size_t k = 0; k < nx; ++k) {
        REQUIRE(std::fabs(ox[k] - double(rx[k])) <= 1e-12 * double(rx[k]) + 1e-300);
        REQUIRE(qx[k] == mx[k]);
      }
      REQUIRE((sy == oy && sx == ox));  // the same terms in the same order
      REQUIRE(std::fabs(psq - double(rp)) <= 1e-12 * double(rp));
      if (first.empty())
        first = {oy, ox, qy, qx, std::vector<double>{psq}};
      else
        REQUIRE((first[0] == oy && first[1] == ox && first[2] == qy && first[3] == qx && first[4][0] == psq));
    }
  };
  for (auto d :
       {std::array<std::int64_t, 5>{1, 700, 1, 129, 1}, std::array<std::int64_t, 5>{2, 400, 2, 200, 1},
        std::array<std::int64_t, 5>{1, 40, 1, 4096, 1}, std::array<std::int64_t, 5>{1, 17, 1, 5003, 1},
        std::array<std::int64_t, 5>{2, 50, 2, 91, 4}})
    run(float{}, d);
  run(gradapt::half{}, std::array<std::int64_t, 5>{1, 700, 1, 129, 1});
  run(double{}, std::array<std::int64_t, 5>{2, 400, 2, 200, 1});
}

namespace {
/// t = x² + min(r, c) from a read-only view x; y ← 2x − r (an update that reads the row
/// entry); vectorizable.
struct term_and_update {
  static constexpr bool vectorizable = true;
  template <class V>
  GRADAPT_HD V term(V r, V c, const V& x, const V&) const {
    return x * x + gradapt::simd::min(r, c);
  }
  template <class V>
  GRADAPT_HD V operator()(V r, V c, V& x, V& y) const {
    y = V(2.0f) * x - r;
    return term(r, c, x, y);
  }
};
}  // namespace

TEST_CASE("host apply_factored_max: the update and the row/column maxima of its terms in one pass",
          "[backend][factored]") {
  // Shapes with a pack path (C == 1, lines of 8k and 8k + r elements) and without (C > 1).
  for (const std::array<std::int64_t, 5> d :
       {std::array<std::int64_t, 5>{1, 37, 1, 53, 1}, {2, 5, 3, 16, 1}, {1, 9, 1, 7, 3}, {1, 1, 1, 1, 1}}) {
    const std::size_t A = d[0], X = d[1], B = d[2], Y = d[3], C = d[4];
    const std::size_t n = A * X * B * Y * C, ny = A * X * B * C, nx = A * B * Y * C;
    std::mt19937 rng(static_cast<unsigned>(n));
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> g(n), r(ny), c(nx);
    for (auto& v : g) v = u(rng);
    for (auto& v : r) v = u(rng);
    for (auto& v : c) v = u(rng);
    for (const bool with_nan : {false, true}) {
      auto x = g;
      if (with_nan && n > 3) x[n / 2] = std::numeric_limits<float>::quiet_NaN();
      const auto x0 = x;
      std::vector<float> y(n), oy(ny), ox(nx);
      host{.threads = 2}.apply_factored_max(
          term_and_update{}, d, tensor_view<const float>(gradapt::host_view(r)),
          tensor_view<const float>(gradapt::host_view(c)), gradapt::host_view(oy), gradapt::host_view(ox),
          gradapt::host_view(std::as_const(x)), gradapt::host_view(y));
      // Plain loops: the maxima (NaN if any term is NaN) and the update.
      std::vector<float> wy(ny, -INFINITY), wx(nx, -INFINITY);
      std::vector<bool> ny_nan(ny), nx_nan(nx);
      gradapt_test::for_each_factored(d, [&](std::size_t e, std::size_t yi, std::size_t xi) {
        const float t = x0[e] * x0[e] + std::min(r[yi], c[xi]);
        if (t != t) {
          ny_nan[yi] = true;
          nx_nan[xi] = true;
        }
        wy[yi] = std::max(wy[yi], t);
        wx[xi] = std::max(wx[xi], t);
        const float want = 2.0f * x0[e] - r[yi];
        REQUIRE(std::memcmp(&want, &y[e], sizeof want) == 0);
      });
      for (std::size_t k = 0; k < ny; ++k) REQUIRE((ny_nan[k] ? std::isnan(oy[k]) : oy[k] == wy[k]));
      for (std::size_t k = 0; k < nx; ++k) REQUIRE((nx_nan[k] ? std::isnan(ox[k]) : ox[k] == wx[k]));
      if (with_nan && n > 3)
        REQUIRE(std::count_if(oy.begin(), oy.end(), [](float v) { return v != v; }) == 1);
    }
  }
  std::vector<float> x(6), y(6), o(2);
  REQUIRE_THROWS_WITH(
      host{}.apply_factored_max(term_and_update{}, {1, 2, 1, 3, 1}, tensor_view<const float>{},
                                tensor_view<const float>{}, gradapt::host_view(o), gradapt::host_view(o),
                                gradapt::host_view(std::as_const(x)), gradapt::host_view(y)),
      Contains("over_x 2 elements (expected A*X*B*C = 2 and A*B*Y*C = 3)"));
}

}  // namespace gradapt_test_factored_backend

// The linear-algebra backend (linalg/host_lapack.hpp): GEMM and SYRK against a long double
// re-computation with the classical forward error bound, the symmetric eigensolver by its
// backward error and orthogonality, and the argument checks.
//
// Bounds: a computed dot product of length k satisfies |fl(x·y) − x·y| <= γ_k Σ|x_i||y_i|,
// γ_k = k·u/(1 − k·u) (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), whatever
// the summation order a blocked BLAS picks; alpha, beta and the final add cost two more
// roundings, so every element is checked against (k + 2)·u·(|α|Σ|a||b| + |β||c|) (with 2× for
// the 1/(1 − k·u) factor and any FMA-free kernel). A backward-stable symmetric eigensolver
// returns Q, Λ with ‖A − QΛQᵀ‖_F <= p(n)·u·‖A‖_F and ‖QᵀQ − I‖_F <= p(n)·u for a modestly
// growing p(n) (LAPACK Users' Guide §4.7); the tests take p(n) = 4n.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "eigh_errors.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/linalg/newton_schulz.hpp"
#include "host_as_device_linalg.hpp"

namespace gradapt_test_linalg {

using Catch::Matchers::Contains;
using gradapt::gram;
using gradapt::host_lapack;
using gradapt::tensor_view;
using gradapt::transpose;

namespace {

template <class T>
std::vector<T> random_matrix(std::int64_t r, std::int64_t c, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> m(static_cast<std::size_t>(r * c));
  for (auto& v : m) v = T(u(rng));
  return m;
}

template <class T>
std::vector<T> random_symmetric(std::int64_t n, unsigned seed) {
  auto m = random_matrix<T>(n, n, seed);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < i; ++j) m[std::size_t(j * n + i)] = m[std::size_t(i * n + j)];
  return m;
}

template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}

// Element (i, j) of op(X) for a row-major r × c matrix X.
template <class T>
long double at(const std::vector<T>& x, std::int64_t cols, transpose t, std::int64_t i, std::int64_t j) {
  return t == transpose::none ? x[std::size_t(i * cols + j)] : x[std::size_t(j * cols + i)];
}

}  // namespace

TEMPLATE_TEST_CASE("host_lapack::gemm matches a long double product within the dot-product bound", "[linalg]",
                   float, double) {
  using T = TestType;
  const host_lapack la;
  struct shape {
    std::int64_t m, k, n;
  };
  const shape shapes[] = {{1, 1, 1}, {7, 5, 3}, {64, 33, 17}, {3, 100, 40}, {0, 4, 3}, {4, 0, 3}};
  for (const auto& s : shapes)
    for (transpose ta : {transpose::none, transpose::yes})
      for (transpose tb : {transpose::none, transpose::yes})
        for (double beta : {0.0, -1.5}) {
          const std::int64_t ar = ta == transpose::none ? s.m : s.k, ac = ta == transpose::none ? s.k : s.m;
          const std::int64_t br = tb == transpose::none ? s.k : s.n, bc = tb == transpose::none ? s.n : s.k;
          const auto a = random_matrix<T>(ar, ac, 1);
          const auto b = random_matrix<T>(br, bc, 2);
          auto c = random_matrix<T>(s.m, s.n, 3);
          const auto c0 = c;
          if (beta == 0.0 && !c.empty()) c[0] = std::numeric_limits<T>::quiet_NaN();  // beta = 0 ignores C
          const double alpha = 0.75;
          la.gemm<T>(ta, tb, alpha, tensor_view<const T>(a.data(), {ar, ac}),
                     tensor_view<const T>(b.data(), {br, bc}), beta, tensor_view<T>(c.data(), {s.m, s.n}));
          for (std::int64_t i = 0; i < s.m; ++i)
            for (std::int64_t j = 0; j < s.n; ++j) {
              long double ref = 0, mag = 0;
              for (std::int64_t l = 0; l < s.k; ++l) {
                const long double p = at(a, ac, ta, i, l) * at(b, bc, tb, l, j);
                ref += p;
                mag += std::fabs(p);
              }
              const long double cij = beta == 0.0 ? 0.0L : (long double)c0[std::size_t(i * s.n + j)];
              ref = alpha * ref + beta * cij;
              const long double bound =
                  2.0L * (s.k + 2) * unit_roundoff<T>() * (std::fabs(alpha) * mag + std::fabs(beta * cij));
              INFO("m " << s.m << " k " << s.k << " n " << s.n << " ta " << int(ta) << " tb " << int(tb)
                        << " beta " << beta << " at " << i << "," << j);
              REQUIRE(std::fabs((long double)c[std::size_t(i * s.n + j)] - ref) <= bound);
            }
        }
}

TEMPLATE_TEST_CASE("host_lapack::syrk forms A·Aᵀ and Aᵀ·A, symmetric bit for bit", "[linalg]", float,
                   double) {
  using T = TestType;
  const host_lapack la;
  for (gram g : {gram::rows, gram::columns})
    for (std::int64_t m : {1, 6, 50})
      for (std::int64_t k : {0, 1, 9, 130})
        for (double beta : {0.0, 0.5}) {
          const auto a = random_matrix<T>(m, k, 4);
          const std::int64_t n = g == gram::rows ? m : k;
          auto c = random_symmetric<T>(n, 5);
          const auto c0 = c;
          const double alpha = -2.0;
          la.syrk<T>(g, alpha, tensor_view<const T>(a.data(), {m, k}), beta,
                     tensor_view<T>(c.data(), {n, n}));
          const std::int64_t inner = g == gram::rows ? k : m;
          for (std::int64_t i = 0; i < n; ++i)
            for (std::int64_t j = 0; j < n; ++j) {
              long double ref = 0, mag = 0;
              for (std::int64_t l = 0; l < inner; ++l) {
                const long double p =
                    g == gram::rows ? (long double)a[std::size_t(i * k + l)] * a[std::size_t(j * k + l)]
                                    : (long double)a[std::size_t(l * k + i)] * a[std::size_t(l * k + j)];
                ref += p;
                mag += std::fabs(p);
              }
              const long double cij = c0[std::size_t(i * n + j)];
              ref = alpha * ref + beta * cij;
              const long double bound =
                  2.0L * (inner + 2) * unit_roundoff<T>() * (std::fabs(alpha) * mag + std::fabs(beta * cij));
              INFO("gram " << int(g) << " m " << m << " k " << k << " beta " << beta << " at " << i << ","
                           << j);
              REQUIRE(std::fabs((long double)c[std::size_t(i * n + j)] - ref) <= bound);
              REQUIRE(c[std::size_t(i * n + j)] == c[std::size_t(j * n + i)]);
            }
        }
}

TEMPLATE_TEST_CASE("host_lapack::eigh: ascending eigenvalues, A = Q·diag(w)·Qᵀ, Q orthogonal", "[linalg]",
                   float, double) {
  using T = TestType;
  const host_lapack la;
  for (std::int64_t n : {1, 2, 5, 64, 200}) {
    const auto a = random_symmetric<T>(n, unsigned(10 + n));
    auto q = a;
    std::vector<T> w(static_cast<std::size_t>(n));
    auto ws = la.eigh_workspace<T>(n);
    REQUIRE(la.eigh<T>(tensor_view<T>(q.data(), {n, n}), gradapt::host_view(w), ws));
    REQUIRE(std::is_sorted(w.begin(), w.end()));
    const auto e = gradapt_test::eigh_errors_of(a, q, w, n);
    INFO("n " << n << " residual " << double(std::sqrt(e.residual / e.anorm)) << " orthogonality "
              << double(std::sqrt(e.orthogonality)));
    REQUIRE(std::sqrt(e.residual) <= 4.0L * n * unit_roundoff<T>() * std::sqrt(e.anorm));
    REQUIRE(std::sqrt(e.orthogonality) <= 4.0L * n * unit_roundoff<T>());
  }
}

TEMPLATE_TEST_CASE("host_lapack::qr: A = Q·R, Q orthogonal, R upper triangular; aliases throw", "[linalg]",
                   float, double) {
  using T = TestType;
  const host_lapack la;
  for (std::int64_t n : {1, 3, 48}) {
    const auto a = random_matrix<T>(n, n, unsigned(30 + n));
    std::vector<T> q(a.size()), r(a.size());
    auto ws = la.qr_workspace<T>(n);
    la.qr<T>(tensor_view<const T>(a.data(), {n, n}), tensor_view<T>(q.data(), {n, n}),
             tensor_view<T>(r.data(), {n, n}), ws);
    long double residual = 0, orthogonality = 0, anorm = 0;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        if (j < i) REQUIRE(r[std::size_t(i * n + j)] == T(0));
        long double qr = 0, qtq = 0;
        for (std::int64_t k = 0; k < n; ++k) {
          qr += (long double)q[std::size_t(i * n + k)] * r[std::size_t(k * n + j)];
          qtq += (long double)q[std::size_t(k * n + i)] * q[std::size_t(k * n + j)];
        }
        const long double aij = a[std::size_t(i * n + j)], id = i == j ? 1 : 0;
        residual += (qr - aij) * (qr - aij);
        anorm += aij * aij;
        orthogonality += (qtq - id) * (qtq - id);
      }
    INFO("n " << n);
    REQUIRE(std::sqrt(residual) <= 8.0L * n * unit_roundoff<T>() * std::sqrt(anorm));
    REQUIRE(std::sqrt(orthogonality) <= 8.0L * n * unit_roundoff<T>());
  }
  std::vector<T> m(9, T(1)), q(9);
  auto ws = la.qr_workspace<T>(3);
  REQUIRE_THROWS_WITH(la.qr<T>(tensor_view<const T>(m.data(), {3, 3}), tensor_view<T>(m.data(), {3, 3}),
                               tensor_view<T>(q.data(), {3, 3}), ws),
                      Contains("distinct"));
}

TEST_CASE("host_lapack::eigh of a diagonal matrix returns its sorted diagonal", "[linalg]") {
  const host_lapack la;
  std::vector<double> a = {3, 0, 0, 0, -1, 0, 0, 0, 2}, w(3);
  auto ws = la.eigh_workspace<double>(3);
  REQUIRE(la.eigh<double>(tensor_view<double>(a.data(), {3, 3}), gradapt::host_view(w), ws));
  REQUIRE(w == std::vector<double>{-1, 2, 3});
  // Column 0 of Q is ±e₁ (the eigenvector of -1).
  REQUIRE(std::fabs(a[3]) == 1.0);
  REQUIRE(a[0] == 0.0);
  REQUIRE(a[6] == 0.0);
}

TEST_CASE("host_lapack: invalid shapes throw gradapt::error with the sizes", "[linalg]") {
  const host_lapack la;
  std::vector<double> buf(64, 1.0), w(4);
  auto m = [&](std::int64_t r, std::int64_t c) { return tensor_view<double>(buf.data(), {r, c}); };
  auto cm = [&](std::int64_t r, std::int64_t c) { return tensor_view<const double>(buf.data(), {r, c}); };
  REQUIRE_THROWS_WITH(la.gemm<double>(transpose::none, transpose::none, 1, cm(2, 3), cm(2, 3), 0, m(2, 3)),
                      Contains("inner dimensions must agree"));
  REQUIRE_THROWS_WITH(la.gemm<double>(transpose::none, transpose::yes, 1, cm(2, 3), cm(4, 3), 0, m(2, 3)),
                      Contains("C has shape [2, 3] but op(A)·op(B) is 2 x 4"));
  REQUIRE_THROWS_WITH(la.gemm<double>(transpose::none, transpose::none, 1,
                                      tensor_view<const double>::vector(buf.data(), 4), cm(4, 1), 0, m(1, 1)),
                      Contains("A has shape [4] (expected a matrix, rank 2)"));
  REQUIRE_THROWS_WITH(la.syrk<double>(gram::rows, 1, cm(3, 5), 0, m(5, 5)),
                      Contains("C has shape [5, 5] but A·Aᵀ of A [3, 5] is 3 x 3"));
  REQUIRE_THROWS_WITH(la.syrk<double>(gram::columns, 1, cm(3, 5), 0, m(5, 3)),
                      Contains("expected a square matrix"));
  auto ws = la.eigh_workspace<double>(4);
  REQUIRE_THROWS_WITH(la.eigh<double>(m(4, 3), gradapt::host_view(w), ws),
                      Contains("expected a square matrix"));
  REQUIRE_THROWS_WITH(la.eigh<double>(m(3, 3), gradapt::host_view(w), ws), Contains("w has 4 elements"));
  std::vector<double> w3(3);
  REQUIRE_THROWS_WITH(la.eigh<double>(m(3, 3), gradapt::host_view(w3), ws),
                      Contains("the workspace was made for 4 x 4 matrices"));
  REQUIRE_THROWS_WITH(la.eigh_workspace<double>(-1), Contains("expected n >= 0"));
}

// G = U·diag(σ)·Vᵀ with U, V products of two Householder reflections: Newton–Schulz acts on each
// singular value alone, so the result is U·diag(f(σ / max(‖σ‖, ε)))·Vᵀ with f the scalar iteration
// x ← a·x + b·x³ + c·x⁵ (computed here in long double): a closed form independent of the matrix
// products.
template <class T>
void newton_schulz_closed_form(std::int64_t m, std::int64_t n, unsigned seed, double tol) {
  using ld = long double;
  const std::int64_t k = std::min(m, n);
  const auto householder = [](std::int64_t d, unsigned s) {
    std::mt19937 rng(s);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::vector<ld> q(static_cast<std::size_t>(d * d), 0.0L);
    for (std::int64_t i = 0; i < d; ++i) q[static_cast<std::size_t>(i * d + i)] = 1.0L;
    for (int r = 0; r < 2; ++r) {  // q ← q·(I − 2vvᵀ/‖v‖²)
      std::vector<ld> v(static_cast<std::size_t>(d));
      ld nn = 0;
      for (auto& x : v) {
        x = u(rng);
        nn += x * x;
      }
      for (std::int64_t i = 0; i < d; ++i) {
        ld dot = 0;
        for (std::int64_t j = 0; j < d; ++j)
          dot += q[static_cast<std::size_t>(i * d + j)] * v[static_cast<std::size_t>(j)];
        for (std::int64_t j = 0; j < d; ++j)
          q[static_cast<std::size_t>(i * d + j)] -= 2.0L * dot * v[static_cast<std::size_t>(j)] / nn;
      }
    }
    return q;
  };
  const auto U = householder(m, seed), V = householder(n, seed + 7);
  std::vector<ld> sigma(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    sigma[static_cast<std::size_t>(i)] = 0.05L + 1.5L * ld(i) / ld(k);  // spread
  const gradapt::newton_schulz_options o{};
  ld norm = 0;
  for (const ld s : sigma) norm += s * s;
  norm = std::sqrt(norm);
  std::vector<ld> f(sigma.size());
  for (std::size_t i = 0; i < sigma.size(); ++i) {
    ld x = sigma[i] / std::max(norm, ld(o.epsilon));
    for (std::uint32_t s = 0; s < o.steps; ++s)
      x = ld(o.a) * x + ld(o.b) * x * x * x + ld(o.c) * x * x * x * x * x;
    f[i] = x;
  }
  const auto product = [&](const std::vector<ld>& d) {  // U[:, :k]·diag(d)·V[:, :k]ᵀ
    std::vector<ld> out(static_cast<std::size_t>(m * n), 0.0L);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        ld acc = 0;
        for (std::int64_t r = 0; r < k; ++r)
          acc += U[static_cast<std::size_t>(i * m + r)] * d[static_cast<std::size_t>(r)] *
                 V[static_cast<std::size_t>(j * n + r)];
        out[static_cast<std::size_t>(i * n + j)] = acc;
      }
    return out;
  };
  const auto g = product(sigma), want = product(f);
  std::vector<T> x(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) x[i] = static_cast<T>(g[i]);
  std::vector<T> ws(gradapt::newton_schulz_workspace(m, n));
  gradapt::newton_schulz(host_lapack{}, gradapt::host{}, tensor_view<T>(x.data(), {m, n}),
                         tensor_view<T>::vector(ws.data(), std::int64_t(ws.size())), o);
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, double(std::abs(ld(x[i]) - want[i])));
  INFO(m << " x " << n << ": largest difference " << worst);
  CHECK(worst <= tol);
  // The singular values moved towards 1: the result is far from the scaled input.
  CHECK(std::abs(ld(x[0]) - g[0] / norm) > 10 * tol);
}

TEST_CASE("newton_schulz: the closed form on known singular vectors, wide, tall and square", "[linalg]") {
  for (const auto& [m, n] : {std::pair<std::int64_t, std::int64_t>{6, 9}, {9, 6}, {7, 7}, {1, 5}, {5, 1}}) {
    newton_schulz_closed_form<double>(m, n, 11u + unsigned(m), 1e-12);
    newton_schulz_closed_form<float>(m, n, 11u + unsigned(m), 2e-5);
  }
}

TEST_CASE("newton_schulz on device-tagged memory: the host's bits, through the backends only",
          "[linalg][device]") {
  // The device path (cuda_linalg with gradapt::cuda) is the same code over device views: run here
  // through the device-tagged host backend and linear algebra, it gives the host call's bits.
  for (const auto& [m, n] : {std::pair<std::int64_t, std::int64_t>{6, 9}, {9, 6}, {7, 7}, {1, 5}}) {
    for (const std::uint32_t steps : {1u, 2u, 5u}) {  // odd: the result ends in the workspace
      std::mt19937 rng(unsigned(m * 31 + n + steps));
      std::normal_distribution<float> nd;
      std::vector<float> h(static_cast<std::size_t>(m * n)), ws(gradapt::newton_schulz_workspace(m, n));
      for (auto& v : h) v = nd(rng);
      std::vector<float> d = h, dws(ws.size(), std::numeric_limits<float>::quiet_NaN());
      const gradapt::newton_schulz_options o{.steps = steps};
      gradapt::newton_schulz(host_lapack{}, gradapt::host{}, tensor_view<float>(h.data(), {m, n}),
                             tensor_view<float>::vector(ws.data(), std::int64_t(ws.size())), o);
      using dview = tensor_view<float, gradapt::device_space>;
      gradapt::newton_schulz(host_as_device::linalg{}, host_as_device::backend{}, dview(d.data(), {m, n}),
                             dview::vector(dws.data(), std::int64_t(dws.size())), o);
      INFO(m << " x " << n << ", " << steps << " steps");
      CHECK(std::memcmp(h.data(), d.data(), h.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("newton_schulz: a zero matrix stays zero; bad options and workspaces throw", "[linalg]") {
  std::vector<double> z(12, 0.0), ws(gradapt::newton_schulz_workspace(3, 4));
  const auto wsv = tensor_view<double>::vector(ws.data(), std::int64_t(ws.size()));
  gradapt::newton_schulz(host_lapack{}, gradapt::host{}, tensor_view<double>(z.data(), {3, 4}), wsv, {});
  CHECK(std::all_of(z.begin(), z.end(), [](double v) { return v == 0.0; }));
  std::vector<double> small(3);
  REQUIRE_THROWS_WITH(
      gradapt::newton_schulz(host_lapack{}, gradapt::host{}, tensor_view<double>(z.data(), {3, 4}),
                             tensor_view<double>::vector(small.data(), 3), {}),
      Contains("needs 30"));
  REQUIRE_THROWS_WITH(gradapt::validate(gradapt::newton_schulz_options{.steps = 0}, "opt: ns"),
                      Contains("opt: ns.steps is 0"));
  REQUIRE_THROWS_WITH(gradapt::validate(gradapt::newton_schulz_options{.epsilon = -1}, "opt: ns"),
                      Contains("epsilon is -1"));
}

}  // namespace gradapt_test_linalg

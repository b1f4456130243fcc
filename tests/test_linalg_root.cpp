// Inverse p-th roots (linalg/matrix_root.hpp) against closed forms and long double residuals.
//
// Accuracy model behind the tolerances (u: unit roundoff of the element type, κ: condition
// number of A + r·I, n: size):
//  - eigen: a backward-stable eigensolver gives the exact decomposition of A + E with
//    ‖E‖ <= p(n)·u·‖A‖; the smallest eigenvalue then moves by up to κ·p(n)·u relative and
//    λ^(-1/p) by 1/p of that, so ‖X − X*‖_F / ‖X*‖_F <= C·n·u·κ (C = 4 for p(n), p >= 1).
//    Storing A in T already perturbs it by u·‖A‖, so the same bound covers float inputs.
//  - coupled Newton: M = X^p·(A + r·I) holds up to rounding, and the iteration stops once
//    max|M − I| <= tol; X = X*(I + R)^(1/p) with R = M − I gives
//    ‖X − X*‖₂/‖X*‖₂ <= ‖R‖₂/p + rounding <= n·tol/p + C·n·u·κ.
//  - the residual X^p·(A + r·I) − I, computed in long double from the returned X, is p times
//    X's relative error: max|R| <= p·(the bound above).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/linalg/matrix_root.hpp"

namespace gradapt_test_linalg_root {

using Catch::Matchers::Contains;
using gradapt::host_lapack;
using gradapt::inverse_root_options;
using gradapt::inverse_root_workspace;
using gradapt::newton_stop;
using gradapt::ridge_kind;
using gradapt::root_method;
using gradapt::root_status;
using gradapt::tensor_view;

namespace {

using ld = long double;
using lmat = std::vector<ld>;

template <class T>
constexpr ld unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}

// A random orthogonal n × n matrix (modified Gram-Schmidt in long double, twice).
lmat random_orthogonal(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> g;
  const auto N = std::size_t(n);
  lmat q(N * N);
  for (auto& v : q) v = g(rng);
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t j = 0; j < N; ++j) {
      for (std::size_t k = 0; k < j; ++k) {
        ld d = 0;
        for (std::size_t i = 0; i < N; ++i) d += q[i * N + j] * q[i * N + k];
        for (std::size_t i = 0; i < N; ++i) q[i * N + j] -= d * q[i * N + k];
      }
      ld s = 0;
      for (std::size_t i = 0; i < N; ++i) s += q[i * N + j] * q[i * N + j];
      s = std::sqrt(s);
      for (std::size_t i = 0; i < N; ++i) q[i * N + j] /= s;
    }
  return q;
}

// Q·diag(d)·Qᵀ in long double.
lmat rotate(const lmat& q, const std::vector<ld>& d) {
  const std::size_t n = d.size();
  lmat a(n * n);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j <= i; ++j) {
      ld s = 0;
      for (std::size_t k = 0; k < n; ++k) s += q[i * n + k] * d[k] * q[j * n + k];
      a[i * n + j] = a[j * n + i] = s;
    }
  return a;
}

lmat matmul(const lmat& a, const lmat& b, std::size_t n) {
  lmat c(n * n, 0);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t k = 0; k < n; ++k)
      for (std::size_t j = 0; j < n; ++j) c[i * n + j] += a[i * n + k] * b[k * n + j];
  return c;
}

// max |X^p·(A + r·I) − I| in long double, X and A as stored.
template <class T>
ld residual(const std::vector<T>& x, const std::vector<T>& a, int p, double ridge) {
  const std::size_t n = static_cast<std::size_t>(std::lround(std::sqrt(double(a.size()))));
  lmat xl(x.begin(), x.end()), al(a.begin(), a.end());
  for (std::size_t i = 0; i < n; ++i) al[i * n + i] += ridge;
  lmat r = al;
  for (int k = 0; k < p; ++k) r = matmul(xl, r, n);
  ld e = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) e = std::max(e, std::fabs(r[i * n + j] - (i == j ? 1 : 0)));
  return e;
}

template <class T>
ld rel_frobenius(const std::vector<T>& x, const lmat& ref) {
  ld num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    num += (x[i] - ref[i]) * (x[i] - ref[i]), den += ref[i] * ref[i];
  return std::sqrt(num / den);
}

template <class T>
std::vector<T> to(const lmat& a) {
  return std::vector<T>(a.begin(), a.end());
}

template <class T>
gradapt::inverse_root_result root(std::vector<T>& a, int p, std::vector<T>& x, inverse_root_options o,
                                  const host_lapack& la = {}) {
  const auto n = static_cast<std::int64_t>(std::lround(std::sqrt(double(a.size()))));
  inverse_root_workspace<host_lapack, T> ws(la, n);
  return gradapt::inverse_pth_root(la, tensor_view<const T>(a.data(), {n, n}), p,
                                   tensor_view<T>(x.data(), {n, n}), ws, o);
}

// Spectrum of n values spread geometrically over [1/κ, 1].
std::vector<ld> spectrum(std::size_t n, ld kappa) {
  std::vector<ld> d(n);
  for (std::size_t i = 0; i < n; ++i) d[i] = std::pow(kappa, -ld(i) / ld(n > 1 ? n - 1 : 1));
  return d;
}

constexpr root_method methods[] = {root_method::coupled_newton, root_method::eigen};

}  // namespace

TEMPLATE_TEST_CASE("inverse_pth_root of a diagonal matrix is the element-wise power", "[linalg][root]", float,
                   double) {
  using T = TestType;
  const std::size_t n = 12;
  std::vector<T> a(n * n, T(0));
  std::vector<ld> d(n);
  for (std::size_t i = 0; i < n; ++i) d[i] = ld(T(std::pow(10.0, -2.0 + 4.0 * double(i) / double(n - 1))));
  for (std::size_t i = 0; i < n; ++i) a[i * n + i] = T(d[i]);  // κ = 1e4
  const ld kappa = 1e4;
  const double tol = 1e-6;
  for (int p : {2, 4, 8})
    for (root_method m : methods) {
      std::vector<T> x(n * n, T(-7));
      const auto r =
          root<T>(a, p, x, {.method = m, .epsilon = 0, .ridge = ridge_kind::absolute, .tolerance = tol});
      INFO("p " << p << " method " << int(m) << " status " << gradapt::to_string(r.status));
      REQUIRE(r.ok());
      lmat ref(n * n, 0);
      for (std::size_t i = 0; i < n; ++i) ref[i * n + i] = std::pow(d[i], -1.0L / p);
      const ld bound = (m == root_method::eigen ? 0 : n * tol / p) + 4 * n * unit_roundoff<T>() * kappa;
      REQUIRE(rel_frobenius(x, ref) <= bound);
    }
}

TEMPLATE_TEST_CASE("inverse_pth_root of Q·D·Qᵀ matches Q·D^(-1/p)·Qᵀ and X^p·A ≈ I", "[linalg][root]", float,
                   double) {
  using T = TestType;
  const std::size_t n = 48;
  const auto q = random_orthogonal(n, 7);
  for (ld kappa : {1e2L, 1e4L}) {
    const auto d = spectrum(n, kappa);
    auto a = to<T>(rotate(q, d));
    for (int p : {2, 4, 8})
      for (root_method m : methods) {
        // A is rounded to T: its own spectrum differs from d by ~u·‖A‖·n, inside the bound.
        const double tol = 1e-6;
        std::vector<T> x(n * n);
        const auto r =
            root<T>(a, p, x, {.method = m, .epsilon = 0, .ridge = ridge_kind::absolute, .tolerance = tol});
        INFO("kappa " << double(kappa) << " p " << p << " method " << int(m) << " status "
                      << gradapt::to_string(r.status) << " iterations " << r.iterations << " error "
                      << r.error);
        REQUIRE(r.ok());
        std::vector<ld> dp(n);
        for (std::size_t i = 0; i < n; ++i) dp[i] = std::pow(d[i], -1.0L / p);
        const ld xbound = (m == root_method::eigen ? 0 : n * tol / p) + 4 * n * unit_roundoff<T>() * kappa;
        REQUIRE(rel_frobenius(x, rotate(q, dp)) <= xbound);
        REQUIRE(residual(x, a, p, 0.0) <= p * xbound);
        if (m == root_method::coupled_newton) REQUIRE(r.stop == newton_stop::tolerance);
      }
  }
}

TEMPLATE_TEST_CASE("coupled Newton and the eigendecomposition agree", "[linalg][root]", float, double) {
  using T = TestType;
  const std::size_t n = 64;
  // A Shampoo-like statistic: G·Gᵀ of a random 64 × 256 G, plus a relative ridge.
  std::mt19937 rng(3);
  std::normal_distribution<double> g;
  lmat gm(n * 256);
  for (auto& v : gm) v = g(rng);
  lmat al(n * n, 0);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t k = 0; k < 256; ++k) al[i * n + j] += gm[i * 256 + k] * gm[j * 256 + k];
  auto a = to<T>(al);
  for (int p : {2, 4}) {
    std::vector<T> xn(n * n), xe(n * n);
    const inverse_root_options o{.epsilon = 1e-4, .ridge = ridge_kind::relative, .tolerance = 1e-6};
    auto on = o, oe = o;
    on.method = root_method::coupled_newton;
    oe.method = root_method::eigen;
    const auto rn = root<T>(a, p, xn, on);
    const auto re = root<T>(a, p, xe, oe);
    REQUIRE(rn.ok());
    REQUIRE(re.ok());
    // λ_max by power iteration is a Rayleigh quotient: a lower bound within power_tolerance.
    REQUIRE(rn.lambda_max <= re.lambda_max * (1 + 8 * n * unit_roundoff<T>()));
    REQUIRE(rn.lambda_max >= re.lambda_max * (1 - 1e-4));
    // G·Gᵀ with 256 columns: κ(A) is about ((√256 + √64)/(√256 − √64))² = 9; the ridge only
    // lowers it. Both results lie within their bounds of the true root.
    const ld kappa = 100;
    const ld bound = n * o.tolerance / p + 2 * 4 * n * unit_roundoff<T>() * kappa + 1e-4 / p;
    lmat xel(xe.begin(), xe.end());
    REQUIRE(rel_frobenius(xn, xel) <= bound);
  }
}

TEMPLATE_TEST_CASE("ill-conditioned (cond 1e8) and singular matrices are rooted through the ridge",
                   "[linalg][root]", float, double) {
  using T = TestType;
  const std::size_t n = 32;
  const auto q = random_orthogonal(n, 11);
  auto d_ill = spectrum(n, 1e8L);
  auto d_sing = spectrum(n, 1e2L);
  for (std::size_t i = n / 2; i < n; ++i) d_sing[i] = 0;  // rank n/2
  for (const auto* d : {&d_ill, &d_sing}) {
    auto a = to<T>(rotate(q, *d));
    for (int p : {2, 4, 8})
      for (root_method m : methods) {
        const double eps = 1e-4;  // relative ridge: κ(A + r·I) <= (1 + eps)/eps ≈ 1e4
        std::vector<T> x(n * n);
        const auto r = root<T>(a, p, x, {.method = m, .epsilon = eps, .ridge = ridge_kind::relative});
        INFO("p " << p << " method " << int(m) << " status " << gradapt::to_string(r.status));
        REQUIRE(r.ok());
        REQUIRE(r.ridge == Approx(eps * r.lambda_max).epsilon(1e-12));
        REQUIRE(r.lambda_max == Approx(1.0).epsilon(1e-4));  // λ_max of the spectrum is 1
        const ld kappa = (1 + eps) / eps;
        std::vector<ld> dp(n);
        for (std::size_t i = 0; i < n; ++i) dp[i] = std::pow((*d)[i] + r.ridge, -1.0L / p);
        const ld xbound = (m == root_method::eigen ? 0 : n * 1e-6L / p) + 4 * n * unit_roundoff<T>() * kappa;
        REQUIRE(rel_frobenius(x, rotate(q, dp)) <= xbound);
        REQUIRE(residual(x, a, p, r.ridge) <= p * xbound);
      }
  }
}

TEMPLATE_TEST_CASE("failures are statuses and leave X untouched", "[linalg][root]", float, double) {
  using T = TestType;
  const std::size_t n = 6;
  auto good = to<T>(rotate(random_orthogonal(n, 5), spectrum(n, 10)));
  const std::vector<T> sentinel(n * n, T(42));
  for (root_method m : methods) {
    INFO("method " << int(m));
    std::vector<T> x = sentinel;
    auto a = good;
    a[7] = std::numeric_limits<T>::quiet_NaN();
    REQUIRE(root<T>(a, 2, x, {.method = m}).status == root_status::nonfinite_input);
    a[7] = std::numeric_limits<T>::infinity();
    REQUIRE(root<T>(a, 2, x, {.method = m}).status == root_status::nonfinite_input);
    a = good;
    a[1] = std::nextafter(a[1], T(10));  // a[0][1] != a[1][0]
    REQUIRE(root<T>(a, 2, x, {.method = m}).status == root_status::not_symmetric);
    std::vector<T> zero(n * n, T(0));
    REQUIRE(root<T>(zero, 2, x, {.method = m, .ridge = ridge_kind::relative}).status ==
            root_status::singular);
    REQUIRE(root<T>(zero, 2, x, {.method = m, .epsilon = 0, .ridge = ridge_kind::absolute}).status ==
            root_status::singular);
    REQUIRE(x == sentinel);
  }
  // A singular matrix without a ridge: the eigen route sees an eigenvalue <= 0; Newton's
  // zero eigenvalue stays 0 (M's error stays 1) until max_iterations.
  auto d = spectrum(n, 10);
  d[0] = 0;
  auto sing = to<T>(rotate(random_orthogonal(n, 9), d));
  std::vector<T> x = sentinel;
  // Rounding may leave the zero eigenvalue slightly positive in T: the eigen route then
  // returns a huge but finite root. Force an exactly singular matrix: a zero row and column.
  for (std::size_t i = 0; i < n; ++i) sing[i] = sing[i * n] = T(0);
  REQUIRE(root<T>(sing, 2, x, {.method = root_method::eigen, .epsilon = 0, .ridge = ridge_kind::absolute})
              .status == root_status::singular);
  const auto rn = root<T>(sing, 2, x,
                          {.method = root_method::coupled_newton,
                           .epsilon = 0,
                           .ridge = ridge_kind::absolute,
                           .max_iterations = 30});
  REQUIRE(rn.status == root_status::not_converged);
  REQUIRE(rn.error >= 0.5);
  REQUIRE(x == sentinel);
}

// A linear-algebra backend that forwards to host_lapack but fails on demand: float eigh
// reports failure, double eigh too if asked, and gemm writes NaN after a number of calls.
struct faulty_lapack {
  using space = gradapt::host_space;
  bool fail_float_eigh = false, fail_double_eigh = false;
  int nan_after_gemms = -1;  // < 0: never
  mutable int gemm_calls = 0;
  host_lapack la{};
  template <class T>
  auto eigh_workspace(std::int64_t n) const {
    return la.eigh_workspace<T>(n);
  }
  template <class T>
  void gemm(gradapt::transpose ta, gradapt::transpose tb, double alpha, tensor_view<const T> a,
            tensor_view<const T> b, double beta, tensor_view<T> c) const {
    la.gemm<T>(ta, tb, alpha, a, b, beta, c);
    if (nan_after_gemms >= 0 && gemm_calls++ >= nan_after_gemms)
      c.data()[0] = std::numeric_limits<T>::quiet_NaN();
  }
  template <class T>
  void syrk(gradapt::gram g, double alpha, tensor_view<const T> a, double beta, tensor_view<T> c) const {
    la.syrk<T>(g, alpha, a, beta, c);
  }
  template <class T, class W>
  bool eigh(tensor_view<T> a, tensor_view<T> w, W& ws) const {
    if (std::is_same_v<T, float> ? fail_float_eigh : fail_double_eigh) return false;
    return la.eigh<T>(a, w, ws);
  }
};
static_assert(gradapt::linalg_backend<faulty_lapack>);

template <class T>
gradapt::inverse_root_result faulty_root(const faulty_lapack& la, std::vector<T>& a, int p, std::vector<T>& x,
                                         inverse_root_options o) {
  const auto n = static_cast<std::int64_t>(std::lround(std::sqrt(double(a.size()))));
  inverse_root_workspace<faulty_lapack, T> ws(la, n);
  return gradapt::inverse_pth_root(la, tensor_view<const T>(a.data(), {n, n}), p,
                                   tensor_view<T>(x.data(), {n, n}), ws, o);
}

TEST_CASE("eigen route: a failed float decomposition is retried in double", "[linalg][root]") {
  const std::size_t n = 16;
  auto a = to<float>(rotate(random_orthogonal(n, 21), spectrum(n, 100)));
  std::vector<float> ref(n * n), x(n * n, 5.0f);
  REQUIRE(root<float>(a, 4, ref, {.method = root_method::eigen}).ok());
  faulty_lapack la{.fail_float_eigh = true};
  const auto r = faulty_root<float>(la, a, 4, x, {.method = root_method::eigen});
  REQUIRE(r.ok());
  REQUIRE(r.retried_in_double);
  // The double route differs from the float one by the float route's error only.
  lmat refl(ref.begin(), ref.end());
  REQUIRE(rel_frobenius(x, refl) <= 2 * 4 * n * unit_roundoff<float>() * 100);
  const std::vector<float> before = x;
  REQUIRE(faulty_root<float>(la, a, 4, x, {.method = root_method::eigen, .retry_in_double = false}).status ==
          root_status::eigensolver_failed);
  la.fail_double_eigh = true;
  const auto r2 = faulty_root<float>(la, a, 4, x, {.method = root_method::eigen});
  REQUIRE(r2.status == root_status::eigensolver_failed);
  REQUIRE(r2.retried_in_double);
  REQUIRE(x == before);
  std::vector<double> ad(a.begin(), a.end()), xd(n * n, 3.0);
  REQUIRE(faulty_root<double>(la, ad, 4, xd, {.method = root_method::eigen}).status ==
          root_status::eigensolver_failed);
  REQUIRE(xd == std::vector<double>(n * n, 3.0));
}

TEST_CASE("coupled Newton: when the error grows, the best iterate so far is returned", "[linalg][root]") {
  const std::size_t n = 24;
  auto a = to<double>(rotate(random_orthogonal(n, 31), spectrum(n, 1e3)));
  const int p = 4;
  // p = 4: each iteration takes 1 (X·Mₚ) + 2 (Mₚ⁴) + 1 (·M) = 4 products; the first
  // relative-ridge power iteration is skipped (absolute ridge), so gemm call 4k is the first of
  // iteration k + 1. Corrupt iteration 9's products: the error becomes NaN there.
  const inverse_root_options o{.method = root_method::coupled_newton,
                               .epsilon = 1e-3,
                               .ridge = ridge_kind::absolute,
                               .tolerance = 1e-12};
  faulty_lapack la{.nan_after_gemms = 4 * 8};
  std::vector<double> x(n * n), x8(n * n);
  const auto r = faulty_root<double>(la, a, p, x, o);
  REQUIRE(r.stop == newton_stop::error_grew);
  REQUIRE(r.iterations == 9);
  // The same computation stopped after 8 iterations gives the same bits when iteration 8 was
  // the best, which it is while the error decreases.
  auto o8 = o;
  o8.max_iterations = 8;
  const auto r8 = root<double>(a, p, x8, o8);
  REQUIRE(r8.stop == newton_stop::max_iterations);
  REQUIRE(r.error == r8.error);
  REQUIRE(x == x8);
  REQUIRE(r.status == (r8.error <= o.max_error ? root_status::ok : root_status::not_converged));
}

TEST_CASE("inverse_pth_root: invalid arguments throw gradapt::error", "[linalg][root]") {
  const host_lapack la;
  std::vector<double> a(16, 0.0), x(16), x9(9);
  for (int i = 0; i < 4; ++i) a[std::size_t(i * 5)] = 1;
  inverse_root_workspace<host_lapack, double> ws(la, 4);
  const tensor_view<const double> av(a.data(), {4, 4});
  const tensor_view<double> xv(x.data(), {4, 4});
  auto call = [&](int p, inverse_root_options o) { return gradapt::inverse_pth_root(la, av, p, xv, ws, o); };
  REQUIRE(call(2, {}).ok());
  REQUIRE_THROWS_WITH(gradapt::inverse_pth_root(la, tensor_view<const double>(a.data(), {2, 8}), 2,
                                                tensor_view<double>(x.data(), {2, 8}), ws),
                      Contains("A has shape [2, 8] (expected a square matrix)"));
  REQUIRE_THROWS_WITH(gradapt::inverse_pth_root(la, av, 2, tensor_view<double>(x9.data(), {3, 3}), ws),
                      Contains("X has shape [3, 3] but A has shape [4, 4]"));
  inverse_root_workspace<host_lapack, double> ws3(la, 3);
  REQUIRE_THROWS_WITH(gradapt::inverse_pth_root(la, av, 2, xv, ws3),
                      Contains("the workspace was made for 3 x 3 matrices"));
  REQUIRE_THROWS_WITH(call(0, {}), Contains("p is 0 (expected a positive integer"));
  REQUIRE_THROWS_WITH(call(-2, {}), Contains("p is -2"));
  REQUIRE_THROWS_WITH(call(2, {.epsilon = -1e-6}),
                      Contains("epsilon is -1e-06 (expected a finite ridge >= 0)"));
  REQUIRE_THROWS_WITH(call(2, {.epsilon = std::numeric_limits<double>::quiet_NaN()}),
                      Contains("epsilon is nan"));
  REQUIRE_THROWS_WITH(call(2, {.tolerance = -1}), Contains("tolerance is -1"));
  REQUIRE_THROWS_WITH(call(2, {.max_iterations = 0}), Contains("max_iterations is 0"));
  REQUIRE_THROWS_WITH(call(2, {.max_error_ratio = 0.5}), Contains("max_error_ratio is 0.5"));
  REQUIRE_THROWS_WITH(call(2, {.max_error = 0}), Contains("max_error is 0"));
  REQUIRE_THROWS_WITH(call(2, {.power_iterations = 0}), Contains("power_iterations is 0"));
  REQUIRE_THROWS_WITH(call(2, {.power_tolerance = -1}), Contains("power_tolerance is -1"));
  REQUIRE_THROWS_WITH((inverse_root_workspace<host_lapack, double>(la, 0)), Contains("n is 0"));
}

}  // namespace gradapt_test_linalg_root

// See shampoo_ld_reference.hpp.
#include "shampoo_ld_reference.hpp"

#include <algorithm>
#include <cmath>

#include "ld_linalg.hpp"

namespace gradapt_test {

struct shampoo_ld_reference::impl {
  std::size_t m, n;
  ld eps;
  std::vector<ld> l, r, v;
  std::vector<ld> pl, pr;  ///< stale_direction: the roots of the statistics so far
  /// Adds g's statistics; returns g.
  std::vector<ld> accumulate(const std::vector<double>& g) {
    const std::vector<ld> x(g.begin(), g.end());
    const auto xt = transpose(x, m, n);
    const auto ggt = matmul(x, xt, m, n, m), gtg = matmul(xt, x, n, m, n);
    for (std::size_t i = 0; i < l.size(); ++i) l[i] += ggt[i];
    for (std::size_t i = 0; i < r.size(); ++i) r[i] += gtg[i];
    return x;
  }
};

namespace {
/// The eigenvectors of symmetric a (k × k) as columns, in ascending order of their eigenvalues.
std::vector<ld> ascending_basis(const std::vector<ld>& a, std::size_t k) {
  std::vector<ld> q, w;
  jacobi_eigen(a, k, q, w);
  std::vector<std::size_t> order(k);
  for (std::size_t i = 0; i < k; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return w[x] < w[y]; });
  std::vector<ld> out(k * k);
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t c = 0; c < k; ++c) out[i * k + c] = q[i * k + order[c]];
  return out;
}
}  // namespace

shampoo_ld_reference::shampoo_ld_reference(std::size_t m, std::size_t n, double eps)
    : p_(new impl{m,
                  n,
                  ld(eps),
                  std::vector<ld>(m * m, 0),
                  std::vector<ld>(n * n, 0),
                  std::vector<ld>(m * n, 0),
                  {},
                  {}}) {}

shampoo_ld_reference::~shampoo_ld_reference() = default;

std::vector<double> shampoo_ld_reference::direction(const std::vector<double>& g) {
  auto& s = *p_;
  const auto x = s.accumulate(g);
  const auto pl = sym_power(s.l, s.m, s.eps, ld(-0.25)), pr = sym_power(s.r, s.n, s.eps, ld(-0.25));
  const auto d = matmul(matmul(pl, x, s.m, s.m, s.n), pr, s.m, s.n, s.n);
  return std::vector<double>(d.begin(), d.end());
}

std::vector<double> shampoo_ld_reference::stale_direction(const std::vector<double>& g) {
  auto& s = *p_;
  std::vector<double> out = g;
  if (!s.pl.empty()) {
    const std::vector<ld> x(g.begin(), g.end());
    const auto d = matmul(matmul(s.pl, x, s.m, s.m, s.n), s.pr, s.m, s.n, s.n);
    out.assign(d.begin(), d.end());
  }
  s.accumulate(g);
  s.pl = sym_power(s.l, s.m, s.eps, ld(-0.25));
  s.pr = sym_power(s.r, s.n, s.eps, ld(-0.25));
  return out;
}

std::vector<double> shampoo_ld_reference::corrected_direction(const std::vector<double>& g) {
  auto& s = *p_;
  const auto x = s.accumulate(g);
  const auto ql = ascending_basis(s.l, s.m), qr = ascending_basis(s.r, s.n);
  auto rot = matmul(matmul(transpose(ql, s.m, s.m), x, s.m, s.m, s.n), qr, s.m, s.n, s.n);
  for (std::size_t i = 0; i < rot.size(); ++i) {
    s.v[i] += rot[i] * rot[i];
    rot[i] /= std::sqrt(s.v[i]) + s.eps;
  }
  const auto d = matmul(matmul(ql, rot, s.m, s.m, s.n), transpose(qr, s.n, s.n), s.m, s.n, s.n);
  return std::vector<double>(d.begin(), d.end());
}

}  // namespace gradapt_test

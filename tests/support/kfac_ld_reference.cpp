// See kfac_ld_reference.hpp.
#include "kfac_ld_reference.hpp"

#include <algorithm>

#include "ld_linalg.hpp"

namespace gradapt_test {

struct kfac_ld_reference::impl {
  std::size_t in, out, n;
  bool bias;
  ld d, lambda;
  std::vector<ld> a, g, as, gs;  // the factors and their snapshot at the last decomposition
};

namespace {
std::vector<ld> identity(std::size_t n) {
  std::vector<ld> m(n * n, 0);
  for (std::size_t i = 0; i < n; ++i) m[i * n + i] = 1;
  return m;
}
}  // namespace

kfac_ld_reference::kfac_ld_reference(std::size_t in, std::size_t out, bool bias, double decay, double damping)
    : p_(std::make_unique<impl>()) {
  auto& p = *p_;
  p.in = in;
  p.out = out;
  p.bias = bias;
  p.n = in + (bias ? 1 : 0);
  p.d = decay;
  p.lambda = damping;
  p.a = p.as = identity(p.n);
  p.g = p.gs = identity(out);
}
kfac_ld_reference::~kfac_ld_reference() = default;

void kfac_ld_reference::update(const std::vector<double>& a, const std::vector<double>& g, std::size_t rows,
                               double s) {
  auto& p = *p_;
  std::vector<ld> ah(rows * p.n, 1), gh(g.begin(), g.end());
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < p.in; ++c) ah[r * p.n + c] = a[r * p.in + c];
  const auto ata = matmul(transpose(ah, rows, p.n), ah, p.n, rows, p.n);
  const auto gtg = matmul(transpose(gh, rows, p.out), gh, p.out, rows, p.out);
  const ld rs = ld(rows), ss = ld(s) * ld(s);
  for (std::size_t e = 0; e < p.a.size(); ++e) p.a[e] = p.d * p.a[e] + (1 - p.d) * ata[e] / rs;
  for (std::size_t e = 0; e < p.g.size(); ++e) p.g[e] = p.d * p.g[e] + (1 - p.d) * gtg[e] / (rs * ss);
}

void kfac_ld_reference::decompose() {
  p_->as = p_->a;
  p_->gs = p_->g;
}

std::vector<double> kfac_ld_reference::direction(const std::vector<double>& w, const std::vector<double>& b,
                                                 bool eigen) const {
  const auto& p = *p_;
  std::vector<ld> m(p.out * p.n);
  for (std::size_t r = 0; r < p.out; ++r) {
    for (std::size_t c = 0; c < p.in; ++c) m[r * p.n + c] = w[r * p.in + c];
    if (p.bias) m[r * p.n + p.in] = b[r];
  }
  if (eigen) {
    std::vector<ld> qa, da, qg, dg;
    jacobi_eigen(p.as, p.n, qa, da);
    jacobi_eigen(p.gs, p.out, qg, dg);
    auto v = matmul(matmul(transpose(qg, p.out, p.out), m, p.out, p.out, p.n), qa, p.out, p.n, p.n);
    for (std::size_t r = 0; r < p.out; ++r)
      for (std::size_t c = 0; c < p.n; ++c)
        v[r * p.n + c] /= std::max(dg[r], ld(0)) * std::max(da[c], ld(0)) + p.lambda;
    v = matmul(matmul(qg, v, p.out, p.out, p.n), transpose(qa, p.n, p.n), p.out, p.n, p.n);
    return std::vector<double>(v.begin(), v.end());
  }
  auto ga = p.gs, aa = p.as;
  for (std::size_t i = 0; i < p.out; ++i) ga[i * p.out + i] += p.lambda;
  for (std::size_t i = 0; i < p.n; ++i) aa[i * p.n + i] += p.lambda;
  // X = (G + λI)⁻¹·M; V = X·(A + λI)⁻¹ = ((A + λI)⁻¹·Xᵀ)ᵀ (A symmetric).
  const auto x = solve(ga, m, p.out, p.n);
  const auto v = transpose(solve(aa, transpose(x, p.out, p.n), p.n, p.out), p.n, p.out);
  return std::vector<double>(v.begin(), v.end());
}

}  // namespace gradapt_test

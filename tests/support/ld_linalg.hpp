#pragma once
// Long double dense linear algebra for test references, written from the textbook formulas and
// independent of the library: a cyclic Jacobi eigensolver (Golub & Van Loan §8.5), powers of
// symmetric matrices through it, products, transposes and a linear solve with partial pivoting;
// and the normal random inputs the second-order tests (Shampoo, K-FAC) feed them.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace gradapt_test {

using ld = long double;

// Symmetric n × n A = Q·diag(w)·Qᵀ by cyclic Jacobi rotations (Golub & Van Loan §8.5).
inline void jacobi_eigen(std::vector<ld> a, std::size_t n, std::vector<ld>& q, std::vector<ld>& w) {
  q.assign(n * n, 0);
  for (std::size_t i = 0; i < n; ++i) q[i * n + i] = 1;
  ld total = 0;
  for (const ld x : a) total += x * x;
  for (int sweep = 0; sweep < 100; ++sweep) {
    ld off = 0;
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j)
        if (i != j) off += a[i * n + j] * a[i * n + j];
    if (off <= 1e-40L * total) break;  // below long double's rounding of the entries
    for (std::size_t p = 0; p < n; ++p)
      for (std::size_t r = p + 1; r < n; ++r) {
        const ld apr = a[p * n + r];
        if (apr == 0) continue;
        const ld theta = (a[r * n + r] - a[p * n + p]) / (2 * apr);
        const ld t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const ld c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::size_t k = 0; k < n; ++k) {  // A ← A·J
          const ld akp = a[k * n + p], akr = a[k * n + r];
          a[k * n + p] = c * akp - s * akr;
          a[k * n + r] = s * akp + c * akr;
        }
        for (std::size_t k = 0; k < n; ++k) {  // A ← Jᵀ·A
          const ld apk = a[p * n + k], ark = a[r * n + k];
          a[p * n + k] = c * apk - s * ark;
          a[r * n + k] = s * apk + c * ark;
        }
        for (std::size_t k = 0; k < n; ++k) {  // Q ← Q·J
          const ld qkp = q[k * n + p], qkr = q[k * n + r];
          q[k * n + p] = c * qkp - s * qkr;
          q[k * n + r] = s * qkp + c * qkr;
        }
      }
  }
  w.resize(n);
  for (std::size_t i = 0; i < n; ++i) w[i] = a[i * n + i];
}

// (A + r·I)^e for symmetric PSD A.
inline std::vector<ld> sym_power(const std::vector<ld>& a, std::size_t n, ld r, ld e) {
  std::vector<ld> q, w, out(n * n, 0);
  jacobi_eigen(a, n, q, w);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t k = 0; k < n; ++k)
        out[i * n + j] += q[i * n + k] * std::pow(std::max(w[k], ld(0)) + r, e) * q[j * n + k];
  return out;
}

// C (m × n) = A (m × k) · B (k × n).
inline std::vector<ld> matmul(const std::vector<ld>& a, const std::vector<ld>& b, std::size_t m,
                              std::size_t k, std::size_t n) {
  std::vector<ld> c(m * n, 0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t l = 0; l < k; ++l)
      for (std::size_t j = 0; j < n; ++j) c[i * n + j] += a[i * k + l] * b[l * n + j];
  return c;
}

inline std::vector<ld> transpose(const std::vector<ld>& a, std::size_t m, std::size_t n) {
  std::vector<ld> t(m * n);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) t[j * m + i] = a[i * n + j];
  return t;
}

// X (n × m) solving S·X = B (S n × n, B n × m) by Gaussian elimination with partial pivoting.
inline std::vector<ld> solve(std::vector<ld> s, std::vector<ld> b, std::size_t n, std::size_t m) {
  for (std::size_t k = 0; k < n; ++k) {
    std::size_t piv = k;
    for (std::size_t r = k + 1; r < n; ++r)
      if (std::fabs(s[r * n + k]) > std::fabs(s[piv * n + k])) piv = r;
    for (std::size_t c = 0; c < n; ++c) std::swap(s[k * n + c], s[piv * n + c]);
    for (std::size_t c = 0; c < m; ++c) std::swap(b[k * m + c], b[piv * m + c]);
    for (std::size_t r = k + 1; r < n; ++r) {
      const ld f = s[r * n + k] / s[k * n + k];
      for (std::size_t c = k; c < n; ++c) s[r * n + c] -= f * s[k * n + c];
      for (std::size_t c = 0; c < m; ++c) b[r * m + c] -= f * b[k * m + c];
    }
  }
  std::vector<ld> x(n * m);
  for (std::size_t k = n; k-- > 0;)
    for (std::size_t c = 0; c < m; ++c) {
      ld v = b[k * m + c];
      for (std::size_t j = k + 1; j < n; ++j) v -= s[k * n + j] * x[j * m + c];
      x[k * m + c] = v / s[k * n + k];
    }
  return x;
}

// n values from N(0, scale²), mt19937(seed), converted to T.
template <class T>
std::vector<T> normal_vector(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(rng));
  return v;
}

}  // namespace gradapt_test

// The backward error and orthogonality of a symmetric eigendecomposition, in long double (the
// host and CUDA eigh tests: tests/test_linalg.cpp, tests/test_linalg_cuda.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradapt_test {

/// Squared Frobenius norms: of A − Q·diag(w)·Qᵀ, of A, and of QᵀQ − I.
struct eigh_errors {
  long double residual = 0, anorm = 0, orthogonality = 0;
};

/// For A (n × n, row-major), its eigenvalues w and eigenvectors Q (the columns of n × n, row-major).
template <class T>
eigh_errors eigh_errors_of(const std::vector<T>& a, const std::vector<T>& q, const std::vector<T>& w,
                           std::int64_t n) {
  eigh_errors e;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      long double s = 0, o = 0;
      for (std::int64_t l = 0; l < n; ++l) {
        s += (long double)q[std::size_t(i * n + l)] * w[std::size_t(l)] * q[std::size_t(j * n + l)];
        o += (long double)q[std::size_t(l * n + i)] * q[std::size_t(l * n + j)];  // (QᵀQ)_ij
      }
      const long double aij = a[std::size_t(i * n + j)];
      e.residual += (aij - s) * (aij - s);
      e.anorm += aij * aij;
      e.orthogonality += (o - (i == j)) * (o - (i == j));
    }
  return e;
}

}  // namespace gradapt_test

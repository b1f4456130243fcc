#pragma once
/// @file
/// The check a loaded Kronecker factor or Shampoo statistic must pass: a running sum or average
/// of Gram matrices, so symmetric (the library writes both triangles as bitwise mirror images),
/// with a diagonal >= 0 and every 2 x 2 principal minor >= 0 (|m_ij|^2 <= m_ii m_jj, with 1e-3
/// relative room for rounding). O(n^2), no factorisation: it rejects what no run can produce
/// (a corrupted or hand-edited checkpoint behind a valid checksum), not every indefinite matrix.

#include <cstddef>
#include <sstream>
#include <string>

namespace gradapt::detail::linalg {

/// Empty when the row-major n x n matrix m passes; else what fails, naming the elements.
template <class E>
std::string gram_violation(const E* m, std::size_t n) {
  std::ostringstream out;
  for (std::size_t i = 0; i < n; ++i)
    if (!(m[i * n + i] >= E(0))) {
      out << "has diagonal element " << i << " = " << m[i * n + i] << " (expected >= 0)";
      return out.str();
    }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j) {
      const E a = m[i * n + j], b = m[j * n + i];
      if (!(a == b)) {
        out << "is not symmetric: element (" << i << ", " << j << ") is " << a << " but (" << j << ", " << i
            << ") is " << b;
        return out.str();
      }
      const double c = static_cast<double>(a);
      const double bound = static_cast<double>(m[i * n + i]) * static_cast<double>(m[j * n + j]);
      if (!(c * c <= bound * (1.0 + 1e-3) + 1e-300)) {
        out << "is not positive semi-definite: element (" << i << ", " << j << ") is " << a
            << " but the diagonal holds " << m[i * n + i] << " and " << m[j * n + j]
            << " (expected |m_ij|^2 <= m_ii m_jj)";
        return out.str();
      }
    }
  return {};
}

}  // namespace gradapt::detail::linalg

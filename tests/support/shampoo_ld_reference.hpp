// Root-inverse and eigenvalue-corrected Shampoo's directions for one matrix parameter, kept in
// long double and written from the formulas (no library code). Both accumulate the statistics
// L ← L + G·Gᵀ and R ← R + Gᵀ·G (β2 = 1, no bias correction) and decompose them with a cyclic
// Jacobi eigensolver. Root-inverse: roots (A + ε·I)^(-1/4) of the eigenvalues clamped at 0,
// direction L^(-1/4)·G·R^(-1/4). Eigenvalue-corrected (no first moment, bases refreshed every
// step, eigenvectors in ascending order of their eigenvalues): r = Q_Lᵀ·G·Q_R in the bases of
// this step's statistics, V ← V + r², direction Q_L·(r / (√V + ε))·Q_Rᵀ. The long double state
// stays in a separately compiled file
// (shampoo_ld_reference.cpp), so that CUDA translation units, where long double is not
// supported, can use it through doubles.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace gradapt_test {

class shampoo_ld_reference {
 public:
  /// For an m × n parameter and the absolute ridge eps.
  shampoo_ld_reference(std::size_t m, std::size_t n, double eps);
  ~shampoo_ld_reference();
  shampoo_ld_reference(const shampoo_ld_reference&) = delete;
  shampoo_ld_reference& operator=(const shampoo_ld_reference&) = delete;
  /// Accumulates the statistics of g (m × n, row-major) and returns the step's direction.
  std::vector<double> direction(const std::vector<double>& g);
  /// Root-inverse with its roots one step stale (root_staleness 1, roots every step): the
  /// direction of g with the roots of the statistics up to the previous step (g itself at the
  /// first), then g's statistics added and their roots kept for the next call.
  std::vector<double> stale_direction(const std::vector<double>& g);
  /// The same for eigenvalue-corrected Shampoo (its own statistics and V).
  std::vector<double> corrected_direction(const std::vector<double>& g);

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace gradapt_test

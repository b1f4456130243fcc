// K-FAC's preconditioned gradient for one layer, kept in long double and written from the
// formulas (no library code): factors from the identity, A ← d·A + (1 − d)·âᵀâ / rows
// (â = [a | 1] with a bias) and G ← d·G + (1 − d)·gᵀg / (rows·s²) at every step; at
// decomposition steps a snapshot of both; the step's direction for M = [W | b]
// (out × (in [+1])) from the snapshot: the inverse method's V = (G_s + λI)⁻¹·M·(A_s + λI)⁻¹
// (linear solves), or the eigen method's V = Q_G·[(Q_Gᵀ·M·Q_A) ⊘ (d_G·d_Aᵀ + λ)]·Q_Aᵀ (cyclic
// Jacobi eigendecompositions, eigenvalues clamped at 0: the damping added to the Kronecker
// product's eigenvalues). The long double state stays in a separately compiled file
// (kfac_ld_reference.cpp), so that CUDA translation units, where long double is not
// supported, use it through doubles.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace gradapt_test {

class kfac_ld_reference {
 public:
  /// A layer of `in` inputs and `out` outputs (and a bias), factor decay d and damping λ.
  kfac_ld_reference(std::size_t in, std::size_t out, bool bias, double decay, double damping);
  ~kfac_ld_reference();
  kfac_ld_reference(const kfac_ld_reference&) = delete;
  kfac_ld_reference& operator=(const kfac_ld_reference&) = delete;
  /// One step's factor update from a (rows × in) and g (rows × out, scaled by s), row-major.
  void update(const std::vector<double>& a, const std::vector<double>& g, std::size_t rows, double s);
  /// The factors as they are now become the ones the directions use.
  void decompose();
  /// V for the weight gradient w (out × in) and bias gradient b (out; empty without a bias):
  /// out × (in [+1]), the bias's column last; the eigen method's or the inverse method's.
  std::vector<double> direction(const std::vector<double>& w, const std::vector<double>& b, bool eigen) const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace gradapt_test

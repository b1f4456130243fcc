#pragma once
/// @file
/// `shampoo_options`, the options of `gradapt::shampoo` (shampoo.hpp, whose `validate` checks
/// them).

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>
#include <vector>

#include "gradapt/core/enum_name.hpp"

#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/linalg/newton_schulz.hpp"
#include "gradapt/optim/shampoo_grafting.hpp"

namespace gradapt {

/// Which end of a tensor's shape `merge_small_dims` starts from.
enum class shampoo_merge : unsigned char {
  first,  ///< from the first dimension (scalable_shampoo): [64, 32, 3, 3] → [64, 288] at 1024
  last,   ///< from the last one (Distributed Shampoo's merge_small_dims): [3, 3, 32, 64] → [288, 64]
};

/// How the eigen root treats the smallest eigenvalues of a factor, which rounding can make
/// slightly negative (a rank-deficient statistic has exact zeros). With λ the eigenvalues and
/// r the ridge:
enum class shampoo_spectrum : unsigned char {
  clamp,  ///< (max(λ, 0) + r)^(−1/p) (gradapt's inverse_pth_root)
  shift,  ///< Distributed Shampoo's perturbation (PerturbationConfig, perturb_before_computation):
          ///< μ = eig(S + r·I); when min μ < r, μ ← μ − min μ + r; then μ^(−1/p)
};

/// Which member of the Shampoo family the blocks use (Distributed Shampoo's
/// `preconditioner_config`); docs/algorithms/shampoo.md gives each one's formulas.
enum class shampoo_preconditioner : unsigned char {
  root_inverse,          ///< Shampoo: D = M̂ ×₁ P_1 … ×ₖ P_k with P_d = S_d^(−1/p)
                         ///< (RootInvShampooPreconditionerConfig)
  eigenvalue_corrected,  ///< SOAP / eigenvalue-corrected Shampoo: Adam's second moment in the
                         ///< eigenbasis of the factors (EigenvalueCorrectedShampooPreconditionerConfig)
  spectral_descent,      ///< Muon: the Newton–Schulz orthogonalization of each 2-D block of M̂
                         ///< (SpectralDescentPreconditionerConfig); no statistics
};

/// How eigenvalue-corrected Shampoo refreshes its eigenbases.
enum class shampoo_eigenbasis : unsigned char {
  eigh,  ///< a full symmetric eigendecomposition (EighEigendecompositionConfig)
  qr,    ///< `qr_iterations` steps of QR power iteration warm-started from the current basis
         ///< (QREigendecompositionConfig; SOAP's)
};

/// The names of a merge direction and of a spectrum treatment, for messages and checkpoints.
constexpr std::string_view to_string(shampoo_merge m) {
  return detail::enum_name(m, std::array<std::string_view, 2>{"first", "last"});
}
/// See above.
constexpr std::string_view to_string(shampoo_spectrum s) {
  return detail::enum_name(s, std::array<std::string_view, 2>{"clamp", "shift"});
}
/// See above.
constexpr std::string_view to_string(shampoo_preconditioner p) {
  return detail::enum_name(
      p, std::array<std::string_view, 3>{"root_inverse", "eigenvalue_corrected", "spectral_descent"});
}
/// See above.
constexpr std::string_view to_string(shampoo_eigenbasis e) {
  return detail::enum_name(e, std::array<std::string_view, 2>{"eigh", "qr"});
}

/// One entry of `shampoo_options::inverse_exponents` (Distributed Shampoo's
/// inverse_exponent_override: order → exponent, or order → {dimension → exponent}, with the
/// exponent written here as p of the root −1/p, the peer's exponent being 1/p).
struct shampoo_exponent {
  std::size_t order = 0;  ///< blocks with this many factors (merged dimensions), 1 to max_rank
  int dimension = -1;  ///< that factor (0-based) only, or −1: every factor of the order without its own entry
  int p = 0;           ///< root −1/p (p >= 1); 0: the factor is not preconditioned (the peer's 0.0)
};

/// Options of `gradapt::shampoo`, e.g. `gradapt::shampoo({.lr = 1e-3, .graft = shampoo_graft::adam})`.
/// The constructor validates them and throws gradapt::error naming a bad one.
struct shampoo_options {
  /// η, finite and >= 0. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// Largest side of a preconditioned block (>= 1): each dimension of the (merged) shape is cut
  /// into pieces of at most this many indices. Default 1024.
  std::int64_t max_preconditioner_dim = 1024;
  /// Merge consecutive dimensions while their product stays <= max_preconditioner_dim
  /// (scalable_shampoo's merge_small_dims: [64, 32, 3, 3] → [64, 288]). Dimensions of size 1
  /// are dropped either way. Default true.
  bool merge_small_dims = true;
  /// A tensor with a dimension larger than this (before merging) is preconditioned by the
  /// graft alone (>= 1). Default 4096.
  std::int64_t skip_preconditioning_dim_size_gt = 4096;
  /// β2 of the statistics, in (0, 1]: 1 sums them (S ← S + X·Xᵀ), below 1 keeps an EMA
  /// (S ← β2·S + (1 − β2)·X·Xᵀ). Default 1.
  double beta2 = 1.0;
  /// Update the statistics at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t statistics_frequency = 1;
  /// Recompute the roots at steps t >= start with (t − start) mod this == 0 (>= 1). Default 1.
  std::uint64_t precondition_frequency = 1;
  /// First step that computes roots and preconditions (>= 1); earlier steps take the grafted
  /// method's direction. Default 1.
  std::uint64_t start_preconditioning_step = 1;
  /// p of the roots P = (S + r·I)^(−1/p); 0 means p = 2k for a block with k factors (4 for a
  /// matrix). Default 0. `inverse_exponents` entries take precedence.
  int inverse_exponent_override = 0;
  /// Per block order (and per factor) exponents, Distributed Shampoo's inverse_exponent_override
  /// map: for factor d of a block with k factors, the entry {k, d, p} if any, else {k, −1, p},
  /// else inverse_exponent_override, else 2k. p = 0 leaves that factor unpreconditioned (no
  /// statistic, identity root). At most one entry per (order, dimension). Default empty.
  std::vector<shampoo_exponent> inverse_exponents = {};
  /// β1 of a first moment of the gradient kept before the preconditioner (Distributed Shampoo's
  /// betas[0]): m ← m + (1 − β1)·(g − m), and m (divided by 1 − β1^t with `bias_correction`) is
  /// what is preconditioned and grafted; the statistics and the graft's state still take g.
  /// In [0, 1); 0 keeps no buffer and uses g. Default 0 (the peer's default is 0.9).
  double beta1 = 0.0;
  /// Distributed Shampoo's use_bias_correction: the first moment is divided by 1 − β1^t, and with
  /// beta2 < 1 the statistics by 1 − β2^u (u: statistics updates so far) before their roots.
  /// Default false (the peer's default is true).
  bool bias_correction = false;
  /// Tensors with one dimension larger than 1 (biases, norm scales; with merging, any tensor
  /// whose dimensions merge into one) get full-matrix blocks (k = 1, p = 2: the peer's treatment)
  /// instead of the graft alone. Default false.
  bool precondition_1d = false;
  /// Which end `merge_small_dims` starts from. Default first (the peer merges from the last).
  shampoo_merge merge_from = shampoo_merge::first;
  /// The eigen root's treatment of the smallest eigenvalues (root.method eigen only).
  /// Default clamp (the peer shifts).
  shampoo_spectrum spectrum = shampoo_spectrum::clamp;
  /// How the roots are computed: method (eigen or coupled Newton), ridge ε and its kind
  /// (absolute r = ε, relative r = ε·λ_max), Newton's stopping rules (see linalg/matrix_root.hpp).
  /// Default: eigendecomposition with a relative ridge of 1e-6.
  inverse_root_options root = {};
  /// Which member of the family the blocks use (see shampoo_preconditioner). Default
  /// root_inverse (Shampoo).
  shampoo_preconditioner preconditioner = shampoo_preconditioner::root_inverse;
  /// Spectral descent: the Newton–Schulz iteration of each block, X₀ = M̂ / max(‖M̂‖_F, ε)
  /// (linalg/newton_schulz.hpp). Default: 5 steps of (3.4445, −4.7750, 2.0315), ε = 1e-8.
  newton_schulz_options newton_schulz = {.epsilon = 1e-8};
  /// Spectral descent: multiply each orthogonalized block by √max(1, rows / cols) (the Muon
  /// recipe's `scale_by_dims_fn`). Default false (the peer's default: 1).
  bool scale_by_aspect = false;
  /// Eigenvalue-corrected: how the eigenbases are refreshed. Default eigh.
  shampoo_eigenbasis eigenbasis = shampoo_eigenbasis::eigh;
  /// Eigenvalue-corrected with eigenbasis qr: QR iterations per refresh (>= 1). Default 1.
  std::uint32_t qr_iterations = 1;
  /// Eigenvalue-corrected with eigenbasis qr: stop iterating once the rotated factor's
  /// off-diagonal Frobenius norm is at most this fraction of its norm (>= 0). Default 0.
  double qr_tolerance = 0.0;
  /// Eigenvalue-corrected: p of the corrected second moment's root, M̂' / ((V / c)^(1/p) + ε)
  /// (> 0). Default 2.
  double corrected_exponent = 2.0;
  /// Graft the preconditioned blocks' direction to the graft's norm (false: the graft method
  /// only takes the tensors the preconditioner does not, the peer's Muon recipe). Default true.
  bool graft_preconditioned = true;
  /// A block whose roots fail this many root computations in a row (a non-finite statistic,
  /// no convergence, an eigensolver failure) makes the step throw (>= 1). Default 10.
  std::uint64_t max_consecutive_failures = 10;
  /// Roots in a background host thread: 0 computes them inside the step at which they are due.
  /// With s >= 1 that step t copies the statistics and starts their roots in the state's worker
  /// thread; steps t .. t + s − 1 precondition with the roots they already have, and step t + s
  /// installs the new ones (waiting for the thread if it has not finished). At most
  /// precondition_frequency. Default 0.
  std::uint64_t root_staleness = 0;
  /// With root_staleness >= 1: true installs new roots at exactly step t + s, so a run's bits do
  /// not depend on how fast the thread is; false installs them at the first step after the
  /// thread has finished (at the latest t + s): fresher roots, but the step at which they take
  /// effect depends on timing. The distributed step needs true. Default true.
  bool deterministic_roots = true;
  /// The grafted method (step size of every block, and the diagonal tensors' method).
  /// Default adagrad.
  shampoo_graft graft = shampoo_graft::adagrad;
  /// β of the rmsprop and adam grafts, in [0, 1). Default 0.999.
  double graft_beta2 = 0.999;
  /// ε of the adagrad, rmsprop and adam grafts, finite and > 0. Default 1e-10.
  double graft_epsilon = 1e-10;
  /// μ of the SGD chain's momentum, in [0, 1]; 0 keeps no buffer. Default 0.
  double momentum = 0.0;
  /// Nesterov momentum (needs momentum > 0). Default false.
  bool nesterov = false;
  /// λ, finite and >= 0, added to the direction before momentum. Default 0.
  double weight_decay = 0.0;
  /// Returns true for parameter names that get no decay (in addition to
  /// `param_flags::skip_weight_decay`). Default empty.
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// The options that reproduce facebookresearch/optimizers' DistributedShampoo constructed with
/// its defaults (commit f60660661194de26d3ee78bae6d15820ff8e583d): lr 1e-2, betas (0.9, 1.0),
/// epsilon 1e-12 (absolute), use_bias_correction, max_preconditioner_dim 1024, merging from the
/// last dimension, 1-D tensors preconditioned, precondition_frequency 1 with
/// start_preconditioning_step −1 (= 1), eigen roots with the shifted spectrum and the double
/// retry, exponents 1/(2k), no grafting, no momentum, no weight decay, 3 tolerated failures
/// (the fourth in a row throws), and no size limit (the peer has no
/// skip_preconditioning_dim_size_gt). docs/algorithms/shampoo.md lists what is not matched.
inline shampoo_options distributed_shampoo_defaults() {
  shampoo_options o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 1.0;
  o.bias_correction = true;
  o.max_preconditioner_dim = 1024;
  o.merge_small_dims = true;
  o.merge_from = shampoo_merge::last;
  o.precondition_1d = true;
  o.skip_preconditioning_dim_size_gt = std::numeric_limits<std::int64_t>::max();
  o.statistics_frequency = 1;
  o.precondition_frequency = 1;
  o.start_preconditioning_step = 1;
  o.root.method = root_method::eigen;
  o.root.ridge = ridge_kind::absolute;
  o.root.epsilon = 1e-12;
  o.root.retry_in_double = true;
  o.spectrum = shampoo_spectrum::shift;
  o.max_consecutive_failures = 4;
  o.graft = shampoo_graft::none;
  o.momentum = 0.0;
  o.weight_decay = 0.0;
  return o;
}

/// Distributed Shampoo's defaults with its `DefaultSpectralDescentPreconditionerConfig`
/// (spectral descent, Muon's orthogonalization): `distributed_shampoo_defaults()` with
/// preconditioner spectral_descent, 5 Newton–Schulz steps of (3.4445, −4.7750, 2.0315) with the
/// norm clamped at 1e-8, no aspect scaling, and the graft (none) only for the tensors that are
/// not orthogonalized. Blocks are merged from the last dimension down to two dimensions;
/// tensors that do not become 2-D (biases) take the graft alone, where the peer raises an error.
inline shampoo_options spectral_descent_defaults() {
  shampoo_options o = distributed_shampoo_defaults();
  o.preconditioner = shampoo_preconditioner::spectral_descent;
  o.precondition_1d = false;  // (1-D tensors are never orthogonalized)
  o.newton_schulz = {};
  o.newton_schulz.epsilon = 1e-8;
  o.scale_by_aspect = false;
  o.graft_preconditioned = false;
  return o;
}

/// Distributed Shampoo's defaults with its `DefaultEigenvalueCorrectedShampooConfig`
/// (eigenvalue-corrected Shampoo with eigendecompositions): `distributed_shampoo_defaults()`
/// with preconditioner eigenvalue_corrected, eigenbasis eigh, corrected_exponent 2.
inline shampoo_options eigenvalue_corrected_defaults() {
  shampoo_options o = distributed_shampoo_defaults();
  o.preconditioner = shampoo_preconditioner::eigenvalue_corrected;
  o.eigenbasis = shampoo_eigenbasis::eigh;
  o.corrected_exponent = 2.0;
  return o;
}

/// Distributed Shampoo's defaults with its `DefaultSOAPConfig` (SOAP: the eigenbases refreshed
/// by one QR power iteration, warm-started, tolerance 0): `eigenvalue_corrected_defaults()`
/// with eigenbasis qr.
inline shampoo_options soap_defaults() {
  shampoo_options o = eigenvalue_corrected_defaults();
  o.eigenbasis = shampoo_eigenbasis::qr;
  o.qr_iterations = 1;
  o.qr_tolerance = 0.0;
  return o;
}

}  // namespace gradapt

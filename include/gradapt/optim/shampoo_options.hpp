#pragma once
/// @file
/// `shampoo_options`, the options of `gradapt::shampoo` (shampoo.hpp, whose `validate` checks
/// them).

#include <cstdint>
#include <functional>
#include <string_view>

#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/optim/shampoo_grafting.hpp"

namespace gradapt {

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
  /// matrix). Default 0.
  int inverse_exponent_override = 0;
  /// How the roots are computed: method (eigen or coupled Newton), ridge ε and its kind
  /// (absolute r = ε, relative r = ε·λ_max), Newton's stopping rules (see linalg/matrix_root.hpp).
  /// Default: eigendecomposition with a relative ridge of 1e-6.
  inverse_root_options root = {};
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

}  // namespace gradapt

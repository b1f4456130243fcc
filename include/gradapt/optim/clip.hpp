#pragma once
/// @file
/// Gradient clipping by global norm (Pascanu, Mikolov and Bengio 2013, "On the difficulty of
/// training recurrent neural networks", ICML; arXiv:1211.5063, section 3.2).
///
/// The global norm is the L2 norm of all gradient tensors taken together, as if they were
/// concatenated into one vector:
///
///     ‖g‖ = sqrt( Σ_t Σ_i g_ti² )            (accumulated in double, fixed order)
///     f   = max_norm / (‖g‖ + eps)
///     g  ← g · f     when f < 1;  g untouched otherwise
///
/// so that the clipped gradient has norm max_norm (exactly, up to rounding, with eps = 0).
///
/// How the peers define it (facts read from their sources):
///  - PyTorch `torch.nn.utils.clip_grad_norm_`: f = max_norm / (‖g‖ + 1e-6) clamped to at most
///    1, and the gradients are always multiplied by the clamped f (f = 1 leaves them equal).
///    The norm is computed in the gradients' dtype. A NaN norm gives f = NaN (every gradient
///    becomes NaN) and an inf norm gives f = 0 (finite entries become 0, inf entries NaN),
///    unless `error_if_nonfinite=True` raises. max_norm = 0 zeroes the gradients.
///  - optax `clip_by_global_norm`: g unchanged when ‖g‖ < max_norm, else g / ‖g‖ · max_norm
///    (no eps; at ‖g‖ = max_norm the division is still applied). max_norm = 0 with a zero
///    gradient gives 0/0 = NaN.
///
/// gradapt's choice: optax's rule with an optional `eps` (0 by default, 1e-6 reproduces
/// PyTorch: its f = 1 multiplication is the identity), the norm in double, and the corner
/// cases defined so that no NaN is ever produced from finite input:
///  - ‖g‖ <= max_norm (eps = 0): untouched, no pass over memory;
///  - max_norm = 0: a non-zero gradient is set to zero (f = 0); a zero gradient stays zero;
///  - zero gradient or empty list: untouched, returns 0;
///  - max_norm = +inf: never clips;
///  - non-finite ‖g‖ (an inf or NaN element, or a double sum of squares that overflows): the
///    gradients are left untouched and the non-finite norm is returned for the caller to act
///    on (skip the step), or, with `error_if_nonfinite`, gradapt::error is thrown naming the
///    first tensor with non-finite elements.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Options of clip_by_global_norm, e.g. `gradapt::clip_options{.error_if_nonfinite = true}`.
///
/// | name               | type   | default | meaning                                                    |
/// |--------------------|--------|---------|------------------------------------------------------------|
/// | eps                | double | 0       | f = max_norm / (‖g‖ + eps); 1e-6 reproduces PyTorch         |
/// | error_if_nonfinite | bool   | false   | throw on an inf/NaN norm (else: leave untouched, return it) |
struct clip_options {
  double eps = 0.0;                 ///< >= 0, finite
  bool error_if_nonfinite = false;  ///< throw gradapt::error when the global norm is not finite
};

namespace detail::clip {

/// g ← g · factor in the compute type (the factor rounded to float for float/half/bfloat16).
struct scale_by {
  double factor;
  template <class C>
  GRADAPT_HD GRADAPT_INLINE void operator()(C& g) const {
    g = g * static_cast<C>(factor);
  }
};

inline std::string check_args(double max_norm, const clip_options& o, const char* fn) {
  if (!(max_norm >= 0.0))
    return message(fn, ": max_norm is ", max_norm, " (expected >= 0; +inf disables clipping)");
  if (!(std::isfinite(o.eps) && o.eps >= 0.0))
    return message(fn, ": eps is ", o.eps, " (expected a finite value >= 0; 0 or PyTorch's 1e-6)");
  return {};
}

/// Names the first tensor that holds inf/NaN (error path only: allocates a per-tensor buffer).
template <class B, class L>
std::string describe_nonfinite(const B& b, const L& grads) {
  const std::size_t count = std::ranges::size(grads);
  std::vector<double> per(count);
  const double total = b.reduce(reduction::count_nonfinite, grads, std::span<double>(per));
  for (std::size_t t = 0; t < count; ++t)
    if (per[t] > 0.0)
      return message("tensor ", t, " of ", count, " holds ", per[t], " inf/NaN element(s) (", total,
                     " in all tensors)");
  return message("all ", count, " tensors are finite, but their sum of squares overflows double");
}

}  // namespace detail::clip

/// Clip factor for a global norm: f = max_norm / (norm + eps) when that is < 1 and norm is
/// finite and > 0, else 1 (no clipping). max_norm = 0 gives 0 for any finite norm > 0.
inline double clip_factor(double norm, double max_norm, double eps = 0.0) {
  if (!std::isfinite(norm) || !(norm > 0.0)) return 1.0;
  const double f = max_norm / (norm + eps);
  return f < 1.0 ? f : 1.0;
}

/// Global L2 norm of a list of tensors: sqrt of the backend's sum of squares over all tensors
/// (double accumulation, fixed order: bitwise reproducible for any thread count).
template <backend B, class L>
requires view_list<L, typename B::space>
double global_norm(const B& b, const L& grads) {
  return std::sqrt(b.reduce(reduction::sum_squares, grads, std::span<double>{}));
}

/// Clips `grads` in place to global norm `max_norm` (see the file comment for the exact rule
/// and the corner cases) and returns the global norm BEFORE clipping.
///
/// Cost: one read pass (the norm) and, only when clipping, one read-write pass.
/// @throws gradapt::error when max_norm < 0 or NaN, eps is negative or not finite, or (with
///         error_if_nonfinite) the norm is inf or NaN
template <backend B, class L>
requires view_list<L, typename B::space>
double clip_by_global_norm(const B& b, const L& grads, double max_norm, const clip_options& options = {}) {
  constexpr const char* fn = "clip_by_global_norm";
  static_assert(!std::is_const_v<typename std::remove_cvref_t<std::ranges::range_value_t<L>>::element_type>,
                "gradapt::clip_by_global_norm clips in place: pass views of mutable gradients");
  const std::string e = detail::clip::check_args(max_norm, options, fn);
  if (!e.empty()) throw error(e);
  const double norm = global_norm(b, grads);
  if (!std::isfinite(norm)) {
    if (options.error_if_nonfinite)
      detail::fail(fn, ": the global gradient norm is ", norm, ": ",
                   detail::clip::describe_nonfinite(b, grads),
                   ". Skip this step (a loss_scaler's unscale reports overflows), fix the gradients, or set "
                   "error_if_nonfinite = false to leave them untouched and get the norm back");
    return norm;
  }
  const double f = clip_factor(norm, max_norm, options.eps);
  if (f < 1.0) b.apply_list(detail::clip::scale_by{f}, grads);
  return norm;
}

/// Sharded form: the gradients are split across the ranks of `comm` (each rank holds a
/// disjoint part, as in ZeRO-style sharding), so the global norm is sqrt of the SUM over
/// ranks of the local sums of squares (one allreduce of two doubles in host memory, so `comm`
/// is a host communicator; the gradients may live wherever the backend runs). Every rank clips its
/// part by the same factor and gets the same norm. Do not use it on replicated (already
/// averaged) gradients: their norm is the local one, use the non-collective form.
///
/// Invalid arguments on any rank make every rank throw (agreed through the same allreduce).
/// With error_if_nonfinite every rank throws; the message says whether this rank's part holds
/// the inf/NaN.
template <backend B, communicator C, class L>
requires view_list<L, typename B::space> && std::same_as<typename C::space, host_space>
double clip_by_global_norm(const B& b, C& comm, const L& grads, double max_norm,
                           const clip_options& options = {}) {
  constexpr const char* fn = "clip_by_global_norm";
  static_assert(!std::is_const_v<typename std::remove_cvref_t<std::ranges::range_value_t<L>>::element_type>,
                "gradapt::clip_by_global_norm clips in place: pass views of mutable gradients");
  const std::string e = detail::clip::check_args(max_norm, options, fn);
  const double local = e.empty() ? b.reduce(reduction::sum_squares, grads, std::span<double>{}) : 0.0;
  double buf[2] = {local, e.empty() ? 0.0 : 1.0};
  comm.allreduce(tensor_view<double, host_space>::vector(buf, 2), reduce_op::sum);
  if (!e.empty()) throw error(e);
  detail::require(buf[1] == 0.0, fn, " on rank ", comm.rank(), ": ", buf[1],
                  " other rank(s) passed invalid arguments (see the error raised on those ranks)");
  const double norm = std::sqrt(buf[0]);
  if (!std::isfinite(norm)) {
    if (options.error_if_nonfinite)
      detail::fail(fn, " on rank ", comm.rank(), ": the global gradient norm over ", comm.size(),
                   " ranks is ", norm, "; on this rank ",
                   std::isfinite(local) ? std::string("the local part is finite (another rank's is not)")
                                        : detail::clip::describe_nonfinite(b, grads),
                   ". Skip this step, fix the gradients, or set error_if_nonfinite = false");
    return norm;
  }
  const double f = clip_factor(norm, max_norm, options.eps);
  if (f < 1.0) b.apply_list(detail::clip::scale_by{f}, grads);
  return norm;
}

}  // namespace gradapt

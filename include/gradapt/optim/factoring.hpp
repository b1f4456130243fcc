#pragma once
/// @file
/// How the factored optimizers see a tensor (gradapt::adafactor, gradapt::sm3 and the
/// chain stages transform::scale_by_factored_rms and transform::scale_by_sm3): the choice of
/// the two factored axes, the [A, X, B, Y, C] view, what a factored stage keeps per tensor,
/// and the per-tensor scheduling on backends with `run_tasks`. Needs only the core headers,
/// so chain.hpp (which runs factored stages) and factored.hpp both include it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// How a factored optimizer picks the two axes of a tensor of rank >= 2.
enum class factor_axes : unsigned char {
  largest_two,  ///< the two largest dims (optax; ties go to the later axis)
  last_two      ///< the last two dims (torch.optim.Adafactor)
};

namespace detail::optim {

/// The factoring of one tensor: its [A, X, B, Y, C] view and which axis is the "largest"
/// (d0 in optax's `_factored_dims`, whose statistic is the normalised one).
struct factoring {
  bool factored = false;
  std::array<std::int64_t, 5> d{1, 1, 1, 1, 1};
  bool largest_is_y = true;  ///< d0 (the axis optax's v_row removes) is the Y axis
};

/// optax's `_factored_dims` (ties: np.argsort's stable order, so the later of two equal
/// dims is the larger) or torch's last-two rule; `min_dim` applies to the smaller of the two.
inline factoring factor_of(std::span<const std::int64_t> shape, bool enabled, factor_axes rule,
                           std::int64_t min_dim) {
  factoring f;
  const std::size_t r = shape.size();
  if (!enabled || r < 2) return f;
  std::size_t d0 = 0, d1 = 0;  // largest, second largest
  if (rule == factor_axes::last_two) {
    d0 = r - 1;
    d1 = r - 2;
  } else {
    std::array<std::size_t, max_rank> idx{};
    for (std::size_t k = 0; k < r; ++k) idx[k] = k;
    // A stable insertion sort by size (at most max_rank entries; no allocation, unlike
    // std::stable_sort, so a step may call this).
    for (std::size_t k = 1; k < r; ++k)
      for (std::size_t m = k; m > 0 && shape[idx[m]] < shape[idx[m - 1]]; --m) std::swap(idx[m], idx[m - 1]);
    d0 = idx[r - 1];
    d1 = idx[r - 2];
  }
  if (std::min(shape[d0], shape[d1]) < min_dim) return f;
  const std::size_t p = std::min(d0, d1), q = std::max(d0, d1);
  f.factored = true;
  f.largest_is_y = d0 == q;
  std::int64_t a = 1, b = 1, c = 1;
  for (std::size_t k = 0; k < p; ++k) a *= shape[k];
  for (std::size_t k = p + 1; k < q; ++k) b *= shape[k];
  for (std::size_t k = q + 1; k < r; ++k) c *= shape[k];
  f.d = {a, shape[p], b, shape[q], c};
  return f;
}

}  // namespace detail::optim

/// What a factored chain stage (transform::scale_by_factored_rms, transform::scale_by_sm3)
/// decides for one tensor when the chain's state is created.
struct factored_tensor {
  /// True: the chain runs this tensor's passes through the backend's `apply_factored` over
  /// the [A, X, B, Y, C] view `d`, with the stage's row and column factors; false: the stage
  /// is element-wise for this tensor, with a full-size buffer.
  bool factored = false;
  std::array<std::int64_t, 5> d{1, 1, 1, 1, 1};  ///< the [A, X, B, Y, C] view (factored tensors)
  std::size_t state = 0;                         ///< elements of the stage's buffer for this tensor
  std::size_t ws = 0;       ///< workspace elements (state type): row factors A·X·B·C, then column factors
  std::size_t ws_sums = 0;  ///< workspace doubles (the stage's row and column sums)
  std::size_t rows = 0;     ///< A·X·B·C: the row factors' length
  std::size_t cols = 0;     ///< A·B·Y·C: the column factors' length
  bool variant =
      false;  ///< passed to the stage's `y<Variant>` (Adafactor: the column factor multiplies first)
  /// Adafactor's normalisation (scale_by_factored_rms): the normalised statistic seen as the
  /// [d0, d1, d2] view whose middle dim is reduced, its `groups` sums of `length` values, and
  /// whether it is the row statistic (the larger dim is Y).
  struct normalisation {
    std::array<std::int64_t, 3> d{1, 1, 1};  ///< the view of the normalised statistic
    std::int64_t groups = 0;                 ///< sums taken (d0 · d2)
    std::int64_t length = 0;                 ///< values per sum (d1)
    bool largest_is_y = false;               ///< the normalised statistic is the row one
  };
  /// SM3's covers (scale_by_sm3): the tensor's rank and dims (one cover per dim) and its
  /// widest dim.
  struct cover_dims {
    std::size_t rank = 0;                       ///< covers
    std::array<std::int64_t, max_rank> dims{};  ///< their lengths, in dim order
    std::size_t widest = 0;                     ///< the longest cover
  };
  normalisation norm;  ///< scale_by_factored_rms's data for this tensor
  cover_dims covers;   ///< scale_by_sm3's data for this tensor
};

namespace detail::optim {

/// Per-thread workspace slots a per-tensor step needs on backend b: its thread count on a
/// `task_backend` (the host), else 1.
template <class B>
std::size_t task_slots(const B& b) {
  if constexpr (task_backend<B>)
    return static_cast<std::size_t>(std::max(1, b.thread_count()));
  else
    return 1;
}

/// Calls one(backend, k, slot) for every tensor k of a list whose sizes are `sizes` (`order`:
/// the tensors largest first, `total`: their sum). On a backend with `run_tasks` (the host)
/// (a `task_backend`) and more than one thread: tensors larger than 1/T of the list first, each on all
/// threads, then the others as independent one-thread tasks, largest first, each with its own workspace slot:
/// one parallel region per step instead of several per tensor, and no barrier inside a tensor. A backend's
/// results do not depend on its thread count, so the bits are the same in both modes. Elsewhere: in order,
/// slot 0.
template <class B, class F>
void for_tensors(const B& b, std::span<const std::size_t> order, std::span<const std::size_t> sizes,
                 std::size_t total, std::size_t slots, const F& one) {
  const std::size_t n = sizes.size();
  if constexpr (task_backend<B>) {
    const std::size_t T = std::min(static_cast<std::size_t>(b.thread_count()), slots);
    if (T > 1) {
      for (const std::size_t k : order)
        if (sizes[k] * T > total) one(b, k, 0);
      const B b1 = b.single_thread();
      b.run_tasks(order.size(), T, [&](std::size_t q, std::size_t slot) {
        const std::size_t k = order[q];
        if (sizes[k] * T <= total) one(b1, k, slot);
      });
      return;
    }
  }
  for (std::size_t k = 0; k < n; ++k) one(b, k, 0);
}

/// A one-dimensional view of n elements at p in memory space Space.
template <class Space, class T>
tensor_view<T, Space> vector_view(T* p, std::size_t n) {
  return tensor_view<T, Space>::vector(p, static_cast<std::int64_t>(n));
}
/// The same, read-only.
template <class Space, class T>
tensor_view<const T, Space> const_vector_view(T* p, std::size_t n) {
  return tensor_view<const T, Space>::vector(p, static_cast<std::int64_t>(n));
}

/// vector_view and const_vector_view in memory space Space as a pair of function objects, for
/// `const auto [vec, cvec] = vector_views<space>();` in a stage's backend code.
template <class Space>
constexpr auto vector_views() {
  return std::pair{[](auto* p, std::size_t n) { return vector_view<Space>(p, n); },
                   [](auto* p, std::size_t n) { return const_vector_view<Space>(p, n); }};
}

/// The tensor indices sorted by size, largest first (ties in index order).
inline std::vector<std::size_t> largest_first(std::span<const std::size_t> sizes) {
  std::vector<std::size_t> order(sizes.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t c) { return sizes[a] > sizes[c]; });
  return order;
}

/// Sizes a grow-only backend workspace (gradapt::cuda's) at init for the steps that follow, so
/// that even the first step can be captured into a CUDA graph: a fused pass over the whole
/// list `values` (the parameters' views) with up to `terms` values per element, and
/// `line_sums` doubles (a factored sum's per-line partials plus its result). Backends that are
/// not a `workspace_backend` (the host) need nothing.
template <class B, class View>
void reserve_workspace(const B& b, const std::vector<View>& values, std::size_t terms,
                       std::size_t line_sums) {
  if constexpr (workspace_backend<B>) {
    b.reserve_for(values, terms < 1 ? 1 : terms);
    if (line_sums > 0) b.reserve(line_sums * sizeof(double));
  }
}

}  // namespace detail::optim
}  // namespace gradapt

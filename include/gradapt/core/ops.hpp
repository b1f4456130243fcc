#pragma once
/// @file
/// Operation tags shared by backends and communicators.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "gradapt/core/config.hpp"
#include "gradapt/core/enum_name.hpp"

namespace gradapt {

/// Element reductions a backend computes, always accumulated in double.
enum class reduction : std::uint8_t {
  sum,              ///< sum of x
  sum_squares,      ///< sum of x^2 (squared L2 norm)
  max_abs,          ///< max |x|; NaN if any element is NaN; 0 for an empty tensor
  count_nonfinite,  ///< number of elements that are inf or NaN
};

/// Index of the tensor inside a list, passed first to an `apply_list` functor that asks for it
/// (for per-tensor scalars such as a trust ratio).
struct tensor_index {
  std::size_t value;  ///< zero-based position of the tensor in the list passed to the backend
};

/// K values an `apply_reduce` functor returns for one element; each is summed per tensor in
/// double with the backend's fixed reduction order. A functor with one value returns a plain
/// `double` instead.
template <std::size_t K>
struct terms {
  static_assert(K >= 1, "gradapt::terms needs at least one value");
  double v[K];  ///< the K per-element values, summed independently
  /// Value `k` (0 <= k < K; not bounds-checked, the functor owns the index).
  GRADAPT_HD constexpr double& operator[](std::size_t k) { return v[k]; }
  /// Value `k` (0 <= k < K; not bounds-checked).
  GRADAPT_HD constexpr const double& operator[](std::size_t k) const { return v[k]; }
};

/// Number of values a functor result of type R carries (1 for a scalar, K for terms<K>).
template <class R>
struct terms_size : std::integral_constant<std::size_t, 1> {};
template <std::size_t K>
struct terms_size<terms<K>> : std::integral_constant<std::size_t, K> {};

/// Squared norms returned by a communicator's `allreduce_with_norms` (sum over ranks, in place):
/// what the data-parallel gradient noise scale needs, computed during the reduction itself.
struct allreduce_norms {
  double sum_local_sq = 0.0;  ///< sum over ranks of |x_r|^2, the inputs before the reduction
  double result_sq = 0.0;     ///< |sum_r x_r|^2 of the reduced result as stored
};

/// Combining rule of a collective reduction.
enum class reduce_op : std::uint8_t { sum, max };

/// The enumerator's name ("sum", "sum_squares", "max_abs", "count_nonfinite") for error
/// messages and logs; "unknown" for a value outside the enumeration.
constexpr std::string_view name(reduction r) {
  return detail::enum_name(
      r, std::array<std::string_view, 4>{"sum", "sum_squares", "max_abs", "count_nonfinite"});
}

/// The enumerator's name ("sum" or "max") for error messages and logs.
constexpr std::string_view name(reduce_op r) { return r == reduce_op::sum ? "sum" : "max"; }

namespace detail {
/// dst = src in the compute type (a value copy through the backend's element loop, for memory
/// a host loop cannot touch; a 16-bit signalling NaN becomes quiet).
struct copy_to {
  static constexpr bool vectorizable = true;  ///< host SIMD packs: a copy, the same bits
  template <class C>
  GRADAPT_HD void operator()(C& dst, const C& src) const {
    dst = src;
  }
};

/// g ← g / n in the compute type: the data-parallel mean after a summing collective (the train
/// step's `allreduce_mean`, the bucket reducer and the sharded step share it, so their means
/// have the same bits).
struct divide_by_ranks {
  int n;  ///< the world size
  template <class T>
  GRADAPT_HD void operator()(T& g) const {
    g = g / static_cast<T>(n);
  }
  /// g ← sum / n: the same division, writing elsewhere (a fused buffer's sum into a gradient).
  template <class T>
  GRADAPT_HD void operator()(T& g, const T& sum) const {
    g = sum / static_cast<T>(n);
  }
};

/// g ← g · c in the element type (c rounded to it once): a rank's weight in a weighted mean.
struct multiply_by {
  double c;  ///< the factor
  template <class T>
  GRADAPT_HD void operator()(T& g) const {
    g = g * static_cast<T>(c);
  }
};

/// x ← +0: clears memory a host loop cannot touch (a padded tail on a device).
struct set_zero {
  template <class T>
  GRADAPT_HD void operator()(T& x) const {
    x = T{};
  }
};
}  // namespace detail

}  // namespace gradapt

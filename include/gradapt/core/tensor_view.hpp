#pragma once
/// @file
/// Non-owning, contiguous, row-major views over a framework's own buffers.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt {

/// Memory-space tag: ordinary host memory.
struct host_space {
  static constexpr std::string_view name = "host";  ///< "host", for error messages
};
/// Memory-space tag: CUDA device memory. Host loops never accept views in this space and
/// device kernels never accept host views: the mismatch is a compile error.
struct device_space {
  static constexpr std::string_view name = "device";  ///< "device", for error messages
};

template <class S>
concept memory_space = std::is_same_v<S, host_space> || std::is_same_v<S, device_space>;

/// Largest tensor rank a view describes (rank 0 is a scalar with one element).
inline constexpr int max_rank = 4;

/// A pointer, a row-major contiguous shape of rank 0 to 4, an element type and a memory space.
///
/// The view never owns or copies memory. `T` may be const-qualified for read-only inputs; a
/// `tensor_view<T, S>` converts implicitly to `tensor_view<const T, S>`. Accessors are
/// GRADAPT_HD so a view can be passed by value into a device kernel.
template <class T, memory_space Space = host_space>
requires element<T>
class tensor_view {
 public:
  using element_type = T;                  ///< the element type as given, const included
  using value_type = std::remove_cv_t<T>;  ///< the element type without const
  using space = Space;                     ///< host_space or device_space

  /// An empty rank-1 view (size 0).
  constexpr tensor_view() = default;

  /// A view of `data` with the given shape (rank = number of dims, 0 to 4).
  tensor_view(T* data, std::span<const std::int64_t> shape) : data_(data) { assign(shape); }
  /// The same from a brace list, e.g. `tensor_view<float>(p, {3, 4})`.
  /// @throws gradapt::error for rank > 4, a negative extent, a shape whose byte size overflows
  ///         size_t, or a null `data` with a non-zero element count
  tensor_view(T* data, std::initializer_list<std::int64_t> shape)
      : tensor_view(data, std::span<const std::int64_t>(shape.begin(), shape.size())) {}

  /// A rank-1 view of `n` elements.
  static tensor_view vector(T* data, std::int64_t n) {
    const std::int64_t s[1] = {n};
    return tensor_view(data, std::span<const std::int64_t>(s, 1));
  }
  /// A rank-0 view of one element.
  static tensor_view scalar(T* data) { return tensor_view(data, std::span<const std::int64_t>{}); }

  /// Read-only view of the same memory.
  template <class U = T>
  requires(!std::is_const_v<U>) constexpr operator tensor_view<const U, Space>() const {
    return tensor_view<const U, Space>::from_parts(data_, dims_, rank_, size_);
  }

  /// Pointer to the first element (may be null when the view is empty).
  GRADAPT_HD constexpr T* data() const { return data_; }
  /// Number of elements: the product of the dims (1 for rank 0).
  GRADAPT_HD constexpr std::size_t size() const { return size_; }
  /// True when the view has no elements.
  GRADAPT_HD constexpr bool empty() const { return size_ == 0; }
  /// Number of dimensions, 0 to max_rank.
  GRADAPT_HD constexpr int rank() const { return rank_; }
  /// Extent of dimension `i`; unchecked (precondition 0 <= i < rank()).
  GRADAPT_HD constexpr std::int64_t dim(int i) const { return dims_[static_cast<std::size_t>(i)]; }
  /// The extents, outermost first (empty for rank 0).
  constexpr std::span<const std::int64_t> shape() const {
    return {dims_.data(), static_cast<std::size_t>(rank_)};
  }
  /// Size in bytes: size() * sizeof(T).
  constexpr std::size_t bytes() const { return size_ * sizeof(T); }
  /// Runtime tag of the element type (const ignored), for messages and dtype dispatch.
  static constexpr dtype type() { return dtype_of_v<T>; }

  /// Element access, only for host views.
  constexpr T& operator[](std::size_t i) const requires std::is_same_v<Space, host_space> { return data_[i]; }

  /// The same memory as a rank-1 view.
  constexpr tensor_view flat() const {
    return from_parts(data_, {static_cast<std::int64_t>(size_), 0, 0, 0}, 1, size_);
  }

  /// True when both views have the same rank and dims.
  template <class U>
  constexpr bool same_shape(const tensor_view<U, Space>& o) const {
    if (rank_ != o.rank()) return false;
    for (int i = 0; i < rank_; ++i)
      if (dims_[static_cast<std::size_t>(i)] != o.dim(i)) return false;
    return true;
  }

  /// "[2, 3]" style text of the shape, for messages.
  std::string shape_string() const {
    std::string s = "[";
    for (int i = 0; i < rank_; ++i) {
      if (i) s += ", ";
      s += std::to_string(dims_[static_cast<std::size_t>(i)]);
    }
    return s + "]";
  }

  /// Builds a view from already-validated parts (used for const conversion and flat()).
  static constexpr tensor_view from_parts(T* data, std::array<std::int64_t, max_rank> dims, int rank,
                                          std::size_t size) {
    tensor_view v;
    v.data_ = data;
    v.dims_ = dims;
    v.rank_ = rank;
    v.size_ = size;
    return v;
  }

 private:
  void assign(std::span<const std::int64_t> shape) {
    detail::require(shape.size() <= static_cast<std::size_t>(max_rank), "tensor_view: rank ", shape.size(),
                    " is not supported (expected 0 to ", max_rank, ")");
    rank_ = static_cast<int>(shape.size());
    std::size_t n = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      detail::require(shape[i] >= 0, "tensor_view: dim ", i, " is ", shape[i],
                      " (expected a non-negative extent)");
      const auto d = static_cast<std::size_t>(shape[i]);
      detail::require(d == 0 || n <= std::numeric_limits<std::size_t>::max() / sizeof(T) / d,
                      "tensor_view: shape overflows the address space");
      n *= d;
      dims_[i] = shape[i];
    }
    size_ = n;
    detail::require(data_ != nullptr || size_ == 0, "tensor_view: null data pointer for ", size_,
                    " elements");
  }

  T* data_ = nullptr;
  std::array<std::int64_t, max_rank> dims_{0, 0, 0, 0};
  int rank_ = 1;
  std::size_t size_ = 0;
};

/// Host view of a contiguous range (std::vector, std::array, std::span) as a rank-1 tensor.
template <class R>
requires std::ranges::contiguous_range<R> &&
    element<std::remove_reference_t<std::ranges::range_reference_t<R>>>
auto host_view(R&& r) {
  using T = std::remove_reference_t<std::ranges::range_reference_t<R>>;
  return tensor_view<T, host_space>::vector(std::ranges::data(r),
                                            static_cast<std::int64_t>(std::ranges::size(r)));
}

/// Host view of a contiguous range with an explicit shape.
template <class R>
requires std::ranges::contiguous_range<R>
auto host_view(R&& r, std::initializer_list<std::int64_t> shape) {
  using T = std::remove_reference_t<std::ranges::range_reference_t<R>>;
  tensor_view<T, host_space> v(std::ranges::data(r), shape);
  detail::require(v.size() == std::ranges::size(r), "host_view: shape ", v.shape_string(), " has ", v.size(),
                  " elements but the range holds ", std::ranges::size(r));
  return v;
}

/// True for every tensor_view specialisation.
template <class V>
inline constexpr bool is_tensor_view_v = false;
/// Specialisation that makes is_tensor_view_v true for tensor_view<T, S>.
template <class T, class S>
inline constexpr bool is_tensor_view_v<tensor_view<T, S>> = true;

/// A contiguous range of tensor views in memory space `Space` (a parameter list's values or
/// grads, a std::vector or std::span of views).
template <class R, class Space>
concept view_list = std::ranges::contiguous_range<R> &&
    is_tensor_view_v<std::remove_cvref_t<std::ranges::range_value_t<R>>> &&
    std::is_same_v<typename std::remove_cvref_t<std::ranges::range_value_t<R>>::space, Space>;

}  // namespace gradapt

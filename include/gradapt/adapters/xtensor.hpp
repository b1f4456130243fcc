#pragma once
/// @file
/// Zero-copy tensor views over xtensor's strided storage: `gradapt::view_of(x)` for an
/// xt::xarray, xt::xtensor, xt::xtensor_fixed, the adaptors returned by xt::adapt, and strided
/// views (xt::view, xt::strided_view) whose elements are contiguous in row-major order.
///
/// Shape. The view has the xtensor object's shape, rank 0 to 4 (gradapt's `max_rank`). The
/// elements must be laid out row-major and contiguously: for every axis k with extent > 1 the
/// stride must be the product of the extents after k (xtensor reports stride 0 for axes of
/// extent 1; such axes are free). Column-major containers of rank >= 2, slices that skip
/// elements (a column of a row-major matrix, a step of 2) and broadcast views are rejected with
/// a gradapt::error; evaluate them into a row-major container first (`xt::xarray<float> c =
/// expr;`).
///
/// Element types: float, double, and gradapt's own half / bfloat16 when a container stores
/// them. Constness follows the object (a const container, or an adaptor of const memory,
/// gives a `tensor_view<const T>`). Owning temporaries (an xarray or xtensor rvalue) are
/// rejected at compile time because the view would dangle; adaptors and views passed as
/// rvalues are fine when they do not own their memory (an adaptor built with
/// xt::acquire_ownership() owns it: keep such an adaptor alive while the view is used). The
/// view is valid until the container is resized, reshaped or destroyed.
///
/// **Assign with xt::noalias.** xtensor's plain assignment `a = expr` is aliasing-safe: it
/// evaluates `expr` into a NEW buffer and moves it into `a`, freeing the buffer a view points
/// to. Write `xt::noalias(a) = expr;` (or `a += expr`, element access, std::copy) to update a
/// viewed container in place.
///
/// This header needs xtensor (tested with 0.24) and nothing from gradapt beyond core/.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <xtensor/xtensor_forward.hpp>
#include <xtensor/xutils.hpp>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::xtensor {

/// True for xtensor containers that own their storage (xarray, xtensor, xtensor_fixed): a
/// view of an rvalue dangles. Adaptors (xt::adapt) and views derive from other bases.
template <class D>
inline constexpr bool owns_storage_v = false;
template <class EC, xt::layout_type L, class SC, class Tag>
inline constexpr bool owns_storage_v<xt::xarray_container<EC, L, SC, Tag>> = true;
template <class EC, std::size_t N, xt::layout_type L, class Tag>
inline constexpr bool owns_storage_v<xt::xtensor_container<EC, N, L, Tag>> = true;
template <class ET, class S, xt::layout_type L, bool SH, class Tag>
inline constexpr bool owns_storage_v<xt::xfixed_container<ET, S, L, SH, Tag>> = true;

/// "[2, 3]" text of an xtensor shape or strides, for messages.
template <class R>
std::string list_string(const R& r) {
  std::string s = "[";
  bool first = true;
  for (const auto& v : r) {
    if (!first) s += ", ";
    first = false;
    s += std::to_string(v);
  }
  return s + "]";
}

}  // namespace detail::xtensor

/// xtensor objects with a data interface: `data()`, `data_offset()`, `shape()`, `strides()`.
template <class X>
concept xtensor_strided = requires(const std::remove_cvref_t<X>& x) {
  typename std::remove_cvref_t<X>::value_type;
  x.data();
  x.data_offset();
  x.shape();
  x.strides();
  x.dimension();
}
&&xt::has_data_interface<std::remove_cvref_t<X>>::value;

/// xtensor objects `view_of` accepts: strided, a gradapt element type, and not an owning
/// temporary. `X` is as deduced for a forwarding reference (`C&` for an lvalue, `C` for an
/// rvalue). Layout, strides and rank are run-time properties, checked by `view_of`.
template <class X>
concept xtensor_viewable = xtensor_strided<X> && element<typename std::remove_cvref_t<X>::value_type> &&
    !(detail::xtensor::owns_storage_v<std::remove_cvref_t<X>> && !std::is_lvalue_reference_v<X>);

/// A zero-copy host view of an xtensor object's storage, with the object's shape.
///
/// @param x an xarray, xtensor, xtensor_fixed, xt::adapt adaptor or strided view of float,
///          double, gradapt::half or gradapt::bfloat16
/// @return `tensor_view<T, host_space>` (T const when `x` is read-only) pointing at
///         `x.data() + x.data_offset()`
/// @throws gradapt::error when the rank exceeds 4 or the strides are not the row-major
///         contiguous strides of the shape (the message lists both).
template <class X>
requires xtensor_strided<X>
auto view_of(X&& x) {
  using D = std::remove_cvref_t<X>;
  static_assert(!(detail::xtensor::owns_storage_v<D> && !std::is_lvalue_reference_v<X>),
                "gradapt::view_of: the xtensor container is a temporary; the view would dangle. Pass a "
                "named object.");
  static_assert(element<typename D::value_type>,
                "gradapt::view_of: unsupported xtensor value_type (expected float, double, gradapt::half "
                "or gradapt::bfloat16)");
  using P = std::remove_pointer_t<decltype(x.data())>;  // const E or E
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  const std::size_t rank = x.dimension();
  detail::require(rank <= static_cast<std::size_t>(max_rank), "view_of(xtensor of shape ",
                  detail::xtensor::list_string(shape), "): rank ", rank, " is not supported (expected 0 to ",
                  max_rank, "; reshape it, e.g. flatten the leading axes)");
  std::array<std::int64_t, max_rank> dims{};
  std::size_t size = 1;
  for (std::size_t k = 0; k < rank; ++k) {
    dims[k] = static_cast<std::int64_t>(shape[k]);
    size *= static_cast<std::size_t>(shape[k]);
  }
  if (size > 0) {
    std::int64_t expected = 1;
    for (std::size_t k = rank; k-- > 0;) {
      const auto stride = static_cast<std::int64_t>(strides[k]);
      detail::require(dims[k] <= 1 || stride == expected, "view_of(xtensor of shape ",
                      detail::xtensor::list_string(shape), "): strides are ",
                      detail::xtensor::list_string(strides), " but axis ", k, " needs stride ", expected,
                      " (expected contiguous row-major storage; a column-major container, a strided slice "
                      "or a broadcast is not: copy it into a row-major xt::xarray first)");
      expected *= dims[k];
    }
  }
  P* const data = x.data() + x.data_offset();
  return tensor_view<P, host_space>(data, std::span<const std::int64_t>(dims.data(), rank));
}

}  // namespace gradapt

#pragma once
/// @file
/// Zero-copy tensor views over Thrust's containers and device pointers:
/// `gradapt::view_of(v)` for a thrust::host_vector, device_vector or universal_vector (any
/// container derived from Thrust's vector_base), and `gradapt::view_of(p, n)` for a
/// thrust::device_ptr.
///
/// Memory space. The view's space is the memory the container really uses, decided from its
/// Thrust system at compile time:
///
/// | container (THRUST_DEVICE_SYSTEM)             | view                          |
/// |----------------------------------------------|-------------------------------|
/// | host_vector (any)                            | tensor_view<T, host_space>    |
/// | device_vector, universal_vector, device_ptr (CUDA, the default) | tensor_view<T, device_space> |
/// | device_vector, device_ptr (CPP, OMP or TBB)  | tensor_view<T, host_space>    |
///
/// so a device_vector built for Thrust's OpenMP or sequential device system (host memory)
/// feeds gradapt's host backend, and a CUDA one feeds `gradapt::cuda`; a mix-up is a compile
/// error, as for every tensor_view.
///
/// Shape: rank 1 of the container's size, or an explicit shape whose element count must equal
/// the size (checked). Element types: float, double, gradapt::half and gradapt::bfloat16 (for
/// `__half` / `__nv_bfloat16` storage, see backend/cuda/device_types.cuh). Constness follows
/// the container. Temporaries are rejected at compile time (the view would dangle). The view
/// is valid until the container is resized or destroyed.
///
/// This header contains no CUDA syntax: a host compiler may include it (Thrust's own headers
/// then need the CUDA toolkit's include directory for the CUDA system). It needs nothing from
/// gradapt beyond core/. Tested with the CCCL of CUDA 13 (Thrust 3.0); it relies on Thrust's
/// detail::vector_base, the common base of its vectors.

#include <thrust/detail/vector_base.h>
#include <thrust/device_ptr.h>
#include <thrust/iterator/iterator_traits.h>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::thrust_adapter {

/// gradapt's memory space for memory owned by Thrust system `System`.
template <class System>
struct space_for {
  static constexpr bool host = std::is_convertible_v<System, ::thrust::host_system_tag>;
  static constexpr bool device = std::is_convertible_v<System, ::thrust::device_system_tag>;
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  static constexpr bool cuda_device = device && !host;
#else
  static constexpr bool cuda_device = false;  // the device system runs on the host
#endif
  static_assert(host || device,
                "gradapt/adapters/thrust.hpp: memory of a Thrust system that is neither the host nor "
                "the device system of this build; take a raw pointer and build a tensor_view yourself");
  using type = std::conditional_t<cuda_device, device_space, host_space>;
};

template <class Iterator>
using space_of_t = typename space_for<typename ::thrust::iterator_system<Iterator>::type>::type;

/// True for Thrust vectors (host_vector, device_vector, universal_vector, system vectors).
template <class V>
concept vector = requires {
  typename V::value_type;
  typename V::allocator_type;
}
&&std::is_base_of_v<::thrust::detail::vector_base<typename V::value_type, typename V::allocator_type>, V>;

}  // namespace detail::thrust_adapter

/// Thrust containers `view_of` accepts: a vector of a gradapt element type, not a temporary.
/// `X` is as deduced for a forwarding reference (`V&` for an lvalue, `V` for an rvalue).
template <class X>
concept thrust_viewable = detail::thrust_adapter::vector<std::remove_cvref_t<X>> &&
    element<typename std::remove_cvref_t<X>::value_type> && std::is_lvalue_reference_v<X>;

/// The memory space of the views of Thrust container (or iterator) type `V`.
template <class V>
using thrust_space_t = detail::thrust_adapter::space_of_t<typename std::remove_cvref_t<V>::iterator>;

/// A zero-copy rank-1 view of a Thrust vector, in the vector's memory space.
/// @return `tensor_view<T, Space>` with T const for a const vector (see the file comment for
///         Space)
template <class X>
requires detail::thrust_adapter::vector<std::remove_cvref_t<X>>
auto view_of(X&& v) {
  using V = std::remove_cvref_t<X>;
  static_assert(std::is_lvalue_reference_v<X>,
                "gradapt::view_of: the Thrust vector is a temporary; the view would dangle. Pass a named "
                "vector.");
  static_assert(element<typename V::value_type>,
                "gradapt::view_of: unsupported Thrust value_type (expected float, double, gradapt::half or "
                "gradapt::bfloat16)");
  using P = std::remove_reference_t<decltype(*::thrust::raw_pointer_cast(v.data()))>;
  // Thrust's data() of an empty host_vector dereferences a null iterator: do not call it then.
  P* const data = v.empty() ? nullptr : ::thrust::raw_pointer_cast(v.data());
  return tensor_view<P, thrust_space_t<V>>::vector(data, static_cast<std::int64_t>(v.size()));
}

/// A zero-copy view of a Thrust vector with an explicit row-major shape (rank 0 to 4).
/// @throws gradapt::error when the shape's element count differs from the vector's size
template <class X>
requires detail::thrust_adapter::vector<std::remove_cvref_t<X>>
auto view_of(X&& v, std::initializer_list<std::int64_t> shape) {
  auto flat = view_of(std::forward<X>(v));
  using View = decltype(flat);
  const std::span<const std::int64_t> s(shape.begin(), shape.size());
  View shaped(flat.data(), s);  // validates rank and dims
  detail::require(shaped.size() == flat.size(), "view_of(Thrust vector of ", flat.size(),
                  " elements): shape ", shaped.shape_string(), " holds ", shaped.size(),
                  " elements (expected a shape whose product is the size)");
  return shaped;
}

/// A zero-copy rank-1 view of `n` elements at a thrust::device_ptr (device_space under the
/// CUDA device system, host_space under CPP/OMP/TBB).
template <class T>
requires element<T>
auto view_of(::thrust::device_ptr<T> p, std::int64_t n) {
  using S = detail::thrust_adapter::space_of_t<::thrust::device_ptr<T>>;
  return tensor_view<T, S>::vector(::thrust::raw_pointer_cast(p), n);
}

/// A zero-copy view with a row-major shape (rank 0 to 4) at a thrust::device_ptr.
template <class T>
requires element<T>
auto view_of(::thrust::device_ptr<T> p, std::initializer_list<std::int64_t> shape) {
  using S = detail::thrust_adapter::space_of_t<::thrust::device_ptr<T>>;
  return tensor_view<T, S>(::thrust::raw_pointer_cast(p), shape);
}

}  // namespace gradapt

#pragma once
/// @file
/// Zero-copy tensor views over Eigen's dense storage: `gradapt::view_of(x)` for a Matrix,
/// Array, Map, Ref, Block or Transpose whose elements lie contiguously in memory.
///
/// Shape. A tensor_view is row-major: its first index is the slowest. An Eigen object stores
/// `outerSize()` runs of `innerSize()` elements, so the view's shape is
/// [outerSize(), innerSize()]:
///
/// | Eigen object                          | view shape | element (i, j) of Eigen is      |
/// |---------------------------------------|------------|---------------------------------|
/// | row-major r x c (Eigen::RowMajor)     | [r, c]     | view element (i, j)             |
/// | column-major r x c (Eigen's default)  | [c, r]     | view element (j, i)             |
/// | vector type (compile-time 1 row/col)  | [n]        | view element i                  |
///
/// A column-major r x c matrix is therefore the row-major [c, r] view of its transpose: the
/// same memory, read in the order Eigen stores it (`m.transpose()` is row-major with the same
/// storage, so it gives the same [c, r] view). Element-wise algorithms (all of gradapt's
/// optimizers and statistics) do not care; code that interprets the two dims must swap them
/// for column-major objects, or keep its matrices in Eigen::RowMajor order.
/// Vector types (VectorXf, RowVectorXd, ArrayXf, a column of a column-major matrix) are
/// rank 1 whatever their runtime length; a dynamic matrix that happens to have one column is
/// still rank 2.
///
/// Element types: float, double, Eigen::half (viewed as gradapt::half) and Eigen::bfloat16
/// (viewed as gradapt::bfloat16). Both 16-bit pairs have the same size and the same IEEE
/// binary16 / bfloat16 bit layout (checked at compile time), so the view reinterprets Eigen's
/// storage in place, as gradapt's CUDA backend does for `__half`.
///
/// Constness follows the object: a const Matrix, Map<const ...>, Ref<const ...> or a block
/// of a const matrix gives a `tensor_view<const T>`. Owning temporaries (a Matrix or Array
/// rvalue, and a Ref<const ...> rvalue, which may hold a private copy of an expression) are
/// rejected at compile time because the view would dangle; rvalue Maps, writable Refs and
/// blocks are fine, since their storage outlives them. A named Ref<const ...> is viewed as it
/// is, which is its private copy when it made one. The view is valid until the Eigen object
/// is resized (to another size) or destroyed.
///
/// This header needs Eigen (tested with 3.4; bfloat16 needs 3.4) and nothing from gradapt
/// beyond core/.

#include <Eigen/Core>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::eigen {

/// gradapt's element type for an Eigen scalar (void when there is none).
template <class S>
struct element_for {
  using type = void;
};
template <>
struct element_for<float> {
  using type = float;
};
template <>
struct element_for<double> {
  using type = double;
};
template <>
struct element_for<Eigen::half> {
  using type = gradapt::half;
};

static_assert(sizeof(Eigen::half) == sizeof(gradapt::half) &&
                  alignof(Eigen::half) == alignof(gradapt::half) && std::is_trivially_copyable_v<Eigen::half>,
              "gradapt/adapters/eigen.hpp: Eigen::half is not a 2-byte trivially copyable type");
static_assert(std::numeric_limits<Eigen::half>::radix == 2 &&
                  std::numeric_limits<Eigen::half>::digits == 11 &&
                  std::numeric_limits<Eigen::half>::max_exponent == 16,
              "gradapt/adapters/eigen.hpp: Eigen::half is not IEEE binary16 (11 significand bits, emax 15)");

#if EIGEN_VERSION_AT_LEAST(3, 4, 0)
template <>
struct element_for<Eigen::bfloat16> {
  using type = gradapt::bfloat16;
};
static_assert(sizeof(Eigen::bfloat16) == sizeof(gradapt::bfloat16) &&
                  alignof(Eigen::bfloat16) == alignof(gradapt::bfloat16) &&
                  std::is_trivially_copyable_v<Eigen::bfloat16>,
              "gradapt/adapters/eigen.hpp: Eigen::bfloat16 is not a 2-byte trivially copyable type");
static_assert(std::numeric_limits<Eigen::bfloat16>::radix == 2 &&
                  std::numeric_limits<Eigen::bfloat16>::digits == 8 &&
                  std::numeric_limits<Eigen::bfloat16>::max_exponent == 128,
              "gradapt/adapters/eigen.hpp: Eigen::bfloat16 is not bfloat16 (8 significand bits, emax 127)");
#endif

/// Deduces the DenseBase<E> an Eigen object derives from (E may be a base of the object's own
/// type, e.g. Block for VectorBlock); only used in unevaluated contexts.
template <class E>
void as_dense(const Eigen::DenseBase<E>&);

/// True for Eigen objects that own, or may own, their storage: Matrix and Array, and
/// Ref<const ...>, which holds a private copy when built from an expression or from storage
/// of another layout. A view of such an rvalue dangles.
template <class D>
inline constexpr bool owns_storage_v = std::is_base_of_v<Eigen::PlainObjectBase<D>, D>;
template <class M, int Options, class Stride>
inline constexpr bool owns_storage_v<Eigen::Ref<const M, Options, Stride>> = true;

}  // namespace detail::eigen

/// Eigen dense objects: anything derived from Eigen::DenseBase (matrices, arrays, maps, refs,
/// blocks, expressions).
template <class X>
concept eigen_dense = requires(const std::remove_cvref_t<X>& x) {
  typename std::remove_cvref_t<X>::Scalar;
  detail::eigen::as_dense(x);
};

/// Eigen objects `view_of` accepts: dense, with direct access to storage (not an unevaluated
/// expression), a float, double, Eigen::half or Eigen::bfloat16 scalar, and not an owning
/// temporary. Contiguity is a run-time property, checked by `view_of`.
template <class X>
concept eigen_viewable =
    eigen_dense<X> && static_cast<bool>(std::remove_cvref_t<X>::Flags& Eigen::DirectAccessBit) &&
    !std::is_void_v<typename detail::eigen::element_for<typename std::remove_cvref_t<X>::Scalar>::type> &&
    !(detail::eigen::owns_storage_v<std::remove_cvref_t<X>> && !std::is_lvalue_reference_v<X>);

/// A zero-copy host view of an Eigen object's storage.
///
/// @param x a Matrix, Array, Map, Ref, Block (row, column, block, segment) or Transpose with
///          direct storage access and a float, double, Eigen::half or Eigen::bfloat16 scalar
/// @return `tensor_view<T, host_space>` (T const when `x` is read-only), of shape [n] for
///         vector types and [outerSize(), innerSize()] otherwise (see the file comment:
///         column-major r x c gives [c, r])
/// @throws gradapt::error when the elements are not contiguous: an inner stride other than 1
///         (e.g. a row of a column-major matrix, a Map with InnerStride<2>) or an outer stride
///         other than the inner size (e.g. a sub-block of a matrix, a Map with
///         OuterStride<>(n) padding). Copy such an object into a Matrix first.
template <class X>
requires eigen_dense<X>
auto view_of(X&& x) {
  using D = std::remove_cvref_t<X>;
  static_assert(!(detail::eigen::owns_storage_v<D> && !std::is_lvalue_reference_v<X>),
                "gradapt::view_of: the Eigen Matrix/Array (or Ref<const ...>, which may hold a copy) is a "
                "temporary; the view would dangle. Pass a named object.");
  static_assert(static_cast<bool>(D::Flags & Eigen::DirectAccessBit),
                "gradapt::view_of: this Eigen expression has no storage of its own (e.g. a + b, "
                "m.cwiseAbs(), Zero()); evaluate it into a Matrix or Array first.");
  using S = typename D::Scalar;
  using E = typename detail::eigen::element_for<S>::type;
  static_assert(!std::is_void_v<E>,
                "gradapt::view_of: unsupported Eigen scalar type (expected float, double, Eigen::half "
                "or Eigen::bfloat16)");
  using P = std::remove_pointer_t<decltype(x.data())>;  // const S or S
  using T = std::conditional_t<std::is_const_v<P>, const E, E>;
  T* const data = reinterpret_cast<T*>(x.data());
  const auto n = static_cast<std::int64_t>(x.size());
  const auto inner_stride = static_cast<std::int64_t>(x.innerStride());
  if constexpr (D::IsVectorAtCompileTime) {
    detail::require(n <= 1 || inner_stride == 1, "view_of(Eigen vector of ", n, " elements): elements are ",
                    inner_stride,
                    " apart (expected contiguous storage, inner stride 1; a row of a column-major "
                    "matrix or a strided Map is not contiguous: copy it into a vector first)");
    return tensor_view<T, host_space>::vector(data, n);
  } else {
    const auto inner = static_cast<std::int64_t>(x.innerSize());
    const auto outer = static_cast<std::int64_t>(x.outerSize());
    const auto outer_stride = static_cast<std::int64_t>(x.outerStride());
    const char* order = D::IsRowMajor ? "row-major" : "column-major";
    if (n > 0) {
      detail::require(inner <= 1 || inner_stride == 1, "view_of(Eigen ", order, " ", x.rows(), " x ",
                      x.cols(), "): inner stride is ", inner_stride, " (expected 1: the elements of each ",
                      D::IsRowMajor ? "row" : "column", " must be adjacent; copy it into a Matrix first)");
      detail::require(outer <= 1 || outer_stride == inner, "view_of(Eigen ", order, " ", x.rows(), " x ",
                      x.cols(), "): outer stride is ", outer_stride, " but the inner size is ", inner,
                      " (expected equal: a sub-block of a larger matrix or a ",
                      "padded Map is not contiguous; copy it into a Matrix first)");
    }
    return tensor_view<T, host_space>(data, {outer, inner});
  }
}

}  // namespace gradapt

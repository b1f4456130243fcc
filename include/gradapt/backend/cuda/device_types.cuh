#pragma once
/// @file
/// Mapping between gradapt's 16-bit storage types and CUDA's: `gradapt::half` <-> `__half`,
/// `gradapt::bfloat16` <-> `__nv_bfloat16`. Both pairs are 2-byte standard-layout types with
/// the same bit layout, so pointers reinterpret and values convert through the raw bits.
///
/// Also the element loads and stores device kernels use: they run the hardware conversions
/// (`cvt.f32.f16`, `cvt.rn.f16.f32`, `cvt.rn.bf16.f32`) and give bit-for-bit the results of
/// gradapt::load / gradapt::store on the host (round to nearest, ties to even; overflow to
/// inf; subnormals exact). The one place the hardware differs is NaN: it returns a canonical
/// NaN, while the host keeps sign and payload, so NaN inputs take the host bit path.
///
/// Naming pitfall: cuda_fp16.h declares a global `typedef __half half;`, so in a .cu file an
/// unqualified `half` outside namespace gradapt is CUDA's type. Spell `gradapt::half`.
/// Included only from .cu translation units.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"

namespace gradapt {

static_assert(sizeof(__half) == sizeof(half) && alignof(__half) >= alignof(half),
              "gradapt::half and __half must be layout-compatible");
static_assert(sizeof(__nv_bfloat16) == sizeof(bfloat16) && alignof(__nv_bfloat16) >= alignof(bfloat16),
              "gradapt::bfloat16 and __nv_bfloat16 must be layout-compatible");

/// CUDA's type for gradapt element type T (cv-qualifiers kept): `__half` for half,
/// `__nv_bfloat16` for bfloat16, T itself for float and double.
template <class T>
struct cuda_type {
  using type = T;  ///< T itself (float, double)
};
/// gradapt::half is stored as CUDA's `__half`.
template <>
struct cuda_type<half> {
  using type = __half;  ///< `__half`
};
/// gradapt::bfloat16 is stored as CUDA's `__nv_bfloat16`.
template <>
struct cuda_type<bfloat16> {
  using type = __nv_bfloat16;  ///< `__nv_bfloat16`
};
/// A const element maps to the const CUDA type.
template <class T>
struct cuda_type<const T> {
  using type = const typename cuda_type<T>::type;  ///< `const cuda_type_t<T>`
};
/// CUDA's type for gradapt element type T: `cuda_type<T>::type`.
template <class T>
using cuda_type_t = typename cuda_type<T>::type;

/// gradapt's type for CUDA element type T (cv-qualifiers kept): the inverse of cuda_type.
template <class T>
struct gradapt_type {
  using type = T;  ///< T itself (float, double)
};
/// CUDA's `__half` is gradapt::half.
template <>
struct gradapt_type<__half> {
  using type = half;  ///< gradapt::half
};
/// CUDA's `__nv_bfloat16` is gradapt::bfloat16.
template <>
struct gradapt_type<__nv_bfloat16> {
  using type = bfloat16;  ///< gradapt::bfloat16
};
/// A const element maps to the const gradapt type.
template <class T>
struct gradapt_type<const T> {
  using type = const typename gradapt_type<T>::type;  ///< `const gradapt_type_t<T>`
};
/// gradapt's type for CUDA element type T: `gradapt_type<T>::type`.
template <class T>
using gradapt_type_t = typename gradapt_type<T>::type;

/// Reinterprets a pointer to gradapt elements as a pointer to the CUDA type (same bits).
template <class T>
GRADAPT_HD inline cuda_type_t<T>* to_cuda(T* p) {
  return reinterpret_cast<cuda_type_t<T>*>(p);
}

/// Reinterprets a pointer to CUDA elements (`__half`, `__nv_bfloat16`, float, double) as a
/// pointer to gradapt elements (same bits).
template <class T>
GRADAPT_HD inline gradapt_type_t<T>* from_cuda(T* p) {
  return reinterpret_cast<gradapt_type_t<T>*>(p);
}

/// The same bits as a `__half` value.
GRADAPT_HD inline __half to_cuda(half h) {
  __half_raw r;
  r.x = h.bits;
  return __half(r);
}
/// The same bits as a `__nv_bfloat16` value.
GRADAPT_HD inline __nv_bfloat16 to_cuda(bfloat16 h) {
  __nv_bfloat16_raw r;
  r.x = h.bits;
  return __nv_bfloat16(r);
}
/// The same bits as a gradapt::half value.
GRADAPT_HD inline half from_cuda(__half h) { return half::from_bits(static_cast<__half_raw>(h).x); }
/// The same bits as a gradapt::bfloat16 value.
GRADAPT_HD inline bfloat16 from_cuda(__nv_bfloat16 h) {
  return bfloat16::from_bits(static_cast<__nv_bfloat16_raw>(h).x);
}

namespace detail {

/// Loads a stored element into its compute type (float for half/bfloat16/float, double for
/// double). Equal to gradapt::load bit for bit; in device code half uses `cvt.f32.f16`.
template <class T>
GRADAPT_HD GRADAPT_INLINE compute_t<T> device_load(const T& x) {
  using V = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<V, half>) {
#if GRADAPT_DEVICE_PASS
    const std::uint16_t b = x.bits;
    if ((b & 0x7fffu) > 0x7c00u) return half_bits_to_float(b);  // NaN: keep sign and payload
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
#else
    return load(x);
#endif
  } else {
    // bfloat16 -> float is a 16-bit shift on every path; float and double load as they are.
    return load(x);
  }
}

/// Stores a compute-type value into a stored element, rounding to nearest even for 16-bit
/// types. Equal to gradapt::store bit for bit; in device code it uses `cvt.rn.f16.f32` and
/// `cvt.rn.bf16.f32` for every value but NaN.
template <class T>
GRADAPT_HD GRADAPT_INLINE void device_store(T& dst, compute_t<T> v) {
  static_assert(!std::is_const_v<T>, "device_store into a const element");
  if constexpr (std::is_same_v<T, half>) {
#if GRADAPT_DEVICE_PASS
    if (v != v) {
      dst.bits = float_to_half_bits(v);
    } else {
      dst.bits = static_cast<__half_raw>(__float2half_rn(v)).x;
    }
#else
    store(dst, v);
#endif
  } else if constexpr (std::is_same_v<T, bfloat16>) {
#if GRADAPT_DEVICE_PASS
    if (v != v) {
      dst.bits = float_to_bfloat16_bits(v);
    } else {
      dst.bits = static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x;
    }
#else
    store(dst, v);
#endif
  } else {
    dst = v;
  }
}

}  // namespace detail
}  // namespace gradapt

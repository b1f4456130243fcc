#pragma once
/// @file
/// A tiny device-friendly tuple: one value of each type, trivially copyable when they are, so
/// it travels into CUDA kernels (a chain's stage kernels) and lives in registers (the CUDA
/// backend's per-element values).

#include <cstddef>
#include <utility>

#include "gradapt/core/config.hpp"

namespace gradapt::detail {

/// Element I of a value_pack.
template <std::size_t I, class T>
struct pack_slot {
  T value;  ///< the element
};
template <class Seq, class... T>
struct value_pack_base;
template <std::size_t... I, class... T>
struct value_pack_base<std::index_sequence<I...>, T...> : pack_slot<I, T>... {};
/// Holds one value of each type; `slot<I>(p)` is the I-th as an lvalue.
template <class... T>
struct value_pack : value_pack_base<std::index_sequence_for<T...>, T...> {};

/// Element I of a value_pack.
template <std::size_t I, class T>
GRADAPT_HD GRADAPT_INLINE constexpr T& slot(pack_slot<I, T>& s) {
  return s.value;
}
/// Element I of a value_pack, read-only.
template <std::size_t I, class T>
GRADAPT_HD GRADAPT_INLINE constexpr const T& slot(const pack_slot<I, T>& s) {
  return s.value;
}

}  // namespace gradapt::detail

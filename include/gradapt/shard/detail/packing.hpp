#pragma once
/// @file
/// Internals of gradapt/shard/optimizer.hpp: the element functors of the packing copies, the
/// one-dimensional views they run over, the walks over the pieces that overlap a range of
/// shard positions, and the exchange that assembles the per-tensor and global sums of the
/// shard's chain across ranks. Not a public interface: names here may change without notice.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gradapt/core/config.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain_plan.hpp"
#include "gradapt/shard/partition.hpp"
#include "gradapt/shard/state.hpp"

namespace gradapt::detail::shard_k {

/// dst = src in the compute type: a value copy, or master values rounded to the parameters'
/// type to nearest even (gradapt::detail::copy_to).
using gradapt::detail::copy_to;
/// x = 0.
struct set_zero {
  template <class C>
  GRADAPT_HD void operator()(C& x) const {
    x = C(0);
  }
};

/// A one-dimensional view of n elements at p in space Sp.
template <class Sp, class T>
tensor_view<T, Sp> vec(T* p, std::size_t n) {
  return tensor_view<T, Sp>::vector(p, static_cast<std::int64_t>(n));
}

/// Calls f(piece, first shard position, count) for every part of `pieces` inside shard
/// positions [p0, p0 + len).
template <class F>
void for_overlaps(std::span<const shard::piece> pieces, std::size_t p0, std::size_t len, F&& f) {
  for (const shard::piece& q : pieces) {
    const std::size_t a = std::max(p0, q.shard_offset), e = std::min(p0 + len, q.shard_offset + q.length);
    if (a < e) f(q, a, e - a);
  }
}

/// True when a piece of `a` and a piece of `b` share an element of one tensor.
inline bool overlaps_any(std::span<const shard::piece> a, std::span<const shard::piece> b) {
  for (const shard::piece& x : a)
    for (const shard::piece& y : b)
      if (x.tensor == y.tensor && x.offset < y.offset + y.length && y.offset < x.offset + x.length)
        return true;
  return false;
}

/// The sums of the shard's list tensors → the logical tensors' sums (see the file comment of
/// gradapt/shard/optimizer.hpp).
template <class Comm, class S>
struct assembly {
  static constexpr bool active = true;
  Comm* comm;
  const std::vector<shard::shard_unit>* units;
  const std::vector<char>* split;
  const std::vector<std::size_t>* xbase;
  std::vector<double>* x;
  std::vector<double>* logical;
  std::vector<double>* rows;
  gradapt::detail::optim::assembled_sums operator()(const double* sums, std::size_t count, std::size_t terms,
                                                    bool global) {
    const std::size_t ntensors = xbase->size() - 1;
    const std::size_t nx = xbase->back();
    x->assign(nx * terms, 0.0);
    for (std::size_t i = 0; i < count; ++i)
      for (std::size_t k = 0; k < terms; ++k) (*x)[(*units)[i].exchange * terms + k] = sums[i * terms + k];
    comm->allreduce(host_view(*x), reduce_op::sum);
    logical->assign(ntensors * terms, 0.0);
    for (std::size_t t = 0; t < ntensors; ++t)
      for (std::size_t u = (*xbase)[t]; u < (*xbase)[t + 1]; ++u)
        for (std::size_t k = 0; k < terms; ++k) (*logical)[t * terms + k] += (*x)[u * terms + k];
    if (global) return {logical->data(), ntensors};
    rows->resize(count * terms);
    for (std::size_t i = 0; i < count; ++i)
      for (std::size_t k = 0; k < terms; ++k)
        (*rows)[i * terms + k] = (*logical)[(*units)[i].tensor * terms + k];
    return {rows->data(), count};
  }
};

}  // namespace gradapt::detail::shard_k

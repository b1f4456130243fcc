#pragma once
/// @file
/// How `gradapt::shampoo` cuts a tensor into blocks: `shampoo_layout` and `shampoo_plan`
/// (dimensions of size 1 dropped, small dimensions merged, each merged dimension cut into
/// pieces of at most max_preconditioner_dim), and the walk over a block's contiguous runs.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/shampoo_options.hpp"

namespace gradapt {

/// How `gradapt::shampoo` cuts one tensor into blocks (see `shampoo_plan`).
struct shampoo_layout {
  /// Preconditioned by the graft alone (fewer than two dimensions larger than 1, a dimension
  /// larger than skip_preconditioning_dim_size_gt, or an empty tensor).
  bool diagonal = true;
  /// The shape the blocks cut (dimensions of size 1 dropped, small ones merged); its
  /// row-major order is the tensor's, so it is a reshape.
  std::vector<std::int64_t> merged;
  /// One block: its first index and its extent in each merged dimension.
  struct block {
    std::array<std::int64_t, max_rank> offset{};  ///< first index per merged dimension
    std::array<std::int64_t, max_rank> size{};    ///< extent per merged dimension
  };
  /// The blocks in row-major order of the block grid (empty when diagonal).
  std::vector<block> blocks;
};

/// The block layout of a tensor of `shape` under `o` (deterministic: a function of the shape
/// and the blocking options only: max_preconditioner_dim, merge_small_dims, merge_from,
/// skip_preconditioning_dim_size_gt, precondition_1d).
///  1. diagonal when the tensor is empty, has a dimension larger than
///     `skip_preconditioning_dim_size_gt`, or has fewer than two dimensions larger than 1
///     (unless `precondition_1d`: then such a tensor is one merged dimension of its size;
///     never for spectral descent);
///  2. merged shape: dimensions of size 1 dropped; with `merge_small_dims`, consecutive
///     dimensions multiplied together while the product stays <= `max_preconditioner_dim`,
///     from the first dimension or from the last (`merge_from`);
///     spectral descent merges only while more than two dimensions would remain, and a tensor
///     whose merged shape is not 2-D is diagonal;
///  3. each merged dimension cut into pieces of `max_preconditioner_dim` (the last one shorter);
///     the blocks are the pieces' products, in row-major order.
/// @throws gradapt::error for a negative extent, rank > 4, max_preconditioner_dim < 1 or
///         skip_preconditioning_dim_size_gt < 1
inline shampoo_layout shampoo_plan(std::span<const std::int64_t> shape, const shampoo_options& o) {
  detail::require(o.max_preconditioner_dim >= 1, "shampoo_plan: max_preconditioner_dim is ",
                  o.max_preconditioner_dim, " (expected >= 1)");
  detail::require(o.skip_preconditioning_dim_size_gt >= 1,
                  "shampoo_plan: skip_preconditioning_dim_size_gt is ", o.skip_preconditioning_dim_size_gt,
                  " (expected >= 1)");
  detail::require(shape.size() <= static_cast<std::size_t>(max_rank), "shampoo_plan: rank ", shape.size(),
                  " (expected 0 to ", max_rank, ")");
  for (const auto d : shape) detail::require(d >= 0, "shampoo_plan: extent ", d, " (expected >= 0)");
  shampoo_layout l;
  std::int64_t big = 0, size = 1;
  bool too_large = false;
  for (const auto d : shape) {
    size *= d;
    if (d > 1) ++big;
    if (d > o.skip_preconditioning_dim_size_gt) too_large = true;
  }
  const bool spectral = o.preconditioner == shampoo_preconditioner::spectral_descent;
  if (size == 0 || too_large || (big < 2 && (spectral || !o.precondition_1d))) return l;
  const std::int64_t cap = o.max_preconditioner_dim;
  std::vector<std::int64_t> dims;
  for (const auto d : shape)
    if (d != 1) dims.push_back(d);
  if (dims.empty()) dims.push_back(1);  // a scalar (precondition_1d): one 1 × 1 factor
  const bool last = o.merge_from == shampoo_merge::last;
  if (last) std::reverse(dims.begin(), dims.end());
  // Spectral descent merges only while more than two dimensions would remain (the peer's
  // target_tensor_dimensionality 2): [6, 5, 4] → [6, 20] from the last.
  const std::size_t target = spectral ? 2 : 1;
  std::int64_t prod = 1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::int64_t d = dims[i];
    const bool room = i == 0 || l.merged.size() + 1 + (dims.size() - i) > target;
    if (!o.merge_small_dims) {
      l.merged.push_back(d);
    } else if (room && d <= cap / prod) {  // prod·d <= cap without overflow
      prod *= d;
    } else {
      if (prod > 1) l.merged.push_back(prod);
      prod = d;
    }
  }
  if (o.merge_small_dims && (prod > 1 || l.merged.empty())) l.merged.push_back(prod);
  if (last) std::reverse(l.merged.begin(), l.merged.end());
  if (spectral && l.merged.size() != 2) {  // orthogonalization takes matrices only
    l.merged.clear();
    return l;
  }
  l.diagonal = false;
  const std::size_t k = l.merged.size();
  std::array<std::int64_t, max_rank> count{}, at{};
  std::size_t total = 1;
  for (std::size_t d = 0; d < k; ++d) {
    count[d] = (l.merged[d] - 1) / cap + 1;
    total *= static_cast<std::size_t>(count[d]);
  }
  l.blocks.reserve(total);
  for (std::size_t j = 0; j < total; ++j) {
    shampoo_layout::block b;
    for (std::size_t d = 0; d < k; ++d) {
      b.offset[d] = at[d] * cap;
      b.size[d] = std::min(cap, l.merged[d] - b.offset[d]);
    }
    l.blocks.push_back(b);
    for (std::size_t d = k; d-- > 0;) {  // odometer, last dimension fastest
      if (++at[d] < count[d]) break;
      at[d] = 0;
    }
  }
  return l;
}

/// Elements of one sharding unit of a tensor of `shape` (`scale_by_shampoo::shard_grain`):
/// for a preconditioned tensor, max_preconditioner_dim rows of its merged shape (one row of
/// blocks: a cut at a multiple of it never splits a block); 1 for a diagonal tensor (the graft
/// is element-wise).
inline std::size_t shampoo_grain(std::span<const std::int64_t> shape, const shampoo_options& o) {
  const shampoo_layout l = shampoo_plan(shape, o);
  if (l.diagonal) return 1;
  std::size_t g = static_cast<std::size_t>(std::min<std::int64_t>(o.max_preconditioner_dim, l.merged[0]));
  for (std::size_t d = 1; d < l.merged.size(); ++d) g *= static_cast<std::size_t>(l.merged[d]);
  return g;
}

/// The layout of elements [offset, offset + length) of a tensor of `shape` (a slice cut at
/// multiples of `shampoo_grain` from the tensor's start, or whole): the whole tensor's layout
/// with the first merged dimension restricted to the slice's rows and the blocks of those
/// rows (offsets relative to the slice), and in `first_block` the index of its first block in
/// the whole tensor's layout. The slice's blocks are the whole tensor's, in the same order.
/// @throws gradapt::error when the slice is out of range or cuts a block
inline shampoo_layout shampoo_slice_plan(std::span<const std::int64_t> shape, const shampoo_options& o,
                                         std::size_t offset, std::size_t length, std::size_t& first_block) {
  shampoo_layout l = shampoo_plan(shape, o);
  std::size_t size = 1;
  for (const auto d : shape) size *= static_cast<std::size_t>(d);
  detail::require(offset <= size && length <= size - offset, "shampoo_slice_plan: elements [", offset, ", ",
                  offset + length, ") of a tensor of ", size, " elements");
  first_block = 0;
  if (l.diagonal || (offset == 0 && length == size)) return l;
  const std::size_t grain = shampoo_grain(shape, o);
  const std::size_t band =
      grain / static_cast<std::size_t>(std::min<std::int64_t>(o.max_preconditioner_dim, l.merged[0]));
  detail::require(offset % grain == 0 && (length % grain == 0 || offset + length == size),
                  "shampoo_slice_plan: elements [", offset, ", ", offset + length,
                  ") cut a block (slices start at multiples of ", grain,
                  " elements and end at one or at the tensor's end)");
  const auto row0 = static_cast<std::int64_t>(offset / band), rows = static_cast<std::int64_t>(length / band);
  std::vector<shampoo_layout::block> kept;
  bool seen = false;
  for (std::size_t j = 0; j < l.blocks.size(); ++j) {
    auto b = l.blocks[j];
    if (b.offset[0] < row0 || b.offset[0] >= row0 + rows) continue;
    if (!seen) first_block = j;
    seen = true;
    b.offset[0] -= row0;
    kept.push_back(b);
  }
  l.blocks = std::move(kept);
  l.merged[0] = rows;
  return l;
}

namespace detail::shampoo_impl {

/// Calls f(flat offset in the tensor, offset in the block, run length) for every contiguous
/// run (a piece of the last merged dimension) of block `b` of a tensor with merged shape `m`.
template <class F>
void for_runs(const std::vector<std::int64_t>& m, const shampoo_layout::block& b, F&& f) {
  const std::size_t k = m.size();
  std::array<std::int64_t, max_rank> stride{}, at{};
  stride[k - 1] = 1;
  for (std::size_t d = k - 1; d-- > 0;) stride[d] = stride[d + 1] * m[d + 1];
  const std::int64_t run = b.size[k - 1];
  std::int64_t inner = 0;
  while (true) {
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < k; ++d) flat += (b.offset[d] + at[d]) * stride[d];
    f(static_cast<std::size_t>(flat), static_cast<std::size_t>(inner), static_cast<std::size_t>(run));
    inner += run;
    std::size_t d = k - 1;
    while (d-- > 0) {
      if (++at[d] < b.size[d]) break;
      at[d] = 0;
    }
    if (d == static_cast<std::size_t>(-1)) return;
  }
}

}  // namespace detail::shampoo_impl

}  // namespace gradapt

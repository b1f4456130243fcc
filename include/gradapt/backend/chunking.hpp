#pragma once
/// @file
/// Index math for multi-tensor chunked launches and the fixed partition behind deterministic
/// reductions.
///
/// A list of tensors is cut into chunks of `chunk_elements` elements (the last chunk of a
/// tensor may be shorter; an empty tensor has no chunk). Chunks are numbered globally in
/// tensor order through an exclusive prefix over the per-tensor chunk counts:
///
///     prefix[0] = 0,  prefix[t + 1] = prefix[t] + ceil(size[t] / chunk_elements)
///
/// so global chunk `g` belongs to the tensor `t` with `prefix[t] <= g < prefix[t + 1]`
/// (`locate_chunk`, a binary search that never lands on an empty tensor). One launch then
/// covers hundreds of tensors: a CUDA block takes one global chunk.
///
/// Reductions use a fixed partition that does not depend on the launch shape:
///  1. inside a chunk, lane `l` (of `reduction_lanes`, a power of two) accumulates the
///     chunk's elements `l, l + lanes, l + 2 lanes, ...` in increasing order, starting from
///     the identity;
///  2. the lanes are combined by a fixed binary tree: for `s = lanes/2, lanes/4, ..., 1`,
///     `a[l] = combine(a[l], a[l + s])` for every `l < s`; the chunk's partial is `a[0]`;
///  3. a tensor's chunk partials are reduced by steps 1 and 2 again (lane `l` folds partials
///     `l, l + lanes, ...` with `combine`), which gives the tensor's result.
/// `lane_tree_reduce` and `chunked_tree_reduce` are host reference implementations of exactly
/// this order: a device kernel that follows it produces the same bits.
///
/// Everything here is plain C++ (functions used by kernels are GRADAPT_HD) so host tests
/// exercise the same code the CUDA backend runs.

#include <cstddef>
#include <span>
#include <vector>

#include "gradapt/core/config.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt::chunking {

/// Elements per chunk (2^14). Fixed at compile time because it is part of the reduction
/// order: changing it changes the bits of a floating-point reduction.
inline constexpr std::size_t chunk_elements = std::size_t{1} << 14;

/// Lanes per reduction partition (2^8): a CUDA reduction block has this many threads.
inline constexpr std::size_t reduction_lanes = 256;

/// A half-open element range `[begin, end)` inside one tensor.
struct element_range {
  std::size_t begin = 0;  ///< first element (offset from the tensor's start)
  std::size_t end = 0;    ///< one past the last element; `end >= begin`
  /// Number of elements, `end - begin`.
  GRADAPT_HD constexpr std::size_t size() const { return end - begin; }
};

/// Where a global chunk lives: its tensor, its index inside that tensor and its elements.
/// For an out-of-range global chunk, `tensor == ntensors` and the range is empty.
struct chunk_location {
  std::size_t tensor = 0;           ///< index of the owning tensor in the list (`ntensors` if none)
  std::size_t chunk_in_tensor = 0;  ///< chunk number counted from the tensor's first chunk
  std::size_t begin = 0;            ///< first element of the chunk, offset inside the tensor
  std::size_t end = 0;              ///< one past the chunk's last element, offset inside the tensor
  /// Number of elements in the chunk (0 for an out-of-range chunk).
  GRADAPT_HD constexpr std::size_t size() const { return end - begin; }
};

/// True for a non-zero power of two.
GRADAPT_HD constexpr bool is_power_of_two(std::size_t n) { return n != 0 && (n & (n - 1)) == 0; }

/// Number of chunks of a tensor with `n` elements: `ceil(n / chunk)`, 0 for an empty tensor.
/// Written without `n + chunk - 1` so it cannot overflow. `chunk` must be positive.
GRADAPT_HD constexpr std::size_t chunk_count(std::size_t n, std::size_t chunk = chunk_elements) {
  return n / chunk + (n % chunk != 0 ? 1 : 0);
}

/// Elements of chunk `c` of a tensor with `n` elements: `[c * chunk, min(n, (c + 1) * chunk))`.
/// A chunk index at or past `chunk_count(n, chunk)` gives an empty range at `n`.
GRADAPT_HD constexpr element_range chunk_range(std::size_t n, std::size_t c,
                                               std::size_t chunk = chunk_elements) {
  if (c >= chunk_count(n, chunk)) return {n, n};
  const std::size_t b = c * chunk;
  const std::size_t rest = n - b;
  return {b, b + (rest < chunk ? rest : chunk)};
}

/// Fills `prefix` (one slot more than `sizes`) with the exclusive prefix of the per-tensor
/// chunk counts, `prefix[t] = sum_{u < t} chunk_count(sizes[u])`, and returns the total
/// number of chunks `prefix[sizes.size()]`.
/// @throws gradapt::error if `prefix.size() != sizes.size() + 1`, if `chunk` is 0, or if the
///         total does not fit in std::size_t.
inline std::size_t exclusive_chunk_prefix(std::span<const std::size_t> sizes, std::span<std::size_t> prefix,
                                          std::size_t chunk = chunk_elements) {
  detail::require(chunk > 0, "chunking: chunk size is 0 (expected a positive element count)");
  detail::require(prefix.size() == sizes.size() + 1, "chunking: prefix has ", prefix.size(), " slots for ",
                  sizes.size(), " tensors (expected ", sizes.size() + 1, ")");
  std::size_t total = 0;
  prefix[0] = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t c = chunk_count(sizes[t], chunk);
    detail::require(total <= static_cast<std::size_t>(-1) - c, "chunking: tensor ", t,
                    " overflows the chunk count");
    total += c;
    prefix[t + 1] = total;
  }
  return total;
}

/// Finds the tensor and element range of global chunk `global_chunk`.
///
/// @param prefix       `ntensors + 1` exclusive prefix values from `exclusive_chunk_prefix`
///                     (non-decreasing, `prefix[0] == 0`)
/// @param ntensors     number of tensors
/// @param global_chunk chunk number in `[0, prefix[ntensors])`
/// @param sizes        `ntensors` element counts, the ones the prefix was built from
/// @param chunk        elements per chunk, the one the prefix was built with
///
/// Binary search for the last `t` with `prefix[t] <= global_chunk`: an empty tensor `t` has
/// `prefix[t] == prefix[t + 1]`, so the search always passes over it to a later tensor that
/// owns the chunk. O(log ntensors). Out-of-range chunks give `{ntensors, 0, 0, 0}`.
GRADAPT_HD constexpr chunk_location locate_chunk(const std::size_t* prefix, std::size_t ntensors,
                                                 std::size_t global_chunk, const std::size_t* sizes,
                                                 std::size_t chunk = chunk_elements) {
  if (ntensors == 0 || global_chunk >= prefix[ntensors]) return {ntensors, 0, 0, 0};
  // Invariant: prefix[lo] <= global_chunk < prefix[hi].
  std::size_t lo = 0;
  std::size_t hi = ntensors;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= global_chunk)
      lo = mid;
    else
      hi = mid;
  }
  const std::size_t c = global_chunk - prefix[lo];
  const element_range r = chunk_range(sizes[lo], c, chunk);
  return {lo, c, r.begin, r.end};
}

/// The lane that accumulates element `offset` (counted from the start of its chunk, or the
/// index of a partial inside its tensor) in the reduction partition.
GRADAPT_HD constexpr std::size_t lane_of(std::size_t offset, std::size_t lanes = reduction_lanes) {
  return offset % lanes;
}

/// Host reference of one level of the reduction partition over `n` items.
///
/// Lane `l < lanes` starts from `identity` and folds items `l, l + lanes, ...` in increasing
/// order as `a = fold(a, i)`; then `for (s = lanes / 2; s >= 1; s /= 2) a[l] = combine(a[l],
/// a[l + s])` for `l < s`; the result is `a[0]`. `n == 0` gives `identity` folded through the
/// tree (`combine(identity, identity)` ...), matching a kernel whose lanes all stay idle.
///
/// @tparam V       the value type (double for the CUDA backend)
/// @param n        number of items
/// @param identity the starting value of every lane
/// @param fold     `V fold(V acc, std::size_t i)`: folds item `i` into a lane accumulator
/// @param combine  `V combine(V a, V b)`: merges two lane results
/// @param lanes    lanes of the partition (a power of two)
/// @throws gradapt::error unless `lanes` is a power of two.
/// This is a reference for tests and documentation; it allocates `lanes` values.
template <class V, class Fold, class Combine>
V lane_tree_reduce(std::size_t n, V identity, Fold fold, Combine combine,
                   std::size_t lanes = reduction_lanes) {
  detail::require(is_power_of_two(lanes), "chunking: ", lanes, " reduction lanes (expected a power of two)");
  std::vector<V> a(lanes, identity);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t l = lane_of(i, lanes);
    a[l] = fold(a[l], i);
  }
  for (std::size_t s = lanes / 2; s >= 1; s /= 2)
    for (std::size_t l = 0; l < s; ++l) a[l] = combine(a[l], a[l + s]);
  return a[0];
}

/// Host reference of a whole tensor's reduction over `n` elements: each chunk of `chunk`
/// elements is reduced by `lane_tree_reduce` (with `fold(acc, i)` receiving the element's
/// index in the tensor), then the chunk partials are reduced by `lane_tree_reduce` with
/// `fold(acc, c) = combine(acc, partial[c])`. An empty tensor gives `identity` through the
/// second level only (it has no chunks), as the CUDA backend does.
template <class V, class Fold, class Combine>
V chunked_tree_reduce(std::size_t n, V identity, Fold fold, Combine combine,
                      std::size_t chunk = chunk_elements, std::size_t lanes = reduction_lanes) {
  detail::require(chunk > 0, "chunking: chunk size is 0 (expected a positive element count)");
  const std::size_t nchunks = chunk_count(n, chunk);
  std::vector<V> partial;
  partial.reserve(nchunks);
  for (std::size_t c = 0; c < nchunks; ++c) {
    const element_range r = chunk_range(n, c, chunk);
    partial.push_back(lane_tree_reduce(
        r.size(), identity, [&](V acc, std::size_t j) { return fold(acc, r.begin + j); }, combine, lanes));
  }
  return lane_tree_reduce(
      nchunks, identity, [&](V acc, std::size_t c) { return combine(acc, partial[c]); }, combine, lanes);
}

}  // namespace gradapt::chunking

#pragma once
/// @file
/// Adasum: adaptive summation of gradients (or model deltas) across data-parallel ranks
/// (Maleki, Musuvathi, Mytkowicz, Saarikivi, Xu, Eksarevskiy, Ekanayake, Barsoum, "Scaling
/// Distributed Training with Adaptive Summation", MLSys 2021; the operator Horovod offers as
/// `hvd.Adasum`).
///
/// The pairwise operator, applied to each tensor (layer) t of two lists a and b:
///
///     a (+) b = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
///
/// It is the sum a + b when a and b are orthogonal, their mean when they are parallel (for
/// any lengths: a and c a give (1 + c) a / 2), and in between otherwise: each vector loses
/// half of its projection on the other. A zero vector is the identity: when |a|^2 <=
/// `zero_threshold` (0 by default) a's coefficient is 1, so 0 (+) b = b exactly.
///
/// N ranks are reduced as a binary tree, ((r0 (+) r1) (+) (r2 (+) r3)) ..., computed with
/// recursive vector halving and distance doubling over the communicator's pairwise `exchange`
/// (no other collective touches the data in flat mode). The result is identical, bit for bit,
/// on every rank and equal to the serial definition below; see docs/algorithms/adasum.md.
///
/// Bit-exact definition (what `adasum::allreduce` computes):
///  - Let v_r be rank r's tensors concatenated (n elements). A range [lo, hi) halves at
///    mid = lo + floor((hi - lo) / 2); depth d means d successive halvings (2^d pieces).
///  - partial_d(x, y, t, [lo, hi)) = the backend's per-tensor dot product of the part of
///    tensor t inside [lo, hi) when d = 0, else partial_{d-1}(lower half) +
///    partial_{d-1}(upper half) (in double, lower half first).
///  - combine_d(a, b): for each tensor t, ab = partial_d(a, b), aa = partial_d(a, a),
///    bb = partial_d(b, b) over [0, n); alpha = aa <= zero_threshold ? 1 : 1 - 0.5 (ab / aa),
///    beta likewise with bb; element i becomes C(alpha) a_i + C(beta) b_i in the compute type C
///    (float for float, half and bfloat16; double for double), rounded once to the element type.
///  - Fold: with P the largest power of two <= N, rank P + i's vector is folded into rank i's:
///    L_i = combine_1(v_i, v_{P+i}) for i < N - P, L_i = v_i otherwise.
///  - Tree: X^0 = L; at level k = 0 .. log2(P) - 1, X^{k+1}_j = combine_{k+1}(X^k_{2j},
///    X^k_{2j+1}). The result X^{log2 P}_0 is written to every rank's tensors.
/// The depth of a combine equals the number of ranks that hold pieces of its operands, so the
/// partial sums are exactly those the distributed schedule forms.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/combine/detail/adasum_impl.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// How the ranks are combined.
enum class adasum_mode : std::uint8_t {
  /// Adasum over all ranks of the communicator.
  flat,
  /// Average inside groups of `group_size` consecutive ranks (a node's GPUs), Adasum across the
  /// group leaders (local rank 0), broadcast inside each group. Horovod's hierarchical mode.
  hierarchical,
};

/// Options of gradapt::adasum, built with designated initialisers, e.g.
/// `gradapt::adasum_options{.mode = gradapt::adasum_mode::hierarchical, .group_size = 8}`.
///
/// | name           | type        | default | meaning |
/// |----------------|-------------|---------|-----------------------------------------------------------------|
/// | mode           | adasum_mode | flat    | flat: Adasum over all ranks; hierarchical: mean in groups,
/// Adasum across group leaders | | group_size     | int         | 1       | hierarchical: ranks per group
/// (ranks r with equal r / group_size); the last group may be smaller | | zero_threshold | double      | 0 |
/// a tensor with \|a\|^2 <= zero_threshold counts as zero: its projection term is dropped (coefficient 1) |
/// | check_layout   | bool        | true    | one allreduce of 10 doubles per call so that a list that
/// differs across ranks throws on every rank |
struct adasum_options {
  adasum_mode mode = adasum_mode::flat;  ///< flat or hierarchical
  int group_size = 1;                    ///< ranks per group in hierarchical mode (>= 1)
  /// Squared-norm threshold below which a tensor counts as zero (>= 0, finite). Norms are
  /// accumulated in double, so any nonzero float vector has |a|^2 > 0 and 0 is safe; Horovod
  /// uses 1e-8.
  double zero_threshold = 0.0;
  /// Agree on the list layout before each call (count, total, a fingerprint of the sizes, an
  /// error flag) with one small allreduce, so every rank throws together on a mismatch. Off
  /// saves that latency-bound collective; a bad list then throws on its own rank only and the
  /// other ranks may wait in the exchange.
  bool check_layout = true;
};

/// Scratch memory for Adasum over one tensor-list layout (tensor count and sizes), in memory
/// space `Space`.
///
/// It holds a receive and a send buffer of ceil(n / 2) elements each plus one element (n the
/// list's total element count) and 6 doubles per tensor plus 10 (partial dot products and the
/// layout agreement), and host-side view lists whose capacity is reserved here, so that
/// `adasum::allreduce` allocates nothing. Host workspaces own their memory; device workspaces
/// borrow buffers from the framework's allocator, sized with `elements_needed` and
/// `scalars_needed`. Adasum keeps no state between calls: a workspace holds scratch only, so
/// there is nothing to checkpoint. Move-only.
///
/// @tparam T     element type of the lists it serves (float, double, half, bfloat16)
/// @tparam Space host_space or device_space
template <element T, memory_space Space = host_space>
class adasum_workspace {
  static_assert(!std::is_const_v<T>, "adasum_workspace: the element type must not be const");

 public:
  using element_type = T;  ///< element type of the lists it serves
  using space = Space;     ///< memory space of its buffers

  /// Elements of T the element buffer needs for a list of `total` elements: 2 ceil(total/2) + 1.
  static constexpr std::size_t elements_needed(std::size_t total) {
    return detail::adasum::buffers<T, Space>::elements_needed(total);
  }
  /// Doubles the scalar buffer needs for a list of `count` tensors: 6 count + 10.
  static constexpr std::size_t scalars_needed(std::size_t count) {
    return detail::adasum::buffers<T, Space>::scalars_needed(count);
  }
  /// elements_needed for this list.
  template <class L>
  requires view_list<L, Space>
  static std::size_t elements_needed(const L& list) {
    std::size_t total = 0;
    for (const auto& v : list) total += v.size();
    return elements_needed(total);
  }
  /// scalars_needed for this list.
  template <class L>
  requires view_list<L, Space>
  static std::size_t scalars_needed(const L& list) { return scalars_needed(std::ranges::size(list)); }

  /// A host workspace for lists shaped like `list`, owning its memory.
  template <class L>
  requires view_list<L, Space> && std::same_as<Space, host_space>
  explicit adasum_workspace(const L& list) {
    const auto sizes = sizes_of(list);
    std::size_t total = 0;
    for (std::size_t s : sizes) total += s;
    own_elements_.resize(elements_needed(total));
    own_scalars_.resize(scalars_needed(sizes.size()));
    buf_.init(sizes, host_view(own_elements_), host_view(own_scalars_));
  }

  /// A workspace for lists shaped like `list` over caller-owned buffers (any memory space):
  /// `elements` needs at least elements_needed(list) elements and `scalars` at least
  /// scalars_needed(list) doubles. The buffers must outlive the workspace and not be used
  /// for anything else while an Adasum call runs.
  /// @throws gradapt::error when a buffer is too small (naming both sizes)
  template <class L>
  requires view_list<L, Space> adasum_workspace(const L& list, tensor_view<T, Space> elements,
                                                tensor_view<double, Space> scalars) {
    buf_.init(sizes_of(list), elements, scalars);
  }

  /// Move-only: the lists inside point into its own buffers.
  adasum_workspace(const adasum_workspace&) = delete;
  adasum_workspace& operator=(const adasum_workspace&) = delete;
  /// Takes over the buffers and lists; the moved-from workspace must not be used again.
  adasum_workspace(adasum_workspace&&) noexcept = default;
  /// Takes over the buffers and lists; the moved-from workspace must not be used again.
  adasum_workspace& operator=(adasum_workspace&&) noexcept = default;
  ~adasum_workspace() = default;

  /// Number of tensors of the layout.
  std::size_t tensor_count() const { return buf_.count(); }
  /// Total elements of the layout.
  std::size_t total_elements() const { return buf_.total; }
  /// Tensor sizes of the layout, in list order.
  std::span<const std::size_t> sizes() const { return buf_.sizes; }

  /// Internal: the scratch views and lists the algorithm uses.
  detail::adasum::buffers<T, Space>& internal_buffers() { return buf_; }

 private:
  template <class L>
  static std::vector<std::size_t> sizes_of(const L& list) {
    using V = std::remove_cvref_t<std::ranges::range_value_t<L>>;
    static_assert(std::is_same_v<typename V::value_type, T>,
                  "adasum_workspace: the list's element type differs from the workspace's");
    std::vector<std::size_t> s;
    s.reserve(std::ranges::size(list));
    for (const auto& v : list) s.push_back(v.size());
    return s;
  }

  std::vector<T> own_elements_;
  std::vector<double> own_scalars_;
  detail::adasum::buffers<T, Space> buf_;
};

/// Adasum across the ranks of a communicator (Maleki et al., MLSys 2021).
///
/// Each call replaces every rank's tensors with the Adasum of all ranks' tensors, tensor by
/// tensor (the dot products and norms of the operator are per tensor, the paper's per-layer
/// form). All ranks must call `allreduce` together with lists of the same layout.
///
/// Schedule (flat mode, P the largest power of two <= N ranks, n elements):
///  - fold: each rank P + i swaps halves with rank i; each combines the half it keeps using
///    the per-tensor dot products summed over both halves; rank P + i sends its half to i.
///  - reduce-scatter, levels k = 0 .. log2(P) - 1: rank r swaps half of the range it holds
///    with rank r ^ 2^k, keeps the other half (the lower rank the lower half), computes the
///    per-tensor partial a.b, |a|^2, |b|^2 of its half in one pass, sums them with the ranks
///    r ^ 2^k, r ^ 2^(k-1), ..., r ^ 1 (recursive doubling, lower operand first, so every
///    piece uses the full-vector coefficients and all ranks form the same bits), and combines
///    its half in one pass.
///  - allgather by distance halving (levels log2(P) - 1 .. 0); then rank i sends the result
///    to rank P + i.
/// Each rank moves about 2 n (1 - 1/P) elements, like a reduce-scatter plus allgather
/// allreduce. Exchanges always carry equal sizes on both sides (a communicator requirement):
/// a range of odd length moves its last element in a second one-element exchange, and the
/// one-way fold transfers carry an unused message back.
///
/// Memory: a list whose tensors are adjacent in memory (a framework's flat gradient buffer)
/// is sent and received in place; otherwise pieces are packed through the workspace.
///
/// Numerics: dot products and norms in double (the backend's fixed-order reductions), element
/// math in the compute type (float for 16-bit and float tensors). The result is deterministic
/// and bitwise equal to the serial definition in the file comment, whatever the host thread
/// count. Non-finite inputs give non-finite results for the tensors that hold them (their
/// coefficients become NaN); other tensors are unaffected. The coefficients are rounded to
/// the compute type: if one operand's norm is more than about 1e38 times the other's (only
/// possible for float or bfloat16 values spread over nearly the whole exponent range), a float
/// coefficient overflows; a zero_threshold above the small operand's squared norm avoids it.
///
/// Device lists: the backend and a device communicator (comm::nccl) must enqueue on the same
/// stream; the dot products stay in device memory (the backend's `dot_to`), and only the layout
/// agreement waits for the stream.
///
/// @tparam C a communicator (comm::threads, comm::mpi, comm::nccl, comm::single)
template <communicator C>
class adasum {
 public:
  using space = typename C::space;      ///< memory space of the lists (the communicator's)
  using options_type = adasum_options;  ///< the options aggregate

  /// Validates the options and, in hierarchical mode, splits `comm` into groups and leaders
  /// (collective: every rank constructs its adasum together). The communicator handle is
  /// copied (communicators are handles).
  /// @throws gradapt::error on invalid options (the same on every rank, before any collective)
  explicit adasum(C comm, adasum_options options = {}) : world_(std::move(comm)), opt_(options) {
    detail::require(std::isfinite(opt_.zero_threshold) && opt_.zero_threshold >= 0.0,
                    "adasum: zero_threshold is ", opt_.zero_threshold,
                    " (expected a finite squared norm >= 0; 0 treats only exact zeros as zero)");
    detail::require(opt_.group_size >= 1, "adasum: group_size is ", opt_.group_size,
                    " (expected >= 1 ranks per group)");
    detail::require(
        opt_.mode == adasum_mode::hierarchical || opt_.group_size == 1, "adasum: group_size is ",
        opt_.group_size,
        " but mode is flat (set .mode = gradapt::adasum_mode::hierarchical to average in groups)");
    if (opt_.mode == adasum_mode::hierarchical) {
      const int r = world_.rank();
      local_.emplace(world_.split(r / opt_.group_size, r));
      leaders_.emplace(world_.split(local_->rank() == 0 ? 0 : 1, r));
    }
  }

  /// The options this object was built with.
  const adasum_options& options() const { return opt_; }
  /// Rank in the communicator.
  int rank() const { return world_.rank(); }
  /// Number of ranks.
  int size() const { return world_.size(); }
  /// Ranks in this rank's group (hierarchical mode; 1 in flat mode).
  int group_size() const { return local_ ? local_->size() : 1; }

  /// Replaces every rank's tensors with the Adasum over all ranks, in place. Collective.
  ///
  /// @param b     backend whose space equals the communicator's (host with comm::threads or
  ///              comm::mpi; gradapt::cuda with comm::nccl, on the same stream)
  /// @param grads the tensors (a param_list's grads(), a std::vector or span of views),
  ///              non-const element type T, tensors not overlapping in memory
  /// @param ws    a workspace made for this layout
  /// An empty list, or a list of empty tensors, is a no-op (after the layout agreement).
  /// Hierarchical mode: the group mean is the communicator's sum multiplied by 1 / g in the
  /// compute type (g the group's size), then the leaders run flat Adasum, then each leader
  /// broadcasts to its group.
  /// @throws gradapt::error on every rank when the lists differ across ranks (tensor count,
  ///         total, or sizes) or when any rank's list does not match its workspace
  template <backend B, class L, element T>
  requires view_list<L, space> && std::same_as<typename B::space, space>
  void allreduce(const B& b, const L& grads, adasum_workspace<T, space>& ws) {
    using V = std::remove_cvref_t<std::ranges::range_value_t<L>>;
    static_assert(std::is_same_v<typename V::element_type, T>,
                  "adasum::allreduce: the list must hold non-const views of the workspace's element type "
                  "(the result is written in place)");
    const std::span<const V> list(std::ranges::data(grads), std::ranges::size(grads));
    auto& buf = ws.internal_buffers();
    const std::string bad = detail::adasum::layout_mismatch(buf, list, "adasum::allreduce", world_.rank());
    detail::adasum::engine<B, C, T> all(b, world_, buf, list, opt_.zero_threshold);
    if (opt_.check_layout)
      all.agree(bad, "adasum::allreduce");
    else if (!bad.empty())
      throw error(bad);
    all.set_offsets();
    if (buf.total == 0) return;
    if (opt_.mode == adasum_mode::flat) {
      all.run();
      return;
    }
    detail::adasum::engine<B, C, T> group(b, *local_, buf, list, opt_.zero_threshold);
    const int g = local_->size();
    if (g > 1) {
      group.allreduce_sum();
      using CT = compute_t<T>;
      b.apply_list(detail::adasum::scale_by<CT>{static_cast<CT>(1.0 / static_cast<double>(g))}, list);
    }
    if (local_->rank() == 0) {
      detail::adasum::engine<B, C, T> leaders(b, *leaders_, buf, list, opt_.zero_threshold);
      leaders.run();
    }
    if (g > 1) group.broadcast_root();
  }

 private:
  C world_;
  adasum_options opt_;
  std::optional<C> local_;    ///< this rank's group (hierarchical)
  std::optional<C> leaders_;  ///< the group leaders (or, for other ranks, the non-leaders)
};

/// The pairwise Adasum operator on one rank, tensor by tensor: a <- a (+) b with
/// a (+) b = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, the per-tensor dot products
/// accumulated in double over whole tensors (combine_0 of the definition above). Use it to
/// merge two model deltas or gradients held by one process.
///
/// @param b    backend (host, or a device backend with dot_to)
/// @param a    first operand and result (non-const views of T)
/// @param bs   second operand (views of T or const T; same tensor count and sizes as a)
/// @param ws   a workspace made for a's layout (only its scalar buffer is used)
/// @param zero_threshold squared norm at or below which a tensor counts as zero (>= 0)
/// @throws gradapt::error on a length or size mismatch or a bad threshold
template <backend B, class LA, class LB, element T>
requires view_list<LA, typename B::space> && view_list<LB, typename B::space>
void adasum_combine(const B& b, const LA& a, const LB& bs, adasum_workspace<T, typename B::space>& ws,
                    double zero_threshold = 0.0) {
  using S = typename B::space;
  using VA = std::remove_cvref_t<std::ranges::range_value_t<LA>>;
  using VB = std::remove_cvref_t<std::ranges::range_value_t<LB>>;
  static_assert(std::is_same_v<typename VA::element_type, T>,
                "adasum_combine: `a` must hold non-const views of the workspace's element type");
  static_assert(std::is_same_v<typename VB::value_type, T>,
                "adasum_combine: `bs` must hold views of the workspace's element type");
  detail::require(std::isfinite(zero_threshold) && zero_threshold >= 0.0,
                  "adasum_combine: zero_threshold is ", zero_threshold,
                  " (expected a finite squared norm >= 0)");
  const std::span<const VA> la(std::ranges::data(a), std::ranges::size(a));
  const std::span<const VB> lb(std::ranges::data(bs), std::ranges::size(bs));
  detail::require(la.size() == lb.size(), "adasum_combine: a holds ", la.size(), " tensors but b holds ",
                  lb.size(), " (expected equal lengths)");
  for (std::size_t t = 0; t < la.size(); ++t)
    detail::require(la[t].size() == lb[t].size(), "adasum_combine: tensor ", t, " has ", la[t].size(),
                    " elements in a but ", lb[t].size(), " in b (expected equal sizes)");
  auto& buf = ws.internal_buffers();
  const std::string bad = detail::adasum::layout_mismatch(buf, la, "adasum_combine", -1);
  if (!bad.empty()) throw error(bad);
  if (la.empty()) return;
  buf.user_mut.clear();
  buf.user_const.clear();
  buf.scratch_const.clear();
  for (std::size_t t = 0; t < la.size(); ++t) {
    buf.user_mut.push_back(la[t]);
    buf.user_const.push_back(la[t]);
    buf.scratch_const.push_back(tensor_view<const T, S>(lb[t]));
  }
  using dview = tensor_view<double, S>;
  b.apply(detail::adasum::set_zero{},
          dview::vector(buf.mine.data(), static_cast<std::int64_t>(3 * la.size())));
  detail::adasum::partial_dots(b, buf, buf.user_const, buf.scratch_const, 0);
  detail::adasum::combine_pieces(b, buf, false, 0, zero_threshold);
}

}  // namespace gradapt

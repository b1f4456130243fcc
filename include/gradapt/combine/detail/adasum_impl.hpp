#pragma once
/// @file
/// Internals of gradapt/combine/adasum.hpp: the element functors, the scratch buffers, and the
/// engine that runs the vector-halving, distance-doubling schedule over a communicator's
/// pairwise `exchange`. Not a public interface: names here may change without notice.
///
/// Everything here is written against the `backend` and `communicator` concepts. The only
/// places that look at the memory space are the per-tensor dot products (host backends write
/// them into host memory, device backends need the device-resident `dot_to`) and the optional
/// fused host pass (`apply_reduce_list`, when the backend offers it).

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

// The host backend calls functors that opt in (`vectorizable`) with SIMD packs
// (gradapt/backend/simd.hpp): the one-pass partials and the combine then run at memory speed
// under the consumer's plain -O2, with the same bits as the scalar calls (lane-wise IEEE
// operations, the same accumulator lanes). Without that header the functors stay scalar.
/// @def GRADAPT_ADASUM_PACKS
/// 1 when gradapt/backend/simd.hpp is available and the Adasum functors accept SIMD packs,
/// 0 when they are scalar only. Internal: set by this header, not meant to be defined by users.
#if __has_include("gradapt/backend/simd.hpp")
#include "gradapt/backend/simd.hpp"
#define GRADAPT_ADASUM_PACKS 1
#else
#define GRADAPT_ADASUM_PACKS 0
#endif

namespace gradapt::detail::adasum {

// ---- element functors (GRADAPT_HD: the same code runs in host loops and CUDA kernels) -------
// Functors that do not opt in to packs constrain their operators to scalar floating-point
// types, so a backend that probes them with packs sees "scalar only" instead of an error.

/// (a·b, a·a, b·b) of one element pair in double, for a fused three-output reduction. The
/// products are exactly those of `dot(a, b)`, `dot(a, a)` and `dot(b, b)`.
struct dots3 {
#if GRADAPT_ADASUM_PACKS
  static constexpr bool vectorizable = true;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 3> operator()(V& a, V& b) const {
    const auto x = simd::widen(a);
    const auto y = simd::widen(b);
    simd::terms_t<V, 3> r;
    r[0] = x * y;
    r[1] = x * x;
    r[2] = y * y;
    return r;
  }
#else
  template <std::floating_point C>
  GRADAPT_HD GRADAPT_INLINE terms<3> operator()(C& a, C& b) const {
    const double x = static_cast<double>(a);
    const double y = static_cast<double>(b);
    return terms<3>{{x * y, x * x, y * y}};
  }
#endif
};

/// Per-tensor coefficients from the summed partials: `aa` becomes alpha, `bb` becomes beta.
///   alpha = 1 - (a·b / |a|^2) / 2, or 1 when |a|^2 <= threshold (a's projection term is dropped)
///   beta  = 1 - (a·b / |b|^2) / 2, or 1 when |b|^2 <= threshold
/// A NaN norm is not <= threshold, so NaN propagates into the coefficient.
struct coefficients {
  double threshold;
  GRADAPT_HD void operator()(double& ab, double& aa, double& bb) const {
    const double alpha = aa <= threshold ? 1.0 : 1.0 - 0.5 * (ab / aa);
    const double beta = bb <= threshold ? 1.0 : 1.0 - 0.5 * (ab / bb);
    aa = alpha;
    bb = beta;
  }
};

/// The combine step on one piece of tensor `first + t`: result = C(alpha) a + C(beta) b in the
/// compute type C, with the coefficients rounded to C. `Upper` says this rank holds b (the
/// higher-ranked group's vector) in `mine` and a in `theirs`; the expression is the same.
template <bool Upper>
struct combine {
  const double* alpha;
  const double* beta;
  std::size_t first;
#if GRADAPT_ADASUM_PACKS
  static constexpr bool vectorizable = true;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(tensor_index t, V& mine, V& theirs) const {
    step<simd::scalar_t<V>>(t, mine, theirs);
  }
#else
  template <std::floating_point V>
  GRADAPT_HD GRADAPT_INLINE void operator()(tensor_index t, V& mine, V& theirs) const {
    step<V>(t, mine, theirs);
  }
#endif
  /// V is C or a pack of C lanes (the coefficients are broadcast).
  template <class C, class V>
  GRADAPT_HD GRADAPT_INLINE void step(tensor_index t, V& mine, V& theirs) const {
    const C ca = static_cast<C>(alpha[first + t.value]);
    const C cb = static_cast<C>(beta[first + t.value]);
    if constexpr (Upper)
      mine = ca * theirs + cb * mine;
    else
      mine = ca * mine + cb * theirs;
  }
};

/// Sum of two partial vectors, lower-ranked operand first (so both partners form the same bits).
template <bool MineIsLower>
struct add_partials {
  GRADAPT_HD void operator()(double& mine, double& theirs) const {
    if constexpr (MineIsLower)
      mine = mine + theirs;
    else
      mine = theirs + mine;
  }
};

struct set_zero {
  GRADAPT_HD void operator()(double& x) const { x = 0.0; }
};

/// dst = src (a load into the compute type and a store back: value-exact; a signalling NaN of a
/// 16-bit type becomes quiet).
struct copy_value {
  template <std::floating_point C>
  GRADAPT_HD void operator()(C& dst, C& src) const {
    dst = src;
  }
};

/// x = x * factor in the compute type (the 1/g of the hierarchical average).
template <class C>
struct scale_by {
  C factor;
  GRADAPT_HD void operator()(C& x) const { x = x * factor; }
};

/// Writes K host values into K one-element views (tensor t gets v[t]): how small host values
/// reach a buffer in any memory space through the backend alone.
template <std::size_t K>
struct put_values {
  double v[K];
  GRADAPT_HD void operator()(tensor_index t, double& x) const { x = v[t.value]; }
};

// ---- flat ranges ----------------------------------------------------------------------------

/// Half-open range [lo, hi) of the flat concatenation of a tensor list.
struct range {
  std::size_t lo = 0;
  std::size_t hi = 0;
  constexpr std::size_t size() const { return hi - lo; }
  /// The halving rule of the whole algorithm: the lower half gets floor(size / 2) elements.
  constexpr std::size_t mid() const { return lo + (hi - lo) / 2; }
  constexpr range lower() const { return {lo, mid()}; }
  constexpr range upper() const { return {mid(), hi}; }
};

/// Largest power of two <= n (n >= 1).
constexpr int floor_pow2(int n) {
  int p = 1;
  while (p <= n / 2) p *= 2;
  return p;
}

/// log2 of a power of two.
constexpr int log2_exact(int p) {
  int l = 0;
  while ((1 << l) < p) ++l;
  return l;
}

/// Values carried by the layout agreement: count, elements, two fingerprint halves, error flag.
inline constexpr std::size_t check_values = 6;

/// 52-bit FNV-1a fingerprint of the element type and the tensor sizes of a list, as two
/// 26-bit integers (each exact in a double).
template <class V>
std::array<double, 2> fingerprint(dtype type, std::span<const V> list) {
  std::uint64_t h = 1469598103934665603ull;
  const auto mix = [&](std::uint64_t v) {
    for (int k = 0; k < 8; ++k) {
      h ^= (v >> (8 * k)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<std::uint64_t>(type));
  mix(list.size());
  for (const auto& v : list) mix(v.size());
  const std::uint64_t mask = (std::uint64_t{1} << 26) - 1;
  return {static_cast<double>((h >> 38) & mask), static_cast<double>((h >> 12) & mask)};
}

// ---- scratch --------------------------------------------------------------------------------

/// Scratch of one Adasum call, sized for one tensor-list layout (`count` tensors, `total`
/// elements). Element buffer: receive scratch [0, c), send scratch [c, 2c), one junk element
/// at 2c (c = ceil(total / 2)). Scalar buffer: partials of this rank [0, 3 count) as three
/// planes a·b | |a|^2 | |b|^2 (alpha and beta replace the norms after the group sum), the
/// partner's partials [3 count, 6 count), the layout-agreement buffer [6 count, 6 count + 10).
/// The host-side vectors hold the offsets and the view lists the steps build; their capacity
/// is reserved here, so steps allocate nothing.
template <class T, class Space>
struct buffers {
  std::vector<std::size_t> sizes;   ///< layout this scratch was made for
  std::vector<std::size_t> offset;  ///< flat offsets, count + 1 (recomputed from the list per call)
  std::size_t total = 0;
  std::size_t half = 0;  ///< c = ceil(total / 2)

  tensor_view<T, Space> recv, send, junk;
  tensor_view<double, Space> mine, theirs, check;
  std::vector<tensor_view<double, Space>> check_slots;  ///< the 10 agreement values as 1-element views

  // View lists rebuilt by each step (capacity `count`).
  std::vector<tensor_view<T, Space>> user_mut, scratch_mut;
  std::vector<tensor_view<const T, Space>> user_const, scratch_const;
  std::vector<double> host_terms;  ///< interleaved fused-pass output (host backends only)

  static constexpr std::size_t elements_needed(std::size_t total_elements) {
    return 2 * ((total_elements + 1) / 2) + 1;
  }
  static constexpr std::size_t scalars_needed(std::size_t count) { return 6 * count + 2 * check_values; }

  void init(std::span<const std::size_t> tensor_sizes, tensor_view<T, Space> elements,
            tensor_view<double, Space> scalars) {
    sizes.assign(tensor_sizes.begin(), tensor_sizes.end());
    const std::size_t count = sizes.size();
    offset.assign(count + 1, 0);
    total = 0;
    for (std::size_t t = 0; t < count; ++t) offset[t + 1] = (total += sizes[t]);
    half = (total + 1) / 2;
    require(elements.size() >= elements_needed(total), "adasum_workspace: the element buffer has ",
            elements.size(), " elements but a list of ", total, " elements needs ", elements_needed(total),
            " (2 * ceil(total / 2) + 1)");
    require(scalars.size() >= scalars_needed(count), "adasum_workspace: the scalar buffer has ",
            scalars.size(), " doubles but a list of ", count, " tensors needs ", scalars_needed(count),
            " (6 * tensors + 10)");
    T* e = elements.data();
    recv = tensor_view<T, Space>::vector(e, static_cast<std::int64_t>(half));
    send = tensor_view<T, Space>::vector(e + half, static_cast<std::int64_t>(half));
    junk = tensor_view<T, Space>::vector(e + 2 * half, 1);
    double* s = scalars.data();
    mine = tensor_view<double, Space>::vector(s, static_cast<std::int64_t>(3 * count));
    theirs = tensor_view<double, Space>::vector(s + 3 * count, static_cast<std::int64_t>(3 * count));
    check = tensor_view<double, Space>::vector(s + 6 * count, static_cast<std::int64_t>(2 * check_values));
    check_slots.clear();
    for (std::size_t k = 0; k < 2 * check_values; ++k)
      check_slots.push_back(tensor_view<double, Space>::vector(s + 6 * count + k, 1));
    user_mut.clear();
    user_mut.reserve(count);
    scratch_mut.clear();
    scratch_mut.reserve(count);
    user_const.clear();
    user_const.reserve(count);
    scratch_const.clear();
    scratch_const.reserve(count);
    if constexpr (std::is_same_v<Space, host_space>) host_terms.assign(3 * count, 0.0);
  }

  std::size_t count() const { return sizes.size(); }
  double* ab() const { return mine.data(); }
  double* alpha() const { return mine.data() + count(); }
  double* beta() const { return mine.data() + 2 * count(); }
};

/// Compares a list with the layout a workspace was made for; "" when they match (no
/// allocation then). `rank` < 0 leaves the rank out of the message.
template <class T, class Space, class V>
std::string layout_mismatch(const buffers<T, Space>& ws, std::span<const V> list, const char* fn, int rank) {
  const auto where = [&] { return rank < 0 ? std::string(fn) : message(fn, " on rank ", rank); };
  if (list.size() != ws.count())
    return message(where(), ": the list holds ", list.size(), " tensors but the workspace was made for ",
                   ws.count(), " (make a workspace for this list)");
  for (std::size_t t = 0; t < list.size(); ++t)
    if (list[t].size() != ws.sizes[t])
      return message(where(), ": tensor ", t, " has ", list[t].size(),
                     " elements but the workspace was made for ", ws.sizes[t],
                     " (make a workspace for this list)");
  return {};
}

// ---- per-tensor dot products ------------------------------------------------------------------

template <class B, class L>
concept fused_dots = std::is_same_v<typename B::space, host_space> &&
    requires(const B& b, std::span<double> out, const L& xs) {
  b.apply_reduce_list(dots3{}, out, xs, xs);
};

template <class>
inline constexpr bool always_false = false;

/// Writes a·b, |a|^2 and |b|^2 of the m = |as| pieces (tensors first .. first + m - 1) into the
/// three planes of `ws.mine`. Host backends with `apply_reduce_list` do it in one pass over a
/// and b; otherwise three per-tensor `dot` calls (device backends: `dot_to`, results stay in
/// device memory). Both give the same bits on the host backend (same products, same order).
template <class B, class T, class Space, class L>
void partial_dots(const B& b, buffers<T, Space>& ws, const L& as, const L& bs, std::size_t first) {
  const std::size_t m = std::ranges::size(as);
  if (m == 0) return;
  if constexpr (fused_dots<B, L>) {
    const std::span<double> out(ws.host_terms.data(), 3 * m);
    b.apply_reduce_list(dots3{}, out, as, bs);
    for (std::size_t i = 0; i < m; ++i) {
      ws.ab()[first + i] = out[3 * i];
      ws.alpha()[first + i] = out[3 * i + 1];
      ws.beta()[first + i] = out[3 * i + 2];
    }
  } else if constexpr (std::is_same_v<Space, host_space>) {
    b.dot(as, bs, std::span<double>(ws.ab() + first, m));
    b.dot(as, as, std::span<double>(ws.alpha() + first, m));
    b.dot(bs, bs, std::span<double>(ws.beta() + first, m));
  } else if constexpr (deferred_dot_backend<B>) {
    const auto plane = [&](double* p) {
      return tensor_view<double, Space>::vector(p + first, static_cast<std::int64_t>(m));
    };
    b.dot_to(as, bs, plane(ws.ab()));
    b.dot_to(as, as, plane(ws.alpha()));
    b.dot_to(bs, bs, plane(ws.beta()));
  } else {
    static_assert(
        always_false<B>,
        "gradapt::adasum: a backend over device memory needs dot_to(xs, ys, per_tensor_view) so that "
        "per-tensor dot products stay in device memory (gradapt::cuda has it)");
  }
}

/// Coefficients and combine over pieces [first, first + |mine|) once ws.mine holds the summed
/// partials: mine = alpha a + beta b.
template <class B, class T, class Space>
void combine_pieces(const B& b, buffers<T, Space>& ws, bool upper, std::size_t first, double threshold) {
  const std::size_t count = ws.count();
  if (count == 0) return;
  using dview = tensor_view<double, Space>;
  using cdview = tensor_view<const double, Space>;
  const auto n = static_cast<std::int64_t>(count);
  b.apply(coefficients{threshold}, cdview(dview::vector(ws.ab(), n)), dview::vector(ws.alpha(), n),
          dview::vector(ws.beta(), n));
  if (ws.user_mut.empty()) return;
  if (upper)
    b.apply_list(combine<true>{ws.alpha(), ws.beta(), first}, ws.user_mut, ws.scratch_const);
  else
    b.apply_list(combine<false>{ws.alpha(), ws.beta(), first}, ws.user_mut, ws.scratch_const);
}

// ---- the engine -------------------------------------------------------------------------------

/// Runs the steps of one Adasum call on one communicator. Holds references only; making one
/// allocates nothing.
template <class B, class C, class T>
class engine {
  using S = typename C::space;
  using view = tensor_view<T, S>;
  using cview = tensor_view<const T, S>;
  using dview = tensor_view<double, S>;
  using cdview = tensor_view<const double, S>;

 public:
  engine(const B& b, C& comm, buffers<T, S>& ws, std::span<const view> list, double threshold)
      : b_(b), comm_(comm), ws_(ws), list_(list), threshold_(threshold) {}

  /// Adasum of every rank's list over this communicator (any rank count), in place.
  void run() {
    const int n = comm_.size();
    const int r = comm_.rank();
    if (n == 1 || ws_.total == 0) return;
    const int p = floor_pow2(n);
    const int levels = log2_exact(p);
    const range all{0, ws_.total};

    // Fold: rank p + i combines with rank i (i holds a, p + i holds b), then sends its half.
    if (r >= p) {
      const int i = r - p;
      const int peers[1] = {i};
      const bool lower[1] = {false};
      reduce_scatter_step(i, false, all, peers, lower);
      xfer(i, src::user(all.mid()), dst::junk_recv(), all.upper().size());
      // The result comes back in two halves (each exchange carries an unused message back).
      xfer(i, src::junk_send(), dst::user(0), all.lower().size());
      xfer(i, src::junk_send(), dst::user(all.mid()), all.upper().size());
      return;
    }
    const bool folded = r < n - p;
    if (folded) {
      const int peers[1] = {p + r};
      const bool lower[1] = {true};
      reduce_scatter_step(p + r, true, all, peers, lower);
      xfer(p + r, src::junk_send(), dst::user(all.mid()), all.upper().size());
    }

    // Core: levels of vector halving, distance doubling over ranks 0 .. p - 1.
    std::array<range, 32> held{};
    held[0] = all;
    for (int k = 0; k < levels; ++k) {
      std::array<int, 32> peers{};
      std::array<bool, 32> lower{};
      for (int j = k, s = 0; j >= 0; --j, ++s) {
        peers[static_cast<std::size_t>(s)] = r ^ (1 << j);
        lower[static_cast<std::size_t>(s)] = ((r >> j) & 1) == 0;
      }
      const auto steps = static_cast<std::size_t>(k + 1);
      const bool me_lower = ((r >> k) & 1) == 0;
      held[static_cast<std::size_t>(k + 1)] = reduce_scatter_step(
          r ^ (1 << k), me_lower, held[static_cast<std::size_t>(k)],
          std::span<const int>(peers.data(), steps), std::span<const bool>(lower.data(), steps));
    }
    // Allgather by distance halving: at level k the partners hold the two halves of held[k].
    for (int k = levels - 1; k >= 0; --k)
      allgather_step(r ^ (1 << k), ((r >> k) & 1) == 0, held[static_cast<std::size_t>(k)]);

    if (folded) {
      xfer(p + r, src::user(0), dst::junk_recv(), all.lower().size());
      xfer(p + r, src::user(all.mid()), dst::junk_recv(), all.upper().size());
    }
  }

  /// In-place sum over this communicator of the whole list, in pieces of at most ceil(n/2)
  /// elements (packed through the send scratch where a piece is not contiguous in memory).
  void allreduce_sum() {
    chunked([&](view piece) { comm_.allreduce(piece, reduce_op::sum); }, true, true);
  }

  /// Copies rank 0's list into every rank's list over this communicator.
  void broadcast_root() {
    const bool root = comm_.rank() == 0;
    chunked([&](view piece) { comm_.broadcast(piece, 0); }, root, !root);
  }

  /// The layout agreement: one allreduce(max) of (count, total, fingerprint, error flag) and
  /// their negations. Throws on every rank when the lists differ or any rank reported
  /// `local_error` (which this rank then throws itself).
  void agree(const std::string& local_error, const char* who) {
    const auto fp = fingerprint(dtype_of_v<T>, list_);
    const double count = static_cast<double>(list_.size());
    std::size_t total = 0;
    for (const auto& v : list_) total += v.size();
    const double bad = local_error.empty() ? 0.0 : static_cast<double>(comm_.rank() + 1);
    // Count, total and fingerprint describe the list itself (not the workspace), so a list
    // that differs from the other ranks' is seen by every rank.
    const double mine[check_values] = {count, static_cast<double>(total),        fp[0], fp[1],
                                       bad,   static_cast<double>(dtype_of_v<T>)};
    put_values<2 * check_values> pv{};
    for (std::size_t k = 0; k < check_values; ++k) {
      pv.v[k] = mine[k];
      pv.v[check_values + k] = -mine[k];
    }
    b_.apply_list(pv, ws_.check_slots);
    comm_.allreduce(ws_.check, reduce_op::max);
    double got[2 * check_values];
    b_.reduce(reduction::sum, ws_.check_slots, std::span<double>(got, 2 * check_values));
    // Counts and totals are integers below 2^53: exact in double, printed as integers.
    const auto hi = [&](std::size_t k) { return static_cast<long long>(got[k]); };
    const auto lo = [&](std::size_t k) { return static_cast<long long>(-got[check_values + k]); };
    const int r = comm_.rank();
    if (!local_error.empty()) throw error(local_error);
    if (hi(5) != lo(5))
      fail(who, " on rank ", r, ": the element types differ across ranks: this rank passes ",
           name(dtype_of_v<T>), " (every rank must pass tensors of the same element type)");
    if (hi(0) != lo(0))
      fail(who, " on rank ", r, ": the tensor lists differ across ranks: this rank has ", list_.size(),
           " tensors, the ranks hold between ", lo(0), " and ", hi(0),
           " (every rank must pass the same list)");
    if (hi(1) != lo(1))
      fail(who, " on rank ", r, ": the tensor lists differ across ranks: this rank has ", total,
           " elements, the ranks hold between ", lo(1), " and ", hi(1),
           " (every rank must pass tensors of the same sizes)");
    if (hi(2) != lo(2) || hi(3) != lo(3))
      fail(who, " on rank ", r, ": the tensor sizes differ across ranks (same count ", list_.size(),
           " and total ", total, ", but not the same sizes in the same order)");
    if (hi(4) != 0)
      fail(who, " on rank ", r, ": rank ", hi(4) - 1,
           " passed invalid input (it throws the reason; every rank stops here)");
  }

  /// Flat offsets of the current list (sizes equal the workspace's, checked before).
  void set_offsets() {
    std::size_t acc = 0;
    for (std::size_t t = 0; t < list_.size(); ++t) {
      ws_.offset[t] = acc;
      acc += list_[t].size();
    }
    ws_.offset[list_.size()] = acc;
  }

 private:
  /// One side of an exchange: the user range from `lo`, the side's buffer (send or receive
  /// scratch) from `lo`, or the one-element junk slot.
  struct endpoint {
    enum kind_t { user_k, buffer_k, junk_slot_k } kind;
    std::size_t lo;
  };
  struct src : endpoint {
    static src user(std::size_t lo) { return {{endpoint::user_k, lo}}; }
    static src junk_send() { return {{endpoint::buffer_k, 0}}; }
    static src junk_slot() { return {{endpoint::junk_slot_k, 0}}; }
  };
  struct dst : endpoint {
    static dst user(std::size_t lo) { return {{endpoint::user_k, lo}}; }
    static dst scratch(std::size_t lo) { return {{endpoint::buffer_k, lo}}; }
    static dst junk_recv() { return {{endpoint::buffer_k, 0}}; }
    static dst junk_slot() { return {{endpoint::junk_slot_k, 0}}; }
  };

  /// Tensors overlapping [lo, hi): [tb, te). Empty tensors strictly inside give empty pieces.
  std::pair<std::size_t, std::size_t> tensors_in(range q) const {
    const std::size_t count = list_.size();
    if (q.size() == 0) return {0, 0};
    const auto* o = ws_.offset.data();
    // tb: first t with offset[t + 1] > lo; te: first t with offset[t] >= hi.
    const std::size_t tb = static_cast<std::size_t>(std::upper_bound(o + 1, o + count + 1, q.lo) - (o + 1));
    const std::size_t te = static_cast<std::size_t>(std::lower_bound(o, o + count, q.hi) - o);
    return {tb, std::max(tb, te)};
  }

  /// Pieces of the user's tensors covering q (mutable and const lists), and matching pieces of
  /// a scratch buffer that holds q's elements from `scratch_base` on. Returns the first tensor.
  std::size_t build(range q, T* scratch_base) {
    ws_.user_mut.clear();
    ws_.user_const.clear();
    ws_.scratch_mut.clear();
    ws_.scratch_const.clear();
    const auto [tb, te] = tensors_in(q);
    for (std::size_t t = tb; t < te; ++t) {
      const std::size_t s = std::max(ws_.offset[t], q.lo);
      const std::size_t e = std::min(ws_.offset[t + 1], q.hi);
      const auto len = static_cast<std::int64_t>(e - s);
      const view u = view::vector(list_[t].data() + (s - ws_.offset[t]), len);
      ws_.user_mut.push_back(u);
      ws_.user_const.push_back(u);
      if (scratch_base != nullptr) {
        const view sc = view::vector(scratch_base + (s - q.lo), len);
        ws_.scratch_mut.push_back(sc);
        ws_.scratch_const.push_back(sc);
      }
    }
    return tb;
  }

  /// The user pieces just built, as one view when they are adjacent in memory (a fused buffer).
  bool contiguous(std::size_t m, view& out) const {
    T* start = nullptr;
    T* next = nullptr;
    for (const auto& v : ws_.user_mut) {
      if (v.size() == 0) continue;
      if (start == nullptr) {
        start = next = v.data();
      } else if (reinterpret_cast<std::uintptr_t>(v.data()) != reinterpret_cast<std::uintptr_t>(next)) {
        return false;
      }
      next = v.data() + v.size();
    }
    out = view::vector(start, static_cast<std::int64_t>(m));
    return start != nullptr;
  }

  /// The first m elements of a scratch buffer.
  static view scratch(T* p, std::size_t m) { return view::vector(p, static_cast<std::int64_t>(m)); }

  /// Builds the pieces of [lo, lo + m) with `buf` as their scratch and returns the view that
  /// carries the range: the user's memory when the pieces are adjacent (`direct` true), the
  /// first m elements of `buf` otherwise (the caller packs or unpacks through it).
  view user_or_scratch(std::size_t lo, std::size_t m, T* buf, bool& direct) {
    build({lo, lo + m}, buf);
    view v;
    direct = contiguous(m, v);
    return direct ? v : scratch(buf, m);
  }

  /// One exchange of m elements with `peer`: what to send (user range, or an unused message)
  /// and where to receive it (user range, the receive scratch, or nowhere). Non-contiguous user
  /// ranges go through the send scratch (packed) or the receive scratch (unpacked after).
  void xfer(int peer, src s, dst d, std::size_t m) {
    if (m == 0) return;
    bool pack = false;
    const cview out = side(s, m, ws_.send.data(), pack);
    if (pack) b_.apply_list(copy_value{}, ws_.scratch_mut, ws_.user_const);
    bool unpack = false;
    const view in = side(d, m, ws_.recv.data(), unpack);
    comm_.exchange(peer, out, in);
    if (unpack) b_.apply_list(copy_value{}, ws_.user_mut, ws_.scratch_const);
  }

  /// The view of m elements that one side of an exchange uses, with `buf` its buffer: the
  /// user range (through `buf` when its pieces are not adjacent: `via_buf` true), elements
  /// from `lo` of `buf`, or the junk slot.
  view side(endpoint e, std::size_t m, T* buf, bool& via_buf) {
    switch (e.kind) {
      case endpoint::user_k: {
        bool direct = false;
        const view v = user_or_scratch(e.lo, m, buf, direct);
        via_buf = !direct;
        return v;
      }
      case endpoint::buffer_k:
        return scratch(buf + e.lo, m);
      case endpoint::junk_slot_k:
        break;
    }
    return ws_.junk;
  }

  /// One level of the reduce-scatter: this rank holds h (of its group's vector); it keeps one
  /// half, swaps the other with `peer` (who holds the same range of the other vector), sums
  /// the per-tensor partials with `sum_peers` in order (recursive doubling, lower operand
  /// first), and combines its half. Returns the kept half.
  range reduce_scatter_step(int peer, bool lower, range h, std::span<const int> sum_peers,
                            std::span<const bool> sum_lower) {
    const range keep = lower ? h.lower() : h.upper();
    const std::size_t f = h.lower().size();
    const std::size_t c = h.upper().size();  // f or f + 1
    // f elements each way: the lower rank sends [mid, mid + f), the upper rank [lo, mid).
    xfer(peer, src::user(lower ? h.mid() : h.lo), dst::scratch(0), f);
    if (c > f) {  // the last element of the upper half goes to the upper rank alone
      if (lower)
        xfer(peer, src::user(h.hi - 1), dst::junk_slot(), 1);
      else
        xfer(peer, src::junk_slot(), dst::scratch(f), 1);
    }

    // Partials of the kept half: a is the lower rank's vector, b the upper rank's.
    const std::size_t count = list_.size();
    b_.apply(set_zero{}, dview::vector(ws_.mine.data(), static_cast<std::int64_t>(3 * count)));
    const std::size_t first = build(keep, ws_.recv.data());
    if (lower)
      partial_dots(b_, ws_, ws_.user_const, ws_.scratch_const, first);
    else
      partial_dots(b_, ws_, ws_.scratch_const, ws_.user_const, first);
    for (std::size_t s = 0; s < sum_peers.size(); ++s) {
      comm_.exchange(sum_peers[s], cdview(ws_.mine), ws_.theirs);
      if (sum_lower[s])
        b_.apply(add_partials<true>{}, ws_.mine, cdview(ws_.theirs));
      else
        b_.apply(add_partials<false>{}, ws_.mine, cdview(ws_.theirs));
    }
    combine_pieces(b_, ws_, !lower, first, threshold_);
    return keep;
  }

  /// One level of the allgather: the partners hold the two halves of `parent` and swap them.
  void allgather_step(int peer, bool lower, range parent) {
    const std::size_t f = parent.lower().size();
    const std::size_t c = parent.upper().size();
    xfer(peer, src::user(lower ? parent.lo : parent.mid()), dst::user(lower ? parent.mid() : parent.lo), f);
    if (c > f) {
      if (lower)
        xfer(peer, src::junk_slot(), dst::user(parent.hi - 1), 1);
      else
        xfer(peer, src::user(parent.hi - 1), dst::junk_slot(), 1);
    }
  }

  /// Runs an in-place collective `op` over the list in pieces of at most ceil(n/2) elements
  /// (the same pieces on every rank). Non-contiguous pieces are packed into the send scratch
  /// first when `pack` (the ranks that contribute data) and unpacked after when `unpack` (the
  /// ranks that receive data).
  template <class Op>
  void chunked(Op op, bool pack, bool unpack) {
    const std::size_t n = ws_.total;
    const std::size_t cap = ws_.half;
    for (std::size_t lo = 0; lo < n; lo += cap) {
      const std::size_t m = std::min(cap, n - lo);
      bool direct = false;
      const view v = user_or_scratch(lo, m, ws_.send.data(), direct);
      if (!direct && pack) b_.apply_list(copy_value{}, ws_.scratch_mut, ws_.user_const);
      op(v);
      if (!direct && unpack) b_.apply_list(copy_value{}, ws_.user_mut, ws_.scratch_const);
    }
  }

  const B& b_;
  C& comm_;
  buffers<T, S>& ws_;
  std::span<const view> list_;
  double threshold_;
};

}  // namespace gradapt::detail::adasum

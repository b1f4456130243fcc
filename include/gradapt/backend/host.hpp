#pragma once
/// @file
/// The host backend: element-wise functors and reductions over host memory, with optional
/// OpenMP threads. Reductions are accumulated in double with a fixed blocking, so results are
/// bitwise identical for any thread count and from run to run.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/factored_checks.hpp"
#include "gradapt/backend/host/apply.hpp"
#include "gradapt/backend/host/factored.hpp"
#include "gradapt/backend/host/reduce.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradapt {

/// Host backend: runs element functors and reductions over `tensor_view<T, host_space>`.
///
/// `threads` is the number of OpenMP threads (0: OpenMP's default, `omp_get_max_threads()`;
/// without OpenMP every operation runs on the calling thread). Nothing is allocated.
///
/// Determinism: reductions use a fixed blocking (4096-element blocks, 8 double accumulators
/// per block, blocks added in order, tensors added in order), independent of `threads`.
struct host {
  /// Views this backend accepts: ordinary host memory.
  using space = host_space;

  /// OpenMP threads per operation: 0 (default) for OpenMP's default, else a positive count.
  /// A negative count makes the operations throw gradapt::error (`thread_count()` checks it);
  /// without OpenMP a valid count is ignored. Results do not depend on it.
  int threads = 0;

  /// Threads actually used.
  int thread_count() const {
    detail::require(threads >= 0, "host backend: threads is ", threads,
                    " (expected 0 for OpenMP's default, or a positive count)");
#if defined(_OPENMP)
    return threads == 0 ? omp_get_max_threads() : threads;
#else
    return 1;
#endif
  }
  /// A copy of this backend that runs every operation on one thread (for work inside a task
  /// of `run_tasks`).
  host single_thread() const {
    host h = *this;
    h.threads = 1;
    return h;
  }

  /// Element-wise `f` over views of equal size: for each i, loads element i of every view into
  /// its compute type, calls `f(v0, v1, ...)` with lvalue references, and stores the values of
  /// non-const views back (16-bit types round to nearest even). Views may alias only if they
  /// are the same view passed once.
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply needs at least one view");
    const std::size_t n = check_sizes(views...);
    detail::host_impl::apply_one(f, tensor_index{0}, n, thread_count(), views.data()...);
  }

  /// Element-wise `f` over lists of tensors: tensor t of every list must have the same size.
  /// When `f` is callable as `f(gradapt::tensor_index{t}, v0, v1, ...)` it gets the index.
  template <class F, class... Ls>
  requires(view_list<Ls, host_space>&&...) void apply_list(F f, const Ls&... lists) const {
    static_assert(sizeof...(Ls) > 0, "gradapt::host::apply_list needs at least one list");
    const std::size_t count = check_list_lengths(lists...);
    const int nt = thread_count();
    // All sizes are checked before any element is touched (and before a parallel region,
    // where an exception could not propagate).
    std::size_t chunks = 0;
    for (std::size_t t = 0; t < count; ++t)
      chunks += (check_list_sizes(t, lists...) + detail::host_impl::apply_chunk - 1) /
                detail::host_impl::apply_chunk;
#if defined(_OPENMP)
    // One parallel region for the whole list: the chunks of all tensors, numbered in tensor
    // order, are split into one contiguous range per thread. No barrier between tensors, and
    // small tensors are spread over the threads too. Element-wise work: the split does not
    // change any result.
    if (nt > 1 && chunks > 1) {
#pragma omp parallel num_threads(nt)
      {
        const auto T = static_cast<std::size_t>(omp_get_num_threads());
        const auto me = static_cast<std::size_t>(omp_get_thread_num());
        const std::size_t lo = chunks * me / T, hi = chunks * (me + 1) / T;
        std::size_t first = 0;  // global number of tensor t's first chunk
        for (std::size_t t = 0; t < count && first < hi; ++t) {
          const std::size_t n = std::ranges::data(first_list(lists...))[t].size();
          constexpr std::size_t C = detail::host_impl::apply_chunk;
          const std::size_t nc = (n + C - 1) / C;
          for (std::size_t c = std::max(lo, first); c < std::min(hi, first + nc); ++c)
            detail::host_impl::apply_one(f, tensor_index{t},
                                         std::min(n, (c - first + 1) * C) - (c - first) * C, 1,
                                         (std::ranges::data(lists)[t].data() + (c - first) * C)...);
          first += nc;
        }
      }
      return;
    }
#endif
    for (std::size_t t = 0; t < count; ++t)
      detail::host_impl::apply_one(f, tensor_index{t}, std::ranges::data(first_list(lists...))[t].size(), nt,
                                   std::ranges::data(lists)[t].data()...);
  }

  /// Fused element-wise apply and per-tensor sum: like `apply_list`, but `f` also returns a
  /// value per element (a `double`, or `gradapt::terms<K>` for K values) that is summed per
  /// tensor in double. Writes per-tensor sums into `per_tensor` (empty, or count * K slots;
  /// tensor t's value k at t * K + k) and returns their sum in tensor order (a `double`, or
  /// `terms<K>`).
  ///
  /// One pass over memory: the update and the statistics it needs (a gradient norm for the
  /// noise scale, a trust-ratio norm, a non-finite count) cost no extra read. The summation
  /// order is `reduce`'s (4096-element blocks, 8 lanes, fixed tree, blocks then tensors in
  /// order), so a functor returning `double(x) * double(x)` gives `reduce(sum_squares)`'s bits
  /// for any thread count. Each value is taken from the functor's return, before the element's
  /// stores.
  template <class F, class... Ls>
  requires(view_list<Ls, host_space>&&...) auto apply_reduce_list(F f, std::span<double> per_tensor,
                                                                  const Ls&... lists) const {
    static_assert(sizeof...(Ls) > 0, "gradapt::host::apply_reduce_list needs at least one list");
    using R = typename detail::host_impl::reduce_result<
        std::is_invocable_v<F&, tensor_index, compute_t<detail::host_impl::list_elem_t<Ls>>&...>, F,
        detail::host_impl::list_elem_t<Ls>...>::type;
    static_assert(std::is_arithmetic_v<std::remove_cvref_t<R>> ||
                      terms_size<std::remove_cvref_t<R>>::value > 1 ||
                      std::is_same_v<std::remove_cvref_t<R>, terms<1>>,
                  "gradapt::host::apply_reduce_list: the functor must return a double (or another "
                  "arithmetic type) or gradapt::terms<K>");
    constexpr std::size_t K = terms_size<std::remove_cvref_t<R>>::value;
    const std::size_t count = check_list_lengths(lists...);
    detail::require(per_tensor.empty() || per_tensor.size() == count * K,
                    "host backend apply_reduce_list: per_tensor has ", per_tensor.size(), " slots for ",
                    count, " tensors x ", K, " values (expected ", count * K,
                    ", or empty for the total only)");
    const int nt = thread_count();
    terms<K> total{};
    double one[K];
    for (std::size_t t = 0; t < count; ++t) {
      const std::size_t n = check_list_sizes(t, lists...);
      double* out = per_tensor.empty() ? one : per_tensor.data() + t * K;
      detail::host_impl::apply_reduce_one<K>(f, tensor_index{t}, n, nt, out,
                                             std::ranges::data(lists)[t].data()...);
      for (std::size_t k = 0; k < K; ++k) total[k] += out[k];
    }
    if constexpr (std::is_arithmetic_v<std::remove_cvref_t<R>>)
      return total[0];
    else
      return total;
  }

  /// `apply_reduce_list` over single views of equal size.
  template <class F, class... Ts>
  auto apply_reduce(F f, tensor_view<Ts, host_space>... views) const {
    return apply_reduce_list(f, std::span<double>{},
                             std::span<const tensor_view<Ts, host_space>>(&views, 1)...);
  }

  /// Reduction of one tensor, accumulated in double.
  template <class T>
  double reduce(reduction op, tensor_view<T, host_space> x) const {
    const std::span<const tensor_view<T, host_space>> one(&x, 1);
    return reduce(op, one, std::span<double>{});
  }

  /// Per-tensor reductions (into `per_tensor`, which must be empty or have one slot per
  /// tensor) and the global result: the per-tensor results combined in tensor order.
  template <class L>
  requires view_list<L, host_space>
  double reduce(reduction op, const L& xs, std::span<double> per_tensor) const {
    check_out(xs, per_tensor, "reduce");
    using namespace detail::host_impl;
    const int nt = thread_count();
    const auto no_y = [](std::size_t) { return static_cast<const float*>(nullptr); };
    switch (op) {
      case reduction::sum:
        return reduce_list<rk::sum>(xs, no_y, per_tensor, nt);
      case reduction::sum_squares:
        return reduce_list<rk::sum_squares>(xs, no_y, per_tensor, nt);
      case reduction::max_abs:
        return reduce_list<rk::max_abs>(xs, no_y, per_tensor, nt);
      case reduction::count_nonfinite:
        return reduce_list<rk::nonfinite>(xs, no_y, per_tensor, nt);
    }
    detail::fail("host backend: unknown reduction");
  }

  /// Dot product of two equal-size tensors, accumulated in double.
  template <class T, class U>
  double dot(tensor_view<T, host_space> x, tensor_view<U, host_space> y) const {
    const std::span<const tensor_view<T, host_space>> xs(&x, 1);
    const std::span<const tensor_view<U, host_space>> ys(&y, 1);
    return dot(xs, ys, std::span<double>{});
  }

  /// Per-tensor dot products and their sum in tensor order.
  template <class L1, class L2>
  requires view_list<L1, host_space> && view_list<L2, host_space>
  double dot(const L1& xs, const L2& ys, std::span<double> per_tensor) const {
    const std::size_t count = check_list_lengths(xs, ys);
    for (std::size_t t = 0; t < count; ++t) check_list_sizes(t, xs, ys);
    check_out(xs, per_tensor, "dot");
    const auto* yp = std::ranges::data(ys);
    return detail::host_impl::reduce_list<detail::host_impl::rk::dot>(
        xs, [yp](std::size_t t) { return yp[t].data(); }, per_tensor, thread_count());
  }

  /// Element-wise combination of `count` arrays of `n` elements into `out`, in source order:
  /// `out[i] = x_0[i] op x_1[i] op ...` in compute_t<T>, rounded once; max propagates NaN.
  /// `source(k)` returns source k's first element (`const T*`); `out` may be one of the
  /// sources (the same elements) but may not overlap one otherwise. Runs on the calling thread
  /// (a communicator calls it from every rank on its own slice). The kernel of comm::threads'
  /// reductions.
  ///
  /// `then(b, e)` (optional) is called in order for each block [b, e) of 4096 elements (the
  /// last one shorter) as soon as `out[b, e)` is stored, while the block is still in cache:
  /// comm::threads copies each block of a rank's slice into the other ranks' buffers there.
  template <element T, class Src, class Then = detail::host_impl::no_block_hook>
  requires std::is_invocable_r_v<const T*, const Src&, int> &&
      std::is_invocable_v<const Then&, std::size_t, std::size_t>
  static void combine_sources(int count, const Src& source, T* out, std::size_t n, reduce_op op,
                              const Then& then = {}) {
    detail::require(count >= 1, "host backend combine_sources: count is ", count, " (expected >= 1)");
    detail::host_impl::combine_sources<false>(count, source, out, n, op, std::false_type{}, then);
  }

  /// The mean of `count` arrays in one pass: combine_sources with `reduce_op::sum`, each sum
  /// rounded to T and then divided by `count` in compute_t<T> (the bits of the sum followed by
  /// `apply(detail::divide_by_ranks{count}, out)`, without the second pass over memory). The
  /// kernel of comm::threads' `allreduce_mean`. `out` and `then` as for combine_sources.
  template <element T, class Src, class Then = detail::host_impl::no_block_hook>
  requires std::is_invocable_r_v<const T*, const Src&, int> &&
      std::is_invocable_v<const Then&, std::size_t, std::size_t>
  static void combine_sources_mean(int count, const Src& source, T* out, std::size_t n,
                                   const Then& then = {}) {
    detail::require(count >= 1, "host backend combine_sources_mean: count is ", count, " (expected >= 1)");
    detail::host_impl::combine_sources<false>(count, source, out, n, reduce_op::sum, std::true_type{}, then);
  }

  /// combine_sources with `reduce_op::sum` that also returns, in double, the sum over sources
  /// of |x_k|^2 and |out|^2 as stored, accumulated block by block (4096 elements, 8 lanes, the
  /// fixed tree) while each block is in cache, so the bits depend only on n and `count`.
  /// `out` and `then` as for combine_sources (`then` sees each block after its norms).
  template <element T, class Src, class Then = detail::host_impl::no_block_hook>
  requires std::is_invocable_r_v<const T*, const Src&, int> &&
      std::is_invocable_v<const Then&, std::size_t, std::size_t>
  static allreduce_norms combine_sources_with_norms(int count, const Src& source, T* out, std::size_t n,
                                                    const Then& then = {}) {
    detail::require(count >= 1, "host backend combine_sources_with_norms: count is ", count,
                    " (expected >= 1)");
    return detail::host_impl::combine_sources<true>(count, source, out, n, reduce_op::sum, std::false_type{},
                                                    then);
  }

  /// Host work is synchronous: nothing to wait for.
  void synchronize() const {}

  /// Owning, zero-initialised memory for `n` elements of T that this backend's operations
  /// read and write (an algorithm's state between steps, e.g. optimizer moments). Allocate
  /// at set-up: a step path never calls it. `data()` and `size()` give the view's parts.
  template <element T>
  std::vector<T> allocate(std::size_t n) const {
    return std::vector<T>(n);
  }

  /// Copies `src` into `dst` (equal sizes). Here both are host memory; the CUDA backend's
  /// overloads copy between device and host memory, so state save/restore is written once.
  /// @throws gradapt::error if the sizes differ
  template <class T>
  void copy(tensor_view<const T, host_space> src, tensor_view<T, host_space> dst) const {
    detail::require(src.size() == dst.size(), "host backend copy: source has ", src.size(),
                    " elements but destination has ", dst.size(), " (expected equal sizes)");
    if (src.size() != 0) std::memcpy(static_cast<void*>(dst.data()), src.data(), src.bytes());
  }

  /// Row and column reductions of a tensor seen as the row-major shape d = [A, X, B, Y, C]
  /// (A·X·B·Y·C == x.size()): the factored statistics of Adafactor (Shazeer & Stern 2018) and
  /// the covers of SM3 (Anil et al. 2019). With t = f(r, c, x[a, i, b, j, c']) where r and c
  /// are the element's entries of the optional `row` and `col` vectors (indexed as over_y and
  /// over_x below; 1 where a vector is empty), in their compute types, and f returns a value
  /// that is widened to double (a compute-type value, or a double):
  ///
  ///     over_y[((a·X + i)·B + b)·C + c'] = ⊕_j t     (A·X·B·C values; reduce over axis Y)
  ///     over_x[((a·B + b)·Y + j)·C + c'] = ⊕_i t     (A·B·Y·C values; reduce over axis X)
  ///
  /// ⊕ is `op`: a sum (in double) or a max (NaN if any term is NaN; -inf for no terms). A 2-D
  /// [n, m] tensor is d = [1, n, 1, m, 1]: over_y holds the n row results, over_x the m column
  /// results. Either output may be empty (not computed). Fixed order, independent of
  /// `threads`: over_y with C == 1 adds term j into lane j mod 8 and combines the 8 lanes as a
  /// fixed tree, with C > 1 adds j in ascending order. over_x: when both outputs are wanted,
  /// C == 1 and Y <= `group_line_max` (4096), the lines of a slice form groups of
  /// G = max(16, 65536 / Y) consecutive i; a group's terms are added in ascending i and the
  /// group results in group order (each line is read once, by one thread; `bench_factored`'s
  /// stats_pass row times it against a plain read of the same bytes); otherwise
  /// i is added in ascending order, and on several threads lines are processed in blocks of
  /// about 256 KiB so that the column reduction re-reads them from cache. A sum through a
  /// functor with `vectorizable = true` over float data (C == 1) is computed on `simd::pack`s
  /// of 8 (f returns the float pack, widened), with the same bits. Nothing is allocated (the
  /// grouped path keeps a 32 KiB partial per thread on the stack).
  /// @throws gradapt::error if d does not describe x or a vector has the wrong size
  template <class F, class RY, class RX, class T>
  void reduce_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                       tensor_view<RX, host_space> col, tensor_view<T, host_space> x,
                       tensor_view<double, host_space> over_y, tensor_view<double, host_space> over_x,
                       reduce_op op = reduce_op::sum) const {
    const auto dd =
        detail::host_impl::factored::check_factored(d, x.size(), row.size(), col.size(), "reduce_factored");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C;
    detail::check_factored_vector("host backend ", "reduce_factored", "over_y", over_y.size(), ny, "A*X*B*C");
    detail::check_factored_vector("host backend ", "reduce_factored", "over_x", over_x.size(), nx, "A*B*Y*C");
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    if (op == reduce_op::max)
      detail::host_impl::factored::reduce_factored_impl<true>(thread_count(), f, rp, cp, x.data(), A, X, B, Y,
                                                              C, over_y.data(), over_y.empty(), over_x.data(),
                                                              over_x.empty());
    else
      detail::host_impl::factored::reduce_factored_impl<false>(thread_count(), f, rp, cp, x.data(), A, X, B,
                                                               Y, C, over_y.data(), over_y.empty(),
                                                               over_x.data(), over_x.empty());
  }

  /// `reduce_factored` (sums) that also returns Σ_k y_k² of a second view `y` of x's size,
  /// read in the same pass as x (each line of y right after the same line of x; Adafactor's
  /// parameter scale rides in its statistics pass). Each element is widened to double, then
  /// squared; line l = (a·X + i)·B + b of Y·C elements is summed in 8 lanes (element k into lane
  /// k mod 8, fixed tree) into line_sums[l], and the A·X·B line sums are added in line order,
  /// so the result is independent of `threads`. Both outputs are required. Nothing is allocated.
  /// @throws gradapt::error on a size mismatch (names the view and the expected size)
  template <class F, class RY, class RX, class T, class U>
  double reduce_factored_sumsq(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                               tensor_view<RX, host_space> col, tensor_view<T, host_space> x,
                               tensor_view<double, host_space> over_y, tensor_view<double, host_space> over_x,
                               tensor_view<U, host_space> y,
                               tensor_view<double, host_space> line_sums) const {
    const auto dd = detail::host_impl::factored::check_factored(d, x.size(), row.size(), col.size(),
                                                                "reduce_factored_sumsq");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C, lines = A * X * B;
    detail::check_factored_vector("host backend ", "reduce_factored_sumsq", "over_y", over_y.size(), ny,
                                  "A*X*B*C", false);
    detail::check_factored_vector("host backend ", "reduce_factored_sumsq", "over_x", over_x.size(), nx,
                                  "A*B*Y*C", false);
    detail::require(y.size() == x.size(), "host backend reduce_factored_sumsq: y has ", y.size(),
                    " elements but x has ", x.size(), " (expected equal sizes)");
    detail::require(line_sums.size() >= lines, "host backend reduce_factored_sumsq: line_sums has ",
                    line_sums.size(), " elements (expected at least A*X*B = ", lines, ")");
    if (x.size() == 0) {
      reduce_factored(f, d, row, col, x, over_y, over_x);
      return 0.0;
    }
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    detail::host_impl::factored::reduce_factored_impl<false>(thread_count(), f, rp, cp, x.data(), A, X, B, Y,
                                                             C, over_y.data(), false, over_x.data(), false,
                                                             y.data(), line_sums.data());
    double total = 0.0;
    for (std::size_t l = 0; l < lines; ++l) total += line_sums.data()[l];
    return total;
  }

  /// Element-wise `f` over views of equal size seen as d = [A, X, B, Y, C] (see
  /// `reduce_factored`), with one entry of a row vector and one of a column vector per
  /// element: `f(r, c, v0, v1, ...)` where r = row[((a·X + i)·B + b)·C + c] and
  /// c = col[((a·B + b)·Y + j)·C + c] in their compute types (1 where that vector is empty),
  /// and v0, v1, ... are lvalues of the elements (non-const views are stored back). Adafactor's
  /// update: u = g · r_i · c_j.
  ///
  /// When `f` returns a value it is summed in double and returned: per line of Y·C elements
  /// in 8 lanes (element k into lane k mod 8, fixed tree), lines added in order; independent of
  /// `threads`. A functor with `vectorizable = true` is called with `simd::pack` lvalues when
  /// C == 1 and every view and vector holds float (same bits as the scalar calls).
  /// @throws gradapt::error on a size mismatch
  template <class F, class RY, class RX, class... Ts>
  double apply_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                        tensor_view<RX, host_space> col, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply_factored needs at least one view");
    const std::size_t n = check_sizes(views...);
    const auto dd =
        detail::host_impl::factored::check_factored(d, n, row.size(), col.size(), "apply_factored");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    if (n == 0) return 0.0;
    const std::size_t L = Y * C, lines = A * X * B;
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    using R = decltype(f(compute_t<RY>(1), compute_t<RX>(1), std::declval<compute_t<Ts>&>()...));
    constexpr bool reduces = !std::is_void_v<R>;
    const auto line = [&](std::size_t l) -> double {
      const std::size_t a = l / (X * B), b = l % B;
      const std::size_t cbase = (a * B + b) * L;
      return detail::host_impl::factored::factored_line<reduces>(f, l * L, L, C, rp, rp ? l * C : 0, cp,
                                                                 cbase, views.data()...);
    };
    const int nt = thread_count();
    const bool par = nt > 1 && lines > 1 && n >= 2 * detail::host_impl::apply_chunk;
    if constexpr (!reduces) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(nt) if (par)
#endif
      for (std::size_t l = 0; l < lines; ++l) line(l);
      (void)par;
      return 0.0;
    } else {
      // Line sums of a round on the stack (32 KiB), added in line order after the round.
      constexpr std::size_t R0 = 4096;
      double part[R0];
      double total = 0.0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) if (par)
#endif
      for (std::size_t l0 = 0; l0 < lines; l0 += R0) {
        const std::size_t rb = std::min(R0, lines - l0);
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (std::size_t j = 0; j < rb; ++j) part[j] = line(l0 + j);
#if defined(_OPENMP)
#pragma omp single
#endif
        for (std::size_t j = 0; j < rb; ++j) total += part[j];
      }
      (void)par;
      return total;
    }
  }

  /// `apply_factored` with a value-returning `f` whose sum is stored in `sum[0]` instead of
  /// returned (the same bits). The form the optimizers call on every backend: on a device the
  /// sum stays in device memory for a later kernel, so the step never waits for the host.
  /// @throws gradapt::error on a size mismatch or when `sum` is empty
  template <class F, class RY, class RX, class... Ts>
  void apply_factored_sum(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                          tensor_view<RX, host_space> col, tensor_view<double, host_space> sum,
                          tensor_view<Ts, host_space>... views) const {
    detail::require(sum.size() >= 1,
                    "host backend apply_factored_sum: the sum view is empty (expected 1 element)");
    sum.data()[0] = apply_factored(f, d, row, col, views...);
  }

  /// Element-wise `f(r, c, v0, v1, ...)` as in `apply_factored`, where f also returns a term
  /// t (a value of a compute type) whose per-row and per-column maxima are kept in the same
  /// pass. `f.term(r, c, v0, v1, ...)` must return the same t without writing anything and
  /// from only the views f does not write (it is called again on a line that holds a NaN
  /// term, after f ran): over_y[((a·X + i)·B + b)·C + c'] = max_j t and over_x[((a·B + b)·Y + j)·C + c'] =
  /// max_i t (the indexing of `reduce_factored`), NaN when any of the terms is NaN, -inf for
  /// none. The maxima do not depend on the order the terms are taken in, so this gives
  /// `reduce_factored(term, ..., reduce_op::max)` followed by `apply_factored(f, ...)` in one
  /// read of the views (SM3's covers and update). Runs on the calling thread (the per-column
  /// maxima would need a copy per thread): a per-tensor task's operation. A functor with
  /// `vectorizable = true` over float data (C == 1) runs on `simd::pack`s of 8 (AVX2 when the
  /// CPU has it), with the same results as the scalar calls. Nothing is allocated.
  /// @throws gradapt::error on a size mismatch
  template <class F, class RY, class RX, class M, class... Ts>
  void apply_factored_max(F f, std::array<std::int64_t, 5> d, tensor_view<RY, host_space> row,
                          tensor_view<RX, host_space> col, tensor_view<M, host_space> over_y,
                          tensor_view<M, host_space> over_x, tensor_view<Ts, host_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::host::apply_factored_max needs at least one view");
    static_assert(std::is_floating_point_v<M>,
                  "gradapt::host::apply_factored_max: maxima are float or double");
    const std::size_t n = check_sizes(views...);
    const auto dd =
        detail::host_impl::factored::check_factored(d, n, row.size(), col.size(), "apply_factored_max");
    const std::size_t A = dd[0], X = dd[1], B = dd[2], Y = dd[3], C = dd[4];
    const std::size_t ny = A * X * B * C, nx = A * B * Y * C;
    detail::require(over_y.size() == ny && over_x.size() == nx,
                    "host backend apply_factored_max: over_y has ", over_y.size(), " and over_x ",
                    over_x.size(), " elements (expected A*X*B*C = ", ny, " and A*B*Y*C = ", nx, ")");
    M* oy = over_y.data();
    M* ox = over_x.data();
    std::fill(oy, oy + ny, -std::numeric_limits<M>::infinity());
    std::fill(ox, ox + nx, -std::numeric_limits<M>::infinity());
    const std::size_t L = Y * C, lines = A * X * B;
    const auto* rp = row.empty() ? nullptr : row.data();
    const auto* cp = col.empty() ? nullptr : col.data();
    for (std::size_t l = 0; l < lines; ++l) {
      const std::size_t a = l / (X * B), b = l % B;
      const std::size_t cbase = (a * B + b) * L;
      detail::host_impl::factored::max_line(f, l * L, L, C, rp, l * C, cp, cbase, oy + l * C, ox + cbase,
                                            views.data()...);
    }
  }

  /// Runs `fn(task, slot)` for every task in [0, n) on min(max_threads, thread_count())
  /// threads, handing tasks out one at a time in ascending order (OpenMP dynamic schedule); slot
  /// is the running thread's number (below that count), for per-thread workspace. The tasks
  /// must be independent. One parallel region, no barrier but its end: the factored optimizers
  /// run whole tensors as tasks (on a copy of the backend with threads = 1), which stays fast
  /// when other processes share the cores. The first exception a task throws is rethrown after
  /// all tasks ran. Nothing is allocated (unless a task throws).
  template <class F>
  void run_tasks(std::size_t n, std::size_t max_threads, const F& fn) const {
    const std::size_t nt = std::min(max_threads, static_cast<std::size_t>(thread_count()));
#if defined(_OPENMP)
    if (nt > 1 && n > 1) {
      std::exception_ptr err;
      const int nti = static_cast<int>(nt);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nti)
      for (std::size_t q = 0; q < n; ++q) {
        try {
          fn(q, static_cast<std::size_t>(omp_get_thread_num()));
        } catch (...) {
#pragma omp critical(gradapt_host_run_tasks)
          if (!err) err = std::current_exception();
        }
      }
      if (err) std::rethrow_exception(err);
      return;
    }
#endif
    (void)nt;
    for (std::size_t q = 0; q < n; ++q) fn(q, 0);
  }

 private:
  template <class V0, class... Vs>
  static std::size_t check_sizes(const V0& v0, const Vs&... vs) {
    const std::size_t n = v0.size();
    std::size_t pos = 0;
    ((++pos, detail::require(vs.size() == n, "host backend apply: view ", pos, " has ", vs.size(),
                             " elements but view 0 has ", n, " (expected equal sizes)")),
     ...);
    return n;
  }
  template <class L0, class... Ls>
  static const L0& first_list(const L0& l0, const Ls&...) {
    return l0;
  }
  template <class L0, class... Ls>
  static std::size_t check_list_lengths(const L0& l0, const Ls&... ls) {
    const std::size_t n = std::ranges::size(l0);
    std::size_t pos = 0;
    ((++pos,
      detail::require(std::ranges::size(ls) == n, "host backend: list ", pos, " holds ",
                      std::ranges::size(ls), " tensors but list 0 holds ", n, " (expected equal lengths)")),
     ...);
    return n;
  }
  template <class L0, class... Ls>
  static std::size_t check_list_sizes(std::size_t t, const L0& l0, const Ls&... ls) {
    const std::size_t n = std::ranges::data(l0)[t].size();
    std::size_t pos = 0;
    ((++pos, detail::require(std::ranges::data(ls)[t].size() == n, "host backend: tensor ", t, " has ",
                             std::ranges::data(ls)[t].size(), " elements in list ", pos, " but ", n,
                             " in list 0 (expected equal sizes)")),
     ...);
    return n;
  }
  template <class L>
  static void check_out(const L& xs, std::span<double> out, const char* what) {
    detail::require(out.empty() || out.size() == std::ranges::size(xs), "host backend ", what,
                    ": per_tensor has ", out.size(), " slots for ", std::ranges::size(xs),
                    " tensors (expected equal, or empty for the global result only)");
  }
};

static_assert(factored_sumsq_backend<host> && factored_max_backend<host> && task_backend<host>,
              "gradapt::host models optimizer_backend, factored_backend, factored_sumsq_backend, "
              "factored_max_backend and task_backend");

static_assert(backend<host>);

}  // namespace gradapt

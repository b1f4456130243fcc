#pragma once
/// @file
/// gradapt::cuda, the CUDA backend: element functors and deterministic reductions over
/// `tensor_view<T, device_space>` on one stream. Included only from .cu translation units
/// (through gradapt/backend/cuda.cuh).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ranges>
#include <span>
#include <type_traits>

#include "gradapt/backend/chunking.hpp"
#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/cuda/apply_reduce.cuh"
#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/backend/cuda/device_buffer.cuh"
#include "gradapt/backend/cuda/device_types.cuh"
#include "gradapt/backend/cuda/factored.cuh"
#include "gradapt/backend/cuda/multi_tensor.cuh"
#include "gradapt/backend/cuda/reduction_ops.cuh"
#include "gradapt/backend/cuda/workspace.cuh"
#include "gradapt/backend/factored_checks.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::cuda_impl {

/// True for `tensor_view<T, device_space>` (any element type, any cv-qualification of T).
template <class V>
inline constexpr bool is_device_view_v = false;
template <class T>
inline constexpr bool is_device_view_v<tensor_view<T, device_space>> = true;

/// The view type held by a list.
template <class L>
using list_view_t = std::remove_cvref_t<std::ranges::range_value_t<L>>;

}  // namespace detail::cuda_impl

/// CUDA backend: runs GRADAPT_HD element functors and reductions over device memory on
/// `stream`.
///
/// Build it as an aggregate, `gradapt::cuda{.stream = s}` (a null stream is the legacy default
/// stream). Every operation is enqueued on `stream`; `apply`, `apply_list`, `reduce_to` and
/// `dot_to` return without waiting, `reduce` and `dot` return host doubles and therefore wait
/// for the stream.
///
/// **Launches.** `apply_list` and the list reductions pack the pointers and sizes of up to
/// `detail::cuda_impl::batch_capacity` tensors (about 80 for four float lists under the
/// default 4000-byte argument budget, see GRADAPT_CUDA_PARAM_BYTES) into the kernel arguments
/// and cut them into chunks of `chunking::chunk_elements` (16384) elements, one block per
/// chunk: hundreds of tensors take a few launches, empty tensors take no block.
///
/// **Determinism.** Reductions accumulate in double over the fixed partition of
/// gradapt/backend/chunking.hpp (256 lanes per 16384-element chunk, strided lane folds, a
/// fixed binary tree, then the same over a tensor's chunk partials, then tensors combined in
/// order). No floating-point atomics are used and nothing depends on the batch boundaries or
/// the device's occupancy: results are bitwise identical from run to run, on any stream, and
/// equal to `chunking::chunked_tree_reduce` run with the ops of reduction_ops.cuh on the host.
/// They are not bitwise equal to gradapt::host, whose blocking is different.
///
/// **Workspace.** Reductions need `8 * (chunks + tensors)` bytes of device scratch and, for
/// the host-returning forms, `8 * tensors` bytes of pinned host memory; agreements across ranks
/// stage their words in a third, small buffer (`staging`). All live in
/// `workspace`, created with the object and shared by its copies; the memory is allocated on
/// first use and only grows. Call `reserve` or `reserve_for` during set-up so that the
/// steady-state step path performs no allocation. Copies of a backend share the workspace,
/// so copies must not run reductions concurrently on different streams; give each
/// concurrently used stream its own `gradapt::cuda` object. Not thread-safe.
///
/// **Errors.** Mismatched sizes or list lengths throw gradapt::error naming the tensor index,
/// the argument positions and both sizes; a failing CUDA call throws gradapt::error with the
/// call and cudaGetErrorString's text. Views in host_space are rejected at compile time.
///
/// Functors must be trivially copyable and callable on the device (GRADAPT_HD members or
/// `__host__ __device__` lambdas); each thread calls its own copy.
struct cuda {
  /// Views this backend accepts: device memory (host_space views do not compile).
  using space = device_space;

  /// Stream every operation is enqueued on (nullptr: the default stream).
  cudaStream_t stream = nullptr;

  /// Scratch memory for reduction partials (see the class comment). Shared by copies.
  std::shared_ptr<detail::cuda_workspace> workspace = std::make_shared<detail::cuda_workspace>();

  /// Element-wise `f` over views of equal size.
  ///
  /// For each element i: `v_k = load(view_k[i])` in `compute_t<T_k>` (float for
  /// float/half/bfloat16, double for double), `f(v_0, v_1, ...)` with the values as mutable
  /// lvalues (preceded by `gradapt::tensor_index{0}` if f accepts it), then
  /// `store(view_k[i], v_k)` (round to nearest even) for every view whose T_k is not const.
  /// Views may alias only as the same view passed once. Asynchronous.
  /// @throws gradapt::error if the sizes differ (naming both views' positions and sizes)
  template <class F, class... Views>
  void apply(F f, Views... views) const {
    static_assert(sizeof...(Views) > 0, "gradapt::cuda::apply needs at least one view");
    static_assert((detail::cuda_impl::is_device_view_v<Views> && ...),
                  "gradapt::cuda::apply: every argument after the functor must be a "
                  "gradapt::tensor_view<T, gradapt::device_space> (host_space views go to gradapt::host)");
    static_assert(detail::cuda_impl::callable<F, typename Views::element_type...>,
                  "gradapt::cuda::apply: the functor must be callable with one compute-type lvalue "
                  "reference per view (float& for float/half/bfloat16, double& for double), "
                  "optionally preceded by gradapt::tensor_index");
    const std::size_t n = [](const auto& v0, const auto&... vs) {
      std::size_t pos = 0;
      ((++pos, detail::require(vs.size() == v0.size(), "gradapt::cuda::apply: view ", pos, " has ", vs.size(),
                               " elements but view 0 has ", v0.size(), " (expected equal sizes)")),
       ...);
      return v0.size();
    }(views...);
    if (n == 0) return;
    detail::cuda_impl::apply_lists<1>(f, stream, 1, &views...);
  }

  /// Element-wise `f` over lists of tensors in one multi-tensor pass.
  ///
  /// Every list is a contiguous range of `tensor_view<T, device_space>` (a param_list's
  /// values() or grads(), a std::vector or std::span of views); all lists hold the same number
  /// of tensors and tensor t has the same size in every list. For each tensor t and element i
  /// it does what `apply` does, calling `f(gradapt::tensor_index{t}, v_0, ...)` when f accepts
  /// the index (for per-tensor scalars) and `f(v_0, ...)` otherwise. Asynchronous.
  /// @throws gradapt::error on a length or size mismatch (naming the tensor, the lists and
  ///         both sizes)
  template <class F, class... Lists>
  void apply_list(F f, const Lists&... lists) const {
    static_assert(sizeof...(Lists) > 0, "gradapt::cuda::apply_list needs at least one list");
    static_assert((view_list<Lists, device_space> && ...),
                  "gradapt::cuda::apply_list: every list must be a contiguous range of "
                  "gradapt::tensor_view<T, gradapt::device_space> (host_space lists go to gradapt::host)");
    static_assert(
        detail::cuda_impl::callable<F, typename detail::cuda_impl::list_view_t<Lists>::element_type...>,
        "gradapt::cuda::apply_list: the functor must be callable with one compute-type lvalue "
        "reference per list (float& for float/half/bfloat16, double& for double), optionally "
        "preceded by gradapt::tensor_index");
    const std::size_t count = check_lists("apply_list", lists...);
    detail::cuda_impl::apply_lists(f, stream, count, std::ranges::data(lists)...);
  }

  /// Reduction of one tensor, accumulated in double in the fixed order described above:
  /// `sum` = sum x, `sum_squares` = sum x^2, `max_abs` = max |x| (NaN if any NaN, 0 when
  /// empty), `count_nonfinite` = number of inf/NaN elements. Waits for the stream.
  template <class T>
  double reduce(reduction op, tensor_view<T, device_space> x) const {
    check_op(op, "reduce");
    return detail::cuda_ops::visit(op, [&](auto o) { return host_result<decltype(o), 1>(1, {}, &x); });
  }

  /// Per-tensor reductions of a list and their combination in tensor order (sum of the
  /// per-tensor results for sum, sum_squares and count_nonfinite; their max, NaN-propagating,
  /// for max_abs). Writes the per-tensor results to `per_tensor` unless it is empty. Waits for
  /// the stream.
  /// @throws gradapt::error unless `per_tensor` is empty or has one slot per tensor
  template <class L>
  double reduce(reduction op, const L& xs, std::span<double> per_tensor) const {
    static_assert(view_list<L, device_space>,
                  "gradapt::cuda::reduce: the list must be a contiguous range of "
                  "gradapt::tensor_view<T, gradapt::device_space>");
    check_op(op, "reduce");
    const std::size_t count = std::ranges::size(xs);
    check_host_out(count, per_tensor.size(), "reduce");
    return detail::cuda_ops::visit(
        op, [&](auto o) { return host_result<decltype(o), 0>(count, per_tensor, std::ranges::data(xs)); });
  }

  /// Dot product sum x*y of two equal-size tensors, accumulated in double (fma per element)
  /// in the fixed order described above. Waits for the stream.
  /// @throws gradapt::error if the sizes differ
  template <class T, class U>
  double dot(tensor_view<T, device_space> x, tensor_view<U, device_space> y) const {
    detail::require(x.size() == y.size(), "gradapt::cuda::dot: y has ", y.size(), " elements but x has ",
                    x.size(), " (expected equal sizes)");
    return host_result<detail::cuda_ops::dot, 1>(1, {}, &x, &y);
  }

  /// Per-tensor dot products of two lists and their sum in tensor order; per-tensor results
  /// go to `per_tensor` unless it is empty. Waits for the stream.
  /// @throws gradapt::error on a length or size mismatch, or a wrong `per_tensor` size
  template <class L1, class L2>
  double dot(const L1& xs, const L2& ys, std::span<double> per_tensor) const {
    static_assert(view_list<L1, device_space> && view_list<L2, device_space>,
                  "gradapt::cuda::dot: both lists must be contiguous ranges of "
                  "gradapt::tensor_view<T, gradapt::device_space>");
    const std::size_t count = check_lists("dot", xs, ys);
    check_host_out(count, per_tensor.size(), "dot");
    return host_result<detail::cuda_ops::dot, 0>(count, per_tensor, std::ranges::data(xs),
                                                 std::ranges::data(ys));
  }

  /// Device-resident reduction of one tensor: writes the value `reduce(op, x)` would return
  /// into `result[0]` (a one-element device view) without waiting for the stream.
  /// @throws gradapt::error unless `result` has exactly one element
  template <class T>
  void reduce_to(reduction op, tensor_view<T, device_space> x,
                 tensor_view<double, device_space> result) const {
    check_op(op, "reduce_to");
    detail::require(result.size() == 1, "gradapt::cuda::reduce_to: result has ", result.size(),
                    " elements (expected 1)");
    detail::cuda_ops::visit(op, [&](auto o) {
      device_result<decltype(o), 1>(1, result, {}, &x);
      return 0;
    });
  }

  /// Device-resident per-tensor reductions: `per_tensor[t]` (device, one slot per tensor, or
  /// empty) gets tensor t's result and `total[0]` (device, one element, or empty) the
  /// combination in tensor order, bitwise what `reduce` returns. No host synchronisation;
  /// later kernels on `stream` (a trust ratio, a clipping factor) read the results in place.
  /// @throws gradapt::error on wrong output sizes or when both outputs are empty
  template <class L>
  requires view_list<L, device_space>
  void reduce_to(reduction op, const L& xs, tensor_view<double, device_space> per_tensor,
                 tensor_view<double, device_space> total = {}) const {
    check_op(op, "reduce_to");
    const std::size_t count = std::ranges::size(xs);
    check_device_out(count, per_tensor.size(), total.size(), "reduce_to");
    detail::cuda_ops::visit(op, [&](auto o) {
      device_result<decltype(o), 0>(count, per_tensor, total, std::ranges::data(xs));
      return 0;
    });
  }

  /// Device-resident dot product of two equal-size tensors into `result[0]`; no host sync.
  /// @throws gradapt::error on a size mismatch or unless `result` has one element
  template <class T, class U>
  void dot_to(tensor_view<T, device_space> x, tensor_view<U, device_space> y,
              tensor_view<double, device_space> result) const {
    detail::require(x.size() == y.size(), "gradapt::cuda::dot_to: y has ", y.size(), " elements but x has ",
                    x.size(), " (expected equal sizes)");
    detail::require(result.size() == 1, "gradapt::cuda::dot_to: result has ", result.size(),
                    " elements (expected 1)");
    device_result<detail::cuda_ops::dot, 1>(1, result, {}, &x, &y);
  }

  /// Device-resident per-tensor dot products into `per_tensor` (one slot per tensor, or
  /// empty) and their in-order sum into `total[0]` (or empty); no host sync.
  /// @throws gradapt::error on a length or size mismatch or wrong output sizes
  template <class L1, class L2>
  requires view_list<L1, device_space> && view_list<L2, device_space>
  void dot_to(const L1& xs, const L2& ys, tensor_view<double, device_space> per_tensor,
              tensor_view<double, device_space> total = {}) const {
    const std::size_t count = check_lists("dot_to", xs, ys);
    check_device_out(count, per_tensor.size(), total.size(), "dot_to");
    device_result<detail::cuda_ops::dot, 0>(count, per_tensor, total, std::ranges::data(xs),
                                            std::ranges::data(ys));
  }

  /// Fused element-wise `f` and per-tensor sums over lists of tensors, with no host
  /// synchronisation: `f` works like apply_list's functor and also returns a value per
  /// element (a `double`, or `gradapt::terms<K>` for K values); the values are summed per
  /// tensor in double (the order of backend/cuda/apply_reduce.cuh: fixed, no atomics) into
  /// `per_tensor` (device memory, count * K doubles, tensor t's value k at t * K + k), where
  /// later kernels on `stream` read them (an optimizer's trust ratio). Asynchronous.
  /// @throws gradapt::error on a length or size mismatch, or unless per_tensor has count * K
  ///         elements
  template <class F, class... Lists>
  void apply_reduce_list(F f, tensor_view<double, device_space> per_tensor, const Lists&... lists) const {
    static_assert(sizeof...(Lists) > 0, "gradapt::cuda::apply_reduce_list needs at least one list");
    static_assert((view_list<Lists, device_space> && ...),
                  "gradapt::cuda::apply_reduce_list: every list must be a contiguous range of "
                  "gradapt::tensor_view<T, gradapt::device_space>");
    static_assert(
        detail::cuda_impl::callable<F, typename detail::cuda_impl::list_view_t<Lists>::element_type...>,
        "gradapt::cuda::apply_reduce_list: the functor must be callable with one compute-type lvalue "
        "reference per list, optionally preceded by gradapt::tensor_index");
    constexpr std::size_t K = detail::cuda_impl::apply_reduce_terms<
        F, typename detail::cuda_impl::list_view_t<Lists>::element_type...>::value;
    const std::size_t count = check_lists("apply_reduce_list", lists...);
    detail::require(per_tensor.size() == count * K, "gradapt::cuda::apply_reduce_list: per_tensor has ",
                    per_tensor.size(), " elements for ", count, " tensors x ", K, " values (expected ",
                    count * K, ")");
    if (count == 0) return;
    const auto* l0 = [](const auto& first, const auto&...) { return std::ranges::data(first); }(lists...);
    const std::size_t nchunks = detail::cuda_impl::total_chunks(count, l0);
    auto* partials = static_cast<double*>(ws().device(K * nchunks * sizeof(double), stream));
    detail::cuda_impl::apply_reduce_lists<K>(f, stream, partials, per_tensor.data(), count,
                                             std::ranges::data(lists)...);
  }

  /// Row and column reductions of `x` seen as d = [A, X, B, Y, C] (Adafactor's factored
  /// statistics, SM3's covers): the same contract as gradapt::host::reduce_factored (f(r, c, v)
  /// with the optional row/column vector entries, a sum in double or a NaN-propagating max),
  /// in the order of backend/cuda/factored.cuh. Asynchronous.
  /// @throws gradapt::error if d does not describe x or a vector has the wrong size
  template <class F, class RY, class RX, class T>
  void reduce_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, device_space> row,
                       tensor_view<RX, device_space> col, tensor_view<T, device_space> x,
                       tensor_view<double, device_space> over_y, tensor_view<double, device_space> over_x,
                       reduce_op op = reduce_op::sum) const {
    const auto fd = check_factored(d, x.size(), "reduce_factored");
    const std::size_t ny = fd.A * fd.X * fd.B * fd.C, nx = fd.A * fd.B * fd.Y * fd.C;
    check_factored_vector(row.size(), ny, "reduce_factored", "row vector");
    check_factored_vector(col.size(), nx, "reduce_factored", "column vector");
    check_factored_vector(over_y.size(), ny, "reduce_factored", "over_y");
    check_factored_vector(over_x.size(), nx, "reduce_factored", "over_x");
    const detail::cuda_impl::fvectors<RY, RX> v{row.empty() ? nullptr : row.data(),
                                                col.empty() ? nullptr : col.data()};
    using detail::cuda_impl::factored_grid;
    using detail::cuda_impl::factored_threads;
    const auto launch = [&]<bool Max>() {
      if (!over_y.empty() && ny > 0) {
        detail::cuda_impl::factored_rows_kernel<Max>
            <<<factored_grid(ny, 1), factored_threads, 0, stream>>>(f, fd, v, x.data(), over_y.data());
        GRADAPT_CUDA_CHECK(cudaGetLastError());
      }
      if (!over_x.empty() && nx > 0) {
        detail::cuda_impl::factored_cols_kernel<Max>
            <<<factored_grid(nx, factored_threads), factored_threads, 0, stream>>>(f, fd, v, x.data(),
                                                                                   over_x.data());
        GRADAPT_CUDA_CHECK(cudaGetLastError());
      }
    };
    if (op == reduce_op::max)
      launch.template operator()<true>();
    else
      launch.template operator()<false>();
  }

  /// Element-wise `f(r, c, v...)` over views seen as d = [A, X, B, Y, C], with the row and
  /// column vector entries of each element (the contract of gradapt::host::apply_factored).
  /// A void `f` is enqueued and 0 returned at once; when `f` returns a value, the values are
  /// summed in double (per line, then over lines, fixed trees) and the sum is returned, which
  /// waits for the stream (`apply_factored_sum` keeps it on the device instead).
  /// @throws gradapt::error on a size mismatch
  template <class F, class RY, class RX, class... Ts>
  double apply_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, device_space> row,
                        tensor_view<RX, device_space> col, tensor_view<Ts, device_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::cuda::apply_factored needs at least one view");
    using R = decltype(f(compute_t<RY>(1), compute_t<RX>(1), std::declval<compute_t<Ts>&>()...));
    if constexpr (std::is_void_v<R>) {
      factored_launch(f, d, row, col, nullptr, views...);
      return 0.0;
    } else {
      const double* out = factored_launch(f, d, row, col, nullptr, views...);
      if (out == nullptr) return 0.0;
      auto* host = static_cast<double*>(ws().pinned(sizeof(double)));
      GRADAPT_CUDA_CHECK(cudaMemcpyAsync(host, out, sizeof(double), cudaMemcpyDeviceToHost, stream));
      synchronize();
      return *host;
    }
  }

  /// `apply_factored` with a value-returning `f` whose sum is written to `sum[0]` in device
  /// memory (0 for empty views), with no host synchronisation: a later kernel on `stream` reads
  /// it (Adafactor's clipping statistic). Asynchronous.
  /// @throws gradapt::error on a size mismatch or when `sum` is empty
  template <class F, class RY, class RX, class... Ts>
  void apply_factored_sum(F f, std::array<std::int64_t, 5> d, tensor_view<RY, device_space> row,
                          tensor_view<RX, device_space> col, tensor_view<double, device_space> sum,
                          tensor_view<Ts, device_space>... views) const {
    static_assert(sizeof...(Ts) > 0, "gradapt::cuda::apply_factored_sum needs at least one view");
    using R = decltype(f(compute_t<RY>(1), compute_t<RX>(1), std::declval<compute_t<Ts>&>()...));
    static_assert(!std::is_void_v<R>, "gradapt::cuda::apply_factored_sum: f must return the value to sum");
    detail::require(sum.size() >= 1,
                    "gradapt::cuda::apply_factored_sum: the sum view is empty (expected 1 element)");
    if (!factored_launch(f, d, row, col, sum.data(), views...))
      GRADAPT_CUDA_CHECK(cudaMemsetAsync(sum.data(), 0, sizeof(double), stream));
  }

  /// Owning, zero-initialised device memory for `n` elements of T (an algorithm's state
  /// between steps), zeroed on `stream` before it returns. Allocates (cudaMalloc) and waits for
  /// the stream: call it at set-up, never in a step or during graph capture.
  template <element T>
  cuda_buffer<T> allocate(std::size_t n) const {
    return cuda_buffer<T>(n, stream);
  }

  /// Copies device memory to host memory (equal sizes) and waits for it.
  /// @throws gradapt::error if the sizes differ or the copy fails
  template <class T>
  void copy(tensor_view<const T, device_space> src, tensor_view<T, host_space> dst) const {
    detail::require(src.size() == dst.size(), "gradapt::cuda::copy: source has ", src.size(),
                    " elements but destination has ", dst.size(), " (expected equal sizes)");
    if (src.size() == 0) return;
    GRADAPT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToHost, stream));
    synchronize();
  }
  /// Copies host memory to device memory (equal sizes) and waits for it, so the source may be
  /// released on return.
  /// @throws gradapt::error if the sizes differ or the copy fails
  template <class T>
  void copy(tensor_view<const T, host_space> src, tensor_view<T, device_space> dst) const {
    detail::require(src.size() == dst.size(), "gradapt::cuda::copy: source has ", src.size(),
                    " elements but destination has ", dst.size(), " (expected equal sizes)");
    if (src.size() == 0) return;
    GRADAPT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyHostToDevice, stream));
    synchronize();
  }

  /// Device memory for `n` doubles that an agreement across ranks stages through (copied in,
  /// allreduced on the communicator, copied back and waited for before the caller returns:
  /// `gradapt::detail::allreduce_host_values`), from the shared workspace: grow-only, so the
  /// step path allocates nothing after its first agreement. Valid until the next call.
  double* staging(std::size_t n) const { return static_cast<double*>(ws().words(n * sizeof(double))); }

  /// Waits until all work enqueued on `stream` has finished (cudaStreamSynchronize).
  void synchronize() const { GRADAPT_CUDA_CHECK(cudaStreamSynchronize(stream)); }

  /// Grows the workspace to at least `device_bytes` of device memory and `pinned_bytes` of
  /// pinned host memory now, so later calls allocate nothing. Call it before the step loop.
  void reserve(std::size_t device_bytes, std::size_t pinned_bytes = 0) const {
    ws().device(device_bytes, stream);
    ws().pinned(pinned_bytes);
  }

  /// Reserves what any reduction or dot over a list shaped like `xs` (same tensor count and
  /// sizes), and any `apply_reduce_list` over it whose functor returns up to `terms` values,
  /// needs: `workspace_bytes(xs, terms)` device bytes and `8 * xs.size()` pinned bytes. Call
  /// it (or run the work once) before capturing that work into a CUDA graph: the workspace
  /// cannot grow during capture.
  template <class L>
  requires view_list<L, device_space>
  void reserve_for(const L& xs, std::size_t terms = 1) const {
    reserve(workspace_bytes(xs, terms), std::ranges::size(xs) * sizeof(double));
  }

  /// Device workspace bytes a reduction or dot over `xs` needs (8 bytes per chunk of
  /// `chunking::chunk_elements` elements plus 8 bytes per tensor), or an `apply_reduce_list`
  /// whose functor returns `terms` values (8 bytes per chunk and value), whichever is more.
  template <class L>
  requires view_list<L, device_space>
  static std::size_t workspace_bytes(const L& xs, std::size_t terms = 1) {
    const std::size_t count = std::ranges::size(xs);
    const std::size_t chunks = detail::cuda_impl::total_chunks(count, std::ranges::data(xs));
    return std::max(chunks + count, terms * chunks) * sizeof(double);
  }

 private:
  /// Checks the views against d and enqueues `f` over them (apply_factored's kernels). For a
  /// value-returning `f` the sum goes to `out` (to the workspace when out is null) and its
  /// address is returned; nullptr when the views are empty or f returns nothing.
  template <class F, class RY, class RX, class... Ts>
  double* factored_launch(F f, std::array<std::int64_t, 5> d, tensor_view<RY, device_space> row,
                          tensor_view<RX, device_space> col, double* out,
                          tensor_view<Ts, device_space>... views) const {
    const std::size_t n = [](const auto& v0, const auto&... vs) {
      std::size_t pos = 0;
      ((++pos, detail::require(vs.size() == v0.size(), "gradapt::cuda::apply_factored: view ", pos, " has ",
                               vs.size(), " elements but view 0 has ", v0.size(), " (expected equal sizes)")),
       ...);
      return v0.size();
    }(views...);
    const auto fd = check_factored(d, n, "apply_factored");
    const std::size_t ny = fd.A * fd.X * fd.B * fd.C, nx = fd.A * fd.B * fd.Y * fd.C;
    check_factored_vector(row.size(), ny, "apply_factored", "row vector");
    check_factored_vector(col.size(), nx, "apply_factored", "column vector");
    if (n == 0) return nullptr;
    const detail::cuda_impl::fvectors<RY, RX> v{row.empty() ? nullptr : row.data(),
                                                col.empty() ? nullptr : col.data()};
    using detail::cuda_impl::factored_grid;
    using detail::cuda_impl::factored_threads;
    using R = decltype(f(compute_t<RY>(1), compute_t<RX>(1), std::declval<compute_t<Ts>&>()...));
    if constexpr (std::is_void_v<R>) {
      detail::cuda_impl::
          factored_apply_kernel<<<factored_grid(n, factored_threads), factored_threads, 0, stream>>>(
              f, fd, v, n, views.data()...);
      GRADAPT_CUDA_CHECK(cudaGetLastError());
      return nullptr;
    } else {
      const std::size_t lines = fd.A * fd.X * fd.B;
      auto* scratch = static_cast<double*>(ws().device((lines + 1) * sizeof(double), stream));
      double* dst = out != nullptr ? out : scratch + lines;
      detail::cuda_impl::factored_apply_sum_kernel<<<factored_grid(lines, 1), factored_threads, 0, stream>>>(
          f, fd, v, scratch, views.data()...);
      GRADAPT_CUDA_CHECK(cudaGetLastError());
      detail::cuda_impl::factored_sum_kernel<<<1, factored_threads, 0, stream>>>(scratch, lines, dst);
      GRADAPT_CUDA_CHECK(cudaGetLastError());
      return dst;
    }
  }

  detail::cuda_workspace& ws() const {
    detail::require(workspace != nullptr,
                    "gradapt::cuda: workspace is null (leave the default, or assign a "
                    "std::make_shared<gradapt::detail::cuda_workspace>())");
    return *workspace;
  }

  static detail::cuda_impl::fdims check_factored(const std::array<std::int64_t, 5>& d, std::size_t n,
                                                 const char* what) {
    const auto e = detail::factored_dims(d, n, "gradapt::cuda::", what);
    return {e[0], e[1], e[2], e[3], e[4]};
  }
  static void check_factored_vector(std::size_t got, std::size_t want, const char* what, const char* name) {
    detail::check_factored_vector("gradapt::cuda::", what, name, got, want, {});
  }

  static void check_op(reduction op, const char* what) {
    detail::require(detail::cuda_ops::valid(op), "gradapt::cuda::", what, ": unknown reduction ",
                    static_cast<int>(op), " (expected sum, sum_squares, max_abs or count_nonfinite)");
  }

  /// Lengths of all lists and per-tensor sizes agree; returns the tensor count.
  template <class L0, class... Ls>
  static std::size_t check_lists(const char* what, const L0& l0, const Ls&... ls) {
    const std::size_t count = std::ranges::size(l0);
    {
      std::size_t pos = 0;
      ((++pos, detail::require(std::ranges::size(ls) == count, "gradapt::cuda::", what, ": list ", pos,
                               " holds ", std::ranges::size(ls), " tensors but list 0 holds ", count,
                               " (expected equal lengths)")),
       ...);
    }
    if constexpr (sizeof...(Ls) > 0) {
      const auto* d0 = std::ranges::data(l0);
      for (std::size_t t = 0; t < count; ++t) {
        const std::size_t n = d0[t].size();
        std::size_t pos = 0;
        ((++pos, detail::require(std::ranges::data(ls)[t].size() == n, "gradapt::cuda::", what, ": tensor ",
                                 t, " has ", std::ranges::data(ls)[t].size(), " elements in list ", pos,
                                 " but ", n, " in list 0 (expected equal sizes)")),
         ...);
      }
    }
    return count;
  }

  static void check_host_out(std::size_t count, std::size_t slots, const char* what) {
    detail::require(slots == 0 || slots == count, "gradapt::cuda::", what, ": per_tensor has ", slots,
                    " slots for ", count, " tensors (expected ", count, ", or 0 for the global result only)");
  }

  static void check_device_out(std::size_t count, std::size_t slots, std::size_t total, const char* what) {
    detail::require(slots == 0 || slots == count, "gradapt::cuda::", what, ": per_tensor has ", slots,
                    " elements for ", count, " tensors (expected ", count, ", or 0 for the total only)");
    detail::require(total <= 1, "gradapt::cuda::", what, ": total has ", total,
                    " elements (expected 1, or 0 for per-tensor results only)");
    detail::require(slots != 0 || total != 0, "gradapt::cuda::", what,
                    ": per_tensor and total are both empty (nothing to write)");
  }

  /// Enqueues the reduction with per-tensor results in the workspace, copies them to pinned
  /// memory, waits, and combines them in tensor order on the host. `Cap`: tensors per launch
  /// (0: as many as the argument budget allows; 1 for single tensors, smaller arguments).
  template <class Op, std::size_t Cap, class T0, class... Ts>
  double host_result(std::size_t count, std::span<double> per_tensor, const tensor_view<T0, device_space>* l0,
                     const tensor_view<Ts, device_space>*... ls) const {
    const std::size_t nchunks = detail::cuda_impl::total_chunks(count, l0);
    auto* scratch = static_cast<double*>(ws().device((nchunks + count) * sizeof(double), stream));
    auto* host = static_cast<double*>(ws().pinned(count * sizeof(double)));
    if (count > 0) {
      double* dev_per_tensor = scratch + nchunks;
      detail::cuda_impl::reduce_lists<Op, Cap>(stream, scratch, dev_per_tensor, nullptr, count, l0, ls...);
      GRADAPT_CUDA_CHECK(
          cudaMemcpyAsync(host, dev_per_tensor, count * sizeof(double), cudaMemcpyDeviceToHost, stream));
    }
    synchronize();
    if (!per_tensor.empty()) std::memcpy(per_tensor.data(), host, count * sizeof(double));
    return detail::cuda_impl::combine_in_order<Op>(host, count);
  }

  /// Enqueues the reduction with results in device memory only.
  template <class Op, std::size_t Cap, class T0, class... Ts>
  void device_result(std::size_t count, tensor_view<double, device_space> per_tensor,
                     tensor_view<double, device_space> total, const tensor_view<T0, device_space>* l0,
                     const tensor_view<Ts, device_space>*... ls) const {
    const std::size_t nchunks = detail::cuda_impl::total_chunks(count, l0);
    const std::size_t own_slots = per_tensor.empty() ? count : 0;
    auto* scratch = static_cast<double*>(ws().device((nchunks + own_slots) * sizeof(double), stream));
    double* dev_per_tensor = per_tensor.empty() ? scratch + nchunks : per_tensor.data();
    double* dev_total = total.empty() ? nullptr : total.data();
    detail::cuda_impl::reduce_lists<Op, Cap>(stream, scratch, dev_per_tensor, dev_total, count, l0, ls...);
  }
};

static_assert(
    factored_backend<cuda> && workspace_backend<cuda> && deferred_dot_backend<cuda>,
    "gradapt::cuda models optimizer_backend, factored_backend, workspace_backend and deferred_dot_backend");

static_assert(backend<cuda>);
static_assert(std::is_aggregate_v<cuda>);
static_assert(staging_backend<cuda>);

}  // namespace gradapt

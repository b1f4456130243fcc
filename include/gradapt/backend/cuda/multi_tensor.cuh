#pragma once
/// @file
/// Multi-tensor chunked kernels of the CUDA backend: element-wise apply and deterministic
/// reductions over lists of tensors, several hundred tensors per launch. Included only from
/// .cu translation units.
///
/// Launch shape. Tensor pointers, sizes and the exclusive chunk prefix of up to
/// `batch_capacity` tensors travel in a kernel-argument struct (`tensor_batch`, kept under
/// `param_budget` bytes together with the functor), so a launch needs no device metadata
/// buffer and no host-to-device copy. Block `b` of a launch takes global chunk `b` of its
/// batch and finds its tensor with `chunking::locate_chunk`.
///
/// Reduction order (the determinism promise). Chunk partials follow the partition of
/// gradapt/backend/chunking.hpp exactly: lane `l` of a 256-thread block folds the chunk's
/// elements `l, l + 256, ...` in order, the lanes are combined by the fixed binary tree
/// (`s = 128 .. 32` in shared memory, `s = 16 .. 1` by warp shuffles, the same tree), and a
/// second kernel reduces each tensor's chunk partials the same way. Nothing depends on the
/// batch boundaries, the stream, timing or atomics, so results are bitwise identical from
/// run to run and equal to `chunking::chunked_tree_reduce` run on the host with the ops of
/// reduction_ops.cuh.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>

#include "gradapt/backend/chunking.hpp"
#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/backend/cuda/device_types.cuh"
#include "gradapt/backend/cuda/reduction_ops.cuh"
#include "gradapt/backend/value_pack.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

/// `__grid_constant__` (CUDA 11.7+): kernel-argument structs are read in place, in the
/// parameter space, even where they are indexed dynamically, instead of being copied to
/// local memory.
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
#define GRADAPT_GRID_CONSTANT __grid_constant__
#else
#define GRADAPT_GRID_CONSTANT
#endif

/// Bytes of kernel arguments a multi-tensor launch may use. The default keeps every launch
/// under the 4096-byte limit that all architectures and CUDA versions accept; with CUDA 12.1+
/// and only Volta or newer targets it may be raised (up to 32764) to fit more tensors per
/// launch. Define it identically in every translation unit of a program.
#ifndef GRADAPT_CUDA_PARAM_BYTES
#define GRADAPT_CUDA_PARAM_BYTES 4000
#endif

namespace gradapt::detail::cuda_impl {

/// Kernel-argument bytes per launch (see GRADAPT_CUDA_PARAM_BYTES).
inline constexpr std::size_t param_budget = GRADAPT_CUDA_PARAM_BYTES;
/// Threads per block of the apply kernel.
inline constexpr unsigned apply_threads = 512;
/// Elements each apply thread loads before it computes (memory-level parallelism).
inline constexpr unsigned apply_ilp = 4;
/// Threads per block of the reduction kernels: the lanes of the reduction partition.
inline constexpr unsigned reduce_threads = static_cast<unsigned>(chunking::reduction_lanes);
/// Elements each reduction lane loads before it folds them in order.
inline constexpr unsigned reduce_ilp = 4;
/// Largest grid a launch uses (gridDim.x limit).
inline constexpr std::size_t max_grid = 0x7fffffff;

static_assert(chunking::is_power_of_two(chunking::reduction_lanes) && chunking::reduction_lanes >= 64 &&
                  chunking::reduction_lanes <= 1024,
              "the block tree needs 64 to 1024 lanes, a power of two");

/// Pointers, sizes and chunk prefix of up to N tensors from K lists: one launch's metadata,
/// passed by value as a kernel argument.
template <std::size_t K, std::size_t N>
struct tensor_batch {
  void* ptr[K][N];            ///< ptr[k][j]: data of tensor j of list k (const-ness restored by the kernel)
  std::size_t size[N];        ///< elements of tensor j (equal across lists)
  std::size_t prefix[N + 1];  ///< exclusive prefix of chunk counts; prefix[ntensors] = chunks in the launch
  std::size_t ntensors;       ///< tensors in this batch
  std::size_t first_tensor;   ///< list index of tensor 0 of the batch
  std::size_t first_chunk;    ///< global chunk number of chunk 0 of the batch (partials slot)
};

/// Tensors per launch for K lists when `reserved` bytes of other kernel arguments (the
/// functor, output pointers) share the budget.
template <std::size_t K, std::size_t Reserved>
inline constexpr std::size_t batch_capacity = (param_budget - Reserved - 4 * sizeof(std::size_t)) /
                                              (K * sizeof(void*) + 2 * sizeof(std::size_t));

/// Stores `v` into `*p` unless the element type is const (inputs are never written).
template <class T>
GRADAPT_HD GRADAPT_INLINE void store_if_mutable(T* p, compute_t<T> v) {
  if constexpr (!std::is_const_v<T>) device_store(*p, v);
}

/// True when F wants the tensor index first: `f(tensor_index, compute_t<Ts>&...)`.
template <class F, class... Ts>
inline constexpr bool wants_index = std::is_invocable_v<F&, tensor_index, compute_t<Ts>&...>;
/// True when F can be called either way.
template <class F, class... Ts>
inline constexpr bool callable = wants_index<F, Ts...> || std::is_invocable_v<F&, compute_t<Ts>&...>;

// ---- apply ------------------------------------------------------------------------------------

/// Applies `f` to elements [begin, end) of one tensor: thread `x` takes elements
/// `begin + x + k * apply_threads`, `apply_ilp` of them loaded before any is computed.
template <class F, class... Ts, std::size_t... I>
__device__ __forceinline__ void apply_range(F& f, tensor_index ti, std::size_t begin, std::size_t end,
                                            std::index_sequence<I...>, Ts*... p) {
  using pack = value_pack<compute_t<Ts>...>;
  constexpr std::size_t step = std::size_t{apply_threads} * apply_ilp;
  for (std::size_t base = begin + threadIdx.x; base < end; base += step) {
    pack v[apply_ilp];
#pragma unroll
    for (unsigned u = 0; u < apply_ilp; ++u) {
      const std::size_t i = base + std::size_t{u} * apply_threads;
      if (i < end) ((slot<I>(v[u]) = device_load(p[i])), ...);
    }
#pragma unroll
    for (unsigned u = 0; u < apply_ilp; ++u) {
      const std::size_t i = base + std::size_t{u} * apply_threads;
      if (i < end) {
        if constexpr (wants_index<F, Ts...>)
          f(ti, slot<I>(v[u])...);
        else
          f(slot<I>(v[u])...);
      }
    }
#pragma unroll
    for (unsigned u = 0; u < apply_ilp; ++u) {
      const std::size_t i = base + std::size_t{u} * apply_threads;
      if (i < end) (store_if_mutable(p + i, slot<I>(v[u])), ...);
    }
  }
}

template <class F, class Batch, class... Ts, std::size_t... I>
__device__ __forceinline__ void apply_chunk(F& f, const Batch& b, std::index_sequence<I...> seq) {
  const chunking::chunk_location loc = chunking::locate_chunk(b.prefix, b.ntensors, blockIdx.x, b.size);
  apply_range<F, Ts...>(f, tensor_index{b.first_tensor + loc.tensor}, loc.begin, loc.end, seq,
                        static_cast<Ts*>(b.ptr[I][loc.tensor])...);
}

/// One block per chunk of the batch.
template <class F, class Batch, class... Ts>
__global__ void __launch_bounds__(apply_threads)
    apply_kernel(const F f, const GRADAPT_GRID_CONSTANT Batch batch) {
  F g = f;  // a mutable per-thread copy, as the host loop calls a local copy
  apply_chunk<F, Batch, Ts...>(g, batch, std::index_sequence_for<Ts...>{});
}

// ---- reductions ---------------------------------------------------------------------------

/// The fixed lane tree over one block (reduce_threads lanes): for s = L/2 .. 1,
/// a[l] = combine(a[l], a[l + s]) for l < s. Shared memory for s >= 32, warp shuffles below;
/// the result is valid in thread 0.
template <class Op>
__device__ __forceinline__ double block_tree(double v) {
  __shared__ double lanes[reduce_threads];
  const unsigned l = threadIdx.x;
  lanes[l] = v;
  __syncthreads();
#pragma unroll
  for (unsigned s = reduce_threads / 2; s >= 32; s /= 2) {
    if (l < s) lanes[l] = Op::combine(lanes[l], lanes[l + s]);
    __syncthreads();
  }
  double r = 0.0;
  if (l < 32) {
    r = lanes[l];
#pragma unroll
    for (unsigned s = 16; s >= 1; s /= 2) r = Op::combine(r, __shfl_down_sync(0xffffffffu, r, s));
  }
  return r;
}

/// Lane `threadIdx.x` folds elements begin + lane + k * reduce_threads in increasing order.
template <class Op, class... Ts, std::size_t... I>
__device__ __forceinline__ double fold_range(std::size_t begin, std::size_t end, std::index_sequence<I...>,
                                             const Ts*... p) {
  using pack = value_pack<std::conditional_t<true, double, Ts>...>;
  constexpr std::size_t step = std::size_t{reduce_threads} * reduce_ilp;
  double acc = Op::identity();
  for (std::size_t base = begin + threadIdx.x; base < end; base += step) {
    pack v[reduce_ilp];
#pragma unroll
    for (unsigned u = 0; u < reduce_ilp; ++u) {
      const std::size_t i = base + std::size_t{u} * reduce_threads;
      if (i < end) ((slot<I>(v[u]) = static_cast<double>(device_load(p[i]))), ...);
    }
#pragma unroll
    for (unsigned u = 0; u < reduce_ilp; ++u) {
      const std::size_t i = base + std::size_t{u} * reduce_threads;
      if (i < end) acc = Op::fold(acc, slot<I>(v[u])...);
    }
  }
  return acc;
}

template <class Op, class Batch, class... Ts, std::size_t... I>
__device__ __forceinline__ double fold_chunk(const Batch& b, std::index_sequence<I...> seq) {
  const chunking::chunk_location loc = chunking::locate_chunk(b.prefix, b.ntensors, blockIdx.x, b.size);
  return fold_range<Op, Ts...>(loc.begin, loc.end, seq, static_cast<const Ts*>(b.ptr[I][loc.tensor])...);
}

/// One block per chunk: partials[first_chunk + blockIdx.x] = the chunk's partial.
template <class Op, class Batch, class... Ts>
__global__ void __launch_bounds__(reduce_threads)
    reduce_chunks_kernel(const GRADAPT_GRID_CONSTANT Batch batch, double* partials) {
  const double acc = fold_chunk<Op, Batch, Ts...>(batch, std::index_sequence_for<Ts...>{});
  const double r = block_tree<Op>(acc);
  if (threadIdx.x == 0) partials[batch.first_chunk + blockIdx.x] = r;
}

/// One block per tensor of the batch: out[first_tensor + t] = the lane tree over the tensor's
/// chunk partials (identity for an empty tensor).
template <class Op, class Batch>
__global__ void __launch_bounds__(reduce_threads)
    reduce_tensors_kernel(const GRADAPT_GRID_CONSTANT Batch batch, const double* partials, double* out) {
  const std::size_t t = blockIdx.x;
  const std::size_t c0 = batch.first_chunk + batch.prefix[t];
  const std::size_t m = batch.prefix[t + 1] - batch.prefix[t];
  double acc = Op::identity();
  for (std::size_t j = threadIdx.x; j < m; j += reduce_threads) acc = Op::combine(acc, partials[c0 + j]);
  const double r = block_tree<Op>(acc);
  if (threadIdx.x == 0) out[batch.first_tensor + t] = r;
}

/// One thread: *total = combine(...combine(identity, per_tensor[0])..., per_tensor[n-1]), the
/// same sequential order the host-returning reductions use.
template <class Op>
__global__ void reduce_total_kernel(const double* per_tensor, std::size_t n, double* total) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double acc = Op::identity();
  for (std::size_t t = 0; t < n; ++t) acc = Op::combine(acc, per_tensor[t]);
  *total = acc;
}

/// The same sequential combination on the host.
template <class Op>
double combine_in_order(const double* per_tensor, std::size_t n) {
  double acc = Op::identity();
  for (std::size_t t = 0; t < n; ++t) acc = Op::combine(acc, per_tensor[t]);
  return acc;
}

// ---- host side: batching and launches -------------------------------------------------------

/// Total chunks of a list (prefix over all its tensors).
template <class T>
std::size_t total_chunks(std::size_t count, const tensor_view<T, device_space>* list) {
  std::size_t total = 0;
  for (std::size_t t = 0; t < count; ++t) total += chunking::chunk_count(list[t].size());
  return total;
}

/// Packs `count` tensors of K parallel lists into batches of up to N tensors and calls
/// `launch(batch, chunks_in_batch)` for each. Sizes are taken from list 0 (callers have
/// checked they agree).
template <std::size_t N, class Launch, class... Ts>
void for_each_batch(std::size_t count, Launch&& launch, const tensor_view<Ts, device_space>*... lists) {
  constexpr std::size_t K = sizeof...(Ts);
  static_assert(N >= 1, "GRADAPT_CUDA_PARAM_BYTES leaves no room for a tensor in a launch");
  using batch_t = tensor_batch<K, N>;
  static_assert(std::is_trivially_copyable_v<batch_t>);
  const auto* first = [](const auto* l0, const auto*...) { return l0; }(lists...);
  batch_t b{};
  std::size_t chunk_base = 0;
  for (std::size_t t = 0; t < count;) {
    const std::size_t nt = count - t < N ? count - t : N;
    b.ntensors = nt;
    b.first_tensor = t;
    b.first_chunk = chunk_base;
    for (std::size_t j = 0; j < nt; ++j) {
      std::size_t k = 0;
      ((b.ptr[k++][j] = const_cast<void*>(static_cast<const void*>(lists[t + j].data()))), ...);
      b.size[j] = first[t + j].size();
    }
    const std::size_t chunks = chunking::exclusive_chunk_prefix(std::span<const std::size_t>(b.size, nt),
                                                                std::span<std::size_t>(b.prefix, nt + 1));
    require(chunks <= max_grid, "cuda backend: tensors ", t, " to ", t + nt - 1, " need ", chunks,
            " chunks in one launch (at most ", max_grid, " of ", chunking::chunk_elements,
            " elements are supported)");
    launch(b, chunks);
    chunk_base += chunks;
    t += nt;
  }
}

/// Element-wise `f` over `count` tensors of each list, in as few launches as the argument
/// budget allows. `Cap` > 0 caps the tensors per launch (1 for a single view keeps the
/// kernel arguments small); 0 takes the full budget.
template <std::size_t Cap = 0, class F, class... Ts>
void apply_lists(const F& f, cudaStream_t stream, std::size_t count,
                 const tensor_view<Ts, device_space>*... lists) {
  constexpr std::size_t N = Cap > 0 ? Cap : batch_capacity<sizeof...(Ts), sizeof(F)>;
  static_assert(N <= batch_capacity<sizeof...(Ts), sizeof(F)>, "Cap exceeds the kernel-argument budget");
  using batch_t = tensor_batch<sizeof...(Ts), N>;
  for_each_batch<N>(
      count,
      [&](const batch_t& b, std::size_t chunks) {
        if (chunks == 0) return;
        apply_kernel<F, batch_t, Ts...><<<static_cast<unsigned>(chunks), apply_threads, 0, stream>>>(f, b);
        GRADAPT_CUDA_CHECK_LAUNCH("gradapt apply_kernel");
      },
      lists...);
}

/// Reduces `count` tensors of the lists with Op: per-tensor results into `per_tensor` (device,
/// `count` doubles) and, when `total` is non-null, their in-order combination into `*total`
/// (device). `partials` must hold `total_chunks` doubles. Enqueued on `stream`, no host sync.
/// `Cap` as for apply_lists; the results do not depend on it.
template <class Op, std::size_t Cap = 0, class... Ts>
void reduce_lists(cudaStream_t stream, double* partials, double* per_tensor, double* total, std::size_t count,
                  const tensor_view<Ts, device_space>*... lists) {
  constexpr std::size_t N = Cap > 0 ? Cap : batch_capacity<sizeof...(Ts), 2 * sizeof(void*)>;
  static_assert(N <= batch_capacity<sizeof...(Ts), 2 * sizeof(void*)>,
                "Cap exceeds the kernel-argument budget");
  using batch_t = tensor_batch<sizeof...(Ts), N>;
  for_each_batch<N>(
      count,
      [&](const batch_t& b, std::size_t chunks) {
        if (chunks > 0) {
          reduce_chunks_kernel<Op, batch_t, Ts...>
              <<<static_cast<unsigned>(chunks), reduce_threads, 0, stream>>>(b, partials);
          GRADAPT_CUDA_CHECK_LAUNCH("gradapt reduce_chunks_kernel");
        }
        reduce_tensors_kernel<Op, batch_t>
            <<<static_cast<unsigned>(b.ntensors), reduce_threads, 0, stream>>>(b, partials, per_tensor);
        GRADAPT_CUDA_CHECK_LAUNCH("gradapt reduce_tensors_kernel");
      },
      lists...);
  if (total != nullptr) {
    reduce_total_kernel<Op><<<1, 32, 0, stream>>>(per_tensor, count, total);
    GRADAPT_CUDA_CHECK_LAUNCH("gradapt reduce_total_kernel");
  }
}

}  // namespace gradapt::detail::cuda_impl

#pragma once
/// @file
/// The fused element-wise apply + per-tensor sum of the CUDA backend
/// (`gradapt::cuda::apply_reduce_list`). Included only from .cu translation units.
///
/// Launch shape and order: the reduction partition of gradapt/backend/chunking.hpp. Each
/// block takes one chunk of `chunking::chunk_elements` elements with `reduce_threads` (256)
/// lanes; lane l applies the functor to the chunk's elements l, l + 256, ... in increasing
/// order (loads, call, stores of the mutable views) and folds each of the K values the functor
/// returns into its own double accumulator (`acc += value`). Each value's lanes are combined by
/// the fixed block tree of multi_tensor.cuh, giving K chunk partials; a second kernel reduces
/// each tensor's chunk partials per value with the same tree. No atomics: the per-tensor sums
/// repeat bit for bit and equal `chunking::chunked_tree_reduce` with `acc + x` folds on the
/// host. They are not bitwise equal to gradapt::host's sums (a different, equally fixed, order).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <type_traits>
#include <utility>

#include "gradapt/backend/chunking.hpp"
#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/backend/cuda/device_types.cuh"
#include "gradapt/backend/cuda/multi_tensor.cuh"
#include "gradapt/backend/cuda/reduction_ops.cuh"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::detail::cuda_impl {

/// Value k of a functor result (a double or terms<K>).
template <class R>
__device__ __forceinline__ double term_of(const R& r, [[maybe_unused]] std::size_t k) {
  if constexpr (std::is_arithmetic_v<R>)
    return static_cast<double>(r);
  else
    return r[k];
}

/// Number of values a functor returns when called on compute-type lvalues of Ts.
template <class F, class... Ts>
struct apply_reduce_terms {
  using result =
      std::conditional_t<wants_index<F, Ts...>, std::invoke_result<F&, tensor_index, compute_t<Ts>&...>,
                         std::invoke_result<F&, compute_t<Ts>&...>>;
  static constexpr std::size_t value = terms_size<std::remove_cvref_t<typename result::type>>::value;
};

// Doxygen skips this kernel (the conditional section below): its parser, seeing
// `__launch_bounds__(...)` before the name, reads the templated lambda in the body as a
// declaration and warns about an undeclared `std::index_sequence`. The kernel is internal
// (detail), so nothing is lost.
/// @cond GRADAPT_DOXYGEN_SKIP
/// One block per chunk: applies f to the chunk and writes K partials,
/// partials[k * total_chunks + first_chunk + blockIdx.x].
template <std::size_t K, class F, class Batch, class... Ts>
__global__ void __launch_bounds__(reduce_threads)
    apply_reduce_chunks_kernel(const F f, const GRADAPT_GRID_CONSTANT Batch b, double* partials,
                               std::size_t total_chunks) {
  F g = f;
  const chunking::chunk_location loc = chunking::locate_chunk(b.prefix, b.ntensors, blockIdx.x, b.size);
  const tensor_index ti{b.first_tensor + loc.tensor};
  double acc[K];
#pragma unroll
  for (std::size_t k = 0; k < K; ++k) acc[k] = 0.0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    for (std::size_t i = loc.begin + threadIdx.x; i < loc.end; i += reduce_threads) {
      value_pack<compute_t<Ts>...> v;
      ((slot<I>(v) = device_load(static_cast<Ts*>(b.ptr[I][loc.tensor])[i])), ...);
      const auto r = [&] {
        if constexpr (wants_index<F, Ts...>)
          return g(ti, slot<I>(v)...);
        else
          return g(slot<I>(v)...);
      }();
#pragma unroll
      for (std::size_t k = 0; k < K; ++k)  // a separate rounded add: never fused with f's last multiply
        acc[k] = __dadd_rn(acc[k], term_of(r, k));
      (store_if_mutable(static_cast<Ts*>(b.ptr[I][loc.tensor]) + i, slot<I>(v)), ...);
    }
  }
  (std::index_sequence_for<Ts...>{});
  // One fixed tree per value (block_tree's shared array is rewritten only after every lane
  // has passed the previous tree's last barrier, and warp 0 reads only its own slots).
#pragma unroll
  for (std::size_t k = 0; k < K; ++k) {
    const double r = block_tree<cuda_ops::sum>(acc[k]);
    if (threadIdx.x == 0) partials[k * total_chunks + b.first_chunk + blockIdx.x] = r;
  }
}
/// @endcond

/// Block (t, k): out[(first_tensor + t) * K + k] = the tree over tensor t's chunk partials of
/// value k (0 for an empty tensor).
template <std::size_t K, class Batch>
__global__ void __launch_bounds__(reduce_threads)
    reduce_tensor_terms_kernel(const GRADAPT_GRID_CONSTANT Batch b, const double* partials,
                               std::size_t total_chunks, double* out) {
  const std::size_t t = blockIdx.x, k = blockIdx.y;
  const double* part = partials + k * total_chunks + b.first_chunk + b.prefix[t];
  const std::size_t m = b.prefix[t + 1] - b.prefix[t];
  double acc = 0.0;
  for (std::size_t j = threadIdx.x; j < m; j += reduce_threads) acc = acc + part[j];
  const double r = block_tree<cuda_ops::sum>(acc);
  if (threadIdx.x == 0) out[(b.first_tensor + t) * K + k] = r;
}

/// Enqueues the fused apply + reduce of `count` tensors of the lists on `stream`: per-tensor
/// sums into `per_tensor` (device, count * K doubles, tensor t's value k at t * K + k).
/// `partials` must hold K * total_chunks doubles. No host synchronisation.
template <std::size_t K, class F, class... Ts>
void apply_reduce_lists(const F& f, cudaStream_t stream, double* partials, double* per_tensor,
                        std::size_t count, const tensor_view<Ts, device_space>*... lists) {
  constexpr std::size_t N =
      batch_capacity<sizeof...(Ts), sizeof(F) + 2 * sizeof(void*) + sizeof(std::size_t)>;
  using batch_t = tensor_batch<sizeof...(Ts), N>;
  const auto* first = [](const auto* l0, const auto*...) { return l0; }(lists...);
  const std::size_t total = total_chunks(count, first);
  for_each_batch<N>(
      count,
      [&](const batch_t& b, std::size_t chunks) {
        if (chunks > 0) {
          apply_reduce_chunks_kernel<K, F, batch_t, Ts...>
              <<<static_cast<unsigned>(chunks), reduce_threads, 0, stream>>>(f, b, partials, total);
          GRADAPT_CUDA_CHECK_LAUNCH("gradapt apply_reduce_chunks_kernel");
        }
        reduce_tensor_terms_kernel<K, batch_t>
            <<<dim3(static_cast<unsigned>(b.ntensors), static_cast<unsigned>(K)), reduce_threads, 0,
               stream>>>(b, partials, total, per_tensor);
        GRADAPT_CUDA_CHECK_LAUNCH("gradapt reduce_tensor_terms_kernel");
      },
      lists...);
}

}  // namespace gradapt::detail::cuda_impl

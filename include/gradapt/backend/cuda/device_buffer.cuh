#pragma once
/// @file
/// `gradapt::cuda_buffer<T>`: owning, zero-initialised device memory that algorithms keep
/// between steps (optimizer moments), returned by `gradapt::cuda::allocate`. Included only
/// from .cu translation units.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/core/error.hpp"

namespace gradapt {

/// Owning device memory for `size()` elements of T, zero-initialised, freed by the destructor.
/// Move-only. `data()` is a device pointer (null when empty).
template <class T>
class cuda_buffer {
 public:
  cuda_buffer() = default;
  /// Allocates n elements with cudaMalloc and zeroes them on `stream`, then waits for that
  /// stream (set-up only: a plain cudaMemset would run on the legacy default stream and may
  /// still be running when work on a non-blocking stream reads the memory).
  explicit cuda_buffer(std::size_t n, cudaStream_t stream = nullptr) : n_(n) {
    if (n == 0) return;
    detail::require(n <= static_cast<std::size_t>(-1) / sizeof(T), "cuda_buffer: ", n,
                    " elements overflow size_t");
    GRADAPT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    cudaError_t e = cudaMemsetAsync(p_, 0, n * sizeof(T), stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) {
      cudaFree(p_);
      p_ = nullptr;
      GRADAPT_CUDA_CHECK(e);
    }
  }
  cuda_buffer(const cuda_buffer&) = delete;
  cuda_buffer& operator=(const cuda_buffer&) = delete;
  /// Takes over o's memory; o is left empty.
  cuda_buffer(cuda_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  /// Frees this buffer's memory (cudaFree, errors ignored), then takes over o's; o is left empty.
  cuda_buffer& operator=(cuda_buffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  ~cuda_buffer() { release(); }

  /// Device pointer to the first element; null when empty. Not dereferenceable on the host.
  T* data() const { return p_; }
  /// Number of elements (0 when empty or moved from).
  std::size_t size() const { return n_; }

 private:
  void release() noexcept {
    if (p_ != nullptr) cudaFree(p_);  // errors ignored: this also runs from the destructor
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace gradapt

#pragma once
/// @file
/// Scratch memory of the CUDA backend: a device buffer for reduction partials, a pinned host
/// buffer for results copied back, and a device buffer for the words agreements stage. Included only from .cu
/// translation units.

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/core/error.hpp"

namespace gradapt::detail {

/// Grow-only scratch memory shared by copies of one gradapt::cuda backend object.
///
/// Buffers are allocated on first use and only grow: a request no larger than the current
/// capacity returns the existing buffer without any CUDA call beyond cudaGetDevice, so once
/// a workload has run (or `gradapt::cuda::reserve` sized it) the step path allocates nothing.
/// Growth is the slow path: it waits for the device (cudaDeviceSynchronize) so no queued
/// kernel still uses the old buffer, frees it, and allocates at least twice the old size.
///
/// Not thread-safe, and one buffer serves one stream at a time: backends that run
/// concurrently on different streams need their own workspaces. The device buffer belongs to
/// the device that was current when it was first allocated; using it from another device is
/// an error. A CUDA graph captured from work on a backend holds this buffer's address: keep
/// that backend object (or a copy, which shares the workspace) alive while the graph is
/// replayed, and do not let the workspace grow (a larger operation on the same backend)
/// after capture, since growing frees the old buffer.
class cuda_workspace {
 public:
  cuda_workspace() = default;
  cuda_workspace(const cuda_workspace&) = delete;
  cuda_workspace& operator=(const cuda_workspace&) = delete;
  ~cuda_workspace() { release(); }

  /// Device memory of at least `bytes` bytes (256-byte aligned), valid until the next call
  /// that grows it. `bytes == 0` returns the current buffer (possibly null). `stream` is the
  /// stream the caller enqueues on: while it is being captured into a CUDA graph the buffer
  /// cannot grow (allocation and device synchronisation are not allowed then), so a request
  /// beyond the capacity throws gradapt::error naming `reserve`.
  void* device(std::size_t bytes, cudaStream_t stream = nullptr) {
    int current = 0;
    GRADAPT_CUDA_CHECK(cudaGetDevice(&current));
    if (device_buffer_ != nullptr && current != device_id_)
      fail("cuda backend: the workspace was allocated on device ", device_id_, " but the current device is ",
           current, " (use one gradapt::cuda object, with its own workspace, per device)");
    if (bytes <= device_bytes_) return device_buffer_;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    GRADAPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      fail("cuda backend: an operation needs ", bytes, " bytes of workspace but ", device_bytes_,
           " are held, and its stream is being captured into a CUDA graph, where the workspace cannot grow; "
           "reserve it before capture (gradapt::cuda::reserve or reserve_for, or run the captured work once "
           "uncaptured)");
    const std::size_t want = grow_to(device_bytes_, bytes);
    if (device_buffer_ != nullptr) {
      GRADAPT_CUDA_CHECK(cudaDeviceSynchronize());
      GRADAPT_CUDA_CHECK(cudaFree(device_buffer_));
      device_buffer_ = nullptr;
      device_bytes_ = 0;
    }
    GRADAPT_CUDA_CHECK(cudaMalloc(&device_buffer_, want));
    device_bytes_ = want;
    device_id_ = current;
    return device_buffer_;
  }

  /// Page-locked host memory of at least `bytes` bytes, valid until the next call that grows
  /// it. Used for device-to-host copies of reduction results, which are synchronised before
  /// the call returns, so growing never races with a copy.
  void* pinned(std::size_t bytes) {
    if (bytes <= pinned_bytes_) return pinned_buffer_;
    const std::size_t want = grow_to(pinned_bytes_, bytes);
    if (pinned_buffer_ != nullptr) {
      GRADAPT_CUDA_CHECK(cudaFreeHost(pinned_buffer_));
      pinned_buffer_ = nullptr;
      pinned_bytes_ = 0;
    }
    GRADAPT_CUDA_CHECK(cudaMallocHost(&pinned_buffer_, want));
    pinned_bytes_ = want;
    return pinned_buffer_;
  }

  /// Device memory of at least `bytes` bytes for the words an agreement stages (a buffer of
  /// its own, apart from the reduction partials), grow-only. Its users copy their words in,
  /// reduce them and copy them back before they return, waiting for the stream, so no queued
  /// work uses it when it grows (cudaFree waits for the device anyway).
  void* words(std::size_t bytes) {
    int current = 0;
    GRADAPT_CUDA_CHECK(cudaGetDevice(&current));
    if (words_buffer_ != nullptr && current != words_device_)
      fail("cuda backend: the workspace's staging words were allocated on device ", words_device_,
           " but the current device is ", current, " (use one gradapt::cuda object per device)");
    if (bytes <= words_bytes_) return words_buffer_;
    const std::size_t want = grow_to(words_bytes_, bytes);
    if (words_buffer_ != nullptr) {
      GRADAPT_CUDA_CHECK(cudaFree(words_buffer_));
      words_buffer_ = nullptr;
      words_bytes_ = 0;
    }
    GRADAPT_CUDA_CHECK(cudaMalloc(&words_buffer_, want));
    words_bytes_ = want;
    words_device_ = current;
    return words_buffer_;
  }

  /// Bytes of device memory held.
  std::size_t device_capacity() const noexcept { return device_bytes_; }
  /// Bytes of pinned host memory held.
  std::size_t pinned_capacity() const noexcept { return pinned_bytes_; }

  /// Frees both buffers (errors are ignored: this also runs from the destructor, possibly
  /// after the CUDA runtime has shut down at program exit).
  void release() noexcept {
    if (device_buffer_ != nullptr) {
      int current = 0;
      const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != device_id_;
      if (switch_device) (void)cudaSetDevice(device_id_);
      (void)cudaFree(device_buffer_);
      if (switch_device) (void)cudaSetDevice(current);
    }
    if (words_buffer_ != nullptr) {
      int current = 0;
      const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != words_device_;
      if (switch_device) (void)cudaSetDevice(words_device_);
      (void)cudaFree(words_buffer_);
      if (switch_device) (void)cudaSetDevice(current);
    }
    if (pinned_buffer_ != nullptr) (void)cudaFreeHost(pinned_buffer_);
    words_buffer_ = nullptr;
    words_bytes_ = 0;
    device_buffer_ = nullptr;
    pinned_buffer_ = nullptr;
    device_bytes_ = 0;
    pinned_bytes_ = 0;
  }

 private:
  static std::size_t grow_to(std::size_t have, std::size_t need) {
    std::size_t want = have * 2 > need ? have * 2 : need;
    return (want + 255) / 256 * 256;
  }

  void* device_buffer_ = nullptr;
  std::size_t device_bytes_ = 0;
  int device_id_ = -1;
  void* pinned_buffer_ = nullptr;
  std::size_t pinned_bytes_ = 0;
  void* words_buffer_ = nullptr;
  std::size_t words_bytes_ = 0;
  int words_device_ = -1;
};

}  // namespace gradapt::detail

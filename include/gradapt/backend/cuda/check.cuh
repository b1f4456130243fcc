#pragma once
/// @file
/// Turns CUDA runtime errors into gradapt::error. Included only from .cu translation units.

#include <cuda_runtime_api.h>

#include "gradapt/core/error.hpp"

namespace gradapt::detail {

/// Throws gradapt::error if `status` is not cudaSuccess. The message names the failed call
/// (as written in the source), the CUDA error name and cudaGetErrorString's text, and the
/// source location, e.g.
/// `gradapt: CUDA call cudaMalloc(&p, 1024) failed: cudaErrorMemoryAllocation (out of memory) at
/// workspace.cuh:40`.
inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess)
    fail("CUDA call ", call, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") at ",
         file, ":", line);
}

/// Checks the launch of kernel `kernel` (configuration errors, missing device code) right
/// after the `<<<...>>>` statement, through cudaGetLastError.
inline void cuda_check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    fail("CUDA launch of ", kernel, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status),
         ") at ", file, ":", line);
}

}  // namespace gradapt::detail

/// Evaluates a CUDA runtime call and throws gradapt::error naming it if it fails.
#define GRADAPT_CUDA_CHECK(...) ::gradapt::detail::cuda_check((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)

/// Checks the most recent kernel launch; `name` is a string naming the kernel for the message.
#define GRADAPT_CUDA_CHECK_LAUNCH(name) ::gradapt::detail::cuda_check_launch((name), __FILE__, __LINE__)

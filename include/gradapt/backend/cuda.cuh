#pragma once
/// @file
/// Umbrella header of the CUDA backend. Include it only from .cu translation units compiled
/// by nvcc (or another CUDA compiler); host-only code uses gradapt/gradapt.hpp and sees no
/// CUDA syntax.
///
/// Defines `gradapt::cuda` (backend/cuda/backend.cuh), the 16-bit type mapping
/// (backend/cuda/device_types.cuh), the CUDA error check (backend/cuda/check.cuh), the
/// workspace (backend/cuda/workspace.cuh), the reduction ops (backend/cuda/reduction_ops.cuh),
/// the multi-tensor kernels (backend/cuda/multi_tensor.cuh), the fused apply + per-tensor sum
/// (backend/cuda/apply_reduce.cuh) and owning device memory (backend/cuda/device_buffer.cuh).

#if !defined(__CUDACC__)
#error "gradapt/backend/cuda.cuh needs a CUDA compiler: include it from a .cu file"
#endif

#include "gradapt/backend/chunking.hpp"
#include "gradapt/backend/cuda/apply_reduce.cuh"
#include "gradapt/backend/cuda/backend.cuh"
#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/backend/cuda/device_buffer.cuh"
#include "gradapt/backend/cuda/device_types.cuh"
#include "gradapt/backend/cuda/multi_tensor.cuh"
#include "gradapt/backend/cuda/reduction_ops.cuh"
#include "gradapt/backend/cuda/workspace.cuh"

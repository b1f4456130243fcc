#pragma once
/// @file
/// Configuration macros shared by every gradapt header.

/// Library version, kept equal to the CMake project version.
#define GRADAPT_VERSION_MAJOR 0
#define GRADAPT_VERSION_MINOR 1  ///< minor version; see GRADAPT_VERSION_MAJOR
#define GRADAPT_VERSION_PATCH 0  ///< patch version; see GRADAPT_VERSION_MAJOR

/// Marks a function callable from host and device code. Under nvcc (or clang-cuda) it expands
/// to `__host__ __device__`; under a plain host compiler it expands to nothing, so the headers
/// a host compiler sees never contain CUDA syntax.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define GRADAPT_HD __host__ __device__
/// 1 when the translation unit is compiled by a CUDA/HIP compiler (host and device passes),
/// 0 under a plain host compiler.
#define GRADAPT_DEVICE_COMPILER 1
#else
#define GRADAPT_HD
#define GRADAPT_DEVICE_COMPILER 0
#endif

/// Forced inlining for tiny element functors in hot loops.
#if defined(_MSC_VER)
#define GRADAPT_INLINE __forceinline
#else
#define GRADAPT_INLINE inline __attribute__((always_inline))
#endif

/// `__restrict` spelled for every supported compiler.
#define GRADAPT_RESTRICT __restrict

/// True while compiling the device pass of a CUDA translation unit.
#if defined(__CUDA_ARCH__)
#define GRADAPT_DEVICE_PASS 1
#else
#define GRADAPT_DEVICE_PASS 0
#endif

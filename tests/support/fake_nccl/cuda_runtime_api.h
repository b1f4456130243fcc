#pragma once
// A stand-in for the part of the CUDA runtime API that gradapt::comm::nccl calls, for tests that
// run comm::nccl's own code on the host (tests/test_nccl_host.cpp): "device" memory is host
// memory, a stream runs each operation when it is enqueued (so every stream is always idle), and
// there is one device, 0. Put this folder first on the include path of such a test only.
#include <cstddef>
#include <cstdlib>
#include <cstring>

enum cudaError_t { cudaSuccess = 0, cudaErrorNotReady = 600, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
struct fake_cuda_stream {};
using cudaStream_t = fake_cuda_stream*;

inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = std::malloc(bytes == 0 ? 1 : bytes);
  return *p != nullptr ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, std::size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, v, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess"
                          : (e == cudaErrorNotReady ? "cudaErrorNotReady" : "cudaErrorInvalidValue");
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

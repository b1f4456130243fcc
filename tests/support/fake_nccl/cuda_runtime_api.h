#pragma once
// A stand-in for the part of the CUDA runtime API that gradapt::comm::nccl calls, for tests that
// run comm::nccl's own code on the host (tests/test_nccl_host.cpp): "device" memory is host
// memory, a stream runs each operation when it is enqueued (so every stream is always idle), and
// there is one device, 0. Events order nothing (every stream is idle); their records and waits are
// appended to the calling thread's fake_cuda_event_log(), so a test can check which streams
// comm::nccl orders after which. Put this folder first on the include path of such a test only.
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

struct fake_cuda_event {
  int id;
};
using cudaEvent_t = fake_cuda_event*;
constexpr unsigned cudaEventDisableTiming = 2;
/// One event call: "record" (the event, on `stream`) or "wait" (`stream` waits for the event).
struct fake_cuda_event_call {
  std::string what;
  cudaStream_t stream;
  cudaEvent_t event;
};
inline std::vector<fake_cuda_event_call>& fake_cuda_event_log() {
  thread_local std::vector<fake_cuda_event_call> log;
  return log;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  if (flags != cudaEventDisableTiming) return cudaErrorInvalidValue;
  static std::atomic<int> next{0};
  *e = new fake_cuda_event{++next};
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  if (e == nullptr) return cudaErrorInvalidValue;
  fake_cuda_event_log().push_back({"record", s, e});
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0) {
  if (e == nullptr || flags != 0) return cudaErrorInvalidValue;
  fake_cuda_event_log().push_back({"wait", s, e});
  return cudaSuccess;
}
/// Set on a rank's thread to make its streams never finish (cudaStreamQuery: not ready), as a
/// collective that hangs on the device would: the test of comm::nccl's watchdog.
inline bool& fake_cuda_stream_stuck() {
  thread_local bool stuck = false;
  return stuck;
}
inline cudaError_t cudaStreamQuery(cudaStream_t) {
  return fake_cuda_stream_stuck() ? cudaErrorNotReady : cudaSuccess;
}
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess"
                          : (e == cudaErrorNotReady ? "cudaErrorNotReady" : "cudaErrorInvalidValue");
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

// Catch2 runner for the CUDA tests: exits with 77 (ctest SKIP_RETURN_CODE) when no CUDA
// device is usable, so the tests build everywhere nvcc exists and skip on GPU-less machines.

#include "catch_session.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount reports 0");
    return 77;
  }
  return gradapt_test::run_catch(argc, argv);
}

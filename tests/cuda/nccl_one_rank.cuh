#pragma once
// A one-rank NCCL communicator on device 0 and its own stream, for the CUDA tests that run
// gradapt over comm::nccl (test_cuda_shard.cu, test_cuda_train_step.cu).
#include <nccl.h>

#include "cuda_test_support.cuh"

namespace gradapt_test {

struct nccl_one_rank {
  ncclComm_t handle = nullptr;
  cudaStream_t stream = nullptr;
  nccl_one_rank() {
    GRADAPT_CUDA_CHECK(cudaStreamCreate(&stream));
    int dev = 0;
    REQUIRE(ncclCommInitAll(&handle, 1, &dev) == ncclSuccess);
  }
  ~nccl_one_rank() {
    ncclCommDestroy(handle);
    cudaStreamDestroy(stream);
  }
  nccl_one_rank(const nccl_one_rank&) = delete;
  nccl_one_rank& operator=(const nccl_one_rank&) = delete;
};

}  // namespace gradapt_test

#pragma once
// Operations of gradapt::comm::nccl compiled by nvcc (nccl_nvcc_ops.cu) and called from the
// host-compiled test, proving the header builds under both compilers and behaves the same.

#include "gradapt/comm/nccl.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace nccltest {

/// On a one-rank communicator: allreduce sum and max, broadcast from 0, allgather of `buf`
/// into `tmp`, reduce_scatter of `tmp` back into `buf`, exchange of `buf` with itself into
/// `tmp`, then barrier. Every step is the identity with one rank, so afterwards both `buf`
/// and `tmp` hold `buf`'s original values. `tmp` must have as many elements as `buf`.
template <class T>
void nvcc_ops(gradapt::comm::nccl& c, gradapt::tensor_view<T, gradapt::device_space> buf,
              gradapt::tensor_view<T, gradapt::device_space> tmp);

extern template void nvcc_ops<float>(gradapt::comm::nccl&, gradapt::tensor_view<float, gradapt::device_space>,
                                     gradapt::tensor_view<float, gradapt::device_space>);
extern template void nvcc_ops<double>(gradapt::comm::nccl&,
                                      gradapt::tensor_view<double, gradapt::device_space>,
                                      gradapt::tensor_view<double, gradapt::device_space>);
extern template void nvcc_ops<gradapt::half>(gradapt::comm::nccl&,
                                             gradapt::tensor_view<gradapt::half, gradapt::device_space>,
                                             gradapt::tensor_view<gradapt::half, gradapt::device_space>);
extern template void nvcc_ops<gradapt::bfloat16>(
    gradapt::comm::nccl&, gradapt::tensor_view<gradapt::bfloat16, gradapt::device_space>,
    gradapt::tensor_view<gradapt::bfloat16, gradapt::device_space>);

}  // namespace nccltest

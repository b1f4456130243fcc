// Compiled by nvcc: gradapt/comm/nccl.hpp is plain host C++ and must build here too.
#include "nccl_nvcc_ops.hpp"

namespace nccltest {

template <class T>
void nvcc_ops(gradapt::comm::nccl& c, gradapt::tensor_view<T, gradapt::device_space> buf,
              gradapt::tensor_view<T, gradapt::device_space> tmp) {
  using cview = gradapt::tensor_view<const T, gradapt::device_space>;
  c.allreduce(buf, gradapt::reduce_op::sum);
  c.allreduce(buf, gradapt::reduce_op::max);
  c.broadcast(buf, 0);
  c.allgather(cview(buf), tmp);
  c.reduce_scatter(cview(tmp), buf, gradapt::reduce_op::sum);
  c.exchange(c.rank(), cview(buf), tmp);
  c.barrier();
}

template void nvcc_ops<float>(gradapt::comm::nccl&, gradapt::tensor_view<float, gradapt::device_space>,
                              gradapt::tensor_view<float, gradapt::device_space>);
template void nvcc_ops<double>(gradapt::comm::nccl&, gradapt::tensor_view<double, gradapt::device_space>,
                               gradapt::tensor_view<double, gradapt::device_space>);
template void nvcc_ops<gradapt::half>(gradapt::comm::nccl&,
                                      gradapt::tensor_view<gradapt::half, gradapt::device_space>,
                                      gradapt::tensor_view<gradapt::half, gradapt::device_space>);
template void nvcc_ops<gradapt::bfloat16>(gradapt::comm::nccl&,
                                          gradapt::tensor_view<gradapt::bfloat16, gradapt::device_space>,
                                          gradapt::tensor_view<gradapt::bfloat16, gradapt::device_space>);

}  // namespace nccltest

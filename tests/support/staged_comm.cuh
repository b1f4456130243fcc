#pragma once
// A device-space communicator for the CUDA tests, over comm::threads: every operation copies
// the device buffers to host memory, runs the comm::threads operation there and copies the
// result back (comm::nccl needs one GPU per rank). The CUDA backend runs on the legacy default
// stream, which orders those copies after the kernels.

#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/cuda.cuh"
#include "gradapt/comm/threads.hpp"

// A named namespace: nvcc warns about unused members of classes in an anonymous one (the
// concept requires operations that a test may not call).
namespace gradapt_test {

/// The elements of a device view, copied to host memory.
template <class T>
std::vector<T> staged_copy_to_host(gradapt::tensor_view<const T, gradapt::device_space> v) {
  std::vector<T> h(v.size());
  if (!h.empty()) GRADAPT_CUDA_CHECK(cudaMemcpy(h.data(), v.data(), v.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

/// Copies `h` into the device view `v` (of the same size).
template <class T>
void staged_copy_to_device(const std::vector<T>& h, gradapt::tensor_view<T, gradapt::device_space> v) {
  if (!h.empty()) GRADAPT_CUDA_CHECK(cudaMemcpy(v.data(), h.data(), v.bytes(), cudaMemcpyHostToDevice));
}

/// Device-space communicator over comm::threads, staging every buffer through host memory.
class staged_comm {
 public:
  using space = gradapt::device_space;
  template <class T>
  using dview = gradapt::tensor_view<T, gradapt::device_space>;

  explicit staged_comm(gradapt::comm::threads t) : t_(std::move(t)) {}
  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }

  template <gradapt::element T>
  requires(!std::is_const_v<T>) void allreduce(dview<T> buf, gradapt::reduce_op op) {
    auto h = staged_copy_to_host<T>(buf);
    t_.allreduce(gradapt::host_view(h), op);
    staged_copy_to_device(h, buf);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void broadcast(dview<T> buf, int root) {
    auto h = staged_copy_to_host<T>(buf);
    t_.broadcast(gradapt::host_view(h), root);
    staged_copy_to_device(h, buf);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<dview<const T>> send, dview<T> recv) {
    const auto s = staged_copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.allgather<T>(gradapt::host_view(s), gradapt::host_view(r));
    staged_copy_to_device(r, recv);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void reduce_scatter(std::type_identity_t<dview<const T>> send, dview<T> recv,
                                                    gradapt::reduce_op op) {
    const auto s = staged_copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.reduce_scatter<T>(gradapt::host_view(s), gradapt::host_view(r), op);
    staged_copy_to_device(r, recv);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void exchange(int peer, std::type_identity_t<dview<const T>> send,
                                              dview<T> recv) {
    const auto s = staged_copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.exchange<T>(peer, gradapt::host_view(s), gradapt::host_view(r));
    staged_copy_to_device(r, recv);
  }
  staged_comm split(int color, int key) { return staged_comm(t_.split(color, key)); }
  void barrier() { t_.barrier(); }

 private:
  gradapt::comm::threads t_;
};
static_assert(gradapt::communicator<staged_comm>);

}  // namespace gradapt_test

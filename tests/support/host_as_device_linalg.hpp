#pragma once
// gradapt::host_lapack over device-tagged views of host memory: a `linalg_backend` whose space is
// gradapt::device_space, so that code written for cuda_linalg (products and eigensolves on a
// device, element work through the element backend) runs on the host in tests, beside
// host_as_device::backend. The numbers are host_lapack's; what it checks is that the code under
// test reaches device memory only through the backends (it cannot catch a raw host loop over a
// device pointer, which reads host memory here: only a GPU run does). Separate from
// host_as_device.hpp so tests without BLAS/LAPACK do not link them.

#include <atomic>
#include <cstdint>
#include <memory>

#include "gradapt/linalg/host_lapack.hpp"
#include "host_as_device.hpp"

namespace host_as_device {

struct linalg {
  using space = device_space;
  gradapt::host_lapack h{};
  /// Calls of enter_thread over every copy (a background thread's start).
  std::shared_ptr<std::atomic<int>> entered = std::make_shared<std::atomic<int>>(0);

  /// A new element backend (its own staging words), as cuda_linalg::elements gives a new
  /// gradapt::cuda on its stream.
  backend elements(const backend&) const { return backend{}; }
  void enter_thread() const { ++*entered; }

  template <class T>
  auto eigh_workspace(std::int64_t n) const {
    return h.template eigh_workspace<T>(n);
  }
  template <class T>
  void gemm(gradapt::transpose ta, gradapt::transpose tb, double alpha, tensor_view<const T, device_space> a,
            tensor_view<const T, device_space> b, double beta, tensor_view<T, device_space> c) const {
    h.gemm(ta, tb, alpha, on_host(a), on_host(b), beta, on_host(c));
  }
  template <class T>
  void syrk(gradapt::gram g, double alpha, tensor_view<const T, device_space> a, double beta,
            tensor_view<T, device_space> c) const {
    h.syrk(g, alpha, on_host(a), beta, on_host(c));
  }
  template <class T, class W>
  bool eigh(tensor_view<T, device_space> a, tensor_view<T, device_space> w, W& ws) const {
    return h.eigh(on_host(a), on_host(w), ws);
  }
  template <class T>
  auto qr_workspace(std::int64_t n) const {
    return h.template qr_workspace<T>(n);
  }
  template <class T, class W>
  void qr(tensor_view<const T, device_space> a, tensor_view<T, device_space> q,
          tensor_view<T, device_space> r, W& ws) const {
    h.qr(on_host(a), on_host(q), on_host(r), ws);
  }
};

static_assert(gradapt::linalg_backend<linalg>);
static_assert(gradapt::stream_linalg_backend<linalg, backend>);

}  // namespace host_as_device

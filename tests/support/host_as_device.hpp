#pragma once
// A backend and a communicator in `device_space` whose memory is host memory: every view is
// re-tagged to `host_space` and forwarded to gradapt::host and comm::threads. Code written for
// any backend whose space is not the host's (the CUDA + NCCL path) runs through it on the host,
// with its own branches (agreements staged through backend buffers, copies between the
// spaces, no host-only shortcuts), on 1 to 8 ranks, where no GPU is available.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/param_list.hpp"

namespace host_as_device {

using gradapt::device_space;
using gradapt::host_space;
using gradapt::tensor_view;

template <class T>
tensor_view<T, host_space> on_host(tensor_view<T, device_space> v) {
  return tensor_view<T, host_space>(v.data(), v.shape());
}

template <class V>
inline constexpr bool is_device_view = false;
template <class T>
inline constexpr bool is_device_view<tensor_view<T, device_space>> = true;

template <class L>
concept device_list =
    std::ranges::range<L> && is_device_view<std::remove_cvref_t<std::ranges::range_value_t<L>>>;

/// The views of a device list as host views.
template <class L>
requires device_list<L>
auto on_host(const L& list) {
  using H = decltype(on_host(*std::ranges::begin(list)));
  std::vector<H> out;
  for (const auto& v : list) out.push_back(on_host(v));
  return out;
}

/// Any other argument (functors, shapes, options) unchanged.
template <class A>
requires(!device_list<std::remove_cvref_t<A>> && !is_device_view<std::remove_cvref_t<A>>) A &&
    on_host(A&& a) {
  return std::forward<A>(a);
}

/// gradapt::host (one thread) over device-tagged views of host memory. Like gradapt::cuda it
/// lends grow-only staging words shared by its copies (so, like it, one object per rank thread).
struct backend {
  using space = device_space;
  gradapt::host h{.threads = 1};
  std::shared_ptr<std::vector<double>> words = std::make_shared<std::vector<double>>();

  double* staging(std::size_t n) const {
    if (words->size() < n) words->resize(n);
    return words->data();
  }

  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, device_space>... views) const {
    h.apply(f, on_host(views)...);
  }
  template <class F, class... Ls>
  void apply_list(F f, const Ls&... lists) const {
    h.apply_list(f, on_host(lists)...);
  }
  template <class T>
  double reduce(gradapt::reduction op, tensor_view<T, device_space> x) const {
    return h.reduce(op, on_host(x));
  }
  template <class L>
  double reduce(gradapt::reduction op, const L& xs, std::span<double> per_tensor) const {
    return h.reduce(op, on_host(xs), per_tensor);
  }
  template <class T, class U>
  double dot(tensor_view<T, device_space> x, tensor_view<U, device_space> y) const {
    return h.dot(on_host(x), on_host(y));
  }
  template <class L1, class L2>
  double dot(const L1& xs, const L2& ys, std::span<double> per_tensor) const {
    return h.dot(on_host(xs), on_host(ys), per_tensor);
  }
  /// The per-tensor dot products stay in this backend's memory, as on a device (dot_to).
  template <class L1, class L2>
  void dot_to(const L1& xs, const L2& ys, tensor_view<double, device_space> per_tensor) const {
    (void)h.dot(on_host(xs), on_host(ys), std::span<double>(per_tensor.data(), per_tensor.size()));
  }
  /// The per-tensor sums stay in this backend's memory, as on a device.
  template <class F, class... Ls>
  void apply_reduce_list(F f, tensor_view<double, device_space> per_tensor, const Ls&... lists) const {
    (void)h.apply_reduce_list(f, std::span<double>(per_tensor.data(), per_tensor.size()), on_host(lists)...);
  }
  template <class F, class... A>
  void reduce_factored(F f, std::array<std::int64_t, 5> d, A&&... a) const {
    h.reduce_factored(f, d, on_host(std::forward<A>(a))...);
  }
  template <class F, class... A>
  double apply_factored(F f, std::array<std::int64_t, 5> d, A&&... a) const {
    return h.apply_factored(f, d, on_host(std::forward<A>(a))...);
  }
  template <class F, class... A>
  void apply_factored_sum(F f, std::array<std::int64_t, 5> d, A&&... a) const {
    h.apply_factored_sum(f, d, on_host(std::forward<A>(a))...);
  }
  template <class F, class... A>
  void apply_factored_max(F f, std::array<std::int64_t, 5> d, A&&... a) const {
    h.apply_factored_max(f, d, on_host(std::forward<A>(a))...);
  }
  template <gradapt::element T>
  std::vector<T> allocate(std::size_t n) const {
    return std::vector<T>(n);
  }
  template <class T>
  void copy(tensor_view<const T, device_space> src, tensor_view<T, host_space> dst) const {
    h.copy(on_host(src), dst);
  }
  template <class T>
  void copy(tensor_view<const T, host_space> src, tensor_view<T, device_space> dst) const {
    h.copy(src, on_host(dst));
  }
  void synchronize() const {}
};
static_assert(gradapt::staging_backend<backend>);  // the staged agreements take the staging path

/// Host vectors as the device-tagged backends' memory, for the reference runs written once for
/// every memory (kfac_reference_run.hpp, shampoo_reference_run.hpp): alloc, put, get.
struct memory {
  template <class T>
  std::vector<T> alloc(std::size_t n) const {
    return std::vector<T>(n);
  }
  template <class T>
  void put(std::vector<T>& d, const std::vector<T>& h) const {
    d = h;
  }
  template <class T>
  std::vector<T> get(const std::vector<T>& d) const {
    return d;
  }
};

/// comm::threads over device-tagged views of host memory.
struct comm {
  using space = device_space;
  gradapt::comm::threads* c;
  /// The communicator `split` made (null for one built over a caller's threads handle).
  std::shared_ptr<gradapt::comm::threads> owned{};

  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class T>
  void allreduce(tensor_view<T, device_space> buf, gradapt::reduce_op op) {
    c->allreduce(on_host(buf), op);
  }
  template <class T>
  void broadcast(tensor_view<T, device_space> buf, int root) {
    c->broadcast(on_host(buf), root);
  }
  template <class T>
  void allgather(tensor_view<const T, device_space> send, tensor_view<T, device_space> recv) {
    c->allgather(on_host(send), on_host(recv));
  }
  template <class T>
  void reduce_scatter(tensor_view<const T, device_space> send, tensor_view<T, device_space> recv,
                      gradapt::reduce_op op) {
    c->reduce_scatter(on_host(send), on_host(recv), op);
  }
  template <class T>
  void exchange(int peer, tensor_view<const T, device_space> send, tensor_view<T, device_space> recv) {
    c->exchange(peer, on_host(send), on_host(recv));
  }
  /// comm::threads::split, the new handle owned by the result (and shared by its copies).
  comm split(int color, int key) {
    auto s = std::make_shared<gradapt::comm::threads>(c->split(color, key));
    return comm{s.get(), s};
  }
  void barrier() { c->barrier(); }
};

/// The same tensors, flags and groups as `params`, as device-tagged views.
template <class V, class G>
gradapt::param_list<V, G, device_space> on_device(const gradapt::param_list<V, G>& params) {
  gradapt::param_list<V, G, device_space> out(params.group(0).options);
  for (std::size_t g = 1; g < params.group_count(); ++g)
    out.add_group(params.group(g).name, params.group(g).options);
  for (std::size_t t = 0; t < params.size(); ++t) {
    const auto& e = params[t];
    out.add(e.name, tensor_view<V, device_space>(e.value.data(), e.value.shape()),
            tensor_view<G, device_space>(e.grad.data(), e.grad.shape()), e.flags, e.group);
  }
  return out;
}

}  // namespace host_as_device

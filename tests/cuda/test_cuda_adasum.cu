// Adasum (gradapt/combine/adasum.hpp) with the CUDA backend on device memory.
//
// Ranks are host threads on one GPU. `staged_comm` below is a device-space communicator for
// tests only: every operation copies the device buffers to host memory, runs the
// comm::threads operation there and copies the result back (comm::nccl needs one GPU per
// rank). The backend runs on the legacy default stream, which orders those copies after the
// kernels.
//
// Checks: a long double re-computation of the tree within rounding (four element types, lists
// with empty, one-element and multi-chunk tensors, 1 to 5 ranks, flat and hierarchical);
// exact closed forms (orthogonal inputs sum, equal inputs stay); repeated runs give the same
// bits; adasum_combine; errors. Without a GPU the runner exits 77 (skipped). The NCCL
// instantiation is compiled when <nccl.h> is found (it is never called here).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"

#if __has_include(<nccl.h>) && defined(GRADAPT_TEST_NCCL)
#include "gradapt/comm/nccl.hpp"
#endif

namespace gradapt_test_cuda_adasum {

using namespace gradapt_test;
using gradapt::device_space;
using gradapt::tensor_view;

namespace {

template <class T>
using tlist = std::vector<std::vector<T>>;
using ldlist = std::vector<std::vector<long double>>;

template <class T>
std::vector<T> copy_to_host(tensor_view<const T, device_space> v) {
  std::vector<T> h(v.size());
  if (!h.empty()) GRADAPT_CUDA_CHECK(cudaMemcpy(h.data(), v.data(), v.bytes(), cudaMemcpyDeviceToHost));
  return h;
}
template <class T>
void copy_to_device(const std::vector<T>& h, tensor_view<T, device_space> v) {
  if (!h.empty()) GRADAPT_CUDA_CHECK(cudaMemcpy(v.data(), h.data(), v.bytes(), cudaMemcpyHostToDevice));
}

}  // namespace

// A named namespace: nvcc warns about unused members of classes in an anonymous one (the
// concept requires operations Adasum does not call).
namespace adasum_cuda_test {

/// Device-space communicator over comm::threads, staging every buffer through host memory.
class staged_comm {
 public:
  using space = device_space;
  explicit staged_comm(gradapt::comm::threads t) : t_(std::move(t)) {}
  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }

  template <gradapt::element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, device_space> buf, gradapt::reduce_op op) {
    auto h = copy_to_host<T>(buf);
    t_.allreduce(gradapt::host_view(h), op);
    copy_to_device(h, buf);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void broadcast(tensor_view<T, device_space> buf, int root) {
    auto h = copy_to_host<T>(buf);
    t_.broadcast(gradapt::host_view(h), root);
    copy_to_device(h, buf);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<tensor_view<const T, device_space>> send,
                                               tensor_view<T, device_space> recv) {
    const auto s = copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.allgather<T>(gradapt::host_view(s), gradapt::host_view(r));
    copy_to_device(r, recv);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void reduce_scatter(
      std::type_identity_t<tensor_view<const T, device_space>> send, tensor_view<T, device_space> recv,
      gradapt::reduce_op op) {
    const auto s = copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.reduce_scatter<T>(gradapt::host_view(s), gradapt::host_view(r), op);
    copy_to_device(r, recv);
  }
  template <gradapt::element T>
  requires(!std::is_const_v<T>) void exchange(int peer,
                                              std::type_identity_t<tensor_view<const T, device_space>> send,
                                              tensor_view<T, device_space> recv) {
    const auto s = copy_to_host<T>(send);
    std::vector<T> r(recv.size());
    t_.exchange<T>(peer, gradapt::host_view(s), gradapt::host_view(r));
    copy_to_device(r, recv);
  }
  staged_comm split(int color, int key) { return staged_comm(t_.split(color, key)); }
  void barrier() { t_.barrier(); }

 private:
  gradapt::comm::threads t_;
};
static_assert(gradapt::communicator<staged_comm>);

}  // namespace adasum_cuda_test

namespace {

using adasum_cuda_test::staged_comm;

template <class T>
long double val(T x) {
  return static_cast<long double>(gradapt::load(x));
}
template <class T>
long double eps() {
  if constexpr (std::is_same_v<T, double>) return std::numeric_limits<double>::epsilon() / 2;
  if constexpr (std::is_same_v<T, float>) return std::numeric_limits<float>::epsilon() / 2;
  if constexpr (std::is_same_v<T, gradapt::half>) return std::ldexp(1.0L, -11);
  return std::ldexp(1.0L, -8);
}

int floor_pow2(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

ldlist ld_combine(const ldlist& a, const ldlist& b) {
  ldlist out = a;
  for (std::size_t t = 0; t < a.size(); ++t) {
    long double ab = 0, aa = 0, bb = 0;
    for (std::size_t i = 0; i < a[t].size(); ++i) {
      ab += a[t][i] * b[t][i];
      aa += a[t][i] * a[t][i];
      bb += b[t][i] * b[t][i];
    }
    const long double alpha = aa <= 0 ? 1.0L : 1.0L - ab / (2 * aa);
    const long double beta = bb <= 0 ? 1.0L : 1.0L - ab / (2 * bb);
    for (std::size_t i = 0; i < a[t].size(); ++i) out[t][i] = alpha * a[t][i] + beta * b[t][i];
  }
  return out;
}

template <class T>
ldlist widen(const tlist<T>& l) {
  ldlist out;
  for (const auto& v : l) {
    std::vector<long double> w;
    for (T x : v) w.push_back(val(x));
    out.push_back(w);
  }
  return out;
}

/// The tree of docs/algorithms/adasum.md in long double (group means first when g > 1).
template <class T>
ldlist ld_tree(const std::vector<tlist<T>>& in, int g = 1) {
  std::vector<ldlist> v;
  const int n = static_cast<int>(in.size());
  for (int first = 0; first < n; first += g) {
    ldlist m = widen(in[first]);
    const int last = std::min(n, first + g);
    for (int k = first + 1; k < last; ++k) {
      const ldlist w = widen(in[k]);
      for (std::size_t t = 0; t < m.size(); ++t)
        for (std::size_t i = 0; i < m[t].size(); ++i) m[t][i] += w[t][i];
    }
    for (auto& t : m)
      for (auto& x : t) x /= (last - first);
    v.push_back(m);
  }
  const int q = static_cast<int>(v.size());
  const int p = floor_pow2(q);
  std::vector<ldlist> x(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i) x[i] = i + p < q ? ld_combine(v[i], v[i + p]) : v[i];
  for (int width = p; width > 1; width /= 2)
    for (int j = 0; j < width / 2; ++j) x[j] = ld_combine(x[2 * j], x[2 * j + 1]);
  return x[0];
}

/// Runs Adasum on n device "ranks"; returns every rank's result (copied to the host).
template <class T>
std::vector<tlist<T>> run_device(const std::vector<tlist<T>>& in, gradapt::adasum_options opt = {}) {
  const int n = static_cast<int>(in.size());
  std::vector<tlist<T>> out(in.size());
  gradapt::comm::run_threads(n, [&](gradapt::comm::threads& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    staged_comm comm(t);
    std::vector<dvec<T>> buffers;
    for (const auto& v : in[r]) buffers.push_back(to_device(v));
    std::vector<tensor_view<T, device_space>> views;
    for (auto& b : buffers) views.push_back(view(b));
    using W = gradapt::adasum_workspace<T, device_space>;
    dvec<T> elements(W::elements_needed(views));
    dvec<double> scalars(W::scalars_needed(views));
    W ws(views, view(elements), view(scalars));
    const gradapt::cuda backend{};
    gradapt::adasum<staged_comm> ada(comm, opt);
    ada.allreduce(backend, views, ws);
    backend.synchronize();
    for (const auto& b : buffers) out[r].push_back(to_host(b));
  });
  return out;
}

template <class T>
std::vector<tlist<T>> inputs(int n, const std::vector<std::size_t>& sizes, std::uint64_t seed) {
  std::vector<tlist<T>> in;
  for (int r = 0; r < n; ++r) {
    tlist<T> l;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      l.push_back(
          random_values<T>(sizes[t], seed * 1000 + static_cast<std::uint64_t>(r * 50) + t, -1.0, 1.0));
    in.push_back(l);
  }
  return in;
}

/// |got - want| <= 8 eps (levels + 1) sum_r max|v_r,t| for every element.
template <class T>
bool close(const tlist<T>& got, const ldlist& want, const std::vector<tlist<T>>& in) {
  int levels = 1;
  for (int p = static_cast<int>(in.size()); p > 1; p /= 2) ++levels;
  for (std::size_t t = 0; t < want.size(); ++t) {
    long double scale = 0;
    for (const auto& l : in) {
      long double m = 0;
      for (T x : l[t]) m = std::max(m, std::fabs(val(x)));
      scale += m;
    }
    for (std::size_t i = 0; i < want[t].size(); ++i)
      if (!(std::fabs(val(got[t][i]) - want[t][i]) <= 8 * eps<T>() * (levels + 1) * scale)) return false;
  }
  return true;
}

const std::vector<std::size_t> sizes = {gradapt::chunking::chunk_elements * 2 + 17, 1, 0, 300};

}  // namespace

TEMPLATE_TEST_CASE("cuda adasum: the tree of pairwise combines within rounding", "[cuda][adasum]", float,
                   double, gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  for (int n = 1; n <= 5; ++n) {
    const auto in = inputs<T>(n, sizes, static_cast<std::uint64_t>(n));
    const auto got = run_device(in);
    const auto want = ld_tree(in);
    for (int r = 0; r < n; ++r) {
      INFO("ranks " << n << ", rank " << r);
      REQUIRE(close(got[r], want, in));
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(bits(got[r][t][i]) == bits(got[0][t][i]));
    }
    // Repeated runs give the same bits.
    const auto again = run_device(in);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(bits(again[0][t][i]) == bits(got[0][t][i]));
  }
}

TEMPLATE_TEST_CASE("cuda adasum: hierarchical mode within rounding", "[cuda][adasum]", float, gradapt::half) {
  using T = TestType;
  for (int n : {2, 3, 5})
    for (int g : {2, 3}) {
      const auto in = inputs<T>(n, sizes, static_cast<std::uint64_t>(10 * n + g));
      const auto got = run_device(in, {.mode = gradapt::adasum_mode::hierarchical, .group_size = g});
      INFO("ranks " << n << ", group size " << g);
      REQUIRE(close(got[n - 1], ld_tree(in, g), in));
    }
}

TEMPLATE_TEST_CASE("cuda adasum: orthogonal inputs sum and equal inputs stay, exactly", "[cuda][adasum]",
                   float, gradapt::bfloat16) {
  using T = TestType;
  for (int n = 1; n <= 5; ++n) {
    auto in = inputs<T>(n, sizes, 77);
    for (int r = 0; r < n; ++r)
      for (auto& v : in[r])
        for (std::size_t i = 0; i < v.size(); ++i)
          if (static_cast<int>(i % static_cast<std::size_t>(n)) != r) gradapt::store(v[i], 0.0f);
    const auto got = run_device(in);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i)
        REQUIRE(bits(got[0][t][i]) == bits(in[i % static_cast<std::size_t>(n)][t][i]));
    const std::vector<tlist<T>> same(static_cast<std::size_t>(n), in[0]);
    const auto stay = run_device(same);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(bits(stay[n - 1][t][i]) == bits(in[0][t][i]));
  }
}

TEST_CASE("cuda adasum_combine: the pairwise operator on one device", "[cuda][adasum]") {
  const auto in = inputs<float>(2, sizes, 5);
  std::vector<dvec<float>> a, b;
  std::vector<tensor_view<float, device_space>> av;
  std::vector<tensor_view<const float, device_space>> bv;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    a.push_back(to_device(in[0][t]));
    b.push_back(to_device(in[1][t]));
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    av.push_back(view(a[t]));
    bv.push_back(cview(b[t]));
  }
  using W = gradapt::adasum_workspace<float, device_space>;
  dvec<float> elements(W::elements_needed(av));
  dvec<double> scalars(W::scalars_needed(av));
  W ws(av, view(elements), view(scalars));
  const gradapt::cuda backend{};
  gradapt::adasum_combine(backend, av, bv, ws);
  tlist<float> got;
  for (const auto& d : a) got.push_back(to_host(d));
  REQUIRE(close(got, ld_combine(widen(in[0]), widen(in[1])), in));
}

TEST_CASE("cuda adasum: a list that differs across ranks throws on every rank", "[cuda][adasum][errors]") {
  gradapt::comm::run_threads(3, [](gradapt::comm::threads& t) {
    staged_comm comm(t);
    dvec<float> x(t.rank() == 1 ? 9 : 8, 1.0f);
    std::vector<tensor_view<float, device_space>> views = {view(x)};
    using W = gradapt::adasum_workspace<float, device_space>;
    dvec<float> elements(W::elements_needed(views));
    dvec<double> scalars(W::scalars_needed(views));
    W ws(views, view(elements), view(scalars));
    gradapt::adasum<staged_comm> ada(comm);
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::cuda{}, views, ws),
                             Catch::Matchers::Contains("differ across ranks"));
  });
}

#if __has_include(<nccl.h>) && defined(GRADAPT_TEST_NCCL)
// Compile check of the NCCL instantiation (one GPU per rank is needed to run it; see
// tests/nccl). Inline and never called: the templates are instantiated, no code is emitted.
[[maybe_unused]] inline void adasum_over_nccl(
    gradapt::comm::nccl comm, std::vector<tensor_view<gradapt::bfloat16, device_space>>& grads,
    gradapt::adasum_workspace<gradapt::bfloat16, device_space>& ws) {
  gradapt::adasum<gradapt::comm::nccl> ada(comm,
                                           {.mode = gradapt::adasum_mode::hierarchical, .group_size = 8});
  ada.allreduce(gradapt::cuda{.stream = comm.stream()}, grads, ws);
}
#endif

}  // namespace gradapt_test_cuda_adasum

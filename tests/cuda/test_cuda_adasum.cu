// Adasum (gradapt/combine/adasum.hpp) with the CUDA backend on device memory.
//
// Ranks are host threads on one GPU. `staged_comm` (support/staged_comm.cuh) is a device-space
// communicator for tests only: every operation copies the device buffers to host memory, runs
// the comm::threads operation there and copies the result back (comm::nccl needs one GPU per
// rank). The backend runs on the legacy default stream, which orders those copies after the
// kernels. The long double reference is support/adasum_reference.hpp's.
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

#include "adasum_reference.hpp"
#include "cuda_test_support.cuh"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "staged_comm.cuh"

#if __has_include(<nccl.h>) && defined(GRADAPT_TEST_NCCL)
#include "gradapt/comm/nccl.hpp"
#endif

namespace gradapt_test_cuda_adasum {

using namespace gradapt_test;

namespace {

using adasum_test::eps;
using adasum_test::ld_combine;
using adasum_test::ldlist;
using adasum_test::tlist;
using adasum_test::val;
using adasum_test::widen;

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
  return adasum_test::ld_tree_of(v);
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
    const long double scale = adasum_test::rank_scale(in, t);
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

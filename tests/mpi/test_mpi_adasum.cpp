// Adasum (gradapt/combine/adasum.hpp) over comm::mpi, run under mpirun with 1 to 5 ranks.
//
//  - Flat mode equals, bit for bit, the same call on an in-process comm::threads world with
//    as many ranks: every MPI rank re-runs all ranks' inputs on threads and compares its own
//    rank's result (the threads result is itself checked against the serial tree in
//    tests/test_adasum.cpp). Random inputs, four element types, lists with empty, one-element
//    and odd-sized tensors, separate buffers and one fused buffer.
//  - Orthogonal inputs give their exact sum.
//  - Hierarchical mode equals the threads result bit for bit. Its group sums are MPI
//    allreduces, whose order is MPI's, so the inputs are multiples of 1/4 below 4 in magnitude:
//    every partial sum of at most 5 of them is exact in every element type.
//  - A list that differs on one rank, or a workspace made for another list, throws on every rank.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "adasum_fixtures.hpp"
#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/comm/threads.hpp"
#include "mpi_test_support.hpp"

namespace gradapt_test_mpi_adasum {

using gradapt::tensor_view;

namespace {

using adasum_test::tlist;

/// Rank r's tensors: random in [-1, 1) (or multiples of 1/4 in [-2, 2) when `dyadic`).
template <class T>
tlist<T> inputs(const std::vector<std::size_t>& sizes, int r, std::uint64_t seed, bool dyadic) {
  std::mt19937_64 rng(seed * 977 + static_cast<std::uint64_t>(r));
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::uniform_int_distribution<int> q(-8, 7);
  tlist<T> out;
  for (std::size_t n : sizes) {
    std::vector<T> v(n);
    for (auto& x : v) x = mpitest::make<T>(dyadic ? q(rng) / 4.0 : d(rng));
    out.push_back(std::move(v));
  }
  return out;
}

/// Runs Adasum on communicator `comm` over rank r's inputs; returns the result.
template <class T, class C>
tlist<T> run(C& comm, const tlist<T>& in, bool one_buffer, gradapt::adasum_options opt) {
  return adasum_test::adasum_on(comm, in, {.one_buffer = one_buffer, .options = opt});
}

template <class T>
bool same(const tlist<T>& a, const tlist<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t t = 0; t < a.size(); ++t)
    if (!mpitest::same_bits(a[t], b[t])) return false;
  return true;
}

const std::vector<std::vector<std::size_t>> shapes = {
    {1000, 1, 0, 15, 4097, 2}, {12345}, {7, 0, 0, 13}, {1}, {}};

/// MPI result of this rank vs the threads result of the same rank, for every shape and both
/// memory layouts.
template <class T>
void compare_with_threads(gradapt::adasum_options opt, bool dyadic) {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const int me = comm.rank();
  for (std::size_t s = 0; s < shapes.size(); ++s)
    for (const bool one_buffer : {false, true}) {
      const auto got = run<T>(comm, inputs<T>(shapes[s], me, s, dyadic), one_buffer, opt);
      std::vector<tlist<T>> threads_out(static_cast<std::size_t>(n));
      gradapt::comm::run_threads(n, [&](gradapt::comm::threads& tc) {
        const int r = tc.rank();
        threads_out[static_cast<std::size_t>(r)] =
            run<T>(tc, inputs<T>(shapes[s], r, s, dyadic), !one_buffer, opt);
      });
      INFO("ranks " << n << ", rank " << me << ", shape " << s << ", one buffer " << one_buffer);
      REQUIRE(same(got, threads_out[static_cast<std::size_t>(me)]));
    }
}

}  // namespace

TEMPLATE_TEST_CASE("mpi adasum: equals the threads communicator bit for bit", "[mpi][adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  compare_with_threads<TestType>({}, false);
}

TEMPLATE_TEST_CASE("mpi adasum: hierarchical mode equals the threads communicator bit for bit",
                   "[mpi][adasum]", float, gradapt::bfloat16) {
  for (int g : {1, 2, 3})
    compare_with_threads<TestType>({.mode = gradapt::adasum_mode::hierarchical, .group_size = g}, true);
}

TEST_CASE("mpi adasum: orthogonal inputs give their exact sum", "[mpi][adasum]") {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const int me = comm.rank();
  const std::vector<std::size_t> sizes = {29, 1, 8};
  // Rank r owns the elements i with i % n == r.
  const auto own = [&](int r) {
    auto l = inputs<float>(sizes, r, 3, false);
    for (auto& v : l)
      for (std::size_t i = 0; i < v.size(); ++i)
        if (static_cast<int>(i % static_cast<std::size_t>(n)) != r) v[i] = 0.0f;
    return l;
  };
  const auto got = run<float>(comm, own(me), me % 2 == 0, {});
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      const int owner = static_cast<int>(i % static_cast<std::size_t>(n));
      INFO("tensor " << t << ", element " << i);
      REQUIRE(got[t][i] == own(owner)[t][i]);
    }
}

TEST_CASE("mpi adasum: lists that differ across ranks throw on every rank", "[mpi][adasum][errors]") {
  using Catch::Matchers::Contains;
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const int me = comm.rank();
  // The last rank's second tensor is one element longer.
  std::vector<float> x(10, 1.0f), y(me == n - 1 && n > 1 ? 4 : 3, 1.0f);
  std::vector<tensor_view<float>> list = {mpitest::view(x), mpitest::view(y)};
  gradapt::adasum_workspace<float> ws(list);
  gradapt::adasum<gradapt::comm::mpi> ada(comm);
  if (n > 1) {
    const std::string e = mpitest::error_of([&] { ada.allreduce(gradapt::host{}, list, ws); });
    REQUIRE_THAT(e, Contains("differ across ranks") && Contains("on rank " + std::to_string(me)));
  }
  // Rank 0 passes a workspace made for another list: it names the tensor, the others name rank 0.
  std::vector<float> z(11, 1.0f);
  std::vector<tensor_view<float>> other = {mpitest::view(z), mpitest::view(y)};
  gradapt::adasum_workspace<float> wrong(other);
  std::vector<float> y2(3, 1.0f);
  std::vector<tensor_view<float>> same_list = {mpitest::view(x), mpitest::view(y2)};
  gradapt::adasum_workspace<float> right(same_list);
  const std::string e =
      mpitest::error_of([&] { ada.allreduce(gradapt::host{}, same_list, me == 0 ? wrong : right); });
  if (me == 0)
    REQUIRE_THAT(e, Contains("tensor 0 has 10 elements but the workspace was made for 11"));
  else
    REQUIRE_THAT(e, Contains("rank 0 passed invalid input"));
  // The world is still usable: a good call afterwards succeeds and agrees with threads.
  ada.allreduce(gradapt::host{}, same_list, right);
  REQUIRE(x[0] == 1.0f);
}

}  // namespace gradapt_test_mpi_adasum

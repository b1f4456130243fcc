#pragma once
// The hierarchical allreduce (comm::hierarchy) written once over the communicator: the threads
// test (tests/test_hierarchical.cpp) runs these scenarios on 1 to 8 ranks, the MPI test
// (tests/mpi/test_mpi_hierarchical.cpp) under mpiexec with 1 to 5 ranks. Assertions go through
// rank_check.hpp (safe on rank threads).
//
// Inputs are small integers, so every partial sum is exact in every element type: the
// hierarchical result must have the bits of the flat allreduce whatever order an engine adds
// in, and the value of a closed-form reference computed here in double.
#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "rank_check.hpp"
#include "thrown_message.hpp"

namespace hier_scenarios {

using exact::make;
using exact::same_bits;
using exact::value;

/// Integer input of rank r at index i, in [-5, 5].
inline double x(int r, std::size_t i) {
  return static_cast<double>((r * 7 + static_cast<int>(i % 13) * 3) % 11) - 5.0;
}

/// Buffer sizes every scenario runs: empty, one element, not divisible by most group sizes,
/// and a larger one.
inline constexpr std::size_t sizes[] = {0, 1, 37, 1000};

/// The message of the gradapt::error f throws, or "no error".
template <class F>
std::string error_of(F&& f) {
  return gradapt_test::thrown_message(std::forward<F>(f));
}

/// The hierarchy's shape: nodes() × local_size() ranks, consistent with its communicators.
template <class Comm>
void check_shape(const gradapt::comm::hierarchy<Comm>& h, int expect_nodes) {
  RANK_CHECK(h.nodes() == expect_nodes);
  RANK_CHECK(h.nodes() * h.local_size() == h.size());
  RANK_CHECK(h.local().size() == h.local_size());
  RANK_CHECK(h.local().rank() == h.local_rank());
  RANK_CHECK(h.cross().size() == h.nodes());
  RANK_CHECK(h.cross().rank() == h.node());
}

/// Sum and max of integer data through `h` have the bits of the flat allreduce over `world`
/// and the closed-form values, for every size; twice, so the scratch is reused.
template <class T, class Comm>
void matches_flat_exact(Comm& world, gradapt::comm::hierarchy<Comm>& h) {
  const int r = world.rank(), p = world.size();
  for (int round = 0; round < 2; ++round)
    for (const std::size_t n : sizes)
      for (const auto op : {gradapt::reduce_op::sum, gradapt::reduce_op::max}) {
        std::vector<T> mine(n);
        for (std::size_t i = 0; i < n; ++i) mine[i] = make<T>(x(r, i) + round);
        auto flat = mine, hier = mine;
        world.allreduce(gradapt::host_view(flat), op);
        h.allreduce(gradapt::host_view(hier), op);
        RANK_CHECK(same_bits(hier, flat));
        bool right = true;
        for (std::size_t i = 0; i < n; ++i) {
          double want = x(0, i) + round;
          for (int q = 1; q < p; ++q)
            want = op == gradapt::reduce_op::sum ? want + x(q, i) + round : std::max(want, x(q, i) + round);
          right = right && value(hier[i]) == want;
        }
        RANK_CHECK(right);
      }
}

/// The divisors of p, ascending, comma-separated.
inline std::string divisors(int p) {
  std::string s;
  for (int d = 1; d <= p; ++d)
    if (p % d == 0) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

/// A group size that does not divide the world size (size + 1 never does): every rank throws
/// naming both sizes; the world still works afterwards.
template <class Comm>
void indivisible_group_size(Comm& world) {
  const int g = world.size() + 1;
  const auto what = error_of([&] { gradapt::comm::hierarchy<Comm> h(world, {.group_size = g}); });
  RANK_CHECK(what == "gradapt: comm::hierarchy on rank " + std::to_string(world.rank()) +
                         ": hierarchy_options::group_size " + std::to_string(g) +
                         " does not divide the world size " + std::to_string(world.size()) +
                         " (expected one of " + divisors(world.size()) + ")");
}

/// Rank 0 passes group size 1, the others the world size: with two or more ranks every rank
/// throws, naming the option and the range.
template <class Comm>
void disagreeing_group_size(Comm& world) {
  const int g = world.rank() == 0 ? 1 : world.size();
  const auto what = error_of([&] { gradapt::comm::hierarchy<Comm> h(world, {.group_size = g}); });
  if (world.size() == 1) {
    RANK_CHECK(what == "no error");
    return;
  }
  RANK_CHECK(what == "gradapt: comm::hierarchy on rank " + std::to_string(world.rank()) +
                         ": hierarchy_options::group_size is " + std::to_string(g) +
                         " on this rank but ranges from 1 to " + std::to_string(world.size()) +
                         " across ranks (every rank must pass the same hierarchy_options::group_size)");
}

/// Rank 0 on host "alpha", the others on "beta": with three or more ranks the hosts hold
/// different numbers of ranks and every rank throws naming both hosts and counts.
template <class Comm>
void unequal_hosts(Comm& world) {
  const int p = world.size();
  const auto what = error_of(
      [&] { gradapt::comm::hierarchy<Comm> h(world, {.host = world.rank() == 0 ? "alpha" : "beta"}); });
  if (p < 3) {
    RANK_CHECK(what == "no error");
    return;
  }
  RANK_CHECK(what == "gradapt: comm::hierarchy on rank " + std::to_string(world.rank()) +
                         ": the hosts hold different numbers of ranks (\"alpha\" 1 rank, \"beta\" " +
                         std::to_string(p - 1) +
                         " ranks); the cross-node communicator needs the same number of ranks on every "
                         "host (start as many ranks on each host, or set hierarchy_options::group_size)");
}

/// Ranks pass different element counts (with two or more ranks): every rank throws naming the
/// count and its range, and the hierarchy still works afterwards.
template <class Comm>
void disagreeing_counts(Comm& world) {
  gradapt::comm::hierarchy<Comm> h(world, {.group_size = 1});
  std::vector<float> v(static_cast<std::size_t>(10 + (world.rank() == world.size() - 1 ? 1 : 0)), 1.0f);
  const auto what = error_of([&] { h.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum); });
  if (world.size() == 1) {
    RANK_CHECK(what == "no error");
  } else {
    RANK_CHECK(what == "gradapt: comm::hierarchy::allreduce on rank " + std::to_string(world.rank()) +
                           ": element count is " + std::to_string(v.size()) +
                           " on this rank but ranges from 10 to 11 across ranks (every rank must pass the "
                           "same element count)");
  }
  std::vector<double> ok(5, 1.0);
  h.allreduce(gradapt::host_view(ok), gradapt::reduce_op::sum);
  RANK_CHECK(ok[4] == world.size());
}

}  // namespace hier_scenarios

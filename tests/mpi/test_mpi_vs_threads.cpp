// "threads and MPI communicators give identical results for the same inputs": every MPI rank
// runs one script of operations on gradapt::comm::mpi, then runs the same script on an
// in-process gradapt::comm::threads world with as many ranks as MPI has, and compares the
// outputs of its own rank bitwise.
//
// The inputs are exact dyadic values (multiples of 1/4, see mpi_test_support.hpp) whose sums
// over at most 5 ranks are exact in every element type, half and bfloat16 included. The two
// engines combine ranks in different orders (MPI's tree or ring versus rank order) and round
// 16-bit sums at different points (MPI at every step, threads once); with these inputs neither
// can change a bit, so any difference is a real bug in data placement or arithmetic.
#include "catch.hpp"

#include <mpi.h>

#include <cstddef>
#include <string>
#include <vector>

#include "gradapt/comm/mpi.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/concepts.hpp"
#include "mpi_test_support.hpp"

namespace gradapt_test_mpi_vs_threads {

using namespace mpitest;

namespace {

/// One labelled output of the script.
template <class T>
struct output {
  std::string what;
  std::vector<T> data;
};

/// Every operation of the communicator contract, on exact inputs, for communicator C. Written
/// once against the concept, run on both engines.
template <class T, gradapt::communicator C>
std::vector<output<T>> script(C& c) {
  const int r = c.rank();
  const int p = c.size();
  const auto np = static_cast<std::size_t>(p);
  std::vector<output<T>> out;
  for (const std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{1000}}) {
    const std::string at = " n=" + std::to_string(n);

    auto x = fill<T>(n, [&](std::size_t i) { return a(r, i); });
    c.allreduce(view(x), reduce_op::sum);
    out.push_back({"allreduce sum" + at, x});

    auto y = fill<T>(n, [&](std::size_t i) { return b(r, i); });
    c.allreduce(view(y), reduce_op::max);
    out.push_back({"allreduce max" + at, y});

    auto z = fill<T>(n, [&](std::size_t i) { return a(r, i + 3); });
    c.broadcast(view(z), p - 1);
    out.push_back({"broadcast from the last rank" + at, z});

    const auto send = fill<T>(n, [&](std::size_t i) { return b(r, i + 1); });
    std::vector<T> gathered(np * n, make<T>(99));
    c.allgather(cview(send), view(gathered));
    out.push_back({"allgather" + at, gathered});

    const auto big = fill<T>(np * n, [&](std::size_t j) { return a(r, j); });
    std::vector<T> part(n, make<T>(99));
    c.reduce_scatter(cview(big), view(part), reduce_op::sum);
    out.push_back({"reduce_scatter sum" + at, part});
    const auto big_b = fill<T>(np * n, [&](std::size_t j) { return b(r, j); });
    c.reduce_scatter(cview(big_b), view(part), reduce_op::max);
    out.push_back({"reduce_scatter max" + at, part});

    for (int k = 0; k < p; ++k) {
      const auto mine = fill<T>(n, [&](std::size_t i) { return a(r, i + static_cast<std::size_t>(k)); });
      std::vector<T> theirs(n, make<T>(99));
      c.exchange(partner(r, k, p), cview(mine), view(theirs));
      out.push_back({"exchange round " + std::to_string(k) + at, theirs});
    }

    auto sub = c.split(r % 2, -r);
    auto s = fill<T>(n, [&](std::size_t i) { return a(r, i); });
    sub.allreduce(view(s), reduce_op::sum);
    out.push_back({"allreduce sum in the odd/even group" + at, s});
    std::vector<T> sub_gathered(static_cast<std::size_t>(sub.size()) * n);
    sub.allgather(cview(send), view(sub_gathered));
    out.push_back({"allgather in the odd/even group" + at, sub_gathered});
    sub.barrier();
  }
  c.barrier();
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("threads and MPI communicators give identical results for the same inputs",
                   "[mpi][threads]", float, double, half, bfloat16) {
  using T = TestType;
  gradapt::comm::mpi world;
  const auto from_mpi = script<T>(world);

  // The same ranks in one process; only the main thread of this MPI process calls MPI, the
  // worker threads only run the threads communicator. Catch2 assertions stay on this thread.
  std::vector<std::vector<output<T>>> from_threads(static_cast<std::size_t>(world.size()));
  gradapt::comm::run_threads(world.size(), [&](gradapt::comm::threads& c) {
    from_threads[static_cast<std::size_t>(c.rank())] = script<T>(c);
  });
  const auto& mine = from_threads[static_cast<std::size_t>(world.rank())];

  REQUIRE(mine.size() == from_mpi.size());
  for (std::size_t k = 0; k < mine.size(); ++k) {
    INFO("operation: " << from_mpi[k].what << ", rank " << world.rank() << " of " << world.size());
    CHECK(mine[k].what == from_mpi[k].what);
    CHECK(same_bits(mine[k].data, from_mpi[k].data));
    CHECK(values(mine[k].data) == values(from_mpi[k].data));
  }
}

}  // namespace gradapt_test_mpi_vs_threads

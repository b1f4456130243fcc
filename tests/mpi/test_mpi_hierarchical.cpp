// The hierarchical allreduce (comm::hierarchy) over gradapt::comm::mpi under mpirun with 1 to
// 5 ranks: every group size that divides the world, and simulated hosts; integer data bitwise
// equal to the flat allreduce; errors on every rank, after which the world still works. The
// scenarios are shared with the threads test (tests/support/scenarios/hierarchical.hpp).
#include "catch.hpp"

#include <mpi.h>

#include <string>
#include <vector>

#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/mpi.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/hierarchical.hpp"

namespace gradapt_test_mpi_hierarchical {

using gradapt::comm::hierarchy;
using namespace mpitest;

TEMPLATE_TEST_CASE("mpi hierarchical sum and max of integers equal the flat allreduce bit for bit",
                   "[mpi][hierarchical]", float, double, half, bfloat16) {
  mpi c;
  const int p = c.size();
  for (int g = 1; g <= p; ++g) {
    if (p % g != 0) continue;
    hierarchy<mpi> h(c, {.group_size = g});
    hier_scenarios::check_shape(h, p / g);
    CHECK(h.node() == c.rank() / g);
    CHECK(h.local_rank() == c.rank() % g);
    hier_scenarios::matches_flat_exact<TestType>(c, h);
  }
}

TEST_CASE("mpi hierarchy groups by host name: the real host and simulated hosts", "[mpi][hierarchical]") {
  mpi c;
  {
    hierarchy<mpi> h(c);  // every rank of this test runs on one machine
    hier_scenarios::check_shape(h, 1);
    CHECK(!h.host().empty());
    hier_scenarios::matches_flat_exact<float>(c, h);
  }
  {
    // Even worlds: two interleaved hosts (rank r on host r mod 2); odd worlds: one rank per host.
    const int p = c.size(), hosts = p % 2 == 0 ? 2 : p;
    hierarchy<mpi> h(c, {.host = "sim-" + std::to_string(c.rank() % hosts)});
    hier_scenarios::check_shape(h, hosts);
    CHECK(h.node() == c.rank() % hosts);
    CHECK(h.local_rank() == c.rank() / hosts);
    hier_scenarios::matches_flat_exact<double>(c, h);
  }
}

TEST_CASE("mpi hierarchy errors are thrown on every rank", "[mpi][hierarchical][errors]") {
  mpi c;
  hier_scenarios::indivisible_group_size(c);
  still_works(c);
  hier_scenarios::disagreeing_group_size(c);
  still_works(c);
  hier_scenarios::unequal_hosts(c);
  still_works(c);
  hier_scenarios::disagreeing_counts(c);
  still_works(c);
}

}  // namespace gradapt_test_mpi_hierarchical

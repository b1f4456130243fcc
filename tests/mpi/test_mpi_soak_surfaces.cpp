// The randomized soak of one disagreeing rank (tests/support/scenarios/soak_surfaces.hpp: the
// composed step with each state and reduce slot, Shampoo's and K-FAC's distributed steps, an
// elastic job) on MPI_COMM_WORLD, 2 to 5 ranks (np 1 has nobody to disagree with): 60 cases of
// the same draw as tests/test_soak_surfaces.cpp (GRADAPT_SOAK_MPI_CASES changes the count). A
// case passes when nobody disagreed and every rank ended with the same parameter bits, or
// somebody did and every rank threw gradapt::error (not the watchdog's "did not arrive"); the
// outcome is agreed over all ranks after each case, so the world stays usable for the next one.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/mpi.hpp"
#include "scenarios/soak_surfaces.hpp"

namespace gradapt_test_mpi_soak_surfaces {

namespace soak = soak_surfaces_scenario;

TEST_CASE("mpi: soak of one disagreeing rank over the composed step, Shampoo, K-FAC and elastic jobs",
          "[mpi][soak][disagreement]") {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  if (n < 2) return;  // one rank disagrees with nobody
  const char* env = std::getenv("GRADAPT_SOAK_MPI_CASES");
  const std::uint64_t cases = env ? std::strtoull(env, nullptr, 10) : 60;
  std::uint64_t failures = 0, agreed = 0, disagreed = 0;
  std::string first;
  for (std::uint64_t i = 0; i < cases; ++i) {
    std::mt19937_64 rng(20261128 + 7919 * i + static_cast<std::uint64_t>(n));
    const soak::plan p = soak::draw(rng, n);
    std::string out;
    std::uint64_t hash = 0;
    try {
      hash = soak::hash_floats(soak::run_case(comm, p));
    } catch (const gradapt::error& e) {
      out = std::string("threw: ") + e.what();
    }
    // Every rank's outcome: threw (1) or not, and the hash split into exact doubles.
    std::vector<double> mine{out.empty() ? 0.0 : 1.0,
                             out.find("did not arrive") != std::string::npos ? 1.0 : 0.0,
                             static_cast<double>(hash >> 32), static_cast<double>(hash & 0xffffffffu)};
    std::vector<double> lo = mine, hi = mine;
    for (auto& v : lo) v = -v;
    comm.allreduce(gradapt::host_view(hi), gradapt::reduce_op::max);
    comm.allreduce(gradapt::host_view(lo), gradapt::reduce_op::max);
    bool ok = true;
    if (p.perturb == 0) {
      ++agreed;
      ok = hi[0] == 0.0 && hi[2] == -lo[2] && hi[3] == -lo[3];  // nobody threw, the same bits
    } else {
      ++disagreed;
      ok = -lo[0] == 1.0 && hi[1] == 0.0;  // every rank threw, none by the watchdog
    }
    if (!ok && ++failures == 1)
      first = "case " + std::to_string(i) + ": surface " + std::to_string(static_cast<int>(p.s)) +
              ", perturbation " + std::to_string(p.perturb) + " on rank " + std::to_string(p.culprit) +
              "; this rank: " + (out.empty() ? "returned" : out);
  }
  if (comm.rank() == 0)
    std::printf("mpi soak on %d ranks: %llu cases, %llu agreeing, %llu disagreeing, %llu failed\n", n,
                static_cast<unsigned long long>(cases), static_cast<unsigned long long>(agreed),
                static_cast<unsigned long long>(disagreed), static_cast<unsigned long long>(failures));
  INFO(first);
  REQUIRE(failures == 0);
}

}  // namespace gradapt_test_mpi_soak_surfaces

// A randomized soak of ranks that disagree over the newer surfaces, on the threads
// communicator. Each case draws a world of 2 to 4 ranks, a surface and, in about two cases of
// three, one rank (the culprit) that does something the others do not:
//
//   the composed step, with each state and reduce slot (replicated, zero_state<1>,
//   zero_state<2>, bucket_reduce, hierarchical_reduce) and SGD with momentum or AdamW:
//     another learning rate at construction, another optimizer option, another step_args::lr
//     at step 2, AdaScale on the culprit only, a parameter of the same size in another shape,
//     a NaN learning rate at step 2, or (zero_state<2>, bucket_reduce) a gradient left
//     unmarked at step 2;
//   Shampoo's distributed step: another graft_epsilon, momentum or beta1, or another step lr;
//   K-FAC's distributed step: another learning rate, another damping, a layer's factors
//     left out at step 2;
//   an elastic job: a policy that proposes a learning rate on the culprit only, or another
//   value there.
//
// A case passes when nobody disagreed and every rank returned with bitwise identical
// parameters, or somebody did and every rank threw gradapt::error (not the watchdog's "did not
// arrive", which would mean a rank was left waiting). GRADAPT_SOAK_SURFACE_CASES sets the number
// of cases (default 1000; 300 under a sanitizer), GRADAPT_SOAK_SEED the seed;
// docs/reliability.md records a run of 10,000.
#include "catch.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "sanitizer.hpp"
#include "scenarios/soak_surfaces.hpp"

namespace gradapt_test_soak_surfaces {

namespace {

using threads = gradapt::comm::threads;
using namespace soak_surfaces_scenario;

constexpr std::uint64_t default_cases = gradapt_test::under_sanitizer ? 300 : 1000;

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace

TEST_CASE("soak: the composed step's slots, Shampoo, K-FAC and elastic jobs with one disagreeing rank",
          "[soak][disagreement]") {
  const std::uint64_t cases = env_or("GRADAPT_SOAK_SURFACE_CASES", default_cases);
  const std::uint64_t seed = env_or("GRADAPT_SOAK_SEED", 20261128);
  const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(20)};
  std::uint64_t agreed = 0, disagreed = 0, failures = 0;
  for (std::uint64_t i = 0; i < cases; ++i) {
    std::mt19937_64 rng(seed + i);
    const int n = 2 + static_cast<int>(rng() % 3);
    const plan p = draw(rng, n);
    std::vector<std::string> out(static_cast<std::size_t>(n));
    std::vector<std::uint64_t> hashes(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, quick, [&](threads& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      try {
        hashes[r] = hash_floats(run_case(comm, p));
      } catch (const gradapt::error& e) {
        out[r] = std::string("threw: ") + e.what();
      } catch (const std::exception& e) {
        out[r] = std::string("other exception: ") + e.what();
      }
    });
    bool ok = true;
    if (p.perturb == 0) {
      ++agreed;
      for (std::size_t r = 0; r < out.size(); ++r) ok = ok && out[r].empty() && hashes[r] == hashes[0];
    } else {
      ++disagreed;
      for (const auto& o : out)
        ok = ok && o.rfind("threw: ", 0) == 0 && o.find("did not arrive") == std::string::npos;
    }
    if (!ok) {
      ++failures;
      if (failures <= 5) {
        std::string msg = "case " + std::to_string(i) + ": surface " + std::to_string(static_cast<int>(p.s)) +
                          ", " + std::to_string(n) + " ranks, perturbation " + std::to_string(p.perturb) +
                          " on rank " + std::to_string(p.culprit) + (p.adamw ? ", adamw" : ", sgd");
        for (std::size_t r = 0; r < out.size(); ++r)
          msg.append("\n  rank ")
              .append(std::to_string(r))
              .append(": ")
              .append(out[r].empty() ? "returned" : out[r]);
        UNSCOPED_INFO(msg);
      }
    }
  }
  std::printf("soak over the surfaces: %llu cases, %llu agreeing, %llu disagreeing, %llu failed\n",
              static_cast<unsigned long long>(cases), static_cast<unsigned long long>(agreed),
              static_cast<unsigned long long>(disagreed), static_cast<unsigned long long>(failures));
  REQUIRE(failures == 0);
  REQUIRE(agreed > 0);
  REQUIRE(disagreed > 0);
}

}  // namespace gradapt_test_soak_surfaces

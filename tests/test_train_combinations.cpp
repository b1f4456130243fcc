// The composed step's slots in combination on comm::threads: the covering array of
// tests/support/scenarios/train_combinations.hpp over
//
//   optimizer {SGD with momentum, AdamW, LAMB, LARS, Adafactor factored, SM3}
//   × state {replicated, zero_state<1>, zero_state<2>} × reduce {one buffer, buckets, hierarchical}
//   × combine {mean, Adasum} × loss scaler {off, on} × AdaScale {off, on} × sync {every step, LocalSGD}
//
// in which every pair of values that the slots allow together appears in at least one row (30
// rows, five per optimizer: buckets, hierarchical, ZeRO-1, ZeRO-2 and Adasum, with the flags
// varied across them). Each row runs 20 steps on 1, 2, 3 and 5 ranks (12 steps on 3 ranks under a
// sanitizer), with an overflow on the last rank at step 5 when the scaler is on, and a save at
// step 10 (6) loaded into a fresh step that runs the rest. Its reference is the same recipe with the state
// replicated and the gradients reduced in one buffer, run without the checkpoint. Gradients differ by rank
// and are multiples of 2^-6 below 2^5, so every partial sum is exact and the order of a reduction
// (shards, buckets, groups) does not change a bit: the parameters must then equal the
// reference's bit for bit, as the docs promise for these slots on comm::threads. With AdaScale
// the noise scale's norms are summed in another order per slot (in double; the estimator's
// difference of two norms amplifies the rounding), so the gain agrees to 1e-9 and the
// parameters to 1e-6 (relative, + 1e-3). The same rows run under mpirun in
// tests/mpi/test_mpi_train_combinations.cpp. K-FAC is covered with each reduce slot in
// tests/test_train_kfac.cpp; the invalid pairs fail to compile (tests/compile_fail/train_slots.cpp).
#include "catch.hpp"

#include <chrono>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "sanitizer.hpp"
#include "scenarios/train_combinations.hpp"

namespace gradapt_test_train_combinations {

using gradapt::comm::run_threads;
using gradapt::comm::threads;
namespace scenario = train_combinations_scenario;

namespace {

// Under a sanitizer (the asan preset, at -O0) the rows run on 3 ranks only: that build looks
// for memory and UB errors, which every world size reaches on the same code; the default
// preset runs every world size.
const std::vector<int> worlds =
    gradapt_test::under_sanitizer ? std::vector<int>{3} : std::vector<int>{1, 2, 3, 5};

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};

/// Runs a row on every world size (row_options' steps and save), and asserts its outcome
/// on every rank thread.
const auto on_threads = [](const char* name, auto... slots) {
  for (const int n : worlds) {
    INFO(name << " on " << n << " ranks");
    run_threads(n, quick, [&](threads& comm) {
      scenario::require_row(scenario::run_row(comm, scenario::row_options{}, slots...));
    });
  }
};

}  // namespace

TEST_CASE("slots in combination: SGD and AdamW rows", "[train][combinations]") {
  scenario::sgd_adamw_rows(on_threads);
}

TEST_CASE("slots in combination: LAMB and LARS rows", "[train][combinations]") {
  scenario::lamb_lars_rows(on_threads);
}

TEST_CASE("slots in combination: Adafactor and SM3 rows (factored, whole tensors per rank)",
          "[train][combinations]") {
  scenario::adafactor_sm3_rows(on_threads);
}

}  // namespace gradapt_test_train_combinations

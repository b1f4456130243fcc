// The composed step's slots in combination over comm::mpi, under mpirun with 1 to 5 ranks: every
// row of the covering array of tests/support/scenarios/train_combinations.hpp (optimizer × state
// × reduce × combine × loss scaler × AdaScale × sync, 30 rows; both hierarchical_reduce settings
// are valid on any world size) against its reference recipe, replicated with one-buffer
// reduction and no checkpoint: 20 steps with an overflow on the last rank at step 5 (scaler on)
// and a save at step 10 loaded into a fresh step that runs the rest, bit for bit in the
// parameters on gradients whose sums are exact in any order, the gain to 1e-9 and the
// parameters to 1e-6 with AdaScale. The steps run on the host backend with one OpenMP thread
// per rank. The threads test (tests/test_train_combinations.cpp) runs the same rows.
//
// Every row runs on every rank before any REQUIRE, and each row's outcome is the worst over all
// ranks (scenario::agree), so a failure on one rank fails the row on every rank and none is left
// waiting in a collective.
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/mpi.hpp"
#include "scenarios/train_combinations.hpp"

namespace gradapt_test_mpi_train_combinations {

using mpi = gradapt::comm::mpi;
namespace scenario = train_combinations_scenario;

namespace {

const scenario::row_options when{.steps = 20, .saved_at = 10, .backend = {.threads = 1}};

/// Runs the rows `rows` passes to its visitor on MPI_COMM_WORLD, then asserts every row's
/// outcome, agreed over all ranks.
template <class Rows>
void run_on_world(Rows rows) {
  mpi comm;
  std::vector<std::pair<std::string, scenario::outcome>> got;
  rows([&](const char* name, auto... slots) {
    got.emplace_back(name, scenario::agree(comm, scenario::run_row(comm, when, slots...)));
  });
  for (const auto& [name, o] : got) {
    INFO(name << " on " << comm.size() << " ranks: failed on " << o.failed_ranks << " rank(s)");
    scenario::require_row(o);
  }
}

}  // namespace

TEST_CASE("mpi: slots in combination: SGD and AdamW rows", "[mpi][train][combinations]") {
  run_on_world([](auto&& row) { scenario::sgd_adamw_rows(row); });
}

TEST_CASE("mpi: slots in combination: LAMB and LARS rows", "[mpi][train][combinations]") {
  run_on_world([](auto&& row) { scenario::lamb_lars_rows(row); });
}

TEST_CASE("mpi: slots in combination: Adafactor and SM3 rows (factored, whole tensors per rank)",
          "[mpi][train][combinations]") {
  run_on_world([](auto&& row) { scenario::adafactor_sm3_rows(row); });
}

}  // namespace gradapt_test_mpi_train_combinations

// The Shampoo family (Shampoo, SOAP, Muon) in the composed step over comm::mpi, under mpirun
// with 1 to 5 ranks: the rows of tests/support/scenarios/train_shampoo_rows.hpp (replicated
// state with each reduce and combine slot, the scaler, AdaScale and LocalSGD) against their
// one-buffer reference without a checkpoint, as tests/test_train_shampoo.cpp runs them on
// comm::threads. Without LocalSGD the roots (SOAP: the eigenbases) are divided among the MPI
// ranks and allgathered; the parameters must still equal the reference's bit for bit. Every row
// runs on every rank before any REQUIRE; each outcome is the worst over all ranks.
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/mpi.hpp"
#include "scenarios/train_shampoo_rows.hpp"

namespace gradapt_test_mpi_train_shampoo {

namespace scenario = train_combinations_scenario;

TEST_CASE("mpi: slots in combination: Shampoo, SOAP and Muon rows", "[mpi][train][combinations][shampoo]") {
  gradapt::comm::mpi comm;
  const scenario::row_options when{.steps = 20, .saved_at = 10, .backend = {.threads = 1}};
  std::vector<std::pair<std::string, scenario::outcome>> got;
  scenario::shampoo_rows([&](const char* name, auto... slots) {
    got.emplace_back(name, scenario::agree(comm, scenario::run_row(comm, when, slots...)));
  });
  for (const auto& [name, o] : got) {
    INFO(name << " on " << comm.size() << " ranks: failed on " << o.failed_ranks << " rank(s)");
    scenario::require_row(o);
  }
}

}  // namespace gradapt_test_mpi_train_shampoo

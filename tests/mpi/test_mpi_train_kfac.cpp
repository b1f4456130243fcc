// K-FAC in the composed step's precondition slot over comm::mpi, on 1 to 5 ranks: the composed
// step (one-buffer reduction, and bucket_reduce with overlap, gradients marked in the backward's
// order) equals the sequence it stands for written out on the same communicator (allreduce-sum
// and divide by the rank count, kfac::step(comm, ...) at the lr, the optimizer's step), bit for
// bit in the parameters and in the K-FAC state, and the parameters are identical on every rank.
// The scenario is shared with the threads test: tests/support/scenarios/train_kfac.hpp. Built
// when the linear-algebra component (LAPACK) is on.
//
// Every collective runs on every rank before any REQUIRE, so a failure on one rank cannot leave
// the others waiting in a collective.
#include <vector>

#include "catch.hpp"
#include "exact_values.hpp"
#include "gradapt/comm/mpi.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/train_kfac.hpp"

namespace gradapt_test_mpi_train_kfac {

using mpi = gradapt::comm::mpi;
using namespace train_kfac_scenario;
using exact::identical_on_every_rank;

TEST_CASE("mpi: K-FAC in the composed step, one buffer and overlapped buckets, equals the stages by hand",
          "[mpi][train][kfac]") {
  mpi comm;
  const gradapt::kfac_options configs[] = {
      {.factor_update_steps = 1, .inv_update_steps = 1},
      {.factor_update_steps = 2, .inv_update_steps = 3, .damping = 0.01, .method = kfac_method::inverse},
  };
  constexpr int steps = 7;
  for (const auto& o : configs) {
    INFO("factor_update_steps " << o.factor_update_steps << ", inv_update_steps " << o.inv_update_steps);
    const kfac kf(o);
    const auto a = run_composed(comm, kf, steps);
    const auto b = run_by_hand(comm, kf, steps);
    const auto c =
        run_composed(comm, kf, steps, train::bucket_reduce{.buckets = {.cap_bytes = 64}, .overlap = true});
    const auto plain = run_plain(comm, steps);
    const bool in_sync = identical_on_every_rank(comm, a.params);
    REQUIRE(a.kfac_steps == steps);
    REQUIRE(same_bits(a.params, b.params));
    REQUIRE(a.kfac_state == b.kfac_state);
    REQUIRE(same_bits(c.params, b.params));
    REQUIRE(c.kfac_state == b.kfac_state);
    REQUIRE(in_sync);
    REQUIRE_FALSE(same_bits(a.params, plain));  // K-FAC changed the trajectory
  }
}

}  // namespace gradapt_test_mpi_train_kfac

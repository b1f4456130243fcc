// The data-parallel gradient-noise-scale form over comm::mpi gives the numbers of the serial
// two-batch form, bit for bit. Gradient values are multiples of 1/32 below 8 in magnitude, so
// every sum the allreduces form is exact whatever order MPI combines ranks in; the remaining
// operations (division by the rank count, the loss scale, the EMAs) are the same operations on
// the same values in both forms. The scenario is shared with the threads test
// (tests/support/scenarios/noise_scale.hpp).
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "scenarios/noise_scale.hpp"

namespace gradapt_test_mpi_noise_scale {

namespace {

// Rank r's local gradient at step k (already multiplied by the loss scale): a component every
// rank shares (the signal) plus a rank-specific one (the noise), all multiples of 1/32.
std::vector<double> local_grad(int r, int k, double loss_scale) {
  std::vector<double> g(37);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const auto h = static_cast<unsigned>((r * 131 + k * 71 + static_cast<int>(i) * 17) % 97);
    const double shared = static_cast<double>(static_cast<int>(i % 5) - 2) + 0.5 * static_cast<double>(k % 3);
    const double noise = static_cast<double>(h % 61) / 32.0 - 0.9375;
    g[i] = (shared + noise) * loss_scale;
  }
  return g;
}

}  // namespace

TEST_CASE("mpi: data-parallel noise scale equals the serial two-batch form", "[mpi][gns]") {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const gradapt::noise_batch batch{.micro_batch = 4, .accumulation_steps = 2, .loss_scale = 64.0};
  if (n == 1) {
    noise_scale_scenario::one_rank_throws(comm, batch);
    return;
  }
  const auto grad = [&](int r, int k) { return local_grad(r, k, batch.loss_scale); };
  const auto serial = noise_scale_scenario::serial_reference(n, batch, 20, grad);
  const auto dp = noise_scale_scenario::data_parallel(comm, batch, 20, grad);
  noise_scale_scenario::require_same(dp, serial);
  gradapt::gradient_noise_scale restored({.smoothing = 0.9});
  restored.restore(dp.state);
  REQUIRE(restored.b_simple().has_value());
}

}  // namespace gradapt_test_mpi_noise_scale

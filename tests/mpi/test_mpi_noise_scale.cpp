// The data-parallel gradient-noise-scale form over comm::mpi gives the numbers of the serial
// two-batch form, bit for bit. Gradient values are multiples of 1/32 below 8 in magnitude, so
// every sum the allreduces form is exact whatever order MPI combines ranks in; the remaining
// operations (division by the rank count, the loss scale, the EMAs) are the same operations on
// the same values in both forms.
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"

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

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Field by field (the struct has padding after its last member, which memcmp would compare).
bool same_state(const gradapt::gradient_noise_scale_state& a, const gradapt::gradient_noise_scale_state& b) {
  return same_bits(a.ema_grad_sq, b.ema_grad_sq) && same_bits(a.ema_trace, b.ema_trace) &&
         same_bits(a.beta_power, b.beta_power) && same_bits(a.last_grad_sq, b.last_grad_sq) &&
         same_bits(a.last_trace, b.last_trace) && a.samples == b.samples && a.skipped == b.skipped &&
         a.biased == b.biased && a.has_previous == b.has_previous;
}

}  // namespace

TEST_CASE("mpi: data-parallel noise scale equals the serial two-batch form", "[mpi][gns]") {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const gradapt::noise_batch batch{.micro_batch = 4, .accumulation_steps = 2, .loss_scale = 64.0};
  const double local = batch.local();
  const gradapt::host backend{.threads = 1};
  const int steps = 20;
  if (n == 1) {
    gradapt::gradient_noise_scale gns;
    REQUIRE_THROWS_WITH(gns.update(comm, 1.0, 1.0, batch),
                        Catch::Matchers::Contains("update_single_replica"));
    return;
  }
  gradapt::gradient_noise_scale serial({.smoothing = 0.9}), dp({.smoothing = 0.9});
  for (int k = 0; k < steps; ++k) {
    // Serial reference: every rank recomputes all ranks' gradients locally.
    std::vector<double> sum(37, 0.0);
    double local_sq_sum = 0;
    for (int r = 0; r < n; ++r) {
      const auto g = local_grad(r, k, batch.loss_scale);
      local_sq_sum += backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(g));
      for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
    for (double& v : sum) v /= n;
    const double serial_global = backend.reduce(gradapt::reduction::sum_squares,
                                                gradapt::tensor_view<const double>(gradapt::host_view(sum)));
    REQUIRE(serial.update(local_sq_sum / n, local, serial_global, n * local, batch.loss_scale));
    // Data-parallel form: this rank's gradient, one gradient allreduce, one scalar allreduce.
    auto g = local_grad(comm.rank(), k, batch.loss_scale);
    const double local_sq = backend.reduce(gradapt::reduction::sum_squares,
                                           gradapt::tensor_view<const double>(gradapt::host_view(g)));
    comm.allreduce(gradapt::host_view(g), gradapt::reduce_op::sum);
    for (double& v : g) v /= n;
    const double global_sq = backend.reduce(gradapt::reduction::sum_squares,
                                            gradapt::tensor_view<const double>(gradapt::host_view(g)));
    REQUIRE(global_sq == serial_global);
    REQUIRE(dp.update(comm, local_sq, global_sq, batch));
  }
  REQUIRE(same_state(dp.state(), serial.state()));
  REQUIRE(dp.b_simple().has_value());
}

#pragma once
// The data-parallel gradient-noise-scale form against the serial two-batch form, written once
// over the communicator: the threads test (tests/test_gradient_noise_scale.cpp) runs it inside
// run_threads, the MPI test (tests/mpi/test_mpi_noise_scale.cpp) on MPI_COMM_WORLD. Assertions
// go through rank_check.hpp.
#include <cstddef>
#include <utility>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "rank_check.hpp"

namespace noise_scale_scenario {

/// Bitwise equality of two estimator states, field by field (the struct has padding after its
/// last member, which memcmp would compare).
inline bool same_state(const gradapt::gradient_noise_scale_state& a,
                       const gradapt::gradient_noise_scale_state& b) {
  using exact::same_bits;
  return same_bits(a.ema_grad_sq, b.ema_grad_sq) && same_bits(a.ema_trace, b.ema_trace) &&
         same_bits(a.beta_power, b.beta_power) && same_bits(a.last_grad_sq, b.last_grad_sq) &&
         same_bits(a.last_trace, b.last_trace) && a.samples == b.samples && a.skipped == b.skipped &&
         a.biased == b.biased && a.has_previous == b.has_previous;
}

/// An estimator's state after a run and |mean gradient|^2 at every step.
struct run_result {
  gradapt::gradient_noise_scale_state state;
  std::vector<double> global_sq;
};

/// Serial reference over n ranks: every rank's gradient `local_grad(r, k)` (already times the
/// loss scale) computed here, summed in rank order, fed to the two-batch form.
template <class Grad>
run_result serial_reference(int n, const gradapt::noise_batch& batch, int steps, Grad&& local_grad) {
  const gradapt::host backend{.threads = 1};
  gradapt::gradient_noise_scale serial({.smoothing = 0.9});
  run_result out;
  for (int k = 0; k < steps; ++k) {
    std::vector<double> sum = local_grad(0, k);
    double local_sq_sum =
        backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(std::as_const(sum)));
    for (int r = 1; r < n; ++r) {
      const auto g = local_grad(r, k);
      local_sq_sum += backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(g));
      for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
    for (double& v : sum) v /= n;
    const double global_sq =
        backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(std::as_const(sum)));
    const bool accepted =
        serial.update(local_sq_sum / n, batch.local(), global_sq, n * batch.local(), batch.loss_scale);
    RANK_REQUIRE(accepted);
    out.global_sq.push_back(global_sq);
  }
  out.state = serial.state();
  return out;
}

/// Data-parallel form on this rank: its gradient, one gradient allreduce, one scalar allreduce
/// inside update; every update is accepted.
template <class Comm, class Grad>
run_result data_parallel(Comm& comm, const gradapt::noise_batch& batch, int steps, Grad&& local_grad) {
  const gradapt::host backend{.threads = 1};
  const int n = comm.size();
  gradapt::gradient_noise_scale gns({.smoothing = 0.9});
  run_result out;
  for (int k = 0; k < steps; ++k) {
    auto g = local_grad(comm.rank(), k);
    const double local_sq =
        backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(std::as_const(g)));
    comm.allreduce(gradapt::host_view(g), gradapt::reduce_op::sum);
    for (double& v : g) v /= n;
    const double global_sq =
        backend.reduce(gradapt::reduction::sum_squares, gradapt::host_view(std::as_const(g)));
    // The assertion lock must not be held across a collective: evaluate first, then assert.
    const bool accepted = gns.update(comm, local_sq, global_sq, batch);
    RANK_REQUIRE(accepted);
    out.global_sq.push_back(global_sq);
  }
  out.state = gns.state();
  return out;
}

/// The data-parallel run equals the serial reference bit for bit, step by step.
inline void require_same(const run_result& dp, const run_result& serial) {
  RANK_REQUIRE(exact::same_bits(dp.global_sq, serial.global_sq));
  RANK_REQUIRE(same_state(dp.state, serial.state));
}

/// A world of one rank has no second batch size: the data-parallel form throws and names the
/// single-replica form.
template <class Comm>
void one_rank_throws(Comm& comm, const gradapt::noise_batch& batch) {
  gradapt::gradient_noise_scale gns;
  RANK_REQUIRE_THROWS_WITH(
      gns.update(comm, 1.0, 1.0, batch),
      Catch::Matchers::Contains("world of 1 rank") && Catch::Matchers::Contains("update_single_replica"));
}

}  // namespace noise_scale_scenario

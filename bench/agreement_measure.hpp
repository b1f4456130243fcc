#pragma once
// The measurement of bench_agreement (threads) and bench_agreement_mpi (MPI), written once over
// the communicator: on every rank a replica of the GPT-2-small-shaped list (101.2M parameters,
// gpt2_shapes.hpp) stepped by train::data_parallel_step with AdamW; rank 0 times, between
// barriers, 5 whole steps, 400 per-step agreements alone (gradapt::agree_values over the
// step's 7 values) and 5 replica checks alone (the backend's sum over the parameters and its
// agreement). share = (agree + replica / replica_check_interval) / step.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace gradapt_bench {

/// Rank 0's timings (seconds) and the step's replica check interval.
struct agreement_samples {
  std::vector<double> step, agree, replica;
  std::uint64_t interval = 0;

  static double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
  /// The medians and the agreement's share of a step.
  struct summary {
    double step = 0, agree = 0, replica = 0, share = 0;
    std::uint64_t interval = 0;
    void print(int ranks, const char* comm) const {
      std::printf(
          "%s, %d ranks: step %.1f ms, agreement %.1f us, replica check %.1f ms every %llu steps: "
          "share %.4f%%\n",
          comm, ranks, 1e3 * step, 1e6 * agree, 1e3 * replica, static_cast<unsigned long long>(interval),
          100.0 * share);
    }
  };
  summary result() const {
    summary s{median(step), median(agree), median(replica), 0, interval};
    s.share = s.step > 0 ? (s.agree + s.replica / static_cast<double>(interval)) / s.step : 0;
    return s;
  }
};

/// Runs the measurement on this rank of `comm` (every rank calls it; rank 0 records).
template <class Comm>
void measure_agreement(Comm& comm, agreement_samples& out) {
  using clock_type = std::chrono::steady_clock;
  constexpr int steps = 5, agrees = 400, replicas = 5;
  gradapt_bench::gpt2_bucket r(/*flag_no_decay=*/true, /*with_triad=*/false);
  const gradapt::host backend{.threads = 1};
  auto step = gradapt::train::make_data_parallel_step(
      comm, backend, r.params, gradapt::adamw({.lr = 1e-4, .weight_decay = 0.01}), {.lr = 1e-4});
  out.interval = step.replica_check_interval();
  const auto timed = [&](std::vector<double>& into, auto&& body) {
    comm.barrier();
    const auto t0 = clock_type::now();
    body();
    comm.barrier();
    if (comm.rank() == 0) into.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  };
  for (int s = 0; s < steps; ++s) timed(out.step, [&] { step.step(); });
  const gradapt::agreed_value values[7] = {{"step", 1.0},    {"lr", 1e-4},    {"local_batch", 1.0},
                                           {"accum", 1.0},   {"period", 0.0}, {"scale", 1.0},
                                           {"loss", 65536.0}};
  for (int a = 0; a < agrees; ++a)
    timed(out.agree,
          [&] { gradapt::agree_values(comm, "bench", std::span<const gradapt::agreed_value>(values)); });
  for (int k = 0; k < replicas; ++k)
    timed(out.replica, [&] {
      const double sum = backend.reduce(gradapt::reduction::sum, r.params.values(), std::span<double>());
      gradapt::agree_values(comm, "bench replica", {{"sum", sum}});
    });
}

}  // namespace gradapt_bench

// What the cross-rank agreement costs a data-parallel step: four in-process ranks
// (comm::threads, one host thread each), each with a replica of the GPT-2-small-shaped list
// (101.2M parameters, gpt2_shapes.hpp), stepping train::data_parallel_step with AdamW. In the
// same run it times, on the same world:
//
//   step     one whole data_parallel_step::step (per-step agreement, gradient allreduce,
//            AdamW, and the replica check when due)
//   agree    the per-step agreement alone: gradapt::agree_values over the step's values, the
//            one collective the step adds to check that the ranks agree
//   replica  the replica check alone (the backend's sum over the parameters plus its
//            agreement), which the step runs once every replica_check_interval() steps
//
// and reports the medians and the agreement's share of a step:
//   share = (agree + replica / interval) / step.
//
//   bench_agreement [--benchmark_filter=...]    counters: step_ms, agree_us, replica_ms, share
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void BM_agreement_share(benchmark::State& st) {
  const int ranks = static_cast<int>(st.range(0));
  constexpr int steps = 5, agrees = 400, replicas = 5;
  std::vector<double> step_s, agree_s, replica_s;
  std::uint64_t interval = 0;
  for (auto _ : st) {
    gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& comm) {
      gradapt_bench::gpt2_bucket r(/*flag_no_decay=*/true, /*with_triad=*/false);
      const gradapt::host backend{.threads = 1};
      auto step = gradapt::train::make_data_parallel_step(
          comm, backend, r.params, gradapt::adamw({.lr = 1e-4, .weight_decay = 0.01}), {.lr = 1e-4});
      interval = step.replica_check_interval();
      const auto timed = [&](std::vector<double>& out, auto&& body) {
        comm.barrier();
        const auto t0 = clock_type::now();
        body();
        comm.barrier();
        if (comm.rank() == 0) out.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
      };
      for (int s = 0; s < steps; ++s) timed(step_s, [&] { step.step(); });
      const gradapt::agreed_value values[7] = {{"step", 1.0},    {"lr", 1e-4},    {"local_batch", 1.0},
                                               {"accum", 1.0},   {"period", 0.0}, {"scale", 1.0},
                                               {"loss", 65536.0}};
      for (int a = 0; a < agrees; ++a)
        timed(agree_s,
              [&] { gradapt::agree_values(comm, "bench", std::span<const gradapt::agreed_value>(values)); });
      for (int k = 0; k < replicas; ++k)
        timed(replica_s, [&] {
          const double sum = backend.reduce(gradapt::reduction::sum, r.params.values(), std::span<double>());
          gradapt::agree_values(comm, "bench replica", {{"sum", sum}});
        });
    });
  }
  const double step = median(step_s), agree = median(agree_s), rep = median(replica_s);
  const double share = (agree + rep / static_cast<double>(interval)) / step;
  st.counters["step_ms"] = 1e3 * step;
  st.counters["agree_us"] = 1e6 * agree;
  st.counters["replica_ms"] = 1e3 * rep;
  st.counters["share"] = share;
  std::printf(
      "ranks %d: step %.1f ms, agreement %.1f us, replica check %.1f ms every %llu steps: share %.4f%%\n",
      ranks, 1e3 * step, 1e6 * agree, 1e3 * rep, static_cast<unsigned long long>(interval), 100.0 * share);
}

}  // namespace

BENCHMARK(BM_agreement_share)->Arg(4)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();

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
//
// The same measurement over comm::mpi is bench_agreement_mpi (agreement_measure.hpp).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "agreement_measure.hpp"
#include "gradapt/comm/threads.hpp"

namespace {

void BM_agreement_share(benchmark::State& st) {
  const int ranks = static_cast<int>(st.range(0));
  gradapt_bench::agreement_samples samples;
  for (auto _ : st)
    gradapt::comm::run_threads(
        ranks, [&](gradapt::comm::threads& comm) { gradapt_bench::measure_agreement(comm, samples); });
  const auto r = samples.result();
  st.counters["step_ms"] = 1e3 * r.step;
  st.counters["agree_us"] = 1e6 * r.agree;
  st.counters["replica_ms"] = 1e3 * r.replica;
  st.counters["share"] = r.share;
  r.print(ranks, "comm::threads");
}

}  // namespace

BENCHMARK(BM_agreement_share)->Arg(4)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();

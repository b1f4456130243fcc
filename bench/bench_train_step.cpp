// The composed step (train::data_parallel_step) with ZeRO stage 2, LAMB and dynamic loss
// scaling on the GPT-2-small list (148 tensors, 101.2M fp32 parameters, bench/gpt2_shapes.hpp)
// on N comm::threads ranks, against the same work called piece by piece, in the same round:
//
//   composed_zero2/N/T  each rank marks its gradients ready in the backward's order
//                       (`step.mark_ready(t)`, last tensor first) and calls `step.step()`; the
//                       pieces: per gradient the scaler's fused unscale and count
//                       (`unscale_count_nonfinite`) and `sharded_optimizer::mark_ready` (its
//                       reduce-scatter buckets), then `loss_scaler::decide` and
//                       `sharded_optimizer::step`, on the same parameters with a state of their
//                       own. Each rank holds its own parameters and gradients (refilled from one
//                       copy before each timed part, outside the timing) and a host backend of
//                       max(1, T / N) threads; the two variants alternate which runs first.
//                       Counters: vs_pieces = median over rounds of t_composed / t_pieces
//                       (floor 1.10: what the step adds to the pieces: its per-step agreement,
//                       the marks' bookkeeping, the metrics); state_ratio = the largest
//                       `step.state_bytes()` over ranks / (K Psi / N), K = 8 bytes per parameter
//                       for LAMB's fp32 m and v (floor 1.05: ZeRO's per-rank share plus the
//                       partition's 4096-element alignment); the medians of both times.
//
// The ranks share the machine's cores (N = 4 runs 4 threads on a 2-core machine), so the times
// are not those of N machines; the ratio compares the two variants on equal terms.
//
// Compiled like a consumer (plain -O2, no -march, no fast-math).
//
//   OMP_NUM_THREADS=2 bench_train_step [--rounds=5]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "paired.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const gradapt::lamb& the_lamb() {
  static const gradapt::lamb opt({.lr = 1e-4, .weight_decay = 0.01});
  return opt;
}

gradapt::loss_scaler_options scaler_options() { return {.init_scale = 1.0, .growth_interval = 1 << 30}; }

/// The shapes and one copy of the initial parameters and gradients.
gradapt_bench::gpt2_bucket& the_model() {
  static gradapt_bench::gpt2_bucket m(true, false);
  return m;
}

/// One rank's parameters and gradients (its own copies) as a parameter list.
struct rank_model {
  std::vector<float> p, g;
  gradapt::param_list<float> params;
  explicit rank_model(const gradapt_bench::gpt2_bucket& m) : p(m.p), g(m.g) {
    std::size_t off = 0;
    for (std::size_t t = 0; t < m.params.size(); ++t) {
      const auto& e = m.params[t];
      params.add(e.name, gradapt::tensor_view<float>(p.data() + off, e.value.shape()),
                 gradapt::tensor_view<float>(g.data() + off, e.value.shape()), e.flags, e.group);
      off += e.value.size();
    }
  }
  void refill(const gradapt_bench::gpt2_bucket& m) { std::copy(m.g.begin(), m.g.end(), g.begin()); }
};

void composed_zero2(benchmark::State& st) {
  const int world = static_cast<int>(st.range(0)), threads = static_cast<int>(st.range(1));
  const gradapt::host b{.threads = std::max(1, threads / world)};
  auto& m = the_model();
  auto comms = gradapt::comm::threads::create(world);
  std::vector<std::unique_ptr<rank_model>> ms;
  for (int r = 0; r < world; ++r) ms.push_back(std::make_unique<rank_model>(m));
  const auto on_ranks = [&](const std::function<void(int)>& f) {
    std::vector<std::thread> pool;
    for (int r = 0; r < world; ++r) pool.emplace_back(f, r);
    for (auto& t : pool) t.join();
  };
  using step_type = decltype(gradapt::train::make_data_parallel_step(
      comms[0], b, ms[0]->params, the_lamb(), {}, gradapt::loss_scaler(scaler_options()),
      gradapt::train::zero_state<2>{}));
  const gradapt::shard::sharded_optimizer<gradapt::lamb> pieces_opt(the_lamb(), {});
  using pieces_state = decltype(pieces_opt.init(comms[0], b, ms[0]->params));
  std::vector<std::optional<step_type>> steps(static_cast<std::size_t>(world));
  std::vector<std::optional<pieces_state>> states(static_cast<std::size_t>(world));
  std::vector<gradapt::loss_scaler> scalers(static_cast<std::size_t>(world),
                                            gradapt::loss_scaler(scaler_options()));
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(world));
  const auto composed = [&](int r) {
    auto& step = *steps[static_cast<std::size_t>(r)];
    for (std::size_t t = ms[static_cast<std::size_t>(r)]->params.size(); t-- > 0;) step.mark_ready(t);
    step.step();
  };
  const auto pieces = [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    auto& params = ms[i]->params;
    auto& sc = scalers[i];
    double nonfinite = 0.0;
    for (std::size_t t = params.size(); t-- > 0;) {
      nonfinite += gradapt::unscale_count_nonfinite(b, params.grads().subspan(t, 1), sc.inv_scale());
      pieces_opt.mark_ready(comms[i], b, params, *states[i], t);
    }
    if (sc.decide(comms[i], nonfinite, std::string()))
      pieces_opt.step(comms[i], b, params, *states[i], {.lr = 1e-4});
  };
  on_ranks([&](int r) {  // build both (collective), then one warm-up step each (first touch)
    const auto i = static_cast<std::size_t>(r);
    steps[i].emplace(gradapt::train::make_data_parallel_step(
        comms[i], b, ms[i]->params, the_lamb(), {.lr = 1e-4}, gradapt::loss_scaler(scaler_options()),
        gradapt::train::zero_state<2>{}));
    states[i].emplace(pieces_opt.init(comms[i], b, ms[i]->params));
    composed(r);
    ms[i]->refill(m);
    pieces(r);
    bytes[i] = steps[i]->state_bytes();
  });
  std::vector<double> ratio, t_composed, t_pieces;
  bool composed_first = true;
  for (auto _ : st) {
    double tc = 0.0, tp = 0.0;
    for (int k = 0; k < 2; ++k) {
      const bool run_composed = (k == 0) == composed_first;
      on_ranks([&](int r) { ms[static_cast<std::size_t>(r)]->refill(m); });
      const auto a = clock_type::now();
      on_ranks(run_composed ? std::function<void(int)>(composed) : std::function<void(int)>(pieces));
      (run_composed ? tc : tp) = seconds(a, clock_type::now());
    }
    composed_first = !composed_first;
    t_composed.push_back(tc);
    t_pieces.push_back(tp);
    ratio.push_back(tc / tp);
    st.SetIterationTime(tc);
  }
  const double share = 8.0 * static_cast<double>(m.n) / world;  // K Psi / N, K = 8 (fp32 m, v)
  st.counters["vs_pieces"] = gradapt_bench::median_of(ratio);
  st.counters["state_ratio"] = static_cast<double>(*std::max_element(bytes.begin(), bytes.end())) / share;
  st.counters["composed_ms"] = 1e3 * gradapt_bench::median_of(t_composed);
  st.counters["pieces_ms"] = 1e3 * gradapt_bench::median_of(t_pieces);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = gradapt_bench::take_rounds(argc, argv, 5);
  benchmark::Initialize(&argc, argv);
  for (const int n : {2, 4})
    benchmark::RegisterBenchmark("composed_zero2", composed_zero2)
        ->Args({n, 2})
        ->ArgNames({"N", "threads"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(rounds);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

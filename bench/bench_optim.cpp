// Optimizer steps on a 100M-parameter, transformer-shaped list (floors: SGD-momentum and AdamW >= 0.85 of
// triad, LAMB and LARS >= 0.65), and SGD-momentum and AdamW without the value checks
// (`*_unchecked`), whose ratio to the checked rows is the checks' cost.
//
// The list is GPT-2-small shaped (d = 768, 12 layers, a 20000-token embedding and 1024
// positions: 148 tensors, 101.2M fp32 parameters) laid out in one flat bucket, as frameworks
// keep them. Each round times, back to back on the same buffers:
//
//   triad   a = b + s c over 3 arrays of the same element count (12 bytes per element)
//   roof    a plain loop with the kernel's own streams (SGD/LARS: p += g; b += g;
//           AdamW/LAMB: p += g; m += g; v += g): what the memory system allows for them
//   kernel  one optimizer step through gradapt (host backend, the given thread count)
//
// and reports medians over rounds of the effective bandwidth, i.e. the fewest bytes the step
// must move (SGD with momentum and LARS: read p, g, b and write p, b = 20 B per parameter;
// AdamW and LAMB: read p, g, m, v and write p, m, v = 28 B) over the step's time, and its
// ratio to the same round's triad and roof. LAMB and LARS need a second pass (the trust ratio
// needs whole-tensor norms before any element is written), so they move more than the minimum.
//
// Issue 5's floors, at 2 threads: SGD-momentum and AdamW >= 0.85 of triad; LAMB and LARS
// >= 0.65. Compiled like a consumer (plain -O2, no -march, no fast-math).
//
// Google Benchmark: one benchmark per step with argument = threads (1 and 2), each iteration a
// paired round (bench/paired.hpp), 9 iterations unless --rounds=N. A table of the medians with
// the floors follows the console output.
//
//   bench_optim [--rounds=9] [--benchmark_filter=/2]
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "paired.hpp"

namespace {

/// The bucket plus the state streams of the plain-roof loops.
struct model : gradapt_bench::gpt2_bucket {
  std::vector<float> r1, r2;
  model() : gpt2_bucket(true) { r1.assign(n, 0.0f), r2.assign(n, 0.0f); }
};

void triad(model& m, int t) { m.triad(t); }

/// The kernel's own streams, as plain loops (restrict pointers, omp simd): 2 or 3 state
/// streams besides p (read-write) and g (read).
void roof(model& m, int t, int state_streams) {
  float* __restrict p = m.p.data();
  const float* __restrict g = m.g.data();
  float* __restrict a = m.r1.data();
  float* __restrict b = m.r2.data();
  const std::size_t n = m.n;
  if (state_streams == 1) {
#pragma omp parallel for simd schedule(static) num_threads(t)
    for (std::size_t i = 0; i < n; ++i) {
      p[i] += 1e-7f * g[i];
      a[i] += g[i];
    }
  } else {
#pragma omp parallel for simd schedule(static) num_threads(t)
    for (std::size_t i = 0; i < n; ++i) {
      p[i] += 1e-7f * g[i];
      a[i] += g[i];
      b[i] += g[i] * g[i];
    }
  }
}

model& the_model() {
  static model m;
  return m;
}

/// One optimizer step per paired round; the state is created (and warmed up by one step) per
/// benchmark run. `check_interval` 0 turns the state's value checks off (the per-step check of
/// the values the final pass wrote, and the interval check of the state buffers).
template <class Opt>
void run_step(benchmark::State& st, const Opt& opt, double bytes_per_param, int state_streams,
              std::uint64_t check_interval = 100) {
  model& m = the_model();
  const int threads = static_cast<int>(st.range(0));
  gradapt::host backend{.threads = threads};
  auto state = opt.init(backend, m.params);
  state.set_check_interval(check_interval);
  opt.step(backend, m.params, state, {.lr = 1e-4});  // warm-up (first touch of the state)
  gradapt_bench::paired_rounds(
      st, {static_cast<double>(m.n), bytes_per_param, 8.0 + 8.0 * state_streams + 4.0},
      [&] { triad(m, threads); }, [&] { roof(m, threads, state_streams); },
      [&] { opt.step(backend, m.params, state, {.lr = 1e-4}); });
}

void sgd_momentum(benchmark::State& st) { run_step(st, gradapt::sgd({.lr = 1e-4, .momentum = 0.9}), 20, 1); }
void adamw(benchmark::State& st) { run_step(st, gradapt::adamw({.lr = 1e-4, .weight_decay = 0.01}), 28, 2); }
void lamb(benchmark::State& st) { run_step(st, gradapt::lamb({.lr = 1e-4, .weight_decay = 0.01}), 28, 2); }
void lars(benchmark::State& st) { run_step(st, gradapt::lars({.lr = 1e-4, .weight_decay = 0.01}), 20, 1); }
// The same steps without the value checks: the checks' cost is the ratio of the two rows'
// "vs triad" (each paired with its own triad rounds in the same run).
void sgd_momentum_unchecked(benchmark::State& st) {
  run_step(st, gradapt::sgd({.lr = 1e-4, .momentum = 0.9}), 20, 1, 0);
}
void adamw_unchecked(benchmark::State& st) {
  run_step(st, gradapt::adamw({.lr = 1e-4, .weight_decay = 0.01}), 28, 2, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = gradapt_bench::take_rounds(argc, argv, 9);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const model& m = the_model();
  std::printf("%zu tensors, %.1fM fp32 parameters (%.2f GB per stream); %d paired rounds, medians\n",
              m.params.size(), static_cast<double>(m.n) * 1e-6, static_cast<double>(m.n) * 4e-9, rounds);
  for (auto [name, fn] :
       {std::pair{"sgd_momentum", &sgd_momentum}, std::pair{"adamw", &adamw}, std::pair{"lamb", &lamb},
        std::pair{"lars", &lars}, std::pair{"sgd_momentum_unchecked", &sgd_momentum_unchecked},
        std::pair{"adamw_unchecked", &adamw_unchecked}})
    gradapt_bench::register_paired(name, fn, rounds);
  gradapt_bench::table_reporter rep;
  rep.floors = {{"sgd_momentum", 0.85}, {"adamw", 0.85}, {"lamb", 0.65}, {"lars", 0.65}};
  benchmark::RunSpecifiedBenchmarks(&rep);
  rep.print_table(
      "eff GB/s: fewest bytes the step must move (SGD/LARS 20 B, AdamW/LAMB 28 B per parameter) / step "
      "time.\n"
      "floor (2 threads): SGD-momentum and AdamW >= 0.85 of triad, LAMB and LARS >= 0.65.");
  benchmark::Shutdown();
  return 0;
}

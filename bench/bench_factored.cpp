// Adafactor and SM3 steps on a 100M-parameter, transformer-shaped list (issue 5's floor for
// Adafactor and SM3: effective bandwidth >= 0.60 of the same-run triad at 2 threads).
//
// The list is bench_optim's GPT-2-small shape (d = 768, 12 layers, a 20000-token embedding
// and 1024 positions: 148 tensors, 101.2M fp32 parameters) in one flat bucket. Each round
// times, back to back on the same buffers:
//
//   triad   a = b + s c over 3 arrays of the same element count (12 bytes per element)
//   roof    p += s g: a plain loop with the step's own streams (read p, g; write p)
//   kernel  one optimizer step through gradapt (host backend, the given thread count)
//
// and reports medians over rounds of the effective bandwidth: the fewest bytes the step must
// move over the step's time. Adafactor without momentum and SM3 without momentum must read p
// and g and write p (12 B per parameter; their statistics are a few MB); SM3 with momentum
// also reads and writes m (20 B). SM3's host step moves just that (one fused pass per tensor:
// the covers' maxima and the update from one read of g). Adafactor moves more than that: per factored tensor
// it reads g three times (statistics, clipping sum, update) and p twice (parameter scale, update); tensors
// are processed one at a time so that the repeated reads of a tensor of a few MB hit the last-level cache.
// The adafactor_chain row is the same algorithm (optax defaults, lr 1e-3, as the adafactor row) composed
// from transforms (gradapt::adafactor_chain): tensor by tensor too, but one pass per barrier (statistics,
// clipping sum, Σp² for the parameter scale, update), so per factored tensor it reads g four times (once
// more than the class) and p twice; it has no floor and is read next to the adafactor row of the same run.
// The sm3_chain row (gradapt::sm3_chain, no momentum) runs SM3's covers through the generic backend
// operations (a max-reduction pass over g, then the update pass over p and g) instead of the class's
// one fused host pass; compare it with the sm3 row.
// Compiled like a consumer (plain -O2, no -march, no fast-math).
//
// Google Benchmark: one benchmark per step with argument = threads (1 and 2), each iteration a
// paired round (bench/paired.hpp), 9 iterations unless --rounds=N; a table with the floors
// follows the console output.
//
//   bench_factored [--rounds=9] [--benchmark_filter=/2]
#include <cstdio>
#include <string>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/sm3.hpp"
#include "paired.hpp"

namespace {

struct model : gradapt_bench::gpt2_bucket {
  model() : gpt2_bucket(false) {}
};

void triad(model& m, int t) { m.triad(t); }

void roof(model& m, int t) {
  float* __restrict p = m.p.data();
  const float* __restrict g = m.g.data();
  const std::size_t n = m.n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) p[i] += 1e-9f * g[i];
}

model& the_model() {
  static model m;
  return m;
}

/// One optimizer step per paired round; the state is created (and warmed up by one step) per
/// benchmark run.
template <class Opt>
void run_step(benchmark::State& st, const Opt& opt, double bytes_per_param) {
  model& m = the_model();
  const int threads = static_cast<int>(st.range(0));
  gradapt::host backend{.threads = threads};
  auto state = opt.init(backend, m.params);
  opt.step(backend, m.params, state);  // warm-up (first touch of the state)
  gradapt_bench::paired_rounds(
      st, {static_cast<double>(m.n), bytes_per_param, 12.0}, [&] { triad(m, threads); },
      [&] { roof(m, threads); }, [&] { opt.step(backend, m.params, state); });
}

void adafactor(benchmark::State& st) { run_step(st, gradapt::adafactor({.lr = 1e-3}), 12); }
void adafactor_chain(benchmark::State& st) { run_step(st, gradapt::adafactor_chain({.lr = 1e-3}), 12); }
void adafactor_torch(benchmark::State& st) {
  run_step(st, gradapt::adafactor(gradapt::torch_adafactor_options(1e-3)), 12);
}
void sm3_momentum(benchmark::State& st) { run_step(st, gradapt::sm3({.lr = 1e-3}), 20); }
void sm3(benchmark::State& st) { run_step(st, gradapt::sm3({.lr = 1e-3, .momentum = 0.0}), 12); }
void sm3_chain(benchmark::State& st) { run_step(st, gradapt::sm3_chain({.lr = 1e-3, .momentum = 0.0}), 12); }

}  // namespace

int main(int argc, char** argv) {
  const int rounds = gradapt_bench::take_rounds(argc, argv, 9);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const model& m = the_model();
  std::printf("%zu tensors, %.1fM fp32 parameters (%.2f GB per stream); %d paired rounds, medians\n",
              m.params.size(), static_cast<double>(m.n) * 1e-6, static_cast<double>(m.n) * 4e-9, rounds);
  {
    gradapt::host b{};
    const auto st = gradapt::adafactor({.lr = 1e-3}).init(b, m.params);
    std::printf("adafactor state: %zu elements (%.2f MB) for %zu parameters; workspace %.2f MB\n",
                st.state_elements(), static_cast<double>(st.state_elements()) * 4e-6, m.n,
                static_cast<double>(st.workspace_bytes()) * 1e-6);
    const auto sc = gradapt::adafactor_chain({.lr = 1e-3}).init(b, m.params);
    std::printf("adafactor_chain state: %zu elements (%.2f MB)\n", sc.state_elements(),
                static_cast<double>(sc.state_elements()) * 4e-6);
  }
  for (auto [name, fn] :
       {std::pair{"adafactor", &adafactor}, std::pair{"adafactor_chain", &adafactor_chain},
        std::pair{"adafactor_torch", &adafactor_torch}, std::pair{"sm3_momentum", &sm3_momentum},
        std::pair{"sm3", &sm3}, std::pair{"sm3_chain", &sm3_chain}})
    gradapt_bench::register_paired(name, fn, rounds);
  gradapt_bench::table_reporter rep;
  // adafactor_chain and sm3_chain have no floor (their floor column prints "-").
  rep.floors = {{"adafactor", 0.60}, {"adafactor_torch", 0.60}, {"sm3_momentum", 0.60}, {"sm3", 0.60}};
  benchmark::RunSpecifiedBenchmarks(&rep);
  rep.print_table(
      "eff GB/s: fewest bytes the step must move (Adafactor and SM3 without momentum 12 B, SM3 with momentum "
      "20 B per parameter) / step time; the roof is p += s g (12 B).\n"
      "floor (issue 5, 2 threads): Adafactor >= 0.60 of triad (SM3 held to the same); adafactor_chain has "
      "none (compare it with the adafactor row).");
  benchmark::Shutdown();
  return 0;
}

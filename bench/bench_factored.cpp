// Adafactor and SM3 steps on a 100M-parameter, transformer-shaped list (floor for Adafactor
// and SM3: effective bandwidth >= 0.60 of the same-run triad at 2 threads).
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
// also reads and writes m (20 B). Both are gradapt::chain presets run tensor by tensor.
// SM3's host step moves just that: a tensor run as a one-thread task takes one pass
// (host::apply_factored_max: the covers' maxima and the update from one read of g).
// Adafactor moves more: per factored tensor it reads g three times (statistics, clipping sum,
// update) and p twice (Σp² in the statistics pass, update); the passes of a tensor run back to
// back so that a tensor of a few MB is re-read from the last-level cache. The stats_pass row
// times Adafactor's statistics pass alone (host::reduce_factored_sumsq) on the largest tensor
// with all threads on it, against a plain read of the same g and p (its roof): the path a
// tensor larger than 1/T of a list takes.
// Compiled like a consumer (plain -O2, no -march, no fast-math).
//
// Google Benchmark: one benchmark per step with argument = threads (1 and 2), each iteration a
// paired round (bench/paired.hpp), 9 iterations unless --rounds=N; a table with the floors
// follows the console output.
//
//   bench_factored [--rounds=9] [--benchmark_filter=/2]
#include <array>
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
void adafactor_torch(benchmark::State& st) {
  run_step(st, gradapt::adafactor(gradapt::torch_adafactor_options(1e-3)), 12);
}
void sm3_momentum(benchmark::State& st) { run_step(st, gradapt::sm3({.lr = 1e-3}), 20); }
void sm3(benchmark::State& st) { run_step(st, gradapt::sm3({.lr = 1e-3, .momentum = 0.0}), 12); }

/// Adafactor's statistics pass alone on the list's largest tensor (the [20000, 768] token
/// embedding) with every thread on it, the way the optimizers run a tensor larger than 1/T of
/// the list: host::reduce_factored_sumsq (row and column sums of g² + eps1, and Σp² of the
/// same lines). Its roof is a plain loop over the same two arrays (Σ g² + p² in one OpenMP
/// simd reduction: 8 B per element, the pass's own streams); the triad runs over that tensor's
/// element count.
void stats_pass(benchmark::State& st) {
  model& m = the_model();
  const int threads = static_cast<int>(st.range(0));
  gradapt::host b{.threads = threads};
  std::size_t k = 0;
  for (std::size_t t = 1; t < m.params.size(); ++t)
    if (m.params[t].value.size() > m.params[k].value.size()) k = t;
  const auto g = gradapt::tensor_view<const float>(m.params[k].grad.flat());
  const auto p = gradapt::tensor_view<const float>(m.params[k].value.flat());
  const auto shape = m.params[k].value.shape();
  const std::int64_t rows = shape[0], cols = shape[1];
  const std::size_t e = g.size();
  std::vector<double> sy(static_cast<std::size_t>(rows)), sx(static_cast<std::size_t>(cols)), sl(sy.size());
  const std::array<std::int64_t, 5> d{1, rows, 1, cols, 1};
  const gradapt::detail::adafactor_k::square_plus<float> stats{1e-30f};
  double sink = 0.0;
  gradapt_bench::paired_rounds(
      st, {static_cast<double>(e), 8.0, 8.0},
      [&] {
        float* __restrict a = m.ta.data();
        const float* __restrict x = m.tb.data();
        const float* __restrict y = m.tc.data();
#pragma omp parallel for simd schedule(static) num_threads(threads)
        for (std::size_t i = 0; i < e; ++i) a[i] = x[i] + 0.5f * y[i];
      },
      [&] {
        const float* __restrict x = g.data();
        const float* __restrict y = p.data();
        double acc = 0.0;
#pragma omp parallel for simd reduction(+ : acc) schedule(static) num_threads(threads)
        for (std::size_t i = 0; i < e; ++i)
          acc += static_cast<double>(x[i]) * x[i] + static_cast<double>(y[i]) * y[i];
        sink += acc;
      },
      [&] {
        sink += b.reduce_factored_sumsq(stats, d, gradapt::tensor_view<const float>(),
                                        gradapt::tensor_view<const float>(), g, gradapt::host_view(sy),
                                        gradapt::host_view(sx), p, gradapt::host_view(sl));
      });
  benchmark::DoNotOptimize(sink);
}

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
  }
  for (auto [name, fn] : {std::pair{"adafactor", &adafactor}, std::pair{"adafactor_torch", &adafactor_torch},
                          std::pair{"sm3_momentum", &sm3_momentum}, std::pair{"sm3", &sm3},
                          std::pair{"stats_pass", &stats_pass}})
    gradapt_bench::register_paired(name, fn, rounds);
  gradapt_bench::table_reporter rep;
  rep.floors = {{"adafactor", 0.60}, {"adafactor_torch", 0.60}, {"sm3_momentum", 0.60}, {"sm3", 0.60}};
  benchmark::RunSpecifiedBenchmarks(&rep);
  rep.print_table(
      "eff GB/s: fewest bytes the step must move (Adafactor and SM3 without momentum 12 B, SM3 with momentum "
      "20 B per parameter) / step time; the roof is p += s g (12 B).\n"
      "floor (2 threads): Adafactor >= 0.60 of triad (SM3 held to the same).\n"
      "stats_pass: Adafactor's statistics pass alone on the largest tensor, all threads on it (8 B per "
      "element: "
      "g and p read); its roof is a plain read of the same two arrays.");
  benchmark::Shutdown();
  return 0;
}

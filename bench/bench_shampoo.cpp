// gradapt::shampoo on a 25.2M-parameter transformer-shaped list (8 layers of d = 512: four
// 512 × 512 attention matrices, 512 × 2048 and 2048 × 512 MLP matrices, two 512 norm vectors;
// max_preconditioner_dim 1024, so 64 blocks of 512 × 512, 512 × 1024 and 1024 × 512), float,
// graft AdaGrad, host backend and host_lapack, at the consumer's -O2. Run it with one BLAS
// thread, so that a step runs on one core and the worker thread's roots on the other:
//
//   OPENBLAS_NUM_THREADS=1 bench_shampoo
//
//   step_throughput   steps that update the statistics (SYRK) and precondition (two GEMM-shaped
//                     mode products per block) with roots computed once beforehand and never
//                     again. Counters: gflops = the FLOPs of those products per second (SYRK of
//                     an m × n block: m²n + n²m; products: 2m²n + 2mn²), gemm_gflops = the same
//                     library's 1024 × 1024 GEMM in this run, ratio = gflops / gemm_gflops.
//   async_overhead    the same 24 steps twice: roots switched off (computed once, as above) and
//                     async roots (precondition_frequency = root_staleness = 12, so roots start
//                     at steps 13 and 25 in the worker thread and are installed 12 steps later,
//                     the timed steps 13 to 36 all preconditioned). Counters: the mean step time
//                     of both, ratio = async / off, roots_s = one root computation's time in the
//                     worker (all 64 blocks).
//   distributed_roots/N  N comm::threads ranks compute the roots of the blocks lpt_assign gives
//                     them: the root time of a rank is the thread CPU time of a step that
//                     computes roots minus that of a step that does not (statistics and
//                     products are the same in both); counters: max_rank_s = the largest rank's
//                     root time, and for N > 1 ratio = max_rank_s / the one-rank root time
//                     measured in the same process. CPU time, not wall time: on a machine with
//                     fewer cores than ranks the ranks' wall times include each other's work.
//   family_steps      the same list stepped by Shampoo, SOAP (eigenvalue-corrected, bases from
//                     step 1 never refreshed again) and Muon (spectral descent, aspect-scaled;
//                     the norm vectors by the graft), each timed over the same number of steps
//                     in this run. Counters: shampoo_s, soap_s, muon_s (mean step times),
//                     soap_ratio = soap_s / shampoo_s, muon_gemm_s = Muon's Newton–Schulz FLOPs
//                     (per block and iteration: SYRK k²l, A·A 2k³, B·X 2k²l, k = min side,
//                     l = max side) at gemm_gflops, muon_ratio = muon_s / muon_gemm_s.
//   eigenbasis_refresh SOAP's refresh of all 64 blocks' bases: a step that refreshes minus one
//                     that does not, with eigh and with one QR iteration (warm-started from the
//                     bases of the refresh before; step 1 starts it from the identity).
//                     Counters: eigh_s, qr_s, ratio = qr_s / eigh_s.
#include <benchmark/benchmark.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/shampoo.hpp"

namespace {

using gradapt::host_lapack;
using gradapt::shampoo;
using gradapt::shampoo_options;
using gradapt::tensor_view;

const gradapt::host backend{.threads = 1};
const host_lapack la{};

struct transformer {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> params;
  double flops = 0;  ///< statistics and preconditioning products of one step
  explicit transformer(int layers = 8, std::int64_t d = 512) {
    std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes;
    for (int l = 0; l < layers; ++l) {
      const std::string pre = "layer" + std::to_string(l) + ".";
      for (const char* n : {"q", "k", "v", "o"}) shapes.push_back({pre + n, {d, d}});
      shapes.push_back({pre + "up", {d, 4 * d}});
      shapes.push_back({pre + "down", {4 * d, d}});
      shapes.push_back({pre + "ln1", {d}});
      shapes.push_back({pre + "ln2", {d}});
    }
    p.resize(shapes.size());
    g.resize(shapes.size());
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::size_t n = 1;
      for (auto e : shapes[t].second) n *= static_cast<std::size_t>(e);
      p[t].assign(n, 0.0f);
      g[t].resize(n);
      for (auto& x : g[t]) x = nd(rng);
      params.add(shapes[t].first, tensor_view<float>(p[t].data(), shapes[t].second),
                 tensor_view<float>(g[t].data(), shapes[t].second));
      if (shapes[t].second.size() == 2)
        for (std::int64_t r = 0; r < shapes[t].second[0]; r += 1024)
          for (std::int64_t c = 0; c < shapes[t].second[1]; c += 1024) {
            const double m = double(std::min<std::int64_t>(1024, shapes[t].second[0] - r));
            const double k = double(std::min<std::int64_t>(1024, shapes[t].second[1] - c));
            flops += m * m * k + k * k * m + 2 * m * m * k + 2 * m * k * k;
          }
    }
  }
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& x : p) n += x.size();
    return n;
  }
};

shampoo_options options() {
  shampoo_options o;
  o.lr = 1e-4;
  o.max_preconditioner_dim = 1024;
  o.graft = gradapt::shampoo_graft::adagrad;
  return o;
}

double gemm_gflops() {
  const std::int64_t n = 1024;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  const auto run = [&] {
    la.gemm(gradapt::transpose::none, gradapt::transpose::none, 1.0,
            tensor_view<const float>(a.data(), {n, n}), tensor_view<const float>(b.data(), {n, n}), 0.0,
            tensor_view<float>(c.data(), {n, n}));
  };
  run();
  const auto t0 = std::chrono::steady_clock::now();
  const int reps = 10;
  for (int i = 0; i < reps; ++i) run();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(c.data());
  return 2.0 * double(n) * double(n) * double(n) * reps / s / 1e9;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void step_throughput(benchmark::State& state) {
  transformer m;
  auto o = options();
  o.precondition_frequency = 1000000;  // roots at step 1 only
  const shampoo opt(o);
  auto st = opt.init(backend, m.params);
  opt.step(backend, m.params, st);
  const double ref = gemm_gflops();
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    opt.step(backend, m.params, st);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double gf = m.flops * double(state.iterations()) / seconds / 1e9;
  state.counters["params_M"] = double(m.size()) / 1e6;
  state.counters["gflops"] = gf;
  state.counters["gemm_gflops"] = ref;
  state.counters["ratio"] = gf / ref;
}

void async_overhead(benchmark::State& state) {
  const int steps = 24;
  double off = 0, on = 0, roots = 0;
  for (auto _ : state) {
    {
      transformer m;
      auto o = options();
      o.precondition_frequency = 1000000;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      const auto r0 = std::chrono::steady_clock::now();
      opt.step(backend, m.params, st);  // computes the roots once
      roots = std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count();
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) opt.step(backend, m.params, st);
      off = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
    }
    {
      transformer m;
      auto o = options();
      o.precondition_frequency = 12;
      o.root_staleness = 12;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      for (int s = 0; s < 12; ++s) opt.step(backend, m.params, st);  // step 13 installs step 1's roots
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) opt.step(backend, m.params, st);
      on = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
    }
  }
  state.counters["off_s"] = off;
  state.counters["async_s"] = on;
  state.counters["ratio"] = on / off;
  state.counters["roots_s"] = roots - off;
}

double one_rank_roots = 0;

void distributed_roots(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<double> root_s(static_cast<std::size_t>(n));
  for (auto _ : state) {
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& c) {
      transformer m;
      auto o = options();
      o.precondition_frequency = 2;  // roots at steps 1, 3, ...
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      opt.step(c, backend, m.params, st);  // step 1: agreement, plan, roots
      const double t0 = thread_cpu_seconds();
      opt.step(c, backend, m.params, st);  // step 2: statistics and products
      const double t1 = thread_cpu_seconds();
      opt.step(c, backend, m.params, st);  // step 3: the same, and roots
      const double t2 = thread_cpu_seconds();
      root_s[static_cast<std::size_t>(c.rank())] = (t2 - t1) - (t1 - t0);
    });
  }
  const double mx = *std::max_element(root_s.begin(), root_s.end());
  if (n == 1) one_rank_roots = mx;
  state.counters["max_rank_s"] = mx;
  if (n > 1 && one_rank_roots > 0) state.counters["ratio"] = mx / one_rank_roots;
}

}  // namespace

/// Mean seconds of `steps` steps of `opt` on m (after one warm-up step).
template <class Opt, class St>
double mean_step(const Opt& opt, transformer& m, St& st, int steps) {
  double seconds = 0;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    opt.step(backend, m.params, st);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return seconds / steps;
}

shampoo_options soap_options() {
  shampoo_options o = options();
  o.preconditioner = gradapt::shampoo_preconditioner::eigenvalue_corrected;
  o.graft = gradapt::shampoo_graft::none;
  o.beta2 = 0.999;
  o.root.epsilon = 1e-8;
  o.root.ridge = gradapt::ridge_kind::absolute;
  return o;
}

void family_steps(benchmark::State& state) {
  transformer m;
  const double ref = gemm_gflops();
  double ns_flops = 0;  // Muon's Newton–Schulz FLOPs per step
  for (std::size_t t = 0; t < m.params.size(); ++t) {
    const auto& v = m.params[t].value;
    if (v.rank() == 2)
      for (std::int64_t r = 0; r < v.dim(0); r += 1024)
        for (std::int64_t c = 0; c < v.dim(1); c += 1024) {
          const double a = double(std::min<std::int64_t>(1024, v.dim(0) - r));
          const double b = double(std::min<std::int64_t>(1024, v.dim(1) - c));
          const double k = std::min(a, b), l = std::max(a, b);
          ns_flops += 5 * (k * k * l + 2 * k * k * k + 2 * k * k * l);
        }
  }
  // The mean time of 3 steps after a first one (whose roots or bases are never refreshed).
  const auto timed = [&](shampoo_options o) {
    o.precondition_frequency = 1000000;
    const shampoo opt(o);
    auto st = opt.init(backend, m.params);
    opt.step(backend, m.params, st);
    return mean_step(opt, m, st, 3);
  };
  double sh = 0, so = 0, mu = 0;
  for (auto _ : state) {
    sh = timed(options());
    so = timed(soap_options());
    auto o = gradapt::spectral_descent_defaults();
    o.lr = 1e-4;
    o.max_preconditioner_dim = 1024;
    o.scale_by_aspect = true;
    o.graft = gradapt::shampoo_graft::adam;
    mu = timed(o);
  }
  const double muon_gemm = ns_flops / (ref * 1e9);
  state.counters["shampoo_s"] = sh;
  state.counters["soap_s"] = so;
  state.counters["soap_ratio"] = so / sh;
  state.counters["muon_s"] = mu;
  state.counters["muon_gemm_s"] = muon_gemm;
  state.counters["muon_ratio"] = mu / muon_gemm;
  state.counters["gemm_gflops"] = ref;
}

void eigenbasis_refresh(benchmark::State& state) {
  transformer m;
  double eigh_s = 0, qr_s = 0;
  for (auto _ : state) {
    for (const auto basis : {gradapt::shampoo_eigenbasis::eigh, gradapt::shampoo_eigenbasis::qr}) {
      auto o = soap_options();
      o.eigenbasis = basis;
      o.precondition_frequency = 2;  // refreshes at steps 1, 3, 5, ...
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      opt.step(backend, m.params, st);  // step 1: the first bases (from the identity for qr)
      double with = 0, without = 0;
      for (int i = 0; i < 2; ++i) {
        without += mean_step(opt, m, st, 1);  // an even step: no refresh
        with += mean_step(opt, m, st, 1);     // an odd step: a refresh
      }
      (basis == gradapt::shampoo_eigenbasis::eigh ? eigh_s : qr_s) = (with - without) / 2;
    }
  }
  state.counters["eigh_s"] = eigh_s;
  state.counters["qr_s"] = qr_s;
  state.counters["ratio"] = qr_s / eigh_s;
}

BENCHMARK(step_throughput)->Unit(benchmark::kSecond)->Iterations(6)->UseRealTime();
BENCHMARK(family_steps)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();
BENCHMARK(eigenbasis_refresh)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();
BENCHMARK(async_overhead)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();
BENCHMARK(distributed_roots)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();

int main(int argc, char** argv) {
  const char* t = std::getenv("OPENBLAS_NUM_THREADS");
  if (!t || std::strcmp(t, "1") != 0)
    std::fprintf(
        stderr,
        "bench_shampoo: set OPENBLAS_NUM_THREADS=1 (one BLAS thread per caller; see the file comment)\n");
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

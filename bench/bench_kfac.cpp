// gradapt::kfac on the linear layers of a small transformer (4 layers of d = 256: q, k, v, o of
// 256 × 256, up 1024 × 256, down 256 × 1024, all with a bias; 24 layers, 3.2M weights), float,
// 512 rows (tokens) of a and g per layer, host_lapack at the consumer's -O2. Run it with one
// BLAS thread per caller:
//
//   OPENBLAS_NUM_THREADS=1 bench_kfac
//
//   products        a step that updates the factors (two SYRKs per layer: aᵀa, gᵀg) and
//                   preconditions (four GEMMs per layer), decompositions computed once
//                   beforehand and not again. Counters: gflops = those FLOPs per second
//                   (SYRK of rows × n: rows·n², counted as the useful half of a GEMM's
//                   2·rows·n²; preconditioning: 2·out²·n + 2·out·n² twice), gemm_gflops = the
//                   same library's 1024 × 1024 GEMM in this run, ratio = gflops / gemm_gflops.
//   amortised       one cycle of 100 steps with factor updates every 10 and decompositions
//                   every 100 (the setting), per step; next to it the SGD-momentum
//                   step on the same weights (gradapt::sgd, host backend, 1 thread) and their
//                   ratio. decompose_s = the decompositions of one inverse update.
//   distributed/N   N comm::threads ranks: the thread CPU time of a step that decomposes minus
//                   that of a step that does not (both update factors), the largest over
//                   ranks; for N > 1 ratio = that / the one-rank time measured first.
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
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"

namespace {

using gradapt::kfac;
using gradapt::kfac_grad;
using gradapt::kfac_layer;
using gradapt::tensor_view;

const gradapt::host_lapack la{};
constexpr std::int64_t rows = 512;

struct model {
  std::vector<kfac_layer> layers;
  std::vector<std::vector<float>> a, g, w, b, gw, gb, gw0, gb0;
  std::vector<kfac_grad<float>> grads;
  gradapt::param_list<float> params;
  double product_flops = 0;  ///< factor SYRKs + preconditioning GEMMs of one step
  explicit model(int blocks = 4, std::int64_t d = 256) {
    for (int l = 0; l < blocks; ++l) {
      const std::string p = "block" + std::to_string(l) + ".";
      for (const char* n : {"q", "k", "v", "o"}) layers.push_back({p + n, d, d, true});
      layers.push_back({p + "up", d, 4 * d, true});
      layers.push_back({p + "down", 4 * d, d, true});
    }
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto fill = [&](std::size_t n) {
      std::vector<float> v(n);
      for (auto& x : v) x = nd(rng);
      return v;
    };
    for (const auto& s : layers) {
      a.push_back(fill(static_cast<std::size_t>(rows * s.in)));
      g.push_back(fill(static_cast<std::size_t>(rows * s.out)));
      w.push_back(fill(static_cast<std::size_t>(s.out * s.in)));
      b.push_back(fill(static_cast<std::size_t>(s.out)));
      gw0.push_back(fill(static_cast<std::size_t>(s.out * s.in)));
      gb0.push_back(fill(static_cast<std::size_t>(s.out)));
      const double n = double(s.in + 1), o = double(s.out), r = double(rows);
      product_flops += 2 * r * n * n / 2 + 2 * r * o * o / 2 + 2 * (2 * o * o * n + 2 * o * n * n);
    }
    gw = gw0;
    gb = gb0;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      grads.push_back(
          {tensor_view<float>(gw[i].data(), {layers[i].out, layers[i].in}), gradapt::host_view(gb[i])});
      params.add(layers[i].name + ".weight", tensor_view<float>(w[i].data(), {layers[i].out, layers[i].in}),
                 tensor_view<float>(gw[i].data(), {layers[i].out, layers[i].in}));
      params.add(layers[i].name + ".bias", gradapt::host_view(b[i]), gradapt::host_view(gb[i]));
    }
  }
  void reset_grads() {
    for (std::size_t i = 0; i < gw.size(); ++i) {
      std::copy(gw0[i].begin(), gw0[i].end(), gw[i].begin());
      std::copy(gb0[i].begin(), gb0[i].end(), gb[i].begin());
    }
  }
  template <class St>
  void feed(const kfac& kf, St& st) {
    if (!kf.factor_update_due(st)) return;
    for (std::size_t i = 0; i < layers.size(); ++i)
      kf.accumulate(st, i, tensor_view<const float>(a[i].data(), {rows, layers[i].in}),
                    tensor_view<const float>(g[i].data(), {rows, layers[i].out}));
  }
};

double gemm_gflops() {
  const std::int64_t n = 1024;
  std::vector<float> x(n * n, 0.5f), y(n * n, 0.25f), z(n * n);
  const auto run = [&] {
    la.gemm(gradapt::transpose::none, gradapt::transpose::none, 1.0,
            tensor_view<const float>(x.data(), {n, n}), tensor_view<const float>(y.data(), {n, n}), 0.0,
            tensor_view<float>(z.data(), {n, n}));
  };
  run();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) run();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(z.data());
  return 2.0 * double(n) * double(n) * double(n) * 10 / s / 1e9;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void products(benchmark::State& state) {
  model m;
  const kfac kf({.inv_update_steps = 1000000});
  auto st = kf.init<float>(la, m.layers);
  m.feed(kf, st);
  kf.step(st, m.grads, 0.1);  // decomposes once
  const double ref = gemm_gflops();
  double seconds = 0;
  for (auto _ : state) {
    m.reset_grads();
    m.feed(kf, st);
    const auto t0 = std::chrono::steady_clock::now();
    kf.step(st, m.grads, 0.1);
    seconds += seconds_since(t0);
  }
  // feed() ran outside the timed part: time its SYRKs too, in one more timed round.
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) {
    m.feed(kf, st);
    kf.step(st, m.grads, 0.1);
  }
  const double with_feed = seconds_since(t0) / 3;
  const double gf = m.product_flops / with_feed / 1e9;
  state.counters["gflops"] = gf;
  state.counters["gemm_gflops"] = ref;
  state.counters["ratio"] = gf / ref;
  state.counters["precondition_s"] = seconds / double(state.iterations());
}

void amortised(benchmark::State& state) {
  model m;
  const kfac kf({.factor_update_steps = 10, .inv_update_steps = 100});
  auto st = kf.init<float>(la, m.layers);
  const gradapt::sgd opt({.lr = 0.01, .momentum = 0.9});
  const gradapt::host backend{.threads = 1};
  auto sst = opt.init(backend, m.params);
  double kfac_s = 0, sgd_s = 0, decompose_s = 0;
  for (auto _ : state) {
    kfac_s = 0;
    sgd_s = 0;
    for (int t = 0; t < 100; ++t) {
      m.reset_grads();
      const auto t0 = std::chrono::steady_clock::now();
      m.feed(kf, st);
      kf.step(st, m.grads, 0.01);
      const double k = seconds_since(t0);
      kfac_s += k;
      if (t == 0) decompose_s = k;
      const auto t1 = std::chrono::steady_clock::now();
      opt.step(backend, m.params, sst);
      sgd_s += seconds_since(t1);
    }
  }
  state.counters["kfac_per_step_s"] = kfac_s / 100;
  state.counters["sgd_step_s"] = sgd_s / 100;
  state.counters["ratio"] = kfac_s / sgd_s;
  state.counters["decompose_s"] = decompose_s;
}

double one_rank = 0;

void distributed(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::vector<double> dec(static_cast<std::size_t>(n));
  for (auto _ : state) {
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& c) {
      model m;
      const kfac kf({.inv_update_steps = 2});  // decompositions at steps 1, 3
      auto st = kf.init<float>(la, m.layers);
      m.feed(kf, st);
      kf.step(c, st, m.grads, 0.1);
      const double t0 = thread_cpu_seconds();
      m.feed(kf, st);
      kf.step(c, st, m.grads, 0.1);  // step 2: factors, no decompositions
      const double t1 = thread_cpu_seconds();
      m.feed(kf, st);
      kf.step(c, st, m.grads, 0.1);  // step 3: factors and decompositions
      const double t2 = thread_cpu_seconds();
      dec[static_cast<std::size_t>(c.rank())] = (t2 - t1) - (t1 - t0);
    });
  }
  const double mx = *std::max_element(dec.begin(), dec.end());
  if (n == 1) one_rank = mx;
  state.counters["max_rank_s"] = mx;
  if (n > 1 && one_rank > 0) state.counters["ratio"] = mx / one_rank;
}

}  // namespace

BENCHMARK(products)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(amortised)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();
BENCHMARK(distributed)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kSecond)->Iterations(1)->UseRealTime();

int main(int argc, char** argv) {
  const char* t = std::getenv("OPENBLAS_NUM_THREADS");
  if (!t || std::strcmp(t, "1") != 0)
    std::fprintf(
        stderr,
        "bench_kfac: set OPENBLAS_NUM_THREADS=1 (one BLAS thread per caller; see the file comment)\n");
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

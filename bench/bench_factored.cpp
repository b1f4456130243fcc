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
// Compiled like a consumer (plain -O2, no -march, no fast-math).
//
//   bench_factored [rounds=9] [threads...=1 2]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/sm3.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using gradapt_bench::tensor_shape;
inline std::vector<tensor_shape> shapes() { return gradapt_bench::gpt2_small_shapes(); }

struct model {
  std::size_t n = 0;
  std::vector<float> p, g;
  std::vector<float> ta, tb, tc;
  gradapt::param_list<float> params;
  model() {
    const auto s = shapes();
    for (const auto& t : s) {
      std::size_t k = 1;
      for (auto d : t.dims) k *= static_cast<std::size_t>(d);
      n += k;
    }
    p.assign(n, 0.0f);
    g.assign(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = 0.02f * static_cast<float>(static_cast<int>(i * 2654435761u % 2001) - 1000) / 1000.0f;
      g[i] = 1e-3f * static_cast<float>(static_cast<int>(i * 40503u % 2001) - 1000) / 1000.0f;
    }
    ta.assign(n, 1.0f), tb.assign(n, 2.0f), tc.assign(n, 0.5f);
    std::size_t off = 0;
    for (const auto& t : s) {
      const gradapt::tensor_view<float> pv(p.data() + off, t.dims), gv(g.data() + off, t.dims);
      params.add(t.name, pv, gv);
      off += pv.size();
    }
  }
};

void triad(model& m, int t) {
  float* __restrict a = m.ta.data();
  const float* __restrict b = m.tb.data();
  const float* __restrict c = m.tc.data();
  const std::size_t n = m.n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
}

void roof(model& m, int t) {
  float* __restrict p = m.p.data();
  const float* __restrict g = m.g.data();
  const std::size_t n = m.n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) p[i] += 1e-9f * g[i];
}

double seconds(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct row {
  std::string name;
  int threads;
  double ms, gbs, vs_triad, vs_roof, triad_gbs, floor;
};

template <class Opt>
row measure(model& m, const char* name, const Opt& opt, double bytes_per_param, int threads, int rounds,
            double floor) {
  gradapt::host backend{.threads = threads};
  auto st = opt.init(backend, m.params);
  opt.step(backend, m.params, st);  // warm-up (first touch of the state)
  std::vector<double> k_time, vs_triad, vs_roof, triad_bw;
  const double n = static_cast<double>(m.n);
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = clock_type::now();
    triad(m, threads);
    const auto t1 = clock_type::now();
    roof(m, threads);
    const auto t2 = clock_type::now();
    opt.step(backend, m.params, st);
    const auto t3 = clock_type::now();
    const double tri = 12.0 * n / seconds(t0, t1);
    const double rf = 12.0 * n / seconds(t1, t2);
    const double k = bytes_per_param * n / seconds(t2, t3);
    k_time.push_back(seconds(t2, t3));
    vs_triad.push_back(k / tri);
    vs_roof.push_back(k / rf);
    triad_bw.push_back(tri);
  }
  const double t = median(k_time);
  return {name,
          threads,
          t * 1e3,
          bytes_per_param * n / t * 1e-9,
          median(vs_triad),
          median(vs_roof),
          median(triad_bw) * 1e-9,
          floor};
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  std::vector<int> threads;
  for (int i = 2; i < argc; ++i) threads.push_back(std::atoi(argv[i]));
  if (threads.empty()) threads = {1, 2};
  model m;
  std::printf("%zu tensors, %.1fM fp32 parameters (%.2f GB per stream); %d paired rounds, medians\n",
              m.params.size(), static_cast<double>(m.n) * 1e-6, static_cast<double>(m.n) * 4e-9, rounds);
  {
    gradapt::host b{};
    const auto st = gradapt::adafactor({.lr = 1e-3}).init(b, m.params);
    std::printf("adafactor state: %zu elements (%.2f MB) for %zu parameters; workspace %.2f MB\n",
                st.state_elements(), static_cast<double>(st.state_elements()) * 4e-6, m.n,
                static_cast<double>(st.workspace_bytes()) * 1e-6);
  }
  std::vector<row> rows;
  for (int t : threads) {
    rows.push_back(measure(m, "adafactor", gradapt::adafactor({.lr = 1e-3}), 12, t, rounds, 0.60));
    rows.push_back(measure(m, "adafactor_torch", gradapt::adafactor(gradapt::torch_adafactor_options(1e-3)),
                           12, t, rounds, 0.60));
    rows.push_back(measure(m, "sm3_momentum", gradapt::sm3({.lr = 1e-3}), 20, t, rounds, 0.60));
    rows.push_back(measure(m, "sm3", gradapt::sm3({.lr = 1e-3, .momentum = 0.0}), 12, t, rounds, 0.60));
  }
  std::printf("\n%-16s %7s %10s %10s %10s %10s %10s %8s\n", "step", "threads", "ms", "eff GB/s", "triad GB/s",
              "vs triad", "vs roof", "floor");
  for (const auto& r : rows)
    std::printf("%-16s %7d %10.1f %10.1f %10.1f %10.2f %10.2f %8s\n", r.name.c_str(), r.threads, r.ms, r.gbs,
                r.triad_gbs, r.vs_triad, r.vs_roof,
                r.floor > 0 && r.threads == 2 ? (r.vs_triad >= r.floor ? "met" : "MISSED") : "-");
  std::printf(
      "\neff GB/s: fewest bytes the step must move (Adafactor and SM3 without momentum 12 B, SM3 with "
      "momentum "
      "20 B per parameter) / step time.\n"
      "vs triad / vs roof: per-round ratios to the triad loop and to p += s g (the same three streams).\n"
      "floor (issue 5, 2 threads): Adafactor and SM3 >= 0.60 of triad.\n");
  return 0;
}

// Optimizer steps on a 100M-parameter, transformer-shaped list (issue 5's floors).
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
//   bench_optim [rounds=15] [threads...=1 2]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using gradapt_bench::tensor_shape;
inline std::vector<tensor_shape> shapes() { return gradapt_bench::gpt2_small_shapes(); }

struct model {
  std::size_t n = 0;
  std::vector<float> p, g;        // the flat parameter and gradient buckets
  std::vector<float> ta, tb, tc;  // triad arrays
  std::vector<float> r1, r2, r3;  // plain-roof state streams
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
    r1.assign(n, 0.0f), r2.assign(n, 0.0f), r3.assign(n, 0.0f);
    std::size_t off = 0;
    for (const auto& t : s) {
      const gradapt::tensor_view<float> pv(p.data() + off, t.dims), gv(g.data() + off, t.dims);
      params.add(t.name, pv, gv, {.skip_weight_decay = t.no_decay, .skip_trust_ratio = t.no_decay});
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
  double ms, gbs, vs_triad, vs_roof, triad_gbs;
  double floor;
};

template <class Opt>
row measure(model& m, const char* name, const Opt& opt, double bytes_per_param, int state_streams,
            int threads, int rounds, double floor) {
  gradapt::host backend{.threads = threads};
  auto st = opt.init(backend, m.params);
  opt.step(backend, m.params, st, {.lr = 1e-4});  // warm-up (first touch of the state)
  std::vector<double> k_time, vs_triad, vs_roof, triad_bw;
  const double n = static_cast<double>(m.n);
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = clock_type::now();
    triad(m, threads);
    const auto t1 = clock_type::now();
    roof(m, threads, state_streams);
    const auto t2 = clock_type::now();
    opt.step(backend, m.params, st, {.lr = 1e-4});
    const auto t3 = clock_type::now();
    const double tri = 12.0 * n / seconds(t0, t1);
    const double rf = (8.0 + 8.0 * state_streams + 4.0) * n / seconds(t1, t2);
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
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  std::vector<int> threads;
  for (int i = 2; i < argc; ++i) threads.push_back(std::atoi(argv[i]));
  if (threads.empty()) threads = {1, 2};
  model m;
  std::printf("%zu tensors, %.1fM fp32 parameters (%.2f GB per stream); %d paired rounds, medians\n",
              m.params.size(), static_cast<double>(m.n) * 1e-6, static_cast<double>(m.n) * 4e-9, rounds);
  std::vector<row> rows;
  for (int t : threads) {
    rows.push_back(
        measure(m, "sgd_momentum", gradapt::sgd({.lr = 1e-4, .momentum = 0.9}), 20, 1, t, rounds, 0.85));
    rows.push_back(
        measure(m, "adamw", gradapt::adamw({.lr = 1e-4, .weight_decay = 0.01}), 28, 2, t, rounds, 0.85));
    rows.push_back(
        measure(m, "lamb", gradapt::lamb({.lr = 1e-4, .weight_decay = 0.01}), 28, 2, t, rounds, 0.65));
    rows.push_back(
        measure(m, "lars", gradapt::lars({.lr = 1e-4, .weight_decay = 0.01}), 20, 1, t, rounds, 0.65));
  }
  std::printf("\n%-14s %7s %10s %10s %10s %10s %10s %8s\n", "step", "threads", "ms", "eff GB/s", "triad GB/s",
              "vs triad", "vs roof", "floor");
  for (const auto& r : rows)
    std::printf("%-14s %7d %10.1f %10.1f %10.1f %10.2f %10.2f %8s\n", r.name.c_str(), r.threads, r.ms, r.gbs,
                r.triad_gbs, r.vs_triad, r.vs_roof,
                r.threads == 2 ? (r.vs_triad >= r.floor ? "met" : "MISSED") : "-");
  std::printf(
      "\neff GB/s: fewest bytes the step must move (SGD/LARS 20 B, AdamW/LAMB 28 B per parameter) / step "
      "time.\n"
      "vs triad / vs roof: per-round ratios to the triad loop and to a plain loop with the step's own "
      "streams.\n"
      "floor (issue 5, 2 threads): SGD-momentum and AdamW >= 0.85 of triad, LAMB and LARS >= 0.65.\n");
  return 0;
}

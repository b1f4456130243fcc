// Per-step cost of the gradient noise scale + AdaScale against the allreduce + optimizer step
// they ride on.
//
// P in-process ranks (comm::threads, one host thread each), each holding a replica of a
// 25.2M-parameter, transformer-shaped list (8 layers of d = 512: qkv, proj, fc1, fc2 weights,
// their biases and two layer norms: 96 tensors) whose gradients live in one flat bucket, as
// data-parallel frameworks keep them. Each round times, back to back on the same buffers:
//
//   base    allreduce(sum) of the bucket; SGD-momentum step with the 1/P mean folded in
//   fused   allreduce_with_norms (norms computed during the reduction) ; noise-scale update ;
//           AdaScale gain and lr at tau ; the same SGD-momentum step at that lr
//   generic the same through a communicator without allreduce_with_norms: two read passes on
//           the backend and a two-double allreduce (what an MPI user pays)
//
// and reports the medians over rounds of (fused - base) / base and (generic - base) / base.
//
//   bench_gns [--benchmark_filter=...]    args: ranks (default runs 2 and 4)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/stats/allreduce_with_norms.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// Tensor sizes of the transformer-shaped list.
std::vector<std::size_t> shapes() {
  constexpr std::size_t d = 512, layers = 8;
  std::vector<std::size_t> s;
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t n : {d * 3 * d, 3 * d, d * d, d, d * 4 * d, 4 * d, 4 * d * d, d, d, d, d, d})
      s.push_back(n);
  return s;
}

// Forwards to comm::threads without allreduce_with_norms (the generic path).
struct plain_comm {
  using space = gradapt::host_space;
  gradapt::comm::threads* c;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class T>
  void allreduce(gradapt::tensor_view<T> b, gradapt::reduce_op op) {
    c->allreduce(b, op);
  }
  template <class T>
  void broadcast(gradapt::tensor_view<T> b, int root) {
    c->broadcast(b, root);
  }
  template <class T>
  void allgather(gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r) {
    c->allgather<T>(s, r);
  }
  template <class T>
  void reduce_scatter(gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r, gradapt::reduce_op op) {
    c->reduce_scatter<T>(s, r, op);
  }
  template <class T>
  void exchange(int peer, gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r) {
    c->exchange<T>(peer, s, r);
  }
  plain_comm split(int, int) { return *this; }
  void barrier() { c->barrier(); }
};

struct replica {
  std::vector<float> bucket, w, m;
  std::vector<gradapt::tensor_view<float>> ws, ms;
  std::vector<gradapt::tensor_view<const float>> gs;
  explicit replica(int rank) {
    const auto s = shapes();
    std::size_t total = 0;
    for (auto n : s) total += n;
    bucket.resize(total);
    w.assign(total, 0.01f);
    m.assign(total, 0.0f);
    std::size_t off = 0;
    for (auto n : s) {
      ws.push_back(gradapt::tensor_view<float>::vector(w.data() + off, static_cast<std::int64_t>(n)));
      ms.push_back(gradapt::tensor_view<float>::vector(m.data() + off, static_cast<std::int64_t>(n)));
      gs.push_back(
          gradapt::tensor_view<const float>::vector(bucket.data() + off, static_cast<std::int64_t>(n)));
      off += n;
    }
    refill(rank, 0);
  }
  // A fresh "backward pass": gradient = common signal + rank-dependent noise (cheap to make).
  void refill(int rank, int step) {
    const float a = 1e-3f * static_cast<float>(rank + 1), b = 1e-4f * static_cast<float>(step % 7);
    for (std::size_t i = 0; i < bucket.size(); ++i)
      bucket[i] = 1e-3f + a * static_cast<float>(static_cast<int>(i % 97) - 48) + b;
  }
};

void sgd_step(const gradapt::host& backend, replica& r, float lr, float inv_p) {
  const float mu = 0.9f;
  backend.apply_list(
      [=](float& w, float& m, float g) {
        m = mu * m + inv_p * g;
        w -= lr * m;
      },
      r.ws, r.ms, r.gs);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void BM_gns_adascale_overhead(benchmark::State& st) {
  const int p = static_cast<int>(st.range(0));
  constexpr int rounds = 21;
  std::vector<double> base_t, fused_over, generic_over, fused_t, generic_t;
  std::vector<replica> reps;
  for (int r = 0; r < p; ++r) reps.emplace_back(r);
  for (auto _ : st) {
    gradapt::comm::run_threads(p, [&](gradapt::comm::threads& c) {
      const gradapt::host backend{.threads = 1};
      replica& rep = reps[static_cast<std::size_t>(c.rank())];
      const float inv_p = 1.0f / static_cast<float>(p);
      gradapt::gradient_noise_scale gns{{.smoothing = 0.9}}, gns2{{.smoothing = 0.9}};
      gradapt::adascale ada{{.scale = static_cast<double>(p)}}, ada2{{.scale = static_cast<double>(p)}};
      const auto schedule = [](double tau) { return 0.1 / (1.0 + 1e-3 * tau); };
      const gradapt::noise_batch batch{.micro_batch = 32};
      plain_comm pc{&c};
      // Each round runs the three variants in a rotated order (memory and cache state left by
      // one variant favour or hurt the next), each on a freshly written gradient bucket.
      for (int round = -3; round < rounds; ++round) {  // three warm-up rounds
        const auto bucket = gradapt::host_view(rep.bucket);
        double t[3] = {};
        for (int j = 0; j < 3; ++j) {
          const int variant = (j + round + 3) % 3;
          rep.refill(c.rank(), round + 3);
          c.barrier();
          const auto t0 = clock_type::now();
          if (variant == 0) {
            c.allreduce(bucket, gradapt::reduce_op::sum);
            sgd_step(backend, rep, 0.1f, inv_p);
          } else if (variant == 1) {
            const auto norms = gradapt::allreduce_with_norms(c, backend, bucket);
            gns.update(norms, p, batch);
            const auto s = ada.step(schedule, gns, batch.local());
            sgd_step(backend, rep, static_cast<float>(s.lr), inv_p);
          } else {
            const auto norms = gradapt::allreduce_with_norms(pc, backend, bucket);
            gns2.update(norms, p, batch);
            const auto s = ada2.step(schedule, gns2, batch.local());
            sgd_step(backend, rep, static_cast<float>(s.lr), inv_p);
          }
          c.barrier();
          t[variant] = std::chrono::duration<double>(clock_type::now() - t0).count();
        }
        if (c.rank() == 0 && round >= 0) {
          base_t.push_back(t[0]);
          fused_t.push_back(t[1]);
          generic_t.push_back(t[2]);
          fused_over.push_back((t[1] - t[0]) / t[0]);
          generic_over.push_back((t[2] - t[0]) / t[0]);
        }
      }
    });
    st.SetIterationTime(median(base_t));
  }
  st.counters["base_ms"] = median(base_t) * 1e3;
  st.counters["fused_ms"] = median(fused_t) * 1e3;
  st.counters["generic_ms"] = median(generic_t) * 1e3;
  st.counters["fused_overhead"] = median(fused_over);
  st.counters["generic_overhead"] = median(generic_over);
}

BENCHMARK(BM_gns_adascale_overhead)
    ->Arg(2)
    ->Arg(4)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  std::size_t total = 0;
  for (auto n : shapes()) total += n;
  std::printf("%zu parameters in %zu tensors per replica (fp32); medians over 21 rounds per rank count\n",
              total, shapes().size());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

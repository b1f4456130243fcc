// Bucketed allreduce of the 148 GPT-2-small fp32 gradients (101.2M elements, 405 MB per rank)
// on comm::threads ranks, timed in one run against its references:
//
//   build/bench/bench_buckets_threads [--ranks 4] [--iters 5] [--cap-mib 25] [--first-mib 1]
//
// Every variant sums the same gradients across the ranks, timed after a barrier as the maximum
// over ranks, the variants interleaved within each iteration:
//   single      one allreduce of one contiguous buffer of the same total size
//   bucketed    bucket::reducer over the gradients in their own allocations (one per tensor):
//               mark_ready of every gradient in backward order, then wait(); includes packing,
//               the mean and the write-back
//   in-place    bucket::reducer over the same gradients held in a bucket::storage: each bucket
//               reduced in its own memory, the mean formed in place
//   in-pl. sum  the same with reducer_options::average = false: the sum, the operation
//               `single` performs (a framework that folds 1/N into its learning rate)
//   per-tensor  one allreduce per gradient (148 calls)
// It prints median times and the throughput ratios to `single`. comm::threads sums in rank
// order into each rank's buffer, so the ranks share the machine's cores and memory bandwidth:
// the ratios, not the times, are the result. Compiled like a consumer's code: plain -O2.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/threads.hpp"
#include "timing.hpp"

namespace {

using gradapt_bench::median;

using gradapt::bucket::bucket_plan;
using gradapt::bucket::reducer;
using gradapt::comm::threads;
using clock_type = std::chrono::steady_clock;

struct args {
  int ranks = 4;
  int iters = 5;
  double cap_mib = 25;
  double first_mib = 1;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--ranks")
      a.ranks = std::atoi(v);
    else if (k == "--iters")
      a.iters = std::atoi(v);
    else if (k == "--cap-mib")
      a.cap_mib = std::atof(v);
    else if (k == "--first-mib")
      a.first_mib = std::atof(v);
    else {
      std::fprintf(stderr, "bench_buckets_threads: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.ranks < 1 || a.iters < 1) {
    std::fprintf(stderr, "bench_buckets_threads: --ranks and --iters must be >= 1\n");
    std::exit(2);
  }
  return a;
}

/// Runs f on every rank after a barrier; the maximum over ranks of its wall time.
template <class F>
double timed(threads& comm, F&& f) {
  comm.barrier();
  const auto t0 = clock_type::now();
  f();
  double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
  comm.allreduce(gradapt::tensor_view<double>::vector(&dt, 1), gradapt::reduce_op::max);
  return dt;
}

}  // namespace

int main(int argc, char** argv) {
  const args a = parse(argc, argv);
  const auto shapes = gradapt_bench::gpt2_small_shapes();
  std::vector<gradapt::bucket::tensor_info> infos;
  std::size_t total = 0;
  for (const auto& s : shapes) {
    std::size_t k = 1;
    for (auto d : s.dims) k *= static_cast<std::size_t>(d);
    infos.push_back({k});
    total += k;
  }
  const auto plan =
      bucket_plan::make(infos, {.cap_bytes = static_cast<std::size_t>(a.cap_mib * 1048576.0),
                                .first_cap_bytes = static_cast<std::size_t>(a.first_mib * 1048576.0)});
  const double bytes = 4.0 * static_cast<double>(total);
  std::printf(
      "bench_buckets_threads: %d comm::threads rank(s), %zu gradients, %zu elements (%.1f MB fp32 per rank), "
      "%zu buckets (cap %.3g MiB, first %.3g MiB), %d iterations\n",
      a.ranks, infos.size(), total, bytes / 1e6, plan.buckets().size(), a.cap_mib, a.first_mib, a.iters);

  std::vector<double> t_single, t_bucketed, t_in_place, t_in_place_sum, t_per_tensor;
  bool layout_ok = true;
  gradapt::comm::run_threads(a.ranks, [&](threads& comm) {
    // The gradients, one allocation per tensor as a framework holds them, and the same values
    // in the plan's bucket layout.
    std::vector<std::vector<float>> g;
    std::vector<gradapt::tensor_view<float>> views;
    gradapt::bucket::storage<float> store(plan);
    const auto store_views = store.views();
    std::size_t at = 0;
    for (std::size_t t = 0; t < infos.size(); ++t) {
      g.emplace_back(infos[t].size);
      for (std::size_t i = 0; i < g.back().size(); ++i)
        g.back()[i] = 1e-3f * static_cast<float>(static_cast<int>((i + at) * 40503u % 2001) - 1000);
      at += g.back().size();
      views.push_back(gradapt::host_view(g.back()));
    }
    const auto refill = [&] {
      for (std::size_t t = 0; t < g.size(); ++t) std::copy(g[t].begin(), g[t].end(), store_views[t].data());
    };
    refill();
    std::vector<float> single(total, 1e-3f);
    reducer<threads, float> copying(comm, plan, views);
    reducer<threads, float> in_place(comm, plan, store_views);
    reducer<threads, float> in_place_sum(comm, plan, store_views, {.average = false});
    if (comm.rank() == 0) layout_ok = in_place.fused_elements() == 0 && copying.fused_elements() > 0;
    std::vector<std::size_t> backward_order(g.size());
    for (std::size_t t = 0; t < g.size(); ++t) backward_order[t] = g.size() - 1 - t;

    std::vector<double> ts, tb, ti, tsum, tp;
    for (int it = 0; it < a.iters; ++it) {
      ts.push_back(timed(comm, [&] { comm.allreduce(gradapt::host_view(single), gradapt::reduce_op::sum); }));
      tb.push_back(timed(comm, [&] {
        for (const auto t : backward_order) copying.mark_ready(t);
        copying.wait();
      }));
      ti.push_back(timed(comm, [&] {
        for (const auto t : backward_order) in_place.mark_ready(t);
        in_place.wait();
      }));
      tsum.push_back(timed(comm, [&] {
        for (const auto t : backward_order) in_place_sum.mark_ready(t);
        in_place_sum.wait();
      }));
      tp.push_back(timed(comm, [&] {
        for (const auto t : backward_order) comm.allreduce(views[t], gradapt::reduce_op::sum);
      }));
      std::fill(single.begin(), single.end(), 1e-3f);  // keep the sums bounded
      refill();
    }
    if (comm.rank() == 0)
      t_single = ts, t_bucketed = tb, t_in_place = ti, t_in_place_sum = tsum, t_per_tensor = tp;
  });
  if (!layout_ok) {
    std::fprintf(stderr,
                 "bench_buckets_threads: expected the storage's buckets in place and the others copied\n");
    return 1;
  }
  const double s = median(t_single);
  std::printf("\nthroughput (median of %d, max over ranks)\n", a.iters);
  std::printf("  %-11s %9s %11s %22s\n", "variant", "ms", "GB/s", "throughput / single");
  const auto row = [&](const char* name, const std::vector<double>& t) {
    const double m = median(t);
    std::printf("  %-11s %9.1f %11.3f %22.3f\n", name, 1e3 * m, bytes / m / 1e9, s / m);
  };
  row("single", t_single);
  row("bucketed", t_bucketed);
  row("in-place", t_in_place);
  row("in-pl. sum", t_in_place_sum);
  row("per-tensor", t_per_tensor);
  return 0;
}

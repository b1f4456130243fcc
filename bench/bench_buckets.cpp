// Bucketed gradient allreduce over MPI on the 148 GPT-2-small fp32 gradients (101.2M
// elements, 405 MB per rank), timed in one run against its references:
//
//   mpiexec --oversubscribe -n 4 build/bench/bench_buckets [--iters 5] [--cap-mib 25]
//           [--first-mib 1] [--backward 1.0]
//
// (a) Throughput. Every variant sums the same gradients across ranks, timed after an
//     MPI_Barrier as the maximum over ranks, the variants interleaved within each iteration:
//       single     one comm::mpi allreduce of one contiguous buffer of the same total size
//       bucketed   bucket::reducer (overlapping path): mark_ready of every gradient in
//                  backward order, then wait(); includes packing, the mean and the write-back
//       blocking   the same reducer with reducer_options::overlap = false
//       in-place   the overlapping reducer over the same gradients held in a bucket::storage
//                  (DDP's gradient_as_bucket_view): each bucket reduced in its own memory, no
//                  packing or write-back copies, the mean formed in place
//       in-place blocking   the same with overlap = false
//       in-place sum        the in-place overlapping reducer with average = false: the sum,
//                  the operation `single` performs (a framework that folds 1/N into its lr)
//       per-tensor one comm::mpi allreduce per gradient (148 calls)
//     It prints median times, throughput (bytes of gradients per second) and the ratios to
//     `single` (the reference: one message of the same size).
// (b) Overlap. A simulated backward pass produces the gradients in backward order; before
//     each, the host waits until a deadline proportional to the elements produced so far (as
//     while a GPU computes), for a total of `backward` times the median blocking reduction
//     time of (a) (`--backward 0` skips (b)). Three ways to wait:
//       sleep      sleep_until the deadline (progress only inside mark_ready)
//       spin       busy-wait on the clock (progress only inside mark_ready)
//       poll       sleep in 100 us slices and call reducer::progress() between them
//     Measured per mode: backward alone (no reducer), backward with mark_ready + wait()
//     (overlapping path), and backward followed by the blocking reduction of everything
//     (non-overlapped). exposed = (backward + wait) - backward alone; non-overlapped
//     communication = (backward + blocking reduction) - backward alone. The ratio
//     exposed / non-overlapped communication is the share of communication that the overlap
//     did not hide (the last bucket, which holds the token embedding, can only start when
//     backward ends). Each mode is measured with the copying reducers and with the in-place
//     ones (gradients in a bucket::storage).
// (c) ZeRO-2 overlap. The same simulated backward with shard::sharded_optimizer's stage 2 (SGD,
//     the same bucket caps): `mark_ready` of each gradient with `sharded_options::overlap`
//     (each bucket's MPI_Ireduce_scatter_block started there; the poll mode calls
//     comm.progress() between slices), then `reduce()`, which completes them into the shard;
//     against backward followed by the blocking stage 2 (overlap = false, every gradient marked,
//     then `reduce()`), the backward lasting `backward` times ZeRO-2's own blocking reduction
//     (measured first). exposed / non-overlapped communication as in (b).
// Compiled like a consumer's code: plain -O2, no -march.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "timing.hpp"

namespace {

using gradapt_bench::median;

using gradapt::bucket::bucket_plan;
using gradapt::bucket::reducer;
using gradapt::comm::mpi;
using clock_type = std::chrono::steady_clock;

struct args {
  int iters = 5;
  double cap_mib = 25;
  double first_mib = 1;
  double backward = 1.0;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--iters")
      a.iters = std::atoi(v);
    else if (k == "--cap-mib")
      a.cap_mib = std::atof(v);
    else if (k == "--first-mib")
      a.first_mib = std::atof(v);
    else if (k == "--backward")
      a.backward = std::atof(v);
  }
  return a;
}

/// Runs f on every rank after a barrier; the maximum over ranks of its wall time.
template <class F>
double timed(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  f();
  double dt = MPI_Wtime() - t0, worst = 0;
  MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

enum class wait_mode { sleep, spin, poll };
const char* mode_name(wait_mode m) {
  return m == wait_mode::sleep ? "sleep" : m == wait_mode::spin ? "spin" : "poll";
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    const args a = parse(argc, argv);
    mpi comm;
    const int rank = comm.rank();

    // The gradients, one allocation per tensor as a framework holds them.
    const auto shapes = gradapt_bench::gpt2_small_shapes();
    std::vector<std::vector<float>> g;
    std::vector<gradapt::tensor_view<float>> views;
    std::vector<gradapt::bucket::tensor_info> infos;
    std::size_t total = 0;
    for (const auto& s : shapes) {
      std::size_t k = 1;
      for (auto d : s.dims) k *= static_cast<std::size_t>(d);
      g.emplace_back(k);
      for (std::size_t i = 0; i < k; ++i)
        g.back()[i] = 1e-3f * static_cast<float>(static_cast<int>((i + total) * 40503u % 2001) - 1000);
      infos.push_back({k});
      total += k;
    }
    for (std::size_t t = 0; t < g.size(); ++t) views.emplace_back(g[t].data(), shapes[t].dims);
    std::vector<float> single(total, 1e-3f);
    const double bytes = 4.0 * static_cast<double>(total);

    const auto plan =
        bucket_plan::make(infos, {.cap_bytes = static_cast<std::size_t>(a.cap_mib * 1048576.0),
                                  .first_cap_bytes = static_cast<std::size_t>(a.first_mib * 1048576.0)});
    reducer<mpi, float> overlapped(comm, plan, views);
    reducer<mpi, float> blocking(comm, plan, views, {.overlap = false});
    // The same gradients in the plan's bucket layout.
    gradapt::bucket::storage<float> store(plan);
    const auto store_views = store.views();
    for (std::size_t t = 0; t < g.size(); ++t) std::copy(g[t].begin(), g[t].end(), store_views[t].data());
    reducer<mpi, float> in_place(comm, plan, store_views);
    reducer<mpi, float> in_place_blocking(comm, plan, store_views, {.overlap = false});
    reducer<mpi, float> in_place_sum(comm, plan, store_views, {.average = false});
    if (in_place.fused_elements() != 0 || overlapped.fused_elements() == 0) {
      std::fprintf(stderr, "bench_buckets: expected the storage's buckets in place and the others copied\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::vector<std::size_t> backward_order(g.size());
    for (std::size_t t = 0; t < g.size(); ++t) backward_order[t] = g.size() - 1 - t;

    if (rank == 0)
      std::printf(
          "bench_buckets: %d rank(s), %zu gradients, %zu elements (%.1f MB fp32 per rank), %zu buckets "
          "(cap %.3g MiB, first %.3g MiB), %d iterations\n",
          comm.size(), g.size(), total, bytes / 1e6, plan.buckets().size(), a.cap_mib, a.first_mib, a.iters);

    // (a) throughput
    std::vector<double> t_single, t_bucketed, t_blocking, t_in_place, t_in_place_blocking, t_in_place_sum,
        t_per_tensor;
    for (int it = 0; it < a.iters; ++it) {
      t_single.push_back(timed([&] { comm.allreduce(gradapt::host_view(single), gradapt::reduce_op::sum); }));
      t_bucketed.push_back(timed([&] {
        for (const auto t : backward_order) overlapped.mark_ready(t);
        overlapped.wait();
      }));
      t_blocking.push_back(timed([&] {
        for (const auto t : backward_order) blocking.mark_ready(t);
        blocking.wait();
      }));
      t_in_place.push_back(timed([&] {
        for (const auto t : backward_order) in_place.mark_ready(t);
        in_place.wait();
      }));
      t_in_place_blocking.push_back(timed([&] {
        for (const auto t : backward_order) in_place_blocking.mark_ready(t);
        in_place_blocking.wait();
      }));
      t_in_place_sum.push_back(timed([&] {
        for (const auto t : backward_order) in_place_sum.mark_ready(t);
        in_place_sum.wait();
      }));
      t_per_tensor.push_back(timed([&] {
        for (const auto t : backward_order) comm.allreduce(views[t], gradapt::reduce_op::sum);
      }));
      for (auto& x : single) x = 1e-3f;  // keep the sums bounded
      for (std::size_t t = 0; t < g.size(); ++t) std::copy(g[t].begin(), g[t].end(), store_views[t].data());
    }
    const double s = median(t_single);
    if (rank == 0) {
      std::printf("\n(a) throughput (median of %d, max over ranks)\n", a.iters);
      std::printf("  %-11s %9s %11s %22s\n", "variant", "ms", "GB/s", "throughput / single");
      const auto row = [&](const char* name, const std::vector<double>& t) {
        const double m = median(t);
        std::printf("  %-11s %9.1f %11.3f %22.3f\n", name, 1e3 * m, bytes / m / 1e9, s / m);
      };
      row("single", t_single);
      row("bucketed", t_bucketed);
      row("blocking", t_blocking);
      row("in-place", t_in_place);
      row("in-pl. blk", t_in_place_blocking);
      row("in-pl. sum", t_in_place_sum);
      row("per-tensor", t_per_tensor);
    }

    // (b) overlap (skipped with --backward 0)
    if (a.backward > 0) {
      double reduce_time = median(t_blocking);
      MPI_Bcast(&reduce_time, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      const double backward_s = a.backward * reduce_time;
      std::vector<double> cum(g.size() + 1, 0.0);  // deadline of each gradient, in backward order
      {
        std::size_t done = 0;
        for (std::size_t i = 0; i < backward_order.size(); ++i) {
          done += g[backward_order[i]].size();
          cum[i] = backward_s * static_cast<double>(done) / static_cast<double>(total);
        }
      }
      if (rank == 0)
        std::printf("\n(b) overlap: simulated backward of %.1f ms (%.2f x the blocking reduction)\n",
                    1e3 * backward_s, a.backward);
      // (c)'s sharded optimizers: parameter values of their own (read by no step here), the
      // gradients g.
      std::vector<float> values(total, 0.0f);
      gradapt::param_list<float> params;
      for (std::size_t t = 0, at = 0; t < g.size(); at += g[t].size(), ++t)
        params.add("g" + std::to_string(t), gradapt::tensor_view<float>(values.data() + at, shapes[t].dims),
                   views[t]);
      const gradapt::host hb{.threads = 1};
      const gradapt::bucket::bucket_options caps{
          .cap_bytes = static_cast<std::size_t>(a.cap_mib * 1048576.0),
          .first_cap_bytes = static_cast<std::size_t>(a.first_mib * 1048576.0)};
      const gradapt::shard::sharded_optimizer zero_over(gradapt::sgd({}), {.buckets = caps, .overlap = true});
      const gradapt::shard::sharded_optimizer zero_block(gradapt::sgd({}), {.buckets = caps});
      auto s_over = zero_over.init(comm, hb, params);
      auto s_block = zero_block.init(comm, hb, params);
      const auto zero_blocking = [&] {
        for (const auto t : backward_order) zero_block.mark_ready(comm, hb, params, s_block, t);
        zero_block.reduce(comm, hb, params, s_block);
      };
      // (c)'s backward lasts `backward` times ZeRO-2's own blocking reduction: (b)'s times
      // `stretch`.
      double stretch = 1.0, zero_time = 0.0;
      {
        std::vector<double> t;
        for (int it = 0; it < a.iters; ++it) {
          t.push_back(timed(zero_blocking));
          zero_block.discard_round(s_block);
        }
        zero_time = median(t);
        MPI_Bcast(&zero_time, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      }
      if (rank == 0)
        std::printf("(c) ZeRO-2: blocking stage-2 reduction %.1f ms, simulated backward %.1f ms\n",
                    1e3 * zero_time, 1e3 * a.backward * zero_time);
      const auto print_row = [&](wait_mode mode, const char* what, const std::vector<double>& alone,
                                 const std::vector<double>& with_overlap,
                                 const std::vector<double>& non_overlapped) {
        if (rank != 0) return;
        const double b = median(alone), o = median(with_overlap), n = median(non_overlapped);
        std::printf(
            "  %-5s %-8s backward %8.1f ms | +overlapped wait %8.1f ms | +blocking after %8.1f ms | exposed "
            "%7.1f ms of %7.1f ms: exposed/non-overlapped comm %.3f, step time ratio %.3f\n",
            mode_name(mode), what, 1e3 * b, 1e3 * o, 1e3 * n, 1e3 * (o - b), 1e3 * (n - b), (o - b) / (n - b),
            o / n);
      };
      for (const wait_mode mode : {wait_mode::sleep, wait_mode::spin, wait_mode::poll}) {
        const auto backward = [&](auto&& on_ready, auto&& poll) {
          const auto start = clock_type::now();
          for (std::size_t i = 0; i < backward_order.size(); ++i) {
            const auto deadline = start + std::chrono::duration_cast<clock_type::duration>(
                                              std::chrono::duration<double>(stretch * cum[i]));
            if (mode == wait_mode::sleep) {
              std::this_thread::sleep_until(deadline);
            } else if (mode == wait_mode::spin) {
              while (clock_type::now() < deadline) {
              }
            } else {
              for (auto now = clock_type::now(); now < deadline; now = clock_type::now()) {
                poll();
                std::this_thread::sleep_until(std::min(deadline, now + std::chrono::microseconds(100)));
              }
            }
            on_ready(backward_order[i]);
          }
        };
        for (const bool in_memory : {false, true}) {
          auto& over = in_memory ? in_place : overlapped;
          auto& block = in_memory ? in_place_blocking : blocking;
          std::vector<double> alone, with_overlap, non_overlapped;
          for (int it = 0; it < a.iters; ++it) {
            alone.push_back(timed([&] { backward([](std::size_t) {}, [] {}); }));
            with_overlap.push_back(timed([&] {
              backward([&](std::size_t t) { over.mark_ready(t); }, [&] { over.progress(); });
              over.wait();
            }));
            non_overlapped.push_back(timed([&] {
              backward([](std::size_t) {}, [] {});
              for (const auto t : backward_order) block.mark_ready(t);
              block.wait();
            }));
          }
          print_row(mode, in_memory ? "in-place" : "copying", alone, with_overlap, non_overlapped);
        }
        {  // (c) ZeRO-2
          stretch = zero_time / reduce_time;
          std::vector<double> alone, with_overlap, non_overlapped;
          for (int it = 0; it < a.iters; ++it) {
            alone.push_back(timed([&] { backward([](std::size_t) {}, [] {}); }));
            with_overlap.push_back(timed([&] {
              backward([&](std::size_t t) { zero_over.mark_ready(comm, hb, params, s_over, t); },
                       [&] { comm.progress(); });
              zero_over.reduce(comm, hb, params, s_over);
            }));
            zero_over.discard_round(s_over);
            non_overlapped.push_back(timed([&] {
              backward([](std::size_t) {}, [] {});
              zero_blocking();
            }));
            zero_block.discard_round(s_block);
          }
          stretch = 1.0;
          print_row(mode, "ZeRO-2", alone, with_overlap, non_overlapped);
        }
      }
    }
  }
  MPI_Finalize();
  return 0;
}

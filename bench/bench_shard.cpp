// ZeRO stage 1 (shard::sharded_optimizer) with AdamW on the GPT-2-small list (148 tensors,
// 101.2M fp32 parameters, bench/gpt2_shapes.hpp): what one rank's step costs against the
// unsharded step, and what one rank keeps in optimizer state.
//
// Timings (Google Benchmark, each iteration a paired round on the same buffers):
//
//   shard_step/N/r/T    triad, the unsharded AdamW step (`opt.step(b, params, state)`) and the
//                       chain step over rank r's shard for a plan of N ranks, back to back, all
//                       at T threads. The shard step is exactly the part of
//                       sharded_optimizer::step between the reduce-scatter and the allgather:
//                       AdamW has no barrier stages, so its units are the plan's pieces, and the
//                       shard's list has one entry per piece, its values a view into the
//                       parameters at [offset, offset + length), its gradients a view into a
//                       gradient shard buffer at the piece's shard position (whole tensors keep
//                       their shape), stepped by `adamw.step` with a state from `adamw.init` on
//                       that list. The setup checks the list against the units the sharded
//                       optimizer itself builds for rank r (init on comm::threads).
//                       The two steps alternate which runs first. Counters: ratio = median over
//                       rounds of t_shard / t_unsharded, target = 1.2 / N, shard = rank r's
//                       share of the elements, ratio_per_share = ratio / shard (1: the same cost
//                       per element), pieces = entries of the shard's list, the medians of both
//                       step times, and the round's triad bandwidth (the machine's state).
//   sharded_step/N/T    for information: the full sharded_optimizer::step (reduce-scatter and
//                       mean, the shard's chain, allgather) on N comm::threads ranks, each with
//                       its own parameter values (the gradients are shared, read only) and a
//                       host backend of max(1, T / N) threads, against the unsharded step at T
//                       threads in the same round. The ranks share the machine's cores (on a
//                       2-core machine N = 4 runs 4 threads on 2 cores), and every rank packs the
//                       whole gradient for the reduce-scatter, so this is not the per-rank cost
//                       of a real N-node run.
//
// Memory (printed after the timings; `--memory-csv` prints only this, as CSV, for
// bench/plot_shard_memory.py): per-rank optimizer state bytes (`sharded_state::state_bytes()`)
// for N = 1, 2, 4, 8, 16, 64, max and min over ranks, from the plan (AdamW: 2 x shard_size(r)
// x 4 B for m and v, plus 4 B x shard_capacity() of float master values for bfloat16
// parameters; Adafactor, tensor granularity: the sum of the unsharded state's per-tensor
// buffers over the rank's tensors), checked equal to `state_bytes()` of a sharded state
// created on comm::threads for N <= 8, against ZeRO's K Psi / N (K = 8 for fp32 m and v; K = 12
// with an fp32 master copy, which the library keeps only for `init<float>` on 16-bit
// parameters).
//
// Compiled like a consumer (plain -O2, no -march, no fast-math).
//
//   OMP_NUM_THREADS=2 bench_shard [--rounds=9] [--benchmark_filter=threads:2] [--memory-csv]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpt2_shapes.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/shard/partition.hpp"
#include "paired.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using gradapt::shard::partition_plan;
using gradapt::shard::piece;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;

double seconds(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const gradapt::adamw& the_adamw() {
  static const gradapt::adamw opt({.lr = 1e-4, .weight_decay = 0.01});
  return opt;
}
// The shard step below is the sharded step's chain only when the units are the plan's pieces:
// chains without per-tensor or global sums (no barrier stages) and not factored.
static_assert(gradapt::adamw::plan::max_terms == 0 && !gradapt::adamw::plan::has_factored,
              "AdamW is expected to have no barrier stages (units = pieces)");

/// The sharded optimizer's options of the timings (the defaults: element granularity, cuts at
/// multiples of 4096 from every tensor's start).
const sharded_options timed_options{};

/// The bucket plus the unsharded AdamW state (created on first use, warmed up by one step).
struct model : gradapt_bench::gpt2_bucket {
  model() : gpt2_bucket(true) {}
  std::vector<std::size_t> sizes() const {
    std::vector<std::size_t> s;
    for (std::size_t t = 0; t < params.size(); ++t) s.push_back(params[t].value.size());
    return s;
  }
};

model& the_model() {
  static model m;
  return m;
}

using adamw_state =
    decltype(the_adamw().init(gradapt::host{}, std::declval<const gradapt::param_list<float>&>()));

adamw_state& unsharded_state(int threads) {
  static std::optional<adamw_state> st;
  model& m = the_model();
  const gradapt::host b{.threads = threads};
  if (!st) {
    st.emplace(the_adamw().init(b, m.params));
    the_adamw().step(b, m.params, *st, {.lr = 1e-4});  // first touch of the state
  }
  return *st;
}

/// What sharded_optimizer::step runs for rank r of a plan of N ranks between the reduce-scatter
/// and the allgather: a list over r's pieces (values in the parameters, gradients in a gradient
/// shard buffer of shard_capacity() elements) and the chain's state over it.
struct shard_list {
  partition_plan plan;
  std::vector<float> grad;
  gradapt::param_list<float> list;

  shard_list(const model& m, int world, int rank)
      : plan(partition_plan::make(m.sizes(), world, timed_options.partition)),
        list(m.params.group(0).options) {
    grad.assign(plan.shard_capacity(), 0.0f);
    for (const piece& q : plan.pieces(rank)) {
      const auto& e = m.params[q.tensor];
      std::copy_n(e.grad.data() + q.offset, q.length, grad.data() + q.shard_offset);  // the averaged grads
      const bool whole = q.length == e.value.size();
      float* vp = e.value.data() + q.offset;
      float* gp = grad.data() + q.shard_offset;
      const auto n = static_cast<std::int64_t>(q.length);
      std::string name = e.name;
      if (!whole) name += "[" + std::to_string(q.offset) + ":" + std::to_string(q.offset + q.length) + ")";
      list.add(std::move(name),
               whole ? gradapt::tensor_view<float>(vp, e.value.shape())
                     : gradapt::tensor_view<float>::vector(vp, n),
               whole ? gradapt::tensor_view<float>(gp, e.value.shape())
                     : gradapt::tensor_view<float>::vector(gp, n),
               e.flags, e.group);
    }
  }
};

/// Checks that rank r's units in a sharded_optimizer over `m` on N comm::threads ranks are the
/// plan's pieces (what shard_list steps). Small packing rounds: the units do not depend on them.
bool units_are_pieces(const model& m, int world, int rank) {
  bool same = false;
  sharded_options o = timed_options;
  o.bucket_elements = 4096;
  gradapt::comm::run_threads(world, [&](gradapt::comm::threads& comm) {
    const gradapt::host b{.threads = 1};
    const sharded_optimizer opt(the_adamw(), o);
    auto s = opt.init(comm, b, m.params);
    if (comm.rank() != rank) return;
    const auto units = s.units();
    const auto pieces = s.plan().pieces(rank);
    same = units.size() == pieces.size();
    for (std::size_t i = 0; same && i < units.size(); ++i)
      same = units[i].tensor == pieces[i].tensor && units[i].offset == pieces[i].offset &&
             units[i].length == pieces[i].length && units[i].position == pieces[i].shard_offset;
  });
  return same;
}

void shard_step(benchmark::State& st) {
  model& m = the_model();
  const int world = static_cast<int>(st.range(0)), rank = static_cast<int>(st.range(1));
  const int threads = static_cast<int>(st.range(2));
  if (!units_are_pieces(m, world, rank)) {
    st.SkipWithError("the sharded optimizer's units for this rank are not the plan's pieces");
    return;
  }
  const gradapt::host b{.threads = threads};
  auto& full = unsharded_state(threads);
  shard_list sh(m, world, rank);
  auto sst = the_adamw().init(b, sh.list);
  the_adamw().step(b, sh.list, sst, {.lr = 1e-4});  // first touch of the shard's state
  std::vector<double> ratio, t_full, t_shard, tri;
  bool shard_first = false;  // alternated, so neither step always runs right after the triad
  for (auto _ : st) {
    const auto t0 = clock_type::now();
    m.triad(threads);
    const auto t1 = clock_type::now();
    double full_s = 0, shard_s = 0;
    for (int k = 0; k < 2; ++k) {
      const auto a = clock_type::now();
      if ((k == 0) == shard_first)
        the_adamw().step(b, sh.list, sst, {.lr = 1e-4});
      else
        the_adamw().step(b, m.params, full, {.lr = 1e-4});
      const auto e = clock_type::now();
      ((k == 0) == shard_first ? shard_s : full_s) = seconds(a, e);
    }
    shard_first = !shard_first;
    t_full.push_back(full_s);
    t_shard.push_back(shard_s);
    ratio.push_back(shard_s / full_s);
    tri.push_back(12.0 * static_cast<double>(m.n) / seconds(t0, t1) * 1e-9);
    st.SetIterationTime(shard_s);
  }
  st.counters["ratio"] = gradapt_bench::median_of(ratio);
  st.counters["target"] = 1.2 / world;
  const double share = static_cast<double>(sh.plan.shard_size(rank)) / static_cast<double>(m.n);
  st.counters["shard"] = share;
  st.counters["ratio_per_share"] = st.counters["ratio"] / share;  // 1: the same cost per element
  st.counters["pieces"] = static_cast<double>(sh.list.size());
  st.counters["unsharded_ms"] = 1e3 * gradapt_bench::median_of(t_full);
  st.counters["shard_ms"] = 1e3 * gradapt_bench::median_of(t_shard);
  st.counters["triad_GBps"] = gradapt_bench::median_of(tri);
}

/// One rank's parameters for the N-rank sharded step: its own values, the shared gradients.
struct rank_params {
  std::vector<float> p;
  gradapt::param_list<float> params;
  explicit rank_params(const model& m) : p(m.p) {
    std::size_t off = 0;
    for (std::size_t t = 0; t < m.params.size(); ++t) {
      const auto& e = m.params[t];
      params.add(e.name, gradapt::tensor_view<float>(p.data() + off, e.value.shape()), e.grad, e.flags,
                 e.group);
      off += e.value.size();
    }
  }
};

void sharded_step(benchmark::State& st) {
  using opt_type = sharded_optimizer<gradapt::adamw>;
  using state_type =
      decltype(std::declval<const opt_type&>().init(std::declval<gradapt::comm::threads&>(), gradapt::host{},
                                                    std::declval<const gradapt::param_list<float>&>()));
  model& m = the_model();
  const int world = static_cast<int>(st.range(0)), threads = static_cast<int>(st.range(1));
  const int per_rank = std::max(1, threads / world);
  const gradapt::host full_b{.threads = threads}, rank_b{.threads = per_rank};
  auto& full = unsharded_state(threads);
  const opt_type opt(the_adamw(), timed_options);
  auto comms = gradapt::comm::threads::create(world);
  std::vector<std::unique_ptr<rank_params>> ps;
  std::vector<std::optional<state_type>> ss(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) ps.push_back(std::make_unique<rank_params>(m));
  const auto on_ranks = [&](const std::function<void(int)>& f) {
    std::vector<std::thread> pool;
    for (int r = 0; r < world; ++r) pool.emplace_back(f, r);
    for (auto& t : pool) t.join();
  };
  on_ranks([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    ss[i].emplace(opt.init(comms[i], rank_b, ps[i]->params));
    opt.step(comms[i], rank_b, ps[i]->params, *ss[i], {.lr = 1e-4});  // first touch
  });
  std::vector<double> ratio, t_full, t_sharded;
  for (auto _ : st) {
    const auto t0 = clock_type::now();
    the_adamw().step(full_b, m.params, full, {.lr = 1e-4});
    const auto t1 = clock_type::now();
    on_ranks([&](int r) {
      const auto i = static_cast<std::size_t>(r);
      opt.step(comms[i], rank_b, ps[i]->params, *ss[i], {.lr = 1e-4});
    });
    const auto t2 = clock_type::now();
    t_full.push_back(seconds(t0, t1));
    t_sharded.push_back(seconds(t1, t2));
    ratio.push_back(seconds(t1, t2) / seconds(t0, t1));
    st.SetIterationTime(seconds(t1, t2));
  }
  st.counters["vs_unsharded"] = gradapt_bench::median_of(ratio);
  st.counters["threads_per_rank"] = per_rank;
  st.counters["unsharded_ms"] = 1e3 * gradapt_bench::median_of(t_full);
  st.counters["sharded_ms"] = 1e3 * gradapt_bench::median_of(t_sharded);
}

// ---- memory ----

constexpr int memory_worlds[] = {1, 2, 4, 8, 16, 64};
constexpr int measured_up_to = 8;  // comm::threads ranks created for the check against state_bytes()

/// One configuration's per-rank state bytes for one world size.
struct memory_row {
  std::string optimizer;
  int world = 1;
  double params = 0;                               ///< Psi
  std::size_t plan_max = 0, plan_min = 0;          ///< from the plan, over ranks
  std::size_t measured_max = 0, measured_min = 0;  ///< state_bytes() over ranks (0: not measured)
  bool measured = false;
  double zero = 0;       ///< K Psi / N (0: no formula)
  double unsharded = 0;  ///< the unsharded optimizer's state bytes
};

/// state_bytes() of every rank of a sharded state for `params` on N comm::threads ranks.
template <class M, class Opt, class PL>
std::vector<std::size_t> measured_bytes(const Opt& chain, const sharded_options& so, const PL& params,
                                        int world) {
  std::vector<std::size_t> out(static_cast<std::size_t>(world), 0);
  sharded_options o = so;
  o.bucket_elements = 4096;  // small packing buffers: they are not state
  gradapt::comm::run_threads(world, [&](gradapt::comm::threads& comm) {
    const gradapt::host b{.threads = 1};
    const sharded_optimizer opt(chain, o);
    const auto s = opt.template init<M>(comm, b, params);
    out[static_cast<std::size_t>(comm.rank())] = s.state_bytes();
  });
  return out;
}

/// Fills a row from per-rank plan bytes and (when measured) per-rank state_bytes(); false when
/// they differ.
bool fill(memory_row& row, const std::vector<std::size_t>& plan, const std::vector<std::size_t>& measured) {
  row.plan_max = *std::max_element(plan.begin(), plan.end());
  row.plan_min = *std::min_element(plan.begin(), plan.end());
  row.measured = !measured.empty();
  if (!row.measured) return true;
  row.measured_max = *std::max_element(measured.begin(), measured.end());
  row.measured_min = *std::min_element(measured.begin(), measured.end());
  return plan == measured;
}

/// The memory rows (AdamW fp32, AdamW on bfloat16 parameters with float master values,
/// Adafactor fp32 by whole tensors); `ok` is false when a measured state_bytes() differs from
/// the plan's.
std::vector<memory_row> memory_rows(bool& ok) {
  ok = true;
  const model& m = the_model();
  const auto sizes = m.sizes();
  const auto psi = static_cast<double>(m.n);
  std::vector<memory_row> rows;
  const gradapt::host b;
  const gradapt::adamw& adamw = the_adamw();
  const double adamw_unsharded =
      static_cast<double>(adamw.init(b, m.params).state_elements() * sizeof(float));

  // bfloat16 parameters and gradients of the same shapes.
  using bf = gradapt::bfloat16;
  std::vector<bf> pb(m.n), gb(m.n);
  for (std::size_t i = 0; i < m.n; ++i) pb[i] = bf(m.p[i]), gb[i] = bf(m.g[i]);
  gradapt::param_list<bf> bparams;
  std::size_t off = 0;
  for (std::size_t t = 0; t < m.params.size(); ++t) {
    const auto& e = m.params[t];
    bparams.add(e.name, gradapt::tensor_view<bf>(pb.data() + off, e.value.shape()),
                gradapt::tensor_view<bf>(gb.data() + off, e.value.shape()), e.flags, e.group);
    off += e.value.size();
  }

  // Adafactor: per-tensor state of the unsharded optimizer.
  const gradapt::adafactor adafactor({});
  const sharded_options by_tensor{.partition = {.mode = gradapt::shard::granularity::tensor}};
  std::vector<std::size_t> af_tensor(sizes.size(), 0);
  double af_unsharded = 0;
  {
    const auto s = adafactor.init(b, m.params);
    for (std::size_t j = 0; j < s.buffer_count(); ++j) {
      const auto bufs = s.buffer(j);
      for (std::size_t t = 0; t < bufs.size(); ++t) af_tensor[t] += bufs[t].size();
    }
    af_unsharded = static_cast<double>(s.state_elements() * sizeof(float));
  }

  for (const int n : memory_worlds) {
    const auto plan = partition_plan::make(sizes, n, timed_options.partition);
    const auto tplan = partition_plan::make(sizes, n, by_tensor.partition);
    std::vector<std::size_t> fp32(static_cast<std::size_t>(n)), master(fp32.size()), af(fp32.size());
    for (int r = 0; r < n; ++r) {
      const auto i = static_cast<std::size_t>(r);
      fp32[i] = 2 * sizeof(float) * plan.shard_size(r);
      master[i] = fp32[i] + sizeof(float) * plan.shard_capacity();  // master values: the whole capacity
      for (const piece& q : tplan.pieces(r)) af[i] += sizeof(float) * af_tensor[q.tensor];
    }
    const bool measure = n <= measured_up_to;
    memory_row a{"adamw_fp32", n, psi, 0, 0, 0, 0, false, 8.0 * psi / n, adamw_unsharded};
    ok &=
        fill(a, fp32,
             measure ? measured_bytes<void>(adamw, timed_options, m.params, n) : std::vector<std::size_t>{});
    memory_row c{"adamw_bf16_master", n, psi, 0, 0, 0, 0, false, 12.0 * psi / n, 12.0 * psi};
    ok &=
        fill(c, master,
             measure ? measured_bytes<float>(adamw, timed_options, bparams, n) : std::vector<std::size_t>{});
    memory_row d{"adafactor_fp32", n, psi, 0, 0, 0, 0, false, 0.0, af_unsharded};
    ok &=
        fill(d, af,
             measure ? measured_bytes<void>(adafactor, by_tensor, m.params, n) : std::vector<std::size_t>{});
    rows.push_back(a);
    rows.push_back(c);
    rows.push_back(d);
  }
  return rows;
}

void print_csv(const std::vector<memory_row>& rows) {
  std::printf(
      "optimizer,ranks,params,plan_max_bytes,plan_min_bytes,measured_max_bytes,measured_min_bytes,"
      "zero_formula_bytes,unsharded_bytes\n");
  for (const auto& r : rows) {
    std::printf("%s,%d,%.0f,%zu,%zu,", r.optimizer.c_str(), r.world, r.params, r.plan_max, r.plan_min);
    if (r.measured)
      std::printf("%zu,%zu,", r.measured_max, r.measured_min);
    else
      std::printf(",,");
    if (r.zero > 0)
      std::printf("%.0f,", r.zero);
    else
      std::printf(",");
    std::printf("%.0f\n", r.unsharded);
  }
}

void print_table(const std::vector<memory_row>& rows, bool ok) {
  std::printf(
      "\nper-rank optimizer state (MB = 1e6 B), max over ranks [min]; measured = state_bytes() on "
      "comm::threads (N <= %d)\n",
      measured_up_to);
  std::printf("%-18s %5s %12s %12s %10s %14s %10s %12s\n", "optimizer", "ranks", "plan MB", "measured MB",
              "min MB", "ZeRO K Psi/N", "max/ZeRO", "unsharded/N");
  for (const auto& r : rows) {
    char meas[32] = "-", zero[32] = "-", vs[32] = "-";
    if (r.measured) std::snprintf(meas, sizeof meas, "%.2f", r.measured_max * 1e-6);
    if (r.zero > 0) {
      std::snprintf(zero, sizeof zero, "%.2f", r.zero * 1e-6);
      std::snprintf(vs, sizeof vs, "%.4f", static_cast<double>(r.plan_max) / r.zero);
    }
    std::printf("%-18s %5d %12.2f %12s %10.2f %14s %10s %12.2f\n", r.optimizer.c_str(), r.world,
                r.plan_max * 1e-6, meas, r.plan_min * 1e-6, zero, vs, r.unsharded / r.world * 1e-6);
  }
  std::printf(
      "K = 8 (fp32 m, v), 12 (with the fp32 master copy); Psi = %.0f parameters. plan == measured: %s\n",
      rows.empty() ? 0.0 : rows.front().params, ok ? "yes" : "NO");
}

/// Removes `flag` from argv; true when it was there.
bool take_flag(int& argc, char** argv, const char* flag) {
  bool found = false;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], flag) == 0)
      found = true;
    else
      argv[out++] = argv[i];
  }
  argc = out;
  return found;
}

}  // namespace

int main(int argc, char** argv) {
  const bool csv_only = take_flag(argc, argv, "--memory-csv");
  const int rounds = gradapt_bench::take_rounds(argc, argv, 9);
  if (csv_only) {
    bool ok = true;
    const auto rows = memory_rows(ok);
    print_csv(rows);
    if (!ok) std::fprintf(stderr, "bench_shard: a measured state_bytes() differs from the plan's bytes\n");
    return ok ? 0 : 1;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const model& m = the_model();
  std::printf("%zu tensors, %.1fM fp32 parameters; AdamW; %d paired rounds, medians\n", m.params.size(),
              static_cast<double>(m.n) * 1e-6, rounds);
  for (const int n : {2, 4}) {
    const auto plan = partition_plan::make(m.sizes(), n, timed_options.partition);
    int largest = 0;
    for (int r = 1; r < n; ++r)
      if (plan.shard_size(r) > plan.shard_size(largest)) largest = r;
    std::vector<int> ranks{0, n - 1};
    if (largest != 0 && largest != n - 1) ranks.push_back(largest);
    for (const int r : ranks)
      for (const int t : {1, 2})
        benchmark::RegisterBenchmark("shard_step", shard_step)
            ->Args({n, r, t})
            ->ArgNames({"N", "rank", "threads"})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(rounds);
  }
  for (const int n : {2, 4})
    benchmark::RegisterBenchmark("sharded_step", sharded_step)
        ->Args({n, 2})
        ->ArgNames({"N", "threads"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(rounds);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  bool ok = true;
  const auto rows = memory_rows(ok);
  print_table(rows, ok);
  return ok ? 0 : 1;
}

// Elastic data-parallel training of the 64-32-10 ReLU MLP of the 8x8 handwritten digits
// (examples/data/digits.csv, 1797 images: 1497 to train, 300 held out) on 8 in-process ranks
// (comm::threads): one rank becomes 3x slower, gradapt::elastic::straggler_policy (an
// adaptive_job policy around a straggler_detector) raises it, and in run B asks for it to be
// dropped: the framework commits the training state and continues on a world without that rank.
// Two runs with the same seed are compared: A keeps the straggler (the policy only reports),
// B drops it.
//
// TIME IS SIMULATED AND DETERMINISTIC. The training itself is real (the composed step
// gradapt::train::make_data_parallel_step with gradapt::sgd, momentum 0.9, lr 0.1 for 8 ranks,
// on comm::threads), but the seconds are a model, the same on every machine and every run:
//
//   time-to-ready of the rank on node q at step k = B x c x slow_q(k) x j(seed, k, q)
//       B = 16 examples per rank (--batch), c = 2 ms per example (--example-cost),
//       slow_q(k) = 3 (--slowdown) for node 2 (--slow-node) from step 40 (--onset) on, else 1,
//       j = a jitter uniform in [0.7, 1.3] from a hash of (seed, k, q);
//   communication of a step on n ranks = 3 a + 2 (n - 1) / n x bytes / bw
//       three collectives of latency a = 0.5 ms each (--latency): the step's agreement (which
//       carries every rank's time-to-ready), the gradient allreduce and the policy's vote;
//       bytes = 2410 float gradients = 9640 bytes,
//       bw = 1.25 GB/s (--bandwidth), a ring allreduce's traffic; 0 on one rank;
//   wall time of a step = max over the ranks of time-to-ready + communication;
//   a resize (commit, end of the world, a new world, restore) = 1 s (--resize-cost).
//
// Every rank passes ITS time-to-ready to the step as step_args::ready_seconds (measured before
// the step, whose allreduce would hide it); the step's agreement gives every rank every rank's
// time, and the policy's detector (default options: window 20, persistence 5) reads them after
// the step (adaptive_job::step).
//
// Ranks live on nodes 0..7; a world is a list of nodes and a node's rank is its index in that
// list. Data: one fixed shuffle of the training set read as a stream; each step the world reads
// the next n x B examples, and the rank of index r takes the r-th block of B (digits_run.hpp's
// batch_of), so a step's batch depends on the step and the rank within the current world only.
//
// Events (steps counted from 1):
//   step 40 (--onset): node 2 becomes 3x slower and stays so;
//   run B only: at the step where the detector raises a rank, the ranks vote the policy's drop
//     request into job.decision(); every rank finishes the step, commits (step.save() and the
//     flat parameter vector, which the framework owns) and the world ends; a world without the
//     dropped nodes continues at the next step;
//   step 150 (--preempt): the last 2 nodes of the world (6 and 7) are preempted: the world
//     commits before that step and a world without them continues;
//   step 220 (--regrow): nodes 6 and 7 come back through the same commit/restore path.
// So run A goes 8 -> 6 -> 8 ranks and run B 8 -> 7 -> 5 -> 7. A new world builds a fresh step
// on the committed parameters, calls step.restore(bytes, rescale_rule::linear_lr) and makes a
// fresh job (and detector) for its size. linear_lr because the local batch is fixed per rank (it is what
// a rank computes), so the global batch follows the ranks, and the linear scaling rule keeps
// lr / global batch, i.e. the step per example seen, unchanged (keep_global_batch would need
// accumulation_steps x 8 / 7, not a whole number).
//
// The loss is the mean cross-entropy over the 1497 training images and the accuracy that of the
// 300 held-out images, evaluated after every step by all ranks on slices of the data (outside
// the simulated time), and at the start of each world on the restored parameters.
//
// Writes elastic_digits.csv (run, step, simulated seconds, world size, each node's
// time-to-ready, flagged and raised nodes, loss, held-out accuracy, throughput in examples/s),
// elastic_digits_step_time.svg (run B: each node's time-to-ready against the step with the
// events marked), elastic_digits_loss.svg and elastic_digits_throughput.svg (both runs against
// simulated time) into --out, prints the simulated time each run takes to reach the training
// loss --target (0.04) and their ratio, and ends with
//   "elastic: time to loss <T>: <b> s with the drop policy, <a> s without, ratio <r> <= 0.75;
//    straggler raised at step <s> (onset <o>); <m> restores continue the loss: PASS"
// PASS needs: both runs reach the target and the ratio is at most 0.75; in both runs the
// detector raises nothing before the onset and only the slow node after it, and in run B it
// raises that node within 20 steps of the onset; at every restore the loss on the new world
// before its first step equals the loss at the commit (to 1e-9 relative: the evaluation sums
// another number of slices) and the first step's loss is within a factor 1.25 of the last
// step's before the commit; the replicas are bitwise identical after every step and every rank
// commits the same bytes (the step is called without step_args::loss, which differs by rank).
// Otherwise the line ends in FAIL and the exit status is 1.
//
//   elastic_digits [--data examples/data/digits.csv] [--out docs/algorithms/img] [--steps 400]
//                  [--batch 16] [--lr 0.1] [--onset 40] [--slowdown 3] [--slow-node 2]
//                  [--preempt 150] [--regrow 220] [--target 0.04] [--example-cost 2e-3]
//                  [--latency 5e-4] [--bandwidth 1.25e9] [--resize-cost 1] [--seed 7]
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gradapt/elastic/policy.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/optim/sgd.hpp>
#include <gradapt/train/data_parallel_step.hpp>

#include "common/check.hpp"
#include "common/cli.hpp"
#include "common/digits_mlp.hpp"
#include "common/digits_run.hpp"
#include "common/svg_plot.hpp"

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

namespace dg = examples::digits;
using dg::dataset;
using dg::mlp;
using dg::split;
using gradapt::comm::threads;

constexpr int nodes = 8;           // ranks at the start
constexpr int preempted = 2;       // ranks the preemption takes and the regrowth gives back
constexpr double max_jump = 1.25;  // the first loss after a restore / the last before, at most

struct config {
  long steps = 400;
  int batch = 16;
  double lr = 0.1;  // for 8 ranks x 16 examples; rescaled by linear_lr on restore
  double momentum = 0.9;
  long onset = 40;
  double slowdown = 3.0;
  int slow_node = 2;
  long preempt = 150, regrow = 220;
  double target = 0.04;
  double example_cost = 2e-3;  // s per example
  double latency = 5e-4;       // s per collective
  double bandwidth = 1.25e9;   // bytes / s
  double resize_cost = 1.0;    // s per commit / restore
  unsigned seed = 7;

  /// A deterministic jitter in [0.7, 1.3) of node q at step k.
  double jitter(long k, int q) const {
    std::uint64_t x =
        (std::uint64_t{seed} << 40) ^ (static_cast<std::uint64_t>(k) << 8) ^ static_cast<std::uint64_t>(q);
    for (int i = 0; i < 2; ++i) {  // splitmix64, twice
      x += 0x9E3779B97F4A7C15ULL;
      x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
      x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
      x ^= x >> 31;
    }
    return 0.7 + 0.6 * static_cast<double>(x >> 11) * 0x1.0p-53;
  }
  /// Simulated time-to-ready of node q at step k (seconds).
  double ready(long k, int q) const {
    const double slow = q == slow_node && k >= onset ? slowdown : 1.0;
    return batch * example_cost * slow * jitter(k, q);
  }
  /// Simulated communication of one step on n ranks (seconds).
  double comm(int n) const {
    if (n <= 1) return 0.0;
    const double bytes = static_cast<double>(mlp::n_params * sizeof(float));
    return 3 * latency + 2.0 * (n - 1) / n * bytes / bandwidth;
  }
};

/// One step of a run, as rank 0 records it.
struct row {
  long step = 0;              ///< 1-based
  double seconds = 0;         ///< simulated clock after the step
  double step_seconds = 0;    ///< simulated wall time of the step
  int world = 0;              ///< ranks
  std::vector<double> ready;  ///< per node; NaN when the node is not in the world
  std::vector<int> flagged;   ///< nodes flagged after the step
  std::vector<int> raised;    ///< nodes raised at the step
  double loss = 0, accuracy = 0, throughput = 0;
};

/// One commit / restore between two worlds.
struct resize {
  long step = 0;              ///< first step on the new world
  double begin = 0, end = 0;  ///< simulated clock
  int from = 0, to = 0;       ///< ranks
  std::string why;            ///< what ended the old world
  double loss_commit = 0;     ///< loss at the commit (after the old world's last step)
  double loss_restored = 0;   ///< loss on the new world before its first step
  double loss_first = 0;      ///< loss after the new world's first step
  double lr = 0;              ///< the learning rate after restore
};

struct run_result {
  std::string name;
  bool policy = false;
  double loss0 = 0;  ///< loss at step 0
  std::vector<row> rows;
  std::vector<resize> resizes;
  bool identical = true;  ///< replicas bitwise identical after every step, the same bytes committed
};

void flatten(const mlp& m, std::vector<float>& out) {
  out.resize(mlp::n_params);
  auto it = std::copy(m.w1.begin(), m.w1.end(), out.begin());
  it = std::copy(m.b1.begin(), m.b1.end(), it);
  it = std::copy(m.w2.begin(), m.w2.end(), it);
  std::copy(m.b2.begin(), m.b2.end(), it);
}

void unflatten(const std::vector<float>& in, mlp& m) {
  auto it = in.begin();
  for (auto* v : {&m.w1, &m.b1, &m.w2, &m.b2}) {
    std::copy(it, it + static_cast<std::ptrdiff_t>(v->size()), v->begin());
    it += static_cast<std::ptrdiff_t>(v->size());
  }
}

/// One run: without (A) or with (B) the drop policy.
run_result train(const dataset& d, const split& s, const config& c, bool policy) {
  run_result out;
  out.policy = policy;
  out.name = policy ? "B: drop the straggler" : "A: keep the straggler";
  std::vector<int> world(nodes), standby;
  std::iota(world.begin(), world.end(), 0);
  std::vector<std::byte> committed;  // step.save() of the last world
  std::vector<float> params;         // the framework's parameters at the commit
  long next = 1;                     // first step of the next world
  long blocks = 0;                   // blocks of B examples read from the stream so far
  double clock = 0;
  while (next <= c.steps) {
    const int n = static_cast<int>(world.size());
    long last = c.steps;
    if (next < c.preempt)
      last = std::min(last, c.preempt - 1);
    else if (next < c.regrow)
      last = std::min(last, c.regrow - 1);
    struct slot {
      std::vector<std::byte> bytes;
      std::vector<float> params;
    };
    std::vector<slot> slots(static_cast<std::size_t>(n));
    dg::run_trace trace;
    dg::evaluator ev(d, s, n, trace);
    long ended = last;        // last step of this world
    std::vector<int> raised;  // nodes raised at `ended` (run B)
    double restored_loss = 0, restored_lr = 0;
    const long first = next, base = blocks;
    const double start_clock = clock;
    double end_clock = clock;
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      const int node = world[static_cast<std::size_t>(r)];
      const gradapt::host backend{.threads = 1};
      mlp model;  // the same initial weights on every rank (fixed seed)
      if (!params.empty()) unflatten(params, model);
      auto step = gradapt::train::make_data_parallel_step(
          comm, backend, model.params, gradapt::sgd({.lr = c.lr, .momentum = c.momentum}),
          {.lr = c.lr, .local_batch = static_cast<double>(c.batch)});
      if (!committed.empty()) step.restore(committed, gradapt::train::rescale_rule::linear_lr);
      using gradapt::elastic::straggler_response;
      gradapt::elastic::adaptive_job job(
          step, gradapt::elastic::straggler_policy(
                    {.response = policy ? straggler_response::drop : straggler_response::report}));
      ev.record(comm, model, first - 1, start_clock);  // the loss this world starts from
      if (r == 0) {
        restored_loss = trace.points.back().loss;
        restored_lr = step.settings().lr;
        out.identical = out.identical && trace.identical;
      }
      std::vector<int> idx(static_cast<std::size_t>(c.batch));
      double t = start_clock;
      long k = first;
      for (; k <= last; ++k) {
        dg::batch_of(c.batch, 1, s, base + (k - first) * n + r, 0, idx);
        model.loss(d, idx.data(), c.batch, true);  // this rank's gradient of its batch
        // This rank's time-to-ready (simulated), shared by the step's agreement; no
        // step_args::loss: it differs by rank and would make the commits differ.
        job.step({.ready_seconds = c.ready(k, node)});
        const auto& report = job.policy<0>().report();
        double slowest = 0;
        for (const int q : world) slowest = std::max(slowest, c.ready(k, q));
        const double dt = slowest + c.comm(n);
        t += dt;
        ev.record(comm, model, k, t);
        if (r == 0) {
          row w;
          w.step = k;
          w.seconds = t;
          w.step_seconds = dt;
          w.world = n;
          w.ready.assign(nodes, std::numeric_limits<double>::quiet_NaN());
          for (const int q : world) w.ready[static_cast<std::size_t>(q)] = c.ready(k, q);
          for (const int x : report.flagged) w.flagged.push_back(world[static_cast<std::size_t>(x)]);
          for (const int x : report.raised) w.raised.push_back(world[static_cast<std::size_t>(x)]);
          w.loss = trace.points.back().loss;
          w.accuracy = trace.points.back().accuracy;
          w.throughput = n * c.batch / dt;
          out.rows.push_back(std::move(w));
          out.identical = out.identical && trace.identical;
        }
        if (job.decision().resize()) {  // agreed by every rank (the policy's vote)
          if (r == 0)
            for (const int x : job.decision().drop_ranks)
              raised.push_back(world[static_cast<std::size_t>(x)]);
          break;
        }
      }
      // Commit: the step's state and the framework's parameters.
      auto& mine = slots[static_cast<std::size_t>(r)];
      mine.bytes = step.save();
      flatten(model, mine.params);
      comm.barrier();
      if (r == 0) {
        ended = std::min(k, last);
        end_clock = t;
        for (const auto& o : slots)
          if (o.bytes != slots[0].bytes || o.params != slots[0].params) out.identical = false;
        committed = slots[0].bytes;
        params = slots[0].params;
      }
    });
    if (first == 1) out.loss0 = trace.points.front().loss;
    if (!out.resizes.empty() && out.resizes.back().step == first) {
      auto& z = out.resizes.back();
      z.loss_restored = restored_loss;
      z.lr = restored_lr;
      for (const auto& w : out.rows)
        if (w.step == first) z.loss_first = w.loss;
    }
    blocks = base + (ended - first + 1) * n;
    clock = end_clock;
    next = ended + 1;
    if (next > c.steps) break;
    // The next world: without the raised nodes, then the scheduled preemption or regrowth.
    std::string why;
    for (const int q : raised) {
      world.erase(std::find(world.begin(), world.end(), q));
      why += "node " + std::to_string(q) + " raised and dropped";
    }
    if (next == c.preempt) {
      const int take = std::min(preempted, static_cast<int>(world.size()) - 1);
      for (int i = 0; i < take; ++i) standby.push_back(world.back()), world.pop_back();
      why += std::string(why.empty() ? "" : "; ") + std::to_string(take) + " ranks preempted";
    }
    if (next == c.regrow) {
      why += std::string(why.empty() ? "" : "; ") + std::to_string(standby.size()) + " ranks back";
      world.insert(world.end(), standby.begin(), standby.end());
      standby.clear();
      std::sort(world.begin(), world.end());
    }
    resize z;
    z.step = next;
    z.begin = clock;
    z.end = clock + c.resize_cost;
    z.from = n;
    z.to = static_cast<int>(world.size());
    z.why = why;
    z.loss_commit = out.rows.back().loss;
    out.resizes.push_back(z);
    clock = z.end;
  }
  return out;
}

/// The simulated seconds after the first step whose loss is at or below `target`; NaN if none.
double time_to(const run_result& r, double target, long* step = nullptr) {
  for (const auto& w : r.rows)
    if (w.loss <= target) {
      if (step) *step = w.step;
      return w.seconds;
    }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string join(const std::vector<int>& v) {
  std::string o;
  for (const int x : v) o += (o.empty() ? "" : ";") + std::to_string(x);
  return o;
}

constexpr const char* options[] = {"--data",    "--out",       "--steps",       "--batch",
                                   "--lr",      "--onset",     "--slowdown",    "--slow-node",
                                   "--preempt", "--regrow",    "--target",      "--example-cost",
                                   "--latency", "--bandwidth", "--resize-cost", "--seed"};

}  // namespace

int main(int argc, char** argv) {
  try {
    const examples::cli cl(argc, argv, "elastic_digits", options);
    const dataset d =
        examples::digits::load(cl.text("--data", GRADAPT_EXAMPLES_DATA_DIR "/digits.csv"), "elastic_digits");
    const std::string out_dir = cl.text("--out", "docs/algorithms/img");
    config c;
    c.steps = cl.count("--steps", c.steps, 1);
    c.batch = static_cast<int>(cl.count("--batch", c.batch, 1));
    c.lr = cl.number("--lr", c.lr);
    c.onset = cl.count("--onset", c.onset, 1);
    c.slowdown = cl.number("--slowdown", c.slowdown);
    c.slow_node = static_cast<int>(cl.count("--slow-node", c.slow_node, 0));
    examples::require(c.slow_node < nodes - preempted, "elastic_digits: --slow-node is ", c.slow_node,
                      " (expected 0 to ", nodes - preempted - 1, ": nodes ", nodes - preempted,
                      " and up are ", "the ones preempted)");
    c.preempt = cl.count("--preempt", c.preempt, 2);
    c.regrow = cl.count("--regrow", c.regrow, c.preempt + 1);
    c.target = cl.number("--target", c.target);
    c.example_cost = cl.number("--example-cost", c.example_cost);
    c.latency = cl.number("--latency", c.latency);
    c.bandwidth = cl.number("--bandwidth", c.bandwidth);
    examples::require(c.bandwidth > 0, "elastic_digits: --bandwidth is 0 (expected bytes per second > 0)");
    c.resize_cost = cl.number("--resize-cost", c.resize_cost);
    c.seed = static_cast<unsigned>(cl.count("--seed", c.seed, 0));

    std::vector<int> all(static_cast<std::size_t>(d.n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(c.seed));
    const std::size_t held_out = 300;
    examples::require(all.size() > held_out, "elastic_digits: the data holds ", all.size(),
                      " rows (expected more than ", held_out, ")");
    const split s{std::vector<int>(all.begin(), all.end() - static_cast<std::ptrdiff_t>(held_out)),
                  std::vector<int>(all.end() - static_cast<std::ptrdiff_t>(held_out), all.end())};
    std::printf(
        "64-32-10 MLP on %zu digits (%zu held out), %d ranks x %d examples, SGD momentum %g, lr %g for %d "
        "ranks (linear_lr on restore), %ld steps\n",
        s.train.size() + s.test.size(), s.test.size(), nodes, c.batch, c.momentum, c.lr, nodes, c.steps);
    std::printf(
        "simulated time: %g ms per example x jitter [0.7, 1.3], node %d x%g from step %ld; communication 3 x "
        "%g ms + 2(n-1)/n x %zu bytes / %g GB/s; %g s per resize; preemption of %d ranks at step %ld, back "
        "at step %ld\n",
        c.example_cost * 1e3, c.slow_node, c.slowdown, c.onset, c.latency * 1e3,
        mlp::n_params * sizeof(float), c.bandwidth * 1e-9, c.resize_cost, preempted, c.preempt, c.regrow);

    const run_result runs[2] = {train(d, s, c, false), train(d, s, c, true)};

    bool ok = true;
    long raised_at = -1;
    int restores = 0;
    for (const auto& r : runs) {
      std::printf("\n%s\n", r.name.c_str());
      for (const auto& w : r.rows)
        if (!w.raised.empty()) {
          std::printf("  step %ld: detector raises node %s\n", w.step, join(w.raised).c_str());
          for (const int q : w.raised) ok = ok && q == c.slow_node && w.step >= c.onset;
          if (r.policy && raised_at < 0) raised_at = w.step;
        }
      for (const auto& z : r.resizes) {
        const double jump = z.loss_first / z.loss_commit;
        const bool continuous = std::fabs(z.loss_restored - z.loss_commit) <= 1e-9 * z.loss_commit &&
                                jump <= max_jump && jump >= 1 / max_jump;
        ok = ok && continuous;
        ++restores;
        std::printf(
            "  before step %ld (%.2f s): %d -> %d ranks (%s); lr %g; loss %.5f at the commit, %.5f restored, "
            "%.5f after the first step (x%.3f)%s\n",
            z.step, z.begin, z.from, z.to, z.why.c_str(), z.lr, z.loss_commit, z.loss_restored, z.loss_first,
            jump, continuous ? "" : " NOT CONTINUOUS");
      }
      long st = 0;
      const double t = time_to(r, c.target, &st);
      const auto& e = r.rows.back();
      std::printf(
          "  reaches loss %g at step %ld, %.2f simulated s; final loss %.5f, held-out accuracy %.3f at "
          "%.2f s; replicas identical: %s\n",
          c.target, st, t, e.loss, e.accuracy, e.seconds, r.identical ? "yes" : "NO");
      ok = ok && r.identical;
    }
    const double ta = time_to(runs[0], c.target), tb = time_to(runs[1], c.target);
    const double ratio = tb / ta;
    ok = ok && std::isfinite(ta) && std::isfinite(tb) && ratio <= 0.75;
    ok = ok && raised_at >= c.onset && raised_at < c.onset + 20;
    std::printf(
        "\nelastic: time to loss %g: %.2f s with the drop policy, %.2f s without, ratio %.3f <= 0.75; "
        "straggler raised at step %ld (onset %ld); %d restores continue the loss: %s\n",
        c.target, tb, ta, ratio, raised_at, c.onset, restores, ok ? "PASS" : "FAIL");

    // CSV.
    std::ofstream csv(out_dir + "/elastic_digits.csv");
    csv << "run,step,seconds,world";
    for (int q = 0; q < nodes; ++q) csv << ",ready_node" << q;
    csv << ",flagged_nodes,raised_nodes,loss,accuracy,throughput\n";
    for (const auto& r : runs) {
      const char* tag = r.policy ? "B" : "A";
      csv << tag << ",0,0," << nodes;
      for (int q = 0; q < nodes; ++q) csv << ',';
      csv << ",," << r.loss0 << ",,\n";
      for (const auto& w : r.rows) {
        csv << tag << ',' << w.step << ',' << w.seconds << ',' << w.world;
        for (const double x : w.ready) {
          csv << ',';
          if (std::isfinite(x)) csv << x;
        }
        csv << ',' << join(w.flagged) << ',' << join(w.raised) << ',' << w.loss << ',' << w.accuracy << ','
            << w.throughput << '\n';
      }
    }
    if (!csv) examples::fail("elastic_digits: cannot write ", out_dir, "/elastic_digits.csv");

    // Step time of run B: each node's time-to-ready (a new series where a node rejoins).
    const run_result& b = runs[1];
    std::vector<examples::series> ready;
    for (int q = 0; q < nodes; ++q) {
      bool in = false;
      for (const auto& w : b.rows) {
        const double x = w.ready[static_cast<std::size_t>(q)];
        if (!std::isfinite(x)) {
          in = false;
          continue;
        }
        if (!in) {
          std::string name = "node " + std::to_string(q);
          if (q == c.slow_node) name += " (slowed)";
          if (w.step > 1) name += " (back)";
          ready.push_back({name, {}});
          in = true;
        }
        ready.back().points.emplace_back(static_cast<double>(w.step), x * 1e3);
      }
    }
    std::vector<std::pair<double, std::string>> marks;
    marks.emplace_back(static_cast<double>(c.onset), "node " + std::to_string(c.slow_node) + " slows");
    for (const auto& w : b.rows)
      if (!w.raised.empty())
        marks.emplace_back(static_cast<double>(w.step), "raised: node " + join(w.raised));
    for (const auto& z : b.resizes)
      marks.emplace_back(static_cast<double>(z.step) - 0.5,
                         std::to_string(z.from) + " -> " + std::to_string(z.to) + " ranks");
    examples::write_svg(out_dir + "/elastic_digits_step_time.svg", ready,
                        {.title = "Run B: each rank's time-to-ready (simulated) and the detector's decision",
                         .x_label = "step",
                         .y_label = "time-to-ready (simulated ms)",
                         .width = 960,
                         .height = 500,
                         .marks = marks});

    // Loss and throughput against simulated time, both runs.
    std::vector<examples::series> loss, thr;
    double t_max = 0;
    for (const auto& r : runs) {
      examples::series l{r.name, {{0.0, r.loss0}}}, h{r.name, {}};
      std::size_t z = 0;
      for (const auto& w : r.rows) {
        if (z < r.resizes.size() && r.resizes[z].step == w.step) {  // no examples while resizing
          h.points.emplace_back(r.resizes[z].begin, 0.0);
          h.points.emplace_back(r.resizes[z].end, 0.0);
          ++z;
        }
        l.points.emplace_back(w.seconds, w.loss);
        h.points.emplace_back(w.seconds - w.step_seconds, w.throughput);
        h.points.emplace_back(w.seconds, w.throughput);
      }
      t_max = std::max(t_max, r.rows.back().seconds);
      loss.push_back(std::move(l));
      thr.push_back(std::move(h));
    }
    loss.push_back({"target " + examples::detail::fmt(c.target), {{0.0, c.target}, {t_max, c.target}}});
    examples::write_svg(out_dir + "/elastic_digits_loss.svg", loss,
                        {.title = "Training loss against simulated time (8 ranks, one 3x straggler)",
                         .x_label = "simulated seconds",
                         .y_label = "training loss (1497 images)",
                         .width = 900,
                         .log_y = true});
    examples::write_svg(out_dir + "/elastic_digits_throughput.svg", thr,
                        {.title = "Throughput against simulated time (0 while resizing)",
                         .x_label = "simulated seconds",
                         .y_label = "examples per simulated second",
                         .width = 900});
    std::printf(
        "wrote %s/elastic_digits.csv, elastic_digits_step_time.svg, elastic_digits_loss.svg, "
        "elastic_digits_throughput.svg\n",
        out_dir.c_str());
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

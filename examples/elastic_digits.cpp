// Elastic data-parallel training of the 64-32-10 ReLU MLP of the 8x8 handwritten digits
// (examples/data/digits.csv, 1797 images: 1497 to train, 300 held out) on 8 in-process ranks
// (comm::threads): one rank becomes 3x slower, gradapt::elastic::straggler_policy (an
// adaptive_job policy around a straggler_detector) raises it, and in run B asks for it to be
// dropped: the framework commits the training state and continues on a world without that rank.
// Two runs with the same seed are compared: A keeps the straggler (the policy only reports),
// B drops it.
//
// TIME IS MEASURED (std::chrono::steady_clock), with the work of a larger model stood in for by
// sleeps. The training is real (the composed step gradapt::train::make_data_parallel_step with
// gradapt::sgd, momentum 0.9, lr 0.1 for 8 ranks, on comm::threads), and so are the times:
//
//   each step, the rank on node q computes the gradient of its B = 16 examples (--batch), then
//       sleeps B x c x slow_q(k) x j(seed, k, q): c = 0.5 ms per example (--example-cost),
//       slow_q(k) = 3 (--slowdown) for node 2 (--slow-node) from step 20 (--onset) on, else 1,
//       j a jitter uniform in [0.7, 1.3] from a hash of (seed, k, q). The sleep stands in for
//       the compute of a model larger than this MLP (whose gradient takes about 0.1 ms), and
//       makes the straggler really slow; sleeping ranks leave the 2 cores to the others;
//   time-to-ready of a rank = steady_clock from the start of its step to the end of its sleep,
//       measured, and passed to the step as step_args::ready_seconds;
//   a step on the clock = the slowest rank's measured time-to-ready (step.rank_times(), which
//       the step's agreement shares): what the step waits for before it can communicate;
//   a resize = steady_clock on rank 0 from the commit (step.save()) to the new world ready for
//       its first step (threads ended and started, a fresh step, step.restore, a fresh job, a
//       barrier): what it really took;
//   the clock = the sum of the steps and the resizes.
// Left off the clock: the evaluation after every step (not training), and the step's
// in-process collectives (the agreement, the gradient allreduce, the policy's vote). Those are
// memory copies between 8 threads that share 2 cores, and each wake-up of the 8 threads waits
// for the scheduler: 3 to 5 ms a step measured with other builds running, 20 ms and more with
// the cores kept busy, which says nothing about a network. Rank 0's wall clock with them (from
// the start of its step to the return of job.step) is printed and written too, not checked.
//
// So the numbers vary from run to run and machine to machine; the check below has margin for
// that (docs/algorithms/elastic.md has the measured spread).
//
// Every rank passes ITS measured time-to-ready to the step (measured before the step, whose
// allreduce would hide it); the step's agreement gives every rank every rank's time
// (step.rank_times()), and the policy's detector (default options: window 20, persistence 5)
// reads them after the step (adaptive_job::step).
//
// Ranks live on nodes 0..7; a world is a list of nodes and a node's rank is its index in that
// list. Data: one fixed shuffle of the training set read as a stream; each step the world reads
// the next n x B examples, and the rank of index r takes the r-th block of B (digits_run.hpp's
// batch_of), so a step's batch depends on the step and the rank within the current world only.
//
// Events (steps counted from 1):
//   step 20 (--onset): node 2 becomes 3x slower and stays so;
//   run B only: at the step where the detector raises a rank, the ranks vote the policy's drop
//     request into job.decision(); every rank finishes the step, commits (step.save() and the
//     flat parameter vector, which the framework owns) and the world ends; a world without the
//     dropped nodes continues at the next step (--drop-policy 0 makes run B only report, like
//     A: then B is no faster, and the check fails);
//   step 60 (--preempt): the last 2 nodes of the world (6 and 7) are preempted: the world
//     commits before that step and a world without them continues;
//   step 90 (--regrow): nodes 6 and 7 come back through the same commit/restore path.
// So run A goes 8 -> 6 -> 8 ranks and run B 8 -> 7 -> 5 -> 7. A new world builds a fresh step
// on the committed parameters, calls step.restore(bytes, rescale_rule::linear_lr) and makes a
// fresh job (and detector) for its size. linear_lr because the local batch is fixed per rank (it is what
// a rank computes), so the global batch follows the ranks, and the linear scaling rule keeps
// lr / global batch, i.e. the step per example seen, unchanged (keep_global_batch would need
// accumulation_steps x 8 / 7, not a whole number).
//
// The loss is the mean cross-entropy over the 1497 training images and the accuracy that of the
// 300 held-out images, evaluated after every step by all ranks on slices of the data (off the
// clock), and at the start of each world on the restored parameters. A run ends at the first
// step whose loss is at or below --target (0.08), or after --steps (400) steps.
//
// Writes elastic_digits.csv (run, step, seconds on the clock, world size, each node's measured
// time-to-ready, flagged and raised nodes, loss, held-out accuracy, throughput in examples per
// second of the clock, rank 0's wall clock), elastic_digits_step_time.svg (run B: each node's
// time-to-ready against the step with the events marked), elastic_digits_loss.svg and
// elastic_digits_throughput.svg (both runs against the clock) into --out, prints the time each
// run takes to reach the training loss --target and their ratio, and ends with
//   "elastic: time to loss <T>: <b> s with the drop policy, <a> s without, ratio <r> <= 0.75;
//    straggler raised at step <s> (onset <o>); <m> restores continue the loss: PASS"
// PASS needs: both runs reach the target and the ratio is at most 0.75 (measured 0.55 to 0.64,
// see docs/algorithms/elastic.md; with --drop-policy 0 it is about 1); in both runs the
// detector raises nothing before the onset and only the slow node after it, and in run B it
// raises that node within 20 steps of the onset; at every restore the loss on the new world
// before its first step equals the loss at the commit (to 1e-9 relative: the evaluation sums
// another number of slices) and the first step's loss is within a factor 1.25 of the last
// step's before the commit; the replicas are bitwise identical after every step and every rank
// commits the same bytes (the step is called without step_args::loss, which differs by rank).
// Otherwise the line ends in FAIL and the exit status is 1.
//
//   elastic_digits [--data examples/data/digits.csv] [--out docs/algorithms/img] [--steps 400]
//                  [--batch 16] [--lr 0.1] [--onset 20] [--slowdown 3] [--slow-node 2]
//                  [--preempt 60] [--regrow 90] [--target 0.08] [--example-cost 5e-4]
//                  [--drop-policy 1] [--seed 7]
#include <algorithm>
#include <chrono>
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
#include <thread>
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
using steady = std::chrono::steady_clock;

/// Seconds from `a` to now on the steady clock.
double since(steady::time_point a) { return std::chrono::duration<double>(steady::now() - a).count(); }

constexpr int nodes = 8;           // ranks at the start
constexpr int preempted = 2;       // ranks the preemption takes and the regrowth gives back
constexpr double max_jump = 1.25;  // the first loss after a restore / the last before, at most

struct config {
  long steps = 400;
  int batch = 16;
  double lr = 0.1;  // for 8 ranks x 16 examples; rescaled by linear_lr on restore
  double momentum = 0.9;
  long onset = 20;
  double slowdown = 3.0;
  int slow_node = 2;
  long preempt = 60, regrow = 90;
  double target = 0.08;
  double example_cost = 5e-4;  // s per example, slept (the work of a larger model)
  bool drop_policy = true;     // run B drops the raised rank (false: it only reports, as A)
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
  /// The sleep of node q at step k after its gradient (seconds).
  double work(long k, int q) const {
    const double slow = q == slow_node && k >= onset ? slowdown : 1.0;
    return batch * example_cost * slow * jitter(k, q);
  }
};

/// One step of a run, as rank 0 records it.
struct row {
  long step = 0;              ///< 1-based
  double seconds = 0;         ///< the clock after the step
  double step_seconds = 0;    ///< the step on the clock: the slowest rank's measured time-to-ready
  double wall = 0;            ///< rank 0's wall clock after the step (the collectives included)
  double wall_seconds = 0;    ///< rank 0's wall time of the step: start to the end of job.step
  int world = 0;              ///< ranks
  std::vector<double> ready;  ///< per node, measured time-to-ready; NaN when the node is not in the world
  std::vector<int> flagged;   ///< nodes flagged after the step
  std::vector<int> raised;    ///< nodes raised at the step
  double loss = 0, accuracy = 0, throughput = 0;
};

/// One commit / restore between two worlds.
struct resize {
  long step = 0;              ///< first step on the new world
  double begin = 0, end = 0;  ///< the clock (end - begin: the measured resize)
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
  out.name = !policy         ? "A: keep the straggler"
             : c.drop_policy ? "B: drop the straggler"
                             : "B: --drop-policy 0, keep the straggler";
  const bool drop = policy && c.drop_policy;
  std::vector<int> world(nodes), standby;
  std::iota(world.begin(), world.end(), 0);
  std::vector<std::byte> committed;  // step.save() of the last world
  std::vector<float> params;         // the framework's parameters at the commit
  long next = 1;                     // first step of the next world
  long blocks = 0;                   // blocks of B examples read from the stream so far
  double clock = 0;                  // the clock (see the file comment)
  double wall = 0;                   // rank 0's wall clock, the collectives included
  steady::time_point commit_at{};    // rank 0's steady clock at the last commit
  bool reached = false;              // the loss reached the target: the run ends
  while (next <= c.steps && !reached) {
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
    double restored_loss = 0, restored_lr = 0, resize_seconds = 0;
    const long first = next, base = blocks;
    double end_clock = clock, end_wall = wall;
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
                    {.response = drop ? straggler_response::drop : straggler_response::report}));
      comm.barrier();  // every rank is ready for the first step: the resize ends here
      double t = clock, tw = wall;
      if (r == 0 && !committed.empty()) {
        resize_seconds = since(commit_at);
        t += resize_seconds;
        tw += resize_seconds;
      }
      ev.record(comm, model, first - 1, t);  // the loss this world starts from
      if (r == 0) {
        restored_loss = trace.points.back().loss;
        restored_lr = step.settings().lr;
        out.identical = out.identical && trace.identical;
      }
      std::vector<int> idx(static_cast<std::size_t>(c.batch));
      long k = first;
      for (; k <= last; ++k) {
        // The evaluation before this step ended in a barrier: the ranks start together.
        const auto start = steady::now();
        dg::batch_of(c.batch, 1, s, base + (k - first) * n + r, 0, idx);
        model.loss(d, idx.data(), c.batch, true);  // this rank's gradient of its batch
        std::this_thread::sleep_for(std::chrono::duration<double>(c.work(k, node)));  // the larger model
        // This rank's measured time-to-ready, shared by the step's agreement; no
        // step_args::loss: it differs by rank and would make the commits differ.
        job.step({.ready_seconds = since(start)});
        const double wall_dt = since(start);   // with the collectives, which waited for the slowest rank
        const auto times = step.rank_times();  // every rank's measured time-to-ready, the same on every rank
        const double dt = times.empty() ? wall_dt : *std::max_element(times.begin(), times.end());
        t += dt;
        tw += wall_dt;
        const auto& report = job.policy<0>().report();
        ev.record(comm, model, k, t);  // off the clock
        if (r == 0) {
          row w;
          w.step = k;
          w.seconds = t;
          w.step_seconds = dt;
          w.wall = tw;
          w.wall_seconds = wall_dt;
          w.world = n;
          w.ready.assign(nodes, std::numeric_limits<double>::quiet_NaN());
          for (std::size_t x = 0; x < times.size(); ++x)
            w.ready[static_cast<std::size_t>(world[x])] = times[x];
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
        // Rank 0's evaluation, which every rank reads after the evaluation's last barrier.
        if (trace.points.back().loss <= c.target) break;
      }
      // Commit: the step's state and the framework's parameters.
      if (r == 0) commit_at = steady::now();
      auto& mine = slots[static_cast<std::size_t>(r)];
      mine.bytes = step.save();
      flatten(model, mine.params);
      comm.barrier();
      if (r == 0) {
        ended = std::min(k, last);
        end_clock = t;
        end_wall = tw;
        for (const auto& o : slots)
          if (o.bytes != slots[0].bytes || o.params != slots[0].params) out.identical = false;
        committed = slots[0].bytes;
        params = slots[0].params;
      }
    });
    if (first == 1) out.loss0 = trace.points.front().loss;
    if (!out.resizes.empty() && out.resizes.back().step == first) {
      auto& z = out.resizes.back();
      z.end = z.begin + resize_seconds;
      z.loss_restored = restored_loss;
      z.lr = restored_lr;
      for (const auto& w : out.rows)
        if (w.step == first) z.loss_first = w.loss;
    }
    blocks = base + (ended - first + 1) * n;
    clock = end_clock;
    wall = end_wall;
    next = ended + 1;
    reached = !out.rows.empty() && out.rows.back().loss <= c.target;
    if (next > c.steps || reached) break;
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
    z.end = clock;  // + the measured resize, once the next world is ready
    z.from = n;
    z.to = static_cast<int>(world.size());
    z.why = why;
    z.loss_commit = out.rows.back().loss;
    out.resizes.push_back(z);
  }
  return out;
}

/// The clock (or, with `on_wall`, rank 0's wall clock) after the first step whose loss is at or
/// below `target`; NaN if none.
double time_to(const run_result& r, double target, long* step = nullptr, bool on_wall = false) {
  for (const auto& w : r.rows)
    if (w.loss <= target) {
      if (step) *step = w.step;
      return on_wall ? w.wall : w.seconds;
    }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string join(const std::vector<int>& v) {
  std::string o;
  for (const int x : v) o += (o.empty() ? "" : ";") + std::to_string(x);
  return o;
}

constexpr const char* options[] = {"--data",   "--out",          "--steps",       "--batch",   "--lr",
                                   "--onset",  "--slowdown",     "--slow-node",   "--preempt", "--regrow",
                                   "--target", "--example-cost", "--drop-policy", "--seed"};

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
    const long drop_policy = cl.count("--drop-policy", 1, 0);
    examples::require(drop_policy <= 1, "elastic_digits: --drop-policy is ", drop_policy,
                      " (expected 1: run B drops the raised rank, or 0: it only reports)");
    c.drop_policy = drop_policy == 1;
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
        "measured time (steady_clock): each rank's gradient, then a sleep of %g ms per example x jitter "
        "[0.7, 1.3], node %d x%g from step %ld; the clock adds each step's slowest time-to-ready and each "
        "resize (commit to restored); preemption of %d ranks at step %ld, back at step %ld; run B %s; a run "
        "ends at loss %g or after %ld steps\n",
        c.example_cost * 1e3, c.slow_node, c.slowdown, c.onset, preempted, c.preempt, c.regrow,
        c.drop_policy ? "drops the raised rank" : "only reports (--drop-policy 0)", c.target, c.steps);

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
            "  before step %ld (%.2f s, resize %.1f ms): %d -> %d ranks (%s); lr %g; loss %.5f at the "
            "commit, %.5f restored, %.5f after the first step (x%.3f)%s\n",
            z.step, z.begin, (z.end - z.begin) * 1e3, z.from, z.to, z.why.c_str(), z.lr, z.loss_commit,
            z.loss_restored, z.loss_first, jump, continuous ? "" : " NOT CONTINUOUS");
      }
      // Mean step from the onset on, per world size: on the clock (the slowest rank's
      // time-to-ready) and on rank 0's wall clock (the collectives included).
      std::string means;
      for (int n = nodes; n >= 1; --n) {
        double sum = 0, sum_wall = 0;
        long count = 0;
        for (const auto& w : r.rows)
          if (w.step >= c.onset && w.world == n) sum += w.step_seconds, sum_wall += w.wall_seconds, ++count;
        if (count > 0) {
          char buf[96];
          std::snprintf(buf, sizeof buf, "%s%.1f ms (%.1f ms wall) on %d ranks", means.empty() ? "" : ", ",
                        sum / count * 1e3, sum_wall / count * 1e3, n);
          means += buf;
        }
      }
      std::printf("  mean step from step %ld on: %s\n", c.onset, means.c_str());
      long st = 0;
      const double t = time_to(r, c.target, &st);
      const auto& e = r.rows.back();
      std::printf(
          "  reaches loss %g at step %ld, %.2f s on the clock (%.2f s wall); last step %ld: loss %.5f, "
          "held-out accuracy %.3f; replicas identical: %s\n",
          c.target, st, t, e.wall, e.step, e.loss, e.accuracy, r.identical ? "yes" : "NO");
      ok = ok && r.identical;
    }
    const double ta = time_to(runs[0], c.target), tb = time_to(runs[1], c.target);
    const double ratio = tb / ta;
    const double wa = time_to(runs[0], c.target, nullptr, true),
                 wb = time_to(runs[1], c.target, nullptr, true);
    std::printf(
        "\nwall clock with the collectives (not checked: on 2 shared cores their time is the scheduler's): "
        "%.2f s with the drop policy, %.2f s without, ratio %.3f\n",
        wb, wa, wb / wa);
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
    csv << ",flagged_nodes,raised_nodes,loss,accuracy,throughput,wall_seconds\n";
    for (const auto& r : runs) {
      const char* tag = r.policy ? "B" : "A";
      csv << tag << ",0,0," << nodes;
      for (int q = 0; q < nodes; ++q) csv << ',';
      csv << ",," << r.loss0 << ",,,0\n";
      for (const auto& w : r.rows) {
        csv << tag << ',' << w.step << ',' << w.seconds << ',' << w.world;
        for (const double x : w.ready) {
          csv << ',';
          if (std::isfinite(x)) csv << x;
        }
        csv << ',' << join(w.flagged) << ',' << join(w.raised) << ',' << w.loss << ',' << w.accuracy << ','
            << w.throughput << ',' << w.wall << '\n';
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
                        {.title = "Run B: each rank's measured time-to-ready and the detector's decision",
                         .x_label = "step",
                         .y_label = "time-to-ready (measured ms)",
                         .width = 960,
                         .height = 500,
                         .marks = marks});

    // Loss and throughput against measured time, both runs.
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
                        {.title = "Training loss against the clock (8 ranks, one 3x straggler)",
                         .x_label = "seconds on the clock (each step's slowest time-to-ready, the resizes)",
                         .y_label = "training loss (1497 images)",
                         .width = 900,
                         .log_y = true});
    examples::write_svg(out_dir + "/elastic_digits_throughput.svg", thr,
                        {.title = "Throughput against the clock (0 while resizing)",
                         .x_label = "seconds on the clock (each step's slowest time-to-ready, the resizes)",
                         .y_label = "examples per second of the clock",
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

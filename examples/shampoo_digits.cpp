// Shampoo against AdamW and LAMB on the 64-32-10 ReLU MLP of the 8x8 handwritten digits
// (examples/data/digits.csv, 1797 images: 1497 to train, 300 held out), data-parallel on N
// in-process ranks (comm::threads, N = 4 by default).
//
// Every run sees the same stream of examples: at step t rank r takes training examples
// (t N + r) B .. (t N + r) B + B - 1 of one fixed shuffle (B = 16 per rank, 64 per step), sums
// the gradient bucket with one allreduce and divides it by N, then steps its optimizer. Every
// run has the same learning-rate schedule shape: a linear warm-up over 20 steps to the peak
// rate, then a cosine decay to 0 at the last step (600 steps, about 26 epochs). Weight decay
// 1e-4 on the weight matrices (the biases are flagged skip_weight_decay) for every optimizer.
//
//   AdamW    gradapt::adamw (b1 0.9, b2 0.999, eps 1e-8);
//   LAMB     gradapt::lamb (the same moments, eps 1e-6, no clipping);
//   Shampoo  gradapt::shampoo with the Adam graft (graft_beta2 0.999, graft_epsilon 1e-8),
//            heavy-ball momentum 0.9 (the SGD chain's; it plays Adam's first moment), summed
//            statistics (beta2 1), roots every 10 steps from step 10 (eigendecomposition,
//            relative ridge 1e-6), distributed over the ranks with shampoo::step(comm, ...).
//            fc1.weight (32 x 64) is one block with a 32 x 32 and a 64 x 64 factor, fc2.weight
//            (10 x 32) one block with a 10 x 10 and a 32 x 32 factor (merge_small_dims off: its
//            320 elements would merge into one dimension and make it a full-matrix 320 x 320
//            preconditioner); the biases take the Adam graft alone;
//   Shampoo (async roots)  the same with root_staleness 10: each rank's worker thread computes
//            its blocks' roots while the next 10 steps run on the previous roots.
//
// Learning rates: each optimizer's peak rate is the one with the lowest final training loss on
// the grid 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1 at the defaults above
// (`shampoo_digits --grid 1` runs it and prints the table; docs/algorithms/shampoo.md,
// "Example", shows the measured one). Chosen: AdamW 0.1, LAMB 1e-2, Shampoo 1e-2, Shampoo
// (async) 1e-2. Shampoo's heavy-ball momentum sums the directions where Adam averages them
// (a factor 1 / (1 - 0.9) = 10), so its best rate sits about 10x below AdamW's.
//
// The loss is the mean cross-entropy over the 1497 training images, and the accuracy the
// fraction of the 300 held-out images classified correctly, both evaluated every `--eval-every`
// steps (default 5) and after the last one, by all ranks on slices of the data, outside the
// timed part. The seconds are the wall time of the training steps alone (batch gradient,
// allreduce, optimizer step) on rank 0, summed; with more ranks than cores they include the
// waits for descheduled ranks, so they vary from run to run.
//
// Writes shampoo_digits.csv (optimizer, step, seconds, loss, accuracy), shampoo_digits_steps.svg
// (loss against steps) and shampoo_digits_time.svg (loss against wall time) into --out, prints
// the final losses, and ends with the check
//   "shampoo: reaches AdamW's final loss <L> at step <s> of <S> (<r>x fewer steps): PASS"
// where s is the first evaluated step at which the Shampoo run's loss is at or below AdamW's
// final loss L (a multiple of --eval-every: the crossing lies in the --eval-every steps before
// it) and r = S / s. PASS needs s < S and bitwise identical replicas at the end of
// every run; otherwise the line ends in FAIL (or reads "shampoo: does not reach AdamW's final
// loss <L> in <S> steps: FAIL") and the exit status is 1.
//
//   shampoo_digits [--data examples/data/digits.csv] [--out .] [--ranks 4] [--steps 600]
//                  [--batch 16] [--warmup 20] [--weight-decay 1e-4] [--lr-adamw 0.1]
//                  [--lr-lamb 1e-2] [--lr-shampoo 1e-2] [--lr-async 1e-2]
//                  [--precondition-frequency 10] [--start 10] [--staleness 10]
//                  [--merge-small-dims 0] [--async 1] [--eval-every 5] [--grid 0] [--seed 7]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <gradapt/gradapt.hpp>
#include <gradapt/linalg/host_lapack.hpp>
#include <gradapt/optim/adamw.hpp>
#include <gradapt/optim/lamb.hpp>
#include <gradapt/optim/shampoo.hpp>

#include "common/check.hpp"
#include "common/cli.hpp"
#include "common/digits_mlp.hpp"
#include "common/digits_run.hpp"
#include "common/svg_plot.hpp"

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

using examples::digits::allreduce_mean;
using examples::digits::batch_of;
using examples::digits::dataset;
using examples::digits::evaluator;
using examples::digits::mlp;
using examples::digits::point;
using examples::digits::split;
using gradapt::comm::threads;

enum class method { adamw, lamb, shampoo, shampoo_async };

const char* name_of(method m) {
  switch (m) {
    case method::adamw:
      return "AdamW";
    case method::lamb:
      return "LAMB";
    case method::shampoo:
      return "Shampoo";
    case method::shampoo_async:
      return "Shampoo (async roots)";
  }
  return "?";
}

struct config {
  int ranks = 4;
  int batch = 16;
  long steps = 600;
  long warmup = 20;
  double weight_decay = 1e-4;
  double lr_adamw = 0.1, lr_lamb = 1e-2, lr_shampoo = 1e-2, lr_async = 1e-2;
  std::uint64_t precondition_frequency = 10, start = 10, staleness = 10;
  bool merge_small_dims = false;
  bool async = true;
  long eval_every = 5;
  unsigned seed = 7;

  /// The learning rate of step t for peak rate `peak`: linear warm-up over `warmup` steps,
  /// then a cosine decay to 0 at step `steps`.
  double lr_at(long t, double peak) const {
    if (t < warmup) return peak * static_cast<double>(t + 1) / static_cast<double>(warmup);
    const double x = static_cast<double>(t - warmup) / static_cast<double>(std::max(1L, steps - warmup));
    return peak * 0.5 * (1.0 + std::cos(3.14159265358979323846 * x));
  }

  gradapt::shampoo_options shampoo(bool with_async) const {
    return {.max_preconditioner_dim = 1024,
            .merge_small_dims = merge_small_dims,
            .precondition_frequency = precondition_frequency,
            .start_preconditioning_step = start,
            .root_staleness = with_async ? staleness : 0,
            .graft = gradapt::shampoo_graft::adam,
            .graft_beta2 = 0.999,
            .graft_epsilon = 1e-8,
            .momentum = 0.9,
            .weight_decay = weight_decay};
  }
};

struct run_result : examples::digits::run_trace {
  std::string name;
  double lr = 0;
  double final_loss = 0;
  double seconds = 0;                ///< training steps' wall time on rank 0
  std::vector<std::uint64_t> roots;  ///< Shampoo: block root computations per rank
};

/// One run of method m at peak rate `lr`; evaluates every `eval_every` steps and after the last.
run_result train(const dataset& d, const split& s, const config& c, method m, double lr, long eval_every) {
  run_result out;
  out.name = name_of(m);
  out.lr = lr;
  out.roots.assign(static_cast<std::size_t>(c.ranks), 0);
  evaluator ev(d, s, c.ranks, out);
  gradapt::comm::run_threads(c.ranks, [&](threads& comm) {
    const gradapt::host backend{.threads = 1};
    mlp model;  // the same initial weights on every rank (fixed seed)
    std::vector<int> idx(static_cast<std::size_t>(c.batch));
    const auto loop = [&](auto&& opt_step) {
      double seconds = 0;
      for (long t = 0; t < c.steps; ++t) {
        if (t % eval_every == 0) ev.record(comm, model, t, seconds);
        const auto t0 = std::chrono::steady_clock::now();
        batch_of(c.batch, c.ranks, s, t, comm.rank(), idx);
        model.loss(d, idx.data(), c.batch, true);
        allreduce_mean(comm, backend, model);
        opt_step(c.lr_at(t, lr));
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      ev.record(comm, model, c.steps, seconds);
      if (comm.rank() == 0) out.seconds = seconds;
    };
    switch (m) {
      case method::adamw: {
        const gradapt::adamw opt({.weight_decay = c.weight_decay});
        auto st = opt.init(backend, model.params);
        loop([&](double l) { opt.step(backend, model.params, st, {.lr = l}); });
        break;
      }
      case method::lamb: {
        const gradapt::lamb opt({.weight_decay = c.weight_decay});
        auto st = opt.init(backend, model.params);
        loop([&](double l) { opt.step(backend, model.params, st, {.lr = l}); });
        break;
      }
      case method::shampoo:
      case method::shampoo_async: {
        const gradapt::shampoo opt(c.shampoo(m == method::shampoo_async));
        auto st = opt.init(backend, model.params);
        loop([&](double l) { opt.step(comm, backend, model.params, st, {.lr = l}); });
        out.roots[static_cast<std::size_t>(comm.rank())] =
            st.preconditioner().root_computations();  // own slot
        break;
      }
    }
  });
  out.final_loss = out.points.back().loss;
  return out;
}

/// The first evaluated step whose loss is at or below `target`, or -1.
long first_reaching(const run_result& r, double target) {
  for (const auto& p : r.points)
    if (p.loss <= target) return p.step;
  return -1;
}

constexpr const char* options[] = {"--data",         "--out",        "--ranks",
                                   "--steps",        "--batch",      "--warmup",
                                   "--weight-decay", "--lr-adamw",   "--lr-lamb",
                                   "--lr-shampoo",   "--lr-async",   "--precondition-frequency",
                                   "--start",        "--staleness",  "--merge-small-dims",
                                   "--async",        "--eval-every", "--grid",
                                   "--seed"};

/// `--grid 1`: every method at every rate of the grid, final losses only; prints the table and
/// each method's best rate.
void grid(const dataset& d, const split& s, const config& c, const std::vector<method>& methods) {
  const double rates[] = {1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0};
  std::printf("\nfinal training loss after %ld steps, by peak learning rate\n%-22s", c.steps, "lr");
  for (const double r : rates) std::printf(" %9g", r);
  std::printf("  best\n");
  for (const method m : methods) {
    std::printf("%-22s", name_of(m));
    std::fflush(stdout);
    double best = std::numeric_limits<double>::infinity(), best_lr = 0;
    for (const double r : rates) {
      const auto res = train(d, s, c, m, r, c.steps);
      std::printf(" %9.3g", res.final_loss);
      std::fflush(stdout);
      if (std::isfinite(res.final_loss) && res.final_loss < best) best = res.final_loss, best_lr = r;
    }
    std::printf("  %g\n", best_lr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const examples::cli cl(argc, argv, "shampoo_digits", options);
    const dataset d =
        examples::digits::load(cl.text("--data", GRADAPT_EXAMPLES_DATA_DIR "/digits.csv"), "shampoo_digits");
    const std::string out_dir = cl.text("--out", ".");
    config c;
    const auto num = [&](const char* name, double def) { return cl.number(name, def); };
    const auto count = [&](const char* name, long def, long min) { return cl.count(name, def, min); };
    c.ranks = static_cast<int>(count("--ranks", c.ranks, 1));
    c.steps = count("--steps", c.steps, 1);
    c.batch = static_cast<int>(count("--batch", c.batch, 1));
    c.warmup = count("--warmup", c.warmup, 0);
    c.weight_decay = num("--weight-decay", c.weight_decay);
    c.lr_adamw = num("--lr-adamw", c.lr_adamw);
    c.lr_lamb = num("--lr-lamb", c.lr_lamb);
    c.lr_shampoo = num("--lr-shampoo", c.lr_shampoo);
    c.lr_async = num("--lr-async", c.lr_async);
    c.precondition_frequency = static_cast<std::uint64_t>(count("--precondition-frequency", 10, 1));
    c.start = static_cast<std::uint64_t>(count("--start", 10, 1));
    c.staleness = static_cast<std::uint64_t>(count("--staleness", 10, 1));
    c.merge_small_dims = count("--merge-small-dims", 0, 0) != 0;
    c.async = count("--async", 1, 0) != 0;
    c.eval_every = count("--eval-every", c.eval_every, 1);
    const bool run_grid = count("--grid", 0, 0) != 0;
    c.seed = static_cast<unsigned>(count("--seed", c.seed, 0));
    // Shampoo validates its own options (and names a bad one) before any rank starts.
    (void)gradapt::shampoo(c.shampoo(c.async));

    std::vector<int> all(static_cast<std::size_t>(d.n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(c.seed));
    const std::size_t held_out = 300;
    examples::require(all.size() > held_out, "shampoo_digits: the data holds ", all.size(),
                      " rows (expected more than ", held_out, ")");
    const split s{std::vector<int>(all.begin(), all.end() - static_cast<std::ptrdiff_t>(held_out)),
                  std::vector<int>(all.end() - static_cast<std::ptrdiff_t>(held_out), all.end())};
    std::printf(
        "64-32-10 MLP on %zu digits (%zu held out), %d ranks x %d examples per step, %ld steps; peak rate "
        "after a %ld-step warm-up, cosine decay to 0; weight decay %g\n",
        s.train.size() + s.test.size(), s.test.size(), c.ranks, c.batch, c.steps, c.warmup, c.weight_decay);
    std::printf(
        "Shampoo: Adam graft, momentum 0.9, roots every %llu steps from step %llu (distributed over the "
        "ranks), merge_small_dims %s; async variant: root_staleness %llu\n",
        static_cast<unsigned long long>(c.precondition_frequency), static_cast<unsigned long long>(c.start),
        c.merge_small_dims ? "on" : "off", static_cast<unsigned long long>(c.staleness));

    std::vector<method> methods{method::adamw, method::lamb, method::shampoo};
    if (c.async) methods.push_back(method::shampoo_async);
    if (run_grid) {
      grid(d, s, c, methods);
      return 0;
    }
    std::vector<run_result> runs;
    for (const method m : methods) {
      const double lr = m == method::adamw     ? c.lr_adamw
                        : m == method::lamb    ? c.lr_lamb
                        : m == method::shampoo ? c.lr_shampoo
                                               : c.lr_async;
      runs.push_back(train(d, s, c, m, lr, c.eval_every));
    }

    std::printf("\n%-22s %8s %10s %9s %8s %8s\n", "optimizer", "peak lr", "final loss", "accuracy", "in sync",
                "time s");
    for (const auto& r : runs)
      std::printf("%-22s %8g %10.5f %9.3f %8s %8.2f\n", r.name.c_str(), r.lr, r.final_loss,
                  r.points.back().accuracy, r.identical ? "yes" : "NO", r.seconds);

    for (const auto& r : runs) {
      if (r.name.rfind("Shampoo", 0) != 0) continue;
      std::printf("%s: block root computations per rank:", r.name.c_str());
      for (const auto n : r.roots) std::printf(" %llu", static_cast<unsigned long long>(n));
      std::printf("\n");
    }
    const auto& adamw = runs[0];
    const double target = adamw.final_loss;
    for (std::size_t i = 1; i < runs.size(); ++i) {
      const long at = first_reaching(runs[i], target);
      if (at < 0) {
        std::printf("%s: does not reach AdamW's final loss %.5f in %ld steps\n", runs[i].name.c_str(), target,
                    c.steps);
        continue;
      }
      const auto& p = *std::find_if(runs[i].points.begin(), runs[i].points.end(),
                                    [&](const point& q) { return q.step == at; });
      std::printf("%s: reaches AdamW's final loss %.5f at step %ld (%.2f s; AdamW: step %ld, %.2f s)\n",
                  runs[i].name.c_str(), target, at, p.seconds, c.steps, adamw.seconds);
    }

    // The check: Shampoo reaches AdamW's final training loss before AdamW's last step, and every
    // run ends with bitwise identical replicas.
    bool in_sync = true;
    for (const auto& r : runs) in_sync = in_sync && r.identical && std::isfinite(r.final_loss);
    std::printf("replicas bitwise identical at the end of every run: %s\n", in_sync ? "yes" : "NO");
    const long s_at = first_reaching(runs[2], target);
    const bool ok = s_at >= 0 && s_at < c.steps && in_sync;
    if (s_at < 0)
      std::printf("shampoo: does not reach AdamW's final loss %.5f in %ld steps: FAIL\n", target, c.steps);
    else
      std::printf("shampoo: reaches AdamW's final loss %.5f at step %ld of %ld (%.2fx fewer steps): %s\n",
                  target, s_at, c.steps,
                  static_cast<double>(c.steps) / static_cast<double>(std::max(1L, s_at)),
                  ok ? "PASS" : "FAIL");

    std::ofstream csv(out_dir + "/shampoo_digits.csv");
    csv << "optimizer,step,seconds,loss,accuracy\n";
    for (const auto& r : runs)
      for (const auto& p : r.points)
        csv << '"' << r.name << "\"," << p.step << ',' << p.seconds << ',' << p.loss << ',' << p.accuracy
            << '\n';
    if (!csv) examples::fail("shampoo_digits: cannot write ", out_dir, "/shampoo_digits.csv");
    std::vector<examples::series> by_step, by_time;
    for (const auto& r : runs) {
      char label[96];
      std::snprintf(label, sizeof label, "%s, lr %g", r.name.c_str(), r.lr);
      examples::series a{label, {}}, b{label, {}};
      for (const auto& p : r.points) {
        a.points.emplace_back(static_cast<double>(p.step), p.loss);
        b.points.emplace_back(p.seconds, p.loss);
      }
      by_step.push_back(std::move(a));
      by_time.push_back(std::move(b));
    }
    const std::string sub = " (" + std::to_string(c.ranks) + " ranks, digits MLP)";
    examples::write_svg(out_dir + "/shampoo_digits_steps.svg", by_step,
                        {.title = "Training loss against steps" + sub,
                         .x_label = "step",
                         .y_label = "training loss (1497 images)",
                         .width = 900,
                         .log_y = true});
    examples::write_svg(out_dir + "/shampoo_digits_time.svg", by_time,
                        {.title = "Training loss against wall time" + sub,
                         .x_label = "seconds of training steps (rank 0, evaluation excluded)",
                         .y_label = "training loss (1497 images)",
                         .width = 900,
                         .log_y = true});
    std::printf("wrote %s/shampoo_digits.csv, shampoo_digits_steps.svg, shampoo_digits_time.svg\n",
                out_dir.c_str());
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

// K-FAC + SGD against SGD and LAMB on the 64-32-10 ReLU MLP of the 8x8 handwritten digits
// (examples/data/digits.csv, 1797 images: 1497 to train, 300 held out), data-parallel on N
// in-process ranks (comm::threads, N = 4 by default): steps and wall time to a fixed held-out
// accuracy.
//
// Every run sees the same stream of examples: at step t rank r takes training examples
// (t N + r) B .. (t N + r) B + B - 1 of one fixed shuffle (B = 16 per rank, 64 per step), sums
// the gradient bucket with one allreduce and divides it by N, then steps its optimizer. Every
// run has the same learning-rate schedule shape: a linear warm-up over 20 steps to the peak
// rate, then a cosine decay to 0 at the last step (600 steps, about 26 epochs). Weight decay
// 1e-4 on the weight matrices (the biases are flagged skip_weight_decay) for every optimizer.
//
//   SGD          gradapt::sgd, heavy-ball momentum 0.9;
//   K-FAC + SGD  gradapt::kfac over both layers (fc1: in 64, out 32; fc2: in 32, out 10; each
//                with its bias), distributed with kfac::step(comm, ...), then the same SGD on
//                the rewritten gradients. Options, set once: factors every step (factor_decay
//                0.95), eigendecompositions every 10 steps, damping 0.003, kl_clip 0.001
//                (kfac-pytorch's defaults but for the inverse frequency and the damping);
//   LAMB         gradapt::lamb (b1 0.9, b2 0.999, eps 1e-6, no clipping).
//
// K-FAC's inputs are recomputed from the model on factor-update steps, for this rank's batch:
// a of fc1 is the pixels (B x 64), a of fc2 the hidden ReLU activations (B x 32), and g the
// gradient of each example's own cross-entropy with respect to the layer's pre-activations
// (B x 32 and B x 10): the per-example gradients, so G is the empirical Fisher's output factor
// (the batch mean's 1/B would scale G by 1/B^2 against the damping).
//
// Learning rates: each optimizer's peak rate is the one that reaches the target held-out
// accuracy in the fewest steps (ties: the higher final accuracy) on the grid 1e-3, 3e-3, 1e-2,
// 3e-2, 0.1, 0.3, 1, 3 at the defaults above (`kfac_digits --grid 1` runs it and prints the
// table, "diverged" for a run whose optimizer state became non-finite; docs/algorithms/kfac.md,
// "Example", shows the measured one). Chosen: SGD 0.3, K-FAC + SGD 0.3, LAMB 3e-2. KL clipping
// caps lr^2 <V, M> at kl_clip, so at the larger rates K-FAC's step stops growing with the rate
// and those rates tie on steps.
//
// The loss is the mean cross-entropy over the 1497 training images, and the accuracy the
// fraction of the 300 held-out images classified correctly, both evaluated every `--eval-every`
// steps (default 5) and after the last one, by all ranks on slices of the data, outside the
// timed part. The seconds are the wall time of the training steps alone (batch gradient,
// allreduce, K-FAC's inputs, factors, decompositions and preconditioning, optimizer step) on
// rank 0, summed; with more ranks than cores they include the waits for descheduled ranks, so
// they vary from run to run.
//
// Writes kfac_digits.csv (optimizer, step, seconds, loss, accuracy), kfac_digits_steps.svg
// (held-out accuracy against steps) and kfac_digits_time.svg (against wall time) into --out,
// prints each run's steps and seconds to the target accuracy (--target, default 0.95), and
// ends with the check
//   "kfac: reaches held-out accuracy <A> at step <s>, SGD at step <S> (<r>x fewer steps): PASS"
// where s and S are the first evaluated steps at which the K-FAC + SGD and the SGD runs' held-out
// accuracy is at or above A (multiples of --eval-every: each crossing lies in the --eval-every
// steps before it) and r = S / s. PASS needs both to reach A, s < S and bitwise identical
// replicas at the end of every run; otherwise the line ends in FAIL (or reads "kfac: ... does
// not reach held-out accuracy <A> in <n> steps: FAIL") and the exit status is 1.
//
//   kfac_digits [--data examples/data/digits.csv] [--out .] [--ranks 4] [--steps 600]
//               [--batch 16] [--warmup 20] [--weight-decay 1e-4] [--target 0.95]
//               [--lr-sgd 0.3] [--lr-kfac 0.3] [--lr-lamb 3e-2] [--damping 0.003]
//               [--factor-update-steps 1] [--inv-update-steps 10] [--kl-clip 0.001]
//               [--eval-every 5] [--grid 0] [--seed 7]
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
#include <gradapt/optim/kfac.hpp>
#include <gradapt/optim/lamb.hpp>
#include <gradapt/optim/sgd.hpp>

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
namespace dg = examples::digits;

enum class method { sgd, kfac, lamb };

const char* name_of(method m) {
  switch (m) {
    case method::sgd:
      return "SGD";
    case method::kfac:
      return "K-FAC + SGD";
    case method::lamb:
      return "LAMB";
  }
  return "?";
}

struct config {
  int ranks = 4;
  int batch = 16;
  long steps = 600;
  long warmup = 20;
  double weight_decay = 1e-4;
  double target = 0.95;
  double lr_sgd = 0.3, lr_kfac = 0.3, lr_lamb = 3e-2;
  double damping = 0.003, kl_clip = 0.001;
  std::uint64_t factor_update_steps = 1, inv_update_steps = 10;
  long eval_every = 5;
  unsigned seed = 7;

  /// The learning rate of step t for peak rate `peak`: linear warm-up over `warmup` steps,
  /// then a cosine decay to 0 at step `steps`.
  double lr_at(long t, double peak) const {
    if (t < warmup) return peak * static_cast<double>(t + 1) / static_cast<double>(warmup);
    const double x = static_cast<double>(t - warmup) / static_cast<double>(std::max(1L, steps - warmup));
    return peak * 0.5 * (1.0 + std::cos(3.14159265358979323846 * x));
  }

  gradapt::kfac_options kfac() const {
    return {.factor_decay = 0.95,
            .factor_update_steps = factor_update_steps,
            .inv_update_steps = inv_update_steps,
            .damping = damping,
            .method = gradapt::kfac_method::eigen,
            .kl_clip = kl_clip};
  }
};

struct run_result : examples::digits::run_trace {
  std::string name;
  double lr = 0;
  double seconds = 0;                ///< training steps' wall time on rank 0
  std::uint64_t decompositions = 0;  ///< K-FAC: layer decompositions, summed over the ranks
};

/// K-FAC's inputs for one batch: each layer's inputs a and the gradients g of each example's own
/// loss with respect to the layer's pre-activations, rows = examples.
struct kfac_inputs {
  std::vector<float> a1, g1, a2, g2;  ///< rows x 64, rows x 32, rows x 32, rows x 10

  /// Recomputes the forward and backward pass of `m` over examples idx[0..count).
  void compute(const mlp& m, const dataset& d, const int* idx, int count) {
    const auto rows = static_cast<std::size_t>(count);
    a1.resize(rows * dg::features);
    g1.resize(rows * dg::hidden);
    a2.resize(rows * dg::hidden);
    g2.resize(rows * dg::classes);
    for (std::size_t k = 0; k < rows; ++k) {
      const float* x = &d.x[static_cast<std::size_t>(idx[k]) * dg::features];
      std::copy(x, x + dg::features, &a1[k * dg::features]);
      float* h = &a2[k * dg::hidden];
      for (int u = 0; u < dg::hidden; ++u) {
        float s = m.b1[static_cast<std::size_t>(u)];
        for (int j = 0; j < dg::features; ++j)
          s += m.w1[static_cast<std::size_t>(u * dg::features + j)] * x[j];
        h[u] = s > 0 ? s : 0;
      }
      float z[dg::classes];
      float zmax = -1e30f;
      for (int c = 0; c < dg::classes; ++c) {
        float s = m.b2[static_cast<std::size_t>(c)];
        for (int u = 0; u < dg::hidden; ++u) s += m.w2[static_cast<std::size_t>(c * dg::hidden + u)] * h[u];
        z[c] = s, zmax = std::max(zmax, s);
      }
      double zsum = 0;
      for (int c = 0; c < dg::classes; ++c) zsum += std::exp(double(z[c] - zmax));
      const int y = d.y[static_cast<std::size_t>(idx[k])];
      float* dz = &g2[k * dg::classes];
      for (int c = 0; c < dg::classes; ++c)
        dz[c] = static_cast<float>(std::exp(double(z[c] - zmax)) / zsum) - (c == y ? 1.0f : 0.0f);
      float* dp = &g1[k * dg::hidden];
      for (int u = 0; u < dg::hidden; ++u) {
        float dh = 0;
        if (h[u] > 0)
          for (int c = 0; c < dg::classes; ++c)
            dh += m.w2[static_cast<std::size_t>(c * dg::hidden + u)] * dz[c];
        dp[u] = dh;
      }
    }
  }
};

/// One run of method m at peak rate `lr`; evaluates every `eval_every` steps and after the last.
run_result train(const dataset& d, const split& s, const config& c, method m, double lr, long eval_every) {
  run_result out;
  out.name = name_of(m);
  out.lr = lr;
  evaluator ev(d, s, c.ranks, out);
  std::vector<std::uint64_t> decompositions(static_cast<std::size_t>(c.ranks), 0);
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
      case method::sgd: {
        const gradapt::sgd opt({.momentum = 0.9, .weight_decay = c.weight_decay});
        auto st = opt.init(backend, model.params);
        loop([&](double l) { opt.step(backend, model.params, st, {.lr = l}); });
        break;
      }
      case method::kfac: {
        const gradapt::sgd opt({.momentum = 0.9, .weight_decay = c.weight_decay});
        auto st = opt.init(backend, model.params);
        const gradapt::kfac kf(c.kfac());
        const gradapt::host_lapack la{};
        const gradapt::kfac_layer layers[] = {{"fc1", dg::features, dg::hidden, true},
                                              {"fc2", dg::hidden, dg::classes, true}};
        auto ks = kf.init<float>(la, layers);
        using view = gradapt::tensor_view<float, gradapt::host_space>;
        using cview = gradapt::tensor_view<const float, gradapt::host_space>;
        const gradapt::kfac_grad<float> grads[] = {
            {view(model.gw1, {dg::hidden, dg::features}), view::vector(model.gb1, std::int64_t{dg::hidden})},
            {view(model.gw2, {dg::classes, dg::hidden}), view::vector(model.gb2, std::int64_t{dg::classes})}};
        kfac_inputs in;
        const std::int64_t rows = c.batch;
        loop([&](double l) {
          if (kf.factor_update_due(ks)) {
            in.compute(model, d, idx.data(), c.batch);
            kf.accumulate(ks, 0, cview(in.a1.data(), {rows, dg::features}),
                          cview(in.g1.data(), {rows, dg::hidden}));
            kf.accumulate(ks, 1, cview(in.a2.data(), {rows, dg::hidden}),
                          cview(in.g2.data(), {rows, dg::classes}));
          }
          kf.step(comm, ks, grads, l);
          opt.step(backend, model.params, st, {.lr = l});
        });
        decompositions[static_cast<std::size_t>(comm.rank())] = ks.decompositions();  // own slot
        break;
      }
      case method::lamb: {
        const gradapt::lamb opt({.weight_decay = c.weight_decay});
        auto st = opt.init(backend, model.params);
        loop([&](double l) { opt.step(backend, model.params, st, {.lr = l}); });
        break;
      }
    }
  });
  for (const auto n : decompositions) out.decompositions += n;
  return out;
}

/// The first evaluated point whose held-out accuracy is at or above `target`, or null.
const point* first_reaching(const run_result& r, double target) {
  for (const auto& p : r.points)
    if (p.accuracy >= target) return &p;
  return nullptr;
}

constexpr const char* options[] = {"--data",
                                   "--out",
                                   "--ranks",
                                   "--steps",
                                   "--batch",
                                   "--warmup",
                                   "--weight-decay",
                                   "--target",
                                   "--lr-sgd",
                                   "--lr-kfac",
                                   "--lr-lamb",
                                   "--damping",
                                   "--factor-update-steps",
                                   "--inv-update-steps",
                                   "--kl-clip",
                                   "--eval-every",
                                   "--grid",
                                   "--seed"};

/// `--grid 1`: every method at every rate of the grid; prints, per rate, the first evaluated
/// step at the target accuracy ("-" when not reached) and the final accuracy, and each method's
/// best rate (fewest steps, ties: higher final accuracy).
void grid(const dataset& d, const split& s, const config& c, const std::vector<method>& methods) {
  const double rates[] = {1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0};
  std::printf(
      "\nfirst evaluated step at held-out accuracy >= %g / final held-out accuracy after %ld steps, by "
      "peak learning rate\n%-12s",
      c.target, c.steps, "lr");
  for (const double r : rates) std::printf(" %11g", r);
  std::printf("  best\n");
  for (const method m : methods) {
    std::printf("%-12s", name_of(m));
    std::fflush(stdout);
    long best_step = std::numeric_limits<long>::max();
    double best_acc = -1, best_lr = 0;
    for (const double r : rates) {
      run_result res;
      try {
        res = train(d, s, c, m, r, c.eval_every);
      } catch (const gradapt::error&) {  // a state that diverged to non-finite values throws
        std::printf(" %11s", "diverged");
        std::fflush(stdout);
        continue;
      }
      const point* p = first_reaching(res, c.target);
      const double acc = res.points.back().accuracy;
      char cell[32];
      if (p)
        std::snprintf(cell, sizeof cell, "%ld/%.3f", p->step, acc);
      else
        std::snprintf(cell, sizeof cell, "-/%.3f", acc);
      std::printf(" %11s", cell);
      std::fflush(stdout);
      if (p && (p->step < best_step || (p->step == best_step && acc > best_acc)))
        best_step = p->step, best_acc = acc, best_lr = r;
    }
    if (best_acc < 0)
      std::printf("  none\n");
    else
      std::printf("  %g\n", best_lr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const examples::cli cl(argc, argv, "kfac_digits", options);
    const dataset d =
        examples::digits::load(cl.text("--data", GRADAPT_EXAMPLES_DATA_DIR "/digits.csv"), "kfac_digits");
    const std::string out_dir = cl.text("--out", ".");
    config c;
    const auto num = [&](const char* name, double def) { return cl.number(name, def); };
    const auto count = [&](const char* name, long def, long min) { return cl.count(name, def, min); };
    c.ranks = static_cast<int>(count("--ranks", c.ranks, 1));
    c.steps = count("--steps", c.steps, 1);
    c.batch = static_cast<int>(count("--batch", c.batch, 1));
    c.warmup = count("--warmup", c.warmup, 0);
    c.weight_decay = num("--weight-decay", c.weight_decay);
    c.target = num("--target", c.target);
    examples::require(c.target <= 1, "kfac_digits: --target is ", c.target, " (expected an accuracy <= 1)");
    c.lr_sgd = num("--lr-sgd", c.lr_sgd);
    c.lr_kfac = num("--lr-kfac", c.lr_kfac);
    c.lr_lamb = num("--lr-lamb", c.lr_lamb);
    c.damping = num("--damping", c.damping);
    c.kl_clip = num("--kl-clip", c.kl_clip);
    c.factor_update_steps = static_cast<std::uint64_t>(count("--factor-update-steps", 1, 1));
    c.inv_update_steps = static_cast<std::uint64_t>(count("--inv-update-steps", 10, 1));
    c.eval_every = count("--eval-every", c.eval_every, 1);
    const bool run_grid = count("--grid", 0, 0) != 0;
    c.seed = static_cast<unsigned>(count("--seed", c.seed, 0));
    // K-FAC validates its own options (and names a bad one) before any rank starts.
    gradapt::kfac::validate(c.kfac());

    std::vector<int> all(static_cast<std::size_t>(d.n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(c.seed));
    const std::size_t held_out = 300;
    examples::require(all.size() > held_out, "kfac_digits: the data holds ", all.size(),
                      " rows (expected more than ", held_out, ")");
    const split s{std::vector<int>(all.begin(), all.end() - static_cast<std::ptrdiff_t>(held_out)),
                  std::vector<int>(all.end() - static_cast<std::ptrdiff_t>(held_out), all.end())};
    std::printf(
        "64-32-10 MLP on %zu digits (%zu held out), %d ranks x %d examples per step, %ld steps; peak rate "
        "after a %ld-step warm-up, cosine decay to 0; weight decay %g; target held-out accuracy %g\n",
        s.train.size() + s.test.size(), s.test.size(), c.ranks, c.batch, c.steps, c.warmup, c.weight_decay,
        c.target);
    std::printf(
        "K-FAC: eigen, factors every %llu steps (decay 0.95), decompositions every %llu steps (distributed "
        "over the ranks), damping %g, kl_clip %g; then SGD momentum 0.9\n",
        static_cast<unsigned long long>(c.factor_update_steps),
        static_cast<unsigned long long>(c.inv_update_steps), c.damping, c.kl_clip);

    const std::vector<method> methods{method::sgd, method::kfac, method::lamb};
    if (run_grid) {
      grid(d, s, c, methods);
      return 0;
    }
    std::vector<run_result> runs;
    for (const method m : methods) {
      const double lr = m == method::sgd ? c.lr_sgd : m == method::kfac ? c.lr_kfac : c.lr_lamb;
      runs.push_back(train(d, s, c, m, lr, c.eval_every));
    }

    std::printf("\n%-12s %8s %10s %9s %8s %8s %16s %12s\n", "optimizer", "peak lr", "final loss", "accuracy",
                "in sync", "time s", "step at target", "s at target");
    for (const auto& r : runs) {
      const point* p = first_reaching(r, c.target);
      char st[24] = "-", se[24] = "-";
      if (p) {
        std::snprintf(st, sizeof st, "%ld", p->step);
        std::snprintf(se, sizeof se, "%.3f", p->seconds);
      }
      std::printf("%-12s %8g %10.5f %9.3f %8s %8.2f %16s %12s\n", r.name.c_str(), r.lr, r.points.back().loss,
                  r.points.back().accuracy, r.identical ? "yes" : "NO", r.seconds, st, se);
    }
    std::printf("K-FAC + SGD: %llu layer decompositions over all ranks\n",
                static_cast<unsigned long long>(runs[1].decompositions));

    // The check: K-FAC + SGD reaches the target held-out accuracy in fewer steps than SGD, and
    // every run ends with bitwise identical replicas.
    bool in_sync = true;
    for (const auto& r : runs) in_sync = in_sync && r.identical && std::isfinite(r.points.back().loss);
    std::printf("replicas bitwise identical at the end of every run: %s\n", in_sync ? "yes" : "NO");
    const point* k = first_reaching(runs[1], c.target);
    const point* g = first_reaching(runs[0], c.target);
    const bool ok = k && g && k->step < g->step && in_sync;
    if (!k || !g)
      std::printf("kfac: %s does not reach held-out accuracy %.3f in %ld steps: FAIL\n",
                  k ? "SGD" : "K-FAC + SGD", c.target, c.steps);
    else
      std::printf(
          "kfac: reaches held-out accuracy %.3f at step %ld, SGD at step %ld (%.2fx fewer steps): %s\n",
          c.target, k->step, g->step,
          static_cast<double>(g->step) / static_cast<double>(std::max(1L, k->step)), ok ? "PASS" : "FAIL");

    std::ofstream csv(out_dir + "/kfac_digits.csv");
    csv << "optimizer,step,seconds,loss,accuracy\n";
    for (const auto& r : runs)
      for (const auto& p : r.points)
        csv << '"' << r.name << "\"," << p.step << ',' << p.seconds << ',' << p.loss << ',' << p.accuracy
            << '\n';
    if (!csv) examples::fail("kfac_digits: cannot write ", out_dir, "/kfac_digits.csv");
    std::vector<examples::series> by_step, by_time;
    for (const auto& r : runs) {
      char label[96];
      std::snprintf(label, sizeof label, "%s, lr %g", r.name.c_str(), r.lr);
      examples::series a{label, {}}, b{label, {}};
      for (const auto& p : r.points) {
        a.points.emplace_back(static_cast<double>(p.step), p.accuracy);
        b.points.emplace_back(p.seconds, p.accuracy);
      }
      by_step.push_back(std::move(a));
      by_time.push_back(std::move(b));
    }
    char target_line[64];
    std::snprintf(target_line, sizeof target_line, "target %g", c.target);
    const auto target_series = [&](double x1) {
      return examples::series{target_line, {{0.0, c.target}, {x1, c.target}}};
    };
    double t_max = 0;
    for (const auto& r : runs) t_max = std::max(t_max, r.seconds);
    by_step.push_back(target_series(static_cast<double>(c.steps)));
    by_time.push_back(target_series(t_max));
    const std::string sub = " (" + std::to_string(c.ranks) + " ranks, digits MLP)";
    examples::write_svg(out_dir + "/kfac_digits_steps.svg", by_step,
                        {.title = "Held-out accuracy against steps" + sub,
                         .x_label = "step",
                         .y_label = "held-out accuracy (300 images)",
                         .width = 900});
    examples::write_svg(out_dir + "/kfac_digits_time.svg", by_time,
                        {.title = "Held-out accuracy against wall time" + sub,
                         .x_label = "seconds of training steps (rank 0, evaluation excluded)",
                         .y_label = "held-out accuracy (300 images)",
                         .width = 900});
    std::printf("wrote %s/kfac_digits.csv, kfac_digits_steps.svg, kfac_digits_time.svg\n", out_dir.c_str());
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

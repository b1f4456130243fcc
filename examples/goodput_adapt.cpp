// Live batch-size adaptation with the Pollux goodput model (Qiao et al., OSDI 2021) on real data:
// the 64-32-10 ReLU MLP on the 8x8 digits (examples/data/digits.csv) trained data-parallel on R
// in-process ranks (comm::threads, R = 4 by default) with AdaScale. One rank's gradient averages
// s micro-batches of m examples (gradient accumulation), so a step takes M = R m s examples.
//
//  1. Profiling: real steps of a scratch model at a grid of (m, s) in worlds of the sizes given
//     by --profile-worlds (default: R only; see "Worlds" below). Every configuration is timed
//     in several short rounds, so a change of the machine's load spreads over all of them; its
//     lower-quartile step time is a throughput_sample (see lower_quartile).
//  2. Check of the model: fit_throughput_params on the "fit" grid, then the fitted model
//     predicts the step times of the other configurations of the profile ("held out":
//     m and s values the fit never saw, timed in the same rounds).
//  3. Adaptive training (AdaScale, base batch M0 = 16, the batch the learning rate 0.2 was
//     tuned for in adascale_digits). Each step, allreduce_with_norms sums the gradient bucket
//     and returns the two squared norms of the data-parallel noise scale;
//     gradient_noise_scale::update(norms, R, {m, s}) feeds B_simple and AdaScale's gain. Every K
//     steps rank 0 refits throughput_params to the whole profile plus the step times of
//     the configurations run so far, calls search_goodput (with hysteresis) at the current
//     B_simple and broadcasts the chosen (m, s); on a change, AdaScale's scale S = M / M0
//     follows, so the learning rate does too.
//  4. A reference run keeps the initial configuration (M = M0) to the same scale-invariant
//     iterations, for the measured speedup.
//
// Worlds: Pollux's model charges each replica its own compute time t_grad, independent of R
// (one GPU per replica). In-process ranks share the machine's cores, so on a machine with fewer
// cores than ranks a replica's compute slows down as R grows, which the model cannot express:
// the default profiles only the world the run uses. --profile-worlds 1,2,4 shows the effect.
//
// Checks (the "checks passed" line the ctest looks for): every held-out configuration's
// predicted step time is within --tolerance (default 30%) of its measured one, and both runs
// end with a finite loss below the initial one. Why 30%: on a 2-core machine at a load average
// of 10 to 13 (other builds and tests running), the worst held-out error of 35 runs was 21%,
// while the model fitted across worlds of 1, 2 and 4 ranks sharing those cores (which it
// cannot describe) was 36 to 43% off.
//
// Writes into --out: goodput_adapt.csv (one row per step of both runs), goodput_adapt_timing.csv
// (measured and predicted step times), goodput_adapt_curves.csv, goodput_adapt.svg (predicted
// goodput against M at several points of training, the chosen M marked) and
// noise_scale_digits.svg (B_simple, AdaScale gain and S against tau).
//
//   goodput_adapt [--data examples/data/digits.csv] [--out .] [--ranks 4] [--iters 3000]
//                 [--every 50] [--lr 0.2] [--max-atomic-batch 32] [--max-accum-steps 4]
//                 [--hysteresis 0.1] [--tolerance 0.3] [--profile-worlds 4]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <gradapt/gradapt.hpp>
#include <gradapt/scaling/goodput.hpp>
#include <gradapt/scaling/goodput_fit.hpp>

#include "common/check.hpp"
#include "common/digits_mlp.hpp"
#include "common/svg_plot.hpp"

// Sanitizer builds run the example for its memory and thread checks; their instrumentation
// changes the step times (compute several times slower, synchronisation much more), so the
// model check is reported there but not enforced.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GOODPUT_ADAPT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define GOODPUT_ADAPT_SANITIZED 1
#endif
#endif
#ifndef GOODPUT_ADAPT_SANITIZED
#define GOODPUT_ADAPT_SANITIZED 0
#endif

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

using examples::digits::dataset;
using examples::digits::mlp;
using clock_type = std::chrono::steady_clock;
using gradapt::goodput_config;
using gradapt::throughput_sample;

constexpr int base_batch = 16;  // M0: the learning rate was tuned for batches of 16

struct settings {
  std::string data = GRADAPT_EXAMPLES_DATA_DIR "/digits.csv";
  std::string out = ".";
  int ranks = 4;
  double iters = 3000;  // scale-invariant iterations to train for
  int every = 50;       // steps between adaptation decisions
  double lr = 0.2;
  int max_m = 32;  // stands in for the memory limit on the micro-batch
  int max_s = 4;
  double hysteresis = 0.1;
  double tolerance = 0.30;
  std::vector<int> profile_worlds;  // default: {ranks}
};

// The step-time statistic of a configuration: the lower quartile of its measured steps. On a
// shared machine other processes' time slices lengthen some steps, the more so the longer the
// step; the median of the longest configurations was seen to carry that (2.7x at a load
// average of 10 on 2 cores), while the lower quartile estimates what the job itself costs.
double lower_quartile(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  const auto q = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 4);
  std::nth_element(v.begin(), q, v.end());
  return *q;
}

double seconds(clock_type::duration d) { return std::chrono::duration<double>(d).count(); }

goodput_config config(int m, int s, int replicas) {
  return {.atomic_batch = m, .accum_steps = s, .replicas = replicas, .nodes = 1};
}

// One rank's part of a data-parallel step: s micro-batches of m examples from the shared
// stream `order` starting at position `first` (rank r takes positions [r m s, (r + 1) m s)),
// accumulated into the flat gradient bucket as the mean over its m s examples.
void local_gradient(mlp& model, const dataset& d, const std::vector<int>& order, long long first, int rank,
                    int m, int s, std::vector<int>& idx) {
  model.zero_grad();
  const auto n = static_cast<long long>(order.size());
  for (int j = 0; j < s; ++j) {
    const long long at = first + (static_cast<long long>(rank) * s + j) * m;
    for (int k = 0; k < m; ++k)
      idx[static_cast<std::size_t>(k)] = order[static_cast<std::size_t>((at + k) % n)];
    model.accumulate(d, idx.data(), m, m * s);
  }
}

// SGD on the mean gradient; the bucket holds the SUM over ranks (a summing allreduce).
void sgd(const gradapt::host& backend, mlp& model, double lr, int ranks) {
  const float step = static_cast<float>(lr / ranks);
  backend.apply_list([step](float& p, float g) { p -= step * g; }, model.params.values(),
                     model.params.grads());
}

// ---- 1. profiling ------------------------------------------------------------------------

struct profiled {
  throughput_sample sample;
  bool held_out;  // not used by the check's fit; predicted instead
};

std::vector<profiled> profile(const dataset& d, const std::vector<int>& order, const settings& o) {
  // fit grid: m in {max/8, max/2, max} x s in {1, 2, max}; held out: m in {max/4, 3 max/4} x s in {1, 3}
  std::vector<std::pair<goodput_config, bool>> grid;
  const auto add = [&](int m, int s, bool held_out) {
    const auto c = config(std::clamp(m, 1, o.max_m), std::clamp(s, 1, o.max_s), 1);
    for (const auto& g : grid)
      if (g.first == c) return;
    grid.emplace_back(c, held_out);
  };
  for (int m : {o.max_m / 8, o.max_m / 2, o.max_m})
    for (int s : {1, 2, o.max_s}) add(m, s, false);
  for (int m : {o.max_m / 4, 3 * o.max_m / 4})
    for (int s : {1, 3}) add(m, s, true);
  constexpr int rounds = GOODPUT_ADAPT_SANITIZED ? 4 : 16, warmup = 2, timed = 12;  // fewer when instrumented
  std::vector<profiled> out;
  for (int world : o.profile_worlds) {
    std::vector<std::vector<double>> times(grid.size());
    gradapt::comm::run_threads(world, [&](gradapt::comm::threads& comm) {
      const gradapt::host backend{.threads = 1};
      mlp model;
      std::vector<int> idx(static_cast<std::size_t>(o.max_m));
      long long first = 0;
      for (int round = 0; round < rounds; ++round)
        for (std::size_t c = 0; c < grid.size(); ++c) {
          const int m = grid[c].first.atomic_batch, s = grid[c].first.accum_steps;
          comm.barrier();
          auto last = clock_type::now();
          for (int t = 0; t < warmup + timed; ++t) {
            local_gradient(model, d, order, first, comm.rank(), m, s, idx);
            first += static_cast<long long>(world) * m * s;
            gradapt::allreduce_with_norms(comm, backend, model.grad_bucket());
            sgd(backend, model, 0.01, world);
            const auto now = clock_type::now();
            if (comm.rank() == 0 && t >= warmup) times[c].push_back(seconds(now - last));
            last = now;
          }
        }
    });
    for (std::size_t c = 0; c < grid.size(); ++c) {
      auto cfg = grid[c].first;
      cfg.replicas = world;
      out.push_back({{cfg, lower_quartile(times[c])}, grid[c].second});
    }
  }
  return out;
}

// ---- 2. training -------------------------------------------------------------------------

struct step_record {
  long step;
  double tau, gain, b_simple, step_time, loss;  // loss: NaN except at decision points
  int m, s;
};

struct decision {
  long step;  // steps taken before the decision
  double tau, b_simple, speedup_vs_current, goodput_vs_start;
  goodput_config best, chosen;
  bool switched;
  gradapt::throughput_params params;  // the model the decision used
};

struct run_result {
  std::vector<step_record> steps;
  std::vector<decision> decisions;
  std::vector<throughput_sample> measured;  // per configuration run: lower-quartile step time
  double step_seconds = 0;                  // time in training steps (decisions and evaluations excluded)
  double decision_seconds = 0;              // rank 0's time in fits and searches
  double initial_loss = 0, final_loss = 0;
};

// Goodput against the global batch M = R k at noise scale `noise`: for each M the best (m, s)
// with m s = k in the search ranges (the set search_goodput maximises over).
std::vector<std::pair<double, double>> goodput_curve(const gradapt::throughput_params& p, double noise,
                                                     const settings& o) {
  std::vector<std::pair<double, double>> curve;
  const gradapt::efficiency_params e{.noise_scale = noise, .base_batch = base_batch};
  for (int k = 1; k <= o.max_m * o.max_s; ++k) {
    double best = -1;
    for (int s = 1; s <= o.max_s; ++s)
      if (k % s == 0 && k / s <= o.max_m && config(k / s, s, o.ranks).global_batch() >= base_batch)
        best = std::max(best, gradapt::goodput(p, e, config(k / s, s, o.ranks)));
    if (best > 0) curve.emplace_back(double(o.ranks) * k, best);
  }
  return curve;
}

// Replaces the sample of `c` among samples[from, end), or appends one.
void record(std::vector<throughput_sample>& samples, std::size_t from, const goodput_config& c, double t) {
  for (std::size_t i = from; i < samples.size(); ++i)
    if (samples[i].config == c) {
      samples[i].step_time = t;
      return;
    }
  samples.push_back({c, t});
}

run_result train(const dataset& d, const std::vector<int>& order, const settings& o, bool adapt,
                 const std::vector<throughput_sample>& profile_samples) {
  const int R = o.ranks;
  const goodput_config start = config((base_batch + R - 1) / R, 1, R);  // smallest M = R m >= M0
  const auto schedule = [&](double tau) { return tau < 0.7 * o.iters ? o.lr : 0.1 * o.lr; };
  const gradapt::goodput_search_options search{
      .max_atomic_batch = o.max_m, .max_accum_steps = o.max_s, .hysteresis = o.hysteresis};
  run_result res;
  res.steps.reserve(static_cast<std::size_t>(o.iters) + 1);
  gradapt::comm::run_threads(R, [&](gradapt::comm::threads& comm) {
    const int rank = comm.rank();
    const gradapt::host backend{.threads = 1};
    mlp model;
    gradapt::gradient_noise_scale gns({.smoothing = 0.99});
    gradapt::adascale ada({.scale = start.global_batch() / base_batch});
    std::vector<int> idx(static_cast<std::size_t>(o.max_m));
    goodput_config cur = start;
    std::vector<double> times;                                 // rank 0: step times in `cur`
    std::vector<throughput_sample> samples = profile_samples;  // rank 0: what the fit sees
    if (rank == 0) res.initial_loss = model.loss(d, nullptr, d.n, false);
    long long first = 0;
    comm.barrier();
    auto last = clock_type::now();
    for (long step = 0; ada.progress() < o.iters; ++step) {
      const int m = cur.atomic_batch, s = cur.accum_steps;
      local_gradient(model, d, order, first, rank, m, s, idx);
      first += static_cast<long long>(R) * m * s;
      const auto norms = gradapt::allreduce_with_norms(comm, backend, model.grad_bucket());
      gns.update(norms, R, gradapt::noise_batch{.micro_batch = double(m), .accumulation_steps = s});
      const auto a = ada.step(schedule, gns, base_batch);
      sgd(backend, model, a.lr, R);
      const auto now = clock_type::now();
      const double dt = seconds(now - last);
      last = now;
      if (rank == 0) {
        times.push_back(dt);
        res.step_seconds += dt;
        res.steps.push_back(
            {step, ada.progress(), a.gain, gns.b_simple().value_or(std::nan("")), dt, std::nan(""), m, s});
      }
      if ((step + 1) % o.every != 0 || ada.progress() >= o.iters) continue;

      // ---- decision: rank 0 decides, every rank applies -----------------------------------
      double next[2] = {double(m), double(s)};
      if (rank == 0) {
        res.steps.back().loss = model.loss(d, nullptr, d.n, false);
        const auto bs = gns.b_simple();
        if (adapt && bs) {
          const auto t0 = clock_type::now();
          record(samples, profile_samples.size(), cur, lower_quartile(times));
          // tolerance 1e-8 instead of the default 1e-12: the same fits here at a third of the time
          const auto fit = gradapt::fit_throughput_params(samples, {.tolerance = 1e-8});
          const gradapt::efficiency_params e{.noise_scale = std::max(0.0, *bs), .base_batch = base_batch};
          const auto r = gradapt::search_goodput(fit.params, e, R, 1, cur, search);
          res.decision_seconds += seconds(clock_type::now() - t0);
          const decision dec{step + 1,
                             ada.progress(),
                             *bs,
                             r.speedup,
                             r.goodput / gradapt::goodput(fit.params, e, start),
                             r.best,
                             r.config,
                             r.switched,
                             fit.params};
          res.decisions.push_back(dec);
          std::printf(
              "step %4ld  tau %6.0f  B_simple %6.1f  best m %2d s %d (%.2fx current)  -> %s m %2d s %d"
              "  M %3.0f  S %5.2f  predicted goodput %.2fx the start's\n",
              dec.step, dec.tau, dec.b_simple, r.best.atomic_batch, r.best.accum_steps, r.speedup,
              r.switched ? "switch to" : "keep     ", r.config.atomic_batch, r.config.accum_steps,
              r.config.global_batch(), r.config.global_batch() / base_batch, dec.goodput_vs_start);
          next[0] = r.config.atomic_batch;
          next[1] = r.config.accum_steps;
        }
      }
      comm.broadcast(gradapt::tensor_view<double, gradapt::host_space>::vector(next, 2), 0);
      const goodput_config chosen = config(int(next[0]), int(next[1]), R);
      if (!(chosen == cur)) {
        cur = chosen;
        ada.set_scale(cur.global_batch() / base_batch);  // the learning rate follows the batch
        times.clear();
      }
      last = clock_type::now();  // the decision is not part of a step time
    }
    if (rank == 0) {
      res.final_loss = model.loss(d, nullptr, d.n, false);
      if (!times.empty()) record(samples, profile_samples.size(), cur, lower_quartile(times));
      res.measured.assign(samples.begin() + static_cast<std::ptrdiff_t>(profile_samples.size()),
                          samples.end());
    }
  });
  return res;
}

std::ofstream open_out(const std::string& path) {
  std::ofstream f(path);
  if (!f) examples::fail("goodput_adapt: cannot write '", path, "' (does the --out directory exist?)");
  return f;
}

// ---- arguments ---------------------------------------------------------------------------

template <class T>
T number(const std::string& option, const std::string& v) {
  std::size_t used = 0;
  T x{};
  try {
    if constexpr (std::is_same_v<T, int>)
      x = std::stoi(v, &used);
    else
      x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty()) examples::fail("goodput_adapt: ", option, " '", v, "' is not a number");
  return x;
}

settings parse(int argc, char** argv) {
  settings o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) examples::fail("goodput_adapt: option ", a, " needs a value");
    const std::string v = argv[++i];
    if (a == "--data")
      o.data = v;
    else if (a == "--out")
      o.out = v;
    else if (a == "--ranks")
      o.ranks = number<int>(a, v);
    else if (a == "--iters")
      o.iters = number<double>(a, v);
    else if (a == "--every")
      o.every = number<int>(a, v);
    else if (a == "--lr")
      o.lr = number<double>(a, v);
    else if (a == "--max-atomic-batch")
      o.max_m = number<int>(a, v);
    else if (a == "--max-accum-steps")
      o.max_s = number<int>(a, v);
    else if (a == "--hysteresis")
      o.hysteresis = number<double>(a, v);
    else if (a == "--tolerance")
      o.tolerance = number<double>(a, v);
    else if (a == "--profile-worlds") {
      for (std::size_t p = 0; p < v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        o.profile_worlds.push_back(number<int>(a, v.substr(p, q - p)));
        p = q + 1;
      }
    } else
      examples::fail("goodput_adapt: unknown option ", a,
                     " (see the comment at the top of goodput_adapt.cpp)");
  }
  examples::require(o.ranks >= 2 && o.ranks <= base_batch, "goodput_adapt: --ranks ", o.ranks,
                    " (expected 2..", base_batch, ": the data-parallel noise scale needs two ranks)");
  examples::require(o.iters > 0 && o.every >= 1 && o.lr > 0 && o.tolerance > 0 && o.hysteresis >= 0,
                    "goodput_adapt: --iters ", o.iters, ", --every ", o.every, ", --lr ", o.lr,
                    ", --tolerance ", o.tolerance, ", --hysteresis ", o.hysteresis,
                    " (expected positive values; hysteresis >= 0)");
  examples::require(o.max_m >= 8 && o.max_s >= 3, "goodput_adapt: --max-atomic-batch ", o.max_m,
                    " and --max-accum-steps ", o.max_s,
                    " (expected >= 8 and >= 3: the profile needs distinct m and s values)");
  if (o.profile_worlds.empty()) o.profile_worlds.push_back(o.ranks);
  for (int w : o.profile_worlds)
    examples::require(w >= 1 && w <= 64, "goodput_adapt: --profile-worlds has ", w,
                      " (expected world sizes 1..64, comma-separated)");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings o = parse(argc, argv);
    const dataset d = examples::digits::load(o.data, "goodput_adapt");
    open_out(o.out + "/goodput_adapt.csv");  // fail now, not after the runs, when --out is not writable
    std::vector<int> order(static_cast<std::size_t>(d.n));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    std::printf(
        "64-32-10 MLP on %d digits, %d in-process ranks, base batch M0 = %d, %g scale-invariant "
        "iterations, lr %g, m <= %d, s <= %d, a decision every %d steps\n",
        d.n, o.ranks, base_batch, o.iters, o.lr, o.max_m, o.max_s, o.every);

    // ---- profile and check the model on held-out configurations ------------------------------
    const auto t0 = clock_type::now();
    const auto prof = profile(d, order, o);
    std::vector<throughput_sample> fit_set, all;
    for (const auto& p : prof) {
      all.push_back(p.sample);
      if (!p.held_out) fit_set.push_back(p.sample);
    }
    const auto fit0 = gradapt::fit_throughput_params(fit_set);
    std::printf(
        "profiled %zu configurations in %.2f s; fitted on %zu: alpha_c %.3g ms, beta_c %.3g ms per "
        "example, t_sync(R = %d) %.3g ms, gamma %.2f, rms error %.1f%%\n",
        prof.size(), seconds(clock_type::now() - t0), fit_set.size(), 1e3 * fit0.params.alpha_c,
        1e3 * fit0.params.beta_c, o.ranks, 1e3 * gradapt::sync_time(fit0.params, o.ranks, 1),
        fit0.params.gamma, 100 * fit0.rms_log_error);
    double worst = 0;
    int held_out = 0;
    for (const auto& p : prof) {
      if (!p.held_out) continue;
      const auto& c = p.sample.config;
      const double pred = gradapt::step_time(fit0.params, c), err = std::fabs(pred / p.sample.step_time - 1);
      std::printf("  held out R %d m %2d s %d: measured %.3f ms, predicted %.3f ms (%.0f%% off)\n",
                  c.replicas, c.atomic_batch, c.accum_steps, 1e3 * p.sample.step_time, 1e3 * pred, 100 * err);
      worst = std::max(worst, err);
      ++held_out;
    }

    // ---- train adaptively, then at the initial configuration ----------------------------------
    const run_result ad = train(d, order, o, true, all);
    const run_result fixed = train(d, order, o, false, all);
    for (const auto& dec : ad.decisions)
      if (dec.switched)
        for (const auto& smp : ad.measured)
          if (smp.config == dec.chosen) {
            const double pred = gradapt::step_time(dec.params, dec.chosen);
            std::printf(
                "  switched to m %2d s %d at step %ld: predicted %.3f ms per step before it ran, "
                "measured %.3f ms (%.0f%% off)\n",
                dec.chosen.atomic_batch, dec.chosen.accum_steps, dec.step, 1e3 * pred, 1e3 * smp.step_time,
                100 * std::fabs(pred / smp.step_time - 1));
            break;
          }
    std::printf(
        "adaptive: %zu steps to tau %.0f, %.2f s in steps (+ %.3f s in %zu fits and searches), final "
        "loss %.4f (initial %.4f)\n",
        ad.steps.size(), ad.steps.back().tau, ad.step_seconds, ad.decision_seconds, ad.decisions.size(),
        ad.final_loss, ad.initial_loss);
    std::printf(
        "fixed m %d s 1 (M = %.0f): %zu steps to tau %.0f, %.2f s in steps, final loss %.4f; adaptive "
        "speedup %.2fx in steps (%.2fx counting its decisions)\n",
        fixed.steps.back().m, double(o.ranks * fixed.steps.back().m), fixed.steps.size(),
        fixed.steps.back().tau, fixed.step_seconds, fixed.final_loss, fixed.step_seconds / ad.step_seconds,
        fixed.step_seconds / (ad.step_seconds + ad.decision_seconds));

    // ---- CSV -----------------------------------------------------------------------------------
    std::vector<throughput_sample> everything = all;
    everything.insert(everything.end(), ad.measured.begin(), ad.measured.end());
    const auto final_fit = gradapt::fit_throughput_params(everything);
    std::ofstream timing = open_out(o.out + "/goodput_adapt_timing.csv");
    timing << "phase,replicas,atomic_batch,accum_steps,measured_s,predicted_by_profile_fit_s,"
              "predicted_by_final_fit_s\n";
    for (const auto& p : prof)
      timing << (p.held_out ? "profile_held_out," : "profile_fit,") << p.sample.config.replicas << ','
             << p.sample.config.atomic_batch << ',' << p.sample.config.accum_steps << ','
             << p.sample.step_time << ',' << gradapt::step_time(fit0.params, p.sample.config) << ','
             << gradapt::step_time(final_fit.params, p.sample.config) << '\n';
    for (const auto& smp : ad.measured)
      timing << "run," << smp.config.replicas << ',' << smp.config.atomic_batch << ','
             << smp.config.accum_steps << ',' << smp.step_time << ','
             << gradapt::step_time(fit0.params, smp.config) << ','
             << gradapt::step_time(final_fit.params, smp.config) << '\n';
    std::ofstream csv = open_out(o.out + "/goodput_adapt.csv");
    csv << "run,step,tau,atomic_batch,accum_steps,global_batch,gain,b_simple,step_time_s,loss\n";
    for (const auto* r : {&ad, &fixed})
      for (const auto& st : r->steps)
        csv << (r == &ad ? "adaptive" : "fixed") << ',' << st.step << ',' << st.tau << ',' << st.m << ','
            << st.s << ',' << o.ranks * st.m * st.s << ',' << st.gain << ',' << st.b_simple << ','
            << st.step_time << ',' << st.loss << '\n';

    // ---- plots -----------------------------------------------------------------------------------
    std::ofstream curves_csv = open_out(o.out + "/goodput_adapt_curves.csv");
    curves_csv << "step,tau,b_simple,global_batch,predicted_goodput,chosen_global_batch\n";
    std::vector<examples::series> curves;
    if (!ad.decisions.empty()) {
      const std::size_t nd = ad.decisions.size();
      std::vector<std::size_t> pick{0, nd / 3, (2 * nd) / 3, nd - 1};
      pick.erase(std::unique(pick.begin(), pick.end()), pick.end());
      for (std::size_t k : pick) {
        const auto& dec = ad.decisions[k];
        const double noise = std::max(0.0, dec.b_simple), mc = dec.chosen.global_batch();
        const double gc =
            gradapt::goodput(dec.params, {.noise_scale = noise, .base_batch = base_batch}, dec.chosen);
        // the curve, with a line down from the chosen configuration to the axis
        std::vector<std::pair<double, double>> pts;
        bool marked = false;
        for (auto [x, y] : goodput_curve(dec.params, noise, o)) {
          if (!marked && x >= mc) {
            pts.insert(pts.end(), {{mc, gc}, {mc, 0.0}, {mc, gc}});
            marked = true;
          }
          pts.emplace_back(x, y);
          curves_csv << dec.step << ',' << dec.tau << ',' << dec.b_simple << ',' << x << ',' << y << ',' << mc
                     << '\n';
        }
        char name[64];
        std::snprintf(name, sizeof name, "tau %.0f B %.0f: M %.0f", dec.tau, dec.b_simple, mc);
        curves.push_back({name, pts});
      }
    }
    if (curves.empty())  // a run shorter than --every steps: the plot would have no curve
      std::printf("no adaptation decision was made (fewer than %d steps): goodput_adapt.svg is empty\n",
                  o.every);
    examples::write_svg(o.out + "/goodput_adapt.svg", curves,
                        {.title = "Digits MLP on " + std::to_string(o.ranks) +
                                  " ranks: predicted goodput vs global batch (line down: chosen M)",
                         .x_label = "global batch M = R m s (examples)",
                         .y_label = "goodput (base-batch examples / s)",
                         .width = 860});
    std::vector<std::pair<double, double>> bs, gain, scale;
    const std::size_t stride = std::max<std::size_t>(1, ad.steps.size() / 500);  // keeps the SVG small
    for (std::size_t i = 0; i < ad.steps.size(); i += stride) {
      const auto& st = ad.steps[i];
      bs.emplace_back(st.tau, st.b_simple);
      gain.emplace_back(st.tau, st.gain);
      scale.emplace_back(st.tau, double(o.ranks * st.m * st.s) / base_batch);
    }
    examples::write_svg(o.out + "/noise_scale_digits.svg",
                        {{"B_simple (examples)", bs}, {"AdaScale gain r", gain}, {"scale S = M / M0", scale}},
                        {.title = "Digits MLP, adaptive run: noise scale, gain and scale",
                         .x_label = "scale-invariant iterations (tau)",
                         .y_label = "log scale",
                         .log_y = true});
    std::printf(
        "wrote goodput_adapt.csv, goodput_adapt_timing.csv, goodput_adapt_curves.csv, goodput_adapt.svg "
        "and noise_scale_digits.svg into %s\n",
        o.out.c_str());

    // ---- checks --------------------------------------------------------------------------------
    const bool model_ok = held_out > 0 && (worst <= o.tolerance || GOODPUT_ADAPT_SANITIZED);
    const bool loss_ok = std::isfinite(ad.final_loss) && ad.final_loss < ad.initial_loss &&
                         std::isfinite(fixed.final_loss) && fixed.final_loss < fixed.initial_loss;
    std::printf(
        "model check: %d held-out configurations, worst step-time error %.0f%% (tolerance %.0f%%): %s\n",
        held_out, 100 * worst, 100 * o.tolerance,
        GOODPUT_ADAPT_SANITIZED ? "not enforced in a sanitizer build"
        : model_ok              ? "ok"
                                : "FAILED");
    std::printf("loss check: adaptive %.4f, fixed %.4f, initial %.4f: %s\n", ad.final_loss, fixed.final_loss,
                ad.initial_loss, loss_ok ? "ok" : "FAILED");
    if (!(model_ok && loss_ok)) return 1;
    if (GOODPUT_ADAPT_SANITIZED)
      std::printf("checks passed: losses finite and below the initial (model check not enforced here)\n");
    else
      std::printf(
          "checks passed: held-out step times predicted within %.0f%%, losses finite and below the initial\n",
          100 * o.tolerance);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

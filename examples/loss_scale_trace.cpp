// Dynamic loss scaling over a scripted fp16 run: how the scale rides under the overflow
// ceiling, backs off at loss spikes and at an injected NaN, and regrows.
//
// The unscaled gradient's largest magnitude m_t follows a script: it decays from 2e-2 to 2e-5
// over the run (gradients shrink as training converges), with three loss spikes (m jumps by
// 300x to 3000x for a few steps) and one bad batch (a NaN at step 4200). Each step, a
// 4096-element gradient with values up to m_t in magnitude is multiplied by the current scale
// S and stored in fp16, as a backward pass on `loss * S` would leave it; it overflows exactly
// when S m_t > 65504 (the largest fp16). The scaler unscales it and decides whether to step.
// The largest safe scale, the ceiling, is 65504 / m_t.
//
// Two scalers run the same script: the defaults (hysteresis 1, PyTorch's rule) and DeepSpeed's
// hysteresis 2 (the first overflow of a burst is tolerated: no back-off, the step is still
// skipped). growth_interval is 200 here (2000 by default) so that regrowth is visible.
//
// Writes loss_scale_trace.csv (step, m, log2 ceiling, log2 S for both scalers; the steps where
// something changes and every 50th) and loss_scale_trace.svg into the output directory, prints
// a summary, and checks that every step was skipped exactly when its fp16 gradient held an inf
// or NaN, and that the final scale is under the ceiling.
//
//   loss_scale_trace [--out docs/algorithms/img] [--steps 6000]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gradapt/gradapt.hpp>
#include <gradapt/precision/loss_scaler.hpp>

#include "common/check.hpp"
#include "common/svg_plot.hpp"

namespace {

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

/// The smooth part of the script: gradients shrink 1000x over the run.
double base_magnitude(int t, int steps) { return 2e-2 * std::pow(1e-3, static_cast<double>(t) / steps); }

/// The script: largest unscaled gradient magnitude at step t (NaN for the bad batch).
double magnitude(int t, int steps) {
  const double base = base_magnitude(t, steps);
  struct spike {
    int at, len;
    double factor;
  };
  for (const spike s : {spike{1500, 3, 300.0}, spike{2900, 6, 3000.0}, spike{5200, 2, 1000.0}})
    if (t >= s.at * steps / 6000 && t < s.at * steps / 6000 + s.len) return base * s.factor;
  if (t == 4200 * steps / 6000) return std::nan("");
  return base;
}

struct run {
  gradapt::loss_scaler scaler;
  std::vector<gradapt::half> grad;
  std::vector<double> log2_scale;
  std::vector<int> skipped_at;
  int mismatches = 0;
  explicit run(gradapt::loss_scaler_options o) : scaler(o), grad(4096) {}

  /// One step: the scaled fp16 gradient, its own overflow check, and the scaler's decision.
  void step(int t, double m, const std::vector<float>& unit) {
    const float s = static_cast<float>(scaler.scale());
    bool has_nonfinite = false;
    for (std::size_t i = 0; i < grad.size(); ++i) {
      const float v =
          std::isnan(m) && i == 17 ? NAN : static_cast<float>(s * (std::isnan(m) ? 1e-3 : m) * unit[i]);
      grad[i] = gradapt::half(v);
      has_nonfinite |= !std::isfinite(static_cast<float>(grad[i]));
    }
    const std::vector<gradapt::tensor_view<gradapt::half>> grads{gradapt::host_view(grad)};
    gradapt::comm::single comm;
    const bool stepped = scaler.unscale(gradapt::host{.threads = 1}, comm, grads);
    if (stepped == has_nonfinite) ++mismatches;
    if (!stepped) skipped_at.push_back(t);
    log2_scale.push_back(std::log2(scaler.scale()));
  }
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string out = arg(argc, argv, "--out", ".");
    const int steps = std::stoi(arg(argc, argv, "--steps", "6000"));
    if (steps < 600) examples::fail("loss_scale_trace: --steps is ", steps, " (expected >= 600)");
    // Unit-magnitude pattern: the largest element is exactly 1 (so max |g| = m).
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> unit(4096);
    for (auto& v : unit) v = u(rng);
    unit[100] = 1.0f;

    run plain({.growth_interval = 200});
    run hyst({.growth_interval = 200, .hysteresis = 2});
    std::vector<double> mags, ceiling;
    for (int t = 0; t < steps; ++t) {
      const double m = magnitude(t, steps);
      mags.push_back(m);
      ceiling.push_back(std::isnan(m) ? NAN : std::log2(65504.0 / m));
      plain.step(t, m, unit);
      hyst.step(t, m, unit);
    }

    // The CSV and the plot keep the steps where something happens (a scale changes, a step is
    // skipped, the script leaves its smooth trend) and every 50th step: the scales are step
    // functions and the ceiling is smooth between events, so nothing visible is lost.
    const auto changed = [](const std::vector<double>& v, std::size_t k) {
      return k > 0 && v[k] != v[k - 1];
    };
    const auto event = [&](int t) {
      if (t % 50 == 0 || t + 1 == steps) return true;
      for (int d = -1; d <= 1; ++d) {
        const int u = t + d;
        if (u < 0 || u >= steps) continue;
        const auto k = static_cast<std::size_t>(u);
        if (changed(plain.log2_scale, k) || changed(hyst.log2_scale, k) ||
            !(mags[k] == base_magnitude(u, steps)))
          return true;
      }
      return false;
    };
    std::ofstream csv(out + "/loss_scale_trace.csv");
    csv << "step,max_abs_grad,log2_ceiling,log2_scale,log2_scale_hysteresis2\n";
    std::vector<examples::series> lines(3);
    lines[0].name = "ceiling 65504/max|g|";
    lines[1].name = "scale (hysteresis 1)";
    lines[2].name = "scale (hysteresis 2)";
    for (int t = 0; t < steps; ++t) {
      if (!event(t)) continue;
      const auto k = static_cast<std::size_t>(t);
      csv << t << ',' << mags[k] << ',' << ceiling[k] << ',' << plain.log2_scale[k] << ','
          << hyst.log2_scale[k] << '\n';
      // Scales are drawn as steps: the previous value up to this step, then the new one.
      for (auto [series, v] :
           {std::pair{&lines[1], &plain.log2_scale}, std::pair{&lines[2], &hyst.log2_scale}}) {
        if (changed(*v, k)) series->points.emplace_back(t, (*v)[k - 1]);
        series->points.emplace_back(t, (*v)[k]);
      }
      lines[0].points.emplace_back(t, ceiling[k]);
    }
    if (!csv) examples::fail("loss_scale_trace: cannot write ", out, "/loss_scale_trace.csv");
    examples::write_svg(
        out + "/loss_scale_trace.svg", lines,
        {.title = "Loss scale on a scripted fp16 run (growth_interval 200, max_scale 2^24, NaN at 4200)",
         .x_label = "step",
         .y_label = "log2 of the scale"});

    for (const run* r : {&plain, &hyst}) {
      std::printf(
          "%s: %zu skipped steps (%llu back-offs, %llu growths), final scale 2^%g, final ceiling 2^%.2f\n",
          r == &plain ? "hysteresis 1" : "hysteresis 2", r->skipped_at.size(),
          static_cast<unsigned long long>(r->scaler.backoffs()),
          static_cast<unsigned long long>(r->scaler.growths()), r->log2_scale.back(), ceiling.back());
    }
    std::printf("wrote %s/loss_scale_trace.csv and %s/loss_scale_trace.svg\n", out.c_str(), out.c_str());
    const bool ok = plain.mismatches == 0 && hyst.mismatches == 0 &&
                    plain.log2_scale.back() <= ceiling.back() && hyst.log2_scale.back() <= ceiling.back();
    std::printf(
        "checks: skipped exactly the steps whose fp16 gradient overflowed, final scale under the ceiling: "
        "%s\n",
        ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

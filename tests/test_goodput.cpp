// Pollux goodput model (scaling/goodput.hpp): step time, efficiency, goodput, search, errors.
#include <cmath>
#include <limits>

#include "catch.hpp"
#include "gradapt/scaling/goodput.hpp"

namespace gradapt_test_goodput {

using Catch::Matchers::Contains;
using gradapt::efficiency_params;
using gradapt::goodput_config;
using gradapt::goodput_search_options;
using gradapt::throughput_params;

namespace {

// α_c = 0.1, β_c = 0.01, α_n = 0.3, β_n = 0.05, α_r = 0.2, β_r = 0.02.
throughput_params params(double gamma) {
  return {.alpha_c = 0.1,
          .beta_c = 0.01,
          .alpha_n = 0.3,
          .beta_n = 0.05,
          .alpha_r = 0.2,
          .beta_r = 0.02,
          .gamma = gamma};
}

// Independent long-double re-computation of the goodput (straight from Pollux Eqs. 7-9 and the
// AdaScale gain r = (σ² + |G|²)/(σ²/S + |G|²) with |G|² = 1 and σ² = B/M0), no shared code.
double reference_goodput(const throughput_params& p, double noise, double base, int m, int s, int r, int n) {
  using ld = long double;
  const ld tg = ld(p.alpha_c) + ld(p.beta_c) * m;
  ld ts = 0;
  if (r > 1) {
    const ld extra = r > 2 ? ld(r - 2) : ld(0);
    ts = n > 1 ? ld(p.alpha_n) + ld(p.beta_n) * extra : ld(p.alpha_r) + ld(p.beta_r) * extra;
  }
  const ld g = p.gamma;
  const ld t = ld(s - 1) * tg + std::pow(std::pow(tg, g) + std::pow(ts, g), 1 / g);
  const ld batch = ld(r) * m * s;
  const ld sigma2 = ld(noise) / base, grad2 = 1, scale = batch / base;
  const ld gain = (sigma2 + grad2) / (sigma2 / scale + grad2);
  return double(batch / t * gain / scale);
}

}  // namespace

TEST_CASE("goodput: step time closed forms", "[goodput]") {
  const auto p1 = params(1.0);
  // R = 1: no synchronisation; t = s · (α_c + β_c m).
  REQUIRE(gradapt::sync_time(p1, 1, 1) == 0.0);
  REQUIRE(gradapt::compute_time(p1, 10) == Approx(0.2).epsilon(1e-14));
  REQUIRE(gradapt::step_time(p1, {.atomic_batch = 10, .accum_steps = 1}) == Approx(0.2).epsilon(1e-14));
  REQUIRE(gradapt::step_time(p1, {.atomic_batch = 10, .accum_steps = 3}) == Approx(0.6).epsilon(1e-14));
  REQUIRE(gradapt::throughput(p1, {.atomic_batch = 10, .accum_steps = 3}) ==
          Approx(30.0 / 0.6).epsilon(1e-14));
  // Single node: α_r + β_r max(R − 2, 0); R = 2 pays no retrogression.
  REQUIRE(gradapt::sync_time(p1, 2, 1) == Approx(0.2).epsilon(1e-14));
  REQUIRE(gradapt::sync_time(p1, 4, 1) == Approx(0.24).epsilon(1e-14));
  // γ = 1: no overlap, 0.3 + 0.24.
  REQUIRE(gradapt::step_time(p1, {.atomic_batch = 20, .accum_steps = 1, .replicas = 4, .nodes = 1}) ==
          Approx(0.54).epsilon(1e-14));
  // Multi node: α_n + β_n (R − 2) = 0.3 + 0.05 · 6 = 0.6; s = 2: 0.3 + (0.3 + 0.6).
  REQUIRE(gradapt::sync_time(p1, 8, 2) == Approx(0.6).epsilon(1e-14));
  REQUIRE(gradapt::sync_time(p1, 2, 2) == Approx(0.3).epsilon(1e-14));
  const goodput_config multi{.atomic_batch = 20, .accum_steps = 2, .replicas = 8, .nodes = 2};
  REQUIRE(gradapt::step_time(p1, multi) == Approx(1.2).epsilon(1e-14));
  REQUIRE(gradapt::throughput(p1, multi) == Approx(320.0 / 1.2).epsilon(1e-14));
  // γ = 2: sqrt(0.3² + 0.24²) = sqrt(0.1476) = 0.384187454245971...
  REQUIRE(
      gradapt::step_time(params(2.0), {.atomic_batch = 20, .accum_steps = 1, .replicas = 4, .nodes = 1}) ==
      Approx(0.384187454245971).epsilon(1e-13));
  // γ = 2 with a 3-4-5 triangle: t_grad = 0.3, t_sync = α_r = 0.4 (R = 2) → 0.5.
  auto p345 = params(2.0);
  p345.alpha_r = 0.4;
  REQUIRE(gradapt::step_time(p345, {.atomic_batch = 20, .accum_steps = 1, .replicas = 2, .nodes = 1}) ==
          Approx(0.5).epsilon(1e-14));
  // γ → ∞: perfect overlap, (s − 1) t_grad + max(t_grad, t_sync); no overflow at huge γ.
  for (double g : {1e3, 1e6, 1e300}) {
    REQUIRE(gradapt::step_time(params(g), multi) == Approx(0.3 + 0.6).epsilon(1e-2 * 1e3 / g + 1e-12));
    REQUIRE(
        gradapt::step_time(params(g), {.atomic_batch = 50, .accum_steps = 1, .replicas = 4, .nodes = 1}) ==
        Approx(0.6).epsilon(1e-2 * 1e3 / g + 1e-12));
  }
  // Equal parts at γ: 2^(1/γ) · t.
  auto peq = params(3.0);
  peq.alpha_r = 0.3;
  REQUIRE(gradapt::step_time(peq, {.atomic_batch = 20, .accum_steps = 1, .replicas = 2, .nodes = 1}) ==
          Approx(0.3 * std::cbrt(2.0)).epsilon(1e-14));
  // Overlap only ever helps: larger γ, shorter step.
  double prev = std::numeric_limits<double>::infinity();
  for (double g : {1.0, 1.5, 2.0, 4.0, 10.0}) {
    const double t = gradapt::step_time(params(g), multi);
    REQUIRE(t < prev);
    REQUIRE(t >= 0.9 - 1e-15);
    prev = t;
  }
}

TEST_CASE("goodput: statistical efficiency", "[goodput]") {
  // B = 100, M0 = 50, M = 200: (150)/(300) = 0.5; AdaScale: σ²/|G|² = 2, S = 4, r = 3/1.5 = 2, r/S = 0.5.
  REQUIRE(gradapt::statistical_efficiency({.noise_scale = 100, .base_batch = 50}, 200) ==
          Approx(0.5).epsilon(1e-15));
  // M = M0: efficiency 1 whatever the noise.
  for (double b : {0.0, 1.0, 1e6})
    REQUIRE(gradapt::statistical_efficiency({.noise_scale = b, .base_batch = 32}, 32) == 1.0);
  // B = 0: 1/S.
  REQUIRE(gradapt::statistical_efficiency({.noise_scale = 0, .base_batch = 32}, 256) ==
          Approx(0.125).epsilon(1e-15));
  // B → ∞: 1.
  REQUIRE(gradapt::statistical_efficiency({.noise_scale = 1e12, .base_batch = 32}, 256) ==
          Approx(1.0).epsilon(1e-9));
  REQUIRE(gradapt::statistical_efficiency(
              {.noise_scale = std::numeric_limits<double>::infinity(), .base_batch = 32}, 256) == 1.0);
  // Monotone decreasing in M.
  double prev = 2.0;
  for (double m : {32.0, 64.0, 128.0, 1024.0}) {
    const double e = gradapt::statistical_efficiency({.noise_scale = 500, .base_batch = 32}, m);
    REQUIRE(e < prev);
    prev = e;
  }
  // goodput = throughput · efficiency, checked against the long-double reference.
  const auto p = params(2.5);
  const goodput_config c{.atomic_batch = 24, .accum_steps = 3, .replicas = 6, .nodes = 2};
  REQUIRE(gradapt::goodput(p, {.noise_scale = 700, .base_batch = 64}, c) ==
          Approx(reference_goodput(p, 700, 64, 24, 3, 6, 2)).epsilon(1e-12));
}

TEST_CASE("goodput: search closed-form optima", "[goodput]") {
  const auto p = params(1.0);
  const goodput_config cur{.atomic_batch = 16, .accum_steps = 1, .replicas = 4, .nodes = 1};
  // B = ∞: goodput = throughput, which grows with m (α_c amortised) and s (t_sync amortised).
  auto r =
      gradapt::search_goodput(p, {.noise_scale = std::numeric_limits<double>::infinity(), .base_batch = 64},
                              4, 1, cur, {.max_atomic_batch = 64, .max_accum_steps = 4, .hysteresis = 0.0});
  REQUIRE(r.best == goodput_config{.atomic_batch = 64, .accum_steps = 4, .replicas = 4, .nodes = 1});
  // B = 0: goodput = M0 / t_iter, so the smallest feasible batch m·s = 16 wins, without accumulation.
  r = gradapt::search_goodput(p, {.noise_scale = 0, .base_batch = 64}, 4, 1, cur,
                              {.max_atomic_batch = 64, .max_accum_steps = 4, .hysteresis = 0.0});
  REQUIRE(r.best == goodput_config{.atomic_batch = 16, .accum_steps = 1, .replicas = 4, .nodes = 1});
  REQUIRE(r.config == cur);
  REQUIRE_FALSE(r.switched);
  REQUIRE(r.speedup == 1.0);
  // max_global_batch caps M = R·m·s.
  r = gradapt::search_goodput(p, {.noise_scale = std::numeric_limits<double>::infinity(), .base_batch = 64},
                              4, 1, cur,
                              {.max_atomic_batch = 64, .max_accum_steps = 4, .max_global_batch = 512});
  REQUIRE(r.best.global_batch() <= 512);
  REQUIRE(r.best == goodput_config{.atomic_batch = 64, .accum_steps = 2, .replicas = 4, .nodes = 1});
}

TEST_CASE("goodput: search matches a brute force over the grid", "[goodput]") {
  const double noise = 900, base = 48;
  for (double gamma : {1.0, 1.7, 4.0}) {
    const auto p = params(gamma);
    for (auto [rep, nod] :
         {std::pair{1, 1}, std::pair{3, 1}, std::pair{8, 1}, std::pair{8, 2}, std::pair{12, 3}}) {
      const goodput_search_options o{.min_atomic_batch = 2,
                                     .max_atomic_batch = 96,
                                     .min_accum_steps = 1,
                                     .max_accum_steps = 6,
                                     .hysteresis = 0.0};
      const goodput_config cur{.atomic_batch = 48, .accum_steps = 1, .replicas = rep, .nodes = nod};
      const auto r = gradapt::search_goodput(p, {.noise_scale = noise, .base_batch = base}, rep, nod, cur, o);
      double best = -1;
      int bm = 0, bs = 0;
      for (int m = 2; m <= 96; ++m)
        for (int s = 1; s <= 6; ++s) {
          if (double(rep) * m * s < base) continue;
          const double g = reference_goodput(p, noise, base, m, s, rep, nod);
          if (g > best * (1 + 1e-12)) {
            best = g;
            bm = m;
            bs = s;
          }
        }
      INFO("gamma " << gamma << " R " << rep << " N " << nod);
      REQUIRE(r.best.atomic_batch == bm);
      REQUIRE(r.best.accum_steps == bs);
      REQUIRE(r.best_goodput == Approx(best).epsilon(1e-12));
      // The optimum is interior for this noise scale (the test exercises the trade-off).
      REQUIRE(r.best.global_batch() > base);
      REQUIRE(r.best.global_batch() < double(rep) * 96 * 6);
    }
  }
}

TEST_CASE("goodput: hysteresis keeps or switches", "[goodput]") {
  const auto p = params(2.0);
  const efficiency_params e{.noise_scale = 900, .base_batch = 48};
  const goodput_config cur{.atomic_batch = 32, .accum_steps = 1, .replicas = 8, .nodes = 2};
  const goodput_search_options o{.max_atomic_batch = 96, .max_accum_steps = 6};
  const auto free = gradapt::search_goodput(p, e, 8, 2, cur,
                                            {.max_atomic_batch = 96, .max_accum_steps = 6, .hysteresis = 0});
  REQUIRE(free.switched);
  REQUIRE(free.speedup > 1.02);
  REQUIRE(free.speedup == Approx(free.best_goodput / free.current_goodput).epsilon(1e-15));
  const double gain = free.speedup - 1;

  auto below = o;
  below.hysteresis = gain + 0.01;  // the improvement is below the threshold: keep
  auto r = gradapt::search_goodput(p, e, 8, 2, cur, below);
  REQUIRE_FALSE(r.switched);
  REQUIRE(r.config == cur);
  REQUIRE(r.goodput == r.current_goodput);
  REQUIRE(r.best == free.best);

  auto above = o;
  above.hysteresis = gain - 0.01;  // the improvement exceeds the threshold: switch
  r = gradapt::search_goodput(p, e, 8, 2, cur, above);
  REQUIRE(r.switched);
  REQUIRE(r.config == free.best);
  REQUIRE(r.goodput == r.best_goodput);

  // Once at the best configuration, it stays there even with no hysteresis.
  r = gradapt::search_goodput(p, e, 8, 2, free.best,
                              {.max_atomic_batch = 96, .max_accum_steps = 6, .hysteresis = 0});
  REQUIRE_FALSE(r.switched);
  REQUIRE(r.speedup == 1.0);

  // A current configuration that is not feasible at the searched placement (other R, N) or out of
  // range cannot be kept, whatever the hysteresis.
  auto huge = o;
  huge.hysteresis = 1e9;
  r = gradapt::search_goodput(p, e, 16, 4, cur, huge);
  REQUIRE(r.switched);
  REQUIRE(r.config.replicas == 16);
  REQUIRE(r.config.nodes == 4);
  r = gradapt::search_goodput(p, e, 8, 2, {.atomic_batch = 200, .accum_steps = 1, .replicas = 8, .nodes = 2},
                              huge);
  REQUIRE(r.switched);
  REQUIRE(r.config.atomic_batch <= 96);
}

TEST_CASE("goodput: bad input throws gradapt::error with an actionable message", "[goodput]") {
  const auto p = params(1.0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto bad = p;
  bad.beta_n = nan;
  REQUIRE_THROWS_WITH(gradapt::step_time(bad, {}), Contains("beta_n") && Contains("finite and >= 0"));
  bad = p;
  bad.alpha_c = -1;
  REQUIRE_THROWS_WITH(gradapt::compute_time(bad, 4), Contains("alpha_c = -1"));
  bad = p;
  bad.alpha_r = inf;
  REQUIRE_THROWS_AS(gradapt::sync_time(bad, 2, 1), gradapt::error);
  bad = p;
  bad.gamma = 0.5;
  REQUIRE_THROWS_WITH(gradapt::throughput(bad, {}), Contains("gamma = 0.5") && Contains(">= 1"));
  bad.gamma = nan;
  REQUIRE_THROWS_AS(gradapt::validate(bad), gradapt::error);
  // All-zero compute: the step would take no time.
  REQUIRE_THROWS_WITH(gradapt::step_time(throughput_params{}, {}), Contains("step time") && Contains("is 0"));

  REQUIRE_THROWS_WITH(gradapt::step_time(p, {.atomic_batch = 0}), Contains("atomic_batch = 0"));
  REQUIRE_THROWS_WITH(gradapt::step_time(p, {.accum_steps = 0}), Contains("accum_steps = 0"));
  REQUIRE_THROWS_WITH(gradapt::step_time(p, {.replicas = 0}), Contains("replicas = 0"));
  REQUIRE_THROWS_WITH(gradapt::step_time(p, {.replicas = 2, .nodes = 3}), Contains("exceeds replicas"));
  REQUIRE_THROWS_WITH(gradapt::sync_time(p, 2, 0), Contains("nodes = 0"));
  REQUIRE_THROWS_WITH(gradapt::compute_time(p, -3), Contains("atomic_batch = -3"));

  REQUIRE_THROWS_WITH(gradapt::statistical_efficiency({.noise_scale = -1, .base_batch = 8}, 16),
                      Contains("noise_scale = -1"));
  REQUIRE_THROWS_AS(gradapt::statistical_efficiency({.noise_scale = nan, .base_batch = 8}, 16),
                    gradapt::error);
  REQUIRE_THROWS_WITH(gradapt::statistical_efficiency({.noise_scale = 1, .base_batch = 0}, 16),
                      Contains("base_batch = 0"));
  REQUIRE_THROWS_WITH(gradapt::statistical_efficiency({.noise_scale = 1, .base_batch = 8}, 0),
                      Contains("global_batch = 0"));
  REQUIRE_THROWS_AS(gradapt::statistical_efficiency({.noise_scale = 1, .base_batch = 8}, nan),
                    gradapt::error);

  const efficiency_params e{.noise_scale = 100, .base_batch = 16};
  const goodput_config cur{.atomic_batch = 8, .accum_steps = 1, .replicas = 2, .nodes = 1};
  // max_atomic_batch left at its default: the range is empty.
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 2, 1, cur, {}), Contains("max_atomic_batch = 0"));
  REQUIRE_THROWS_WITH(
      gradapt::search_goodput(p, e, 2, 1, cur, {.min_atomic_batch = 0, .max_atomic_batch = 8}),
      Contains("min_atomic_batch = 0"));
  REQUIRE_THROWS_WITH(
      gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 8, .atomic_batch_step = 0}),
      Contains("atomic_batch_step = 0"));
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 8, .min_accum_steps = 0}),
                      Contains("min_accum_steps = 0"));
  REQUIRE_THROWS_WITH(
      gradapt::search_goodput(p, e, 2, 1, cur,
                              {.max_atomic_batch = 8, .min_accum_steps = 3, .max_accum_steps = 2}),
      Contains("range of accumulation steps is empty"));
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 8, .hysteresis = -0.1}),
                      Contains("hysteresis = -0.1"));
  REQUIRE_THROWS_AS(gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 8, .hysteresis = nan}),
                    gradapt::error);
  REQUIRE_THROWS_WITH(
      gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 8, .max_global_batch = 0}),
      Contains("max_global_batch = 0"));
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 0, 1, cur, {.max_atomic_batch = 8}),
                      Contains("replicas = 0"));
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 2, 1, {.atomic_batch = -1}, {.max_atomic_batch = 8}),
                      Contains("current.atomic_batch = -1"));
  // No configuration reaches the base batch: 2 · 4 · 1 < 16.
  REQUIRE_THROWS_WITH(gradapt::search_goodput(p, e, 2, 1, cur, {.max_atomic_batch = 4}),
                      Contains("no configuration") && Contains("raise max_atomic_batch"));
}

}  // namespace gradapt_test_goodput

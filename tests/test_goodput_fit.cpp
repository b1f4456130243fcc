// Fitting the Pollux step-time model (scaling/goodput_fit.hpp, Eigen Levenberg–Marquardt).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gradapt/scaling/goodput_fit.hpp"

namespace gradapt_test_goodput_fit {

using Catch::Matchers::Contains;
using gradapt::goodput_config;
using gradapt::throughput_params;
using gradapt::throughput_sample;

namespace {

constexpr throughput_params truth{.alpha_c = 0.02,
                                  .beta_c = 0.002,
                                  .alpha_n = 0.15,
                                  .beta_n = 0.01,
                                  .alpha_r = 0.05,
                                  .beta_r = 0.005,
                                  .gamma = 2.5};

// Exact model step times (closed form written out here, not via the library) times lognormal
// noise exp(sigma · z), three per configuration; z from a Box–Muller transform of a fixed-seed
// mt19937_64 (portable bits).
std::vector<throughput_sample> samples(double sigma, std::uint64_t seed, bool multi_node = true) {
  std::mt19937_64 rng(seed);
  auto uniform = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53; };
  std::vector<throughput_sample> out;
  const int placements[][2] = {{1, 1}, {2, 1}, {4, 1}, {8, 1}, {2, 2}, {4, 2}, {8, 2}, {16, 4}, {32, 8}};
  for (const auto& rn : placements) {
    if (!multi_node && rn[1] > 1) continue;
    for (int m : {8, 16, 32, 64, 128})
      for (int s : {1, 2, 4}) {
        const double tg = truth.alpha_c + truth.beta_c * m;
        const int r = rn[0], n = rn[1];
        const double ts = r == 1  ? 0.0
                          : n > 1 ? truth.alpha_n + truth.beta_n * std::max(r - 2, 0)
                                  : truth.alpha_r + truth.beta_r * std::max(r - 2, 0);
        const double t =
            (s - 1) * tg + std::pow(std::pow(tg, truth.gamma) + std::pow(ts, truth.gamma), 1 / truth.gamma);
        for (int rep = 0; rep < 3; ++rep) {  // three measurements per configuration
          const double z = std::sqrt(-2 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
          out.push_back({.config = {.atomic_batch = m, .accum_steps = s, .replicas = r, .nodes = n},
                         .step_time = t * std::exp(sigma * z)});
        }
      }
  }
  return out;
}

}  // namespace

TEST_CASE("goodput_fit: noise-free samples are fitted exactly", "[goodput_fit]") {
  const auto data = samples(0.0, 1);
  const auto r = gradapt::fit_throughput_params(data);
  REQUIRE(r.free_parameters == 7);
  REQUIRE(r.fitted_gamma);
  REQUIRE(r.fitted_intra_node);
  REQUIRE(r.fitted_inter_node);
  REQUIRE(r.rms_log_error < 1e-6);
  REQUIRE(r.params.alpha_c == Approx(truth.alpha_c).epsilon(1e-4));
  REQUIRE(r.params.beta_c == Approx(truth.beta_c).epsilon(1e-4));
  REQUIRE(r.params.alpha_n == Approx(truth.alpha_n).epsilon(1e-4));
  REQUIRE(r.params.beta_n == Approx(truth.beta_n).epsilon(1e-4));
  REQUIRE(r.params.alpha_r == Approx(truth.alpha_r).epsilon(1e-4));
  REQUIRE(r.params.beta_r == Approx(truth.beta_r).epsilon(1e-4));
  REQUIRE(r.params.gamma == Approx(truth.gamma).epsilon(1e-4));
}

TEST_CASE("goodput_fit: 2% noise, parameters within 5% and the same best configuration", "[goodput_fit]") {
  for (std::uint64_t seed : {42u, 7u, 2021u}) {
    INFO("seed " << seed);
    const auto data = samples(0.02, seed);
    const auto r = gradapt::fit_throughput_params(data);
    const auto& p = r.params;
    REQUIRE(r.rms_log_error < 0.03);
    REQUIRE(r.rms_log_error > 0.01);
    REQUIRE(r.rms_error > 0.0);
    REQUIRE(p.alpha_c == Approx(truth.alpha_c).epsilon(0.05));
    REQUIRE(p.beta_c == Approx(truth.beta_c).epsilon(0.05));
    REQUIRE(p.alpha_n == Approx(truth.alpha_n).epsilon(0.05));
    REQUIRE(p.beta_n == Approx(truth.beta_n).epsilon(0.05));
    REQUIRE(p.alpha_r == Approx(truth.alpha_r).epsilon(0.05));
    REQUIRE(p.beta_r == Approx(truth.beta_r).epsilon(0.05));
    REQUIRE(p.gamma == Approx(truth.gamma).epsilon(0.05));

    const gradapt::efficiency_params e{.noise_scale = 2000, .base_batch = 128};
    // Memory caps the atomic batch at 64 (stride 16), so larger global batches need
    // accumulation: on the true model the best configuration beats the runner-up by >= 2.5% at
    // R = 1, 4, 8 (checked below); there the fitted model must pick exactly that configuration.
    // At R = 32 the runner-up is within 0.6%, far below what 2% timing noise can resolve; there
    // the fitted model's choice must be worth >= 99.5% of the true optimum on the true model.
    const gradapt::goodput_search_options o{.min_atomic_batch = 16,
                                            .max_atomic_batch = 64,
                                            .atomic_batch_step = 16,
                                            .max_accum_steps = 8,
                                            .hysteresis = 0.0};
    for (auto [rep, nod] : {std::pair{1, 1}, std::pair{4, 1}, std::pair{8, 2}, std::pair{32, 8}}) {
      INFO("R " << rep << " N " << nod);
      const goodput_config cur{.atomic_batch = 64, .accum_steps = 2, .replicas = rep, .nodes = nod};
      const auto on_truth = gradapt::search_goodput(truth, e, rep, nod, cur, o);
      const auto on_fit = gradapt::search_goodput(p, e, rep, nod, cur, o);
      double runner_up = 0;
      for (int m = 16; m <= 64; m += 16)
        for (int s = 1; s <= 8; ++s) {
          const goodput_config c{.atomic_batch = m, .accum_steps = s, .replicas = rep, .nodes = nod};
          if (c.global_batch() >= e.base_batch && !(c == on_truth.best))
            runner_up = std::max(runner_up, gradapt::goodput(truth, e, c));
        }
      if (rep <= 8) {
        REQUIRE(on_truth.best_goodput > 1.025 * runner_up);
        REQUIRE(on_fit.best == on_truth.best);
      } else {
        REQUIRE(gradapt::goodput(truth, e, on_fit.best) >= 0.995 * on_truth.best_goodput);
      }
      REQUIRE(on_fit.best_goodput == Approx(on_truth.best_goodput).epsilon(0.05));
    }
    // Accumulation is exercised: the best configuration at R = 1 uses s = 2.
    REQUIRE(gradapt::search_goodput(p, e, 1, 1, {.atomic_batch = 64}, o).best.accum_steps == 2);
  }
}

TEST_CASE("goodput_fit: unidentifiable coefficients are fixed", "[goodput_fit]") {
  // Single node only: no inter-node samples, α_n = β_n = 0.
  auto data = samples(0.0, 3, /*multi_node=*/false);
  auto r = gradapt::fit_throughput_params(data);
  REQUIRE(r.free_parameters == 5);
  REQUIRE_FALSE(r.fitted_inter_node);
  REQUIRE(r.fitted_intra_node);
  REQUIRE(r.params.alpha_n == 0.0);
  REQUIRE(r.params.beta_n == 0.0);
  REQUIRE(r.params.alpha_r == Approx(truth.alpha_r).epsilon(1e-4));
  REQUIRE(r.params.gamma == Approx(truth.gamma).epsilon(1e-4));

  // Single replica only: compute only, γ = 1 and no sync coefficients.
  std::vector<throughput_sample> single;
  for (const auto& smp : data)
    if (smp.config.replicas == 1) single.push_back(smp);
  r = gradapt::fit_throughput_params(single);
  REQUIRE(r.free_parameters == 2);
  REQUIRE_FALSE(r.fitted_gamma);
  REQUIRE(r.params.gamma == 1.0);
  REQUIRE(r.params.alpha_r == 0.0);
  REQUIRE(r.params.alpha_c == Approx(truth.alpha_c).epsilon(1e-6));
  REQUIRE(r.params.beta_c == Approx(truth.beta_c).epsilon(1e-6));
}

TEST_CASE("goodput_fit: bad input throws gradapt::error", "[goodput_fit]") {
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params({}), Contains("no samples"));
  std::vector<throughput_sample> one_m{{.config = {.atomic_batch = 8}, .step_time = 0.1},
                                       {.config = {.atomic_batch = 8, .accum_steps = 2}, .step_time = 0.2}};
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(one_m), Contains("two or more distinct atomic batch"));
  // 3 samples, 7 coefficients (R = 4 on 2 nodes and on 1 node brings α, β of both links and γ).
  std::vector<throughput_sample> few{
      {.config = {.atomic_batch = 8}, .step_time = 0.1},
      {.config = {.atomic_batch = 16, .replicas = 4, .nodes = 2}, .step_time = 0.3},
      {.config = {.atomic_batch = 16, .replicas = 4, .nodes = 1}, .step_time = 0.2}};
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(few), Contains("3 samples for 7 coefficients"));
  std::vector<throughput_sample> bad{{.config = {.atomic_batch = 8}, .step_time = 0.1},
                                     {.config = {.atomic_batch = 16}, .step_time = -0.2}};
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(bad), Contains("sample 1 has step_time = -0.2"));
  bad[1] = {.config = {.atomic_batch = 16, .replicas = 0}, .step_time = 0.2};
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(bad), Contains("replicas = 0"));
  bad[1] = {.config = {.atomic_batch = 16}, .step_time = std::nan("")};
  REQUIRE_THROWS_AS(gradapt::fit_throughput_params(bad), gradapt::error);
  const std::vector<throughput_sample> ok{{.config = {.atomic_batch = 8}, .step_time = 0.1},
                                          {.config = {.atomic_batch = 16}, .step_time = 0.2}};
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(ok, {.max_evaluations = 0}),
                      Contains("max_evaluations = 0"));
  REQUIRE_THROWS_WITH(gradapt::fit_throughput_params(ok, {.tolerance = -1}), Contains("tolerance = -1"));
}

}  // namespace gradapt_test_goodput_fit

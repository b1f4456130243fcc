// The data-parallel gradient noise scale of a model written with xtensor, measured by gradapt
// through the xtensor adapter (gradapt/adapters/xtensor.hpp) and checked against its closed
// form.
//
// Model: linear regression y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, s²), loss ½(x·w − y)²,
// held at a fixed point w (e = w − w*). Its per-example gradient g = x (x·e − ε) has mean
// G = e and covariance trace tr(Σ) = (d + 1)|e|² + d s² (Gaussian fourth moments), so the
// "simple" noise scale of McCandlish et al. (2018) is B_simple = tr(Σ) / |G|² exactly.
//
// Each of P in-process ranks (comm::threads) draws a fresh batch of b examples per step into
// xtensor containers, computes its mean gradient with xtensor expressions into an
// xt::xtensor it owns, and hands the view of that buffer to gradapt::allreduce_with_norms: one
// pass sums the gradients across ranks and yields the two squared norms of the data-parallel
// estimator (B_small = b, B_big = P b). gradapt::gradient_noise_scale smooths the estimates;
// the program prints the estimate next to the closed form.
//
//   xtensor_noise_scale [--ranks 4] [--steps 3000]
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <xtensor/xarray.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xview.hpp>

#include <gradapt/adapters/xtensor.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/stats/allreduce_with_norms.hpp>
#include <gradapt/stats/gradient_noise_scale.hpp>

#include "common/check.hpp"

namespace {

constexpr std::size_t d = 16, batch = 8;
constexpr double noise_sd = 0.5;

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 3000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc)
      ranks = std::stoi(argv[++i]);
    else if (a == "--steps" && i + 1 < argc)
      steps = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: xtensor_noise_scale [--ranks P] [--steps N]\n");
      return 2;
    }
  }
  try {
    if (ranks < 2 || steps < 1)
      examples::fail(
          "xtensor_noise_scale: --ranks must be >= 2 (the data-parallel estimator needs two "
          "batch sizes) and --steps >= 1");
    // e = w − w*, fixed for the whole run.
    xt::xtensor<double, 1> e = xt::zeros<double>({d});
    for (std::size_t i = 0; i < d; ++i) e(i) = 0.3 * std::sin(1.0 + static_cast<double>(i));
    const double e_sq = xt::sum(e * e)();
    const double exact = ((d + 1) * e_sq + d * noise_sd * noise_sd) / e_sq;

    double estimate = 0;
    std::uint64_t samples = 0;
    gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& comm) {
      std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(comm.rank()));  // independent examples per rank
      std::normal_distribution<double> nd;
      xt::xtensor<double, 2> x = xt::zeros<double>({batch, d});
      xt::xtensor<double, 1> eps = xt::zeros<double>({batch});
      xt::xtensor<double, 1> r = xt::zeros<double>({batch});
      xt::xtensor<double, 1> g = xt::zeros<double>({d});  // this rank's gradient, then the sum
      const auto g_view = gradapt::view_of(g);
      const gradapt::host backend{.threads = 1};
      gradapt::gradient_noise_scale gns({.smoothing = 0.995});
      for (int s = 0; s < steps; ++s) {
        for (auto& v : x) v = nd(rng);
        for (auto& v : eps) v = noise_sd * nd(rng);
        // residual x·e − ε, then the mean gradient (1/b) Σ_i x_i r_i. xt::noalias assigns in place:
        // a plain `g = expr` evaluates into a new buffer and frees the viewed one.
        xt::noalias(r) = xt::sum(x * xt::view(e, xt::newaxis(), xt::all()), {1}) - eps;
        xt::noalias(g) = xt::sum(x * xt::view(r, xt::all(), xt::newaxis()), {0}) / static_cast<double>(batch);
        const auto norms = gradapt::allreduce_with_norms(comm, backend, g_view);
        gns.update(norms, comm.size(), {.micro_batch = static_cast<double>(batch)});
      }
      if (comm.rank() == 0) {
        estimate = gns.b_simple().value_or(std::nan(""));
        samples = gns.samples();
      }
    });

    const double rel = std::abs(estimate - exact) / exact;
    std::printf("xtensor_noise_scale: %d ranks x %zu examples, %llu samples\n", ranks, batch,
                static_cast<unsigned long long>(samples));
    std::printf(
        "xtensor_noise_scale: B_simple estimated %.2f, closed form %.2f: %s (%.1f%% off, tolerance 10%%)\n",
        estimate, exact, rel < 0.10 ? "agree" : "DISAGREE", 100.0 * rel);
    return rel < 0.10 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

// Gradient noise scale (stats/gradient_noise_scale.hpp), checked against a synthetic linear
// regression whose per-example gradient distribution is known in closed form.
//
// Model: y = x·w* + ε with x ~ N(0, I_d), ε ~ N(0, s²), loss ½(x·w − y)². At parameters w,
// with e = w − w*, the per-example gradient is g = x (x·w − y) = x (x·e − ε).
//   G = E[g] = E[x xᵀ] e − E[x] E[ε] = e,                       so |G|² = |e|².
//   E|g|² = E[(x·e)² |x|²] − 2 E[ε] E[(x·e)|x|²] + E[ε²] E|x|²
//         = eᵀ E[x xᵀ x xᵀ] e + s² d.
//   Gaussian fourth moments (Isserlis): E[x_i x_j x_k x_l] = δij δkl + δik δjl + δil δjk, so
//   E[x xᵀ x xᵀ] = E[|x|² x xᵀ] = (d + 2) I (equivalently tr of E[x xᵀ e eᵀ x xᵀ] =
//   tr(2 e eᵀ + |e|² I) = (d + 2)|e|²). Hence E|g|² = (d + 2)|e|² + d s² and
//   tr(Σ) = E|g|² − |G|² = (d + 1)|e|² + d s²,   B_simple = tr(Σ) / |G|².
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "rank_check.hpp"
#include "scenarios/noise_scale.hpp"

namespace gradapt_test_gradient_noise_scale {

using Catch::Matchers::Contains;
using gradapt::gradient_noise_scale;
using gradapt::gradient_noise_scale_state;
using gradapt::host_view;
using gradapt::noise_batch;

namespace {

constexpr int dim = 8;
constexpr double noise_sd = 0.7;

/// The regression problem at a fixed parameter point.
struct problem {
  std::vector<double> e;  // w − w*
  double e_sq() const {
    double s = 0;
    for (double v : e) s += v * v;
    return s;
  }
  double true_grad_sq() const { return e_sq(); }
  double true_trace() const { return (dim + 1) * e_sq() + dim * noise_sd * noise_sd; }
};

problem make_problem() {
  problem p;
  for (int i = 0; i < dim; ++i) p.e.push_back(0.25 * (i % 3) - 0.2 + 0.05 * i);
  return p;
}

/// Mean gradient over `n` fresh examples, accumulated into `out` (size dim).
void batch_gradient(const problem& p, std::mt19937_64& rng, int n, std::vector<double>& out) {
  std::normal_distribution<double> nd(0.0, 1.0);
  out.assign(dim, 0.0);
  double x[dim];
  for (int k = 0; k < n; ++k) {
    double xe = 0;
    for (int i = 0; i < dim; ++i) {
      x[i] = nd(rng);
      xe += x[i] * p.e[static_cast<std::size_t>(i)];
    }
    const double r = xe - noise_sd * nd(rng);
    for (int i = 0; i < dim; ++i) out[static_cast<std::size_t>(i)] += x[i] * r;
  }
  for (double& v : out) v /= n;
}

double sq(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return s;
}

using exact::same_bits;
using noise_scale_scenario::same_state;

struct mean_se {
  double sum = 0, sum_sq = 0;
  int n = 0;
  void add(double x) {
    sum += x;
    sum_sq += x * x;
    ++n;
  }
  double mean() const { return sum / n; }
  double se() const { return std::sqrt((sum_sq / n - mean() * mean()) / (n - 1)); }
};

}  // namespace

TEST_CASE("gns: two-batch estimators are unbiased on linear regression", "[gns]") {
  const problem p = make_problem();
  std::mt19937_64 rng(12345);
  const int b_small = 4, b_big = 16;
  mean_se g_est, t_est;
  std::vector<double> gs, gr;
  for (int draw = 0; draw < 20000; ++draw) {
    // g_big holds g_small's examples plus 12 more: E|g_B|^2 = |G|^2 + tr(Σ)/B still holds.
    batch_gradient(p, rng, b_small, gs);
    batch_gradient(p, rng, b_big - b_small, gr);
    std::vector<double> gb(dim);
    for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = (b_small * gs[i] + (b_big - b_small) * gr[i]) / b_big;
    const auto est = gradapt::two_batch_estimate(sq(gs), b_small, sq(gb), b_big);
    g_est.add(est.grad_sq);
    t_est.add(est.trace);
  }
  INFO("|G|^2 " << g_est.mean() << " ± " << g_est.se() << " vs " << p.true_grad_sq());
  INFO("tr(Σ) " << t_est.mean() << " ± " << t_est.se() << " vs " << p.true_trace());
  REQUIRE(std::abs(g_est.mean() - p.true_grad_sq()) < 3 * g_est.se());
  REQUIRE(std::abs(t_est.mean() - p.true_trace()) < 3 * t_est.se());
}

TEST_CASE("gns: smoothed B_simple converges to tr(Σ)/|G|^2", "[gns]") {
  const problem p = make_problem();
  std::mt19937_64 rng(777);
  gradient_noise_scale gns({.smoothing = 0.9998});
  REQUIRE_FALSE(gns.b_simple().has_value());
  std::vector<double> gs, gr, gb(dim);
  int accepted = 0;
  for (int step = 0; step < 40000; ++step) {
    batch_gradient(p, rng, 32, gs);
    batch_gradient(p, rng, 96, gr);
    for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = (32 * gs[i] + 96 * gr[i]) / 128;
    accepted += gns.update(sq(gs), 32, sq(gb), 128);
  }
  REQUIRE(accepted == 40000);
  const double truth = p.true_trace() / p.true_grad_sq();
  REQUIRE(gns.b_simple().has_value());
  INFO("B_simple " << *gns.b_simple() << " vs " << truth);
  REQUIRE(std::abs(*gns.b_simple() / truth - 1.0) < 0.05);
  REQUIRE(gns.samples() == 40000);
  REQUIRE_FALSE(gns.biased());
}

TEST_CASE("gns: bias correction and negative estimates enter the EMA unchanged", "[gns]") {
  gradient_noise_scale gns({.smoothing = 0.5});
  // |g_small|^2 = 1 at B=1, |g_big|^2 = 2 at B=2: |G|^2 = (4 - 1)/1 = 3, tr = (1 - 2)/(1/2) = -2.
  REQUIRE(gns.update(1.0, 1.0, 2.0, 2.0));
  REQUIRE(*gns.grad_sq() == 3.0);  // (0.5 * 3) / (1 - 0.5)
  REQUIRE(*gns.trace() == -2.0);
  REQUIRE(*gns.b_simple() == -2.0 / 3.0);
  // |G|^2 = (2*1 - 1*3)/1 = -1, tr = (3 - 1)/(1/2) = 4.
  REQUIRE(gns.update(3.0, 1.0, 1.0, 2.0));
  // ema_g = 0.5*1.5 + 0.5*(-1) = 0.25, corrected /0.75; ema_t = 0.5*(-1) + 0.5*4 = 1.5, /0.75.
  REQUIRE(*gns.grad_sq() == 0.25 / 0.75);
  REQUIRE(*gns.trace() == 1.5 / 0.75);
  REQUIRE(gns.last().grad_sq == -1.0);
  // Smoothed |G|^2 <= 0: B_simple undefined.
  gradient_noise_scale neg({.smoothing = 0.0});
  REQUIRE(neg.update(3.0, 1.0, 1.0, 2.0));
  REQUIRE(*neg.grad_sq() == -1.0);
  REQUIRE_FALSE(neg.b_simple().has_value());
}

TEST_CASE("gns: data-parallel form equals the serial two-batch form", "[gns][threads]") {
  const problem p = make_problem();
  const noise_batch batch{.micro_batch = 3, .accumulation_steps = 2, .loss_scale = 256.0};
  const int steps = 25;
  // Rank r's local gradient at step k comes from its own deterministic stream, scaled by the
  // loss scale as a mixed-precision framework would leave it.
  const auto local_grad = [&](int r, int k) {
    std::mt19937_64 rng(1000003ull * static_cast<unsigned>(k) + static_cast<unsigned>(r));
    std::vector<double> g;
    batch_gradient(p, rng, static_cast<int>(batch.local()), g);
    for (double& v : g) v *= batch.loss_scale;
    return g;
  };
  for (int n = 2; n <= 4; ++n) {
    const auto serial = noise_scale_scenario::serial_reference(n, batch, steps, local_grad);
    std::vector<noise_scale_scenario::run_result> dp(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& comm) {
      dp[static_cast<std::size_t>(comm.rank())] =
          noise_scale_scenario::data_parallel(comm, batch, steps, local_grad);
    });
    for (const auto& d : dp) noise_scale_scenario::require_same(d, serial);
  }
  // One rank has no second batch size: an actionable error.
  gradapt::comm::run_threads(
      1, [&](gradapt::comm::threads& comm) { noise_scale_scenario::one_rank_throws(comm, batch); });
}

TEST_CASE("gns: bad input on one rank makes every rank throw", "[gns][threads]") {
  std::vector<std::string> what(3);
  gradapt::comm::run_threads(3, [&](gradapt::comm::threads& comm) {
    gradient_noise_scale gns;
    try {
      gns.update(comm, comm.rank() == 1 ? -1.0 : 1.0, 1.0, {.micro_batch = 4});
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  REQUIRE_THAT(what[1], Contains("local |g|^2 is -1"));
  REQUIRE_THAT(what[0], Contains("1 other rank(s) passed invalid input"));
  REQUIRE_THAT(what[2], Contains("1 other rank(s) passed invalid input"));
}

TEST_CASE("gns: non-finite norms are skipped and counted and never averaged", "[gns]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  gradient_noise_scale gns({.smoothing = 0.9});
  REQUIRE(gns.update(2.0, 4, 1.0, 16));
  const auto before = gns.state();
  REQUIRE_FALSE(gns.update(inf, 4, 1.0, 16));
  REQUIRE_FALSE(gns.update(2.0, 4, nan, 16));
  REQUIRE_FALSE(gns.update_reduced(nan, 1.0, 4, {.micro_batch = 4}));
  REQUIRE_FALSE(gns.update_single_replica(1.0, 1.0, nan, 4));
  REQUIRE_FALSE(gns.update(1e308, 4, 0.0, 16));  // finite norms, overflowing estimate
  REQUIRE(gns.skipped() == 5);
  auto after = gns.state();
  after.skipped = before.skipped;
  REQUIRE(same_state(after, before));
  // NaN on one rank: the allreduce spreads it, every rank skips the same sample.
  std::vector<std::uint64_t> skipped(2);
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& comm) {
    gradient_noise_scale g;
    const bool first = g.update(comm, comm.rank() == 0 ? nan : 1.0, 0.5, {.micro_batch = 2});
    const bool second = g.update(comm, 1.0, 0.5, {.micro_batch = 2});
    RANK_REQUIRE(!first);
    RANK_REQUIRE(second);
    skipped[static_cast<std::size_t>(comm.rank())] = g.skipped() * 10 + g.samples();
  });
  REQUIRE(skipped[0] == 11);
  REQUIRE(skipped[1] == 11);
}

TEST_CASE("gns: loss scale divides squared norms by scale^2", "[gns]") {
  gradient_noise_scale plain({.smoothing = 0.8}), scaled({.smoothing = 0.8});
  const double s = 1024.0;  // a power of two: the division is exact
  for (int k = 1; k <= 10; ++k) {
    const double a = 1.0 + 0.1 * k, b = 0.5 + 0.01 * k;
    plain.update(a, 8, b, 32);
    scaled.update(a * s * s, 8, b * s * s, 32, s);
  }
  REQUIRE(same_state(plain.state(), scaled.state()));
  gradient_noise_scale p2, s2;
  p2.update_reduced(1.5, 0.75, 4, {.micro_batch = 8});
  s2.update_reduced(1.5 * s * s, 0.75 * s * s, 4, {.micro_batch = 8, .loss_scale = s});
  REQUIRE(same_state(p2.state(), s2.state()));
}

TEST_CASE("gns: single-replica form", "[gns]") {
  const problem p = make_problem();
  SECTION("with independent draws at a fixed point it is unbiased") {
    std::mt19937_64 rng(99);
    mean_se g_est, t_est;
    std::vector<double> a, b;
    for (int draw = 0; draw < 20000; ++draw) {
      batch_gradient(p, rng, 4, a);
      batch_gradient(p, rng, 4, b);
      double dot = 0;
      for (std::size_t i = 0; i < a.size(); ++i) dot += a[i] * b[i];
      gradient_noise_scale one({.smoothing = 0.0});
      REQUIRE(one.update_single_replica(sq(a), sq(b), dot, 4));
      REQUIRE(one.biased());
      g_est.add(one.last().grad_sq);
      t_est.add(one.last().trace);
    }
    REQUIRE(std::abs(g_est.mean() - p.true_grad_sq()) < 3 * g_est.se());
    REQUIRE(std::abs(t_est.mean() - p.true_trace()) < 3 * t_est.se());
  }
  SECTION("the backend form keeps the previous gradient unscaled and matches the scalar form") {
    const gradapt::host backend{.threads = 1};
    const double s = 64.0;
    std::vector<float> g0{1, 2, 3}, g1{4, -1}, p0(3), p1(2);
    std::vector<gradapt::tensor_view<const float>> grads{host_view(std::as_const(g0)),
                                                         host_view(std::as_const(g1))};
    std::vector<gradapt::tensor_view<float>> prev{host_view(p0), host_view(p1)};
    gradient_noise_scale gns({.smoothing = 0.5}), ref({.smoothing = 0.5});
    const noise_batch batch{.micro_batch = 2, .accumulation_steps = 2, .loss_scale = s};
    REQUIRE_FALSE(gns.update_single_replica(backend, grads, prev, batch));  // first call: records only
    REQUIRE(gns.skipped() == 0);
    REQUIRE(p0 == std::vector<float>{1 / 64.f, 2 / 64.f, 3 / 64.f});
    // Next step's gradient (still carrying the loss scale).
    g0 = {2, 0, 1};
    g1 = {-3, 5};
    REQUIRE(gns.update_single_replica(backend, grads, prev, batch));
    const double sq_t = (4 + 0 + 1 + 9 + 25) / (s * s);
    const double sq_p = (1 + 4 + 9 + 16 + 1) / (s * s);
    const double dot = (2 + 0 + 3 - 12 - 5) / (s * s);
    REQUIRE(ref.update_single_replica(sq_t, sq_p, dot, 4));
    REQUIRE(same_state(
        [&] {
          auto st = gns.state();
          st.has_previous = false;
          return st;
        }(),
        ref.state()));
    REQUIRE(p1 == std::vector<float>{-3 / 64.f, 5 / 64.f});
    // A non-finite gradient is skipped and leaves the previous buffer stale, not poisoned.
    g1[0] = std::numeric_limits<float>::infinity();
    REQUIRE_FALSE(gns.update_single_replica(backend, grads, prev, batch));
    REQUIRE(gns.skipped() == 1);
    REQUIRE_FALSE(gns.state().has_previous);
    REQUIRE(std::isfinite(p1[0]));
  }
}

TEST_CASE("gns: per-group and global estimates from a param_list with 16-bit gradients", "[gns][threads]") {
  // Two ranks, three tensors in two groups, bfloat16 gradients: the backend's double
  // accumulation of the stored values must give exactly the slot norms the serial form sees.
  const noise_batch batch{.micro_batch = 5, .loss_scale = 8.0};
  const auto fill = [](int r, std::size_t t, std::size_t n) {
    std::vector<gradapt::bfloat16> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = gradapt::bfloat16(float(0.25 * double((r + 1) * (i + 1 + 3 * t)) - 1.0));
    return v;
  };
  const std::size_t sizes[3] = {7, 3, 5};
  const std::size_t group_of[3] = {1, 0, 1};
  std::vector<std::vector<gradient_noise_scale_state>> got(2);
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& comm) {
    std::vector<std::vector<float>> w(3);
    std::vector<std::vector<gradapt::bfloat16>> g(3);
    gradapt::param_list<float, gradapt::bfloat16> params;
    params.add_group("matrices");
    for (std::size_t t = 0; t < 3; ++t) {
      w[t].assign(sizes[t], 0.f);
      g[t] = fill(comm.rank(), t, sizes[t]);
      params.add("p" + std::to_string(t), host_view(w[t]), host_view(g[t]), {}, group_of[t]);
    }
    const gradapt::host backend{.threads = 1};
    gradapt::grouped_noise_scale gns({.smoothing = 0.5}, params);
    RANK_REQUIRE(gns.slots() == 3);
    gns.record_local(backend, params);
    // The caller's gradient allreduce (mean), stored back in bfloat16.
    for (std::size_t t = 0; t < 3; ++t) {
      std::vector<float> f(sizes[t]);
      for (std::size_t i = 0; i < f.size(); ++i) f[i] = float(g[t][i]);
      comm.allreduce(host_view(f), gradapt::reduce_op::sum);
      for (std::size_t i = 0; i < f.size(); ++i) g[t][i] = gradapt::bfloat16(f[i] / 2.f);
    }
    const bool accepted = gns.update(comm, backend, params, batch);
    RANK_REQUIRE(accepted);
    for (std::size_t k = 0; k < gns.slots(); ++k)
      got[static_cast<std::size_t>(comm.rank())].push_back(gns.slot(k).state());
  });
  // Serial reference: squared norms of the stored bfloat16 values in long double.
  long double local[2][3] = {}, global[3] = {};
  for (std::size_t t = 0; t < 3; ++t) {
    const auto a = fill(0, t, sizes[t]), b = fill(1, t, sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      const long double x = float(a[i]), y = float(b[i]);
      const long double m = float(gradapt::bfloat16((float(a[i]) + float(b[i])) / 2.f));
      for (std::size_t slot : {std::size_t{0}, group_of[t] + 1}) {
        local[0][slot] += x * x;
        local[1][slot] += y * y;
        global[slot] += m * m;
      }
    }
  }
  for (std::size_t slot = 0; slot < 3; ++slot) {
    gradient_noise_scale ref({.smoothing = 0.5});
    ref.update_reduced(double((local[0][slot] + local[1][slot]) / 2), double(global[slot]), 2, batch);
    for (int r = 0; r < 2; ++r) {
      const auto& s = got[static_cast<std::size_t>(r)][slot];
      REQUIRE(s.samples == 1);
      REQUIRE(s.ema_grad_sq == Approx(ref.state().ema_grad_sq).epsilon(1e-12));
      REQUIRE(s.ema_trace == Approx(ref.state().ema_trace).epsilon(1e-12));
    }
  }
}

TEST_CASE("gns: save/restore is exact", "[gns]") {
  const auto feed = [](gradient_noise_scale& g, int k) {
    // 12 b > 4 a: the smoothed |G|^2 stays positive, so B_simple is defined.
    const double a = 1.0 + 0.5 * std::sin(0.37 * k), b = 0.7 + 0.1 * std::cos(0.11 * k);
    if (k % 7 == 3)
      g.update(std::numeric_limits<double>::infinity(), 4, b, 12);
    else if (k % 5 == 0)
      g.update_single_replica(a, b, 0.1 * a, 4);
    else
      g.update(a, 4, b, 12);
  };
  gradient_noise_scale full({.smoothing = 0.97});
  for (int k = 0; k < 100; ++k) feed(full, k);
  gradient_noise_scale first({.smoothing = 0.97});
  for (int k = 0; k < 40; ++k) feed(first, k);
  const gradient_noise_scale_state checkpoint = first.state();
  gradient_noise_scale resumed({.smoothing = 0.97});
  resumed.restore(checkpoint);
  for (int k = 40; k < 100; ++k) feed(resumed, k);
  REQUIRE(same_state(full.state(), resumed.state()));
  REQUIRE(full.b_simple().has_value());
  REQUIRE(resumed.b_simple().has_value());
  REQUIRE(same_bits(*full.b_simple(), *resumed.b_simple()));
  REQUIRE(full.skipped() > 0);
  REQUIRE(full.biased_samples() > 0);
}

TEST_CASE("gns: invalid input throws actionable errors", "[gns]") {
  using gradapt::error;
  REQUIRE_THROWS_AS(gradient_noise_scale({.smoothing = 1.0}), error);
  REQUIRE_THROWS_WITH(gradient_noise_scale({.smoothing = -0.1}),
                      Contains("smoothing is -0.1") && Contains("expected 0 <= smoothing < 1"));
  gradient_noise_scale gns;
  REQUIRE_THROWS_WITH(gns.update(1, 8, 1, 8),
                      Contains("B_big is 8 but B_small is 8") && Contains("B_big > B_small"));
  REQUIRE_THROWS_WITH(gns.update(1, 0, 1, 8), Contains("B_small is 0") && Contains("positive"));
  REQUIRE_THROWS_WITH(gns.update(1, -2, 1, 8), Contains("B_small is -2"));
  REQUIRE_THROWS_WITH(gns.update(-1, 2, 1, 8), Contains("|g_small|^2 is -1"));
  REQUIRE_THROWS_WITH(gns.update(1, 2, 1, 8, 0.0), Contains("loss_scale is 0"));
  REQUIRE_THROWS_WITH(gns.update_reduced(1, 1, 1, {.micro_batch = 4}), Contains("ranks is 1"));
  REQUIRE_THROWS_WITH(gns.update_reduced(1, 1, 2, {}), Contains("micro_batch is 0"));
  REQUIRE_THROWS_WITH(gns.update_reduced(1, 1, 2, {.micro_batch = 4, .accumulation_steps = 0}),
                      Contains("accumulation_steps is 0"));
  REQUIRE_THROWS_WITH(gns.update_single_replica(1, 1, 0, 0), Contains("batch_size is 0"));
  gradient_noise_scale_state bad;
  bad.beta_power = 0.5;  // no samples but a decayed β^t
  REQUIRE_THROWS_WITH(gns.restore(bad), Contains("field beta_power is 0.5 with samples 0"));
  bad.beta_power = 1.0;
  bad.ema_trace = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_THROWS_WITH(gns.restore(bad), Contains("field ema_trace is nan"));
  bad.ema_trace = 0.0;
  bad.biased = 2;
  REQUIRE_THROWS_WITH(gns.restore(bad), Contains("field biased is 2 with samples 0"));
  REQUIRE(gns.samples() == 0);  // nothing was half-applied
}

}  // namespace gradapt_test_gradient_noise_scale

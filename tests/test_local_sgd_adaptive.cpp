// Local SGD (sync/local_sgd.hpp) on the threads communicator, 1 to 5 ranks: the adaptive
// period, checkpoints, byte counters, allocation and errors.
//
// References used here, none of which calls the code under test:
//  - an independent long double re-implementation of the adaptive period rule (EMA of the
//    rank-mean loss, reference round, K = ceil(sqrt(eta0/eta * F/F0) * K0) clamped);
//  - hand-computed byte counts.
#include "local_sgd_fixtures.hpp"

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_local_sgd_adaptive {

using namespace local_sgd_test;

// ---- adaptive period -------------------------------------------------------------------------

TEST_CASE("adaptive_period::period_formula on exact ratios", "[local_sgd][adaptive]") {
  using gradapt::adaptive_period;
  // K = ceil(sqrt(lr0/lr * F/F0) * K0), clamped to [1, K_max].
  REQUIRE(adaptive_period::period_formula(3, 100, 0.1, 0.1, 2.0, 2.0) == 3);         // ratio 1
  REQUIRE(adaptive_period::period_formula(3, 100, 0.1, 0.1, 2.0, 8.0) == 6);         // ratio 4: 2 * 3
  REQUIRE(adaptive_period::period_formula(3, 100, 0.1, 0.1, 9.0, 1.0) == 1);         // ratio 1/9: 1/3 * 3
  REQUIRE(adaptive_period::period_formula(3, 100, 0.1, 0.05, 2.0, 2.0) == 5);        // sqrt(2) * 3 = 4.24
  REQUIRE(adaptive_period::period_formula(7, 100, 0.3, 0.1, 5.0, 5.0 / 3.0) == 7);   // (3 * 1/3) exact
  REQUIRE(adaptive_period::period_formula(4, 10, 1.0, 1e-9, 1.0, 1e9) == 10);        // clamp K_max
  REQUIRE(adaptive_period::period_formula(4, 10, 1.0, 1.0, 1.0, 0.0) == 1);          // loss 0: clamp 1
  REQUIRE(adaptive_period::period_formula(4, 10, 1.0, 1.0, 1.0, 1e-6) == 1);         // 0.004 -> 1
  REQUIRE(adaptive_period::period_formula(4, 10, 1.0, 1e-300, 1e300, 1e300) == 10);  // huge -> K_max
  REQUIRE(adaptive_period::period_formula(16, 64, 0.1, 0.1, 2.0, 2.0) == 16);        // K_0 outside the root
  // Exact ratios whose double evaluation lands just above the integer: (0.1 / 0.3) * 27 = 9,
  // sqrt(9) = 3, but in double x = 3.0000000000000004, and a plain ceil would give 4.
  REQUIRE(adaptive_period::period_formula(1, 100, 0.1, 0.3, 1.0, 27.0) == 3);
  REQUIRE(adaptive_period::period_formula(4, 100, 0.1, 0.3, 16.0, 27.0) == 3);
  REQUIRE(adaptive_period::period_formula(5, 100, 0.1, 0.3, 25.0, 27.0) == 3);
}

TEST_CASE("adaptive_period: EMA, reference, skipped samples on a hand-computed sequence",
          "[local_sgd][adaptive]") {
  adaptive_period s({.initial_period = 3, .max_period = 50, .smoothing = 0.5});
  REQUIRE(s.period() == 3);
  REQUIRE(s.due(2) == -1);
  REQUIRE(s.due(3) == 0);
  REQUIRE_FALSE(s.loss().has_value());
  std::uint64_t c = 3;
  const auto round = [&](double loss, double lr) {
    const auto next = s.advance(c, 0, {.loss = loss, .lr = lr});
    s.commit(next);
    c = next.next_due;
  };
  // Sample 0 first: no reference (F = 0), period stays K_0.
  round(0.0, 0.1);
  REQUIRE(s.period() == 3);
  REQUIRE_FALSE(s.reference_loss().has_value());
  REQUIRE(*s.loss() == 0.0);
  REQUIRE(c == 6);
  // ema_1 = 0 (sample 0), ema_2 = 0.5 * 0 + 0.5 * 6 = 3, beta^2 = 0.25,
  // F = 3 / 0.75 = 4 > 0: reference F0 = 4, eta0 = 0.1; K = K0 = 3.
  round(6.0, 0.1);
  REQUIRE(*s.reference_loss() == 4.0);
  REQUIRE(*s.reference_lr() == 0.1);
  REQUIRE(s.period() == 3);
  // NaN and -inf are skipped: nothing changes but the count; the next round is one period on.
  round(std::numeric_limits<double>::quiet_NaN(), 0.1);
  round(-std::numeric_limits<double>::infinity(), 0.1);
  REQUIRE(s.skipped() == 2);
  REQUIRE(s.samples() == 2);
  REQUIRE(c == 15);
  // ema_3 = 1.5 + 0.5 * 1 = 2, beta^3 = 0.125, F = 2 / 0.875 = 16/7; ratio (16/7)/4 = 4/7;
  // sqrt(4/7) * 3 = 2.268 -> 3.
  round(1.0, 0.1);
  REQUIRE(*s.loss() == Approx(16.0 / 7.0).epsilon(1e-15));
  REQUIRE(s.period() == 3);
  // ema_4 = 1 + 0.5 * 0.2 = 1.1, beta^4 = 1/16, F = 1.1 / (15/16) = 17.6/15 = 1.17333;
  // lr 0.1 -> 0.0125 (ratio 8): sqrt(8 * 1.17333 / 4) * 3 = 4.5956 -> 5.
  round(0.2, 0.0125);
  REQUIRE(*s.loss() == Approx(17.6 / 15.0).epsilon(1e-15));
  REQUIRE(s.period() == 5);
  REQUIRE(c == 23);
  // Invalid observations throw and change nothing.
  const auto before = s.state();
  REQUIRE_THROWS_WITH(s.advance(c, 0, {.loss = -1.0, .lr = 0.1}), Contains("loss is -1"));
  REQUIRE_THROWS_WITH(s.advance(c, 0, {.loss = 1.0, .lr = 0.0}), Contains("learning rate is 0"));
  REQUIRE_THROWS_WITH(s.advance(c, 0, {.loss = 1.0, .lr = std::numeric_limits<double>::infinity()}),
                      Contains("learning rate is inf"));
  REQUIRE(s.state().samples == before.samples);
  REQUIRE(s.state().next_due == before.next_due);
}

namespace {

/// Scripted per-rank loss: decays, differs by rank, wiggles; NaN on rank 1 at a few steps.
double scripted_loss(int r, std::uint64_t t) {
  if (r == 1 && (t == 9 || t == 35 || t == 36 || t == 37 || t == 38 || t == 39 || t == 40))
    return std::nan("");
  const double td = static_cast<double>(t);
  return (1.5 + 0.2 * r) * (0.3 + 0.7 * std::exp(-td / 30.0)) * (1.0 + 0.05 * std::sin(1.7 * td + r));
}
/// Scripted learning rate: a step decay, equal on every rank except a rank-dependent wiggle in
/// the last phase (the rank mean is what counts).
double scripted_lr(int r, std::uint64_t t) {
  if (t < 80) return 0.1;
  if (t < 140) return 0.02;
  return 0.004 * (1.0 + 0.1 * r);
}

struct ref_round {
  std::uint64_t step;    // 0-based global step of the round
  std::uint64_t period;  // K after the round
  bool skipped;
};

/// Independent re-implementation of the adaptive rule in long double.
std::vector<ref_round> adaptive_reference(int n, std::uint64_t start, std::uint64_t steps, std::uint64_t k0,
                                          std::uint64_t k_max, long double beta, long double& min_gap) {
  std::vector<ref_round> out;
  long double ema = 0, bp = 1, f0 = 0, eta0 = 0;
  bool has = false;
  std::uint64_t k = k0, next = k0;
  min_gap = 1;
  for (std::uint64_t t = start; t < steps; ++t) {
    const std::uint64_t c = t - start + 1;
    if (c != next) continue;
    long double loss = 0, lr = 0;
    for (int r = 0; r < n; ++r) {
      loss += scripted_loss(r, t);
      lr += scripted_lr(r, t);
    }
    loss /= n;
    lr /= n;
    bool skipped = false;
    if (!std::isfinite(loss)) {
      skipped = true;
    } else {
      ema = beta * ema + (1 - beta) * loss;
      bp *= beta;
      const long double f = ema / (1 - bp);
      if (!has && f > 0) {
        has = true;
        f0 = f;
        eta0 = lr;
      }
      const long double x = std::sqrt((eta0 / lr) * (f / f0)) * static_cast<long double>(k0);
      const long double nearest = std::nearbyint(x);
      const long double gap = std::fabs(x - nearest);
      long double kk;
      if (gap <= 1e-9L * std::max(1.0L, nearest)) {
        kk = nearest;  // exact cases (the reference round itself)
      } else {
        kk = std::ceil(x);
        min_gap = std::min(min_gap, gap);
      }
      kk = std::clamp(kk, 1.0L, static_cast<long double>(k_max));
      k = static_cast<std::uint64_t>(kk);
    }
    next = c + k;
    out.push_back({t, k, skipped});
  }
  return out;
}

}  // namespace

TEST_CASE("adaptive_period: rounds and periods match an independent re-computation (1 to 5 ranks)",
          "[local_sgd][adaptive]") {
  const std::uint64_t start = 4, steps = 260, k0 = 5, k_max = 12;
  const double beta = 0.5;
  for (int n = 1; n <= 5; ++n) {
    long double min_gap = 1;
    const auto want = adaptive_reference(n, start, steps, k0, k_max, beta, min_gap);
    // The data exercise the rule: no period near a rounding tie, a skipped round (rank 1's
    // NaN, n >= 2), periods below and at K_max, the learning-rate decay.
    REQUIRE(min_gap > 1e-6L);
    std::set<std::uint64_t> periods;
    std::size_t skips = 0;
    for (const auto& w : want) {
      periods.insert(w.period);
      skips += w.skipped ? 1 : 0;
    }
    CAPTURE(n, periods.size(), skips);
    REQUIRE(periods.size() >= 4);
    REQUIRE(periods.count(k_max) == 1);
    REQUIRE(*periods.begin() < k0);
    if (n >= 2) REQUIRE(skips >= 1);

    std::vector<std::vector<ref_round>> got(static_cast<std::size_t>(n));
    std::vector<std::uint64_t> skipped(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](threads_comm& comm) {
      const int r = comm.rank();
      local_sgd lsgd(comm, {.start_step = start},
                     adaptive_period({.initial_period = static_cast<std::int64_t>(k0),
                                      .max_period = static_cast<std::int64_t>(k_max),
                                      .smoothing = beta}));
      std::vector<float> x = {static_cast<float>(r)};
      const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
      for (std::uint64_t t = 0; t < steps; ++t) {
        const std::uint64_t skipped_before = lsgd.schedule().skipped();
        const auto res = lsgd.step(comm, gradapt::host{.threads = 1},
                                   {.loss = scripted_loss(r, t), .lr = scripted_lr(r, t)}, xs);
        if (res.averaged)
          got[static_cast<std::size_t>(r)].push_back(
              {t, lsgd.schedule().period(), lsgd.schedule().skipped() != skipped_before});
      }
      skipped[static_cast<std::size_t>(r)] = lsgd.schedule().skipped();
    });
    for (int r = 0; r < n; ++r) {
      const auto& g = got[static_cast<std::size_t>(r)];
      REQUIRE(g.size() == want.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        CAPTURE(r, i, want[i].step, want[i].period);
        REQUIRE(g[i].step == want[i].step);
        REQUIRE(g[i].period == want[i].period);
        REQUIRE(g[i].skipped == want[i].skipped);
      }
      REQUIRE(skipped[static_cast<std::size_t>(r)] == skips);
    }
  }
}

// ---- checkpoints -----------------------------------------------------------------------------

namespace {

/// A small simulated training run: x ← x − lr (x − target_r(t)), with a bfloat16 momentum-like
/// buffer m ← 0.5 m + (x − target) that is averaged too. Returns nothing; fills x, m.
struct sim {
  std::vector<float> x = std::vector<float>(6, 0.0f);
  std::vector<bfloat16> m = std::vector<bfloat16>(6, bfloat16(0.0f));
  double step(int r, std::uint64_t t) {
    double loss = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double target =
          std::sin(0.3 * static_cast<double>(t) + static_cast<double>(r) + static_cast<double>(i)) + 0.1 * i;
      const double d = static_cast<double>(x[i]) - target;
      loss += d * d;
      const float mi = 0.5f * static_cast<float>(m[i]) + static_cast<float>(d);
      m[i] = bfloat16(mi);
      x[i] = static_cast<float>(static_cast<double>(x[i]) - 0.1 * static_cast<double>(mi));
    }
    return loss;
  }
};

template <class S>
void restore_continues_identically(int n, S schedule, std::uint64_t start, std::uint64_t split,
                                   std::uint64_t steps) {
  gradapt::comm::run_threads(n, [&](threads_comm& comm) {
    const int r = comm.rank();
    const gradapt::host backend{.threads = 1};
    const auto run_step = [&](auto& lsgd, sim& s, std::uint64_t t) {
      const double loss = s.step(r, t);
      const std::vector<tensor_view<float>> xs = {gradapt::host_view(s.x)};
      const std::vector<tensor_view<bfloat16>> ms = {gradapt::host_view(s.m)};
      return lsgd.step(comm, backend, {.loss = loss, .lr = 0.1 / (1.0 + 0.01 * static_cast<double>(t))}, xs,
                       ms);
    };
    // Uninterrupted run.
    sim a;
    local_sgd la(comm, {.start_step = start}, schedule);
    std::vector<bool> rounds_a;
    for (std::uint64_t t = 0; t < steps; ++t) rounds_a.push_back(run_step(la, a, t).averaged);
    // Interrupted run: save at `split`, restore into a fresh object and fresh buffers.
    sim b;
    std::vector<bool> rounds_b;
    std::vector<std::byte> ck;  // one state archive
    sim saved;
    {
      local_sgd lb(comm, {.start_step = start}, schedule);
      for (std::uint64_t t = 0; t < split; ++t) rounds_b.push_back(run_step(lb, b, t).averaged);
      ck = lb.save();
      saved = b;
    }
    sim c = saved;
    local_sgd lc(comm, {.start_step = start}, schedule);
    lc.load(ck);
    RANK_REQUIRE(lc.steps() == split);
    for (std::uint64_t t = split; t < steps; ++t) rounds_b.push_back(run_step(lc, c, t).averaged);
    RANK_REQUIRE(rounds_a == rounds_b);
    RANK_REQUIRE(same_bits(a.x, c.x));
    RANK_REQUIRE(same_bits(a.m, c.m));
    const auto sa = la.state(), sc = lc.state();
    RANK_REQUIRE(la.save() == lc.save());  // the archives agree byte for byte
    RANK_REQUIRE(sa.driver.steps == sc.driver.steps);
    RANK_REQUIRE(sa.driver.rounds == sc.driver.rounds);
    RANK_REQUIRE(sa.driver.level_rounds == sc.driver.level_rounds);
    RANK_REQUIRE(sa.driver.payload_bytes == sc.driver.payload_bytes);
    RANK_REQUIRE(sa.driver.ring_bytes == sc.driver.ring_bytes);
    RANK_REQUIRE(sa.driver.every_step_payload_bytes == sc.driver.every_step_payload_bytes);
    RANK_REQUIRE(sa.driver.every_step_ring_bytes == sc.driver.every_step_ring_bytes);
    if constexpr (std::is_same_v<S, adaptive_period>) {
      RANK_REQUIRE(sa.schedule.period == sc.schedule.period);
      RANK_REQUIRE(sa.schedule.next_due == sc.schedule.next_due);
      RANK_REQUIRE(same_bits(sa.schedule.ema, sc.schedule.ema));
      RANK_REQUIRE(same_bits(sa.schedule.beta_power, sc.schedule.beta_power));
      RANK_REQUIRE(same_bits(sa.schedule.loss, sc.schedule.loss));
      RANK_REQUIRE(same_bits(sa.schedule.reference_loss, sc.schedule.reference_loss));
      RANK_REQUIRE(same_bits(sa.schedule.reference_lr, sc.schedule.reference_lr));
      RANK_REQUIRE(sa.schedule.samples == sc.schedule.samples);
      RANK_REQUIRE(sa.schedule.has_reference == sc.schedule.has_reference);
      RANK_REQUIRE(sa.schedule.samples > 3);  // the split falls after several adaptive rounds
    }
    if constexpr (std::is_same_v<S, fixed_period>) {
      RANK_REQUIRE(sa.schedule.rounds == sc.schedule.rounds);
      RANK_REQUIRE(sa.schedule.next_due == sc.schedule.next_due);
    }
    RANK_REQUIRE(sa.driver.rounds >= 4);
  });
}

}  // namespace

TEST_CASE("local_sgd: restoring a checkpoint mid-run continues bit for bit", "[local_sgd][checkpoint]") {
  for (int n : {1, 2, 3, 4, 7}) {
    CAPTURE(n);
    restore_continues_identically(
        n, adaptive_period({.initial_period = 2, .max_period = 9, .smoothing = 0.8}), 3, 31, 70);
    restore_continues_identically(n, fixed_period({.period = 5, .warmup_rounds = 2, .ramp = true}), 2, 13,
                                  40);
    restore_continues_identically(
        n,
        hierarchical_period(
            {.levels = {{.period = 2, .group_size = 1}, {.period = 3, .group_size = world_marker}}}),
        1, 17, 40);
    if (n >= 2)  // a group of 2 needs 2 ranks
      restore_continues_identically(
          n,
          hierarchical_period(
              {.levels = {{.period = 2, .group_size = 2}, {.period = 6, .group_size = world_marker}}}),
          0, 11, 40);
  }
}

TEST_CASE("local_sgd: load rejects inconsistent checkpoints", "[local_sgd][checkpoint]") {
  gradapt::comm::single comm;
  local_sgd lsgd(comm, {.start_step = 2}, fixed_period({.period = 4}));
  std::vector<float> x(2);
  const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
  for (int t = 0; t < 7; ++t) lsgd.step(comm, gradapt::host{}, xs);  // one round at c = 4
  const auto good = lsgd.state();
  REQUIRE(good.driver.rounds == 1);
  REQUIRE(good.schedule.next_due == 8);
  auto bad = good;
  bad.driver.rounds = 9;
  REQUIRE_THROWS_WITH(lsgd.restore(bad), Contains("rounds"));
  bad = good;
  bad.driver.level_rounds[3] = 1;
  bad.driver.rounds = 2;
  REQUIRE_THROWS_WITH(lsgd.restore(bad), Contains("level 3"));
  bad = good;
  bad.schedule.next_due = 5;  // not ahead of the 5 local steps
  REQUIRE_THROWS_WITH(lsgd.restore(bad), Contains("next round"));
  bad = good;
  bad.schedule.next_due = 20;  // further than one period ahead
  REQUIRE_THROWS_WITH(lsgd.restore(bad), Contains("next round"));
  REQUIRE(lsgd.state().schedule.next_due == 8);  // a rejected load changes nothing
  lsgd.restore(good);

  adaptive_period a({.initial_period = 2, .max_period = 4});
  auto as = a.state();
  as.period = 5;
  REQUIRE_THROWS_WITH(a.restore(as, 0), Contains("period is 5"));
  as = a.state();
  as.beta_power = 0.5;  // no samples but a decayed beta power
  REQUIRE_THROWS_WITH(a.restore(as, 0), Contains("inconsistent"));
  as = a.state();
  as.has_reference = true;
  REQUIRE_THROWS_WITH(a.restore(as, 0), Contains("reference"));
}

// ---- bytes -----------------------------------------------------------------------------------

TEST_CASE("local_sgd: byte counters against hand-computed values", "[local_sgd][bytes]") {
  // Lists: float {10, 0}, half {7}, double {3}: payload = 40 + 14 + 24 = 78 bytes.
  SECTION("3 ranks, fixed period 4, start 2, 14 steps") {
    gradapt::comm::run_threads(3, [](threads_comm& comm) {
      std::vector<std::vector<float>> f = {std::vector<float>(10), {}};
      std::vector<std::vector<half>> h = {std::vector<half>(7)};
      std::vector<std::vector<double>> d = {std::vector<double>(3)};
      const auto fl = views_of(f);
      const auto hl = views_of(h);
      const auto dl = views_of(d);
      local_sgd lsgd(comm, {.start_step = 2}, fixed_period({.period = 4}));
      for (int t = 0; t < 14; ++t) lsgd.step(comm, gradapt::host{}, fl, hl, dl);
      // 12 local steps, rounds at c = 4, 8, 12. Ring bytes per round: floor(2 * 2 * 78 / 3) = 104.
      RANK_REQUIRE(lsgd.rounds() == 3);
      RANK_REQUIRE(lsgd.payload_bytes() == 3 * 78);
      RANK_REQUIRE(lsgd.ring_bytes() == 3 * 104);
      RANK_REQUIRE(lsgd.every_step_payload_bytes() == 12 * 78);
      RANK_REQUIRE(lsgd.every_step_ring_bytes() == 12 * 104);
    });
  }
  SECTION("4 ranks, hierarchical {2: 2, 4: world}, start 0, 8 steps") {
    gradapt::comm::run_threads(4, [](threads_comm& comm) {
      std::vector<std::vector<float>> f = {std::vector<float>(10), {}};
      std::vector<std::vector<half>> h = {std::vector<half>(7)};
      std::vector<std::vector<double>> d = {std::vector<double>(3)};
      const auto fl = views_of(f);
      const auto hl = views_of(h);
      const auto dl = views_of(d);
      local_sgd lsgd(comm, {},
                     hierarchical_period({.levels = {{.period = 2, .group_size = 2},
                                                     {.period = 4, .group_size = world_marker}}}));
      for (int t = 0; t < 8; ++t) lsgd.step(comm, gradapt::host{}, fl, hl, dl);
      // Rounds: c = 2 (pairs), 4 (world), 6 (pairs), 8 (world).
      // Ring bytes: pairs floor(2 * 1 * 78 / 2) = 78, world floor(2 * 3 * 78 / 4) = 117.
      RANK_REQUIRE(lsgd.rounds() == 4);
      RANK_REQUIRE(lsgd.rounds_at(0) == 2);
      RANK_REQUIRE(lsgd.rounds_at(1) == 2);
      RANK_REQUIRE(lsgd.payload_bytes() == 4 * 78);
      RANK_REQUIRE(lsgd.ring_bytes() == 2 * 78 + 2 * 117);
      RANK_REQUIRE(lsgd.every_step_payload_bytes() == 8 * 78);
      RANK_REQUIRE(lsgd.every_step_ring_bytes() == 8 * 117);
    });
  }
  SECTION("1 rank sends nothing") {
    gradapt::comm::single comm;
    std::vector<float> x(10);
    const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
    local_sgd lsgd(comm, {}, fixed_period({.period = 2}));
    for (int t = 0; t < 6; ++t) lsgd.step(comm, gradapt::host{}, xs);
    REQUIRE(lsgd.rounds() == 3);
    REQUIRE(lsgd.payload_bytes() == 3 * 40);
    REQUIRE(lsgd.ring_bytes() == 0);
    REQUIRE(lsgd.every_step_ring_bytes() == 0);
  }
}

// ---- allocation ------------------------------------------------------------------------------

TEST_CASE("local_sgd: the steady-state step allocates nothing", "[local_sgd][alloc]") {
  const auto check = [](threads_comm& comm, auto lsgd) {
    std::vector<float> x(64, 1.0f);
    std::vector<half> m(32, half(0.5f));
    const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
    const std::vector<tensor_view<half>> ms = {gradapt::host_view(m)};
    const gradapt::host backend{.threads = 1};
    const auto one = [&](int t) {
      if constexpr (decltype(lsgd)::schedule_type::uses_loss)
        lsgd.step(comm, backend, {.loss = 1.0 + 1.0 / (1.0 + t), .lr = 0.1}, xs, ms);
      else
        lsgd.step(comm, backend, xs, ms);
    };
    for (int t = 0; t < 20; ++t) one(t);  // warm-up: the communicator's scratch, list agreement
    const std::size_t before = alloc_counter::on_this_thread();
    for (int t = 20; t < 60; ++t) one(t);
    const std::size_t after = alloc_counter::on_this_thread();
    RANK_REQUIRE(after == before);
    RANK_REQUIRE(lsgd.rounds() > 10);
  };
  gradapt::comm::run_threads(3, [&](threads_comm& comm) {
    check(comm, local_sgd(comm, {.start_step = 2}, fixed_period({.period = 2})));
    check(comm, local_sgd(comm, {}, adaptive_period({.initial_period = 2, .max_period = 3})));
    check(comm, local_sgd(comm, {},
                          hierarchical_period({.levels = {{.period = 1, .group_size = 2},
                                                          {.period = 3, .group_size = world_marker}}})));
  });
}

// ---- errors ----------------------------------------------------------------------------------

TEST_CASE("schedules reject invalid options with actionable messages", "[local_sgd][errors]") {
  REQUIRE_THROWS_WITH(fixed_period({.period = 0}), Contains("period is 0"));
  REQUIRE_THROWS_WITH(fixed_period({.period = -3}), Contains("period is -3"));
  REQUIRE_THROWS_WITH(fixed_period({.period = 4, .warmup_rounds = -1}), Contains("warmup_rounds is -1"));
  REQUIRE_THROWS_WITH(adaptive_period({.max_period = 0}), Contains("max_period is 0"));
  REQUIRE_THROWS_WITH(adaptive_period({.initial_period = 0}), Contains("initial_period is 0"));
  REQUIRE_THROWS_WITH(adaptive_period({.initial_period = 8, .max_period = 4}), Contains("K_max >= K_0"));
  REQUIRE_THROWS_WITH(adaptive_period({.smoothing = 1.0}), Contains("smoothing is 1"));
  REQUIRE_THROWS_WITH(adaptive_period({.smoothing = -0.1}), Contains("smoothing is -0.1"));
  REQUIRE_THROWS_WITH(adaptive_period({.smoothing = std::nan("")}), Contains("smoothing is nan"));
  REQUIRE_THROWS_WITH(hierarchical_period({}), Contains("no levels"));
  REQUIRE_THROWS_WITH(hierarchical_period({.levels = std::vector<hierarchical_level>(9, {.period = 1})}),
                      Contains("9 levels"));
  REQUIRE_THROWS_WITH(hierarchical_period({.levels = {{.period = 0}}}), Contains("period 0"));
  REQUIRE_THROWS_WITH(hierarchical_period({.levels = {{.period = 4, .group_size = 2}, {.period = 4}}}),
                      Contains("strictly increasing"));
  REQUIRE_THROWS_WITH(hierarchical_period({.levels = {{.period = 2, .group_size = 0}, {.period = 4}}}),
                      Contains("group size 0"));
  REQUIRE_THROWS_WITH(hierarchical_period({.levels = {{.period = 2, .group_size = -2}, {.period = 4}}}),
                      Contains("group size -2"));
}

TEST_CASE("local_sgd: hierarchies that do not fit the communicator are rejected on every rank",
          "[local_sgd][errors]") {
  const auto build = [](int n, std::vector<hierarchical_level> levels) {
    gradapt::comm::run_threads(
        n, [&](threads_comm& comm) { local_sgd lsgd(comm, {}, hierarchical_period({.levels = levels})); });
  };
  REQUIRE_THROWS_WITH(
      build(6, {{.period = 2, .group_size = 2}, {.period = 4, .group_size = 3}, {.period = 8}}),
      Contains("groups must nest"));
  REQUIRE_THROWS_WITH(build(8, {{.period = 2, .group_size = 2}, {.period = 4, .group_size = 4}}),
                      Contains("last level"));
  REQUIRE_THROWS_WITH(build(8, {{.period = 2, .group_size = 16}, {.period = 4}}), Contains("group size 16"));
  // Valid: 6 ranks in groups of 4 ({0..3}, {4, 5}) under the world.
  REQUIRE_NOTHROW(build(6, {{.period = 2, .group_size = 4}, {.period = 4}}));
}

TEST_CASE("local_sgd: invalid loss or learning rate on one rank makes every rank throw, nothing averaged",
          "[local_sgd][errors]") {
  struct bad_case {
    double loss, lr;
    const char* own;
  };
  for (const bad_case bc :
       {bad_case{1.0, 0.0, "learning rate is 0"}, bad_case{1.0, -0.5, "learning rate is -0.5"},
        bad_case{-2.0, 0.1, "loss is -2"},
        bad_case{1.0, std::numeric_limits<double>::quiet_NaN(), "learning rate is nan"}}) {
    gradapt::comm::run_threads(3, [&](threads_comm& comm) {
      const int r = comm.rank();
      local_sgd lsgd(comm, {.start_step = 1}, adaptive_period({.initial_period = 2}));
      std::vector<double> x = {static_cast<double>(r)};
      const std::vector<tensor_view<double>> xs = {gradapt::host_view(x)};
      const gradapt::host backend{};
      lsgd.step(comm, backend, {.loss = 1.0, .lr = 0.1}, xs);  // synchronous
      lsgd.step(comm, backend, {.loss = 1.0, .lr = 0.1}, xs);  // local c = 1
      const gradapt::local_sgd_input in = r == 2 ? gradapt::local_sgd_input{.loss = bc.loss, .lr = bc.lr}
                                                 : gradapt::local_sgd_input{.loss = 1.0, .lr = 0.1};
      if (r == 2)
        RANK_REQUIRE_THROWS_WITH(lsgd.step(comm, backend, in, xs), Contains(bc.own));
      else
        RANK_REQUIRE_THROWS_WITH(lsgd.step(comm, backend, in, xs), Contains("1 other rank(s)"));
      RANK_REQUIRE(x[0] == static_cast<double>(r));
      RANK_REQUIRE(lsgd.steps() == 2);
      RANK_REQUIRE(lsgd.rounds() == 0);
      // The run can go on: the round is retried with valid input.
      const auto res = lsgd.step(comm, backend, {.loss = 1.0, .lr = 0.1}, xs);
      RANK_REQUIRE(res.averaged);
      RANK_REQUIRE(x[0] == 1.0);
    });
  }
  // A NaN loss is a skipped sample, not an error.
  gradapt::comm::run_threads(2, [](threads_comm& comm) {
    local_sgd lsgd(comm, {}, adaptive_period({.initial_period = 1}));
    std::vector<double> x = {1.0};
    const std::vector<tensor_view<double>> xs = {gradapt::host_view(x)};
    const double loss = comm.rank() == 0 ? std::nan("") : 1.0;
    const auto res =
        lsgd.step(comm, gradapt::host{}, {.loss = loss, .lr = 0.1}, xs);  // collective: not under the lock
    RANK_REQUIRE(res.averaged);
    RANK_REQUIRE(lsgd.schedule().skipped() == 1);
    RANK_REQUIRE(lsgd.schedule().samples() == 0);
  });
}

TEST_CASE("local_sgd: lists that differ across ranks throw on every rank", "[local_sgd][errors]") {
  SECTION("a tensor size differs: the list agreement, or without it the communicator, names the sizes") {
    for (bool check : {true, false}) {
      gradapt::comm::run_threads(3, [&](threads_comm& comm) {
        std::vector<float> x(comm.rank() == 1 ? 5 : 4, 1.0f);
        const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
        local_sgd lsgd(comm, {.check_lists = check}, fixed_period({.period = 1}));
        RANK_REQUIRE_THROWS_WITH(lsgd.step(comm, gradapt::host{}, xs),
                                 Contains("ranges from 16 to 20 across ranks"));
        RANK_REQUIRE(lsgd.rounds() == 0);
      });
    }
  }
  SECTION("a rank passes one tensor fewer: the list agreement catches it before any allreduce") {
    for (int n : {2, 3, 5}) {
      gradapt::comm::run_threads(n, [](threads_comm& comm) {
        std::vector<std::vector<float>> bufs(comm.rank() == 1 ? 2 : 3, std::vector<float>(4, 1.0f));
        const auto xs = views_of(bufs);
        local_sgd lsgd(comm, {}, fixed_period({.period = 1}));
        RANK_REQUIRE_THROWS_WITH(lsgd.step(comm, gradapt::host{}, xs), Contains("tensors"));
        RANK_REQUIRE(bufs[0][0] == 1.0f);
      });
    }
  }
  SECTION("a different communicator than the one the driver was built on") {
    gradapt::comm::run_threads(4, [](threads_comm& comm) {
      local_sgd lsgd(comm, {}, fixed_period({.period = 1}));
      auto half_world = comm.split(comm.rank() % 2, comm.rank());
      std::vector<float> x(4);
      const std::vector<tensor_view<float>> xs = {gradapt::host_view(x)};
      RANK_REQUIRE_THROWS_WITH(lsgd.step(half_world, gradapt::host{}, xs), Contains("same communicator"));
    });
  }
}

}  // namespace gradapt_test_local_sgd_adaptive

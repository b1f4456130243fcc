// Local SGD (sync/local_sgd.hpp) on the threads communicator, 1 to 8 ranks: average_models,
// the fixed and hierarchical schedules and the hand-over at start_step.
//
// References used here, none of which calls the code under test:
//  - rank means of inputs that are multiples of 1/4 below 8 in magnitude: every partial sum
//    is exact in every element type, so the expected mean is the exact quotient rounded once
//    to the compute type (and then to the storage type), computed in long double;
//  - hand-derived tables of averaging steps and groups (fixed warm-up/ramp, hierarchical).
#include "local_sgd_fixtures.hpp"
#include "scenarios/average_models.hpp"

namespace gradapt_test_local_sgd {

using namespace local_sgd_test;

// ---- average_models --------------------------------------------------------------------------

TEMPLATE_TEST_CASE("average_models: exact rank mean with identical bits on every rank",
                   "[local_sgd][average]", float, double, half, bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {13, 0, 29};
  for (int n = 1; n <= 8; ++n) {
    std::vector<std::vector<std::vector<T>>> out(static_cast<std::size_t>(n));
    std::vector<std::vector<double>> out_extra(static_cast<std::size_t>(n));
    std::vector<std::uint64_t> payload(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](threads_comm& comm) {
      const int r = comm.rank();
      std::vector<std::vector<T>> bufs;
      std::size_t off = 0;
      for (std::size_t s : sizes) {
        std::vector<T> b(s);
        for (std::size_t i = 0; i < s; ++i) b[i] = make<T>(dyadic(r, off + i));
        off += s;
        bufs.push_back(std::move(b));
      }
      std::vector<std::vector<double>> extra = {std::vector<double>(5)};
      for (std::size_t i = 0; i < 5; ++i) extra[0][i] = dyadic(r + 3, i);
      const auto list = views_of(bufs);
      const auto extra_list = views_of(extra);
      const gradapt::host backend{.threads = 1};
      payload[static_cast<std::size_t>(r)] = gradapt::average_models(comm, backend, list, extra_list);
      out[static_cast<std::size_t>(r)] = bufs;
      out_extra[static_cast<std::size_t>(r)] = extra[0];
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(n, r);
      REQUIRE(payload[static_cast<std::size_t>(r)] == (13 + 29) * sizeof(T) + 5 * sizeof(double));
      for (std::size_t t = 0; t < sizes.size(); ++t)
        REQUIRE(same_bits(out[static_cast<std::size_t>(r)][t], out[0][t]));
      REQUIRE(same_bits(out_extra[static_cast<std::size_t>(r)], out_extra[0]));
    }
    std::size_t off = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        long double sum = 0;
        for (int r = 0; r < n; ++r) sum += dyadic(r, off + i);
        const std::vector<T> want = {expected_mean<T>(sum, n)};
        const std::vector<T> got = {out[0][t][i]};
        CAPTURE(n, t, i, value(want[0]), value(got[0]));
        REQUIRE(same_bits(got, want));
      }
      off += sizes[t];
    }
    for (std::size_t i = 0; i < 5; ++i) {
      long double sum = 0;
      for (int r = 0; r < n; ++r) sum += dyadic(r + 3, i);
      REQUIRE(out_extra[0][i] == expected_mean<double>(sum, n));
    }
  }
}

TEST_CASE("average_models: random float values agree bit for bit and lie within rounding of the mean",
          "[local_sgd][average]") {
  constexpr std::size_t size = 1000;
  constexpr unsigned seed = 100;
  for (int n = 1; n <= 8; ++n) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](threads_comm& comm) {
      out[static_cast<std::size_t>(comm.rank())] = average_scenario::averaged(comm, seed, size);
    });
    for (int r = 0; r < n; ++r) REQUIRE(same_bits(out[static_cast<std::size_t>(r)], out[0]));
    average_scenario::require_within_rounding_of_mean(out[0], n, seed);
  }
}

__extension__ typedef unsigned __int128 u128;  // exact reference for 64-bit products

TEST_CASE("ring_allreduce_bytes is floor(2 (n - 1) payload / n) without overflow", "[local_sgd][bytes]") {
  const std::vector<std::uint64_t> payloads = {
      0, 1, 2, 3, 7, 78, 1000003, (std::uint64_t{1} << 40) + 17, (std::uint64_t{1} << 62) + 12345};
  for (std::uint64_t p : payloads)
    for (int n = 1; n <= 9; ++n) {
      const u128 exact = n == 1 ? 0 : (static_cast<u128>(2 * (n - 1)) * p) / static_cast<unsigned>(n);
      CAPTURE(p, n);
      REQUIRE(gradapt::ring_allreduce_bytes(p, n) == static_cast<std::uint64_t>(exact));
    }
}

// ---- schedules and the synchronous hand-over -----------------------------------------------

namespace {

/// Steps (0-based) whose local_sgd::step averaged, over `steps` steps on a one-rank world.
template <class S>
std::vector<std::uint64_t> averaging_steps(gradapt::local_sgd_options opt, S schedule, std::uint64_t steps,
                                           std::vector<bool>* sync = nullptr) {
  gradapt::comm::single comm;
  local_sgd lsgd(comm, opt, std::move(schedule));
  std::vector<float> x(3, 1.0f);
  const std::vector<tensor_view<float>> list = {gradapt::host_view(x)};
  std::vector<std::uint64_t> out;
  for (std::uint64_t t = 0; t < steps; ++t) {
    if (sync) sync->push_back(lsgd.sync_gradients());
    REQUIRE(lsgd.sync_gradients() == lsgd.sync_gradients_at(t));
    if (lsgd.step(comm, gradapt::host{.threads = 1}, list).averaged) out.push_back(t);
  }
  return out;
}

}  // namespace

TEST_CASE("fixed_period: warm-up, doubling ramp and K after start_step (hand-derived)",
          "[local_sgd][fixed]") {
  // start_step 3: steps 0, 1, 2 allreduce gradients; local step c = t - 2 for t >= 3.
  // warmup_rounds 2, ramp, K = 6: rounds at c = 1, 2 (period 1), 4 (+2), 8 (+4), 14 (+min(8, 6)),
  // 20, 26, 32 (+6 each), i.e. at t = c + 2.
  std::vector<bool> sync;
  const auto got = averaging_steps({.start_step = 3},
                                   fixed_period({.period = 6, .warmup_rounds = 2, .ramp = true}), 36, &sync);
  REQUIRE(got == std::vector<std::uint64_t>{3, 4, 6, 10, 16, 22, 28, 34});
  for (std::size_t t = 0; t < sync.size(); ++t) REQUIRE(sync[t] == (t < 3));

  // No warm-up, no ramp, K = 8, start 0: t = 7, 15, 23.
  REQUIRE(averaging_steps({}, fixed_period({.period = 8}), 30) == std::vector<std::uint64_t>{7, 15, 23});
  // warmup_rounds 1 with ramp gives periods 1, 2, 4, 8, 8: c = 1, 3, 7, 15, 23 (start 0: t = c - 1).
  REQUIRE(averaging_steps({}, fixed_period({.period = 8, .warmup_rounds = 1, .ramp = true}), 24) ==
          std::vector<std::uint64_t>{0, 2, 6, 14, 22});
  // K = 1: every local step; K = 5 with ramp and no warm-up: periods 2, 4, 5, 5: c = 2, 6, 11, 16.
  REQUIRE(averaging_steps({.start_step = 2}, fixed_period({.period = 1}), 6) ==
          std::vector<std::uint64_t>{2, 3, 4, 5});
  REQUIRE(averaging_steps({}, fixed_period({.period = 5, .ramp = true}), 17) ==
          std::vector<std::uint64_t>{1, 5, 10, 15});
}

TEST_CASE("local_sgd: gradient sync and averaging hand over at start_step and never overlap",
          "[local_sgd][handover]") {
  // Three ranks; during the synchronous phase the caller averages gradients, so the replicas
  // stay identical without any parameter averaging; from start_step on each rank steps alone
  // and only the rounds bring the replicas together.
  const std::uint64_t start = 5;
  gradapt::comm::run_threads(3, [&](threads_comm& comm) {
    local_sgd lsgd(comm, {.start_step = start}, fixed_period({.period = 3, .warmup_rounds = 1}));
    const gradapt::host backend{.threads = 1};
    std::vector<double> x = {1.0}, g = {0.0};
    const std::vector<tensor_view<double>> xs = {gradapt::host_view(x)};
    for (std::uint64_t t = 0; t < 20; ++t) {
      g[0] = static_cast<double>(comm.rank() + 1) * 0.125;  // rank-specific gradient
      const bool sync = lsgd.sync_gradients();
      RANK_REQUIRE(sync == (t < start));
      if (sync) {
        comm.allreduce(gradapt::host_view(g), gradapt::reduce_op::sum);
        g[0] /= 3.0;
      }
      x[0] -= g[0];
      const auto res = lsgd.step(comm, backend, xs);
      // Rounds: c = 1 (warm-up), then every 3: c = 4, 7, 10, 13 -> t = start + c - 1.
      const bool want = t >= start && ((t - start + 1) == 1 || (t - start + 1) % 3 == 1);
      RANK_REQUIRE(res.averaged == want);
      RANK_REQUIRE(lsgd.synchronous_steps() == std::min<std::uint64_t>(t + 1, start));
      RANK_REQUIRE(lsgd.local_steps() == (t + 1 > start ? t + 1 - start : 0));
      double spread[2] = {x[0], -x[0]};
      comm.allreduce(tensor_view<double>::vector(spread, 2), gradapt::reduce_op::max);
      const bool identical = spread[0] == -spread[1];
      // Identical during the synchronous phase and right after every round; apart otherwise.
      RANK_REQUIRE(identical == (t < start || want));
    }
    RANK_REQUIRE(lsgd.rounds() == 5);
  });
}

namespace {

/// Groups of a level as hand-written tables: group[l] lists the members of each group.
using group_table = std::vector<std::vector<std::vector<int>>>;

/// Runs a hierarchical schedule on n ranks for `steps` local steps (start_step 2): each rank
/// adds a rank- and step-specific increment to its two values, then calls step. A serial
/// reference applies the same increments and replaces each group's values by the group mean
/// at the levels of `expected_level` (indexed by local step c, -1 for none).
void run_hierarchy(int n, std::vector<hierarchical_level> levels, const std::vector<int>& expected_level,
                   const group_table& groups) {
  const std::uint64_t start = 2;
  const auto steps = static_cast<std::uint64_t>(expected_level.size()) - 1 + start;
  const auto inc = [](int r, std::uint64_t t, std::size_t i) {
    return static_cast<double>(static_cast<int>((static_cast<std::uint64_t>(r) * 5 + t * 3 + i) % 7) - 3) /
           8.0;
  };
  // Serial reference.
  std::vector<std::vector<long double>> ref(static_cast<std::size_t>(n), std::vector<long double>(2, 0.0L));
  std::vector<std::vector<std::vector<long double>>> ref_after(steps);
  for (std::uint64_t t = 0; t < steps; ++t) {
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < 2; ++i) ref[static_cast<std::size_t>(r)][i] += inc(r, t, i);
    if (t >= start) {
      const int l = expected_level[t - start + 1];
      if (l >= 0)
        for (const auto& grp : groups[static_cast<std::size_t>(l)])
          for (std::size_t i = 0; i < 2; ++i) {
            long double s = 0;
            for (int m : grp) s += ref[static_cast<std::size_t>(m)][i];
            for (int m : grp) ref[static_cast<std::size_t>(m)][i] = s / static_cast<long double>(grp.size());
          }
    }
    ref_after[t] = ref;
  }
  std::vector<std::vector<std::vector<double>>> got(
      steps, std::vector<std::vector<double>>(static_cast<std::size_t>(n)));
  std::vector<std::vector<gradapt::local_sgd_result>> results(static_cast<std::size_t>(n));
  std::vector<std::vector<std::uint64_t>> level_rounds(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, [&](threads_comm& comm) {
    const int r = comm.rank();
    local_sgd lsgd(comm, {.start_step = start}, hierarchical_period({.levels = levels}));
    std::vector<double> x(2, 0.0);
    const std::vector<tensor_view<double>> xs = {gradapt::host_view(x)};
    for (std::uint64_t t = 0; t < steps; ++t) {
      for (std::size_t i = 0; i < 2; ++i) x[i] += inc(r, t, i);
      results[static_cast<std::size_t>(r)].push_back(lsgd.step(comm, gradapt::host{.threads = 1}, xs));
      got[t][static_cast<std::size_t>(r)] = x;
    }
    for (std::size_t l = 0; l < lsgd.levels(); ++l)
      level_rounds[static_cast<std::size_t>(r)].push_back(lsgd.rounds_at(l));
  });
  for (int r = 0; r < n; ++r) {
    std::vector<std::uint64_t> want_rounds(levels.size(), 0);
    for (std::uint64_t t = 0; t < steps; ++t) {
      const auto& res = results[static_cast<std::size_t>(r)][t];
      const int l = t >= start ? expected_level[t - start + 1] : -1;
      CAPTURE(n, r, t, l);
      REQUIRE(res.averaged == (l >= 0));
      REQUIRE(res.level == l);
      if (l >= 0) {
        ++want_rounds[static_cast<std::size_t>(l)];
        std::size_t size = 0;
        for (const auto& grp : groups[static_cast<std::size_t>(l)])
          if (std::find(grp.begin(), grp.end(), r) != grp.end()) size = grp.size();
        REQUIRE(res.group_size == static_cast<int>(size));
      }
      for (std::size_t i = 0; i < 2; ++i)
        REQUIRE(std::fabs(static_cast<long double>(got[t][static_cast<std::size_t>(r)][i]) -
                          ref_after[t][static_cast<std::size_t>(r)][i]) <= 1e-12L);
      // Members of one group hold identical bits right after its round.
      if (l >= 0)
        for (const auto& grp : groups[static_cast<std::size_t>(l)])
          if (std::find(grp.begin(), grp.end(), r) != grp.end())
            for (int m : grp)
              REQUIRE(same_bits(got[t][static_cast<std::size_t>(m)], got[t][static_cast<std::size_t>(r)]));
    }
    REQUIRE(level_rounds[static_cast<std::size_t>(r)] == want_rounds);
  }
}

}  // namespace

TEST_CASE("hierarchical_period: levels and groups follow the hand-derived tables",
          "[local_sgd][hierarchical]") {
  SECTION("8 ranks, {2: 2, 4: 4, 8: world}") {
    // c:      1   2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
    // level:  -   0  -  1  -  0  -  2  -  0  -  1  -  0  -  2   (largest period dividing c)
    const std::vector<int> level = {-9, -1, 0, -1, 1, -1, 0, -1, 2, -1, 0, -1, 1, -1, 0, -1, 2};
    const group_table groups = {
        {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {{0, 1, 2, 3}, {4, 5, 6, 7}}, {{0, 1, 2, 3, 4, 5, 6, 7}}};
    run_hierarchy(8,
                  {{.period = 2, .group_size = 2},
                   {.period = 4, .group_size = 4},
                   {.period = 8, .group_size = world_marker}},
                  level, groups);
  }
  SECTION("5 ranks, {2: 2, 6: 4, 12: world}: the last group of a level is smaller") {
    // c:      1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18
    // level:  -  0  -  0  -  1  -  0  -  0  -  2  -  0  -  0  -  1
    const std::vector<int> level = {-9, -1, 0, -1, 0, -1, 1, -1, 0, -1, 0, -1, 2, -1, 0, -1, 0, -1, 1};
    const group_table groups = {{{0, 1}, {2, 3}, {4}}, {{0, 1, 2, 3}, {4}}, {{0, 1, 2, 3, 4}}};
    run_hierarchy(
        5, {{.period = 2, .group_size = 2}, {.period = 6, .group_size = 4}, {.period = 12, .group_size = 5}},
        level, groups);
  }
  SECTION("3 ranks, {3: 1, 5: world}: a level of singletons averages nothing") {
    // c: 1 2 3 4 5 6 7 8 9 10 -> level: - - 0 - 1 0 - - 0 1
    const std::vector<int> level = {-9, -1, -1, 0, -1, 1, 0, -1, -1, 0, 1};
    const group_table groups = {{{0}, {1}, {2}}, {{0, 1, 2}}};
    run_hierarchy(3, {{.period = 3, .group_size = 1}, {.period = 5, .group_size = world_marker}}, level,
                  groups);
  }
  SECTION("1 to 8 ranks, one level {4: world} behaves like fixed_period{4}") {
    for (int n = 1; n <= 8; ++n) {
      std::vector<int> level(13, -1);
      level[4] = level[8] = level[12] = 0;
      std::vector<int> all(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) all[static_cast<std::size_t>(r)] = r;
      run_hierarchy(n, {{.period = 4, .group_size = world_marker}}, level, {{all}});
    }
  }
}

}  // namespace gradapt_test_local_sgd

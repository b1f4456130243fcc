// Local SGD over comm::mpi with 1 to 5 ranks (odd counts included).
//
// - average_models: exact dyadic inputs (mpi_test_support.hpp) whose sums are exact in every
//   element type, so the expected mean is the exact quotient rounded once to the compute type
//   and once to the storage type; every rank's result is allgathered and compared bit for bit.
// - Random float values: all ranks hold identical bits after averaging (the MPI allreduce hands
//   every rank the one reduced value), within rounding of the long double mean.
// - Hierarchical rounds: a serial re-simulation of every rank, with groups of consecutive
//   ranks, in long double.
// - Adaptive rounds: an independent long double re-implementation of the period rule.
// - Invalid input on one rank, lists and schedules that differ across ranks: every rank throws,
//   none hangs.
//
// The random-float and schedule-disagreement scenarios are shared with the threads tests
// (tests/support/scenarios/average_models.hpp and disagreement.hpp).
// - A checkpoint taken mid-run and restored into a fresh object continues bit for bit.
//
// Every collective runs on every rank before any REQUIRE, so a failure on one rank cannot leave
// the others waiting in a collective.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "local_sgd_fixtures.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/average_models.hpp"
#include "scenarios/disagreement.hpp"

namespace gradapt_test_mpi_local_sgd {

using namespace local_sgd_test;
using namespace mpitest;

using exact::identical_on_every_rank;

TEMPLATE_TEST_CASE("mpi local_sgd: average_models gives the exact mean with identical bits on every rank",
                   "[mpi][local_sgd]", float, double, half, bfloat16) {
  using T = TestType;
  gradapt::comm::mpi comm;
  const int n = comm.size(), r = comm.rank();
  const gradapt::host backend{.threads = 1};
  std::vector<std::vector<T>> bufs = {fill<T>(37, [&](std::size_t i) { return a(r, i); }),
                                      {},
                                      fill<T>(1000, [&](std::size_t i) { return a(r, i + 5); })};
  std::vector<tensor_view<T>> list;
  for (auto& b : bufs) list.push_back(view(b));
  const std::uint64_t payload = gradapt::average_models(comm, backend, list);
  bool same = true;
  for (const auto& b : bufs) same = identical_on_every_rank(comm, b) && same;
  REQUIRE(payload == 1037 * sizeof(T));
  REQUIRE(same);
  const std::size_t offsets[3] = {0, 0, 5};
  for (std::size_t t = 0; t < bufs.size(); ++t)
    for (std::size_t i = 0; i < bufs[t].size(); ++i) {
      long double sum = 0;
      for (int q = 0; q < n; ++q) sum += a(q, i + offsets[t]);
      const std::vector<T> want = {expected_mean<T>(sum, n)};
      const std::vector<T> got = {bufs[t][i]};
      CAPTURE(n, t, i, value(want[0]), value(got[0]));
      REQUIRE(same_bits(got, want));
    }
}

TEST_CASE("mpi local_sgd: random float values are identical on every rank and within rounding of the mean",
          "[mpi][local_sgd]") {
  gradapt::comm::mpi comm;
  constexpr std::size_t size = 20000;  // large enough for the engine's large-message algorithm
  constexpr unsigned seed = 7;
  const auto x = average_scenario::averaged(comm, seed, size);
  const bool same = identical_on_every_rank(comm, x);
  REQUIRE(same);
  average_scenario::require_within_rounding_of_mean(x, comm.size(), seed);
}

TEST_CASE("mpi local_sgd: hierarchical rounds average consecutive groups (serial re-simulation)",
          "[mpi][local_sgd]") {
  gradapt::comm::mpi comm;
  const int n = comm.size(), r = comm.rank();
  // {2: 2, 6: world}; on one rank {2: 1, 6: world}. Groups of 2 are {0,1}, {2,3}, {4}.
  const int g0 = n >= 2 ? 2 : 1;
  const std::uint64_t start = 3, steps = 3 + 24;
  local_sgd lsgd(comm, {.start_step = start},
                 hierarchical_period({.levels = {{.period = 2, .group_size = g0},
                                                 {.period = 6, .group_size = hierarchical_level::world}}}));
  const auto inc = [](int q, std::uint64_t t, std::size_t i) {
    return static_cast<double>(static_cast<int>((static_cast<std::uint64_t>(q) * 5 + t * 3 + i) % 7) - 3) /
           8.0;
  };
  std::vector<std::vector<long double>> ref(static_cast<std::size_t>(n), std::vector<long double>(3, 0.0L));
  std::vector<double> x(3, 0.0);
  const std::vector<tensor_view<double>> xs = {view(x)};
  bool values_ok = true, groups_ok = true, results_ok = true;
  for (std::uint64_t t = 0; t < steps; ++t) {
    for (std::size_t i = 0; i < 3; ++i) {
      x[i] += inc(r, t, i);
      for (int q = 0; q < n; ++q) ref[static_cast<std::size_t>(q)][i] += inc(q, t, i);
    }
    const auto res = lsgd.step(comm, gradapt::host{.threads = 1}, xs);
    // Expected level: the largest period dividing the local step count c.
    const std::uint64_t c = t >= start ? t - start + 1 : 0;
    const int level = c == 0 ? -1 : (c % 6 == 0 ? 1 : (c % 2 == 0 ? 0 : -1));
    results_ok = results_ok && res.averaged == (level >= 0) && res.level == level;
    if (level >= 0) {
      const int g = level == 1 ? n : g0;
      for (int first = 0; first < n; first += g) {
        const int last = std::min(n, first + g);
        for (std::size_t i = 0; i < 3; ++i) {
          long double s = 0;
          for (int q = first; q < last; ++q) s += ref[static_cast<std::size_t>(q)][i];
          for (int q = first; q < last; ++q) ref[static_cast<std::size_t>(q)][i] = s / (last - first);
        }
        if (r >= first && r < last) results_ok = results_ok && res.group_size == last - first;
      }
      // Members of this rank's group hold identical bits.
      std::vector<double> all(3 * static_cast<std::size_t>(n));
      comm.allgather(cview(x), view(all));
      const int first = r / g * g, last = std::min(n, first + g);
      for (int q = first; q < last; ++q)
        groups_ok = groups_ok && std::memcmp(all.data() + 3 * static_cast<std::size_t>(q), x.data(),
                                             3 * sizeof(double)) == 0;
    }
    for (std::size_t i = 0; i < 3; ++i)
      values_ok = values_ok &&
                  std::fabs(static_cast<long double>(x[i]) - ref[static_cast<std::size_t>(r)][i]) <= 1e-12L;
  }
  REQUIRE(results_ok);
  REQUIRE(values_ok);
  REQUIRE(groups_ok);
  REQUIRE(lsgd.rounds_at(0) == 8);  // c = 2, 4, 8, 10, 14, 16, 20, 22
  REQUIRE(lsgd.rounds_at(1) == 4);  // c = 6, 12, 18, 24
}

namespace {

double mpi_loss(int r, std::uint64_t t) {
  if (r == 1 && t >= 20 && t < 26) return std::nan("");  // a skipped round with 2+ ranks
  const double td = static_cast<double>(t);
  return (1.0 + 0.3 * r) * (0.25 + std::exp(-td / 25.0)) * (1.0 + 0.04 * std::cos(2.1 * td + r));
}
double mpi_lr(std::uint64_t t) { return t < 70 ? 0.05 : (t < 130 ? 0.01 : 0.0005); }

}  // namespace

TEST_CASE("mpi local_sgd: adaptive periods match an independent re-computation on every rank",
          "[mpi][local_sgd]") {
  gradapt::comm::mpi comm;
  const int n = comm.size(), r = comm.rank();
  const std::uint64_t start = 2, steps = 200, k0 = 4, k_max = 11;
  const long double beta = 0.6L;
  // Reference: rounds at c = next; EMA of the rank-mean loss; reference round; the formula.
  std::vector<std::uint64_t> want_steps, want_periods;
  long double ema = 0, bp = 1, f0 = 0, eta0 = 0, min_gap = 1;
  bool has = false;
  std::uint64_t k = k0, next = k0, skips = 0;
  for (std::uint64_t t = start; t < steps; ++t) {
    const std::uint64_t c = t - start + 1;
    if (c != next) continue;
    long double loss = 0;
    for (int q = 0; q < n; ++q) loss += mpi_loss(q, t);
    loss /= n;
    const long double lr = mpi_lr(t);
    if (!std::isfinite(loss)) {
      ++skips;
    } else {
      ema = beta * ema + (1 - beta) * loss;
      bp *= beta;
      const long double f = ema / (1 - bp);
      if (!has) {
        has = true;
        f0 = f;
        eta0 = lr;
      }
      const long double xk = std::sqrt((eta0 / lr) * (f / f0)) * static_cast<long double>(k0);
      const long double nearest = std::nearbyint(xk);
      long double kk = nearest;
      if (std::fabs(xk - nearest) > 1e-9L * std::max(1.0L, nearest)) {
        kk = std::ceil(xk);
        min_gap = std::min(min_gap, std::fabs(xk - nearest));
      }
      k = static_cast<std::uint64_t>(std::clamp(kk, 1.0L, static_cast<long double>(k_max)));
    }
    next = c + k;
    want_steps.push_back(t);
    want_periods.push_back(k);
  }
  local_sgd lsgd(comm, {.start_step = start},
                 adaptive_period({.initial_period = static_cast<std::int64_t>(k0),
                                  .max_period = static_cast<std::int64_t>(k_max),
                                  .smoothing = static_cast<double>(beta)}));
  std::vector<float> x = {static_cast<float>(r)};
  const std::vector<tensor_view<float>> xs = {view(x)};
  std::vector<std::uint64_t> got_steps, got_periods;
  for (std::uint64_t t = 0; t < steps; ++t) {
    const auto res =
        lsgd.step(comm, gradapt::host{.threads = 1}, {.loss = mpi_loss(r, t), .lr = mpi_lr(t)}, xs);
    if (res.averaged) {
      got_steps.push_back(t);
      got_periods.push_back(lsgd.schedule().period());
    }
  }
  // Every rank saw the same sequence (compare rank 0's with ours).
  std::vector<double> seq(got_periods.begin(), got_periods.end());
  seq.resize(64, -1.0);
  const bool same = identical_on_every_rank(comm, seq);
  REQUIRE(min_gap > 1e-6L);
  REQUIRE(want_periods.size() >= 10);
  REQUIRE(std::count(want_periods.begin(), want_periods.end(), k_max) >= 1);
  REQUIRE(*std::min_element(want_periods.begin(), want_periods.end()) < k0);
  REQUIRE(same);
  REQUIRE(got_steps == want_steps);
  REQUIRE(got_periods == want_periods);
  REQUIRE(lsgd.schedule().skipped() == skips);
  if (n >= 2) REQUIRE(skips >= 1);
}

TEST_CASE("mpi local_sgd: invalid input or mismatched lists on one rank make every rank throw",
          "[mpi][local_sgd]") {
  gradapt::comm::mpi comm;
  const int n = comm.size(), r = comm.rank();
  const int bad = n - 1;
  SECTION("learning rate 0 on the last rank") {
    local_sgd lsgd(comm, {}, adaptive_period({.initial_period = 1}));
    std::vector<double> x = {static_cast<double>(r)};
    const std::vector<tensor_view<double>> xs = {view(x)};
    const std::string msg =
        error_of([&] { lsgd.step(comm, gradapt::host{}, {.loss = 1.0, .lr = r == bad ? 0.0 : 0.1}, xs); });
    CAPTURE(msg);
    if (r == bad)
      REQUIRE(msg.find("learning rate is 0") != std::string::npos);
    else
      REQUIRE(msg.find("1 other rank(s)") != std::string::npos);
    REQUIRE(x[0] == static_cast<double>(r));
    REQUIRE(lsgd.rounds() == 0);
  }
  SECTION(
      "another period or start step on rank 0: an error at the first differing round, not a hang (2+ "
      "ranks)") {
    if (n >= 2)
      for (const auto& c : disagreement_scenario::local_sgd_cases<gradapt::comm::mpi>()) {
        const std::string msg = error_of([&] { c.body(comm); });
        CAPTURE(c.what, msg);
        CHECK(msg.find(c.expected(r)) != std::string::npos);
      }
  }
  SECTION("one tensor fewer on the last rank (2+ ranks)") {
    if (n >= 2) {
      std::vector<std::vector<float>> bufs(r == bad ? 1 : 2, std::vector<float>(8, 1.0f));
      std::vector<tensor_view<float>> xs;
      for (auto& b : bufs) xs.push_back(view(b));
      local_sgd lsgd(comm, {}, fixed_period({.period = 1}));
      const std::string msg = error_of([&] { lsgd.step(comm, gradapt::host{}, xs); });
      CAPTURE(msg);
      REQUIRE(msg.find("tensors") != std::string::npos);
    }
  }
  SECTION("a tensor size differs without the round agreement: average_models names the bytes (2+ ranks)") {
    if (n >= 2) {
      std::vector<float> v(r == bad ? 9 : 8, 1.0f);
      const std::vector<tensor_view<float>> xs = {view(v)};
      local_sgd lsgd(comm, {.check_lists = false}, fixed_period({.period = 1}));
      const std::string msg = error_of([&] { lsgd.step(comm, gradapt::host{}, xs); });
      CAPTURE(msg);
      REQUIRE(msg.find("average_models on rank") != std::string::npos);
      REQUIRE(msg.find("ranges from 32 to 36 across ranks") != std::string::npos);
    }
  }
}

TEST_CASE("mpi local_sgd: a checkpoint restored mid-run continues bit for bit", "[mpi][local_sgd]") {
  gradapt::comm::mpi comm;
  const int r = comm.rank();
  const gradapt::host backend{.threads = 1};
  const auto train = [&](auto& lsgd, std::vector<float>& x, std::uint64_t t) {
    double loss = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double d =
          static_cast<double>(x[i]) - std::sin(0.2 * static_cast<double>(t) + r + static_cast<double>(i));
      loss += d * d;
      x[i] = static_cast<float>(static_cast<double>(x[i]) - 0.2 * d);
    }
    const std::vector<tensor_view<float>> xs = {view(x)};
    lsgd.step(comm, backend, {.loss = loss, .lr = 0.2}, xs);
  };
  const adaptive_period schedule({.initial_period = 2, .max_period = 7, .smoothing = 0.5});
  const std::uint64_t split = 23, steps = 60;
  std::vector<float> xa(5, 0.0f);
  local_sgd la(comm, {.start_step = 1}, schedule);
  for (std::uint64_t t = 0; t < steps; ++t) train(la, xa, t);

  std::vector<float> xb(5, 0.0f);
  std::vector<std::byte> ck;  // one state archive
  {
    local_sgd lb(comm, {.start_step = 1}, schedule);
    for (std::uint64_t t = 0; t < split; ++t) train(lb, xb, t);
    ck = lb.save();
  }
  local_sgd lc(comm, {.start_step = 1}, schedule);
  lc.load(ck);
  for (std::uint64_t t = split; t < steps; ++t) train(lc, xb, t);
  REQUIRE(same_bits(xa, xb));
  REQUIRE(la.rounds() == lc.rounds());
  REQUIRE(la.rounds() >= 8);
  REQUIRE(la.schedule().period() == lc.schedule().period());
  REQUIRE(std::bit_cast<std::uint64_t>(la.state().schedule.ema) ==
          std::bit_cast<std::uint64_t>(lc.state().schedule.ema));
  REQUIRE(la.ring_bytes() == lc.ring_bytes());
}

}  // namespace gradapt_test_mpi_local_sgd

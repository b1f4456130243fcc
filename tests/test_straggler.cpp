// gradapt::elastic::straggler_detector (elastic/straggler.hpp):
//  1. an injected 3× straggler (one rank of 2..8, jittered ±30%) is flagged within 20 steps of
//     its onset in each of 20 seeded runs, and no other rank is;
//  2. healthy runs raise nothing in 1,000 steps: ±30% uniform per-rank jitter, with and without
//     rare single-step 3× pauses (0.5% of rank-steps);
//  3. a rank that recovers is cleared once its slow steps leave the window;
//  4. rebalance: batch sizes proportional to speed, exact sums, the remainder rule;
//  5. observe(comm, t) on comm::threads ranks gives every rank the same decisions; an invalid
//     time or detectors at different steps throw on every rank naming the rank; bad options.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bit_flips.hpp"
#include "catch.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/elastic/straggler.hpp"
#include "rank_check.hpp"

namespace gradapt_test_straggler {

using namespace gradapt::elastic;  // straggler_detector, straggler_options
using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;

namespace {
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};

// Per-rank step times: base × U[0.7, 1.3], times `slowdown` for rank `slow` from step `onset`,
// and with probability `pause` a single-step 3× pause.
struct sim {
  int ranks;
  std::mt19937_64 rng;
  int slow = -1;
  std::uint64_t onset = 0;
  double slowdown = 3.0;
  double pause = 0.0;
  std::uint64_t step = 0;
  std::vector<double> next() {
    std::uniform_real_distribution<double> jitter(0.7, 1.3), u(0.0, 1.0);
    std::vector<double> t(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      double x = 0.25 * jitter(rng);
      if (r == slow && step >= onset) x *= slowdown;
      if (pause > 0 && u(rng) < pause) x *= 3.0;
      t[static_cast<std::size_t>(r)] = x;
    }
    ++step;
    return t;
  }
};
}  // namespace

TEST_CASE("straggler: an injected 3x straggler is flagged within 20 steps in every seeded run",
          "[elastic][straggler]") {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    const int ranks = 2 + static_cast<int>(seed % 7);  // 2..8
    INFO("seed " << seed << ", " << ranks << " ranks");
    sim s{ranks, std::mt19937_64(seed)};
    s.slow = static_cast<int>(seed) % ranks;
    s.onset = 100 + seed;
    straggler_detector d(ranks);
    std::int64_t raised_at = -1;
    for (std::uint64_t t = 0; t < s.onset + 60; ++t) {
      const auto& rep = d.observe(s.next());
      for (int r : rep.raised) {
        REQUIRE(r == s.slow);  // no other rank, and nothing before the onset
        REQUIRE(t >= s.onset);
        if (raised_at < 0) raised_at = static_cast<std::int64_t>(t);
      }
    }
    REQUIRE(raised_at >= 0);
    CHECK(raised_at - static_cast<std::int64_t>(s.onset) < 20);
    CHECK(d.flagged(s.slow));
  }
}

TEST_CASE("straggler: no flag in 1,000 healthy steps with 30% jitter, with or without rare pauses",
          "[elastic][straggler]") {
  for (const int ranks : {2, 3, 8})
    for (const double pause : {0.0, 0.005})
      for (unsigned seed = 1; seed <= 5; ++seed) {
        INFO(ranks << " ranks, pause " << pause << ", seed " << seed);
        sim s{ranks, std::mt19937_64(1000 + seed)};
        s.pause = pause;
        straggler_detector d(ranks);
        std::size_t slow_steps = 0;
        for (int t = 0; t < 1000; ++t) {
          const auto& rep = d.observe(s.next());
          CHECK(rep.flagged.empty());
          for (bool x : rep.slow) slow_steps += x ? 1 : 0;
        }
        if (pause == 0) CHECK(slow_steps == 0);
      }
}

TEST_CASE("straggler: a rank that recovers is cleared when its slow steps leave the window",
          "[elastic][straggler]") {
  const straggler_options o{.window = 10, .persistence = 3};
  straggler_detector d(4, o);
  std::vector<double> t(4, 1.0);
  for (int s = 0; s < 10; ++s) d.observe(t);
  t[2] = 3.0;
  std::vector<int> raised, cleared;
  for (int s = 0; s < 5; ++s) {
    const auto& rep = d.observe(t);
    if (!rep.raised.empty()) raised.push_back(s);
  }
  CHECK(raised == std::vector<int>{2});  // the third slow step
  t[2] = 1.0;
  int at = -1;
  for (int s = 0; s < 12 && at < 0; ++s)
    if (!d.observe(t).cleared.empty()) at = s;
  // 5 slow marks in the window; cleared when fewer than 3 remain: after 8 healthy steps.
  CHECK(at == 7);
  CHECK_FALSE(d.flagged(2));
}

TEST_CASE("straggler: rebalance gives batches proportional to speed that sum exactly",
          "[elastic][straggler]") {
  straggler_detector d(4);
  CHECK(d.rebalance(10) == std::vector<std::int64_t>{3, 3, 2, 2});  // equal shares before any step
  const double times[] = {1.0, 1.0, 2.0, 1.0};
  for (int s = 0; s < 3; ++s) d.observe(times);
  CHECK(d.typical_time(2) == 2.0);
  // spare 256 − 4 = 252 by speeds 1 : 1 : 0.5 : 1 → 72, 72, 36, 72 exactly.
  CHECK(d.rebalance(256) == std::vector<std::int64_t>{73, 73, 37, 73});
  // 257 − 4 = 253: 72.29, 72.29, 36.14, 72.29 → floors 252, one more to the lowest-ranked
  // largest fraction (rank 0).
  CHECK(d.rebalance(257) == std::vector<std::int64_t>{74, 73, 37, 73});
  const auto b = d.rebalance(1000, 10);
  std::int64_t sum = 0;
  for (auto x : b) sum += x;
  CHECK(sum == 1000);
  CHECK_THROWS_WITH(d.rebalance(3), Contains("cannot give 4 ranks at least 1"));
}

TEST_CASE("straggler: rebalance on random and extreme inputs: exact sums, min_batch, faster never gets less",
          "[elastic][straggler]") {
  std::mt19937_64 rng(20261128);
  const std::int64_t big = std::int64_t{1} << 62;
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    straggler_detector d(n);
    std::vector<double> t(static_cast<std::size_t>(n));
    for (auto& x : t) {  // zeros, tiny and huge times among ordinary ones
      switch (rng() % 6) {
        case 0:
          x = 0.0;
          break;
        case 1:
          x = 1e-300;
          break;
        case 2:
          x = 1e300;
          break;
        default:
          x = std::ldexp(static_cast<double>(rng() % 1000 + 1), -static_cast<int>(rng() % 20));
      }
    }
    const int steps = static_cast<int>(rng() % 3);  // 0: no timing yet, equal shares
    for (int s = 0; s < steps; ++s) d.observe(t);
    const std::int64_t min_batch =
        1 + static_cast<std::int64_t>(rng() % 4 == 0 ? rng() % (big / 16) : rng() % 8);
    const std::int64_t global =
        rng() % 3 == 0 ? std::numeric_limits<std::int64_t>::max() - static_cast<std::int64_t>(rng() % 100)
                       : min_batch * n + static_cast<std::int64_t>(rng() % 100000);
    INFO("trial " << trial << ": " << n << " ranks, global " << global << ", min " << min_batch);
    if (min_batch > global / n) {
      CHECK_THROWS_WITH(d.rebalance(global, min_batch), Contains("cannot give"));
      continue;
    }
    const auto b = d.rebalance(global, min_batch);
    REQUIRE(b.size() == static_cast<std::size_t>(n));
    std::int64_t left = global;  // subtracted one by one: no overflow near 2^63
    for (const auto x : b) {
      REQUIRE(x >= min_batch);
      left -= x;
    }
    REQUIRE(left == 0);
    if (steps > 0)
      for (int a = 0; a < n; ++a)
        for (int c = 0; c < n; ++c)
          if (d.typical_time(a) < d.typical_time(c))  // a is faster: never fewer examples
            REQUIRE(b[static_cast<std::size_t>(a)] >= b[static_cast<std::size_t>(c)]);
  }
  // A rank with time 0 is the fastest: it gets the spare examples.
  straggler_detector d(3);
  const double zero_one[] = {1.0, 0.0, 2.0};
  d.observe(zero_one);
  CHECK(d.rebalance(30) == std::vector<std::int64_t>{1, 28, 1});
  // min_batch near 2^62 on 4 ranks: an error, not an overflow.
  CHECK_THROWS_WITH(straggler_detector(4).rebalance(std::numeric_limits<std::int64_t>::max(), big),
                    Contains("cannot give 4 ranks at least " + std::to_string(big)));
}

TEST_CASE("straggler: observe over a communicator agrees on every rank; errors on every rank",
          "[elastic][straggler]") {
  run_threads(4, quick, [&](threads& c) {
    straggler_detector d(4);
    sim s{4, std::mt19937_64(7)};  // every rank draws the same stream and keeps its own time
    s.slow = 1;
    s.onset = 30;
    std::vector<int> raised_at;
    for (int t = 0; t < 60; ++t) {
      const auto times = s.next();
      const auto& rep = d.observe(c, times[static_cast<std::size_t>(c.rank())]);
      if (!rep.raised.empty()) {
        RANK_CHECK(rep.raised == std::vector<int>{1});
        raised_at.push_back(t);
      }
    }
    RANK_CHECK(raised_at.size() == 1);
    RANK_CHECK(raised_at.at(0) >= 30);
    RANK_CHECK(raised_at.at(0) < 50);
    RANK_REQUIRE_THROWS_WITH(d.observe(c, c.rank() == 2 ? -1.0 : 1.0), Contains("rank 2's time is -1"));
    straggler_detector other(4);
    if (c.rank() != 3) other.observe(std::vector<double>(4, 1.0));
    RANK_REQUIRE_THROWS_WITH(other.observe(c, 1.0), Contains("rank 3's detector has observed 0 steps"));
  });
  straggler_detector d(2);
  CHECK_THROWS_WITH(d.observe(std::vector<double>{1.0}), Contains("1 times for 2 ranks"));
  CHECK_THROWS_WITH(d.observe(std::vector<double>{1.0, NAN}), Contains("rank 1's time is nan"));
  CHECK(d.steps() == 0);
  CHECK_THROWS_WITH(straggler_detector(0), Contains("ranks is 0"));
  CHECK_THROWS_WITH(straggler_detector(2, {.window = 1}), Contains("window is 1"));
  CHECK_THROWS_WITH(straggler_detector(2, {.window = 4, .persistence = 5}), Contains("persistence is 5"));
  CHECK_THROWS_WITH(straggler_detector(2, {.threshold = 0}), Contains("threshold is 0"));
  CHECK_THROWS_WITH(straggler_detector(2, {.min_ratio = 0.5}), Contains("min_ratio is 0.5"));
  CHECK_THROWS_WITH(straggler_detector(2, {.floor = -1}), Contains("floor is -1"));
  CHECK_THROWS_WITH(d.flagged(2), Contains("rank 2 out of range"));
}

TEST_CASE("straggler: a checkpoint continues bit for bit; every bit flip and impossible fields are rejected",
          "[straggler][checkpoint]") {
  const straggler_options o{.window = 6, .persistence = 2};
  straggler_detector a(4, o), b(4, o);
  const auto times_at = [](int t) {
    return std::vector<double>{1.0 + 0.01 * t, 1.02, t % 2 ? 4.0 : 1.01, 0.99};
  };
  for (int t = 0; t < 9; ++t) a.observe(times_at(t));
  REQUIRE(a.flagged(2));
  const auto bytes = a.save();
  b.load(bytes);
  CHECK(b.steps() == 9);
  CHECK(b.flagged(2));
  CHECK(b.report().flagged == a.report().flagged);
  CHECK(b.report().slow == a.report().slow);
  for (int t = 9; t < 20; ++t) {
    const auto& ra = a.observe(times_at(t));
    const auto& rb = b.observe(times_at(t));
    CHECK(ra.flagged == rb.flagged);
    CHECK(ra.raised == rb.raised);
    CHECK(ra.cleared == rb.cleared);
  }
  CHECK(a.save() == b.save());
  CHECK(a.rebalance(1000) == b.rebalance(1000));
  const auto good = a.save();
  const std::size_t n = gradapt_test::flip_every_bit(
      good, [&](std::span<const std::byte> bad) { b.load(bad); }, [&] { return b.save(); });
  CHECK(n == gradapt_test::flips_for(good.size()));
  // Behind a valid checksum: a flag its marks do not give, a negative time, another world.
  const auto rewrite = [&](auto edit) {
    gradapt::archive_writer w{straggler_detector::archive_kind, straggler_detector::archive_version};
    edit(w);
    return w.finish();
  };
  const auto fields = [&](gradapt::archive_writer& w, std::vector<double> times,
                          std::vector<std::int64_t> flags) {
    w.put("ranks", std::uint64_t{4});
    w.put("window", std::uint64_t{6});
    w.put("persistence", std::uint64_t{2});
    w.put("steps", std::uint64_t{9});
    const std::int64_t sh[2] = {6, 4};
    w.put_tensor<double>("times", std::span<const double>(times), sh);
    std::vector<std::int64_t> marks(24, 0);
    w.put_tensor<std::int64_t>("slow", std::span<const std::int64_t>(marks), sh);
    w.put_tensor<std::int64_t>("flagged", std::span<const std::int64_t>(flags));
  };
  std::vector<double> ok_times(24, 1.0);
  CHECK_THROWS_WITH(b.load(rewrite([&](auto& w) {
    fields(w, ok_times, {0, 0, 1, 0});
  })),
                    Contains("flagged[2] is 1 but rank 2 has 0 slow marks"));
  auto neg = ok_times;
  neg[5] = -1.0;
  CHECK_THROWS_WITH(b.load(rewrite([&](auto& w) {
    fields(w, neg, {0, 0, 0, 0});
  })),
                    Contains("times[1][1] is -1"));
  straggler_detector three(3, o);
  CHECK_THROWS_WITH(three.load(good), Contains("watches 4 ranks but this detector 3"));
  CHECK(b.save() == a.save());  // the failed loads changed nothing
}

}  // namespace gradapt_test_straggler

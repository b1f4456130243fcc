// AdaScale (scaling/adascale.hpp): gain r = (σ² + |G|²) / (σ²/S + |G|²), progress τ += r.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "gradapt/scaling/adascale.hpp"

namespace gradapt_test_adascale {

using Catch::Matchers::Contains;
using gradapt::adascale;
using gradapt::adascale_state;

namespace {
bool same_bits(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}
bool same_state(const adascale_state& a, const adascale_state& b) {
  return same_bits(a.scale, b.scale) && same_bits(a.progress, b.progress) &&
         same_bits(a.last_gain, b.last_gain) && a.steps == b.steps && a.skipped == b.skipped;
}
}  // namespace

TEST_CASE("adascale: gain formula and limits", "[adascale]") {
  // σ² = 1, |G|² = 1, S = 4: (1 + 1) / (1/4 + 1) = 1.6.
  REQUIRE(adascale::gain(1.0, 1.0, 4.0) == Approx(1.6).epsilon(1e-15));
  REQUIRE(adascale::gain(3.0, 0.5, 8.0) == Approx(3.5 / (3.0 / 8.0 + 0.5)).epsilon(1e-15));
  // σ² = 0: noise-free, a bigger batch buys nothing.
  REQUIRE(adascale::gain(0.0, 2.0, 16.0) == 1.0);
  REQUIRE(adascale::gain(0.0, 0.0, 16.0) == 1.0);
  // |G|² = 0 with noise: the step is worth S base steps.
  REQUIRE(adascale::gain(5.0, 0.0, 16.0) == 16.0);
  // S = 1: the base batch itself.
  REQUIRE(adascale::gain(5.0, 0.3, 1.0) == 1.0);
  // Negative estimates are clamped to 0 (AdaptDL does the same).
  REQUIRE(adascale::gain(-1.0, 2.0, 16.0) == 1.0);
  REQUIRE(adascale::gain(2.0, -1.0, 16.0) == 16.0);
  // In terms of the noise scale: σ²/|G|² = B_simple/B_base.
  const double b_simple = 300, b_base = 32, s = 8;
  REQUIRE(adascale::gain(b_simple / b_base, 1.0, s) == Approx((b_simple + b_base) / (b_simple / s + b_base)));
}

TEST_CASE("adascale: gain is monotone in S and bounded by [1, S]", "[adascale]") {
  for (double v : {1e-6, 0.01, 1.0, 100.0, 1e6}) {
    for (double g : {1e-6, 0.5, 1.0, 1e3}) {
      double prev = 1.0;
      for (double s = 1.0; s <= 256.0; s *= 1.5) {
        const double r = adascale::gain(v, g, s);
        REQUIRE(r >= prev);
        REQUIRE(r >= 1.0);
        REQUIRE(r <= s);
        prev = r;
      }
    }
  }
}

TEST_CASE("adascale: progress accumulates the gains and the schedule is read at τ", "[adascale]") {
  adascale ada({.scale = 4.0});
  const auto schedule = [](double tau) { return tau < 3.0 ? 0.1 : 0.01; };
  // Step 1: r = 1.6 at τ = 0.
  auto s1 = ada.step(schedule, 1.0, 1.0);
  REQUIRE(s1.progress == 0.0);
  REQUIRE(s1.gain == Approx(1.6));
  REQUIRE(s1.lr == Approx(0.1 * 1.6));
  REQUIRE(ada.progress() == Approx(1.6));
  // Step 2: |G|² = 0 → r = 4 at τ = 1.6 (schedule still 0.1).
  auto s2 = ada.step(schedule, 2.0, 0.0);
  REQUIRE(s2.gain == 4.0);
  REQUIRE(s2.lr == Approx(0.4));
  REQUIRE(ada.progress() == Approx(5.6));
  // Step 3: past the schedule's drop at τ = 3.
  REQUIRE(ada.learning_rate(schedule, 0.0, 1.0) == Approx(0.01));
  REQUIRE(ada.progress() == Approx(5.6));  // learning_rate does not advance
  REQUIRE(ada.advance(0.0, 1.0) == 1.0);
  REQUIRE(ada.progress() == Approx(6.6));
  REQUIRE(ada.steps() == 3);
  REQUIRE(ada.last_gain() == 1.0);
}

TEST_CASE("adascale: square-root variant for adaptive optimizers", "[adascale]") {
  adascale ada({.scale = 4.0, .sqrt_gain = true});
  const auto one = [](double) { return 1.0; };
  const auto s = ada.step(one, 2.0, 0.0);  // r = 4
  REQUIRE(s.gain == 4.0);
  REQUIRE(s.lr_factor == 2.0);
  REQUIRE(s.lr == 2.0);
  REQUIRE(ada.progress() == 4.0);  // τ still advances by the full gain
  REQUIRE(ada.lr_factor(9.0) == 3.0);
}

TEST_CASE("adascale: the scale may change mid-run", "[adascale]") {
  adascale ada({.scale = 2.0});
  ada.advance(3.0, 0.0);  // r = 2
  ada.set_scale(8.0);
  REQUIRE(ada.scale() == 8.0);
  REQUIRE(ada.advance(3.0, 0.0) == 8.0);
  REQUIRE(ada.progress() == 10.0);
  ada.set_scale(1.0);
  REQUIRE(ada.advance(3.0, 1.0) == 1.0);
  REQUIRE(ada.progress() == 11.0);
}

TEST_CASE("adascale: non-finite statistics are skipped with gain 1", "[adascale]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  adascale ada({.scale = 8.0});
  REQUIRE(ada.advance(nan, 1.0) == 1.0);
  REQUIRE(ada.advance(1.0, inf) == 1.0);
  REQUIRE(ada.skipped() == 2);
  REQUIRE(ada.progress() == 2.0);
  const auto s = ada.step([](double tau) { return 0.5 * tau; }, inf, 1.0);
  REQUIRE(s.gain == 1.0);
  REQUIRE(s.lr == 1.0);  // 0.5 · τ(=2) · 1
  REQUIRE(ada.skipped() == 3);
  REQUIRE_THROWS_WITH(adascale::gain(nan, 1.0, 2.0), Contains("expected finite statistics"));
}

TEST_CASE("adascale: statistics from a gradient noise scale estimator", "[adascale][gns]") {
  gradapt::gradient_noise_scale gns({.smoothing = 0.0});
  adascale ada({.scale = 4.0});
  REQUIRE(ada.gain(gns, 16.0) == 1.0);  // no sample yet
  REQUIRE(ada.advance(gns, 16.0) == 1.0);
  REQUIRE(ada.skipped() == 0);
  // |g_small|^2 = 2 at B = 8, |g_big|^2 = 1.25 at B = 32: |G|^2 = 1, tr(Σ) = 8.
  REQUIRE(gns.update(2.0, 8, 1.25, 32));
  REQUIRE(*gns.grad_sq() == Approx(1.0));
  REQUIRE(*gns.trace() == Approx(8.0));
  // σ² at base batch 8 is tr(Σ)/8 = 1: r = 2 / (1/4 + 1) = 1.6.
  REQUIRE(ada.gain(gns, 8.0) == Approx(1.6));
  const auto s = ada.step([](double) { return 1.0; }, gns, 8.0);
  REQUIRE(s.gain == Approx(1.6));
  REQUIRE(ada.progress() == Approx(2.6));
}

TEST_CASE("adascale: save/restore is exact", "[adascale]") {
  const auto feed = [](adascale& a, int k) {
    if (k == 30) a.set_scale(16.0);
    const double v = k % 9 == 4 ? std::numeric_limits<double>::quiet_NaN() : 1.0 + std::sin(0.3 * k);
    a.advance(v, 0.2 + 0.1 * std::cos(0.7 * k));
  };
  adascale full({.scale = 4.0}), first({.scale = 4.0}), resumed({.scale = 1.0});
  for (int k = 0; k < 60; ++k) feed(full, k);
  for (int k = 0; k < 20; ++k) feed(first, k);
  const adascale_state checkpoint = first.state();
  resumed.restore(checkpoint);
  for (int k = 20; k < 60; ++k) feed(resumed, k);
  REQUIRE(same_state(full.state(), resumed.state()));
  REQUIRE(full.skipped() > 0);
}

TEST_CASE("adascale: invalid input throws actionable errors", "[adascale]") {
  REQUIRE_THROWS_WITH(adascale({.scale = 0.5}), Contains("scale is 0.5") && Contains("expected S >= 1"));
  REQUIRE_THROWS_WITH(adascale({.scale = std::numeric_limits<double>::infinity()}), Contains("scale is inf"));
  adascale ada;
  REQUIRE_THROWS_WITH(ada.set_scale(0.0), Contains("adascale::set_scale: scale is 0"));
  gradapt::gradient_noise_scale gns;
  REQUIRE_THROWS_WITH(ada.gain(gns, 0.0), Contains("base_batch is 0"));
  REQUIRE_THROWS_WITH(ada.step([](double) { return std::numeric_limits<double>::quiet_NaN(); }, 1.0, 1.0),
                      Contains("schedule returned nan"));
  REQUIRE(ada.steps() == 0);  // the failed step did not advance
  adascale_state bad;
  bad.last_gain = 0.5;
  REQUIRE_THROWS_WITH(ada.restore(bad), Contains("field last_gain is 0.5"));
  // The gain is bounded by S: a checkpoint whose last gain exceeds its scale is impossible.
  bad.scale = 4.0;
  bad.last_gain = 1e9;
  REQUIRE_THROWS_WITH(ada.restore(bad), Contains("field last_gain is 1e+09 with scale 4") &&
                                            Contains("1 <= last_gain <= scale"));
  bad.last_gain = 4.0;
  bad.progress = -1.0;
  REQUIRE_THROWS_WITH(ada.restore(bad), Contains("field progress is -1"));
  bad.progress = 3.0;
  bad.steps = 2;
  bad.skipped = 3;
  REQUIRE_THROWS_WITH(ada.restore(bad), Contains("field skipped is 3 with steps 2"));
  bad.skipped = 1;
  ada.restore(bad);  // consistent
  REQUIRE(ada.last_gain() == 4.0);
  // Lowering S caps the last gain at the new bound, so the state stays loadable.
  ada.set_scale(2.0);
  REQUIRE(ada.last_gain() == 2.0);
  adascale again;
  again.restore(ada.state());
}

}  // namespace gradapt_test_adascale

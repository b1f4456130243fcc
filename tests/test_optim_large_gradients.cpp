// Finite input, finite result: gradients far above 1 but whose update is finite in exact
// arithmetic must give finite parameters that moved, for every optimizer whose state can hold
// the exact statistics in float. AdamW and LAMB form (1 - b2) g^2 as ((1 - b2) g) g, SM3 forms
// c1 g^2 as (c1 g) g: finite whenever the exact value is a finite float.
#include "catch.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"

namespace {

/// Steps `opt` three times with gradients of magnitude `g` (alternating signs per element) on
/// a [6, 5] matrix and a 5-vector; requires every parameter finite and every one moved.
template <class Opt>
void finite_after_large_gradients(Opt opt, float g, const char* name) {
  INFO(name);
  std::vector<float> w(30), b(5), gw(30), gb(5);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.05f * static_cast<float>(i);
  gradapt::param_list<float, float> params;
  params.add("w", gradapt::tensor_view<float>(w.data(), {6, 5}),
             gradapt::tensor_view<float>(gw.data(), {6, 5}));
  params.add("b", gradapt::host_view(b), gradapt::host_view(gb));
  const std::vector<float> w0 = w, b0 = b;
  const gradapt::host backend{.threads = 1};
  auto state = opt.init(backend, params);
  for (int t = 1; t <= 3; ++t) {
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = (i + t) % 2 ? g : -g;
    for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = (i + t) % 2 ? -g : g;
    opt.step(backend, params, state, {});
  }
  for (std::size_t i = 0; i < w.size(); ++i) {
    INFO("w[" << i << "] = " << w[i]);
    REQUIRE(std::isfinite(w[i]));
  }
  for (float x : b) REQUIRE(std::isfinite(x));
  REQUIRE(w != w0);
  REQUIRE(b != b0);
}

}  // namespace

TEST_CASE("AdamW, LAMB and SM3 stay finite for gradients of 1e20 (where g^2 alone overflows float)",
          "[optim][numerics]") {
  for (const float g : {1e19f, 1e20f, 5e20f}) {
    INFO("g = " << g);
    finite_after_large_gradients(gradapt::adamw({.lr = 1e-3}), g, "adamw");
    finite_after_large_gradients(gradapt::lamb({.lr = 1e-3}), g, "lamb");
    finite_after_large_gradients(gradapt::sm3({.lr = 1e-3, .b2 = 0.999}), g, "sm3");
  }
}

TEST_CASE("SGD and LARS stay finite up to gradients of 1e30", "[optim][numerics]") {
  for (const float g : {1e20f, 1e30f}) {
    INFO("g = " << g);
    finite_after_large_gradients(gradapt::sgd({.lr = 0.01 / static_cast<double>(g), .momentum = 0.9}), g,
                                 "sgd");
    finite_after_large_gradients(gradapt::lars({.lr = 1e-3}), g, "lars");
  }
}

TEST_CASE("eps = 0 with eps_root = 0 is rejected where a zero gradient would give 0/0",
          "[optim][validation]") {
  REQUIRE_THROWS_WITH(gradapt::adamw({.eps = 0.0}),
                      Catch::Matchers::Contains("adamw: eps and eps_root are both 0"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.eps = 0.0}),
                      Catch::Matchers::Contains("lamb: eps and eps_root are both 0"));
  REQUIRE_NOTHROW(gradapt::adamw({.eps = 0.0, .eps_root = 1e-16}));
}

// Finite input, finite result: gradients far above 1 but whose update is finite in exact
// arithmetic must give finite parameters that moved, for every optimizer whose state can hold
// the exact statistics in float. AdamW and LAMB form (1 - b2) g^2 as ((1 - b2) g) g, SM3 forms
// c1 g^2 as (c1 g) g: finite whenever the exact value is a finite float. Where the exact
// statistic exceeds float's range (c g^2 > FLT_MAX), the step must report it (gradapt::error
// from the step's check of the parameters it wrote, or the state's interval check) instead of
// leaving a frozen or NaN parameter silently.
#include "catch.hpp"

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"

namespace gradapt_test_optim_large_gradients {

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

/// Gradients of magnitude `g` on a [6, 5] matrix and a 5-vector, alternating in sign.
struct large_gradient_model {
  std::vector<float> w = std::vector<float>(30), b = std::vector<float>(5), gw = std::vector<float>(30),
                     gb = std::vector<float>(5);
  gradapt::param_list<float, float> params;
  large_gradient_model() {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.05f * static_cast<float>(i);
    params.add("w", gradapt::tensor_view<float>(w.data(), {6, 5}),
               gradapt::tensor_view<float>(gw.data(), {6, 5}));
    params.add("b", gradapt::host_view(b), gradapt::host_view(gb));
  }
  void set(float g, int t) {
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = (i + t) % 2 ? g : -g;
    for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = (i + t) % 2 ? -g : g;
  }
};

/// `c` is the coefficient of g^2 in the statistic the optimizer's first step stores (0: none).
/// When c g^2 is a finite float, three steps give finite parameters that moved; otherwise
/// the first step throws naming the non-finite state, every later step throws, save()
/// refuses the state, and loading the checkpoint taken before the failure lets training go on.
template <class Opt>
void finite_or_reported(Opt opt, float g, double c, const char* name) {
  INFO(name << ", g = " << g);
  const double stat = c * static_cast<double>(g) * static_cast<double>(g);
  if (stat <= static_cast<double>(std::numeric_limits<float>::max())) {
    finite_after_large_gradients(opt, g, name);
    return;
  }
  large_gradient_model m;
  const gradapt::host backend{.threads = 1};
  auto state = opt.init(backend, m.params);
  state.set_check_interval(1);
  m.set(1.0f, 0);
  opt.step(backend, m.params, state, {});
  const auto good = state.save(backend);
  const std::vector<float> w_good = m.w;
  m.set(g, 1);
  REQUIRE_THROWS_WITH(opt.step(backend, m.params, state, {}),
                      (Catch::Matchers::Contains("are not finite") ||
                       Catch::Matchers::Contains("left non-finite values in parameter")) &&
                          Catch::Matchers::Contains("restore a checkpoint"));
  REQUIRE_THROWS_WITH(opt.step(backend, m.params, state, {}),
                      Catch::Matchers::Contains("holds non-finite values since a check after step 2"));
  REQUIRE_THROWS_WITH(state.save(backend), Catch::Matchers::Contains("holds a non-finite value"));
  state.load(backend, good);
  m.w = w_good;
  m.set(1.0f, 2);
  opt.step(backend, m.params, state, {});
  for (const float x : m.w) REQUIRE(std::isfinite(x));
}

}  // namespace

TEST_CASE(
    "Every optimizer: gradients of 1e20, 1e30 and FLT_MAX give finite moved parameters, or a reported "
    "state overflow where the exact statistic exceeds float",
    "[optim][numerics]") {
  const float fmax = std::numeric_limits<float>::max();
  for (const float g : {1e20f, 1e30f, fmax}) {
    finite_or_reported(gradapt::sgd({.lr = 1e-3}), g, 0.0, "sgd");
    finite_or_reported(gradapt::sgd({.lr = 1e-3, .momentum = 0.9}), g, 0.0, "sgd momentum");
    finite_or_reported(gradapt::lars({.lr = 1e-3}), g, 0.0, "lars");
    finite_or_reported(gradapt::adamw({.lr = 1e-3}), g, 1e-3, "adamw");
    finite_or_reported(gradapt::lamb({.lr = 1e-3}), g, 1e-3, "lamb");
    finite_or_reported(gradapt::sm3({.lr = 1e-3, .b2 = 0.999}), g, 1e-3, "sm3 (b2 = 0.999)");
    finite_or_reported(gradapt::sm3({.lr = 1e-3}), g, 1.0, "sm3");
    finite_or_reported(gradapt::adafactor({}), g, 1.0, "adafactor");
  }
}

TEST_CASE(
    "A statistic that overflows behind a finite parameter is found by the interval check; 0 turns it off",
    "[optim][numerics]") {
  const gradapt::adamw opt({.lr = 1e-3});
  large_gradient_model m;
  const gradapt::host backend{.threads = 1};
  auto state = opt.init(backend, m.params);
  REQUIRE(state.check_interval() == 100);
  state.set_check_interval(3);
  m.set(1.0f, 0);
  opt.step(backend, m.params, state, {});  // step 1: checked
  m.set(1e30f, 1);
  opt.step(backend, m.params, state, {});  // step 2: v overflows, the parameters stay finite
  for (const float x : m.w) REQUIRE(std::isfinite(x));
  m.set(1.0f, 2);
  REQUIRE_THROWS_WITH(
      opt.step(backend, m.params, state, {}),  // step 3: checked
      Catch::Matchers::Contains("after step 3") && Catch::Matchers::Contains("parameter 'w'"));
  auto off = opt.init(backend, m.params);
  off.set_check_interval(0);
  m.set(1e30f, 0);
  for (int t = 0; t < 3; ++t) REQUIRE_NOTHROW(opt.step(backend, m.params, off, {}));
}

TEST_CASE("AdamW, LAMB and SM3 stay finite for gradients of 1e20 (where g^2 alone overflows float)",
          "[optim][numerics]") {
  // Three steps: (1 - b2) g^2 summed three times stays below FLT_MAX up to g of about 3.3e20.
  for (const float g : {1e19f, 1e20f, 2e20f}) {
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

}  // namespace gradapt_test_optim_large_gradients

namespace gradapt_test_optim_large_gradients {

namespace {
/// Ten steps of `opt` (default check interval) on gradients of magnitude `g` with random
/// signs: after every step that returns, every parameter is finite; a step that would leave
/// one non-finite throws at that step, naming it.
template <class Opt>
void never_silently_nonfinite(Opt opt, float g, const char* name) {
  INFO(name << ", g = " << g);
  large_gradient_model m;
  const gradapt::host backend{.threads = 1};
  auto state = opt.init(backend, m.params);
  std::uint32_t seed = 12345;
  for (int t = 1; t <= 10; ++t) {
    for (auto* v : {&m.gw, &m.gb})
      for (auto& x : *v) {
        seed = seed * 1664525u + 1013904223u;
        x = (seed >> 31) ? g : -g;
      }
    try {
      opt.step(backend, m.params, state, {});
    } catch (const gradapt::error& e) {
      const std::string what = e.what();
      INFO(what);
      REQUIRE((what.find("left non-finite values in parameter '") != std::string::npos ||
               what.find("are not finite") != std::string::npos));
      return;
    }
    for (const float x : m.w) REQUIRE(std::isfinite(x));
    for (const float x : m.b) REQUIRE(std::isfinite(x));
  }
}
}  // namespace

TEST_CASE("No step returns with a non-finite parameter from finite gradients (weight decay, momentum)",
          "[optim][numerics]") {
  const float fmax = std::numeric_limits<float>::max();
  for (const float g : {1e30f, fmax}) {
    never_silently_nonfinite(gradapt::sgd({.lr = 1.0, .momentum = 0.9, .weight_decay = 0.5}), g, "sgd");
    never_silently_nonfinite(gradapt::sgd({.lr = 10.0, .momentum = 0.9, .nesterov = true}), g,
                             "sgd nesterov");
    never_silently_nonfinite(gradapt::lars({.lr = 1.0, .weight_decay = 0.5}), g, "lars");
    never_silently_nonfinite(gradapt::adamw({.lr = 1e30, .weight_decay = 0.5}), g, "adamw");
    never_silently_nonfinite(gradapt::lamb({.lr = 1e30}), g, "lamb");
    never_silently_nonfinite(gradapt::sm3({.lr = 1e30}), g, "sm3");
    never_silently_nonfinite(gradapt::adafactor({.lr = 1e30}), g, "adafactor");
  }
  // The reproducer: SGD with momentum and weight decay on FLT_MAX gradients of one sign: the
  // momentum buffer overflows at step 2, and so does the parameter; step 2 throws.
  large_gradient_model m;
  const gradapt::host backend{.threads = 1};
  const gradapt::sgd opt({.lr = 1.0, .momentum = 0.9, .weight_decay = 0.1});
  auto state = opt.init(backend, m.params);
  m.set(fmax, 1);
  opt.step(backend, m.params, state, {});
  for (const float x : m.w) REQUIRE(std::isfinite(x));
  REQUIRE_THROWS_WITH(opt.step(backend, m.params, state, {}),
                      Catch::Matchers::Contains("step 2 left non-finite values in parameter 'w'"));
}

}  // namespace gradapt_test_optim_large_gradients

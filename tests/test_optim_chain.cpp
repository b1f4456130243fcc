// Optimizer chains and presets (optim/) against independent references: properties the peer
// reference vectors do not cover.
//
//  - every option against an independent long double re-computation of the presets' formulas
//    (tests/support/chain_fixtures.hpp): LAMB's trust-ratio clamp and global gradient
//    clipping, LARS's paper denominator, bias correction off, eps_root, masks from param_flags
//    and from name predicates, group lr_scale and weight_decay (also changed mid-run), double
//    parameters, 16-bit parameters and gradients, subnormal gradients;
//  - closed forms of the first step;
//  - edge cases: zero weights, zero gradients, inf and NaN gradients (confined to their tensor),
//    empty tensors, empty lists.
#include "chain_fixtures.hpp"

namespace gradapt_test_optim_chain {

using namespace chain_test;

// ---- every option against the long double reference ---------------------------------------------

TEST_CASE("LAMB options against a long double re-computation", "[optim][lamb][reference]") {
  struct variant {
    const char* what;
    gradapt::lamb_options o;
  };
  const std::vector<variant> variants{
      {"optax defaults", {}},
      {"weight decay + masks", {.weight_decay = 0.01}},
      {"DeepSpeed clamp [0.01, 10] active",
       {.weight_decay = 0.01, .min_trust_ratio = 0.01, .max_trust_ratio = 10}},
      {"tight clamp [0.5, 2]", {.weight_decay = 0.01, .min_trust_ratio = 0.5, .max_trust_ratio = 2}},
      {"apex global clip (active)", {.weight_decay = 0.01, .max_grad_norm = 0.5}},
      {"global clip inactive", {.max_grad_norm = 1e6}},
      {"no bias correction, eps_root",
       {.b1 = 0.8, .b2 = 0.9, .eps = 1e-4, .eps_root = 1e-6, .bias_correction = false}},
      {"predicate masks",
       {.weight_decay = 0.05,
        .skip_weight_decay = [](std::string_view n) { return ends_with(n, ".weight"); },
        .skip_trust_ratio = [](std::string_view n) { return n == "w1d"; }}},
  };
  for (const auto& variant : variants) {
    const auto& o = variant.o;  // a named reference: clang 14 cannot capture structured bindings
    INFO(variant.what);
    problem<float, float> pr(standard_specs(), 5);
    auto ref = ref_init(pr, o.skip_weight_decay, o.skip_trust_ratio);
    const double err = compare(
        gradapt::lamb(o), [&](auto& r, auto g, int s, ld lr) { ref_lamb(r, std::move(g), o, s, lr); }, pr,
        ref, 5);
    REQUIRE(err <= 1);
  }
  // The clamp does bind in the clamped variants (otherwise the test above would not test it).
  problem<float, float> pr(standard_specs(), 5);
  auto a = ref_init(pr), b = ref_init(pr);
  pr.make_grads(1);
  ref_lamb(a, ref_grads(pr.g), {.weight_decay = 0.01}, 1, 0.01L);
  ref_lamb(b, ref_grads(pr.g), {.weight_decay = 0.01, .min_trust_ratio = 0.5, .max_trust_ratio = 2}, 1,
           0.01L);
  bool binds = false;
  for (std::size_t t = 0; t < a.size(); ++t) binds |= a[t].p != b[t].p;
  REQUIRE(binds);
}

TEST_CASE("AdamW, LARS and SGD options against a long double re-computation", "[optim][reference]") {
  for (const auto& o :
       std::vector<gradapt::adamw_options>{{},
                                           {.b1 = 0.5, .b2 = 0.8, .eps = 1e-3, .weight_decay = 0.1},
                                           {.eps_root = 1e-5, .bias_correction = false}}) {
    problem<float, float> pr(standard_specs(), 11);
    auto ref = ref_init(pr, o.skip_weight_decay);
    REQUIRE(compare(
                gradapt::adamw(o), [&](auto& r, auto g, int s, ld lr) { ref_adamw(r, g, o, s, lr); }, pr, ref,
                5) <= 1);
  }
  using gradapt::transform::lars_denominator;
  for (const auto& o : std::vector<gradapt::lars_options>{
           {.weight_decay = 0.01, .trust_coefficient = 0.02},
           {.weight_decay = 0.01, .trust_coefficient = 0.02, .denominator = lars_denominator::sum_of_norms},
           {.weight_decay = 1e-3, .eps = 1e-4, .momentum = 0.8, .nesterov = true},
           {.weight_decay = 1e-3, .momentum = 0.0},
           {.weight_decay = 0.1, .skip_trust_ratio = [](std::string_view n) { return n == "big"; }}}) {
    problem<float, float> pr(standard_specs(), 13);
    auto ref = ref_init(pr, o.skip_weight_decay, o.skip_trust_ratio);
    REQUIRE(compare(
                gradapt::lars(o), [&](auto& r, auto g, int, ld lr) { ref_lars(r, g, o, lr); }, pr, ref, 5) <=
            1);
  }
  for (const auto& o :
       std::vector<gradapt::sgd_options>{{},
                                         {.momentum = 0.9},
                                         {.momentum = 0.9, .nesterov = true, .weight_decay = 0.01},
                                         {.weight_decay = 0.1}}) {
    problem<float, float> pr(standard_specs(), 17);
    auto ref = ref_init(pr, o.skip_weight_decay);
    REQUIRE(compare(
                gradapt::sgd(o), [&](auto& r, auto g, int, ld lr) { ref_sgd(r, g, o, lr); }, pr, ref, 5) <=
            1);
  }
}

TEST_CASE("double parameters follow the long double reference to double precision", "[optim][double]") {
  {
    problem<double, double> pr(standard_specs(), 19);
    const gradapt::lamb_options o{.weight_decay = 0.01, .max_grad_norm = 1.0, .max_trust_ratio = 10};
    auto ref = ref_init(pr);
    REQUIRE(compare(
                gradapt::lamb(o), [&](auto& r, auto g, int s, ld lr) { ref_lamb(r, std::move(g), o, s, lr); },
                pr, ref, 4) <= 1);
  }
  {
    problem<double, double> pr(standard_specs(), 23);
    const gradapt::lars_options o{.weight_decay = 0.01, .nesterov = true};
    auto ref = ref_init(pr);
    REQUIRE(compare(
                gradapt::lars(o), [&](auto& r, auto g, int, ld lr) { ref_lars(r, g, o, lr); }, pr, ref, 4) <=
            1);
  }
}

TEMPLATE_TEST_CASE("16-bit parameters and gradients: one rounding per step", "[optim][half]", gradapt::half,
                   gradapt::bfloat16) {
  // The reference computes in long double and rounds the parameters to the 16-bit type after
  // every step, as a framework keeping 16-bit weights does; gradapt computes in float and
  // rounds once. They may differ by one unit in the last place at a rounding boundary.
  const auto ulp = [](ld x) {
    const int e = std::ilogb(static_cast<double>(x == 0 ? 1e-30L : x));
    return std::is_same_v<TestType, gradapt::half> ? std::ldexp(1.0, std::max(e, -14) - 10)
                                                   : std::ldexp(1.0, e - 7);
  };
  problem<TestType, TestType> pr(standard_specs(), 29);
  const gradapt::lamb_options o{.weight_decay = 0.01};
  auto ref = ref_init(pr);
  host b{.threads = 2};
  gradapt::lamb opt(o);
  auto st = opt.init(b, pr.params);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(st.buffer(0)[0])>, tensor_view<float>>,
                "16-bit parameters keep float state by default");
  for (int s = 1; s <= 3; ++s) {
    pr.make_grads(s);
    opt.step(b, pr.params, st, {.lr = 0.01});
    ref_lamb(ref, ref_grads(pr.g), o, s, 0.01L);
    for (auto& t : ref)
      for (ld& x : t.p) x = static_cast<ld>(gradapt::load(TestType(static_cast<float>(x))));
    for (std::size_t t = 0; t < ref.size(); ++t)
      for (std::size_t i = 0; i < ref[t].p.size(); ++i) {
        INFO("step " << s << " tensor " << pr.specs[t].name << "[" << i << "]");
        const ld got = static_cast<ld>(gradapt::load(pr.p[t][i]));
        REQUIRE(std::fabs(got - ref[t].p[i]) <= ulp(ref[t].p[i]) * 1.001);
        ref[t].p[i] = got;  // continue from gradapt's rounding so errors do not compound
      }
  }
  // Mixed: float master weights, 16-bit gradients, against the float-gradient run on the same
  // (exactly representable) gradient values.
  problem<float, TestType> mixed(standard_specs(), 31);
  problem<float, float> full(standard_specs(), 31);
  gradapt::adamw aw({.weight_decay = 0.01});
  auto sm = aw.init(b, mixed.params);
  auto sf = aw.init(b, full.params);
  for (int s = 1; s <= 3; ++s) {
    mixed.make_grads(s);
    for (std::size_t t = 0; t < mixed.g.size(); ++t)
      for (std::size_t i = 0; i < mixed.g[t].size(); ++i) full.g[t][i] = gradapt::load(mixed.g[t][i]);
    aw.step(b, mixed.params, sm);
    aw.step(b, full.params, sf);
  }
  for (std::size_t t = 0; t < mixed.p.size(); ++t) REQUIRE(same_bits(mixed.p[t], full.p[t]));
}

TEST_CASE("group options: lr_scale and weight_decay, also changed between steps", "[optim][groups]") {
  problem<float, float> pr(standard_specs(), 37);
  const gradapt::adamw_options o{.weight_decay = 0.02};
  auto ref = ref_init(pr);
  const auto start = starts(ref);
  host b{.threads = 1};
  gradapt::adamw opt(o);
  auto st = opt.init(b, pr.params);
  for (int s = 1; s <= 4; ++s) {
    if (s == 3) {  // mid-run change of group 1's options
      pr.params.options(1).lr_scale = 2.0;
      pr.params.options(1).weight_decay = std::nullopt;
      for (std::size_t t = 0; t < ref.size(); ++t)
        if (pr.specs[t].group == 1) {
          ref[t].lr_scale = 2.0L;
          ref[t].wd.reset();
        }
    }
    pr.make_grads(s);
    opt.step(b, pr.params, st);
    ref_adamw(ref, ref_grads(pr.g), o, s, 1e-3L);
  }
  REQUIRE(scaled_error(pr.p, ref, start, 4) <= 1);
}

// ---- closed forms of the first step --------------------------------------------------------------

TEST_CASE("first steps in closed form", "[optim][closed-form]") {
  // AdamW step 1: m̂ = g, v̂ = g², so u = g / (|g| + eps) + λ p and p1 = p0 − η u.
  std::vector<float> p{0.5f, -2.0f, 0.0f, 3.0f}, g{0.25f, -0.5f, 1.0f, 0.0f};
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  const std::vector<float> p0 = p;
  host b{.threads = 1};
  {
    gradapt::adamw opt({.lr = 0.1, .eps = 0.25, .weight_decay = 0.5});
    auto st = opt.init(b, params);
    opt.step(b, params, st);
    for (std::size_t i = 0; i < p.size(); ++i) {
      const ld u = static_cast<ld>(g[i]) / (std::fabs(static_cast<ld>(g[i])) + 0.25L) + 0.5L * p0[i];
      REQUIRE(std::fabs(p[i] - (p0[i] - 0.1L * u)) <= ulp_of<float>(p0[i] - 0.1L * u));
    }
  }
  // LAMB step 1: u as above; r = ‖p‖/‖u‖ clamped to max_ratio: with a tiny update the clamp
  // binds and p1 = p0 − η · r_max · u exactly up to rounding.
  p = p0;
  std::vector<float> tiny{1e-3f, -1e-3f, 1e-3f, 0.0f};
  g = tiny;
  {
    gradapt::lamb opt({.lr = 0.1, .eps = 1.0, .max_trust_ratio = 10});
    auto st = opt.init(b, params);
    opt.step(b, params, st);
    ld un = 0, pn = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const ld u = static_cast<ld>(tiny[i]) / (std::fabs(static_cast<ld>(tiny[i])) + 1.0L);
      un += u * u;
      pn += static_cast<ld>(p0[i]) * p0[i];
    }
    REQUIRE(std::sqrt(pn) / std::sqrt(un) > 10);  // the clamp binds
    for (std::size_t i = 0; i < p.size(); ++i) {
      const ld u = static_cast<ld>(tiny[i]) / (std::fabs(static_cast<ld>(tiny[i])) + 1.0L);
      REQUIRE(std::fabs(p[i] - (p0[i] - 0.1L * 10 * u)) <= ulp_of<float>(p0[i] - 0.1L * 10 * u));
    }
  }
  // LARS step 1 (momentum buffer starts at 0): p1 = p0 − η r (g + λp), both denominators.
  for (auto den : {gradapt::transform::lars_denominator::norm_of_sum,
                   gradapt::transform::lars_denominator::sum_of_norms}) {
    p = p0;
    g = {0.25f, -0.5f, 1.0f, 0.0f};
    gradapt::lars opt(
        {.lr = 0.5, .weight_decay = 0.1, .trust_coefficient = 0.01, .eps = 0.0, .denominator = den});
    auto st = opt.init(b, params);
    opt.step(b, params, st);
    ld pn = 0, gn = 0, dn = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const ld d = g[i] + 0.1L * p0[i];
      pn += static_cast<ld>(p0[i]) * p0[i];
      gn += static_cast<ld>(g[i]) * g[i];
      dn += d * d;
    }
    const ld r = den == gradapt::transform::lars_denominator::norm_of_sum
                     ? 0.01L * std::sqrt(pn) / std::sqrt(dn)
                     : 0.01L * std::sqrt(pn) / (std::sqrt(gn) + 0.1L * std::sqrt(pn));
    for (std::size_t i = 0; i < p.size(); ++i) {
      const ld want = p0[i] - 0.5L * r * (g[i] + 0.1L * p0[i]);
      REQUIRE(std::fabs(p[i] - want) <= ulp_of<float>(want));
    }
  }
}

// ---- edge cases --------------------------------------------------------------------------------

TEST_CASE("zero weights and zero gradients", "[optim][edge]") {
  host b{.threads = 1};
  std::vector<float> p(10, 0.0f), g(10, 0.0f);
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  // LAMB with both norms 0: r = 1, nothing moves, nothing becomes NaN.
  gradapt::lamb lamb({.weight_decay = 0.1});
  auto sl = lamb.init(b, params);
  lamb.step(b, params, sl);
  for (float x : p) REQUIRE(x == 0.0f);
  // Zero weights, non-zero gradient: r = 1 (‖p‖ = 0), so the step is the plain Adam direction.
  std::fill(g.begin(), g.end(), 0.5f);
  lamb.step(b, params, sl);
  for (float x : p) REQUIRE(close(x, -1e-3 * (0.05 / 0.19) / (std::sqrt(0.00025 / 0.001999) + 1e-6), 1e-5));
  // LARS with zero gradient and zero weights: r = 1, no NaN.
  std::fill(p.begin(), p.end(), 0.0f);
  std::fill(g.begin(), g.end(), 0.0f);
  gradapt::lars lars({.weight_decay = 0.1});
  auto sr = lars.init(b, params);
  lars.step(b, params, sr);
  for (float x : p) REQUIRE(x == 0.0f);
}

TEST_CASE("inf and NaN gradients stay in their tensor", "[optim][edge][nonfinite]") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf}) {
    INFO("bad gradient " << bad);
    std::vector<float> p1(20, 1.0f), g1(20, 0.1f), p2(20, 1.0f), g2(20, 0.1f);
    g1[3] = bad;
    gradapt::param_list<float> params;
    params.add("bad", gradapt::host_view(p1), gradapt::host_view(g1));
    params.add("good", gradapt::host_view(p2), gradapt::host_view(g2));
    host b{.threads = 2};
    const auto good_after = [&](auto opt) {
      std::fill(p1.begin(), p1.end(), 1.0f);
      std::fill(p2.begin(), p2.end(), 1.0f);
      auto st = opt.init(b, params);
      // The update completes, then the step reports the non-finite parameter it wrote.
      REQUIRE_THROWS_WITH(opt.step(b, params, st),
                          Catch::Matchers::Contains("step 1 left non-finite values in parameter 'bad'"));
      return p2;
    };
    // LAMB: the trust ratio of the bad tensor is NaN, so all of it becomes NaN (as in optax
    // and apex); the other tensor is untouched by it.
    auto other = good_after(gradapt::lamb({.weight_decay = 0.01}));
    for (float x : p1) REQUIRE(std::isnan(x));
    for (float x : other) REQUIRE(std::isfinite(x));
    // AdamW: only the element (inf/inf in the Adam direction is NaN).
    other = good_after(gradapt::adamw());
    for (std::size_t i = 0; i < p1.size(); ++i) REQUIRE(std::isfinite(p1[i]) == (i != 3));
    for (float x : other) REQUIRE(std::isfinite(x));
    // LARS: the norm is NaN or inf: the tensor's ratio is NaN or 0, never the other tensor's.
    other = good_after(gradapt::lars({.weight_decay = 0.01}));
    for (float x : other) REQUIRE(std::isfinite(x));
    // LAMB with global clipping: the global norm is not finite, which reaches every tensor
    // (inf gives factor 0, NaN leaves the gradients as they are): documented behaviour.
    good_after(gradapt::lamb({.max_grad_norm = 1.0}));
    REQUIRE(std::isnan(p1[3]));
  }
}

TEST_CASE("subnormal gradients use exact double norms", "[optim][edge][denormal]") {
  // Without weight decay LAMB's update of a subnormal gradient is tiny but its norm is exact
  // in double, so r = ‖p‖/‖u‖ and the step has length η ‖p‖ (optax's float32 norm underflows
  // to 0 here and gives r = 1; see make_optim_refs.py).
  std::vector<spec> s{{"w", {24}, {}, 0, 1.0, 0.0}};
  problem<float, float> pr(s, 41);
  for (auto& x : pr.g[0]) x = 3e-39f * ((&x - pr.g[0].data()) % 2 ? 1.0f : -1.0f);
  REQUIRE(std::fpclassify(pr.g[0][0]) == FP_SUBNORMAL);
  auto ref = ref_init(pr);
  const auto start = starts(ref);
  host b{.threads = 1};
  gradapt::lamb opt;
  auto st = opt.init(b, pr.params);
  opt.step(b, pr.params, st, {.lr = 0.01});
  ref_lamb(ref, ref_grads(pr.g), {}, 1, 0.01L);
  REQUIRE(scaled_error(pr.p, ref, start, 1) <= 1);
  ld moved = 0, pn = 0;
  for (std::size_t i = 0; i < start[0].size(); ++i) {
    moved += (pr.p[0][i] - start[0][i]) * (pr.p[0][i] - start[0][i]);
    pn += start[0][i] * start[0][i];
  }
  REQUIRE(close(static_cast<double>(std::sqrt(moved)), 0.01 * std::sqrt(static_cast<double>(pn)), 1e-4));
}

TEST_CASE("empty tensors and empty lists", "[optim][edge]") {
  host b{.threads = 2};
  gradapt::param_list<float> none;
  gradapt::lamb lamb({.max_grad_norm = 1.0});
  auto st = lamb.init(b, none);
  lamb.step(b, none, st);
  lamb.step(b, none, st);
  REQUIRE(st.steps() == 2);
  REQUIRE(st.tensors() == 0);
  std::vector<float> e, p{1.0f, 2.0f}, g{0.5f, 0.5f};
  gradapt::param_list<float> params;
  params.add("empty", tensor_view<float>(e.data(), {0, 5}), tensor_view<float>(e.data(), {0, 5}));
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  gradapt::lars lars;
  auto sr = lars.init(b, params);
  lars.step(b, params, sr);
  REQUIRE(p[0] != 1.0f);
}

}  // namespace gradapt_test_optim_chain

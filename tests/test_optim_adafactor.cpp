// gradapt::adafactor (a gradapt::chain preset) on the host backend.
//
//  - multi-step runs against an independent long double re-computation of Shazeer & Stern's
//    algorithm (tests/support/adafactor_fixtures.hpp): 1-D, small and large 2-D, 3-D and 4-D
//    shapes, factored axes adjacent or not, every option (momentum, weight decay (optax and
//    torch forms), relative step, eps1 as a clamp, last-two factoring, clipping and parameter
//    scale off, decay offset, explicit lr), on 1 to 3 threads;
//  - closed form of the first step of a factored matrix (β_1 = 0, so V̂ = R C / mean R);
//  - state size: n + m elements for an n x m factored matrix (+ n m with momentum);
//  - determinism across thread counts, save/restore mid-run (bit-identical continuation), bad
//    checkpoints rejected, no allocation in the steady-state step (SM3's too);
//  - edge cases: zero weights, zero gradients, inf and NaN gradients, empty tensors, empty
//    lists, subnormal gradients, size-1 dims, 16-bit gradients, invalid options and
//    mismatched lists (gradapt::error naming them).
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "adafactor_fixtures.hpp"
#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/optim/sm3.hpp"
#include "optim_runs.hpp"
#include "sanitizer.hpp"

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_optim_adafactor {

using namespace adafactor_test;

TEST_CASE("adafactor matches a long double re-computation of the paper's algorithm", "[optim][adafactor]") {
  struct variant {
    const char* name;
    gradapt::adafactor_options o;
  };
  const std::vector<variant> vs = {
      {"optax defaults", {}},
      {"lr 0.05, momentum 0.9, weight decay 1e-3", {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}},
      {"relative step, no parameter scale",
       {.lr = 0.5, .relative_step = true, .multiply_by_parameter_scale = false}},
      {"clipping off, decay 0.5, offset 2",
       {.lr = 0.01,
        .decay_rate = 0.5,
        .decay_offset = 2,
        .clipping_threshold = std::numeric_limits<double>::infinity()}},
      {"clipping 0.3, min dim 16", {.lr = 0.02, .min_dim_size_to_factor = 16, .clipping_threshold = 0.3}},
      {"torch form", gradapt::torch_adafactor_options(1e-2, 1e-3, 0.05)},
      {"not factored", {.lr = 0.02, .factored = false}},
      {"eps1 1e-3 added", {.lr = 0.02, .eps1 = 1e-3}},
  };
  const auto start = shapes_mix();
  for (const auto& v : vs) {
    INFO(v.name);
    const auto theirs = reference_run(v.o, 5);
    // Under a sanitizer 2 threads only: "bitwise independent of the thread count" below covers 1 and 3.
    for (const int threads :
         gradapt_test::under_sanitizer ? std::vector<int>{2} : std::vector<int>{2, 1, 3}) {
      const double d = compare_runs(library_run(gradapt::adafactor(v.o), 5, threads), theirs, start);
      WARN(v.name << ", on " << threads << " thread(s): largest difference " << d << " of the movement");
      REQUIRE(d <= 2e-5);
    }
  }
}

TEST_CASE("adafactor's comparison separates plausible mistakes", "[optim][adafactor]") {
  // The reference run with one formula changed lands far outside the tolerance above.
  const auto o = gradapt::adafactor_options{.lr = 0.05};
  auto wrong = o;
  wrong.decay_rate = 0.75;  // a slightly different β_t schedule
  const double d = compare_runs(library_run(gradapt::adafactor(o), 4), reference_run(wrong, 4), shapes_mix());
  REQUIRE(d > 100 * 2e-5);
}

TEST_CASE("adafactor's first step on a factored matrix has a closed form", "[optim][adafactor]") {
  // β_1 = 0: R_i = mean_j s_ij, C_j = mean_i s_ij, V̂ = R_i C_j / mean(R). With g_ij = a_i b_j
  // (rank one) and eps1 -> 0, V̂_ij = g_ij² exactly, so y = sign(g) and rms(y) = 1: no clipping,
  // the update is lr · max(rms(p), eps2) · sign(g).
  const std::int64_t n = 128, m = 160;
  std::vector<float> p(static_cast<std::size_t>(n * m), 0.0f), g(p.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < m; ++j)
      g[static_cast<std::size_t>(i * m + j)] = std::ldexp(1.0f + float(i % 5), -3) * ((j % 3) - 1.5f);
  gradapt::param_list<float> pl;
  pl.add("w", gradapt::host_view(p, {n, m}), gradapt::host_view(g, {n, m}));
  host b{.threads = 2};
  gradapt::adafactor opt({.lr = 0.25, .eps1 = 1e-37});  // > 0, and below every g²'s ulp
  auto st = opt.init(b, pl);
  REQUIRE(st.factored(0));
  opt.step(b, pl, st);
  for (std::size_t k = 0; k < p.size(); ++k) {
    const float want = -0.25f * 1e-3f * (g[k] > 0 ? 1.0f : -1.0f);  // p = 0: scale eps2
    REQUIRE(std::fabs(p[k] - want) <= 1e-6f * std::fabs(want));
  }
}

TEST_CASE("adafactor state of an n x m matrix takes n + m elements", "[optim][adafactor]") {
  std::vector<tensor> ts = {make("w", {300, 129}, 1), make("b", {300}, 2), make("small", {127, 500}, 3),
                            make("c", {4, 200, 130}, 4)};
  auto pl = list_of(ts);
  host b{};
  {
    auto st = gradapt::adafactor().init(b, pl);
    REQUIRE(st.factored(0));
    REQUIRE(st.buffer(0)[0].size() == 300 + 129);  // buffer 0: the second moments
    REQUIRE(!st.factored(1));
    REQUIRE(st.buffer(0)[1].size() == 300);
    REQUIRE(!st.factored(2));  // 127 < 128
    REQUIRE(st.buffer(0)[2].size() == 127 * 500);
    REQUIRE(st.factored(3));  // [4] x (200 + 130)
    REQUIRE(st.buffer(0)[3].size() == 4 * (200 + 130));
    REQUIRE(st.state_elements() == 300 + 129 + 300 + 127 * 500 + 4 * 330);
    REQUIRE(st.buffer(1).empty());  // buffer 1: the momentum
  }
  {
    auto st = gradapt::adafactor({.momentum = 0.9}).init(b, pl);
    REQUIRE(st.buffer(0)[0].size() == 300 + 129);
    REQUIRE(st.buffer(1)[0].size() == 300 * 129);
    REQUIRE(st.state_elements() == 300 + 129 + 300 + 127 * 500 + 4 * 330 + pl.total_elements());
    // buffer 1 views the momentum: without decay p moves by exactly m (p ← p − m).
    gradapt_test::require_momentum_step(
        ts, 40, 1.0f, [&] { gradapt::adafactor({.momentum = 0.9}).step(b, pl, st); },
        [&](std::size_t t) { return st.buffer(1)[t]; });
    REQUIRE_THROWS_WITH(st.buffer(7), Contains("index 7 out of range"));
  }
}

TEST_CASE("adafactor is bitwise independent of the thread count", "[optim][adafactor]") {
  std::vector<std::vector<float>> out;
  for (int th : {1, 2, 3}) {
    auto ts = shapes_mix();
    ts.push_back(make("huge", {515, 257}, 11));  // > 2 * 32768 elements: the parallel host paths
    auto pl = list_of(ts);
    host b{.threads = th};
    gradapt::adafactor opt({.lr = 0.03, .momentum = 0.5});
    auto st = opt.init(b, pl);
    gradapt_test::run_steps(ts, 31, 3, [&](std::vector<tensor>&) { opt.step(b, pl, st); });
    out.push_back(gradapt_test::all_params(ts));
  }
  gradapt_test::require_same_bits(out);
}

TEST_CASE("adafactor save/restore continues bit-identically; the step allocates nothing",
          "[optim][adafactor]") {
  for (double mom : {0.0, 0.9}) {
    host b{.threads = 2};
    gradapt::adafactor opt({.lr = 0.02, .momentum = mom, .weight_decay = 1e-4});
    // Saved after 3 steps; a second run restored from the checkpoint, parameters copied.
    gradapt_test::resumed_run run(opt, b, shapes_mix(), 5, 3);
    const auto& bytes = run.bytes;
    auto& sc = run.sc;
    run.continue_to(6, [](auto&& step) {
      const long before = alloc_counter::in_process();
      step();
      REQUIRE(alloc_counter::in_process() == before);
    });
    run.require_same_params();
    REQUIRE(run.sa.save(b) == sc.save(b));

    // Bad checkpoints are rejected and leave the state as it was.
    auto bad = bytes;
    bad.pop_back();
    REQUIRE_THROWS_WITH(sc.load(b, bad), Contains("archive(gradapt.optimizer): checksum mismatch"));
    bad = bytes;
    bad[0] = std::byte{'x'};
    REQUIRE_THROWS_WITH(sc.load(b, bad), Contains("not a gradapt state archive"));
    auto other = shapes_mix();
    other.pop_back();
    auto po = list_of(other);
    auto so = opt.init(b, po);
    REQUIRE_THROWS_WITH(so.load(b, bytes), Contains("tensor count"));
    auto sm = gradapt::adafactor({.momentum = mom > 0 ? 0.0 : 0.9}).init(b, run.pa);
    REQUIRE_THROWS_WITH(sm.load(b, bytes), Contains("active-stage mask"));
    REQUIRE(sc.steps() == 6);
  }
}

TEST_CASE("sm3's steady-state step allocates nothing (1 and 2 threads, with and without momentum)",
          "[optim][sm3]") {
  // The counter lives in this executable; shapes_mix() holds 1-D to 4-D tensors, so the host
  // step's fused covers, its line pieces and the leading-dim covers all run.
  for (const int threads : {1, 2})
    for (const double mom : {0.0, 0.9}) {
      auto a = shapes_mix();
      auto pa = list_of(a);
      host b{.threads = threads};
      gradapt::sm3 opt({.lr = 0.05, .momentum = mom});
      auto sa = opt.init(b, pa);
      for (int s = 1; s <= 4; ++s) {
        gradapt_test::fill_step(a, 11, s);
        const long before = alloc_counter::in_process();
        opt.step(b, pa, sa);
        if (s > 1) REQUIRE(alloc_counter::in_process() == before);
      }
    }
}

TEST_CASE("adafactor composes with global-norm clipping applied to the gradients first",
          "[optim][adafactor]") {
  // Composition outside the optimizer: clip_by_global_norm on params.grads(), then step.
  // Adafactor divides by the root of an EMA of g², so a constant gradient scale cancels (up to
  // eps1): clipping to half the norm at every step leaves the trajectory as it was, while a
  // clip factor that changes between steps changes it.
  host b{.threads = 2};
  gradapt::adafactor opt({.lr = 0.02});
  auto a = shapes_mix(), c = shapes_mix(), d = shapes_mix();
  auto pa = list_of(a), pc = list_of(c), pd = list_of(d);
  auto sa = opt.init(b, pa), sc = opt.init(b, pc), sd = opt.init(b, pd);
  for (int s = 1; s <= 5; ++s) {
    for (std::size_t k = 0; k < a.size(); ++k) {
      const unsigned seed = 13u * static_cast<unsigned>(s) + static_cast<unsigned>(k);
      fill_grad(a[k], seed);
      fill_grad(c[k], seed);
      fill_grad(d[k], seed);
    }
    const double norm = gradapt::global_norm(b, pa.grads());
    REQUIRE(gradapt::clip_by_global_norm(b, pc.grads(), 0.5 * norm) == norm);
    REQUIRE(std::fabs(gradapt::global_norm(b, pc.grads()) - 0.5 * norm) <= 1e-6 * norm);
    // d: a factor that differs from step to step (1/s of the norm).
    gradapt::clip_by_global_norm(b, pd.grads(), norm / s);
    opt.step(b, pa, sa);
    opt.step(b, pc, sc);
    opt.step(b, pd, sd);
  }
  double move = 0, same = 0, varied = 0;
  const auto start = shapes_mix();
  for (std::size_t k = 0; k < a.size(); ++k)
    for (std::size_t i = 0; i < a[k].size(); ++i) {
      move = std::max(move, std::fabs(double(a[k].p[i]) - double(start[k].p[i])));
      same = std::max(same, std::fabs(double(a[k].p[i]) - double(c[k].p[i])));
      varied = std::max(varied, std::fabs(double(a[k].p[i]) - double(d[k].p[i])));
    }
  REQUIRE(move > 0);
  REQUIRE(same == 0.0);  // bit for bit: halving is exact and eps1 is below the ulp of g²
  REQUIRE(varied > 1e-2 * move);
}

TEST_CASE("adafactor edge cases", "[optim][adafactor]") {
  host b{.threads = 2};
  SECTION("zero weights and zero gradients") {
    // Zero gradients: the statistics are eps1 (1e-30), y = 0, p unchanged. Zero weights: the
    // parameter scale is eps2.
    std::vector<tensor> ts = {make("w", {130, 140}, 1), make("v", {20}, 2)};
    auto pl = list_of(ts);
    gradapt::adafactor opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    gradapt_test::require_zero_grads_keep_params(opt, b, ts, pl, st);  // then zero weights
    fill_grad(ts[0], 3);
    fill_grad(ts[1], 4);
    ref_opt ref{{.lr = 0.1}, {}, 0};
    auto theirs = ts;
    ref.init(theirs);
    {
      auto zero_g = theirs;
      for (auto& t : zero_g) std::fill(t.g.begin(), t.g.end(), 0.0f);
      ref.step(zero_g);
    }
    opt.step(b, pl, st);
    ref.step(theirs);
    for (std::size_t k = 0; k < ts.size(); ++k)
      for (std::size_t i = 0; i < ts[k].size(); ++i) {
        REQUIRE(ts[k].p[i] != 0.0f);
        REQUIRE(std::fabs(ts[k].p[i] - theirs[k].p[i]) <= 1e-5f * std::fabs(theirs[k].p[i]));
      }
  }
  SECTION("inf and NaN gradients poison their own tensor only") {
    std::vector<tensor> ts = {make("w", {130, 140}, 1), make("v", {20}, 2), make("ok", {129, 129}, 3)};
    for (std::size_t k = 0; k < ts.size(); ++k) fill_grad(ts[k], static_cast<unsigned>(k));
    ts[0].g[5] = std::numeric_limits<float>::infinity();
    ts[1].g[3] = std::numeric_limits<float>::quiet_NaN();
    auto pl = list_of(ts);
    gradapt::adafactor opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    // The update completes as optax's does; the step then reports the non-finite parameter.
    REQUIRE_THROWS_WITH(opt.step(b, pl, st),
                        Catch::Matchers::Contains("step 1 left non-finite values in parameter 'w'"));
    // inf in g: s = inf in one row and one column, mean(R) = inf, so the normalised factor is
    // NaN/0 and every element of the tensor becomes NaN (optax gives the same).
    REQUIRE(std::all_of(ts[0].p.begin(), ts[0].p.end(), [](float x) { return std::isnan(x); }));
    REQUIRE(std::isnan(ts[1].p[3]));
    REQUIRE(std::all_of(ts[2].p.begin(), ts[2].p.end(), [](float x) { return std::isfinite(x); }));
  }
  SECTION("empty tensors and empty lists") {
    std::vector<tensor> ts = {make("e", {0, 200}, 1), make("w", {128, 130}, 2), make("e2", {0}, 3)};
    auto pl = list_of(ts);
    gradapt::adafactor opt({.lr = 0.1, .min_dim_size_to_factor = 0});
    auto st = opt.init(b, pl);
    REQUIRE(st.buffer(0)[0].size() == 0);
    fill_grad(ts[1], 9);
    opt.step(b, pl, st);
    REQUIRE(st.steps() == 1);
    gradapt::param_list<float> none;
    auto s0 = opt.init(b, none);
    opt.step(b, none, s0);
    REQUIRE(s0.steps() == 1);
    REQUIRE(s0.state_elements() == 0);
  }
  SECTION("subnormal gradients") {
    // g² underflows to 0 in float; eps1 keeps the statistics positive, y is tiny but finite.
    std::vector<tensor> ts = {make("w", {130, 128}, 1), make("v", {24}, 2)};
    for (auto& t : ts)
      for (std::size_t i = 0; i < t.size(); ++i) t.g[i] = std::ldexp(float(int(i % 13) - 6), -140);
    const auto before = ts;
    auto pl = list_of(ts);
    gradapt::adafactor opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    opt.step(b, pl, st);
    for (std::size_t k = 0; k < ts.size(); ++k)
      for (std::size_t i = 0; i < ts[k].size(); ++i) {
        REQUIRE(std::isfinite(ts[k].p[i]));
        // y = g / sqrt(1e-30) ~ 1e-27 · 2^-140+: far below p's ulp, p unchanged.
        REQUIRE(ts[k].p[i] == before[k].p[i]);
      }
  }
  SECTION("size-1 dims and 16-bit gradients") {
    std::vector<float> p(300), p2(300);
    std::vector<gradapt::bfloat16> g(300);
    std::vector<float> gf(300);
    for (std::size_t i = 0; i < 300; ++i) {
      p[i] = p2[i] = float(i % 11) * 0.1f - 0.5f;
      g[i] = gradapt::bfloat16(float(i % 17) * 0.01f - 0.08f);
      gf[i] = float(g[i]);
    }
    gradapt::param_list<float, gradapt::bfloat16> pl;
    pl.add("w", gradapt::host_view(p, {1, 300, 1}), gradapt::host_view(g, {1, 300, 1}));
    gradapt::param_list<float> pf;
    pf.add("w", gradapt::host_view(p2, {1, 300, 1}), gradapt::host_view(gf, {1, 300, 1}));
    gradapt::adafactor opt({.lr = 0.1, .min_dim_size_to_factor = 1});
    auto st = opt.init(b, pl);
    auto sf = opt.init(b, pf);
    REQUIRE(st.factored(0));
    REQUIRE(st.buffer(0)[0].size() == 301);  // [1, 300, 1]: axes 1 (300) and 2 (1, later tie)
    opt.step(b, pl, st);
    opt.step(b, pf, sf);
    REQUIRE(p == p2);
  }
  SECTION("invalid options and mismatched lists") {
    using O = gradapt::adafactor_options;
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.lr = -1}), Contains("lr"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.decay_rate = std::nan("")}), Contains("decay_rate"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.min_dim_size_to_factor = -1}),
                        Contains("min_dim_size_to_factor"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.eps1 = -1}), Contains("eps1"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.eps1 = 0, .eps1_mode = gradapt::adafactor_eps1::clamp}),
                        Contains("eps1"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.clipping_threshold = 0}), Contains("clipping_threshold"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.eps2 = std::numeric_limits<double>::infinity()}),
                        Contains("eps2"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.momentum = 1.0}), Contains("momentum"));
    REQUIRE_THROWS_WITH(gradapt::adafactor(O{.weight_decay = -0.1}), Contains("weight_decay"));
    auto ts = shapes_mix();
    auto pl = list_of(ts);
    gradapt::adafactor opt;
    auto st = opt.init(b, pl);
    REQUIRE_THROWS_WITH(opt.step(b, pl, st, {.lr = std::numeric_limits<double>::quiet_NaN()}),
                        Contains("learning rate is nan"));
    auto fewer = shapes_mix();
    fewer.pop_back();
    auto pf = list_of(fewer);
    REQUIRE_THROWS_WITH(opt.step(b, pf, st), Contains("holds 9 tensors but the state was created for 10"));
    auto other = shapes_mix();
    other[1] = make("small", {16, 25}, 2);
    auto po = list_of(other);
    REQUIRE_THROWS_WITH(opt.step(b, po, st), Contains("parameter 'small' (tensor 1) has 400 elements"));
    gradapt::adafactor with_m({.momentum = 0.9});
    REQUIRE_THROWS_WITH(with_m.step(b, pl, st), Contains("stage 4 on"));
    REQUIRE(st.steps() == 0);
  }
}

}  // namespace gradapt_test_optim_adafactor

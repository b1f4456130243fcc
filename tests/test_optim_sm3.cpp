// gradapt::sm3 on the host backend.
//
//  - multi-step runs against an independent long double re-computation of Anil et al.'s SM3-II
//    with one cover per dimension (written here from the paper and optax's documented formula,
//    not from the library): 1-D, rank-0, 2-D, 3-D and 4-D shapes, size-1 dims, momentum on and
//    off, b2 < 1;
//  - the covers after a step equal the maxima of a over each dim's slices (closed form);
//  - state size: the sum of the dims (n + m for a matrix), plus the momentum buffer;
//  - the same bits on 1 to 3 threads, where the host takes both of its paths (a tensor run as a
//    one-thread task: one fused pass, host::apply_factored_max; a tensor larger than 1/T of
//    the list: reduce_factored, then the update on all threads), non-finite gradients included;
//  - save/restore mid-run, bad checkpoints rejected;
//  - edge cases: zero gradients (u = 0 where a = 0), zero weights, inf and NaN gradients,
//    empty tensors and lists, subnormal gradients, invalid options, mismatched lists.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/sm3.hpp"
#include "optim_runs.hpp"
#include "run_compare.hpp"

namespace gradapt_test_optim_sm3 {

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::tensor_view;
using ld = long double;

namespace {

struct tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> p, g;
  std::size_t size() const { return p.size(); }
};

tensor make(std::string name, std::vector<std::int64_t> shape, unsigned seed) {
  tensor t{std::move(name), std::move(shape), {}, {}};
  std::size_t n = 1;
  for (auto d : t.shape) n *= static_cast<std::size_t>(d);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  t.p.resize(n);
  t.g.resize(n);
  for (auto& x : t.p) x = u(rng);
  return t;
}

void fill_grad(tensor& t, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < t.size(); ++i) t.g[i] = u(rng) * 0.125f * (1.0f + float(i % 5) * 0.5f);
}

gradapt::param_list<float> list_of(std::vector<tensor>& ts) {
  gradapt::param_list<float> pl;
  for (auto& t : ts)
    pl.add(t.name, tensor_view<float>(t.p.data(), std::span<const std::int64_t>(t.shape)),
           tensor_view<float>(t.g.data(), std::span<const std::int64_t>(t.shape)));
  return pl;
}

std::vector<tensor> shapes_mix() {
  return {make("bias", {37}, 1),       make("scalar", {}, 2),        make("mat", {130, 70}, 3),
          make("big", {515, 257}, 4),  make("cube", {3, 40, 29}, 5), make("four", {5, 2, 7, 3}, 6),
          make("unit", {1, 30, 1}, 7), make("row", {1, 50}, 8)};
}

// ---- the long double reference (SM3-II, one cover per dim) ------------------------------------
struct ref_tensor {
  std::vector<std::int64_t> shape;
  std::vector<std::vector<ld>> mu;  // one per dim (rank >= 2) or the full accumulator
  std::vector<ld> m;
};

struct ref_opt {
  gradapt::sm3_options o;
  std::vector<ref_tensor> ts;

  // Calls f(q, i_q) for each coordinate i_q of element `flat` of shape s (row-major).
  template <class F>
  static void for_coords(const std::vector<std::int64_t>& s, std::size_t flat, F&& f) {
    for (std::size_t k = s.size(); k-- > 0;) {
      f(k, flat % static_cast<std::size_t>(s[k]));
      flat /= static_cast<std::size_t>(s[k]);
    }
  }
  void init(const std::vector<tensor>& in) {
    for (const auto& x : in) {
      ref_tensor r;
      r.shape = x.shape;
      if (x.shape.size() < 2)
        r.mu.push_back(std::vector<ld>(x.size(), 0));
      else
        for (auto d : x.shape) r.mu.push_back(std::vector<ld>(static_cast<std::size_t>(d), 0));
      r.m.assign(x.size(), 0);
      ts.push_back(std::move(r));
    }
  }
  void step(std::vector<tensor>& in) {
    const ld c1 = o.b2 == 1.0 ? 1 : 1 - ld(o.b2), c2 = o.b2;
    for (std::size_t k = 0; k < in.size(); ++k) {
      auto& x = in[k];
      auto& r = ts[k];
      const std::size_t n = x.size();
      std::vector<ld> a(n);
      const bool full = x.shape.size() < 2;
      for (std::size_t i = 0; i < n; ++i) {
        ld nu;
        if (full) {
          nu = r.mu[0][i];
        } else {
          nu = std::numeric_limits<ld>::infinity();
          for_coords(x.shape, i, [&](std::size_t q, std::size_t c) { nu = std::min(nu, r.mu[q][c]); });
        }
        a[i] = c1 * ld(x.g[i]) * ld(x.g[i]) + c2 * nu;
      }
      if (full) {
        r.mu[0] = a;
      } else {
        for (auto& v : r.mu) std::fill(v.begin(), v.end(), -std::numeric_limits<ld>::infinity());
        for (std::size_t i = 0; i < n; ++i)
          for_coords(x.shape, i,
                     [&](std::size_t q, std::size_t c) { r.mu[q][c] = std::max(r.mu[q][c], a[i]); });
      }
      for (std::size_t i = 0; i < n; ++i) {
        const ld u = a[i] > 0 ? ld(x.g[i]) / std::sqrt(a[i] + ld(o.eps)) : 0;
        r.m[i] = ld(o.momentum) * r.m[i] + (1 - ld(o.momentum)) * u;
        x.p[i] = static_cast<float>(ld(x.p[i]) - ld(o.lr) * (o.momentum > 0 ? r.m[i] : u));
      }
    }
  }
};

/// Cover k of tensor t (rank >= 2): a slice of the state's buffer 0, whose covers are in dim
/// order.
template <class St>
std::vector<float> cover(const St& st, std::size_t t, const std::vector<std::int64_t>& shape, std::size_t k) {
  const auto v = st.buffer(0)[t];
  std::size_t off = 0;
  for (std::size_t q = 0; q < k; ++q) off += static_cast<std::size_t>(shape[q]);
  return {v.data() + off, v.data() + off + static_cast<std::size_t>(shape[k])};
}

// The reference's parameters after `steps` steps from shapes_mix(), with the gradients
// fill_grad gives step s and tensor k (seed 100 s + k).
std::vector<tensor> reference_run(const gradapt::sm3_options& o, int steps) {
  auto theirs = shapes_mix();
  ref_opt ref{o, {}};
  ref.init(theirs);
  gradapt_test::run_steps(theirs, 100, steps, [&](std::vector<tensor>& ts) { ref.step(ts); });
  return theirs;
}

// gradapt's run on reference_run's gradients, on `threads` threads; `opt` is gradapt::sm3(o)
// or a chain of the same stages.
template <class Opt>
std::vector<tensor> library_run(const Opt& opt, int steps, int threads = 2) {
  return gradapt_test::library_run_on(opt, shapes_mix(), 100, steps, threads);
}

}  // namespace

TEST_CASE("sm3 matches a long double re-computation of SM3-II", "[optim][sm3]") {
  const auto start = shapes_mix();
  for (const auto& o : {gradapt::sm3_options{}, gradapt::sm3_options{.lr = 0.1, .momentum = 0.0},
                        gradapt::sm3_options{.lr = 0.05, .momentum = 0.5, .b2 = 0.9, .eps = 1e-4}}) {
    const auto theirs = reference_run(o, 5);
    for (const int threads : {2, 1, 3}) {
      const double d =
          run_compare::relative_difference(library_run(gradapt::sm3(o), 5, threads), theirs, start);
      WARN("sm3 lr " << o.lr << " momentum " << o.momentum << " b2 " << o.b2 << " on " << threads
                     << " thread(s): largest difference " << d);
      REQUIRE(d <= 2e-5);
    }
  }
  // A plausible mistake (covers summed instead of maximised is too far; a different momentum
  // is the subtle one) lands far outside the tolerance.
  const double wrong = run_compare::relative_difference(
      library_run(gradapt::sm3({.lr = 0.1}), 4), reference_run({.lr = 0.1, .momentum = 0.85}, 4), start);
  REQUIRE(wrong > 100 * 2e-5);
}

TEST_CASE("sm3 covers after one step are the maxima of g^2 over each dim's slices", "[optim][sm3]") {
  std::vector<tensor> ts = {make("c", {4, 6, 5}, 1)};
  fill_grad(ts[0], 9);
  auto pl = list_of(ts);
  host b{};
  gradapt::sm3 opt;
  auto st = opt.init(b, pl);
  opt.step(b, pl, st);
  const std::int64_t D[3] = {4, 6, 5};
  for (std::size_t k = 0; k < 3; ++k) {
    const auto cov = cover(st, 0, ts[0].shape, k);
    REQUIRE(cov.size() == static_cast<std::size_t>(D[k]));
    for (std::int64_t j = 0; j < D[k]; ++j) {
      float want = 0;
      for (std::int64_t a = 0; a < 4; ++a)
        for (std::int64_t bb = 0; bb < 6; ++bb)
          for (std::int64_t c = 0; c < 5; ++c) {
            const std::int64_t idx[3] = {a, bb, c};
            if (idx[k] != j) continue;
            const float g = ts[0].g[static_cast<std::size_t>((a * 6 + bb) * 5 + c)];
            want = std::max(want, g * g);  // a = g^2 + 0 at the first step
          }
      REQUIRE(cov[static_cast<std::size_t>(j)] == want);
    }
  }
}

TEST_CASE("sm3 state takes the sum of the dims", "[optim][sm3]") {
  std::vector<tensor> ts = {make("w", {300, 129}, 1), make("b", {300}, 2), make("c", {4, 20, 13}, 3),
                            make("s", {}, 4)};
  auto pl = list_of(ts);
  host b{};
  auto st = gradapt::sm3({.momentum = 0.0}).init(b, pl);
  REQUIRE(st.buffer(0)[0].size() == 300 + 129);
  REQUIRE(st.buffer(0)[1].size() == 300);
  REQUIRE(st.buffer(0)[2].size() == 4 + 20 + 13);
  REQUIRE(st.buffer(0)[3].size() == 1);
  REQUIRE(st.state_elements() == 429 + 300 + 37 + 1);
  auto sm = gradapt::sm3({.lr = 0.5}).init(b, pl);
  REQUIRE(sm.state_elements() == 429 + 300 + 37 + 1 + pl.total_elements());
  // buffer 1 holds the momentum (empty without it): p ← p − lr m with lr = 0.5.
  REQUIRE(st.buffer(1).empty());
  gradapt_test::require_momentum_step(
      ts, 50, 0.5f, [&] { gradapt::sm3({.lr = 0.5}).step(b, pl, sm); },
      [&](std::size_t t) { return sm.buffer(1)[t]; });
  REQUIRE_THROWS_WITH(sm.buffer(2), Contains("index 2 out of range"));
}

TEST_CASE("sm3 is deterministic across threads and restores exactly", "[optim][sm3]") {
  std::vector<std::vector<float>> out;
  for (int th : {1, 2}) {
    host b{.threads = th};
    gradapt::sm3 opt({.lr = 0.1});
    // save after 3 steps, continue in a copy and in the original
    gradapt_test::resumed_run run(opt, b, shapes_mix(), 7, 3);
    run.continue_to(5);
    const auto& bytes = run.bytes;
    auto& sc = run.sc;
    auto& ts = run.a;
    REQUIRE(run.sa.save(b) == sc.save(b));
    auto bad = bytes;
    bad.erase(bad.end() - 4, bad.end());
    REQUIRE_THROWS_WITH(sc.load(b, bad), Contains("archive(gradapt.optimizer): checksum mismatch"));
    auto sm = gradapt::sm3({.momentum = 0.0}).init(b, run.pa);
    REQUIRE_THROWS_WITH(sm.load(b, bytes), Contains("active-stage mask"));
    out.push_back(gradapt_test::all_params(ts));
  }
  gradapt_test::require_same_bits(out);
}

TEST_CASE("sm3 edge cases", "[optim][sm3]") {
  host b{.threads = 2};
  SECTION("zero gradients leave the parameters; zero weights move") {
    std::vector<tensor> ts = {make("w", {30, 20}, 1), make("v", {9}, 2)};
    auto pl = list_of(ts);
    gradapt::sm3 opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    // a = 0 everywhere: u = 0 (the 0/0 = 0 convention); then zero weights.
    gradapt_test::require_zero_grads_keep_params(opt, b, ts, pl, st);
    fill_grad(ts[0], 4);
    opt.step(b, pl, st);
    REQUIRE(
        std::all_of(ts[0].p.begin(), ts[0].p.end(), [](float x) { return x != 0.0f && std::isfinite(x); }));
  }
  SECTION("inf and NaN gradients stay in their tensor") {
    std::vector<tensor> ts = {make("w", {30, 20}, 1), make("v", {9}, 2), make("ok", {10, 10}, 3)};
    for (std::size_t k = 0; k < ts.size(); ++k) fill_grad(ts[k], static_cast<unsigned>(k));
    ts[0].g[21] = std::numeric_limits<float>::infinity();  // row 1, column 1
    ts[1].g[4] = std::numeric_limits<float>::quiet_NaN();
    auto pl = list_of(ts);
    gradapt::sm3 opt({.lr = 0.1, .momentum = 0.0});
    auto st = opt.init(b, pl);
    // Follows the infinite covers through two steps, so the state's finiteness check (which
    // would report them: test_optim_large_gradients.cpp) is off.
    st.set_check_interval(0);
    opt.step(b, pl, st);
    // w: the inf element gets inf / inf = NaN; the others of row 1 and column 1 get
    // g / sqrt(g^2 + 0) (their own a is finite at the first step); the covers of row 1 and
    // column 1 become inf.
    REQUIRE(std::isnan(ts[0].p[21]));
    REQUIRE(std::isfinite(ts[0].p[22]));
    REQUIRE(std::isinf(cover(st, 0, ts[0].shape, 0)[1]));
    REQUIRE(std::isinf(cover(st, 0, ts[0].shape, 1)[1]));
    REQUIRE(std::isnan(ts[1].p[4]));
    REQUIRE(std::isfinite(ts[1].p[3]));
    REQUIRE(std::all_of(ts[2].p.begin(), ts[2].p.end(), [](float x) { return std::isfinite(x); }));
    // Next step: nu is the minimum over the covers, so only the element whose row and column
    // covers are both inf keeps a = inf (u = g / inf = 0); its neighbours move normally.
    const float keep = ts[0].p[22];
    fill_grad(ts[0], 77);
    opt.step(b, pl, st);
    REQUIRE(std::isfinite(ts[0].p[22]));
    REQUIRE(ts[0].p[22] != keep);
  }
  SECTION("empty tensors, empty lists, subnormal gradients") {
    std::vector<tensor> ts = {make("e", {0, 5}, 1), make("e1", {0}, 2), make("d", {6, 7}, 3)};
    for (std::size_t i = 0; i < ts[2].size(); ++i) ts[2].g[i] = std::ldexp(float(int(i % 5) - 2), -140);
    const auto before = ts;
    auto pl = list_of(ts);
    gradapt::sm3 opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    REQUIRE(st.buffer(0)[0].size() == 0);  // an empty tensor keeps nothing
    opt.step(b, pl, st);
    // g^2 underflows to 0: a = 0, u = 0.
    REQUIRE(ts[2].p == before[2].p);
    gradapt::param_list<float> none;
    auto s0 = opt.init(b, none);
    opt.step(b, none, s0);
    REQUIRE(s0.steps() == 1);
  }
  SECTION("invalid options and mismatched lists") {
    using O = gradapt::sm3_options;
    REQUIRE_THROWS_WITH(gradapt::sm3(O{.lr = -1}), Contains("lr"));
    REQUIRE_THROWS_WITH(gradapt::sm3(O{.momentum = 1}), Contains("momentum"));
    REQUIRE_THROWS_WITH(gradapt::sm3(O{.b2 = 0}), Contains("b2"));
    REQUIRE_THROWS_WITH(gradapt::sm3(O{.eps = -1}), Contains("eps"));
    auto ts = shapes_mix();
    auto pl = list_of(ts);
    gradapt::sm3 opt;
    auto st = opt.init(b, pl);
    auto fewer = shapes_mix();
    fewer.pop_back();
    auto pf = list_of(fewer);
    REQUIRE_THROWS_WITH(opt.step(b, pf, st), Contains("holds 7 tensors but the state was created for 8"));
    REQUIRE_THROWS_WITH(opt.step(b, pl, st, {.lr = std::numeric_limits<double>::infinity()}),
                        Contains("learning rate is inf"));
    REQUIRE_THROWS_WITH(gradapt::sm3({.momentum = 0.0}).step(b, pl, st), Contains("stage 1 off"));
  }
}

// ---- the host's two paths, checkpoints, user chains -------------------------------------------

TEST_CASE("sm3 gives the same bits on 1 to 3 threads (fused and two-pass paths), restores exactly",
          "[optim][sm3][chain]") {
  namespace tf = gradapt::transform;
  for (const auto& o : {gradapt::sm3_options{}, gradapt::sm3_options{.lr = 0.1, .momentum = 0.0},
                        gradapt::sm3_options{.lr = 0.05, .momentum = 0.5, .b2 = 0.9, .eps = 1e-4}}) {
    // One thread: every tensor takes the fused pass. Three threads: "big" ([515, 257], more
    // than a third of the list) takes reduce_factored and the update on all threads, the
    // others the fused pass in one-thread tasks. The maxima do not depend on the order.
    std::vector<std::vector<float>> params, covers;
    for (const int threads : {1, 2, 3}) {
      auto a = shapes_mix();
      auto pa = list_of(a);
      host b{.threads = threads};
      const gradapt::sm3 opt(o);
      auto sa = opt.init(b, pa);
      sa.set_check_interval(0);  // the non-finite values propagate; no check stops the step
      for (int s = 1; s <= 4; ++s) {
        gradapt_test::fill_step(a, 13, s);
        if (s == 3) {  // non-finite gradients, in a fused tensor and in the two-pass one
          a[2].g[5] = INFINITY;
          a[3].g[1000] = NAN;
          a[4].g[7] = -INFINITY;
        }
        opt.step(b, pa, sa);
      }
      std::vector<float> p, c;
      for (std::size_t k = 0; k < a.size(); ++k) {
        p.insert(p.end(), a[k].p.begin(), a[k].p.end());
        c.insert(c.end(), sa.buffer(0)[k].data(), sa.buffer(0)[k].data() + sa.buffer(0)[k].size());
        REQUIRE(sa.factored(k) == (a[k].shape.size() >= 2));
      }
      params.push_back(p);
      covers.push_back(c);
    }
    for (std::size_t r = 1; r < params.size(); ++r) {
      REQUIRE(std::memcmp(params[0].data(), params[r].data(), params[0].size() * sizeof(float)) == 0);
      REQUIRE(std::memcmp(covers[0].data(), covers[r].data(), covers[0].size() * sizeof(float)) == 0);
    }
    // The covers of the NaN's row and column are NaN, stored as the positive quiet NaN.
    const std::uint32_t qnan = std::bit_cast<std::uint32_t>(std::numeric_limits<float>::quiet_NaN());
    std::size_t nans = 0;
    for (const float x : covers[0])
      if (x != x) {
        REQUIRE(std::bit_cast<std::uint32_t>(x) == qnan);
        ++nans;
      }
    REQUIRE(nans >= 2);
  }
  // n + m accumulators for an n x m matrix; save after 2 steps, restore, continue: the same bits.
  host b{.threads = 2};
  const gradapt::sm3 opt({.lr = 0.05});
  gradapt_test::resumed_run run(opt, b, shapes_mix(), 7, 2);
  for (const auto* st : {&run.sa, &run.sc}) {
    REQUIRE(st->buffer(0)[2].size() == 130 + 70);
    REQUIRE(st->buffer(0)[5].size() == 5 + 2 + 7 + 3);
  }
  run.continue_to(4);
  run.require_same_params();
  auto& a = run.a;
  auto& pa = run.pa;
  auto& sa = run.sa;
  // Invalid options name themselves; a user chain may put clipping after the covers.
  REQUIRE_THROWS_WITH(gradapt::sm3({.b2 = 0}), Contains("sm3: b2 is 0"));
  {  // a negative step learning rate: rejected before anything moves
    const auto before = a;
    REQUIRE_THROWS_WITH(opt.step(b, pa, sa, {.lr = -0.05}), Contains("expected >= 0"));
    for (std::size_t k = 0; k < a.size(); ++k) REQUIRE(a[k].p == before[k].p);
  }
  REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_sm3{.eps = -1}}), Contains("eps"));
  gradapt::chain clipped{tf::scale_by_sm3{}, tf::clip_by_block_rms{.threshold = 0.5},
                         tf::scale_by_learning_rate{.lr = 0.1}};
  auto d = shapes_mix();
  auto pd = list_of(d);
  auto sd = clipped.init(b, pd);
  for (std::size_t k = 0; k < d.size(); ++k) fill_grad(d[k], 99u + static_cast<unsigned>(k));
  const auto before = d;
  clipped.step(b, pd, sd);
  // First step: a = g², u = g / √(g² + eps) ≈ sign(g) (rms about 1 > 0.5): clipped to rms 0.5,
  // so each tensor's parameters move by an rms of 0.1 · 0.5 (checked on the dense tensors).
  for (std::size_t k = 0; k < d.size(); ++k) {
    if (d[k].size() < 16) continue;
    double ss = 0;
    for (std::size_t i = 0; i < d[k].size(); ++i) ss += std::pow(double(d[k].p[i]) - before[k].p[i], 2);
    INFO("tensor " << d[k].name);
    REQUIRE(std::fabs(std::sqrt(ss / double(d[k].size())) - 0.05) <= 0.05 * 1e-3);
  }
}

TEST_CASE("sm3: a state saved for [16, 8] does not load into [8, 16]", "[sm3][checkpoint]") {
  // Both keep 24 covers; the dims in the layout tell them apart.
  std::vector<float> p(128), g(128, 0.5f);
  gradapt::param_list<float> wide, tall;
  wide.add("w", gradapt::host_view(p, {16, 8}), gradapt::host_view(g, {16, 8}));
  tall.add("w", gradapt::host_view(p, {8, 16}), gradapt::host_view(g, {8, 16}));
  gradapt::host b{};
  const gradapt::sm3 opt({.lr = 0.1});
  auto sw = opt.init(b, wide);
  opt.step(b, wide, sw);
  auto st = opt.init(b, tall);
  REQUIRE_THROWS_WITH(st.load(b, sw.save(b)),
                      Contains("parameter 'w' has shape [16, 8] in the checkpoint but [8, 16] here"));
  REQUIRE(st.steps() == 0);
}

}  // namespace gradapt_test_optim_sm3

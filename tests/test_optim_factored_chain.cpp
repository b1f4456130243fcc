// Adafactor as a chain: its stages reached through stage<I>(), state layout and workspace,
// thread independence and checkpoints, a user chain starting with
// transform::scale_by_factored_rms against a long double computation, and edge cases (non-finite,
// zero and empty inputs, invalid options), and the pass plan.
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

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_optim_factored_chain {

using namespace adafactor_test;

// ---- gradapt::adafactor as a chain, and user chains starting with transform::scale_by_factored_rms --

TEST_CASE("adafactor: n + m state elements for an n x m matrix, momentum buffer per parameter",
          "[optim][adafactor][chain]") {
  std::vector<tensor> ts = {make("w", {300, 129}, 1), make("b", {300}, 2), make("small", {127, 500}, 3),
                            make("c", {4, 200, 130}, 4), make("empty", {0, 200}, 5)};
  auto pl = list_of(ts);
  host b{};
  const std::size_t stats = 300 + 129 + 300 + 127 * 500 + 4 * (200 + 130);
  {
    auto st = gradapt::adafactor().init(b, pl);
    REQUIRE(st.factored(0));
    REQUIRE(st.buffer(0)[0].size() == 300 + 129);
    REQUIRE(!st.factored(1));
    REQUIRE(st.buffer(0)[1].size() == 300);
    REQUIRE(!st.factored(2));
    REQUIRE(st.factored(3));
    REQUIRE(st.buffer(0)[3].size() == 4 * (200 + 130));
    REQUIRE(!st.factored(4));
    REQUIRE(st.buffer(0)[4].size() == 0);
    REQUIRE(st.state_elements() == stats);
    REQUIRE_THROWS_WITH(st.factored(5), Contains("out of range"));
  }
  {
    auto st = gradapt::adafactor({.momentum = 0.9}).init(b, pl);
    REQUIRE(st.state_elements() == stats + pl.total_elements());
  }
  {
    // The workspace: one slot per thread of the task mode, each O(n + m) of the largest
    // factored tensor (not O(parameters)), plus a few doubles per tensor.
    const std::size_t one = gradapt::adafactor().init(host{.threads = 1}, pl).workspace_bytes();
    const std::size_t two = gradapt::adafactor().init(host{.threads = 2}, pl).workspace_bytes();
    const std::size_t slot = two - one;
    REQUIRE(two > one);
    REQUIRE(slot >= (4 * 330) * sizeof(float));       // the factors of tensor c
    REQUIRE(slot <= 8 * (4 * 330) * sizeof(double));  // a few vectors of n + m
    REQUIRE(one - slot <= 64 * ts.size() * sizeof(double));
    // A chain without a factored stage has no slots.
    const auto adamw = gradapt::adamw();
    REQUIRE(adamw.init(host{.threads = 1}, pl).workspace_bytes() ==
            adamw.init(host{.threads = 2}, pl).workspace_bytes());
    REQUIRE(adamw.init(host{}, pl).workspace_bytes() <= 64 * ts.size() * sizeof(double));
  }
}

TEST_CASE("adafactor is bitwise independent of the thread count, restores exactly and allocates nothing",
          "[optim][adafactor][chain]") {
  const gradapt::adafactor_options o{.lr = 0.03, .momentum = 0.5, .weight_decay = 1e-3};
  std::vector<std::vector<float>> out;
  for (int th : {1, 2, 3}) {
    auto ts = shapes_mix();
    ts.push_back(make("huge", {515, 257}, 11));  // the parallel host paths
    auto pl = list_of(ts);
    host b{.threads = th};
    const auto opt = gradapt::adafactor(o);
    auto st = opt.init(b, pl);
    for (int s = 1; s <= 3; ++s) {
      gradapt_test::fill_step(ts, 31, s);
      const long before = alloc_counter::in_process();
      opt.step(b, pl, st);
      if (s > 1) REQUIRE(alloc_counter::in_process() == before);
    }
    out.push_back(gradapt_test::all_params(ts));
  }
  gradapt_test::require_same_bits(out);

  // Save after 3 steps, restore into a fresh state, continue: the same bits.
  host b{.threads = 2};
  const auto opt = gradapt::adafactor(o);
  gradapt_test::resumed_run run(opt, b, shapes_mix(), 5, 3);
  run.continue_to(5);
  run.require_same_params();
  const auto& bytes = run.bytes;
  auto& pc = run.pc;
  auto& sc = run.sc;
  REQUIRE(run.sa.save(b) == sc.save(b));
  // A state whose tensors factor differently (min_dim 16 factors "small") rejects the bytes.
  auto other = gradapt::adafactor({.lr = 0.03, .min_dim_size_to_factor = 16, .momentum = 0.5});
  auto so = other.init(b, pc);
  REQUIRE_THROWS_WITH(so.load(b, bytes), Contains("factored layout"));
  // The same element counts in another layout: [128, 256] and [256, 128] keep 384 statistics each.
  std::vector<tensor> wide = {make("w", {128, 256}, 1)}, tall = {make("w", {256, 128}, 1)};
  auto pw = list_of(wide);
  auto pt = list_of(tall);
  auto sw = opt.init(b, pw);
  auto st2 = opt.init(b, pt);
  REQUIRE(sw.state_elements() == st2.state_elements());
  REQUIRE_THROWS_WITH(st2.load(b, sw.save(b)),
                      Contains("parameter 'w' has shape [128, 256] in the checkpoint but [256, 128] here"));
  // Options that decide the factoring cannot change under a state.
  auto changed = opt;
  changed.stage<0>().min_dim_size_to_factor = 16;
  REQUIRE_THROWS_WITH(changed.step(b, pc, sc), Contains("another layout than at init"));
  changed.stage<0>().min_dim_size_to_factor = 128;
  changed.stage<0>().axes = gradapt::factor_axes::last_two;  // "apart" [150, 2, 130] factors other dims
  REQUIRE_THROWS_WITH(changed.step(b, pc, sc), Contains("another layout than at init"));
}

namespace {
// A user chain: factored second moment, heavy-ball momentum (trace), weight decay masked off
// biases, learning rate; against a long double computation written from the formulas.
struct user_ref {
  std::vector<ld> r, c, v, tau;
};
}  // namespace

TEST_CASE("a user chain (factored rms, trace, masked decay, lr) matches a long double computation",
          "[optim][adafactor][chain]") {
  namespace tf = gradapt::transform;
  const double beta_rate = 0.8, mu = 0.7, wd = 0.01, lr = 0.05;
  gradapt::chain opt{
      tf::scale_by_factored_rms{.min_dim_size_to_factor = 32}, tf::trace{.decay = mu},
      tf::add_decayed_weights{.weight_decay = wd, .skip = [](std::string_view n) { return n == "bias"; }},
      tf::scale_by_learning_rate{.lr = lr}};
  std::vector<tensor> mine = {make("wide", {40, 70}, 1), make("tall", {90, 33}, 2), make("bias", {37}, 3)};
  auto theirs = mine;
  const auto start = mine;
  auto pl = list_of(mine);
  host b{.threads = 2};
  auto st = opt.init(b, pl);
  REQUIRE(st.factored(0));
  REQUIRE(st.factored(1));
  REQUIRE(!st.factored(2));
  std::vector<user_ref> ref(mine.size());
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const auto& s = mine[k].shape;
    ref[k].tau.assign(mine[k].size(), 0);
    if (s.size() == 2) {
      ref[k].r.assign(static_cast<std::size_t>(s[0]), 0);
      ref[k].c.assign(static_cast<std::size_t>(s[1]), 0);
    } else {
      ref[k].v.assign(mine[k].size(), 0);
    }
  }
  for (int t = 1; t <= 5; ++t) {
    const ld w = std::pow(ld(t), -ld(beta_rate)), beta = 1 - w;
    for (std::size_t k = 0; k < mine.size(); ++k) {
      fill_grad(mine[k], 300u * static_cast<unsigned>(t) + static_cast<unsigned>(k));
      fill_grad(theirs[k], 300u * static_cast<unsigned>(t) + static_cast<unsigned>(k));
      auto& x = theirs[k];
      auto& q = ref[k];
      const std::size_t n = x.size();
      std::vector<ld> y(n);
      if (x.shape.size() == 2) {
        const std::size_t R = static_cast<std::size_t>(x.shape[0]), C = static_cast<std::size_t>(x.shape[1]);
        std::vector<ld> rs(R, 0), cs(C, 0);
        for (std::size_t i = 0; i < R; ++i)
          for (std::size_t j = 0; j < C; ++j) {
            const ld s2 = ld(x.g[i * C + j]) * x.g[i * C + j] + ld(1e-30);
            rs[i] += s2 / ld(C);
            cs[j] += s2 / ld(R);
          }
        for (std::size_t i = 0; i < R; ++i) q.r[i] = beta * q.r[i] + w * rs[i];
        for (std::size_t j = 0; j < C; ++j) q.c[j] = beta * q.c[j] + w * cs[j];
        // The statistic that removes the larger axis is normalised by its mean (optax).
        const bool cols_larger = C >= R;
        ld mean = 0;
        if (cols_larger) {
          for (ld v : q.r) mean += v / ld(R);
        } else {
          for (ld v : q.c) mean += v / ld(C);
        }
        for (std::size_t i = 0; i < R; ++i)
          for (std::size_t j = 0; j < C; ++j) {
            const ld vhat = cols_larger ? q.r[i] / mean * q.c[j] : q.r[i] * (q.c[j] / mean);
            y[i * C + j] = ld(x.g[i * C + j]) / std::sqrt(vhat);
          }
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          q.v[i] = beta * q.v[i] + w * (ld(x.g[i]) * x.g[i] + ld(1e-30));
          y[i] = ld(x.g[i]) / std::sqrt(q.v[i]);
        }
      }
      const ld lam = x.name == "bias" ? 0 : ld(wd);
      for (std::size_t i = 0; i < n; ++i) {
        q.tau[i] = y[i] + ld(mu) * q.tau[i];
        x.p[i] = static_cast<float>(ld(x.p[i]) - ld(lr) * (q.tau[i] + lam * x.p[i]));
      }
    }
    opt.step(b, pl, st);
  }
  double move = 0, err = 0;
  for (std::size_t k = 0; k < mine.size(); ++k)
    for (std::size_t i = 0; i < mine[k].size(); ++i) {
      move = std::max(move, std::fabs(double(theirs[k].p[i]) - double(start[k].p[i])));
      err =
          std::max(err, std::fabs(double(mine[k].p[i]) - double(theirs[k].p[i])) - 4 * std::ldexp(1.0, -23));
    }
  REQUIRE(move > 0.1);
  WARN("user chain: largest difference " << err / move << " of the movement");
  REQUIRE(err / move <= 2e-5);
}

TEST_CASE("adafactor edge cases (chain): non-finite, zero and empty inputs, invalid options",
          "[optim][adafactor][chain]") {
  namespace tf = gradapt::transform;
  host b{.threads = 2};
  SECTION("inf and NaN gradients poison their tensor (as in optax), on one thread and on two") {
    for (const float bad : {INFINITY, NAN}) {
      auto a = shapes_mix();
      auto c = shapes_mix();
      auto pa = list_of(a);
      auto pc = list_of(c);
      const gradapt::adafactor_options o{.lr = 0.02};
      const host b1{.threads = 1};
      const gradapt::adafactor sa_opt(o);
      const gradapt::adafactor ca_opt(o);
      auto sa = sa_opt.init(b1, pa);
      auto sc = ca_opt.init(b, pc);
      sa.set_check_interval(0);  // the values propagate as optax's do; no check stops the step
      sc.set_check_interval(0);
      for (int s = 1; s <= 2; ++s) {
        for (std::size_t k = 0; k < a.size(); ++k) {
          fill_grad(a[k], 9u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
          fill_grad(c[k], 9u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
        }
        if (s == 2) {
          a[3].g[17] = bad;  // "tall": factored
          c[3].g[17] = bad;
          a[0].g[5] = bad;  // "bias": a full second moment
          c[0].g[5] = bad;
        }
        sa_opt.step(b1, pa, sa);
        ca_opt.step(b, pc, sc);
      }
      for (std::size_t k = 0; k < a.size(); ++k)
        for (std::size_t i = 0; i < a[k].size(); ++i) {
          INFO("tensor " << a[k].name << " element " << i);
          REQUIRE(std::isnan(a[k].p[i]) == std::isnan(c[k].p[i]));
          REQUIRE(std::isfinite(a[k].p[i]) == std::isfinite(c[k].p[i]));
        }
      REQUIRE(std::isnan(c[3].p[0]));     // the whole factored tensor
      REQUIRE(std::isfinite(c[1].p[0]));  // other tensors untouched
    }
  }
  SECTION("zero gradients leave the parameters bit for bit; zero weights move by eps2") {
    auto a = shapes_mix();
    const auto start = a;
    auto pa = list_of(a);
    const auto opt = gradapt::adafactor({.lr = 0.1});
    auto st = opt.init(b, pa);
    opt.step(b, pa, st);  // g = 0 (make() leaves it zero)
    for (std::size_t k = 0; k < a.size(); ++k)
      for (std::size_t i = 0; i < a[k].size(); ++i)
        REQUIRE(std::bit_cast<std::uint32_t>(a[k].p[i]) == std::bit_cast<std::uint32_t>(start[k].p[i]));
    std::vector<tensor> z = {make("w", {128, 130}, 1, 0.0f)};
    fill_grad(z[0], 3);
    auto pz = list_of(z);
    auto sz = opt.init(b, pz);
    opt.step(b, pz, sz);
    double top = 0;
    for (float v : z[0].p) top = std::max(top, std::fabs(double(v)));
    REQUIRE(top > 0);
    REQUIRE(top <= 0.1 * 1e-3 * 16);  // lr · eps2 · |y|, y clipped to rms 1
  }
  SECTION("16-bit gradients and parameters (the scalar paths of apply_factored)") {
    // bfloat16 gradients give the bits of the same values as float gradients, factored and
    // not; half parameters run and stay within half's rounding of the float run.
    const std::vector<std::vector<std::int64_t>> shapes = {{130, 140}, {37}, {2, 128, 129}};
    std::vector<std::vector<float>> pf, pb;
    std::vector<std::vector<gradapt::half>> ph;
    std::vector<std::vector<gradapt::bfloat16>> gb;
    std::vector<std::vector<float>> gf;
    std::vector<std::vector<gradapt::half>> gh;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      auto t = make("t", shapes[k], 40u + static_cast<unsigned>(k));
      fill_grad(t, 50u + static_cast<unsigned>(k));
      pf.push_back(t.p);
      pb.push_back(t.p);
      ph.emplace_back();
      gb.emplace_back();
      gf.emplace_back();
      gh.emplace_back();
      for (std::size_t i = 0; i < t.size(); ++i) {
        ph.back().push_back(gradapt::half(t.p[i]));
        gb.back().push_back(gradapt::bfloat16(t.g[i]));
        gf.back().push_back(float(gb.back().back()));
        gh.back().push_back(gradapt::half(gf.back().back()));
        pf.back()[i] = float(ph.back().back());
        pb.back()[i] = pf.back()[i];
      }
    }
    gradapt::param_list<float> lf;
    gradapt::param_list<float, gradapt::bfloat16> lb;
    gradapt::param_list<gradapt::half> lh;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      std::string n = "t";
      n += std::to_string(k);
      const std::span<const std::int64_t> sh(shapes[k]);
      lf.add(n, tensor_view<float>(pf[k].data(), sh), tensor_view<float>(gf[k].data(), sh));
      lb.add(n, tensor_view<float>(pb[k].data(), sh), tensor_view<gradapt::bfloat16>(gb[k].data(), sh));
      lh.add(n, tensor_view<gradapt::half>(ph[k].data(), sh), tensor_view<gradapt::half>(gh[k].data(), sh));
    }
    const auto opt = gradapt::adafactor({.lr = 0.01, .momentum = 0.5});
    auto sf = opt.init(b, lf);
    auto sb = opt.init(b, lb);
    auto sh = opt.init(b, lh);
    REQUIRE(sb.factored(0));
    REQUIRE(sh.factored(2));
    const auto start = pf;
    for (int s = 0; s < 3; ++s) {
      opt.step(b, lf, sf);
      opt.step(b, lb, sb);
      opt.step(b, lh, sh);
    }
    double move = 0;
    for (std::size_t k = 0; k < shapes.size(); ++k)
      for (std::size_t i = 0; i < pf[k].size(); ++i)
        move = std::max(move, std::fabs(double(pf[k][i]) - start[k][i]));
    REQUIRE(move > 0.01);
    for (std::size_t k = 0; k < shapes.size(); ++k)
      for (std::size_t i = 0; i < pf[k].size(); ++i) {
        INFO("tensor " << k << " element " << i);
        REQUIRE(std::bit_cast<std::uint32_t>(pf[k][i]) == std::bit_cast<std::uint32_t>(pb[k][i]));
        // half holds p to 2^-11 relative; its statistics see half-rounded p: a few 2^-11 of the
        // movement on top
        REQUIRE(std::fabs(double(float(ph[k][i])) - pf[k][i]) <=
                std::ldexp(3 * std::fabs(pf[k][i]) + 8 * move, -11));
      }
  }
  SECTION("an empty list and empty tensors") {
    gradapt::param_list<float> none;
    const auto opt = gradapt::adafactor();
    auto st = opt.init(b, none);
    opt.step(b, none, st);
    REQUIRE(st.steps() == 1);
    std::vector<tensor> e = {make("e", {0, 300}, 1), make("s", {}, 2)};
    fill_grad(e[1], 4);
    auto pe = list_of(e);
    auto se = opt.init(b, pe);
    opt.step(b, pe, se);
    REQUIRE(std::isfinite(e[1].p[0]));
  }
  SECTION("invalid options and mismatched lists throw gradapt::error naming them") {
    REQUIRE_THROWS_WITH(gradapt::adafactor({.decay_rate = -1}), Contains("decay_rate"));
    {  // a negative step learning rate: rejected before anything moves
      auto n = shapes_mix();
      auto pn = list_of(n);
      for (std::size_t k = 0; k < n.size(); ++k) fill_grad(n[k], 60 + unsigned(k));
      const auto before = n;
      const auto opt = gradapt::adafactor();
      auto sn = opt.init(b, pn);
      REQUIRE_THROWS_WITH(opt.step(b, pn, sn, {.lr = -0.01}), Contains("expected >= 0"));
      for (std::size_t k = 0; k < n.size(); ++k) REQUIRE(n[k].p == before[k].p);
      REQUIRE(sn.steps() == 0);
    }
    REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_factored_rms{.decay_rate = -0.5}}),
                        Contains("decay_rate"));
    REQUIRE_THROWS_WITH(
        (gradapt::chain{tf::scale_by_factored_rms{.eps = 0, .eps_mode = gradapt::adafactor_eps1::clamp}}),
        Contains("eps"));
    REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_factored_rms{.min_dim_size_to_factor = -1}}),
                        Contains("min_dim_size_to_factor"));
    REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_factored_rms{}, tf::ema{.decay = 1.0}}),
                        Contains("ema"));
    REQUIRE_THROWS_WITH(
        (gradapt::chain{tf::scale_by_factored_rms{}, tf::scale_by_param_block_rms{.min_scale = -1}}),
        Contains("min_scale"));
    REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_factored_rms{}, tf::clip_by_block_rms{.threshold = 0}}),
                        Contains("threshold"));
    REQUIRE_THROWS_WITH(
        (gradapt::chain{tf::scale_by_factored_rms{}, tf::clip_by_block_rms{.threshold = NAN}}),
        Contains("threshold"));
    REQUIRE_THROWS_WITH(
        (gradapt::chain{tf::scale_by_factored_rms{}, tf::add_decayed_weights{.times_lr = true, .lr = -1}}),
        Contains("lr"));
    auto a = shapes_mix();
    auto pa = list_of(a);
    const auto opt = gradapt::adafactor();
    auto st = opt.init(b, pa);
    auto fewer = shapes_mix();
    fewer.pop_back();
    auto pf = list_of(fewer);
    REQUIRE_THROWS_WITH(opt.step(b, pf, st), Contains("tensors but the state was created for"));
    REQUIRE_THROWS_WITH(opt.step(b, pa, st, {.lr = NAN}), Contains("learning rate"));
    // Momentum switched on after init: the state has no buffer for it.
    auto opt2 = opt;
    opt2.stage<4>().decay = 0.9;
    REQUIRE_THROWS_WITH(opt2.step(b, pa, st), Contains("create a new state"));
  }
}

// The parameter-scale pass of adafactor reads p only (its measure ignores u and the stage
// before it, the learning rate, keeps no state); after a stateful stage it would rebuild u.
namespace plan_checks {
namespace tf = gradapt::transform;
using P = gradapt::adafactor_chain_type::plan;
constexpr std::uint64_t all_on = P::mask_of((std::size_t{1} << P::optional_count) - 1);
static_assert(P::passes(all_on) == 3);
static_assert(!P::measure_only(0, all_on) && P::needs_grad(0, all_on));
static_assert(P::measure_only(1, all_on) && !P::needs_grad(1, all_on) && P::args(1, all_on) == 1);
static_assert(!P::measure_only(2, all_on) && P::needs_grad(2, all_on));
using Q = gradapt::chain<tf::scale_by_factored_rms, tf::ema, tf::scale_by_param_block_rms, tf::scale>::plan;
constexpr std::uint64_t q_on = Q::mask_of(3);
static_assert(!Q::measure_only(0, q_on) && Q::needs_grad(0, q_on));
}  // namespace plan_checks

}  // namespace gradapt_test_optim_factored_chain

// gradapt::adafactor on the host backend.
//
//  - multi-step runs against an independent long double re-computation of Shazeer & Stern's
//    algorithm written here from the paper and optax's/torch's documented formulas (not from
//    the library): 1-D, small and large 2-D, 3-D and 4-D shapes, factored axes adjacent or
//    not, every option (momentum, weight decay (optax and torch forms), relative step, eps1 as
//    a clamp, last-two factoring, clipping and parameter scale off, decay offset, explicit lr);
//  - closed form of the first step of a factored matrix (β_1 = 0, so V̂ = R C / mean R);
//  - state size: n + m elements for an n x m factored matrix (+ n m with momentum);
//  - determinism across thread counts, save/restore mid-run (bit-identical continuation), bad
//    checkpoints rejected, no allocation in the steady-state step;
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

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/optim/sm3.hpp"

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::tensor_view;
using ld = long double;

static_assert(gradapt::factored_backend<gradapt::host>);

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace {

// ---- tensors ----------------------------------------------------------------------------------

struct tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> p, g;
  std::size_t size() const { return p.size(); }
};

std::size_t numel(const std::vector<std::int64_t>& s) {
  std::size_t n = 1;
  for (auto d : s) n *= static_cast<std::size_t>(d);
  return n;
}

tensor make(std::string name, std::vector<std::int64_t> shape, unsigned seed, float pscale = 1.0f) {
  tensor t{std::move(name), std::move(shape), {}, {}};
  const std::size_t n = numel(t.shape);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  t.p.resize(n);
  t.g.resize(n);
  for (auto& x : t.p) x = u(rng) * pscale;
  return t;
}

void fill_grad(tensor& t, unsigned seed, float scale = 0.125f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // Row and column structure so the factored statistics are not flat.
  const std::size_t n = t.size();
  for (std::size_t i = 0; i < n; ++i) t.g[i] = u(rng) * scale * (1.0f + static_cast<float>(i % 7) * 0.25f);
}

gradapt::param_list<float> list_of(std::vector<tensor>& ts) {
  gradapt::param_list<float> pl;
  for (auto& t : ts) {
    tensor_view<float> pv(t.p.data(), std::span<const std::int64_t>(t.shape));
    tensor_view<float> gv(t.g.data(), std::span<const std::int64_t>(t.shape));
    pl.add(t.name, pv, gv);
  }
  return pl;
}

// ---- the long double reference ------------------------------------------------------------------
// Written from Shazeer & Stern (2018), algorithm 4 and section 6, with optax's choices (the two
// largest dims, ties to the later axis; eps1 added to g^2; the statistic that removes the
// largest axis is normalised by its mean over the other factored axis) and torch's switches.

struct ref_tensor {
  std::vector<std::int64_t> shape;
  bool factored = false;
  std::size_t ax_large = 0, ax_small = 0;  // factored axes (largest, second)
  std::vector<ld> r, c, v, m;              // r: stat removing ax_large; c: removing ax_small
};

struct ref_opt {
  gradapt::adafactor_options o;
  std::vector<ref_tensor> ts;
  std::uint64_t t = 0;

  static std::vector<std::size_t> strides(const std::vector<std::int64_t>& s) {
    std::vector<std::size_t> st(s.size(), 1);
    for (std::size_t k = s.size(); k-- > 1;) st[k - 1] = st[k] * static_cast<std::size_t>(s[k]);
    return st;
  }
  // Index of element `flat` with axis `ax` removed (row-major over the remaining dims).
  static std::size_t drop(const std::vector<std::int64_t>& s, std::size_t flat, std::size_t ax) {
    const auto st = strides(s);
    std::size_t out = 0;
    for (std::size_t k = 0; k < s.size(); ++k) {
      const std::size_t i = (flat / st[k]) % static_cast<std::size_t>(s[k]);
      if (k == ax) continue;
      out = out * static_cast<std::size_t>(s[k]) + i;
    }
    return out;
  }

  void init(const std::vector<tensor>& in) {
    for (const auto& x : in) {
      ref_tensor r;
      r.shape = x.shape;
      const std::size_t n = x.size();
      const std::size_t rk = x.shape.size();
      if (o.factored && rk >= 2 && n > 0) {
        std::size_t a = 0, b = 0;
        if (o.axes == gradapt::factor_axes::last_two) {
          a = rk - 1;
          b = rk - 2;
        } else {
          // largest: the last index of the maximum; second: the largest of the rest, later on ties
          a = 0;
          for (std::size_t k = 0; k < rk; ++k)
            if (x.shape[k] >= x.shape[a]) a = k;
          b = a == 0 ? 1 : 0;
          for (std::size_t k = 0; k < rk; ++k)
            if (k != a && x.shape[k] >= x.shape[b]) b = k;
        }
        if (std::min(x.shape[a], x.shape[b]) >= o.min_dim_size_to_factor) {
          r.factored = true;
          r.ax_large = a;
          r.ax_small = b;
          r.r.assign(n / static_cast<std::size_t>(x.shape[a]), 0);
          r.c.assign(n / static_cast<std::size_t>(x.shape[b]), 0);
        }
      }
      if (!r.factored) r.v.assign(n, 0);
      if (o.momentum > 0) r.m.assign(n, 0);
      ts.push_back(std::move(r));
    }
  }

  void step(std::vector<tensor>& in, std::optional<double> lr_arg = std::nullopt) {
    ++t;
    const ld lr = lr_arg.value_or(o.lr);
    const ld td = t > o.decay_offset ? ld(t - o.decay_offset) : 1;
    const ld w = std::pow(td, -ld(o.decay_rate));
    const ld beta = 1 - w;
    const bool clamp = o.eps1_mode == gradapt::adafactor_eps1::clamp;
    const ld eps1 = o.eps1;
    const ld lr_t = o.relative_step ? std::min(lr, 1 / std::sqrt(ld(t))) : lr;
    for (std::size_t k = 0; k < in.size(); ++k) {
      auto& x = in[k];
      auto& r = ts[k];
      const std::size_t n = x.size();
      if (n == 0) continue;
      std::vector<ld> y(n);
      if (r.factored) {
        const std::size_t la = static_cast<std::size_t>(x.shape[r.ax_large]);
        const std::size_t lb = static_cast<std::size_t>(x.shape[r.ax_small]);
        std::vector<ld> sr(r.r.size(), 0), sc(r.c.size(), 0);
        for (std::size_t i = 0; i < n; ++i) {
          const ld g = x.g[i];
          const ld s = g * g + (clamp ? 0 : eps1);
          sr[drop(x.shape, i, r.ax_large)] += s / ld(la);
          sc[drop(x.shape, i, r.ax_small)] += s / ld(lb);
        }
        for (std::size_t j = 0; j < sr.size(); ++j) r.r[j] = beta * r.r[j] + w * sr[j];
        for (std::size_t j = 0; j < sc.size(); ++j) r.c[j] = beta * r.c[j] + w * sc[j];
        // mean of r over the small axis: r's shape is the shape without ax_large.
        std::vector<std::int64_t> rs;
        for (std::size_t q = 0; q < x.shape.size(); ++q)
          if (q != r.ax_large) rs.push_back(x.shape[q]);
        const std::size_t small_in_r = r.ax_small < r.ax_large ? r.ax_small : r.ax_small - 1;
        std::vector<ld> mean(r.r.size() / lb, 0);
        for (std::size_t j = 0; j < r.r.size(); ++j) mean[drop(rs, j, small_in_r)] += r.r[j] / ld(lb);
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t jr = drop(x.shape, i, r.ax_large), jc = drop(x.shape, i, r.ax_small);
          ld mu = mean[drop(rs, jr, small_in_r)];
          if (clamp) mu = std::max(mu, eps1);
          ld vhat = r.r[jr] * r.c[jc] / mu;
          if (clamp) vhat = std::max(vhat, eps1 * eps1);
          y[i] = ld(x.g[i]) / std::sqrt(vhat);
        }
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          const ld g = x.g[i];
          r.v[i] = beta * r.v[i] + w * (g * g + (clamp ? 0 : eps1));
          ld vv = r.v[i];
          if (clamp) vv = std::max(vv, eps1 * eps1);
          y[i] = g / std::sqrt(vv);
        }
      }
      ld denom = 1;
      if (std::isfinite(o.clipping_threshold)) {
        ld ss = 0;
        for (ld v : y) ss += v * v;
        denom = std::max(ld(1), std::sqrt(ss / ld(n)) / ld(o.clipping_threshold));
      }
      ld pscale = 1;
      if (o.multiply_by_parameter_scale) {
        ld ss = 0;
        for (float v : x.p) ss += ld(v) * v;
        pscale = std::max(std::sqrt(ss / ld(n)), ld(o.eps2));
      }
      const ld wd = ld(o.weight_decay) * (o.weight_decay_times_lr ? lr : 1);
      for (std::size_t i = 0; i < n; ++i) {
        ld u = y[i] / denom * lr_t * pscale;
        if (o.momentum > 0) {
          r.m[i] = ld(o.momentum) * r.m[i] + (1 - ld(o.momentum)) * u;
          u = r.m[i];
        }
        x.p[i] = static_cast<float>(ld(x.p[i]) - u - wd * ld(x.p[i]));
      }
    }
  }
};

std::vector<tensor> shapes_mix() {
  return {make("bias", {37}, 1),
          make("small", {16, 24}, 2),
          make("big", {130, 200}, 3),
          make("tall", {300, 129}, 4),
          make("cube", {3, 140, 129}, 5),
          make("apart", {150, 2, 130}, 6),
          make("four", {129, 2, 131, 3}, 7),
          make("square", {128, 128}, 8),
          make("scalar", {}, 9),
          make("unit", {1, 300, 1}, 10)};
}

// Runs gradapt and the reference side by side for `steps` steps and returns the largest
// |gradapt - ref| / (largest movement of the reference), so 1e-4 means "a 1e-4 fraction of
// what the optimizer did".
// `opt` is gradapt::adafactor(o) or gradapt::adafactor_chain(o).
template <class Opt>
double run_compare_with(const Opt& opt, const gradapt::adafactor_options& o, int steps, int threads = 2,
                        std::vector<tensor> (*shapes)() = shapes_mix) {
  auto mine = shapes();
  auto theirs = shapes();
  const auto start = shapes();
  host b{.threads = threads};
  auto pl = list_of(mine);
  auto st = opt.init(b, pl);
  ref_opt ref{o, {}, 0};
  ref.init(theirs);
  for (int s = 1; s <= steps; ++s) {
    for (std::size_t k = 0; k < mine.size(); ++k) {
      fill_grad(mine[k], 1000u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      fill_grad(theirs[k], 1000u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
    }
    opt.step(b, pl, st);
    ref.step(theirs);
  }
  REQUIRE(st.steps() == static_cast<std::uint64_t>(steps));
  double move = 0, err = 0, top = 0;
  for (std::size_t k = 0; k < mine.size(); ++k)
    for (std::size_t i = 0; i < mine[k].size(); ++i) {
      REQUIRE(std::isfinite(mine[k].p[i]));
      move = std::max(move, std::fabs(double(theirs[k].p[i]) - double(start[k].p[i])));
      err = std::max(err, std::fabs(double(mine[k].p[i]) - double(theirs[k].p[i])));
      top = std::max(top, std::fabs(double(theirs[k].p[i])));
    }
  REQUIRE(move > 0);
  // Both sides round p to float every step: a few ulps of the largest |p| are allowed on top.
  return std::max(0.0, err - 4 * std::ldexp(top, -23)) / move;
}

double run_compare(const gradapt::adafactor_options& o, int steps, int threads = 2,
                   std::vector<tensor> (*shapes)() = shapes_mix) {
  return run_compare_with(gradapt::adafactor(o), o, steps, threads, shapes);
}

}  // namespace

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
  for (const auto& v : vs) {
    INFO(v.name);
    const double d = run_compare(v.o, 5);
    WARN(v.name << ": largest difference " << d << " of the movement");
    REQUIRE(d <= 2e-5);
    // The same algorithm composed from stages (adafactor_chain), on 1 and 3 threads.
    for (const int threads : {1, 3}) {
      const double dc = run_compare_with(gradapt::adafactor_chain(v.o), v.o, 5, threads);
      WARN(v.name << ", adafactor_chain on " << threads << " thread(s): largest difference " << dc
                  << " of the movement");
      REQUIRE(dc <= 2e-5);
    }
  }
}

TEST_CASE("adafactor's comparison separates plausible mistakes", "[optim][adafactor]") {
  // The reference run with one formula changed lands far outside the tolerance above.
  auto o = gradapt::adafactor_options{.lr = 0.05};
  auto mine = shapes_mix();
  auto theirs = shapes_mix();
  const auto start = shapes_mix();
  host b{.threads = 2};
  auto pl = list_of(mine);
  gradapt::adafactor opt(o);
  auto st = opt.init(b, pl);
  auto wrong = o;
  wrong.decay_rate = 0.75;  // a slightly different β_t schedule
  ref_opt ref{wrong, {}, 0};
  ref.init(theirs);
  for (int s = 1; s <= 4; ++s) {
    for (std::size_t k = 0; k < mine.size(); ++k) {
      fill_grad(mine[k], 77u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      fill_grad(theirs[k], 77u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
    }
    opt.step(b, pl, st);
    ref.step(theirs);
  }
  double move = 0, err = 0;
  for (std::size_t k = 0; k < mine.size(); ++k)
    for (std::size_t i = 0; i < mine[k].size(); ++i) {
      move = std::max(move, std::fabs(double(theirs[k].p[i]) - double(start[k].p[i])));
      err = std::max(err, std::fabs(double(mine[k].p[i]) - double(theirs[k].p[i])));
    }
  REQUIRE(err / move > 100 * 2e-5);
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
  gradapt::adafactor opt({.lr = 0.25, .eps1 = 0.0});
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
    REQUIRE(st.second_moment_elements(0) == 300 + 129);
    REQUIRE(!st.factored(1));
    REQUIRE(st.second_moment_elements(1) == 300);
    REQUIRE(!st.factored(2));  // 127 < 128
    REQUIRE(st.second_moment_elements(2) == 127 * 500);
    REQUIRE(st.factored(3));  // [4] x (200 + 130)
    REQUIRE(st.second_moment_elements(3) == 4 * (200 + 130));
    REQUIRE(st.state_elements() == 300 + 129 + 300 + 127 * 500 + 4 * 330);
    REQUIRE(st.momentum_elements(0) == 0);
  }
  {
    auto st = gradapt::adafactor({.momentum = 0.9}).init(b, pl);
    REQUIRE(st.second_moment_elements(0) == 300 + 129);
    REQUIRE(st.momentum_elements(0) == 300 * 129);
    REQUIRE(st.state_elements() == 300 + 129 + 300 + 127 * 500 + 4 * 330 + pl.total_elements());
    // momentum(t) views tensor t's buffer: without decay p moves by exactly m (p ← p − m).
    REQUIRE(gradapt::adafactor().init(b, pl).momentum(0).empty());
    std::vector<std::vector<float>> before;
    for (std::size_t t = 0; t < ts.size(); ++t) {
      fill_grad(ts[t], 40 + unsigned(t));
      before.push_back(ts[t].p);
    }
    gradapt::adafactor({.momentum = 0.9}).step(b, pl, st);
    for (std::size_t t = 0; t < ts.size(); ++t) {
      const auto m = st.momentum(t);
      REQUIRE(m.size() == ts[t].size());
      std::size_t moved = 0;
      for (std::size_t k = 0; k < m.size(); ++k) {
        const float d = before[t][k] - ts[t].p[k];
        const float mag = std::max(std::fabs(before[t][k]), std::fabs(ts[t].p[k]));
        REQUIRE(std::fabs(m.data()[k] - d) <= 2 * std::numeric_limits<float>::epsilon() * mag);
        moved += m.data()[k] != 0.0f ? 1 : 0;
      }
      REQUIRE(moved > m.size() / 2);
    }
    REQUIRE_THROWS_WITH(st.momentum(4), Contains("tensor 4 out of range"));
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
    for (int s = 1; s <= 3; ++s) {
      for (std::size_t k = 0; k < ts.size(); ++k)
        fill_grad(ts[k], 31u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      opt.step(b, pl, st);
    }
    std::vector<float> all;
    for (auto& t : ts) all.insert(all.end(), t.p.begin(), t.p.end());
    out.push_back(all);
  }
  for (std::size_t r = 1; r < out.size(); ++r)
    for (std::size_t i = 0; i < out[0].size(); ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(out[r][i]) == std::bit_cast<std::uint32_t>(out[0][i]));
}

TEST_CASE("adafactor save/restore continues bit-identically; the step allocates nothing",
          "[optim][adafactor]") {
  for (double mom : {0.0, 0.9}) {
    auto a = shapes_mix();
    auto pa = list_of(a);
    host b{.threads = 2};
    gradapt::adafactor opt({.lr = 0.02, .momentum = mom, .weight_decay = 1e-4});
    auto sa = opt.init(b, pa);
    for (int s = 1; s <= 3; ++s) {
      for (std::size_t k = 0; k < a.size(); ++k)
        fill_grad(a[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      opt.step(b, pa, sa);
    }
    const auto bytes = sa.save(b);
    // A second run restored from the checkpoint, parameters copied.
    auto c = a;
    auto pc = list_of(c);
    auto sc = opt.init(b, pc);
    sc.load(b, bytes);
    REQUIRE(sc.steps() == 3);
    for (int s = 4; s <= 6; ++s) {
      for (std::size_t k = 0; k < a.size(); ++k) {
        fill_grad(a[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
        fill_grad(c[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      }
      const long before = alloc_counter::in_process();
      opt.step(b, pa, sa);
      REQUIRE(alloc_counter::in_process() == before);
      opt.step(b, pc, sc);
    }
    for (std::size_t k = 0; k < a.size(); ++k)
      for (std::size_t i = 0; i < a[k].size(); ++i)
        REQUIRE(std::bit_cast<std::uint32_t>(a[k].p[i]) == std::bit_cast<std::uint32_t>(c[k].p[i]));
    REQUIRE(sa.save(b) == sc.save(b));

    // Bad checkpoints are rejected and leave the state as it was.
    auto bad = bytes;
    bad.pop_back();
    REQUIRE_THROWS_WITH(sc.load(b, bad), Contains("archive(gradapt.adafactor): checksum mismatch"));
    bad = bytes;
    bad[0] = std::byte{'x'};
    REQUIRE_THROWS_WITH(sc.load(b, bad), Contains("not a gradapt state archive"));
    auto other = shapes_mix();
    other.pop_back();
    auto po = list_of(other);
    auto so = opt.init(b, po);
    REQUIRE_THROWS_WITH(so.load(b, bytes), Contains("tensors but this state has"));
    auto sm = gradapt::adafactor({.momentum = mom > 0 ? 0.0 : 0.9}).init(b, pa);
    REQUIRE_THROWS_WITH(sm.load(b, bytes), Contains("tensor 'momentum' has shape"));
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
        for (std::size_t k = 0; k < a.size(); ++k)
          fill_grad(a[k], 11u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
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
    for (auto& t : ts) std::fill(t.g.begin(), t.g.end(), 0.0f);
    const auto before = ts;
    auto pl = list_of(ts);
    gradapt::adafactor opt({.lr = 0.1});
    auto st = opt.init(b, pl);
    opt.step(b, pl, st);
    for (std::size_t k = 0; k < ts.size(); ++k) REQUIRE(ts[k].p == before[k].p);
    for (auto& t : ts) std::fill(t.p.begin(), t.p.end(), 0.0f);
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
    opt.step(b, pl, st);
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
    REQUIRE(st.second_moment_elements(0) == 0);
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
    REQUIRE(st.second_moment_elements(0) == 301);  // [1, 300, 1]: axes 1 (300) and 2 (1, later tie)
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
                        Contains("learning rate"));
    auto fewer = shapes_mix();
    fewer.pop_back();
    auto pf = list_of(fewer);
    REQUIRE_THROWS_WITH(opt.step(b, pf, st), Contains("holds 9 tensors but the state was created for 10"));
    auto other = shapes_mix();
    other[1] = make("small", {16, 25}, 2);
    auto po = list_of(other);
    REQUIRE_THROWS_WITH(opt.step(b, po, st), Contains("parameter 'small' (tensor 1) has 400 elements"));
    gradapt::adafactor with_m({.momentum = 0.9});
    REQUIRE_THROWS_WITH(with_m.step(b, pl, st), Contains("momentum is on"));
    REQUIRE(st.steps() == 0);
  }
}

TEST_CASE("adafactor's per-tensor update scale (the function the CUDA path runs on device sums)",
          "[optim][adafactor]") {
  using gradapt::detail::adafactor_k::scale_params;
  using gradapt::detail::adafactor_k::update_scale;
  const scale_params k{.n = 4, .threshold = 1, .eps2 = 1e-3, .lr_t = 0.01, .clip = true, .param_scale = true};
  // rms(y) = sqrt(16/4) = 2 > d: divide by 2; rms(p) = 0 < eps2: the floor.
  REQUIRE(update_scale(k, 16.0, 0.0) == 0.01 * 1e-3 / 2.0);
  // rms(y) = sqrt(2/4) < 1: no clipping; rms(p) = sqrt(36/4) = 3.
  REQUIRE(update_scale(k, 2.0, 36.0) == 0.01 * 3.0 / 1.0);
  // threshold 0.5: rms(y) / d = 2 * sqrt(2/4) (> 1).
  scale_params h = k;
  h.threshold = 0.5;
  REQUIRE(update_scale(h, 2.0, 36.0) == 0.01 * 3.0 / (std::sqrt(2.0 / 4.0) / 0.5));
  // non-finite sums propagate; switched-off terms are ignored.
  REQUIRE(std::isnan(update_scale(k, NAN, 36.0)));
  REQUIRE(std::isnan(update_scale(k, 2.0, NAN)));
  REQUIRE(update_scale(k, INFINITY, 36.0) == 0.0);
  REQUIRE(update_scale(k, 2.0, INFINITY) == INFINITY);
  scale_params off = k;
  off.clip = false;
  off.param_scale = false;
  REQUIRE(update_scale(off, NAN, NAN) == 0.01);
  // the functor form writes the same value
  double c = 16.0, p = 36.0, out = -1.0;
  gradapt::detail::adafactor_k::scale_from_sums{k}(c, p, out);
  REQUIRE(out == update_scale(k, 16.0, 36.0));
}

TEST_CASE("host reduce_factored and apply_factored against plain loops", "[optim][adafactor][backend]") {
  // [A, X, B, Y, C] = [2, 5, 3, 7, 4] and the 2-D [n, m] form, sum and max.
  host b{.threads = 2};
  for (auto d :
       {std::array<std::int64_t, 5>{2, 5, 3, 7, 4}, std::array<std::int64_t, 5>{1, 300, 1, 129, 1}}) {
    const std::size_t A = std::size_t(d[0]), X = std::size_t(d[1]), B = std::size_t(d[2]),
                      Y = std::size_t(d[3]), C = std::size_t(d[4]);
    std::vector<float> x(A * X * B * Y * C);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float((i * 37) % 101) * 0.01f - 0.3f;
    std::vector<double> oy(A * X * B * C), ox(A * B * Y * C), my(oy.size()), mx(ox.size());
    const auto sq = [](float, float, float v) { return double(v) * double(v); };
    const tensor_view<const float> none;
    b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(oy),
                      gradapt::host_view(ox));
    b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(my),
                      gradapt::host_view(mx), gradapt::reduce_op::max);
    std::vector<ld> ry(oy.size(), 0), rx(ox.size(), 0);
    std::vector<double> qy(oy.size(), -1), qx(ox.size(), -1);
    for (std::size_t a = 0; a < A; ++a)
      for (std::size_t i = 0; i < X; ++i)
        for (std::size_t bb = 0; bb < B; ++bb)
          for (std::size_t j = 0; j < Y; ++j)
            for (std::size_t c = 0; c < C; ++c) {
              const double t = sq(0.0f, 0.0f, x[(((a * X + i) * B + bb) * Y + j) * C + c]);
              const std::size_t iy = ((a * X + i) * B + bb) * C + c, ix = ((a * B + bb) * Y + j) * C + c;
              ry[iy] += t;
              rx[ix] += t;
              qy[iy] = std::max(qy[iy], t);
              qx[ix] = std::max(qx[ix], t);
            }
    for (std::size_t k = 0; k < oy.size(); ++k) {
      REQUIRE(std::fabs(oy[k] - double(ry[k])) <= 1e-12 * double(ry[k]) + 1e-300);
      REQUIRE(my[k] == qy[k]);
    }
    for (std::size_t k = 0; k < ox.size(); ++k) {
      REQUIRE(std::fabs(ox[k] - double(rx[k])) <= 1e-12 * double(rx[k]) + 1e-300);
      REQUIRE(mx[k] == qx[k]);
    }
    // apply_factored: y = x * r * c and the sum of y.
    std::vector<float> rv(oy.size()), cv(ox.size());
    for (std::size_t k = 0; k < rv.size(); ++k) rv[k] = 1.0f + float(k % 3);
    for (std::size_t k = 0; k < cv.size(); ++k) cv[k] = 0.5f + float(k % 5);
    std::vector<float> y = x;
    const double total = b.apply_factored(
        [](float r, float c, float& v) {
          v = v * r * c;
          return v;
        },
        d, gradapt::host_view(std::as_const(rv)), gradapt::host_view(std::as_const(cv)),
        gradapt::host_view(y));
    ld want = 0;
    for (std::size_t a = 0; a < A; ++a)
      for (std::size_t i = 0; i < X; ++i)
        for (std::size_t bb = 0; bb < B; ++bb)
          for (std::size_t j = 0; j < Y; ++j)
            for (std::size_t c = 0; c < C; ++c) {
              const std::size_t e = (((a * X + i) * B + bb) * Y + j) * C + c;
              const float v = x[e] * rv[((a * X + i) * B + bb) * C + c] * cv[((a * B + bb) * Y + j) * C + c];
              REQUIRE(y[e] == v);
              want += v;
            }
    REQUIRE(std::fabs(total - double(want)) <= 1e-9 * std::fabs(double(want)) + 1e-9);
    // apply_factored_sum: the same elements and the same sum, stored instead of returned.
    std::vector<float> y2 = x;
    std::vector<double> sum(1, -1.0);
    b.apply_factored_sum(
        [](float r, float c, float& v) {
          v = v * r * c;
          return v;
        },
        d, gradapt::host_view(std::as_const(rv)), gradapt::host_view(std::as_const(cv)),
        gradapt::host_view(sum), gradapt::host_view(y2));
    REQUIRE(y2 == y);
    REQUIRE(sum[0] == total);
  }
  {
    std::vector<float> empty;
    std::vector<double> none_sum;
    REQUIRE_THROWS_WITH(b.apply_factored_sum([](float, float, float& v) { return v; }, {1, 0, 1, 0, 1},
                                             tensor_view<const float>(), tensor_view<const float>(),
                                             gradapt::host_view(none_sum), gradapt::host_view(empty)),
                        Contains("sum view is empty"));
  }
  std::vector<float> x(10);
  std::vector<double> o(3);
  const tensor_view<const float> none;
  REQUIRE_THROWS_WITH(
      b.reduce_factored([](float, float, float v) { return double(v); }, {1, 3, 1, 3, 1}, none, none,
                        gradapt::host_view(std::as_const(x)), gradapt::host_view(o), gradapt::host_view(o)),
      Contains("hold 9 elements but the tensor has 10"));
}

TEST_CASE("host reduce_factored reads each line once on any thread count: same bits for 1 to 3 threads",
          "[optim][adafactor][backend]") {
  // Matrix-like views (C == 1) with lines of at most host's group limit take the grouped path
  // (a per-thread partial per group of lines, added in group order); longer lines and C > 1
  // take the row/column loops. Both must match plain loops and give the same bits on 1, 2 and
  // 3 threads, for sums (with Σ y² of a second view) and maxima; shapes large enough for the
  // parallel paths, with several groups per slice, A, B > 1 and tails that are not a multiple of 8.
  const auto run = [](auto tag, std::array<std::int64_t, 5> d) {
    using T = decltype(tag);
    const std::size_t A = std::size_t(d[0]), X = std::size_t(d[1]), B = std::size_t(d[2]),
                      Y = std::size_t(d[3]), C = std::size_t(d[4]);
    const std::size_t n = A * X * B * Y * C, ny = A * X * B * C, nx = A * B * Y * C;
    std::vector<T> x(n), y(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = T(float((i * 37) % 101) * 0.01f - 0.3f);
      y[i] = T(float((i * 11) % 23) * 0.5f - 2.0f);
    }
    const auto sq = [](float, float, float v) { return double(v) * double(v); };
    std::vector<ld> ry(ny, 0), rx(nx, 0);
    std::vector<double> my(ny, -1), mx(nx, -1);
    ld rp = 0;
    for (std::size_t e = 0; e < n; ++e) {
      const std::size_t c = e % C, j = (e / C) % Y, line = e / (Y * C);  // line = (a X + i) B + b
      const std::size_t bb = line % B, a = line / (X * B);
      const double t = sq(0, 0, float(x[e]));
      ry[line * C + c] += t;
      rx[((a * B + bb) * Y + j) * C + c] += t;
      my[line * C + c] = std::max(my[line * C + c], t);
      mx[((a * B + bb) * Y + j) * C + c] = std::max(mx[((a * B + bb) * Y + j) * C + c], t);
      rp += ld(float(y[e])) * ld(float(y[e]));
    }
    std::vector<std::vector<double>> first;
    for (int threads : {1, 2, 3}) {
      CAPTURE(sizeof(T), d, threads);
      host b{.threads = threads};
      std::vector<double> oy(ny, -7), ox(nx, -7), qy(ny, -7), qx(nx, -7), sy(ny, -7), sx(nx, -7),
          ls(A * X * B, -7);
      const tensor_view<const float> none;
      b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(oy),
                        gradapt::host_view(ox));
      b.reduce_factored(sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(qy),
                        gradapt::host_view(qx), gradapt::reduce_op::max);
      const double psq = b.reduce_factored_sumsq(
          sq, d, none, none, gradapt::host_view(std::as_const(x)), gradapt::host_view(sy),
          gradapt::host_view(sx), gradapt::host_view(std::as_const(y)), gradapt::host_view(ls));
      for (std::size_t k = 0; k < ny; ++k) {
        REQUIRE(std::fabs(oy[k] - double(ry[k])) <= 1e-12 * double(ry[k]) + 1e-300);
        REQUIRE(qy[k] == my[k]);
      }
      for (std::size_t k = 0; k < nx; ++k) {
        REQUIRE(std::fabs(ox[k] - double(rx[k])) <= 1e-12 * double(rx[k]) + 1e-300);
        REQUIRE(qx[k] == mx[k]);
      }
      REQUIRE((sy == oy && sx == ox));  // the same terms in the same order
      REQUIRE(std::fabs(psq - double(rp)) <= 1e-12 * double(rp));
      if (first.empty())
        first = {oy, ox, qy, qx, std::vector<double>{psq}};
      else
        REQUIRE((first[0] == oy && first[1] == ox && first[2] == qy && first[3] == qx && first[4][0] == psq));
    }
  };
  for (auto d :
       {std::array<std::int64_t, 5>{1, 700, 1, 129, 1}, std::array<std::int64_t, 5>{2, 400, 2, 200, 1},
        std::array<std::int64_t, 5>{1, 40, 1, 4096, 1}, std::array<std::int64_t, 5>{1, 17, 1, 5003, 1},
        std::array<std::int64_t, 5>{2, 50, 2, 91, 4}})
    run(float{}, d);
  run(gradapt::half{}, std::array<std::int64_t, 5>{1, 700, 1, 129, 1});
  run(double{}, std::array<std::int64_t, 5>{2, 400, 2, 200, 1});
}

// ---- reference vectors from optax and torch.optim.Adafactor (tests/data/optim_factored) -------
// Written by tests/data/make_factored_refs.py (not run here) with make_optim_refs.py's
// conventions: inputs from a counter-based generator reproduced below, samples of every tensor
// after the first and the last step. A stored element must be within rtol of the case's
// movement scale (and within 1e-3 of its own tensor's movement plus 4 ulp), NaN where the
// peer has NaN; the recorded sensitivities must exceed 10 rtol.
#ifndef GRADAPT_FACTORED_DATA
#error "define GRADAPT_FACTORED_DATA as the path of tests/data/optim_factored"
#endif

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "gradapt/optim/sm3.hpp"

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<float> gen_values(std::uint64_t seed, std::size_t n, int log2_scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t u = splitmix64(seed * 0x100000001B3ull + i);
    const auto k = static_cast<std::int64_t>(u >> 40) - (std::int64_t{1} << 23);
    v[i] = static_cast<float>(std::ldexp(static_cast<double>(k), log2_scale - 23));
  }
  return v;
}

double num(const std::string& s) {
  if (s == "nan") return std::nan("");
  if (s == "inf") return INFINITY;
  if (s == "-inf") return -INFINITY;
  return std::stod(s);
}

struct ref_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t pseed = 0, gseed = 0;
  int plog = 0, glog = 0;
  bool zero_p = false, zero_g = false;
  std::vector<std::tuple<int, std::size_t, float>> inject;
  std::size_t size() const { return numel(shape); }
  std::vector<float> param0() const {
    return zero_p ? std::vector<float>(size(), 0.0f) : gen_values(pseed, size(), plog);
  }
  std::vector<float> grad(int step) const {
    if (zero_g) return std::vector<float>(size(), 0.0f);
    auto g = gen_values(gseed + 1000 * static_cast<std::uint64_t>(step), size(), glog);
    for (const auto& [s, i, v] : inject)
      if (s == step) g[i] = v;
    return g;
  }
};

struct ref_result {
  int step = 0;
  std::string tensor;
  std::size_t stride = 1;
  std::vector<double> sample;
};

struct ref_case {
  std::string name, optimizer;
  std::map<std::string, double> opt;
  int steps = 0;
  double scale = 0;
  std::vector<double> sensitivity;
  std::vector<ref_spec> tensors;
  std::vector<ref_result> results;
};

ref_case load_ref(const std::filesystem::path& file) {
  std::ifstream in(file);
  REQUIRE(in.good());
  ref_case c;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "case") {
      ls >> c.name;
    } else if (key == "opt") {
      ls >> c.optimizer;
      std::string kv;
      while (ls >> kv) c.opt[kv.substr(0, kv.find('='))] = num(kv.substr(kv.find('=') + 1));
    } else if (key == "steps") {
      ls >> c.steps;
    } else if (key == "scale") {
      std::string v;
      ls >> v;
      c.scale = num(v);
    } else if (key == "sensitivity") {
      std::string v;
      ls >> v;
      c.sensitivity.push_back(num(v));
    } else if (key == "tensor") {
      ref_spec t;
      int rank = 0;
      ls >> t.name >> rank;
      t.shape.resize(static_cast<std::size_t>(rank));
      for (auto& d : t.shape) ls >> d;
      std::string flags, word;
      ls >> t.pseed >> t.gseed >> t.plog >> t.glog >> flags;
      t.zero_p = flags.find("zero_p") != std::string::npos;
      t.zero_g = flags.find("zero_g") != std::string::npos;
      while (ls >> word) {
        REQUIRE(word == "inject");
        int s = 0;
        std::size_t i = 0;
        std::string v;
        ls >> s >> i >> v;
        t.inject.emplace_back(s, i, static_cast<float>(num(v)));
      }
      c.tensors.push_back(t);
    } else if (key == "result") {
      ref_result r;
      std::string w;
      std::size_t count = 0;
      ls >> r.step >> r.tensor >> w >> r.stride >> w >> count;
      std::string values_line, v;
      std::getline(in, values_line);
      std::istringstream vs(values_line);
      while (vs >> v) r.sample.push_back(num(v));
      REQUIRE(r.sample.size() == count);
      c.results.push_back(r);
    } else if (key == "source") {
    } else if (key == "end") {
      break;
    } else {
      FAIL("unknown line in " << file << ": " << line);
    }
  }
  return c;
}

gradapt::adafactor_options adafactor_from(const std::map<std::string, double>& o) {
  gradapt::adafactor_options a;
  a.lr = o.at("lr");
  a.relative_step = o.at("relative_step") != 0;
  a.decay_rate = o.at("decay_rate");
  a.min_dim_size_to_factor = static_cast<std::int64_t>(o.at("min_dim"));
  a.factored = o.at("factored") != 0;
  a.axes = o.at("axes") != 0 ? gradapt::factor_axes::last_two : gradapt::factor_axes::largest_two;
  a.eps1 = o.at("eps1");
  a.eps1_mode =
      o.at("eps1_clamp") != 0 ? gradapt::adafactor_eps1::clamp : gradapt::adafactor_eps1::add_to_square;
  a.clipping_threshold = o.at("clip");
  a.multiply_by_parameter_scale = o.at("param_scale") != 0;
  a.eps2 = o.at("eps2");
  a.momentum = o.at("momentum");
  a.weight_decay = o.at("wd");
  a.weight_decay_times_lr = o.at("wd_times_lr") != 0;
  return a;
}

template <class Opt>
std::map<int, std::vector<std::vector<float>>> run_ref_case(const Opt& opt, const ref_case& c, int threads) {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> pl;
  for (const auto& t : c.tensors) {
    p.push_back(t.param0());
    g.push_back(std::vector<float>(t.size()));
  }
  for (std::size_t i = 0; i < c.tensors.size(); ++i)
    pl.add(c.tensors[i].name,
           tensor_view<float>(p[i].data(), std::span<const std::int64_t>(c.tensors[i].shape)),
           tensor_view<float>(g[i].data(), std::span<const std::int64_t>(c.tensors[i].shape)));
  host b{.threads = threads};
  auto st = opt.init(b, pl);
  std::map<int, std::vector<std::vector<float>>> snaps;
  for (int s = 1; s <= c.steps; ++s) {
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      const auto gi = c.tensors[i].grad(s);  // copied in: the views point at g[i]'s buffer
      std::copy(gi.begin(), gi.end(), g[i].begin());
    }
    opt.step(b, pl, st);
    if (s == 1 || s == c.steps) snaps[s] = p;
  }
  return snaps;
}

}  // namespace

TEST_CASE("adafactor and sm3 match optax and torch.optim.Adafactor reference vectors",
          "[optim][refs][adafactor]") {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(GRADAPT_FACTORED_DATA))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 8);
  constexpr double rtol = 1e-4;
  int adafactor_cases = 0, sm3_cases = 0, torch_cases = 0;
  for (const auto& file : files) {
    const ref_case c = load_ref(file);
    INFO("case " << c.name);
    REQUIRE(c.steps > 1);
    REQUIRE(c.scale > 0);
    for (double d : c.sensitivity) REQUIRE(d > 10 * rtol);
    std::vector<std::pair<std::string, std::map<int, std::vector<std::vector<float>>>>> runs;
    if (c.optimizer == "adafactor") {
      runs.emplace_back("adafactor", run_ref_case(gradapt::adafactor(adafactor_from(c.opt)), c, 2));
      runs.emplace_back("adafactor_chain",
                        run_ref_case(gradapt::adafactor_chain(adafactor_from(c.opt)), c, 2));
      ++adafactor_cases;
      torch_cases += c.name.find("torch") != std::string::npos;
    } else {
      REQUIRE(c.optimizer == "sm3");
      const gradapt::sm3_options so{
          .lr = c.opt.at("lr"), .momentum = c.opt.at("momentum"), .eps = c.opt.at("eps")};
      runs.emplace_back("sm3", run_ref_case(gradapt::sm3(so), c, 2));
      runs.emplace_back("sm3_chain", run_ref_case(gradapt::sm3_chain(so), c, 2));
      ++sm3_cases;
    }
    for (const auto& [form, mine] : runs) {
      INFO("optimizer " << form);
      double worst = 0;
      for (const auto& r : c.results) {
        std::size_t t = 0;
        while (c.tensors[t].name != r.tensor) ++t;
        const auto& got = mine.at(r.step)[t];
        const auto p0 = c.tensors[t].param0();
        double own = 0;  // the tensor's own movement, from the sample
        for (std::size_t k = 0; k < r.sample.size(); ++k)
          if (std::isfinite(r.sample[k]))
            own = std::max(own, std::fabs(r.sample[k] - double(p0[k * r.stride])));
        REQUIRE((got.size() + r.stride - 1) / r.stride == r.sample.size());
        for (std::size_t k = 0; k < r.sample.size(); ++k) {
          const double want = r.sample[k];
          const double v = got[k * r.stride];
          INFO("tensor " << r.tensor << " step " << r.step << " element " << k * r.stride << ": " << v
                         << " vs " << want);
          if (std::isnan(want)) {
            REQUIRE(std::isnan(v));
          } else if (std::isinf(want)) {
            REQUIRE(v == want);
          } else {
            const double err = std::fabs(v - want);
            REQUIRE(err <= rtol * c.scale);
            REQUIRE(err <= 1e-3 * own + 4 * std::ldexp(std::fabs(want), -23) + 1e-30);
            worst = std::max(worst, err / c.scale);
          }
        }
      }
      WARN("case " << c.name << " (" << form << "): largest difference " << worst
                   << " of the movement scale (tolerance " << rtol << ")");
    }
  }
  REQUIRE(adafactor_cases >= 5);
  REQUIRE(torch_cases >= 2);
  REQUIRE(sm3_cases >= 2);
}

// ---- adafactor_chain and user chains starting with transform::scale_by_factored_rms -------------

TEST_CASE("adafactor_chain: n + m state elements for an n x m matrix, momentum buffer per parameter",
          "[optim][adafactor][chain]") {
  std::vector<tensor> ts = {make("w", {300, 129}, 1), make("b", {300}, 2), make("small", {127, 500}, 3),
                            make("c", {4, 200, 130}, 4), make("empty", {0, 200}, 5)};
  auto pl = list_of(ts);
  host b{};
  const std::size_t stats = 300 + 129 + 300 + 127 * 500 + 4 * (200 + 130);
  {
    auto st = gradapt::adafactor_chain().init(b, pl);
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
    auto st = gradapt::adafactor_chain({.momentum = 0.9}).init(b, pl);
    REQUIRE(st.state_elements() == stats + pl.total_elements());
  }
  {
    // The workspace: one slot per thread of the task mode, each O(n + m) of the largest
    // factored tensor (not O(parameters)), plus a few doubles per tensor.
    const std::size_t one = gradapt::adafactor_chain().init(host{.threads = 1}, pl).workspace_bytes();
    const std::size_t two = gradapt::adafactor_chain().init(host{.threads = 2}, pl).workspace_bytes();
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

TEST_CASE(
    "adafactor_chain is bitwise independent of the thread count, restores exactly and allocates nothing",
    "[optim][adafactor][chain]") {
  const gradapt::adafactor_options o{.lr = 0.03, .momentum = 0.5, .weight_decay = 1e-3};
  std::vector<std::vector<float>> out;
  for (int th : {1, 2, 3}) {
    auto ts = shapes_mix();
    ts.push_back(make("huge", {515, 257}, 11));  // the parallel host paths
    auto pl = list_of(ts);
    host b{.threads = th};
    const auto opt = gradapt::adafactor_chain(o);
    auto st = opt.init(b, pl);
    for (int s = 1; s <= 3; ++s) {
      for (std::size_t k = 0; k < ts.size(); ++k)
        fill_grad(ts[k], 31u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      const long before = alloc_counter::in_process();
      opt.step(b, pl, st);
      if (s > 1) REQUIRE(alloc_counter::in_process() == before);
    }
    std::vector<float> all;
    for (auto& t : ts) all.insert(all.end(), t.p.begin(), t.p.end());
    out.push_back(all);
  }
  for (std::size_t r = 1; r < out.size(); ++r)
    for (std::size_t i = 0; i < out[0].size(); ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(out[r][i]) == std::bit_cast<std::uint32_t>(out[0][i]));

  // Save after 3 steps, restore into a fresh state, continue: the same bits.
  auto a = shapes_mix();
  auto pa = list_of(a);
  host b{.threads = 2};
  const auto opt = gradapt::adafactor_chain(o);
  auto sa = opt.init(b, pa);
  for (int s = 1; s <= 3; ++s) {
    for (std::size_t k = 0; k < a.size(); ++k)
      fill_grad(a[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
    opt.step(b, pa, sa);
  }
  const auto bytes = sa.save(b);
  auto c = a;
  auto pc = list_of(c);
  auto sc = opt.init(b, pc);
  sc.load(b, bytes);
  REQUIRE(sc.steps() == 3);
  for (int s = 4; s <= 5; ++s) {
    for (std::size_t k = 0; k < a.size(); ++k) {
      fill_grad(a[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      fill_grad(c[k], 5u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
    }
    opt.step(b, pa, sa);
    opt.step(b, pc, sc);
  }
  for (std::size_t k = 0; k < a.size(); ++k)
    for (std::size_t i = 0; i < a[k].size(); ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(a[k].p[i]) == std::bit_cast<std::uint32_t>(c[k].p[i]));
  REQUIRE(sa.save(b) == sc.save(b));
  // A state whose tensors factor differently (min_dim 16 factors "small") rejects the bytes.
  auto other = gradapt::adafactor_chain({.lr = 0.03, .min_dim_size_to_factor = 16, .momentum = 0.5});
  auto so = other.init(b, pc);
  REQUIRE_THROWS_WITH(so.load(b, bytes), Contains("factored layout"));
  // The same element counts in another layout: [128, 256] and [256, 128] keep 384 statistics each.
  std::vector<tensor> wide = {make("w", {128, 256}, 1)}, tall = {make("w", {256, 128}, 1)};
  auto pw = list_of(wide);
  auto pt = list_of(tall);
  auto sw = opt.init(b, pw);
  auto st2 = opt.init(b, pt);
  REQUIRE(sw.state_elements() == st2.state_elements());
  REQUIRE_THROWS_WITH(st2.load(b, sw.save(b)), Contains("parameter 'w' has another shape"));
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

TEST_CASE("adafactor_chain edge cases: non-finite, zero and empty inputs, invalid options",
          "[optim][adafactor][chain]") {
  namespace tf = gradapt::transform;
  host b{.threads = 2};
  SECTION("inf and NaN gradients poison their tensor as in the standalone optimizer (and optax)") {
    for (const float bad : {INFINITY, NAN}) {
      auto a = shapes_mix();
      auto c = shapes_mix();
      auto pa = list_of(a);
      auto pc = list_of(c);
      const gradapt::adafactor_options o{.lr = 0.02};
      gradapt::adafactor sa_opt(o);
      const auto ca_opt = gradapt::adafactor_chain(o);
      auto sa = sa_opt.init(b, pa);
      auto sc = ca_opt.init(b, pc);
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
        sa_opt.step(b, pa, sa);
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
    const auto opt = gradapt::adafactor_chain({.lr = 0.1});
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
    const auto opt = gradapt::adafactor_chain({.lr = 0.01, .momentum = 0.5});
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
    const auto opt = gradapt::adafactor_chain();
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
    REQUIRE_THROWS_WITH(gradapt::adafactor_chain({.decay_rate = -1}), Contains("decay_rate"));
    {  // a negative step learning rate, as the class: rejected before anything moves
      auto n = shapes_mix();
      auto pn = list_of(n);
      for (std::size_t k = 0; k < n.size(); ++k) fill_grad(n[k], 60 + unsigned(k));
      const auto before = n;
      const auto opt = gradapt::adafactor_chain();
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
    const auto opt = gradapt::adafactor_chain();
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

// The parameter-scale pass of adafactor_chain reads p only (its measure ignores u and the stage
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

TEST_CASE("adafactor_chain gives the class's bits when clipping and the parameter scale are off",
          "[optim][adafactor][chain]") {
  // Without the two per-tensor factors both forms compute y in optax's order (normalised factor
  // first), scale it by the learning rate, apply momentum and decay in the same expressions.
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& o : {gradapt::adafactor_options{
                            .lr = 0.05, .clipping_threshold = inf, .multiply_by_parameter_scale = false},
                        gradapt::adafactor_options{.lr = 0.5,
                        .relative_step = true,
                        .clipping_threshold = inf,
                        .multiply_by_parameter_scale = false,
                        .momentum = 0.9,
                        .weight_decay = 1e-3}}) {
    auto a = shapes_mix();
    auto c = shapes_mix();
    auto pa = list_of(a);
    auto pc = list_of(c);
    host b{.threads = 2};
    gradapt::adafactor plain(o);
    const auto chained = gradapt::adafactor_chain(o);
    auto sa = plain.init(b, pa);
    auto sc = chained.init(b, pc);
    for (int s = 1; s <= 4; ++s) {
      for (std::size_t k = 0; k < a.size(); ++k) {
        fill_grad(a[k], 17u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
        fill_grad(c[k], 17u * static_cast<unsigned>(s) + static_cast<unsigned>(k));
      }
      plain.step(b, pa, sa);
      chained.step(b, pc, sc);
    }
    for (std::size_t k = 0; k < a.size(); ++k)
      for (std::size_t i = 0; i < a[k].size(); ++i) {
        INFO("tensor " << a[k].name << " element " << i);
        REQUIRE(std::bit_cast<std::uint32_t>(a[k].p[i]) == std::bit_cast<std::uint32_t>(c[k].p[i]));
      }
  }
}

#pragma once
// Fixtures of the Adafactor tests: named tensors with shapes, gradients from a seed, a
// param_list over them, a mix of shapes, and an independent long double re-computation of
// Shazeer & Stern's algorithm (written from the paper and optax's/torch's documented formulas,
// not from the library), with `reference_run`, `library_run` and `compare_runs` to run it side
// by side with gradapt.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "optim_runs.hpp"
#include "run_compare.hpp"

namespace adafactor_test {

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::tensor_view;
using ld = long double;

static_assert(gradapt::factored_backend<gradapt::host>);

// ---- tensors ----------------------------------------------------------------------------------

struct tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> p, g;
  std::size_t size() const { return p.size(); }
};

inline std::size_t numel(const std::vector<std::int64_t>& s) {
  std::size_t n = 1;
  for (auto d : s) n *= static_cast<std::size_t>(d);
  return n;
}

inline tensor make(std::string name, std::vector<std::int64_t> shape, unsigned seed, float pscale = 1.0f) {
  tensor t{std::move(name), std::move(shape), {}, {}};
  const std::size_t n = numel(t.shape);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  t.p.resize(n);
  t.g.resize(n);
  for (auto& x : t.p) x = u(rng) * pscale;
  return t;
}

inline void fill_grad(tensor& t, unsigned seed, float scale = 0.125f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // Row and column structure so the factored statistics are not flat.
  const std::size_t n = t.size();
  for (std::size_t i = 0; i < n; ++i) t.g[i] = u(rng) * scale * (1.0f + static_cast<float>(i % 7) * 0.25f);
}

inline gradapt::param_list<float> list_of(std::vector<tensor>& ts) {
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

  // Index of element `flat` with axis `ax` removed (row-major over the remaining dims): the
  // digits of `flat` in the mixed radix of s, from the last axis, without the digit of ax.
  static std::size_t drop(const std::vector<std::int64_t>& s, std::size_t flat, std::size_t ax) {
    std::size_t out = 0, weight = 1;
    for (std::size_t k = s.size(); k-- > 0;) {
      const std::size_t d = static_cast<std::size_t>(s[k]);
      const std::size_t i = flat % d;
      flat /= d;
      if (k == ax) continue;
      out += i * weight;
      weight *= d;
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

inline std::vector<tensor> shapes_mix() {
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

// The reference's parameters after `steps` steps from `shapes()`, with the gradients
// fill_grad gives step s and tensor k (seed 1000 s + k).
inline std::vector<tensor> reference_run(const gradapt::adafactor_options& o, int steps,
                                         std::vector<tensor> (*shapes)() = shapes_mix) {
  auto theirs = shapes();
  ref_opt ref{o, {}, 0};
  ref.init(theirs);
  gradapt_test::run_steps(theirs, 1000, steps, [&](std::vector<tensor>& ts) { ref.step(ts); });
  return theirs;
}

// gradapt's run on the same gradients as reference_run, on `threads` threads; `opt` is
// gradapt::adafactor(o) or a chain of the same stages.
template <class Opt>
std::vector<tensor> library_run(const Opt& opt, int steps, int threads = 2,
                                std::vector<tensor> (*shapes)() = shapes_mix) {
  return gradapt_test::library_run_on(opt, shapes(), 1000, steps, threads);
}

// How far gradapt's parameters land from the reference's, in units of the reference's
// movement from `start` (run_compare::relative_difference).
inline double compare_runs(const std::vector<tensor>& mine, const std::vector<tensor>& theirs,
                           const std::vector<tensor>& start) {
  return run_compare::relative_difference(mine, theirs, start);
}

}  // namespace adafactor_test

#pragma once
// Fixtures of the optimizer-chain tests: parameter problems (named shapes, flags, groups,
// gradients regenerated per step, in element types V and G) and an independent long double
// re-computation of the presets' formulas (written from the papers, not from the library).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/precision/loss_scaler.hpp"

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using gradapt::host;
using gradapt::param_flags;
using gradapt::tensor_view;
using ld = long double;

namespace chain_test {

// ---- problems ----------------------------------------------------------------------------------

struct spec {
  std::string name;
  std::vector<std::int64_t> shape;
  param_flags flags{};
  std::size_t group = 0;
  double pscale = 1.0;  ///< 0: zero weights
  double gscale = 0.1;  ///< 0: zero gradients
};

inline std::size_t numel(const std::vector<std::int64_t>& s) {
  std::size_t n = 1;
  for (auto d : s) n *= static_cast<std::size_t>(d);
  return n;
}

/// Parameters, gradients (regenerated per step) and a param_list over them, in element types
/// V and G. Groups: 0 "default"; 1 "half_lr" (lr_scale 0.5, weight_decay 0.03).
template <class V, class G>
struct problem {
  std::vector<spec> specs;
  std::vector<std::vector<V>> p;
  std::vector<std::vector<G>> g;
  gradapt::param_list<V, G> params;
  std::uint64_t seed;

  problem(std::vector<spec> s, std::uint64_t seed_) : specs(std::move(s)), seed(seed_) {
    params.add_group("half_lr", {.lr_scale = 0.5, .weight_decay = 0.03});
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (const auto& sp : specs) {
      const std::size_t n = numel(sp.shape);
      std::vector<V> pv(n);
      for (auto& x : pv) gradapt::store(x, static_cast<gradapt::compute_t<V>>(sp.pscale * u(rng)));
      p.push_back(std::move(pv));
      g.push_back(std::vector<G>(n));
    }
    for (std::size_t i = 0; i < specs.size(); ++i)
      params.add(specs[i].name, tensor_view<V>(p[i].data(), specs[i].shape),
                 tensor_view<G>(g[i].data(), specs[i].shape), specs[i].flags, specs[i].group);
  }
  /// Gradients of step s (1-based), written in place.
  void make_grads(int s) {
    std::mt19937_64 rng(seed * 7919 + static_cast<std::uint64_t>(s));
    std::normal_distribution<double> nd(0.0, 1.0);
    for (std::size_t i = 0; i < specs.size(); ++i)
      for (auto& x : g[i]) gradapt::store(x, static_cast<gradapt::compute_t<G>>(specs[i].gscale * nd(rng)));
  }
};

inline std::vector<spec> standard_specs() {
  return {
      {"w1d", {37}},
      {"w2d.weight", {33, 17}},
      {"w3d", {3, 5, 7}, {}, 1},
      {"ln.bias", {1, 9, 1}, {.skip_weight_decay = true, .skip_trust_ratio = true}},
      {"big", {300, 457}},  // > 128 Ki elements: the parallel host paths
      {"scalar", {}},
      {"empty", {0, 3}},
      {"zero_w", {16}, {}, 0, 0.0},
      {"zero_g", {16}, {}, 1, 1.0, 0.0},
  };
}

// ---- the long double reference -----------------------------------------------------------------

struct ref_tensor {
  std::vector<ld> p, m, v, b;
  bool no_wd = false, no_tr = false;
  ld lr_scale = 1;
  std::optional<ld> wd;
};

template <class V, class G>
inline std::vector<ref_tensor> ref_init(const problem<V, G>& pr,
                                        const std::function<bool(std::string_view)>& skip_wd = {},
                                        const std::function<bool(std::string_view)>& skip_tr = {}) {
  std::vector<ref_tensor> r;
  for (std::size_t i = 0; i < pr.specs.size(); ++i) {
    ref_tensor t;
    for (const auto& x : pr.p[i]) t.p.push_back(static_cast<ld>(gradapt::load(x)));
    t.m.assign(t.p.size(), 0);
    t.v.assign(t.p.size(), 0);
    t.b.assign(t.p.size(), 0);
    t.no_wd = pr.specs[i].flags.skip_weight_decay || (skip_wd && skip_wd(pr.specs[i].name));
    t.no_tr = pr.specs[i].flags.skip_trust_ratio || (skip_tr && skip_tr(pr.specs[i].name));
    if (pr.specs[i].group == 1) {
      t.lr_scale = 0.5L;
      t.wd = 0.03L;
    }
    r.push_back(std::move(t));
  }
  return r;
}

template <class G>
inline std::vector<std::vector<ld>> ref_grads(const std::vector<std::vector<G>>& g) {
  std::vector<std::vector<ld>> out;
  for (const auto& t : g) {
    std::vector<ld> x;
    for (const auto& e : t) x.push_back(static_cast<ld>(gradapt::load(e)));
    out.push_back(std::move(x));
  }
  return out;
}

inline ld norm(const std::vector<ld>& x) {
  ld s = 0;
  for (ld e : x) s += e * e;
  return std::sqrt(s);
}

inline ld decay_of(const ref_tensor& t, ld wd) { return t.no_wd ? 0 : t.wd.value_or(wd); }

/// LAMB (You et al. 2020, algorithm 2) with apex's global clipping and DeepSpeed's clamp.
inline void ref_lamb(std::vector<ref_tensor>& ts, std::vector<std::vector<ld>> g,
                     const gradapt::lamb_options& o, int step, ld lr) {
  if (std::isfinite(o.max_grad_norm)) {
    ld s = 0;
    for (const auto& x : g)
      for (ld e : x) s += e * e;
    const ld n = std::sqrt(s);
    if (n > o.max_grad_norm)
      for (auto& x : g)
        for (ld& e : x) e *= o.max_grad_norm / n;
  }
  const ld bc1 = o.bias_correction ? 1 - std::pow(static_cast<ld>(o.b1), step) : 1;
  const ld bc2 = o.bias_correction ? 1 - std::pow(static_cast<ld>(o.b2), step) : 1;
  for (std::size_t t = 0; t < ts.size(); ++t) {
    auto& T = ts[t];
    const ld wd = decay_of(T, o.weight_decay);
    std::vector<ld> u(T.p.size());
    for (std::size_t i = 0; i < u.size(); ++i) {
      T.m[i] = o.b1 * T.m[i] + (1 - static_cast<ld>(o.b1)) * g[t][i];
      T.v[i] = o.b2 * T.v[i] + (1 - static_cast<ld>(o.b2)) * g[t][i] * g[t][i];
      u[i] = (T.m[i] / bc1) / (std::sqrt(T.v[i] / bc2 + o.eps_root) + o.eps) + wd * T.p[i];
    }
    const ld pn = norm(T.p), un = norm(u);
    ld r = 1;
    if (!T.no_tr && pn > 0 && un > 0)
      r = std::clamp(pn / un, static_cast<ld>(o.min_trust_ratio), static_cast<ld>(o.max_trust_ratio));
    for (std::size_t i = 0; i < u.size(); ++i) T.p[i] -= lr * T.lr_scale * r * u[i];
  }
}

/// AdamW (Loshchilov & Hutter 2019, algorithm 2 with the optax parameterisation).
inline void ref_adamw(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
                      const gradapt::adamw_options& o, int step, ld lr) {
  const ld bc1 = o.bias_correction ? 1 - std::pow(static_cast<ld>(o.b1), step) : 1;
  const ld bc2 = o.bias_correction ? 1 - std::pow(static_cast<ld>(o.b2), step) : 1;
  for (std::size_t t = 0; t < ts.size(); ++t) {
    auto& T = ts[t];
    const ld wd = decay_of(T, o.weight_decay);
    for (std::size_t i = 0; i < T.p.size(); ++i) {
      T.m[i] = o.b1 * T.m[i] + (1 - static_cast<ld>(o.b1)) * g[t][i];
      T.v[i] = o.b2 * T.v[i] + (1 - static_cast<ld>(o.b2)) * g[t][i] * g[t][i];
      const ld u = (T.m[i] / bc1) / (std::sqrt(T.v[i] / bc2 + o.eps_root) + o.eps) + wd * T.p[i];
      T.p[i] -= lr * T.lr_scale * u;
    }
  }
}

/// LARS (You, Gitman & Ginsburg 2017, algorithm 1; optax's order: lr before momentum).
inline void ref_lars(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
                     const gradapt::lars_options& o, ld lr) {
  for (std::size_t t = 0; t < ts.size(); ++t) {
    auto& T = ts[t];
    const ld wd = decay_of(T, o.weight_decay);
    std::vector<ld> d(T.p.size());
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = g[t][i] + wd * T.p[i];
    const ld pn = norm(T.p), gn = norm(g[t]), dn = norm(d);
    ld r = 1;
    if (!T.no_tr) {
      if (o.denominator == gradapt::transform::lars_denominator::norm_of_sum) {
        if (pn > 0 && dn > 0) r = o.trust_coefficient * pn / (dn + o.eps);
      } else {
        if (pn > 0 && gn > 0) r = o.trust_coefficient * pn / (gn + wd * pn + o.eps);
      }
    }
    for (std::size_t i = 0; i < d.size(); ++i) {
      const ld u = -lr * T.lr_scale * r * d[i];
      if (o.momentum == 0) {
        T.p[i] += u;
        continue;
      }
      T.b[i] = u + o.momentum * T.b[i];
      T.p[i] += o.nesterov ? u + o.momentum * T.b[i] : T.b[i];
    }
  }
}

/// SGD with (coupled) weight decay and heavy-ball or Nesterov momentum.
inline void ref_sgd(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
                    const gradapt::sgd_options& o, ld lr) {
  for (std::size_t t = 0; t < ts.size(); ++t) {
    auto& T = ts[t];
    const ld wd = decay_of(T, o.weight_decay);
    for (std::size_t i = 0; i < T.p.size(); ++i) {
      const ld d = g[t][i] + wd * T.p[i];
      ld u = d;
      if (o.momentum != 0) {
        T.b[i] = d + o.momentum * T.b[i];
        u = o.nesterov ? d + o.momentum * T.b[i] : T.b[i];
      }
      T.p[i] -= lr * T.lr_scale * u;
    }
  }
}

/// One unit in the last place of |x| in V's precision (at least the smallest normal's).
template <class V>
inline ld ulp_of(ld x) {
  using C = gradapt::compute_t<V>;
  const C a = std::max(static_cast<C>(std::fabs(x)), std::numeric_limits<C>::min());
  return static_cast<ld>(std::nextafter(a, std::numeric_limits<C>::infinity()) - a);
}

/// Largest |ours − ref| over all elements in units of the rounding that `steps` steps in V
/// allow: per step one ulp of the parameter (its rounding) plus 1e-6 of the largest movement
/// (the compute-type rounding of the update), for float; the same with double's epsilon for
/// double. A result <= 1 means gradapt equals the exact recomputation up to its own rounding.
template <class V>
inline double scaled_error(const std::vector<std::vector<V>>& ours, const std::vector<ref_tensor>& ref,
                           const std::vector<std::vector<ld>>& start, int steps) {
  constexpr ld rel = std::is_same_v<gradapt::compute_t<V>, double> ? 1e-14L : 1e-6L;
  ld scale = 0, worst = 0;
  for (std::size_t t = 0; t < ref.size(); ++t)
    for (std::size_t i = 0; i < ref[t].p.size(); ++i)
      scale = std::max(scale, std::fabs(ref[t].p[i] - start[t][i]));
  for (std::size_t t = 0; t < ref.size(); ++t)
    for (std::size_t i = 0; i < ref[t].p.size(); ++i) {
      const ld got = static_cast<ld>(gradapt::load(ours[t][i]));
      if (!std::isfinite(static_cast<double>(got)) || !std::isfinite(static_cast<double>(ref[t].p[i])))
        return INFINITY;
      const ld unit = steps * (ulp_of<V>(ref[t].p[i]) + rel * scale);
      worst = std::max(worst, std::fabs(got - ref[t].p[i]) / unit);
    }
  return static_cast<double>(worst);
}

inline std::vector<std::vector<ld>> starts(const std::vector<ref_tensor>& r) {
  std::vector<std::vector<ld>> s;
  for (const auto& t : r) s.push_back(t.p);
  return s;
}

/// Runs `steps` steps of gradapt and of the reference with a learning-rate schedule and
/// returns the scaled error.
template <class Opt, class Ref, class V, class G>
inline double compare(const Opt& opt, Ref ref_step, problem<V, G>& pr, std::vector<ref_tensor> ref, int steps,
                      int threads = 2) {
  const auto start = starts(ref);
  host b{.threads = threads};
  auto st = opt.init(b, pr.params);
  for (int s = 1; s <= steps; ++s) {
    pr.make_grads(s);
    const double lr = 0.01 * (1.0 + 0.25 * s);  // a schedule through step_args
    opt.step(b, pr.params, st, {.lr = lr});
    ref_step(ref, ref_grads(pr.g), s, static_cast<ld>(lr));
  }
  return scaled_error(pr.p, ref, start, steps);
}

template <class T>
inline bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
inline std::string error_of(T&& fn) {
  try {
    fn();
  } catch (const gradapt::error& e) {
    return e.what();
  }
  return "";
}

/// |a - b| <= rel * |b|.
inline bool close(double a, double b, double rel) { return std::fabs(a - b) <= rel * std::fabs(b); }

inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace chain_test

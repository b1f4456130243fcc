// Optimizer chains and presets (optim/): properties the peer reference vectors do not cover.
//
//  - every option against an independent long double re-computation of the presets' formulas
//    (written here from the papers, not from the library): LAMB's trust-ratio clamp and global
//    gradient clipping, LARS's paper denominator, bias correction off, eps_root, masks from
//    param_flags and from name predicates, group lr_scale and weight_decay (also changed
//    mid-run), double parameters, 16-bit parameters and gradients, subnormal gradients;
//  - closed forms of the first step;
//  - edge cases: zero weights, zero gradients, inf and NaN gradients (confined to their tensor),
//    empty tensors, empty lists;
//  - the pass structure (which lists each backend call reads and writes), through a recording
//    backend;
//  - save/restore: training continues bit for bit, and bad checkpoints are rejected;
//  - every error message names what is wrong.
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

namespace {

// ---- problems ----------------------------------------------------------------------------------

struct spec {
  std::string name;
  std::vector<std::int64_t> shape;
  param_flags flags{};
  std::size_t group = 0;
  double pscale = 1.0;  ///< 0: zero weights
  double gscale = 0.1;  ///< 0: zero gradients
};

std::size_t numel(const std::vector<std::int64_t>& s) {
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

std::vector<spec> standard_specs() {
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
std::vector<ref_tensor> ref_init(const problem<V, G>& pr,
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
std::vector<std::vector<ld>> ref_grads(const std::vector<std::vector<G>>& g) {
  std::vector<std::vector<ld>> out;
  for (const auto& t : g) {
    std::vector<ld> x;
    for (const auto& e : t) x.push_back(static_cast<ld>(gradapt::load(e)));
    out.push_back(std::move(x));
  }
  return out;
}

ld norm(const std::vector<ld>& x) {
  ld s = 0;
  for (ld e : x) s += e * e;
  return std::sqrt(s);
}

ld decay_of(const ref_tensor& t, ld wd) { return t.no_wd ? 0 : t.wd.value_or(wd); }

/// LAMB (You et al. 2020, algorithm 2) with apex's global clipping and DeepSpeed's clamp.
void ref_lamb(std::vector<ref_tensor>& ts, std::vector<std::vector<ld>> g, const gradapt::lamb_options& o,
              int step, ld lr) {
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
void ref_adamw(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
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
void ref_lars(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
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
void ref_sgd(std::vector<ref_tensor>& ts, const std::vector<std::vector<ld>>& g,
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
ld ulp_of(ld x) {
  using C = gradapt::compute_t<V>;
  const C a = std::max(static_cast<C>(std::fabs(x)), std::numeric_limits<C>::min());
  return static_cast<ld>(std::nextafter(a, std::numeric_limits<C>::infinity()) - a);
}

/// Largest |ours − ref| over all elements in units of the rounding that `steps` steps in V
/// allow: per step one ulp of the parameter (its rounding) plus 1e-6 of the largest movement
/// (the compute-type rounding of the update), for float; the same with double's epsilon for
/// double. A result <= 1 means gradapt equals the exact recomputation up to its own rounding.
template <class V>
double scaled_error(const std::vector<std::vector<V>>& ours, const std::vector<ref_tensor>& ref,
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

std::vector<std::vector<ld>> starts(const std::vector<ref_tensor>& r) {
  std::vector<std::vector<ld>> s;
  for (const auto& t : r) s.push_back(t.p);
  return s;
}

/// Runs `steps` steps of gradapt and of the reference with a learning-rate schedule and
/// returns the scaled error.
template <class Opt, class Ref, class V, class G>
double compare(const Opt& opt, Ref ref_step, problem<V, G>& pr, std::vector<ref_tensor> ref, int steps,
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
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
std::string error_of(T&& fn) {
  try {
    fn();
  } catch (const gradapt::error& e) {
    return e.what();
  }
  return "";
}

/// |a - b| <= rel * |b|.
bool close(double a, double b, double rel) { return std::fabs(a - b) <= rel * std::fabs(b); }

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

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
      opt.step(b, params, st);
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

// ---- pass structure ----------------------------------------------------------------------------

namespace {

/// One backend call: what it was and, per list, whether the backend may write it.
struct call_record {
  std::string op;
  std::vector<bool> mutable_lists;
  bool operator==(const call_record&) const = default;
};

/// Forwards to gradapt::host and records every element-wise call.
struct recording_backend {
  using space = gradapt::host_space;
  host inner{.threads = 1};
  std::vector<call_record>* log = nullptr;

  template <class L>
  static bool is_mutable() {
    using V = std::remove_cvref_t<std::ranges::range_value_t<L>>;
    return !std::is_const_v<typename V::element_type>;
  }
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, space>... v) const {
    log->push_back({"apply", {!std::is_const_v<Ts>...}});
    inner.apply(f, v...);
  }
  template <class F, class... Ls>
  void apply_list(F f, const Ls&... ls) const {
    log->push_back({"apply_list", {is_mutable<Ls>()...}});
    inner.apply_list(f, ls...);
  }
  template <class F, class... Ls>
  auto apply_reduce_list(F f, std::span<double> out, const Ls&... ls) const {
    log->push_back({"apply_reduce_list", {is_mutable<Ls>()...}});
    return inner.apply_reduce_list(f, out, ls...);
  }
  template <class T>
  double reduce(gradapt::reduction op, tensor_view<T, space> x) const {
    return inner.reduce(op, x);
  }
  template <class L>
  double reduce(gradapt::reduction op, const L& xs, std::span<double> out) const {
    return inner.reduce(op, xs, out);
  }
  template <class T, class U>
  double dot(tensor_view<T, space> x, tensor_view<U, space> y) const {
    return inner.dot(x, y);
  }
  template <class L1, class L2>
  double dot(const L1& x, const L2& y, std::span<double> out) const {
    return inner.dot(x, y, out);
  }
  void synchronize() const {}
  template <gradapt::element T>
  auto allocate(std::size_t n) const {
    return inner.allocate<T>(n);
  }
  template <class T>
  void copy(tensor_view<const T, space> s, tensor_view<T, space> d) const {
    inner.copy(s, d);
  }
};
static_assert(gradapt::optimizer_backend<recording_backend>);
static_assert(gradapt::optimizer_backend<host>);

template <class Opt>
std::vector<call_record> record_step(const Opt& opt) {
  std::vector<float> p(100, 1.0f), g(100, 0.1f), p2(7, 1.0f), g2(7, 0.2f);
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(p), gradapt::host_view(g));
  params.add("b", gradapt::host_view(p2), gradapt::host_view(g2));
  std::vector<call_record> log;
  recording_backend b{.log = &log};
  auto st = opt.init(b, params);
  log.clear();
  opt.step(b, params, st);
  return log;
}

}  // namespace

TEST_CASE("each preset makes the fewest passes and writes only what it must", "[optim][passes]") {
  using R = std::vector<call_record>;
  // AdamW: one pass reading p, g, m, v and writing p, m, v.
  REQUIRE(record_step(gradapt::adamw()) == R{{"apply_list", {true, false, true, true}}});
  // SGD: momentum 0 keeps no buffer; with momentum one buffer.
  REQUIRE(record_step(gradapt::sgd()) == R{{"apply_list", {true, false}}});
  REQUIRE(record_step(gradapt::sgd({.momentum = 0.9})) == R{{"apply_list", {true, false, true}}});
  // LAMB: (1) p, g read, m, v advanced, norms summed; (2) factors; (3) p written from p, m, v
  // (the gradient is not read again: the Adam direction is rebuilt from m and v).
  REQUIRE(record_step(gradapt::lamb()) == R{{"apply_reduce_list", {false, false, true, true}},
                                            {"apply_list", {true}},
                                            {"apply_list", {true, false, false}}});
  // LAMB with global clipping: one read pass over g first (and a one-element finalize).
  REQUIRE(record_step(gradapt::lamb({.max_grad_norm = 1.0})) ==
          R{{"apply_reduce_list", {false}},
            {"apply", {true}},
            {"apply_reduce_list", {false, false, true, true}},
            {"apply_list", {true}},
            {"apply_list", {true, false, false}}});
  // LARS: norms of p and g (read only), then p, g read and p, momentum written.
  REQUIRE(record_step(gradapt::lars()) == R{{"apply_reduce_list", {false, false}},
                                            {"apply_list", {true}},
                                            {"apply_list", {true, false, true}}});
  REQUIRE(record_step(gradapt::lars({.momentum = 0})) ==
          R{{"apply_reduce_list", {false, false}}, {"apply_list", {true}}, {"apply_list", {true, false}}});
  // A custom chain with two barriers: block-RMS clipping then the trust ratio.
  namespace tf = gradapt::transform;
  gradapt::chain<tf::clip_by_block_rms, tf::scale_by_adam, tf::scale_by_trust_ratio,
                 tf::scale_by_learning_rate>
      c{tf::clip_by_block_rms{.threshold = 0.05}, tf::scale_by_adam{}, tf::scale_by_trust_ratio{},
        tf::scale_by_learning_rate{.lr = 0.1}};
  REQUIRE(record_step(c) == R{{"apply_reduce_list", {false}},
                              {"apply_list", {true}},
                              {"apply_reduce_list", {false, false, true, true}},
                              {"apply_list", {true}},
                              {"apply_list", {true, false, false}}});
}

TEST_CASE("a custom chain with block-RMS clipping matches its formula", "[optim][chain]") {
  namespace tf = gradapt::transform;
  // clip_by_block_rms then SGD: u = g / max(1, rms(g) / c), p ← p − η u.
  std::vector<float> p{1, 2, 3, 4}, g{3, -4, 0, 0}, p2{1, 1}, g2{0.01f, 0.01f};
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(p), gradapt::host_view(g));
  params.add("b", gradapt::host_view(p2), gradapt::host_view(g2));
  gradapt::chain<tf::clip_by_block_rms, tf::scale_by_learning_rate> c{tf::clip_by_block_rms{.threshold = 0.5},
                                                                      tf::scale_by_learning_rate{.lr = 1.0}};
  host b{};
  auto st = c.init(b, params);
  c.step(b, params, st);
  const double rms = std::sqrt((9.0 + 16.0) / 4.0);  // 2.5: clipped by 0.5 / 2.5
  REQUIRE(close(p[0], 1 - 3 * 0.5 / rms, 1e-6));
  REQUIRE(close(p[1], 2 + 4 * 0.5 / rms, 1e-6));
  REQUIRE(close(p2[0], 1 - 0.01, 1e-6));  // rms 0.01 < 0.5: untouched
}

TEST_CASE("ema with debias, parameter block RMS, relative step and lr-coupled decay follow their formulas",
          "[optim][chain]") {
  namespace tf = gradapt::transform;
  // u = EMA(g) / (1 − β^t); u ← u · max(rms(p), min_scale); u ← η_t s u with η_t = min(η, 1/√t);
  // u ← u + λ η s p (times_lr: the step's η, not η_t; s the group's lr_scale); p ← p − u.
  std::vector<float> pa{1, 2, 3, 4}, ga{1, -2, 0.5f, 4}, pb{2, -2}, gb{0.25f, -1};
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(pa), gradapt::host_view(ga));
  const std::size_t slow = params.add_group("slow", {.lr_scale = 0.5, .weight_decay = std::nullopt});
  params.add("b", gradapt::host_view(pb), gradapt::host_view(gb), {}, slow);
  const double beta = 0.5, lam = 0.1, eta = 0.9;
  gradapt::chain c{tf::ema{.decay = beta, .debias = true}, tf::scale_by_param_block_rms{.min_scale = 1e-3},
                   tf::scale_by_learning_rate{.flip_sign = false, .relative_step = true},
                   tf::add_decayed_weights{.weight_decay = lam, .times_lr = true}, tf::scale{.factor = -1}};
  host b{};
  auto st = c.init(b, params);
  std::vector<std::vector<double>> p = {{1, 2, 3, 4}, {2, -2}}, m = {{0, 0, 0, 0}, {0, 0}};
  const std::vector<std::vector<double>> g = {{1, -2, 0.5, 4}, {0.25, -1}};
  const double s[2] = {1.0, 0.5};
  for (int t = 1; t <= 3; ++t) {
    c.step(b, params, st, {.lr = eta});
    const double eta_t = std::min(eta, 1 / std::sqrt(double(t)));
    for (std::size_t k = 0; k < 2; ++k) {
      double ss = 0;
      for (double v : p[k]) ss += v * v;
      const double scale = std::max(std::sqrt(ss / double(p[k].size())), 1e-3);
      for (std::size_t i = 0; i < p[k].size(); ++i) {
        m[k][i] = (1 - beta) * g[k][i] + beta * m[k][i];
        const double u =
            m[k][i] / (1 - std::pow(beta, t)) * scale * eta_t * s[k] + lam * eta * s[k] * p[k][i];
        p[k][i] -= u;
      }
    }
    for (std::size_t i = 0; i < pa.size(); ++i) REQUIRE(close(pa[i], p[0][i], 1e-5));
    for (std::size_t i = 0; i < pb.size(); ++i) REQUIRE(close(pb[i], p[1][i], 1e-5));
  }
  // The parameter scale's measure reads p only, but ema before it keeps state: its pass still
  // advances ema (it is not a p-only pass).
  using P = decltype(c)::plan;
  static_assert(!P::measure_only(0, P::mask_of(3)));
  REQUIRE_THROWS_WITH((gradapt::chain{tf::ema{.decay = -0.1}}), Contains("decay"));
  REQUIRE_THROWS_WITH(c.step(b, params, st, {.lr = -1.0}), Contains("learning rate"));
}

TEST_CASE("presets reject a negative learning rate; a chain of one's own may ascend", "[optim][chain]") {
  namespace tf = gradapt::transform;
  std::vector<float> p = {1, -2, 3, 0.5f}, g = {0.5f, 0.25f, -1, 2};
  const std::vector<float> p0 = p;
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  host b{};
  const auto check = [&](const auto& opt, const char* name) {
    CAPTURE(name);
    auto st = opt.init(b, params);
    REQUIRE_THROWS_WITH(opt.step(b, params, st, {.lr = -0.1}),
                        Contains("learning rate is -0.1") && Contains("expected >= 0"));
    REQUIRE(p == p0);  // rejected before any element moved
    REQUIRE(st.steps() == 0);
    opt.step(b, params, st, {.lr = 0.0});  // zero is allowed
    p = p0;
  };
  check(gradapt::sgd({.lr = 0.1, .momentum = 0.9}), "sgd");
  check(gradapt::adamw(), "adamw");
  check(gradapt::lamb(), "lamb");
  check(gradapt::lars(), "lars");
  REQUIRE_THROWS_WITH(gradapt::sgd({.lr = -0.1}), Contains("lr is -0.1") && Contains("expected >= 0"));
  REQUIRE_THROWS_WITH(gradapt::adamw({.lr = -1e-3}), Contains("expected >= 0"));
  // A chain of one's own: allow_negative defaults to true, so η = -0.5 with the sign flip ascends:
  // p ← p + 0.5 g.
  gradapt::chain up{tf::scale_by_learning_rate{.lr = 1.0}};
  auto st = up.init(b, params);
  up.step(b, params, st, {.lr = -0.5});
  for (std::size_t i = 0; i < p.size(); ++i) REQUIRE(p[i] == p0[i] + 0.5f * g[i]);
  REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_learning_rate{.lr = -1.0, .allow_negative = false}}),
                      Contains("lr is -1"));
}

// ---- save / restore ----------------------------------------------------------------------------

namespace {

template <class Opt>
void check_round_trip(const Opt& opt, int threads) {
  problem<float, float> a(standard_specs(), 43);
  host b{.threads = threads};
  auto st = opt.init(b, a.params);
  for (int s = 1; s <= 3; ++s) {
    a.make_grads(s);
    opt.step(b, a.params, st, {.lr = 0.01});
  }
  const auto bytes = st.save(b);
  const auto p_saved = a.p;
  for (int s = 4; s <= 6; ++s) {
    a.make_grads(s);
    opt.step(b, a.params, st, {.lr = 0.01});
  }
  // A fresh problem and state, restored from the bytes.
  problem<float, float> c(standard_specs(), 43);
  for (std::size_t t = 0; t < c.p.size(); ++t)
    std::copy(p_saved[t].begin(), p_saved[t].end(), c.p[t].begin());
  auto st2 = opt.init(b, c.params);
  st2.load(b, bytes);
  REQUIRE(st2.steps() == 3);
  for (int s = 4; s <= 6; ++s) {
    c.make_grads(s);
    opt.step(b, c.params, st2, {.lr = 0.01});
  }
  for (std::size_t t = 0; t < c.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
  REQUIRE(st2.save(b) == st.save(b));
}

}  // namespace

TEST_CASE("save and restore continue bit for bit", "[optim][checkpoint]") {
  for (int threads : {1, 2}) {
    check_round_trip(gradapt::adamw({.weight_decay = 0.01}), threads);
    check_round_trip(gradapt::lamb({.weight_decay = 0.01, .max_grad_norm = 1.0}), threads);
    check_round_trip(gradapt::lars({.weight_decay = 0.01, .nesterov = true}), threads);
    check_round_trip(gradapt::sgd({.momentum = 0.9}), threads);
    check_round_trip(gradapt::sgd(), threads);
  }
}

TEST_CASE("a state is move-only and keeps working after a move", "[optim][checkpoint]") {
  problem<float, float> a(standard_specs(), 59), c(standard_specs(), 59);
  host b{};
  gradapt::lamb opt({.weight_decay = 0.01});
  auto s1 = opt.init(b, a.params);
  static_assert(!std::is_copy_constructible_v<decltype(s1)> &&
                std::is_nothrow_move_constructible_v<decltype(s1)>);
  auto s2 = opt.init(b, c.params);
  a.make_grads(1);
  c.make_grads(1);
  opt.step(b, a.params, s1);
  opt.step(b, c.params, s2);
  auto moved = std::move(s2);  // the views into the moved buffers stay valid
  a.make_grads(2);
  c.make_grads(2);
  opt.step(b, a.params, s1);
  opt.step(b, c.params, moved);
  for (std::size_t t = 0; t < a.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
}

TEST_CASE("bad checkpoints are rejected with the reason", "[optim][checkpoint][errors]") {
  problem<float, float> a(standard_specs(), 47);
  host b{};
  gradapt::adamw opt;
  auto st = opt.init(b, a.params);
  a.make_grads(1);
  opt.step(b, a.params, st);
  const auto bytes = st.save(b);
  auto st2 = opt.init(b, a.params);
  // Truncated, trailing bytes, not a checkpoint, another kind of state.
  REQUIRE_THROWS_WITH(st2.load(b, std::span(bytes).first(bytes.size() - 5)), Contains("checksum mismatch"));
  auto longer = bytes;
  longer.push_back(std::byte{0});
  REQUIRE_THROWS_WITH(st2.load(b, longer), Contains("checksum mismatch"));
  auto garbled = bytes;
  garbled[0] = std::byte{'x'};
  REQUIRE_THROWS_WITH(st2.load(b, garbled), Contains("not a gradapt state archive"));
  REQUIRE_THROWS_WITH(st2.load(b, std::span(bytes).first(3)), Contains("too few"));
  REQUIRE_THROWS_WITH(st2.load(b, gradapt::loss_scaler{}.save()),
                      Contains("'gradapt.loss_scaler' archive, expected 'gradapt.optimizer'"));
  // A well-formed archive whose values do not fit: a non-finite moment, a step count that
  // cannot grow.
  const auto rewrite = [&](auto&& edit) {
    gradapt::archive_reader r{bytes, "gradapt.optimizer", 1};
    gradapt::archive_writer w{"gradapt.optimizer", 1};
    for (const auto& n : r.names()) {
      switch (r.type(n)) {
        case gradapt::archive_field::u64: {
          auto v = r.get<std::uint64_t>(n);
          edit(n, v);
          w.put(n, v);
          break;
        }
        case gradapt::archive_field::string:
          w.put(n, r.get<std::string>(n));
          break;
        case gradapt::archive_field::tensor: {
          const auto info = r.tensor_info(n);
          if (info.element == gradapt::archive_element::i64) {
            w.put_tensor<std::int64_t>(n, r.get_tensor<std::int64_t>(n), info.shape);
          } else {
            auto v = r.get_tensor<float>(n);
            edit(n, v);
            w.put_tensor<float>(n, v, info.shape);
          }
          break;
        }
        default:
          FAIL("unexpected field type");
      }
    }
    return w.finish();
  };
  const auto nan_moment = rewrite([](const std::string& n, auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::vector<float>>)
      if (n.rfind("buffer1/", 0) == 0 && !v.empty()) v.back() = std::numeric_limits<float>::quiet_NaN();
  });
  REQUIRE_THROWS_WITH(st2.load(b, nan_moment), Contains("holds a non-finite value"));
  const auto huge_steps = rewrite([](const std::string& n, auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::uint64_t>)
      if (n == "steps") v = std::numeric_limits<std::uint64_t>::max();
  });
  REQUIRE_THROWS_WITH(st2.load(b, huge_steps), Contains("cannot grow"));
  REQUIRE(st2.steps() == 0);
  // Other element type, other sizes, other active stages, other optimizer.
  problem<double, double> d(standard_specs(), 47);
  auto sd = opt.init(b, d.params);
  REQUIRE_THROWS_WITH(sd.load(b, bytes), Contains("holds float32 state but this state is float64"));
  auto specs = standard_specs();
  specs[0].shape = {38};
  problem<float, float> other(specs, 47);
  auto so = opt.init(b, other.params);
  REQUIRE_THROWS_WITH(so.load(b, bytes), Contains("has another shape in the checkpoint"));
  gradapt::sgd plain, heavy({.momentum = 0.9});
  auto sp = plain.init(b, a.params);
  auto sh = heavy.init(b, a.params);
  REQUIRE_THROWS_WITH(sh.load(b, sp.save(b)), Contains("active-stage mask"));
  gradapt::lamb lamb;
  auto sl = lamb.init(b, a.params);
  REQUIRE_THROWS_WITH(sl.load(b, bytes), Contains("stage count is 3 but this state's is 5"));
  // A failed load leaves the state usable and unchanged.
  REQUIRE(st2.steps() == 0);
  st2.load(b, bytes);
  REQUIRE(st2.steps() == 1);
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("invalid options name the public algorithm and option", "[optim][errors]") {
  REQUIRE_THROWS_WITH(gradapt::adamw({.b1 = 1.0}),
                      StartsWith("gradapt: adamw: b1 is 1 (expected 0 <= b1 < 1"));
  REQUIRE_THROWS_WITH(gradapt::adamw({.b2 = -0.1}), StartsWith("gradapt: adamw: b2 is -0.1"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.b1 = 1}), StartsWith("gradapt: lamb: b1 is 1"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.eps = -1e-6}), StartsWith("gradapt: lamb: eps is -1e-06"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.lr = std::nan("")}), StartsWith("gradapt: lamb: lr is nan"));
  REQUIRE_THROWS_WITH(
      gradapt::lamb({.min_trust_ratio = 10, .max_trust_ratio = 0.01}),
      StartsWith("gradapt: lamb: the clamp [min_trust_ratio, max_trust_ratio] is [10, 0.01]"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.max_grad_norm = -1}), StartsWith("gradapt: lamb: max_grad_norm is -1"));
  REQUIRE_THROWS_WITH(gradapt::lars({.trust_coefficient = 0}),
                      StartsWith("gradapt: lars: trust_coefficient is 0"));
  REQUIRE_THROWS_WITH(gradapt::lars({.momentum = 1.5}), StartsWith("gradapt: lars: momentum is 1.5"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.momentum = -0.5}), StartsWith("gradapt: sgd: momentum is -0.5"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.nesterov = true}),
                      StartsWith("gradapt: sgd: nesterov is set but momentum is 0"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.weight_decay = INFINITY}),
                      StartsWith("gradapt: sgd: weight_decay is inf"));
}

TEST_CASE("the ({}) forms give the default options", "[optim][usability]") {
  // Each is an exact match for the empty braces (not ambiguous with the move constructor).
  problem<float, float> a(standard_specs(), 61), c(standard_specs(), 61);
  host b{};
  const auto same_step = [&](const auto& x, const auto& y) {
    auto sx = x.init(b, a.params);
    auto sy = y.init(b, c.params);
    a.make_grads(1);
    c.make_grads(1);
    x.step(b, a.params, sx);
    y.step(b, c.params, sy);
    for (std::size_t t = 0; t < a.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
  };
  same_step(gradapt::sgd({}), gradapt::sgd());
  same_step(gradapt::adamw({}), gradapt::adamw());
  same_step(gradapt::lamb({}), gradapt::lamb());
  same_step(gradapt::lars({}), gradapt::lars());
  REQUIRE(gradapt::loss_scaler({}).scale() == gradapt::loss_scaler().scale());
  REQUIRE_THROWS_WITH(gradapt::lamb({gradapt::lamb_options{}, gradapt::lamb_options{}}),
                      Contains("lamb: 2 option sets given (expected one)"));
}

TEST_CASE("mismatched parameters, states and learning rates are rejected", "[optim][errors]") {
  problem<float, float> a(standard_specs(), 53);
  host b{};
  gradapt::lamb opt;
  auto st = opt.init(b, a.params);
  // A list with another tensor count, or another size.
  auto fewer = standard_specs();
  fewer.pop_back();
  problem<float, float> f(fewer, 53);
  REQUIRE_THROWS_WITH(opt.step(b, f.params, st), Contains("holds 8 tensors but the state was created for 9"));
  auto bigger = standard_specs();
  bigger[1].shape = {33, 18};
  problem<float, float> g(bigger, 53);
  REQUIRE_THROWS_WITH(opt.step(b, g.params, st),
                      Contains("parameter 'w2d.weight' (tensor 1) has 594 elements but the state holds 561"));
  // A learning rate that is not finite.
  REQUIRE_THROWS_WITH(opt.step(b, a.params, st, {.lr = INFINITY}),
                      Contains("the step's learning rate is inf"));
  // Options that switch a stage on or off after init.
  gradapt::sgd sgd({.momentum = 0.9});
  auto ss = sgd.init(b, a.params);
  sgd.stage<1>().decay = 0.0;
  REQUIRE_THROWS_WITH(sgd.step(b, a.params, ss),
                      Contains("{stage 1 off} but the state was created with {stage 1 on}"));
  sgd.stage<1>().decay = 0.5;  // another momentum is fine
  sgd.step(b, a.params, ss);
  REQUIRE(ss.steps() == 1);
  REQUIRE(st.steps() == 0);  // failed steps do not count
  REQUIRE_THROWS_WITH(st.buffer(2), Contains("index 2 out of range (2 buffer(s))"));
}

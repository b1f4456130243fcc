// gradapt::kfac (optim/kfac.hpp) on host_lapack, against references independent of the library:
//  1. closed form: for a linear least-squares layer with G = I the K-FAC curvature is the
//     Gauss-Newton matrix, so one step with damping 0 and lr 1 lands on the least-squares
//     solution (solved here in long double), with and without a bias;
//  2. one step's preconditioned gradient against long double: eigen (the damped Kronecker
//     inverse through a Jacobi eigendecomposition), its prediv form, and explicit inverses;
//     the factors' running averages from the identity;
//  3. KL clipping scales by ν = min(1, √(kl_clip / |Σ lr²⟨V, M⟩|));
//  4. frequencies, micro-batch averaging, the loss scale divided out of g;
//  5. distributed over 1..4 comm::threads ranks, each with its own a and g: the bits of one rank
//     accumulating every rank's batch in rank order; each decomposition computed once; the same
//     under every grad_worker_fraction (1..6 ranks), with each decomposition held by g ranks;
//     checkpoints of partly held decompositions; double decompositions over float factors;
//  6. failures keep the previous decomposition, count, and throw after N in a row (naming the
//     rank that computed it); checkpoints continue bit for bit; bad input and ranks that
//     disagree throw on every rank.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bit_flips.hpp"
#include "catch.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "ld_linalg.hpp"
#include "rank_check.hpp"

namespace gradapt_test_kfac {

using Catch::Matchers::Contains;
using gradapt::kfac;
using gradapt::kfac_grad;
using gradapt::kfac_layer;
using gradapt::kfac_method;
using gradapt::kfac_options;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using gradapt_test::ld;
using gradapt_test::normal_vector;

namespace {

const gradapt::host_lapack la{};
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};

template <class T>
tensor_view<const T> mat(const std::vector<T>& v, std::int64_t r, std::int64_t c) {
  return tensor_view<const T>(v.data(), {r, c});
}

// rows × out with orthonormal columns scaled by √rows: gᵀg / rows = I exactly up to rounding.
std::vector<double> identity_g(std::int64_t rows, std::int64_t out, unsigned seed) {
  auto g = normal_vector<double>(static_cast<std::size_t>(rows * out), seed);
  for (std::int64_t c = 0; c < out; ++c) {  // modified Gram-Schmidt in long double
    for (std::int64_t p = 0; p < c; ++p) {
      ld dot = 0;
      for (std::int64_t r = 0; r < rows; ++r) dot += ld(g[r * out + c]) * ld(g[r * out + p]);
      for (std::int64_t r = 0; r < rows; ++r)
        g[r * out + c] = double(ld(g[r * out + c]) - dot * ld(g[r * out + p]));
    }
    ld norm = 0;
    for (std::int64_t r = 0; r < rows; ++r) norm += ld(g[r * out + c]) * ld(g[r * out + c]);
    for (std::int64_t r = 0; r < rows; ++r) g[r * out + c] = double(ld(g[r * out + c]) / std::sqrt(norm));
  }
  for (auto& x : g) x *= std::sqrt(double(rows));
  return g;
}

// The factor (1/rows)·xᵀx of a rows × n matrix in long double.
std::vector<ld> gram(const std::vector<ld>& x, std::size_t rows, std::size_t n) {
  std::vector<ld> s(n * n, 0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) s[i * n + j] += x[r * n + i] * x[r * n + j] / ld(rows);
  return s;
}

template <class T>
std::vector<ld> with_ones(const std::vector<T>& a, std::size_t rows, std::size_t in, bool bias) {
  const std::size_t n = in + (bias ? 1 : 0);
  std::vector<ld> x(rows * n, 1);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < in; ++c) x[r * n + c] = ld(a[r * in + c]);
  return x;
}

double max_rel(const std::vector<ld>& want, const std::vector<double>& got) {
  ld num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    num = std::max(num, std::fabs(want[i] - ld(got[i])));
    den = std::max(den, std::fabs(want[i]));
  }
  return double(num / den);
}

}  // namespace

// ---- 1. closed form ---------------------------------------------------------------------------

TEST_CASE("kfac: with G = I one undamped step is the Gauss-Newton step to the least-squares solution",
          "[kfac]") {
  for (const bool bias : {false, true}) {
    INFO("bias " << bias);
    const std::int64_t rows = 40, in = 6, out = 3, n = in + (bias ? 1 : 0);
    const auto a = normal_vector<double>(rows * in, 1);
    const auto tgt = normal_vector<double>(rows * out, 2);
    auto w = normal_vector<double>(out * in, 3), b = normal_vector<double>(out, 4);
    // ∇W = (1/rows) Σ (W a + b − t) aᵀ and ∇b = (1/rows) Σ (W a + b − t).
    std::vector<double> gw(out * in, 0), gb(out, 0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        ld y = bias ? ld(b[o]) : 0;
        for (std::int64_t c = 0; c < in; ++c) y += ld(w[o * in + c]) * ld(a[r * in + c]);
        const ld e = (y - ld(tgt[r * out + o])) / ld(rows);
        for (std::int64_t c = 0; c < in; ++c) gw[o * in + c] += double(e * ld(a[r * in + c]));
        gb[o] += double(e);
      }
    const kfac kf({.factor_decay = 1e-12, .damping = 0, .kl_clip = 0});
    const kfac_layer layers[] = {{"fc", in, out, bias}};
    auto st = kf.init<double>(la, layers);
    const auto g = identity_g(rows, out, 5);
    kf.accumulate(st, 0, mat(a, rows, in), mat(g, rows, out));
    const kfac_grad<double> grads[] = {
        {tensor_view<double>(gw.data(), {out, in}), bias ? gradapt::host_view(gb) : tensor_view<double>()}};
    kf.step(st, std::span(grads), 1.0);
    // W* = P·S⁻¹ with S = (1/rows) Σ x xᵀ, P = (1/rows) Σ t xᵀ (x = a with a 1 for the bias).
    const auto x = with_ones(a, rows, in, bias);
    const auto s = gram(x, rows, n);
    std::vector<ld> pt(n * out, 0);  // Pᵀ (n × out)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t o = 0; o < out; ++o)
          pt[i * out + o] += x[r * n + i] * ld(tgt[r * out + o]) / ld(rows);
    const auto wst = gradapt_test::solve(s, pt, n, out);  // W*ᵀ = S⁻¹·Pᵀ
    std::vector<ld> want;
    std::vector<double> got;
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < n; ++i) {
        want.push_back(wst[i * out + o]);
        const double cur = i < in ? w[o * in + i] : b[o];
        const double step = i < in ? gw[o * in + i] : gb[o];
        got.push_back(cur - step);
      }
    CHECK(max_rel(want, got) < 1e-9);
  }
}

// ---- 2. one step against long double -----------------------------------------------------------

TEST_CASE("kfac: one step's factors and preconditioned gradient against long double", "[kfac]") {
  const std::int64_t rows = 12, in = 5, out = 4, n = in + 1;
  const double d = 0.9, lambda = 0.05;
  const auto a = normal_vector<double>(rows * in, 11), g = normal_vector<double>(rows * out, 12);
  const auto gw0 = normal_vector<double>(out * in, 13), gb0 = normal_vector<double>(out, 14);
  // Reference factors: d·I + (1 − d)·(1/rows)·xᵀx.
  auto fa = gram(with_ones(a, rows, in, true), rows, n);
  auto fg = gram(with_ones(g, rows, out, false), rows, out);
  for (std::int64_t i = 0; i < n * n; ++i) fa[i] = ld(d) * (i % (n + 1) == 0 ? 1 : 0) + (1 - ld(d)) * fa[i];
  for (std::int64_t i = 0; i < out * out; ++i)
    fg[i] = ld(d) * (i % (out + 1) == 0 ? 1 : 0) + (1 - ld(d)) * fg[i];
  std::vector<ld> m(out * n);
  for (std::int64_t o = 0; o < out; ++o) {
    for (std::int64_t c = 0; c < in; ++c) m[o * n + c] = gw0[o * in + c];
    m[o * n + in] = gb0[o];
  }
  for (const auto method : {kfac_method::eigen, kfac_method::inverse})
    for (const bool prediv : {false, true}) {
      if (prediv && method == kfac_method::inverse) continue;
      INFO("method " << int(method) << " prediv " << prediv);
      const kfac kf({.factor_decay = d,
                     .damping = lambda,
                     .method = method,
                     .prediv_eigenvalues = prediv,
                     .kl_clip = 0});
      const kfac_layer layers[] = {{"fc", in, out, true}};
      auto st = kf.init<double>(la, layers);
      kf.accumulate(st, 0, mat(a, rows, in), mat(g, rows, out));
      auto gw = gw0, gb = gb0;
      const kfac_grad<double> grads[] = {{tensor_view<double>(gw.data(), {out, in}), gradapt::host_view(gb)}};
      kf.step(st, std::span(grads), 0.1);
      std::vector<double> got_a(st.factor_a(0).begin(), st.factor_a(0).end());
      CHECK(max_rel(fa, got_a) < 1e-14);
      std::vector<ld> want;
      if (method == kfac_method::inverse) {  // (G + λI)⁻¹·M·(A + λI)⁻¹
        auto ga = fg, aa = fa;
        for (std::int64_t i = 0; i < out; ++i) ga[i * out + i] += lambda;
        for (std::int64_t i = 0; i < n; ++i) aa[i * n + i] += lambda;
        const auto left = gradapt_test::solve(ga, m, out, n);  // (G+λI)⁻¹ M
        const auto right =
            gradapt_test::solve(aa, gradapt_test::transpose(left, out, n), n, out);  // (A+λI)⁻¹ (..)ᵀ
        want = gradapt_test::transpose(right, n, out);
      } else {  // Q_G [(Q_Gᵀ M Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ by Jacobi
        std::vector<ld> qa, da, qg, dg;
        gradapt_test::jacobi_eigen(fa, n, qa, da);
        gradapt_test::jacobi_eigen(fg, out, qg, dg);
        auto v1 = gradapt_test::matmul(
            gradapt_test::matmul(gradapt_test::transpose(qg, out, out), m, out, out, n), qa, out, n, n);
        for (std::int64_t r = 0; r < out; ++r)
          for (std::int64_t c = 0; c < n; ++c)
            v1[r * n + c] /= std::max(dg[r], ld(0)) * std::max(da[c], ld(0)) + lambda;
        want = gradapt_test::matmul(gradapt_test::matmul(qg, v1, out, out, n),
                                    gradapt_test::transpose(qa, n, n), out, n, n);
      }
      std::vector<double> got;
      for (std::int64_t o = 0; o < out; ++o) {
        for (std::int64_t c = 0; c < in; ++c) got.push_back(gw[o * in + c]);
        got.push_back(gb[o]);
      }
      CHECK(max_rel(want, got) < 1e-12);
    }
}

// ---- 3. KL clipping -------------------------------------------------------------------------------

TEST_CASE("kfac: KL clipping scales every layer by min(1, sqrt(kl_clip / |sum lr^2 <V, M>|))", "[kfac]") {
  const kfac_layer layers[] = {{"a", 4, 3, true}, {"b", 3, 2, false}};
  const auto a0 = normal_vector<double>(8 * 4, 21), g0 = normal_vector<double>(8 * 3, 22),
             a1 = normal_vector<double>(8 * 3, 23), g1 = normal_vector<double>(8 * 2, 24);
  const auto w0 = normal_vector<double>(12, 25), b0 = normal_vector<double>(3, 26),
             w1 = normal_vector<double>(6, 27);
  const auto run = [&](double kl, double lr, std::vector<double>& w, std::vector<double>& b,
                       std::vector<double>& v) {
    const kfac kf({.damping = 0.01, .kl_clip = kl});
    auto st = kf.init<double>(la, layers);
    kf.accumulate(st, 0, mat(a0, 8, 4), mat(g0, 8, 3));
    kf.accumulate(st, 1, mat(a1, 8, 3), mat(g1, 8, 2));
    w = w0, b = b0, v = w1;
    const kfac_grad<double> grads[] = {{tensor_view<double>(w.data(), {3, 4}), gradapt::host_view(b)},
                                       {tensor_view<double>(v.data(), {2, 3})}};
    kf.step(st, std::span(grads), lr);
    return st.last_kl_scale();
  };
  std::vector<double> w, b, v, wc, bc, vc;
  CHECK(run(0, 0.1, w, b, v) == 1.0);
  ld vg = 0;  // Σ ⟨V, M⟩ over both layers
  for (std::size_t i = 0; i < w.size(); ++i) vg += ld(w[i]) * ld(w0[i]);
  for (std::size_t i = 0; i < b.size(); ++i) vg += ld(b[i]) * ld(b0[i]);
  for (std::size_t i = 0; i < v.size(); ++i) vg += ld(v[i]) * ld(w1[i]);
  for (const double lr : {0.1, 3.0}) {
    const double kl = 1e-3;
    const ld nu = std::min(ld(1), std::sqrt(ld(kl) / std::fabs(vg * ld(lr) * ld(lr))));
    INFO("lr " << lr << " nu " << double(nu));
    const double got = run(kl, lr, wc, bc, vc);
    CHECK(std::fabs(got - double(nu)) <= 1e-12 * double(nu));
    for (std::size_t i = 0; i < w.size(); ++i)
      CHECK(std::fabs(wc[i] - double(nu) * w[i]) <= 1e-12 * std::fabs(w[i]) + 1e-300);
    for (std::size_t i = 0; i < v.size(); ++i)
      CHECK(std::fabs(vc[i] - double(nu) * v[i]) <= 1e-12 * std::fabs(v[i]) + 1e-300);
  }
  CHECK(run(1e-3, 3.0, wc, bc, vc) < 1.0);    // the large step is clipped
  CHECK(run(1e-3, 1e-4, wc, bc, vc) == 1.0);  // the small one is not
}

// ---- 4. frequencies, micro-batches, loss scale ---------------------------------------------------

TEST_CASE("kfac: factor and inverse frequencies, micro-batch averaging, loss scale", "[kfac]") {
  const kfac_layer layers[] = {{"fc", 3, 2, true}};
  const kfac kf({.factor_update_steps = 2, .inv_update_steps = 4});
  auto st = kf.init<float>(la, layers);
  std::vector<float> w(6), b(2);
  const kfac_grad<float> grads[] = {{tensor_view<float>(w.data(), {2, 3}), gradapt::host_view(b)}};
  std::vector<float> prev_a;
  for (int t = 1; t <= 9; ++t) {
    const bool factors = (t - 1) % 2 == 0;
    CHECK(kf.factor_update_due(st) == factors);
    if (factors) {
      const auto a = normal_vector<float>(5 * 3, 30 + unsigned(t)),
                 g = normal_vector<float>(5 * 2, 40 + unsigned(t));
      kf.accumulate(st, 0, mat(a, 5, 3), mat(g, 5, 2));
    } else {
      const auto a = normal_vector<float>(5 * 3, 1);
      CHECK_THROWS_WITH(kf.accumulate(st, 0, mat(a, 5, 3), mat(a, 5, 2)),
                        Contains("does not update factors"));
    }
    const auto before = st.decompositions();
    kf.step(st, std::span(grads), 0.1);
    const std::vector<float> now(st.factor_a(0).begin(), st.factor_a(0).end());
    CHECK((now != prev_a) == factors);
    CHECK(st.decompositions() - before == ((t - 1) % 4 == 0 ? 1u : 0u));
    prev_a = now;
  }
  // Two micro-batches average; g·s with loss_scale s gives g's factor (s a power of two: exact).
  const kfac k1({.factor_decay = 0.5});
  const auto a = normal_vector<double>(6 * 3, 50), g = normal_vector<double>(6 * 2, 51),
             a2 = normal_vector<double>(6 * 3, 52), g2 = normal_vector<double>(6 * 2, 53);
  auto gs = g2;
  for (auto& x : gs) x *= 1024;
  auto s1 = k1.init<double>(la, layers), s2 = k1.init<double>(la, layers);
  k1.accumulate(s1, 0, mat(a, 6, 3), mat(g, 6, 2));
  k1.accumulate(s1, 0, mat(a2, 6, 3), mat(gs, 6, 2), 1024.0);
  std::vector<double> all_a(a), all_g(g);
  all_a.insert(all_a.end(), a2.begin(), a2.end());
  all_g.insert(all_g.end(), g2.begin(), g2.end());
  k1.accumulate(s2, 0, mat(all_a, 12, 3), mat(all_g, 12, 2));
  std::vector<double> wd(6), bd(2);
  const kfac_grad<double> gd[] = {{tensor_view<double>(wd.data(), {2, 3}), gradapt::host_view(bd)}};
  k1.step(s1, std::span(gd), 0.1);
  k1.step(s2, std::span(gd), 0.1);
  for (std::size_t i = 0; i < s1.factor_a(0).size(); ++i)
    CHECK(std::fabs(s1.factor_a(0)[i] - s2.factor_a(0)[i]) <= 1e-14 * std::fabs(s2.factor_a(0)[i]) + 1e-300);
  for (std::size_t i = 0; i < s1.factor_g(0).size(); ++i) {
    CHECK(std::fabs(s1.factor_g(0)[i] - s2.factor_g(0)[i]) <= 1e-14 * std::fabs(s2.factor_g(0)[i]) + 1e-300);
  }
}

// ---- 5. distributed -------------------------------------------------------------------------------

namespace {
const kfac_layer model_layers[] = {
    {"fc1", 8, 6, true}, {"fc2", 6, 6, true}, {"fc3", 6, 3, false}, {"conv", 12, 4, true}};

// Rank r's a and g for layer l at step t.
std::vector<float> shard(int t, int r, std::size_t l, bool is_g) {
  const auto& s = model_layers[l];
  return normal_vector<float>(
      static_cast<std::size_t>(5 * (is_g ? s.out : s.in)),
      1000u * unsigned(t) + 100u * unsigned(r) + 10u * unsigned(l) + (is_g ? 1u : 0u));
}

struct grads_t {
  std::vector<std::vector<float>> w, b;
  std::vector<kfac_grad<float>> views;
  explicit grads_t(int t) {
    for (std::size_t l = 0; l < std::size(model_layers); ++l) {
      const auto& s = model_layers[l];
      w.push_back(normal_vector<float>(static_cast<std::size_t>(s.out * s.in),
                                       7000u + unsigned(t) * 10u + unsigned(l)));
      b.push_back(s.bias ? normal_vector<float>(static_cast<std::size_t>(s.out), 8000u + unsigned(t))
                         : std::vector<float>());
    }
    for (std::size_t l = 0; l < w.size(); ++l)
      views.push_back({tensor_view<float>(w[l].data(), {model_layers[l].out, model_layers[l].in}),
                       model_layers[l].bias ? gradapt::host_view(b[l]) : tensor_view<float>()});
  }
  std::vector<float> flat() const {
    std::vector<float> v;
    for (std::size_t l = 0; l < w.size(); ++l) {
      v.insert(v.end(), w[l].begin(), w[l].end());
      v.insert(v.end(), b[l].begin(), b[l].end());
    }
    return v;
  }
};
// One rank accumulating ranks [0, n)'s batches, steps [from, to): the gradients after each step.
template <class K, class S>
std::vector<std::vector<float>> reference(const K& kf, S& st, int n, int from, int to) {
  std::vector<std::vector<float>> want;
  for (int t = from; t < to; ++t) {
    const bool due = kf.factor_update_due(st);
    for (int r = 0; r < n && due; ++r)
      for (std::size_t l = 0; l < std::size(model_layers); ++l) {
        const auto a = shard(t, r, l, false), g = shard(t, r, l, true);
        kf.accumulate(st, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
      }
    grads_t gr(t);
    kf.step(st, gr.views, 0.05);
    want.push_back(gr.flat());
  }
  return want;
}
}  // namespace

TEST_CASE("kfac distributed: 1..4 ranks give one rank's bits over every rank's batches", "[kfac][dist]") {
  const kfac kf({.factor_update_steps = 1, .inv_update_steps = 2, .damping = 0.003});
  const int steps = 5;
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    // One rank: every rank's batch accumulated in rank order (factors are due on every step).
    auto st = kf.init<float>(la, model_layers);
    const auto want = reference(kf, st, n, 0, steps);
    std::vector<std::uint64_t> computed(static_cast<std::size_t>(n));
    run_threads(n, quick, [&](threads& c) {
      auto s = kf.init<float>(la, model_layers);
      for (int t = 0; t < steps; ++t) {
        for (std::size_t l = 0; l < std::size(model_layers); ++l) {
          const auto a = shard(t, c.rank(), l, false), g = shard(t, c.rank(), l, true);
          kf.accumulate(s, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
        }
        grads_t gr(t);
        kf.step(c, s, gr.views, 0.05);
        const auto got = gr.flat();
        RANK_CHECK(std::memcmp(got.data(), want[static_cast<std::size_t>(t)].data(),
                               got.size() * sizeof(float)) == 0);
      }
      computed[static_cast<std::size_t>(c.rank())] = s.decompositions();
    });
    std::uint64_t sum = 0;
    for (auto x : computed) sum += x;
    CHECK(sum == st.decompositions());  // steps 1, 3, 5 decompose each layer once, on one rank
  }
}

TEST_CASE("kfac distributed: bad input and disagreements throw on every rank", "[kfac][dist]") {
  const kfac kf({});
  SECTION("a factor update on some ranks only") {
    run_threads(3, quick, [&](threads& c) {
      auto s = kf.init<float>(la, model_layers);
      for (std::size_t l = 0; l < std::size(model_layers); ++l) {
        if (l == 2 && c.rank() == 1) continue;
        const auto a = shard(0, c.rank(), l, false), g = shard(0, c.rank(), l, true);
        kf.accumulate(s, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
      }
      grads_t gr(0);
      RANK_REQUIRE_THROWS_WITH(kf.step(c, s, gr.views, 0.1),
                               Contains("layer 'fc3' got a and g on 2 of 3 ranks"));
    });
  }
  SECTION("layer lists that differ") {
    run_threads(2, quick, [&](threads& c) {
      std::vector<kfac_layer> mine(std::begin(model_layers), std::end(model_layers));
      if (c.rank() == 1) mine[1].name = "fc2b";
      auto s = kf.init<float>(la, mine);
      grads_t gr(0);
      RANK_REQUIRE_THROWS_WITH(kf.step(c, s, gr.views, 0.1), Contains("layer names and shapes"));
    });
  }
  SECTION("one rank's gradients do not fit its layers") {
    run_threads(3, quick, [&](threads& c) {
      std::vector<kfac_layer> mine(std::begin(model_layers), std::end(model_layers));
      if (c.rank() == 2) mine[1].out = 5;
      auto s = kf.init<float>(la, mine);
      grads_t gr(0);
      RANK_REQUIRE_THROWS_WITH(
          kf.step(c, s, gr.views, 0.1),
          Contains(c.rank() == 2 ? "layer 'fc2' has a weight of 5" : "rank 2 passed invalid input"));
    });
  }
  SECTION("options that differ") {
    run_threads(2, quick, [&](threads& c) {
      const kfac mine({.damping = c.rank() == 0 ? 0.001 : 0.01});
      auto s = mine.init<float>(la, model_layers);
      grads_t gr(0);
      RANK_REQUIRE_THROWS_WITH(mine.step(c, s, gr.views, 0.1), Contains("damping"));
    });
  }
  SECTION("a decomposition that keeps failing names the rank that computed it") {
    const kfac k2({.max_consecutive_failures = 2});
    run_threads(3, quick, [&](threads& c) {
      auto s = k2.init<float>(la, model_layers);
      for (int t = 0; t < 3; ++t) {
        for (std::size_t l = 0; l < std::size(model_layers); ++l) {
          auto a = shard(t, c.rank(), l, false);
          const auto g = shard(t, c.rank(), l, true);
          if (l == 1 && t >= 1) a[0] = std::numeric_limits<float>::quiet_NaN();
          k2.accumulate(s, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
        }
        grads_t gr(t);
        if (t < 2) {
          k2.step(c, s, gr.views, 0.1);
          RANK_CHECK(s.ready(1));  // the step-1 decomposition is kept
        } else {
          RANK_REQUIRE_THROWS_WITH(k2.step(c, s, gr.views, 0.1),
                                   Contains("layer 'fc2'") && Contains("computed on rank"));
        }
      }
    });
  }
}

// ---- 5b. grad_worker_fraction (KAISA's modes) and the decomposition precision ------------------

namespace {
// Step t of a run: this rank's a and g (on factor-update steps), then the step on `grads`.
template <class K, class S, class Step>
void feed(const K& kf, S& s, int t, int rank, Step&& step) {
  if (kf.factor_update_due(s))
    for (std::size_t l = 0; l < std::size(model_layers); ++l) {
      const auto a = shard(t, rank, l, false), g = shard(t, rank, l, true);
      kf.accumulate(s, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
    }
  step();
}
bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}
}  // namespace

TEST_CASE(
    "kfac distributed: every grad_worker_fraction gives one rank's bits; g ranks hold each decomposition",
    "[kfac][dist]") {
  const int steps = 7;
  for (const auto method : {kfac_method::eigen, kfac_method::inverse})
    for (const int n : {1, 2, 3, 4, 6}) {
      kfac_options o{.factor_update_steps = 2, .inv_update_steps = 3, .damping = 0.003, .method = method};
      const kfac ref(o);
      auto st = ref.init<float>(la, model_layers);
      const auto want = reference(ref, st, n, 0, steps);
      for (int g = 1; g <= n; ++g) {
        if (n % g != 0) continue;
        INFO(n << " ranks, " << g << " grad workers, method " << int(method));
        o.grad_worker_fraction = double(g) / double(n);
        const kfac kf(o);
        std::vector<std::size_t> bytes(static_cast<std::size_t>(n));
        std::vector<int> held(static_cast<std::size_t>(n) * std::size(model_layers));
        std::vector<std::uint64_t> computed(static_cast<std::size_t>(n));
        run_threads(n, quick, [&](threads& c) {
          auto s = kf.init<float>(la, model_layers);
          for (int t = 0; t < steps; ++t) {
            grads_t gr(t);
            feed(kf, s, t, c.rank(), [&] { kf.step(c, s, gr.views, 0.05); });
            RANK_CHECK(same_bits(gr.flat(), want[static_cast<std::size_t>(t)]));
          }
          RANK_CHECK(s.grad_workers() == g);
          const auto me = static_cast<std::size_t>(c.rank());
          bytes[me] = s.decomposition_bytes();
          computed[me] = s.decompositions();
          for (std::size_t l = 0; l < std::size(model_layers); ++l)
            held[me * std::size(model_layers) + l] = s.holds(l) ? 1 : 0;
        });
        std::size_t total = 0;
        std::uint64_t decs = 0;
        for (int r = 0; r < n; ++r) {
          total += bytes[static_cast<std::size_t>(r)];
          decs += computed[static_cast<std::size_t>(r)];
        }
        CHECK(total == static_cast<std::size_t>(g) * st.decomposition_bytes());
        CHECK(decs == st.decompositions());  // each decomposition computed once, on one rank
        for (std::size_t l = 0; l < std::size(model_layers); ++l) {
          int holders = 0;
          for (int r = 0; r < n; ++r)
            holders += held[static_cast<std::size_t>(r) * std::size(model_layers) + l];
          CHECK(holders == g);
        }
      }
    }
}

TEST_CASE("kfac distributed: grad_worker_fraction errors and disagreements throw on every rank",
          "[kfac][dist]") {
  SECTION("g that does not divide the ranks") {
    const kfac kf({.grad_worker_fraction = 0.5});  // 3 ranks: g = round(1.5) = 2
    run_threads(3, quick, [&](threads& c) {
      auto s = kf.init<float>(la, model_layers);
      grads_t gr(0);
      feed(kf, s, 0, c.rank(), [&] {
        RANK_REQUIRE_THROWS_WITH(kf.step(c, s, gr.views, 0.1),
                                 Contains("2 grad workers per layer, which does not divide 3"));
      });
    });
  }
  for (const double f : {0.25, 0.5}) {
    INFO("grad_worker_fraction " << f);
    const kfac kf({.inv_update_steps = 3, .grad_worker_fraction = f});
    run_threads(4, quick, [&](threads& c) {
      auto s = kf.init<float>(la, model_layers);
      for (int t = 0; t < 2; ++t) {
        grads_t gr(t);
        if (t == 1 && c.rank() == 3) gr.w[0][2] += 1.0f;  // rank 3 passes other gradients
        feed(kf, s, t, c.rank(), [&] {
          if (t == 0) {
            kf.step(c, s, gr.views, 0.05);
          } else {
            // g = 1: every rank compares with rank 0; g = 2: ranks 1 and 3 see it, the others
            // learn it from the agreement after the exchange.
            const bool sees = f == 0.25 || c.rank() % 2 == 1;
            RANK_REQUIRE_THROWS_WITH(kf.step(c, s, gr.views, 0.05),
                                     Contains(sees ? "gradients of rank 3 differ" : "rank"));
          }
        });
      }
      RANK_REQUIRE_THROWS_WITH(kf.step(c, s, grads_t(2).views, 0.05), Contains("restore a checkpoint"));
    });
  }
}

TEST_CASE("kfac distributed: saves under grad_worker_fraction < 1 continue bitwise; another world recomputes",
          "[kfac][dist]") {
  const kfac_options base{.inv_update_steps = 3, .damping = 0.003};
  kfac_options mo = base;
  mo.grad_worker_fraction = 0.25;
  const kfac mem(mo), full(base);
  std::vector<std::vector<std::byte>> saves(4);
  std::vector<std::vector<float>> want(4);
  run_threads(4, quick, [&](threads& c) {
    auto s = mem.init<float>(la, model_layers);
    for (int t = 0; t < 6; ++t) {
      grads_t gr(t);
      feed(mem, s, t, c.rank(), [&] { mem.step(c, s, gr.views, 0.05); });
      if (t == 1) saves[static_cast<std::size_t>(c.rank())] = s.save();  // decomposed at step 1 only
      if (t >= 2 && c.rank() == 0) want[static_cast<std::size_t>(t - 2)] = gr.flat();  // ranks agree bitwise
    }
  });
  auto whole = full.init<float>(la, model_layers);
  for (int t = 0; t < 2; ++t) reference(full, whole, 4, t, t + 1);
  CHECK(saves[0].size() < whole.save().size());  // one rank holds some decompositions only
  // The same world and fraction, each rank its own save: nothing recomputed.
  run_threads(4, quick, [&](threads& c) {
    auto s = mem.init<float>(la, model_layers);
    s.load(saves[static_cast<std::size_t>(c.rank())]);
    const auto before = s.decompositions();
    for (int t = 2; t < 6; ++t) {
      grads_t gr(t);
      feed(mem, s, t, c.rank(), [&] { mem.step(c, s, gr.views, 0.05); });
      RANK_CHECK(same_bits(gr.flat(), want[static_cast<std::size_t>(t - 2)]));
    }
    RANK_CHECK(s.decompositions() - before <= std::size(model_layers));  // step 4's, on this rank's layers
  });
  // Two ranks, every rank holding everything, from ranks 0 and 1's saves: the decompositions are
  // recomputed from the stored factors at the next step, as one rank loading rank 0's save does.
  auto one = full.init<float>(la, model_layers);
  one.load(saves[0]);
  const auto want2 = reference(full, one, 2, 2, 6);
  run_threads(2, quick, [&](threads& c) {
    auto s = full.init<float>(la, model_layers);
    s.load(saves[static_cast<std::size_t>(c.rank())]);
    for (int t = 2; t < 6; ++t) {
      grads_t gr(t);
      feed(full, s, t, c.rank(), [&] { full.step(c, s, gr.views, 0.05); });
      RANK_CHECK(same_bits(gr.flat(), want2[static_cast<std::size_t>(t - 2)]));
    }
  });
}

TEST_CASE("kfac: decompositions in double over float factors", "[kfac]") {
  const kfac kf({.inv_update_steps = 2});
  auto ff = kf.init<float>(la, model_layers);
  auto fd = kf.init<float, double>(la, model_layers);
  auto dd = kf.init<double>(la, model_layers);
  CHECK(fd.decomposition_bytes() == 2 * ff.decomposition_bytes());
  std::vector<float> gf, gd;
  for (int t = 0; t < 4; ++t) {
    gf = reference(kf, fd, 1, t, t + 1)[0];
    gd = reference(kf, dd, 1, t, t + 1)[0];
    reference(kf, ff, 1, t, t + 1);
  }
  for (std::size_t l = 0; l < std::size(model_layers); ++l) {  // the factors are the float state's
    CHECK(std::equal(fd.factor_a(l).begin(), fd.factor_a(l).end(), ff.factor_a(l).begin()));
    CHECK(std::equal(fd.factor_g(l).begin(), fd.factor_g(l).end(), ff.factor_g(l).begin()));
  }
  double err = 0, scale = 0;  // float factors, double decompositions: float rounding of the factors only
  for (std::size_t e = 0; e < gf.size(); ++e) {
    err = std::max(err, std::fabs(double(gf[e]) - double(gd[e])));
    scale = std::max(scale, std::fabs(double(gd[e])));
  }
  CHECK(err <= 1e-4 * scale);
  // Distributed in double: one rank's bits.
  auto one = kf.init<float, double>(la, model_layers);
  const auto want = reference(kf, one, 3, 0, 4);
  const kfac half({.inv_update_steps = 2, .grad_worker_fraction = 1.0 / 3.0});
  run_threads(3, quick, [&](threads& c) {
    auto s = half.init<float, double>(la, model_layers);
    for (int t = 0; t < 4; ++t) {
      grads_t gr(t);
      feed(half, s, t, c.rank(), [&] { half.step(c, s, gr.views, 0.05); });
      RANK_CHECK(same_bits(gr.flat(), want[static_cast<std::size_t>(t)]));
    }
  });
  const auto bytes = fd.save();
  auto back = kf.init<float, double>(la, model_layers);
  back.load(bytes);
  CHECK(back.save() == bytes);
  CHECK_THROWS_WITH(ff.load(bytes), Contains("float64 decompositions"));
}

// ---- 6. failures, checkpoints, bad input ------------------------------------------------------

TEST_CASE("kfac: a failing decomposition keeps the previous one and throws after N in a row", "[kfac]") {
  const kfac kf({.max_consecutive_failures = 3});
  const kfac_layer layers[] = {{"fc", 3, 2, false}};
  auto st = kf.init<double>(la, layers);
  std::vector<double> w(6);
  const kfac_grad<double> grads[] = {{tensor_view<double>(w.data(), {2, 3})}};
  auto a = normal_vector<double>(15, 60);
  const auto g = normal_vector<double>(10, 61);
  kf.accumulate(st, 0, mat(a, 5, 3), mat(g, 5, 2));
  kf.step(st, std::span(grads), 0.1);
  REQUIRE(st.ready(0));
  const auto saved = st.save();
  a[4] = std::numeric_limits<double>::infinity();
  for (int i = 1; i <= 3; ++i) {
    w.assign(6, 1.0);
    kf.accumulate(st, 0, mat(a, 5, 3), mat(g, 5, 2));
    if (i < 3) {
      kf.step(st, std::span(grads), 0.1);
      CHECK(st.failures(0) == std::pair<std::uint64_t, std::uint64_t>{std::uint64_t(i), std::uint64_t(i)});
      CHECK(std::isfinite(w[0]));  // preconditioned with the kept decomposition
    } else {
      CHECK_THROWS_WITH(kf.step(st, std::span(grads), 0.1),
                        Contains("layer 'fc'") && Contains("3 times in a row"));
    }
  }
  CHECK_THROWS_WITH(kf.step(st, std::span(grads), 0.1), Contains("restore a checkpoint"));
  st.load(saved);
  kf.accumulate(st, 0, mat(normal_vector<double>(15, 62), 5, 3), mat(g, 5, 2));
  CHECK_NOTHROW(kf.step(st, std::span(grads), 0.1));
}

TEST_CASE("kfac: save/load continues bit for bit; mismatched archives throw and change nothing", "[kfac]") {
  const kfac kf({.inv_update_steps = 2});
  auto st = kf.init<float>(la, model_layers);
  const auto run = [&](auto& s, int from, int to) {
    std::vector<float> out;
    for (int t = from; t < to; ++t) {
      for (std::size_t l = 0; l < std::size(model_layers); ++l) {
        const auto a = shard(t, 0, l, false), g = shard(t, 0, l, true);
        kf.accumulate(s, l, mat(a, 5, model_layers[l].in), mat(g, 5, model_layers[l].out));
      }
      grads_t gr(t);
      kf.step(s, gr.views, 0.05);
      out = gr.flat();
    }
    return out;
  };
  run(st, 0, 3);
  const auto bytes = st.save();
  const auto want = run(st, 3, 6);
  auto st2 = kf.init<float>(la, model_layers);
  st2.load(bytes);
  CHECK(st2.steps() == 3);
  CHECK(run(st2, 3, 6) == want);
  {
    const kfac inv({.method = kfac_method::inverse});
    auto other = inv.init<float>(la, model_layers);
    const auto before = other.save();
    CHECK_THROWS_WITH(other.load(bytes), Contains("method"));
    CHECK(other.save() == before);
    std::vector<kfac_layer> changed(std::begin(model_layers), std::end(model_layers));
    changed[3].bias = false;
    auto o2 = kf.init<float>(la, changed);
    CHECK_THROWS_WITH(o2.load(bytes), Contains("layer 'conv' has another shape or bias"));
    auto d = kf.init<double>(la, model_layers);
    CHECK_THROWS_WITH(d.load(bytes), Contains("float32"));
  }
  {
    // Checkpoints with a valid checksum but an impossible factor: asymmetric, a negative
    // diagonal, an off-diagonal element beyond the diagonal's bound. The load names the factor
    // and the elements, and changes nothing.
    auto ref = kf.init<float>(la, model_layers);
    ref.load(bytes);
    const auto a0 = ref.factor_a(0);
    const auto n = static_cast<std::size_t>(model_layers[0].in + (model_layers[0].bias ? 1 : 0));
    REQUIRE(a0.size() == n * n);
    const auto block = std::as_bytes(a0);
    const auto at = std::search(bytes.begin(), bytes.end(), block.begin(), block.end());
    REQUIRE(at != bytes.end());
    const auto offset = static_cast<std::size_t>(at - bytes.begin());
    const auto tampered = [&](std::size_t element, float value) {
      std::vector<std::byte> b = bytes;
      std::memcpy(b.data() + offset + 4 * element, &value, 4);
      gradapt_test::reseal(b);
      return b;
    };
    auto fresh = kf.init<float>(la, model_layers);
    const auto before = fresh.save();
    CHECK_THROWS_WITH(fresh.load(tampered(1, a0[1] + 1.0f)),
                      Contains("A of layer '") && Contains("is not symmetric: element (0, 1)"));
    CHECK_THROWS_WITH(fresh.load(tampered(0, -1.0f)), Contains("has diagonal element 0 = -1"));
    const float big = 2.0f * std::sqrt(a0[0] * a0[n + 1]) + 1.0f;
    std::vector<std::byte> both = tampered(1, big);
    {  // the mirror element too, so that only the bound fails
      std::memcpy(both.data() + offset + 4 * n, &big, 4);
      gradapt_test::reseal(both);
    }
    CHECK_THROWS_WITH(fresh.load(both), Contains("is not positive semi-definite: element (0, 1)"));
    CHECK(fresh.save() == before);
    fresh.load(tampered(1, a0[1]));  // the untouched value loads
  }
}

TEST_CASE("kfac: every single-bit flip of a checkpoint is rejected, the state unchanged",
          "[kfac][checkpoint]") {
  const kfac kf({.inv_update_steps = 2});
  auto st = kf.init<float>(la, model_layers);
  for (int t = 0; t < 3; ++t) {
    for (std::size_t l = 0; l < std::size(model_layers); ++l)
      kf.accumulate(st, l, mat(shard(t, 0, l, false), 5, model_layers[l].in),
                    mat(shard(t, 0, l, true), 5, model_layers[l].out));
    grads_t gr(t);
    kf.step(st, gr.views, 0.05);
  }
  const auto good = st.save();
  const std::size_t n = gradapt_test::flip_every_bit(
      good, [&](std::span<const std::byte> bad) { st.load(bad); }, [&] { return st.save(); });
  CHECK(n == gradapt_test::flips_for(good.size()));
}

TEST_CASE("kfac: invalid options and input throw naming what is wrong", "[kfac]") {
  CHECK_THROWS_WITH(kfac({.factor_decay = 0}), Contains("factor_decay"));
  CHECK_THROWS_WITH(kfac({.factor_decay = 1.5}), Contains("factor_decay"));
  CHECK_THROWS_WITH(kfac({.factor_update_steps = 0}), Contains("factor_update_steps"));
  CHECK_THROWS_WITH(kfac({.inv_update_steps = 0}), Contains("inv_update_steps"));
  CHECK_THROWS_WITH(kfac({.damping = -1}), Contains("damping"));
  CHECK_THROWS_WITH(kfac({.method = kfac_method::inverse, .prediv_eigenvalues = true}), Contains("prediv"));
  CHECK_THROWS_WITH(kfac({.kl_clip = std::numeric_limits<double>::quiet_NaN()}), Contains("kl_clip"));
  CHECK_THROWS_WITH(kfac({.max_consecutive_failures = 0}), Contains("max_consecutive_failures"));
  const kfac kf({});
  CHECK_THROWS_WITH(kf.init<float>(la, std::span<const kfac_layer>()), Contains("no layers"));
  const kfac_layer twice[] = {{"x", 2, 2, false}, {"x", 3, 3, false}};
  CHECK_THROWS_WITH(kf.init<float>(la, twice), Contains("registered twice"));
  const kfac_layer zero[] = {{"z", 0, 2, false}};
  CHECK_THROWS_WITH(kf.init<float>(la, zero), Contains("layer 'z' has in 0"));
  const kfac_layer layers[] = {{"fc", 3, 2, true}};
  auto st = kf.init<float>(la, layers);
  const auto a = normal_vector<float>(15, 1), g = normal_vector<float>(10, 2),
             g4 = normal_vector<float>(8, 3);
  CHECK_THROWS_WITH(kf.accumulate(st, 1, mat(a, 5, 3), mat(g, 5, 2)), Contains("out of range"));
  CHECK_THROWS_WITH(kf.accumulate(st, 0, mat(a, 3, 5), mat(g, 5, 2)), Contains("takes a of rows × 3"));
  CHECK_THROWS_WITH(kf.accumulate(st, 0, mat(a, 5, 3), mat(g4, 4, 2)), Contains("a has 5 rows and g has 4"));
  CHECK_THROWS_WITH(kf.accumulate(st, 0, mat(a, 5, 3), mat(g, 5, 2), 0.0), Contains("loss_scale"));
  std::vector<float> w(6), b(2), wrong(4);
  const kfac_grad<float> bad_w[] = {{tensor_view<float>(wrong.data(), {2, 2}), gradapt::host_view(b)}};
  const kfac_grad<float> no_b[] = {{tensor_view<float>(w.data(), {2, 3})}};
  const kfac_grad<float> ok[] = {{tensor_view<float>(w.data(), {2, 3}), gradapt::host_view(b)}};
  CHECK_THROWS_WITH(kf.step(st, std::span(bad_w), 0.1), Contains("layer 'fc' has a weight of 2 × 3"));
  CHECK_THROWS_WITH(kf.step(st, std::span(no_b), 0.1), Contains("has a bias of 2"));
  CHECK_THROWS_WITH(kf.step(st, std::span(ok), -1.0), Contains("lr is -1"));
  CHECK_THROWS_WITH(kf.step(st, std::span(ok), 0.1), Contains("layer 'fc' got no a and g"));
}

TEST_CASE("kfac distributed: a one-rank difference in any option is an error on every rank naming it",
          "[kfac][dist][agreement]") {
  struct change {
    const char* option;
    const char* lo;  ///< the printed range's ends (values print with 17 digits: a prefix)
    const char* hi;
    std::function<void(kfac_options&)> apply;
  };
  const std::vector<change> changes = {
      {"factor_decay", "0.9", "0.9499", [](auto& o) { o.factor_decay = 0.9; }},
      {"factor_update_steps", "1", "2", [](auto& o) { o.factor_update_steps = 2; }},
      {"inv_update_steps", "1", "3", [](auto& o) { o.inv_update_steps = 3; }},
      {"damping", "0.001", "0.01", [](auto& o) { o.damping = 0.01; }},
      {"method", "0", "1", [](auto& o) { o.method = gradapt::kfac_method::inverse; }},
      {"prediv_eigenvalues", "0", "1", [](auto& o) { o.prediv_eigenvalues = true; }},
      {"kl_clip", "0.001", "0.002", [](auto& o) { o.kl_clip = 0.002; }},
      {"max_consecutive_failures", "4", "10", [](auto& o) { o.max_consecutive_failures = 4; }},
      {"grad_worker_fraction", "0.3333", "1", [](auto& o) { o.grad_worker_fraction = 1.0 / 3.0; }},
  };
  for (const auto& ch : changes) {
    INFO(ch.option);
    run_threads(3, quick, [&](threads& c) {
      kfac_options o{};
      if (c.rank() == 1) ch.apply(o);
      const kfac kf(o);
      auto s = kf.init<float>(la, model_layers);
      grads_t gr(0);
      feed(kf, s, 0, c.rank(), [&] {
        RANK_REQUIRE_THROWS_WITH(kf.step(c, s, gr.views, 0.1),
                                 Contains(std::string(ch.option) + " is") &&
                                     Contains(std::string("ranges from ") + ch.lo) &&
                                     Contains(std::string(" to ") + ch.hi) && Contains("across ranks"));
      });
    });
  }
}

}  // namespace gradapt_test_kfac

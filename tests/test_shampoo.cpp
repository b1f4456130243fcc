// gradapt::shampoo (optim/shampoo.hpp) on the host backend with host_lapack.
//
// References are independent of the library: a long double cyclic Jacobi eigensolver written
// here gives the matrix powers L^(-1/4) and R^(-1/4); the grafted methods are re-computed in
// long double from their formulas; closed forms where the statistics are diagonal.
//  1. one step on a matrix equals L^(-1/4)·G·R^(-1/4) (graft none, lr 1), closed form and
//     Jacobi reference, eigen and coupled Newton roots; a 3-D tensor's mode products;
//     the statistics (sum and EMA) and the roots advance exactly at the steps their
//     frequencies select;
//  2. a tensor larger than max_preconditioner_dim gives, bit for bit, what each of its blocks
//     gives as a tensor of its own;
//  3. 1-D (and over-large) tensors take the grafted method alone: AdaGrad and Adam references;
//  4. grafting: each block's direction has the grafted method's norm;
//  5. before start_preconditioning_step the step is the grafted method's, bit for bit;
//  6. a NaN gradient keeps the previous roots and counts the failure; the error after N in a
//     row names the tensor and the block; a zero statistic (relative ridge) is a failure too;
//  7. save/load round trip continues bit for bit; damaged and mismatched archives throw and
//     leave the state as it was;
//  8. every invalid option throws naming it;
//  composition: a group with lr_scale 0 stays put; bfloat16 gradients, two host threads and
//     value buffers that move after init give the float, one-thread bits;
//  9. an ill-conditioned quadratic: Shampoo reaches the loss target in far fewer steps than
//     the grafted SGD at the same learning rate;
// 10. Distributed Shampoo's options: precondition_1d, merge_from and the exponent map in the
//     plan (an unpreconditioned factor keeps a zero statistic and an identity root), the
//     preset's values, the first moment at step 1 (bias-corrected or not), the shifted
//     spectrum against the clamp on a non-PSD factor, root failures in the step's report, and
//     checkpoints refused by a state with other shaping options.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bit_flips.hpp"
#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "ld_linalg.hpp"

namespace gradapt_test_shampoo {

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::host_lapack;
using gradapt::shampoo;
using gradapt::shampoo_graft;
using gradapt::shampoo_options;
using gradapt::tensor_view;
using gradapt_test::jacobi_eigen;
using gradapt_test::ld;
using gradapt_test::matmul;
using gradapt_test::normal_vector;
using gradapt_test::sym_power;
using gradapt_test::transpose;

namespace {

// ---- long double references --------------------------------------------------------------

// Copies src into dst in place: dst's buffer is what a param_list views, so it must not move.
template <class T>
void set(std::vector<T>& dst, const std::vector<T>& src) {
  REQUIRE(dst.size() == src.size());
  std::copy(src.begin(), src.end(), dst.begin());
}

ld rel_diff(const std::vector<ld>& want, const std::vector<double>& got) {
  ld num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    num += (want[i] - got[i]) * (want[i] - got[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// One tensor's parameters and gradient, with a one-entry param_list over them.
template <class T = double>
struct one_tensor {
  std::vector<T> p, g;
  std::vector<std::int64_t> shape;
  gradapt::param_list<T> params;
  one_tensor(std::vector<std::int64_t> sh, std::string name = "w") : shape(std::move(sh)) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    p.assign(n, T(0));
    g.assign(n, T(0));
    params.add(name, tensor_view<T>(p.data(), shape), tensor_view<T>(g.data(), shape));
  }
};

const host backend{.threads = 1};
const host_lapack la{};

// Runs a step whose gradient holds a NaN: Shampoo's part (statistics, roots, failure count)
// runs; the SGD chain after it may refuse the NaN parameters (chain::step's finiteness check),
// which is accepted here.
template <class F>
void nan_step(F&& f) {
  try {
    f();
  } catch (const gradapt::error& e) {
    CHECK(std::string(e.what()).find("chain::step") != std::string::npos);
  }
}

shampoo_options exact_options() {
  shampoo_options o;
  o.lr = 1.0;
  o.merge_small_dims = false;
  o.graft = shampoo_graft::none;
  o.root.ridge = gradapt::ridge_kind::absolute;
  return o;
}

}  // namespace

// ---- 1. one step is L^(-1/4)·G·R^(-1/4) ------------------------------------------------------

TEST_CASE("shampoo: one step on a diagonal-statistics matrix is the closed form", "[shampoo]") {
  // G = [[3, 0, 0], [0, 4, 0]]: L = diag(9, 16), R = diag(9, 16, 0); with r = 7,
  // Y = L^(-1/4)·G·R^(-1/4) has Y00 = 3/√16 = 0.75, Y11 = 4/√23 and zeros elsewhere.
  auto o = exact_options();
  o.root.epsilon = 7.0;
  one_tensor t({2, 3});
  set(t.g, {3, 0, 0, 0, 4, 0});
  const shampoo opt(o);
  auto st = opt.init(backend, t.params);
  opt.step(backend, t.params, st);
  CHECK(st.preconditioner().block(0, 0).ready);
  CHECK(st.preconditioner().block(0, 0).exponent == 4);
  const double want[6] = {-0.75, 0, 0, 0, -4.0 / std::sqrt(23.0), 0};
  for (int i = 0; i < 6; ++i) CHECK(t.p[i] == Approx(want[i]).margin(1e-15).epsilon(1e-14));
}

TEST_CASE("shampoo: one step equals L^(-1/4) G R^(-1/4) from a long double Jacobi reference", "[shampoo]") {
  const std::size_t m = 5, n = 7;
  const ld r = 0.05;
  for (auto method : {gradapt::root_method::eigen, gradapt::root_method::coupled_newton}) {
    auto o = exact_options();
    o.root.epsilon = double(r);
    o.root.method = method;
    o.root.tolerance = 1e-12;
    one_tensor t({std::int64_t(m), std::int64_t(n)});
    set(t.g, normal_vector<double>(m * n, 11));
    const shampoo opt(o);
    auto st = opt.init(backend, t.params);
    opt.step(backend, t.params, st);
    std::vector<ld> g(t.g.begin(), t.g.end());
    const auto gt = transpose(g, m, n);
    const auto lq = sym_power(matmul(g, gt, m, n, m), m, r, -0.25L);
    const auto rq = sym_power(matmul(gt, g, n, m, n), n, r, -0.25L);
    const auto y = matmul(matmul(lq, g, m, m, n), rq, m, n, n);
    std::vector<double> got(m * n);
    for (std::size_t i = 0; i < m * n; ++i) got[i] = -t.p[i];
    // eigen: C·n·u·κ with κ(R + rI) = (λ_max + r)/r, about 400 here; Newton: n·tol/p on top.
    CHECK(rel_diff(y, got) < (method == gradapt::root_method::eigen ? 1e-11 : 1e-9));
  }
}

TEST_CASE("shampoo: a 3-D tensor's direction is X ×1 P1 ×2 P2 ×3 P3 with p = 6", "[shampoo]") {
  const std::size_t a = 3, b = 4, c = 5, N = a * b * c;
  const ld r = 0.1;
  auto o = exact_options();
  o.root.epsilon = double(r);
  one_tensor t({std::int64_t(a), std::int64_t(b), std::int64_t(c)});
  set(t.g, normal_vector<double>(N, 5));
  const shampoo opt(o);
  auto st = opt.init(backend, t.params);
  opt.step(backend, t.params, st);
  REQUIRE(st.preconditioner().block(0, 0).factors == 3);
  REQUIRE(st.preconditioner().block(0, 0).exponent == 6);
  const std::size_t dims[3] = {a, b, c};
  auto at = [&](std::size_t i, std::size_t j, std::size_t k) { return (i * b + j) * c + k; };
  std::vector<ld> y(t.g.begin(), t.g.end());
  for (int d = 0; d < 3; ++d) {
    const std::size_t nd = dims[d];
    std::vector<ld> s(nd * nd, 0);
    for (std::size_t i = 0; i < a; ++i)
      for (std::size_t j = 0; j < b; ++j)
        for (std::size_t k = 0; k < c; ++k) {
          const std::size_t idx[3] = {i, j, k};
          for (std::size_t q = 0; q < nd; ++q) {
            std::size_t jdx[3] = {i, j, k};
            jdx[d] = q;
            s[idx[d] * nd + q] += ld(t.g[at(idx[0], idx[1], idx[2])]) * ld(t.g[at(jdx[0], jdx[1], jdx[2])]);
          }
        }
    const auto pw = sym_power(s, nd, r, -1.0L / 6);
    std::vector<ld> z(N, 0);
    for (std::size_t i = 0; i < a; ++i)
      for (std::size_t j = 0; j < b; ++j)
        for (std::size_t k = 0; k < c; ++k) {
          const std::size_t idx[3] = {i, j, k};
          for (std::size_t q = 0; q < nd; ++q) {
            std::size_t jdx[3] = {i, j, k};
            jdx[d] = q;
            z[at(i, j, k)] += pw[idx[d] * nd + q] * y[at(jdx[0], jdx[1], jdx[2])];
          }
        }
    y = z;
  }
  std::vector<double> got(N);
  for (std::size_t i = 0; i < N; ++i) got[i] = -t.p[i];
  CHECK(rel_diff(y, got) < 1e-11);
}

TEST_CASE("shampoo: statistics (sum or EMA) and roots follow their frequencies", "[shampoo]") {
  for (double beta2 : {1.0, 0.75}) {
    shampoo_options o;
    o.merge_small_dims = false;
    o.beta2 = beta2;
    o.statistics_frequency = 2;  // statistics at steps 1, 3, 5
    o.precondition_frequency = 3;
    o.start_preconditioning_step = 2;  // roots at steps 2, 5
    one_tensor t({3, 4});
    const shampoo opt(o);
    auto st = opt.init(backend, t.params);
    std::vector<ld> left(9, 0);  // the reference L
    std::vector<double> stat_before, root_before;
    for (int step = 1; step <= 5; ++step) {
      set(t.g, normal_vector<double>(12, 90 + unsigned(step)));
      stat_before.assign(st.preconditioner().statistic(0, 0, 0).begin(),
                         st.preconditioner().statistic(0, 0, 0).end());
      root_before.assign(st.preconditioner().root(0, 0, 0).begin(), st.preconditioner().root(0, 0, 0).end());
      opt.step(backend, t.params, st);
      const bool stats_due = step % 2 == 1, roots_due = step == 2 || step == 5;
      if (stats_due) {
        const ld w = beta2 == 1.0 ? 1.0L : 1.0L - ld(beta2);
        for (std::size_t i = 0; i < 3; ++i)
          for (std::size_t j = 0; j < 3; ++j) {
            ld gg = 0;
            for (std::size_t k = 0; k < 4; ++k) gg += ld(t.g[i * 4 + k]) * ld(t.g[j * 4 + k]);
            left[i * 3 + j] = ld(beta2) * left[i * 3 + j] + w * gg;
          }
      }
      const auto stat = st.preconditioner().statistic(0, 0, 0);
      for (std::size_t i = 0; i < 9; ++i)
        CHECK(stat[i] == Approx(double(left[i])).epsilon(1e-13).margin(1e-15));
      if (!stats_due) CHECK(std::equal(stat.begin(), stat.end(), stat_before.begin()));
      const auto root = st.preconditioner().root(0, 0, 0);
      CHECK(std::equal(root.begin(), root.end(), root_before.begin()) == !roots_due);
      CHECK(st.preconditioner().block(0, 0).ready == (step >= 2));
    }
  }
}

// ---- 2. blocks ------------------------------------------------------------------------------

TEST_CASE("shampoo: plan merges small dims, drops size-1 dims and cuts blocks", "[shampoo]") {
  shampoo_options o;
  const std::vector<std::int64_t> conv{64, 32, 3, 3};
  auto l = gradapt::shampoo_plan(conv, o);
  CHECK(!l.diagonal);
  CHECK(l.merged == std::vector<std::int64_t>{64, 288});
  CHECK(l.blocks.size() == 1);
  o.max_preconditioner_dim = 100;
  l = gradapt::shampoo_plan(std::vector<std::int64_t>{250, 1, 30}, o);
  CHECK(l.merged == std::vector<std::int64_t>{250, 30});
  REQUIRE(l.blocks.size() == 3);
  CHECK(l.blocks[2].offset[0] == 200);
  CHECK(l.blocks[2].size[0] == 50);
  CHECK(l.blocks[2].size[1] == 30);
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{1, 512}, o).diagonal);
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{7}, o).diagonal);
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{}, o).diagonal);
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{0, 5}, o).diagonal);
  o.skip_preconditioning_dim_size_gt = 40;
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{50, 3}, o).diagonal);
  o.max_preconditioner_dim = 0;
  CHECK_THROWS_WITH(gradapt::shampoo_plan(std::vector<std::int64_t>{4, 6}, o),
                    Contains("max_preconditioner_dim"));
  o = {};
  CHECK_THROWS_WITH(gradapt::shampoo_plan(std::vector<std::int64_t>{4, -6}, o), Contains("extent -6"));
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{4, 6}, o).merged == std::vector<std::int64_t>{24});
  // scalable_shampoo's documented examples of merge_small_dims (max_dim 1024).
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{2, 512, 1, 2048}, o).merged ==
        std::vector<std::int64_t>{1024, 2048});
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{1, 2, 768, 2048}, o).merged ==
        std::vector<std::int64_t>{2, 768, 2048});
}

TEST_CASE("shampoo: a blocked tensor gives what its blocks give as tensors of their own", "[shampoo]") {
  // [6, 7] with blocks of 4: [0,4)x[0,4), [0,4)x[4,7), [4,6)x[0,4), [4,6)x[4,7).
  for (auto graft : {shampoo_graft::adagrad, shampoo_graft::adam, shampoo_graft::none}) {
    shampoo_options o;
    o.lr = 0.1;
    o.max_preconditioner_dim = 4;
    o.merge_small_dims = false;
    o.graft = graft;
    o.momentum = 0.5;
    o.start_preconditioning_step = 2;
    const shampoo opt(o);
    one_tensor big({6, 7});
    set(big.p, normal_vector<double>(42, 1));
    auto sb = opt.init(backend, big.params);
    REQUIRE(sb.preconditioner().layout(0).blocks.size() == 4);
    const std::int64_t r0[4] = {0, 0, 4, 4}, c0[4] = {0, 4, 0, 4}, rs[4] = {4, 4, 2, 2}, cs[4] = {4, 3, 4, 3};
    std::vector<double> pv[4], gv[4];
    gradapt::param_list<double> parts;
    for (int j = 0; j < 4; ++j) {
      pv[j].resize(std::size_t(rs[j] * cs[j]));
      gv[j].resize(pv[j].size());
      for (std::int64_t i = 0; i < rs[j]; ++i)
        for (std::int64_t k = 0; k < cs[j]; ++k)
          pv[j][std::size_t(i * cs[j] + k)] = big.p[std::size_t((r0[j] + i) * 7 + c0[j] + k)];
      parts.add("b" + std::to_string(j), tensor_view<double>(pv[j].data(), {rs[j], cs[j]}),
                tensor_view<double>(gv[j].data(), {rs[j], cs[j]}));
    }
    auto sp = opt.init(backend, parts);
    for (int step = 0; step < 4; ++step) {
      set(big.g, normal_vector<double>(42, 100 + unsigned(step)));
      for (int j = 0; j < 4; ++j)
        for (std::int64_t i = 0; i < rs[j]; ++i)
          for (std::int64_t k = 0; k < cs[j]; ++k)
            gv[j][std::size_t(i * cs[j] + k)] = big.g[std::size_t((r0[j] + i) * 7 + c0[j] + k)];
      opt.step(backend, big.params, sb);
      opt.step(backend, parts, sp);
      for (int j = 0; j < 4; ++j)
        for (std::int64_t i = 0; i < rs[j]; ++i)
          for (std::int64_t k = 0; k < cs[j]; ++k)
            REQUIRE(pv[j][std::size_t(i * cs[j] + k)] == big.p[std::size_t((r0[j] + i) * 7 + c0[j] + k)]);
    }
  }
}

// ---- 3. diagonal fallback -------------------------------------------------------------------

TEST_CASE("shampoo: 1-D and over-large tensors take the grafted AdaGrad or Adam step", "[shampoo]") {
  for (auto graft :
       {shampoo_graft::adagrad, shampoo_graft::adam, shampoo_graft::rmsprop, shampoo_graft::sgd}) {
    shampoo_options o;
    o.lr = 0.01;
    o.graft = graft;
    o.graft_beta2 = 0.9;
    o.graft_epsilon = 1e-8;
    o.skip_preconditioning_dim_size_gt = 8;
    gradapt::param_list<double> params;
    std::vector<double> p1(10, 0.5), g1(10), p2(3 * 9, -0.25), g2(27);
    params.add("bias", gradapt::host_view(p1), gradapt::host_view(g1));
    params.add("wide", tensor_view<double>(p2.data(), {3, 9}), tensor_view<double>(g2.data(), {3, 9}));
    const shampoo opt(o);
    auto st = opt.init(backend, params);
    CHECK(st.preconditioner().layout(0).diagonal);
    CHECK(st.preconditioner().layout(1).diagonal);
    std::vector<ld> rp(37), ra(37, 0);
    for (std::size_t i = 0; i < 10; ++i) rp[i] = 0.5L;
    for (std::size_t i = 10; i < 37; ++i) rp[i] = -0.25L;
    for (int t = 1; t <= 5; ++t) {
      set(g1, normal_vector<double>(10, unsigned(t)));
      set(g2, normal_vector<double>(27, 50 + unsigned(t)));
      opt.step(backend, params, st);
      for (std::size_t i = 0; i < 37; ++i) {
        const ld g = i < 10 ? g1[i] : g2[i - 10];
        ld d = g;
        const ld b = 0.9L, eps = 1e-8L;
        if (graft == shampoo_graft::adagrad) ra[i] += g * g, d = g / (std::sqrt(ra[i]) + eps);
        if (graft == shampoo_graft::rmsprop)
          ra[i] = b * ra[i] + (1 - b) * g * g, d = g / (std::sqrt(ra[i]) + eps);
        if (graft == shampoo_graft::adam)
          ra[i] = b * ra[i] + (1 - b) * g * g, d = g / (std::sqrt(ra[i] / (1 - std::pow(b, ld(t)))) + eps);
        rp[i] -= 0.01L * d;
        const double got = i < 10 ? p1[i] : p2[i - 10];
        REQUIRE(std::fabs(double(rp[i]) - got) <= 1e-14 * (1 + std::fabs(got)));
      }
    }
  }
}

// ---- 4. grafting norms ----------------------------------------------------------------------

TEST_CASE("shampoo: each block's direction has the grafted method's norm", "[shampoo]") {
  for (auto graft :
       {shampoo_graft::sgd, shampoo_graft::adagrad, shampoo_graft::rmsprop, shampoo_graft::adam}) {
    shampoo_options o;
    o.max_preconditioner_dim = 4;
    o.merge_small_dims = false;
    o.graft = graft;
    o.graft_beta2 = 0.95;
    o.graft_epsilon = 1e-6;
    one_tensor t({6, 7});
    const shampoo opt(o);
    auto st = opt.init(backend, t.params);
    std::vector<ld> a(42, 0);
    for (int step = 1; step <= 3; ++step) {
      set(t.g, normal_vector<double>(42, 7 + unsigned(step), 0.1 * step));
      opt.step(backend, t.params, st);
      std::vector<ld> dg(42);
      for (std::size_t i = 0; i < 42; ++i) {
        const ld g = t.g[i], b = 0.95L, eps = 1e-6L;
        dg[i] = g;
        if (graft == shampoo_graft::adagrad) a[i] += g * g, dg[i] = g / (std::sqrt(a[i]) + eps);
        if (graft == shampoo_graft::rmsprop)
          a[i] = b * a[i] + (1 - b) * g * g, dg[i] = g / (std::sqrt(a[i]) + eps);
        if (graft == shampoo_graft::adam)
          a[i] = b * a[i] + (1 - b) * g * g,
          dg[i] = g / (std::sqrt(a[i] / (1 - std::pow(b, ld(step)))) + eps);
      }
      const auto dir = st.preconditioner().direction(0);
      for (std::size_t j = 0; j < 4; ++j) {
        const auto blk = st.preconditioner().block(0, j);
        REQUIRE(blk.ready);
        ld want = 0, got = 0, plain = 0;
        for (std::int64_t i = 0; i < blk.range.size[0]; ++i)
          for (std::int64_t k = 0; k < blk.range.size[1]; ++k) {
            const std::size_t e = std::size_t((blk.range.offset[0] + i) * 7 + blk.range.offset[1] + k);
            want += dg[e] * dg[e];
            got += ld(dir[e]) * ld(dir[e]);
            plain += (ld(dir[e]) - dg[e]) * (ld(dir[e]) - dg[e]);
          }
        CHECK(std::sqrt(got) == Approx(double(std::sqrt(want))).epsilon(1e-12));
        CHECK(plain > 1e-6 * want);  // the direction is Shampoo's, not the graft's
      }
    }
  }
}

// ---- 5. before start_preconditioning_step ---------------------------------------------------

TEST_CASE("shampoo: before start_preconditioning_step the step is the grafted method's", "[shampoo]") {
  shampoo_options o;
  o.lr = 0.05;
  o.graft = shampoo_graft::adam;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  o.start_preconditioning_step = 4;
  o.max_preconditioner_dim = 4;
  shampoo_options diag = o;
  diag.skip_preconditioning_dim_size_gt = 1;  // every tensor diagonal: the grafted optimizer
  one_tensor a({6, 5}), b({6, 5});
  set(a.p, normal_vector<double>(30, 3));
  set(b.p, a.p);
  const shampoo sa(o), sb(diag);
  auto st_a = sa.init(backend, a.params);
  auto st_b = sb.init(backend, b.params);
  REQUIRE(!st_a.preconditioner().layout(0).diagonal);
  REQUIRE(st_b.preconditioner().layout(0).diagonal);
  for (int t = 1; t <= 4; ++t) {
    set(a.g, normal_vector<double>(30, 40 + unsigned(t)));
    set(b.g, a.g);
    sa.step(backend, a.params, st_a);
    sb.step(backend, b.params, st_b);
    if (t < 4) {
      REQUIRE(std::memcmp(a.p.data(), b.p.data(), 30 * sizeof(double)) == 0);
      CHECK(!st_a.preconditioner().block(0, 0).ready);
      CHECK(st_a.preconditioner().statistic(0, 0, 0)[0] > 0);  // statistics accumulate from step 1
    } else {
      CHECK(st_a.preconditioner().block(0, 0).ready);
      CHECK(std::memcmp(a.p.data(), b.p.data(), 30 * sizeof(double)) != 0);
    }
  }
}

// ---- 6. failures ----------------------------------------------------------------------------

TEST_CASE("shampoo: a NaN gradient keeps the previous roots, counts, and throws after N in a row",
          "[shampoo]") {
  shampoo_options o;
  o.graft = shampoo_graft::sgd;
  o.max_consecutive_failures = 3;
  o.merge_small_dims = false;  // [4, 4] keeps L and R (merged it would be one 16 × 16 factor)
  one_tensor t({4, 4});
  const shampoo opt(o);
  auto st = opt.init(backend, t.params);
  st.set_check_interval(0);  // the chain's own check would stop at the first NaN parameter
  for (int s = 0; s < 2; ++s) {
    set(t.g, normal_vector<double>(16, 60 + unsigned(s)));
    opt.step(backend, t.params, st);
  }
  const std::vector<double> l0(st.preconditioner().root(0, 0, 0).begin(),
                               st.preconditioner().root(0, 0, 0).end());
  const std::vector<double> r0(st.preconditioner().root(0, 0, 1).begin(),
                               st.preconditioner().root(0, 0, 1).end());
  set(t.g, normal_vector<double>(16, 70));
  t.g[5] = std::numeric_limits<double>::quiet_NaN();
  nan_step([&] { opt.step(backend, t.params, st); });
  CHECK(std::equal(l0.begin(), l0.end(), st.preconditioner().root(0, 0, 0).begin()));
  CHECK(std::equal(r0.begin(), r0.end(), st.preconditioner().root(0, 0, 1).begin()));
  CHECK(st.preconditioner().block(0, 0).failures == 1);
  CHECK(st.preconditioner().block(0, 0).consecutive_failures == 1);
  set(t.g, normal_vector<double>(16, 71));
  nan_step([&] { opt.step(backend, t.params, st); });  // the summed statistic stays NaN
  CHECK(st.preconditioner().block(0, 0).consecutive_failures == 2);
  const std::vector<double> before = t.p;
  set(t.g, normal_vector<double>(16, 72));
  REQUIRE_THROWS_WITH(opt.step(backend, t.params, st), Contains("parameter 'w' block 0") &&
                                                           Contains("failed 3 times in a row") &&
                                                           Contains("nonfinite_input"));
  CHECK(std::memcmp(before.data(), t.p.data(), 16 * sizeof(double)) == 0);  // parameters unchanged
  REQUIRE_THROWS_WITH(opt.step(backend, t.params, st), Contains("restore a checkpoint"));
}

TEST_CASE("shampoo: a zero statistic with a relative ridge fails and the block takes the graft",
          "[shampoo]") {
  shampoo_options o;
  o.graft = shampoo_graft::adagrad;
  one_tensor t({3, 4});
  const shampoo opt(o);
  auto st = opt.init(backend, t.params);
  opt.step(backend, t.params, st);  // g = 0: S = 0, λ_max = 0, relative ridge 0: singular
  CHECK(!st.preconditioner().block(0, 0).ready);
  CHECK(st.preconditioner().block(0, 0).failures == 1);
  set(t.g, normal_vector<double>(12, 2));
  opt.step(backend, t.params, st);
  CHECK(st.preconditioner().block(0, 0).ready);
  CHECK(st.preconditioner().block(0, 0).consecutive_failures == 0);
  CHECK(st.preconditioner().block(0, 0).failures == 1);
}

// ---- 7. checkpoints -------------------------------------------------------------------------

TEST_CASE("shampoo: save/load continues bit for bit; bad archives throw and change nothing", "[shampoo]") {
  shampoo_options o;
  o.lr = 0.02;
  o.graft = shampoo_graft::adam;
  o.momentum = 0.9;
  o.max_preconditioner_dim = 4;
  o.precondition_frequency = 2;
  const shampoo opt(o);
  gradapt::param_list<float> params;
  std::vector<float> w(6 * 5), gw(30), bias(5), gb(5);
  params.add("w", tensor_view<float>(w.data(), {6, 5}), tensor_view<float>(gw.data(), {6, 5}));
  params.add("bias", gradapt::host_view(bias), gradapt::host_view(gb));
  auto st = opt.init(backend, params);
  const auto grads = [&](int s) {
    set(gw, normal_vector<float>(30, 200 + unsigned(s)));
    set(gb, normal_vector<float>(5, 300 + unsigned(s)));
  };
  for (int s = 0; s < 3; ++s) {
    grads(s);
    opt.step(backend, params, st);
  }
  const auto bytes = st.save(backend);
  const auto w_saved = w, b_saved = bias;
  for (int s = 3; s < 7; ++s) {
    grads(s);
    opt.step(backend, params, st);
  }
  const auto w_want = w, b_want = bias;

  set(w, w_saved);
  set(bias, b_saved);
  auto st2 = opt.init(backend, params);
  st2.load(backend, bytes);
  CHECK(st2.steps() == 3);
  for (int s = 3; s < 7; ++s) {
    grads(s);
    opt.step(backend, params, st2);
  }
  CHECK(std::memcmp(w.data(), w_want.data(), w.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(bias.data(), b_want.data(), bias.size() * sizeof(float)) == 0);

  auto st3 = opt.init(backend, params);
  const auto fresh = st3.save(backend);
  auto damaged = bytes;
  damaged[damaged.size() / 2] ^= std::byte{0x10};
  CHECK_THROWS_WITH(st3.load(backend, damaged), Contains("checksum"));
  {  // another graft
    shampoo_options og = o;
    og.graft = shampoo_graft::adagrad;
    auto other = shampoo(og).init(backend, params);
    CHECK_THROWS_WITH(other.load(backend, bytes), Contains("graft"));
  }
  {  // other blocks
    shampoo_options ob = o;
    ob.max_preconditioner_dim = 3;
    auto other = shampoo(ob).init(backend, params);
    CHECK_THROWS_WITH(other.load(backend, bytes), Contains("max_preconditioner_dim"));
  }
  {  // another shape
    gradapt::param_list<float> p2;
    std::vector<float> w2(30), g2(30), b2(5), gb2(5);
    p2.add("w", tensor_view<float>(w2.data(), {5, 6}), tensor_view<float>(g2.data(), {5, 6}));
    p2.add("bias", gradapt::host_view(b2), gradapt::host_view(gb2));
    auto other = opt.init(backend, p2);
    CHECK_THROWS_WITH(other.load(backend, bytes), Contains("shape"));
  }
  {  // another name
    gradapt::param_list<float> p2;
    std::vector<float> w2(30), g2(30), b2(5), gb2(5);
    p2.add("v", tensor_view<float>(w2.data(), {6, 5}), tensor_view<float>(g2.data(), {6, 5}));
    p2.add("bias", gradapt::host_view(b2), gradapt::host_view(gb2));
    auto other = opt.init(backend, p2);
    CHECK_THROWS_WITH(other.load(backend, bytes), Contains("no parameter 'v'"));
  }
  {  // a field this state does not read, in the chain's part and in the Shampoo section
    gradapt::archive_writer w{"gradapt.optimizer", 1};
    st.save(backend, w);
    w.put("extra", std::uint64_t{1});
    CHECK_THROWS_WITH(st3.load(backend, w.finish()), Contains("field 'extra' was not read"));
    gradapt::archive_writer w2{"gradapt.optimizer", 1};
    st.save(backend, w2);
    w2.begin("preconditioner");
    w2.put("extra", std::uint64_t{1});
    w2.end();
    CHECK_THROWS_WITH(st3.load(backend, w2.finish()), Contains("Shampoo section holds"));
  }
  CHECK(st3.save(backend) == fresh);  // the failed loads changed nothing
  CHECK_THROWS_WITH(st3.load(backend, std::span<const std::byte>(bytes).first(40)), Contains("archive"));
}

// ---- 8. options -----------------------------------------------------------------------------

TEST_CASE("shampoo: every bit flip is rejected; a statistic no run can produce is named",
          "[shampoo][checkpoint]") {
  shampoo_options o;
  o.lr = 0.02;
  o.max_preconditioner_dim = 4;
  o.beta1 = 0.9;
  const shampoo opt(o);
  gradapt::param_list<float> params;
  std::vector<float> w(6 * 5), gw(30), bias(5), gb(5);
  params.add("w", tensor_view<float>(w.data(), {6, 5}), tensor_view<float>(gw.data(), {6, 5}));
  params.add("bias", gradapt::host_view(bias), gradapt::host_view(gb));
  auto st = opt.init(backend, params);
  for (int s = 0; s < 3; ++s) {
    set(gw, normal_vector<float>(30, 400 + unsigned(s)));
    set(gb, normal_vector<float>(5, 500 + unsigned(s)));
    opt.step(backend, params, st);
  }
  const auto good = st.save(backend);
  const std::size_t n = gradapt_test::flip_every_bit(
      good, [&](std::span<const std::byte> bad) { st.load(backend, bad); }, [&] { return st.save(backend); });
  CHECK(n == gradapt_test::flips_for(good.size()));
  // Behind a valid checksum: the first block's first statistic (4 x 4) made asymmetric.
  const auto stat = st.preconditioner().statistic(0, 0, 0);
  REQUIRE(stat.size() == 16);
  const auto block = std::as_bytes(stat);
  const auto at = std::search(good.begin(), good.end(), block.begin(), block.end());
  REQUIRE(at != good.end());
  std::vector<std::byte> bad = good;
  const float off = stat[1] + 1.0f;
  std::memcpy(bad.data() + (at - good.begin()) + 4, &off, 4);
  gradapt_test::reseal(bad);
  CHECK_THROWS_WITH(st.load(backend, bad),
                    Contains("the statistic 0 of parameter 'w' (block 0) is not symmetric"));
  CHECK(st.save(backend) == good);
}

TEST_CASE("shampoo: every invalid option throws naming it", "[shampoo]") {
  const std::vector<std::pair<std::function<void(shampoo_options&)>, const char*>> bad = {
      {[](auto& o) { o.lr = -1; }, "lr"},
      {[](auto& o) { o.lr = NAN; }, "lr"},
      {[](auto& o) { o.max_preconditioner_dim = 0; }, "max_preconditioner_dim"},
      {[](auto& o) { o.skip_preconditioning_dim_size_gt = 0; }, "skip_preconditioning_dim_size_gt"},
      {[](auto& o) { o.beta2 = 0; }, "beta2"},
      {[](auto& o) { o.beta2 = 1.5; }, "beta2"},
      {[](auto& o) { o.statistics_frequency = 0; }, "statistics_frequency"},
      {[](auto& o) { o.precondition_frequency = 0; }, "precondition_frequency"},
      {[](auto& o) { o.start_preconditioning_step = 0; }, "start_preconditioning_step"},
      {[](auto& o) { o.inverse_exponent_override = -2; }, "inverse_exponent_override"},
      {[](auto& o) { o.root.method = gradapt::root_method(9); }, "root.method"},
      {[](auto& o) { o.root.ridge = gradapt::ridge_kind(9); }, "root.ridge"},
      {[](auto& o) { o.root.epsilon = -1; }, "root.epsilon"},
      {[](auto& o) { o.root.tolerance = -1; }, "root.tolerance"},
      {[](auto& o) { o.root.max_iterations = 0; }, "root.max_iterations"},
      {[](auto& o) { o.root.max_error_ratio = 0.5; }, "root.max_error_ratio"},
      {[](auto& o) { o.root.max_error = 0; }, "root.max_error"},
      {[](auto& o) { o.root.power_iterations = 0; }, "root.power_iterations"},
      {[](auto& o) { o.root.power_tolerance = -1; }, "root.power_tolerance"},
      {[](auto& o) { o.max_consecutive_failures = 0; }, "max_consecutive_failures"},
      {[](auto& o) { o.graft = shampoo_graft(17); }, "graft"},
      {[](auto& o) { o.graft_beta2 = 1; }, "graft_beta2"},
      {[](auto& o) { o.graft_epsilon = 0; }, "graft_epsilon"},
      {[](auto& o) { o.momentum = 1.5; }, "momentum"},
      {[](auto& o) { o.nesterov = true; }, "nesterov"},
      {[](auto& o) { o.weight_decay = -1; }, "weight_decay"},
      {[](auto& o) { o.beta1 = 1; }, "beta1 is 1"},
      {[](auto& o) { o.beta1 = -0.5; }, "beta1 is -0.5"},
      {[](auto& o) { o.merge_from = gradapt::shampoo_merge(7); }, "merge_from is 7"},
      {[](auto& o) { o.spectrum = gradapt::shampoo_spectrum(7); }, "spectrum is 7"},
      {[](auto& o) {
         o.spectrum = gradapt::shampoo_spectrum::shift;
         o.root.method = gradapt::root_method::coupled_newton;
       },
       "spectrum is shift but root.method is coupled_newton"},
      {[](auto& o) {
         o.inverse_exponents = {{0, -1, 2}};
       },
       "inverse_exponents[0].order is 0"},
      {[](auto& o) {
         o.inverse_exponents = {{2, 2, 2}};
       },
       "inverse_exponents[0].dimension is 2"},
      {[](auto& o) {
         o.inverse_exponents = {{2, -1, -3}};
       },
       "inverse_exponents[0].p is -3"},
      {[](auto& o) {
         o.inverse_exponents = {{2, 1, 2}, {3, 1, 2}, {2, 1, 4}};
       },
       "inverse_exponents[2] repeats order 2 dimension 1"},
  };
  for (const auto& [change, name] : bad) {
    shampoo_options o;
    change(o);
    INFO(name);
    CHECK_THROWS_WITH(shampoo(o), Contains(std::string("shampoo: ") + name));
  }
  CHECK_NOTHROW(shampoo({}));
  // A step's learning rate and a list that does not fit the state.
  one_tensor t({3, 3});
  const shampoo opt({});
  auto st = opt.init(backend, t.params);
  CHECK_THROWS_WITH(opt.step(backend, t.params, st, {.lr = -0.1}), Contains("learning rate"));
  one_tensor u({3, 4});
  CHECK_THROWS_WITH(opt.step(backend, u.params, st), Contains("create the state with init()"));
  CHECK(st.steps() == 0);
}

// ---- 10. Distributed Shampoo's options (the trajectories are in test_shampoo_refs.cpp) -------

TEST_CASE("shampoo: precondition_1d, merge_from, exponent map and the preset's plan", "[shampoo]") {
  shampoo_options o;
  o.max_preconditioner_dim = 16;
  const std::int64_t bias[] = {24}, scalar[] = {1, 1}, conv[] = {8, 4, 3, 3};
  CHECK(gradapt::shampoo_plan(bias, o).diagonal);
  o.precondition_1d = true;
  const auto b = gradapt::shampoo_plan(bias, o);
  REQUIRE(!b.diagonal);
  CHECK(b.merged == std::vector<std::int64_t>{24});
  CHECK(b.blocks.size() == 2);  // 16 + 8
  CHECK(gradapt::shampoo_plan(scalar, o).merged == std::vector<std::int64_t>{1});
  CHECK(gradapt::shampoo_plan(conv, o).merged == std::vector<std::int64_t>{8, 12, 3});
  o.merge_from = gradapt::shampoo_merge::last;
  CHECK(gradapt::shampoo_plan(conv, o).merged == std::vector<std::int64_t>{8, 4, 9});
  // The map: order 3 dimension 0 unpreconditioned (identity root, no statistic), dimension 1 at
  // p = 4, dimension 2 the order's default 6; order 2 at p = 2 everywhere.
  o.merge_small_dims = false;
  o.inverse_exponents = {{3, 0, 0}, {3, 1, 4}, {2, -1, 2}};
  one_tensor t({3, 4, 5});
  one_tensor m({4, 6});
  const shampoo opt(o);
  auto st = opt.init(backend, t.params);
  auto sm = opt.init(backend, m.params);
  CHECK(st.preconditioner().block(0, 0).exponents[0] == 0);
  CHECK(st.preconditioner().block(0, 0).exponents[1] == 4);
  CHECK(st.preconditioner().block(0, 0).exponents[2] == 6);
  CHECK(sm.preconditioner().block(0, 0).exponents[0] == 2);
  CHECK(sm.preconditioner().block(0, 0).exponents[1] == 2);
  set(t.g, normal_vector<double>(60, 5));
  const auto report = opt.step(backend, t.params, st);
  CHECK(report.step == 1);
  CHECK(report.roots_installed == 1);
  CHECK(report.root_failures.empty());
  for (const double v : st.preconditioner().statistic(0, 0, 0)) CHECK(v == 0.0);
  const auto r0 = st.preconditioner().root(0, 0, 0);
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j) CHECK(r0[i * 3 + j] == (i == j ? 1.0 : 0.0));
  // The preset: the peer's defaults (the trajectory is the distributed_shampoo_defaults case).
  const auto d = gradapt::distributed_shampoo_defaults();
  CHECK_NOTHROW(shampoo(d));
  CHECK(d.beta1 == 0.9);
  CHECK(d.bias_correction);
  CHECK(d.precondition_1d);
  CHECK(d.merge_from == gradapt::shampoo_merge::last);
  CHECK(d.spectrum == gradapt::shampoo_spectrum::shift);
  CHECK(d.root.epsilon == 1e-12);
  CHECK(d.graft == shampoo_graft::none);
}

TEST_CASE("shampoo: beta1 preconditions the bias-corrected first moment", "[shampoo]") {
  // One 1-D tensor with precondition_1d and graft none: the direction is (S + r)^(-1/2)·m̂ with
  // S = Σ g gᵀ; at step 1, m̂ = g (bias-corrected) and without correction m = (1 − β1)·g.
  shampoo_options o = exact_options();
  o.precondition_1d = true;
  o.beta1 = 0.9;
  o.root.epsilon = 0.5;
  one_tensor t({3});
  t.g = {1.0, 2.0, 2.0};  // |g|² = 9: S = g gᵀ, eigenvalues 9, 0, 0
  std::vector<double> want(3);
  for (int i = 0; i < 3; ++i) want[std::size_t(i)] = -t.g[std::size_t(i)] / std::sqrt(9.5);
  for (const bool corrected : {true, false}) {
    o.bias_correction = corrected;
    std::fill(t.p.begin(), t.p.end(), 0.0);
    const shampoo opt(o);
    auto st = opt.init(backend, t.params);
    opt.step(backend, t.params, st);
    for (std::size_t i = 0; i < 3; ++i) {
      INFO("bias_correction " << corrected << " element " << i);
      const double w = corrected ? want[i] : 0.1 * want[i];
      CHECK(std::fabs(t.p[i] - w) <= 1e-12 * std::fabs(w));
      CHECK(std::fabs(st.preconditioner().first_moment(0)[i] - 0.1 * t.g[i]) <= 1e-15);
    }
  }
}

TEST_CASE("shampoo: the shifted spectrum raises every eigenvalue by -lambda_min", "[shampoo]") {
  // S = diag(4, 1, -1e-3) is what rounding can make of a rank-deficient factor. With r = 1e-2:
  // clamp: (max(λ, 0) + r)^(-1/2); shift (the peer's): eig(S + r·I) = (4 + r, 1 + r, r − 1e-3),
  // whose minimum is below r, so every eigenvalue rises by 1e-3: (λ + 1e-3 + r)^(-1/2).
  const std::vector<double> s3 = {4, 0, 0, 0, 1, 0, 0, 0, -1e-3};
  const int p[1] = {2};
  const std::int64_t n[1] = {3};
  const std::size_t off[1] = {0};
  for (const auto spectrum : {gradapt::shampoo_spectrum::clamp, gradapt::shampoo_spectrum::shift}) {
    gradapt::detail::shampoo_impl::root_recipe rc;
    rc.root.ridge = gradapt::ridge_kind::absolute;
    rc.root.epsilon = 1e-2;
    rc.spectrum = spectrum;
    gradapt::detail::shampoo_impl::root_workspace<host_lapack, double> ws(la, 3);
    std::vector<double> x(9), staging;
    const gradapt::host one{.threads = 1};
    const auto [status, factor] = gradapt::detail::shampoo_impl::block_roots(
        la, one, 1, p, n, off, s3.data(), x.data(), [&](std::int64_t) -> auto& { return ws; }, rc, 1.0,
        staging);
    REQUIRE(status == gradapt::root_status::ok);
    const double up = spectrum == gradapt::shampoo_spectrum::shift ? 1e-3 : 0.0;
    // The third: clamp max(−1e-3, 0) + r, shift −1e-3 + 1e-3 + r: r either way.
    const double want[3] = {1 / std::sqrt(4 + up + 1e-2), 1 / std::sqrt(1 + up + 1e-2), 1 / std::sqrt(1e-2)};
    for (std::size_t i = 0; i < 3; ++i) {
      INFO("spectrum " << to_string(spectrum) << " eigenvalue " << i);
      CHECK(std::fabs(x[i * 3 + i] - want[i]) <= 1e-12 * want[i]);
    }
    // The bias divisor: the statistics divided by 2 give the root of S / 2.
    const auto [st2, f2] = gradapt::detail::shampoo_impl::block_roots(
        la, one, 1, p, n, off, s3.data(), x.data(), [&](std::int64_t) -> auto& { return ws; }, rc, 2.0,
        staging);
    REQUIRE(st2 == gradapt::root_status::ok);
    CHECK(std::fabs(x[0] - 1 / std::sqrt(2 + up / 2 + 1e-2)) <= 1e-12);
    (void)factor;
    (void)f2;
  }
}

TEST_CASE("shampoo: a failed root is in the step's report as it happens", "[shampoo]") {
  // Coupled Newton allowed one iteration and an error of 1e-12: every root computation fails
  // (not_converged) while everything stays finite; the block takes the graft.
  shampoo_options o;
  o.graft = shampoo_graft::sgd;
  o.max_consecutive_failures = 3;
  o.merge_small_dims = false;
  o.root.method = gradapt::root_method::coupled_newton;
  o.root.max_iterations = 1;
  o.root.max_error = 1e-12;
  one_tensor t({4, 4}), u({3, 5}, "u");
  gradapt::param_list<double> both;
  both.add("w", tensor_view<double>(t.p.data(), {4, 4}), tensor_view<double>(t.g.data(), {4, 4}));
  both.add("u", tensor_view<double>(u.p.data(), {3, 5}), tensor_view<double>(u.g.data(), {3, 5}));
  const shampoo opt(o);
  auto st = opt.init(backend, both);
  for (std::uint64_t k = 1; k <= 2; ++k) {
    set(t.g, normal_vector<double>(16, 60 + unsigned(k)));
    set(u.g, normal_vector<double>(15, 80 + unsigned(k)));
    const auto r = opt.step(backend, both, st);
    CHECK(r.step == k);
    CHECK(r.roots_installed == 0);
    REQUIRE(r.root_failures.size() == 2);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto& f = r.root_failures[i];
      CHECK(f.block == i);
      CHECK(f.tensor == i);
      CHECK(f.tensor_block == 0);
      CHECK(f.factor == 0);
      CHECK(f.reason == gradapt::root_status::not_converged);
      CHECK(f.consecutive == k);
      CHECK(f.failures == k);
      CHECK(f.rank == -1);
      CHECK(f.step == k);
    }
    for (const double v : t.p) CHECK(std::isfinite(v));
  }
  CHECK_THROWS_WITH(opt.step(backend, both, st),
                    Contains("failed 3 times in a row") && Contains("not_converged"));
}

TEST_CASE("shampoo: a checkpoint does not load into a state with other shaping options", "[shampoo]") {
  shampoo_options o;
  o.beta1 = 0.9;
  o.bias_correction = true;
  o.precondition_1d = true;
  o.max_preconditioner_dim = 4;
  const auto run = [](const shampoo_options& opts, one_tensor<float>& w, int steps) {
    const shampoo opt(opts);
    auto st = opt.init(backend, w.params);
    for (int s = 0; s < steps; ++s) {
      set(w.g, normal_vector<float>(w.g.size(), 400 + unsigned(s)));
      opt.step(backend, w.params, st);
    }
    return st;
  };
  one_tensor<float> w({6, 5});
  const auto st = run(o, w, 3);
  const auto bytes = st.save(backend);
  const auto p_saved = w.p;
  {  // continues bit for bit, the first moment included
    auto st_more = run(o, w, 0);
    st_more.load(backend, bytes);
    CHECK(std::equal(st.preconditioner().first_moment(0).begin(), st.preconditioner().first_moment(0).end(),
                     st_more.preconditioner().first_moment(0).begin()));
  }
  const std::vector<std::pair<std::function<void(shampoo_options&)>, const char*>> other = {
      {[](auto& x) { x.beta1 = 0.8; }, "beta1"},
      {[](auto& x) { x.beta1 = 0; }, "beta1"},
      {[](auto& x) { x.bias_correction = false; }, "bias_correction"},
      {[](auto& x) { x.spectrum = gradapt::shampoo_spectrum::shift; }, "spectrum"},
      {[](auto& x) {
         x.inverse_exponents = {{2, 1, 2}};
       },
       "root exponents"},
  };
  for (const auto& [change, what] : other) {
    auto x = o;
    change(x);
    INFO(what);
    one_tensor<float> v({6, 5});
    auto st2 = run(x, v, 0);
    const auto fresh = st2.save(backend);
    CHECK_THROWS_WITH(st2.load(backend, bytes), Contains(what));
    CHECK(st2.save(backend) == fresh);
  }
  {  // precondition_1d changes a 1-D tensor's layout
    auto x = o;
    x.precondition_1d = false;
    one_tensor<float> b({5}, "b");
    auto sb = run(o, b, 1);
    const auto bb = sb.save(backend);
    one_tensor<float> c({5}, "b");
    auto sc = run(x, c, 0);
    CHECK_THROWS_WITH(sc.load(backend, bb), Contains("precondition_1d"));
  }
}

// ---- 9. convergence -------------------------------------------------------------------------

TEST_CASE("shampoo: an ill-conditioned quadratic converges in far fewer steps than grafted SGD",
          "[shampoo]") {
  // f(W) = ½ tr((W − W*)ᵀ A (W − W*) B), ∇f = A (W − W*) B, A and B SPD with spectra
  // 1..100 (rotated): the Hessian A ⊗ B has condition number 10⁴. Measured with OpenBLAS:
  // SGD 6595 steps, Shampoo 524 (a ratio of 12.6; the check asks for 5).
  const std::size_t n = 8;
  const auto spd = [&](unsigned seed) {
    std::vector<ld> q, w;
    auto m = normal_vector<double>(n * n, seed);
    std::vector<ld> s(n * n);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) s[i * n + j] = ld(m[i * n + j]) + ld(m[j * n + i]);
    jacobi_eigen(s, n, q, w);  // a random orthogonal Q
    std::vector<double> a(n * n, 0);
    for (std::size_t k = 0; k < n; ++k) {
      const ld lam = std::pow(100.0L, ld(k) / ld(n - 1));
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j) a[i * n + j] += double(q[i * n + k] * lam * q[j * n + k]);
    }
    for (std::size_t i = 0; i < n; ++i)  // exactly symmetric
      for (std::size_t j = 0; j < i; ++j) a[i * n + j] = a[j * n + i];
    return a;
  };
  const auto A = spd(1), B = spd(2);
  const auto wstar = normal_vector<double>(n * n, 3);
  // Steps to f <= 1e-6·f(W0) from W0 = 0, or `cap` + 1 (diverged, or not there in `cap` steps).
  const auto run = [&](shampoo_options o, double lr, int cap) {
    o.lr = lr;
    one_tensor t({std::int64_t(n), std::int64_t(n)});
    const shampoo opt(o);
    auto st = opt.init(backend, t.params);
    double f0 = -1;
    std::vector<double> e(n * n), ae(n * n);
    for (int s = 0; s <= cap; ++s) {
      for (std::size_t i = 0; i < n * n; ++i) e[i] = t.p[i] - wstar[i];
      std::fill(ae.begin(), ae.end(), 0.0);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t k = 0; k < n; ++k)
          for (std::size_t j = 0; j < n; ++j) ae[i * n + j] += A[i * n + k] * e[k * n + j];
      std::fill(t.g.begin(), t.g.end(), 0.0);
      double f = 0;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t k = 0; k < n; ++k)
          for (std::size_t j = 0; j < n; ++j) t.g[i * n + j] += ae[i * n + k] * B[k * n + j];
      for (std::size_t i = 0; i < n * n; ++i) f += 0.5 * e[i] * t.g[i];
      if (f0 < 0) f0 = f;
      if (f <= 1e-6 * f0) return s;
      if (!(f < 1e6 * f0)) return cap + 1;  // diverged
      try {
        opt.step(backend, t.params, st);
      } catch (const gradapt::error&) {  // roots failing on an overflowed statistic
        return cap + 1;
      }
    }
    return cap + 1;
  };
  // Each method at its best learning rate on the grid 2^0 .. 2^-16 (measured here, so neither
  // is handicapped by a hand-picked rate); a run stops once it is slower than the best so far.
  const auto best = [&](const shampoo_options& o) {
    int steps = 40000;
    for (int k = 0; k <= 16; ++k) steps = std::min(steps, run(o, std::ldexp(1.0, -k), steps));
    return steps;
  };
  shampoo_options sgd_o;  // the grafted method alone: SGD
  sgd_o.graft = shampoo_graft::sgd;
  sgd_o.start_preconditioning_step = std::numeric_limits<std::uint64_t>::max();
  shampoo_options sh_o;  // Shampoo's own step (no graft), summed statistics
  sh_o.graft = shampoo_graft::none;
  sh_o.merge_small_dims = false;  // L (8 × 8) and R (8 × 8), not one 64 × 64 factor
  const int sgd_steps = best(sgd_o);
  const int shampoo_steps = best(sh_o);
  INFO("grafted SGD: " << sgd_steps << " steps, Shampoo: " << shampoo_steps << " steps");
  CHECK(sgd_steps < 40000);
  CHECK(shampoo_steps * 5 < sgd_steps);
}

// ---- composition with the parameter list and the backend ------------------------------------

TEST_CASE("shampoo: groups, 16-bit gradients, moved buffers and thread counts", "[shampoo]") {
  shampoo_options o;
  o.lr = 0.1;
  o.graft = shampoo_graft::adam;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  o.max_preconditioner_dim = 4;
  const shampoo opt(o);
  const auto grads = [](int s) { return normal_vector<float>(30, 500 + unsigned(s)); };
  // Reference: float gradients, one thread.
  std::vector<float> w0(30, 0.5f), g0(30), b0(3, 0.25f), gb0(3, 0.f);
  gradapt::param_list<float> ref;
  ref.add("w", tensor_view<float>(w0.data(), {6, 5}), tensor_view<float>(g0.data(), {6, 5}));
  const auto frozen = ref.add_group("frozen", {.lr_scale = 0.0, .weight_decay = std::nullopt});
  ref.add("b", gradapt::host_view(b0), gradapt::host_view(gb0), {}, frozen);
  auto sr = opt.init(backend, ref);
  // The same with bfloat16 gradients (values exactly representable), two threads, and value
  // buffers that move after init.
  std::vector<float> w1(30, 0.5f), w2(30), b1(3, 0.25f), b2(3);
  std::vector<gradapt::bfloat16> g1(30), gb1(3, gradapt::bfloat16(0.f));
  const auto list_over = [&](std::vector<float>& w, std::vector<float>& b) {
    gradapt::param_list<float, gradapt::bfloat16> l;
    l.add("w", tensor_view<float>(w.data(), {6, 5}), tensor_view<gradapt::bfloat16>(g1.data(), {6, 5}));
    const auto f = l.add_group("frozen", {.lr_scale = 0.0, .weight_decay = std::nullopt});
    l.add("b", gradapt::host_view(b), gradapt::host_view(gb1), {}, f);
    return l;
  };
  const host two{.threads = 2};
  auto l1 = list_over(w1, b1);
  auto s1 = opt.init(two, l1);
  for (int s = 0; s < 4; ++s) {
    const auto g = grads(s);
    for (std::size_t i = 0; i < 30; ++i) {
      g1[i] = gradapt::bfloat16(g[i]);
      g0[i] = static_cast<float>(g1[i]);  // the same values in float
    }
    opt.step(backend, ref, sr);
    if (s < 2) {
      opt.step(two, l1, s1);
    } else {  // the framework moved its value buffers: a list over the new ones
      if (s == 2) w2 = w1, b2 = b1;
      auto l2 = list_over(w2, b2);
      opt.step(two, l2, s1);
    }
    const auto& w = s < 2 ? w1 : w2;
    REQUIRE(std::memcmp(w.data(), w0.data(), 30 * sizeof(float)) == 0);
  }
  CHECK(b0 == std::vector<float>(3, 0.25f));  // lr_scale 0: unchanged (its weight decay too)
  CHECK(b2 == std::vector<float>(3, 0.25f));
}

// ---- 11. the family: eigenvalue-corrected (SOAP) and spectral descent (Muon) -------------------

// A two-tensor model (a [6, 5] matrix and a [5] bias) stepped with `o` for `steps` steps.
struct family_model {
  std::vector<double> w = std::vector<double>(30, 0.1), gw = std::vector<double>(30),
                      b = std::vector<double>(5, 0.0), gb = std::vector<double>(5);
  gradapt::param_list<double> params;
  family_model() {
    params.add("w", tensor_view<double>(w.data(), {6, 5}), tensor_view<double>(gw.data(), {6, 5}));
    params.add("bias", gradapt::host_view(b), gradapt::host_view(gb));
  }
  void grads(int s) {
    set(gw, normal_vector<double>(30, 900 + unsigned(s)));
    set(gb, normal_vector<double>(5, 950 + unsigned(s)));
  }
};

shampoo_options soap_options(gradapt::shampoo_eigenbasis basis) {
  shampoo_options o = gradapt::soap_defaults();
  o.eigenbasis = basis;
  o.lr = 0.01;
  o.beta2 = 0.99;
  o.root.epsilon = 1e-8;
  o.precondition_frequency = 2;
  o.merge_small_dims = false;  // [6, 5] keeps two factors
  return o;
}

TEST_CASE("shampoo family: SOAP's first step is Adam's in the identity basis; a refresh gives the eigenbasis",
          "[shampoo][family]") {
  for (const auto basis : {gradapt::shampoo_eigenbasis::eigh, gradapt::shampoo_eigenbasis::qr}) {
    INFO(to_string(basis));
    shampoo_options o = soap_options(basis);
    o.start_preconditioning_step = 3;  // the bases stay the identity for steps 1 and 2
    o.precondition_frequency = 3;
    o.beta1 = 0.0;
    family_model m;
    const shampoo opt(o);
    auto st = opt.init(backend, m.params);
    m.grads(1);
    const std::vector<double> w0 = m.w;
    opt.step(backend, m.params, st);
    // Step 1: V = (1 − β2)·g², c = 1 − β2, D = g / (√(V / c) + ε) = g / (|g| + ε): the identity basis.
    for (std::size_t i = 0; i < 30; ++i) {
      const double g = m.gw[i];
      CHECK(m.w[i] == Approx(w0[i] - 0.01 * g / (std::abs(g) + 1e-8)).epsilon(1e-12));
    }
    m.grads(2);
    opt.step(backend, m.params, st);
    m.grads(3);
    opt.step(backend, m.params, st);  // refresh: Q_d from S_d / (1 − β2³) + εI
    const auto& pre = st.preconditioner();
    for (std::size_t d = 0; d < 2; ++d) {
      const auto s = pre.statistic(0, 0, d), q = pre.root(0, 0, d);
      const std::size_t n = d == 0 ? 6 : 5;
      // QᵀSQ is diagonal (eigh: exactly up to rounding; one QR step from the identity: only
      // nearly, so check orthogonality there) and Q is orthogonal.
      double off = 0, all = 0, orth = 0;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          double qsq = 0, qq = 0;
          for (std::size_t a = 0; a < n; ++a) {
            qq += q[a * n + i] * q[a * n + j];
            for (std::size_t b = 0; b < n; ++b) qsq += q[a * n + i] * s[a * n + b] * q[b * n + j];
          }
          all += qsq * qsq;
          if (i != j) off += qsq * qsq;
          orth = std::max(orth, std::abs(qq - (i == j ? 1.0 : 0.0)));
        }
      CHECK(orth < 1e-12);
      if (basis == gradapt::shampoo_eigenbasis::eigh) CHECK(std::sqrt(off / all) < 1e-12);
    }
  }
}

TEST_CASE("shampoo family: spectral descent's direction is the block's Newton–Schulz orthogonalization",
          "[shampoo][family]") {
  shampoo_options o = gradapt::spectral_descent_defaults();
  o.lr = 0.5;
  o.beta1 = 0.0;
  o.scale_by_aspect = true;
  family_model m;
  const shampoo opt(o);
  auto st = opt.init(backend, m.params);
  CHECK(!st.preconditioner().layout(0).diagonal);
  CHECK(st.preconditioner().layout(1).diagonal);  // the bias: the graft (none: the gradient)
  m.grads(1);
  const std::vector<double> w0 = m.w, b0 = m.b;
  std::vector<double> x = m.gw, ws(gradapt::newton_schulz_workspace(6, 5));
  gradapt::newton_schulz(la, gradapt::host{.threads = 1}, tensor_view<double>(x.data(), {6, 5}),
                         tensor_view<double>::vector(ws.data(), std::int64_t(ws.size())), o.newton_schulz);
  opt.step(backend, m.params, st);
  const double aspect = std::sqrt(6.0 / 5.0);
  for (std::size_t i = 0; i < 30; ++i) CHECK(m.w[i] == Approx(w0[i] - 0.5 * aspect * x[i]).epsilon(1e-12));
  for (std::size_t i = 0; i < 5; ++i) CHECK(m.b[i] == Approx(b0[i] - 0.5 * m.gb[i]).epsilon(1e-12));
  // A [6, 5, 4] tensor is merged to [6, 20] (down to two dimensions from the last), a [7] never.
  const auto l3 = gradapt::shampoo_plan(std::vector<std::int64_t>{6, 5, 4}, o);
  CHECK(l3.merged == std::vector<std::int64_t>{6, 20});
  CHECK(gradapt::shampoo_plan(std::vector<std::int64_t>{7}, o).diagonal);
}

TEST_CASE("shampoo family: checkpoints continue bit for bit, every bit flip and a negative V are rejected",
          "[shampoo][family][checkpoint]") {
  for (const int kind : {0, 1, 2}) {
    const shampoo_options o = kind == 0   ? soap_options(gradapt::shampoo_eigenbasis::eigh)
                              : kind == 1 ? soap_options(gradapt::shampoo_eigenbasis::qr)
                                          : gradapt::spectral_descent_defaults();
    INFO("kind " << kind);
    const shampoo opt(o);
    family_model a, b;
    auto sa = opt.init(backend, a.params);
    auto sb = opt.init(backend, b.params);
    for (int s = 1; s <= 3; ++s) {
      a.grads(s);
      opt.step(backend, a.params, sa);
    }
    const auto bytes = sa.save(backend);
    sb.load(backend, bytes);
    set(b.w, a.w);
    set(b.b, a.b);
    for (int s = 4; s <= 7; ++s) {
      a.grads(s);
      b.grads(s);
      opt.step(backend, a.params, sa);
      opt.step(backend, b.params, sb);
    }
    CHECK(a.w == b.w);
    CHECK(a.b == b.b);
    const auto good = sa.save(backend);
    const std::size_t n = gradapt_test::flip_every_bit(
        good, [&](std::span<const std::byte> bad) { sb.load(backend, bad); },
        [&] { return sb.save(backend); });
    CHECK(n == gradapt_test::flips_for(good.size()));
    // Another family member's state does not take the checkpoint.
    const shampoo other(kind == 2 ? soap_options(gradapt::shampoo_eigenbasis::eigh)
                                  : gradapt::spectral_descent_defaults());
    family_model c;
    auto sc = other.init(backend, c.params);
    CHECK_THROWS_WITH(sc.load(backend, good), Contains("preconditioner"));
    if (kind != 2) {  // a corrected second moment below zero, behind a valid checksum
      const auto v = sa.preconditioner().corrected_moment(0, 0);
      REQUIRE(v.size() == 30);
      const auto raw = std::as_bytes(v);
      const auto at = std::search(good.begin(), good.end(), raw.begin(), raw.end());
      REQUIRE(at != good.end());
      std::vector<std::byte> bad = good;
      const double neg = -1.0;
      std::memcpy(bad.data() + (at - good.begin()), &neg, sizeof neg);
      gradapt_test::reseal(bad);
      CHECK_THROWS_WITH(sb.load(backend, bad), Contains("corrected second moment") && Contains("-1"));
    }
  }
}

TEST_CASE("shampoo family: a SOAP block whose eigenbasis refreshes keep failing throws naming the refresh",
          "[shampoo][family]") {
  shampoo_options o = soap_options(gradapt::shampoo_eigenbasis::eigh);
  o.max_consecutive_failures = 2;  // refreshes at steps 1, 3, ...
  family_model m;
  const shampoo opt(o);
  auto st = opt.init(backend, m.params);
  st.set_check_interval(0);  // the chain's own check would stop at the first NaN parameter
  m.grads(1);
  m.gw[3] = std::numeric_limits<double>::quiet_NaN();  // the statistics become NaN for good
  const auto r1 = opt.step(backend, m.params, st);
  REQUIRE(r1.root_failures.size() == 1);
  CHECK(r1.root_failures[0].reason == gradapt::root_status::nonfinite_input);
  m.grads(2);
  opt.step(backend, m.params, st);
  m.grads(3);
  CHECK_THROWS_WITH(opt.step(backend, m.params, st),
                    Contains("parameter 'w' block 0") &&
                        Contains("eigenbasis refresh failed 2 times in a row") &&
                        Contains("nonfinite_input"));
}

TEST_CASE("shampoo family: invalid family options throw naming them", "[shampoo][family]") {
  const auto bad = [](auto change, const char* what) {
    shampoo_options o = gradapt::soap_defaults();
    change(o);
    INFO(what);
    CHECK_THROWS_WITH(shampoo(o), Contains(what));
  };
  bad([](auto& o) { o.qr_iterations = 0; }, "qr_iterations is 0");
  bad([](auto& o) { o.qr_tolerance = -1; }, "qr_tolerance is -1");
  bad([](auto& o) { o.corrected_exponent = 0; }, "corrected_exponent is 0");
  bad([](auto& o) { o.statistics_frequency = 2; }, "statistics_frequency is 2");
  bad([](auto& o) { o.root_staleness = 1; }, "root_staleness is 1");
  bad([](auto& o) { o.inverse_exponent_override = 4; }, "inverse_exponent_override");
  bad([](auto& o) { o.preconditioner = static_cast<gradapt::shampoo_preconditioner>(7); },
      "preconditioner is 7");
  bad(
      [](auto& o) {
        o.preconditioner = gradapt::shampoo_preconditioner::spectral_descent;
        o.newton_schulz.steps = 0;
      },
      "newton_schulz.steps is 0");
}

}  // namespace gradapt_test_shampoo

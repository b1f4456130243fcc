// A backend written outside include/, against the documented concepts only
// (include/gradapt/backend/concepts.hpp and docs/writing-a-backend.md): plain scalar loops,
// every sum accumulated in double in index order. It models `backend`, `optimizer_backend`
// and `factored_backend` and none of the optional capabilities (no tasks, no fused Σp² pass,
// no workspace), so the algorithms take their generic paths on it.
//
// What is checked, and against what:
//  - every optimizer (SGD with momentum, AdamW, LAMB, LARS, Adafactor and SM3 with and without
//    momentum, a user chain) runs on it and on gradapt::host over the same tensors for several steps; the
//    parameters agree within the rounding of the two backends' summation orders (the element
//    math is the same functors; the host sums in 8 lanes, this backend in index order), and
//    the optimizer states save on one backend and load on the other;
//  - the composed train step (loss scaling, AdaScale, LocalSGD) on comm::threads with 3 ranks,
//    on both backends: the same parameters within rounding and the same metrics;
//  - the backend's own operations against direct loops (its row/column reductions, maxima with
//    NaN, fused apply-and-sum), so that the comparison above compares two correct backends.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace gradapt_test_backend_third_party {

namespace thirdparty {

using gradapt::host_space;
using gradapt::tensor_index;
using gradapt::tensor_view;

/// Operations run by every loop_backend (to show the algorithms really ran on it).
inline std::atomic<std::size_t> operations{0};

/// A framework's own host backend: one loop per operation, no SIMD, no threads.
struct loop_backend {
  using space = host_space;

  // ---- backend --------------------------------------------------------------------------------

  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, space>... v) const {
    ++operations;
    const std::size_t n = common_size(v.size()...);
    for (std::size_t i = 0; i < n; ++i) element(f, 0, i, v.data()...);
  }

  template <class F, class... Ls>
  void apply_list(F f, const Ls&... lists) const {
    ++operations;
    const std::size_t count = common_size(std::ranges::size(lists)...);
    for (std::size_t t = 0; t < count; ++t) {
      const std::size_t n = common_size(std::ranges::data(lists)[t].size()...);
      for (std::size_t i = 0; i < n; ++i) element(f, t, i, std::ranges::data(lists)[t].data()...);
    }
  }

  template <class T>
  double reduce(gradapt::reduction op, tensor_view<T, space> x) const {
    const tensor_view<T, space> one[1] = {x};
    return reduce(op, std::span<const tensor_view<T, space>>(one), std::span<double>{});
  }

  template <class L>
  double reduce(gradapt::reduction op, const L& xs, std::span<double> per_tensor) const {
    ++operations;
    const std::size_t count = std::ranges::size(xs);
    check_out(per_tensor, count);
    const bool is_max = op == gradapt::reduction::max_abs;
    double total = 0.0;
    for (std::size_t t = 0; t < count; ++t) {
      const auto& v = std::ranges::data(xs)[t];
      double s = 0.0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        const double x = static_cast<double>(gradapt::load(v.data()[i]));
        switch (op) {
          case gradapt::reduction::sum:
            s += x;
            break;
          case gradapt::reduction::sum_squares:
            s += x * x;
            break;
          case gradapt::reduction::max_abs:
            s = nan_max(s, std::fabs(x));
            break;
          case gradapt::reduction::count_nonfinite:
            s += std::isfinite(x) ? 0.0 : 1.0;
            break;
        }
      }
      if (!per_tensor.empty()) per_tensor[t] = s;
      total = is_max ? nan_max(total, s) : total + s;
    }
    return total;
  }

  template <class T, class U>
  double dot(tensor_view<T, space> x, tensor_view<U, space> y) const {
    const tensor_view<T, space> xs[1] = {x};
    const tensor_view<U, space> ys[1] = {y};
    return dot(std::span<const tensor_view<T, space>>(xs), std::span<const tensor_view<U, space>>(ys),
               std::span<double>{});
  }

  template <class L1, class L2>
  double dot(const L1& xs, const L2& ys, std::span<double> per_tensor) const {
    ++operations;
    const std::size_t count = common_size(std::ranges::size(xs), std::ranges::size(ys));
    check_out(per_tensor, count);
    double total = 0.0;
    for (std::size_t t = 0; t < count; ++t) {
      const auto& x = std::ranges::data(xs)[t];
      const auto& y = std::ranges::data(ys)[t];
      const std::size_t n = common_size(x.size(), y.size());
      double s = 0.0;
      for (std::size_t i = 0; i < n; ++i)
        s +=
            static_cast<double>(gradapt::load(x.data()[i])) * static_cast<double>(gradapt::load(y.data()[i]));
      if (!per_tensor.empty()) per_tensor[t] = s;
      total += s;
    }
    return total;
  }

  void synchronize() const {}

  // ---- optimizer_backend ----------------------------------------------------------------------

  template <class T>
  std::vector<T> allocate(std::size_t n) const {
    return std::vector<T>(n);
  }

  template <class T>
  void copy(tensor_view<const T, space> src, tensor_view<T, space> dst) const {
    gradapt::detail::require(src.size() == dst.size(), "loop_backend::copy: sizes ", src.size(), " and ",
                             dst.size());
    std::copy(src.data(), src.data() + src.size(), dst.data());
  }

  template <class F, class... Ls>
  auto apply_reduce_list(F f, std::span<double> per_tensor, const Ls&... lists) const {
    ++operations;
    const std::size_t count = common_size(std::ranges::size(lists)...);
    using R = std::remove_cvref_t<decltype(element(f, 0, 0, std::ranges::data(lists)[0].data()...))>;
    constexpr std::size_t K = gradapt::terms_size<R>::value;
    gradapt::detail::require(per_tensor.empty() || per_tensor.size() == count * K,
                             "loop_backend::apply_reduce_list: per_tensor size");
    gradapt::terms<K> total{};
    for (std::size_t t = 0; t < count; ++t) {
      const std::size_t n = common_size(std::ranges::data(lists)[t].size()...);
      gradapt::terms<K> s{};
      for (std::size_t i = 0; i < n; ++i) {
        const R r = element(f, t, i, std::ranges::data(lists)[t].data()...);
        if constexpr (K == 1 && std::is_arithmetic_v<R>)
          s[0] += static_cast<double>(r);
        else
          for (std::size_t k = 0; k < K; ++k) s[k] += r[k];
      }
      for (std::size_t k = 0; k < K; ++k) {
        if (!per_tensor.empty()) per_tensor[t * K + k] = s[k];
        total[k] += s[k];
      }
    }
    if constexpr (std::is_arithmetic_v<R>)
      return total[0];
    else
      return total;
  }

  // ---- factored_backend: a tensor seen as [A, X, B, Y, C] -----------------------------------

  template <class F, class RY, class RX, class T>
  void reduce_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, space> row,
                       tensor_view<RX, space> col, tensor_view<T, space> x, tensor_view<double, space> over_y,
                       tensor_view<double, space> over_x,
                       gradapt::reduce_op op = gradapt::reduce_op::sum) const {
    ++operations;
    const bool mx = op == gradapt::reduce_op::max;
    const double init = mx ? -std::numeric_limits<double>::infinity() : 0.0;
    std::fill(over_y.data(), over_y.data() + over_y.size(), init);
    std::fill(over_x.data(), over_x.data() + over_x.size(), init);
    for_each_factored(d, x.size(), [&](std::size_t e, std::size_t yi, std::size_t xi) {
      const double t = static_cast<double>(f(entry(row, yi), entry(col, xi), gradapt::load(x.data()[e])));
      if (!over_y.empty()) over_y.data()[yi] = mx ? nan_max(over_y.data()[yi], t) : over_y.data()[yi] + t;
      if (!over_x.empty()) over_x.data()[xi] = mx ? nan_max(over_x.data()[xi], t) : over_x.data()[xi] + t;
    });
  }

  template <class F, class RY, class RX, class... Ts>
  double apply_factored(F f, std::array<std::int64_t, 5> d, tensor_view<RY, space> row,
                        tensor_view<RX, space> col, tensor_view<Ts, space>... v) const {
    ++operations;
    double total = 0.0;
    for_each_factored(d, common_size(v.size()...), [&](std::size_t e, std::size_t yi, std::size_t xi) {
      const auto r = entry(row, yi);
      const auto c = entry(col, xi);
      auto with_rc = [&](auto&... x) { return f(r, c, x...); };
      using R = decltype(element_call(with_rc, e, v.data()...));
      if constexpr (std::is_void_v<R>)
        element_call(with_rc, e, v.data()...);
      else
        total += static_cast<double>(element_call(with_rc, e, v.data()...));
    });
    return total;
  }

  template <class F, class RY, class RX, class... Ts>
  void apply_factored_sum(F f, std::array<std::int64_t, 5> d, tensor_view<RY, space> row,
                          tensor_view<RX, space> col, tensor_view<double, space> sum,
                          tensor_view<Ts, space>... v) const {
    gradapt::detail::require(!sum.empty(), "loop_backend::apply_factored_sum: empty sum view");
    sum.data()[0] = apply_factored(f, d, row, col, v...);
  }

 private:
  template <class... N>
  static std::size_t common_size(std::size_t n0, N... n) {
    gradapt::detail::require(((n == n0) && ...), "loop_backend: operands of different sizes");
    return n0;
  }
  static void check_out(std::span<double> out, std::size_t count) {
    gradapt::detail::require(out.empty() || out.size() == count, "loop_backend: per-tensor output size");
  }
  static double nan_max(double a, double b) {
    if (a != a || b != b) return std::numeric_limits<double>::quiet_NaN();
    return a > b ? a : b;
  }
  template <class R>
  static gradapt::compute_t<std::remove_const_t<R>> entry(tensor_view<R, space> v, std::size_t i) {
    if (v.empty()) return gradapt::compute_t<std::remove_const_t<R>>(1);
    return gradapt::load(v.data()[i]);
  }
  /// Calls g(e, row index, column index) for every element of d = [A, X, B, Y, C] in memory order.
  template <class G>
  static void for_each_factored(std::array<std::int64_t, 5> d, std::size_t n, G&& g) {
    const auto A = static_cast<std::size_t>(d[0]), X = static_cast<std::size_t>(d[1]),
               B = static_cast<std::size_t>(d[2]), Y = static_cast<std::size_t>(d[3]),
               C = static_cast<std::size_t>(d[4]);
    gradapt::detail::require(A * X * B * Y * C == n, "loop_backend: factored shape does not hold the tensor");
    std::size_t e = 0;
    for (std::size_t a = 0; a < A; ++a)
      for (std::size_t i = 0; i < X; ++i)
        for (std::size_t b = 0; b < B; ++b)
          for (std::size_t j = 0; j < Y; ++j)
            for (std::size_t c = 0; c < C; ++c, ++e)
              g(e, ((a * X + i) * B + b) * C + c, ((a * B + b) * Y + j) * C + c);
  }
  /// Loads element i of every operand into its compute type, calls h(values...) with lvalues,
  /// stores the non-const operands back and returns h's result.
  template <class H, class... P>
  static decltype(auto) element_call(H& h, std::size_t i, P*... p) {
    std::tuple<gradapt::compute_t<std::remove_const_t<P>>...> v{gradapt::load(p[i])...};
    const auto store_all = [&]<std::size_t... I>(std::index_sequence<I...>) {
      (store_one(p[i], std::get<I>(v)), ...);
    };
    using R = decltype(std::apply(h, v));
    if constexpr (std::is_void_v<R>) {
      std::apply(h, v);
      store_all(std::index_sequence_for<P...>{});
    } else {
      const R r = std::apply(h, v);
      store_all(std::index_sequence_for<P...>{});
      return r;
    }
  }
  template <class T, class V>
  static void store_one(T& dst, const V& v) {
    if constexpr (!std::is_const_v<T>) gradapt::store(dst, v);
  }
  /// element_call of f, with the tensor index first when f takes one.
  template <class F, class... P>
  static decltype(auto) element(F& f, std::size_t t, std::size_t i, P*... p) {
    auto h = [&](auto&... x) -> decltype(auto) {
      if constexpr (std::is_invocable_v<F&, tensor_index, decltype(x)...>)
        return f(tensor_index{t}, x...);
      else
        return f(x...);
    };
    return element_call(h, i, p...);
  }
};

static_assert(gradapt::factored_backend<loop_backend>);
static_assert(!gradapt::task_backend<loop_backend> && !gradapt::factored_sumsq_backend<loop_backend> &&
              !gradapt::workspace_backend<loop_backend>);

}  // namespace thirdparty

namespace {

using gradapt::tensor_view;
using thirdparty::loop_backend;

bool close(double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); }

/// Parameters and gradients over a list of shapes (matrices large enough to be factored,
/// a rank-3 tensor, vectors and a scalar), with a param_list over them.
struct model {
  std::vector<std::vector<std::int64_t>> shapes{{130, 140}, {6, 5, 129}, {140}, {3, 4}, {1}, {}};
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> params;

  model() {
    std::mt19937_64 rng(17);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (const auto& s : shapes) {
      std::size_t n = 1;
      for (auto e : s) n *= static_cast<std::size_t>(e);
      std::vector<float> v(n);
      for (auto& x : v) x = static_cast<float>(u(rng));
      p.push_back(std::move(v));
      g.emplace_back(n);
    }
    for (std::size_t t = 0; t < shapes.size(); ++t)
      params.add("w" + std::to_string(t), tensor_view<float>(p[t].data(), shapes[t]),
                 tensor_view<float>(g[t].data(), shapes[t]), {.skip_weight_decay = shapes[t].size() < 2});
  }
  model(const model&) = delete;
  model& operator=(const model&) = delete;

  void fill(int step) {
    std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(step));
    std::uniform_real_distribution<double> u(-0.1, 0.1);
    for (auto& t : g)
      for (auto& x : t) x = static_cast<float>(u(rng));
  }
};

/// max |a − b| over all parameters, in units of the largest parameter movement of `a` from p0.
double deviation(const model& a, const model& b, const std::vector<std::vector<float>>& p0) {
  double moved = 0.0, worst = 0.0;
  for (std::size_t t = 0; t < a.p.size(); ++t)
    for (std::size_t i = 0; i < a.p[t].size(); ++i) {
      moved = std::max(moved, std::fabs(double(a.p[t][i]) - p0[t][i]));
      worst = std::max(worst, std::fabs(double(a.p[t][i]) - b.p[t][i]));
    }
  REQUIRE(moved > 0.0);
  return worst / moved;
}

/// Runs `steps` steps of `opt` on both backends (host with 2 threads) from the same start,
/// checks the parameters agree, then moves the state across backends through a checkpoint.
template <class Opt>
void against_host(const Opt& opt, int steps = 5) {
  model on_loop, on_host;
  const auto p0 = on_loop.p;
  const loop_backend lb;
  const gradapt::host hb{.threads = 2};
  auto sl = opt.init(lb, on_loop.params);
  auto sh = opt.init(hb, on_host.params);
  const std::size_t before = thirdparty::operations;
  for (int s = 1; s <= steps; ++s) {
    on_loop.fill(s);
    on_host.fill(s);
    opt.step(lb, on_loop.params, sl, {.lr = 0.01 / s});
    opt.step(hb, on_host.params, sh, {.lr = 0.01 / s});
  }
  REQUIRE(thirdparty::operations > before);
  REQUIRE(sl.steps() == static_cast<std::uint64_t>(steps));
  CHECK(deviation(on_host, on_loop, p0) < 1e-5);

  // A checkpoint written on one backend restores on the other; both continue alike.
  sh.load(hb, sl.save(lb));
  on_host.p = on_loop.p;
  on_loop.fill(steps + 1);
  on_host.fill(steps + 1);
  opt.step(lb, on_loop.params, sl, {.lr = 0.002});
  opt.step(hb, on_host.params, sh, {.lr = 0.002});
  CHECK(deviation(on_host, on_loop, p0) < 1e-5);
}

}  // namespace

TEST_CASE("third-party backend: its own operations against direct loops", "[backend][third_party]") {
  const loop_backend b;
  // [A, X, B, Y, C] = [2, 3, 1, 4, 2]: rows over Y, columns over X.
  const std::array<std::int64_t, 5> d{2, 3, 1, 4, 2};
  std::vector<float> x(48);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) - 3.0f;
  std::vector<double> oy(2 * 3 * 2), ox(2 * 4 * 2);
  const auto sq = [](float, float, float v) { return static_cast<double>(v) * v; };
  b.reduce_factored(sq, d, tensor_view<const float>{}, tensor_view<const float>{},
                    gradapt::host_view(std::as_const(x)), gradapt::host_view(oy), gradapt::host_view(ox));
  for (std::size_t a = 0; a < 2; ++a)
    for (std::size_t c = 0; c < 2; ++c) {
      for (std::size_t i = 0; i < 3; ++i) {
        double s = 0;
        for (std::size_t j = 0; j < 4; ++j)
          s += double(x[((a * 3 + i) * 4 + j) * 2 + c]) * x[((a * 3 + i) * 4 + j) * 2 + c];
        CHECK(oy[(a * 3 + i) * 2 + c] == s);
      }
      for (std::size_t j = 0; j < 4; ++j) {
        double s = 0;
        for (std::size_t i = 0; i < 3; ++i)
          s += double(x[((a * 3 + i) * 4 + j) * 2 + c]) * x[((a * 3 + i) * 4 + j) * 2 + c];
        CHECK(ox[(a * 4 + j) * 2 + c] == s);
      }
    }
  // Maxima propagate a NaN to its row and its column only.
  x[5] = std::numeric_limits<float>::quiet_NaN();  // a = 0, i = 0, j = 2, c = 1
  const auto id = [](float, float, float v) { return static_cast<double>(v); };
  b.reduce_factored(id, d, tensor_view<const float>{}, tensor_view<const float>{},
                    gradapt::host_view(std::as_const(x)), gradapt::host_view(oy), gradapt::host_view(ox),
                    gradapt::reduce_op::max);
  CHECK(std::isnan(oy[1]));
  CHECK(std::isnan(ox[5]));
  CHECK(oy[0] == 3.0);
  CHECK(ox[4] == 3.0);
  // Fused apply and sum: y ← 2y, returns y before the store.
  std::vector<float> y{1, 2, 3}, z{4, 5, 6};
  const std::vector<gradapt::tensor_view<float>> ys{gradapt::host_view(y), gradapt::host_view(z)};
  std::vector<double> per(2);
  const double total = b.apply_reduce_list(
      [](float& v) {
        const double r = v;
        v *= 2;
        return r;
      },
      std::span<double>(per), std::span<const gradapt::tensor_view<float>>(ys));
  CHECK(total == 21.0);
  CHECK(per == std::vector<double>{6.0, 15.0});
  CHECK(y == std::vector<float>{2, 4, 6});
  CHECK_THROWS_AS(b.apply([](float&, float) {}, gradapt::host_view(y), gradapt::host_view(std::as_const(x))),
                  gradapt::error);
}

TEST_CASE("third-party backend: every optimizer against the host backend", "[backend][third_party]") {
  SECTION("sgd with momentum") { against_host(gradapt::sgd({.lr = 0.1, .momentum = 0.9, .nesterov = true})); }
  SECTION("adamw") { against_host(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01})); }
  SECTION("lamb with clipping") {
    against_host(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01, .max_grad_norm = 0.5}));
  }
  SECTION("lars") { against_host(gradapt::lars({.lr = 0.1, .weight_decay = 1e-3})); }
  SECTION("adafactor") { against_host(gradapt::adafactor({.lr = 1e-2})); }
  SECTION("adafactor with momentum") { against_host(gradapt::adafactor({.lr = 1e-2, .momentum = 0.9})); }
  SECTION("sm3") { against_host(gradapt::sm3({.lr = 1e-2})); }
  SECTION("sm3 without momentum") { against_host(gradapt::sm3({.lr = 1e-2, .momentum = 0.0})); }
  SECTION("a user's chain") {
    against_host(gradapt::chain{
        gradapt::transform::clip_by_global_norm{.max_norm = 0.3}, gradapt::transform::scale_by_adam{},
        gradapt::transform::scale_by_trust_ratio{}, gradapt::transform::scale_by_learning_rate{.lr = 1e-2}});
  }
}

TEST_CASE("third-party backend: the composed train step against the host backend", "[backend][third_party]") {
  namespace train = gradapt::train;
  constexpr int ranks = 3, steps = 6;
  struct result {
    std::vector<std::vector<float>> p;
    std::vector<train::step_metrics> m;
  };
  const auto run = [&]<class B>(const B& backend) {
    std::vector<result> out(ranks);
    gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& comm) {
      model rep;
      auto step = train::make_data_parallel_step(
          comm, backend, rep.params, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
          {.lr = 1e-2, .local_batch = 4}, gradapt::loss_scaler({.init_scale = 256.0, .growth_interval = 2}),
          train::adascale_policy{.base_batch = 4},
          train::local_sgd_policy{{.start_step = 3}, gradapt::fixed_period({.period = 2})});
      auto& r = out[static_cast<std::size_t>(comm.rank())];
      for (int s = 1; s <= steps; ++s) {
        rep.fill(s * 10 + comm.rank());
        for (auto& t : rep.g)
          for (auto& v : t) v *= static_cast<float>(step.loss_scale());
        r.m.push_back(step.step({.loss = 1.0 / s}));
      }
      r.p = rep.p;
    });
    return out;
  };
  const std::size_t before = thirdparty::operations;
  const auto on_loop = run(loop_backend{});
  REQUIRE(thirdparty::operations > before);
  const auto on_host = run(gradapt::host{.threads = 1});
  for (int r = 0; r < ranks; ++r) {
    const auto& a = on_loop[static_cast<std::size_t>(r)];
    const auto& h = on_host[static_cast<std::size_t>(r)];
    for (std::size_t t = 0; t < a.p.size(); ++t)
      for (std::size_t i = 0; i < a.p[t].size(); ++i) REQUIRE(std::fabs(a.p[t][i] - h.p[t][i]) < 1e-6);
    for (std::size_t s = 0; s < a.m.size(); ++s) {
      CHECK(a.m[s].stepped == h.m[s].stepped);
      CHECK(a.m[s].synchronous == h.m[s].synchronous);
      CHECK(a.m[s].averaged == h.m[s].averaged);
      CHECK(a.m[s].loss_scale == h.m[s].loss_scale);
      CHECK(close(a.m[s].gain, h.m[s].gain));
      CHECK(close(a.m[s].lr, h.m[s].lr));
    }
  }
}

}  // namespace gradapt_test_backend_third_party

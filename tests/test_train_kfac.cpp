// K-FAC in the precondition slot of train::data_parallel_step (train/kfac_policy.hpp), on
// host_lapack and comm::threads ranks, for a 2-layer MLP (4 → 5, tanh, → 3, both with biases)
// whose parameters are added to the list out of layer order (the mapping is not the identity).
//
// What is checked, and against what:
//  - the composed step (kfac_policy, SGD with momentum) against the sequence written out here:
//    allreduce-sum and divide by the rank count, kfac::step(comm, ...) at the lr, the
//    optimizer's step; bit for bit in the parameters and in the K-FAC state (its archive), on 1,
//    2 and 3 ranks, with factor and inverse updates at several frequencies and both methods;
//  - an overflow step (loss scaler, an inf on one rank, a and g already accumulated) leaves the
//    K-FAC state's steps, factors and decompositions unchanged, and the run then equals one that
//    never had that step (the accumulated terms were discarded, not carried over);
//  - the K-FAC state is in the step's checkpoint: a run continued from it equals the
//    uninterrupted one;
//  - a mapping that does not fit the parameter list throws gradapt::error naming the layer, on
//    every rank.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "gradapt/train/kfac_policy.hpp"
#include "rank_check.hpp"

namespace gradapt_test_train_kfac {

using Catch::Matchers::Contains;
namespace train = gradapt::train;
using gradapt::kfac;
using gradapt::kfac_grad;
using gradapt::kfac_layer;
using gradapt::kfac_method;
using gradapt::tensor_view;
using threads = gradapt::comm::threads;

namespace {

const gradapt::host_lapack la{};
constexpr std::int64_t in = 4, hid = 5, out = 3, rows = 6;
constexpr double lr = 0.1;
const kfac_layer layers[] = {{"fc1", in, hid, true}, {"fc2", hid, out, true}};

/// Parameter list order: fc2.weight, fc1.weight, fc1.bias, fc2.bias.
std::vector<train::kfac_params> mapping() { return {{.weight = 1, .bias = 2}, {.weight = 0, .bias = 3}}; }

auto make_opt() { return gradapt::sgd({.lr = lr, .momentum = 0.9}); }

std::vector<float> uniform(std::size_t n, std::uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(u(rng));
  return v;
}

/// The MLP: its parameters and gradients (the step's list), and the a and g K-FAC takes.
struct mlp {
  std::vector<float> w1 = uniform(hid * in, 1, 0.5), b1 = uniform(hid, 2, 0.1),
                     w2 = uniform(out * hid, 3, 0.5), b2 = uniform(out, 4, 0.1);
  std::vector<float> gw1 = std::vector<float>(hid * in), gb1 = std::vector<float>(hid),
                     gw2 = std::vector<float>(out * hid), gb2 = std::vector<float>(out);
  std::vector<float> a1, g1, a2, g2;  // rows × in, rows × hid, rows × hid, rows × out
  gradapt::param_list<float> params;

  mlp() {
    params.add("fc2.weight", tensor_view<float>(w2.data(), {out, hid}),
               tensor_view<float>(gw2.data(), {out, hid}));
    params.add("fc1.weight", tensor_view<float>(w1.data(), {hid, in}),
               tensor_view<float>(gw1.data(), {hid, in}));
    params.add("fc1.bias", gradapt::host_view(b1), gradapt::host_view(gb1));
    params.add("fc2.bias", gradapt::host_view(b2), gradapt::host_view(gb2));
  }
  mlp(const mlp&) = delete;
  mlp& operator=(const mlp&) = delete;

  /// Forward and backward of rank r's batch of step s for the loss (1/2rows)·Σ|y − t|², the
  /// loss multiplied by `scale`; gradients (and g) carry the scale.
  void backward(int r, int s, double scale) {
    const auto x =
        uniform(rows * in, 1000 + 17 * static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(r), 1.0);
    const auto t =
        uniform(rows * out, 5000 + 17 * static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(r), 1.0);
    a1 = x;
    a2.assign(rows * hid, 0.0f);
    g1.assign(rows * hid, 0.0f);
    g2.assign(rows * out, 0.0f);
    std::vector<double> z(rows * hid), dy(rows * out), dh(rows * hid);
    for (std::int64_t n = 0; n < rows; ++n) {
      for (std::int64_t h = 0; h < hid; ++h) {
        double v = b1[h];
        for (std::int64_t c = 0; c < in; ++c) v += double(w1[h * in + c]) * x[n * in + c];
        z[n * hid + h] = std::tanh(v);
        a2[n * hid + h] = static_cast<float>(z[n * hid + h]);
      }
      for (std::int64_t o = 0; o < out; ++o) {
        double y = b2[o];
        for (std::int64_t h = 0; h < hid; ++h) y += double(w2[o * hid + h]) * z[n * hid + h];
        dy[n * out + o] = (y - t[n * out + o]) / rows * scale;
      }
      for (std::int64_t h = 0; h < hid; ++h) {
        double v = 0;
        for (std::int64_t o = 0; o < out; ++o) v += dy[n * out + o] * w2[o * hid + h];
        dh[n * hid + h] = v * (1 - z[n * hid + h] * z[n * hid + h]);
      }
    }
    for (std::size_t e = 0; e < g2.size(); ++e) g2[e] = static_cast<float>(dy[e]);
    for (std::size_t e = 0; e < g1.size(); ++e) g1[e] = static_cast<float>(dh[e]);
    const auto outer = [](std::vector<float>& gw, std::vector<float>& gb, const std::vector<double>& d,
                          const std::vector<double>& a, std::int64_t no, std::int64_t ni) {
      for (std::int64_t o = 0; o < no; ++o) {
        double sb = 0;
        for (std::int64_t n = 0; n < rows; ++n) sb += d[n * no + o];
        gb[o] = static_cast<float>(sb);
        for (std::int64_t i = 0; i < ni; ++i) {
          double sw = 0;
          for (std::int64_t n = 0; n < rows; ++n) sw += d[n * no + o] * a[n * ni + i];
          gw[o * ni + i] = static_cast<float>(sw);
        }
      }
    };
    outer(gw2, gb2, dy, z, out, hid);
    outer(gw1, gb1, dh, std::vector<double>(x.begin(), x.end()), hid, in);
  }

  tensor_view<const float> a(std::size_t layer) const {
    return layer == 0 ? tensor_view<const float>(a1.data(), {rows, in})
                      : tensor_view<const float>(a2.data(), {rows, hid});
  }
  tensor_view<const float> g(std::size_t layer) const {
    return layer == 0 ? tensor_view<const float>(g1.data(), {rows, hid})
                      : tensor_view<const float>(g2.data(), {rows, out});
  }

  std::vector<float> flat() const {
    std::vector<float> v;
    for (const auto* p : {&w1, &b1, &w2, &b2}) v.insert(v.end(), p->begin(), p->end());
    return v;
  }
  void assign(const std::vector<float>& v) {
    auto it = v.begin();
    for (auto* p : {&w1, &b1, &w2, &b2}) {
      std::copy(it, it + static_cast<std::ptrdiff_t>(p->size()), p->begin());
      it += static_cast<std::ptrdiff_t>(p->size());
    }
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct result {
  std::vector<float> params;
  std::vector<std::byte> kfac_state;
  std::uint64_t kfac_steps = 0;
};

auto make_step(threads& comm, mlp& net, const kfac& kf) {
  return train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                        train::kfac_policy(kf, kf.init<double>(la, layers), mapping()));
}

/// One composed step: backward, a and g when the factor update is due, step().
template <class Step>
const train::step_metrics& composed_step(Step& step, mlp& net, int r, int s) {
  net.backward(r, s, step.loss_scale());
  auto& pre = step.preconditioner();
  if (pre.factor_update_due())
    for (std::size_t l = 0; l < 2; ++l) pre.accumulate(l, net.a(l), net.g(l), step.loss_scale());
  return step.step({.loss = 1.0 / s});
}

result run_composed(threads& comm, const kfac& kf, int steps) {
  mlp net;
  auto step = make_step(comm, net, kf);
  for (int s = 1; s <= steps; ++s) composed_step(step, net, comm.rank(), s);
  const auto& st = step.preconditioner().state();
  return {net.flat(), st.save(), st.steps()};
}

/// The sequence the policy stands for, written out.
result run_by_hand(threads& comm, const kfac& kf, int steps) {
  mlp net;
  const gradapt::host backend{.threads = 1};
  const auto opt = make_opt();
  auto ost = opt.init(backend, net.params);
  auto st = kf.init<double>(la, layers);
  const int n = comm.size();
  for (int s = 1; s <= steps; ++s) {
    net.backward(comm.rank(), s, 1.0);
    if (kf.factor_update_due(st))
      for (std::size_t l = 0; l < 2; ++l) kf.accumulate(st, l, net.a(l), net.g(l));
    for (const auto& g : net.params.grads()) {
      comm.allreduce(g, gradapt::reduce_op::sum);
      for (std::size_t e = 0; e < g.size(); ++e) g[e] = g[e] / static_cast<float>(n);
    }
    const kfac_grad<float> grads[] = {
        {tensor_view<float>(net.gw1.data(), {hid, in}), gradapt::host_view(net.gb1)},
        {tensor_view<float>(net.gw2.data(), {out, hid}), gradapt::host_view(net.gb2)}};
    kf.step(comm, st, std::span(grads), lr);
    opt.step(backend, net.params, ost, {.lr = lr});
  }
  return {net.flat(), st.save(), st.steps()};
}

/// Plain SGD with momentum through the step (no preconditioner), the same data.
std::vector<float> run_plain(threads& comm, int steps) {
  mlp net;
  auto step =
      train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr});
  for (int s = 1; s <= steps; ++s) {
    net.backward(comm.rank(), s, 1.0);
    step.step();
  }
  return net.flat();
}

}  // namespace

TEST_CASE("kfac_policy: the composed step equals allreduce-mean, kfac::step(comm) and the optimizer by hand",
          "[train][kfac]") {
  const gradapt::kfac_options configs[] = {
      {.factor_update_steps = 1, .inv_update_steps = 1},
      {.factor_update_steps = 2, .inv_update_steps = 3},
      {.factor_update_steps = 3, .inv_update_steps = 2, .damping = 0.01, .method = kfac_method::inverse},
  };
  constexpr int steps = 7;
  for (int n = 1; n <= 3; ++n)
    for (const auto& o : configs) {
      INFO(n << " ranks, factor_update_steps " << o.factor_update_steps << ", inv_update_steps "
             << o.inv_update_steps);
      const kfac kf(o);
      std::vector<result> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
      std::vector<std::vector<float>> plain(static_cast<std::size_t>(n));
      gradapt::comm::run_threads(n, [&](threads& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        a[r] = run_composed(comm, kf, steps);
        b[r] = run_by_hand(comm, kf, steps);
        plain[r] = run_plain(comm, steps);
      });
      for (std::size_t r = 0; r < a.size(); ++r) {
        INFO("rank " << r);
        REQUIRE(a[r].kfac_steps == steps);
        REQUIRE(b[r].kfac_steps == steps);
        REQUIRE(same_bits(a[r].params, b[r].params));
        REQUIRE(a[r].kfac_state == b[r].kfac_state);
        REQUIRE(same_bits(a[r].params, a[0].params));  // the replicas agree
        // K-FAC changed the trajectory.
        REQUIRE_FALSE(same_bits(a[r].params, plain[r]));
      }
    }
}

TEST_CASE("kfac_policy: an overflow step leaves the K-FAC state untouched and discards its terms",
          "[train][kfac]") {
  // Factor updates at K-FAC steps 1, 3, 5 (calls 1, 3, 5 without the overflow); the overflow
  // hits call 3, whose a and g were accumulated (with the inf in g on the last rank).
  const kfac kf({.factor_update_steps = 2, .inv_update_steps = 2});
  const gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 1000});
  for (int n = 1; n <= 2; ++n) {
    INFO(n << " ranks");
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      mlp x, y;
      auto sx = train::make_data_parallel_step(
          comm, gradapt::host{.threads = 1}, x.params, make_opt(), {.lr = lr},
          train::kfac_policy(kf, kf.init<double>(la, layers), mapping()), scaler);
      auto sy = train::make_data_parallel_step(
          comm, gradapt::host{.threads = 1}, y.params, make_opt(), {.lr = lr},
          train::kfac_policy(kf, kf.init<double>(la, layers), mapping()), scaler);
      for (int s = 1; s <= 2; ++s) {
        composed_step(sx, x, r, s);
        composed_step(sy, y, r, s);
      }
      // The overflow step on x.
      const auto before = sx.preconditioner().state().save();
      const auto params_before = x.flat();
      x.backward(r, 3, sx.loss_scale());
      auto& pre = sx.preconditioner();
      RANK_REQUIRE(pre.factor_update_due());
      if (r == n - 1) {
        x.g1[0] = std::numeric_limits<float>::infinity();  // the backward pass overflowed here
        x.gw1[0] = std::numeric_limits<float>::infinity();
      }
      for (std::size_t l = 0; l < 2; ++l) pre.accumulate(l, x.a(l), x.g(l), sx.loss_scale());
      const auto& m = sx.step({.loss = 1.0 / 3});
      RANK_REQUIRE(m.found_inf);
      RANK_REQUIRE(!m.stepped);
      RANK_REQUIRE(sx.loss_scale() == 512.0);
      RANK_REQUIRE(pre.state().steps() == 2);
      RANK_REQUIRE(pre.state().save() == before);  // factors, decompositions, counters
      RANK_REQUIRE(same_bits(x.flat(), params_before));
      RANK_REQUIRE(pre.factor_update_due());  // the factor update is due again
      // x retries step 3 and goes on; y never had the overflow. The loss scales differ by a
      // power of two, which the unscale and K-FAC's division by the scale remove exactly.
      for (int s = 3; s <= 5; ++s) {
        composed_step(sx, x, r, s);
        composed_step(sy, y, r, s);
      }
      RANK_REQUIRE(sx.preconditioner().state().steps() == 5);
      RANK_REQUIRE(sx.preconditioner().state().save() == sy.preconditioner().state().save());
      RANK_REQUIRE(same_bits(x.flat(), y.flat()));
      RANK_REQUIRE(sx.metrics().optimizer_steps == 5);
    });
  }
}

TEST_CASE("kfac_policy: the K-FAC state is in the step's checkpoint", "[train][kfac]") {
  const kfac kf({.factor_update_steps = 2, .inv_update_steps = 3});
  gradapt::comm::run_threads(2, [&](threads& comm) {
    const int r = comm.rank();
    mlp a;
    auto sa = make_step(comm, a, kf);
    for (int s = 1; s <= 3; ++s) composed_step(sa, a, r, s);
    const auto ckpt = sa.save();
    const auto p3 = a.flat();
    for (int s = 4; s <= 6; ++s) composed_step(sa, a, r, s);

    mlp b;
    b.assign(p3);
    auto sb = make_step(comm, b, kf);
    sb.load(ckpt);
    RANK_REQUIRE(sb.preconditioner().state().steps() == 3);
    for (int s = 4; s <= 6; ++s) composed_step(sb, b, r, s);
    RANK_REQUIRE(same_bits(a.flat(), b.flat()));
    RANK_REQUIRE(sa.preconditioner().state().save() == sb.preconditioner().state().save());

    // A step without the preconditioner rejects the checkpoint (slot mask).
    mlp c;
    auto sc =
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, c.params, make_opt(), {.lr = lr});
    RANK_REQUIRE_THROWS_WITH(sc.load(ckpt), Contains("slot mask"));
  });
}

TEST_CASE("kfac_policy: a mapping that does not fit throws naming the layer, on every rank",
          "[train][kfac]") {
  const kfac kf({});
  using P = train::kfac_params;
  struct bad_case {
    std::vector<P> map;
    const char* message;
  };
  const bad_case cases[] = {
      {{{.weight = 9, .bias = 2}, {.weight = 0, .bias = 3}}, "layer 'fc1' names parameter 9 as its weight"},
      {{{.weight = 1, .bias = 2}, {.weight = 0, .bias = 7}}, "layer 'fc2' names parameter 7 as its bias"},
      {{{.weight = 0, .bias = 2}, {.weight = 1, .bias = 3}},
       "layer 'fc1' has a weight of out 5 × in 4 but its weight parameter 0 ('fc2.weight') has shape [3, 5]"},
      {{{.weight = 1, .bias = 3}, {.weight = 0, .bias = 2}},
       "layer 'fc1' has a bias of 5 but its bias parameter 3 ('fc2.bias') has shape [3]"},
      {{{.weight = 1}, {.weight = 0, .bias = 3}},
       "layer 'fc1' is registered with a bias but its mapping names no bias parameter"},
      {{{.weight = 1, .bias = 2}, {.weight = 1, .bias = 3}},
       "layer 'fc2' names parameter 1 ('fc1.weight') as its weight, which another mapping already names"},
      {{{.weight = 1, .bias = 2}}, "1 parameter mappings for 2 K-FAC layers"},
  };
  gradapt::comm::run_threads(2, [&](threads& comm) {
    for (const auto& c : cases) {
      mlp net;
      RANK_REQUIRE_THROWS_WITH(train::make_data_parallel_step(
                                   comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                   train::kfac_policy(kf, kf.init<double>(la, layers), c.map)),
                               Contains(c.message));
    }
    // A layer without a bias whose mapping names one.
    {
      mlp net;
      const kfac_layer nobias[] = {{"fc1", in, hid, false}, {"fc2", hid, out, true}};
      RANK_REQUIRE_THROWS_WITH(
          train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(),
                                         {.lr = lr},
                                         train::kfac_policy(kf, kf.init<double>(la, nobias), mapping())),
          Contains("layer 'fc1' is registered without a bias but its mapping names bias parameter 2"));
    }
    // A mapping wrong on one rank only: every rank throws, none waits.
    {
      mlp net;
      auto map = mapping();
      if (comm.rank() == 1) map[0].weight = 9;
      RANK_REQUIRE_THROWS_WITH(train::make_data_parallel_step(
                                   comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                   train::kfac_policy(kf, kf.init<double>(la, layers), map)),
                               Contains("kfac_policy parameter mapping"));
    }
  });
}

}  // namespace gradapt_test_train_kfac

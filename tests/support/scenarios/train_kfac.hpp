#pragma once
// K-FAC in the precondition slot of train::data_parallel_step, written once over the
// communicator: tests/test_train_kfac.cpp runs it on comm::threads, tests/mpi/test_mpi_train_kfac.cpp
// on MPI_COMM_WORLD.
//
// A 2-layer MLP (4 → 5, tanh, → 3, both with biases) whose parameters are added to the list out
// of layer order (the mapping is not the identity); each rank's batch differs. run_composed runs
// the composed step (kfac_policy, SGD with momentum, any further policies such as a reduce slot);
// run_by_hand runs the sequence the policy stands for, written out: allreduce-sum and divide by
// the rank count, kfac::step(comm, ...) at the lr, the optimizer's step.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "gradapt/train/kfac_policy.hpp"

namespace train_kfac_scenario {

namespace train = gradapt::train;
using gradapt::kfac;
using gradapt::kfac_grad;
using gradapt::kfac_layer;
using gradapt::kfac_method;
using gradapt::tensor_view;

inline const gradapt::host_lapack la{};
inline constexpr std::int64_t in = 4, hid = 5, out = 3, rows = 6;
inline constexpr double lr = 0.1;
inline const kfac_layer layers[] = {{"fc1", in, hid, true}, {"fc2", hid, out, true}};

/// Parameter list order: fc2.weight, fc1.weight, fc1.bias, fc2.bias.
inline std::vector<train::kfac_params> mapping() {
  return {{.weight = 1, .bias = 2}, {.weight = 0, .bias = 3}};
}

inline auto make_opt() { return gradapt::sgd({.lr = lr, .momentum = 0.9}); }

inline std::vector<float> uniform(std::size_t n, std::uint64_t seed, double scale) {
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

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct result {
  std::vector<float> params;
  std::vector<std::byte> kfac_state;
  std::uint64_t kfac_steps = 0;
};

/// The composed step with K-FAC in the precondition slot, and any further policies.
template <class Comm, class... Extra>
auto make_step(Comm& comm, mlp& net, const kfac& kf, Extra... extra) {
  return train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                        train::kfac_policy(kf, kf.init<double>(la, layers), mapping()),
                                        extra...);
}

/// One composed step: backward (with a reduce slot that marks gradients, each marked as the
/// backward produces it, last layer first), a and g when the factor update is due, step().
template <class Step>
const train::step_metrics& composed_step(Step& step, mlp& net, int r, int s) {
  net.backward(r, s, step.loss_scale());
  if constexpr (Step::marks_gradients)
    for (const std::size_t t : {std::size_t{3}, std::size_t{0}, std::size_t{2}, std::size_t{1}})
      step.mark_ready(t);
  auto& pre = step.preconditioner();
  if (pre.factor_update_due())
    for (std::size_t l = 0; l < 2; ++l) pre.accumulate(l, net.a(l), net.g(l), step.loss_scale());
  return step.step({.loss = 1.0 / s});
}

template <class Comm, class... Extra>
result run_composed(Comm& comm, const kfac& kf, int steps, Extra... extra) {
  mlp net;
  auto step = make_step(comm, net, kf, extra...);
  for (int s = 1; s <= steps; ++s) composed_step(step, net, comm.rank(), s);
  const auto& st = step.preconditioner().state();
  return {net.flat(), st.save(), st.steps()};
}

/// The sequence the policy stands for, written out.
template <class Comm>
result run_by_hand(Comm& comm, const kfac& kf, int steps) {
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
template <class Comm>
std::vector<float> run_plain(Comm& comm, int steps) {
  mlp net;
  auto step =
      train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr});
  for (int s = 1; s <= steps; ++s) {
    net.backward(comm.rank(), s, 1.0);
    step.step();
  }
  return net.flat();
}

}  // namespace train_kfac_scenario

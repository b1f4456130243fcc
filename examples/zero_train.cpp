// ZeRO-2 in the composed data-parallel step (docs/algorithms/train-step.md, "Sharded optimizer
// state"): LAMB + dynamic loss scaling + AdaScale with the optimizer state sharded over 4
// in-process ranks, each gradient handed to the step as the backward pass produces it (last
// layer first), so full buckets are reduce-scattered while the rest of the backward runs.
// The same recipe with the state replicated runs beside it: the weights agree to rounding
// (AdaScale's norms are summed per shard), and each rank holds a quarter of the state.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace train = gradapt::train;

constexpr int ranks = 4, batch = 8, steps = 40;
const std::vector<int> widths{4096, 8192, 16384, 8192, 4096, 2048};  // one weight tensor each

/// Six weight tensors ("layers") pulled towards targets w*_i = 0.3 ((i mod 7) - 3) by the loss
/// ½ mean (w − w*)², each rank seeing its own noisy gradient (w − w*) + 0.5 ξ: a stand-in for a
/// network whose per-rank gradients differ by their batches, which is what AdaScale measures.
struct model {
  std::vector<std::vector<float>> w, g;
  gradapt::param_list<float> params;
  model() {
    for (const int d : widths) {
      w.emplace_back(static_cast<std::size_t>(d), 0.0f);
      g.emplace_back(static_cast<std::size_t>(d), 0.0f);
    }
    for (std::size_t k = 0; k < w.size(); ++k)
      params.add("layer" + std::to_string(k), gradapt::host_view(w[k]), gradapt::host_view(g[k]));
  }
  model(const model&) = delete;
  model& operator=(const model&) = delete;

  static float target(std::size_t i) { return 0.3f * static_cast<float>(static_cast<int>(i % 7) - 3); }

  /// Rank r's step t: the loss, and the gradients times `scale`, produced from the last layer to
  /// the first; `ready(k)` is called as each is finished.
  template <class Ready>
  double backward(int r, int t, double scale, Ready&& ready) {
    std::mt19937 rng(static_cast<unsigned>(7919 * t + r));
    std::normal_distribution<float> noise(0.0f, 0.5f);
    double loss = 0.0;
    std::size_t count = 0;
    for (std::size_t k = w.size(); k-- > 0;) {  // the backward pass: last layer first
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        const float d = w[k][i] - target(i);
        loss += 0.5 * d * d;
        g[k][i] = static_cast<float>((d + noise(rng)) * scale);
      }
      count += w[k].size();
      ready(k);
    }
    return loss / static_cast<double>(count);
  }
};

/// A hook: the learning rate decays with AdaScale's progress τ.
struct decay {
  void before_step(train::step_settings& s, const train::step_metrics& last) {
    s.lr = 0.1 / (1.0 + 0.05 * last.progress);
  }
};

/// The recipe; `state` is the state slot's policy.
template <class Comm, class State>
auto make_step(Comm& comm, model& m, State state) {
  return train::make_data_parallel_step(
      comm, gradapt::host{.threads = 1}, m.params, gradapt::lamb({.weight_decay = 0.01}),
      {.lr = 0.1, .local_batch = batch}, gradapt::loss_scaler({.init_scale = 1024.0}),
      train::adascale_policy{.base_batch = batch}, state, decay{});
}

int main() {
  gradapt::comm::run_threads(ranks, [](gradapt::comm::threads& comm) {
    const int r = comm.rank();
    model sharded, replicated;
    // ZeRO-2: 64 KiB buckets, so the six gradients travel in several buckets.
    auto zero =
        make_step(comm, sharded, train::zero_state<2>{.sharding = {.buckets = {.cap_bytes = 64 << 10}}});
    auto whole = make_step(comm, replicated, train::replicated_state{});
    double first = 0.0, last = 0.0;
    for (int t = 1; t <= steps; ++t) {
      const double loss =
          sharded.backward(r, t, zero.loss_scale(), [&](std::size_t k) { zero.mark_ready(k); });
      const train::step_metrics& z = zero.step({.loss = loss});
      replicated.backward(r, t, whole.loss_scale(), [](std::size_t) {});
      const train::step_metrics& w = whole.step({.loss = loss});
      examples::require(z.gain == w.gain || std::abs(z.gain - w.gain) <= 1e-9 * w.gain,
                        "zero_train: AdaScale's gain ", z.gain, " vs ", w.gain, " on rank ", r);
      if (t == 1) first = loss;
      last = loss;
      if (r == 0 && t % 10 == 0)
        std::printf(
            "step %2d  loss %.5f  gain %.3f  lr %.5f  optimizer state on rank 0: %zu bytes (replicated: "
            "%zu)\n",
            t, loss, z.gain, z.lr, static_cast<std::size_t>(z.state_bytes),
            static_cast<std::size_t>(w.state_bytes));
    }
    double worst = 0.0;
    for (std::size_t k = 0; k < sharded.w.size(); ++k)
      for (std::size_t i = 0; i < sharded.w[k].size(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(sharded.w[k][i]) - replicated.w[k][i]));
    examples::require(worst <= 1e-5, "zero_train: ZeRO-2 and the replicated step differ by ", worst,
                      " on rank ", r);
    examples::require(last < 0.2 * first, "zero_train: the loss went from ", first, " to ", last, " on rank ",
                      r);
    // The ranks' shards of the state add up to the replicated state.
    double bytes = static_cast<double>(zero.state_bytes());
    comm.allreduce(gradapt::host_view(std::span<double>(&bytes, 1)), gradapt::reduce_op::sum);
    examples::require(bytes == static_cast<double>(whole.state_bytes()), "zero_train: the shards hold ",
                      bytes, " bytes of state, the replicated step ", whole.state_bytes());
    const double share = static_cast<double>(zero.state_bytes()) / static_cast<double>(whole.state_bytes());
    if (r == 0)
      std::printf(
          "ZeRO-2 = replicated to %.1e; loss %.4f -> %.4f; rank 0 holds %.2f of the optimizer state\n", worst,
          first, last, share);
  });
}

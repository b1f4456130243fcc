// The whole loop of the composed data-parallel step (docs/algorithms/train-step.md shows this
// file): construction, the per-step call, metrics, and a checkpoint that a fresh step resumes
// from bit for bit. Least squares y = x·w on 3 in-process ranks with SGD + momentum, dynamic
// loss scaling, AdaScale and a learning-rate hook.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/check.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace train = gradapt::train;

constexpr int dim = 16, batch = 8, steps = 60, saved_at = 30;

/// A hook: the learning rate decays with AdaScale's progress τ.
struct decay {
  void before_step(train::step_settings& s, const train::step_metrics& last) {
    s.lr = 0.05 / (1.0 + 0.01 * last.progress);
  }
};

/// One rank's model: weights, gradient, and the param_list the step works on.
struct model {
  std::vector<float> w = std::vector<float>(dim, 0.0f), g = std::vector<float>(dim, 0.0f);
  gradapt::param_list<float> params;
  model() { params.add("w", gradapt::host_view(w), gradapt::host_view(g)); }
  model(const model&) = delete;
  model& operator=(const model&) = delete;

  /// The mean-squared-error gradient of rank r's batch at step t, times the loss scale;
  /// returns the loss.
  double backward(int r, int t, double loss_scale) {
    std::mt19937 rng(static_cast<unsigned>(1000 * t + r));
    std::normal_distribution<float> x(0.0f, 1.0f), noise(0.0f, 0.1f);
    std::vector<float> grad(dim, 0.0f);
    double loss = 0.0;
    for (int b = 0; b < batch; ++b) {
      float xs[dim], err = 0.0f;
      for (int i = 0; i < dim; ++i) {
        xs[i] = x(rng);
        err += xs[i] * (w[static_cast<std::size_t>(i)] - 0.5f * static_cast<float>(i % 3));
      }
      err -= noise(rng);
      loss += 0.5 * err * err / batch;
      for (int i = 0; i < dim; ++i) grad[static_cast<std::size_t>(i)] += err * xs[i] / batch;
    }
    for (int i = 0; i < dim; ++i)
      g[static_cast<std::size_t>(i)] = static_cast<float>(grad[static_cast<std::size_t>(i)] * loss_scale);
    return loss;
  }
};

/// Builds the step: optimizer, initial settings, then policies and hooks in any order.
template <class Comm>
auto make_step(Comm& comm, model& m) {
  return train::make_data_parallel_step(
      comm, gradapt::host{.threads = 1}, m.params, gradapt::sgd({.lr = 0.05, .momentum = 0.9}),
      {.lr = 0.05, .local_batch = batch}, gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 20}),
      train::adascale_policy{.base_batch = batch}, decay{});
}

int main() {
  gradapt::comm::run_threads(3, [](gradapt::comm::threads& comm) {
    const int r = comm.rank();
    model m;
    auto step = make_step(comm, m);
    std::vector<std::byte> checkpoint;
    std::vector<float> w_saved;
    for (int t = 1; t <= steps; ++t) {
      const double loss = m.backward(r, t, step.loss_scale());  // the framework's backward pass
      const train::step_metrics& s = step.step({.loss = loss});
      if (r == 0 && t % 10 == 0)
        std::printf("step %2d  loss %.4f  gain %.2f  lr %.4f  noise scale %7.1f  loss scale %g\n", t, s.loss,
                    s.gain, s.lr, s.noise_scale, s.loss_scale);
      if (t == saved_at) {  // the step's state; the weights are the framework's to save
        checkpoint = step.save();
        w_saved = m.w;
      }
    }

    // Resume from the checkpoint in a fresh step and weights: the same bits as the run above.
    model resumed;
    resumed.w = w_saved;
    auto again = make_step(comm, resumed);
    again.load(checkpoint);
    for (int t = saved_at + 1; t <= steps; ++t)
      again.step({.loss = resumed.backward(r, t, again.loss_scale())});
    examples::require(std::memcmp(resumed.w.data(), m.w.data(), m.w.size() * sizeof(float)) == 0,
                      "train_loop: the resumed run differs on rank ", r);
    examples::require(again.metrics().loss == step.metrics().loss, "train_loop: metrics differ on rank ", r);
    if (r == 0)
      std::printf("resumed from step %d: the same weights bit for bit (%d bytes of step state)\n", saved_at,
                  static_cast<int>(checkpoint.size()));
  });
}

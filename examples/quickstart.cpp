// Quick start (docs/index.md shows this file): 4 in-process ranks fit y = w·x + b to noisy data
// with data-parallel LAMB. Each step measures the gradient noise scale while the gradients are
// summed, and AdaScale turns it into a gain on the learning rate.
#include <gradapt/gradapt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr int ranks = 4, dim = 8, batch = 16;  // batch: examples per rank and step
  gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& comm) {
    // The framework's own buffers (here plain vectors) and a parameter list of views over them.
    std::vector<float> w(dim, 0.0f), b(1, 0.0f), grad(dim + 1), x(dim);
    gradapt::param_list<float> params;
    params.add("w", gradapt::host_view(w), gradapt::tensor_view<float>::vector(grad.data(), dim));
    params.add("b", gradapt::host_view(b), gradapt::tensor_view<float>::vector(grad.data() + dim, 1),
               {.skip_weight_decay = true, .skip_trust_ratio = true});
    const gradapt::host backend{.threads = 1};
    const gradapt::lamb lamb({.lr = 0.1});
    auto state = lamb.init(backend, params);
    gradapt::gradient_noise_scale gns({.smoothing = 0.9});
    gradapt::adascale ada({.scale = double(ranks), .sqrt_gain = true});  // S = global/base batch
    std::mt19937 rng(comm.rank());
    std::normal_distribution<float> normal;
    while (ada.progress() < 400) {  // τ: progress in base-batch (one rank's batch) iterations
      std::fill(grad.begin(), grad.end(), 0.0f);
      for (int i = 0; i < batch; ++i) {  // forward and backward of 0.5 (w·x + b − y)² / batch
        float err = b[0] - 1.0f - 0.5f * normal(rng);  // truth: w_j = (j + 1) / dim, b = 1
        for (int j = 0; j < dim; ++j) x[j] = normal(rng), err += (w[j] - (j + 1.0f) / dim) * x[j];
        for (int j = 0; j < dim; ++j) grad[j] += err * x[j] / batch;
        grad[dim] += err / batch;
      }
      const auto norms = gradapt::allreduce_with_norms(comm, backend, gradapt::host_view(grad));  // sum
      for (float& g : grad) g /= ranks;                                                           // mean
      gns.update(norms, ranks, {.micro_batch = batch});
      const auto s = ada.step([](double tau) { return 0.1 * (1 - tau / 400); }, gns, batch);
      lamb.step(backend, params, state, {.lr = s.lr});
    }
    double err2 = (b[0] - 1.0) * (b[0] - 1.0), start2 = 1.0;  // |θ − θ*|², now and at θ = 0
    for (int j = 0; j < dim; ++j)
      err2 += std::pow(w[j] - (j + 1.0) / dim, 2), start2 += std::pow((j + 1.0) / dim, 2);
    if (comm.rank() == 0)
      std::printf("%llu steps, tau %.0f, last gain %.2f, B_simple %.0f, |theta - theta*| %.4f of %.4f: %s\n",
                  static_cast<unsigned long long>(ada.steps()), ada.progress(), ada.last_gain(),
                  gns.b_simple().value_or(NAN), std::sqrt(err2), std::sqrt(start2),
                  err2 < 0.05 * 0.05 * start2 ? "converged" : "NOT converged");
  });
}

// Compiled by ctest with g++ and clang++ at -Wall -Wextra -Wpedantic -Werror: a framework's
// translation unit that includes only the umbrella header and instantiates the main paths.
#include <gradapt/gradapt.hpp>

#include <vector>

double consumer_step(std::vector<float>& w, std::vector<gradapt::bfloat16>& g, int ranks) {
  gradapt::param_list<float, gradapt::bfloat16> params;
  params.add("w", gradapt::host_view(w), gradapt::host_view(g), {.skip_weight_decay = true});
  gradapt::host backend{.threads = 1};
  backend.apply_list([](float& x, float& grad) { x -= 0.1f * grad; }, params.values(), params.grads());
  std::vector<double> per(params.size());
  double total = backend.reduce(gradapt::reduction::sum_squares, params.grads(), per);
  gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& c) {
    std::vector<double> v{total};
    c.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
  });
  return total;
}

// binary16 parameters and gradients through AdamW and the loss scaler's fused unscale: the host
// backend's 32-byte half stores and square roots (GCC, no -march) at every optimisation level.
double consumer_half_step(std::vector<gradapt::half>& w, std::vector<gradapt::half>& g) {
  gradapt::param_list<gradapt::half> params;
  params.add("w", gradapt::host_view(w), gradapt::host_view(g));
  const gradapt::host backend{.threads = 1};
  const double nonfinite = gradapt::unscale_count_nonfinite(backend, params.grads(), 0.5f);
  const gradapt::adamw opt({.lr = 1e-3});
  auto state = opt.init(backend, params);
  opt.step(backend, params, state);
  return nonfinite;
}

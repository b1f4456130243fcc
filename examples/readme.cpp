#include <gradapt/gradapt.hpp>

#include <cstdio>
#include <vector>

int main() {
  gradapt::comm::run_threads(4, [](gradapt::comm::threads& comm) {  // 4 ranks, one thread each
    // This rank's own buffers (a framework's tensors in a real program) and views over them.
    std::vector<float> w(6, 0.0f), g(6);
    gradapt::param_list<float> params;
    params.add("layer.weight", gradapt::host_view(w, {2, 3}), gradapt::host_view(g, {2, 3}));

    const gradapt::host backend{.threads = 1};
    const gradapt::adamw adamw({.lr = 0.05, .weight_decay = 0.0});
    auto state = adamw.init(backend, params);
    for (int step = 0; step < 300; ++step) {
      // Backward pass of 0.5·|w − t|² with t = rank + 1 everywhere: the ranks disagree.
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = w[i] - float(comm.rank() + 1);
      for (const auto& grad : params.grads()) comm.allreduce_mean(grad);  // average over ranks
      adamw.step(backend, params, state);
    }
    if (comm.rank() == 0) std::printf("w[0] = %.2f (the mean target is 2.50)\n", w[0]);
  });
}

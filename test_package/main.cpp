// Conan test_package: the packaged headers compile and a data-parallel noise-scale step runs.
#include <cstdio>
#include <vector>

#include <gradapt/gradapt.hpp>

int main() {
  std::vector<double> b_simple(2);
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& comm) {
    std::vector<float> g(1000, comm.rank() == 0 ? 1.0f : 3.0f);
    gradapt::gradient_noise_scale gns({.smoothing = 0.0});
    const auto norms = gradapt::allreduce_with_norms(comm, gradapt::host{.threads = 1}, gradapt::host_view(g));
    gns.update(norms, comm.size(), {.micro_batch = 8});
    b_simple[static_cast<std::size_t>(comm.rank())] = gns.b_simple().value_or(-1.0);
  });
  // Local norms 1000 and 9000 (mean 5000), averaged gradient 2 everywhere (|g|^2 = 4000):
  // |G|^2 = (16 * 4000 - 8 * 5000) / 8 = 3000, tr(S) = (5000 - 4000) / (1/8 - 1/16) = 16000.
  const double expected = 16000.0 / 3000.0;
  std::printf("gradapt test_package: B_simple = %.6f (expected %.6f)\n", b_simple[0], expected);
  return b_simple[0] == b_simple[1] && b_simple[0] > expected * (1 - 1e-12) && b_simple[0] < expected * (1 + 1e-12)
             ? 0
             : 1;
}

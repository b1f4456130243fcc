// Conan test_package: the packaged headers compile and a data-parallel noise-scale step runs.
#include <cstdio>
#include <vector>

#include <gradapt/gradapt.hpp>
#ifdef GRADAPT_WITH_LINALG_COMPONENT
#include <gradapt/linalg/host_lapack.hpp>
#endif

int main() {
  std::vector<double> b_simple(2);
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& comm) {
    std::vector<float> g(1000, comm.rank() == 0 ? 1.0f : 3.0f);
    gradapt::gradient_noise_scale gns({.smoothing = 0.0});
    const auto norms =
        gradapt::allreduce_with_norms(comm, gradapt::host{.threads = 1}, gradapt::host_view(g));
    gns.update(norms, comm.size(), {.micro_batch = 8});
    b_simple[static_cast<std::size_t>(comm.rank())] = gns.b_simple().value_or(-1.0);
  });
  // Local norms 1000 and 9000 (mean 5000), averaged gradient 2 everywhere (|g|^2 = 4000):
  // |G|^2 = (16 * 4000 - 8 * 5000) / 8 = 3000, tr(S) = (5000 - 4000) / (1/8 - 1/16) = 16000.
  const double expected = 16000.0 / 3000.0;
  std::printf("gradapt test_package: B_simple = %.6f (expected %.6f)\n", b_simple[0], expected);
#ifdef GRADAPT_WITH_LINALG_COMPONENT
  // gradapt::linalg: C = Aᵀ·A of A = [[1, 2], [3, 4]] through the system BLAS.
  const std::vector<double> a{1, 2, 3, 4};
  std::vector<double> c(4);
  gradapt::host_lapack{}.syrk<double>(gradapt::gram::columns, 1.0,
                                      gradapt::tensor_view<const double>(a.data(), {2, 2}), 0.0,
                                      gradapt::tensor_view<double>(c.data(), {2, 2}));
  std::printf("gradapt test_package: linalg AᵀA = [%g %g; %g %g]\n", c[0], c[1], c[2], c[3]);
  if (c != std::vector<double>{10, 14, 14, 20}) return 1;
#endif
  return b_simple[0] == b_simple[1] && b_simple[0] > expected * (1 - 1e-12) &&
                 b_simple[0] < expected * (1 + 1e-12)
             ? 0
             : 1;
}

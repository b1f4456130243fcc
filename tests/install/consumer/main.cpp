// Built against an installed gradapt: a two-rank allreduce over the threads communicator.
#include <gradapt/gradapt.hpp>

#include <cstdio>
#include <vector>
#ifdef GRADAPT_WITH_LINALG_COMPONENT
#include <gradapt/linalg/host_lapack.hpp>
#endif

int main() {
  double total = 0;
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& c) {
    std::vector<double> v{double(c.rank() + 1)};
    c.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
    if (c.rank() == 0) total = v[0];
  });
  std::printf("installed gradapt %d.%d.%d: allreduce over 2 ranks = %g\n", GRADAPT_VERSION_MAJOR,
              GRADAPT_VERSION_MINOR, GRADAPT_VERSION_PATCH, total);
#ifdef GRADAPT_WITH_LINALG_COMPONENT
  // gradapt::linalg: C = Aᵀ·A of A = [[1, 2], [3, 4]] through the system BLAS.
  const std::vector<double> a{1, 2, 3, 4};
  std::vector<double> c(4);
  gradapt::host_lapack{}.syrk<double>(gradapt::gram::columns, 1.0,
                                      gradapt::tensor_view<const double>(a.data(), {2, 2}), 0.0,
                                      gradapt::tensor_view<double>(c.data(), {2, 2}));
  std::printf("gradapt::linalg: AᵀA = [%g %g; %g %g]\n", c[0], c[1], c[2], c[3]);
  if (c != std::vector<double>{10, 14, 14, 20}) return 1;
#endif
  return total == 3.0 ? 0 : 1;
}

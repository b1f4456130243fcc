// Built against an installed gradapt: a two-rank allreduce over the threads communicator.
#include <gradapt/gradapt.hpp>

#include <cstdio>
#include <vector>

int main() {
  double total = 0;
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& c) {
    std::vector<double> v{double(c.rank() + 1)};
    c.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
    if (c.rank() == 0) total = v[0];
  });
  std::printf("installed gradapt %d.%d.%d: allreduce over 2 ranks = %g\n", GRADAPT_VERSION_MAJOR,
              GRADAPT_VERSION_MINOR, GRADAPT_VERSION_PATCH, total);
  return total == 3.0 ? 0 : 1;
}

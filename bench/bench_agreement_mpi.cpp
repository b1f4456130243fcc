// bench_agreement over comm::mpi: what the cross-rank agreement costs a data-parallel step
// when the ranks are processes (see agreement_measure.hpp for what is timed). A plain harness
// with its own main, like the other MPI benches:
//
//   mpirun -np 4 build/default/bench/bench_agreement_mpi
//
// Rank 0 prints the medians and the agreement's share of a step.
#include <mpi.h>

#include <cstdio>

#include "agreement_measure.hpp"
#include "gradapt/comm/mpi.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int code = 0;
  try {
    gradapt::comm::mpi comm;
    gradapt_bench::agreement_samples samples;
    gradapt_bench::measure_agreement(comm, samples);
    if (comm.rank() == 0) samples.result().print(comm.size(), "comm::mpi");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_agreement_mpi: %s\n", e.what());
    code = 1;
  }
  MPI_Finalize();
  return code;
}

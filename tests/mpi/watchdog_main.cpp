// The MPI watchdog, run by ctest under mpiexec with 3 ranks (tests/mpi/CMakeLists.txt); each
// case passes when the expected message appears, and the test's TIMEOUT fails a hang.
//  - `missing` (mpi.watchdog): rank 0 never enters the allreduce ranks 1 and 2 wait in (it
//    sleeps, as a rank busy elsewhere would). After mpi_options::timeout (1 s) every waiting
//    rank prints an error naming the operation and rank 0 as missing, and the job is aborted.
//  - `elsewhere` (mpi.watchdog_elsewhere): rank 0 waits in an allreduce, rank 1 in an exchange
//    with rank 2, and rank 2 sleeps. Rank 0's error names rank 2 as missing and says that
//    rank 1 waits in exchange (rank 1's own timeout is longer, so rank 0 prints first).
#include <mpi.h>

#include <chrono>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "gradapt/comm/mpi.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::string_view mode = argc > 1 ? argv[1] : "missing";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const double timeout = (mode == "elsewhere" && rank == 1) ? 20.0 : 1.0;
  gradapt::comm::mpi comm{MPI_COMM_WORLD, {.timeout = timeout}};
  std::vector<float> v(4, 1.0f), w(4, 0.0f);
  const int sleeper = mode == "elsewhere" ? 2 : 0;
  if (comm.rank() == sleeper) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // the job is aborted long before
  } else if (mode == "elsewhere" && comm.rank() == 1) {
    comm.exchange(2, gradapt::host_view(std::as_const(v)), gradapt::host_view(w));
  } else {
    comm.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
  }
  MPI_Finalize();
  return 0;
}

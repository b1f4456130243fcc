// The MPI watchdog: rank 0 never enters the allreduce the other ranks wait in (it sleeps, as a
// rank busy elsewhere would). After mpi_options::timeout (1 s here) every waiting rank prints
// an error naming the operation and the job is aborted; ctest passes when the message appears
// (tests/mpi/CMakeLists.txt, mpi.watchdog), and its TIMEOUT fails a hang.
#include <mpi.h>

#include <chrono>
#include <thread>
#include <vector>

#include "gradapt/comm/mpi.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  gradapt::comm::mpi comm{MPI_COMM_WORLD, {.timeout = 1.0}};
  if (comm.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // the job is aborted long before
  } else {
    std::vector<float> v(4, 1.0f);
    comm.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
  }
  MPI_Finalize();
  return 0;
}

// Catch2 main for the MPI tests: MPI_Init_thread before the session, MPI_Finalize after.
// Only rank 0 prints; another rank's report is captured and printed (prefixed with its rank)
// only when that rank has a failure. The exit status is the maximum over all ranks, so a
// failure on any rank fails every process and therefore mpirun and the ctest entry.
#include "catch_session.hpp"

#include <mpi.h>

#include <iostream>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  int provided = 0;
  // The threads-vs-MPI test starts threads, but only the main thread calls MPI.
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    std::cerr << "gradapt MPI tests: MPI_Init_thread failed\n";
    return 1;
  }
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  std::ostringstream captured;
  std::streambuf* const console = rank == 0 ? nullptr : std::cout.rdbuf(captured.rdbuf());
  const int result = gradapt_test::run_catch_lists_ok(argc, argv);
  if (console != nullptr) std::cout.rdbuf(console);
  if (result != 0 && rank != 0) {
    std::istringstream lines(captured.str());
    std::ostringstream report;
    for (std::string line; std::getline(lines, line);) report << "[rank " << rank << "] " << line << '\n';
    std::cerr << report.str() << std::flush;
  }

  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    std::cout << "gradapt MPI tests on " << size << " rank(s): "
              << (worst == 0 ? "passed on every rank"
                             : "FAILED on at least one rank (see the [rank r] reports)")
              << std::endl;
  MPI_Finalize();
  return worst > 255 ? 255 : worst;
}

#pragma once
// Communicator calls that differ between rank 0 and the other ranks, written once over the
// communicator: another collective, reduction op, element type, or an invalid argument on
// rank 0. The threads test (tests/test_comm.cpp) runs every case on 2, 3 and 5 threads ranks,
// the MPI test (tests/mpi/test_mpi_errors.cpp) on MPI_COMM_WORLD when it has 2 or more ranks.
#include <functional>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "scenarios/disagreement.hpp"

namespace collective_scenario {

using disagreement_scenario::disagreement_case;

/// Rank 0 runs `first`, every other rank `others`.
template <class Comm, class F, class G>
std::function<void(Comm&)> rank0_else(F first, G others) {
  return [first, others](Comm& c) {
    if (c.rank() == 0)
      first(c);
    else
      others(c);
  };
}

/// Another collective, op, element type or argument on rank 0; the text each rank's error
/// names.
template <class Comm>
std::vector<disagreement_case<Comm>> cases() {
  const auto split = [](Comm& c) { (void)c.split(0, 0); };
  const auto allreduce_float = [](Comm& c, gradapt::reduce_op op) {
    std::vector<float> v(4, 1.0f);
    c.allreduce(gradapt::host_view(v), op);
  };
  const auto allreduce = [allreduce_float](Comm& c) { allreduce_float(c, gradapt::reduce_op::sum); };
  const auto allreduce_max = [allreduce_float](Comm& c) { allreduce_float(c, gradapt::reduce_op::max); };
  const auto allreduce_double = [](Comm& c) {
    std::vector<double> v(4, 1.0);
    c.allreduce(gradapt::host_view(v), gradapt::reduce_op::sum);
  };
  const auto barrier = [](Comm& c) { c.barrier(); };
  const auto broadcast_from = [](int root) {
    return [root](Comm& c) {
      std::vector<float> v(3);
      c.broadcast(gradapt::host_view(v), root);
    };
  };
  return {
      {"split on rank 0, allreduce elsewhere", rank0_else<Comm>(split, allreduce),
       "must call the same collective"},
      {"allreduce on rank 0, split elsewhere", rank0_else<Comm>(allreduce, split),
       "must call the same collective"},
      {"barrier on rank 0, allreduce elsewhere", rank0_else<Comm>(barrier, allreduce),
       "must call the same collective"},
      {"max on rank 0, sum elsewhere", rank0_else<Comm>(allreduce_max, allreduce), "uses reduce_op::max"},
      {"float on rank 0, double elsewhere", rank0_else<Comm>(allreduce, allreduce_double), "passes float64"},
      {"a negative color on rank 0", rank0_else<Comm>([](Comm& c) { (void)c.split(-1, 0); }, split),
       "color -1", 0, "rank 0 passed invalid arguments"},
      {"root 7 on rank 0", rank0_else<Comm>(broadcast_from(7), broadcast_from(0)), "root 7 is out of range",
       0, "rank 0 passed invalid arguments"},
  };
}

}  // namespace collective_scenario

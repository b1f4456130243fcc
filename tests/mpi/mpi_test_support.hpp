#pragma once
// Helpers shared by the MPI tests: exact-valued inputs, conversions, bitwise comparison.
//
// Every input is a small dyadic rational (a multiple of 1/4 below 16 in magnitude), so it is
// exact in half and bfloat16, and every partial sum of at most 5 of them is exact too: results
// do not depend on the order in which MPI (or any engine) combines ranks, and each expected
// value is computed here in closed form or by a plain loop in double.

#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "exact_values.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "scenarios/comm_ops.hpp"
#include "thrown_message.hpp"

namespace mpitest {

using exact::make;
using exact::same_bits;
using exact::value;
using namespace comm_ops;
using gradapt::bfloat16;
using gradapt::half;
using gradapt::reduce_op;
using gradapt::comm::mpi;
using gradapt::comm::mpi_options;

/// Runs f and returns the message of the gradapt::error it throws ("no error" otherwise;
/// any other exception propagates and fails the test).
template <class F>
std::string error_of(F&& f) {
  return gradapt_test::thrown_message(std::forward<F>(f));
}

/// A sum over all ranks that must come out right after an error.
inline void still_works(mpi& c) {
  std::vector<float> x{1.0f, 2.0f};
  c.allreduce(view(x), reduce_op::sum);
  CHECK(x[0] == static_cast<float>(c.size()));
  CHECK(x[1] == static_cast<float>(2 * c.size()));
}

/// Rank and size of MPI_COMM_WORLD.
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace mpitest

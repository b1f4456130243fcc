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

#include "exact_values.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace mpitest {

using exact::make;
using exact::same_bits;
using exact::value;
using gradapt::bfloat16;
using gradapt::half;
using gradapt::reduce_op;
using gradapt::comm::mpi;
using gradapt::comm::mpi_options;

/// Summed input of rank r at index i: in [-1/2, 3] for r < 5, a multiple of 1/4.
inline double a(int r, std::size_t i) { return 0.5 * (r + 1) + 0.25 * static_cast<double>(i % 7) - 1.0; }

/// Maxed input of rank r at index i: the largest value moves between ranks with i.
inline double b(int r, std::size_t i) {
  return 0.5 * static_cast<double>((static_cast<std::size_t>(r) * 3 + i) % 5) - 1.0;
}

/// n elements of T with element i = f(i).
template <class T, class F>
std::vector<T> fill(std::size_t n, F&& f) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(f(i));
  return v;
}

/// The values of a vector, widened to double (for readable Catch2 comparisons).
template <class T>
std::vector<double> values(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = value(v[i]);
  return out;
}

/// Reference values: element i = f(i), rounded through T as the test's inputs are.
template <class T, class F>
std::vector<double> expect(std::size_t n, F&& f) {
  return values(fill<T>(n, std::forward<F>(f)));
}

/// Read-only host view of a vector.
template <class T>
gradapt::tensor_view<const T> cview(const std::vector<T>& v) {
  return gradapt::tensor_view<const T>::vector(v.data(), static_cast<std::int64_t>(v.size()));
}

/// Writable host view of a vector.
template <class T>
gradapt::tensor_view<T> view(std::vector<T>& v) {
  return gradapt::tensor_view<T>::vector(v.data(), static_cast<std::int64_t>(v.size()));
}

/// Runs f and returns the message of the gradapt::error it throws ("no error" otherwise;
/// any other exception propagates and fails the test).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const gradapt::error& e) {
    return e.what();
  }
  return "no error";
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

/// Partner of rank r in round k of a round-robin over the ring: (k - r) mod n. The pairing is
/// symmetric (the partner's partner is r), so over rounds k = 0..n-1 every rank exchanges once
/// with every rank, itself included.
inline int partner(int r, int k, int n) { return ((k - r) % n + n) % n; }

}  // namespace mpitest

#pragma once
// Exact element values shared by the threads and MPI tests: stores and loads of exactly
// representable doubles in float, double, half and bfloat16, bitwise comparison, the exactly
// rounded rank mean, and a bitwise check that every rank holds the same copy.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace exact {

/// Stores v in element type T, rounded through T's compute type (exact for the exactly
/// representable values the communicator tests use).
template <class T>
T make(double v) {
  T t;
  gradapt::store(t, static_cast<gradapt::compute_t<T>>(v));
  return t;
}

/// Value of a stored element, widened to double.
template <class T>
double value(T x) {
  return static_cast<double>(gradapt::load(x));
}

/// Bitwise equality of two vectors of the same element type.
template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

/// Bitwise equality of two doubles.
inline bool same_bits(double x, double y) {
  return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
}

/// The stored mean of exact inputs summing to `sum` over n ranks: the quotient rounded to the
/// compute type (double for double, float otherwise), then to T.
template <class T>
T expected_mean(long double sum, int n) {
  const long double q = sum / static_cast<long double>(n);
  if constexpr (std::is_same_v<T, double>)
    return static_cast<double>(q);
  else
    return T(static_cast<float>(q));
}

/// True when every rank's copy of v has the same bits as this rank's (a collective: every
/// rank calls it with the same size).
template <class Comm, class T>
bool identical_on_every_rank(Comm& comm, const std::vector<T>& v) {
  std::vector<T> all(v.size() * static_cast<std::size_t>(comm.size()));
  comm.allgather(gradapt::tensor_view<const T>::vector(v.data(), static_cast<std::int64_t>(v.size())),
                 gradapt::tensor_view<T>::vector(all.data(), static_cast<std::int64_t>(all.size())));
  bool same = true;
  for (int r = 0; r < comm.size() && !v.empty(); ++r)  // memcmp needs non-null pointers
    same = same && std::memcmp(all.data() + static_cast<std::size_t>(r) * v.size(), v.data(),
                               v.size() * sizeof(T)) == 0;
  return same;
}

}  // namespace exact

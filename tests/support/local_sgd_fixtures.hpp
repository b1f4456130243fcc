#pragma once
// Fixtures of the Local SGD tests: values exact in every element type (multiples of 1/4), the
// exactly rounded rank mean, bit comparisons and views over buffers.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "rank_check.hpp"

using Catch::Matchers::Contains;
using gradapt::adaptive_period;
using gradapt::bfloat16;
using gradapt::fixed_period;
using gradapt::half;
using gradapt::hierarchical_level;
using gradapt::hierarchical_period;
using gradapt::local_sgd;
using gradapt::tensor_view;
using threads_comm = gradapt::comm::threads;

namespace local_sgd_test {

constexpr int world_marker = hierarchical_level::world;

template <class T>
T make(double v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return static_cast<T>(v);
  else
    return T(static_cast<float>(v));
}

template <class T>
double value(T x) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return static_cast<double>(x);
  else
    return static_cast<double>(static_cast<float>(x));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline bool same_bits(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}

/// Views over a set of buffers (one tensor per buffer).
template <class T>
inline std::vector<tensor_view<T>> views_of(std::vector<std::vector<T>>& bufs) {
  std::vector<tensor_view<T>> v;
  for (auto& b : bufs) v.push_back(tensor_view<T>::vector(b.data(), static_cast<std::int64_t>(b.size())));
  return v;
}

/// Input of rank r at element i: a multiple of 1/4 in [-4, 4].
inline double dyadic(int r, std::size_t i) {
  return 0.25 * static_cast<double>(static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 3) % 33) - 16);
}

/// The expected stored mean: the exact quotient rounded to the compute type, then to T.
template <class T>
T expected_mean(long double sum, int n) {
  const long double q = sum / static_cast<long double>(n);
  if constexpr (std::is_same_v<T, double>)
    return static_cast<double>(q);
  else
    return T(static_cast<float>(q));
}

}  // namespace local_sgd_test

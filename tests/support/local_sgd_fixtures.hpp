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

#include "exact_values.hpp"
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

using exact::make;
using exact::same_bits;
using exact::value;

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

using exact::expected_mean;

}  // namespace local_sgd_test

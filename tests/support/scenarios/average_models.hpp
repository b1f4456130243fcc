#pragma once
// average_models on random float values, written once over the communicator: the threads test
// (tests/test_local_sgd.cpp) runs it on 1 to 8 threads ranks, the MPI test
// (tests/mpi/test_mpi_local_sgd.cpp) on MPI_COMM_WORLD with a buffer large enough for the
// engine's large-message algorithm.
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "catch.hpp"
#include "gradapt/gradapt.hpp"

namespace average_scenario {

/// Rank r's input: `size` normal floats (σ = 3) from the seed `seed + r`.
inline std::vector<float> random_input(int r, unsigned seed, std::size_t size) {
  std::mt19937 rng(seed + static_cast<unsigned>(r));
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(size);
  for (float& x : v) x = nd(rng);
  return v;
}

/// This rank's input averaged over the communicator.
template <class Comm>
std::vector<float> averaged(Comm& comm, unsigned seed, std::size_t size) {
  auto x = random_input(comm.rank(), seed, size);
  const std::vector<gradapt::tensor_view<float>> list = {gradapt::host_view(x)};
  gradapt::average_models(comm, gradapt::host{.threads = 1}, list);
  return x;
}

/// `got` (the average over n ranks) lies within rounding of the exact mean of the inputs, in
/// any summation order: n − 1 float additions within u each, then the division. With one rank
/// the input comes back unchanged.
inline void require_within_rounding_of_mean(const std::vector<float>& got, int n, unsigned seed) {
  std::vector<std::vector<float>> in;
  for (int r = 0; r < n; ++r) in.push_back(random_input(r, seed, got.size()));
  const long double u = std::ldexp(1.0L, -24);
  for (std::size_t i = 0; i < got.size(); ++i) {
    long double sum = 0, abs_sum = 0;
    for (const auto& v : in) {
      sum += v[i];
      abs_sum += std::fabs(static_cast<long double>(v[i]));
    }
    const long double mean = sum / n;
    const long double bound = 1.01L * u * (static_cast<long double>(n - 1) * abs_sum / n + std::fabs(mean));
    if (!(std::fabs(static_cast<long double>(got[i]) - mean) <= bound) || (n == 1 && got[i] != in[0][i])) {
      CAPTURE(n, i, got[i], static_cast<double>(mean));
      REQUIRE(false);
    }
  }
}

}  // namespace average_scenario

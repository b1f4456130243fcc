#pragma once
// The bucket reducer (gradapt/bucket/reducer.hpp) written once over the communicator: the
// threads test (tests/test_bucket_reducer.cpp) and the MPI test
// (tests/mpi/test_mpi_bucket_reducer.cpp) build their gradients, layouts and reference rounds
// from these helpers.
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <vector>

#include "gradapt/bucket/plan.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace bucket_scenarios {

using grads = std::vector<std::vector<float>>;

/// Gradients of rank r at round k: sizes `sizes`; element of tensor t is `f(d(rng), t)` with
/// one generator seeded by r and k (and one distribution `d`) for the whole list.
template <class Dist, class F>
grads seeded_grads(const std::vector<std::size_t>& sizes, int r, int k, Dist d, F f) {
  std::mt19937 rng(static_cast<unsigned>(1000 * r + 17 * k + 3));
  grads g(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    g[t].resize(sizes[t]);
    for (auto& x : g[t]) x = f(d(rng), t);
  }
  return g;
}

inline std::vector<gradapt::tensor_view<float>> views_of(grads& g) {
  std::vector<gradapt::tensor_view<float>> v;
  for (auto& x : g) v.push_back(gradapt::host_view(x));
  return v;
}

/// The float layout of tensors of `sizes` elements.
inline std::vector<gradapt::bucket::tensor_info> infos(const std::vector<std::size_t>& sizes) {
  std::vector<gradapt::bucket::tensor_info> v;
  for (const auto s : sizes) v.push_back({s});
  return v;
}

/// The per-tensor reference: each gradient allreduced and divided by the rank count.
template <class Comm>
grads per_tensor_mean(Comm& comm, grads g) {
  for (auto& w : g) {
    comm.allreduce(gradapt::host_view(w), gradapt::reduce_op::sum);
    for (auto& x : w) x = x / static_cast<float>(comm.size());
  }
  return g;
}

/// A random order of the n gradients, its own for each rank and round.
inline std::vector<std::size_t> shuffled(std::size_t n, unsigned seed) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  return order;
}

/// One round of `red` over its gradient buffers `g`: copies `fresh` into them, computes the
/// per-tensor mean of those values, marks the gradients in this rank's own order (calling
/// `after_mark(t)` after marking t) and waits. Returns the per-tensor mean, which `g` must now
/// equal bit for bit.
template <class Comm, class AfterMark>
grads mean_round(Comm& comm, gradapt::bucket::reducer<Comm, float>& red, grads& g, const grads& fresh,
                 int round, AfterMark&& after_mark) {
  for (std::size_t t = 0; t < g.size(); ++t) std::copy(fresh[t].begin(), fresh[t].end(), g[t].begin());
  const auto want = per_tensor_mean(comm, g);
  for (const std::size_t t : shuffled(g.size(), static_cast<unsigned>(comm.rank() * 31 + round))) {
    red.mark_ready(t);
    after_mark(t);
  }
  red.wait();
  return want;
}

}  // namespace bucket_scenarios

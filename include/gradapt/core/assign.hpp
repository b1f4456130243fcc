#pragma once
/// @file
/// Deterministic assignment of weighted items to ranks by the longest-processing-time rule
/// (Graham 1969): the sharded optimizer's tensor partition (cost = elements) and Shampoo's
/// distributed roots (cost = Σ n³ of a block's factors) both use it.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "gradapt/core/error.hpp"

namespace gradapt {

/// Assigns item i of cost `cost[i]` to a rank in [0, ranks): items in decreasing cost (ties:
/// the lower index first), each to the rank with the least load so far (ties: the lower
/// rank). Returns the rank of each item; `load`, when not empty, receives each rank's total
/// cost (it must hold `ranks` entries).
///
/// Deterministic: a function of the costs and `ranks` only, so every rank computes the same
/// assignment without communicating. Bound: the most loaded rank's cost is at most the least
/// loaded rank's plus the largest item's (the last item given to the most loaded rank went to
/// the least loaded one at that time), so it is at most total / ranks + max cost.
/// @throws gradapt::error when ranks < 1 or `load` has another size than `ranks`
template <std::unsigned_integral T>
std::vector<int> lpt_assign(std::span<const T> cost, int ranks, std::span<T> load = {}) {
  detail::require(ranks >= 1, "lpt_assign: ranks is ", ranks, " (expected >= 1)");
  detail::require(load.empty() || load.size() == static_cast<std::size_t>(ranks), "lpt_assign: load holds ",
                  load.size(), " entries for ", ranks, " ranks");
  std::vector<std::size_t> order(cost.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return cost[x] > cost[y]; });
  std::vector<T> sum(static_cast<std::size_t>(ranks), T(0));
  std::vector<int> rank_of(cost.size(), 0);
  for (const std::size_t i : order) {
    const auto r = static_cast<std::size_t>(std::min_element(sum.begin(), sum.end()) - sum.begin());
    rank_of[i] = static_cast<int>(r);
    sum[r] += cost[i];
  }
  if (!load.empty()) std::copy(sum.begin(), sum.end(), load.begin());
  return rank_of;
}

}  // namespace gradapt

#pragma once
// How far a library run lands from an independent reference run of the same steps, in units
// of what the reference's optimizer did (tests of Adafactor and SM3 against their long double
// re-computations).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "catch.hpp"

namespace run_compare {

// The largest |mine - theirs| over every parameter, divided by the largest movement of the
// reference from `start`: 1e-4 means "a 1e-4 fraction of what the optimizer did". Both sides
// round p to float every step, so four ulps of the largest |p| are allowed first. `T` has a
// float vector `p`; the three lists hold the same tensors.
template <class T>
double relative_difference(const std::vector<T>& mine, const std::vector<T>& theirs,
                           const std::vector<T>& start) {
  REQUIRE(mine.size() == theirs.size());
  REQUIRE(start.size() == theirs.size());
  double move = 0, err = 0, top = 0;
  for (std::size_t k = 0; k < mine.size(); ++k) {
    REQUIRE(mine[k].p.size() == theirs[k].p.size());
    for (std::size_t i = 0; i < mine[k].p.size(); ++i) {
      REQUIRE(std::isfinite(mine[k].p[i]));
      move = std::max(move, std::fabs(double(theirs[k].p[i]) - double(start[k].p[i])));
      err = std::max(err, std::fabs(double(mine[k].p[i]) - double(theirs[k].p[i])));
      top = std::max(top, std::fabs(double(theirs[k].p[i])));
    }
  }
  REQUIRE(move > 0);
  return std::max(0.0, err - 4 * std::ldexp(top, -23)) / move;
}

}  // namespace run_compare

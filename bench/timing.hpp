// Timing helpers shared by the plain (non-Google-Benchmark) harnesses.
#pragma once

#include <algorithm>
#include <vector>

namespace gradapt_bench {

/// The median of v (the mean of the two middle values for an even count; v non-empty).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace gradapt_bench

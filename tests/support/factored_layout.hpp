#pragma once
// Plain loops over the [A, X, B, Y, C] view of a factored tensor (reduce_factored,
// apply_factored), shared by the host and CUDA factored-backend tests.
#include <array>
#include <cstddef>
#include <cstdint>

namespace gradapt_test {

/// Calls f(e, iy, ix) for every element of a tensor laid out as d = [A, X, B, Y, C], in
/// element order: e is the element's index, iy its index in the statistic that sums Y out
/// ([A, X, B, C]), ix its index in the one that sums X out ([A, B, Y, C]).
template <class F>
void for_each_factored(const std::array<std::int64_t, 5>& d, F&& f) {
  const auto A = static_cast<std::size_t>(d[0]), X = static_cast<std::size_t>(d[1]),
             B = static_cast<std::size_t>(d[2]), Y = static_cast<std::size_t>(d[3]),
             C = static_cast<std::size_t>(d[4]);
  for (std::size_t a = 0; a < A; ++a)
    for (std::size_t i = 0; i < X; ++i)
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t j = 0; j < Y; ++j)
          for (std::size_t c = 0; c < C; ++c) {
            const std::size_t e = (((a * X + i) * B + b) * Y + j) * C + c;
            f(e, ((a * X + i) * B + b) * C + c, ((a * B + b) * Y + j) * C + c);
          }
}

}  // namespace gradapt_test

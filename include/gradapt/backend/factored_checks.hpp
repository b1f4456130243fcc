#pragma once
/// @file
/// The argument checks of the backends' factored operations (a tensor seen as
/// [A, X, B, Y, C] with row and column vectors), shared by gradapt::host and gradapt::cuda so
/// that one rule holds on both. Each message starts with the caller's `prefix` and `what`
/// ("host backend " and "reduce_factored").

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gradapt/core/error.hpp"

namespace gradapt::detail {

/// The five extents of `d` after checking that each is non-negative and that together they
/// hold the tensor's `n` elements.
inline std::array<std::size_t, 5> factored_dims(const std::array<std::int64_t, 5>& d, std::size_t n,
                                                std::string_view prefix, std::string_view what) {
  std::size_t prod = 1;
  for (std::size_t k = 0; k < 5; ++k) {
    require(d[k] >= 0, prefix, what, ": factored dim ", k, " is ", d[k],
            " (expected non-negative [A, X, B, Y, C])");
    prod *= static_cast<std::size_t>(d[k]);
  }
  require(prod == n, prefix, what, ": factored dims [", d[0], ", ", d[1], ", ", d[2], ", ", d[3], ", ", d[4],
          "] hold ", prod, " elements but the tensor has ", n);
  return {static_cast<std::size_t>(d[0]), static_cast<std::size_t>(d[1]), static_cast<std::size_t>(d[2]),
          static_cast<std::size_t>(d[3]), static_cast<std::size_t>(d[4])};
}

/// A vector `name` of a factored operation holds `got` elements where `want` are expected
/// (0 also allowed when `optional`); `product` names the extents' product ("A*X*B*C") in the
/// message, or is empty.
inline void check_factored_vector(std::string_view prefix, std::string_view what, std::string_view name,
                                  std::size_t got, std::size_t want, std::string_view product,
                                  bool optional = true) {
  require((optional && got == 0) || got == want, prefix, what, ": ", name, " has ", got,
          " elements (expected ", product, product.empty() ? "" : " = ", want, optional ? ", or 0)" : ")");
}

}  // namespace gradapt::detail

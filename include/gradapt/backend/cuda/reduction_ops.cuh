#pragma once
/// @file
/// The element math of the CUDA backend's reductions, as GRADAPT_HD functions so host code
/// (tests, references) runs exactly what the kernels run. Included only from .cu units.
///
/// Each op has `identity()`, `fold(acc, x...)` (one element into a lane accumulator, values
/// already widened to double) and `combine(a, b)` (two partial results). Products use fma,
/// which is correctly rounded on host and device alike, so a host re-computation in the
/// partition order of gradapt/backend/chunking.hpp reproduces the device bits.

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gradapt/core/config.hpp"
#include "gradapt/core/ops.hpp"

namespace gradapt::detail::cuda_ops {

/// A quiet NaN (0x7ff8000000000000), built without <limits> so device code can use it.
GRADAPT_HD GRADAPT_INLINE double quiet_nan() {
  const std::uint64_t bits = 0x7ff8000000000000ull;
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

/// sum of x: fold `a + x`, combine `a + b`.
struct sum {
  static constexpr reduction kind = reduction::sum;
  GRADAPT_HD static double identity() { return 0.0; }
  GRADAPT_HD static double fold(double a, double x) { return a + x; }
  GRADAPT_HD static double combine(double a, double b) { return a + b; }
};

/// sum of x^2: fold `fma(x, x, a)`, combine `a + b`.
struct sum_squares {
  static constexpr reduction kind = reduction::sum_squares;
  GRADAPT_HD static double identity() { return 0.0; }
  GRADAPT_HD static double fold(double a, double x) { return ::fma(x, x, a); }
  GRADAPT_HD static double combine(double a, double b) { return a + b; }
};

/// max |x|: fold `combine(a, |x|)`; combine is max, NaN if either side is NaN (a canonical
/// quiet NaN). Identity 0, so an empty tensor gives 0.
struct max_abs {
  static constexpr reduction kind = reduction::max_abs;
  GRADAPT_HD static double identity() { return 0.0; }
  GRADAPT_HD static double combine(double a, double b) {
    if (a != a || b != b) return quiet_nan();
    return b > a ? b : a;
  }
  GRADAPT_HD static double fold(double a, double x) { return combine(a, ::fabs(x)); }
};

/// number of inf/NaN elements: fold `a + (|x| <= DBL_MAX ? 0 : 1)`, combine `a + b` (exact
/// below 2^53 elements).
struct count_nonfinite {
  static constexpr reduction kind = reduction::count_nonfinite;
  GRADAPT_HD static double identity() { return 0.0; }
  GRADAPT_HD static double fold(double a, double x) { return a + (::fabs(x) <= DBL_MAX ? 0.0 : 1.0); }
  GRADAPT_HD static double combine(double a, double b) { return a + b; }
};

/// sum of x*y: fold `fma(x, y, a)`, combine `a + b`.
struct dot {
  GRADAPT_HD static double identity() { return 0.0; }
  GRADAPT_HD static double fold(double a, double x, double y) { return ::fma(x, y, a); }
  GRADAPT_HD static double combine(double a, double b) { return a + b; }
};

/// Calls `fn(op)` with the op type matching `r` (a value of sum, sum_squares, max_abs or
/// count_nonfinite) and returns its result.
template <class Fn>
decltype(auto) visit(reduction r, Fn&& fn) {
  switch (r) {
    case reduction::sum:
      return fn(sum{});
    case reduction::sum_squares:
      return fn(sum_squares{});
    case reduction::max_abs:
      return fn(max_abs{});
    case reduction::count_nonfinite:
      return fn(count_nonfinite{});
  }
  return fn(sum{});  // unreachable for valid enumerators; callers validate `r` first
}

/// True for the four reduction enumerators.
constexpr bool valid(reduction r) {
  return r == reduction::sum || r == reduction::sum_squares || r == reduction::max_abs ||
         r == reduction::count_nonfinite;
}

}  // namespace gradapt::detail::cuda_ops

#pragma once
// The long double Adasum reference shared by the host, MPI and CUDA Adasum tests: element
// access in long double, unit roundoffs, and the tree of docs/algorithms/adasum.md computed in
// long double. Depends on gradapt's element types only (no backend), so nvcc compiles it too.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/dtype.hpp"

namespace adasum_test {

template <class T>
using tlist = std::vector<std::vector<T>>;  // one rank's tensors
using ldlist = std::vector<std::vector<long double>>;

template <class T>
inline long double val(T x) {
  return static_cast<long double>(gradapt::load(x));
}

/// Unit roundoff of T's significand.
template <class T>
inline long double eps() {
  if constexpr (std::is_same_v<T, double>) return std::numeric_limits<double>::epsilon() / 2;
  if constexpr (std::is_same_v<T, float>) return std::numeric_limits<float>::epsilon() / 2;
  if constexpr (std::is_same_v<T, gradapt::half>) return std::ldexp(1.0L, -11);
  return std::ldexp(1.0L, -8);  // bfloat16
}

inline int floor_pow2(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

template <class T>
inline ldlist widen(const tlist<T>& l) {
  ldlist out;
  for (const auto& v : l) {
    std::vector<long double> w;
    for (T x : v) w.push_back(val(x));
    out.push_back(std::move(w));
  }
  return out;
}

/// The scale of tensor t's rounding error: sum over the ranks r of max_i |v_r,t[i]|.
template <class T>
inline long double rank_scale(const std::vector<tlist<T>>& inputs, std::size_t t) {
  long double scale = 0;
  for (const auto& in : inputs) {
    long double m = 0;
    for (T x : in[t]) m = std::max(m, std::fabs(val(x)));
    scale += m;
  }
  return scale;
}

/// One pairwise Adasum combination in long double; a side whose squared norm is at most
/// `threshold` gets coefficient 1.
inline ldlist ld_combine(const ldlist& a, const ldlist& b, long double threshold = 0) {
  ldlist out = a;
  for (std::size_t t = 0; t < a.size(); ++t) {
    long double ab = 0, aa = 0, bb = 0;
    for (std::size_t i = 0; i < a[t].size(); ++i) {
      ab += a[t][i] * b[t][i];
      aa += a[t][i] * a[t][i];
      bb += b[t][i] * b[t][i];
    }
    const long double alpha = aa <= threshold ? 1.0L : 1.0L - ab / (2 * aa);
    const long double beta = bb <= threshold ? 1.0L : 1.0L - ab / (2 * bb);
    for (std::size_t i = 0; i < a[t].size(); ++i) out[t][i] = alpha * a[t][i] + beta * b[t][i];
  }
  return out;
}

/// The tree over long double lists: the ranks past the largest power of two fold into the
/// first ones, then pairs combine level by level.
inline ldlist ld_tree_of(const std::vector<ldlist>& v, long double threshold = 0) {
  const int n = static_cast<int>(v.size());
  const int p = floor_pow2(n);
  std::vector<ldlist> x(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i) x[i] = i + p < n ? ld_combine(v[i], v[i + p], threshold) : v[i];
  for (int width = p; width > 1; width /= 2)
    for (int j = 0; j < width / 2; ++j) x[j] = ld_combine(x[2 * j], x[2 * j + 1], threshold);
  return x[0];
}

/// The tree over the ranks' lists, each widened to long double.
template <class T>
inline ldlist ld_tree(const std::vector<tlist<T>>& v, long double threshold = 0) {
  std::vector<ldlist> w;
  for (const auto& l : v) w.push_back(widen(l));
  return ld_tree_of(w, threshold);
}

}  // namespace adasum_test

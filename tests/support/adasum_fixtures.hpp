#pragma once
// Fixtures of the Adasum tests: rank inputs, the serial tree in the library's float/double
// scheme, the long double tree and a runner of the distributed algorithm over any communicator
// (see tests/test_adasum.cpp for what each reference is; tests/mpi/test_mpi_adasum.cpp runs the
// same runner on MPI).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "adasum_reference.hpp"
#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/param_list.hpp"
#include "rank_check.hpp"

namespace adasum_test {

using gradapt::adasum_mode;
using gradapt::adasum_options;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;

template <class T>
using C_t = gradapt::compute_t<T>;

template <class T>
T from(long double v) {
  T x{};
  gradapt::store(x, static_cast<C_t<T>>(v));
  return x;
}
template <class T>
inline bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
template <class T>
inline bool is_nan(T x) {
  return std::isnan(static_cast<double>(gradapt::load(x)));
}

/// `sizes.size()` tensors of random values in [-1, 1) rounded to T.
template <class T>
tlist<T> random_list(const std::vector<std::size_t>& sizes, std::uint64_t seed, double lo = -1.0,
                     double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  tlist<T> out;
  for (std::size_t n : sizes) {
    std::vector<T> v(n);
    for (auto& x : v) x = from<T>(d(rng));
    out.push_back(std::move(v));
  }
  return out;
}

inline std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& sizes) {
  std::vector<std::size_t> off{0};
  for (std::size_t s : sizes) off.push_back(off.back() + s);
  return off;
}

template <class T>
inline std::vector<std::size_t> sizes_of(const tlist<T>& l) {
  std::vector<std::size_t> s;
  for (const auto& v : l) s.push_back(v.size());
  return s;
}

/// One rank's tensors in separate buffers or carved, adjacent, from one buffer.
template <class T>
struct rank_tensors {
  std::vector<std::vector<T>> separate;
  std::vector<T> fused;
  std::vector<tensor_view<T>> views;

  rank_tensors(const tlist<T>& values, bool one_buffer) {
    if (one_buffer) {
      for (const auto& v : values) fused.insert(fused.end(), v.begin(), v.end());
      std::size_t off = 0;
      for (const auto& v : values) {
        views.push_back(tensor_view<T>::vector(fused.data() + off, static_cast<std::int64_t>(v.size())));
        off += v.size();
      }
    } else {
      separate = values;
      for (auto& v : separate) views.push_back(gradapt::host_view(v));
    }
  }
  tlist<T> values() const {
    tlist<T> out;
    for (const auto& v : views) out.emplace_back(v.data(), v.data() + v.size());
    return out;
  }
};

// ---- the serial reference in the library's float/double scheme ---------------------------------
template <class T>
struct serial {
  gradapt::host b{.threads = 1};
  double threshold = 0.0;

  /// Per-tensor dot of x and y over [lo, hi), summed as a halving tree of 2^depth pieces.
  double partial(const tlist<T>& x, const tlist<T>& y, const std::vector<std::size_t>& off, std::size_t t,
                 std::size_t lo, std::size_t hi, int depth) const {
    if (depth == 0) {
      const std::size_t s = std::max(off[t], lo), e = std::min(off[t + 1], hi);
      if (s >= e) return 0.0;
      const auto n = static_cast<std::int64_t>(e - s);
      return b.dot(tensor_view<const T>::vector(x[t].data() + (s - off[t]), n),
                   tensor_view<const T>::vector(y[t].data() + (s - off[t]), n));
    }
    const std::size_t mid = lo + (hi - lo) / 2;
    return partial(x, y, off, t, lo, mid, depth - 1) + partial(x, y, off, t, mid, hi, depth - 1);
  }

  tlist<T> combine(const tlist<T>& a, const tlist<T>& bb, int depth) const {
    using C = C_t<T>;
    const auto off = offsets_of(sizes_of(a));
    const std::size_t n = off.back();
    tlist<T> out = a;
    for (std::size_t t = 0; t < a.size(); ++t) {
      const double ab = partial(a, bb, off, t, 0, n, depth);
      const double aa = partial(a, a, off, t, 0, n, depth);
      const double bsq = partial(bb, bb, off, t, 0, n, depth);
      const double alpha = aa <= threshold ? 1.0 : 1.0 - 0.5 * (ab / aa);
      const double beta = bsq <= threshold ? 1.0 : 1.0 - 0.5 * (ab / bsq);
      const C ca = static_cast<C>(alpha), cb = static_cast<C>(beta);
      for (std::size_t i = 0; i < a[t].size(); ++i)
        gradapt::store(out[t][i], ca * gradapt::load(a[t][i]) + cb * gradapt::load(bb[t][i]));
    }
    return out;
  }

  /// The fold of ranks P + i into rank i (depth 1), then the tree (level k at depth k + 1).
  tlist<T> tree(const std::vector<tlist<T>>& v) const {
    const int n = static_cast<int>(v.size());
    const int p = floor_pow2(n);
    std::vector<tlist<T>> x(static_cast<std::size_t>(p));
    for (int i = 0; i < p; ++i) x[i] = i + p < n ? combine(v[i], v[i + p], 1) : v[i];
    for (int width = p, depth = 1; width > 1; width /= 2, ++depth)
      for (int j = 0; j < width / 2; ++j) x[j] = combine(x[2 * j], x[2 * j + 1], depth);
    return x[0];
  }

  /// Hierarchical mode: the group mean as comm::threads forms it (sum in rank order in the
  /// compute type, one rounding, then times 1/g in the compute type), then the tree.
  tlist<T> hierarchical(const std::vector<tlist<T>>& v, int g) const {
    using C = C_t<T>;
    const int n = static_cast<int>(v.size());
    std::vector<tlist<T>> means;
    for (int first = 0; first < n; first += g) {
      const int last = std::min(n, first + g);
      tlist<T> m = v[first];
      for (std::size_t t = 0; t < m.size(); ++t)
        for (std::size_t i = 0; i < m[t].size(); ++i) {
          C acc = gradapt::load(v[first][t][i]);
          for (int k = first + 1; k < last; ++k) acc = acc + gradapt::load(v[k][t][i]);
          gradapt::store(m[t][i], acc);
          if (last - first > 1)
            gradapt::store(m[t][i],
                           gradapt::load(m[t][i]) * static_cast<C>(1.0 / static_cast<double>(last - first)));
        }
      means.push_back(std::move(m));
    }
    return tree(means);
  }
};

// ---- the long double reference (widen, ld_combine, ld_tree: adasum_reference.hpp) ----------------
/// Tree levels a rank count goes through (fold included).
inline int levels_of(int n) {
  int l = 0;
  for (int p = floor_pow2(n); p > 1; p /= 2) ++l;
  return l + (floor_pow2(n) < n ? 1 : 0);
}

// ---- running the distributed algorithm -------------------------------------------------------------

/// The host backend without apply_reduce_list: the partials then take three `dot` passes.
struct host_three_dots {
  using space = host_space;
  gradapt::host h;
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, host_space>... v) const {
    h.apply(f, v...);
  }
  template <class F, class... Ls>
  void apply_list(F f, const Ls&... ls) const {
    h.apply_list(f, ls...);
  }
  template <class... A>
  double reduce(A&&... a) const {
    return h.reduce(std::forward<A>(a)...);
  }
  template <class... A>
  double dot(A&&... a) const {
    return h.dot(std::forward<A>(a)...);
  }
  void synchronize() const {}
};
static_assert(gradapt::backend<host_three_dots>);
static_assert(gradapt::detail::adasum::fused_dots<gradapt::host, std::vector<tensor_view<const float>>>,
              "the host backend takes the one-pass partials");
static_assert(!gradapt::detail::adasum::fused_dots<host_three_dots, std::vector<tensor_view<const float>>>);
#if GRADAPT_ADASUM_PACKS
static_assert(gradapt::simd::vectorizable_v<gradapt::detail::adasum::dots3> &&
                  gradapt::simd::vectorizable_v<gradapt::detail::adasum::combine<true>>,
              "the partials and the combine run on SIMD packs on the host");
#endif

struct run_config {
  bool one_buffer = false;
  int host_threads = 1;
  bool three_dots = false;
  adasum_options options = {};
};

/// Runs Adasum on this rank of `comm` over its tensors `in`; returns the result.
template <class T, class Comm>
tlist<T> adasum_on(Comm& comm, const tlist<T>& in, const run_config& cfg) {
  rank_tensors<T> mine(in, cfg.one_buffer);
  gradapt::adasum_workspace<T> ws(mine.views);
  gradapt::adasum<Comm> ada(comm, cfg.options);
  if (cfg.three_dots)
    ada.allreduce(host_three_dots{gradapt::host{.threads = cfg.host_threads}}, mine.views, ws);
  else
    ada.allreduce(gradapt::host{.threads = cfg.host_threads}, mine.views, ws);
  return mine.values();
}

/// Runs Adasum on n threads ranks over `inputs[r]`; returns every rank's result.
template <class T>
std::vector<tlist<T>> run_adasum(const std::vector<tlist<T>>& inputs, const run_config& cfg) {
  const int n = static_cast<int>(inputs.size());
  std::vector<tlist<T>> out(inputs.size());
  run_threads(n, [&](threads& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    out[r] = adasum_on(comm, inputs[r], cfg);
  });
  return out;
}

template <class T>
std::vector<tlist<T>> rank_inputs(int n, const std::vector<std::size_t>& sizes, std::uint64_t seed) {
  std::vector<tlist<T>> in;
  for (int r = 0; r < n; ++r) in.push_back(random_list<T>(sizes, seed * 131 + static_cast<std::uint64_t>(r)));
  return in;
}

/// Index of the first element where got and want differ in bits (NaN == NaN), or -1.
template <class T>
long first_difference(const tlist<T>& got, const tlist<T>& want) {
  long k = 0;
  for (std::size_t t = 0; t < want.size(); ++t)
    for (std::size_t i = 0; i < want[t].size(); ++i, ++k)
      if (!same_bits(got[t][i], want[t][i]) && !(is_nan(got[t][i]) && is_nan(want[t][i]))) return k;
  return -1;
}

/// Largest |error| / tolerance over all elements, with the tolerance of tensor t
/// 8 eps (levels + 1) sum_r max|v_r,t| (+ an absolute floor for subnormal results).
template <class T>
inline double worst_ratio(const tlist<T>& got, const ldlist& want, const std::vector<tlist<T>>& inputs,
                          long double floor_abs = 0) {
  const int levels = levels_of(static_cast<int>(inputs.size()));
  double worst = 0;
  for (std::size_t t = 0; t < want.size(); ++t) {
    const long double tol = 8 * eps<T>() * (levels + 1) * rank_scale(inputs, t) + floor_abs;
    for (std::size_t i = 0; i < want[t].size(); ++i) {
      const long double err = std::fabs(val(got[t][i]) - want[t][i]);
      if (!(err <= tol)) return std::numeric_limits<double>::infinity();
      if (tol > 0) worst = std::max(worst, static_cast<double>(err / tol));
    }
  }
  return worst;
}

/// List shapes: mixed (empty, one-element, more than one host block), a single element for up
/// to 8 ranks, odd totals, only empty tensors, no tensors, one large odd tensor, 40 small ones.
inline std::vector<std::vector<std::size_t>> shapes() {
  std::vector<std::vector<std::size_t>> s = {
      {1000, 1, 0, 15, 4097, 2}, {1}, {7, 0, 0, 13}, {0}, {}, {12345}, {3, 2}};
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> d(0, 300);
  std::vector<std::size_t> many;
  for (int k = 0; k < 40; ++k) many.push_back(k % 9 == 0 ? 0 : d(rng));
  s.push_back(many);
  return s;
}

}  // namespace adasum_test

// Adasum (gradapt/combine/adasum.hpp) on the threads communicator with 1 to 8 ranks.
//
// References written here, independently of the library's schedule:
//  - `serial`: the binary tree ((r0 (+) r1) (+) (r2 (+) r3)) ... with the fold of ranks beyond
//    the largest power of two, in the library's float/double scheme: per-tensor dot products
//    summed as a halving tree over 2^depth pieces (the backend's `dot` on each piece, the only
//    library code it uses), coefficients in double, element math in the compute type. The
//    distributed result must equal it bit for bit.
//  - `ld_tree`: the same tree in long double with whole-tensor dot products and no rounding;
//    results must agree within the rounding of the element type.
//  - closed forms: orthogonal inputs sum, equal inputs stay, parallel inputs average (a tree
//    of pairwise means), zero vectors are the identity.
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

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/param_list.hpp"
#include "rank_check.hpp"

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace {

using gradapt::adasum_mode;
using gradapt::adasum_options;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;

template <class T>
using C_t = gradapt::compute_t<T>;
template <class T>
using tlist = std::vector<std::vector<T>>;  // one rank's tensors
using ldlist = std::vector<std::vector<long double>>;

template <class T>
T from(long double v) {
  T x{};
  gradapt::store(x, static_cast<C_t<T>>(v));
  return x;
}
template <class T>
long double val(T x) {
  return static_cast<long double>(gradapt::load(x));
}
template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
template <class T>
bool is_nan(T x) {
  return std::isnan(static_cast<double>(gradapt::load(x)));
}

/// Unit roundoff of T's significand.
template <class T>
long double eps() {
  if constexpr (std::is_same_v<T, double>) return std::numeric_limits<double>::epsilon() / 2;
  if constexpr (std::is_same_v<T, float>) return std::numeric_limits<float>::epsilon() / 2;
  if constexpr (std::is_same_v<T, gradapt::half>) return std::ldexp(1.0L, -11);
  return std::ldexp(1.0L, -8);  // bfloat16
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

std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& sizes) {
  std::vector<std::size_t> off{0};
  for (std::size_t s : sizes) off.push_back(off.back() + s);
  return off;
}

template <class T>
std::vector<std::size_t> sizes_of(const tlist<T>& l) {
  std::vector<std::size_t> s;
  for (const auto& v : l) s.push_back(v.size());
  return s;
}

int floor_pow2(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
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

// ---- the long double reference -------------------------------------------------------------------
template <class T>
ldlist widen(const tlist<T>& l) {
  ldlist out;
  for (const auto& v : l) {
    std::vector<long double> w;
    for (T x : v) w.push_back(val(x));
    out.push_back(std::move(w));
  }
  return out;
}

ldlist ld_combine(const ldlist& a, const ldlist& b, long double threshold) {
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

template <class T>
ldlist ld_tree(const std::vector<tlist<T>>& v, long double threshold = 0) {
  const int n = static_cast<int>(v.size());
  const int p = floor_pow2(n);
  std::vector<ldlist> x(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i)
    x[i] = i + p < n ? ld_combine(widen(v[i]), widen(v[i + p]), threshold) : widen(v[i]);
  for (int width = p; width > 1; width /= 2)
    for (int j = 0; j < width / 2; ++j) x[j] = ld_combine(x[2 * j], x[2 * j + 1], threshold);
  return x[0];
}

/// Tree levels a rank count goes through (fold included).
int levels_of(int n) {
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

/// Runs Adasum on n threads ranks over `inputs[r]`; returns every rank's result.
template <class T>
std::vector<tlist<T>> run_adasum(const std::vector<tlist<T>>& inputs, const run_config& cfg) {
  const int n = static_cast<int>(inputs.size());
  std::vector<tlist<T>> out(inputs.size());
  run_threads(n, [&](threads& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    rank_tensors<T> mine(inputs[r], cfg.one_buffer);
    gradapt::adasum_workspace<T> ws(mine.views);
    gradapt::adasum<threads> ada(comm, cfg.options);
    if (cfg.three_dots)
      ada.allreduce(host_three_dots{gradapt::host{.threads = cfg.host_threads}}, mine.views, ws);
    else
      ada.allreduce(gradapt::host{.threads = cfg.host_threads}, mine.views, ws);
    out[r] = mine.values();
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
double worst_ratio(const tlist<T>& got, const ldlist& want, const std::vector<tlist<T>>& inputs,
                   long double floor_abs = 0) {
  const int levels = levels_of(static_cast<int>(inputs.size()));
  double worst = 0;
  for (std::size_t t = 0; t < want.size(); ++t) {
    long double scale = 0;
    for (const auto& in : inputs) {
      long double m = 0;
      for (T x : in[t]) m = std::max(m, std::fabs(val(x)));
      scale += m;
    }
    const long double tol = 8 * eps<T>() * (levels + 1) * scale + floor_abs;
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
std::vector<std::vector<std::size_t>> shapes() {
  std::vector<std::vector<std::size_t>> s = {
      {1000, 1, 0, 15, 4097, 2}, {1}, {7, 0, 0, 13}, {0}, {}, {12345}, {3, 2}};
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> d(0, 300);
  std::vector<std::size_t> many;
  for (int k = 0; k < 40; ++k) many.push_back(k % 9 == 0 ? 0 : d(rng));
  s.push_back(many);
  return s;
}

}  // namespace

TEMPLATE_TEST_CASE("adasum: distributed result equals the serial tree bit for bit", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  const auto all_shapes = shapes();
  for (int n = 1; n <= 8; ++n) {
    for (std::size_t s = 0; s < all_shapes.size(); ++s) {
      const auto inputs = rank_inputs<T>(n, all_shapes[s], 100 * s + static_cast<std::uint64_t>(n));
      const auto want = serial<T>{}.tree(inputs);
      for (const bool one_buffer : {false, true})
        for (const int threads_ : {1, 2}) {
          const auto got = run_adasum(inputs, {.one_buffer = one_buffer, .host_threads = threads_});
          for (int r = 0; r < n; ++r) {
            INFO("ranks " << n << ", shape " << s << ", one buffer " << one_buffer << ", host threads "
                          << threads_ << ", rank " << r);
            REQUIRE(sizes_of(got[r]) == all_shapes[s]);
            REQUIRE(first_difference(got[r], want) == -1);
          }
        }
    }
  }
}

TEMPLATE_TEST_CASE("adasum: one-pass partials equal three dot passes bit for bit", "[adasum]", float, double,
                   gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {5000, 3, 0, 777, 1};
  for (int n : {2, 3, 4, 7}) {
    const auto inputs = rank_inputs<T>(n, sizes, 55 + static_cast<std::uint64_t>(n));
    const auto fused = run_adasum(inputs, {});
    const auto three = run_adasum(inputs, {.three_dots = true});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(fused[r], three[r]) == -1);
    REQUIRE(first_difference(fused[0], serial<T>{}.tree(inputs)) == -1);
  }
}

TEST_CASE("adasum: without the layout agreement the result is the same", "[adasum]") {
  const std::vector<std::size_t> sizes = {129, 0, 1, 40};
  for (int n : {1, 2, 3, 6}) {
    const auto inputs = rank_inputs<float>(n, sizes, 12);
    const auto got = run_adasum(inputs, {.options = {.check_layout = false}});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(got[r], serial<float>{}.tree(inputs)) == -1);
  }
}

TEMPLATE_TEST_CASE("adasum: long double reference within rounding", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {300, 1, 0, 64, 4097};
  for (int n = 1; n <= 8; ++n) {
    const auto inputs = rank_inputs<T>(n, sizes, 900 + static_cast<std::uint64_t>(n));
    const auto got = run_adasum(inputs, {});
    const auto want = ld_tree(inputs);
    INFO("ranks " << n);
    const double ratio = worst_ratio(got[0], want, inputs);
    INFO("worst error / tolerance " << ratio);
    REQUIRE(ratio <= 1.0);
  }
}

TEMPLATE_TEST_CASE("adasum: orthogonal inputs give their sum exactly", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {37, 1, 16};
  for (int n = 1; n <= 8; ++n) {
    // Rank r owns the elements i with i % n == r: disjoint supports, exact zero dot products.
    std::vector<tlist<T>> inputs;
    for (int r = 0; r < n; ++r) {
      auto l = random_list<T>(sizes, 300 + static_cast<std::uint64_t>(r), 0.25, 2.0);
      for (auto& v : l)
        for (std::size_t i = 0; i < v.size(); ++i)
          if (static_cast<int>(i % static_cast<std::size_t>(n)) != r) v[i] = from<T>(0);
      inputs.push_back(l);
    }
    const auto got = run_adasum(inputs, {.one_buffer = n % 2 == 0});
    for (int r = 0; r < n; ++r)
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          INFO("ranks " << n << ", rank " << r << ", tensor " << t << ", element " << i);
          REQUIRE(same_bits(got[r][t][i], inputs[i % static_cast<std::size_t>(n)][t][i]));
        }
  }
}

TEMPLATE_TEST_CASE("adasum: equal inputs give the input exactly", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const auto one = random_list<T>({100, 1, 0, 33}, 17);
  for (int n = 1; n <= 8; ++n) {
    const std::vector<tlist<T>> inputs(static_cast<std::size_t>(n), one);
    const auto got = run_adasum(inputs, {});
    for (int r = 0; r < n; ++r) REQUIRE(first_difference(got[r], one) == -1);
  }
}

TEMPLATE_TEST_CASE("adasum: parallel inputs give the tree of pairwise means", "[adasum]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  // a (+) c a = (1 + c) a / 2 for any c != 0: rank r sends c_r u with c_r a power of two (so the
  // inputs are exactly parallel); the closed form is the same tree over the scalars c_r.
  const auto u = random_list<T>({50, 1, 9}, 23, 0.5, 1.0);
  const double cs[] = {1.0, 4.0, 0.5, -2.0, 2.0, 8.0, 0.25, -1.0};
  const auto tree_mean = [&](int n) {
    const int p = floor_pow2(n);
    std::vector<long double> x(static_cast<std::size_t>(p));
    for (int i = 0; i < p; ++i) x[i] = i + p < n ? (cs[i] + cs[i + p]) / 2 : cs[i];
    for (int width = p; width > 1; width /= 2)
      for (int j = 0; j < width / 2; ++j) x[j] = (x[2 * j] + x[2 * j + 1]) / 2;
    return x[0];
  };
  for (int n = 1; n <= 8; ++n) {
    std::vector<tlist<T>> inputs;
    for (int r = 0; r < n; ++r) {
      tlist<T> l = u;
      for (auto& v : l)
        for (auto& x : v) x = from<T>(cs[r] * val(x));
      inputs.push_back(l);
    }
    const long double m = tree_mean(n);
    const auto got = run_adasum(inputs, {});
    for (std::size_t t = 0; t < u.size(); ++t)
      for (std::size_t i = 0; i < u[t].size(); ++i) {
        const long double want = m * val(u[t][i]);
        INFO("ranks " << n << ", tensor " << t << ", element " << i << ": got " << val(got[0][t][i])
                      << ", closed form " << want);
        REQUIRE(std::fabs(val(got[0][t][i]) - want) <= 8 * eps<T>() * (levels_of(n) + 1) * 8 * val(u[t][i]));
      }
  }
  // Equal norms, opposite directions: the mean is zero, and exactly so.
  const std::vector<tlist<T>> opposite = {u, [&] {
                                            tlist<T> l = u;
                                            for (auto& v : l)
                                              for (auto& x : v) x = from<T>(-val(x));
                                            return l;
                                          }()};
  const auto got = run_adasum(opposite, {});
  for (const auto& v : got[1])
    for (T x : v) REQUIRE(val(x) == 0);
}

TEMPLATE_TEST_CASE("adasum: zero vectors are the identity", "[adasum]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {20, 0, 7};
  for (int n = 1; n <= 8; ++n)
    for (int k = 0; k < n; ++k) {
      // Only rank k is nonzero: every combine is 0 (+) x or x (+) 0 = x, exactly.
      std::vector<tlist<T>> inputs;
      for (int r = 0; r < n; ++r) {
        auto l = random_list<T>(sizes, 40 + static_cast<std::uint64_t>(r));
        if (r != k)
          for (auto& v : l) std::fill(v.begin(), v.end(), from<T>(0));
        inputs.push_back(l);
      }
      const auto got = run_adasum(inputs, {});
      for (int r = 0; r < n; ++r) {
        INFO("ranks " << n << ", nonzero rank " << k << ", rank " << r);
        REQUIRE(first_difference(got[r], inputs[k]) == -1);
      }
    }
  // All zero: zero.
  const std::vector<tlist<T>> zeros(3, tlist<T>{std::vector<T>(5, from<T>(0))});
  const auto got = run_adasum(zeros, {});
  for (T x : got[2][0]) REQUIRE(val(x) == 0);
}

TEST_CASE("adasum: the zero threshold drops a small tensor's projection term", "[adasum]") {
  // Tensor 0 of rank 0 has |a|^2 = 16 * (1e-4)^2 = 1.6e-7 <= 1e-6: alpha = 1, so the result is
  // a + (1 - a.b / (2 |b|^2)) b; tensor 1 is above the threshold and combined as usual.
  const std::vector<std::size_t> sizes = {16, 8};
  auto a = random_list<float>(sizes, 1, 0.5, 1.0);
  for (auto& x : a[0]) x *= 1e-4f;
  const auto b = random_list<float>(sizes, 2, 0.5, 1.0);
  const double thr = 1e-6;
  const auto got = run_adasum<float>({a, b}, {.options = {.zero_threshold = thr}});
  REQUIRE(first_difference(got[0], serial<float>{.threshold = thr}.tree({a, b})) == -1);
  double ab = 0, bb = 0, aa = 0;
  for (std::size_t i = 0; i < 16; ++i) {
    ab += double(a[0][i]) * b[0][i];
    bb += double(b[0][i]) * b[0][i];
    aa += double(a[0][i]) * a[0][i];
  }
  REQUIRE(aa <= thr);
  const float beta = static_cast<float>(1.0 - 0.5 * (ab / bb));
  for (std::size_t i = 0; i < 16; ++i) REQUIRE(std::fabs(got[0][0][i] - (a[0][i] + beta * b[0][i])) <= 1e-6f);
  // Without the threshold the tiny tensor is combined normally (alpha is about -0.5 |b| / |a|).
  const auto plain = run_adasum<float>({a, b}, {});
  REQUIRE(first_difference(plain[0], serial<float>{}.tree({a, b})) == -1);
  REQUIRE(first_difference(plain[0], got[0]) != -1);
}

TEMPLATE_TEST_CASE("adasum: values near the smallest normal and near sqrt(max) stay finite", "[adasum]",
                   float, gradapt::half, gradapt::bfloat16, double) {
  using T = TestType;
  const int min_exp = std::is_same_v<T, gradapt::half> ? -14 : std::is_same_v<T, double> ? -1022 : -126;
  // For double, 2^500 rather than sqrt(max) = 2^512: a sum of 100 squares near 2^1024 overflows
  // the double accumulator (norms of double tensors need |x| below about sqrt(DBL_MAX / n)).
  const int sqrt_max_exp = std::is_same_v<T, gradapt::half> ? 7 : std::is_same_v<T, double> ? 500 : 63;
  const std::vector<std::size_t> sizes = {100, 3};
  for (const int e : {min_exp, sqrt_max_exp}) {
    for (int n : {2, 3, 5, 8}) {
      std::vector<tlist<T>> inputs;
      for (int r = 0; r < n; ++r) {
        auto l = random_list<T>(sizes, 70 + static_cast<std::uint64_t>(r), 1.0, 2.0);
        for (auto& v : l)
          for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = from<T>(std::ldexp(val(v[i]), e) * ((i + static_cast<std::size_t>(r)) % 3 == 0 ? -1 : 1));
        inputs.push_back(l);
      }
      const auto got = run_adasum(inputs, {});
      INFO("exponent " << e << ", ranks " << n);
      for (const auto& v : got[0])
        for (T x : v) REQUIRE(std::isfinite(static_cast<double>(gradapt::load(x))));
      if constexpr (!std::is_same_v<T, double>) {
        // Results near the smallest normal may be subnormal: allow a few units of the smallest
        // subnormal on top of the relative tolerance.
        const int min_sub = std::is_same_v<T, gradapt::half> ? -24 : -149;
        REQUIRE(worst_ratio(got[0], ld_tree(inputs), inputs, std::ldexp(8.0L, min_sub)) <= 1.0);
      } else {
        // In double the squared norms of values near 2^-1022 underflow to 0: the tensors then
        // count as zero vectors and are summed. The result is finite and equals the serial tree.
        REQUIRE(first_difference(got[0], serial<T>{}.tree(inputs)) == -1);
      }
    }
  }
}

TEMPLATE_TEST_CASE("adasum: inf and NaN reach only their own tensor", "[adasum]", float, gradapt::bfloat16) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {10, 12, 9};
  for (int n : {2, 3, 4, 6}) {
    auto inputs = rank_inputs<T>(n, sizes, 5);
    inputs[1][1][3] = from<T>(std::numeric_limits<double>::quiet_NaN());
    inputs[0][2][0] = from<T>(std::numeric_limits<double>::infinity());
    const auto want = serial<T>{}.tree(inputs);
    const auto got = run_adasum(inputs, {});
    for (int r = 0; r < n; ++r) {
      INFO("ranks " << n << ", rank " << r);
      REQUIRE(first_difference(got[r], want) == -1);
      for (T x : got[r][1]) REQUIRE(is_nan(x));
      for (T x : got[r][2]) REQUIRE(!std::isfinite(static_cast<double>(gradapt::load(x))));
      for (T x : got[r][0]) REQUIRE(std::isfinite(static_cast<double>(gradapt::load(x))));
    }
  }
}

TEMPLATE_TEST_CASE("adasum: hierarchical mode is the group mean followed by the leaders' tree", "[adasum]",
                   float, gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {333, 0, 1, 64};
  for (int n = 1; n <= 8; ++n)
    for (int g : {1, 2, 3, 4, 9}) {
      const auto inputs = rank_inputs<T>(n, sizes, 600 + static_cast<std::uint64_t>(n * 10 + g));
      const auto want = serial<T>{}.hierarchical(inputs, g);
      for (const bool one_buffer : {false, true}) {
        const auto got = run_adasum(
            inputs,
            {.one_buffer = one_buffer, .options = {.mode = adasum_mode::hierarchical, .group_size = g}});
        for (int r = 0; r < n; ++r) {
          INFO("ranks " << n << ", group size " << g << ", one buffer " << one_buffer << ", rank " << r);
          REQUIRE(first_difference(got[r], want) == -1);
        }
      }
    }
}

TEST_CASE("adasum: lists that differ across ranks throw on every rank", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  // Rank 2 has 6 elements in tensor 1 instead of 5.
  run_threads(4, [](threads& comm) {
    std::vector<float> x(3, 1.0f), y(comm.rank() == 2 ? 6 : 5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x), gradapt::host_view(y)};
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(
        ada.allreduce(gradapt::host{.threads = 1}, list, ws),
        Contains("differ across ranks") && Contains("on rank " + std::to_string(comm.rank())));
  });
  // The same totals but different sizes.
  run_threads(3, [](threads& comm) {
    std::vector<float> x(comm.rank() == 1 ? 4 : 3, 1.0f), y(comm.rank() == 1 ? 4 : 5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x), gradapt::host_view(y)};
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{.threads = 1}, list, ws),
                             Contains("tensor sizes differ across ranks"));
  });
  // Rank 1 has one tensor more.
  run_threads(3, [](threads& comm) {
    std::vector<float> x(3, 1.0f), y(5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x)};
    if (comm.rank() == 1) list.push_back(gradapt::host_view(y));
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{.threads = 1}, list, ws),
                             Contains("tensor lists differ across ranks") && Contains("tensors"));
  });
}

TEST_CASE("adasum: a workspace made for another list throws on every rank", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  run_threads(3, [](threads& comm) {
    std::vector<double> x(7, 1.0), other(8, 1.0);
    std::vector<tensor_view<double>> list = {gradapt::host_view(x)};
    std::vector<tensor_view<double>> other_list = {gradapt::host_view(other)};
    gradapt::adasum_workspace<double> ws(comm.rank() == 0 ? other_list : list);
    gradapt::adasum<threads> ada(comm);
    if (comm.rank() == 0)
      RANK_REQUIRE_THROWS_WITH(
          ada.allreduce(gradapt::host{}, list, ws),
          Contains("adasum::allreduce on rank 0: tensor 0 has 7 elements but the workspace "
                   "was made for 8"));
    else
      RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{}, list, ws),
                               Contains("rank 0 passed invalid input"));
  });
  // Without the agreement, the bad rank throws alone (here every rank is bad, so none waits).
  run_threads(2, [](threads& comm) {
    std::vector<double> x(7, 1.0);
    std::vector<tensor_view<double>> list = {gradapt::host_view(x), gradapt::host_view(x)};
    std::vector<tensor_view<double>> shorter = {gradapt::host_view(x)};
    gradapt::adasum_workspace<double> ws(shorter);
    gradapt::adasum<threads> ada(comm, {.check_layout = false});
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{}, list, ws),
                             Contains("the list holds 2 tensors but the workspace was made for 1"));
  });
}

TEST_CASE("adasum: invalid options throw before any collective", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  gradapt::comm::single one;
  using A = gradapt::adasum<gradapt::comm::single>;
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = -1.0})), Contains("zero_threshold is -1"));
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = std::nan("")})), Contains("zero_threshold"));
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = std::numeric_limits<double>::infinity()})),
                      Contains("finite"));
  REQUIRE_THROWS_WITH((A(one, {.mode = adasum_mode::hierarchical, .group_size = 0})),
                      Contains("group_size is 0"));
  REQUIRE_THROWS_WITH((A(one, {.group_size = 2})), Contains("but mode is flat"));
  // Workspace buffers that are too small.
  std::vector<float> x(9), e(10), ok(11);
  std::vector<double> s(15), enough(16);
  std::vector<tensor_view<float>> list = {gradapt::host_view(x)};
  using W = gradapt::adasum_workspace<float>;
  REQUIRE(W::elements_needed(list) == 11);
  REQUIRE(W::scalars_needed(list) == 16);
  REQUIRE_THROWS_WITH(W(list, gradapt::host_view(e), gradapt::host_view(enough)),
                      Contains("element buffer has 10 elements but a list of 9 elements needs 11"));
  REQUIRE_THROWS_WITH(W(list, gradapt::host_view(ok), gradapt::host_view(s)),
                      Contains("scalar buffer has 15 doubles but a list of 1 tensors needs 16"));
  // Borrowed buffers work like owned ones.
  W borrowed(list, gradapt::host_view(ok), gradapt::host_view(enough));
  REQUIRE(borrowed.total_elements() == 9);
  A single_rank(one);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  single_rank.allreduce(gradapt::host{}, list, borrowed);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(x[i] == static_cast<float>(i));
}

TEST_CASE("adasum: empty lists and lists of empty tensors are no-ops", "[adasum]") {
  run_threads(5, [](threads& comm) {
    std::vector<tensor_view<float>> none;
    gradapt::adasum_workspace<float> ws(none);
    gradapt::adasum<threads> ada(comm);
    ada.allreduce(gradapt::host{}, none, ws);
    std::vector<float> empty;
    std::vector<tensor_view<float>> empties = {gradapt::host_view(empty), gradapt::host_view(empty)};
    gradapt::adasum_workspace<float> ws2(empties);
    ada.allreduce(gradapt::host{}, empties, ws2);
    RANK_REQUIRE(ws2.total_elements() == 0);
  });
}

TEST_CASE("adasum: repeated calls give the same bits and the steady state allocates nothing", "[adasum]") {
  const std::vector<std::size_t> sizes = {500, 3, 0, 77};
  for (int n : {3, 4}) {
    const auto inputs = rank_inputs<float>(n, sizes, 8);
    std::vector<std::size_t> allocations(static_cast<std::size_t>(n));
    std::vector<tlist<float>> first(static_cast<std::size_t>(n)), second(static_cast<std::size_t>(n));
    for (const bool one_buffer : {false, true})
      run_threads(n, [&](threads& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        rank_tensors<float> mine(inputs[r], one_buffer);
        gradapt::adasum_workspace<float> ws(mine.views);
        gradapt::adasum<threads> ada(comm);
        const gradapt::host b{.threads = 1};
        ada.allreduce(b, mine.views, ws);
        first[r] = mine.values();
        rank_tensors<float> again(inputs[r], one_buffer);
        // Same layout, new buffers: the workspace serves any list of this layout.
        const std::size_t before = alloc_counter::on_this_thread();
        ada.allreduce(b, again.views, ws);
        allocations[r] = alloc_counter::on_this_thread() - before;
        second[r] = again.values();
      });
    for (int r = 0; r < n; ++r) {
      INFO("ranks " << n << ", rank " << r);
      REQUIRE(allocations[r] == 0);
      REQUIRE(first_difference(first[r], second[r]) == -1);
    }
  }
}

TEMPLATE_TEST_CASE("adasum_combine: the pairwise operator on one rank", "[adasum]", float, double,
                   gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {40, 1, 0, 4100};
  auto a = random_list<T>(sizes, 31);
  const auto b = random_list<T>(sizes, 32);
  rank_tensors<T> ra(a, false), rb(b, true);
  std::vector<tensor_view<const T>> bviews(rb.views.begin(), rb.views.end());
  gradapt::adasum_workspace<T> ws(ra.views);
  gradapt::adasum_combine(gradapt::host{}, ra.views, bviews, ws);
  // Whole-tensor dot products: the serial combine at depth 0.
  REQUIRE(first_difference(ra.values(), serial<T>{}.combine(a, b, 0)) == -1);
  REQUIRE(worst_ratio(ra.values(), ld_combine(widen(a), widen(b), 0), std::vector<tlist<T>>{a, b}) <= 1.0);
  // a (+) a = a.
  rank_tensors<T> same(a, false), copy(a, true);
  gradapt::adasum_combine(gradapt::host{}, same.views, copy.views, ws);
  REQUIRE(first_difference(same.values(), a) == -1);
}

TEST_CASE("adasum_combine: errors name the tensor and both sizes", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  std::vector<float> x(4), y(5), z(4);
  std::vector<tensor_view<float>> a = {gradapt::host_view(x)}, b = {gradapt::host_view(y)},
                                  two = {gradapt::host_view(x), gradapt::host_view(z)},
                                  c = {gradapt::host_view(z)};
  gradapt::adasum_workspace<float> ws(a);
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, b, ws),
                      Contains("tensor 0 has 4 elements in a but 5 in b"));
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, two, ws),
                      Contains("a holds 1 tensors but b holds 2"));
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, c, ws, -0.5), Contains("zero_threshold"));
  gradapt::adasum_workspace<float> wrong(two);
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, c, wrong),
                      Contains("the list holds 1 tensors but the workspace was made for 2"));
}

TEST_CASE("adasum: param_list gradients and comm::single", "[adasum]") {
  std::vector<float> w(6, 0.0f), g(6);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * static_cast<float>(i);
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(w), gradapt::host_view(g));
  gradapt::adasum_workspace<float> ws(params.grads());
  gradapt::comm::single one;
  gradapt::adasum<gradapt::comm::single> ada(one);
  ada.allreduce(gradapt::host{}, params.grads(), ws);
  for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == 0.5f * static_cast<float>(i));
}

#pragma once
/// @file
/// SM3 (Anil, Gupta, Koren & Singer 2019, "Memory-Efficient Adaptive Optimization",
/// arXiv:1901.11150, algorithm SM3-II with one cover per dimension), as optax's `sm3`:
///
///     ν_i   = min over the covers r ∋ i of μ(r)           (a tensor of rank k has k covers: its
///                                                          slices along each dim, one accumulator
///                                                          per index of that dim)
///     a_i   = g_i² + ν_i                                  ((1 − b2) g_i² + b2 ν_i when b2 ≠ 1)
///     μ(r)  ← max over i ∈ r of a_i                      (row and column maxima for a matrix)
///     u_i   = g_i / √(a_i + eps)  where a_i > 0, else 0
///     m     ← b1 m + (1 − b1) u;  p ← p − η m            (b1 = momentum; no buffer when 0)
///
/// 1-D and rank-0 tensors keep a full accumulator (a = g² + a). State: d_0 + ... + d_{k−1}
/// elements for a rank-k tensor (n + m for an n × m matrix), plus the momentum buffer.
///
/// Passes per tensor of rank k >= 2, seen as [d_0 ⋯ d_{k−2}, d_{k−1}] (lines of d_{k−1}).
/// On the host (`factored_max_backend`), a tensor that runs as a one-thread task takes one
/// pass: `apply_factored_max` reads g, p (and m) once, computes a from the old covers, keeps
/// the maxima of a per line and per column, and writes p (and m). Elsewhere (CUDA, or a tensor
/// larger than 1/T of the list on T host threads): (1) read g, the maxima of a over the last
/// axis and over the others (`reduce_factored` with max); (2) read p, g (and m), write p (and
/// m). Then the small arrays: the maxima over the last axis are reduced again for the covers
/// of the other dims, and for k >= 3 the covers of the first k − 1 dims are first expanded
/// into their minimum. Both give the same bits (the maxima do not depend on order; a NaN
/// maximum is stored as the positive quiet NaN), for any thread count and for the host's
/// AVX2, SSE2 and scalar paths.
///
/// Non-finite gradients: an inf or NaN in g makes a (and then the covers of its row and column,
/// for good) inf or NaN; as in optax, an element whose a is NaN gets u = 0 unless its own g is
/// not finite (then u is NaN), and an element whose a is inf gets u = 0 (g / inf) or NaN.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/stage.hpp"
#include "gradapt/optim/transforms.hpp"

namespace gradapt {

/// Options of `gradapt::sm3`, e.g. `gradapt::sm3({.lr = 0.1})`. Formulas and defaults of
/// optax.sm3 (whose learning rate has no default).
struct sm3_options {
  double lr = 0.01;  ///< η (a step's `step_args::lr` overrides it); optax has no default, 0.01 is gradapt's
  double momentum = 0.9;  ///< b1 of the EMA of the update; 0 keeps no momentum buffer
  double b2 = 1.0;        ///< 1: a = g² + ν (the paper); otherwise a = (1 − b2) g² + b2 ν
  double eps = 1e-8;      ///< added to a inside the root
};

namespace detail::sm3_k {

/// a = c1 g² + c2 ν, with ν = min(r, c) (the covers' minimum), as a double for the maxima.
template <class C>
struct accumulate {
  C c1, c2;
  GRADAPT_HD double operator()(C r, C c, C g) const {
    const C nu = simd::min(r, c);
    return static_cast<double>((c1 * g) * g + c2 * nu);
  }
};
/// The maximum's terms of an already reduced array: the value itself.
struct identity {
  template <class R, class C>
  GRADAPT_HD double operator()(R, R, C v) const {
    return static_cast<double>(v);
  }
};
/// out = min(r, c): the expanded minimum of two covers.
struct cover_min {
  template <class C>
  GRADAPT_HD void operator()(C r, C c, C& out) const {
    out = simd::min(r, c);
  }
};
/// dst = src (a maximum computed in double is a float value: exact).
struct assign {
  template <class C>
  GRADAPT_HD void operator()(C& dst, double& src) const {
    dst = static_cast<C>(src);
  }
};
/// dst = src, a NaN stored as the positive quiet NaN (src: a maximum, exact in dst's type).
struct assign_canonical {
  template <class C, class D>
  GRADAPT_HD void operator()(C& dst, D src) const {
    if (src != src) {
      const std::uint64_t bits = 0x7ff8000000000000ull;  // built without <limits>: device code too
      double q;
      std::memcpy(&q, &bits, sizeof q);
      dst = static_cast<C>(q);
    } else {
      dst = static_cast<C>(src);
    }
  }
};

template <class V, class C>
GRADAPT_HD GRADAPT_INLINE V update_of(const V& g, const V& a, C eps) {
  const V inv = V(C(1)) / simd::sqrt(a + V(eps));
  return g * simd::select(a > V(C(0)), inv, V(C(0)));
}

/// dst = src (a copy of covers into the chain's workspace).
struct copy_value {
  template <class C>
  GRADAPT_HD void operator()(C& dst, C& src) const {
    dst = src;
  }
};
}  // namespace detail::sm3_k

namespace transform {

/// SM3's cover accumulators (Anil et al. 2019, SM3-II with one cover per dimension), as the
/// accumulator half of optax's `scale_by_sm3`: the first stage of a chain (see
/// `gradapt::sm3` for optax's whole SM3; its momentum is a separate `transform::ema`).
///
///     ν_i = min over the covers r ∋ i of μ(r);   a_i = c1 g_i² + c2 ν_i   (c1 = 1 − b2, c2 = b2;
///                                                                      c1 = 1 when b2 = 1)
///     μ(r) ← max over i ∈ r of a_i;              u_i = g_i / √(a_i + eps) where a_i > 0, else 0
///
/// A tensor of rank k >= 2 keeps d_0 + ... + d_{k−1} accumulators (n + m for an n × m matrix);
/// 1-D and rank-0 tensors keep a full accumulator (a = c1 g² + c2 a). For rank >= 2 the chain
/// sees the tensor as [d_0 ⋯ d_{k−2}, d_{k−1}]: `advance` writes the old covers' minimum over
/// the leading dims and the last dim's cover into the workspace (the factors every pass reads),
/// takes the maxima of a (backend `reduce_factored` with max) and stores the new covers; each
/// pass computes u from the old covers and g, so passes after a barrier reproduce it exactly.
/// Same values as `gradapt::sm3`'s device path.
struct scale_by_sm3 {
  /// 1: a = g² + ν (the paper); otherwise a = (1 − b2) g² + b2 ν. In (0, 1]. Default 1.
  double b2 = 1.0;
  /// Added to a inside the root; finite, >= 0. Default 1e-8.
  double eps = 1e-8;

  /// One buffer (the covers, or a full accumulator); never reads p; factored: one accumulator
  /// per index of each dim. The statistics are maxima of a per-element term (`kernel::term`),
  /// which do not depend on the order they are taken in: on a `factored_max_backend` a chain
  /// with no barrier gathers them during its update pass (one read of g; see chain.hpp).
  static constexpr stage_spec traits{
      .buffers = 1, .uses_param = false, .factored_state = true, .max_statistics = true};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_sm3 <option>".
  static constexpr auto option_fields() { return GRADAPT_OPTION_FIELDS(scale_by_sm3, b2, eps); }

  /// @throws gradapt::error naming the option when b2 is outside (0, 1] or eps is negative
  void validate() const {
    gradapt::detail::require(std::isfinite(b2) && b2 > 0 && b2 <= 1, "scale_by_sm3: b2 is ", b2,
                             " (expected 0 < b2 <= 1; 1 is the paper's sum)");
    gradapt::detail::require(std::isfinite(eps) && eps >= 0, "scale_by_sm3: eps is ", eps,
                             " (expected finite and >= 0)");
  }

  /// Rank >= 2: covered over [lead, last dim], its dims in `covers`; otherwise a
  /// full accumulator.
  factored_tensor plan_tensor(std::span<const std::int64_t> shape) const {
    factored_tensor t;
    const std::size_t r = shape.size();
    if (r < 2) return t;
    std::size_t size = 1, covers = 0, widest = 0;
    for (const std::int64_t d : shape) {
      size *= static_cast<std::size_t>(d);
      covers += static_cast<std::size_t>(d);
      widest = std::max(widest, static_cast<std::size_t>(d));
    }
    if (size == 0) return t;
    const auto Y = static_cast<std::size_t>(shape[r - 1]);
    const std::size_t lead = size / Y;
    t.factored = true;
    t.d = {1, static_cast<std::int64_t>(lead), 1, static_cast<std::int64_t>(Y), 1};
    t.rows = lead;
    t.cols = Y;
    t.state = covers;
    // old covers as factors (lead, then Y); the expansions' ping-pong buffers (rank >= 3); the
    // maxima of a fused pass (lead, then Y)
    t.ws = lead + Y + (r >= 3 ? 2 * lead : 0) + lead + Y;
    t.ws_sums = 2 * lead + widest + lead + Y;  // commit's scratch, then advance's maxima
    t.covers.rank = r;
    t.covers.widest = widest;
    for (std::size_t k = 0; k < r; ++k) t.covers.dims[k] = shape[k];
    return t;
  }

  /// Element math of scale_by_sm3 in compute type C.
  template <class C>
  struct kernel {
    C c1;   ///< weight of g²
    C c2;   ///< weight of ν
    C eps;  ///< added to a inside the root
    /// Full accumulator (1-D, rank 0): a ← c1 u² + c2 a; u ← u / √(a + eps) (0 where a <= 0).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& a) const {
      a = (V(c1) * u) * u + V(c2) * a;
      u = gradapt::detail::sm3_k::update_of(u, a, eps);
    }
    /// u from its input and the advanced accumulator.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& a) const {
      u = gradapt::detail::sm3_k::update_of(u, a, eps);
    }
    /// Covered tensors: u from the old covers' minimum over the leading dims r, the last dim's
    /// cover c, and g (one form: `factored_tensor::variant` is never set).
    template <bool, class V>
    GRADAPT_HD GRADAPT_INLINE V y(const V& r, const V& c, const V& g) const {
      return gradapt::detail::sm3_k::update_of(g, term(r, c, g), eps);
    }
    /// a = c1 g² + c2 min(r, c): the value whose maxima over each dim's slices are the new
    /// covers.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE V term(const V& r, const V& c, const V& g) const {
      return (V(c1) * g) * g + V(c2) * simd::min(r, c);
    }
  };
  /// The kernel (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {b2 == 1.0 ? C(1) : static_cast<C>(1.0 - b2), static_cast<C>(b2), static_cast<C>(eps)};
  }

  /// Writes the old covers as factors to the workspace: rows (the minimum over the leading
  /// dims' covers, expanded to [d_0 ⋯ d_{k−2}]) at ws[0, lead), the last dim's cover at
  /// ws[lead, lead + Y). Backend operations only.
  template <class B, class S>
  void factors(const B& b, const factored_tensor& t, tensor_view<S, typename B::space> state, S* ws) const {
    using space = typename B::space;
    const auto [vec, cvec] = gradapt::detail::optim::vector_views<space>();
    const auto lay = layout(t);
    const std::size_t r = lay.rank, Y = t.cols, lead = t.rows;
    S* mu = state.data();
    S* wa = r >= 3 ? ws + lead + Y : ws;  // ping-pong buffers of the expansions (rank >= 3 only)
    S* wb = r >= 3 ? wa + lead : ws;
    tensor_view<const S, space> row = cvec(mu + lay.off[0], lay.dims[0]);
    std::size_t len = lay.dims[0];
    S* dst = wa;
    for (std::size_t q = 1; q + 1 < r; ++q) {
      b.apply_factored(gradapt::detail::sm3_k::cover_min{},
                       {1, static_cast<std::int64_t>(len), 1, static_cast<std::int64_t>(lay.dims[q]), 1}, row,
                       cvec(mu + lay.off[q], lay.dims[q]), vec(dst, len * lay.dims[q]));
      row = cvec(dst, len * lay.dims[q]);
      len *= lay.dims[q];
      dst = dst == wa ? wb : wa;
    }
    b.apply(gradapt::detail::sm3_k::copy_value{}, vec(ws, lead), row);
    b.apply(gradapt::detail::sm3_k::copy_value{}, vec(ws + lead, Y), cvec(mu + lay.off[r - 1], Y));
  }
  /// Where a fused pass leaves the maxima of a over the last dim (`lead` values) and over the
  /// leading dims (Y values) in the workspace.
  template <class S>
  S* row_maxima(const factored_tensor& t, S* ws) const {
    return ws + t.ws - t.rows - t.cols;
  }
  template <class S>  ///< see row_maxima
  S* column_maxima(const factored_tensor& t, S* ws) const {
    return ws + t.ws - t.cols;
  }
  /// Stores the new covers from the maxima of a: over the last dim per leading index
  /// (`row_max`, lead values) and over the leading dims (`col_max`, Y values); the leading dims'
  /// covers by reducing `row_max` further. A NaN maximum is stored as the positive quiet NaN
  /// (so the covers' bits do not depend on which NaN a backend met first). `sums`: ws_sums
  /// doubles of scratch.
  template <class B, class S, class M>
  void commit(const B& b, const factored_tensor& t, tensor_view<S, typename B::space> state, S* ws,
              double* sums, const M* row_max, const M* col_max) const {
    using space = typename B::space;
    const auto [vec, cvec] = gradapt::detail::optim::vector_views<space>();
    const auto lay = layout(t);
    const std::size_t r = lay.rank, Y = t.cols, lead = t.rows;
    S* mu = state.data();
    double* da = sums;
    double* db = sums + lead;
    double* dx = sums + 2 * lead;
    b.apply(gradapt::detail::sm3_k::assign_canonical{}, vec(mu + lay.off[r - 1], Y), cvec(col_max, Y));
    if (r == 2) {
      b.apply(gradapt::detail::sm3_k::assign_canonical{}, vec(mu, lead), cvec(row_max, lead));
      return;
    }
    // cur: the maxima over dims > q, shape [d_0 .. d_q]; the first reduction reads row_max.
    std::size_t len = lead;
    double* cur = da;
    double* nxt = db;
    for (std::size_t q = r - 1; q-- > 1;) {
      const std::size_t dq = lay.dims[q];
      const std::size_t before = len / dq;
      const std::array<std::int64_t, 5> d{1, static_cast<std::int64_t>(before), 1,
                                          static_cast<std::int64_t>(dq), 1};
      if (q == r - 2)
        b.reduce_factored(gradapt::detail::sm3_k::identity{}, d, cvec(ws, 0), cvec(ws, 0), cvec(row_max, len),
                          vec(nxt, before), vec(dx, dq), reduce_op::max);
      else
        b.reduce_factored(gradapt::detail::sm3_k::identity{}, d, cvec(ws, 0), cvec(ws, 0), cvec(cur, len),
                          vec(nxt, before), vec(dx, dq), reduce_op::max);
      b.apply(gradapt::detail::sm3_k::assign_canonical{}, vec(mu + lay.off[q], dq), cvec(dx, dq));
      std::swap(cur, nxt);
      len = before;
    }
    b.apply(gradapt::detail::sm3_k::assign_canonical{}, vec(mu + lay.off[0], len), cvec(cur, len));
  }
  /// Advances a covered tensor's statistics from g and leaves the old covers as factors in the
  /// workspace (`factors`; the update reads them): the maxima of a (`reduce_factored` with
  /// max) become the new covers (`commit`). Backend operations only.
  template <class C, class B, class S, class G>
  void advance(const B& b, const kernel<C>& k, const factored_tensor& t,
               tensor_view<S, typename B::space> state, tensor_view<const G, typename B::space> g, S* ws,
               double* sums) const {
    using space = typename B::space;
    const auto [vec, cvec] = gradapt::detail::optim::vector_views<space>();
    factors(b, t, state, ws);
    const std::size_t Y = t.cols, lead = t.rows;
    double* row_max = sums + 2 * lead + t.covers.widest;  // after commit's scratch
    double* col_max = row_max + lead;
    b.reduce_factored(gradapt::detail::sm3_k::accumulate<C>{k.c1, k.c2}, t.d, cvec(ws, lead),
                      cvec(ws + lead, Y), g, vec(row_max, lead), vec(col_max, Y), reduce_op::max);
    commit(b, t, state, ws, sums, static_cast<const double*>(row_max), static_cast<const double*>(col_max));
  }

 private:
  struct cover_layout {
    std::size_t rank = 0;
    std::array<std::size_t, max_rank> dims{}, off{};
  };
  static cover_layout layout(const factored_tensor& t) {
    cover_layout l;
    l.rank = t.covers.rank;
    std::size_t o = 0;
    for (std::size_t q = 0; q < l.rank; ++q) {
      l.dims[q] = static_cast<std::size_t>(t.covers.dims[q]);
      l.off[q] = o;
      o += l.dims[q];
    }
    return l;
  }
};

}  // namespace transform

/// The chain behind `gradapt::sm3`.
using sm3_chain_type = chain<transform::scale_by_sm3, transform::ema, transform::scale_by_learning_rate>;

/// SM3 (see the file comment): scale_by_sm3(b2, eps) → ema(momentum) → scale_by_learning_rate(lr).
/// A `gradapt::chain`: `init(backend, params)` and `step(backend, params, state, {.lr})`, a
/// `chain_state` whose buffer 0 holds the covers (a tensor of rank k >= 2: its k covers, one
/// per dim, in dim order; a full accumulator otherwise) and buffer 1 the momentum (momentum =
/// 0: none). Needs a `factored_backend`; on the host (`factored_max_backend`) a tensor's step
/// is one pass over its memory.
class sm3 : public sm3_chain_type {
 public:
  /// `sm3({})`: the default options.
  sm3(std::initializer_list<sm3_options> o) : sm3(detail::options_from(o, "sm3")) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit sm3(const sm3_options& o = {}) : sm3_chain_type(stages(o)) {}

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const sm3_options& o) {
    detail::require(std::isfinite(o.lr) && o.lr >= 0, "sm3: lr is ", o.lr, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1, "sm3: momentum is ",
                    o.momentum, " (expected 0 <= momentum < 1; 0 keeps no momentum buffer)");
    detail::require(std::isfinite(o.b2) && o.b2 > 0 && o.b2 <= 1, "sm3: b2 is ", o.b2,
                    " (expected 0 < b2 <= 1; 1 is the paper's sum)");
    detail::require(std::isfinite(o.eps) && o.eps >= 0, "sm3: eps is ", o.eps, " (expected finite and >= 0)");
  }

 private:
  static sm3_chain_type stages(const sm3_options& o) {
    validate(o);
    return sm3_chain_type{transform::scale_by_sm3{.b2 = o.b2, .eps = o.eps},
                          transform::ema{.decay = o.momentum, .debias = false},
                          transform::scale_by_learning_rate{.lr = o.lr, .allow_negative = false}};
  }
};

}  // namespace gradapt

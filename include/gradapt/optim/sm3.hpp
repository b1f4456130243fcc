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
/// On the host (a backend with `run_tasks`): one pass that reads p, g (and m) once, computes a
/// from the old covers, keeps the maxima of a per line and per column, and writes p (and m);
/// the tensors (large ones cut into pieces of whole lines) run as one-thread tasks in one
/// parallel region, and the covers are written when a tensor's pieces are done. On other
/// backends (CUDA): (1) read g, a, and the maxima of a over the last axis and over the others
/// (backend `reduce_factored` with max); (2) read p, g (and m), write p (and m); then the small
/// arrays: the maxima over the last axis are reduced again for the covers of the other dims,
/// and for k >= 3 the covers of the first k − 1 dims are first expanded into their minimum (a
/// workspace of d_0 ⋯ d_{k−2}). Both give the same values (the maxima do not depend on order;
/// a NaN maximum is stored as the positive quiet NaN), and the host's are the same bits for
/// any thread count and for its AVX2, SSE2 and scalar paths.
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
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/factored.hpp"
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
    return static_cast<double>(c1 * (g * g) + c2 * nu);
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

template <class V, class C>
GRADAPT_HD GRADAPT_INLINE V update_of(const V& g, const V& a, C eps) {
  const V inv = V(C(1)) / simd::sqrt(a + V(eps));
  return g * simd::select(a > V(C(0)), inv, V(C(0)));
}

template <bool Mom, class V, class C>
GRADAPT_HD GRADAPT_INLINE void finish(V u, V& p, C lr, C b1, C one_minus_b1, V* m) {
  if constexpr (Mom) {
    *m = V(one_minus_b1) * u + V(b1) * *m;
    u = *m;
  }
  p = p - V(lr) * u;
}

/// The update pass of a tensor of rank >= 2: f(r, c, p, g[, m]). `accumulate` and `update` are
/// its two halves, which the host's fused pass calls separately (it also takes the maxima of a).
template <bool Mom, class C>
struct covered_update {
  static constexpr bool vectorizable = true;
  C c1, c2, eps, lr, b1, one_minus_b1;
  /// a = c1 g² + c2 min(r, c).
  template <class V>
  GRADAPT_HD GRADAPT_INLINE V accumulate(const V& r, const V& c, const V& g) const {
    return V(c1) * (g * g) + V(c2) * simd::min(r, c);
  }
  /// p ← p − η (momentum of) g / √(a + eps) (0 where a <= 0).
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void update(const V& a, V& p, const V& g, V* m) const {
    finish<Mom>(update_of(g, a, eps), p, lr, b1, one_minus_b1, m);
  }
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V r, V c, V& p, V& g) const requires(!Mom) {
    update(accumulate(r, c, g), p, g, static_cast<V*>(nullptr));
  }
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V r, V c, V& p, V& g, V& m) const requires Mom {
    update(accumulate(r, c, g), p, g, &m);
  }
};

/// The whole step of a 1-D or rank-0 tensor (a full accumulator): f(p, g, acc[, m]).
template <bool Mom, class C>
struct full_update {
  static constexpr bool vectorizable = true;
  C c1, c2, eps, lr, b1, one_minus_b1;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V& p, V& g, V& acc) const requires(!Mom) {
    acc = V(c1) * (g * g) + V(c2) * acc;
    finish<false>(update_of(g, acc, eps), p, lr, b1, one_minus_b1, static_cast<V*>(nullptr));
  }
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V& p, V& g, V& acc, V& m) const requires Mom {
    acc = V(c1) * (g * g) + V(c2) * acc;
    finish<true>(update_of(g, acc, eps), p, lr, b1, one_minus_b1, &m);
  }
};

/// max(acc, t) that keeps a NaN from either side: t where acc < t or t is NaN, else acc. The
/// maxima of SM3's covers are order-independent with it (a NaN is stored canonical, see
/// `canonical`), so the host's fused pass may take them in any order and over any split.
template <class V>
GRADAPT_INLINE V nan_max(const V& acc, const V& t) {
  return simd::select((acc < t) | (t != t), t, acc);
}
/// v, with any NaN replaced by the positive quiet NaN (the value the backends' max reductions
/// produce), so the covers' bits do not depend on which NaN was seen first.
template <class C>
GRADAPT_INLINE C canonical(C v) {
  return v != v ? std::numeric_limits<C>::quiet_NaN() : v;
}

/// One work item of the host's fused step: lines [b, e) of factored tensor `tensor` (elements
/// [b, e) of a 1-D or rank-0 one), with Y column maxima at `col_off` of the maxima buffer.
struct host_item {
  std::size_t tensor = 0, b = 0, e = 0, col_off = 0;
};

/// `a > b ? a : b` lane-wise: x86's maxps rule, b when either is NaN (one instruction; the
/// fused pass keeps its running maxima in b, so a NaN maximum stays, and flags NaN terms).
template <class V>
GRADAPT_INLINE V gt_max(const V& a, const V& b) {
#if GRADAPT_SIMD_PACKS
  if constexpr (simd::is_pack_v<V>) {
    V r;
    for (std::size_t q = 0; q < V::parts; ++q) r.part[q] = a.part[q] > b.part[q] ? a.part[q] : b.part[q];
    return r;
  } else
#endif
  {
    return a > b ? a : b;
  }
}

#if GRADAPT_SIMD_PACKS
/// The pack loop of `fused_line` (float data) in packs P of 8 floats: elements [0, j) with
/// j the returned count; the row maximum of the non-NaN terms is folded into *racc and *bad
/// is set when a term was NaN.
template <class P, bool Mom>
GRADAPT_INLINE std::size_t fused_packs(const covered_update<Mom, float>& f, float r, const float* col,
                                       float* cm, float* p, const float* g, float* m, std::size_t Y,
                                       float* racc, bool* bad) {
  const P rr(r), zero(0.0f);
  P ra(-std::numeric_limits<float>::infinity());
  auto nan = zero != zero;
  std::size_t j = 0;
  for (; j + 8 <= Y; j += 8) {
    const P gv = P::load(g + j);
    const P a = f.accumulate(rr, P::load(col + j), gv);
    nan = nan | (a != a);
    ra = gt_max(a, ra);
    gt_max(a, P::load(cm + j)).store(cm + j);
    P pv = P::load(p + j);
    if constexpr (Mom) {
      P mv = P::load(m + j);
      f.update(a, pv, gv, &mv);
      mv.store(m + j);
    } else {
      f.update(a, pv, gv, static_cast<P*>(nullptr));
    }
    pv.store(p + j);
  }
  float lanes[8];
  ra.store(lanes);
  for (std::size_t q = 0; q < 8; ++q) {
    *racc = gt_max(lanes[q], *racc);
    *bad = *bad || nan[q];
  }
  return j;
}
#if defined(__x86_64__) && GRADAPT_SIMD_AVX_ASM && !defined(GRADAPT_NO_AVX2_DISPATCH)
#define GRADAPT_SM3_AVX2_DISPATCH 1
/// fused_packs compiled for AVX2 (one 32-byte register per 8 floats; no FMA, same bits).
template <bool Mom>
__attribute__((target("avx2"))) std::size_t fused_packs_avx2(const covered_update<Mom, float>& f, float r,
                                                             const float* col, float* cm, float* p,
                                                             const float* g, float* m, std::size_t Y,
                                                             float* racc, bool* bad) {
  return fused_packs<simd::pack<float, 8, 32>>(f, r, col, cm, p, g, m, Y, racc, bad);
}
#endif
#endif

/// The host's fused pass over one line of Y elements of a tensor of rank >= 2 (SM3's two passes
/// in one read: the old covers give a, a's maxima go to the running column maxima `cm` and the
/// returned row maximum, and the update is applied). r is the line's cover minimum, `col` the
/// last dim's cover. The maxima are taken with `gt_max` (one instruction) and NaN terms only
/// flagged; a line with a NaN term is looked at again (its terms recomputed from g and the old
/// covers, which nothing has changed yet) to make its row maximum and its columns' maxima NaN.
/// Float data runs on `simd::pack`s of 8 (AVX2 when the CPU has it; the same bits as the
/// scalar loop, which does the tail and the other element types).
template <bool Mom, class C, class V, class G, class S>
C fused_line(const covered_update<Mom, C> f, C r, const S* col, S* cm, V* p, const G* g, S* m,
             std::size_t Y) {
  C racc = -std::numeric_limits<C>::infinity();
  bool bad = false;
  std::size_t j = 0;
#if GRADAPT_SIMD_PACKS
  if constexpr (std::is_same_v<C, float> && std::is_same_v<V, float> &&
                std::is_same_v<std::remove_cv_t<G>, float> && std::is_same_v<S, float>) {
#if defined(GRADAPT_SM3_AVX2_DISPATCH)
    if (simd::detail::cpu_has_avx2())
      j = fused_packs_avx2<Mom>(f, r, col, cm, p, g, m, Y, &racc, &bad);
    else
#endif
      j = fused_packs<simd::pack<float, 8>>(f, r, col, cm, p, g, m, Y, &racc, &bad);
  }
#endif
  for (; j < Y; ++j) {
    const C gv = load(g[j]);
    const C a = f.accumulate(r, load(col[j]), gv);
    bad = bad || a != a;
    racc = gt_max(a, racc);
    cm[j] = gt_max(a, cm[j]);
    C pv = load(p[j]);
    if constexpr (Mom) {
      C mv = load(m[j]);
      f.update(a, pv, gv, &mv);
      store(m[j], mv);
    } else {
      f.update(a, pv, gv, static_cast<C*>(nullptr));
    }
    store(p[j], pv);
  }
  if (bad) {
    for (j = 0; j < Y; ++j) {
      const C a = f.accumulate(r, load(col[j]), load(g[j]));
      if (a != a) cm[j] = a;
    }
    racc = std::numeric_limits<C>::quiet_NaN();
  }
  return racc;
}
}  // namespace detail::sm3_k

class sm3;

/// The state of `gradapt::sm3`: one accumulator per dimension of each tensor (a full one for
/// 1-D and rank-0 tensors), the optional momentum buffer, the step count and a workspace.
template <class B, class V, class G, class S>
class sm3_state {
 public:
  using backend_type = B;           ///< the backend the state lives on
  using space = typename B::space;  ///< memory space of the state buffers
  using value_type = V;             ///< parameter element type
  using grad_type = G;              ///< gradient element type
  using state_element = S;          ///< element type of the state buffers (the parameters' compute type)

  sm3_state() = default;
  /// Moves the state (buffers are not copied; the source is left empty).
  sm3_state(sm3_state&&) noexcept = default;
  /// Move-assigns the state.
  sm3_state& operator=(sm3_state&&) noexcept = default;
  sm3_state(const sm3_state&) = delete;
  sm3_state& operator=(const sm3_state&) = delete;

  /// Steps taken.
  std::uint64_t steps() const { return steps_; }
  /// Parameters the state was created for.
  std::size_t tensors() const { return info_.size(); }
  /// Accumulator elements of tensor t: the sum of its dims (rank >= 2), else its size.
  std::size_t accumulator_elements(std::size_t t) const { return at(t).acc_len; }
  /// Momentum elements of tensor t.
  std::size_t momentum_elements(std::size_t t) const { return has_m_ ? at(t).size : 0; }
  /// All optimizer-state elements (accumulators and momentum).
  std::size_t state_elements() const { return mu_.size() + m_.size(); }
  /// Accumulator of dim `k` of tensor t (the whole accumulator for rank <= 1, k = 0).
  tensor_view<const S, space> accumulator(std::size_t t, std::size_t k) const {
    const auto& i = at(t);
    if (i.rank < 2) {
      detail::require(k == 0, "sm3_state::accumulator: tensor ", t, " has one accumulator (asked for dim ", k,
                      ")");
      return tensor_view<const S, space>::vector(mu_.data() + i.off, static_cast<std::int64_t>(i.acc_len));
    }
    detail::require(k < i.rank, "sm3_state::accumulator: tensor ", t, " has rank ", i.rank,
                    " (asked for dim ", k, ")");
    return tensor_view<const S, space>::vector(mu_.data() + i.off + i.cover_off[k], i.dims[k]);
  }

  /// Tensor t's momentum buffer (its size, in the parameters' layout); empty when the state
  /// keeps no momentum (momentum = 0 at init).
  tensor_view<const S, space> momentum(std::size_t t) const {
    const auto& i = at(t);
    if (!has_m_) return {};
    return tensor_view<const S, space>::vector(m_.data() + i.m_off, static_cast<std::int64_t>(i.size));
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.sm3";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// Writes the state into the open section of `w`: element type, step count, a layout row
  /// per tensor (size, rank, the dims padded to the largest rank, accumulator size), the
  /// accumulators ("statistics") and the momentum buffer ("momentum", empty without momentum).
  void save(const B& b, archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<S>));
    w.put("steps", steps_);
    detail::optim::put_layout(w, layout(), layout_cols);
    detail::optim::put_state_buffer(b, w, "statistics", mu_.data(), mu_.size());
    detail::optim::put_state_buffer(b, w, "momentum", m_.data(), m_.size());
  }
  /// Reads what `save(b, w)` wrote, for the same parameters (shapes included) and options.
  /// All or nothing.
  /// @throws gradapt::error naming the first field that does not match (nothing is changed)
  void load(const B& b, archive_reader& r) {
    constexpr const char* who = "sm3_state::load";
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<S>), who, ": the checkpoint holds ", et,
                    " state but this state is ", name(dtype_of_v<S>));
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), who, ": step count ", steps,
                    " cannot grow");
    detail::optim::expect_layout(r, layout(), layout_cols, who, "size, rank, dims, accumulator size");
    const auto mu = detail::optim::get_state_buffer<S>(r, "statistics", mu_.size(), who);
    const auto m = detail::optim::get_state_buffer<S>(r, "momentum", m_.size(), who);
    r.finish_section();
    b.copy(tensor_view<const S, host_space>(host_view(mu)),
           tensor_view<S, space>::vector(mu_.data(), static_cast<std::int64_t>(mu_.size())));
    b.copy(tensor_view<const S, host_space>(host_view(m)),
           tensor_view<S, space>::vector(m_.data(), static_cast<std::int64_t>(m_.size())));
    b.synchronize();
    steps_ = steps;
  }
  /// The state as one archive of kind "gradapt.sm3" (core/archive.hpp).
  std::vector<std::byte> save(const B& b) const { return save_archive(*this, b); }
  /// Restores a state written by `save(b)`; all or nothing.
  void load(const B& b, std::span<const std::byte> bytes) { load_archive(*this, b, bytes); }

 private:
  friend class sm3;
  static constexpr std::size_t layout_cols = 3 + max_rank;
  std::vector<std::int64_t> layout() const {
    std::vector<std::int64_t> out;
    for (const auto& i : info_) {
      out.push_back(static_cast<std::int64_t>(i.size));
      out.push_back(static_cast<std::int64_t>(i.rank));
      for (std::size_t k = 0; k < max_rank; ++k) out.push_back(k < i.rank ? i.dims[k] : 0);
      out.push_back(static_cast<std::int64_t>(i.acc_len));
    }
    return out;
  }
  struct tensor_info {
    std::size_t size = 0;
    std::size_t rank = 0;
    std::array<std::int64_t, max_rank> dims{};
    std::array<std::size_t, max_rank> cover_off{};
    std::size_t acc_len = 0;
    std::size_t off = 0, m_off = 0;
    std::size_t chunks = 0;    ///< host path: work items of this tensor
    std::size_t col_off = 0;   ///< host path: its items' column maxima (chunks × last dim)
    std::size_t rows_off = 0;  ///< host path: its row maxima (rank >= 3)
  };
  const tensor_info& at(std::size_t t) const {
    detail::require(t < info_.size(), "sm3_state: tensor ", t, " out of range (", info_.size(), " tensors)");
    return info_[t];
  }

  std::uint64_t steps_ = 0;
  bool has_m_ = false;
  std::vector<tensor_info> info_;
  detail::optim::buffer_t<B, S> mu_, m_, wa_, wb_;
  detail::optim::buffer_t<B, double> da_, db_, dx_;
  // Host path (a backend with run_tasks): the work items, largest first, the column maxima of
  // each item and the row maxima of the rank >= 3 tensors.
  std::vector<detail::sm3_k::host_item> items_;
  detail::optim::buffer_t<B, S> cmax_, rmax_;
};

/// SM3 (see the file comment). Same interface as the chain presets:
///
///     gradapt::sm3 opt({.lr = 0.1});
///     auto st = opt.init(backend, params);
///     opt.step(backend, params, st, {.lr = schedule(t)});
class sm3 {
 public:
  /// `sm3({})`: the default options (an exact match for the empty braces, which the
  /// options constructor alone would leave ambiguous with the move constructor).
  sm3(std::initializer_list<sm3_options> o) : sm3(detail::options_from(o, "sm3")) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit sm3(const sm3_options& o = {}) : o_(o) { validate(o_); }

  /// The options.
  const sm3_options& options() const { return o_; }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const sm3_options& o) {
    detail::require(std::isfinite(o.lr) && o.lr >= 0, "sm3: lr is ", o.lr, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1, "sm3: momentum is ",
                    o.momentum, " (expected 0 <= momentum < 1; 0 keeps no momentum buffer)");
    detail::require(std::isfinite(o.b2) && o.b2 > 0 && o.b2 <= 1, "sm3: b2 is ", o.b2,
                    " (expected 0 < b2 <= 1; 1 is the paper's sum)");
    detail::require(std::isfinite(o.eps) && o.eps >= 0, "sm3: eps is ", o.eps, " (expected finite and >= 0)");
  }

  /// Creates the state for `params` (zero accumulators and momentum, and the workspace).
  template <class S = void, factored_backend B, element V, element G, class Options>
  auto init(const B& b, const param_list<V, G, typename B::space, Options>& params) const {
    using St = std::conditional_t<std::is_void_v<S>, compute_t<V>, S>;
    static_assert(std::is_same_v<compute_t<V>, compute_t<G>> && std::is_same_v<compute_t<V>, St>,
                  "gradapt::sm3: the state element type is the parameters' compute type");
    validate(o_);
    sm3_state<B, V, G, St> st;
    st.has_m_ = o_.momentum > 0;
    std::size_t total = 0, m_total = 0, wa = 0, wd = 0, wx = 0;
    for (std::size_t t = 0; t < params.size(); ++t) {
      const auto& e = params[t];
      typename sm3_state<B, V, G, St>::tensor_info i;
      i.size = e.value.size();
      i.rank = static_cast<std::size_t>(e.value.rank());
      for (std::size_t k = 0; k < i.rank; ++k) i.dims[k] = e.value.dim(static_cast<int>(k));
      if (i.rank < 2 || i.size == 0) {
        i.acc_len = i.size;
        if (i.rank >= 2) {  // empty: the covers exist (sum of dims) but nothing is updated
          i.acc_len = 0;
          for (std::size_t k = 0; k < i.rank; ++k) i.acc_len += static_cast<std::size_t>(i.dims[k]);
        }
        if (i.rank >= 2) {
          std::size_t o = 0;
          for (std::size_t k = 0; k < i.rank; ++k) {
            i.cover_off[k] = o;
            o += static_cast<std::size_t>(i.dims[k]);
          }
        }
      } else {
        std::size_t o = 0;
        for (std::size_t k = 0; k < i.rank; ++k) {
          i.cover_off[k] = o;
          o += static_cast<std::size_t>(i.dims[k]);
          wx = std::max(wx, static_cast<std::size_t>(i.dims[k]));
        }
        i.acc_len = o;
        const std::size_t lead = i.size / static_cast<std::size_t>(i.dims[i.rank - 1]);
        wd = std::max(wd, lead);
        if (i.rank >= 3) wa = std::max(wa, lead);
      }
      i.off = total;
      total += i.acc_len;
      i.m_off = m_total;
      if (st.has_m_) m_total += i.size;
      st.info_.push_back(i);
    }
    st.mu_ = b.template allocate<St>(total);
    st.m_ = b.template allocate<St>(m_total);
    if constexpr (host_tasks<B>) {
      plan_host(b, st);
    } else {
      st.wa_ = b.template allocate<St>(wa);
      st.wb_ = b.template allocate<St>(wa);
      st.da_ = b.template allocate<double>(wd);
      st.db_ = b.template allocate<double>(wd);
      st.dx_ = b.template allocate<double>(wx);
    }
    return st;
  }

  /// One SM3 step over all tensors (see the file comment).
  /// @throws gradapt::error when `params` does not match the state or the learning rate is
  ///         not finite and >= 0
  template <factored_backend B, element V, element G, class Options, class S>
  void step(const B& b, const param_list<V, G, typename B::space, Options>& params, sm3_state<B, V, G, S>& st,
            const step_args& args = {}) const {
    detail::require(params.size() == st.info_.size(), "sm3::step: the parameter list holds ", params.size(),
                    " tensors but the state was created for ", st.info_.size(),
                    " (create the state with init() for this list)");
    for (std::size_t t = 0; t < params.size(); ++t)
      detail::require(params[t].value.size() == st.info_[t].size, "sm3::step: parameter '", params[t].name,
                      "' (tensor ", t, ") has ", params[t].value.size(), " elements but the state holds ",
                      st.info_[t].size);
    detail::require((o_.momentum > 0) == st.has_m_, "sm3::step: momentum is ", o_.momentum > 0 ? "on" : "off",
                    " but the state was created with it ", st.has_m_ ? "on" : "off",
                    " (create a new state with init())");
    const double lr = args.lr.value_or(o_.lr);
    detail::require(std::isfinite(lr) && lr >= 0, "sm3::step: learning rate ", lr,
                    " (expected finite and >= 0)");
    using C = compute_t<V>;
    using space = typename B::space;
    const C c1 = o_.b2 == 1.0 ? C(1) : static_cast<C>(1.0 - o_.b2);
    const C c2 = static_cast<C>(o_.b2);
    const C eps = static_cast<C>(o_.eps), lrc = static_cast<C>(lr), b1 = static_cast<C>(o_.momentum),
            omb1 = static_cast<C>(1.0 - o_.momentum);
    if constexpr (host_tasks<B>) {
      if (st.has_m_)
        host_step(b, params, st, detail::sm3_k::covered_update<true, C>{c1, c2, eps, lrc, b1, omb1},
                  detail::sm3_k::full_update<true, C>{c1, c2, eps, lrc, b1, omb1});
      else
        host_step(b, params, st, detail::sm3_k::covered_update<false, C>{c1, c2, eps, lrc, b1, omb1},
                  detail::sm3_k::full_update<false, C>{c1, c2, eps, lrc, b1, omb1});
      ++st.steps_;
      return;
    }
    const auto vec = [](auto* p, std::size_t n) { return gradapt::detail::optim::vector_view<space>(p, n); };
    const auto cvec = [](auto* p, std::size_t n) {
      return gradapt::detail::optim::const_vector_view<space>(p, n);
    };
    for (std::size_t k = 0; k < params.size(); ++k) {
      const auto& i = st.info_[k];
      if (i.size == 0) continue;
      const auto& e = params[k];
      const auto p = e.value.flat();
      const auto g = tensor_view<const G, space>(e.grad.flat());
      S* mu = st.mu_.data() + i.off;
      S* m = st.has_m_ ? st.m_.data() + i.m_off : nullptr;
      if (i.rank < 2) {
        if (m)
          b.apply(detail::sm3_k::full_update<true, C>{c1, c2, eps, lrc, b1, omb1}, p, g, vec(mu, i.size),
                  vec(m, i.size));
        else
          b.apply(detail::sm3_k::full_update<false, C>{c1, c2, eps, lrc, b1, omb1}, p, g, vec(mu, i.size));
        continue;
      }
      const std::size_t r = i.rank;
      const auto Y = static_cast<std::size_t>(i.dims[r - 1]);
      const std::size_t lead = i.size / Y;
      // The covers' minimum over the first r - 1 dims, expanded to [d_0 ... d_{r-2}].
      tensor_view<const S, space> row = cvec(mu + i.cover_off[0], static_cast<std::size_t>(i.dims[0]));
      if (r >= 3) {
        std::size_t len = static_cast<std::size_t>(i.dims[0]);
        S* dst = st.wa_.data();
        for (std::size_t q = 1; q + 1 < r; ++q) {
          const auto dq = static_cast<std::size_t>(i.dims[q]);
          b.apply_factored(detail::sm3_k::cover_min{},
                           {1, static_cast<std::int64_t>(len), 1, static_cast<std::int64_t>(dq), 1}, row,
                           cvec(mu + i.cover_off[q], dq), vec(dst, len * dq));
          row = cvec(dst, len * dq);
          len *= dq;
          dst = dst == st.wa_.data() ? st.wb_.data() : st.wa_.data();
        }
      }
      const std::array<std::int64_t, 5> d{1, static_cast<std::int64_t>(lead), 1, static_cast<std::int64_t>(Y),
                                          1};
      const auto col = cvec(mu + i.cover_off[r - 1], Y);
      // (1) maxima of a over the last axis (per leading index) and over the leading axes.
      b.reduce_factored(detail::sm3_k::accumulate<C>{c1, c2}, d, row, col, g, vec(st.da_.data(), lead),
                        vec(st.dx_.data(), Y), reduce_op::max);
      // (2) the update, from the old covers.
      if (m)
        b.apply_factored(detail::sm3_k::covered_update<true, C>{c1, c2, eps, lrc, b1, omb1}, d, row, col, p,
                         g, vec(m, i.size));
      else
        b.apply_factored(detail::sm3_k::covered_update<false, C>{c1, c2, eps, lrc, b1, omb1}, d, row, col, p,
                         g);
      // (3) the new covers: the last dim's directly, the others by reducing the maxima further.
      b.apply(detail::sm3_k::assign{}, vec(mu + i.cover_off[r - 1], Y), vec(st.dx_.data(), Y));
      double* cur = st.da_.data();
      double* nxt = st.db_.data();
      std::size_t len = lead;
      for (std::size_t q = r - 1; q-- > 1;) {  // cur holds the maxima over dims > q, shape [d_0 .. d_q]
        const auto dq = static_cast<std::size_t>(i.dims[q]);
        const std::size_t before = len / dq;
        b.reduce_factored(detail::sm3_k::identity{},
                          {1, static_cast<std::int64_t>(before), 1, static_cast<std::int64_t>(dq), 1},
                          cvec(st.wa_.data(), 0), cvec(st.wa_.data(), 0), cvec(cur, len), vec(nxt, before),
                          vec(st.dx_.data(), dq), reduce_op::max);
        b.apply(detail::sm3_k::assign{}, vec(mu + i.cover_off[q], dq), vec(st.dx_.data(), dq));
        std::swap(cur, nxt);
        len = before;
      }
      b.apply(detail::sm3_k::assign{}, vec(mu + i.cover_off[0], len), vec(cur, len));
    }
    ++st.steps_;
  }

 private:
  sm3_options o_;

  /// A host-memory `task_backend` (gradapt::host): the step runs as one fused pass per tensor,
  /// in tasks (see `host_step`).
  template <class B>
  static constexpr bool host_tasks = std::is_same_v<typename B::space, host_space>&& task_backend<B>;

  /// Splits the tensors into work items for `host_step`: with T = b.thread_count() > 1, a
  /// tensor of more than 1/(2T) of all elements is cut into pieces of whole lines (elements for
  /// 1-D) of about that size; items are ordered largest first (run_tasks hands them out in that
  /// order, so the threads end together). Allocates the items' column maxima and the row maxima
  /// of rank >= 3 tensors.
  template <class B, class St>
  static void plan_host(const B& b, St& st) {
    using S = typename St::state_element;
    const std::size_t T = static_cast<std::size_t>(std::max(1, b.thread_count()));
    std::size_t total = 0;
    for (const auto& i : st.info_) total += i.size;
    const std::size_t cap = T > 1 ? std::max<std::size_t>(1, (total + 2 * T - 1) / (2 * T)) : total + 1;
    std::size_t cm = 0, rm = 0;
    st.items_.clear();
    for (std::size_t k = 0; k < st.info_.size(); ++k) {
      auto& i = st.info_[k];
      if (i.size == 0) continue;
      const bool factored = i.rank >= 2;
      const std::size_t Y = factored ? static_cast<std::size_t>(i.dims[i.rank - 1]) : 1;
      const std::size_t lines = i.size / Y;
      const std::size_t n = std::min(lines, (i.size + cap - 1) / cap);
      i.chunks = n;
      if (factored) {
        i.col_off = cm;
        cm += n * Y;
        if (i.rank >= 3) {
          i.rows_off = rm;
          rm += lines;
        }
      }
      for (std::size_t c = 0; c < n; ++c)
        st.items_.push_back({k, lines * c / n, lines * (c + 1) / n, i.col_off + c * Y});
    }
    const auto work = [&](const detail::sm3_k::host_item& it) {
      const auto& i = st.info_[it.tensor];
      return (it.e - it.b) * (i.rank >= 2 ? static_cast<std::size_t>(i.dims[i.rank - 1]) : 1);
    };
    std::stable_sort(st.items_.begin(), st.items_.end(),
                     [&](const auto& x, const auto& y) { return work(x) > work(y); });
    st.cmax_ = b.template allocate<S>(cm);
    st.rmax_ = b.template allocate<S>(rm);
  }

  /// The host step: every work item as a one-thread task (`host::run_tasks`: one parallel
  /// region, no barrier inside). An item of a tensor of rank >= 2 makes one pass over its lines
  /// (`fused_line`: a from the old covers, its row and column maxima, the update), writes the
  /// row maxima (a rank-2 tensor's first cover directly: line l reads only entry l) and keeps
  /// its column maxima; the covers read by other lines are written when all of the tensor's
  /// items are done (by the task itself when it is the only one, else after the region). The
  /// maxima do not depend on the order or the split, so the result is the same for any thread
  /// count, and the same bits as the two-pass form.
  template <bool Mom, class B, class V, class G, class Options, class S, class C>
  static void host_step(const B& b, const param_list<V, G, typename B::space, Options>& params,
                        sm3_state<B, V, G, S>& st, const detail::sm3_k::covered_update<Mom, C>& cu,
                        const detail::sm3_k::full_update<Mom, C>& fu) {
    const B b1 = b.single_thread();
    const auto run = [&](std::size_t q, std::size_t) {
      const auto& it = st.items_[q];
      const auto& i = st.info_[it.tensor];
      const auto& e = params[it.tensor];
      V* p = e.value.flat().data();
      const G* g = e.grad.flat().data();
      S* mu = st.mu_.data() + i.off;
      S* m = Mom ? st.m_.data() + i.m_off : nullptr;
      if (i.rank < 2) {
        const std::size_t n = it.e - it.b;
        const auto v = [&](auto* x) {
          using T = std::remove_pointer_t<decltype(x)>;
          return tensor_view<T, host_space>::vector(x + it.b, static_cast<std::int64_t>(n));
        };
        if constexpr (Mom)
          b1.apply(fu, v(p), v(g), v(mu), v(m));
        else
          b1.apply(fu, v(p), v(g), v(mu));
        return;
      }
      const std::size_t r = i.rank;
      const auto Y = static_cast<std::size_t>(i.dims[r - 1]);
      S* cm = st.cmax_.data() + it.col_off;
      std::fill(cm, cm + Y, -std::numeric_limits<S>::infinity());
      const S* col = mu + i.cover_off[r - 1];
      for (std::size_t l = it.b; l < it.e; ++l) {
        const std::size_t at = l * Y;
        if (r == 2) {
          const C mx = detail::sm3_k::fused_line(cu, static_cast<C>(mu[l]), col, cm, p + at, g + at,
                                                 m ? m + at : nullptr, Y);
          mu[l] = static_cast<S>(detail::sm3_k::canonical(mx));
        } else {
          // The cover minimum of line l: min over dims q < r - 1 of cover_q[i_q], in q order.
          std::size_t idx[max_rank];
          for (std::size_t q = r - 1, rest = l; q-- > 0;) {
            idx[q] = rest % static_cast<std::size_t>(i.dims[q]);
            rest /= static_cast<std::size_t>(i.dims[q]);
          }
          C rv = static_cast<C>(mu[idx[0]]);
          for (std::size_t q = 1; q + 1 < r; ++q)
            rv = simd::min(rv, static_cast<C>(mu[i.cover_off[q] + idx[q]]));
          st.rmax_.data()[i.rows_off + l] = static_cast<S>(
              detail::sm3_k::fused_line(cu, rv, col, cm, p + at, g + at, m ? m + at : nullptr, Y));
        }
      }
      if (i.chunks == 1) finish_covers(st, it.tensor);
    };
    b.run_tasks(st.items_.size(), st.items_.size(), run);
    for (std::size_t k = 0; k < st.info_.size(); ++k)
      if (st.info_[k].rank >= 2 && st.info_[k].chunks > 1) finish_covers(st, k);
  }

  /// The new covers of factored tensor k once all its items ran: the last dim's from the items'
  /// column maxima; for rank >= 3 the others from the row maxima (a rank-2 tensor's first cover
  /// is already written).
  template <class St>
  static void finish_covers(St& st, std::size_t k) {
    using S = typename St::state_element;
    const auto& i = st.info_[k];
    const std::size_t r = i.rank;
    const auto Y = static_cast<std::size_t>(i.dims[r - 1]);
    S* mu = st.mu_.data() + i.off;
    const S* cm = st.cmax_.data() + i.col_off;
    S* col = mu + i.cover_off[r - 1];
    for (std::size_t j = 0; j < Y; ++j) {
      S v = cm[j];
      for (std::size_t c = 1; c < i.chunks; ++c) v = detail::sm3_k::nan_max(v, cm[c * Y + j]);
      col[j] = detail::sm3_k::canonical(v);
    }
    if (r < 3) return;
    std::fill(mu, mu + i.cover_off[r - 1], -std::numeric_limits<S>::infinity());
    const S* rm = st.rmax_.data() + i.rows_off;
    const std::size_t lines = i.size / Y;
    for (std::size_t l = 0; l < lines; ++l)
      for (std::size_t q = r - 1, rest = l; q-- > 0;) {
        const auto dq = static_cast<std::size_t>(i.dims[q]);
        S& c = mu[i.cover_off[q] + rest % dq];
        c = detail::sm3_k::nan_max(c, rm[l]);
        rest /= dq;
      }
    for (std::size_t j = 0; j < i.cover_off[r - 1]; ++j) mu[j] = detail::sm3_k::canonical(mu[j]);
  }
};

namespace detail::sm3_k {
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
/// `gradapt::sm3_chain` for optax's whole SM3; its momentum is a separate `transform::ema`).
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

  static constexpr bool factored_state = true;         ///< one accumulator per index of each dim
  static constexpr std::size_t buffers = 1;            ///< the covers (or a full accumulator)
  static constexpr std::size_t tensor_slots = 0;       ///< no per-tensor constants
  static constexpr bool barrier = false;               ///< element-wise once the covers are read
  static constexpr bool optional = false;              ///< always active
  static constexpr bool replay_ignores_input = false;  ///< u needs g
  static constexpr bool uses_param = false;            ///< never reads p

  /// @throws gradapt::error naming the option when b2 is outside (0, 1] or eps is negative
  void validate() const {
    gradapt::detail::require(std::isfinite(b2) && b2 > 0 && b2 <= 1, "scale_by_sm3: b2 is ", b2,
                             " (expected 0 < b2 <= 1; 1 is the paper's sum)");
    gradapt::detail::require(std::isfinite(eps) && eps >= 0, "scale_by_sm3: eps is ", eps,
                             " (expected finite and >= 0)");
  }
  /// Writes nothing: the stage has no per-tensor constants.
  void tensor_constants(const tensor_setup&, double*) const {}

  /// Rank >= 2: covered over [lead, last dim], aux = {rank, d_0, d_1, d_2, d_3}; otherwise a
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
    t.ws = lead + Y + (r >= 3 ? 2 * lead : 0);
    t.ws_sums = 2 * lead + widest;
    t.aux[0] = static_cast<std::int64_t>(r);
    for (std::size_t k = 0; k < r; ++k) t.aux[1 + k] = shape[k];
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
      a = V(c1) * (u * u) + V(c2) * a;
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
      const V a = V(c1) * (g * g) + V(c2) * simd::min(r, c);
      return gradapt::detail::sm3_k::update_of(g, a, eps);
    }
  };
  /// The kernel (no per-step constants).
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {b2 == 1.0 ? C(1) : static_cast<C>(1.0 - b2), static_cast<C>(b2), static_cast<C>(eps)};
  }

  /// Writes the old covers' factors to the workspace (rows: the minimum over the leading dims'
  /// covers, expanded to [d_0 ⋯ d_{k−2}]; then the last dim's cover), takes the maxima of a
  /// and stores them as the new covers. Backend operations only.
  template <class C, class B, class S, class G>
  void advance(const B& b, const kernel<C>& k, const factored_tensor& t,
               tensor_view<S, typename B::space> state, tensor_view<const G, typename B::space> g, S* ws,
               double* sums) const {
    using space = typename B::space;
    const auto vec = [](auto* p, std::size_t n) { return gradapt::detail::optim::vector_view<space>(p, n); };
    const auto cvec = [](auto* p, std::size_t n) {
      return gradapt::detail::optim::const_vector_view<space>(p, n);
    };
    const auto r = static_cast<std::size_t>(t.aux[0]);
    std::array<std::size_t, max_rank> dims{}, off{};
    std::size_t o = 0;
    for (std::size_t q = 0; q < r; ++q) {
      dims[q] = static_cast<std::size_t>(t.aux[1 + q]);
      off[q] = o;
      o += dims[q];
    }
    const std::size_t Y = t.cols, lead = t.rows;
    S* mu = state.data();
    S* rows = ws;
    S* cols = ws + lead;
    S* wa = r >= 3 ? ws + lead + Y : ws;  // ping-pong buffers of the expansions (rank >= 3 only)
    S* wb = r >= 3 ? wa + lead : ws;
    double* da = sums;
    double* db = sums + lead;
    double* dx = sums + 2 * lead;
    // The old covers as factors: the leading dims' minimum, expanded, and the last dim's.
    tensor_view<const S, space> row = cvec(mu + off[0], dims[0]);
    std::size_t len = dims[0];
    S* dst = wa;
    for (std::size_t q = 1; q + 1 < r; ++q) {
      b.apply_factored(gradapt::detail::sm3_k::cover_min{},
                       {1, static_cast<std::int64_t>(len), 1, static_cast<std::int64_t>(dims[q]), 1}, row,
                       cvec(mu + off[q], dims[q]), vec(dst, len * dims[q]));
      row = cvec(dst, len * dims[q]);
      len *= dims[q];
      dst = dst == wa ? wb : wa;
    }
    b.apply(gradapt::detail::sm3_k::copy_value{}, vec(rows, lead), row);
    b.apply(gradapt::detail::sm3_k::copy_value{}, vec(cols, Y), cvec(mu + off[r - 1], Y));
    // The maxima of a over the last dim (per leading index) and over the leading dims.
    b.reduce_factored(gradapt::detail::sm3_k::accumulate<C>{k.c1, k.c2}, t.d, cvec(rows, lead), cvec(cols, Y),
                      g, vec(da, lead), vec(dx, Y), reduce_op::max);
    // The new covers: the last dim's directly, the others by reducing the maxima further.
    b.apply(gradapt::detail::sm3_k::assign{}, vec(mu + off[r - 1], Y), vec(dx, Y));
    double* cur = da;
    double* nxt = db;
    len = lead;
    for (std::size_t q = r - 1; q-- > 1;) {  // cur: the maxima over dims > q, shape [d_0 .. d_q]
      const std::size_t dq = dims[q];
      const std::size_t before = len / dq;
      b.reduce_factored(gradapt::detail::sm3_k::identity{},
                        {1, static_cast<std::int64_t>(before), 1, static_cast<std::int64_t>(dq), 1},
                        cvec(wa, 0), cvec(wa, 0), cvec(cur, len), vec(nxt, before), vec(dx, dq),
                        reduce_op::max);
      b.apply(gradapt::detail::sm3_k::assign{}, vec(mu + off[q], dq), vec(dx, dq));
      std::swap(cur, nxt);
      len = before;
    }
    b.apply(gradapt::detail::sm3_k::assign{}, vec(mu + off[0], len), vec(cur, len));
  }
};

}  // namespace transform

/// The chain type of `sm3_chain`: optax's sm3 as a composition of stages.
using sm3_chain_type = chain<transform::scale_by_sm3, transform::ema, transform::scale_by_learning_rate>;

/// SM3 assembled from gradient transformations, as optax's `sm3`: scale_by_sm3(b2, eps) →
/// ema(momentum) → scale_by_learning_rate(lr), with the options of `gradapt::sm3`. The same
/// values as the standalone class's device path; on the host the class is faster (one fused
/// pass per tensor), the chain is the form to extend.
/// @throws gradapt::error naming an invalid option
inline sm3_chain_type sm3_chain(const sm3_options& o = {}) {
  sm3::validate(o);
  return sm3_chain_type{transform::scale_by_sm3{.b2 = o.b2, .eps = o.eps},
                        transform::ema{.decay = o.momentum, .debias = false},
                        transform::scale_by_learning_rate{.lr = o.lr, .allow_negative = false}};
}

}  // namespace gradapt

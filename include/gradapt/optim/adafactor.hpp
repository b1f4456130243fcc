#pragma once
/// @file
/// Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
/// Cost", arXiv:1804.04235), as optax's `adafactor` with torch.optim.Adafactor's switches.
///
/// For a tensor whose two factored dims (the two largest, both >= min_dim_size_to_factor) are
/// rows i and columns j, at step t (1-based):
///
///     β_t   = 1 − (t − decay_offset)^(−decay_rate)                 (0 at the first step)
///     s     = g² + eps1
///     R_i   ← β_t R_i + (1 − β_t) mean_j s_ij                      (n values)
///     C_j   ← β_t C_j + (1 − β_t) mean_i s_ij                      (m values)
///     y_ij  = g_ij · (R_i / mean(R))^(−1/2) · C_j^(−1/2)          (the "largest" axis' statistic
///                                                                   is the normalised one, as optax)
/// and for 1-D, small and unfactored tensors v ← β_t v + (1 − β_t) s, y = g · v^(−1/2). Then
///
///     y ← y / max(1, rms(y) / d)                                   (update clipping, d = 1)
///     y ← y · η_t      η_t = lr, or min(lr, 1/√t) with relative_step
///     y ← y · max(rms(p), eps2)                                    (multiply_by_parameter_scale)
///     m ← b1 m + (1 − b1) y;  y = m                                (optional momentum)
///     p ← p − (y + λ p)                                            (λ = weight_decay, or lr · weight_decay)
///
/// Tensors of rank > 2 factor their two largest dims (the others index separate statistics).
/// State: n + m elements for an n × m factored matrix (plus n·m for momentum), the full size
/// otherwise. A shared workspace (the largest tensor's row and column sums and factors) is
/// allocated at init and reused for every tensor; the step allocates nothing.
///
/// Passes per factored tensor: (1) read g, row and column sums of g² (backend
/// `reduce_factored`; on the host `reduce_factored_sumsq`, which also reads p for Σp² in the
/// same pass); (2) read g, Σ y² for the clipping; (3) other backends only: read p for rms(p);
/// (4) read g, p (and m), write p (and m). The element update is y · s with one per-tensor
/// scale s = η_t · max(rms(p), eps2) / max(1, rms(y)/d) (the row and column factors
/// (R_i/mean R)^(−1/2) and C_j^(−1/2) are computed once per row and column). A tensor's passes
/// run back to back, so passes 2 and 4 find a tensor of up to a few MiB in the last-level
/// cache. The sums Σy² and Σp² and the scale s stay where the backend runs: on CUDA they are
/// written by kernels (`apply_factored_sum`, `apply_reduce_list`, a one-element `apply` of
/// `update_scale`) and read by the update kernel, so a step never waits for the host. On the
/// host with T > 1 threads, tensors smaller than 1/T of the list run as whole
/// one-thread tasks (`host::run_tasks`, one workspace slot per thread, so the workspace is T
/// times the one-thread size); larger ones first, each on all threads. Same bits either way.
///
/// Non-finite gradients: inf or NaN in g makes that tensor's statistics (the row and column
/// of the element, then through the normalisation the whole tensor) inf or NaN, and the
/// parameters it touches become NaN, exactly as in optax; skip such steps with the loss
/// scaler (a skipped step does not call `step`, so the step count does not advance).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
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

/// Where Adafactor's eps1 enters.
enum class adafactor_eps1 : unsigned char {
  add_to_square,  ///< s = g² + eps1 (optax, the paper)
  clamp           ///< statistics without eps; V̂ clamped to >= eps1² and mean(R) to >= eps1 (torch)
};

/// Options of `gradapt::adafactor`, e.g. `gradapt::adafactor({.lr = 1e-2, .relative_step = true})`.
/// Defaults follow optax.adafactor; the torch column gives torch.optim.Adafactor's equivalent.
///
struct adafactor_options {
  double lr = 1.0;  ///< η, the learning rate (a step's `step_args::lr` overrides it); optax's
                    ///< learning_rate=None means 1 (torch: 1e-2)
  bool relative_step =
      false;  ///< true: η_t = min(lr, 1/√t), the paper's relative step size (torch: always on)
  double decay_rate = 0.8;  ///< β2_t = 1 − t^(−decay_rate) (torch: beta2_decay = −0.8); must be in (0, 1]
  std::uint64_t decay_offset = 0;  ///< t is counted from this step (for fine-tuning); before it β2 = 0
  std::int64_t min_dim_size_to_factor =
      128;               ///< factor a tensor when both factored dims are at least this (torch: 0, always)
  bool factored = true;  ///< false: every tensor keeps a full second moment (Adam-like state)
  factor_axes axes = factor_axes::largest_two;  ///< which two dims are factored: the two largest (optax) or
                                                ///< the last two (torch)
  double eps1 = 1e-30;  ///< regulariser of g² (torch: eps[0] = 1.19e-7, float's epsilon); must be >= 0
  adafactor_eps1 eps1_mode = adafactor_eps1::add_to_square;  ///< where eps1 enters: added to g² (optax, the
                                                             ///< paper) or as a clamp (torch)
  double clipping_threshold =
      1.0;  ///< d of the update clipping u ← u / max(1, rms(u)/d); +inf turns clipping off
  bool multiply_by_parameter_scale = true;  ///< scale the step by max(rms(p), eps2) (torch: always on)
  double eps2 = 1e-3;                       ///< lower bound of the parameter scale (torch: eps[1] = 1e-3)
  double momentum = 0.0;      ///< b1 of an EMA of the update; 0 keeps no momentum buffer (torch: no momentum)
  double weight_decay = 0.0;  ///< λ: p ← p − λ p on top of the update (optax's weight_decay_rate)
  bool weight_decay_times_lr =
      false;  ///< true: λ is multiplied by the learning rate (torch: p ← p (1 − lr λ))
};

/// The options torch.optim.Adafactor uses for (lr, eps2, weight_decay): relative step,
/// last-two factoring of every tensor of rank >= 2, eps1 = float epsilon as a clamp.
inline adafactor_options torch_adafactor_options(double lr = 1e-2, double eps2 = 1e-3,
                                                 double weight_decay = 0.0) {
  return {.lr = lr,
          .relative_step = true,
          .min_dim_size_to_factor = 0,
          .axes = factor_axes::last_two,
          .eps1 = static_cast<double>(std::numeric_limits<float>::epsilon()),
          .eps1_mode = adafactor_eps1::clamp,
          .eps2 = eps2,
          .weight_decay = weight_decay,
          .weight_decay_times_lr = true};
}

namespace detail::adafactor_k {

/// s = g² + eps in the compute type (the backend widens it): a row/column statistic term.
template <class C>
struct square_plus {
  static constexpr bool vectorizable = true;
  C eps;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE V operator()(V, V, V v) const {
    return v * v + V(eps);
  }
};
/// The value itself (a sum of a statistic).
struct identity {
  template <class C>
  GRADAPT_HD double operator()(C, C, C v) const {
    return static_cast<double>(v);
  }
};
/// v ← β v + w · (sum / len).
template <class C>
struct ema_mean {
  C beta, w;
  double inv_len;
  GRADAPT_HD void operator()(C& v, double& sum) const {
    const C mean = static_cast<C>(sum * inv_len);
    v = beta * v + w * mean;
  }
};
/// out = (stat / max(mean, floor))^(−1/2), mean = sum / len (the normalised statistic).
template <class C>
struct norm_factor {
  double inv_len;
  C floor;
  GRADAPT_HD void operator()(C, double sum, C& stat, C& out) const {
    C mean = static_cast<C>(sum * inv_len);
    mean = mean < floor ? floor : mean;
    out = C(1) / simd::sqrt(stat / mean);
  }
};
/// out = stat^(−1/2).
template <class C>
struct inv_sqrt {
  GRADAPT_HD void operator()(C& stat, C& out) const { out = C(1) / simd::sqrt(stat); }
};

/// y = g · r · c in optax's order (the normalised factor first), or g · min(r c, 1/eps1).
template <bool NormY, bool Clamp, class V, class C>
GRADAPT_HD GRADAPT_INLINE V factored_y(const V& r, const V& c, const V& g, C inv_eps) {
  if constexpr (Clamp) {
    return g * simd::min(r * c, V(inv_eps));
  } else if constexpr (NormY) {
    return (g * r) * c;
  } else {
    return (g * c) * r;
  }
}

/// Σ y² of a factored tensor (the clipping statistic).
template <bool NormY, bool Clamp, class C>
struct factored_clip_sum {
  static constexpr bool vectorizable = true;
  C inv_eps;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE V operator()(V r, V c, V& g) const {
    const V y = factored_y<NormY, Clamp>(r, c, g, inv_eps);
    return y * y;
  }
};

/// p² widened (the parameter scale's sum), vectorised on the host.
struct square_sum {
  static constexpr bool vectorizable = true;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 1> operator()(V& p) const {
    simd::terms_t<V, 1> r;
    const auto w = simd::widen(p);
    r[0] = w * w;
    return r;
  }
};

/// One slot of the step's workspace: factors, row/column sums, normalisation sums,
/// three reduction targets (Σy², Σp², the update's scale) and the per-line Σp² (host).
template <class S>
struct workspace {
  S *fy, *fx;
  double *sy, *sx, *sn, *red, *sl;
};

/// The per-step scalars of the final update: scale = η_t · max(rms(p), eps2) / max(1, rms(y)/d),
/// computed once per tensor in double (so the element update is one multiply, not a division
/// and two multiplies).
template <class C>
struct update_scalars {
  C scale, b1, one_minus_b1, wd;
};

/// The per-tensor constants of the update scale (see `update_scale`).
struct scale_params {
  double n;          ///< elements of the tensor
  double threshold;  ///< clipping threshold d
  double eps2;       ///< floor of the parameter scale
  double lr_t;       ///< the step's (relative) learning rate
  bool clip;         ///< clipping on (d finite)
  bool param_scale;  ///< multiply_by_parameter_scale
};

/// scale = lr_t · max(rms(p), eps2) / max(1, rms(y) / d) from the tensor's sums Σy² and Σp²
/// (a NaN rms propagates). One function for every backend: the host calls it directly, the
/// CUDA path runs it in a one-element kernel on sums that never leave the device.
GRADAPT_HD inline double update_scale(const scale_params& k, double clip_sum, double p_sq) {
  double denom = 1.0;
  if (k.clip) {
    const double rms = simd::sqrt(clip_sum / k.n) / k.threshold;
    denom = rms > 1.0 ? rms : (rms != rms ? rms : 1.0);
  }
  double pscale = 1.0;
  if (k.param_scale) {
    const double rms = simd::sqrt(p_sq / k.n);
    pscale = rms > k.eps2 ? rms : (rms != rms ? rms : k.eps2);
  }
  return k.lr_t * pscale / denom;
}

/// `update_scale` as a backend functor over three one-element views: (Σy², Σp², scale).
struct scale_from_sums {
  scale_params k;
  GRADAPT_HD void operator()(double& clip_sum, double& p_sq, double& scale) const {
    scale = update_scale(k, clip_sum, p_sq);
  }
};

/// The scalars of an update whose scale is read from memory (`Dev`: the device-resident value
/// of `scale_from_sums`) or carried by value.
template <bool Dev, class C>
GRADAPT_HD GRADAPT_INLINE update_scalars<C> scalars_of(const update_scalars<C>& s, const double* scale_at) {
  if constexpr (Dev) {
    update_scalars<C> r = s;
    r.scale = static_cast<C>(*scale_at);
    return r;
  } else {
    (void)scale_at;
    return s;
  }
}

/// y → clipped and scaled (one multiply), momentum, decay; p ← p − u.
template <bool Mom, class V, class C>
GRADAPT_HD GRADAPT_INLINE void finish(V y, V& p, const update_scalars<C>& s, V* m) {
  V u = y * V(s.scale);
  if constexpr (Mom) {
    *m = V(s.one_minus_b1) * u + V(s.b1) * *m;
    u = *m;
  }
  u = u + V(s.wd) * p;
  p = p - u;
}

/// The final pass of a factored tensor: f(r, c, p, g[, m]). `Dev`: the scale is read from
/// `scale_at` (device memory) instead of `s.scale`.
template <bool NormY, bool Clamp, bool Mom, class C, bool Dev = false>
struct factored_update {
  static constexpr bool vectorizable = true;
  C inv_eps;
  update_scalars<C> s;
  const double* scale_at = nullptr;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V r, V c, V& p, V& g) const requires(!Mom) {
    finish<false>(factored_y<NormY, Clamp>(r, c, g, inv_eps), p, scalars_of<Dev>(s, scale_at),
                  static_cast<V*>(nullptr));
  }
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V r, V c, V& p, V& g, V& m) const requires Mom {
    finish<true>(factored_y<NormY, Clamp>(r, c, g, inv_eps), p, scalars_of<Dev>(s, scale_at), &m);
  }
};

/// y of an unfactored tensor from its advanced v.
template <class V, class C>
GRADAPT_HD GRADAPT_INLINE V full_y(const V& g, const V& v, C clamp) {
  return g * (V(C(1)) / simd::sqrt(simd::max(v, V(clamp))));
}

/// v ← β v + w (g² + eps); returns y² (the clipping statistic).
template <class C>
struct full_moment {
  C beta, w, eps_add, clamp;
  GRADAPT_HD double operator()(C& v, C& g) const {
    v = beta * v + w * (g * g + eps_add);
    const C y = full_y(g, v, clamp);
    return static_cast<double>(y * y);
  }
};

/// The final pass of an unfactored tensor: f(p, g, v[, m]) (`Dev` as in factored_update).
template <bool Mom, class C, bool Dev = false>
struct full_update {
  static constexpr bool vectorizable = true;
  C clamp;
  update_scalars<C> s;
  const double* scale_at = nullptr;
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V& p, V& g, V& v) const requires(!Mom) {
    finish<false>(full_y(g, v, clamp), p, scalars_of<Dev>(s, scale_at), static_cast<V*>(nullptr));
  }
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void operator()(V& p, V& g, V& v, V& m) const requires Mom {
    finish<true>(full_y(g, v, clamp), p, scalars_of<Dev>(s, scale_at), &m);
  }
};

}  // namespace detail::adafactor_k

namespace transform {

/// Adafactor's factored second moment (Shazeer & Stern 2018), as optax's
/// `scale_by_factored_rms`, with torch.optim.Adafactor's switches: the first stage of a chain
/// (see `gradapt::adafactor_chain` for optax's whole Adafactor). With β_t = 1 − (t −
/// decay_offset)^(−decay_rate) and s = g² + eps:
///
///  - factored tensor (rank >= 2, both factored dims >= min_dim_size_to_factor): row and column
///    EMAs R ← β_t R + (1 − β_t) mean_j s, C ← β_t C + (1 − β_t) mean_i s, and
///    u = g · (R_i / mean R)^(−1/2) · C_j^(−1/2) (the larger axis' statistic normalised, as optax);
///  - other tensors: v ← β_t v + (1 − β_t) s, u = g · v^(−1/2).
///
/// eps_mode = clamp is torch's placement (no eps in s; v clamped to >= eps², mean R to >= eps,
/// u = g · min(r c, 1/eps)). State: the row then column statistics of a factored tensor
/// (n + m elements for n × m), v of the others. The chain runs a factored tensor through the
/// backend's row/column operations (`advance` leaves the factors in the chain's workspace and
/// each pass computes u = y(r, c, g) inside `apply_factored`), so it needs a `factored_backend`.
struct scale_by_factored_rms {
  /// Factor tensors of rank >= 2 (false: every tensor keeps a full v). Default true.
  bool factored = true;
  /// β_t = 1 − t^(−decay_rate); finite, >= 0. Default 0.8.
  double decay_rate = 0.8;
  /// t is counted from this step (β = 0 until then). Default 0.
  std::uint64_t decay_offset = 0;
  /// Factor when both factored dims are at least this. Default 128.
  std::int64_t min_dim_size_to_factor = 128;
  /// eps: added to g² (add_to_square) or the clamp bound (clamp); >= 0 (> 0 for clamp). Default 1e-30.
  double eps = 1e-30;
  /// Where eps enters. Default add_to_square (optax).
  adafactor_eps1 eps_mode = adafactor_eps1::add_to_square;
  /// Which two dims are factored. Default the two largest (optax).
  factor_axes axes = factor_axes::largest_two;

  static constexpr bool factored_state = true;         ///< row and column statistics per tensor
  static constexpr std::size_t buffers = 1;            ///< the statistics (v, or R then C)
  static constexpr std::size_t tensor_slots = 0;       ///< no per-tensor constants
  static constexpr bool barrier = false;               ///< element-wise once the factors exist
  static constexpr bool optional = false;              ///< always active
  static constexpr bool replay_ignores_input = false;  ///< u needs g
  static constexpr bool uses_param = false;            ///< never reads p

  /// @throws gradapt::error naming the option when decay_rate is negative, eps is negative
  ///         (or 0 with the clamp) or min_dim_size_to_factor is negative
  void validate() const {
    gradapt::detail::require(std::isfinite(decay_rate) && decay_rate >= 0.0,
                             "scale_by_factored_rms: decay_rate is ", decay_rate,
                             " (expected finite and >= 0; 0.8 in the paper)");
    gradapt::detail::require(
        std::isfinite(eps) && eps >= 0.0 && (eps_mode != adafactor_eps1::clamp || eps > 0.0),
        "scale_by_factored_rms: eps is ", eps, " (expected finite and >= 0, and > 0 with eps_mode = clamp)");
    gradapt::detail::require(min_dim_size_to_factor >= 0, "scale_by_factored_rms: min_dim_size_to_factor is ",
                             min_dim_size_to_factor, " (expected >= 0)");
  }
  /// Writes nothing: the stage has no per-tensor constants.
  void tensor_constants(const tensor_setup&, double*) const {}

  /// How a tensor of this shape is handled: factored over its [A, X, B, Y, C] view, with the
  /// normalised statistic's grouping in aux = {nd[0..2], groups, length, largest_is_y}.
  factored_tensor plan_tensor(std::span<const std::int64_t> shape) const {
    factored_tensor t;
    const auto f = gradapt::detail::optim::factor_of(shape, factored, axes, min_dim_size_to_factor);
    if (!f.factored) return t;
    const auto [A, X, Bd, Y, C] = f.d;
    t.factored = true;
    t.d = f.d;
    t.rows = static_cast<std::size_t>(A * X * Bd * C);
    t.cols = static_cast<std::size_t>(A * Bd * Y * C);
    t.state = t.rows + t.cols;
    t.ws = t.rows + t.cols;
    const std::int64_t groups = A * Bd * C;
    t.ws_sums = t.rows + t.cols + static_cast<std::size_t>(groups);
    if (f.largest_is_y)
      t.aux = {A, X, Bd * C, groups, X, 1, 0, 0};
    else
      t.aux = {A * Bd, Y, C, groups, Y, 0, 0, 0};
    t.variant = !f.largest_is_y;  // the normalised (column) factor multiplies first, as optax
    return t;
  }

  /// Element math of scale_by_factored_rms in compute type C.
  template <class C>
  struct kernel {
    C beta;      ///< β_t
    C w;         ///< 1 − β_t
    C eps_add;   ///< eps (add_to_square) or 0
    C clamp_v;   ///< eps² (clamp) or 0
    C inv_eps;   ///< 1/eps (clamp) or 0
    C floor;     ///< eps (clamp) or 0: the floor of mean R
    bool clamp;  ///< eps_mode == clamp
    /// Unfactored tensors: v ← β v + (1 − β)(u² + eps); u ← u · max(v, eps²)^(−1/2).
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void update(V& u, const V&, const double*, V& v) const {
      v = V(beta) * v + V(w) * (u * u + V(eps_add));
      u = gradapt::detail::adafactor_k::full_y(u, v, clamp_v);
    }
    /// u from its input and the advanced v.
    template <class V>
    GRADAPT_HD GRADAPT_INLINE void replay(V& u, const V&, const double*, const V& v) const {
      u = gradapt::detail::adafactor_k::full_y(u, v, clamp_v);
    }
    /// Factored tensors: u = g · r · c, the normalised factor first (optax's order: `ColumnFirst`
    /// when it is the column factor); g · min(r c, 1/eps) with the clamp.
    template <bool ColumnFirst, class V>
    GRADAPT_HD GRADAPT_INLINE V y(const V& r, const V& c, const V& g) const {
      if (clamp) return g * simd::min(r * c, V(inv_eps));
      if constexpr (ColumnFirst)
        return (g * c) * r;
      else
        return (g * r) * c;
    }
  };
  /// The kernel of step t.
  template <class C>
  kernel<C> prepare(const step_context& s) const {
    const double td = s.step > decay_offset ? static_cast<double>(s.step - decay_offset) : 1.0;
    const double wd = std::pow(td, -decay_rate);
    const bool cl = eps_mode == adafactor_eps1::clamp;
    return {static_cast<C>(1.0 - wd),
            static_cast<C>(wd),
            cl ? C(0) : static_cast<C>(eps),
            cl ? static_cast<C>(eps * eps) : C(0),
            cl ? static_cast<C>(1.0 / eps) : C(0),
            cl ? static_cast<C>(eps) : C(0),
            cl};
  }

  /// Advances a factored tensor's statistics from g and leaves its factors in the workspace:
  /// row factors at ws[0, rows), column factors at ws[rows, rows + cols). `sums`: ws_sums
  /// doubles. Backend operations only (no host synchronisation on CUDA).
  template <class C, class B, class S, class G>
  void advance(const B& b, const kernel<C>& k, const factored_tensor& t,
               tensor_view<S, typename B::space> state, tensor_view<const G, typename B::space> g, S* ws,
               double* sums) const {
    using space = typename B::space;
    const auto vec = [](auto* p, std::size_t n) { return gradapt::detail::optim::vector_view<space>(p, n); };
    const auto cvec = [](auto* p, std::size_t n) {
      return gradapt::detail::optim::const_vector_view<space>(p, n);
    };
    const std::int64_t X = t.d[1], Y = t.d[3];
    const std::size_t ny = t.rows, nx = t.cols;
    const std::array<std::int64_t, 5> nd{t.aux[0], t.aux[1], t.aux[2], 1, 1};
    const std::size_t ng = static_cast<std::size_t>(t.aux[3]);
    const double norm_len = static_cast<double>(t.aux[4]);
    const bool largest_is_y = t.aux[5] != 0;
    S* v = state.data();
    S* fy = ws;
    S* fx = ws + ny;
    double* sy = sums;
    double* sx = sums + ny;
    double* sn = sums + ny + nx;
    // Row and column sums of s = g² + eps, then the EMAs of their means.
    b.reduce_factored(gradapt::detail::adafactor_k::square_plus<C>{k.eps_add}, t.d, cvec(fy, 0), cvec(fx, 0),
                      g, vec(sy, ny), vec(sx, nx));
    b.apply(gradapt::detail::adafactor_k::ema_mean<C>{k.beta, k.w, 1.0 / static_cast<double>(Y)}, vec(v, ny),
            vec(sy, ny));
    b.apply(gradapt::detail::adafactor_k::ema_mean<C>{k.beta, k.w, 1.0 / static_cast<double>(X)},
            vec(v + ny, nx), vec(sx, nx));
    // Factors: the normalised statistic's (over its groups) and the other's.
    S* vn = largest_is_y ? v : v + ny;
    S* vo = largest_is_y ? v + ny : v;
    S* fn = largest_is_y ? fy : fx;
    S* fo = largest_is_y ? fx : fy;
    const std::size_t nn = largest_is_y ? ny : nx, no = largest_is_y ? nx : ny;
    b.reduce_factored(gradapt::detail::adafactor_k::identity{}, nd, cvec(fn, 0), cvec(fn, 0), cvec(vn, nn),
                      vec(sx, 0), vec(sn, ng));
    b.apply_factored(gradapt::detail::adafactor_k::norm_factor<C>{1.0 / norm_len, k.floor}, nd, cvec(fy, 0),
                     cvec(sn, ng), vec(vn, nn), vec(fn, nn));
    b.apply(gradapt::detail::adafactor_k::inv_sqrt<C>{}, vec(vo, no), vec(fo, no));
  }
};

}  // namespace transform

class adafactor;

/// The state of `gradapt::adafactor` for backend B, parameter type V, gradient type G and
/// state element type S (the compute type of V by default): the second-moment statistics
/// (row and column EMAs of factored tensors, the full EMA of the others), the optional
/// momentum buffer, the step count, and the workspace. Created by `adafactor::init`.
template <class B, class V, class G, class S>
class adafactor_state {
 public:
  using backend_type = B;           ///< the backend the state lives on
  using space = typename B::space;  ///< memory space of the state buffers
  using value_type = V;             ///< parameter element type
  using grad_type = G;              ///< gradient element type
  using state_element = S;          ///< element type of the state buffers (the parameters' compute type)

  adafactor_state() = default;
  /// Move-only (the same rule as chain_state; duplicate through save/load): moves the
  /// buffers, leaving the source empty.
  adafactor_state(adafactor_state&&) noexcept = default;
  /// Move-assigns the state.
  adafactor_state& operator=(adafactor_state&&) noexcept = default;
  adafactor_state(const adafactor_state&) = delete;
  adafactor_state& operator=(const adafactor_state&) = delete;

  /// Steps taken.
  std::uint64_t steps() const { return steps_; }
  /// Parameters the state was created for.
  std::size_t tensors() const { return info_.size(); }
  /// True when tensor t keeps a factored (row + column) second moment.
  bool factored(std::size_t t) const { return at(t).f.factored; }
  /// Second-moment elements of tensor t: X·(A·B·C) + Y·(A·B·C) when factored (n + m for an
  /// n × m matrix), its size otherwise.
  std::size_t second_moment_elements(std::size_t t) const { return at(t).ny + at(t).nx; }
  /// Momentum elements of tensor t (its size with momentum, else 0).
  std::size_t momentum_elements(std::size_t t) const { return has_m_ ? at(t).size : 0; }
  /// All optimizer-state elements (second moments and momentum): what a checkpoint holds.
  std::size_t state_elements() const { return v_.size() + m_.size(); }
  /// Workspace elements (row/column sums in double, factors in S), shared by all tensors.
  std::size_t workspace_bytes() const {
    return (sy_.size() + sx_.size() + sn_.size() + red_.size() + sl_.size()) * sizeof(double) +
           (fy_.size() + fx_.size()) * sizeof(S);
  }
  /// Tensor t's second moment: the row statistic (reduced over Y, A·X·B·C values) then the
  /// column statistic (A·B·Y·C values) when factored, else the full v.
  tensor_view<const S, space> second_moment(std::size_t t) const {
    const auto& i = at(t);
    return tensor_view<const S, space>::vector(v_.data() + i.v_off, static_cast<std::int64_t>(i.ny + i.nx));
  }

  /// Tensor t's momentum buffer (its size, in the parameters' layout); empty when the state
  /// keeps no momentum (momentum = 0 at init).
  tensor_view<const S, space> momentum(std::size_t t) const {
    const auto& i = at(t);
    if (!has_m_) return {};
    return tensor_view<const S, space>::vector(m_.data() + i.m_off, static_cast<std::int64_t>(i.size));
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.adafactor";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// Writes the state into the open section of `w`: element type, step count, a layout row
  /// per tensor (size, factored flag, row and column statistic sizes), the second moments
  /// ("statistics") and the momentum buffer ("momentum", empty without momentum).
  void save(const B& b, archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<S>));
    w.put("steps", steps_);
    detail::optim::put_layout(w, layout(), 4);
    detail::optim::put_state_buffer(b, w, "statistics", v_.data(), v_.size());
    detail::optim::put_state_buffer(b, w, "momentum", m_.data(), m_.size());
  }
  /// Reads what `save(b, w)` wrote, for the same parameters and options. All or nothing.
  /// @throws gradapt::error naming the first field that does not match (nothing is changed)
  void load(const B& b, archive_reader& r) {
    constexpr const char* who = "adafactor_state::load";
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<S>), who, ": the checkpoint holds ", et,
                    " state but this state is ", name(dtype_of_v<S>));
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), who, ": step count ", steps,
                    " cannot grow");
    detail::optim::expect_layout(r, layout(), 4, who, "size, factored, row statistics, column statistics");
    const auto v = detail::optim::get_state_buffer<S>(r, "statistics", v_.size(), who);
    const auto m = detail::optim::get_state_buffer<S>(r, "momentum", m_.size(), who);
    r.finish_section();
    b.copy(tensor_view<const S, host_space>(host_view(v)),
           tensor_view<S, space>::vector(v_.data(), static_cast<std::int64_t>(v_.size())));
    b.copy(tensor_view<const S, host_space>(host_view(m)),
           tensor_view<S, space>::vector(m_.data(), static_cast<std::int64_t>(m_.size())));
    b.synchronize();
    steps_ = steps;
  }
  /// The state as one archive of kind "gradapt.adafactor" (core/archive.hpp).
  std::vector<std::byte> save(const B& b) const { return save_archive(*this, b); }
  /// Restores a state written by `save(b)`; all or nothing.
  void load(const B& b, std::span<const std::byte> bytes) { load_archive(*this, b, bytes); }

 private:
  friend class adafactor;
  std::vector<std::int64_t> layout() const {
    std::vector<std::int64_t> out;
    for (const auto& i : info_)
      out.insert(out.end(), {static_cast<std::int64_t>(i.size), i.f.factored ? 1 : 0,
                             static_cast<std::int64_t>(i.ny), static_cast<std::int64_t>(i.nx)});
    return out;
  }
  struct tensor_info {
    std::size_t size = 0;
    detail::optim::factoring f;
    std::size_t ny = 0, nx = 0;  ///< row / column statistic sizes (factored), or ny = size
    std::size_t v_off = 0, m_off = 0;
    std::array<std::int64_t, 5> nd{1, 1, 1, 1, 1};  ///< view of the normalised statistic
    std::size_t ng = 0;                             ///< normalisation groups
    std::size_t norm_len = 1;                       ///< elements per normalisation group
  };
  const tensor_info& at(std::size_t t) const {
    detail::require(t < info_.size(), "adafactor_state: tensor ", t, " out of range (", info_.size(),
                    " tensors)");
    return info_[t];
  }

  /// The workspace of slot k (one per thread of the host's task mode).
  detail::adafactor_k::workspace<S> slot(std::size_t k) {
    return {fy_.data() + k * my_, fx_.data() + k * mx_, sy_.data() + k * my_, sx_.data() + k * mx_,
            sn_.data() + k * mg_, red_.data() + 3 * k,  sl_.data() + k * my_};
  }

  std::uint64_t steps_ = 0;
  bool has_m_ = false;
  std::size_t my_ = 0, mx_ = 0, mg_ = 0;  ///< per-slot workspace sizes
  std::size_t slots_ = 1;                 ///< workspace slots
  std::size_t total_ = 0;                 ///< parameters in the list
  std::vector<std::size_t> order_;        ///< tensors by size, largest first (task order)
  std::vector<std::size_t> sizes_;        ///< elements of each tensor
  std::vector<tensor_info> info_;
  detail::optim::buffer_t<B, S> v_, m_, fy_, fx_;
  detail::optim::buffer_t<B, double> sy_, sx_, sn_, red_, sl_;  ///< sl_: per-line Σp² (host)
};

/// Adafactor (see the file comment). Same interface as the chain presets:
///
///     gradapt::adafactor opt({.momentum = 0.9});
///     auto st = opt.init(backend, params);
///     opt.step(backend, params, st, {.lr = schedule(t)});
class adafactor {
 public:
  /// `adafactor({})`: the default options (an exact match for the empty braces, which the
  /// options constructor alone would leave ambiguous with the move constructor).
  adafactor(std::initializer_list<adafactor_options> o) : adafactor(detail::options_from(o, "adafactor")) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit adafactor(const adafactor_options& o = {}) : o_(o) { validate(o_); }

  /// The options.
  const adafactor_options& options() const { return o_; }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const adafactor_options& o) {
    const auto finite_nonneg = [](double v) { return std::isfinite(v) && v >= 0; };
    detail::require(finite_nonneg(o.lr), "adafactor: lr is ", o.lr, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.decay_rate) && o.decay_rate >= 0, "adafactor: decay_rate is ",
                    o.decay_rate, " (expected finite and >= 0; 0.8 in the paper)");
    detail::require(o.min_dim_size_to_factor >= 0, "adafactor: min_dim_size_to_factor is ",
                    o.min_dim_size_to_factor, " (expected >= 0)");
    detail::require(finite_nonneg(o.eps1), "adafactor: eps1 is ", o.eps1, " (expected finite and >= 0)");
    detail::require(o.eps1_mode != adafactor_eps1::clamp || o.eps1 > 0,
                    "adafactor: eps1 is 0 with "
                    "eps1_mode = clamp (expected > 0: it bounds 1/sqrt(v))");
    detail::require(o.clipping_threshold > 0 && !std::isnan(o.clipping_threshold),
                    "adafactor: clipping_threshold is ", o.clipping_threshold,
                    " (expected > 0; +inf turns clipping off)");
    detail::require(finite_nonneg(o.eps2), "adafactor: eps2 is ", o.eps2, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1, "adafactor: momentum is ",
                    o.momentum, " (expected 0 <= momentum < 1; 0 keeps no momentum buffer)");
    detail::require(finite_nonneg(o.weight_decay), "adafactor: weight_decay is ", o.weight_decay,
                    " (expected finite and >= 0)");
  }

  /// Creates the state for `params`: statistics, momentum (when enabled) and workspace,
  /// zero-initialised, in the backend's memory.
  template <class S = void, factored_backend B, element V, element G, class Options>
  auto init(const B& b, const param_list<V, G, typename B::space, Options>& params) const {
    using St = std::conditional_t<std::is_void_v<S>, compute_t<V>, S>;
    static_assert(std::is_same_v<compute_t<V>, compute_t<G>> && std::is_same_v<compute_t<V>, St>,
                  "gradapt::adafactor: the state element type is the parameters' compute type");
    validate(o_);
    adafactor_state<B, V, G, St> st;
    st.has_m_ = o_.momentum > 0;
    std::size_t v_total = 0, m_total = 0, my = 0, mx = 0, mg = 0;
    for (std::size_t t = 0; t < params.size(); ++t) {
      const auto& e = params[t];
      typename adafactor_state<B, V, G, St>::tensor_info i;
      i.size = e.value.size();
      i.f = detail::optim::factor_of(e.value.shape(), o_.factored, o_.axes, o_.min_dim_size_to_factor);
      if (i.size == 0) i.f.factored = false;
      if (i.f.factored) {
        const auto [A, X, Bd, Y, C] = i.f.d;
        i.ny = static_cast<std::size_t>(A * X * Bd * C);
        i.nx = static_cast<std::size_t>(A * Bd * Y * C);
        if (i.f.largest_is_y) {  // normalised: the statistic over Y, [A, X, B, C], over X
          i.nd = {A, X, Bd * C, 1, 1};
          i.ng = static_cast<std::size_t>(A * Bd * C);
          i.norm_len = static_cast<std::size_t>(X);
        } else {  // normalised: the statistic over X, [A, B, Y, C], over Y
          i.nd = {A * Bd, Y, C, 1, 1};
          i.ng = static_cast<std::size_t>(A * Bd * C);
          i.norm_len = static_cast<std::size_t>(Y);
        }
        my = std::max(my, i.ny);
        mx = std::max(mx, i.nx);
        mg = std::max(mg, i.ng);
      } else {
        i.ny = i.size;
      }
      i.v_off = v_total;
      v_total += i.ny + i.nx;
      i.m_off = m_total;
      if (st.has_m_) m_total += i.size;
      st.info_.push_back(i);
    }
    const std::size_t slots = detail::optim::task_slots(b);
    st.slots_ = slots;
    st.my_ = my;
    st.mx_ = mx;
    st.mg_ = mg;
    for (const auto& i : st.info_) {
      st.total_ += i.size;
      st.sizes_.push_back(i.size);
    }
    st.order_ = detail::optim::largest_first(st.sizes_);
    st.v_ = b.template allocate<St>(v_total);
    st.m_ = b.template allocate<St>(m_total);
    st.sy_ = b.template allocate<double>(my * slots);
    st.sx_ = b.template allocate<double>(mx * slots);
    st.sn_ = b.template allocate<double>(mg * slots);
    st.fy_ = b.template allocate<St>(my * slots);
    st.fx_ = b.template allocate<St>(mx * slots);
    st.red_ = b.template allocate<double>(3 * slots);
    st.sl_ = b.template allocate<double>(my * slots);
    {  // a grow-only device workspace is sized now (the first step may be captured into a graph)
      std::vector<tensor_view<const V, typename B::space>> values(params.size());
      std::size_t lines = 0;
      for (std::size_t t = 0; t < params.size(); ++t) {
        values[t] = params[t].value;
        const auto& i = st.info_[t];
        if (i.f.factored)
          lines = std::max(lines, static_cast<std::size_t>(i.f.d[0] * i.f.d[1] * i.f.d[2]) + 1);
      }
      detail::optim::reserve_workspace(b, values, 1, lines);
    }
    return st;
  }

  /// One Adafactor step over all tensors (see the file comment).
  /// @throws gradapt::error when `params` does not match the state or the learning rate is
  ///         not finite and >= 0
  template <factored_backend B, element V, element G, class Options, class S>
  void step(const B& b, const param_list<V, G, typename B::space, Options>& params,
            adafactor_state<B, V, G, S>& st, const step_args& args = {}) const {
    detail::require(params.size() == st.info_.size(), "adafactor::step: the parameter list holds ",
                    params.size(), " tensors but the state was created for ", st.info_.size(),
                    " (create the state with init() for this list)");
    for (std::size_t t = 0; t < params.size(); ++t)
      detail::require(params[t].value.size() == st.info_[t].size, "adafactor::step: parameter '",
                      params[t].name, "' (tensor ", t, ") has ", params[t].value.size(),
                      " elements but the state holds ", st.info_[t].size);
    detail::require((o_.momentum > 0) == st.has_m_, "adafactor::step: momentum is ",
                    o_.momentum > 0 ? "on" : "off", " but the state was created with it ",
                    st.has_m_ ? "on" : "off", " (create a new state with init())");
    const double lr = args.lr.value_or(o_.lr);
    detail::require(std::isfinite(lr) && lr >= 0, "adafactor::step: learning rate ", lr,
                    " (expected finite and >= 0)");
    using C = compute_t<V>;
    using space = typename B::space;
    const std::uint64_t t = st.steps_ + 1;
    const double td = t > o_.decay_offset ? static_cast<double>(t - o_.decay_offset) : 1.0;
    const double w = std::pow(td, -o_.decay_rate);  // 1 - beta
    const C beta = static_cast<C>(1.0 - w), wc = static_cast<C>(w);
    const double lr_t = o_.relative_step ? std::min(lr, 1.0 / std::sqrt(static_cast<double>(t))) : lr;
    const bool clamp = o_.eps1_mode == adafactor_eps1::clamp;
    const C eps_add = clamp ? C(0) : static_cast<C>(o_.eps1);
    const C clamp_v = clamp ? static_cast<C>(o_.eps1 * o_.eps1) : C(0);
    const C inv_eps = clamp ? static_cast<C>(1.0 / o_.eps1) : C(0);
    const C floor = clamp ? static_cast<C>(o_.eps1) : C(0);
    const auto vec = [](auto* p, std::size_t n) { return gradapt::detail::optim::vector_view<space>(p, n); };
    const auto cvec = [](auto* p, std::size_t n) {
      return gradapt::detail::optim::const_vector_view<space>(p, n);
    };
    constexpr bool on_host = std::is_same_v<space, host_space>;
    const bool clip_on = std::isfinite(o_.clipping_threshold);
    const detail::adafactor_k::update_scalars<C> base{
        C(0), static_cast<C>(o_.momentum), static_cast<C>(1.0 - o_.momentum),
        static_cast<C>(o_.weight_decay * (o_.weight_decay_times_lr ? lr : 1.0))};
    // ws.red of a slot: [Σ y² (clipping), Σ p² (parameter scale), the update's scale]. On a
    // device all three stay in device memory: the step never waits for the host.
    const auto update_scale = [&](const B& bb, double* red, std::size_t n) {
      const detail::adafactor_k::scale_params kp{
          static_cast<double>(n),        o_.clipping_threshold, o_.eps2, lr_t, clip_on,
          o_.multiply_by_parameter_scale};
      if constexpr (on_host)
        red[2] = detail::adafactor_k::update_scale(kp, red[0], red[1]);
      else
        bb.apply(detail::adafactor_k::scale_from_sums{kp}, vec(red, 1), vec(red + 1, 1), vec(red + 2, 1));
    };
    // The update's scalars on the host (the scale by value); on a device the kernel reads it.
    const auto host_scalars = [&](const double* red) {
      auto s = base;
      if constexpr (on_host) s.scale = static_cast<C>(red[2]);
      return s;
    };

    // One tensor on backend bb with workspace slot `slot` (tensors are independent).
    const auto one = [&](const B& bb, std::size_t k, std::size_t slot) {
      const auto ws = st.slot(slot);
      const auto& i = st.info_[k];
      if (i.size == 0) return;
      const auto& e = params[k];
      const auto p = e.value.flat();
      const auto g = tensor_view<const G, space>(e.grad.flat());
      S* v = st.v_.data() + i.v_off;
      S* m = st.has_m_ ? st.m_.data() + i.m_off : nullptr;
      if (i.f.factored) {
        // (1) row and column sums of s = g² + eps1 (on the host with Σp², read in the same
        // pass), EMAs of their means.
        bool have_p_sq = false;
        const auto stats = detail::adafactor_k::square_plus<C>{eps_add};
        if constexpr (factored_sumsq_backend<std::remove_cvref_t<decltype(bb)>>) {
          if (o_.multiply_by_parameter_scale) {
            ws.red[1] =
                bb.reduce_factored_sumsq(stats, i.f.d, cvec(ws.fy, 0), cvec(ws.fx, 0), g, vec(ws.sy, i.ny),
                                         vec(ws.sx, i.nx), tensor_view<const V, space>(p), vec(ws.sl, i.ny));
            have_p_sq = true;
          }
        }
        if (!have_p_sq)
          bb.reduce_factored(stats, i.f.d, cvec(ws.fy, 0), cvec(ws.fx, 0), g, vec(ws.sy, i.ny),
                             vec(ws.sx, i.nx));
        const auto [A, X, Bd, Y, Cd] = i.f.d;
        bb.apply(detail::adafactor_k::ema_mean<C>{beta, wc, 1.0 / static_cast<double>(Y)}, vec(v, i.ny),
                 vec(ws.sy, i.ny));
        bb.apply(detail::adafactor_k::ema_mean<C>{beta, wc, 1.0 / static_cast<double>(X)},
                 vec(v + i.ny, i.nx), vec(ws.sx, i.nx));
        // (2) factors: the normalised statistic's and the other's.
        S* vn = i.f.largest_is_y ? v : v + i.ny;
        S* vo = i.f.largest_is_y ? v + i.ny : v;
        S* fn = i.f.largest_is_y ? ws.fy : ws.fx;
        S* fo = i.f.largest_is_y ? ws.fx : ws.fy;
        const std::size_t nn = i.f.largest_is_y ? i.ny : i.nx, no = i.f.largest_is_y ? i.nx : i.ny;
        bb.reduce_factored(detail::adafactor_k::identity{}, i.nd, cvec(fn, 0), cvec(fn, 0), cvec(vn, nn),
                           vec(ws.sx, 0), vec(ws.sn, i.ng));
        bb.apply_factored(detail::adafactor_k::norm_factor<C>{1.0 / static_cast<double>(i.norm_len), floor},
                          i.nd, cvec(ws.fy, 0), cvec(ws.sn, i.ng), vec(vn, nn), vec(fn, nn));
        bb.apply(detail::adafactor_k::inv_sqrt<C>{}, vec(vo, no), vec(fo, no));
        const auto fy = cvec(ws.fy, i.ny);
        const auto fx = cvec(ws.fx, i.nx);
        // (3) Σ y² for the clipping and Σ p² for the parameter scale, then the scale.
        if (clip_on)
          dispatch_norm(i.f.largest_is_y, clamp, [&]<bool NY, bool CL>() {
            bb.apply_factored_sum(detail::adafactor_k::factored_clip_sum<NY, CL, C>{inv_eps}, i.f.d, fy, fx,
                                  vec(ws.red, 1), g);
            return 0.0;
          });
        if (o_.multiply_by_parameter_scale && !have_p_sq) param_sum_squares(bb, ws.red + 1, p);
        update_scale(bb, ws.red, i.size);
        // (4) the update.
        const auto s = host_scalars(ws.red);
        dispatch_norm(i.f.largest_is_y, clamp, [&]<bool NY, bool CL>() {
          if (m)
            bb.apply_factored(
                detail::adafactor_k::factored_update<NY, CL, true, C, !on_host>{inv_eps, s, ws.red + 2},
                i.f.d, fy, fx, p, g, vec(m, i.size));
          else
            bb.apply_factored(
                detail::adafactor_k::factored_update<NY, CL, false, C, !on_host>{inv_eps, s, ws.red + 2},
                i.f.d, fy, fx, p, g);
          return 0.0;
        });
      } else {
        const auto vv = vec(v, i.size);
        const tensor_view<S, space> vl[1] = {vv};
        const tensor_view<const G, space> gl[1] = {g};
        bb.apply_reduce_list(detail::adafactor_k::full_moment<C>{beta, wc, eps_add, clamp_v},
                             detail::optim::per_tensor_arg(vec(ws.red, 1)),
                             std::span<const tensor_view<S, space>>(vl),
                             std::span<const tensor_view<const G, space>>(gl));
        if (o_.multiply_by_parameter_scale) param_sum_squares(bb, ws.red + 1, p);
        update_scale(bb, ws.red, i.size);
        const auto s = host_scalars(ws.red);
        if (m)
          bb.apply(detail::adafactor_k::full_update<true, C, !on_host>{clamp_v, s, ws.red + 2}, p, g, vv,
                   vec(m, i.size));
        else
          bb.apply(detail::adafactor_k::full_update<false, C, !on_host>{clamp_v, s, ws.red + 2}, p, g, vv);
      }
    };
    for_tensors(b, st, one);
    ++st.steps_;
  }

 private:
  adafactor_options o_;

  /// Calls one(backend, k, slot) for every tensor k (detail::optim::for_tensors: on the host
  /// with more than one thread, large tensors on all threads, the others as one-thread tasks
  /// with a workspace slot each; the bits do not depend on the mode).
  template <class B, class St, class F>
  static void for_tensors(const B& b, const St& st, const F& one) {
    detail::optim::for_tensors(b, std::span<const std::size_t>(st.order_),
                               std::span<const std::size_t>(st.sizes_), st.total_, st.slots_, one);
  }

  template <class F>
  static double dispatch_norm(bool norm_y, bool clamp, F&& f) {
    if (clamp) return f.template operator()<true, true>();  // the order is irrelevant with the clamp
    return norm_y ? f.template operator()<true, false>() : f.template operator()<false, false>();
  }

  /// Σ p² of one tensor into `out[0]` through the backend's fused reduction (on a device it
  /// stays there).
  template <class B, class P>
  static void param_sum_squares(const B& b, double* out, const P& p) {
    using space = typename B::space;
    using T = typename P::value_type;
    const tensor_view<const T, space> pl[1] = {p};
    b.apply_reduce_list(detail::adafactor_k::square_sum{},
                        detail::optim::per_tensor_arg(tensor_view<double, space>::vector(out, 1)),
                        std::span<const tensor_view<const T, space>>(pl));
  }
};

/// The chain type of `adafactor_chain`: optax's adafactor as a composition of stages.
using adafactor_chain_type = chain<transform::scale_by_factored_rms, transform::clip_by_block_rms,
                                   transform::scale_by_learning_rate, transform::scale_by_param_block_rms,
                                   transform::ema, transform::add_decayed_weights, transform::scale>;

/// Adafactor assembled from gradient transformations, in optax's order:
///
///     scale_by_factored_rms → clip_by_block_rms(clipping_threshold) → scale_by_learning_rate(lr,
///     relative_step) → scale_by_param_block_rms(eps2) → ema(momentum) →
///     add_decayed_weights(weight_decay [× lr]) → scale(−1)
///
/// with the same options as `gradapt::adafactor` (stages switched off by them cost nothing:
/// clipping_threshold = +inf, multiply_by_parameter_scale = false, momentum = 0). It gives the
/// standalone class's results within rounding (the class folds clipping, learning rate and
/// parameter scale into one multiplication per element; the chain applies them one by one),
/// bit for bit when clipping and the parameter scale are off
/// and is the form to extend: reach a stage through `stage<I>()`, or build your own chain
/// starting with `transform::scale_by_factored_rms`. The learning rate sits in two stages
/// (stage 2, and stage 5 with weight_decay_times_lr): pass it per step (`step_args::lr`, which
/// both read) or change both. The standalone class is the faster of the
/// two on the host (it measures Σp² in its first pass; the chain spends a pass per barrier).
/// @throws gradapt::error naming an invalid option
inline adafactor_chain_type adafactor_chain(const adafactor_options& o = {}) {
  adafactor::validate(o);
  return adafactor_chain_type{
      transform::scale_by_factored_rms{.factored = o.factored,
                                       .decay_rate = o.decay_rate,
                                       .decay_offset = o.decay_offset,
                                       .min_dim_size_to_factor = o.min_dim_size_to_factor,
                                       .eps = o.eps1,
                                       .eps_mode = o.eps1_mode,
                                       .axes = o.axes},
      transform::clip_by_block_rms{.threshold = o.clipping_threshold},
      transform::scale_by_learning_rate{
          .lr = o.lr, .flip_sign = false, .relative_step = o.relative_step, .allow_negative = false},
      transform::scale_by_param_block_rms{.min_scale = o.eps2, .active = o.multiply_by_parameter_scale},
      transform::ema{.decay = o.momentum, .debias = false},
      transform::add_decayed_weights{
          .weight_decay = o.weight_decay, .times_lr = o.weight_decay_times_lr, .lr = o.lr},
      transform::scale{.factor = -1.0}};
}

}  // namespace gradapt

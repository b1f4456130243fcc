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
/// otherwise. A workspace (row and column sums and factors, one slot per host thread) is
/// allocated at init and reused for every tensor; the step allocates nothing.
///
/// `gradapt::adafactor` is a `gradapt::chain` of the stages above (see the class). The chain
/// runs a factored tensor's passes back to back, so a tensor of up to a few MiB is re-read
/// from the last-level cache: (1) read g, row and column sums of g² (backend
/// `reduce_factored`; on the host `reduce_factored_sumsq`, which also reads p for the
/// parameter scale's Σp² in the same pass); (2) read g, Σ y² for the clipping; (3) other
/// backends only: read p for Σp²; (4) read g, p (and m), write p (and m). The row and column
/// factors (R_i/mean R)^(−1/2) and C_j^(−1/2) are computed once per row and column. The sums
/// and the per-tensor factors stay where the backend runs (on CUDA a step never waits for
/// the host). On the host with T > 1 threads, tensors smaller than 1/T of the list run as
/// whole one-thread tasks (`host::run_tasks`), larger ones first, each on all threads; the
/// bits do not depend on T.
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
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
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
  double eps1 = 1e-30;  ///< regulariser of g² (torch: eps[0] = 1.19e-7, float's epsilon); must be > 0
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

/// y of an unfactored tensor from its advanced v.
template <class V, class C>
GRADAPT_HD GRADAPT_INLINE V full_y(const V& g, const V& v, C clamp) {
  return g * (V(C(1)) / simd::sqrt(simd::max(v, V(clamp))));
}

}  // namespace detail::adafactor_k

namespace transform {

/// Adafactor's factored second moment (Shazeer & Stern 2018), as optax's
/// `scale_by_factored_rms`, with torch.optim.Adafactor's switches: the first stage of a chain
/// (see `gradapt::adafactor` for optax's whole Adafactor). With β_t = 1 − (t −
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
  /// β_t = 1 − t^(−decay_rate); in (0, 1]. Default 0.8.
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

  /// One buffer (the statistics: v, or R then C); never reads p; factored: row and column
  /// statistics per tensor.
  static constexpr stage_spec traits{.buffers = 1, .uses_param = false, .factored_state = true};
  /// The options every rank must share (train::data_parallel_step agrees on them at
  /// construction), named "scale_by_factored_rms <option>".
  static constexpr auto option_fields() {
    return GRADAPT_OPTION_FIELDS(scale_by_factored_rms, factored, decay_rate, decay_offset,
                                 min_dim_size_to_factor, eps, eps_mode, axes);
  }

  /// @throws gradapt::error naming the option when decay_rate is outside (0, 1], eps is not
  ///         positive and finite, or min_dim_size_to_factor is negative
  void validate() const {
    gradapt::detail::require(std::isfinite(decay_rate) && decay_rate > 0.0 && decay_rate <= 1.0,
                             "scale_by_factored_rms: decay_rate is ", decay_rate,
                             " (expected in (0, 1]; 0.8 in the paper)");
    gradapt::detail::require(std::isfinite(eps) && eps > 0.0, "scale_by_factored_rms: eps is ", eps,
                             " (expected finite and > 0: with 0, a row of zero gradients gives 0/0)");
    gradapt::detail::require(min_dim_size_to_factor >= 0, "scale_by_factored_rms: min_dim_size_to_factor is ",
                             min_dim_size_to_factor, " (expected >= 0)");
  }

  /// How a tensor of this shape is handled: factored over its [A, X, B, Y, C] view, with the
  /// normalised statistic's grouping in `norm`.
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
    // row and column sums, the normalisation's group sums, then per-line sums of p² (the
    // statistics pass's Σp², see `advance`)
    t.ws_sums = t.rows + t.cols + static_cast<std::size_t>(groups) + t.rows;
    if (f.largest_is_y)
      t.norm = {{A, X, Bd * C}, groups, X, true};
    else
      t.norm = {{A * Bd, Y, C}, groups, Y, false};
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
  /// doubles. Backend operations only (no host synchronisation on CUDA). With `p_squares`
  /// (on a `factored_sumsq_backend`), the statistics pass also reads the parameters p and
  /// writes Σp² there: the sum a following scale_by_param_block_rms needs, at no extra read.
  template <class C, class B, class S, class G, class P = S>
  void advance(const B& b, const kernel<C>& k, const factored_tensor& t,
               tensor_view<S, typename B::space> state, tensor_view<const G, typename B::space> g, S* ws,
               double* sums, tensor_view<const P, typename B::space> p = {},
               double* p_squares = nullptr) const {
    using space = typename B::space;
    const auto [vec, cvec] = gradapt::detail::optim::vector_views<space>();
    const std::int64_t X = t.d[1], Y = t.d[3];
    const std::size_t ny = t.rows, nx = t.cols;
    const std::array<std::int64_t, 5> nd{t.norm.d[0], t.norm.d[1], t.norm.d[2], 1, 1};
    const std::size_t ng = static_cast<std::size_t>(t.norm.groups);
    const double norm_len = static_cast<double>(t.norm.length);
    const bool largest_is_y = t.norm.largest_is_y;
    S* v = state.data();
    S* fy = ws;
    S* fx = ws + ny;
    double* sy = sums;
    double* sx = sums + ny;
    double* sn = sums + ny + nx;
    // Row and column sums of s = g² + eps (and Σp²), then the EMAs of their means.
    bool sums_done = false;
    if constexpr (factored_sumsq_backend<B>) {
      if (p_squares != nullptr) {
        *p_squares =
            b.reduce_factored_sumsq(gradapt::detail::adafactor_k::square_plus<C>{k.eps_add}, t.d, cvec(fy, 0),
                                    cvec(fx, 0), g, vec(sy, ny), vec(sx, nx), p, vec(sn + ng, ny));
        sums_done = true;
      }
    }
    if (!sums_done)
      b.reduce_factored(gradapt::detail::adafactor_k::square_plus<C>{k.eps_add}, t.d, cvec(fy, 0),
                        cvec(fx, 0), g, vec(sy, ny), vec(sx, nx));
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

/// The chain behind `gradapt::adafactor`: optax's adafactor as a composition of stages.
using adafactor_chain_type = chain<transform::scale_by_factored_rms, transform::clip_by_block_rms,
                                   transform::scale_by_learning_rate, transform::scale_by_param_block_rms,
                                   transform::ema, transform::add_decayed_weights, transform::scale>;

/// Adafactor (see the file comment), in optax's order of stages:
///
///     scale_by_factored_rms → clip_by_block_rms(clipping_threshold) → scale_by_learning_rate(lr,
///     relative_step) → scale_by_param_block_rms(eps2) → ema(momentum) →
///     add_decayed_weights(weight_decay [× lr]) → scale(−1)
///
/// Stages switched off by the options cost nothing (clipping_threshold = +inf,
/// multiply_by_parameter_scale = false, momentum = 0, weight_decay = 0). A `gradapt::chain`:
/// `init(backend, params)` and `step(backend, params, state, {.lr})`, a `chain_state` whose
/// buffer 0 holds the second moments (a factored tensor's row then column statistics) and
/// buffer 1 the momentum; reach a stage through `stage<I>()`. The learning rate sits in two
/// stages (2, and 5 with weight_decay_times_lr): pass it per step (`step_args::lr`, which both
/// read). Needs a `factored_backend`.
class adafactor : public adafactor_chain_type {
 public:
  /// `adafactor({})`: the default options (an exact match for the empty braces, which the
  /// options constructor alone would leave ambiguous with the copy and move constructors).
  adafactor(std::initializer_list<adafactor_options> o) : adafactor(detail::options_from(o, "adafactor")) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit adafactor(const adafactor_options& o = {}) : adafactor_chain_type(stages(o)) {}

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const adafactor_options& o) {
    const auto finite_nonneg = [](double v) { return std::isfinite(v) && v >= 0; };
    detail::require(finite_nonneg(o.lr), "adafactor: lr is ", o.lr, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.decay_rate) && o.decay_rate > 0 && o.decay_rate <= 1,
                    "adafactor: decay_rate is ", o.decay_rate, " (expected in (0, 1]; 0.8 in the paper)");
    detail::require(o.min_dim_size_to_factor >= 0, "adafactor: min_dim_size_to_factor is ",
                    o.min_dim_size_to_factor, " (expected >= 0)");
    detail::require(std::isfinite(o.eps1) && o.eps1 > 0, "adafactor: eps1 is ", o.eps1,
                    " (expected finite and > 0: with 0 a row of zero gradients gives 0/0; with the clamp "
                    "it bounds 1/sqrt(v))");
    detail::require(o.clipping_threshold > 0 && !std::isnan(o.clipping_threshold),
                    "adafactor: clipping_threshold is ", o.clipping_threshold,
                    " (expected > 0; +inf turns clipping off)");
    detail::require(finite_nonneg(o.eps2), "adafactor: eps2 is ", o.eps2, " (expected finite and >= 0)");
    detail::require(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1, "adafactor: momentum is ",
                    o.momentum, " (expected 0 <= momentum < 1; 0 keeps no momentum buffer)");
    detail::require(finite_nonneg(o.weight_decay), "adafactor: weight_decay is ", o.weight_decay,
                    " (expected finite and >= 0)");
  }

 private:
  static adafactor_chain_type stages(const adafactor_options& o) {
    validate(o);
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
};

}  // namespace gradapt

#pragma once
/// @file
/// Dynamic loss scaling for mixed-precision training (Micikevicius et al. 2018, "Mixed
/// Precision Training", ICLR; arXiv:1710.03740, section 3.2).
///
/// The loss is multiplied by a scale S before the backward pass, so small fp16 gradients do
/// not flush to zero; the gradients then carry the factor S and are unscaled (multiplied by
/// 1/S) before the optimizer step. S is adapted: a step whose gradients hold inf or NaN is
/// skipped and S backs off; after `growth_interval` clean steps in a row S grows.
///
///     overflow:  skip the step; (after the hysteresis budget is spent) S ← max(S·backoff, min_scale)
///     clean:     step; after growth_interval clean steps in a row S ← min(S·growth, max_scale)
///
/// Three parts:
///  - `loss_scaler`: the policy (options + a plain state; `update(found_inf)`), and the
///    collective entry point `unscale(backend, comm, grads)` that runs the fused pass, agrees on
///    the overflow across ranks and updates the scale;
///  - `unscale_count_nonfinite`: the fused pass alone: one pass over a gradient list that
///    multiplies by 1/S and counts the elements that are not finite after the multiplication
///    (in place, or from 16-bit gradients into fp32 master gradients);
///  - `unscale_flag_nonfinite`: the same pass for backends without a fused apply + reduce
///    (the CUDA backend): a flag in the backend's memory is set instead of a count.

#include <atomic>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/configured.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Hyperparameters of loss_scaler, e.g. `gradapt::loss_scaler_options{.growth_interval = 1000}`.
/// The defaults are PyTorch's `torch.amp.GradScaler` defaults plus DeepSpeed's minimum scale
/// and apex's maximum scale.
///
/// | name                   | type   | default | meaning                                              |
/// |------------------------|--------|---------|------------------------------------------------------|
/// | init_scale             | double | 2^16    | scale of the first step                              |
/// | growth_factor          | double | 2       | S ← S·growth after growth_interval clean steps (> 1) |
/// | backoff_factor         | double | 0.5     | S ← S·backoff on a back-off (0 < backoff < 1)        |
/// | growth_interval        | int64  | 2000    | clean steps in a row before S grows (>= 1)           |
/// | hysteresis             | int    | 1       | H: H − 1 overflows tolerated before a back-off       |
/// | consecutive_hysteresis | bool   | false   | refill hysteresis on each clean step (else on growth) |
/// | min_scale              | double | 1       | lower bound; an overflow at min_scale throws         |
/// | max_scale              | double | 2^24    | upper bound: growth is capped, S is never inf        |
///
/// The scale is kept in float precision, as PyTorch keeps it in a float32 tensor: the
/// framework multiplies a float loss by it, and 1/S must be the reciprocal of the factor the
/// gradients actually carry. init_scale, min_scale and max_scale are therefore rounded to the
/// nearest float at construction, and every update rounds S·factor (computed in double) to
/// float, exactly as PyTorch's `_amp_update_scale_` does.
struct loss_scaler_options {
  double init_scale = 65536.0;          ///< S of the first step, in [min_scale, max_scale]
  double growth_factor = 2.0;           ///< > 1
  double backoff_factor = 0.5;          ///< in (0, 1)
  std::int64_t growth_interval = 2000;  ///< >= 1
  int hysteresis = 1;                   ///< >= 1; overflows tolerated before backing off = hysteresis − 1
  bool consecutive_hysteresis = false;  ///< refill the budget on each clean step (else on growth)
  double min_scale = 1.0;               ///< >= 2^-126 (1/S must be a finite float)
  double max_scale = 16777216.0;        ///< <= the largest finite float
};

/// The complete state of a loss_scaler: plain data (`state()`, `restore()`); `save()` and
/// `load()` carry it in a state archive (core/archive.hpp).
struct loss_scaler_state {
  double scale = 65536.0;           ///< current S (a float value), the factor for the next loss
  std::int64_t growth_tracker = 0;  ///< clean steps since the last overflow or growth, < growth_interval
  int hysteresis_left = 1;          ///< overflows until the next back-off (DeepSpeed's cur_hysteresis), >= 1
  std::uint64_t steps = 0;          ///< updates seen (stepped + skipped)
  std::uint64_t skipped = 0;        ///< steps skipped because the gradients were not finite
  std::uint64_t backoffs = 0;       ///< overflows that reduced S
  std::uint64_t growths = 0;        ///< growth events (the clean-step count reached growth_interval)

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(loss_scaler_state, scale, growth_tracker, hysteresis_left, steps, skipped,
                                  backoffs, growths);
  }
};

namespace detail::loss_scale {

#if defined(__GNUC__) && !defined(__clang__)
#define GRADAPT_DETAIL_NOINLINE_GCC __attribute__((noinline))
#else
#define GRADAPT_DETAIL_NOINLINE_GCC
#endif
/// Rounds to the nearest float (the precision the scale is kept in). Not inlined with GCC:
/// GCC 12.2's straight-line vectoriser, at -O2, pairs two adjacent calls into one cvtpd2ps and
/// then stores the unrounded doubles; a call keeps each rounding intact.
GRADAPT_DETAIL_NOINLINE_GCC inline double to_float(double x) {
  return static_cast<double>(static_cast<float>(x));
}
#undef GRADAPT_DETAIL_NOINLINE_GCC

/// Smallest |v| (compute type) that is stored as ±inf in element type T, or the largest finite
/// value of the compute type for float/double: `v` is non-finite after the store exactly when
/// !(−limit < v < limit) for 16-bit types and !(−limit <= v <= limit) for float/double.
/// For half: 65520 = 65504 + half an ulp (ties to even round up to inf). For bfloat16: the
/// float with bits 0x7f7f8000 (largest bfloat16 plus half an ulp; ties to even round up).
template <class T>
GRADAPT_HD GRADAPT_INLINE bool nonfinite_when_stored(compute_t<T> v) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, half>) {
    return !(v < 65520.0f && v > -65520.0f);
  } else if constexpr (std::is_same_v<U, bfloat16>) {
    const float lim = detail::bits_float(0x7f7f8000u);
    return !(v < lim && v > -lim);
  } else if constexpr (std::is_same_v<U, float>) {
    const float lim = detail::bits_float(0x7f7fffffu);  // largest finite float
    return !(v <= lim && v >= -lim);
  } else {
    const double lim = 1.7976931348623157e308;  // largest finite double (a literal: usable on devices)
    return !(v <= lim && v >= -lim);
  }
}

#if GRADAPT_SIMD_PACKS
/// Pack form of `nonfinite_when_stored`: 1.0 in the lanes whose value is not finite once stored
/// as T, 0.0 elsewhere, widened to double (the same limits and comparisons, lane by lane).
template <class T, class V>
GRADAPT_INLINE simd::terms_t<V, 1> nonfinite_when_stored_pack(const V& v) {
  using U = std::remove_cv_t<T>;
  using S = simd::scalar_t<V>;
  decltype(v < v) finite;
  if constexpr (std::is_same_v<U, half>) {
    finite = (v < V(S(65520.0f))) & (v > V(S(-65520.0f)));
  } else if constexpr (std::is_same_v<U, bfloat16>) {
    const S lim = detail::bits_float(0x7f7f8000u);
    finite = (v < V(lim)) & (v > V(-lim));
  } else if constexpr (std::is_same_v<U, float>) {
    const S lim = detail::bits_float(0x7f7fffffu);
    finite = (v <= V(lim)) & (v >= V(-lim));
  } else {
    const S lim = S(1.7976931348623157e308);
    finite = (v <= V(lim)) & (v >= V(-lim));
  }
  simd::terms_t<V, 1> r;
  r[0] = simd::widen(simd::select(finite, V(S(0)), V(S(1))));
  return r;
}
#endif

/// In-place unscale, returning 1 for an element that is not finite after the store.
template <class G>
struct unscale_count_inplace {
  /// The host runs it on `simd::pack`s of float or double (same bits as the scalar form).
  static constexpr bool vectorizable = true;
  float inv_scale;
  GRADAPT_HD GRADAPT_INLINE double operator()(compute_t<G>& g) const {
    g = g * static_cast<compute_t<G>>(inv_scale);
    return nonfinite_when_stored<G>(g) ? 1.0 : 0.0;
  }
#if GRADAPT_SIMD_PACKS
  template <class V>
  requires simd::is_pack_v<V> GRADAPT_INLINE simd::terms_t<V, 1>
  operator()(V& g) const {
    g = g * static_cast<simd::scalar_t<V>>(inv_scale);
    return nonfinite_when_stored_pack<G>(g);
  }
#endif
};

/// master = g · (1/S), returning 1 for a master element that is not finite after the store.
template <class M, class G>
struct unscale_count_into {
  /// The host runs it on `simd::pack`s when M and G share a compute type (fp16/bf16/fp32
  /// gradients into fp32 masters); same bits as the scalar form.
  static constexpr bool vectorizable = true;
  float inv_scale;
  GRADAPT_HD GRADAPT_INLINE double operator()(compute_t<M>& master, compute_t<G> g) const {
    master = static_cast<compute_t<M>>(g * static_cast<compute_t<G>>(inv_scale));
    return nonfinite_when_stored<M>(master) ? 1.0 : 0.0;
  }
#if GRADAPT_SIMD_PACKS
  template <class V>
  requires simd::is_pack_v<V> GRADAPT_INLINE simd::terms_t<V, 1>
  operator()(V& master, const V& g) const {
    master = g * static_cast<simd::scalar_t<V>>(inv_scale);
    return nonfinite_when_stored_pack<M>(master);
  }
#endif
};

/// Sets *flag to 1. Every writer writes the same value; on the host the store is a relaxed
/// atomic (threads of the host backend may race on it), on a device a volatile store.
GRADAPT_HD inline void raise_flag(float* flag) {
#if GRADAPT_DEVICE_PASS
  *static_cast<volatile float*>(flag) = 1.0f;
#else
  std::atomic_ref<float>(*flag).store(1.0f, std::memory_order_relaxed);
#endif
}

/// In-place unscale that raises a flag (in the backend's memory) on a non-finite result.
template <class G>
struct unscale_flag_inplace {
  float inv_scale;
  float* flag;
  GRADAPT_HD GRADAPT_INLINE void operator()(compute_t<G>& g) const {
    g = g * static_cast<compute_t<G>>(inv_scale);
    if (nonfinite_when_stored<G>(g)) raise_flag(flag);
  }
};

/// master = g · (1/S) that raises a flag on a non-finite master element.
template <class M, class G>
struct unscale_flag_into {
  float inv_scale;
  float* flag;
  GRADAPT_HD GRADAPT_INLINE void operator()(compute_t<M>& master, compute_t<G> g) const {
    master = static_cast<compute_t<M>>(g * static_cast<compute_t<G>>(inv_scale));
    if (nonfinite_when_stored<M>(master)) raise_flag(flag);
  }
};

/// Writes a constant (used on the flag workspace, in whatever memory space it lives in).
struct set_value {
  float value;
  GRADAPT_HD void operator()(float& x) const { x = value; }
};

/// Views of a list, and their element type.
template <class L>
using view_t = std::remove_cvref_t<std::ranges::range_value_t<L>>;
template <class L>
using elem_t = typename view_t<L>::element_type;

/// True when the backend offers a fused element-wise apply + per-tensor sum.
template <class B, class F, class... Ls>
concept fused_apply_reduce = requires(const B& b, F f, std::span<double> out, const Ls&... ls) {
  b.apply_reduce_list(f, out, ls...);
};

/// Views are converted to const in chunks of this many (on the stack: nothing is allocated).
inline constexpr std::size_t view_chunk = 64;

/// Calls fn(master_chunk, const_grad_chunk, offset) over matching chunks of two lists; the
/// gradient views are converted to read-only views so the backend never writes them back.
template <class LM, class LG, class Fn>
void for_each_chunk(const LM& master, const LG& grads, Fn&& fn) {
  using GV = view_t<LG>;
  using CG = tensor_view<const typename GV::value_type, typename GV::space>;
  using MV = view_t<LM>;
  const std::size_t count = std::ranges::size(grads);
  const auto* gp = std::ranges::data(grads);
  const auto* mp = std::ranges::data(master);
  CG buf[view_chunk];
  for (std::size_t off = 0; off < count; off += view_chunk) {
    const std::size_t n = count - off < view_chunk ? count - off : view_chunk;
    for (std::size_t i = 0; i < n; ++i) buf[i] = gp[off + i];
    fn(std::span<const MV>(mp + off, n), std::span<const CG>(buf, n), off);
  }
}

/// Checks that `master` has one tensor per gradient tensor, of the same size. Returns the
/// message ("" when valid) instead of throwing, so a collective caller can agree on errors.
template <class LG, class LM>
std::string check_master(const LG& grads, const LM& master, const char* fn) {
  const std::size_t count = std::ranges::size(grads);
  if (std::ranges::size(master) != count)
    return message(fn, ": ", count, " gradient tensors but ", std::ranges::size(master),
                   " master-gradient tensors (expected one master buffer per gradient tensor)");
  const auto* gp = std::ranges::data(grads);
  const auto* mp = std::ranges::data(master);
  for (std::size_t t = 0; t < count; ++t)
    if (gp[t].size() != mp[t].size())
      return message(fn, ": gradient tensor ", t, " has ", gp[t].size(), " elements but master tensor ", t,
                     " has ", mp[t].size(), " (expected equal sizes)");
  return {};
}

inline std::string check_per_tensor(std::size_t count, std::span<double> per_tensor, const char* fn) {
  if (!per_tensor.empty() && per_tensor.size() != count)
    return message(fn, ": per_tensor has ", per_tensor.size(), " slots for ", count,
                   " tensors (expected equal, or empty)");
  return {};
}

/// Throws unless `inv_scale` is a positive, finite factor 1/S (`fn` names the entry point).
inline void require_inv_scale(float inv_scale, const char* fn) {
  require(std::isfinite(inv_scale) && inv_scale > 0.0f, fn, ": inv_scale is ", inv_scale,
          " (expected a positive, finite factor 1/S)");
}

/// The argument checks of both unscale_flag_nonfinite overloads: the factor and the flag view.
template <class Space>
void require_flag_args(float inv_scale, tensor_view<float, Space> flag) {
  require_inv_scale(inv_scale, "unscale_flag_nonfinite");
  require(flag.size() >= 1, "unscale_flag_nonfinite: the flag view is empty (expected 1 float)");
}

}  // namespace detail::loss_scale

/// The fused unscale pass, in place: for every element g of every tensor, g ← g · inv_scale
/// (in the compute type, one rounding on the store), and counts the elements that are not
/// finite AFTER the store: an inf/NaN that was already there, or a finite product that
/// overflows the element type (an fp16 gradient times 1/S > 1 beyond 65504, for example).
/// One read and one write per element. PyTorch's `_amp_foreach_non_finite_check_and_unscale_`
/// checks the input only; for 1/S <= 1 both checks agree (no product can overflow).
///
/// Needs a backend with `apply_reduce_list` (the host backend). Per-tensor counts go to
/// `per_tensor` when it is not empty (one slot per tensor).
/// @return the number of non-finite elements on this rank (an integer, exact up to 2^53)
template <backend B, class L>
requires view_list<L, typename B::space>
double unscale_count_nonfinite(const B& b, const L& grads, float inv_scale,
                               std::span<double> per_tensor = {}) {
  using G = detail::loss_scale::elem_t<L>;
  static_assert(!std::is_const_v<G>,
                "gradapt::unscale_count_nonfinite: the gradients are unscaled in place; "
                "pass views of mutable elements");
  using F = detail::loss_scale::unscale_count_inplace<G>;
  static_assert(detail::loss_scale::fused_apply_reduce<B, F, L>,
                "gradapt::unscale_count_nonfinite needs a backend with apply_reduce_list (use "
                "unscale_flag_nonfinite with this backend)");
  detail::loss_scale::require_inv_scale(inv_scale, "unscale_count_nonfinite");
  const std::string e =
      detail::loss_scale::check_per_tensor(std::ranges::size(grads), per_tensor, "unscale_count_nonfinite");
  if (!e.empty()) throw error(e);
  return b.apply_reduce_list(F{inv_scale}, per_tensor, grads);
}

/// The fused unscale pass into master gradients: master ← g · inv_scale for every element
/// (16-bit gradients into fp32 master buffers, typically), counting the master elements that
/// are not finite after the store. The gradients are only read (2 bytes per fp16 element) and
/// the master buffers only written. `master` must hold one tensor per gradient tensor with
/// the same number of elements (shapes may differ).
/// @return the number of non-finite master elements on this rank
template <backend B, class L, class LM>
requires view_list<L, typename B::space> && view_list<LM, typename B::space>
double unscale_count_nonfinite(const B& b, const L& grads, const LM& master, float inv_scale,
                               std::span<double> per_tensor = {}) {
  using G = detail::loss_scale::elem_t<L>;
  using M = detail::loss_scale::elem_t<LM>;
  static_assert(!std::is_const_v<M>,
                "gradapt::unscale_count_nonfinite: master gradients are written; pass "
                "views of mutable elements");
  using F = detail::loss_scale::unscale_count_into<M, G>;
  using CG = tensor_view<const std::remove_cv_t<G>, typename B::space>;
  static_assert(detail::loss_scale::fused_apply_reduce<B, F, std::span<const detail::loss_scale::view_t<LM>>,
                                                       std::span<const CG>>,
                "gradapt::unscale_count_nonfinite needs a backend with apply_reduce_list (use "
                "unscale_flag_nonfinite with this backend)");
  detail::loss_scale::require_inv_scale(inv_scale, "unscale_count_nonfinite");
  std::string e = detail::loss_scale::check_master(grads, master, "unscale_count_nonfinite");
  if (e.empty())
    e = detail::loss_scale::check_per_tensor(std::ranges::size(grads), per_tensor, "unscale_count_nonfinite");
  if (!e.empty()) throw error(e);
  double total = 0.0;
  detail::loss_scale::for_each_chunk(master, grads, [&](auto m, auto g, std::size_t off) {
    total += b.apply_reduce_list(F{inv_scale},
                                 per_tensor.empty() ? per_tensor : per_tensor.subspan(off, g.size()), m, g);
  });
  return total;
}

/// The unscale pass for backends without a fused apply + reduce (the CUDA backend): the same
/// element math as unscale_count_nonfinite, in place, with `flag[0]` (a float in the
/// backend's memory space) set to 1 when any element is not finite after the store. The flag
/// is not cleared here: zero it before the pass. One read and one write per element; the
/// work is enqueued on the backend (no synchronisation).
template <backend B, class L>
requires view_list<L, typename B::space>
void unscale_flag_nonfinite(const B& b, const L& grads, float inv_scale,
                            tensor_view<float, typename B::space> flag) {
  using G = detail::loss_scale::elem_t<L>;
  static_assert(!std::is_const_v<G>,
                "gradapt::unscale_flag_nonfinite: the gradients are unscaled in place; "
                "pass views of mutable elements");
  detail::loss_scale::require_flag_args(inv_scale, flag);
  b.apply_list(detail::loss_scale::unscale_flag_inplace<G>{inv_scale, flag.data()}, grads);
}

/// The flag form of the pass into master gradients (master ← g · inv_scale; the gradients are
/// only read). See the in-place overload.
template <backend B, class L, class LM>
requires view_list<L, typename B::space> && view_list<LM, typename B::space>
void unscale_flag_nonfinite(const B& b, const L& grads, const LM& master, float inv_scale,
                            tensor_view<float, typename B::space> flag) {
  using G = detail::loss_scale::elem_t<L>;
  using M = detail::loss_scale::elem_t<LM>;
  static_assert(!std::is_const_v<M>,
                "gradapt::unscale_flag_nonfinite: master gradients are written; pass "
                "views of mutable elements");
  detail::loss_scale::require_flag_args(inv_scale, flag);
  const std::string e = detail::loss_scale::check_master(grads, master, "unscale_flag_nonfinite");
  if (!e.empty()) throw error(e);
  detail::loss_scale::for_each_chunk(master, grads, [&](auto m, auto g, std::size_t) {
    b.apply_list(detail::loss_scale::unscale_flag_into<M, G>{inv_scale, flag.data()}, m, g);
  });
}

/// Dynamic loss scaler (Micikevicius et al. 2018), with PyTorch GradScaler's growth/back-off
/// rule and DeepSpeed's optional hysteresis.
///
/// Each step, after the framework's backward pass on `loss * scale()`:
///
///     if (!scaler.unscale(backend, comm, params)) continue;  // overflow: skip the step
///     opt.step(...);                                          // gradients are unscaled
///
/// `unscale` is collective: it unscales this rank's gradients in one fused pass, agrees on the
/// overflow across ranks with one allreduce, updates the scale, and returns whether to step.
/// Every rank gets the same answer and keeps the same scale. **A skipped step must not reach
/// the optimizer**: when `unscale` returns false, do not call the optimizer's step (its step
/// count and bias corrections must not advance), and discard the gradients (they hold
/// non-finite values). The scale used for the next loss is `scale()` after the call.
///
/// The rule (H = hysteresis, h = hysteresis_left, starting at H):
///  - overflow: the step is skipped and the clean-step count resets to 0. If h > 1, h ← h − 1
///    and S is kept (the overflow is tolerated). Otherwise S ← max(S·backoff, min_scale); when
///    S already equals min_scale this throws gradapt::error instead (the gradients overflow
///    even unscaled: running on would only produce NaN). h is not refilled by a back-off, so
///    once the budget is spent every further overflow backs off until it is refilled.
///  - clean step: with consecutive_hysteresis, h ← H. The clean-step count grows by one; when
///    it reaches growth_interval it resets to 0, h ← H, and S ← min(S·growth, max_scale).
/// With H = 1 this is exactly PyTorch's `torch.amp.GradScaler` rule (plus the two bounds);
/// with H > 1 it is DeepSpeed's `DynamicLossScaler` (delayed_shift = H), whose tolerated
/// overflows also restart the growth window and also skip the step.
///
/// Errors are agreed on: invalid arguments on one rank (list length mismatch, say) make every
/// rank throw, so no rank is left waiting in a collective. On any throw the scaler's state is
/// unchanged (gradients of ranks with valid input may already be unscaled).
class loss_scaler : public archived_state<loss_scaler, loss_scaler_state>,
                    public configured<loss_scaler, loss_scaler_options, loss_scaler_state> {
 public:
  /// `loss_scaler(options)` (throws gradapt::error when an option is out of range, naming it)
  /// and `loss_scaler({})` (the default options).
  using configured::configured;

  /// The validated options (init/min/max scale rounded to float).
  const loss_scaler_options& options() const { return opt_; }

  /// The current scale S: multiply the loss by it before the backward pass.
  double scale() const { return st_.scale; }
  /// The factor unscale multiplies by: float(1 / S), computed in double and rounded once
  /// (PyTorch's `scale.double().reciprocal().float()`).
  float inv_scale() const { return static_cast<float>(1.0 / st_.scale); }

  /// Updates seen: steps taken plus steps skipped.
  std::uint64_t steps() const { return st_.steps; }
  /// Steps skipped because some rank's gradients were not finite.
  std::uint64_t skipped() const { return st_.skipped; }
  /// Overflows that reduced the scale (skipped() minus the overflows tolerated by hysteresis).
  std::uint64_t backoffs() const { return st_.backoffs; }
  /// Times the clean-step count reached growth_interval (the scale grew, or stayed at max_scale).
  std::uint64_t growths() const { return st_.growths; }

  /// Unscales `grads` in place (g ← g / S), agrees across ranks on whether any element of any
  /// rank is not finite after unscaling, updates the scale, and returns true when the
  /// optimizer should step. Collective over `comm` (one allreduce of two doubles).
  ///
  /// Host memory. With a backend that has `apply_reduce_list` (the host backend) the pass is
  /// fused (`unscale_count_nonfinite`); with another host backend it uses the flag form.
  template <backend B, communicator C, class L>
  requires view_list<L, typename B::space> && std::same_as<typename B::space, host_space> &&
      std::same_as<typename C::space, host_space>
  [[nodiscard]] bool unscale(const B& b, C& comm, const L& grads) {
    return unscale_host(b, comm, grads, nullptr);
  }

  /// Unscales 16-bit (or any) gradients into master buffers (master ← g / S; the gradients are
  /// only read) and proceeds as the in-place form; the overflow check is on the master values.
  template <backend B, communicator C, class L, class LM>
  requires view_list<L, typename B::space> && view_list<LM, typename B::space> &&
      std::same_as<typename B::space, host_space> && std::same_as<typename C::space, host_space>
  [[nodiscard]] bool unscale(const B& b, C& comm, const L& grads, const LM& master) {
    return unscale_host(b, comm, grads, master);
  }

  /// The in-place form over a parameter list's gradients.
  template <backend B, communicator C, element V, element G, memory_space S, class O>
  requires std::same_as<typename B::space, host_space> && std::same_as<S, host_space> &&
      std::same_as<typename C::space, host_space>
  [[nodiscard]] bool unscale(const B& b, C& comm, const param_list<V, G, S, O>& params) {
    return unscale_host(b, comm, params.grads(), nullptr);
  }

  /// Any memory space (the CUDA backend with the NCCL communicator): the flag form of the pass
  /// into `workspace`, a caller-owned buffer of at least 2 floats in the backend's space (flag,
  /// error flag), one allreduce (max) of those 2 floats, and one small reduction that brings
  /// them to the host (on CUDA it synchronises the stream). The backend's and the
  /// communicator's work must be ordered (the same CUDA stream).
  template <backend B, communicator C, class L>
  requires view_list<L, typename B::space> && std::same_as<typename B::space, typename C::space>
  [[nodiscard]] bool unscale(const B& b, C& comm, const L& grads,
                             tensor_view<float, typename B::space> workspace) {
    return unscale_flagged(b, comm, grads, nullptr, workspace);
  }

  /// Any memory space, into master buffers; see the workspace form above.
  template <backend B, communicator C, class L, class LM>
  requires view_list<L, typename B::space> && view_list<LM, typename B::space> &&
      std::same_as<typename B::space, typename C::space>
  [[nodiscard]] bool unscale(const B& b, C& comm, const L& grads, const LM& master,
                             tensor_view<float, typename B::space> workspace) {
    return unscale_flagged(b, comm, grads, master, workspace);
  }

  /// The collective half of `unscale` for gradients unscaled piece by piece elsewhere (for
  /// example bucket by bucket during the backward pass, each piece through
  /// `unscale_count_nonfinite(b, piece, inv_scale())`): agrees across ranks on whether any rank
  /// counted a non-finite element (`found`, this rank's count) or failed (`local_error`, thrown
  /// on this rank and named on the others), updates the scale, and returns true when the
  /// optimizer should step. Collective over `comm` (one allreduce of three doubles, as unscale).
  /// @throws gradapt::error on every rank when a rank passed a local error or a `found` that is
  ///         not a finite count >= 0, or called another collective; on an overflow at min_scale
  template <communicator C>
  requires std::same_as<typename C::space, host_space>
  [[nodiscard]] bool decide(C& comm, double found, const std::string& local_error = {}) {
    std::string err = local_error;
    if (err.empty() && !(std::isfinite(found) && found >= 0.0))
      err = detail::message("loss_scaler::decide on rank ", comm.rank(), ": found is ", found,
                            " (expected this rank's count of non-finite gradient elements, finite and >= 0)");
    return update(agree(comm, found, err, "loss_scaler::decide"));
  }

  /// `decide` on any communicator: the agreement travels through a buffer of backend `b` in
  /// the communicator's memory space (copied in and out; on CUDA the copy back waits for the
  /// stream). Pass the count, or a flag (1 when any element was not finite, from
  /// `unscale_flag_nonfinite` brought to the host), as `found`.
  template <communicator C, backend B>
  requires std::same_as<typename C::space, typename B::space>
  [[nodiscard]] bool decide(C& comm, const B& b, double found, const std::string& local_error = {}) {
    std::string err = local_error;
    if (err.empty() && !(std::isfinite(found) && found >= 0.0))
      err = detail::message("loss_scaler::decide on rank ", comm.rank(), ": found is ", found,
                            " (expected this rank's count of non-finite gradient elements, finite and >= 0)");
    return update(agree(comm, found, err, "loss_scaler::decide", &b));
  }

  /// Applies one step of the rule with an overflow decision made elsewhere (every rank must
  /// pass the same value). Returns !found_inf: whether the optimizer should step.
  /// @throws gradapt::error on an overflow at min_scale (state unchanged)
  [[nodiscard]] bool update(bool found_inf) {
    loss_scaler_state s = st_;
    ++s.steps;
    if (found_inf) {
      ++s.skipped;
      s.growth_tracker = 0;
      if (s.hysteresis_left > 1) {
        --s.hysteresis_left;
      } else {
        detail::require(s.scale > opt_.min_scale,
                        "loss_scaler: the gradients overflowed at the minimum loss scale ", opt_.min_scale,
                        " (step ", s.steps, ", ", s.skipped,
                        " skipped so far): they are not finite even unscaled, and backing off further would "
                        "only feed NaN to the optimizer. Check the model and data for inf/NaN, lower the "
                        "learning rate, keep overflowing layers in fp32/bf16, or lower min_scale");
        const double next = detail::loss_scale::to_float(s.scale * opt_.backoff_factor);
        s.scale = next > opt_.min_scale ? next : opt_.min_scale;
        ++s.backoffs;
      }
    } else {
      if (opt_.consecutive_hysteresis) s.hysteresis_left = opt_.hysteresis;
      if (++s.growth_tracker == opt_.growth_interval) {
        s.growth_tracker = 0;
        s.hysteresis_left = opt_.hysteresis;
        const double next = detail::loss_scale::to_float(s.scale * opt_.growth_factor);
        s.scale = next < opt_.max_scale ? next : opt_.max_scale;
        ++s.growths;
      }
    }
    st_ = s;
    return !found_inf;
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.loss_scaler";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The complete state (plain data).
  const loss_scaler_state& state() const { return st_; }
  /// Sets the state; later steps are bit-identical to the run it was taken from.
  /// @throws gradapt::error when the state does not fit these options (state unchanged)
  void restore(const loss_scaler_state& s) {
    detail::require(std::isfinite(s.scale) && s.scale >= opt_.min_scale && s.scale <= opt_.max_scale &&
                        detail::loss_scale::to_float(s.scale) == s.scale,
                    "loss_scaler::load: scale ", s.scale, " is outside [min_scale ", opt_.min_scale,
                    ", max_scale ", opt_.max_scale,
                    "] or not a float value (was the state saved with other options?)");
    detail::require(s.growth_tracker >= 0 && s.growth_tracker < opt_.growth_interval,
                    "loss_scaler::load: growth_tracker ", s.growth_tracker,
                    " is outside [0, growth_interval ", opt_.growth_interval, ")");
    detail::require(s.hysteresis_left >= 1 && s.hysteresis_left <= opt_.hysteresis,
                    "loss_scaler::load: hysteresis_left ", s.hysteresis_left, " is outside [1, hysteresis ",
                    opt_.hysteresis, "]");
    detail::require(s.skipped <= s.steps && s.backoffs <= s.skipped && s.growths <= s.steps &&
                        s.steps < std::numeric_limits<std::uint64_t>::max(),
                    "loss_scaler::load: inconsistent counters (", s.steps, " steps, ", s.skipped,
                    " skipped, ", s.backoffs, " back-offs, ", s.growths,
                    " growths; expected backoffs <= skipped <= steps, growths <= steps, steps < 2^64 - 1)");
    st_ = s;
    options_agreed_ = false;  // a loaded state is agreed again at the next unscale
  }

 private:
  friend class configured<loss_scaler, loss_scaler_options, loss_scaler_state>;

  static constexpr std::string_view name = "loss_scaler";

  static loss_scaler_state start(const loss_scaler_options& o) {
    loss_scaler_state s;
    s.scale = o.init_scale;
    s.hysteresis_left = o.hysteresis;
    return s;
  }
  static loss_scaler_options validated(const loss_scaler_options& in) {
    using detail::require;
    constexpr double fmax = static_cast<double>(std::numeric_limits<float>::max());
    constexpr double fmin = static_cast<double>(std::numeric_limits<float>::min());  // 2^-126
    const double growth = in.growth_factor, backoff = in.backoff_factor;
    const double lo = in.min_scale, hi = in.max_scale, init = in.init_scale;
    require(std::isfinite(growth) && growth > 1.0, "loss_scaler: growth_factor is ", growth,
            " (expected a finite factor > 1; 2 is typical)");
    require(std::isfinite(backoff) && backoff > 0.0 && backoff < 1.0, "loss_scaler: backoff_factor is ",
            backoff, " (expected 0 < backoff < 1; 0.5 is typical)");
    require(in.growth_interval >= 1, "loss_scaler: growth_interval is ", in.growth_interval,
            " (expected >= 1 clean steps; 2000 is typical)");
    require(in.hysteresis >= 1, "loss_scaler: hysteresis is ", in.hysteresis,
            " (expected >= 1; 1 backs off on every overflow, H backs off on the H-th)");
    require(lo >= fmin && lo <= fmax, "loss_scaler: min_scale is ", lo, " (expected a float in [2^-126, ",
            fmax, "] so that 1/scale is a finite float)");
    require(hi >= fmin && hi <= fmax, "loss_scaler: max_scale is ", hi,
            " (expected a finite float value <= ", fmax, ")");
    loss_scaler_options o = in;
    o.min_scale = detail::loss_scale::to_float(lo);
    o.max_scale = detail::loss_scale::to_float(hi);
    require(o.min_scale <= o.max_scale, "loss_scaler: min_scale ", lo, " exceeds max_scale ", hi);
    require(std::isfinite(init) && init >= o.min_scale && init <= o.max_scale, "loss_scaler: init_scale is ",
            init, " (expected a value in [min_scale ", o.min_scale, ", max_scale ", o.max_scale, "])");
    o.init_scale = detail::loss_scale::to_float(init);
    return o;
  }

  /// Agrees on (count or flag, error) across ranks; throws the agreed error; returns found_inf.
  /// A third summed value, the operation's tag, tells a rank whose sum met another operation's
  /// collective of the same size (its flag would be someone's gradient) that the ranks are out
  /// of step. On the first call the options are agreed too (gradapt::agree_values).
  /// With a backend `b` (any memory space), the words travel through its buffer.
  template <class C, class B = std::nullptr_t>
  bool agree(C& comm, double found, const std::string& local_error, const char* fn, const B* b = nullptr) {
    constexpr double tag =
        1.0 + static_cast<double>(static_cast<std::uint64_t>(detail::operation_tag("loss_scaler::unscale")) %
                                  (1u << 20));
    double buf[3] = {local_error.empty() ? found : 0.0, local_error.empty() ? 0.0 : 1.0, tag};
    if constexpr (std::is_same_v<B, std::nullptr_t>)
      comm.allreduce(tensor_view<double, host_space>::vector(buf, 3), reduce_op::sum);
    else
      detail::allreduce_host_values(comm, *b, std::span<double>(buf, 3), reduce_op::sum);
    if (!local_error.empty()) throw error(local_error);
    detail::require(buf[2] == tag * comm.size() && buf[1] == std::floor(buf[1]) && buf[1] >= 0.0, fn,
                    " on rank ", comm.rank(),
                    ": the ranks are not in the same operation (another rank called a different collective "
                    "of the same size); every rank must call loss_scaler::unscale together");
    detail::require(buf[1] == 0.0, fn, " on rank ", comm.rank(), ": ", buf[1],
                    " other rank(s) passed invalid input (see the error raised on those ranks)");
    if (!options_agreed_) {
      const agreed_value opts[] = {
          {"loss_scaler_options::init_scale", opt_.init_scale},
          {"loss_scaler_options::growth_factor", opt_.growth_factor},
          {"loss_scaler_options::backoff_factor", opt_.backoff_factor},
          {"loss_scaler_options::growth_interval", static_cast<double>(opt_.growth_interval)},
          {"loss_scaler_options::hysteresis", static_cast<double>(opt_.hysteresis)},
          {"loss_scaler_options::consecutive_hysteresis", opt_.consecutive_hysteresis ? 1.0 : 0.0},
          {"loss_scaler_options::min_scale", opt_.min_scale},
          {"loss_scaler_options::max_scale", opt_.max_scale},
          {"loss scale", st_.scale},
          {"updates", static_cast<double>(st_.steps)}};
      if constexpr (std::is_same_v<B, std::nullptr_t>)
        agree_values(comm, "loss_scaler::unscale", std::span<const agreed_value>(opts));
      else
        agree_values(comm, *b, "loss_scaler::unscale", std::span<const agreed_value>(opts));
      options_agreed_ = true;
    }
    return buf[0] > 0.0;
  }

  template <class B, class C, class L, class LM>
  bool unscale_host(const B& b, C& comm, const L& grads, const LM& master) {
    constexpr const char* fn = "loss_scaler::unscale";
    const float inv = inv_scale();
    std::string err;
    double found = 0.0;
    if constexpr (!std::is_same_v<LM, std::nullptr_t>)
      err = detail::loss_scale::check_master(grads, master, fn);
    if (err.empty()) {
      using G = detail::loss_scale::elem_t<L>;
      if constexpr (std::is_same_v<LM, std::nullptr_t>) {
        if constexpr (detail::loss_scale::fused_apply_reduce<B, detail::loss_scale::unscale_count_inplace<G>,
                                                             L>) {
          found = unscale_count_nonfinite(b, grads, inv);
        } else {
          float flag = 0.0f;
          unscale_flag_nonfinite(b, grads, inv, tensor_view<float, host_space>::scalar(&flag));
          found = flag;
        }
      } else {
        using M = detail::loss_scale::elem_t<LM>;
        using CG = tensor_view<const std::remove_cv_t<G>, host_space>;
        if constexpr (detail::loss_scale::fused_apply_reduce<B, detail::loss_scale::unscale_count_into<M, G>,
                                                             std::span<const detail::loss_scale::view_t<LM>>,
                                                             std::span<const CG>>) {
          found = unscale_count_nonfinite(b, grads, master, inv);
        } else {
          float flag = 0.0f;
          unscale_flag_nonfinite(b, grads, master, inv, tensor_view<float, host_space>::scalar(&flag));
          found = flag;
        }
      }
    }
    return update(agree(comm, found, err, fn));
  }

  template <class B, class C, class L, class LM>
  bool unscale_flagged(const B& b, C& comm, const L& grads, const LM& master,
                       tensor_view<float, typename B::space> ws) {
    constexpr const char* fn = "loss_scaler::unscale";
    using S = typename B::space;
    // Without a workspace there is nothing to agree through; its size is the same on every
    // rank by contract, so every rank throws here together.
    detail::require(ws.size() >= 2, fn, " on rank ", comm.rank(), ": the workspace has ", ws.size(),
                    " floats (expected at least 2 in ", S::name,
                    " memory: the overflow flag and an error flag)");
    std::string err;
    if constexpr (!std::is_same_v<LM, std::nullptr_t>)
      err = detail::loss_scale::check_master(grads, master, fn);
    const auto flag = tensor_view<float, S>::vector(ws.data(), 1);
    const auto eflag = tensor_view<float, S>::vector(ws.data() + 1, 1);
    b.apply(detail::loss_scale::set_value{0.0f}, flag);
    b.apply(detail::loss_scale::set_value{err.empty() ? 0.0f : 1.0f}, eflag);
    if (err.empty()) {
      if constexpr (std::is_same_v<LM, std::nullptr_t>)
        unscale_flag_nonfinite(b, grads, inv_scale(), flag);
      else
        unscale_flag_nonfinite(b, grads, master, inv_scale(), flag);
    }
    comm.allreduce(tensor_view<float, S>::vector(ws.data(), 2), reduce_op::max);
    const tensor_view<const float, S> parts[2] = {flag, eflag};
    double got[2] = {0.0, 0.0};
    b.reduce(reduction::sum, std::span<const tensor_view<const float, S>>(parts, 2),
             std::span<double>(got, 2));
    if (!err.empty()) throw error(err);
    detail::require(got[1] == 0.0, fn, " on rank ", comm.rank(),
                    ": another rank passed invalid input (see the error raised on that rank)");
    return update(got[0] > 0.0);
  }

  bool options_agreed_ = false;  ///< the options were agreed across ranks (host communicators)
};

}  // namespace gradapt

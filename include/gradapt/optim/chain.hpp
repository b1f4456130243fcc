#pragma once
/// @file
/// `gradapt::chain<Stages...>`: an optimizer composed from gradient transformations
/// (optax's `chain`), run with as few passes over memory as its stages allow, and its typed
/// state `gradapt::chain_state`.
///
/// Passes. The update u starts as the gradient g, flows through the stages in order, and the
/// chain ends with p ← p + u. Element-wise stages (Adam's moments, weight decay, momentum, the
/// learning rate) fuse into one pass. A *barrier* stage needs a reduction of its input over a
/// whole tensor (a trust-ratio norm) or over all tensors (a global norm) before it can act;
/// it ends a pass:
///
///     pass 0:  u = g → stages before barrier 1 (state advanced) → measure barrier 1's sums
///              (fused: backend.apply_reduce_list)
///     finalize: per-tensor (or global) factor from the sums, computed where the backend runs
///              (a tiny apply; on CUDA no host synchronisation)
///     pass 1:  replay the stages before barrier 1 from their new state, apply its factor,
///              advance the stages up to barrier 2, measure ...
///     last:    ... advance the remaining stages and write p ← p + u (backend.apply_list)
///
/// A replay rebuilds u instead of storing it between passes; a stage whose replay needs only
/// its state (Adam) cuts the rebuild there, so LAMB's second pass reads p, m, v and not g.
/// Views a pass only reads are passed as const lists, so the backend never writes them back.
/// Stages switched off by their options (momentum 0, no gradient clipping) cost nothing: the
/// chain keeps one compiled form per combination of optional stages and picks it at run time.
///
/// Factored chains. When stage 0 is a factored stage (Adafactor's or SM3's second moment, see
/// stage.hpp), the chain runs tensor by tensor: for a factored tensor the stage's `advance`
/// leaves row and column factors in a workspace and each pass above runs through the
/// backend's `apply_factored` (`factored_pass` puts the stage's output y(r, c, g) where the
/// gradient would be); other tensors run the passes over a one-tensor list. On the host the
/// tensors are scheduled as the factored optimizers do (`detail::optim::for_tensors`).
///
/// State. `init` allocates, through the backend, one buffer per state buffer of each active
/// stage (sized to all parameters; a factored stage's to what it keeps per tensor), plus
/// small per-tensor arrays and, for factored chains, a per-thread workspace; `step` allocates
/// nothing.
/// `chain_state::save` / `load` round-trip the state exactly.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/factoring.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt {

template <class... Stages>
class chain;

namespace detail::optim {

/// Compile-time description of one stage.
struct stage_info {
  bool barrier = false;
  bool global = false;
  bool optional = false;
  bool ignores_input = false;
  bool uses_param = true;
  bool factored = false;            ///< a factored second-moment stage (row and column statistics per tensor)
  bool measure_reads_input = true;  ///< a barrier whose measure reads u (false: p only)
  bool measures_param_squares = false;  ///< a barrier whose measure is Σp² (widened to double)
  bool max_statistics = false;          ///< a factored stage whose statistics are maxima of a term (SM3)
  std::size_t buffers = 0;
  std::size_t slots = 0;
  std::size_t terms = 0;
};

template <class S>
GRADAPT_HD constexpr stage_info info_of() {
  stage_info i;
  i.barrier = S::barrier;
  i.optional = S::optional;
  i.ignores_input = S::replay_ignores_input;
  i.uses_param = S::uses_param;
  i.buffers = S::buffers;
  i.slots = S::tensor_slots;
  if constexpr (requires { S::factored_state; }) {
    i.factored = S::factored_state;
    if constexpr (S::factored_state)
      static_assert(!S::barrier && S::buffers == 1 && !S::optional && !S::replay_ignores_input,
                    "gradapt::chain: a factored stage is a required element stage with one buffer whose "
                    "replay reads its input");
    if constexpr (requires { S::max_statistics; }) i.max_statistics = S::max_statistics;
  }
  if constexpr (S::barrier) {
    static_assert(S::buffers == 0, "gradapt::chain: a barrier stage keeps no per-element state");
    if constexpr (requires { S::measure_reads_input; }) i.measure_reads_input = S::measure_reads_input;
    if constexpr (requires { S::measures_param_squares; })
      i.measures_param_squares = S::measures_param_squares;
    i.global = S::global;
    i.terms = S::terms;
  }
  return i;
}

/// What a stage does in a pass.
enum class mode : unsigned char { skip, replay, update, measure };

/// Which list a backend argument of a pass is.
enum class arg_kind : unsigned char { param_mut, param_const, grad, buffer_mut, buffer_const };

struct arg_desc {
  arg_kind kind = arg_kind::param_const;
  std::size_t index = 0;  ///< buffer index for buffer kinds
};

/// The pass structure of a chain for the enabled-stage mask E (bit i: stage i is on).
template <class... S>
struct plan {
  static constexpr std::size_t n = sizeof...(S);
  static_assert(n >= 1 && n <= 64, "gradapt::chain holds 1 to 64 stages");
  static constexpr stage_info info[n] = {info_of<S>()...};
  /// info_at(k) without touching the static array, so the queries below also compile as device
  /// functions (nvcc has no device copy of a static constexpr member array).
  GRADAPT_HD static constexpr stage_info info_at(std::size_t k) {
    const stage_info a[n] = {info_of<S>()...};
    return a[k];
  }

  GRADAPT_HD static constexpr std::size_t buffer_offset(std::size_t i) {
    std::size_t o = 0;
    for (std::size_t k = 0; k < i; ++k) o += info_at(k).buffers;
    return o;
  }
  GRADAPT_HD static constexpr std::size_t slot_offset(std::size_t i) {
    std::size_t o = 0;
    for (std::size_t k = 0; k < i; ++k) o += info_at(k).slots;
    return o;
  }
  static constexpr std::size_t total_buffers = buffer_offset(n);
  static constexpr std::size_t total_slots = slot_offset(n);
  static constexpr std::size_t max_terms = [] {
    std::size_t m = 0;
    for (std::size_t k = 0; k < n; ++k) m = info_at(k).terms > m ? info_at(k).terms : m;
    return m;
  }();
  static constexpr std::uint64_t required_mask = [] {
    std::uint64_t m = 0;
    for (std::size_t k = 0; k < n; ++k)
      if (!info_at(k).optional) m |= std::uint64_t{1} << k;
    return m;
  }();
  static constexpr std::size_t optional_count = [] {
    std::size_t c = 0;
    for (std::size_t k = 0; k < n; ++k) c += info_at(k).optional ? 1 : 0;
    return c;
  }();
  static_assert(optional_count <= 6,
                "gradapt::chain compiles one form per combination of optional stages: at most 6");
  /// True when stage 0 is a factored stage: the chain then runs tensor by tensor (see
  /// chain::step).
  static constexpr bool has_factored = info_at(0).factored;
  static constexpr bool factored_first = [] {
    for (std::size_t k = 1; k < n; ++k)
      if (info_at(k).factored) return false;
    return true;
  }();
  static_assert(
      factored_first,
      "gradapt::chain: a factored stage (scale_by_factored_rms, scale_by_sm3) must be the first stage "
      "(it reads the gradient itself, as in optax's adafactor and sm3)");
  static constexpr bool any_global = [] {
    for (std::size_t k = 0; k < n; ++k)
      if (info_at(k).barrier && info_at(k).global) return true;
    return false;
  }();
  static_assert(
      !has_factored || !any_global,
      "gradapt::chain: a chain with a factored stage runs tensor by tensor and cannot hold a global "
      "barrier (clip_by_global_norm): clip the gradients before the step (gradapt::clip_by_global_norm "
      "in optim/clip.hpp)");
  static_assert(!has_factored || max_terms <= 1,
                "gradapt::chain: after a factored stage a barrier may measure one term per tensor "
                "(clip_by_block_rms, scale_by_param_block_rms), not two (trust ratios)");

  /// The mask with optional stage number j (in order) on exactly when bit j of `bits` is set.
  static constexpr std::uint64_t mask_of(std::size_t bits) {
    std::uint64_t m = required_mask;
    std::size_t j = 0;
    for (std::size_t k = 0; k < n; ++k)
      if (info_at(k).optional) {
        if ((bits >> j) & 1u) m |= std::uint64_t{1} << k;
        ++j;
      }
    return m;
  }

  GRADAPT_HD static constexpr bool on(std::size_t i, std::uint64_t e) { return ((e >> i) & 1u) != 0; }
  GRADAPT_HD static constexpr std::size_t barriers(std::uint64_t e) {
    std::size_t c = 0;
    for (std::size_t k = 0; k < n; ++k) c += (on(k, e) && info_at(k).barrier) ? 1 : 0;
    return c;
  }
  GRADAPT_HD static constexpr std::size_t barrier_pos(std::size_t j, std::uint64_t e) {
    for (std::size_t k = 0; k < n; ++k)
      if (on(k, e) && info_at(k).barrier && j-- == 0) return k;
    return n;
  }
  /// Number of enabled barriers before stage i (the slot of its factors).
  GRADAPT_HD static constexpr std::size_t barrier_number(std::size_t i, std::uint64_t e) {
    std::size_t c = 0;
    for (std::size_t k = 0; k < i; ++k) c += (on(k, e) && info_at(k).barrier) ? 1 : 0;
    return c;
  }
  GRADAPT_HD static constexpr std::size_t passes(std::uint64_t e) { return barriers(e) + 1; }
  GRADAPT_HD static constexpr bool is_final(std::size_t pass, std::uint64_t e) {
    return pass + 1 == passes(e);
  }
  GRADAPT_HD static constexpr std::size_t lo(std::size_t pass, std::uint64_t e) {
    return pass == 0 ? 0 : barrier_pos(pass - 1, e) + 1;
  }
  GRADAPT_HD static constexpr std::size_t hi(std::size_t pass, std::uint64_t e) {
    return is_final(pass, e) ? n : barrier_pos(pass, e);
  }
  /// True when a replayed stage rebuilds u from its state alone, so the stages before it and
  /// the gradient are not needed in this pass.
  GRADAPT_HD static constexpr bool starts_fresh(std::size_t pass, std::uint64_t e) {
    for (std::size_t k = 0; k < lo(pass, e); ++k)
      if (on(k, e) && !info_at(k).barrier && info_at(k).ignores_input) return true;
    return false;
  }
  GRADAPT_HD static constexpr std::size_t live_from(std::size_t pass, std::uint64_t e) {
    std::size_t s = 0;
    for (std::size_t k = 0; k < lo(pass, e); ++k)
      if (on(k, e) && !info_at(k).barrier && info_at(k).ignores_input) s = k;
    return s;
  }
  /// True when pass `pass` only measures its barrier from p: the barrier's measure does not
  /// read u and the stages it would advance keep no state (they are replayed in the next pass
  /// anyway), so the pass reads p alone (Adafactor's parameter scale).
  GRADAPT_HD static constexpr bool measure_only(std::size_t pass, std::uint64_t e) {
    if (is_final(pass, e) || info_at(hi(pass, e)).measure_reads_input) return false;
    for (std::size_t k = lo(pass, e); k < hi(pass, e); ++k)
      if (on(k, e) && !info_at(k).barrier && info_at(k).buffers > 0) return false;
    return true;
  }
  /// The first measure-only pass whose barrier sums p² (scale_by_param_block_rms), which a
  /// factored stage's statistics pass can take over on a backend that reads p there
  /// (`factored_sumsq_backend`); passes(e) when there is none.
  GRADAPT_HD static constexpr std::size_t param_squares_pass(std::uint64_t e) {
    for (std::size_t p = 0; p + 1 < passes(e); ++p)
      if (measure_only(p, e) && info_at(hi(p, e)).measures_param_squares) return p;
    return passes(e);
  }
  GRADAPT_HD static constexpr mode mode_of(std::size_t pass, std::size_t i, std::uint64_t e) {
    if (!on(i, e)) return mode::skip;
    if (measure_only(pass, e)) return i == hi(pass, e) ? mode::measure : mode::skip;
    if (starts_fresh(pass, e) && i < live_from(pass, e)) return mode::skip;
    if (i < lo(pass, e)) return mode::replay;
    if (i < hi(pass, e)) return mode::update;
    if (i == hi(pass, e) && !is_final(pass, e)) return mode::measure;
    return mode::skip;
  }
  GRADAPT_HD static constexpr bool active(std::size_t pass, std::size_t i, std::uint64_t e) {
    const mode m = mode_of(pass, i, e);
    return m == mode::replay || m == mode::update;
  }
  GRADAPT_HD static constexpr bool needs_grad(std::size_t pass, std::uint64_t e) {
    return !starts_fresh(pass, e) && !measure_only(pass, e);
  }
  GRADAPT_HD static constexpr bool needs_param(std::size_t pass, std::uint64_t e) {
    if (is_final(pass, e)) return true;
    for (std::size_t k = 0; k < n; ++k)
      if (mode_of(pass, k, e) != mode::skip && info_at(k).uses_param) return true;
    return false;
  }
  /// Argument position (after the tensor index) of the gradient.
  GRADAPT_HD static constexpr std::size_t grad_arg(std::size_t pass, std::uint64_t e) {
    return needs_param(pass, e) ? 1 : 0;
  }
  /// Argument position of stage i's first buffer.
  GRADAPT_HD static constexpr std::size_t buffer_arg(std::size_t pass, std::size_t i, std::uint64_t e) {
    std::size_t a = (needs_param(pass, e) ? 1 : 0) + (needs_grad(pass, e) ? 1 : 0);
    for (std::size_t k = 0; k < i; ++k)
      if (active(pass, k, e) && !info_at(k).barrier) a += info_at(k).buffers;
    return a;
  }
  GRADAPT_HD static constexpr std::size_t args(std::size_t pass, std::uint64_t e) {
    return buffer_arg(pass, n, e);
  }
  /// What backend argument a of the pass is.
  static constexpr arg_desc arg_at(std::size_t pass, std::uint64_t e, std::size_t a) {
    if (needs_param(pass, e)) {
      if (a == 0) return {is_final(pass, e) ? arg_kind::param_mut : arg_kind::param_const, 0};
      --a;
    }
    if (needs_grad(pass, e)) {
      if (a == 0) return {arg_kind::grad, 0};
      --a;
    }
    for (std::size_t k = 0; k < n; ++k) {
      if (!active(pass, k, e) || info_at(k).barrier) continue;
      if (a < info_at(k).buffers)
        return {mode_of(pass, k, e) == mode::update ? arg_kind::buffer_mut : arg_kind::buffer_const,
                buffer_offset(k) + a};
      a -= info_at(k).buffers;
    }
    return {};
  }
};

// ---- a device-friendly aggregate of the stages' kernels ------------------------------------

template <std::size_t I, class T>
struct kslot {
  T value;
};
template <class Seq, class... T>
struct kpack_base;
template <std::size_t... I, class... T>
struct kpack_base<std::index_sequence<I...>, T...> : kslot<I, T>... {};
/// One value of each type, trivially copyable when they are (it travels into CUDA kernels).
template <class... T>
struct kpack : kpack_base<std::index_sequence_for<T...>, T...> {};

template <std::size_t I, class T>
GRADAPT_HD GRADAPT_INLINE constexpr const T& kget(const kslot<I, T>& s) {
  return s.value;
}
template <std::size_t I, class T>
GRADAPT_HD GRADAPT_INLINE constexpr T& kget(kslot<I, T>& s) {
  return s.value;
}

/// Argument I of a pack of lvalues of one type (resolved at compile time: no addresses are
/// stored, so the compiler keeps the values in registers).
template <std::size_t I, class T, class... R>
GRADAPT_HD GRADAPT_INLINE T& nth(T& a, R&... r) {
  if constexpr (I == 0)
    return a;
  else
    return nth<I - 1>(r...);
}

/// The element functor of pass `Pass` under mask E: called with the tensor index and one
/// lvalue per backend argument (plan::arg_at), all in compute type C (or host packs of C).
/// `FT`: the element belongs to a factored tensor, whose factored stage (stage 0) is skipped
/// here: its output arrives through the gradient argument (factored_pass).
template <class Plan, std::size_t Pass, std::uint64_t E, class C, class K, bool FT = false>
struct pass_functor {
  static constexpr bool vectorizable = true;

  K kernels;
  const double* tconst;   ///< per-tensor constants, plan::total_slots per tensor
  const double* factors;  ///< barrier factors: [barrier number][tensor]
  std::size_t count;      ///< tensors

  template <std::size_t I, class V, class... A, std::size_t... J>
  GRADAPT_HD GRADAPT_INLINE void stage_step(V& u, const V& p, const double* tc, std::size_t t,
                                            std::index_sequence<J...>, A&... args) const {
    // Every plan query is a constant expression (nothing of the plan is read at run time, so
    // the same code compiles for the device).
    constexpr mode m = Plan::mode_of(Pass, I, E);
    if constexpr (FT && Plan::info_at(I).factored) {
      (void)u;
    } else if constexpr (m == mode::replay || m == mode::update) {
      constexpr std::size_t soff = Plan::slot_offset(I);
      constexpr std::size_t boff = Plan::buffer_arg(Pass, I, E);
      constexpr bool barrier = Plan::info_at(I).barrier;
      constexpr bool global = Plan::info_at(I).global;
      const auto& k = kget<I>(kernels);
      const double* stc = tc + soff;
      if constexpr (barrier) {
        constexpr std::size_t b = Plan::barrier_number(I, E);
        const double f = factors[b * count + (global ? 0 : t)];
        k.apply(u, p, static_cast<C>(f), stc);
      } else if constexpr (m == mode::update) {
        k.update(u, p, stc, nth<boff + J>(args...)...);
      } else {
        k.replay(u, p, stc, nth<boff + J>(args...)...);
      }
    }
  }

  template <class V, class... A, std::size_t... I>
  GRADAPT_HD GRADAPT_INLINE void run_stages(V& u, const V& p, const double* tc, std::size_t t,
                                            std::index_sequence<I...>, A&... args) const {
    (stage_step<I>(u, p, tc, t, std::make_index_sequence<Plan::info_at(I).buffers>{}, args...), ...);
  }

  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE V& param(V& unused, A&... args) const {
    if constexpr (Plan::needs_param(Pass, E))
      return nth<0>(args...);
    else
      return unused;
  }

  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE auto operator()(tensor_index t, V& a0, A&... rest) const {
    static_assert(1 + sizeof...(A) == Plan::args(Pass, E), "gradapt::chain: pass argument count mismatch");
    V unused{};
    V& p = param(unused, a0, rest...);
    V u;
    if constexpr (Plan::needs_grad(Pass, E))
      u = nth<Plan::grad_arg(Pass, E)>(a0, rest...);
    else
      u = V(C(0));
    constexpr std::size_t slots = Plan::total_slots;
    const double* tc = tconst + t.value * slots;
    run_stages(u, p, tc, t.value, std::make_index_sequence<Plan::n>{}, a0, rest...);
    if constexpr (Plan::is_final(Pass, E)) {
      p = p + u;
    } else {
      constexpr std::size_t h = Plan::hi(Pass, E);
      constexpr std::size_t hoff = Plan::slot_offset(h);
      return kget<h>(kernels).measure(u, p, tc + hoff);
    }
  }
};

/// A pass of the chain over one factored tensor, run by the backend's `apply_factored` as
/// f(r, c, args...): r and c are the factored stage's row and column factors of the element,
/// args the pass's arguments without the factored stage's buffer. The stage's output
/// u0 = y(r, c, g) replaces the gradient argument of the pass functor (which skips stage 0),
/// and a dummy takes the buffer's place. Returns the measured term of a non-final pass.
/// `Variant` is the tensor's `factored_tensor::variant`, passed on to the stage's `y`.
template <class Plan, std::size_t Pass, std::uint64_t E, class C, class K, bool Variant>
struct factored_pass {
  static constexpr bool vectorizable = true;
  using PF = pass_functor<Plan, Pass, E, C, K, true>;
  PF pf;

  static constexpr bool stage_on = Plan::active(Pass, 0, E);
  static constexpr std::size_t ga = Plan::grad_arg(Pass, E);
  static constexpr std::size_t va = Plan::buffer_arg(Pass, 0, E);
  static constexpr std::size_t full = Plan::args(Pass, E);

  template <std::size_t J, class V, class... A>
  GRADAPT_HD GRADAPT_INLINE V& pick(V& u0, V& dummy, A&... a) const {
    if constexpr (stage_on && J == va)
      return dummy;
    else if constexpr (stage_on && J == ga)
      return u0;
    else {
      constexpr std::size_t j = (stage_on && J > va) ? J - 1 : J;  // the position without the buffer
      return nth<j>(a...);
    }
  }
  template <class V, std::size_t... J, class... A>
  GRADAPT_HD GRADAPT_INLINE auto call(V& u0, V& dummy, std::index_sequence<J...>, A&... a) const {
    if constexpr (Plan::is_final(Pass, E))
      pf(tensor_index{0}, pick<J>(u0, dummy, a...)...);
    else
      return pf(tensor_index{0}, pick<J>(u0, dummy, a...)...)[0];
  }
  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE auto operator()(V r, V c, A&... a) const {
    static_assert(sizeof...(A) + (stage_on ? 1 : 0) == full, "gradapt::chain: factored pass argument count");
    V u0{};
    V dummy{};
    if constexpr (stage_on) u0 = kget<0>(pf.kernels).template y<Variant>(r, c, nth<ga>(a...));
    return call(u0, dummy, std::make_index_sequence<full>{}, a...);
  }
};

/// The single pass of a chain whose factored stage keeps maxima (SM3), for the backend's
/// `apply_factored_max`: returns the stage's term (whose row and column maxima become the new
/// statistics) and runs the chain's final pass (`FP`, a factored_pass) on the element.
template <class FP>
struct max_pass {
  static constexpr bool vectorizable = true;
  FP fp;
  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE V operator()(V r, V c, A&... a) const {
    const V t = term(r, c, a...);
    fp(r, c, a...);
    return t;
  }
  /// The stage's term alone (it reads the gradient, which no pass writes).
  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE V term(V r, V c, A&... a) const {
    return kget<0>(fp.pf.kernels).term(r, c, nth<FP::ga>(a...));
  }
};

/// factor[t] = finalize(sums of tensor t), over one-element views of the factor array.
template <class Kernel>
struct finalize_each {
  Kernel k;
  const double* sums;
  const double* tconst;
  std::size_t terms;
  std::size_t slots;
  std::size_t offset;
  GRADAPT_HD void operator()(tensor_index t, double& f) const {
    f = k.finalize(sums + t.value * terms, tconst + t.value * slots + offset);
  }
};

/// factor = finalize(sums over all tensors, added in tensor order from +0).
template <class Kernel, std::size_t K>
struct finalize_all {
  Kernel k;
  const double* sums;
  std::size_t count;
  GRADAPT_HD void operator()(double& f) const {
    double s[K];
    for (std::size_t j = 0; j < K; ++j) s[j] = 0.0;
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t j = 0; j < K; ++j) s[j] += sums[t * K + j];
    f = k.finalize(s, nullptr);
  }
};

template <class O>
double group_lr_scale(const O& o) {
  if constexpr (requires { o.lr_scale; })
    return static_cast<double>(o.lr_scale);
  else
    return 1.0;
}
template <class O>
std::optional<double> group_weight_decay(const O& o) {
  if constexpr (requires { o.weight_decay; })
    return std::optional<double>(o.weight_decay);
  else
    return std::nullopt;
}

template <class B, class T>
using buffer_t = std::remove_cvref_t<decltype(std::declval<const B&>().template allocate<T>(std::size_t{}))>;

/// A view of a whole backend buffer (const when the buffer is).
template <class Space, class Buf>
auto view_of(Buf& buf) {
  using T = std::remove_pointer_t<decltype(buf.data())>;
  return tensor_view<T, Space>::vector(buf.data(), static_cast<std::int64_t>(buf.size()));
}

}  // namespace detail::optim

/// The state of a `chain<Stages...>` for one backend and element types: per-element buffers
/// (Adam's m and v, a momentum trace) in the backend's memory, the step count, and the small
/// per-tensor arrays the passes use. Created by `chain::init`, advanced by `chain::step`.
///
/// @tparam Chain the chain type (its plan fixes the buffers)
/// @tparam B     the backend (gradapt::host, gradapt::cuda)
/// @tparam V,G   parameter and gradient element types
/// @tparam S     state element type (the compute type of V by default)
///
/// `save` writes a self-describing byte string (a header with the element type, stages,
/// active stages, tensor sizes and step count, then the raw buffers); `load` checks the
/// header against this state and restores it bit for bit, so training continues exactly as
/// it would have.
template <class Chain, class B, class V, class G, class S>
class chain_state {
 public:
  using backend_type = B;             ///< the backend the buffers live on
  using space = typename B::space;    ///< memory space of the views (host_space, device_space)
  using value_type = V;               ///< parameter element type
  using grad_type = G;                ///< gradient element type
  using state_element = S;            ///< element type of the state buffers
  using plan = typename Chain::plan;  ///< the chain's compile-time stage layout

  chain_state() = default;
  /// Move-only: the per-tensor views point into the state's own buffers. Duplicate a state
  /// through `save` and `load`.
  chain_state(chain_state&&) noexcept = default;
  /// Move assignment: takes over the other state's buffers (the views stay valid, the memory
  /// does not move).
  chain_state& operator=(chain_state&&) noexcept = default;
  chain_state(const chain_state&) = delete;
  chain_state& operator=(const chain_state&) = delete;

  /// Steps taken (optax's count).
  std::uint64_t steps() const { return steps_; }
  /// Parameters the state was created for.
  std::size_t tensors() const { return sizes_.size(); }
  /// Bit i set when stage i of the chain is active in this state.
  std::uint64_t active_stages() const { return enabled_; }
  /// Number of per-element state buffers over all stages (inactive stages' are empty).
  static constexpr std::size_t buffer_count() { return plan::total_buffers; }
  /// Elements of all per-element state buffers (what a checkpoint holds besides its header).
  std::size_t state_elements() const {
    std::size_t n = 0;
    for (const auto& b : bufs_) n += b.size();
    return n;
  }
  /// Bytes of the step's workspace in the backend's memory (per-tensor constants, barrier
  /// factors and sums; for a factored chain the per-slot factors and sums, one slot per
  /// thread of the host's task mode), allocated at init and reused by every step. Not part
  /// of a checkpoint. The backend object's own scratch (gradapt::cuda's grow-only workspace,
  /// which init sizes too) is not counted.
  std::size_t workspace_bytes() const {
    return (tconst_.size() + factors_.size() + sums_.size() + wdbl_.size() + wsum_.size() + wfac_.size()) *
               sizeof(double) +
           wbuf_.size() * sizeof(S);
  }
  /// True when tensor t's factored stage (a chain whose first stage is
  /// scale_by_factored_rms or scale_by_sm3) keeps row and column statistics rather than a
  /// full-size buffer; false for every tensor of other chains.
  bool factored(std::size_t t) const {
    detail::require(t < sizes_.size(), "chain_state::factored: tensor ", t, " out of range (", sizes_.size(),
                    " tensors)");
    return !ft_.empty() && ft_[t].factored;
  }
  /// Per-tensor views of state buffer j (stage buffers in stage order: for AdamW 0 = m,
  /// 1 = v). Empty when the owning stage is inactive. A factored stage's buffer holds, for a
  /// factored tensor, what the stage keeps instead of one element per parameter (Adafactor:
  /// the row then column statistics; SM3: one cover per dimension, in dimension order).
  std::span<const tensor_view<S, space>> buffer(std::size_t j) const {
    detail::require(j < plan::total_buffers, "chain_state::buffer: index ", j, " out of range (",
                    plan::total_buffers, " buffer(s))");
    return mut_[j];
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.optimizer";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// Writes the state into the open section of `w`: the element type, stage count, buffer
  /// count, active-stage mask, step count and tensor count; per tensor its name, shape and
  /// (factored chains) factored layout under "tensor/<name>"; and every active buffer j as
  /// one tensor field per parameter, "buffer<j>/<name>", shaped like the parameter (a
  /// factored tensor's statistics as a vector). Each tensor is copied to host memory through
  /// one reused buffer.
  void save(const B& b, archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<S>));
    w.put("stages", static_cast<std::uint64_t>(plan::n));
    w.put("buffers", static_cast<std::uint64_t>(plan::total_buffers));
    w.put("active_stages", enabled_);
    w.put("steps", steps_);
    w.put("tensors", static_cast<std::uint64_t>(sizes_.size()));
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      w.begin(detail::archive_impl::join("tensor", "/", names_[t]));
      w.put("index", static_cast<std::uint64_t>(t));
      w.put_tensor<std::int64_t>("shape", shapes_[t]);
      if (!ft_.empty()) w.put_tensor<std::int64_t>("factored_layout", layout_of(t));
      w.end();
    }
    std::vector<S> host;
    for (std::size_t j = 0; j < plan::total_buffers; ++j) {
      if (mut_[j].empty()) continue;
      w.begin(detail::archive_impl::join("buffer", "", std::to_string(j)));
      for (std::size_t t = 0; t < sizes_.size(); ++t) {
        const auto& v = mut_[j][t];
        host.resize(v.size());
        b.copy(tensor_view<const S, space>(v), host_view(host));
        w.put_tensor<S>(names_[t], host, buffer_shape(j, t));
      }
      w.end();
    }
  }

  /// Reads what `save(b, w)` wrote into this state, created by the same optimizer type and
  /// options for parameters with the same names, shapes and factoring. All or nothing: every
  /// field is checked (names, shapes, element type, layout, finite values, a step count that
  /// can still grow) before the first buffer is written.
  /// @throws gradapt::error naming the first field that does not match
  void load(const B& b, archive_reader& r) {
    const auto expect = [&](const char* field, std::uint64_t want, const char* what) {
      const auto got = r.get<std::uint64_t>(field);
      detail::require(
          got == want, "optimizer state load: the checkpoint's ", what, " is ", got, " but this state's is ",
          want, " (restore into a state created by the same optimizer and options for the same parameters)");
    };
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<S>), "optimizer state load: the checkpoint holds ", et,
                    " state but this state is ", name(dtype_of_v<S>));
    expect("stages", plan::n, "stage count");
    expect("buffers", plan::total_buffers, "buffer count");
    expect("active_stages", enabled_, "active-stage mask");
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), "optimizer state load: step count ",
                    steps, " cannot grow");
    expect("tensors", sizes_.size(), "tensor count");
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      const std::string sec = detail::archive_impl::join("tensor", "/", names_[t]);
      detail::require(r.has(detail::archive_impl::join(sec, "/", "index")),
                      "optimizer state load: the checkpoint has no parameter '", names_[t],
                      "' (restore for the same parameter names)");
      r.begin(sec);
      const auto index = r.get<std::uint64_t>("index");
      detail::require(index == t, "optimizer state load: parameter '", names_[t], "' is tensor ", index,
                      " in the checkpoint but ", t, " here (restore for the same parameter order)");
      const auto shape = r.get_tensor<std::int64_t>("shape");
      detail::require(std::ranges::equal(shape, shapes_[t]), "optimizer state load: parameter '", names_[t],
                      "' has another shape in the checkpoint (", shape.size(), "-d, ", product(shape),
                      " elements) than here (", shapes_[t].size(), "-d, ", sizes_[t], " elements)");
      if (!ft_.empty()) {
        const auto got = r.get_tensor<std::int64_t>("factored_layout");
        const auto want = layout_of(t);
        detail::require(std::ranges::equal(got, want), "optimizer state load: parameter '", names_[t],
                        "'s factored layout differs (same shapes and factoring options: factored, "
                        "min_dim_size_to_factor, axes)");
      }
      r.end();
    }
    // Pass 1: check every buffer tensor (type, shape, finite values) without changing anything.
    std::vector<S> host;
    for_each_buffer(r, host, [&](std::size_t j, std::size_t t) {
      for (const S& x : host)
        detail::require(std::isfinite(static_cast<double>(static_cast<compute_t<S>>(x))),
                        "optimizer state load: buffer ", j, " of '", names_[t],
                        "' holds a non-finite value (", static_cast<double>(static_cast<compute_t<S>>(x)),
                        "); a checkpoint of a diverged run cannot be resumed");
    });
    r.finish_section();
    // Pass 2: copy into the backend's memory.
    for_each_buffer(r, host, [&](std::size_t j, std::size_t t) {
      b.copy(tensor_view<const S, host_space>(host_view(host)), mut_[j][t]);
    });
    b.synchronize();
    steps_ = steps;
  }

  /// The state as one archive of kind "gradapt.optimizer" (core/archive.hpp).
  std::vector<std::byte> save(const B& b) const { return save_archive(*this, b); }
  /// Restores a state written by `save(b)` (all or nothing; see `load(b, reader)`).
  /// @throws gradapt::error for a damaged archive or one that does not fit this state
  void load(const B& b, std::span<const std::byte> bytes) { load_archive(*this, b, bytes); }

 private:
  template <class...>
  friend class chain;

  static std::uint64_t product(const std::vector<std::int64_t>& s) {
    std::uint64_t n = 1;
    for (const auto e : s) n *= static_cast<std::uint64_t>(e);
    return n;
  }
  /// A factored tensor's layout as stored: factored flag, the [A, X, B, Y, C] view, state size.
  std::vector<std::int64_t> layout_of(std::size_t t) const {
    const auto& f = ft_[t];
    return {f.factored ? 1 : 0, f.d[0], f.d[1], f.d[2], f.d[3], f.d[4], static_cast<std::int64_t>(f.state)};
  }
  /// The stored shape of buffer j's tensor t: the parameter's, or a vector for a factored stage.
  std::vector<std::int64_t> buffer_shape(std::size_t j, std::size_t t) const {
    if (mut_[j][t].size() == sizes_[t]) return shapes_[t];
    return {static_cast<std::int64_t>(mut_[j][t].size())};
  }
  // Reads every active buffer tensor into `host` in turn and calls f(j, t).
  template <class F>
  void for_each_buffer(archive_reader& r, std::vector<S>& host, F&& f) {
    for (std::size_t j = 0; j < plan::total_buffers; ++j) {
      if (mut_[j].empty()) continue;
      r.begin(detail::archive_impl::join("buffer", "", std::to_string(j)));
      for (std::size_t t = 0; t < sizes_.size(); ++t) {
        detail::require(r.has(names_[t]), "optimizer state load: the checkpoint has no buffer ", j, " for '",
                        names_[t], "'");
        host.resize(mut_[j][t].size());
        r.get_tensor<S>(names_[t], std::span<S>(host), buffer_shape(j, t));
        f(j, t);
      }
      r.end();
    }
  }

  std::uint64_t steps_ = 0;
  std::uint64_t enabled_ = 0;
  std::vector<std::size_t> sizes_;
  std::vector<std::string> names_;                 ///< parameter names (checkpoint keys)
  std::vector<std::vector<std::int64_t>> shapes_;  ///< parameter shapes
  std::vector<detail::optim::buffer_t<B, S>> bufs_;
  std::vector<std::vector<tensor_view<S, space>>> mut_;
  std::vector<std::vector<tensor_view<const S, space>>> const_;
  std::vector<tensor_view<const V, space>> p_const_;
  std::vector<tensor_view<const G, space>> g_const_;
  detail::optim::buffer_t<B, double> tconst_, factors_, sums_;
  std::vector<double> tconst_host_;
  std::vector<std::vector<tensor_view<double, space>>> factor_views_;  ///< per enabled barrier
  std::vector<double> group_lr_;
  std::vector<std::optional<double>> group_wd_;
  // Chains with a factored stage (run tensor by tensor):
  std::vector<factored_tensor> ft_;     ///< the stage's decision per tensor
  std::vector<std::size_t> order_;      ///< tensors largest first (task order)
  std::size_t total_ = 0;               ///< parameters in the list
  std::size_t slots_ = 1;               ///< workspace slots (threads of the host's task mode)
  std::size_t ws_ = 0, wsd_ = 0;        ///< per-slot workspace sizes (S, double)
  detail::optim::buffer_t<B, S> wbuf_;  ///< factors
  detail::optim::buffer_t<B, double> wdbl_, wsum_, wfac_;  ///< sums; barrier sums, factors
  std::vector<tensor_view<double, space>> wfac_views_;     ///< [slot][barrier]
};

/// An optimizer assembled from gradient transformations (see optim/transforms.hpp and the
/// file comment for how passes are formed), e.g. AdamW:
///
///     gradapt::chain opt{gradapt::transform::scale_by_adam{},
///                        gradapt::transform::add_decayed_weights{.weight_decay = 1e-4},
///                        gradapt::transform::scale_by_learning_rate{.lr = 1e-3}};
///     auto state = opt.init(backend, params);
///     opt.step(backend, params, state, {.lr = schedule(step)});
///
/// Stages are validated when the chain is built (gradapt::error naming the option). The chain
/// is a value: copy it, or change a stage's options through `stage<I>()` between steps (a
/// change that switches an optional stage on or off needs a new state).
template <class... Stages>
class chain {
 public:
  /// Compile-time layout of the stages: state-buffer and per-tensor-slot offsets, barriers,
  /// which stages are optional.
  using plan = detail::optim::plan<Stages...>;
  /// The state type for backend B, parameters V, gradients G and state elements S.
  template <class B, element V, element G = V, element S = compute_t<V>>
  using state_type = chain_state<chain, B, V, G, S>;

  /// Every stage with its default options.
  /// @throws gradapt::error if a stage's defaults fail its `validate()` (a user-written stage)
  chain() { validate(); }
  /// The stages in order, with their options.
  /// @throws gradapt::error naming the first invalid option (each stage's `validate()`)
  explicit chain(Stages... stages) : stages_(std::move(stages)...) { validate(); }

  /// Stage I (options readable and writable between steps).
  template <std::size_t I>
  auto& stage() {
    return std::get<I>(stages_);
  }
  /// Stage I, read-only.
  template <std::size_t I>
  const auto& stage() const {
    return std::get<I>(stages_);
  }

  /// Creates the state for `params` on backend `b`: zero-initialised buffers of element type
  /// S (default: the compute type of the parameters) for every active stage.
  /// @throws gradapt::error on invalid options
  template <class S = void, optimizer_backend B, element V, element G, class Options>
  auto init(const B& b, const param_list<V, G, typename B::space, Options>& params) const {
    using St = std::conditional_t<std::is_void_v<S>, compute_t<V>, S>;
    static_assert(std::is_same_v<compute_t<V>, compute_t<G>> && std::is_same_v<compute_t<V>, compute_t<St>>,
                  "gradapt::chain: parameters, gradients and state must share one compute type (float for "
                  "float/half/bfloat16, double for double)");
    static_assert(!plan::has_factored || std::is_same_v<St, compute_t<V>>,
                  "gradapt::chain: a chain with a factored stage keeps its state (and the factors of its "
                  "workspace) in the parameters' compute type: leave S at its default");
    static_assert(!plan::has_factored || factored_backend<B>,
                  "gradapt::chain: a chain with a factored stage (scale_by_factored_rms, scale_by_sm3) needs "
                  "a backend with row/column operations (gradapt::factored_backend: reduce_factored, "
                  "apply_factored, apply_factored_sum), such as gradapt::host or gradapt::cuda");
    validate();
    using space = typename B::space;
    chain_state<chain, B, V, G, St> st;
    const std::size_t count = params.size();
    st.enabled_ = current_mask();
    st.sizes_.resize(count);
    for (std::size_t t = 0; t < count; ++t) {
      st.names_.push_back(params.entries()[t].name);
      const auto sh = params.values()[t].shape();
      st.shapes_.emplace_back(sh.begin(), sh.end());
    }
    std::size_t total = 0;
    for (std::size_t t = 0; t < count; ++t) total += (st.sizes_[t] = params.values()[t].size());
    if constexpr (plan::has_factored) {
      st.ft_.resize(count);
      for (std::size_t t = 0; t < count; ++t) {
        st.ft_[t] = std::get<0>(stages_).plan_tensor(params.values()[t].shape());
        if (st.sizes_[t] == 0) st.ft_[t] = factored_tensor{};
        if (!st.ft_[t].factored) st.ft_[t].state = st.sizes_[t];
      }
    }
    // Elements of stage i's buffers for tensor t: one per parameter, except a factored stage's.
    const auto buffer_elements = [&](std::size_t i, std::size_t t) {
      return plan::info[i].factored ? st.ft_[t].state : st.sizes_[t];
    };
    st.mut_.resize(plan::total_buffers);
    st.const_.resize(plan::total_buffers);
    for (std::size_t i = 0; i < plan::n; ++i) {
      for (std::size_t j = 0; j < plan::info[i].buffers; ++j) {
        const std::size_t k = plan::buffer_offset(i) + j;
        const bool on = plan::on(i, st.enabled_);
        std::size_t elems = 0;
        for (std::size_t t = 0; t < count; ++t) elems += buffer_elements(i, t);
        st.bufs_.push_back(b.template allocate<St>(on ? elems : 0));
        if (!on) continue;
        St* base = st.bufs_.back().data();
        std::size_t off = 0;
        for (std::size_t t = 0; t < count; ++t) {
          const std::size_t n = buffer_elements(i, t);
          const auto v = tensor_view<St, space>::vector(base + off, static_cast<std::int64_t>(n));
          st.mut_[k].push_back(v);
          st.const_[k].push_back(v);
          off += n;
        }
      }
    }
    st.p_const_.resize(count);
    st.g_const_.resize(count);
    st.tconst_host_.assign(count * plan::total_slots, 0.0);
    st.tconst_ = b.template allocate<double>(count * plan::total_slots);
    const std::size_t nb = plan::barriers(st.enabled_);
    st.factors_ = b.template allocate<double>(nb * count);
    st.sums_ = b.template allocate<double>(count * plan::max_terms);
    st.factor_views_.resize(nb);
    for (std::size_t i = 0; i < plan::n; ++i) {
      if (!plan::on(i, st.enabled_) || !plan::info[i].barrier) continue;
      const std::size_t bn = plan::barrier_number(i, st.enabled_);
      double* base = st.factors_.data() + bn * count;
      const std::size_t views = plan::info[i].global ? (count > 0 ? 1 : 0) : count;
      for (std::size_t t = 0; t < views; ++t)
        st.factor_views_[bn].push_back(tensor_view<double, space>::vector(base + t, 1));
    }
    if constexpr (plan::has_factored) {
      st.total_ = total;
      st.order_ = detail::optim::largest_first(st.sizes_);
      st.slots_ = detail::optim::task_slots(b);
      for (const auto& f : st.ft_) {
        st.ws_ = std::max(st.ws_, f.ws);
        st.wsd_ = std::max(st.wsd_, f.ws_sums);
      }
      st.wbuf_ = b.template allocate<St>(st.ws_ * st.slots_);
      st.wdbl_ = b.template allocate<double>(st.wsd_ * st.slots_);
      st.wsum_ = b.template allocate<double>(st.slots_ * sum_stride);
      st.wfac_ = b.template allocate<double>(st.slots_ * nb);
      for (std::size_t k = 0; k < st.slots_ * nb; ++k)
        st.wfac_views_.push_back(tensor_view<double, space>::vector(st.wfac_.data() + k, 1));
    }
    {  // a grow-only device workspace is sized now (the first step may be captured into a graph)
      std::vector<tensor_view<const V, space>> values(count);
      std::size_t lines = 0;
      for (std::size_t t = 0; t < count; ++t) values[t] = params[t].value;
      if constexpr (plan::has_factored)
        for (const auto& f : st.ft_)
          if (f.factored) lines = std::max(lines, static_cast<std::size_t>(f.d[0] * f.d[1] * f.d[2]) + 1);
      detail::optim::reserve_workspace(b, values, plan::max_terms, lines);
    }
    refresh_constants(b, params, st, true);
    return st;
  }

  /// One optimizer step: reads the gradients, advances the state and updates the parameters
  /// in place, in `plan::passes` passes over memory (see the file comment).
  /// @throws gradapt::error when `params` does not match the state (tensor count or sizes),
  ///         the state's active stages differ from the options now, or the learning rate is
  ///         not finite
  template <optimizer_backend B, element V, element G, class Options, class S>
  void step(const B& b, const param_list<V, G, typename B::space, Options>& params,
            chain_state<chain, B, V, G, S>& st, const step_args& args = {}) const {
    const std::size_t count = params.size();
    detail::require(count == st.sizes_.size(), "chain::step: the parameter list holds ", count,
                    " tensors but the state was created for ", st.sizes_.size(),
                    " (create the state with init() for this list)");
    for (std::size_t t = 0; t < count; ++t) {
      const auto& e = params[t];
      detail::require(e.value.size() == st.sizes_[t], "chain::step: parameter '", e.name, "' (tensor ", t,
                      ") has ", e.value.size(), " elements but the state holds ", st.sizes_[t]);
      st.p_const_[t] = e.value;
      st.g_const_[t] = e.grad;
    }
    if constexpr (plan::has_factored)
      for (std::size_t t = 0; t < count; ++t) {
        if (st.sizes_[t] == 0) continue;
        const factored_tensor now = std::get<0>(stages_).plan_tensor(params[t].value.shape());
        const factored_tensor& was = st.ft_[t];
        if (now.factored != was.factored || now.d != was.d || (now.factored && now.state != was.state))
          detail::fail("chain::step: parameter '", params[t].name, "' (tensor ", t,
                       "): the factored stage's options now give it another layout than at init (",
                       was.factored ? "factored" : "not factored", " then, ",
                       now.factored ? "factored" : "not factored",
                       " now; factored, min_dim_size_to_factor and axes fix the state's layout: create a new "
                       "state with init())");
      }
    const std::uint64_t mask = current_mask();
    if (mask != st.enabled_)  // (the message is built only on failure: a step allocates nothing)
      detail::fail("chain::step: the options switch stages ", describe_mask(mask),
                   " but the state was created with ", describe_mask(st.enabled_),
                   " (a stage's state cannot appear or vanish mid-run: create a new state with init())");
    refresh_constants(b, params, st, false);
    const step_context ctx{st.steps_ + 1, args.lr};
    using C = compute_t<V>;
    const auto kernels = make_kernels<C>(ctx, std::index_sequence_for<Stages...>{});
    if (count > 0) {
      dispatch(mask, [&]<std::uint64_t E>() {
        if constexpr (plan::has_factored)
          run_by_tensor<E>(b, params, st, kernels);
        else
          run_passes<E>(b, params, st, kernels, std::make_index_sequence<plan::passes(E)>{});
      });
    }
    ++st.steps_;
  }

 private:
  std::tuple<Stages...> stages_;

  /// Doubles per workspace slot for barrier sums: one barrier's terms, then Σp² measured in
  /// a factored stage's statistics pass.
  static constexpr std::size_t sum_stride = (plan::max_terms > 0 ? plan::max_terms : 1) + 1;

  void validate() const {
    std::apply([](const auto&... s) { (s.validate(), ...); }, stages_);
  }

  std::uint64_t current_mask() const {
    std::uint64_t m = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using S = std::tuple_element_t<I, std::tuple<Stages...>>;
            bool on = true;
            if constexpr (S::optional) on = std::get<I>(stages_).enabled();
            if (on) m |= std::uint64_t{1} << I;
          }(),
          ...);
    }
    (std::index_sequence_for<Stages...>{});
    return m;
  }

  static std::string describe_mask(std::uint64_t m) {
    std::string s = "{";
    bool first = true;
    for (std::size_t i = 0; i < plan::n; ++i)
      if (plan::info[i].optional) {
        s += first ? "" : ", ";
        s += "stage " + std::to_string(i) + (((m >> i) & 1u) ? " on" : " off");
        first = false;
      }
    return s + "}";
  }

  template <class F, std::size_t... J>
  static void dispatch_impl(std::uint64_t mask, F&& f, std::index_sequence<J...>) {
    const bool done =
        ((mask == plan::mask_of(J) ? (f.template operator()<plan::mask_of(J)>(), true) : false) || ...);
    if (!done) detail::fail("chain::step: internal error: no compiled form for stage mask ", mask);
  }
  template <class F>
  static void dispatch(std::uint64_t mask, F&& f) {
    dispatch_impl(mask, f, std::make_index_sequence<std::size_t{1} << plan::optional_count>{});
  }

  template <class C, std::size_t... I>
  auto make_kernels(const step_context& ctx, std::index_sequence<I...>) const {
    detail::optim::kpack<typename Stages::template kernel<C>...> k;
    ((detail::optim::kget<I>(k) = std::get<I>(stages_).template prepare<C>(ctx)), ...);
    return k;
  }

  /// Recomputes the per-tensor constants when a group's options changed (always at init) and
  /// copies them where the backend reads them.
  template <class B, class PL, class St>
  void refresh_constants(const B& b, const PL& params, St& st, bool force) const {
    const std::size_t ng = params.group_count();
    bool changed = force || st.group_lr_.size() != ng;
    if (!changed)
      for (std::size_t g = 0; g < ng && !changed; ++g) {
        const auto& o = params.group(g).options;
        changed = detail::optim::group_lr_scale(o) != st.group_lr_[g] ||
                  detail::optim::group_weight_decay(o) != st.group_wd_[g];
      }
    if (!changed) return;
    st.group_lr_.resize(ng);
    st.group_wd_.resize(ng);
    for (std::size_t g = 0; g < ng; ++g) {
      st.group_lr_[g] = detail::optim::group_lr_scale(params.group(g).options);
      st.group_wd_[g] = detail::optim::group_weight_decay(params.group(g).options);
    }
    for (std::size_t t = 0; t < params.size(); ++t) {
      const auto& e = params[t];
      const tensor_setup ts{e.name, t, e.value.size(), e.flags, st.group_lr_[e.group], st.group_wd_[e.group]};
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (std::get<I>(stages_).tensor_constants(
             ts, st.tconst_host_.data() + t * plan::total_slots + plan::slot_offset(I)),
         ...);
      }
      (std::index_sequence_for<Stages...>{});
    }
    if (!st.tconst_host_.empty())
      b.copy(tensor_view<const double, host_space>(host_view(st.tconst_host_)),
             detail::optim::view_of<typename B::space>(st.tconst_));
  }

  /// The backend list for argument descriptor D of a pass.
  template <detail::optim::arg_desc D, class PL, class St>
  static decltype(auto) list(const PL& params, St& st) {
    using detail::optim::arg_kind;
    if constexpr (D.kind == arg_kind::param_mut)
      return params.values();
    else if constexpr (D.kind == arg_kind::param_const)
      return std::span<const typename decltype(st.p_const_)::value_type>(st.p_const_);
    else if constexpr (D.kind == arg_kind::grad)
      return std::span<const typename decltype(st.g_const_)::value_type>(st.g_const_);
    else if constexpr (D.kind == arg_kind::buffer_mut)
      return std::span<const typename std::remove_cvref_t<decltype(st.mut_[0])>::value_type>(
          st.mut_[D.index]);
    else
      return std::span<const typename std::remove_cvref_t<decltype(st.const_[0])>::value_type>(
          st.const_[D.index]);
  }

  template <std::uint64_t E, class B, class PL, class St, class K, std::size_t... P>
  void run_passes(const B& b, const PL& params, St& st, const K& kernels, std::index_sequence<P...>) const {
    (run_pass<P, E>(b, params, st, kernels), ...);
  }

  template <std::size_t Pass, std::uint64_t E, class B, class PL, class St, class K>
  void run_pass(const B& b, const PL& params, St& st, const K& kernels) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    const std::size_t count = params.size();
    const detail::optim::pass_functor<plan, Pass, E, C, K> f{kernels, st.tconst_.data(), st.factors_.data(),
                                                             count};
    constexpr std::size_t nargs = plan::args(Pass, E);
    if constexpr (plan::is_final(Pass, E)) {
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        b.apply_list(f, list<plan::arg_at(Pass, E, A)>(params, st)...);
      }
      (std::make_index_sequence<nargs>{});
    } else {
      constexpr std::size_t h = plan::hi(Pass, E);
      constexpr std::size_t terms = plan::info[h].terms;
      constexpr std::size_t bn = plan::barrier_number(h, E);
      const auto sums =
          tensor_view<double, space>::vector(st.sums_.data(), static_cast<std::int64_t>(count * terms));
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        b.apply_reduce_list(f, detail::optim::per_tensor_arg(sums),
                            list<plan::arg_at(Pass, E, A)>(params, st)...);
      }
      (std::make_index_sequence<nargs>{});
      const auto& k = detail::optim::kget<h>(kernels);
      using Kernel = std::remove_cvref_t<decltype(k)>;
      if constexpr (plan::info[h].global) {
        b.apply(detail::optim::finalize_all<Kernel, terms>{k, st.sums_.data(), count},
                st.factor_views_[bn][0]);
      } else {
        b.apply_list(detail::optim::finalize_each<Kernel>{k, st.sums_.data(), st.tconst_.data(), terms,
                                                          plan::total_slots, plan::slot_offset(h)},
                     st.factor_views_[bn]);
      }
    }
  }

  // ---- chains whose first stage is factored: tensor by tensor -------------------------------
  //
  // Each tensor runs all passes back to back (a tensor of a few MiB stays in the last-level
  // cache between them), on the host as the factored optimizers schedule it (for_tensors):
  // large tensors on all threads, the others as one-thread tasks with a workspace slot each.
  //  - factored tensor: the stage's `advance` reads g and leaves its row and column factors in
  //    the slot's workspace; every pass then runs through `apply_factored` (factored_pass),
  //    a barrier's sum through `apply_factored_sum`;
  //  - other tensors: the chain's own passes over a one-tensor list (the stage is element-wise).
  // Barrier factors and sums live in the slot's workspace (on CUDA in device memory), so a
  // step never waits for the host.

  template <std::uint64_t E, class B, class PL, class St, class K>
  void run_by_tensor(const B& b, const PL& params, St& st, const K& kernels) const {
    using space = typename B::space;
    using G = typename PL::grad_type;
    using V = typename PL::value_type;
    // Σp² for the parameter scale rides in the statistics pass (see param_squares_pass).
    constexpr bool fused_param_squares =
        plan::param_squares_pass(E) < plan::passes(E) && factored_sumsq_backend<B>;
    // A stage with maxima for statistics, and nothing after it that needs a second pass: its
    // statistics are gathered during the update itself (apply_factored_max, one-thread tasks).
    constexpr bool fused_maxima =
        plan::info_at(0).max_statistics && plan::passes(E) == 1 && factored_max_backend<B>;
    const auto one = [&](const B& bb, std::size_t k, std::size_t slot) {
      if (st.sizes_[k] == 0) return;
      const auto& f = st.ft_[k];
      auto* ws = st.wbuf_.data() + slot * st.ws_;
      double* sums = st.wdbl_.data() + slot * st.wsd_;
      const auto& stage = std::get<0>(stages_);
      const auto& k0 = detail::optim::kget<0>(kernels);
      const auto g = tensor_view<const G, space>(st.g_const_[k]);
      if constexpr (fused_maxima) {
        if (f.factored && bb.thread_count() == 1) {
          stage.factors(bb, f, st.mut_[0][k], ws);
          if (f.variant)
            max_tensor_pass<E, true>(bb, params, st, kernels, k, slot);
          else
            max_tensor_pass<E, false>(bb, params, st, kernels, k, slot);
          stage.commit(bb, f, st.mut_[0][k], ws, sums, stage.row_maxima(f, ws), stage.column_maxima(f, ws));
          return;
        }
      }
      if (f.factored) {
        if constexpr (fused_param_squares)
          stage.advance(bb, k0, f, st.mut_[0][k], g, ws, sums, tensor_view<const V, space>(st.p_const_[k]),
                        st.wsum_.data() + slot * sum_stride + sum_stride - 1);
        else
          stage.advance(bb, k0, f, st.mut_[0][k], g, ws, sums);
      }
      [&]<std::size_t... P>(std::index_sequence<P...>) {
        (tensor_pass<P, E>(bb, params, st, kernels, k, slot), ...);
      }
      (std::make_index_sequence<plan::passes(E)>{});
    };
    detail::optim::for_tensors(b, std::span<const std::size_t>(st.order_),
                               std::span<const std::size_t>(st.sizes_), st.total_, st.slots_, one);
  }

  /// The view of tensor k for argument descriptor D of a pass.
  template <detail::optim::arg_desc D, class PL, class St>
  static auto one_view(const PL& params, St& st, std::size_t k) {
    return list<D>(params, st)[k];
  }

  /// One pass over factored tensor k through `apply_factored` (`Variant`: its
  /// factored_tensor::variant); a non-final pass leaves its barrier's sum in `sum[0]`.
  template <std::size_t Pass, std::uint64_t E, bool Variant, class B, class PL, class St, class K>
  void factored_tensor_pass(const B& b, const PL& params, St& st, const K& kernels, std::size_t k,
                            std::size_t slot, double* sum) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    constexpr std::size_t nb = plan::barriers(E);
    constexpr std::size_t nargs = plan::args(Pass, E);
    constexpr bool final = plan::is_final(Pass, E);
    const double* tc = st.tconst_.data() + k * plan::total_slots;
    double* factors = st.wfac_.data() + slot * nb;
    const auto& f = st.ft_[k];
    using FP = detail::optim::factored_pass<plan, Pass, E, C, K, Variant>;
    const FP fp{{kernels, tc, factors, 1}};
    constexpr bool stage_on = FP::stage_on;
    constexpr std::size_t va = FP::va;
    const auto* w = st.wbuf_.data() + slot * st.ws_;
    const auto fy =
        tensor_view<const typename St::state_element, space>::vector(w, static_cast<std::int64_t>(f.rows));
    const auto fx = tensor_view<const typename St::state_element, space>::vector(
        w + f.rows, static_cast<std::int64_t>(f.cols));
    // The pass's arguments without the factored stage's buffer.
    [&]<std::size_t... A>(std::index_sequence<A...>) {
      constexpr auto full = [](std::size_t a) { return (stage_on && a >= va) ? a + 1 : a; };
      if constexpr (final)
        b.apply_factored(fp, f.d, fy, fx, one_view<plan::arg_at(Pass, E, full(A))>(params, st, k)...);
      else
        b.apply_factored_sum(fp, f.d, fy, fx, tensor_view<double, space>::vector(sum, 1),
                             one_view<plan::arg_at(Pass, E, full(A))>(params, st, k)...);
    }
    (std::make_index_sequence<nargs - (stage_on ? 1 : 0)>{});
  }

  /// The one pass of factored tensor k through `apply_factored_max`: the chain's update and
  /// the stage's maxima (into the stage's `row_maxima` / `column_maxima` workspace) together.
  template <std::uint64_t E, bool Variant, class B, class PL, class St, class K>
  void max_tensor_pass(const B& b, const PL& params, St& st, const K& kernels, std::size_t k,
                       std::size_t slot) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    using S = typename St::state_element;
    constexpr std::size_t nargs = plan::args(0, E);
    const double* tc = st.tconst_.data() + k * plan::total_slots;
    const auto& f = st.ft_[k];
    using FP = detail::optim::factored_pass<plan, 0, E, C, K, Variant>;
    const detail::optim::max_pass<FP> mp{FP{{kernels, tc, nullptr, 1}}};
    constexpr std::size_t va = FP::va;
    auto* w = st.wbuf_.data() + slot * st.ws_;
    const auto& stage = std::get<0>(stages_);
    const auto fy = tensor_view<const S, space>::vector(w, static_cast<std::int64_t>(f.rows));
    const auto fx = tensor_view<const S, space>::vector(w + f.rows, static_cast<std::int64_t>(f.cols));
    const auto my = tensor_view<S, space>::vector(stage.row_maxima(f, w), static_cast<std::int64_t>(f.rows));
    const auto mx =
        tensor_view<S, space>::vector(stage.column_maxima(f, w), static_cast<std::int64_t>(f.cols));
    [&]<std::size_t... A>(std::index_sequence<A...>) {
      constexpr auto full = [](std::size_t a) { return a >= va ? a + 1 : a; };
      b.apply_factored_max(mp, f.d, fy, fx, my, mx, one_view<plan::arg_at(0, E, full(A))>(params, st, k)...);
    }
    (std::make_index_sequence<nargs - 1>{});
  }

  template <std::size_t Pass, std::uint64_t E, class B, class PL, class St, class K>
  void tensor_pass(const B& b, const PL& params, St& st, const K& kernels, std::size_t k,
                   std::size_t slot) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    constexpr std::size_t nb = plan::barriers(E);
    constexpr std::size_t nargs = plan::args(Pass, E);
    constexpr bool final = plan::is_final(Pass, E);
    const double* tc = st.tconst_.data() + k * plan::total_slots;
    double* factors = st.wfac_.data() + slot * nb;
    double* sum = st.wsum_.data() + slot * sum_stride;
    const auto& f = st.ft_[k];
    constexpr bool premeasured = Pass == plan::param_squares_pass(E) && factored_sumsq_backend<B>;
    if (premeasured && f.factored) {
      sum += sum_stride - 1;  // Σp², measured in the statistics pass
    } else if (f.factored) {
      if (f.variant)
        factored_tensor_pass<Pass, E, true>(b, params, st, kernels, k, slot, sum);
      else
        factored_tensor_pass<Pass, E, false>(b, params, st, kernels, k, slot, sum);
    } else {
      const detail::optim::pass_functor<plan, Pass, E, C, K> pf{kernels, tc, factors, 1};
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        if constexpr (final)
          b.apply_list(pf, list<plan::arg_at(Pass, E, A)>(params, st).subspan(k, 1)...);
        else
          b.apply_reduce_list(pf,
                              detail::optim::per_tensor_arg(tensor_view<double, space>::vector(
                                  sum, static_cast<std::int64_t>(plan::info[plan::hi(Pass, E)].terms))),
                              list<plan::arg_at(Pass, E, A)>(params, st).subspan(k, 1)...);
      }
      (std::make_index_sequence<nargs>{});
    }
    if constexpr (!final) {
      constexpr std::size_t h = plan::hi(Pass, E);
      constexpr std::size_t bn = plan::barrier_number(h, E);
      const auto& kh = detail::optim::kget<h>(kernels);
      using Kernel = std::remove_cvref_t<decltype(kh)>;
      b.apply_list(detail::optim::finalize_each<Kernel>{kh, sum, tc, plan::info[h].terms, plan::total_slots,
                                                        plan::slot_offset(h)},
                   std::span<const tensor_view<double, space>>(st.wfac_views_.data() + slot * nb + bn, 1));
    }
  }
};

}  // namespace gradapt

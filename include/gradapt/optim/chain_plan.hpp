#pragma once
/// @file
/// The compile-time pass plan of a `gradapt::chain` and the element functors its passes run
/// (part of optim/chain.hpp): which stages a pass replays, advances or measures, the backend
/// argument lists, the kernels' aggregate that travels into device code, and the wrappers
/// that run a pass over a factored tensor (`factored_pass`, `max_pass`).

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
#include "gradapt/backend/value_pack.hpp"
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

namespace detail::optim {

/// The traits of stage S (optim/stage.hpp): S's `traits` value when it declares one (else
/// every default), with each trait S declares as a member of its own taking precedence.
template <class S>
constexpr stage_spec spec_of() {
  stage_spec t{};
  if constexpr (requires { S::traits; }) t = S::traits;
  if constexpr (requires { S::buffers; }) t.buffers = static_cast<std::size_t>(S::buffers);
  if constexpr (requires { S::tensor_slots; }) t.tensor_slots = static_cast<std::size_t>(S::tensor_slots);
  if constexpr (requires { S::barrier; }) t.barrier = static_cast<bool>(S::barrier);
  if constexpr (requires { S::global; }) t.global = static_cast<bool>(S::global);
  if constexpr (requires { S::terms; }) t.terms = static_cast<std::size_t>(S::terms);
  if constexpr (requires { S::optional; }) t.optional = static_cast<bool>(S::optional);
  if constexpr (requires { S::replay_ignores_input; })
    t.replay_ignores_input = static_cast<bool>(S::replay_ignores_input);
  if constexpr (requires { S::uses_param; }) t.uses_param = static_cast<bool>(S::uses_param);
  if constexpr (requires { S::measure_reads_input; })
    t.measure_reads_input = static_cast<bool>(S::measure_reads_input);
  if constexpr (requires { S::measures_param_squares; })
    t.measures_param_squares = static_cast<bool>(S::measures_param_squares);
  if constexpr (requires { S::factored_state; }) t.factored_state = static_cast<bool>(S::factored_state);
  if constexpr (requires { S::max_statistics; }) t.max_statistics = static_cast<bool>(S::max_statistics);
  if constexpr (requires { S::preconditioner; }) t.preconditioner = static_cast<bool>(S::preconditioner);
  return t;
}

/// The traits of a stage with their defaults (optim/stage.hpp): a stage declares only what
/// differs from an element-wise, always-active stage with no state, no per-tensor constants,
/// whose replay reads its input and whose math may read p.
template <class S>
struct stage_traits {
  /// Every trait of S (`spec_of`).
  static constexpr stage_spec spec = spec_of<S>();
  /// Per-element state buffers (default 0).
  static constexpr std::size_t buffers = spec.buffers;
  /// Per-tensor constants (default 0).
  static constexpr std::size_t tensor_slots = spec.tensor_slots;
  /// Needs a reduction of its input before it acts (default false).
  static constexpr bool barrier = spec.barrier;
  /// May be switched off by its options, through `enabled()` (default false).
  static constexpr bool optional = spec.optional;
  /// Its replay computes u from its state alone (default false).
  static constexpr bool replay_ignores_input = spec.replay_ignores_input;
  /// Its math reads the parameter p (default true; false lets a pass skip reading p).
  static constexpr bool uses_param = spec.uses_param;
  /// A factored second-moment stage (default false).
  static constexpr bool factored_state = spec.factored_state;
  /// A preconditioner stage (default false).
  static constexpr bool preconditioner = spec.preconditioner;
};

/// The element kernel of a preconditioner stage: the identity (the stage's work is done
/// before the passes, which read its direction where they would read the gradient).
template <class C>
struct identity_kernel {
  /// u unchanged.
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void update(V&, const V&, const double*) const {}
  /// u unchanged.
  template <class V>
  GRADAPT_HD GRADAPT_INLINE void replay(V&, const V&, const double*) const {}
};

/// The communicator argument of a preconditioner stage's `direct` on a step without one.
struct no_comm {};

/// `s.validate()` when the stage has one (options to check), else nothing.
template <class S>
void validate_stage(const S& s) {
  if constexpr (requires { s.validate(); }) s.validate();
}
/// `s.tensor_constants(ts, out)` when the stage has per-tensor constants.
template <class S>
void stage_tensor_constants(const S& s, const tensor_setup& ts, double* out) {
  if constexpr (requires { s.tensor_constants(ts, out); }) s.tensor_constants(ts, out);
}

/// The traits of S as the plan keeps them (`stage_traits<S>::spec`, checked): the barrier
/// traits at their defaults for an element stage, `max_statistics` false unless S is factored.
template <class S>
GRADAPT_HD constexpr stage_spec info_of() {
  using T = stage_traits<S>;
  stage_spec i = T::spec;
  if constexpr (T::factored_state) {
    static_assert(!T::barrier && T::buffers == 1 && !T::optional && !T::replay_ignores_input,
                  "gradapt::chain: a factored stage is a required element stage with one buffer whose "
                  "replay reads its input");
  } else {
    i.max_statistics = false;
  }
  if constexpr (T::preconditioner)
    static_assert(!T::barrier && T::buffers == 0 && !T::optional && !T::factored_state,
                  "gradapt::chain: a preconditioner stage is a required stage without chain buffers that is "
                  "neither a barrier nor factored");
  if constexpr (T::barrier) {
    static_assert(T::buffers == 0, "gradapt::chain: a barrier stage keeps no per-element state");
    static_assert(T::spec.terms > 0, "gradapt::chain: a barrier stage declares its terms (at least 1)");
  } else {  // the barrier traits mean nothing for an element stage
    const stage_spec element{};
    i.global = element.global;
    i.terms = element.terms;
    i.measure_reads_input = element.measure_reads_input;
    i.measures_param_squares = element.measures_param_squares;
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
  static constexpr stage_spec info[n] = {info_of<S>()...};
  /// info_at(k) without touching the static array, so the queries below also compile as device
  /// functions (nvcc has no device copy of a static constexpr member array).
  GRADAPT_HD static constexpr stage_spec info_at(std::size_t k) {
    const stage_spec a[n] = {info_of<S>()...};
    return a[k];
  }

  GRADAPT_HD static constexpr std::size_t buffer_offset(std::size_t i) {
    std::size_t o = 0;
    for (std::size_t k = 0; k < i; ++k) o += info_at(k).buffers;
    return o;
  }
  GRADAPT_HD static constexpr std::size_t slot_offset(std::size_t i) {
    std::size_t o = 0;
    for (std::size_t k = 0; k < i; ++k) o += info_at(k).tensor_slots;
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
  static constexpr bool has_factored = info_at(0).factored_state;
  static constexpr bool factored_first = [] {
    for (std::size_t k = 1; k < n; ++k)
      if (info_at(k).factored_state) return false;
    return true;
  }();
  static_assert(
      factored_first,
      "gradapt::chain: a factored stage (scale_by_factored_rms, scale_by_sm3) must be the first stage "
      "(it reads the gradient itself, as in optax's adafactor and sm3)");
  /// True when stage 0 is a preconditioner stage (see chain::step).
  static constexpr bool has_preconditioner = info_at(0).preconditioner;
  static_assert(
      [] {
        for (std::size_t k = 1; k < n; ++k)
          if (info_at(k).preconditioner) return false;
        return true;
      }(),
      "gradapt::chain: a preconditioner stage (scale_by_shampoo) must be the first stage (it reads the "
      "gradient itself)");
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
      if (on(k, e) && !info_at(k).barrier && info_at(k).replay_ignores_input) return true;
    return false;
  }
  GRADAPT_HD static constexpr std::size_t live_from(std::size_t pass, std::uint64_t e) {
    std::size_t s = 0;
    for (std::size_t k = 0; k < lo(pass, e); ++k)
      if (on(k, e) && !info_at(k).barrier && info_at(k).replay_ignores_input) s = k;
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

/// The plan's answers for pass `Pass` under mask E, each a constant evaluated once per (plan,
/// pass, mask). The plan's queries loop over the stages (and call each other), and a compiler
/// evaluates a constant expression afresh wherever it occurs, so the functors and the chain's
/// pass drivers, instantiated for every value and argument type, read them from here. Every
/// member is a scalar, so device code may read them (a non-scalar constexpr member is not
/// usable there).
template <class Plan, std::size_t Pass, std::uint64_t E>
struct pass_table {
  static constexpr bool final = Plan::is_final(Pass, E);
  static constexpr bool needs_param = Plan::needs_param(Pass, E);
  static constexpr bool needs_grad = Plan::needs_grad(Pass, E);
  static constexpr std::size_t grad_arg = Plan::grad_arg(Pass, E);
  static constexpr std::size_t args = Plan::args(Pass, E);
  /// The barrier stage this pass measures (n for the final pass).
  static constexpr std::size_t hi = Plan::hi(Pass, E);
  static constexpr bool premeasure_squares = Pass == Plan::param_squares_pass(E);
  template <std::size_t I>
  static constexpr mode mode_of = Plan::mode_of(Pass, I, E);
  template <std::size_t I>
  static constexpr bool active = mode_of<I> == mode::replay || mode_of<I> == mode::update;
  template <std::size_t I>
  static constexpr std::size_t buffer_arg = Plan::buffer_arg(Pass, I, E);
  template <std::size_t I>
  static constexpr std::size_t barrier_number = Plan::barrier_number(I, E);
  /// Backend argument A (host code: arg_desc is not a scalar).
  template <std::size_t A>
  static constexpr arg_desc arg = Plan::arg_at(Pass, E, A);
};

/// The plan's per-stage constants for stage I, each evaluated once (scalars, as in
/// pass_table).
template <class Plan, std::size_t I>
struct stage_table {
  static constexpr stage_spec spec = Plan::info_at(I);
  static constexpr bool barrier = spec.barrier;
  static constexpr bool global = spec.global;
  static constexpr bool factored_state = spec.factored_state;
  static constexpr std::size_t buffers = spec.buffers;
  static constexpr std::size_t terms = spec.terms;
  static constexpr std::size_t slot_offset = Plan::slot_offset(I);
};

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

  using table = pass_table<Plan, Pass, E>;

  template <std::size_t I, class V, class... A, std::size_t... J>
  GRADAPT_HD GRADAPT_INLINE void stage_step(V& u, const V& p, const double* tc, std::size_t t,
                                            std::index_sequence<J...>, A&... args) const {
    // Every plan query is a constant (nothing of the plan is read at run time, so the same
    // code compiles for the device).
    using stage = stage_table<Plan, I>;
    constexpr mode m = table::template mode_of<I>;
    if constexpr (FT && stage::factored_state) {
      (void)u;
    } else if constexpr (m == mode::replay || m == mode::update) {
      constexpr std::size_t boff = table::template buffer_arg<I>;
      const auto& k = gradapt::detail::slot<I>(kernels);
      const double* stc = tc + stage::slot_offset;
      if constexpr (stage::barrier) {
        constexpr std::size_t b = table::template barrier_number<I>;
        const double f = factors[b * count + (stage::global ? 0 : t)];
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
    (stage_step<I>(u, p, tc, t, std::make_index_sequence<stage_table<Plan, I>::buffers>{}, args...), ...);
  }

  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE V& param(V& unused, A&... args) const {
    if constexpr (table::needs_param)
      return nth<0>(args...);
    else
      return unused;
  }

  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE auto operator()(tensor_index t, V& a0, A&... rest) const {
    static_assert(1 + sizeof...(A) == table::args, "gradapt::chain: pass argument count mismatch");
    V unused{};
    V& p = param(unused, a0, rest...);
    V u;
    if constexpr (table::needs_grad)
      u = nth<table::grad_arg>(a0, rest...);
    else
      u = V(C(0));
    constexpr std::size_t slots = Plan::total_slots;
    const double* tc = tconst + t.value * slots;
    run_stages(u, p, tc, t.value, std::make_index_sequence<Plan::n>{}, a0, rest...);
    if constexpr (table::final) {
      p = p + u;
    } else {
      constexpr std::size_t h = table::hi;
      return gradapt::detail::slot<h>(kernels).measure(u, p, tc + stage_table<Plan, h>::slot_offset);
    }
  }
};

/// The final pass F, also returning per element the parameter it wrote (its first argument)
/// widened to double. Summed per tensor by `apply_reduce_list`, the sum is finite exactly when
/// every updated value is (float values summed in double cannot overflow: |Σ| < 2^128 × n),
/// so the pass that writes a parameter finds a non-finite one. (Summing the state buffers too
/// would also find a statistic that overflowed while the parameter stayed finite, at 12% to
/// 20% of an AdamW or SGD step in bench_optim; the parameter alone is within the run's noise.)
template <class F>
struct finite_probe {
  static constexpr bool vectorizable = F::vectorizable;
  F f;
  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE simd::terms_t<V, 1> operator()(tensor_index t, V& a0, A&... rest) const {
    f(t, a0, rest...);
    simd::terms_t<V, 1> r;
    r[0] = simd::widen(a0);
    return r;
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

  using table = pass_table<Plan, Pass, E>;
  static constexpr bool stage_on = table::template active<0>;
  static constexpr std::size_t ga = table::grad_arg;
  static constexpr std::size_t va = table::template buffer_arg<0>;
  static constexpr std::size_t full = table::args;

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
    if constexpr (table::final)
      pf(tensor_index{0}, pick<J>(u0, dummy, a...)...);
    else
      return pf(tensor_index{0}, pick<J>(u0, dummy, a...)...)[0];
  }
  template <class V, class... A>
  GRADAPT_HD GRADAPT_INLINE auto operator()(V r, V c, A&... a) const {
    static_assert(sizeof...(A) + (stage_on ? 1 : 0) == full, "gradapt::chain: factored pass argument count");
    V u0{};
    V dummy{};
    if constexpr (stage_on)
      u0 = gradapt::detail::slot<0>(pf.kernels).template y<Variant>(r, c, nth<ga>(a...));
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
    return gradapt::detail::slot<0>(fp.pf.kernels).term(r, c, nth<FP::ga>(a...));
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

/// What a chain's sum assembly returns (chain::step with an assembly): `count` rows of a
/// barrier's terms, in host memory, that the barrier's factor is computed from.
struct assembled_sums {
  const double* sums = nullptr;  ///< row t holds the barrier's terms for row t
  std::size_t count = 0;         ///< rows
};

/// The assembly of a plain step: the sums measured over the list are the tensors' own.
struct no_sum_assembly {
  static constexpr bool active = false;
  assembled_sums operator()(const double* s, std::size_t n, std::size_t, bool) const { return {s, n}; }
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

}  // namespace gradapt

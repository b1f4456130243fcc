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
#include "gradapt/optim/chain_plan.hpp"
#include "gradapt/optim/chain_state.hpp"
#include "gradapt/optim/factoring.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt {

template <class... Stages>
class chain;

namespace detail::optim {
/// What `chain::step` returns: the preconditioner stage's report, or nothing.
template <class Plan, class S0>
struct step_result_of {
  using type = void;
};
template <class Plan, class S0>
requires(Plan::has_preconditioner) struct step_result_of<Plan, S0> {
  using type = typename S0::report_type;
};
}  // namespace detail::optim

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
  /// What `step` returns: void, or for a chain whose first stage is a preconditioner stage
  /// (scale_by_shampoo) that stage's report of the step (shampoo_step_report).
  using step_result =
      typename detail::optim::step_result_of<plan, std::tuple_element_t<0, std::tuple<Stages...>>>::type;

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

  /// True when a stage with a global sum over every tensor (clip_by_global_norm) is switched
  /// on by its options: a step then needs the sum over the whole parameter list.
  bool global_barrier_active() const {
    const std::uint64_t m = current_mask();
    for (std::size_t i = 0; i < plan::n; ++i)
      if (plan::info[i].barrier && plan::info[i].global && (m >> i & 1u) != 0) return true;
    return false;
  }

  /// Pushes, in stage order, the options of every stage that names them (`option_fields()`)
  /// as doubles: what `train::data_parallel_step` agrees on across ranks at construction, so
  /// that ranks built with another momentum or b2 throw naming it. `out` has
  /// `push(std::string_view name, double value)`.
  template <class Out>
  void agreed_options(Out& out) const {
    [&]<std::size_t... I>(std::index_sequence<I...>) { (push_options(std::get<I>(stages_), out), ...); }
    (std::index_sequence_for<Stages...>{});
  }

  /// Creates the state for `params` on backend `b`: zero-initialised buffers of element type
  /// S (default: the compute type of the parameters) for every active stage. `slices` (the
  /// sharded optimizer's, for a chain whose preconditioner stage is sharded by block): list
  /// entry t is a slice of a larger tensor (see stage.hpp).
  /// @throws gradapt::error on invalid options; when `slices` is given to a chain without a
  ///         preconditioner stage that takes them
  template <class S = void, optimizer_backend B, element V, element G, class Options>
  auto init(const B& b, const param_list<V, G, typename B::space, Options>& params,
            std::span<const preconditioner_slice> slices = {}) const {
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
      return plan::info[i].factored_state ? st.ft_[t].state : st.sizes_[t];
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
    if constexpr (std::same_as<space, host_space>) st.param_checks_.assign(count, 0.0);
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
    if constexpr (requires { std::get<0>(stages_).init_state(b, params, slices); })
      st.pre_ = std::get<0>(stages_).init_state(b, params, slices);
    else if constexpr (plan::has_preconditioner)
      st.pre_ = std::get<0>(stages_).init_state(b, params);
    if constexpr (!requires { std::get<0>(stages_).init_state(b, params, slices); })
      detail::require(slices.empty(), "chain::init: ", slices.size(),
                      " slices given, but the chain has no preconditioner stage sharded by block");
    return st;
  }

  /// One optimizer step: reads the gradients, advances the state and updates the parameters
  /// in place, in `plan::passes` passes over memory (see the file comment).
  /// @throws gradapt::error when `params` does not match the state (tensor count or sizes),
  ///         the state's active stages differ from the options now, or the learning rate is
  ///         not finite; after the update, when the state's finiteness check (first step and
  ///         every `chain_state::check_interval()` steps) finds a non-finite state value, and
  ///         on every later step until `load` restores the state
  ///
  /// A chain whose first stage is a preconditioner stage (scale_by_shampoo) first has that
  /// stage map every gradient to its direction (its state advanced; see stage.hpp), then runs
  /// the passes over the directions, and returns the stage's report.
  template <optimizer_backend B, element V, element G, class Options, class S>
  step_result step(const B& b, const param_list<V, G, typename B::space, Options>& params,
                   chain_state<chain, B, V, G, S>& st, const step_args& args = {}) const {
    detail::optim::no_sum_assembly none;
    detail::optim::no_comm nc;
    return step_impl(nc, b, params, st, args, none);
  }

  /// `step` of a chain whose first stage is a preconditioner stage, with its distributed work
  /// over the ranks of `comm` (scale_by_shampoo: each rank computes its share of the roots and
  /// one allgather gives every rank all of them; the result is the same bits as `step` on one
  /// rank). The stage agrees across ranks, once per world, its options and the other stages'
  /// (`agreed_options`): a difference is a gradapt::error on every rank naming the option.
  template <communicator Comm, optimizer_backend B, element V, element G, class Options, class S>
  requires(plan::has_preconditioner) step_result
      step(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params,
           chain_state<chain, B, V, G, S>& st, const step_args& args = {})
  const {
    detail::optim::no_sum_assembly none;
    return step_impl(comm, b, params, st, args, none);
  }

  /// `step` for a list whose tensors are pieces of larger logical tensors (the sharded step,
  /// shard/optimizer.hpp): after each barrier's per-tensor sums are measured over this list,
  /// `assembly(sums, count, terms, global)` (host memory) returns the sums the barrier's factor
  /// is computed from, as a `detail::optim::assembled_sums`: for a per-tensor barrier `count`
  /// rows of `terms` (row t: the sums of the logical tensor that list tensor t belongs to),
  /// for a global barrier the logical tensors' rows, in logical order. It is called once per
  /// active barrier in pass order on every step, also with `count == 0` when the list is empty,
  /// so that an assembly that communicates runs the same collectives on every rank.
  template <optimizer_backend B, element V, element G, class Options, class S, class Assembly>
  requires std::same_as<typename B::space, host_space> &&
      (!plan::has_factored &&
       !plan::has_preconditioner) void step(const B& b,
                                            const param_list<V, G, typename B::space, Options>& params,
                                            chain_state<chain, B, V, G, S>& st, const step_args& args,
                                            Assembly& assembly) const {
    detail::optim::no_comm nc;
    step_impl(nc, b, params, st, args, assembly);
  }

  /// The options of every stage after the first, pushed as `agreed_options` pushes them (a
  /// preconditioner stage agrees them with its own across ranks).
  struct later_options {
    const chain* c;  ///< the chain whose stages 1.. are pushed
    /// Pushes the options of every stage after the first (`push(name, value)` on `out`).
    template <class Out>
    void push_options(Out& out) const {
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (chain::push_options(std::get<I + 1>(c->stages_), out), ...);
      }
      (std::make_index_sequence<sizeof...(Stages) - 1>{});
    }
  };

 private:
  template <class Comm, optimizer_backend B, element V, element G, class Options, class S, class Assembly>
  step_result step_impl(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params,
                        chain_state<chain, B, V, G, S>& st, const step_args& args, Assembly& assembly) const {
    const std::size_t count = params.size();
    // A preconditioner stage checks the list against its state and agrees across ranks
    // first (so that a bad input is an error on every rank); the passes read its directions.
    [[maybe_unused]] std::conditional_t<plan::has_preconditioner, step_result, int> report{};
    if constexpr (plan::has_preconditioner) {
      detail::require(!st.failed_, "chain::step: the state holds non-finite values since a check after step ",
                      st.steps_, " (see chain_state::set_check_interval); restore a checkpoint with load()");
      step_context pctx;
      pctx.step = st.steps_ + 1;
      if (args.lr.has_value()) pctx.lr = *args.lr;
      const later_options later{this};
      report = std::get<0>(stages_).direct(comm, b, params, st.pre_, pctx, later);
    }
    detail::require(count == st.sizes_.size(), "chain::step: the parameter list holds ", count,
                    " tensors but the state was created for ", st.sizes_.size(),
                    " (create the state with init() for this list)");
    for (std::size_t t = 0; t < count; ++t) {
      const auto& e = params[t];
      detail::require(e.value.size() == st.sizes_[t], "chain::step: parameter '", e.name, "' (tensor ", t,
                      ") has ", e.value.size(), " elements but the state holds ", st.sizes_[t]);
      st.p_const_[t] = e.value;
      if constexpr (plan::has_preconditioner)
        st.g_const_[t] = st.pre_.direction_view(t);
      else
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
    detail::require(!st.failed_, "chain::step: the state holds non-finite values since a check after step ",
                    st.steps_, " (see chain_state::set_check_interval); restore a checkpoint with load()");
    refresh_constants(b, params, st, false);
    // Field by field, the learning rate only when set: GCC 12 at -O1 warns that a copied
    // empty std::optional's payload "may be used uninitialized" (-Wmaybe-uninitialized).
    step_context ctx;
    ctx.step = st.steps_ + 1;
    if (args.lr.has_value()) ctx.lr = *args.lr;
    using C = compute_t<V>;
    const auto kernels = make_kernels<C>(ctx, std::index_sequence_for<Stages...>{});
    if (count > 0) {
      dispatch(mask, [&]<std::uint64_t E>() {
        if constexpr (plan::has_factored)
          run_by_tensor<E>(b, params, st, kernels);
        else
          run_passes<E>(b, params, st, kernels, assembly, std::make_index_sequence<plan::passes(E)>{});
      });
    } else if constexpr (Assembly::active) {
      for (std::size_t i = 0; i < plan::n; ++i)
        if (plan::on(i, mask) && plan::info[i].barrier)
          (void)assembly(nullptr, 0, plan::info[i].terms, plan::info[i].global);
    }
    ++st.steps_;
    if (st.nonfinite_param_ != 0) {
      const std::size_t t = st.nonfinite_param_ - 1;
      st.nonfinite_param_ = 0;
      st.failed_ = true;
      detail::fail(
          "chain::step: step ", st.steps_, " left non-finite values in parameter '", params[t].name,
          "' (a non-finite gradient, or a finite one whose update overflowed the float range); the "
          "parameters have been updated and the state cannot recover: restore a checkpoint with load(), "
          "and clip or rescale the gradients (a loss scaler skips non-finite ones)");
    }
    if (st.check_interval_ != 0 && (st.steps_ == 1 || st.steps_ % st.check_interval_ == 0)) {
      st.failed_ = true;
      st.check_finite(b, "chain::step");
      st.failed_ = false;
    }
    if constexpr (plan::has_preconditioner) return report;
  }

  std::tuple<Stages...> stages_;

  /// Pushes stage s's named options (none when it names none).
  template <class S, class Out>
  static void push_options(const S& s, Out& out) {
    if constexpr (requires { s.push_agreed_options(out); })
      s.push_agreed_options(out);  // a stage whose options are not all numbers (scale_by_shampoo)
    else if constexpr (requires { S::option_fields(); })
      std::apply([&](const auto&... f) { (out.push(f.name, static_cast<double>(s.*(f.ptr))), ...); },
                 S::option_fields());
  }

  /// Doubles per workspace slot for barrier sums: one barrier's terms, then Σp² measured in
  /// a factored stage's statistics pass.
  static constexpr std::size_t sum_stride = (plan::max_terms > 0 ? plan::max_terms : 1) + 1;

  void validate() const {
    std::apply([](const auto&... s) { (detail::optim::validate_stage(s), ...); }, stages_);
  }

  std::uint64_t current_mask() const {
    std::uint64_t m = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using S = std::tuple_element_t<I, std::tuple<Stages...>>;
            bool on = true;
            if constexpr (detail::optim::stage_traits<S>::optional) on = std::get<I>(stages_).enabled();
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
    detail::value_pack<typename Stages::template kernel<C>...> k;
    ((detail::slot<I>(k) = std::get<I>(stages_).template prepare<C>(ctx)), ...);
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
    for (std::size_t g = 0; g < ng; ++g)  // all or nothing: check every group before using any
      gradapt::detail::check_group_options(params.group(g).options, params.group(g).name, "chain::step");
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
        (detail::optim::stage_tensor_constants(
             std::get<I>(stages_), ts, st.tconst_host_.data() + t * plan::total_slots + plan::slot_offset(I)),
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

  template <std::uint64_t E, class B, class PL, class St, class K, class Asm, std::size_t... P>
  void run_passes(const B& b, const PL& params, St& st, const K& kernels, Asm& assembly,
                  std::index_sequence<P...>) const {
    (run_pass<P, E>(b, params, st, kernels, assembly), ...);
  }

  template <std::size_t Pass, std::uint64_t E, class B, class PL, class St, class K, class Asm>
  void run_pass(const B& b, const PL& params, St& st, const K& kernels, Asm& assembly) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    const std::size_t count = params.size();
    const detail::optim::pass_functor<plan, Pass, E, C, K> f{kernels, st.tconst_.data(), st.factors_.data(),
                                                             count};
    using table = detail::optim::pass_table<plan, Pass, E>;
    constexpr std::size_t nargs = table::args;
    if constexpr (table::final) {
      if constexpr (std::same_as<space, host_space>) {
        // On the host the final pass also sums the updated parameters per tensor in double
        // (finite exactly when every value is), in registers: no extra memory traffic.
        if (st.check_interval_ != 0) {
          static_assert(table::needs_param, "gradapt::chain: the final pass writes the parameters");
          [&]<std::size_t... A>(std::index_sequence<A...>) {
            b.apply_reduce_list(detail::optim::finite_probe<decltype(f)>{f},
                                std::span<double>(st.param_checks_),
                                list<table::template arg<A>>(params, st)...);
          }
          (std::make_index_sequence<nargs>{});
          for (std::size_t t = count; t-- > 0;)  // the first such tensor is named
            if (!std::isfinite(st.param_checks_[t])) st.nonfinite_param_ = t + 1;
          return;
        }
      }
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        b.apply_list(f, list<table::template arg<A>>(params, st)...);
      }
      (std::make_index_sequence<nargs>{});
    } else {
      constexpr std::size_t h = table::hi;
      constexpr std::size_t terms = plan::info[h].terms;
      constexpr std::size_t bn = table::template barrier_number<h>;
      const auto sums =
          tensor_view<double, space>::vector(st.sums_.data(), static_cast<std::int64_t>(count * terms));
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        b.apply_reduce_list(f, detail::optim::per_tensor_arg(sums),
                            list<table::template arg<A>>(params, st)...);
      }
      (std::make_index_sequence<nargs>{});
      const auto& k = detail::slot<h>(kernels);
      using Kernel = std::remove_cvref_t<decltype(k)>;
      const double* sums_at = st.sums_.data();
      std::size_t rows = count;
      if constexpr (Asm::active) {
        const detail::optim::assembled_sums got =
            assembly(st.sums_.data(), count, terms, plan::info[h].global);
        detail::require(plan::info[h].global || got.count == count, "chain::step: the sum assembly returned ",
                        got.count, " rows for ", count, " tensors");
        sums_at = got.sums;
        rows = got.count;
      }
      if constexpr (plan::info[h].global) {
        b.apply(detail::optim::finalize_all<Kernel, terms>{k, sums_at, rows}, st.factor_views_[bn][0]);
      } else {
        b.apply_list(detail::optim::finalize_each<Kernel>{k, sums_at, st.tconst_.data(), terms,
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
      const auto& k0 = detail::slot<0>(kernels);
      const auto g = tensor_view<const G, space>(st.g_const_[k]);
      if constexpr (fused_maxima) {
        bool one_thread = true;  // a backend without threads of its own (CUDA) runs it as one pass
        if constexpr (task_backend<B>) one_thread = bb.thread_count() == 1;
        if (f.factored && one_thread) {
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
      // On the host, the updated tensor is read once more while it is still in cache: its
      // non-finite count (one slot per tensor, so tasks on other threads do not share it).
      if constexpr (std::same_as<space, host_space>)
        if (st.check_interval_ != 0)
          st.param_checks_[k] =
              bb.reduce(reduction::count_nonfinite, tensor_view<const V, space>(st.p_const_[k]));
    };
    detail::optim::for_tensors(b, std::span<const std::size_t>(st.order_),
                               std::span<const std::size_t>(st.sizes_), st.total_, st.slots_, one);
    if constexpr (std::same_as<space, host_space>)
      if (st.check_interval_ != 0)
        for (std::size_t t = st.sizes_.size(); t-- > 0;)  // the first such tensor is named
          if (st.param_checks_[t] != 0.0) st.nonfinite_param_ = t + 1;
  }

  /// The view of tensor k for argument descriptor D of a pass.
  template <detail::optim::arg_desc D, class PL, class St>
  static auto one_view(const PL& params, St& st, std::size_t k) {
    return list<D>(params, st)[k];
  }

  /// One pass over factored tensor k through `apply_factored` (`Variant`: its
  /// factored_tensor::variant), with the tensor's constants `tc` and its barrier factors
  /// `factors` (tensor_pass finds both); a non-final pass leaves its barrier's sum in `sum[0]`.
  template <std::size_t Pass, std::uint64_t E, bool Variant, class B, class PL, class St, class K>
  void factored_tensor_pass(const B& b, const PL& params, St& st, const K& kernels, std::size_t k,
                            std::size_t slot, const double* tc, double* factors, double* sum) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    using table = detail::optim::pass_table<plan, Pass, E>;
    constexpr std::size_t nargs = table::args;
    constexpr bool final = table::final;
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
        b.apply_factored(fp, f.d, fy, fx, one_view<table::template arg<full(A)>>(params, st, k)...);
      else
        b.apply_factored_sum(fp, f.d, fy, fx, tensor_view<double, space>::vector(sum, 1),
                             one_view<table::template arg<full(A)>>(params, st, k)...);
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
    using table = detail::optim::pass_table<plan, 0, E>;
    constexpr std::size_t nargs = table::args;
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
      b.apply_factored_max(mp, f.d, fy, fx, my, mx, one_view<table::template arg<full(A)>>(params, st, k)...);
    }
    (std::make_index_sequence<nargs - 1>{});
  }

  template <std::size_t Pass, std::uint64_t E, class B, class PL, class St, class K>
  void tensor_pass(const B& b, const PL& params, St& st, const K& kernels, std::size_t k,
                   std::size_t slot) const {
    using C = compute_t<typename PL::value_type>;
    using space = typename B::space;
    using table = detail::optim::pass_table<plan, Pass, E>;
    constexpr std::size_t nb = plan::barriers(E);
    constexpr std::size_t nargs = table::args;
    constexpr bool final = table::final;
    const double* tc = st.tconst_.data() + k * plan::total_slots;
    double* factors = st.wfac_.data() + slot * nb;
    double* sum = st.wsum_.data() + slot * sum_stride;
    const auto& f = st.ft_[k];
    constexpr bool premeasured = table::premeasure_squares && factored_sumsq_backend<B>;
    if (premeasured && f.factored) {
      sum += sum_stride - 1;  // Σp², measured in the statistics pass
    } else if (f.factored) {
      if (f.variant)
        factored_tensor_pass<Pass, E, true>(b, params, st, kernels, k, slot, tc, factors, sum);
      else
        factored_tensor_pass<Pass, E, false>(b, params, st, kernels, k, slot, tc, factors, sum);
    } else {
      const detail::optim::pass_functor<plan, Pass, E, C, K> pf{kernels, tc, factors, 1};
      [&]<std::size_t... A>(std::index_sequence<A...>) {
        if constexpr (final)
          b.apply_list(pf, list<table::template arg<A>>(params, st).subspan(k, 1)...);
        else
          b.apply_reduce_list(pf,
                              detail::optim::per_tensor_arg(tensor_view<double, space>::vector(
                                  sum, static_cast<std::int64_t>(plan::info[table::hi].terms))),
                              list<table::template arg<A>>(params, st).subspan(k, 1)...);
      }
      (std::make_index_sequence<nargs>{});
    }
    if constexpr (!final) {
      constexpr std::size_t h = table::hi;
      constexpr std::size_t bn = table::template barrier_number<h>;
      const auto& kh = detail::slot<h>(kernels);
      using Kernel = std::remove_cvref_t<decltype(kh)>;
      b.apply_list(detail::optim::finalize_each<Kernel>{kh, sum, tc, plan::info[h].terms, plan::total_slots,
                                                        plan::slot_offset(h)},
                   std::span<const tensor_view<double, space>>(st.wfac_views_.data() + slot * nb + bn, 1));
    }
  }
};

}  // namespace gradapt

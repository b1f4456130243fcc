#pragma once
/// @file
/// The interface of one gradient transformation ("stage") of a `gradapt::chain`, and the
/// host-side values a stage reads when it sets itself up for a step or a tensor.
///
/// An optimizer is a chain of small stages (optax's idea: Loshchilov & Hutter's decoupled
/// weight decay, Adam's moments, You et al.'s trust ratio, momentum, a learning-rate scale are
/// each one transformation of the update u, which starts as the gradient g). In C++ the chain
/// is a template and runs as few passes over memory as the stages allow: consecutive
/// element-wise stages fuse into one pass, and only a stage that needs a reduction of its
/// input (a trust-ratio norm, a global gradient norm, a block RMS) ends a pass.
///
/// A stage type S is an aggregate of options with these members. A stage declares only what is
/// particular to it: every trait has a default (read through `detail::optim::stage_traits`), so
/// an element-wise stage without state needs only its options, `prepare` and `kernel`.
///
///  - `static constexpr stage_spec traits`: the stage's traits in one value (see stage_spec;
///    its members' defaults are the defaults listed here). A stage may instead, or in addition,
///    declare a trait as a member of its own of the same name (`static constexpr std::size_t
///    buffers = 2;`), which takes precedence over `traits`:
///     - `buffers`: per-element state buffers (Adam: 2, momentum: 1; default 0);
///     - `tensor_slots`: per-tensor constants (masked weight decay, lr scale; default 0);
///     - `barrier`: needs a reduction over its input before it acts (default false);
///     - `optional`: may be switched off by its options, `enabled()` (default false);
///     - `replay_ignores_input`: its replay computes u from its state alone (Adam; default
///       false);
///     - `uses_param`: its math reads the parameter p (default true; false lets a pass skip
///       p).
///  - `void validate() const`: throws gradapt::error naming a bad option (default: nothing to
///    check).
///  - `static constexpr auto option_fields()`: the options every rank must share, as a tuple
///    of `archive_member`s (GRADAPT_OPTION_FIELDS(stage, option, ...)), which
///    `chain::agreed_options` reads for the train step's construction agreement (default: none
///    agreed; the replica check still finds a difference as drift);
///  - `void tensor_constants(const tensor_setup&, double* out) const`: fills the tensor_slots
///    values (default: none).
///  - `template <class C> kernel<C> prepare(const step_context&) const`: the per-step constants
///    (required).
///
/// `kernel<C>` is trivially copyable (it travels into CUDA kernels) and holds the element math
/// as GRADAPT_HD templates on the value type V (C = float or double, or a host `simd::pack`);
/// `tc` points at the stage's per-tensor constants for the element's tensor:
///
///  - element stages: `update(V& u, const V& p, const double* tc, V&... buffers)` transforms u
///    and advances the stage's state buffers; `replay(V& u, const V& p, const double* tc,
///    const V&... buffers)` recomputes the same u from the already advanced state without
///    writing it. Replay lets a later pass (after a barrier) rebuild u instead of storing it:
///    for the output to be bitwise the one `update` produced, it must be a function of
///    (input u, new state) computed by the same expressions.
///  - barrier stages (`buffers == 0`) also declare the traits `global` (one factor for all
///    tensors, else one per tensor; default false) and `terms` (at least 1), and provide
///    `measure(const V& u, const V& p, const double* tc)` returning `simd::terms_t<V, terms>`
///    (values summed per tensor in double with the backend's fixed order), `double
///    finalize(const double* sums, const double* tc)` (the factor from the sums; for a global
///    barrier the sums over all tensors in tensor order and tc == nullptr), and `apply(V& u,
///    const V& p, C factor, const double* tc)`.
///  - a barrier may declare the trait `measure_reads_input = false` when its measure reads p
///    only (scale_by_param_block_rms): if the stages between it and the previous barrier keep
///    no state, its pass then reads p alone instead of rebuilding u.
///
/// Factored stages (Adafactor's `transform::scale_by_factored_rms`, SM3's
/// `transform::scale_by_sm3`) keep row and column statistics instead of one value per element.
/// They declare the trait `factored_state = true`, are required element stages with one buffer
/// whose replay reads its input, must be the chain's first stage, and add:
///
///  - `factored_tensor plan_tensor(std::span<const std::int64_t> shape) const`: per tensor
///    (at `init`), whether it is factored, its [A, X, B, Y, C] view, the buffer elements it
///    needs (`state`; a full-size buffer when not factored) and its workspace (`ws` elements
///    of the state type, `ws_sums` doubles);
///  - `advance(backend, kernel, factored_tensor, state view, gradient view, ws, ws_sums)`:
///    advances a factored tensor's statistics from g with backend operations and leaves its
///    row factors at ws[0, rows) and column factors at ws[rows, rows + cols);
///  - `kernel<C>::y(r, c, g)`: the stage's output for an element from its row factor r, column
///    factor c and gradient g (recomputed in every pass); `update` / `replay` are the stage's
///    element-wise form for tensors that are not factored.
///
/// A chain with a factored stage runs tensor by tensor (see chain.hpp) and needs a backend
/// with `apply_factored` / `apply_factored_sum` (`factored_backend`); its barriers measure one
/// term per tensor and none is global (checked at compile time).
///
/// Preconditioner stages (Shampoo's `transform::scale_by_shampoo`, optim/shampoo.hpp) map each
/// tensor's gradient to a direction as a whole (blocks, matrix products, roots), keeping state
/// that is not one value per element (per-block statistics and roots). They declare the trait
/// `preconditioner = true`, must be the chain's first stage, are required, keep no chain
/// buffers and are not barriers; their element kernel is the identity
/// (`detail::optim::identity_kernel`). They add:
///
///  - `template <class B, class V, class G> using state_type`: the stage's state, held by the
///    chain's state (`chain_state::preconditioner()`), saved in its archive's "preconditioner"
///    section;
///  - `using report_type`: what `chain::step` returns for such a chain (the step's report);
///  - `state_type<B, V, G> init_state(const B&, const param_list<V, G, space, O>&) const`;
///  - `report_type direct(Comm& comm, const B&, const param_list&, state_type&, const
///    step_context&, Extra& extra) const`: advances the state and writes every tensor's
///    direction into the state (`state.direction_view(t)`), which the chain's passes then read
///    where an element-wise chain reads the gradient. `comm` is the communicator of
///    `chain::step(comm, ...)` (distributed roots) or `detail::optim::no_comm` for
///    `chain::step(b, ...)`; `extra.push_options(out)` pushes the other stages' agreed
///    options, for a stage that agrees its options across ranks.
///
/// A preconditioner stage whose state is per block is sharded by block
/// (`shard::sharded_optimizer`): it adds `std::size_t shard_grain(shape)`, the elements of
/// one unit of a tensor of that shape (a cut at a multiple of it from the tensor's start never
/// splits a block; 1: any cut), and `init_state(b, params, slices)`, where list entry t is
/// elements [offset, offset + size) of a tensor of `slices[t].shape` (`preconditioner_slice`),
/// cut at unit boundaries: the state then holds that slice's blocks, the same blocks and bits
/// as the whole tensor's state holds for them.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/param_list.hpp"

namespace gradapt {

/// List entry t of a preconditioner stage's `init_state(b, params, slices)` is elements
/// [offset, offset + params[t].value.size()) of a tensor of `shape` (see the file comment).
struct preconditioner_slice {
  std::vector<std::int64_t> shape;  ///< the whole tensor's shape
  std::size_t offset = 0;           ///< the slice's first element within the whole tensor
};

/// The traits of a stage in one value, declared by a stage as `static constexpr stage_spec
/// traits{...}` (e.g. `traits{.buffers = 1, .optional = true, .uses_param = false}` for
/// momentum); each member's default is the trait's default (see the file comment).
struct stage_spec {
  /// Per-element state buffers (Adam: 2, momentum: 1). Default 0.
  std::size_t buffers = 0;
  /// Per-tensor constants the stage fills in `tensor_constants`. Default 0.
  std::size_t tensor_slots = 0;
  /// Needs a reduction over its input before it acts: ends a pass. Default false.
  bool barrier = false;
  /// A barrier's factor is one for all tensors (else one per tensor). Default false.
  bool global = false;
  /// Values a barrier's `measure` returns per element (at least 1 for a barrier). Default 0.
  std::size_t terms = 0;
  /// May be switched off by its options, through `enabled()`. Default false.
  bool optional = false;
  /// Its replay computes u from its state alone (Adam). Default false.
  bool replay_ignores_input = false;
  /// Its math reads the parameter p (false lets a pass skip reading p). Default true.
  bool uses_param = true;
  /// A barrier's measure reads u (false: p only, so its pass may skip rebuilding u). Default
  /// true.
  bool measure_reads_input = true;
  /// A barrier's measure is Σp² widened to double (a factored stage's statistics pass may take
  /// it). Default false.
  bool measures_param_squares = false;
  /// A factored second-moment stage (row and column statistics per tensor). Default false.
  bool factored_state = false;
  /// A factored stage whose statistics are maxima of a term (SM3). Default false.
  bool max_statistics = false;
  /// A preconditioner stage (maps whole tensors to directions; see the file comment). Default
  /// false.
  bool preconditioner = false;
};

/// What a stage sees when it prepares one step.
struct step_context {
  /// 1-based number of the step being taken (optax's incremented count): 1 at the first step.
  std::uint64_t step = 1;
  /// Learning rate passed to this step (`step_args::lr`), if any; stages that scale by a
  /// learning rate use it instead of their option.
  std::optional<double> lr{};
};

/// What a stage sees when it sets up its per-tensor constants (at init, and again whenever a
/// group's options change).
struct tensor_setup {
  std::string_view name;               ///< the parameter's name in the param_list
  std::size_t index = 0;               ///< the parameter's position
  std::size_t size = 0;                ///< elements of the tensor
  param_flags flags;                   ///< masks recorded with the parameter
  double lr_scale = 1.0;               ///< the group's learning-rate scale (1 without one)
  std::optional<double> weight_decay;  ///< the group's weight-decay override, if any
};

/// The per-step input, one type for every step call: an optimizer's
/// (`opt.step(b, params, state, {.lr = schedule(t)})`) and the composed train step's
/// (`step.step({.loss = loss})`).
struct step_args {
  /// Learning rate for this step. Optimizers: when unset, their `lr` option. The train step:
  /// the base learning rate η of this call (before AdaScale's gain); when unset,
  /// `step_settings::lr`.
  std::optional<double> lr{};
  /// This rank's training loss (the train step reports it in its metrics; LocalSGD's
  /// adaptive_period averages it over the ranks). NaN when not given; optimizers ignore it.
  double loss = std::numeric_limits<double>::quiet_NaN();
  /// This rank's time-to-ready in seconds: its own work before the step (forward, backward,
  /// data loading), measured before any collective hides it. The train step shares every
  /// rank's time within its per-step agreement (`data_parallel_step::rank_times()`); every
  /// rank gives it or none does. NaN when not given; optimizers ignore it.
  double ready_seconds = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace gradapt

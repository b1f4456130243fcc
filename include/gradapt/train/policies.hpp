#pragma once
/// @file
/// The policy slots of `gradapt::train::data_parallel_step`, the settings hooks may change, the
/// metrics a step reports, and the hook interface.
///
/// A data-parallel step is the recipe
///
///     unscale + overflow check (loss scaler)  →  local statistics  →  combine across ranks
///     (allreduce-mean, or Adasum)  →  noise scale and AdaScale gain  →  optimizer step at
///     lr × gain  →  LocalSGD averaging when due
///
/// Each stage is a *slot* filled by one policy value passed to `make_data_parallel_step`; a
/// slot left out takes its "off" policy, which costs nothing (no member, no branch):
///
/// | slot    | off (default)     | on                                                        |
/// |---------|-------------------|-----------------------------------------------------------|
/// | scaler  | `no_loss_scaling` | `gradapt::loss_scaler` (Micikevicius et al. 2018)         |
/// | combine | `allreduce_mean`  | `adasum_combine` (Maleki et al. 2021)                     |
/// | adapt   | `no_adascale`     | `adascale_policy` (McCandlish et al. 2018; Johnson 2020)  |
/// | sync    | `no_local_sgd`    | `local_sgd_policy<Schedule>` (post-local SGD, Lin 2018)   |
///
/// Any other value passed to the factory is a *hook*: an object with one or more of the member
/// functions `before_step`, `after_step`, `on_overflow`, `on_rescale` (detected at compile
/// time, as ensmallen detects callbacks). Hooks see `step_metrics` and may change
/// `step_settings` (learning rate, batch size, LocalSGD period), the way KungFu's adaptation
/// policies act on a running job.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>

#include "gradapt/combine/adasum.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"

namespace gradapt::train {

// ---- the slots ------------------------------------------------------------------------------

/// Scaler slot, off: the gradients carry no loss scale and are used as they are.
struct no_loss_scaling {};

/// Combine slot (default): gradients are summed over the ranks with one allreduce per tensor
/// and divided by the rank count, g ← (1/N) Σ_r g_r. With `adascale_policy` on, the summing
/// allreduce is `gradapt::allreduce_with_norms`, which also yields the two squared norms of the
/// data-parallel noise scale (no extra pass on comm::threads).
struct allreduce_mean {};

/// Combine slot: Adasum (Maleki et al., MLSys 2021), g ← g_0 ⊕ g_1 ⊕ … ⊕ g_{N−1} with the
/// pairwise operator a ⊕ b = (1 − a·b/2|a|²) a + (1 − a·b/2|b|²) b per tensor (see
/// combine/adasum.hpp). The step builds the `gradapt::adasum` combiner and its workspace
/// once. The data-parallel noise scale needs the rank MEAN of the gradients, which Adasum does
/// not form, so this slot cannot be combined with `adascale_policy` (a compile-time error).
struct adasum_combine {
  adasum_options options{};  ///< flat or hierarchical, zero threshold, layout check
};

/// Adapt slot, off: no noise-scale statistics; gain 1; the learning rate is `step_settings::lr`.
struct no_adascale {};

/// Adapt slot: the data-parallel gradient noise scale (McCandlish et al. 2018, appendix A.1)
/// measured from every synchronous step's gradient allreduce, and the AdaScale gain
/// (Johnson et al., ICML 2020) derived from it:
///
///     S = N · local_batch · accumulation_steps / base_batch        (AdaScale's scale, >= 1)
///     σ² = tr(Σ) / base_batch,  r = (σ² + |G|²) / (σ²/S + |G|²) ∈ [1, S]
///     lr_step = lr · r   (or lr · √r with sqrt_gain),   τ ← τ + r
///
/// S follows the batch: a hook that changes `step_settings::local_batch` changes S, and the
/// step reports it through `on_rescale`. With one rank no noise-scale sample exists (one batch
/// size cannot separate noise from signal), so r = 1.
///
/// | name       | type                         | default  | meaning                          |
/// |------------|------------------------------|----------|----------------------------------|
/// | base_batch | double                       | required | B_0 (examples, > 0)              |
/// | noise      | gradient_noise_scale_options | {}       | EMA smoothing of the estimates   |
/// | sqrt_gain  | bool                         | false    | lr factor √r (AdaptDL AdamScale) |
/// | scale_lr   | bool                         | true     | false: report r and τ, step at η |
struct adascale_policy {
  double base_batch = 0.0;                  ///< B_0 (> 0, required)
  gradient_noise_scale_options noise = {};  ///< smoothing of the noise-scale EMAs
  bool sqrt_gain = false;                   ///< lr factor √r instead of r
  bool scale_lr = true;                     ///< multiply the learning rate by the gain factor
};

/// Sync slot, off: every step combines gradients.
struct no_local_sgd {};

/// Sync slot: local SGD with a synchronous start (`gradapt::local_sgd`). Steps before
/// `options.start_step` combine gradients; later steps are local and the parameters are
/// averaged over the ranks when `schedule` says so (fixed_period, adaptive_period,
/// hierarchical_period). With `fixed_period`, a hook may change the period at run time through
/// `step_settings::period`. During local steps the noise scale is not updated and the AdaScale
/// gain is 1 (a local step is one base step).
template <averaging_schedule S>
struct local_sgd_policy {
  local_sgd_options options{};  ///< start_step, list check
  S schedule{};                 ///< when to average
};
/// Deduces the schedule type: `local_sgd_policy{{.start_step = 100}, gradapt::fixed_period({.period = 8})}`.
template <averaging_schedule S>
local_sgd_policy(local_sgd_options, S) -> local_sgd_policy<S>;

// ---- settings, metrics, hook events ------------------------------------------------------------

/// What a hook may change. Values must be equal on every rank (hooks run on every rank and see
/// the same metrics, so a deterministic hook keeps them equal). Changes made in `before_step`
/// apply to the step being taken; changes made in `after_step` or `on_overflow` apply from the
/// next step.
struct step_settings {
  /// Base learning rate η (finite, >= 0). The optimizer steps at η × the AdaScale factor; a
  /// schedule written for the base batch is followed by setting η = schedule(progress) in
  /// `before_step` (progress is AdaScale's τ, or the optimizer step count without AdaScale).
  double lr = 1e-3;
  /// Examples in one micro-batch on one rank (> 0). Read by the noise scale and by AdaScale's
  /// S; ignored without `adascale_policy`.
  double local_batch = 1.0;
  /// Micro-batches accumulated into one step's gradient (>= 1).
  int accumulation_steps = 1;
  /// LocalSGD period K (local steps between averaging rounds) when the sync slot holds a
  /// `local_sgd_policy<fixed_period>`; 0 otherwise. A hook that sets another value changes the
  /// period from the next round on.
  std::int64_t period = 0;
};

/// What one step did (passed to `after_step` and `on_overflow`; the previous step's metrics
/// are passed to `before_step`). Identical on every rank.
struct step_metrics {
  std::uint64_t step = 0;             ///< calls of step() so far, this one included (taken + skipped)
  std::uint64_t optimizer_steps = 0;  ///< steps the optimizer has taken (skipped steps excluded)
  double loss = std::numeric_limits<double>::quiet_NaN();  ///< the caller's loss (step_input::loss)
  double loss_scale = 1.0;  ///< loss scale for the NEXT backward pass (after this step's update)
  double noise_scale = std::numeric_limits<double>::quiet_NaN();  ///< B_simple; NaN while undefined
  double gain = 1.0;         ///< AdaScale gain r of this step (1 when off, skipped or local)
  double lr = 0.0;           ///< learning rate the optimizer used (0 on a skipped step)
  double progress = 0.0;     ///< τ after the step (optimizer steps without AdaScale)
  double scale = 1.0;        ///< AdaScale's S for this step (1 without AdaScale)
  bool found_inf = false;    ///< some rank's gradient was not finite: the step was skipped
  bool stepped = false;      ///< the optimizer stepped
  bool synchronous = false;  ///< the gradients were combined across ranks this step
  bool averaged = false;     ///< LocalSGD averaged the parameters after this step
};

/// The AdaScale scale changed (the batch changed): S went from `old_scale` to `new_scale`
/// before step `step` (1-based).
struct rescale_event {
  double old_scale = 1.0;  ///< S before the change
  double new_scale = 1.0;  ///< S from this step on
  std::uint64_t step = 0;  ///< the step (1-based) that runs at new_scale
};

/// Per-call input of `data_parallel_step::step`.
struct step_input {
  /// This rank's training loss of the step (reported in the metrics; required by LocalSGD's
  /// adaptive_period, which averages it over ranks). NaN when not given.
  double loss = std::numeric_limits<double>::quiet_NaN();
};

// ---- hook detection ---------------------------------------------------------------------------

/// `h.before_step(settings, last_metrics)`: before the step, after the previous step's metrics.
template <class H>
concept before_step_hook = requires(H& h, step_settings& s, const step_metrics& m) {
  h.before_step(s, m);
};
/// `h.after_step(settings, metrics)`: after every step, taken or skipped.
template <class H>
concept after_step_hook = requires(H& h, step_settings& s, const step_metrics& m) {
  h.after_step(s, m);
};
/// `h.on_overflow(settings, metrics)`: a step was skipped because a gradient was not finite
/// (before `after_step`; `metrics.loss_scale` is already backed off).
template <class H>
concept overflow_hook = requires(H& h, step_settings& s, const step_metrics& m) {
  h.on_overflow(s, m);
};
/// `h.on_rescale(settings, event)`: AdaScale's S changed because the batch changed.
template <class H>
concept rescale_hook = requires(H& h, step_settings& s, const rescale_event& e) {
  h.on_rescale(s, e);
};

/// A hook: an object (or a std::reference_wrapper to one) with at least one hook member.
template <class H>
concept step_hook =
    before_step_hook<std::unwrap_reference_t<H>> || after_step_hook<std::unwrap_reference_t<H>> ||
    overflow_hook<std::unwrap_reference_t<H>> || rescale_hook<std::unwrap_reference_t<H>>;

namespace detail {

using gradapt::detail::fail;
using gradapt::detail::message;
using gradapt::detail::require;

/// Which slot a value passed to the factory fills.
enum class slot : unsigned char { scaler, combine, adapt, sync, hook, none };

template <class T>
struct slot_of {
  static constexpr slot value = step_hook<T> ? slot::hook : slot::none;
};
template <>
struct slot_of<no_loss_scaling> {
  static constexpr slot value = slot::scaler;
};
template <>
struct slot_of<loss_scaler> {
  static constexpr slot value = slot::scaler;
};
template <>
struct slot_of<allreduce_mean> {
  static constexpr slot value = slot::combine;
};
template <>
struct slot_of<adasum_combine> {
  static constexpr slot value = slot::combine;
};
template <>
struct slot_of<no_adascale> {
  static constexpr slot value = slot::adapt;
};
template <>
struct slot_of<adascale_policy> {
  static constexpr slot value = slot::adapt;
};
template <>
struct slot_of<no_local_sgd> {
  static constexpr slot value = slot::sync;
};
template <class S>
struct slot_of<local_sgd_policy<S>> {
  static constexpr slot value = slot::sync;
};

template <class T>
inline constexpr slot slot_v = slot_of<std::remove_cvref_t<T>>::value;

}  // namespace detail
}  // namespace gradapt::train

#pragma once
/// @file
/// `train::make_data_parallel_step`: builds a `train::data_parallel_step` from an optimizer,
/// the settings, and policies and hooks in any order. Included by
/// gradapt/train/data_parallel_step.hpp (include that header).
#include <tuple>
#include <type_traits>
#include <utility>

#include "gradapt/train/data_parallel_step.hpp"

namespace gradapt::train {

/// Builds a `data_parallel_step` from an optimizer, the initial settings and any number of
/// policies and hooks, in any order: each policy fills its slot (at most one per slot; slots
/// left out are off), every other argument must be a hook (see `step_hook`).
///
///     auto step = gradapt::train::make_data_parallel_step(comm, backend, params, gradapt::sgd(),
///                                                         {.lr = 0.1});   // plain allreduce-mean SGD
///
/// Collective over `comm` (see data_parallel_step). `comm` and `params` must outlive the step.
template <communicator Comm, backend B, class PL, class Opt, class... Args>
auto make_data_parallel_step(Comm& comm, const B& backend, const PL& params, Opt optimizer,
                             step_settings settings, Args&&... args) {
  using detail::count_slot;
  using detail::slot;
  using detail::slot_v;
  static_assert(step_optimizer<Opt, B, PL>,
                "train::make_data_parallel_step: the fourth argument must be an optimizer with the chain "
                "interface (gradapt::sgd, adamw, lamb, lars, adafactor, sm3 or a gradapt::chain), "
                "e.g. gradapt::lamb({.lr = 1e-3}) rather than a gradapt::lamb_options");
  static_assert(
      (detail::at_most_one<slot::scaler, Args...>() && detail::at_most_one<slot::combine, Args...>() &&
       detail::at_most_one<slot::adapt, Args...>() && detail::at_most_one<slot::sync, Args...>() &&
       detail::at_most_one<slot::precondition, Args...>() && detail::at_most_one<slot::state, Args...>() &&
       detail::at_most_one<slot::reduce, Args...>()));
  static_assert(
      count_slot<slot::none, Args...> == 0,
      "train::make_data_parallel_step: an argument is neither a policy (no_loss_scaling, loss_scaler, "
      "allreduce_mean, adasum_combine, no_adascale, adascale_policy, no_local_sgd, local_sgd_policy, "
      "no_preconditioner, kfac_policy, replicated_state, zero_state, one_buffer_reduce, bucket_reduce, "
      "hierarchical_reduce, or a "
      "type declaring `static constexpr "
      "train::policy_slot slot`) "
      "nor a hook (an object with before_step, after_step, on_overflow or on_rescale)");
  auto scaler = detail::pick<slot::scaler, no_loss_scaling>(args...);
  auto combine = detail::pick<slot::combine, allreduce_mean>(args...);
  auto adapt = detail::pick<slot::adapt, no_adascale>(args...);
  auto sync = detail::pick<slot::sync, no_local_sgd>(args...);
  // Moved from an rvalue argument (a preconditioner may own move-only state, e.g. K-FAC's);
  // pick moves only the argument filling this slot, hook_tuple only the hooks.
  auto precond = detail::pick<slot::precondition, no_preconditioner>(std::forward<Args>(args)...);
  auto state = detail::pick<slot::state, replicated_state>(args...);
  auto reduce = detail::pick<slot::reduce, one_buffer_reduce>(args...);
  auto hooks = std::tuple_cat(detail::hook_tuple(std::forward<Args>(args))...);
  return data_parallel_step<Comm, B, PL, Opt, decltype(scaler), decltype(combine), decltype(adapt),
                            decltype(sync), decltype(hooks), decltype(precond), decltype(state),
                            decltype(reduce)>(comm, backend, params, std::move(optimizer), settings,
                                              std::move(scaler), std::move(combine), std::move(adapt),
                                              std::move(sync), std::move(hooks), std::move(precond),
                                              std::move(state), std::move(reduce));
}

}  // namespace gradapt::train

#pragma once
/// @file
/// How `train::data_parallel_step` is set up and kept consistent across ranks: its constructor
/// (the slots built, collectively), the construction and per-step agreements, the replica
/// check, the empty-shard check and the validation of the learning rate, the batch settings and
/// AdaScale's scale. Included by train/data_parallel_step.hpp, whose class declares these
/// members (not for direct inclusion).
#ifndef GRADAPT_TRAIN_STEP
#error \
    "gradapt/train/detail/step_setup.hpp is part of gradapt/train/data_parallel_step.hpp: include that header"
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/type_name.hpp"

namespace gradapt::train {

GRADAPT_TRAIN_STEP_TEMPLATE
GRADAPT_TRAIN_STEP::data_parallel_step(Comm& comm, const B& b, const PL& params, Opt opt,
                                       step_settings settings, Scaler scaler, Combine combine, Adapt adapt,
                                       Sync sync, Hooks hooks, Precond precond, StateP state, ReduceP reduce)
    : comm_(&comm),
      backend_(b),
      params_(&params),
      opt_(std::move(opt)),
      scaler_(std::move(scaler)),
      settings_(settings),
      hooks_(std::move(hooks)) {
  agree_on_construction(adapt, sync, precond);
  tensors_ = params.size();
  total_ = params.total_elements();
  if constexpr (has_sharded_state) {
    sharded_.emplace(opt_, state.sharding);
    state_.emplace(sharded_->init(comm, backend_, params));  // collective; agrees the options
    check_empty_shards(state);
  } else {
    (void)state;
    state_ = opt_.init(backend_, params);
  }
  if constexpr (has_buckets) {  // collective: the ranks agree on the plan and options
    std::vector<bucket::tensor_info> infos(params.size());
    std::vector<tensor_view<grad_type, typename B::space>> grads(params.grads().begin(),
                                                                 params.grads().end());
    for (std::size_t t = 0; t < infos.size(); ++t) infos[t] = {grads[t].size(), dtype_of_v<grad_type>};
    reducer_.emplace(comm, bucket::bucket_plan::make(infos, reduce.buckets), std::move(grads),
                     bucket::reducer_options{.average = true, .overlap = reduce.overlap}, backend_);
  } else if constexpr (has_hierarchy) {  // collective: agrees on the options, splits the world
    hier_.emplace(comm, reduce.hierarchy, backend_);
  } else {
    (void)reduce;
  }
  if constexpr (marks_gradients) marked_.assign(params.size(), 0);
  if constexpr (has_loss_scaling && on_device) flags_ = backend_.template allocate<float>(2);  // zeroed
  combiner_.emplace(bind_combiner(combine, comm, backend_, params));
  if constexpr (has_preconditioner) {
    // A mapping error on one rank is thrown on every rank (the others name that rank).
    std::string bad;
    try {
      pre_.emplace(std::move(precond).bind(comm, backend_, params));
    } catch (const error& e) {
      bad = e.what();
    }
    agree("train::data_parallel_step (binding the preconditioner)", std::span<const agreed_value>(), bad);
  } else {
    (void)precond;
  }
  if constexpr (has_adascale) {
    detail::require(std::isfinite(adapt.base_batch) && adapt.base_batch > 0.0,
                    "train::adascale_policy: base_batch is ", adapt.base_batch,
                    " (expected the positive number of examples the learning rate was tuned for)");
    adapt_.policy = adapt;
    check_batch("train::data_parallel_step");
    const double s0 = adascale_scale();
    check_scale(s0, "train::data_parallel_step");
    adapt_.gns = gradient_noise_scale(adapt.noise);
    adapt_.ada = adascale({.scale = s0, .sqrt_gain = adapt.sqrt_gain});
    last_.scale = s0;
  } else {
    (void)adapt;
  }
  if constexpr (has_local_sgd) {
    sync_.options = sync.options;
    sync_.schedule = sync.schedule;
    if constexpr (has_settable_period) {
      if (settings_.period == 0)
        settings_.period = sync.schedule.options().period;
      else
        sync_.schedule = with_period(settings_.period);
    }
    sync_.driver.emplace(comm, sync_.options, sync_.schedule);
  } else {
    (void)sync;
  }
  if constexpr (!has_settable_period)
    detail::require(settings_.period == 0, "train::data_parallel_step: step_settings::period is ",
                    settings_.period,
                    " but the sync slot holds no local_sgd_policy<fixed_period> (leave it 0)");
  check_lr("train::data_parallel_step");
  check_rank_batches("train::data_parallel_step");
  if constexpr (has_local_sgd) sync_.was_synchronous = settings_.synchronous;
  if constexpr (has_loss_scaling) last_.loss_scale = scaler_.scale();
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_empty_shards(const StateP& o) const {
  const auto& plan = state_->plan();
  std::string empty, bad;
  int count = 0;
  for (int r = 0; r < plan.world(); ++r)
    if (plan.pieces(r).empty()) {
      if (count < 8) empty += (count ? ", " : "") + std::to_string(r);
      ++count;
    }
  if (count != 0 && !o.allow_empty_shards)
    bad = detail::message("train::data_parallel_step: zero_state leaves ", count, " of ", plan.world(),
                          " ranks without elements (ranks ", empty, count > 8 ? ", ..." : "", ") for ",
                          total_, " elements in ", tensors_, " tensors at partition_options::alignment ",
                          o.sharding.partition.alignment,
                          ": lower the alignment (a chain without per-tensor or global sums takes any), use "
                          "fewer ranks, or set zero_state::allow_empty_shards");
  const agreed_value allow[] = {{"zero_state::allow_empty_shards", o.allow_empty_shards ? 1.0 : 0.0}};
  agree("train::data_parallel_step", std::span<const agreed_value>(allow), bad);
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_rank_batches(const char* fn) const {
  const auto& rb = settings_.rank_batches;
  if constexpr (marks_gradients)
    detail::require(
        rb.empty(), fn, ": step_settings::rank_batches is set but ",
        has_buckets ? "the reduce slot holds bucket_reduce" : "the state slot holds zero_state<2>",
        ", which reduces the gradients during the backward pass, before step() could weight "
        "them: reduce at step() (one_buffer_reduce, zero_state<1>) with per-rank batch sizes");
  detail::require(rb.empty() || rb.size() == static_cast<std::size_t>(comm_->size()), fn,
                  ": step_settings::rank_batches holds ", rb.size(), " batch sizes but the world has ",
                  comm_->size(), " ranks (one per rank in rank order, or empty for local_batch everywhere)");
  for (std::size_t r = 0; r < rb.size(); ++r)
    detail::require(std::isfinite(rb[r]) && rb[r] > 0.0, fn, ": step_settings::rank_batches[", r, "] is ",
                    rb[r], " (expected the positive number of examples in rank ", r, "'s micro-batch)");
  if constexpr (has_custom_combine)
    detail::require(rb.empty(), fn,
                    ": step_settings::rank_batches is set but the combine slot holds a combiner other than "
                    "allreduce_mean, which cannot weight the ranks by their batches (leave rank_batches "
                    "empty or combine with allreduce_mean)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_batch(const char* fn) const {
  check_rank_batches(fn);
  detail::require(settings_.accumulation_steps >= 1, fn, ": step_settings::accumulation_steps is ",
                  settings_.accumulation_steps, " (expected >= 1 micro-batches per step)");
  if (!settings_.rank_batches.empty()) return;
  detail::require(
      std::isfinite(settings_.local_batch) && settings_.local_batch > 0.0, fn,
      ": step_settings::local_batch is ", settings_.local_batch,
      " (expected the positive number of examples in one rank's micro-batch; set by the caller or a "
      "hook)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_lr(const char* fn) const {
  detail::require(std::isfinite(settings_.lr) && settings_.lr >= 0.0, fn, ": step_settings::lr is ",
                  settings_.lr, " (expected a finite learning rate >= 0; set by the caller or a hook)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_scale(double s, const char* fn) const {
  detail::require(std::isfinite(s) && s >= 1.0, fn, ": AdaScale's scale S = ranks ", comm_->size(),
                  " x local_batch ", settings_.local_batch, " x accumulation_steps ",
                  settings_.accumulation_steps, " / base_batch ", adapt_policy_base_batch(), " = ", s,
                  " is below 1 (expected the step's batch to be at least the base batch: lower base_batch or "
                  "raise the batch)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::apply_settings(std::uint64_t call) {
  constexpr const char* fn = "train::data_parallel_step::step";
  check_rank_batches(fn);
  if constexpr (has_adascale) {
    check_batch(fn);
    const double s = adascale_scale();
    if (s != adapt_.ada.scale()) {
      check_scale(s, fn);
      const rescale_event e{adapt_.ada.scale(), s, call};
      adapt_.ada.set_scale(s);
      notify<events::on_rescale>(hooks_, settings_, e);
    }
  }
  if constexpr (has_settable_period) {
    detail::require(settings_.period >= 1, fn, ": step_settings::period is ", settings_.period,
                    " (expected K >= 1 local steps between averaging rounds)");
    if (settings_.period != sync_.schedule.options().period) change_period(settings_.period);
  } else {
    detail::require(settings_.period == 0, fn, ": step_settings::period is ", settings_.period,
                    " but the sync slot holds no local_sgd_policy<fixed_period> (leave it 0)");
  }
  check_lr(fn);
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <class A, class Y, class P>
void GRADAPT_TRAIN_STEP::agree_on_construction(const A& adapt, const Y& sync, const P& precond) {
  // Up to 17 values of the step's own and the optimizer's (a Shampoo chain pushes 42).
  agreed_list<96> v;
  v.push("parameter tensors", static_cast<double>(params_->size()));
  v.push("parameter elements", static_cast<double>(params_->total_elements()));
  v.push("parameter shapes (a hash of every tensor's rank and extents)",
         detail::fingerprint(params_->grads()));
  v.push("loss scaling on", has_loss_scaling ? 1.0 : 0.0);
  v.push("adascale on", has_adascale ? 1.0 : 0.0);
  v.push("local sgd on", has_local_sgd ? 1.0 : 0.0);
  v.push("preconditioner on", has_preconditioner ? 1.0 : 0.0);
  v.push("state slot (0 replicated_state, 1 or 2 zero_state<stage>)", static_cast<double>(zero_stage));
  v.push("reduce slot (0 one_buffer_reduce, 1 bucket_reduce, 2 hierarchical_reduce)",
         has_buckets ? 1.0 : (has_hierarchy ? 2.0 : 0.0));
  v.push("step_settings::lr", settings_.lr);
  v.push("step_settings::local_batch", settings_.local_batch);
  v.push("step_settings::accumulation_steps", static_cast<double>(settings_.accumulation_steps));
  v.push("step_settings::period", static_cast<double>(settings_.period));
  if constexpr (has_adascale) {
    v.push("adascale_policy::base_batch", adapt.base_batch);
    v.push("adascale_policy::sqrt_gain", adapt.sqrt_gain ? 1.0 : 0.0);
    v.push("adascale_policy::scale_lr", adapt.scale_lr ? 1.0 : 0.0);
  }
  if constexpr (has_local_sgd)
    v.push("local_sgd_options::start_step", static_cast<double>(sync.options.start_step));
  if constexpr (requires { opt_.agreed_options(v); }) opt_.agreed_options(v);
  if constexpr (requires { precond.agreed_options(v); }) precond.agreed_options(v);
  // First the step's structure, in a fixed number of values: ranks that built other slots or
  // another optimizer would otherwise pass lists of other lengths to the agreement below.
  agreed_list<12> head;
  head.push("scaler slot (1: loss scaling on)", has_loss_scaling ? 1.0 : 0.0);
  head.push("adapt slot (1: adascale_policy on)", has_adascale ? 1.0 : 0.0);
  head.push("sync slot (1: local_sgd_policy on)", has_local_sgd ? 1.0 : 0.0);
  head.push("precondition slot (1: a preconditioner on)", has_preconditioner ? 1.0 : 0.0);
  head.push("state slot (0 replicated_state, 1 or 2 zero_state<stage>)", static_cast<double>(zero_stage));
  head.push("reduce slot (0 one_buffer_reduce, 1 bucket_reduce, 2 hierarchical_reduce)",
            has_buckets ? 1.0 : (has_hierarchy ? 2.0 : 0.0));
  head.push(structure_name<Opt>("the optimizer"),
            gradapt::detail::operation_tag(gradapt::detail::type_name<Opt>()));
  head.push(structure_name<Combine>("the combine slot"),
            gradapt::detail::operation_tag(gradapt::detail::type_name<Combine>()));
  head.push(structure_name<P>("the precondition slot"),
            gradapt::detail::operation_tag(gradapt::detail::type_name<P>()));
  head.push("options agreed at construction (count)", static_cast<double>(v.count));
  agree("train::data_parallel_step (slots and optimizer)", head.view());
  agree("train::data_parallel_step", v.view());
  detail::require(params_->size() > 0, "train::data_parallel_step on rank ", comm_->rank(),
                  ": the parameter list is empty (add the model's parameters before building the step)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::agree_on_step(std::uint64_t call, double eta, double ready, double busy, double loss,
                                       const std::string& bad) {
  agreed_list<12> v;
  v.push("step", static_cast<double>(call));
  v.push("learning rate (step_args::lr or step_settings::lr)", bad.empty() ? eta : 0.0);
  v.push("step_settings::local_batch", settings_.local_batch);
  v.push("step_settings::accumulation_steps", static_cast<double>(settings_.accumulation_steps));
  v.push("step_settings::period", static_cast<double>(settings_.period));
  v.push("step_settings::synchronous", settings_.synchronous ? 1.0 : 0.0);
  v.push("step_settings::rank_batches (count)", static_cast<double>(settings_.rank_batches.size()));
  v.push("step_settings::rank_batches (a 52-bit hash of the values)",
         static_cast<double>(gradapt::detail::hash_bytes(0x9E3779B97F4A7C15ull, settings_.rank_batches.data(),
                                                         settings_.rank_batches.size()) >>
                             12));
  v.push("step_args::ready_seconds given (1) or not (0)", ready >= 0.0 ? 1.0 : 0.0);
  if constexpr (has_adascale) v.push("AdaScale scale", adapt_.ada.scale());
  if constexpr (has_loss_scaling) v.push("loss scale", scaler_.scale());
  // Shared per rank: time-to-ready, time in the previous step, and the loss as a class (0
  // finite, 1 NaN, 2 +inf, 3 -inf) and its finite value, so the metrics' loss is the ranks' mean.
  const double loss_class = std::isnan(loss) ? 1.0 : (std::isinf(loss) ? (loss > 0.0 ? 2.0 : 3.0) : 0.0);
  const double mine[4] = {ready, busy, loss_class, loss_class == 0.0 ? loss : 0.0};
  constexpr std::size_t k = 4;
  shared_.resize(k * static_cast<std::size_t>(comm_->size()));
  agree_values_and_share(*comm_, backend_, "train::data_parallel_step::step", v.view(),
                         std::span<const double>(mine), std::span<double>(shared_), bad, &agree_ws_);
  const auto n = static_cast<std::size_t>(comm_->size());
  rank_times_.clear();
  rank_busy_.clear();
  bool all_busy = true;
  for (std::size_t r = 0; r < n; ++r) all_busy = all_busy && shared_[k * r + 1] >= 0.0;
  for (std::size_t r = 0; r < n && ready >= 0.0; ++r) rank_times_.push_back(shared_[k * r]);
  for (std::size_t r = 0; r < n && all_busy; ++r) rank_busy_.push_back(shared_[k * r + 1]);
  double sum = 0.0;
  for (std::size_t r = 0; r < n; ++r) {
    const double c = shared_[k * r + 2];
    sum += c == 0.0
               ? shared_[k * r + 3]
               : (c == 1.0 ? std::numeric_limits<double>::quiet_NaN() : (c == 2.0 ? HUGE_VAL : -HUGE_VAL));
  }
  mean_loss_ = sum / static_cast<double>(n);
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::check_replicas(const step_metrics& m) {
  if (replica_every_ == 0 || !(m.synchronous || m.averaged)) return;
  if (replica_checks_++ % replica_every_ != 0) return;
  const double sum = backend_.reduce(reduction::sum, params_->values(), std::span<double>());
  const agreed_value replicas[] = {
      {"the sum of the parameters after the step (the replicas differ: optimizer options, a hook or the "
       "combiner differ across ranks)",
       sum}};
  agree("train::data_parallel_step replica check", std::span<const agreed_value>(replicas));
}

}  // namespace gradapt::train

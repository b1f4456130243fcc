#pragma once
/// @file
/// How `train::data_parallel_step` moves the gradients across the ranks: the weights of
/// heterogeneous batches, the completion of the buckets marked during the backward pass, the
/// sharded optimizer's reduction (ZeRO), the combine slot's one-buffer reduction and the
/// hierarchical one (`hierarchical_reduce`), each with the noise scale's inputs when AdaScale is
/// on. Included by train/data_parallel_step.hpp, whose class declares these members (not for
/// direct inclusion).
#ifndef GRADAPT_TRAIN_STEP
#error \
    "gradapt/train/detail/step_reduce.hpp is part of gradapt/train/data_parallel_step.hpp: include that header"
#endif
#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::train {

GRADAPT_TRAIN_STEP_TEMPLATE
auto GRADAPT_TRAIN_STEP::weight_for_mean() -> weights {
  const int n = comm_->size();
  weights w;
  w.weighted = !settings_.rank_batches.empty() && n > 1;
  if (w.weighted) {
    const double sum = micro_batch_sum();
    for (const double b : settings_.rank_batches) {
      const double c = static_cast<double>(n) * b / sum;
      w.c2 += c * c;
      w.e2 += b * b;
    }
    const double mine =
        static_cast<double>(n) * settings_.rank_batches[static_cast<std::size_t>(comm_->rank())] / sum;
    if (mine != 1.0) backend_.apply_list(gradapt::detail::multiply_by{mine}, params_->grads());
  }
  return w;
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::forward_mark(std::size_t t) {
  marked_[t] = 1;
  if constexpr (has_buckets)
    reducer_->mark_ready(t);
  else
    sharded_->mark_ready(*comm_, backend_, *params_, *state_, t);
  ++marks_;
}

GRADAPT_TRAIN_STEP_TEMPLATE
std::string GRADAPT_TRAIN_STEP::complete_marks() {
  std::string e = std::move(mark_error_);
  mark_error_.clear();
  if (marks_ == tensors_) return e;
  std::size_t first = 0;
  while (marked_[first] != 0) ++first;
  if (e.empty())
    e = detail::message(
        "train::data_parallel_step::step on rank ", comm_->rank(), ": ", marks_, " of ", tensors_,
        " gradients were marked ready before step(), the first missing being gradient ", first, " ('",
        (*params_)[first].name, "') (", has_buckets ? "bucket_reduce" : "zero_state<2>",
        " needs mark_ready(t) for every gradient in every step)");
  for (std::size_t t = first; t < tensors_; ++t)
    if (marked_[t] == 0) forward_mark(t);
  return e;
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::abandon_round() {
  if constexpr (has_buckets)
    reducer_->wait();
  else
    sharded_->discard_round(*state_);
  std::fill(marked_.begin(), marked_.end(), char{0});
  marks_ = 0;
  nonfinite_ = 0.0;
  if constexpr (has_loss_scaling && on_device) clear_flag();
  local_sq_ = 0.0;
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::reduce_buckets() {
  reducer_->wait();
  std::fill(marked_.begin(), marked_.end(), char{0});
  marks_ = 0;
  if constexpr (has_adascale) {
    const int n = comm_->size();
    double local = local_sq_;
    local_sq_ = 0.0;
    if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
    const double global = backend_.reduce(reduction::sum_squares, params_->grads(), std::span<double>());
    sum_over_ranks(std::span<double>(&local, 1));
    adapt_.gns.update_reduced(local / static_cast<double>(n), global, n,
                              noise_batch{.micro_batch = settings_.local_batch,
                                          .accumulation_steps = settings_.accumulation_steps,
                                          .loss_scale = 1.0});
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::reduce_sharded() {
  std::fill(marked_.begin(), marked_.end(), char{0});
  marks_ = 0;
  [[maybe_unused]] const weights w = zero_stage == 1 ? weight_for_mean() : weights{};
  if constexpr (has_adascale) {
    const int n = comm_->size();
    if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
    double local = local_sq_;
    if constexpr (zero_stage == 1)
      local = backend_.reduce(reduction::sum_squares, params_->grads(), std::span<double>());
    local_sq_ = 0.0;
    sharded_->reduce(*comm_, backend_, *params_, *state_);
    double sums[2] = {local, sharded_->gradient_sum_squares(backend_, *state_)};
    sum_over_ranks(std::span<double>(sums, 2));
    if (w.weighted) {
      const double acc = static_cast<double>(settings_.accumulation_steps);
      adapt_.gns.update(sums[0] / w.c2, acc * w.e2 / micro_batch_sum(), sums[1], global_batch());
    } else {
      adapt_.gns.update_reduced(sums[0] / static_cast<double>(n), sums[1], n,
                                noise_batch{.micro_batch = settings_.local_batch,
                                            .accumulation_steps = settings_.accumulation_steps,
                                            .loss_scale = 1.0});
    }
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::combine() {
  const int n = comm_->size();
  [[maybe_unused]] const auto [weighted, c2, e2] = weight_for_mean();
  if constexpr (has_adascale) {
    if (n == 1) return;  // the mean of one rank is its gradient; no noise-scale sample
    allreduce_norms norms{};
    if constexpr (has_hierarchy)
      norms = hierarchical_mean<true>();
    else
      norms = combiner_->combine_mean_with_norms(*comm_, backend_, params_->grads());
    if (weighted) {
      const double acc = static_cast<double>(settings_.accumulation_steps);
      const double p = static_cast<double>(n);
      adapt_.gns.update(norms.sum_local_sq / c2, acc * e2 / micro_batch_sum(), norms.result_sq / (p * p),
                        global_batch());
    } else {
      adapt_.gns.update(norms, n,
                        noise_batch{.micro_batch = settings_.local_batch,
                                    .accumulation_steps = settings_.accumulation_steps,
                                    .loss_scale = 1.0});
    }
  } else if constexpr (has_hierarchy) {
    (void)hierarchical_mean<false>();
  } else {
    combiner_->combine(*comm_, backend_, params_->grads());
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <bool Norms>
allreduce_norms GRADAPT_TRAIN_STEP::hierarchical_mean() {
  allreduce_norms norms{0.0, 0.0};
  const int n = comm_->size();
  if (n == 1) return norms;
  const auto grads = params_->grads();
  if constexpr (Norms)
    norms.sum_local_sq = backend_.reduce(reduction::sum_squares, grads, std::span<double>());
  for (const auto& g : grads) hier_->allreduce(g, reduce_op::sum);
  if constexpr (Norms) {
    norms.result_sq = backend_.reduce(reduction::sum_squares, grads, std::span<double>());
    sum_over_ranks(std::span<double>(&norms.sum_local_sq, 1));
  }
  backend_.apply_list(gradapt::detail::divide_by_ranks{n}, grads);
  return norms;
}

}  // namespace gradapt::train

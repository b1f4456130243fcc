#pragma once
/// @file
/// `gradapt::bucket::reducer`: the gradients of a parameter list averaged (or summed) across
/// ranks through the buckets of a `bucket_plan`, driven by `mark_ready` as the framework's
/// backward pass produces each gradient (PyTorch DDP's Reducer, Horovod's fusion buffer).
///
/// A bucket is reduced once all its gradients are ready, and buckets are reduced strictly in
/// plan order on every rank: when bucket 3 completes before bucket 2, it waits until bucket 2
/// has been reduced. So ranks whose gradients become ready in different orders still enter the
/// same collectives in the same order, and never wait in different ones. Each reduction packs
/// the bucket's gradients into its fused buffer, runs one `allreduce(sum)` of it and writes
/// the result back (times 1/N when averaging). `wait()` reduces what is left and ends the
/// round; every gradient must have been marked ready by then.
///
/// The result is element-wise the communicator's sum of the same elements: on `comm::threads`
/// (rank order, one rounding) it is bitwise the per-tensor `allreduce` whatever the buckets;
/// MPI's summation order may depend on the message size, so with three or more ranks a bucket
/// may round differently from a per-tensor allreduce. Collectives here are blocking: a bucket
/// is reduced inside the `mark_ready` call that completes it (or a later one, in plan order).
///
/// Construction is collective: one small allreduce (`gradapt::agree_values`) checks that every
/// rank built the same plan (bucket count, elements, a layout fingerprint) and options, so a
/// rank with another plan throws on every rank instead of mixing buckets.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/bucket/plan.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::bucket {

/// Options of a reducer.
struct reducer_options {
  /// Divide the sum by the world size (the data-parallel mean). Default true.
  bool average = true;
};

/// Reduces the gradients `grads` (host views of element type T, in registration order) across
/// the ranks of `comm` through `plan` (see the file comment).
template <class Comm, class T>
requires communicator<Comm> && std::same_as<typename Comm::space, host_space> && element<T>
class reducer {
 public:
  /// Builds the fused buffers of `plan` for `grads`. Collective (one small allreduce).
  /// @throws gradapt::error on every rank when a rank's plan or options differ; on this rank
  ///         when `grads` does not match the plan (count, sizes, element type)
  reducer(Comm& comm, bucket_plan plan, std::vector<tensor_view<T, host_space>> grads,
          const reducer_options& o = {})
      : comm_(&comm), plan_(std::move(plan)), grads_(std::move(grads)), opt_(o) {
    std::string bad;
    if (grads_.size() != plan_.tensors())
      bad = error_text("the plan has ", plan_.tensors(), " tensors but ", grads_.size(),
                       " gradients were given");
    for (std::size_t t = 0; bad.empty() && t < grads_.size(); ++t) {
      const auto& k = plan_.buckets()[plan_.where(t).bucket];
      const std::size_t at = plan_.where(t).offset;
      const std::size_t i = index_in(k, t);
      const std::size_t n = (i + 1 < k.tensors.size() ? k.offsets[i + 1] : k.elements) - at;
      if (grads_[t].size() != n)
        bad = error_text("gradient ", t, " has ", grads_[t].size(), " elements but the plan gives it ", n);
      else if (k.type != dtype_of_v<T>)
        bad = error_text("gradient ", t, " is ", name(dtype_of_v<T>), " but its bucket is ", name(k.type));
    }
    std::uint64_t h = 1469598103ULL;
    for (const auto& k : plan_.buckets())
      for (std::size_t i = 0; i < k.tensors.size(); ++i)
        h = (h * 1099511ULL + k.tensors[i] * 7919ULL + k.offsets[i]) % (std::uint64_t{1} << 50);
    agree_values(comm, "bucket::reducer",
                 {{"buckets", static_cast<double>(plan_.buckets().size())},
                  {"tensors", static_cast<double>(plan_.tensors())},
                  {"bucket layout (fingerprint)", static_cast<double>(h)},
                  {"reducer_options::average", opt_.average ? 1.0 : 0.0}},
                 bad);
    fused_.resize(plan_.buckets().size());
    missing_.resize(plan_.buckets().size());
    for (std::size_t b = 0; b < fused_.size(); ++b) fused_[b].resize(plan_.buckets()[b].elements);
    ready_.assign(grads_.size(), 0);
    start_round();
  }

  /// Marks gradient t ready; reduces every bucket that is complete and next in plan order.
  /// @throws gradapt::error when t is out of range or already marked in this round
  void mark_ready(std::size_t t) {
    gradapt::detail::require(t < grads_.size(), "bucket::reducer::mark_ready on rank ", comm_->rank(),
                             ": gradient ", t, " is out of range (", grads_.size(), " gradients)");
    gradapt::detail::require(ready_[t] == 0, "bucket::reducer::mark_ready on rank ", comm_->rank(),
                             ": gradient ", t,
                             " is already marked ready in this round (call wait() to end the round)");
    ready_[t] = 1;
    --missing_[plan_.where(t).bucket];
    while (next_ < fused_.size() && missing_[next_] == 0) reduce(next_++);
  }

  /// Ends the round: reduces the buckets that are left (in plan order) and starts a new round.
  /// @throws gradapt::error naming the first gradient not marked ready (this rank only; the
  ///         others then wait in that bucket's collective until the communicator's watchdog)
  void wait() {
    for (std::size_t t = 0; t < ready_.size(); ++t)
      gradapt::detail::require(ready_[t] != 0, "bucket::reducer::wait on rank ", comm_->rank(), ": gradient ",
                               t,
                               " was not marked ready in this round (mark every gradient before the step)");
    while (next_ < fused_.size()) reduce(next_++);
    start_round();
  }

  /// Buckets reduced so far in this round.
  [[nodiscard]] std::size_t reduced() const noexcept { return next_; }
  /// The plan.
  [[nodiscard]] const bucket_plan& plan() const noexcept { return plan_; }

 private:
  template <class... A>
  std::string error_text(A&&... a) const {
    return gradapt::detail::message("bucket::reducer on rank ", comm_->rank(), ": ", std::forward<A>(a)...);
  }
  static std::size_t index_in(const bucket& k, std::size_t t) {
    for (std::size_t i = 0; i < k.tensors.size(); ++i)
      if (k.tensors[i] == t) return i;
    return k.tensors.size();
  }
  void start_round() {
    next_ = 0;
    for (std::size_t b = 0; b < fused_.size(); ++b) missing_[b] = plan_.buckets()[b].tensors.size();
    std::fill(ready_.begin(), ready_.end(), char{0});
    while (next_ < fused_.size() && missing_[next_] == 0) ++next_;  // (no empty buckets exist)
  }
  void reduce(std::size_t b) {
    const auto& k = plan_.buckets()[b];
    auto& f = fused_[b];
    for (std::size_t i = 0; i < k.tensors.size(); ++i) {
      const auto& g = grads_[k.tensors[i]];
      std::copy_n(g.data(), g.size(), f.data() + k.offsets[i]);
    }
    comm_->allreduce(host_view(f), reduce_op::sum);
    using C = compute_t<T>;
    const auto n = static_cast<C>(comm_->size());
    for (std::size_t i = 0; i < k.tensors.size(); ++i) {
      auto& g = grads_[k.tensors[i]];
      const T* src = f.data() + k.offsets[i];
      if (opt_.average)  // as the train step's allreduce_mean: g / n in the compute type
        for (std::size_t j = 0; j < g.size(); ++j) g.data()[j] = static_cast<T>(static_cast<C>(src[j]) / n);
      else
        std::copy_n(src, g.size(), g.data());
    }
  }

  Comm* comm_;
  bucket_plan plan_;
  std::vector<tensor_view<T, host_space>> grads_;
  reducer_options opt_;
  std::vector<std::vector<T>> fused_;
  std::vector<std::size_t> missing_;
  std::vector<char> ready_;
  std::size_t next_ = 0;
};

}  // namespace gradapt::bucket

#pragma once
/// @file
/// `gradapt::bucket::reducer`: the gradients of a parameter list averaged (or summed) across
/// ranks through the buckets of a `bucket_plan`, driven by `mark_ready` as the framework's
/// backward pass produces each gradient (PyTorch DDP's Reducer, Horovod's fusion buffer).
///
/// A bucket is started once all its gradients are ready, and buckets are started strictly in
/// plan order on every rank: when bucket 3 completes before bucket 2, it waits until bucket 2
/// has been started. So ranks whose gradients become ready in different orders still enter
/// the same collectives in the same order, and never wait in different ones. Each bucket's
/// gradients are packed into its fused buffer and summed by one allreduce of it; the result
/// is written back (g / N in the compute type when averaging). A bucket whose gradients
/// already lie in memory in its layout (one buffer, each gradient at its offset: allocate them
/// in a `bucket::storage`, as DDP's `gradient_as_bucket_view` does) is reduced in place: no
/// fused buffer, no copies, the mean formed in place. `wait()` starts what is left,
/// completes every bucket in plan order and ends the round; every gradient must have been
/// marked ready by then.
///
/// Two paths, one result per communicator:
/// - **Overlapping** (a `nonblocking_allreduce_communicator` such as `comm::mpi`, with
///   `reducer_options::overlap`, the default): `mark_ready` starts each complete bucket with
///   `iallreduce` and returns at once, so the collectives run while the backward pass goes on.
///   Every `mark_ready` (and `progress()`) also tests the requests in flight, because MPI
///   libraries such as Open MPI move non-blocking collectives only inside MPI calls, and
///   writes back each leading bucket whose collective has completed; `wait()` waits the rest
///   in plan order and writes them back. The last bucket in plan order can start only once
///   every gradient is ready, when there is nothing left to overlap it with: it takes the
///   blocking `allreduce` inside the call that starts it.
/// - **Blocking** (`comm::single`, `comm::threads`, or `overlap = false`): a bucket is
///   reduced and written back inside the `mark_ready` call that completes it (or a later one,
///   in plan order). On a `mean_allreduce_communicator` (`comm::threads`) an averaging bucket
///   is one `allreduce_mean`, which divides as it reduces.
///
/// The result is element-wise the communicator's sum of the same elements: on `comm::threads`
/// (rank order, one rounding) it is bitwise the per-tensor `allreduce` whatever the buckets.
/// MPI's summation order may depend on the message size and on the collective (blocking or
/// non-blocking), so with three or more ranks a bucket may round differently from a
/// per-tensor `allreduce`; exactly representable sums (integer-valued data) agree bit for bit
/// on every path.
///
/// Construction is collective: one small allreduce (`gradapt::agree_values`) checks that every
/// rank built the same plan (bucket count, elements, a layout fingerprint) and options, so a
/// rank with another plan throws on every rank instead of mixing buckets. The per-bucket
/// collectives follow from that agreed plan; on MPI each non-blocking one still carries its
/// own fingerprint (see `comm::mpi::iallreduce`).
///
/// Device memory (`comm::nccl` with the CUDA backend as `B`): the fused buffers come from the
/// backend (`allocate`), the packing copies and the mean are backend element operations and
/// the agreement travels through a backend buffer. NCCL's collectives are enqueued on the
/// communicator's stream and return at once, so each bucket's allreduce is ordered after the
/// gradients written before `mark_ready` on that stream and runs while the host goes on
/// (the blocking path above, without a host wait). With `nccl_options::producer` set to the
/// framework's backward stream (a `stream_ordered_communicator`), each bucket's packing and
/// allreduce run on the communicator's stream (the backend's must be the same) after an event
/// of the producer's work so far, beside the rest of the backward pass, and `wait()` makes the
/// producer wait for them on the device before it returns.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/bucket/plan.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::bucket {

/// Options of a reducer.
struct reducer_options {
  /// Divide the sum by the world size (the data-parallel mean). Default true.
  bool average = true;
  /// With a communicator that has a non-blocking allreduce
  /// (`nonblocking_allreduce_communicator`), start each bucket without waiting so that its
  /// collective overlaps the rest of the backward pass, and complete the buckets in `wait()`.
  /// False reduces each bucket with the blocking `allreduce` inside `mark_ready`. Ignored by
  /// communicators without a non-blocking allreduce. Default true.
  bool overlap = true;
};

namespace detail {
/// The request type of `Comm`'s non-blocking allreduce on T (an empty tag when it has none).
template <class Comm, class T>
struct request_of {
  struct none {};
  using type = none;
};
template <class Comm, class T>
requires nonblocking_allreduce_communicator<Comm>
struct request_of<Comm, T> {
  using type = decltype(std::declval<Comm&>().iallreduce(std::declval<tensor_view<T, typename Comm::space>>(),
                                                         reduce_op::sum));
};
}  // namespace detail

/// Reduces the gradients `grads` (views of element type T in the communicator's memory, in
/// registration order) across the ranks of `comm` through `plan` (see the file comment). `B`
/// is the backend of that memory (gradapt::host, or the CUDA backend with comm::nccl).
template <class Comm, class T, class B = host>
requires communicator<Comm> && element<T> && std::same_as<typename Comm::space, typename B::space>
class reducer {
 public:
  /// The memory space of the gradients and buffers.
  using space = typename Comm::space;

  /// Builds the fused buffers of `plan` for `grads`. Collective (one small allreduce).
  /// @throws gradapt::error on every rank when a rank's plan or options differ; on this rank
  ///         when `grads` does not match the plan (count, sizes, element type)
  reducer(Comm& comm, bucket_plan plan, std::vector<tensor_view<T, space>> grads,
          const reducer_options& o = {}, const B& backend = B{})
      : comm_(&comm), backend_(backend), plan_(std::move(plan)), grads_(std::move(grads)), opt_(o) {
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
    const agreed_value agreed[] = {{"buckets", static_cast<double>(plan_.buckets().size())},
                                   {"tensors", static_cast<double>(plan_.tensors())},
                                   {"bucket layout (fingerprint)", static_cast<double>(h)},
                                   {"reducer_options::average", opt_.average ? 1.0 : 0.0},
                                   {"reducer_options::overlap", opt_.overlap ? 1.0 : 0.0}};
    agree_values(comm, backend_, "bucket::reducer", std::span<const agreed_value>(agreed), bad);
    fused_.resize(plan_.buckets().size());
    in_place_.assign(plan_.buckets().size(), 0);
    if constexpr (can_overlap) requests_.resize(plan_.buckets().size());
    missing_.resize(plan_.buckets().size());
    for (std::size_t b = 0; b < fused_.size(); ++b) {
      const auto& k = plan_.buckets()[b];
      const T* first = grads_[k.tensors[0]].data();
      bool contiguous = k.offsets[0] == 0;
      for (std::size_t i = 1; contiguous && i < k.tensors.size(); ++i)
        contiguous = grads_[k.tensors[i]].data() == first + k.offsets[i];
      in_place_[b] = contiguous ? 1 : 0;
      if (!contiguous) fused_[b] = backend_.template allocate<T>(k.elements);
    }
    ready_.assign(grads_.size(), 0);
    start_round();
  }

  /// Marks gradient t ready; starts every bucket that is complete and next in plan order
  /// (overlapping path: without waiting for it; blocking path: reduced and written back here),
  /// then lets the collectives in flight advance (`progress()`).
  /// @throws gradapt::error when t is out of range or already marked in this round, or when
  ///         the communicator fails
  void mark_ready(std::size_t t) {
    gradapt::detail::require(t < grads_.size(), "bucket::reducer::mark_ready on rank ", comm_->rank(),
                             ": gradient ", t, " is out of range (", grads_.size(), " gradients)");
    gradapt::detail::require(ready_[t] == 0, "bucket::reducer::mark_ready on rank ", comm_->rank(),
                             ": gradient ", t,
                             " is already marked ready in this round (call wait() to end the round)");
    ready_[t] = 1;
    --missing_[plan_.where(t).bucket];
    while (next_ < fused_.size() && missing_[next_] == 0) start(next_++);
    progress();
  }

  /// Lets the collectives in flight advance without waiting, and writes back every leading
  /// bucket whose collective has completed (tests the outstanding requests in plan order; a
  /// no-op on the blocking path). `mark_ready` calls it; a framework may also call it while
  /// it waits for its device between gradients.
  /// @throws gradapt::error when a bucket's collective failed (e.g. the ranks' calls differed)
  void progress() {
    if constexpr (can_overlap)
      if (opt_.overlap)
        while (done_ < next_ && requests_[done_].test()) unpack(done_++);
  }

  /// Ends the round: starts the buckets that are left (in plan order), completes every bucket
  /// in plan order, writes the results back and starts a new round.
  /// @throws gradapt::error naming the first gradient not marked ready (this rank only; the
  ///         others then wait in that bucket's collective until the communicator's watchdog),
  ///         or when a bucket's collective failed (the round is then abandoned: the requests
  ///         in flight are completed and discarded, and a new round starts)
  void wait() {
    for (std::size_t t = 0; t < ready_.size(); ++t)
      gradapt::detail::require(ready_[t] != 0, "bucket::reducer::wait on rank ", comm_->rank(), ": gradient ",
                               t,
                               " was not marked ready in this round (mark every gradient before the step)");
    if constexpr (can_overlap) {
      try {
        while (next_ < fused_.size()) start(next_++);
        if (opt_.overlap)
          for (; done_ < fused_.size(); ++done_) {
            requests_[done_].wait();
            unpack(done_);
          }
      } catch (...) {
        for (auto& r : requests_) r = request_type{};  // completes and discards what is in flight
        start_round();
        throw;
      }
    } else {
      while (next_ < fused_.size()) start(next_++);
    }
    // The producer's later work (the framework's optimizer step, its next forward) reads the
    // averaged gradients.
    if constexpr (stream_ordered_communicator<Comm>) comm_->join_producer();
    start_round();
  }

  /// Buckets started so far in this round (blocking path: reduced and written back;
  /// overlapping path: collectives started, written back by `wait()`).
  [[nodiscard]] std::size_t started() const noexcept { return next_; }
  /// Same as `started()` (the name of the blocking path).
  [[nodiscard]] std::size_t reduced() const noexcept { return next_; }
  /// True when buckets are started without waiting (the communicator has a non-blocking
  /// allreduce and `reducer_options::overlap` is set).
  [[nodiscard]] bool overlap() const noexcept { return can_overlap && opt_.overlap; }
  /// The plan.
  [[nodiscard]] const bucket_plan& plan() const noexcept { return plan_; }
  /// Whether bucket b is reduced in place (its gradients lie in one buffer in its layout, e.g.
  /// in a `bucket::storage`): no fused buffer and no copies.
  /// @throws gradapt::error when b is out of range
  [[nodiscard]] bool in_place(std::size_t b) const {
    gradapt::detail::require(b < in_place_.size(), "bucket::reducer::in_place: bucket ", b, " of ",
                             in_place_.size());
    return in_place_[b] != 0;
  }
  /// Elements held in fused buffers (0 when every bucket is reduced in place).
  [[nodiscard]] std::size_t fused_elements() const noexcept {
    std::size_t n = 0;
    for (const auto& f : fused_) n += f.size();
    return n;
  }

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
    done_ = 0;
    for (std::size_t b = 0; b < fused_.size(); ++b) missing_[b] = plan_.buckets()[b].tensors.size();
    std::fill(ready_.begin(), ready_.end(), char{0});
    while (next_ < fused_.size() && missing_[next_] == 0) ++next_;  // (no empty buckets exist)
  }
  /// Packs bucket b into its fused buffer and starts (or, blocking, runs) its allreduce.
  void start(std::size_t b) {
    if constexpr (can_overlap) requests_[b] = request_type{};  // an abandoned round's, completed first
    // The packing below reads gradients the framework wrote on its producer stream.
    if constexpr (stream_ordered_communicator<Comm>) comm_->after_producer();
    const auto buf = buffer(b);
    if (!in_place_[b]) {
      const auto& k = plan_.buckets()[b];
      for (std::size_t i = 0; i < k.tensors.size(); ++i) {
        const auto& g = grads_[k.tensors[i]];
        if constexpr (on_host)
          std::copy_n(g.data(), g.size(), buf.data() + k.offsets[i]);
        else
          backend_.apply(
              gradapt::detail::copy_to{},
              tensor_view<T, space>::vector(buf.data() + k.offsets[i], static_cast<std::int64_t>(g.size())),
              tensor_view<const T, space>(g));
      }
    }
    if constexpr (can_overlap)
      if (opt_.overlap) {
        if (b + 1 < fused_.size()) {
          requests_[b] = comm_->iallreduce(buf, reduce_op::sum);
          return;
        }
        // The last bucket starts when every gradient is ready: nothing is left to overlap it
        // with, so it takes the blocking allreduce (the MPI library's tuned algorithm, which
        // can be twice as fast as its non-blocking one). Its request stays empty (complete),
        // so it is written back in plan order after the buckets still in flight.
        comm_->allreduce(buf, reduce_op::sum);
        return;
      }
    if constexpr (mean_allreduce_communicator<Comm>)
      if (opt_.average) {  // the division inside the collective: the same bits, one pass less
        comm_->allreduce_mean(buf);
        unpack(b, false);
        return;
      }
    comm_->allreduce(buf, reduce_op::sum);
    unpack(b);
  }
  /// Bucket b's collective buffer: the gradients' own memory in place, else its fused buffer.
  tensor_view<T, space> buffer(std::size_t b) {
    const auto n = static_cast<std::int64_t>(plan_.buckets()[b].elements);
    if (in_place_[b]) return tensor_view<T, space>::vector(grads_[plan_.buckets()[b].tensors[0]].data(), n);
    return tensor_view<T, space>::vector(fused_[b].data(), n);
  }
  /// Writes bucket b's result back into its gradients, divided by N when averaging and
  /// `divide` (false: the collective has divided already). The division is
  /// detail::divide_by_ranks through the backend's element loop (on the host one thread,
  /// vectorised at plain -O2), as the train step's allreduce_mean divides, so the bits are the
  /// same.
  void unpack(std::size_t b, bool divide = true) {
    const auto& k = plan_.buckets()[b];
    const bool average = opt_.average && divide;
    const auto one = [&] {
      if constexpr (on_host)
        return host{.threads = 1};  // a rank's own thread: the reducer runs inside a rank
      else
        return backend_;
    }();
    const gradapt::detail::divide_by_ranks mean{comm_->size()};
    if (in_place_[b]) {
      if (average) one.apply(mean, buffer(b));
      return;
    }
    const auto& f = fused_[b];
    for (std::size_t i = 0; i < k.tensors.size(); ++i) {
      const auto& g = grads_[k.tensors[i]];
      const T* src = f.data() + k.offsets[i];
      const auto from = tensor_view<const T, space>::vector(src, static_cast<std::int64_t>(g.size()));
      if (average)
        one.apply(mean, g, from);
      else if constexpr (on_host)
        std::copy_n(src, g.size(), g.data());
      else
        one.apply(gradapt::detail::copy_to{}, g, from);
    }
  }

  static constexpr bool can_overlap = nonblocking_allreduce_communicator<Comm>;
  static constexpr bool on_host = std::same_as<space, host_space>;
  using request_type = typename detail::request_of<Comm, T>::type;
  using buffer_type = decltype(std::declval<const B&>().template allocate<T>(std::size_t{}));

  Comm* comm_;
  B backend_;
  bucket_plan plan_;
  std::vector<tensor_view<T, space>> grads_;
  reducer_options opt_;
  std::vector<buffer_type> fused_;  ///< per bucket; empty for a bucket reduced in place
  std::vector<char> in_place_;      ///< per bucket: its gradients lie in its layout
  std::vector<std::size_t> missing_;
  std::vector<char> ready_;
  std::vector<request_type> requests_;  ///< per bucket (overlapping path only)
  std::size_t next_ = 0;                ///< buckets started in this round
  std::size_t done_ = 0;                ///< leading buckets whose collective completed
};

/// Gradient memory in a plan's bucket layout (PyTorch DDP's `gradient_as_bucket_view`): one
/// buffer per bucket of element type T, each gradient a view at its offset. A framework that
/// allocates its gradients here (writing each backward result into `view(t)`) lets
/// `bucket::reducer` reduce every bucket in place, without the copy into a fused buffer and
/// back (`reducer::in_place(b)` tells; bench/bench_buckets.cpp times the variant `in-place`).
/// In place, the gradients of a started bucket are its collective's buffer until `wait()`
/// returns: the framework must not read or write them in between.
template <class T>
requires element<T>
class storage {
 public:
  /// Buffers (zero-filled) for the buckets of `plan` whose element type is T.
  explicit storage(const bucket_plan& plan) : plan_(plan), buffers_(plan.buckets().size()) {
    for (std::size_t b = 0; b < buffers_.size(); ++b)
      if (plan_.buckets()[b].type == dtype_of_v<T>) buffers_[b].assign(plan_.buckets()[b].elements, T{});
  }
  /// Gradient t: a 1-D view of its elements in its bucket's buffer.
  /// @throws gradapt::error when t is out of range or its bucket holds another element type
  [[nodiscard]] tensor_view<T, host_space> view(std::size_t t) {
    const location at = plan_.where(t);  // checks the range
    const auto& k = plan_.buckets()[at.bucket];
    gradapt::detail::require(k.type == dtype_of_v<T>, "bucket::storage<", name(dtype_of_v<T>),
                             ">::view: tensor ", t, " is in a bucket of ", name(k.type),
                             " (make a storage of that type for it)");
    std::size_t i = 0;
    while (k.tensors[i] != t) ++i;
    const std::size_t end = i + 1 < k.tensors.size() ? k.offsets[i + 1] : k.elements;
    return tensor_view<T, host_space>::vector(buffers_[at.bucket].data() + at.offset,
                                              static_cast<std::int64_t>(end - at.offset));
  }
  /// Views of every gradient of type T in registration order (what `reducer` takes when the
  /// whole plan is of type T).
  /// @throws gradapt::error when a tensor's bucket holds another element type
  [[nodiscard]] std::vector<tensor_view<T, host_space>> views() {
    std::vector<tensor_view<T, host_space>> out;
    for (std::size_t t = 0; t < plan_.tensors(); ++t) out.push_back(view(t));
    return out;
  }
  /// Elements held (over the buckets of type T).
  [[nodiscard]] std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (const auto& v : buffers_) n += v.size();
    return n;
  }

 private:
  bucket_plan plan_;
  std::vector<std::vector<T>> buffers_;
};

}  // namespace gradapt::bucket

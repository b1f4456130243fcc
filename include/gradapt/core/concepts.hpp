#pragma once
/// @file
/// The communicator concept (who talks to whom). Where element math runs, the `backend`
/// concept and its refinements, is in backend/concepts.hpp. Algorithms never name a concrete
/// implementation.

#include <concepts>
#include <span>

#include "gradapt/core/config.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Ranks that talk over buffers in memory space `C::space`.
///
/// Required: rank() and size(); allreduce (sum, max), broadcast, allgather, reduce_scatter and
/// a pairwise exchange with one peer on float and double views; split into subgroups
/// (returns the same communicator type); barrier.
template <class C>
concept communicator = requires {
  typename C::space;
}
&&memory_space<typename C::space>&& requires(C& c, const C& cc, tensor_view<float, typename C::space> f,
                                             tensor_view<const float, typename C::space> cf,
                                             tensor_view<double, typename C::space> d,
                                             tensor_view<const double, typename C::space> cd) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.allreduce(f, reduce_op::sum);
  c.allreduce(d, reduce_op::max);
  c.broadcast(f, 0);
  c.broadcast(d, 0);
  c.allgather(cf, f);
  c.allgather(cd, d);
  c.reduce_scatter(cf, f, reduce_op::sum);
  c.reduce_scatter(cd, d, reduce_op::sum);
  c.exchange(0, cf, f);
  c.exchange(0, cd, d);
  { c.split(0, 0) } -> std::same_as<C>;
  c.barrier();
};

/// A communicator that can also start a summing allreduce without waiting for it:
/// `c.iallreduce(buf, reduce_op::sum)` returns a move-only request `r` whose `r.wait()`
/// completes the operation (the buffer then holds the result) and whose `r.test()` advances it
/// and returns true once complete. The buffer must stay valid until then; a request's
/// destructor completes an operation still in flight. A call that differs across ranks must
/// be an error on every rank (at `wait` or `test`), never a hang. `comm::mpi` has it;
/// `comm::single` and `comm::threads` do not (their collectives are blocking).
template <class C>
concept nonblocking_allreduce_communicator = communicator<C> &&
    requires(C& c, tensor_view<float, typename C::space> f, tensor_view<double, typename C::space> d) {
  { c.iallreduce(f, reduce_op::sum) } -> std::movable;
  { c.iallreduce(d, reduce_op::sum) } -> std::movable;
  c.iallreduce(f, reduce_op::sum).wait();
  { c.iallreduce(f, reduce_op::sum).test() } -> std::convertible_to<bool>;
};

/// A communicator that can also start a summing reduce-scatter without waiting for it:
/// `c.ireduce_scatter(send, recv, reduce_op::sum)` returns a request as
/// `nonblocking_allreduce_communicator`'s (`wait`, `test`; `send` and `recv` valid until it
/// completes). `comm::mpi` has it.
template <class C>
concept nonblocking_reduce_scatter_communicator = communicator<C> &&
    requires(C& c, tensor_view<const float, typename C::space> cf, tensor_view<float, typename C::space> f,
             tensor_view<const double, typename C::space> cd, tensor_view<double, typename C::space> d) {
  { c.ireduce_scatter(cf, f, reduce_op::sum) } -> std::movable;
  { c.ireduce_scatter(cd, d, reduce_op::sum) } -> std::movable;
  c.ireduce_scatter(cf, f, reduce_op::sum).wait();
  { c.ireduce_scatter(cf, f, reduce_op::sum).test() } -> std::convertible_to<bool>;
};

/// A communicator with a blocking mean over ranks in one collective: `c.allreduce_mean(buf)`
/// leaves in `buf` exactly the bits of `c.allreduce(buf, reduce_op::sum)` followed by
/// g / size() in the compute type (detail::divide_by_ranks), without a second pass over the
/// buffer. `comm::threads` has it; the bucket reducer and the train step's `allreduce_mean`
/// use it when the communicator has it (and sum, then divide, otherwise).
template <class C>
concept mean_allreduce_communicator = communicator<C> &&
    requires(C& c, tensor_view<float, typename C::space> f, tensor_view<double, typename C::space> d) {
  c.allreduce_mean(f);
  c.allreduce_mean(d);
};

/// A communicator whose operations run on a stream of their own beside the stream where the
/// framework produces their buffers (its backward stream), ordered by events on the device
/// rather than by host waits: `c.after_producer()` makes the communicator's stream wait for
/// the producer's work enqueued so far (the collectives do it themselves; a caller that first
/// touches produced buffers on the communicator's stream, such as the bucket reducer's
/// packing copy, calls it before), and `c.join_producer()` makes the producer's stream wait for
/// the communicator's work enqueued so far (the bucket reducer's `wait()` and the composed
/// step call it before they return). Both do nothing when no producer is set. `comm::nccl`
/// has them (`nccl_options::producer`).
template <class C>
concept stream_ordered_communicator = communicator<C> && requires(C& c) {
  c.after_producer();
  c.join_producer();
};

}  // namespace gradapt

#pragma once
/// @file
/// A summing gradient allreduce that also yields the two squared norms of the data-parallel
/// gradient noise scale: the ranks' local |g_r|^2 before the reduction and |sum_r g_r|^2 after.

#include <concepts>
#include <type_traits>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// A communicator whose summing allreduce computes the squared norms itself, during the pass
/// that reads the data (comm::threads does).
template <class C, class T>
concept communicator_with_norms = requires(C& c, tensor_view<T, typename C::space> buf) {
  { c.allreduce_with_norms(buf) } -> std::same_as<allreduce_norms>;
};

/// Sums `buf` over the ranks of `comm` in place and returns
///  - `sum_local_sq`: sum over ranks of |buf_r|^2 as it was before the reduction, and
///  - `result_sq`: |sum_r buf_r|^2 of the result.
///
/// For the noise scale (McCandlish et al. 2018, data-parallel form) the mean local squared
/// norm is sum_local_sq / P and the squared norm of the averaged gradient is result_sq / P^2;
/// `gradient_noise_scale::update(norms, P, batch)` takes the struct directly.
///
/// Cost: a communicator that satisfies `communicator_with_norms` (comm::threads) computes
/// both norms while it reduces, with no extra pass over memory and no extra collective. Any
/// other communicator (MPI; NCCL with the CUDA backend) gets two read passes on `backend`
/// (before and after) and one one-double allreduce (on a device communicator through a
/// backend buffer: the reads and the copy back wait for the stream); both results are then
/// the same on every rank.
///
/// Pass the gradient bucket (the flat buffer the framework allreduces); for a list of
/// separate tensors, call once per bucket and add the fields.
template <class C, backend B, element T>
requires communicator<C> && std::same_as<typename C::space, typename B::space> &&
    (!std::is_const_v<T>)allreduce_norms
    allreduce_with_norms(C& comm, const B& backend, tensor_view<T, typename C::space> buf) {
  if constexpr (communicator_with_norms<C, T>) {
    (void)backend;
    return comm.allreduce_with_norms(buf);
  } else {
    const tensor_view<const T, typename C::space> in = buf;
    double stats[2] = {backend.reduce(reduction::sum_squares, in), 0.0};
    comm.allreduce(buf, reduce_op::sum);
    detail::allreduce_host_values(comm, backend, std::span<double>(stats, 1), reduce_op::sum);
    stats[1] = backend.reduce(reduction::sum_squares, in);
    return {stats[0], stats[1]};
  }
}

}  // namespace gradapt

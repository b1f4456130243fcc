#pragma once
/// @file
/// The two concepts every algorithm is written against: `backend` (where element math runs)
/// and `communicator` (who talks to whom). Algorithms never name a concrete implementation.

#include <concepts>
#include <span>

#include "gradapt/core/config.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail {
/// Element functor used only to probe the backend concept: y += x.
struct concept_probe {
  GRADAPT_HD void operator()(float& y, float x) const { y += x; }
};
}  // namespace detail

/// A place where element math runs, over views in memory space `B::space`.
///
/// Required: element-wise `apply` of a GRADAPT_HD functor over one tensor or over lists of
/// tensors (`apply_list`), single-tensor and multi-tensor reductions accumulated in double
/// with a fixed order (bitwise reproducible), `dot`, and `synchronize()`.
template <class B>
concept backend = requires {
  typename B::space;
}
&&memory_space<typename B::space>&& requires(const B& b, tensor_view<float, typename B::space> x,
                                             tensor_view<const float, typename B::space> cx,
                                             std::span<const tensor_view<float, typename B::space>> xs,
                                             std::span<double> out) {
  { b.reduce(reduction::sum_squares, cx) } -> std::same_as<double>;
  { b.dot(cx, cx) } -> std::same_as<double>;
  { b.reduce(reduction::sum_squares, xs, out) } -> std::same_as<double>;
  { b.dot(xs, xs, out) } -> std::same_as<double>;
  b.apply(detail::concept_probe{}, x, cx);
  b.apply_list(detail::concept_probe{}, xs, xs);
  b.synchronize();
};

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

}  // namespace gradapt

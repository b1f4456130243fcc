#pragma once
/// @file
/// What a backend is, and each capability an algorithm may ask of it, named once.
///
/// A backend is a small value type (gradapt::host, gradapt::cuda, or a framework's own) that
/// runs element math over `tensor_view`s in one memory space. Algorithms are class templates
/// constrained by the concepts below and call only the operations these concepts name; no
/// algorithm detects a backend by probing its members. docs/writing-a-backend.md lists, per
/// concept, what to implement and the determinism promise each operation must keep.
///
/// The concepts, what each adds, and what needs it:
///
///  - `backend`: apply, apply_list, reduce, dot, synchronize. Every algorithm.
///  - `optimizer_backend`: allocate, copy, apply_reduce_list. Every optimizer, the train step.
///  - `factored_backend`: reduce_factored, apply_factored, apply_factored_sum. Adafactor, SM3.
///  - `factored_sumsq_backend` (optional): reduce_factored_sumsq. Adafactor's parameter scale
///    in its statistics pass.
///  - `factored_max_backend` (optional): apply_factored_max. SM3's covers and update in one
///    pass.
///  - `task_backend` (optional): thread_count, single_thread, run_tasks. Per-tensor tasks of
///    the factored optimizers.
///  - `workspace_backend` (optional): reserve_for, reserve. A graph-capturable first step.
///  - `staging_backend` (optional): staging. Agreements across ranks on a device that
///    allocate nothing per call.
///  - `deferred_dot_backend`: dot_to (results left in the backend's memory). Adasum on a
///    device.
///
/// The optional capabilities change how a step is scheduled, never its bits: an algorithm runs
/// on any backend with the required ones.

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

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

namespace detail::optim {
/// The per-tensor output argument of apply_reduce_list: a std::span for host memory, the
/// device view itself for device memory (a device backend keeps the sums on the device).
template <class Space>
auto per_tensor_arg(tensor_view<double, Space> v) {
  if constexpr (std::is_same_v<Space, host_space>)
    return std::span<double>(v.data(), v.size());
  else
    return v;
}
/// Element functor used only to probe the optimizer_backend concept: y += 1, returns y.
struct reduce_probe {
  GRADAPT_HD double operator()(float& y) const {
    y += 1.0f;
    return static_cast<double>(y);
  }
};
/// Element functor used only to probe `factored_backend`: r · c · v² as a double.
struct factored_probe {
  GRADAPT_HD double operator()(float r, float c, float v) const { return static_cast<double>(r * c * v * v); }
};
/// Element functor used only to probe `factored_backend`: y *= r * c.
struct factored_apply_probe {
  GRADAPT_HD void operator()(float r, float c, float& y) const { y *= r * c; }
};
/// Task body used only to probe `task_backend`.
struct task_probe {
  void operator()(std::size_t, std::size_t) const {}
};
}  // namespace detail::optim

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

/// A backend an optimizer chain can run on: `backend` plus owning allocation
/// (`allocate<T>(n)`: zero-filled, with `data()` and `size()`), copies between its memory and
/// host memory, and the fused element-wise apply with per-tensor sums (`apply_reduce_list`,
/// the sums in a fixed order). gradapt::host and gradapt::cuda provide them.
template <class B>
concept optimizer_backend = backend<B> &&
    requires(const B& b, std::size_t n, tensor_view<const double, typename B::space> cs,
             tensor_view<double, typename B::space> s, tensor_view<const double, host_space> ch,
             tensor_view<double, host_space> h, std::span<const tensor_view<float, typename B::space>> xs) {
  b.template allocate<double>(n).data();
  b.template allocate<double>(n).size();
  b.copy(cs, h);
  b.copy(ch, s);
  b.apply_reduce_list(detail::optim::reduce_probe{}, detail::optim::per_tensor_arg(s), xs);
};

/// A backend the factored optimizers run on: `optimizer_backend` plus row/column operations
/// over a tensor seen as [A, X, B, Y, C]: `reduce_factored` (per-row and per-column sums, or
/// NaN-propagating maxima, of a functor of the row entry, column entry and element),
/// `apply_factored` (an element functor that also gets the row and column entries; returns the
/// sum of its results) and `apply_factored_sum` (the same sum left in the backend's memory).
template <class B>
concept factored_backend = optimizer_backend<B> &&
    requires(const B& b, tensor_view<const float, typename B::space> cx,
             tensor_view<float, typename B::space> x, tensor_view<double, typename B::space> s,
             std::array<std::int64_t, 5> d) {
  b.reduce_factored(detail::optim::factored_probe{}, d, cx, cx, cx, s, s);
  b.reduce_factored(detail::optim::factored_probe{}, d, cx, cx, cx, s, s, reduce_op::max);
  { b.apply_factored(detail::optim::factored_apply_probe{}, d, cx, cx, x) } -> std::convertible_to<double>;
  b.apply_factored_sum(detail::optim::factored_probe{}, d, cx, cx, s, cx);
};

/// A backend whose statistics pass for a factored tensor also returns Σ y² of a second
/// tensor read in the same pass (`reduce_factored_sumsq`; gradapt::host): Adafactor's
/// parameter scale then costs no extra read of the parameters.
template <class B>
concept factored_sumsq_backend = factored_backend<B> &&
    requires(const B& b, tensor_view<const float, typename B::space> cx,
             tensor_view<double, typename B::space> s, std::array<std::int64_t, 5> d) {
  {
    b.reduce_factored_sumsq(detail::optim::factored_probe{}, d, cx, cx, cx, s, s, cx, s)
    } -> std::convertible_to<double>;
};

/// Element functor used only to probe `factored_max_backend`: y *= r · c, returns y.
namespace detail::optim {
struct factored_max_probe {
  GRADAPT_HD float operator()(float r, float c, float& y) const {
    y *= r * c;
    return y;
  }
  GRADAPT_HD float term(float r, float c, const float& y) const { return y * r * c; }
};
}  // namespace detail::optim

/// A backend that applies an element functor over a factored tensor and keeps the per-row
/// and per-column maxima of the values it returns in the same pass (`apply_factored_max`; the
/// functor's `term` member recomputes a value without writing;
/// gradapt::host, on the calling thread): SM3's covers and update in one read of the
/// gradient. The maxima equal `reduce_factored`'s with `reduce_op::max` over the same terms.
template <class B>
concept factored_max_backend = factored_backend<B> &&
    requires(const B& b, tensor_view<const float, typename B::space> cx,
             tensor_view<float, typename B::space> x, std::array<std::int64_t, 5> d) {
  b.apply_factored_max(detail::optim::factored_max_probe{}, d, cx, cx, x, x, x);
};

/// A backend that schedules independent tasks on its own threads (gradapt::host): its
/// `thread_count()`, a copy of itself that runs every operation on one thread
/// (`single_thread()`, for work inside a task), and `run_tasks(n, max_threads, fn)`, which
/// calls fn(q, slot) once for each q < n on up to max_threads threads, slot < max_threads
/// naming the thread. Per-tensor steps use it to run small tensors as one-thread tasks; the
/// results never depend on the thread count.
template <class B>
concept task_backend = backend<B> && requires(const B& b, std::size_t n) {
  { b.thread_count() } -> std::convertible_to<int>;
  { b.single_thread() } -> std::same_as<B>;
  b.run_tasks(n, n, detail::optim::task_probe{});
};

/// A backend with a grow-only workspace that can be sized ahead of the first step
/// (gradapt::cuda): `reserve_for(views, terms)` for a fused pass over `views` with `terms`
/// values per element, and `reserve(bytes)`. Sizing at init lets even the first step be
/// captured into a CUDA graph.
template <class B>
concept workspace_backend = backend<B> &&
    requires(const B& b, const std::vector<tensor_view<const float, typename B::space>>& v, std::size_t n) {
  b.reserve_for(v, n);
  b.reserve(n);
};

/// A backend that lends grow-only memory of its space for the few words an agreement across
/// ranks stages on a device (`staging(n)`: at least n doubles, valid until the next call;
/// gradapt::cuda's workspace). `detail::allreduce_host_values` uses it; a backend without it
/// gets a buffer from `allocate` per agreement.
template <class B>
concept staging_backend = requires(const B& b, std::size_t n) {
  { b.staging(n) } -> std::same_as<double*>;
};

/// A backend that can leave per-tensor dot products in its own memory (`dot_to(xs, ys, out)`,
/// out a view of doubles in `B::space`) instead of returning them to the host, so a device
/// step need not wait for the host (gradapt::cuda; Adasum uses it off the host).
template <class B>
concept deferred_dot_backend = backend<B> &&
    requires(const B& b, std::span<const tensor_view<const float, typename B::space>> xs,
             tensor_view<double, typename B::space> out) {
  b.dot_to(xs, xs, out);
};

}  // namespace gradapt

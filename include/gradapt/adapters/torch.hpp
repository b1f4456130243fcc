#pragma once
/// @file
/// Zero-copy tensor views over LibTorch tensors, and a parameter list built from a module.
///
///     auto w = gradapt::view_of<float>(tensor);                          // CPU float32
///     auto g = gradapt::view_of<gradapt::bfloat16, gradapt::device_space>(cuda_grad);
///     auto params = gradapt::param_list_of<float>(*model);              // values + grads
///
/// A view is the tensor's own memory (`data_ptr()`, which includes the storage offset) with
/// the tensor's sizes. It is checked, never converted: the requested element type must be the
/// tensor's dtype (float = float32, double = float64, gradapt::half = float16,
/// gradapt::bfloat16 = bfloat16), the layout strided and dense (`is_contiguous()`, rank 0 to
/// 4), the device a CPU device for `host_space` and a CUDA device for `device_space`, and the
/// tensor must not carry a lazy negation bit. Anything else throws a gradapt::error naming the
/// dtype, device, sizes and strides found and what to do; nothing is copied behind the caller's
/// back (`.contiguous()`, `.cpu()`, `.to(dtype)` copy: keep their result alive and view it).
///
/// Lifetime and aliasing. The view stays valid while the tensor's storage lives and is not
/// reallocated. Gradients: autograd accumulates into an existing `.grad()` in place, so views
/// of gradients stay valid across steps as long as they are zeroed in place
/// (`module.zero_grad(false)`, `grad.zero_()`), not set to None (`zero_grad(true)`, the
/// default from LibTorch 2.0 on) or replaced. Writes through a view bypass autograd and the
/// tensor's version counter, exactly like an optimizer's update under `torch::NoGradGuard`.
///
/// CUDA tensors: the view carries no device index or stream. Run gradapt::cuda on the stream
/// the framework uses (`at::cuda::getCurrentCUDAStream()`) with the tensor's device current.
///
/// Needs LibTorch (tested with 1.13; `find_package(Torch)`) and nothing from gradapt beyond
/// core/. Only ATen's tensor header is included, so a translation unit that views tensors does
/// not pay for <torch/torch.h>; `param_list_of` is a template over the module type and is
/// compiled where the module is known.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::torch_adapter {

/// LibTorch's scalar type for gradapt element type T.
template <class T>
constexpr c10::ScalarType scalar_type_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return c10::ScalarType::Float;
  else if constexpr (std::is_same_v<U, double>)
    return c10::ScalarType::Double;
  else if constexpr (std::is_same_v<U, half>)
    return c10::ScalarType::Half;
  else
    return c10::ScalarType::BFloat16;
}

static_assert(sizeof(c10::Half) == sizeof(half) && sizeof(c10::BFloat16) == sizeof(bfloat16),
              "gradapt/adapters/torch.hpp: LibTorch's 16-bit types are not 2 bytes");

/// "[3, 4]" text of sizes or strides.
inline std::string list_string(c10::IntArrayRef r) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < r.size(); ++i) os << (i ? ", " : "") << r[i];
  os << ']';
  return os.str();
}

/// What a message calls the tensor: "tensor" or "parameter 'fc1.weight' (value)".
inline std::string label(const std::string& what) { return what.empty() ? std::string("tensor") : what; }

template <element T, memory_space Space>
tensor_view<T, Space> view(const at::Tensor& t, const std::string& what) {
  constexpr dtype want = dtype_of_v<T>;
  const std::string name = label(what);
  const char* fn = std::is_same_v<Space, host_space> ? "view_of<T, host_space>" : "view_of<T, device_space>";
  require(t.defined(), fn, ": ", name,
          " is undefined (a default-constructed tensor, or a gradient before the first backward(): run "
          "backward() first, or allocate the gradient)");
  require(t.scalar_type() == scalar_type_of<T>(), fn, ": ", name, " has dtype ",
          c10::toString(t.scalar_type()), " but ", gradapt::name(want),
          " was requested (expected torch dtype ", c10::toString(scalar_type_of<T>()),
          "; views never convert: request the tensor's own type or "
          "keep a converted copy alive)");
  require(t.layout() == c10::kStrided, fn, ": ", name, " has layout ", t.layout(),
          " (expected a dense strided tensor; call .to_dense() and view the result)");
  if constexpr (std::is_same_v<Space, host_space>) {
    require(t.device().is_cpu(), fn, ": ", name, " is on device ", t.device().str(),
            " but a host view was requested (expected a CPU tensor; use view_of<T, gradapt::device_space> "
            "for a CUDA tensor, or keep a .cpu() copy alive)");
  } else {
    require(t.device().is_cuda(), fn, ": ", name, " is on device ", t.device().str(),
            " but a device view was requested (expected a CUDA tensor; use view_of<T> (host_space) for a "
            "CPU tensor)");
  }
  require(t.dim() <= max_rank, fn, ": ", name, " has rank ", t.dim(), " (sizes ", list_string(t.sizes()),
          "; expected 0 to ", max_rank, ": view a reshape of it, e.g. t.flatten(0, 1), or t.view(-1))");
  require(t.is_contiguous(), fn, ": ", name, " is not contiguous (sizes ", list_string(t.sizes()),
          ", strides ", list_string(t.strides()),
          "; expected row-major contiguous strides. A transpose, a strided slice or channels_last is not: "
          "view a .contiguous() copy, and keep it alive)");
  require(!t.is_neg(), fn, ": ", name,
          " carries a lazy negation bit (its memory holds the negated values; call .resolve_neg() and view "
          "the result)");
  T* const data = static_cast<T*>(t.data_ptr());
  const c10::IntArrayRef sizes = t.sizes();
  return tensor_view<T, Space>(data, std::span<const std::int64_t>(sizes.data(), sizes.size()));
}

/// The module behind a module, a torch::nn::ModuleHolder or a std::shared_ptr to a module.
template <class M>
decltype(auto) module_ref(M& m) {
  if constexpr (requires { m.named_parameters(true); })
    return (m);
  else
    return (*m);
}

}  // namespace detail::torch_adapter

/// A zero-copy view of a LibTorch tensor's memory.
///
/// @tparam T     float, double, gradapt::half or gradapt::bfloat16, const-qualified for a
///               read-only view; must match the tensor's dtype
/// @tparam Space host_space (CPU tensors, the default) or device_space (CUDA tensors)
/// @return a view with the tensor's sizes (rank 0 to 4) over `t.data_ptr()`
/// @throws gradapt::error for an undefined tensor, another dtype, a sparse layout, a device
///         of the other kind, rank > 4, non-contiguous strides or a lazy negation bit
template <element T, memory_space Space = host_space>
tensor_view<T, Space> view_of(const at::Tensor& t) {
  return detail::torch_adapter::view<T, Space>(t, "");
}

/// Options of `param_list_of`, e.g. `{.allocate_missing_grads = true}`.
///
/// | name                   | type          | default | meaning                                        |
/// |------------------------|---------------|---------|------------------------------------------------|
/// | allocate_missing_grads | bool          | false   | zero-fill missing gradients (otherwise: error) |
/// | include_frozen         | bool          | false   | also list requires_grad() == false parameters  |
/// | flags                  | std::function | empty   | per-parameter flags from (name, value)         |
struct torch_param_options {
  /// Parameters whose `.grad()` is undefined get `p.mutable_grad() = zeros` (same dtype, device,
  /// sizes; contiguous). Autograd then accumulates into that tensor in place, so the views stay
  /// valid. Off by default: a missing gradient is an error.
  bool allocate_missing_grads = false;
  /// Frozen parameters (requires_grad() == false) are left out unless this is set.
  bool include_frozen = false;
  /// Flags for each parameter from its qualified name and value (empty: default flags).
  std::function<param_flags(const std::string& name, const at::Tensor& value)> flags = {};
};

/// A gradapt::param_list over a module's parameters (`named_parameters()`, recursive, in the
/// module's order, with its qualified names such as "fc1.weight"): for each, a view of the
/// value and a view of `.grad()`. Nothing is copied.
///
/// Call it once the gradients exist (after the first backward()), or with
/// `.allocate_missing_grads = true`, and zero gradients in place afterwards (see the file
/// comment). Rebuild the list if the module's parameters or gradients are replaced.
///
/// @tparam V     element type of the values (must match each parameter's dtype)
/// @tparam G     element type of the gradients (LibTorch keeps them in the parameter's dtype)
/// @tparam Space host_space for CPU modules, device_space for CUDA modules
/// @param module a torch::nn::Module, a module holder (torch::nn::Linear, ...) or a
///               std::shared_ptr to a module
/// @param options missing-gradient policy, frozen parameters and per-parameter flags (see
///               torch_param_options)
/// @throws gradapt::error naming the parameter when a view cannot be made (see `view_of`) or a
///         gradient is missing: "run backward() first, or pass .allocate_missing_grads = true"
template <element V, element G = V, memory_space Space = host_space, class Module>
param_list<V, G, Space> param_list_of(Module& module, const torch_param_options& options = {}) {
  auto& m = detail::torch_adapter::module_ref(module);
  param_list<V, G, Space> list;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const at::Tensor& value = item.value();
    if (!value.requires_grad() && !options.include_frozen) continue;
    if (!value.grad().defined()) {
      detail::require(options.allocate_missing_grads, "param_list_of: parameter '", name,
                      "' has no gradient yet (run backward() once before building the list, or pass "
                      ".allocate_missing_grads = true)");
      value.mutable_grad() = value.new_zeros(value.sizes());
    }
    const auto v = detail::torch_adapter::view<V, Space>(value, "parameter '" + name + "' (value)");
    const auto g = detail::torch_adapter::view<G, Space>(value.grad(), "parameter '" + name + "' (gradient)");
    list.add(name, v, g, options.flags ? options.flags(name, value) : param_flags{});
  }
  return list;
}

}  // namespace gradapt

#pragma once
/// @file
/// A parameter list over a framework's own buffers: names, value and gradient views, per
/// parameter flags, and groups that carry their own options. Nothing is copied.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Per-parameter switches (masks) that optimizers consult.
struct param_flags {
  bool skip_weight_decay = false;  ///< exclude from weight decay (biases, norm layers)
  bool skip_trust_ratio = false;   ///< exclude from LARS/LAMB trust-ratio scaling
};

/// Options a parameter group carries; algorithms read what they understand.
struct group_options {
  double lr_scale = 1.0;               ///< multiplies the learning rate for this group
  std::optional<double> weight_decay;  ///< overrides the optimizer's weight decay when set
};

namespace detail {

/// Checks the options of group `group` that gradapt's optimizers read: lr_scale finite and
/// >= 0 (a negative scale would step uphill), weight_decay (when set) finite and >= 0.
/// @throws gradapt::error naming `who`, the group and the option
template <class O>
void check_group_options(const O& o, std::string_view group, std::string_view who) {
  if constexpr (requires { o.lr_scale; }) {
    const auto s = static_cast<double>(o.lr_scale);
    require(std::isfinite(s) && s >= 0.0, who, ": group '", group, "' has lr_scale ", s,
            " (expected finite and >= 0: it multiplies the learning rate, and a negative one steps uphill)");
  }
  if constexpr (requires { o.weight_decay.has_value(); }) {
    if (o.weight_decay.has_value()) {
      const auto w = static_cast<double>(*o.weight_decay);
      require(std::isfinite(w) && w >= 0.0, who, ": group '", group, "' has weight_decay ", w,
              " (expected finite and >= 0)");
    }
  }
}

}  // namespace detail

/// One parameter: a name, its value and gradient views, flags and its group index.
template <class V, class G, class Space>
struct param_entry {
  std::string name;             ///< unique, non-empty name (e.g. the framework's parameter path)
  tensor_view<V, Space> value;  ///< the weights, updated in place by optimizers
  tensor_view<G, Space> grad;   ///< the gradient, same shape as `value`
  param_flags flags;            ///< per-parameter masks (weight decay, trust ratio)
  std::size_t group = 0;        ///< index of the parameter's group in the list (0 = "default")
};

/// A named group of parameters with its own options.
template <class Options>
struct param_group {
  std::string name;                  ///< unique, non-empty group name; group 0 is "default"
  Options options;                   ///< the group's options, read by the algorithms that understand them
  std::vector<std::size_t> members;  ///< indices into the parameter list, in insertion order
};

/// Parameters described once, over the framework's buffers.
///
/// @tparam V     value (weight) element type, e.g. float for fp32 master weights
/// @tparam G     gradient element type, e.g. bfloat16 for 16-bit gradients
/// @tparam Space host_space or device_space
/// @tparam Options what a group carries (group_options by default)
///
/// Group 0, named "default", exists from construction. `values()` and `grads()` are
/// contiguous spans of views, the shape every multi-tensor backend operation takes.
template <element V, element G = V, memory_space Space = host_space, class Options = group_options>
class param_list {
 public:
  using value_type = V;                    ///< element type of the weights
  using grad_type = G;                     ///< element type of the gradients
  using space = Space;                     ///< memory space of every view in the list
  using options_type = Options;            ///< what each group carries
  using entry = param_entry<V, G, Space>;  ///< one parameter's record

  /// An empty list with group 0 ("default") holding value-initialised options.
  param_list() { groups_.push_back({"default", Options{}, {}}); }
  /// An empty list whose group 0 ("default") holds `default_options`.
  explicit param_list(Options default_options) {
    detail::check_group_options(default_options, "default", "param_list");
    groups_.push_back({"default", std::move(default_options), {}});
  }

  /// Adds a group and returns its index. Names must be unique and non-empty.
  std::size_t add_group(std::string name, Options options = {}) {
    detail::require(!name.empty(), "param_list::add_group: empty group name");
    for (const auto& g : groups_)
      detail::require(g.name != name, "param_list::add_group: group '", name, "' already exists");
    detail::check_group_options(options, name, "param_list::add_group");
    groups_.push_back({std::move(name), std::move(options), {}});
    return groups_.size() - 1;
  }

  /// Adds a parameter. The value and gradient must have the same shape; names are unique.
  /// @return the parameter's index
  std::size_t add(std::string name, tensor_view<V, Space> value, tensor_view<G, Space> grad,
                  param_flags flags = {}, std::size_t group = 0) {
    detail::require(!name.empty(), "param_list::add: empty parameter name");
    detail::require(group < groups_.size(), "param_list::add: parameter '", name, "' names group ", group,
                    " but only ", groups_.size(), " group(s) exist");
    detail::require(value.same_shape(grad), "param_list::add: parameter '", name, "' has value shape ",
                    value.shape_string(), " but gradient shape ", grad.shape_string(),
                    " (expected equal shapes)");
    detail::require(!find(name), "param_list::add: parameter '", name, "' already exists");
    // Two views of one buffer would be updated (or unscaled) twice per step.
    detail::require(!overlaps(value.data(), value.bytes(), grad.data(), grad.bytes()),
                    "param_list::add: parameter '", name,
                    "' has a gradient that shares memory with its value (pass separate buffers)");
    for (const auto& e : entries_) {
      const auto clash = [&](const void* p, std::size_t n, const char* what) {
        const char* other = overlaps(p, n, e.value.data(), e.value.bytes()) ? "value"
                            : overlaps(p, n, e.grad.data(), e.grad.bytes()) ? "gradient"
                                                                            : nullptr;
        detail::require(other == nullptr, "param_list::add: the ", what, " of parameter '", name,
                        "' shares memory with the ", other == nullptr ? "" : other, " of parameter '", e.name,
                        "' (each parameter needs its own value and gradient buffers)");
      };
      clash(value.data(), value.bytes(), "value");
      clash(grad.data(), grad.bytes(), "gradient");
    }
    entries_.push_back({std::move(name), value, grad, flags, group});
    values_.push_back(value);
    grads_.push_back(grad);
    groups_[group].members.push_back(entries_.size() - 1);
    total_ += value.size();
    return entries_.size() - 1;
  }

  /// Number of parameters (tensors), not elements; see total_elements().
  std::size_t size() const { return entries_.size(); }
  /// True when no parameter has been added (groups do not count).
  bool empty() const { return entries_.empty(); }
  /// Total number of elements over all parameters.
  std::size_t total_elements() const { return total_; }

  /// Parameter `i` in insertion order; unchecked (precondition i < size()), see at().
  const entry& operator[](std::size_t i) const { return entries_[i]; }
  /// Bounds-checked access by index.
  const entry& at(std::size_t i) const {
    detail::require(i < entries_.size(), "param_list::at: index ", i, " out of range (size ", entries_.size(),
                    ")");
    return entries_[i];
  }
  /// Bounds-checked access by name.
  const entry& at(std::string_view name) const {
    const auto i = find(name);
    detail::require(i.has_value(), "param_list::at: no parameter named '", name, "'");
    return entries_[*i];
  }
  /// Index of the parameter with this name, if any.
  std::optional<std::size_t> find(std::string_view name) const {
    for (std::size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].name == name) return i;
    return std::nullopt;
  }

  /// All parameter records in insertion order. The span is invalidated by add().
  std::span<const entry> entries() const { return entries_; }
  /// Value views in parameter order.
  std::span<const tensor_view<V, Space>> values() const { return values_; }
  /// Gradient views in parameter order.
  std::span<const tensor_view<G, Space>> grads() const { return grads_; }

  /// Number of groups, including group 0 ("default"); always at least 1.
  std::size_t group_count() const { return groups_.size(); }
  /// Group `g` (name, options, member indices).
  /// @throws gradapt::error when `g >= group_count()`
  const param_group<Options>& group(std::size_t g) const {
    detail::require(g < groups_.size(), "param_list::group: index ", g, " out of range (", groups_.size(),
                    " group(s))");
    return groups_[g];
  }
  /// Mutable group options (learning-rate scale changes mid-run, for example).
  Options& options(std::size_t g) {
    detail::require(g < groups_.size(), "param_list::options: index ", g, " out of range (", groups_.size(),
                    " group(s))");
    return groups_[g].options;
  }

 private:
  /// True when the byte ranges [a, a + na) and [b, b + nb) share a byte.
  static bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
    const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
    return na != 0 && nb != 0 && x < y + nb && y < x + na;
  }

  std::vector<entry> entries_;
  std::vector<tensor_view<V, Space>> values_;
  std::vector<tensor_view<G, Space>> grads_;
  std::vector<param_group<Options>> groups_;
  std::size_t total_ = 0;
};

}  // namespace gradapt

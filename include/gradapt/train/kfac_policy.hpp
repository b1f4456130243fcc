#pragma once
/// @file
/// `gradapt::train::kfac_policy`: K-FAC (optim/kfac.hpp) in the precondition slot of
/// `gradapt::train::data_parallel_step`. The step owns the K-FAC object and its state and, on
/// every taken step, rewrites the combined (rank-mean) gradients of the registered layers with
/// `kfac::step(comm, state, grads, lr)` before the optimizer steps on them at the same lr:
///
///     const gradapt::kfac kf({.factor_update_steps = 10, .inv_update_steps = 100});
///     const gradapt::kfac_layer layers[] = {{"fc1", 784, 256, true}, {"fc2", 256, 10, true}};
///     auto step = gradapt::train::make_data_parallel_step(
///         comm, backend, params, gradapt::sgd({.momentum = 0.9}), {.lr = 0.1},
///         gradapt::train::kfac_policy(kf, kf.init<float>(la, layers),
///                                     {{.weight = 0, .bias = 1}, {.weight = 2, .bias = 3}}));
///     for (...) {
///       backward(loss * step.loss_scale());
///       auto& pre = step.preconditioner();
///       if (pre.factor_update_due()) {           // the framework collects a and g on these steps
///         pre.accumulate(0, a1, g1, step.loss_scale());
///         pre.accumulate(1, a2, g2, step.loss_scale());
///       }
///       step.step({.loss = loss});
///     }
///
/// Each K-FAC layer (in registration order) names the parameters of the step's list that hold
/// its weight (out × in; a convolution's out × c × kh × kw with c·kh·kw = in) and, for a layer
/// registered with a bias, its bias (out). The mapping is checked when the step is built.
/// On a step the loss scaler skips, the terms accumulated for it are discarded
/// (`kfac_state::discard`) and K-FAC does not step. The K-FAC state is in the step's
/// checkpoint (section "precondition"). Not combinable with `local_sgd_policy` (a
/// compile-time error): K-FAC needs the same combined gradient on every rank.
///
/// In device memory the state comes from `kf.init<float>(backend, cuda_linalg(...), layers)`
/// (the step's backend: its stream), `a` and `g` are device views, and everything K-FAC does
/// runs on that stream (kfac.md, CUDA).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/train/policies.hpp"

namespace gradapt::train {

/// Where one K-FAC layer's gradient is in the step's parameter list (indices in insertion
/// order).
struct kfac_params {
  std::size_t weight = 0;                ///< the weight: out × in (or out × c × kh × kw, c·kh·kw = in)
  std::optional<std::size_t> bias = {};  ///< the bias (out elements); set exactly for layers with a bias
};

/// A K-FAC state type (`gradapt::kfac_state<...>`, whatever its template parameters).
template <class S>
concept kfac_state_type = std::movable<S> && requires(const gradapt::kfac& k, S& s, const S& cs) {
  { k.factor_update_due(cs) } -> std::same_as<bool>;
  { cs.layers() } -> std::convertible_to<std::size_t>;
  { cs.layer(std::size_t{}) } -> std::same_as<const kfac_layer&>;
  s.discard();
};

/// K-FAC bound to a data-parallel step (what `step.preconditioner()` returns with
/// `kfac_policy`): the K-FAC object, its state, the layer-to-parameter mapping and the
/// gradient views K-FAC rewrites.
template <class State, class G>
class kfac_preconditioner {
 public:
  /// Built by `kfac_policy::bind` (the mapping already checked against the parameter list).
  kfac_preconditioner(gradapt::kfac kf, State state, std::vector<kfac_params> map)
      : kf_(std::move(kf)), st_(std::move(state)), map_(std::move(map)), views_(map_.size()) {}

  /// The K-FAC object (its options).
  const gradapt::kfac& kfac() const { return kf_; }
  /// The K-FAC state (factors, decompositions, step count).
  const State& state() const { return st_; }
  /// The K-FAC state, e.g. for `kfac().accumulate(state(), ...)`.
  State& state() { return st_; }
  /// The mapping from K-FAC layers to parameters.
  const std::vector<kfac_params>& mapping() const { return map_; }

  /// Whether the next taken step updates the factors: collect every layer's a and g then.
  bool factor_update_due() const { return kf_.factor_update_due(st_); }
  /// `kfac::accumulate` on the step's state: layer i's inputs a (rows × in) and output gradients
  /// g (rows × out) of this rank's batch, g multiplied by `loss_scale` (pass the step's
  /// `loss_scale()`). Only when `factor_update_due()`.
  template <class A, class Gr>
  void accumulate(std::size_t i, const A& a, const Gr& g, double loss_scale = 1.0) {
    kf_.accumulate(st_, i, a, g, loss_scale);
  }

  /// The precondition stage: every layer's combined gradient rewritten in place by
  /// `kfac::step(comm, state, grads, lr)` (collective).
  template <class Comm, class B, class L>
  void precondition(Comm& comm, const B&, const L& grads, double lr) {
    for (std::size_t i = 0; i < map_.size(); ++i) {
      const kfac_layer& s = st_.layer(i);
      using Sp = typename State::space;
      views_[i].weight = tensor_view<G, Sp>(grads[map_[i].weight].data(), {s.out, s.in});
      views_[i].bias = map_[i].bias ? grads[*map_[i].bias] : tensor_view<G, Sp>();
    }
    kf_.step(comm, st_, views_, lr);
  }
  /// The step was skipped: drop the a and g terms accumulated for it.
  void discard() { st_.discard(); }

  /// The K-FAC state into the step's checkpoint.
  void save(archive_writer& w) const { st_.save(w); }
  /// The K-FAC state from the step's checkpoint (all or nothing).
  void load(archive_reader& r) { st_.load(r); }

 private:
  gradapt::kfac kf_;
  State st_;
  std::vector<kfac_params> map_;
  std::vector<kfac_grad<G, typename State::space>> views_;
};

/// Precondition slot: K-FAC. Holds the K-FAC object, its state (from `kfac.init`; moved into
/// the step) and, per registered layer in order, the parameters holding its gradient. Pass it
/// to `make_data_parallel_step` as an rvalue.
template <kfac_state_type State>
class kfac_policy {
 public:
  static constexpr policy_slot slot = policy_slot::precondition;  ///< fills the precondition slot

  /// `kf` and the state it created (`kf.init<C>(la, layers)`); `mapping[i]` for layer i.
  kfac_policy(gradapt::kfac kf, State state, std::vector<kfac_params> mapping)
      : kf_(std::move(kf)), st_(std::move(state)), map_(std::move(mapping)) {}

  /// The K-FAC object.
  const gradapt::kfac& kfac() const { return kf_; }
  /// The mapping.
  const std::vector<kfac_params>& mapping() const { return map_; }

  /// Values every rank must pass equal (the step's construction agreement): the layer count
  /// and the mapping. K-FAC's own options and layers are agreed at its first step.
  template <class Out>
  void agreed_options(Out& v) const {
    std::uint64_t h = 1469598103ULL;
    for (const auto& m : map_) {
      h = (h * 1099511ULL + m.weight + 1) % (std::uint64_t{1} << 50);
      h = (h * 1099511ULL + (m.bias ? *m.bias + 1 : 0)) % (std::uint64_t{1} << 50);
    }
    v.push("kfac_policy layers", static_cast<double>(map_.size()));
    v.push("kfac_policy parameter mapping (hash)", static_cast<double>(h));
  }

  /// Checks the mapping against `params` and the state's layers, and moves the K-FAC object
  /// and state into the bound preconditioner.
  /// @throws gradapt::error naming the layer: a mapping count other than the layer count, a
  ///         parameter index out of range, a shape that is not the layer's (weight out × in,
  ///         bias out), a bias given for a layer without one or missing for one with one, a
  ///         parameter named twice
  template <class Comm, class B, class PL>
  auto bind(Comm&, const B&, const PL& params) && {
    using G = typename PL::grad_type;
    static_assert(std::is_same_v<typename State::space, typename PL::space>,
                  "train::kfac_policy: the K-FAC state's memory is not the parameters' (for device memory "
                  "create it with kfac.init(backend, la, layers) over a device backend and cuda_linalg)");
    constexpr const char* who = "train::kfac_policy";
    detail::require(st_.layers() > 0, who,
                    ": the K-FAC state has no layers (create it with kfac.init(la, layers))");
    detail::require(map_.size() == st_.layers(), who, ": ", map_.size(), " parameter mappings for ",
                    st_.layers(),
                    " K-FAC layers (one kfac_params per registered layer, in registration order)");
    const auto grads = params.grads();
    std::vector<bool> used(params.size(), false);
    for (std::size_t i = 0; i < map_.size(); ++i) {
      const kfac_layer& s = st_.layer(i);
      const kfac_params& m = map_[i];
      const auto index = [&](std::size_t p, const char* part) {
        detail::require(p < params.size(), who, ": layer '", s.name, "' names parameter ", p, " as its ",
                        part, " but the parameter list holds ", params.size());
        detail::require(!used[p], who, ": layer '", s.name, "' names parameter ", p, " ('", params[p].name,
                        "') as its ", part, ", which another mapping already names");
        used[p] = true;
      };
      index(m.weight, "weight");
      const auto& w = grads[m.weight];
      std::int64_t rest = 1;
      for (int d = 1; d < w.rank(); ++d) rest *= w.dim(d);
      detail::require(w.rank() >= 2 && w.dim(0) == s.out && rest == s.in, who, ": layer '", s.name,
                      "' has a weight of out ", s.out, " × in ", s.in, " but its weight parameter ", m.weight,
                      " ('", params[m.weight].name, "') has shape ", w.shape_string(), " (expected [", s.out,
                      ", ", s.in, "], or a convolution's [", s.out, ", c, kh, kw] with c·kh·kw = ", s.in,
                      ")");
      if (s.bias) {
        detail::require(m.bias.has_value(), who, ": layer '", s.name,
                        "' is registered with a bias but its mapping names no bias parameter");
        index(*m.bias, "bias");
        const auto& b = grads[*m.bias];
        detail::require(b.rank() == 1 && b.dim(0) == s.out, who, ": layer '", s.name, "' has a bias of ",
                        s.out, " but its bias parameter ", *m.bias, " ('", params[*m.bias].name,
                        "') has shape ", b.shape_string(), " (expected [", s.out, "])");
      } else if (m.bias) {
        detail::fail(who, ": layer '", s.name,
                     "' is registered without a bias but its mapping names bias parameter ", *m.bias,
                     " (register the layer with bias = true, or drop the bias from the mapping)");
      }
    }
    return kfac_preconditioner<State, G>(std::move(kf_), std::move(st_), std::move(map_));
  }

 private:
  gradapt::kfac kf_;
  State st_;
  std::vector<kfac_params> map_;
};

}  // namespace gradapt::train

#pragma once
/// @file
/// Shampoo (Gupta, Koren and Singer 2018, "Shampoo: Preconditioned Stochastic Tensor
/// Optimization"; Anil et al. 2020, "Scalable Second Order Optimization for Deep Learning"),
/// with blocking and grafting as in google-research's scalable_shampoo, on the host.
///
/// For a block X of a tensor's gradient, seen as a k-dimensional array (k = 2 for a matrix:
/// left and right statistics), at step t (1-based):
///
///     S_d ← β2·S_d + w·X_(d)·X_(d)ᵀ       d = 1..k, X_(d) the mode-d unfolding (k = 2: L += G·Gᵀ,
///                                         R += Gᵀ·G); β2 = w = 1 (sum) or w = 1 − β2 (EMA);
///                                         every `statistics_frequency` steps
///     M   ← M + (1 − β1)·(X − M)          only with beta1 > 0 (Distributed Shampoo's betas[0]);
///     M̂   = M / (1 − β1^t)                 with bias_correction; without beta1, M̂ = X
///     P_d = (S_d / c + r·I)^(−1/p)         p = 2k (−1/4 for a matrix) or inverse_exponents,
///                                         every `precondition_frequency` steps from
///                                         `start_preconditioning_step` (linalg/matrix_root.hpp,
///                                         or the shifted spectrum); c = 1 − β2^u with
///                                         bias_correction and β2 < 1, else 1
///     D_s = M̂ ×₁ P_1 ×₂ … ×ₖ P_k          (k = 2: P_L·G·P_R)
///     D_g = the grafted method's direction for M̂ (SGD, AdaGrad, RMSProp, Adam; its state
///           advances with X)
///     D   = D_s · ‖D_g‖_F / ‖D_s‖_F       (grafting: Shampoo's direction, the grafted step size)
///
/// Before `start_preconditioning_step`, and for a block with no successful root yet, D = D_g.
/// Tensors with fewer than two dimensions larger than 1 (biases, norm scales; unless
/// `precondition_1d`) or with a dimension larger than `skip_preconditioning_dim_size_gt` use
/// the grafted method alone (a diagonal preconditioner). `distributed_shampoo_defaults()`
/// (shampoo_options.hpp) gives the options of facebookresearch/optimizers' DistributedShampoo. The direction
/// then goes through the SGD chain (optim/sgd.hpp):
///
///     d = D + λ·p;   b ← μ·b + d;   u = b (or d + μ·b with Nesterov);   p ← p − η·u
///
/// so weight decay, momentum and the learning rate (with its schedule through
/// `step_args::lr` and the groups' `lr_scale` / `weight_decay`) are the chain stages every
/// preset uses. With a communicator, `step(comm, ...)` divides the roots among the ranks and
/// allgathers them; with `root_staleness >= 1` a background thread computes them while steps go
/// on. docs/algorithms/shampoo.md describes the blocking, the roots, the failure handling, the
/// distributed and asynchronous roots, and what is not built (CUDA).

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/linalg/newton_schulz.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/preset.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/shampoo_blocks.hpp"
#include "gradapt/optim/shampoo_grafting.hpp"
#include "gradapt/optim/shampoo_options.hpp"
#include "gradapt/optim/shampoo_root_worker.hpp"
#include "gradapt/optim/shampoo_state.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt {

namespace transform {

/// Shampoo's preconditioner as a chain stage (see the file comment and
/// docs/algorithms/shampoo.md): every tensor's gradient becomes its grafted direction D, from
/// block preconditioners (inverse p-th roots of per-block statistics) grafted to another
/// method's step size; the chain's later stages (weight decay, momentum, the learning rate)
/// then act on D. It is a preconditioner stage (optim/stage.hpp): the chain's first stage, its
/// state (`shampoo_state`: blocks, statistics, roots, graft state, the first moment) held in
/// the chain's state, its report returned by `chain::step`. `gradapt::shampoo` is the preset
/// chain; a chain of one's own:
///
///     gradapt::chain opt{gradapt::transform::scale_by_shampoo<>{.options = {.graft =
///     gradapt::shampoo_graft::adam}},
///                        gradapt::transform::add_decayed_weights{.weight_decay = 1e-4},
///                        gradapt::transform::scale_by_learning_rate{.lr = 1e-3}};
///
/// The stage reads the preconditioner's fields of `options` (blocking, statistics, roots,
/// graft, first moment, distribution); `lr`, `momentum`, `nesterov`, `weight_decay` and
/// `skip_weight_decay` are the later stages' (the preset maps them; the stage checks them
/// and otherwise ignores them).
///
/// @tparam L the linear-algebra backend of the roots and products (host memory)
template <class L = host_lapack>
struct scale_by_shampoo {
  /// The options (see shampoo_options).
  shampoo_options options{};
  /// The linear-algebra backend (copied into the state at init).
  L linalg{};
  /// The linear-algebra backend of the background roots (root_staleness >= 1), copied into the
  /// state's root thread at init; `linalg` when not set. Device memory needs it set, to a
  /// `stream_linalg_backend` on a second stream of the same device (a `cuda_linalg` of its own,
  /// not a copy of `linalg`: copies share cuBLAS/cuSOLVER handles, which one thread at a time
  /// may use); the roots' element work runs on its `elements(b)`.
  std::optional<L> root_linalg{};

  /// A preconditioner stage: required, no chain buffers, never reads p in the passes.
  static constexpr stage_spec traits{.uses_param = false, .preconditioner = true};
  /// The state for backend B, parameters V and gradients G.
  template <class B, class V, class G>
  using state_type = shampoo_state<L, B, V, G>;
  /// What `chain::step` returns.
  using report_type = shampoo_step_report;
  /// The element kernel: the identity (the passes read D where they would read g).
  template <class C>
  using kernel = gradapt::detail::optim::identity_kernel<C>;
  /// The identity kernel.
  template <class C>
  kernel<C> prepare(const step_context&) const {
    return {};
  }
  /// Throws gradapt::error naming the first invalid option (the chain calls it when built).
  void validate() const { validate(options); }
  /// Elements of one sharding unit of a tensor of `shape` (`shampoo_grain`): one row of
  /// blocks, or 1 for a tensor the graft alone preconditions.
  std::size_t shard_grain(std::span<const std::int64_t> shape) const { return shampoo_grain(shape, options); }
  /// Pushes the options that shape the result (what the distributed step also agrees on), for
  /// `chain::agreed_options`.
  template <class Out>
  void push_agreed_options(Out& out) const {
    for (const auto& v : agreed_values()) out.push(v.name, v.value);
  }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const shampoo_options& o) {
    constexpr const char* w = "shampoo";
    const auto finite = [](double v) { return std::isfinite(v); };
    gradapt::detail::require(finite(o.lr) && o.lr >= 0, w, ": lr is ", o.lr, " (expected finite and >= 0)");
    gradapt::detail::require(o.max_preconditioner_dim >= 1, w, ": max_preconditioner_dim is ",
                             o.max_preconditioner_dim,
                             " (expected >= 1: the largest side of a preconditioned block; 1024 is typical)");
    gradapt::detail::require(o.skip_preconditioning_dim_size_gt >= 1, w,
                             ": skip_preconditioning_dim_size_gt is ", o.skip_preconditioning_dim_size_gt,
                             " (expected >= 1: tensors with a larger dimension take the graft alone)");
    gradapt::detail::require(finite(o.beta2) && o.beta2 > 0 && o.beta2 <= 1, w, ": beta2 is ", o.beta2,
                             " (expected in (0, 1]: 1 sums the statistics, below 1 is an EMA)");
    gradapt::detail::require(o.statistics_frequency >= 1, w, ": statistics_frequency is 0 (expected >= 1)");
    gradapt::detail::require(o.precondition_frequency >= 1, w,
                             ": precondition_frequency is 0 (expected >= 1)");
    gradapt::detail::require(o.start_preconditioning_step >= 1, w,
                             ": start_preconditioning_step is 0 (expected >= 1; steps are counted from 1)");
    gradapt::detail::require(o.inverse_exponent_override >= 0, w, ": inverse_exponent_override is ",
                             o.inverse_exponent_override,
                             " (expected p >= 1 for the root S^(-1/p), or 0 for p = 2k)");
    const auto& r = o.root;
    gradapt::detail::require(r.method == root_method::eigen || r.method == root_method::coupled_newton, w,
                             ": root.method is ", int(r.method),
                             " (expected root_method::eigen or coupled_newton)");
    gradapt::detail::require(r.ridge == ridge_kind::absolute || r.ridge == ridge_kind::relative, w,
                             ": root.ridge is ", int(r.ridge),
                             " (expected ridge_kind::absolute or relative)");
    gradapt::detail::require(finite(r.epsilon) && r.epsilon >= 0, w, ": root.epsilon is ", r.epsilon,
                             " (expected a finite ridge >= 0)");
    gradapt::detail::require(finite(r.tolerance) && r.tolerance >= 0, w, ": root.tolerance is ", r.tolerance,
                             " (expected finite and >= 0)");
    gradapt::detail::require(r.max_iterations >= 1, w, ": root.max_iterations is ", r.max_iterations,
                             " (expected >= 1)");
    gradapt::detail::require(r.max_error_ratio >= 1, w, ": root.max_error_ratio is ", r.max_error_ratio,
                             " (expected >= 1)");
    gradapt::detail::require(r.max_error > 0, w, ": root.max_error is ", r.max_error, " (expected > 0)");
    gradapt::detail::require(r.power_iterations >= 1, w, ": root.power_iterations is ", r.power_iterations,
                             " (expected >= 1)");
    gradapt::detail::require(finite(r.power_tolerance) && r.power_tolerance >= 0, w,
                             ": root.power_tolerance is ", r.power_tolerance, " (expected finite and >= 0)");
    gradapt::detail::require(
        o.max_consecutive_failures >= 1, w,
        ": max_consecutive_failures is 0 (expected >= 1: failures in a row before the step throws)");
    gradapt::detail::require(
        o.root_staleness <= o.precondition_frequency, w, ": root_staleness is ", o.root_staleness,
        " but precondition_frequency is ", o.precondition_frequency,
        " (expected root_staleness <= precondition_frequency: the roots started at one due "
        "step are installed before the next one starts)");
    gradapt::detail::require(o.graft <= shampoo_graft::adam, w, ": graft is ", int(o.graft),
                             " (expected none, sgd, adagrad, rmsprop or adam)");
    gradapt::detail::require(finite(o.graft_beta2) && o.graft_beta2 >= 0 && o.graft_beta2 < 1, w,
                             ": graft_beta2 is ", o.graft_beta2, " (expected in [0, 1); 0.999 is typical)");
    gradapt::detail::require(finite(o.graft_epsilon) && o.graft_epsilon > 0, w, ": graft_epsilon is ",
                             o.graft_epsilon, " (expected finite and > 0)");
    gradapt::detail::require(finite(o.momentum) && o.momentum >= 0 && o.momentum <= 1, w, ": momentum is ",
                             o.momentum, " (expected in [0, 1]; 0 keeps no buffer)");
    gradapt::detail::require(!o.nesterov || o.momentum > 0, w, ": nesterov is set but momentum is ",
                             o.momentum, " (Nesterov momentum needs momentum > 0)");
    gradapt::detail::require(finite(o.weight_decay) && o.weight_decay >= 0, w, ": weight_decay is ",
                             o.weight_decay, " (expected finite and >= 0)");
    gradapt::detail::require(finite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1, w, ": beta1 is ", o.beta1,
                             " (expected in [0, 1): the first moment's EMA coefficient; 0 keeps none)");
    gradapt::detail::require(o.merge_from <= shampoo_merge::last, w, ": merge_from is ", int(o.merge_from),
                             " (expected shampoo_merge::first or last)");
    gradapt::detail::require(o.spectrum <= shampoo_spectrum::shift, w, ": spectrum is ", int(o.spectrum),
                             " (expected shampoo_spectrum::clamp or shift)");
    gradapt::detail::require(
        o.spectrum == shampoo_spectrum::clamp || r.method == root_method::eigen, w,
        ": spectrum is shift but root.method is coupled_newton (the shifted spectrum is the "
        "eigen root's; use spectrum clamp with Newton)");
    gradapt::detail::require(o.preconditioner <= shampoo_preconditioner::spectral_descent, w,
                             ": preconditioner is ", int(o.preconditioner),
                             " (expected root_inverse, eigenvalue_corrected or spectral_descent)");
    if (o.preconditioner == shampoo_preconditioner::spectral_descent)
      gradapt::validate(o.newton_schulz, "shampoo: newton_schulz");
    if (o.preconditioner == shampoo_preconditioner::eigenvalue_corrected) {
      gradapt::detail::require(o.eigenbasis <= shampoo_eigenbasis::qr, w, ": eigenbasis is ",
                               int(o.eigenbasis), " (expected eigh or qr)");
      gradapt::detail::require(o.qr_iterations >= 1, w, ": qr_iterations is 0 (expected >= 1)");
      gradapt::detail::require(finite(o.qr_tolerance) && o.qr_tolerance >= 0, w, ": qr_tolerance is ",
                               o.qr_tolerance, " (expected finite and >= 0)");
      gradapt::detail::require(finite(o.corrected_exponent) && o.corrected_exponent > 0, w,
                               ": corrected_exponent is ", o.corrected_exponent,
                               " (expected finite and > 0)");
      gradapt::detail::require(
          o.statistics_frequency == 1, w, ": statistics_frequency is ", o.statistics_frequency,
          " but eigenvalue-corrected Shampoo updates its factors and its corrected second "
          "moment every step (expected 1)");
      gradapt::detail::require(o.root_staleness == 0, w, ": root_staleness is ", o.root_staleness,
                               " but eigenvalue-corrected Shampoo refreshes its eigenbases inside the step "
                               "(expected 0)");
      gradapt::detail::require(
          o.inverse_exponent_override == 0 && o.inverse_exponents.empty(), w,
          ": inverse_exponent_override / inverse_exponents are set but eigenvalue-corrected "
          "Shampoo rotates every factor and takes corrected_exponent for its second moment");
    }
    for (std::size_t i = 0; i < o.inverse_exponents.size(); ++i) {
      const auto& e = o.inverse_exponents[i];
      gradapt::detail::require(e.order >= 1 && e.order <= static_cast<std::size_t>(max_rank), w,
                               ": inverse_exponents[", i, "].order is ", e.order,
                               " (expected a block order from 1 to ", max_rank, ")");
      gradapt::detail::require(e.dimension >= -1 && e.dimension < static_cast<int>(e.order), w,
                               ": inverse_exponents[", i, "].dimension is ", e.dimension,
                               " (expected -1 for every factor, or 0 to ", e.order - 1, ")");
      gradapt::detail::require(e.p >= 0, w, ": inverse_exponents[", i, "].p is ", e.p,
                               " (expected p >= 1 for the root S^(-1/p), or 0: not preconditioned)");
      for (std::size_t j = 0; j < i; ++j)
        gradapt::detail::require(
            o.inverse_exponents[j].order != e.order || o.inverse_exponents[j].dimension != e.dimension, w,
            ": inverse_exponents[", i, "] repeats order ", e.order, " dimension ", e.dimension,
            " of inverse_exponents[", j, "] (expected one entry per order and dimension)");
    }
  }

  /// p of factor d of a block with k factors (see shampoo_options::inverse_exponents).
  static int exponent(const shampoo_options& o, std::size_t k, std::size_t d) {
    int all = -1;
    for (const auto& e : o.inverse_exponents) {
      if (e.order != k) continue;
      if (e.dimension == static_cast<int>(d)) return e.p;
      if (e.dimension == -1) all = e.p;
    }
    if (all >= 0) return all;
    return o.inverse_exponent_override != 0 ? o.inverse_exponent_override : static_cast<int>(2 * k);
  }

  /// The state for `params` on element backend `b` (whose memory is L's), the chain's `init`
  /// calls it: block layouts, zero statistics and roots, graft state, direction buffers, one
  /// root workspace per block size, and scratch (`linalg` copied into it).
  /// @throws gradapt::error for a parameter whose gradient and value shapes differ (param_list
  ///         prevents it) or a block size the linear-algebra backend cannot take; on device
  ///         memory, for root.method coupled_newton (its iteration runs in host memory) and for
  ///         root_staleness >= 1 without `root_linalg` (or with an L that is not a
  ///         `stream_linalg_backend` of B), naming the option
  ///
  /// With `slices` (the sharded optimizer's), list entry t is elements [slices[t].offset, +
  /// its size) of a tensor of `slices[t].shape`, cut at multiples of `shard_grain`: the state
  /// holds that slice's blocks (`shampoo_slice_plan`), which step as the whole tensor's do.
  /// @throws gradapt::error also when `slices` is neither empty nor one per tensor, or a
  ///         slice cuts a block
  template <optimizer_backend B, element V, element G, class Options>
  requires std::same_as<typename B::space, typename L::space> state_type<B, V, G> init_state(
      const B& b, const param_list<V, G, typename B::space, Options>& params,
      std::span<const preconditioner_slice> slices = {})
  const {
    constexpr bool on_host = std::same_as<typename B::space, host_space>;
    gradapt::detail::require(slices.empty() || slices.size() == params.size(), "shampoo: ", slices.size(),
                             " slices for ", params.size(), " tensors (expected none or one per tensor)");
    if constexpr (!on_host) {
      const char* who = "shampoo: on device memory";
      if (options.preconditioner == shampoo_preconditioner::root_inverse) {
        gradapt::detail::require(options.root.method == root_method::eigen, who,
                                 " the roots are computed by root.method eigen (root.method is "
                                 "coupled_newton, whose iteration runs in host memory)");
        if (options.root_staleness > 0) {
          if constexpr (stream_linalg_backend<L, B>)
            gradapt::detail::require(
                root_linalg.has_value(), who, " the background roots (root_staleness is ",
                options.root_staleness,
                ") run on root_linalg, which is not set (give the stage a linear-algebra backend of its "
                "own on a second stream of the device)");
          else
            gradapt::detail::fail(who, " the background roots (root_staleness is ", options.root_staleness,
                                  ") need a linear-algebra backend that names the element backend of its "
                                  "stream (stream_linalg_backend: cuda_linalg with gradapt::cuda)");
        }
      }
    }
    using St = state_type<B, V, G>;
    using C = typename St::compute_type;
    const L& la = linalg;
    St st;
    st.la_ = la;
    st.graft_ = options.graft;
    st.beta1_ = options.beta1;
    st.bias_correction_ = options.bias_correction;
    st.spectrum_ = options.spectrum;
    st.preconditioner_ = options.preconditioner;
    st.max_failures_ = options.max_consecutive_failures;
    const bool spectral = options.preconditioner == shampoo_preconditioner::spectral_descent;
    const bool corrected = options.preconditioner == shampoo_preconditioner::eigenvalue_corrected;
    std::size_t max_ns = 0;
    if constexpr (!qr_linalg_backend<L>)
      gradapt::detail::require(
          !corrected || options.eigenbasis != shampoo_eigenbasis::qr,
          "shampoo: eigenbasis qr needs a linear-algebra backend with qr() (host_lapack has "
          "it); use eigenbasis eigh with this one");
    std::size_t max_block = 0, max_roots = 0, total_mats = 0, total_elems = 0;
    const bool has_state = gradapt::detail::shampoo_impl::graft_has_state(options.graft);
    st.t_.resize(params.size());
    for (std::size_t t = 0; t < params.size(); ++t) {
      auto& x = st.t_[t];
      const auto& e = params[t];
      x.name = e.name;
      x.shape.assign(e.value.shape().begin(), e.value.shape().end());
      x.size = e.value.size();
      if (slices.empty()) {
        x.layout = shampoo_plan(e.value.shape(), options);
      } else {
        x.layout =
            shampoo_slice_plan(slices[t].shape, options, slices[t].offset, e.value.size(), x.first_block);
        x.offset = slices[t].offset;
        x.whole = slices[t].shape;
        x.sliced = true;
        x.whole_layout = shampoo_plan(x.whole, options);
        x.whole_size = 1;
        for (const auto d : x.whole) x.whole_size *= static_cast<std::size_t>(d);
        if (!x.whole_layout.diagonal) {
          const auto& m = x.whole_layout.merged;
          x.band_rows =
              static_cast<std::size_t>(std::min<std::int64_t>(options.max_preconditioner_dim, m[0]));
          x.band = 1;
          x.per_band = 1;
          for (std::size_t d = 1; d < m.size(); ++d) {
            x.band *= static_cast<std::size_t>(m[d]);
            x.per_band *= static_cast<std::size_t>((m[d] - 1) / options.max_preconditioner_dim + 1);
          }
        }
      }
      x.dir = b.template allocate<C>(x.size);  // zeroed
      if (has_state) x.graft = b.template allocate<C>(x.size);
      if (options.beta1 > 0) x.mom = b.template allocate<C>(x.size);
      const std::size_t k = x.layout.merged.size();
      for (const auto& r : x.layout.blocks) {
        typename St::block_t bl;
        bl.k = k;
        std::size_t elems = 1, mats = 0;
        for (std::size_t d = 0; d < k; ++d) {
          // Spectral descent keeps no factors (p 0); eigenvalue-corrected rotates every one (p
          // is then only a mark; its root is the corrected_exponent of the second moment).
          bl.p[d] = spectral ? 0 : corrected ? 1 : exponent(options, k, d);
          bl.n[d] = r.size[d];
          bl.off[d] = mats;
          if (!spectral) mats += static_cast<std::size_t>(r.size[d] * r.size[d]);
          elems *= static_cast<std::size_t>(r.size[d]);
          if (bl.p[d] != 0) add_workspace(st, la, executor(b), r.size[d], options.root.method);
          if (corrected) {
            st.workspace(r.size[d]).e.reserve(la, executor(b), r.size[d]);
            if (options.eigenbasis == shampoo_eigenbasis::qr)
              st.workspace(r.size[d]).qr.reserve(la, executor(b), r.size[d]);
          }
        }
        bl.stats.assign(mats, C(0));
        bl.roots.assign(mats, C(0));
        bl.at = total_mats;
        total_mats += mats;
        if (spectral) {
          bl.ready = true;  // nothing to compute before the first step
          max_ns = std::max(max_ns, newton_schulz_workspace(bl.n[0], bl.n[1]));
        }
        if (corrected) {  // the identity basis until the first refresh; V = 0
          for (std::size_t d = 0; d < k; ++d)
            for (std::int64_t i = 0; i < bl.n[d]; ++i)
              bl.roots[bl.off[d] + static_cast<std::size_t>(i * bl.n[d] + i)] = C(1);
          bl.ready = true;
          bl.corr.assign(elems, C(0));
          if (options.beta1 > 0) bl.mrot.assign(elems, C(0));  // Q = I, M = 0: Qᵀ M Q = 0
          bl.at_e = total_elems;
          total_elems += elems;
        }
        max_block = std::max(max_block, elems);
        max_roots = std::max(max_roots, mats);
        x.blocks.push_back(std::move(bl));
      }
    }
    for (auto* v : {&st.xb_, &st.ab_, &st.db_, &st.y0_, &st.y1_}) *v = b.template allocate<C>(max_block);
    if (options.beta1 > 0 || corrected) st.mb_ = b.template allocate<C>(max_block);
    st.rs_ = b.template allocate<C>(max_roots);
    if constexpr (!on_host) {  // the statistics and roots in device memory (host copies in the blocks)
      st.dstats_ = b.template allocate<C>(total_mats);
      st.droots_ = b.template allocate<C>(total_mats);
      st.dcorr_ = b.template allocate<C>(total_elems);  // zeros, as the blocks' corr and mrot
      if (options.beta1 > 0) st.dmrot_ = b.template allocate<C>(total_elems);
      if (corrected)  // the identity bases
        for (auto& x : st.t_)
          for (auto& bl : x.blocks) {
            const auto n = static_cast<std::int64_t>(bl.roots.size());
            b.copy(tensor_view<const C, host_space>::vector(bl.roots.data(), n),
                   tensor_view<C, typename B::space>::vector(st.roots_at(bl), n));
          }
    }
    st.ns_ = b.template allocate<C>(max_ns);
    st.staleness_ = options.root_staleness;
    st.deterministic_ = options.deterministic_roots;
    for (std::size_t t = 0; t < st.t_.size(); ++t)
      for (std::size_t j = 0; j < st.t_[t].blocks.size(); ++j) {
        auto& bl = st.t_[t].blocks[j];
        if (spectral) continue;  // no roots to compute
        typename St::ref_t ref{t, j, 0, bl.roots.size()};
        for (std::size_t d = 0; d < bl.k; ++d) {
          const auto n = static_cast<std::uint64_t>(bl.n[d]);
          if (bl.p[d] != 0) ref.cost += n * n * n;
        }
        st.refs_.push_back(ref);
        if (options.root_staleness > 0) {
          bl.snap.assign(bl.stats.size(), C(0));  // a device's: the checkpoint's host copy
          if constexpr (on_host) bl.pend.assign(bl.roots.size(), C(0));
        }
      }
    if (options.root_staleness > 0 && options.preconditioner == shampoo_preconditioner::root_inverse) {
      // (spectral descent has no roots; eigenvalue-corrected refreshes in the step, see validate)
      st.tasks_.reserve(st.refs_.size());
      std::vector<std::pair<std::int64_t, typename St::workspace_t*>> ws;
      for (auto& [n, w] : st.ws_) ws.emplace_back(n, w.get());
      using worker_t = typename decltype(st.worker_)::element_type;
      if constexpr (on_host) {
        st.worker_ =
            std::make_unique<worker_t>(root_linalg.value_or(la), host{.threads = 1}, recipe(), std::move(ws));
      } else if constexpr (stream_linalg_backend<L, B>) {  // checked above
        st.dsnap_ = b.template allocate<C>(total_mats);
        st.dpend_ = b.template allocate<C>(total_mats);
        st.worker_ =
            std::make_unique<worker_t>(*root_linalg, root_linalg->elements(b), recipe(), std::move(ws));
      }
    }
    return st;
  }

  /// The directions of one step (the chain's `step` calls it): the statistics, the roots when
  /// due (computed here, or started in the worker thread and installed `root_staleness` steps
  /// later; with a communicator, divided among the ranks), every tensor's direction (see the
  /// file comment) into the state's direction buffers.
  ///
  /// Distributed roots (`chain::step(comm, ...)`): the blocks are assigned to ranks by
  /// `lpt_assign` over their cost Σ n_d³ (deterministic: every rank derives the same plan from
  /// the layout and the world size), each rank computes its own blocks' roots, and one
  /// allgather gives every rank all of them, so each rank's root work falls as 1/N. Every rank
  /// must call it at the same steps with the same (averaged) gradients; the result is the same
  /// bits as the step on one rank. Checked across ranks: at the first call on a world (one
  /// small allreduce) the layout, the step count, every option that shapes the result
  /// (shampoo_distributed.hpp: blocking, statistics, roots, graft, first moment) and the
  /// chain's other stages' options (momentum, weight decay, lr); at every exchange the step,
  /// the step's learning rate and a hash of the statistics the roots come from. A difference
  /// is a gradapt::error on every rank naming the value and its range across ranks. With
  /// root_staleness >= 1 each rank's worker thread computes its blocks and the exchange
  /// happens at the installing step (deterministic_roots must be true). The world may change
  /// between calls (the plan follows it; roots in flight restart from their copied statistics
  /// under the new plan).
  /// @throws gradapt::error when `params` does not match the state (count, names, shapes), the
  ///         step's learning rate is not finite or negative, a block's roots failed
  ///         `max_consecutive_failures` computations in a row (naming the parameter and the
  ///         block; the parameters and the graft state are left unchanged, the statistics have
  ///         advanced, and every later step throws until `load` restores a checkpoint), or for
  ///         a disagreement across ranks
  /// @return the step's report: the blocks whose roots it installed, and every failed root
  ///         computation as it happens (block, factor, reason, failures in a row and in all),
  ///         the block keeping its last good roots (the graft's direction before any)
  template <class Comm, optimizer_backend B, element V, element G, class Options, class Extra>
  shampoo_step_report direct(Comm& comm, const B& b,
                             const param_list<V, G, typename B::space, Options>& params,
                             state_type<B, V, G>& st, const step_context& ctx, const Extra& extra) const {
    return step_impl(comm, b, params, st, ctx, extra);
  }

 private:
  template <class Comm, class B, class V, class G, class Options, class Extra>
  shampoo_step_report step_impl(Comm& comm, const B& b,
                                const param_list<V, G, typename B::space, Options>& params,
                                state_type<B, V, G>& st, const step_context& ctx, const Extra& extra) const {
    using C = compute_t<V>;
    using Sp = typename B::space;
    constexpr bool on_host = std::same_as<Sp, host_space>;
    constexpr bool dist = !std::is_same_v<Comm, gradapt::detail::optim::no_comm>;
    constexpr const char* who = "shampoo::step";
    gradapt::detail::require(
        !st.failed_, who, ": the state stopped after a block's roots failed ", st.max_failures_,
        " times in a row or the ranks' statistics differed; restore a checkpoint with load()");
    // This rank's input errors travel through the agreement of a distributed step that
    // communicates, so every rank throws instead of waiting in a collective for this one.
    std::string bad;
    try {
      gradapt::detail::require(params.size() == st.t_.size(), who, ": the parameter list holds ",
                               params.size(), " tensors but the state was created for ", st.t_.size(),
                               " (create the state with init() for this list)");
      for (std::size_t t = 0; t < params.size(); ++t) {
        const auto& e = params[t];
        const auto& x = st.t_[t];
        gradapt::detail::require(e.name == x.name && std::ranges::equal(e.value.shape(), x.shape), who,
                                 ": parameter ", t, " is '", e.name, "' of shape ", e.value.shape_string(),
                                 " but the state holds '", x.name,
                                 "' of another shape or name (create the state with init() for this list)");
      }
      gradapt::detail::require(
          st.staleness_ == options.root_staleness && st.deterministic_ == options.deterministic_roots, who,
          ": the state was created with root_staleness ", st.staleness_, " and deterministic_roots ",
          st.deterministic_, " but this optimizer has ", options.root_staleness, " and ",
          options.deterministic_roots, " (create the state with this optimizer's init())");
      gradapt::detail::require(st.beta1_ == options.beta1 && st.bias_correction_ == options.bias_correction &&
                                   st.spectrum_ == options.spectrum && st.graft_ == options.graft,
                               who, ": the state was created with beta1 ", st.beta1_, ", bias_correction ",
                               st.bias_correction_, ", spectrum ", to_string(st.spectrum_), " and graft ",
                               to_string(st.graft_), " but this optimizer has ", options.beta1, ", ",
                               options.bias_correction, ", ", to_string(options.spectrum), " and ",
                               to_string(options.graft), " (create the state with this optimizer's init())");
      if (ctx.lr) {
        gradapt::detail::require(std::isfinite(*ctx.lr) && *ctx.lr >= 0, who,
                                 ": the step's learning rate is ", *ctx.lr,
                                 " (expected finite and >= 0; check the schedule)");
      }
      if constexpr (dist)
        gradapt::detail::require(st.staleness_ == 0 || st.deterministic_, who,
                                 ": the distributed step installs roots at the same step on every rank; set "
                                 "deterministic_roots = true (root_staleness is ",
                                 st.staleness_, ")");
    } catch (const error& e) {
      bad = e.what();
    }
    const std::uint64_t t = ctx.step;
    const bool spectral = options.preconditioner == shampoo_preconditioner::spectral_descent;
    const bool stats_due = !spectral && (t - 1) % options.statistics_frequency == 0;
    // Spectral descent and eigenvalue-corrected blocks use their preconditioner from step 1
    // unless a graft takes them before start_preconditioning_step (the peer's rule).
    const bool graft_blocks = options.graft != shampoo_graft::none && options.graft_preconditioned;
    const bool preconditioning =
        t >= options.start_preconditioning_step ||
        (options.preconditioner != shampoo_preconditioner::root_inverse && !graft_blocks);
    const bool roots_due = !spectral && t >= options.start_preconditioning_step &&
                           (t - options.start_preconditioning_step) % options.precondition_frequency == 0;
    if constexpr (dist) {
      const bool exchanges = (roots_due && st.staleness_ == 0) ||
                             (st.pending_step_ != 0 && t == st.pending_step_ + st.staleness_) ||
                             !st.x_.planned_for(comm.size(), comm.rank());
      const agreed_value at[] = {{"step", static_cast<double>(t)},
                                 {"step lr", ctx.lr ? *ctx.lr : options.lr}};
      if (exchanges)
        agree_values(comm, b, "shampoo::step", std::span<const agreed_value>(at), bad);
      else if (!bad.empty())
        throw error(bad);
      plan(comm, b, st, extra);
    } else if (!bad.empty()) {
      throw error(bad);
    }
    st.report_.clear();
    st.installed_ = 0;

    // The element work runs through the backend (one thread on the host, as the products).
    const auto ex = executor(b);
    if (st.relaunch_) launch(st, ex, dist);
    if (stats_due)
      for (std::size_t i = 0; i < st.t_.size(); ++i)
        for (std::size_t j = 0; j < st.t_[i].blocks.size(); ++j)
          block_stats(st, ex, st.t_[i], j, params[i].grad.data());
    // Roots in flight (root_staleness >= 1).
    if (st.pending_step_ != 0 &&
        (t == st.pending_step_ + st.staleness_ || (!st.deterministic_ && st.worker_->idle())))
      finish_roots(comm, ex, st);
    if (roots_due) {
      if (st.staleness_ == 0) {
        compute_roots(comm, ex, st, t);
      } else {
        for (const auto& r : st.refs_) {
          auto& bl = st.t_[r.t].blocks[r.j];
          if constexpr (on_host) {
            std::copy(bl.stats.begin(), bl.stats.end(), bl.snap.begin());
          } else {
            const auto n = static_cast<std::int64_t>(bl.stats.size());
            ex.apply(gradapt::detail::copy_to{}, tensor_view<C, Sp>::vector(st.snap_at(bl), n),
                     tensor_view<const C, Sp>::vector(st.stats_at(bl), n));
          }
        }
        st.pending_step_ = t;
        launch(st, ex, dist);
      }
    }

    const double b2 = options.graft_beta2;
    const gradapt::detail::shampoo_impl::graft_kernel<C> gk{C(b2), C(1.0 - b2), C(options.graft_epsilon),
                                                            C(1.0 - std::pow(b2, static_cast<double>(t)))};
    // The first moment (beta1 > 0): m ← m + (1 − β1)·(g − m), divided by 1 − β1^t when
    // bias-corrected; it is what the blocks precondition and the graft divides.
    const C w1 = C(1.0 - options.beta1);
    const double bc2 = root_bias(t);  // eigenvalue-corrected: V's bias correction
    const C bc1 = C(options.bias_correction ? 1.0 - std::pow(options.beta1, static_cast<double>(t)) : 1.0);
    namespace si = gradapt::detail::shampoo_impl;
    for (std::size_t i = 0; i < st.t_.size(); ++i) {
      auto& x = st.t_[i];
      const auto g = tensor_view<const G, Sp>::vector(params[i].grad.data(), std::int64_t(x.size));
      const auto vec = [&](auto& v) { return tensor_view<C, Sp>::vector(v.data(), std::int64_t(x.size)); };
      const bool has_state = x.graft.size() != 0, has_mom = x.mom.size() != 0;
      if (has_mom) ex.apply(si::moment_update<C>{w1}, vec(x.mom), g);
      if (x.layout.diagonal) {
        const auto m = [&] { return tensor_view<const C, Sp>::vector(x.mom.data(), std::int64_t(x.size)); };
        si::with_graft(options.graft, [&](auto k) {
          const si::graft_direction<C, k.value> gd{gk, bc1};
          if (has_mom && has_state)
            ex.apply(gd, vec(x.dir), g, m(), vec(x.graft));
          else if (has_mom)
            ex.apply(si::graft_direction_of_moment<C, k.value>{gk, bc1}, vec(x.dir), g, m());
          else if (has_state)
            ex.apply(gd, vec(x.dir), g, vec(x.graft));
          else
            ex.apply(gd, vec(x.dir), g);
        });
        continue;
      }
      for (std::size_t j = 0; j < x.blocks.size(); ++j)
        block_direction(st, ex, x, j, g.data(), gk, bc1, w1, has_state, preconditioning, bc2);
    }
    st.steps_ = t;
    return {t, st.installed_, std::move(st.report_)};
  }

  /// Where the direction's element work runs: gradapt::host on one thread (the products run on
  /// one BLAS thread too) for host memory, `b` itself for a device's.
  template <class B>
  static auto executor(const B& b) {
    if constexpr (std::same_as<typename B::space, host_space>) {
      (void)b;
      return host{.threads = 1};
    } else {
      return b;
    }
  }

  /// What block_roots needs besides the block: the root options and the spectrum treatment.
  gradapt::detail::shampoo_impl::root_recipe recipe() const { return {options.root, options.spectrum}; }
  /// What block_eigenbases needs: the refresh method, the ridge and QR's iterations.
  gradapt::detail::shampoo_impl::basis_recipe basis_recipe() const {
    return {options.eigenbasis, options.root.epsilon, options.qr_iterations, options.qr_tolerance,
            options.root.retry_in_double};
  }
  /// The divisor of the statistics before the roots computed at step t: 1 − β2^u with u the
  /// statistics updates up to t (bias_correction and beta2 < 1), else 1.
  double root_bias(std::uint64_t t) const {
    if (!options.bias_correction || options.beta2 >= 1.0 || t == 0) return 1.0;
    const auto u = static_cast<double>((t - 1) / options.statistics_frequency + 1);
    return 1.0 - std::pow(options.beta2, u);
  }

  template <class St, class LA, class Ex>
  static void add_workspace(St& st, const LA& la, const Ex& ex, std::int64_t n, root_method method) {
    for (const auto& w : st.ws_)
      if (w.first == n) return;
    st.ws_.emplace_back(n, std::make_unique<typename St::workspace_t>(la, n));
    st.ws_.back().second->reserve(la, ex, method);  // the first root allocates nothing either
  }

  // The distributed plan and the owner exchange (shampoo_distributed.hpp).
  template <class Comm, class B, class St, class Extra>
  void plan(Comm& comm, const B& b, St& st, const Extra& extra) const;
  // The options the distributed plan agrees on besides the layout (shampoo_distributed.hpp).
  std::array<agreed_value, 33> agreed_values() const;
  template <class St>
  static bool owns(const St& st, std::size_t i, bool dist);
  template <class St>
  static std::uint64_t stats_hash(const St& st, bool snapshot);
  template <class Comm, class Ex, class St>
  static void exchange(Comm& comm, const Ex& ex, St& st, std::uint64_t step, std::uint64_t hash,
                       const std::string& local_error = {});
  template <class St>
  static typename St::compute_type* exchange_out(St& st, std::size_t i);
  template <class St>
  static void exchange_status(St& st, std::size_t i, root_status status, std::size_t factor);
  // The roots of a step (shampoo_roots.hpp).
  template <class St, class Ex>
  void launch(St& st, const Ex& ex, bool dist) const;
  template <class Comm, class Ex, class St>
  static void finish_roots(Comm& comm, const Ex& ex, St& st);
  template <class Ex, class St>
  static void to_host(const Ex& ex, St& st, bool snapshot);
  template <class Comm, class Ex, class St>
  void compute_roots(Comm& comm, const Ex& ex, St& st, std::uint64_t t) const;
  template <class St, class Ex, class C>
  static void install(St& st, const Ex& ex, std::size_t i, root_status status, std::size_t factor,
                      const C* roots, int rank, std::uint64_t from);
  // The statistics (shampoo_statistics.hpp).
  template <class St, class Ex, class Tensor, class G>
  void block_stats(St& st, const Ex& ex, Tensor& x, std::size_t j, const G* g) const;
  template <class Block>
  static std::pair<std::int64_t, std::int64_t> split(const Block& bl, std::size_t d);

  /// Block j of tensor x: gather, graft, direction (preconditioned when the block has roots),
  /// scatter. The element work and the products run on `ex` (executor()) and L.
  template <class St, class Ex, class Tensor, class G, class GK, class C>
  void block_direction(St& st, const Ex& ex, Tensor& x, std::size_t j, const G* g, const GK& gk, C bc1, C w1,
                       bool has_state, bool preconditioning, double bc2) const {
    namespace si = gradapt::detail::shampoo_impl;
    using Sp = typename Ex::space;
    const auto v = [](C* p, std::size_t n) { return tensor_view<C, Sp>::vector(p, std::int64_t(n)); };
    const auto cv = [](const C* p, std::size_t n) {
      return tensor_view<const C, Sp>::vector(p, std::int64_t(n));
    };
    auto& bl = x.blocks[j];
    const auto& range = x.layout.blocks[j];
    std::size_t elems = 1;
    for (std::size_t d = 0; d < bl.k; ++d) elems *= static_cast<std::size_t>(bl.n[d]);
    const bool has_mom = x.mom.size() != 0;
    C* xb = st.xb_.data();
    C* ab = st.ab_.data();
    C* db = st.db_.data();
    C* mb = has_mom ? st.mb_.data() : xb;  // what is preconditioned: g, or m / (1 − β1^t)
    si::for_runs(x.layout.merged, range, [&](std::size_t flat, std::size_t at, std::size_t run) {
      ex.apply(si::gather_as<C>{}, v(xb + at, run),
               tensor_view<const G, Sp>::vector(g + flat, std::int64_t(run)));
      if (has_mom) ex.apply(si::divided_by<C>{bc1}, v(mb + at, run), cv(x.mom.data() + flat, run));
      if (has_state) ex.apply(gradapt::detail::copy_to{}, v(ab + at, run), cv(x.graft.data() + flat, run));
    });
    si::with_graft(options.graft, [&](auto k) {  // m̂ is gathered corrected
      if (has_state)
        ex.apply(si::graft_direction<C, k.value, false>{gk, C(1)}, v(db, elems), cv(xb, elems), cv(mb, elems),
                 v(ab, elems));
      else
        ex.apply(si::graft_direction_of_moment<C, k.value, false>{gk, C(1)}, v(db, elems), cv(xb, elems),
                 cv(mb, elems));
    });
    C* y = nullptr;  // the preconditioned direction D_s, when the block has one this step
    const auto kind = options.preconditioner;
    // Eigenvalue-corrected: what is rotated into the eigenbasis and divided there (without a
    // first moment, the rotated G itself, kept in mb).
    const C* rotated = nullptr;
    if (kind == shampoo_preconditioner::eigenvalue_corrected) {
      // V ← β2·V + w·(Q_1ᵀ ×₁ … G)², every step, in the bases just refreshed.
      const C* r = product(st, bl, xb, true);
      const double beta2 = options.beta2;
      ex.apply(si::rotated_second_moment<C>{C(beta2), C(beta2 == 1.0 ? 1.0 : 1.0 - beta2), beta2 == 1.0},
               v(st.corr_at(bl), elems), cv(r, elems));
      if (bl.mrot.empty()) {
        ex.apply(gradapt::detail::copy_to{}, v(st.mb_.data(), elems), cv(r, elems));
        rotated = st.mb_.data();
      } else if (bl.mrot_valid) {
        // Qᵀ M Q follows M's update while the bases stand: M' ← M' + (1 − β1)·(Qᵀ G Q − M').
        ex.apply(si::moment_update<C>{w1}, v(st.mrot_at(bl), elems), cv(r, elems));
        rotated = st.mrot_at(bl);
      } else {  // new bases at this step: M' = Qᵀ M Q from M (mb is free: the graft has read it)
        si::for_runs(x.layout.merged, range, [&](std::size_t flat, std::size_t at, std::size_t run) {
          ex.apply(gradapt::detail::copy_to{}, v(mb + at, run), cv(x.mom.data() + flat, run));
        });
        const C* m = product(st, bl, mb, true);
        ex.apply(gradapt::detail::copy_to{}, v(st.mrot_at(bl), elems), cv(m, elems));
        bl.mrot_valid = true;
        rotated = st.mrot_at(bl);
      }
    }
    if (preconditioning && bl.ready && kind == shampoo_preconditioner::eigenvalue_corrected) {
      // M̂' = Qᵀ M Q / (1 − β1^t) (or Qᵀ G Q); M̂' / ((V / c)^(1/p) + ε), rotated back (into
      // xb: g is no longer needed).
      ex.apply(
          si::corrected_quotient<C>{bl.mrot.empty() ? C(1) : bc1, C(bc2), C(options.root.epsilon),
                                    C(1.0 / options.corrected_exponent), options.corrected_exponent == 2.0},
          v(xb, elems), cv(rotated, elems), cv(st.corr_at(bl), elems));
      y = product(st, bl, xb);
    }
    if (preconditioning && bl.ready && kind == shampoo_preconditioner::root_inverse) y = product(st, bl, mb);
    if (preconditioning && bl.ready && kind == shampoo_preconditioner::spectral_descent) {
      // The block's Newton–Schulz orthogonalization.
      y = st.y0_.data();
      ex.apply(gradapt::detail::copy_to{}, v(y, elems), cv(mb, elems));
      newton_schulz(st.la_, ex, tensor_view<C, Sp>(y, {bl.n[0], bl.n[1]}), v(st.ns_.data(), st.ns_.size()),
                    options.newton_schulz);
      if (options.scale_by_aspect && bl.n[0] > bl.n[1])
        ex.apply(gradapt::detail::multiply_by{double(C(std::sqrt(double(bl.n[0]) / double(bl.n[1]))))},
                 v(y, elems));
    }
    if (y != nullptr && options.graft != shampoo_graft::none && options.graft_preconditioned) {
      // D_s scaled to the graft's norm: ‖D_g‖ / ‖D_s‖ (the backend's sums of squares, in double)
      const double ns = ex.reduce(reduction::sum_squares, v(y, elems));
      const double ng = ex.reduce(reduction::sum_squares, v(db, elems));
      const C scale = ns > 0 ? C(std::sqrt(ng) / std::sqrt(ns)) : C(0);
      ex.apply(gradapt::detail::multiply_by{double(scale)}, v(y, elems));
    }
    const C* out = y != nullptr ? y : db;
    si::for_runs(x.layout.merged, range, [&](std::size_t flat, std::size_t at, std::size_t run) {
      ex.apply(gradapt::detail::copy_to{}, v(x.dir.data() + flat, run), cv(out + at, run));
      if (has_state) ex.apply(gradapt::detail::copy_to{}, v(x.graft.data() + flat, run), cv(ab + at, run));
    });
  }

  /// X ×₁ P_1 ×₂ … ×ₖ P_k into one of the product buffers; returns it. With `transposed`, the
  /// products with P_dᵀ (eigenvalue-corrected Shampoo's rotation into its eigenbases).
  template <class St, class Block, class C>
  static C* product(St& st, const Block& bl, const C* xb, bool transposed = false) {
    using cview = tensor_view<const C, typename L::space>;
    using mview = tensor_view<C, typename L::space>;
    const auto& la = st.la_;
    const C* cur = xb;
    C* dst = nullptr;
    for (std::size_t d = 0; d < bl.k; ++d) {
      dst = d % 2 == 0 ? st.y0_.data() : st.y1_.data();
      const std::int64_t n = bl.n[d];
      const auto [a, c] = split(bl, d);
      const cview p(st.roots_at(bl) + bl.off[d], {n, n});
      if (c == 1) {  // last dimension: Y = X·Pᵀ (P is symmetric up to rounding), or X·P
        la.gemm(transpose::none, transposed ? transpose::none : transpose::yes, 1.0, cview(cur, {a, n}), p,
                0.0, mview(dst, {a, n}));
      } else {
        for (std::int64_t q = 0; q < a; ++q)
          la.gemm(transposed ? transpose::yes : transpose::none, transpose::none, 1.0, p,
                  cview(cur + q * n * c, {n, c}), 0.0, mview(dst + q * n * c, {n, c}));
      }
      cur = dst;
    }
    return dst;
  }
};

}  // namespace transform

/// The chain behind `gradapt::shampoo`: Shampoo's grafted direction, then the SGD chain.
using shampoo_chain = chain<transform::scale_by_shampoo<>, transform::add_decayed_weights, transform::trace,
                            transform::scale_by_learning_rate>;

/// Shampoo on the host (see the file comment and docs/algorithms/shampoo.md): the chain
/// `scale_by_shampoo` → weight decay → momentum → learning rate, built from one
/// `shampoo_options`.
///
///     const gradapt::host backend{};
///     gradapt::shampoo opt({.lr = 1e-3, .graft = gradapt::shampoo_graft::adam, .momentum = 0.9});
///     auto state = opt.init(backend, params);
///     const auto report = opt.step(backend, params, state, {.lr = schedule(t)});
///     opt.step(comm, backend, params, state, {.lr = schedule(t)});  // roots over the ranks
///
/// `state.preconditioner()` is the `shampoo_state` (blocks, statistics, roots);
/// `state.buffer(0)` the momentum buffer.
class shampoo : public detail::optim::preset<shampoo, shampoo_chain, shampoo_options> {
 public:
  using detail::optim::preset<shampoo, shampoo_chain, shampoo_options>::preset;
  /// The name in error messages.
  static constexpr const char* name = "shampoo";
  /// The chain the options give.
  static shampoo_chain stages(const shampoo_options& o) {
    transform::scale_by_shampoo<> pre;
    pre.options = o;
    return shampoo_chain(std::move(pre), detail::optim::decay_stage(o), detail::optim::momentum_stage(o),
                         detail::optim::lr_stage(o));
  }
  /// The options the preset was built from (the preconditioner's; its later stages' through
  /// `stage<1>()` to `stage<3>()`).
  const shampoo_options& options() const { return this->template stage<0>().options; }
};

}  // namespace gradapt

// The definitions of shampoo's and shampoo_state's members declared above, by concern.
#include "gradapt/optim/shampoo_checkpoint.hpp"
#include "gradapt/optim/shampoo_distributed.hpp"
#include "gradapt/optim/shampoo_roots.hpp"
#include "gradapt/optim/shampoo_statistics.hpp"

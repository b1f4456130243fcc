#pragma once
/// @file
/// `gradapt::chain_state`: the typed state of a `gradapt::chain` (part of optim/chain.hpp):
/// per-element buffers of every active stage in the backend's memory, the step count, the
/// per-tensor arrays of the passes and a factored chain's workspace; its checkpoint is the
/// optimizer archive (core/archive.hpp), addressed by parameter name.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/core/type_name.hpp"
#include "gradapt/optim/factoring.hpp"
#include "gradapt/optim/stage.hpp"

#include "gradapt/optim/chain_plan.hpp"

namespace gradapt {

template <class... Stages>
class chain;

namespace detail::optim {
/// The preconditioner state of a chain without a preconditioner stage: nothing.
struct no_preconditioner_state {};
/// The state a chain's preconditioner stage keeps (its `state_type<B, V, G>`), or nothing.
template <class Chain, class B, class V, class G>
struct preconditioner_state_of {
  using type = no_preconditioner_state;
};
template <class S0, class... Rest, class B, class V, class G>
requires(stage_traits<S0>::preconditioner) struct preconditioner_state_of<chain<S0, Rest...>, B, V, G> {
  using type = typename S0::template state_type<B, V, G>;
};
}  // namespace detail::optim

/// The state of a `chain<Stages...>` for one backend and element types: per-element buffers
/// (Adam's m and v, a momentum trace) in the backend's memory, the step count, and the small
/// per-tensor arrays the passes use. Created by `chain::init`, advanced by `chain::step`.
///
/// @tparam Chain the chain type (its plan fixes the buffers)
/// @tparam B     the backend (gradapt::host, gradapt::cuda)
/// @tparam V,G   parameter and gradient element types
/// @tparam S     state element type (the compute type of V by default)
///
/// `save` writes a self-describing byte string (a header with the element type, stages,
/// active stages, tensor sizes and step count, then the raw buffers); `load` checks the
/// header against this state and restores it bit for bit, so training continues exactly as
/// it would have.
template <class Chain, class B, class V, class G, class S>
class chain_state {
 public:
  using backend_type = B;             ///< the backend the buffers live on
  using space = typename B::space;    ///< memory space of the views (host_space, device_space)
  using value_type = V;               ///< parameter element type
  using grad_type = G;                ///< gradient element type
  using state_element = S;            ///< element type of the state buffers
  using plan = typename Chain::plan;  ///< the chain's compile-time stage layout
  /// The state of the chain's preconditioner stage (`no_preconditioner_state` without one).
  using preconditioner_type = typename detail::optim::preconditioner_state_of<Chain, B, V, G>::type;

  chain_state() = default;
  /// Move-only: the per-tensor views point into the state's own buffers. Duplicate a state
  /// through `save` and `load`.
  chain_state(chain_state&&) noexcept = default;
  /// Move assignment: takes over the other state's buffers (the views stay valid, the memory
  /// does not move).
  chain_state& operator=(chain_state&&) noexcept = default;
  chain_state(const chain_state&) = delete;
  chain_state& operator=(const chain_state&) = delete;

  /// Steps taken (optax's count).
  std::uint64_t steps() const { return steps_; }
  /// Parameters the state was created for.
  std::size_t tensors() const { return sizes_.size(); }
  /// Bit i set when stage i of the chain is active in this state.
  std::uint64_t active_stages() const { return enabled_; }
  /// Number of per-element state buffers over all stages (inactive stages' are empty).
  static constexpr std::size_t buffer_count() { return plan::total_buffers; }
  /// Elements of all per-element state buffers and of a preconditioner stage's state (what a
  /// checkpoint holds besides its header).
  std::size_t state_elements() const {
    std::size_t n = 0;
    for (const auto& b : bufs_) n += b.size();
    if constexpr (plan::has_preconditioner) n += pre_.state_elements();
    return n;
  }
  /// Bytes of the step's workspace in the backend's memory (per-tensor constants, barrier
  /// factors and sums; for a factored chain the per-slot factors and sums, one slot per
  /// thread of the host's task mode), allocated at init and reused by every step. Not part
  /// of a checkpoint. The backend object's own scratch (gradapt::cuda's grow-only workspace,
  /// which init sizes too) is not counted.
  std::size_t workspace_bytes() const {
    return (tconst_.size() + factors_.size() + sums_.size() + wdbl_.size() + wsum_.size() + wfac_.size()) *
               sizeof(double) +
           wbuf_.size() * sizeof(S);
  }
  /// True when tensor t's factored stage (a chain whose first stage is
  /// scale_by_factored_rms or scale_by_sm3) keeps row and column statistics rather than a
  /// full-size buffer; false for every tensor of other chains.
  bool factored(std::size_t t) const {
    detail::require(t < sizes_.size(), "chain_state::factored: tensor ", t, " out of range (", sizes_.size(),
                    " tensors)");
    return !ft_.empty() && ft_[t].factored;
  }
  /// Per-tensor views of state buffer j (stage buffers in stage order: for AdamW 0 = m,
  /// 1 = v). Empty when the owning stage is inactive. A factored stage's buffer holds, for a
  /// factored tensor, what the stage keeps instead of one element per parameter (Adafactor:
  /// the row then column statistics; SM3: one cover per dimension, in dimension order).
  std::span<const tensor_view<S, space>> buffer(std::size_t j) const {
    detail::require(j < plan::total_buffers, "chain_state::buffer: index ", j, " out of range (",
                    plan::total_buffers, " buffer(s))");
    return mut_[j];
  }

  /// The state of the chain's preconditioner stage (Shampoo's blocks, statistics and roots:
  /// `shampoo_state`), for a chain whose first stage is one.
  const preconditioner_type& preconditioner() const requires(plan::has_preconditioner) { return pre_; }
  /// The preconditioner stage's state, writable: for a state restored piece by piece (the
  /// sharded optimizer's load, through the stage state's own checked `load_slice`).
  preconditioner_type& preconditioner() requires(plan::has_preconditioner) { return pre_; }

  /// Steps between the checks that every state buffer is still finite (default 100; 0 turns
  /// this check and the parameter check off). Two checks:
  ///  - parameters, every step, on the host backend: the pass that writes the parameters also
  ///    sums them per tensor in double, in registers (element-wise chains; no extra memory
  ///    traffic; finite exactly when every value is), or re-reads each updated tensor while it
  ///    is in cache (factored chains). A step that leaves a parameter non-finite (a non-finite
  ///    gradient, or a finite one whose update overflows: SGD's momentum with weight decay on
  ///    gradients near FLT_MAX) throws gradapt::error naming the parameter at that step.
  ///    Device backends do not run it (it would synchronise the stream).
  ///  - state buffers, after the first step and after every `interval`-th: one read of every
  ///    state buffer (for AdamW, m and v: 8 bytes per parameter against the step's 28: about
  ///    30% more memory traffic when every step is checked, 0.3% at the default). What only
  ///    this check finds: a statistic that overflowed while the parameter stayed finite
  ///    (AdamW's v above about 1.8e19² / (1 − b2): the update divides by it, so the parameter
  ///    freezes; Adafactor's and SM3's likewise), and on device backends any non-finite value;
  ///    it finds them at most `interval - 1` steps late, the parameters frozen meanwhile.
  /// After either finds a non-finite value every later step throws until `load` restores a
  /// checkpoint.
  void set_check_interval(std::uint64_t interval) noexcept { check_interval_ = interval; }
  /// See set_check_interval.
  [[nodiscard]] std::uint64_t check_interval() const noexcept { return check_interval_; }
  /// Sets the step count, for a state whose buffers were restored piece by piece (the sharded
  /// optimizer's load); `load` sets it from the checkpoint.
  /// @throws gradapt::error when `k` is the largest std::uint64_t (the count could not grow)
  void set_steps(std::uint64_t k) {
    detail::require(k < std::numeric_limits<std::uint64_t>::max(), "chain_state::set_steps: step count ", k,
                    " cannot grow");
    steps_ = k;
  }

  /// Throws gradapt::error when an element of an active state buffer is not finite (inf or
  /// NaN), naming the first such parameter and buffer, the count and `who` (the caller's name).
  /// One `count_nonfinite` reduction per active buffer.
  void check_finite(const B& b, std::string_view who) const {
    for (std::size_t j = 0; j < mut_.size(); ++j) {
      if (mut_[j].empty() || bufs_[j].size() == 0) continue;
      const auto all =
          tensor_view<const S, space>::vector(bufs_[j].data(), static_cast<std::int64_t>(bufs_[j].size()));
      if (b.reduce(reduction::count_nonfinite, all) == 0.0) continue;
      for (std::size_t t = 0; t < sizes_.size(); ++t) {
        const double bad = b.reduce(reduction::count_nonfinite, tensor_view<const S, space>(mut_[j][t]));
        if (bad == 0.0) continue;
        std::size_t stage = 0;
        while (plan::buffer_offset(stage + 1) <= j) ++stage;
        detail::fail(who, ": after step ", steps_, ", ", bad, " of the ", mut_[j][t].size(),
                     " elements of state buffer ", j, " (stage ", stage, ") of parameter '", names_[t],
                     "' are not finite. A non-finite gradient, or a finite one too large for the state's "
                     "float range (a squared statistic overflows above |g| of about 1.8e19), caused it; the "
                     "parameters have been updated and the state cannot recover: restore a checkpoint with "
                     "load(), and clip or rescale the gradients (a loss scaler skips non-finite ones)");
      }
    }
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.optimizer";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// Writes the state into the open section of `w`: the element type, stage count, buffer
  /// count, active-stage mask, step count and tensor count; per tensor its name, shape and
  /// (factored chains) factored layout under "tensor/<name>"; a preconditioner stage's state
  /// under "preconditioner" (its own fields and checks); and every active buffer j as
  /// one tensor field per parameter, "buffer<j>/<name>", shaped like the parameter (a
  /// factored tensor's statistics as a vector). Each tensor is copied to host memory through
  /// one reused buffer.
  void save(const B& b, archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<S>));
    w.put("stages", static_cast<std::uint64_t>(plan::n));
    w.put("stage_types", stage_types());
    w.put("buffers", static_cast<std::uint64_t>(plan::total_buffers));
    w.put("active_stages", enabled_);
    w.put("steps", steps_);
    w.put("tensors", static_cast<std::uint64_t>(sizes_.size()));
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      w.begin(detail::archive_impl::join("tensor", "/", names_[t]));
      w.put("index", static_cast<std::uint64_t>(t));
      w.put_tensor<std::int64_t>("shape", shapes_[t]);
      if (!ft_.empty()) w.put_tensor<std::int64_t>("factored_layout", layout_of(t));
      w.end();
    }
    if constexpr (plan::has_preconditioner) {
      w.begin("preconditioner");
      pre_.save(b, w);
      w.end();
    }
    std::vector<S> host;
    for (std::size_t j = 0; j < mut_.size(); ++j) {
      if (mut_[j].empty()) continue;
      w.begin(detail::archive_impl::join("buffer", "", std::to_string(j)));
      for (std::size_t t = 0; t < sizes_.size(); ++t) {
        const auto& v = mut_[j][t];
        host.resize(v.size());
        b.copy(tensor_view<const S, space>(v), host_view(host));
        for (const S& x : host)
          detail::require(std::isfinite(static_cast<double>(static_cast<compute_t<S>>(x))),
                          "optimizer state save: buffer ", j, " of '", names_[t],
                          "' holds a non-finite value; load() would reject this checkpoint (the run has "
                          "diverged: save the last good state instead)");
        w.put_tensor<S>(names_[t], host, buffer_shape(j, t));
      }
      w.end();
    }
  }

  /// Reads what `save(b, w)` wrote into this state, created by the same optimizer type and
  /// options for parameters with the same names, shapes and factoring. All or nothing: every
  /// field is checked (names, shapes, element type, layout, finite values, a step count that
  /// can still grow) before the first buffer is written.
  /// @throws gradapt::error naming the first field that does not match
  void load(const B& b, archive_reader& r) {
    const auto expect = [&](const char* field, std::uint64_t want, const char* what) {
      const auto got = r.get<std::uint64_t>(field);
      detail::require(
          got == want, "optimizer state load: the checkpoint's ", what, " is ", got, " but this state's is ",
          want, " (restore into a state created by the same optimizer and options for the same parameters)");
    };
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<S>), "optimizer state load: the checkpoint holds ", et,
                    " state but this state is ", name(dtype_of_v<S>));
    // The stages' names, for the message only (compilers may spell a type differently).
    const std::string theirs = r.has("stage_types") ? r.get<std::string>("stage_types") : "not recorded";
    const auto got_stages = r.get<std::uint64_t>("stages");
    detail::require(got_stages == plan::n, "optimizer state load: the checkpoint's stage count is ",
                    got_stages, " (its stages: ", theirs, ") but this state's is ", plan::n, " (",
                    stage_types(), "); restore into a state created by the same optimizer");
    expect("buffers", plan::total_buffers, "buffer count");
    expect("active_stages", enabled_, "active-stage mask");
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), "optimizer state load: step count ",
                    steps, " cannot grow");
    expect("tensors", sizes_.size(), "tensor count");
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      const std::string sec = detail::archive_impl::join("tensor", "/", names_[t]);
      detail::require(r.has(detail::archive_impl::join(sec, "/", "index")),
                      "optimizer state load: the checkpoint has no parameter '", names_[t],
                      "' (restore for the same parameter names)");
      r.begin(sec);
      const auto index = r.get<std::uint64_t>("index");
      detail::require(index == t, "optimizer state load: parameter '", names_[t], "' is tensor ", index,
                      " in the checkpoint but ", t, " here (restore for the same parameter order)");
      const auto shape = r.get_tensor<std::int64_t>("shape");
      if (!std::ranges::equal(shape, shapes_[t])) {
        const auto text = [](const auto& dims) {
          std::string out = "[";
          for (std::size_t d = 0; d < dims.size(); ++d) out += (d ? ", " : "") + std::to_string(dims[d]);
          return out + "]";
        };
        detail::fail("optimizer state load: parameter '", names_[t], "' has shape ", text(shape),
                     " in the checkpoint but ", text(shapes_[t]), " here (restore for the same model)");
      }
      if (!ft_.empty()) {
        const auto got = r.get_tensor<std::int64_t>("factored_layout");
        const auto want = layout_of(t);
        detail::require(std::ranges::equal(got, want), "optimizer state load: parameter '", names_[t],
                        "'s factored layout differs (same shapes and factoring options: factored, "
                        "min_dim_size_to_factor, axes)");
      }
      r.end();
    }
    // Pass 1: check every buffer tensor (type, shape, finite values) without changing anything.
    std::vector<S> host;
    for_each_buffer(r, host, [&](std::size_t j, std::size_t t) {
      for (const S& x : host)
        detail::require(std::isfinite(static_cast<double>(static_cast<compute_t<S>>(x))),
                        "optimizer state load: buffer ", j, " of '", names_[t],
                        "' holds a non-finite value (", static_cast<double>(static_cast<compute_t<S>>(x)),
                        "); a checkpoint of a diverged run cannot be resumed");
    });
    // Pass 2: copy into the backend's memory, once everything has been checked (a
    // preconditioner stage's state checks its section first and commits after this).
    const auto commit = [&] {
      r.finish_section();
      for_each_buffer(r, host, [&](std::size_t j, std::size_t t) {
        b.copy(tensor_view<const S, host_space>(host_view(host)), mut_[j][t]);
      });
      b.synchronize();
    };
    if constexpr (plan::has_preconditioner) {
      r.begin("preconditioner");
      pre_.load(b, r, steps, [&] {
        r.end();
        commit();
      });
    } else {
      commit();
    }
    steps_ = steps;
    failed_ = false;
  }

  /// The state as one archive of kind "gradapt.optimizer" (core/archive.hpp).
  std::vector<std::byte> save(const B& b) const { return save_archive(*this, b); }
  /// Restores a state written by `save(b)` (all or nothing; see `load(b, reader)`).
  /// @throws gradapt::error for a damaged archive or one that does not fit this state
  void load(const B& b, std::span<const std::byte> bytes) { load_archive(*this, b, bytes); }

 private:
  template <class...>
  friend class chain;

  static std::uint64_t product(const std::vector<std::int64_t>& s) {
    std::uint64_t n = 1;
    for (const auto e : s) n *= static_cast<std::uint64_t>(e);
    return n;
  }
  /// A factored tensor's layout as stored: factored flag, the [A, X, B, Y, C] view, state size.
  std::vector<std::int64_t> layout_of(std::size_t t) const {
    const auto& f = ft_[t];
    return {f.factored ? 1 : 0, f.d[0], f.d[1], f.d[2], f.d[3], f.d[4], static_cast<std::int64_t>(f.state)};
  }
  /// The stored shape of buffer j's tensor t: the parameter's, or a vector for a factored stage.
  std::vector<std::int64_t> buffer_shape(std::size_t j, std::size_t t) const {
    if (mut_[j][t].size() == sizes_[t]) return shapes_[t];
    return {static_cast<std::int64_t>(mut_[j][t].size())};
  }
  // Reads every active buffer tensor into `host` in turn and calls f(j, t).
  template <class F>
  void for_each_buffer(archive_reader& r, std::vector<S>& host, F&& f) {
    for (std::size_t j = 0; j < mut_.size(); ++j) {
      if (mut_[j].empty()) continue;
      r.begin(detail::archive_impl::join("buffer", "", std::to_string(j)));
      for (std::size_t t = 0; t < sizes_.size(); ++t) {
        detail::require(r.has(names_[t]), "optimizer state load: the checkpoint has no buffer ", j, " for '",
                        names_[t], "'");
        host.resize(mut_[j][t].size());
        r.get_tensor<S>(names_[t], std::span<S>(host), buffer_shape(j, t));
        f(j, t);
      }
      r.end();
    }
  }

  std::uint64_t steps_ = 0;
  std::uint64_t enabled_ = 0;
  std::uint64_t check_interval_ = 100;
  bool failed_ = false;               ///< a check found a non-finite value; steps throw until load()
  std::vector<double> param_checks_;  ///< host: per tensor, Σp of the final pass (or a non-finite count)
  std::size_t nonfinite_param_ = 0;   ///< 1 + the tensor the last step left non-finite, or 0
  std::vector<std::size_t> sizes_;
  std::vector<std::string> names_;                 ///< parameter names (checkpoint keys)
  std::vector<std::vector<std::int64_t>> shapes_;  ///< parameter shapes
  std::vector<detail::optim::buffer_t<B, S>> bufs_;
  std::vector<std::vector<tensor_view<S, space>>> mut_;
  std::vector<std::vector<tensor_view<const S, space>>> const_;
  std::vector<tensor_view<const V, space>> p_const_;
  /// What the passes read as the gradient: g, or a preconditioner stage's direction (in the
  /// compute type).
  using pass_grad = std::conditional_t<plan::has_preconditioner, compute_t<V>, G>;
  std::vector<tensor_view<const pass_grad, space>> g_const_;
  detail::optim::buffer_t<B, double> tconst_, factors_, sums_;
  std::vector<double> tconst_host_;
  std::vector<std::vector<tensor_view<double, space>>> factor_views_;  ///< per enabled barrier
  std::vector<double> group_lr_;
  std::vector<std::optional<double>> group_wd_;
  [[no_unique_address]] preconditioner_type pre_{};  ///< the preconditioner stage's state
  // The chain's stage types, "chain<trace, scale_by_learning_rate>" (for messages).
  static std::string stage_types() { return detail::short_type_name<Chain>(); }

  // Chains with a factored stage (run tensor by tensor):
  std::vector<factored_tensor> ft_;     ///< the stage's decision per tensor
  std::vector<std::size_t> order_;      ///< tensors largest first (task order)
  std::size_t total_ = 0;               ///< parameters in the list
  std::size_t slots_ = 1;               ///< workspace slots (threads of the host's task mode)
  std::size_t ws_ = 0, wsd_ = 0;        ///< per-slot workspace sizes (S, double)
  detail::optim::buffer_t<B, S> wbuf_;  ///< factors
  detail::optim::buffer_t<B, double> wdbl_, wsum_, wfac_;  ///< sums; barrier sums, factors
  std::vector<tensor_view<double, space>> wfac_views_;     ///< [slot][barrier]
};

}  // namespace gradapt

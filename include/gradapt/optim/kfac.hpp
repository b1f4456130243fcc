#pragma once
/// @file
/// K-FAC (Martens and Grosse 2015; Osawa et al. 2019, distributed; Pauloski et al. 2021,
/// KAISA): Kronecker-factored natural-gradient preconditioning of linear layers, in host or
/// device memory (the state's element and linear-algebra backends), fed by the framework with
/// each layer's inputs and output gradients. It rewrites the gradients; any optimizer then
/// steps on them.
///
/// For a layer with inputs a (rows × in, plus a column of ones with a bias) and output
/// gradients g (rows × out; divided by the loss scale), on factor-update steps:
///
///     A ← d·A + (1 − d)·aᵀa / rows        G ← d·G + (1 − d)·gᵀg / rows
///
/// (d = factor_decay; A and G start at the identity; several `accumulate` calls in one step are
/// averaged; with a communicator the new terms are averaged over the ranks first). On
/// inverse-update steps the decompositions are recomputed: eigen (A = Q_A·diag(d_A)·Q_Aᵀ, the
/// eigenvalues clamped at 0, the same for G) or explicit damped inverses (A + λI)⁻¹, (G + λI)⁻¹.
/// Each step, the weight gradient M (out × (in [+1]), the bias gradient as the last column)
/// becomes
///
///     eigen:    V = Q_G·[(Q_Gᵀ·M·Q_A) ⊘ (d_G·d_Aᵀ + λ)]·Q_Aᵀ
///     inverse:  V = (G + λI)⁻¹·M·(A + λI)⁻¹
///
/// and with KL clipping every layer's V is scaled by ν = min(1, √(kl_clip / |Σ lr²·⟨V, M⟩|))
/// (the sum over all layers). The factors are kept in C, the decompositions computed, kept and
/// applied in D (both float or double; `kfac_state<L, C, D, B>`). Distributed, each layer's
/// decomposition is computed on one rank and held by g = grad_worker_fraction · ranks of them,
/// which precondition its gradient (KAISA's communication-optimal, hybrid and memory-optimal
/// modes); in device memory every rank decomposes every layer (g = ranks). docs/algorithms/kfac.md has the
/// options, the distributed modes and what is not built.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"
#include "gradapt/optim/kfac_kernels.hpp"
#include "gradapt/optim/kfac_options.hpp"
#include "gradapt/optim/kfac_state.hpp"

namespace gradapt {

/// K-FAC (see the file comment and docs/algorithms/kfac.md). Per step:
///
///     if (kf.factor_update_due(state))            // collect a and g on these steps only
///       for each layer i: kf.accumulate(state, i, a_i, g_i, loss_scale);
///     kf.step(state, grads, lr);                   // or kf.step(comm, state, grads, lr)
///     optimizer.step(backend, params, opt_state);  // on the rewritten gradients
class kfac {
 public:
  /// `kfac({})`: the default options.
  kfac(std::initializer_list<kfac_options> o) : kfac(o.size() ? *o.begin() : kfac_options{}) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit kfac(const kfac_options& o = {}) : o_(o) { validate(o_); }
  /// The options.
  const kfac_options& options() const { return o_; }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const kfac_options& o) {
    constexpr const char* w = "kfac";
    detail::require(std::isfinite(o.factor_decay) && o.factor_decay > 0 && o.factor_decay <= 1, w,
                    ": factor_decay is ", o.factor_decay, " (expected in (0, 1]; 0.95 is typical)");
    detail::require(o.factor_update_steps >= 1, w, ": factor_update_steps is 0 (expected >= 1)");
    detail::require(o.inv_update_steps >= 1, w, ": inv_update_steps is 0 (expected >= 1)");
    detail::require(std::isfinite(o.damping) && o.damping >= 0, w, ": damping is ", o.damping,
                    " (expected finite and >= 0; 0.001 is typical)");
    detail::require(o.method == kfac_method::eigen || o.method == kfac_method::inverse, w, ": method is ",
                    int(o.method), " (expected kfac_method::eigen or inverse)");
    detail::require(!o.prediv_eigenvalues || o.method == kfac_method::eigen, w,
                    ": prediv_eigenvalues needs method eigen");
    detail::require(std::isfinite(o.kl_clip) && o.kl_clip >= 0, w, ": kl_clip is ", o.kl_clip,
                    " (expected finite and >= 0; 0 switches KL clipping off)");
    detail::require(o.max_consecutive_failures >= 1, w, ": max_consecutive_failures is 0 (expected >= 1)");
    detail::require(
        std::isfinite(o.grad_worker_fraction) && o.grad_worker_fraction > 0 && o.grad_worker_fraction <= 1, w,
        ": grad_worker_fraction is ", o.grad_worker_fraction,
        " (expected in (0, 1]: 1 communication-optimal, 1/ranks memory-optimal)");
  }

  /// Grad workers per layer on `ranks` ranks: max(1, round(grad_worker_fraction · ranks)).
  int grad_workers(int ranks) const {
    detail::require(ranks >= 1, "kfac::grad_workers: ranks is ", ranks, " (expected >= 1)");
    const auto g = static_cast<long>(std::lround(o_.grad_worker_fraction * ranks));
    return static_cast<int>(std::clamp(g, 1L, static_cast<long>(ranks)));
  }

  /// A state for `layers` with factors in C and decompositions in D (each float or double) on
  /// host linear-algebra backend `la`, its element passes on gradapt::host with one thread.
  /// @throws gradapt::error for an empty list, a layer with in or out < 1, or a repeated name
  template <class C = float, class D = C, linalg_backend L>
  requires std::same_as<typename L::space, host_space> kfac_state<L, C, D> init(
      const L& la, std::span<const kfac_layer> layers)
  const { return init<C, D>(host{.threads = 1}, la, layers); }

  /// A state for `layers` in the memory of element backend `b` and linear-algebra backend `la`
  /// (one memory space: gradapt::cuda with cuda_linalg for device memory). Allocates every
  /// factor, term and decomposition buffer; the steps then allocate backend memory only when
  /// `accumulate` sees more rows than before.
  /// @throws gradapt::error as above, and in device memory for grad_worker_fraction < 1 (its
  ///         exchanges stage through host memory)
  template <class C = float, class D = C, factored_backend B, linalg_backend L>
  requires std::same_as<typename L::space, typename B::space> kfac_state<L, C, D, B> init(
      const B& b, const L& la, std::span<const kfac_layer> layers)
  const {
    using St = kfac_state<L, C, D, B>;
    detail::require(!layers.empty(), "kfac::init: no layers (register at least one)");
    detail::require(St::on_host || o_.grad_worker_fraction == 1, "kfac::init: grad_worker_fraction is ",
                    o_.grad_worker_fraction,
                    " but the state is in device memory, where every rank holds every decomposition "
                    "(grad_worker_fraction = 1); the hybrid and memory-optimal plans run on the host");
    St st(la, b);  // (a default-constructed cuda_linalg would make handles of its own)
    st.method_ = o_.method;
    st.prediv_ = o_.prediv_eigenvalues;
    st.max_failures_ = o_.max_consecutive_failures;
    std::size_t terms = layers.size(), largest = 0, largest_dec = 0, largest_inv = 0, largest_gram = 0;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto& s = layers[i];
      detail::require(s.in >= 1 && s.out >= 1, "kfac::init: layer '", s.name, "' has in ", s.in, " and out ",
                      s.out, " (expected >= 1)");
      for (std::size_t j = 0; j < i; ++j)
        detail::require(layers[j].name != s.name, "kfac::init: layer name '", s.name,
                        "' is registered twice (names address checkpoints)");
      typename St::layer_t x;
      x.spec = s;
      x.n = s.in + (s.bias ? 1 : 0);
      const auto na = static_cast<std::size_t>(x.n), ng = static_cast<std::size_t>(s.out);
      x.a = b.template allocate<C>(na * na);
      x.g = b.template allocate<C>(ng * ng);
      identity(st, x.a.data(), x.n);
      identity(st, x.g.data(), s.out);
      x.terms = terms;
      terms += na * na + ng * ng;
      x.v = b.template allocate<D>(ng * na);
      x.dec = b.template allocate<D>(st.dec_size(x));
      largest = std::max(largest, ng * na);
      largest_dec = std::max(largest_dec, st.dec_size(x));
      // The inverse method's eigenproblems (Q_A, d_A, Q_G, d_G) and a scaled basis.
      largest_gram = std::max({largest_gram, na * na, ng * ng});
      if (o_.method == kfac_method::inverse)
        largest_inv = std::max(largest_inv, na * na + na + ng * ng + ng + std::max(na * na, ng * ng));
      workspace(st, la, x.n);
      workspace(st, la, s.out);
      st.l_.push_back(std::move(x));
    }
    st.terms_ = b.template allocate<C>(terms);
    std::int64_t widest = 0;
    for (const auto& x : st.l_) widest = std::max({widest, x.n, x.spec.out});
    std::vector<C> iota(static_cast<std::size_t>(widest));
    for (std::size_t e = 0; e < iota.size(); ++e) iota[e] = C(e);
    st.iota_ = b.template allocate<C>(iota.size());
    st.from_host(iota, st.iota_);
    st.gram_ = b.template allocate<C>(largest_gram);
    st.m_ = b.template allocate<D>(largest);
    // Products (out × (in [+1])); the inverse method's eigenproblems and scaled bases.
    st.tmp_ = b.template allocate<D>(std::max(largest, largest_inv));
    st.dtmp_ = b.template allocate<D>(largest_dec);
    return st;
  }

  /// Whether the state's next step updates the factors (the framework collects a and g then).
  template <class L, class C, class D, class B>
  bool factor_update_due(const kfac_state<L, C, D, B>& st) const {
    return st.steps_ % o_.factor_update_steps == 0;
  }

  /// Adds layer i's inputs `a` (rows × in) and output gradients `g` (rows × out, scaled by
  /// `loss_scale`, which is divided out), in the state's memory, to this step's factor terms.
  /// Several calls in one step (micro-batches) are averaged. Only on steps whose factor update
  /// is due.
  /// @throws gradapt::error for an unknown layer, shapes that do not match its registration, a
  ///         row count that differs between a and g or is 0, a loss scale that is not finite
  ///         and > 0, or a step that does not update factors
  template <class L, class C, class D, class B, element T>
  void accumulate(kfac_state<L, C, D, B>& st, std::size_t i, tensor_view<const T, typename L::space> a,
                  tensor_view<const T, typename L::space> g, double loss_scale = 1.0) const {
    using Sp = typename L::space;
    constexpr const char* who = "kfac::accumulate";
    detail::require(i < st.l_.size(), who, ": layer ", i, " out of range (", st.l_.size(), " layers)");
    auto& x = st.l_[i];
    const auto& s = x.spec;
    detail::require(a.rank() == 2 && g.rank() == 2, who, ": layer '", s.name,
                    "': a and g must be matrices (rows × ", s.in, " and rows × ", s.out, "), got ",
                    a.shape_string(), " and ", g.shape_string());
    detail::require(a.dim(1) == s.in && g.dim(1) == s.out, who, ": layer '", s.name, "' takes a of rows × ",
                    s.in, " and g of rows × ", s.out, ", got ", a.shape_string(), " and ", g.shape_string());
    detail::require(a.dim(0) == g.dim(0) && a.dim(0) >= 1, who, ": layer '", s.name, "': a has ", a.dim(0),
                    " rows and g has ", g.dim(0), " (expected the same number, >= 1)");
    detail::require(std::isfinite(loss_scale) && loss_scale > 0, who, ": loss_scale is ", loss_scale,
                    " (expected finite and > 0: the scale g was multiplied by)");
    detail::require(factor_update_due(st), who, ": layer '", s.name, "' at step ", st.steps_ + 1,
                    ", which does not update factors (factor_update_steps = ", o_.factor_update_steps,
                    "; ask factor_update_due())");
    namespace k = detail::kfac_k;
    const std::int64_t rows = a.dim(0);
    const auto& la = st.la_;
    const auto& ex = st.ex_;
    // Into scratch with the ones column (and in C), then the Gram product; then added to the
    // step's terms, so several calls add up in call order.
    const auto need = static_cast<std::size_t>(rows * std::max(x.n, s.out));
    if (st.scratch_.size() < need) st.scratch_ = ex.template allocate<C>(need);
    C* sa = st.scratch_.data();
    if (s.bias) {
      ex.apply_list(k::cast{}, k::rows_of<C, Sp>(sa, rows, x.n, 0, s.in),
                    k::rows_of<const T, Sp>(a.data(), rows, s.in, 0, s.in));
      ex.apply_list(k::fill{1.0}, k::rows_of<C, Sp>(sa, rows, x.n, s.in, 1));
    } else {
      ex.apply(k::cast{}, st.vec(sa, static_cast<std::size_t>(rows * s.in)), a);
    }
    C* gram = st.gram_.data();
    C* ta = st.terms_.data() + x.terms;
    C* tg = ta + x.n * x.n;
    const auto term = [&](C* t, std::int64_t n) {
      const auto e = static_cast<std::size_t>(n * n);
      if (x.count)
        ex.apply(k::add{}, st.vec(t, e), st.vec(static_cast<const C*>(gram), e));
      else
        ex.apply(k::cast{}, st.vec(t, e), st.vec(static_cast<const C*>(gram), e));
    };
    la.syrk(gram::columns, 1.0 / double(rows), tensor_view<const C, Sp>(sa, {rows, x.n}), 0.0,
            tensor_view<C, Sp>(gram, {x.n, x.n}));
    term(ta, x.n);
    ex.apply(k::cast{}, st.vec(sa, static_cast<std::size_t>(rows * s.out)), g);
    la.syrk(gram::columns, 1.0 / (double(rows) * loss_scale * loss_scale),
            tensor_view<const C, Sp>(sa, {rows, s.out}), 0.0, tensor_view<C, Sp>(gram, {s.out, s.out}));
    term(tg, s.out);
    ++x.count;
  }

  /// One step on this rank alone: the factor update (when due: every layer must have had
  /// `accumulate`), the decompositions (when due), and every layer's gradient rewritten in place.
  /// @throws gradapt::error for gradients that do not match the layers, a non-finite or negative
  ///         lr, a layer with no accumulate on a factor-update step, or a layer whose
  ///         decomposition failed max_consecutive_failures times in a row
  template <class L, class C, class D, class B, class R>
  requires detail::kfac_grad_range<R>
  void step(kfac_state<L, C, D, B>& st, const R& grads, double lr) const {
    step_impl(nullptr, st, as_span(grads), lr);
  }

  /// One step with the factors averaged over the ranks of `comm` (one in-place allreduce of
  /// every layer's new terms; the averages read one triangle, so the factors stay symmetric)
  /// and, in host memory, the decompositions divided among the ranks (`lpt_assign` over
  /// (in+1)³ + out³; in device memory every rank decomposes every layer after agreeing on the
  /// factors' hash). `comm`'s stream must be the state's backends' (one stream). Each
  /// decomposition goes to its layer's g grad workers
  /// (one allgather within each group of g ranks, at inverse updates); with g < ranks the grad
  /// workers precondition their layers and one allgather across the groups gives every rank
  /// every preconditioned gradient, each step. Every rank passes its own a and g (its local
  /// batch) and the same averaged gradients. The step, the lr and each rank's input errors are
  /// agreed every step; the layer list and the options once per world; the factors at every
  /// decomposition exchange, and the gradients at every exchange of preconditioned gradients.
  /// @throws gradapt::error as the step above, and for a disagreement across ranks (on every
  ///         rank), or a grad_worker_fraction whose g does not divide the ranks
  template <communicator Comm, class L, class C, class D, class B, class R>
  requires std::same_as<typename Comm::space, typename L::space> && detail::kfac_grad_range<R>
  void step(Comm& comm, kfac_state<L, C, D, B>& st, const R& grads, double lr) const {
    step_impl(&comm, st, as_span(grads), lr);
  }

 private:
  template <class R>
  static auto as_span(const R& r) {
    using G = std::ranges::range_value_t<R>;
    return std::span<const G>(std::ranges::data(r), std::ranges::size(r));
  }
  template <class L, class C, class D, class B>
  static void workspace(kfac_state<L, C, D, B>& st, const L& la, std::int64_t n) {
    for (const auto& w : st.ws_)
      if (w.first == n) return;
    st.ws_.emplace_back(
        n, std::make_shared<detail::linalg::eigh_workspace_t<L, D>>(la.template eigh_workspace<D>(n)));
  }
  template <class St>
  static auto& find_ws(St& st, std::int64_t n) {
    for (auto& w : st.ws_)
      if (w.first == n) return *w.second;
    detail::fail("kfac: internal error: no eigensolver workspace for ", n);
  }
  /// The factors' hash (in device memory through host copies).
  template <class St>
  static std::uint64_t factor_hash(const St& st) {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (const auto& x : st.l_) {
      if constexpr (St::on_host) {
        h = detail::hash_bytes(h, x.a.data(), x.a.size());
        h = detail::hash_bytes(h, x.g.data(), x.g.size());
      } else {
        const auto a = st.to_host(x.a), g = st.to_host(x.g);
        h = detail::hash_bytes(h, a.data(), a.size());
        h = detail::hash_bytes(h, g.data(), g.size());
      }
    }
    return h;
  }
  /// n × n identity at p in the state's memory.
  template <class St, class C>
  static void identity(const St& st, C* p, std::int64_t n) {
    std::vector<C> h(static_cast<std::size_t>(n * n), C(0));
    for (std::int64_t r = 0; r < n; ++r) h[static_cast<std::size_t>(r * n + r)] = C(1);
    if constexpr (St::on_host)
      std::copy(h.begin(), h.end(), p);
    else
      st.ex_.copy(tensor_view<const C, host_space>::vector(h.data(), n * n), St::vec(p, h.size()));
  }

  template <class CommPtr, class L, class C, class D, class B, class T, class Sp>
  void step_impl(CommPtr comm, kfac_state<L, C, D, B>& st, std::span<const kfac_grad<T, Sp>> grads,
                 double lr) const {
    static_assert(std::is_same_v<Sp, typename L::space>,
                  "kfac::step: the gradients' memory space is not the state's (kfac_grad<T, Space>)");
    using St = kfac_state<L, C, D, B>;
    constexpr bool dist = !std::is_same_v<CommPtr, std::nullptr_t>;
    constexpr const char* who = "kfac::step";
    detail::require(!st.failed_, who, ": the state stopped after a layer's decomposition failed ",
                    st.max_failures_,
                    " times in a row or the ranks' factors or gradients differed; restore a ", "checkpoint");
    // This rank's input errors travel through the per-step agreement of the distributed step, so
    // every rank throws instead of waiting in a collective for this one.
    std::string bad;
    try {
      detail::require(std::isfinite(lr) && lr >= 0, who, ": lr is ", lr, " (expected finite and >= 0)");
      detail::require(grads.size() == st.l_.size(), who, ": ", grads.size(), " gradients for ", st.l_.size(),
                      " layers (one per registered layer, in registration order)");
      for (std::size_t i = 0; i < grads.size(); ++i) {
        const auto& s = st.l_[i].spec;
        const auto& gw = grads[i].weight;
        detail::require(gw.rank() == 2 && gw.dim(0) == s.out && gw.dim(1) == s.in, who, ": layer '", s.name,
                        "' has a weight of ", s.out, " × ", s.in, " but its gradient is ", gw.shape_string());
        detail::require(
            s.bias ? (grads[i].bias.size() == static_cast<std::size_t>(s.out)) : grads[i].bias.size() == 0,
            who, ": layer '", s.name, "' ",
            s.bias ? "has a bias of " + std::to_string(s.out) : std::string("has no bias"),
            " but its bias gradient holds ", grads[i].bias.size(), " elements");
      }
    } catch (const error& e) {
      bad = e.what();
    }
    const std::uint64_t t = st.steps_ + 1;
    const bool factors_due = (t - 1) % o_.factor_update_steps == 0;
    bool inverse_due = (t - 1) % o_.inv_update_steps == 0;
    if constexpr (dist) {
      const bool replan = !planned(*comm, st);
      const agreed_value at[] = {{"step", static_cast<double>(t)},
                                 {"lr", lr},
                                 {"re-plans (1 after a load or a new world)", replan ? 1.0 : 0.0}};
      agree_values(*comm, st.ex_, "kfac::step", std::span<const agreed_value>(at), bad);
      if (replan) plan(*comm, st);
    } else {
      if (!bad.empty()) throw error(bad);
      if (!(st.world_ == 1 && st.rank_ == 0 && st.group_ == 1)) {
        std::vector<double> missing = layout(st, 1, 0, 1);
        st.comms_.reset();
        st.force_ = std::any_of(missing.begin(), missing.end(), [](double m) { return m != 0; });
      }
    }
    if (st.force_) inverse_due = true;
    st.force_ = false;
    if (factors_due) update_factors(comm, st, t);
    for (auto& x : st.l_) x.outcome = 0;
    std::string differs;
    if (inverse_due) differs = decompose(comm, st, t);
    // The grad workers precondition their layers; with g < ranks the results are exchanged.
    const bool exchange = st.group_ < st.world_;
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      auto& x = st.l_[i];
      if (!x.held) continue;
      if constexpr (St::on_host) {
        if (exchange) {
          D* out = st.xv_.out(i);
          out[0] = D(x.outcome);
          precondition(st, i, grads[i], out + 1);
          continue;
        }
      }
      precondition(st, i, grads[i], x.v.data());
      // ⟨V, M⟩ for KL clipping while M is still in m_.
      if (o_.kl_clip > 0)
        x.vm = st.ex_.dot(St::vec(std::as_const(x).v.data(), x.v.size()),
                          St::vec(std::as_const(st).m_.data(), x.v.size()));
    }
    if constexpr (dist && St::on_host) {
      if (exchange) {
        std::uint64_t h = 0x9E3779B97F4A7C15ull;
        for (const auto& gr : grads) {
          h = detail::hash_bytes(h, gr.weight.data(), gr.weight.size());
          h = detail::hash_bytes(h, gr.bias.data(), gr.bias.size());
        }
        if (inverse_due) h ^= factor_hash(st);
        auto* rc = receivers(*comm, st);
        const int r = st.xv_.run(*rc, t, h, who);
        if (r >= 0 && differs.empty())
          differs = "kfac::step on rank " + std::to_string(st.rank_) + ": the gradients" +
                    (inverse_due ? std::string(" or factors") : std::string()) + " of rank " +
                    std::to_string(r * st.group_ + st.rank_ % st.group_) + " differ from rank " +
                    std::to_string(st.rank_ % st.group_) + "'s at step " + std::to_string(t) +
                    " (every rank must pass the same averaged gradients); restore a checkpoint with load()";
        for (std::size_t i = 0; i < st.l_.size(); ++i)
          st.l_[i].outcome = static_cast<unsigned char>(st.xv_.in(i)[0]);
      }
      // Within a hybrid plan a disagreement is seen by some groups only: one agreement over
      // every rank makes it an error everywhere.
      if (st.group_ > 1 && st.group_ < st.world_ && (inverse_due || exchange)) {
        try {
          agree_values(*comm, "kfac::step (after the exchanges)", {{"step", static_cast<double>(t)}},
                       differs);
        } catch (const error&) {
          st.failed_ = true;  // the factors may have been updated: the state is not usable
          throw;
        }
      }
    }
    if (!differs.empty()) {
      st.failed_ = true;
      throw error(differs);
    }
    count_outcomes(st);
    double vg = 0;
    if (o_.kl_clip > 0)
      for (std::size_t i = 0; i < st.l_.size(); ++i)
        vg += (st.group_ < st.world_ ? dot(st, i, grads[i], v_of(st, i)) : st.l_[i].vm) * lr * lr;
    double nu = 1;
    if (o_.kl_clip > 0 && vg != 0) nu = std::min(1.0, std::sqrt(o_.kl_clip / std::fabs(vg)));
    st.nu_ = nu;
    for (std::size_t i = 0; i < st.l_.size(); ++i) write_v(st, i, grads[i], nu, v_of(st, i));
    st.steps_ = t;
  }

  template <class St>
  static const auto* v_of(const St& st, std::size_t i) {
    if constexpr (St::on_host)
      if (st.group_ < st.world_) return st.xv_.in(i) + 1;
    return static_cast<const std::remove_cvref_t<decltype(*st.l_[i].v.data())>*>(st.l_[i].v.data());
  }

  // The distributed plan (kfac_distributed.hpp).
  template <class Comm, class St>
  bool planned(const Comm& comm, const St& st) const;
  template <class Comm, class St>
  static Comm* group_comm(Comm& comm, St& st);
  template <class Comm, class St>
  static Comm* receivers(Comm& comm, St& st);
  template <class St>
  static std::vector<double> layout(St& st, int n, int me, int g);
  template <class Comm, class St>
  void plan(Comm& comm, St& st) const;
  // The running factors (kfac_factors.hpp).
  template <class CommPtr, class St>
  void update_factors(CommPtr comm, St& st, std::uint64_t t) const;
  // The decompositions and preconditioning products (kfac_decomposition.hpp).
  template <class CommPtr, class St>
  std::string decompose(CommPtr comm, St& st, std::uint64_t t) const;
  template <class St, class X, class D>
  bool decompose_layer(St& st, X& x, D* out) const;
  template <class St, class X, class D>
  static void install(const St& st, X& x, bool ok, const D* dec);
  template <class St>
  static void count_outcomes(St& st);
  template <class St, class G>
  static void gradient_matrix(St& st, std::size_t i, const G& gr);
  template <class St, class G, class D>
  void precondition(St& st, std::size_t i, const G& gr, D* v) const;
  template <class St, class G, class D>
  static double dot(St& st, std::size_t i, const G& gr, const D* v);
  template <class St, class G, class D>
  static void write_v(St& st, std::size_t i, const G& gr, double nu, const D* v);

  kfac_options o_;
};

}  // namespace gradapt

// The definitions of kfac's private members declared above, by concern.
#include "gradapt/optim/kfac_decomposition.hpp"
#include "gradapt/optim/kfac_distributed.hpp"
#include "gradapt/optim/kfac_factors.hpp"

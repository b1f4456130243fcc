#pragma once
/// @file
/// K-FAC (Martens and Grosse 2015; Osawa et al. 2019, distributed; Pauloski et al. 2021,
/// KAISA): Kronecker-factored natural-gradient preconditioning of linear layers, on the host,
/// fed by the framework with each layer's inputs and output gradients. It rewrites the
/// gradients; any optimizer then steps on them.
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
/// (the sum over all layers). docs/algorithms/kfac.md has the options, the distributed mode
/// and what is not built.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

namespace gradapt {

/// How K-FAC preconditions with its factors.
enum class kfac_method : unsigned char {
  eigen,    ///< eigendecompositions; the damping is added to the Kronecker product's eigenvalues
  inverse,  ///< explicit damped inverses of each factor (computed through the eigendecomposition)
};

/// One layer K-FAC preconditions: a weight of `out` × `in` and, with `bias`, a bias of `out`.
/// A convolution registers in = in_channels·kh·kw (its unfolded patches) and out = out_channels.
struct kfac_layer {
  std::string name;      ///< for messages and checkpoints (unique)
  std::int64_t in = 0;   ///< columns of a (>= 1)
  std::int64_t out = 0;  ///< columns of g (>= 1)
  bool bias = false;     ///< a gets a column of ones; the gradient has a bias part
};

/// A layer's gradient for `kfac::step`, rewritten in place: weight (out × in, row-major) and,
/// for a layer with a bias, the bias (out).
template <class T>
struct kfac_grad {
  tensor_view<T, host_space> weight;     ///< out × in
  tensor_view<T, host_space> bias = {};  ///< out (empty without a bias)
};

namespace detail {
template <class G>
struct is_kfac_grad : std::false_type {};
template <class T>
struct is_kfac_grad<kfac_grad<T>> : std::bool_constant<element<T>> {};
/// A contiguous range of kfac_grad<T> (an array, std::vector, std::span).
template <class R>
concept kfac_grad_range = std::ranges::contiguous_range<const R> && std::ranges::sized_range<const R> &&
    is_kfac_grad<std::remove_cv_t<std::ranges::range_value_t<R>>>::value;
}  // namespace detail

/// Options of `gradapt::kfac` (defaults: kfac-pytorch's KFACPreconditioner, except
/// prediv_eigenvalues, which kfac-pytorch switches on; the results are the same either way).
struct kfac_options {
  /// d of the running averages, in (0, 1]. Default 0.95.
  double factor_decay = 0.95;
  /// Update the factors at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t factor_update_steps = 1;
  /// Recompute the decompositions at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t inv_update_steps = 1;
  /// λ, finite and >= 0 (Tikhonov). Default 0.001.
  double damping = 0.001;
  /// Eigendecompositions or damped inverses. Default eigen.
  kfac_method method = kfac_method::eigen;
  /// eigen: keep 1 / (d_G·d_Aᵀ + λ) from the inverse update instead of the eigenvalues (one
  /// out × in matrix per layer; the step divides nothing). Default false.
  bool prediv_eigenvalues = false;
  /// KL clipping's bound, finite and >= 0; 0 switches it off. Default 0.001.
  double kl_clip = 0.001;
  /// A layer whose decomposition fails this many inverse updates in a row makes the step throw
  /// (>= 1). Default 10.
  std::uint64_t max_consecutive_failures = 10;
};

class kfac;

/// The state of `gradapt::kfac` over linear-algebra backend L in element type C (float or
/// double): per layer its factors A and G, the batch terms accumulated in this step, the
/// decomposition (Q_A, d_A, Q_G, d_G, or the inverses; with prediv 1 / (d_G·d_Aᵀ + λ)), and its
/// failure counters. Checkpoint: one archive of kind "gradapt.kfac" addressed by layer name
/// (factors, decompositions, counters); the decompositions are stored, not recomputed.
template <class L, class C>
class kfac_state {
  static_assert(std::is_same_v<C, float> || std::is_same_v<C, double>, "kfac_state: C is float or double");

 public:
  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.kfac";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  kfac_state() = default;                       ///< an empty state; `kfac::init` creates a usable one
  kfac_state(kfac_state&&) noexcept = default;  ///< move
  kfac_state& operator=(kfac_state&&) noexcept = default;  ///< move

  /// Steps taken.
  std::uint64_t steps() const { return steps_; }
  /// Registered layers.
  std::size_t layers() const { return l_.size(); }
  /// Layer i's registration. @throws gradapt::error when i is out of range
  const kfac_layer& layer(std::size_t i) const { return at(i).spec; }
  /// Layer i's factor A ((in [+1])², row-major). @throws gradapt::error when i is out of range
  std::span<const C> factor_a(std::size_t i) const { return at(i).a; }
  /// Layer i's factor G (out², row-major). @throws gradapt::error when i is out of range
  std::span<const C> factor_g(std::size_t i) const { return at(i).g; }
  /// Whether layer i holds a decomposition from a successful inverse update.
  bool ready(std::size_t i) const { return at(i).ready; }
  /// Layer i's failed decompositions in a row and in all.
  std::pair<std::uint64_t, std::uint64_t> failures(std::size_t i) const {
    return {at(i).consecutive, at(i).failures};
  }
  /// Decompositions this rank computed (one per layer per inverse update it owns).
  std::uint64_t decompositions() const { return computed_; }
  /// The rank that decomposes layer i under the last distributed step's plan (0 before any).
  int owner(std::size_t i) const {
    at(i);
    return x_.world == 0 ? 0 : x_.owner[i];
  }
  /// ν of the last step's KL clipping (1 when off or not clipped).
  double last_kl_scale() const { return nu_; }
  /// Drops the a and g terms `accumulate` added since the last step, for a step that is not
  /// taken (a loss-scaler overflow: its terms may not be finite). The factors, decompositions
  /// and step count are unchanged; the step's factor update is due again on the next call.
  void discard() {
    for (auto& x : l_) x.count = 0;
  }

  /// Writes the state into the open section of `w`. Call it between steps.
  /// @throws gradapt::error when a factor or decomposition is not finite
  void save(archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<C>));
    w.put("method", std::string(method_ == kfac_method::eigen ? "eigen" : "inverse"));
    w.put("steps", steps_);
    w.put("layers", static_cast<std::uint64_t>(l_.size()));
    for (std::size_t i = 0; i < l_.size(); ++i) {
      const auto& x = l_[i];
      w.begin(detail::archive_impl::join("layer", "/", x.spec.name));
      w.put("index", static_cast<std::uint64_t>(i));
      const std::int64_t shape[3] = {x.spec.in, x.spec.out, x.spec.bias ? 1 : 0};
      w.put_tensor<std::int64_t>("shape", shape);
      const std::int64_t sa[2] = {x.n, x.n}, sg[2] = {x.spec.out, x.spec.out};
      put(w, x, "A", x.a, sa);
      put(w, x, "G", x.g, sg);
      put(w, x, "decomposition", x.dec, std::array<std::int64_t, 1>{static_cast<std::int64_t>(x.dec.size())});
      w.put("ready", x.ready);
      w.put("consecutive_failures", x.consecutive);
      w.put("failures", x.failures);
      w.end();
    }
  }
  /// Reads what `save(w)` wrote into a state created by `kfac::init` for the same layers and
  /// method; all or nothing.
  /// @throws gradapt::error naming the first field that does not match
  void load(archive_reader& r) {
    constexpr const char* who = "kfac state load";
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<C>), who, ": the checkpoint holds ", et, " factors but this state ",
                    name(dtype_of_v<C>));
    const auto m = r.get<std::string>("method");
    detail::require(m == (method_ == kfac_method::eigen ? "eigen" : "inverse"), who,
                    ": the checkpoint's method is '", m, "' (restore with the same kfac_options::method)");
    const auto steps = r.get<std::uint64_t>("steps");
    const auto count = r.get<std::uint64_t>("layers");
    detail::require(count == l_.size(), who, ": the checkpoint holds ", count, " layers but this state ",
                    l_.size());
    std::vector<layer_t> next = l_;
    for (std::size_t i = 0; i < l_.size(); ++i) {
      auto& x = next[i];
      const std::string sec = detail::archive_impl::join("layer", "/", x.spec.name);
      detail::require(r.has(detail::archive_impl::join(sec, "/", "index")), who,
                      ": the checkpoint has no layer '", x.spec.name, "'");
      r.begin(sec);
      detail::require(r.get<std::uint64_t>("index") == i, who, ": layer '", x.spec.name,
                      "' has another position in the checkpoint");
      const auto shape = r.get_tensor<std::int64_t>("shape");
      detail::require(shape == std::vector<std::int64_t>{x.spec.in, x.spec.out, x.spec.bias ? 1 : 0}, who,
                      ": layer '", x.spec.name, "' has another shape or bias in the checkpoint");
      const std::int64_t sa[2] = {x.n, x.n}, sg[2] = {x.spec.out, x.spec.out};
      get(r, x, "A", x.a, sa, who);
      get(r, x, "G", x.g, sg, who);
      get(r, x, "decomposition", x.dec, std::array<std::int64_t, 1>{static_cast<std::int64_t>(x.dec.size())},
          who);
      x.ready = r.get<bool>("ready");
      x.consecutive = r.get<std::uint64_t>("consecutive_failures");
      x.failures = r.get<std::uint64_t>("failures");
      detail::require(x.consecutive < max_failures_ && x.consecutive <= x.failures, who, ": layer '",
                      x.spec.name, "' has ", x.consecutive, " consecutive failures of ", x.failures);
      r.end();
    }
    detail::require(r.names().size() == 4 + 8 * l_.size(), who, ": the checkpoint holds ", r.names().size(),
                    " fields but this state has ", 4 + 8 * l_.size());
    for (std::size_t i = 0; i < l_.size(); ++i) {
      l_[i].a.swap(next[i].a);
      l_[i].g.swap(next[i].g);
      l_[i].dec.swap(next[i].dec);
      l_[i].ready = next[i].ready;
      l_[i].consecutive = next[i].consecutive;
      l_[i].failures = next[i].failures;
      l_[i].count = 0;
      l_[i].inited = true;
    }
    steps_ = steps;
    failed_ = false;
  }
  /// The state as one archive of kind "gradapt.kfac".
  std::vector<std::byte> save() const { return save_archive(*this); }
  /// Restores a state written by `save()` (all or nothing).
  void load(std::span<const std::byte> bytes) { load_archive(*this, bytes); }

 private:
  friend class kfac;
  struct layer_t {
    kfac_layer spec;
    std::int64_t n = 0;       ///< in + bias
    std::vector<C> a, g;      ///< the running factors
    std::vector<C> ba, bg;    ///< this step's accumulated terms
    std::vector<C> v;         ///< this step's preconditioned gradient (out × (in [+1]))
    std::uint64_t count = 0;  ///< accumulate() calls this step
    bool inited = false;      ///< the factors have had a first update
    std::vector<C> dec;       ///< eigen: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹
    bool ready = false;
    std::uint64_t consecutive = 0, failures = 0;
  };
  const layer_t& at(std::size_t i) const {
    detail::require(i < l_.size(), "kfac_state: layer ", i, " out of range (", l_.size(), " layers)");
    return l_[i];
  }
  template <class Shape>
  static void put(archive_writer& w, const layer_t& x, const char* field, const std::vector<C>& v,
                  const Shape& sh) {
    for (const C e : v)
      detail::require(std::isfinite(e), "kfac state save: ", field, " of layer '", x.spec.name,
                      "' is not finite (save the last good state)");
    w.put_tensor<C>(field, std::span<const C>(v), sh);
  }
  template <class Shape>
  static void get(archive_reader& r, const layer_t& x, const char* field, std::vector<C>& v, const Shape& sh,
                  const char* who) {
    r.get_tensor<C>(field, std::span<C>(v), sh);
    for (const C e : v)
      detail::require(std::isfinite(e), who, ": ", field, " of layer '", x.spec.name, "' is not finite");
  }

  L la_{};
  kfac_method method_ = kfac_method::eigen;
  bool prediv_ = false;
  std::uint64_t max_failures_ = 1;
  std::uint64_t steps_ = 0;
  bool failed_ = false;
  double nu_ = 1;
  std::uint64_t computed_ = 0;
  std::vector<layer_t> l_;
  std::vector<std::pair<std::int64_t, std::shared_ptr<detail::linalg::eigh_workspace_t<L, C>>>> ws_;
  std::vector<C> scratch_, t1_, t2_, red_;  ///< a or g in C, products, M, the factor reduction
  detail::owner_exchange<C> x_;
};

/// K-FAC on the host (see the file comment and docs/algorithms/kfac.md). Per step:
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
  }

  /// A state for `layers` with factors in C (float or double) on linear-algebra backend `la`.
  /// @throws gradapt::error for an empty list, a layer with in or out < 1, or a repeated name
  template <class C = float, linalg_backend L>
  requires std::same_as<typename L::space, host_space> kfac_state<L, C> init(
      const L& la, std::span<const kfac_layer> layers)
  const {
    detail::require(!layers.empty(), "kfac::init: no layers (register at least one)");
    kfac_state<L, C> st;
    st.la_ = la;
    st.method_ = o_.method;
    st.prediv_ = o_.prediv_eigenvalues;
    st.max_failures_ = o_.max_consecutive_failures;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto& s = layers[i];
      detail::require(s.in >= 1 && s.out >= 1, "kfac::init: layer '", s.name, "' has in ", s.in, " and out ",
                      s.out, " (expected >= 1)");
      for (std::size_t j = 0; j < i; ++j)
        detail::require(layers[j].name != s.name, "kfac::init: layer name '", s.name,
                        "' is registered twice (names address checkpoints)");
      typename kfac_state<L, C>::layer_t x;
      x.spec = s;
      x.n = s.in + (s.bias ? 1 : 0);
      const auto na = static_cast<std::size_t>(x.n), ng = static_cast<std::size_t>(s.out);
      x.a.assign(na * na, C(0));
      x.g.assign(ng * ng, C(0));
      x.ba.assign(na * na, C(0));
      x.bg.assign(ng * ng, C(0));
      x.v.assign(ng * na, C(0));
      x.dec.assign(o_.method == kfac_method::inverse
                       ? na * na + ng * ng
                       : na * na + na + ng * ng + ng + (o_.prediv_eigenvalues ? ng * na : 0),
                   C(0));
      workspace(st, la, x.n);
      workspace(st, la, s.out);
      st.l_.push_back(std::move(x));
    }
    return st;
  }

  /// Whether the state's next step updates the factors (the framework collects a and g then).
  template <class L, class C>
  bool factor_update_due(const kfac_state<L, C>& st) const {
    return st.steps_ % o_.factor_update_steps == 0;
  }

  /// Adds layer i's inputs `a` (rows × in) and output gradients `g` (rows × out, scaled by
  /// `loss_scale`, which is divided out) to this step's factor terms. Several calls in one step
  /// (micro-batches) are averaged. Only on steps whose factor update is due.
  /// @throws gradapt::error for an unknown layer, shapes that do not match its registration, a
  ///         row count that differs between a and g or is 0, a loss scale that is not finite
  ///         and > 0, or a step that does not update factors
  template <class L, class C, element T>
  void accumulate(kfac_state<L, C>& st, std::size_t i, tensor_view<const T, host_space> a,
                  tensor_view<const T, host_space> g, double loss_scale = 1.0) const {
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
    const std::int64_t rows = a.dim(0);
    const auto& la = st.la_;
    // Into scratch with the ones column (and in C), then the Gram product; then added to the
    // step's terms, so several calls add up in call order.
    st.scratch_.resize(static_cast<std::size_t>(rows * std::max(x.n, s.out)));
    C* sa = st.scratch_.data();
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < s.in; ++c) sa[r * x.n + c] = static_cast<C>(a.data()[r * s.in + c]);
      if (s.bias) sa[r * x.n + s.in] = C(1);
    }
    st.t1_.resize(std::max(x.a.size(), x.g.size()));
    la.syrk(gram::columns, 1.0 / double(rows), tensor_view<const C, host_space>(sa, {rows, x.n}), 0.0,
            tensor_view<C, host_space>(st.t1_.data(), {x.n, x.n}));
    for (std::size_t e = 0; e < x.ba.size(); ++e) x.ba[e] = x.count ? x.ba[e] + st.t1_[e] : st.t1_[e];
    for (std::int64_t e = 0; e < rows * s.out; ++e) sa[e] = static_cast<C>(g.data()[e]);
    la.syrk(gram::columns, 1.0 / (double(rows) * loss_scale * loss_scale),
            tensor_view<const C, host_space>(sa, {rows, s.out}), 0.0,
            tensor_view<C, host_space>(st.t1_.data(), {s.out, s.out}));
    for (std::size_t e = 0; e < x.bg.size(); ++e) x.bg[e] = x.count ? x.bg[e] + st.t1_[e] : st.t1_[e];
    ++x.count;
  }

  /// One step on this rank alone: the factor update (when due: every layer must have had
  /// `accumulate`), the decompositions (when due), and every layer's gradient rewritten in place.
  /// @throws gradapt::error for gradients that do not match the layers, a non-finite or negative
  ///         lr, a layer with no accumulate on a factor-update step, or a layer whose
  ///         decomposition failed max_consecutive_failures times in a row
  template <class L, class C, class R>
  requires detail::kfac_grad_range<R>
  void step(kfac_state<L, C>& st, const R& grads, double lr) const {
    detail::owner_exchange<C>* none = nullptr;
    step_impl(none, st, as_span(grads), lr);
  }

  /// One step with the factors averaged over the ranks of `comm` (one allreduce of the upper
  /// triangles of every layer's new terms) and the decompositions divided among the ranks
  /// (`lpt_assign` over (in+1)³ + out³, one allgather; every rank gets every decomposition).
  /// Every rank passes its own a and g (its local batch) and the same averaged gradients. At the
  /// first call on a world the layer list and the options are agreed across ranks; on a
  /// factor-update step a layer with no accumulate on some ranks is an error on every rank.
  /// @throws gradapt::error as the step above, and for a disagreement across ranks
  template <communicator Comm, class L, class C, class R>
  requires std::same_as<typename Comm::space, host_space> && detail::kfac_grad_range<R>
  void step(Comm& comm, kfac_state<L, C>& st, const R& grads, double lr) const {
    step_impl(&comm, st, as_span(grads), lr);
  }

 private:
  template <class R>
  static auto as_span(const R& r) {
    using G = std::ranges::range_value_t<R>;
    return std::span<const G>(std::ranges::data(r), std::ranges::size(r));
  }
  template <class St, class L>
  static void workspace(St& st, const L& la, std::int64_t n) {
    for (const auto& w : st.ws_)
      if (w.first == n) return;
    using C = std::remove_cvref_t<decltype(st.t1_[0])>;
    st.ws_.emplace_back(
        n, std::make_shared<detail::linalg::eigh_workspace_t<L, C>>(la.template eigh_workspace<C>(n)));
  }
  template <class St>
  static auto& find_ws(St& st, std::int64_t n) {
    for (auto& w : st.ws_)
      if (w.first == n) return *w.second;
    detail::fail("kfac: internal error: no eigensolver workspace for ", n);
  }

  template <class CommPtr, class L, class C, class T>
  void step_impl(CommPtr comm, kfac_state<L, C>& st, std::span<const kfac_grad<T>> grads, double lr) const {
    constexpr bool dist = !std::is_same_v<CommPtr, detail::owner_exchange<C>*>;
    constexpr const char* who = "kfac::step";
    detail::require(!st.failed_, who, ": the state stopped after a layer's decomposition failed ",
                    st.max_failures_, " times in a row or the ranks' factors differed; restore a checkpoint");
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
    const bool inverse_due = (t - 1) % o_.inv_update_steps == 0;
    if constexpr (dist) {
      if (factors_due || inverse_due || !st.x_.planned_for(comm->size(), comm->rank()))
        agree_values(*comm, "kfac::step", {{"step", static_cast<double>(t)}, {"lr", lr}}, bad);
      else if (!bad.empty())
        throw error(bad);
      plan(*comm, st);
    } else if (!bad.empty()) {
      throw error(bad);
    }
    if (factors_due) update_factors(comm, st, t);
    if (inverse_due) decompose(comm, st, t);
    // Precondition.
    double vg = 0;
    for (std::size_t i = 0; i < st.l_.size(); ++i) vg += precondition(st, i, grads[i], lr);
    double nu = 1;
    if (o_.kl_clip > 0 && vg != 0) nu = std::min(1.0, std::sqrt(o_.kl_clip / std::fabs(vg)));
    st.nu_ = nu;
    for (std::size_t i = 0; i < st.l_.size(); ++i) write_back(st, i, grads[i], nu);
    st.steps_ = t;
  }

  template <class Comm, class St>
  void plan(Comm& comm, St& st) const {
    const int n = comm.size(), me = comm.rank();
    if (st.x_.planned_for(n, me)) return;
    std::vector<std::uint64_t> cost(st.l_.size());
    std::vector<std::size_t> words(st.l_.size());
    std::uint64_t h = 0x84222325CBF29CE4ull;
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      const auto& x = st.l_[i];
      const auto na = static_cast<std::uint64_t>(x.n), ng = static_cast<std::uint64_t>(x.spec.out);
      cost[i] = na * na * na + ng * ng * ng;
      words[i] = 1 + x.dec.size();
      const std::int64_t sh[3] = {x.spec.in, x.spec.out, x.spec.bias ? 1 : 0};
      h = detail::hash_bytes(h, sh, 3);
      h = detail::hash_bytes(h, x.spec.name.data(), x.spec.name.size());
    }
    const agreed_value values[] = {
        {"layers", static_cast<double>(st.l_.size())},
        {"layer names and shapes (hash)", static_cast<double>(h >> 16)},
        {"steps taken", static_cast<double>(st.steps_)},
        {"factor_decay", o_.factor_decay},
        {"factor_update_steps", static_cast<double>(o_.factor_update_steps)},
        {"inv_update_steps", static_cast<double>(o_.inv_update_steps)},
        {"damping", o_.damping},
        {"method", static_cast<double>(o_.method)},
        {"prediv_eigenvalues", o_.prediv_eigenvalues ? 1.0 : 0.0},
        {"kl_clip", o_.kl_clip},
        {"max_consecutive_failures", static_cast<double>(o_.max_consecutive_failures)},
    };
    agree_values(comm, "kfac::step (distributed)", std::span<const agreed_value>(values));
    st.x_.plan(cost, words, n, me);
  }

  /// The running factors from this step's terms (averaged over the ranks when distributed).
  template <class CommPtr, class St>
  void update_factors(CommPtr comm, St& st, std::uint64_t t) const {
    using C = std::remove_cvref_t<decltype(st.t1_[0])>;
    constexpr bool dist = !std::is_same_v<CommPtr, detail::owner_exchange<C>*>;
    if constexpr (dist) {
      // One buffer: per layer a flag (it had terms), then the upper triangles of A's and G's terms.
      std::size_t words = 0;
      for (const auto& x : st.l_)
        words += 1 + static_cast<std::size_t>(x.n * (x.n + 1) / 2 + x.spec.out * (x.spec.out + 1) / 2);
      st.red_.assign(words, C(0));
      C* p = st.red_.data();
      for (auto& x : st.l_) {
        *p++ = x.count ? C(1) : C(0);
        pack(p, x.ba, x.n, x.count);
        pack(p, x.bg, x.spec.out, x.count);
      }
      comm->allreduce(tensor_view<C, host_space>::vector(st.red_.data(), static_cast<std::int64_t>(words)),
                      reduce_op::sum);
      const int n = comm->size();
      p = st.red_.data();
      for (auto& x : st.l_) {
        const auto have = static_cast<int>(*p++);
        if (have != n) {
          for (auto& y : st.l_) y.count = 0;
          detail::fail("kfac::step on rank ", comm->rank(), ": layer '", x.spec.name, "' got a and g on ",
                       have, " of ", n, " ranks at factor-update step ", t,
                       " (every rank must call accumulate for every layer on these steps)");
        }
        unpack(p, x.ba, x.n, C(n));
        unpack(p, x.bg, x.spec.out, C(n));
      }
    } else {
      for (auto& x : st.l_) {
        if (x.count == 0) {
          detail::fail("kfac::step: layer '", x.spec.name, "' got no a and g at factor-update step ", t,
                       " (call accumulate for every layer on these steps; factor_update_due() says which)");
        }
        const C inv = C(x.count);
        for (auto& e : x.ba) e = e / inv;
        for (auto& e : x.bg) e = e / inv;
      }
    }
    const C d = C(o_.factor_decay), w = C(1.0 - o_.factor_decay);
    for (auto& x : st.l_) {
      ema(x.a, x.ba, x.n, x.inited, d, w);
      ema(x.g, x.bg, x.spec.out, x.inited, d, w);
      x.inited = true;
      x.count = 0;
    }
  }
  template <class C>
  static void pack(C*& p, const std::vector<C>& m, std::int64_t n, std::uint64_t count) {
    const C inv = C(count ? count : 1);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c = r; c < n; ++c) *p++ = count ? m[static_cast<std::size_t>(r * n + c)] / inv : C(0);
  }
  template <class C>
  static void unpack(C*& p, std::vector<C>& m, std::int64_t n, C ranks) {
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c = r; c < n; ++c) {
        const C v = *p++ / ranks;
        m[static_cast<std::size_t>(r * n + c)] = v;
        m[static_cast<std::size_t>(c * n + r)] = v;
      }
  }
  template <class C>
  static void ema(std::vector<C>& f, const std::vector<C>& b, std::int64_t n, bool inited, C d, C w) {
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c = 0; c < n; ++c) {
        const auto e = static_cast<std::size_t>(r * n + c);
        const C prev = inited ? f[e] : (r == c ? C(1) : C(0));
        f[e] = d * prev + w * b[e];
      }
  }

  /// Every layer's decomposition (this rank's layers only when distributed, then exchanged).
  template <class CommPtr, class St>
  void decompose(CommPtr comm, St& st, std::uint64_t t) const {
    using C = std::remove_cvref_t<decltype(st.t1_[0])>;
    constexpr bool dist = !std::is_same_v<CommPtr, detail::owner_exchange<C>*>;
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      if constexpr (dist)
        if (!st.x_.owns(i)) continue;
      auto& x = st.l_[i];
      C* out = nullptr;
      if constexpr (dist) {
        out = st.x_.out(i) + 1;
      } else {
        st.t2_.resize(x.dec.size());
        out = st.t2_.data();
      }
      const bool ok = decompose_layer(st, x, out);
      ++st.computed_;
      if constexpr (dist) {
        st.x_.out(i)[0] = ok ? C(1) : C(0);
      } else {
        install(st, i, ok, out, -1);
      }
    }
    if constexpr (dist) {
      std::uint64_t h = 0xCBF29CE484222325ull;
      for (const auto& x : st.l_) {
        h = detail::hash_bytes(h, x.a.data(), x.a.size());
        h = detail::hash_bytes(h, x.g.data(), x.g.size());
      }
      const int differs = st.x_.run(*comm, t, h, "kfac::step");
      if (differs >= 0) {
        st.failed_ = true;
        detail::fail("kfac::step on rank ", st.x_.rank, ": the factors of rank ", differs,
                     " differ from rank 0's at step ", t, "; restore a checkpoint with load()");
      }
      for (std::size_t i = 0; i < st.l_.size(); ++i) {
        const C* in = st.x_.in(i);
        install(st, i, in[0] == C(1), in + 1, st.x_.owner[i]);
      }
    }
  }

  /// Layer x's decomposition into `out` (the layout of x.dec); false when a factor is not finite
  /// or the eigensolver fails.
  template <class St, class X, class C>
  bool decompose_layer(St& st, X& x, C* out) const {
    const std::int64_t na = x.n, ng = x.spec.out;
    for (const C e : x.a)
      if (!std::isfinite(e)) return false;
    for (const C e : x.g)
      if (!std::isfinite(e)) return false;
    C* qa = out;
    C* da = qa + na * na;
    C* qg = da + na;
    C* dg = qg + ng * ng;
    // eigen layout: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹ (built from the same
    // eigendecompositions in the scratch).
    std::vector<C>& tmp = st.t1_;
    if (o_.method == kfac_method::inverse) {
      tmp.resize(static_cast<std::size_t>(na * na + na + ng * ng + ng));
      qa = tmp.data();
      da = qa + na * na;
      qg = da + na;
      dg = qg + ng * ng;
    }
    std::copy(x.a.begin(), x.a.end(), qa);
    std::copy(x.g.begin(), x.g.end(), qg);
    const auto& la = st.la_;
    if (!la.eigh(tensor_view<C, host_space>(qa, {na, na}), tensor_view<C, host_space>(da, {na}),
                 find_ws(st, na)))
      return false;
    if (!la.eigh(tensor_view<C, host_space>(qg, {ng, ng}), tensor_view<C, host_space>(dg, {ng}),
                 find_ws(st, ng)))
      return false;
    for (std::int64_t e = 0; e < na; ++e) da[e] = std::max(da[e], C(0));
    for (std::int64_t e = 0; e < ng; ++e) dg[e] = std::max(dg[e], C(0));
    for (std::int64_t e = 0; e < na * na; ++e)
      if (!std::isfinite(qa[e])) return false;
    for (std::int64_t e = 0; e < ng * ng; ++e)
      if (!std::isfinite(qg[e])) return false;
    const C lambda = C(o_.damping);
    if (o_.method == kfac_method::inverse) {
      // X⁻¹ = Q·diag(1 / (d + λ))·Qᵀ, one row of products at a time into `out`.
      const auto inverse = [&](const C* q, const C* d, std::int64_t n, C* dst) {
        for (std::int64_t r = 0; r < n; ++r)
          for (std::int64_t c = 0; c < n; ++c) {
            double s = 0;
            for (std::int64_t k = 0; k < n; ++k)
              s += double(q[r * n + k]) * double(q[c * n + k]) / (double(d[k]) + double(lambda));
            dst[r * n + c] = C(s);
          }
      };
      inverse(qa, da, na, out);
      inverse(qg, dg, ng, out + na * na);
      for (std::int64_t e = 0; e < na * na + ng * ng; ++e)
        if (!std::isfinite(out[e])) return false;
      return true;
    }
    if (o_.prediv_eigenvalues) {
      C* pd = dg + ng;
      for (std::int64_t r = 0; r < ng; ++r)
        for (std::int64_t c = 0; c < na; ++c) pd[r * na + c] = C(1) / (dg[r] * da[c] + lambda);
      for (std::int64_t e = 0; e < ng * na; ++e)
        if (!std::isfinite(pd[e])) return false;
    }
    return true;
  }

  template <class St, class C>
  static void install(St& st, std::size_t i, bool ok, const C* dec, int rank) {
    auto& x = st.l_[i];
    if (ok) {
      std::copy(dec, dec + x.dec.size(), x.dec.begin());
      x.ready = true;
      x.consecutive = 0;
      return;
    }
    ++x.failures;
    if (++x.consecutive < st.max_failures_) return;
    st.failed_ = true;
    detail::fail(
        "kfac::step: layer '", x.spec.name, "': the decomposition failed ", x.consecutive, " times in a row",
        rank >= 0 ? " (computed on rank " + std::to_string(rank) + ")" : std::string(),
        "; a non-finite a or g makes the factors non-finite for good. The gradients are unchanged; restore a "
        "checkpoint with load() (and skip non-finite steps, e.g. with the loss scaler), or raise "
        "max_consecutive_failures");
  }

  /// V for layer i into st.m_ segment; returns lr²·⟨V, M⟩.
  template <class St, class T>
  double precondition(St& st, std::size_t i, const kfac_grad<T>& gr, double lr) const {
    using C = std::remove_cvref_t<decltype(st.t1_[0])>;
    auto& x = st.l_[i];
    const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
    // M (out × n) into t2_, V into m_ (both sized for the largest layer).
    const auto size = static_cast<std::size_t>(ng * na);
    st.t2_.resize(std::max(st.t2_.size(), size));
    st.t1_.resize(std::max(st.t1_.size(), size));
    C* m = st.t2_.data();
    C* v = x.v.data();
    for (std::int64_t r = 0; r < ng; ++r) {
      for (std::int64_t c = 0; c < in; ++c) m[r * na + c] = static_cast<C>(gr.weight.data()[r * in + c]);
      if (x.spec.bias) m[r * na + in] = static_cast<C>(gr.bias.data()[r]);
    }
    if (!x.ready) {
      std::copy(m, m + size, v);
    } else {
      const auto& la = st.la_;
      using cv = tensor_view<const C, host_space>;
      using mv = tensor_view<C, host_space>;
      C* tmp = st.t1_.data();
      if (o_.method == kfac_method::inverse) {
        const C* ai = x.dec.data();
        const C* gi = ai + na * na;
        la.gemm(transpose::none, transpose::none, 1.0, cv(gi, {ng, ng}), cv(m, {ng, na}), 0.0,
                mv(tmp, {ng, na}));
        la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(ai, {na, na}), 0.0,
                mv(v, {ng, na}));
      } else {
        const C* qa = x.dec.data();
        const C* da = qa + na * na;
        const C* qg = da + na;
        const C* dg = qg + ng * ng;
        const C* pd = dg + ng;
        // V1 = Q_Gᵀ·M·Q_A
        la.gemm(transpose::yes, transpose::none, 1.0, cv(qg, {ng, ng}), cv(m, {ng, na}), 0.0,
                mv(tmp, {ng, na}));
        la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0,
                mv(v, {ng, na}));
        const C lambda = C(o_.damping);
        for (std::int64_t r = 0; r < ng; ++r)
          for (std::int64_t c = 0; c < na; ++c)
            v[r * na + c] = o_.prediv_eigenvalues ? v[r * na + c] * pd[r * na + c]
                                                  : v[r * na + c] / (dg[r] * da[c] + lambda);
        // V = Q_G·V2·Q_Aᵀ
        la.gemm(transpose::none, transpose::none, 1.0, cv(qg, {ng, ng}), cv(v, {ng, na}), 0.0,
                mv(tmp, {ng, na}));
        la.gemm(transpose::none, transpose::yes, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0,
                mv(v, {ng, na}));
      }
    }
    if (o_.kl_clip == 0) return 0;
    double s = 0;  // ⟨V, M⟩ in double, in element order
    for (std::size_t e = 0; e < size; ++e) s += double(v[e]) * double(m[e]);
    return s * lr * lr;
  }

  template <class St, class T, class C>
  static void write_v(St& st, std::size_t i, const kfac_grad<T>& gr, double nu, const C* v) {
    const auto& x = st.l_[i];
    const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
    const C s = C(nu);
    for (std::int64_t r = 0; r < ng; ++r) {
      for (std::int64_t c = 0; c < in; ++c) gr.weight.data()[r * in + c] = static_cast<T>(v[r * na + c] * s);
      if (x.spec.bias) gr.bias.data()[r] = static_cast<T>(v[r * na + in] * s);
    }
  }

  template <class St, class T>
  static void write_back(St& st, std::size_t i, const kfac_grad<T>& gr, double nu) {
    write_v(st, i, gr, nu, st.l_[i].v.data());
  }

  kfac_options o_;
};

}  // namespace gradapt

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
/// (the sum over all layers). The factors are kept in C, the decompositions computed, kept and
/// applied in D (both float or double; `kfac_state<L, C, D>`). Distributed, each layer's
/// decomposition is computed on one rank and held by g = grad_worker_fraction · ranks of them,
/// which precondition its gradient (KAISA's communication-optimal, hybrid and memory-optimal
/// modes). docs/algorithms/kfac.md has the options, the distributed modes and what is not
/// built.

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

/// The two communicators of a hybrid plan (made by `split`), held by the state without its
/// type: `tag` is the address of `kfac_comms_tag<Comm>`.
struct kfac_comms_base {
  virtual ~kfac_comms_base() = default;
  const void* tag = nullptr;
};
template <class Comm>
inline constexpr char kfac_comms_tag = 0;
template <class Comm>
struct kfac_comms final : kfac_comms_base {
  kfac_comms(Comm g, Comm r) : group(std::move(g)), receivers(std::move(r)) { tag = &kfac_comms_tag<Comm>; }
  Comm group;      ///< the grad workers of this rank's layers (ranks r / g equal)
  Comm receivers;  ///< one rank of each group (ranks r mod g equal)
};
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
  /// KAISA's grad_worker_fraction, in (0, 1]: on n ranks each layer has g = max(1,
  /// round(fraction · n)) grad workers (g must divide n), the group of g consecutive ranks that
  /// holds the rank decomposing it. They hold its decomposition and precondition its gradient.
  /// 1: every rank holds every decomposition (communication-optimal); 1/n: only the decomposing
  /// rank (memory-optimal; the preconditioned gradients are allgathered every step); in between,
  /// hybrid. Every choice gives the same bits. Default 1.
  double grad_worker_fraction = 1;
};

class kfac;

/// The state of `gradapt::kfac` over linear-algebra backend L, with factors in C and
/// decompositions in D (each float or double): per layer its factors A and G, the batch terms
/// accumulated in this step, the decomposition (Q_A, d_A, Q_G, d_G, or the inverses; with prediv
/// 1 / (d_G·d_Aᵀ + λ)) where this rank holds it, and its failure counters.
///
/// Checkpoint: one archive of kind "gradapt.kfac" addressed by layer name (factors, the
/// decompositions this rank holds, counters). Decompositions are stored, not recomputed: a
/// rank that loads a checkpoint lacking a decomposition it must hold (a save from a rank that
/// did not hold it, under grad_worker_fraction < 1 or another world) recomputes every
/// decomposition from the stored factors at its next step, on every rank.
template <class L, class C, class D = C>
class kfac_state {
  static_assert(std::is_same_v<C, float> || std::is_same_v<C, double>, "kfac_state: C is float or double");
  static_assert(std::is_same_v<D, float> || std::is_same_v<D, double>, "kfac_state: D is float or double");

 public:
  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.kfac";
  static constexpr std::uint32_t archive_version = 2;  ///< see archive_kind

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
  /// Whether layer i has had a successful inverse update (on whichever rank computed it).
  bool ready(std::size_t i) const { return at(i).ready; }
  /// Whether this rank is one of layer i's grad workers (holds its decomposition and
  /// preconditions its gradient) under the last step's plan.
  bool holds(std::size_t i) const { return at(i).held; }
  /// Bytes of the decompositions this rank keeps.
  std::size_t decomposition_bytes() const {
    std::size_t b = 0;
    for (const auto& x : l_) b += x.dec.size() * sizeof(D);
    return b;
  }
  /// Grad workers per layer under the last distributed step's plan (1 before any).
  int grad_workers() const { return group_; }
  /// Layer i's failed decompositions in a row and in all.
  std::pair<std::uint64_t, std::uint64_t> failures(std::size_t i) const {
    return {at(i).consecutive, at(i).failures};
  }
  /// Decompositions this rank computed (one per layer per inverse update it owns).
  std::uint64_t decompositions() const { return computed_; }
  /// The rank that decomposes layer i under the last distributed step's plan (0 before any).
  int owner(std::size_t i) const {
    at(i);
    return owner_.empty() ? 0 : owner_[i];
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
    w.put("decomposition_type", name(dtype_of_v<D>));
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
      const std::vector<D> none;
      const auto& dec = x.have ? x.dec : none;
      put(w, x, "decomposition", dec, std::array<std::int64_t, 1>{static_cast<std::int64_t>(dec.size())});
      w.put("ready", x.ready);
      w.put("consecutive_failures", x.consecutive);
      w.put("failures", x.failures);
      w.end();
    }
  }
  /// Reads what `save(w)` wrote into a state created by `kfac::init` for the same layers,
  /// method and element types; all or nothing. The next step re-plans (and, distributed,
  /// agrees the state across ranks).
  /// @throws gradapt::error naming the first field that does not match
  void load(archive_reader& r) {
    constexpr const char* who = "kfac state load";
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<C>), who, ": the checkpoint holds ", et, " factors but this state ",
                    name(dtype_of_v<C>));
    const bool v1 = !r.has("decomposition_type");  // format 1: D = C, every decomposition stored
    const std::string dt = v1 ? et : r.get<std::string>("decomposition_type");
    detail::require(dt == name(dtype_of_v<D>), who, ": the checkpoint holds ", dt,
                    " decompositions but this state ", name(dtype_of_v<D>));
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
      x.have = r.tensor_info("decomposition").elements != 0;
      detail::require(!v1 || x.have, who, ": layer '", x.spec.name, "' has no decomposition");
      x.dec.resize(x.have ? dec_size(x) : 0);
      get(r, x, "decomposition", x.dec, std::array<std::int64_t, 1>{static_cast<std::int64_t>(x.dec.size())},
          who);
      x.ready = r.get<bool>("ready");
      if (v1) x.have = x.ready;
      x.consecutive = r.get<std::uint64_t>("consecutive_failures");
      x.failures = r.get<std::uint64_t>("failures");
      detail::require(x.consecutive < max_failures_ && x.consecutive <= x.failures, who, ": layer '",
                      x.spec.name, "' has ", x.consecutive, " consecutive failures of ", x.failures);
      r.end();
    }
    const std::size_t fields = (v1 ? 4 : 5) + 8 * l_.size();
    detail::require(r.names().size() == fields, who, ": the checkpoint holds ", r.names().size(),
                    " fields but this state has ", fields);
    for (std::size_t i = 0; i < l_.size(); ++i) {
      l_[i].a.swap(next[i].a);
      l_[i].g.swap(next[i].g);
      l_[i].dec.swap(next[i].dec);
      l_[i].have = next[i].have;
      l_[i].held = true;
      l_[i].ready = next[i].ready;
      l_[i].consecutive = next[i].consecutive;
      l_[i].failures = next[i].failures;
      l_[i].count = 0;
      l_[i].inited = true;
    }
    steps_ = steps;
    failed_ = false;
    world_ = 0;  // re-plan at the next step
  }
  /// The state as one archive of kind "gradapt.kfac".
  std::vector<std::byte> save() const { return save_archive(*this); }
  /// Restores a state written by `save()` (all or nothing).
  void load(std::span<const std::byte> bytes) { load_archive(*this, bytes); }

 private:
  friend class kfac;
  struct layer_t {
    kfac_layer spec;
    std::int64_t n = 0;         ///< in + bias
    std::vector<C> a, g;        ///< the running factors
    std::vector<C> ba, bg;      ///< this step's accumulated terms
    std::vector<D> v;           ///< this step's preconditioned gradient (out × (in [+1])), g = n
    std::uint64_t count = 0;    ///< accumulate() calls this step
    bool inited = false;        ///< the factors have had a first update
    std::vector<D> dec;         ///< eigen: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹
    bool held = true;           ///< this rank is a grad worker of the layer
    bool have = false;          ///< dec holds a decomposition
    bool ready = false;         ///< a decomposition succeeded (on any rank)
    unsigned char outcome = 0;  ///< this step's decomposition: 0 none, 1 succeeded, 2 failed
    std::uint64_t consecutive = 0, failures = 0;
  };
  std::size_t dec_size(const layer_t& x) const {
    const auto na = static_cast<std::size_t>(x.n), ng = static_cast<std::size_t>(x.spec.out);
    return method_ == kfac_method::inverse ? na * na + ng * ng
                                           : na * na + na + ng * ng + ng + (prediv_ ? ng * na : 0);
  }
  const layer_t& at(std::size_t i) const {
    detail::require(i < l_.size(), "kfac_state: layer ", i, " out of range (", l_.size(), " layers)");
    return l_[i];
  }
  template <class E, class Shape>
  static void put(archive_writer& w, const layer_t& x, const char* field, const std::vector<E>& v,
                  const Shape& sh) {
    for (const E e : v)
      detail::require(std::isfinite(e), "kfac state save: ", field, " of layer '", x.spec.name,
                      "' is not finite (save the last good state)");
    w.put_tensor<E>(field, std::span<const E>(v), sh);
  }
  template <class E, class Shape>
  static void get(archive_reader& r, const layer_t& x, const char* field, std::vector<E>& v, const Shape& sh,
                  const char* who) {
    r.get_tensor<E>(field, std::span<E>(v), sh);
    for (const E e : v)
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
  std::vector<std::pair<std::int64_t, std::shared_ptr<detail::linalg::eigh_workspace_t<L, D>>>> ws_;
  std::vector<C> scratch_, gram_, red_;  ///< a or g in C, a Gram product, the factor reduction
  std::vector<D> m_, tmp_, dtmp_;        ///< M, a product, a decomposition being computed
  // The plan: world_ ranks (0: none yet), g = group_ grad workers per layer, owner_ decomposes.
  int world_ = 0, rank_ = 0, group_ = 1;
  bool force_ = false;  ///< recompute every decomposition at the next step
  std::vector<int> owner_;
  detail::owner_exchange<D> xd_;  ///< decompositions within a group of grad workers
  detail::owner_exchange<D> xv_;  ///< preconditioned gradients across groups (g < n)
  std::shared_ptr<detail::kfac_comms_base> comms_;
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
  /// linear-algebra backend `la`.
  /// @throws gradapt::error for an empty list, a layer with in or out < 1, or a repeated name
  template <class C = float, class D = C, linalg_backend L>
  requires std::same_as<typename L::space, host_space> kfac_state<L, C, D> init(
      const L& la, std::span<const kfac_layer> layers)
  const {
    detail::require(!layers.empty(), "kfac::init: no layers (register at least one)");
    kfac_state<L, C, D> st;
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
      typename kfac_state<L, C, D>::layer_t x;
      x.spec = s;
      x.n = s.in + (s.bias ? 1 : 0);
      const auto na = static_cast<std::size_t>(x.n), ng = static_cast<std::size_t>(s.out);
      x.a.assign(na * na, C(0));
      x.g.assign(ng * ng, C(0));
      x.ba.assign(na * na, C(0));
      x.bg.assign(ng * ng, C(0));
      x.v.assign(ng * na, D(0));
      x.dec.assign(st.dec_size(x), D(0));
      workspace(st, la, x.n);
      workspace(st, la, s.out);
      st.l_.push_back(std::move(x));
    }
    return st;
  }

  /// Whether the state's next step updates the factors (the framework collects a and g then).
  template <class L, class C, class D>
  bool factor_update_due(const kfac_state<L, C, D>& st) const {
    return st.steps_ % o_.factor_update_steps == 0;
  }

  /// Adds layer i's inputs `a` (rows × in) and output gradients `g` (rows × out, scaled by
  /// `loss_scale`, which is divided out) to this step's factor terms. Several calls in one step
  /// (micro-batches) are averaged. Only on steps whose factor update is due.
  /// @throws gradapt::error for an unknown layer, shapes that do not match its registration, a
  ///         row count that differs between a and g or is 0, a loss scale that is not finite
  ///         and > 0, or a step that does not update factors
  template <class L, class C, class D, element T>
  void accumulate(kfac_state<L, C, D>& st, std::size_t i, tensor_view<const T, host_space> a,
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
    st.gram_.resize(std::max(x.a.size(), x.g.size()));
    la.syrk(gram::columns, 1.0 / double(rows), tensor_view<const C, host_space>(sa, {rows, x.n}), 0.0,
            tensor_view<C, host_space>(st.gram_.data(), {x.n, x.n}));
    for (std::size_t e = 0; e < x.ba.size(); ++e) x.ba[e] = x.count ? x.ba[e] + st.gram_[e] : st.gram_[e];
    for (std::int64_t e = 0; e < rows * s.out; ++e) sa[e] = static_cast<C>(g.data()[e]);
    la.syrk(gram::columns, 1.0 / (double(rows) * loss_scale * loss_scale),
            tensor_view<const C, host_space>(sa, {rows, s.out}), 0.0,
            tensor_view<C, host_space>(st.gram_.data(), {s.out, s.out}));
    for (std::size_t e = 0; e < x.bg.size(); ++e) x.bg[e] = x.count ? x.bg[e] + st.gram_[e] : st.gram_[e];
    ++x.count;
  }

  /// One step on this rank alone: the factor update (when due: every layer must have had
  /// `accumulate`), the decompositions (when due), and every layer's gradient rewritten in place.
  /// @throws gradapt::error for gradients that do not match the layers, a non-finite or negative
  ///         lr, a layer with no accumulate on a factor-update step, or a layer whose
  ///         decomposition failed max_consecutive_failures times in a row
  template <class L, class C, class D, class R>
  requires detail::kfac_grad_range<R>
  void step(kfac_state<L, C, D>& st, const R& grads, double lr) const {
    step_impl(nullptr, st, as_span(grads), lr);
  }

  /// One step with the factors averaged over the ranks of `comm` (one allreduce of the upper
  /// triangles of every layer's new terms) and the decompositions divided among the ranks
  /// (`lpt_assign` over (in+1)³ + out³). Each decomposition goes to its layer's g grad workers
  /// (one allgather within each group of g ranks, at inverse updates); with g < ranks the grad
  /// workers precondition their layers and one allgather across the groups gives every rank
  /// every preconditioned gradient, each step. Every rank passes its own a and g (its local
  /// batch) and the same averaged gradients. The step, the lr and each rank's input errors are
  /// agreed every step; the layer list and the options once per world; the factors at every
  /// decomposition exchange, and the gradients at every exchange of preconditioned gradients.
  /// @throws gradapt::error as the step above, and for a disagreement across ranks (on every
  ///         rank), or a grad_worker_fraction whose g does not divide the ranks
  template <communicator Comm, class L, class C, class D, class R>
  requires std::same_as<typename Comm::space, host_space> && detail::kfac_grad_range<R>
  void step(Comm& comm, kfac_state<L, C, D>& st, const R& grads, double lr) const {
    step_impl(&comm, st, as_span(grads), lr);
  }

 private:
  template <class R>
  static auto as_span(const R& r) {
    using G = std::ranges::range_value_t<R>;
    return std::span<const G>(std::ranges::data(r), std::ranges::size(r));
  }
  template <class L, class C, class D>
  static void workspace(kfac_state<L, C, D>& st, const L& la, std::int64_t n) {
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
  template <class St>
  static std::uint64_t factor_hash(const St& st) {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (const auto& x : st.l_) {
      h = detail::hash_bytes(h, x.a.data(), x.a.size());
      h = detail::hash_bytes(h, x.g.data(), x.g.size());
    }
    return h;
  }

  template <class CommPtr, class L, class C, class D, class T>
  void step_impl(CommPtr comm, kfac_state<L, C, D>& st, std::span<const kfac_grad<T>> grads,
                 double lr) const {
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
      agree_values(*comm, "kfac::step",
                   {{"step", static_cast<double>(t)},
                    {"lr", lr},
                    {"re-plans (1 after a load or a new world)", replan ? 1.0 : 0.0}},
                   bad);
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
      if (exchange) {
        D* out = st.xv_.out(i);
        out[0] = D(x.outcome);
        precondition(st, i, grads[i], out + 1);
      } else {
        precondition(st, i, grads[i], x.v.data());
      }
    }
    if constexpr (dist) {
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
      for (std::size_t i = 0; i < st.l_.size(); ++i) vg += dot(st, i, grads[i], v_of(st, i)) * lr * lr;
    double nu = 1;
    if (o_.kl_clip > 0 && vg != 0) nu = std::min(1.0, std::sqrt(o_.kl_clip / std::fabs(vg)));
    st.nu_ = nu;
    for (std::size_t i = 0; i < st.l_.size(); ++i) write_v(st, i, grads[i], nu, v_of(st, i));
    st.steps_ = t;
  }

  template <class St>
  static const auto* v_of(const St& st, std::size_t i) {
    return st.group_ < st.world_ ? st.xv_.in(i) + 1 : st.l_[i].v.data();
  }

  template <class Comm, class St>
  bool planned(const Comm& comm, const St& st) const {
    if (st.world_ != comm.size() || st.rank_ != comm.rank() || st.group_ != grad_workers(comm.size()))
      return false;
    if (st.group_ == 1 || st.group_ == st.world_) return true;
    return st.comms_ && st.comms_->tag == &detail::kfac_comms_tag<Comm>;
  }
  template <class Comm, class St>
  static Comm* group_comm(Comm& comm, St& st) {
    if (st.group_ == st.world_) return &comm;
    return &static_cast<detail::kfac_comms<Comm>&>(*st.comms_).group;
  }
  template <class Comm, class St>
  static Comm* receivers(Comm& comm, St& st) {
    if (st.group_ == 1) return &comm;
    return &static_cast<detail::kfac_comms<Comm>&>(*st.comms_).receivers;
  }

  /// The plan for n ranks and grad-worker groups of g: owners, what this rank holds, the two
  /// exchanges. Returns per layer 1 where this rank must hold a decomposition it lacks.
  template <class St>
  static std::vector<double> layout(St& st, int n, int me, int g) {
    const std::size_t count = st.l_.size();
    if (n == 1) {
      st.owner_.assign(count, 0);
    } else {
      std::vector<std::uint64_t> cost(count);
      for (std::size_t i = 0; i < count; ++i) {
        const auto na = static_cast<std::uint64_t>(st.l_[i].n),
                   ng = static_cast<std::uint64_t>(st.l_[i].spec.out);
        cost[i] = na * na * na + ng * ng * ng;
      }
      st.owner_ = lpt_assign(std::span<const std::uint64_t>(cost), n);
    }
    std::vector<double> missing(count, 0.0);
    std::vector<int> in_group(count, -1), across(count, -1);
    std::vector<std::size_t> dec_words(count), v_words(count);
    for (std::size_t i = 0; i < count; ++i) {
      auto& x = st.l_[i];
      const int o = st.owner_[i];
      x.held = me / g == o / g;
      if (!x.held) {
        x.dec.clear();
        x.dec.shrink_to_fit();
        x.have = false;
      } else if (x.dec.size() != st.dec_size(x)) {
        x.dec.assign(st.dec_size(x), 0);
        x.have = false;
      }
      const auto v = static_cast<std::size_t>(x.spec.out * x.n);
      if (g == n) {
        x.v.resize(v);
      } else {
        x.v.clear();
        x.v.shrink_to_fit();
      }
      if (x.held && x.ready && !x.have) missing[i] = 1;
      in_group[i] = x.held ? o % g : -1;
      across[i] = o / g;
      dec_words[i] = 1 + st.dec_size(x);
      v_words[i] = 1 + v;
    }
    if (g > 1)
      st.xd_.plan_owners(std::move(in_group), dec_words, g, me % g);
    else
      st.xd_.clear();
    if (g < n)
      st.xv_.plan_owners(std::move(across), v_words, n / g, me / g);
    else
      st.xv_.clear();
    st.world_ = n;
    st.rank_ = me;
    st.group_ = g;
    return missing;
  }

  template <class Comm, class St>
  void plan(Comm& comm, St& st) const {
    using D = std::remove_cvref_t<decltype(st.m_[0])>;
    using C = std::remove_cvref_t<decltype(st.red_[0])>;
    const int n = comm.size(), me = comm.rank();
    std::uint64_t h = 0x84222325CBF29CE4ull;
    for (const auto& x : st.l_) {
      const std::int64_t sh[3] = {x.spec.in, x.spec.out, x.spec.bias ? 1 : 0};
      h = detail::hash_bytes(h, sh, 3);
      h = detail::hash_bytes(h, x.spec.name.data(), x.spec.name.size());
    }
    const agreed_value values[] = {
        {"layers", static_cast<double>(st.l_.size())},
        {"layer names and shapes (hash)", static_cast<double>(h >> 16)},
        {"steps taken", static_cast<double>(st.steps_)},
        {"factor element bytes", static_cast<double>(sizeof(C))},
        {"decomposition element bytes", static_cast<double>(sizeof(D))},
        {"factor_decay", o_.factor_decay},
        {"factor_update_steps", static_cast<double>(o_.factor_update_steps)},
        {"inv_update_steps", static_cast<double>(o_.inv_update_steps)},
        {"damping", o_.damping},
        {"method", static_cast<double>(o_.method)},
        {"prediv_eigenvalues", o_.prediv_eigenvalues ? 1.0 : 0.0},
        {"kl_clip", o_.kl_clip},
        {"max_consecutive_failures", static_cast<double>(o_.max_consecutive_failures)},
        {"grad_worker_fraction", o_.grad_worker_fraction},
    };
    agree_values(comm, "kfac::step (distributed)", std::span<const agreed_value>(values));
    const int g = grad_workers(n);
    detail::require(n % g == 0, "kfac::step: grad_worker_fraction ", o_.grad_worker_fraction, " on ", n,
                    " ranks gives ", g, " grad workers per layer, which does not divide ", n,
                    " (choose a fraction whose g = round(fraction · ranks) divides the ranks)");
    if (g > 1 && g < n)
      st.comms_ = std::make_shared<detail::kfac_comms<Comm>>(comm.split(me / g, me), comm.split(me % g, me));
    else
      st.comms_.reset();
    std::vector<double> missing = layout(st, n, me, g);
    // A decomposition some grad worker lacks (after a load, or on a new world) is recomputed for
    // every layer, on every rank.
    comm.allreduce(
        tensor_view<double, host_space>::vector(missing.data(), static_cast<std::int64_t>(missing.size())),
        reduce_op::max);
    st.force_ = std::any_of(missing.begin(), missing.end(), [](double m) { return m != 0; });
  }

  /// The running factors from this step's terms (averaged over the ranks when distributed).
  template <class CommPtr, class St>
  void update_factors(CommPtr comm, St& st, std::uint64_t t) const {
    using C = std::remove_cvref_t<decltype(st.red_[0])>;
    constexpr bool dist = !std::is_same_v<CommPtr, std::nullptr_t>;
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

  /// The decompositions of this rank's layers, then (g > 1) exchanged within each group of grad
  /// workers and installed where held. Each layer's outcome is left in `outcome` where held.
  /// Returns a message when a group member's factors differ (empty otherwise).
  template <class CommPtr, class St>
  std::string decompose(CommPtr comm, St& st, std::uint64_t t) const {
    using D = std::remove_cvref_t<decltype(st.m_[0])>;
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      if (st.owner_[i] != st.rank_) continue;
      auto& x = st.l_[i];
      if (st.group_ == 1) {
        st.dtmp_.resize(st.dec_size(x));
        const bool ok = decompose_layer(st, x, st.dtmp_.data());
        install(x, ok, st.dtmp_.data());
      } else {
        D* out = st.xd_.out(i);
        out[0] = decompose_layer(st, x, out + 1) ? D(1) : D(0);
      }
      ++st.computed_;
    }
    if constexpr (!std::is_same_v<CommPtr, std::nullptr_t>) {
      if (st.group_ > 1) {
        const int differs = st.xd_.run(*group_comm(*comm, st), t, factor_hash(st), "kfac::step");
        if (differs >= 0)
          return "kfac::step on rank " + std::to_string(st.rank_) + ": the factors of rank " +
                 std::to_string(st.rank_ - st.rank_ % st.group_ + differs) + " differ from rank " +
                 std::to_string(st.rank_ - st.rank_ % st.group_) + "'s at step " + std::to_string(t) +
                 "; restore a checkpoint with load()";
        for (std::size_t i = 0; i < st.l_.size(); ++i) {
          auto& x = st.l_[i];
          if (!x.held) continue;
          const D* in = st.xd_.in(i);
          install(x, in[0] == D(1), in + 1);
        }
      }
    }
    return {};
  }

  /// Layer x's decomposition into `out` (the layout of x.dec); false when a factor is not finite
  /// or the eigensolver fails.
  template <class St, class X, class D>
  bool decompose_layer(St& st, X& x, D* out) const {
    const std::int64_t na = x.n, ng = x.spec.out;
    for (const auto e : x.a)
      if (!std::isfinite(e)) return false;
    for (const auto e : x.g)
      if (!std::isfinite(e)) return false;
    D* qa = out;
    D* da = qa + na * na;
    D* qg = da + na;
    D* dg = qg + ng * ng;
    // eigen layout: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹ (built from the same
    // eigendecompositions in the scratch).
    std::vector<D>& tmp = st.tmp_;
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
    if (!la.eigh(tensor_view<D, host_space>(qa, {na, na}), tensor_view<D, host_space>(da, {na}),
                 find_ws(st, na)))
      return false;
    if (!la.eigh(tensor_view<D, host_space>(qg, {ng, ng}), tensor_view<D, host_space>(dg, {ng}),
                 find_ws(st, ng)))
      return false;
    for (std::int64_t e = 0; e < na; ++e) da[e] = std::max(da[e], D(0));
    for (std::int64_t e = 0; e < ng; ++e) dg[e] = std::max(dg[e], D(0));
    for (std::int64_t e = 0; e < na * na; ++e)
      if (!std::isfinite(qa[e])) return false;
    for (std::int64_t e = 0; e < ng * ng; ++e)
      if (!std::isfinite(qg[e])) return false;
    const D lambda = D(o_.damping);
    if (o_.method == kfac_method::inverse) {
      // X⁻¹ = Q·diag(1 / (d + λ))·Qᵀ, one row of products at a time into `out`.
      const auto inverse = [&](const D* q, const D* d, std::int64_t n, D* dst) {
        for (std::int64_t r = 0; r < n; ++r)
          for (std::int64_t c = 0; c < n; ++c) {
            double s = 0;
            for (std::int64_t k = 0; k < n; ++k)
              s += double(q[r * n + k]) * double(q[c * n + k]) / (double(d[k]) + double(lambda));
            dst[r * n + c] = D(s);
          }
      };
      inverse(qa, da, na, out);
      inverse(qg, dg, ng, out + na * na);
      for (std::int64_t e = 0; e < na * na + ng * ng; ++e)
        if (!std::isfinite(out[e])) return false;
      return true;
    }
    if (o_.prediv_eigenvalues) {
      D* pd = dg + ng;
      for (std::int64_t r = 0; r < ng; ++r)
        for (std::int64_t c = 0; c < na; ++c) pd[r * na + c] = D(1) / (dg[r] * da[c] + lambda);
      for (std::int64_t e = 0; e < ng * na; ++e)
        if (!std::isfinite(pd[e])) return false;
    }
    return true;
  }

  /// Installs a held layer's decomposition (when it succeeded) and records the outcome.
  template <class X, class D>
  static void install(X& x, bool ok, const D* dec) {
    x.outcome = ok ? 1 : 2;
    if (!ok) return;
    std::copy(dec, dec + x.dec.size(), x.dec.begin());
    x.have = true;
  }

  /// Every layer's failure counters from this step's outcomes (the same on every rank); throws
  /// for a layer that failed max_consecutive_failures times in a row.
  template <class St>
  static void count_outcomes(St& st) {
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      auto& x = st.l_[i];
      if (x.outcome == 1) {
        x.ready = true;
        x.consecutive = 0;
      } else if (x.outcome == 2) {
        ++x.failures;
        ++x.consecutive;
      }
    }
    for (std::size_t i = 0; i < st.l_.size(); ++i) {
      const auto& x = st.l_[i];
      if (x.outcome != 2 || x.consecutive < st.max_failures_) continue;
      st.failed_ = true;
      detail::fail(
          "kfac::step: layer '", x.spec.name, "': the decomposition failed ", x.consecutive,
          " times in a row",
          st.world_ > 1 ? " (computed on rank " + std::to_string(st.owner_[i]) + ")" : std::string(),
          "; a non-finite a or g makes the factors non-finite for good. The gradients are unchanged; "
          "restore a checkpoint with load() (and skip non-finite steps, e.g. with the loss scaler), or "
          "raise max_consecutive_failures");
    }
  }

  /// Layer i's preconditioned gradient V (out × (in [+1])) into `v`; M itself while this rank
  /// holds no decomposition of the layer.
  template <class St, class T, class D>
  void precondition(St& st, std::size_t i, const kfac_grad<T>& gr, D* v) const {
    auto& x = st.l_[i];
    const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
    const auto size = static_cast<std::size_t>(ng * na);
    st.m_.resize(std::max(st.m_.size(), size));
    st.tmp_.resize(std::max(st.tmp_.size(), size));
    D* m = st.m_.data();
    for (std::int64_t r = 0; r < ng; ++r) {
      for (std::int64_t c = 0; c < in; ++c) m[r * na + c] = static_cast<D>(gr.weight.data()[r * in + c]);
      if (x.spec.bias) m[r * na + in] = static_cast<D>(gr.bias.data()[r]);
    }
    if (!x.have) {
      std::copy(m, m + size, v);
      return;
    }
    const auto& la = st.la_;
    using cv = tensor_view<const D, host_space>;
    using mv = tensor_view<D, host_space>;
    D* tmp = st.tmp_.data();
    if (o_.method == kfac_method::inverse) {
      const D* ai = x.dec.data();
      const D* gi = ai + na * na;
      la.gemm(transpose::none, transpose::none, 1.0, cv(gi, {ng, ng}), cv(m, {ng, na}), 0.0,
              mv(tmp, {ng, na}));
      la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(ai, {na, na}), 0.0,
              mv(v, {ng, na}));
      return;
    }
    const D* qa = x.dec.data();
    const D* da = qa + na * na;
    const D* qg = da + na;
    const D* dg = qg + ng * ng;
    const D* pd = dg + ng;
    // V1 = Q_Gᵀ·M·Q_A
    la.gemm(transpose::yes, transpose::none, 1.0, cv(qg, {ng, ng}), cv(m, {ng, na}), 0.0, mv(tmp, {ng, na}));
    la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0, mv(v, {ng, na}));
    const D lambda = D(o_.damping);
    for (std::int64_t r = 0; r < ng; ++r)
      for (std::int64_t c = 0; c < na; ++c)
        v[r * na + c] =
            o_.prediv_eigenvalues ? v[r * na + c] * pd[r * na + c] : v[r * na + c] / (dg[r] * da[c] + lambda);
    // V = Q_G·V2·Q_Aᵀ
    la.gemm(transpose::none, transpose::none, 1.0, cv(qg, {ng, ng}), cv(v, {ng, na}), 0.0, mv(tmp, {ng, na}));
    la.gemm(transpose::none, transpose::yes, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0, mv(v, {ng, na}));
  }

  /// ⟨V, M⟩ of layer i in double, in element order (M as the decomposition type).
  template <class St, class T, class D>
  static double dot(const St& st, std::size_t i, const kfac_grad<T>& gr, const D* v) {
    const auto& x = st.l_[i];
    const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
    double s = 0;
    for (std::int64_t r = 0; r < ng; ++r) {
      for (std::int64_t c = 0; c < in; ++c)
        s += double(v[r * na + c]) * double(static_cast<D>(gr.weight.data()[r * in + c]));
      if (x.spec.bias) s += double(v[r * na + in]) * double(static_cast<D>(gr.bias.data()[r]));
    }
    return s;
  }

  template <class St, class T, class D>
  static void write_v(St& st, std::size_t i, const kfac_grad<T>& gr, double nu, const D* v) {
    const auto& x = st.l_[i];
    const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
    const D s = D(nu);
    for (std::int64_t r = 0; r < ng; ++r) {
      for (std::int64_t c = 0; c < in; ++c) gr.weight.data()[r * in + c] = static_cast<T>(v[r * na + c] * s);
      if (x.spec.bias) gr.bias.data()[r] = static_cast<T>(v[r * na + in] * s);
    }
  }

  kfac_options o_;
};

}  // namespace gradapt

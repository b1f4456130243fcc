#pragma once
/// @file
/// `kfac_state`, the state of `gradapt::kfac` (kfac.hpp): per layer the running factors A and G,
/// the terms accumulated in a step, the decomposition this rank holds and the failure counters;
/// the distributed plan it records; and its checkpoint (`save` and `load`).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/linalg/concepts.hpp"
#include "gradapt/linalg/factor_check.hpp"
#include "gradapt/optim/kfac_options.hpp"

namespace gradapt {

namespace detail {
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

class kfac;

/// The state of `gradapt::kfac` over linear-algebra backend L and element backend B (its
/// memory: `B::space` == `L::space`; gradapt::host on one thread for a state from
/// `kfac::init(la, layers)`), with factors in C and decompositions in D (each float or double):
/// per layer its factors A and G (the identity before the first update), the batch terms
/// accumulated in this step, the decomposition (Q_A, d_A, Q_G, d_G, or the inverses; with
/// prediv 1 / (d_G·d_Aᵀ + λ)) where this rank holds it, and its failure counters. Everything
/// numeric lives in B's memory; the accessors and the checkpoint copy to the host.
///
/// Checkpoint: one archive of kind "gradapt.kfac" addressed by layer name (factors, the
/// decompositions this rank holds, counters). Decompositions are stored, not recomputed: a
/// rank that loads a checkpoint lacking a decomposition it must hold (a save from a rank that
/// did not hold it, under grad_worker_fraction < 1 or another world) recomputes every
/// decomposition from the stored factors at its next step, on every rank.
template <class L, class C, class D = C, class B = host>
class kfac_state {
  static_assert(std::is_same_v<C, float> || std::is_same_v<C, double>, "kfac_state: C is float or double");
  static_assert(std::is_same_v<D, float> || std::is_same_v<D, double>, "kfac_state: D is float or double");
  static_assert(std::is_same_v<typename L::space, typename B::space>,
                "kfac_state: the linear-algebra backend L and the element backend B work on one memory");

 public:
  using space = typename L::space;                                    ///< where the numbers live
  static constexpr bool on_host = std::is_same_v<space, host_space>;  ///< host memory
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
  /// Layer i's factor A ((in [+1])², row-major; in device memory, a host copy valid until the
  /// next call for this layer). @throws gradapt::error when i is out of range
  std::span<const C> factor_a(std::size_t i) const { return host_view(at(i).a, at(i).ha); }
  /// Layer i's factor G (out², row-major; as factor_a). @throws gradapt::error when i is out of
  /// range
  std::span<const C> factor_g(std::size_t i) const { return host_view(at(i).g, at(i).hg); }
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
      put(w, x, "A", to_host(x.a), sa);
      put(w, x, "G", to_host(x.g), sg);
      const std::vector<D> dec = x.have ? to_host(x.dec) : std::vector<D>{};
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
    struct loaded {
      std::vector<C> a, g;
      std::vector<D> dec;
      bool have = false, ready = false;
      std::uint64_t consecutive = 0, failures = 0;
    };
    std::vector<loaded> next(l_.size());
    for (std::size_t i = 0; i < l_.size(); ++i) {
      const auto& x = l_[i];
      auto& y = next[i];
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
      y.a.resize(static_cast<std::size_t>(x.n * x.n));
      y.g.resize(static_cast<std::size_t>(x.spec.out * x.spec.out));
      get(r, x, "A", y.a, sa, who);
      get(r, x, "G", y.g, sg, who);
      check_factor(x, "A", y.a, x.n, who);
      check_factor(x, "G", y.g, x.spec.out, who);
      y.have = r.tensor_info("decomposition").elements != 0;
      detail::require(!v1 || y.have, who, ": layer '", x.spec.name, "' has no decomposition");
      y.dec.resize(y.have ? dec_size(x) : 0);
      get(r, x, "decomposition", y.dec, std::array<std::int64_t, 1>{static_cast<std::int64_t>(y.dec.size())},
          who);
      y.ready = r.get<bool>("ready");
      if (v1) y.have = y.ready;
      y.consecutive = r.get<std::uint64_t>("consecutive_failures");
      y.failures = r.get<std::uint64_t>("failures");
      detail::require(y.consecutive < max_failures_ && y.consecutive <= y.failures, who, ": layer '",
                      x.spec.name, "' has ", y.consecutive, " consecutive failures of ", y.failures);
      r.end();
    }
    const std::size_t fields = (v1 ? 4 : 5) + 8 * l_.size();
    detail::require(r.names().size() == fields, who, ": the checkpoint holds ", r.names().size(),
                    " fields but this state has ", fields);
    // Every field checked: now the copies into the state's memory.
    for (std::size_t i = 0; i < l_.size(); ++i) {
      auto& x = l_[i];
      auto& y = next[i];
      from_host(y.a, x.a);
      from_host(y.g, x.g);
      if (x.dec.size() != y.dec.size()) x.dec = ex_.template allocate<D>(y.dec.size());
      from_host(y.dec, x.dec);
      x.have = y.have;
      x.held = true;
      x.ready = y.ready;
      x.consecutive = y.consecutive;
      x.failures = y.failures;
      x.count = 0;
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
  kfac_state(const L& la, const B& ex) : la_(la), ex_(ex) {}
  template <class T>
  using buf = std::remove_cvref_t<decltype(std::declval<const B&>().template allocate<T>(std::size_t{}))>;
  struct layer_t {
    kfac_layer spec;
    std::int64_t n = 0;         ///< in + bias
    buf<C> a, g;                ///< the running factors (the identity before the first update)
    std::size_t terms = 0;      ///< this step's terms of A and G: at terms_ + terms (n², then out²)
    buf<D> v;                   ///< this step's preconditioned gradient (out × (in [+1])), g = n
    std::uint64_t count = 0;    ///< accumulate() calls this step
    buf<D> dec;                 ///< eigen: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹
    bool held = true;           ///< this rank is a grad worker of the layer
    bool have = false;          ///< dec holds a decomposition
    bool ready = false;         ///< a decomposition succeeded (on any rank)
    unsigned char outcome = 0;  ///< this step's decomposition: 0 none, 1 succeeded, 2 failed
    double vm = 0;              ///< this step's ⟨V, M⟩ (g = n, KL clipping)
    std::uint64_t consecutive = 0, failures = 0;
    mutable std::vector<C> ha, hg;  ///< device memory: host copies of a and g (the accessors)
  };
  std::size_t dec_size(const layer_t& x) const {
    const auto na = static_cast<std::size_t>(x.n), ng = static_cast<std::size_t>(x.spec.out);
    return method_ == kfac_method::inverse ? na * na + ng * ng
                                           : na * na + na + ng * ng + ng + (prediv_ ? ng * na : 0);
  }
  /// A view of n elements at p in the state's memory.
  template <class T>
  static tensor_view<T, space> vec(T* p, std::size_t n) {
    return tensor_view<T, space>::vector(p, static_cast<std::int64_t>(n));
  }
  /// The buffer's elements on the host (a copy).
  template <class Buf>
  auto to_host(const Buf& b) const {
    using T = std::remove_cvref_t<decltype(*b.data())>;
    std::vector<T> h(b.size());
    if constexpr (on_host) {
      std::copy(b.data(), b.data() + b.size(), h.begin());
    } else {
      ex_.copy(vec(static_cast<const T*>(b.data()), b.size()),
               tensor_view<T, host_space>::vector(h.data(), static_cast<std::int64_t>(h.size())));
      ex_.synchronize();
    }
    return h;
  }
  /// Host values into the buffer (of their size).
  template <class T, class Buf>
  void from_host(const std::vector<T>& h, Buf& b) const {
    if constexpr (on_host)
      std::copy(h.begin(), h.end(), b.data());
    else
      ex_.copy(tensor_view<const T, host_space>::vector(h.data(), static_cast<std::int64_t>(h.size())),
               vec(b.data(), b.size()));
  }
  /// The buffer itself in host memory; in device memory a copy into `mirror`.
  std::span<const C> host_view(const buf<C>& b, std::vector<C>& mirror) const {
    if constexpr (on_host) {
      return std::span<const C>(b.data(), b.size());
    } else {
      mirror = to_host(b);
      return mirror;
    }
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

  // A Kronecker factor is a running average of Gram matrices (linalg/factor_check.hpp).
  template <class E>
  static void check_factor(const layer_t& x, const char* field, const std::vector<E>& m, std::int64_t n,
                           const char* who) {
    const std::string bad = detail::linalg::gram_violation(m.data(), static_cast<std::size_t>(n));
    detail::require(bad.empty(), who, ": ", field, " of layer '", x.spec.name, "' ", bad);
  }

  L la_{};
  B ex_{};
  kfac_method method_ = kfac_method::eigen;
  bool prediv_ = false;
  std::uint64_t max_failures_ = 1;
  std::uint64_t steps_ = 0;
  bool failed_ = false;
  double nu_ = 1;
  std::uint64_t computed_ = 0;
  std::vector<layer_t> l_;
  std::vector<std::pair<std::int64_t, std::shared_ptr<detail::linalg::eigh_workspace_t<L, D>>>> ws_;
  buf<C> terms_;           ///< per layer a flag (it had terms), then every layer's terms (layer_t::terms)
  std::vector<C> flags_;   ///< the flags' host copy
  buf<C> iota_;            ///< 0, 1, 2, ... (the factors' row and column indices)
  buf<C> scratch_, gram_;  ///< a or g in C (rows × max(in [+1], out)), a Gram product
  buf<D> m_, tmp_, dtmp_;  ///< M, products and eigenproblems, a decomposition being computed
  // The plan: world_ ranks (0: none yet), g = group_ grad workers per layer, owner_ decomposes.
  int world_ = 0, rank_ = 0, group_ = 1;
  bool force_ = false;  ///< recompute every decomposition at the next step
  std::vector<int> owner_;
  detail::owner_exchange<D> xd_;  ///< decompositions within a group of grad workers (host memory)
  detail::owner_exchange<D> xv_;  ///< preconditioned gradients across groups (g < n; host memory)
  std::shared_ptr<detail::kfac_comms_base> comms_;
};

}  // namespace gradapt

#pragma once
/// @file
/// `shampoo_state`, the state of Shampoo's preconditioner stage (`transform::scale_by_shampoo`,
/// shampoo.hpp), held in the chain's state: per tensor its block layout,
/// per block the statistics, roots and failure counters, the graft's state, the direction
/// buffers, the roots in flight and the distributed plan. Its checkpoint (`save` and `load` of
/// a section) is in shampoo_checkpoint.hpp.

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/optim/shampoo_blocks.hpp"
#include "gradapt/optim/shampoo_grafting.hpp"
#include "gradapt/optim/shampoo_options.hpp"
#include "gradapt/optim/shampoo_root_worker.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt {

namespace transform {
template <class L>
struct scale_by_shampoo;
}  // namespace transform

/// A failed root computation of one block, as a step reports it (`shampoo_step_report`). The
/// block keeps its last good roots (or, before any, takes the graft's direction).
struct shampoo_root_failure {
  std::size_t block = 0;                 ///< index over every preconditioned block, tensor by tensor
  std::size_t tensor = 0;                ///< the parameter's index in the list
  std::size_t tensor_block = 0;          ///< the block's index within the parameter
  std::size_t factor = 0;                ///< the factor whose root failed first
  root_status reason = root_status::ok;  ///< not converged, non-finite input or result, ...
  std::uint64_t consecutive = 0;         ///< failures in a row, this one included (the step throws at
                                         ///< max_consecutive_failures)
  std::uint64_t failures = 0;            ///< failures of the block in all
  int rank = -1;                         ///< the rank that computed it (−1: this one, not distributed)
  std::uint64_t step = 0;                ///< the step whose statistics the roots came from
};

/// What a Shampoo chain's `step` reports: the root computations installed and the failures among them.
struct shampoo_step_report {
  std::uint64_t step = 0;                           ///< the step (1-based)
  std::size_t roots_installed = 0;                  ///< blocks whose new roots were installed by this step
  std::vector<shampoo_root_failure> root_failures;  ///< blocks whose roots failed at this step
};

/// The state of `transform::scale_by_shampoo` for linear-algebra backend L, element backend B,
/// parameters V and gradients G (`chain_state::preconditioner()` of a Shampoo
/// chain): per tensor its block layout; per block the k statistics and k roots (n_d × n_d
/// matrices in compute_t<V>), whether it holds roots yet, and its failure counters; the
/// graft's per-element state; the first moment; the direction buffers; scratch sized once at
/// `init`, so a steady step allocates nothing in gradapt (the BLAS/LAPACK library manages its
/// own).
///
/// Checkpoint: the "preconditioner" section of the chain's archive (kind "gradapt.optimizer"),
/// addressed by parameter name (`tensor/<name>/...`: index, shape, layout, and per block
/// `block<j>/stat<d>`, `block<j>/root<d>`, `exponents`, `ready`, `consecutive_failures`,
/// `failures`; `graft/<name>` and, with beta1 > 0, `first_moment/<name>` shaped like the
/// parameter; the options that shape the state, `beta1`, `bias_correction`, `spectrum`,
/// besides `graft`). The step count is the chain's. `load` checks everything before it changes
/// anything.
template <class L, class B, class V, class G>
class shampoo_state {
 public:
  using compute_type = compute_t<V>;  ///< element type of statistics, roots and directions
  /// Whether B works on host memory (every family member and root method), or on a device's
  /// (every family member; root-inverse Shampoo with root.method eigen).
  static constexpr bool on_host = std::same_as<typename B::space, host_space>;

  /// Format version of the section `save()` writes (its "format" field).
  static constexpr std::uint32_t format_version = 5;

  /// What a block holds besides its matrices.
  struct block_info {
    shampoo_layout::block range;             ///< offsets and extents in the merged shape
    std::size_t factors = 0;                 ///< k: statistics (and roots) of the block
    int exponent = 0;                        ///< p of its first root (see exponents)
    std::array<int, max_rank> exponents{};   ///< p of root d (0: not preconditioned, identity)
    bool ready = false;                      ///< holds roots from a successful computation
    std::uint64_t consecutive_failures = 0;  ///< failed root computations since the last success
    std::uint64_t failures = 0;              ///< failed root computations in all
  };

  /// An empty state; the chain's `init` creates a usable one.
  shampoo_state() = default;
  /// Move-only (the internal parameter list points into the state's own buffers, which do
  /// not move). Duplicate a state through `save` and `load`.
  shampoo_state(shampoo_state&&) noexcept = default;
  /// Move assignment (waits for this state's roots in flight first).
  shampoo_state& operator=(shampoo_state&&) noexcept = default;
  /// Waits for the roots in flight, if any.
  ~shampoo_state() {
    if (worker_) worker_->discard();
  }
  /// Not copyable (see the move constructor).
  shampoo_state(const shampoo_state&) = delete;
  /// Not copyable.
  shampoo_state& operator=(const shampoo_state&) = delete;

  /// Steps taken.
  std::uint64_t steps() const { return steps_; }
  /// Tensors the state was created for.
  std::size_t tensors() const { return t_.size(); }
  /// Elements of the state a checkpoint holds, in compute_type: every block's statistics,
  /// roots (eigenbases), copies for the roots in flight and corrected second moment, the graft
  /// state and the first moment (not the direction buffers and scratch).
  std::size_t state_elements() const {
    std::size_t n = 0;
    for (const auto& x : t_) {
      n += x.graft.size() + x.mom.size();
      for (const auto& bl : x.blocks)
        n += bl.stats.size() + bl.roots.size() + bl.snap.size() + bl.corr.size() + bl.mrot.size();
    }
    return n;
  }
  /// Tensor t's block layout.
  /// @throws gradapt::error when t is out of range
  const shampoo_layout& layout(std::size_t t) const { return tensor(t).layout; }
  /// Tensor t's block j.
  /// @throws gradapt::error when t or j is out of range
  block_info block(std::size_t t, std::size_t j) const {
    const auto& b = blk(t, j);
    return {tensor(t).layout.blocks[j], b.k, b.p[0], b.p, b.ready, b.consecutive, b.failures};
  }
  /// Statistic d of block j of tensor t (n_d × n_d, row-major). Host memory (on a device the
  /// checkpoint holds them).
  /// @throws gradapt::error when an index is out of range
  std::span<const compute_type> statistic(std::size_t t, std::size_t j,
                                          std::size_t d) const requires on_host {
    const auto& b = blk(t, j);
    detail::require(d < b.k, "shampoo_state::statistic: factor ", d, " out of range (", b.k, ")");
    if (b.stats.empty()) return {};  // spectral descent keeps no factors
    return {b.stats.data() + b.off[d], static_cast<std::size_t>(b.n[d] * b.n[d])};
  }
  /// Root d of block j of tensor t (n_d × n_d; zeros until the block is ready). Host memory.
  /// @throws gradapt::error when an index is out of range
  std::span<const compute_type> root(std::size_t t, std::size_t j, std::size_t d) const requires on_host {
    const auto& b = blk(t, j);
    detail::require(d < b.k, "shampoo_state::root: factor ", d, " out of range (", b.k, ")");
    if (b.roots.empty()) return {};  // spectral descent keeps no factors
    return {b.roots.data() + b.off[d], static_cast<std::size_t>(b.n[d] * b.n[d])};
  }
  /// The eigenvalue-corrected second moment V of block j of tensor t, in the block's element
  /// order in the eigenbasis (empty for the other preconditioners).
  /// @throws gradapt::error when an index is out of range
  std::span<const compute_type> corrected_moment(std::size_t t, std::size_t j) const requires on_host {
    return blk(t, j).corr;
  }
  /// The family member the state was created for.
  shampoo_preconditioner preconditioner() const { return preconditioner_; }
  /// The graft's per-element state of tensor t in the tensor's element order (empty for the
  /// none and sgd grafts). Host memory.
  std::span<const compute_type> graft_state(std::size_t t) const requires on_host { return tensor(t).graft; }
  /// The first moment m of tensor t (shampoo_options::beta1 > 0; empty otherwise), in the
  /// tensor's element order, before bias correction. Host memory.
  std::span<const compute_type> first_moment(std::size_t t) const requires on_host { return tensor(t).mom; }
  /// The direction D of tensor t computed by the last step (what the chain's later stages read as
  /// its gradient), in the tensor's element order. Host memory (on a device: direction_view).
  std::span<const compute_type> direction(std::size_t t) const requires on_host { return tensor(t).dir; }
  /// Block root computations this rank has run (each computes every factor of one block;
  /// with the distributed step, only the blocks this rank owns).
  std::uint64_t root_computations() const { return computed_; }
  /// The rank that computes the roots of block j of tensor t under the last distributed step's
  /// plan (0 before any distributed step).
  /// @throws gradapt::error when t or j is out of range
  int root_owner(std::size_t t, std::size_t j) const {
    blk(t, j);
    if (x_.world == 0) return 0;
    for (std::size_t i = 0; i < refs_.size(); ++i)
      if (refs_[i].t == t && refs_[i].j == j) return x_.owner[i];
    return 0;
  }
  /// The step whose statistics the roots in flight were started from (0: none in flight).
  std::uint64_t roots_in_flight() const { return pending_step_; }
  /// The direction of tensor t as the chain's passes read it (shaped like the parameter), in
  /// B's memory.
  tensor_view<const compute_type, typename B::space> direction_view(std::size_t t) const {
    const auto& x = tensor(t);
    return tensor_view<const compute_type, typename B::space>(x.dir.data(), x.shape);
  }

  /// Writes the state into the open section of `w` (see the class comment). Host memory.
  /// @throws gradapt::error when a statistic, root or graft state is not finite (a diverged
  ///         run; save the last good state instead)
  void save(const B& b, archive_writer& w) const;

  /// Reads what `save(b, w)` wrote (the chain's `load` calls it with the checkpoint's step
  /// count `steps`), into a state created with the same graft and blocking options for
  /// parameters with the same names and shapes. All or nothing: every field is read and
  /// checked (names, shapes, layouts, symmetric positive semidefinite finite statistics,
  /// failure counters below max_consecutive_failures), then `commit()` runs (the chain checks
  /// and copies its own buffers; it may throw), and only then does this state change.
  /// @throws gradapt::error naming the first field that does not match
  template <class Commit>
  void load(const B& b, archive_reader& r, std::uint64_t steps, Commit&& commit);

  /// The sharded optimizer's checkpoint (shard/state.hpp), for a state made with slices
  /// (`scale_by_shampoo::init_state(b, params, slices)`): `save_header` writes the fields
  /// every slice shares (format, element type, graft, beta1, bias_correction, spectrum,
  /// preconditioner, roots in flight); `save_slice(b, w, t)` writes tensor t's slice:
  /// `first_block` and `blocks` (its blocks' indices in the whole tensor), `block<J>/...` per
  /// block J of the whole tensor (as `save` writes a block), and `graft` and `first_moment`
  /// over the slice's elements.
  /// @throws gradapt::error when a value is not finite
  void save_header(archive_writer& w) const;
  /// See save_header.
  void save_slice(const B& b, archive_writer& w, std::size_t t) const;
  /// Reads and checks what `save_header` wrote, into a state just made by `init_state` with
  /// slices, at the checkpoint's step count `steps`.
  /// @throws gradapt::error naming the field that does not match this state's options
  void load_header(archive_reader& r, std::uint64_t steps);
  /// Reads what `save_slice` wrote for elements [offset, offset + length) of the tensor that
  /// tensor t of this state slices, checking every block (as `load` does) and copying the
  /// blocks and elements the two slices share into this state. Call it for every old slice
  /// of the tensor, after `load_header`, on a state just made (a failed read leaves it
  /// partly written: discard it).
  /// @throws gradapt::error naming the field and the parameter
  void load_slice(const B& b, archive_reader& r, std::size_t t, std::size_t offset, std::size_t length);

 private:
  template <class>
  friend struct transform::scale_by_shampoo;
  using C = compute_type;
  /// A buffer of B's memory (std::vector on the host): the per-element state and the scratch
  /// the spectral descent's direction passes through.
  using buf = std::remove_cvref_t<decltype(std::declval<const B&>().template allocate<C>(std::size_t{}))>;

  struct block_t {
    std::size_t k = 0;
    std::array<int, max_rank> p{};
    std::array<std::int64_t, max_rank> n{};
    std::array<std::size_t, max_rank> off{};
    /// Host memory: the statistics and roots. Device memory: they live in the state's dstats_
    /// and droots_ at offset `at`, and these are the host copies a checkpoint and the
    /// statistics' hash go through.
    std::vector<C> stats, roots;
    std::size_t at = 0;
    /// root_staleness >= 1: the statistics copied for the worker and its roots. Device memory:
    /// they live in dsnap_ and dpend_ at offset `at`, and snap is the host copy a checkpoint goes
    /// through (pend is empty).
    std::vector<C> snap, pend;
    std::vector<C> corr;     ///< eigenvalue-corrected: the second moment V in the eigenbasis
    std::vector<C> mrot;     ///< eigenvalue-corrected with beta1 > 0: Qᵀ M Q in the current bases
    std::size_t at_e = 0;    ///< device memory: corr and mrot in dcorr_ and dmrot_ at this offset
    bool mrot_valid = true;  ///< false from new bases' install to the next direction
    bool ready = false;
    std::uint64_t consecutive = 0, failures = 0;
  };
  struct tensor_t {
    std::string name;
    std::vector<std::int64_t> shape;
    std::size_t size = 0;
    shampoo_layout layout;
    std::vector<block_t> blocks;
    buf graft, dir, mom;  ///< mom: the first moment (beta1 > 0)
    // A slice of a larger tensor (the sharded optimizer's): its whole shape, its first element
    // and its first block's index within the whole tensor.
    bool sliced = false;
    std::vector<std::int64_t> whole;
    shampoo_layout whole_layout;
    std::size_t offset = 0, first_block = 0, whole_size = 0;
    std::size_t band_rows = 0, band = 0, per_band = 0;  ///< rows per row of blocks, elements per row, blocks
  };
  using workspace_t = detail::shampoo_impl::root_workspace<L, C, std::conditional_t<on_host, host, B>>;

  const tensor_t& tensor(std::size_t t) const {
    detail::require(t < t_.size(), "shampoo_state: tensor ", t, " out of range (", t_.size(), " tensors)");
    return t_[t];
  }
  const block_t& blk(std::size_t t, std::size_t j) const {
    const auto& x = tensor(t);
    detail::require(j < x.blocks.size(), "shampoo_state: block ", j, " of parameter '", x.name,
                    "' out of range (", x.blocks.size(), " blocks)");
    return x.blocks[j];
  }
  static std::vector<std::int64_t> layout_words(const shampoo_layout& l) {
    std::vector<std::int64_t> w{l.diagonal ? 1 : 0, static_cast<std::int64_t>(l.merged.size())};
    w.insert(w.end(), l.merged.begin(), l.merged.end());
    w.push_back(static_cast<std::int64_t>(l.blocks.size()));
    for (const auto& b : l.blocks)
      for (std::size_t d = 0; d < l.merged.size(); ++d) {
        w.push_back(b.offset[d]);
        w.push_back(b.size[d]);
      }
    return w;
  }
  static std::vector<std::int64_t> exponent_words(const block_t& b) {
    return std::vector<std::int64_t>(b.p.begin(), b.p.begin() + static_cast<std::ptrdiff_t>(b.k));
  }
  /// Buffer `v` as host values: itself on the host; copied through `b` into `tmp` on a device.
  static std::span<const C> host_values(const B& b, const buf& v, std::vector<C>& tmp) {
    if constexpr (on_host) {
      (void)b;
      (void)tmp;
      return {v.data(), v.size()};
    } else {
      tmp.resize(v.size());
      const auto n = static_cast<std::int64_t>(v.size());
      b.copy(tensor_view<const C, typename B::space>::vector(v.data(), n),
             tensor_view<C, host_space>::vector(tmp.data(), n));
      return tmp;
    }
  }
  static void require_finite(std::span<const C> v, const std::string& name, std::size_t j, const char* what,
                             const char* who = "shampoo state save") {
    for (const C x : v)
      detail::require(std::isfinite(x), who, ": a ", what, " of parameter '", name, "' (block ", j,
                      ") is not finite; a checkpoint of a diverged run cannot be resumed (save the last good "
                      "state instead)");
  }
  // The checkpoint's pieces (shampoo_checkpoint.hpp).
  void write_block(archive_writer& w, std::size_t t, std::size_t j, std::size_t label, const C* stats,
                   const C* roots, const C* corr, const C* mrot, const C* snap) const;
  // write_block from B's memory (device: through host copies), and a block's host copies
  // into the device buffers (nothing in host memory).
  void write_block_of(const B& b, archive_writer& w, std::size_t t, std::size_t j, std::size_t label) const;
  void block_to_device(const B& b, const block_t& bl);
  void read_block(archive_reader& r, const std::string& pname, block_t& bl, std::size_t j,
                  std::uint64_t in_flight) const;
  std::uint64_t check_header(archive_reader& r, std::uint64_t steps) const;
  static std::size_t block_fields(const block_t& bl, bool in_flight) {
    return (bl.stats.empty() ? 0 : (in_flight ? 3 : 2) * bl.k) + 4 + (bl.corr.empty() ? 0 : 1) +
           (bl.mrot.empty() ? 0 : 1);
  }
  /// A block's field in the memory of B: the block's own vector `h` on the host, the
  /// state's device buffer `d` at offset `at` on a device.
  template <class H, class D>
  static auto* in_memory(H& h, D& d, std::size_t at) {
    if constexpr (on_host)
      return h.data();
    else
      return d.data() + at;
  }
  /// Block bl's statistics, roots, snapshot and the worker's roots (root_staleness >= 1),
  /// corrected second moment and rotated first moment in the memory of B.
  C* stats_at(block_t& bl) { return in_memory(bl.stats, dstats_, bl.at); }
  C* roots_at(block_t& bl) { return in_memory(bl.roots, droots_, bl.at); }
  C* snap_at(block_t& bl) { return in_memory(bl.snap, dsnap_, bl.at); }
  C* pend_at(block_t& bl) { return in_memory(bl.pend, dpend_, bl.at); }
  C* corr_at(block_t& bl) { return in_memory(bl.corr, dcorr_, bl.at_e); }
  C* mrot_at(block_t& bl) { return in_memory(bl.mrot, dmrot_, bl.at_e); }
  const C* roots_at(const block_t& bl) const { return in_memory(bl.roots, droots_, bl.at); }
  workspace_t& workspace(std::int64_t n) {
    for (auto& [size, ws] : ws_)
      if (size == n) return *ws;
    detail::fail("shampoo: internal error: no root workspace for size ", n);
  }

  // Declared first so that a move assignment joins the old worker before anything it reads
  // is replaced; the destructor waits for it before any member goes.
  std::unique_ptr<detail::shampoo_impl::root_worker<L, C, std::conditional_t<on_host, host, B>>> worker_;
  L la_{};
  shampoo_graft graft_ = shampoo_graft::none;
  double beta1_ = 0;              ///< shampoo_options::beta1 (the first moment's meaning)
  bool bias_correction_ = false;  ///< shampoo_options::bias_correction (the roots' input)
  shampoo_spectrum spectrum_ = shampoo_spectrum::clamp;  ///< shampoo_options::spectrum
  shampoo_preconditioner preconditioner_ = shampoo_preconditioner::root_inverse;  ///< the family member
  std::vector<shampoo_root_failure> report_;  ///< this step's root failures (moved into its report)
  std::uint64_t max_failures_ = 1;
  std::uint64_t steps_ = 0;
  bool failed_ = false;
  std::vector<tensor_t> t_;
  std::vector<std::pair<std::int64_t, std::unique_ptr<workspace_t>>> ws_;
  buf xb_, ab_, db_, y0_, y1_;  ///< block scratch: g, graft state, D_g, products
  buf rs_;                      ///< block scratch: roots
  buf dstats_, droots_;         ///< device memory: every block's statistics and roots (block_t::at)
  buf dcorr_, dmrot_;           ///< device memory: every block's corr and mrot (block_t::at_e)
  buf dsnap_, dpend_;           ///< device memory, root_staleness >= 1: every block's snap and pend (at)
  std::vector<C> hbuf_;         ///< device memory: host staging of the roots' identity factors
  buf mb_;                      ///< block scratch: the corrected first moment (beta1 > 0)
  buf ns_;                      ///< spectral descent: Newton–Schulz scratch

  struct ref_t {
    std::size_t t = 0, j = 0;  ///< tensor and block
    std::uint64_t cost = 0;    ///< Σ n_d³ of its factors
    std::size_t words = 0;     ///< Σ n_d² (its roots' elements)
  };
  std::vector<ref_t> refs_;  ///< every preconditioned block, tensor by tensor
  std::uint64_t staleness_ = 0;
  bool deterministic_ = true;
  // Roots in flight (root_staleness >= 1).
  std::uint64_t pending_step_ = 0;  ///< the step that started them (0: none)
  std::uint64_t pending_hash_ = 0;  ///< hash of the statistics they start from
  bool relaunch_ = false;           ///< loaded with roots in flight: start them at the next step
  std::vector<detail::shampoo_impl::root_task<C>> tasks_;
  detail::owner_exchange<C> x_;  ///< distributed roots: plan and buffers (world 0: none yet)
  // Distributed roots in device memory: x_'s chunks in B's memory (the status words unused),
  // and this rank's (status, failing factor) per block it computes (by x_.slot), every rank's,
  // and the words of the agreement that carries them.
  buf dxsend_, dxrecv_;
  std::vector<double> xstat_, xall_, xwork_;
  std::uint64_t computed_ = 0;  ///< root computations (blocks) this rank ran
  std::size_t installed_ = 0;   ///< blocks whose roots the current step installed
};

}  // namespace gradapt

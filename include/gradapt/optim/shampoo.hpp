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
///     P_d = (S_d + r·I)^(−1/p)             p = 2k (−1/4 for a matrix), every
///                                         `precondition_frequency` steps from
///                                         `start_preconditioning_step` (linalg/matrix_root.hpp)
///     D_s = X ×₁ P_1 ×₂ … ×ₖ P_k          (k = 2: P_L·G·P_R)
///     D_g = the grafted method's direction for the block (SGD, AdaGrad, RMSProp, Adam)
///     D   = D_s · ‖D_g‖_F / ‖D_s‖_F       (grafting: Shampoo's direction, the grafted step size)
///
/// Before `start_preconditioning_step`, and for a block with no successful root yet, D = D_g.
/// Tensors with fewer than two dimensions larger than 1 (biases, norm scales) or with a
/// dimension larger than `skip_preconditioning_dim_size_gt` use the grafted method alone (a
/// diagonal preconditioner). The direction then goes through the SGD chain (optim/sgd.hpp):
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
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/assign.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"
#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/stage.hpp"

namespace gradapt {

/// The method whose step size a Shampoo block takes (grafting), and which preconditions the
/// tensors Shampoo leaves diagonal. With g the gradient, a the method's per-element state and
/// ε `graft_epsilon`:
enum class shampoo_graft : unsigned char {
  none,     ///< no rescaling: D = D_s; diagonal tensors take g (SGD)
  sgd,      ///< D_g = g
  adagrad,  ///< a ← a + g²;  D_g = g / (√a + ε)
  rmsprop,  ///< a ← β·a + (1 − β)·g²;  D_g = g / (√a + ε)   (β = graft_beta2)
  adam,     ///< a ← β·a + (1 − β)·g²;  D_g = g / (√(a / (1 − β^t)) + ε): Adam's bias-corrected
            ///< second moment; Adam's first moment is the chain's `momentum`
};

/// The name of a graft ("none", "sgd", "adagrad", "rmsprop", "adam").
constexpr std::string_view to_string(shampoo_graft g) {
  return detail::enum_name(g, std::array<std::string_view, 5>{"none", "sgd", "adagrad", "rmsprop", "adam"});
}

/// Options of `gradapt::shampoo`, e.g. `gradapt::shampoo({.lr = 1e-3, .graft = shampoo_graft::adam})`.
/// The constructor validates them and throws gradapt::error naming a bad one.
struct shampoo_options {
  /// η, finite and >= 0. Default 1e-3. A step's `step_args::lr` overrides it.
  double lr = 1e-3;
  /// Largest side of a preconditioned block (>= 1): each dimension of the (merged) shape is cut
  /// into pieces of at most this many indices. Default 1024.
  std::int64_t max_preconditioner_dim = 1024;
  /// Merge consecutive dimensions while their product stays <= max_preconditioner_dim
  /// (scalable_shampoo's merge_small_dims: [64, 32, 3, 3] → [64, 288]). Dimensions of size 1
  /// are dropped either way. Default true.
  bool merge_small_dims = true;
  /// A tensor with a dimension larger than this (before merging) is preconditioned by the
  /// graft alone (>= 1). Default 4096.
  std::int64_t skip_preconditioning_dim_size_gt = 4096;
  /// β2 of the statistics, in (0, 1]: 1 sums them (S ← S + X·Xᵀ), below 1 keeps an EMA
  /// (S ← β2·S + (1 − β2)·X·Xᵀ). Default 1.
  double beta2 = 1.0;
  /// Update the statistics at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t statistics_frequency = 1;
  /// Recompute the roots at steps t >= start with (t − start) mod this == 0 (>= 1). Default 1.
  std::uint64_t precondition_frequency = 1;
  /// First step that computes roots and preconditions (>= 1); earlier steps take the grafted
  /// method's direction. Default 1.
  std::uint64_t start_preconditioning_step = 1;
  /// p of the roots P = (S + r·I)^(−1/p); 0 means p = 2k for a block with k factors (4 for a
  /// matrix). Default 0.
  int inverse_exponent_override = 0;
  /// How the roots are computed: method (eigen or coupled Newton), ridge ε and its kind
  /// (absolute r = ε, relative r = ε·λ_max), Newton's stopping rules (see linalg/matrix_root.hpp).
  /// Default: eigendecomposition with a relative ridge of 1e-6.
  inverse_root_options root = {};
  /// A block whose roots fail this many root computations in a row (a non-finite statistic,
  /// no convergence, an eigensolver failure) makes the step throw (>= 1). Default 10.
  std::uint64_t max_consecutive_failures = 10;
  /// Roots in a background host thread: 0 computes them inside the step at which they are due.
  /// With s >= 1 that step t copies the statistics and starts their roots in the state's worker
  /// thread; steps t .. t + s − 1 precondition with the roots they already have, and step t + s
  /// installs the new ones (waiting for the thread if it has not finished). At most
  /// precondition_frequency. Default 0.
  std::uint64_t root_staleness = 0;
  /// With root_staleness >= 1: true installs new roots at exactly step t + s, so a run's bits do
  /// not depend on how fast the thread is; false installs them at the first step after the
  /// thread has finished (at the latest t + s): fresher roots, but the step at which they take
  /// effect depends on timing. The distributed step needs true. Default true.
  bool deterministic_roots = true;
  /// The grafted method (step size of every block, and the diagonal tensors' method).
  /// Default adagrad.
  shampoo_graft graft = shampoo_graft::adagrad;
  /// β of the rmsprop and adam grafts, in [0, 1). Default 0.999.
  double graft_beta2 = 0.999;
  /// ε of the adagrad, rmsprop and adam grafts, finite and > 0. Default 1e-10.
  double graft_epsilon = 1e-10;
  /// μ of the SGD chain's momentum, in [0, 1]; 0 keeps no buffer. Default 0.
  double momentum = 0.0;
  /// Nesterov momentum (needs momentum > 0). Default false.
  bool nesterov = false;
  /// λ, finite and >= 0, added to the direction before momentum. Default 0.
  double weight_decay = 0.0;
  /// Returns true for parameter names that get no decay (in addition to
  /// `param_flags::skip_weight_decay`). Default empty.
  std::function<bool(std::string_view)> skip_weight_decay = {};
};

/// How `gradapt::shampoo` cuts one tensor into blocks (see `shampoo_plan`).
struct shampoo_layout {
  /// Preconditioned by the graft alone (fewer than two dimensions larger than 1, a dimension
  /// larger than skip_preconditioning_dim_size_gt, or an empty tensor).
  bool diagonal = true;
  /// The shape the blocks cut (dimensions of size 1 dropped, small ones merged); its
  /// row-major order is the tensor's, so it is a reshape.
  std::vector<std::int64_t> merged;
  /// One block: its first index and its extent in each merged dimension.
  struct block {
    std::array<std::int64_t, max_rank> offset{};  ///< first index per merged dimension
    std::array<std::int64_t, max_rank> size{};    ///< extent per merged dimension
  };
  /// The blocks in row-major order of the block grid (empty when diagonal).
  std::vector<block> blocks;
};

/// The block layout of a tensor of `shape` under `o` (deterministic: a function of the shape
/// and the three blocking options only).
///  1. diagonal when the tensor is empty, has fewer than two dimensions larger than 1, or has
///     a dimension larger than `skip_preconditioning_dim_size_gt`;
///  2. merged shape: dimensions of size 1 dropped; with `merge_small_dims`, consecutive
///     dimensions multiplied together while the product stays <= `max_preconditioner_dim`;
///  3. each merged dimension cut into pieces of `max_preconditioner_dim` (the last one shorter);
///     the blocks are the pieces' products, in row-major order.
/// @throws gradapt::error for a negative extent, rank > 4, max_preconditioner_dim < 1 or
///         skip_preconditioning_dim_size_gt < 1
inline shampoo_layout shampoo_plan(std::span<const std::int64_t> shape, const shampoo_options& o) {
  detail::require(o.max_preconditioner_dim >= 1, "shampoo_plan: max_preconditioner_dim is ",
                  o.max_preconditioner_dim, " (expected >= 1)");
  detail::require(o.skip_preconditioning_dim_size_gt >= 1,
                  "shampoo_plan: skip_preconditioning_dim_size_gt is ", o.skip_preconditioning_dim_size_gt,
                  " (expected >= 1)");
  detail::require(shape.size() <= static_cast<std::size_t>(max_rank), "shampoo_plan: rank ", shape.size(),
                  " (expected 0 to ", max_rank, ")");
  for (const auto d : shape) detail::require(d >= 0, "shampoo_plan: extent ", d, " (expected >= 0)");
  shampoo_layout l;
  std::int64_t big = 0, size = 1;
  bool too_large = false;
  for (const auto d : shape) {
    size *= d;
    if (d > 1) ++big;
    if (d > o.skip_preconditioning_dim_size_gt) too_large = true;
  }
  if (size == 0 || big < 2 || too_large) return l;
  const std::int64_t cap = o.max_preconditioner_dim;
  std::int64_t prod = 1;
  for (const auto d : shape) {
    if (d == 1) continue;
    if (!o.merge_small_dims) {
      l.merged.push_back(d);
    } else if (d <= cap / prod) {  // prod·d <= cap without overflow
      prod *= d;
    } else {
      if (prod > 1) l.merged.push_back(prod);
      prod = d;
    }
  }
  if (o.merge_small_dims && prod > 1) l.merged.push_back(prod);
  l.diagonal = false;
  const std::size_t k = l.merged.size();
  std::array<std::int64_t, max_rank> count{}, at{};
  std::size_t total = 1;
  for (std::size_t d = 0; d < k; ++d) {
    count[d] = (l.merged[d] - 1) / cap + 1;
    total *= static_cast<std::size_t>(count[d]);
  }
  l.blocks.reserve(total);
  for (std::size_t j = 0; j < total; ++j) {
    shampoo_layout::block b;
    for (std::size_t d = 0; d < k; ++d) {
      b.offset[d] = at[d] * cap;
      b.size[d] = std::min(cap, l.merged[d] - b.offset[d]);
    }
    l.blocks.push_back(b);
    for (std::size_t d = k; d-- > 0;) {  // odometer, last dimension fastest
      if (++at[d] < count[d]) break;
      at[d] = 0;
    }
  }
  return l;
}

namespace detail::shampoo_impl {

/// The grafted direction of one element, advancing its state a (see shampoo_graft).
template <class C>
struct graft_kernel {
  shampoo_graft kind;
  C beta, one_minus_beta, eps, bias;  ///< bias: 1 − β^t (adam)
  C operator()(C g, C& a) const {
    switch (kind) {
      case shampoo_graft::none:
      case shampoo_graft::sgd:
        return g;
      case shampoo_graft::adagrad:
        a = a + g * g;
        return g / (std::sqrt(a) + eps);
      case shampoo_graft::rmsprop:
        a = beta * a + one_minus_beta * (g * g);
        return g / (std::sqrt(a) + eps);
      case shampoo_graft::adam:
        a = beta * a + one_minus_beta * (g * g);
        return g / (std::sqrt(a / bias) + eps);
    }
    return g;
  }
};

/// True when the graft keeps a per-element state.
constexpr bool graft_has_state(shampoo_graft g) {
  return g == shampoo_graft::adagrad || g == shampoo_graft::rmsprop || g == shampoo_graft::adam;
}

/// Calls f(flat offset in the tensor, offset in the block, run length) for every contiguous
/// run (a piece of the last merged dimension) of block `b` of a tensor with merged shape `m`.
template <class F>
void for_runs(const std::vector<std::int64_t>& m, const shampoo_layout::block& b, F&& f) {
  const std::size_t k = m.size();
  std::array<std::int64_t, max_rank> stride{}, at{};
  stride[k - 1] = 1;
  for (std::size_t d = k - 1; d-- > 0;) stride[d] = stride[d + 1] * m[d + 1];
  const std::int64_t run = b.size[k - 1];
  std::int64_t inner = 0;
  while (true) {
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < k; ++d) flat += (b.offset[d] + at[d]) * stride[d];
    f(static_cast<std::size_t>(flat), static_cast<std::size_t>(inner), static_cast<std::size_t>(run));
    inner += run;
    std::size_t d = k - 1;
    while (d-- > 0) {
      if (++at[d] < b.size[d]) break;
      at[d] = 0;
    }
    if (d == static_cast<std::size_t>(-1)) return;
  }
}

/// A block's roots: factor d of the block is an n[d] × n[d] matrix at offset off[d] of both
/// `stats` and `out`. Computes them in order and stops at the first failure; returns its status
/// and factor (`out` then holds the factors before it). `ws(n)` is the root workspace for size n.
template <class L, class C, class Ws>
std::pair<root_status, std::size_t> block_roots(const L& la, std::size_t k, int p, const std::int64_t* n,
                                                const std::size_t* off, const C* stats, C* out, Ws&& ws,
                                                const inverse_root_options& o) {
  for (std::size_t d = 0; d < k; ++d) {
    const auto r = inverse_pth_root(la, tensor_view<const C, host_space>(stats + off[d], {n[d], n[d]}), p,
                                    tensor_view<C, host_space>(out + off[d], {n[d], n[d]}), ws(n[d]), o);
    if (!r.ok()) return {r.status, d};
  }
  return {root_status::ok, 0};
}

/// Stands for "no communicator": the step computes every block's roots itself.
struct no_comm {};

/// One block's roots for the worker thread: from `in` (a copy of the statistics) into `out`.
template <class C>
struct root_task {
  std::size_t k = 0;
  int p = 0;
  const std::int64_t* n = nullptr;
  const std::size_t* off = nullptr;
  const C* in = nullptr;
  C* out = nullptr;
  root_status status = root_status::ok;
  std::size_t factor = 0;
};

/// A background host thread that computes roots (shampoo_options::root_staleness >= 1). The
/// step hands it a list of tasks whose buffers stay untouched by the step until `wait` returns;
/// the thread owns the root workspaces while it runs. Created at `init`, joined by the
/// destructor (after the task list in flight, if any, is done).
template <class L, class C>
class root_worker {
 public:
  using workspace_t = inverse_root_workspace<L, C>;
  root_worker(const L& la, const inverse_root_options& o,
              std::vector<std::pair<std::int64_t, workspace_t*>> ws)
      : la_(la), o_(o), ws_(std::move(ws)), thread_([this] { run(); }) {}
  root_worker(const root_worker&) = delete;
  root_worker& operator=(const root_worker&) = delete;
  ~root_worker() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// Starts `tasks` (which must outlive the computation); the worker must be idle.
  void start(std::span<root_task<C>> tasks) {
    {
      std::lock_guard lock(m_);
      tasks_ = tasks;
      busy_ = true;
      error_ = nullptr;
    }
    cv_.notify_all();
  }
  /// True when no task list is in flight.
  bool idle() {
    std::lock_guard lock(m_);
    return !busy_;
  }
  /// Waits for the task list in flight; rethrows an exception the computation raised.
  void wait() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  /// Waits for the task list in flight and drops its outcome (a `load` replaces its inputs).
  void discard() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_; });
    error_ = nullptr;
  }

 private:
  void run() {
    std::unique_lock lock(m_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (busy_) {
        const auto tasks = tasks_;
        lock.unlock();
        std::exception_ptr err;
        try {
          for (auto& t : tasks) {
            const auto [status, factor] = block_roots(
                la_, t.k, t.p, t.n, t.off, t.in, t.out,
                [&](std::int64_t n) -> workspace_t& { return find(n); }, o_);
            t.status = status;
            t.factor = factor;
          }
        } catch (...) {
          err = std::current_exception();
        }
        lock.lock();
        error_ = err;
        busy_ = false;
        cv_.notify_all();
      } else if (stop_) {
        return;
      }
    }
  }
  workspace_t& find(std::int64_t n) {
    for (auto& [size, w] : ws_)
      if (size == n) return *w;
    detail::fail("shampoo: internal error: no root workspace for size ", n);
  }

  L la_;
  inverse_root_options o_;
  std::vector<std::pair<std::int64_t, workspace_t*>> ws_;
  std::mutex m_;
  std::condition_variable cv_;
  std::span<root_task<C>> tasks_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started after every other member exists
};

}  // namespace detail::shampoo_impl

class shampoo;

/// The state of `gradapt::shampoo` for linear-algebra backend L, element backend B (host
/// memory), parameters V, gradients G and group options `Options`: per tensor its block
/// layout; per block the k statistics and k roots (n_d × n_d matrices in compute_t<V>), whether
/// it holds roots yet, and its failure counters; the graft's per-element state; the
/// direction buffers; the SGD chain's state (momentum); scratch sized once at `init`, so a
/// steady step allocates nothing in gradapt (the BLAS/LAPACK library manages its own).
///
/// Checkpoint: one archive of kind "gradapt.shampoo" addressed by parameter name
/// (`tensor/<name>/...`: index, shape, layout, and per block `block<j>/stat<d>`,
/// `block<j>/root<d>`, `ready`, `consecutive_failures`, `failures`; `graft/<name>` shaped like
/// the parameter; the chain's state under `tail`). `load` checks everything before it changes
/// anything.
template <class L, class B, class V, class G, class Options>
class shampoo_state {
 public:
  using compute_type = compute_t<V>;  ///< element type of statistics, roots and directions
  using tail_state_type =
      chain_state<sgd_chain, B, V, compute_type, compute_type>;  ///< the SGD chain's state

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.shampoo";
  static constexpr std::uint32_t archive_version = 2;  ///< see archive_kind

  /// What a block holds besides its matrices.
  struct block_info {
    shampoo_layout::block range;             ///< offsets and extents in the merged shape
    std::size_t factors = 0;                 ///< k: statistics (and roots) of the block
    int exponent = 0;                        ///< p of its roots
    bool ready = false;                      ///< holds roots from a successful computation
    std::uint64_t consecutive_failures = 0;  ///< failed root computations since the last success
    std::uint64_t failures = 0;              ///< failed root computations in all
  };

  /// An empty state; `shampoo::init` creates a usable one.
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
  /// Tensor t's block layout.
  /// @throws gradapt::error when t is out of range
  const shampoo_layout& layout(std::size_t t) const { return tensor(t).layout; }
  /// Tensor t's block j.
  /// @throws gradapt::error when t or j is out of range
  block_info block(std::size_t t, std::size_t j) const {
    const auto& b = blk(t, j);
    return {tensor(t).layout.blocks[j], b.k, b.p, b.ready, b.consecutive, b.failures};
  }
  /// Statistic d of block j of tensor t (n_d × n_d, row-major).
  /// @throws gradapt::error when an index is out of range
  std::span<const compute_type> statistic(std::size_t t, std::size_t j, std::size_t d) const {
    const auto& b = blk(t, j);
    detail::require(d < b.k, "shampoo_state::statistic: factor ", d, " out of range (", b.k, ")");
    return {b.stats.data() + b.off[d], static_cast<std::size_t>(b.n[d] * b.n[d])};
  }
  /// Root d of block j of tensor t (n_d × n_d; zeros until the block is ready).
  /// @throws gradapt::error when an index is out of range
  std::span<const compute_type> root(std::size_t t, std::size_t j, std::size_t d) const {
    const auto& b = blk(t, j);
    detail::require(d < b.k, "shampoo_state::root: factor ", d, " out of range (", b.k, ")");
    return {b.roots.data() + b.off[d], static_cast<std::size_t>(b.n[d] * b.n[d])};
  }
  /// The graft's per-element state of tensor t in the tensor's element order (empty for the
  /// none and sgd grafts).
  std::span<const compute_type> graft_state(std::size_t t) const { return tensor(t).graft; }
  /// The direction D of tensor t computed by the last step (what the SGD chain received as
  /// its gradient), in the tensor's element order.
  std::span<const compute_type> direction(std::size_t t) const { return tensor(t).dir; }
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
  /// The SGD chain's state (momentum buffer, its step count).
  const tail_state_type& tail_state() const { return tail_; }

  /// Writes the state into the open section of `w` (see the class comment). Host memory.
  /// @throws gradapt::error when a statistic, root or graft state is not finite (a diverged
  ///         run; save the last good state instead)
  void save(const B& b, archive_writer& w) const {
    w.put("element_type", name(dtype_of_v<compute_type>));
    w.put("graft", std::string(to_string(graft_)));
    w.put("steps", steps_);
    w.put("roots_in_flight", pending_step_);
    w.put("tensors", static_cast<std::uint64_t>(t_.size()));
    for (std::size_t t = 0; t < t_.size(); ++t) {
      const auto& x = t_[t];
      w.begin(detail::archive_impl::join("tensor", "/", x.name));
      w.put("index", static_cast<std::uint64_t>(t));
      w.put_tensor<std::int64_t>("shape", x.shape);
      w.put_tensor<std::int64_t>("layout", layout_words(x.layout));
      for (std::size_t j = 0; j < x.blocks.size(); ++j) {
        const auto& bl = x.blocks[j];
        w.begin("block" + std::to_string(j));
        for (std::size_t d = 0; d < bl.k; ++d) {
          const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
          const std::span<const compute_type> s = statistic(t, j, d), r = root(t, j, d);
          require_finite(s, x.name, j, "statistic");
          require_finite(r, x.name, j, "root");
          w.put_tensor<compute_type>("stat" + std::to_string(d), s, sh);
          w.put_tensor<compute_type>("root" + std::to_string(d), r, sh);
          if (pending_step_ != 0) {
            const std::span<const compute_type> c(bl.snap.data() + bl.off[d], s.size());
            require_finite(c, x.name, j, "statistic copy for the roots in flight");
            w.put_tensor<compute_type>("snap" + std::to_string(d), c, sh);
          }
        }
        w.put("ready", bl.ready);
        w.put("consecutive_failures", bl.consecutive);
        w.put("failures", bl.failures);
        w.end();
      }
      w.end();
    }
    if (detail::shampoo_impl::graft_has_state(graft_))
      for (const auto& x : t_) {
        require_finite(std::span<const compute_type>(x.graft), x.name, 0, "graft state");
        w.put_tensor<compute_type>(detail::archive_impl::join("graft", "/", x.name),
                                   std::span<const compute_type>(x.graft), x.shape);
      }
    w.begin("tail");
    tail_.save(b, w);
    w.end();
  }

  /// Reads what `save(b, w)` wrote, into a state created by `shampoo::init` with the same
  /// graft and blocking options for parameters with the same names and shapes. All or
  /// nothing: every field is read and checked (names, shapes, layouts, finite matrices,
  /// failure counters below max_consecutive_failures, the chain's state) before anything
  /// changes.
  /// @throws gradapt::error naming the first field that does not match
  void load(const B& b, archive_reader& r) {
    constexpr const char* who = "shampoo state load";
    if (worker_ && pending_step_ != 0 && !relaunch_) {  // the copies it reads may be replaced
      worker_->discard();
      relaunch_ = true;  // if the load fails, the same roots start again at the next step
    }
    const auto et = r.get<std::string>("element_type");
    detail::require(et == name(dtype_of_v<compute_type>), who, ": the checkpoint holds ", et,
                    " state but this state is ", name(dtype_of_v<compute_type>));
    const auto gr = r.get<std::string>("graft");
    detail::require(gr == to_string(graft_), who, ": the checkpoint's graft is '", gr,
                    "' but this state's is '", to_string(graft_),
                    "' (restore with the same shampoo_options::graft)");
    const auto steps = r.get<std::uint64_t>("steps");
    detail::require(steps < std::numeric_limits<std::uint64_t>::max(), who, ": step count ", steps,
                    " cannot grow");
    const auto in_flight = r.get<std::uint64_t>("roots_in_flight");
    detail::require(
        in_flight == 0 || (staleness_ > 0 && in_flight <= steps && in_flight + staleness_ > steps), who,
        ": the checkpoint has roots in flight, started at step ", in_flight, " of ", steps,
        ", which this state (root_staleness ", staleness_,
        ") would not install at a later step; restore with the root_staleness it was written with");
    const auto count = r.get<std::uint64_t>("tensors");
    detail::require(count == t_.size(), who, ": the checkpoint holds ", count, " tensors but this state ",
                    t_.size(), " (restore for the same parameters)");
    // Everything is read into `next` first; the state changes only after every check passed.
    std::vector<std::vector<block_t>> next(t_.size());
    std::vector<std::vector<compute_type>> graft(t_.size());
    for (std::size_t t = 0; t < t_.size(); ++t) {
      const auto& x = t_[t];
      const std::string sec = detail::archive_impl::join("tensor", "/", x.name);
      detail::require(r.has(detail::archive_impl::join(sec, "/", "index")), who,
                      ": the checkpoint has no parameter '", x.name,
                      "' (restore for the same parameter names)");
      r.begin(sec);
      const auto index = r.get<std::uint64_t>("index");
      detail::require(index == t, who, ": parameter '", x.name, "' is tensor ", index,
                      " in the checkpoint but ", t, " here (restore for the same parameter order)");
      const auto shape = r.get_tensor<std::int64_t>("shape");
      detail::require(shape == x.shape, who, ": parameter '", x.name,
                      "' has another shape in the checkpoint (restore for the same parameter shapes)");
      const auto lay = r.get_tensor<std::int64_t>("layout");
      detail::require(
          lay == layout_words(x.layout), who, ": parameter '", x.name,
          "' is cut into other blocks in the checkpoint (max_preconditioner_dim, merge_small_dims and "
          "skip_preconditioning_dim_size_gt must be those the checkpoint was written with)");
      next[t] = x.blocks;
      for (std::size_t j = 0; j < x.blocks.size(); ++j) {
        auto& bl = next[t][j];
        r.begin("block" + std::to_string(j));
        for (std::size_t d = 0; d < bl.k; ++d) {
          const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
          const auto nn = static_cast<std::size_t>(bl.n[d] * bl.n[d]);
          const std::span<compute_type> s(bl.stats.data() + bl.off[d], nn),
              rt(bl.roots.data() + bl.off[d], nn);
          r.get_tensor<compute_type>("stat" + std::to_string(d), s, sh);
          r.get_tensor<compute_type>("root" + std::to_string(d), rt, sh);
          require_finite(std::span<const compute_type>(s), x.name, j, "statistic", who);
          require_finite(std::span<const compute_type>(rt), x.name, j, "root", who);
          if (in_flight != 0) {
            const std::span<compute_type> c(bl.snap.data() + bl.off[d], nn);
            r.get_tensor<compute_type>("snap" + std::to_string(d), c, sh);
            require_finite(std::span<const compute_type>(c), x.name, j, "statistic copy", who);
          }
        }
        bl.ready = r.get<bool>("ready");
        bl.consecutive = r.get<std::uint64_t>("consecutive_failures");
        bl.failures = r.get<std::uint64_t>("failures");
        detail::require(bl.consecutive < max_failures_ && bl.consecutive <= bl.failures, who, ": parameter '",
                        x.name, "' block ", j, " has ", bl.consecutive, " consecutive failures of ",
                        bl.failures, " (expected fewer than max_consecutive_failures = ", max_failures_,
                        " and no more than the total)");
        r.end();
      }
      r.end();
    }
    if (detail::shampoo_impl::graft_has_state(graft_))
      for (std::size_t t = 0; t < t_.size(); ++t) {
        graft[t].resize(t_[t].graft.size());
        r.get_tensor<compute_type>(detail::archive_impl::join("graft", "/", t_[t].name),
                                   std::span<compute_type>(graft[t]), t_[t].shape);
        require_finite(std::span<const compute_type>(graft[t]), t_[t].name, 0, "graft state", who);
      }
    {  // an archive with fields this state would not read is rejected before anything changes
      std::size_t want = 5 + (detail::shampoo_impl::graft_has_state(graft_) ? t_.size() : 0), own = 0;
      for (const auto& x : t_) {
        want += 3;
        for (const auto& bl : x.blocks) want += (in_flight != 0 ? 3 : 2) * bl.k + 3;
      }
      for (const auto& n : r.names())
        if (n.rfind("tail/", 0) != 0) ++own;
      detail::require(own == want, who, ": the checkpoint holds ", own,
                      " fields outside 'tail' but this state has ", want,
                      " (written for other parameters or another layout)");
    }
    r.begin("tail");
    tail_.load(b, r);  // all or nothing itself: throws before changing the chain's state
    r.end();
    for (std::size_t t = 0; t < t_.size(); ++t) {
      for (std::size_t j = 0; j < next[t].size(); ++j) {
        auto& bl = t_[t].blocks[j];
        bl.stats.swap(next[t][j].stats);
        bl.roots.swap(next[t][j].roots);
        if (in_flight != 0) bl.snap.swap(next[t][j].snap);
        bl.ready = next[t][j].ready;
        bl.consecutive = next[t][j].consecutive;
        bl.failures = next[t][j].failures;
      }
      if (detail::shampoo_impl::graft_has_state(graft_)) t_[t].graft.swap(graft[t]);
    }
    steps_ = steps;
    failed_ = false;
    pending_step_ = in_flight;
    relaunch_ = in_flight != 0;
  }

  /// The state as one archive of kind "gradapt.shampoo".
  std::vector<std::byte> save(const B& b) const { return save_archive(*this, b); }
  /// Restores a state written by `save(b)` (all or nothing).
  /// @throws gradapt::error for a damaged archive or one that does not fit this state
  void load(const B& b, std::span<const std::byte> bytes) { load_archive(*this, b, bytes); }

 private:
  friend class shampoo;
  using C = compute_type;

  struct block_t {
    std::size_t k = 0;
    int p = 0;
    std::array<std::int64_t, max_rank> n{};
    std::array<std::size_t, max_rank> off{};
    std::vector<C> stats, roots;
    std::vector<C> snap, pend;  ///< root_staleness >= 1: statistics copied for the worker, its roots
    bool ready = false;
    std::uint64_t consecutive = 0, failures = 0;
  };
  struct tensor_t {
    std::string name;
    std::vector<std::int64_t> shape;
    std::size_t size = 0;
    shampoo_layout layout;
    std::vector<block_t> blocks;
    std::vector<C> graft, dir;
  };
  using workspace_t = inverse_root_workspace<L, C>;

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
  static void require_finite(std::span<const C> v, const std::string& name, std::size_t j, const char* what,
                             const char* who = "shampoo state save") {
    for (const C x : v)
      detail::require(std::isfinite(x), who, ": a ", what, " of parameter '", name, "' (block ", j,
                      ") is not finite; a checkpoint of a diverged run cannot be resumed (save the last good "
                      "state instead)");
  }
  workspace_t& workspace(std::int64_t n) {
    for (auto& [size, ws] : ws_)
      if (size == n) return *ws;
    detail::fail("shampoo: internal error: no root workspace for size ", n);
  }

  // Declared first so that a move assignment joins the old worker before anything it reads
  // is replaced; the destructor waits for it before any member goes.
  std::unique_ptr<detail::shampoo_impl::root_worker<L, C>> worker_;
  L la_{};
  shampoo_graft graft_ = shampoo_graft::none;
  std::uint64_t max_failures_ = 1;
  std::uint64_t steps_ = 0;
  bool failed_ = false;
  std::vector<tensor_t> t_;
  std::vector<std::pair<std::int64_t, std::unique_ptr<workspace_t>>> ws_;
  std::vector<C> xb_, ab_, db_, y0_, y1_, rs_;  ///< block scratch: g, graft state, D_g, products, roots
  param_list<V, C, host_space, Options> list_;  ///< the parameters with the directions as gradients
  tail_state_type tail_;

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
  std::uint64_t computed_ = 0;   ///< root computations (blocks) this rank ran
};

/// Shampoo on the host (see the file comment and docs/algorithms/shampoo.md): block
/// preconditioners from inverse p-th roots of per-block statistics, grafted to another
/// method's step size, followed by the SGD chain (weight decay, momentum, learning rate).
///
///     const gradapt::host backend{};
///     const gradapt::host_lapack la{};                       // gradapt/linalg/host_lapack.hpp
///     gradapt::shampoo opt({.lr = 1e-3, .graft = gradapt::shampoo_graft::adam, .momentum = 0.9});
///     auto state = opt.init(backend, la, params);
///     opt.step(backend, params, state, {.lr = schedule(t)});
///
/// The preconditioner is not a chain stage: a stage's state is per-element buffers in the
/// element backend's memory and its output is computed element by element (for factored
/// stages from row and column factors), while Shampoo keeps n × n matrices per block, root
/// workspaces of a linear-algebra backend and failure counters, and its output is a product
/// of matrices. It therefore computes the grafted direction itself and hands it to
/// `gradapt::sgd`'s chain as the gradient.
class shampoo {
 public:
  /// `shampoo({})`: the default options.
  shampoo(std::initializer_list<shampoo_options> o) : shampoo(detail::options_from(o, "shampoo")) {}
  /// @throws gradapt::error on an invalid option, naming it
  explicit shampoo(const shampoo_options& o = {}) : o_(checked(o)), tail_(tail_options(o_)) {}

  /// The options.
  const shampoo_options& options() const { return o_; }

  /// Throws gradapt::error naming the first invalid option.
  static void validate(const shampoo_options& o) {
    constexpr const char* w = "shampoo";
    const auto finite = [](double v) { return std::isfinite(v); };
    detail::require(finite(o.lr) && o.lr >= 0, w, ": lr is ", o.lr, " (expected finite and >= 0)");
    detail::require(o.max_preconditioner_dim >= 1, w, ": max_preconditioner_dim is ",
                    o.max_preconditioner_dim,
                    " (expected >= 1: the largest side of a preconditioned block; 1024 is typical)");
    detail::require(o.skip_preconditioning_dim_size_gt >= 1, w, ": skip_preconditioning_dim_size_gt is ",
                    o.skip_preconditioning_dim_size_gt,
                    " (expected >= 1: tensors with a larger dimension take the graft alone)");
    detail::require(finite(o.beta2) && o.beta2 > 0 && o.beta2 <= 1, w, ": beta2 is ", o.beta2,
                    " (expected in (0, 1]: 1 sums the statistics, below 1 is an EMA)");
    detail::require(o.statistics_frequency >= 1, w, ": statistics_frequency is 0 (expected >= 1)");
    detail::require(o.precondition_frequency >= 1, w, ": precondition_frequency is 0 (expected >= 1)");
    detail::require(o.start_preconditioning_step >= 1, w,
                    ": start_preconditioning_step is 0 (expected >= 1; steps are counted from 1)");
    detail::require(o.inverse_exponent_override >= 0, w, ": inverse_exponent_override is ",
                    o.inverse_exponent_override, " (expected p >= 1 for the root S^(-1/p), or 0 for p = 2k)");
    const auto& r = o.root;
    detail::require(r.method == root_method::eigen || r.method == root_method::coupled_newton, w,
                    ": root.method is ", int(r.method), " (expected root_method::eigen or coupled_newton)");
    detail::require(r.ridge == ridge_kind::absolute || r.ridge == ridge_kind::relative, w, ": root.ridge is ",
                    int(r.ridge), " (expected ridge_kind::absolute or relative)");
    detail::require(finite(r.epsilon) && r.epsilon >= 0, w, ": root.epsilon is ", r.epsilon,
                    " (expected a finite ridge >= 0)");
    detail::require(finite(r.tolerance) && r.tolerance >= 0, w, ": root.tolerance is ", r.tolerance,
                    " (expected finite and >= 0)");
    detail::require(r.max_iterations >= 1, w, ": root.max_iterations is ", r.max_iterations,
                    " (expected >= 1)");
    detail::require(r.max_error_ratio >= 1, w, ": root.max_error_ratio is ", r.max_error_ratio,
                    " (expected >= 1)");
    detail::require(r.max_error > 0, w, ": root.max_error is ", r.max_error, " (expected > 0)");
    detail::require(r.power_iterations >= 1, w, ": root.power_iterations is ", r.power_iterations,
                    " (expected >= 1)");
    detail::require(finite(r.power_tolerance) && r.power_tolerance >= 0, w, ": root.power_tolerance is ",
                    r.power_tolerance, " (expected finite and >= 0)");
    detail::require(
        o.max_consecutive_failures >= 1, w,
        ": max_consecutive_failures is 0 (expected >= 1: failures in a row before the step throws)");
    detail::require(o.root_staleness <= o.precondition_frequency, w, ": root_staleness is ", o.root_staleness,
                    " but precondition_frequency is ", o.precondition_frequency,
                    " (expected root_staleness <= precondition_frequency: the roots started at one due "
                    "step are installed before the next one starts)");
    detail::require(o.graft <= shampoo_graft::adam, w, ": graft is ", int(o.graft),
                    " (expected none, sgd, adagrad, rmsprop or adam)");
    detail::require(finite(o.graft_beta2) && o.graft_beta2 >= 0 && o.graft_beta2 < 1, w, ": graft_beta2 is ",
                    o.graft_beta2, " (expected in [0, 1); 0.999 is typical)");
    detail::require(finite(o.graft_epsilon) && o.graft_epsilon > 0, w, ": graft_epsilon is ", o.graft_epsilon,
                    " (expected finite and > 0)");
    detail::require(finite(o.momentum) && o.momentum >= 0 && o.momentum <= 1, w, ": momentum is ", o.momentum,
                    " (expected in [0, 1]; 0 keeps no buffer)");
    detail::require(!o.nesterov || o.momentum > 0, w, ": nesterov is set but momentum is ", o.momentum,
                    " (Nesterov momentum needs momentum > 0)");
    detail::require(finite(o.weight_decay) && o.weight_decay >= 0, w, ": weight_decay is ", o.weight_decay,
                    " (expected finite and >= 0)");
  }

  /// The state for `params` on element backend `b` (host memory) and linear-algebra backend
  /// `la` (copied into the state): block layouts, zero statistics and roots, graft state,
  /// direction buffers, one root workspace per block size, scratch, and the SGD chain's state.
  /// @throws gradapt::error for a parameter whose gradient and value shapes differ (param_list
  ///         prevents it) or a block size the linear-algebra backend cannot take
  template <optimizer_backend B, linalg_backend L, element V, element G, class Options>
  requires std::same_as<typename B::space, host_space> && std::same_as<typename L::space, host_space>
  auto init(const B& b, const L& la, const param_list<V, G, host_space, Options>& params) const {
    using St = shampoo_state<L, B, V, G, Options>;
    using C = typename St::compute_type;
    St st;
    st.la_ = la;
    st.graft_ = o_.graft;
    st.max_failures_ = o_.max_consecutive_failures;
    st.list_ = param_list<V, C, host_space, Options>(params.group(0).options);
    for (std::size_t g = 1; g < params.group_count(); ++g)
      st.list_.add_group(params.group(g).name, params.group(g).options);
    std::size_t max_block = 0, max_roots = 0;
    const bool has_state = detail::shampoo_impl::graft_has_state(o_.graft);
    st.t_.resize(params.size());
    for (std::size_t t = 0; t < params.size(); ++t) {
      auto& x = st.t_[t];
      const auto& e = params[t];
      x.name = e.name;
      x.shape.assign(e.value.shape().begin(), e.value.shape().end());
      x.size = e.value.size();
      x.layout = shampoo_plan(e.value.shape(), o_);
      x.dir.assign(x.size, C(0));
      if (has_state) x.graft.assign(x.size, C(0));
      const std::size_t k = x.layout.merged.size();
      for (const auto& r : x.layout.blocks) {
        typename St::block_t bl;
        bl.k = k;
        bl.p = o_.inverse_exponent_override != 0 ? o_.inverse_exponent_override : static_cast<int>(2 * k);
        std::size_t elems = 1, mats = 0;
        for (std::size_t d = 0; d < k; ++d) {
          bl.n[d] = r.size[d];
          bl.off[d] = mats;
          mats += static_cast<std::size_t>(r.size[d] * r.size[d]);
          elems *= static_cast<std::size_t>(r.size[d]);
          add_workspace(st, la, r.size[d], o_.root.method);
        }
        bl.stats.assign(mats, C(0));
        bl.roots.assign(mats, C(0));
        max_block = std::max(max_block, elems);
        max_roots = std::max(max_roots, mats);
        x.blocks.push_back(std::move(bl));
      }
      st.list_.add(e.name, e.value, tensor_view<C, host_space>(x.dir.data(), e.value.shape()), e.flags,
                   e.group);
    }
    for (auto* v : {&st.xb_, &st.ab_, &st.db_, &st.y0_, &st.y1_}) v->assign(max_block, C(0));
    st.rs_.assign(max_roots, C(0));
    st.staleness_ = o_.root_staleness;
    st.deterministic_ = o_.deterministic_roots;
    for (std::size_t t = 0; t < st.t_.size(); ++t)
      for (std::size_t j = 0; j < st.t_[t].blocks.size(); ++j) {
        auto& bl = st.t_[t].blocks[j];
        typename St::ref_t ref{t, j, 0, bl.roots.size()};
        for (std::size_t d = 0; d < bl.k; ++d) {
          const auto n = static_cast<std::uint64_t>(bl.n[d]);
          ref.cost += n * n * n;
        }
        st.refs_.push_back(ref);
        if (o_.root_staleness > 0) {
          bl.snap.assign(bl.stats.size(), C(0));
          bl.pend.assign(bl.roots.size(), C(0));
        }
      }
    if (o_.root_staleness > 0) {
      st.tasks_.reserve(st.refs_.size());
      std::vector<std::pair<std::int64_t, typename St::workspace_t*>> ws;
      for (auto& [n, w] : st.ws_) ws.emplace_back(n, w.get());
      st.worker_ = std::make_unique<detail::shampoo_impl::root_worker<L, C>>(la, o_.root, std::move(ws));
    }
    st.tail_ = tail_.init(b, st.list_);
    return st;
  }

  /// One step: the statistics, the roots when due (computed here, or started in the worker
  /// thread and installed `root_staleness` steps later), every tensor's direction (see the
  /// file comment), then the SGD chain over them, which updates the parameters in place.
  /// @throws gradapt::error when `params` does not match the state (count, names, shapes), the
  ///         step's learning rate is not finite or negative, or a block's roots failed
  ///         `max_consecutive_failures` computations in a row (naming the parameter and the
  ///         block; the parameters and the graft state are left unchanged, the statistics have
  ///         advanced, and every later step throws until `load` restores a checkpoint)
  template <optimizer_backend B, class L, element V, element G, class Options>
  void step(const B& b, const param_list<V, G, host_space, Options>& params,
            shampoo_state<L, B, V, G, Options>& st, const step_args& args = {}) const {
    detail::shampoo_impl::no_comm none;
    step_impl(none, b, params, st, args);
  }

  /// One step with the roots distributed over the ranks of `comm`: the blocks are assigned to
  /// ranks by `lpt_assign` over their cost Σ n_d³ (deterministic: every rank derives the same
  /// plan from the layout and the world size), each rank computes its own blocks' roots, and one
  /// allgather gives every rank all of them, so each rank's root work falls as 1/N. Every rank
  /// must call it at the same steps with the same (averaged) gradients; the result is the same
  /// bits as `step(b, params, st, args)` on one rank. Checked across ranks: at the first call
  /// on a world (one small allreduce) the layout, the step count and the root options; at every
  /// exchange the step and a hash of the statistics the roots come from. A difference is a
  /// gradapt::error on every rank. With root_staleness >= 1 each rank's worker thread computes
  /// its blocks and the exchange happens at the installing step (deterministic_roots must be
  /// true). The world may change between calls (the plan follows it; roots in flight restart
  /// from their copied statistics under the new plan).
  /// @throws gradapt::error as the step above, and for a disagreement across ranks
  template <communicator Comm, optimizer_backend B, class L, element V, element G, class Options>
  requires std::same_as<typename Comm::space, host_space>
  void step(Comm& comm, const B& b, const param_list<V, G, host_space, Options>& params,
            shampoo_state<L, B, V, G, Options>& st, const step_args& args = {}) const {
    step_impl(comm, b, params, st, args);
  }

 private:
  template <class Comm, class B, class L, class V, class G, class Options>
  void step_impl(Comm& comm, const B& b, const param_list<V, G, host_space, Options>& params,
                 shampoo_state<L, B, V, G, Options>& st, const step_args& args) const {
    using C = compute_t<V>;
    constexpr bool dist = !std::is_same_v<Comm, detail::shampoo_impl::no_comm>;
    constexpr const char* who = "shampoo::step";
    detail::require(!st.failed_, who, ": the state stopped after a block's roots failed ", st.max_failures_,
                    " times in a row or the ranks' statistics differed; restore a checkpoint with load()");
    // This rank's input errors travel through the agreement of a distributed step that
    // communicates, so every rank throws instead of waiting in a collective for this one.
    std::string bad;
    bool rebind = false;
    try {
      detail::require(params.size() == st.t_.size(), who, ": the parameter list holds ", params.size(),
                      " tensors but the state was created for ", st.t_.size(),
                      " (create the state with init() for this list)");
      for (std::size_t t = 0; t < params.size(); ++t) {
        const auto& e = params[t];
        const auto& x = st.t_[t];
        detail::require(e.name == x.name && std::ranges::equal(e.value.shape(), x.shape), who, ": parameter ",
                        t, " is '", e.name, "' of shape ", e.value.shape_string(), " but the state holds '",
                        x.name, "' of another shape or name (create the state with init() for this list)");
        rebind = rebind || st.list_[t].value.data() != e.value.data();
      }
      detail::require(params.group_count() == st.list_.group_count(), who, ": the list has ",
                      params.group_count(), " groups but the state was created for ", st.list_.group_count());
      detail::require(st.staleness_ == o_.root_staleness && st.deterministic_ == o_.deterministic_roots, who,
                      ": the state was created with root_staleness ", st.staleness_,
                      " and deterministic_roots ", st.deterministic_, " but this optimizer has ",
                      o_.root_staleness, " and ", o_.deterministic_roots,
                      " (create the state with this optimizer's init())");
      if (args.lr) {
        detail::require(std::isfinite(*args.lr) && *args.lr >= 0, who, ": the step's learning rate is ",
                        *args.lr, " (expected finite and >= 0; check the schedule)");
      }
      if constexpr (dist)
        detail::require(st.staleness_ == 0 || st.deterministic_, who,
                        ": the distributed step installs roots at the same step on every rank; set "
                        "deterministic_roots = true (root_staleness is ",
                        st.staleness_, ")");
    } catch (const error& e) {
      bad = e.what();
    }
    const std::uint64_t t = st.steps_ + 1;
    const bool stats_due = (t - 1) % o_.statistics_frequency == 0;
    const bool preconditioning = t >= o_.start_preconditioning_step;
    const bool roots_due =
        preconditioning && (t - o_.start_preconditioning_step) % o_.precondition_frequency == 0;
    if constexpr (dist) {
      const bool exchanges = (roots_due && st.staleness_ == 0) ||
                             (st.pending_step_ != 0 && t == st.pending_step_ + st.staleness_) ||
                             !st.x_.planned_for(comm.size(), comm.rank());
      if (exchanges)
        agree_values(comm, "shampoo::step", {{"step", static_cast<double>(t)}}, bad);
      else if (!bad.empty())
        throw error(bad);
      plan(comm, st);
    } else if (!bad.empty()) {
      throw error(bad);
    }
    if (rebind) rebind_values(st, params);
    for (std::size_t g = 0; g < params.group_count(); ++g) st.list_.options(g) = params.group(g).options;

    if (st.relaunch_) launch(st, dist);
    if (stats_due)
      for (std::size_t i = 0; i < st.t_.size(); ++i)
        for (std::size_t j = 0; j < st.t_[i].blocks.size(); ++j)
          block_stats(st, st.t_[i], j, params[i].grad.data());
    if (st.pending_step_ != 0 &&
        (t == st.pending_step_ + st.staleness_ || (!st.deterministic_ && st.worker_->idle())))
      finish_roots(comm, st);
    if (roots_due) {
      if (st.staleness_ == 0) {
        compute_roots(comm, st, t);
      } else {
        for (const auto& r : st.refs_) {
          auto& bl = st.t_[r.t].blocks[r.j];
          std::copy(bl.stats.begin(), bl.stats.end(), bl.snap.begin());
        }
        st.pending_step_ = t;
        launch(st, dist);
      }
    }

    const double b2 = o_.graft_beta2;
    const detail::shampoo_impl::graft_kernel<C> gk{o_.graft, C(b2), C(1.0 - b2), C(o_.graft_epsilon),
                                                   C(1.0 - std::pow(b2, static_cast<double>(t)))};
    C dummy = C(0);
    for (std::size_t i = 0; i < st.t_.size(); ++i) {
      auto& x = st.t_[i];
      const G* g = params[i].grad.data();
      const bool has_state = !x.graft.empty();
      if (x.layout.diagonal) {
        for (std::size_t e = 0; e < x.size; ++e)
          x.dir[e] = gk(static_cast<C>(g[e]), has_state ? x.graft[e] : dummy);
        continue;
      }
      for (std::size_t j = 0; j < x.blocks.size(); ++j)
        block_direction(st, x, j, g, gk, has_state, preconditioning);
    }
    tail_.step(b, st.list_, st.tail_, args);
    st.steps_ = t;
  }

  template <class St, class L>
  static void add_workspace(St& st, const L& la, std::int64_t n, root_method method) {
    for (const auto& w : st.ws_)
      if (w.first == n) return;
    st.ws_.emplace_back(n, std::make_unique<typename St::workspace_t>(la, n));
    st.ws_.back().second->reserve(method);  // the first root allocates nothing either
  }

  template <class St, class PL>
  static void rebind_values(St& st, const PL& params) {
    using C = typename St::compute_type;
    std::decay_t<decltype(st.list_)> list(params.group(0).options);
    for (std::size_t g = 1; g < params.group_count(); ++g)
      list.add_group(params.group(g).name, params.group(g).options);
    for (std::size_t t = 0; t < params.size(); ++t) {
      const auto& e = params[t];
      list.add(e.name, e.value, tensor_view<C, host_space>(st.t_[t].dir.data(), e.value.shape()), e.flags,
               e.group);
    }
    st.list_ = std::move(list);
  }

  /// The distributed plan for `comm`'s world: owners by lpt_assign over the blocks' costs, each
  /// block's place in its owner's chunk; agreed across ranks once per world.
  template <class Comm, class St>
  void plan(Comm& comm, St& st) const {
    const int n = comm.size(), me = comm.rank();
    if (st.x_.planned_for(n, me)) return;
    std::uint64_t words = 0, shape_hash = 0x84222325CBF29CE4ull;
    std::vector<std::uint64_t> cost(st.refs_.size());
    std::vector<std::size_t> size(st.refs_.size());
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      const auto& r = st.refs_[i];
      const auto& bl = st.t_[r.t].blocks[r.j];
      cost[i] = r.cost;
      size[i] = 2 + r.words;  // status, failing factor, roots
      words += r.words;
      shape_hash = detail::hash_bytes(shape_hash, bl.n.data(), bl.k);
    }
    const agreed_value values[] = {
        {"preconditioned blocks", static_cast<double>(st.refs_.size())},
        {"root elements", static_cast<double>(words)},
        {"block shapes (hash)", static_cast<double>(shape_hash >> 16)},
        {"steps taken", static_cast<double>(st.steps_)},
        {"roots in flight (starting step)", static_cast<double>(st.pending_step_)},
        {"root_staleness", static_cast<double>(o_.root_staleness)},
        {"statistics_frequency", static_cast<double>(o_.statistics_frequency)},
        {"precondition_frequency", static_cast<double>(o_.precondition_frequency)},
        {"start_preconditioning_step", static_cast<double>(o_.start_preconditioning_step)},
        {"max_consecutive_failures", static_cast<double>(o_.max_consecutive_failures)},
        {"root.method", static_cast<double>(o_.root.method)},
        {"root.epsilon", o_.root.epsilon},
        {"inverse_exponent_override", static_cast<double>(o_.inverse_exponent_override)},
    };
    agree_values(comm, "shampoo::step (distributed roots)", std::span<const agreed_value>(values));
    if (st.pending_step_ != 0 && !st.relaunch_) {  // roots in flight under the old plan
      st.worker_->discard();
      st.relaunch_ = true;
    }
    st.x_.plan(cost, size, n, me);
  }

  template <class St>
  static bool owns(const St& st, std::size_t i, bool dist) {
    return !dist || st.x_.owns(i);
  }

  /// Starts the worker on this rank's blocks, from the statistics copied into `snap`.
  template <class St>
  static void launch(St& st, bool dist) {
    st.relaunch_ = false;
    st.tasks_.clear();
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      if (!owns(st, i, dist)) continue;
      auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
      st.tasks_.push_back({bl.k, bl.p, bl.n.data(), bl.off.data(), bl.snap.data(), bl.pend.data()});
    }
    st.pending_hash_ = dist ? stats_hash(st, true) : 0;
    st.computed_ += st.tasks_.size();
    st.worker_->start(std::span(st.tasks_));
  }

  /// Waits for the roots in flight and installs them (through the exchange when distributed).
  template <class Comm, class St>
  static void finish_roots(Comm& comm, St& st) {
    constexpr bool dist = !std::is_same_v<Comm, detail::shampoo_impl::no_comm>;
    const std::uint64_t from = st.pending_step_;
    st.pending_step_ = 0;
    st.worker_->wait();
    std::size_t k = 0;
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      if (!owns(st, i, dist)) continue;
      const auto& task = st.tasks_[k++];
      const auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
      if constexpr (dist) {
        auto* w = st.x_.out(i);
        w[0] = static_cast<typename St::compute_type>(static_cast<int>(task.status));
        w[1] = static_cast<typename St::compute_type>(task.factor);
        std::copy(bl.pend.begin(), bl.pend.end(), w + 2);
      } else {
        install(st, i, task.status, task.factor, bl.pend.data(), -1);
      }
    }
    if constexpr (dist) exchange(comm, st, from, st.pending_hash_);
  }

  /// Computes the due roots inside the step (root_staleness 0).
  template <class Comm, class St>
  void compute_roots(Comm& comm, St& st, std::uint64_t t) const {
    constexpr bool dist = !std::is_same_v<Comm, detail::shampoo_impl::no_comm>;
    const auto ws = [&](std::int64_t n) -> typename St::workspace_t& { return st.workspace(n); };
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      if (!owns(st, i, dist)) continue;
      const auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
      ++st.computed_;
      if constexpr (dist) {
        auto* w = st.x_.out(i);
        const auto [status, factor] = detail::shampoo_impl::block_roots(
            st.la_, bl.k, bl.p, bl.n.data(), bl.off.data(), bl.stats.data(), w + 2, ws, o_.root);
        w[0] = static_cast<typename St::compute_type>(static_cast<int>(status));
        w[1] = static_cast<typename St::compute_type>(factor);
      } else {
        const auto [status, factor] = detail::shampoo_impl::block_roots(
            st.la_, bl.k, bl.p, bl.n.data(), bl.off.data(), bl.stats.data(), st.rs_.data(), ws, o_.root);
        install(st, i, status, factor, st.rs_.data(), -1);
      }
    }
    if constexpr (dist) exchange(comm, st, t, stats_hash(st, false));
  }

  /// The hash of every block's statistics (or of their copies for the worker).
  template <class St>
  static std::uint64_t stats_hash(const St& st, bool snapshot) {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (const auto& r : st.refs_) {
      const auto& bl = st.t_[r.t].blocks[r.j];
      const auto& v = snapshot ? bl.snap : bl.stats;
      h = detail::hash_bytes(h, v.data(), v.size());
    }
    return h;
  }

  /// Allgathers every rank's chunk (header, then per owned block its status, failing factor and
  /// roots), checks the headers agree, and installs every block from its owner's chunk.
  template <class Comm, class St>
  static void exchange(Comm& comm, St& st, std::uint64_t step, std::uint64_t hash) {
    const int differs = st.x_.run(comm, step, hash, "shampoo::step");
    if (differs >= 0) {
      st.failed_ = true;
      detail::fail("shampoo::step on rank ", st.x_.rank, ": the statistics of rank ", differs,
                   " differ from rank 0's at step ", step,
                   " (every rank must pass the same averaged gradients); restore a checkpoint with load()");
    }
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      const auto* c = st.x_.in(i);
      const auto code = static_cast<int>(c[0]);
      detail::require(code >= 0 && code <= static_cast<int>(root_status::nonfinite_result),
                      "shampoo::step: internal error: root status ", code, " from rank ", st.x_.owner[i]);
      install(st, i, static_cast<root_status>(code), static_cast<std::size_t>(c[1]), c + 2, st.x_.owner[i]);
    }
  }

  /// Installs block i's roots (or counts its failure; throws after max_consecutive_failures in a
  /// row). `rank` names the rank that computed them (-1: this one, not distributed).
  template <class St, class C>
  static void install(St& st, std::size_t i, root_status status, std::size_t factor, const C* roots,
                      int rank) {
    const auto& ref = st.refs_[i];
    auto& x = st.t_[ref.t];
    auto& bl = x.blocks[ref.j];
    if (status == root_status::ok) {
      std::copy(roots, roots + bl.roots.size(), bl.roots.begin());
      bl.ready = true;
      bl.consecutive = 0;
      return;
    }
    ++bl.failures;
    if (++bl.consecutive < st.max_failures_) return;
    st.failed_ = true;
    const auto& range = x.layout.blocks[ref.j];
    std::string where;
    for (std::size_t d = 0; d < bl.k; ++d)
      where += (d ? ", " : "") + std::to_string(range.offset[d]) + ".." +
               std::to_string(range.offset[d] + range.size[d]);
    detail::fail("shampoo::step: parameter '", x.name, "' block ", ref.j, " (indices [", where,
                 "] of its merged shape): the inverse root failed ", bl.consecutive,
                 " times in a row (last: factor ", factor, ", ", to_string(status),
                 rank >= 0 ? ", computed on rank " + std::to_string(rank) : "",
                 "); a non-finite gradient makes the statistics non-finite for good. The parameters are "
                 "unchanged; restore a checkpoint with load() (and skip non-finite gradients, e.g. with the "
                 "loss scaler), or raise root.epsilon / max_consecutive_failures");
  }

  /// Block j of tensor x: the gradient's statistics.
  template <class St, class Tensor, class G>
  void block_stats(St& st, Tensor& x, std::size_t j, const G* g) const {
    using C = typename St::compute_type;
    if (x.layout.diagonal) return;
    auto& bl = x.blocks[j];
    C* xb = st.xb_.data();
    detail::shampoo_impl::for_runs(x.layout.merged, x.layout.blocks[j],
                                   [&](std::size_t flat, std::size_t at, std::size_t run) {
                                     for (std::size_t e = 0; e < run; ++e)
                                       xb[at + e] = static_cast<C>(g[flat + e]);
                                   });
    const auto& la = st.la_;
    using cview = tensor_view<const C, host_space>;
    using mview = tensor_view<C, host_space>;
    const double beta = o_.beta2, w = o_.beta2 == 1.0 ? 1.0 : 1.0 - o_.beta2;
    for (std::size_t d = 0; d < bl.k; ++d) {
      const std::int64_t n = bl.n[d];
      const auto [a, c] = split(bl, d);
      const mview s(bl.stats.data() + bl.off[d], {n, n});
      if (a == 1) {
        la.syrk(gram::rows, w, cview(xb, {n, c}), beta, s);
      } else if (c == 1) {
        la.syrk(gram::columns, w, cview(xb, {a, n}), beta, s);
      } else {
        for (std::int64_t q = 0; q < a; ++q)
          la.syrk(gram::rows, w, cview(xb + q * n * c, {n, c}), q == 0 ? beta : 1.0, s);
      }
    }
  }

  /// Mode d of a block as a × n × c (a: the dimensions before d, c: after).
  template <class Block>
  static std::pair<std::int64_t, std::int64_t> split(const Block& bl, std::size_t d) {
    std::int64_t a = 1, c = 1;
    for (std::size_t e = 0; e < d; ++e) a *= bl.n[e];
    for (std::size_t e = d + 1; e < bl.k; ++e) c *= bl.n[e];
    return {a, c};
  }

  /// Block j of tensor x: gather, graft, direction (preconditioned when the block has roots),
  /// scatter.
  template <class St, class Tensor, class G, class GK>
  void block_direction(St& st, Tensor& x, std::size_t j, const G* g, const GK& gk, bool has_state,
                       bool preconditioning) const {
    using C = typename St::compute_type;
    namespace si = detail::shampoo_impl;
    auto& bl = x.blocks[j];
    const auto& range = x.layout.blocks[j];
    std::size_t elems = 1;
    for (std::size_t d = 0; d < bl.k; ++d) elems *= static_cast<std::size_t>(bl.n[d]);
    C* xb = st.xb_.data();
    C* ab = st.ab_.data();
    C* db = st.db_.data();
    si::for_runs(x.layout.merged, range, [&](std::size_t flat, std::size_t at, std::size_t run) {
      for (std::size_t e = 0; e < run; ++e) xb[at + e] = static_cast<C>(g[flat + e]);
      if (has_state) std::copy(x.graft.data() + flat, x.graft.data() + flat + run, ab + at);
    });
    C dummy = C(0);
    for (std::size_t e = 0; e < elems; ++e) db[e] = gk(xb[e], has_state ? ab[e] : dummy);
    const C* out = db;
    if (preconditioning && bl.ready) {
      C* y = product(st, bl, xb);
      if (o_.graft != shampoo_graft::none) {  // ‖D_s‖ and ‖D_g‖ in double, in element order
        double ns = 0, ng = 0;
        for (std::size_t e = 0; e < elems; ++e) {
          ns += double(y[e]) * double(y[e]);
          ng += double(db[e]) * double(db[e]);
        }
        const C scale = ns > 0 ? C(std::sqrt(ng) / std::sqrt(ns)) : C(0);
        for (std::size_t e = 0; e < elems; ++e) y[e] = y[e] * scale;
      }
      out = y;
    }
    si::for_runs(x.layout.merged, range, [&](std::size_t flat, std::size_t at, std::size_t run) {
      std::copy(out + at, out + at + run, x.dir.data() + flat);
      if (has_state) std::copy(ab + at, ab + at + run, x.graft.data() + flat);
    });
  }

  /// X ×₁ P_1 ×₂ … ×ₖ P_k into one of the product buffers; returns it.
  template <class St, class Block, class C>
  static C* product(St& st, const Block& bl, const C* xb) {
    using cview = tensor_view<const C, host_space>;
    using mview = tensor_view<C, host_space>;
    const auto& la = st.la_;
    const C* cur = xb;
    C* dst = nullptr;
    for (std::size_t d = 0; d < bl.k; ++d) {
      dst = d % 2 == 0 ? st.y0_.data() : st.y1_.data();
      const std::int64_t n = bl.n[d];
      const auto [a, c] = split(bl, d);
      const cview p(bl.roots.data() + bl.off[d], {n, n});
      if (c == 1) {  // last dimension: Y = X·Pᵀ (P is symmetric up to rounding)
        la.gemm(transpose::none, transpose::yes, 1.0, cview(cur, {a, n}), p, 0.0, mview(dst, {a, n}));
      } else {
        for (std::int64_t q = 0; q < a; ++q)
          la.gemm(transpose::none, transpose::none, 1.0, p, cview(cur + q * n * c, {n, c}), 0.0,
                  mview(dst + q * n * c, {n, c}));
      }
      cur = dst;
    }
    return dst;
  }

  static shampoo_options checked(const shampoo_options& o) {
    validate(o);
    return o;
  }
  static sgd_options tail_options(const shampoo_options& o) {
    return {.lr = o.lr,
            .momentum = o.momentum,
            .nesterov = o.nesterov,
            .weight_decay = o.weight_decay,
            .skip_weight_decay = o.skip_weight_decay};
  }

  shampoo_options o_;
  sgd tail_;
};

}  // namespace gradapt

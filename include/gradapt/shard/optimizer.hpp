#pragma once
/// @file
/// `gradapt::shard::sharded_optimizer`: any `gradapt::chain` optimizer (SGD, AdamW, LAMB, LARS,
/// Adafactor, SM3, a user's chain) with its state sharded over the ranks of a communicator
/// (ZeRO stage 1, Rajbhandari et al. 2020), giving the same bits as the unsharded optimizer.
///
/// Every rank holds the full parameters and its own local gradients (the framework's buffers);
/// a `partition_plan` gives each rank a shard of the elements. One step:
///
///  1. the gradients are reduce-scattered into this rank's gradient shard and divided by the
///     world size (the data-parallel mean, in rounds of at most `bucket_elements` shard
///     positions, so the packing buffer does not grow with the model);
///  2. the chain steps this rank's shard only: its state covers the shard (S bytes per state
///     element per shard element instead of per parameter);
///  3. the updated shards are allgathered into every rank's parameters (in rounds as in 1).
///
/// Stage 2: when the framework calls `mark_ready(t)` as each gradient is produced, the
/// gradients are reduce-scattered bucket by bucket (a `bucket::bucket_plan` over the gradients,
/// buckets in plan order) during the backward pass, so a gradient's buffer is free for reuse
/// as soon as its bucket has been reduced (`released(t)`); `step` then skips point 1.
///
/// Sums over a tensor that straddles ranks (LAMB's and LARS's trust ratios) and sums over all
/// tensors (a global-norm clip) are assembled across ranks exactly: the chain measures a
/// straddling tensor's sums per 4096-element reduction block (the host backend's blocking),
/// one allreduce in which each block's partial has a single contributing rank collects them,
/// and every rank adds them in block order as the unsharded reduction does. So the sharded step
/// equals the unsharded optimizer bit for bit on the same averaged gradients, for any rank
/// count. This needs every cut inside a tensor at a multiple of 4096 elements from the
/// tensor's start (`partition_options{.alignment = 4096k, .align_tensors = true}`, the
/// default here) or whole tensors (`granularity::tensor`). A chain whose first stage factors
/// tensors (Adafactor, SM3) keeps row and column statistics per tensor and needs every tensor
/// whole on one rank (`granularity::tensor`).
///
/// With `M` (the master element type) wider than the parameters' `V` (float master values for
/// half or bfloat16 parameters), the shard keeps its values in M, the chain steps them, and
/// the allgather carries them rounded to V.
///
/// Backends: the host backend with host communicators (threads, single, MPI), and any
/// optimizer backend whose memory space matches its communicator's (the CUDA backend with
/// NCCL): the packing copies, the mean and the master rounding are the backend's element-wise
/// `apply` over (offset, length) views, and the agreements travel through a backend buffer. On
/// a device backend a chain with per-tensor sums (LAMB, LARS) needs whole tensors
/// (`granularity::tensor`) and a chain with a global sum (a global-norm clip) is rejected on
/// more than one rank: the exact cross-shard assembly runs on the host backend only. The
/// backend and the communicator must share one CUDA stream (`cuda{.stream = comm.stream()}`):
/// the packing kernels and the collectives are ordered by it alone. The device path compiles
/// in the CUDA tests and has not run on a GPU.
/// Checkpoints: `save` writes this rank's shard (its pieces, keyed by parameter name and
/// element range, with the plan); `load` restores a state on any world size from the archives
/// of any other, reading only the old archives that overlap this rank's new shard.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/bucket/plan.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/shard/detail/checkpoint_read.hpp"
#include "gradapt/shard/detail/packing.hpp"
#include "gradapt/shard/partition.hpp"
#include "gradapt/shard/state.hpp"

namespace gradapt::shard {

/// Elements of one host reduction block: a tensor's sums are the block partials added in
/// block order, so a tensor cut at multiples of this can be reduced across ranks exactly.
inline constexpr std::size_t reduction_block = gradapt::detail::host_impl::block;

/// Options of a sharded optimizer.
struct sharded_options {
  /// How the elements are cut into shards (default: element granularity, cuts at multiples of
  /// 4096 elements from every tensor's start, so any chain's sums can be assembled exactly).
  partition_options partition{
      .mode = granularity::element, .alignment = reduction_block, .align_tensors = true};
  /// Shard positions per reduce-scatter and allgather round (default 2^20): the packing
  /// buffers hold world × this many elements at most.
  std::size_t bucket_elements = std::size_t{1} << 20;
  /// Steps between the agreed checks that every rank's state shard is finite (default 100,
  /// and after the first step; 0 turns the check off).
  std::uint64_t check_interval = 100;
  /// Stage 2 (`mark_ready`): the gradient buckets reduce-scattered during the backward pass
  /// (DDP's rule: reverse registration order, a smaller first bucket).
  bucket::bucket_options buckets{};
  /// Stage 2 over a communicator with a non-blocking reduce-scatter (`comm::mpi`): each
  /// bucket's reduce-scatter is started by `mark_ready` without waiting (each bucket in its own
  /// buffers: about one more gradient's worth of memory) and completed by `step` (or `reduce`),
  /// so the backward pass goes on while the buckets travel; every `mark_ready` also lets MPI
  /// progress. Default false: each bucket is reduce-scattered, blocking, inside `mark_ready`.
  bool overlap = false;
};

/// A chain optimizer whose state is sharded over the ranks (see the file comment).
///
///     gradapt::shard::sharded_optimizer opt{gradapt::lamb({.lr = 1e-3})};
///     auto state = opt.init(comm, backend, params);   // collective
///     opt.step(comm, backend, params, state);         // reads local grads, updates params
template <class Chain>
class sharded_optimizer {
  /// A chain whose first stage is a preconditioner stage sharded by block (scale_by_shampoo).
  static constexpr bool by_blocks = Chain::plan::has_preconditioner;
  static_assert(
      !by_blocks || Chain::plan::max_terms == 0,
      "gradapt::shard::sharded_optimizer: a chain with a preconditioner stage (scale_by_shampoo) is sharded "
      "by block, and its later stages may not take per-tensor or global sums (trust ratio, "
      "clip_by_global_norm) over tensors cut between ranks: clip the gradients before the step, or use "
      "the replicated state slot");

 public:
  /// The chain and the sharding options.
  /// @throws gradapt::error when bucket_elements is 0 or the partition options are invalid
  explicit sharded_optimizer(Chain opt, const sharded_options& o = {}) : opt_(std::move(opt)), o_(o) {
    gradapt::detail::require(o_.bucket_elements > 0,
                             "shard::sharded_optimizer: sharded_options::bucket_elements is 0 (expected a "
                             "positive number of shard positions per round)");
    (void)partition_plan::make(std::span<const std::size_t>(), 1, o_.partition);  // checks the options
    gradapt::detail::require(by_blocks || o_.partition.mode != granularity::unit,
                             "shard::sharded_optimizer: partition_options::mode is unit, which cuts at the "
                             "blocks of a preconditioner stage (scale_by_shampoo); this chain has none: use "
                             "element or tensor granularity");
  }

  /// The chain (its options may change between steps, as for the unsharded chain).
  Chain& chain() { return opt_; }
  /// The chain, read-only.
  const Chain& chain() const { return opt_; }
  /// The options.
  const sharded_options& options() const { return o_; }

  /// Creates this rank's state for `params` (full values on every rank). Collective: every
  /// rank agrees on the tensor sizes, the partition options, the chain's options and the
  /// element types; a rank with another layout or options throws on every rank.
  /// @tparam M master element type (default V; float for half or bfloat16 parameters keeps
  ///         float master values of the shard)
  /// @tparam S state element type (default the compute type)
  /// @throws gradapt::error on every rank when the ranks disagree or a rank's input is
  ///         invalid (a factored chain with a tensor cut across ranks, a cut inside a tensor at
  ///         a position that is not a multiple of 4096 for a chain with barrier stages)
  template <class M = void, class S = void, class Comm, class B, element V, element G, class Options>
  requires communicator<Comm> && optimizer_backend<B> && std::same_as<typename Comm::space, typename B::space>
  auto init(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params) const {
    using Mt = std::conditional_t<std::is_void_v<M>, V, M>;
    using St = std::conditional_t<std::is_void_v<S>, compute_t<V>, S>;
    static_assert(std::is_same_v<compute_t<Mt>, compute_t<V>>,
                  "shard::sharded_optimizer: the master type must share the parameters' compute type");
    sharded_state<Chain, B, V, G, Mt, St, Options> s;
    std::vector<std::size_t> sizes(params.size());
    for (std::size_t t = 0; t < params.size(); ++t) sizes[t] = params[t].value.size();
    std::string bad;
    const int n = comm.size();
    try {
      if constexpr (by_blocks) {
        // Sharded by block: element (the default) and unit granularity cut at rows of blocks.
        partition_options po = o_.partition;
        std::vector<std::size_t> grains;
        if (po.mode != granularity::tensor) {
          po.mode = granularity::unit;
          for (std::size_t t = 0; t < params.size(); ++t)
            grains.push_back(opt_.template stage<0>().shard_grain(params[t].value.shape()));
        }
        s.plan_ = partition_plan::make(sizes, n, po, grains);
      } else {
        s.plan_ = partition_plan::make(sizes, n, o_.partition);
      }
    } catch (const error& e) {
      bad = e.what();
    }
    s.rank_ = comm.rank();
    s.check_interval_ = o_.check_interval;
    if (bad.empty()) bad = describe_cut_problem<B>(s.plan_, params);
    std::uint64_t h = 1469598103ULL;
    for (const std::size_t x : sizes) h = (h * 1099511ULL + x) % (std::uint64_t{1} << 50);
    agreed_list<64> v;
    v.push("tensors", static_cast<double>(sizes.size()));
    v.push("tensor sizes (fingerprint)", static_cast<double>(h));
    v.push("partition_options::mode", static_cast<double>(o_.partition.mode));
    v.push("partition_options::alignment", static_cast<double>(o_.partition.alignment));
    v.push("partition_options::align_tensors", o_.partition.align_tensors ? 1.0 : 0.0);
    v.push("sharded_options::bucket_elements", static_cast<double>(o_.bucket_elements));
    v.push("sharded_options::check_interval", static_cast<double>(o_.check_interval));
    v.push("bucket_options::cap_bytes", static_cast<double>(o_.buckets.cap_bytes));
    v.push("bucket_options::first_cap_bytes", static_cast<double>(o_.buckets.first_cap_bytes));
    v.push("sharded_options::overlap", o_.overlap ? 1.0 : 0.0);
    if (o_.overlap && !nonblocking_reduce_scatter_communicator<Comm> && bad.empty())
      bad =
          "shard::sharded_optimizer: sharded_options::overlap needs a communicator with a non-blocking "
          "reduce-scatter (ireduce_scatter: comm::mpi); this one has none (set overlap = false)";
    v.push("parameter element type", static_cast<double>(dtype_of_v<V>));
    v.push("gradient element type", static_cast<double>(dtype_of_v<G>));
    v.push("master element type", static_cast<double>(dtype_of_v<Mt>));
    if constexpr (requires { opt_.agreed_options(v); }) opt_.agreed_options(v);
    agree_values(comm, b, "shard::sharded_optimizer::init", v.view(), bad);

    for (std::size_t t = 0; t < params.size(); ++t) {
      s.names_.push_back(params[t].name);
      const auto sh = params[t].value.shape();
      s.shapes_.emplace_back(sh.begin(), sh.end());
    }
    build_units(s);
    const std::size_t cap = s.plan_.shard_capacity();
    s.grad_ = b.template allocate<G>(cap);
    if constexpr (!std::is_same_v<Mt, V>) {
      s.master_ = b.template allocate<Mt>(cap);
      for (const piece& q : s.plan_.pieces(s.rank_))
        b.apply(gradapt::detail::shard_k::copy_to{},
                vec<space_of<B>, Mt>(s.master_.data() + q.shard_offset, q.length),
                vec<space_of<B>, const V>(params[q.tensor].value.data() + q.offset, q.length));
    }
    s.bucket_ = std::max<std::size_t>(1, std::min(o_.bucket_elements, cap));
    plan_buckets(b, s);
    s.send_g_ = b.template allocate<G>(s.bucket_ * static_cast<std::size_t>(n));
    s.send_v_ = b.template allocate<V>(s.bucket_);
    s.recv_v_ = b.template allocate<V>(s.bucket_ * static_cast<std::size_t>(n));
    bind(s, params);
    if constexpr (by_blocks) {
      std::vector<preconditioner_slice> slices;
      for (const shard_unit& u : s.units_) slices.push_back({s.shapes_[u.tensor], u.offset});
      s.st_ = opt_.template init<St>(b, s.list_, slices);
    } else {
      s.st_ = opt_.template init<St>(b, s.list_);
    }
    s.st_.set_check_interval(0);  // the sharded step runs an agreed check instead
    return s;
  }

  /// The first part of `step`, for a caller that needs the averaged gradient shard before the
  /// update (its norm: `gradient_sum_squares`): reduce-scatters and averages the gradients of
  /// `params` into this rank's gradient shard (with stage 2, finishes the round that
  /// `mark_ready` reduced). The next `step` then skips its reduction. Collective.
  /// @throws gradapt::error as `step`; when called twice before a step
  template <class Comm, class B, element V, element G, class M, class S, class Options>
  requires communicator<Comm> && optimizer_backend<B> && std::same_as<typename Comm::space, typename B::space>
  void reduce(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params,
              sharded_state<Chain, B, V, G, M, S, Options>& s) const {
    using Sp = space_of<B>;
    check_fit(comm, params, s, "reduce");
    gradapt::detail::require(!s.reduced_, "shard::sharded_optimizer::reduce on rank ", s.rank_,
                             ": the gradients of this step are already reduced (call step() next)");
    const auto n = static_cast<std::size_t>(comm.size());
    const std::size_t cap = s.plan_.shard_capacity();
    // 1. Reduce-scatter in rounds of shard positions [p0, p0 + len), unless mark_ready
    //    reduced every bucket during the backward pass.
    const bool staged = s.marked_ != 0;
    if (staged) {
      for (std::size_t t = 0; t < s.ready_.size(); ++t)
        gradapt::detail::require(
            s.ready_[t] != 0, "shard::sharded_optimizer::step on rank ", s.rank_, ": gradient ", t, " ('",
            params[t].name,
            "') was not marked ready in this round (after mark_ready, every gradient must "
            "be marked before the step)");
      finish_pending(b, s);
      start_round(s);
    }
    for (std::size_t p0 = 0; p0 < cap && !staged; p0 += s.bucket_) {
      const std::size_t len = std::min(s.bucket_, cap - p0);
      for (std::size_t r = 0; r < n; ++r) {
        G* dst = s.send_g_.data() + r * len;
        b.apply(gradapt::detail::shard_k::set_zero{},
                vec<Sp, G>(dst, len));  // alignment gaps and the last shard's tail
        gradapt::detail::shard_k::for_overlaps(
            s.plan_.pieces(static_cast<int>(r)), p0, len, [&](const piece& q, std::size_t a, std::size_t k) {
              b.apply(gradapt::detail::shard_k::copy_to{}, vec<Sp, G>(dst + (a - p0), k),
                      vec<Sp, const G>(params[q.tensor].grad.data() + q.offset + (a - q.shard_offset), k));
            });
      }
      comm.reduce_scatter(vec<Sp, const G>(s.send_g_.data(), n * len), vec<Sp, G>(s.grad_.data() + p0, len),
                          reduce_op::sum);
    }
    if (n > 1)
      b.apply(gradapt::detail::divide_by_ranks{static_cast<int>(n)}, vec<Sp, G>(s.grad_.data(), cap));
    s.reduced_ = true;
  }

  /// Σ g² over this rank's averaged gradient shard (after `reduce`), in double: the ranks'
  /// values add up to |ḡ|², the squared norm of the averaged gradient (summed in another order
  /// than one pass over the whole gradient, so equal to it to rounding). Any memory space (on
  /// CUDA each piece's reduction waits for the stream).
  template <class B, class V, class G, class M, class S, class Options>
  double gradient_sum_squares(const B& b, const sharded_state<Chain, B, V, G, M, S, Options>& s) const {
    gradapt::detail::require(s.reduced_, "shard::sharded_optimizer::gradient_sum_squares on rank ", s.rank_,
                             ": the gradients of this step are not reduced yet (call reduce() first)");
    double sum = 0.0;
    for (const piece& q : s.plan_.pieces(s.rank_))
      sum += b.reduce(reduction::sum_squares,
                      tensor_view<const G, typename B::space>::vector(s.grad_.data() + q.shard_offset,
                                                                      static_cast<std::int64_t>(q.length)));
    return sum;
  }

  /// One step: reduce-scatter and average the gradients of `params` (unless `reduce` did),
  /// step this rank's shard, allgather the parameters. Collective.
  /// @throws gradapt::error when `params` does not match the state or the communicator is not
  ///         the one the state was made for; on every rank when a rank's state shard holds a
  ///         non-finite value at a check (naming the ranks)
  ///
  /// A chain whose first stage is a preconditioner stage (Shampoo, SOAP, Muon) is sharded by
  /// block: each rank holds, computes and steps the blocks of its own rows of blocks (roots and
  /// eigenbases computed by their owner, no exchange), and one small allreduce per step
  /// agrees the step count and whether every rank's stage succeeded (a block whose roots failed
  /// max_consecutive_failures times throws on every rank). It returns the stage's report over
  /// this rank's blocks (`tensor` is the parameter's index, `tensor_block` the block's index
  /// within the whole parameter).
  template <class Comm, class B, element V, element G, class M, class S, class Options>
  requires communicator<Comm> && optimizer_backend<B> && std::same_as<typename Comm::space, typename B::space>
  typename Chain::step_result step(Comm& comm, const B& b,
                                   const param_list<V, G, typename B::space, Options>& params,
                                   sharded_state<Chain, B, V, G, M, S, Options>& s,
                                   const step_args& args = {}) const {
    using Sp = space_of<B>;
    if (!s.reduced_) reduce(comm, b, params, s);
    s.reduced_ = false;
    check_fit(comm, params, s, "step");
    const auto n = static_cast<std::size_t>(comm.size());
    const std::size_t cap = s.plan_.shard_capacity();
    rebind_if_moved(s, params);
    for (std::size_t g = 0; g < params.group_count(); ++g) s.list_.options(g) = params.group(g).options;

    // 2. The chain over this rank's units.
    [[maybe_unused]] std::conditional_t<by_blocks, typename Chain::step_result, int> report{};
    if constexpr (by_blocks) {
      std::string bad;
      try {
        report = opt_.step(b, s.list_, s.st_, args);
      } catch (const std::exception& e) {
        bad = e.what();
      }
      const agreed_value at[] = {{"step", static_cast<double>(s.st_.steps())}};
      agree_values(comm, b, "shard::sharded_optimizer::step", at, bad);
      if constexpr (requires { report.root_failures; })
        for (auto& f : report.root_failures) f.tensor = s.units_.at(f.tensor).tensor;
    } else if constexpr (Chain::plan::max_terms > 0 && !Chain::plan::has_factored &&
                         std::same_as<typename B::space, host_space>) {
      gradapt::detail::shard_k::assembly<Comm, S> a{&comm,     &s.units_,   &s.split_, &s.xbase_,
                                                    &s.xsums_, &s.logical_, &s.rows_};
      opt_.step(b, s.list_, s.st_, args, a);
    } else {
      if constexpr (!std::same_as<typename B::space, host_space>)
        gradapt::detail::require(n == 1 || !opt_.global_barrier_active(), global_sum_problem(), " (rank ",
                                 s.rank_, ")");
      opt_.step(b, s.list_, s.st_, args);
    }

    // 3. Allgather the shards' values into every rank's parameters.
    const bool master = !std::is_same_v<M, V>;
    for (std::size_t p0 = 0; p0 < cap; p0 += s.bucket_) {
      const std::size_t len = std::min(s.bucket_, cap - p0);
      gradapt::detail::shard_k::for_overlaps(
          s.plan_.pieces(s.rank_), p0, len, [&](const piece& q, std::size_t a, std::size_t k) {
            V* dst = s.send_v_.data() + (a - p0);
            if constexpr (!std::is_same_v<M, V>)
              b.apply(gradapt::detail::shard_k::copy_to{}, vec<Sp, V>(dst, k),
                      vec<Sp, const M>(s.master_.data() + a, k));
            else
              b.apply(gradapt::detail::shard_k::copy_to{}, vec<Sp, V>(dst, k),
                      vec<Sp, const V>(params[q.tensor].value.data() + q.offset + (a - q.shard_offset), k));
          });
      comm.allgather(vec<Sp, const V>(s.send_v_.data(), len), vec<Sp, V>(s.recv_v_.data(), n * len));
      for (std::size_t r = 0; r < n; ++r) {
        if (static_cast<int>(r) == s.rank_ && !master) continue;  // updated in place
        const V* src = s.recv_v_.data() + r * len;
        gradapt::detail::shard_k::for_overlaps(
            s.plan_.pieces(static_cast<int>(r)), p0, len, [&](const piece& q, std::size_t a, std::size_t k) {
              b.apply(gradapt::detail::shard_k::copy_to{},
                      vec<Sp, V>(params[q.tensor].value.data() + q.offset + (a - q.shard_offset), k),
                      vec<Sp, const V>(src + (a - p0), k));
            });
      }
    }

    // 4. The agreed finiteness check.
    const std::uint64_t k = s.st_.steps();
    if (s.check_interval_ != 0 && (k == 1 || k % s.check_interval_ == 0)) check_finite(comm, b, s, "step");
    if constexpr (by_blocks) return report;
  }

  /// Stage 2: marks gradient t of `params` ready (the framework calls it as the backward pass
  /// produces each gradient) and reduce-scatters every bucket that is complete and next in
  /// plan order into this rank's gradient shard. Ranks may mark in different orders: buckets
  /// are reduced in plan order on every rank. Once every gradient is marked, `step` uses the
  /// reduced shard. Collective per bucket.
  /// @throws gradapt::error when t is out of range or already marked in this round, or
  ///         `params` does not match the state
  template <class Comm, class B, element V, element G, class M, class S, class Options>
  requires communicator<Comm> && optimizer_backend<B> && std::same_as<typename Comm::space, typename B::space>
  void mark_ready(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params,
                  sharded_state<Chain, B, V, G, M, S, Options>& s, std::size_t t) const {
    check_fit(comm, params, s, "mark_ready");
    gradapt::detail::require(t < s.ready_.size(), "shard::sharded_optimizer::mark_ready on rank ", s.rank_,
                             ": gradient ", t, " is out of range (", s.ready_.size(), " gradients)");
    gradapt::detail::require(s.ready_[t] == 0, "shard::sharded_optimizer::mark_ready on rank ", s.rank_,
                             ": gradient ", t, " ('", params[t].name,
                             "') is already marked ready in this round (call step() to end the round)");
    s.ready_[t] = 1;
    ++s.marked_;
    --s.missing_[s.bplan_.where(t).bucket];
    while (s.next_ < s.missing_.size() && s.missing_[s.next_] == 0)
      reduce_bucket(comm, b, params, s, s.next_++);
    if constexpr (requires { comm.progress(); })
      if (o_.overlap && !s.pending_.empty()) comm.progress();  // MPI moves them inside its calls
  }

  /// Stage 2: ends this round without a step (a step skipped on every rank, after a loss
  /// scaler's overflow): the marks are cleared and the next `mark_ready` starts a new round;
  /// the gradient shard already reduced is not used. Not collective; every rank calls it.
  template <class B, class V, class G, class M, class S, class Options>
  void discard_round(sharded_state<Chain, B, V, G, M, S, Options>& s) const {
    for (auto& p : s.pending_) p->wait();  // started on every rank: completed, not used
    s.pending_.clear();
    start_round(s);
    s.reduced_ = false;
  }
  /// Stage 2: gradients marked ready in this round so far.
  template <class B, class V, class G, class M, class S, class Options>
  std::size_t marked(const sharded_state<Chain, B, V, G, M, S, Options>& s) const {
    return s.marked_;
  }

  /// Restores a state saved on any world size (`sharded_state::save` on each old rank) into
  /// this rank's shard for `params` on this communicator. `archive(r)` returns the bytes old
  /// rank r saved, which must stay valid until the next call (a mapped file will do: nothing
  /// is copied but one piece's field at a time). Old rank 0's archive is read for the plan,
  /// then only the old archives whose pieces overlap this rank's new shard. Collective: the
  /// ranks agree that every one of them restored the same step count.
  /// @throws gradapt::error (on every rank) when an archive is damaged, was saved for other
  ///         parameters (names, sizes), another optimizer layout or element type, or the ranks
  ///         restored different step counts
  template <class M = void, class S = void, class Comm, class B, element V, element G, class Options>
  requires communicator<Comm> && optimizer_backend<B> && std::same_as<typename Comm::space, typename B::space>
  auto load(Comm& comm, const B& b, const param_list<V, G, typename B::space, Options>& params,
            const std::function<std::span<const std::byte>(int old_rank)>& archive) const {
    auto s = init<M, S>(comm, b, params);
    using St = typename decltype(s)::chain_state_type;
    using Se = typename St::state_element;
    using Mt = typename decltype(s)::master_type;
    std::string bad;
    std::uint64_t steps = 0;
    try {
      archive_reader r0(archive(0), sharded_state<Chain, B, V, G, Mt, Se, Options>::archive_kind,
                        sharded_state<Chain, B, V, G, Mt, Se, Options>::archive_version);
      r0.begin("plan");
      // The archived sizes are checked against the parameters before the plan is cut.
      const partition_plan old = partition_plan::load(r0, [&](std::span<const std::size_t> sizes) {
        gradapt::detail::require(sizes.size() == params.size(),
                                 "sharded optimizer load: the checkpoint holds ", sizes.size(),
                                 " tensors but the parameter list holds ", params.size());
        for (std::size_t t = 0; t < params.size(); ++t)
          gradapt::detail::require(sizes[t] == params[t].value.size(), "sharded optimizer load: tensor ", t,
                                   " ('", params[t].name, "') has ", sizes[t],
                                   " elements in the checkpoint but ", params[t].value.size(), " here");
      });
      r0.end();
      const auto steps0 = r0.get<std::uint64_t>("steps");
      bool have = false;
      for (int r = 0; r < old.world(); ++r) {
        if (!gradapt::detail::shard_k::overlaps_any(old.pieces(r), s.plan_.pieces(s.rank_))) continue;
        gradapt::detail::shard_k::checkpoint_reader::read_rank(b, s, old, r, archive(r), params, have, steps);
      }
      if (!have) steps = steps0;
    } catch (const std::exception& e) {  // also what the archive callback throws
      bad = e.what();
    }
    const agreed_value restored[] = {{"restored step count", static_cast<double>(steps)}};
    agree_values(comm, b, "shard::sharded_optimizer::load", restored, bad);
    s.st_.set_steps(steps);
    if constexpr (!std::is_same_v<Mt, V>) {  // the model's parameters from the restored master values
      for (const piece& q : s.plan_.pieces(s.rank_))
        b.apply(gradapt::detail::shard_k::copy_to{},
                vec<space_of<B>, V>(params[q.tensor].value.data() + q.offset, q.length),
                vec<space_of<B>, const Mt>(s.master_.data() + q.shard_offset, q.length));
    }
    return s;
  }

 private:
  template <class B>
  using space_of = typename B::space;

  /// A one-dimensional view of n elements at p in space Sp.
  template <class Sp, class T>
  static tensor_view<T, Sp> vec(T* p, std::size_t n) {
    return gradapt::detail::shard_k::vec<Sp, T>(p, n);
  }

  /// Stage 2's bucket plan over the gradients and each bucket's per-rank segments, and the
  /// packing buffers of the longest bucket.
  template <class B, class St>
  void plan_buckets(const B& b, St& s) const {
    using Gt = typename St::gradient_type;
    const partition_plan& p = s.plan_;
    std::vector<bucket::tensor_info> infos(p.tensors());
    for (std::size_t t = 0; t < infos.size(); ++t) infos[t] = {p.tensor_size(t), dtype_of_v<Gt>};
    s.bplan_ = bucket::bucket_plan::make(infos, o_.buckets);
    const auto nb = s.bplan_.buckets().size();
    s.segments_.assign(nb, std::vector<std::vector<piece>>(static_cast<std::size_t>(p.world())));
    for (int r = 0; r < p.world(); ++r)
      for (const piece& q : p.pieces(r))
        s.segments_[s.bplan_.where(q.tensor).bucket][static_cast<std::size_t>(r)].push_back(q);
    // Within a bucket, a rank's segments follow the bucket's packing order of tensors.
    for (std::size_t k = 0; k < nb; ++k) {
      const auto& order = s.bplan_.buckets()[k].tensors;
      for (auto& seg : s.segments_[k])
        std::stable_sort(seg.begin(), seg.end(), [&](const piece& x, const piece& y) {
          return std::find(order.begin(), order.end(), x.tensor) <
                 std::find(order.begin(), order.end(), y.tensor);
        });
    }
    s.ready_.assign(p.tensors(), 0);
    std::size_t longest = 0;
    for (std::size_t k = 0; k < nb; ++k) longest = std::max(longest, bucket_length(s, k));
    if (nb != 0) {
      s.bsend_ = b.template allocate<Gt>(longest * static_cast<std::size_t>(p.world()));
      s.brecv_ = b.template allocate<Gt>(longest);
    }
    if (o_.overlap) {  // each bucket its own regions, so that every bucket can be in flight at once
      s.osoff_.assign(nb + 1, 0);
      s.oroff_.assign(nb + 1, 0);
      for (std::size_t k = 0; k < nb; ++k) {
        const std::size_t len = bucket_length(s, k);
        s.osoff_[k + 1] = s.osoff_[k] + len * static_cast<std::size_t>(p.world());
        s.oroff_[k + 1] = s.oroff_[k] + len;
      }
      s.osend_ = b.template allocate<Gt>(s.osoff_[nb]);
      s.orecv_ = b.template allocate<Gt>(s.oroff_[nb]);
      s.pending_.reserve(nb);
    }
    start_round(s);
  }

  /// Elements of rank block of bucket k: the longest rank's segments.
  template <class St>
  static std::size_t bucket_length(const St& s, std::size_t k) {
    std::size_t len = 0;
    for (const auto& seg : s.segments_[k]) {
      std::size_t m = 0;
      for (const piece& q : seg) m += q.length;
      len = std::max(len, m);
    }
    return len;
  }

  template <class St>
  static void start_round(St& s) {
    std::fill(s.ready_.begin(), s.ready_.end(), char{0});
    s.missing_.assign(s.bplan_.buckets().size(), 0);
    for (std::size_t t = 0; t < s.ready_.size(); ++t) ++s.missing_[s.bplan_.where(t).bucket];
    s.next_ = 0;
    s.marked_ = 0;
  }

  /// Reduce-scatters bucket k: rank r's block holds its segments of the bucket (padded to the
  /// longest rank's), and this rank's reduced block goes to its shard positions.
  template <class Comm, class B, class PL, class St>
  void reduce_bucket(Comm& comm, const B& b, const PL& params, St& s, std::size_t k) const {
    using Gt = typename St::gradient_type;
    using Sp = space_of<B>;
    const auto n = static_cast<std::size_t>(comm.size());
    const std::size_t len = bucket_length(s, k);
    Gt* send = o_.overlap ? s.osend_.data() + s.osoff_[k] : s.bsend_.data();
    for (std::size_t r = 0; r < n; ++r) {
      Gt* dst = send + r * len;
      std::size_t at = 0;
      for (const piece& q : s.segments_[k][r]) {
        b.apply(gradapt::detail::shard_k::copy_to{}, vec<Sp, Gt>(dst + at, q.length),
                vec<Sp, const Gt>(params[q.tensor].grad.data() + q.offset, q.length));
        at += q.length;
      }
      if (at < len) b.apply(gradapt::detail::shard_k::set_zero{}, vec<Sp, Gt>(dst + at, len - at));
    }
    if constexpr (nonblocking_reduce_scatter_communicator<Comm>) {
      if (o_.overlap) {  // completed (and unpacked) by finish_pending
        Gt* recv = s.orecv_.data() + s.oroff_[k];
        auto r =
            comm.ireduce_scatter(vec<Sp, const Gt>(send, n * len), vec<Sp, Gt>(recv, len), reduce_op::sum);
        s.pending_.push_back(
            std::make_unique<gradapt::detail::shard_k::pending_request<decltype(r)>>(std::move(r), k));
        return;
      }
    }
    comm.reduce_scatter(vec<Sp, const Gt>(send, n * len), vec<Sp, Gt>(s.brecv_.data(), len), reduce_op::sum);
    unpack_bucket(b, s, k, s.brecv_.data());
  }

  /// Copies this rank's reduced block of bucket k (at `recv`) to its shard positions.
  template <class B, class St, class Gt>
  static void unpack_bucket(const B& b, St& s, std::size_t k, const Gt* recv) {
    using Sp = space_of<B>;
    std::size_t at = 0;
    for (const piece& q : s.segments_[k][static_cast<std::size_t>(s.rank_)]) {
      b.apply(gradapt::detail::shard_k::copy_to{}, vec<Sp, Gt>(s.grad_.data() + q.shard_offset, q.length),
              vec<Sp, const Gt>(recv + at, q.length));
      at += q.length;
    }
  }

  /// Completes the buckets' reduce-scatters in flight, in the order they started, and unpacks
  /// each into the shard.
  template <class B, class St>
  static void finish_pending(const B& b, St& s) {
    try {
      for (auto& p : s.pending_) {
        p->wait();
        unpack_bucket(b, s, p->bucket, s.orecv_.data() + s.oroff_[p->bucket]);
      }
    } catch (...) {
      s.pending_.clear();  // the others complete as their requests are destroyed
      throw;
    }
    s.pending_.clear();
  }

  /// Empty when the plan suits the chain on backend B; else what is wrong, naming the tensor.
  template <class B, class PL>
  std::string describe_cut_problem(const partition_plan& p, const PL& params) const {
    constexpr bool on_host = std::same_as<typename B::space, host_space>;
    if constexpr (!on_host)
      if (p.world() > 1 && opt_.global_barrier_active()) return global_sum_problem();
    for (int r = 0; r < p.world(); ++r)
      for (const piece& q : p.pieces(r)) {
        const std::size_t n = p.tensor_size(q.tensor);
        if (q.length == n) continue;
        if constexpr (Chain::plan::has_factored)
          return gradapt::detail::message(
              "shard::sharded_optimizer: parameter '", params[q.tensor].name, "' (tensor ", q.tensor,
              ") is cut across ranks (rank ", r, " holds elements [", q.offset, ", ", q.offset + q.length,
              ") of ", n,
              "), but the chain's first stage factors each tensor's rows and columns: shard it "
              "with partition_options{.mode = granularity::tensor}");
        if constexpr (Chain::plan::max_terms > 0 && !on_host)
          return gradapt::detail::message(
              "shard::sharded_optimizer: parameter '", params[q.tensor].name, "' (tensor ", q.tensor,
              ") is cut across ranks, and the chain has per-tensor sums (trust ratio), which are "
              "assembled across shards on the host backend only: on this backend shard with "
              "partition_options{.mode = granularity::tensor}");
        if constexpr (Chain::plan::max_terms > 0) {
          const bool ok = q.offset % reduction_block == 0 &&
                          ((q.offset + q.length) % reduction_block == 0 || q.offset + q.length == n);
          if (!ok)
            return gradapt::detail::message(
                "shard::sharded_optimizer: parameter '", params[q.tensor].name, "' (tensor ", q.tensor,
                ") is cut at element ", q.offset % reduction_block != 0 ? q.offset : q.offset + q.length,
                ", not a multiple of ", reduction_block,
                ", and the chain has per-tensor or global sums (trust ratio, clipping): use "
                "partition_options{.alignment = a multiple of ",
                reduction_block, ", .align_tensors = true} or granularity::tensor");
        }
      }
    return {};
  }

  static std::string global_sum_problem() {
    return "shard::sharded_optimizer: the chain's global sum (clip_by_global_norm, switched on) is "
           "assembled across shards on the host backend only: on this backend clip the gradients "
           "before the step (gradapt::clip_by_global_norm over the parameter list) and switch the "
           "chain's clipping off";
  }

  /// The shard's units and the exchange rows (one per straddling tensor's reduction block,
  /// one per whole tensor).
  template <class St>
  void build_units(St& s) const {
    const partition_plan& p = s.plan_;
    const std::size_t T = p.tensors();
    s.split_.assign(T, 0);
    for (int r = 0; r < p.world(); ++r)
      for (const piece& q : p.pieces(r))
        if (q.length != p.tensor_size(q.tensor)) s.split_[q.tensor] = 1;
    s.xbase_.assign(T + 1, 0);
    for (std::size_t t = 0; t < T; ++t) {
      const std::size_t n = p.tensor_size(t);
      const std::size_t rows = s.split_[t] ? n / reduction_block + (n % reduction_block != 0 ? 1 : 0) : 1;
      s.xbase_[t + 1] = s.xbase_[t] + rows;
    }
    constexpr bool by_block = Chain::plan::max_terms > 0 && !Chain::plan::has_factored;
    for (const piece& q : p.pieces(s.rank_)) {
      if (!s.split_[q.tensor] || !by_block) {
        s.units_.push_back({q.tensor, q.offset, q.length, q.shard_offset,
                            s.xbase_[q.tensor] + (s.split_[q.tensor] ? q.offset / reduction_block : 0)});
        continue;
      }
      for (std::size_t o = q.offset; o < q.offset + q.length; o += reduction_block) {
        const std::size_t k = std::min(reduction_block, q.offset + q.length - o);
        s.units_.push_back(
            {q.tensor, o, k, q.shard_offset + (o - q.offset), s.xbase_[q.tensor] + o / reduction_block});
      }
    }
  }

  /// (Re)builds the shard's parameter list over the units: values in the parameters (or in
  /// the master shard), gradients in the gradient shard; whole tensors keep their shape.
  template <class St, class PL>
  void bind(St& s, const PL& params) const {
    using Mt = typename St::master_type;
    using Gt = typename St::gradient_type;
    using Sp = typename St::space;
    using Opts = typename PL::options_type;
    param_list<Mt, Gt, Sp, Opts> list(params.group(0).options);
    for (std::size_t g = 1; g < params.group_count(); ++g)
      list.add_group(params.group(g).name, params.group(g).options);
    for (const shard_unit& u : s.units_) {
      const auto& e = params[u.tensor];
      const bool whole = u.length == e.value.size();
      Mt* vp;
      if constexpr (std::is_same_v<Mt, typename PL::value_type>)
        vp = e.value.data() + u.offset;
      else
        vp = s.master_.data() + u.position;
      Gt* gp = s.grad_.data() + u.position;
      const auto n = static_cast<std::int64_t>(u.length);
      tensor_view<Mt, Sp> val =
          whole ? tensor_view<Mt, Sp>(vp, e.value.shape()) : tensor_view<Mt, Sp>::vector(vp, n);
      tensor_view<Gt, Sp> grd =
          whole ? tensor_view<Gt, Sp>(gp, e.value.shape()) : tensor_view<Gt, Sp>::vector(gp, n);
      std::string nm = e.name;
      if (!whole)
        nm.append("[")
            .append(std::to_string(u.offset))
            .append(":")
            .append(std::to_string(u.offset + u.length))
            .append(")");
      list.add(std::move(nm), val, grd, e.flags, e.group);
    }
    s.list_ = std::move(list);
    s.bound_.resize(params.size());
    for (std::size_t t = 0; t < params.size(); ++t) s.bound_[t] = params[t].value.data();
  }

  template <class St, class PL>
  void rebind_if_moved(St& s, const PL& params) const {
    for (std::size_t t = 0; t < params.size(); ++t)
      if (s.bound_[t] != static_cast<const void*>(params[t].value.data())) {
        bind(s, params);
        return;
      }
  }

  template <class Comm, class PL, class St>
  void check_fit(Comm& comm, const PL& params, const St& s, const char* fn) const {
    gradapt::detail::require(comm.size() == s.plan_.world() && comm.rank() == s.rank_,
                             "shard::sharded_optimizer::", fn, ": the communicator is rank ", comm.rank(),
                             " of ", comm.size(), " but the state was made for rank ", s.rank_, " of ",
                             s.plan_.world(), " (after a resize, save and load the state on the new world)");
    gradapt::detail::require(params.size() == s.plan_.tensors(), "shard::sharded_optimizer::", fn,
                             ": the parameter list holds ", params.size(),
                             " tensors but the state was made for ", s.plan_.tensors());
    for (std::size_t t = 0; t < params.size(); ++t)
      gradapt::detail::require(params[t].value.size() == s.plan_.tensor_size(t),
                               "shard::sharded_optimizer::", fn, ": parameter '", params[t].name,
                               "' (tensor ", t, ") has ", params[t].value.size(),
                               " elements but the state was made for ", s.plan_.tensor_size(t));
    gradapt::detail::require(params.group_count() == s.list_.group_count(), "shard::sharded_optimizer::", fn,
                             ": the parameter list has ", params.group_count(),
                             " groups but the state was made for ", s.list_.group_count());
  }

  /// Every rank counts the non-finite values of its state shard; one allreduce tells every rank
  /// which ranks have any, and every rank throws naming them.
  template <class Comm, class B, class St>
  void check_finite(Comm& comm, const B& b, St& s, const char* fn) const {
    using Cs = typename St::chain_state_type;
    using Sp = typename St::space;
    double bad = 0.0;
    for (std::size_t j = 0; j < Cs::buffer_count(); ++j)
      for (const auto& v : s.st_.buffer(j))
        bad += b.reduce(reduction::count_nonfinite, tensor_view<const typename Cs::state_element, Sp>(v));
    if (s.master_.size() != 0)
      bad += b.reduce(reduction::count_nonfinite,
                      vec<Sp, const typename St::master_type>(s.master_.data(), s.master_.size()));
    std::vector<double> per(static_cast<std::size_t>(comm.size()), 0.0);
    per[static_cast<std::size_t>(comm.rank())] = bad;
    gradapt::detail::allreduce_host_values(comm, b, std::span<double>(per), reduce_op::sum);
    std::string ranks;
    for (std::size_t r = 0; r < per.size(); ++r)
      if (per[r] != 0.0) ranks.append(ranks.empty() ? "" : ", ").append(std::to_string(r));
    gradapt::detail::require(ranks.empty(), "shard::sharded_optimizer::", fn, " on rank ", comm.rank(),
                             ": the state shard of rank(s) ", ranks, " holds non-finite values after step ",
                             s.st_.steps(),
                             "; the parameters have been updated and the state cannot recover: restore a "
                             "checkpoint with load(), and clip or rescale the gradients");
  }

  Chain opt_;
  sharded_options o_;
};

}  // namespace gradapt::shard

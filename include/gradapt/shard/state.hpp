#pragma once
/// @file
/// `gradapt::shard::sharded_state`: the state of a `gradapt::shard::sharded_optimizer` on one
/// rank (the partition plan, the gradient shard, the chain state of the shard, the master
/// values and the packing buffers), `shard_unit` (one list entry of the shard's chain), and
/// `sharded_state::save`, which writes this rank's shard as an archive.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradapt/bucket/plan.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/shard/partition.hpp"

namespace gradapt::detail::shard_k {
struct checkpoint_reader;

/// A bucket's reduce-scatter in flight (stage 2 with `sharded_options::overlap`), its request
/// type erased (the state is not templated on the communicator).
struct pending {
  std::size_t bucket = 0;  ///< the bucket it reduces
  virtual ~pending() = default;
  virtual void wait() = 0;  ///< completes it (throws what the request's wait throws)
};
/// `pending` over a communicator's request R.
template <class R>
struct pending_request final : pending {
  R r;
  pending_request(R x, std::size_t k) : r(std::move(x)) { bucket = k; }
  void wait() override { r.wait(); }
};

}  // namespace gradapt::detail::shard_k

namespace gradapt::shard {

template <class Chain>
class sharded_optimizer;

/// One contiguous range of a tensor that the shard's chain sees as one list entry.
struct shard_unit {
  std::size_t tensor = 0;    ///< logical tensor
  std::size_t offset = 0;    ///< first element within the tensor
  std::size_t length = 0;    ///< elements
  std::size_t position = 0;  ///< position in this rank's shard buffer
  std::size_t exchange = 0;  ///< row of the sums exchanged across ranks
};

/// The state of a `sharded_optimizer` on one rank: the plan, this rank's gradient shard,
/// the chain state of its shard (and master values), and the packing buffers.
/// Created by `sharded_optimizer::init` or `load`, advanced by `step`. Move-only.
template <class Chain, class B, class V, class G, class M, class S, class Options>
class sharded_state {
 public:
  /// The chain state of this rank's shard.
  using chain_state_type = typename Chain::template state_type<B, M, G, S>;
  using backend_type = B;           ///< the backend the state's buffers belong to
  using space = typename B::space;  ///< the memory space of the buffers and views
  using value_type = V;             ///< the parameters' element type
  using gradient_type = G;          ///< the gradients' element type
  using master_type = M;            ///< the shard's value type (V, or wider master values)
  /// The chain's first stage is a preconditioner stage, sharded by block.
  static constexpr bool has_preconditioner = chain_state_type::plan::has_preconditioner;

  /// Move-only: the shard's list and chain state point into the state's own buffers.
  sharded_state(sharded_state&&) noexcept = default;
  /// Move assignment (the views stay valid: the buffers do not move).
  sharded_state& operator=(sharded_state&&) noexcept = default;
  sharded_state(const sharded_state&) = delete;
  sharded_state& operator=(const sharded_state&) = delete;

  /// The partition plan.
  const partition_plan& plan() const { return plan_; }
  /// This state's rank.
  int rank() const { return rank_; }
  /// Steps taken.
  std::uint64_t steps() const { return st_.steps(); }
  /// The chain state of this rank's shard (its buffers cover the shard only).
  const chain_state_type& shard_state() const { return st_; }
  /// The list entries the shard's chain steps: whole tensors, or ranges of a tensor that
  /// straddles ranks (one per reduction block when the chain has barrier stages).
  std::span<const shard_unit> units() const { return units_; }
  /// Bytes of optimizer state on this rank: the chain's state buffers over the shard (and a
  /// preconditioner stage's blocks), plus the master values (when M is not V).
  std::size_t state_bytes() const { return st_.state_elements() * sizeof(S) + master_.size() * sizeof(M); }
  /// Bytes of this rank's gradient shard (the averaged gradients the chain reads).
  std::size_t gradient_bytes() const { return grad_.size() * sizeof(G); }
  /// Bytes of the packing buffers of the reduce-scatter and allgather rounds (and of stage
  /// 2's buckets) and the sums exchanged for straddling tensors.
  std::size_t workspace_bytes() const {
    return (send_g_.size() + bsend_.size() + brecv_.size() + osend_.size() + orecv_.size()) * sizeof(G) +
           send_v_.size() * sizeof(V) + recv_v_.size() * sizeof(V) +
           (xsums_.size() + logical_.size() + rows_.size()) * sizeof(double);
  }
  /// The gradient buckets of stage 2 (`mark_ready`).
  const bucket::bucket_plan& buckets() const { return bplan_; }
  /// True when gradient t's bucket has been reduce-scattered in this round: its buffer is
  /// not read again before the next `mark_ready(t)` and may be reused.
  bool released(std::size_t t) const {
    gradapt::detail::require(t < ready_.size(), "sharded optimizer released: gradient ", t,
                             " is out of range (", ready_.size(), " gradients)");
    return bplan_.where(t).bucket < next_;
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.sharded_optimizer";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// This rank's shard as an archive: the plan, the rank, the chain's element type, stage
  /// layout and step count, and per piece of the plan its parameter name, tensor index, element
  /// range and the state of every active buffer (and the master values) over that range.
  /// Holds the archive (reserved at its final size) and one piece's buffer besides: the
  /// shard plus at most one tensor's worth of state.
  /// @throws gradapt::error when a state value is not finite
  std::vector<std::byte> save(const B& b) const {
    archive_writer w(archive_kind, archive_version);
    w.begin("plan");
    plan_.save(w);
    w.end();
    w.put("rank", static_cast<std::uint64_t>(rank_));
    w.put("element_type", name(dtype_of_v<S>));
    w.put("master_type", name(dtype_of_v<M>));
    w.put("stages", static_cast<std::uint64_t>(chain_state_type::plan::n));
    w.put("buffers", static_cast<std::uint64_t>(chain_state_type::buffer_count()));
    w.put("active_stages", st_.active_stages());
    w.put("steps", st_.steps());
    if constexpr (has_preconditioner) {  // sharded by block: the fields every slice shares
      w.begin("preconditioner");
      st_.preconditioner().save_header(w);
      w.end();
    }
    const auto mine = plan_.pieces(rank_);
    w.put("pieces", static_cast<std::uint64_t>(mine.size()));
    // The archive's size is known up front: reserving it keeps one copy of the shard.
    std::size_t bytes = w.size() + 4;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const std::size_t fields = 4 + 2 * chain_state_type::buffer_count() + 1;  // with name slack
      bytes += fields * (64 + names_[mine[i].tensor].size()) + 2 * names_[mine[i].tensor].size();
      for (std::size_t j = 0; j < chain_state_type::buffer_count(); ++j)
        if (!st_.buffer(j).empty()) bytes += mine[i].length * sizeof(S);
      if (master_.size() != 0) bytes += mine[i].length * sizeof(M);
    }
    if constexpr (has_preconditioner)  // its blocks' matrices, with room for their field names
      bytes += st_.preconditioner().state_elements() * sizeof(compute_t<S>) + mine.size() * 4096;
    w.reserve(bytes);
    std::vector<S> host;
    std::vector<M> mhost;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const piece& q = mine[i];
      w.begin(gradapt::detail::archive_impl::join("piece", "/", std::to_string(i)));
      w.put("name", names_[q.tensor]);
      w.put("tensor", static_cast<std::uint64_t>(q.tensor));
      w.put("offset", static_cast<std::uint64_t>(q.offset));
      w.put("length", static_cast<std::uint64_t>(q.length));
      for (std::size_t j = 0; j < chain_state_type::buffer_count(); ++j) {
        const auto bufs = st_.buffer(j);
        if (bufs.empty()) continue;
        // Element-wise buffers cover the piece unit by unit; a factored tensor's statistics
        // (row and column sums, SM3's covers) belong to its one whole-tensor unit and are
        // written whole, whatever their length.
        host.clear();
        std::size_t at = 0, units = 0;
        bool factored = false;
        for_units_of(q, [&](std::size_t u) {
          const auto& v = bufs[u];
          factored = factored || v.size() != units_[u].length;
          host.resize(host.size() + v.size());
          b.copy(tensor_view<const S, space>(v), host_view(std::span<S>(host).subspan(at, v.size())));
          at += v.size();
          ++units;
        });
        gradapt::detail::require(
            factored ? units == 1 && q.offset == 0 && q.length == plan_.tensor_size(q.tensor)
                     : at == q.length,
            "sharded optimizer save on rank ", rank_, ": buffer ", j, " of '", names_[q.tensor], "' spans ",
            at, " values over ", units, " units for its ", q.length, " shard elements",
            factored ? " (a factored tensor's statistics need the whole tensor on one rank)" : "");
        for (const S& x : host)
          gradapt::detail::require(std::isfinite(static_cast<double>(static_cast<compute_t<S>>(x))),
                                   "sharded optimizer save on rank ", rank_, ": buffer ", j, " of '",
                                   names_[q.tensor], "' holds a non-finite value (save the last good state)");
        w.put_tensor<S>(gradapt::detail::archive_impl::join("buffer", "", std::to_string(j)), host);
      }
      if constexpr (has_preconditioner) {
        w.begin("preconditioner");
        for_units_of(q, [&](std::size_t u) { st_.preconditioner().save_slice(b, w, u); });
        w.end();
      }
      if (master_.size() != 0) {
        mhost.resize(q.length);
        b.copy(tensor_view<const M, space>::vector(master_.data() + q.shard_offset,
                                                   static_cast<std::int64_t>(q.length)),
               host_view(std::span<M>(mhost)));
        w.put_tensor<M>("master", mhost);
      }
      w.end();
    }
    return std::move(w).finish();
  }

 private:
  template <class>
  friend class sharded_optimizer;
  friend struct gradapt::detail::shard_k::checkpoint_reader;
  sharded_state() = default;

  /// Calls f(u) for each unit of piece q, in element order.
  template <class F>
  void for_units_of(const piece& q, F&& f) const {
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].tensor == q.tensor && units_[u].offset >= q.offset &&
          units_[u].offset < q.offset + q.length)
        f(u);
  }

  partition_plan plan_ = partition_plan::make(std::span<const std::size_t>(), 1);
  int rank_ = 0;
  std::uint64_t check_interval_ = 100;
  std::size_t bucket_ = 0;
  std::vector<std::string> names_;
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<shard_unit> units_;
  std::vector<char> split_;                      ///< tensor t straddles ranks
  std::vector<std::size_t> xbase_;               ///< first exchange row of tensor t (T + 1 entries)
  gradapt::detail::optim::buffer_t<B, G> grad_;  ///< this rank's averaged gradient shard (capacity elements)
  gradapt::detail::optim::buffer_t<B, M> master_;  ///< master values of the shard (when M is not V)
  std::vector<const void*> bound_;  ///< the parameters' value pointers the unit list points into
  gradapt::detail::optim::buffer_t<B, G> send_g_;  ///< reduce-scatter packing (world × round)
  gradapt::detail::optim::buffer_t<B, V> send_v_;  ///< allgather packing (round)
  gradapt::detail::optim::buffer_t<B, V> recv_v_;  ///< allgather packing (world × round)
  std::vector<double> xsums_, logical_, rows_;
  // Stage 2: the bucket plan, this round's ready marks, the buckets still missing gradients,
  // the next bucket to reduce, and each bucket's per-rank segments (rank-major).
  bucket::bucket_plan bplan_ = bucket::bucket_plan::make(std::span<const bucket::tensor_info>());
  std::vector<char> ready_;
  std::vector<std::size_t> missing_;
  std::size_t next_ = 0, marked_ = 0;
  bool reduced_ = false;                                   ///< `reduce` ran for this step
  std::vector<std::vector<std::vector<piece>>> segments_;  ///< [bucket][rank]: pieces in the bucket
  gradapt::detail::optim::buffer_t<B, G> bsend_, brecv_;   ///< stage 2 packing (world × bucket, bucket)
  // Stage 2 with overlap: every bucket's own send (world × its length) and receive regions, at
  // these offsets, and the reduce-scatters in flight (declared after the buffers they use, so
  // destroyed first: a request's destructor completes it).
  gradapt::detail::optim::buffer_t<B, G> osend_, orecv_;
  std::vector<std::size_t> osoff_, oroff_;
  std::vector<std::unique_ptr<gradapt::detail::shard_k::pending>> pending_;
  param_list<M, G, typename B::space, Options> list_;
  chain_state_type st_;
};

}  // namespace gradapt::shard

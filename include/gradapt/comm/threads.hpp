#pragma once
/// @file
/// `comm::threads`: N ranks as threads of one process, sharing memory. The default world for
/// tests and demos. Reductions combine ranks in rank order 0, 1, ..., N-1, so results are
/// bitwise reproducible. Every collective checks that all ranks called the same operation
/// with consistent sizes and element types; on a mismatch every rank throws the same
/// gradapt::error (naming both sizes), so no rank is left waiting.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/detail/arguments.hpp"
#include "gradapt/comm/detail/fingerprint.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::comm {

/// Thrown by a comm::threads operation when another rank of the world has failed: the world
/// was aborted, so the operation can never complete. The message names the failed rank and
/// its error.
class peer_failure : public gradapt::error {
 public:
  using gradapt::error::error;
};

/// Options of an in-process world (comm::threads::create, run_threads).
struct threads_options {
  /// Watchdog: the longest a rank waits in a collective (or an exchange) for the other ranks.
  /// When it expires, the waiting rank throws a gradapt::error naming the operation and the
  /// ranks that did not arrive, and the world is aborted so every other waiting rank throws
  /// comm::peer_failure with the same message: a rank that returned, threw or called another
  /// operation ends the run with an error instead of a hang. Default 5 minutes; must be > 0.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

namespace detail {

using gradapt::detail::without_prefix;

/// Shared state of one in-process world. Internal: use comm::threads.
class threads_world {
 public:
  /// One rank's arguments of the collective in flight: the fingerprint every rank must agree
  /// on, and the buffers (and, for split, the color and key) the others read.
  struct post {
    call c;
    const void* send = nullptr;
    void* recv = nullptr;
    int color = 0;
    int key = 0;
    bool valid = true;  ///< false when this rank's own arguments are invalid
  };
  struct channel {
    const void* data = nullptr;
    std::size_t count = 0;
    dtype type = dtype::float32;
    bool posted = false;
    bool consumed = false;
    bool valid = true;
  };

  threads_world(int n, threads_options options)
      : n_(n),
        opts_(options),
        here_(static_cast<std::size_t>(n)),
        posts_(static_cast<std::size_t>(n)),
        chans_(static_cast<std::size_t>(n) * n),
        norms_(2 * static_cast<std::size_t>(n)),
        split_worlds_(static_cast<std::size_t>(n)) {}

  int size() const { return n_; }
  const threads_options& options() const { return opts_; }

  /// Waits until all ranks arrive; throws if a rank failed. After threads_options::timeout
  /// without every rank, throws a gradapt::error naming `op` and the ranks that did not
  /// arrive, and aborts the world so that the ranks waiting with this one throw too.
  void barrier(int rank, std::string_view op) {
    std::unique_lock lk(m_);
    throw_if_aborted();
    const std::uint64_t gen = generation_;
    here_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == n_) {
      arrived_ = 0;
      std::fill(here_.begin(), here_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!wait(lk, [&] { return generation_ != gen || aborted_; })) {
      std::string missing;
      for (int k = 0; k < n_; ++k)
        if (!here_[static_cast<std::size_t>(k)])
          missing.append(missing.empty() ? "" : ", ").append(std::to_string(k));
      timed_out(lk, rank,
                gradapt::detail::message("comm::threads ", op, " on rank ", rank, ": rank(s) ", missing,
                                         " did not arrive within ", seconds(),
                                         " s (threads_options::timeout): a "
                                         "rank returned, threw or called another operation"));
    }
    if (generation_ == gen) throw_if_aborted();
  }

  /// Marks the world failed (a rank threw); wakes every waiting rank.
  void abort(int rank, const std::string& what) {
    std::lock_guard lk(m_);
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ =
          std::string("rank ").append(std::to_string(rank)).append(" failed: ").append(without_prefix(what));
    }
    cv_.notify_all();
  }

  void set_post(int rank, const post& p) {
    std::lock_guard lk(m_);
    throw_if_aborted();
    posts_[static_cast<std::size_t>(rank)] = p;
  }
  const post& posted(int rank) const { return posts_[static_cast<std::size_t>(rank)]; }
  /// Two doubles per rank, for allreduce_with_norms' partial sums (sized once: a rank may
  /// still read them after the collective's last barrier, until it posts the next one).
  double* norms() { return norms_.data(); }

  std::shared_ptr<threads_world>& split_slot(int rank) {
    return split_worlds_[static_cast<std::size_t>(rank)];
  }

  /// Pairwise exchange of `count` elements through the (rank -> peer) and (peer -> rank)
  /// mailboxes. `bad` is this rank's complete error message for invalid arguments (empty
  /// otherwise): it is posted too, so both sides throw instead of one waiting forever.
  void exchange(int rank, int peer, const void* send, std::size_t count, void* recv, dtype type,
                const arguments& args, const std::string& bad) {
    channel& out = chan(rank, peer);
    channel& in = chan(peer, rank);
    std::unique_lock lk(m_);
    throw_if_aborted();
    out = {send, count, type, true, false, bad.empty()};
    cv_.notify_all();
    if (!wait(lk, [&] { return (in.posted && !in.consumed) || aborted_; }))
      timed_out(lk, rank,
                args.text("peer rank ", peer, " did not enter exchange with this rank within ", seconds(),
                          " s (threads_options::timeout)"));
    throw_if_aborted();
    std::string problem = bad;
    if (problem.empty() && !in.valid)
      problem = args.text("peer rank ", peer, " passed invalid arguments (it throws the reason)");
    else if (problem.empty() && in.type != type)
      problem = args.text("this rank passes ", name(type), " but peer rank ", peer, " passes ", name(in.type),
                          " (both sides must exchange the same element type)");
    else if (problem.empty() && in.count != count)
      problem = args.text("send has ", count, " elements but peer rank ", peer, " has ", in.count,
                          " (both sides must exchange the same size)");
    if (problem.empty() && count > 0) {
      lk.unlock();
      std::memcpy(recv, in.data, count * size_of(type));
      lk.lock();
    }
    in.consumed = true;
    cv_.notify_all();
    if (!wait(lk, [&] { return out.consumed || aborted_; }))
      timed_out(lk, rank,
                args.text("peer rank ", peer, " did not finish exchange with this rank within ", seconds(),
                          " s (threads_options::timeout)"));
    out.posted = false;
    out.consumed = false;
    if (!problem.empty()) throw gradapt::error(problem);
    throw_if_aborted();
  }

 private:
  channel& chan(int from, int to) { return chans_[static_cast<std::size_t>(from) * n_ + to]; }
  /// Waits for `ready` up to the watchdog timeout; false when it expired.
  template <class Pred>
  bool wait(std::unique_lock<std::mutex>& lk, Pred ready) {
    return cv_.wait_for(lk, opts_.timeout, ready);
  }
  double seconds() const { return std::chrono::duration<double>(opts_.timeout).count(); }
  /// The watchdog fired on `rank`: abort the world (the others throw peer_failure naming this
  /// message) and throw the message here.
  [[noreturn]] void timed_out(std::unique_lock<std::mutex>&, int rank, const std::string& what) {
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ =
          std::string("rank ").append(std::to_string(rank)).append(" failed: ").append(without_prefix(what));
    }
    cv_.notify_all();
    throw gradapt::error(what);
  }
  void throw_if_aborted() const {
    if (aborted_) throw peer_failure(gradapt::detail::message("comm::threads: ", abort_reason_));
  }

  int n_;
  threads_options opts_;
  std::vector<bool> here_;  ///< ranks inside the current barrier generation
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<post> posts_;
  std::vector<channel> chans_;
  std::vector<double> norms_;
  std::vector<std::shared_ptr<threads_world>> split_worlds_;
};

}  // namespace detail

/// One rank's handle on an in-process world of `size()` ranks.
///
/// Create a world with `threads::create(n)` (one handle per rank, for your own threads) or
/// run a function on every rank with `run_threads(n, fn)`. Collectives must be called by all
/// ranks in the same order, as with MPI. Buffers must not be modified by their owner while a
/// collective that uses them is in flight, and the send and receive buffers of one call must
/// not overlap, except that allgather's `send` may be this rank's block of `recv` (in place).
class threads {
 public:
  using space = host_space;  ///< buffers are host memory shared by the in-process ranks

  /// A new world of `n` ranks; element r is rank r's handle.
  static std::vector<threads> create(int n, threads_options options = {}) {
    gradapt::detail::require(n >= 1, "comm::threads::create: ", n, " ranks requested (expected >= 1)");
    gradapt::detail::require(options.timeout.count() > 0,
                             "comm::threads::create: threads_options::timeout is ", options.timeout.count(),
                             " ms (expected > 0)");
    auto w = std::make_shared<detail::threads_world>(n, options);
    std::vector<threads> out;
    out.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) out.push_back(threads(w, r));
    return out;
  }

  /// This handle's rank, 0 to size() - 1.
  int rank() const { return rank_; }
  /// Number of ranks in this handle's world (the one created, or the sub-world of a split).
  int size() const { return w_->size(); }

  /// Element-wise sum or max over ranks, in place. Values are combined in rank order in the
  /// compute type (float for float/half/bfloat16, double for double) and rounded once; max
  /// propagates NaN.
  template <element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, space> buf, reduce_op op) {
    reduce_in_place<false>(buf, op);
  }

  /// Mean over ranks, in place: the bits of `allreduce(buf, reduce_op::sum)` followed by
  /// g / size() in the compute type (`detail::divide_by_ranks`, as the train step's
  /// `allreduce_mean` and the bucket reducer divide), with the division done as each rank
  /// reduces its slice, so the mean costs no more memory traffic than the sum. Every rank must
  /// call allreduce_mean here (a rank calling allreduce instead is an error on every rank).
  template <element T>
  requires(!std::is_const_v<T>) void allreduce_mean(tensor_view<T, space> buf) {
    reduce_in_place<false, true>(buf, reduce_op::sum);
  }

  /// Sum over ranks, in place (exactly `allreduce(buf, reduce_op::sum)`), that also returns
  /// the squared norms the gradient noise scale needs, computed while the data is read anyway:
  /// the sum over ranks of |x_r|^2 of the inputs, and |sum_r x_r|^2 of the result as stored.
  /// Both are accumulated in double in a fixed order (the host backend's blocks within a
  /// rank's slice, slices in rank order), so every rank gets the same bits. Costs no extra pass
  /// over memory: each block's norms are taken while it is still in cache.
  template <element T>
  requires(!std::is_const_v<T>) allreduce_norms allreduce_with_norms(tensor_view<T, space> buf) {
    return reduce_in_place<true>(buf, reduce_op::sum);
  }

  /// Copies rank `root`'s buffer into every rank's buffer.
  template <element T>
  requires(!std::is_const_v<T>) void broadcast(tensor_view<T, space> buf, int root) {
    begin({{detail::coll::broadcast, dtype_of_v<T>, reduce_op::sum, root, count(buf.size())},
           nullptr,
           buf.data()},
          args("broadcast").rank_range("root", root));
    if (rank_ != root) std::copy_n(static_cast<const T*>(w_->posted(root).recv), buf.size(), buf.data());
    meet();
  }

  /// Rank r's `send` lands at offset r * send.size() of every rank's `recv`.
  template <element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<tensor_view<const T, space>> send,
                                               tensor_view<T, space> recv) {
    begin({{detail::coll::allgather, dtype_of_v<T>, reduce_op::sum, 0, count(send.size())},
           send.data(),
           recv.data()},
          args("allgather").gather<T>(send.data(), send.size(), recv.data(), recv.size()));
    const std::size_t n = send.size();
    for (int k = 0; k < size(); ++k) {
      const auto* from = static_cast<const T*>(w_->posted(k).send);
      T* to = recv.data() + static_cast<std::size_t>(k) * n;
      if (from != to) std::copy_n(from, n, to);  // equal only for this rank's block in place
    }
    meet();
  }

  /// Element-wise reduction of every rank's `send`; rank r receives block r.
  template <element T>
  requires(!std::is_const_v<T>) void reduce_scatter(std::type_identity_t<tensor_view<const T, space>> send,
                                                    tensor_view<T, space> recv, reduce_op op) {
    begin(
        {{detail::coll::reduce_scatter, dtype_of_v<T>, op, 0, count(recv.size())}, send.data(), recv.data()},
        args("reduce_scatter").scatter<T>(send.data(), send.size(), recv.data(), recv.size(), false));
    const std::size_t n = recv.size();
    const std::size_t off = static_cast<std::size_t>(rank_) * n;
    gradapt::host::combine_sources(
        size(), [&](int k) { return static_cast<const T*>(w_->posted(k).send) + off; }, recv.data(), n, op);
    meet();
  }

  /// Sends `send` to `peer` and receives `peer`'s message into `recv` (which must have as
  /// many elements as the peer sends). Only the two ranks take part. `peer == rank()` copies.
  template <element T>
  requires(!std::is_const_v<T>) void exchange(int peer,
                                              std::type_identity_t<tensor_view<const T, space>> send,
                                              tensor_view<T, space> recv) {
    const detail::arguments a = args("exchange");
    // With a peer, this rank's recv is written while the peer may still read its send.
    std::string bad;
    if (a.exchange_self<T>(peer, send.data(), send.size(), recv.data(), recv.size(), false, bad,
                           [&] { std::copy_n(send.data(), send.size(), recv.data()); }))
      return;
    w_->exchange(rank_, peer, send.data(), send.size(), recv.data(), dtype_of_v<T>, a, bad);
  }

  /// Ranks with equal `color` (>= 0) form a new world, ordered by (key, old rank).
  threads split(int color, int key) {
    const std::string bad = args("split").color(color);
    begin({{detail::coll::split, dtype::float32, reduce_op::sum, 0, 0}, nullptr, nullptr, color, key}, bad);
    std::vector<int> members;
    for (int k = 0; k < size(); ++k)
      if (w_->posted(k).color == color) members.push_back(k);
    const auto key_of = [&](int k) { return w_->posted(k).key; };
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return key_of(a) < key_of(b); });
    const int leader = members.front();
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    if (rank_ == leader)
      w_->split_slot(leader) =
          std::make_shared<detail::threads_world>(static_cast<int>(members.size()), w_->options());
    meet();
    threads result(w_->split_slot(leader), new_rank);
    meet();
    if (rank_ == leader) w_->split_slot(leader).reset();
    return result;
  }

  /// Waits until every rank has arrived.
  void barrier() {
    begin({{detail::coll::barrier, dtype::float32, reduce_op::sum, 0, 0}});
    // Nobody may post the next collective while a peer still checks this one's posts.
    meet();
  }

  /// Marks the world failed so that ranks blocked in a collective throw instead of waiting.
  /// run_threads calls it when a rank's function throws.
  void abort(const std::string& why) { w_->abort(rank_, why); }

 private:
  threads(std::shared_ptr<detail::threads_world> w, int rank) : w_(std::move(w)), rank_(rank) {}

  /// Posts this rank's arguments, waits for all ranks, and checks that their fingerprints
  /// agree; on a difference every rank throws the same kind of gradapt::error (the shared
  /// message of comm/detail/fingerprint.hpp), after a barrier so no rank reposts early.
  void begin(detail::threads_world::post p, const std::string& bad = {}) {
    p.valid = bad.empty();
    current_ = p.c.kind;
    w_->set_post(rank_, p);
    meet();
    int invalid = -1;
    for (int k = 0; k < size() && invalid < 0; ++k)
      if (!w_->posted(k).valid) invalid = k;
    bool same = true;
    for (int k = 1; k < size() && same; ++k)
      same = detail::fields(w_->posted(k).c) == detail::fields(w_->posted(0).c);
    if (invalid < 0 && same) return;
    const std::string_view op = detail::coll_name(p.c.kind);
    std::string problem = bad;
    if (problem.empty() && invalid >= 0)
      problem = detail::invalid_peer_message("comm::threads", op, rank_, invalid);
    if (problem.empty()) {
      std::vector<detail::call> all(static_cast<std::size_t>(size()));
      for (int k = 0; k < size(); ++k) all[static_cast<std::size_t>(k)] = w_->posted(k).c;
      problem = detail::mismatch_message("comm::threads", op, rank_, all);
    }
    meet();  // nobody may repost while others still read the posts
    throw gradapt::error(problem);
  }

  static std::int64_t count(std::size_t n) { return static_cast<std::int64_t>(n); }

  /// Meets every rank of the world inside the current collective (the watchdog names it).
  void meet() { w_->barrier(rank_, detail::coll_name(current_)); }

  /// Rank r reduces slice r of every rank's buffer (in groups of 8 elements, so the compiler
  /// vectorises at plain -O2) into its own buffer, and copies each block of 4096 results into
  /// the other ranks' buffers while the block is in cache: slice r of each buffer is read and
  /// written by rank r alone, so no scratch buffer and no second pass over memory are needed,
  /// and a barrier after the slices ends the collective. With `Norms`, the squared norms of
  /// each block's inputs and result are taken with the host backend's block reduction while
  /// the block is in cache; block values are added in order, and each rank posts its two sums
  /// for every rank to add in rank order. With `Mean`, each sum is divided by the rank count
  /// as it is stored (combine_sources_mean).
  template <bool Norms, bool Mean = false, class T>
  allreduce_norms reduce_in_place(tensor_view<T, space> buf, reduce_op op) {
    const std::size_t n = buf.size();
    const int p = size();
    constexpr detail::coll kind = Norms ? detail::coll::allreduce_with_norms
                                        : (Mean ? detail::coll::allreduce_mean : detail::coll::allreduce);
    begin({{kind, dtype_of_v<T>, op, 0, count(n)}, nullptr, buf.data()});
    const auto bounds = slice(n);
    const std::size_t lo = bounds.first, hi = bounds.second;
    const auto src = [&](int k) { return static_cast<const T*>(w_->posted(k).recv) + lo; };
    T* const mine_out = buf.data() + lo;
    const auto spread = [&](std::size_t b, std::size_t e) {
      for (int k = 0; k < p; ++k) {
        T* const to = static_cast<T*>(w_->posted(k).recv) + lo;
        if (to != mine_out) std::copy(mine_out + b, mine_out + e, to + b);  // equal: ranks share a buffer
      }
    };
    allreduce_norms mine;
    if constexpr (Norms)
      mine = gradapt::host::combine_sources_with_norms(p, src, mine_out, hi - lo, spread);
    else if constexpr (Mean)
      gradapt::host::combine_sources_mean(p, src, mine_out, hi - lo, spread);
    else
      gradapt::host::combine_sources(p, src, mine_out, hi - lo, op, spread);
    allreduce_norms norms;
    double* posted = w_->norms();
    if constexpr (Norms) {
      posted[2 * rank_] = mine.sum_local_sq;
      posted[2 * rank_ + 1] = mine.result_sq;
    }
    meet();
    // The sums stay readable until every rank has posted its next collective (begin's barrier).
    if constexpr (Norms)
      for (int k = 0; k < p; ++k) norms.sum_local_sq += posted[2 * k], norms.result_sq += posted[2 * k + 1];
    return norms;
  }

  std::pair<std::size_t, std::size_t> slice(std::size_t n) const {
    const auto p = static_cast<std::size_t>(size());
    const auto r = static_cast<std::size_t>(rank_);
    return {n * r / p, n * (r + 1) / p};
  }

  detail::arguments args(std::string_view op) const { return {"comm::threads", op, rank_, size()}; }

  std::shared_ptr<detail::threads_world> w_;
  int rank_ = 0;
  detail::coll current_ = detail::coll::barrier;  ///< the collective in flight (for messages)
};

static_assert(communicator<threads>);

/// Runs `fn(comm::threads&)` on `n` threads, one per rank of a new world, and joins them.
/// If a rank throws, the world is aborted (ranks blocked in collectives throw peer_failure) and
/// the first exception thrown by a rank's own code is rethrown here, in preference to the
/// peer_failure exceptions it caused.
template <class F>
void run_threads(int n, threads_options options, F&& fn) {
  auto comms = threads::create(n, options);
  std::mutex m;
  std::exception_ptr first;
  bool first_is_abort = true;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    pool.emplace_back([&, r] {
      try {
        fn(comms[static_cast<std::size_t>(r)]);
      } catch (const std::exception& e) {
        const bool is_abort = dynamic_cast<const peer_failure*>(&e) != nullptr;
        {
          std::lock_guard lk(m);
          if (!first || (first_is_abort && !is_abort)) {
            first = std::current_exception();
            first_is_abort = is_abort;
          }
        }
        comms[static_cast<std::size_t>(r)].abort(e.what());
      } catch (...) {
        {
          std::lock_guard lk(m);
          if (!first || first_is_abort) {
            first = std::current_exception();
            first_is_abort = false;
          }
        }
        comms[static_cast<std::size_t>(r)].abort("unknown exception");
      }
    });
  }
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

/// run_threads with the default threads_options.
template <class F>
void run_threads(int n, F&& fn) {
  run_threads(n, threads_options{}, std::forward<F>(fn));
}

}  // namespace gradapt::comm

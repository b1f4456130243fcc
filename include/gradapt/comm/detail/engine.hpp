#pragma once
/// @file
/// The opening of every operation of a communicator over an engine (comm::mpi, comm::nccl):
/// the local argument checks (comm/detail/arguments.hpp) and, with `check_sizes`, the
/// cross-rank agreement on the call's fingerprint (comm/detail/fingerprint.hpp). The engine
/// supplies only the transport of the agreement; what is checked, in which order, and what
/// every rank throws is the same for every engine.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gradapt/comm/detail/arguments.hpp"
#include "gradapt/comm/detail/fingerprint.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"

namespace gradapt::comm::detail {

/// CRTP base of an engine communicator. `Engine` derives from `engine_calls<Engine>`, befriends
/// it and provides:
/// - `static constexpr std::string_view comm_name` ("comm::mpi");
/// - public `rank()`, `size()` and `options().check_sizes`;
/// - `void max_allreduce_words(std::string_view op, std::int64_t* w, std::size_t n) const`: the
///   element-wise MAX of n int64 across ranks, in place;
/// - `void allgather_words(std::string_view op, const std::int64_t* mine, std::size_t n,
///   std::int64_t* all) const`: every rank's n int64 into `all`, in rank order;
/// - `std::int64_t swap_size(int peer, std::int64_t mine)`: sends `mine` to `peer` and
///   returns the peer's value.
/// Each `open_*` throws gradapt::error for invalid arguments or a disagreement (on every rank
/// when sizes are checked) and returns whether the engine has data to move.
template <class Engine>
class engine_calls {
 protected:
  /// The argument checks of operation `op` on this rank.
  [[nodiscard]] arguments args(std::string_view op) const {
    return {Engine::comm_name, op, self().rank(), self().size()};
  }

  /// Agreement before a collective (with check_sizes): every rank's fingerprint of the call and
  /// argument validity meet in one MAX allreduce of fingerprint_words integers; on a
  /// difference, every rank throws naming what differs. `bad` is this rank's complete error
  /// message when its own arguments are invalid (empty otherwise).
  void agree(const call& c, const std::string& bad) const {
    if (!self().options().check_sizes) {
      if (!bad.empty()) throw error(bad);
      return;
    }
    const std::string_view op = coll_name(c.kind);
    detail::agree(
        Engine::comm_name, op, self().rank(), self().size(), c, bad,
        [&](std::int64_t* w, std::size_t n) { self().max_allreduce_words(op, w, n); },
        [&](const std::int64_t* mine, std::size_t n, std::int64_t* all) {
          self().allgather_words(op, mine, n, all);
        });
  }

  /// allreduce of `n` elements of T with `op`.
  template <class T>
  bool open_allreduce(std::size_t n, reduce_op op) const {
    agree({coll::allreduce, dtype_of_v<T>, op, 0, static_cast<std::int64_t>(n)}, {});
    return n != 0;
  }

  /// broadcast of `n` elements of T from `root`.
  template <class T>
  bool open_broadcast(std::size_t n, int root) const {
    const std::string bad = args("broadcast").rank_range("root", root);
    agree({coll::broadcast, dtype_of_v<T>, reduce_op::sum, root, static_cast<std::int64_t>(n)}, bad);
    return n != 0;
  }

  /// allgather of `ns` elements of T from `send` into the `nr` elements of `recv`.
  template <class T>
  bool open_allgather(const T* send, std::size_t ns, const T* recv, std::size_t nr) const {
    const std::string bad = args("allgather").template gather<T>(send, ns, recv, nr);
    agree({coll::allgather, dtype_of_v<T>, reduce_op::sum, 0, static_cast<std::int64_t>(ns)}, bad);
    return ns != 0;
  }

  /// reduce_scatter with `op` of the `ns` elements of `send` into the `nr` elements of `recv`;
  /// `own_block` allows recv to be this rank's block of send.
  template <class T>
  bool open_reduce_scatter(const T* send, std::size_t ns, const T* recv, std::size_t nr, reduce_op op,
                           bool own_block) const {
    const std::string bad = args("reduce_scatter").template scatter<T>(send, ns, recv, nr, own_block);
    agree({coll::reduce_scatter, dtype_of_v<T>, op, 0, static_cast<std::int64_t>(nr)}, bad);
    return nr != 0;
  }

  /// exchange of `ns` elements of T with `peer`; `in_place` allows send and recv to be the same
  /// memory with a peer. With `peer` this rank, `copy()` moves send into recv when they differ.
  template <class T, class Copy>
  bool open_exchange(int peer, const T* send, std::size_t ns, const T* recv, std::size_t nr, bool in_place,
                     Copy&& copy) {
    const arguments a = args("exchange");
    std::string bad;
    if (a.exchange_self<T>(peer, send, ns, recv, nr, in_place, bad, copy)) return false;
    a.agree_exchange(peer, ns, bad, self().options().check_sizes,
                     [&](std::int64_t mine) { return mutable_self().swap_size(peer, mine); });
    return ns != 0;
  }

  /// split with `color`.
  void open_split(int color) const {
    agree({coll::split, dtype::float32, reduce_op::sum, 0, 0}, args("split").color(color));
  }

 private:
  const Engine& self() const { return static_cast<const Engine&>(*this); }
  Engine& mutable_self() { return static_cast<Engine&>(*this); }
};

}  // namespace gradapt::comm::detail

#pragma once
/// @file
/// `comm::single`: a world of one rank. Every collective is the identity (allgather and
/// exchange with itself copy), so algorithms run unchanged without any parallel engine.

#include <algorithm>
#include <type_traits>

#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::comm {

/// A communicator of exactly one rank over host memory.
class single {
 public:
  using space = host_space;  ///< buffers are host memory

  /// Always 0.
  int rank() const { return 0; }
  /// Always 1.
  int size() const { return 1; }

  /// Sum or max over one rank: leaves the buffer unchanged. Never throws.
  template <element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, space>, reduce_op) {}

  /// Broadcast from `root` within one rank: leaves the buffer unchanged.
  /// @throws gradapt::error unless `root == 0`
  template <element T>
  requires(!std::is_const_v<T>) void broadcast(tensor_view<T, space>, int root) {
    check_rank(root, "broadcast", "root");
  }

  /// Gathers the one rank's `send` into `recv`: a copy.
  /// @throws gradapt::error unless `recv.size() == send.size()`
  template <element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<tensor_view<const T, space>> send,
                                               tensor_view<T, space> recv) {
    check_equal(send.size(), recv.size(), "allgather");
    std::copy_n(send.data(), send.size(), recv.data());
  }

  /// Reduces over one rank and scatters one block: copies `send` into `recv`.
  /// @throws gradapt::error unless `recv.size() == send.size()`
  template <element T>
  requires(!std::is_const_v<T>) void reduce_scatter(std::type_identity_t<tensor_view<const T, space>> send,
                                                    tensor_view<T, space> recv, reduce_op) {
    check_equal(send.size(), recv.size(), "reduce_scatter");
    std::copy_n(send.data(), send.size(), recv.data());
  }

  /// Exchange with oneself: copies `send` into `recv`.
  /// @throws gradapt::error unless `peer == 0` and `recv.size() == send.size()`
  template <element T>
  requires(!std::is_const_v<T>) void exchange(int peer,
                                              std::type_identity_t<tensor_view<const T, space>> send,
                                              tensor_view<T, space> recv) {
    check_rank(peer, "exchange", "peer");
    check_equal(send.size(), recv.size(), "exchange");
    std::copy_n(send.data(), send.size(), recv.data());
  }

  /// Any split of a one-rank world is another one-rank world; the key is ignored.
  /// @throws gradapt::error when `color` is negative
  single split(int color, int) const {
    gradapt::detail::require(color >= 0, "comm::single split: color ", color, " is negative (expected >= 0)");
    return {};
  }

  /// Returns at once (nothing to wait for).
  void barrier() {}

 private:
  static void check_rank(int r, const char* op, const char* what) {
    gradapt::detail::require(r == 0, "comm::single ", op, ": ", what, " ", r,
                             " is out of range (world of 1 rank)");
  }
  static void check_equal(std::size_t send, std::size_t recv, const char* op) {
    gradapt::detail::require(send == recv, "comm::single ", op, " on rank 0: receive buffer has ", recv,
                             " elements but ", send, " are sent (expected equal with 1 rank)");
  }
};

static_assert(communicator<single>);

}  // namespace gradapt::comm

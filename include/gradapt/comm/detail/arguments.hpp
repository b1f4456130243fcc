#pragma once
/// @file
/// The local argument checks of the communicator contract, shared by comm::threads, comm::mpi
/// and comm::nccl so that one mistake reads the same on every communicator. Each check returns
/// this rank's complete error message, or an empty string when the arguments are valid; the
/// communicator then agrees on the verdict across ranks (comm/detail/fingerprint.hpp), so
/// every rank throws together.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "gradapt/core/error.hpp"

namespace gradapt::comm::detail {

/// True when the byte ranges [a, a + na) and [b, b + nb) share a byte.
inline bool overlap(const void* a, std::size_t na, const void* b, std::size_t nb) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return na != 0 && nb != 0 && x < y + nb && y < x + na;
}

/// Checks of one call: `comm` ("comm::mpi"), the operation, this rank and the world size.
class arguments {
 public:
  arguments(std::string_view comm, std::string_view op, int rank, int size)
      : comm_(comm), op_(op), rank_(rank), size_(size) {}

  /// "gradapt: <comm> <op> on rank <r>: <args...>".
  template <class... Args>
  [[nodiscard]] std::string text(Args&&... args) const {
    return gradapt::detail::message(comm_, " ", op_, " on rank ", rank_, ": ", std::forward<Args>(args)...);
  }
  /// Throws gradapt::error with text(args...).
  template <class... Args>
  [[noreturn]] void fail(Args&&... args) const {
    throw error(text(std::forward<Args>(args)...));
  }

  /// A root or peer `r` (named `what`) outside [0, size).
  [[nodiscard]] std::string rank_range(std::string_view what, std::int64_t r) const {
    if (r >= 0 && r < size_) return {};
    return text(what, " ", r, " is out of range (expected 0 to ", size_ - 1, ")");
  }

  /// A split color below 0.
  [[nodiscard]] std::string color(int c) const {
    if (c >= 0) return {};
    return text("color ", c, " is negative (expected a color >= 0)");
  }

  /// allgather: recv holds size() blocks of send's length; send may be exactly this rank's
  /// block of recv (in place), and must not overlap recv otherwise.
  template <class T>
  [[nodiscard]] std::string gather(const T* send, std::size_t ns, const T* recv, std::size_t nr) const {
    const std::size_t total = ns * static_cast<std::size_t>(size_);
    if (nr != total)
      return text("recv has ", nr, " elements but must have size() * send.size() = ", size_, " * ", ns, " = ",
                  total);
    const std::size_t own = static_cast<std::size_t>(rank_) * ns;
    if (send != recv + own && overlap(send, ns * sizeof(T), recv, nr * sizeof(T)))
      return text("send overlaps recv; it may only be recv's own block at offset rank() * send.size() = ",
                  own);
    return {};
  }

  /// reduce_scatter: send holds size() blocks of recv's length. With `own_block`, recv may be
  /// exactly this rank's block of send; otherwise (and for any other overlap) the buffers
  /// must be separate.
  template <class T>
  [[nodiscard]] std::string scatter(const T* send, std::size_t ns, const T* recv, std::size_t nr,
                                    bool own_block) const {
    const std::size_t total = nr * static_cast<std::size_t>(size_);
    if (ns != total)
      return text("send has ", ns, " elements but must have size() * recv.size() = ", size_, " * ", nr, " = ",
                  total);
    const std::size_t own = static_cast<std::size_t>(rank_) * nr;
    if (own_block && recv == send + own) return {};
    if (overlap(send, ns * sizeof(T), recv, nr * sizeof(T)))
      return own_block ? text(
                             "send overlaps recv; recv may only be send's own block at offset rank() * "
                             "recv.size() = ",
                             own)
                       : text("send and recv overlap; pass separate buffers");
    return {};
  }

  /// exchange: equal sizes; the same buffer is exchanged in place when `in_place` allows it,
  /// any other overlap is an error.
  template <class T>
  [[nodiscard]] std::string exchange(const T* send, std::size_t ns, const T* recv, std::size_t nr,
                                     bool in_place) const {
    if (ns != nr)
      return text("send has ", ns, " elements but recv has ", nr, " (exchange needs equal sizes)");
    if (in_place && send == recv) return {};
    if (overlap(send, ns * sizeof(T), recv, nr * sizeof(T)))
      return in_place ? text("send and recv partly overlap; pass separate buffers or the same buffer")
                      : text("send and recv overlap; pass separate buffers");
    return {};
  }

  /// The local part of an exchange with `peer`: throws for a peer outside [0, size). With
  /// `peer` this rank, throws for invalid buffers, calls `copy()` (which moves send into recv)
  /// unless send and recv are the same memory, and returns true: nothing is left to do.
  /// Otherwise stores this rank's verdict on the buffers in `bad` (exchange, with send and
  /// recv the same memory allowed when `in_place`) and returns false.
  template <class T, class Copy>
  [[nodiscard]] bool exchange_self(int peer, const T* send, std::size_t ns, const T* recv, std::size_t nr,
                                   bool in_place, std::string& bad, Copy&& copy) const {
    if (auto out = rank_range("peer", peer); !out.empty()) throw error(out);
    bad = exchange<T>(send, ns, recv, nr, in_place || peer == rank_);
    if (peer != rank_) return false;
    if (!bad.empty()) throw error(bad);
    if (send != recv) copy();
    return true;
  }

  /// The size agreement of an exchange with `peer`: with `check`, the two sides swap their
  /// sizes through `swap(mine) -> theirs` (-1 for invalid arguments) and both throw when they
  /// differ or either side's arguments are invalid (`bad`, this side's message or empty);
  /// without it only this side's `bad` is thrown.
  template <class Swap>
  void agree_exchange(int peer, std::size_t count, const std::string& bad, bool check, Swap&& swap) const {
    if (!check) {
      if (!bad.empty()) throw error(bad);
      return;
    }
    const std::int64_t mine = bad.empty() ? static_cast<std::int64_t>(count) : -1;
    const std::int64_t theirs = swap(mine);
    if (!bad.empty()) throw error(bad);
    exchange_sizes(peer, mine, theirs);
  }

  /// After two exchange peers swapped their sizes (-1 for invalid arguments): throws when they
  /// differ or the peer's arguments were invalid.
  void exchange_sizes(int peer, std::int64_t mine, std::int64_t theirs) const {
    if (theirs < 0) fail("peer rank ", peer, " passed invalid arguments (it throws the reason)");
    if (theirs != mine)
      fail("send has ", mine, " elements but peer rank ", peer, " has ", theirs,
           " (both sides must exchange the same size)");
  }

 private:
  std::string_view comm_;
  std::string_view op_;
  int rank_;
  int size_;
};

}  // namespace gradapt::comm::detail

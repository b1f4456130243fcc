#pragma once
/// @file
/// Owner-computes, then allgather: items (Shampoo's blocks, K-FAC's layers) are given to ranks
/// by `lpt_assign` over their costs; each rank writes its own items' words into its chunk of
/// one buffer, and one allgather gives every rank every item. A 4-word header per chunk
/// carries a step and a 48-bit hash that the caller checks are equal on every rank.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/core/assign.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::detail {

/// A 64-bit hash of `n` values' bytes (64-bit words, multiply-xorshift), continuing from `h`.
template <class T>
std::uint64_t hash_bytes(std::uint64_t h, const T* p, std::size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  const std::size_t bytes = n * sizeof(T);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  for (; i < bytes; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

/// The plan and buffers of one owner-computes exchange in element type C (float or double).
template <class C>
struct owner_exchange {
  static constexpr std::size_t header = 4;  ///< step (2 × 24 bits), hash (2 × 24 bits)
  int world = 0;                            ///< ranks of the plan (0: none yet)
  int rank = 0;                             ///< this rank
  std::vector<int> owner;                   ///< rank that computes each item
  std::vector<std::size_t> pos;             ///< offset of each item's words in its owner's chunk
  std::vector<std::size_t> slot;            ///< each item's index among its owner's items
  std::size_t most = 0;                     ///< the most items one rank computes
  std::size_t chunk = 0;                    ///< words per rank
  std::vector<C> send, recv;                ///< the chunks (empty when planned without host buffers)

  /// True when planned for this world and rank.
  bool planned_for(int n, int r) const { return world == n && rank == r; }

  /// Plans items of `cost` (for the assignment) and `words` (their size in the exchange);
  /// without `host_buffers` the caller keeps the chunks in memory of its own (`run` is then not
  /// called).
  void plan(std::span<const std::uint64_t> cost, std::span<const std::size_t> words, int n, int r,
            bool host_buffers = true) {
    plan_owners(lpt_assign(cost, n), words, n, r, host_buffers);
  }
  /// Plans items with the given owners (a rank in [0, n), or -1: the item is not exchanged) and
  /// `words` (their size in the exchange).
  void plan_owners(std::vector<int> owners, std::span<const std::size_t> words, int n, int r,
                   bool host_buffers = true) {
    owner = std::move(owners);
    std::vector<std::size_t> fill(static_cast<std::size_t>(n), header), count(static_cast<std::size_t>(n), 0);
    pos.assign(owner.size(), 0);
    slot.assign(owner.size(), 0);
    for (std::size_t i = 0; i < owner.size(); ++i) {
      if (owner[i] < 0) continue;
      const auto o = static_cast<std::size_t>(owner[i]);
      pos[i] = fill[o];
      fill[o] += words[i];
      slot[i] = count[o]++;
    }
    chunk = *std::max_element(fill.begin(), fill.end());
    most = *std::max_element(count.begin(), count.end());
    send.assign(host_buffers ? chunk : 0, C(0));
    recv.assign(host_buffers ? chunk * static_cast<std::size_t>(n) : 0, C(0));
    world = n;
    rank = r;
  }
  /// True when this rank computes item i.
  bool owns(std::size_t i) const { return owner[i] == rank; }
  /// Forgets the plan and frees the buffers.
  void clear() { *this = owner_exchange{}; }
  /// Where this rank writes item i's words (it must own it).
  C* out(std::size_t i) { return send.data() + pos[i]; }
  /// Item i's words after `run`.
  const C* in(std::size_t i) const {
    return recv.data() + static_cast<std::size_t>(owner[i]) * chunk + pos[i];
  }

  /// Allgathers the chunks with `step` and `hash` (its top 48 bits) in the header. Throws
  /// gradapt::error on every rank (naming `who`) when a rank's step differs from rank 0's, or
  /// when a rank passes a `local_error` (its words could not be computed): that rank throws
  /// its message, the others name it. Returns the first rank whose hash differs from rank 0's,
  /// or -1.
  template <class Comm>
  int run(Comm& comm, std::uint64_t step, std::uint64_t hash, const char* who,
          const std::string& local_error = {}) {
    constexpr std::uint64_t mask = (std::uint64_t{1} << 24) - 1;
    const std::uint64_t h = hash >> 16;
    send[0] = local_error.empty() ? static_cast<C>(step & mask) : C(-1);
    send[1] = static_cast<C>((step >> 24) & mask);
    send[2] = static_cast<C>(h & mask);
    send[3] = static_cast<C>((h >> 24) & mask);
    const auto len = static_cast<std::int64_t>(chunk);
    comm.allgather(tensor_view<const C, host_space>::vector(send.data(), len),
                   tensor_view<C, host_space>::vector(recv.data(), len * world));
    const auto word = [&](int r, int i) {
      const C* c = recv.data() + static_cast<std::size_t>(r) * chunk;
      return static_cast<std::uint64_t>(c[i]) | (static_cast<std::uint64_t>(c[i + 1]) << 24);
    };
    for (int r = 0; r < world; ++r) {
      if (!(recv[static_cast<std::size_t>(r) * chunk] < C(0))) continue;
      if (r == rank) throw error(local_error);
      fail(who, " on rank ", rank, ": rank ", r,
           " could not compute its share of the exchange (its own error says why)");
    }
    int differs = -1;
    for (int r = 1; r < world; ++r) {
      require(word(r, 0) == word(0, 0), who, " on rank ", rank, ": rank ", r, " is at step ", word(r, 0),
              " but rank 0 at step ", word(0, 0), " (every rank must call it at the same steps)");
      if (differs < 0 && word(r, 2) != word(0, 2)) differs = r;
    }
    return differs;
  }
};

}  // namespace gradapt::detail

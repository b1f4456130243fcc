#pragma once
/// @file
/// The fingerprint of a collective call that every communicator checks across ranks before it
/// moves data: which collective, the element type, the reduction op, the root and the per-rank
/// element count, plus whether this rank's own arguments were valid. comm::threads compares
/// the posted fingerprints directly; comm::mpi and comm::nccl agree on them with one small
/// element-wise MAX allreduce of `fingerprint_words` 64-bit integers (each field f travels as
/// f and -f, so the maximum and the minimum over ranks come back together) and, only when
/// they differ, one allgather to name a rank that differs. The messages are shared, so every
/// communicator reports a mismatch the same way, on every rank.

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"

namespace gradapt::comm::detail {

/// The collectives of the communicator contract.
enum class coll : std::uint8_t {
  allreduce,
  allreduce_with_norms,
  broadcast,
  allgather,
  reduce_scatter,
  split,
  barrier,
  exchange,
  iallreduce,
  allreduce_mean,
  ireduce_scatter
};

/// The last enumerator of `coll` (for range checks of values read back from a message).
inline constexpr coll last_coll = coll::ireduce_scatter;

/// The collective's name ("allreduce", ...); "unknown" for a value outside the enumeration.
constexpr std::string_view coll_name(coll c) {
  return gradapt::detail::enum_name(
      c, std::array<std::string_view, 11>{"allreduce", "allreduce_with_norms", "broadcast", "allgather",
                                          "reduce_scatter", "split", "barrier", "exchange", "iallreduce",
                                          "allreduce_mean", "ireduce_scatter"});
}

/// What every rank must agree on when it enters one collective.
struct call {
  coll kind = coll::barrier;      ///< the collective
  dtype type = dtype::float32;    ///< element type of the buffers
  reduce_op op = reduce_op::sum;  ///< reduction (sum for collectives that do not reduce)
  std::int64_t root = 0;          ///< root (broadcast), color (split), else 0
  std::int64_t count = 0;         ///< elements each rank contributes (the agreed size)
};

/// Fields of a call in the order a mismatch is reported: a different collective first (a
/// different type on a different collective says nothing), then type, op, root and count.
inline constexpr std::size_t call_fields = 5;
/// Words of the MAX-allreduce encoding: each field as (f, -f), then the invalid-rank word.
inline constexpr std::size_t fingerprint_words = 2 * call_fields + 1;

/// The fields of `c` as integers, in report order.
constexpr std::array<std::int64_t, call_fields> fields(const call& c) {
  return {static_cast<std::int64_t>(c.kind), static_cast<std::int64_t>(c.type),
          static_cast<std::int64_t>(c.op), c.root, c.count};
}

/// Encodes `c` for an element-wise MAX allreduce; `valid` is false when this rank's own
/// arguments are invalid (the last word then carries -rank, else INT64_MIN).
constexpr std::array<std::int64_t, fingerprint_words> encode(const call& c, bool valid, int rank) {
  std::array<std::int64_t, fingerprint_words> w{};
  const auto f = fields(c);
  for (std::size_t i = 0; i < call_fields; ++i) {
    w[2 * i] = f[i];
    w[2 * i + 1] = -f[i];
  }
  w[2 * call_fields] = valid ? std::numeric_limits<std::int64_t>::min() : -static_cast<std::int64_t>(rank);
  return w;
}

/// After the MAX allreduce: the lowest rank whose arguments were invalid, or -1.
constexpr int invalid_rank(const std::array<std::int64_t, fingerprint_words>& w) {
  const std::int64_t v = w[2 * call_fields];
  return v == std::numeric_limits<std::int64_t>::min() ? -1 : static_cast<int>(-v);
}

/// After the MAX allreduce: true when every rank passed the same fields.
constexpr bool all_agree(const std::array<std::int64_t, fingerprint_words>& w) {
  for (std::size_t i = 0; i < call_fields; ++i)
    if (w[2 * i] != -w[2 * i + 1]) return false;
  return true;
}

/// Field `i` of a call, as the message shows it.
inline std::string field_text(std::size_t i, std::int64_t v) {
  switch (i) {
    case 0:
      return std::string("called ").append(coll_name(static_cast<coll>(v)));
    case 1:
      return std::string("passes ").append(name(static_cast<dtype>(v)));
    case 2:
      return std::string("uses reduce_op::").append(name(static_cast<reduce_op>(v)));
    case 3:
      return std::string("passes root ").append(std::to_string(v));
    default:
      return std::string("passes ").append(std::to_string(v)).append(" elements");
  }
}

inline constexpr std::array<std::string_view, call_fields> field_rules = {
    "every rank must call the same collective in the same order",
    "every rank must pass the same element type", "every rank must pass the same reduction op",
    "every rank must pass the same root", "every rank must pass the same size"};

/// The message every rank throws when the gathered fingerprints `all` (one call per rank, in
/// rank order) differ: names the first field that differs, this rank's value and the value
/// of the lowest rank that differs from this one (or, when this rank agrees with everyone on
/// that field, the two lowest ranks that differ).
inline std::string mismatch_message(std::string_view comm, std::string_view op, int rank,
                                    std::span<const call> all) {
  for (std::size_t i = 0; i < call_fields; ++i) {
    const std::int64_t mine = fields(all[static_cast<std::size_t>(rank)])[i];
    for (std::size_t k = 0; k < all.size(); ++k) {
      const std::int64_t theirs = fields(all[k])[i];
      if (theirs == mine) continue;
      return gradapt::detail::message(comm, " ", op, " on rank ", rank, ": this rank ", field_text(i, mine),
                                      " but rank ", k, " ", field_text(i, theirs), " (", field_rules[i], ")");
    }
  }
  for (std::size_t i = 0; i < call_fields; ++i) {
    const std::int64_t first = fields(all[0])[i];
    for (std::size_t k = 1; k < all.size(); ++k)
      if (fields(all[k])[i] != first)
        return gradapt::detail::message(comm, " ", op, " on rank ", rank, ": rank 0 ", field_text(i, first),
                                        " but rank ", k, " ", field_text(i, fields(all[k])[i]), " (",
                                        field_rules[i], ")");
  }
  return gradapt::detail::message(comm, " ", op, " on rank ", rank, ": the ranks' calls differ");
}

/// The message of every rank when rank `bad` (another rank) passed invalid arguments.
inline std::string invalid_peer_message(std::string_view comm, std::string_view op, int rank, int bad) {
  return gradapt::detail::message(
      comm, " ", op, " on rank ", rank, ": rank ", bad,
      " passed invalid arguments (that rank's error says which); nothing was sent");
}

/// Agreement over a fingerprint through two engine collectives: `max_allreduce(words, n)`
/// (element-wise MAX of n int64 in place) and `allgather(mine, n, all)` (every rank's n int64
/// into all, in rank order; called only on the error path). `bad` is this rank's complete
/// error message when its own arguments are invalid (empty otherwise). Returns normally only
/// when every rank's call matches and every rank's arguments are valid; otherwise every rank
/// throws gradapt::error (this rank's own message first).
template <class MaxAllreduce, class Allgather>
void agree(std::string_view comm, std::string_view op, int rank, int size, const call& c,
           const std::string& bad, MaxAllreduce&& max_allreduce, Allgather&& allgather) {
  auto w = encode(c, bad.empty(), rank);
  max_allreduce(w.data(), w.size());
  if (!bad.empty()) throw error(bad);
  if (const int r = invalid_rank(w); r >= 0) throw error(invalid_peer_message(comm, op, rank, r));
  if (all_agree(w)) return;
  // Error path only: every rank's fields, to name one that differs.
  const auto mine = fields(c);
  std::vector<std::int64_t> words(static_cast<std::size_t>(size) * call_fields, 0);
  allgather(mine.data(), call_fields, words.data());
  std::vector<call> all(static_cast<std::size_t>(size), call{});
  for (std::size_t k = 0; k < all.size(); ++k) {
    const std::int64_t* f = words.data() + k * call_fields;
    all[k] =
        call{static_cast<coll>(f[0]), static_cast<dtype>(f[1]), static_cast<reduce_op>(f[2]), f[3], f[4]};
  }
  throw error(mismatch_message(comm, op, rank, std::span<const call>(all.data(), all.size())));
}

}  // namespace gradapt::comm::detail

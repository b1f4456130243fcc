#pragma once
/// @file
/// The state that copies of a `comm::mpi` share (the count of checked calls, the buffers of
/// the watchdog's sends, the non-blocking allreduce whose fingerprint is in flight and the
/// handle that carries non-blocking data), the stages of one non-blocking allreduce, and the
/// watchdog's conversation after a timeout, which finds the ranks that never entered a
/// collective and where the others wait.

#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/comm/detail/fingerprint.hpp"

namespace gradapt::comm::detail_mpi {

/// One non-blocking allreduce (`mpi::iallreduce`): its fingerprint in flight on the
/// communicator's handle, then its data collectives in flight on the data handle.
struct nonblocking_op {
  /// Where the operation stands.
  enum class stage : std::uint8_t {
    agreeing,  ///< the fingerprint allreduce is in flight; no data has moved
    posted,    ///< the ranks agreed; the data collectives are in flight
    complete,  ///< the data collectives finished: the buffer holds the result
    failed     ///< the ranks' calls differed (`error` says how); no data moved
  };
  stage at = stage::agreeing;
  gradapt::comm::detail::call c{};                                             ///< this rank's call
  std::array<std::int64_t, gradapt::comm::detail::fingerprint_words> words{};  ///< fingerprint (MAX)
  MPI_Request fingerprint = MPI_REQUEST_NULL;                                  ///< its request
  void* data = nullptr;                                                        ///< the buffer
  const void* send = nullptr;             ///< ireduce_scatter: the send buffer (size() blocks of c.count)
  std::string bad;                        ///< this rank's own argument error (sent as an invalid fingerprint)
  std::size_t bytes_per_element = 0;      ///< its element size
  MPI_Datatype type = MPI_DATATYPE_NULL;  ///< its MPI type
  MPI_Op op = MPI_OP_NULL;                ///< the reduction
  std::vector<MPI_Request> requests;      ///< the data collectives (one per max_count piece)
  std::string error;                      ///< the agreement error (stage failed)
};

/// State shared by a communicator and its copies: the count of checked calls (the watchdog
/// tells apart a peer waiting in this call from one waiting in another), the buffers of the
/// watchdog's fire-and-forget sends, which must outlive their requests, the non-blocking
/// allreduce whose fingerprint is still in flight (at most one) and the duplicate handle that
/// carries non-blocking data (created by the first agreed `iallreduce`, freed with the state).
struct shared_state {
  std::uint64_t calls = 0;
  std::deque<std::array<std::int64_t, 4>> sent;
  std::shared_ptr<nonblocking_op> agreeing;
  MPI_Comm data = MPI_COMM_NULL;

  shared_state() = default;
  shared_state(const shared_state&) = delete;
  shared_state& operator=(const shared_state&) = delete;
  ~shared_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && data != MPI_COMM_NULL) MPI_Comm_free(&data);
  }
};

/// The watchdog's conversation after a timeout (point-to-point on `tag`): a query
/// {0, call, collective, id} to every awaited rank, an answer {1, call, collective, id} from
/// each rank that waits in a check of the same handle. Ranks that never answer are missing.
class watch {
 public:
  watch(MPI_Comm comm, int rank, int size, int tag, gradapt::comm::detail::coll kind, int waits_for,
        shared_state& shared)
      : comm_(comm),
        rank_(rank),
        size_(size),
        tag_(tag),
        kind_(kind),
        waits_for_(waits_for),
        shared_(shared),
        seen_(static_cast<std::size_t>(size)) {}

  /// Answers every query that has arrived; true when one came from the rank's current call
  /// (a peer has timed out in the same operation).
  bool serve() {
    bool same_call = false;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, tag_, comm_, &flag, &st) != MPI_SUCCESS || flag == 0) return same_call;
      std::array<std::int64_t, 4> m{};
      if (MPI_Recv(m.data(), 4, MPI_INT64_T, st.MPI_SOURCE, tag_, comm_, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return same_call;
      const auto q = static_cast<std::size_t>(st.MPI_SOURCE);
      if (m[0] == 0) {
        seen_[q] = {true, m[1], m[2]};
        send(st.MPI_SOURCE,
             {1, static_cast<std::int64_t>(shared_.calls), static_cast<std::int64_t>(kind_), m[3]});
        same_call = same_call || same(m[1], m[2]);
      } else if (m[3] == id_) {
        seen_[q] = {true, m[1], m[2]};
      }
    }
  }

  /// Sends this rank's query to every rank it waits for.
  void ask() {
    static std::int64_t next_id = 0;
    id_ = ++next_id;
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && (waits_for_ < 0 || q == waits_for_))
        send(q, {0, static_cast<std::int64_t>(shared_.calls), static_cast<std::int64_t>(kind_), id_});
  }

  /// What the answers say: the ranks that never answered, and those waiting in another call.
  [[nodiscard]] std::string report() const {
    std::string missing, elsewhere;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || (waits_for_ >= 0 && q != waits_for_)) continue;
      const auto& a = seen_[static_cast<std::size_t>(q)];
      if (!a.answered) {
        missing.append(missing.empty() ? "" : ", ").append(std::to_string(q));
      } else if (!same(a.call, a.kind)) {
        elsewhere.append(elsewhere.empty() ? "" : "; ").append("rank ").append(std::to_string(q));
        elsewhere.append(" waits in ")
            .append(a.kind >= 0 && a.kind <= static_cast<std::int64_t>(gradapt::comm::detail::last_coll)
                        ? gradapt::comm::detail::coll_name(static_cast<gradapt::comm::detail::coll>(a.kind))
                        : std::string_view("an unknown operation"))
            .append(" (its checked call ")
            .append(std::to_string(a.call))
            .append(", this rank's ")
            .append(std::to_string(shared_.calls))
            .append(")");
      }
    }
    std::string out;
    if (!missing.empty())
      out.append("missing rank(s) ")
          .append(missing)
          .append(" (no answer: computing, returned, failed, or inside an MPI call gradapt does not watch)");
    if (!elsewhere.empty()) out.append(out.empty() ? "" : "; ").append(elsewhere);
    if (out.empty()) out = "every awaited rank answered from this operation, but the check did not complete";
    return out;
  }

 private:
  /// True when (call, kind) is the operation this rank waits in (exchanges are pairwise and
  /// not counted as calls: the kind decides).
  [[nodiscard]] bool same(std::int64_t call, std::int64_t kind) const {
    if (kind != static_cast<std::int64_t>(kind_)) return false;
    return kind_ == gradapt::comm::detail::coll::exchange || call == static_cast<std::int64_t>(shared_.calls);
  }
  struct answer {
    bool answered = false;
    std::int64_t call = -1, kind = -1;
  };
  void send(int to, const std::array<std::int64_t, 4>& m) {
    shared_.sent.push_back(m);
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(shared_.sent.back().data(), 4, MPI_INT64_T, to, tag_, comm_, &r) == MPI_SUCCESS)
      MPI_Request_free(&r);
  }

  MPI_Comm comm_;
  int rank_, size_, tag_;
  gradapt::comm::detail::coll kind_;
  int waits_for_;
  shared_state& shared_;
  std::vector<answer> seen_;
  std::int64_t id_ = 0;
};

}  // namespace gradapt::comm::detail_mpi

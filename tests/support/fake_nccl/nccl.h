#pragma once
// A stand-in for the part of NCCL that gradapt::comm::nccl calls, over host threads, for tests
// that run comm::nccl's own code on the host (tests/test_nccl_host.cpp; see cuda_runtime_api.h
// here). Each rank is a thread holding its own ncclComm_t of one world (`fake_nccl::world`).
// A collective is a rendezvous: every rank posts its call, and the last to arrive moves the data
// of all of them (in rank order) and releases the others. Send/recv pairs inside a group meet in
// per-pair mailboxes at ncclGroupEnd.
//
// What the real library does with calls that do not match across ranks (other counts, another
// collective, another root) is undefined: it hangs or corrupts memory. Here such a rendezvous
// returns ncclInvalidUsage on every rank and counts itself in `fake_nccl::unmatched`, so a test
// sees whether a mismatch reached the engine. A rank that never arrives leaves the others
// waiting, as on a GPU.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda_runtime_api.h"

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
};
enum ncclDataType_t {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

struct ncclComm;

namespace fake_nccl {

enum class kind { allreduce, broadcast, allgather, reduce_scatter, split };

/// One rank's call at a rendezvous.
struct post {
  kind k = kind::allreduce;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;  ///< broadcast root; split: color
  int key = 0;   ///< split: key
};

struct group_state;

/// The ranks of one communicator.
struct clique {
  int n = 1;
  std::mutex m;
  std::condition_variable cv;
  std::uint64_t generation = 0;
  int arrived = 0;
  bool failed = false;  ///< the latest rendezvous did not match
  std::vector<post> posts;
  std::vector<::ncclComm*> made;  ///< split: each rank's new communicator
  /// Point-to-point: (from, to) -> the sender's buffer and size, taken by the receiver.
  std::map<std::pair<int, int>, std::pair<const void*, std::size_t>> mail;
  explicit clique(int ranks)
      : n(ranks), posts(static_cast<std::size_t>(ranks)), made(static_cast<std::size_t>(ranks)) {}
};

/// Rendezvous whose calls did not match (see the file comment).
inline std::atomic<int> unmatched{0};

}  // namespace fake_nccl

struct ncclComm {
  std::shared_ptr<fake_nccl::clique> c;
  int rank = 0;
  bool aborted = false;
  int group_depth = 0;
  /// Sends and receives queued inside a group: (peer, buffer, bytes, is_send).
  struct p2p {
    int peer;
    const void* send;
    void* recv;
    std::size_t bytes;
  };
  std::vector<p2p> queued;
};
using ncclComm_t = ncclComm*;

namespace fake_nccl {

inline std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

template <class T>
void reduce_into(std::vector<unsigned char>& out, const std::vector<post>& ps, std::size_t count,
                 std::size_t offset, ncclRedOp_t op) {
  out.assign(count * sizeof(T), 0);
  for (std::size_t i = 0; i < count; ++i) {
    T acc{};
    for (std::size_t r = 0; r < ps.size(); ++r) {
      T x;
      std::memcpy(&x, static_cast<const unsigned char*>(ps[r].send) + (offset + i) * sizeof(T), sizeof(T));
      acc = r == 0 ? x : (op == ncclMax ? std::max(acc, x) : static_cast<T>(acc + x));
    }
    std::memcpy(out.data() + i * sizeof(T), &acc, sizeof(T));
  }
}

inline bool reduce_any(std::vector<unsigned char>& out, const std::vector<post>& ps, std::size_t count,
                       std::size_t offset, ncclDataType_t t, ncclRedOp_t op) {
  if (op != ncclSum && op != ncclMax) return false;
  switch (t) {
    case ncclFloat32:
      reduce_into<float>(out, ps, count, offset, op);
      return true;
    case ncclFloat64:
      reduce_into<double>(out, ps, count, offset, op);
      return true;
    case ncclInt64:
      reduce_into<std::int64_t>(out, ps, count, offset, op);
      return true;
    default:
      return false;  // 16-bit reductions are not modelled
  }
}

/// The last rank of a rendezvous moves everyone's data. Returns false when the posts differ.
inline bool execute(clique& c) {
  const post& p0 = c.posts[0];
  for (const post& p : c.posts)
    if (p.k != p0.k || (p.k != kind::split && (p.count != p0.count || p.type != p0.type || p.op != p0.op ||
                                               (p.k == kind::broadcast && p.root != p0.root))))
      return false;
  const std::size_t n = static_cast<std::size_t>(c.n), es = type_size(p0.type), bytes = p0.count * es;
  switch (p0.k) {
    case kind::allreduce: {
      std::vector<unsigned char> sum;
      if (!reduce_any(sum, c.posts, p0.count, 0, p0.type, p0.op)) return false;
      for (const post& p : c.posts) std::memcpy(p.recv, sum.data(), bytes);
      return true;
    }
    case kind::broadcast: {
      std::vector<unsigned char> v(bytes);
      std::memcpy(v.data(), c.posts[static_cast<std::size_t>(p0.root)].send, bytes);
      for (const post& p : c.posts) std::memcpy(p.recv, v.data(), bytes);
      return true;
    }
    case kind::allgather: {
      std::vector<unsigned char> v(bytes * n);
      for (std::size_t r = 0; r < n; ++r) std::memcpy(v.data() + r * bytes, c.posts[r].send, bytes);
      for (const post& p : c.posts) std::memcpy(p.recv, v.data(), v.size());
      return true;
    }
    case kind::reduce_scatter: {
      std::vector<std::vector<unsigned char>> blocks(n);
      for (std::size_t r = 0; r < n; ++r)
        if (!reduce_any(blocks[r], c.posts, p0.count, r * p0.count, p0.type, p0.op)) return false;
      for (std::size_t r = 0; r < n; ++r) std::memcpy(c.posts[r].recv, blocks[r].data(), bytes);
      return true;
    }
    case kind::split: {
      std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, old rank)
      for (std::size_t r = 0; r < n; ++r)
        if (c.posts[r].root >= 0) by_color[c.posts[r].root].push_back({c.posts[r].key, static_cast<int>(r)});
      for (auto& [color, members] : by_color) {
        std::sort(members.begin(), members.end());
        auto nc = std::make_shared<clique>(static_cast<int>(members.size()));
        for (std::size_t i = 0; i < members.size(); ++i)
          c.made[static_cast<std::size_t>(members[i].second)] =
              new ncclComm{nc, static_cast<int>(i), false, 0, {}};
      }
      return true;
    }
  }
  return false;
}

/// Posts this rank's call and waits for every rank's; the last to arrive executes them.
inline ncclResult_t rendezvous(ncclComm_t comm, const post& p) {
  if (comm == nullptr || comm->aborted) return ncclInvalidUsage;
  clique& c = *comm->c;
  std::unique_lock<std::mutex> lock(c.m);
  c.posts[static_cast<std::size_t>(comm->rank)] = p;
  const std::uint64_t gen = c.generation;
  if (++c.arrived == c.n) {
    c.failed = !execute(c);
    if (c.failed) ++unmatched;
    c.arrived = 0;
    ++c.generation;
    c.cv.notify_all();
  } else {
    c.cv.wait(lock, [&] { return c.generation != gen; });
  }
  return c.failed ? ncclInvalidUsage : ncclSuccess;
}

/// A world of n ranks: rank r's communicator is element r (delete each with ncclCommDestroy).
inline std::vector<ncclComm_t> world(int n) {
  auto c = std::make_shared<clique>(n);
  std::vector<ncclComm_t> out;
  for (int r = 0; r < n; ++r) out.push_back(new ncclComm{c, r, false, 0, {}});
  return out;
}

}  // namespace fake_nccl

inline ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  return fake_nccl::rendezvous(comm, {fake_nccl::kind::allreduce, send, recv, count, type, op, 0, 0});
}
inline ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                  int root, ncclComm_t comm, cudaStream_t) {
  return fake_nccl::rendezvous(comm, {fake_nccl::kind::broadcast, send, recv, count, type, ncclSum, root, 0});
}
inline ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                  ncclComm_t comm, cudaStream_t) {
  return fake_nccl::rendezvous(comm, {fake_nccl::kind::allgather, send, recv, count, type, ncclSum, 0, 0});
}
inline ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  return fake_nccl::rendezvous(comm, {fake_nccl::kind::reduce_scatter, send, recv, count, type, op, 0, 0});
}
inline ncclResult_t ncclGroupStart() { return ncclSuccess; }
inline thread_local std::vector<ncclComm_t> fake_nccl_group_members;
inline ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t type, int peer,
                             ncclComm_t comm, cudaStream_t) {
  comm->queued.push_back({peer, send, nullptr, count * fake_nccl::type_size(type)});
  fake_nccl_group_members.push_back(comm);
  return ncclSuccess;
}
inline ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                             cudaStream_t) {
  comm->queued.push_back({peer, nullptr, recv, count * fake_nccl::type_size(type)});
  fake_nccl_group_members.push_back(comm);
  return ncclSuccess;
}
/// Runs the queued sends and receives: every send is posted first, then each receive waits for
/// its peer's send and copies it (a size that differs fails both sides), then each send waits
/// until its receiver has taken it.
inline ncclResult_t ncclGroupEnd() {
  ncclResult_t result = ncclSuccess;
  for (ncclComm_t comm : fake_nccl_group_members) {
    fake_nccl::clique& c = *comm->c;
    std::vector<ncclComm::p2p> q;
    q.swap(comm->queued);
    {
      std::lock_guard<std::mutex> lock(c.m);
      for (const auto& e : q)
        if (e.send != nullptr) c.mail[{comm->rank, e.peer}] = {e.send, e.bytes};
      c.cv.notify_all();
    }
    for (const auto& e : q) {
      if (e.recv == nullptr) continue;
      std::unique_lock<std::mutex> lock(c.m);
      c.cv.wait(lock, [&] { return c.mail.count({e.peer, comm->rank}) != 0; });
      const auto [src, bytes] = c.mail[{e.peer, comm->rank}];
      if (bytes != e.bytes) {
        ++fake_nccl::unmatched;
        result = ncclInvalidUsage;
      } else {
        std::memcpy(e.recv, src, bytes);
      }
      c.mail.erase({e.peer, comm->rank});
      c.cv.notify_all();
    }
    for (const auto& e : q) {
      if (e.send == nullptr) continue;
      std::unique_lock<std::mutex> lock(c.m);
      c.cv.wait(lock, [&] { return c.mail.count({comm->rank, e.peer}) == 0; });
    }
  }
  fake_nccl_group_members.clear();
  return result;
}
inline ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, void*) {
  const ncclResult_t r = fake_nccl::rendezvous(
      comm, {fake_nccl::kind::split, nullptr, nullptr, 0, ncclInt64, ncclSum, color, key});
  if (r != ncclSuccess) return r;
  std::lock_guard<std::mutex> lock(comm->c->m);
  *out = comm->c->made[static_cast<std::size_t>(comm->rank)];
  comm->c->made[static_cast<std::size_t>(comm->rank)] = nullptr;
  return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  *rank = comm->rank;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  *count = comm->c->n;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(ncclComm_t, int* device) {
  *device = 0;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
  comm->aborted = true;
  return ncclSuccess;
}
inline ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* state) {
  *state = ncclSuccess;
  return ncclSuccess;
}
inline const char* ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : (r == ncclInvalidUsage ? "invalid usage" : "fake NCCL error");
}
inline const char* ncclGetLastError(ncclComm_t) { return ""; }

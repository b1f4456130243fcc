#pragma once
/// @file
/// `gradapt::comm::nccl`: the communicator contract over an NCCL communicator and a CUDA
/// stream that the framework owns. Device memory only. Plain host C++ (it includes
/// `<nccl.h>` and `<cuda_runtime_api.h>` and contains no CUDA syntax), so it compiles with a
/// host compiler as well as with nvcc; link `gradapt::nccl`.
///
/// What it promises:
/// - **Asynchronous.** Every operation except `barrier`, `split` and the optional argument
///   check is *enqueued* on the stream given at construction and returns before the data has
///   moved: synchronise the stream (or order later work on it) before reading results on the
///   host or from another stream. Buffers must stay alive until the stream has passed them.
/// - **Deterministic reductions.** Each reduction is one NCCL collective; NCCL fixes its
///   algorithm and order for a given size, rank count, topology and NCCL configuration
///   (`NCCL_ALGO`, `NCCL_PROTO`), so results are bitwise identical from run to run on the same
///   system. The order is NCCL's, not gradapt's. `half` and `bfloat16` are reduced natively
///   (`ncclFloat16`, `ncclBfloat16`).
/// - **Argument checks.** Everything that can be checked locally is: a root or peer outside
///   `[0, size())`, `recv.size() != size() * send.size()` (allgather),
///   `send.size() != size() * recv.size()` (reduce_scatter), unequal exchange sizes, a negative
///   split color, overlapping buffers.
/// - **Agreement across ranks (on by default).** Before each collective the ranks agree on its
///   fingerprint (which collective, element type, reduction, root, count, and whether each
///   rank's own arguments were valid) with one tiny `ncclAllReduce` (MAX of the fields and their
///   negations; for exchange, a send/recv of the size), as `comm::mpi` does; on a difference
///   every rank throws, naming the collective, the field, and its range across ranks, instead of
///   entering an NCCL collective whose calls do not match (which hangs or corrupts memory). The
///   cost: the fingerprint's round trip through a device scratch buffer and a host wait for the
///   stream before the collective is enqueued, so the host does not run ahead of the device
///   past a collective. `nccl_options{.check_sizes = false}` turns it off, once a program's
///   collectives are known to match.
/// - **Empty buffers.** A zero-element operation enqueues nothing (after the optional check).
/// - **Host-side watchdog.** What waits on the host (`barrier`, `split`, the argument check)
///   polls the stream for at most `nccl_options::timeout` seconds, then aborts the
///   communicator (`ncclCommAbort`) and throws. With the argument check on, every operation
///   waits for the stream before it enqueues its collective, so a collective enqueued earlier
///   on the same stream that never completes (a rank that left, threw or called another
///   operation) is caught by the next operation's wait; the last collective before the
///   framework's own synchronisation is not watched. Unverified on hardware (no GPU has run it).
/// - **Engine errors.** Every NCCL or CUDA result other than success becomes `gradapt::error`
///   naming the operation, the rank, the function and the engine's own text
///   (`ncclGetErrorString` plus `ncclGetLastError`; `cudaGetErrorString`). Non-blocking
///   communicators are supported: `ncclInProgress` is polled with `ncclCommGetAsyncError`.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradapt/comm/detail/arguments.hpp"
#include "gradapt/comm/detail/engine.hpp"
#include "gradapt/comm/detail/fingerprint.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::comm {

/// Options of the NCCL communicator, built with designated initialisers:
/// `gradapt::comm::nccl comm{handle, stream, {.check_sizes = false}}`.
struct nccl_options {
  /// Before each operation, agree with the other ranks on its fingerprint (collective, element
  /// type, reduction, root, count, argument validity: one tiny collective plus a stream
  /// synchronisation per call), so a mismatch makes every rank throw instead of hanging. On by
  /// default; every rank must pass the same value.
  bool check_sizes = true;
  /// Host-side watchdog of the operations that wait on the host (`barrier`, `split` and the
  /// argument check): the longest, in seconds, the host polls the stream for them. Past it the
  /// communicator is aborted (`ncclCommAbort`, as PyTorch's NCCL watchdog does) and the call
  /// throws gradapt::error naming the operation; the communicator cannot be used afterwards.
  /// 0 waits forever. Default 300 (5 minutes). An enqueued collective is watched by the next
  /// operation's wait when `check_sizes` is on (its argument check waits for the stream); the
  /// stream's own synchronisation by the framework is not watched.
  double timeout = 300.0;
  /// The framework's stream that writes the buffers this communicator reduces (its backward
  /// stream), when it is not the communicator's: every operation first makes the
  /// communicator's stream wait for the work enqueued on it so far (`cudaEventRecord` on the
  /// producer, `cudaStreamWaitEvent` on the communicator's stream: the device orders them, the
  /// host does not wait), so reductions run on the communicator's stream while the producer
  /// goes on with the rest of the backward pass; `join_producer()` orders the producer after
  /// the communicator's work (the bucket reducer's `wait()` and the composed step call both).
  /// Unset (the default), or equal to the communicator's stream: nothing is recorded. Element
  /// work on buffers the communicator reduces (the backend's) belongs on the communicator's
  /// stream. Split communicators inherit it.
  std::optional<cudaStream_t> producer = std::nullopt;
};

namespace detail_nccl {

/// NCCL datatype of element type T.
template <class T>
constexpr ncclDataType_t datatype() {
  if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (std::is_same_v<T, half>)
    return ncclFloat16;
  else
    return ncclBfloat16;
}

constexpr ncclRedOp_t reduction(reduce_op op) { return op == reduce_op::max ? ncclMax : ncclSum; }

/// Makes `device` current for the guard's lifetime and restores the previous device.
class device_guard {
 public:
  explicit device_guard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device &&
        cudaSetDevice(device) == cudaSuccess)
      restore_ = true;
  }
  ~device_guard() {
    if (restore_) cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

/// Per-family state shared by copies: the handle if owned (from split) and a small device
/// scratch buffer for barrier and the argument check, allocated on first use.
struct shared_state {
  ncclComm_t owned = nullptr;
  int device = 0;
  void* scratch = nullptr;
  cudaEvent_t produced = nullptr;  ///< recorded on the producer stream (nccl_options::producer)
  cudaEvent_t reduced = nullptr;   ///< recorded on the communicator's stream for the producer

  shared_state() = default;
  shared_state(const shared_state&) = delete;
  shared_state& operator=(const shared_state&) = delete;
  ~shared_state() {
    if (scratch != nullptr || produced != nullptr || reduced != nullptr) {
      device_guard guard(device);
      if (scratch != nullptr) cudaFree(scratch);
      if (produced != nullptr) cudaEventDestroy(produced);
      if (reduced != nullptr) cudaEventDestroy(reduced);
    }
    if (owned != nullptr) {
      // Flush outstanding work, then free; errors cannot be reported from a destructor.
      if (ncclCommFinalize(owned) == ncclInProgress) {
        ncclResult_t state = ncclInProgress;
        while (state == ncclInProgress && ncclCommGetAsyncError(owned, &state) == ncclSuccess) {
        }
      }
      ncclCommDestroy(owned);
    }
  }
};

}  // namespace detail_nccl

/// A communicator over an NCCL communicator and a CUDA stream, for device memory.
///
/// Implements `gradapt::communicator`: `allreduce` (sum, max), `broadcast`, `allgather`,
/// `reduce_scatter`, pairwise `exchange` (grouped `ncclSend`/`ncclRecv`), `split`
/// (`ncclCommSplit`) and `barrier` on device views of `float`, `double`, `half` and
/// `bfloat16`. Operations are enqueued on `stream()` and are asynchronous (see the file
/// comment); collectives must be called by every rank in the same order.
///
/// Ownership: the communicator built from a framework's handle never destroys it or the
/// stream. A communicator returned by `split` owns its new handle; copies share it, and the
/// last copy to die finalises and destroys it (`ncclCommFinalize`, `ncclCommDestroy`).
class nccl : private detail::engine_calls<nccl> {
  friend class detail::engine_calls<nccl>;

 public:
  /// Views this communicator accepts: CUDA device memory.
  using space = device_space;

  /// Wraps `comm` and enqueues every operation on `stream` (which may be the legacy default
  /// stream, `nullptr`). The stream must belong to the communicator's device. Throws
  /// gradapt::error for a null handle or when NCCL cannot report the rank, size or device.
  nccl(ncclComm_t comm, cudaStream_t stream, nccl_options options = {})
      : state_(std::make_shared<detail_nccl::shared_state>()), comm_(comm), stream_(stream), opts_(options) {
    init();
  }

  /// The wrapped NCCL handle.
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  /// The stream operations are enqueued on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /// The CUDA device of the communicator (from `ncclCommCuDevice`).
  [[nodiscard]] int device() const noexcept { return state_->device; }
  /// This process's rank in the communicator, `0 <= rank() < size()`.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks in the communicator.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The options this communicator was built with (split communicators inherit them).
  [[nodiscard]] const nccl_options& options() const noexcept { return opts_; }

  /// Makes the communicator's stream wait, on the device, for the work enqueued so far on
  /// `nccl_options::producer` (nothing when it is unset or is the communicator's stream). Every
  /// operation calls it first.
  void after_producer() { order("after_producer", true); }
  /// Makes `nccl_options::producer` wait, on the device, for the work enqueued so far on the
  /// communicator's stream (nothing when it is unset or is the communicator's stream).
  void join_producer() { order("join_producer", false); }

  /// Enqueues, in place and element-wise across ranks, `buf[i] = op over ranks of buf[i]`.
  /// Every rank must pass the same number of elements.
  template <element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, device_space> buf, reduce_op op) {
    constexpr std::string_view name = "allreduce";
    after_producer();
    if (!open_allreduce<T>(buf.size(), op)) return;
    check(ncclAllReduce(buf.data(), buf.data(), buf.size(), detail_nccl::datatype<T>(),
                        detail_nccl::reduction(op), comm_, stream_),
          name, "ncclAllReduce");
  }

  /// Enqueues a copy of rank `root`'s `buf` into `buf` of every other rank. Every rank must
  /// pass the same `root` in `[0, size())` and the same number of elements.
  template <element T>
  requires(!std::is_const_v<T>) void broadcast(tensor_view<T, device_space> buf, int root) {
    constexpr std::string_view name = "broadcast";
    after_producer();
    if (!open_broadcast<T>(buf.size(), root)) return;
    check(ncclBroadcast(buf.data(), buf.data(), buf.size(), detail_nccl::datatype<T>(), root, comm_, stream_),
          name, "ncclBroadcast");
  }

  /// Enqueues a gather of every rank's `send` into `recv` on every rank: rank r's block lands
  /// at offset `r * send.size()`. Requires `recv.size() == size() * send.size()` and the same
  /// `send.size()` on every rank. `send` may be exactly rank()'s block of `recv` (NCCL's in-place
  /// form); any other overlap is an error.
  template <element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<tensor_view<const T, device_space>> send,
                                               tensor_view<T, device_space> recv) {
    constexpr std::string_view name = "allgather";
    after_producer();
    const std::size_t n = send.size();
    if (!open_allgather<T>(send.data(), n, recv.data(), recv.size())) return;
    check(ncclAllGather(send.data(), recv.data(), n, detail_nccl::datatype<T>(), comm_, stream_), name,
          "ncclAllGather");
  }

  /// Enqueues an element-wise reduction of `send` across ranks, scattered so that rank r
  /// receives block r (elements `[r * recv.size(), (r + 1) * recv.size())`). Requires
  /// `send.size() == size() * recv.size()` and the same `recv.size()` on every rank. `recv` may
  /// be exactly rank()'s block of `send` (NCCL's in-place form); any other overlap is an error.
  template <element T>
  requires(!std::is_const_v<T>) void reduce_scatter(
      std::type_identity_t<tensor_view<const T, device_space>> send, tensor_view<T, device_space> recv,
      reduce_op op) {
    constexpr std::string_view name = "reduce_scatter";
    after_producer();
    const std::size_t m = recv.size();
    if (!open_reduce_scatter<T>(send.data(), send.size(), recv.data(), m, op, true)) return;
    check(ncclReduceScatter(send.data(), recv.data(), m, detail_nccl::datatype<T>(),
                            detail_nccl::reduction(op), comm_, stream_),
          name, "ncclReduceScatter");
  }

  /// Enqueues a send of `send` to rank `peer` and a receive of the peer's `send` into `recv`,
  /// grouped (`ncclGroupStart`, `ncclSend`, `ncclRecv`, `ncclGroupEnd`); the peer must call
  /// `exchange(rank(), ...)`. Requires `send.size() == recv.size()` and non-overlapping
  /// buffers. `peer == rank()` enqueues a device-to-device copy (nothing when `send` and `recv`
  /// are the same memory). A `peer` outside `[0, size())` throws on this rank only.
  template <element T>
  requires(!std::is_const_v<T>) void exchange(int peer,
                                              std::type_identity_t<tensor_view<const T, device_space>> send,
                                              tensor_view<T, device_space> recv) {
    constexpr std::string_view name = "exchange";
    after_producer();
    const auto copy = [&] {
      if (send.empty()) return;
      detail_nccl::device_guard guard(state_->device);
      cuda_check(cudaMemcpyAsync(recv.data(), send.data(), send.bytes(), cudaMemcpyDeviceToDevice, stream_),
                 name, "cudaMemcpyAsync");
    };
    // NCCL cannot exchange with a peer in place; a copy to itself can.
    if (!open_exchange<T>(peer, send.data(), send.size(), recv.data(), recv.size(), false, copy)) return;
    constexpr ncclDataType_t type = detail_nccl::datatype<T>();
    group(name, [&] {
      check(ncclSend(send.data(), send.size(), type, peer, comm_, stream_), name, "ncclSend");
      check(ncclRecv(recv.data(), recv.size(), type, peer, comm_, stream_), name, "ncclRecv");
    });
  }

  /// Collective over all ranks: returns the communicator of the ranks that passed the same
  /// `color` (>= 0), ordered by `(key, rank())`, on the same stream and with the same options.
  /// The new handle comes from `ncclCommSplit` (inheriting this handle's configuration) and is
  /// destroyed when the last copy of the result dies. Blocks the host until the split is done.
  [[nodiscard]] nccl split(int color, int key) const {
    constexpr std::string_view name = "split";
    open_split(color);
    auto state = std::make_shared<detail_nccl::shared_state>();
    ncclComm_t made = nullptr;
    ncclResult_t r = ncclCommSplit(comm_, color, key, &made, nullptr);
    state->owned = made;  // destroyed with `state` if anything below throws
    if (r == ncclInProgress && made != nullptr) r = wait(made);
    check(r, name, "ncclCommSplit");
    gradapt::detail::require(made != nullptr, "comm::nccl split on rank ", rank_,
                             ": ncclCommSplit returned no communicator for color ", color);
    return nccl(std::move(state), made, stream_, opts_);
  }

  /// Enqueues a one-element allreduce and synchronises the stream: returns once every rank has
  /// entered `barrier` and this rank's earlier work on the stream has finished.
  void barrier() {
    constexpr std::string_view name = "barrier";
    after_producer();
    void* s = scratch();
    check(ncclAllReduce(s, s, 1, ncclInt64, ncclMax, comm_, stream_), name, "ncclAllReduce");
    synchronize(name);
  }

 private:
  nccl(std::shared_ptr<detail_nccl::shared_state> state, ncclComm_t comm, cudaStream_t stream,
       nccl_options options)
      : state_(std::move(state)), comm_(comm), stream_(stream), opts_(options) {
    init();
  }

  void init() {
    gradapt::detail::require(std::isfinite(opts_.timeout) && opts_.timeout >= 0.0,
                             "comm::nccl: nccl_options::timeout is ", opts_.timeout,
                             " (expected seconds >= 0; 0 waits forever)");
    gradapt::detail::require(comm_ != nullptr,
                             "comm::nccl: the ncclComm_t handle is null; pass an initialised "
                             "communicator (ncclCommInitRank, ncclCommInitAll or ncclCommSplit)");
    check(ncclCommUserRank(comm_, &rank_), "setup", "ncclCommUserRank");
    check(ncclCommCount(comm_, &size_), "setup", "ncclCommCount");
    check(ncclCommCuDevice(comm_, &state_->device), "setup", "ncclCommCuDevice");
  }

  static constexpr std::string_view comm_name = "comm::nccl";

  template <class... Args>
  [[noreturn]] void fail(std::string_view op, Args&&... args_) const {
    args(op).fail(std::forward<Args>(args_)...);
  }

  /// Polls a non-blocking communicator until its pending call has finished.
  static ncclResult_t wait(ncclComm_t c) {
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      const ncclResult_t r = ncclCommGetAsyncError(c, &state);
      if (r != ncclSuccess) return r;
    }
    return state;
  }

  void check(ncclResult_t r, std::string_view op, std::string_view fn) const {
    if (r == ncclInProgress) r = wait(comm_);
    if (r == ncclSuccess) return;
    const char* last = ncclGetLastError(comm_);
    const std::string detail =
        last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string();
    fail(op, fn, " failed: ", ncclGetErrorString(r), detail);
  }

  void cuda_check(cudaError_t e, std::string_view op, std::string_view fn) const {
    if (e != cudaSuccess) fail(op, fn, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  }

  /// The communicator's stream waits on the device for the producer's work enqueued so far
  /// (`after`), or the producer for the communicator's, through an event of the family
  /// (created on first use); nothing without a producer, or when it is the stream itself.
  void order(std::string_view op, bool after) const {
    if (!opts_.producer || *opts_.producer == stream_) return;
    const cudaStream_t from = after ? *opts_.producer : stream_, to = after ? stream_ : *opts_.producer;
    cudaEvent_t& event = after ? state_->produced : state_->reduced;
    detail_nccl::device_guard guard(state_->device);
    if (event == nullptr)
      cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), op, "cudaEventCreateWithFlags");
    cuda_check(cudaEventRecord(event, from), op, "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(to, event, 0), op, "cudaStreamWaitEvent");
  }

  /// Runs `body` between ncclGroupStart and ncclGroupEnd; the group is closed even if it throws.
  template <class F>
  void group(std::string_view op, F&& body) {
    check(ncclGroupStart(), op, "ncclGroupStart");
    try {
      body();
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    check(ncclGroupEnd(), op, "ncclGroupEnd");
  }

  /// Waits for the stream on the host, at most nccl_options::timeout seconds (see there).
  void synchronize(std::string_view op) const {
    detail_nccl::device_guard guard(state_->device);
    if (opts_.timeout <= 0.0) {
      cuda_check(cudaStreamSynchronize(stream_), op, "cudaStreamSynchronize");
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(opts_.timeout);
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda_check(e, op, "cudaStreamQuery");
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::yield();
    }
    ncclCommAbort(comm_);
    fail(op, "not every rank finished ", op, " within ", opts_.timeout,
         " s (nccl_options::timeout): a rank returned, threw or called another operation; the "
         "communicator was aborted (ncclCommAbort) and cannot be used again");
  }

  /// Device scratch for the argument check: one fingerprint, or this rank's fields followed by
  /// every rank's (64-bit integers), allocated on first use.
  void* scratch() const {
    if (state_->scratch == nullptr) {
      detail_nccl::device_guard guard(state_->device);
      const std::size_t words =
          std::max(detail::fingerprint_words, detail::call_fields * (static_cast<std::size_t>(size_) + 1));
      const std::size_t bytes = sizeof(std::int64_t) * words;
      cuda_check(cudaMalloc(&state_->scratch, bytes), "setup", "cudaMalloc (scratch)");
      // On the communicator's stream, so it is ordered before the copies that use it.
      cuda_check(cudaMemsetAsync(state_->scratch, 0, bytes, stream_), "setup", "cudaMemsetAsync (scratch)");
    }
    return state_->scratch;
  }

  /// Copies `count` 64-bit integers host -> scratch, runs `device_op`, copies them back, syncs.
  template <class F>
  void round_trip(std::string_view op, std::int64_t* host, std::size_t in, std::size_t out,
                  F&& device_op) const {
    auto* s = static_cast<std::int64_t*>(scratch());
    detail_nccl::device_guard guard(state_->device);
    cuda_check(cudaMemcpyAsync(s, host, in * sizeof(std::int64_t), cudaMemcpyHostToDevice, stream_), op,
               "cudaMemcpyAsync (argument check)");
    device_op(s);
    cuda_check(cudaMemcpyAsync(host, s, out * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream_), op,
               "cudaMemcpyAsync (argument check)");
    synchronize(op);
  }

  /// Sends `mine` to `peer` and returns the peer's value (argument check of exchange).
  std::int64_t swap_size(int peer, std::int64_t mine) {
    std::int64_t v[2] = {mine, 0};
    round_trip("exchange", v, 2, 2, [&](std::int64_t* s) {
      group("exchange", [&] {
        check(ncclSend(s, 1, ncclInt64, peer, comm_, stream_), "exchange", "ncclSend (argument check)");
        check(ncclRecv(s + 1, 1, ncclInt64, peer, comm_, stream_), "exchange", "ncclRecv (argument check)");
      });
    });
    return v[1];
  }

  /// The argument check's MAX allreduce: one ncclAllReduce through the device scratch and a
  /// stream synchronisation.
  void max_allreduce_words(std::string_view op, std::int64_t* w, std::size_t n) const {
    round_trip(op, w, n, n, [&](std::int64_t* s) {
      check(ncclAllReduce(s, s, n, ncclInt64, ncclMax, comm_, stream_), op, "ncclAllReduce (argument check)");
    });
  }

  /// The argument check's allgather (error path only): the scratch holds this rank's n words,
  /// then every rank's.
  void allgather_words(std::string_view op, const std::int64_t* mine, std::size_t n,
                       std::int64_t* all) const {
    const std::size_t total = n * (static_cast<std::size_t>(size_) + 1);
    std::vector<std::int64_t> buf(total, 0);
    std::copy_n(mine, n, buf.data());
    round_trip(op, buf.data(), n, 0, [&](std::int64_t* s) {
      check(ncclAllGather(s, s + n, n, ncclInt64, comm_, stream_), op, "ncclAllGather (argument check)");
      cuda_check(
          cudaMemcpyAsync(all, s + n, (total - n) * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream_),
          op, "cudaMemcpyAsync (argument check)");
    });
  }

  std::shared_ptr<detail_nccl::shared_state> state_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  nccl_options opts_{};
  int rank_ = 0;
  int size_ = 1;
};

static_assert(gradapt::communicator<gradapt::comm::nccl>);

}  // namespace gradapt::comm

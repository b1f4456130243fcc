#pragma once
/// @file
/// `gradapt::comm::mpi`: the communicator contract over an MPI communicator that the framework
/// owns (MPI_COMM_WORLD by default). Host memory only; include it from host translation units
/// that are compiled with the MPI compiler wrapper or linked to `gradapt::mpi`.
///
/// What it promises:
/// - **Deterministic reductions.** Every reduction is one MPI collective, so its order is the one
///   the MPI library fixes for a given message size, rank count and configuration: results are
///   bitwise identical from run to run. The order itself is the engine's, not gradapt's.
/// - **16-bit types.** `half` and `bfloat16` travel as a committed contiguous MPI datatype over
///   `MPI_UINT16_T`; sum and max are user-defined `MPI_Op`s that widen both operands to float,
///   combine them and round back to the 16-bit type (nearest, ties to even). The rounding
///   therefore happens at every step of MPI's reduction tree, not once at the end: with
///   `P` ranks a 16-bit sum carries up to `P - 1` roundings. Max is exact (it picks one
///   operand); a NaN operand makes the result NaN.
/// - **Cheap argument agreement.** With `mpi_options::check_sizes` (the default) every
///   collective first runs one tiny `MPI_Iallreduce(MPI_MAX)` of the call's fingerprint
///   (collective, element type, op, root, count and argument validity, each as f and -f; 11
///   64-bit integers, comm/detail/fingerprint.hpp), so every rank learns whether all ranks
///   entered the same collective with the same arguments. All ranks then throw together, with
///   a message that names what differs (for example `gradapt: comm::mpi allreduce on rank 2:
///   this rank passes 10 elements but rank 0 passes 12 elements (every rank must pass the same
///   size)`), instead of deadlocking, truncating or mixing float with double. `exchange` swaps
///   the two sizes with the peer first. With `check_sizes = false` only local checks run; a
///   rank that throws then leaves its peers waiting inside MPI.
/// - **Watchdog.** The argument check (and `exchange`'s size swap) waits at most
///   `mpi_options::timeout` seconds (default 300) for the other ranks. Past it, the rank asks
///   every rank it waits for where it is (a point-to-point query on `mpi_options::watch_tag`,
///   answered by any rank that is waiting in a gradapt collective of this communicator),
///   collects the answers for a grace period (half the timeout, between 0.2 and 5 s), prints
///   an error naming the operation and the ranks that never arrived (and, for ranks that wait
///   elsewhere, where they wait) and aborts the job with `MPI_Abort`: a rank that returned,
///   is still computing or called something else ends the job with a message, never a silent
///   hang. A rank waiting in a check that receives a query starts its own grace period, so
///   every waiting rank prints its message before the job ends.
/// - **Engine errors.** Every MPI return code other than `MPI_SUCCESS` becomes `gradapt::error`
///   with the operation, the rank, the MPI function and MPI's own text (`MPI_Error_string`).
///   For codes to be returned at all, the constructor installs `MPI_ERRORS_RETURN` on the
///   handle unless `mpi_options::errors_return` is false.
/// - **Large buffers.** MPI counts are `int`; buffers longer than `mpi_options::max_count`
///   elements are moved in pieces of at most that many elements (allgather and reduce_scatter
///   then use one broadcast or reduce per rank).
///
/// The element types' MPI datatypes and operators are in comm/mpi_datatypes.hpp; the state
/// that copies of a communicator share and the watchdog are in comm/mpi_watchdog.hpp.

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradapt/comm/detail/arguments.hpp"
#include "gradapt/comm/detail/engine.hpp"
#include "gradapt/comm/detail/fingerprint.hpp"
#include "gradapt/comm/mpi_datatypes.hpp"
#include "gradapt/comm/mpi_watchdog.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::comm {

/// Options of the MPI communicator, built with designated initialisers:
/// `gradapt::comm::mpi comm{MPI_COMM_WORLD, {.check_sizes = false}}`.
struct mpi_options {
  /// Before each collective, agree on the call's fingerprint (collective, element type, op,
  /// root, count) and argument validity with one extra tiny `MPI_Iallreduce` (and, for
  /// `exchange`, swap sizes with the peer), so that a mismatch makes every rank throw instead
  /// of hanging or mixing data. Off saves one small latency-bound message per call (and turns
  /// the watchdog off).
  bool check_sizes = true;
  /// Install `MPI_ERRORS_RETURN` on the wrapped handle (and on split handles) so that MPI
  /// failures come back as return codes and are thrown as `gradapt::error`. Note that this
  /// changes the error handler of the framework's handle for all its users. With `false` the
  /// handle keeps its handler (MPI's default, `MPI_ERRORS_ARE_FATAL`, aborts the job).
  bool errors_return = true;
  /// Message tag of the point-to-point traffic of `exchange` (and its size check), in
  /// `[0, MPI_TAG_UB]`. Pick one the framework does not use on the same communicator.
  int tag = 0x6761;
  /// Largest element count passed to one MPI call, in `[1, INT_MAX]`; longer buffers are sent
  /// in pieces. Lower it only to work around MPI libraries that mishandle large messages.
  std::int64_t max_count = INT_MAX;
  /// Watchdog of the argument check (with check_sizes): the longest a rank waits, in seconds,
  /// for every rank to enter the same collective. When it expires the rank prints an error
  /// naming the operation to stderr and aborts the job with `MPI_Abort` (a collective that
  /// not every rank entered can neither complete nor be cancelled). 0 waits forever. Default
  /// 300 (5 minutes).
  double timeout = 300.0;
  /// Message tag of the watchdog's queries and answers (point-to-point on the same handle,
  /// sent only after a timeout), in `[0, MPI_TAG_UB]` and different from `tag`.
  int watch_tag = 0x6762;
};

/// A communicator over an MPI communicator handle, for host memory.
///
/// Implements `gradapt::communicator`: `allreduce` (sum, max), `broadcast`, `allgather`,
/// `reduce_scatter`, pairwise `exchange`, `split` and `barrier` on views of `float`, `double`,
/// `half` and `bfloat16`. Every operation is blocking: it returns when the local buffers may be
/// reused. Collectives must be called by every rank of the communicator in the same order, as
/// with MPI itself; threads may use distinct `mpi` objects concurrently only if MPI was
/// initialised with `MPI_THREAD_MULTIPLE`.
///
/// Ownership: the communicator built from a framework's handle never frees it. A communicator
/// returned by `split` owns its new handle; copies share it, and the last copy to die calls
/// `MPI_Comm_free` (skipped if MPI is already finalised). Copies are cheap.
class mpi : private detail::engine_calls<mpi> {
  friend class detail::engine_calls<mpi>;

 public:
  /// Views this communicator accepts: host memory.
  using space = host_space;

  /// Wraps `comm` (MPI_COMM_WORLD by default). MPI must be initialised and not finalised, and
  /// `comm` must be an intracommunicator. Throws gradapt::error otherwise or when `options` is
  /// out of range. With `options.errors_return` it installs `MPI_ERRORS_RETURN` on `comm`.
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) : comm_(comm), opts_(options) {
    init();
  }

  /// Wraps MPI_COMM_WORLD with the given options.
  explicit mpi(mpi_options options) : mpi(MPI_COMM_WORLD, options) {}

  /// The wrapped MPI handle (owned by this object's family only if it came from `split`).
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  /// This process's rank in the communicator, `0 <= rank() < size()`.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks in the communicator.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The options this communicator was built with (split communicators inherit them).
  [[nodiscard]] const mpi_options& options() const noexcept { return opts_; }

  /// In place, element-wise across ranks: `buf[i] = op over ranks of buf[i]` (sum or max).
  /// Every rank must pass the same number of elements.
  template <element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, host_space> buf, reduce_op op) {
    constexpr std::string_view name = "allreduce";
    if (!open_allreduce<T>(buf.size(), op)) return;
    const MPI_Datatype type = detail_mpi::datatype<T>();
    const MPI_Op mop = detail_mpi::reduction<T>(op);
    pieces(buf.size(), [&](std::size_t off, int count) {
      check(MPI_Allreduce(MPI_IN_PLACE, buf.data() + off, count, type, mop, comm_), name, "MPI_Allreduce");
    });
  }

  class request;

  /// Starts a non-blocking in-place allreduce of `buf` (sum or max, element-wise across ranks)
  /// and returns its request; `buf` must stay valid and untouched until the request completes
  /// (`request::wait`, a `test` that returns true, or the request's destructor). Every rank
  /// must pass the same number of elements, element type and op, and start its non-blocking
  /// allreduces in the same order as its other collectives, as with MPI.
  ///
  /// Agreement (with `mpi_options::check_sizes`): the call's fingerprint travels in one tiny
  /// `MPI_Iallreduce` on this handle, posted here; the data collective (`MPI_Iallreduce` on a
  /// duplicate of the handle, in pieces of at most `max_count` elements) is posted only once
  /// the fingerprints have met, so a call that differs across ranks (size, element type, op,
  /// or another collective on another rank) moves no data and fails on every rank, at that
  /// request's `wait` or `test`, with the same message as a blocking call. At most one
  /// fingerprint is in flight: the next operation on this communicator (another
  /// `iallreduce`, any blocking collective) first waits for it, under the watchdog, and posts
  /// its data. Without `check_sizes` the data collective is posted at once.
  /// @throws gradapt::error when an MPI call fails
  template <element T>
  requires(!std::is_const_v<T>) [[nodiscard]] request
      iallreduce(tensor_view<T, host_space> buf, reduce_op op);

  /// Starts a non-blocking reduce-scatter (sum or max): block q of `send` (`size()` blocks of
  /// `recv.size()` elements) is reduced over the ranks into rank q's `recv`; returns its
  /// request (the same `request` as `iallreduce`: `wait`, `test`). `send` and `recv` must stay
  /// valid, and `recv` untouched, until the request completes. Agreement and ordering as for
  /// `iallreduce`: with `mpi_options::check_sizes` the fingerprint (this rank's argument errors
  /// included: sizes, overlapping buffers) travels first, and a call that differs moves no data
  /// and fails on every rank at its request's `wait` or `test`; without it a local argument
  /// error throws here. The data moves in one `MPI_Ireduce_scatter_block` (or, past
  /// `max_count` elements, one `MPI_Ireduce` per rank block and piece).
  /// @throws gradapt::error when an MPI call fails, or (without check_sizes) for invalid arguments
  template <element T>
  requires(!std::is_const_v<T>) [[nodiscard]] request
      ireduce_scatter(std::type_identity_t<tensor_view<const T, host_space>> send,
                      tensor_view<T, host_space> recv, reduce_op op);

  /// Lets outstanding non-blocking allreduces advance without waiting: posts the data of an
  /// agreed fingerprint and enters MPI's progress engine (Open MPI moves non-blocking
  /// collectives only inside MPI calls). Cheap; call it between pieces of other work.
  /// @throws gradapt::error when an MPI call fails
  void progress() {
    try_settle();
    int flag = 0;
    check(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE), "progress", "MPI_Iprobe");
  }

  /// Copies `buf` of rank `root` into `buf` of every other rank. Every rank must pass the same
  /// `root` in `[0, size())` and the same number of elements.
  template <element T>
  requires(!std::is_const_v<T>) void broadcast(tensor_view<T, host_space> buf, int root) {
    constexpr std::string_view name = "broadcast";
    if (!open_broadcast<T>(buf.size(), root)) return;
    const MPI_Datatype type = detail_mpi::datatype<T>();
    pieces(buf.size(), [&](std::size_t off, int count) {
      check(MPI_Bcast(buf.data() + off, count, type, root, comm_), name, "MPI_Bcast");
    });
  }

  /// Gathers every rank's `send` into `recv` on every rank: rank r's block lands at offset
  /// `r * send.size()`. Requires `recv.size() == size() * send.size()` and the same
  /// `send.size()` on every rank. `send` may be exactly rank()'s block of `recv` (in place);
  /// any other overlap is an error.
  template <element T>
  requires(!std::is_const_v<T>) void allgather(std::type_identity_t<tensor_view<const T, host_space>> send,
                                               tensor_view<T, host_space> recv) {
    constexpr std::string_view name = "allgather";
    const std::size_t n = send.size();
    const std::size_t total = n * static_cast<std::size_t>(size_);
    T* mine = recv.data() + (recv.size() == total ? static_cast<std::size_t>(rank_) * n : 0);
    const bool in_place = n != 0 && send.data() == mine;
    if (!open_allgather<T>(send.data(), n, recv.data(), recv.size())) return;
    const MPI_Datatype type = detail_mpi::datatype<T>();
    if (total <= static_cast<std::size_t>(opts_.max_count)) {
      const int count = static_cast<int>(n);
      check(MPI_Allgather(in_place ? MPI_IN_PLACE : static_cast<const void*>(send.data()), count, type,
                          recv.data(), count, type, comm_),
            name, "MPI_Allgather");
      return;
    }
    if (!in_place) std::memcpy(static_cast<void*>(mine), static_cast<const void*>(send.data()), send.bytes());
    for (int q = 0; q < size_; ++q) {
      T* block = recv.data() + static_cast<std::size_t>(q) * n;
      pieces(n, [&](std::size_t off, int count) {
        check(MPI_Bcast(block + off, count, type, q, comm_), name, "MPI_Bcast");
      });
    }
  }

  /// Reduces `send` element-wise across ranks and scatters the result: rank r receives block r
  /// (elements `[r * recv.size(), (r + 1) * recv.size())` of the reduction). Requires
  /// `send.size() == size() * recv.size()`, the same `recv.size()` on every rank, and `send`
  /// and `recv` not to overlap.
  template <element T>
  requires(!std::is_const_v<T>) void reduce_scatter(
      std::type_identity_t<tensor_view<const T, host_space>> send, tensor_view<T, host_space> recv,
      reduce_op op) {
    constexpr std::string_view name = "reduce_scatter";
    const std::size_t m = recv.size();
    const std::size_t total = m * static_cast<std::size_t>(size_);
    if (!open_reduce_scatter<T>(send.data(), send.size(), recv.data(), m, op, false)) return;
    const MPI_Datatype type = detail_mpi::datatype<T>();
    const MPI_Op mop = detail_mpi::reduction<T>(op);
    if (total <= static_cast<std::size_t>(opts_.max_count)) {
      check(MPI_Reduce_scatter_block(send.data(), recv.data(), static_cast<int>(m), type, mop, comm_), name,
            "MPI_Reduce_scatter_block");
      return;
    }
    for (int q = 0; q < size_; ++q) {
      const T* block = send.data() + static_cast<std::size_t>(q) * m;
      pieces(m, [&](std::size_t off, int count) {
        check(MPI_Reduce(block + off, q == rank_ ? recv.data() + off : nullptr, count, type, mop, q, comm_),
              name, "MPI_Reduce");
      });
    }
  }

  /// Sends `send` to rank `peer` and receives the peer's `send` into `recv` (the peer must call
  /// `exchange(rank(), ...)` at the same time). Requires `send.size() == recv.size()` and the
  /// same size on both sides. `peer == rank()` copies `send` into `recv` locally. `send` and
  /// `recv` may be the same memory (exchanged in place); any other overlap is an error.
  /// A `peer` outside `[0, size())` throws on this rank only: the rank that expected this one
  /// keeps waiting.
  template <element T>
  requires(!std::is_const_v<T>) void exchange(int peer,
                                              std::type_identity_t<tensor_view<const T, host_space>> send,
                                              tensor_view<T, host_space> recv) {
    constexpr std::string_view name = "exchange";
    const bool same = send.data() == recv.data();
    const auto copy = [&] {
      if (!send.empty())
        std::memcpy(static_cast<void*>(recv.data()), static_cast<const void*>(send.data()), send.bytes());
    };
    if (!open_exchange<T>(peer, send.data(), send.size(), recv.data(), recv.size(), true, copy)) return;
    const MPI_Datatype type = detail_mpi::datatype<T>();
    pieces(send.size(), [&](std::size_t off, int count) {
      if (same)
        check(MPI_Sendrecv_replace(recv.data() + off, count, type, peer, opts_.tag, peer, opts_.tag, comm_,
                                   MPI_STATUS_IGNORE),
              name, "MPI_Sendrecv_replace");
      else
        check(MPI_Sendrecv(send.data() + off, count, type, peer, opts_.tag, recv.data() + off, count, type,
                           peer, opts_.tag, comm_, MPI_STATUS_IGNORE),
              name, "MPI_Sendrecv");
    });
  }

  /// Collective over all ranks: returns the communicator of the ranks that passed the same
  /// `color` (>= 0), ordered by `(key, rank())`, with the same options. The new handle comes
  /// from `MPI_Comm_split` and is freed when the last copy of the result dies.
  [[nodiscard]] mpi split(int color, int key) const {
    constexpr std::string_view name = "split";
    open_split(color);
    MPI_Comm made = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &made), name, "MPI_Comm_split");
    std::shared_ptr<MPI_Comm> owner(new MPI_Comm(made), [](MPI_Comm* c) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && *c != MPI_COMM_NULL) MPI_Comm_free(c);
      delete c;
    });
    return mpi(std::move(owner), opts_);
  }

  /// Returns once every rank of the communicator has entered `barrier`.
  void barrier() {
    agree({detail::coll::barrier, dtype::float32, reduce_op::sum, 0, 0}, {});
    check(MPI_Barrier(comm_), "barrier", "MPI_Barrier");
  }

 private:
  mpi(std::shared_ptr<MPI_Comm> owner, mpi_options options)
      : owner_(std::move(owner)), comm_(*owner_), opts_(options) {
    init();
  }

  void init() {
    int flag = 0;
    MPI_Initialized(&flag);
    gradapt::detail::require(flag != 0,
                             "comm::mpi: MPI is not initialised; call MPI_Init or MPI_Init_thread before "
                             "constructing gradapt::comm::mpi");
    MPI_Finalized(&flag);
    gradapt::detail::require(
        flag == 0,
        "comm::mpi: MPI is already finalised; construct communicators between MPI_Init and "
        "MPI_Finalize");
    gradapt::detail::require(comm_ != MPI_COMM_NULL,
                             "comm::mpi: the handle is MPI_COMM_NULL; pass a valid communicator "
                             "(a rank outside a split group has none)");
    gradapt::detail::require(std::isfinite(opts_.timeout) && opts_.timeout >= 0.0,
                             "comm::mpi: mpi_options::timeout is ", opts_.timeout,
                             " (expected seconds >= 0; 0 waits forever)");
    gradapt::detail::require(opts_.max_count >= 1 && opts_.max_count <= INT_MAX,
                             "comm::mpi: mpi_options::max_count is ", opts_.max_count, " (expected 1 to ",
                             INT_MAX, ")");
    check(MPI_Comm_test_inter(comm_, &flag), "setup", "MPI_Comm_test_inter");
    gradapt::detail::require(flag == 0,
                             "comm::mpi: intercommunicators are not supported; pass an intracommunicator "
                             "(e.g. from MPI_Intercomm_merge)");
    if (opts_.errors_return)
      check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "setup", "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "setup", "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "setup", "MPI_Comm_size");
    void* ub = nullptr;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &flag), "setup", "MPI_Comm_get_attr");
    const int tag_ub = flag ? *static_cast<int*>(ub) : 32767;
    gradapt::detail::require(opts_.tag >= 0 && opts_.tag <= tag_ub, "comm::mpi: mpi_options::tag is ",
                             opts_.tag, " (expected 0 to MPI_TAG_UB = ", tag_ub, ")");
    gradapt::detail::require(
        opts_.watch_tag >= 0 && opts_.watch_tag <= tag_ub && opts_.watch_tag != opts_.tag,
        "comm::mpi: mpi_options::watch_tag is ", opts_.watch_tag, " (expected 0 to MPI_TAG_UB = ", tag_ub,
        ", different from mpi_options::tag = ", opts_.tag, ")");
  }

  static constexpr std::string_view comm_name = "comm::mpi";

  /// Waits for the requests of an argument check (`waits_for`: the ranks it needs, -1 for
  /// all); past mpi_options::timeout, finds out which of those ranks are missing (see the file
  /// comment), prints the error and aborts the job.
  void wait_or_abort(std::span<MPI_Request> reqs, std::string_view op, detail::coll kind,
                     int waits_for = -1) const {
    const auto test = [&] {
      int done = 0;
      check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), op,
            "MPI_Testall (argument check)");
      return done != 0;
    };
    if (opts_.timeout <= 0.0) {
      check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), op,
            "MPI_Waitall (argument check)");
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto seconds = [](double s) {
      return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
    };
    auto deadline = clock::now() + seconds(opts_.timeout);
    detail_mpi::watch w(comm_, rank_, size_, opts_.watch_tag, kind, waits_for, *shared_);
    bool expired = false;
    for (;;) {
      if (test()) return;
      const bool asked = w.serve();
      if (!expired && (asked || clock::now() > deadline)) {
        expired = true;
        w.ask();
        deadline = clock::now() + seconds(std::clamp(0.5 * opts_.timeout, 0.2, 5.0));
      } else if (expired && clock::now() > deadline) {
        break;
      }
      std::this_thread::yield();
    }
    const std::string what = args(op).text("not every rank entered ", op, " within ", opts_.timeout,
                                           " s (mpi_options::timeout): ", w.report(), "; aborting the job");
    std::fprintf(stderr, "%s\n", what.c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, 3);
    throw error(what);  // MPI_Abort does not return on a conforming implementation
  }

  void check(int code, std::string_view op, std::string_view fn) const {
    detail_mpi::check(code, op, rank_, fn);
  }

  /// Calls f(offset, count) for consecutive pieces of at most max_count elements.
  template <class F>
  void pieces(std::size_t n, F&& f) const {
    const auto step = static_cast<std::size_t>(opts_.max_count);
    for (std::size_t off = 0; off < n; off += step) f(off, static_cast<int>(std::min(step, n - off)));
  }

  /// Sends `mine` to `peer` and returns the peer's value (size check of exchange).
  std::int64_t swap_size(int peer, std::int64_t mine) const {
    std::int64_t theirs = 0;
    std::array<MPI_Request, 2> req{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    check(MPI_Irecv(&theirs, 1, MPI_INT64_T, peer, opts_.tag, comm_, &req[0]), "exchange",
          "MPI_Irecv (size swap)");
    check(MPI_Isend(&mine, 1, MPI_INT64_T, peer, opts_.tag, comm_, &req[1]), "exchange",
          "MPI_Isend (size swap)");
    wait_or_abort(req, "exchange", detail::coll::exchange, peer);
    return theirs;
  }

  /// Starts the non-blocking operation `o` (its call, buffers and local error set) of element
  /// type T: its fingerprint first with check_sizes, else its data at once.
  template <element T>
  request start(std::shared_ptr<detail_mpi::nonblocking_op> o, reduce_op op);

  /// Waits (under the watchdog) for the fingerprint of the non-blocking allreduce in flight, if
  /// any, and settles it: posts its data or records its agreement error. Every operation that
  /// posts on this handle calls it first, so the handle's collectives keep one order on every
  /// rank (fingerprint, then the error path's allgather if any, then the next operation).
  void settle() const {
    const auto o = shared_->agreeing;
    if (!o) return;
    wait_or_abort(std::span<MPI_Request>(&o->fingerprint, 1), "iallreduce", detail::coll::iallreduce);
    resolve(*o);
  }

  /// settle() if the fingerprint in flight has already met (never waits).
  void try_settle() const {
    const auto o = shared_->agreeing;
    if (!o) return;
    int done = 0;
    check(MPI_Test(&o->fingerprint, &done, MPI_STATUS_IGNORE), "iallreduce", "MPI_Test (argument check)");
    if (done != 0) resolve(*o);
  }

  /// The fingerprint of `o` has met: record a disagreement (after the allgather that names a
  /// rank, on every rank alike) or post the data collectives on the data handle.
  void resolve(detail_mpi::nonblocking_op& o) const {
    shared_->agreeing.reset();
    if (!detail::all_agree(o.words)) {
      try {
        detail::agree(
            comm_name, detail::coll_name(o.c.kind), rank_, size_, o.c, o.bad,
            [&](std::int64_t* w, std::size_t n) { std::copy_n(o.words.data(), n, w); },
            [&](const std::int64_t* mine, std::size_t n, std::int64_t* all) {
              allgather_words(detail::coll_name(o.c.kind), mine, n, all);
            });
      } catch (const error& e) {
        o.error = e.what();
      }
      o.at = detail_mpi::nonblocking_op::stage::failed;
      return;
    }
    post(o);
  }

  /// Posts the data collectives of an agreed non-blocking allreduce (creating the data handle
  /// on first use: a collective at the same point of every rank's sequence).
  void post(detail_mpi::nonblocking_op& o) const {
    if (shared_->data == MPI_COMM_NULL)
      check(MPI_Comm_dup(comm_, &shared_->data), "iallreduce", "MPI_Comm_dup (data handle)");
    const auto n = static_cast<std::size_t>(o.c.count);
    if (o.c.kind == detail::coll::ireduce_scatter) {  // rank blocks of n elements
      const auto* send = static_cast<const unsigned char*>(o.send);
      auto* recv = static_cast<unsigned char*>(o.data);
      if (n * static_cast<std::size_t>(size_) <= static_cast<std::size_t>(opts_.max_count)) {
        MPI_Request r = MPI_REQUEST_NULL;
        if (n != 0)
          check(MPI_Ireduce_scatter_block(send, recv, static_cast<int>(n), o.type, o.op, shared_->data, &r),
                "ireduce_scatter", "MPI_Ireduce_scatter_block");
        if (n != 0) o.requests.push_back(r);
      } else {
        for (int q = 0; q < size_; ++q)
          pieces(n, [&](std::size_t off, int count) {
            MPI_Request r = MPI_REQUEST_NULL;
            const std::size_t at = (static_cast<std::size_t>(q) * n + off) * o.bytes_per_element;
            check(MPI_Ireduce(send + at, q == rank_ ? recv + off * o.bytes_per_element : nullptr, count,
                              o.type, o.op, q, shared_->data, &r),
                  "ireduce_scatter", "MPI_Ireduce");
            o.requests.push_back(r);
          });
      }
      o.at = o.requests.empty() ? detail_mpi::nonblocking_op::stage::complete
                                : detail_mpi::nonblocking_op::stage::posted;
      return;
    }
    o.requests.reserve((n + static_cast<std::size_t>(opts_.max_count) - 1) /
                       static_cast<std::size_t>(opts_.max_count));
    pieces(n, [&](std::size_t off, int count) {
      MPI_Request r = MPI_REQUEST_NULL;
      check(MPI_Iallreduce(MPI_IN_PLACE, static_cast<unsigned char*>(o.data) + off * o.bytes_per_element,
                           count, o.type, o.op, shared_->data, &r),
            "iallreduce", "MPI_Iallreduce");
      o.requests.push_back(r);
    });
    o.at = o.requests.empty() ? detail_mpi::nonblocking_op::stage::complete
                              : detail_mpi::nonblocking_op::stage::posted;
  }

  /// The argument check's MAX allreduce: one MPI_Iallreduce, under the watchdog (which counts
  /// the checked calls). A non-blocking allreduce's fingerprint in flight is settled first.
  void max_allreduce_words(std::string_view op, std::int64_t* w, std::size_t n) const {
    settle();
    ++shared_->calls;
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, w, static_cast<int>(n), MPI_INT64_T, MPI_MAX, comm_, &req), op,
          "MPI_Iallreduce (argument check)");
    wait_or_abort(std::span<MPI_Request>(&req, 1), op, kind_of(op));
  }

  /// The collective named `op` (coll_name's inverse).
  static detail::coll kind_of(std::string_view op) {
    for (int k = 0; k <= static_cast<int>(detail::last_coll); ++k)
      if (detail::coll_name(static_cast<detail::coll>(k)) == op) return static_cast<detail::coll>(k);
    return detail::coll::allreduce;
  }

  /// The argument check's allgather (error path only).
  void allgather_words(std::string_view op, const std::int64_t* mine, std::size_t n,
                       std::int64_t* all) const {
    check(MPI_Allgather(mine, static_cast<int>(n), MPI_INT64_T, all, static_cast<int>(n), MPI_INT64_T, comm_),
          op, "MPI_Allgather (argument check)");
  }

  std::shared_ptr<MPI_Comm> owner_;  ///< set only for communicators made by split
  std::shared_ptr<detail_mpi::shared_state> shared_ = std::make_shared<detail_mpi::shared_state>();
  MPI_Comm comm_ = MPI_COMM_NULL;
  mpi_options opts_{};
  int rank_ = 0;
  int size_ = 1;
};

/// A non-blocking allreduce or reduce-scatter of `comm::mpi` in flight (returned by
/// `mpi::iallreduce` and `mpi::ireduce_scatter`).
/// Move-only. Its buffer holds the result once `wait()` returns or `test()` returns true.
/// The destructor of a request that is still in flight completes it (waiting, under the
/// communicator's watchdog for the agreement, which aborts the job rather than hang) and
/// discards any error, so MPI never writes into a buffer that has been released.
class mpi::request {
 public:
  /// An empty request (already complete).
  request() = default;
  /// Not copyable: one request owns its operation.
  request(const request&) = delete;
  /// Not copyable: one request owns its operation.
  request& operator=(const request&) = delete;
  /// Takes over `other`'s operation; `other` becomes empty.
  request(request&& other) noexcept : comm_(std::move(other.comm_)), op_(std::move(other.op_)) {}
  /// Completes this request's operation (as the destructor does), then takes over `other`'s.
  request& operator=(request&& other) noexcept {
    if (this != &other) {
      finish_quietly();
      comm_ = std::move(other.comm_);
      op_ = std::move(other.op_);
    }
    return *this;
  }
  /// Completes the operation if it is still in flight; errors are discarded.
  ~request() { finish_quietly(); }

  /// True while this request refers to an operation not yet completed by wait() or test().
  [[nodiscard]] bool active() const noexcept { return op_ != nullptr; }

  /// Advances the operation without blocking; true once it is complete (the request becomes
  /// empty). An empty request is complete.
  /// @throws gradapt::error when the ranks' calls differed (every rank throws, naming what
  ///         differs; no data moved) or an MPI call failed
  bool test() {
    if (!op_) return true;
    using stage = detail_mpi::nonblocking_op::stage;
    if (op_->at == stage::agreeing) comm_->try_settle();
    if (op_->at == stage::agreeing) return false;
    if (op_->at == stage::posted) {
      int done = 0;
      comm_->check(MPI_Testall(static_cast<int>(op_->requests.size()), op_->requests.data(), &done,
                               MPI_STATUSES_IGNORE),
                   detail::coll_name(op_->c.kind), "MPI_Testall");
      if (done == 0) return false;
      op_->at = stage::complete;
    }
    return finish();
  }

  /// Waits until the operation is complete (the request becomes empty). An empty request
  /// returns at once.
  /// @throws gradapt::error when the ranks' calls differed (every rank throws, naming what
  ///         differs; no data moved) or an MPI call failed
  void wait() {
    if (!op_) return;
    using stage = detail_mpi::nonblocking_op::stage;
    if (op_->at == stage::agreeing) comm_->settle();
    if (op_->at == stage::posted) {
      comm_->check(
          MPI_Waitall(static_cast<int>(op_->requests.size()), op_->requests.data(), MPI_STATUSES_IGNORE),
          detail::coll_name(op_->c.kind), "MPI_Waitall");
      op_->at = stage::complete;
    }
    finish();
  }

 private:
  friend class mpi;
  request(const mpi& comm, std::shared_ptr<detail_mpi::nonblocking_op> op)
      : comm_(comm), op_(std::move(op)) {}

  /// Empties the request; throws the agreement error of a failed operation.
  bool finish() {
    const auto op = std::move(op_);
    op_.reset();
    if (op->at == detail_mpi::nonblocking_op::stage::failed) throw error(op->error);
    return true;
  }

  void finish_quietly() noexcept {
    if (!op_) return;
    try {
      wait();
    } catch (...) {
      op_.reset();
    }
  }

  std::optional<mpi> comm_;
  std::shared_ptr<detail_mpi::nonblocking_op> op_;
};

template <element T>
requires(!std::is_const_v<T>) mpi::request mpi::iallreduce(tensor_view<T, host_space> buf, reduce_op op) {
  auto o = std::make_shared<detail_mpi::nonblocking_op>();
  o->c = {detail::coll::iallreduce, dtype_of_v<T>, op, 0, static_cast<std::int64_t>(buf.size())};
  o->data = static_cast<void*>(buf.data());
  return start<T>(std::move(o), op);
}

template <element T>
requires(!std::is_const_v<T>) mpi::request mpi::ireduce_scatter(
    std::type_identity_t<tensor_view<const T, host_space>> send, tensor_view<T, host_space> recv,
    reduce_op op) {
  auto o = std::make_shared<detail_mpi::nonblocking_op>();
  o->c = {detail::coll::ireduce_scatter, dtype_of_v<T>, op, 0, static_cast<std::int64_t>(recv.size())};
  o->bad =
      args("ireduce_scatter").template scatter<T>(send.data(), send.size(), recv.data(), recv.size(), false);
  o->send = static_cast<const void*>(send.data());
  o->data = static_cast<void*>(recv.data());
  return start<T>(std::move(o), op);
}

template <element T>
mpi::request mpi::start(std::shared_ptr<detail_mpi::nonblocking_op> o, reduce_op op) {
  o->bytes_per_element = sizeof(T);
  o->type = detail_mpi::datatype<T>();
  o->op = detail_mpi::reduction<T>(op);
  if (!opts_.check_sizes) {  // a local argument error stays local, as for the blocking calls
    if (!o->bad.empty()) throw error(o->bad);
    settle();
    post(*o);
    return request(*this, std::move(o));
  }
  settle();  // the previous fingerprint first: one order of collectives on every rank
  o->words = detail::encode(o->c, o->bad.empty(), rank_);
  ++shared_->calls;
  check(MPI_Iallreduce(MPI_IN_PLACE, o->words.data(), static_cast<int>(o->words.size()), MPI_INT64_T, MPI_MAX,
                       comm_, &o->fingerprint),
        detail::coll_name(o->c.kind), "MPI_Iallreduce (argument check)");
  shared_->agreeing = o;
  return request(*this, std::move(o));
}

static_assert(gradapt::communicator<gradapt::comm::mpi>);
static_assert(gradapt::nonblocking_allreduce_communicator<gradapt::comm::mpi>);
static_assert(gradapt::nonblocking_reduce_scatter_communicator<gradapt::comm::mpi>);

}  // namespace gradapt::comm

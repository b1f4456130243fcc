#pragma once
/// @file
/// The inverse p-th roots of a Shampoo block's statistics (`block_roots`, one root per
/// factor through linalg/matrix_root.hpp) and the background host thread that computes them
/// with shampoo_options::root_staleness >= 1 (`root_worker` and its `root_task`s).

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/matrix_root.hpp"

namespace gradapt::detail::shampoo_impl {

/// A block's roots: factor d of the block is an n[d] × n[d] matrix at offset off[d] of both
/// `stats` and `out`. Computes them in order and stops at the first failure; returns its status
/// and factor (`out` then holds the factors before it). `ws(n)` is the root workspace for size n.
template <class L, class C, class Ws>
std::pair<root_status, std::size_t> block_roots(const L& la, std::size_t k, int p, const std::int64_t* n,
                                                const std::size_t* off, const C* stats, C* out, Ws&& ws,
                                                const inverse_root_options& o) {
  for (std::size_t d = 0; d < k; ++d) {
    const auto r = inverse_pth_root(la, tensor_view<const C, host_space>(stats + off[d], {n[d], n[d]}), p,
                                    tensor_view<C, host_space>(out + off[d], {n[d], n[d]}), ws(n[d]), o);
    if (!r.ok()) return {r.status, d};
  }
  return {root_status::ok, 0};
}

/// Stands for "no communicator": the step computes every block's roots itself.
struct no_comm {};

/// One block's roots for the worker thread: from `in` (a copy of the statistics) into `out`.
template <class C>
struct root_task {
  std::size_t k = 0;
  int p = 0;
  const std::int64_t* n = nullptr;
  const std::size_t* off = nullptr;
  const C* in = nullptr;
  C* out = nullptr;
  root_status status = root_status::ok;
  std::size_t factor = 0;
};

/// A background host thread that computes roots (shampoo_options::root_staleness >= 1). The
/// step hands it a list of tasks whose buffers stay untouched by the step until `wait` returns;
/// the thread owns the root workspaces while it runs. Created at `init`, joined by the
/// destructor (after the task list in flight, if any, is done).
template <class L, class C>
class root_worker {
 public:
  using workspace_t = inverse_root_workspace<L, C>;
  root_worker(const L& la, const inverse_root_options& o,
              std::vector<std::pair<std::int64_t, workspace_t*>> ws)
      : la_(la), o_(o), ws_(std::move(ws)), thread_([this] { run(); }) {}
  root_worker(const root_worker&) = delete;
  root_worker& operator=(const root_worker&) = delete;
  ~root_worker() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// Starts `tasks` (which must outlive the computation); the worker must be idle.
  void start(std::span<root_task<C>> tasks) {
    {
      std::lock_guard lock(m_);
      tasks_ = tasks;
      busy_ = true;
      error_ = nullptr;
    }
    cv_.notify_all();
  }
  /// True when no task list is in flight.
  bool idle() {
    std::lock_guard lock(m_);
    return !busy_;
  }
  /// Waits for the task list in flight; rethrows an exception the computation raised.
  void wait() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  /// Waits for the task list in flight and drops its outcome (a `load` replaces its inputs).
  void discard() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !busy_; });
    error_ = nullptr;
  }

 private:
  void run() {
    std::unique_lock lock(m_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (busy_) {
        const auto tasks = tasks_;
        lock.unlock();
        std::exception_ptr err;
        try {
          for (auto& t : tasks) {
            const auto [status, factor] = block_roots(
                la_, t.k, t.p, t.n, t.off, t.in, t.out,
                [&](std::int64_t n) -> workspace_t& { return find(n); }, o_);
            t.status = status;
            t.factor = factor;
          }
        } catch (...) {
          err = std::current_exception();
        }
        lock.lock();
        error_ = err;
        busy_ = false;
        cv_.notify_all();
      } else if (stop_) {
        return;
      }
    }
  }
  workspace_t& find(std::int64_t n) {
    for (auto& [size, w] : ws_)
      if (size == n) return *w;
    detail::fail("shampoo: internal error: no root workspace for size ", n);
  }

  L la_;
  inverse_root_options o_;
  std::vector<std::pair<std::int64_t, workspace_t*>> ws_;
  std::mutex m_;
  std::condition_variable cv_;
  std::span<root_task<C>> tasks_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started after every other member exists
};

}  // namespace gradapt::detail::shampoo_impl

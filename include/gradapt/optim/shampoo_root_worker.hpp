#pragma once
/// @file
/// The inverse p-th roots of a Shampoo block's statistics (`block_roots`, one root per
/// factor through linalg/matrix_root.hpp) and the background host thread that computes them
/// with shampoo_options::root_staleness >= 1 (`root_worker` and its `root_task`s).

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"
#include "gradapt/linalg/matrix_root.hpp"
#include "gradapt/optim/shampoo_grafting.hpp"
#include "gradapt/optim/shampoo_options.hpp"

namespace gradapt::detail::shampoo_impl {

/// A root workspace of one matrix size: inverse_pth_root's (the coupled Newton iteration, in
/// host memory), the eigen roots' buffers in C and, allocated by the first retry, in double
/// (eigenvectors, eigenvalues and column scales in the memory of the element backend B, the
/// prepared input and, on a device, the host copies they are staged through), and eigenvalue-
/// corrected Shampoo's QR buffers (host memory).
template <class L, class C, class B = host>
struct root_workspace {
  root_workspace(const L& la, std::int64_t n) : base(la, n) {}
  inverse_root_workspace<L, C> base;
  template <class U>
  struct eig {
    using buffer =
        std::remove_cvref_t<decltype(std::declval<const B&>().template allocate<U>(std::size_t{}))>;
    buffer q, w, s, x;          ///< x: the root in U when U is not C
    std::vector<U> hq, hw, hs;  ///< a device's host staging
    std::vector<C> ha;          ///< a device's host copy of the input
    std::unique_ptr<detail::linalg::eigh_workspace_t<L, U>> ws;
    void reserve(const L& la, const B& b, std::int64_t n) {
      if (ws) return;
      const auto nn = static_cast<std::size_t>(n * n);
      q = b.template allocate<U>(nn);
      s = b.template allocate<U>(nn);
      w = b.template allocate<U>(static_cast<std::size_t>(n));
      if constexpr (!std::is_same_v<U, C>) x = b.template allocate<U>(nn);
      ws.reset(new detail::linalg::eigh_workspace_t<L, U>(la.template eigh_workspace<U>(n)));
    }
  };
  eig<C> e;
  eig<double> d;
  /// Eigenvalue-corrected Shampoo's QR refresh, in L's memory: the rotated factor B, its QR
  /// factors, the accumulated basis, a product and the sort's permutation matrix; in host
  /// memory the staged A and P, B's copy and the sort order; L's QR workspace (allocated on
  /// reserve).
  struct qr_buffers {
    using buffer = typename eig<C>::buffer;
    buffer b, q, r, acc, t, pm;
    std::vector<C> ha, hp, hb;
    std::vector<std::size_t> perm;
    typename detail::linalg::qr_workspace_of<L, C>::type work{};
    void reserve(const L& la, const B& bk, std::int64_t n) {
      if (!perm.empty() || n == 0) return;
      const auto nn = static_cast<std::size_t>(n * n);
      for (auto* v : {&b, &q, &r, &acc, &t, &pm}) *v = bk.template allocate<C>(nn);
      perm.resize(static_cast<std::size_t>(n));
      if constexpr (qr_linalg_backend<L>) work = la.template qr_workspace<C>(n);
    }
  };
  qr_buffers qr;
  /// Allocates what `m` needs now rather than at the first root.
  void reserve(const L& la, const B& b, root_method m) {
    if (m == root_method::coupled_newton)
      base.reserve(m);
    else
      e.reserve(la, b, base.n());
  }
};

/// One eigen root of A (n × n, in host memory `ha`) in precision U into x (n × n, C, in L's
/// memory), through `eigen_core`: the spectrum clamped at 0 (`inverse_pth_root`'s eigen
/// method: clamp_scales) or shifted (when min μ < r, μ ← μ − min μ + r, with μ = eig(A + r·I)
/// for an absolute ridge and eig(A) + r for a relative one, r = ε·λ_max). Returns
/// eigensolver_failed (for a retry in double), singular, nonfinite_result or ok.
template <class U, class L, class Ex, class C, class E>
root_status eigen_root_in(const L& la, const Ex& ex, const C* ha, std::int64_t n, int p,
                          const inverse_root_options& o, shampoo_spectrum spectrum, E& e, C* x) {
  using Sp = typename L::space;
  const auto nn = static_cast<std::size_t>(n);
  e.reserve(la, ex, n);
  U* hq = e.q.data();  // the prepared input, in host memory (then copied to q on a device)
  if constexpr (!std::is_same_v<Sp, host_space>) {
    e.hq.resize(nn * nn);
    hq = e.hq.data();
  }
  for (std::size_t i = 0; i < nn * nn; ++i) hq[i] = U(ha[i]);
  const bool shift = spectrum == shampoo_spectrum::shift;
  if (shift && o.ridge == ridge_kind::absolute)
    for (std::size_t i = 0; i < nn; ++i) hq[i * nn + i] += U(o.epsilon);
  detail::linalg::from_host(ex, hq, e.q.data(), nn * nn);
  U* xu = nullptr;
  if constexpr (std::is_same_v<U, C>)
    xu = x;
  else
    xu = e.x.data();
  inverse_root_result r;
  const auto scales = [&](U* lam, U* sc) {
    if (!shift) return detail::linalg::clamp_scales(lam, nn, p, o, r, sc);
    double rr = o.epsilon;
    if (o.ridge == ridge_kind::relative) {
      rr = o.epsilon * std::max(double(lam[nn - 1]), 0.0);
      for (std::size_t i = 0; i < nn; ++i) lam[i] += U(rr);
    }
    const double lo = double(*std::min_element(lam, lam + nn));
    if (lo < rr)
      for (std::size_t i = 0; i < nn; ++i) lam[i] = U(double(lam[i]) - lo + rr);
    for (std::size_t j = 0; j < nn; ++j) {
      const double l = double(lam[j]);
      if (!(l > 0)) return false;
      sc[j] = U(std::pow(l, -0.5 / double(p)));
    }
    return true;
  };
  const auto status = detail::linalg::eigen_core(la, ex, n, e.q.data(), e.w.data(), e.s.data(), xu, *e.ws,
                                                 e.hw, e.hs, scales);
  if (status != root_status::ok) return status;
  if constexpr (!std::is_same_v<U, C>)
    ex.apply(gather_as<C>{}, tensor_view<C, Sp>::vector(x, n * n),
             tensor_view<const U, Sp>::vector(xu, n * n));
  if (ex.reduce(reduction::count_nonfinite, tensor_view<const C, Sp>::vector(x, n * n)) != 0)
    return root_status::nonfinite_result;
  return root_status::ok;
}

/// How a block's roots are computed: the root options, the spectrum treatment and the factor
/// the statistics are divided by first (1 − β2^u with bias_correction, else 1).
struct root_recipe {
  inverse_root_options root;
  shampoo_spectrum spectrum = shampoo_spectrum::clamp;
};

/// How eigenvalue-corrected Shampoo refreshes a block's eigenbases.
struct basis_recipe {
  shampoo_eigenbasis method = shampoo_eigenbasis::eigh;
  double epsilon = 0;            ///< the ridge added to each factor first (the peer's epsilon)
  std::uint32_t iterations = 1;  ///< qr: power iterations
  double tolerance = 0;          ///< qr: stop when off-diagonal ‖B‖ <= tolerance·‖B‖
  bool retry_in_double = true;   ///< eigh in float: retry a failed decomposition in double
};

/// The eigenbasis of A = S / bias + ε·I in precision U by a symmetric eigendecomposition:
/// eigenvectors as columns, ascending eigenvalues, into `out` (L's memory). S is read in host
/// memory (`hs`); A is prepared there and copied to the workspace's q on a device. False when
/// the eigensolver fails.
template <class U, class L, class Ex, class C, class E>
bool eigh_basis(const L& la, const Ex& ex, const C* hs, std::int64_t n, double bias, double eps, E& e,
                C* out) {
  using Sp = typename L::space;
  const auto nn = static_cast<std::size_t>(n);
  e.reserve(la, ex, n);
  U* hq = e.q.data();
  if constexpr (!std::is_same_v<Sp, host_space>) {
    e.hq.resize(nn * nn);
    hq = e.hq.data();
  }
  for (std::size_t i = 0; i < nn * nn; ++i) hq[i] = U(double(hs[i]) / bias);
  for (std::size_t i = 0; i < nn; ++i) hq[i * nn + i] += U(eps);
  detail::linalg::from_host(ex, hq, e.q.data(), nn * nn);
  if (!la.eigh(tensor_view<U, Sp>(e.q.data(), {n, n}), tensor_view<U, Sp>::vector(e.w.data(), n), *e.ws))
    return false;
  ex.apply(gather_as<C>{}, tensor_view<C, Sp>::vector(out, n * n),
           tensor_view<const U, Sp>::vector(e.q.data(), n * n));
  return true;
}

/// A block's eigenbases for eigenvalue-corrected Shampoo (the Distributed Shampoo
/// eigendecomposition configs): factor d's basis Q_d (n_d × n_d, eigenvectors as columns) from
/// A = S_d / bias + ε·I, into `out` at offset off[d]:
///  - eigh: the eigenvectors of A, ascending eigenvalues (retried in double for float);
///  - qr: from the current basis `prev`, B = Qᵀ·A·Q, then `iterations` times (until B's
///    off-diagonal norm is at most `tolerance`·‖B‖): B = Q'·R', B ← R'·Q', Q ← Q·Q'; the
///    columns of Q sorted by diag(B), ascending (stable).
/// Stops at the first failure; returns its status and factor.
template <class L, class Ex, class C, class Ws>
std::pair<root_status, std::size_t> block_eigenbases(const L& la, const Ex& ex, std::size_t k,
                                                     const std::int64_t* n, const std::size_t* off,
                                                     const C* stats, const C* prev, C* out, Ws&& ws,
                                                     const basis_recipe& rc, double bias) {
  using Sp = typename L::space;
  using cview = tensor_view<const C, Sp>;
  using mview = tensor_view<C, Sp>;
  for (std::size_t d = 0; d < k; ++d) {
    const std::int64_t m = n[d];
    const auto nn = static_cast<std::size_t>(m);
    C* x = out + off[d];
    auto& w = ws(m);
    const C* s = detail::linalg::host_copy(ex, stats + off[d], nn * nn, w.e.ha);  // host memory
    for (std::size_t i = 0; i < nn * nn; ++i)
      if (!std::isfinite(double(s[i]))) return {root_status::nonfinite_input, d};
    if (rc.method == shampoo_eigenbasis::eigh) {
      bool ok = eigh_basis<C>(la, ex, s, m, bias, rc.epsilon, w.e, x);
      if (!ok && std::is_same_v<C, float> && rc.retry_in_double)
        ok = eigh_basis<double>(la, ex, s, m, bias, rc.epsilon, w.d, x);
      if (!ok) return {root_status::eigensolver_failed, d};
    } else {
      if constexpr (qr_linalg_backend<L>) {  // init checks it
        auto& q = w.qr;
        q.reserve(la, ex, m);
        const C* p = prev + off[d];
        // A (staged in host memory, into r), then t = A·Q, B = Qᵀ·t.
        C* ha = q.r.data();
        if constexpr (!std::is_same_v<Sp, host_space>) {
          q.ha.resize(nn * nn);
          ha = q.ha.data();
        }
        for (std::size_t i = 0; i < nn * nn; ++i) ha[i] = C(double(s[i]) / bias);
        for (std::size_t i = 0; i < nn; ++i) ha[i * nn + i] += C(rc.epsilon);
        detail::linalg::from_host(ex, static_cast<const C*>(ha), q.r.data(), nn * nn);
        la.gemm(transpose::none, transpose::none, 1.0, cview(q.r.data(), {m, m}), cview(p, {m, m}), 0.0,
                mview(q.t.data(), {m, m}));
        la.gemm(transpose::yes, transpose::none, 1.0, cview(p, {m, m}), cview(q.t.data(), {m, m}), 0.0,
                mview(q.b.data(), {m, m}));
        ex.apply(gradapt::detail::copy_to{}, mview::vector(q.acc.data(), m * m), cview::vector(p, m * m));
        const C* hb = nullptr;
        for (std::uint32_t it = 0; it < rc.iterations; ++it) {
          hb = detail::linalg::host_copy(ex, static_cast<const C*>(q.b.data()), nn * nn, q.hb);
          double all = 0, diag = 0;
          for (std::size_t i = 0; i < nn * nn; ++i) all += double(hb[i]) * double(hb[i]);
          for (std::size_t i = 0; i < nn; ++i) diag += double(hb[i * nn + i]) * double(hb[i * nn + i]);
          if (std::sqrt(std::max(all - diag, 0.0)) <= rc.tolerance * std::sqrt(all)) break;
          la.qr(cview(q.b.data(), {m, m}), mview(q.q.data(), {m, m}), mview(q.r.data(), {m, m}), q.work);
          la.gemm(transpose::none, transpose::none, 1.0, cview(q.r.data(), {m, m}), cview(q.q.data(), {m, m}),
                  0.0, mview(q.b.data(), {m, m}));
          la.gemm(transpose::none, transpose::none, 1.0, cview(q.acc.data(), {m, m}),
                  cview(q.q.data(), {m, m}), 0.0, mview(q.t.data(), {m, m}));
          std::swap(q.acc, q.t);
        }
        hb = detail::linalg::host_copy(ex, static_cast<const C*>(q.b.data()), nn * nn, q.hb);
        for (std::size_t i = 0; i < nn; ++i) q.perm[i] = i;
        std::stable_sort(q.perm.begin(), q.perm.end(),
                         [&](std::size_t a, std::size_t b) { return hb[a * nn + a] < hb[b * nn + b]; });
        bool identity = true;
        for (std::size_t i = 0; i < nn; ++i) identity = identity && q.perm[i] == i;
        if (identity) {
          ex.apply(gradapt::detail::copy_to{}, mview::vector(x, m * m), cview::vector(q.acc.data(), m * m));
        } else {
          // The columns reordered as one product with the permutation matrix P (exact: one
          // product by 1 per entry, the rest adds zeros).
          q.hp.assign(nn * nn, C(0));
          for (std::size_t c = 0; c < nn; ++c) q.hp[q.perm[c] * nn + c] = C(1);
          detail::linalg::from_host(ex, static_cast<const C*>(q.hp.data()), q.pm.data(), nn * nn);
          la.gemm(transpose::none, transpose::none, 1.0, cview(q.acc.data(), {m, m}),
                  cview(q.pm.data(), {m, m}), 0.0, mview(x, {m, m}));
        }
      } else {
        (void)prev;
        return {root_status::eigensolver_failed, d};  // init rejects a backend without qr
      }
    }
    if (ex.reduce(reduction::count_nonfinite, cview::vector(x, m * m)) != 0)
      return {root_status::nonfinite_result, d};
  }
  return {root_status::ok, 0};
}

/// A block's roots: factor d of the block is an n[d] × n[d] matrix at offset off[d] of both
/// `stats` and `out` (L's memory), with exponent p[d] (0: not preconditioned, `out` gets the
/// identity, staged through `hbuf` on a device). The statistics are divided by `bias` (1: as
/// they are) into `out`, whose root is taken there. The element work runs on `ex` (the memory's
/// element backend); the eigen method's checks read a host copy of each factor. Computes them
/// in order and stops at the first failure; returns its status and factor (`out` then holds the
/// factors before it). `ws(n)` is the root workspace for size n.
template <class L, class Ex, class C, class Ws>
std::pair<root_status, std::size_t> block_roots(const L& la, const Ex& ex, std::size_t k, const int* p,
                                                const std::int64_t* n, const std::size_t* off, const C* stats,
                                                C* out, Ws&& ws, const root_recipe& rc, double bias,
                                                std::vector<C>& hbuf) {
  using Sp = typename L::space;
  for (std::size_t d = 0; d < k; ++d) {
    const auto nn = static_cast<std::size_t>(n[d] * n[d]);
    C* x = out + off[d];
    if (p[d] == 0) {
      C* h = x;
      if constexpr (!std::is_same_v<Sp, host_space>) {
        hbuf.resize(nn);
        h = hbuf.data();
      }
      std::fill(h, h + nn, C(0));
      for (std::int64_t i = 0; i < n[d]; ++i) h[i * n[d] + i] = C(1);
      detail::linalg::from_host(ex, h, x, nn);
      continue;
    }
    const C* a = stats + off[d];
    const auto len = static_cast<std::int64_t>(nn);
    if (bias != 1.0) {
      ex.apply(divided_by<C>{C(bias)}, tensor_view<C, Sp>::vector(x, len),
               tensor_view<const C, Sp>::vector(a, len));
      a = x;
    }
    auto& w = ws(n[d]);
    if (rc.root.method == root_method::eigen) {
      const C* ha = detail::linalg::host_copy(ex, a, nn, w.e.ha);
      if (!detail::linalg::all_finite(ha, nn)) return {root_status::nonfinite_input, d};
      if (rc.spectrum == shampoo_spectrum::clamp &&
          !detail::linalg::symmetric(ha, static_cast<std::size_t>(n[d])))
        return {root_status::not_symmetric, d};
      auto status = eigen_root_in<C>(la, ex, ha, n[d], p[d], rc.root, rc.spectrum, w.e, x);
      if constexpr (std::is_same_v<C, float>)
        if (status == root_status::eigensolver_failed && rc.root.retry_in_double)
          status = eigen_root_in<double>(la, ex, ha, n[d], p[d], rc.root, rc.spectrum, w.d, x);
      if (status != root_status::ok) return {status, d};
      continue;
    }
    if constexpr (std::is_same_v<Sp, host_space>) {  // coupled Newton: host memory (init checks it)
      const auto r = inverse_pth_root(la, tensor_view<const C, host_space>(a, {n[d], n[d]}), p[d],
                                      tensor_view<C, host_space>(x, {n[d], n[d]}), w.base, rc.root);
      if (!r.ok()) return {r.status, d};
    } else {
      detail::fail("shampoo: internal error: root.method coupled_newton on device memory");
    }
  }
  return {root_status::ok, 0};
}

/// One block's roots for the worker thread: from `in` (a copy of the statistics) into `out`.
template <class C>
struct root_task {
  std::size_t block = 0;  ///< the block's index in the state's list of preconditioned blocks
  std::size_t k = 0;
  const int* p = nullptr;
  double bias = 1.0;
  const std::int64_t* n = nullptr;
  const std::size_t* off = nullptr;
  const C* in = nullptr;
  C* out = nullptr;
  root_status status = root_status::ok;
  std::size_t factor = 0;
};

/// A background host thread that computes roots (shampoo_options::root_staleness >= 1) with
/// linear-algebra backend L and element backend Ex: gradapt::host on one thread for host
/// memory; on a device, a `stream_linalg_backend` and its `elements` (a second stream), the
/// thread entering L's device first and waiting for that stream before a task list counts as
/// done. The step hands it a list of tasks whose buffers stay untouched by the step until
/// `wait` returns; the thread owns the root workspaces while it runs. Created at `init`, joined
/// by the destructor (after the task list in flight, if any, is done).
template <class L, class C, class Ex = host>
class root_worker {
 public:
  using workspace_t = root_workspace<L, C, Ex>;
  root_worker(const L& la, const Ex& ex, const root_recipe& o,
              std::vector<std::pair<std::int64_t, workspace_t*>> ws)
      : la_(la), ex_(ex), o_(o), ws_(std::move(ws)), thread_([this] { run(); }) {}
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
          if constexpr (!std::is_same_v<typename L::space, host_space>) {
            if (!entered_) la_.enter_thread();
            entered_ = true;
          }
          for (auto& t : tasks) {
            const auto [status, factor] = block_roots(
                la_, ex_, t.k, t.p, t.n, t.off, t.in, t.out,
                [&](std::int64_t n) -> workspace_t& { return find(n); }, o_, t.bias, hbuf_);
            t.status = status;
            t.factor = factor;
          }
          ex_.synchronize();  // every root written before the step reads them
        } catch (...) {
          err = std::current_exception();
          try {  // nothing of the list still runs on the stream once the step sees the error
            ex_.synchronize();
          } catch (...) {
          }
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
  Ex ex_;
  bool entered_ = false;  // enter_thread called (device memory)
  root_recipe o_;
  std::vector<C> hbuf_;  // block_roots' device staging (unused in host memory)
  std::vector<std::pair<std::int64_t, workspace_t*>> ws_;
  std::mutex m_;
  std::condition_variable cv_;
  std::span<root_task<C>> tasks_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started after every other member exists
};

}  // namespace gradapt::detail::shampoo_impl

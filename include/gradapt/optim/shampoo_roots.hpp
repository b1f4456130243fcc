#pragma once
/// @file
/// `gradapt::shampoo`'s root computations in a step: inside the step (root_staleness 0) or
/// started in the state's worker thread (on a device, on `root_linalg`'s stream) and installed
/// `root_staleness` steps later, and the installation of a block's roots or the count of its
/// failures.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <type_traits>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/linalg/matrix_root.hpp"

#include "gradapt/optim/shampoo.hpp"

namespace gradapt {

/// Starts the worker on this rank's blocks (with a communicator, the blocks it owns), from the
/// statistics copied into `snap` (with a communicator in device memory, also into the blocks'
/// host copies, which the hash reads). On a device it first waits for the step's stream: the
/// copies (or a `load`'s) are done before the worker's stream reads them.
template <class L>
template <class St, class Ex>
void transform::scale_by_shampoo<L>::launch(St& st, const Ex& ex, bool dist) const {
  st.relaunch_ = false;
  st.tasks_.clear();
  const double bias = root_bias(st.pending_step_);
  for (std::size_t i = 0; i < st.refs_.size(); ++i) {
    if (!owns(st, i, dist)) continue;
    auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
    st.tasks_.push_back(
        {i, bl.k, bl.p.data(), bias, bl.n.data(), bl.off.data(), st.snap_at(bl), st.pend_at(bl)});
  }
  try {
    if constexpr (!St::on_host) {
      if (dist) to_host(ex, st, true);  // waits for the stream
      ex.synchronize();
    }
    st.pending_hash_ = dist ? stats_hash(st, true) : 0;
    st.worker_->start(std::span(st.tasks_));
  } catch (...) {
    st.pending_step_ = 0;  // nothing in flight
    throw;
  }
  st.computed_ += st.tasks_.size();
}

/// Waits for the roots in flight and installs them (through the exchange when distributed: a
/// rank whose worker threw passes its message to the exchange, so every rank throws).
template <class L>
template <class Comm, class Ex, class St>
void transform::scale_by_shampoo<L>::finish_roots(Comm& comm, const Ex& ex, St& st) {
  constexpr bool dist = !std::is_same_v<Comm, gradapt::detail::optim::no_comm>;
  using C = typename St::compute_type;
  const std::uint64_t from = st.pending_step_;
  st.pending_step_ = 0;
  std::string local;
  try {
    st.worker_->wait();
    for (const auto& task : st.tasks_) {
      const std::size_t i = task.block;
      auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
      if constexpr (dist) {
        if (!owns(st, i, dist)) continue;  // launched without the communicator
        const auto n = static_cast<std::int64_t>(bl.roots.size());
        ex.apply(gradapt::detail::copy_to{},
                 tensor_view<C, typename L::space>::vector(exchange_out(st, i), n),
                 tensor_view<const C, typename L::space>::vector(st.pend_at(bl), n));
        exchange_status(st, i, task.status, task.factor);
      } else {
        install(st, ex, i, task.status, task.factor, static_cast<const C*>(st.pend_at(bl)), -1, from);
      }
    }
  } catch (const std::exception& e) {
    if constexpr (!dist) throw;
    local = e.what();
  }
  if constexpr (dist) exchange(comm, ex, st, from, st.pending_hash_, local);
}

/// Device memory: every block's statistics (or their copies for the worker) copied into the
/// blocks' host copies, which the statistics' hash reads (O(Σ n²) words).
template <class L>
template <class Ex, class St>
void transform::scale_by_shampoo<L>::to_host(const Ex& ex, St& st, bool snapshot) {
  using C = typename St::compute_type;
  for (const auto& r : st.refs_) {
    auto& bl = st.t_[r.t].blocks[r.j];
    auto& h = snapshot ? bl.snap : bl.stats;
    const auto n = static_cast<std::int64_t>(h.size());
    ex.copy(tensor_view<const C, typename L::space>::vector(snapshot ? st.snap_at(bl) : st.stats_at(bl), n),
            tensor_view<C, host_space>::vector(h.data(), n));
  }
}

/// Computes the due roots inside the step (root_staleness 0). With a communicator, each rank
/// computes its blocks and the exchange gives every rank all of them (in device memory the
/// hash of the statistics reads their host copies, made here).
template <class L>
template <class Comm, class Ex, class St>
void transform::scale_by_shampoo<L>::compute_roots(Comm& comm, const Ex& ex, St& st, std::uint64_t t) const {
  constexpr bool dist = !std::is_same_v<Comm, gradapt::detail::optim::no_comm>;
  using C = typename St::compute_type;
  const auto ws = [&](std::int64_t n) -> typename St::workspace_t& { return st.workspace(n); };
  const auto rc = recipe();
  const double bias = root_bias(t);
  std::string local;  // with a communicator, this rank's failure travels through the exchange
  try {
    if constexpr (dist && !St::on_host) to_host(ex, st, false);
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      if (!owns(st, i, dist)) continue;
      auto& bl = st.t_[st.refs_[i].t].blocks[st.refs_[i].j];
      ++st.computed_;
      // Eigenvalue-corrected Shampoo's "roots" are the factors' eigenbases (the QR refresh starts
      // from the installed ones, which every rank holds).
      const auto compute = [&](C* out) {
        if (options.preconditioner == shampoo_preconditioner::eigenvalue_corrected)
          return gradapt::detail::shampoo_impl::block_eigenbases(st.la_, ex, bl.k, bl.n.data(), bl.off.data(),
                                                                 st.stats_at(bl), st.roots_at(bl), out, ws,
                                                                 basis_recipe(), bias);
        return gradapt::detail::shampoo_impl::block_roots(st.la_, ex, bl.k, bl.p.data(), bl.n.data(),
                                                          bl.off.data(), st.stats_at(bl), out, ws, rc, bias,
                                                          st.hbuf_);
      };
      if constexpr (dist) {
        const auto [status, factor] = compute(exchange_out(st, i));
        exchange_status(st, i, status, factor);
      } else {
        const auto [status, factor] = compute(st.rs_.data());
        install(st, ex, i, status, factor, st.rs_.data(), -1, t);
      }
    }
  } catch (const std::exception& e) {
    if constexpr (!dist) throw;
    local = e.what();
  }
  if constexpr (dist) exchange(comm, ex, st, t, local.empty() ? stats_hash(st, false) : 0, local);
}

/// Installs block i's roots (or counts its failure and reports it in the step's report; throws
/// after max_consecutive_failures in a row). `rank` names the rank that computed them (-1: this
/// one, not distributed); `from` is the step whose statistics they come from.
template <class L>
template <class St, class Ex, class C>
void transform::scale_by_shampoo<L>::install(St& st, const Ex& ex, std::size_t i, root_status status,
                                             std::size_t factor, const C* roots, int rank,
                                             std::uint64_t from) {
  const auto& ref = st.refs_[i];
  auto& x = st.t_[ref.t];
  auto& bl = x.blocks[ref.j];
  if (status == root_status::ok) {
    ++st.installed_;
    if constexpr (St::on_host) {
      (void)ex;
      std::copy(roots, roots + bl.roots.size(), bl.roots.begin());
    } else {
      const auto n = static_cast<std::int64_t>(bl.roots.size());
      ex.apply(gradapt::detail::copy_to{}, tensor_view<C, typename L::space>::vector(st.roots_at(bl), n),
               tensor_view<const C, typename L::space>::vector(roots, n));
    }
    bl.ready = true;
    bl.mrot_valid = false;  // eigenvalue-corrected: Qᵀ M Q is rebuilt in the new bases
    bl.consecutive = 0;
    return;
  }
  ++bl.failures;
  ++bl.consecutive;
  st.report_.push_back(
      {i, ref.t, x.first_block + ref.j, factor, status, bl.consecutive, bl.failures, rank, from});
  if (bl.consecutive < st.max_failures_) return;
  st.failed_ = true;
  const auto& range = x.layout.blocks[ref.j];
  std::string where;
  for (std::size_t d = 0; d < bl.k; ++d)
    where += (d ? ", " : "") + std::to_string(range.offset[d]) + ".." +
             std::to_string(range.offset[d] + range.size[d]);
  gradapt::detail::fail(
      "shampoo::step: parameter '", x.name, "' block ", x.first_block + ref.j, " (indices [", where,
      "] of its merged shape): the ",
      st.preconditioner_ == shampoo_preconditioner::eigenvalue_corrected ? "eigenbasis refresh"
                                                                         : "inverse root",
      " failed ", bl.consecutive, " times in a row (last: factor ", factor, ", ", to_string(status),
      rank >= 0 ? ", computed on rank " + std::to_string(rank) : "",
      "); a non-finite gradient makes the statistics non-finite for good. The parameters are "
      "unchanged; restore a checkpoint with load() (and skip non-finite gradients, e.g. with the "
      "loss scaler), or raise root.epsilon / max_consecutive_failures");
}

}  // namespace gradapt

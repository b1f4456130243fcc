#pragma once
/// @file
/// `gradapt::shampoo`'s distributed roots: the plan of which rank computes which block's roots
/// (lpt_assign over the blocks' costs, agreed across ranks once per world), and the owner
/// exchange that allgathers the roots and installs every block from its owner's chunk (in host
/// or device memory).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/linalg/matrix_root.hpp"

#include "gradapt/optim/shampoo.hpp"

namespace gradapt {

/// The distributed plan for `comm`'s world (agreed through backend `b`'s memory): owners by lpt_assign over
/// the blocks' costs, each block's place in its owner's chunk; agreed across ranks once per world, with every
/// option that shapes the result (a one-rank difference is a gradapt::error on every rank naming the option
/// and both values; the step's lr is agreed at every exchange, see shampoo.hpp).
template <class L>
std::array<agreed_value, 33> transform::scale_by_shampoo<L>::agreed_values() const {
  std::uint64_t exps = 0xCBF29CE484222325ull;  // the exponent entries, in order
  for (const auto& e : options.inverse_exponents) {
    const std::int64_t w[3] = {static_cast<std::int64_t>(e.order), e.dimension, e.p};
    exps = gradapt::detail::hash_bytes(exps, w, 3);
  }
  const auto& o = options;
  return {{
      {"shampoo root_staleness", static_cast<double>(o.root_staleness)},
      {"shampoo statistics_frequency", static_cast<double>(o.statistics_frequency)},
      {"shampoo precondition_frequency", static_cast<double>(o.precondition_frequency)},
      {"shampoo start_preconditioning_step", static_cast<double>(o.start_preconditioning_step)},
      {"shampoo max_consecutive_failures", static_cast<double>(o.max_consecutive_failures)},
      {"shampoo root.method", static_cast<double>(o.root.method)},
      {"shampoo root.epsilon", o.root.epsilon},
      {"shampoo inverse_exponent_override", static_cast<double>(o.inverse_exponent_override)},
      {"shampoo inverse_exponents (hash)", static_cast<double>(exps >> 16)},
      {"shampoo root.ridge", static_cast<double>(o.root.ridge)},
      {"shampoo root.tolerance", o.root.tolerance},
      {"shampoo root.max_iterations", static_cast<double>(o.root.max_iterations)},
      {"shampoo root.max_error", o.root.max_error},
      {"shampoo spectrum", static_cast<double>(o.spectrum)},
      {"shampoo beta2", o.beta2},
      {"shampoo beta1", o.beta1},
      {"shampoo bias_correction", o.bias_correction ? 1.0 : 0.0},
      {"shampoo graft", static_cast<double>(o.graft)},
      {"shampoo graft_beta2", o.graft_beta2},
      {"shampoo graft_epsilon", o.graft_epsilon},
      {"shampoo max_preconditioner_dim", static_cast<double>(o.max_preconditioner_dim)},
      {"shampoo preconditioner", static_cast<double>(o.preconditioner)},
      {"shampoo newton_schulz.steps", static_cast<double>(o.newton_schulz.steps)},
      {"shampoo newton_schulz.a", o.newton_schulz.a},
      {"shampoo newton_schulz.b", o.newton_schulz.b},
      {"shampoo newton_schulz.c", o.newton_schulz.c},
      {"shampoo newton_schulz.epsilon", o.newton_schulz.epsilon},
      {"shampoo scale_by_aspect", o.scale_by_aspect ? 1.0 : 0.0},
      {"shampoo eigenbasis", static_cast<double>(o.eigenbasis)},
      {"shampoo qr_iterations", static_cast<double>(o.qr_iterations)},
      {"shampoo qr_tolerance", o.qr_tolerance},
      {"shampoo corrected_exponent", o.corrected_exponent},
      {"shampoo graft_preconditioned", o.graft_preconditioned ? 1.0 : 0.0},
  }};
}

/// The distributed plan for `comm`'s world (agreed through backend `b`'s memory): owners by lpt_assign over
/// the blocks' costs, each block's place in its owner's chunk; agreed across ranks once per world, with every
/// option that shapes the result and the chain's later stages' options (`extra`; a one-rank difference is a
/// gradapt::error on every rank naming the option and both values; the step's lr is agreed at every exchange,
/// see shampoo.hpp).
template <class L>
template <class Comm, class B, class St, class Extra>
void transform::scale_by_shampoo<L>::plan(Comm& comm, const B& b, St& st, const Extra& extra) const {
  const int n = comm.size(), me = comm.rank();
  if (st.x_.planned_for(n, me)) return;
  std::uint64_t words = 0, shape_hash = 0x84222325CBF29CE4ull;
  std::vector<std::uint64_t> cost(st.refs_.size());
  std::vector<std::size_t> size(st.refs_.size());
  for (std::size_t i = 0; i < st.refs_.size(); ++i) {
    const auto& r = st.refs_[i];
    const auto& bl = st.t_[r.t].blocks[r.j];
    cost[i] = r.cost;
    size[i] = 2 + r.words;  // status, failing factor, roots
    words += r.words;
    shape_hash = gradapt::detail::hash_bytes(shape_hash, bl.n.data(), bl.k);
  }
  std::vector<agreed_value> values{
      {"preconditioned blocks", static_cast<double>(st.refs_.size())},
      {"root elements", static_cast<double>(words)},
      {"block shapes (hash)", static_cast<double>(shape_hash >> 16)},
      {"steps taken", static_cast<double>(st.steps_)},
      {"roots in flight (starting step)", static_cast<double>(st.pending_step_)},
  };
  for (const auto& v : agreed_values()) values.push_back(v);
  struct pusher {
    std::vector<agreed_value>* out;
    void push(std::string_view name, double v) const { out->push_back({name, v}); }
  } later{&values};
  extra.push_options(later);
  agree_values(comm, b, "shampoo::step (distributed roots)", std::span<const agreed_value>(values));
  if (st.pending_step_ != 0 && !st.relaunch_) {  // roots in flight under the old plan
    st.worker_->discard();
    st.relaunch_ = true;
  }
  st.x_.plan(cost, size, n, me, St::on_host);
  if constexpr (!St::on_host) {  // the chunks in device memory, the statuses through the agreement
    using C = typename St::compute_type;
    st.dxsend_ = b.template allocate<C>(st.x_.chunk);
    st.dxrecv_ = b.template allocate<C>(st.x_.chunk * static_cast<std::size_t>(n));
    st.xstat_.assign(2 * st.x_.most, 0.0);
    st.xall_.assign(2 * st.x_.most * static_cast<std::size_t>(n), 0.0);
  }
}

template <class L>
template <class St>
bool transform::scale_by_shampoo<L>::owns(const St& st, std::size_t i, bool dist) {
  return !dist || st.x_.owns(i);
}

/// The hash of every block's statistics (or of their copies for the worker).
template <class L>
template <class St>
std::uint64_t transform::scale_by_shampoo<L>::stats_hash(const St& st, bool snapshot) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& r : st.refs_) {
    const auto& bl = st.t_[r.t].blocks[r.j];
    const auto& v = snapshot ? bl.snap : bl.stats;
    h = gradapt::detail::hash_bytes(h, v.data(), v.size());
  }
  return h;
}

/// Where this rank writes block i's roots for the exchange: in its chunk after the block's
/// status words (the device chunk's stay unused).
template <class L>
template <class St>
typename St::compute_type* transform::scale_by_shampoo<L>::exchange_out(St& st, std::size_t i) {
  if constexpr (St::on_host)
    return st.x_.out(i) + 2;
  else
    return st.dxsend_.data() + st.x_.pos[i] + 2;
}

/// Records block i's root status and failing factor for the exchange.
template <class L>
template <class St>
void transform::scale_by_shampoo<L>::exchange_status(St& st, std::size_t i, root_status status,
                                                     std::size_t factor) {
  if constexpr (St::on_host) {
    auto* w = st.x_.out(i);
    w[0] = static_cast<typename St::compute_type>(static_cast<int>(status));
    w[1] = static_cast<typename St::compute_type>(factor);
  } else {
    st.xstat_[2 * st.x_.slot[i]] = static_cast<double>(static_cast<int>(status));
    st.xstat_[2 * st.x_.slot[i] + 1] = static_cast<double>(factor);
  }
}

/// Allgathers every rank's chunk (header, then per owned block its status, failing factor and
/// roots), checks the headers agree, and installs every block from its owner's chunk. A rank
/// whose roots threw passes the message as `local_error`: it throws it, every other rank throws
/// naming that rank, and the state stops until `load`. In
/// device memory the header's step and hash and the statuses travel in one agreement (staged
/// through `ex`, every rank throwing on a difference), the roots in one allgather of the device
/// chunks, and the installs are copies on `ex`'s stream.
template <class L>
template <class Comm, class Ex, class St>
void transform::scale_by_shampoo<L>::exchange(Comm& comm, const Ex& ex, St& st, std::uint64_t step,
                                              std::uint64_t hash, const std::string& local_error) {
  using C = typename St::compute_type;
  if constexpr (!St::on_host) {
    using Sp = typename L::space;
    const agreed_value at[] = {{"step", static_cast<double>(step)},
                               {"statistics (hash)", static_cast<double>(hash >> 16)}};
    try {
      agree_values_and_share(comm, ex, "shampoo::step (the roots' exchange)",
                             std::span<const agreed_value>(at), std::span<const double>(st.xstat_),
                             std::span<double>(st.xall_), local_error, &st.xwork_);
    } catch (const error&) {
      st.failed_ = true;  // every later step throws until load()
      throw;
    }
    const auto len = static_cast<std::int64_t>(st.x_.chunk);
    comm.allgather(tensor_view<const C, Sp>::vector(st.dxsend_.data(), len),
                   tensor_view<C, Sp>::vector(st.dxrecv_.data(), len * st.x_.world));
    const std::size_t k = 2 * st.x_.most;
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      const auto r = static_cast<std::size_t>(st.x_.owner[i]);
      const double* w = st.xall_.data() + r * k + 2 * st.x_.slot[i];
      const auto code = static_cast<int>(w[0]);
      gradapt::detail::require(code >= 0 && code <= static_cast<int>(root_status::nonfinite_result),
                               "shampoo::step: internal error: root status ", code, " from rank ", r);
      install(st, ex, i, static_cast<root_status>(code), static_cast<std::size_t>(w[1]),
              static_cast<const C*>(st.dxrecv_.data() + r * st.x_.chunk + st.x_.pos[i] + 2), st.x_.owner[i],
              step);
    }
  } else {
    int differs = -1;
    try {
      differs = st.x_.run(comm, step, hash, "shampoo::step", local_error);
    } catch (const error&) {
      st.failed_ = true;  // a rank could not compute its roots: every later step throws until load()
      throw;
    }
    if (differs >= 0) {
      st.failed_ = true;
      gradapt::detail::fail(
          "shampoo::step on rank ", st.x_.rank, ": the statistics of rank ", differs,
          " differ from rank 0's at step ", step,
          " (every rank must pass the same averaged gradients); restore a checkpoint with load()");
    }
    for (std::size_t i = 0; i < st.refs_.size(); ++i) {
      const auto* c = st.x_.in(i);
      const auto code = static_cast<int>(c[0]);
      gradapt::detail::require(code >= 0 && code <= static_cast<int>(root_status::nonfinite_result),
                               "shampoo::step: internal error: root status ", code, " from rank ",
                               st.x_.owner[i]);
      install(st, ex, i, static_cast<root_status>(code), static_cast<std::size_t>(c[1]), c + 2,
              st.x_.owner[i], step);
    }
  }
}

}  // namespace gradapt

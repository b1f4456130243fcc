#pragma once
/// @file
/// `gradapt::shampoo`'s distributed roots: the plan of which rank computes which block's roots
/// (lpt_assign over the blocks' costs, agreed across ranks once per world), and the owner
/// exchange that allgathers the roots and installs every block from its owner's chunk.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/owner_exchange.hpp"
#include "gradapt/linalg/matrix_root.hpp"

#include "gradapt/optim/shampoo.hpp"

namespace gradapt {

/// The distributed plan for `comm`'s world: owners by lpt_assign over the blocks' costs, each
/// block's place in its owner's chunk; agreed across ranks once per world, with every option
/// that shapes the result (a one-rank difference is a gradapt::error on every rank naming the
/// option and both values; the step's lr is agreed at every exchange, see shampoo.hpp).
template <class Comm, class St>
void shampoo::plan(Comm& comm, St& st) const {
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
    shape_hash = detail::hash_bytes(shape_hash, bl.n.data(), bl.k);
  }
  std::uint64_t exps = 0xCBF29CE484222325ull;  // the exponent entries, in order
  for (const auto& e : o_.inverse_exponents) {
    const std::int64_t w[3] = {static_cast<std::int64_t>(e.order), e.dimension, e.p};
    exps = detail::hash_bytes(exps, w, 3);
  }
  const agreed_value values[] = {
      {"preconditioned blocks", static_cast<double>(st.refs_.size())},
      {"root elements", static_cast<double>(words)},
      {"block shapes (hash)", static_cast<double>(shape_hash >> 16)},
      {"steps taken", static_cast<double>(st.steps_)},
      {"roots in flight (starting step)", static_cast<double>(st.pending_step_)},
      {"root_staleness", static_cast<double>(o_.root_staleness)},
      {"statistics_frequency", static_cast<double>(o_.statistics_frequency)},
      {"precondition_frequency", static_cast<double>(o_.precondition_frequency)},
      {"start_preconditioning_step", static_cast<double>(o_.start_preconditioning_step)},
      {"max_consecutive_failures", static_cast<double>(o_.max_consecutive_failures)},
      {"root.method", static_cast<double>(o_.root.method)},
      {"root.epsilon", o_.root.epsilon},
      {"inverse_exponent_override", static_cast<double>(o_.inverse_exponent_override)},
      {"inverse_exponents (hash)", static_cast<double>(exps >> 16)},
      {"root.ridge", static_cast<double>(o_.root.ridge)},
      {"root.tolerance", o_.root.tolerance},
      {"root.max_iterations", static_cast<double>(o_.root.max_iterations)},
      {"root.max_error", o_.root.max_error},
      {"spectrum", static_cast<double>(o_.spectrum)},
      {"beta2", o_.beta2},
      {"beta1", o_.beta1},
      {"bias_correction", o_.bias_correction ? 1.0 : 0.0},
      {"graft", static_cast<double>(o_.graft)},
      {"graft_beta2", o_.graft_beta2},
      {"graft_epsilon", o_.graft_epsilon},
      {"momentum", o_.momentum},
      {"nesterov", o_.nesterov ? 1.0 : 0.0},
      {"weight_decay", o_.weight_decay},
      {"lr", o_.lr},
  };
  agree_values(comm, "shampoo::step (distributed roots)", std::span<const agreed_value>(values));
  if (st.pending_step_ != 0 && !st.relaunch_) {  // roots in flight under the old plan
    st.worker_->discard();
    st.relaunch_ = true;
  }
  st.x_.plan(cost, size, n, me);
}

template <class St>
bool shampoo::owns(const St& st, std::size_t i, bool dist) {
  return !dist || st.x_.owns(i);
}

/// The hash of every block's statistics (or of their copies for the worker).
template <class St>
std::uint64_t shampoo::stats_hash(const St& st, bool snapshot) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (const auto& r : st.refs_) {
    const auto& bl = st.t_[r.t].blocks[r.j];
    const auto& v = snapshot ? bl.snap : bl.stats;
    h = detail::hash_bytes(h, v.data(), v.size());
  }
  return h;
}

/// Allgathers every rank's chunk (header, then per owned block its status, failing factor and
/// roots), checks the headers agree, and installs every block from its owner's chunk.
template <class Comm, class St>
void shampoo::exchange(Comm& comm, St& st, std::uint64_t step, std::uint64_t hash) {
  const int differs = st.x_.run(comm, step, hash, "shampoo::step");
  if (differs >= 0) {
    st.failed_ = true;
    detail::fail("shampoo::step on rank ", st.x_.rank, ": the statistics of rank ", differs,
                 " differ from rank 0's at step ", step,
                 " (every rank must pass the same averaged gradients); restore a checkpoint with load()");
  }
  for (std::size_t i = 0; i < st.refs_.size(); ++i) {
    const auto* c = st.x_.in(i);
    const auto code = static_cast<int>(c[0]);
    detail::require(code >= 0 && code <= static_cast<int>(root_status::nonfinite_result),
                    "shampoo::step: internal error: root status ", code, " from rank ", st.x_.owner[i]);
    install(st, i, static_cast<root_status>(code), static_cast<std::size_t>(c[1]), c + 2, st.x_.owner[i],
            step);
  }
}

}  // namespace gradapt

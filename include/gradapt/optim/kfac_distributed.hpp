#pragma once
/// @file
/// `gradapt::kfac`'s distributed plan: whether a state's plan fits a communicator, the
/// assignment of each layer's decomposition to a rank (`lpt_assign`), its group of grad workers,
/// the communicators of a hybrid plan, the two exchanges, and the agreement of the layers and
/// options across ranks.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/assign.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

#include "gradapt/optim/kfac.hpp"

namespace gradapt {

template <class Comm, class St>
bool kfac::planned(const Comm& comm, const St& st) const {
  if (st.world_ != comm.size() || st.rank_ != comm.rank() || st.group_ != grad_workers(comm.size()))
    return false;
  if (st.group_ == 1 || st.group_ == st.world_) return true;
  return st.comms_ && st.comms_->tag == &detail::kfac_comms_tag<Comm>;
}
template <class Comm, class St>
Comm* kfac::group_comm(Comm& comm, St& st) {
  if (st.group_ == st.world_) return &comm;
  return &static_cast<detail::kfac_comms<Comm>&>(*st.comms_).group;
}
template <class Comm, class St>
Comm* kfac::receivers(Comm& comm, St& st) {
  if (st.group_ == 1) return &comm;
  return &static_cast<detail::kfac_comms<Comm>&>(*st.comms_).receivers;
}

/// The plan for n ranks and grad-worker groups of g: owners, what this rank holds, the two
/// exchanges. Returns per layer 1 where this rank must hold a decomposition it lacks.
template <class St>
std::vector<double> kfac::layout(St& st, int n, int me, int g) {
  const std::size_t count = st.l_.size();
  if (n == 1 || !St::on_host) {
    st.owner_.assign(count, me);  // device memory: every rank decomposes every layer
  } else {
    std::vector<std::uint64_t> cost(count);
    for (std::size_t i = 0; i < count; ++i) {
      const auto na = static_cast<std::uint64_t>(st.l_[i].n),
                 ng = static_cast<std::uint64_t>(st.l_[i].spec.out);
      cost[i] = na * na * na + ng * ng * ng;
    }
    st.owner_ = lpt_assign(std::span<const std::uint64_t>(cost), n);
  }
  std::vector<double> missing(count, 0.0);
  std::vector<int> in_group(count, -1), across(count, -1);
  std::vector<std::size_t> dec_words(count), v_words(count);
  for (std::size_t i = 0; i < count; ++i) {
    auto& x = st.l_[i];
    const int o = st.owner_[i];
    x.held = me / g == o / g;
    using D = std::remove_cvref_t<decltype(*x.dec.data())>;
    if (!x.held) {
      x.dec = {};
      x.have = false;
    } else if (x.dec.size() != st.dec_size(x)) {
      x.dec = st.ex_.template allocate<D>(st.dec_size(x));
      x.have = false;
    }
    const auto v = static_cast<std::size_t>(x.spec.out * x.n);
    if (g == n) {
      if (x.v.size() != v) x.v = st.ex_.template allocate<D>(v);
    } else {
      x.v = {};
    }
    if (x.held && x.ready && !x.have) missing[i] = 1;
    in_group[i] = x.held ? o % g : -1;
    across[i] = o / g;
    dec_words[i] = 1 + st.dec_size(x);
    v_words[i] = 1 + v;
  }
  if (g > 1 && St::on_host)
    st.xd_.plan_owners(std::move(in_group), dec_words, g, me % g);
  else
    st.xd_.clear();
  if (g < n)
    st.xv_.plan_owners(std::move(across), v_words, n / g, me / g);
  else
    st.xv_.clear();
  st.world_ = n;
  st.rank_ = me;
  st.group_ = g;
  return missing;
}

template <class Comm, class St>
void kfac::plan(Comm& comm, St& st) const {
  using D = std::remove_cvref_t<decltype(*st.m_.data())>;
  using C = std::remove_cvref_t<decltype(*st.terms_.data())>;
  const int n = comm.size(), me = comm.rank();
  std::uint64_t h = 0x84222325CBF29CE4ull;
  for (const auto& x : st.l_) {
    const std::int64_t sh[3] = {x.spec.in, x.spec.out, x.spec.bias ? 1 : 0};
    h = detail::hash_bytes(h, sh, 3);
    h = detail::hash_bytes(h, x.spec.name.data(), x.spec.name.size());
  }
  const agreed_value values[] = {
      {"layers", static_cast<double>(st.l_.size())},
      {"layer names and shapes (hash)", static_cast<double>(h >> 16)},
      {"steps taken", static_cast<double>(st.steps_)},
      {"factor element bytes", static_cast<double>(sizeof(C))},
      {"decomposition element bytes", static_cast<double>(sizeof(D))},
      {"factor_decay", o_.factor_decay},
      {"factor_update_steps", static_cast<double>(o_.factor_update_steps)},
      {"inv_update_steps", static_cast<double>(o_.inv_update_steps)},
      {"damping", o_.damping},
      {"method", static_cast<double>(o_.method)},
      {"prediv_eigenvalues", o_.prediv_eigenvalues ? 1.0 : 0.0},
      {"kl_clip", o_.kl_clip},
      {"max_consecutive_failures", static_cast<double>(o_.max_consecutive_failures)},
      {"grad_worker_fraction", o_.grad_worker_fraction},
  };
  agree_values(comm, st.ex_, "kfac::step (distributed)", std::span<const agreed_value>(values));
  const int g = grad_workers(n);
  detail::require(St::on_host || g == n, "kfac::step: grad_worker_fraction is ", o_.grad_worker_fraction,
                  " but the state is in device memory, where every rank holds every decomposition "
                  "(grad_worker_fraction = 1)");
  detail::require(n % g == 0, "kfac::step: grad_worker_fraction ", o_.grad_worker_fraction, " on ", n,
                  " ranks gives ", g, " grad workers per layer, which does not divide ", n,
                  " (choose a fraction whose g = round(fraction · ranks) divides the ranks)");
  if (g > 1 && g < n && St::on_host)
    st.comms_ = std::make_shared<detail::kfac_comms<Comm>>(comm.split(me / g, me), comm.split(me % g, me));
  else
    st.comms_.reset();
  std::vector<double> missing = layout(st, n, me, g);
  // A decomposition some grad worker lacks (after a load, or on a new world) is recomputed for
  // every layer, on every rank.
  detail::allreduce_host_values(comm, st.ex_, std::span<double>(missing), reduce_op::max);
  st.force_ = std::any_of(missing.begin(), missing.end(), [](double m) { return m != 0; });
}

}  // namespace gradapt

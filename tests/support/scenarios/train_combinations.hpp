#pragma once
// The composed step's slots in combination, written once over the communicator: the threads test
// (tests/test_train_combinations.cpp) runs the rows inside run_threads, the MPI test
// (tests/mpi/test_mpi_train_combinations.cpp) on MPI_COMM_WORLD. The rows form a covering array
// over
//
//   optimizer {SGD with momentum, AdamW, LAMB, LARS, Adafactor factored, SM3}
//   × state {replicated, zero_state<1>, zero_state<2>} × reduce {one buffer, buckets, hierarchical}
//   × combine {mean, Adasum} × loss scaler {off, on} × AdaScale {off, on} × sync {every step, LocalSGD}
//
// in which every pair of values that the slots allow together appears in at least one row (30
// rows, five per optimizer: buckets, hierarchical, ZeRO-1, ZeRO-2 and Adasum, with the flags
// varied across them). Both hierarchical_reduce settings are valid on any world size: `hier`
// groups by host name (one group, every rank runs on this machine), `pairs` puts one rank in
// each group.
//
// run_row runs one row on this rank: the recipe with an overflow on the last rank at step
// overflow_at when the scaler is on, and a save at `saved_at` loaded into a fresh step that
// runs the rest; its reference is the same recipe with the state replicated and the gradients
// reduced in one buffer, run without the checkpoint. Gradients differ by rank and are multiples
// of 2^-6 below 2^5, so every partial sum over up to 5 ranks is exact and the order of a
// reduction (shards, buckets, groups, MPI's own) does not change a bit: the parameters must
// then equal the reference's bit for bit. With AdaScale the noise scale's norms are summed in
// another order per slot (in double; the estimator's difference of two norms amplifies the
// rounding), so the gain must agree to 1e-9 and the parameters to 1e-6 (relative, + 1e-3).
//
// run_row holds no assertion and runs every collective of the row on every rank; require_row
// asserts through rank_check.hpp (safe on rank threads); agree (a collective) gives every rank
// the worst outcome over all ranks.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <tuple>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"
#include "sanitizer.hpp"
#include "scenarios/sharded.hpp"

namespace train_combinations_scenario {

namespace train = gradapt::train;
using sharded_scenario::model;
using sharded_scenario::same_bits;
using train::allreduce_mean;
using train::bucket_reduce;
using train::hierarchical_reduce;
using train::one_buffer_reduce;
using train::replicated_state;
using train::zero_state;
using adasum = train::adasum_combine;

/// A row's flags: the loss scaler, AdaScale and LocalSGD on or off.
template <bool Scale, bool Ada, bool Local>
struct flags {};

/// How a row runs: `steps` steps, the checkpoint saved after step `saved_at`, every step on
/// `backend`, whose results do not depend on its thread count (the MPI test runs one OpenMP
/// thread per rank: ranks that share the cores would otherwise spin against each other). The
/// scaler's overflow is at step overflow_at, before the save. 20 steps saved after 10; under a
/// sanitizer (which looks for memory, UB and race errors the same code reaches in fewer steps)
/// 12 saved after 6: the overflow (step 5) and Shampoo's roots of step 5 come before the
/// save, LocalSGD's local steps (from step 4) and averages on both sides of it.
struct row_options {
  int steps = gradapt_test::under_sanitizer ? 12 : 20;
  int saved_at = gradapt_test::under_sanitizer ? 6 : 10;
  gradapt::host backend{};
};
inline constexpr int overflow_at = 5;

inline const gradapt::shard::sharded_options tensor_cut{
    .partition = {.mode = gradapt::shard::granularity::tensor}};
inline const zero_state<1> z1{.allow_empty_shards = true};
inline const zero_state<2> z2{.sharding = {.buckets = {.cap_bytes = 40000}}, .allow_empty_shards = true};
inline const zero_state<1> z1_whole{.sharding = tensor_cut, .allow_empty_shards = true};
inline const zero_state<2> z2_whole{
    .sharding = {.partition = tensor_cut.partition, .buckets = {.cap_bytes = 40000}},
    .allow_empty_shards = true};
inline const bucket_reduce buckets{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
// Grouped by host name: one group on this machine, the sum's order is the flat one's.
inline const hierarchical_reduce hier{};
inline const hierarchical_reduce pairs{.hierarchy = {.group_size = 1}};  // one rank per group

inline const auto sgd = gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
inline const auto adamw = gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01});
inline const auto lamb = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
inline const auto lars = gradapt::lars({.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9});
inline const auto adafactor = gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5});
inline const auto sm3 = gradapt::sm3({.lr = 0.1, .momentum = 0.9});

/// This rank's gradients at step k: full-mantissa values rounded to multiples of 2^-6 (at most
/// 2^4 in magnitude), so that sums over up to 5 ranks are exact in any order.
inline void exact_grads(model<float>& m, int rank, int k, double scale) {
  m.make_grads(rank, k);
  for (auto& t : m.g)
    for (auto& x : t) x = static_cast<float>(std::round(static_cast<double>(x) * 64.0) / 64.0 * scale);
}

/// The composed step on `params` (host or device-tagged views) with the given state, reduce and
/// combine slots and, by the flags, the loss scaler, AdaScale and LocalSGD.
template <bool Scale, bool Ada, bool Local, class Comm, class B, class PL, class Opt, class State,
          class Reduce, class Combine>
auto make_step(Comm& comm, const B& backend, const PL& params, const Opt& opt, const State& state,
               const Reduce& reduce, const Combine& combine, double lr) {
  auto scaler = [] {
    if constexpr (Scale)
      return std::tuple(gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}));
    else
      return std::tuple();
  }();
  auto ada = [] {
    if constexpr (Ada)
      return std::tuple(train::adascale_policy{.base_batch = 8});
    else
      return std::tuple();
  }();
  auto local = [] {
    if constexpr (Local)
      return std::tuple(train::local_sgd_policy{{.start_step = 4}, gradapt::fixed_period({.period = 3})});
    else
      return std::tuple();
  }();
  return std::apply(
      [&](auto... p) {
        return train::make_data_parallel_step(comm, backend, params, opt, {.lr = lr, .local_batch = 8}, state,
                                              reduce, combine, p...);
      },
      std::tuple_cat(scaler, ada, local));
}

/// One step: this rank's gradients times the loss scale (with the scaler, an overflow on the
/// last rank at overflow_at), marked in the backward's order when the step reduces during the
/// backward pass.
template <class Step, class Comm>
train::step_metrics one_step(Step& step, model<float>& m, Comm& comm, int k) {
  exact_grads(m, comm.rank(), k, step.loss_scale());
  if constexpr (Step::has_loss_scaling)
    if (k == overflow_at && comm.rank() == comm.size() - 1)
      m.g[2][1] = std::numeric_limits<float>::infinity();
  if constexpr (Step::marks_gradients)
    for (std::size_t t = m.params.size(); t-- > 0;) step.mark_ready(t);
  return step.step();
}

/// What one row ends with on this rank (after agree: the worst over all ranks).
struct outcome {
  bool adascale = false;
  int metrics_differ_at = 0;    ///< a step whose metrics differ from the reference's (0: none)
  bool overflow_as_set = true;  ///< the reference skipped step overflow_at exactly when the scaler is on
  double gain_error = 0.0;      ///< AdaScale: the largest relative error of the gain after the load
  double param_error = 0.0;     ///< AdaScale: the largest relative error of a parameter (+ 1e-3)
  int tensor_bits_differ = -1;  ///< without AdaScale: a tensor whose bits differ (-1: none)
  int failed_ranks = 0;         ///< after agree: how many ranks failed a check (for messages)
};

inline bool passed(const outcome& o) {
  return o.metrics_differ_at == 0 && o.overflow_as_set &&
         (o.adascale ? o.gain_error <= 1e-9 && o.param_error <= 1e-6 : o.tensor_bits_differ == -1);
}

/// One row of the array against its reference (see the file comment), on this rank.
template <bool Scale, bool Ada, bool Local, class Comm, class Opt, class State, class Reduce, class Combine>
outcome run_row(Comm& comm, const row_options& when, flags<Scale, Ada, Local>, const Opt& opt,
                const State& state, const Reduce& reduce, const Combine& combine) {
  outcome out;
  out.adascale = Ada;
  model<float> a, c;
  auto reference = make_step<Scale, Ada, Local>(comm, when.backend, a.params, opt, replicated_state{},
                                                one_buffer_reduce{}, combine, 1e-2);
  std::vector<train::step_metrics> ref;
  for (int k = 1; k <= when.steps; ++k) ref.push_back(one_step(reference, a, comm, k));
  const auto differ_at = [&](int k) {
    if (out.metrics_differ_at == 0) out.metrics_differ_at = k;
  };
  std::vector<std::byte> saved;
  {
    auto first =
        make_step<Scale, Ada, Local>(comm, when.backend, c.params, opt, state, reduce, combine, 1e-2);
    for (int k = 1; k <= when.saved_at; ++k) {
      const auto got = one_step(first, c, comm, k);
      const auto& want = ref[static_cast<std::size_t>(k - 1)];
      if (!(got.found_inf == want.found_inf && got.stepped == want.stepped &&
            got.loss_scale == want.loss_scale && got.averaged == want.averaged))
        differ_at(k);
    }
    saved = first.save();  // with LocalSGD or ZeRO, this rank's own
  }
  auto second = make_step<Scale, Ada, Local>(comm, when.backend, c.params, opt, state, reduce, combine, 0.5);
  second.load(saved);
  for (int k = when.saved_at + 1; k <= when.steps; ++k) {
    const auto got = one_step(second, c, comm, k);
    const auto& want = ref[static_cast<std::size_t>(k - 1)];
    if (!(got.found_inf == want.found_inf && got.optimizer_steps == want.optimizer_steps &&
          got.loss_scale == want.loss_scale && got.averaged == want.averaged))
      differ_at(k);
    if (want.gain > 0.0) {
      const double e = std::abs(got.gain - want.gain) / want.gain;
      out.gain_error = e == e ? std::max(out.gain_error, e) : HUGE_VAL;  // a NaN fails the row
    }
  }
  out.overflow_as_set = ref[static_cast<std::size_t>(overflow_at - 1)].found_inf == Scale;
  if constexpr (Ada) {
    for (std::size_t t = 0; t < a.p.size(); ++t)
      for (std::size_t i = 0; i < a.p[t].size(); ++i) {
        const double e = std::abs(static_cast<double>(c.p[t][i]) - a.p[t][i]) /
                         (std::abs(static_cast<double>(a.p[t][i])) + 1e-3);
        out.param_error = e == e ? std::max(out.param_error, e) : HUGE_VAL;  // a NaN fails the row
      }
  } else {
    for (std::size_t t = a.p.size(); t-- > 0;)
      if (!same_bits(a.p[t], c.p[t])) out.tensor_bits_differ = static_cast<int>(t);
  }
  return out;
}

/// The worst of every rank's outcome, on every rank (a collective), with the count of ranks
/// on which a check failed.
template <class Comm>
outcome agree(Comm& comm, const outcome& mine) {
  std::vector<double> v{static_cast<double>(mine.metrics_differ_at), mine.overflow_as_set ? 0.0 : 1.0,
                        mine.gain_error, mine.param_error, static_cast<double>(mine.tensor_bits_differ)};
  std::vector<double> failed{passed(mine) ? 0.0 : 1.0};
  comm.allreduce(gradapt::host_view(v), gradapt::reduce_op::max);
  comm.allreduce(gradapt::host_view(failed), gradapt::reduce_op::sum);
  outcome all = mine;
  all.metrics_differ_at = static_cast<int>(v[0]);
  all.overflow_as_set = v[1] == 0.0;
  all.gain_error = v[2];
  all.param_error = v[3];
  all.tensor_bits_differ = static_cast<int>(v[4]);
  all.failed_ranks = static_cast<int>(failed[0]);
  return all;
}

/// Asserts a row's outcome (safe on rank threads), the checks that name what differs first.
inline void require_row(const outcome& o) {
  RANK_REQUIRE(o.metrics_differ_at == 0);
  RANK_REQUIRE(o.overflow_as_set);
  if (o.adascale) {
    RANK_REQUIRE(o.gain_error <= 1e-9);
    RANK_REQUIRE(o.param_error <= 1e-6);
  } else {
    RANK_REQUIRE(o.tensor_bits_differ == -1);
  }
  RANK_REQUIRE(o.failed_ranks == 0);  // after agree: a rank whose own check failed
}

// The rows, by optimizer pair: each calls row(name, flags<scaler, AdaScale, LocalSGD>{},
// optimizer, state, reduce, combine). Per optimizer: buckets, hierarchical, ZeRO-1, ZeRO-2 and
// Adasum rows, the flags varied so that every pair of (state, reduce, combine, scaler,
// AdaScale, sync) values allowed together, and every optimizer with each of those values, is in
// some row.

template <class Row>
void sgd_adamw_rows(Row&& row) {
  row("sgd, buckets, scaler", flags<true, false, false>{}, sgd, replicated_state{}, buckets,
      allreduce_mean{});
  row("sgd, hierarchical, AdaScale, LocalSGD", flags<false, true, true>{}, sgd, replicated_state{}, pairs,
      allreduce_mean{});
  row("sgd, zero_state<1>, AdaScale", flags<false, true, false>{}, sgd, z1, one_buffer_reduce{},
      allreduce_mean{});
  row("sgd, zero_state<2>, scaler", flags<true, false, false>{}, sgd, z2, one_buffer_reduce{},
      allreduce_mean{});
  row("sgd, Adasum, scaler, LocalSGD", flags<true, false, true>{}, sgd, replicated_state{},
      one_buffer_reduce{}, adasum{});
  row("adamw, buckets, AdaScale", flags<false, true, false>{}, adamw, replicated_state{}, buckets,
      allreduce_mean{});
  row("adamw, hierarchical, scaler, LocalSGD", flags<true, false, true>{}, adamw, replicated_state{}, hier,
      allreduce_mean{});
  row("adamw, zero_state<1>, scaler", flags<true, false, false>{}, adamw, z1, one_buffer_reduce{},
      allreduce_mean{});
  row("adamw, zero_state<2>, AdaScale", flags<false, true, false>{}, adamw, z2, one_buffer_reduce{},
      allreduce_mean{});
  row("adamw, Adasum", flags<false, false, false>{}, adamw, replicated_state{}, one_buffer_reduce{},
      adasum{});
}

template <class Row>
void lamb_lars_rows(Row&& row) {
  row("lamb, buckets, scaler, AdaScale", flags<true, true, false>{}, lamb, replicated_state{}, buckets,
      allreduce_mean{});
  row("lamb, hierarchical, scaler, AdaScale, LocalSGD", flags<true, true, true>{}, lamb, replicated_state{},
      pairs, allreduce_mean{});
  row("lamb, zero_state<1>, scaler, AdaScale", flags<true, true, false>{}, lamb, z1, one_buffer_reduce{},
      allreduce_mean{});
  row("lamb, zero_state<2>, scaler, AdaScale", flags<true, true, false>{}, lamb, z2, one_buffer_reduce{},
      allreduce_mean{});
  row("lamb, Adasum", flags<false, false, false>{}, lamb, replicated_state{}, one_buffer_reduce{}, adasum{});
  row("lars, buckets, AdaScale", flags<false, true, false>{}, lars, replicated_state{}, buckets,
      allreduce_mean{});
  row("lars, hierarchical, LocalSGD", flags<false, false, true>{}, lars, replicated_state{}, hier,
      allreduce_mean{});
  row("lars, zero_state<1>", flags<false, false, false>{}, lars, z1, one_buffer_reduce{}, allreduce_mean{});
  row("lars, zero_state<2>", flags<false, false, false>{}, lars, z2, one_buffer_reduce{}, allreduce_mean{});
  row("lars, Adasum, scaler, LocalSGD", flags<true, false, true>{}, lars, replicated_state{},
      one_buffer_reduce{}, adasum{});
}

/// Adafactor and SM3 keep factored state: ZeRO rows cut whole tensors per rank.
template <class Row>
void adafactor_sm3_rows(Row&& row) {
  row("adafactor, buckets, scaler", flags<true, false, false>{}, adafactor, replicated_state{}, buckets,
      allreduce_mean{});
  row("adafactor, hierarchical, AdaScale", flags<false, true, false>{}, adafactor, replicated_state{}, pairs,
      allreduce_mean{});
  row("adafactor, zero_state<1>, AdaScale", flags<false, true, false>{}, adafactor, z1_whole,
      one_buffer_reduce{}, allreduce_mean{});
  row("adafactor, zero_state<2>, scaler, AdaScale", flags<true, true, false>{}, adafactor, z2_whole,
      one_buffer_reduce{}, allreduce_mean{});
  row("adafactor, Adasum, scaler, LocalSGD", flags<true, false, true>{}, adafactor, replicated_state{},
      one_buffer_reduce{}, adasum{});
  row("sm3, buckets, AdaScale", flags<false, true, false>{}, sm3, replicated_state{}, buckets,
      allreduce_mean{});
  row("sm3, hierarchical, scaler, AdaScale, LocalSGD", flags<true, true, true>{}, sm3, replicated_state{},
      hier, allreduce_mean{});
  row("sm3, zero_state<1>, scaler", flags<true, false, false>{}, sm3, z1_whole, one_buffer_reduce{},
      allreduce_mean{});
  row("sm3, zero_state<2>", flags<false, false, false>{}, sm3, z2_whole, one_buffer_reduce{},
      allreduce_mean{});
  row("sm3, Adasum", flags<false, false, false>{}, sm3, replicated_state{}, one_buffer_reduce{}, adasum{});
}

}  // namespace train_combinations_scenario

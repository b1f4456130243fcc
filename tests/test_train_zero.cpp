// The composed step's state slot on comm::threads, 1, 2, 3 and 5 ranks: zero_state<1> and
// zero_state<2> (gradients marked ready in a different order on every rank) give the replicated
// step's parameters bit for bit, for SGD, AdamW, LAMB, LARS (element granularity) and Adafactor
// and SM3 (tensor granularity, factored tensors included), on full-mantissa gradients that
// differ by rank; with the loss scaler (an overflow step skipped on every rank); the state bytes
// per rank in the metrics; AdaScale's gain from the shards' norms (to rounding); save and load
// mid-run continue bitwise; errors on every rank.
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "sanitizer.hpp"
#include "scenarios/sharded.hpp"

namespace gradapt_test_train_zero {

using namespace gradapt::train;  // make_data_parallel_step, replicated_state, zero_state, ...
using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using sharded_scenario::model;
using sharded_scenario::same_bits;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};
// The worlds of the bitwise comparisons: 1, 2, 3 and 5 ranks, 3 only under a sanitizer.
const std::vector<int> worlds_1235 =
    gradapt_test::under_sanitizer ? std::vector<int>{3} : std::vector<int>{1, 2, 3, 5};
const gradapt::shard::sharded_options tensor_cut{.partition = {.mode = gradapt::shard::granularity::tensor}};

/// The parameters after `steps` composed steps on this rank's gradients (make_grads(rank, k):
/// full-mantissa values that differ by rank), with the state slot `state`. Stage 2 marks the
/// gradients in an order that depends on the rank and the step.
template <class Opt, class State, class... Extra>
std::vector<std::vector<float>> run(threads& comm, const Opt& opt, const State& state, int steps,
                                    std::vector<std::uint64_t>* bytes = nullptr, Extra... extra) {
  const gradapt::host b;
  model<float> m;
  auto step = make_data_parallel_step(comm, b, m.params, opt, {.lr = 1e-2}, state, extra...);
  for (int k = 1; k <= steps; ++k) {
    m.make_grads(comm.rank(), k);
    if constexpr (decltype(step)::marks_gradients) {
      std::vector<std::size_t> order(m.params.size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::rotate(order.begin(), order.begin() + (comm.rank() + k) % static_cast<int>(order.size()),
                  order.end());
      if ((comm.rank() + k) % 2 == 1) std::reverse(order.begin(), order.end());
      for (const std::size_t t : order) {
        step.mark_ready(t);
        if constexpr (decltype(step)::has_buckets) step.progress();  // as a backward's gap would
      }
    }
    const auto& met = step.step();
    RANK_REQUIRE(met.stepped);
    RANK_REQUIRE(met.state_bytes == step.state_bytes());
    if (bytes != nullptr) bytes->push_back(met.state_bytes);
  }
  return m.p;
}

/// The largest |y - x| / (|x| + 1e-3) over every element of two models' parameters.
inline double worst_relative(const std::vector<std::vector<float>>& x,
                             const std::vector<std::vector<float>>& y) {
  double worst = 0.0;
  for (std::size_t t = 0; t < x.size(); ++t)
    for (std::size_t i = 0; i < x[t].size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(y[t][i]) - x[t][i]) /
                                  (std::abs(static_cast<double>(x[t][i])) + 1e-3));
  return worst;
}

/// Replicated, zero_state<1> and zero_state<2> on 1, 2, 3 and 5 ranks (5 ranks leave one
/// without elements at the default alignment, accepted here).
template <class Opt>
void all_states(const Opt& opt, const gradapt::shard::sharded_options& so) {
  for (const int n : worlds_1235) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      std::vector<std::uint64_t> whole, one, two;
      const auto ref = run(comm, opt, replicated_state{}, 4, &whole);
      const auto z1 = run(comm, opt, zero_state<1>{.sharding = so, .allow_empty_shards = true}, 4, &one);
      const auto z2 = run(comm, opt, zero_state<2>{.sharding = so, .allow_empty_shards = true}, 4, &two);
      for (std::size_t t = 0; t < ref.size(); ++t) {
        RANK_REQUIRE(same_bits(ref[t], z1[t]));
        RANK_REQUIRE(same_bits(ref[t], z2[t]));
      }
      // Every rank's shard of the state adds up to the replicated state.
      double sum = static_cast<double>(one.back());  // exact: far below 2^53
      comm.allreduce(gradapt::tensor_view<double>::vector(&sum, 1), gradapt::reduce_op::sum);
      RANK_REQUIRE(sum == static_cast<double>(whole.back()));
      RANK_REQUIRE(two.back() == one.back());
    });
  }
}

}  // namespace

TEST_CASE("zero_state<1> and <2> give the replicated step's bits: SGD, AdamW, LAMB, LARS", "[train][zero]") {
  all_states(gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}), {});
  all_states(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), {});
  all_states(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), {});
  all_states(gradapt::lars({.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9}), {});
}

TEST_CASE("zero_state<1> and <2> give the replicated step's bits: Adafactor and SM3, factored",
          "[train][zero]") {
  all_states(gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5}), tensor_cut);
  all_states(gradapt::sm3({.lr = 0.1, .momentum = 0.9}), tensor_cut);
}

TEST_CASE("bucket_reduce gives the one-buffer step's bits: SGD, AdamW, LAMB, Adafactor", "[train][buckets]") {
  // Buckets of about 20 KB (several per step) and DDP's defaults (one or two here), gradients
  // marked in a rank- and step-dependent order.
  const gradapt::train::bucket_reduce small{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  const auto check = [&](const auto& opt) {
    for (const int n : worlds_1235) {
      INFO("ranks " << n);
      run_threads(n, quick, [&](threads& comm) {
        const auto ref = run(comm, opt, replicated_state{}, 4);
        const auto a = run(comm, opt, replicated_state{}, 4, nullptr, small);
        const auto b = run(comm, opt, replicated_state{}, 4, nullptr, gradapt::train::bucket_reduce{});
        for (std::size_t t = 0; t < ref.size(); ++t) {
          RANK_REQUIRE(same_bits(ref[t], a[t]));
          RANK_REQUIRE(same_bits(ref[t], b[t]));
        }
      });
    }
  };
  check(gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}));
  check(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}));
  check(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}));
  check(gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5}));
}

TEST_CASE(
    "bucket_reduce with the loss scaler and AdaScale: overflow skipped everywhere, the gain to rounding",
    "[train][buckets]") {
  for (const int n : {2, 3}) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> a, c;
      const auto opt = gradapt::lamb({.lr = 1e-2});
      const auto scaler = gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2});
      const gradapt::train::adascale_policy ada{.base_batch = 8};
      const gradapt::train::step_settings set{.lr = 1e-2, .local_batch = 8};
      auto rep = make_data_parallel_step(comm, b, a.params, opt, set, scaler, ada);
      auto buc = make_data_parallel_step(comm, b, c.params, opt, set, scaler, ada,
                                         gradapt::train::bucket_reduce{.buckets = {.cap_bytes = 30000}});
      for (int k = 1; k <= 6; ++k) {
        for (auto* m : {&a, &c}) {
          m->make_grads(comm.rank(), k);
          for (auto& g : m->g)
            for (auto& x : g) x *= static_cast<float>(rep.loss_scale());
          if (k == 2 && comm.rank() == 0) m->g[3][5] = std::numeric_limits<float>::quiet_NaN();
        }
        for (std::size_t t = c.params.size(); t-- > 0;) buc.mark_ready(t);
        const auto mr = rep.step();
        const auto mb = buc.step();
        RANK_REQUIRE(mb.found_inf == (k == 2));
        RANK_REQUIRE(mr.found_inf == mb.found_inf);
        RANK_REQUIRE(mb.loss_scale == mr.loss_scale);
        if (k != 2) {
          RANK_REQUIRE(mr.gain > 1.0);
          RANK_REQUIRE(std::abs(mb.gain - mr.gain) <= 1e-9 * mr.gain);
        }
      }
      const double worst = worst_relative(a.p, c.p);
      RANK_REQUIRE(worst <= 1e-5);
    });
  }
}

TEST_CASE("zero_state<1> and <2> with the loss scaler: an overflow on one rank skips the step on every rank",
          "[train][zero]") {
  for (const int n : {1, 3}) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> a, c, d;
      const auto opt = gradapt::adamw({.lr = 1e-2});
      const auto scaler = gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2});
      auto rep = make_data_parallel_step(comm, b, a.params, opt, {.lr = 1e-2}, scaler);
      auto z1 = make_data_parallel_step(comm, b, c.params, opt, {.lr = 1e-2}, scaler, zero_state<1>{});
      auto z2 = make_data_parallel_step(comm, b, d.params, opt, {.lr = 1e-2}, scaler,
                                        zero_state<2>{.sharding = {.buckets = {.cap_bytes = 40000}}});
      for (int k = 1; k <= 5; ++k) {
        for (auto* m : {&a, &c, &d}) {
          m->make_grads(comm.rank(), k);
          for (auto& g : m->g)  // the scaled gradients of the backward pass (S is a power of 2)
            for (auto& x : g) x *= static_cast<float>(rep.loss_scale());
          if (k == 2 && comm.rank() == n - 1) m->g[1][7] = std::numeric_limits<float>::infinity();
        }
        for (std::size_t t = d.params.size(); t-- > 0;) z2.mark_ready(t);  // the backward's order
        const auto& mr = rep.step();
        const auto& m1 = z1.step();
        const auto& m2 = z2.step();
        for (const auto* mz : {&m1, &m2}) {
          RANK_REQUIRE(mz->found_inf == (k == 2));
          RANK_REQUIRE(mr.found_inf == mz->found_inf);
          RANK_REQUIRE(mz->loss_scale == mr.loss_scale);
          RANK_REQUIRE(mz->optimizer_steps == mr.optimizer_steps);
        }
      }
      for (std::size_t t = 0; t < a.p.size(); ++t) {
        RANK_REQUIRE(same_bits(a.p[t], c.p[t]));
        RANK_REQUIRE(same_bits(a.p[t], d.p[t]));
      }
    });
  }
}

TEST_CASE("zero_state<1> and <2> with AdaScale: the gain and the parameters of the replicated step",
          "[train][zero]") {
  // The noise scale's norms come from the shards (Σ over ranks of Σ ḡ² per shard) rather than
  // from one pass over the whole averaged gradient: equal to rounding, so the gain and the
  // parameters are compared to a tolerance, against the replicated step's own values.
  for (const int n : {2, 3}) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> a, c, d;
      const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
      const gradapt::train::adascale_policy ada{.base_batch = 8};
      const gradapt::train::step_settings set{.lr = 1e-2, .local_batch = 8};
      auto rep = make_data_parallel_step(comm, b, a.params, opt, set, ada);
      auto z1 = make_data_parallel_step(comm, b, c.params, opt, set, ada, zero_state<1>{});
      auto z2 = make_data_parallel_step(comm, b, d.params, opt, set, ada, zero_state<2>{});
      for (int k = 1; k <= 6; ++k) {
        a.make_grads(comm.rank(), k);
        c.make_grads(comm.rank(), k);
        d.make_grads(comm.rank(), k);
        for (std::size_t t = 0; t < d.params.size(); ++t) z2.mark_ready(t);
        const auto mr = rep.step();
        const auto m1 = z1.step();
        const auto m2 = z2.step();
        for (const auto* mz : {&m1, &m2}) {
          RANK_REQUIRE(mr.gain > 1.0);  // the gradients differ by rank: there is noise to see
          RANK_REQUIRE(std::abs(mz->gain - mr.gain) <= 1e-9 * mr.gain);
          RANK_REQUIRE(std::abs(mz->noise_scale - mr.noise_scale) <= 1e-6 * std::abs(mr.noise_scale));
          RANK_REQUIRE(std::abs(mz->progress - mr.progress) <= 1e-9 * mr.progress);
        }
      }
      double worst = 0.0;
      for (std::size_t t = 0; t < a.p.size(); ++t)
        for (std::size_t i = 0; i < a.p[t].size(); ++i)
          for (const auto* q : {&c, &d})
            worst = std::max(worst, std::abs(static_cast<double>(q->p[t][i]) - a.p[t][i]) /
                                        (std::abs(static_cast<double>(a.p[t][i])) + 1e-3));
      RANK_REQUIRE(worst <= 1e-5);
    });
  }
}

TEST_CASE("zero_state: save and load mid-run continue bit for bit", "[train][zero]") {
  for (const int n : {2, 3}) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
      model<float> a, c;
      auto first = make_data_parallel_step(comm, b, a.params, opt, {.lr = 1e-2}, zero_state<1>{});
      for (int k = 1; k <= 2; ++k) {
        a.make_grads(comm.rank(), k);
        first.step();
      }
      const auto saved = first.save();  // this rank's shard
      c.p = a.p;
      auto second = make_data_parallel_step(comm, b, c.params, opt, {.lr = 0.5}, zero_state<1>{});
      second.load(saved);
      RANK_REQUIRE(second.settings().lr == 1e-2);
      RANK_REQUIRE(second.optimizer_state().steps() == 2);
      RANK_REQUIRE(second.metrics().state_bytes == first.state_bytes());
      for (int k = 3; k <= 5; ++k) {
        a.make_grads(comm.rank(), k);
        c.make_grads(comm.rank(), k);
        first.step();
        second.step();
      }
      for (std::size_t t = 0; t < a.p.size(); ++t) RANK_REQUIRE(same_bits(a.p[t], c.p[t]));
    });
  }
}

namespace {

/// Composed steps k0..k1 on this rank: gradients identical on every rank with sums exact in
/// any order (`same`: the mean is the same on any world size) or full-mantissa and different
/// per rank, times the loss scale (a power of 2), marked in the backward's order.
template <class Step>
void advance(Step& step, model<float>& m, int rank, int k0, int k1, bool same) {
  for (int k = k0; k <= k1; ++k) {
    m.make_grads(rank, k, same);
    for (auto& g : m.g)
      for (auto& x : g) x *= static_cast<float>(step.loss_scale());
    if constexpr (Step::marks_gradients)
      for (std::size_t t = m.params.size(); t-- > 0;) step.mark_ready(t);
    const bool stepped = step.step().stepped;  // (not inside RANK_REQUIRE, which holds a lock)
    RANK_REQUIRE(stepped);
  }
}

/// What each of n ranks throws while building an SGD step on the model with the policies that
/// `policies(comm, build)` passes to `build(...)` (they may differ by rank).
template <class F>
std::vector<std::string> construction_errors(int n, F policies) {
  return gradapt_test::errors_of(n, quick, [&](threads& comm) {
    const gradapt::host b;
    model<float> m;
    policies(comm, [&](auto... p) {
      (void)make_data_parallel_step(comm, b, m.params, gradapt::sgd(), {.lr = 0.1}, p...);
    });
  });
}

/// restore() of an N-rank checkpoint on M ranks against an uninterrupted M-rank run from the
/// same state. Three steps on gradients whose mean is the same on any world size leave the same
/// state on N and on M ranks (the parameters are checked equal), so the M-rank run that took
/// them is the reference: it is given the restored settings (the rule's) by hand, and both take
/// five more steps on gradients that differ by rank. The parameters, the loss scale and the
/// whole checkpoint must then agree bit for bit.
template <class Opt, class State>
void restore_against_uninterrupted(const Opt& opt, const State& state) {
  using gradapt::train::rescale_rule;
  const gradapt::host b;
  const auto make = [&](threads& comm, model<float>& m) {
    return make_data_parallel_step(comm, b, m.params, opt, {.lr = 1e-2, .accumulation_steps = 60}, state,
                                   gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}));
  };
  // Under a sanitizer two of the pairs (one growing, one shrinking).
  const std::vector<std::pair<int, int>> worlds =
      gradapt_test::under_sanitizer
          ? std::vector<std::pair<int, int>>{{2, 3}, {3, 2}}
          : std::vector<std::pair<int, int>>{{1, 3}, {2, 5}, {3, 2}, {5, 1}, {4, 4}, {2, 3}};
  const rescale_rule rules[] = {rescale_rule::keep_global_batch, rescale_rule::linear_lr,
                                rescale_rule::sqrt_lr};
  for (std::size_t i = 0; i < std::size(worlds); ++i) {
    const int n = worlds[i].first, m = worlds[i].second;  // (not a structured binding: lambdas capture them)
    const rescale_rule rule = rules[i % std::size(rules)];
    INFO(n << " -> " << m << " ranks, " << gradapt::train::name(rule));
    std::vector<std::vector<std::byte>> saved(static_cast<std::size_t>(n));
    std::vector<std::vector<float>> at3;
    run_threads(n, quick, [&](threads& comm) {
      model<float> a;
      auto step = make(comm, a);
      advance(step, a, comm.rank(), 1, 3, true);
      saved[static_cast<std::size_t>(comm.rank())] = step.save();
      if (comm.rank() == 0) at3 = a.p;
    });
    run_threads(m, quick, [&](threads& comm) {
      model<float> ref, got;
      auto reference = make(comm, ref);
      advance(reference, ref, comm.rank(), 1, 3, true);
      for (std::size_t t = 0; t < at3.size(); ++t) RANK_REQUIRE(same_bits(ref.p[t], at3[t]));
      got.p = at3;  // the framework restores its parameters itself
      auto resumed = make(comm, got);
      resumed.restore([&](int r) { return std::span<const std::byte>(saved[static_cast<std::size_t>(r)]); },
                      rule);
      RANK_REQUIRE(resumed.steps() == 3);
      RANK_REQUIRE(resumed.loss_scale() == reference.loss_scale());
      const double ratio = double(m) / double(n);
      const auto& s = resumed.settings();
      RANK_REQUIRE(s.accumulation_steps == (rule == rescale_rule::keep_global_batch ? 60 * n / m : 60));
      RANK_REQUIRE(s.lr == (rule == rescale_rule::linear_lr ? 1e-2 * double(m) / double(n)  // lr × M / N
                            : rule == rescale_rule::sqrt_lr ? 1e-2 * std::sqrt(ratio)
                                                            : 1e-2));
      reference.settings() = s;
      advance(reference, ref, comm.rank(), 4, 8, false);
      advance(resumed, got, comm.rank(), 4, 8, false);
      for (std::size_t t = 0; t < ref.p.size(); ++t) RANK_REQUIRE(same_bits(ref.p[t], got.p[t]));
      RANK_REQUIRE(resumed.loss_scale() == reference.loss_scale());
      RANK_REQUIRE(resumed.state_bytes() == reference.state_bytes());
      const bool same_checkpoint = resumed.save() == reference.save();
      RANK_REQUIRE(same_checkpoint);
    });
  }
}

}  // namespace

TEST_CASE("restore N -> M: every state slot continues as an uninterrupted M-rank run, bit for bit",
          "[train][zero][elastic]") {
  SECTION("LAMB (norms across shards), replicated, zero_state<1> and <2>") {
    const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
    restore_against_uninterrupted(opt, replicated_state{});
    restore_against_uninterrupted(opt, zero_state<1>{.allow_empty_shards = true});
    restore_against_uninterrupted(opt, zero_state<2>{.allow_empty_shards = true});
  }
  SECTION("Adafactor and SM3, factored, whole tensors per rank") {
    const auto ada = gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5});
    const auto sm3 = gradapt::sm3({.lr = 0.1, .momentum = 0.9});
    restore_against_uninterrupted(ada, replicated_state{});
    restore_against_uninterrupted(ada, zero_state<1>{.sharding = tensor_cut, .allow_empty_shards = true});
    restore_against_uninterrupted(sm3, zero_state<2>{.sharding = tensor_cut, .allow_empty_shards = true});
  }
}

TEST_CASE("hierarchical_reduce: the hierarchy's sum over N, then the optimizer, bit for bit",
          "[train][hierarchical]") {
  // (world size, group size): groups of 2 and 3, one group of all ranks, one rank per group,
  // and grouping by host name (one host: one group).
  const std::pair<int, int> worlds[] = {{4, 2}, {6, 3}, {3, 3}, {3, 1}, {2, 0}, {1, 0}};
  for (const auto& world : worlds) {
    const int n = world.first, g = world.second;  // (not a structured binding: the lambda captures them)
    INFO(n << " ranks, group_size " << g);
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
      model<float> a, c;
      auto step =
          make_data_parallel_step(comm, b, a.params, opt, {.lr = 1e-2},
                                  gradapt::train::hierarchical_reduce{.hierarchy = {.group_size = g}});
      gradapt::comm::hierarchy<threads> h(comm, {.group_size = g});
      auto st = opt.init(b, c.params);
      for (int k = 1; k <= 4; ++k) {
        a.make_grads(comm.rank(), k);
        c.make_grads(comm.rank(), k);
        const bool stepped = step.step().stepped;
        if (n > 1) {  // the sequence the slot stands for, written out
          for (const auto& t : c.params.grads()) h.allreduce(t, gradapt::reduce_op::sum);
          b.apply_list(gradapt::detail::divide_by_ranks{n}, c.params.grads());
        }
        opt.step(b, c.params, st, {.lr = 1e-2});
        RANK_REQUIRE(stepped);
      }
      for (std::size_t t = 0; t < a.p.size(); ++t) RANK_REQUIRE(same_bits(a.p[t], c.p[t]));
    });
  }
}

TEST_CASE(
    "hierarchical_reduce with the loss scaler, AdaScale and LocalSGD: a flat reduction's bits where sums are "
    "exact",
    "[train][hierarchical]") {
  // Gradients rounded to multiples of 2^-6 (at most 2^4 in magnitude): every partial sum over up
  // to 6 ranks is exact in float, so the hierarchy's order gives the flat allreduce's bits.
  const auto exact_grads = [](model<float>& m, int rank, int k, double scale) {
    m.make_grads(rank, k);
    for (auto& t : m.g)
      for (auto& x : t) x = static_cast<float>(std::round(static_cast<double>(x) * 64.0) / 64.0 * scale);
  };
  const gradapt::train::hierarchical_reduce hier{.hierarchy = {.group_size = 2}};
  for (const int n : {2, 4, 6}) {
    INFO(n << " ranks");
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      const auto opt = gradapt::adamw({.lr = 1e-2});
      const auto scaler = gradapt::loss_scaler({.init_scale = 256, .growth_interval = 2});
      const gradapt::train::local_sgd_policy local{{.start_step = 3}, gradapt::fixed_period({.period = 2})};
      const gradapt::train::adascale_policy ada{.base_batch = 8};
      const gradapt::train::step_settings set{.lr = 1e-2, .local_batch = 8};
      {  // the loss scaler (an overflow on one rank) and LocalSGD: bit for bit
        model<float> a, c;
        auto flat = make_data_parallel_step(comm, b, a.params, opt, set, scaler, local);
        auto tree = make_data_parallel_step(comm, b, c.params, opt, set, scaler, local, hier);
        for (int k = 1; k <= 8; ++k) {
          exact_grads(a, comm.rank(), k, flat.loss_scale());
          exact_grads(c, comm.rank(), k, tree.loss_scale());
          if (k == 2 && comm.rank() == n - 1) a.g[1][3] = c.g[1][3] = std::numeric_limits<float>::infinity();
          const auto mf = flat.step();
          const auto mt = tree.step();
          RANK_REQUIRE(mt.found_inf == (k == 2));
          RANK_REQUIRE(mt.found_inf == mf.found_inf);
          RANK_REQUIRE(mt.averaged == mf.averaged);
        }
        for (std::size_t t = 0; t < a.p.size(); ++t) RANK_REQUIRE(same_bits(a.p[t], c.p[t]));
      }
      {  // AdaScale: the norms summed in another order, so the gain to rounding
        model<float> a, c;
        auto flat = make_data_parallel_step(comm, b, a.params, opt, set, ada);
        auto tree = make_data_parallel_step(comm, b, c.params, opt, set, ada, hier);
        for (int k = 1; k <= 5; ++k) {
          exact_grads(a, comm.rank(), k, 1.0);
          exact_grads(c, comm.rank(), k, 1.0);
          const double gf = flat.step().gain;
          const double gt = tree.step().gain;
          RANK_REQUIRE(gt > 1.0);
          RANK_REQUIRE(std::abs(gt - gf) <= 1e-12 * gf);
        }
        const double worst = worst_relative(a.p, c.p);
        RANK_REQUIRE(worst <= 1e-6);
      }
    });
  }
}

TEST_CASE("hierarchical_reduce errors: every rank throws, naming the option", "[train][hierarchical]") {
  SECTION("a group size that does not divide the world") {
    const auto what = construction_errors(3, [](threads&, auto build) {
      build(gradapt::train::hierarchical_reduce{.hierarchy = {.group_size = 2}});
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("group_size"));
  }
  SECTION("ranks whose reduce slots differ") {
    const auto what = construction_errors(2, [](threads& comm, auto build) {
      if (comm.rank() == 0)
        build(gradapt::train::hierarchical_reduce{});
      else
        build();
    });
    for (const auto& w : what)
      CHECK_THAT(w, Contains("reduce slot (0 one_buffer_reduce, 1 bucket_reduce, 2 hierarchical_reduce)"));
  }
}

TEST_CASE("zero_state errors: every rank throws, naming the problem", "[train][zero]") {
  SECTION("a partition that leaves ranks empty") {
    // The model holds 38,769 elements cut at multiples of 4096 from each tensor's start: 12
    // ranks leave some without elements (counted from the plan itself).
    std::vector<std::size_t> sizes;
    for (const auto& sh : sharded_scenario::shapes()) sizes.push_back(sharded_scenario::numel(sh));
    const auto plan =
        gradapt::shard::partition_plan::make(sizes, 12, gradapt::shard::sharded_options{}.partition);
    int empty = 0;
    for (int r = 0; r < 12; ++r) empty += plan.pieces(r).empty() ? 1 : 0;
    REQUIRE(empty > 0);
    const auto what = construction_errors(12, [](threads&, auto build) { build(zero_state<1>{}); });
    for (const auto& w : what)
      CHECK_THAT(w,
                 Contains("zero_state leaves " + std::to_string(empty) + " of 12 ranks without elements") &&
                     Contains("allow_empty_shards") && Contains("alignment 4096"));
    run_threads(12, quick, [](threads& comm) {  // accepted when asked for
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::sgd(), {.lr = 0.1},
                                          zero_state<1>{.allow_empty_shards = true});
      m.make_grads(comm.rank(), 1);
      const bool stepped = step.step().stepped;  // (collective: not inside RANK_REQUIRE's lock)
      RANK_REQUIRE(stepped);
    });
  }
  SECTION("ranks that differ in allow_empty_shards") {
    const auto what = construction_errors(
        2, [](threads& comm, auto build) { build(zero_state<1>{.allow_empty_shards = comm.rank() == 1}); });
    for (const auto& w : what) CHECK_THAT(w, Contains("zero_state::allow_empty_shards"));
  }
  SECTION("ranks whose state slots differ") {
    const auto what = construction_errors(2, [](threads& comm, auto build) {
      if (comm.rank() == 0)
        build(zero_state<1>{});
      else
        build(zero_state<2>{});
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("state slot"));
  }
  SECTION("a damaged checkpoint on one rank") {
    const auto what = gradapt_test::errors_of(3, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, zero_state<1>{});
      m.make_grads(comm.rank(), 1);
      step.step();
      auto bytes = step.save();
      if (comm.rank() == 1) bytes[bytes.size() / 2] ^= std::byte{1};
      step.load(bytes);
    });
    CHECK_THAT(what[1], Contains("archive"));
    for (const auto& w : what) CHECK_THAT(w, Contains("train::data_parallel_step::load"));
  }
  SECTION("restore from the old ranks' checkpoints: one damaged, of another step, or a source that throws") {
    // Three old ranks' checkpoints after steps 1 and 2, restored on two new ranks.
    std::vector<std::vector<std::byte>> one(3), two(3);
    run_threads(3, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, zero_state<1>{});
      for (int k = 1; k <= 2; ++k) {
        m.make_grads(comm.rank(), k);
        step.step();
        (k == 1 ? one : two)[static_cast<std::size_t>(comm.rank())] = step.save();
      }
    });
    const auto restore_on_two = [&](const std::function<std::span<const std::byte>(int, int)>& source) {
      return gradapt_test::errors_of(2, quick, [&](threads& comm) {
        const gradapt::host b;
        model<float> m;
        auto step =
            make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, zero_state<1>{});
        const auto before = step.save();
        try {
          step.restore([&](int r) { return source(comm.rank(), r); },
                       gradapt::train::rescale_rule::linear_lr);
        } catch (const gradapt::error&) {
          const bool unchanged = step.steps() == 0 && step.save() == before && step.settings().lr == 0.1;
          RANK_REQUIRE(unchanged);
          throw;
        }
      });
    };
    // The rank that read the bad checkpoint names it; every other rank names that rank.
    const auto named = [](const std::vector<std::string>& what, const std::string& why) {
      int naming = 0;
      for (const auto& w : what) {
        CHECK_THAT(w, Contains("restore") || Contains("sharded_optimizer::load"));
        naming += w.find(why) != std::string::npos ? 1 : 0;
      }
      CHECK(naming >= 1);
    };
    std::vector<std::byte> damaged = two[2];
    damaged[damaged.size() / 3] ^= std::byte{4};
    named(restore_on_two([&](int, int r) -> std::span<const std::byte> { return r == 2 ? damaged : two[r]; }),
          "old rank 2's checkpoint: archive");
    named(restore_on_two([&](int, int r) -> std::span<const std::byte> { return r == 1 ? one[r] : two[r]; }),
          "old rank 1's checkpoint is of step 1 but old rank 0's of step 2");
    const auto what = restore_on_two([&](int me, int r) -> std::span<const std::byte> {
      if (me == 1) throw gradapt::error("the file of old rank " + std::to_string(r) + " is missing");
      return two[r];
    });
    CHECK_THAT(what[1], Contains("the file of old rank 0 is missing"));
    CHECK_THAT(what[0], Contains("rank 1"));
    run_threads(2, quick, [&](threads& comm) {  // the intact checkpoints restore
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, zero_state<1>{});
      step.restore([&](int r) { return std::span<const std::byte>(two[static_cast<std::size_t>(r)]); },
                   gradapt::train::rescale_rule::linear_lr);
      RANK_REQUIRE(step.steps() == 2);
      RANK_REQUIRE(step.settings().lr == 0.1 * 2.0 / 3.0);
    });
  }
  SECTION("ranks that differ in the sharding options") {
    const auto what = construction_errors(2, [](threads& comm, auto build) {
      gradapt::shard::sharded_options o;
      if (comm.rank() == 1) o.bucket_elements = 1000;
      build(zero_state<1>{.sharding = o});
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("bucket_elements"));
  }
  SECTION("one rank misses, repeats or misplaces a mark: every rank throws, none waits, the next step runs") {
    // Small buckets (several per step) and blocking collectives (comm::threads): ranks that
    // marked everything wait in a bucket's allreduce for the rank at fault, which step() joins.
    const gradapt::train::bucket_reduce small{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
    const auto scaler = gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 1000});
    enum class fault { missing, twice, out_of_range };
    const auto check = [&](auto make, fault f, const char* why) {
      const auto what = gradapt_test::errors_of(3, quick, [&](threads& comm) {
        const gradapt::host b;
        model<float> m;
        auto step = make(comm, b, m);
        for (int k = 1; k <= 2; ++k) {
          m.make_grads(comm.rank(), k);
          for (std::size_t t = m.params.size(); t-- > 0;) {
            const bool at_fault = k == 1 && comm.rank() == 1 && t == 3;
            if (at_fault && f == fault::missing) continue;
            step.mark_ready(t);
            if (at_fault && f == fault::twice) step.mark_ready(t);
            if (at_fault && f == fault::out_of_range) step.mark_ready(m.params.size() + 2);
          }
          if (k == 1) {
            bool threw = false;
            try {
              step.step();
            } catch (const gradapt::error&) {
              threw = true;
            }
            RANK_REQUIRE(threw);
            RANK_REQUIRE(step.steps() == 0);
          } else {
            const bool stepped = step.step().stepped;  // the marks started afresh
            RANK_REQUIRE(stepped);
            throw gradapt::error(std::string("recovered: ") + why);
          }
        }
      });
      CHECK_THAT(what[1], Contains("recovered"));
      for (const auto& w : what) CHECK_THAT(w, Contains("recovered"));
    };
    for (const fault f : {fault::missing, fault::twice, fault::out_of_range}) {
      check(
          [&](threads& comm, const gradapt::host& b, model<float>& m) {
            return make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, small);
          },
          f, "buckets");
      check(
          [&](threads& comm, const gradapt::host& b, model<float>& m) {
            return make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, small, scaler);
          },
          f, "buckets and scaler");
      check(
          [&](threads& comm, const gradapt::host& b, model<float>& m) {
            return make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1},
                                           zero_state<2>{.sharding = {.buckets = {.cap_bytes = 40000}}});
          },
          f, "zero_state<2>");
    }
    // What the ranks say: the rank at fault names the gradient, the others name that rank.
    const auto what = gradapt_test::errors_of(3, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::adamw(), {.lr = 0.1}, small);
      m.make_grads(comm.rank(), 1);
      for (std::size_t t = m.params.size(); t-- > 0;)
        if (!(comm.rank() == 1 && t == 3)) step.mark_ready(t);
      step.step();
    });
    CHECK_THAT(
        what[1],
        Contains(
            "7 of 8 gradients were marked ready before step(), the first missing being gradient 3 ('w3')"));
    CHECK_THAT(what[0], Contains("rank 1"));
    CHECK_THAT(what[2], Contains("rank 1"));
  }
  SECTION("zero_state<2>: a step before every gradient is marked") {
    const auto what = gradapt_test::errors_of(2, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      auto step = make_data_parallel_step(comm, b, m.params, gradapt::sgd(), {.lr = 0.1}, zero_state<2>{});
      m.make_grads(comm.rank(), 1);
      for (std::size_t t = 0; t + 1 < m.params.size(); ++t) step.mark_ready(t);
      step.step();
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("gradient 7") || Contains("passed invalid input"));
  }
}

TEST_CASE("loss_scaler::decide: a count that is not finite and >= 0 on one rank is an error on every rank",
          "[train][zero]") {
  for (const double bad : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    const auto what = gradapt_test::errors_of(3, quick, [bad](threads& comm) {
      auto scaler = gradapt::loss_scaler({.init_scale = 1024});
      (void)scaler.decide(comm, comm.rank() == 1 ? bad : 0.0);
    });
    CHECK_THAT(what[1], Contains("loss_scaler::decide on rank 1: found is") && Contains("finite and >= 0"));
    CHECK_THAT(what[0], Contains("other rank(s) passed invalid input"));
    CHECK_THAT(what[2], Contains("other rank(s) passed invalid input"));
  }
  run_threads(2, quick, [](threads& comm) {  // a valid count decides as unscale would
    auto scaler = gradapt::loss_scaler({.init_scale = 1024});
    const bool step = scaler.decide(comm, comm.rank() == 0 ? 3.0 : 0.0);
    RANK_REQUIRE(!step);
    RANK_REQUIRE(scaler.scale() == 512.0);
  });
}

}  // namespace gradapt_test_train_zero

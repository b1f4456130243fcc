// The composed step's slots in combination: a covering array over
//
//   optimizer {SGD with momentum, AdamW, LAMB, LARS, Adafactor factored, SM3}
//   × state {replicated, zero_state<1>, zero_state<2>} × reduce {one buffer, buckets, hierarchical}
//   × combine {mean, Adasum} × loss scaler {off, on} × AdaScale {off, on} × sync {every step, LocalSGD}
//
// in which every pair of values that the slots allow together appears in at least one row (30
// rows, five per optimizer: buckets, hierarchical, ZeRO-1, ZeRO-2 and Adasum, with the flags
// varied across them). Each row runs 20 steps on comm::threads with 1, 2, 3 and 5 ranks (3
// under a sanitizer), with an overflow on the last rank at step 5 when the scaler is on, and a
// save at step 10 loaded into a fresh step that runs the rest. Its reference is the same recipe
// with the state replicated and the gradients reduced in one buffer, run without the
// checkpoint. Gradients differ by rank and are multiples of 2^-6 below 2^5, so every partial
// sum is exact and the order of a reduction (shards, buckets, groups) does not change a bit:
// the parameters must then equal the reference's bit for bit, as the docs promise for these
// slots on comm::threads. With AdaScale the noise scale's norms are summed in another order per
// slot (in double; the estimator's difference of two norms amplifies the rounding), so the gain
// agrees to 1e-9 and the parameters to 1e-6 (relative, + 1e-3). K-FAC is covered with each
// reduce slot in tests/test_train_kfac.cpp; the invalid pairs fail to compile
// (tests/compile_fail/train_slots.cpp).
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"
#include "scenarios/sharded.hpp"

namespace gradapt_test_train_combinations {

namespace train = gradapt::train;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using sharded_scenario::model;
using sharded_scenario::same_bits;
using train::allreduce_mean;
using train::bucket_reduce;
using train::hierarchical_reduce;
using train::one_buffer_reduce;
using train::replicated_state;
using train::zero_state;
using adasum = train::adasum_combine;

namespace {

// Under a sanitizer (the asan preset, at -O0) the rows run on 3 ranks only: that build looks
// for memory and UB errors, which every world size reaches on the same code; the default
// preset runs every world size.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int worlds[] = {3};
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr int worlds[] = {3};
#else
constexpr int worlds[] = {1, 2, 3, 5};
#endif
#else
constexpr int worlds[] = {1, 2, 3, 5};
#endif

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};
constexpr int steps = 20, overflow_at = 5, saved_at = 10;
const gradapt::shard::sharded_options tensor_cut{.partition = {.mode = gradapt::shard::granularity::tensor}};
const zero_state<1> z1{.allow_empty_shards = true};
const zero_state<2> z2{.sharding = {.buckets = {.cap_bytes = 40000}}, .allow_empty_shards = true};
const zero_state<1> z1_whole{.sharding = tensor_cut, .allow_empty_shards = true};
const zero_state<2> z2_whole{.sharding = {.partition = tensor_cut.partition, .buckets = {.cap_bytes = 40000}},
                             .allow_empty_shards = true};
const bucket_reduce buckets{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
const hierarchical_reduce hier{};  // grouped by host name: one group here, the sum's order is the flat one's
const hierarchical_reduce pairs{.hierarchy = {.group_size = 1}};  // one rank per group

/// This rank's gradients at step k: full-mantissa values rounded to multiples of 2^-6 (at most
/// 2^4 in magnitude), so that sums over up to 5 ranks are exact in any order.
void exact_grads(model<float>& m, int rank, int k, double scale) {
  m.make_grads(rank, k);
  for (auto& t : m.g)
    for (auto& x : t) x = static_cast<float>(std::round(static_cast<double>(x) * 64.0) / 64.0 * scale);
}

/// The composed step with the given state, reduce and combine slots and, by the flags, the
/// loss scaler, AdaScale and LocalSGD.
template <bool Scale, bool Ada, bool Local, class Opt, class State, class Reduce, class Combine>
auto make(threads& comm, model<float>& m, const Opt& opt, const State& state, const Reduce& reduce,
          const Combine& combine, double lr) {
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
        return train::make_data_parallel_step(comm, gradapt::host{}, m.params, opt,
                                              {.lr = lr, .local_batch = 8}, state, reduce, combine, p...);
      },
      std::tuple_cat(scaler, ada, local));
}

/// One step: this rank's gradients times the loss scale (with the scaler, an overflow on the
/// last rank at overflow_at), marked in the backward's order when the step reduces during the backward pass.
template <class Step>
train::step_metrics one_step(Step& step, model<float>& m, threads& comm, int k) {
  exact_grads(m, comm.rank(), k, step.loss_scale());
  if constexpr (Step::has_loss_scaling)
    if (k == overflow_at && comm.rank() == comm.size() - 1)
      m.g[2][1] = std::numeric_limits<float>::infinity();
  if constexpr (Step::marks_gradients)
    for (std::size_t t = m.params.size(); t-- > 0;) step.mark_ready(t);
  return step.step();
}

/// One row of the array against its reference (see the file comment).
template <bool Scale, bool Ada, bool Local, class Opt, class State, class Reduce, class Combine>
void row(const char* name, const Opt& opt, const State& state, const Reduce& reduce, const Combine& combine) {
  for (const int n : worlds) {
    INFO(name << " on " << n << " ranks");
    run_threads(n, quick, [&](threads& comm) {
      model<float> a, c;
      auto reference =
          make<Scale, Ada, Local>(comm, a, opt, replicated_state{}, one_buffer_reduce{}, combine, 1e-2);
      std::vector<train::step_metrics> ref;
      for (int k = 1; k <= steps; ++k) ref.push_back(one_step(reference, a, comm, k));
      std::vector<std::byte> saved;
      {
        auto first = make<Scale, Ada, Local>(comm, c, opt, state, reduce, combine, 1e-2);
        for (int k = 1; k <= saved_at; ++k) {
          const auto got = one_step(first, c, comm, k);
          const auto& want = ref[static_cast<std::size_t>(k - 1)];
          const bool same = got.found_inf == want.found_inf && got.stepped == want.stepped &&
                            got.loss_scale == want.loss_scale && got.averaged == want.averaged;
          RANK_REQUIRE(same);
        }
        saved = first.save();  // with LocalSGD or ZeRO, this rank's own
      }
      auto second = make<Scale, Ada, Local>(comm, c, opt, state, reduce, combine, 0.5);
      second.load(saved);
      double worst_gain = 0.0;
      for (int k = saved_at + 1; k <= steps; ++k) {
        const auto got = one_step(second, c, comm, k);
        const auto& want = ref[static_cast<std::size_t>(k - 1)];
        const bool same = got.found_inf == want.found_inf && got.optimizer_steps == want.optimizer_steps &&
                          got.loss_scale == want.loss_scale && got.averaged == want.averaged;
        RANK_REQUIRE(same);
        if (want.gain > 0.0) worst_gain = std::max(worst_gain, std::abs(got.gain - want.gain) / want.gain);
      }
      RANK_REQUIRE(ref[static_cast<std::size_t>(overflow_at - 1)].found_inf == Scale);
      if constexpr (Ada) {
        RANK_REQUIRE(worst_gain <= 1e-9);
        double worst = 0.0;
        for (std::size_t t = 0; t < a.p.size(); ++t)
          for (std::size_t i = 0; i < a.p[t].size(); ++i)
            worst = std::max(worst, std::abs(static_cast<double>(c.p[t][i]) - a.p[t][i]) /
                                        (std::abs(static_cast<double>(a.p[t][i])) + 1e-3));
        RANK_REQUIRE(worst <= 1e-6);
      } else {
        for (std::size_t t = 0; t < a.p.size(); ++t) RANK_REQUIRE(same_bits(a.p[t], c.p[t]));
      }
    });
  }
}

const auto sgd = gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3});
const auto adamw = gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01});
const auto lamb = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
const auto lars = gradapt::lars({.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9});
const auto adafactor = gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5});
const auto sm3 = gradapt::sm3({.lr = 0.1, .momentum = 0.9});

}  // namespace

// Rows: <scaler, AdaScale, LocalSGD>(optimizer, state, reduce, combine). Per optimizer: buckets,
// hierarchical, ZeRO-1, ZeRO-2 and Adasum rows, the flags varied so that every pair of
// (state, reduce, combine, scaler, AdaScale, sync) values allowed together, and every
// optimizer with each of those values, is in some row.
TEST_CASE("slots in combination: SGD and AdamW rows", "[train][combinations]") {
  row<true, false, false>("sgd, buckets, scaler", sgd, replicated_state{}, buckets, allreduce_mean{});
  row<false, true, true>("sgd, hierarchical, AdaScale, LocalSGD", sgd, replicated_state{}, pairs,
                         allreduce_mean{});
  row<false, true, false>("sgd, zero_state<1>, AdaScale", sgd, z1, one_buffer_reduce{}, allreduce_mean{});
  row<true, false, false>("sgd, zero_state<2>, scaler", sgd, z2, one_buffer_reduce{}, allreduce_mean{});
  row<true, false, true>("sgd, Adasum, scaler, LocalSGD", sgd, replicated_state{}, one_buffer_reduce{},
                         adasum{});
  row<false, true, false>("adamw, buckets, AdaScale", adamw, replicated_state{}, buckets, allreduce_mean{});
  row<true, false, true>("adamw, hierarchical, scaler, LocalSGD", adamw, replicated_state{}, hier,
                         allreduce_mean{});
  row<true, false, false>("adamw, zero_state<1>, scaler", adamw, z1, one_buffer_reduce{}, allreduce_mean{});
  row<false, true, false>("adamw, zero_state<2>, AdaScale", adamw, z2, one_buffer_reduce{}, allreduce_mean{});
  row<false, false, false>("adamw, Adasum", adamw, replicated_state{}, one_buffer_reduce{}, adasum{});
}

TEST_CASE("slots in combination: LAMB and LARS rows", "[train][combinations]") {
  row<true, true, false>("lamb, buckets, scaler, AdaScale", lamb, replicated_state{}, buckets,
                         allreduce_mean{});
  row<true, true, true>("lamb, hierarchical, scaler, AdaScale, LocalSGD", lamb, replicated_state{}, pairs,
                        allreduce_mean{});
  row<true, true, false>("lamb, zero_state<1>, scaler, AdaScale", lamb, z1, one_buffer_reduce{},
                         allreduce_mean{});
  row<true, true, false>("lamb, zero_state<2>, scaler, AdaScale", lamb, z2, one_buffer_reduce{},
                         allreduce_mean{});
  row<false, false, false>("lamb, Adasum", lamb, replicated_state{}, one_buffer_reduce{}, adasum{});
  row<false, true, false>("lars, buckets, AdaScale", lars, replicated_state{}, buckets, allreduce_mean{});
  row<false, false, true>("lars, hierarchical, LocalSGD", lars, replicated_state{}, hier, allreduce_mean{});
  row<false, false, false>("lars, zero_state<1>", lars, z1, one_buffer_reduce{}, allreduce_mean{});
  row<false, false, false>("lars, zero_state<2>", lars, z2, one_buffer_reduce{}, allreduce_mean{});
  row<true, false, true>("lars, Adasum, scaler, LocalSGD", lars, replicated_state{}, one_buffer_reduce{},
                         adasum{});
}

TEST_CASE("slots in combination: Adafactor and SM3 rows (factored, whole tensors per rank)",
          "[train][combinations]") {
  row<true, false, false>("adafactor, buckets, scaler", adafactor, replicated_state{}, buckets,
                          allreduce_mean{});
  row<false, true, false>("adafactor, hierarchical, AdaScale", adafactor, replicated_state{}, pairs,
                          allreduce_mean{});
  row<false, true, false>("adafactor, zero_state<1>, AdaScale", adafactor, z1_whole, one_buffer_reduce{},
                          allreduce_mean{});
  row<true, true, false>("adafactor, zero_state<2>, scaler, AdaScale", adafactor, z2_whole,
                         one_buffer_reduce{}, allreduce_mean{});
  row<true, false, true>("adafactor, Adasum, scaler, LocalSGD", adafactor, replicated_state{},
                         one_buffer_reduce{}, adasum{});
  row<false, true, false>("sm3, buckets, AdaScale", sm3, replicated_state{}, buckets, allreduce_mean{});
  row<true, true, true>("sm3, hierarchical, scaler, AdaScale, LocalSGD", sm3, replicated_state{}, hier,
                        allreduce_mean{});
  row<true, false, false>("sm3, zero_state<1>, scaler", sm3, z1_whole, one_buffer_reduce{}, allreduce_mean{});
  row<false, false, false>("sm3, zero_state<2>", sm3, z2_whole, one_buffer_reduce{}, allreduce_mean{});
  row<false, false, false>("sm3, Adasum", sm3, replicated_state{}, one_buffer_reduce{}, adasum{});
}

}  // namespace gradapt_test_train_combinations

// The composed step (train::data_parallel_step) on a backend and communicator whose memory space
// is not the host's (the CUDA backend with comm::nccl), run on the host through the device-tagged
// backend and communicator of support/host_as_device.hpp on 1, 2 and 3 ranks (3 under a
// sanitizer). Every slot the device configuration takes is in some row:
//   - the loss scaler: its overflow and error flags in backend memory, the gradients unscaled in
//     one pass, or gradient by gradient in mark_ready with zero_state<2> or bucket_reduce;
//   - allreduce_mean, and AdaScale (the noise-scale sums through backend buffers), and
//     adasum_combine (its workspace over backend buffers);
//   - LocalSGD (its round agreement and averaging);
//   - replicated state, zero_state<1> and zero_state<2>;
//   - bucket_reduce (fused buffers from the backend, packing copies and the mean as backend
//     operations) and hierarchical_reduce (comm::hierarchy over the device-tagged communicator's
//     splits, its scratch and agreement words in backend buffers).
// The construction, per-step and replica agreements travel through backend buffers. Each row
// saves at step 10 and loads into a fresh step for steps 11 to 20.
//
// Each row runs the same recipe twice on the same ranks, once on the host step (gradapt::host,
// comm::threads) and once on the device path, with gradients that are multiples of 2^-6 (every
// partial sum exact) and an overflow on the last rank at step 5 when the scaler is on. The
// parameters must equal the host step's bit for bit and the metrics must match. With AdaScale the
// host communicator forms the noise scale's norms inside its allreduce and the device path by two
// backend reductions, in another order: the gain then agrees to 1e-9 and the parameters to 1e-6
// (relative, + 1e-3). A rank that differs in an option or a step's learning rate makes every
// rank throw through the same staged agreements.
#include "catch.hpp"

#include <chrono>
#include <cmath>
#include <cstddef>
#include <string>
#include <tuple>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "host_as_device.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "sanitizer.hpp"
#include "scenarios/train_combinations.hpp"

namespace gradapt_test_train_device_path {

using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
namespace train = gradapt::train;
namespace scenario = train_combinations_scenario;
using scenario::flags;
using sharded_scenario::model;

namespace {

const std::vector<int> worlds =
    gradapt_test::under_sanitizer ? std::vector<int>{3} : std::vector<int>{1, 2, 3};
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};
// 20 steps saved after 10; 12 after 6 under a sanitizer (row_options' counts).
const int steps = scenario::row_options{}.steps, saved_at = scenario::row_options{}.saved_at;

/// Steps 1 to `steps` of a row on `m` (through `params`, host or device-tagged views of m's
/// tensors), saved after step `saved_at` and loaded into a fresh step; the metrics of each step.
template <bool Scale, bool Ada, bool Local, class Comm, class B, class PL, class Opt, class State,
          class Reduce, class Combine>
std::vector<train::step_metrics> run(Comm& comm, const B& backend, model<float>& m, const PL& params,
                                     const Opt& opt, const State& state, const Reduce& reduce,
                                     const Combine& combine) {
  std::vector<train::step_metrics> out;
  std::vector<std::byte> saved;
  {
    auto first =
        scenario::make_step<Scale, Ada, Local>(comm, backend, params, opt, state, reduce, combine, 1e-2);
    for (int k = 1; k <= saved_at; ++k) out.push_back(scenario::one_step(first, m, comm, k));
    saved = first.save();
  }
  auto second =
      scenario::make_step<Scale, Ada, Local>(comm, backend, params, opt, state, reduce, combine, 0.5);
  second.load(saved);  // restores the settings (lr 1e-2) with the state
  for (int k = saved_at + 1; k <= steps; ++k) out.push_back(scenario::one_step(second, m, comm, k));
  return out;
}

/// One row on this rank: the host step and the device path, compared (see the file comment).
template <bool Scale, bool Ada, bool Local, class Opt, class State, class Reduce = train::one_buffer_reduce,
          class Combine = train::allreduce_mean>
void row_matches(threads& c, flags<Scale, Ada, Local>, const Opt& opt, const State& state,
                 const Reduce& reduce = {}, const Combine& combine = {}) {
  const gradapt::host hb{.threads = 1};
  const host_as_device::backend db;
  host_as_device::comm dc{&c};
  model<float> h, d;
  const auto dparams = host_as_device::on_device(d.params);
  const auto want = run<Scale, Ada, Local>(c, hb, h, h.params, opt, state, reduce, combine);
  const auto got = run<Scale, Ada, Local>(dc, db, d, dparams, opt, state, reduce, combine);
  RANK_REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    RANK_REQUIRE(got[k].found_inf == want[k].found_inf);
    RANK_REQUIRE(got[k].stepped == want[k].stepped);
    RANK_REQUIRE(got[k].synchronous == want[k].synchronous);
    RANK_REQUIRE(got[k].averaged == want[k].averaged);
    RANK_REQUIRE(got[k].loss_scale == want[k].loss_scale);
    RANK_REQUIRE(got[k].optimizer_steps == want[k].optimizer_steps);
    RANK_REQUIRE(got[k].state_bytes == want[k].state_bytes);
    if constexpr (Ada)
      RANK_REQUIRE(std::abs(got[k].gain - want[k].gain) <= 1e-9 * want[k].gain);
    else
      RANK_REQUIRE(got[k].gain == want[k].gain);
  }
  RANK_REQUIRE(want[scenario::overflow_at - 1].found_inf == Scale);
  for (std::size_t t = 0; t < h.p.size(); ++t) {
    if constexpr (Ada) {
      double worst = 0.0;
      for (std::size_t i = 0; i < h.p[t].size(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(d.p[t][i]) - h.p[t][i]) /
                                    (std::abs(static_cast<double>(h.p[t][i])) + 1e-3));
      RANK_REQUIRE(worst <= 1e-6);
    } else {
      RANK_REQUIRE(sharded_scenario::same_bits(h.p[t], d.p[t]));
    }
  }
}

const auto on_threads = [](const char* name, auto... row) {
  for (const int n : worlds) {
    INFO(name << " on " << n << " ranks");
    run_threads(n, quick, [&](threads& c) { row_matches(c, row...); });
  }
};

}  // namespace

TEST_CASE("the composed step's device path equals the host step, replicated state", "[train][device]") {
  using train::replicated_state;
  on_threads("sgd, scaler", flags<true, false, false>{}, scenario::sgd, replicated_state{});
  on_threads("adamw, scaler, AdaScale", flags<true, true, false>{}, scenario::adamw, replicated_state{});
  on_threads("lamb, scaler, LocalSGD", flags<true, false, true>{}, scenario::lamb, replicated_state{});
  on_threads("sm3, AdaScale, LocalSGD", flags<false, true, true>{}, scenario::sm3, replicated_state{});
}

TEST_CASE("the composed step's device path equals the host step, zero_state<1> and <2>", "[train][device]") {
  // LAMB, LARS and the factored chains are sharded by whole tensors on the device path.
  on_threads("adamw, zero_state<1>, scaler", flags<true, false, false>{}, scenario::adamw, scenario::z1);
  on_threads("lars, zero_state<1>, scaler, AdaScale", flags<true, true, false>{}, scenario::lars,
             scenario::z1_whole);
  on_threads("sgd, zero_state<2>, scaler (flags set in mark_ready)", flags<true, false, false>{},
             scenario::sgd, scenario::z2);
  on_threads("adafactor, zero_state<2>, scaler, AdaScale", flags<true, true, false>{}, scenario::adafactor,
             scenario::z2_whole);
}

TEST_CASE("the composed step's device path equals the host step, bucket_reduce", "[train][device]") {
  using train::replicated_state;
  on_threads("sgd, buckets, scaler (marks)", flags<true, false, false>{}, scenario::sgd, replicated_state{},
             scenario::buckets);
  on_threads("adamw, buckets, scaler, AdaScale", flags<true, true, false>{}, scenario::adamw,
             replicated_state{}, scenario::buckets);
  on_threads("adafactor, buckets", flags<false, false, false>{}, scenario::adafactor, replicated_state{},
             scenario::buckets);
}

TEST_CASE("the composed step's device path equals the host step, adasum_combine", "[train][device]") {
  using train::replicated_state;
  const train::one_buffer_reduce one;
  on_threads("sgd, Adasum, scaler", flags<true, false, false>{}, scenario::sgd, replicated_state{}, one,
             scenario::adasum{});
  on_threads("lamb, Adasum, LocalSGD", flags<false, false, true>{}, scenario::lamb, replicated_state{}, one,
             scenario::adasum{});
}

TEST_CASE("the composed step's device path equals the host step, hierarchical_reduce", "[train][device]") {
  using train::replicated_state;
  // Grouped by host name (one group: the host names travel through a staged allgather), one
  // rank per group, and two groups of two, where the model's odd-sized tensors take the padded
  // three-step path (reduce_scatter, cross allreduce, allgather) through backend scratch.
  on_threads("sgd, hierarchical by host, scaler", flags<true, false, false>{}, scenario::sgd,
             replicated_state{}, scenario::hier);
  on_threads("lamb, hierarchical pairs, AdaScale, LocalSGD", flags<false, true, true>{}, scenario::lamb,
             replicated_state{}, scenario::pairs);
  const train::hierarchical_reduce two{.hierarchy = {.group_size = 2}};
  for (const int n : {2, 4}) {
    INFO("groups of two on " << n << " ranks");
    run_threads(n, quick, [&](threads& c) {
      row_matches(c, flags<true, false, false>{}, scenario::adamw, replicated_state{}, two);
    });
  }
}

TEST_CASE("the composed step's device path: a rank that differs throws on every rank", "[train][device]") {
  SECTION("an optimizer option at construction") {
    const auto what = gradapt_test::errors_of(3, quick, [&](threads& c) {
      const host_as_device::backend db;
      host_as_device::comm dc{&c};
      model<float> m;
      const auto dparams = host_as_device::on_device(m.params);
      const auto opt = gradapt::adamw({.lr = 1e-2, .weight_decay = c.rank() == 1 ? 0.02 : 0.01});
      auto step = train::make_data_parallel_step(dc, db, dparams, opt, {.lr = 1e-2, .local_batch = 8},
                                                 gradapt::loss_scaler({}));
    });
    for (const auto& w : what) {
      CHECK_THAT(w, Contains("train::data_parallel_step"));
      CHECK_THAT(w, Contains("weight_decay"));
    }
  }
  SECTION("a step's learning rate, with the loss scaler and zero_state<2>") {
    const auto what = gradapt_test::errors_of(3, quick, [&](threads& c) {
      const host_as_device::backend db;
      host_as_device::comm dc{&c};
      model<float> m;
      const auto dparams = host_as_device::on_device(m.params);
      auto step =
          train::make_data_parallel_step(dc, db, dparams, scenario::sgd, {.lr = 1e-2, .local_batch = 8},
                                         gradapt::loss_scaler({}), scenario::z2);
      scenario::one_step(step, m, dc, 1);
      scenario::exact_grads(m, c.rank(), 2, step.loss_scale());
      for (std::size_t t = 0; t < m.params.size(); ++t) step.mark_ready(t);
      step.step({.lr = c.rank() == 2 ? 0.5 : 1e-2});
    });
    for (const auto& w : what) {
      CHECK_THAT(w, Contains("train::data_parallel_step::step"));
      CHECK_THAT(w, Contains("learning rate"));
    }
  }
}

}  // namespace gradapt_test_train_device_path

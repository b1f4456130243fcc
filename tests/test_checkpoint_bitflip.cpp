// Every kind of state saved through the state archive rejects every single-bit flip of its
// checkpoint with a gradapt::error and is left unchanged (its next save gives the same bytes).
// K-FAC's state is flipped in tests/test_kfac.cpp (it needs the linear-algebra library) and
// Shampoo's in tests/test_shampoo.cpp. Under a sanitizer a sample of the bits is flipped
// (support/bit_flips.hpp's flips_bit); the default preset flips every one.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "bit_flips.hpp"
#include "catch.hpp"
#include "checkpoint_model.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/elastic/policy.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace gradapt_test_checkpoint_bitflip {

namespace {

using gradapt_test::flip_every_bit;
using gradapt_test::model;

template <class Opt>
void optimizer_case(const Opt& opt, const char* label) {
  INFO(label);
  model m;
  gradapt::host b{};
  auto st = opt.init(b, m.params);
  for (int t = 1; t <= 3; ++t) {
    m.grads(t);
    opt.step(b, m.params, st, {.lr = 1e-2});
  }
  const auto good = st.save(b);
  const std::size_t n = flip_every_bit(
      good, [&](std::span<const std::byte> bad) { st.load(b, bad); }, [&] { return st.save(b); });
  REQUIRE(n == gradapt_test::flips_for(good.size()));
  REQUIRE(st.steps() == 3);
}

}  // namespace

TEST_CASE("bit flips: optimizer states (AdamW, LAMB, Adafactor, SM3)", "[archive][checkpoint]") {
  optimizer_case(gradapt::adamw({.weight_decay = 0.01}), "adamw");
  optimizer_case(gradapt::lamb({.weight_decay = 0.01}), "lamb");
  optimizer_case(gradapt::adafactor({.min_dim_size_to_factor = 2}), "adafactor");
  optimizer_case(gradapt::adafactor({.min_dim_size_to_factor = 2, .momentum = 0.9}),
                 "adafactor with momentum");
  optimizer_case(gradapt::sm3({.momentum = 0.0}), "sm3");
  optimizer_case(gradapt::sm3({.momentum = 0.9}), "sm3 with momentum");
}

TEST_CASE("bit flips: loss scaler, noise scale, AdaScale", "[archive][checkpoint]") {
  gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 3});
  for (int t = 0; t < 5; ++t) (void)scaler.update(t == 2);
  auto good = scaler.save();
  flip_every_bit(
      good, [&](std::span<const std::byte> bad) { scaler.load(bad); }, [&] { return scaler.save(); });

  gradapt::gradient_noise_scale gns({.smoothing = 0.9});
  for (int t = 1; t <= 4; ++t) gns.update(0.5 + 0.1 * t, 8.0, 0.2 + 0.01 * t, 32.0);
  good = gns.save();
  flip_every_bit(
      good, [&](std::span<const std::byte> bad) { gns.load(bad); }, [&] { return gns.save(); });

  gradapt::adascale ada({.scale = 4.0});
  for (int t = 0; t < 3; ++t) ada.advance(gns, 8.0);
  good = ada.save();
  flip_every_bit(
      good, [&](std::span<const std::byte> bad) { ada.load(bad); }, [&] { return ada.save(); });
}

TEST_CASE("bit flips: LocalSGD with each schedule", "[archive][checkpoint]") {
  gradapt::comm::single comm;
  gradapt::host b{};
  std::vector<float> x(7, 1.0f);
  const std::vector<gradapt::tensor_view<float>> xs{gradapt::host_view(x)};
  const auto run = [&](auto schedule, const char* label) {
    INFO(label);
    gradapt::local_sgd lsgd(comm, {.start_step = 2}, schedule);
    for (int t = 0; t < 9; ++t) {
      if constexpr (decltype(schedule)::uses_loss)
        lsgd.step(comm, b, {.loss = 1.0 / (1 + t), .lr = 0.1}, std::span(xs));
      else
        lsgd.step(comm, b, std::span(xs));
    }
    const auto good = lsgd.save();
    flip_every_bit(
        good, [&](std::span<const std::byte> bad) { lsgd.load(bad); }, [&] { return lsgd.save(); });
  };
  run(gradapt::fixed_period({.period = 3}), "fixed_period");
  run(gradapt::adaptive_period({.initial_period = 2, .max_period = 8}), "adaptive_period");
  run(gradapt::hierarchical_period(
          {.levels = {{.period = 2, .group_size = 1},
                      {.period = 4, .group_size = gradapt::hierarchical_level::world}}}),
      "hierarchical_period");
}

TEST_CASE("bit flips: the data-parallel train step", "[archive][checkpoint][train]") {
  gradapt::comm::run_threads(2, [&](gradapt::comm::threads& comm) {
    model m;
    gradapt::host b{};
    auto step = gradapt::train::make_data_parallel_step(
        comm, b, m.params, gradapt::lamb({.weight_decay = 0.01}), {.lr = 0.01, .local_batch = 8},
        gradapt::loss_scaler({.init_scale = 256.0}), gradapt::train::adascale_policy{.base_batch = 8});
    for (int t = 1; t <= 3; ++t) {
      m.grads(t + comm.rank());
      step.step({.loss = 1.0});
    }
    const auto good = step.save();
    // Rank 0 flips every bit; the load is not collective.
    if (comm.rank() == 0)
      flip_every_bit(
          good, [&](std::span<const std::byte> bad) { step.load(bad); }, [&] { return step.save(); });
  });
}

TEST_CASE("bit flips: sharded optimizer states (AdamW by element, Adafactor factored by tensor)",
          "[archive][checkpoint][shard]") {
  const auto one = [](const auto& chain, const gradapt::shard::sharded_options& so, const char* label) {
    INFO(label);
    gradapt::comm::single comm;
    model m;
    gradapt::host b{};
    const gradapt::shard::sharded_optimizer opt(chain, so);
    auto st = opt.init(comm, b, m.params);
    for (int t = 1; t <= 3; ++t) {
      m.grads(t);
      opt.step(comm, b, m.params, st, {.lr = 1e-2});
    }
    const auto good = st.save(b);
    flip_every_bit(
        good,
        [&](std::span<const std::byte> bad) { st = opt.load(comm, b, m.params, [&](int) { return bad; }); },
        [&] { return st.save(b); });
    REQUIRE(st.steps() == 3);
  };
  one(gradapt::adamw({.weight_decay = 0.01}), {}, "adamw");
  one(gradapt::adafactor({.min_dim_size_to_factor = 2}),
      {.partition = {.mode = gradapt::shard::granularity::tensor}}, "adafactor");
}

TEST_CASE("bit flips: the train step with zero_state<2> and with hierarchical_reduce",
          "[archive][checkpoint][train]") {
  gradapt::comm::single comm;
  const auto flips = [&](auto& step, model& m) {
    for (int t = 1; t <= 3; ++t) {
      m.grads(t);
      if constexpr (std::remove_reference_t<decltype(step)>::marks_gradients)
        for (std::size_t k = m.params.size(); k-- > 0;) step.mark_ready(k);
      step.step({.loss = 1.0});
    }
    const auto good = step.save();
    flip_every_bit(
        good, [&](std::span<const std::byte> bad) { step.load(bad); }, [&] { return step.save(); });
  };
  model a, c;
  gradapt::host b{};
  auto zero = gradapt::train::make_data_parallel_step(comm, b, a.params, gradapt::adamw({}), {.lr = 0.01},
                                                      gradapt::loss_scaler({.init_scale = 256.0}),
                                                      gradapt::train::zero_state<2>{});
  flips(zero, a);
  auto hier = gradapt::train::make_data_parallel_step(comm, b, c.params, gradapt::lamb({}), {.lr = 0.01},
                                                      gradapt::train::hierarchical_reduce{});
  flips(hier, c);
}

TEST_CASE("bit flips: grouped noise scale, elastic job policies", "[archive][checkpoint][elastic]") {
  model m;
  gradapt::grouped_noise_scale grouped({.smoothing = 0.8}, m.params);
  std::vector<double> local(grouped.slots()), global(grouped.slots());
  for (int t = 1; t <= 3; ++t) {
    for (std::size_t k = 0; k < local.size(); ++k) {
      local[k] = 0.5 + 0.1 * t + 0.01 * static_cast<double>(k);
      global[k] = 0.3 + 0.05 * t + 0.01 * static_cast<double>(k);
    }
    grouped.update_reduced(local, global, 4, {.micro_batch = 8});
  }
  auto good = grouped.save();
  flip_every_bit(
      good, [&](std::span<const std::byte> bad) { grouped.load(bad); }, [&] { return grouped.save(); });

  // The job's policies (sync_switch_policy keeps a reference throughput and its counters),
  // after the warm-up has recorded its samples.
  gradapt::comm::single comm;
  gradapt::host b{};
  auto step = gradapt::train::make_data_parallel_step(comm, b, m.params, gradapt::adamw({}),
                                                      {.lr = 0.01, .local_batch = 8});
  gradapt::elastic::adaptive_job job(step, gradapt::elastic::sync_switch_policy({.warmup = 3}),
                                     gradapt::elastic::sync_switch_policy({.warmup = 8}));
  for (int t = 1; t <= 6; ++t) {
    m.grads(t);
    job.step({.ready_seconds = 0.01 * t});
  }
  good = job.save_policies();
  REQUIRE(job.policy<0>().reference() > 0.0);
  flip_every_bit(
      good, [&](std::span<const std::byte> bad) { job.load_policies(bad); },
      [&] { return job.save_policies(); });
}

}  // namespace gradapt_test_checkpoint_bitflip

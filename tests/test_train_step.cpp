// train::data_parallel_step on the threads communicator, 1 to 4 ranks (3 included).
//
// What is checked, and against what:
//  - the composed step equals the same stages called one by one (loss_scaler::unscale,
//    allreduce_with_norms / allreduce + divide / adasum::allreduce, gradient_noise_scale,
//    adascale, the optimizer's step, local_sgd::step), bit for bit in the parameters and in
//    every metric, for LAMB + loss scaling (fp16 gradients) + AdaScale, LARS, SGD alone, AdamW +
//    Adasum, and SGD with momentum + LocalSGD;
//  - one step against an independent long double evaluation of the formulas (McCandlish et
//    al.'s two-batch estimators, AdaScale's gain, the SGD update), and Adasum against its
//    closed form for orthogonal gradients;
//  - an overflow on one rank skips the step on every rank: parameters, optimizer step count,
//    AdaScale progress and LocalSGD counters unchanged, the loss scale backed off;
//  - hooks fire in order (before_step, on_rescale, on_overflow, after_step) with the metrics
//    of the by-hand run, and their changes (learning rate, batch, LocalSGD period) take effect;
//  - a checkpoint round trip continues a run bit for bit; bad checkpoints are rejected and
//    leave the state unchanged;
//  - invalid input throws gradapt::error with actionable messages, on every rank together for
//    lists that differ across ranks;
//  - the steady-state step allocates nothing.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"
#include "scenarios/train_step.hpp"

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_train_step {

using Catch::Matchers::Contains;
using gradapt::half;
namespace train = gradapt::train;
using threads = gradapt::comm::threads;
using ld = long double;

namespace {

using namespace train_scenario;

/// The composed step on n threads ranks (see train_scenario::run_composed).
template <class G, class Opt, class... P>
std::vector<rank_result> composed(int n, const plan& pl, Opt (*make_opt)(), P... policies) {
  std::vector<rank_result> out(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, [&](threads& comm) {
    out[static_cast<std::size_t>(comm.rank())] = run_composed<G>(comm, pl, make_opt, policies...);
  });
  return out;
}

/// The same stages called one by one on n threads ranks (see train_scenario::run_by_hand).
template <class G, class Opt>
std::vector<rank_result> by_hand(int n, const plan& pl, Opt (*make_opt)(), stages with) {
  std::vector<rank_result> out(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, [&](threads& comm) {
    out[static_cast<std::size_t>(comm.rank())] = run_by_hand<G>(comm, pl, make_opt, with);
  });
  return out;
}

void require_same(const std::vector<rank_result>& a, const std::vector<rank_result>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t r = 0; r < a.size(); ++r) {
    INFO("rank " << r);
    train_scenario::require_same(a[r], b[r]);
  }
}

}  // namespace

TEST_CASE("composed step equals the stages by hand: LAMB + fp16 loss scaling + AdaScale", "[train]") {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    const plan pl{.steps = 8, .inf_at = 4, .grow_at = 6};
    const auto a = composed<half>(
        n, pl, &make_opt_lamb, gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 3}),
        train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.5}});
    const auto b = by_hand<half>(n, pl, &make_opt_lamb, {.scaling = true, .adapt = true});
    require_same(a, b);
    // Sanity of the run itself: the overflow step was skipped and the batch change rescaled.
    const auto& m = a[0].metrics;
    REQUIRE(m[3].found_inf);
    REQUIRE_FALSE(m[3].stepped);
    REQUIRE(m[3].optimizer_steps == 3);
    REQUIRE(m.back().optimizer_steps == 7);
    REQUIRE(m[5].scale == 2.0 * n);
    if (n >= 2) {
      REQUIRE(std::isfinite(m.back().noise_scale));
      REQUIRE(m.back().gain >= 1.0);
      REQUIRE(m.back().gain <= m.back().scale);
    }
    for (std::size_t r = 1; r < a.size(); ++r) REQUIRE(same_bits(a[r].params, a[0].params));
  }
}

TEST_CASE("composed step equals the stages by hand: LARS, plain SGD, AdamW + Adasum, SGD + LocalSGD",
          "[train]") {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    const plan pl{.steps = 7};
    require_same(composed<float>(n, pl, &make_opt_lars), by_hand<float>(n, pl, &make_opt_lars, {}));
    require_same(composed<float>(n, pl, &make_opt_sgd), by_hand<float>(n, pl, &make_opt_sgd, {}));
    require_same(composed<float>(n, pl, &make_opt_adamw, train::adasum_combine{}),
                 by_hand<float>(n, pl, &make_opt_adamw, {.adasum = true}));
    const auto a =
        composed<float>(n, pl, &make_opt_sgd_momentum,
                        train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 2})});
    require_same(a, by_hand<float>(n, pl, &make_opt_sgd_momentum, {.local = true}));
    // LocalSGD: steps 1, 2 synchronous; local steps 3..7 averaged after local steps 2 and 4
    // (steps 4 and 6).
    const auto& m = a[0].metrics;
    const bool sync[] = {true, true, false, false, false, false, false};
    const bool avg[] = {false, false, false, true, false, true, false};
    for (std::size_t k = 0; k < 7; ++k) {
      INFO("step " << k + 1);
      REQUIRE(m[k].synchronous == sync[k]);
      REQUIRE(m[k].averaged == avg[k]);
    }
    // After the last (unaveraged) local step the replicas differ when there are several.
    if (n > 1) REQUIRE_FALSE(same_bits(a[0].params, a[1].params));
  }
}

TEST_CASE("one step against the formulas in long double (noise scale, AdaScale gain, SGD)", "[train]") {
  for (int n : {2, 3, 4}) {
    INFO(n << " ranks");
    const double lr = 0.1, local_batch = 4.0, base = 2.0;
    std::vector<std::vector<float>> grads(static_cast<std::size_t>(n));
    std::vector<float> p0;
    std::vector<std::vector<float>> after(static_cast<std::size_t>(n));
    std::vector<train::step_metrics> metrics(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      replica<float> rep({5, 3});
      rep.fill(r, 1, 1.0);
      gradapt::host backend{};
      auto step = train::make_data_parallel_step(
          comm, backend, rep.params, gradapt::sgd({.lr = 1.0}), {.lr = lr, .local_batch = local_batch},
          train::adascale_policy{.base_batch = base, .noise = {.smoothing = 0.0}});
      std::vector<float> g;
      for (const auto& t : rep.g) g.insert(g.end(), t.begin(), t.end());
      grads[static_cast<std::size_t>(r)] = g;
      if (r == 0) p0 = rep.flat();
      comm.barrier();
      metrics[static_cast<std::size_t>(r)] = step.step();
      after[static_cast<std::size_t>(r)] = rep.flat();
    });
    const std::size_t len = p0.size();
    std::vector<ld> mean(len, 0.0L);
    ld local_sq = 0;
    for (const auto& g : grads)
      for (std::size_t i = 0; i < len; ++i) {
        mean[i] += static_cast<ld>(g[i]) / n;
        local_sq += static_cast<ld>(g[i]) * g[i] / n;
      }
    ld global_sq = 0;
    for (ld v : mean) global_sq += v * v;
    const ld bs = local_batch, bb = n * local_batch;
    const ld grad_sq = (bb * global_sq - bs * local_sq) / (bb - bs);
    const ld trace = (local_sq - global_sq) / (1 / bs - 1 / bb);
    REQUIRE(grad_sq > 0);
    REQUIRE(trace > 0);
    const ld sigma = trace / base, s = n * local_batch / base;
    const ld gain = (sigma + grad_sq) / (sigma / s + grad_sq);
    // The library sums the gradients in float (the gradients' compute type) before it takes
    // |sum|^2, and the estimators subtract nearby quantities: agreement to 1e-5 relative.
    const auto& m = metrics[0];
    REQUIRE(m.scale == Approx(static_cast<double>(s)));
    REQUIRE(m.noise_scale == Approx(static_cast<double>(trace / grad_sq)).epsilon(1e-5));
    REQUIRE(m.gain == Approx(static_cast<double>(gain)).epsilon(1e-5));
    REQUIRE(m.lr == Approx(static_cast<double>(lr * gain)).epsilon(1e-5));
    REQUIRE(m.progress == Approx(static_cast<double>(gain)).epsilon(1e-5));
    for (std::size_t i = 0; i < len; ++i) {
      const ld expect = p0[i] - static_cast<ld>(lr) * gain * mean[i];
      REQUIRE(after[0][i] == Approx(static_cast<double>(expect)).epsilon(1e-5).margin(1e-6));
    }
  }
}

TEST_CASE("Adasum path: orthogonal gradients add (closed form)", "[train]") {
  std::vector<float> result;
  gradapt::comm::run_threads(2, [&](threads& comm) {
    std::vector<float> p(4, 1.0f), g(4, 0.0f);
    gradapt::param_list<float> params;
    params.add("w", gradapt::host_view(p), gradapt::host_view(g));
    gradapt::host backend{};
    auto step = train::make_data_parallel_step(comm, backend, params, gradapt::sgd({.lr = 1.0}), {.lr = 0.5},
                                               train::adasum_combine{});
    g[static_cast<std::size_t>(comm.rank())] = 2.0f;  // rank 0: 2 e0, rank 1: 2 e1 (orthogonal)
    step.step();
    if (comm.rank() == 0) result = p;
  });
  // Adasum of orthogonal vectors is their sum: p = 1 - 0.5 (2 e0 + 2 e1).
  REQUIRE(result == std::vector<float>{0.0f, 0.0f, 1.0f, 1.0f});
}

TEST_CASE("an overflow on one rank skips the step everywhere", "[train]") {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      replica<float> rep;
      gradapt::host backend{};
      plan_hook hook{plan{}, {}, {}, {}};
      auto step = train::make_data_parallel_step(
          comm, backend, rep.params, make_opt_lamb(), {.lr = 0.01, .local_batch = base_batch},
          gradapt::loss_scaler({.init_scale = 256.0}), train::adascale_policy{.base_batch = base_batch},
          train::local_sgd_policy{{.start_step = 1}, gradapt::fixed_period({.period = 1})}, std::ref(hook));
      rep.fill(r, 1, step.loss_scale());
      step.step();
      const auto before = rep.flat();
      const auto tau = step.ada_scale().progress();
      const auto lsteps = step.local().steps();
      rep.fill(r, 2, step.loss_scale(), r == n - 1);
      const auto& m = step.step();
      RANK_REQUIRE(m.found_inf);
      RANK_REQUIRE(!m.stepped);
      RANK_REQUIRE(m.lr == 0.0);
      RANK_REQUIRE(m.loss_scale == 128.0);
      RANK_REQUIRE(step.optimizer_state().steps() == 1);
      RANK_REQUIRE(step.ada_scale().progress() == tau);
      RANK_REQUIRE(step.local().steps() == lsteps);
      RANK_REQUIRE(same_bits(rep.flat(), before));
      RANK_REQUIRE(hook.events ==
                   std::vector<std::string>{"before 1", "after 1", "before 2", "overflow 2", "after 2"});
    });
  }
}

TEST_CASE("hooks fire in order and act: lr schedule, batch change (on_rescale), LocalSGD period", "[train]") {
  for (int n : {1, 3}) {
    INFO(n << " ranks");
    const plan pl{.steps = 6, .inf_at = 3, .grow_at = 5};
    const auto a = composed<float>(
        n, pl, &make_opt_sgd, gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 3}),
        train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.5}});
    const std::vector<std::string> expect{"before 1",   "after 1", "before 2", "after 2", "before 3",
                                          "overflow 3", "after 3", "before 4", "after 4", "before 5",
                                          "rescale 5",  "after 5", "before 6", "after 6"};
    for (const auto& r : a) REQUIRE(r.events == expect);
    const auto& m = a[0].metrics;
    REQUIRE(m[4].scale == 2.0 * n);
    REQUIRE(m[3].scale == 1.0 * n);
    // The lr the hook set from the previous step's progress, times the gain.
    for (std::size_t k = 1; k < m.size(); ++k)
      if (m[k].stepped) REQUIRE(m[k].lr == pl.lr(m[k - 1].progress) * m[k].gain);
  }
  // LocalSGD period set by a hook: start_step 0, period 2, then period 3 from step 3 on.
  struct period_hook {
    std::vector<bool> averaged;
    void before_step(train::step_settings& s, const train::step_metrics& last) {
      if (last.step == 2) s.period = 3;
    }
    void after_step(train::step_settings&, const train::step_metrics& m) { averaged.push_back(m.averaged); }
  };
  gradapt::comm::run_threads(2, [&](threads& comm) {
    replica<float> rep;
    gradapt::host backend{};
    period_hook hook;
    auto step = train::make_data_parallel_step(
        comm, backend, rep.params, make_opt_sgd(), {.lr = 0.1},
        train::local_sgd_policy{{}, gradapt::fixed_period({.period = 2})}, std::ref(hook));
    RANK_REQUIRE(step.settings().period == 2);
    for (int t = 1; t <= 9; ++t) {
      rep.fill(comm.rank(), static_cast<std::uint64_t>(t), 1.0);
      step.step();
    }
    // Rounds after local steps 2 (period 2), then 5 and 8 (period 3, counted from the round).
    RANK_REQUIRE(hook.averaged ==
                 std::vector<bool>{false, true, false, false, true, false, false, true, false});
    RANK_REQUIRE(step.local().rounds() == 3);
  });
}

TEST_CASE("checkpoint: a restored run continues bit for bit", "[train]") {
  for (int n = 1; n <= 4; ++n) {
    for (int cut : {2, 4, 6}) {
      INFO(n << " ranks, checkpoint after step " << cut);
      std::vector<checkpoint_run> straight(static_cast<std::size_t>(n)), resumed(straight.size());
      gradapt::comm::run_threads(n, [&](threads& comm) {
        straight[static_cast<std::size_t>(comm.rank())] = checkpoint_straight(comm, cut);
      });
      gradapt::comm::run_threads(n, [&](threads& comm) {
        const auto ri = static_cast<std::size_t>(comm.rank());
        resumed[ri] = checkpoint_resumed(comm, straight[ri], cut);
      });
      for (std::size_t r = 0; r < straight.size(); ++r) {
        INFO("rank " << r);
        require_resumed_equal(straight[r], resumed[r], cut);
      }
    }
  }
}

TEST_CASE("checkpoint: bad checkpoints are rejected and change nothing", "[train]") {
  gradapt::comm::run_threads(2, [&](threads& comm) {
    replica<float> rep;
    gradapt::host backend{};
    auto step = train::make_data_parallel_step(
        comm, backend, rep.params, make_opt_lamb(), {.lr = 0.01, .local_batch = base_batch},
        gradapt::loss_scaler(), train::adascale_policy{.base_batch = base_batch});
    auto plain = train::make_data_parallel_step(comm, backend, rep.params, make_opt_lamb(), {.lr = 0.01});
    for (int t = 1; t <= 3; ++t) {
      rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale());
      step.step();
    }
    const auto good = step.save();
    std::vector<std::byte> other_state;
    {
      rep.fill(comm.rank(), 4, step.loss_scale());
      step.step();
      other_state = step.save();
      step.load(good);
    }
    auto truncated = good;
    truncated.resize(good.size() - 3);
    RANK_REQUIRE_THROWS_WITH((step.load(truncated)), Contains("truncated"));
    auto bad_magic = good;
    bad_magic[0] = std::byte{'x'};
    RANK_REQUIRE_THROWS_WITH((step.load(bad_magic)), Contains("not a gradapt state archive"));
    auto trailing = good;
    trailing.push_back(std::byte{0});
    RANK_REQUIRE_THROWS_WITH((step.load(trailing)), Contains("checksum mismatch"));
    RANK_REQUIRE_THROWS_WITH((step.load(plain.save())), Contains("slot mask"));
    RANK_REQUIRE_THROWS_WITH((plain.load(good)),
                             Contains("restore into a step built with the same policies"));
    const bool unchanged = step.save() == good;  // unchanged by the failed loads
    RANK_REQUIRE(unchanged);
    step.load(other_state);
    const bool restored = step.save() == other_state;
    RANK_REQUIRE(restored);
    RANK_REQUIRE(step.steps() == 4);
  });
  // Another rank count.
  std::vector<std::byte> two;
  gradapt::comm::run_threads(2, [&](threads& comm) {
    replica<float> rep;
    auto step =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1});
    if (comm.rank() == 0) two = step.save();
  });
  gradapt::comm::run_threads(3, [&](threads& comm) {
    replica<float> rep;
    auto step =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1});
    RANK_REQUIRE_THROWS_WITH((step.load(two)), Contains("rank count is 2 but this step's is 3"));
  });
}

TEST_CASE("invalid input throws actionable errors, on every rank together", "[train]") {
  for (int n : {1, 2, 3}) {
    INFO(n << " ranks");
    // A list that differs on the last rank.
    gradapt::comm::run_threads(n, [&](threads& comm) {
      replica<float> rep(comm.rank() == comm.size() - 1 && comm.size() > 1
                             ? std::vector<std::size_t>{7, 1, 33, 6}
                             : std::vector<std::size_t>{7, 1, 33, 5});
      if (comm.size() > 1)
        RANK_REQUIRE_THROWS_WITH(
            (train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1})),
            Contains("every rank must pass the same parameter elements"));
      gradapt::param_list<float> empty;
      RANK_REQUIRE_THROWS_WITH(
          (train::make_data_parallel_step(comm, gradapt::host{}, empty, make_opt_sgd(), {.lr = 0.1})),
          Contains("the parameter list is empty"));
    });
    gradapt::comm::run_threads(n, [&](threads& comm) {
      replica<float> rep;
      const gradapt::host b{};
      RANK_REQUIRE_THROWS_WITH(
          (train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(), {.lr = std::nan("")})),
          Contains("step_settings::lr is nan"));
      RANK_REQUIRE_THROWS_WITH((train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(),
                                                               {.lr = 0.1}, train::adascale_policy{})),
                               Contains("base_batch is 0"));
      RANK_REQUIRE_THROWS_WITH((train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(),
                                                               {.lr = 0.1, .local_batch = 1.0},
                                                               train::adascale_policy{.base_batch = 64.0})),
                               Contains("lower base_batch"));
      RANK_REQUIRE_THROWS_WITH((train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(),
                                                               {.lr = 0.1, .local_batch = 0.0},
                                                               train::adascale_policy{.base_batch = 1.0})),
                               Contains("step_settings::local_batch is 0"));
      RANK_REQUIRE_THROWS_WITH(
          (train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(), {.lr = 0.1, .period = 4})),
          Contains("no local_sgd_policy<fixed_period>"));
      // A hook that sets an invalid value: the step throws before any collective.
      struct bad_hook {
        void before_step(train::step_settings& s, const train::step_metrics&) { s.lr = -1.0; }
      };
      auto step =
          train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(), {.lr = 0.1}, bad_hook{});
      RANK_REQUIRE_THROWS_WITH((step.step()), Contains("step_settings::lr is -1"));
      // The parameter list changed after the step was built.
      std::vector<float> extra(3), gextra(3);
      rep.params.add("late", gradapt::host_view(extra), gradapt::host_view(gextra));
      auto step2 = train::make_data_parallel_step(comm, b, rep.params, make_opt_sgd(), {.lr = 0.1});
      std::vector<float> more(2), gmore(2);
      rep.params.add("later", gradapt::host_view(more), gradapt::host_view(gmore));
      RANK_REQUIRE_THROWS_WITH((step2.step()), Contains("build a new step when the model changes"));
    });
  }
}

#if GRADAPT_TEST_ALLOC_COUNTER
TEST_CASE("the steady-state step allocates nothing", "[train]") {
  gradapt::comm::run_threads(3, [&](threads& comm) {
    replica<half> rep;
    gradapt::host backend{};
    auto step = train::make_data_parallel_step(
        comm, backend, rep.params, make_opt_lamb(), {.lr = 0.01, .local_batch = base_batch},
        gradapt::loss_scaler({.init_scale = 1024.0}), train::adascale_policy{.base_batch = base_batch},
        train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 2})});
    for (int t = 1; t <= 4; ++t) {
      rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale());
      step.step();
    }
    std::size_t allocs = 0;
    for (int t = 5; t <= 12; ++t) {
      rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale(), t == 7);
      const std::size_t before = alloc_counter::on_this_thread();
      step.step();
      allocs += alloc_counter::on_this_thread() - before;
    }
    RANK_REQUIRE(allocs == 0);
  });
}

TEST_CASE("the steady-state step allocates nothing with the hierarchy, buckets or ZeRO-2", "[train]") {
  gradapt::comm::run_threads(4, [&](threads& comm) {
    const auto steady = [&](auto make) {
      replica<half> rep;
      auto step = make(rep);
      std::size_t allocs = 0;
      for (int t = 1; t <= 10; ++t) {
        rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale(), t == 7);
        const std::size_t before = alloc_counter::on_this_thread();
        if constexpr (decltype(step)::marks_gradients)
          for (std::size_t k = rep.params.size(); k-- > 0;) step.mark_ready(k);
        step.step();
        if (t > 4) allocs += alloc_counter::on_this_thread() - before;
      }
      RANK_REQUIRE(allocs == 0);
    };
    const gradapt::host backend{};
    const train::step_settings set{.lr = 0.01, .local_batch = base_batch};
    steady([&](replica<half>& rep) {
      return train::make_data_parallel_step(comm, backend, rep.params, make_opt_lamb(), set,
                                            gradapt::loss_scaler({.init_scale = 1024.0}),
                                            train::adascale_policy{.base_batch = base_batch},
                                            train::hierarchical_reduce{.hierarchy = {.group_size = 2}});
    });
    steady([&](replica<half>& rep) {
      return train::make_data_parallel_step(comm, backend, rep.params, make_opt_lamb(), set,
                                            gradapt::loss_scaler({.init_scale = 1024.0}),
                                            train::adascale_policy{.base_batch = base_batch},
                                            train::bucket_reduce{.buckets = {.cap_bytes = 256}});
    });
    steady([&](replica<half>& rep) {
      return train::make_data_parallel_step(
          comm, backend, rep.params, make_opt_lamb(), set, gradapt::loss_scaler({.init_scale = 1024.0}),
          train::adascale_policy{.base_batch = base_batch}, train::zero_state<2>{.allow_empty_shards = true});
    });
  });
}
#endif

TEST_CASE("LocalSGD with the adaptive period reads the loss passed to step()", "[train]") {
  for (int n : {2, 3}) {
    INFO(n << " ranks");
    constexpr int steps = 16;
    const auto loss_of = [](int r, int t) { return 2.0 / (1.0 + t * t) + 0.001 * r; };
    const auto schedule = [] {
      return gradapt::adaptive_period({.initial_period = 2, .max_period = 8, .smoothing = 0.0});
    };
    std::vector<std::vector<float>> a(static_cast<std::size_t>(n)), b(a);
    std::vector<std::vector<bool>> avg_a(static_cast<std::size_t>(n)), avg_b(avg_a);
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      replica<float> rep;
      auto step =
          train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.05},
                                         train::local_sgd_policy{{.start_step = 1}, schedule()});
      for (int t = 1; t <= steps; ++t) {
        rep.fill(r, static_cast<std::uint64_t>(t), 1.0);
        avg_a[static_cast<std::size_t>(r)].push_back(step.step({.loss = loss_of(r, t)}).averaged);
      }
      a[static_cast<std::size_t>(r)] = rep.flat();
    });
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      replica<float> rep;
      const gradapt::host backend{};
      const auto opt = make_opt_sgd();
      auto state = opt.init(backend, rep.params);
      gradapt::local_sgd lsgd(comm, {.start_step = 1}, schedule());
      for (int t = 1; t <= steps; ++t) {
        rep.fill(r, static_cast<std::uint64_t>(t), 1.0);
        if (lsgd.sync_gradients()) {
          for (const auto& g : rep.params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
          const float fn = static_cast<float>(n);
          backend.apply_list([fn](float& g) { g = g / fn; }, rep.params.grads());
        }
        opt.step(backend, rep.params, state, {.lr = 0.05});
        avg_b[static_cast<std::size_t>(r)].push_back(
            lsgd.step(comm, backend, {.loss = loss_of(r, t), .lr = 0.05}, rep.params.values()).averaged);
      }
      b[static_cast<std::size_t>(r)] = rep.flat();
    });
    for (std::size_t r = 0; r < a.size(); ++r) {
      REQUIRE(same_bits(a[r], b[r]));
      REQUIRE(avg_a[r] == avg_b[r]);
    }
    // AdaComm's period shrinks as the loss falls (K ~ sqrt(F / F0) K0): more rounds than the
    // (steps - 1) / 2 of the initial period 2, so the loss reached the schedule.
    int rounds = 0;
    for (bool x : avg_a[0]) rounds += x ? 1 : 0;
    REQUIRE(rounds > (steps - 1) / 2);
  }
}

}  // namespace gradapt_test_train_step

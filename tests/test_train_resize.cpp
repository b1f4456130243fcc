// train::data_parallel_step::restore: a checkpoint of N ranks continued on M ranks
// (comm::threads, N and M in 1..8), the rescale rules, and the agreement:
//  - every rank of the new world resumes at the checkpoint's step with the same bits, and the
//    settings follow the rule's closed form (accumulation × N / M; lr × M / N; lr × √(M / N);
//    unchanged under AdaScale, whose gain follows the new global batch);
//  - the state moves losslessly: N → M → N restores the original archive byte for byte;
//  - ranks that pass other checkpoints or other rules, a rule that does not apply, and load()
//    on another world are errors on every rank, with the state unchanged.
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "scenarios/train_step.hpp"

namespace gradapt_test_train_resize {

using Catch::Matchers::Contains;
using threads = gradapt::comm::threads;
namespace train = gradapt::train;
using train::rescale_rule;
using namespace train_scenario;

namespace {
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};

template <class Comm>
auto make_step(Comm& comm, replica<float>& rep, int accumulation = 1) {
  return train::make_data_parallel_step(
      comm, gradapt::host{}, rep.params, make_opt_lamb(),
      {.lr = 0.01, .local_batch = base_batch, .accumulation_steps = accumulation},
      gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 2}),
      train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.7}});
}

struct committed {
  std::vector<std::byte> bytes;
  std::vector<float> params;
  train::step_settings settings;
};

// Three steps on n ranks; rank 0's checkpoint and parameters.
committed commit_on(int n, int accumulation) {
  committed c;
  gradapt::comm::run_threads(n, quick, [&](threads& comm) {
    replica<float> rep;
    auto step = make_step(comm, rep, accumulation);
    for (int t = 1; t <= 3; ++t) {
      rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale());
      step.step({.loss = 1.0});
    }
    if (comm.rank() == 0) {
      c.bytes = step.save();
      c.params = rep.flat();
      c.settings = step.settings();
    }
  });
  return c;
}
}  // namespace

TEST_CASE("restore: N -> M ranks resumes at the same step with the same bits, settings by the rule",
          "[train][elastic]") {
  for (int n = 1; n <= 8; ++n) {
    const committed c = commit_on(n, 840);  // 840 = lcm(1..8): keep_global_batch always applies
    for (int m = 1; m <= 8; ++m) {
      const auto rule = static_cast<rescale_rule>((n + m) % 4);
      INFO(n << " -> " << m << " ranks, " << gradapt::train::name(rule));
      std::vector<std::vector<float>> after(static_cast<std::size_t>(m));
      gradapt::comm::run_threads(m, quick, [&](threads& comm) {
        replica<float> rep;
        rep.set(c.params);
        auto step = make_step(comm, rep);
        step.restore(c.bytes, rule);
        RANK_CHECK(step.steps() == 3);
        const auto& s = step.settings();
        const double ratio = double(m) / double(n);
        switch (rule) {
          case rescale_rule::keep_global_batch:
            RANK_CHECK(s.accumulation_steps == 840 * n / m);
            RANK_CHECK(s.lr == c.settings.lr);
            break;
          case rescale_rule::linear_lr:
            RANK_CHECK(s.lr == c.settings.lr * double(m) / double(n));
            RANK_CHECK(s.accumulation_steps == 840);
            break;
          case rescale_rule::sqrt_lr:
            RANK_CHECK(s.lr == c.settings.lr * std::sqrt(ratio));
            break;
          case rescale_rule::adascale:
            RANK_CHECK(s.lr == c.settings.lr);
            break;
        }
        RANK_CHECK(step.loss_scale() > 0);
        for (int t = 4; t <= 5; ++t) {
          rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale());
          step.step({.loss = 1.0});
        }
        RANK_CHECK(step.steps() == 5);
        after[static_cast<std::size_t>(comm.rank())] = rep.flat();
      });
      for (int r = 1; r < m; ++r) CHECK(after[static_cast<std::size_t>(r)] == after[0]);
      CHECK(after[0] != c.params);
    }
  }
}

TEST_CASE("restore: N -> M -> N gives back the checkpoint byte for byte", "[train][elastic]") {
  for (const int n : {1, 3, 4, 8}) {
    const committed c = commit_on(n, 840);
    for (const int m : {1, 2, 5, 7, 8}) {
      INFO(n << " -> " << m << " -> " << n);
      std::vector<std::byte> on_m;
      gradapt::comm::run_threads(m, quick, [&](threads& comm) {
        replica<float> rep;
        auto step = make_step(comm, rep);
        step.restore(c.bytes, rescale_rule::keep_global_batch);
        if (comm.rank() == 0) on_m = step.save();
      });
      std::vector<std::vector<std::byte>> back(static_cast<std::size_t>(n));
      gradapt::comm::run_threads(n, quick, [&](threads& comm) {
        replica<float> rep;
        auto step = make_step(comm, rep);
        step.restore(on_m, rescale_rule::keep_global_batch);
        back[static_cast<std::size_t>(comm.rank())] = step.save();
      });
      for (const auto& b : back) CHECK(b == c.bytes);
    }
  }
}

TEST_CASE("restore: disagreements and rules that do not apply throw on every rank, changing nothing",
          "[train][elastic]") {
  const committed two = commit_on(2, 1), three = commit_on(3, 1);
  gradapt::comm::run_threads(3, quick, [&](threads& comm) {
    replica<float> rep;
    auto step = make_step(comm, rep);
    rep.fill(comm.rank(), 1, step.loss_scale());
    step.step({.loss = 1.0});
    const auto before = step.save();
    // Rank 1 restores another checkpoint: every rank throws.
    RANK_REQUIRE_THROWS_WITH(
        step.restore(comm.rank() == 1 ? three.bytes : two.bytes, rescale_rule::linear_lr),
        Contains("checkpoint (a 52-bit hash of its bytes; each rank's own save() differs when the loop "
                 "passed per-rank losses"));
    RANK_CHECK(step.save() == before);
    // Another rule on rank 2.
    RANK_REQUIRE_THROWS_WITH(
        step.restore(two.bytes, comm.rank() == 2 ? rescale_rule::sqrt_lr : rescale_rule::linear_lr),
        Contains("rescale rule"));
    RANK_CHECK(step.save() == before);
    // 1 accumulation step on 2 ranks is 2 micro-batches: 3 ranks cannot keep the global batch.
    RANK_REQUIRE_THROWS_WITH(step.restore(two.bytes, rescale_rule::keep_global_batch),
                             Contains("2 micro-batches per step, which 3 ranks cannot split evenly"));
    RANK_CHECK(step.save() == before);
    // load() keeps to the saved world and names restore().
    RANK_REQUIRE_THROWS_WITH(step.load(two.bytes), Contains("restore(bytes, rescale_rule)"));
    RANK_CHECK(step.save() == before);
    step.restore(two.bytes, rescale_rule::linear_lr);
    RANK_CHECK(step.steps() == 3);
    // AdaScale's rule needs the adapt slot.
    auto plain =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1});
    RANK_REQUIRE_THROWS_WITH(plain.restore(plain.save(), rescale_rule::adascale),
                             Contains("needs the adapt slot's adascale_policy"));
  });
}

}  // namespace gradapt_test_train_resize

namespace gradapt_test_train_resize {

TEST_CASE("save: ranks that pass different losses write the same bytes; the metrics hold the mean",
          "[train][elastic]") {
  gradapt::comm::run_threads(3, quick, [](threads& comm) {
    replica<float> rep;
    auto step = make_step(comm, rep);
    const int r = comm.rank();
    for (int t = 1; t <= 3; ++t) {
      rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale());
      // Losses 1, 2, 4 (+ t): the mean (7 + 3t) / 3, summed in rank order.
      const auto& m = step.step({.loss = static_cast<double>(1 << r) + t});
      RANK_CHECK(m.loss == (((1.0 + t) + (2.0 + t)) + (4.0 + t)) / 3.0);
    }
    const auto bytes = step.save();
    const double h = static_cast<double>(gradapt::detail::hash_bytes(7u, bytes.data(), bytes.size()) >> 12);
    double v[2] = {h, -h};
    comm.allreduce(gradapt::tensor_view<double, gradapt::host_space>::vector(v, 2), gradapt::reduce_op::max);
    RANK_CHECK(v[0] == -v[1]);  // every rank's checkpoint hashes alike
    // So every rank's checkpoint restores on another world without a hash mismatch.
    gradapt::comm::run_threads(1, quick, [&](threads& one) {
      replica<float> fresh;
      auto again = make_step(one, fresh);
      again.restore(bytes, rescale_rule::keep_global_batch);
      RANK_CHECK(again.metrics().loss == step.metrics().loss);
    });
    // A rank without a loss makes the mean NaN, on every rank.
    rep.fill(r, 4, step.loss_scale());
    const auto& m = r == 1 ? step.step() : step.step({.loss = 1.0});
    RANK_CHECK(std::isnan(m.loss));
  });
}

}  // namespace gradapt_test_train_resize

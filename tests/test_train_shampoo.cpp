// The Shampoo chain in the composed step on comm::threads: the rows of
// tests/support/scenarios/train_shampoo_rows.hpp (replicated state with each reduce and combine
// slot, the loss scaler, AdaScale and LocalSGD), each on 1, 2, 3 and 5 ranks (3 under a
// sanitizer), 20 steps with a save at step 10 (12 and 6 under a sanitizer) loaded into a fresh
// step, against the same recipe with one-buffer reduction and no checkpoint: the parameters
// equal the reference's bit for bit (AdaScale: gain to 1e-9, parameters to 1e-6), as in
// test_train_combinations. Also: the step's
// report of Shampoo's roots, a one-rank difference in a Shampoo option at construction, and an
// N -> M restore that continues as an uninterrupted M-rank run.
#include "catch.hpp"

#include <chrono>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "sanitizer.hpp"
#include "scenarios/train_shampoo_rows.hpp"

namespace gradapt_test_train_shampoo {

using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
namespace scenario = train_combinations_scenario;
namespace train = gradapt::train;

namespace {

const std::vector<int> worlds =
    gradapt_test::under_sanitizer ? std::vector<int>{3} : std::vector<int>{1, 2, 3, 5};

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};

}  // namespace

TEST_CASE("slots in combination: Shampoo rows", "[train][combinations][shampoo]") {
  scenario::shampoo_rows([](const char* name, auto... slots) {
    for (const int n : worlds) {
      INFO(name << " on " << n << " ranks");
      run_threads(n, quick, [&](threads& comm) {
        scenario::require_row(
            scenario::run_row(comm, scenario::row_options{.backend = {.threads = 1}}, slots...));
      });
    }
  });
}

TEST_CASE("train step with Shampoo: the roots are divided among the ranks and reported", "[train][shampoo]") {
  run_threads(3, quick, [&](threads& comm) {
    sharded_scenario::model<float> m;
    auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, m.params, scenario::shampoo,
                                               {.lr = 1e-2, .local_batch = 8});
    std::size_t installed = 0;
    for (int k = 1; k <= 5; ++k) {
      scenario::exact_grads(m, comm.rank(), k, 1.0);
      step.step();
      const auto& r = step.optimizer_report();
      RANK_CHECK(r.step == static_cast<std::uint64_t>(k));
      RANK_CHECK(r.root_failures.empty());
      installed += r.roots_installed;
    }
    const auto& pre = step.optimizer_state().preconditioner();
    RANK_CHECK(installed > 0);  // roots at steps 2 and 5
    // Every block's roots were computed once per due step, each by one rank.
    std::vector<double> own{static_cast<double>(pre.root_computations())};
    comm.allreduce(gradapt::host_view(own), gradapt::reduce_op::sum);
    RANK_CHECK(own[0] == static_cast<double>(installed));
  });
}

TEST_CASE("train step with Shampoo: a one-rank difference in a Shampoo option is an error on every rank",
          "[train][shampoo]") {
  run_threads(3, quick, [&](threads& comm) {
    sharded_scenario::model<float> m;
    gradapt::shampoo_options o = scenario::shampoo.options();
    if (comm.rank() == 1) o.graft_epsilon = 1e-6;
    o.lr = 2e-2;
    o.momentum = 0.9;
    o.weight_decay = 1e-3;
    RANK_REQUIRE_THROWS_WITH(
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, m.params, gradapt::shampoo(o),
                                       {.lr = 1e-2, .local_batch = 8}),
        Contains("shampoo graft_epsilon is") && Contains("ranges from 1e-10 to 9.99"));
  });
}

TEST_CASE("train step with Shampoo: an N -> M restore continues as an uninterrupted M-rank run",
          "[train][shampoo][elastic]") {
  // Every rank's gradients are the same (so the mean is the same bits on any world): 2 ranks run
  // steps 1-6 and save; 3 ranks restore (linear_lr: lr x 3/2) and run steps 7-12. The reference
  // is 3 ranks from the start, steps 7-12 at the rescaled lr. Shampoo's roots come out the same
  // bits on any world size, so the two must agree bit for bit.
  const double lr = 1e-2;
  std::vector<std::byte> saved;
  std::vector<std::vector<float>> at6;
  run_threads(2, quick, [&](threads& comm) {
    sharded_scenario::model<float> m;
    auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, m.params, scenario::shampoo,
                                               {.lr = lr, .local_batch = 8});
    for (int k = 1; k <= 6; ++k) {
      m.make_grads(comm.rank(), k, true);
      step.step();
    }
    auto bytes = step.save();
    if (comm.rank() == 0) {
      saved = std::move(bytes);
      at6 = m.p;
    }
  });
  std::vector<std::vector<float>> restored(3), uninterrupted(3);
  for (const bool restore : {true, false}) {
    run_threads(3, quick, [&](threads& comm) {
      sharded_scenario::model<float> m;
      auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, m.params,
                                                 scenario::shampoo, {.lr = lr, .local_batch = 8});
      const double rescaled = lr * double(3) / double(2);  // the rule's expression
      if (restore) {
        for (std::size_t t = 0; t < m.p.size(); ++t) m.p[t] = at6[t];
        step.restore(saved, train::rescale_rule::linear_lr);
        RANK_CHECK(step.settings().lr == rescaled);
      } else {
        for (int k = 1; k <= 6; ++k) {
          m.make_grads(comm.rank(), k, true);
          step.step();
        }
      }
      for (int k = 7; k <= 12; ++k) {
        m.make_grads(comm.rank(), k, true);
        step.step({.lr = rescaled});
      }
      RANK_CHECK(step.optimizer_state().steps() == 12u);
      auto& out = (restore ? restored : uninterrupted)[static_cast<std::size_t>(comm.rank())];
      for (const auto& t : m.p) out.insert(out.end(), t.begin(), t.end());
    });
  }
  for (std::size_t r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(restored[r] == uninterrupted[r]);
  }
  CHECK(restored[0] != std::vector<float>(restored[0].size(), 0.0f));
}

}  // namespace gradapt_test_train_shampoo

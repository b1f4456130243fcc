// train::data_parallel_step with heterogeneous batches, shared per-rank times and a paused
// LocalSGD (comm::threads):
//  - step_settings::rank_batches: the combined gradient is the example-weighted mean (checked
//    against the mean over every example in double), equal batches give the bits of the
//    uniform path, AdaScale's S counts Σ_r b_r, and the noise scale's two estimates (|G|², tr Σ)
//    recover the closed form of synthetic gradients with known G and Σ under unequal batches
//    (where the uniform formula is off by far more than the tolerance);
//  - step_args::ready_seconds: every rank reads every rank's time, and its previous step's time,
//    from the step's own agreement;
//  - step_settings::synchronous: a LocalSGD run paused in its local phase averages the replicas
//    once, then combines every step with the LocalSGD counters held, and resumes;
//  - checkpoints carry the new settings; a restore on another world turns rank_batches into
//    their mean;
//  - errors on every rank for sizes, values and disagreements.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "scenarios/train_step.hpp"

namespace gradapt_test_train_hetero {

using Catch::Matchers::Contains;
using threads = gradapt::comm::threads;
namespace train = gradapt::train;
using namespace train_scenario;

namespace {
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};

// Per-example gradient i of rank r at a step: a deterministic vector of `d` values.
std::vector<double> example(int r, int i, std::size_t d, std::uint64_t step) {
  std::mt19937_64 rng(step * 1000003ull + static_cast<std::uint64_t>(r) * 7919ull +
                      static_cast<std::uint64_t>(i));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(d);
  for (auto& x : v) x = 0.3 + u(rng);
  return v;
}

// A flat model of d parameters (one tensor) at zero, float.
struct flat_model {
  std::vector<float> p, g;
  gradapt::param_list<float, float> params;
  explicit flat_model(std::size_t d) : p(d, 0.0f), g(d, 0.0f) {
    params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  }
};
}  // namespace

TEST_CASE("rank_batches: the combined gradient is the mean over every example", "[train][hetero]") {
  const std::vector<double> batches = {1, 3, 6, 10};
  const int n = 4;
  constexpr std::size_t d = 50;
  // The reference: the mean of all 20 examples' gradients, in double; and the plain rank mean.
  std::vector<double> all(d, 0.0), plain(d, 0.0);
  double total = 0;
  for (int r = 0; r < n; ++r) {
    std::vector<double> mine(d, 0.0);
    for (int i = 0; i < int(batches[std::size_t(r)]); ++i) {
      const auto x = example(r, i, d, 1);
      for (std::size_t k = 0; k < d; ++k) all[k] += x[k], mine[k] += x[k];
    }
    total += batches[std::size_t(r)];
    for (std::size_t k = 0; k < d; ++k) plain[k] += mine[k] / batches[std::size_t(r)] / n;
  }
  for (auto& x : all) x /= total;
  double far = 0;
  for (std::size_t k = 0; k < d; ++k) far = std::max(far, std::fabs(all[k] - plain[k]));
  REQUIRE(far > 1e-2);  // the unweighted mean is not the answer

  std::vector<std::vector<float>> result(n);
  double global_batch = 0;
  gradapt::comm::run_threads(n, quick, [&](threads& comm) {
    flat_model m(d);
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 1.0}),
                                               {.lr = 1.0, .rank_batches = batches});
    const int r = comm.rank();
    std::vector<double> mine(d, 0.0);
    for (int i = 0; i < int(batches[std::size_t(r)]); ++i) {
      const auto x = example(r, i, d, 1);
      for (std::size_t k = 0; k < d; ++k) mine[k] += x[k];
    }
    for (std::size_t k = 0; k < d; ++k) m.g[k] = static_cast<float>(mine[k] / batches[std::size_t(r)]);
    const auto& metrics = step.step();
    if (r == 0) global_batch = metrics.global_batch;
    result[std::size_t(r)] = m.p;  // p = -1 · combined gradient
  });
  CHECK(global_batch == 20.0);
  for (int r = 1; r < n; ++r) CHECK(result[std::size_t(r)] == result[0]);
  double worst = 0, scale = 0;
  for (std::size_t k = 0; k < d; ++k) {
    worst = std::max(worst, std::fabs(-double(result[0][k]) - all[k]));
    scale = std::max(scale, std::fabs(all[k]));
  }
  CHECK(worst <= 4e-7 * scale);
}

TEST_CASE("rank_batches: equal batches give the uniform path's bits (LAMB, loss scaling, AdaScale)",
          "[train][hetero]") {
  for (const int n : {2, 3, 5}) {
    INFO(n << " ranks");
    std::vector<float> uniform, listed;
    std::vector<double> noise_u, noise_l;
    for (const bool list : {false, true}) {
      gradapt::comm::run_threads(n, quick, [&](threads& comm) {
        replica<float> rep;
        train::step_settings s{.lr = 0.01, .local_batch = base_batch, .accumulation_steps = 3};
        if (list) s.rank_batches.assign(std::size_t(n), base_batch);
        auto step = train::make_data_parallel_step(
            comm, gradapt::host{}, rep.params, make_opt_lamb(), s,
            gradapt::loss_scaler({.init_scale = 256.0}),
            train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.5}});
        std::vector<double> noise;
        for (int t = 1; t <= 6; ++t) {
          rep.fill(comm.rank(), static_cast<std::uint64_t>(t), step.loss_scale());
          noise.push_back(step.step().noise_scale);
        }
        if (comm.rank() == 0) (list ? listed : uniform) = rep.flat(), (list ? noise_l : noise_u) = noise;
      });
    }
    CHECK(listed == uniform);
    REQUIRE(noise_l.size() == noise_u.size());
    for (std::size_t i = 0; i < noise_l.size(); ++i)
      CHECK((noise_l[i] == noise_u[i] || (std::isnan(noise_l[i]) && std::isnan(noise_u[i]))));
  }
}

TEST_CASE("rank_batches: the noise scale recovers |G|^2 and tr(Sigma) under unequal batches",
          "[train][hetero]") {
  // Rank r's gradient is G + ξ_r with ξ_r ~ N(0, σ²/b_r · I): the mean of b_r examples whose
  // covariance is σ² I, so tr Σ = d σ² and the noise scale is d σ² / |G|².
  constexpr std::size_t d = 256;
  const double sigma2 = 1.0, g2 = 12.8;  // B_noise = 256 / 12.8 = 20
  const std::vector<double> batches = {1, 2, 4, 9};
  const int n = 4, steps = 3000;
  struct result {
    double grad_sq = 0, trace = 0, scale = 0;
  };
  // listed: rank_batches = batches; otherwise the uniform description (local_batch = their mean).
  const auto run = [&](bool listed) {
    result out;
    gradapt::comm::run_threads(n, quick, [&](threads& comm) {
      flat_model m(d);
      train::step_settings s{.lr = 0.0, .local_batch = 4.0};
      if (listed) s.rank_batches = batches;
      auto step = train::make_data_parallel_step(
          comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.0}), s,
          train::adascale_policy{.base_batch = 1.0, .noise = {.smoothing = 0.999}});
      const int r = comm.rank();
      std::mt19937_64 rng(4242 + static_cast<std::uint64_t>(r));
      std::normal_distribution<double> z(0.0, 1.0);
      const double sd = std::sqrt(sigma2 / batches[std::size_t(r)]);
      for (int t = 0; t < steps; ++t) {
        for (auto& x : m.g) x = static_cast<float>(std::sqrt(g2 / double(d)) + sd * z(rng));
        step.step();
      }
      if (r == 0) out = {*step.noise_scale().grad_sq(), *step.noise_scale().trace(), step.metrics().scale};
    });
    return out;
  };
  const result weighted = run(true);
  CHECK(weighted.scale == 16.0);  // Σ b_r / base_batch
  CHECK(std::fabs(weighted.grad_sq - g2) <= 0.02 * g2);
  CHECK(std::fabs(weighted.trace - d * sigma2) <= 0.02 * d * sigma2);
  // The same gradients described as uniform batches of 4 (and averaged unweighted): the
  // two-batch formula misreads them by far more than the tolerance above.
  const result uniform = run(false);
  CHECK(uniform.scale == 16.0);
  CHECK(std::fabs(uniform.trace - d * sigma2) > 0.3 * d * sigma2);
}

TEST_CASE("rank_batches: invalid or disagreeing sizes are errors on every rank", "[train][hetero]") {
  const auto run = [&](auto settings_of, int n = 3) {
    return gradapt_test::errors_of(n, quick, [&](threads& comm) {
      flat_model m(8);
      auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                                 {.lr = 0.1});
      step.step();
      settings_of(comm.rank(), step.settings());
      step.step();
    });
  };
  for (const auto& e : run([](int, train::step_settings& s) { s.rank_batches = {1, 2}; }))
    CHECK_THAT(e, Contains("rank_batches holds 2 batch sizes but the world has 3 ranks"));
  for (const auto& e : run([](int, train::step_settings& s) { s.rank_batches = {1, 0, 2}; }))
    CHECK_THAT(e, Contains("rank_batches[1] is 0"));
  for (const auto& e : run([](int r, train::step_settings&s) {
         s.rank_batches = {1, r == 2 ? 3.0 : 2.0, 2};
       }))
    CHECK_THAT(e, Contains("rank_batches (a 52-bit hash"));
  // A combiner that cannot weight the ranks.
  const auto adasum = gradapt_test::errors_of(2, quick, [&](threads& comm) {
    flat_model m(8);
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                               {.lr = 0.1}, train::adasum_combine{});
    step.settings().rank_batches = {1, 2};
    step.step();
  });
  for (const auto& e : adasum) CHECK_THAT(e, Contains("cannot weight the ranks"));
}

TEST_CASE("ready_seconds: every rank reads every rank's times from the step's agreement",
          "[train][elastic]") {
  const int n = 3;
  std::vector<int> ok(n, 0);
  gradapt::comm::run_threads(n, quick, [&](threads& comm) {
    flat_model m(8);
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                               {.lr = 0.1});
    const int r = comm.rank();
    step.step({.ready_seconds = 0.25 * (r + 1)});
    bool good = step.rank_times().size() == 3 && step.rank_step_seconds().empty();
    for (int q = 0; q < n && good; ++q) good = step.rank_times()[std::size_t(q)] == 0.25 * (q + 1);
    step.step({.ready_seconds = 2.0 - r});
    good =
        good && step.rank_times().size() == 3 && step.rank_times()[0] == 2.0 && step.rank_times()[2] == 0.0;
    good = good && step.rank_step_seconds().size() == 3;
    for (const double s : step.rank_step_seconds()) good = good && s >= 0.0 && s < 60.0;
    step.step();  // no times: empty
    good = good && step.rank_times().empty();
    ok[std::size_t(r)] = good ? 1 : 0;
  });
  CHECK(ok == std::vector<int>(n, 1));

  const auto some = gradapt_test::errors_of(3, quick, [&](threads& comm) {
    flat_model m(8);
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                               {.lr = 0.1});
    step.step({.ready_seconds = comm.rank() == 1 ? std::nan("") : 0.5});
  });
  for (const auto& e : some) CHECK_THAT(e, Contains("ready_seconds given"));
  const auto negative = gradapt_test::errors_of(3, quick, [&](threads& comm) {
    flat_model m(8);
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                               {.lr = 0.1});
    step.step({.ready_seconds = comm.rank() == 2 ? -1.0 : 0.5});
  });
  CHECK_THAT(negative[2], Contains("step_args::ready_seconds is -1"));
  for (const auto& e : negative) CHECK_THAT(e, Contains("rank 2"));
}

TEST_CASE("synchronous: a paused LocalSGD averages once, combines every step, then resumes",
          "[train][local_sgd]") {
  const int n = 3;
  std::vector<std::vector<float>> at_pause(n), after_pause(n);
  std::vector<int> ok(n, 0);
  gradapt::comm::run_threads(n, quick, [&](threads& comm) {
    replica<float> rep;
    auto step = train::make_data_parallel_step(
        comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1},
        train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 4})});
    bool good = true;
    std::uint64_t t = 0;
    const auto one = [&] {
      ++t;
      rep.fill(comm.rank(), t, 1.0);
      return step.step();
    };
    one(), one();                        // synchronous start
    good = good && !one().synchronous;   // step 3: local
    step.settings().synchronous = true;  // pause in the local phase
    const auto local = step.local().local_steps();
    const auto rounds = step.local().rounds();
    good = good && one().synchronous;  // step 4: averaged first, then combined
    at_pause[std::size_t(comm.rank())] = rep.flat();
    for (int k = 0; k < 3; ++k) good = good && one().synchronous && !step.metrics().averaged;
    good = good && step.local().local_steps() == local && step.local().rounds() == rounds;
    after_pause[std::size_t(comm.rank())] = rep.flat();
    // A checkpoint carries the setting.
    const auto bytes = step.save();
    step.settings().synchronous = false;
    step.load(bytes);
    good = good && step.settings().synchronous;
    step.settings().synchronous = false;  // resume
    good = good && !one().synchronous && step.local().local_steps() == local + 1;
    ok[std::size_t(comm.rank())] = good ? 1 : 0;
  });
  CHECK(ok == std::vector<int>(n, 1));
  for (int r = 1; r < n; ++r) {
    CHECK(at_pause[std::size_t(r)] == at_pause[0]);
    CHECK(after_pause[std::size_t(r)] == after_pause[0]);
  }
}

TEST_CASE("rank_batches in checkpoints: load keeps them, restore on another world takes their mean",
          "[train][hetero][elastic]") {
  const auto make = [](threads& comm, flat_model& m) {
    return train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                          {.lr = 0.1, .local_batch = 3, .accumulation_steps = 2},
                                          train::adascale_policy{.base_batch = 4.0});
  };
  std::vector<std::byte> bytes;
  std::vector<int> ok(4, 0);
  gradapt::comm::run_threads(4, quick, [&](threads& comm) {
    flat_model m(8);
    auto step = make(comm, m);
    step.settings().rank_batches = {2, 4, 6, 8};
    for (int t = 0; t < 2; ++t) {
      for (auto& x : m.g) x = 0.5f + 0.1f * float(comm.rank() + t);
      step.step();
    }
    bool good = step.metrics().global_batch == 40.0 && step.metrics().scale == 10.0;
    const auto mine = step.save();
    if (comm.rank() == 0) bytes = mine;
    step.settings().rank_batches.clear();
    step.load(mine);
    good = good && step.settings().rank_batches == std::vector<double>{2, 4, 6, 8} &&
           step.metrics().global_batch == 40.0;
    ok[std::size_t(comm.rank())] = good ? 1 : 0;
  });
  CHECK(ok == std::vector<int>(4, 1));
  for (const int m : {4, 2}) {
    INFO("restore on " << m << " ranks");
    std::vector<int> fine(std::size_t(m), 0);
    gradapt::comm::run_threads(m, quick, [&](threads& comm) {
      flat_model model(8);
      auto step = make(comm, model);
      step.restore(bytes, train::rescale_rule::keep_global_batch);
      const auto& s = step.settings();
      bool good = m == 4 ? s.rank_batches == std::vector<double>{2, 4, 6, 8} && s.accumulation_steps == 2
                         : s.rank_batches.empty() && s.local_batch == 5.0 && s.accumulation_steps == 4;
      good = good && step.step().global_batch == 40.0 && step.metrics().scale == 10.0;
      fine[std::size_t(comm.rank())] = good ? 1 : 0;
    });
    CHECK(fine == std::vector<int>(std::size_t(m), 1));
  }
}

}  // namespace gradapt_test_train_hetero

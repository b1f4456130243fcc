// Ranks that disagree get an error on every rank: no crash, no hang, no silent divergence.
// Each case runs a world in which one rank differs from the others (an option, a schedule, a
// list, a per-call value) and requires that every rank ends in gradapt::error with a message
// that names what differs; the threads communicator's watchdog bounds every case, so a case
// that would hang fails with a timeout message instead.
#include "catch.hpp"

#include <chrono>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

using threads = gradapt::comm::threads;
namespace train = gradapt::train;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(5)};

/// Runs `body(comm)` on n ranks and returns every rank's error message ("" when none).
template <class F>
std::vector<std::string> errors_of(int n, F&& body) {
  std::vector<std::string> what(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, quick, [&](threads& comm) {
    try {
      body(comm);
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return what;
}

/// Every rank threw, and every message contains `needle` (or, on ranks other than `culprit`,
/// `others` when given: the message of a rank that was told another rank's input was bad).
void require_all(const std::vector<std::string>& what, const std::string& needle) {
  for (std::size_t r = 0; r < what.size(); ++r) {
    INFO("rank " << r << ": " << what[r] << " (expected: " << needle << ")");
    REQUIRE(what[r].find(needle) != std::string::npos);
    REQUIRE(what[r].find("did not arrive") == std::string::npos);  // settled, not timed out
    REQUIRE(what[r].find("gradapt: gradapt:") == std::string::npos);
  }
}

struct model {
  std::vector<float> w = std::vector<float>(12), b = std::vector<float>(3);
  std::vector<float> gw = std::vector<float>(12), gb = std::vector<float>(3);
  gradapt::param_list<float, float> params;
  model() {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * static_cast<float>(i);
    params.add("w", gradapt::host_view(w), gradapt::host_view(gw));
    params.add("b", gradapt::host_view(b), gradapt::host_view(gb));
  }
  void grads(std::uint64_t step) {
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = 0.1f * static_cast<float>((i + step) % 5) - 0.2f;
    for (auto& x : gb) x = 0.05f;
  }
};

}  // namespace

TEST_CASE("train step: a setting or option that differs on one rank is an error on every rank",
          "[disagreement][train]") {
  for (int n : {2, 3, 4}) {
    // Built with another learning rate on the last rank.
    require_all(errors_of(n,
                          [](threads& comm) {
                            model m;
                            const double lr = comm.rank() == comm.size() - 1 ? 0.2 : 0.1;
                            auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                                       gradapt::sgd({.lr = 0.1}), {.lr = lr});
                            (void)step;
                          }),
                "step_settings::lr is ");
    // Another local batch / AdaScale base batch.
    require_all(errors_of(n,
                          [](threads& comm) {
                            model m;
                            const double base = comm.rank() == 0 ? 4.0 : 8.0;
                            auto step = train::make_data_parallel_step(
                                comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                {.lr = 0.1, .local_batch = 16.0}, train::adascale_policy{.base_batch = base});
                            (void)step;
                          }),
                "adascale_policy::base_batch");
    // A per-call learning rate that differs.
    require_all(errors_of(n,
                          [](threads& comm) {
                            model m;
                            auto step = train::make_data_parallel_step(
                                comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
                            m.grads(1);
                            step.step({.lr = comm.rank() == 1 ? 0.05 : 0.1});
                          }),
                "learning rate (step_args::lr or step_settings::lr) is ");
    // An invalid per-call learning rate on one rank: that rank names it, the others name the rank.
    const auto bad_lr = errors_of(n, [](threads& comm) {
      model m;
      auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                                 {.lr = 0.1});
      m.grads(1);
      step.step({.lr = comm.rank() == 0 ? -1.0 : 0.1});
    });
    REQUIRE(bad_lr[0].find("step_args::lr is -1") != std::string::npos);
    for (int r = 1; r < n; ++r)
      REQUIRE(bad_lr[static_cast<std::size_t>(r)].find("rank 0 passed invalid input") != std::string::npos);
    // Momentum differs: nothing to name up front; the replica check finds the drift on the first step.
    require_all(errors_of(n,
                          [](threads& comm) {
                            model m;
                            const double mu = comm.rank() == 0 ? 0.9 : 0.0;
                            auto step = train::make_data_parallel_step(
                                comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1, .momentum = mu}),
                                {.lr = 0.1});
                            step.set_replica_check_interval(1);  // the first step is equal either way
                            for (std::uint64_t t = 1; t <= 3; ++t) {
                              m.grads(t);
                              step.step();
                            }
                          }),
                "the replicas differ");
    // Loss scaler options differ.
    require_all(errors_of(n,
                          [](threads& comm) {
                            model m;
                            const double growth = comm.rank() == 0 ? 2.0 : 4.0;
                            auto step = train::make_data_parallel_step(
                                comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}), {.lr = 0.1},
                                gradapt::loss_scaler({.growth_factor = growth}));
                            m.grads(1);
                            step.step();
                          }),
                "loss_scaler_options::growth_factor");
  }
}

TEST_CASE("LocalSGD: another period or start step on one rank is an error on every rank, not a hang",
          "[disagreement][local_sgd]") {
  for (int n : {2, 3}) {
    require_all(errors_of(n,
                          [](threads& comm) {
                            std::vector<float> x(6, static_cast<float>(comm.rank()));
                            const std::vector<gradapt::tensor_view<float>> xs = {gradapt::host_view(x)};
                            const std::int64_t k = comm.rank() == 0 ? 2 : 3;
                            gradapt::local_sgd lsgd(comm, {}, gradapt::fixed_period({.period = k}));
                            for (int t = 0; t < 12; ++t) lsgd.step(comm, gradapt::host{}, xs);
                          }),
                "every rank must pass the same ");
    require_all(errors_of(n,
                          [](threads& comm) {
                            std::vector<float> x(6, 1.0f);
                            const std::vector<gradapt::tensor_view<float>> xs = {gradapt::host_view(x)};
                            const std::uint64_t start = comm.rank() == 0 ? 0 : 1;
                            gradapt::local_sgd lsgd(comm, {.start_step = start},
                                                    gradapt::fixed_period({.period = 2}));
                            for (int t = 0; t < 12; ++t) lsgd.step(comm, gradapt::host{}, xs);
                          }),
                "every rank must pass the same ");
  }
}

TEST_CASE("average_models: a tensor more on one rank is an error on every rank, not a hang",
          "[disagreement][average_models]") {
  require_all(errors_of(3,
                        [](threads& comm) {
                          std::vector<float> a(4, 1.0f), b(4, 2.0f);
                          std::vector<gradapt::tensor_view<float>> xs = {gradapt::host_view(a)};
                          if (comm.rank() == 1) xs.push_back(gradapt::host_view(b));
                          gradapt::average_models(comm, gradapt::host{}, xs);
                        }),
              "tensors is ");
}

TEST_CASE("noise scale: a batch that differs across ranks is an error on every rank, not different estimates",
          "[disagreement][noise_scale]") {
  require_all(errors_of(3,
                        [](threads& comm) {
                          gradapt::gradient_noise_scale g;
                          const double mb = comm.rank() == 2 ? 16.0 : 8.0;
                          g.update(comm, 2.0, 1.0, {.micro_batch = mb});
                        }),
              "noise_batch::micro_batch is ");
}

TEST_CASE("Adasum: another element type or mode on one rank is an error on every rank, not a crash",
          "[disagreement][adasum]") {
  // float on rank 0, double elsewhere: named as an element type, not as a size.
  require_all(errors_of(3,
                        [](threads& comm) {
                          std::vector<float> xf(6, 1.0f);
                          std::vector<double> xd(6, 1.0);
                          gradapt::adasum<threads> ada(comm);
                          if (comm.rank() == 0) {
                            std::vector<gradapt::tensor_view<float>> list = {gradapt::host_view(xf)};
                            gradapt::adasum_workspace<float> ws(list);
                            ada.allreduce(gradapt::host{}, list, ws);
                          } else {
                            std::vector<gradapt::tensor_view<double>> list = {gradapt::host_view(xd)};
                            gradapt::adasum_workspace<double> ws(list);
                            ada.allreduce(gradapt::host{}, list, ws);
                          }
                        }),
              "the element types differ across ranks");
  // Hierarchical on rank 0 (it splits the world), flat elsewhere (it starts the reduction).
  require_all(
      errors_of(4,
                [](threads& comm) {
                  std::vector<float> x(6, 1.0f);
                  std::vector<gradapt::tensor_view<float>> list = {gradapt::host_view(x)};
                  gradapt::adasum_workspace<float> ws(list);
                  const auto mode =
                      comm.rank() == 0 ? gradapt::adasum_mode::hierarchical : gradapt::adasum_mode::flat;
                  gradapt::adasum<threads> ada(comm, {.mode = mode, .group_size = comm.rank() == 0 ? 2 : 1});
                  ada.allreduce(gradapt::host{}, list, ws);
                }),
      "must call the same collective");
}

#pragma once
// Ranks that disagree, written once over the communicator: each case is a body that one rank
// runs with another setting, option or per-call value than the others, and the text every
// rank's gradapt::error must contain. The threads tests (tests/test_disagreement.cpp) run each
// body on 2 to 4 threads ranks, the MPI tests (tests/mpi/test_mpi_train_step.cpp and
// test_mpi_local_sgd.cpp) on every rank of MPI_COMM_WORLD when it has 2 or more.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace disagreement_scenario {

/// A two-tensor model with deterministic gradients.
struct model {
  std::vector<float> w = std::vector<float>(12), b = std::vector<float>(3);
  std::vector<float> gw = std::vector<float>(12), gb = std::vector<float>(3);
  gradapt::param_list<float, float> params;
  model() {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * static_cast<float>(i);
    params.add("w", gradapt::host_view(w), gradapt::host_view(gw));
    params.add("b", gradapt::host_view(b), gradapt::host_view(gb));
  }
  model(const model&) = delete;
  model& operator=(const model&) = delete;
  void grads(std::uint64_t step) {
    for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = 0.1f * static_cast<float>((i + step) % 5) - 0.2f;
    for (auto& x : gb) x = 0.05f;
  }
};

/// One disagreement: `body` throws on every rank; the message of rank `culprit` contains
/// `needle`, every other rank's contains `others` (or `needle` when `others` is empty).
template <class Comm>
struct disagreement_case {
  std::string what;
  std::function<void(Comm&)> body;
  std::string needle;
  int culprit = -1;
  std::string others = {};

  /// The text rank r's message must contain.
  const std::string& expected(int r) const { return r == culprit || others.empty() ? needle : others; }
};

/// Settings, options and per-call values of train::data_parallel_step that differ on one rank.
template <class Comm>
std::vector<disagreement_case<Comm>> train_step_cases() {
  namespace train = gradapt::train;
  return {
      {"another learning rate on the last rank, at construction",
       [](Comm& comm) {
         model m;
         const double lr = comm.rank() == comm.size() - 1 ? 0.2 : 0.1;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::sgd({.lr = 0.1}), {.lr = lr});
         (void)step;
       },
       "step_settings::lr is "},
      {"another local batch / AdaScale base batch on rank 0",
       [](Comm& comm) {
         model m;
         const double base = comm.rank() == 0 ? 4.0 : 8.0;
         auto step = train::make_data_parallel_step(
             comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}), {.lr = 0.1, .local_batch = 16.0},
             train::adascale_policy{.base_batch = base});
         (void)step;
       },
       "adascale_policy::base_batch"},
      {"another per-call learning rate on rank 1",
       [](Comm& comm) {
         model m;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
         m.grads(1);
         step.step({.lr = comm.rank() == 1 ? 0.05 : 0.1});
       },
       "learning rate (step_args::lr or step_settings::lr) is "},
      {"an invalid per-call learning rate on rank 0: that rank names it, the others name the rank",
       [](Comm& comm) {
         model m;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
         m.grads(1);
         step.step({.lr = comm.rank() == 0 ? -1.0 : 0.1});
       },
       "step_args::lr is -1", 0, "rank 0 passed invalid input"},
      {"another momentum on rank 0, at construction (the optimizer's stage options)",
       [](Comm& comm) {
         model m;
         const double mu = comm.rank() == 0 ? 0.9 : 0.0;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::sgd({.lr = 0.1, .momentum = mu}), {.lr = 0.1});
         (void)step;
       },
       "momentum (stage trace: decay) is "},
      {"another AdamW b2 on the last rank, at construction",
       [](Comm& comm) {
         model m;
         const double b2 = comm.rank() == comm.size() - 1 ? 0.99 : 0.999;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::adamw({.lr = 0.1, .b2 = b2}), {.lr = 0.1});
         (void)step;
       },
       "scale_by_adam b2 is "},
      {"another initial parameter on rank 0: the replica check finds what no option names",
       [](Comm& comm) {
         model m;
         if (comm.rank() == 0) m.w[3] += 0.5f;
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                    gradapt::sgd({.lr = 0.1, .momentum = 0.9}), {.lr = 0.1});
         step.set_replica_check_interval(1);
         for (std::uint64_t t = 1; t <= 3; ++t) {
           m.grads(t);
           step.step();
         }
       },
       "the replicas differ"},
      {"other loss scaler options on rank 0",
       [](Comm& comm) {
         model m;
         const double growth = comm.rank() == 0 ? 2.0 : 4.0;
         auto step =
             train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                            {.lr = 0.1}, gradapt::loss_scaler({.growth_factor = growth}));
         m.grads(1);
         step.step();
       },
       "loss_scaler_options::growth_factor"},
      {"another optimizer on rank 0: each rank's message names its own",
       [](Comm& comm) {
         model m;
         if (comm.rank() == 0) {
           auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                      gradapt::adamw({.lr = 0.1}), {.lr = 0.1});
           (void)step;
         } else {
           auto step = train::make_data_parallel_step(
               comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1, .momentum = 0.9}), {.lr = 0.1});
           (void)step;
         }
       },
       "the optimizer (this rank's: adamw = chain<", 0, "the optimizer (this rank's: sgd = chain<"},
      {"AdaScale on the last rank only",
       [](Comm& comm) {
         model m;
         if (comm.rank() == comm.size() - 1) {
           auto step =
               train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::sgd({.lr = 0.1}),
                                              {.lr = 0.1}, train::adascale_policy{});
           (void)step;
         } else {
           auto step = train::make_data_parallel_step(comm, gradapt::host{}, m.params,
                                                      gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
           (void)step;
         }
       },
       "adapt slot (1: adascale_policy on) is "},
      {"the same sizes in another shape on rank 0",
       [](Comm& comm) {
         std::vector<float> w(12, 0.5f), g(12, 0.1f);
         const std::vector<std::int64_t> shape =
             comm.rank() == 0 ? std::vector<std::int64_t>{3, 4} : std::vector<std::int64_t>{4, 3};
         gradapt::param_list<float, float> params;
         params.add("w", gradapt::tensor_view<float>(w.data(), shape),
                    gradapt::tensor_view<float>(g.data(), shape));
         auto step = train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd({.lr = 0.1}),
                                                    {.lr = 0.1});
         (void)step;
       },
       "parameter shapes (a hash of every tensor's rank and extents) is "},
  };
}

/// Twelve LocalSGD steps over one tensor of six values `x0`, with the given start step and
/// fixed period.
template <class Comm>
void local_sgd_steps(Comm& comm, float x0, std::uint64_t start, std::int64_t period) {
  std::vector<float> x(6, x0);
  const std::vector<gradapt::tensor_view<float>> xs = {gradapt::host_view(x)};
  gradapt::local_sgd lsgd(comm, {.start_step = start}, gradapt::fixed_period({.period = period}));
  for (int t = 0; t < 12; ++t) lsgd.step(comm, gradapt::host{}, xs);
}

/// LocalSGD schedules that differ on one rank: an error at the first differing round, not a hang.
template <class Comm>
std::vector<disagreement_case<Comm>> local_sgd_cases() {
  return {
      {"another period on rank 0",
       [](Comm& comm) {
         local_sgd_steps(comm, static_cast<float>(comm.rank()), 0, comm.rank() == 0 ? 2 : 3);
       },
       "fixed_period period is "},
      {"another start step on rank 0",
       [](Comm& comm) { local_sgd_steps(comm, 1.0f, comm.rank() == 0 ? 0 : 1, 2); },
       "every rank must pass the same "},
  };
}

}  // namespace disagreement_scenario

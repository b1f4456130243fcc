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
#include <utility>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_errors.hpp"
#include "scenarios/disagreement.hpp"

namespace gradapt_test_disagreement {

using threads = gradapt::comm::threads;
namespace train = gradapt::train;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(5)};

/// Every rank's error message ("" when none), with the short watchdog.
template <class F>
std::vector<std::string> errors_of(int n, F&& body) {
  return gradapt_test::errors_of(n, quick, std::forward<F>(body));
}

/// Every rank threw, and every message contains `needle` (or, on ranks other than `culprit`,
/// `others` when given: the message of a rank that was told another rank's input was bad).
void require_all(const std::vector<std::string>& what, const std::string& needle, int culprit = -1,
                 const std::string& others = {}) {
  for (std::size_t r = 0; r < what.size(); ++r) {
    const std::string& want = static_cast<int>(r) == culprit || others.empty() ? needle : others;
    INFO("rank " << r << ": " << what[r] << " (expected: " << want << ")");
    REQUIRE(what[r].find(want) != std::string::npos);
    REQUIRE(what[r].find("did not arrive") == std::string::npos);  // settled, not timed out
    REQUIRE(what[r].find("gradapt: gradapt:") == std::string::npos);
  }
}

/// Runs every case on n ranks and requires every rank's error to name what differs.
void require_cases(int n, const std::vector<disagreement_scenario::disagreement_case<threads>>& cases) {
  for (const auto& c : cases) {
    INFO(n << " ranks: " << c.what);
    require_all(errors_of(n, c.body), c.needle, c.culprit, c.others);
  }
}

}  // namespace

TEST_CASE("train step: a setting or option that differs on one rank is an error on every rank",
          "[disagreement][train]") {
  for (int n : {2, 3, 4}) require_cases(n, disagreement_scenario::train_step_cases<threads>());
}

TEST_CASE("LocalSGD: another period or start step on one rank is an error on every rank, not a hang",
          "[disagreement][local_sgd]") {
  for (int n : {2, 3}) require_cases(n, disagreement_scenario::local_sgd_cases<threads>());
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

TEST_CASE("agree_values_and_share: every rank reads every rank's values; a bad value is an error everywhere",
          "[comm][agree]") {
  // 2 values from each of n ranks: 2n words beyond the agreement's own, past the 64-word stack
  // buffer from n = 29 on (then in the caller's workspace, reused over the calls).
  for (const int n : {1, 2, 5, 40}) {
    INFO(n << " ranks");
    std::vector<int> ok(static_cast<std::size_t>(n), 0);
    gradapt::comm::run_threads(n, quick, [&](threads& comm) {
      std::vector<double> shared(2 * static_cast<std::size_t>(n)), ws;
      bool good = true;
      for (int call = 0; call < 3; ++call) {
        const double mine[2] = {comm.rank() * 1.5 - 7.0 + call, -1e300};
        gradapt::agree_values_and_share(comm, "test share", {{{"call", double(call)}}},
                                        std::span<const double>(mine), std::span<double>(shared), {}, &ws);
        for (int r = 0; r < n; ++r)
          good = good && shared[2 * std::size_t(r)] == r * 1.5 - 7.0 + call &&
                 shared[2 * std::size_t(r) + 1] == -1e300;
      }
      ok[static_cast<std::size_t>(comm.rank())] = good ? 1 : 0;
    });
    CHECK(ok == std::vector<int>(static_cast<std::size_t>(n), 1));
  }
  const auto what = errors_of(3, [](threads& comm) {
    std::vector<double> shared(3);
    const double mine[1] = {comm.rank() == 1 ? std::nan("") : 1.0};
    gradapt::agree_values_and_share(comm, "test share", {}, std::span<const double>(mine),
                                    std::span<double>(shared));
  });
  require_all(what, "a shared value is nan", 1, "rank 1 passed invalid input");
  const auto apart = errors_of(3, [](threads& comm) {
    std::vector<double> shared(3);
    const double mine[1] = {1.0};
    gradapt::agree_values_and_share(comm, "test share", {{{"k", comm.rank() == 2 ? 2.0 : 1.0}}},
                                    std::span<const double>(mine), std::span<double>(shared));
  });
  require_all(apart, "k is");
}

}  // namespace gradapt_test_disagreement

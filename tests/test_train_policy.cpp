// A combine policy and a stateful hook written outside include/, plugged into
// train::make_data_parallel_step through the documented contract (train/policies.hpp:
// `policy_slot`, `combine_policy`, `saves_state`) without editing the library.
//
// The policy is top-k sparsification with error feedback (Stich, Cordonnier & Jaggi 2018,
// "Sparsified SGD with Memory"; Aji & Heafield 2017): each rank adds its residual to its
// gradient, keeps the k largest magnitudes of each tensor, carries the rest to the next step,
// and the kept values are averaged over the ranks.
//
// What is checked, and against what (comm::threads, 1 to 4 ranks):
//  - the composed step's parameters against a serial re-computation of the same algorithm
//    over all ranks' gradients (written here from the paper's description);
//  - error feedback conserves the gradient: N · Σ_steps (averaged kept values) + Σ_r residual_r
//    equals Σ_steps Σ_r g_r;
//  - the combiner's residual and the hook's counter are in the step's checkpoint: a run
//    continued from a checkpoint equals the uninterrupted run bit for bit, and a checkpoint of
//    a combiner with other options is rejected on every rank, leaving the step unchanged.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"

namespace gradapt_test_train_policy {

using Catch::Matchers::Contains;
namespace train = gradapt::train;
using threads = gradapt::comm::threads;

namespace user {

/// The k = ceil(fraction · n) largest |e_i| of e (ties to the lower index): kept[i] true.
std::vector<bool> top_k(const std::vector<float>& e, double fraction) {
  const std::size_t n = e.size();
  const auto k = std::min(n, static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(n))));
  std::vector<std::size_t> idx(n);
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  std::stable_sort(idx.begin(), idx.end(),
                   [&](std::size_t a, std::size_t b) { return std::fabs(e[a]) > std::fabs(e[b]); });
  std::vector<bool> kept(n, false);
  for (std::size_t j = 0; j < k; ++j) kept[idx[j]] = true;
  return kept;
}

/// Top-k with error feedback, a combine policy defined by a user.
struct topk_combine {
  static constexpr train::policy_slot slot = train::policy_slot::combine;
  double fraction = 0.25;  ///< share of each tensor's elements sent per step

  /// The combiner bound to a parameter list: a residual per tensor.
  struct bound {
    double fraction = 0.25;
    std::vector<std::vector<float>> residual;

    template <class Comm, class B, class L>
    void combine(Comm& comm, const B&, const L& grads) {
      for (std::size_t t = 0; t < grads.size(); ++t) {
        float* g = grads[t].data();
        auto& res = residual[t];
        std::vector<float> e(res.size());
        for (std::size_t i = 0; i < e.size(); ++i) e[i] = g[i] + res[i];
        const auto kept = top_k(e, fraction);
        for (std::size_t i = 0; i < e.size(); ++i) {
          g[i] = kept[i] ? e[i] : 0.0f;
          res[i] = kept[i] ? 0.0f : e[i];
        }
        comm.allreduce(grads[t], gradapt::reduce_op::sum);
        for (std::size_t i = 0; i < e.size(); ++i) g[i] /= static_cast<float>(comm.size());
      }
    }
    void save(gradapt::archive_writer& w) const {
      w.put("fraction", fraction);
      for (std::size_t t = 0; t < residual.size(); ++t)
        w.put_tensor<float>("residual" + std::to_string(t), residual[t]);
    }
    void load(gradapt::archive_reader& r) {
      const auto f = r.get<double>("fraction");
      gradapt::detail::require(f == fraction, "topk_combine: the checkpoint's fraction is ", f,
                               " but this one's is ", fraction);
      std::vector<std::vector<float>> in(residual.size());
      for (std::size_t t = 0; t < in.size(); ++t) {
        in[t].resize(residual[t].size());
        r.get_tensor<float>("residual" + std::to_string(t), in[t]);
      }
      residual = std::move(in);  // all or nothing
    }
  };

  template <class Comm, class B, class PL>
  bound bind(Comm&, const B&, const PL& params) const {
    static_assert(std::is_same_v<typename PL::grad_type, float>, "topk_combine: float gradients");
    bound b{fraction, {}};
    for (const auto& g : params.grads()) b.residual.emplace_back(g.size(), 0.0f);
    return b;
  }
};

/// A hook with state of its own: counts the steps it has seen.
struct step_counter {
  std::uint64_t seen = 0;
  void after_step(train::step_settings&, const train::step_metrics&) { ++seen; }
  void save(gradapt::archive_writer& w) const { w.put("seen", seen); }
  void load(gradapt::archive_reader& r) { seen = r.get<std::uint64_t>("seen"); }
};

}  // namespace user

static_assert(train::combine_policy<user::topk_combine, threads, gradapt::host, gradapt::param_list<float>>);
static_assert(
    !train::mean_combiner<user::topk_combine::bound, threads, gradapt::host, gradapt::param_list<float>>);
static_assert(train::saves_state<user::topk_combine::bound> && train::saves_state<user::step_counter>);

namespace {

const std::vector<std::size_t> sizes{40, 7, 100};
constexpr double lr = 0.1;

std::vector<std::vector<float>> initial() {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<std::vector<float>> p;
  for (auto n : sizes) {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(u(rng));
    p.push_back(std::move(v));
  }
  return p;
}

std::vector<std::vector<float>> gradient(int rank, int step) {
  std::mt19937_64 rng(100 * static_cast<std::uint64_t>(step) + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<std::vector<float>> g;
  for (auto n : sizes) {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(u(rng));
    g.push_back(std::move(v));
  }
  return g;
}

struct replica {
  std::vector<std::vector<float>> p = initial(), g;
  gradapt::param_list<float> params;
  replica() {
    for (auto n : sizes) g.emplace_back(n);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      params.add("t" + std::to_string(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]));
  }
  replica(const replica&) = delete;
  replica& operator=(const replica&) = delete;
};

template <class Step>
void run_steps(Step& step, replica& rep, int rank, int from, int to) {
  for (int s = from; s <= to; ++s) {
    const auto g = gradient(rank, s);
    for (std::size_t t = 0; t < sizes.size(); ++t) std::copy(g[t].begin(), g[t].end(), rep.g[t].begin());
    step.step({.loss = 1.0 / s});
  }
}

}  // namespace

TEST_CASE("outside policy: top-k with error feedback against a serial re-computation", "[train][policy]") {
  constexpr int steps = 5;
  for (int n = 1; n <= 4; ++n) {
    std::vector<std::vector<std::vector<float>>> params(static_cast<std::size_t>(n));
    std::vector<std::vector<std::vector<float>>> residual(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, [&](threads& comm) {
      replica rep;
      auto step =
          train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, rep.params,
                                         gradapt::sgd({.lr = lr}), {.lr = lr}, user::topk_combine{0.2});
      run_steps(step, rep, comm.rank(), 1, steps);
      params[static_cast<std::size_t>(comm.rank())] = rep.p;
      residual[static_cast<std::size_t>(comm.rank())] = step.combiner().residual;
    });

    // The same algorithm, serially over all ranks, in double.
    auto p = initial();
    std::vector<std::vector<std::vector<double>>> res(static_cast<std::size_t>(n));
    for (auto& r : res)
      for (auto s : sizes) r.emplace_back(s, 0.0);
    std::vector<std::vector<double>> sent(sizes.size()), seen(sizes.size());
    for (std::size_t t = 0; t < sizes.size(); ++t)
      sent[t].assign(sizes[t], 0.0), seen[t].assign(sizes[t], 0.0);
    for (int s = 1; s <= steps; ++s) {
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        std::vector<double> mean(sizes[t], 0.0);
        for (int r = 0; r < n; ++r) {
          const auto g = gradient(r, s)[t];
          std::vector<float> e(sizes[t]);
          for (std::size_t i = 0; i < e.size(); ++i) {
            e[i] = static_cast<float>(g[i] + res[static_cast<std::size_t>(r)][t][i]);
            seen[t][i] += g[i];
          }
          const auto kept = user::top_k(e, 0.2);
          for (std::size_t i = 0; i < e.size(); ++i) {
            mean[i] += kept[i] ? e[i] : 0.0;
            res[static_cast<std::size_t>(r)][t][i] = kept[i] ? 0.0 : e[i];
          }
        }
        for (std::size_t i = 0; i < mean.size(); ++i) {
          mean[i] /= n;
          sent[t][i] += n * mean[i];
          p[t][i] = static_cast<float>(p[t][i] - lr * mean[i]);
        }
      }
    }
    for (int r = 0; r < n; ++r)
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          INFO("ranks " << n << ", rank " << r << ", tensor " << t << ", element " << i);
          REQUIRE(std::fabs(params[static_cast<std::size_t>(r)][t][i] - p[t][i]) < 1e-5);
          REQUIRE(std::fabs(residual[static_cast<std::size_t>(r)][t][i] -
                            res[static_cast<std::size_t>(r)][t][i]) < 1e-5);
        }
    // Error feedback loses nothing: what was sent plus what is held equals what was seen.
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        double held = 0.0;
        for (int r = 0; r < n; ++r) held += residual[static_cast<std::size_t>(r)][t][i];
        REQUIRE(std::fabs(sent[t][i] + held - seen[t][i]) < 1e-4);
      }
  }
}

TEST_CASE("outside policy: its state and a hook's are in the step's checkpoint", "[train][policy]") {
  constexpr int n = 3;
  gradapt::comm::run_threads(n, [&](threads& comm) {
    const int r = comm.rank();
    // Uninterrupted: 7 steps. Interrupted: 4 steps, checkpoint, a new step loads it, 3 steps.
    replica a;
    auto sa =
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, a.params, gradapt::sgd({.lr = lr}),
                                       {.lr = lr}, user::topk_combine{0.1}, user::step_counter{});
    run_steps(sa, a, r, 1, 4);
    const auto ckpt = sa.save();
    const auto p4 = a.p;
    run_steps(sa, a, r, 5, 7);

    replica b;
    b.p = p4;
    auto sb =
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, b.params, gradapt::sgd({.lr = lr}),
                                       {.lr = lr}, user::topk_combine{0.1}, user::step_counter{});
    sb.load(ckpt);
    RANK_REQUIRE(std::get<0>(sb.hooks()).seen == 4);
    RANK_REQUIRE(!(sb.combiner().residual == sa.combiner().residual));  // sa ran 3 more steps
    run_steps(sb, b, r, 5, 7);
    RANK_REQUIRE(std::get<0>(sb.hooks()).seen == 7);
    RANK_REQUIRE(sb.combiner().residual == sa.combiner().residual);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      RANK_REQUIRE(std::memcmp(a.p[t].data(), b.p[t].data(), sizes[t] * sizeof(float)) == 0);

    // A combiner with other options rejects the checkpoint and keeps its state.
    replica c;
    auto sc =
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, c.params, gradapt::sgd({.lr = lr}),
                                       {.lr = lr}, user::topk_combine{0.5}, user::step_counter{});
    run_steps(sc, c, r, 1, 2);
    const auto before = sc.save();
    RANK_REQUIRE_THROWS_WITH(sc.load(ckpt), Contains("topk_combine: the checkpoint's fraction is 0.1"));
    RANK_REQUIRE(sc.save() == before);
    RANK_REQUIRE(std::get<0>(sc.hooks()).seen == 2);
  });
}

TEST_CASE("step_args: one per-step input for optimizers and the train step", "[train][policy]") {
  gradapt::comm::run_threads(2, [&](threads& comm) {
    replica a, b;
    auto sa = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, a.params,
                                             gradapt::sgd({.lr = lr}), {.lr = lr});
    auto sb = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, b.params,
                                             gradapt::sgd({.lr = lr}), {.lr = 1.0});
    // The call's lr overrides the settings' for that call only.
    const auto g = gradient(comm.rank(), 1);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::copy(g[t].begin(), g[t].end(), a.g[t].begin());
      std::copy(g[t].begin(), g[t].end(), b.g[t].begin());
    }
    const auto& ma = sa.step({.lr = 0.05, .loss = 2.0});
    RANK_REQUIRE(ma.lr == 0.05);
    RANK_REQUIRE(ma.loss == 2.0);
    RANK_REQUIRE(sa.settings().lr == lr);
    const auto& mb = sb.step({.lr = 0.05});
    RANK_REQUIRE(mb.lr == 0.05);
    for (std::size_t t = 0; t < sizes.size(); ++t) RANK_REQUIRE(a.p[t] == b.p[t]);
    RANK_REQUIRE_THROWS_WITH(sa.step({.lr = -1.0}), Contains("step_args::lr is -1"));
  });
}

}  // namespace gradapt_test_train_policy

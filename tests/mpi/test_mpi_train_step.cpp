// train::data_parallel_step over comm::mpi with 1 to 5 ranks (odd counts included).
//
// - The composed step equals the stages called one by one on the same communicator, bit for
//   bit in the parameters and the metrics: LAMB + loss scaling (fp16 gradients, an overflow on
//   the last rank) + noise scale + AdaScale; AdamW + Adasum; SGD with momentum + LocalSGD.
// - The parameters are identical on every rank after synchronous steps (allgathered, bitwise).
// - A checkpoint taken mid-run and restored into a fresh step continues bit for bit.
// - Lists that differ across ranks make every rank throw; none hangs.
//
// Every collective runs on every rank before any REQUIRE, so a failure on one rank cannot leave
// the others waiting in a collective.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

using gradapt::half;
namespace train = gradapt::train;
using mpi = gradapt::comm::mpi;

namespace {

constexpr double base_batch = 8.0;

template <class G>
struct replica {
  std::vector<std::vector<float>> p;
  std::vector<std::vector<G>> g;
  gradapt::param_list<float, G> params;

  explicit replica(std::vector<std::size_t> sizes = {7, 1, 33, 5}) {
    std::mt19937_64 rng(99);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (std::size_t n : sizes) {
      std::vector<float> v(n);
      for (auto& x : v) x = static_cast<float>(u(rng));
      p.push_back(std::move(v));
      g.push_back(std::vector<G>(n));
    }
    for (std::size_t t = 0; t < sizes.size(); ++t)
      params.add("t" + std::to_string(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]));
  }
  replica(const replica&) = delete;
  replica& operator=(const replica&) = delete;

  void fill(int rank, std::uint64_t step, double loss_scale, bool inject_inf = false) {
    std::mt19937_64 shared(1000 + step), own(7 * step + 131 * static_cast<std::uint64_t>(rank) + 3);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (auto& t : g)
      for (auto& x : t) x = G(static_cast<float>((0.4 * u(shared) + 0.6 * u(own)) * loss_scale));
    if (inject_inf) g[2][5] = G(std::numeric_limits<float>::infinity());
  }
  std::vector<float> flat() const {
    std::vector<float> out;
    for (const auto& t : p) out.insert(out.end(), t.begin(), t.end());
    return out;
  }
  void set(const std::vector<float>& flat) {
    std::size_t at = 0;
    for (auto& t : p)
      for (auto& x : t) x = flat[at++];
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_double(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

struct lr_hook {
  void before_step(train::step_settings& s, const train::step_metrics& last) {
    s.lr = 0.05 / (1.0 + 0.05 * last.progress);
  }
};

struct run_result {
  std::vector<float> params;
  std::vector<train::step_metrics> metrics;
};

enum class recipe { lamb_scaled_adascale, adamw_adasum, sgd_local };
constexpr int steps = 7, inf_at = 4;

run_result composed(mpi& comm, recipe which) {
  const int r = comm.rank(), n = comm.size();
  replica<half> rep;
  run_result out;
  const auto loop = [&](auto& step) {
    for (int t = 1; t <= steps; ++t) {
      rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == inf_at && r == n - 1);
      out.metrics.push_back(step.step({.loss = 1.0 / t}));
    }
  };
  const gradapt::host b{};
  if (which == recipe::lamb_scaled_adascale) {
    auto step = train::make_data_parallel_step(
        comm, b, rep.params, gradapt::lamb({.weight_decay = 0.01}), {.lr = 0.05, .local_batch = base_batch},
        gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 3}),
        train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.5}}, lr_hook{});
    loop(step);
  } else if (which == recipe::adamw_adasum) {
    auto step = train::make_data_parallel_step(comm, b, rep.params, gradapt::adamw(), {.lr = 0.05},
                                               gradapt::loss_scaler({.init_scale = 1024.0}),
                                               train::adasum_combine{}, lr_hook{});
    loop(step);
  } else {
    auto step = train::make_data_parallel_step(
        comm, b, rep.params, gradapt::sgd({.momentum = 0.9}), {.lr = 0.05},
        gradapt::loss_scaler({.init_scale = 1024.0}),
        train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 2})}, lr_hook{});
    loop(step);
  }
  out.params = rep.flat();
  return out;
}

template <class Opt>
run_result by_hand(mpi& comm, recipe which, const Opt& opt) {
  const int r = comm.rank(), n = comm.size();
  const bool adapt = which == recipe::lamb_scaled_adascale, adasum = which == recipe::adamw_adasum,
             local = which == recipe::sgd_local;
  replica<half> rep;
  const gradapt::host b{};
  auto state = opt.init(b, rep.params);
  gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = adapt ? 3 : 2000});
  std::optional<gradapt::adasum<mpi>> comb;
  std::optional<gradapt::adasum_workspace<half>> ws;
  if (adasum) {
    comb.emplace(comm);
    ws.emplace(rep.params.grads());
  }
  gradapt::gradient_noise_scale gns({.smoothing = 0.5});
  gradapt::adascale ada({.scale = static_cast<double>(n)});
  gradapt::local_sgd<mpi, gradapt::fixed_period> lsgd(comm, {.start_step = 2},
                                                      gradapt::fixed_period({.period = 2}));
  run_result out;
  double progress = 0.0;
  for (int t = 1; t <= steps; ++t) {
    const double lr0 = 0.05 / (1.0 + 0.05 * progress);
    train::step_metrics m;
    m.step = static_cast<std::uint64_t>(t);
    m.loss = 1.0 / t;
    if (adapt) m.scale = ada.scale();
    rep.fill(r, static_cast<std::uint64_t>(t), scaler.scale(), t == inf_at && r == n - 1);
    const bool ok = scaler.unscale(b, comm, rep.params);
    m.loss_scale = scaler.scale();
    if (ok) {
      const bool sync = !local || lsgd.sync_gradients();
      m.synchronous = sync;
      if (sync) {
        if (adasum) {
          comb->allreduce(b, rep.params.grads(), *ws);
        } else if (n > 1) {
          gradapt::allreduce_norms norms{0.0, 0.0};
          for (const auto& g : rep.params.grads()) {
            if (adapt) {
              const auto x = gradapt::allreduce_with_norms(comm, b, g);
              norms.sum_local_sq += x.sum_local_sq;
              norms.result_sq += x.result_sq;
            } else {
              comm.allreduce(g, gradapt::reduce_op::sum);
            }
          }
          const float fn = static_cast<float>(n);
          b.apply_list([fn](float& g) { g = g / fn; }, rep.params.grads());
          if (adapt) gns.update(norms, n, gradapt::noise_batch{.micro_batch = base_batch});
        }
      }
      double gain = 1.0, lr = lr0;
      if (adapt) {
        gain = ada.advance(gns, base_batch);
        lr = lr0 * gain;
      }
      opt.step(b, rep.params, state, {.lr = lr});
      if (local) m.averaged = lsgd.step(comm, b, rep.params.values()).averaged;
      m.stepped = true;
      m.gain = gain;
      m.lr = lr;
    } else {
      m.found_inf = true;
    }
    m.optimizer_steps = state.steps();
    m.progress = adapt ? ada.progress() : static_cast<double>(state.steps());
    if (adapt) m.noise_scale = gns.b_simple().value_or(std::numeric_limits<double>::quiet_NaN());
    progress = m.progress;
    out.metrics.push_back(m);
  }
  out.params = rep.flat();
  return out;
}

void require_same(const run_result& a, const run_result& b) {
  REQUIRE(same_bits(a.params, b.params));
  REQUIRE(a.metrics.size() == b.metrics.size());
  for (std::size_t k = 0; k < a.metrics.size(); ++k) {
    const auto &x = a.metrics[k], &y = b.metrics[k];
    INFO("step " << k + 1);
    REQUIRE(x.step == y.step);
    REQUIRE(x.optimizer_steps == y.optimizer_steps);
    REQUIRE(same_double(x.loss_scale, y.loss_scale));
    REQUIRE(((std::isnan(x.noise_scale) && std::isnan(y.noise_scale)) ||
             same_double(x.noise_scale, y.noise_scale)));
    REQUIRE(same_double(x.gain, y.gain));
    REQUIRE(same_double(x.lr, y.lr));
    REQUIRE(same_double(x.progress, y.progress));
    REQUIRE(same_double(x.scale, y.scale));
    REQUIRE(x.found_inf == y.found_inf);
    REQUIRE(x.stepped == y.stepped);
    REQUIRE(x.synchronous == y.synchronous);
    REQUIRE(x.averaged == y.averaged);
  }
}

/// Rank r's vector as seen on every rank, compared with rank 0's.
bool same_on_all_ranks(mpi& comm, const std::vector<float>& v) {
  std::vector<float> all(v.size() * static_cast<std::size_t>(comm.size()));
  comm.allgather(gradapt::tensor_view<const float>(gradapt::host_view(v)), gradapt::host_view(all));
  for (int r = 1; r < comm.size(); ++r)
    if (std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * v.size(),
                    v.size() * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace

TEST_CASE("mpi: the composed step equals the stages by hand", "[mpi][train]") {
  mpi comm;
  const auto a = composed(comm, recipe::lamb_scaled_adascale);
  const auto b = by_hand(comm, recipe::lamb_scaled_adascale, gradapt::lamb({.weight_decay = 0.01}));
  const bool in_sync = same_on_all_ranks(comm, a.params);
  const auto c = composed(comm, recipe::adamw_adasum);
  const auto d = by_hand(comm, recipe::adamw_adasum, gradapt::adamw());
  const bool adasum_in_sync = same_on_all_ranks(comm, c.params);
  const auto e = composed(comm, recipe::sgd_local);
  const auto f = by_hand(comm, recipe::sgd_local, gradapt::sgd({.momentum = 0.9}));
  require_same(a, b);
  require_same(c, d);
  require_same(e, f);
  REQUIRE(in_sync);
  REQUIRE(adasum_in_sync);
  // The overflow on the last rank skipped step inf_at everywhere.
  REQUIRE(a.metrics[inf_at - 1].found_inf);
  REQUIRE(a.metrics.back().optimizer_steps == steps - 1);
  if (comm.size() >= 2) REQUIRE(std::isfinite(a.metrics.back().noise_scale));
}

TEST_CASE("mpi: a restored checkpoint continues bit for bit", "[mpi][train]") {
  mpi comm;
  const int r = comm.rank();
  constexpr int total = 9, cut = 5;
  const auto build = [&](replica<half>& rep) {
    return train::make_data_parallel_step(
        comm, gradapt::host{}, rep.params, gradapt::lamb(), {.lr = 0.01, .local_batch = base_batch},
        gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 2}),
        train::adascale_policy{.base_batch = base_batch},
        train::local_sgd_policy{{.start_step = 3}, gradapt::fixed_period({.period = 2})}, lr_hook{});
  };
  std::vector<std::byte> ck;
  std::vector<float> ck_params, straight, resumed;
  {
    replica<half> rep;
    auto step = build(rep);
    for (int t = 1; t <= total; ++t) {
      rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == 2 && r == 0);
      step.step();
      if (t == cut) {
        ck = step.save();
        ck_params = rep.flat();
      }
    }
    straight = rep.flat();
  }
  {
    replica<half> rep;
    auto step = build(rep);
    rep.set(ck_params);
    step.load(ck);
    for (int t = cut + 1; t <= total; ++t) {
      rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == 2 && r == 0);
      step.step();
    }
    resumed = rep.flat();
  }
  REQUIRE(same_bits(straight, resumed));
}

TEST_CASE("mpi: parameter lists that differ across ranks throw on every rank", "[mpi][train]") {
  mpi comm;
  if (comm.size() < 2) return;
  replica<float> rep(comm.rank() == comm.size() - 1 ? std::vector<std::size_t>{7, 1, 33, 6}
                                                    : std::vector<std::size_t>{7, 1, 33, 5});
  std::string what;
  try {
    auto step =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, gradapt::sgd(), {.lr = 0.1});
    step.step();
  } catch (const gradapt::error& e) {
    what = e.what();
  }
  REQUIRE(what.find("every rank must pass the same parameter") != std::string::npos);
}

TEST_CASE("mpi: settings and options that differ across ranks throw on every rank",
          "[mpi][train][disagreement]") {
  mpi comm;
  if (comm.size() < 2) return;
  const int r = comm.rank();
  const auto what_of = [](auto&& body) {
    try {
      body();
    } catch (const gradapt::error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {  // another learning rate on the last rank, at construction
    replica<float> rep;
    const double lr = r == comm.size() - 1 ? 0.2 : 0.1;
    CHECK(what_of([&] {
            (void)train::make_data_parallel_step(comm, gradapt::host{}, rep.params, gradapt::sgd(),
                                                 {.lr = lr});
          }).find("step_settings::lr is ") != std::string::npos);
  }
  {  // another per-call learning rate on rank 1
    replica<float> rep;
    auto step =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, gradapt::sgd(), {.lr = 0.1});
    rep.fill(r, 1, 1.0);
    CHECK(what_of([&] {
            step.step({.lr = r == 1 ? 0.05 : 0.1});
          }).find("learning rate (step_args::lr or step_settings::lr) is ") != std::string::npos);
  }
  {  // another momentum on rank 0: the replica check finds the drift
    replica<float> rep;
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, rep.params,
                                               gradapt::sgd({.momentum = r == 0 ? 0.9 : 0.0}), {.lr = 0.1});
    step.set_replica_check_interval(1);
    const std::string e = what_of([&] {
      for (int t = 1; t <= 3; ++t) {
        rep.fill(r, static_cast<std::uint64_t>(t), 1.0);
        step.step();
      }
    });
    CHECK(e.find("the replicas differ") != std::string::npos);
  }
}

#pragma once
// Scenarios of train::data_parallel_step written once over the communicator: the threads tests
// (tests/test_train_step.cpp) call them inside run_threads, the MPI tests
// (tests/mpi/test_mpi_train_step.cpp) on MPI_COMM_WORLD.
//
//  - run_composed: the composed step, driven by a plan (learning-rate schedule, an overflow on
//    the last rank, a batch change) through a recording hook;
//  - run_by_hand: the same stages called one by one (loss_scaler::unscale,
//    allreduce_with_norms / allreduce + divide / adasum::allreduce, gradient_noise_scale,
//    adascale, the optimizer's step, local_sgd::step) with the plan applied by the loop;
//  - require_same: both runs agree bit for bit in the parameters and every metric;
//  - checkpoint_straight / checkpoint_resumed: a run with a checkpoint after step `cut`, and a
//    fresh step that loads it and continues.
//
// The run functions hold no assertion (they run on rank threads); the require_* functions
// assert with Catch2 and run on one thread per process.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "exact_values.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace train_scenario {

namespace train = gradapt::train;

inline constexpr double base_batch = 8.0;

/// One rank's model: parameters (the same on every rank at the start) and gradients, with a
/// param_list over them. Gradients are a shared "signal" plus per-rank noise, times the loss
/// scale, stored in G.
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
      params.add("t" + std::to_string(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]),
                 {.skip_weight_decay = sizes[t] == 1});
  }
  replica(const replica&) = delete;
  replica& operator=(const replica&) = delete;

  void fill(int rank, std::uint64_t step, double loss_scale, bool inject_inf = false) {
    std::mt19937_64 shared(1000 + step), own(7 * step + 131 * static_cast<std::uint64_t>(rank) + 3);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (auto& t : g)
      for (auto& x : t) {
        const double v = (0.4 * u(shared) + 0.6 * u(own)) * loss_scale;
        x = G(static_cast<float>(v));
      }
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

using exact::identical_on_every_rank;
using exact::same_bits;

/// The knobs a run turns, applied by the hook in the composed run and by the loop in the
/// by-hand run: lr(τ) = lr0 / (1 + 0.05 τ); the local batch doubles before `grow_at`.
struct plan {
  int steps = 6;
  double lr0 = 0.05;
  int inf_at = -1;   ///< 1-based step at which the last rank's gradient holds an inf
  int grow_at = -1;  ///< 1-based step before which the local batch doubles
  double lr(double progress) const { return lr0 / (1.0 + 0.05 * progress); }
};

/// A hook that drives the plan and records what it saw.
struct plan_hook {
  plan pl;
  std::vector<std::string> events;
  std::vector<train::step_metrics> after;
  std::vector<train::rescale_event> rescales;
  void before_step(train::step_settings& s, const train::step_metrics& last) {
    events.push_back("before " + std::to_string(last.step + 1));
    s.lr = pl.lr(last.progress);
    if (static_cast<int>(last.step) + 1 == pl.grow_at) s.local_batch *= 2.0;
  }
  void on_rescale(train::step_settings&, const train::rescale_event& e) {
    events.push_back("rescale " + std::to_string(e.step));
    rescales.push_back(e);
  }
  void on_overflow(train::step_settings&, const train::step_metrics& m) {
    events.push_back("overflow " + std::to_string(m.step));
  }
  void after_step(train::step_settings&, const train::step_metrics& m) {
    events.push_back("after " + std::to_string(m.step));
    after.push_back(m);
  }
};

/// What one rank ends a run with.
struct rank_result {
  std::vector<float> params;
  std::vector<train::step_metrics> metrics;
  std::vector<std::string> events;
};

inline auto make_opt_lamb() { return gradapt::lamb({.lr = 0.01, .weight_decay = 0.01}); }
inline auto make_opt_sgd() { return gradapt::sgd({.lr = 0.1}); }
inline auto make_opt_sgd_momentum() { return gradapt::sgd({.lr = 0.1, .momentum = 0.9}); }
inline auto make_opt_adamw() { return gradapt::adamw({.lr = 0.01}); }
inline auto make_opt_lars() { return gradapt::lars({.lr = 0.1, .weight_decay = 1e-3}); }

/// The stages run_by_hand calls: each matches a policy of the composed step.
struct stages {
  bool scaling = false;  ///< loss_scaler({.init_scale = 1024, .growth_interval = 3})
  bool adasum = false;   ///< adasum_combine instead of the allreduce-mean
  bool adapt = false;    ///< adascale_policy with noise smoothing 0.5
  bool local = false;    ///< local_sgd_policy{{.start_step = 2}, fixed_period({.period = 2})}
};

/// The composed step on this rank: the plan's steps, with `policies` and the plan's hook.
template <class G, class Comm, class Opt, class... P>
rank_result run_composed(Comm& comm, const plan& pl, Opt (*make_opt)(), P... policies) {
  const int r = comm.rank(), n = comm.size();
  replica<G> rep;
  gradapt::host backend{.threads = 1};
  plan_hook hook{pl, {}, {}, {}};
  auto step =
      train::make_data_parallel_step(comm, backend, rep.params, make_opt(),
                                     {.lr = pl.lr0, .local_batch = base_batch}, policies..., std::ref(hook));
  for (int t = 1; t <= pl.steps; ++t) {
    rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == pl.inf_at && r == n - 1);
    step.step({.loss = 1.0 / t});
  }
  return {rep.flat(), hook.after, hook.events};
}

/// The same stages called one by one on this rank, with the plan applied by the loop.
template <class G, class Comm, class Opt>
rank_result run_by_hand(Comm& comm, const plan& pl, Opt (*make_opt)(), stages with) {
  const int r = comm.rank(), n = comm.size();
  replica<G> rep;
  gradapt::host backend{.threads = 1};
  const Opt opt = make_opt();
  auto state = opt.init(backend, rep.params);
  gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 3});
  std::optional<gradapt::adasum<Comm>> ada_comb;
  std::optional<gradapt::adasum_workspace<G>> ws;
  if (with.adasum) {
    ada_comb.emplace(comm);
    ws.emplace(rep.params.grads());
  }
  double local_batch = base_batch;
  gradapt::gradient_noise_scale gns({.smoothing = 0.5});
  gradapt::adascale ada({.scale = n * local_batch / base_batch});
  gradapt::local_sgd<Comm, gradapt::fixed_period> lsgd(comm, {.start_step = 2},
                                                       gradapt::fixed_period({.period = 2}));
  train::step_metrics last;
  rank_result res;
  // The counters of a taken or skipped step, then the step is recorded.
  const auto finish = [&](train::step_metrics& m) {
    m.optimizer_steps = state.steps();
    m.progress = with.adapt ? ada.progress() : static_cast<double>(state.steps());
    m.noise_scale = with.adapt ? gns.b_simple().value_or(std::numeric_limits<double>::quiet_NaN())
                               : std::numeric_limits<double>::quiet_NaN();
    res.metrics.push_back(m);
    last = m;
  };
  for (int t = 1; t <= pl.steps; ++t) {
    train::step_metrics m;
    m.step = static_cast<std::uint64_t>(t);
    // The ranks' mean loss, summed in rank order as the step sums it.
    double loss_sum = 0.0;
    for (int r = 0; r < n; ++r) loss_sum += 1.0 / t;
    m.loss = loss_sum / n;
    const double lr0 = pl.lr(last.progress);
    if (t == pl.grow_at) local_batch *= 2.0;
    if (with.adapt) {
      const double s = n * local_batch / base_batch;
      if (s != ada.scale()) ada.set_scale(s);
      m.scale = ada.scale();
    }
    rep.fill(r, static_cast<std::uint64_t>(t), with.scaling ? scaler.scale() : 1.0,
             t == pl.inf_at && r == n - 1);
    if (with.scaling) {
      const bool ok = scaler.unscale(backend, comm, rep.params);
      m.loss_scale = scaler.scale();
      if (!ok) {
        m.found_inf = true;
        finish(m);
        continue;
      }
    }
    const bool sync = !with.local || lsgd.sync_gradients();
    m.synchronous = sync;
    if (sync) {
      if (with.adasum) {
        ada_comb->allreduce(backend, rep.params.grads(), *ws);
      } else if (n > 1) {
        gradapt::allreduce_norms norms{0.0, 0.0};
        for (const auto& g : rep.params.grads()) {
          if (with.adapt) {
            const auto x = gradapt::allreduce_with_norms(comm, backend, g);
            norms.sum_local_sq += x.sum_local_sq;
            norms.result_sq += x.result_sq;
          } else {
            comm.allreduce(g, gradapt::reduce_op::sum);
          }
        }
        const float inv_n = static_cast<float>(n);
        backend.apply_list([inv_n](float& g) { g = g / inv_n; }, rep.params.grads());
        if (with.adapt) gns.update(norms, n, gradapt::noise_batch{.micro_batch = local_batch});
      }
    }
    double gain = 1.0, lr = lr0;
    if (with.adapt) {
      gain = sync ? ada.advance(gns, base_batch) : ada.advance(0.0, 0.0);
      lr = lr0 * gain;
    }
    opt.step(backend, rep.params, state, {.lr = lr});
    if (with.local) m.averaged = lsgd.step(comm, backend, rep.params.values()).averaged;
    m.stepped = true;
    m.gain = gain;
    m.lr = lr;
    finish(m);
  }
  res.params = rep.flat();
  return res;
}

/// Two steps' metrics agree bit for bit.
inline void require_same_metrics(const train::step_metrics& a, const train::step_metrics& b) {
  INFO("step " << a.step);
  REQUIRE(a.step == b.step);
  REQUIRE(a.optimizer_steps == b.optimizer_steps);
  REQUIRE(same_bits(a.loss, b.loss));
  REQUIRE(same_bits(a.loss_scale, b.loss_scale));
  REQUIRE(
      ((std::isnan(a.noise_scale) && std::isnan(b.noise_scale)) || same_bits(a.noise_scale, b.noise_scale)));
  REQUIRE(same_bits(a.gain, b.gain));
  REQUIRE(same_bits(a.lr, b.lr));
  REQUIRE(same_bits(a.progress, b.progress));
  REQUIRE(same_bits(a.scale, b.scale));
  REQUIRE(a.found_inf == b.found_inf);
  REQUIRE(a.stepped == b.stepped);
  REQUIRE(a.synchronous == b.synchronous);
  REQUIRE(a.averaged == b.averaged);
}

/// One rank's two runs agree bit for bit in the parameters and every step's metrics.
inline void require_same(const rank_result& a, const rank_result& b) {
  REQUIRE(same_bits(a.params, b.params));
  REQUIRE(a.metrics.size() == b.metrics.size());
  for (std::size_t k = 0; k < a.metrics.size(); ++k) require_same_metrics(a.metrics[k], b.metrics[k]);
}

/// The checkpoint scenario's hook: an lr schedule, another LocalSGD period from step 5 and a
/// doubled local batch from step 6.
struct checkpoint_hook {
  void before_step(train::step_settings& s, const train::step_metrics& last) {
    s.lr = 0.01 / (1.0 + 0.1 * last.progress);
    if (last.step == 4) s.period = 3;
    if (last.step == 5) s.local_batch = 2.0 * base_batch;
  }
};

/// The checkpoint scenario's step: LAMB, fp16 loss scaling, AdaScale and LocalSGD.
template <class Comm>
auto make_checkpoint_step(Comm& comm, replica<gradapt::half>& rep) {
  return train::make_data_parallel_step(
      comm, gradapt::host{}, rep.params, make_opt_lamb(), {.lr = 0.01, .local_batch = base_batch},
      gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 2}),
      train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.7}},
      train::local_sgd_policy{{.start_step = 3}, gradapt::fixed_period({.period = 2})}, checkpoint_hook{});
}

/// Total steps of the checkpoint scenario; rank 0's gradient overflows at step 3.
inline constexpr int checkpoint_total = 10;

/// What a checkpoint run ends with on one rank.
struct checkpoint_run {
  std::vector<std::byte> checkpoint;  ///< step.save() after step `cut` (straight run only)
  std::vector<float> checkpoint_params;
  std::vector<float> params;  ///< after the last step
  train::step_metrics metrics;
  bool reloaded_same_bytes = true;  ///< resumed run: save() right after load() gave the same bytes
  std::uint64_t steps_after_load = 0;
};

/// The straight run: checkpoint_total steps, saving after step `cut`.
template <class Comm>
checkpoint_run checkpoint_straight(Comm& comm, int cut) {
  const int r = comm.rank();
  checkpoint_run out;
  replica<gradapt::half> rep;
  auto step = make_checkpoint_step(comm, rep);
  for (int t = 1; t <= checkpoint_total; ++t) {
    rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == 3 && r == 0);
    step.step({.loss = 1.0});
    if (t == cut) {
      out.checkpoint = step.save();
      out.checkpoint_params = rep.flat();
    }
  }
  out.params = rep.flat();
  out.metrics = step.metrics();
  return out;
}

/// A fresh step that loads the straight run's checkpoint and runs the remaining steps.
template <class Comm>
checkpoint_run checkpoint_resumed(Comm& comm, const checkpoint_run& straight, int cut) {
  const int r = comm.rank();
  checkpoint_run out;
  replica<gradapt::half> rep;
  auto step = make_checkpoint_step(comm, rep);
  rep.set(straight.checkpoint_params);
  step.load(straight.checkpoint);
  out.steps_after_load = step.steps();
  out.reloaded_same_bytes = step.save() == straight.checkpoint;
  for (int t = cut + 1; t <= checkpoint_total; ++t) {
    rep.fill(r, static_cast<std::uint64_t>(t), step.loss_scale(), t == 3 && r == 0);
    step.step({.loss = 1.0});
  }
  out.params = rep.flat();
  out.metrics = step.metrics();
  return out;
}

/// The resumed run continued the straight one bit for bit.
inline void require_resumed_equal(const checkpoint_run& straight, const checkpoint_run& resumed, int cut) {
  REQUIRE(resumed.steps_after_load == static_cast<std::uint64_t>(cut));
  REQUIRE(resumed.reloaded_same_bytes);
  REQUIRE(same_bits(straight.params, resumed.params));
  require_same_metrics(straight.metrics, resumed.metrics);
  REQUIRE(straight.metrics.step == checkpoint_total);
}

}  // namespace train_scenario

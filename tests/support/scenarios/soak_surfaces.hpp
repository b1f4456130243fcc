#pragma once
// The randomized soak of one disagreeing rank over the newer surfaces, written once over the
// communicator: tests/test_soak_surfaces.cpp runs it on comm::threads (fresh worlds of 2 to 4
// ranks per case), tests/mpi/test_mpi_soak_surfaces.cpp on MPI_COMM_WORLD. See the first file
// for what a case is and when it passes. Needs LAPACK (K-FAC, Shampoo).
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "checkpoint_model.hpp"
#include "gradapt/elastic/policy.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace soak_surfaces_scenario {

namespace train = gradapt::train;

namespace train = gradapt::train;

enum class surface : int { replicated, zero1, zero2, buckets, hierarchical, shampoo, kfac, job };
constexpr int surfaces = 8;
/// Perturbations per surface (0 is none).
constexpr int perturbations(surface s) {
  switch (s) {
    case surface::zero2:
    case surface::buckets:
      return 7;
    case surface::shampoo:
      return 4;
    case surface::kfac:
      return 3;
    case surface::job:
      return 2;
    default:
      return 6;
  }
}

struct plan {
  surface s = surface::replicated;
  int culprit = 0;
  int perturb = 0;  ///< 0: every rank does the same
  bool adamw = false;
};

/// FNV-1a of the bytes of `v`.
inline std::uint64_t hash_floats(const std::vector<float>& v) {
  std::uint64_t h = 14695981039346656037ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

inline std::vector<float> flat(const gradapt_test::model& m) {
  std::vector<float> out(m.w1);
  out.insert(out.end(), m.w2.begin(), m.w2.end());
  out.insert(out.end(), m.w3.begin(), m.w3.end());
  return out;
}

/// The same three tensors as gradapt_test::model, the first as [4, 6] instead of [6, 4].
struct transposed : gradapt_test::model {
  gradapt::param_list<float> other;
  transposed() {
    other.add("dense.weight", gradapt::host_view(w1, {4, 6}), gradapt::host_view(g1, {4, 6}));
    other.add("dense.bias", gradapt::host_view(w2, {5}), gradapt::host_view(g2, {5}));
    other.add("conv.weight", gradapt::host_view(w3, {2, 3, 2}), gradapt::host_view(g3, {2, 3, 2}));
  }
};

/// Three steps of the composed step with the given state and reduce slots.
template <class Comm, class StateP, class ReduceP>
std::vector<float> run_step(Comm& comm, const plan& p, StateP state, ReduceP reduce) {
  const bool me = comm.rank() == p.culprit;
  transposed m;
  const auto& params = (p.perturb == 5 && me) ? m.other : m.params;
  const double lr0 = (p.perturb == 1 && me) ? 0.2 : 0.1;
  const auto body = [&](auto& step) {
    for (int t = 1; t <= 3; ++t) {
      m.grads(t + comm.rank());
      double lr = 0.05;
      if (t == 2 && me && p.perturb == 3) lr = 0.07;
      if (t == 2 && me && p.perturb == 6) lr = std::numeric_limits<double>::quiet_NaN();
      if constexpr (std::remove_reference_t<decltype(step)>::marks_gradients)
        for (std::size_t k = params.size(); k-- > 0;)
          if (!(t == 2 && me && p.perturb == 7 && k == 1)) step.mark_ready(k);
      step.step({.lr = lr, .loss = 1.0});
    }
  };
  const auto with_opt = [&](auto opt) {
    if (p.perturb == 4 && me) {
      auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, params, opt,
                                                 {.lr = lr0, .local_batch = 4}, state, reduce,
                                                 train::adascale_policy{.base_batch = 4});
      body(step);
    } else {
      auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, params, opt,
                                                 {.lr = lr0, .local_batch = 4}, state, reduce);
      body(step);
    }
  };
  const bool other = p.perturb == 2 && me;
  if (p.adamw)
    with_opt(gradapt::adamw({.lr = 0.1, .b2 = other ? 0.99 : 0.999, .weight_decay = 0.01}));
  else
    with_opt(gradapt::sgd({.lr = 0.1, .momentum = other ? 0.5 : 0.9}));
  return flat(m);
}

template <class Comm>
std::vector<float> run_shampoo(Comm& comm, const plan& p) {
  const bool me = comm.rank() == p.culprit;
  gradapt::shampoo_options o;
  o.lr = 0.02;
  o.max_preconditioner_dim = 4;
  o.precondition_frequency = 1;
  o.start_preconditioning_step = 1;
  o.graft_epsilon = (p.perturb == 1 && me) ? 1e-8 : 1e-10;
  o.momentum = (p.perturb == 2 && me) ? 0.5 : 0.9;
  o.beta1 = (p.perturb == 3 && me) ? 0.8 : 0.0;
  const gradapt::shampoo opt(o);
  const gradapt::host backend{.threads = 1};
  gradapt_test::model m;
  auto st = opt.init(backend, m.params);
  for (int t = 1; t <= 3; ++t) {
    m.grads(t);  // the averaged gradients: the same on every rank
    opt.step(comm, backend, m.params, st, {.lr = (p.perturb == 4 && me && t == 2) ? 0.03 : 0.02});
  }
  return flat(m);
}

template <class Comm>
std::vector<float> run_kfac(Comm& comm, const plan& p) {
  const bool me = comm.rank() == p.culprit;
  const gradapt::kfac kf({.inv_update_steps = 2, .damping = (p.perturb == 2 && me) ? 0.01 : 0.003});
  const gradapt::host_lapack la{};
  const std::vector<gradapt::kfac_layer> layers{{"fc1", 4, 3, true}, {"fc2", 3, 2, false}};
  auto st = kf.init<float>(la, layers);
  std::vector<float> w1(12), b1(3), w2(6), a(20), g(15);
  std::vector<float> out;
  for (int t = 1; t <= 3; ++t) {
    for (std::size_t l = 0; l < layers.size(); ++l) {
      if (t == 2 && me && p.perturb == 3 && l == 1) continue;
      const auto in = layers[l].in, outs = layers[l].out;
      for (std::size_t i = 0; i < a.size(); ++i)
        a[i] = 0.1f * static_cast<float>((i * 7 + t + 3 * comm.rank() + l) % 11) - 0.5f;
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = 0.05f * static_cast<float>((i * 3 + t + comm.rank() + l) % 7) - 0.15f;
      kf.accumulate(st, l, gradapt::tensor_view<const float>(a.data(), {5, in}),
                    gradapt::tensor_view<const float>(g.data(), {5, outs}));
    }
    for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.01f * static_cast<float>((i + t) % 5);
    for (std::size_t i = 0; i < b1.size(); ++i) b1[i] = 0.02f * static_cast<float>(i + t);
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = -0.01f * static_cast<float>((i * 2 + t) % 3);
    const gradapt::kfac_grad<float> grads[] = {
        {gradapt::tensor_view<float>(w1.data(), {3, 4}), gradapt::tensor_view<float>(b1.data(), {3})},
        {gradapt::tensor_view<float>(w2.data(), {2, 3})}};
    kf.step(comm, st, std::span(grads), (p.perturb == 1 && me) ? 0.2 : 0.1);
    out.insert(out.end(), w1.begin(), w1.end());
    out.insert(out.end(), b1.begin(), b1.end());
    out.insert(out.end(), w2.begin(), w2.end());
  }
  return out;
}

struct propose {
  std::function<void(const gradapt::elastic::job_view&, gradapt::elastic::job_action&)> f;
  void after_step(const gradapt::elastic::job_view& v, gradapt::elastic::job_action& a) { f(v, a); }
};

template <class Comm>
std::vector<float> run_job(Comm& comm, const plan& p) {
  const bool me = comm.rank() == p.culprit;
  gradapt_test::model m;
  auto step = train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, m.params,
                                             gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
  gradapt::elastic::adaptive_job job(
      step, propose{[&](const gradapt::elastic::job_view& v, gradapt::elastic::job_action& a) {
        if (v.steps != 2) return;
        if (p.perturb == 0) a.lr = 0.05;
        if (p.perturb == 1 && me) a.lr = 0.05;
        if (p.perturb == 2) a.lr = me ? 0.07 : 0.05;
      }});
  for (int t = 1; t <= 3; ++t) {
    m.grads(t + comm.rank());
    job.step();
  }
  return flat(m);
}

template <class Comm>
std::vector<float> run_case(Comm& comm, const plan& p) {
  switch (p.s) {
    case surface::replicated:
      return run_step(comm, p, train::replicated_state{}, train::one_buffer_reduce{});
    case surface::zero1:
      return run_step(comm, p, train::zero_state<1>{.allow_empty_shards = true}, train::one_buffer_reduce{});
    case surface::zero2:
      return run_step(
          comm, p,
          train::zero_state<2>{.sharding = {.buckets = {.cap_bytes = 64}}, .allow_empty_shards = true},
          train::one_buffer_reduce{});
    case surface::buckets:
      return run_step(comm, p, train::replicated_state{}, train::bucket_reduce{.buckets = {.cap_bytes = 64}});
    case surface::hierarchical:
      return run_step(comm, p, train::replicated_state{}, train::hierarchical_reduce{});
    case surface::shampoo:
      return run_shampoo(comm, p);
    case surface::kfac:
      return run_kfac(comm, p);
    default:
      return run_job(comm, p);
  }
}

/// Case i of the soak with `seed` on a world of n ranks (n drawn by the caller when it makes the
/// world, given here when the world is fixed): the surface, the culprit, the optimizer and, in
/// about two cases of three, a perturbation.
inline plan draw(std::mt19937_64& rng, int n) {
  plan p;
  p.s = static_cast<surface>(rng() % surfaces);
  p.culprit = static_cast<int>(rng() % static_cast<unsigned>(n));
  p.adamw = rng() % 2;
  if (rng() % 3 != 0) p.perturb = 1 + static_cast<int>(rng() % static_cast<unsigned>(perturbations(p.s)));
  return p;
}

}  // namespace soak_surfaces_scenario

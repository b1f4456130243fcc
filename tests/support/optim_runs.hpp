#pragma once
// Runs of an optimizer over float tensors with seeded gradients, shared by the factored-optimizer
// tests (Adafactor, SM3, their chains): `run_steps` (any stepper: the library or a reference),
// `library_run_on` (gradapt on the host backend), `require_momentum_step` (a step moves the
// parameters by the state's momentum buffer), and `resumed_run`, a run saved after some steps
// and restored into a fresh state over a copy of its parameters, both then stepped with the
// same gradients.
//
// `Tensor` has `p` (parameters) and `size()`; its namespace provides `fill_grad(Tensor&,
// unsigned seed)` and `list_of(std::vector<Tensor>&)` (a gradapt::param_list<float>), found
// by argument-dependent lookup. Step s gives tensor k the gradients of seed `seed_step * s + k`.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/core/param_list.hpp"

namespace gradapt_test {

/// Sets step `s`'s gradients of every tensor in `ts`: fill_grad(ts[k], seed_step * s + k).
template <class Tensor>
void fill_step(std::vector<Tensor>& ts, unsigned seed_step, int s) {
  for (std::size_t k = 0; k < ts.size(); ++k)
    fill_grad(ts[k], seed_step * static_cast<unsigned>(s) + static_cast<unsigned>(k));
}

/// The parameters of all tensors of `ts`, one after the other.
template <class Tensor>
std::vector<float> all_params(const std::vector<Tensor>& ts) {
  std::vector<float> all;
  for (const auto& t : ts) all.insert(all.end(), t.p.begin(), t.p.end());
  return all;
}

/// Every run's parameters (all_params) have the bits of the first run's.
inline void require_same_bits(const std::vector<std::vector<float>>& runs) {
  for (std::size_t r = 1; r < runs.size(); ++r)
    for (std::size_t i = 0; i < runs[0].size(); ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(runs[r][i]) == std::bit_cast<std::uint32_t>(runs[0][i]));
}

/// Zero gradients: one step of `opt` (list `pl` over `ts`, state `st`) leaves the parameters
/// as they were. Then sets the parameters to zero, for the caller's next steps.
template <class Opt, class Backend, class Tensor, class List, class State>
void require_zero_grads_keep_params(const Opt& opt, const Backend& b, std::vector<Tensor>& ts, List& pl,
                                    State& st) {
  for (auto& t : ts) std::fill(t.g.begin(), t.g.end(), 0.0f);
  const auto before = ts;
  opt.step(b, pl, st);
  for (std::size_t k = 0; k < ts.size(); ++k) REQUIRE(ts[k].p == before[k].p);
  for (auto& t : ts) std::fill(t.p.begin(), t.p.end(), 0.0f);
}

/// Steps 1 to `steps` of `step(ts)`, each after fill_step(ts, seed_step, s).
template <class Tensor, class Step>
void run_steps(std::vector<Tensor>& ts, unsigned seed_step, int steps, Step&& step) {
  for (int s = 1; s <= steps; ++s) {
    fill_step(ts, seed_step, s);
    step(ts);
  }
}

/// `ts` after `steps` steps of `opt` on a host backend of `threads` threads (the gradients of
/// run_steps); REQUIREs that the state counts the steps.
template <class Opt, class Tensor>
std::vector<Tensor> library_run_on(const Opt& opt, std::vector<Tensor> ts, unsigned seed_step, int steps,
                                   int threads) {
  gradapt::host b{.threads = threads};
  auto pl = list_of(ts);
  auto st = opt.init(b, pl);
  run_steps(ts, seed_step, steps, [&](std::vector<Tensor>&) { opt.step(b, pl, st); });
  REQUIRE(st.steps() == static_cast<std::uint64_t>(steps));
  return ts;
}

/// Sets tensor t's gradients by fill_grad(ts[t], seed + t) and runs `step()`; then for every
/// tensor the momentum buffer `momentum(t)` (a view) has its size, moved the parameters by
/// `lr` times itself (within 2 float eps of the larger magnitude) and is non-zero for more than
/// half of the elements.
template <class Tensor, class Step, class Momentum>
void require_momentum_step(std::vector<Tensor>& ts, unsigned seed, float lr, Step&& step,
                           Momentum&& momentum) {
  std::vector<std::vector<float>> before;
  for (std::size_t t = 0; t < ts.size(); ++t) {
    fill_grad(ts[t], seed + static_cast<unsigned>(t));
    before.push_back(ts[t].p);
  }
  step();
  for (std::size_t t = 0; t < ts.size(); ++t) {
    const auto m = momentum(t);
    REQUIRE(m.size() == ts[t].size());
    std::size_t moved = 0;
    for (std::size_t k = 0; k < m.size(); ++k) {
      const float d = before[t][k] - ts[t].p[k];
      const float mag = std::max(std::fabs(before[t][k]), std::fabs(ts[t].p[k]));
      REQUIRE(std::fabs(lr * m.data()[k] - d) <= 2 * std::numeric_limits<float>::epsilon() * mag);
      moved += m.data()[k] != 0.0f ? 1 : 0;
    }
    REQUIRE(moved > m.size() / 2);
  }
}

/// `a`, `pa`, `sa`: tensors, list and state of the original run, stepped through `saved`
/// steps and then saved into `bytes`; `c`, `pc`, `sc`: a copy of the tensors and a fresh state
/// loaded from `bytes`. The constructor REQUIREs that the restored state counts `saved` steps.
template <class Opt, class Backend, class Tensor>
struct resumed_run {
  using list_t = gradapt::param_list<float>;
  using state_t =
      decltype(std::declval<const Opt&>().init(std::declval<const Backend&>(), std::declval<list_t&>()));

  const Opt& opt;
  const Backend& b;
  unsigned seed_step;
  std::vector<Tensor> a;
  list_t pa;
  state_t sa;
  int steps = 0;
  std::vector<std::byte> bytes;
  std::vector<Tensor> c;
  list_t pc;
  state_t sc;

  resumed_run(const Opt& o, const Backend& backend, std::vector<Tensor> tensors, unsigned seed, int saved)
      : opt(o),
        b(backend),
        seed_step(seed),
        a(std::move(tensors)),
        pa(list_of(a)),
        sa(opt.init(b, pa)),
        bytes(step_and_save(saved)),
        c(a),
        pc(list_of(c)),
        sc(opt.init(b, pc)) {
    sc.load(b, bytes);
    REQUIRE(sc.steps() == static_cast<std::uint64_t>(saved));
  }
  resumed_run(const resumed_run&) = delete;
  resumed_run& operator=(const resumed_run&) = delete;

  /// Steps both runs through step `last` with the same gradients; `step_original(step)` runs
  /// the original's step (`step()`), a place for checks around it.
  template <class StepOriginal>
  void continue_to(int last, StepOriginal&& step_original) {
    for (++steps; steps <= last; ++steps) {
      fill_step(a, seed_step, steps);
      fill_step(c, seed_step, steps);
      step_original([&] { opt.step(b, pa, sa); });
      opt.step(b, pc, sc);
    }
    --steps;
  }
  void continue_to(int last) {
    continue_to(last, [](auto&& step) { step(); });
  }

  /// The two runs' parameters are the same bits.
  void require_same_params() const {
    for (std::size_t k = 0; k < a.size(); ++k)
      for (std::size_t i = 0; i < a[k].size(); ++i)
        REQUIRE(std::bit_cast<std::uint32_t>(a[k].p[i]) == std::bit_cast<std::uint32_t>(c[k].p[i]));
  }

 private:
  std::vector<std::byte> step_and_save(int saved) {
    run_steps(a, seed_step, saved, [&](std::vector<Tensor>&) { opt.step(b, pa, sa); });
    steps = saved;
    return sa.save(b);
  }
};

}  // namespace gradapt_test

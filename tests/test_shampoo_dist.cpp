// gradapt::shampoo's roots distributed over ranks (comm::threads) and computed in a background
// thread (root_staleness), on the host backend with host_lapack.
//
// The reference for every distributed run is the one-rank step on the same gradients: the
// roots are a function of the statistics alone, so where they are computed must not change a
// bit. The reference for the asynchronous roots is their definition: the roots installed at
// step t + s are inverse_pth_root of the statistics as they stood after step t (captured here
// through the state's accessors), and the steps in between use the previous ones.
//  1. distributed, 1..5 ranks: the same bits as one rank; each block computed once, on the
//     rank lpt_assign gives it; the most loaded rank's cost within the LPT bound;
//  2. asynchronous, deterministic: installs exactly at t + s, from step t's statistics; the
//     bits do not depend on how fast the worker is;
//  3. asynchronous, install when ready: every step uses the old or the new roots, the new ones
//     by t + s at the latest;
//  4. a checkpoint with roots in flight continues bit for bit (also on another world size);
//     a state that would not install them rejects it;
//  5. distributed and asynchronous together, and a world that shrinks and grows: the bits of
//     the one-rank asynchronous run; the same with Distributed Shampoo's options (beta1, bias
//     correction, 1-D blocks, merging from the last dimension, shifted spectrum, exponent map);
//  6. ranks that disagree (gradients, options, non-deterministic roots) throw on every rank;
//     a block whose roots keep failing throws on every rank naming the computing rank; each
//     option that shapes the result, and the step's learning rate, is agreed (one rank's
//     difference throws on every rank naming the option and both values).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "rank_check.hpp"

namespace gradapt_test_shampoo_dist {

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::host_lapack;
using gradapt::shampoo;
using gradapt::shampoo_graft;
using gradapt::shampoo_options;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;

namespace {

const host backend{.threads = 1};
const host_lapack la{};
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};

// A small model whose blocks have different sizes (so the assignment has something to
// balance): a matrix cut into 4 blocks, a conv kernel merged to 6 × 12 and cut into 2, a
// bias (diagonal), a second matrix.
struct model {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> params;
  model() {
    const std::vector<std::vector<std::int64_t>> shapes = {{12, 10}, {6, 3, 2, 2}, {10}, {5, 12}};
    const char* names[] = {"w1", "conv", "bias", "w2"};
    p.resize(shapes.size());
    g.resize(shapes.size());
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::size_t n = 1;
      for (auto d : shapes[t]) n *= static_cast<std::size_t>(d);
      p[t].assign(n, 0.5f);
      g[t].assign(n, 0.0f);
      params.add(names[t], tensor_view<float>(p[t].data(), shapes[t]),
                 tensor_view<float>(g[t].data(), shapes[t]));
    }
  }
  // The averaged gradient of step s (the same on every rank, as after an allreduce).
  void grads(int s, unsigned salt = 0) {
    for (std::size_t t = 0; t < g.size(); ++t) {
      std::mt19937 rng(1000u * static_cast<unsigned>(s) + 17u * static_cast<unsigned>(t) + salt);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (auto& x : g[t]) x = d(rng);
    }
  }
  std::vector<float> flat() const {
    std::vector<float> v;
    for (const auto& x : p) v.insert(v.end(), x.begin(), x.end());
    return v;
  }
};

shampoo_options base_options() {
  shampoo_options o;
  o.lr = 0.01;
  o.max_preconditioner_dim = 8;
  o.graft = shampoo_graft::adam;
  o.momentum = 0.9;
  o.precondition_frequency = 2;
  o.start_preconditioning_step = 2;
  return o;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Parameters after `steps` one-rank steps.
std::vector<float> one_rank(const shampoo_options& o, int steps, std::uint64_t* computations = nullptr) {
  model m;
  const shampoo opt(o);
  auto st = opt.init(backend, m.params);
  for (int s = 0; s < steps; ++s) {
    m.grads(s);
    opt.step(backend, m.params, st);
  }
  if (computations) *computations = st.preconditioner().root_computations();
  return m.flat();
}

template <class St>
std::vector<std::vector<float>> all_roots(const St& st) {
  std::vector<std::vector<float>> r;
  for (std::size_t t = 0; t < st.tensors(); ++t)
    for (std::size_t j = 0; j < st.preconditioner().layout(t).blocks.size(); ++j)
      for (std::size_t d = 0; d < st.preconditioner().block(t, j).factors; ++d) {
        const auto v = st.preconditioner().root(t, j, d);
        r.emplace_back(v.begin(), v.end());
      }
  return r;
}

// inverse_pth_root of every block's current statistics, with the optimizer's root options.
template <class St>
std::vector<std::vector<float>> roots_of_statistics(const St& st, const shampoo_options& o) {
  std::vector<std::vector<float>> r;
  for (std::size_t t = 0; t < st.tensors(); ++t)
    for (std::size_t j = 0; j < st.preconditioner().layout(t).blocks.size(); ++j) {
      const auto info = st.preconditioner().block(t, j);
      for (std::size_t d = 0; d < info.factors; ++d) {
        const auto s = st.preconditioner().statistic(t, j, d);
        const auto n = static_cast<std::int64_t>(info.range.size[d]);
        std::vector<float> out(s.size());
        gradapt::inverse_root_workspace<host_lapack, float> ws(la, n);
        const auto res =
            gradapt::inverse_pth_root(la, tensor_view<const float>(s.data(), {n, n}), info.exponent,
                                      tensor_view<float>(out.data(), {n, n}), ws, o.root);
        REQUIRE(res.ok());
        r.push_back(std::move(out));
      }
    }
  return r;
}

}  // namespace

// ---- 1. distributed roots ------------------------------------------------------------------

TEST_CASE("shampoo distributed: 1..5 ranks give one rank's bits, each block computed once",
          "[shampoo][dist]") {
  const auto o = base_options();
  const int steps = 9;
  std::uint64_t local_computations = 0;
  const auto want = one_rank(o, steps, &local_computations);
  REQUIRE(local_computations > 0);
  for (int n = 1; n <= 5; ++n) {
    std::vector<std::uint64_t> computed(static_cast<std::size_t>(n)), cost(static_cast<std::size_t>(n));
    std::uint64_t total = 0, largest = 0;
    std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
    run_threads(n, quick, [&](threads& c) {
      model m;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      for (int s = 0; s < steps; ++s) {
        m.grads(s);
        opt.step(c, backend, m.params, st);
      }
      const auto r = static_cast<std::size_t>(c.rank());
      got[r] = m.flat();
      computed[r] = st.preconditioner().root_computations();
      if (c.rank() == 0) {
        for (std::size_t t = 0; t < st.tensors(); ++t)
          for (std::size_t j = 0; j < st.preconditioner().layout(t).blocks.size(); ++j) {
            const auto info = st.preconditioner().block(t, j);
            std::uint64_t k = 0;
            for (std::size_t d = 0; d < info.factors; ++d) {
              const auto e = static_cast<std::uint64_t>(info.range.size[d]);
              k += e * e * e;
            }
            cost[static_cast<std::size_t>(st.preconditioner().root_owner(t, j))] += k;
            total += k;
            largest = std::max(largest, k);
          }
      }
    });
    INFO(n << " ranks");
    for (int r = 0; r < n; ++r) CHECK(same_bits(got[static_cast<std::size_t>(r)], want));
    std::uint64_t sum = 0;
    for (auto x : computed) sum += x;
    CHECK(sum == local_computations);  // each block's roots computed by exactly one rank
    // The LPT bound: the most loaded rank is within one block of the average.
    CHECK(*std::max_element(cost.begin(), cost.end()) * static_cast<std::uint64_t>(n) <=
          total + static_cast<std::uint64_t>(n) * largest);
    if (n > 1) CHECK(*std::max_element(computed.begin(), computed.end()) < local_computations);
  }
}

TEST_CASE("lpt_assign: deterministic, within one item of the average, checked input", "[shampoo][dist]") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const int ranks = 1 + trial % 7;
    std::vector<std::uint64_t> cost(static_cast<std::size_t>(trial % 13));
    for (auto& x : cost) x = rng() % 1000;
    std::vector<std::uint64_t> load(static_cast<std::size_t>(ranks));
    const auto owner = gradapt::lpt_assign(std::span<const std::uint64_t>(cost), ranks, std::span(load));
    CHECK(owner == gradapt::lpt_assign(std::span<const std::uint64_t>(cost), ranks));
    std::vector<std::uint64_t> mine(static_cast<std::size_t>(ranks), 0);
    for (std::size_t i = 0; i < cost.size(); ++i) {
      REQUIRE(owner[i] >= 0);
      REQUIRE(owner[i] < ranks);
      mine[static_cast<std::size_t>(owner[i])] += cost[i];
    }
    CHECK(mine == load);
    const auto mx = *std::max_element(load.begin(), load.end()),
               mn = *std::min_element(load.begin(), load.end());
    const auto big = cost.empty() ? 0 : *std::max_element(cost.begin(), cost.end());
    CHECK(mx <= mn + big);
  }
  std::vector<std::uint64_t> c{1, 2}, wrong(3);
  CHECK_THROWS_WITH(gradapt::lpt_assign(std::span<const std::uint64_t>(c), 0), Contains("ranks is 0"));
  CHECK_THROWS_WITH(gradapt::lpt_assign(std::span<const std::uint64_t>(c), 2, std::span(wrong)),
                    Contains("3 entries for 2 ranks"));
}

// ---- 2. asynchronous roots, deterministic ------------------------------------------------------

TEST_CASE("shampoo async: roots from step t's statistics installed at exactly t + s", "[shampoo][async]") {
  for (const std::uint64_t s : {1u, 2u}) {
    auto o = base_options();
    o.precondition_frequency = 2;
    o.root_staleness = s;
    INFO("root_staleness " << s);
    const shampoo opt(o);
    model m;
    auto st = opt.init(backend, m.params);
    std::vector<std::vector<float>> expected_next, current = all_roots(st);
    std::uint64_t started = 0;
    for (int k = 0; k < 9; ++k) {
      m.grads(k);
      opt.step(backend, m.params, st);
      const std::uint64_t t = st.steps();
      if (started != 0 && t == started + s) {
        CHECK(all_roots(st) == expected_next);  // installed now, from step `started`'s statistics
        current = expected_next;
        started = 0;
      } else {
        CHECK(all_roots(st) == current);  // in between: the previous roots
      }
      if (st.preconditioner().roots_in_flight() ==
          t) {  // roots due at t: started from the statistics as they are now
        CHECK((t >= o.start_preconditioning_step && (t - o.start_preconditioning_step) % 2 == 0));
        expected_next = roots_of_statistics(st, o);
        started = t;
      }
    }
    std::uint64_t blocks = 0;
    for (std::size_t t = 0; t < st.tensors(); ++t) blocks += st.preconditioner().layout(t).blocks.size();
    CHECK(st.preconditioner().root_computations() ==
          4 * blocks);  // steps 2, 4, 6, 8 start roots; 8's are in flight
  }
}

TEST_CASE("shampoo async: the bits do not depend on the worker's speed; staleness changes them",
          "[shampoo][async]") {
  auto o = base_options();
  o.root_staleness = 2;
  const auto run = [&](int pause_ms) {
    model m;
    const shampoo opt(o);
    auto st = opt.init(backend, m.params);
    for (int s = 0; s < 10; ++s) {
      m.grads(s);
      opt.step(backend, m.params, st);
      if (pause_ms) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    }
    return m.flat();
  };
  const auto fast = run(0), slow = run(3);
  CHECK(same_bits(fast, slow));
  CHECK_FALSE(same_bits(fast, one_rank(base_options(), 10)));  // the stale roots are used
}

// ---- 3. asynchronous roots, installed when ready ---------------------------------------------

TEST_CASE("shampoo async: install-when-ready uses the old or the new roots, the new ones by t + s",
          "[shampoo][async]") {
  auto o = base_options();
  o.precondition_frequency = 3;
  o.root_staleness = 3;
  o.deterministic_roots = false;
  const shampoo opt(o);
  model m;
  auto st = opt.init(backend, m.params);
  std::vector<std::vector<float>> next, current = all_roots(st);
  std::uint64_t started = 0;
  for (int k = 0; k < 12; ++k) {
    m.grads(k);
    if (k % 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // vary the timing
    opt.step(backend, m.params, st);
    const std::uint64_t t = st.steps();
    const auto now = all_roots(st);
    if (started != 0) {
      const bool is_new = now == next;
      CHECK((is_new || now == current));
      if (t == started + 3) CHECK(is_new);
      if (is_new) {
        current = next;
        started = 0;
      }
    } else {
      CHECK(now == current);
    }
    if (st.preconditioner().roots_in_flight() == t) {
      next = roots_of_statistics(st, o);
      started = t;
    }
  }
}

// ---- 4. checkpoints with roots in flight ---------------------------------------------------------

TEST_CASE("shampoo async: a checkpoint with roots in flight continues bit for bit", "[shampoo][async]") {
  auto o = base_options();
  o.root_staleness = 2;
  const shampoo opt(o);
  model m;
  auto st = opt.init(backend, m.params);
  for (int s = 0; s < 4; ++s) {
    m.grads(s);
    opt.step(backend, m.params, st);
  }
  REQUIRE(st.preconditioner().roots_in_flight() == 4);
  const auto bytes = st.save(backend);
  const auto saved = m.p;
  for (int s = 4; s < 9; ++s) {
    m.grads(s);
    opt.step(backend, m.params, st);
  }
  const auto want = m.flat();

  for (std::size_t t = 0; t < m.p.size(); ++t) std::copy(saved[t].begin(), saved[t].end(), m.p[t].begin());
  auto st2 = opt.init(backend, m.params);
  st2.load(backend, bytes);
  CHECK(st2.preconditioner().roots_in_flight() == 4);
  for (int s = 4; s < 9; ++s) {
    m.grads(s);
    opt.step(backend, m.params, st2);
  }
  CHECK(same_bits(m.flat(), want));

  // ... and on 3 ranks, each computing its own blocks of the roots in flight.
  std::vector<std::vector<float>> got(3);
  run_threads(3, quick, [&](threads& c) {
    model mr;
    for (std::size_t t = 0; t < mr.p.size(); ++t)
      std::copy(saved[t].begin(), saved[t].end(), mr.p[t].begin());
    auto sr = opt.init(backend, mr.params);
    sr.load(backend, bytes);
    for (int s = 4; s < 9; ++s) {
      mr.grads(s);
      opt.step(c, backend, mr.params, sr);
    }
    got[static_cast<std::size_t>(c.rank())] = mr.flat();
  });
  for (const auto& g : got) CHECK(same_bits(g, want));

  {  // a state that would never install them
    auto sync = shampoo(base_options()).init(backend, m.params);
    const auto before = sync.save(backend);
    CHECK_THROWS_WITH(sync.load(backend, bytes), Contains("roots in flight"));
    CHECK(sync.save(backend) == before);
    auto o1 = o;
    o1.root_staleness = 1;  // started at 4, installed at 5: the checkpoint is at step 4, fine
    auto one = shampoo(o1).init(backend, m.params);
    CHECK_NOTHROW(one.load(backend, bytes));
  }
  {  // loading over a state with its own roots in flight drops them and takes the archive's
    auto st3 = opt.init(backend, m.params);
    for (int s = 0; s < 2; ++s) {
      m.grads(50 + s);
      opt.step(backend, m.params, st3);
    }
    REQUIRE(st3.preconditioner().roots_in_flight() == 2);
    st3.load(backend, bytes);
    CHECK(st3.preconditioner().roots_in_flight() == 4);
    CHECK(st3.save(backend) == bytes);
  }
}

// ---- 5. distributed and asynchronous, over a changing world ----------------------------------

TEST_CASE("shampoo distributed + async: one rank's bits, also when the world shrinks and grows",
          "[shampoo][dist][async]") {
  auto o = base_options();
  o.root_staleness = 1;
  const auto want = one_rank(o, 12);
  // 4 ranks, then 2, then 3, for 4 steps each: each world continues the states, and each
  // change comes with roots in flight (started at steps 4 and 8, installed at 5 and 9).
  std::vector<model> models(4);
  const shampoo opt(o);
  std::vector<decltype(opt.init(backend, models[0].params))> states;
  for (auto& m : models) states.push_back(opt.init(backend, m.params));
  int step = 0;
  for (const int n : {4, 2, 3}) {
    const int count = 4;
    run_threads(n, quick, [&](threads& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      for (int s = step; s < step + count; ++s) {
        models[r].grads(s);
        opt.step(c, backend, models[r].params, states[r]);
      }
    });
    step += count;
    // Ranks that leave hand nothing on; the ones that stay continue (their states are equal).
    for (std::size_t r = static_cast<std::size_t>(n); r < models.size(); ++r) {
      const auto bytes = states[0].save(backend);
      for (std::size_t t = 0; t < models[r].p.size(); ++t) models[r].p[t] = models[0].p[t];
      states[r] = opt.init(backend, models[r].params);
      states[r].load(backend, bytes);
    }
  }
  for (int r = 0; r < 3; ++r) CHECK(same_bits(models[static_cast<std::size_t>(r)].flat(), want));
}

TEST_CASE("shampoo distributed + async: the peer's options give one rank's bits", "[shampoo][dist][async]") {
  // beta1 with bias correction, bias-corrected EMA statistics, 1-D blocks, merging from the
  // last dimension, the shifted spectrum and an exponent map: 3 ranks, with roots in the
  // step and in the worker (root_staleness 1), give the one-rank bits of the same options.
  auto o = base_options();
  o.beta1 = 0.9;
  o.bias_correction = true;
  o.beta2 = 0.9;
  o.precondition_1d = true;
  o.merge_from = gradapt::shampoo_merge::last;
  o.spectrum = gradapt::shampoo_spectrum::shift;
  o.root.ridge = gradapt::ridge_kind::absolute;
  o.root.epsilon = 1e-3;
  o.inverse_exponents = {{3, 0, 0}, {2, -1, 2}};
  for (const std::uint64_t staleness : {0u, 1u}) {
    o.root_staleness = staleness;
    const auto want = one_rank(o, 9);
    std::vector<std::vector<float>> got(3);
    run_threads(3, quick, [&](threads& c) {
      model m;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      for (int s = 0; s < 9; ++s) {
        m.grads(s);
        const auto r = opt.step(c, backend, m.params, st);
        RANK_CHECK(r.root_failures.empty());
      }
      got[static_cast<std::size_t>(c.rank())] = m.flat();
    });
    INFO("root_staleness " << staleness);
    for (const auto& g : got) CHECK(same_bits(g, want));
  }
}

// ---- 6. ranks that disagree ----------------------------------------------------------------------

TEST_CASE("shampoo distributed: disagreements and failures throw on every rank", "[shampoo][dist]") {
  const auto o = base_options();
  SECTION("one rank's gradients differ") {
    run_threads(3, quick, [&](threads& c) {
      model m;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      opt.step(c, backend, m.params, st);  // step 1: no roots due
      m.grads(1, c.rank() == 2 ? 7u : 0u);
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains("statistics of rank 2"));
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains("restore a checkpoint"));
    });
  }
  SECTION("one rank's input is invalid at a step that exchanges roots") {
    run_threads(3, quick, [&](threads& c) {
      model m;
      const shampoo opt(o);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      opt.step(c, backend, m.params, st);  // step 1: plan, no roots
      m.grads(1);
      const double lr = c.rank() == 1 ? std::numeric_limits<double>::quiet_NaN() : 0.01;
      RANK_REQUIRE_THROWS_WITH(
          opt.step(c, backend, m.params, st, {.lr = lr}),
          Contains(c.rank() == 1 ? "learning rate is nan" : "rank 1 passed invalid input"));
    });
  }
  SECTION("one rank's options differ") {
    run_threads(3, quick, [&](threads& c) {
      model m;
      auto mine = o;
      if (c.rank() == 1) mine.precondition_frequency = 3;
      const shampoo opt(mine);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains("precondition_frequency"));
    });
  }
  SECTION("one rank's model differs") {
    run_threads(2, quick, [&](threads& c) {
      auto mine = o;
      if (c.rank() == 1) mine.max_preconditioner_dim = 6;
      model m;
      const shampoo opt(mine);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains("across ranks"));
    });
  }
  SECTION("install-when-ready roots cannot be distributed") {
    auto od = o;
    od.root_staleness = 1;
    od.deterministic_roots = false;
    run_threads(2, quick, [&](threads& c) {
      model m;
      const shampoo opt(od);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains("deterministic_roots = true"));
    });
  }
  SECTION("a block whose roots keep failing names the rank that computed them") {
    auto of = o;
    of.max_consecutive_failures = 2;
    of.precondition_frequency = 1;
    run_threads(3, quick, [&](threads& c) {
      model m;
      const shampoo opt(of);
      auto st = opt.init(backend, m.params);
      st.set_check_interval(0);  // the chain's check would stop at w1's NaN parameters first
      m.grads(0);
      opt.step(c, backend, m.params, st);
      m.g[0][0] = std::numeric_limits<float>::quiet_NaN();  // w1's statistics become NaN for good
      auto report = gradapt::shampoo_step_report{};
      try {  // the first failure is counted and reported (the SGD chain may then refuse w1's NaN)
        report = opt.step(c, backend, m.params, st);
      } catch (const gradapt::error& e) {
        RANK_CHECK(std::string(e.what()).find("non-finite") != std::string::npos);
      }
      RANK_CHECK(st.preconditioner().block(0, 0).failures == 1);
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st),
                               Contains("parameter 'w1' block 0") && Contains("computed on rank"));
    });
  }
}

TEST_CASE("shampoo distributed: every option that shapes the result, and the step's lr, is agreed",
          "[shampoo][dist]") {
  // One rank (1 of 3) differs in one option: every rank throws naming it and both values.
  struct change {
    const char* name;
    std::function<void(shampoo_options&)> apply;
    const char* values;  // "ranges from lo to hi"
  };
  const std::vector<change> changes = {
      {"graft_epsilon", [](auto& o) { o.graft_epsilon = 1e-8; }, "1e-10 to 1e-08"},
      {"momentum", [](auto& o) { o.momentum = 0.5; }, "0.5 to 0.9"},
      {"graft", [](auto& o) { o.graft = shampoo_graft::rmsprop; }, "3 to 4"},
      {"graft_beta2", [](auto& o) { o.graft_beta2 = 0.5; }, "0.5 to 0.999"},
      {"weight_decay", [](auto& o) { o.weight_decay = 0.01; }, "0 to 0.01"},
      {"nesterov", [](auto& o) { o.nesterov = true; }, "0 to 1"},
      {"lr", [](auto& o) { o.lr = 0.02; }, "0.01 to 0.02"},
      {"beta1", [](auto& o) { o.beta1 = 0.9; }, "0 to 0.9"},
      {"bias_correction", [](auto& o) { o.bias_correction = true; }, "0 to 1"},
      {"beta2", [](auto& o) { o.beta2 = 0.5; }, "0.5 to 1"},
      {"spectrum", [](auto& o) { o.spectrum = gradapt::shampoo_spectrum::shift; }, "0 to 1"},
      {"inverse_exponents (hash)",
       [](auto& o) {
         o.inverse_exponents = {{2, -1, 2}};
       },
       " to "},
      {"root.ridge", [](auto& o) { o.root.ridge = gradapt::ridge_kind::absolute; }, "0 to 1"},
      {"root.tolerance", [](auto& o) { o.root.tolerance = 1e-5; }, " to "},  // printed to 17 digits
  };
  for (const auto& ch : changes) {
    INFO(ch.name);
    run_threads(3, quick, [&](threads& c) {
      model m;
      auto mine = base_options();
      if (c.rank() == 1) ch.apply(mine);
      const shampoo opt(mine);
      auto st = opt.init(backend, m.params);
      m.grads(0);
      // The chain's later stages name theirs as their stage does ("momentum (stage trace:
      // decay) is", "scale_by_learning_rate lr is").
      RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st), Contains(std::string(ch.name)) &&
                                                                       Contains(ch.values) &&
                                                                       Contains("across ranks"));
    });
  }
  // The step's learning rate (a schedule that differs on one rank), at a step that exchanges.
  run_threads(3, quick, [&](threads& c) {
    model m;
    const shampoo opt(base_options());
    auto st = opt.init(backend, m.params);
    m.grads(0);
    opt.step(c, backend, m.params, st, {.lr = 0.01});  // step 1: the plan
    m.grads(1);
    RANK_REQUIRE_THROWS_WITH(opt.step(c, backend, m.params, st, {.lr = c.rank() == 1 ? 0.02 : 0.01}),
                             Contains("step lr is") && Contains("0.01 to 0.02"));
  });
}

TEST_CASE("shampoo options: root_staleness is at most precondition_frequency", "[shampoo][async]") {
  auto o = base_options();
  o.precondition_frequency = 2;
  o.root_staleness = 3;
  CHECK_THROWS_WITH(shampoo(o), Contains("root_staleness is 3"));
  o.root_staleness = 2;
  CHECK_NOTHROW(shampoo(o));
  model m;
  auto st = shampoo(o).init(backend, m.params);
  m.grads(0);
  CHECK_THROWS_WITH(shampoo(base_options()).step(backend, m.params, st), Contains("root_staleness"));
}

}  // namespace gradapt_test_shampoo_dist

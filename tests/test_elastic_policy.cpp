// gradapt::elastic::adaptive_job and its policies (elastic/policy.hpp):
//  1. policies are detected by their members; the events run in order with the view's epoch
//     and step count; the documented example policy (step_decay) acts at its epochs;
//  2. the vote: an action proposed on one rank only, or with other values on some rank, an
//     invalid action, and a policy that throws on one rank are errors on every rank naming the
//     field (or the rank), with the settings unchanged; agreed actions reach every rank's
//     settings at the same step; a later policy sees an earlier one's proposal;
//  3. straggler_policy on simulated per-example times: rebalance raises the slow rank and gives
//     per-rank batches summing to the global batch, proportional to the speeds once the window
//     holds only slow steps, and proposes nothing else while the rank stays slow;
//     drop puts the slow rank in the decision, which world_changed() clears;
//  4. sync_switch_policy switches to local steps after `patience` slow steps (not before) and
//     back when the throughput recovers; its state survives save_policies / load_policies;
//  5. goodput_policy re-plans on a world change (4 → 2 ranks) to the closed-form optimum
//     m* = sqrt(α_c B / (β_c R)), which is what a direct search_goodput call returns; nothing
//     while the noise scale is NaN;
//  6. option and event-order errors name the option;
//  7. the real train::data_parallel_step on comm::threads ranks: per-rank times reach the view,
//     and an agreed action reaches the step's settings on every rank;
//  8. one concept of hook (core/hooks.hpp) for both: events are told apart by their arguments
//     (a job's after_step is not a step's), and one object passed by std::ref to the step (as
//     a hook) and to the job (as a policy) handles both kinds of event with one state.
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/elastic/policy.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "rank_check.hpp"

namespace gradapt_test_elastic_policy {

using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
namespace el = gradapt::elastic;
namespace train = gradapt::train;

namespace {
const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};

// A step with the members adaptive_job uses; `model` fills the times and metrics of each call.
template <class Comm>
struct fake_step {
  Comm* c = nullptr;
  train::step_settings s = initial();
  train::step_metrics m;
  std::vector<double> times, secs;
  std::vector<train::step_settings> ran;  // the settings each call ran with
  std::uint64_t calls = 0;
  std::function<void(fake_step&)> model;

  explicit fake_step(Comm& comm) : c(&comm) {}
  static train::step_settings initial() {
    train::step_settings s;
    s.lr = 0.1;
    s.local_batch = 16.0;
    return s;
  }
  const train::step_metrics& step(const gradapt::step_args& a) {
    ++calls;
    ran.push_back(s);
    m.step = calls;
    m.loss = a.loss;
    m.synchronous = s.synchronous;  // as with a local_sgd_policy: false takes local steps
    m.global_batch =
        s.rank_batches.empty()
            ? s.local_batch * s.accumulation_steps * c->size()
            : std::accumulate(s.rank_batches.begin(), s.rank_batches.end(), 0.0) * s.accumulation_steps;
    if (model) model(*this);
    return m;
  }
  const train::step_metrics& metrics() const { return m; }
  train::step_settings& settings() { return s; }
  const train::step_settings& settings() const { return s; }
  std::uint64_t steps() const { return calls; }
  Comm& comm() const { return *c; }
  std::span<const double> rank_times() const { return times; }
  std::span<const double> rank_step_seconds() const { return secs; }
};

// Jitter in [0.7, 1.3] from (seed, step, rank): the same on every rank.
double jitter(std::uint64_t seed, std::uint64_t step, int rank) {
  std::mt19937_64 g(seed * 1000003u + step * 131u + static_cast<std::uint64_t>(rank));
  return std::uniform_real_distribution<double>(0.7, 1.3)(g);
}

// Records every event it sees.
struct recorder {
  std::vector<std::string> events;
  std::vector<std::int64_t> epochs;
  std::vector<std::uint64_t> steps;
  void note(const char* e, const el::job_view& v) {
    events.push_back(e);
    epochs.push_back(v.epoch);
    steps.push_back(v.steps);
  }
  void before_train(const el::job_view& v, el::job_action&) { note("before_train", v); }
  void before_epoch(const el::job_view& v, el::job_action&) { note("before_epoch", v); }
  void after_step(const el::job_view& v, el::job_action&) { note("after_step", v); }
  void after_epoch(const el::job_view& v, el::job_action&) { note("after_epoch", v); }
  void after_train(const el::job_view& v, el::job_action&) { note("after_train", v); }
  void on_world_change(const el::job_view& v, el::job_action&) { note("on_world_change", v); }
};

// The example of elastic.md, "Writing a policy".
struct step_decay {
  void before_epoch(const el::job_view& v, el::job_action& a) const {
    if (v.epoch > 0 && v.epoch % 3 == 0) a.lr = v.settings.lr / 2;
  }
};

struct only_after_step {
  void after_step(const el::job_view&, el::job_action&) {}
};
struct not_a_policy {
  void after_step(int) {}
};

// Proposes `set(view, action)` at step `at` (after_step).
struct propose_at {
  std::uint64_t at = 0;
  std::function<void(const el::job_view&, el::job_action&)> set;
  void after_step(const el::job_view& v, el::job_action& a) {
    if (v.steps == at) set(v, a);
  }
};
}  // namespace

static_assert(el::job_policy<recorder> && gradapt::handles<recorder, el::events::after_step> &&
              gradapt::handles<recorder, el::events::on_world_change>);
static_assert(el::job_policy<only_after_step> &&
              !gradapt::handles<only_after_step, el::events::before_epoch> &&
              !gradapt::handles<only_after_step, el::events::on_world_change>);
static_assert(!el::job_policy<not_a_policy> && !el::job_policy<int>);
static_assert(el::job_policy<el::straggler_policy> &&
              gradapt::handles<el::straggler_policy, el::events::after_step> &&
              gradapt::handles<el::straggler_policy, el::events::on_world_change>);
static_assert(gradapt::handles<el::sync_switch_policy, el::events::after_step> &&
              !gradapt::handles<el::sync_switch_policy, el::events::on_world_change>);
static_assert(gradapt::handles<el::goodput_policy, el::events::after_step> &&
              gradapt::handles<el::goodput_policy, el::events::on_world_change>);
static_assert(train::saves_state<el::sync_switch_policy> && !train::saves_state<el::straggler_policy>);

TEST_CASE("adaptive_job: events run the detected hooks in order", "[elastic][policy]") {
  gradapt::comm::single comm;
  fake_step<gradapt::comm::single> step(comm);
  el::adaptive_job job(step, recorder{}, only_after_step{});
  job.begin_train();
  for (std::int64_t e = 0; e < 2; ++e) {
    job.begin_epoch(e);
    job.step();
    job.step();
    job.end_epoch(e);
  }
  job.world_changed();
  job.end_train();
  const auto& r = job.policy<0>();
  const std::vector<std::string> want{"before_train", "before_epoch",    "after_step", "after_step",
                                      "after_epoch",  "before_epoch",    "after_step", "after_step",
                                      "after_epoch",  "on_world_change", "after_train"};
  CHECK(r.events == want);
  CHECK(r.epochs == std::vector<std::int64_t>{0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1});
  CHECK(r.steps == std::vector<std::uint64_t>{0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 4});
  CHECK(step.calls == 4);
}

TEST_CASE("adaptive_job: the documented step_decay policy halves the lr every third epoch",
          "[elastic][policy]") {
  run_threads(2, quick, [](threads& comm) {
    fake_step<threads> step(comm);
    el::adaptive_job job(step, step_decay{});
    std::vector<double> lrs;
    for (std::int64_t e = 0; e < 7; ++e) {
      job.begin_epoch(e);
      job.step();
      lrs.push_back(step.ran.back().lr);
      job.end_epoch(e);
    }
    RANK_CHECK(lrs == std::vector<double>{0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025});
  });
}

TEST_CASE("adaptive_job: an action proposed on one rank only is an error on every rank naming the field",
          "[elastic][policy]") {
  run_threads(3, quick, [](threads& comm) {
    fake_step<threads> step(comm);
    el::adaptive_job job(step, propose_at{2, [](const el::job_view& v, el::job_action& a) {
                                            if (v.rank == 1) a.lr = 0.5;
                                          }});
    job.step();
    RANK_REQUIRE_THROWS_WITH(job.step(), Contains("job_action::lr") && Contains("every rank must pass"));
    RANK_CHECK(step.s.lr == 0.1);  // nothing applied
    RANK_CHECK(job.last_action().empty());
    // The job goes on: the next step's vote agrees (no proposal).
    job.step();
    RANK_CHECK(step.ran.back().lr == 0.1);
  });
}

TEST_CASE("adaptive_job: different values, invalid actions and a throwing policy fail on every rank",
          "[elastic][policy]") {
  run_threads(3, quick, [](threads& comm) {
    fake_step<threads> step(comm);
    el::adaptive_job job(
        step,
        propose_at{1,
                   [](const el::job_view& v, el::job_action& a) {
                     a.rank_batches = std::vector<double>{10, 10, 10.0 + (v.rank == 2 ? 1 : 0)};
                   }},
        propose_at{2, [](const el::job_view& v, el::job_action& a) { a.local_batch = 8.0 + v.rank; }},
        propose_at{3,
                   [](const el::job_view&, el::job_action& a) {
                     a.drop_ranks = {0, 3};
                   }},
        propose_at{4, [](const el::job_view& v, el::job_action&) {
                     if (v.rank == 2) throw gradapt::error("policy failure on rank 2");
                   }});
    RANK_REQUIRE_THROWS_WITH(job.step(), Contains("job_action::rank_batches (a hash of the values)"));
    RANK_REQUIRE_THROWS_WITH(job.step(), Contains("job_action::local_batch"));
    RANK_REQUIRE_THROWS_WITH(job.step(), Contains("rank 0 passed invalid input") ||
                                             Contains("job_action::drop_ranks holds rank 3"));
    RANK_REQUIRE_THROWS_WITH(
        job.step(), comm.rank() == 2 ? Contains("policy 3's after_step threw: policy failure on rank 2")
                                     : Contains("rank 2 passed invalid input"));
    RANK_CHECK(step.s.local_batch == 16.0);
    RANK_CHECK(step.s.rank_batches.empty());
    RANK_CHECK(!job.decision().resize());
  });
}

TEST_CASE(
    "adaptive_job: agreed actions reach every rank's settings at the same step; later policies see "
    "earlier proposals",
    "[elastic][policy]") {
  std::mutex mu;
  std::vector<std::vector<train::step_settings>> ran(4);
  run_threads(4, quick, [&](threads& comm) {
    fake_step<threads> step(comm);
    el::adaptive_job job(step,
                         propose_at{3,
                                    [](const el::job_view&, el::job_action& a) {
                                      a.lr = 0.25;
                                      a.accumulation_steps = 2;
                                      a.synchronous = true;
                                      a.world_size = 6;
                                    }},
                         propose_at{3, [](const el::job_view&, el::job_action& a) {
                                      if (a.lr) a.lr = *a.lr * 2;  // sees the first policy's proposal
                                      a.rank_batches = std::vector<double>{4, 4, 4, 20};
                                    }});
    for (int t = 0; t < 5; ++t) job.step();
    RANK_CHECK(job.decision().world_size == std::optional<int>(6));
    RANK_CHECK(job.decision().step == 3);
    std::lock_guard lock(mu);
    ran[static_cast<std::size_t>(comm.rank())] = step.ran;
  });
  for (const auto& r : ran) {
    REQUIRE(r.size() == 5);
    for (std::size_t k = 0; k < 3; ++k) {  // steps 1..3 ran before the action
      CHECK(r[k].lr == 0.1);
      CHECK(r[k].accumulation_steps == 1);
      CHECK(!r[k].synchronous);
      CHECK(r[k].rank_batches.empty());
    }
    for (std::size_t k = 3; k < 5; ++k) {
      CHECK(r[k].lr == 0.5);
      CHECK(r[k].accumulation_steps == 2);
      CHECK(r[k].synchronous);
      CHECK(r[k].rank_batches == std::vector<double>{4, 4, 4, 20});
    }
  }
}

namespace {
// Per-example seconds 1 ms × jitter, × 3 for `slow` from step `onset`; time-to-ready = the
// rank's batch × that; 2 ms inside step() from the second call.
template <class Comm>
void straggler_model(fake_step<Comm>& s, int slow, std::uint64_t onset) {
  const int n = s.c->size();
  s.times.assign(static_cast<std::size_t>(n), 0.0);
  for (int r = 0; r < n; ++r) {
    const double batch =
        s.s.rank_batches.empty() ? s.s.local_batch : s.s.rank_batches[static_cast<std::size_t>(r)];
    const double per = 1e-3 * jitter(7, s.calls, r) * (r == slow && s.calls >= onset ? 3.0 : 1.0);
    s.times[static_cast<std::size_t>(r)] = batch * per;
  }
  if (s.calls >= 2) s.secs.assign(static_cast<std::size_t>(n), 2e-3);
}
}  // namespace

TEST_CASE("straggler_policy: rebalance raises the slow rank and gives batches summing to the global batch",
          "[elastic][policy][straggler]") {
  std::mutex mu;
  std::vector<std::vector<double>> batches(4);
  run_threads(4, quick, [&](threads& comm) {
    fake_step<threads> step(comm);
    step.model = [](fake_step<threads>& s) { straggler_model(s, 2, 30); };
    el::adaptive_job job(
        step, el::straggler_policy(
                  {.response = el::straggler_response::rebalance, .global_batch = 64, .min_batch = 2}));
    std::uint64_t raised_at = 0;
    for (std::uint64_t t = 1; t <= 120; ++t) {
      job.step();
      const auto& rep = job.policy<0>().report();
      if (!rep.raised.empty() && raised_at == 0) {
        raised_at = t;
        RANK_CHECK(rep.raised == std::vector<int>{2});
        RANK_REQUIRE(job.last_action().rank_batches.has_value());
      }
      // Once more when the window (20) holds only steps after the raise; then nothing (no oscillation).
      if (raised_at != 0 && t == raised_at + 20) RANK_CHECK(job.last_action().rank_batches.has_value());
      if (raised_at != 0 && t > raised_at && t != raised_at + 20) RANK_CHECK(!job.last_action().rank_batches);
    }
    RANK_REQUIRE(raised_at >= 30);
    RANK_CHECK(raised_at < 50);
    RANK_CHECK(job.policy<0>().detector().flagged(2));  // still slow per example
    std::lock_guard lock(mu);
    batches[static_cast<std::size_t>(comm.rank())] = step.s.rank_batches;
  });
  const auto& b = batches[0];
  REQUIRE(b.size() == 4);
  for (const auto& other : batches) CHECK(other == b);
  CHECK(std::accumulate(b.begin(), b.end(), 0.0) == 64.0);
  for (std::size_t r = 0; r < 4; ++r) CHECK(b[r] >= 2.0);
  // Speeds 1 : 1 : 1/3 : 1 give the slow rank about 64 / 10 and the others about 19.
  CHECK(b[2] >= 5.0);
  CHECK(b[2] <= 8.0);
  for (const std::size_t r : {0u, 1u, 3u}) CHECK(b[r] > 2.0 * b[2]);
}

TEST_CASE("straggler_policy: drop puts the slow rank in the decision; world_changed clears it",
          "[elastic][policy][straggler]") {
  run_threads(4, quick, [](threads& comm) {
    fake_step<threads> step(comm);
    step.model = [](fake_step<threads>& s) { straggler_model(s, 1, 20); };
    el::adaptive_job job(step, el::straggler_policy({.response = el::straggler_response::drop}));
    for (int t = 0; t < 19; ++t) job.step();
    RANK_CHECK(!job.decision().resize());
    int t = 19;
    while (!job.decision().resize() && t < 80) {
      job.step();
      ++t;
    }
    RANK_REQUIRE(job.decision().resize());
    RANK_CHECK(job.decision().drop_ranks == std::vector<int>{1});
    RANK_CHECK(job.decision().step == static_cast<std::uint64_t>(t));
    RANK_CHECK(step.s.rank_batches.empty());  // drop changes no setting
    job.world_changed();
    RANK_CHECK(!job.decision().resize());
    RANK_CHECK(job.policy<0>().detector().steps() == 0);  // a fresh detector
  });
}

TEST_CASE("sync_switch_policy: local steps after `patience` slow steps, back on recovery; saved state",
          "[elastic][policy]") {
  run_threads(2, quick, [](threads& comm) {
    // Throughput 32 / x examples per second: x = 1 during warm-up, 2 (half) from step 8, 1 from step 15.
    fake_step<threads> step(comm);
    step.s.local_batch = 16.0;
    step.model = [](fake_step<threads>& s) {
      const double x = (s.calls >= 8 && s.calls < 15) ? 2.0 : 1.0;
      s.times.assign(2, 0.25 * x);
      if (s.calls >= 2) s.secs.assign(2, 0.75 * x);
    };
    el::adaptive_job job(
        step, el::sync_switch_policy({.warmup = 4, .fraction = 0.8, .fraction_back = 0.95, .patience = 3}));
    RANK_CHECK(!step.s.synchronous);
    job.step();  // step 1 has no throughput; the warm-up asks for synchronous steps
    RANK_CHECK(step.s.synchronous);
    RANK_CHECK(step.ran.back().synchronous == false);
    for (int t = 2; t <= 4; ++t) job.step();  // 2..4 are warm-up samples
    RANK_CHECK(job.policy<0>().reference() == 0.0);
    job.step();  // step 5: the 4th sample
    RANK_CHECK(job.policy<0>().reference() == 32.0);
    const std::vector<std::byte> saved = job.save_policies();
    for (int t = 6; t <= 9; ++t) job.step();  // slow at 8, 9
    RANK_CHECK(step.s.synchronous);
    RANK_CHECK(job.policy<0>().slow_steps() == 2);
    job.step();  // step 10: the third slow step
    RANK_CHECK(!step.s.synchronous);
    RANK_CHECK(job.last_action().synchronous == std::optional<bool>(false));
    for (int t = 11; t <= 14; ++t) job.step();  // still slow: stays local
    RANK_CHECK(!step.s.synchronous);
    RANK_CHECK(!job.last_action().synchronous);
    job.step();  // step 15: recovered
    RANK_CHECK(step.s.synchronous);
    RANK_CHECK(step.ran.back().synchronous == false);  // step 15 itself ran local; step 16 combines
    // The saved state: a fresh policy loaded from it has the reference.
    fake_step<threads> other(comm);
    el::adaptive_job again(other, el::sync_switch_policy({.warmup = 4, .patience = 3}));
    again.load_policies(saved);
    RANK_CHECK(again.policy<0>().reference() == 32.0);
    // A policy held by std::ref loads into the object it refers to.
    el::sync_switch_policy target({.warmup = 4, .patience = 3});
    el::adaptive_job by_ref(other, std::ref(target));
    by_ref.load_policies(saved);
    RANK_CHECK(target.reference() == 32.0);
    RANK_CHECK(by_ref.save_policies() == saved);
    // A damaged archive is rejected whole.
    std::vector<std::byte> bad = saved;
    bad[bad.size() / 2] ^= std::byte{1};
    RANK_REQUIRE_THROWS_WITH(again.load_policies(bad), Contains("CRC") || Contains("checksum"));
    RANK_CHECK(again.policy<0>().reference() == 32.0);
  });
}

TEST_CASE("goodput_policy: re-plans on a world change to the closed-form optimum of search_goodput",
          "[elastic][policy][goodput]") {
  // t_iter = s (alpha_c + beta_c m) with no sync cost: goodput(m) at s = 1 is
  // R m (B + M0) / ((alpha_c + beta_c m)(B + R m)), maximal at m* = sqrt(alpha_c B / (beta_c R)).
  // alpha_c = 0.1, beta_c = 0.01, B = 80, R = 2: m* = 20.
  const el::goodput_policy_options opts{.model = {.alpha_c = 0.1, .beta_c = 0.01, .gamma = 1.0},
                                        .search = {.max_atomic_batch = 64, .hysteresis = 0.05},
                                        .base_batch = 8.0,
                                        .every = 5};
  using job_t = el::adaptive_job<fake_step<threads>, el::goodput_policy>;
  std::vector<std::optional<job_t>> jobs(4);
  std::vector<std::optional<fake_step<threads>>> steps(4);
  // World A (4 ranks): the noise scale is undefined, nothing happens.
  run_threads(4, quick, [&](threads& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    steps[r].emplace(comm);
    steps[r]->s.local_batch = 4.0;
    jobs[r].emplace(*steps[r], el::goodput_policy(opts));
    for (int t = 0; t < 5; ++t) jobs[r]->step();
    RANK_CHECK(!jobs[r]->policy<0>().last_search());
    RANK_CHECK(steps[r]->s.local_batch == 4.0);
  });
  // World B (2 ranks): the framework restored the step there, the noise scale is 80.
  std::vector<std::optional<fake_step<threads>>> next(2);
  run_threads(2, quick, [&](threads& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    next[r].emplace(comm);
    next[r]->s.local_batch = 4.0;
    next[r]->m.noise_scale = 80.0;
    next[r]->calls = 5;
    next[r]->model = [](fake_step<threads>& s) { s.m.noise_scale = 80.0; };
    jobs[r]->world_changed(*next[r]);
    const auto direct = gradapt::search_goodput(opts.model, {.noise_scale = 80.0, .base_batch = 8.0}, 2, 1,
                                                {.atomic_batch = 4, .replicas = 2}, opts.search);
    RANK_CHECK(direct.switched);
    RANK_CHECK(direct.config.atomic_batch == 20);
    RANK_CHECK(direct.config.accum_steps == 1);
    RANK_CHECK(next[r]->s.local_batch == 20.0);
    RANK_CHECK(next[r]->s.accumulation_steps == 1);
    RANK_REQUIRE(jobs[r]->policy<0>().last_search());
    RANK_CHECK(jobs[r]->policy<0>().last_search()->goodput == direct.goodput);
    // Every 5 steps it searches again; the optimum is kept (no action).
    for (int t = 0; t < 5; ++t) jobs[r]->step();
    RANK_CHECK(jobs[r]->policy<0>().last_search()->current_goodput == direct.goodput);
    RANK_CHECK(!jobs[r]->last_action().local_batch);
    RANK_CHECK(next[r]->s.local_batch == 20.0);
  });
}

TEST_CASE("policies: invalid options and event order are errors naming them", "[elastic][policy]") {
  using el::straggler_response;
  CHECK_THROWS_WITH(el::straggler_policy({.response = straggler_response::rebalance}),
                    Contains("global_batch"));
  CHECK_THROWS_WITH(el::straggler_policy({.detector = {.window = 1}}), Contains("window"));
  CHECK_THROWS_WITH(el::straggler_policy({.min_batch = 0}), Contains("min_batch"));
  CHECK_THROWS_WITH(el::sync_switch_policy({.warmup = 0}), Contains("warmup"));
  CHECK_THROWS_WITH(el::sync_switch_policy({.fraction = 1.5}), Contains("fraction is"));
  CHECK_THROWS_WITH(el::sync_switch_policy({.fraction = 0.8, .fraction_back = 0.5}),
                    Contains("fraction_back"));
  CHECK_THROWS_WITH(el::sync_switch_policy({.patience = 0}), Contains("patience"));
  CHECK_THROWS_WITH(el::sync_switch_policy({.reference = -1}), Contains("reference"));
  const el::goodput_policy_options ok{
      .model = {.alpha_c = 0.1, .beta_c = 0.01}, .search = {.max_atomic_batch = 8}, .base_batch = 8};
  CHECK_NOTHROW(el::goodput_policy(ok));
  auto o = ok;
  o.base_batch = 0;
  CHECK_THROWS_WITH(el::goodput_policy(o), Contains("base_batch"));
  o = ok;
  o.search.max_atomic_batch = 0;
  CHECK_THROWS_WITH(el::goodput_policy(o), Contains("max_atomic_batch"));
  o = ok;
  o.every = 0;
  CHECK_THROWS_WITH(el::goodput_policy(o), Contains("every"));
  o = ok;
  o.model.gamma = 0.5;
  CHECK_THROWS_WITH(el::goodput_policy(o), Contains("gamma"));
  o = ok;
  o.ranks_per_node = -1;
  CHECK_THROWS_WITH(el::goodput_policy(o), Contains("ranks_per_node"));

  gradapt::comm::single comm;
  fake_step<gradapt::comm::single> step(comm);
  el::adaptive_job job(step, recorder{}, el::straggler_policy{}, el::sync_switch_policy{});
  CHECK_THROWS_WITH(job.end_epoch(0), Contains("end_epoch(0)") && Contains("no epoch is open"));
  CHECK_THROWS_WITH(job.begin_epoch(-1), Contains("begin_epoch(-1)"));
  job.begin_epoch(3);
  CHECK_THROWS_WITH(job.begin_epoch(4), Contains("epoch 3 is open"));
  CHECK_THROWS_WITH(job.end_epoch(2), Contains("the open epoch is 3"));
  // Without per-rank times the straggler and sync policies cannot work.
  CHECK_THROWS_WITH(job.step(), Contains("policy 1's after_step") && Contains("step_args::ready_seconds"));
  // A job whose policies save state rejects another job's archive.
  el::adaptive_job two(step, el::sync_switch_policy{}, el::sync_switch_policy{});
  el::adaptive_job one(step, el::sync_switch_policy{});
  CHECK_THROWS_WITH(one.load_policies(two.save_policies()), Contains("holds 2 policies"));
}

TEST_CASE("adaptive_job over train::data_parallel_step: per-rank times in the view, actions in the settings",
          "[elastic][policy][train]") {
  for (const int n : {2, 4}) {
    INFO(n << " ranks");
    run_threads(n, quick, [n](threads& comm) {
      std::vector<float> p(6, 1.0f), g(6, 0.0f);
      gradapt::param_list<float, float> params;
      params.add("w", gradapt::host_view(p), gradapt::host_view(g));
      auto step = train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd(),
                                                 {.lr = 0.1, .local_batch = 4.0});
      std::vector<std::vector<double>> seen;
      el::adaptive_job job(
          step, propose_at{3, [&](const el::job_view& v, el::job_action& a) {
                             a.lr = 0.05;
                             seen.assign(1, std::vector<double>(v.rank_times.begin(), v.rank_times.end()));
                           }});
      for (int t = 1; t <= 4; ++t) {
        for (auto& x : g) x = 0.1f * static_cast<float>(comm.rank() + t);
        const auto& m = job.step({.ready_seconds = 0.01 * (comm.rank() + 1) * t});
        RANK_CHECK(m.step == static_cast<std::uint64_t>(t));
        const auto v = job.view();
        RANK_REQUIRE(v.rank_times.size() == static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r)
          RANK_CHECK(v.rank_times[static_cast<std::size_t>(r)] == 0.01 * (r + 1) * t);
        RANK_CHECK(v.global_batch == 4.0 * n);
        if (t >= 2) {
          RANK_CHECK(v.rank_step_seconds.size() == static_cast<std::size_t>(n));
          RANK_CHECK(std::isfinite(v.throughput));
          RANK_CHECK(v.throughput > 0.0);
        } else {
          RANK_CHECK(std::isnan(v.throughput));
        }
        RANK_CHECK(step.settings().lr == (t >= 3 ? 0.05 : 0.1));
      }
      RANK_CHECK(step.metrics().lr == 0.05);  // step 4 ran at the agreed lr
      RANK_REQUIRE(seen.size() == 1);
      RANK_CHECK(seen[0].size() == static_cast<std::size_t>(n));
    });
  }
}

namespace {
// Handles one event of the step (before_step) and one of the job (after_epoch).
struct both_ways {
  int step_calls = 0, epoch_calls = 0;
  std::vector<double> lrs;  // the lr each step was about to run with
  void before_step(train::step_settings& s, const train::step_metrics&) {
    ++step_calls;
    lrs.push_back(s.lr);
  }
  void after_epoch(const el::job_view& v, el::job_action& a) {
    ++epoch_calls;
    a.lr = v.settings.lr / 2;
  }
};
struct step_only {
  void after_step(train::step_settings&, const train::step_metrics&) {}
};
}  // namespace

static_assert(train::step_hook<both_ways> && el::job_policy<both_ways>);
static_assert(train::step_hook<std::reference_wrapper<both_ways>> &&
              el::job_policy<std::reference_wrapper<both_ways>>);
// The same member name with the other component's arguments is not that component's hook.
static_assert(train::step_hook<step_only> && !el::job_policy<step_only>);
static_assert(!train::step_hook<only_after_step> && el::job_policy<only_after_step>);
static_assert(gradapt::handles<both_ways, train::events::before_step> &&
              !gradapt::handles<both_ways, train::events::after_step> &&
              gradapt::handles<both_ways, el::events::after_epoch> &&
              !gradapt::handles<both_ways, el::events::after_step>);

TEST_CASE("one object as step hook and job policy: both kinds of event reach one state",
          "[elastic][policy][train]") {
  run_threads(2, quick, [](threads& comm) {
    std::vector<float> p(4, 1.0f), g(4, 0.25f);
    gradapt::param_list<float, float> params;
    params.add("w", gradapt::host_view(p), gradapt::host_view(g));
    both_ways hook;
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd(), {.lr = 0.5},
                                               std::ref(hook));
    el::adaptive_job job(step, std::ref(hook));
    for (std::int64_t e = 0; e < 3; ++e) {
      job.begin_epoch(e);
      for (int t = 0; t < 2; ++t) job.step();
      job.end_epoch(e);
    }
    RANK_CHECK(hook.step_calls == 6);
    RANK_CHECK(hook.epoch_calls == 3);
    // Each epoch's action (lr halved) reaches the next epoch's steps, seen by the step hook.
    RANK_CHECK(hook.lrs == std::vector<double>{0.5, 0.5, 0.25, 0.25, 0.125, 0.125});
    RANK_CHECK(step.settings().lr == 0.0625);
    RANK_CHECK(&std::get<0>(job.policies()).get() == &hook);
  });
}

TEST_CASE("straggler_policy over train::data_parallel_step: the rebalanced batches reach the step",
          "[elastic][policy][train][straggler]") {
  run_threads(4, quick, [](threads& comm) {
    std::vector<float> p(6, 1.0f), g(6, 0.0f);
    gradapt::param_list<float, float> params;
    params.add("w", gradapt::host_view(p), gradapt::host_view(g));
    auto step = train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd(),
                                               {.lr = 0.01, .local_batch = 16.0});
    el::adaptive_job job(
        step, el::straggler_policy(
                  {.response = el::straggler_response::rebalance, .global_batch = 64, .min_batch = 2}));
    std::uint64_t raised_at = 0;
    for (std::uint64_t t = 1; t <= 40 && raised_at == 0; ++t) {
      // Rank 3 takes 3 ms per example, the others 1 ms (jittered), from step 10.
      const auto& s = step.settings();
      const double batch =
          s.rank_batches.empty() ? s.local_batch : s.rank_batches[static_cast<std::size_t>(comm.rank())];
      const double per = 1e-3 * jitter(3, t, comm.rank()) * (comm.rank() == 3 && t >= 10 ? 3.0 : 1.0);
      for (auto& x : g) x = 0.01f * static_cast<float>(comm.rank() + 1);
      job.step({.ready_seconds = batch * per});
      if (!job.policy<0>().report().raised.empty()) raised_at = t;
    }
    RANK_REQUIRE(raised_at >= 10);
    RANK_CHECK(job.policy<0>().report().raised == std::vector<int>{3});
    const std::vector<double> b = step.settings().rank_batches;
    RANK_REQUIRE(b.size() == 4);
    RANK_CHECK(std::accumulate(b.begin(), b.end(), 0.0) == 64.0);
    RANK_CHECK(b[3] < b[0]);
    for (auto& x : g) x = 0.01f;
    const auto& m = job.step({.ready_seconds = 1e-3});
    RANK_CHECK(m.global_batch == 64.0);  // the step ran with the agreed per-rank batches
  });
}

}  // namespace gradapt_test_elastic_policy

// train::data_parallel_step over comm::mpi with 1 to 5 ranks (odd counts included).
//
// - The composed step equals the stages called one by one on the same communicator, bit for
//   bit in the parameters and the metrics: LAMB + loss scaling (fp16 gradients, an overflow on
//   the last rank) + noise scale + AdaScale; AdamW + Adasum; SGD with momentum + LocalSGD.
// - The parameters are identical on every rank after synchronous steps (allgathered, bitwise).
// - A checkpoint taken mid-run and restored into a fresh step continues bit for bit; one of N
//   ranks restored on M ranks (sub-worlds of 1..size ranks) resumes alike on every rank.
// - Lists, settings and options that differ across ranks make every rank throw; none hangs.
// - The state slot's zero_state<1> and <2>, and the reduce slot's bucket_reduce and
//   hierarchical_reduce (two "hosts" of two ranks on 4 ranks), give the replicated step's bits.
//
// The scenarios are shared with the threads tests: tests/support/scenarios/train_step.hpp and
// disagreement.hpp.
//
// Every collective runs on every rank before any REQUIRE, so a failure on one rank cannot leave
// the others waiting in a collective.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/elastic/policy.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/disagreement.hpp"
#include "scenarios/sharded.hpp"
#include "scenarios/train_step.hpp"

namespace gradapt_test_mpi_train_step {

using gradapt::half;
using mpi = gradapt::comm::mpi;
using namespace train_scenario;

TEST_CASE("mpi: the composed step equals the stages by hand", "[mpi][train]") {
  mpi comm;
  const plan pl{.steps = 7, .inf_at = 4};
  const auto scaler = gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 3});
  const auto a =
      run_composed<half>(comm, pl, &make_opt_lamb, scaler,
                         train::adascale_policy{.base_batch = base_batch, .noise = {.smoothing = 0.5}});
  const auto b = run_by_hand<half>(comm, pl, &make_opt_lamb, {.scaling = true, .adapt = true});
  const bool in_sync = identical_on_every_rank(comm, a.params);
  const auto c = run_composed<half>(comm, pl, &make_opt_adamw, scaler, train::adasum_combine{});
  const auto d = run_by_hand<half>(comm, pl, &make_opt_adamw, {.scaling = true, .adasum = true});
  const bool adasum_in_sync = identical_on_every_rank(comm, c.params);
  const auto e =
      run_composed<half>(comm, pl, &make_opt_sgd_momentum, scaler,
                         train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 2})});
  const auto f = run_by_hand<half>(comm, pl, &make_opt_sgd_momentum, {.scaling = true, .local = true});
  require_same(a, b);
  require_same(c, d);
  require_same(e, f);
  REQUIRE(in_sync);
  REQUIRE(adasum_in_sync);
  // The overflow on the last rank skipped step inf_at everywhere.
  REQUIRE(a.metrics[static_cast<std::size_t>(pl.inf_at - 1)].found_inf);
  REQUIRE(a.metrics.back().optimizer_steps == static_cast<std::uint64_t>(pl.steps - 1));
  if (comm.size() >= 2) REQUIRE(std::isfinite(a.metrics.back().noise_scale));
}

TEST_CASE(
    "mpi: zero_state<1> and <2>, bucket_reduce (overlapped) and hierarchical_reduce give the replicated "
    "step's bits",
    "[mpi][train][zero]") {
  // The gradients differ by rank and lie on a grid of 2^-12 below 16 in magnitude, so their sums
  // are exact in any order: this checks the state slot's wiring over MPI (the scaler's overflow
  // on one rank, stage 2's marks in a rank-dependent order, the state bytes), not MPI's
  // summation order, which test_mpi_shard checks on full-mantissa gradients.
  mpi comm;
  const gradapt::host b;
  const int n = comm.size(), r = comm.rank();
  const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
  const auto scaler = gradapt::loss_scaler({.init_scale = 256.0, .growth_interval = 2});
  sharded_scenario::model<float> a, c, d, e, f;
  auto rep = train::make_data_parallel_step(comm, b, a.params, opt, {.lr = 1e-2}, scaler);
  auto z1 = train::make_data_parallel_step(comm, b, c.params, opt, {.lr = 1e-2}, scaler,
                                           train::zero_state<1>{.allow_empty_shards = true});
  auto z2 = train::make_data_parallel_step(
      comm, b, d.params, opt, {.lr = 1e-2}, scaler,
      train::zero_state<2>{.sharding = {.buckets = {.cap_bytes = 40000}}, .allow_empty_shards = true});
  auto bu = train::make_data_parallel_step(comm, b, e.params, opt, {.lr = 1e-2}, scaler,
                                           train::bucket_reduce{.buckets = {.cap_bytes = 40000}});
  // Even worlds: groups of two ranks named as hosts ("node0", "node1", ...: two nodes on 4
  // ranks); odd ones: one rank per group.
  gradapt::comm::hierarchy_options groups{.group_size = 1};
  if (n % 2 == 0) groups = {.host = "node" + std::to_string(r / 2)};
  auto hi = train::make_data_parallel_step(comm, b, f.params, opt, {.lr = 1e-2}, scaler,
                                           train::hierarchical_reduce{.hierarchy = groups});
  std::vector<train::step_metrics> mr, m1, m2, mb, mh;
  for (int k = 1; k <= 5; ++k) {
    for (auto* m : {&a, &c, &d, &e, &f}) {
      m->make_grads(r, k);
      for (auto& g : m->g)
        for (auto& x : g)
          x = std::nearbyint(std::clamp(x, -15.0f, 15.0f) * 4096.0f) / 4096.0f *
              static_cast<float>(rep.loss_scale());
      if (k == 3 && r == n - 1) m->g[4][11] = std::numeric_limits<float>::infinity();
    }
    for (std::size_t i = 0; i < d.params.size(); ++i) {
      z2.mark_ready((i + static_cast<std::size_t>(r) * 3) % d.params.size());
      bu.mark_ready((i + static_cast<std::size_t>(r) * 5) % e.params.size());
    }
    mr.push_back(rep.step());
    m1.push_back(z1.step());
    m2.push_back(z2.step());
    mb.push_back(bu.step());
    mh.push_back(hi.step());
  }
  double bytes = static_cast<double>(z1.state_bytes());
  comm.allreduce(gradapt::host_view(std::span<double>(&bytes, 1)), gradapt::reduce_op::sum);
  for (std::size_t t = 0; t < a.p.size(); ++t) {
    REQUIRE(sharded_scenario::same_bits(a.p[t], c.p[t]));
    REQUIRE(sharded_scenario::same_bits(a.p[t], d.p[t]));
    REQUIRE(sharded_scenario::same_bits(a.p[t], e.p[t]));
    REQUIRE(sharded_scenario::same_bits(a.p[t], f.p[t]));
  }
  for (std::size_t k = 0; k < mr.size(); ++k) {
    REQUIRE(m1[k].found_inf == (k == 2));
    REQUIRE(m2[k].found_inf == (k == 2));
    REQUIRE(m1[k].loss_scale == mr[k].loss_scale);
    REQUIRE(m2[k].loss_scale == mr[k].loss_scale);
    REQUIRE(mb[k].found_inf == (k == 2));
    REQUIRE(mh[k].found_inf == (k == 2));
  }
  REQUIRE(bytes == static_cast<double>(rep.state_bytes()));
}

TEST_CASE("mpi: a restored checkpoint continues bit for bit", "[mpi][train]") {
  mpi comm;
  const int cuts[] = {2, 4, 6};
  std::vector<checkpoint_run> straight, resumed;
  for (int cut : cuts) {
    straight.push_back(checkpoint_straight(comm, cut));
    resumed.push_back(checkpoint_resumed(comm, straight.back(), cut));
  }
  for (std::size_t k = 0; k < straight.size(); ++k) {
    INFO("checkpoint after step " << cuts[k]);
    require_resumed_equal(straight[k], resumed[k], cuts[k]);
  }
}

TEST_CASE("mpi: parameter lists that differ across ranks throw on every rank", "[mpi][train]") {
  mpi comm;
  if (comm.size() < 2) return;
  replica<float> rep(comm.rank() == comm.size() - 1 ? std::vector<std::size_t>{7, 1, 33, 6}
                                                    : std::vector<std::size_t>{7, 1, 33, 5});
  const std::string what = mpitest::error_of([&] {
    auto step =
        train::make_data_parallel_step(comm, gradapt::host{}, rep.params, make_opt_sgd(), {.lr = 0.1});
    step.step();
  });
  REQUIRE(what.find("every rank must pass the same parameter") != std::string::npos);
}

TEST_CASE("mpi: settings and options that differ across ranks throw on every rank",
          "[mpi][train][disagreement]") {
  mpi comm;
  if (comm.size() < 2) return;
  for (const auto& c : disagreement_scenario::train_step_cases<mpi>()) {
    const std::string what = mpitest::error_of([&] { c.body(comm); });
    INFO(c.what << ": " << what);
    CHECK(what.find(c.expected(comm.rank())) != std::string::npos);
  }
}

TEST_CASE("mpi: restore continues a checkpoint of N ranks on M ranks, every rank alike",
          "[mpi][train][elastic]") {
  mpi world;
  const int w = world.size(), me = world.rank();
  namespace train = gradapt::train;
  const auto make = [](mpi& c, replica<float>& rep) {
    return train::make_data_parallel_step(
        c, gradapt::host{}, rep.params, make_opt_lamb(),
        {.lr = 0.01, .local_batch = base_batch, .accumulation_steps = 60},  // 60 = lcm(1..5)
        gradapt::loss_scaler({.init_scale = 1024.0, .growth_interval = 2}),
        train::adascale_policy{.base_batch = base_batch});
  };
  for (int n = 1; n <= w; ++n) {
    // The old world: ranks [0, n) take three steps; rank 0's checkpoint and parameters go to all.
    mpi old_world = world.split(me < n ? 0 : 1, me);
    std::vector<std::byte> bytes;
    std::vector<float> params;
    if (me < n) {
      replica<float> rep;
      auto step = make(old_world, rep);
      for (int t = 1; t <= 3; ++t) {
        rep.fill(me, static_cast<std::uint64_t>(t), step.loss_scale());
        step.step({.loss = 1.0});
      }
      bytes = step.save();
      params = rep.flat();
    }
    unsigned long long size = bytes.size(), count = params.size();
    MPI_Bcast(&size, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    MPI_Bcast(&count, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    bytes.resize(size);
    params.resize(count);
    MPI_Bcast(bytes.data(), static_cast<int>(size), MPI_BYTE, 0, MPI_COMM_WORLD);
    MPI_Bcast(params.data(), static_cast<int>(count), MPI_FLOAT, 0, MPI_COMM_WORLD);
    for (int m = 1; m <= w; ++m) {
      INFO(n << " -> " << m << " ranks");
      mpi new_world = world.split(me < m ? 0 : 1, me);
      std::vector<float> lo, hi;
      int accumulation = 0;
      std::uint64_t steps = 0;
      if (me < m) {
        replica<float> rep;
        rep.set(params);
        auto step = make(new_world, rep);
        step.restore(bytes, train::rescale_rule::keep_global_batch);
        accumulation = step.settings().accumulation_steps;
        for (int t = 4; t <= 5; ++t) {
          rep.fill(me, static_cast<std::uint64_t>(t), step.loss_scale());
          step.step({.loss = 1.0});
        }
        steps = step.steps();
        lo = hi = rep.flat();
        MPI_Allreduce(MPI_IN_PLACE, lo.data(), static_cast<int>(lo.size()), MPI_FLOAT, MPI_MIN,
                      new_world.native());
        MPI_Allreduce(MPI_IN_PLACE, hi.data(), static_cast<int>(hi.size()), MPI_FLOAT, MPI_MAX,
                      new_world.native());
      }
      if (me < m) {
        CHECK(accumulation == 60 * n / m);
        CHECK(steps == 5);
        CHECK(lo == hi);  // every rank of the new world holds the same parameters
      }
    }
  }
}

TEST_CASE("mpi: zero_state<2> checkpoints of N ranks continue on M ranks as an uninterrupted M-rank run",
          "[mpi][train][zero][elastic]") {
  // Three steps on gradients identical on every rank and exact in any sum leave the same state
  // on any world size (the parameters are checked equal), so an M-rank run of them is the
  // reference: given the restored settings, it must match the step restored from the N ranks'
  // checkpoints (each old rank's bytes broadcast to every rank, as files would be read) bit for
  // bit over three more steps on gradients that differ by rank, the whole checkpoint included.
  mpi world;
  const int w = world.size(), me = world.rank();
  const auto opt = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
  const auto scaler = gradapt::loss_scaler({.init_scale = 256.0, .growth_interval = 2});
  const auto make = [&](mpi& c, sharded_scenario::model<float>& m) {
    return train::make_data_parallel_step(
        c, gradapt::host{}, m.params, opt, {.lr = 1e-2, .accumulation_steps = 60}, scaler,
        train::zero_state<2>{.sharding = {.buckets = {.cap_bytes = 40000}}, .allow_empty_shards = true});
  };
  const auto advance = [](auto& step, sharded_scenario::model<float>& m, int rank, int k0, int k1,
                          bool same) {
    for (int k = k0; k <= k1; ++k) {
      m.make_grads(rank, k, same);
      for (auto& g : m.g)
        for (auto& x : g) x *= static_cast<float>(step.loss_scale());
      for (std::size_t t = m.params.size(); t-- > 0;) step.mark_ready(t);
      step.step();
    }
  };
  const auto flat = [](const sharded_scenario::model<float>& m) {
    std::vector<float> v;
    for (const auto& t : m.p) v.insert(v.end(), t.begin(), t.end());
    return v;
  };
  for (int n = 1; n <= w; ++n) {
    mpi old_world = world.split(me < n ? 0 : 1, me);
    std::vector<std::byte> mine;
    std::vector<float> params;
    if (me < n) {
      sharded_scenario::model<float> a;
      auto step = make(old_world, a);
      advance(step, a, me, 1, 3, true);
      mine = step.save();
      params = flat(a);
    }
    std::vector<std::vector<std::byte>> files(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      auto& f = files[static_cast<std::size_t>(r)];
      unsigned long long size = me == r ? mine.size() : 0;
      MPI_Bcast(&size, 1, MPI_UNSIGNED_LONG_LONG, r, MPI_COMM_WORLD);
      f = me == r ? mine : std::vector<std::byte>(size);
      MPI_Bcast(f.data(), static_cast<int>(size), MPI_BYTE, r, MPI_COMM_WORLD);
    }
    unsigned long long count = params.size();
    MPI_Bcast(&count, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    params.resize(count);
    MPI_Bcast(params.data(), static_cast<int>(count), MPI_FLOAT, 0, MPI_COMM_WORLD);
    for (int m = 1; m <= w; ++m) {
      INFO(n << " -> " << m << " ranks");
      mpi new_world = world.split(me < m ? 0 : 1, me);
      bool same_state = true, same_after = true;
      int accumulation = 0;
      if (me < m) {
        sharded_scenario::model<float> ref, got;
        auto reference = make(new_world, ref);
        advance(reference, ref, me, 1, 3, true);
        same_state = flat(ref) == params;
        std::size_t at = 0;
        for (auto& t : got.p) {
          std::copy(params.begin() + static_cast<std::ptrdiff_t>(at),
                    params.begin() + static_cast<std::ptrdiff_t>(at + t.size()), t.begin());
          at += t.size();
        }
        auto resumed = make(new_world, got);
        resumed.restore([&](int r) { return std::span<const std::byte>(files[static_cast<std::size_t>(r)]); },
                        train::rescale_rule::keep_global_batch);
        accumulation = resumed.settings().accumulation_steps;
        reference.settings() = resumed.settings();
        advance(reference, ref, me, 4, 6, false);
        advance(resumed, got, me, 4, 6, false);
        same_after = flat(ref) == flat(got) && reference.save() == resumed.save();
      }
      if (me < m) {
        CHECK(same_state);
        CHECK(accumulation == 60 * n / m);
        CHECK(same_after);
      }
    }
  }
}

TEST_CASE("mpi: rank_batches weight the mean by examples; every rank reads every rank's times",
          "[mpi][train][elastic]") {
  mpi comm;
  const int n = comm.size(), me = comm.rank();
  namespace train = gradapt::train;
  // Rank r holds the mean of r + 1 examples whose gradient is (r + 1) · 0.5 in every element
  // (exact in float): the example-weighted mean is Σ (r+1)² · 0.5 / Σ (r+1).
  std::vector<double> batches;
  double num = 0, den = 0;
  for (int r = 0; r < n; ++r) {
    batches.push_back(r + 1.0);
    num += (r + 1.0) * (r + 1.0) * 0.5;
    den += r + 1.0;
  }
  std::vector<float> p(16, 0.0f), g(16, 0.0f);
  gradapt::param_list<float, float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  auto step = train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd({.lr = 1.0}),
                                             {.lr = 1.0, .rank_batches = batches});
  std::fill(g.begin(), g.end(), static_cast<float>((me + 1) * 0.5));
  const auto& m = step.step({.ready_seconds = 0.125 * me});
  CHECK(m.global_batch == den);
  for (const float x : p) CHECK(std::fabs(-double(x) - num / den) <= 1e-6 * (num / den));
  std::vector<float> lo = p, hi = p;
  MPI_Allreduce(MPI_IN_PLACE, lo.data(), 16, MPI_FLOAT, MPI_MIN, comm.native());
  MPI_Allreduce(MPI_IN_PLACE, hi.data(), 16, MPI_FLOAT, MPI_MAX, comm.native());
  CHECK(lo == hi);
  REQUIRE(step.rank_times().size() == static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) CHECK(step.rank_times()[static_cast<std::size_t>(r)] == 0.125 * r);
  step.step({.ready_seconds = 1.0});
  REQUIRE(step.rank_step_seconds().size() == static_cast<std::size_t>(n));
  // rank_batches that differ on the last rank: an error on every rank.
  if (n > 1) {
    if (me == n - 1) step.settings().rank_batches.back() += 1.0;
    CHECK_THROWS_WITH(step.step(), Catch::Matchers::Contains("rank_batches"));
  }
}

namespace {
// Proposes lr = 0.5 after every step on the ranks it is told to (all, or the last only).
struct propose_lr {
  bool last_only = false;
  void after_step(const gradapt::elastic::job_view& v, gradapt::elastic::job_action& a) const {
    if (!last_only || v.rank == v.ranks - 1) a.lr = 0.5;
  }
};
}  // namespace

TEST_CASE("mpi: an adaptive_job's vote applies an agreed action everywhere and rejects a partial one",
          "[mpi][elastic]") {
  mpi comm;
  namespace train = gradapt::train;
  std::vector<float> p(4, 1.0f), g(4, 0.25f);
  gradapt::param_list<float, float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  auto step =
      train::make_data_parallel_step(comm, gradapt::host{}, params, gradapt::sgd({.lr = 0.1}), {.lr = 0.1});
  {
    gradapt::elastic::adaptive_job job(step, propose_lr{});
    job.step();
    CHECK(step.settings().lr == 0.5);
    CHECK(job.step().lr == 0.5);
  }
  if (comm.size() > 1) {
    step.settings().lr = 0.1;
    gradapt::elastic::adaptive_job job(step, propose_lr{.last_only = true});
    CHECK_THROWS_WITH(job.step(), Catch::Matchers::Contains("job_action::lr"));
    CHECK(step.settings().lr == 0.1);  // nothing applied, on any rank
  }
}

}  // namespace gradapt_test_mpi_train_step

// The Shampoo family (Shampoo, SOAP, Muon) in the sharded optimizer, sharded by block, on
// comm::threads: each rank holds the rows of blocks of its shard, and after every step the
// parameters equal the unsharded chain's bit for bit on the same averaged gradients (1, 2, 3
// and 5 ranks; element, unit and tensor granularity); the ranks' state elements add up to the
// unsharded state's exactly (every block and element held once); a checkpoint saved on N ranks
// loads on M ranks and continues bit for bit as the unsharded run; every bit flip of a checkpoint
// and a damaged statistic behind a valid checksum are rejected; a block whose roots fail on one
// rank is an error on every rank; the partition's unit cuts.
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bit_flips.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "rank_check.hpp"
#include "sanitizer.hpp"
#include "scenarios/sharded.hpp"

namespace gradapt_test_shard_shampoo {

using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using gradapt::shard::granularity;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;
using sharded_scenario::model;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(60)};

const std::vector<int> worlds =
    gradapt_test::under_sanitizer ? std::vector<int>{3} : std::vector<int>{1, 2, 3, 5};

/// Shampoo with blocks of 16 (w0 [33, 129]: 3 rows of 9 blocks; w6 [130, 70]: 9 rows of 5),
/// roots at steps 2, 4, 6, a first moment, AdaGrad grafting, momentum, weight decay and
/// 1-D tensors preconditioned as well.
gradapt::shampoo shampoo() {
  return gradapt::shampoo({.lr = 2e-2,
                           .max_preconditioner_dim = 16,
                           .precondition_frequency = 2,
                           .start_preconditioning_step = 2,
                           .beta1 = 0.9,
                           .precondition_1d = true,
                           .graft = gradapt::shampoo_graft::adagrad,
                           .momentum = 0.9,
                           .weight_decay = 1e-3});
}

/// SOAP with QR refreshes every 2 steps, blocks of 16.
gradapt::shampoo soap() {
  gradapt::shampoo_options o = gradapt::soap_defaults();
  o.lr = 1e-2;
  o.max_preconditioner_dim = 16;
  o.precondition_frequency = 2;
  o.start_preconditioning_step = 2;
  o.root.epsilon = 1e-8;
  return gradapt::shampoo(o);
}

/// Muon (spectral descent on 2-D blocks of 16, Adam for the rest), Nesterov momentum.
gradapt::shampoo muon() {
  gradapt::shampoo_options o = gradapt::spectral_descent_defaults();
  o.lr = 2e-2;
  o.max_preconditioner_dim = 16;
  o.scale_by_aspect = true;
  o.graft = gradapt::shampoo_graft::adam;
  o.momentum = 0.9;
  o.nesterov = true;
  return gradapt::shampoo(o);
}

const sharded_options element_cut{};  // for a Shampoo chain: unit cuts at its rows of blocks
const sharded_options tensor_cut{.partition = {.mode = granularity::tensor}};
const sharded_options stage2_small{.partition = {.mode = granularity::unit},
                                   .buckets = {.cap_bytes = 20000, .first_cap_bytes = 8000}};

/// The state elements of every rank added up.
template <class S>
double total_elements(threads& comm, const S& s) {
  std::vector<double> n{static_cast<double>(s.shard_state().state_elements())};
  comm.allreduce(gradapt::host_view(n), gradapt::reduce_op::sum);
  return n[0];
}

}  // namespace

TEST_CASE("the Shampoo family sharded by block equals the unsharded chain bit for bit", "[shard][shampoo]") {
  const gradapt::host b;
  for (const auto& member : {std::pair{"shampoo", shampoo()}, {"soap", soap()}, {"muon", muon()}}) {
    const char* name = member.first;
    const gradapt::shampoo& opt = member.second;  // a reference the lambdas below can capture
    std::size_t whole = 0;
    {
      model<float> m;
      whole = opt.init(b, m.params).state_elements();
    }
    for (const auto* so : {&element_cut, &tensor_cut})
      for (const int n : worlds) {
        INFO(name << " on " << n << " ranks, " << gradapt::shard::name(so->partition.mode));
        run_threads(n, quick, [&](threads& comm) {
          sharded_scenario::matches_unsharded<float>(comm, opt, *so, 6);
          model<float> m;
          const sharded_optimizer sopt(opt, *so);
          const auto s = sopt.init(comm, b, m.params);
          const double all = total_elements(comm, s);
          RANK_CHECK(all == static_cast<double>(whole));
          RANK_CHECK(s.state_bytes() == s.shard_state().state_elements() * sizeof(float));
          // Every piece starts at a row of blocks (or a tensor's start).
          for (const auto& q : s.plan().pieces(comm.rank())) {
            const std::size_t g = opt.stage<0>().shard_grain(m.params[q.tensor].value.shape());
            RANK_CHECK(q.offset % g == 0);
          }
        });
      }
  }
}

TEST_CASE("the Shampoo family sharded by block: stage 2 buckets, marks in any order", "[shard][shampoo]") {
  for (const int n : worlds) {
    INFO(n << " ranks");
    run_threads(n, quick, [&](threads& comm) {
      sharded_scenario::stage2_matches_unsharded<float>(comm, shampoo(), stage2_small, 4);
    });
  }
}

namespace {

/// Steps 1..3 sharded on `from` ranks, saved; loaded on `to` ranks, steps 4..7 (roots at 4
/// and 6); against the unsharded chain's 7 steps (the same gradients on every rank).
template <class Opt>
void reshard(const Opt& opt, const sharded_options& so, int from, int to, bool in_flight = false) {
  const gradapt::host b;
  model<float> ref;
  auto rst = opt.init(b, ref.params);
  for (int k = 1; k <= 7; ++k) {
    ref.make_grads(0, k, true);
    opt.step(b, ref.params, rst);
  }
  std::vector<std::vector<std::byte>> saved(static_cast<std::size_t>(from));
  std::vector<std::vector<float>> at3;
  std::mutex mu;
  const sharded_optimizer<Opt> sopt(opt, so);
  run_threads(from, quick, [&](threads& comm) {
    model<float> m;
    auto s = sopt.init(comm, b, m.params);
    for (int k = 1; k <= 3; ++k) {
      m.make_grads(comm.rank(), k, true);
      sopt.step(comm, b, m.params, s);
    }
    RANK_CHECK((s.shard_state().preconditioner().roots_in_flight() == 3) == in_flight);
    saved[static_cast<std::size_t>(comm.rank())] = s.save(b);
    const std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) at3 = m.p;
  });
  run_threads(to, quick, [&](threads& comm) {
    model<float> m;
    m.p = at3;
    auto s = sopt.load(comm, b, m.params, [&](int r) {
      return std::span<const std::byte>(saved.at(static_cast<std::size_t>(r)));
    });
    RANK_REQUIRE(s.steps() == 3);
    for (int k = 4; k <= 7; ++k) {
      m.make_grads(comm.rank(), k, true);
      sopt.step(comm, b, m.params, s);
    }
    for (std::size_t t = 0; t < ref.p.size(); ++t) RANK_CHECK(sharded_scenario::same_bits(ref.p[t], m.p[t]));
  });
}

}  // namespace

TEST_CASE("the Shampoo family sharded by block: saved on N ranks, loaded on M, continues bit for bit",
          "[shard][shampoo]") {
  // Under a sanitizer (about 10 times slower) two of the four world pairs.
  const std::vector<std::pair<int, int>> pairs =
      gradapt_test::under_sanitizer ? std::vector<std::pair<int, int>>{{2, 3}, {5, 2}}
                                    : std::vector<std::pair<int, int>>{{2, 3}, {3, 1}, {1, 5}, {5, 2}};
  for (const auto& [from, to] : pairs) {
    INFO("from " << from << " to " << to);
    reshard(shampoo(), element_cut, from, to);
    reshard(soap(), element_cut, from, to);
    reshard(muon(), element_cut, from, to);
  }
  reshard(shampoo(), tensor_cut, 3, 2);
}

TEST_CASE("the Shampoo family sharded by block: roots in flight are saved and restarted",
          "[shard][shampoo]") {
  gradapt::shampoo_options o = shampoo().options();
  o.root_staleness = 1;  // roots from step 3's statistics installed at step 4: in flight at the save
  o.precondition_frequency = 3;
  o.start_preconditioning_step = 3;
  reshard(gradapt::shampoo(o), element_cut, 2, 3, true);
}

TEST_CASE("the Shampoo family sharded by block: a failing block throws on every rank", "[shard][shampoo]") {
  run_threads(3, quick, [&](threads& comm) {
    const gradapt::host b;
    model<float> m;
    gradapt::shampoo_options o = shampoo().options();
    o.max_consecutive_failures = 1;
    const sharded_optimizer sopt(gradapt::shampoo(o), element_cut);
    auto s = sopt.init(comm, b, m.params);
    m.make_grads(comm.rank(), 1, true);
    sopt.step(comm, b, m.params, s);
    m.make_grads(comm.rank(), 2, true);
    // Only the rank that holds w0's first row of blocks sees a non-finite gradient there; the
    // mean carries it into that block's statistics, whose roots fail at step 2.
    const int owner = s.plan().owner(0, 0);
    if (comm.rank() == owner) gradapt::store(m.g[0][0], std::numeric_limits<float>::infinity());
    // The owner names the block; every other rank names the owner.
    const std::string expected = comm.rank() == owner
                                     ? "parameter 'w0' block 0 (indices"
                                     : "step on rank " + std::to_string(comm.rank()) + ": rank " +
                                           std::to_string(owner) + " passed invalid input";
    RANK_REQUIRE_THROWS_WITH(sopt.step(comm, b, m.params, s), Contains(expected));
  });
}

TEST_CASE("the Shampoo family sharded by block: every bit flip and a damaged block are rejected",
          "[shard][shampoo][checkpoint]") {
  // w [6, 5] in blocks of 4: two rows of blocks (units of 20 and 10 elements); SOAP keeps
  // eigenbases and V besides the statistics.
  // Under a sanitizer SOAP only (its archive holds every field kind Shampoo's does, and more).
  const std::vector<bool> members =
      gradapt_test::under_sanitizer ? std::vector<bool>{true} : std::vector<bool>{false, true};
  for (const bool corrected : members) {
    INFO((corrected ? "soap" : "shampoo"));
    gradapt::shampoo_options o = corrected ? gradapt::soap_defaults() : gradapt::shampoo_options{};
    o.lr = 0.02;
    o.max_preconditioner_dim = 4;
    o.beta1 = 0.9;
    o.root.epsilon = 1e-6;
    const sharded_optimizer opt(gradapt::shampoo(o), element_cut);
    gradapt::comm::single comm;
    const gradapt::host b;
    gradapt::param_list<float> params;
    std::vector<float> w(30, 0.5f), gw(30), bias(5, 0.1f), gb(5);
    params.add("w", gradapt::tensor_view<float>(w.data(), {6, 5}),
               gradapt::tensor_view<float>(gw.data(), {6, 5}));
    params.add("bias", gradapt::host_view(bias), gradapt::host_view(gb));
    auto st = opt.init(comm, b, params);
    for (int k = 1; k <= 3; ++k) {
      for (std::size_t i = 0; i < gw.size(); ++i) gw[i] = std::sin(0.7f * float(i) + float(k));
      for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = std::cos(0.3f * float(i) * float(k));
      opt.step(comm, b, params, st);
    }
    const auto good = st.save(b);
    const std::size_t n = gradapt_test::flip_every_bit(
        good,
        [&](std::span<const std::byte> bad) { st = opt.load(comm, b, params, [&](int) { return bad; }); },
        [&] { return st.save(b); });
    CHECK(n == gradapt_test::flips_for(good.size()));
    // Behind a valid checksum: block 0's first statistic made asymmetric.
    const auto stat = st.shard_state().preconditioner().statistic(0, 0, 0);
    REQUIRE(stat.size() == 16);
    const auto bytes = std::as_bytes(stat);
    const auto at = std::search(good.begin(), good.end(), bytes.begin(), bytes.end());
    REQUIRE(at != good.end());
    std::vector<std::byte> bad = good;
    const float off = stat[1] + 1.0f;
    std::memcpy(bad.data() + (at - good.begin()) + 4, &off, 4);
    gradapt_test::reseal(bad);
    CHECK_THROWS_WITH(opt.load(comm, b, params, [&](int) { return std::span<const std::byte>(bad); }),
                      Contains("statistic 0 of parameter 'w'") && Contains("block 0"));
  }
}

TEST_CASE("unit granularity: contiguous runs of units, cut only at each tensor's grain", "[shard]") {
  using gradapt::shard::partition_plan;
  const std::vector<std::size_t> sizes{100, 7, 0, 64};
  const std::vector<std::size_t> grains{30, 0, 5, 16};  // 4 units of w0 (the last 10), w1 whole
  for (int n = 1; n <= 6; ++n) {
    INFO(n << " ranks");
    const auto p = partition_plan::make(sizes, n, {.mode = granularity::unit}, grains);
    std::vector<std::size_t> covered(sizes.size(), 0);
    int last = -1;
    std::size_t last_tensor = 0;
    std::size_t most = 0;
    for (int r = 0; r < n; ++r) {
      most = std::max(most, p.shard_size(r));
      std::size_t pos = 0;
      for (const auto& q : p.pieces(r)) {
        CHECK(q.shard_offset == pos);
        pos += q.length;
        CHECK(q.offset % (grains[q.tensor] == 0 ? sizes[q.tensor] : grains[q.tensor]) == 0);
        const std::size_t end = q.offset + q.length;
        CHECK((end == sizes[q.tensor] || (grains[q.tensor] != 0 && end % grains[q.tensor] == 0)));
        CHECK(q.offset == covered[q.tensor]);  // in list order, rank by rank: contiguous runs
        covered[q.tensor] = end;
        CHECK((q.tensor > last_tensor || r >= last));
        last = r;
        last_tensor = q.tensor;
      }
    }
    CHECK(covered == sizes);
    CHECK(most <= 171 / static_cast<std::size_t>(n) + 30);  // total / N plus one unit
    CHECK(p.shard_capacity() == most);
    CHECK_THROWS_WITH(partition_plan::make(sizes, n, {.mode = granularity::unit}),
                      Contains("unit granularity with 0 grain(s) for 4 tensor(s)"));
  }
  CHECK_THROWS_WITH(gradapt::shard::sharded_optimizer(gradapt::sgd({.lr = 0.1}),
                                                      {.partition = {.mode = granularity::unit}}),
                    Contains("partition_options::mode is unit") && Contains("this chain has none"));
}

}  // namespace gradapt_test_shard_shampoo

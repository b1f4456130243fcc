// The sharded optimizer on comm::threads, 1 to 8 ranks (1, 2, 5 and 8 under a sanitizer): every chain
// optimizer gives bitwise the unsharded optimizer's parameters on the same averaged gradients, under element
// and tensor granularity; float master values for bfloat16 parameters; checkpoints saved on N ranks load on M
// ranks and continue bitwise as the unsharded run; per-rank state bytes against the plan; every error on
// every rank.
#include "catch.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "sanitizer.hpp"
#include "scenarios/sharded.hpp"

using Catch::Matchers::Contains;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using gradapt::shard::granularity;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;
using sharded_scenario::model;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(20)};

const sharded_options element_cut{};  // element granularity, 4096-aligned cuts
const sharded_options tensor_cut{.partition = {.mode = granularity::tensor}};
// Small rounds, so the reduce-scatter and allgather take several rounds.
const sharded_options element_small_rounds{.bucket_elements = 1000};

/// A user chain with a global barrier: clip by global norm, Adam, weight decay, lr.
using clip_adam_chain =
    gradapt::chain<gradapt::transform::clip_by_global_norm, gradapt::transform::scale_by_adam,
                   gradapt::transform::add_decayed_weights, gradapt::transform::scale_by_learning_rate>;
clip_adam_chain clip_adam() {
  return clip_adam_chain{gradapt::transform::clip_by_global_norm{.max_norm = 5.0},
                         gradapt::transform::scale_by_adam{},
                         gradapt::transform::add_decayed_weights{.weight_decay = 0.01},
                         gradapt::transform::scale_by_learning_rate{.lr = 1e-2}};
}

/// Whether a world of n ranks (up to `most`) runs: every one, or under a sanitizer (which
/// repeats the same code on each) 1, 2, 5 and `most`.
bool runs_world(int n, int most) {
  return !gradapt_test::under_sanitizer || n == 1 || n == 2 || n == 5 || n == most;
}

/// 1 to 8 ranks, parameters of type V. Double for the chains with barrier stages: there the
/// last bits of an assembled sum reach the parameters (float rounds most of them away); the
/// element-wise chains are exact either way, and each (chain, type) pair costs compile time.
template <class V, class Opt>
void all_ranks(const Opt& opt, const sharded_options& so, int steps = 3, int max_ranks = 8) {
  for (int n = 1; n <= max_ranks; ++n) {
    if (!runs_world(n, max_ranks)) continue;
    INFO("ranks " << n);
    run_threads(n, quick,
                [&](threads& comm) { sharded_scenario::matches_unsharded<V>(comm, opt, so, steps); });
  }
}

}  // namespace

TEST_CASE(
    "sharded SGD, AdamW, LAMB, LARS and a clipping chain equal the unsharded step (element granularity)",
    "[shard]") {
  all_ranks<float>(gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}), element_cut);
  all_ranks<float>(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), element_cut);
  all_ranks<double>(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), element_cut);
  all_ranks<float>(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), element_cut);
  all_ranks<double>(gradapt::lars({.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9}), element_cut);
  all_ranks<double>(clip_adam(), element_cut);
  all_ranks<float>(clip_adam(), element_cut);
  all_ranks<double>(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), element_small_rounds, 2);
}

TEST_CASE("sharded optimizers equal the unsharded step under tensor granularity, Adafactor and SM3 included",
          "[shard]") {
  all_ranks<float>(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), tensor_cut);
  all_ranks<float>(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), tensor_cut);
  all_ranks<double>(gradapt::lars({.lr = 0.1, .momentum = 0.9}), tensor_cut);
  all_ranks<double>(clip_adam(), tensor_cut);
  all_ranks<float>(gradapt::adafactor({.lr = 1e-2}), tensor_cut);
  all_ranks<float>(gradapt::sm3({.lr = 0.1, .momentum = 0.9}), tensor_cut);
}

TEST_CASE("stage 2: buckets reduce-scattered as each rank marks its gradients, in any order", "[shard]") {
  // Small buckets (several per step) and the default (one or two here).
  const sharded_options small{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  const sharded_options small_tensor{.partition = {.mode = granularity::tensor},
                                     .buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  for (int n = 1; n <= 8; ++n) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& comm) {
      sharded_scenario::stage2_matches_unsharded<double>(
          comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), small, 3);
      sharded_scenario::stage2_matches_unsharded<float>(comm, gradapt::adamw({.lr = 1e-2}), element_cut, 2);
      sharded_scenario::stage2_matches_unsharded<float>(comm, gradapt::adafactor({.lr = 1e-2}), small_tensor,
                                                        2);
    });
  }
}

TEST_CASE("stage 2 errors: a gradient marked twice or out of range, a step before every mark", "[shard]") {
  run_threads(2, quick, [](threads& comm) {
    const gradapt::host b;
    model<float> m;
    const sharded_optimizer opt(gradapt::adamw({}), element_cut);
    auto s = opt.init(comm, b, m.params);
    m.make_grads(comm.rank(), 1);
    RANK_REQUIRE_THROWS_WITH(opt.mark_ready(comm, gradapt::host{}, m.params, s, 8),
                             Contains("gradient 8 is out of range (8 gradients)"));
    for (std::size_t t = 0; t < 8; ++t) opt.mark_ready(comm, gradapt::host{}, m.params, s, t);
    opt.step(comm, b, m.params, s);
    opt.mark_ready(comm, gradapt::host{}, m.params, s, 3);
    RANK_REQUIRE_THROWS_WITH(opt.mark_ready(comm, gradapt::host{}, m.params, s, 3),
                             Contains("'w3') is already marked ready"));
  });
  const auto what = gradapt_test::errors_of(1, quick, [](threads& comm) {
    const gradapt::host b;
    model<float> m;
    const sharded_optimizer opt(gradapt::adamw({}), element_cut);
    auto s = opt.init(comm, b, m.params);
    opt.mark_ready(comm, gradapt::host{}, m.params, s, 0);
    opt.step(comm, b, m.params, s);
  });
  CHECK_THAT(what[0], Contains("gradient 1 ('w1') was not marked ready in this round"));
}

TEST_CASE("float master values for bfloat16 parameters equal the unsharded float chain, rounded", "[shard]") {
  for (int n : {1, 3, 4}) {
    run_threads(n, quick, [&](threads& comm) {
      sharded_scenario::master_matches_unsharded(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
                                                 element_cut, 3);
      sharded_scenario::master_matches_unsharded(comm, gradapt::adamw({.lr = 1e-2}), tensor_cut, 2);
    });
  }
}

TEST_CASE("per-rank state bytes follow the plan: shard elements times the state's bytes per element",
          "[shard]") {
  for (int n : {1, 2, 4, 8}) {
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({}), element_cut);
      auto s = opt.init(comm, b, m.params);
      const std::size_t shard = s.plan().shard_size(comm.rank());
      RANK_REQUIRE(s.state_bytes() == 2 * sizeof(float) * shard);  // m and v
      RANK_REQUIRE(s.gradient_bytes() == sizeof(float) * s.plan().shard_capacity());
      RANK_REQUIRE(s.plan().shard_capacity() <=
                   (m.params.total_elements() + 8 * 4096) / static_cast<std::size_t>(n) + 4096);
    });
  }
}

namespace {

/// Steps 1..2 sharded on `from` ranks, saved; loaded on `to` ranks, steps 3..4; against the
/// unsharded optimizer's 4 steps (gradients equal on every rank, so the mean is the same for
/// any world size).
template <class Opt>
void reshard(const Opt& opt, const sharded_options& so, int from, int to) {
  const gradapt::host b;
  model<float> ref;
  auto rst = opt.init(b, ref.params);
  for (int k = 1; k <= 4; ++k) {
    ref.make_grads(0, k, true);
    opt.step(b, ref.params, rst);
  }
  std::vector<std::vector<std::byte>> saved(static_cast<std::size_t>(from));
  std::vector<std::vector<float>> after_two;
  std::mutex mu;
  const sharded_optimizer<Opt> sopt(opt, so);
  run_threads(from, quick, [&](threads& comm) {
    model<float> m;
    auto s = sopt.init(comm, b, m.params);
    for (int k = 1; k <= 2; ++k) {
      m.make_grads(comm.rank(), k, true);
      sopt.step(comm, b, m.params, s);
    }
    saved[static_cast<std::size_t>(comm.rank())] = s.save(b);
    const std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) after_two = m.p;
  });
  std::atomic<int> bad_reads{0};
  run_threads(to, quick, [&](threads& comm) {
    model<float> m;
    m.p = after_two;  // the parameters every rank holds after step 2 (same sizes: views stay valid)
    std::set<int> read;
    auto s = sopt.load(comm, b, m.params, [&](int r) {
      read.insert(r);
      return std::span<const std::byte>(saved.at(static_cast<std::size_t>(r)));
    });
    RANK_REQUIRE(s.steps() == 2);
    // Only archives that overlap this rank's new shard (and rank 0's, for the plan) are read.
    for (const int r : read) {
      if (r == 0) continue;
      bool overlaps = false;
      const auto old = [&] {
        std::vector<std::size_t> sz;
        for (std::size_t t = 0; t < s.plan().tensors(); ++t) sz.push_back(s.plan().tensor_size(t));
        return gradapt::shard::partition_plan::make(sz, from, so.partition);
      }();
      for (const auto& q : old.pieces(r))
        for (const auto& p : s.plan().pieces(comm.rank()))
          overlaps = overlaps || (q.tensor == p.tensor && q.offset < p.offset + p.length &&
                                  p.offset < q.offset + q.length);
      if (!overlaps) ++bad_reads;
    }
    for (int k = 3; k <= 4; ++k) {
      m.make_grads(comm.rank(), k, true);
      sopt.step(comm, b, m.params, s);
    }
    for (std::size_t t = 0; t < ref.p.size(); ++t)
      RANK_REQUIRE(sharded_scenario::same_bits(ref.p[t], m.p[t]));
  });
  REQUIRE(bad_reads.load() == 0);
}

}  // namespace

TEST_CASE("a state saved on N ranks loads on M ranks and continues bitwise as the unsharded run", "[shard]") {
  const auto lamb = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
  for (int from = 1; from <= 8; ++from)
    for (int to = 1; to <= 8; ++to) {
      if (!runs_world(from, 8) || !runs_world(to, 8)) continue;
      INFO("from " << from << " to " << to);
      reshard(lamb, element_cut, from, to);
    }
  reshard(gradapt::adafactor({.lr = 1e-2}), tensor_cut, 3, 5);
  reshard(gradapt::adafactor({.lr = 1e-2}), tensor_cut, 8, 2);
  reshard(gradapt::sgd({.lr = 0.05, .momentum = 0.9}), tensor_cut, 4, 7);
  reshard(clip_adam(), element_small_rounds, 5, 3);
}

TEST_CASE("factored statistics (Adafactor's rows and columns, SM3's covers) save and load on any world size",
          "[shard]") {
  // min_dim_size_to_factor 5 factors w0 [33, 129], w3 [64, 64] and w6 [130, 70] (not w5 [3, 5]);
  // SM3 keeps covers for every matrix. Saved on 1 to 3 ranks, loaded on 1 to 4.
  const auto small_threshold = gradapt::adafactor({.lr = 1e-2, .min_dim_size_to_factor = 5});
  const auto sm3 = gradapt::sm3({.lr = 0.1, .momentum = 0.9});
  for (const auto& [from, to] : {std::pair{1, 1}, {1, 4}, {2, 3}, {3, 1}}) {
    INFO("from " << from << " to " << to);
    reshard(small_threshold, tensor_cut, from, to);
    reshard(sm3, tensor_cut, from, to);
  }
}

TEST_CASE("a factored tensor at Adafactor's defaults saves, loads, and continues bitwise", "[shard]") {
  // [256, 130] factors at the default min_dim_size_to_factor (128); [7, 13] does not.
  for (const int n : {1, 2}) {
    INFO("ranks " << n);
    std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(n));
    run_threads(n, quick, [&](threads& comm) {
      const gradapt::host b;
      const std::vector<std::vector<std::int64_t>> shapes{{256, 130}, {7, 13}};
      std::vector<std::vector<float>> p(2), g(2), q(2);
      gradapt::param_list<float, float> a, c;
      for (std::size_t t = 0; t < 2; ++t) {
        const auto len = static_cast<std::size_t>(shapes[t][0] * shapes[t][1]);
        p[t].resize(len);
        g[t].resize(len);
        for (std::size_t i = 0; i < len; ++i)
          p[t][i] = static_cast<float>((i * 37 + t * 11) % 101) / 50.0f - 1.0f;
        a.add("w" + std::to_string(t), gradapt::tensor_view<float>(p[t].data(), shapes[t]),
              gradapt::tensor_view<float>(g[t].data(), shapes[t]));
      }
      const sharded_optimizer opt(gradapt::adafactor({.lr = 1e-2}), tensor_cut);
      auto s = opt.init(comm, b, a);
      const auto fill = [&](int k) {
        for (std::size_t t = 0; t < 2; ++t)
          for (std::size_t i = 0; i < g[t].size(); ++i)
            g[t][i] =
                static_cast<float>((i * 13 + static_cast<std::size_t>(k) * 7 + t) % 29) / 16.0f - 0.875f;
      };
      for (int k = 1; k <= 2; ++k) {
        fill(k);
        opt.step(comm, b, a, s);
      }
      all[static_cast<std::size_t>(comm.rank())] = s.save(b);
      comm.barrier();  // every rank's archive written before any is read
      q = p;
      for (std::size_t t = 0; t < 2; ++t)
        c.add("w" + std::to_string(t), gradapt::tensor_view<float>(q[t].data(), shapes[t]),
              gradapt::tensor_view<float>(g[t].data(), shapes[t]));
      auto restored = opt.load(
          comm, b, c, [&](int r) { return std::span<const std::byte>(all.at(static_cast<std::size_t>(r))); });
      RANK_REQUIRE(restored.steps() == 2);
      for (int k = 3; k <= 4; ++k) {
        fill(k);
        opt.step(comm, b, a, s);
        opt.step(comm, b, c, restored);
      }
      for (std::size_t t = 0; t < 2; ++t) RANK_REQUIRE(sharded_scenario::same_bits(p[t], q[t]));
    });
  }
}

TEST_CASE("sharded optimizer errors: every rank throws, naming the problem", "[shard]") {
  SECTION("overlap over a communicator without a non-blocking reduce-scatter") {
    const auto what = gradapt_test::errors_of(2, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({}), sharded_options{.overlap = true});
      (void)opt.init(comm, b, m.params);
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("sharded_options::overlap needs a communicator"));
  }
  SECTION("a factored chain with a tensor cut across ranks") {
    const auto what = gradapt_test::errors_of(4, quick, [](threads& comm) {  // 4 ranks cut tensor 1
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adafactor({}), element_cut);
      (void)opt.init(comm, b, m.params);
    });
    for (const auto& w : what)
      CHECK_THAT(w, Contains("granularity::tensor") || Contains("passed invalid input"));
    CHECK_THAT(what[0], Contains("parameter 'w1' (tensor 1) is cut across ranks") &&
                            Contains("factors each tensor's rows and columns"));
  }
  SECTION("a barrier chain cut inside a tensor off the 4096-element grid") {
    const auto what = gradapt_test::errors_of(4, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::lamb({}), sharded_options{.partition = {.alignment = 64}});
      (void)opt.init(comm, b, m.params);
    });
    for (const auto& w : what) CHECK_FALSE(w.empty());
    CHECK_THAT(what[0], Contains("not a multiple of 4096"));
  }
  SECTION("ranks with different tensor sizes or options") {
    const auto what = gradapt_test::errors_of(3, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_options so{.bucket_elements = comm.rank() == 1 ? 512u : 1024u};
      const sharded_optimizer opt(gradapt::adamw({}), so);
      (void)opt.init(comm, b, m.params);
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("bucket_elements"));
    const auto lr = gradapt_test::errors_of(2, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({.b2 = comm.rank() == 0 ? 0.999 : 0.99}), element_cut);
      (void)opt.init(comm, b, m.params);
    });
    for (const auto& w : lr) CHECK_THAT(w, Contains("b2"));
  }
  SECTION("a step with another list or world than the state's") {
    run_threads(2, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({}), element_cut);
      auto s = opt.init(comm, b, m.params);
      gradapt::param_list<float> fewer;
      fewer.add("w0", m.params[0].value, m.params[0].grad);
      RANK_REQUIRE_THROWS_WITH(opt.step(comm, b, fewer, s),
                               Contains("holds 1 tensors but the state was made for 8"));
    });
    run_threads(1, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({}), element_cut);
      auto s = opt.init(comm, b, m.params);
      run_threads(2, quick, [&](threads& two) {
        RANK_REQUIRE_THROWS_WITH(opt.step(two, b, m.params, s),
                                 Contains("save and load the state on the new world"));
      });
    });
  }
  SECTION("a load whose archives belong to other parameters or steps") {
    std::vector<std::vector<std::byte>> saved(2);
    const sharded_optimizer opt(gradapt::adamw({}), element_cut);
    run_threads(2, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      auto s = opt.init(comm, b, m.params);
      m.make_grads(comm.rank(), 1);
      opt.step(comm, b, m.params, s);
      saved[static_cast<std::size_t>(comm.rank())] = s.save(b);
    });
    const auto renamed = gradapt_test::errors_of(3, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      gradapt::param_list<float> other;
      for (std::size_t t = 0; t < m.params.size(); ++t)
        other.add(t == 4 ? "renamed" : m.params[t].name, m.params[t].value, m.params[t].grad);
      (void)opt.load(comm, b, other, [&](int r) {
        return std::span<const std::byte>(saved.at(static_cast<std::size_t>(r)));
      });
    });
    bool named = false;
    for (const auto& w : renamed) {
      CHECK_FALSE(w.empty());
      named = named || w.find("'renamed'") != std::string::npos;
    }
    CHECK(named);
    const auto swapped = gradapt_test::errors_of(2, quick, [&](threads& comm) {
      const gradapt::host b;
      model<float> m;
      (void)opt.load(comm, b, m.params, [&](int r) {
        return std::span<const std::byte>(saved.at(static_cast<std::size_t>(1 - r)));
      });
    });
    for (const auto& w : swapped) CHECK_FALSE(w.empty());
    CHECK_THAT(swapped[0], Contains("holds rank 1's shard"));
  }
  SECTION("a non-finite state shard on one rank: every rank throws naming it") {
    const auto what = gradapt_test::errors_of(3, quick, [](threads& comm) {
      const gradapt::host b;
      model<float> m;
      const sharded_optimizer opt(gradapt::adamw({}), element_cut);
      auto s = opt.init(comm, b, m.params);
      m.make_grads(comm.rank(), 1);
      if (comm.rank() == 2) m.g[1][0] = 3e38f;  // the mean stays finite; v = g² overflows on its owner
      opt.step(comm, b, m.params, s);
    });
    for (const auto& w : what) CHECK_THAT(w, Contains("non-finite"));
  }
}

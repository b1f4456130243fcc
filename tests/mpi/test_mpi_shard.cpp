// The sharded optimizer over comm::mpi (1 to 5 ranks): every chain optimizer, stage 2's buckets
// and bfloat16 with float master values equal the unsharded chain bit for bit (the scenarios
// shared with the threads tests, tests/support/scenarios/sharded.hpp), on random gradients with
// full mantissas. What the unsharded chain is fed is what comm::mpi promises
// (docs/algorithms/sharded-state.md, "Which bits are promised"): on 1 or 2 ranks the allreduce
// mean (one addition per element, the same bits in any order); on 3 or more ranks the mean the
// sharded step's own reduce-scatter computed, after checking that every element of it is the
// ranks' gradients added in some order and divided by N, since MPI_Reduce_scatter_block and
// MPI_Allreduce may add in different orders. A state saved on k ranks (a split of the world)
// loads on all ranks, and the reverse, continuing bitwise as the unsharded run. Stage 2 with
// overlap (non-blocking reduce-scatters completed in step) matches as stage 2 does.
// Archives travel through files, as checkpoints do.
#include <unistd.h>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "scenarios/sharded.hpp"

using gradapt::shard::granularity;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;

namespace {

const sharded_options element_cut{};
const sharded_options tensor_cut{.partition = {.mode = granularity::tensor}};

using clip_adam_chain =
    gradapt::chain<gradapt::transform::clip_by_global_norm, gradapt::transform::scale_by_adam,
                   gradapt::transform::add_decayed_weights, gradapt::transform::scale_by_learning_rate>;
clip_adam_chain clip_adam() {
  return clip_adam_chain{gradapt::transform::clip_by_global_norm{.max_norm = 5.0},
                         gradapt::transform::scale_by_adam{},
                         gradapt::transform::add_decayed_weights{.weight_decay = 0.01},
                         gradapt::transform::scale_by_learning_rate{.lr = 1e-2}};
}

/// The mean comm::mpi promises the sharded step matches bit for bit (see the file comment).
sharded_scenario::mean_from promised_mean(const gradapt::comm::mpi& comm) {
  return comm.size() <= 2 ? sharded_scenario::mean_from::allreduce
                          : sharded_scenario::mean_from::sharded_step;
}

/// A directory name every rank agrees on (rank 0's process id).
std::string shared_prefix(gradapt::comm::mpi& comm) {
  std::vector<double> id{static_cast<double>(::getpid())};
  comm.broadcast(gradapt::host_view(id), 0);
  return "/tmp/gradapt_mpi_shard_" + std::to_string(static_cast<long long>(id[0])) + "_";
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) b[i] = static_cast<std::byte>(c[i]);
  return b;
}

void write_file(const std::string& path, const std::vector<std::byte>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  REQUIRE(f.good());
}

/// Steps 1..2 on `saver` (a communicator of some ranks, or none on the others), saved to
/// files; every rank of `loader` loads them and steps 3..4; against the unsharded 4 steps.
template <class V, class Opt>
void reshard(gradapt::comm::mpi& world, const Opt& opt, const sharded_options& so, bool save_on_split,
             int k) {
  const gradapt::host b;
  sharded_scenario::model<V> ref;
  auto rst = opt.init(b, ref.params);
  for (int s = 1; s <= 4; ++s) {
    ref.make_grads(0, s, true);
    opt.step(b, ref.params, rst);
  }
  const std::string prefix = shared_prefix(world) + std::to_string(k) + (save_on_split ? "s_" : "w_");
  const bool in_split = world.rank() < k;
  gradapt::comm::mpi part = world.split(in_split ? 0 : 1, world.rank());
  const sharded_optimizer<Opt> sopt(opt, so);
  std::vector<std::vector<V>> after_two;
  gradapt::comm::mpi& saver = save_on_split ? part : world;
  if (!save_on_split || in_split) {
    sharded_scenario::model<V> m;
    auto s = sopt.init(saver, b, m.params);
    for (int step = 1; step <= 2; ++step) {
      m.make_grads(saver.rank(), step, true);
      sopt.step(saver, b, m.params, s);
    }
    write_file(prefix + std::to_string(saver.rank()), s.save(b));
    after_two = m.p;
  }
  world.barrier();
  gradapt::comm::mpi& loader = save_on_split ? world : part;
  if (save_on_split || in_split) {
    sharded_scenario::model<V> m;
    if (!after_two.empty()) m.p = after_two;
    // Ranks that did not save take the parameters from rank 0 of the loader (every rank holds
    // them all in stage 1).
    for (auto& t : m.p) loader.broadcast(gradapt::host_view(t), 0);
    std::vector<std::byte> held;  // the bytes of the archive read last (valid until the next call)
    auto s = sopt.load(loader, b, m.params, [&](int r) {
      held = read_file(prefix + std::to_string(r));
      return std::span<const std::byte>(held);
    });
    REQUIRE(s.steps() == 2);
    for (int step = 3; step <= 4; ++step) {
      m.make_grads(loader.rank(), step, true);
      sopt.step(loader, b, m.params, s);
    }
    for (std::size_t t = 0; t < ref.p.size(); ++t) REQUIRE(sharded_scenario::same_bits(ref.p[t], m.p[t]));
  }
  world.barrier();
  if (save_on_split ? in_split : true) {
    const int me = save_on_split ? part.rank() : world.rank();
    std::remove((prefix + std::to_string(me)).c_str());
  }
}

}  // namespace

TEST_CASE("mpi: sharded SGD, AdamW, LAMB, LARS and a clipping chain equal the unsharded step",
          "[mpi][shard]") {
  gradapt::comm::mpi comm;
  using sharded_scenario::matches_unsharded;  // double for the chains with barrier stages
  const auto from = promised_mean(comm);
  matches_unsharded<float>(comm, gradapt::sgd({.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}),
                           element_cut, 3, from);
  matches_unsharded<float>(comm, gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), element_cut, 3, from);
  matches_unsharded<double>(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), element_cut, 3, from);
  matches_unsharded<double>(comm, gradapt::lars({.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9}),
                            element_cut, 3, from);
  matches_unsharded<double>(comm, clip_adam(), element_cut, 3, from);
  matches_unsharded<double>(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), tensor_cut, 3, from);
  matches_unsharded<float>(comm, gradapt::adafactor({.lr = 1e-2}), tensor_cut, 3, from);
  matches_unsharded<float>(comm, gradapt::sm3({.lr = 0.1, .momentum = 0.9}), tensor_cut, 3, from);
  sharded_scenario::master_matches_unsharded(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
                                             element_cut, 3, from);
}

TEST_CASE("mpi: stage 2, buckets reduce-scattered as each rank marks its gradients in its own order",
          "[mpi][shard]") {
  gradapt::comm::mpi comm;
  const auto from = promised_mean(comm);
  const sharded_options small{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  const sharded_options small_tensor{.partition = {.mode = granularity::tensor},
                                     .buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  sharded_scenario::stage2_matches_unsharded<double>(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
                                                     small, 3, from);
  sharded_scenario::stage2_matches_unsharded<float>(comm, gradapt::adafactor({.lr = 1e-2}), small_tensor, 2,
                                                    from);
  // Overlapped: each bucket's MPI_Ireduce_scatter_block started in mark_ready, completed in step.
  const sharded_options overlapped{.buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}, .overlap = true};
  sharded_scenario::stage2_matches_unsharded<double>(comm, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
                                                     overlapped, 3, from);
}

TEST_CASE("mpi: stage 2 with overlap, one rank without it: an error on every rank", "[mpi][shard]") {
  gradapt::comm::mpi comm;
  if (comm.size() < 2) return;
  sharded_scenario::model<float> m;
  const gradapt::host b;
  const sharded_optimizer opt(gradapt::adamw({}), {.overlap = comm.rank() != 1});
  try {
    (void)opt.init(comm, b, m.params);
    FAIL("init did not throw");
  } catch (const gradapt::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Matchers::Contains("sharded_options::overlap"));
  }
}

TEST_CASE("mpi: a sharded state saved on k ranks loads on every rank, and the reverse", "[mpi][shard]") {
  gradapt::comm::mpi world;
  const auto lamb = gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01});
  for (int k = 1; k <= world.size(); ++k) {
    reshard<double>(world, lamb, element_cut, true, k);
    reshard<double>(world, lamb, element_cut, false, k);
  }
  reshard<float>(world, gradapt::adafactor({.lr = 1e-2}), tensor_cut, true, 1);
}

// Host memory while a sharded optimizer state is saved and resharded: the tests' counting
// operator new (support/alloc_counter.hpp) charges every heap byte to the thread (rank) that
// allocated it, and the test reads each rank's peak. Saving holds the archive and one piece's buffer; loading
// holds the new shard's state and one tensor's worth of one buffer. A mapped-file style archive callback
// (spans of bytes the caller owns) adds nothing.
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/shard/optimizer.hpp"

#include "alloc_counter.hpp"

namespace gradapt_test_shard_checkpoint_memory {

namespace {

using gradapt::comm::run_threads;
using gradapt::comm::threads;

/// A layer list with one large matrix (its state dominates a shard), a long vector, and small
/// tensors: {1024 x 512, 300000, 4096, 1000, 7, 512 x 64}.
struct net {
  std::vector<std::vector<std::int64_t>> shapes{{1024, 512}, {300000}, {4096}, {1000}, {7}, {512, 64}};
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> params;
  std::size_t largest = 0;
  net() {
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::size_t n = 1;
      for (const auto d : shapes[t]) n *= static_cast<std::size_t>(d);
      largest = std::max(largest, n);
      p.emplace_back(n, 0.5f);
      g.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i) g[t][i] = static_cast<float>((i % 17) + t) / 64.0f;
    }
    for (std::size_t t = 0; t < shapes.size(); ++t)
      params.add("w" + std::to_string(t), gradapt::tensor_view<float>(p[t].data(), shapes[t]),
                 gradapt::tensor_view<float>(g[t].data(), shapes[t]));
  }
};

struct sample {
  std::int64_t extra = 0;    ///< peak bytes above the window's start
  std::int64_t kept = 0;     ///< bytes still held when the call returned (the archive or the state)
  std::int64_t archive = 0;  ///< the archive's size (save)
};

}  // namespace

TEST_CASE("saving and resharding hold the shard plus at most one tensor's worth of state", "[shard]") {
  if (!alloc_counter::enabled) {
    WARN(
        "operator new is not replaced in this build (ThreadSanitizer's runtime owns it): nothing to measure");
    return;
  }
  const gradapt::host b;
  const auto opt = gradapt::adamw({.lr = 1e-3, .weight_decay = 0.01});
  const gradapt::shard::sharded_optimizer<decltype(opt)> sopt(opt);
  const std::int64_t slack = 64 * 1024;  // field names, the reader's index, the plan, comm bookkeeping
  const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};
  for (const auto& [from, to] : std::vector<std::pair<int, int>>{{4, 3}, {2, 5}, {3, 1}}) {
    INFO("from " << from << " to " << to);
    std::vector<std::vector<std::byte>> saved(static_cast<std::size_t>(from));
    std::vector<sample> saves(static_cast<std::size_t>(from)), loads(static_cast<std::size_t>(to));
    const std::size_t largest = net().largest;
    run_threads(from, quick, [&](threads& comm) {
      net m;
      auto s = sopt.init(comm, b, m.params);
      sopt.step(comm, b, m.params, s);
      const std::int64_t base = alloc_counter::start_peak();
      auto bytes = s.save(b);
      sample& x = saves[static_cast<std::size_t>(comm.rank())];
      x.extra = alloc_counter::peak_bytes() - base;
      x.kept = alloc_counter::live_bytes() - base;
      x.archive = static_cast<std::int64_t>(bytes.size());
      saved[static_cast<std::size_t>(comm.rank())] = std::move(bytes);
    });
    run_threads(to, quick, [&](threads& comm) {
      net m;
      const std::int64_t base = alloc_counter::start_peak();
      auto s = sopt.load(comm, b, m.params, [&](int r) {
        return std::span<const std::byte>(saved.at(static_cast<std::size_t>(r)));
      });
      sample& x = loads[static_cast<std::size_t>(comm.rank())];
      x.extra = alloc_counter::peak_bytes() - base;
      x.kept = alloc_counter::live_bytes() - base;
      (void)s;
    });
    // One buffer of the largest tensor, in the state's element type.
    const auto one_tensor = static_cast<std::int64_t>(largest * sizeof(float));
    for (std::size_t r = 0; r < saves.size(); ++r) {
      INFO("save, rank " << r << ": peak +" << saves[r].extra << " B, archive " << saves[r].archive << " B");
      std::printf("save on %d ranks, rank %zu: peak %lld B above the state, archive %lld B (%.3f of it)\n",
                  from, r, static_cast<long long>(saves[r].extra), static_cast<long long>(saves[r].archive),
                  static_cast<double>(saves[r].extra) / static_cast<double>(saves[r].archive));
      CHECK(saves[r].kept <= saves[r].archive + slack);
      CHECK(saves[r].extra <= saves[r].archive + one_tensor + slack);
    }
    for (std::size_t r = 0; r < loads.size(); ++r) {
      INFO("load, rank " << r << ": peak +" << loads[r].extra << " B, state " << loads[r].kept << " B");
      std::printf("load on %d ranks (from %d), rank %zu: peak %lld B, state kept %lld B, one tensor %lld B\n",
                  to, from, r, static_cast<long long>(loads[r].extra), static_cast<long long>(loads[r].kept),
                  static_cast<long long>(one_tensor));
      CHECK(loads[r].extra <= loads[r].kept + one_tensor + slack);
    }
  }
}

}  // namespace gradapt_test_shard_checkpoint_memory

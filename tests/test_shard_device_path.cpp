// The sharded optimizer's path for backends whose memory space is not the host's (the CUDA
// backend with NCCL), run on the host through a device-tagged backend and communicator over host
// memory (support/host_as_device.hpp) on 1 to 6 ranks: packing copies, the mean and the master
// rounding as backend applies, agreements and the finiteness check staged through backend
// buffers, checkpoints copied between the spaces. Against the unsharded host chain, bitwise;
// and the chains that path cannot shard exactly are errors on every rank.
#include "catch.hpp"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "host_as_device.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "scenarios/sharded.hpp"

namespace gradapt_test_shard_device_path {

using Catch::Matchers::Contains;
using gradapt::device_space;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
using gradapt::shard::granularity;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;
using sharded_scenario::model;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(20)};

using host_as_device::on_device;

/// Steps 1..3 sharded through the device path (stage 1, or stage 2 marking in reverse order),
/// a save and a load on the same ranks, step 4: every step bitwise the unsharded host chain.
template <class V, class Opt>
void device_path_matches(threads& c, const Opt& opt, const sharded_options& so, bool stage2) {
  const gradapt::host hb;
  const host_as_device::backend db;
  host_as_device::comm dc{&c};
  model<V> ref, sh;
  const auto dparams = on_device(sh.params);
  auto rst = opt.init(hb, ref.params);
  const sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(dc, db, dparams);
  for (int k = 1; k <= 4; ++k) {
    ref.make_grads(c.rank(), k);
    sh.make_grads(c.rank(), k);
    for (const auto& g : ref.params.grads()) c.allreduce(g, gradapt::reduce_op::sum);
    if (c.size() > 1) hb.apply_list(gradapt::detail::divide_by_ranks{c.size()}, ref.params.grads());
    opt.step(hb, ref.params, rst);
    if (k == 4) {  // through a checkpoint
      const auto bytes = sst.save(db);
      std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(c.size()));
      for (int r = 0; r < c.size(); ++r) {  // every rank's archive, by broadcast of its size and bytes
        double n = r == c.rank() ? static_cast<double>(bytes.size()) : 0.0;
        c.broadcast(gradapt::tensor_view<double>::vector(&n, 1), r);
        std::vector<double> words(static_cast<std::size_t>(n + 7) / 8, 0.0);
        if (r == c.rank()) std::memcpy(words.data(), bytes.data(), bytes.size());
        c.broadcast(gradapt::host_view(words), r);
        all[static_cast<std::size_t>(r)].resize(static_cast<std::size_t>(n));
        std::memcpy(all[static_cast<std::size_t>(r)].data(), words.data(), static_cast<std::size_t>(n));
      }
      sst = sopt.load(dc, db, dparams,
                      [&](int r) { return std::span<const std::byte>(all.at(static_cast<std::size_t>(r))); });
      RANK_REQUIRE(sst.steps() == 3);
    }
    if (stage2)
      for (std::size_t t = sh.p.size(); t-- > 0;) sopt.mark_ready(dc, db, dparams, sst, t);
    sopt.step(dc, db, dparams, sst);
    for (std::size_t t = 0; t < ref.p.size(); ++t)
      RANK_REQUIRE(sharded_scenario::same_bits(ref.p[t], sh.p[t]));
  }
}

}  // namespace

TEST_CASE("the device path of the sharded step equals the unsharded chain on 1 to 6 ranks", "[shard]") {
  const sharded_options tensor_cut{.partition = {.mode = granularity::tensor}};
  const sharded_options small{.bucket_elements = 1000,
                              .buckets = {.cap_bytes = 20000, .first_cap_bytes = 4000}};
  for (int n = 1; n <= 6; ++n) {
    INFO("ranks " << n);
    run_threads(n, quick, [&](threads& c) {
      device_path_matches<float>(c, gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), sharded_options{},
                                 false);
      device_path_matches<float>(c, gradapt::sgd({.lr = 0.05, .momentum = 0.9}), small, true);
      device_path_matches<double>(c, gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}), tensor_cut, false);
      device_path_matches<float>(c, gradapt::adafactor({.lr = 1e-2}), tensor_cut, true);
    });
  }
}

TEST_CASE("the device path rejects what it cannot shard exactly, on every rank", "[shard]") {
  // A trust ratio over a tensor cut across ranks (element granularity, cuts at global multiples
  // of 4096), and a global clip switched on (LAMB's own, off by default, is not in the way).
  using clip_adam_chain =
      gradapt::chain<gradapt::transform::clip_by_global_norm, gradapt::transform::scale_by_adam,
                     gradapt::transform::scale_by_learning_rate>;
  const clip_adam_chain clip_adam{gradapt::transform::clip_by_global_norm{.max_norm = 1.0},
                                  gradapt::transform::scale_by_adam{},
                                  gradapt::transform::scale_by_learning_rate{.lr = 1e-2}};
  run_threads(3, quick, [&](threads& c) {
    const host_as_device::backend db;
    host_as_device::comm dc{&c};
    model<float> m;
    const auto dparams = on_device(m.params);
    const sharded_optimizer lamb(
        gradapt::lamb({.lr = 1e-2}),
        sharded_options{
            .partition = {.mode = granularity::element, .alignment = 4096, .align_tensors = false}});
    RANK_REQUIRE_THROWS_WITH(lamb.init(dc, db, dparams), Contains("granularity::tensor"));
    const sharded_optimizer clip(clip_adam, sharded_options{.partition = {.mode = granularity::tensor}});
    RANK_REQUIRE_THROWS_WITH(clip.init(dc, db, dparams), Contains("clip_by_global_norm"));
  });
  // One rank: nothing is cut and the global sum is local.
  run_threads(1, quick, [&](threads& c) {
    const host_as_device::backend db;
    host_as_device::comm dc{&c};
    model<float> m;
    const auto dparams = on_device(m.params);
    const sharded_optimizer clip(clip_adam);
    auto s = clip.init(dc, db, dparams);
    clip.step(dc, db, dparams, s);
    RANK_REQUIRE(s.steps() == 1);
  });
}

}  // namespace gradapt_test_shard_device_path

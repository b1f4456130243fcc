#pragma once
// The sharded optimizer step against the unsharded chain, written once over the communicator:
// tests/test_shard_optimizer.cpp runs it on comm::threads, tests/mpi/test_mpi_shard.cpp on
// MPI_COMM_WORLD. Gradients are multiples of 2^-10 (2^-4 in 16 bits) below 1 in magnitude, so
// their sum over up to 8 ranks is exact whatever order a communicator adds in: the reference averages
// them with allreduce, the sharded step with reduce_scatter, and both see the same mean.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "rank_check.hpp"

namespace sharded_scenario {

/// Tensor shapes: matrices and vectors from 7 to 12293 elements, so that with 4096-element
/// alignment most ranks' shards cut a tensor, and several tensors lie on one rank.
inline std::vector<std::vector<std::int64_t>> shapes() {
  return {{33, 129}, {12293}, {7}, {64, 64}, {9000}, {3, 5}, {130, 70}, {1}};
}

inline std::size_t numel(const std::vector<std::int64_t>& s) {
  std::size_t n = 1;
  for (const auto d : s) n *= static_cast<std::size_t>(d);
  return n;
}

/// Full parameters, this rank's gradients and a param_list over them (tensor 2 skips weight
/// decay and the trust ratio; tensors 3 and 5 are in group "half_lr").
template <class V, class G = V>
struct model {
  std::vector<std::vector<V>> p;
  std::vector<std::vector<G>> g;
  gradapt::param_list<V, G> params;

  model() {
    params.add_group("half_lr", {.lr_scale = 0.5, .weight_decay = 0.03});
    const auto sh = shapes();
    for (std::size_t t = 0; t < sh.size(); ++t) {
      const std::size_t n = numel(sh[t]);
      p.emplace_back(n);
      g.emplace_back(n);
      std::uint64_t x = 0x9E3779B97F4A7C15ull * (t + 1);
      for (std::size_t i = 0; i < n; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const double u = static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0;
        gradapt::store(p[t][i],
                       static_cast<gradapt::compute_t<V>>(u * (1.0 + 0.25 * static_cast<double>(t))));
      }
    }
    for (std::size_t t = 0; t < sh.size(); ++t) {
      gradapt::param_flags f{};
      if (t == 2) f = {.skip_weight_decay = true, .skip_trust_ratio = true};
      params.add("w" + std::to_string(t), gradapt::tensor_view<V>(p[t].data(), sh[t]),
                 gradapt::tensor_view<G>(g[t].data(), sh[t]), f, (t == 3 || t == 5) ? 1 : 0);
    }
  }

  /// Gradient grid: 2^-10 steps below 1, or 2^-4 for 16-bit gradients (8 significant bits:
  /// a sum of up to 8 of them is still exact, so every summation order gives the same bits).
  static constexpr int grid = sizeof(G) == 2 ? 16 : 1024;

  /// Gradients of `rank` at step k: integers in (-grid, grid) over grid (identical on every
  /// rank when `same` is set, so that the mean is the same for any world size).
  void make_grads(int rank, int k, bool same = false) {
    for (std::size_t t = 0; t < g.size(); ++t) {
      std::uint64_t x = 0xD1B54A32D192ED03ull * (t + 3) + 7919ull * static_cast<std::uint64_t>(k) +
                        (same ? 0 : 104729ull * static_cast<std::uint64_t>(rank + 1));
      for (std::size_t i = 0; i < g[t].size(); ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const auto v = static_cast<int>((x >> 33) % (2 * grid - 1)) - (grid - 1);
        gradapt::store(g[t][i], static_cast<gradapt::compute_t<G>>(static_cast<double>(v) / grid));
      }
    }
  }
};

/// Bitwise equality of two element vectors.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// `steps` steps of `opt` sharded over `comm` give bitwise the parameters of the unsharded
/// chain fed the allreduce mean of the same gradients, after every step. In double (V), the
/// last bits of an assembled sum reach the parameters; in float they are mostly rounded away.
template <class V = float, class Comm, class Opt>
void matches_unsharded(Comm& comm, const Opt& opt, const gradapt::shard::sharded_options& so, int steps) {
  const gradapt::host b;
  model<V> ref, sh;
  auto rst = opt.init(b, ref.params);
  const gradapt::shard::sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(comm, b, sh.params);
  RANK_REQUIRE(sst.plan().world() == comm.size());
  for (int k = 1; k <= steps; ++k) {
    ref.make_grads(comm.rank(), k);
    sh.make_grads(comm.rank(), k);
    for (const auto& g : ref.params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
    if (comm.size() > 1) b.apply_list(gradapt::detail::divide_by_ranks{comm.size()}, ref.params.grads());
    opt.step(b, ref.params, rst);
    sopt.step(comm, b, sh.params, sst);
    for (std::size_t t = 0; t < ref.p.size(); ++t) RANK_REQUIRE(same_bits(ref.p[t], sh.p[t]));
  }
  RANK_REQUIRE(sst.steps() == static_cast<std::uint64_t>(steps));
}

/// Stage 2: every rank marks its gradients ready in its own random order, the buckets are
/// reduce-scattered during the "backward pass", and a gradient buffer is overwritten with NaN
/// as soon as its bucket is released: the step still equals the unsharded chain bitwise.
template <class V = float, class Comm, class Opt>
void stage2_matches_unsharded(Comm& comm, const Opt& opt, const gradapt::shard::sharded_options& so,
                              int steps) {
  const gradapt::host b;
  model<V> ref, sh;
  auto rst = opt.init(b, ref.params);
  const gradapt::shard::sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(comm, b, sh.params);
  const std::size_t T = sh.p.size();
  for (int k = 1; k <= steps; ++k) {
    ref.make_grads(comm.rank(), k);
    sh.make_grads(comm.rank(), k);
    for (const auto& g : ref.params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
    if (comm.size() > 1) b.apply_list(gradapt::detail::divide_by_ranks{comm.size()}, ref.params.grads());
    opt.step(b, ref.params, rst);
    std::vector<std::size_t> order(T);
    for (std::size_t t = 0; t < T; ++t) order[t] = t;
    std::uint64_t x =
        0x2545F4914F6CDD1Dull * static_cast<std::uint64_t>(comm.rank() + 1) + static_cast<std::uint64_t>(k);
    for (std::size_t i = T; i > 1; --i) {  // Fisher-Yates with a per-rank generator
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(order[i - 1], order[static_cast<std::size_t>((x >> 33) % i)]);
    }
    std::vector<char> wiped(T, 0);
    for (const std::size_t t : order) {
      sopt.mark_ready(comm, b, sh.params, sst, t);
      for (std::size_t u = 0; u < T; ++u)
        if (!wiped[u] && sst.released(u)) {
          for (auto& e : sh.g[u]) gradapt::store(e, std::numeric_limits<gradapt::compute_t<V>>::quiet_NaN());
          wiped[u] = 1;
        }
    }
    for (std::size_t u = 0; u < T; ++u) RANK_REQUIRE(wiped[u] == 1);
    sopt.step(comm, b, sh.params, sst);
    for (std::size_t t = 0; t < T; ++t) RANK_REQUIRE(same_bits(ref.p[t], sh.p[t]));
  }
}

/// bfloat16 parameters and gradients with float master values in the shard: bitwise an
/// unsharded chain over a float copy of the parameters, rounded to bfloat16.
template <class Comm, class Opt>
void master_matches_unsharded(Comm& comm, const Opt& opt, const gradapt::shard::sharded_options& so,
                              int steps) {
  using bf = gradapt::bfloat16;
  const gradapt::host b;
  model<bf> sh;
  model<float, bf> ref;  // float master values, bfloat16 gradients
  for (std::size_t t = 0; t < ref.p.size(); ++t)
    for (std::size_t i = 0; i < ref.p[t].size(); ++i) ref.p[t][i] = static_cast<float>(sh.p[t][i]);
  auto rst = opt.init(b, ref.params);
  const gradapt::shard::sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.template init<float>(comm, b, sh.params);
  for (int k = 1; k <= steps; ++k) {
    ref.make_grads(comm.rank(), k);
    sh.make_grads(comm.rank(), k);
    for (const auto& g : ref.params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
    if (comm.size() > 1) b.apply_list(gradapt::detail::divide_by_ranks{comm.size()}, ref.params.grads());
    opt.step(b, ref.params, rst);
    sopt.step(comm, b, sh.params, sst);
    for (std::size_t t = 0; t < ref.p.size(); ++t) {
      std::vector<bf> rounded(ref.p[t].size());
      for (std::size_t i = 0; i < rounded.size(); ++i) rounded[i] = bf(ref.p[t][i]);
      RANK_REQUIRE(same_bits(rounded, sh.p[t]));
    }
  }
}

}  // namespace sharded_scenario

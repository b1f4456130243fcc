#pragma once
// The sharded optimizer step against the unsharded chain, written once over the communicator:
// tests/test_shard_optimizer.cpp runs it on comm::threads (tests/test_shard_device_path.cpp
// through the device path over threads), tests/mpi/test_mpi_shard.cpp on MPI_COMM_WORLD.
//
// Gradients are random with every mantissa bit set at random and exponents spread over 2^-4 to
// 2^4, so a sum over 3 or more ranks rounds, and its bits depend on the order of the additions.
// The reference chain is fed the mean its communicator promises to match
// (docs/algorithms/sharded-state.md, "Which bits are promised"):
//  - mean_from::allreduce: the comm.allreduce mean. Promised where the communicator's
//    reduce_scatter adds every element in the allreduce's order: comm::threads (rank order in
//    both) and any communicator on 1 or 2 ranks (one addition, which is commutative).
//  - mean_from::sharded_step: MPI on 3 or more ranks, where MPI_Reduce_scatter_block and
//    MPI_Allreduce (and stage 2's bucket-sized messages) may add in different orders. The mean
//    the sharded step computed is read back (sharded_mean: the same reduction under SGD with
//    lr 1 from parameters 0), every element of it must be the N ranks' gradients added pairwise
//    in some order and divided by N (not_some_order_mean), and the reference chain is fed it.
// Either way the sharded parameters must equal the reference's bit for bit after every step.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "rank_check.hpp"

namespace sharded_scenario {

/// Which mean the reference chain is fed (see the file comment).
enum class mean_from {
  allreduce,     ///< comm.allreduce, then divided by N: bitwise promised on threads, on 1 or 2 ranks
  sharded_step,  ///< the sharded step's own reduce-scatter mean, checked to be a sum in some order
};

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

/// Significant bits of G (the implicit leading bit included).
template <class G>
constexpr int mantissa_bits() {
  if constexpr (std::is_same_v<G, gradapt::bfloat16>)
    return 8;
  else if constexpr (std::is_same_v<G, gradapt::half>)
    return 11;
  else
    return std::numeric_limits<G>::digits;
}

/// Gradients of `rank` at step k into g (sized as shapes()): uniform in (-1, 1) with 53 random
/// bits, times 2^e for e uniform in -4..4, rounded to G (every mantissa bit random).
///
/// With `same` every rank gets the same values (the seed leaves out the rank), rounded further
/// to mantissa_bits<G>() - 3 bits, so that j x is exact for j <= 8 and (N x) / N = x in any
/// summation order: the mean is then x whatever the world size, which the checkpoint tests need
/// (they compare runs on N and on M ranks with one unsharded run). They test the state's
/// movement between world sizes, not the reduction, which the full-mantissa gradients test.
template <class G>
void fill_grads(std::vector<std::vector<G>>& g, int rank, int k, bool same = false) {
  using C = gradapt::compute_t<G>;
  constexpr int exact_bits = mantissa_bits<G>() - 3;
  for (std::size_t t = 0; t < g.size(); ++t) {
    std::uint64_t x = 0xD1B54A32D192ED03ull * (t + 3) + 7919ull * static_cast<std::uint64_t>(k) +
                      (same ? 0 : 104729ull * static_cast<std::uint64_t>(rank + 1));
    for (std::size_t i = 0; i < g[t].size(); ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const double u = static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0;
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      double v = std::ldexp(u, static_cast<int>((x >> 33) % 9) - 4);
      if (same && v != 0) {
        int e = 0;
        const double m = std::frexp(v, &e);  // v = m 2^e, 0.5 <= |m| < 1
        v = std::ldexp(std::nearbyint(std::ldexp(m, exact_bits)), e - exact_bits);
      }
      gradapt::store(g[t][i], static_cast<C>(v));
    }
  }
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

  /// This rank's gradients at step k (fill_grads; identical on every rank, with sums exact in
  /// any order, when `same` is set).
  void make_grads(int rank, int k, bool same = false) { fill_grads(g, rank, k, same); }
};

/// Bitwise equality of two element vectors.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// The mean gradient the sharded step under `so` computes on `comm` from this rank's
/// gradients `local`, read back bit for bit: a sharded SGD (lr 1, no momentum or weight decay)
/// over parameters 0 with the same options makes the same plan, rounds and buckets, so the same
/// reduce_scatter calls, which a communicator adds in the same order every time (comm::mpi:
/// MPI's order is fixed by the message size and the rank count); it then writes
/// 0 + (-1 x mean) = -mean, exactly. With `stage2` every gradient is marked ready first, so the
/// mean comes from stage 2's buckets.
template <class G, class Comm>
std::vector<std::vector<G>> sharded_mean(Comm& comm, const gradapt::shard::sharded_options& so,
                                         const std::vector<std::vector<G>>& local, bool stage2) {
  using C = gradapt::compute_t<G>;
  const gradapt::host b;
  const auto sh = shapes();
  std::vector<std::vector<G>> p(sh.size()), g = local;
  gradapt::param_list<G, G> params;
  for (std::size_t t = 0; t < sh.size(); ++t) {
    p[t].resize(numel(sh[t]));
    for (auto& e : p[t]) gradapt::store(e, C(0));
    params.add("w" + std::to_string(t), gradapt::tensor_view<G>(p[t].data(), sh[t]),
               gradapt::tensor_view<G>(g[t].data(), sh[t]));
  }
  const gradapt::shard::sharded_optimizer probe(gradapt::sgd({.lr = 1.0}), so);
  auto s = probe.init(comm, b, params);
  if (stage2)
    for (std::size_t t = 0; t < sh.size(); ++t) probe.mark_ready(comm, b, params, s, t);
  probe.step(comm, b, params, s);
  for (auto& v : p)
    for (auto& e : v) {
      const C x = gradapt::load(e);
      gradapt::store(e, x == C(0) ? C(0) : -x);  // a zero mean is +0 (x + (-x) is +0), stepped to +0
    }
  return p;
}

/// Every value that adding n values pairwise in some order gives (any binary tree over them,
/// each addition in the compute type and rounded to G, as MPI reduces: comm/mpi.hpp), n <= 6
/// (945 trees). The per-subset lists keep their memory from one call to the next.
template <class G>
class order_sums {
 public:
  static constexpr int max_values = 6;

  const std::vector<G>& of(const G* xs, int n) {
    const unsigned all = (1u << n) - 1;
    for (unsigned mask = 1; mask <= all; ++mask) {
      auto& out = at_[mask];
      out.clear();
      const unsigned low = mask & (~mask + 1);
      if (mask == low) {
        out.push_back(xs[std::countr_zero(mask)]);
        continue;
      }
      // Splits {a, mask ^ a} with a holding the lowest member: each unordered split once
      // (an addition is commutative); subsets are smaller numbers, so already filled.
      for (unsigned a = (mask - 1) & mask; a != 0; a = (a - 1) & mask) {
        if ((a & low) == 0) continue;
        for (const G& x : at_[a])
          for (const G& y : at_[mask ^ a]) {
            G r;
            gradapt::store(r, gradapt::load(x) + gradapt::load(y));
            if (std::none_of(out.begin(), out.end(), [&](const G& z) { return same(z, r); }))
              out.push_back(r);
          }
      }
    }
    return at_[all];
  }

  static bool same(const G& a, const G& b) { return std::memcmp(&a, &b, sizeof(G)) == 0; }

 private:
  std::array<std::vector<G>, std::size_t{1} << max_values> at_;
};

/// How many elements of `mean` (every tensor's mean gradient at step k) are not the N ranks'
/// gradients (fill_grads) added pairwise in some order (order_sums) and divided by N, as the
/// sharded step divides (detail::divide_by_ranks). Each rank checks every N-th element and the
/// counts are summed, so every rank returns the same count. A rank's contribution left out,
/// counted twice or taken from the wrong element, a wrong divisor or a value changed after the
/// reduction is counted; a different order of the same additions is not.
template <class G, class Comm>
double not_some_order_mean(Comm& comm, const std::vector<std::vector<G>>& mean, int k) {
  using C = gradapt::compute_t<G>;
  const int n = comm.size();
  RANK_REQUIRE(n <= order_sums<G>::max_values);
  std::vector<std::vector<std::vector<G>>> all(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) {
    auto& gq = all[static_cast<std::size_t>(q)];
    for (const auto& s : shapes()) gq.emplace_back(numel(s));
    fill_grads(gq, q, k);
  }
  order_sums<G> sums;
  std::vector<G> xs(static_cast<std::size_t>(n));
  std::vector<double> bad{0.0};
  std::size_t flat = 0;
  for (std::size_t t = 0; t < mean.size(); ++t)
    for (std::size_t i = 0; i < mean[t].size(); ++i, ++flat) {
      if (flat % static_cast<std::size_t>(n) != static_cast<std::size_t>(comm.rank())) continue;
      for (int q = 0; q < n; ++q) xs[static_cast<std::size_t>(q)] = all[static_cast<std::size_t>(q)][t][i];
      bool found = false;
      for (const G& s : sums.of(xs.data(), n)) {
        C m = gradapt::load(s);
        if (n > 1) gradapt::detail::divide_by_ranks{n}(m);
        G e;
        gradapt::store(e, m);
        found = found || order_sums<G>::same(e, mean[t][i]);
      }
      if (!found) bad[0] += 1;
    }
  comm.allreduce(gradapt::host_view(bad), gradapt::reduce_op::sum);
  return bad[0];
}

/// Sets ref's gradients to the mean the reference chain is fed at step k (see the file
/// comment); `local` holds this rank's gradients, `stage2` says how the sharded step reduces.
template <class V, class G, class Comm>
void reference_mean(Comm& comm, const gradapt::shard::sharded_options& so, model<V, G>& ref,
                    const std::vector<std::vector<G>>& local, int k, mean_from from, bool stage2) {
  const gradapt::host b;
  if (from == mean_from::allreduce) {
    for (std::size_t t = 0; t < local.size(); ++t)
      std::copy(local[t].begin(), local[t].end(), ref.g[t].begin());
    for (const auto& g : ref.params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
    if (comm.size() > 1) b.apply_list(gradapt::detail::divide_by_ranks{comm.size()}, ref.params.grads());
    return;
  }
  const auto mean = sharded_mean(comm, so, local, stage2);
  const double bad = not_some_order_mean(comm, mean, k);  // collective: not inside RANK_REQUIRE's lock
  RANK_REQUIRE(bad == 0.0);
  for (std::size_t t = 0; t < mean.size(); ++t) std::copy(mean[t].begin(), mean[t].end(), ref.g[t].begin());
}

/// `steps` steps of `opt` sharded over `comm` give bitwise the parameters of the unsharded
/// chain fed the mean `from` (the file comment) of the same gradients, after every step. In
/// double (V), the last bits of an assembled sum reach the parameters; in float they are mostly
/// rounded away.
template <class V = float, class Comm, class Opt>
void matches_unsharded(Comm& comm, const Opt& opt, const gradapt::shard::sharded_options& so, int steps,
                       mean_from from = mean_from::allreduce) {
  const gradapt::host b;
  model<V> ref, sh;
  auto rst = opt.init(b, ref.params);
  const gradapt::shard::sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(comm, b, sh.params);
  RANK_REQUIRE(sst.plan().world() == comm.size());
  for (int k = 1; k <= steps; ++k) {
    sh.make_grads(comm.rank(), k);
    reference_mean(comm, so, ref, sh.g, k, from, false);
    opt.step(b, ref.params, rst);
    sopt.step(comm, b, sh.params, sst);
    for (std::size_t t = 0; t < ref.p.size(); ++t) RANK_REQUIRE(same_bits(ref.p[t], sh.p[t]));
  }
  RANK_REQUIRE(sst.steps() == static_cast<std::uint64_t>(steps));
}

/// Stage 2: every rank marks its gradients ready in its own random order, the buckets are
/// reduce-scattered during the "backward pass", and a gradient buffer is overwritten with NaN
/// as soon as its bucket is released: the step still equals the unsharded chain bitwise (fed
/// the mean `from`; with mean_from::sharded_step, the mean of stage 2's buckets).
template <class V = float, class Comm, class Opt>
void stage2_matches_unsharded(Comm& comm, const Opt& opt, const gradapt::shard::sharded_options& so,
                              int steps, mean_from from = mean_from::allreduce) {
  const gradapt::host b;
  model<V> ref, sh;
  auto rst = opt.init(b, ref.params);
  const gradapt::shard::sharded_optimizer<Opt> sopt(opt, so);
  auto sst = sopt.init(comm, b, sh.params);
  const std::size_t T = sh.p.size();
  for (int k = 1; k <= steps; ++k) {
    sh.make_grads(comm.rank(), k);
    reference_mean(comm, so, ref, sh.g, k, from, true);
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
                              int steps, mean_from from = mean_from::allreduce) {
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
    sh.make_grads(comm.rank(), k);
    reference_mean(comm, so, ref, sh.g, k, from, false);
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

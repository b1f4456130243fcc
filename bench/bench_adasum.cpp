// Adasum over MPI against MPI_Allreduce(SUM) on the same data, timed in the same run.
//
//   mpirun -np 4 --oversubscribe build/<dir>/bench/bench_adasum [--mib 64] [--tensors 100]
//          [--iters 15] [--threads 1]
//
// Each rank holds `mib` MiB of fp32 gradients in `tensors` tensors shaped like a transformer's
// (weight matrices and small bias / norm vectors). Every iteration restores the inputs, then
// runs each variant once (starting at a rotating position), timed after an MPI_Barrier as the
// maximum over ranks:
//   allreduce      MPI_Allreduce(MPI_IN_PLACE, SUM) on the one contiguous buffer
//   adasum fused   gradapt::adasum over views carved from that buffer (sent in place)
//   adasum split   the same tensors in separate allocations (packed through the workspace)
//   adasum 3 dots  the fused-buffer call with a backend that hides apply_reduce_list, so the
//                  partials take three `dot` passes instead of one (same bits)
//   kernels        the local arithmetic of one pairwise combine over all n elements
//                  (adasum_combine: one fused dot pass, one combine pass), for scale: the
//                  distributed run does this work on 1 - 1/P of the data per rank
// It prints the median and minimum times, the ratio of medians to allreduce, and the median
// of the per-iteration ratios (robust to slow phases of a shared machine). Compiled like a
// consumer's code: plain -O2, no -march.
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/combine/adasum.hpp"
#include "gradapt/comm/mpi.hpp"

namespace {

struct args {
  double mib = 64;
  int tensors = 100;
  int iters = 15;
  int threads = 1;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--mib")
      a.mib = std::atof(v);
    else if (k == "--tensors")
      a.tensors = std::atoi(v);
    else if (k == "--iters")
      a.iters = std::atoi(v);
    else if (k == "--threads")
      a.threads = std::atoi(v);
  }
  return a;
}

/// Tensor sizes summing to `total`: even slots are weight matrices (the bulk, uneven sizes),
/// odd slots are bias / norm vectors of 1 to 4 Ki elements.
std::vector<std::size_t> shapes(std::size_t total, int count) {
  std::vector<std::size_t> s(static_cast<std::size_t>(count));
  std::size_t small = 0;
  for (int t = 1; t < count; t += 2) small += s[t] = 1024 + static_cast<std::size_t>((t * 977) % 3072);
  std::vector<double> w;
  double wsum = 0;
  for (int t = 0; t < count; t += 2) wsum += w.emplace_back(1.0 + (t * 37 % 7) / 3.0);
  std::size_t left = total - small, k = 0;
  for (int t = 0; t < count; t += 2, ++k) {
    const bool last = t + 2 >= count;
    s[t] = last ? left : static_cast<std::size_t>(static_cast<double>(total - small) * w[k] / wsum);
    left -= last ? left : s[t];
  }
  return s;
}

/// The host backend without apply_reduce_list, so Adasum takes three `dot` passes for the
/// partials instead of one fused pass (same bits; compares the two kernels' speed).
struct host_three_dots {
  using space = gradapt::host_space;
  gradapt::host h;
  template <class F, class... Ts>
  void apply(F f, gradapt::tensor_view<Ts, gradapt::host_space>... v) const {
    h.apply(f, v...);
  }
  template <class F, class... Ls>
  void apply_list(F f, const Ls&... ls) const {
    h.apply_list(f, ls...);
  }
  template <class... A>
  double reduce(A&&... x) const {
    return h.reduce(std::forward<A>(x)...);
  }
  template <class... A>
  double dot(A&&... x) const {
    return h.dot(std::forward<A>(x)...);
  }
  void synchronize() const {}
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    const args a = parse(argc, argv);
    gradapt::comm::mpi comm;
    const int rank = comm.rank();
    const int size = comm.size();
    const auto n = static_cast<std::size_t>(a.mib * 1024 * 1024 / sizeof(float));
    const auto sizes = shapes(n, a.tensors);

    std::vector<float> pristine(n);
    std::mt19937 rng(1234u + static_cast<unsigned>(rank));
    std::normal_distribution<float> d(0.0f, 1e-3f);
    for (auto& x : pristine) x = d(rng);

    std::vector<float> flat(n);
    std::vector<std::vector<float>> separate;
    std::vector<gradapt::tensor_view<float>> fused_views, split_views;
    std::size_t off = 0;
    for (std::size_t s : sizes) {
      fused_views.push_back(
          gradapt::tensor_view<float>::vector(flat.data() + off, static_cast<std::int64_t>(s)));
      separate.emplace_back(s);
      off += s;
    }
    for (auto& v : separate) split_views.push_back(gradapt::host_view(v));
    const auto restore = [&] {
      std::memcpy(flat.data(), pristine.data(), n * sizeof(float));
      std::size_t o = 0;
      for (auto& v : separate) {
        std::memcpy(v.data(), pristine.data() + o, v.size() * sizeof(float));
        o += v.size();
      }
    };

    const gradapt::host backend{.threads = a.threads};
    gradapt::adasum<gradapt::comm::mpi> ada(comm);
    gradapt::adasum_workspace<float> ws_fused(fused_views), ws_split(split_views);
    std::vector<float> other(n);
    std::vector<gradapt::tensor_view<const float>> other_views;
    off = 0;
    for (std::size_t s : sizes) {
      other_views.push_back(
          gradapt::tensor_view<const float>::vector(other.data() + off, static_cast<std::int64_t>(s)));
      off += s;
    }
    std::memcpy(other.data(), pristine.data(), n * sizeof(float));
    std::reverse(other.begin(), other.end());

    const auto timed = [&](auto&& op) {
      restore();
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      op();
      double dt = MPI_Wtime() - t0, worst = 0;
      MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      return worst;
    };
    const host_three_dots backend3{backend};
    struct variant {
      const char* name;
      std::function<void()> op;
      std::vector<double> t;
    };
    std::vector<variant> v;
    v.push_back({"MPI_Allreduce(SUM), in place",
                 [&] {
                   MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD);
                 },
                 {}});
    v.push_back({"adasum, tensors in one buffer (in place)",
                 [&] { ada.allreduce(backend, fused_views, ws_fused); },
                 {}});
    v.push_back(
        {"adasum, tensors in separate buffers", [&] { ada.allreduce(backend, split_views, ws_split); }, {}});
    v.push_back({"adasum, one buffer, partials in 3 dot passes",
                 [&] { ada.allreduce(backend3, fused_views, ws_fused); },
                 {}});
    v.push_back({"local kernels: adasum_combine over n",
                 [&] { gradapt::adasum_combine(backend, fused_views, other_views, ws_fused); },
                 {}});
    // Each iteration runs every variant once, starting at a rotating position, so that slow
    // phases of a shared machine hit all variants alike; the paired ratio divides each
    // variant's time by the allreduce time of the same iteration.
    for (int it = 0; it < a.iters + 2; ++it) {
      std::vector<double> t(v.size());
      for (std::size_t j = 0; j < v.size(); ++j) {
        const std::size_t k = (j + static_cast<std::size_t>(it)) % v.size();
        t[k] = timed(v[k].op);
      }
      if (it < 2) continue;  // warm-up: page faults, MPI's shared-memory setup
      for (std::size_t k = 0; k < v.size(); ++k) v[k].t.push_back(t[k]);
    }
    if (rank == 0) {
      const double base = median(v[0].t);
      std::printf(
          "adasum vs MPI_Allreduce(SUM): %d ranks, %.1f MiB fp32 per rank (%zu elements) in %zu tensors, "
          "host threads %d, %d iterations\n",
          size, a.mib, n, sizes.size(), a.threads, a.iters);
      std::printf("%-46s %10s %10s %8s %8s\n", "operation", "median ms", "min ms", "ratio", "paired");
      for (const auto& x : v) {
        std::vector<double> paired;
        for (std::size_t i = 0; i < x.t.size(); ++i) paired.push_back(x.t[i] / v[0].t[i]);
        std::printf("%-46s %10.2f %10.2f %8.2f %8.2f\n", x.name, 1e3 * median(x.t),
                    1e3 * *std::min_element(x.t.begin(), x.t.end()), median(x.t) / base, median(paired));
      }
      std::printf(
          "ratio: median / median of MPI_Allreduce; paired: median over iterations of the time / the same "
          "iteration's MPI_Allreduce time\n");
    }
  }
  MPI_Finalize();
  return 0;
}

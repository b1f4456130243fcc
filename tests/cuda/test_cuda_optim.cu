// The optimizer chains on the CUDA backend: the same GRADAPT_HD functors as on the host, in
// multi-tensor launches, with the trust-ratio norms summed on the device
// (cuda::apply_reduce_list) and read in place by the next kernels (no host synchronisation
// between norm and update).
//
//  - cuda::apply_reduce_list's per-tensor sums equal chunking::chunked_tree_reduce on the host
//    bit for bit (exact-valued data), its updates equal the host's;
//  - SGD, AdamW, LAMB (with clipping and clamp) and LARS over hundreds of tensors follow the host
//    backend to within float rounding (nvcc contracts to fma and sums in another fixed order,
//    so the bits differ);
//  - a device checkpoint round-trips: training continues bit for bit;
//  - a step captures into a CUDA graph (no host synchronisation, copy or allocation in it);
//  - device allocation and copies, and their size checks.
//
// Compiled wherever nvcc is found; skipped (exit 77) without a GPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"

namespace gradapt_test_cuda_optim {

using namespace gradapt_test;

static_assert(gradapt::optimizer_backend<gradapt::cuda>);

namespace {

/// y += x; returns (x², 1): exact for k/8 data, so any fixed summation order gives the same
/// bits as the host reference.
struct add_and_measure {
  GRADAPT_HD gradapt::terms<2> operator()(gradapt::tensor_index, float& y, float x) const {
    y += x;
    gradapt::terms<2> r;
    r[0] = static_cast<double>(x) * static_cast<double>(x);
    r[1] = 1.0;
    return r;
  }
};

/// Device copies of a host parameter list, with views, and a device param_list over them.
struct device_params {
  std::vector<dvec<float>> p, g;
  gradapt::param_list<float, float, device_space> list;
  device_params(const std::vector<std::vector<float>>& hp, const std::vector<std::size_t>& sizes) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      p.push_back(to_device(hp[t]));
      g.push_back(dvec<float>(sizes[t]));
    }
    for (std::size_t t = 0; t < sizes.size(); ++t)
      list.add("t" + std::to_string(t), view(p[t]), view(g[t]),
               {.skip_weight_decay = t % 5 == 1, .skip_trust_ratio = t % 7 == 2});
  }
  void set_grads(const std::vector<std::vector<float>>& hg) {
    for (std::size_t t = 0; t < hg.size(); ++t) thrust::copy(hg[t].begin(), hg[t].end(), g[t].begin());
  }
};

struct host_params {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> list;
  host_params(const std::vector<std::vector<float>>& hp, const std::vector<std::size_t>& sizes) : p(hp) {
    for (std::size_t n : sizes) g.emplace_back(n);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      list.add("t" + std::to_string(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]),
               {.skip_weight_decay = t % 5 == 1, .skip_trust_ratio = t % 7 == 2});
  }
};

/// Runs `steps` steps on both backends and returns the largest |device − host| in units of the
/// host run's largest movement.
template <class Opt>
double device_vs_host(const Opt& opt, int steps) {
  const auto sizes = list_sizes(301, 5);
  std::vector<std::vector<float>> p0;
  for (std::size_t t = 0; t < sizes.size(); ++t) p0.push_back(random_values<float>(sizes[t], 100 + t, -1, 1));
  device_params d(p0, sizes);
  host_params h(p0, sizes);
  const gradapt::cuda cb{};
  const gradapt::host hb{.threads = 1};
  auto sd = opt.init(cb, d.list);
  auto sh = opt.init(hb, h.list);
  for (int s = 1; s <= steps; ++s) {
    std::vector<std::vector<float>> g;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      g.push_back(random_values<float>(sizes[t], 1000 * s + t, -0.1, 0.1));
    d.set_grads(g);
    for (std::size_t t = 0; t < sizes.size(); ++t) std::copy(g[t].begin(), g[t].end(), h.g[t].begin());
    opt.step(cb, d.list, sd, {.lr = 0.01 * s});
    opt.step(hb, h.list, sh, {.lr = 0.01 * s});
  }
  cb.synchronize();
  double scale = 0, worst = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i)
      scale = std::max(scale, std::fabs(double(h.p[t][i]) - p0[t][i]));
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto got = to_host(d.p[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) worst = std::max(worst, std::fabs(double(got[i]) - h.p[t][i]));
  }
  return worst / scale;
}

/// Two lists y and x of k/8 values (exactly summable) with these sizes, on the host and on the
/// device, with device views.
struct eighth_lists {
  std::vector<std::vector<float>> hy, hx;
  std::vector<dvec<float>> dy, dx;
  std::vector<tensor_view<float, device_space>> ys;
  std::vector<tensor_view<const float, device_space>> xs;
  explicit eighth_lists(const std::vector<std::size_t>& sizes) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      hy.push_back(eighths<float>(sizes[t], 2 * t));
      hx.push_back(eighths<float>(sizes[t], 2 * t + 1));
      dy.push_back(to_device(hy.back()));
      dx.push_back(to_device(hx.back()));
    }
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      ys.push_back(view(dy[t]));
      xs.push_back(cview(dx[t]));
    }
  }
};

}  // namespace

TEST_CASE("cuda apply_reduce_list: per-tensor sums in the chunked-tree order, updates as on the host",
          "[cuda][apply_reduce]") {
  const auto sizes = list_sizes(403, 17);
  eighth_lists l(sizes);
  dvec<double> per(2 * sizes.size());
  const gradapt::cuda b{};
  b.apply_reduce_list(add_and_measure{}, view(per), l.ys, l.xs);
  const auto got = to_host(per);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<double> sq(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) sq[i] = double(l.hx[t][i]) * l.hx[t][i];
    const double want = gradapt::chunking::chunked_tree_reduce(
        sizes[t], 0.0, [&](double a, std::size_t i) { return a + sq[i]; },
        [](double a, double c) { return a + c; });
    INFO("tensor " << t << " of size " << sizes[t]);
    REQUIRE(bits(got[2 * t]) == bits(want));
    REQUIRE(got[2 * t + 1] == double(sizes[t]));
    const auto y = to_host(l.dy[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(bits(y[i]) == bits(l.hy[t][i] + l.hx[t][i]));
  }
  // Size checks.
  dvec<double> wrong(3);
  REQUIRE(error_of([&] {
            b.apply_reduce_list(add_and_measure{}, view(wrong), l.ys, l.xs);
          }).find("per_tensor has 3 elements for 403 tensors x 2 values") != std::string::npos);
}

TEST_CASE("cuda optimizers follow the host backend", "[cuda][optim]") {
  REQUIRE(device_vs_host(gradapt::sgd({.momentum = 0.9, .nesterov = true, .weight_decay = 0.01}), 4) < 1e-5);
  REQUIRE(device_vs_host(gradapt::adamw({.weight_decay = 0.01}), 4) < 1e-5);
  REQUIRE(device_vs_host(gradapt::lamb({.weight_decay = 0.01, .max_grad_norm = 1.0, .max_trust_ratio = 10}),
                         4) < 1e-5);
  REQUIRE(device_vs_host(gradapt::lars({.weight_decay = 0.01}), 4) < 1e-5);
}

namespace {

/// Steps `opt` on list a directly and on twin list b through a CUDA graph captured from the
/// backend's stream (after one warm-up step each). The capture fails if the step synchronises
/// with the host, copies to the host or allocates; the graph must give the direct step's bits.
/// With `warm_up = false` the captured step is the very first on its backend after init
/// (which sizes the workspace), and it runs before the direct step.
template <class Opt>
void step_captures(const Opt& opt, bool warm_up = true) {
  const auto sizes = list_sizes(61, 9);
  std::vector<std::vector<float>> p0, g;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    p0.push_back(random_values<float>(sizes[t], 300 + t, -1, 1));
    g.push_back(random_values<float>(sizes[t], 900 + t, -0.1, 0.1));
  }
  device_params a(p0, sizes), b(p0, sizes);
  a.set_grads(g);
  b.set_grads(g);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const gradapt::cuda cb{.stream = stream};
  auto sa = opt.init(cb, a.list);
  auto sb = opt.init(cb, b.list);
  if (warm_up) {
    opt.step(cb, a.list, sa, {.lr = 0.01});
    opt.step(cb, b.list, sb, {.lr = 0.01});
    cb.synchronize();
  }
  capture_and_launch(stream, [&] { opt.step(cb, b.list, sb, {.lr = 0.02}); });
  opt.step(cb, a.list, sa, {.lr = 0.02});
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto x = to_host(a.p[t]), y = to_host(b.p[t]);
    for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(bits(x[i]) == bits(y[i]));
  }
  REQUIRE(sa.save(cb) == sb.save(cb));
  cudaStreamDestroy(stream);
}

}  // namespace

TEST_CASE("cuda optimizer steps never wait for the host (they capture into a CUDA graph)", "[cuda][optim]") {
  step_captures(gradapt::sgd({.momentum = 0.9, .nesterov = true, .weight_decay = 0.01}));
  step_captures(gradapt::adamw({.weight_decay = 0.01}));
  step_captures(gradapt::lamb({.weight_decay = 0.01, .max_grad_norm = 1.0, .max_trust_ratio = 10}));
  step_captures(gradapt::lars({.weight_decay = 0.01}));
}

TEST_CASE("cuda optimizer state round-trips through a checkpoint", "[cuda][optim][checkpoint]") {
  const auto sizes = list_sizes(97, 23);
  std::vector<std::vector<float>> p0;
  for (std::size_t t = 0; t < sizes.size(); ++t) p0.push_back(random_values<float>(sizes[t], 7 + t, -1, 1));
  const gradapt::cuda cb{};
  gradapt::lamb opt({.weight_decay = 0.01});
  device_params a(p0, sizes);
  auto sa = opt.init(cb, a.list);
  const auto grads = [&](int s) {
    std::vector<std::vector<float>> g;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      g.push_back(random_values<float>(sizes[t], 500 * s + t, -0.1, 0.1));
    return g;
  };
  for (int s = 1; s <= 2; ++s) {
    a.set_grads(grads(s));
    opt.step(cb, a.list, sa);
  }
  const auto bytes = sa.save(cb);
  std::vector<std::vector<float>> p_saved;
  for (auto& d : a.p) p_saved.push_back(to_host(d));
  for (int s = 3; s <= 4; ++s) {
    a.set_grads(grads(s));
    opt.step(cb, a.list, sa);
  }
  device_params c(p_saved, sizes);
  auto sc = opt.init(cb, c.list);
  sc.load(cb, bytes);
  for (int s = 3; s <= 4; ++s) {
    c.set_grads(grads(s));
    opt.step(cb, c.list, sc);
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto x = to_host(a.p[t]), y = to_host(c.p[t]);
    for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(bits(x[i]) == bits(y[i]));
  }
  REQUIRE(sc.save(cb) == sa.save(cb));
}

TEST_CASE("cuda allocate and copy", "[cuda][memory]") {
  const gradapt::cuda b{};
  auto buf = b.allocate<float>(1000);
  REQUIRE(buf.size() == 1000);
  std::vector<float> h(1000, 1.0f), back(1000, 2.0f);
  const auto dv = tensor_view<float, device_space>::vector(buf.data(), 1000);
  b.copy(tensor_view<const float, device_space>(dv), gradapt::host_view(back));
  for (float x : back) REQUIRE(x == 0.0f);  // zero-initialised
  b.copy(tensor_view<const float, host_space>(gradapt::host_view(h)), dv);
  b.copy(tensor_view<const float, device_space>(dv), gradapt::host_view(back));
  REQUIRE(back == h);
  std::vector<float> small(3);
  REQUIRE(error_of([&] {
            b.copy(tensor_view<const float, device_space>(dv), gradapt::host_view(small));
          }).find("source has 1000 elements but destination has 3") != std::string::npos);
  auto moved = std::move(buf);
  REQUIRE(buf.data() == nullptr);
  REQUIRE(moved.size() == 1000);
  REQUIRE(b.allocate<double>(0).data() == nullptr);
}

TEST_CASE("cuda allocate on a non-blocking stream: the memory reads as zero from that stream at once",
          "[cuda][memory]") {
  // The zero-fill runs on the backend's stream before allocate returns; a fill on the legacy
  // default stream would not be ordered before work on a non-blocking stream.
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const gradapt::cuda b{.stream = stream};
  for (int round = 0; round < 4; ++round) {
    auto buf = b.allocate<double>(std::size_t{1} << 25);  // 256 MiB
    const auto v = tensor_view<const double, device_space>::vector(buf.data(), std::int64_t{1} << 25);
    REQUIRE(b.reduce(gradapt::reduction::sum_squares, v) == 0.0);
    REQUIRE(b.reduce(gradapt::reduction::count_nonfinite, v) == 0.0);
  }
  cudaStreamDestroy(stream);
}

namespace {
/// x · (x · 1.1) in double: not exact, so a sum that fused the add with this multiply would
/// differ from the chunked tree of separately rounded adds.
struct inexact_square {
  GRADAPT_HD double operator()(double& x) const { return x * (x * 1.1); }
};
}  // namespace

TEST_CASE("cuda apply_reduce_list with inexact double terms: the chunked-tree order, bit for bit",
          "[cuda][apply_reduce]") {
  const auto sizes = list_sizes(37, 29);
  std::vector<std::vector<double>> hx;
  std::vector<dvec<double>> dx;
  std::vector<tensor_view<double, device_space>> xs;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    hx.push_back(random_values<double>(sizes[t], 700 + t, -3, 3));
    dx.push_back(to_device(hx.back()));
  }
  for (auto& d : dx) xs.push_back(view(d));
  dvec<double> per(sizes.size());
  const gradapt::cuda b{};
  b.apply_reduce_list(inexact_square{}, view(per), xs);
  const auto got = to_host(per);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const double want = gradapt::chunking::chunked_tree_reduce(
        sizes[t], 0.0,
        [&](double a, std::size_t i) {
          volatile double term = hx[t][i] * (hx[t][i] * 1.1);  // rounded before the add
          return a + term;
        },
        [](double a, double c) { return a + c; });
    INFO("tensor " << t << " of size " << sizes[t]);
    REQUIRE(bits(got[t]) == bits(want));
  }
}

TEST_CASE(
    "cuda workspace: it cannot grow during graph capture (an error naming reserve); reserve_for "
    "sizes a K-term apply_reduce_list so that it captures",
    "[cuda][workspace]") {
  const auto sizes = list_sizes(97, 31);
  eighth_lists l(sizes);
  dvec<double> per(2 * sizes.size());
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  {
    const gradapt::cuda fresh{.stream = stream};  // its own, empty workspace
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    const std::string e =
        error_of([&] { fresh.apply_reduce_list(add_and_measure{}, view(per), l.ys, l.xs); });
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    INFO(e);
    REQUIRE(e.find("being captured into a CUDA graph") != std::string::npos);
    REQUIRE(e.find("reserve") != std::string::npos);
  }
  const gradapt::cuda b{.stream = stream};
  std::size_t chunks = 0;
  for (const std::size_t n : sizes)
    chunks += gradapt::chunking::chunk_count(n, gradapt::chunking::chunk_elements);
  REQUIRE(gradapt::cuda::workspace_bytes(l.xs, 2) ==
          std::max(2 * chunks, chunks + sizes.size()) * sizeof(double));
  b.reserve_for(l.xs, 2);
  capture_and_launch(stream, [&] { b.apply_reduce_list(add_and_measure{}, view(per), l.ys, l.xs); });
  const auto got = to_host(per);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    REQUIRE(got[2 * t + 1] == double(sizes[t]));
    const auto y = to_host(l.dy[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(bits(y[i]) == bits(l.hy[t][i] + l.hx[t][i]));
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("cuda optimizer init sizes the workspace: the first step captures into a CUDA graph",
          "[cuda][optim]") {
  step_captures(gradapt::adamw({.weight_decay = 0.01}), false);
  step_captures(gradapt::lamb({.weight_decay = 0.01, .max_grad_norm = 1.0}), false);
  step_captures(gradapt::lars({.weight_decay = 0.01}), false);
  step_captures(gradapt::sgd({.lr = 0.1, .momentum = 0.9, .nesterov = true}), false);
}

}  // namespace gradapt_test_cuda_optim

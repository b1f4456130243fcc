// Loss scaling and global-norm clipping on the CUDA backend: the flag form of the unscale pass
// (in place and into fp32 master buffers) against the host backend's fused pass, which
// tests/test_loss_scaler.cpp checks against PyTorch bit for bit; loss_scaler::unscale with a
// device workspace over 1 to 4 ranks (comm::threads staged through host memory) against a
// serial scaler; and clip_by_global_norm on device lists of exactly summable values against
// the host, bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "staged_comm.cuh"

namespace gradapt_test_cuda_loss_scaler {

using namespace gradapt_test;

namespace {

/// A list on the host and its device copy, with views of both.
template <class T>
struct mirrored {
  std::vector<std::vector<T>> host;
  std::vector<dvec<T>> device;
  std::vector<tensor_view<T, host_space>> hviews;
  std::vector<tensor_view<T, device_space>> dviews;
  explicit mirrored(std::vector<std::vector<T>> h) : host(std::move(h)) {
    for (auto& v : host) {
      device.push_back(to_device(v));
      hviews.push_back(gradapt::host_view(v));
    }
    for (auto& d : device) dviews.push_back(view(d));
  }
};

/// Gradients of T with magnitudes over many decades, with non-finite values injected at
/// `bad` random places.
template <class T>
std::vector<std::vector<T>> scaled_grads(const std::vector<std::size_t>& sizes, std::uint64_t seed, int bad) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> exponent(-20.0, 16.0), sign(-1.0, 1.0);
  std::vector<std::vector<T>> out;
  std::size_t total = 0;
  for (auto n : sizes) {
    std::vector<T> v(n);
    for (auto& x : v)
      gradapt::store(x,
                     static_cast<gradapt::compute_t<T>>(std::copysign(std::exp2(exponent(rng)), sign(rng))));
    total += n;
    out.push_back(std::move(v));
  }
  for (int k = 0; k < bad && total > 0; ++k) {
    std::size_t t = 0;
    do t = std::uniform_int_distribution<std::size_t>(0, sizes.size() - 1)(rng);
    while (sizes[t] == 0);
    const std::size_t i = std::uniform_int_distribution<std::size_t>(0, sizes[t] - 1)(rng);
    gradapt::store(out[t][i], static_cast<gradapt::compute_t<T>>(k % 2 ? INFINITY : NAN));
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda unscale: the flag pass equals the host's fused pass bit for bit",
                   "[cuda][loss_scaler]", float, gradapt::half, gradapt::bfloat16) {
  const gradapt::cuda dev{};
  const gradapt::host host{.threads = 1};
  for (int bad : {0, 1, 5}) {
    const auto sizes = list_sizes(300, 11 + static_cast<std::uint64_t>(bad));
    mirrored<TestType> g(scaled_grads<TestType>(sizes, 3 + static_cast<std::uint64_t>(bad), bad));
    for (float inv : {1.0f / 3000.0f, 0x1p-16f, 4.0f}) {
      mirrored<TestType> h(g.host);
      mirrored<TestType> d(g.host);
      const double count = gradapt::unscale_count_nonfinite(host, h.hviews, inv);
      dvec<float> flag(1, 0.0f);
      gradapt::unscale_flag_nonfinite(dev, d.dviews, inv, view(flag));
      dev.synchronize();
      INFO("bad " << bad << ", inv " << inv);
      REQUIRE(to_host(flag)[0] == (count > 0 ? 1.0f : 0.0f));
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        const auto got = to_host(d.device[t]);
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          const bool both_nan =
              std::isnan(static_cast<float>(got[i])) && std::isnan(static_cast<float>(h.host[t][i]));
          if (!both_nan && bits(got[i]) != bits(h.host[t][i]))
            FAIL("tensor " << t << " element " << i << ": device " << bits(got[i]) << " host "
                           << bits(h.host[t][i]));
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("cuda unscale: 16-bit gradients into fp32 master buffers equal the host",
                   "[cuda][loss_scaler]", gradapt::half, gradapt::bfloat16) {
  const gradapt::cuda dev{};
  const gradapt::host host{.threads = 1};
  const auto sizes = list_sizes(150, 5);
  mirrored<TestType> g(scaled_grads<TestType>(sizes, 9, 2));
  std::vector<std::vector<float>> zeros;
  for (auto n : sizes) zeros.emplace_back(n, 0.0f);
  mirrored<float> hm(zeros), dm(zeros);
  const float inv = 1.0f / 3000.0f;
  const double count = gradapt::unscale_count_nonfinite(host, g.hviews, hm.hviews, inv);
  dvec<float> flag(1, 0.0f);
  gradapt::unscale_flag_nonfinite(dev, g.dviews, dm.dviews, inv, view(flag));
  dev.synchronize();
  REQUIRE(count == 2.0);
  REQUIRE(to_host(flag)[0] == 1.0f);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto got = to_host(dm.device[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i)
      if (!(std::isnan(got[i]) && std::isnan(hm.host[t][i])) && bits(got[i]) != bits(hm.host[t][i]))
        FAIL("tensor " << t << " element " << i);
    const auto grad_after = to_host(g.device[t]);
    REQUIRE(std::memcmp(grad_after.data(), g.host[t].data(), sizes[t] * sizeof(TestType)) == 0);  // only read
  }
}

TEST_CASE("cuda loss_scaler: ranks agree through a device workspace (1 to 4 ranks)", "[cuda][loss_scaler]") {
  const auto overflow_at = [](int rank, int step) { return rank == 0 && (step % 3 == 1 || step == 7); };
  for (int n = 1; n <= 4; ++n) {
    gradapt::loss_scaler serial({.init_scale = 256, .growth_interval = 2, .hysteresis = 2});
    std::vector<bool> expect;
    std::vector<double> scales;
    for (int k = 0; k < 16; ++k) {
      expect.push_back(serial.update(overflow_at(0, k)));
      scales.push_back(serial.scale());
    }
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& t) {
      staged_comm comm(t);
      const gradapt::cuda dev{};
      gradapt::loss_scaler s({.init_scale = 256, .growth_interval = 2, .hysteresis = 2});
      dvec<gradapt::half> a(1000), b(37);
      dvec<float> ws(2);
      const std::vector<tensor_view<gradapt::half, device_space>> grads{view(a), view(b)};
      for (int k = 0; k < 16; ++k) {
        std::vector<gradapt::half> ha(1000, gradapt::half(static_cast<float>(s.scale()))),
            hb(37, gradapt::half(1.0f));
        if (overflow_at(comm.rank(), k)) hb[static_cast<std::size_t>(k) % 37] = gradapt::half(INFINITY);
        thrust::copy(ha.begin(), ha.end(), a.begin());
        thrust::copy(hb.begin(), hb.end(), b.begin());
        const bool step = s.unscale(dev, comm, grads, view(ws));
        const bool ok =
            step == expect[static_cast<std::size_t>(k)] && s.scale() == scales[static_cast<std::size_t>(k)];
        if (!ok)
          throw gradapt::error("rank " + std::to_string(comm.rank()) + " step " + std::to_string(k) +
                               " disagrees");
        const gradapt::half a0 = a[0];
        if (step && static_cast<float>(a0) != 1.0f) throw gradapt::error("not unscaled");
      }
    });
  }
}

TEST_CASE("cuda clip_by_global_norm equals the host bit for bit on exactly summable values", "[cuda][clip]") {
  const gradapt::cuda dev{};
  const gradapt::host host{.threads = 1};
  const auto sizes = list_sizes(200, 21);
  std::vector<std::vector<float>> values;
  for (std::size_t t = 0; t < sizes.size(); ++t) values.push_back(eighths<float>(sizes[t], 100 + t));
  for (double max_norm : {1.0, 1e9, 0.0}) {
    mirrored<float> g(values);
    const double hn = gradapt::clip_by_global_norm(host, g.hviews, max_norm);
    const double dn = gradapt::clip_by_global_norm(dev, g.dviews, max_norm);
    dev.synchronize();
    REQUIRE(std::memcmp(&hn, &dn, sizeof hn) == 0);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto got = to_host(g.device[t]);
      REQUIRE(std::memcmp(got.data(), g.host[t].data(), sizes[t] * sizeof(float)) == 0);
    }
  }
}

}  // namespace gradapt_test_cuda_loss_scaler

// gradapt::half / bfloat16 <-> __half / __nv_bfloat16: the type mapping, the reinterpret
// helpers, and the device loads and stores (hardware conversions) against the host bit
// manipulation of gradapt/core/dtype.hpp, bit for bit over every 16-bit pattern and a
// large sample of float patterns.

#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"

namespace gradapt_test_cuda_device_types {

using namespace gradapt_test;

static_assert(std::is_same_v<gradapt::cuda_type_t<gradapt::half>, __half>);
static_assert(std::is_same_v<gradapt::cuda_type_t<const gradapt::bfloat16>, const __nv_bfloat16>);
static_assert(std::is_same_v<gradapt::cuda_type_t<float>, float>);
static_assert(std::is_same_v<gradapt::gradapt_type_t<const __half>, const gradapt::half>);
static_assert(std::is_same_v<gradapt::gradapt_type_t<__nv_bfloat16>, gradapt::bfloat16>);
static_assert(std::is_same_v<gradapt::gradapt_type_t<double>, double>);

namespace {

__global__ void load_all_16bit(const gradapt::half* h, const gradapt::bfloat16* b, float* fh, float* fb,
                               int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    fh[i] = gradapt::detail::device_load(h[i]);
    fb[i] = gradapt::detail::device_load(b[i]);
  }
}

__global__ void store_all(const float* f, gradapt::half* h, gradapt::bfloat16* b, std::size_t n) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < n) {
    gradapt::detail::device_store(h[i], f[i]);
    gradapt::detail::device_store(b[i], f[i]);
  }
}

/// __half arithmetic through the reinterpreted pointer: x + x computed by CUDA's type.
__global__ void double_via_cuda_type(gradapt::half* h, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    __half* p = gradapt::to_cuda(h);
    p[i] = __hadd(p[i], p[i]);
  }
}

}  // namespace

TEST_CASE("16-bit value mapping keeps the bits", "[cuda][types]") {
  for (std::uint32_t u = 0; u < 0x10000u; u += 37) {
    const auto h = gradapt::half::from_bits(static_cast<std::uint16_t>(u));
    const auto b = gradapt::bfloat16::from_bits(static_cast<std::uint16_t>(u));
    REQUIRE(gradapt::from_cuda(gradapt::to_cuda(h)).bits == h.bits);
    REQUIRE(gradapt::from_cuda(gradapt::to_cuda(b)).bits == b.bits);
    REQUIRE(static_cast<__half_raw>(gradapt::to_cuda(h)).x == h.bits);
  }
  gradapt::half arr[2] = {gradapt::half(1.5f), gradapt::half(-2.0f)};
  __half* p = gradapt::to_cuda(arr);
  REQUIRE(static_cast<void*>(p) == static_cast<void*>(arr));
  REQUIRE(gradapt::from_cuda(p) == arr);
}

TEST_CASE("device loads of every half and bfloat16 pattern equal the host loads", "[cuda][types]") {
  constexpr int n = 0x10000;
  std::vector<gradapt::half> hh(n);
  std::vector<gradapt::bfloat16> hb(n);
  for (int i = 0; i < n; ++i) {
    hh[i] = gradapt::half::from_bits(static_cast<std::uint16_t>(i));
    hb[i] = gradapt::bfloat16::from_bits(static_cast<std::uint16_t>(i));
  }
  const auto dh = to_device(hh);
  const auto db = to_device(hb);
  dvec<float> fh(n), fb(n);
  load_all_16bit<<<n / 256, 256>>>(thrust::raw_pointer_cast(dh.data()), thrust::raw_pointer_cast(db.data()),
                                   thrust::raw_pointer_cast(fh.data()), thrust::raw_pointer_cast(fb.data()),
                                   n);
  GRADAPT_CUDA_CHECK(cudaGetLastError());
  const auto gh = to_host(fh);
  const auto gb = to_host(fb);
  for (int i = 0; i < n; ++i) {
    INFO("bits " << i);
    REQUIRE(bits(gh[i]) == bits(gradapt::load(hh[i])));
    REQUIRE(bits(gb[i]) == bits(gradapt::load(hb[i])));
  }
}

TEST_CASE("device stores round like the host for float patterns", "[cuda][types]") {
  std::vector<float> f;
  // Every float whose top 16 bits vary with a fixed low half (ties, just-below, just-above),
  // and a random sample of all patterns.
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x0fffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const std::uint32_t u = (hi << 16) | lo;
      float x;
      std::memcpy(&x, &u, sizeof x);
      f.push_back(x);
    }
  std::mt19937 rng(11);
  for (int i = 0; i < 1000000; ++i) {
    const std::uint32_t u = rng();
    float x;
    std::memcpy(&x, &u, sizeof x);
    f.push_back(x);
  }
  const auto df = to_device(f);
  dvec<gradapt::half> dh(f.size());
  dvec<gradapt::bfloat16> db(f.size());
  const unsigned blocks = static_cast<unsigned>((f.size() + 255) / 256);
  store_all<<<blocks, 256>>>(thrust::raw_pointer_cast(df.data()), thrust::raw_pointer_cast(dh.data()),
                             thrust::raw_pointer_cast(db.data()), f.size());
  GRADAPT_CUDA_CHECK(cudaGetLastError());
  require_host_conversions(f, dh, db);
}

TEST_CASE("reinterpreted device pointers work with CUDA's half arithmetic", "[cuda][types]") {
  std::vector<gradapt::half> h;
  for (float x : {0.5f, -1.25f, 3.0f, 1000.0f, 40000.0f}) h.push_back(gradapt::half(x));
  auto dh = to_device(h);
  double_via_cuda_type<<<1, 32>>>(thrust::raw_pointer_cast(dh.data()), static_cast<int>(h.size()));
  GRADAPT_CUDA_CHECK(cudaGetLastError());
  const auto got = to_host(dh);
  REQUIRE(static_cast<float>(got[0]) == 1.0f);
  REQUIRE(static_cast<float>(got[1]) == -2.5f);
  REQUIRE(static_cast<float>(got[2]) == 6.0f);
  REQUIRE(static_cast<float>(got[3]) == 2000.0f);
  REQUIRE(got[4].bits == 0x7c00u);  // 80000 overflows to +inf
}

}  // namespace gradapt_test_cuda_device_types

// Thrust adapter (adapters/thrust.hpp) under the CUDA device system: device_vector,
// universal_vector and device_ptr give device_space views of the vector's own memory (the
// CUDA backend writes through them and Thrust reads the results back), host_vector gives
// host_space views, constness follows the container, and shape errors throw.
#include <thrust/copy.h>
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <thrust/universal_vector.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/adapters/thrust.hpp"

namespace gradapt_test_cuda_thrust_adapter {

using namespace gradapt_test;
using Catch::Matchers::Contains;
using gradapt::view_of;

static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA,
              "this test needs Thrust's CUDA device system");

namespace {

/// y = a x + y with a power-of-two a: exact products, one rounding on device and host alike.
template <class C>
struct axpy {
  C a;
  GRADAPT_HD void operator()(C& y, C x) const { y = a * x + y; }
};

}  // namespace

TEST_CASE("thrust adapter: the memory space follows the Thrust system", "[cuda][adapters][thrust]") {
  STATIC_REQUIRE(std::is_same_v<gradapt::thrust_space_t<thrust::device_vector<float>>, device_space>);
  STATIC_REQUIRE(std::is_same_v<gradapt::thrust_space_t<thrust::universal_vector<float>>, device_space>);
  STATIC_REQUIRE(std::is_same_v<gradapt::thrust_space_t<thrust::host_vector<float>>, host_space>);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(std::declval<thrust::device_vector<double>&>())),
                                tensor_view<double, device_space>>);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(std::declval<const thrust::device_vector<double>&>())),
                                tensor_view<const double, device_space>>);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(std::declval<thrust::host_vector<gradapt::half>&>())),
                                tensor_view<gradapt::half, host_space>>);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(thrust::device_ptr<gradapt::bfloat16>(), 0)),
                                tensor_view<gradapt::bfloat16, device_space>>);
  STATIC_REQUIRE(!gradapt::thrust_viewable<thrust::device_vector<float>>);  // a temporary would dangle
}

TEMPLATE_TEST_CASE("thrust adapter: the CUDA backend writes through device_vector views",
                   "[cuda][adapters][thrust]", float, double, gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  const std::size_t n = 3 * gradapt::chunking::chunk_elements + 11;
  const auto hx = random_values<TestType>(n, 21);
  auto hy = random_values<TestType>(n, 22);
  thrust::device_vector<TestType> dx(hx.begin(), hx.end());
  thrust::device_vector<TestType> dy(hy.begin(), hy.end());
  const thrust::device_vector<TestType>& cdx = dx;

  auto y = view_of(dy);
  REQUIRE(y.data() == thrust::raw_pointer_cast(dy.data()));
  REQUIRE(y.size() == n);
  const gradapt::cuda backend{};
  backend.apply(axpy<C>{C(0.5)}, y, view_of(cdx));
  backend.synchronize();
  for (std::size_t i = 0; i < n; ++i)
    gradapt::store(hy[i], C(0.5) * gradapt::load(hx[i]) + gradapt::load(hy[i]));
  std::vector<TestType> got(n);
  thrust::copy(dy.begin(), dy.end(), got.begin());
  for (std::size_t i = 0; i < n; ++i) {
    INFO("i = " << i);
    REQUIRE(bits(got[i]) == bits(hy[i]));
  }
}

TEST_CASE("thrust adapter: device_ptr and universal_vector views, shapes", "[cuda][adapters][thrust]") {
  const std::size_t n = 1000;
  const auto h = eighths<float>(n, 4);
  thrust::device_vector<float> d(h.begin(), h.end());
  auto p = view_of(d.data(), {10, 100});
  STATIC_REQUIRE(std::is_same_v<decltype(p), tensor_view<float, device_space>>);
  REQUIRE(p.shape_string() == "[10, 100]");
  double ref = 0;
  for (float v : h) ref += static_cast<double>(v) * v;  // exact: eighths, n small
  const gradapt::cuda backend{};
  REQUIRE(backend.reduce(gradapt::reduction::sum_squares, tensor_view<const float, device_space>(p)) == ref);

  thrust::universal_vector<double> u(64, 1.0);
  auto uv = view_of(u, {8, 8});
  STATIC_REQUIRE(std::is_same_v<decltype(uv), tensor_view<double, device_space>>);
  backend.apply([] GRADAPT_HD(double& x) { x *= 3.0; }, uv);
  backend.synchronize();
  REQUIRE(u[63] == 3.0);  // managed memory: read back through Thrust's host accessor

  REQUIRE_THROWS_WITH(view_of(d, {3, 3}), Contains("Thrust vector of 1000 elements") && Contains("holds 9"));
  REQUIRE_THROWS_WITH(view_of(d.data(), -4), Contains("dim 0 is -4"));
  thrust::host_vector<float> hv(6);
  REQUIRE(view_of(hv, {2, 3}).shape_string() == "[2, 3]");
}

}  // namespace gradapt_test_cuda_thrust_adapter

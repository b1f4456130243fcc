// Thrust adapter (adapters/thrust.hpp) on the host: this translation unit is built with
// THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP, so device_vector and device_ptr hold host
// memory and must give host_space views (the CUDA system's device_space mapping is tested in
// tests/cuda/test_cuda_thrust_adapter.cu). Views alias the containers (writes through the view
// are read back through Thrust), shapes are checked, constness follows the container.
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "catch.hpp"
#include "gradapt/adapters/thrust.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_adapter_thrust {

static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CPP, "build this test with the CPP device system");

using Catch::Matchers::Contains;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::view_of;

TEST_CASE("host_vector views are host views of the vector's memory", "[adapters][thrust]") {
  thrust::host_vector<float> h(10, 1.0f);
  auto v = view_of(h);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<float, host_space>>);
  REQUIRE(v.data() == thrust::raw_pointer_cast(h.data()));
  REQUIRE(v.shape_string() == "[10]");
  v[3] = 7.0f;
  REQUIRE(h[3] == 7.0f);
  auto s = view_of(h, {2, 5});
  REQUIRE(s.shape_string() == "[2, 5]");
  REQUIRE(s.data() == v.data());
  const thrust::host_vector<float>& ch = h;
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(ch)), tensor_view<const float, host_space>>);
  thrust::host_vector<gradapt::half> hh(4);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(hh)), tensor_view<gradapt::half, host_space>>);
  thrust::host_vector<double> empty;
  REQUIRE(view_of(empty).size() == 0);
}

TEST_CASE("device_vector of a host device system gives host views", "[adapters][thrust]") {
  thrust::device_vector<double> d(6, 2.0);
  auto v = view_of(d);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<double, host_space>>);
  STATIC_REQUIRE(std::is_same_v<gradapt::thrust_space_t<thrust::device_vector<double>>, host_space>);
  REQUIRE(v.data() == thrust::raw_pointer_cast(d.data()));
  // write through the host backend (d = 3 d + src), read back through Thrust
  thrust::host_vector<double> src(6);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = 0.5 * static_cast<double>(i);
  const thrust::host_vector<double>& csrc = src;
  gradapt::host{.threads = 1}.apply([](double& x, double s) { x = 3.0 * x + s; }, v, view_of(csrc));
  // (a copy, not d[i]: Thrust's device_reference conversion trips UBSan under the CPP system)
  const thrust::host_vector<double> back = d;
  for (std::size_t i = 0; i < back.size(); ++i) REQUIRE(back[i] == 6.0 + 0.5 * static_cast<double>(i));

  auto p = view_of(d.data(), 6);
  STATIC_REQUIRE(std::is_same_v<decltype(p), tensor_view<double, host_space>>);
  REQUIRE(p.data() == v.data());
  auto p3 = view_of(d.data(), {3, 2});
  REQUIRE(p3.shape_string() == "[3, 2]");
  thrust::device_ptr<const double> cp(thrust::raw_pointer_cast(d.data()));
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(cp, 6)), tensor_view<const double, host_space>>);
}

TEST_CASE("Thrust shape and size errors", "[adapters][thrust][errors]") {
  thrust::host_vector<float> h(10);
  REQUIRE_THROWS_WITH(view_of(h, {3, 3}),
                      Contains("Thrust vector of 10 elements") && Contains("shape [3, 3] holds 9"));
  REQUIRE_THROWS_WITH(view_of(h, {1, 1, 1, 1, 10}), Contains("rank 5 is not supported"));
  REQUIRE_THROWS_WITH(view_of(h, {-2, -5}), Contains("dim 0 is -2"));
  thrust::device_vector<float> d(4);
  REQUIRE_THROWS_WITH(view_of(d.data(), -1), Contains("dim 0 is -1"));
  REQUIRE_THROWS_WITH(view_of(thrust::device_ptr<float>(), 3), Contains("null data pointer"));
}

TEST_CASE("thrust_viewable: what view_of accepts at compile time", "[adapters][thrust]") {
  STATIC_REQUIRE(gradapt::thrust_viewable<thrust::host_vector<float>&>);
  STATIC_REQUIRE(gradapt::thrust_viewable<const thrust::device_vector<double>&>);
  STATIC_REQUIRE(!gradapt::thrust_viewable<thrust::host_vector<float>>);  // a temporary would dangle
  STATIC_REQUIRE(!gradapt::thrust_viewable<thrust::host_vector<int>&>);   // not a gradapt element type
  STATIC_REQUIRE(!gradapt::thrust_viewable<std::vector<float>&>);         // use gradapt::host_view
}

}  // namespace gradapt_test_adapter_thrust

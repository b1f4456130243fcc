// gradapt::cuda::apply on single views: results against plain host loops (bitwise, with
// functors whose arithmetic is exact or singly rounded), const inputs untouched, tensor_index,
// size-mismatch errors, stream use.

#include <cstdint>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"

namespace gradapt_test_cuda_apply {

using namespace gradapt_test;

namespace {

/// y = a * x + y with a power-of-two `a`: a * x is exact, so with or without fma contraction
/// the result is the single rounding of a * x + y, on the device and on the host.
template <class C>
struct axpy {
  C a;
  GRADAPT_HD void operator()(C& y, C x) const { y = a * x + y; }
};

/// Two outputs (one double), two inputs of different types:
/// s = x + y (rounded once into S), p = double(x) * double(y) (exact).
struct sum_and_product {
  GRADAPT_HD void operator()(float& s, double& p, float x, float y) const {
    s = x + y;
    p = static_cast<double>(x) * static_cast<double>(y);
  }
  GRADAPT_HD void operator()(double& s, double& p, double x, float y) const {
    s = x + y;
    p = x * static_cast<double>(y);
  }
};

/// Receives the tensor index: a single-view apply passes 0.
template <class C>
struct add_index {
  GRADAPT_HD void operator()(gradapt::tensor_index t, C& y) const { y += static_cast<C>(t.value) + C(1); }
};

/// h = b = x: the backend's 16-bit stores are the only rounding.
struct convert {
  GRADAPT_HD void operator()(float& h, float& b, float x) const {
    h = x;
    b = x;
  }
};

}  // namespace

TEMPLATE_TEST_CASE("cuda apply: axpy matches the host loop bitwise", "[cuda][apply]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  const gradapt::cuda backend{};
  for (std::size_t n : edge_sizes()) {
    INFO("n = " << n);
    const auto hx = random_values<TestType>(n, 1 + n);
    auto hy = random_values<TestType>(n, 2 + n);
    auto dx = to_device(hx);
    auto dy = to_device(hy);
    for (C a : {C(0.5), C(-2)}) {
      backend.apply(axpy<C>{a}, view(dy), cview(dx));
      for (std::size_t i = 0; i < n; ++i)
        gradapt::store(hy[i], a * gradapt::load(hx[i]) + gradapt::load(hy[i]));
    }
    backend.synchronize();
    const auto got = to_host(dy);
    const auto x_after = to_host(dx);
    for (std::size_t i = 0; i < n; ++i) {
      INFO("i = " << i);
      REQUIRE(bits(got[i]) == bits(hy[i]));
      REQUIRE(bits(x_after[i]) == bits(hx[i]));  // const input untouched
    }
  }
}

TEMPLATE_TEST_CASE("cuda apply: several inputs and outputs of mixed types", "[cuda][apply]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  const std::size_t n = 3 * gradapt::chunking::chunk_elements + 5;
  const auto hx = random_values<TestType>(n, 11);
  const auto hy = random_values<gradapt::bfloat16>(n, 12);
  std::vector<TestType> hs(n);
  std::vector<double> hp(n, -1.0);
  auto dx = to_device(hx);
  auto dy = to_device(hy);
  auto ds = to_device(hs);
  auto dp = to_device(hp);

  cudaStream_t stream = nullptr;
  GRADAPT_CUDA_CHECK(cudaStreamCreate(&stream));
  const gradapt::cuda backend{.stream = stream};
  backend.apply(sum_and_product{}, view(ds), view(dp), cview(dx), cview(dy));
  backend.synchronize();
  GRADAPT_CUDA_CHECK(cudaStreamDestroy(stream));

  const auto gs = to_host(ds);
  const auto gp = to_host(dp);
  for (std::size_t i = 0; i < n; ++i) {
    const C x = gradapt::load(hx[i]);
    const float y = gradapt::load(hy[i]);
    TestType s{};
    gradapt::store(s, x + y);
    INFO("i = " << i);
    REQUIRE(bits(gs[i]) == bits(s));
    REQUIRE(gp[i] == static_cast<double>(x) * static_cast<double>(y));
  }
}

TEMPLATE_TEST_CASE("cuda apply: tensor_index is 0 for a single view", "[cuda][apply]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  const std::size_t n = 1000;
  auto hy = eighths<TestType>(n, 5);
  auto dy = to_device(hy);
  gradapt::cuda{}.apply(add_index<C>{}, view(dy));
  const auto got = to_host(dy);
  for (std::size_t i = 0; i < n; ++i) {
    gradapt::store(hy[i], gradapt::load(hy[i]) + C(1));
    REQUIRE(bits(got[i]) == bits(hy[i]));
  }
}

TEST_CASE("cuda apply: 16-bit stores round to nearest even like the host", "[cuda][apply]") {
  // Values between representable halves / bfloat16s, exact ties included, plus overflow,
  // subnormals, infinities and NaNs: y = x (a conversion only).
  std::vector<float> hx;
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, sizeof f);
    hx.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 1.0f, 1.0009765625f + 0.00048828125f, 65504.0f, 65519.0f, 65520.0f, 1e-8f,
                  5.9604645e-08f, 2.9802322e-08f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN, -NAN})
    hx.push_back(f);
  auto dx = to_device(hx);
  dvec<gradapt::half> dh(hx.size());
  dvec<gradapt::bfloat16> db(hx.size());
  gradapt::cuda{}.apply(convert{}, view(dh), view(db), cview(dx));
  require_host_conversions(hx, dh, db);
}

TEST_CASE("cuda apply: size mismatch names the views and sizes", "[cuda][apply]") {
  dvec<float> a(6), b(5);
  dvec<gradapt::half> c(6);
  const gradapt::cuda backend{};
  const std::string msg = error_of([&] { backend.apply(convert{}, view(a), view(c), cview(b)); });
  REQUIRE(msg.find("gradapt::cuda::apply: view 2 has 5 elements but view 0 has 6") != std::string::npos);
  // Nothing was written.
  const auto ga = to_host(a);
  for (float v : ga) REQUIRE(v == 0.0f);
}

TEST_CASE("cuda apply: empty views launch nothing", "[cuda][apply]") {
  dvec<float> a, b;
  gradapt::cuda{}.apply(axpy<float>{1.0f}, view(a), cview(b));
  GRADAPT_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace gradapt_test_cuda_apply

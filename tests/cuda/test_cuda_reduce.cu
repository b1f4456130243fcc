// gradapt::cuda reductions and dot products: every op against a long double re-computation
// (tolerance) and against a host emulation of the documented partition (bitwise), per-tensor
// lists with empty tensors, the device-resident variants, NaN/inf handling, run-to-run
// bitwise identity, workspace reuse, and argument errors.

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"

namespace gradapt_test_cuda_reduce {

using namespace gradapt_test;
using gradapt::reduction;
namespace ck = gradapt::chunking;
namespace ops = gradapt::detail::cuda_ops;

namespace {

constexpr reduction all_ops[] = {reduction::sum, reduction::sum_squares, reduction::max_abs,
                                 reduction::count_nonfinite};

/// The documented partition, run on the host with the backend's ops: the device must match
/// it bit for bit.
template <class T>
double emulate(reduction op, const std::vector<T>& x) {
  return ops::visit(op, [&](auto o) {
    using Op = decltype(o);
    return ck::chunked_tree_reduce(
        x.size(), Op::identity(),
        [&](double a, std::size_t i) { return Op::fold(a, static_cast<double>(gradapt::load(x[i]))); },
        [](double a, double b) { return Op::combine(a, b); });
  });
}

template <class T, class U>
double emulate_dot(const std::vector<T>& x, const std::vector<U>& y) {
  using Op = ops::dot;
  return ck::chunked_tree_reduce(
      x.size(), Op::identity(),
      [&](double a, std::size_t i) {
        return Op::fold(a, static_cast<double>(gradapt::load(x[i])),
                        static_cast<double>(gradapt::load(y[i])));
      },
      [](double a, double b) { return Op::combine(a, b); });
}

/// Independent reference: long double accumulation in element order, plus the sum of
/// |terms| that bounds the rounding error of any summation order.
struct reference {
  long double value = 0;
  long double magnitude = 0;
};

template <class T>
reference naive(reduction op, const std::vector<T>& x) {
  reference r;
  bool nan = false;
  for (const T& e : x) {
    const long double v = static_cast<long double>(gradapt::load(e));
    switch (op) {
      case reduction::sum:
        r.value += v;
        r.magnitude += std::fabs(v);
        break;
      case reduction::sum_squares:
        r.value += v * v;
        r.magnitude += v * v;
        break;
      case reduction::max_abs:
        nan |= std::isnan(v);
        r.value = std::fabs(v) > r.value ? std::fabs(v) : r.value;
        break;
      case reduction::count_nonfinite:
        r.value += std::isfinite(v) ? 0 : 1;
        break;
    }
  }
  if (nan) r.value = std::numeric_limits<long double>::quiet_NaN();
  return r;
}

template <class T, class U>
reference naive_dot(const std::vector<T>& x, const std::vector<U>& y) {
  reference r;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const long double p =
        static_cast<long double>(gradapt::load(x[i])) * static_cast<long double>(gradapt::load(y[i]));
    r.value += p;
    r.magnitude += std::fabs(p);
  }
  return r;
}

void require_close(double got, const reference& ref) {
  if (std::isnan(static_cast<double>(ref.value))) {
    REQUIRE(std::isnan(got));
    return;
  }
  const long double err = std::fabs(static_cast<long double>(got) - ref.value);
  REQUIRE(err <= 1e-12L * ref.magnitude + 1e-300L);
}

template <class T>
struct tensor_list {
  std::vector<std::vector<T>> host;
  std::vector<dvec<T>> device;
  std::vector<tensor_view<const T, device_space>> views;

  tensor_list(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      host.push_back(random_values<T>(sizes[t], seed * 7919 + t));
      device.push_back(to_device(host.back()));
    }
    for (const auto& d : device) views.push_back(cview(d));
  }
};

}  // namespace

TEMPLATE_TEST_CASE("cuda reduce: every op on one tensor", "[cuda][reduce]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  const gradapt::cuda backend{};
  for (std::size_t n : edge_sizes()) {
    const auto hx = random_values<TestType>(n, 100 + n, -3.0, 2.0);
    const auto dx = to_device(hx);
    for (reduction op : all_ops) {
      INFO("n = " << n << ", op " << gradapt::name(op));
      const double got = backend.reduce(op, cview(dx));
      REQUIRE(bits(got) == bits(emulate(op, hx)));
      require_close(got, naive(op, hx));
    }
  }
}

TEMPLATE_TEST_CASE("cuda dot: one tensor pair, mixed element types", "[cuda][dot]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  const gradapt::cuda backend{};
  for (std::size_t n : edge_sizes()) {
    INFO("n = " << n);
    const auto hx = random_values<TestType>(n, 200 + n);
    const auto hy = random_values<float>(n, 300 + n);
    auto dx = to_device(hx);
    const auto dy = to_device(hy);
    const double got = backend.dot(view(dx), cview(dy));
    REQUIRE(bits(got) == bits(emulate_dot(hx, hy)));
    require_close(got, naive_dot(hx, hy));
    // dot(x, x) is sum_squares in the same order.
    REQUIRE(bits(backend.dot(cview(dx), cview(dx))) ==
            bits(backend.reduce(reduction::sum_squares, cview(dx))));
  }
}

TEMPLATE_TEST_CASE("cuda reduce: NaN, inf and empty tensors", "[cuda][reduce]", float, double, gradapt::half,
                   gradapt::bfloat16) {
  using C = gradapt::compute_t<TestType>;
  const gradapt::cuda backend{};
  const std::size_t n = 2 * ck::chunk_elements + 9;
  auto hx = random_values<TestType>(n, 7);
  gradapt::store(hx[5], std::numeric_limits<C>::infinity());
  gradapt::store(hx[ck::chunk_elements + 3], -std::numeric_limits<C>::infinity());
  auto dx = to_device(hx);
  REQUIRE(backend.reduce(reduction::count_nonfinite, cview(dx)) == 2.0);
  REQUIRE(backend.reduce(reduction::max_abs, cview(dx)) == std::numeric_limits<double>::infinity());
  REQUIRE(std::isnan(backend.reduce(reduction::sum, cview(dx))));  // inf + -inf

  gradapt::store(hx[n - 1], std::numeric_limits<C>::quiet_NaN());
  dx = to_device(hx);
  REQUIRE(backend.reduce(reduction::count_nonfinite, cview(dx)) == 3.0);
  const double mx = backend.reduce(reduction::max_abs, cview(dx));
  REQUIRE(std::isnan(mx));
  REQUIRE(bits(mx) == bits(emulate(reduction::max_abs, hx)));

  const dvec<TestType> empty;
  for (reduction op : all_ops) REQUIRE(bits(backend.reduce(op, cview(empty))) == bits(0.0));
  REQUIRE(bits(backend.dot(cview(empty), cview(empty))) == bits(0.0));
  // max_abs of all -0.0 is +0.0.
  std::vector<TestType> zeros(1000);
  for (auto& z : zeros) gradapt::store(z, C(-0.0));
  const auto dz = to_device(zeros);
  REQUIRE(bits(backend.reduce(reduction::max_abs, cview(dz))) == bits(0.0));
}

TEMPLATE_TEST_CASE("cuda reduce and dot over lists with per-tensor results", "[cuda][reduce][list]", float,
                   double, gradapt::half, gradapt::bfloat16) {
  const gradapt::cuda backend{};
  const auto sizes = list_sizes(333, 5);
  const tensor_list<TestType> xs(sizes, 1);
  const tensor_list<gradapt::bfloat16> ys(sizes, 2);
  std::vector<double> per(sizes.size(), -1.0);
  for (reduction op : all_ops) {
    INFO("op " << gradapt::name(op));
    const double total = backend.reduce(op, xs.views, per);
    double in_order = 0.0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      INFO("tensor " << t << " of size " << sizes[t]);
      // Per-tensor results do not depend on the list or the launch batching.
      REQUIRE(bits(per[t]) == bits(emulate(op, xs.host[t])));
      REQUIRE(bits(per[t]) == bits(backend.reduce(op, xs.views[t])));
      in_order = ops::visit(op, [&](auto o) { return decltype(o)::combine(in_order, per[t]); });
    }
    REQUIRE(bits(total) == bits(in_order));
    REQUIRE(bits(backend.reduce(op, xs.views, std::span<double>{})) == bits(total));
  }
  const double dtotal = backend.dot(xs.views, ys.views, per);
  double dsum = 0.0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    REQUIRE(bits(per[t]) == bits(emulate_dot(xs.host[t], ys.host[t])));
    dsum += per[t];
  }
  REQUIRE(bits(dtotal) == bits(dsum));
}

TEMPLATE_TEST_CASE("cuda reduce_to and dot_to stay on the device and match the host forms", "[cuda][reduce]",
                   float, double, gradapt::half, gradapt::bfloat16) {
  cudaStream_t stream = nullptr;
  GRADAPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const gradapt::cuda backend{.stream = stream};
  const auto sizes = list_sizes(211, 9);
  const tensor_list<TestType> xs(sizes, 3);
  const tensor_list<float> ys(sizes, 4);
  dvec<double> per(sizes.size());
  dvec<double> total(1);
  std::vector<double> host_per(sizes.size());
  for (reduction op : all_ops) {
    INFO("op " << gradapt::name(op));
    backend.reduce_to(op, xs.views, view(per), view(total));
    backend.synchronize();
    const double want = backend.reduce(op, xs.views, host_per);
    const auto got_per = to_host(per);
    REQUIRE(bits(to_host(total)[0]) == bits(want));
    for (std::size_t t = 0; t < sizes.size(); ++t) REQUIRE(bits(got_per[t]) == bits(host_per[t]));
    // Total only, per-tensor only, one tensor.
    backend.reduce_to(op, xs.views, tensor_view<double, device_space>{}, view(total));
    backend.synchronize();
    REQUIRE(bits(to_host(total)[0]) == bits(want));
    backend.reduce_to(op, xs.views[3], view(total));
    backend.synchronize();
    REQUIRE(bits(to_host(total)[0]) == bits(host_per[3]));
  }
  backend.dot_to(xs.views, ys.views, view(per), view(total));
  backend.synchronize();
  const double want = backend.dot(xs.views, ys.views, host_per);
  REQUIRE(bits(to_host(total)[0]) == bits(want));
  const auto got_per = to_host(per);
  for (std::size_t t = 0; t < sizes.size(); ++t) REQUIRE(bits(got_per[t]) == bits(host_per[t]));
  backend.dot_to(xs.views[5], ys.views[5], view(total));
  backend.synchronize();
  REQUIRE(bits(to_host(total)[0]) == bits(host_per[5]));
  // An empty list: the total is the identity.
  const std::vector<tensor_view<const TestType, device_space>> none;
  backend.reduce_to(reduction::sum, none, tensor_view<double, device_space>{}, view(total));
  backend.synchronize();
  REQUIRE(to_host(total)[0] == 0.0);
  GRADAPT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda reduce: bitwise identical across runs, streams and backend objects", "[cuda][reduce]") {
  const std::size_t n = (std::size_t{1} << 22) + 12345;
  const auto hx = random_values<float>(n, 42, -1e3, 1e3);
  const auto hy = random_values<double>(n, 43);
  const auto dx = to_device(hx);
  const auto dy = to_device(hy);
  const gradapt::cuda first{};
  cudaStream_t stream = nullptr;
  GRADAPT_CUDA_CHECK(cudaStreamCreate(&stream));
  const gradapt::cuda second{.stream = stream};
  for (reduction op : all_ops) {
    const double ref = first.reduce(op, cview(dx));
    for (int run = 0; run < 5; ++run) {
      REQUIRE(bits(first.reduce(op, cview(dx))) == bits(ref));
      REQUIRE(bits(second.reduce(op, cview(dx))) == bits(ref));
    }
  }
  const double d = first.dot(cview(dx), cview(dy));
  for (int run = 0; run < 5; ++run) REQUIRE(bits(second.dot(cview(dx), cview(dy))) == bits(d));
  GRADAPT_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda reduce: the reserved workspace is reused without growth", "[cuda][workspace]") {
  const auto sizes = list_sizes(150, 77);
  const tensor_list<float> xs(sizes, 1);
  const gradapt::cuda backend{};
  const gradapt::cuda copy = backend;  // copies share the workspace
  REQUIRE(copy.workspace == backend.workspace);
  backend.reserve_for(xs.views);
  const std::size_t dev = backend.workspace->device_capacity();
  const std::size_t pinned = backend.workspace->pinned_capacity();
  REQUIRE(dev >= gradapt::cuda::workspace_bytes(xs.views));
  REQUIRE(pinned >= sizes.size() * sizeof(double));
  std::vector<double> per(sizes.size());
  dvec<double> dper(sizes.size());
  for (int step = 0; step < 3; ++step) {
    for (reduction op : all_ops) {
      (void)copy.reduce(op, xs.views, per);
      copy.reduce_to(op, xs.views, view(dper));
    }
    (void)copy.dot(xs.views, xs.views, per);
  }
  copy.synchronize();
  REQUIRE(backend.workspace->device_capacity() == dev);
  REQUIRE(backend.workspace->pinned_capacity() == pinned);
}

TEST_CASE("cuda reductions: argument errors", "[cuda][reduce]") {
  const gradapt::cuda backend{};
  const tensor_list<float> a({3, 4, 5}, 1), b({3, 4, 6}, 2), c({3, 4}, 3);
  std::vector<double> per(2);
  REQUIRE(error_of([&] {
            (void)backend.reduce(reduction::sum, a.views, per);
          }).find("gradapt::cuda::reduce: per_tensor has 2 slots for 3 tensors") != std::string::npos);
  REQUIRE(error_of([&] {
            (void)backend.dot(a.views, b.views, std::span<double>{});
          }).find("gradapt::cuda::dot: tensor 2 has 6 elements in list 1 but 5 in list 0") !=
          std::string::npos);
  REQUIRE(error_of([&] {
            (void)backend.dot(a.views, c.views, std::span<double>{});
          }).find("gradapt::cuda::dot: list 1 holds 2 tensors but list 0 holds 3") != std::string::npos);
  REQUIRE(error_of([&] {
            (void)backend.dot(a.views[0], a.views[1]);
          }).find("gradapt::cuda::dot: y has 4 elements but x has 3 (expected equal sizes)") !=
          std::string::npos);
  dvec<double> two(2);
  REQUIRE(error_of([&] {
            backend.dot_to(a.views[0], a.views[1], view(two));
          }).find("gradapt::cuda::dot_to: y has 4 elements but x has 3") != std::string::npos);
  REQUIRE(error_of([&] {
            backend.reduce_to(reduction::sum, a.views[0], view(two));
          }).find("gradapt::cuda::reduce_to: result has 2 elements (expected 1)") != std::string::npos);
  REQUIRE(error_of([&] {
            backend.reduce_to(reduction::sum, a.views, view(two));
          }).find("gradapt::cuda::reduce_to: per_tensor has 2 elements for 3 tensors") != std::string::npos);
  REQUIRE(error_of([&] {
            backend.reduce_to(reduction::sum, a.views, tensor_view<double, device_space>{});
          }).find("both empty") != std::string::npos);
  REQUIRE(error_of([&] {
            backend.dot_to(a.views, a.views, tensor_view<double, device_space>{}, view(two));
          }).find("gradapt::cuda::dot_to: total has 2 elements (expected 1") != std::string::npos);
  REQUIRE(error_of([&] {
            (void)backend.reduce(static_cast<reduction>(42), a.views[0]);
          }).find("unknown reduction 42") != std::string::npos);
}

namespace {
template <class V>
concept reducible = requires(const gradapt::cuda& b, V v) {
  b.reduce(reduction::sum, v);
};
template <class V>
concept dottable = requires(const gradapt::cuda& b, V v) {
  b.dot(v, v);
};
template <class V>
concept reducible_to = requires(const gradapt::cuda& b, V v, tensor_view<double, device_space> out) {
  b.reduce_to(reduction::sum, v, out);
};
}  // namespace

TEST_CASE("cuda backend rejects host views at compile time", "[cuda]") {
  STATIC_REQUIRE(!reducible<tensor_view<float, host_space>>);
  STATIC_REQUIRE(!dottable<tensor_view<float, host_space>>);
  STATIC_REQUIRE(!reducible_to<tensor_view<float, host_space>>);
  STATIC_REQUIRE(reducible<tensor_view<const gradapt::half, device_space>>);
  STATIC_REQUIRE(dottable<tensor_view<gradapt::bfloat16, device_space>>);
  STATIC_REQUIRE(reducible_to<tensor_view<double, device_space>>);
  STATIC_REQUIRE(gradapt::backend<gradapt::cuda>);
  STATIC_REQUIRE(std::is_same_v<gradapt::cuda::space, device_space>);
}

}  // namespace gradapt_test_cuda_reduce

// gradapt::cuda::apply_list over hundreds of tensors (empty ones, scalars, chunk multiples):
// results against plain host loops (bitwise, exact arithmetic), tensor_index, mixed element
// types, the few-launches property, and length/size mismatch errors.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"

namespace gradapt_test_cuda_apply_list {

using namespace gradapt_test;

namespace {

/// y = 2 * x + y + t (t the tensor index): exact for the k/8 inputs and t < 256 in every
/// element type, so device and host agree bitwise.
template <class C>
struct scaled_add_index {
  GRADAPT_HD void operator()(gradapt::tensor_index t, C& y, C x) const {
    y = C(2) * x + y + static_cast<C>(t.value % 256);
  }
};

/// Three lists of different types, no index: m = m + g (float compute), v = v + g*g (double).
template <class C>
struct moments {
  GRADAPT_HD void operator()(C& m, double& v, float g) const {
    m = m + static_cast<C>(g);
    v = v + static_cast<double>(g) * static_cast<double>(g);
  }
};

/// Host-side storage of a list: one std::vector per tensor, their device copies and views.
template <class T>
struct tensor_list {
  std::vector<std::vector<T>> host;
  std::vector<dvec<T>> device;
  std::vector<tensor_view<T, device_space>> views;

  tensor_list(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      host.push_back(eighths<T>(sizes[t], seed * 1000 + t));
      device.push_back(to_device(host.back()));
    }
    for (auto& d : device) views.push_back(view(d));
  }
  std::vector<tensor_view<const T, device_space>> const_views() const { return {views.begin(), views.end()}; }
};

}  // namespace

TEMPLATE_TEST_CASE("cuda apply_list: hundreds of tensors with tensor_index", "[cuda][apply_list]", float,
                   double, gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{300}, std::size_t{701}}) {
    const auto sizes = list_sizes(count, count);
    tensor_list<TestType> ys(sizes, 1), xs(sizes, 2);
    const auto cx = xs.const_views();
    const gradapt::cuda backend{};
    backend.apply_list(scaled_add_index<C>{}, ys.views,
                       std::span<const tensor_view<const TestType, device_space>>(cx));
    backend.synchronize();
    for (std::size_t t = 0; t < count; ++t) {
      const auto got = to_host(ys.device[t]);
      const auto x_after = to_host(xs.device[t]);
      REQUIRE(got.size() == sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        TestType want{};
        gradapt::store(want, C(2) * gradapt::load(xs.host[t][i]) + gradapt::load(ys.host[t][i]) +
                                 static_cast<C>(t % 256));
        INFO("count " << count << ", tensor " << t << " of size " << sizes[t] << ", element " << i);
        REQUIRE(bits(got[i]) == bits(want));
        REQUIRE(bits(x_after[i]) == bits(xs.host[t][i]));
      }
    }
  }
}

TEMPLATE_TEST_CASE("cuda apply_list: mixed element types without index", "[cuda][apply_list]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using C = compute_t<TestType>;
  const auto sizes = list_sizes(257, 99);
  tensor_list<TestType> ms(sizes, 3);
  tensor_list<double> vs(sizes, 4);
  tensor_list<gradapt::bfloat16> gs(sizes, 5);
  const auto cg = gs.const_views();
  gradapt::cuda{}.apply_list(moments<C>{}, ms.views, vs.views, cg);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto gm = to_host(ms.device[t]);
    const auto gv = to_host(vs.device[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      const float g = gradapt::load(gs.host[t][i]);
      TestType m{};
      gradapt::store(m, gradapt::load(ms.host[t][i]) + static_cast<C>(g));
      INFO("tensor " << t << ", element " << i);
      REQUIRE(bits(gm[i]) == bits(m));
      REQUIRE(gv[i] == vs.host[t][i] + static_cast<double>(g) * static_cast<double>(g));
    }
  }
}

TEST_CASE("cuda apply_list: every tensor empty, and an empty list", "[cuda][apply_list]") {
  const std::vector<std::size_t> sizes(500, 0);
  tensor_list<float> ys(sizes, 1), xs(sizes, 2);
  const gradapt::cuda backend{};
  backend.apply_list(scaled_add_index<float>{}, ys.views, xs.views);
  const std::vector<tensor_view<float, device_space>> none;
  backend.apply_list(scaled_add_index<float>{}, none, none);
  backend.synchronize();
}

TEST_CASE("cuda apply_list: length and size mismatches name tensor, lists and sizes", "[cuda][apply_list]") {
  tensor_list<float> a({3, 4, 5}, 1), b({3, 4, 6}, 2), c({3, 4}, 3);
  const gradapt::cuda backend{};
  const std::string sizes_msg =
      error_of([&] { backend.apply_list(scaled_add_index<float>{}, a.views, b.views); });
  REQUIRE(sizes_msg.find("gradapt::cuda::apply_list: tensor 2 has 6 elements in list 1 but 5 in list 0") !=
          std::string::npos);
  const std::string length_msg =
      error_of([&] { backend.apply_list(scaled_add_index<float>{}, a.views, c.views); });
  REQUIRE(length_msg.find("gradapt::cuda::apply_list: list 1 holds 2 tensors but list 0 holds 3") !=
          std::string::npos);
  // Nothing was launched: list 0 is unchanged.
  for (std::size_t t = 0; t < 3; ++t) {
    const auto got = to_host(a.device[t]);
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(bits(got[i]) == bits(a.host[t][i]));
  }
}

TEST_CASE("cuda apply_list: a launch carries dozens of tensors", "[cuda][apply_list]") {
  // The kernel-argument budget holds many tensors per launch (the few-launches property).
  using namespace gradapt::detail::cuda_impl;
  STATIC_REQUIRE(batch_capacity<1, 16> >= 160);
  STATIC_REQUIRE(batch_capacity<2, 16> >= 120);
  STATIC_REQUIRE(batch_capacity<4, 16> >= 80);
  STATIC_REQUIRE(sizeof(tensor_batch<4, batch_capacity<4, 16>>) + 16 <= 4096);
}

}  // namespace gradapt_test_cuda_apply_list

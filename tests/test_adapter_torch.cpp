// LibTorch adapter (adapters/torch.hpp), tensor views: views alias the tensor's memory (writes
// through the view are read back through LibTorch), sizes and storage offsets carry over, and
// every mismatch (dtype, device, layout, strides, rank, negation bit, undefined) throws a
// gradapt::error naming what was found. Only ATen's per-operator headers are included, to keep
// this translation unit small; the module helper is tested in test_adapter_torch_module.cpp.
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <type_traits>

#include "catch.hpp"
#include "gradapt/adapters/torch.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_adapter_torch {

using Catch::Matchers::Contains;
using gradapt::device_space;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::view_of;

TEST_CASE("float32 and float64 CPU tensors are viewed in place", "[adapters][torch]") {
  at::Tensor t = at::zeros({2, 3, 4}, at::kFloat);
  auto v = view_of<float>(t);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<float, host_space>>);
  REQUIRE(v.data() == t.data_ptr<float>());
  REQUIRE(v.shape_string() == "[2, 3, 4]");
  v[(1 * 3 + 2) * 4 + 1] = 6.5f;  // row-major (1, 2, 1)
  REQUIRE(t[1][2][1].item<float>() == 6.5f);

  at::Tensor d = at::arange(10, at::kDouble);
  auto dv = view_of<double>(d);
  REQUIRE(dv.shape_string() == "[10]");
  for (std::size_t i = 0; i < 10; ++i) REQUIRE(dv[i] == static_cast<double>(i));
  // write through the host backend, read back through LibTorch
  gradapt::host{.threads = 1}.apply([](double& x) { x = x * x; }, dv);
  for (std::int64_t i = 0; i < 10; ++i) REQUIRE(d[i].item<double>() == static_cast<double>(i * i));

  // read-only views of the same memory
  auto cv = view_of<const double>(d);
  STATIC_REQUIRE(std::is_same_v<decltype(cv), tensor_view<const double, host_space>>);
  REQUIRE(cv.data() == dv.data());

  // rank 0, empty, rank 4
  at::Tensor s = at::full({}, 2.0, at::kFloat);
  REQUIRE(view_of<float>(s).rank() == 0);
  REQUIRE(view_of<float>(s)[0] == 2.0f);
  at::Tensor e = at::zeros({3, 0}, at::kFloat);
  REQUIRE(view_of<float>(e).size() == 0);
  REQUIRE(view_of<float>(e).shape_string() == "[3, 0]");
  REQUIRE(view_of<float>(at::zeros({1, 2, 3, 4}, at::kFloat)).shape_string() == "[1, 2, 3, 4]");
}

TEST_CASE("16-bit tensors map to gradapt::half and gradapt::bfloat16", "[adapters][torch][dtype]") {
  at::Tensor h = at::arange(-4, 4, at::kFloat).mul(0.375).to(at::kHalf);
  auto hv = view_of<gradapt::half>(h);
  STATIC_REQUIRE(std::is_same_v<decltype(hv), tensor_view<gradapt::half, host_space>>);
  for (std::int64_t i = 0; i < 8; ++i)
    REQUIRE(static_cast<float>(hv[static_cast<std::size_t>(i)]) == h[i].item<float>());
  // y = 0.1 y in float, rounded once to half: LibTorch's own rounding must agree
  gradapt::host{.threads = 1}.apply([](float& y) { y = y * 0.1f; }, hv);
  at::Tensor ref = at::arange(-4, 4, at::kFloat).mul(0.375).mul(0.1).to(at::kHalf);
  REQUIRE(h.equal(ref));

  at::Tensor b = at::arange(0, 6, at::kFloat).div(7.0).to(at::kBFloat16);
  auto bv = view_of<gradapt::bfloat16>(b);
  for (std::int64_t i = 0; i < 6; ++i)
    REQUIRE(static_cast<float>(bv[static_cast<std::size_t>(i)]) == b[i].item<float>());
  bv[5] = gradapt::bfloat16(-3.0f);
  REQUIRE(b[5].item<float>() == -3.0f);
}

TEST_CASE("views start at the storage offset of a contiguous slice", "[adapters][torch]") {
  at::Tensor t = at::arange(24, at::kFloat).reshape({4, 6});
  at::Tensor rows = t.slice(0, 1, 3);  // rows 1 and 2: contiguous, offset 6
  auto v = view_of<float>(rows);
  REQUIRE(v.shape_string() == "[2, 6]");
  REQUIRE(v.data() == t.data_ptr<float>() + 6);
  REQUIRE(v[0] == 6.0f);
  v[11] = -1.0f;
  REQUIRE(t[2][5].item<float>() == -1.0f);
  // size-1 dims with odd strides are still contiguous
  at::Tensor col = t.slice(1, 2, 3).slice(0, 0, 1);  // [1, 1]
  REQUIRE(view_of<float>(col).size() == 1);
}

TEST_CASE("torch views reject what they cannot alias, and say what was found", "[adapters][torch][errors]") {
  at::Tensor f = at::zeros({3, 4}, at::kFloat);
  // dtype
  REQUIRE_THROWS_WITH(view_of<double>(f), Contains("has dtype Float but float64 was requested") &&
                                              Contains("expected torch dtype Double"));
  REQUIRE_THROWS_WITH(view_of<gradapt::half>(f), Contains("has dtype Float but float16 was requested"));
  REQUIRE_THROWS_WITH(view_of<float>(at::zeros({2}, at::kLong)), Contains("has dtype Long"));
  REQUIRE_THROWS_WITH(view_of<gradapt::bfloat16>(at::zeros({2}, at::kHalf)),
                      Contains("has dtype Half but bfloat16 was requested"));
  // device: a CPU tensor requested as device memory
  REQUIRE_THROWS_WITH((view_of<float, device_space>(f)),
                      Contains("on device cpu but a device view was requested") && Contains("CUDA tensor"));
  // strides
  REQUIRE_THROWS_WITH(view_of<float>(f.t()), Contains("is not contiguous (sizes [4, 3], strides [1, 4]") &&
                                                 Contains(".contiguous()"));
  REQUIRE_THROWS_WITH(view_of<float>(f.slice(1, 0, 4, 2)), Contains("sizes [3, 2], strides [4, 2]"));
  REQUIRE_THROWS_WITH(view_of<float>(f.slice(1, 1, 3)), Contains("strides [4, 1]"));
  // rank
  REQUIRE_THROWS_WITH(view_of<float>(at::zeros({1, 2, 1, 2, 3}, at::kFloat)),
                      Contains("has rank 5 (sizes [1, 2, 1, 2, 3]") && Contains("expected 0 to 4"));
  // layout
  REQUIRE_THROWS_WITH(view_of<float>(f.to_sparse()),
                      Contains("has layout Sparse") && Contains(".to_dense()"));
  // lazy negation
  REQUIRE_THROWS_WITH(view_of<float>(f._neg_view()), Contains("negation bit") && Contains("resolve_neg"));
  REQUIRE(view_of<float>(f._neg_view().resolve_neg()).size() == 12);
  // undefined
  REQUIRE_THROWS_WITH(view_of<float>(at::Tensor()),
                      Contains("tensor is undefined") && Contains("backward()"));
  // a contiguous copy is fine (and is a different buffer)
  at::Tensor c = f.t().contiguous();
  REQUIRE(view_of<float>(c).shape_string() == "[4, 3]");
  REQUIRE(view_of<float>(c).data() != f.data_ptr<float>());
}

}  // namespace gradapt_test_adapter_torch

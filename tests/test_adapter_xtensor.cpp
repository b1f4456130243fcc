// xtensor adapter (adapters/xtensor.hpp): views alias xtensor's storage (writes through the view
// are read back through xtensor's own indexing), shapes are xtensor's, constness follows the
// object, and non-contiguous layouts, strided slices and rank > 4 throw.
#include <array>
#include <cstddef>
#include <type_traits>
#include <vector>
#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xbroadcast.hpp>
#include <xtensor/xfixed.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xstrided_view.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xview.hpp>

#include "catch.hpp"
#include "gradapt/adapters/xtensor.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_adapter_xtensor {

using Catch::Matchers::Contains;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::view_of;

TEST_CASE("xarray and xtensor views keep the shape and alias the storage", "[adapters][xtensor]") {
  xt::xarray<float> a = xt::zeros<float>({2, 3, 4});
  auto v = view_of(a);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<float, host_space>>);
  REQUIRE(v.data() == a.data());
  REQUIRE(v.shape_string() == "[2, 3, 4]");
  // row-major: flat index (i * 3 + j) * 4 + k is a(i, j, k)
  v[(1 * 3 + 2) * 4 + 3] = 5.0f;
  REQUIRE(a(1, 2, 3) == 5.0f);
  a(0, 1, 2) = -1.0f;
  REQUIRE(v[(0 * 3 + 1) * 4 + 2] == -1.0f);

  xt::xtensor<double, 2> t = xt::zeros<double>({5, 2});
  auto tv = view_of(t);
  STATIC_REQUIRE(std::is_same_v<decltype(tv), tensor_view<double, host_space>>);
  REQUIRE(tv.shape_string() == "[5, 2]");
  tv[9] = 4.0;
  REQUIRE(t(4, 1) == 4.0);

  xt::xtensor_fixed<float, xt::xshape<2, 2>> fx = {{1.0f, 2.0f}, {3.0f, 4.0f}};
  REQUIRE(view_of(fx).shape_string() == "[2, 2]");
  REQUIRE(view_of(fx)[2] == 3.0f);

  // rank 0 and rank 1, empty, and rank 4
  xt::xarray<double> s = 3.0;
  REQUIRE(view_of(s).rank() == 0);
  REQUIRE(view_of(s).size() == 1);
  xt::xtensor<float, 1> r1 = xt::zeros<float>({7});
  REQUIRE(view_of(r1).shape_string() == "[7]");
  xt::xarray<float> empty = xt::zeros<float>({3, 0});
  REQUIRE(view_of(empty).size() == 0);
  REQUIRE(view_of(empty).shape_string() == "[3, 0]");
  xt::xarray<float> r4 = xt::zeros<float>({2, 1, 3, 2});
  REQUIRE(view_of(r4).shape_string() == "[2, 1, 3, 2]");

  const xt::xarray<float>& ca = a;
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(ca)), tensor_view<const float, host_space>>);
}

TEST_CASE("xt::adapt views the adapted buffer", "[adapters][xtensor]") {
  std::vector<float> buf(12, 0.0f);
  std::array<std::size_t, 2> shape{3, 4};
  auto ad = xt::adapt(buf, shape);
  auto v = view_of(ad);
  REQUIRE(v.data() == buf.data());
  REQUIRE(v.shape_string() == "[3, 4]");
  v[6] = 9.0f;  // (1, 2)
  REQUIRE(ad(1, 2) == 9.0f);
  REQUIRE(buf[6] == 9.0f);
  // an rvalue adaptor of a pointer (non-owning) is fine
  auto v2 = view_of(xt::adapt(buf.data(), buf.size(), xt::no_ownership(), std::vector<std::size_t>{2, 6}));
  REQUIRE(v2.data() == buf.data());
  REQUIRE(v2.shape_string() == "[2, 6]");
  // adaptors of const memory give read-only views
  const std::vector<float>& cbuf = buf;
  auto cad = xt::adapt(cbuf.data(), cbuf.size(), xt::no_ownership(), std::vector<std::size_t>{12});
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(cad)), tensor_view<const float, host_space>>);
  REQUIRE(view_of(cad)[6] == 9.0f);
}

TEST_CASE("contiguous strided views are accepted at their offset", "[adapters][xtensor]") {
  xt::xarray<double> a = xt::arange<double>(24.0);
  a.reshape({2, 3, 4});
  auto row = xt::view(a, 1, 2, xt::all());  // a(1, 2, :), contiguous
  auto rv = view_of(row);
  REQUIRE(rv.shape_string() == "[4]");
  REQUIRE(rv.data() == &a(1, 2, 0));
  REQUIRE(rv[3] == a(1, 2, 3));
  rv[0] = -5.0;
  REQUIRE(a(1, 2, 0) == -5.0);
  auto slab = xt::view(a, 1);  // a(1, :, :)
  REQUIRE(view_of(slab).shape_string() == "[3, 4]");
  REQUIRE(view_of(slab).data() == &a(1, 0, 0));
  auto rows = xt::view(a, 0, xt::range(1, 3), xt::all());  // whole rows: contiguous
  REQUIRE(view_of(rows).shape_string() == "[2, 4]");
  REQUIRE(view_of(rows)[0] == a(0, 1, 0));
}

TEST_CASE("non-contiguous xtensor layouts throw with shape and strides", "[adapters][xtensor][errors]") {
  xt::xarray<float> a = xt::zeros<float>({3, 4});
  // a column of a row-major matrix
  auto col = xt::view(a, xt::all(), 1);
  REQUIRE_THROWS_WITH(view_of(col), Contains("shape [3]") && Contains("strides are [4]") &&
                                        Contains("axis 0 needs stride 1") && Contains("row-major"));
  // a column range: rows are not adjacent
  auto cols = xt::view(a, xt::all(), xt::range(0, 2));
  REQUIRE_THROWS_WITH(view_of(cols), Contains("strides are [4, 1]") && Contains("axis 0 needs stride 2"));
  // a step of 2
  auto step = xt::view(a, xt::range(0, 3, 2), xt::all());
  REQUIRE_THROWS_WITH(view_of(step), Contains("axis 0 needs stride 4"));
  // column-major storage
  xt::xarray<double, xt::layout_type::column_major> cm = xt::zeros<double>({2, 3});
  REQUIRE_THROWS_WITH(view_of(cm), Contains("strides are [1, 2]") && Contains("column-major container"));
  xt::xtensor<double, 2, xt::layout_type::column_major> cm1 = xt::zeros<double>({1, 5});
  REQUIRE(view_of(cm1).shape_string() == "[1, 5]");  // one row: contiguous either way
  // a transposed strided view
  auto tr = xt::transpose(a);
  REQUIRE_THROWS_AS(view_of(tr), gradapt::error);
  // rank 5
  xt::xarray<float> r5 = xt::zeros<float>({1, 2, 1, 2, 2});
  REQUIRE_THROWS_WITH(view_of(r5), Contains("rank 5 is not supported") && Contains("shape [1, 2, 1, 2, 2]"));
  xt::xtensor<double, 6> t6 = xt::zeros<double>({1, 1, 1, 1, 1, 1});
  REQUIRE_THROWS_WITH(view_of(t6), Contains("rank 6"));
  // empty slices are fine whatever their strides
  auto none = xt::view(a, xt::all(), xt::range(0, 0));
  REQUIRE(view_of(none).size() == 0);
}

TEST_CASE("xtensor_viewable: what view_of accepts at compile time", "[adapters][xtensor]") {
  using A = xt::xarray<float>;
  STATIC_REQUIRE(gradapt::xtensor_viewable<A&>);
  STATIC_REQUIRE(gradapt::xtensor_viewable<const A&>);
  STATIC_REQUIRE(!gradapt::xtensor_viewable<A>);  // an owning temporary would dangle
  STATIC_REQUIRE(!gradapt::xtensor_viewable<A&&>);
  STATIC_REQUIRE(!gradapt::xtensor_viewable<xt::xtensor<double, 2>>);
  STATIC_REQUIRE(gradapt::xtensor_viewable<decltype(xt::adapt(std::declval<std::vector<float>&>()))>);
  STATIC_REQUIRE(!gradapt::xtensor_viewable<xt::xarray<int>&>);  // not a gradapt element type
  STATIC_REQUIRE(gradapt::xtensor_viewable<xt::xarray<gradapt::half>&>);
  // expressions without storage
  STATIC_REQUIRE(!gradapt::xtensor_strided<decltype(std::declval<A&>() + std::declval<A&>())>);
  STATIC_REQUIRE(!gradapt::xtensor_strided<std::vector<float>&>);
}

TEST_CASE("xtensor views feed the host backend", "[adapters][xtensor]") {
  xt::xarray<double> g = xt::arange<double>(-20.0, 21.0);
  g.reshape({41});
  xt::xarray<double> p = xt::ones<double>({41});
  const gradapt::host backend{.threads = 2};
  backend.apply([](double& w, double d) { w -= 0.5 * d; }, view_of(p), tensor_view<const double>(view_of(g)));
  const xt::xarray<double> expect = 1.0 - 0.5 * g;
  const bool same = (p == expect);  // (an xtensor comparison cannot go through Catch's decomposer)
  REQUIRE(same);
  // sum of squares of -20..20 is 2 * 20 * 21 * 41 / 6 (exact in double)
  REQUIRE(backend.reduce(gradapt::reduction::sum_squares, tensor_view<const double>(view_of(g))) ==
          2.0 * 20 * 21 * 41 / 6);
}

TEST_CASE("xt::noalias assignment updates the viewed memory in place", "[adapters][xtensor]") {
  xt::xtensor<float, 1> a = xt::zeros<float>({5});
  const xt::xtensor<float, 1> b = xt::arange<float>(5.0f);
  const auto v = view_of(a);
  xt::noalias(a) = 2.0f * b + 1.0f;  // in place (a plain `a = ...` moves a new buffer in)
  REQUIRE(a.data() == v.data());
  for (std::size_t i = 0; i < 5; ++i) REQUIRE(v[i] == 2.0f * static_cast<float>(i) + 1.0f);
}

}  // namespace gradapt_test_adapter_xtensor

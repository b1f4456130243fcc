#include <array>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt_test_tensor_view {

using gradapt::tensor_view;

TEST_CASE("tensor_view describes shape, size and type", "[tensor_view]") {
  std::vector<float> buf(24);
  tensor_view<float> v(buf.data(), {2, 3, 4});
  REQUIRE(v.rank() == 3);
  REQUIRE(v.size() == 24);
  REQUIRE(v.bytes() == 96);
  REQUIRE(v.dim(1) == 3);
  REQUIRE(v.shape_string() == "[2, 3, 4]");
  REQUIRE(v.type() == gradapt::dtype::float32);
  REQUIRE(v.flat().rank() == 1);
  REQUIRE(v.flat().size() == 24);
  v[5] = 3.0f;
  REQUIRE(buf[5] == 3.0f);

  tensor_view<const float> c = v;  // implicit read-only view
  REQUIRE(c.data() == buf.data());
  REQUIRE(c.same_shape(v));

  float s = 1;
  auto scalar = tensor_view<float>::scalar(&s);
  REQUIRE(scalar.rank() == 0);
  REQUIRE(scalar.size() == 1);

  tensor_view<double> four(nullptr, {3, 0, 2, 5});  // empty: a null pointer is fine
  REQUIRE(four.size() == 0);
  REQUIRE(four.empty());
  REQUIRE(tensor_view<float>().size() == 0);
}

TEST_CASE("tensor_view rejects invalid shapes with actionable errors", "[tensor_view][errors]") {
  std::vector<float> buf(8);
  REQUIRE_THROWS_WITH((tensor_view<float>(buf.data(), {1, 1, 1, 1, 8})),
                      Catch::Matchers::Contains("rank 5 is not supported"));
  REQUIRE_THROWS_WITH((tensor_view<float>(buf.data(), {2, -1})), Catch::Matchers::Contains("dim 1 is -1"));
  REQUIRE_THROWS_WITH((tensor_view<float>(nullptr, {2, 2})), Catch::Matchers::Contains("null data pointer"));
  REQUIRE_THROWS_WITH((tensor_view<float>(buf.data(), {1LL << 40, 1LL << 40})),
                      Catch::Matchers::Contains("overflows"));
  REQUIRE_THROWS_AS(gradapt::host_view(buf, {3, 3}), gradapt::error);
  REQUIRE(gradapt::host_view(buf, {2, 4}).shape_string() == "[2, 4]");
}

TEST_CASE("memory spaces are distinct types", "[tensor_view]") {
  STATIC_REQUIRE(!std::is_convertible_v<tensor_view<float, gradapt::host_space>,
                                        tensor_view<float, gradapt::device_space>>);
  STATIC_REQUIRE(!std::is_convertible_v<tensor_view<const float>, tensor_view<float>>);
  STATIC_REQUIRE(gradapt::view_list<std::vector<tensor_view<float>>, gradapt::host_space>);
  STATIC_REQUIRE(!gradapt::view_list<std::vector<tensor_view<float>>, gradapt::device_space>);
}

}  // namespace gradapt_test_tensor_view

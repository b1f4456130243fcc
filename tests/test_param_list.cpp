#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/param_list.hpp"

namespace gradapt_test_param_list {

using gradapt::host_view;

TEST_CASE("param_list views framework buffers without copies", "[param_list]") {
  std::vector<float> w1(6), g1(6), w2(3), g2(3);
  gradapt::param_list<float, gradapt::bfloat16> params;  // grads are 16-bit here
  std::vector<gradapt::bfloat16> bg1(6), bg2(3);
  const auto enc = params.add_group("no_decay", {.lr_scale = 0.5, .weight_decay = 0.0});
  REQUIRE(enc == 1);
  params.add("layer.weight", host_view(w1, {2, 3}), host_view(bg1, {2, 3}));
  params.add("layer.bias", host_view(w2), host_view(bg2),
             {.skip_weight_decay = true, .skip_trust_ratio = true}, enc);
  REQUIRE(params.size() == 2);
  REQUIRE(params.total_elements() == 9);
  REQUIRE(params.values()[0].data() == w1.data());
  REQUIRE(params.grads()[1].data() == bg2.data());
  REQUIRE(params.at("layer.bias").flags.skip_weight_decay);
  REQUIRE(params[1].group == 1);
  REQUIRE(params.group(1).members == std::vector<std::size_t>{1});
  REQUIRE(params.group(0).members == std::vector<std::size_t>{0});
  REQUIRE(params.group(1).options.lr_scale == 0.5);
  params.options(1).lr_scale = 0.25;
  REQUIRE(params.group(1).options.lr_scale == 0.25);
  REQUIRE(params.find("nope") == std::nullopt);
}

TEST_CASE("param_list rejects bad input with messages naming the tensor", "[param_list][errors]") {
  std::vector<float> w(6), g(6), g5(5);
  gradapt::param_list<float> params;
  params.add("a", host_view(w), host_view(g));
  REQUIRE_THROWS_WITH(params.add("b", host_view(w, {2, 3}), host_view(g, {3, 2})),
                      Catch::Matchers::Contains("'b' has value shape [2, 3] but gradient shape [3, 2]"));
  REQUIRE_THROWS_WITH(params.add("c", host_view(w), host_view(g5)), Catch::Matchers::Contains("'c'"));
  REQUIRE_THROWS_WITH(params.add("a", host_view(w), host_view(g)),
                      Catch::Matchers::Contains("'a' already exists"));
  REQUIRE_THROWS_WITH(params.add("", host_view(w), host_view(g)),
                      Catch::Matchers::Contains("empty parameter name"));
  REQUIRE_THROWS_WITH(params.add("d", host_view(w), host_view(g), {}, 7),
                      Catch::Matchers::Contains("names group 7"));
  REQUIRE_THROWS_WITH(params.at("zzz"), Catch::Matchers::Contains("no parameter named 'zzz'"));
  REQUIRE_THROWS_AS(params.at(std::size_t{3}), gradapt::error);
  REQUIRE_THROWS_AS(params.add_group("default"), gradapt::error);
  REQUIRE_THROWS_AS(params.group(9), gradapt::error);
}

}  // namespace gradapt_test_param_list

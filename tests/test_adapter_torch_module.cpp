// LibTorch adapter (adapters/torch.hpp), param_list_of: a parameter list over a module's
// named_parameters() whose value and gradient views alias the parameters and their .grad()
// (autograd's next backward() accumulates into the viewed memory), missing gradients are an
// error unless allocation is asked for, frozen parameters are left out, flags are applied.
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "catch.hpp"
#include "gradapt/adapters/torch.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_adapter_torch_module {

using Catch::Matchers::Contains;

namespace {

/// y = x W^T + b (a hand-written layer: torch/nn/modules/linear.h would double the compile time).
struct dense_impl : torch::nn::Module {
  dense_impl(std::int64_t in, std::int64_t out) {
    weight = register_parameter("weight", at::randn({out, in}).mul(0.5));
    bias = register_parameter("bias", at::zeros({out}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.t()) + bias; }
  torch::Tensor weight, bias;
};
using dense = torch::nn::ModuleHolder<dense_impl>;

struct two_layer : torch::nn::Module {
  two_layer() {
    fc1 = register_module("fc1", dense(3, 4));
    fc2 = register_module("fc2", dense(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(fc1->forward(x).relu()); }
  dense fc1{nullptr}, fc2{nullptr};
};

}  // namespace

TEST_CASE("param_list_of needs gradients, or allocates them when asked", "[adapters][torch]") {
  two_layer m;
  REQUIRE_THROWS_WITH(gradapt::param_list_of<float>(m),
                      Contains("parameter 'fc1.weight' has no gradient yet") &&
                          Contains("run backward() once") && Contains(".allocate_missing_grads = true"));
  auto params = gradapt::param_list_of<float>(m, {.allocate_missing_grads = true});
  REQUIRE(params.size() == 4);
  for (const auto& p : m.named_parameters()) {
    REQUIRE(p.value().grad().defined());
    REQUIRE(p.value().grad().abs().sum().item<float>() == 0.0f);
  }
  // autograd accumulates into the allocated gradients: the views see the gradient
  const auto x = at::ones({5, 3});
  m.forward(x).sum().backward();
  const auto& g = params.at("fc2.bias").grad;
  REQUIRE(g.shape_string() == "[2]");
  REQUIRE(g[0] == 5.0f);  // d(sum of outputs)/d(bias) = batch size
  REQUIRE(g.data() == m.fc2->bias.grad().data_ptr<float>());
}

TEST_CASE("param_list_of views alias values and gradients, in named_parameters order", "[adapters][torch]") {
  two_layer m;
  m.forward(at::randn({8, 3})).pow(2).sum().backward();
  auto params = gradapt::param_list_of<float>(m);
  STATIC_REQUIRE(std::is_same_v<decltype(params), gradapt::param_list<float, float, gradapt::host_space>>);
  REQUIRE(params.size() == 4);
  const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  std::size_t i = 0;
  for (const auto& item : m.named_parameters()) {
    const auto& e = params[i];
    REQUIRE(e.name == names[i]);
    REQUIRE(e.name == item.key());
    REQUIRE(e.value.data() == item.value().data_ptr<float>());
    REQUIRE(e.grad.data() == item.value().grad().data_ptr<float>());
    REQUIRE(e.value.size() == static_cast<std::size_t>(item.value().numel()));
    ++i;
  }
  REQUIRE(params.at("fc1.weight").value.shape_string() == "[4, 3]");
  REQUIRE(params.total_elements() == 4 * 3 + 4 + 2 * 4 + 2);

  // an SGD step through gradapt's host backend equals LibTorch's own update
  torch::Tensor w_before = m.fc1->weight.detach().clone();
  torch::Tensor g_before = m.fc1->weight.grad().clone();
  gradapt::host{.threads = 1}.apply_list([](float& w, float g) { w -= 0.25f * g; }, params.values(),
                                         params.grads());
  REQUIRE(m.fc1->weight.detach().equal(w_before - 0.25f * g_before));

  // gradients zeroed in place stay viewed; the next backward accumulates into them
  m.zero_grad(/*set_to_none=*/false);
  REQUIRE(params.at("fc2.weight").grad[0] == 0.0f);
  m.forward(at::ones({2, 3})).sum().backward();
  REQUIRE(params.at("fc2.bias").grad[1] == 2.0f);
}

TEST_CASE("param_list_of: frozen parameters, flags, holders and errors", "[adapters][torch][errors]") {
  two_layer m;
  m.fc1->bias.set_requires_grad(false);
  m.forward(at::randn({4, 3})).sum().backward();
  auto params = gradapt::param_list_of<float>(m);
  REQUIRE(params.size() == 3);
  REQUIRE(!params.find("fc1.bias"));
  REQUIRE_THROWS_WITH(gradapt::param_list_of<float>(m, {.include_frozen = true}),
                      Contains("parameter 'fc1.bias' has no gradient yet"));
  auto all = gradapt::param_list_of<float>(m, {.allocate_missing_grads = true, .include_frozen = true});
  REQUIRE(all.size() == 4);

  auto flagged = gradapt::param_list_of<float>(
      m, {.flags = [](const std::string& name, const torch::Tensor& v) {
        return gradapt::param_flags{.skip_weight_decay = v.dim() == 1,
                                    .skip_trust_ratio = name.rfind("fc2.", 0) == 0};
      }});
  REQUIRE(!flagged.at("fc1.weight").flags.skip_weight_decay);
  REQUIRE(flagged.at("fc2.bias").flags.skip_weight_decay);
  REQUIRE(flagged.at("fc2.bias").flags.skip_trust_ratio);
  REQUIRE(!flagged.at("fc1.weight").flags.skip_trust_ratio);

  // a module holder and a shared_ptr are accepted
  dense lin(2, 2);
  lin->forward(at::ones({1, 2})).sum().backward();
  REQUIRE(gradapt::param_list_of<float>(lin).size() == 2);
  auto shared = std::make_shared<two_layer>();
  REQUIRE(gradapt::param_list_of<float>(shared, {.allocate_missing_grads = true}).size() == 4);

  // dtype mismatch names the parameter
  REQUIRE_THROWS_WITH(gradapt::param_list_of<double>(m),
                      Contains("parameter 'fc1.weight' (value) has dtype Float but float64 was requested"));
  // a non-contiguous gradient names the parameter and the gradient
  m.fc2->weight.mutable_grad() = at::zeros({4, 2}).t();
  REQUIRE_THROWS_WITH(gradapt::param_list_of<float>(m),
                      Contains("parameter 'fc2.weight' (gradient) is not contiguous"));
}

}  // namespace gradapt_test_adapter_torch_module

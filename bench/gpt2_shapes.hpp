// The GPT-2-small-shaped parameter list (d = 768, 12 layers, a 20000-token embedding and 1024
// positions: 148 tensors, 101.2M parameters) shared by bench_optim and bench_factored.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace gradapt_bench {

struct tensor_shape {
  std::string name;
  std::vector<std::int64_t> dims;
  bool no_decay;  ///< biases and norm weights: excluded from weight decay and trust ratios
};

/// GPT-2-small-shaped parameters (embeddings, 12 blocks, final norm).
inline std::vector<tensor_shape> gpt2_small_shapes() {
  constexpr std::int64_t d = 768, vocab = 20000, positions = 1024, layers = 12;
  std::vector<tensor_shape> s{{"wte", {vocab, d}, false}, {"wpe", {positions, d}, false}};
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    s.push_back({p + "ln_1.weight", {d}, true});
    s.push_back({p + "ln_1.bias", {d}, true});
    s.push_back({p + "attn.c_attn.weight", {d, 3 * d}, false});
    s.push_back({p + "attn.c_attn.bias", {3 * d}, true});
    s.push_back({p + "attn.c_proj.weight", {d, d}, false});
    s.push_back({p + "attn.c_proj.bias", {d}, true});
    s.push_back({p + "ln_2.weight", {d}, true});
    s.push_back({p + "ln_2.bias", {d}, true});
    s.push_back({p + "mlp.c_fc.weight", {d, 4 * d}, false});
    s.push_back({p + "mlp.c_fc.bias", {4 * d}, true});
    s.push_back({p + "mlp.c_proj.weight", {4 * d, d}, false});
    s.push_back({p + "mlp.c_proj.bias", {d}, true});
  }
  s.push_back({"ln_f.weight", {d}, true});
  s.push_back({"ln_f.bias", {d}, true});
  return s;
}

}  // namespace gradapt_bench

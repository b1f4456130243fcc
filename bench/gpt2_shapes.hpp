// The GPT-2-small-shaped parameter list (d = 768, 12 layers, a 20000-token embedding and 1024
// positions: 148 tensors, 101.2M parameters) shared by bench_optim and bench_factored, and
// the flat fp32 bucket both benches step, with the triad arrays timed beside it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"

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

/// The GPT-2-small list laid out in one flat bucket, as frameworks keep parameters: p and g
/// with deterministic values, a param_list over them (biases and norm weights flagged out of
/// weight decay and trust ratios when `flag_no_decay`), and three triad arrays of the same size.
struct gpt2_bucket {
  std::size_t n = 0;
  std::vector<float> p, g;        ///< the flat parameter and gradient buckets
  std::vector<float> ta, tb, tc;  ///< triad arrays
  gradapt::param_list<float> params;

  /// `with_triad = false` leaves the triad arrays empty (for benches that hold many replicas).
  explicit gpt2_bucket(bool flag_no_decay, bool with_triad = true) {
    const auto s = gpt2_small_shapes();
    for (const auto& t : s) {
      std::size_t k = 1;
      for (auto d : t.dims) k *= static_cast<std::size_t>(d);
      n += k;
    }
    p.assign(n, 0.0f);
    g.assign(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = 0.02f * static_cast<float>(static_cast<int>(i * 2654435761u % 2001) - 1000) / 1000.0f;
      g[i] = 1e-3f * static_cast<float>(static_cast<int>(i * 40503u % 2001) - 1000) / 1000.0f;
    }
    if (with_triad) ta.assign(n, 1.0f), tb.assign(n, 2.0f), tc.assign(n, 0.5f);
    std::size_t off = 0;
    for (const auto& t : s) {
      const gradapt::tensor_view<float> pv(p.data() + off, t.dims), gv(g.data() + off, t.dims);
      if (flag_no_decay)
        params.add(t.name, pv, gv, {.skip_weight_decay = t.no_decay, .skip_trust_ratio = t.no_decay});
      else
        params.add(t.name, pv, gv);
      off += pv.size();
    }
  }

  /// The STREAM triad a = b + s c over the three arrays (12 bytes per element).
  void triad(int threads) {
    float* __restrict a = ta.data();
    const float* __restrict b = tb.data();
    const float* __restrict c = tc.data();
    const std::size_t count = n;
#pragma omp parallel for simd schedule(static) num_threads(threads)
    for (std::size_t i = 0; i < count; ++i) a[i] = b[i] + 0.5f * c[i];
  }
};

}  // namespace gradapt_bench

#pragma once
// The small parameter list the checkpoint tests (test_checkpoint_bitflip) and the load()
// fuzzer (tests/fuzz/fuzz_load.cpp) save and load states over.
#include <cstddef>
#include <vector>

#include "gradapt/core/param_list.hpp"

namespace gradapt_test {

/// A small parameter list: a matrix (factored by Adafactor and SM3), a vector and a 3-d tensor.
struct model {
  std::vector<float> w1 = std::vector<float>(6 * 4), g1 = std::vector<float>(6 * 4);
  std::vector<float> w2 = std::vector<float>(5), g2 = std::vector<float>(5);
  std::vector<float> w3 = std::vector<float>(2 * 3 * 2), g3 = std::vector<float>(2 * 3 * 2);
  gradapt::param_list<float> params;
  model() {
    params.add("dense.weight", gradapt::host_view(w1, {6, 4}), gradapt::host_view(g1, {6, 4}));
    params.add("dense.bias", gradapt::host_view(w2, {5}), gradapt::host_view(g2, {5}));
    params.add("conv.weight", gradapt::host_view(w3, {2, 3, 2}), gradapt::host_view(g3, {2, 3, 2}));
    for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.1f * float(i % 7) - 0.3f;
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = 0.05f * float(i);
    for (std::size_t i = 0; i < w3.size(); ++i) w3[i] = -0.2f + 0.03f * float(i);
  }
  void grads(int t) {
    for (std::size_t i = 0; i < g1.size(); ++i) g1[i] = 0.01f * float((i * 3 + t) % 11) - 0.05f;
    for (std::size_t i = 0; i < g2.size(); ++i) g2[i] = 0.02f * float((i + t) % 5) - 0.04f;
    for (std::size_t i = 0; i < g3.size(); ++i) g3[i] = 0.015f * float((i * 5 + t) % 9) - 0.06f;
  }
};

}  // namespace gradapt_test

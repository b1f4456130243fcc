// Four K-FAC steps with the state in the memory of element backend B and linear algebra L,
// against the long double re-run of kfac_ld_reference, written once for every memory:
// test_kfac_device_path runs it through the device-tagged host backends, test_linalg_cuda on
// gradapt::cuda with cuda_linalg. `Mem` moves host vectors in and out of that memory:
// `alloc<T>(n)` (an owning buffer with data()), `put(buffer, host)`, `get(buffer) -> host`.
//
// Two layers (6 → 4 with a bias, 5 → 3 without), 9 rows, g scaled by 4; the factors updated
// every step, decomposed every second step; no KL clipping; a checkpoint round trip after
// step 2. Returns the largest difference between the rewritten gradients and the reference's
// direction, relative to the direction's largest magnitude (each step, each layer).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gradapt/optim/kfac.hpp"
#include "kfac_ld_reference.hpp"

namespace gradapt_test {

template <class Sp, class B, class L, class Mem>
double kfac_against_ld(const B& b, const L& la, const Mem& mem, gradapt::kfac_method method, bool prediv) {
  const gradapt::kfac_layer layers[] = {{"fc1", 6, 4, true}, {"fc2", 5, 3, false}};
  constexpr std::size_t rows = 9;
  constexpr double scale = 4;
  const gradapt::kfac kf({.factor_decay = 0.9,
                          .factor_update_steps = 1,
                          .inv_update_steps = 2,
                          .damping = 0.05,
                          .method = method,
                          .prediv_eigenvalues = prediv,
                          .kl_clip = 0});
  std::vector<std::unique_ptr<kfac_ld_reference>> ref;
  for (const auto& x : layers)
    ref.push_back(
        std::make_unique<kfac_ld_reference>(std::size_t(x.in), std::size_t(x.out), x.bias, 0.9, 0.05));
  auto st = kf.init<double>(b, la, layers);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(-1, 1);
  const auto draw = [&](std::size_t n, double s) {
    std::vector<double> v(n);
    for (auto& e : v) e = s * u(rng);
    return v;
  };
  double worst = 0;
  for (int s = 1; s <= 4; ++s) {
    std::vector<decltype(mem.template alloc<double>(1))> keep;
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      const auto& x = layers[l];
      const auto a = draw(rows * std::size_t(x.in), 1.0), g = draw(rows * std::size_t(x.out), scale * 0.5);
      keep.push_back(mem.template alloc<double>(a.size()));
      mem.put(keep.back(), a);
      keep.push_back(mem.template alloc<double>(g.size()));
      mem.put(keep.back(), g);
      kf.accumulate(
          st, l,
          gradapt::tensor_view<const double, Sp>(keep[keep.size() - 2].data(), {std::int64_t(rows), x.in}),
          gradapt::tensor_view<const double, Sp>(keep.back().data(), {std::int64_t(rows), x.out}), scale);
      ref[l]->update(a, g, rows, scale);
      if ((s - 1) % 2 == 0) ref[l]->decompose();
    }
    std::vector<std::vector<double>> w, bias;
    std::vector<decltype(mem.template alloc<double>(1))> dw, db;
    std::vector<gradapt::kfac_grad<double, Sp>> grads;
    for (const auto& x : layers) {
      w.push_back(draw(std::size_t(x.out * x.in), 1.0));
      bias.push_back(x.bias ? draw(std::size_t(x.out), 1.0) : std::vector<double>{});
      dw.push_back(mem.template alloc<double>(w.back().size()));
      mem.put(dw.back(), w.back());
      db.push_back(mem.template alloc<double>(bias.back().size()));
      mem.put(db.back(), bias.back());
    }
    for (std::size_t l = 0; l < std::size(layers); ++l)
      grads.push_back({gradapt::tensor_view<double, Sp>(dw[l].data(), {layers[l].out, layers[l].in}),
                       layers[l].bias ? gradapt::tensor_view<double, Sp>::vector(db[l].data(), layers[l].out)
                                      : gradapt::tensor_view<double, Sp>()});
    kf.step(st, grads, 0.1);
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      const auto& x = layers[l];
      const auto v = ref[l]->direction(w[l], bias[l], method == gradapt::kfac_method::eigen);
      const auto gw = mem.get(dw[l]), gb = mem.get(db[l]);
      const auto n = std::size_t(x.in + (x.bias ? 1 : 0));
      double big = 0, diff = 0;
      for (std::size_t r = 0; r < std::size_t(x.out); ++r) {
        for (std::size_t c = 0; c < std::size_t(x.in); ++c) {
          big = std::max(big, std::fabs(v[r * n + c]));
          diff = std::max(diff, std::fabs(gw[r * std::size_t(x.in) + c] - v[r * n + c]));
        }
        if (x.bias) {
          big = std::max(big, std::fabs(v[r * n + std::size_t(x.in)]));
          diff = std::max(diff, std::fabs(gb[r] - v[r * n + std::size_t(x.in)]));
        }
      }
      worst = std::max(worst, diff / big);
    }
    if (s == 2) {  // the factors and decompositions leave the memory and come back
      const auto saved = st.save();
      st = kf.init<double>(b, la, layers);
      st.load(saved);
    }
  }
  return worst;
}

}  // namespace gradapt_test

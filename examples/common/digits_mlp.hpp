#pragma once
// The 8x8 handwritten digits (examples/data/digits.csv: label, then 64 pixels in 0..16) and a
// 64-32-10 ReLU MLP with a cross-entropy loss, written out by hand so the examples need nothing
// but gradapt. Shared by adascale_digits, goodput_adapt, comm_strategies and demo.
//
// The MLP keeps its parameters in four buffers and all four gradients in ONE flat buffer (the
// "gradient bucket" a framework allreduces), with param_list views into both.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gradapt/gradapt.hpp>

#include "check.hpp"

namespace examples::digits {

constexpr int features = 64, classes = 10, hidden = 32;

/// The digits data set: n rows of 64 pixels scaled to [0, 1] and a label in 0..9.
struct dataset {
  std::vector<float> x;  ///< n x 64, pixels / 16
  std::vector<int> y;    ///< labels
  int n = 0;             ///< rows
};

/// Reads `path` (CSV: label, 64 pixels); `who` names the program in error messages.
inline dataset load(const std::string& path, const char* who) {
  std::ifstream f(path);
  if (!f) examples::fail(who, ": cannot open '", path, "' (pass --data PATH)");
  dataset d;
  std::string line;
  while (std::getline(f, line)) {
    std::stringstream ss(line);
    std::string cell;
    std::getline(ss, cell, ',');
    d.y.push_back(std::stoi(cell));
    for (int j = 0; j < features; ++j) {
      if (!std::getline(ss, cell, ','))
        examples::fail(who, ": row ", d.n + 1, " of '", path, "' has fewer than 65 fields");
      d.x.push_back(std::stof(cell) / 16.0f);
    }
    ++d.n;
  }
  if (d.n == 0) examples::fail(who, ": '", path, "' holds no rows");
  return d;
}

/// A 64-32-10 MLP with ReLU: the parameters and their gradients, in this rank's own buffers.
/// Initial weights are He-normal from a fixed seed, so every rank starts from the same model.
struct mlp {
  static constexpr std::size_t n_w1 = hidden * features, n_b1 = hidden, n_w2 = classes * hidden,
                               n_b2 = classes, n_params = n_w1 + n_b1 + n_w2 + n_b2;

  std::vector<float> w1, b1, w2, b2;
  std::vector<float> grad;  ///< all gradients, flat: fc1.weight, fc1.bias, fc2.weight, fc2.bias
  float *gw1, *gb1, *gw2, *gb2;
  gradapt::param_list<float> params;

  mlp()
      : w1(n_w1),
        b1(n_b1, 0.0f),
        w2(n_w2),
        b2(n_b2, 0.0f),
        grad(n_params, 0.0f),
        gw1(grad.data()),
        gb1(gw1 + n_w1),
        gw2(gb1 + n_b1),
        gb2(gw2 + n_w2) {
    std::mt19937 rng(42);  // the same initial weights on every rank
    std::normal_distribution<float> n1(0.0f, std::sqrt(2.0f / features)), n2(0.0f, std::sqrt(2.0f / hidden));
    for (auto& v : w1) v = n1(rng);
    for (auto& v : w2) v = n2(rng);
    using gradapt::host_view;
    using view = gradapt::tensor_view<float, gradapt::host_space>;
    params.add("fc1.weight", host_view(w1, {hidden, features}), view(gw1, {hidden, features}));
    params.add("fc1.bias", host_view(b1), view::vector(gb1, std::int64_t{n_b1}), {.skip_weight_decay = true});
    params.add("fc2.weight", host_view(w2, {classes, hidden}), view(gw2, {classes, hidden}));
    params.add("fc2.bias", host_view(b2), view::vector(gb2, std::int64_t{n_b2}), {.skip_weight_decay = true});
  }
  mlp(const mlp&) = delete;  // the views point into this object's buffers
  mlp& operator=(const mlp&) = delete;

  /// The flat gradient buffer as one view (what a gradient allreduce takes).
  gradapt::tensor_view<float, gradapt::host_space> grad_bucket() {
    return gradapt::tensor_view<float, gradapt::host_space>::vector(grad.data(),
                                                                    static_cast<std::int64_t>(grad.size()));
  }

  void zero_grad() { std::fill(grad.begin(), grad.end(), 0.0f); }

  /// The predicted class (arg max of the logits) of example i.
  int predict(const dataset& d, int i) const {
    const float* x = &d.x[static_cast<std::size_t>(i) * features];
    float h[hidden];
    for (int u = 0; u < hidden; ++u) {
      float s = b1[static_cast<std::size_t>(u)];
      for (int j = 0; j < features; ++j) s += w1[static_cast<std::size_t>(u * features + j)] * x[j];
      h[u] = s > 0 ? s : 0;
    }
    int best = 0;
    float best_z = -1e30f;
    for (int c = 0; c < classes; ++c) {
      float s = b2[static_cast<std::size_t>(c)];
      for (int u = 0; u < hidden; ++u) s += w2[static_cast<std::size_t>(c * hidden + u)] * h[u];
      if (s > best_z) best_z = s, best = c;
    }
    return best;
  }

  /// Mean cross-entropy over examples idx[0..count) (all examples when idx is null); with
  /// `with_grad`, the gradient of that mean is written into the gradient buffer.
  double loss(const dataset& d, const int* idx, int count, bool with_grad) {
    if (with_grad) zero_grad();
    return accumulate(d, idx, count, with_grad ? count : 0);
  }

  /// Mean cross-entropy over examples idx[0..count); when `denom` > 0, ADDS the gradient of
  /// (sum of the examples' losses) / denom to the gradient buffer. Gradient accumulation over s
  /// micro-batches of m examples: zero_grad(), then s calls with denom = m * s.
  double accumulate(const dataset& d, const int* idx, int count, int denom) {
    double total = 0;
    float h[hidden], z[classes], dz[classes];
    for (int k = 0; k < count; ++k) {
      const int i = idx ? idx[k] : k;
      const float* x = &d.x[static_cast<std::size_t>(i) * features];
      for (int u = 0; u < hidden; ++u) {
        float s = b1[static_cast<std::size_t>(u)];
        for (int j = 0; j < features; ++j) s += w1[static_cast<std::size_t>(u * features + j)] * x[j];
        h[u] = s > 0 ? s : 0;
      }
      float zmax = -1e30f;
      for (int c = 0; c < classes; ++c) {
        float s = b2[static_cast<std::size_t>(c)];
        for (int u = 0; u < hidden; ++u) s += w2[static_cast<std::size_t>(c * hidden + u)] * h[u];
        z[c] = s, zmax = std::max(zmax, s);
      }
      double zsum = 0;
      for (int c = 0; c < classes; ++c) zsum += std::exp(double(z[c] - zmax));
      const int y = d.y[static_cast<std::size_t>(i)];
      total += std::log(zsum) - double(z[y] - zmax);
      if (denom <= 0) continue;
      for (int c = 0; c < classes; ++c)
        dz[c] = (static_cast<float>(std::exp(double(z[c] - zmax)) / zsum) - (c == y ? 1.0f : 0.0f)) /
                float(denom);
      for (int c = 0; c < classes; ++c) {
        for (int u = 0; u < hidden; ++u) gw2[c * hidden + u] += dz[c] * h[u];
        gb2[c] += dz[c];
      }
      for (int u = 0; u < hidden; ++u) {
        if (h[u] <= 0) continue;
        float dh = 0;
        for (int c = 0; c < classes; ++c) dh += w2[static_cast<std::size_t>(c * hidden + u)] * dz[c];
        for (int j = 0; j < features; ++j) gw1[u * features + j] += dh * x[j];
        gb1[u] += dh;
      }
    }
    return total / count;
  }
};

}  // namespace examples::digits

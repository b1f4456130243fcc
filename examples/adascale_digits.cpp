// AdaScale against linear learning-rate scaling on a real data set: a 64-32-10 ReLU MLP on the
// 8x8 handwritten digits (examples/data/digits.csv, 1797 images), trained data-parallel on S
// in-process ranks (comm::threads) for S in {1, 2, 4, 8, 16}. Every rank takes a base batch of
// 16 examples, so a step at scale S sees 16 S examples: the same stream of examples as S steps
// of the S = 1 run.
//
//   linear:   lr = S * schedule(S * t)              (the "linear scaling rule")
//   adascale: lr = r_t * schedule(tau_t), tau += r_t (Johnson et al. 2020), with r_t from the
//             data-parallel gradient-noise-scale estimate (one extra scalar allreduce a step)
//
// Each run stops at tau = T scale-invariant iterations (linear: tau = S * t). The program
// writes adascale_digits.csv (method, S, tau, loss) and adascale_digits.svg (loss against tau)
// into the output directory, and prints the final losses.
//
//   adascale_digits [--data examples/data/digits.csv] [--out .] [--iters T] [--lr LR]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gradapt/gradapt.hpp>

#include "common/digits_mlp.hpp"
#include "common/svg_plot.hpp"

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

using examples::digits::dataset;
using examples::digits::mlp;

constexpr int base_batch = 16;

struct curve {
  std::string method;
  int scale;
  std::vector<std::pair<double, double>> points;  // (tau, training loss)
};

curve train(const dataset& d, const std::vector<int>& order, int scale, bool adascale, double iters,
            double lr0) {
  curve out{adascale ? "adascale" : "linear", scale, {}};
  const auto schedule = [&](double tau) { return tau < 0.7 * iters ? lr0 : 0.1 * lr0; };
  gradapt::comm::run_threads(scale, [&](gradapt::comm::threads& comm) {
    const int r = comm.rank();
    gradapt::host backend{.threads = 1};
    mlp model;
    auto& params = model.params;
    gradapt::gradient_noise_scale gns({.smoothing = 0.95});
    gradapt::adascale ada({.scale = double(scale)});
    std::vector<int> idx(base_batch);
    const double eval_every = iters / 60.0;
    double next_eval = 0, tau = 0;
    for (long t = 0; tau < iters; ++t) {
      if (tau >= next_eval && r == 0) {
        out.points.emplace_back(tau, model.loss(d, nullptr, d.n, false));
        next_eval += eval_every;
      }
      // The examples of this rank: the S = 1 run's stream, S base batches per step.
      for (int k = 0; k < base_batch; ++k)
        idx[static_cast<std::size_t>(k)] = order[static_cast<std::size_t>(((t * scale + r) * base_batch + k) %
                                                                          static_cast<long>(order.size()))];
      model.loss(d, idx.data(), base_batch, true);
      const double local_sq = backend.reduce(gradapt::reduction::sum_squares, params.grads(), {});
      for (const auto& g : params.grads()) comm.allreduce(g, gradapt::reduce_op::sum);
      const float inv = 1.0f / float(scale);
      backend.apply_list([inv](float& g) { g *= inv; }, params.grads());
      const double global_sq = backend.reduce(gradapt::reduction::sum_squares, params.grads(), {});
      double lr;
      if (adascale) {
        if (scale > 1) gns.update(comm, local_sq, global_sq, gradapt::noise_batch{.micro_batch = base_batch});
        const auto s = ada.step(schedule, gns, base_batch);
        lr = s.lr;
        tau = ada.progress();
      } else {
        lr = scale * schedule(tau);
        tau += scale;
      }
      const float step = static_cast<float>(lr);
      backend.apply_list([step](float& p, float g) { p -= step * g; }, params.values(), params.grads());
    }
    if (r == 0) out.points.emplace_back(tau, model.loss(d, nullptr, d.n, false));
  });
  return out;
}

std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const dataset d = examples::digits::load(
        arg(argc, argv, "--data", GRADAPT_EXAMPLES_DATA_DIR "/digits.csv"), "adascale_digits");
    const std::string out_dir = arg(argc, argv, "--out", ".");
    const double iters = std::stod(arg(argc, argv, "--iters", "3000"));
    const double lr0 = std::stod(arg(argc, argv, "--lr", "0.2"));
    std::vector<int> order(static_cast<std::size_t>(d.n));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    std::printf("64-32-10 MLP on %d digits, base batch %d, %g scale-invariant iterations, lr %g\n", d.n,
                base_batch, iters, lr0);
    std::vector<curve> curves;
    for (int s : {1, 2, 4, 8, 16})
      for (bool ada : {false, true}) {
        curves.push_back(train(d, order, s, ada, iters, lr0));
        std::printf("  %-8s S=%-2d final loss %.4f\n", curves.back().method.c_str(), s,
                    curves.back().points.back().second);
      }
    const auto final_loss = [&](const char* method, int s) {
      for (const auto& c : curves)
        if (c.method == method && c.scale == s) return c.points.back().second;
      return std::nan("");
    };
    const double base = final_loss("adascale", 1);
    for (int s : {8, 16}) {
      const double a = final_loss("adascale", s), l = final_loss("linear", s);
      const double gap = std::fabs(a - base) / base;
      std::printf("S=%d: adascale final loss %.4f is %.1f%% from S=1 (%.4f): %s; linear %.4f (%.1fx S=1)\n",
                  s, a, 100 * gap, base, gap <= 0.05 ? "within 5%" : "NOT within 5%", l, l / base);
    }
    std::ofstream csv(out_dir + "/adascale_digits.csv");
    csv << "method,scale,tau,loss\n";
    for (const auto& c : curves)
      for (auto [tau, loss] : c.points)
        csv << c.method << ',' << c.scale << ',' << tau << ',' << loss << '\n';
    std::vector<examples::series> lines;
    for (const auto& c : curves)
      if (c.scale == 1 ? c.method == "adascale" : true)
        lines.push_back(
            {(c.scale == 1 ? std::string("S=1 (base)") : c.method + " S=" + std::to_string(c.scale)),
             c.points});
    examples::write_svg(out_dir + "/adascale_digits.svg", lines,
                        {.title = "MLP on digits: training loss vs scale-invariant iterations",
                         .x_label = "scale-invariant iterations (tau)",
                         .y_label = "training loss",
                         .log_y = true});
    std::printf("wrote %s/adascale_digits.csv and %s/adascale_digits.svg\n", out_dir.c_str(),
                out_dir.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

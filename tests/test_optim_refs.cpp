// gradapt's SGD, AdamW, LAMB and LARS against reference vectors from optax and PyTorch
// (tests/data/optim/*.txt, written by tests/data/make_optim_refs.py, which is not run here).
//
// Each case file names an optimizer and its options, a list of tensors (1-D, small and large
// 2-D, 3-D, size-1 dims, rank 0, empty, zero weights, zero gradients, subnormal gradients,
// injected inf/NaN) whose parameters and per-step gradients come from a counter-based
// generator reproduced bit for bit (support/counter_random.hpp, read by support/peer_data.hpp),
// and the peer's parameters after the first and the last step. The test runs gradapt on the
// host backend with 1, 2 and 3 threads and checks:
//  - every stored element within a relative tolerance (NaN where the peer has NaN, infinities
//    with their sign), and the float64 sum and sum of squares of every whole tensor;
//  - that the tolerance is at least 10x tighter than the distance, recorded in the file, of
//    three deliberately wrong variants of the optimizer (so the comparison can fail);
//  - bitwise equality of the results across thread counts.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "peer_data.hpp"

namespace gradapt_test_optim_refs {

#ifndef GRADAPT_OPTIM_DATA
#error "define GRADAPT_OPTIM_DATA as the path of tests/data/optim"
#endif

namespace {

// ---- the case files (support/peer_data.hpp) --------------------------------------------------

using case_data = gradapt_test::peer_optimizer_case;
using gradapt_test::load_peer_optimizer_case;

std::vector<std::filesystem::path> case_files() { return gradapt_test::peer_case_files(GRADAPT_OPTIM_DATA); }

// ---- running gradapt on a case -----------------------------------------------------------------

using snapshot = std::vector<std::vector<float>>;  // per tensor, all elements

template <class Opt>
std::map<int, snapshot> run(const Opt& opt, const case_data& c, bool masks, int threads) {
  std::vector<std::vector<float>> p, g;
  for (const auto& t : c.tensors) {
    p.push_back(t.param0());
    g.push_back(std::vector<float>(t.size()));
  }
  gradapt::param_list<float> params;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const auto& t = c.tensors[i];
    gradapt::param_flags flags{};
    if (masks) flags = {.skip_weight_decay = t.no_wd, .skip_trust_ratio = t.no_tr};
    params.add(t.name, gradapt::tensor_view<float>(p[i].data(), t.shape),
               gradapt::tensor_view<float>(g[i].data(), t.shape), flags);
  }
  gradapt::host backend{.threads = threads};
  auto state = opt.init(backend, params);
  // Cases with inf/NaN gradients follow the peer through a non-finite state, which the
  // state's finiteness check would report (tests/test_optim_large_gradients.cpp covers it).
  if (c.name.find("nonfinite") != std::string::npos) state.set_check_interval(0);
  std::map<int, snapshot> out;
  for (int s = 1; s <= c.steps; ++s) {
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      const auto gs = c.tensors[i].grad(s);
      std::copy(gs.begin(), gs.end(), g[i].begin());  // in place: the views point at g[i]
    }
    opt.step(backend, params, state);
    if (s == 1 || s == c.steps) out[s] = p;
  }
  return out;
}

std::map<int, snapshot> run_case(const case_data& c, int threads) {
  const auto& o = c.opt;
  const bool masks = !o.contains("masks") || o.at("masks") != 0.0;
  if (c.optimizer == "sgd")
    return run(gradapt::sgd({.lr = o.at("lr"),
                             .momentum = o.at("momentum"),
                             .nesterov = o.at("nesterov") != 0.0,
                             .weight_decay = o.at("weight_decay")}),
               c, masks, threads);
  if (c.optimizer == "adamw")
    return run(gradapt::adamw({.lr = o.at("lr"),
                               .b1 = o.at("b1"),
                               .b2 = o.at("b2"),
                               .eps = o.at("eps"),
                               .eps_root = o.at("eps_root"),
                               .weight_decay = o.at("weight_decay"),
                               .bias_correction = o.at("bias_correction") != 0.0}),
               c, masks, threads);
  if (c.optimizer == "lamb")
    return run(
        gradapt::lamb({.lr = o.at("lr"),
                       .b1 = o.at("b1"),
                       .b2 = o.at("b2"),
                       .eps = o.at("eps"),
                       .eps_root = o.at("eps_root"),
                       .weight_decay = o.at("weight_decay"),
                       .bias_correction = o.at("bias_correction") != 0.0,
                       .max_grad_norm = o.contains("max_grad_norm") ? o.at("max_grad_norm") : INFINITY}),
        c, masks, threads);
  if (c.optimizer == "lars")
    return run(gradapt::lars({.lr = o.at("lr"),
                              .weight_decay = o.at("weight_decay"),
                              .trust_coefficient = o.at("trust_coefficient"),
                              .eps = o.at("eps"),
                              .momentum = o.at("momentum"),
                              .nesterov = o.at("nesterov") != 0.0}),
               c, masks, threads);
  throw std::runtime_error("unknown optimizer " + c.optimizer);
}

// Differences are measured in units of the case's scale (how far the reference moved the
// parameters). float32 implementations that order their operations differently drift apart by
// a few ulps per step, and optax rounds its bias corrections 1 - b^t in float32 (gradapt uses
// double): 6 steps stay well inside 1e-4 of the movement.
constexpr double rtol = 1e-4;

bool same_bits(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

}  // namespace

TEST_CASE("optimizers match optax and PyTorch reference vectors", "[optim][refs]") {
  const auto files = case_files();
  REQUIRE(files.size() >= 10);
  for (const auto& file : files) {
    const case_data c = load_peer_optimizer_case(file);
    INFO("case " << c.name << " (" << c.source << ")");
    REQUIRE(c.steps > 1);
    REQUIRE(!c.results.empty());
    REQUIRE(c.scale > 0);
    // The tolerance must separate a correct optimizer from a plausible wrong one.
    for (const auto& [d, label] : c.sensitivity) {
      INFO("wrong variant '" << label << "' lands " << d << " away (relative)");
      REQUIRE(d > 10 * rtol);
    }
    const auto ours1 = run_case(c, 1);
    double worst = 0;
    for (const auto& r : c.results) {
      INFO("step " << r.step << ", tensor " << r.tensor);
      std::size_t ti = 0;
      while (c.tensors[ti].name != r.tensor) ++ti;
      const auto& mine = ours1.at(r.step)[ti];
      REQUIRE((mine.size() + r.stride - 1) / r.stride == r.sample.size());
      for (std::size_t k = 0; k < r.sample.size(); ++k) {
        const double want = r.sample[k];
        const double got = mine[k * r.stride];
        // The message is formed only for a failing element (an INFO per element would cost
        // more than the comparison).
        bool ok = true;
        if (const auto nonfinite = gradapt_test::peer_nonfinite_match(want, got)) {
          ok = *nonfinite;
        } else {
          const double err = std::fabs(got - want) / c.scale;
          worst = std::max(worst, err);
          ok = err <= rtol;
        }
        if (!ok)
          FAIL("element " << k * r.stride << ": gradapt " << got << ", reference " << want << " (tolerance "
                          << rtol << " of " << c.scale << ")");
      }
      // Whole-tensor aggregates (cover the elements the file does not store): with every
      // element within rtol * scale, the sum is within n * rtol * scale and the sum of squares
      // within rtol * scale * sum |a + b|.
      double sum = 0, sumsq = 0;
      for (float v : mine) {
        sum += v;
        sumsq += static_cast<double>(v) * v;
      }
      const double n = static_cast<double>(mine.size());
      if (std::isfinite(r.sum)) {
        REQUIRE(std::fabs(sum - r.sum) <= n * rtol * c.scale + 1e-12);
        REQUIRE(std::fabs(sumsq - r.sumsq) <=
                rtol * c.scale * (2 * std::sqrt(n * r.sumsq) + n * rtol * c.scale) + 1e-12);
      } else {
        REQUIRE(!std::isfinite(sum));
      }
    }
    WARN("case " << c.name << ": largest relative difference " << worst << " (tolerance " << rtol << ")");
    // Thread count does not change a bit.
    for (int threads : {2, 3}) {
      const auto other = run_case(c, threads);
      for (const auto& [step, snap] : ours1)
        for (std::size_t t = 0; t < snap.size(); ++t)
          for (std::size_t i = 0; i < snap[t].size(); ++i)
            if (!same_bits(snap[t][i], other.at(step)[t][i]))
              FAIL("threads " << threads << ", step " << step << ", tensor " << c.tensors[t].name << "[" << i
                              << "]: " << other.at(step)[t][i] << " instead of " << snap[t][i]);
    }
  }
}

}  // namespace gradapt_test_optim_refs

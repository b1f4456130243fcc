// gradapt::adafactor and gradapt::sm3 against reference vectors of optax and
// torch.optim.Adafactor (tests/data/optim_factored, written by tests/data/make_factored_refs.py).
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "adafactor_fixtures.hpp"
#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/optim/sm3.hpp"

using Catch::Matchers::Contains;
using gradapt::host;
using gradapt::tensor_view;
using ld = long double;

static_assert(gradapt::factored_backend<gradapt::host>);

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

using namespace adafactor_test;

// ---- reference vectors from optax and torch.optim.Adafactor (tests/data/optim_factored) -------
// Written by tests/data/make_factored_refs.py (not run here) with make_optim_refs.py's
// conventions: inputs from the counter-based generator reproduced bit for bit (read with
// support/peer_data.hpp), samples of every tensor after the first and the last step. A stored
// element must be within rtol of the case's movement scale (and within 1e-3 of its own tensor's
// movement plus 4 ulp), NaN where the peer has NaN; the recorded sensitivities must exceed
// 10 rtol.
#ifndef GRADAPT_FACTORED_DATA
#error "define GRADAPT_FACTORED_DATA as the path of tests/data/optim_factored"
#endif

#include <filesystem>
#include <map>

#include "gradapt/optim/sm3.hpp"
#include "peer_data.hpp"

namespace gradapt_test_optim_factored_refs {

namespace {

using ref_case = gradapt_test::peer_optimizer_case;  // support/peer_data.hpp

gradapt::adafactor_options adafactor_from(const std::map<std::string, double>& o) {
  gradapt::adafactor_options a;
  a.lr = o.at("lr");
  a.relative_step = o.at("relative_step") != 0;
  a.decay_rate = o.at("decay_rate");
  a.min_dim_size_to_factor = static_cast<std::int64_t>(o.at("min_dim"));
  a.factored = o.at("factored") != 0;
  a.axes = o.at("axes") != 0 ? gradapt::factor_axes::last_two : gradapt::factor_axes::largest_two;
  a.eps1 = o.at("eps1");
  a.eps1_mode =
      o.at("eps1_clamp") != 0 ? gradapt::adafactor_eps1::clamp : gradapt::adafactor_eps1::add_to_square;
  a.clipping_threshold = o.at("clip");
  a.multiply_by_parameter_scale = o.at("param_scale") != 0;
  a.eps2 = o.at("eps2");
  a.momentum = o.at("momentum");
  a.weight_decay = o.at("wd");
  a.weight_decay_times_lr = o.at("wd_times_lr") != 0;
  return a;
}

template <class Opt>
std::map<int, std::vector<std::vector<float>>> run_ref_case(const Opt& opt, const ref_case& c, int threads) {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> pl;
  for (const auto& t : c.tensors) {
    p.push_back(t.param0());
    g.push_back(std::vector<float>(t.size()));
  }
  for (std::size_t i = 0; i < c.tensors.size(); ++i)
    pl.add(c.tensors[i].name,
           tensor_view<float>(p[i].data(), std::span<const std::int64_t>(c.tensors[i].shape)),
           tensor_view<float>(g[i].data(), std::span<const std::int64_t>(c.tensors[i].shape)));
  host b{.threads = threads};
  auto st = opt.init(b, pl);
  // Cases with inf/NaN gradients follow the peer through a non-finite state, which the
  // state's finiteness check would report (tests/test_optim_large_gradients.cpp covers it).
  if (c.name.find("nonfinite") != std::string::npos) st.set_check_interval(0);
  std::map<int, std::vector<std::vector<float>>> snaps;
  for (int s = 1; s <= c.steps; ++s) {
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      const auto gi = c.tensors[i].grad(s);  // copied in: the views point at g[i]'s buffer
      std::copy(gi.begin(), gi.end(), g[i].begin());
    }
    opt.step(b, pl, st);
    if (s == 1 || s == c.steps) snaps[s] = p;
  }
  return snaps;
}

}  // namespace

TEST_CASE("adafactor and sm3 match optax and torch.optim.Adafactor reference vectors",
          "[optim][refs][adafactor]") {
  const auto files = gradapt_test::peer_case_files(GRADAPT_FACTORED_DATA);
  REQUIRE(files.size() >= 8);
  constexpr double rtol = 1e-4;
  int adafactor_cases = 0, sm3_cases = 0, torch_cases = 0;
  for (const auto& file : files) {
    const ref_case c = gradapt_test::load_peer_optimizer_case(file);
    INFO("case " << c.name);
    REQUIRE(c.steps > 1);
    REQUIRE(c.scale > 0);
    for (const auto& [d, label] : c.sensitivity) REQUIRE(d > 10 * rtol);
    std::vector<std::pair<std::string, std::map<int, std::vector<std::vector<float>>>>> runs;
    if (c.optimizer == "adafactor") {
      runs.emplace_back("adafactor", run_ref_case(gradapt::adafactor(adafactor_from(c.opt)), c, 2));
      runs.emplace_back("adafactor, 1 thread", run_ref_case(gradapt::adafactor(adafactor_from(c.opt)), c, 1));
      ++adafactor_cases;
      torch_cases += c.name.find("torch") != std::string::npos;
    } else {
      REQUIRE(c.optimizer == "sm3");
      const gradapt::sm3_options so{
          .lr = c.opt.at("lr"), .momentum = c.opt.at("momentum"), .eps = c.opt.at("eps")};
      runs.emplace_back("sm3", run_ref_case(gradapt::sm3(so), c, 2));
      runs.emplace_back("sm3, 1 thread", run_ref_case(gradapt::sm3(so), c, 1));
      ++sm3_cases;
    }
    for (const auto& [form, mine] : runs) {
      INFO("optimizer " << form);
      double worst = 0;
      for (const auto& r : c.results) {
        std::size_t t = 0;
        while (c.tensors[t].name != r.tensor) ++t;
        const auto& got = mine.at(r.step)[t];
        const auto p0 = c.tensors[t].param0();
        double own = 0;  // the tensor's own movement, from the sample
        for (std::size_t k = 0; k < r.sample.size(); ++k)
          if (std::isfinite(r.sample[k]))
            own = std::max(own, std::fabs(r.sample[k] - double(p0[k * r.stride])));
        REQUIRE((got.size() + r.stride - 1) / r.stride == r.sample.size());
        for (std::size_t k = 0; k < r.sample.size(); ++k) {
          const double want = r.sample[k];
          const double v = got[k * r.stride];
          // The message is formed only for a failing element.
          bool ok = true;
          if (const auto nonfinite = gradapt_test::peer_nonfinite_match(want, v)) {
            ok = *nonfinite;
          } else {
            const double err = std::fabs(v - want);
            ok = err <= rtol * c.scale && err <= 1e-3 * own + 4 * std::ldexp(std::fabs(want), -23) + 1e-30;
            worst = std::max(worst, err / c.scale);
          }
          if (!ok)
            FAIL("tensor " << r.tensor << " step " << r.step << " element " << k * r.stride << ": " << v
                           << " vs " << want << " (tolerances " << rtol * c.scale
                           << " and 1e-3 of the tensor's own movement " << own << ")");
        }
      }
      WARN("case " << c.name << " (" << form << "): largest difference " << worst
                   << " of the movement scale (tolerance " << rtol << ")");
    }
  }
  REQUIRE(adafactor_cases >= 5);
  REQUIRE(torch_cases >= 2);
  REQUIRE(sm3_cases >= 2);
}

}  // namespace gradapt_test_optim_factored_refs

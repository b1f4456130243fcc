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
// conventions: inputs from a counter-based generator reproduced below, samples of every tensor
// after the first and the last step. A stored element must be within rtol of the case's
// movement scale (and within 1e-3 of its own tensor's movement plus 4 ulp), NaN where the
// peer has NaN; the recorded sensitivities must exceed 10 rtol.
#ifndef GRADAPT_FACTORED_DATA
#error "define GRADAPT_FACTORED_DATA as the path of tests/data/optim_factored"
#endif

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "gradapt/optim/sm3.hpp"

namespace gradapt_test_optim_factored_refs {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<float> gen_values(std::uint64_t seed, std::size_t n, int log2_scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t u = splitmix64(seed * 0x100000001B3ull + i);
    const auto k = static_cast<std::int64_t>(u >> 40) - (std::int64_t{1} << 23);
    v[i] = static_cast<float>(std::ldexp(static_cast<double>(k), log2_scale - 23));
  }
  return v;
}

double num(const std::string& s) {
  if (s == "nan") return std::nan("");
  if (s == "inf") return INFINITY;
  if (s == "-inf") return -INFINITY;
  return std::stod(s);
}

struct ref_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t pseed = 0, gseed = 0;
  int plog = 0, glog = 0;
  bool zero_p = false, zero_g = false;
  std::vector<std::tuple<int, std::size_t, float>> inject;
  std::size_t size() const { return numel(shape); }
  std::vector<float> param0() const {
    return zero_p ? std::vector<float>(size(), 0.0f) : gen_values(pseed, size(), plog);
  }
  std::vector<float> grad(int step) const {
    if (zero_g) return std::vector<float>(size(), 0.0f);
    auto g = gen_values(gseed + 1000 * static_cast<std::uint64_t>(step), size(), glog);
    for (const auto& [s, i, v] : inject)
      if (s == step) g[i] = v;
    return g;
  }
};

struct ref_result {
  int step = 0;
  std::string tensor;
  std::size_t stride = 1;
  std::vector<double> sample;
};

struct ref_case {
  std::string name, optimizer;
  std::map<std::string, double> opt;
  int steps = 0;
  double scale = 0;
  std::vector<double> sensitivity;
  std::vector<ref_spec> tensors;
  std::vector<ref_result> results;
};

ref_case load_ref(const std::filesystem::path& file) {
  std::ifstream in(file);
  REQUIRE(in.good());
  ref_case c;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "case") {
      ls >> c.name;
    } else if (key == "opt") {
      ls >> c.optimizer;
      std::string kv;
      while (ls >> kv) c.opt[kv.substr(0, kv.find('='))] = num(kv.substr(kv.find('=') + 1));
    } else if (key == "steps") {
      ls >> c.steps;
    } else if (key == "scale") {
      std::string v;
      ls >> v;
      c.scale = num(v);
    } else if (key == "sensitivity") {
      std::string v;
      ls >> v;
      c.sensitivity.push_back(num(v));
    } else if (key == "tensor") {
      ref_spec t;
      int rank = 0;
      ls >> t.name >> rank;
      t.shape.resize(static_cast<std::size_t>(rank));
      for (auto& d : t.shape) ls >> d;
      std::string flags, word;
      ls >> t.pseed >> t.gseed >> t.plog >> t.glog >> flags;
      t.zero_p = flags.find("zero_p") != std::string::npos;
      t.zero_g = flags.find("zero_g") != std::string::npos;
      while (ls >> word) {
        REQUIRE(word == "inject");
        int s = 0;
        std::size_t i = 0;
        std::string v;
        ls >> s >> i >> v;
        t.inject.emplace_back(s, i, static_cast<float>(num(v)));
      }
      c.tensors.push_back(t);
    } else if (key == "result") {
      ref_result r;
      std::string w;
      std::size_t count = 0;
      ls >> r.step >> r.tensor >> w >> r.stride >> w >> count;
      std::string values_line, v;
      std::getline(in, values_line);
      std::istringstream vs(values_line);
      while (vs >> v) r.sample.push_back(num(v));
      REQUIRE(r.sample.size() == count);
      c.results.push_back(r);
    } else if (key == "source") {
    } else if (key == "end") {
      break;
    } else {
      FAIL("unknown line in " << file << ": " << line);
    }
  }
  return c;
}

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
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(GRADAPT_FACTORED_DATA))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 8);
  constexpr double rtol = 1e-4;
  int adafactor_cases = 0, sm3_cases = 0, torch_cases = 0;
  for (const auto& file : files) {
    const ref_case c = load_ref(file);
    INFO("case " << c.name);
    REQUIRE(c.steps > 1);
    REQUIRE(c.scale > 0);
    for (double d : c.sensitivity) REQUIRE(d > 10 * rtol);
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
          if (std::isnan(want)) {
            ok = std::isnan(v);
          } else if (std::isinf(want)) {
            ok = v == want;
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

// gradapt::shampoo against trajectories of an independent implementation: facebookresearch/
// optimizers' DistributedShampoo (tests/data/shampoo/*.txt, written by
// tests/data/make_shampoo_refs.py, which is not run here and documents the option mapping).
//
// Each case file holds gradapt's options (the cases of the options that follow the peer also
// beta1, bias_correction, precondition_1d, merge_from, spectrum, inverse_exponents and the
// distributed_shampoo_defaults preset), the tensors (1-D, 2-D, a 2-D tensor cut into blocks, rank-3 and
// conv-shaped 4-D tensors, merged or not, a [64, 48] tensor with rank-2 gradients), whose parameters and
// per-step gradients come from
// the counter-based generator of tests/data/peer_refs.py reproduced bit for bit, the block plan
// (merged shape, and the number of blocks the peer's own splitting gives), and the peer's
// float64 parameters after the first step, the first preconditioned step, the middle and the
// last (32nd) step. The test runs gradapt on the host backend with host_lapack and checks:
//  - the plan: merged shape, block count, every preconditioned block holding roots at the end;
//  - double: every stored element within rtol_double of the reference, in units of the case's
//    scale (the largest distance any parameter moved);
//  - float: every element within float_margin times the peer's own float32-to-float64 distance
//    (recorded in the file), and never looser than rtol_float_cap;
//  - the family (eigenvalue-corrected / SOAP with eigh and QR refreshes, spectral descent /
//    Muon, and each one's preset) against the peer's own configs, by the same checks; for
//    soap_defaults the float tolerance is 3x the spread of the peer's float32 runs over rounding
//    orders (`peer_float32_spread`: its one float32 run understates that case's noise), and a
//    deliberately wrong mapping in gradapt (one Newton–Schulz step less, the other eigenbasis
//    refresh) lands more than 10x outside the float tolerance;
//  - each deliberately wrong configuration of the peer (recorded distance) lands at least 10x
//    outside the float tolerance, so both comparisons can fail; the variants recorded as
//    `sensitivity_double` (eigen roots in place of coupled Newton's, equal to within Newton's
//    tolerance) land at least 10x outside the double tolerance.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "peer_data.hpp"

namespace gradapt_test_shampoo_refs {

#ifndef GRADAPT_SHAMPOO_DATA
#error "define GRADAPT_SHAMPOO_DATA as the path of tests/data/shampoo"
#endif

namespace {

// ---- the case files (support/peer_data.hpp) --------------------------------------------------

struct tensor_spec : gradapt_test::peer_tensor {
  explicit tensor_spec(gradapt_test::peer_tensor t) : peer_tensor(std::move(t)) {}
  std::vector<std::int64_t> merged;  ///< empty: the graft alone
  std::size_t blocks = 0;            ///< blocks the peer cuts the merged shape into
  int lowrank = 0;                   ///< > 0: gradients of this rank (make_shampoo_refs.py's LowRank)

  /// The gradient of step s (1-based): the generator's, or the LowRank record's
  /// G = sum_r c[r] u_r v_r^T (u, v 8-bit values, exact in double), rounded once to float for T = float.
  template <class T>
  std::vector<T> gradient(int s) const {
    if (lowrank == 0) {
      const auto g = grad(s);
      return std::vector<T>(g.begin(), g.end());
    }
    const auto m = static_cast<std::size_t>(shape.at(0)), n = static_cast<std::size_t>(shape.at(1));
    const auto q = [](std::uint64_t seed, std::size_t k) {
      auto v = gradapt_test::peer_values(seed, k, 0);
      std::vector<double> out(k);
      for (std::size_t i = 0; i < k; ++i) out[i] = std::trunc(double(v[i]) * 128.0) / 128.0;
      return out;
    };
    const auto c = gradapt_test::peer_values(gseed + 1000 * static_cast<std::uint64_t>(s),
                                             static_cast<std::size_t>(lowrank), glog);
    std::vector<double> g(m * n, 0.0);
    for (int r = 0; r < lowrank; ++r) {
      const auto u = q(gseed + 100 + static_cast<std::uint64_t>(r), m);
      const auto v = q(gseed + 200 + static_cast<std::uint64_t>(r), n);
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j)
          g[i * n + j] += double(c[static_cast<std::size_t>(r)]) * (u[i] * v[j]);
    }
    std::vector<T> out(m * n);
    for (std::size_t i = 0; i < m * n; ++i)
      out[i] = static_cast<T>(g[i]);  // float: rounded once, as torch does
    return out;
  }
};

using result = gradapt_test::peer_result;  ///< every element (stride 1)

struct case_data {
  std::string name;
  std::map<std::string, std::string> opt;
  int steps = 0;
  double scale = 0;         ///< largest |p_last - p_0| in the reference: the unit of differences
  double peer_float32 = 0;  ///< the peer's float32 run's distance from its float64 run
  /// The largest distance from the float64 run over float32 runs of the peer that differ only in
  /// rounding order (threads, summation order of the factors, MKL's code path); 0 when not
  /// recorded (make_shampoo_refs.py records it where one float32 run understates the noise).
  double peer_float32_spread = 0;
  std::vector<std::pair<double, std::string>> sensitivity;
  std::vector<std::pair<double, std::string>> sensitivity_double;  ///< to be resolved in double only
  std::vector<tensor_spec> tensors;
  std::vector<result> results;

  double num(const std::string& k) const {
    const auto it = opt.find(k);
    if (it == opt.end()) throw std::runtime_error("case " + name + ": no option " + k);
    return std::stod(it->second);
  }
};

case_data load_case(const std::filesystem::path& file) {
  case_data c;
  const auto id =
      gradapt_test::read_peer_records(file, [&](const std::string& key, std::istream& ls, auto& in) {
        if (key == "opt") {
          for (auto& [k, v] : gradapt_test::peer_options(ls)) c.opt[k] = v;
        } else if (key == "steps") {
          ls >> c.steps;
        } else if (key == "scale") {
          ls >> c.scale;
        } else if (key == "peer_float32") {
          ls >> c.peer_float32;
        } else if (key == "peer_float32_spread") {
          ls >> c.peer_float32_spread;
        } else if (key == "sensitivity" || key == "sensitivity_double") {
          double v = 0;
          std::string label;
          ls >> v >> label;
          (key == "sensitivity" ? c.sensitivity : c.sensitivity_double).emplace_back(v, label);
        } else if (key == "tensor") {
          c.tensors.emplace_back(gradapt_test::read_peer_tensor(ls, in.line()));
        } else if (key == "plan") {
          std::string name, word;
          int k = 0;
          ls >> name >> k;
          auto& t = c.tensors.at(c.tensors.size() - 1);
          if (t.name != name) throw std::runtime_error("plan line for " + name + " after tensor " + t.name);
          if (k == 0) {
            ls >> word;  // "-"
          } else {
            t.merged.resize(static_cast<std::size_t>(k));
            for (auto& d : t.merged) ls >> d;
          }
          ls >> word >> t.blocks;
        } else if (key == "lowrank") {
          std::string name;
          auto& t = c.tensors.at(c.tensors.size() - 1);
          ls >> name >> t.lowrank;
          if (t.name != name)
            throw std::runtime_error("lowrank line for " + name + " after tensor " + t.name);
        } else if (key == "result") {
          c.results.push_back(gradapt_test::read_peer_result(in));
        } else {
          in.unknown();
        }
      });
  c.name = id.name;
  return c;
}

std::vector<std::filesystem::path> case_files() {
  return gradapt_test::peer_case_files(GRADAPT_SHAMPOO_DATA);
}

gradapt::shampoo_graft graft_of(const std::string& s) {
  if (s == "adagrad") return gradapt::shampoo_graft::adagrad;
  if (s == "rmsprop") return gradapt::shampoo_graft::rmsprop;
  if (s == "adam") return gradapt::shampoo_graft::adam;
  if (s == "sgd") return gradapt::shampoo_graft::sgd;
  if (s == "none") return gradapt::shampoo_graft::none;
  throw std::runtime_error("unknown graft " + s);
}

/// The case's option, or `fallback` when the file has no such key (the four cases of the
/// options that have no peer-specific counterpart).
std::string opt_or(const case_data& c, const std::string& k, const std::string& fallback) {
  const auto it = c.opt.find(k);
  return it == c.opt.end() ? fallback : it->second;
}

/// "order:dimension:p,..." (or "-") as shampoo_options::inverse_exponents.
std::vector<gradapt::shampoo_exponent> exponents_of(const std::string& s) {
  std::vector<gradapt::shampoo_exponent> out;
  if (s == "-") return out;
  std::istringstream in(s);
  std::string e;
  while (std::getline(in, e, ',')) {
    gradapt::shampoo_exponent x;
    char sep1 = 0, sep2 = 0;
    std::istringstream es(e);
    es >> x.order >> sep1 >> x.dimension >> sep2 >> x.p;
    if (!es || sep1 != ':' || sep2 != ':') throw std::runtime_error("bad exponent entry " + e);
    out.push_back(x);
  }
  return out;
}

/// The family options a case states (preconditioner and its keys; absent: Shampoo).
void family_options(const case_data& c, gradapt::shampoo_options& o) {
  const auto kind = opt_or(c, "preconditioner", "shampoo");
  if (kind == "shampoo") return;
  o.graft_preconditioned = c.num("graft_preconditioned") != 0;
  if (kind == "spectral_descent") {
    o.preconditioner = gradapt::shampoo_preconditioner::spectral_descent;
    o.newton_schulz.steps = static_cast<std::uint32_t>(c.num("ns_steps"));
    o.newton_schulz.a = c.num("ns_a");
    o.newton_schulz.b = c.num("ns_b");
    o.newton_schulz.c = c.num("ns_c");
    o.newton_schulz.epsilon = c.num("ns_epsilon");
    const auto sc = c.opt.at("ns_scale");
    if (sc != "none" && sc != "aspect") throw std::runtime_error("unknown ns_scale " + sc);
    o.scale_by_aspect = sc == "aspect";
  } else if (kind == "eigenvalue_corrected") {
    o.preconditioner = gradapt::shampoo_preconditioner::eigenvalue_corrected;
    const auto e = c.opt.at("eigenbasis");
    if (e != "eigh" && e != "qr") throw std::runtime_error("unknown eigenbasis " + e);
    o.eigenbasis = e == "qr" ? gradapt::shampoo_eigenbasis::qr : gradapt::shampoo_eigenbasis::eigh;
    o.qr_iterations = static_cast<std::uint32_t>(c.num("qr_iterations"));
    o.qr_tolerance = c.num("qr_tolerance");
    o.corrected_exponent = c.num("corrected_exponent");
    // The peer's corrected second moment shares the factors' beta2 and epsilon.
    if (c.num("corrected_beta2") != c.num("beta2") || c.num("corrected_epsilon") != c.num("epsilon"))
      throw std::runtime_error("case " + c.name +
                               ": corrected_beta2 / corrected_epsilon differ from beta2 / epsilon");
  } else {
    throw std::runtime_error("unknown preconditioner " + kind);
  }
}

gradapt::shampoo_options options_of(const case_data& c) {
  const auto preset = opt_or(c, "preset", "-");
  if (preset != "-") {
    // The preset, with the one setting the case states (the peer ran with its defaults too).
    auto o = preset == "distributed_shampoo_defaults" ? gradapt::distributed_shampoo_defaults()
             : preset == "spectral_descent_defaults"  ? gradapt::spectral_descent_defaults()
             : preset == "soap_defaults"              ? gradapt::soap_defaults()
                                                      : throw std::runtime_error("unknown preset " + preset);
    o.lr = c.num("lr");
    return o;
  }
  gradapt::shampoo_options o;
  o.lr = c.num("lr");
  o.max_preconditioner_dim = static_cast<std::int64_t>(c.num("max_preconditioner_dim"));
  o.merge_small_dims = c.num("merge_small_dims") != 0;
  o.beta2 = c.num("beta2");
  o.statistics_frequency = 1;
  o.precondition_frequency = static_cast<std::uint64_t>(c.num("precondition_frequency"));
  o.start_preconditioning_step = static_cast<std::uint64_t>(c.num("start_preconditioning_step"));
  const auto& root = c.opt.at("root");
  if (root != "eigen" && root != "newton") throw std::runtime_error("unknown root " + root);
  o.root.method = root == "eigen" ? gradapt::root_method::eigen : gradapt::root_method::coupled_newton;
  o.root.ridge = gradapt::ridge_kind::absolute;
  o.root.epsilon = c.num("epsilon");
  o.root.tolerance = c.num("newton_tolerance");
  o.root.max_iterations = static_cast<int>(c.num("newton_max_iterations"));
  o.graft = graft_of(c.opt.at("graft"));
  if (o.graft == gradapt::shampoo_graft::rmsprop || o.graft == gradapt::shampoo_graft::adam)
    o.graft_beta2 = c.num("graft_beta2");
  o.graft_epsilon = c.num("graft_epsilon");
  o.momentum = c.num("momentum");
  o.nesterov = c.num("nesterov") != 0;
  o.weight_decay = c.num("weight_decay");
  o.beta1 = std::stod(opt_or(c, "beta1", "0"));
  o.bias_correction = opt_or(c, "bias_correction", "0") != "0";
  o.precondition_1d = opt_or(c, "precondition_1d", "0") != "0";
  o.merge_from = opt_or(c, "merge_from", "first") == "last" ? gradapt::shampoo_merge::last
                                                            : gradapt::shampoo_merge::first;
  o.spectrum = opt_or(c, "spectrum", "clamp") == "shift" ? gradapt::shampoo_spectrum::shift
                                                         : gradapt::shampoo_spectrum::clamp;
  o.inverse_exponents = exponents_of(opt_or(c, "exponents", "-"));
  family_options(c, o);
  return o;
}

/// The preset's options are those the case file states for the peer's defaults.
void check_preset(const case_data& c) {
  case_data plain = c;
  plain.opt["preset"] = "-";
  const auto o = options_of(c);
  const auto stated = options_of(plain);  // (the keys only: unstated options at gradapt's defaults)
  CHECK(o.preconditioner == stated.preconditioner);
  CHECK(o.graft_preconditioned == stated.graft_preconditioned);
  CHECK(o.newton_schulz.steps == stated.newton_schulz.steps);
  CHECK(o.newton_schulz.a == stated.newton_schulz.a);
  CHECK(o.newton_schulz.b == stated.newton_schulz.b);
  CHECK(o.newton_schulz.c == stated.newton_schulz.c);
  CHECK(o.newton_schulz.epsilon == stated.newton_schulz.epsilon);
  CHECK(o.scale_by_aspect == stated.scale_by_aspect);
  CHECK(o.eigenbasis == stated.eigenbasis);
  CHECK(o.qr_iterations == stated.qr_iterations);
  CHECK(o.qr_tolerance == stated.qr_tolerance);
  CHECK(o.corrected_exponent == stated.corrected_exponent);
  CHECK(o.max_preconditioner_dim == static_cast<std::int64_t>(c.num("max_preconditioner_dim")));
  CHECK(o.merge_small_dims == (c.num("merge_small_dims") != 0));
  CHECK(o.merge_from == gradapt::shampoo_merge::last);
  CHECK(o.beta1 == c.num("beta1"));
  CHECK(o.beta2 == c.num("beta2"));
  CHECK(o.bias_correction == (c.num("bias_correction") != 0));
  CHECK(o.precondition_1d == (c.num("precondition_1d") != 0));
  CHECK(o.root.epsilon == c.num("epsilon"));
  CHECK(o.root.ridge == gradapt::ridge_kind::absolute);
  CHECK(o.root.method == gradapt::root_method::eigen);
  CHECK(o.spectrum == gradapt::shampoo_spectrum::shift);
  CHECK(o.graft == gradapt::shampoo_graft::none);
  CHECK(o.precondition_frequency == static_cast<std::uint64_t>(c.num("precondition_frequency")));
  CHECK(o.start_preconditioning_step == static_cast<std::uint64_t>(c.num("start_preconditioning_step")));
  CHECK(o.momentum == c.num("momentum"));
  CHECK(o.weight_decay == c.num("weight_decay"));
}

/// Runs gradapt in T on case c: the parameters (as double) after each recorded step.
template <class T>
std::map<int, std::vector<std::vector<double>>> run_case(const case_data& c) {
  std::vector<std::vector<T>> p, g;
  for (const auto& t : c.tensors) {
    const auto p0 = t.param0();
    p.emplace_back(p0.begin(), p0.end());
    g.emplace_back(t.size());
  }
  gradapt::param_list<T> params;
  for (std::size_t i = 0; i < c.tensors.size(); ++i)
    params.add(c.tensors[i].name, gradapt::tensor_view<T>(p[i].data(), c.tensors[i].shape),
               gradapt::tensor_view<T>(g[i].data(), c.tensors[i].shape));
  const gradapt::host backend{.threads = 1};
  const gradapt::shampoo opt(options_of(c));
  auto st = opt.init(backend, params);

  // The block plan: gradapt's layout is the one the peer was handed.
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const auto& t = c.tensors[i];
    INFO("tensor " << t.name);
    const auto& l = st.preconditioner().layout(i);
    REQUIRE(l.diagonal == t.merged.empty());
    if (!l.diagonal) {
      REQUIRE(l.merged == t.merged);
      REQUIRE(l.blocks.size() == t.blocks);
    }
  }

  std::map<int, std::vector<std::vector<double>>> out;
  for (int s = 1; s <= c.steps; ++s) {
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      const auto gs = c.tensors[i].template gradient<T>(s);
      std::copy(gs.begin(), gs.end(), g[i].begin());  // in place: the views point at g[i]
    }
    const auto report = opt.step(backend, params, st);
    REQUIRE(report.step == static_cast<std::uint64_t>(s));
    REQUIRE(report.root_failures.empty());
    bool recorded = false;
    for (const auto& r : c.results) recorded = recorded || r.step == s;
    if (recorded) {
      auto& snap = out[s];
      for (const auto& v : p) snap.emplace_back(v.begin(), v.end());
    }
  }
  // Preconditioning is active: every block of every preconditioned tensor holds roots.
  for (std::size_t i = 0; i < c.tensors.size(); ++i)
    for (std::size_t j = 0; j < st.preconditioner().layout(i).blocks.size(); ++j) {
      INFO("tensor " << c.tensors[i].name << " block " << j);
      REQUIRE(st.preconditioner().block(i, j).ready);
      REQUIRE(st.preconditioner().block(i, j).failures == 0);
    }
  return out;
}

/// The largest |gradapt - reference| / scale over every stored element.
double worst_difference(const case_data& c, const std::map<int, std::vector<std::vector<double>>>& ours) {
  double worst = 0;
  for (const auto& r : c.results) {
    std::size_t ti = 0;
    while (c.tensors.at(ti).name != r.tensor) ++ti;
    const auto& mine = ours.at(r.step)[ti];
    REQUIRE(mine.size() == r.sample.size());
    for (std::size_t k = 0; k < mine.size(); ++k) {
      const double err = std::fabs(mine[k] - r.sample[k]) / c.scale;
      if (!(err <= worst)) worst = err;  // NaN propagates
    }
  }
  return worst;
}

// Differences are in units of the case's scale (how far the reference moved the parameters).
//
// double: both implementations compute the same formulas in float64 from the same float32
// inputs, in other operation orders and with other eigensolvers (LAPACK here, torch.linalg.eigh
// there); the coupled Newton roots run the same iteration to the same stopping rule. The
// differences measured are rounding: at most 2.1e-14 (the full-matrix case, 288 x 288 roots),
// 2.6e-15 elsewhere. 1e-10 leaves more than three orders of margin for other BLAS/LAPACK builds
// and sits 7e5 inside the eigen root in place of coupled Newton's (7.4e-8), 2e7 inside the
// nearest wrong variant (2.2e-3).
constexpr double rtol_double = 1e-10;
// float: gradapt's float run and the peer's float32 run each carry float32 rounding through the
// trajectory, amplified by the roots' conditioning; the peer's own float32 run lands
// `peer_float32` from its float64 run, and gradapt's float run lands a comparable distance from
// the same reference (the measured ratios are in docs/algorithms/shampoo.md). The tolerance is
// float_margin times `peer_float32`, never more than rtol_float_cap (each wrong variant must land
// 10x outside it).
constexpr double float_margin = 3;
constexpr double rtol_float_cap = 1e-2;

}  // namespace

TEST_CASE("shampoo matches DistributedShampoo reference trajectories", "[shampoo][refs]") {
  const auto files = case_files();
  REQUIRE(files.size() >= 12);
  for (const auto& file : files) {
    const case_data c = load_case(file);
    INFO("case " << c.name);
    REQUIRE(c.steps >= 30);
    REQUIRE(!c.results.empty());
    REQUIRE(c.scale > 0);
    REQUIRE(c.peer_float32 > 0);
    // The peer's float32 noise: its one float32 run, or where recorded the spread of its float32
    // runs over rounding orders (then not capped: the sensitivities below still must land 10x
    // outside).
    const double rtol_float = c.peer_float32_spread > 0
                                  ? float_margin * std::max(c.peer_float32, c.peer_float32_spread)
                                  : std::min(float_margin * c.peer_float32, rtol_float_cap);
    REQUIRE(!c.sensitivity.empty());
    for (const auto& [d, label] : c.sensitivity) {
      INFO("wrong variant '" << label << "' lands " << d << " away (tolerance " << rtol_float << ")");
      REQUIRE(d > 10 * rtol_float);
    }
    for (const auto& [d, label] : c.sensitivity_double) {
      INFO("variant '" << label << "' lands " << d << " away (double tolerance " << rtol_double << ")");
      REQUIRE(d > 10 * rtol_double);
    }
    if (opt_or(c, "preset", "-") != "-") check_preset(c);
    const double dd = worst_difference(c, run_case<double>(c));
    const double df = worst_difference(c, run_case<float>(c));
    WARN("case " << c.name << ": double " << dd << " (tolerance " << rtol_double << "), float " << df
                 << " (tolerance " << rtol_float << ", peer float32 " << c.peer_float32 << ")");
    CHECK(dd <= rtol_double);
    CHECK(df <= rtol_float);
    const auto kind = opt_or(c, "preconditioner", "shampoo");
    if (kind != "shampoo" && opt_or(c, "preset", "-") == "-") {
      // A deliberately wrong mapping in gradapt lands far outside the tolerance: one
      // Newton–Schulz step less, or the other eigenbasis refresh.
      case_data wrong = c;
      if (kind == "spectral_descent")
        wrong.opt["ns_steps"] = std::to_string(static_cast<int>(c.num("ns_steps")) - 1);
      else
        wrong.opt["eigenbasis"] = c.opt.at("eigenbasis") == "qr" ? "eigh" : "qr";
      const double dw = worst_difference(c, run_case<double>(wrong));
      INFO("the wrong mapping lands " << dw << " away");
      CHECK(dw > 10 * rtol_float);
    }
    if (opt_or(c, "spectrum", "clamp") == "shift" && opt_or(c, "preset", "-") == "-") {
      // What the choice means in float: the same case with gradapt's clamp (not asserted; the
      // double runs agree to rounding either way).
      case_data clamp = c;
      clamp.opt["spectrum"] = "clamp";
      WARN("case " << c.name << " with spectrum clamp: double "
                   << worst_difference(c, run_case<double>(clamp)) << ", float "
                   << worst_difference(c, run_case<float>(clamp)));
    }
  }
}

}  // namespace gradapt_test_shampoo_refs

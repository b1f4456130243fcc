// gradapt::kfac (optim/kfac.hpp) against kfac-pytorch (tests/data/kfac/*.txt, written by
// tests/data/make_kfac_refs.py, which is not run here; its docstring has the option mapping
// and the differences that are not matched).
//
// Each case file holds a 6 -> 5 -> 3 MLP's per-step inputs a, output gradients g and weight
// gradients M = [dW | db] as kfac-pytorch's own hooks saw them, and what the peer (float64)
// computed from them: the running factors A and G, its decomposition (eigen: eigenvalues and
// eigenvectors, or the prediv matrix 1 / (d_G d_Aᵀ + λ); inverse: (A + λI)⁻¹ and (G + λI)⁻¹),
// the KL-clipping scale ν and the gradient it writes back. The test feeds gradapt the same a,
// g and M, in double and in float, and checks every record:
//  - float: within 8 times the distance of the peer's own float32 run from its float64 run
//    (per group: factors, decomposition, gradient);
//  - double: within 64 times that distance scaled from float's unit roundoff to double's
//    (DBL_EPSILON / FLT_EPSILON = 2⁻²⁹): the peer's float32 distance is a few units of
//    float32 rounding, and double rounding of the same computations is that many units of
//    double's;
//  - every wrong variant of the peer recorded in the file (damping in the other place, factors
//    from zero, g times the rows, the decay swapped, no KL clipping) lands at least 10 times
//    the float tolerance away in some group, so the comparison can fail;
//  - the steps with factor and inverse updates are the peer's (a and g present exactly on
//    gradapt's factor-update steps, decompositions exactly on its inverse-update steps).
// Units: a matrix's deviation is max|x − r| / max|r|; an eigenvector's (after aligning its
// sign) max|x − r| · gap_j / max|d|, gap_j the distance of its eigenvalue to the nearest
// other one; ν's |x − r| / |r|.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "peer_data.hpp"

namespace gradapt_test_kfac_refs {

#ifndef GRADAPT_KFAC_DATA
#error "define GRADAPT_KFAC_DATA as the path of tests/data/kfac"
#endif

namespace {

using gradapt::kfac_layer;
using gradapt::tensor_view;

const char* const groups[] = {"factors", "decomposition", "gradient"};

std::string group_of(const std::string& kind) {
  if (kind == "A" || kind == "G") return "factors";
  if (kind == "V" || kind == "nu") return "gradient";
  return "decomposition";
}

using records = std::map<std::pair<std::string, int>, std::vector<double>>;  // (kind, layer)

struct case_data {
  std::string name, source, method;
  std::map<std::string, double> opt;
  std::vector<kfac_layer> layers;
  int steps = 0;
  std::int64_t rows = 0;
  std::map<std::string, double> float32;                            ///< per group
  std::vector<std::tuple<std::string, double, std::string>> wrong;  ///< group, distance, label
  std::vector<records> step;                                        ///< per step (0-based)
};

case_data load_case(const std::filesystem::path& file) {
  case_data c;
  const auto id =
      gradapt_test::read_peer_records(file, [&](const std::string& key, std::istream& ls, auto& in) {
        if (key == "opt") {
          for (const auto& [k, v] : gradapt_test::peer_options(ls))
            if (k == "method")
              c.method = v;
            else
              c.opt[k] = std::stod(v);
        } else if (key == "layers") {
        } else if (key == "layer") {
          kfac_layer l;
          int bias = 0;
          ls >> l.name >> l.in >> l.out >> bias;
          l.bias = bias != 0;
          c.layers.push_back(l);
        } else if (key == "steps") {
          std::string w;
          ls >> c.steps >> w >> c.rows;
        } else if (key == "float32") {
          std::string g;
          double d = 0;
          ls >> g >> d;
          c.float32[g] = d;
        } else if (key == "sensitivity") {
          std::string g, label;
          double d = 0;
          ls >> g >> d;
          std::getline(ls >> std::ws, label);
          c.wrong.emplace_back(g, d, label);
        } else if (key == "step") {
          int s = 0;
          ls >> s;
          if (s != static_cast<int>(c.step.size()) + 1)
            throw std::runtime_error("steps out of order: " + in.line());
          c.step.emplace_back();
        } else {
          int layer = 0;
          std::size_t n = 0;
          ls >> layer >> n;
          std::vector<double> v(n);
          for (auto& x : v) ls >> x;
          if (!ls || c.step.empty()) throw std::runtime_error("bad record: " + in.line().substr(0, 60));
          c.step.back()[{key, layer}] = std::move(v);
        }
      });
  if (c.step.size() != static_cast<std::size_t>(c.steps))
    throw std::runtime_error("short file " + file.string());
  c.name = id.name;
  c.source = id.source;
  return c;
}

std::vector<std::filesystem::path> case_files() { return gradapt_test::peer_case_files(GRADAPT_KFAC_DATA); }

double matrix_dev(const std::vector<double>& x, const std::vector<double>& r) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    num = std::max(num, std::fabs(x[i] - r[i]));
    den = std::max(den, std::fabs(r[i]));
  }
  return num / den;
}

// Eigenvectors (columns of row-major n × n) compared up to sign, scaled by gap_j / max|d|.
double eigvec_dev(const std::vector<double>& x, const std::vector<double>& r, const std::vector<double>& d) {
  const std::size_t n = d.size();
  double dmax = 0;
  for (double e : d) dmax = std::max(dmax, std::fabs(e));
  double worst = 0;
  for (std::size_t j = 0; j < n; ++j) {
    double dot = 0, gap = INFINITY, err = 0;
    for (std::size_t i = 0; i < n; ++i) dot += x[i * n + j] * r[i * n + j];
    for (std::size_t k = 0; k < n; ++k)
      if (k != j) gap = std::min(gap, std::fabs(d[j] - d[k]));
    const double s = dot >= 0 ? 1.0 : -1.0;
    for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(s * x[i * n + j] - r[i * n + j]));
    worst = std::max(worst, err * gap / dmax);
  }
  return worst;
}

gradapt::kfac_options options_of(const case_data& c) {
  const auto& o = c.opt;
  return {.factor_decay = o.at("factor_decay"),
          .factor_update_steps = static_cast<std::uint64_t>(o.at("factor_update_steps")),
          .inv_update_steps = static_cast<std::uint64_t>(o.at("inv_update_steps")),
          .damping = o.at("damping"),
          .method = c.method == "eigen" ? gradapt::kfac_method::eigen : gradapt::kfac_method::inverse,
          .prediv_eigenvalues = o.at("prediv") != 0.0,
          .kl_clip = o.at("kl_clip")};
}

template <class C>
std::vector<C> as(const std::vector<double>& v) {
  return std::vector<C>(v.begin(), v.end());
}

/// gradapt in element type C on the case's a, g and M; the largest deviation per group.
template <class C>
std::map<std::string, double> run(const case_data& c) {
  const gradapt::host_lapack la{};
  const gradapt::kfac kf(options_of(c));
  auto st = kf.init<C>(la, std::span<const kfac_layer>(c.layers));
  const double lr = c.opt.at("lr");
  std::map<std::string, double> worst;
  for (const char* g : groups) worst[g] = 0;
  const auto note = [&](const std::string& kind, double d) {
    double& w = worst[group_of(kind)];
    w = std::max(w, d);
  };
  for (int s = 0; s < c.steps; ++s) {
    const records& rec = c.step[static_cast<std::size_t>(s)];
    INFO("step " << s + 1);
    const bool factors = kf.factor_update_due(st);
    const bool inverse = s % static_cast<int>(c.opt.at("inv_update_steps")) == 0;
    std::vector<std::vector<C>> w, b;
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      const auto& l = c.layers[i];
      const int li = static_cast<int>(i);
      REQUIRE(rec.contains({"a", li}) == factors);  // the peer's factor steps are gradapt's
      REQUIRE(rec.contains({"A", li}) == factors);
      if (factors) {
        const auto a = as<C>(rec.at({"a", li})), g = as<C>(rec.at({"g", li}));
        REQUIRE(a.size() == static_cast<std::size_t>(c.rows * l.in));
        REQUIRE(g.size() == static_cast<std::size_t>(c.rows * l.out));
        kf.accumulate(st, i, tensor_view<const C>(a.data(), {c.rows, l.in}),
                      tensor_view<const C>(g.data(), {c.rows, l.out}));
      }
      const auto& m = rec.at({"M", li});
      const std::int64_t n = l.in + 1;
      REQUIRE(m.size() == static_cast<std::size_t>(l.out * n));
      w.emplace_back(static_cast<std::size_t>(l.out * l.in));
      b.emplace_back(static_cast<std::size_t>(l.out));
      for (std::int64_t r = 0; r < l.out; ++r) {
        for (std::int64_t k = 0; k < l.in; ++k)
          w.back()[static_cast<std::size_t>(r * l.in + k)] = C(m[static_cast<std::size_t>(r * n + k)]);
        b.back()[static_cast<std::size_t>(r)] = C(m[static_cast<std::size_t>(r * n + l.in)]);
      }
    }
    std::vector<gradapt::kfac_grad<C>> grads;
    for (std::size_t i = 0; i < c.layers.size(); ++i)
      grads.push_back({tensor_view<C>(w[i].data(), {c.layers[i].out, c.layers[i].in}),
                       tensor_view<C>(b[i].data(), {c.layers[i].out})});
    const auto decompositions = st.decompositions();
    kf.step(st, grads, lr);
    REQUIRE(st.decompositions() - decompositions == (inverse ? c.layers.size() : 0));  // the peer's steps

    const auto bytes = st.save();
    gradapt::archive_reader ar(bytes, "gradapt.kfac", std::remove_cvref_t<decltype(st)>::archive_version);
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      const auto& l = c.layers[i];
      const int li = static_cast<int>(i);
      const auto n = static_cast<std::size_t>(l.in + 1), out = static_cast<std::size_t>(l.out);
      INFO("layer " << l.name);
      if (factors) {
        const auto fa = st.factor_a(i), fg = st.factor_g(i);
        note("A", matrix_dev(std::vector<double>(fa.begin(), fa.end()), rec.at({"A", li})));
        note("G", matrix_dev(std::vector<double>(fg.begin(), fg.end()), rec.at({"G", li})));
      }
      // The decomposition gradapt holds, from its checkpoint.
      ar.begin("layer/" + l.name);
      const auto dec = ar.template get_tensor<C>("decomposition");
      ar.end();
      const std::vector<double> d(dec.begin(), dec.end());
      const bool peer_dec = rec.contains({c.method == "eigen" ? "QA" : "Ainv", li});
      REQUIRE(peer_dec == inverse);
      if (inverse && c.method == "inverse") {
        note("Ainv", matrix_dev({d.begin(), d.begin() + n * n}, rec.at({"Ainv", li})));
        note("Ginv", matrix_dev({d.begin() + n * n, d.end()}, rec.at({"Ginv", li})));
      } else if (inverse) {
        const auto at = [&](std::size_t off, std::size_t len) {
          return std::vector<double>(d.begin() + off, d.begin() + off + len);
        };
        const auto qa = at(0, n * n), da = at(n * n, n), qg = at(n * n + n, out * out),
                   dg = at(n * n + n + out * out, out);
        if (rec.contains({"dA", li})) {
          note("dA", matrix_dev(da, rec.at({"dA", li})));
          note("dG", matrix_dev(dg, rec.at({"dG", li})));
          note("QA", eigvec_dev(qa, rec.at({"QA", li}), rec.at({"dA", li})));
          note("QG", eigvec_dev(qg, rec.at({"QG", li}), rec.at({"dG", li})));
        } else {  // prediv: the peer keeps no eigenvalues; gradapt's scale the eigenvectors
          note("QA", eigvec_dev(qa, rec.at({"QA", li}), da));
          note("QG", eigvec_dev(qg, rec.at({"QG", li}), dg));
          note("dgda", matrix_dev(at(n * n + n + out * out + out, out * n), rec.at({"dgda", li})));
        }
      }
      std::vector<double> v(out * n);
      for (std::size_t r = 0; r < out; ++r) {
        for (std::size_t k = 0; k + 1 < n; ++k) v[r * n + k] = w[i][r * (n - 1) + k];
        v[r * n + n - 1] = b[i][r];
      }
      note("V", matrix_dev(v, rec.at({"V", li})));
    }
    const double nu = rec.at({"nu", 0}).at(0);
    note("nu", std::fabs(st.last_kl_scale() - nu) / nu);
  }
  return worst;
}

constexpr double float_margin = 8;    // float tolerance: this times the peer's float32 distance
constexpr double double_margin = 64;  // double: this times that distance in double's roundoff

}  // namespace

TEST_CASE("kfac matches kfac-pytorch's factors, decompositions and preconditioned gradients",
          "[kfac][refs]") {
  const auto files = case_files();
  REQUIRE(files.size() >= 3);
  for (const auto& file : files) {
    const case_data c = load_case(file);
    INFO("case " << c.name << " (" << c.source << ")");
    REQUIRE(c.float32.size() == 3);
    std::map<std::string, double> float_tol, double_tol;
    for (const char* g : groups) {
      REQUIRE(c.float32.at(g) > 0);
      float_tol[g] = float_margin * c.float32.at(g);
      double_tol[g] = double_margin * c.float32.at(g) * (DBL_EPSILON / FLT_EPSILON);
    }
    // Every wrong variant lands at least 10 times the float tolerance away in some group.
    std::map<std::string, double> separation;
    for (const auto& [g, d, label] : c.wrong)
      separation[label] = std::max(separation[label], d / float_tol.at(g));
    REQUIRE(separation.size() >= 3);
    for (const auto& [label, ratio] : separation) {
      INFO("wrong variant '" << label << "' lands " << ratio << " float tolerances away");
      REQUIRE(ratio >= 10);
      WARN("case " << c.name << ": wrong variant '" << label << "' lands " << ratio
                   << " float tolerances away");
    }
    const auto dbl = run<double>(c);
    const auto flt = run<float>(c);
    for (const char* g : groups) {
      INFO(g << ": double " << dbl.at(g) << " (tolerance " << double_tol.at(g) << "), float " << flt.at(g)
             << " (tolerance " << float_tol.at(g) << ")");
      CHECK(dbl.at(g) <= double_tol.at(g));
      CHECK(flt.at(g) <= float_tol.at(g));
      WARN("case " << c.name << ", " << g << ": double " << dbl.at(g) << " (tolerance " << double_tol.at(g)
                   << "), float " << flt.at(g) << " (tolerance " << float_tol.at(g) << ")");
    }
  }
}

}  // namespace gradapt_test_kfac_refs

// Four steps of the Shampoo stage (then the learning rate) with its state in the memory of
// element backend B and linear algebra L, against the long double re-run of
// shampoo_ld_reference, written once for every memory: test_shampoo_device_path runs it through
// the device-tagged host backends, test_linalg_cuda on gradapt::cuda with cuda_linalg. `Mem`
// moves host vectors in and out of that memory as in kfac_reference_run.hpp: `alloc<T>(n)`,
// `put(buffer, host)`, `get(buffer) -> host` (each waiting for the backend's work).
//
// A wide and a tall matrix (each with a factor rank-deficient at step 1) and a bias (not
// preconditioned, graft none: g itself); blocks not merged (each matrix whole); lr 0.1; a
// checkpoint round trip after step 2 (with root_staleness 1, roots in flight).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/optim/shampoo.hpp"
#include "shampoo_ld_reference.hpp"

namespace gradapt_test {

/// What shampoo_against_ld measured: the largest difference between the parameters and the
/// re-run's (every step, every tensor) and the root computations of the stage.
struct shampoo_against_result {
  double worst = 0;
  std::uint64_t root_computations = 0;
};

/// `o` (its merge_small_dims set to false) with `ref_dir(reference, g)` the re-run's direction of
/// a matrix's gradient g; `root_la`: the stage's root_linalg when set.
template <class Sp, class B, class L, class Mem, class Dir>
shampoo_against_result shampoo_against_ld(const B& b, const L& la,
                                          std::optional<std::type_identity_t<L>> root_la, const Mem& mem,
                                          gradapt::shampoo_options o, Dir ref_dir) {
  namespace tr = gradapt::transform;
  o.lr = 0.1;
  o.merge_small_dims = false;
  tr::scale_by_shampoo<L> pre{.options = o, .linalg = la, .root_linalg = std::move(root_la)};
  const gradapt::chain<tr::scale_by_shampoo<L>, tr::scale_by_learning_rate> opt(
      std::move(pre), tr::scale_by_learning_rate{.lr = o.lr});
  const std::vector<std::pair<std::int64_t, std::int64_t>> dims{{12, 20}, {20, 12}, {1, 7}};
  std::mt19937_64 rng(50);
  std::uniform_real_distribution<double> u(-1, 1);
  const auto draw = [&](std::size_t n) {
    std::vector<double> v(n);
    for (auto& e : v) e = u(rng);
    return v;
  };
  std::vector<std::vector<double>> w;
  std::vector<std::unique_ptr<shampoo_ld_reference>> ref;
  std::vector<decltype(mem.template alloc<double>(1))> dw, dg;
  gradapt::param_list<double, double, Sp> params;
  for (std::size_t t = 0; t < dims.size(); ++t) {
    const auto [m, n] = dims[t];
    w.push_back(draw(std::size_t(m * n)));
    ref.push_back(std::make_unique<shampoo_ld_reference>(std::size_t(m), std::size_t(n), o.root.epsilon));
    dw.push_back(mem.template alloc<double>(w.back().size()));
    mem.put(dw.back(), w.back());
    dg.push_back(mem.template alloc<double>(w.back().size()));
  }
  for (std::size_t t = 0; t < dims.size(); ++t) {
    const auto [m, n] = dims[t];
    const std::vector<std::int64_t> shape =
        m == 1 ? std::vector<std::int64_t>{n} : std::vector<std::int64_t>{m, n};
    params.add("p" + std::to_string(t), gradapt::tensor_view<double, Sp>(dw[t].data(), shape),
               gradapt::tensor_view<double, Sp>(dg[t].data(), shape));
  }
  shampoo_against_result out;
  auto st = opt.init(b, params);
  for (int k = 1; k <= 4; ++k) {
    for (std::size_t t = 0; t < dims.size(); ++t) {
      const auto g = draw(w[t].size());
      mem.put(dg[t], g);
      const auto dir = dims[t].first == 1 ? g : ref_dir(*ref[t], g);
      for (std::size_t i = 0; i < g.size(); ++i) w[t][i] -= o.lr * dir[i];
    }
    opt.step(b, params, st);
    if (k == 2) {  // the statistics, roots, copies in flight and moments leave the memory and come back
      const auto saved = st.save(b);
      st = opt.init(b, params);
      st.load(b, saved);
    }
    for (std::size_t t = 0; t < dims.size(); ++t) {
      const auto now = mem.get(dw[t]);
      for (std::size_t i = 0; i < now.size(); ++i)
        out.worst = std::max(out.worst, std::fabs(now[i] - w[t][i]));
    }
  }
  out.root_computations = st.preconditioner().root_computations();
  return out;
}

}  // namespace gradapt_test

#pragma once
/// @file
/// `gradapt::shampoo`'s statistics: a block's gradient gathered from the tensor and its
/// mode-d Gram matrices accumulated, S_d ← β2·S_d + w·X_(d)·X_(d)ᵀ, and a block's mode d seen
/// as a × n × c.

#include <cstddef>
#include <cstdint>
#include <utility>

#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

#include "gradapt/optim/shampoo.hpp"

namespace gradapt {

/// Block j of tensor x: the gradient's statistics.
template <class L>
template <class St, class Ex, class Tensor, class G>
void transform::scale_by_shampoo<L>::block_stats(St& st, const Ex& ex, Tensor& x, std::size_t j,
                                                 const G* g) const {
  using C = typename St::compute_type;
  using Sp = typename L::space;
  if (x.layout.diagonal) return;
  auto& bl = x.blocks[j];
  C* xb = st.xb_.data();
  gradapt::detail::shampoo_impl::for_runs(
      x.layout.merged, x.layout.blocks[j], [&](std::size_t flat, std::size_t at, std::size_t run) {
        ex.apply(gradapt::detail::shampoo_impl::gather_as<C>{},
                 tensor_view<C, Sp>::vector(xb + at, static_cast<std::int64_t>(run)),
                 tensor_view<const G, Sp>::vector(g + flat, static_cast<std::int64_t>(run)));
      });
  const auto& la = st.la_;
  using cview = tensor_view<const C, Sp>;
  using mview = tensor_view<C, Sp>;
  const double beta = options.beta2, w = options.beta2 == 1.0 ? 1.0 : 1.0 - options.beta2;
  for (std::size_t d = 0; d < bl.k; ++d) {
    if (bl.p[d] == 0) continue;  // not preconditioned: no statistic
    const std::int64_t n = bl.n[d];
    const auto [a, c] = split(bl, d);
    const mview s(st.stats_at(bl) + bl.off[d], {n, n});
    if (a == 1) {
      la.syrk(gram::rows, w, cview(xb, {n, c}), beta, s);
    } else if (c == 1) {
      la.syrk(gram::columns, w, cview(xb, {a, n}), beta, s);
    } else {
      for (std::int64_t q = 0; q < a; ++q)
        la.syrk(gram::rows, w, cview(xb + q * n * c, {n, c}), q == 0 ? beta : 1.0, s);
    }
  }
}

/// Mode d of a block as a × n × c (a: the dimensions before d, c: after).
template <class L>
template <class Block>
std::pair<std::int64_t, std::int64_t> transform::scale_by_shampoo<L>::split(const Block& bl, std::size_t d) {
  std::int64_t a = 1, c = 1;
  for (std::size_t e = 0; e < d; ++e) a *= bl.n[e];
  for (std::size_t e = d + 1; e < bl.k; ++e) c *= bl.n[e];
  return {a, c};
}

}  // namespace gradapt

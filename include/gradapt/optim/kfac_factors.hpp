#pragma once
/// @file
/// `gradapt::kfac`'s running factors: the factor update of a step from the terms `accumulate`
/// added (averaged over the ranks in one allreduce of their upper triangles when distributed)
/// and the running averages A ← d·A + (1 − d)·aᵀa / rows, G ← d·G + (1 − d)·gᵀg / rows.

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

#include "gradapt/optim/kfac.hpp"

namespace gradapt {

/// The running factors from this step's terms (averaged over the ranks when distributed).
template <class CommPtr, class St>
void kfac::update_factors(CommPtr comm, St& st, std::uint64_t t) const {
  using C = std::remove_cvref_t<decltype(st.red_[0])>;
  constexpr bool dist = !std::is_same_v<CommPtr, std::nullptr_t>;
  if constexpr (dist) {
    // One buffer: per layer a flag (it had terms), then the upper triangles of A's and G's terms.
    std::size_t words = 0;
    for (const auto& x : st.l_)
      words += 1 + static_cast<std::size_t>(x.n * (x.n + 1) / 2 + x.spec.out * (x.spec.out + 1) / 2);
    st.red_.assign(words, C(0));
    C* p = st.red_.data();
    for (auto& x : st.l_) {
      *p++ = x.count ? C(1) : C(0);
      pack(p, x.ba, x.n, x.count);
      pack(p, x.bg, x.spec.out, x.count);
    }
    comm->allreduce(tensor_view<C, host_space>::vector(st.red_.data(), static_cast<std::int64_t>(words)),
                    reduce_op::sum);
    const int n = comm->size();
    p = st.red_.data();
    for (auto& x : st.l_) {
      const auto have = static_cast<int>(*p++);
      if (have != n) {
        for (auto& y : st.l_) y.count = 0;
        detail::fail("kfac::step on rank ", comm->rank(), ": layer '", x.spec.name, "' got a and g on ", have,
                     " of ", n, " ranks at factor-update step ", t,
                     " (every rank must call accumulate for every layer on these steps)");
      }
      unpack(p, x.ba, x.n, C(n));
      unpack(p, x.bg, x.spec.out, C(n));
    }
  } else {
    for (auto& x : st.l_) {
      if (x.count == 0) {
        detail::fail("kfac::step: layer '", x.spec.name, "' got no a and g at factor-update step ", t,
                     " (call accumulate for every layer on these steps; factor_update_due() says which)");
      }
      const C inv = C(x.count);
      for (auto& e : x.ba) e = e / inv;
      for (auto& e : x.bg) e = e / inv;
    }
  }
  const C d = C(o_.factor_decay), w = C(1.0 - o_.factor_decay);
  for (auto& x : st.l_) {
    ema(x.a, x.ba, x.n, x.inited, d, w);
    ema(x.g, x.bg, x.spec.out, x.inited, d, w);
    x.inited = true;
    x.count = 0;
  }
}
template <class C>
void kfac::pack(C*& p, const std::vector<C>& m, std::int64_t n, std::uint64_t count) {
  const C inv = C(count ? count : 1);
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c = r; c < n; ++c) *p++ = count ? m[static_cast<std::size_t>(r * n + c)] / inv : C(0);
}
template <class C>
void kfac::unpack(C*& p, std::vector<C>& m, std::int64_t n, C ranks) {
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c = r; c < n; ++c) {
      const C v = *p++ / ranks;
      m[static_cast<std::size_t>(r * n + c)] = v;
      m[static_cast<std::size_t>(c * n + r)] = v;
    }
}
template <class C>
void kfac::ema(std::vector<C>& f, const std::vector<C>& b, std::int64_t n, bool inited, C d, C w) {
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c = 0; c < n; ++c) {
      const auto e = static_cast<std::size_t>(r * n + c);
      const C prev = inited ? f[e] : (r == c ? C(1) : C(0));
      f[e] = d * prev + w * b[e];
    }
}

}  // namespace gradapt

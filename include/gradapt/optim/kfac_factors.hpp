#pragma once
/// @file
/// `gradapt::kfac`'s running factors: the factor update of a step from the terms `accumulate`
/// added (averaged over the ranks in one allreduce of the whole terms when distributed) and the
/// running averages A ← d·A + (1 − d)·aᵀa / rows, G ← d·G + (1 − d)·gᵀg / rows, as passes of
/// the state's element backend that keep the factors symmetric bit for bit.

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
  using C = std::remove_cvref_t<decltype(*st.terms_.data())>;
  namespace k = detail::kfac_k;
  constexpr bool dist = !std::is_same_v<CommPtr, std::nullptr_t>;
  const auto& ex = st.ex_;
  // Each rank's terms are averaged over its accumulate calls first.
  for (auto& x : st.l_)
    if (x.count > 1) {
      const auto e = static_cast<std::size_t>(x.n * x.n + x.spec.out * x.spec.out);
      ex.apply(k::divide{double(x.count)}, St::vec(st.terms_.data() + x.terms, e));
    }
  double ranks = 1;
  if constexpr (dist) {
    // One allreduce of the whole buffer: per layer a flag (it had terms), then the terms.
    const std::size_t layers = st.l_.size();
    auto& flags = st.flags_;  // host memory, kept with the state
    flags.resize(layers);
    for (std::size_t i = 0; i < layers; ++i) flags[i] = st.l_[i].count ? C(1) : C(0);
    if constexpr (St::on_host)
      std::copy(flags.begin(), flags.end(), st.terms_.data());
    else
      ex.copy(tensor_view<const C, host_space>::vector(flags.data(), static_cast<std::int64_t>(layers)),
              St::vec(st.terms_.data(), layers));
    comm->allreduce(St::vec(st.terms_.data(), st.terms_.size()), reduce_op::sum);
    if constexpr (St::on_host) {
      std::copy(st.terms_.data(), st.terms_.data() + layers, flags.begin());
    } else {
      ex.copy(St::vec(static_cast<const C*>(st.terms_.data()), layers),
              tensor_view<C, host_space>::vector(flags.data(), static_cast<std::int64_t>(layers)));
      ex.synchronize();
    }
    const int n = comm->size();
    for (std::size_t i = 0; i < layers; ++i) {
      const auto have = static_cast<int>(flags[i]);
      if (have != n) {
        for (auto& y : st.l_) y.count = 0;
        detail::fail("kfac::step on rank ", comm->rank(), ": layer '", st.l_[i].spec.name,
                     "' got a and g on ", have, " of ", n, " ranks at factor-update step ", t,
                     " (every rank must call accumulate for every layer on these steps)");
      }
    }
    ranks = n;
  } else {
    for (auto& x : st.l_)
      if (x.count == 0)
        detail::fail("kfac::step: layer '", x.spec.name, "' got no a and g at factor-update step ", t,
                     " (call accumulate for every layer on these steps; factor_update_due() says which)");
  }
  const auto average = [&](C* f, const C* b, std::int64_t n) {
    const auto iota = tensor_view<const C, typename St::space>::vector(st.iota_.data(), n);
    ex.apply_factored(k::symmetric_average<C>{o_.factor_decay, 1.0 - o_.factor_decay, ranks, b,
                                              static_cast<std::size_t>(n)},
                      {1, n, 1, n, 1}, iota, iota, tensor_view<C, typename St::space>(f, {n, n}));
  };
  for (auto& x : st.l_) {
    const C* ta = st.terms_.data() + x.terms;
    average(x.a.data(), ta, x.n);
    average(x.g.data(), ta + x.a.size(), x.spec.out);
    x.count = 0;
  }
}

}  // namespace gradapt

#pragma once
/// @file
/// `gradapt::kfac`'s decompositions and preconditioning products: each layer's eigen
/// decompositions or damped inverses of its factors (exchanged within its group of grad workers
/// when distributed), the failure counters, the preconditioned gradient V, ⟨V, M⟩ for KL clipping
/// and V written back into the gradient.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

#include "gradapt/optim/kfac.hpp"

namespace gradapt {

/// The decompositions of this rank's layers, then (g > 1, host memory) exchanged within each
/// group of grad workers and installed where held; in device memory every rank decomposes every
/// layer, after one agreement on the factors' hash. Each layer's outcome is left in `outcome`
/// where held. Returns a message when a group member's factors differ (empty otherwise).
template <class CommPtr, class St>
std::string kfac::decompose(CommPtr comm, St& st, std::uint64_t t) const {
  using D = std::remove_cvref_t<decltype(*st.m_.data())>;
  if constexpr (!St::on_host && !std::is_same_v<CommPtr, std::nullptr_t>) {
    if (st.world_ > 1) {
      const agreed_value values[] = {{"factors (hash)", static_cast<double>(factor_hash(st) >> 16)}};
      try {
        agree_values(*comm, st.ex_, "kfac::step (the factors the decompositions come from)",
                     std::span<const agreed_value>(values));
      } catch (const error&) {
        st.failed_ = true;  // the factors were updated: the state is not usable
        throw;
      }
    }
  }
  for (std::size_t i = 0; i < st.l_.size(); ++i) {
    if (st.owner_[i] != st.rank_) continue;
    auto& x = st.l_[i];
    if (st.group_ == 1 || !St::on_host) {
      D* out = st.dtmp_.data();
      const bool ok = decompose_layer(st, x, out);
      install(st, x, ok, static_cast<const D*>(out));
    } else {
      D* out = st.xd_.out(i);
      out[0] = decompose_layer(st, x, out + 1) ? D(1) : D(0);
    }
    ++st.computed_;
  }
  if constexpr (!std::is_same_v<CommPtr, std::nullptr_t> && St::on_host) {
    if (st.group_ > 1) {
      const int differs = st.xd_.run(*group_comm(*comm, st), t, factor_hash(st), "kfac::step");
      if (differs >= 0)
        return "kfac::step on rank " + std::to_string(st.rank_) + ": the factors of rank " +
               std::to_string(st.rank_ - st.rank_ % st.group_ + differs) + " differ from rank " +
               std::to_string(st.rank_ - st.rank_ % st.group_) + "'s at step " + std::to_string(t) +
               "; restore a checkpoint with load()";
      for (std::size_t i = 0; i < st.l_.size(); ++i) {
        auto& x = st.l_[i];
        if (!x.held) continue;
        const D* in = st.xd_.in(i);
        install(st, x, in[0] == D(1), in + 1);
      }
    }
  }
  return {};
}

/// Layer x's decomposition into `out` (the layout of x.dec, in the state's memory); false when a
/// factor is not finite or the eigensolver fails.
template <class St, class X, class D>
bool kfac::decompose_layer(St& st, X& x, D* out) const {
  using Sp = typename St::space;
  using cv = tensor_view<const D, Sp>;
  using mv = tensor_view<D, Sp>;
  namespace k = detail::kfac_k;
  const auto& ex = st.ex_;
  const auto& la = st.la_;
  const std::int64_t na = x.n, ng = x.spec.out;
  const auto sa = static_cast<std::size_t>(na * na), sg = static_cast<std::size_t>(ng * ng);
  const auto finite = [&](const auto* p, std::size_t n) {
    return ex.reduce(reduction::count_nonfinite, St::vec(p, n)) == 0;
  };
  if (!finite(x.a.data(), sa) || !finite(x.g.data(), sg)) return false;
  D* qa = out;
  D* da = qa + sa;
  D* qg = da + na;
  D* dg = qg + sg;
  // eigen layout: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹ (built from the same
  // eigendecompositions in the scratch).
  if (o_.method == kfac_method::inverse) {
    qa = st.tmp_.data();
    da = qa + sa;
    qg = da + na;
    dg = qg + sg;
  }
  ex.apply(k::cast{}, St::vec(qa, sa), St::vec(std::as_const(x).a.data(), sa));
  ex.apply(k::cast{}, St::vec(qg, sg), St::vec(std::as_const(x).g.data(), sg));
  if (!la.eigh(mv(qa, {na, na}), mv(da, {na}), find_ws(st, na))) return false;
  if (!la.eigh(mv(qg, {ng, ng}), mv(dg, {ng}), find_ws(st, ng))) return false;
  ex.apply(k::clamp_zero{}, St::vec(da, static_cast<std::size_t>(na)));
  ex.apply(k::clamp_zero{}, St::vec(dg, static_cast<std::size_t>(ng)));
  if (!finite(qa, sa) || !finite(qg, sg)) return false;
  const double lambda = o_.damping;
  if (o_.method == kfac_method::inverse) {
    // X⁻¹ = (Q·diag(1 / (d + λ)))·Qᵀ: the columns scaled, then one product.
    D* qs = dg + ng;
    const auto inverse = [&](const D* q, const D* d, std::int64_t n, D* dst) {
      ex.apply_factored(k::scale_columns{lambda}, {1, n, 1, n, 1}, cv(), cv(d, {n}), mv(qs, {n, n}),
                        cv(q, {n, n}));
      la.gemm(transpose::none, transpose::yes, 1.0, cv(qs, {n, n}), cv(q, {n, n}), 0.0, mv(dst, {n, n}));
    };
    inverse(qa, da, na, out);
    inverse(qg, dg, ng, out + sa);
    return finite(out, sa + sg);
  }
  if (o_.prediv_eigenvalues) {
    D* pd = dg + ng;
    const auto e = static_cast<std::size_t>(ng * na);
    ex.apply_factored(k::kron_reciprocal{lambda}, {1, ng, 1, na, 1}, cv(dg, {ng}), cv(da, {na}),
                      mv(pd, {ng, na}));
    if (!finite(pd, e)) return false;
  }
  return true;
}

/// Installs a held layer's decomposition (when it succeeded) and records the outcome.
template <class St, class X, class D>
void kfac::install(const St& st, X& x, bool ok, const D* dec) {
  x.outcome = ok ? 1 : 2;
  if (!ok) return;
  st.ex_.apply(detail::kfac_k::cast{}, St::vec(x.dec.data(), x.dec.size()), St::vec(dec, x.dec.size()));
  x.have = true;
}

/// Every layer's failure counters from this step's outcomes (the same on every rank); throws
/// for a layer that failed max_consecutive_failures times in a row.
template <class St>
void kfac::count_outcomes(St& st) {
  for (std::size_t i = 0; i < st.l_.size(); ++i) {
    auto& x = st.l_[i];
    if (x.outcome == 1) {
      x.ready = true;
      x.consecutive = 0;
    } else if (x.outcome == 2) {
      ++x.failures;
      ++x.consecutive;
    }
  }
  for (std::size_t i = 0; i < st.l_.size(); ++i) {
    const auto& x = st.l_[i];
    if (x.outcome != 2 || x.consecutive < st.max_failures_) continue;
    st.failed_ = true;
    detail::fail(
        "kfac::step: layer '", x.spec.name, "': the decomposition failed ", x.consecutive, " times in a row",
        st.world_ > 1 && St::on_host ? " (computed on rank " + std::to_string(st.owner_[i]) + ")"
                                     : std::string(),
        "; a non-finite a or g makes the factors non-finite for good. The gradients are unchanged; "
        "restore a checkpoint with load() (and skip non-finite steps, e.g. with the loss scaler), or "
        "raise max_consecutive_failures");
  }
}

/// Layer i's gradient as M (out × (in [+1]), the bias as the last column) in D, into m_.
template <class St, class G>
void kfac::gradient_matrix(St& st, std::size_t i, const G& gr) {
  using Sp = typename St::space;
  using D = std::remove_cvref_t<decltype(*st.m_.data())>;
  using T = typename decltype(gr.weight)::element_type;
  namespace k = detail::kfac_k;
  const auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
  D* m = st.m_.data();
  if (x.spec.bias) {
    st.ex_.apply_list(k::cast{}, k::rows_of<D, Sp>(m, ng, na, 0, in),
                      k::rows_of<const T, Sp>(gr.weight.data(), ng, in, 0, in));
    st.ex_.apply_list(k::cast{}, k::rows_of<D, Sp>(m, ng, na, in, 1),
                      k::rows_of<const T, Sp>(gr.bias.data(), ng, 1, 0, 1));
  } else {
    st.ex_.apply(k::cast{}, St::vec(m, static_cast<std::size_t>(ng * na)),
                 St::vec(static_cast<const T*>(gr.weight.data()), static_cast<std::size_t>(ng * na)));
  }
}

/// Layer i's preconditioned gradient V (out × (in [+1])) into `v`; M itself while this rank
/// holds no decomposition of the layer.
template <class St, class G, class D>
void kfac::precondition(St& st, std::size_t i, const G& gr, D* v) const {
  using Sp = typename St::space;
  using cv = tensor_view<const D, Sp>;
  using mv = tensor_view<D, Sp>;
  namespace k = detail::kfac_k;
  auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out;
  const auto size = static_cast<std::size_t>(ng * na);
  gradient_matrix(st, i, gr);
  const D* m = st.m_.data();
  const auto& ex = st.ex_;
  if (!x.have) {
    ex.apply(k::cast{}, St::vec(v, size), St::vec(m, size));
    return;
  }
  const auto& la = st.la_;
  D* tmp = st.tmp_.data();
  if (o_.method == kfac_method::inverse) {
    const D* ai = x.dec.data();
    const D* gi = ai + na * na;
    la.gemm(transpose::none, transpose::none, 1.0, cv(gi, {ng, ng}), cv(m, {ng, na}), 0.0, mv(tmp, {ng, na}));
    la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(ai, {na, na}), 0.0, mv(v, {ng, na}));
    return;
  }
  const D* qa = x.dec.data();
  const D* da = qa + na * na;
  const D* qg = da + na;
  const D* dg = qg + ng * ng;
  const D* pd = dg + ng;
  // V1 = Q_Gᵀ·M·Q_A
  la.gemm(transpose::yes, transpose::none, 1.0, cv(qg, {ng, ng}), cv(m, {ng, na}), 0.0, mv(tmp, {ng, na}));
  la.gemm(transpose::none, transpose::none, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0, mv(v, {ng, na}));
  // V2 = V1 ⊘ (d_G·d_Aᵀ + λ)
  if (o_.prediv_eigenvalues)
    ex.apply(k::times{}, St::vec(v, size), St::vec(pd, size));
  else
    ex.apply_factored(k::kron_divide{o_.damping}, {1, ng, 1, na, 1}, cv(dg, {ng}), cv(da, {na}),
                      mv(v, {ng, na}));
  // V = Q_G·V2·Q_Aᵀ
  la.gemm(transpose::none, transpose::none, 1.0, cv(qg, {ng, ng}), cv(v, {ng, na}), 0.0, mv(tmp, {ng, na}));
  la.gemm(transpose::none, transpose::yes, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0, mv(v, {ng, na}));
}

/// ⟨V, M⟩ of layer i in double (M as the decomposition type), by the backend's fixed-order dot.
template <class St, class G, class D>
double kfac::dot(St& st, std::size_t i, const G& gr, const D* v) {
  const auto& x = st.l_[i];
  const auto size = static_cast<std::size_t>(x.spec.out * x.n);
  gradient_matrix(st, i, gr);
  return st.ex_.dot(St::vec(v, size), St::vec(static_cast<const D*>(st.m_.data()), size));
}

/// V·ν written back into layer i's weight and bias gradients.
template <class St, class G, class D>
void kfac::write_v(St& st, std::size_t i, const G& gr, double nu, const D* v) {
  using Sp = typename St::space;
  using T = typename decltype(gr.weight)::element_type;
  namespace k = detail::kfac_k;
  const auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
  const k::scaled_cast f{nu};
  if (x.spec.bias) {
    st.ex_.apply_list(f, k::rows_of<T, Sp>(gr.weight.data(), ng, in, 0, in),
                      k::rows_of<const D, Sp>(v, ng, na, 0, in));
    st.ex_.apply_list(f, k::rows_of<T, Sp>(gr.bias.data(), ng, 1, 0, 1),
                      k::rows_of<const D, Sp>(v, ng, na, in, 1));
  } else {
    st.ex_.apply(f, St::vec(gr.weight.data(), static_cast<std::size_t>(ng * na)),
                 St::vec(v, static_cast<std::size_t>(ng * na)));
  }
}

}  // namespace gradapt

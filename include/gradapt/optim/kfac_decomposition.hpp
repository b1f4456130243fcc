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
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

#include "gradapt/optim/kfac.hpp"

namespace gradapt {

/// The decompositions of this rank's layers, then (g > 1) exchanged within each group of grad
/// workers and installed where held. Each layer's outcome is left in `outcome` where held.
/// Returns a message when a group member's factors differ (empty otherwise).
template <class CommPtr, class St>
std::string kfac::decompose(CommPtr comm, St& st, std::uint64_t t) const {
  using D = std::remove_cvref_t<decltype(st.m_[0])>;
  for (std::size_t i = 0; i < st.l_.size(); ++i) {
    if (st.owner_[i] != st.rank_) continue;
    auto& x = st.l_[i];
    if (st.group_ == 1) {
      st.dtmp_.resize(st.dec_size(x));
      const bool ok = decompose_layer(st, x, st.dtmp_.data());
      install(x, ok, st.dtmp_.data());
    } else {
      D* out = st.xd_.out(i);
      out[0] = decompose_layer(st, x, out + 1) ? D(1) : D(0);
    }
    ++st.computed_;
  }
  if constexpr (!std::is_same_v<CommPtr, std::nullptr_t>) {
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
        install(x, in[0] == D(1), in + 1);
      }
    }
  }
  return {};
}

/// Layer x's decomposition into `out` (the layout of x.dec); false when a factor is not finite
/// or the eigensolver fails.
template <class St, class X, class D>
bool kfac::decompose_layer(St& st, X& x, D* out) const {
  const std::int64_t na = x.n, ng = x.spec.out;
  for (const auto e : x.a)
    if (!std::isfinite(e)) return false;
  for (const auto e : x.g)
    if (!std::isfinite(e)) return false;
  D* qa = out;
  D* da = qa + na * na;
  D* qg = da + na;
  D* dg = qg + ng * ng;
  // eigen layout: Q_A, d_A, Q_G, d_G (+ prediv); inverse: A⁻¹, G⁻¹ (built from the same
  // eigendecompositions in the scratch).
  std::vector<D>& tmp = st.tmp_;
  if (o_.method == kfac_method::inverse) {
    tmp.resize(static_cast<std::size_t>(na * na + na + ng * ng + ng));
    qa = tmp.data();
    da = qa + na * na;
    qg = da + na;
    dg = qg + ng * ng;
  }
  std::copy(x.a.begin(), x.a.end(), qa);
  std::copy(x.g.begin(), x.g.end(), qg);
  const auto& la = st.la_;
  if (!la.eigh(tensor_view<D, host_space>(qa, {na, na}), tensor_view<D, host_space>(da, {na}),
               find_ws(st, na)))
    return false;
  if (!la.eigh(tensor_view<D, host_space>(qg, {ng, ng}), tensor_view<D, host_space>(dg, {ng}),
               find_ws(st, ng)))
    return false;
  for (std::int64_t e = 0; e < na; ++e) da[e] = std::max(da[e], D(0));
  for (std::int64_t e = 0; e < ng; ++e) dg[e] = std::max(dg[e], D(0));
  for (std::int64_t e = 0; e < na * na; ++e)
    if (!std::isfinite(qa[e])) return false;
  for (std::int64_t e = 0; e < ng * ng; ++e)
    if (!std::isfinite(qg[e])) return false;
  const D lambda = D(o_.damping);
  if (o_.method == kfac_method::inverse) {
    // X⁻¹ = Q·diag(1 / (d + λ))·Qᵀ, one row of products at a time into `out`.
    const auto inverse = [&](const D* q, const D* d, std::int64_t n, D* dst) {
      for (std::int64_t r = 0; r < n; ++r)
        for (std::int64_t c = 0; c < n; ++c) {
          double s = 0;
          for (std::int64_t k = 0; k < n; ++k)
            s += double(q[r * n + k]) * double(q[c * n + k]) / (double(d[k]) + double(lambda));
          dst[r * n + c] = D(s);
        }
    };
    inverse(qa, da, na, out);
    inverse(qg, dg, ng, out + na * na);
    for (std::int64_t e = 0; e < na * na + ng * ng; ++e)
      if (!std::isfinite(out[e])) return false;
    return true;
  }
  if (o_.prediv_eigenvalues) {
    D* pd = dg + ng;
    for (std::int64_t r = 0; r < ng; ++r)
      for (std::int64_t c = 0; c < na; ++c) pd[r * na + c] = D(1) / (dg[r] * da[c] + lambda);
    for (std::int64_t e = 0; e < ng * na; ++e)
      if (!std::isfinite(pd[e])) return false;
  }
  return true;
}

/// Installs a held layer's decomposition (when it succeeded) and records the outcome.
template <class X, class D>
void kfac::install(X& x, bool ok, const D* dec) {
  x.outcome = ok ? 1 : 2;
  if (!ok) return;
  std::copy(dec, dec + x.dec.size(), x.dec.begin());
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
        st.world_ > 1 ? " (computed on rank " + std::to_string(st.owner_[i]) + ")" : std::string(),
        "; a non-finite a or g makes the factors non-finite for good. The gradients are unchanged; "
        "restore a checkpoint with load() (and skip non-finite steps, e.g. with the loss scaler), or "
        "raise max_consecutive_failures");
  }
}

/// Layer i's preconditioned gradient V (out × (in [+1])) into `v`; M itself while this rank
/// holds no decomposition of the layer.
template <class St, class T, class D>
void kfac::precondition(St& st, std::size_t i, const kfac_grad<T>& gr, D* v) const {
  auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
  const auto size = static_cast<std::size_t>(ng * na);
  st.m_.resize(std::max(st.m_.size(), size));
  st.tmp_.resize(std::max(st.tmp_.size(), size));
  D* m = st.m_.data();
  for (std::int64_t r = 0; r < ng; ++r) {
    for (std::int64_t c = 0; c < in; ++c) m[r * na + c] = static_cast<D>(gr.weight.data()[r * in + c]);
    if (x.spec.bias) m[r * na + in] = static_cast<D>(gr.bias.data()[r]);
  }
  if (!x.have) {
    std::copy(m, m + size, v);
    return;
  }
  const auto& la = st.la_;
  using cv = tensor_view<const D, host_space>;
  using mv = tensor_view<D, host_space>;
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
  const D lambda = D(o_.damping);
  for (std::int64_t r = 0; r < ng; ++r)
    for (std::int64_t c = 0; c < na; ++c)
      v[r * na + c] =
          o_.prediv_eigenvalues ? v[r * na + c] * pd[r * na + c] : v[r * na + c] / (dg[r] * da[c] + lambda);
  // V = Q_G·V2·Q_Aᵀ
  la.gemm(transpose::none, transpose::none, 1.0, cv(qg, {ng, ng}), cv(v, {ng, na}), 0.0, mv(tmp, {ng, na}));
  la.gemm(transpose::none, transpose::yes, 1.0, cv(tmp, {ng, na}), cv(qa, {na, na}), 0.0, mv(v, {ng, na}));
}

/// ⟨V, M⟩ of layer i in double, in element order (M as the decomposition type).
template <class St, class T, class D>
double kfac::dot(const St& st, std::size_t i, const kfac_grad<T>& gr, const D* v) {
  const auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
  double s = 0;
  for (std::int64_t r = 0; r < ng; ++r) {
    for (std::int64_t c = 0; c < in; ++c)
      s += double(v[r * na + c]) * double(static_cast<D>(gr.weight.data()[r * in + c]));
    if (x.spec.bias) s += double(v[r * na + in]) * double(static_cast<D>(gr.bias.data()[r]));
  }
  return s;
}

template <class St, class T, class D>
void kfac::write_v(St& st, std::size_t i, const kfac_grad<T>& gr, double nu, const D* v) {
  const auto& x = st.l_[i];
  const std::int64_t na = x.n, ng = x.spec.out, in = x.spec.in;
  const D s = D(nu);
  for (std::int64_t r = 0; r < ng; ++r) {
    for (std::int64_t c = 0; c < in; ++c) gr.weight.data()[r * in + c] = static_cast<T>(v[r * na + c] * s);
    if (x.spec.bias) gr.bias.data()[r] = static_cast<T>(v[r * na + in] * s);
  }
}

}  // namespace gradapt

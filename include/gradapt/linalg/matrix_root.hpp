#pragma once
/// @file
/// Inverse p-th roots of symmetric positive semi-definite matrices, X = (A + r·I)^(-1/p), by a
/// coupled Newton iteration (matrix products only) or by an eigendecomposition, over any host
/// `linalg_backend`. Shampoo's preconditioners are such roots of its statistics (p = 2k for a
/// k-dimensional tensor block; Gupta, Koren and Singer 2018; Anil et al. 2020).
///
/// Numerical failure (non-finite or non-symmetric input, no convergence, an eigensolver
/// failure, a singular matrix without a ridge) is reported by the returned status and leaves
/// the output untouched, so a caller keeps its previous root; invalid arguments throw
/// gradapt::error. docs/algorithms/linalg.md describes both methods and their stopping rules.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

namespace gradapt {

/// How `inverse_pth_root` computes the root.
enum class root_method : unsigned char {
  /// Coupled Newton iteration (Higham, Functions of Matrices, 2008, eq. 7.18): matrix
  /// products only, in the element type of A.
  coupled_newton,
  /// Symmetric eigendecomposition A = Q·diag(λ)·Qᵀ, X = Q·diag((max(λ, 0) + r)^(-1/p))·Qᵀ;
  /// a float decomposition that fails is retried in double.
  eigen,
};

/// How the ridge r added to A's diagonal is obtained from `inverse_root_options::epsilon`.
enum class ridge_kind : unsigned char {
  absolute,  ///< r = ε
  relative,  ///< r = ε·λ_max(A) (λ_max by power iteration, or from the eigendecomposition)
};

/// The outcome of `inverse_pth_root`. Only `ok` writes the output.
enum class root_status : unsigned char {
  ok,                  ///< X holds the root
  nonfinite_input,     ///< A holds an infinity or NaN
  not_symmetric,       ///< A differs from Aᵀ (compared bit for bit)
  singular,            ///< A + r·I is not positive definite: a zero ridge on a singular A, or a
                       ///< relative ridge on the zero matrix (λ_max = 0)
  not_converged,       ///< Newton: the best iterate's error max|M − I| exceeds `max_error`
  eigensolver_failed,  ///< the eigensolver reported a failure (after the double retry for float)
  nonfinite_result,    ///< the computed root holds an infinity or NaN (overflow)
};

/// Why the coupled Newton iteration stopped.
enum class newton_stop : unsigned char {
  not_run,         ///< the eigen method ran, or the input was rejected before iterating
  tolerance,       ///< max|M − I| <= tolerance
  error_grew,      ///< the error grew by more than `max_error_ratio` (or became non-finite):
                   ///< the best iterate so far is kept
  max_iterations,  ///< `max_iterations` iterations ran
};

/// Options of `inverse_pth_root` (defaults follow google-research scalable_shampoo and
/// facebookresearch/optimizers' Distributed Shampoo).
struct inverse_root_options {
  root_method method = root_method::eigen;  ///< coupled Newton or eigendecomposition
  double epsilon = 1e-6;                    ///< ridge ε (>= 0)
  ridge_kind ridge = ridge_kind::relative;  ///< r = ε or r = ε·λ_max
  double tolerance = 1e-6;                  ///< Newton: stop once max|M − I| <= tolerance (>= 0)
  int max_iterations = 100;                 ///< Newton: at most this many iterations (>= 1)
  double max_error_ratio = 1.2;             ///< Newton: stop when the error grows by more than this (>= 1)
  double max_error = 0.1;                   ///< Newton: a best error above this is `not_converged` (> 0)
  int power_iterations = 100;               ///< power iteration for λ_max: at most this many steps (>= 1)
  double power_tolerance = 1e-6;            ///< power iteration: stop when λ changes by <= this, relative
  bool retry_in_double = true;              ///< eigen: retry a failed float decomposition in double
};

/// What `inverse_pth_root` did.
struct inverse_root_result {
  root_status status = root_status::ok;     ///< ok, or why the output was left untouched
  newton_stop stop = newton_stop::not_run;  ///< Newton: why the iteration stopped
  int iterations = 0;                       ///< Newton iterations performed
  /// Newton: max|M − I| of the returned iterate, where M = X^p·(A + r·I) up to rounding; NaN
  /// for the eigen method, which has no iteration error.
  double error = std::numeric_limits<double>::quiet_NaN();
  double lambda_max = 0;           ///< the λ_max used for a relative ridge (0 if absolute)
  double ridge = 0;                ///< r, the value added to A's diagonal
  bool retried_in_double = false;  ///< eigen: the float decomposition failed and double ran
  /// True when the status is `ok`.
  bool ok() const { return status == root_status::ok; }
};

/// The name of a status, for messages and logs ("ok", "nonfinite_input", ...).
constexpr std::string_view to_string(root_status s) {
  return detail::enum_name(
      s, std::array<std::string_view, 7>{"ok", "nonfinite_input", "not_symmetric", "singular",
                                         "not_converged", "eigensolver_failed", "nonfinite_result"});
}

namespace detail::linalg {
template <class L, class T>
struct root_access;
}  // namespace detail::linalg

/// Scratch memory of `inverse_pth_root` for n × n matrices of T on the linear-algebra backend
/// L: Newton's iterates and product buffers (7 matrices), the eigen method's eigenvectors,
/// column scales, eigenvalues and eigensolver workspace (and, for float, the same in double for
/// the retry).
/// Each part is allocated by `reserve(method)` or by the first call that needs it, so steady
/// calls allocate nothing; the double retry's part is allocated by the first retry.
template <class L, class T>
requires linalg_backend<L> && detail::linalg::real_scalar<T>
class inverse_root_workspace {
 public:
  /// A workspace for n × n matrices on `la` (the backend is copied).
  /// @throws gradapt::error for n < 1
  inverse_root_workspace(const L& la, std::int64_t n) : la_(la), n_(n) {
    detail::require(n >= 1, "inverse_root_workspace: n is ", n, " (expected a matrix size n >= 1)");
  }
  /// The matrix size the workspace serves.
  std::int64_t n() const { return n_; }
  /// Allocates what `method` needs now rather than at the first call.
  void reserve(root_method method) {
    if (method == root_method::coupled_newton)
      newton();
    else
      eigen();
  }

 private:
  friend struct detail::linalg::root_access<L, T>;

  using eigh_ws_t = detail::linalg::eigh_workspace_t<L, T>;
  using eigh_ws_d = detail::linalg::eigh_workspace_t<L, double>;

  std::size_t n2() const { return static_cast<std::size_t>(n_) * static_cast<std::size_t>(n_); }
  std::vector<T>& newton() {
    if (pool_.empty()) pool_.assign(7 * n2(), T(0));
    if (vec_.empty()) vec_.assign(2 * static_cast<std::size_t>(n_), T(0));
    return pool_;
  }
  void eigen() {
    if (q_.empty()) {
      q_.assign(n2(), T(0));
      x_.assign(n2(), T(0));
      s_.assign(n2(), T(0));
      w_.assign(static_cast<std::size_t>(n_), T(0));
      ews_ = std::make_unique<eigh_ws_t>(la_.template eigh_workspace<T>(n_));
    }
  }
  void eigen_double() {
    if (qd_.empty()) {
      qd_.assign(n2(), 0.0);
      xd_.assign(n2(), 0.0);
      sd_.assign(n2(), 0.0);
      wd_.assign(static_cast<std::size_t>(n_), 0.0);
      ewsd_ = std::make_unique<eigh_ws_d>(la_.template eigh_workspace<double>(n_));
    }
  }

  L la_;
  std::int64_t n_;
  std::vector<T> pool_, vec_, q_, x_, w_, s_;
  std::vector<double> qd_, xd_, wd_, sd_;
  std::unique_ptr<eigh_ws_t> ews_;
  std::unique_ptr<eigh_ws_d> ewsd_;
};

namespace detail::linalg {

/// Gives the root functions access to a workspace's buffers, allocated on first use.
template <class L, class T>
struct root_access {
  /// Newton's pool of 7 n × n matrices.
  static std::vector<T>& newton(inverse_root_workspace<L, T>& ws) { return ws.newton(); }
  /// Two vectors of n.
  static std::vector<T>& vec(inverse_root_workspace<L, T>& ws) {
    ws.newton();
    return ws.vec_;
  }
  /// Eigen method: Q, X, w, the column scales and the eigensolver workspace in T.
  static auto eigen(inverse_root_workspace<L, T>& ws) {
    ws.eigen();
    return std::tie(ws.q_, ws.x_, ws.w_, ws.s_, *ws.ews_);
  }
  /// The same in double (the retry of a float decomposition).
  static auto eigen_double(inverse_root_workspace<L, T>& ws) {
    ws.eigen_double();
    return std::tie(ws.qd_, ws.xd_, ws.wd_, ws.sd_, *ws.ewsd_);
  }
};

/// True when every element is finite.
template <class T>
bool all_finite(const T* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

/// True when the row-major n × n matrix equals its transpose bit for bit.
template <class T>
bool symmetric(const T* a, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (!(a[i * n + j] == a[j * n + i])) return false;
  return true;
}

/// max |M − I| over the elements of the row-major n × n matrix m (NaN when m holds a NaN).
template <class T>
double max_abs_minus_identity(const T* m, std::size_t n) {
  double e = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      const double d = std::fabs(double(m[i * n + j]) - (i == j ? 1.0 : 0.0));
      if (!(d <= e)) e = d;  // keeps a NaN
    }
  return e;
}

/// Largest eigenvalue of the symmetric PSD matrix a by power iteration: v ← A·v/|A·v| from a
/// fixed start vector, λ = vᵀA·v (Rayleigh quotient, a lower bound on λ_max), stopped when λ
/// changes by at most `tol`·λ. Products through the backend (n × 1 GEMM); v, y are n-vectors.
template <class L, class T>
double power_iteration(const L& la, tensor_view<const T, host_space> a, T* v, T* y, int max_iter,
                       double tol) {
  const std::size_t n = static_cast<std::size_t>(a.dim(0));
  const auto ni = static_cast<std::int64_t>(n);
  // A fixed, deterministic start with no special structure (not orthogonal to any eigenvector
  // of the matrices that occur in practice): 1 + frac(i·golden ratio).
  double norm = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double g = 1.0 + std::fmod(double(i) * 0.6180339887498949, 1.0);
    v[i] = T(g);
    norm += g * g;
  }
  for (std::size_t i = 0; i < n; ++i) v[i] = T(double(v[i]) / std::sqrt(norm));
  double lambda = 0;
  for (int it = 0; it < max_iter; ++it) {
    la.gemm(transpose::none, transpose::none, 1.0, a, tensor_view<const T, host_space>(v, {ni, 1}), 0.0,
            tensor_view<T, host_space>(y, {ni, 1}));
    double vy = 0, yy = 0;
    for (std::size_t i = 0; i < n; ++i) vy += double(v[i]) * double(y[i]), yy += double(y[i]) * double(y[i]);
    if (!(yy > 0)) return 0;
    const double prev = lambda;
    lambda = vy;
    const double inv = 1.0 / std::sqrt(yy);
    for (std::size_t i = 0; i < n; ++i) v[i] = T(double(y[i]) * inv);
    if (it > 0 && std::fabs(lambda - prev) <= tol * std::fabs(lambda)) break;
  }
  return lambda;
}

/// The argument checks shared by the root functions.
template <class T>
void check_root_args(tensor_view<const T, host_space> a, int p, tensor_view<T, host_space> x,
                     std::int64_t ws_n, const inverse_root_options& o) {
  constexpr const char* who = "inverse_pth_root";
  require_square(a, who, "A");
  require(x.same_shape(a), who, ": X has shape ", x.shape_string(), " but A has shape ", a.shape_string(),
          " (X must have A's shape)");
  require(ws_n == a.dim(0), who, ": the workspace was made for ", ws_n, " x ", ws_n, " matrices but A is ",
          a.shape_string(), " (one workspace per block size)");
  require(p >= 1, who, ": p is ", p, " (expected a positive integer; the root is A^(-1/p))");
  require(std::isfinite(o.epsilon) && o.epsilon >= 0, who, ": epsilon is ", o.epsilon,
          " (expected a finite ridge >= 0)");
  require(std::isfinite(o.tolerance) && o.tolerance >= 0, who, ": tolerance is ", o.tolerance,
          " (expected a finite value >= 0)");
  require(o.max_iterations >= 1, who, ": max_iterations is ", o.max_iterations, " (expected >= 1)");
  require(o.max_error_ratio >= 1, who, ": max_error_ratio is ", o.max_error_ratio,
          " (expected >= 1: the factor by which the error may grow before the iteration stops)");
  require(o.max_error > 0, who, ": max_error is ", o.max_error, " (expected > 0)");
  require(o.power_iterations >= 1, who, ": power_iterations is ", o.power_iterations, " (expected >= 1)");
  require(std::isfinite(o.power_tolerance) && o.power_tolerance >= 0, who, ": power_tolerance is ",
          o.power_tolerance, " (expected a finite value >= 0)");
  require(o.method == root_method::coupled_newton || o.method == root_method::eigen, who,
          ": unknown root_method ", int(o.method));
  require(o.ridge == ridge_kind::absolute || o.ridge == ridge_kind::relative, who, ": unknown ridge_kind ",
          int(o.ridge));
}

/// Coupled Newton iteration for X = (A + r·I)^(-1/p) (Higham 2008, eq. 7.18), in T:
///   z = (p + 1) / (2·‖A + r·I‖_F),  X₀ = z^(1/p)·I,  M₀ = z·(A + r·I),
///   Mₚ = (1 + 1/p)·I − M/p,  X ← X·Mₚ,  M ← Mₚ^p·M,
/// so that M = X^p·(A + r·I) throughout and M → I while X → (A + r·I)^(-1/p). Writes the best
/// iterate (lowest max|M − I|) into `out` (n × n) and returns the result with `error` = its
/// max|M − I|.
template <class L, class T>
inverse_root_result newton_root(const L& la, tensor_view<const T, host_space> a, int p, double ridge, T* out,
                                std::vector<T>& pool, const inverse_root_options& o) {
  inverse_root_result r;
  const std::size_t n = static_cast<std::size_t>(a.dim(0)), n2 = n * n;
  const auto ni = static_cast<std::int64_t>(n);
  // Six buffers: at most five are live while Mₚ^p is formed (M, X, the next X, the power's
  // base and accumulator), so one is always spare. `out` is a seventh.
  T* buf[6];
  for (std::size_t i = 0; i < 6; ++i) buf[i] = pool.data() + i * n2;
  T* m = buf[0];
  T* xcur = buf[1];
  T* best = out;
  auto view = [&](T* q) { return tensor_view<T, host_space>(q, {ni, ni}); };
  auto cview = [&](T* q) { return tensor_view<const T, host_space>(q, {ni, ni}); };
  auto mul = [&](T* dst, T* lhs, T* rhs) {
    la.gemm(transpose::none, transpose::none, 1.0, cview(lhs), cview(rhs), 0.0, view(dst));
  };
  // A buffer of the pool that holds none of the live matrices.
  auto spare = [&](std::initializer_list<const T*> live) {
    for (T* b : buf)
      if (std::find(live.begin(), live.end(), b) == live.end()) return b;
    return static_cast<T*>(nullptr);  // unreachable: 6 buffers, at most 5 live
  };

  double fro2 = 0;
  for (std::size_t i = 0; i < n2; ++i) {
    const double v = double(a.data()[i]) + ((i % (n + 1)) == 0 ? ridge : 0.0);
    fro2 += v * v;
  }
  if (!(fro2 > 0)) {
    r.status = root_status::singular;
    return r;
  }
  const double z = double(p + 1) / (2.0 * std::sqrt(fro2));
  for (std::size_t i = 0; i < n2; ++i)
    m[i] = T(z * (double(a.data()[i]) + ((i % (n + 1)) == 0 ? ridge : 0.0)));
  std::fill(xcur, xcur + n2, T(0));
  const T x0 = T(std::pow(z, 1.0 / double(p)));
  for (std::size_t i = 0; i < n; ++i) xcur[i * (n + 1)] = x0;
  std::copy(xcur, xcur + n2, best);
  double err = max_abs_minus_identity(m, n), best_err = err;
  r.stop = newton_stop::max_iterations;
  const T diag = T(1.0 + 1.0 / double(p)), scale = T(-1.0 / double(p));
  while (true) {
    if (err <= o.tolerance) {
      r.stop = newton_stop::tolerance;
      break;
    }
    if (r.iterations >= o.max_iterations) break;
    T* mp = spare({m, xcur});
    for (std::size_t i = 0; i < n2; ++i) mp[i] = scale * m[i];
    for (std::size_t i = 0; i < n; ++i) mp[i * (n + 1)] += diag;
    T* xnext = spare({m, xcur, mp});
    mul(xnext, xcur, mp);
    // Mₚ^p by binary powering, then · M.
    T* base = mp;
    T* acc = nullptr;
    for (int e = p;;) {
      if (e & 1) {
        if (!acc) {
          acc = base;
        } else {
          T* d = spare({m, xcur, xnext, base, acc});
          mul(d, acc, base);
          acc = d;
        }
      }
      e >>= 1;
      if (!e) break;
      T* d = spare({m, xcur, xnext, base, acc});
      mul(d, base, base);
      base = d;
    }
    T* mnext = spare({m, xcur, xnext, acc});
    mul(mnext, acc, m);
    ++r.iterations;
    const double e = max_abs_minus_identity(mnext, n);
    if (!(e <= o.max_error_ratio * err)) {  // grew too much, or NaN: keep the best iterate
      r.stop = newton_stop::error_grew;
      break;
    }
    m = mnext;
    xcur = xnext;
    err = e;
    if (e < best_err) {
      best_err = e;
      std::copy(xcur, xcur + n2, best);
    }
  }
  r.error = best_err;
  if (!(best_err <= o.max_error)) r.status = root_status::not_converged;
  return r;
}

/// y ← y·s element by element: the eigen root's column scaling Q·diag(s), with s repeated in
/// every row of the second operand.
struct times {
  static constexpr bool vectorizable = true;  ///< host SIMD packs: the same bits
  template <class T>
  GRADAPT_HD void operator()(T& y, const T& s) const {
    y = y * s;
  }
};

/// n values of Ex's memory as host memory: `p` itself when Ex's memory is the host's, else a
/// copy in `tmp` (made through `ex`, which waits for it).
template <class Ex, class T>
T* host_copy(const Ex& ex, T* p, std::size_t n, std::vector<std::remove_const_t<T>>& tmp) {
  using Sp = typename Ex::space;
  if constexpr (std::is_same_v<Sp, host_space>) {
    (void)ex;
    (void)tmp;
    return p;
  } else {
    tmp.resize(n);
    const auto ni = static_cast<std::int64_t>(n);
    ex.copy(tensor_view<const T, Sp>::vector(p, ni),
            tensor_view<std::remove_const_t<T>, host_space>::vector(tmp.data(), ni));
    return tmp.data();
  }
}

/// Writes n values from host memory `h` to `dst` in Ex's memory (nothing when they are one).
template <class Ex, class T>
void from_host(const Ex& ex, const T* h, T* dst, std::size_t n) {
  using Sp = typename Ex::space;
  if constexpr (std::is_same_v<Sp, host_space>) {
    (void)ex;
    if (h != dst) std::copy(h, h + n, dst);
  } else {
    const auto ni = static_cast<std::int64_t>(n);
    ex.copy(tensor_view<const T, host_space>::vector(h, ni), tensor_view<T, Sp>::vector(dst, ni));
  }
}

/// The eigen method's column scales s_j = d_j^(1/2), d_j = (max(λ_j, 0) + r)^(-1/p), from the
/// ascending eigenvalues λ (host memory); sets r.lambda_max and r.ridge. False when A + r·I is
/// not positive definite (a relative ridge on λ_max <= 0, or an eigenvalue plus the ridge <= 0).
template <class U>
bool clamp_scales(const U* lam, std::size_t n, int p, const inverse_root_options& o, inverse_root_result& r,
                  U* s) {
  r.lambda_max = o.ridge == ridge_kind::relative ? std::max(double(lam[n - 1]), 0.0) : 0.0;
  if (o.ridge == ridge_kind::relative && !(r.lambda_max > 0)) return false;
  r.ridge = o.ridge == ridge_kind::relative ? o.epsilon * r.lambda_max : o.epsilon;
  for (std::size_t j = 0; j < n; ++j) {
    const double v = std::max(double(lam[j]), 0.0) + r.ridge;
    if (!(v > 0)) return false;
    s[j] = U(std::pow(v, -0.5 / double(p)));
  }
  return true;
}

/// What every eigen root shares, in precision U over L's memory (n × n, row-major): q holds
/// the symmetric input and is decomposed into Q·diag(λ)·Qᵀ by `la.eigh` (λ into w); `scales(λ,
/// s)` maps the ascending eigenvalues (in host memory: w itself, or their copy in `hw`) to n
/// column scales (false: singular); Q·diag(s) is one element pass of `ex` over Q and a matrix
/// whose rows all hold s (built in host memory: `s` itself, or `hs` copied to `s`); X = (Q·diag
/// (s))·(Q·diag(s))ᵀ by one SYRK into x, symmetric bit for bit. Returns eigensolver_failed when
/// the solver fails or gives non-finite values (a float caller may retry in double), singular,
/// or ok (x may then hold non-finite values: the caller checks what it keeps). The device's
/// host waits: the eigensolver's status, λ (n values) and the scales (n² values).
template <class L, class Ex, class U, class EW, class F>
root_status eigen_core(const L& la, const Ex& ex, std::int64_t n, U* q, U* w, U* s, U* x, EW& ews,
                       std::vector<U>& hw, std::vector<U>& hs, F&& scales) {
  using Sp = typename L::space;
  static_assert(std::is_same_v<Sp, typename Ex::space>, "eigen_core: L and Ex must share a memory space");
  const auto nn = static_cast<std::size_t>(n);
  if (!la.eigh(tensor_view<U, Sp>(q, {n, n}), tensor_view<U, Sp>::vector(w, n), ews))
    return root_status::eigensolver_failed;
  U* lam = host_copy(ex, w, nn, hw);
  if (!all_finite(lam, nn) ||
      ex.reduce(reduction::count_nonfinite, tensor_view<const U, Sp>::vector(q, n * n)) != 0)
    return root_status::eigensolver_failed;
  U* h = s;
  if constexpr (!std::is_same_v<Sp, host_space>) {
    hs.resize(nn * nn);
    h = hs.data();
  }
  if (!scales(lam, h)) return root_status::singular;
  for (std::size_t i = 1; i < nn; ++i) std::copy(h, h + nn, h + i * nn);
  from_host(ex, h, s, nn * nn);
  ex.apply(times{}, tensor_view<U, Sp>::vector(q, n * n), tensor_view<const U, Sp>::vector(s, n * n));
  la.syrk(gram::rows, 1.0, tensor_view<const U, Sp>(q, {n, n}), 0.0, tensor_view<U, Sp>(x, {n, n}));
  return root_status::ok;
}

/// The eigen method of `inverse_pth_root` in precision U (T, or double for the retry of a
/// float decomposition): copies the n × n matrix A into q and forms the root in x through
/// `eigen_core` with the clamped spectrum. Returns false, leaving r as it is, when the
/// decomposition fails or gives non-finite values. Otherwise returns true with r.lambda_max
/// and r.ridge set, and r.status `singular` when A + r·I is not positive definite (x then holds
/// no root).
template <class L, class T, class U, class W>
bool eigen_root(const L& la, const T* a, std::size_t n, int p, const inverse_root_options& o,
                std::vector<U>& q, std::vector<U>& w, std::vector<U>& s, W& ews, U* x,
                inverse_root_result& r) {
  std::copy(a, a + n * n, q.data());
  std::vector<U> unused;  // host memory: eigenvalues and scales are read and built in place
  const auto status =
      eigen_core(la, host{.threads = 1}, static_cast<std::int64_t>(n), q.data(), w.data(), s.data(), x, ews,
                 unused, unused, [&](const U* lam, U* sc) { return clamp_scales(lam, n, p, o, r, sc); });
  if (status == root_status::eigensolver_failed) return false;
  r.status = status;
  return true;
}

}  // namespace detail::linalg

/// X = (A + r·I)^(-1/p) for a symmetric positive semi-definite n × n matrix A.
///
/// The ridge is r = ε (`ridge_kind::absolute`) or r = ε·λ_max(A) (`ridge_kind::relative`;
/// λ_max by power iteration for Newton, the largest eigenvalue for the eigen method).
/// - `root_method::coupled_newton`: the coupled Newton iteration above in T. It stops when
///   max|M − I| <= `tolerance`, when the error grows by more than `max_error_ratio` over the
///   previous iterate's or becomes non-finite (the best iterate is kept), or after
///   `max_iterations`; a best error above `max_error` is `root_status::not_converged`.
/// - `root_method::eigen`: A = Q·diag(λ)·Qᵀ, eigenvalues clamped to >= 0 (rounding can make a
///   PSD matrix's smallest ones negative), X = Q·diag((λ + r)^(-1/p))·Qᵀ. For float, a
///   decomposition that fails (or gives non-finite values) is retried in double when
///   `retry_in_double` is set.
///
/// X is written only when the status is `ok`; otherwise it keeps its contents, so a caller can
/// keep its previous root. X may alias A. The exponent is −1/p for an integer p >= 1 (Shampoo
/// uses p = 2k for a k-dimensional block).
/// @throws gradapt::error when A is not square, X's shape differs from A's, the workspace was
///         made for another size, p < 1, or an option is out of range (ε < 0 or not finite,
///         tolerance < 0, max_iterations < 1, max_error_ratio < 1, max_error <= 0, ...)
template <class L, class T>
requires linalg_backend<L> && std::is_same_v<typename L::space, host_space> && detail::linalg::real_scalar<T>
    inverse_root_result inverse_pth_root(const L& la, tensor_view<const T, host_space> a, int p,
                                         tensor_view<T, host_space> x, inverse_root_workspace<L, T>& ws,
                                         const inverse_root_options& o = {}) {
  using access = detail::linalg::root_access<L, T>;
  detail::linalg::check_root_args<T>(a, p, x, ws.n(), o);
  const std::size_t n = static_cast<std::size_t>(a.dim(0)), n2 = n * n;
  inverse_root_result r;
  if (!detail::linalg::all_finite(a.data(), n2)) {
    r.status = root_status::nonfinite_input;
    return r;
  }
  if (!detail::linalg::symmetric(a.data(), n)) {
    r.status = root_status::not_symmetric;
    return r;
  }

  // Writes a computed root (n × n) to X unless it is not finite (overflow).
  const auto accept = [&](const T* root) {
    if (detail::linalg::all_finite(root, n2))
      std::copy(root, root + n2, x.data());
    else
      r.status = root_status::nonfinite_result;
    return r;
  };

  if (o.method == root_method::coupled_newton) {
    auto& pool = access::newton(ws);
    auto& vec = access::vec(ws);
    if (o.ridge == ridge_kind::relative) {
      r.lambda_max = detail::linalg::power_iteration(la, a, vec.data(), vec.data() + n, o.power_iterations,
                                                     o.power_tolerance);
      if (!(r.lambda_max > 0)) {
        r.status = root_status::singular;
        return r;
      }
    }
    r.ridge = o.ridge == ridge_kind::relative ? o.epsilon * r.lambda_max : o.epsilon;
    // The best iterate goes to the pool's last buffer, copied to X once accepted.
    T* best = pool.data() + 6 * n2;
    const auto res = detail::linalg::newton_root(la, a, p, r.ridge, best, pool, o);
    r.status = res.status;
    r.stop = res.stop;
    r.iterations = res.iterations;
    r.error = res.error;
    return r.ok() ? accept(best) : r;
  }

  auto [q, xs, w, sc, ews] = access::eigen(ws);
  if (detail::linalg::eigen_root(la, a.data(), n, p, o, q, w, sc, ews, xs.data(), r))
    return r.ok() ? accept(xs.data()) : r;
  if constexpr (std::is_same_v<T, float>) {
    if (o.retry_in_double) {
      r.retried_in_double = true;
      auto [qd, xd, wd, sd, ewsd] = access::eigen_double(ws);
      if (!detail::linalg::eigen_root(la, a.data(), n, p, o, qd, wd, sd, ewsd, xd.data(), r)) {
        r.status = root_status::eigensolver_failed;
        return r;
      }
      if (!r.ok()) return r;
      for (std::size_t i = 0; i < n2; ++i) xs[i] = float(xd[i]);
      return accept(xs.data());
    }
  }
  r.status = root_status::eigensolver_failed;
  return r;
}

/// The same for a non-const A view.
template <class L, class T>
requires linalg_backend<L> && std::is_same_v<typename L::space, host_space> && detail::linalg::real_scalar<T>
    inverse_root_result inverse_pth_root(const L& la, tensor_view<T, host_space> a, int p,
                                         tensor_view<T, host_space> x, inverse_root_workspace<L, T>& ws,
                                         const inverse_root_options& o = {}) {
  return inverse_pth_root(la, tensor_view<const T, host_space>(a), p, x, ws, o);
}

}  // namespace gradapt

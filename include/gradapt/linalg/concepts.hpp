#pragma once
/// @file
/// The linear-algebra capability: dense matrix products and a symmetric eigensolver over
/// row-major matrices given as `tensor_view`s, named once as the concept `linalg_backend`.
///
/// This capability sits beside the element-wise backend concepts of backend/concepts.hpp:
///
///  - `linalg_backend`: gemm, syrk, eigh (+ eigh_workspace), for float and double.
///    Shampoo's statistics (SYRK), preconditioning products (GEMM) and inverse p-th roots
///    (gradapt/linalg/matrix_root.hpp).
///
/// A type models it on its own (gradapt::host_lapack, include/gradapt/linalg/host_lapack.hpp,
/// BLAS + LAPACK through the optional CMake component `gradapt::linalg`), so the core headers
/// and gradapt::host stay free of any dependency. An algorithm that needs products takes a
/// `linalg_backend` next to its element backend and calls only the operations named here.

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Whether a matrix operand enters a product as stored or transposed.
enum class transpose : unsigned char {
  none,  ///< op(A) = A
  yes,   ///< op(A) = Aᵀ
};

/// Which Gram product `syrk` forms from an m × k matrix A.
enum class gram : unsigned char {
  rows,     ///< C (m × m) = A Aᵀ: the Gram matrix of the rows (Shampoo's left statistic G Gᵀ)
  columns,  ///< C (k × k) = Aᵀ A: the Gram matrix of the columns (the right statistic Gᵀ G)
};

/// A place where dense linear algebra runs over row-major matrices in memory space `L::space`.
///
/// Required, for T = float and T = double (views of rank 2, row-major, contiguous):
///  - `la.gemm(ta, tb, alpha, A, B, beta, C)`: C = alpha·op(A)·op(B) + beta·C (alpha and beta
///    are doubles, converted to T); beta = 0 ignores C's contents (NaN included).
///  - `la.syrk(g, alpha, A, beta, C)`: C = alpha·A·Aᵀ + beta·C (`gram::rows`) or
///    C = alpha·Aᵀ·A + beta·C (`gram::columns`). C must be symmetric on input when beta ≠ 0;
///    both triangles of C are written and are bitwise mirror images.
///  - `la.template eigh_workspace<T>(n)`: an owning workspace for n × n eigenproblems, so that
///    `eigh` itself allocates nothing.
///  - `la.eigh(A, w, ws) -> bool`: A symmetric n × n; on return w (n values) holds the
///    eigenvalues in ascending order and A holds Q, whose column j is the unit eigenvector of
///    w[j] (A = Q·diag(w)·Qᵀ). Returns false when the solver reports a failure (A and w are
///    then unspecified). Only the lower triangle of A is read.
///
/// Every operation validates its shapes and throws gradapt::error naming the operation, the
/// operand and both sizes. Results are those of the implementing library (see the model's own
/// documentation for its determinism).
namespace detail::linalg {
/// The element types the linear-algebra operations serve: float and double.
template <class T>
concept real_scalar = std::is_same_v<T, float> || std::is_same_v<T, double>;

/// The type of `la.template eigh_workspace<T>(n)` for a `const L& la`.
template <class L, class T>
using eigh_workspace_t = decltype(std::declval<const L&>().template eigh_workspace<T>(std::int64_t{}));
}  // namespace detail::linalg

template <class L>
concept linalg_backend = requires {
  typename L::space;
  typename detail::linalg::eigh_workspace_t<L, float>;
  typename detail::linalg::eigh_workspace_t<L, double>;
}
&&memory_space<typename L::space>&& requires(const L& la, tensor_view<float, typename L::space> f,
                                             tensor_view<const float, typename L::space> cf,
                                             tensor_view<double, typename L::space> d,
                                             tensor_view<const double, typename L::space> cd,
                                             detail::linalg::eigh_workspace_t<L, float>& wf,
                                             detail::linalg::eigh_workspace_t<L, double>& wd) {
  la.gemm(transpose::none, transpose::yes, 1.0, cf, cf, 0.0, f);
  la.gemm(transpose::none, transpose::yes, 1.0, cd, cd, 0.0, d);
  la.syrk(gram::rows, 1.0, cf, 0.0, f);
  la.syrk(gram::columns, 1.0, cd, 0.0, d);
  { la.eigh(f, f, wf) } -> std::same_as<bool>;
  { la.eigh(d, d, wd) } -> std::same_as<bool>;
};

/// The type of `la.template qr_workspace<T>(n)` for a `const L& la`.
namespace detail::linalg {
template <class L, class T>
using qr_workspace_t = decltype(std::declval<const L&>().template qr_workspace<T>(std::int64_t{}));
}  // namespace detail::linalg

/// A `linalg_backend` that also factors a square matrix as Q·R (`qr(a, q, r, ws)`, Q and R
/// written, `ws` from `la.template qr_workspace<T>(n)`): `host_lapack` (a std::vector it
/// grows) and `cuda_linalg`. Eigenvalue-corrected Shampoo's QR refresh needs it.
template <class L>
concept qr_linalg_backend = linalg_backend<L> &&
    requires(const L& la, tensor_view<const float, typename L::space> cf,
             tensor_view<float, typename L::space> f, tensor_view<const double, typename L::space> cd,
             tensor_view<double, typename L::space> d, detail::linalg::qr_workspace_t<L, float>& wf,
             detail::linalg::qr_workspace_t<L, double>& wd) {
  la.qr(cf, f, f, wf);
  la.qr(cd, d, d, wd);
};

/// A `linalg_backend` bound to a stream, that names the element backend B ordered with it:
/// `la.elements(b)` is a new B whose work is enqueued on la's stream, with its own scratch (so
/// that a second host thread can drive it beside the thread that owns `b`), and
/// `la.enter_thread()` prepares the calling host thread for la's calls (CUDA: the stream's
/// device). `cuda_linalg` with `gradapt::cuda` models it. Shampoo's background roots in device
/// memory (shampoo_options::root_staleness >= 1) run on such a backend and its element backend.
template <class L, class B>
concept stream_linalg_backend = linalg_backend<L> && requires(const L& la, const B& b) {
  { la.elements(b) } -> std::same_as<B>;
  la.enter_thread();
};

namespace detail::linalg {
/// qr_workspace_t<L, T> where L models qr_linalg_backend, else an empty placeholder (for
/// workspaces that hold one only when the backend has qr).
template <class L, class T, bool = qr_linalg_backend<L>>
struct qr_workspace_of {
  struct type {};
};
template <class L, class T>
struct qr_workspace_of<L, T, true> {
  using type = qr_workspace_t<L, T>;
};
}  // namespace detail::linalg

namespace detail::linalg {

/// Throws unless `v` is a rank-2 view; `who` and `what` name the call and the operand.
template <class T, class S>
void require_matrix(const tensor_view<T, S>& v, const char* who, const char* what) {
  require(v.rank() == 2, who, ": ", what, " has shape ", v.shape_string(), " (expected a matrix, rank 2)");
}

/// Throws unless `v` is an n × n matrix.
template <class T, class S>
void require_square(const tensor_view<T, S>& v, const char* who, const char* what) {
  require_matrix(v, who, what);
  require(v.dim(0) == v.dim(1), who, ": ", what, " has shape ", v.shape_string(),
          " (expected a square matrix)");
}

/// Throws when a dimension does not fit the LP64 (32-bit) integers of BLAS and LAPACK.
inline void require_blas_int(std::int64_t d, const char* who, const char* what) {
  require(d <= std::int64_t{2147483647}, who, ": ", what, " has a dimension of ", d,
          " (BLAS/LAPACK take 32-bit dimensions; split the matrix into blocks)");
}

/// The checks shared by every gemm implementation: rank 2, inner and outer sizes agree.
template <class A, class B, class C>
void check_gemm(transpose ta, transpose tb, const A& a, const B& b, const C& c, const char* who) {
  require_matrix(a, who, "A");
  require_matrix(b, who, "B");
  require_matrix(c, who, "C");
  const std::int64_t m = ta == transpose::none ? a.dim(0) : a.dim(1);
  const std::int64_t ka = ta == transpose::none ? a.dim(1) : a.dim(0);
  const std::int64_t kb = tb == transpose::none ? b.dim(0) : b.dim(1);
  const std::int64_t n = tb == transpose::none ? b.dim(1) : b.dim(0);
  require(ka == kb, who, ": op(A) is ", m, " x ", ka, " but op(B) is ", kb, " x ", n,
          " (the inner dimensions must agree; A is ", a.shape_string(), ", B is ", b.shape_string(), ")");
  require(c.dim(0) == m && c.dim(1) == n, who, ": C has shape ", c.shape_string(), " but op(A)·op(B) is ", m,
          " x ", n);
  for (std::int64_t d : {m, n, ka}) require_blas_int(d, who, "a product");
}

/// The checks shared by every syrk implementation.
template <class A, class C>
void check_syrk(gram g, const A& a, const C& c, const char* who) {
  require_matrix(a, who, "A");
  require_square(c, who, "C");
  const std::int64_t n = g == gram::rows ? a.dim(0) : a.dim(1);
  require(c.dim(0) == n, who, ": C has shape ", c.shape_string(), " but ", g == gram::rows ? "A·Aᵀ" : "Aᵀ·A",
          " of A ", a.shape_string(), " is ", n, " x ", n);
  require_blas_int(a.dim(0), who, "A");
  require_blas_int(a.dim(1), who, "A");
}

/// The checks shared by every eigh implementation.
template <class A, class W>
void check_eigh(const A& a, const W& w, std::int64_t workspace_n, const char* who) {
  require_square(a, who, "A");
  require(w.size() == static_cast<std::size_t>(a.dim(0)), who, ": w has ", w.size(), " elements but A is ",
          a.shape_string(), " (expected one eigenvalue per row)");
  require(workspace_n == a.dim(0), who, ": the workspace was made for ", workspace_n, " x ", workspace_n,
          " matrices but A is ", a.shape_string());
  require_blas_int(a.dim(0), who, "A");
}

}  // namespace detail::linalg
}  // namespace gradapt

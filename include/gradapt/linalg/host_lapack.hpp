#pragma once
/// @file
/// gradapt::host_lapack: the `linalg_backend` of host memory, through the reference BLAS and
/// LAPACK interfaces (dgemm/sgemm, dsyrk/ssyrk, dsyevd/ssyevd).
///
/// Link with the CMake component `gradapt::linalg` (find_package(LAPACK); the consumer's
/// `BLA_VENDOR` picks OpenBLAS, the reference libraries, MKL, ...). The header declares the
/// Fortran symbols itself with LP64 (32-bit) integers and the hidden string-length arguments of
/// gfortran, so it needs no BLAS or LAPACK header; ILP64 builds of a library are not supported.
/// docs/algorithms/linalg.md records which library was measured fastest here and by how much.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

/// @cond GRADAPT_FORTRAN_SYMBOLS
extern "C" {
// BLAS level 3 and LAPACK's divide-and-conquer symmetric eigensolver (Fortran interfaces).
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc, std::size_t, std::size_t);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc, std::size_t, std::size_t);
void ssyrk_(const char* uplo, const char* trans, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* beta, float* c, const int* ldc, std::size_t,
            std::size_t);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* beta, double* c, const int* ldc, std::size_t,
            std::size_t);
void ssyevd_(const char* jobz, const char* uplo, const int* n, float* a, const int* lda, float* w,
             float* work, const int* lwork, int* iwork, const int* liwork, int* info, std::size_t,
             std::size_t);
void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
             double* work, const int* lwork, int* iwork, const int* liwork, int* info, std::size_t,
             std::size_t);
// Householder QR: the factorisation and the explicit Q.
void sgeqrf_(const int* m, const int* n, float* a, const int* lda, float* tau, float* work, const int* lwork,
             int* info);
void dgeqrf_(const int* m, const int* n, double* a, const int* lda, double* tau, double* work,
             const int* lwork, int* info);
void sorgqr_(const int* m, const int* n, const int* k, float* a, const int* lda, const float* tau,
             float* work, const int* lwork, int* info);
void dorgqr_(const int* m, const int* n, const int* k, double* a, const int* lda, const double* tau,
             double* work, const int* lwork, int* info);
}
/// @endcond

namespace gradapt {

/// Dense linear algebra on host memory through BLAS and LAPACK (models `linalg_backend`).
///
/// A row-major matrix is the transpose of the same memory read column-major, so each call
/// hands BLAS the transposed problem: C = op(A)·op(B) becomes Cᵀ = op(B)ᵀ·op(A)ᵀ, A·Aᵀ of a
/// row-major A is the column-major Bᵀ·B of its memory B, and a symmetric matrix is its own
/// transpose. The library runs on its own threads (OpenBLAS: `OPENBLAS_NUM_THREADS`); results
/// are repeatable bit for bit for a given library, CPU and thread count.
struct host_lapack {
  using space = host_space;  ///< host memory

  /// Owning workspace of `eigh` for n × n matrices of T (LAPACK's optimal work sizes, queried
  /// once), so that `eigh` itself allocates nothing.
  template <class T>
  class eigh_buffers {
   public:
    /// An empty workspace for 0 × 0 matrices.
    eigh_buffers() = default;
    /// Sizes the work arrays for n × n matrices (asks LAPACK for its optimal sizes).
    /// @throws gradapt::error for a negative n or one beyond 32-bit integers
    explicit eigh_buffers(std::int64_t n) : n_(n) {
      detail::require(n >= 0, "host_lapack::eigh_workspace: n is ", n, " (expected n >= 0)");
      detail::linalg::require_blas_int(n, "host_lapack::eigh_workspace", "n");
      if (n == 0) return;
      const int ni = static_cast<int>(n), query = -1;
      int info = 0, iwork_size = 0;
      T work_size{};
      T dummy{};
      if constexpr (std::is_same_v<T, float>)
        ssyevd_("V", "L", &ni, &dummy, &ni, &dummy, &work_size, &query, &iwork_size, &query, &info, 1, 1);
      else
        dsyevd_("V", "L", &ni, &dummy, &ni, &dummy, &work_size, &query, &iwork_size, &query, &info, 1, 1);
      detail::require(info == 0, "host_lapack::eigh_workspace: the LAPACK workspace query for n = ", n,
                      " returned info = ", info);
      // LAPACK's documented minima for jobz = 'V' (1 + 6n + 2n², 3 + 5n), in case a library
      // reports less.
      const double min_work = 1.0 + 6.0 * double(n) + 2.0 * double(n) * double(n);
      work_.resize(static_cast<std::size_t>(std::max<double>(double(work_size), min_work)));
      iwork_.resize(static_cast<std::size_t>(std::max<std::int64_t>(iwork_size, 3 + 5 * n)));
    }
    /// The matrix size the workspace was made for.
    std::int64_t n() const { return n_; }

   private:
    friend struct host_lapack;
    std::int64_t n_ = 0;
    std::vector<T> work_;
    std::vector<int> iwork_;
  };

  /// The workspace `eigh` needs for n × n matrices of T.
  /// @throws gradapt::error for n < 0 or n beyond 32-bit integers
  template <detail::linalg::real_scalar T>
  eigh_buffers<T> eigh_workspace(std::int64_t n) const {
    return eigh_buffers<T>(n);
  }

  /// C = alpha·op(A)·op(B) + beta·C for row-major matrices (beta = 0: C is only written).
  /// @throws gradapt::error unless A, B and C are rank-2 views with op(A) m × k, op(B) k × n
  ///         and C m × n
  template <detail::linalg::real_scalar T>
  void gemm(transpose ta, transpose tb, double alpha, tensor_view<const T, host_space> a,
            tensor_view<const T, host_space> b, double beta, tensor_view<T, host_space> c) const {
    detail::linalg::check_gemm(ta, tb, a, b, c, "host_lapack::gemm");
    const int m = static_cast<int>(c.dim(0)), n = static_cast<int>(c.dim(1));
    const int k = static_cast<int>(ta == transpose::none ? a.dim(1) : a.dim(0));
    if (m == 0 || n == 0) return;
    if (k == 0 && beta == 0.0) {  // BLAS would scale C by zero, keeping a NaN in C
      std::fill(c.data(), c.data() + c.size(), T(0));
      return;
    }
    // Column-major: Cᵀ (n × m) = op(B)ᵀ · op(A)ᵀ; the memory of a row-major X is Xᵀ.
    const char tA = ta == transpose::none ? 'N' : 'T', tB = tb == transpose::none ? 'N' : 'T';
    const int lda = std::max(1, static_cast<int>(a.dim(1))), ldb = std::max(1, static_cast<int>(b.dim(1)));
    const int ldc = std::max(1, n);
    const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
    if (beta == 0.0) std::fill(c.data(), c.data() + c.size(), T(0));
    if constexpr (std::is_same_v<T, float>)
      sgemm_(&tB, &tA, &n, &m, &k, &al, b.data(), &ldb, a.data(), &lda, &be, c.data(), &ldc, 1, 1);
    else
      dgemm_(&tB, &tA, &n, &m, &k, &al, b.data(), &ldb, a.data(), &lda, &be, c.data(), &ldc, 1, 1);
  }

  /// C = alpha·A·Aᵀ + beta·C (`gram::rows`) or alpha·Aᵀ·A + beta·C (`gram::columns`) for a
  /// row-major A; C must be symmetric when beta ≠ 0. The library computes one triangle, which
  /// is then mirrored, so both triangles of C hold the same bits.
  /// @throws gradapt::error unless A is a matrix and C is square of the Gram product's size
  template <detail::linalg::real_scalar T>
  void syrk(gram g, double alpha, tensor_view<const T, host_space> a, double beta,
            tensor_view<T, host_space> c) const {
    detail::linalg::check_syrk(g, a, c, "host_lapack::syrk");
    const int n = static_cast<int>(c.dim(0));
    const int k = static_cast<int>(g == gram::rows ? a.dim(1) : a.dim(0));
    if (n == 0) return;
    if (beta == 0.0) std::fill(c.data(), c.data() + c.size(), T(0));
    if (k > 0) {
      // The memory of row-major A (m × k) is column-major B = Aᵀ (k × m), so A·Aᵀ = Bᵀ·B
      // (trans 'T') and Aᵀ·A = B·Bᵀ (trans 'N'). 'U' in column-major is row-major's lower
      // triangle (C[i][j], j <= i).
      const char trans = g == gram::rows ? 'T' : 'N';
      const int lda = std::max(1, static_cast<int>(a.dim(1))), ldc = n;
      const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
      if constexpr (std::is_same_v<T, float>)
        ssyrk_("U", &trans, &n, &k, &al, a.data(), &lda, &be, c.data(), &ldc, 1, 1);
      else
        dsyrk_("U", &trans, &n, &k, &al, a.data(), &lda, &be, c.data(), &ldc, 1, 1);
    } else if (beta != 0.0) {
      const T be = static_cast<T>(beta);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j <= i; ++j) c.data()[std::size_t(i) * std::size_t(n) + std::size_t(j)] *= be;
    }
    mirror_lower(c.data(), n);
  }

  /// Eigenvalues (ascending, into w) and eigenvectors (the columns of A on return) of the
  /// symmetric matrix A, whose lower triangle is read (LAPACK ?syevd, divide and conquer).
  /// Returns false when LAPACK reports that the algorithm failed to converge.
  /// @throws gradapt::error unless A is n × n, w has n elements and ws was made for n
  template <detail::linalg::real_scalar T>
  bool eigh(tensor_view<T, host_space> a, tensor_view<T, host_space> w, eigh_buffers<T>& ws) const {
    detail::linalg::check_eigh(a, w, ws.n(), "host_lapack::eigh");
    const int n = static_cast<int>(a.dim(0));
    if (n == 0) return true;
    // Row-major lower = column-major upper ('U'); on return the column-major columns of the
    // memory are eigenvectors, i.e. its rows: transpose in place to give Q's columns.
    const int lwork = static_cast<int>(ws.work_.size()), liwork = static_cast<int>(ws.iwork_.size());
    int info = 0;
    if constexpr (std::is_same_v<T, float>)
      ssyevd_("V", "U", &n, a.data(), &n, w.data(), ws.work_.data(), &lwork, ws.iwork_.data(), &liwork, &info,
              1, 1);
    else
      dsyevd_("V", "U", &n, a.data(), &n, w.data(), ws.work_.data(), &lwork, ws.iwork_.data(), &liwork, &info,
              1, 1);
    detail::require(info >= 0, "host_lapack::eigh: LAPACK rejected argument ", -info, " (info = ", info, ")");
    if (info > 0) return false;
    T* p = a.data();
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j)
        std::swap(p[std::size_t(i) * std::size_t(n) + std::size_t(j)],
                  p[std::size_t(j) * std::size_t(n) + std::size_t(i)]);
    return true;
  }

  /// The workspace `qr` takes: an empty vector, which the first call for a size grows to what
  /// LAPACK asks.
  template <detail::linalg::real_scalar T>
  std::vector<T> qr_workspace(std::int64_t n) const {
    detail::require(n >= 0, "host_lapack::qr_workspace: n is ", n, " (expected n >= 0)");
    return {};
  }

  /// Q (orthogonal) and R (upper triangular) with A = Q·R for the n × n row-major matrix A,
  /// by Householder reflections (LAPACK ?geqrf, then ?orgqr for the explicit Q). `work` is
  /// resized to what LAPACK asks on the first call for a size and reused after (pass the same
  /// vector each time so that a steady caller allocates nothing).
  /// @throws gradapt::error unless A, Q and R are n × n and distinct, or when LAPACK rejects an
  ///         argument
  template <detail::linalg::real_scalar T>
  void qr(tensor_view<const T, host_space> a, tensor_view<T, host_space> q, tensor_view<T, host_space> r,
          std::vector<T>& work) const {
    detail::linalg::require_square(a, "host_lapack::qr", "A");
    detail::linalg::require_square(q, "host_lapack::qr", "Q");
    detail::linalg::require_square(r, "host_lapack::qr", "R");
    detail::require(q.dim(0) == a.dim(0) && r.dim(0) == a.dim(0), "host_lapack::qr: A is ", a.shape_string(),
                    " but Q is ", q.shape_string(), " and R is ", r.shape_string());
    detail::linalg::require_blas_int(a.dim(0), "host_lapack::qr", "A");
    detail::require(a.data() != q.data() && a.data() != r.data() && q.data() != r.data(),
                    "host_lapack::qr: A, Q and R must be distinct matrices");
    const int n = static_cast<int>(a.dim(0));
    if (n == 0) return;
    const auto nn = static_cast<std::size_t>(n);
    T* w = q.data();  // column-major A, then its Householder vectors, then column-major Q
    for (std::size_t i = 0; i < nn; ++i)
      for (std::size_t j = 0; j < nn; ++j) w[i + j * nn] = a.data()[i * nn + j];
    int info = 0, lwork = -1;
    T query[2] = {T(0), T(0)};  // the workspace queries (no computation)
    T best = T(0);
    if constexpr (std::is_same_v<T, float>) {
      sgeqrf_(&n, &n, w, &n, query, query + 1, &lwork, &info);
      best = query[1];
      sorgqr_(&n, &n, &n, w, &n, query, query + 1, &lwork, &info);
    } else {
      dgeqrf_(&n, &n, w, &n, query, query + 1, &lwork, &info);
      best = query[1];
      dorgqr_(&n, &n, &n, w, &n, query, query + 1, &lwork, &info);
    }
    const std::size_t need =
        nn + std::max({nn, static_cast<std::size_t>(best), static_cast<std::size_t>(query[1])});
    if (work.size() < need) work.assign(need, T(0));  // tau (n), then LAPACK's work
    T* tau = work.data();
    lwork = static_cast<int>(work.size() - nn);
    if constexpr (std::is_same_v<T, float>)
      sgeqrf_(&n, &n, w, &n, tau, tau + nn, &lwork, &info);
    else
      dgeqrf_(&n, &n, w, &n, tau, tau + nn, &lwork, &info);
    detail::require(info == 0, "host_lapack::qr: ?geqrf rejected argument ", -info, " (info = ", info, ")");
    for (std::size_t i = 0; i < nn; ++i)
      for (std::size_t j = 0; j < nn; ++j) r.data()[i * nn + j] = j >= i ? w[i + j * nn] : T(0);
    if constexpr (std::is_same_v<T, float>)
      sorgqr_(&n, &n, &n, w, &n, tau, tau + nn, &lwork, &info);
    else
      dorgqr_(&n, &n, &n, w, &n, tau, tau + nn, &lwork, &info);
    detail::require(info == 0, "host_lapack::qr: ?orgqr rejected argument ", -info, " (info = ", info, ")");
    for (std::size_t i = 0; i < nn; ++i)  // column-major Q → row-major
      for (std::size_t j = i + 1; j < nn; ++j) std::swap(w[i + j * nn], w[j + i * nn]);
  }

 private:
  /// Copies the lower triangle of the row-major n × n matrix c onto its upper triangle.
  template <class T>
  static void mirror_lower(T* c, int n) {
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j)
        c[std::size_t(i) * std::size_t(n) + std::size_t(j)] =
            c[std::size_t(j) * std::size_t(n) + std::size_t(i)];
  }
};

static_assert(linalg_backend<host_lapack>, "host_lapack must model linalg_backend");
static_assert(qr_linalg_backend<host_lapack>, "host_lapack must model qr_linalg_backend");

}  // namespace gradapt

#pragma once
/// @file
/// gradapt::cuda_linalg: the `linalg_backend` of device memory, through cuBLAS (GEMM, SYRK)
/// and cuSOLVER (?syevd, ?geqrf and ?orgqr), on the caller's stream. Included only from .cu translation
/// units; link with the CMake component `gradapt::cuda_linalg`.
///
/// Compiled and type-checked in this repository's CI (nvcc, no GPU); its numerics have not
/// been run on a device (docs/algorithms/linalg.md).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "gradapt/backend/cuda.cuh"
#include "gradapt/backend/cuda/check.cuh"
#include "gradapt/backend/cuda/device_buffer.cuh"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/linalg/concepts.hpp"

namespace gradapt {

namespace detail::linalg {

/// Throws gradapt::error naming the cuBLAS call and its status.
inline void cublas_check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail("cuBLAS call ", call, " failed: ", cublasGetStatusName(s), " (", cublasGetStatusString(s), ") at ",
         file, ":", line);
}

/// Throws gradapt::error naming the cuSOLVER call and its status code.
inline void cusolver_check(cusolverStatus_t s, const char* call, const char* file, int line) {
  if (s != CUSOLVER_STATUS_SUCCESS)
    fail("cuSOLVER call ", call, " failed: status ", int(s), " at ", file, ":", line);
}

/// c[i][j] = c[j][i] for j > i: copies the lower triangle of a row-major n × n matrix up.
template <class T>
__global__ void mirror_lower_kernel(T* c, int n) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x), i = int(blockIdx.y * blockDim.y + threadIdx.y);
  if (i < n && j < n && j > i)
    c[std::size_t(i) * std::size_t(n) + std::size_t(j)] = c[std::size_t(j) * std::size_t(n) + std::size_t(i)];
}

/// Transposes a row-major n × n matrix in place (each thread of the upper triangle swaps one
/// pair).
template <class T>
__global__ void transpose_in_place_kernel(T* a, int n) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x), i = int(blockIdx.y * blockDim.y + threadIdx.y);
  if (i < n && j < n && j > i) {
    const std::size_t u = std::size_t(i) * std::size_t(n) + std::size_t(j),
                      l = std::size_t(j) * std::size_t(n) + std::size_t(i);
    const T t = a[u];
    a[u] = a[l];
    a[l] = t;
  }
}

/// r = the upper triangle of the column-major n × n matrix a (geqrf's R), row-major, zeros below.
template <class T>
__global__ void upper_from_column_major_kernel(T* r, const T* a, int n) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x), i = int(blockIdx.y * blockDim.y + threadIdx.y);
  if (i < n && j < n)
    r[std::size_t(i) * std::size_t(n) + std::size_t(j)] =
        j >= i ? a[std::size_t(i) + std::size_t(j) * std::size_t(n)] : T(0);
}

}  // namespace detail::linalg

/// Evaluates a cuBLAS call and throws gradapt::error naming it if it fails.
#define GRADAPT_CUBLAS_CHECK(...) \
  ::gradapt::detail::linalg::cublas_check((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)
/// Evaluates a cuSOLVER call and throws gradapt::error naming it if it fails.
#define GRADAPT_CUSOLVER_CHECK(...) \
  ::gradapt::detail::linalg::cusolver_check((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)

/// Dense linear algebra on device memory through cuBLAS and cuSOLVER (models `linalg_backend`).
///
/// Holds a cuBLAS and a cuSOLVER handle bound to the caller's stream, shared by its copies. cuBLAS runs
/// in `CUBLAS_PEDANTIC_MATH` mode: float products are computed in fp32, never TF32, whatever
/// the device and `NVIDIA_TF32_OVERRIDE`. Row-major matrices are passed by transposition as in
/// gradapt::host_lapack; SYRK's triangle is mirrored and eigh's eigenvectors are transposed by
/// small kernels on the same stream. Every call is asynchronous except `eigh`, which waits for
/// the stream to read cuSOLVER's status.
class cuda_linalg {
 public:
  using space = device_space;  ///< device memory

  /// Owning workspace of `eigh` for n × n matrices of T (cuSOLVER's buffer size, queried once,
  /// and the device status word).
  template <class T>
  class eigh_buffers {
   public:
    /// An empty workspace for 0 × 0 matrices.
    eigh_buffers() = default;
    /// The matrix size the workspace was made for.
    std::int64_t n() const { return n_; }

   private:
    friend class cuda_linalg;
    std::int64_t n_ = 0;
    int lwork_ = 0;
    cuda_buffer<T> work_;
    cuda_buffer<int> info_;
  };

  /// Owning workspace of `qr` for n × n matrices of T (cuSOLVER's buffer size for ?geqrf and
  /// ?orgqr, queried once, the Householder scalars and the device status word).
  template <class T>
  class qr_buffers {
   public:
    /// An empty workspace for 0 × 0 matrices.
    qr_buffers() = default;
    /// The matrix size the workspace was made for.
    std::int64_t n() const { return n_; }

   private:
    friend class cuda_linalg;
    std::int64_t n_ = 0;
    int lwork_ = 0;
    cuda_buffer<T> work_, tau_;
    cuda_buffer<int> info_;
  };

  /// Creates the handles on `stream` (the legacy default stream when null), on the stream's
  /// device (the calling thread's current device is restored).
  /// @throws gradapt::error when a handle cannot be created
  explicit cuda_linalg(cudaStream_t stream = nullptr) : stream_(stream), h_(std::make_shared<handles>()) {
    int current = 0;
    GRADAPT_CUDA_CHECK(cudaGetDevice(&current));
    device_ = current;
    if (stream_ != nullptr) GRADAPT_CUDA_CHECK(cudaStreamGetDevice(stream_, &device_));
    // The handles belong to the stream's device, whichever device the calling thread uses.
    struct restore {
      int device;
      bool on;
      ~restore() {
        if (on) (void)cudaSetDevice(device);
      }
    } back{current, device_ != current};
    if (back.on) GRADAPT_CUDA_CHECK(cudaSetDevice(device_));
    GRADAPT_CUBLAS_CHECK(cublasCreate(&h_->blas));
    GRADAPT_CUBLAS_CHECK(cublasSetStream(h_->blas, stream_));
    GRADAPT_CUBLAS_CHECK(cublasSetMathMode(h_->blas, CUBLAS_PEDANTIC_MATH));
    GRADAPT_CUSOLVER_CHECK(cusolverDnCreate(&h_->solver));
    GRADAPT_CUSOLVER_CHECK(cusolverDnSetStream(h_->solver, stream_));
  }
  /// Copies share the handles (destroyed with the last copy) and the stream, as copies of
  /// gradapt::cuda share its workspace: a stage or state may hold one. Not thread-safe.
  cuda_linalg(const cuda_linalg&) = default;
  /// Shares o's handles.
  cuda_linalg& operator=(const cuda_linalg&) = default;
  /// Takes over o's handles; o is left without handles (only destructible or assignable).
  cuda_linalg(cuda_linalg&&) noexcept = default;
  /// Releases this object's share of its handles, then takes over o's.
  cuda_linalg& operator=(cuda_linalg&&) noexcept = default;

  /// The stream every call is enqueued on.
  cudaStream_t stream() const { return stream_; }
  /// The device of `stream()` (the calling thread's current device for the default stream).
  int device() const { return device_; }
  /// A new gradapt::cuda on `stream()`, with its own workspace: the element work ordered with
  /// this object's calls, which a second host thread may drive (stream_linalg_backend).
  cuda elements(const cuda&) const { return cuda{.stream = stream_}; }
  /// Makes the calling host thread use `device()` (cudaSetDevice); a background thread calls it
  /// before its first call.
  /// @throws gradapt::error when CUDA refuses
  void enter_thread() const { GRADAPT_CUDA_CHECK(cudaSetDevice(device_)); }

  /// The workspace `eigh` needs for n × n matrices of T (device memory, allocated here).
  /// @throws gradapt::error for n < 0, n beyond 32-bit integers, or a CUDA failure
  template <detail::linalg::real_scalar T>
  eigh_buffers<T> eigh_workspace(std::int64_t n) const {
    detail::require(n >= 0, "cuda_linalg::eigh_workspace: n is ", n, " (expected n >= 0)");
    detail::linalg::require_blas_int(n, "cuda_linalg::eigh_workspace", "n");
    eigh_buffers<T> ws;
    ws.n_ = n;
    if (n == 0) return ws;
    const int ni = int(n);
    int lwork = 0;
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUSOLVER_CHECK(cusolverDnSsyevd_bufferSize(
          h_->solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, ni, nullptr, ni, nullptr, &lwork));
    else
      GRADAPT_CUSOLVER_CHECK(cusolverDnDsyevd_bufferSize(
          h_->solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, ni, nullptr, ni, nullptr, &lwork));
    ws.lwork_ = lwork;
    ws.work_ = cuda_buffer<T>(std::size_t(lwork > 0 ? lwork : 1), stream_);
    ws.info_ = cuda_buffer<int>(1, stream_);
    return ws;
  }

  /// The workspace `qr` needs for n × n matrices of T (device memory, allocated here).
  /// @throws gradapt::error for n < 0, n beyond 32-bit integers, or a CUDA failure
  template <detail::linalg::real_scalar T>
  qr_buffers<T> qr_workspace(std::int64_t n) const {
    detail::require(n >= 0, "cuda_linalg::qr_workspace: n is ", n, " (expected n >= 0)");
    detail::linalg::require_blas_int(n, "cuda_linalg::qr_workspace", "n");
    qr_buffers<T> ws;
    ws.n_ = n;
    if (n == 0) return ws;
    const int ni = int(n);
    int lq = 0, lo = 0;
    if constexpr (std::is_same_v<T, float>) {
      GRADAPT_CUSOLVER_CHECK(cusolverDnSgeqrf_bufferSize(h_->solver, ni, ni, nullptr, ni, &lq));
      GRADAPT_CUSOLVER_CHECK(cusolverDnSorgqr_bufferSize(h_->solver, ni, ni, ni, nullptr, ni, nullptr, &lo));
    } else {
      GRADAPT_CUSOLVER_CHECK(cusolverDnDgeqrf_bufferSize(h_->solver, ni, ni, nullptr, ni, &lq));
      GRADAPT_CUSOLVER_CHECK(cusolverDnDorgqr_bufferSize(h_->solver, ni, ni, ni, nullptr, ni, nullptr, &lo));
    }
    ws.lwork_ = lq > lo ? lq : lo;
    ws.work_ = cuda_buffer<T>(std::size_t(ws.lwork_ > 0 ? ws.lwork_ : 1), stream_);
    ws.tau_ = cuda_buffer<T>(std::size_t(ni), stream_);
    ws.info_ = cuda_buffer<int>(1, stream_);
    return ws;
  }

  /// Q (orthogonal) and R (upper triangular) with A = Q·R for the row-major n × n device
  /// matrix A, by Householder reflections (cuSOLVER ?geqrf, then ?orgqr for the explicit Q;
  /// the transpositions between row- and column-major by small kernels). Enqueued on
  /// `stream()`, without waiting: the arguments are checked here, so cuSOLVER's status word
  /// (which reports only argument errors for these calls) is not read.
  /// @throws gradapt::error unless A, Q and R are n × n and distinct and ws was made for n, or
  ///         when a CUDA or cuSOLVER call fails
  template <detail::linalg::real_scalar T>
  void qr(tensor_view<const T, device_space> a, tensor_view<T, device_space> q,
          tensor_view<T, device_space> r, qr_buffers<T>& ws) const {
    detail::linalg::require_square(a, "cuda_linalg::qr", "A");
    detail::linalg::require_square(q, "cuda_linalg::qr", "Q");
    detail::linalg::require_square(r, "cuda_linalg::qr", "R");
    detail::require(q.dim(0) == a.dim(0) && r.dim(0) == a.dim(0) && ws.n() == a.dim(0),
                    "cuda_linalg::qr: A is ", a.shape_string(), " but Q is ", q.shape_string(), ", R is ",
                    r.shape_string(), " and the workspace was made for ", ws.n(), " × ", ws.n());
    detail::require(a.data() != q.data() && a.data() != r.data() && q.data() != r.data(),
                    "cuda_linalg::qr: A, Q and R must be distinct matrices");
    const int n = int(a.dim(0));
    if (n == 0) return;
    const dim3 block(16, 16), grid(unsigned((n + 15) / 16), unsigned((n + 15) / 16));
    GRADAPT_CUDA_CHECK(cudaMemcpyAsync(q.data(), a.data(), a.bytes(), cudaMemcpyDeviceToDevice, stream_));
    detail::linalg::transpose_in_place_kernel<T><<<grid, block, 0, stream_>>>(q.data(), n);  // column-major A
    GRADAPT_CUDA_CHECK_LAUNCH("transpose_in_place_kernel");
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUSOLVER_CHECK(cusolverDnSgeqrf(h_->solver, n, n, q.data(), n, ws.tau_.data(), ws.work_.data(),
                                              ws.lwork_, ws.info_.data()));
    else
      GRADAPT_CUSOLVER_CHECK(cusolverDnDgeqrf(h_->solver, n, n, q.data(), n, ws.tau_.data(), ws.work_.data(),
                                              ws.lwork_, ws.info_.data()));
    detail::linalg::upper_from_column_major_kernel<T><<<grid, block, 0, stream_>>>(r.data(), q.data(), n);
    GRADAPT_CUDA_CHECK_LAUNCH("upper_from_column_major_kernel");
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUSOLVER_CHECK(cusolverDnSorgqr(h_->solver, n, n, n, q.data(), n, ws.tau_.data(),
                                              ws.work_.data(), ws.lwork_, ws.info_.data()));
    else
      GRADAPT_CUSOLVER_CHECK(cusolverDnDorgqr(h_->solver, n, n, n, q.data(), n, ws.tau_.data(),
                                              ws.work_.data(), ws.lwork_, ws.info_.data()));
    detail::linalg::transpose_in_place_kernel<T><<<grid, block, 0, stream_>>>(q.data(), n);  // row-major Q
    GRADAPT_CUDA_CHECK_LAUNCH("transpose_in_place_kernel");
  }

  /// C = alpha·op(A)·op(B) + beta·C for row-major device matrices (beta = 0: C is only
  /// written). Enqueued on `stream()`.
  /// @throws gradapt::error unless op(A) is m × k, op(B) k × n and C m × n, or when cuBLAS fails
  template <detail::linalg::real_scalar T>
  void gemm(transpose ta, transpose tb, double alpha, tensor_view<const T, device_space> a,
            tensor_view<const T, device_space> b, double beta, tensor_view<T, device_space> c) const {
    detail::linalg::check_gemm(ta, tb, a, b, c, "cuda_linalg::gemm");
    const int m = int(c.dim(0)), n = int(c.dim(1)), k = int(ta == transpose::none ? a.dim(1) : a.dim(0));
    if (m == 0 || n == 0) return;
    const cublasOperation_t opA = ta == transpose::none ? CUBLAS_OP_N : CUBLAS_OP_T;
    const cublasOperation_t opB = tb == transpose::none ? CUBLAS_OP_N : CUBLAS_OP_T;
    const int lda = a.dim(1) > 0 ? int(a.dim(1)) : 1, ldb = b.dim(1) > 0 ? int(b.dim(1)) : 1;
    const T al = T(alpha), be = T(beta);
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUBLAS_CHECK(
          cublasSgemm(h_->blas, opB, opA, n, m, k, &al, b.data(), ldb, a.data(), lda, &be, c.data(), n));
    else
      GRADAPT_CUBLAS_CHECK(
          cublasDgemm(h_->blas, opB, opA, n, m, k, &al, b.data(), ldb, a.data(), lda, &be, c.data(), n));
  }

  /// C = alpha·A·Aᵀ + beta·C (`gram::rows`) or alpha·Aᵀ·A + beta·C (`gram::columns`) for a
  /// row-major device A; C must be symmetric when beta ≠ 0. One triangle is computed and
  /// mirrored, so both triangles hold the same bits. Enqueued on `stream()`.
  /// @throws gradapt::error unless A is a matrix and C is square of the Gram product's size
  template <detail::linalg::real_scalar T>
  void syrk(gram g, double alpha, tensor_view<const T, device_space> a, double beta,
            tensor_view<T, device_space> c) const {
    detail::linalg::check_syrk(g, a, c, "cuda_linalg::syrk");
    const int n = int(c.dim(0)), k = int(g == gram::rows ? a.dim(1) : a.dim(0));
    if (n == 0) return;
    const cublasOperation_t trans = g == gram::rows ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int lda = a.dim(1) > 0 ? int(a.dim(1)) : 1;
    const T al = T(alpha), be = T(beta);
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUBLAS_CHECK(
          cublasSsyrk(h_->blas, CUBLAS_FILL_MODE_UPPER, trans, n, k, &al, a.data(), lda, &be, c.data(), n));
    else
      GRADAPT_CUBLAS_CHECK(
          cublasDsyrk(h_->blas, CUBLAS_FILL_MODE_UPPER, trans, n, k, &al, a.data(), lda, &be, c.data(), n));
    const dim3 block(16, 16), grid(unsigned((n + 15) / 16), unsigned((n + 15) / 16));
    detail::linalg::mirror_lower_kernel<T><<<grid, block, 0, stream_>>>(c.data(), n);
    GRADAPT_CUDA_CHECK_LAUNCH("mirror_lower_kernel");
  }

  /// Eigenvalues (ascending, into w) and eigenvectors (the columns of A on return) of the
  /// symmetric device matrix A, whose lower triangle is read (cuSOLVER ?syevd). Waits for the
  /// stream to read cuSOLVER's status; returns false when it reports a failure to converge.
  /// @throws gradapt::error unless A is n × n, w has n elements and ws was made for n, or when
  ///         a CUDA, cuBLAS or cuSOLVER call fails
  template <detail::linalg::real_scalar T>
  bool eigh(tensor_view<T, device_space> a, tensor_view<T, device_space> w, eigh_buffers<T>& ws) const {
    detail::linalg::check_eigh(a, w, ws.n(), "cuda_linalg::eigh");
    const int n = int(a.dim(0));
    if (n == 0) return true;
    if constexpr (std::is_same_v<T, float>)
      GRADAPT_CUSOLVER_CHECK(cusolverDnSsyevd(h_->solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n,
                                              a.data(), n, w.data(), ws.work_.data(), ws.lwork_,
                                              ws.info_.data()));
    else
      GRADAPT_CUSOLVER_CHECK(cusolverDnDsyevd(h_->solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n,
                                              a.data(), n, w.data(), ws.work_.data(), ws.lwork_,
                                              ws.info_.data()));
    int info = 0;
    GRADAPT_CUDA_CHECK(cudaMemcpyAsync(&info, ws.info_.data(), sizeof(int), cudaMemcpyDeviceToHost, stream_));
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    detail::require(info >= 0, "cuda_linalg::eigh: cuSOLVER rejected argument ", -info, " (info = ", info,
                    ")");
    if (info > 0) return false;
    const dim3 block(16, 16), grid(unsigned((n + 15) / 16), unsigned((n + 15) / 16));
    detail::linalg::transpose_in_place_kernel<T><<<grid, block, 0, stream_>>>(a.data(), n);
    GRADAPT_CUDA_CHECK_LAUNCH("transpose_in_place_kernel");
    return true;
  }

 private:
  /// The cuBLAS and cuSOLVER handles, destroyed (errors ignored) with the last copy.
  struct handles {
    cublasHandle_t blas = nullptr;
    cusolverDnHandle_t solver = nullptr;
    handles() = default;
    handles(const handles&) = delete;
    handles& operator=(const handles&) = delete;
    ~handles() {
      if (solver) cusolverDnDestroy(solver);
      if (blas) cublasDestroy(blas);
    }
  };
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  std::shared_ptr<handles> h_;
};

static_assert(linalg_backend<cuda_linalg>, "cuda_linalg must model linalg_backend");
static_assert(qr_linalg_backend<cuda_linalg>, "cuda_linalg must model qr_linalg_backend");
static_assert(stream_linalg_backend<cuda_linalg, cuda>, "cuda_linalg must model stream_linalg_backend");

}  // namespace gradapt

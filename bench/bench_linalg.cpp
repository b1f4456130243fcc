// The host linear-algebra candidates for `linalg_backend`, timed in one run at the consumer's
// plain -O2 (no -march): SYRK (C = A·Aᵀ, A n × n), GEMM (C = A·B, n × n) and the symmetric
// eigendecomposition (values and vectors) at n = 128, 512, 1024, float and double.
//
// Candidates:
//   lapack     gradapt::host_lapack, linked through the CMake component gradapt::linalg (the
//              library find_package(LAPACK) picked; -DBLA_VENDOR=OpenBLAS for OpenBLAS)
//   reference  Debian's reference BLAS and LAPACK (netlib), loaded with dlopen from
//              /usr/lib/x86_64-linux-gnu/{blas,lapack}/ with RTLD_LOCAL | RTLD_DEEPBIND so
//              that they coexist with the linked library; skipped when the files are absent
//   eigen      Eigen 3 compiled into this file (noalias GEMM, selfadjointView().rankUpdate,
//              SelfAdjointEigenSolver), single-threaded (no OpenMP here)
//
// qr_lapack times host_lapack::qr (Householder QR with the explicit Q: SOAP's QR refresh
// factors its rotated statistics with it), for comparison with eigh_lapack and gemm_lapack.
//
// Counters: GFLOPS for GEMM (2n³ flops) and SYRK (n³); eigh reports time only (its flop count
// depends on the spectrum). The root_* benches time gradapt::inverse_pth_root on host_lapack
// for p = 4 (the SPD matrix of the eigh benches) by coupled Newton and by the
// eigendecomposition, with the Newton iteration count as a counter; each Newton iteration
// performs 4 n × n GEMMs, so time / (4 · iterations · the gemm_lapack time of the same run)
// is the root's overhead over its products.
//
//   OPENBLAS_NUM_THREADS=1 bench_linalg [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/linalg/matrix_root.hpp"

namespace {

using gradapt::gram;
using gradapt::host_lapack;
using gradapt::tensor_view;
using gradapt::transpose;

template <class T>
std::vector<T> random_matrix(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> m(static_cast<std::size_t>(n * n));
  for (auto& v : m) v = T(u(rng));
  return m;
}

// A symmetric positive definite matrix (a Shampoo-like statistic after its ridge): G·Gᵀ/n +
// 1e-3·I with G uniform in [-1, 1], eigenvalues from 1e-3 to about 1.3 (Marchenko-Pastur).
template <class T>
std::vector<T> spd_matrix(std::int64_t n) {
  const auto g = random_matrix<T>(n, 17);
  std::vector<T> a(static_cast<std::size_t>(n * n));
  host_lapack{}.syrk<T>(gram::rows, 1.0 / double(n), tensor_view<const T>(g.data(), {n, n}), 0.0,
                        tensor_view<T>(a.data(), {n, n}));
  for (std::int64_t i = 0; i < n; ++i) a[std::size_t(i * n + i)] += T(1e-3);
  return a;
}

// ---- the reference libraries through dlopen ----------------------------------------------
template <class T>
struct fortran_api {
  using gemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const T*, const T*,
                          const int*, const T*, const int*, const T*, T*, const int*, std::size_t,
                          std::size_t);
  using syrk_t = void (*)(const char*, const char*, const int*, const int*, const T*, const T*, const int*,
                          const T*, T*, const int*, std::size_t, std::size_t);
  using syevd_t = void (*)(const char*, const char*, const int*, T*, const int*, T*, T*, const int*, int*,
                           const int*, int*, std::size_t, std::size_t);
  gemm_t gemm = nullptr;
  syrk_t syrk = nullptr;
  syevd_t syevd = nullptr;
};

struct reference_libs {
  fortran_api<float> s;
  fortran_api<double> d;
  bool ok = false;
  reference_libs() {
    // The reference BLAS first: liblapack.so.3 then binds its libblas.so.3 dependency to it.
    void* blas = dlopen("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    void* lapack =
        dlopen("/usr/lib/x86_64-linux-gnu/lapack/liblapack.so.3", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!blas || !lapack) return;
    s.gemm = reinterpret_cast<fortran_api<float>::gemm_t>(dlsym(blas, "sgemm_"));
    d.gemm = reinterpret_cast<fortran_api<double>::gemm_t>(dlsym(blas, "dgemm_"));
    s.syrk = reinterpret_cast<fortran_api<float>::syrk_t>(dlsym(blas, "ssyrk_"));
    d.syrk = reinterpret_cast<fortran_api<double>::syrk_t>(dlsym(blas, "dsyrk_"));
    s.syevd = reinterpret_cast<fortran_api<float>::syevd_t>(dlsym(lapack, "ssyevd_"));
    d.syevd = reinterpret_cast<fortran_api<double>::syevd_t>(dlsym(lapack, "dsyevd_"));
    ok = s.gemm && d.gemm && s.syrk && d.syrk && s.syevd && d.syevd;
  }
  template <class T>
  const fortran_api<T>& api() const {
    if constexpr (std::is_same_v<T, float>)
      return s;
    else
      return d;
  }
};

const reference_libs& reference() {
  static const reference_libs libs;
  return libs;
}

template <class T>
using emat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// ---- GEMM -----------------------------------------------------------------------------------
template <class T>
void gemm_lapack(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = random_matrix<T>(n, 1), b = random_matrix<T>(n, 2);
  std::vector<T> c(a.size());
  const host_lapack la;
  for (auto _ : st) {
    la.gemm<T>(transpose::none, transpose::none, 1.0, tensor_view<const T>(a.data(), {n, n}),
               tensor_view<const T>(b.data(), {n, n}), 0.0, tensor_view<T>(c.data(), {n, n}));
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      2.0 * double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

template <class T>
void gemm_reference(benchmark::State& st) {
  if (!reference().ok) return st.SkipWithError("reference BLAS/LAPACK not found");
  const auto n = st.range(0);
  const int ni = int(n);
  const auto a = random_matrix<T>(n, 1), b = random_matrix<T>(n, 2);
  std::vector<T> c(a.size());
  const T one = 1, zero = 0;
  for (auto _ : st) {
    reference().api<T>().gemm("N", "N", &ni, &ni, &ni, &one, b.data(), &ni, a.data(), &ni, &zero, c.data(),
                              &ni, 1, 1);
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      2.0 * double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

template <class T>
void gemm_eigen(benchmark::State& st) {
  const auto n = st.range(0);
  auto a = random_matrix<T>(n, 1), b = random_matrix<T>(n, 2);
  std::vector<T> c(a.size());
  Eigen::Map<const emat<T>> A(a.data(), n, n), B(b.data(), n, n);
  Eigen::Map<emat<T>> C(c.data(), n, n);
  for (auto _ : st) {
    C.noalias() = A * B;
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      2.0 * double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// ---- SYRK -----------------------------------------------------------------------------------
template <class T>
void syrk_lapack(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = random_matrix<T>(n, 1);
  std::vector<T> c(a.size());
  const host_lapack la;
  for (auto _ : st) {
    la.syrk<T>(gram::rows, 1.0, tensor_view<const T>(a.data(), {n, n}), 0.0,
               tensor_view<T>(c.data(), {n, n}));
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

template <class T>
void syrk_reference(benchmark::State& st) {
  if (!reference().ok) return st.SkipWithError("reference BLAS/LAPACK not found");
  const auto n = st.range(0);
  const int ni = int(n);
  const auto a = random_matrix<T>(n, 1);
  std::vector<T> c(a.size());
  const T one = 1, zero = 0;
  for (auto _ : st) {
    // One triangle, as host_lapack computes it (its mirror copy is not timed here).
    reference().api<T>().syrk("U", "T", &ni, &ni, &one, a.data(), &ni, &zero, c.data(), &ni, 1, 1);
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

template <class T>
void syrk_eigen(benchmark::State& st) {
  const auto n = st.range(0);
  auto a = random_matrix<T>(n, 1);
  std::vector<T> c(a.size());
  Eigen::Map<const emat<T>> A(a.data(), n, n);
  Eigen::Map<emat<T>> C(c.data(), n, n);
  for (auto _ : st) {
    C.setZero();
    C.template selfadjointView<Eigen::Lower>().rankUpdate(A);
    benchmark::DoNotOptimize(c.data());
  }
  st.counters["GFLOPS"] = benchmark::Counter(
      double(n) * double(n) * double(n) * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// ---- eigh -----------------------------------------------------------------------------------
template <class T>
void eigh_lapack(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = spd_matrix<T>(n);
  std::vector<T> q(a.size()), w(static_cast<std::size_t>(n));
  const host_lapack la;
  auto ws = la.eigh_workspace<T>(n);
  for (auto _ : st) {
    q = a;
    if (!la.eigh<T>(tensor_view<T>(q.data(), {n, n}), gradapt::host_view(w), ws))
      st.SkipWithError("eigh failed");
    benchmark::DoNotOptimize(q.data());
  }
}

// ---- qr (host_lapack::qr: ?geqrf + ?orgqr, Q formed explicitly) ----------------------------------
template <class T>
void qr_lapack(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = spd_matrix<T>(n);
  std::vector<T> q(a.size()), r(a.size()), work;
  const host_lapack la;
  for (auto _ : st) {
    la.qr<T>(tensor_view<const T>(a.data(), {n, n}), tensor_view<T>(q.data(), {n, n}),
             tensor_view<T>(r.data(), {n, n}), work);
    benchmark::DoNotOptimize(q.data());
  }
}

template <class T>
void eigh_reference(benchmark::State& st) {
  if (!reference().ok) return st.SkipWithError("reference BLAS/LAPACK not found");
  const auto n = st.range(0);
  const int ni = int(n);
  const auto a = spd_matrix<T>(n);
  std::vector<T> q(a.size()), w(static_cast<std::size_t>(n));
  int info = 0, liwork = -1, lwork = -1, isz = 0;
  T wsz = 0;
  reference().api<T>().syevd("V", "U", &ni, q.data(), &ni, w.data(), &wsz, &lwork, &isz, &liwork, &info, 1,
                             1);
  std::vector<T> work(static_cast<std::size_t>(wsz));
  std::vector<int> iwork(static_cast<std::size_t>(isz));
  lwork = int(work.size());
  liwork = int(iwork.size());
  for (auto _ : st) {
    q = a;
    reference().api<T>().syevd("V", "U", &ni, q.data(), &ni, w.data(), work.data(), &lwork, iwork.data(),
                               &liwork, &info, 1, 1);
    if (info != 0) st.SkipWithError("syevd failed");
    benchmark::DoNotOptimize(q.data());
  }
}

template <class T>
void eigh_eigen(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = spd_matrix<T>(n);
  Eigen::Map<const emat<T>> A(a.data(), n, n);
  Eigen::SelfAdjointEigenSolver<emat<T>> solver(n);
  for (auto _ : st) {
    solver.compute(A, Eigen::ComputeEigenvectors);
    if (solver.info() != Eigen::Success) st.SkipWithError("eigensolver failed");
    benchmark::DoNotOptimize(solver.eigenvectors().data());
  }
}

// ---- inverse p-th roots on host_lapack ------------------------------------------------------
template <class T, gradapt::root_method M>
void root_lapack(benchmark::State& st) {
  const auto n = st.range(0);
  const auto a = spd_matrix<T>(n);
  std::vector<T> x(a.size());
  const host_lapack la;
  gradapt::inverse_root_workspace<host_lapack, T> ws(la, n);
  ws.reserve(M);
  gradapt::inverse_root_result r;
  for (auto _ : st) {
    r = gradapt::inverse_pth_root(la, tensor_view<const T>(a.data(), {n, n}), 4,
                                  tensor_view<T>(x.data(), {n, n}), ws,
                                  {.method = M, .epsilon = 1e-6, .ridge = gradapt::ridge_kind::absolute});
    if (!r.ok()) st.SkipWithError("root failed");
    benchmark::DoNotOptimize(x.data());
  }
  st.counters["iterations"] = r.iterations;
}

constexpr auto ms = benchmark::kMillisecond;

}  // namespace

#define GRADAPT_LINALG_BENCH(fn)                                                                       \
  BENCHMARK_TEMPLATE(fn, float)->Arg(128)->Arg(512)->Arg(1024)->Unit(ms)->MinTime(0.3)->UseRealTime(); \
  BENCHMARK_TEMPLATE(fn, double)->Arg(128)->Arg(512)->Arg(1024)->Unit(ms)->MinTime(0.3)->UseRealTime();
GRADAPT_LINALG_BENCH(gemm_lapack)
GRADAPT_LINALG_BENCH(gemm_reference)
GRADAPT_LINALG_BENCH(gemm_eigen)
GRADAPT_LINALG_BENCH(syrk_lapack)
GRADAPT_LINALG_BENCH(syrk_reference)
GRADAPT_LINALG_BENCH(syrk_eigen)
GRADAPT_LINALG_BENCH(eigh_lapack)
GRADAPT_LINALG_BENCH(eigh_reference)
GRADAPT_LINALG_BENCH(eigh_eigen)
GRADAPT_LINALG_BENCH(qr_lapack)
BENCHMARK_TEMPLATE(root_lapack, float, gradapt::root_method::coupled_newton)
    ->Arg(512)
    ->Arg(1024)
    ->Unit(ms)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK_TEMPLATE(root_lapack, double, gradapt::root_method::coupled_newton)
    ->Arg(512)
    ->Arg(1024)
    ->Unit(ms)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK_TEMPLATE(root_lapack, float, gradapt::root_method::eigen)
    ->Arg(512)
    ->Arg(1024)
    ->Unit(ms)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK_TEMPLATE(root_lapack, double, gradapt::root_method::eigen)
    ->Arg(512)
    ->Arg(1024)
    ->Unit(ms)
    ->MinTime(0.3)
    ->UseRealTime();

BENCHMARK_MAIN();

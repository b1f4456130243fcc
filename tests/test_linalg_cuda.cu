// gradapt::cuda_linalg (linalg/cuda_linalg.cuh) on the device: GEMM and SYRK against a long
// double re-computation within the dot-product bound (as tests/test_linalg.cpp; TF32 is off,
// so the fp32 bound applies), eigh by its backward error and orthogonality, and the argument
// checks. Exits with 77 (ctest: skipped) without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "cuda_test_support.cuh"
#include "eigh_errors.hpp"
#include "gradapt/linalg/cuda_linalg.cuh"

using gradapt::cuda_buffer;
using gradapt::cuda_linalg;
using gradapt::device_space;
using gradapt::gram;
using gradapt::transpose;
template <class T>
using dview = gradapt::tensor_view<T, device_space>;

namespace {

/// r × c elements drawn from [-1, 1) (the CUDA tests' generator).
template <class T>
std::vector<T> random_matrix(std::int64_t r, std::int64_t c, unsigned seed) {
  return gradapt_test::random_values<T>(static_cast<std::size_t>(r * c), seed, -1.0, 1.0);
}

template <class T>
cuda_buffer<T> upload(const std::vector<T>& h) {
  cuda_buffer<T> d(h.size());
  if (!h.empty())
    GRADAPT_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const cuda_buffer<T>& d) {
  std::vector<T> h(d.size());
  if (!h.empty())
    GRADAPT_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda_linalg::gemm matches a long double product within the dot-product bound",
                   "[linalg][cuda]", float, double) {
  using T = TestType;
  const cuda_linalg la;
  const std::int64_t m = 33, k = 70, n = 17;
  for (transpose ta : {transpose::none, transpose::yes})
    for (transpose tb : {transpose::none, transpose::yes}) {
      const std::int64_t ar = ta == transpose::none ? m : k, ac = ta == transpose::none ? k : m;
      const std::int64_t br = tb == transpose::none ? k : n, bc = tb == transpose::none ? n : k;
      const auto a = random_matrix<T>(ar, ac, 1), b = random_matrix<T>(br, bc, 2),
                 c0 = random_matrix<T>(m, n, 3);
      auto da = upload(a), db = upload(b), dc = upload(c0);
      la.gemm<T>(ta, tb, 0.5, dview<const T>(da.data(), {ar, ac}), dview<const T>(db.data(), {br, bc}), -1.0,
                 dview<T>(dc.data(), {m, n}));
      const auto c = download(dc);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          long double ref = 0, mag = 0;
          for (std::int64_t l = 0; l < k; ++l) {
            const long double x =
                ta == transpose::none ? a[std::size_t(i * ac + l)] : a[std::size_t(l * ac + i)];
            const long double y =
                tb == transpose::none ? b[std::size_t(l * bc + j)] : b[std::size_t(j * bc + l)];
            ref += x * y;
            mag += std::fabs(x * y);
          }
          const long double cij = c0[std::size_t(i * n + j)];
          ref = 0.5L * ref - cij;
          REQUIRE(std::fabs((long double)c[std::size_t(i * n + j)] - ref) <=
                  2.0L * (k + 2) * unit_roundoff<T>() * (0.5L * mag + std::fabs(cij)));
        }
    }
}

TEMPLATE_TEST_CASE("cuda_linalg::syrk is A·Aᵀ or Aᵀ·A, symmetric bit for bit", "[linalg][cuda]", float,
                   double) {
  using T = TestType;
  const cuda_linalg la;
  const std::int64_t m = 40, k = 90;
  for (gram g : {gram::rows, gram::columns}) {
    const std::int64_t n = g == gram::rows ? m : k, inner = g == gram::rows ? k : m;
    const auto a = random_matrix<T>(m, k, 4);
    auto da = upload(a);
    cuda_buffer<T> dc{std::size_t(n * n)};
    la.syrk<T>(g, 1.0, dview<const T>(da.data(), {m, k}), 0.0, dview<T>(dc.data(), {n, n}));
    const auto c = download(dc);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        long double ref = 0, mag = 0;
        for (std::int64_t l = 0; l < inner; ++l) {
          const long double p = g == gram::rows
                                    ? (long double)a[std::size_t(i * k + l)] * a[std::size_t(j * k + l)]
                                    : (long double)a[std::size_t(l * k + i)] * a[std::size_t(l * k + j)];
          ref += p;
          mag += std::fabs(p);
        }
        REQUIRE(std::fabs((long double)c[std::size_t(i * n + j)] - ref) <=
                2.0L * (inner + 2) * unit_roundoff<T>() * mag);
        REQUIRE(c[std::size_t(i * n + j)] == c[std::size_t(j * n + i)]);
      }
  }
}

TEMPLATE_TEST_CASE("cuda_linalg::eigh: ascending, A = Q·diag(w)·Qᵀ, Q orthogonal", "[linalg][cuda]", float,
                   double) {
  using T = TestType;
  const cuda_linalg la;
  const std::int64_t n = 64;
  auto a = random_matrix<T>(n, n, 9);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < i; ++j) a[std::size_t(j * n + i)] = a[std::size_t(i * n + j)];
  auto dq = upload(a);
  cuda_buffer<T> dw{std::size_t(n)};
  auto ws = la.eigh_workspace<T>(n);
  REQUIRE(la.eigh<T>(dview<T>(dq.data(), {n, n}), dview<T>::vector(dw.data(), n), ws));
  GRADAPT_CUDA_CHECK(cudaStreamSynchronize(la.stream()));
  const auto q = download(dq), w = download(dw);
  REQUIRE(std::is_sorted(w.begin(), w.end()));
  const auto e = gradapt_test::eigh_errors_of(a, q, w, n);
  REQUIRE(std::sqrt(e.residual) <= 4.0L * n * unit_roundoff<T>() * std::sqrt(e.anorm));
  REQUIRE(std::sqrt(e.orthogonality) <= 4.0L * n * unit_roundoff<T>());
}

TEST_CASE("cuda_linalg: invalid shapes throw gradapt::error", "[linalg][cuda]") {
  const cuda_linalg la;
  cuda_buffer<float> buf(64);
  auto m = [&](std::int64_t r, std::int64_t c) { return dview<float>(buf.data(), {r, c}); };
  auto cm = [&](std::int64_t r, std::int64_t c) { return dview<const float>(buf.data(), {r, c}); };
  REQUIRE_THROWS_AS(la.gemm<float>(transpose::none, transpose::none, 1, cm(2, 3), cm(2, 3), 0, m(2, 3)),
                    gradapt::error);
  REQUIRE_THROWS_AS(la.syrk<float>(gram::rows, 1, cm(3, 5), 0, m(5, 5)), gradapt::error);
  auto ws = la.eigh_workspace<float>(4);
  REQUIRE_THROWS_AS(la.eigh<float>(m(3, 3), dview<float>::vector(buf.data(), 3), ws), gradapt::error);
}

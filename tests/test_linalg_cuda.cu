// gradapt::cuda_linalg (linalg/cuda_linalg.cuh) on the device: GEMM and SYRK against a long
// double re-computation within the dot-product bound (as tests/test_linalg.cpp; TF32 is off,
// so the fp32 bound applies), eigh by its backward error and orthogonality, and the argument
// checks, newton_schulz over cuda_linalg with gradapt::cuda against the iteration re-run on the
// host (sums in long double), and Shampoo's spectral descent (Muon with a bias-corrected first
// moment) on the device against the same step written out on the host, through a checkpoint. Exits with 77
// (ctest: skipped) without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "cuda_test_support.cuh"
#include "eigh_errors.hpp"
#include "gradapt/backend/cuda/backend.cuh"
#include "gradapt/linalg/cuda_linalg.cuh"
#include "gradapt/linalg/newton_schulz.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "kfac_reference_run.hpp"
#include "shampoo_ld_reference.hpp"
#include "shampoo_reference_run.hpp"

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

TEMPLATE_TEST_CASE("cuda_linalg::qr: A = Q·R, Q orthogonal, R upper triangular", "[linalg][cuda]", float,
                   double) {
  using T = TestType;
  const cuda_linalg la;
  const std::int64_t n = 48;
  const auto a = random_matrix<T>(n, n, 11);
  const auto da = upload(a);
  cuda_buffer<T> dq{std::size_t(n * n)}, dr{std::size_t(n * n)};
  auto ws = la.qr_workspace<T>(n);
  la.qr<T>(dview<const T>(da.data(), {n, n}), dview<T>(dq.data(), {n, n}), dview<T>(dr.data(), {n, n}), ws);
  GRADAPT_CUDA_CHECK(cudaStreamSynchronize(la.stream()));
  const auto q = download(dq), r = download(dr);
  double residual = 0, orthogonality = 0, anorm = 0;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      if (j < i) REQUIRE(r[std::size_t(i * n + j)] == T(0));
      double qr = 0, qtq = 0;
      for (std::int64_t k = 0; k < n; ++k) {
        qr += double(q[std::size_t(i * n + k)]) * double(r[std::size_t(k * n + j)]);
        qtq += double(q[std::size_t(k * n + i)]) * double(q[std::size_t(k * n + j)]);
      }
      const double aij = double(a[std::size_t(i * n + j)]);
      residual += (qr - aij) * (qr - aij);
      anorm += aij * aij;
      orthogonality += (qtq - (i == j ? 1.0 : 0.0)) * (qtq - (i == j ? 1.0 : 0.0));
    }
  REQUIRE(std::sqrt(residual) <= 8.0 * double(n) * unit_roundoff<T>() * std::sqrt(anorm));
  REQUIRE(std::sqrt(orthogonality) <= 8.0 * double(n) * unit_roundoff<T>());
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

namespace {

/// The Newton–Schulz iteration of the m × n matrix x on the host, on the wide orientation (Xᵀ for
/// a tall X), each sum accumulated in long double; returned in x's layout. (Stored in double:
/// std::vector is constexpr, so nvcc would also compile vector<long double> for the device; sqrtl,
/// not std::sqrt or std::max, for the same reason.)
std::vector<double> ns_reference(const std::vector<double>& x, std::int64_t m, std::int64_t n,
                                 const gradapt::newton_schulz_options& o) {
  const bool tall = m > n;
  const std::int64_t r = tall ? n : m, c = tall ? m : n;
  std::vector<double> y(x.size()), a(std::size_t(r * r)), p(std::size_t(r * r)), z(x.size());
  long double sq = 0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const long double v = x[std::size_t(i * n + j)];
      sq += v * v;
      y[std::size_t(tall ? j * m + i : i * n + j)] = double(v);
    }
  const long double norm = sqrtl(sq) > o.epsilon ? sqrtl(sq) : static_cast<long double>(o.epsilon);
  for (auto& v : y) v = double(v / norm);
  for (std::uint32_t s = 0; s < o.steps; ++s) {
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j) {
        long double acc = 0;
        for (std::int64_t k = 0; k < c; ++k) acc += y[std::size_t(i * c + k)] * y[std::size_t(j * c + k)];
        a[std::size_t(i * r + j)] = double(acc);
      }
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j) {
        long double acc = 0;
        for (std::int64_t k = 0; k < r; ++k) acc += a[std::size_t(i * r + k)] * a[std::size_t(k * r + j)];
        p[std::size_t(i * r + j)] = double(o.b * a[std::size_t(i * r + j)] + o.c * acc);
      }
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < c; ++j) {
        long double acc = 0;
        for (std::int64_t k = 0; k < r; ++k) acc += p[std::size_t(i * r + k)] * y[std::size_t(k * c + j)];
        z[std::size_t(i * c + j)] = double(o.a * y[std::size_t(i * c + j)] + acc);
      }
    y.swap(z);
  }
  std::vector<double> out(x.size());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      out[std::size_t(i * n + j)] = y[std::size_t(tall ? j * m + i : i * n + j)];
  return out;
}

double largest_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace

TEST_CASE("newton_schulz on cuda_linalg and gradapt::cuda: the iteration re-run on the host",
          "[linalg][cuda]") {
  const cuda_linalg la;
  const gradapt::cuda b{.stream = la.stream()};
  const gradapt::newton_schulz_options o{.steps = 5};
  for (const auto& [m, n] : {std::pair<std::int64_t, std::int64_t>{24, 40}, {40, 24}, {16, 16}}) {
    const auto x = random_matrix<double>(m, n, 17);
    auto d = upload(x);
    cuda_buffer<double> ws(gradapt::newton_schulz_workspace(m, n));
    gradapt::newton_schulz(la, b, dview<double>(d.data(), {m, n}),
                           dview<double>::vector(ws.data(), std::int64_t(ws.size())), o);
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(la.stream()));
    const double worst = largest_difference(download(d), ns_reference(x, m, n, o));
    INFO(m << " x " << n << ": largest difference " << worst);
    CHECK(worst <= 1e-10);
  }
}

TEST_CASE(
    "shampoo's spectral descent on gradapt::cuda and cuda_linalg: the first-moment Muon step re-run "
    "on the host, through a checkpoint",
    "[linalg][cuda][shampoo]") {
  namespace tr = gradapt::transform;
  const cuda_linalg la;
  const gradapt::cuda b{.stream = la.stream()};
  gradapt::shampoo_options o = gradapt::spectral_descent_defaults();
  o.lr = 0.1;
  o.beta1 = 0.9;
  o.bias_correction = true;
  o.momentum = 0.0;
  o.weight_decay = 0.0;
  o.scale_by_aspect = true;
  tr::scale_by_shampoo<cuda_linalg> pre{.options = o, .linalg = la};
  const gradapt::chain<tr::scale_by_shampoo<cuda_linalg>, tr::scale_by_learning_rate> opt(
      std::move(pre), tr::scale_by_learning_rate{.lr = o.lr});
  // A wide and a tall matrix (aspect scaling) and a bias (the graft: none, so m̂ itself).
  const std::vector<std::pair<std::int64_t, std::int64_t>> dims{{24, 40}, {40, 24}, {1, 7}};
  std::vector<std::vector<double>> w, mom;
  std::vector<cuda_buffer<double>> dw, dg;
  gradapt::param_list<double, double, device_space> params;
  for (std::size_t t = 0; t < dims.size(); ++t) {
    const auto [m, n] = dims[t];
    w.push_back(random_matrix<double>(m, n, 30 + unsigned(t)));
    mom.emplace_back(w.back().size(), 0.0);
    dw.push_back(upload(w.back()));
    dg.emplace_back(w.back().size());
    const std::vector<std::int64_t> shape =
        m == 1 ? std::vector<std::int64_t>{n} : std::vector<std::int64_t>{m, n};
    params.add("p" + std::to_string(t), dview<double>(dw.back().data(), shape),
               dview<double>(dg.back().data(), shape));
  }
  std::vector<std::byte> saved;
  auto st = opt.init(b, params);
  for (int k = 1; k <= 4; ++k) {
    const double bc1 = 1.0 - std::pow(0.9, k);
    for (std::size_t t = 0; t < dims.size(); ++t) {
      const auto [m, n] = dims[t];
      const auto g = random_matrix<double>(m, n, 100 + unsigned(10 * k) + unsigned(t));
      GRADAPT_CUDA_CHECK(
          cudaMemcpy(dg[t].data(), g.data(), g.size() * sizeof(double), cudaMemcpyHostToDevice));
      std::vector<double> mh(g.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        mom[t][i] = mom[t][i] + 0.1 * (g[i] - mom[t][i]);
        mh[i] = mom[t][i] / bc1;
      }
      const auto dir = m == 1 ? mh : ns_reference(mh, m, n, o.newton_schulz);
      const double aspect = m > n ? std::sqrt(double(m) / double(n)) : 1.0;
      for (std::size_t i = 0; i < g.size(); ++i) w[t][i] -= o.lr * aspect * dir[i];
    }
    opt.step(b, params, st);
    if (k == 2) {  // the first moment leaves the device and comes back
      saved = st.save(b);
      st = opt.init(b, params);
      st.load(b, saved);
    }
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(la.stream()));
    for (std::size_t t = 0; t < dims.size(); ++t) {
      const double worst = largest_difference(download(dw[t]), w[t]);
      INFO("step " << k << ", tensor " << t << ": largest difference " << worst);
      CHECK(worst <= 1e-10);
    }
  }
}

namespace {
/// Device buffers for kfac_against_ld and shampoo_against_ld: the copies wait for `stream` (the backend's).
struct cuda_memory {
  cudaStream_t stream;
  template <class T>
  cuda_buffer<T> alloc(std::size_t n) const {
    return cuda_buffer<T>(n);
  }
  template <class T>
  void put(cuda_buffer<T>& d, const std::vector<T>& h) const {
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (!h.empty())
      GRADAPT_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> get(const cuda_buffer<T>& d) const {
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return download(d);
  }
};
}  // namespace

TEST_CASE(
    "shampoo's root-inverse step on gradapt::cuda and cuda_linalg: statistics, eigen roots and "
    "products against a long double re-run, through a checkpoint; the same with the roots one step "
    "stale on a second stream (root_staleness 1, roots in flight at the checkpoint)",
    "[linalg][cuda][shampoo]") {
  const cuda_linalg la;
  const gradapt::cuda b{.stream = la.stream()};
  cudaStream_t side = nullptr;
  GRADAPT_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  for (const std::uint64_t stale : {0, 1}) {
    INFO("root_staleness " << stale);
    gradapt::shampoo_options o;
    o.graft = gradapt::shampoo_graft::none;
    o.precondition_1d = false;
    o.root.ridge = gradapt::ridge_kind::absolute;
    o.root.epsilon = 1e-6;
    o.root_staleness = stale;
    const auto r = gradapt_test::shampoo_against_ld<device_space>(
        b, la, stale != 0 ? std::optional<cuda_linalg>(cuda_linalg(side)) : std::nullopt,
        cuda_memory{la.stream()}, o,
        [&](gradapt_test::shampoo_ld_reference& ref, const std::vector<double>& g) {
          return stale != 0 ? ref.stale_direction(g) : ref.direction(g);
        });
    INFO("largest difference " << r.worst);
    CHECK(r.worst <= (stale != 0 ? 1e-8 : 1e-9));  // stale: test_shampoo_device_path's bound
    CHECK(r.root_computations > 0);
  }
  GRADAPT_CUDA_CHECK(cudaStreamDestroy(side));
}

TEST_CASE(
    "eigenvalue-corrected shampoo on gradapt::cuda and cuda_linalg: eigenbases, rotated second "
    "moment and products against a long double re-run, through a checkpoint",
    "[linalg][cuda][shampoo]") {
  const cuda_linalg la;
  const gradapt::cuda b{.stream = la.stream()};
  gradapt::shampoo_options o;
  o.preconditioner = gradapt::shampoo_preconditioner::eigenvalue_corrected;
  o.eigenbasis = gradapt::shampoo_eigenbasis::eigh;
  o.graft = gradapt::shampoo_graft::none;
  o.precondition_1d = false;
  o.root.epsilon = 1e-4;
  const auto r = gradapt_test::shampoo_against_ld<device_space>(
      b, la, std::nullopt, cuda_memory{la.stream()}, o,
      [](gradapt_test::shampoo_ld_reference& ref, const std::vector<double>& g) {
        return ref.corrected_direction(g);
      });
  INFO("largest difference " << r.worst);
  CHECK(r.worst <= 1e-9);
  CHECK(r.root_computations > 0);
}

TEST_CASE(
    "kfac on gradapt::cuda and cuda_linalg: factors, eigendecompositions or inverses and products "
    "against a long double re-run, through a checkpoint",
    "[linalg][cuda][kfac]") {
  const cuda_linalg la;
  const gradapt::cuda b{.stream = la.stream()};
  for (const auto& [method, prediv] :
       {std::pair{gradapt::kfac_method::eigen, false}, std::pair{gradapt::kfac_method::eigen, true},
        std::pair{gradapt::kfac_method::inverse, false}}) {
    const double worst =
        gradapt_test::kfac_against_ld<device_space>(b, la, cuda_memory{la.stream()}, method, prediv);
    INFO("method " << int(method) << ", prediv " << prediv << ": largest relative difference " << worst);
    CHECK(worst <= 1e-9);
  }
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

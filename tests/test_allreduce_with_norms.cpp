// allreduce_with_norms: the fused threads-communicator path and the generic path (a
// communicator without the member) give the allreduce's result and the two squared norms of
// the data-parallel noise scale, checked against a long double re-computation.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/stats/allreduce_with_norms.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "rank_check.hpp"

namespace gradapt_test_allreduce_with_norms {

using gradapt::host_view;
using gradapt::comm::run_threads;

namespace {

// A communicator that forwards to comm::threads but has no allreduce_with_norms, so the
// generic (backend passes + scalar allreduce) path runs with several ranks.
struct plain_comm {
  using space = gradapt::host_space;
  gradapt::comm::threads* c;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  template <class T>
  void allreduce(gradapt::tensor_view<T> b, gradapt::reduce_op op) {
    c->allreduce(b, op);
  }
  template <class T>
  void broadcast(gradapt::tensor_view<T> b, int root) {
    c->broadcast(b, root);
  }
  template <class T>
  void allgather(gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r) {
    c->allgather<T>(s, r);
  }
  template <class T>
  void reduce_scatter(gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r, gradapt::reduce_op op) {
    c->reduce_scatter<T>(s, r, op);
  }
  template <class T>
  void exchange(int peer, gradapt::tensor_view<const T> s, gradapt::tensor_view<T> r) {
    c->exchange<T>(peer, s, r);
  }
  plain_comm split(int, int) { return *this; }
  void barrier() { c->barrier(); }
};
static_assert(gradapt::communicator<plain_comm>);
static_assert(!gradapt::communicator_with_norms<plain_comm, float>);
static_assert(gradapt::communicator_with_norms<gradapt::comm::threads, float>);

template <class T>
std::vector<T> rank_data(int rank, std::size_t n) {
  std::mt19937_64 rng(1000 + static_cast<unsigned>(rank));
  std::normal_distribution<double> d(0.5, 2.0);
  std::vector<T> v(n);
  for (auto& x : v) gradapt::store(x, static_cast<gradapt::compute_t<T>>(d(rng)));
  return v;
}

struct expected {
  std::vector<float> sum;  // allreduce's result from comm::threads::allreduce
  long double local = 0, result = 0;
};

template <class T>
void check_world(int n, std::size_t size, bool fused) {
  // Reference: plain allreduce on a separate world, norms re-computed in long double.
  std::vector<std::vector<T>> ref(static_cast<std::size_t>(n));
  run_threads(n, [&](gradapt::comm::threads& c) {
    auto v = rank_data<T>(c.rank(), size);
    c.allreduce(host_view(v), gradapt::reduce_op::sum);
    ref[static_cast<std::size_t>(c.rank())] = v;
  });
  long double local = 0, result = 0;
  for (int r = 0; r < n; ++r)
    for (const T& x : rank_data<T>(r, size))
      local += static_cast<long double>(gradapt::load(x)) * gradapt::load(x);
  for (const T& x : ref[0]) result += static_cast<long double>(gradapt::load(x)) * gradapt::load(x);

  std::vector<gradapt::allreduce_norms> got(static_cast<std::size_t>(n));
  run_threads(n, [&](gradapt::comm::threads& c) {
    auto v = rank_data<T>(c.rank(), size);
    const gradapt::host backend{.threads = 1};
    gradapt::allreduce_norms nr;
    if (fused) {
      nr = gradapt::allreduce_with_norms(c, backend, host_view(v));
    } else {
      plain_comm pc{&c};
      nr = gradapt::allreduce_with_norms(pc, backend, host_view(v));
    }
    RANK_REQUIRE((size == 0 || std::memcmp(v.data(), ref[0].data(), size * sizeof(T)) == 0));
    got[static_cast<std::size_t>(c.rank())] = nr;
  });
  for (const auto& g : got) {
    // Every rank holds the same bits.
    REQUIRE(std::memcmp(&g, &got[0], sizeof g) == 0);
  }
  const double tol = 1e-12;
  REQUIRE(std::fabs(static_cast<long double>(got[0].sum_local_sq) - local) <= tol * local + 1e-300);
  REQUIRE(std::fabs(static_cast<long double>(got[0].result_sq) - result) <= tol * result + 1e-300);
}

}  // namespace

TEMPLATE_TEST_CASE("allreduce_with_norms: the threads communicator's fused reduction", "[norms]", float,
                   double, gradapt::half, gradapt::bfloat16) {
  for (int n : {1, 2, 3, 5, 8})
    for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                             std::size_t{1001}, std::size_t{65543}}) {
      INFO("ranks " << n << " size " << size);
      check_world<TestType>(n, size, true);
    }
}

TEST_CASE("allreduce_with_norms: the generic path for communicators without the member", "[norms]") {
  for (int n : {1, 2, 3, 4})
    for (std::size_t size : {std::size_t{0}, std::size_t{9}, std::size_t{40000}}) {
      INFO("ranks " << n << " size " << size);
      check_world<float>(n, size, false);
    }
}

TEST_CASE("the fused and generic norms feed the noise scale the same estimate", "[norms][gns]") {
  // Four ranks, each with its own draw of a gradient with mean G and noise: the estimator fed
  // from allreduce_with_norms matches the one fed from separately computed norms.
  constexpr int n = 4;
  constexpr std::size_t size = 20000;
  std::vector<double> fused_b(n), manual_b(n);
  run_threads(n, [&](gradapt::comm::threads& c) {
    gradapt::gradient_noise_scale a{{.smoothing = 0.0}}, b{{.smoothing = 0.0}};
    const gradapt::host backend{.threads = 1};
    auto v = rank_data<float>(c.rank(), size);
    auto w = v;
    const auto norms = gradapt::allreduce_with_norms(c, backend, host_view(v));
    a.update(norms, n, {.micro_batch = 32});
    const double local = backend.reduce(gradapt::reduction::sum_squares, host_view(std::as_const(w)));
    c.allreduce(host_view(w), gradapt::reduce_op::sum);
    backend.apply([](float& x) { x *= 0.25f; }, host_view(w));
    const double global = backend.reduce(gradapt::reduction::sum_squares, host_view(std::as_const(w)));
    b.update(c, local, global, {.micro_batch = 32});
    RANK_REQUIRE(a.b_simple().has_value());
    fused_b[static_cast<std::size_t>(c.rank())] = *a.b_simple();
    manual_b[static_cast<std::size_t>(c.rank())] = *b.b_simple();
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE(fused_b[static_cast<std::size_t>(r)] == fused_b[0]);
    REQUIRE(std::fabs(fused_b[static_cast<std::size_t>(r)] - manual_b[static_cast<std::size_t>(r)]) <=
            1e-6 * std::fabs(manual_b[0]));
  }
  gradapt::gradient_noise_scale g;
  REQUIRE_THROWS_WITH(g.update(gradapt::allreduce_norms{1.0, 1.0}, 1, {.micro_batch = 4}),
                      Catch::Matchers::Contains("ranks is 1"));
}

TEST_CASE("allreduce_with_norms: mismatched sizes and mixed calls throw on every rank", "[norms][errors]") {
  std::vector<int> threw(3, 0);
  run_threads(3, [&](gradapt::comm::threads& c) {
    std::vector<float> v(c.rank() == 1 ? 5 : 4, 1.0f);
    try {
      (void)c.allreduce_with_norms(host_view(v));
    } catch (const gradapt::error& e) {
      threw[static_cast<std::size_t>(c.rank())] =
          std::string(e.what()).find("every rank must pass the same size") != std::string::npos;
    }
    std::vector<float> u(4, 1.0f);
    try {
      if (c.rank() == 0)
        c.allreduce(host_view(u), gradapt::reduce_op::sum);
      else
        (void)c.allreduce_with_norms(host_view(u));
    } catch (const gradapt::error& e) {
      threw[static_cast<std::size_t>(c.rank())] +=
          std::string(e.what()).find("allreduce_with_norms") != std::string::npos;
    }
  });
  REQUIRE(threw == std::vector<int>{2, 2, 2});
}

#if defined(GRADAPT_HOST_VECTOR)
TEST_CASE("the fused fp32 sum-with-squares kernel: dispatched (AVX2 when present) and baseline bits agree",
          "[norms][determinism]") {
  for (int p : {1, 2, 3, 7}) {
    for (std::size_t n :
         {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{4096}, std::size_t{4103}}) {
      std::vector<std::vector<float>> src;
      std::vector<const float*> ptr;
      for (int k = 0; k < p; ++k) src.push_back(rank_data<float>(k, n));
      for (auto& v : src) ptr.push_back(v.data());
      std::vector<float> o1(n), o2(n);
      const auto a = gradapt::detail::host_impl::sum_with_squares(ptr.data(), p, o1.data(), n);
      const auto b = gradapt::detail::host_impl::sum_with_squares_lanes<gradapt::simd::native_bytes>(
          ptr.data(), p, o2.data(), n);
      REQUIRE(std::memcmp(&a, &b, sizeof a) == 0);
      REQUIRE((n == 0 || std::memcmp(o1.data(), o2.data(), n * sizeof(float)) == 0));
      long double l = 0, r = 0;
      for (std::size_t i = 0; i < n; ++i) {
        float s = 0;
        for (int k = 0; k < p; ++k) {
          s = k == 0 ? src[0][i] : s + src[static_cast<std::size_t>(k)][i];
          l += static_cast<long double>(src[static_cast<std::size_t>(k)][i]) *
               src[static_cast<std::size_t>(k)][i];
        }
        REQUIRE(o1[i] == s);
        r += static_cast<long double>(s) * s;
      }
      REQUIRE(std::fabs(a.first - l) <= 1e-13 * l);
      REQUIRE(std::fabs(a.second - r) <= 1e-13 * r);
    }
  }
}
#endif

}  // namespace gradapt_test_allreduce_with_norms

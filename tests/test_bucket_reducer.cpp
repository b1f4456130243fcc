// Gradients reduced through buckets, driven by mark_ready on comm::threads (1 to 5 ranks):
// bitwise the per-tensor allreduce and mean whatever the bucket caps and whatever order each
// rank marks its gradients in; buckets reduced in plan order; several rounds; every error.
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "scenarios/bucket_reducer.hpp"

namespace gradapt_test_bucket_reducer {

using gradapt::bucket::bucket_plan;
using gradapt::bucket::reducer;
using gradapt::bucket::tensor_info;
using gradapt::comm::threads;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(10)};

using bucket_scenarios::infos;
using bucket_scenarios::per_tensor_mean;
using bucket_scenarios::shuffled;
using bucket_scenarios::views_of;

/// Gradients of rank r at round k: sizes `sizes`, normal values scaled by 1 + t.
std::vector<std::vector<float>> grads_of(const std::vector<std::size_t>& sizes, int r, int k) {
  return bucket_scenarios::seeded_grads(
      sizes, r, k, std::normal_distribution<float>(0.0f, 1.0f),
      [](float x, std::size_t t) { return x * (1.0f + static_cast<float>(t)); });
}

/// Every rank's error message ("" when none), with the short watchdog.
template <class F>
std::vector<std::string> errors_of(int n, F&& body) {
  return gradapt_test::errors_of(n, quick, std::forward<F>(body));
}

}  // namespace

TEST_CASE("bucketed mean is bitwise the per-tensor allreduce and mean, any caps and ready orders",
          "[bucket][reducer]") {
  const std::vector<std::size_t> sizes{37, 1, 0, 300, 64, 5, 1000, 2, 129};
  for (int n = 1; n <= 5; ++n)
    for (const std::size_t cap :
         {std::size_t{4}, std::size_t{256}, std::size_t{1500}, std::size_t{1} << 20}) {
      gradapt::comm::run_threads(n, quick, [&](threads& comm) {
        const auto plan = bucket_plan::make(infos(sizes), {.cap_bytes = cap, .first_cap_bytes = cap / 2 + 1});
        auto g = grads_of(sizes, comm.rank(), 0);
        reducer<threads, float> red(comm, plan, views_of(g));
        for (int round = 0; round < 2; ++round) {
          // Fresh gradients into the reducer's buffers; each rank marks in its own order.
          std::vector<char> marked(sizes.size(), 0);
          const auto want = bucket_scenarios::mean_round(
              comm, red, g, grads_of(sizes, comm.rank(), round), round, [&](std::size_t t) {
                marked[t] = 1;
                // Buckets are reduced in plan order: exactly the leading complete ones.
                std::size_t lead = 0;
                while (lead < plan.buckets().size() &&
                       std::all_of(plan.buckets()[lead].tensors.begin(), plan.buckets()[lead].tensors.end(),
                                   [&](std::size_t u) { return marked[u] != 0; }))
                  ++lead;
                RANK_REQUIRE(red.reduced() == lead);
              });
          for (std::size_t t = 0; t < sizes.size(); ++t)
            RANK_REQUIRE(
                (g[t].empty() || std::memcmp(g[t].data(), want[t].data(), g[t].size() * sizeof(float)) == 0));
        }
      });
    }
}

TEST_CASE("gradients in a bucket::storage are reduced in place, bitwise as the copying path",
          "[bucket][reducer]") {
  const std::vector<std::size_t> sizes{37, 1, 0, 300, 64, 5, 1000, 2, 129};
  for (int n = 1; n <= 4; ++n)
    for (const std::size_t cap : {std::size_t{256}, std::size_t{1500}, std::size_t{1} << 20}) {
      gradapt::comm::run_threads(n, quick, [&](threads& comm) {
        const auto plan = bucket_plan::make(infos(sizes), {.cap_bytes = cap, .first_cap_bytes = cap / 2 + 1});
        gradapt::bucket::storage<float> store(plan);
        auto views = store.views();
        // Tensor 3 in a separate allocation: its bucket is packed and copied, the others not.
        std::vector<float> own(sizes[3]);
        views[3] = gradapt::host_view(own);
        reducer<threads, float> red(comm, plan, views);
        std::size_t fused = 0;
        for (std::size_t b = 0; b < plan.buckets().size(); ++b) {
          const auto& k = plan.buckets()[b];
          const bool has3 = std::find(k.tensors.begin(), k.tensors.end(), std::size_t{3}) != k.tensors.end();
          const bool copies = has3 && k.tensors.size() > 1;  // a bucket of one tensor is always in place
          RANK_REQUIRE(red.in_place(b) == !copies);
          if (copies) fused = k.elements;
        }
        RANK_REQUIRE(red.fused_elements() == fused);
        RANK_REQUIRE(store.elements() == std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}));
        for (int round = 0; round < 2; ++round) {
          const auto fresh = grads_of(sizes, comm.rank(), round);
          for (std::size_t t = 0; t < sizes.size(); ++t)
            std::copy(fresh[t].begin(), fresh[t].end(), views[t].data());
          const auto want = per_tensor_mean(comm, fresh);
          for (const std::size_t t : shuffled(sizes.size(), static_cast<unsigned>(comm.rank() * 7 + round)))
            red.mark_ready(t);
          red.wait();
          for (std::size_t t = 0; t < sizes.size(); ++t)
            RANK_REQUIRE((sizes[t] == 0 ||
                          std::memcmp(views[t].data(), want[t].data(), sizes[t] * sizeof(float)) == 0));
        }
      });
    }
  // A storage hands out views of its own element type only.
  const std::vector<tensor_info> mixed{{4, gradapt::dtype::float32}, {3, gradapt::dtype::float64}};
  const auto plan = bucket_plan::make(mixed);
  gradapt::bucket::storage<double> doubles(plan);
  CHECK(doubles.view(1).size() == 3);
  CHECK(doubles.elements() == 3);
  CHECK_THROWS_WITH(doubles.view(0), Catch::Matchers::Contains("tensor 0 is in a bucket of float32"));
  CHECK_THROWS_WITH(doubles.view(2), Catch::Matchers::Contains("out of range"));
}

TEST_CASE("reducer errors: marking twice or out of range, a missing gradient, plans that differ",
          "[bucket][reducer][validation]") {
  const std::vector<std::size_t> sizes{3, 4, 5};
  const auto plan = bucket_plan::make(infos(sizes), {.cap_bytes = 8, .first_cap_bytes = 8});
  auto what = errors_of(3, [&](threads& comm) {
    auto g = grads_of(sizes, comm.rank(), 0);
    reducer<threads, float> red(comm, plan, views_of(g));
    red.mark_ready(2);  // bucket 0 = {2}: reduced here
    red.mark_ready(2);
  });
  for (const auto& w : what) REQUIRE_THAT(w, Catch::Matchers::Contains("gradient 2 is already marked ready"));
  what = errors_of(2, [&](threads& comm) {
    auto g = grads_of(sizes, comm.rank(), 0);
    reducer<threads, float> red(comm, plan, views_of(g));
    red.mark_ready(3);
  });
  for (const auto& w : what)
    REQUIRE_THAT(w, Catch::Matchers::Contains("gradient 3 is out of range (3 gradients)"));
  what = errors_of(2, [&](threads& comm) {
    auto g = grads_of(sizes, comm.rank(), 0);
    reducer<threads, float> red(comm, plan, views_of(g));
    red.mark_ready(0);
    red.mark_ready(2);
    red.wait();
  });
  for (const auto& w : what) REQUIRE_THAT(w, Catch::Matchers::Contains("gradient 1 was not marked ready"));
  // Another cap on rank 1: another layout, an error on every rank before any bucket moves.
  what = errors_of(3, [&](threads& comm) {
    const auto mine = bucket_plan::make(
        infos(sizes),
        {.cap_bytes = comm.rank() == 1 ? std::size_t{100} : std::size_t{8}, .first_cap_bytes = 8});
    auto g = grads_of(sizes, comm.rank(), 0);
    reducer<threads, float> red(comm, mine, views_of(g));
  });
  for (const auto& w : what) REQUIRE_THAT(w, Catch::Matchers::Contains("bucket::reducer on rank"));
  for (const auto& w : what) REQUIRE_THAT(w, Catch::Matchers::Contains("across ranks"));
  // Gradients that do not fit the plan on rank 0: that rank names them, the others name the rank.
  what = errors_of(2, [&](threads& comm) {
    auto g = grads_of(comm.rank() == 0 ? std::vector<std::size_t>{3, 4, 6} : sizes, comm.rank(), 0);
    reducer<threads, float> red(comm, plan, views_of(g));
  });
  REQUIRE_THAT(what[0], Catch::Matchers::Contains("gradient 2 has 6 elements but the plan gives it 5"));
  REQUIRE_THAT(what[1], Catch::Matchers::Contains("rank 0 passed invalid input"));
}

}  // namespace gradapt_test_bucket_reducer

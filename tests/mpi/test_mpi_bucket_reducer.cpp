// Non-blocking allreduce of comm::mpi and the bucket reducer over MPI (1 to 5 ranks):
// iallreduce sums and maxes every element type exactly (several requests in flight, pieces,
// test() polling, empty buffers, without the agreement); a call that differs across ranks
// (size, type, op, or a blocking collective on another rank) throws on every rank and leaves
// the communicator working; the reducer's overlapping path gives exactly the per-tensor
// allreduce and mean (and the blocking path's bits) for integer-valued gradients whatever the
// caps and per-rank ready orders; the reducer's errors.
#include "catch.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/mpi.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/bucket_reducer.hpp"

namespace gradapt_test_mpi_bucket_reducer {

using namespace mpitest;
using gradapt::bucket::bucket_plan;
using gradapt::bucket::reducer;
using gradapt::bucket::reducer_options;
using gradapt::bucket::tensor_info;

namespace {

std::string prefix(int rank) {
  return "gradapt: comm::mpi iallreduce on rank " + std::to_string(rank) + ": ";
}

/// mpitest::still_works, then a non-blocking sum.
void still_works(mpi& c) {
  mpitest::still_works(c);
  std::vector<float> x{static_cast<float>(c.size()), static_cast<float>(2 * c.size())};
  auto r = c.iallreduce(view(x), reduce_op::sum);
  r.wait();
  CHECK(x[0] == static_cast<float>(c.size() * c.size()));
}

using bucket_scenarios::infos;
using bucket_scenarios::views_of;

/// Integer-valued gradients of rank r at round k (every partial sum is exact in float).
std::vector<std::vector<float>> int_grads(const std::vector<std::size_t>& sizes, int r, int k) {
  return bucket_scenarios::seeded_grads(sizes, r, k, std::uniform_int_distribution<int>(-64, 64),
                                        [](int x, std::size_t) { return static_cast<float>(x); });
}

}  // namespace

TEMPLATE_TEST_CASE("mpi iallreduce sums and maxes exactly, several requests in flight", "[mpi][iallreduce]",
                   float, double, half, bfloat16) {
  using T = TestType;
  for (const std::int64_t max_count : {std::int64_t{INT_MAX}, std::int64_t{7}})
    for (const bool checked : {true, false}) {
      mpi c(MPI_COMM_WORLD, mpi_options{.check_sizes = checked, .max_count = max_count});
      const int r = c.rank(), n = c.size();
      std::vector<T> a(50), b(13), e;
      for (std::size_t i = 0; i < a.size(); ++i)
        a[i] = make<T>(0.25 * static_cast<double>((r + 1) * (i % 7)));
      for (std::size_t i = 0; i < b.size(); ++i)
        b[i] = make<T>(static_cast<double>((r * 5 + static_cast<int>(i)) % 11));
      auto ra = c.iallreduce(view(a), reduce_op::sum);
      auto re = c.iallreduce(view(e), reduce_op::sum);
      auto rb = c.iallreduce(view(b), reduce_op::max);
      CHECK(ra.active());
      while (!rb.test()) c.progress();  // completes out of order: fine
      re.wait();
      ra.wait();
      CHECK_FALSE(ra.active());
      ra.wait();  // an empty request returns at once
      CHECK(ra.test());
      for (std::size_t i = 0; i < a.size(); ++i)
        CHECK(value(a[i]) == 0.25 * static_cast<double>(i % 7) * n * (n + 1) / 2);
      for (std::size_t i = 0; i < b.size(); ++i) {
        int m = 0;
        for (int q = 0; q < n; ++q) m = std::max(m, (q * 5 + static_cast<int>(i)) % 11);
        CHECK(value(b[i]) == static_cast<double>(m));
      }
    }
}

TEST_CASE("mpi iallreduce requests: moved, dropped in flight, interleaved with blocking calls",
          "[mpi][iallreduce]") {
  mpi c;
  const int n = c.size();
  std::vector<float> x(1000, 1.0f), y(3, 2.0f);
  {
    auto r = c.iallreduce(view(x), reduce_op::sum);
    mpi::request moved = std::move(r);
    CHECK_FALSE(r.active());
    std::vector<double> z{1.0};
    c.allreduce(view(z), reduce_op::sum);  // a blocking collective while x is in flight
    CHECK(z[0] == n);
    moved = c.iallreduce(view(y), reduce_op::sum);  // completes x's first
    CHECK(x[0] == static_cast<float>(n));
  }  // the destructor completes y's
  CHECK(y[2] == static_cast<float>(2 * n));
  still_works(c);
}

TEST_CASE("mpi iallreduce that differs across ranks throws on every rank at wait",
          "[mpi][iallreduce][errors]") {
  mpi c;
  const int r = c.rank();
  if (c.size() < 2) {
    std::vector<float> x(10, 1.0f);
    auto q = c.iallreduce(view(x), reduce_op::sum);
    CHECK(error_of([&] { q.wait(); }) == "no error");
    return;
  }
  const int o = r == 0 ? 1 : 0;
  {  // sizes
    std::vector<float> x(static_cast<std::size_t>(10 + r), 1.0f);
    auto q = c.iallreduce(view(x), reduce_op::sum);
    CHECK(error_of([&] { q.wait(); }) == prefix(r) + "this rank passes " + std::to_string(10 + r) +
                                             " elements but rank " + std::to_string(o) + " passes " +
                                             std::to_string(10 + o) +
                                             " elements (every rank must pass the same size)");
    CHECK(x[0] == 1.0f);  // no data moved
    CHECK_FALSE(q.active());
  }
  still_works(c);
  {  // ops, found by test()
    std::vector<float> x(4, 1.0f);
    auto q = c.iallreduce(view(x), r == 1 ? reduce_op::max : reduce_op::sum);
    const std::string what = error_of([&] {
      while (!q.test()) {
      }
    });
    CHECK_THAT(what, Catch::Matchers::Contains("every rank must pass the same reduction op"));
  }
  still_works(c);
  {  // element types
    std::vector<float> f(4, 1.0f);
    std::vector<double> d(4, 1.0);
    auto q = r == 0 ? c.iallreduce(view(d), reduce_op::sum) : c.iallreduce(view(f), reduce_op::sum);
    CHECK_THAT(error_of([&] { q.wait(); }),
               Catch::Matchers::Contains("every rank must pass the same element type"));
  }
  still_works(c);
  {  // a blocking allreduce on rank 0 against iallreduce elsewhere: an error on every rank
    std::vector<float> x(4, 1.0f);
    std::string what;
    if (r == 0) {
      what = error_of([&] { c.allreduce(view(x), reduce_op::sum); });
    } else {
      auto q = c.iallreduce(view(x), reduce_op::sum);
      what = error_of([&] { q.wait(); });
    }
    CHECK_THAT(what, Catch::Matchers::Contains("every rank must call the same collective in the same order"));
  }
  still_works(c);
  {  // a failed request dropped without wait, the next one works
    std::vector<float> x(static_cast<std::size_t>(3 + r), 1.0f), y(2, 1.0f);
    { auto q = c.iallreduce(view(x), reduce_op::sum); }
    auto q = c.iallreduce(view(y), reduce_op::sum);
    q.wait();
    CHECK(y[0] == static_cast<float>(c.size()));
  }
  still_works(c);
}

TEST_CASE("mpi reducer: exactly the per-tensor allreduce and mean, any caps and ready orders",
          "[mpi][bucket][reducer]") {
  mpi c;
  const std::vector<std::size_t> sizes{37, 1, 0, 300, 64, 5, 1000, 2, 129};
  for (const std::size_t cap : {std::size_t{4}, std::size_t{256}, std::size_t{1500}, std::size_t{1} << 20})
    for (const bool overlap : {true, false}) {
      const auto plan = bucket_plan::make(infos(sizes), {.cap_bytes = cap, .first_cap_bytes = cap / 2 + 1});
      auto g = int_grads(sizes, c.rank(), 0);
      reducer<mpi, float> red(c, plan, views_of(g), {.overlap = overlap});
      CHECK(red.overlap() == overlap);
      for (int round = 0; round < 3; ++round) {
        const auto want = bucket_scenarios::mean_round(c, red, g, int_grads(sizes, c.rank(), round), round,
                                                       [](std::size_t) {});
        for (std::size_t t = 0; t < sizes.size(); ++t) CHECK(same_bits(g[t], want[t]));
        CHECK(red.started() == 0);  // a new round
      }
    }
}

TEST_CASE("mpi reducer: bfloat16 gradients and sums without averaging", "[mpi][bucket][reducer]") {
  mpi c;
  const std::vector<std::size_t> sizes{10, 3, 40};
  const std::vector<tensor_info> layout{
      {10, gradapt::dtype::bfloat16}, {3, gradapt::dtype::bfloat16}, {40, gradapt::dtype::bfloat16}};
  const auto plan = bucket_plan::make(layout, {.cap_bytes = 30, .first_cap_bytes = 8});
  std::vector<std::vector<bfloat16>> g(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i)
      g[t].push_back(make<bfloat16>(static_cast<double>((i + t) % 5)));
  std::vector<gradapt::tensor_view<bfloat16>> v;
  for (auto& x : g) v.push_back(gradapt::host_view(x));
  reducer<mpi, bfloat16> red(c, plan, v, {.average = false});
  for (std::size_t t = 3; t-- > 0;) red.mark_ready(t);
  red.wait();
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i)
      CHECK(value(g[t][i]) == static_cast<double>(((i + t) % 5) * static_cast<std::size_t>(c.size())));
}

TEST_CASE("mpi reducer errors: marking twice or out of range, a missing gradient, plans that differ",
          "[mpi][bucket][reducer][errors]") {
  mpi c;
  const int r = c.rank();
  const std::vector<std::size_t> sizes{3, 4, 5};
  const auto plan = bucket_plan::make(infos(sizes), {.cap_bytes = 8, .first_cap_bytes = 8});
  {
    auto g = int_grads(sizes, r, 0);
    reducer<mpi, float> red(c, plan, views_of(g));
    red.mark_ready(2);  // bucket 0 = {2}: started here
    CHECK_THAT(error_of([&] { red.mark_ready(2); }),
               Catch::Matchers::Contains("gradient 2 is already marked ready"));
    CHECK_THAT(error_of([&] { red.mark_ready(3); }),
               Catch::Matchers::Contains("gradient 3 is out of range (3 gradients)"));
    red.mark_ready(0);
    CHECK(error_of([&] { red.wait(); }) ==
          "gradapt: bucket::reducer::wait on rank " + std::to_string(r) +
              ": gradient 1 was not marked ready in this round (mark every gradient before the step)");
    red.mark_ready(1);  // the round goes on
    red.wait();
  }  // (the destructor completes nothing: every bucket was waited)
  still_works(c);
  {  // another cap on rank 1: an error on every rank before any bucket moves
    const auto mine = bucket_plan::make(
        infos(sizes), {.cap_bytes = r == 1 ? std::size_t{100} : std::size_t{8}, .first_cap_bytes = 8});
    auto g = int_grads(sizes, r, 0);
    const std::string what = error_of([&] { reducer<mpi, float> red(c, mine, views_of(g)); });
    if (c.size() > 1) {
      CHECK_THAT(what, Catch::Matchers::Contains("bucket::reducer on rank"));
      CHECK_THAT(what, Catch::Matchers::Contains("across ranks"));
    } else {
      CHECK(what == "no error");
    }
  }
  {  // overlap on one rank only: an error on every rank
    auto g = int_grads(sizes, r, 0);
    const std::string what =
        error_of([&] { reducer<mpi, float> red(c, plan, views_of(g), {.overlap = r != 1}); });
    if (c.size() > 1) CHECK_THAT(what, Catch::Matchers::Contains("reducer_options::overlap"));
  }
  {  // gradients that do not fit the plan on rank 0: that rank names them, the others name the rank
    auto g = int_grads(r == 0 ? std::vector<std::size_t>{3, 4, 6} : sizes, r, 0);
    const std::string what = error_of([&] { reducer<mpi, float> red(c, plan, views_of(g)); });
    if (r == 0)
      CHECK_THAT(what, Catch::Matchers::Contains("gradient 2 has 6 elements but the plan gives it 5"));
    else
      CHECK_THAT(what, Catch::Matchers::Contains("rank 0 passed invalid input"));
  }
  still_works(c);
}

}  // namespace gradapt_test_mpi_bucket_reducer

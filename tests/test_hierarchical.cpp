// The hierarchical allreduce (comm::hierarchy) on comm::threads, 1 to 8 ranks: every group
// size that divides the world and simulated hosts (consecutive and interleaved); integer data
// bitwise equal to the flat allreduce; random data bitwise equal to an independent reference
// that adds in the documented order (local ranks in order within each group, then the groups
// in order), the same on every run and every rank; no allocation once the scratch has grown;
// every error on every rank.
#include "catch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "alloc_counter.hpp"
#include "exact_values.hpp"
#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/threads.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "scenarios/hierarchical.hpp"

namespace gradapt_test_hierarchical {

using gradapt::reduce_op;
using gradapt::comm::hierarchy;
using gradapt::comm::threads;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(20)};

/// Random input of rank r (n elements, seeded by r and n).
template <class T>
std::vector<T> random_input(int r, std::size_t n) {
  std::mt19937 rng(static_cast<unsigned>(7919 * r + n));
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& e : v) e = static_cast<T>(d(rng) * (1 + r));
  return v;
}

/// The documented order, computed here from every rank's input: group k's ranks members[k]
/// (in local-rank order) added left to right in the compute type and stored as T, then the
/// group results added left to right in group order and stored as T.
template <class T>
std::vector<T> ordered_sum(const std::vector<std::vector<int>>& members, std::size_t n) {
  using C = gradapt::compute_t<T>;
  static_assert(std::is_same_v<C, T>, "float and double only (their compute type is themselves)");
  std::vector<std::vector<T>> in;  // in[r]: rank r's input
  for (const auto& group : members)
    for (const int r : group) {
      if (in.size() <= static_cast<std::size_t>(r)) in.resize(static_cast<std::size_t>(r) + 1);
      in[static_cast<std::size_t>(r)] = random_input<T>(r, n);
    }
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    T total = 0;
    for (std::size_t k = 0; k < members.size(); ++k) {
      T node = 0;
      for (std::size_t j = 0; j < members[k].size(); ++j) {
        const T xi = in[static_cast<std::size_t>(members[k][j])][i];
        node = j == 0 ? xi : node + xi;
      }
      total = k == 0 ? node : total + node;
    }
    out[i] = total;
  }
  return out;
}

/// Group members for consecutive groups of g ranks.
std::vector<std::vector<int>> consecutive(int p, int g) {
  std::vector<std::vector<int>> m(static_cast<std::size_t>(p / g));
  for (int r = 0; r < p; ++r) m[static_cast<std::size_t>(r / g)].push_back(r);
  return m;
}

template <class F>
std::vector<std::string> errors_of(int n, F&& body) {
  return gradapt_test::errors_of(n, quick, std::forward<F>(body));
}

}  // namespace

TEMPLATE_TEST_CASE("hierarchical sum and max of integers equal the flat allreduce bit for bit",
                   "[hierarchical]", float, double, gradapt::half, gradapt::bfloat16) {
  for (int p = 1; p <= 8; ++p)
    for (int g = 1; g <= p; ++g) {
      if (p % g != 0) continue;
      gradapt::comm::run_threads(p, quick, [&](threads& comm) {
        hierarchy<threads> h(comm, {.group_size = g});
        hier_scenarios::check_shape(h, p / g);
        RANK_CHECK(h.node() == comm.rank() / g);
        RANK_CHECK(h.local_rank() == comm.rank() % g);
        RANK_CHECK(h.host().empty());
        hier_scenarios::matches_flat_exact<TestType>(comm, h);
      });
    }
}

TEMPLATE_TEST_CASE("hierarchical sum of random data adds in group order, bit for bit and run to run",
                   "[hierarchical]", float, double) {
  using T = TestType;
  for (int p = 1; p <= 8; ++p)
    for (int g = 1; g <= p; ++g) {
      if (p % g != 0) continue;
      const auto members = consecutive(p, g);
      for (const std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{1000}}) {
        const auto want = ordered_sum<T>(members, n);
        gradapt::comm::run_threads(p, quick, [&](threads& comm) {
          hierarchy<threads> h(comm, {.group_size = g});
          auto a = random_input<T>(comm.rank(), n), b = a;
          h.allreduce(gradapt::host_view(a), reduce_op::sum);
          h.allreduce(gradapt::host_view(b), reduce_op::sum);
          RANK_CHECK(exact::same_bits(a, want));
          RANK_CHECK(exact::same_bits(a, b));
          const bool everywhere = exact::identical_on_every_rank(comm, a);  // (a collective)
          RANK_CHECK(everywhere);
        });
      }
    }
}

TEST_CASE("hierarchical and flat sums of random floats differ in rounding (4 ranks, groups of 2)",
          "[hierarchical]") {
  // (x0 + x1) + (x2 + x3) against ((x0 + x1) + x2) + x3: the documented difference is real.
  gradapt::comm::run_threads(4, quick, [&](threads& comm) {
    hierarchy<threads> h(comm, {.group_size = 2});
    auto hier = random_input<float>(comm.rank(), 1000), flat = hier;
    h.allreduce(gradapt::host_view(hier), reduce_op::sum);
    comm.allreduce(gradapt::host_view(flat), reduce_op::sum);
    RANK_CHECK(!exact::same_bits(hier, flat));
    double worst = 0;
    for (std::size_t i = 0; i < hier.size(); ++i)
      worst = std::max(worst, std::abs(double(hier[i]) - double(flat[i])) / (1 + std::abs(double(flat[i]))));
    RANK_CHECK(worst < 1e-5);
  });
}

TEST_CASE("hierarchy groups ranks by host name: simulated hosts, consecutive and interleaved",
          "[hierarchical]") {
  SECTION("the real host: one node holding every rank") {
    gradapt::comm::run_threads(3, quick, [&](threads& comm) {
      hierarchy<threads> h(comm);
      hier_scenarios::check_shape(h, 1);
      RANK_CHECK(!h.host().empty());
      hier_scenarios::matches_flat_exact<float>(comm, h);
    });
  }
  SECTION("two hosts of three consecutive ranks") {
    gradapt::comm::run_threads(6, quick, [&](threads& comm) {
      hierarchy<threads> h(comm, {.host = comm.rank() < 3 ? "node-a" : "node-b"});
      hier_scenarios::check_shape(h, 2);
      RANK_CHECK(h.host() == (comm.rank() < 3 ? "node-a" : "node-b"));
      RANK_CHECK(h.node() == comm.rank() / 3);
      hier_scenarios::matches_flat_exact<double>(comm, h);
    });
  }
  SECTION("three hosts interleaved (rank r on host r mod 3), nodes numbered by lowest rank") {
    const std::vector<std::vector<int>> members{{0, 3}, {1, 4}, {2, 5}};
    const std::string names[] = {"zeta", "alpha", "mu"};  // numbering is by rank, not by name
    for (const std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{1000}}) {
      const auto want = ordered_sum<float>(members, n);
      gradapt::comm::run_threads(6, quick, [&](threads& comm) {
        hierarchy<threads> h(comm, {.host = names[comm.rank() % 3]});
        hier_scenarios::check_shape(h, 3);
        RANK_CHECK(h.node() == comm.rank() % 3);
        RANK_CHECK(h.local_rank() == comm.rank() / 3);
        auto a = random_input<float>(comm.rank(), n);
        h.allreduce(gradapt::host_view(a), reduce_op::sum);
        RANK_CHECK(exact::same_bits(a, want));
        hier_scenarios::matches_flat_exact<float>(comm, h);
      });
    }
  }
  SECTION("one rank per host") {
    gradapt::comm::run_threads(4, quick, [&](threads& comm) {
      hierarchy<threads> h(comm, {.host = "h" + std::to_string(comm.rank())});
      hier_scenarios::check_shape(h, 4);
      hier_scenarios::matches_flat_exact<float>(comm, h);
    });
  }
}

TEST_CASE("hierarchical allreduce of a rank-2 view reduces every element", "[hierarchical]") {
  gradapt::comm::run_threads(4, quick, [&](threads& comm) {
    hierarchy<threads> h(comm, {.group_size = 2});
    std::vector<double> x(15, 1.0 + comm.rank());
    h.allreduce(gradapt::tensor_view<double>(x.data(), {3, 5}), reduce_op::sum);
    for (const double v : x) RANK_CHECK(v == 10.0);
  });
}

TEST_CASE("repeated hierarchical allreduces allocate nothing once the scratch has grown", "[hierarchical]") {
  if (!alloc_counter::enabled) return;
  gradapt::comm::run_threads(4, quick, [&](threads& comm) {
    hierarchy<threads> h(comm, {.group_size = 2});
    std::vector<float> big(1001, 1.0f), small(37, 1.0f), even(1000, 1.0f);
    h.allreduce(gradapt::host_view(big), reduce_op::sum);  // the scratch grows here
    const auto before = alloc_counter::on_this_thread();
    for (int i = 0; i < 3; ++i) {
      h.allreduce(gradapt::host_view(big), reduce_op::sum);
      h.allreduce(gradapt::host_view(small), reduce_op::max);
      h.allreduce(gradapt::host_view(even), reduce_op::sum);
    }
    RANK_CHECK(alloc_counter::on_this_thread() == before);
  });
}

TEST_CASE("hierarchy errors are thrown on every rank with a message that says what to change",
          "[hierarchical][errors]") {
  for (int p = 1; p <= 5; ++p) {
    gradapt::comm::run_threads(p, quick,
                               [&](threads& comm) { hier_scenarios::indivisible_group_size(comm); });
    gradapt::comm::run_threads(p, quick,
                               [&](threads& comm) { hier_scenarios::disagreeing_group_size(comm); });
    gradapt::comm::run_threads(p, quick, [&](threads& comm) { hier_scenarios::unequal_hosts(comm); });
    gradapt::comm::run_threads(p, quick, [&](threads& comm) { hier_scenarios::disagreeing_counts(comm); });
  }
  SECTION("group size 4 in a world of 6 names the divisors") {
    const auto what = errors_of(6, [&](threads& comm) { hierarchy<threads> h(comm, {.group_size = 4}); });
    for (int r = 0; r < 6; ++r)
      REQUIRE(what[static_cast<std::size_t>(r)] == "gradapt: comm::hierarchy on rank " + std::to_string(r) +
                                                       ": hierarchy_options::group_size 4 does not divide "
                                                       "the world size 6 (expected one of 1, 2, 3, 6)");
  }
  SECTION("a negative group size on one rank: that rank names it, the others name that rank") {
    const auto what = errors_of(
        3, [&](threads& comm) { hierarchy<threads> h(comm, {.group_size = comm.rank() == 1 ? -2 : 1}); });
    REQUIRE(what[1] ==
            "gradapt: comm::hierarchy on rank 1: hierarchy_options::group_size is -2 (expected > 0, or 0 to "
            "group "
            "by host)");
    for (const int r : {0, 2})
      REQUIRE(what[static_cast<std::size_t>(r)] ==
              "gradapt: comm::hierarchy on rank " + std::to_string(r) +
                  ": rank 1 passed invalid input (that rank's error says which)");
  }
  SECTION("host and group size together") {
    const auto what =
        errors_of(2, [&](threads& comm) { hierarchy<threads> h(comm, {.group_size = 1, .host = "x"}); });
    for (const auto& w : what)
      REQUIRE_THAT(w, Catch::Matchers::Contains("hierarchy_options::host is \"x\" but group_size is 1"));
  }
  SECTION("a host name longer than 255 bytes") {
    const auto what = errors_of(2, [&](threads& comm) {
      hierarchy<threads> h(comm, {.host = std::string(comm.rank() == 0 ? 256 : 3, 'h')});
    });
    REQUIRE(what[0] == "gradapt: comm::hierarchy on rank 0: the host name has 256 bytes (at most 255)");
    REQUIRE_THAT(what[1], Catch::Matchers::Contains("rank 0 passed invalid input"));
  }
  SECTION("host names of 255 bytes are told apart by their last byte") {
    gradapt::comm::run_threads(4, quick, [&](threads& comm) {
      std::string name(255, 'h');
      name.back() = comm.rank() % 2 ? 'a' : 'b';
      hierarchy<threads> h(comm, {.host = name});
      hier_scenarios::check_shape(h, 2);
      RANK_CHECK(h.host() == name);
    });
  }
  SECTION("hosts of sizes 2, 1, 3") {
    const std::string hosts[] = {"a", "a", "b", "c", "c", "c"};
    const auto what =
        errors_of(6, [&](threads& comm) { hierarchy<threads> h(comm, {.host = hosts[comm.rank()]}); });
    for (const auto& w : what)
      REQUIRE_THAT(
          w, Catch::Matchers::Contains(
                 "the hosts hold different numbers of ranks (\"a\" 2 ranks, \"b\" 1 rank, \"c\" 3 ranks)"));
  }
  SECTION("different element types, ops, and an op that is neither sum nor max") {
    auto what = errors_of(4, [&](threads& comm) {
      hierarchy<threads> h(comm, {.group_size = 2});
      if (comm.rank() == 3) {
        std::vector<double> d(8);
        h.allreduce(gradapt::host_view(d), reduce_op::sum);
      } else {
        std::vector<float> f(8);
        h.allreduce(gradapt::host_view(f), reduce_op::sum);
      }
    });
    for (const auto& w : what)
      REQUIRE_THAT(
          w, Catch::Matchers::Contains("element type (0 float32, 1 float64, 2 float16, 3 bfloat16) is"));
    what = errors_of(4, [&](threads& comm) {
      hierarchy<threads> h(comm, {.group_size = 2});
      std::vector<float> f(8);
      h.allreduce(gradapt::host_view(f), comm.rank() == 0 ? reduce_op::max : reduce_op::sum);
    });
    for (const auto& w : what) REQUIRE_THAT(w, Catch::Matchers::Contains("reduce_op (0 sum, 1 max) is"));
    what = errors_of(2, [&](threads& comm) {
      hierarchy<threads> h(comm, {.group_size = 1});
      std::vector<float> f(8);
      h.allreduce(gradapt::host_view(f), comm.rank() == 0 ? static_cast<reduce_op>(7) : reduce_op::sum);
    });
    REQUIRE(what[0] == "gradapt: comm::hierarchy::allreduce on rank 0: reduce_op 7 is neither sum nor max");
    REQUIRE_THAT(what[1], Catch::Matchers::Contains("rank 0 passed invalid input"));
  }
  SECTION("without check_arguments an invalid op still throws on its rank") {
    gradapt::comm::run_threads(1, quick, [&](threads& comm) {
      hierarchy<threads> h(comm, {.group_size = 1, .check_arguments = false});
      std::vector<float> f(8);
      RANK_REQUIRE_THROWS_WITH(
          h.allreduce(gradapt::host_view(f), static_cast<reduce_op>(9)),
          Catch::Matchers::Equals(
              "gradapt: comm::hierarchy::allreduce on rank 0: reduce_op 9 is neither sum nor max"));
    });
  }
}

}  // namespace gradapt_test_hierarchical

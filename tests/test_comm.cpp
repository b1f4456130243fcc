// In-process communicators: comm::single and comm::threads with 1 to 8 ranks. Inputs are
// small integers or multiples of 1/4, so every sum is exact and checkable in closed form; the
// data scenarios are shared with the MPI tests (tests/support/scenarios/comm_ops.hpp).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/core/ops.hpp"
#include "rank_check.hpp"
#include "scenarios/collective_disagreement.hpp"
#include "scenarios/comm_ops.hpp"

namespace gradapt_test_comm {

using gradapt::host_view;
using gradapt::reduce_op;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using threads_comm = gradapt::comm::threads;

namespace {
using exact::make;
using exact::value;
template <class T>
tensor_view<const T> cview(const std::vector<T>& v) {
  return host_view(v);
}
}  // namespace

TEMPLATE_TEST_CASE("threads: allreduce, broadcast, allgather, reduce_scatter, exchange over 1 to 8 ranks",
                   "[comm][threads]", float, double, gradapt::half, gradapt::bfloat16) {
  for (int n = 1; n <= 8; ++n) {
    run_threads(n, [n](threads_comm& c) {
      RANK_REQUIRE(c.size() == n);
      comm_ops::allreduce_sum_max<TestType>(c);
      comm_ops::broadcast_every_root<TestType>(c);
      comm_ops::allgather_blocks<TestType>(c);
      comm_ops::reduce_scatter_blocks<TestType>(c);
      comm_ops::exchange_round_robin<TestType>(c, false);
    });
  }
}

TEMPLATE_TEST_CASE("threads: pairwise and changing-peer exchanges, barrier", "[comm][threads]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  for (int n = 1; n <= 8; ++n) {
    run_threads(n, [n](threads_comm& c) {
      const int r = c.rank();
      // Pairwise exchange: ranks 2k and 2k+1; the last rank of an odd world talks to itself.
      const int peer = (r ^ 1) < n ? (r ^ 1) : r;
      std::vector<TestType> out(4, make<TestType>(r)), in(4);
      c.exchange(peer, cview(out), host_view(in));
      for (auto& x : in) RANK_REQUIRE(value(x) == peer);
      // Several exchanges with changing peers in a row (a Adasum-like schedule).
      for (int dist = 1; dist < n; dist *= 2) {
        const int p = r ^ dist;
        if (p >= n) continue;
        c.exchange(p, cview(out), host_view(in));
        for (auto& x : in) RANK_REQUIRE(value(x) == p);
      }
      c.barrier();
    });
  }
}

TEST_CASE("threads: max propagates NaN and keeps infinities", "[comm][threads]") {
  run_threads(3, [](threads_comm& c) {
    std::vector<float> v{0.0f, 1.0f, 2.0f};
    if (c.rank() == 1) v[0] = std::numeric_limits<float>::quiet_NaN();
    if (c.rank() == 2) v[1] = std::numeric_limits<float>::infinity();
    c.allreduce(host_view(v), reduce_op::max);
    RANK_REQUIRE(std::isnan(v[0]));
    RANK_REQUIRE(std::isinf(v[1]));
    RANK_REQUIRE(v[2] == 2.0f);
  });
}

TEST_CASE("threads: split into subgroups ordered by key", "[comm][threads]") {
  for (int n = 1; n <= 7; ++n) {
    run_threads(n, [n](threads_comm& c) {
      const int r = c.rank();
      auto sub = c.split(r % 2, -r);  // reverse order inside each colour
      const int group = (n - r % 2 + 1) / 2;
      RANK_REQUIRE(sub.size() == group);
      std::vector<double> ids(std::size_t(sub.size()));
      std::vector<double> me{double(r)};
      sub.allgather(cview(me), host_view(ids));
      for (int k = 0; k + 1 < sub.size(); ++k) RANK_REQUIRE(ids[std::size_t(k)] > ids[std::size_t(k) + 1]);
      for (double id : ids) RANK_REQUIRE(int(id) % 2 == r % 2);
      std::vector<double> s{1.0};
      sub.allreduce(host_view(s), reduce_op::sum);
      RANK_REQUIRE(s[0] == group);
      auto nested = sub.split(0, 0);  // splits nest
      RANK_REQUIRE(nested.size() == sub.size());
      nested.barrier();
    });
  }
}

TEST_CASE("threads: errors name the operation, the ranks and both sizes", "[comm][threads][errors]") {
  RANK_REQUIRE_THROWS_WITH(run_threads(3,
                                       [](threads_comm& c) {
                                         std::vector<float> v(10 + std::size_t(c.rank() == 2 ? 2 : 0));
                                         c.allreduce(host_view(v), reduce_op::sum);
                                       }),
                           Catch::Matchers::Contains("allreduce") &&
                               Catch::Matchers::Contains("passes 12 elements") &&
                               Catch::Matchers::Contains("passes 10 elements") &&
                               Catch::Matchers::Contains("every rank must pass the same size"));
  // Every rank sees the same verdict and the world stays usable afterwards.
  run_threads(4, [](threads_comm& c) {
    std::vector<float> v(4 + std::size_t(c.rank() % 2));
    RANK_REQUIRE_THROWS_WITH(c.allreduce(host_view(v), reduce_op::sum),
                             Catch::Matchers::Contains("must pass the same size"));
    std::vector<double> ok(3, 1.0);
    c.allreduce(host_view(ok), reduce_op::sum);
    RANK_REQUIRE(ok[0] == 4.0);
  });
  run_threads(2, [](threads_comm& c) {
    std::vector<float> v(4);
    std::vector<double> d(4);
    if (c.rank() == 0)
      RANK_REQUIRE_THROWS_WITH(c.broadcast(host_view(v), 0), Catch::Matchers::Contains("called"));
    else
      RANK_REQUIRE_THROWS_WITH(c.allreduce(host_view(v), reduce_op::sum),
                               Catch::Matchers::Contains("must call the same collective"));
    if (c.rank() == 0)
      RANK_REQUIRE_THROWS_WITH(c.allreduce(host_view(v), reduce_op::sum),
                               Catch::Matchers::Contains("float32"));
    else
      RANK_REQUIRE_THROWS_WITH(c.allreduce(host_view(d), reduce_op::sum),
                               Catch::Matchers::Contains("float64"));
    RANK_REQUIRE_THROWS_WITH(c.broadcast(host_view(v), 2),
                             Catch::Matchers::Contains("root 2 is out of range"));
    RANK_REQUIRE_THROWS_WITH(c.exchange(-1, cview(v), host_view(v)),
                             Catch::Matchers::Contains("peer -1 is out of range"));
    std::vector<float> small(3);
    RANK_REQUIRE_THROWS_WITH(
        c.allgather(cview(small), host_view(v)),
        Catch::Matchers::Contains("recv has 4 elements but must have size() * send.size() = 2 * 3 = 6"));
    RANK_REQUIRE_THROWS_WITH(c.allgather(tensor_view<const float>::vector(v.data() + 1, 2), host_view(v)),
                             Catch::Matchers::Contains("overlap"));
    RANK_REQUIRE_THROWS_WITH(c.split(-1, 0), Catch::Matchers::Contains("color -1"));
  });
}

TEST_CASE("threads: allgather in place (send is this rank's block of recv)", "[comm][threads]") {
  run_threads(3, [](threads_comm& c) {
    std::vector<double> all(6, -1.0);
    const auto own = static_cast<std::size_t>(2 * c.rank());
    all[own] = c.rank();
    all[own + 1] = 10.0 * c.rank();
    c.allgather(tensor_view<const double>::vector(all.data() + own, 2), host_view(all));
    RANK_REQUIRE(all == std::vector<double>{0, 0, 1, 10, 2, 20});
  });
}

TEST_CASE("threads: ranks that disagree all throw, naming what differs", "[comm][threads][errors]") {
  // Every rank must end in gradapt::error (not a crash, not a hang) and the world stays usable.
  for (int n : {2, 3, 5})
    for (const auto& c : collective_scenario::cases<threads_comm>()) {
      INFO(n << " ranks: " << c.what);
      std::vector<int> threw(static_cast<std::size_t>(n), 0);
      run_threads(n, [&](threads_comm& comm) {
        try {
          c.body(comm);
        } catch (const gradapt::error& e) {
          threw[static_cast<std::size_t>(comm.rank())] =
              std::string(e.what()).find(c.expected(comm.rank())) != std::string::npos;
        }
        std::vector<double> ok(2, 1.0);
        comm.allreduce(host_view(ok), reduce_op::sum);
        RANK_REQUIRE(ok[1] == n);
      });
      REQUIRE(threw == std::vector<int>(static_cast<std::size_t>(n), 1));
    }
}

TEST_CASE("threads: the watchdog turns a rank that never arrives into an error on every waiting rank",
          "[comm][threads][errors][watchdog]") {
  const gradapt::comm::threads_options quick{.timeout = std::chrono::milliseconds(100)};
  // Rank 0 returns while the others wait in an allreduce: they throw, naming rank 0.
  std::vector<std::string> what(3);
  run_threads(3, quick, [&](threads_comm& c) {
    if (c.rank() == 0) return;
    std::vector<float> v(4, 1.0f);
    try {
      c.allreduce(host_view(v), reduce_op::sum);
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  REQUIRE(what[0].empty());
  for (int r : {1, 2})
    REQUIRE_THAT(what[static_cast<std::size_t>(r)],
                 Catch::Matchers::Contains("comm::threads allreduce on rank ") &&
                     Catch::Matchers::Contains("rank(s) 0 did not arrive within 0.1 s"));
  // Exchange against a collective: the collective side names the exchanging rank, the
  // exchanging side names its silent peer; nobody hangs.
  std::vector<std::string> w2(2);
  run_threads(2, quick, [&](threads_comm& c) {
    std::vector<float> a(2), b(2);
    try {
      if (c.rank() == 0)
        c.exchange(1, cview(a), host_view(b));
      else
        c.barrier();
    } catch (const gradapt::error& e) {
      w2[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  REQUIRE_THAT(w2[0] + w2[1], Catch::Matchers::Contains("within 0.1 s"));
  REQUIRE(!w2[0].empty());
  REQUIRE(!w2[1].empty());
  REQUIRE(w2[0].find("gradapt: gradapt:") == std::string::npos);
  REQUIRE(w2[1].find("gradapt: gradapt:") == std::string::npos);
  REQUIRE_THROWS_WITH(gradapt::comm::threads::create(2, {.timeout = std::chrono::milliseconds(0)}),
                      Catch::Matchers::Contains("timeout is 0 ms (expected > 0)"));
}

TEST_CASE("threads: exchange with invalid or unequal arguments throws on both sides",
          "[comm][threads][errors]") {
  std::vector<std::string> what(4);
  run_threads(2, [&](threads_comm& c) {
    std::vector<float> send(c.rank() == 0 ? 6 : 4), recv(4);
    try {
      c.exchange(1 - c.rank(), cview(send), host_view(recv));
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(c.rank())] = e.what();
    }
    std::vector<double> a(3, c.rank()), b(3, -1.0), d(4), e4(4);
    try {  // unequal sizes with valid local arguments: both sides name both sizes
      if (c.rank() == 0)
        c.exchange(1, cview(a), host_view(b));
      else
        c.exchange(0, cview(d), host_view(e4));
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(2 + c.rank())] = e.what();
    }
    c.exchange(1 - c.rank(), cview(a), host_view(b));  // the world still works
    RANK_REQUIRE(b[0] == 1 - c.rank());
  });
  REQUIRE(what[0] ==
          "gradapt: comm::threads exchange on rank 0: send has 6 elements but recv has 4 (exchange "
          "needs equal sizes)");
  REQUIRE(what[1] ==
          "gradapt: comm::threads exchange on rank 1: peer rank 0 passed invalid arguments (it "
          "throws the reason)");
  REQUIRE(what[2] ==
          "gradapt: comm::threads exchange on rank 0: send has 3 elements but peer rank 1 has 4 (both "
          "sides must exchange the same size)");
  REQUIRE(what[3] ==
          "gradapt: comm::threads exchange on rank 1: send has 4 elements but peer rank 0 has 3 (both "
          "sides must exchange the same size)");
}

TEST_CASE("threads: a rank that throws releases its peers", "[comm][threads][errors]") {
  std::atomic<int> released{0};
  RANK_REQUIRE_THROWS_WITH(
      run_threads(4,
                  [&](threads_comm& c) {
                    if (c.rank() == 2) throw std::runtime_error("model diverged on rank 2");
                    try {
                      c.barrier();
                    } catch (const gradapt::error& e) {
                      RANK_REQUIRE(std::string(e.what()).find("rank 2 failed: model diverged") !=
                                   std::string::npos);
                      ++released;
                      throw;
                    }
                  }),
      Catch::Matchers::Equals("model diverged on rank 2"));
  RANK_REQUIRE(released == 3);
  RANK_REQUIRE_THROWS_WITH(threads_comm::create(0), Catch::Matchers::Contains("0 ranks requested"));
}

TEST_CASE("threads: results are identical from run to run", "[comm][threads][determinism]") {
  // Non-exact float sums: the rank order is fixed, so the bits are too.
  std::vector<std::vector<float>> runs;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<float> out;
    run_threads(5, [&](threads_comm& c) {
      std::vector<float> v(1000);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 1.0f / float(i + 1 + std::size_t(c.rank()) * 3);
      c.allreduce(host_view(v), reduce_op::sum);
      if (c.rank() == 4) out = v;
    });
    runs.push_back(out);
  }
  RANK_REQUIRE(runs[0] == runs[1]);
  RANK_REQUIRE(runs[1] == runs[2]);
  // And equal to the rank-order sum computed here.
  for (std::size_t i = 0; i < 1000; ++i) {
    float acc = 1.0f / float(i + 1);
    for (int k = 1; k < 5; ++k) acc += 1.0f / float(i + 1 + std::size_t(k) * 3);
    RANK_REQUIRE(runs[0][i] == acc);
  }
}

TEST_CASE("threads: empty buffers are valid everywhere", "[comm][threads]") {
  for (int n : {1, 2, 3}) {
    run_threads(n, [](threads_comm& c) {
      std::vector<float> none, none2;
      c.allreduce(host_view(none), reduce_op::sum);
      c.broadcast(host_view(none), 0);
      c.allgather(cview(none), host_view(none2));
      c.reduce_scatter(cview(none), host_view(none2), reduce_op::max);
      const int peer = (c.rank() ^ 1) < c.size() ? (c.rank() ^ 1) : c.rank();
      c.exchange(peer, cview(none), host_view(none2));
      RANK_REQUIRE(none.empty());
    });
  }
}

TEST_CASE("single: a world of one", "[comm][single]") {
  gradapt::comm::single c;
  RANK_REQUIRE(c.rank() == 0);
  RANK_REQUIRE(c.size() == 1);
  std::vector<float> v{1, 2, 3}, w(3);
  c.allreduce(host_view(v), reduce_op::sum);
  RANK_REQUIRE(v == std::vector<float>{1, 2, 3});
  c.allgather(cview(v), host_view(w));
  RANK_REQUIRE(w == v);
  c.exchange(0, cview(v), host_view(w));
  c.reduce_scatter(cview(v), host_view(w), reduce_op::max);
  RANK_REQUIRE(w == v);
  c.broadcast(host_view(v), 0);
  c.barrier();
  RANK_REQUIRE(c.split(3, 1).size() == 1);
  std::vector<float> w2(2);
  RANK_REQUIRE_THROWS_WITH(c.broadcast(host_view(v), 1), Catch::Matchers::Contains("root 1 is out of range"));
  RANK_REQUIRE_THROWS_WITH(c.allgather(cview(v), host_view(w2)),
                           Catch::Matchers::Contains("receive buffer has 2 elements"));
  REQUIRE_THROWS_AS(c.exchange(1, cview(v), host_view(w)), gradapt::error);
  REQUIRE_THROWS_AS(c.split(-2, 0), gradapt::error);
}

TEMPLATE_TEST_CASE("threads: allreduce_mean has the bits of the sum followed by divide_by_ranks",
                   "[comm][threads][mean]", float, double, gradapt::half, gradapt::bfloat16) {
  static_assert(gradapt::mean_allreduce_communicator<threads_comm>);
  static_assert(!gradapt::mean_allreduce_communicator<gradapt::comm::single>);
  // Values that round in the sum and in the division (random magnitudes over several binades,
  // signs mixed), sizes around the 8-element groups and the slices' edges, 1 to 6 ranks.
  for (int n = 1; n <= 6; ++n)
    for (const std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                                   std::size_t{9}, std::size_t{61}, std::size_t{4099}}) {
      INFO(n << " ranks, " << size << " elements");
      run_threads(n, [&](threads_comm& c) {
        std::mt19937 rng(static_cast<unsigned>(1000 * c.rank() + size));
        std::uniform_real_distribution<double> mag(-4.0, 4.0);
        std::vector<TestType> x(size);
        for (auto& v : x) v = static_cast<TestType>((rng() % 2 ? 1.0 : -1.0) * std::exp2(mag(rng)) / 3.0);
        auto want = x;
        c.allreduce(host_view(want), reduce_op::sum);
        gradapt::host{.threads = 1}.apply(gradapt::detail::divide_by_ranks{n}, host_view(want));
        auto got = x;
        c.allreduce_mean(host_view(got));
        std::size_t differ = 0;
        for (std::size_t i = 0; i < size; ++i)
          differ += std::memcmp(&got[i], &want[i], sizeof(TestType)) != 0 ? 1 : 0;
        RANK_REQUIRE(differ == 0);
      });
    }
  // The mean is not the sum: with 3 ranks of ones it is exactly 1.
  run_threads(3, [](threads_comm& c) {
    std::vector<TestType> ones(9, static_cast<TestType>(1.0));
    c.allreduce_mean(host_view(ones));
    for (const auto v : ones) RANK_REQUIRE(static_cast<double>(gradapt::load(v)) == 1.0);
  });
}

TEST_CASE("threads: allreduce_mean on some ranks and allreduce on others is an error on every rank",
          "[comm][threads][mean][errors]") {
  for (const int n : {2, 3}) {
    std::vector<std::string> what(static_cast<std::size_t>(n));
    run_threads(n, [&](threads_comm& c) {
      std::vector<float> x(16, 1.0f);
      try {
        if (c.rank() == n - 1)
          c.allreduce(host_view(x), reduce_op::sum);
        else
          c.allreduce_mean(host_view(x));
      } catch (const gradapt::error& e) {
        what[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    for (const auto& w : what) {
      INFO(w);
      REQUIRE(w.find("allreduce_mean") != std::string::npos);
      REQUIRE(w.find("allreduce") != std::string::npos);
    }
  }
}

}  // namespace gradapt_test_comm

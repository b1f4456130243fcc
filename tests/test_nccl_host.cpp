// gradapt::comm::nccl's own code on 1 to 4 host threads, through a host stand-in for the NCCL and
// CUDA runtime calls it makes (tests/support/fake_nccl: "device" memory is host memory, each
// collective a rendezvous of the rank threads). What runs here is the communicator's argument
// checks, its agreement on each collective's fingerprint (on by default), its group, split and
// barrier logic and its error paths; the data movement is the stand-in's. On a GPU the same
// header runs against the real libraries in tests/nccl/test_nccl.cpp (one rank) and
// tests/cuda/test_cuda_shard.cu / test_cuda_train_step.cu.
//
// - Every collective gives what its contract says, on 1 to 4 ranks, and on a split.
// - With the default options, ranks that call a collective with another count, another
//   collective, another root or another reduction all throw, naming the collective and the
//   range across ranks, and the mismatched call never reaches the engine (the stand-in counts
//   mismatched rendezvous). With check_sizes off the same mismatch reaches it.
// - The composed step (train::data_parallel_step) over this comm::nccl and the device-tagged
//   host backend equals the host step bit for bit: loss scaler, zero_state<2>, replicated
//   state with LocalSGD, and hierarchical_reduce (comm::hierarchy over ncclCommSplit), through
//   a checkpoint.
// - With nccl_options::producer (the framework's backward stream), collectives, the bucket
//   reducer's packing and the composed step order the communicator's stream after the producer
//   and the producer after them by events (the stand-in logs the records and waits).
#include "catch.hpp"

#include <nccl.h>  // tests/support/fake_nccl: first on this test's include path

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/nccl.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "host_as_device.hpp"
#include "rank_check.hpp"
#include "scenarios/sharded.hpp"
#include "scenarios/train_combinations.hpp"

namespace gradapt_test_nccl_host {

using Catch::Matchers::Contains;
using gradapt::device_space;
using gradapt::reduce_op;
using gradapt::tensor_view;
using gradapt::comm::nccl;
using gradapt::comm::nccl_options;
namespace train = gradapt::train;

namespace {

template <class T>
tensor_view<T, device_space> dev(std::vector<T>& v) {
  return tensor_view<T, device_space>::vector(v.data(), static_cast<std::int64_t>(v.size()));
}

/// Runs body(rank's comm::nccl, threads comm of the same world) on n host threads; returns each
/// rank's gradapt::error message ("" when it did not throw). The threads communicator only
/// carries the test's own checks and comparisons.
template <class F>
std::vector<std::string> on_ranks(int n, const nccl_options& o, F&& body) {
  auto handles = fake_nccl::world(n);
  std::vector<std::string> what(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, {.timeout = std::chrono::seconds(60)}, [&](gradapt::comm::threads& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    try {
      nccl c(handles[r], nullptr, o);
      body(c, t);
    } catch (const gradapt::error& e) {
      what[r] = e.what();
    }
  });
  for (auto* h : handles) ncclCommDestroy(h);
  return what;
}

bool none(const std::vector<std::string>& what) {
  for (const auto& w : what)
    if (!w.empty()) return false;
  return true;
}

}  // namespace

TEST_CASE("comm::nccl over the host stand-in: every operation, 1 to 4 ranks", "[comm][nccl]") {
  for (const int n : {1, 2, 3, 4}) {
    INFO(n << " ranks");
    const auto what = on_ranks(n, {}, [&](nccl& c, gradapt::comm::threads&) {
      const int r = c.rank();
      RANK_REQUIRE(c.size() == n);
      std::vector<float> a{1.0f + float(r), -2.0f * float(r), 0.5f};
      c.allreduce(dev(a), reduce_op::sum);
      const float s = float(n * (n - 1)) / 2.0f;
      RANK_REQUIRE((a == std::vector<float>{float(n) + s, -2.0f * s, 0.5f * float(n)}));
      std::vector<double> m{double(r), -double(r)};
      c.allreduce(dev(m), reduce_op::max);
      RANK_REQUIRE((m == std::vector<double>{double(n - 1), 0.0}));
      std::vector<float> b(3, float(r));
      c.broadcast(dev(b), n - 1);
      RANK_REQUIRE((b == std::vector<float>(3, float(n - 1))));
      std::vector<float> mine{float(r), float(10 * r)}, all(2 * static_cast<std::size_t>(n));
      c.allgather(tensor_view<const float, device_space>::vector(mine.data(), 2), dev(all));
      for (int q = 0; q < n; ++q) RANK_REQUIRE((all[2 * q] == float(q) && all[2 * q + 1] == float(10 * q)));
      std::vector<float> send(2 * static_cast<std::size_t>(n), 1.0f), recv(2);
      c.reduce_scatter(tensor_view<const float, device_space>::vector(send.data(), 2 * n), dev(recv),
                       reduce_op::sum);
      RANK_REQUIRE((recv == std::vector<float>(2, float(n))));
      std::vector<float> out{float(r)}, in{-1.0f};
      const int peer = r ^ 1;
      if (peer < n) {
        c.exchange(peer, tensor_view<const float, device_space>::vector(out.data(), 1), dev(in));
        RANK_REQUIRE(in[0] == float(peer));
      }
      nccl half = c.split(r % 2, -r);  // two colors, keys in reverse rank order
      RANK_REQUIRE(half.size() == (n - r % 2 + 1) / 2);
      std::vector<double> one{1.0};
      half.allreduce(dev(one), reduce_op::sum);
      RANK_REQUIRE(one[0] == double(half.size()));
      c.barrier();
    });
    CHECK(none(what));
  }
}

TEST_CASE("comm::nccl over the host stand-in: a mismatch is an error on every rank by default",
          "[comm][nccl]") {
  const int before = fake_nccl::unmatched.load();
  SECTION("another count") {
    const auto what = on_ranks(3, {}, [](nccl& c, gradapt::comm::threads&) {
      std::vector<float> v(c.rank() == 1 ? 5 : 4, 1.0f);
      c.allreduce(dev(v), reduce_op::sum);
    });
    for (const auto& w : what) {
      CHECK_THAT(w, Contains("comm::nccl"));
      CHECK_THAT(w, Contains("allreduce"));
      CHECK_THAT(w, Contains("4") && Contains("5"));
    }
  }
  SECTION("another collective") {
    const auto what = on_ranks(3, {}, [](nccl& c, gradapt::comm::threads&) {
      std::vector<float> v(4, 1.0f);
      if (c.rank() == 2)
        c.broadcast(dev(v), 0);
      else
        c.allreduce(dev(v), reduce_op::sum);
    });
    for (const auto& w : what) {
      CHECK_THAT(w, Contains("comm::nccl"));
      CHECK_THAT(w, Contains("broadcast") || Contains("collective"));
    }
  }
  SECTION("another root, another reduction, an invalid root on one rank") {
    const auto roots = on_ranks(2, {}, [](nccl& c, gradapt::comm::threads&) {
      std::vector<double> v(3, 1.0);
      c.broadcast(dev(v), c.rank());
    });
    for (const auto& w : roots) CHECK_THAT(w, Contains("root"));
    const auto ops = on_ranks(2, {}, [](nccl& c, gradapt::comm::threads&) {
      std::vector<double> v(3, 1.0);
      c.allreduce(dev(v), c.rank() == 0 ? reduce_op::sum : reduce_op::max);
    });
    for (const auto& w : ops) CHECK_THAT(w, Contains("allreduce"));
    const auto bad = on_ranks(3, {}, [](nccl& c, gradapt::comm::threads&) {
      std::vector<double> v(3, 1.0);
      c.broadcast(dev(v), c.rank() == 1 ? 7 : 0);
    });
    CHECK_THAT(bad[1], Contains("root"));
    CHECK_THAT(bad[0], Contains("rank 1"));
    CHECK_THAT(bad[2], Contains("rank 1"));
  }
  CHECK(fake_nccl::unmatched.load() == before);  // no mismatched call reached the engine
}

TEST_CASE("comm::nccl over the host stand-in: with check_sizes off the mismatch reaches NCCL",
          "[comm][nccl]") {
  const int before = fake_nccl::unmatched.load();
  const auto what = on_ranks(2, {.check_sizes = false}, [](nccl& c, gradapt::comm::threads&) {
    std::vector<float> v(c.rank() == 1 ? 5 : 4, 1.0f);
    c.allreduce(dev(v), reduce_op::sum);
  });
  CHECK(fake_nccl::unmatched.load() == before + 1);
  for (const auto& w : what) CHECK_THAT(w, Contains("ncclAllReduce failed"));
}

namespace {

using sharded_scenario::model;
namespace scenario = train_combinations_scenario;

/// 12 steps of the composed step on `c` (saved after step 6, loaded into a fresh step).
template <class Comm, class B, class PL, class Make>
void twelve_steps(Comm& c, const B& b, model<float>& m, const PL& params, Make&& make) {
  std::vector<std::byte> saved;
  {
    auto s = make(c, b, params, 1e-2);
    for (int k = 1; k <= 6; ++k) scenario::one_step(s, m, c, k);
    saved = s.save();
  }
  auto s = make(c, b, params, 0.5);
  s.load(saved);
  for (int k = 7; k <= 12; ++k) scenario::one_step(s, m, c, k);
}

/// With `o.producer` set, the device run's last step must end with the producer waiting for
/// the communicator's stream (the stand-in's event log of this rank's thread).
template <class Make>
void step_matches_host(int n, Make&& make, const nccl_options& o = {}) {
  const auto what = on_ranks(n, o, [&](nccl& c, gradapt::comm::threads& t) {
    const gradapt::host hb{.threads = 1};
    const host_as_device::backend db;
    model<float> h, d;
    const auto dparams = host_as_device::on_device(d.params);
    twelve_steps(t, hb, h, h.params, make);
    fake_cuda_event_log().clear();
    twelve_steps(c, db, d, dparams, make);
    for (std::size_t i = 0; i < h.p.size(); ++i) RANK_REQUIRE(sharded_scenario::same_bits(h.p[i], d.p[i]));
    const auto& log = fake_cuda_event_log();
    if (o.producer) {
      RANK_REQUIRE(log.size() >= 2);
      RANK_REQUIRE((log[log.size() - 2].what == "record" && log[log.size() - 2].stream == c.stream()));
      RANK_REQUIRE((log.back().what == "wait" && log.back().stream == *o.producer));
    } else {
      RANK_REQUIRE(log.empty());
    }
  });
  CHECK(none(what));
}

}  // namespace

TEST_CASE("the composed step over comm::nccl (host stand-in) equals the host step", "[train][nccl]") {
  for (const int n : {1, 2, 3}) {
    INFO(n << " ranks");
    step_matches_host(n, [](auto& c, const auto& b, const auto& params, double lr) {
      return train::make_data_parallel_step(c, b, params, scenario::sgd, {.lr = lr, .local_batch = 8},
                                            gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}),
                                            scenario::z2);
    });
    step_matches_host(n, [](auto& c, const auto& b, const auto& params, double lr) {
      return train::make_data_parallel_step(
          c, b, params, scenario::adamw, {.lr = lr, .local_batch = 8},
          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}),
          train::local_sgd_policy{{.start_step = 4}, gradapt::fixed_period({.period = 3})});
    });
  }
  for (const int n : {2, 4}) {  // comm::hierarchy over ncclCommSplit: groups of two
    INFO(n << " ranks, hierarchical_reduce in groups of two");
    step_matches_host(n, [](auto& c, const auto& b, const auto& params, double lr) {
      return train::make_data_parallel_step(c, b, params, scenario::adamw, {.lr = lr, .local_batch = 8},
                                            gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}),
                                            train::hierarchical_reduce{.hierarchy = {.group_size = 2}});
    });
  }
}

TEST_CASE(
    "comm::nccl over the host stand-in: an enqueued collective that never finishes is caught by the "
    "next operation's watched wait",
    "[comm][nccl]") {
  // Every rank enqueues an allreduce that (as far as the host can tell) never completes on its
  // stream: the next operation's argument check polls the stream for nccl_options::timeout,
  // aborts the communicator and throws on every rank, naming the operation; the aborted
  // communicator refuses later calls.
  const auto what = on_ranks(2, {.timeout = 0.2}, [](nccl& c, gradapt::comm::threads&) {
    std::vector<float> v{1.0f};
    c.allreduce(dev(v), reduce_op::sum);
    fake_cuda_stream_stuck() = true;
    const auto started = std::chrono::steady_clock::now();
    std::string watchdog;
    try {
      c.allreduce(dev(v), reduce_op::sum);
    } catch (const gradapt::error& e) {
      watchdog = e.what();
    }
    fake_cuda_stream_stuck() = false;
    RANK_REQUIRE(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() >= 0.2);
    RANK_REQUIRE(watchdog.find("allreduce") != std::string::npos);
    RANK_REQUIRE(watchdog.find("nccl_options::timeout") != std::string::npos);
    RANK_REQUIRE(watchdog.find("ncclCommAbort") != std::string::npos);
    c.allreduce(dev(v), reduce_op::sum);  // the aborted communicator: throws
  });
  for (const auto& w : what) CHECK_THAT(w, Contains("allreduce"));
  // The same for barrier, which waits for the stream itself.
  const auto barrier = on_ranks(1, {.timeout = 0.2}, [](nccl& c, gradapt::comm::threads&) {
    std::vector<float> v{1.0f};
    c.allreduce(dev(v), reduce_op::sum);
    fake_cuda_stream_stuck() = true;
    c.barrier();
  });
  CHECK_THAT(barrier[0], Contains("barrier") && Contains("nccl_options::timeout") && Contains("aborted"));
}

TEST_CASE("comm::nccl over the host stand-in: a producer stream is ordered by events on the device",
          "[comm][nccl]") {
  static fake_cuda_stream backward;  // the framework's stream that writes the gradients
  const cudaStream_t producer = &backward;
  // Unset, or the communicator's own stream (on_ranks builds it on the null stream): no event.
  for (const nccl_options& o : {nccl_options{}, nccl_options{.producer = nullptr}}) {
    const auto what = on_ranks(2, o, [](nccl& c, gradapt::comm::threads&) {
      fake_cuda_event_log().clear();
      std::vector<float> v{1.0f};
      c.allreduce(dev(v), reduce_op::sum);
      c.join_producer();
      RANK_REQUIRE(fake_cuda_event_log().empty());
    });
    CHECK(none(what));
  }
  const auto what = on_ranks(2, {.producer = producer}, [&](nccl& c, gradapt::comm::threads&) {
    auto& log = fake_cuda_event_log();
    const auto is = [&](std::size_t i, const char* w, cudaStream_t s) {
      return log.size() > i && log[i].what == w && log[i].stream == s;
    };
    // A collective: the communicator's stream waits for an event recorded on the producer.
    log.clear();
    std::vector<float> v{1.0f + float(c.rank())};
    c.allreduce(dev(v), reduce_op::sum);
    RANK_REQUIRE(v[0] == 3.0f);
    RANK_REQUIRE(log.size() == 2);
    RANK_REQUIRE((is(0, "record", producer) && is(1, "wait", c.stream()) && log[0].event == log[1].event));
    // join_producer: the reverse, through another event.
    log.clear();
    c.join_producer();
    RANK_REQUIRE((log.size() == 2 && is(0, "record", c.stream()) && is(1, "wait", producer)));
    RANK_REQUIRE(log[0].event == log[1].event);
    // The bucket reducer: every bucket's packing waits for the producer before it reads the
    // gradients, and wait() ends with the producer waiting for the communicator's stream.
    std::vector<std::vector<float>> g{std::vector<float>(5), std::vector<float>(20), std::vector<float>(3)};
    std::vector<tensor_view<float, device_space>> views;
    std::vector<gradapt::bucket::tensor_info> info;
    for (auto& x : g) {
      std::fill(x.begin(), x.end(), float(2 * c.rank() + 1));
      views.push_back(dev(x));
      info.push_back({x.size()});
    }
    const auto plan = gradapt::bucket::bucket_plan::make(info, {.cap_bytes = 40, .first_cap_bytes = 16});
    RANK_REQUIRE(plan.buckets().size() >= 2);
    gradapt::bucket::reducer<nccl, float, host_as_device::backend> red(c, plan, views);
    log.clear();
    for (std::size_t t = g.size(); t-- > 0;) red.mark_ready(t);
    red.wait();
    for (const auto& x : g)
      for (const float e : x) RANK_REQUIRE(e == 2.0f);  // (1 + 3) / 2
    std::size_t waits = 0;
    for (const auto& e : log) waits += e.what == "wait" && e.stream == c.stream() ? 1 : 0;
    RANK_REQUIRE(waits >= 2 * plan.buckets().size());  // before each packing and each collective
    RANK_REQUIRE(is(0, "record", producer));
    RANK_REQUIRE(log.size() >= 2);
    RANK_REQUIRE((log[log.size() - 2].what == "record" && log[log.size() - 2].stream == c.stream()));
    RANK_REQUIRE((log.back().what == "wait" && log.back().stream == producer));
  });
  CHECK(none(what));
  // The composed step with the loss scaler and bucket_reduce, or zero_state<2> (whose allgather
  // follows the optimizer), over a communicator with a producer: the host step's bits, every
  // step ending with the producer ordered after it.
  step_matches_host(2,
                    [](auto& c, const auto& b, const auto& params, double lr) {
                      return train::make_data_parallel_step(
                          c, b, params, scenario::adamw, {.lr = lr, .local_batch = 8},
                          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}),
                          scenario::buckets);
                    },
                    {.producer = producer});
  step_matches_host(2,
                    [](auto& c, const auto& b, const auto& params, double lr) {
                      return train::make_data_parallel_step(
                          c, b, params, scenario::sgd, {.lr = lr, .local_batch = 8},
                          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}), scenario::z2);
                    },
                    {.producer = producer});
}

}  // namespace gradapt_test_nccl_host

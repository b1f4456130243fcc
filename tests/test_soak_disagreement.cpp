// A randomized soak of ranks that disagree, on the threads communicator. Each case draws a
// world of 2 to 4 ranks and one call per rank: a collective (allreduce, allreduce_with_norms,
// broadcast, allgather, reduce_scatter, barrier, split), an agreement of named values, or an
// average of a list of tensors, with an element type, reduction op, count and root. In about
// half the cases every rank makes the same call; otherwise one field of one or more ranks
// differs (another collective, type, op, count, root, value, list length, or an invalid root).
// A case passes when either every rank agreed and every rank returned the correct result, or
// the ranks differed and every rank threw gradapt::error. A hang is impossible to miss: the
// watchdog turns it into an error that says "did not arrive", which fails the case; a crash
// fails the run.
//
// Raw collectives draw at most 6 elements per rank. A raw allreduce of exactly the shape of a
// gradapt agreement (2n + 3 doubles with max, n the agreed values) meets that agreement
// unnoticed by the communicator: the agreement's side throws ("not in the same operation")
// but the raw side returns; docs/reliability.md states this limit.
//
// GRADAPT_SOAK_CASES sets the number of cases (default 10000); GRADAPT_SOAK_SEED the seed.
#include "catch.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/sync/average_models.hpp"

namespace gradapt_test_soak_disagreement {

namespace {

using threads = gradapt::comm::threads;

enum class kind : int {
  allreduce,
  norms,
  broadcast,
  allgather,
  reduce_scatter,
  barrier,
  split,
  agree,
  average
};
constexpr int kinds = 9;

struct call {
  kind k = kind::allreduce;
  bool dbl = false;  ///< double instead of float
  bool max = false;  ///< reduce_op::max instead of sum
  int count = 4;     ///< elements per rank (tensors for average)
  int root = 0;      ///< broadcast root (may be out of range), split color, or agreed value
  bool operator==(const call&) const = default;
};

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

/// Rank r's input element i.
double input(int r, int i) { return static_cast<double>((r + 1) * 10 + i); }

/// Runs `c` on this rank; returns "" when it returned with the correct result, the error's
/// message when it threw, or a description of a wrong result.
template <class T>
std::string run_typed(threads& comm, const call& c) {
  const int n = comm.size(), r = comm.rank();
  const auto count = static_cast<std::size_t>(c.count);
  const auto op = c.max ? gradapt::reduce_op::max : gradapt::reduce_op::sum;
  std::vector<T> x(count);
  for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(input(r, static_cast<int>(i)));
  const auto expect_reduced = [&](int i) {
    double acc = input(0, i);
    for (int k = 1; k < n; ++k) acc = c.max ? std::max(acc, input(k, i)) : acc + input(k, i);
    return acc;
  };
  switch (c.k) {
    case kind::allreduce:
    case kind::norms: {
      if (c.k == kind::norms)
        (void)comm.allreduce_with_norms(gradapt::host_view(x));
      else
        comm.allreduce(gradapt::host_view(x), op);
      const bool summed = c.k == kind::norms || !c.max;
      for (std::size_t i = 0; i < count; ++i) {
        double acc = input(0, static_cast<int>(i));
        for (int k = 1; k < n; ++k)
          acc = summed ? acc + input(k, static_cast<int>(i)) : std::max(acc, input(k, static_cast<int>(i)));
        if (static_cast<double>(x[i]) != acc) return "wrong allreduce result";
      }
      return {};
    }
    case kind::broadcast:
      comm.broadcast(gradapt::host_view(x), c.root);
      for (std::size_t i = 0; i < count; ++i)
        if (static_cast<double>(x[i]) != input(c.root, static_cast<int>(i))) return "wrong broadcast result";
      return {};
    case kind::allgather: {
      std::vector<T> all(count * static_cast<std::size_t>(n));
      comm.allgather(gradapt::tensor_view<const T>::vector(x.data(), count), gradapt::host_view(all));
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i)
          if (static_cast<double>(all[static_cast<std::size_t>(k) * count + i]) !=
              input(k, static_cast<int>(i)))
            return "wrong allgather result";
      return {};
    }
    case kind::reduce_scatter: {
      std::vector<T> big(count * static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<T>(input(r, static_cast<int>(i)));
      comm.reduce_scatter(gradapt::tensor_view<const T>::vector(big.data(), big.size()),
                          gradapt::host_view(x), op);
      for (std::size_t i = 0; i < count; ++i)
        if (static_cast<double>(x[i]) !=
            expect_reduced(static_cast<int>(static_cast<std::size_t>(r) * count + i)))
          return "wrong reduce_scatter result";
      return {};
    }
    case kind::barrier:
      comm.barrier();
      return {};
    case kind::split: {
      threads sub = comm.split(0, r);
      if (sub.size() != n) return "wrong split size";
      return {};
    }
    case kind::agree:
      gradapt::agree_values(comm, "soak",
                            {{"value", static_cast<double>(c.root)}, {"count", double(c.count)}});
      return {};
    case kind::average: {
      std::vector<std::vector<T>> data(count, std::vector<T>(3));
      std::vector<gradapt::tensor_view<T>> list;
      for (std::size_t t = 0; t < count; ++t) {
        for (std::size_t i = 0; i < 3; ++i) data[t][i] = static_cast<T>(input(r, static_cast<int>(t + i)));
        list.push_back(gradapt::host_view(data[t]));
      }
      gradapt::average_models(comm, gradapt::host{.threads = 1}, list);
      for (std::size_t t = 0; t < count; ++t)
        for (std::size_t i = 0; i < 3; ++i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += input(k, static_cast<int>(t + i));
          if (static_cast<double>(data[t][i]) != static_cast<double>(static_cast<T>(s / n)))
            return "wrong average";
        }
      return {};
    }
  }
  return "unknown call";
}

std::string run(threads& comm, const call& c) {
  try {
    return c.dbl ? run_typed<double>(comm, c) : run_typed<float>(comm, c);
  } catch (const gradapt::error& e) {
    return std::string("threw: ") + e.what();
  }
}

/// `c` with the fields its kind ignores reset, so that two calls are the same call exactly
/// when their normal forms are equal.
call normal(call c) {
  const bool typed = c.k != kind::barrier && c.k != kind::split && c.k != kind::agree;
  if (!typed) c.dbl = false;
  if (c.k != kind::allreduce && c.k != kind::reduce_scatter) c.max = false;
  if (c.k == kind::barrier || c.k == kind::split) c.count = 0;
  if (c.k != kind::broadcast && c.k != kind::agree) c.root = 0;
  if (c.k == kind::average && c.count == 0) c.dbl = false;  // no tensors: nothing typed moves
  return c;
}

/// One rank's call, drawn so that most fields matter for its kind.
call draw(std::mt19937_64& rng, int n) {
  call c;
  c.k = static_cast<kind>(rng() % kinds);
  c.dbl = rng() % 2;
  c.max = (c.k == kind::allreduce || c.k == kind::reduce_scatter) && rng() % 2;
  c.count = static_cast<int>(rng() % 5);
  c.root = c.k == kind::broadcast ? static_cast<int>(rng() % static_cast<unsigned>(n)) : 0;
  return c;
}

/// A copy of `c` with one field changed.
call mutate(call c, std::mt19937_64& rng, int n) {
  switch (rng() % 5) {
    case 0:
      c.k = static_cast<kind>((static_cast<int>(c.k) + 1 + static_cast<int>(rng() % (kinds - 1))) % kinds);
      break;
    case 1:
      c.dbl = !c.dbl;
      break;
    case 2:
      c.max = !c.max;
      break;
    case 3:
      c.count += 1 + static_cast<int>(rng() % 2);
      break;
    default:
      c.root = rng() % 4 == 0 ? n + 1 : (c.root + 1) % n;  // sometimes out of range (invalid)
      break;
  }
  return c;
}

}  // namespace

TEST_CASE("soak: ranks that disagree all throw, ranks that agree get the right result, none hangs",
          "[soak][disagreement]") {
  const std::uint64_t cases = env_or("GRADAPT_SOAK_CASES", 10000);
  const std::uint64_t seed = env_or("GRADAPT_SOAK_SEED", 20261125);
  const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(10)};
  std::uint64_t agreed = 0, disagreed = 0, failures = 0;
  for (std::uint64_t i = 0; i < cases; ++i) {
    std::mt19937_64 rng(seed + i);
    const int n = 2 + static_cast<int>(rng() % 3);
    const call base = draw(rng, n);
    std::vector<call> calls(static_cast<std::size_t>(n), base);
    if (rng() % 2) {
      const int changed = 1 + static_cast<int>(rng() % static_cast<unsigned>(n - 1));
      for (int k = 0; k < changed; ++k) {
        const auto who = static_cast<std::size_t>(rng() % static_cast<unsigned>(n));
        calls[who] = mutate(calls[who], rng, n);
      }
    }
    bool same = true;
    for (const auto& c : calls) same = same && normal(c) == normal(calls[0]);
    const bool valid_root = calls[0].k != kind::broadcast || (calls[0].root >= 0 && calls[0].root < n);
    std::vector<std::string> out(static_cast<std::size_t>(n));
    gradapt::comm::run_threads(n, quick, [&](threads& comm) {
      out[static_cast<std::size_t>(comm.rank())] = run(comm, calls[static_cast<std::size_t>(comm.rank())]);
    });
    bool ok = true;
    if (same && valid_root) {
      ++agreed;
      for (const auto& o : out) ok = ok && o.empty();
    } else {
      ++disagreed;
      for (const auto& o : out)
        ok = ok && o.rfind("threw: ", 0) == 0 && o.find("did not arrive") == std::string::npos &&
             o.find("gradapt: gradapt:") == std::string::npos;
    }
    if (!ok) {
      ++failures;
      if (failures <= 5) {
        std::string msg = "case " + std::to_string(i) + " (" + (same ? "agreeing" : "disagreeing") + "):";
        for (int r = 0; r < n; ++r) {
          const auto& c = calls[static_cast<std::size_t>(r)];
          msg.append("\n  rank ").append(std::to_string(r)).append(" kind ").append(std::to_string(int(c.k)));
          msg.append(c.dbl ? " double" : " float").append(c.max ? " max" : " sum");
          msg.append(" count ")
              .append(std::to_string(c.count))
              .append(" root ")
              .append(std::to_string(c.root));
          msg.append(": ").append(
              out[static_cast<std::size_t>(r)].empty() ? "returned" : out[static_cast<std::size_t>(r)]);
        }
        UNSCOPED_INFO(msg);
      }
    }
  }
  INFO(cases << " cases: " << agreed << " agreeing, " << disagreed << " disagreeing, " << failures
             << " failed");
  REQUIRE(failures == 0);
  REQUIRE(agreed > 0);
  REQUIRE(disagreed > 0);
}

}  // namespace gradapt_test_soak_disagreement

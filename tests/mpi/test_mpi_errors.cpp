// Every error of gradapt::comm::mpi: sizes that differ across ranks (both sizes named, all
// ranks throw together), bad roots and peers, wrong recv/send sizes, a bad argument on one
// rank only, negative split colors, bad options, and an error code coming from MPI itself.
// After each error the communicator must still work, which proves no rank was left inside a
// collective and no stray message is pending.
#include "catch.hpp"

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <string>
#include <vector>

#include "gradapt/comm/mpi.hpp"
#include "mpi_test_support.hpp"
#include "scenarios/collective_disagreement.hpp"

namespace gradapt_test_mpi_errors {

using namespace mpitest;

namespace {

std::string prefix(const char* op, int rank) {
  return std::string("gradapt: comm::mpi ") + op + " on rank " + std::to_string(rank) + ": ";
}

// The rank whose value differs from rank r's when rank q uses size base + q: rank 0 names
// rank 1, every other rank names rank 0.
int other_of(int r) { return r == 0 ? 1 : 0; }

// The message of `op` on rank r when every rank q passes 10 + q elements (o = other_of(r)).
std::string size_mismatch(const char* op, int r, int o) {
  return prefix(op, r) + "this rank passes " + std::to_string(10 + r) + " elements but rank " +
         std::to_string(o) + " passes " + std::to_string(10 + o) +
         " elements (every rank must pass the same size)";
}

// The message of `op` on rank r of p ranks given the out-of-range `arg` (root, peer) `value`.
std::string out_of_range(const char* op, int r, const char* arg, int value, int p) {
  return prefix(op, r) + arg + " " + std::to_string(value) + " is out of range (expected 0 to " +
         std::to_string(p - 1) + ")";
}

}  // namespace

TEMPLATE_TEST_CASE(
    "mpi collectives with different sizes on different ranks throw on every rank naming both sizes",
    "[mpi][errors]", float, double, half, bfloat16) {
  using T = TestType;
  mpi c;
  const int r = c.rank();
  if (c.size() < 2) {
    // One rank cannot disagree with itself: a size that would differ is simply accepted.
    std::vector<T> x(static_cast<std::size_t>(10 + r), make<T>(1));
    CHECK(error_of([&] { c.allreduce(view(x), reduce_op::sum); }) == "no error");
    return;
  }
  const int o = other_of(r);
  const auto n = static_cast<std::size_t>(10 + r);

  std::vector<T> x(n, make<T>(1));
  CHECK(error_of([&] { c.allreduce(view(x), reduce_op::sum); }) == size_mismatch("allreduce", r, o));
  CHECK(values(x) == std::vector<double>(n, 1.0));  // untouched

  CHECK(error_of([&] { c.broadcast(view(x), 0); }) == size_mismatch("broadcast", r, o));

  const auto p = static_cast<std::size_t>(c.size());
  std::vector<T> gathered(p * n);
  CHECK(error_of([&] { c.allgather(cview(x), view(gathered)); }) == size_mismatch("allgather", r, o));

  std::vector<T> big(p * n, make<T>(1));
  CHECK(error_of([&] { c.reduce_scatter(cview(big), view(x), reduce_op::sum); }) ==
        size_mismatch("reduce_scatter", r, o));
  still_works(c);
}

TEST_CASE("mpi exchange with a peer of a different size throws on both sides", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  const int peer = r ^ 1;  // pairs (0,1), (2,3); the last rank of an odd count talks to itself
  if (peer >= c.size()) {
    std::vector<double> s(3, 1.0), d(3);
    CHECK(error_of([&] { c.exchange(r, cview(s), view(d)); }) == "no error");
    still_works(c);
    return;
  }
  std::vector<double> s(static_cast<std::size_t>(4 + r), 1.0);
  std::vector<double> d(s.size());
  CHECK(error_of([&] { c.exchange(peer, cview(s), view(d)); }) ==
        prefix("exchange", r) + "send has " + std::to_string(4 + r) + " elements but peer rank " +
            std::to_string(peer) + " has " + std::to_string(4 + peer) +
            " (both sides must exchange the same size)");
  still_works(c);
}

TEST_CASE("mpi broadcast with different roots on different ranks throws on every rank", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  if (c.size() < 2) return;
  std::vector<float> x(4, 1.0f);
  const int root = r % 2;
  const int other = r == 0 ? 1 : (root == 0 ? 1 : 0);  // first rank with a different root
  CHECK(error_of([&] { c.broadcast(view(x), root); }) ==
        prefix("broadcast", r) + "this rank passes root " + std::to_string(root) + " but rank " +
            std::to_string(other) + " passes root " + std::to_string(1 - root) +
            " (every rank must pass the same root)");
  still_works(c);
}

TEST_CASE("mpi ranks that call different collectives, types or ops throw on every rank", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  if (c.size() < 2) return;
  const int o = other_of(r);
  for (const auto& k : collective_scenario::cases<mpi>()) {
    const std::string e = error_of([&] { k.body(c); });
    INFO(k.what << ": " << e);
    CHECK(e.find(k.expected(r)) != std::string::npos);
    CHECK(e.find("gradapt: gradapt:") == std::string::npos);
    still_works(c);
  }
  // The full messages of two cases: each rank names its own value and a differing rank's.
  const auto cases = collective_scenario::cases<mpi>();
  const auto message_of = [&](const std::string& what) {
    for (const auto& k : cases)
      if (k.what == what) return error_of([&] { k.body(c); });
    return std::string("no such case");
  };
  // float on rank 0, double elsewhere: MPI itself would truncate or mix the bytes.
  CHECK(message_of("float on rank 0, double elsewhere") ==
        prefix("allreduce", r) + "this rank passes " + (r == 0 ? "float32" : "float64") + " but rank " +
            std::to_string(o) + " passes " + (r == 0 ? "float64" : "float32") +
            " (every rank must pass the same element type)");
  // max on rank 0, sum elsewhere: MPI would return different results per rank.
  CHECK(message_of("max on rank 0, sum elsewhere") ==
        prefix("allreduce", r) + "this rank uses reduce_op::" + (r == 0 ? "max" : "sum") + " but rank " +
            std::to_string(o) + " uses reduce_op::" + (r == 0 ? "sum" : "max") +
            " (every rank must pass the same reduction op)");
  // split on rank 0 while the others reduce or wait at a barrier.
  std::vector<float> f(4, 1.0f);
  const std::string e = error_of([&] {
    if (r == 0)
      (void)c.split(0, 0);
    else if (r % 2 == 1)
      c.allreduce(view(f), reduce_op::sum);
    else
      c.barrier();
  });
  CHECK(e.find("must call the same collective in the same order") != std::string::npos);
  CHECK(e.find(r == 0 ? "this rank called split but rank 1 called allreduce" : "but rank 0 called split") !=
        std::string::npos);
  CHECK(values(f) == std::vector<double>(4, 1.0));  // nothing moved
  still_works(c);
}

TEST_CASE("mpi broadcast root out of range", "[mpi][errors]") {
  for (const bool check : {true, false}) {
    mpi c{MPI_COMM_WORLD, {.check_sizes = check}};
    const int r = c.rank();
    const int p = c.size();
    std::vector<double> x(3, 1.0);
    for (const int root : {p, -1, p + 7}) {
      CHECK(error_of([&] { c.broadcast(view(x), root); }) == out_of_range("broadcast", r, "root", root, p));
    }
    still_works(c);
  }
}

TEST_CASE("mpi exchange peer out of range", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  const int p = c.size();
  std::vector<float> s(2, 1.0f), d(2);
  for (const int peer : {p, -1}) {
    CHECK(error_of([&] { c.exchange(peer, cview(s), view(d)); }) ==
          out_of_range("exchange", r, "peer", peer, p));
  }
  still_works(c);
}

TEST_CASE("mpi exchange send and recv of different sizes", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  std::vector<half> s(3, half(1.0f)), d(4);
  const std::string want =
      prefix("exchange", r) + "send has 3 elements but recv has 4 (exchange needs equal sizes)";
  CHECK(error_of([&] { c.exchange(r, cview(s), view(d)); }) == want);
  // With a real peer both sides are wrong; each names its own sizes, neither hangs.
  const int peer = r ^ 1;
  if (peer < c.size()) CHECK(error_of([&] { c.exchange(peer, cview(s), view(d)); }) == want);
  still_works(c);
}

TEMPLATE_TEST_CASE("mpi allgather and reduce_scatter with the wrong recv or send size", "[mpi][errors]",
                   float, bfloat16) {
  using T = TestType;
  for (const bool check : {true, false}) {
    mpi c{MPI_COMM_WORLD, {.check_sizes = check}};
    const int r = c.rank();
    const auto p = static_cast<std::size_t>(c.size());
    std::vector<T> send(3, make<T>(1));
    std::vector<T> recv(p * 3 + 1);
    CHECK(error_of([&] { c.allgather(cview(send), view(recv)); }) ==
          prefix("allgather", r) + "recv has " + std::to_string(p * 3 + 1) +
              " elements but must have size() * send.size() = " + std::to_string(p) +
              " * 3 = " + std::to_string(p * 3));

    std::vector<T> big(p * 2 + 1, make<T>(1));
    std::vector<T> part(2);
    CHECK(error_of([&] { c.reduce_scatter(cview(big), view(part), reduce_op::sum); }) ==
          prefix("reduce_scatter", r) + "send has " + std::to_string(p * 2 + 1) +
              " elements but must have size() * recv.size() = " + std::to_string(p) +
              " * 2 = " + std::to_string(p * 2));
    still_works(c);
  }
}

TEST_CASE("mpi overlapping buffers are rejected", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  const auto p = static_cast<std::size_t>(c.size());
  std::vector<float> buf(p * 2 + 2, 1.0f);
  // allgather: send starts one element after recv's own block.
  const std::size_t off = static_cast<std::size_t>(r) * 2 + 1;
  CHECK(error_of([&] {
          c.allgather(gradapt::tensor_view<const float>::vector(buf.data() + off, 2),
                      gradapt::tensor_view<float>::vector(buf.data(), static_cast<std::int64_t>(p * 2)));
        }) == prefix("allgather", r) +
                  "send overlaps recv; it may only be recv's own block at offset rank() * send.size() = " +
                  std::to_string(r * 2));
  // reduce_scatter: recv inside send.
  CHECK(error_of([&] {
          c.reduce_scatter(
              gradapt::tensor_view<const float>::vector(buf.data(), static_cast<std::int64_t>(p * 2)),
              gradapt::tensor_view<float>::vector(buf.data() + 1, 2), reduce_op::sum);
        }) == prefix("reduce_scatter", r) + "send and recv overlap; pass separate buffers");
  // exchange: partial overlap.
  CHECK(error_of([&] {
          c.exchange(r, gradapt::tensor_view<const float>::vector(buf.data(), 2),
                     gradapt::tensor_view<float>::vector(buf.data() + 1, 2));
        }) ==
        prefix("exchange", r) + "send and recv partly overlap; pass separate buffers or the same buffer");
  still_works(c);
}

TEST_CASE("mpi a bad argument on one rank makes every rank throw", "[mpi][errors]") {
  mpi c;
  const int r = c.rank();
  const int p = c.size();
  const int bad = p - 1;
  const auto np = static_cast<std::size_t>(p);
  std::vector<double> send(2, 1.0);
  std::vector<double> recv(r == bad ? np * 2 + 3 : np * 2);
  const std::string got = error_of([&] { c.allgather(cview(send), view(recv)); });
  if (r == bad)
    CHECK(got == prefix("allgather", r) + "recv has " + std::to_string(np * 2 + 3) +
                     " elements but must have size() * send.size() = " + std::to_string(p) +
                     " * 2 = " + std::to_string(np * 2));
  else
    CHECK(got == prefix("allgather", r) + "rank " + std::to_string(bad) +
                     " passed invalid arguments (that rank's error says which); nothing was sent");

  const std::string split_error = error_of([&] { static_cast<void>(c.split(r == bad ? -1 : 0, 0)); });
  if (r == bad)
    CHECK(split_error == prefix("split", r) + "color -1 is negative (expected a color >= 0)");
  else
    CHECK(split_error == prefix("split", r) + "rank " + std::to_string(bad) +
                             " passed invalid arguments (that rank's error says which); nothing was sent");
  still_works(c);
}

TEST_CASE("mpi split with a negative color", "[mpi][errors]") {
  for (const bool check : {true, false}) {
    mpi c{MPI_COMM_WORLD, {.check_sizes = check}};
    CHECK(error_of([&] { static_cast<void>(c.split(-3, 0)); }) ==
          prefix("split", c.rank()) + "color -3 is negative (expected a color >= 0)");
    still_works(c);
  }
}

TEST_CASE("mpi constructor rejects a null handle and bad options", "[mpi][errors]") {
  CHECK(error_of([] { mpi c{MPI_COMM_NULL}; }) ==
        "gradapt: comm::mpi: the handle is MPI_COMM_NULL; pass a valid communicator (a rank outside a split "
        "group "
        "has none)");
  CHECK(error_of([] {
          mpi c{MPI_COMM_WORLD, {.max_count = 0}};
        }) ==
        "gradapt: comm::mpi: mpi_options::max_count is 0 (expected 1 to " + std::to_string(INT_MAX) + ")");
  CHECK(error_of([] {
          mpi c{MPI_COMM_WORLD, {.max_count = std::int64_t{INT_MAX} + 1}};
        }) == "gradapt: comm::mpi: mpi_options::max_count is " + std::to_string(std::int64_t{INT_MAX} + 1) +
                  " (expected 1 to " + std::to_string(INT_MAX) + ")");
  const std::string tag_error = error_of([] { mpi c{MPI_COMM_WORLD, {.tag = -1}}; });
  CHECK(tag_error.rfind("gradapt: comm::mpi: mpi_options::tag is -1 (expected 0 to MPI_TAG_UB = ", 0) == 0);
}

TEST_CASE("mpi engine errors carry MPI's own message", "[mpi][errors]") {
  // Without the size check, rank 1 receives 4 elements into a 3-element buffer: MPI itself
  // reports the truncation, and the communicator turns the code into a gradapt::error.
  mpi c{MPI_COMM_WORLD, {.check_sizes = false}};
  const int r = c.rank();
  if (c.size() < 2 || r > 1) {
    still_works(c);
    return;
  }
  std::vector<float> s(r == 0 ? 4 : 3, 1.0f), d(s.size());
  const std::string got = error_of([&] { c.exchange(1 - r, cview(s), view(d)); });
  if (r == 0) {
    CHECK(got == "no error");
  } else {
    CHECK(got.rfind(prefix("exchange", 1) + "MPI_Sendrecv failed: ", 0) == 0);
    CHECK(got.find("truncat") != std::string::npos);
  }
  still_works(c);
}

}  // namespace gradapt_test_mpi_errors

// Every operation of gradapt::comm::mpi on float, double, half and bfloat16, under mpirun with
// 1 to 5 ranks. Inputs are exact, expected values are computed in double by closed form or by a
// loop over ranks, independently of MPI; the data scenarios are shared with the threads test
// (tests/support/scenarios/comm_ops.hpp).
#include "catch.hpp"

#include <mpi.h>

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "gradapt/comm/mpi.hpp"
#include "mpi_test_support.hpp"

namespace gradapt_test_mpi_ops {

using namespace mpitest;

namespace {

// The option sets every data test runs under: defaults, pieces of at most 3 elements (the
// large-buffer path of every operation), and no argument agreement.
std::vector<mpi_options> option_sets() {
  return {mpi_options{}, mpi_options{.max_count = 3}, mpi_options{.check_sizes = false}};
}

}  // namespace

TEST_CASE("mpi communicator reports MPI's rank and size", "[mpi]") {
  mpi c;
  CHECK(c.rank() == world_rank());
  CHECK(c.size() == world_size());
  CHECK(c.native() == MPI_COMM_WORLD);
  CHECK(c.options().check_sizes);
  mpi d{mpi_options{.check_sizes = false}};
  CHECK_FALSE(d.options().check_sizes);
  CHECK(d.size() == world_size());
}

TEMPLATE_TEST_CASE("mpi allreduce sums and maxes exact values", "[mpi]", float, double, half, bfloat16) {
  for (const mpi_options& opts : option_sets()) {
    mpi c{MPI_COMM_WORLD, opts};
    allreduce_sum_max<TestType>(c);
  }
}

TEMPLATE_TEST_CASE("mpi allreduce of a rank-2 view reduces every element", "[mpi]", float, half) {
  using T = TestType;
  mpi c;
  auto x = fill<T>(12, [&](std::size_t i) { return a(c.rank(), i); });
  c.allreduce(gradapt::tensor_view<T>(x.data(), {3, 4}), reduce_op::sum);
  const int p = c.size();
  CHECK(values(x) == expect<T>(12, [&](std::size_t i) {
          double s = 0;
          for (int q = 0; q < p; ++q) s += a(q, i);
          return s;
        }));
}

TEMPLATE_TEST_CASE("mpi broadcast copies the root's buffer from every root", "[mpi]", float, double, half,
                   bfloat16) {
  for (const mpi_options& opts : option_sets()) {
    mpi c{MPI_COMM_WORLD, opts};
    broadcast_every_root<TestType>(c);
  }
}

TEMPLATE_TEST_CASE("mpi allgather places rank r's block at offset r * n", "[mpi]", float, double, half,
                   bfloat16) {
  for (const mpi_options& opts : option_sets()) {
    mpi c{MPI_COMM_WORLD, opts};
    allgather_blocks<TestType>(c);
  }
}

TEMPLATE_TEST_CASE("mpi reduce_scatter gives rank r the reduced block r", "[mpi]", float, double, half,
                   bfloat16) {
  for (const mpi_options& opts : option_sets()) {
    mpi c{MPI_COMM_WORLD, opts};
    reduce_scatter_blocks<TestType>(c);
  }
}

TEMPLATE_TEST_CASE("mpi exchange pairs every rank with every rank around the ring, itself included", "[mpi]",
                   float, double, half, bfloat16) {
  // In place, the MPI communicator exchanges with MPI_Sendrecv_replace.
  for (const mpi_options& opts : option_sets()) {
    mpi c{MPI_COMM_WORLD, opts};
    exchange_round_robin<TestType>(c, true);
  }
}

TEST_CASE("mpi exchange with self copies locally", "[mpi]") {
  mpi c;
  const std::vector<double> send{1.5, -2.25, 3.0};
  std::vector<double> recv(3, 0.0);
  c.exchange(c.rank(), cview(send), view(recv));
  CHECK(recv == send);
  c.exchange(c.rank(), cview(recv), view(recv));
  CHECK(recv == send);
}

TEST_CASE("mpi split into odd and even ranks orders by key, then rank", "[mpi]") {
  mpi c;
  const int r = c.rank();
  const int p = c.size();
  const int color = r % 2;
  // key = -r: reversed order, so the highest world rank of each parity becomes sub-rank 0.
  mpi sub = c.split(color, -r);
  int members = 0;
  int higher = 0;
  double rank_sum = 0;
  for (int q = color; q < p; q += 2) {
    ++members;
    rank_sum += q;
    if (q > r) ++higher;
  }
  CHECK(sub.size() == members);
  CHECK(sub.rank() == higher);
  CHECK(sub.native() != c.native());

  // Collectives run inside the group only.
  std::vector<double> x{static_cast<double>(r)};
  sub.allreduce(view(x), reduce_op::sum);
  CHECK(x[0] == rank_sum);
  std::vector<half> h{half(static_cast<float>(r))};
  sub.broadcast(view(h), 0);  // sub-rank 0 is the highest world rank of this parity
  const int top = color + 2 * ((p - 1 - color) / 2);
  CHECK(value(h[0]) == static_cast<double>(top));
  const std::vector<float> mine{static_cast<float>(r)};
  std::vector<float> all(static_cast<std::size_t>(sub.size()));
  sub.allgather(cview(mine), view(all));
  for (std::size_t s = 0; s < all.size(); ++s)
    CHECK(all[s] == static_cast<float>(top - 2 * static_cast<int>(s)));

  // Equal keys keep the old rank order; a split of a split works too.
  mpi ordered = c.split(color, 0);
  CHECK(ordered.rank() == r / 2);
  mpi nested = ordered.split(ordered.rank() % 2, 0);
  CHECK(nested.size() == (ordered.size() - ordered.rank() % 2 + 1) / 2);
  std::vector<float> one{1.0f};
  nested.allreduce(view(one), reduce_op::sum);
  CHECK(one[0] == static_cast<float>(nested.size()));

  // One color for everyone: the same group, a different handle.
  mpi same = c.split(0, 0);
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(same.native(), c.native(), &cmp);
  CHECK(cmp == MPI_CONGRUENT);
  CHECK(same.rank() == r);
  sub.barrier();
  c.barrier();
}

TEST_CASE("mpi split handles are freed by the last copy; the framework's handle never is", "[mpi]") {
  static int freed = 0;
  freed = 0;
  int key = MPI_KEYVAL_INVALID;
  REQUIRE(MPI_Comm_create_keyval(
              MPI_COMM_NULL_COPY_FN,
              [](MPI_Comm, int, void*, void*) -> int {
                ++freed;
                return MPI_SUCCESS;
              },
              &key, nullptr) == MPI_SUCCESS);

  mpi c;
  {
    std::optional<mpi> keep;
    {
      mpi sub = c.split(0, 0);
      MPI_Comm_set_attr(sub.native(), key, nullptr);
      keep = sub;
    }
    CHECK(freed == 0);  // a copy is still alive
    std::vector<double> x{1.0};
    keep->allreduce(view(x), reduce_op::sum);
    CHECK(x[0] == static_cast<double>(c.size()));
  }
  CHECK(freed == 1);

  // A wrapped framework handle survives every copy of its communicator.
  MPI_Comm dup = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &dup) == MPI_SUCCESS);
  MPI_Comm_set_attr(dup, key, nullptr);
  {
    mpi wrapped{dup};
    mpi copy = wrapped;
    copy.barrier();
  }
  CHECK(freed == 1);
  int size = 0;
  CHECK(MPI_Comm_size(dup, &size) == MPI_SUCCESS);
  CHECK(size == c.size());
  MPI_Comm_free(&dup);
  CHECK(freed == 2);
  MPI_Comm_free_keyval(&key);
}

TEST_CASE("mpi barrier returns on every rank", "[mpi]") {
  mpi c;
  for (int i = 0; i < 3; ++i) c.barrier();
  SUCCEED("all ranks passed three barriers");
}

TEST_CASE("mpi 16-bit reductions round back to the storage type", "[mpi]") {
  // With two ranks one rounding step is order-independent: 1 + 2^-11 is a tie between 1 and
  // 1 + 2^-10 in half and rounds to even (1); in bfloat16 1 + 2^-8 ties and rounds to 1 too.
  mpi c;
  if (c.size() != 2) {
    SUCCEED("needs exactly 2 ranks");
    return;
  }
  std::vector<half> h{half(c.rank() == 0 ? 1.0f : 0.00048828125f),
                      half(c.rank() == 0 ? 1.0f : 0.0009765625f)};
  c.allreduce(view(h), reduce_op::sum);
  CHECK(value(h[0]) == 1.0);
  CHECK(value(h[1]) == 1.0009765625);
  std::vector<bfloat16> g{bfloat16(c.rank() == 0 ? 1.0f : 0.00390625f)};
  c.allreduce(view(g), reduce_op::sum);
  CHECK(value(g[0]) == 1.0);
}

}  // namespace gradapt_test_mpi_ops

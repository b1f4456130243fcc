// The partition plan of sharded optimizer state: worked examples computed by hand, and over
// random layouts the properties every plan must have (every element owned exactly once, pieces
// in list order at their flat positions in the shard buffer (packed unless tensors are
// aligned), aligned equal ranges and cuts on the grid for element granularity,
// whole tensors and the longest-processing-time bound for tensor granularity), determinism,
// the checkpoint round trip and the errors.
#include "catch.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/shard/partition.hpp"

namespace gradapt_test_shard_partition {

using gradapt::shard::granularity;
using gradapt::shard::partition_plan;
using gradapt::shard::piece;

namespace {

/// Checks the properties of `p` for `sizes` (see the file comment).
void check_plan(const partition_plan& p, const std::vector<std::size_t>& sizes) {
  const int n = p.world();
  const auto& o = p.options();
  std::vector<std::vector<int>> owner(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) owner[t].assign(sizes[t], -1);
  std::size_t covered = 0, largest = 0;
  for (const std::size_t s : sizes) largest = std::max(largest, s);
  std::vector<std::size_t> load(static_cast<std::size_t>(n), 0);
  for (int r = 0; r < n; ++r) {
    std::size_t pos = 0, last_tensor = 0;
    bool first = true;
    for (const piece& q : p.pieces(r)) {
      REQUIRE(q.length > 0);
      REQUIRE(q.tensor < sizes.size());
      REQUIRE(q.offset + q.length <= sizes[q.tensor]);
      if (!o.align_tensors) REQUIRE(q.shard_offset == pos);  // packed
      if (!first) REQUIRE(q.tensor > last_tensor);           // list order, one piece per tensor
      first = false;
      last_tensor = q.tensor;
      pos += q.length;
      for (std::size_t i = q.offset; i < q.offset + q.length; ++i) {
        REQUIRE(owner[q.tensor][i] == -1);
        owner[q.tensor][i] = r;
      }
      if (o.mode == granularity::tensor) {
        REQUIRE(q.offset == 0);
        REQUIRE(q.length == sizes[q.tensor]);
      }
    }
    REQUIRE(pos == p.shard_size(r));
    REQUIRE(pos <= p.shard_capacity());
    load[static_cast<std::size_t>(r)] = pos;
    covered += pos;
  }
  REQUIRE(covered == p.total());
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) REQUIRE(owner[t][i] >= 0);
  if (o.mode == granularity::element) {
    // Flat starts (aligned with align_tensors); rank r owns flat [r S, (r + 1) S) and each
    // piece sits at its flat position minus r S in the shard buffer.
    REQUIRE(p.shard_capacity() % o.alignment == 0);
    const std::size_t S = p.shard_capacity();
    std::size_t flat = 0;
    std::vector<std::size_t> start(sizes.size());
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      if (o.align_tensors && flat % o.alignment != 0) flat += o.alignment - flat % o.alignment;
      start[t] = flat;
      flat += sizes[t];
    }
    for (int r = 0; r < n; ++r) {
      const auto ps = p.pieces(r);
      const std::size_t lo = static_cast<std::size_t>(r) * S;
      if (ps.empty()) {
        REQUIRE(lo >= flat);
        continue;
      }
      for (const piece& q : ps) {
        const std::size_t at = start[q.tensor] + q.offset;
        REQUIRE(at >= lo);
        REQUIRE(at + q.length <= lo + S);
        REQUIRE(q.shard_offset == at - lo);
        if (o.align_tensors) {  // cuts inside a tensor on the alignment grid from its start
          REQUIRE(q.offset % o.alignment == 0);
          REQUIRE(((q.offset + q.length) % o.alignment == 0 || q.offset + q.length == sizes[q.tensor]));
        }
      }
      // Ranks before the last hold every flat position of their range that a tensor covers.
      std::size_t expect = 0;
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        const std::size_t b = std::max(lo, start[t]), e = std::min(lo + S, start[t] + sizes[t]);
        if (b < e) expect += e - b;
      }
      REQUIRE(p.shard_size(r) == expect);
    }
    // No more than one alignment block of slack per rank over an even split of the flat span.
    REQUIRE(S <= (flat + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n) + o.alignment);
    if (!o.align_tensors) REQUIRE(flat == p.total());
  } else {
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    REQUIRE(*hi - *lo <= largest);
  }
}

}  // namespace

TEST_CASE("element granularity: a worked example", "[shard][partition]") {
  // 35 elements, alignment 4: 9 blocks, 5 per rank, S = 20. Rank 0 holds flat [0, 20),
  // rank 1 flat [20, 35): tensor 2 straddles them.
  const std::vector<std::size_t> sizes{10, 5, 20};
  const auto p = partition_plan::make(sizes, 2, {.mode = granularity::element, .alignment = 4});
  REQUIRE(p.shard_capacity() == 20);
  const std::vector<piece> r0{{0, 0, 10, 0}, {1, 0, 5, 10}, {2, 0, 5, 15}};
  const std::vector<piece> r1{{2, 5, 15, 0}};
  REQUIRE(std::vector<piece>(p.pieces(0).begin(), p.pieces(0).end()) == r0);
  REQUIRE(std::vector<piece>(p.pieces(1).begin(), p.pieces(1).end()) == r1);
  REQUIRE(p.owner(2, 4) == 0);
  REQUIRE(p.owner(2, 5) == 1);
  REQUIRE(
      p.describe() ==
      "partition_plan: element granularity, 2 rank(s), 3 tensor(s), 35 element(s), alignment 4, shard "
      "capacity 20\n  rank 0: 20 element(s) t0[0, 10) t1[0, 5) t2[0, 5)\n  rank 1: 15 element(s) t2[5, 20)");
  check_plan(p, sizes);
}

TEST_CASE("element granularity with aligned tensors: a worked example", "[shard][partition]") {
  // Alignment 4, tensors aligned: t0 at flat [0, 10), t1 at [12, 17), t2 at [20, 40); 10
  // blocks, 5 per rank, S = 20. Rank 0 holds t0 and t1 (t1 at shard position 12), rank 1 t2.
  const std::vector<std::size_t> sizes{10, 5, 20};
  const auto p =
      partition_plan::make(sizes, 2, {.mode = granularity::element, .alignment = 4, .align_tensors = true});
  REQUIRE(p.shard_capacity() == 20);
  const std::vector<piece> r0{{0, 0, 10, 0}, {1, 0, 5, 12}};
  const std::vector<piece> r1{{2, 0, 20, 0}};
  REQUIRE(std::vector<piece>(p.pieces(0).begin(), p.pieces(0).end()) == r0);
  REQUIRE(std::vector<piece>(p.pieces(1).begin(), p.pieces(1).end()) == r1);
  REQUIRE(p.describe() ==
          "partition_plan: element granularity, 2 rank(s), 3 tensor(s), 35 element(s), alignment 4 (tensors "
          "aligned), shard capacity 20\n  rank 0: 15 element(s) t0[0, 10) t1[0, 5)\n  rank 1: 20 element(s) "
          "t2[0, 20)");
  check_plan(p, sizes);
}

TEST_CASE("tensor granularity: a worked example", "[shard][partition]") {
  // Largest first to the least-loaded rank: t2 (20) -> 0, t0 (10) -> 1, t3 (7) -> 1 (10 < 20),
  // t1 (5) -> 1 (17 < 20). Loads 20 and 22.
  const std::vector<std::size_t> sizes{10, 5, 20, 7};
  const auto p = partition_plan::make(sizes, 2, {.mode = granularity::tensor});
  const std::vector<piece> r0{{2, 0, 20, 0}};
  const std::vector<piece> r1{{0, 0, 10, 0}, {1, 0, 5, 10}, {3, 0, 7, 15}};
  REQUIRE(std::vector<piece>(p.pieces(0).begin(), p.pieces(0).end()) == r0);
  REQUIRE(std::vector<piece>(p.pieces(1).begin(), p.pieces(1).end()) == r1);
  REQUIRE(p.shard_capacity() == 22);
  REQUIRE(p.owner(3, 6) == 1);
  check_plan(p, sizes);
}

TEST_CASE("more ranks than elements or tensors, empty tensors, one rank", "[shard][partition]") {
  for (const auto mode : {granularity::element, granularity::tensor}) {
    const std::vector<std::size_t> sizes{0, 3, 0, 1};
    for (int n : {1, 2, 5, 8}) {
      const auto p = partition_plan::make(sizes, n, {.mode = mode, .alignment = 1});
      check_plan(p, sizes);
    }
    const std::vector<std::size_t> none;
    check_plan(partition_plan::make(none, 3, {.mode = mode}), none);
    const auto one = partition_plan::make(sizes, 1, {.mode = mode});
    REQUIRE(one.shard_size(0) == 4);
  }
}

TEST_CASE("random layouts: every property, both granularities, 1 to 9 ranks", "[shard][partition]") {
  std::mt19937_64 rng(20261125);
  for (int c = 0; c < 400; ++c) {
    std::vector<std::size_t> sizes(rng() % 12);
    for (auto& s : sizes) {
      const auto k = rng() % 10;
      s = k == 0 ? 0 : (k < 7 ? rng() % 50 : rng() % 3000);
    }
    const int n = 1 + static_cast<int>(rng() % 9);
    const std::size_t align = std::vector<std::size_t>{1, 3, 4, 64}[rng() % 4];
    const auto mode = rng() % 2 ? granularity::element : granularity::tensor;
    const bool aligned = rng() % 2 == 0;
    INFO("case " << c << ": " << sizes.size() << " tensors, " << n << " ranks, alignment " << align
                 << (aligned ? ", tensors aligned" : ""));
    const gradapt::shard::partition_options o{.mode = mode, .alignment = align, .align_tensors = aligned};
    const auto p = partition_plan::make(sizes, n, o);
    check_plan(p, sizes);
    const auto again = partition_plan::make(sizes, n, o);
    REQUIRE(again == p);
    REQUIRE(again.describe() == p.describe());
  }
}

TEST_CASE("the plan is saved and loaded with a checkpoint", "[shard][partition][archive]") {
  const std::vector<std::size_t> sizes{768 * 2304, 2304, 768, 50257 * 768};
  for (const auto mode : {granularity::element, granularity::tensor})
    for (const bool aligned : {false, true}) {
      const auto p =
          partition_plan::make(sizes, 4, {.mode = mode, .alignment = 128, .align_tensors = aligned});
      gradapt::archive_writer w(partition_plan::archive_kind, partition_plan::archive_version);
      w.begin("plan");
      p.save(w);
      w.end();
      const auto bytes = w.finish();
      gradapt::archive_reader r(bytes, partition_plan::archive_kind, partition_plan::archive_version);
      r.begin("plan");
      const auto q = partition_plan::load(r);
      r.end();
      REQUIRE(q == p);
      REQUIRE(q.describe() == p.describe());
    }
  gradapt::archive_writer w(partition_plan::archive_kind, partition_plan::archive_version);
  w.put("granularity", "rows");
  w.put("alignment", std::uint64_t{1});
  w.put("world", std::uint64_t{2});
  const auto bad = w.finish();
  gradapt::archive_reader r(bad, partition_plan::archive_kind, partition_plan::archive_version);
  REQUIRE_THROWS_WITH(partition_plan::load(r), Catch::Matchers::Contains("granularity 'rows'"));
}

TEST_CASE("a loaded plan's sizes are checked before its units are cut", "[shard][partition][archive]") {
  // A unit plan of 2^40 elements in units of 1 would loop 2^32 times before its unit limit
  // stops it (minutes): the caller's size check runs first and throws at once.
  gradapt::archive_writer w(partition_plan::archive_kind, partition_plan::archive_version);
  w.begin("plan");
  w.put("granularity", "unit");
  w.put("alignment", std::uint64_t{1});
  w.put("world", std::uint64_t{2});
  w.put("align_tensors", std::uint64_t{0});
  const std::vector<std::uint64_t> sizes{std::uint64_t{1} << 40, 6};
  const std::vector<std::uint64_t> grains{1, 1};
  w.put_tensor<std::uint64_t>("tensor_sizes", sizes);
  w.put_tensor<std::uint64_t>("unit_grains", grains);
  w.end();
  const auto bytes = w.finish();
  gradapt::archive_reader r(bytes, partition_plan::archive_kind, partition_plan::archive_version);
  r.begin("plan");
  std::vector<std::size_t> seen;
  REQUIRE_THROWS_WITH(
      partition_plan::load(r,
                           [&](std::span<const std::size_t> s) {
                             seen.assign(s.begin(), s.end());
                             gradapt::detail::require(s[0] == 6, "tensor 0 has ", s[0],
                                                      " elements in the checkpoint but 6 here");
                           }),
      Catch::Matchers::Contains("tensor 0 has 1099511627776 elements in the checkpoint but 6 here"));
  REQUIRE(seen == std::vector<std::size_t>{std::size_t{1} << 40, 6});
}

TEST_CASE("invalid plans are errors naming the option", "[shard][partition][validation]") {
  const std::vector<std::size_t> sizes{4, 4};
  REQUIRE_THROWS_WITH(partition_plan::make(sizes, 0), Catch::Matchers::Contains("world size is 0"));
  REQUIRE_THROWS_WITH(partition_plan::make(sizes, 2, {.alignment = 0}),
                      Catch::Matchers::Contains("partition_options::alignment is 0"));
  const auto p = partition_plan::make(sizes, 2);
  REQUIRE_THROWS_WITH(p.pieces(2), Catch::Matchers::Contains("rank 2 is out of range"));
  REQUIRE_THROWS_WITH(p.owner(2, 0), Catch::Matchers::Contains("tensor 2 is out of range"));
  REQUIRE_THROWS_WITH(p.owner(1, 4), Catch::Matchers::Contains("element 4 of tensor 1 is out of range"));
  const std::vector<std::size_t> huge{~std::size_t{0}, 2};
  REQUIRE_THROWS_WITH(partition_plan::make(huge, 2), Catch::Matchers::Contains("overflow"));
}

}  // namespace gradapt_test_shard_partition

// Host tests of the multi-tensor chunk index math and the reduction partition
// (gradapt/backend/chunking.hpp), checked against brute-force enumerations.

#include "gradapt/backend/chunking.hpp"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt_test_chunking {

namespace ck = gradapt::chunking;

namespace {

struct expected_chunk {
  std::size_t tensor;
  std::size_t chunk_in_tensor;
  std::size_t begin;
  std::size_t end;
};

// Every chunk of every tensor, in tensor order, by plain enumeration.
std::vector<expected_chunk> enumerate(const std::vector<std::size_t>& sizes, std::size_t chunk) {
  std::vector<expected_chunk> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::size_t c = 0;
    for (std::size_t b = 0; b < sizes[t]; b += chunk, ++c)
      out.push_back({t, c, b, b + chunk < sizes[t] ? b + chunk : sizes[t]});
  }
  return out;
}

// Checks prefix, locate_chunk and coverage of every element for one size list.
void check_sizes(const std::vector<std::size_t>& sizes, std::size_t chunk) {
  std::vector<std::size_t> prefix(sizes.size() + 1, 99);
  const std::size_t total = ck::exclusive_chunk_prefix(sizes, prefix, chunk);
  const auto expected = enumerate(sizes, chunk);
  REQUIRE(total == expected.size());
  REQUIRE(prefix.front() == 0);
  REQUIRE(prefix.back() == total);
  for (std::size_t t = 0; t < sizes.size(); ++t)
    REQUIRE(prefix[t + 1] - prefix[t] == ck::chunk_count(sizes[t], chunk));

  std::vector<std::size_t> covered(sizes.size(), 0);
  for (std::size_t g = 0; g < total; ++g) {
    const ck::chunk_location loc = ck::locate_chunk(prefix.data(), sizes.size(), g, sizes.data(), chunk);
    const expected_chunk& e = expected[g];
    INFO("global chunk " << g << " of " << total << ", chunk size " << chunk);
    REQUIRE(loc.tensor == e.tensor);
    REQUIRE(loc.chunk_in_tensor == e.chunk_in_tensor);
    REQUIRE(loc.begin == e.begin);
    REQUIRE(loc.end == e.end);
    REQUIRE(loc.size() > 0);
    REQUIRE(sizes[loc.tensor] > 0);
    REQUIRE(loc.begin == covered[loc.tensor]);  // chunks tile each tensor in order
    covered[loc.tensor] = loc.end;
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) REQUIRE(covered[t] == sizes[t]);

  const ck::chunk_location past = ck::locate_chunk(prefix.data(), sizes.size(), total, sizes.data(), chunk);
  REQUIRE(past.tensor == sizes.size());
  REQUIRE(past.size() == 0);
}

// Order-recording fold and combine for the partition tests: "(acc,i)" and "[a|b]". Built by
// appending only (GCC 12 warns falsely about `"(" + str` under -O3 -Werror=restrict).
std::string cat(std::initializer_list<std::string_view> parts) {
  std::string s;
  for (auto p : parts) s.append(p);
  return s;
}
std::string fold_str(const std::string& acc, std::size_t i) {
  return cat({"(", acc, ",", std::to_string(i), ")"});
}
std::string combine_str(const std::string& a, const std::string& b) { return cat({"[", a, "|", b, "]"}); }

}  // namespace

TEST_CASE("chunk_count and chunk_range", "[chunking]") {
  constexpr std::size_t C = ck::chunk_elements;
  STATIC_REQUIRE(ck::chunk_count(0) == 0);
  STATIC_REQUIRE(ck::chunk_count(1) == 1);
  STATIC_REQUIRE(ck::chunk_count(C - 1) == 1);
  STATIC_REQUIRE(ck::chunk_count(C) == 1);
  STATIC_REQUIRE(ck::chunk_count(C + 1) == 2);
  STATIC_REQUIRE(ck::chunk_count(3 * C) == 3);
  STATIC_REQUIRE(ck::chunk_count(static_cast<std::size_t>(-1), 2) == static_cast<std::size_t>(-1) / 2 + 1);
  STATIC_REQUIRE(ck::is_power_of_two(ck::reduction_lanes));
  STATIC_REQUIRE(ck::is_power_of_two(ck::chunk_elements));
  STATIC_REQUIRE(!ck::is_power_of_two(0));
  STATIC_REQUIRE(!ck::is_power_of_two(12));

  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                        std::size_t{64}, std::size_t{65}}) {
    std::size_t next = 0;
    const std::size_t chunks = ck::chunk_count(n, 8);
    for (std::size_t c = 0; c < chunks; ++c) {
      const ck::element_range r = ck::chunk_range(n, c, 8);
      REQUIRE(r.begin == next);
      REQUIRE(r.size() >= 1);
      REQUIRE(r.size() <= 8);
      next = r.end;
    }
    REQUIRE(next == n);
    const ck::element_range past = ck::chunk_range(n, chunks, 8);
    REQUIRE(past.begin == n);
    REQUIRE(past.size() == 0);
  }
}

TEST_CASE("exclusive_chunk_prefix rejects bad arguments", "[chunking]") {
  const std::vector<std::size_t> sizes{1, 2, 3};
  std::vector<std::size_t> short_prefix(3);
  REQUIRE_THROWS_AS(ck::exclusive_chunk_prefix(sizes, short_prefix), gradapt::error);
  std::vector<std::size_t> prefix(4);
  REQUIRE_THROWS_AS(ck::exclusive_chunk_prefix(sizes, prefix, 0), gradapt::error);
  const std::vector<std::size_t> huge{static_cast<std::size_t>(-1), static_cast<std::size_t>(-1)};
  std::vector<std::size_t> p3(3);
  REQUIRE_THROWS_AS(ck::exclusive_chunk_prefix(huge, p3, 1), gradapt::error);
  try {
    ck::exclusive_chunk_prefix(sizes, short_prefix);
    FAIL("expected gradapt::error");
  } catch (const gradapt::error& e) {
    REQUIRE(std::string(e.what()).find("prefix has 3 slots for 3 tensors (expected 4)") != std::string::npos);
  }
}

TEST_CASE("locate_chunk on hand-made lists", "[chunking]") {
  constexpr std::size_t C = ck::chunk_elements;
  check_sizes({}, C);
  check_sizes({0}, C);
  check_sizes({0, 0, 0}, C);
  check_sizes({1}, C);
  check_sizes({C}, C);
  check_sizes({C + 1}, C);
  check_sizes({0, 1, 0, 0, C, 0, 2 * C, 1, 0}, C);
  check_sizes({0, 0, 5}, 4);
  check_sizes({5, 0, 0}, 4);
  check_sizes({4, 4, 4, 0, 8, 1}, 4);
  check_sizes({1, 1, 1, 1, 1}, 1);

  // Empty list: nothing to locate.
  const std::size_t zero = 0;
  const ck::chunk_location none = ck::locate_chunk(&zero, 0, 0, nullptr);
  REQUIRE(none.tensor == 0);
  REQUIRE(none.size() == 0);
}

TEST_CASE("locate_chunk matches brute force on random lists", "[chunking]") {
  std::mt19937_64 rng(20240611);
  const std::size_t chunks[] = {1, 3, 4, 64, 1000, ck::chunk_elements};
  for (std::size_t chunk : chunks) {
    for (int trial = 0; trial < 40; ++trial) {
      std::uniform_int_distribution<std::size_t> count_dist(0, trial < 20 ? 12 : 600);
      std::uniform_int_distribution<int> kind(0, 5);
      std::uniform_int_distribution<std::size_t> mult(1, 4);
      std::uniform_int_distribution<std::size_t> any(0, chunk * 5 + 7);
      std::vector<std::size_t> sizes(count_dist(rng));
      for (auto& s : sizes) {
        switch (kind(rng)) {
          case 0:
            s = 0;
            break;  // empty tensor
          case 1:
            s = 1;
            break;  // a scalar
          case 2:
            s = chunk * mult(rng);
            break;  // exactly a chunk multiple
          case 3:
            s = chunk * mult(rng) + 1;
            break;
          case 4:
            s = chunk * mult(rng) - 1;
            break;
          default:
            s = any(rng);
            break;
        }
      }
      INFO("trial " << trial << ", " << sizes.size() << " tensors, chunk " << chunk);
      check_sizes(sizes, chunk);
    }
  }
}

TEST_CASE("locate_chunk is usable in constant expressions", "[chunking]") {
  constexpr std::size_t sizes[] = {0, 3, 0, 8, 0};
  constexpr std::size_t prefix[] = {0, 0, 1, 1, 3, 3};
  constexpr ck::chunk_location a = ck::locate_chunk(prefix, 5, 0, sizes, 4);
  STATIC_REQUIRE(a.tensor == 1);
  STATIC_REQUIRE(a.begin == 0);
  STATIC_REQUIRE(a.end == 3);
  constexpr ck::chunk_location b = ck::locate_chunk(prefix, 5, 2, sizes, 4);
  STATIC_REQUIRE(b.tensor == 3);
  STATIC_REQUIRE(b.chunk_in_tensor == 1);
  STATIC_REQUIRE(b.begin == 4);
  STATIC_REQUIRE(b.end == 8);
  constexpr ck::chunk_location c = ck::locate_chunk(prefix, 5, 3, sizes, 4);
  STATIC_REQUIRE(c.tensor == 5);
}

TEST_CASE("lane_of partitions items round-robin", "[chunking]") {
  STATIC_REQUIRE(ck::lane_of(0) == 0);
  STATIC_REQUIRE(ck::lane_of(ck::reduction_lanes - 1) == ck::reduction_lanes - 1);
  STATIC_REQUIRE(ck::lane_of(ck::reduction_lanes) == 0);
  STATIC_REQUIRE(ck::lane_of(10, 4) == 2);
}

TEST_CASE("lane_tree_reduce follows the documented order", "[chunking]") {
  // Strings record the order: lane folds are "(acc,i)", tree steps are "[a|b]".
  const auto fold = fold_str;
  const auto combine = combine_str;

  // 4 lanes, 6 items: lane 0 gets 0,4; lane 1 gets 1,5; lanes 2,3 get 2,3.
  // Tree: s=2: a0=[a0|a2], a1=[a1|a3]; s=1: a0=[a0|a1].
  const std::string got = ck::lane_tree_reduce(6, std::string("e"), fold, combine, 4);
  REQUIRE(got == "[[((e,0),4)|(e,2)]|[((e,1),5)|(e,3)]]");

  // One lane: a plain left fold.
  REQUIRE(ck::lane_tree_reduce(3, std::string("e"), fold, combine, 1) == "(((e,0),1),2)");
  // No items: the identity through the tree.
  REQUIRE(ck::lane_tree_reduce(0, std::string("e"), fold, combine, 2) == "[e|e]");

  REQUIRE_THROWS_AS(
      ck::lane_tree_reduce(
          3, 0.0, [](double a, std::size_t) { return a; }, [](double a, double b) { return a + b; }, 6),
      gradapt::error);
}

TEST_CASE("chunked_tree_reduce: exact sums and the two-level order", "[chunking]") {
  const auto fold = fold_str;
  const auto combine = combine_str;
  // 5 elements, chunk 2, 2 lanes: chunks {0,1} {2,3} {4}; each chunk: lane0 = (e,first), lane1.
  const std::string got = ck::chunked_tree_reduce(5, std::string("e"), fold, combine, 2, 2);
  const std::string p0 = "[(e,0)|(e,1)]", p1 = "[(e,2)|(e,3)]", p2 = "[(e,4)|e]";
  // Second level: lane0 folds partials 0 and 2, lane1 folds partial 1.
  REQUIRE(got == combine(combine(combine("e", p0), p2), combine("e", p1)));

  // Integer sums are exact whatever the order: compare with the closed form.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{257},
                        ck::chunk_elements, 3 * ck::chunk_elements + 17}) {
    const auto s = ck::chunked_tree_reduce(
        n, std::uint64_t{0}, [](std::uint64_t a, std::size_t i) { return a + i; },
        [](std::uint64_t a, std::uint64_t b) { return a + b; });
    REQUIRE(s == static_cast<std::uint64_t>(n) * (n == 0 ? 0 : n - 1) / 2);
  }
  // Max is order-free: compare with a plain scan.
  std::mt19937 rng(7);
  std::vector<double> v(40000);
  for (auto& x : v) x = std::uniform_real_distribution<double>(-1e3, 1e3)(rng);
  double mx = 0;
  for (double x : v) mx = x > mx ? x : mx;
  const double got_max = ck::chunked_tree_reduce(
      v.size(), 0.0, [&](double a, std::size_t i) { return v[i] > a ? v[i] : a; },
      [](double a, double b) { return a > b ? a : b; });
  REQUIRE(got_max == mx);
  REQUIRE_THROWS_AS(
      ck::chunked_tree_reduce(
          4, 0.0, [](double a, std::size_t) { return a; }, [](double a, double b) { return a + b; }, 0),
      gradapt::error);
}

}  // namespace gradapt_test_chunking

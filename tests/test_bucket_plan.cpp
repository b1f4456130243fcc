// The bucket plan of fused gradient collectives: worked examples computed by hand (reverse
// registration order, the first bucket's smaller cap, one element type per bucket, an observed
// ready order), and over random layouts the properties every plan must have; the errors.
#include "catch.hpp"

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <vector>

#include "gradapt/bucket/plan.hpp"

namespace gradapt_test_bucket_plan {

using gradapt::dtype;
using gradapt::bucket::bucket_options;
using gradapt::bucket::bucket_plan;
using gradapt::bucket::tensor_info;

namespace {

/// Checks `p` against the rule of the file comment for tensors walked in `order`.
void check_plan(const bucket_plan& p, const std::vector<tensor_info>& ts,
                const std::vector<std::size_t>& order, const bucket_options& o) {
  std::vector<int> seen(ts.size(), 0);
  std::vector<std::size_t> rank_in_walk(ts.size());
  for (std::size_t i = 0; i < order.size(); ++i) rank_in_walk[order[i]] = i;
  std::vector<std::size_t> last_of_type(4, 0);
  for (std::size_t b = 0; b < p.buckets().size(); ++b)
    last_of_type[static_cast<std::size_t>(p.buckets()[b].type)] = b;
  for (std::size_t b = 0; b < p.buckets().size(); ++b) {
    const auto& k = p.buckets()[b];
    REQUIRE(!k.tensors.empty());
    std::size_t off = 0;
    for (std::size_t i = 0; i < k.tensors.size(); ++i) {
      const std::size_t t = k.tensors[i];
      REQUIRE(ts[t].type == k.type);
      REQUIRE(k.offsets[i] == off);
      REQUIRE(p.where(t).bucket == b);
      REQUIRE(p.where(t).offset == off);
      if (i > 0) REQUIRE(rank_in_walk[t] > rank_in_walk[k.tensors[i - 1]]);
      ++seen[t];
      off += ts[t].size;
    }
    REQUIRE(k.elements == off);
  }
  for (const int s : seen) REQUIRE(s == 1);
  // A bucket closed in the walk reached its cap with its last tensor and not before; which cap
  // applied depends on whether a bucket had closed before it, so check against the larger of
  // the two for "not before" and the smaller for "reached".
  const std::size_t lo = std::min(o.cap_bytes, o.first_cap_bytes),
                    hi = std::max(o.cap_bytes, o.first_cap_bytes);
  for (std::size_t b = 0; b < p.buckets().size(); ++b) {
    const auto& k = p.buckets()[b];
    const std::size_t before = k.bytes() - ts[k.tensors.back()].size * gradapt::size_of(k.type);
    REQUIRE(before < hi);
    if (b != last_of_type[static_cast<std::size_t>(k.type)]) REQUIRE(k.bytes() >= lo);
  }
}

std::vector<std::size_t> reversed(std::size_t n) {
  std::vector<std::size_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = n - 1 - i;
  return v;
}

}  // namespace

TEST_CASE("reverse registration order, a small first bucket, then the cap", "[bucket]") {
  // Bytes 20, 80, 12, 120, 16; walk 4, 3, 2, 1, 0. First cap 40: {4, 3} closes at 136 bytes.
  // Cap 100: {2, 1} holds 92, {2, 1, 0} closes at 112.
  const std::vector<tensor_info> ts{{5}, {20}, {3}, {30}, {4}};
  const bucket_options o{.cap_bytes = 100, .first_cap_bytes = 40};
  const auto p = bucket_plan::make(ts, o);
  REQUIRE(p.buckets().size() == 2);
  REQUIRE(p.buckets()[0].tensors == std::vector<std::size_t>{4, 3});
  REQUIRE(p.buckets()[0].offsets == std::vector<std::size_t>{0, 4});
  REQUIRE(p.buckets()[1].tensors == std::vector<std::size_t>{2, 1, 0});
  REQUIRE(p.buckets()[1].offsets == std::vector<std::size_t>{0, 3, 23});
  REQUIRE(p.buckets()[1].bytes() == 112);
  REQUIRE(p.where(1).bucket == 1);
  REQUIRE(p.where(1).offset == 3);
  REQUIRE(
      p.describe() ==
      "bucket_plan: 2 bucket(s) for 5 tensor(s)\n  bucket 0: float32, 136 bytes, tensors 4 3\n  bucket 1: "
      "float32, 112 bytes, tensors 2 1 0");
  check_plan(p, ts, reversed(ts.size()), o);
}

TEST_CASE("one element type per bucket; a tensor over the cap fills its own", "[bucket]") {
  // Walk 3, 2, 1, 0: t3 (bf16, 8 bytes) opens a bf16 bucket; t2 (float64, 800 bytes) opens a
  // float64 bucket that closes at once (first cap 64); t1 (float32, 40) opens a float32 bucket;
  // t0 (bf16, 100) joins t3's and closes it (108 >= 100); the float32 bucket closes at the end.
  const std::vector<tensor_info> ts{
      {50, dtype::bfloat16}, {10, dtype::float32}, {100, dtype::float64}, {4, dtype::bfloat16}};
  const bucket_options o{.cap_bytes = 100, .first_cap_bytes = 64};
  const auto p = bucket_plan::make(ts, o);
  REQUIRE(p.buckets().size() == 3);
  REQUIRE(p.buckets()[0].type == dtype::float64);
  REQUIRE(p.buckets()[0].tensors == std::vector<std::size_t>{2});
  REQUIRE(p.buckets()[1].type == dtype::bfloat16);
  REQUIRE(p.buckets()[1].tensors == std::vector<std::size_t>{3, 0});
  REQUIRE(p.buckets()[2].type == dtype::float32);
  REQUIRE(p.buckets()[2].tensors == std::vector<std::size_t>{1});
  check_plan(p, ts, reversed(ts.size()), o);
}

TEST_CASE("rebuild from an observed ready order", "[bucket]") {
  const std::vector<tensor_info> ts{{5}, {20}, {3}, {30}, {4}};
  const bucket_options o{.cap_bytes = 100, .first_cap_bytes = 40};
  const std::vector<std::size_t> ready{1, 0, 4, 2, 3};
  // t1 alone (80 bytes) reaches the first cap 40; then 20 + 16 + 12 = 48 < 100 and t3's 120
  // closes {0, 4, 2, 3} at 168.
  const auto p = bucket_plan::rebuild(ts, ready, o);
  REQUIRE(p.buckets().size() == 2);
  REQUIRE(p.buckets()[0].tensors == std::vector<std::size_t>{1});
  REQUIRE(p.buckets()[1].tensors == std::vector<std::size_t>{0, 4, 2, 3});
  check_plan(p, ts, ready, o);
  REQUIRE(bucket_plan::rebuild(ts, reversed(ts.size()), o) == bucket_plan::make(ts, o));
}

TEST_CASE("random layouts and orders: every property", "[bucket]") {
  std::mt19937_64 rng(7);
  for (int c = 0; c < 500; ++c) {
    std::vector<tensor_info> ts(rng() % 40);
    for (auto& t : ts) {
      t.size = rng() % 5 == 0 ? rng() % 5000 : rng() % 100;
      t.type = static_cast<dtype>(rng() % 4);
    }
    const bucket_options o{.cap_bytes = 1 + rng() % 4096, .first_cap_bytes = 1 + rng() % 1024};
    std::vector<std::size_t> order(ts.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    INFO("case " << c);
    check_plan(bucket_plan::make(ts, o), ts, reversed(ts.size()), o);
    const auto p = bucket_plan::rebuild(ts, order, o);
    check_plan(p, ts, order, o);
    REQUIRE(bucket_plan::rebuild(ts, order, o) == p);
  }
}

TEST_CASE("invalid plans are errors naming the tensor or option", "[bucket][validation]") {
  const std::vector<tensor_info> ts{{5}, {20}, {3}};
  REQUIRE_THROWS_WITH(bucket_plan::make(ts, {.cap_bytes = 0}), Catch::Matchers::Contains("cap_bytes is 0"));
  REQUIRE_THROWS_WITH(bucket_plan::make(ts, {.first_cap_bytes = 0}),
                      Catch::Matchers::Contains("first_cap_bytes is 0"));
  const std::vector<std::size_t> twice{0, 1, 1}, missing{0, 1}, outside{0, 1, 3};
  REQUIRE_THROWS_WITH(bucket_plan::rebuild(ts, twice), Catch::Matchers::Contains("tensor 1 appears twice"));
  REQUIRE_THROWS_WITH(bucket_plan::rebuild(ts, missing),
                      Catch::Matchers::Contains("lists 2 tensors but the plan has 3"));
  REQUIRE_THROWS_WITH(bucket_plan::rebuild(ts, outside),
                      Catch::Matchers::Contains("tensor 3 in the ready order is out of range"));
  REQUIRE_THROWS_WITH(bucket_plan::make(ts).where(3), Catch::Matchers::Contains("tensor 3 is out of range"));
  const std::vector<tensor_info> none;
  REQUIRE(bucket_plan::make(none).buckets().empty());
}

}  // namespace gradapt_test_bucket_plan

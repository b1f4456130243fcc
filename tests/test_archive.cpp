// The state archive (core/archive.hpp) and its checksum (core/crc32c.hpp).
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/crc32c.hpp"

namespace gradapt_test_archive {

using Catch::Matchers::Contains;
using gradapt::archive_reader;
using gradapt::archive_writer;

namespace {
std::vector<std::byte> bytes_of(const std::vector<unsigned>& v) {
  std::vector<std::byte> b;
  for (unsigned x : v) b.push_back(static_cast<std::byte>(x));
  return b;
}

std::vector<std::byte> sample() {
  archive_writer w{"gradapt.test", 2};
  w.put("count", std::uint64_t{4200});
  w.put("offset", std::int64_t{-7});
  w.put("scale", 0.1);
  w.put("flag", true);
  w.put("label", std::string_view("adamw"));
  w.begin("buffers");
  const std::vector<float> m = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 6.0f};
  const std::int64_t shape[] = {2, 3};
  w.put_tensor<float>("m/layer.weight", m, shape);
  const std::vector<double> v = {std::numeric_limits<double>::denorm_min(), 1e300};
  w.put_tensor<double>("v", v);
  w.end();
  return w.finish();
}
}  // namespace

TEST_CASE("crc32c: the RFC 3720 B.4 test vectors", "[archive]") {
  REQUIRE(gradapt::crc32c(std::vector<std::byte>(32, std::byte{0})) == 0x8A9136AAu);
  REQUIRE(gradapt::crc32c(std::vector<std::byte>(32, std::byte{0xFF})) == 0x62A8AB43u);
  std::vector<unsigned> inc, dec;
  for (unsigned i = 0; i < 32; ++i) {
    inc.push_back(i);
    dec.push_back(31 - i);
  }
  REQUIRE(gradapt::crc32c(bytes_of(inc)) == 0x46DD794Eu);
  REQUIRE(gradapt::crc32c(bytes_of(dec)) == 0x113FDB5Cu);
  const std::string check = "123456789";
  REQUIRE(gradapt::crc32c(std::as_bytes(std::span(check.data(), check.size()))) == 0xE3069283u);
  // Incremental form: any split gives the whole CRC (exercises the 8-byte and tail loops).
  std::vector<std::byte> big;
  for (unsigned i = 0; i < 1000; ++i) big.push_back(static_cast<std::byte>((i * 37u + 11u) & 0xFFu));
  const std::uint32_t whole = gradapt::crc32c(big);
  for (std::size_t cut : {0u, 1u, 7u, 8u, 9u, 500u, 999u, 1000u}) {
    const std::span<const std::byte> s(big);
    REQUIRE(gradapt::crc32c_update(gradapt::crc32c(s.first(cut)), s.subspan(cut)) == whole);
  }
}

TEST_CASE("archive: every field type round-trips bit for bit", "[archive]") {
  const auto bytes = sample();
  archive_reader r{bytes, "gradapt.test", 2};
  REQUIRE(r.kind() == "gradapt.test");
  REQUIRE(r.version() == 2);
  REQUIRE(r.get<std::uint64_t>("count") == 4200);
  REQUIRE(r.get<std::int64_t>("offset") == -7);
  REQUIRE(r.get<double>("scale") == 0.1);
  REQUIRE(r.get<bool>("flag"));
  REQUIRE(r.get<std::string>("label") == "adamw");
  const auto label = r.get<std::string_view>("label");  // in place: a view into the bytes
  REQUIRE(label == "adamw");
  REQUIRE(reinterpret_cast<const std::byte*>(label.data()) > bytes.data());
  REQUIRE(reinterpret_cast<const std::byte*>(label.data()) + label.size() <= bytes.data() + bytes.size());
  REQUIRE_THROWS_AS(r.get<std::string_view>("count"), gradapt::error);  // a u64, not a string
  REQUIRE(r.names("buffers") == std::vector<std::string>{"buffers/m/layer.weight", "buffers/v"});
  r.begin("buffers");
  REQUIRE(r.names() == std::vector<std::string>{"m/layer.weight", "v"});
  const auto info = r.tensor_info("m/layer.weight");
  REQUIRE(info.element == gradapt::archive_element::float32);
  REQUIRE(info.shape == std::vector<std::int64_t>{2, 3});
  REQUIRE(info.elements == 6);
  std::vector<float> m(6);
  const std::int64_t shape[] = {2, 3};
  r.get_tensor<float>("m/layer.weight", m, shape);
  REQUIRE(std::bit_cast<std::uint32_t>(m[4]) == 0x80000000u);  // -0.0 kept
  REQUIRE(m[2] == 3.25f);
  const auto v = r.get_tensor<double>("v");
  REQUIRE(v.size() == 2);
  REQUIRE(v[0] == std::numeric_limits<double>::denorm_min());
  r.end();
  r.finish();
  // The same contents written again give the same bytes.
  REQUIRE(sample() == bytes);
}

TEST_CASE("archive: the layout is little-endian and fixed", "[archive]") {
  archive_writer w{"k", 1};
  w.put("a", std::uint64_t{0x0102030405060708ull});
  const auto b = w.finish();
  // magic 8 + format 4 + kind length 4 + "k" 1 + version 4 + count 8 + name length 4 + "a" 1
  // + type 1, then the value's lowest byte first.
  const std::size_t at = 8 + 4 + 4 + 1 + 4 + 8 + 4 + 1 + 1;
  REQUIRE(b.size() == at + 8 + 4);
  REQUIRE(static_cast<unsigned>(b[at]) == 0x08);
  REQUIRE(static_cast<unsigned>(b[at + 7]) == 0x01);
  REQUIRE(static_cast<unsigned>(b[8]) == 1);  // container format 1, little-endian
}

TEST_CASE("archive: a writer reused after finish() starts an archive with none of the earlier fields",
          "[archive]") {
  archive_writer w{"k", 1};
  w.reserve(256);
  w.put("a", std::uint64_t{1});
  w.put("b", 2.5);
  const auto first = w.finish();
  w.put("a", std::uint64_t{7});  // the name is free again
  const std::size_t before = w.size();
  const auto second = w.finish();
  REQUIRE(second.size() == before + 4);  // finish() adds only the CRC32C
  archive_reader r1{first, "k", 1};
  REQUIRE(r1.get<std::uint64_t>("a") == 1);
  REQUIRE(r1.get<double>("b") == 2.5);
  r1.finish();
  archive_reader r2{second, "k", 1};
  REQUIRE(r2.get<std::uint64_t>("a") == 7);
  REQUIRE_FALSE(r2.has("b"));
  r2.finish();
}

TEST_CASE("archive: misuse and mismatches are errors that say what to fix", "[archive]") {
  const auto bytes = sample();
  REQUIRE_THROWS_WITH((archive_reader{bytes, "gradapt.other", 2}), Contains("'gradapt.test' archive"));
  REQUIRE_THROWS_WITH((archive_reader{bytes, "gradapt.test", 1}), Contains("format version 2"));
  REQUIRE_THROWS_WITH((archive_reader{std::span(bytes).first(10), "gradapt.test", 2}), Contains("too few"));
  REQUIRE_THROWS_WITH((archive_reader{std::span(bytes).first(bytes.size() - 1), "gradapt.test", 2}),
                      Contains("checksum"));
  std::vector<std::byte> junk(64, std::byte{1});
  REQUIRE_THROWS_WITH((archive_reader{junk, "gradapt.test", 2}), Contains("not a gradapt state archive"));

  archive_reader r{bytes, "gradapt.test", 2};
  REQUIRE_THROWS_WITH(r.get<std::uint64_t>("missing"), Contains("no field 'missing'"));
  REQUIRE_THROWS_WITH(r.get<double>("count"), Contains("'count' is a u64, expected a f64"));
  REQUIRE_THROWS_WITH(r.get<std::uint8_t>("count"), Contains("too large"));
  REQUIRE_THROWS_WITH(r.get<float>("scale"), Contains("not exactly representable"));
  const std::int64_t wrong[] = {3, 2};
  std::vector<float> m(6);
  REQUIRE_THROWS_WITH(r.get_tensor<float>("buffers/m/layer.weight", m, wrong),
                      Contains("shape [2, 3], expected [3, 2]"));
  std::vector<double> md(6);
  const std::int64_t right[] = {2, 3};
  REQUIRE_THROWS_WITH(r.get_tensor<double>("buffers/m/layer.weight", md, right),
                      Contains("holds float32 elements, expected float64"));
  REQUIRE_THROWS_WITH(r.finish(), Contains("was not read"));

  archive_writer w{"k", 1};
  w.put("x", 1.0);
  REQUIRE_THROWS_WITH(w.put("x", 2.0), Contains("'x' written twice"));
  const std::vector<float> three(3);
  const std::int64_t two[] = {2};
  REQUIRE_THROWS_WITH(w.put_tensor<float>("t", three, two), Contains("has 3 elements but its shape holds 2"));
  w.begin("s");
  REQUIRE_THROWS_WITH(w.finish(), Contains("still open"));
  REQUIRE_THROWS_WITH((archive_writer{"", 1}), Contains("kind"));
}

TEST_CASE("archive: every single-bit flip is rejected", "[archive]") {
  const auto good = sample();
  std::size_t rejected = 0;
  for (std::size_t i = 0; i < good.size() * 8; ++i) {
    auto bad = good;
    bad[i / 8] ^= static_cast<std::byte>(1u << (i % 8));
    try {
      archive_reader r{bad, "gradapt.test", 2};
    } catch (const gradapt::error&) {
      ++rejected;
    }
  }
  REQUIRE(rejected == good.size() * 8);
}

TEST_CASE("archive: a consistent archive with a lying length is rejected, not read past its end",
          "[archive]") {
  // Re-checksummed archives whose tensor extents announce more elements than are stored.
  auto bytes = sample();
  const std::size_t body = bytes.size() - 4;
  for (std::size_t at = 40; at < body; ++at) {
    auto bad = bytes;
    bad[at] = static_cast<std::byte>(0xFF);
    const std::uint32_t crc = gradapt::crc32c(std::span<const std::byte>(bad).first(body));
    for (int k = 0; k < 4; ++k)
      bad[body + static_cast<std::size_t>(k)] = static_cast<std::byte>((crc >> (8 * k)) & 0xFFu);
    try {
      archive_reader r{bad, "gradapt.test", 2};
      // Parsed: every tensor it announces lies inside the archive.
      std::uint64_t held = 0;
      for (const auto& n : r.names())
        if (r.type(n) == gradapt::archive_field::tensor) {
          const auto info = r.tensor_info(n);
          held += info.elements * gradapt::size_of(info.element);
        }
      REQUIRE(held <= bad.size());
    } catch (const gradapt::error&) {
    }
  }
}

}  // namespace gradapt_test_archive

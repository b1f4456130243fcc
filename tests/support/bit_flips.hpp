#pragma once
// The every-bit-flip check shared by the checkpoint tests (tests/test_checkpoint_bitflip.cpp,
// and the states that need another library, such as K-FAC's in tests/test_kfac.cpp).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "catch.hpp"
#include "gradapt/core/crc32c.hpp"
#include "gradapt/core/error.hpp"
#include "sanitizer.hpp"

namespace gradapt_test {

/// Rewrites the archive's closing CRC32C (its last 4 bytes, little-endian) over the rest, so a
/// deliberately edited field reaches the load's value checks behind the checksum.
inline void reseal(std::vector<std::byte>& archive) {
  const std::uint32_t crc = gradapt::crc32c(std::span<const std::byte>(archive.data(), archive.size() - 4));
  for (std::size_t i = 0; i < 4; ++i)
    archive[archive.size() - 4 + i] = static_cast<std::byte>((crc >> (8 * i)) & 0xFFu);
}

/// Whether flip_every_bit flips bit `i` of an archive of `bytes` bytes. Without a sanitizer:
/// every bit. Under one (whose loads cost tens of times more, and which looks for memory and UB
/// errors the loader's parsing paths reach on the same code) every bit of the first 256 and the
/// last 64 bytes, where the header, the field tags and the checksum are, and every 37th bit
/// between them (37 is prime to 8, so every bit position of a byte is visited). The default
/// preset runs the same tests on every bit.
inline bool flips_bit(std::size_t bytes, std::size_t i) {
  if constexpr (!under_sanitizer) return true;
  const std::size_t byte = i / 8;
  return byte < 256 || byte + 64 >= bytes || i % 37 == 0;
}

/// The number of bits flip_every_bit flips in an archive of `bytes` bytes.
inline std::size_t flips_for(std::size_t bytes) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < bytes * 8; ++i) n += flips_bit(bytes, i) ? 1 : 0;
  return n;
}

/// Flips every bit of `good` in turn (under a sanitizer, the bits flips_bit names); `load`
/// must throw gradapt::error each time and `save` must still give `good`. Returns the number
/// of flips tried.
template <class Load, class Save>
std::size_t flip_every_bit(const std::vector<std::byte>& good, Load&& load, Save&& save) {
  std::size_t rejected = 0;
  auto bad = good;
  for (std::size_t i = 0; i < good.size() * 8; ++i) {
    if (!flips_bit(good.size(), i)) continue;
    const auto mask = static_cast<std::byte>(1u << (i % 8));
    bad[i / 8] ^= mask;
    bool threw = false;
    try {
      load(std::span<const std::byte>(bad));
    } catch (const gradapt::error&) {
      threw = true;
    }
    bad[i / 8] ^= mask;
    if (!threw) FAIL("bit " << i << " of " << good.size() * 8 << " flipped and the load was accepted");
    ++rejected;
  }
  REQUIRE(save() == good);
  return rejected;
}

}  // namespace gradapt_test

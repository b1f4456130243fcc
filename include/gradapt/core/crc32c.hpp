#pragma once
/// @file
/// CRC32C (Castagnoli): the checksum of gradapt's state archive.
///
/// The CRC with the reflected polynomial 0x82F63B78 (iSCSI, RFC 3720 appendix B.4; ext4,
/// Btrfs and SCTP use it), initial value and final xor 0xFFFFFFFF. Any single-bit error, any
/// two-bit error within 2^31 bits and any burst of up to 32 bits changes it. The code is the
/// standard table-driven "slicing-by-8" form (8 tables of 256 entries, built at compile
/// time); the result does not depend on the host's byte order. tests/test_archive.cpp checks
/// it against the RFC 3720 test vectors.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace gradapt {

namespace detail::crc32c_impl {

inline constexpr std::uint32_t polynomial = 0x82F63B78u;

constexpr std::array<std::array<std::uint32_t, 256>, 8> make_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ polynomial : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t j = 1; j < 8; ++j)
    for (std::size_t i = 0; i < 256; ++i) t[j][i] = (t[j - 1][i] >> 8) ^ t[0][t[j - 1][i] & 0xFFu];
  return t;
}

inline constexpr auto tables = make_tables();

}  // namespace detail::crc32c_impl

/// Continues a CRC32C over `bytes`: `crc32c_update(crc32c_update(0, a), b)` equals the
/// CRC32C of a followed by b. Start with 0.
inline std::uint32_t crc32c_update(std::uint32_t crc, std::span<const std::byte> bytes) noexcept {
  const auto& t = detail::crc32c_impl::tables;
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  while (n >= 8) {
    const std::uint32_t lo =
        c ^ (static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
             static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][static_cast<std::uint32_t>(p[4])] ^ t[2][static_cast<std::uint32_t>(p[5])] ^
        t[1][static_cast<std::uint32_t>(p[6])] ^ t[0][static_cast<std::uint32_t>(p[7])];
    p += 8;
    n -= 8;
  }
  for (; n; --n, ++p) c = (c >> 8) ^ t[0][(c ^ static_cast<std::uint32_t>(*p)) & 0xFFu];
  return ~c;
}

/// The CRC32C of `bytes`.
inline std::uint32_t crc32c(std::span<const std::byte> bytes) noexcept { return crc32c_update(0, bytes); }

}  // namespace gradapt

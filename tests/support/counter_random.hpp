// splitmix64 (Steele, Lea and Flood; Vigna's constants) as the tests use it:
//  - splitmix64(x): the counter-based hash of the peer-reference generator of
//    tests/data/peer_refs.py (make_*_refs.py), reproduced bit for bit;
//  - peer_values(seed, n, log2_scale): that generator's inputs (exact float32 values);
//  - splitmix64_stream: the sequential generator (state += golden gamma, then the same mix),
//    with signed_unit() for doubles in [-1, 1).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradapt_test {

inline constexpr std::uint64_t splitmix64_gamma = 0x9E3779B97F4A7C15ull;

/// splitmix64's output function (the mix of the state once it has advanced).
constexpr std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The counter-based hash: splitmix64's output for state x.
constexpr std::uint64_t splitmix64(std::uint64_t x) { return splitmix64_mix(x + splitmix64_gamma); }

/// The peer-reference generator (tests/data/peer_refs.py: values): n values
/// k * 2^(log2_scale - 23), k a signed 24-bit integer from splitmix64(seed * 0x100000001B3 + i),
/// so every value is exact in float.
inline std::vector<float> peer_values(std::uint64_t seed, std::size_t n, int log2_scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t u = splitmix64(seed * 0x100000001B3ull + i);
    const auto k = static_cast<std::int64_t>(u >> 40) - (std::int64_t{1} << 23);
    v[i] = static_cast<float>(std::ldexp(static_cast<double>(k), log2_scale - 23));
  }
  return v;
}

/// Sequential splitmix64: each call advances the state by the golden gamma and mixes it.
struct splitmix64_stream {
  std::uint64_t state;
  std::uint64_t operator()() { return splitmix64_mix(state += splitmix64_gamma); }
};

/// 2u - 1 for u the top 53 bits of z as a fraction: a double in [-1, 1) (exact).
constexpr double signed_unit(std::uint64_t z) {
  const double u = static_cast<double>(z >> 11) * 0x1.0p-53;
  return 2 * u - 1;
}

}  // namespace gradapt_test

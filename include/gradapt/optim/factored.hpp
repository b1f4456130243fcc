#pragma once
/// @file
/// Shared pieces of the factored optimizers (gradapt::adafactor, gradapt::sm3): the backend
/// concept they need (row and column reductions over a 2-D view of a tensor), the choice of
/// the two factored axes, and checkpoint helpers.
///
/// A tensor whose factored axes are p < q is seen as the row-major shape [A, X, B, Y, C]
/// with X = shape[p], Y = shape[q], A, B, C the products of the dims before p, between p and
/// q, and after q. The backend's `reduce_factored` reduces over Y (one value per
/// [A, X, B, C]) and over X (one value per [A, B, Y, C]) in one call; `apply_factored` runs
/// an element functor that gets the row entry and the column entry of each element.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/factoring.hpp"

namespace gradapt {

// `factored_backend` (the backend concept these optimizers need) is defined in
// optim/chain.hpp, next to `optimizer_backend`, so that a chain with a factored stage checks it.

namespace detail::optim {

/// First bytes of an adafactor or sm3 checkpoint (a kind field follows the version).
inline constexpr char factored_magic[8] = {'g', 'r', 'a', 'd', 'a', 'p', 't', 'F'};

/// Appends raw bytes to a checkpoint.
inline void put_bytes(std::vector<std::byte>& out, const void* p, std::size_t n) {
  const auto* c = static_cast<const std::byte*>(p);
  out.insert(out.end(), c, c + n);
}
inline void put_u64(std::vector<std::byte>& out, std::uint64_t v) { put_bytes(out, &v, sizeof v); }

/// Reads a checkpoint written with put_u64/put_bytes, naming `who` in its errors.
struct byte_reader {
  std::span<const std::byte> bytes;
  const char* who;
  std::size_t at = 0;
  void take(void* dst, std::size_t n, const char* what) {
    detail::require(at + n <= bytes.size(), who, ": the checkpoint ends inside ", what, " (", bytes.size(),
                    " bytes; truncated?)");
    if (n) std::memcpy(dst, bytes.data() + at, n);
    at += n;
  }
  std::uint64_t u64(const char* what) {
    std::uint64_t v = 0;
    take(&v, sizeof v, what);
    return v;
  }
  void expect(const char* what, std::uint64_t want) {
    const std::uint64_t got = u64(what);
    detail::require(
        got == want, who, ": the checkpoint's ", what, " is ", got, " but this state's is ", want,
        " (restore into a state created by the same optimizer and options for the same parameters)");
  }
};

}  // namespace detail::optim
}  // namespace gradapt

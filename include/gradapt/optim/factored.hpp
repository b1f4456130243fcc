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
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/optim/chain.hpp"
#include "gradapt/optim/factoring.hpp"

namespace gradapt {

// `factored_backend` (the backend concept these optimizers need) is defined in
// optim/chain.hpp, next to `optimizer_backend`, so that a chain with a factored stage checks it.

namespace detail::optim {

/// Writes n elements of state at `data` (in the backend's memory) as a 1-d tensor field.
template <class S, class B>
void put_state_buffer(const B& b, archive_writer& w, std::string_view name, const S* data, std::size_t n) {
  std::vector<S> host(n);
  b.copy(tensor_view<const S, typename B::space>::vector(data, static_cast<std::int64_t>(n)),
         host_view(host));
  w.put_tensor<S>(name, host);
}

/// Reads a 1-d tensor field of n state elements written by put_state_buffer into host memory
/// and checks that every element is finite; `who` names the state in errors.
template <class S>
std::vector<S> get_state_buffer(archive_reader& r, std::string_view name, std::size_t n, const char* who) {
  detail::require(r.has(name), who, ": the checkpoint has no '", name, "'");
  std::vector<S> host(n);
  r.get_tensor<S>(name, std::span<S>(host));
  for (const S& x : host)
    detail::require(std::isfinite(static_cast<double>(static_cast<compute_t<S>>(x))), who, ": '", name,
                    "' holds a non-finite value; a checkpoint of a diverged run cannot be resumed");
  return host;
}

/// Writes a per-tensor layout table (one row of `cols` integers per tensor) as a 2-d field.
inline void put_layout(archive_writer& w, const std::vector<std::int64_t>& rows, std::size_t cols) {
  const std::int64_t shape[] = {static_cast<std::int64_t>(cols ? rows.size() / cols : 0),
                                static_cast<std::int64_t>(cols)};
  w.put_tensor<std::int64_t>("layout", rows, shape);
}

/// Reads the layout table and requires it equal to `want` (the state's own), naming `who`
/// and the first tensor that differs.
inline void expect_layout(archive_reader& r, const std::vector<std::int64_t>& want, std::size_t cols,
                          const char* who, const char* columns) {
  const std::int64_t shape[] = {static_cast<std::int64_t>(cols ? want.size() / cols : 0),
                                static_cast<std::int64_t>(cols)};
  detail::require(r.has("layout"), who, ": the checkpoint has no tensor layout");
  const auto info = r.tensor_info("layout");
  detail::require(
      info.shape.size() == 2 && info.shape[0] == shape[0] && info.shape[1] == shape[1], who,
      ": the checkpoint describes ", info.shape.empty() ? 0 : info.shape[0], " tensors but this state has ",
      shape[0], " (restore into a state created by the same optimizer and options for the same parameters)");
  std::vector<std::int64_t> got(want.size());
  r.get_tensor<std::int64_t>("layout", std::span<std::int64_t>(got), shape);
  for (std::size_t k = 0; k < got.size(); ++k)
    detail::require(got[k] == want[k], who, ": tensor ", k / cols, "'s layout (", columns,
                    ") differs from this state's in column ", k % cols, ": ", got[k], " vs ", want[k],
                    " (same shapes and factoring options)");
}

}  // namespace detail::optim
}  // namespace gradapt

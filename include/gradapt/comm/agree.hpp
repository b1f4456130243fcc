#pragma once
/// @file
/// Agreement across ranks for library-level operations, on any host communicator (and on a
/// device communicator through a backend buffer, `agree_values(comm, backend, ...)`): the values
/// every rank must pass equal (options, schedules, batch descriptions) and the identity of the
/// operation itself, checked with one small allreduce. A difference is a gradapt::error on
/// every rank that names the operation, the value and the range the ranks pass, instead of
/// replicas that drift apart or a collective that pairs with the wrong one and hangs.
///
/// Cost: one `allreduce(max)` of 2·(n + 1) + 1 doubles, where n is the number of values; callers
/// agree once per configuration (at construction or first use), not per step.

#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// One value that must be equal on every rank, named for the error message.
struct agreed_value {
  std::string_view name;  ///< the option's public name, e.g. "period"
  double value;           ///< its value on this rank (integers up to 2^53 are exact)
};

/// A list of at most N agreed values that allocates nothing (for checks on a step path).
template <std::size_t N>
struct agreed_list {
  std::array<agreed_value, N> items{};  ///< the values, [0, count) in use
  std::size_t count = 0;                ///< values in use
  /// Appends one value. @throws gradapt::error when the list is full
  void push(std::string_view name, double value) {
    if (count == N)
      throw error(
          std::string("gradapt: agreed_list: more than ").append(std::to_string(N)).append(" values"));
    items[count++] = {name, value};
  }
  /// The values in use.
  std::span<const agreed_value> view() const { return {items.data(), count}; }
};

namespace detail {

/// A 52-bit FNV-1a hash of `s`, exactly representable as a double: the operation's tag.
constexpr double operation_tag(std::string_view s) {
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return static_cast<double>(h >> 12);
}

/// Text of a double for messages that tells any two different values apart (integers
/// without a fraction, others with 17 significant digits).
inline std::string value_text(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9007199254740992.0)
    return std::to_string(static_cast<std::int64_t>(v));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace detail

namespace detail {

/// Allreduces `v` (host memory) on `comm`: directly on a host communicator, through device
/// memory of backend `b` (copied in, reduced, copied back; the copy back waits for the
/// stream) on a device communicator. That memory is `b.staging(n)` when the backend lends it
/// (gradapt::cuda: its workspace, so an agreement on the step path allocates nothing after
/// the first), otherwise a buffer allocated for the call.
template <class C, class B>
void allreduce_host_values(C& comm, const B& b, std::span<double> v, reduce_op op) {
  if constexpr (std::same_as<typename C::space, host_space>) {
    (void)b;
    comm.allreduce(tensor_view<double, host_space>::vector(v.data(), static_cast<std::int64_t>(v.size())),
                   op);
  } else {
    const auto n = static_cast<std::int64_t>(v.size());
    [[maybe_unused]] decltype(b.template allocate<double>(std::size_t{})) own{};
    double* d = nullptr;
    if constexpr (staging_backend<B>) {
      d = b.staging(v.size());
    } else {
      own = b.template allocate<double>(v.size());
      d = own.data();
    }
    const tensor_view<double, typename C::space> dv = tensor_view<double, typename C::space>::vector(d, n);
    b.copy(tensor_view<const double, host_space>::vector(v.data(), n), dv);
    comm.allreduce(dv, op);
    b.copy(tensor_view<const double, typename C::space>::vector(d, n),
           tensor_view<double, host_space>::vector(v.data(), n));
  }
}

/// agree_values with the allreduce(max) of its words done by `allreduce_max(span)`. With a
/// non-empty `share` (k finite values of this rank), `shared` (k × ranks words) receives every
/// rank's k values in rank order, carried by the same allreduce: each rank writes its own k
/// words and -inf in the others', so the max is an allgather.
template <class C, class R>
void agree_values_with(C& comm, std::string_view who, std::span<const agreed_value> values,
                       const std::string& local_error, R&& allreduce_max, std::span<const double> share = {},
                       std::span<double> shared = {}, std::vector<double>* workspace = nullptr) {
  const double tag = detail::operation_tag(who);
  // On the stack for up to 30 values (checks on a step path allocate nothing).
  const std::size_t base = 2 * (values.size() + 1) + 1;
  const std::size_t words = base + shared.size();
  std::array<double, 64> small;
  std::vector<double> large;
  std::vector<double>& heap = workspace ? *workspace : large;
  if (words > small.size()) heap.resize(words);
  const std::span<double> v =
      words <= small.size() ? std::span<double>(small.data(), words) : std::span<double>(heap.data(), words);
  if (!shared.empty()) {
    const std::size_t k = share.size();
    const auto me = static_cast<std::size_t>(comm.rank());
    for (std::size_t i = base; i < words; ++i) v[i] = -HUGE_VAL;
    for (std::size_t j = 0; j < k; ++j) v[base + me * k + j] = share[j];
  }
  v[0] = tag;
  v[1] = -tag;
  for (std::size_t i = 0; i < values.size(); ++i) {
    // NaN on any rank: +inf in both halves, so max and -min disagree everywhere.
    const double x = values[i].value;
    const bool nan = x != x;
    v[2 * i + 2] = nan ? HUGE_VAL : x;
    v[2 * i + 3] = nan ? HUGE_VAL : -x;
  }
  // The lowest rank with invalid input, as -rank (or -inf when every rank's input is valid).
  v[base - 1] = local_error.empty() ? -HUGE_VAL : -static_cast<double>(comm.rank());
  allreduce_max(v);
  if (!local_error.empty()) throw error(local_error);
  if (v[base - 1] != -HUGE_VAL)
    detail::fail(who, " on rank ", comm.rank(), ": rank ", -v[base - 1],
                 " passed invalid input (that rank's error says which)");
  if (v[0] != tag || v[1] != -tag)
    detail::fail(who, " on rank ", comm.rank(),
                 ": the ranks are not in the same operation (another rank called a different gradapt "
                 "operation at this point); every rank must call ",
                 who, " together");
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double hi = v[2 * i + 2], lo = -v[2 * i + 3];
    if (hi == lo) continue;
    detail::fail(who, " on rank ", comm.rank(), ": ", values[i].name, " is ",
                 detail::value_text(values[i].value), " on this rank but ranges from ",
                 detail::value_text(lo), " to ", detail::value_text(hi),
                 " across ranks (every rank must pass the same ", values[i].name, ")");
  }
  for (std::size_t i = 0; i < shared.size(); ++i) shared[i] = v[base + i];
}

/// agree_values_and_share's body with the allreduce(max) of its words done by `allreduce_max`.
template <class C, class R>
void agree_and_share_with(C& comm, std::string_view who, std::span<const agreed_value> values,
                          std::span<const double> share, std::span<double> shared,
                          const std::string& local_error, std::vector<double>* workspace, R&& allreduce_max) {
  detail::require(shared.size() == share.size() * static_cast<std::size_t>(comm.size()), who, " on rank ",
                  comm.rank(), ": agree_values_and_share: ", shared.size(), " words for ", share.size(),
                  " values from each of ", comm.size(), " ranks");
  std::string bad = local_error;
  std::vector<double> clean;
  for (const double x : share) {
    if (std::isfinite(x)) continue;
    if (bad.empty())
      bad = detail::message(who, " on rank ", comm.rank(), ": a shared value is ", x, " (expected finite)");
    clean.assign(share.size(), 0.0);
  }
  if (!clean.empty()) share = clean;
  agree_values_with(comm, who, values, bad, allreduce_max, share, shared, workspace);
}

}  // namespace detail

/// Checks that every rank of `comm` entered operation `who` (e.g. "local_sgd") with the same
/// `values`. Collective: every rank must call it (with its own values). Throws gradapt::error
/// on every rank when the operation or a value differs, naming the first that does, this
/// rank's value and the smallest and largest any rank passes. A NaN value differs from
/// everything. A rank whose own input is invalid passes its message as `local_error`: it
/// throws that message and every other rank throws naming it, so nobody is left waiting. Host
/// communicators; a device communicator agrees through a backend (the overload below).
template <class C>
requires std::same_as<typename C::space, host_space>
void agree_values(C& comm, std::string_view who, std::span<const agreed_value> values,
                  const std::string& local_error = {}) {
  detail::agree_values_with(comm, who, values, local_error, [&](std::span<double> v) {
    comm.allreduce(tensor_view<double, host_space>::vector(v.data(), static_cast<std::int64_t>(v.size())),
                   reduce_op::max);
  });
}

/// agree_values that also shares this rank's `share` values (k finite numbers, the same k on
/// every rank) with every rank, in the same allreduce: `shared` (k × comm.size() words) receives
/// rank r's values at [r·k, r·k + k). Costs k × comm.size() more words than agree_values; a
/// step that must agree anyway gathers per-rank measurements (times) at no extra collective.
/// A value that is not finite is this rank's invalid input (an error on every rank, as
/// `local_error`). k must be the same on every rank (the words of the allreduce). A
/// `workspace` kept by the caller holds the words beyond a stack buffer of 64, so repeated
/// calls allocate nothing.
/// @throws gradapt::error as agree_values, or when shared.size() != k × comm.size()
template <class C>
requires std::same_as<typename C::space, host_space>
void agree_values_and_share(C& comm, std::string_view who, std::span<const agreed_value> values,
                            std::span<const double> share, std::span<double> shared,
                            const std::string& local_error = {}, std::vector<double>* workspace = nullptr) {
  detail::agree_and_share_with(
      comm, who, values, share, shared, local_error, workspace, [&](std::span<double> v) {
        comm.allreduce(tensor_view<double, host_space>::vector(v.data(), static_cast<std::int64_t>(v.size())),
                       reduce_op::max);
      });
}

/// agree_values_and_share on any communicator: the words travel through a buffer of backend
/// `b` in the communicator's memory space (copied in and out; on CUDA the copy back waits for
/// the stream), otherwise as above.
template <class C, class B>
requires std::same_as<typename C::space, typename B::space>
void agree_values_and_share(C& comm, const B& b, std::string_view who, std::span<const agreed_value> values,
                            std::span<const double> share, std::span<double> shared,
                            const std::string& local_error = {}, std::vector<double>* workspace = nullptr) {
  detail::agree_and_share_with(
      comm, who, values, share, shared, local_error, workspace,
      [&](std::span<double> v) { detail::allreduce_host_values(comm, b, v, reduce_op::max); });
}

/// agree_values on any communicator: the values travel through a buffer of backend `b` in the
/// communicator's memory space (a device buffer, copied in and out, for NCCL), otherwise as above.
template <class C, class B>
requires std::same_as<typename C::space, typename B::space>
void agree_values(C& comm, const B& b, std::string_view who, std::span<const agreed_value> values,
                  const std::string& local_error = {}) {
  detail::agree_values_with(comm, who, values, local_error, [&](std::span<double> v) {
    detail::allreduce_host_values(comm, b, v, reduce_op::max);
  });
}

/// agree_values over an initializer list: `agree_values(comm, "local_sgd", {{"period", 4.0}})`.
template <class C>
requires std::same_as<typename C::space, host_space>
void agree_values(C& comm, std::string_view who, std::initializer_list<agreed_value> values,
                  const std::string& local_error = {}) {
  agree_values(comm, who, std::span<const agreed_value>(values.begin(), values.size()), local_error);
}

}  // namespace gradapt

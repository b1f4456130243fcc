#pragma once
/// @file
/// Model averaging: every rank's copy of a set of tensors (parameters, buffers, optimizer
/// state) is replaced by the mean over the ranks of a communicator,
///
///     x ← (1/N) Σ_r x_r ,
///
/// computed as one in-place allreduce (sum) per tensor followed by one element-wise division
/// by N on the backend. This is the communication step of local SGD (Lin, Stich, Patel and
/// Jaggi 2018, "Don't Use Large Mini-Batches, Use Local SGD"; Wang and Joshi 2018,
/// "Adaptive Communication Strategies to Achieve the Best Error-Runtime Trade-off in
/// Local-Update SGD"). The schedule that decides when to call it is in local_sgd.hpp.

#include <cstddef>
#include <cstdint>
#include <ranges>
#include <type_traits>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

namespace detail::sync {

/// Element functor of the averaging step: v ← v / n, in the compute type (float for
/// float/half/bfloat16, double for double), one rounding.
struct divide_by {
  int n;  ///< the divisor N (ranks in the group)
  /// v ← v / n in the compute type T.
  template <class T>
  GRADAPT_HD void operator()(T& v) const {
    v = v / static_cast<T>(n);
  }
};

/// Element type stored by the views of list L (const-qualification kept).
template <class L>
using list_element_t = typename std::remove_cvref_t<std::ranges::range_value_t<L>>::element_type;

/// Bytes of one list: the sum over its tensors of elements × element size.
template <class L>
std::uint64_t list_bytes(const L& list) {
  std::uint64_t bytes = 0;
  for (const auto& v : list) bytes += static_cast<std::uint64_t>(v.bytes());
  return bytes;
}

/// Tensors of one list.
template <class L>
std::uint64_t list_tensors(const L& list) {
  return static_cast<std::uint64_t>(std::ranges::size(list));
}

}  // namespace detail::sync

/// A list of writable tensor views in memory space `Space` that model averaging accepts: a
/// param_list's `values()`, or any contiguous range (std::vector, std::span) of
/// `tensor_view<T, Space>` with non-const `T` in {float, double, half, bfloat16}.
template <class L, class Space>
concept averageable_list = view_list<L, Space> && !std::is_const_v<detail::sync::list_element_t<L>>;

/// Payload of averaging `lists`: the bytes of all their tensors, Σ elements × element size.
/// This is what one rank hands to the allreduces of one averaging round.
template <class... Ls>
std::uint64_t payload_bytes(const Ls&... lists) {
  return (std::uint64_t{0} + ... + detail::sync::list_bytes(lists));
}

/// Bytes one rank sends in a bandwidth-optimal ring allreduce of `payload` bytes over `ranks`
/// ranks (reduce-scatter then allgather): ⌊2 (ranks − 1) · payload / ranks⌋; 0 for one rank.
/// It is the cost model behind local SGD's counters, not a measurement of what a particular
/// engine (MPI, NCCL) sends.
constexpr std::uint64_t ring_allreduce_bytes(std::uint64_t payload, int ranks) {
  if (ranks <= 1) return 0;
  const auto n = static_cast<std::uint64_t>(ranks);
  // payload = q n + r: 2(n − 1) payload / n = 2(n − 1) q + 2(n − 1) r / n, without overflow
  // for any payload below 2^63.
  const std::uint64_t q = payload / n, r = payload % n;
  return 2 * (n - 1) * q + (2 * (n - 1) * r) / n;
}

/// Replaces every tensor of `lists` by its mean over the ranks of `comm`:
/// x ← (Σ_r x_r) / N with N = comm.size().
///
/// Each tensor is one in-place `comm.allreduce(·, sum)` (in list order, tensors in order), then
/// each list gets one `b.apply_list` that divides by N in the compute type. Every rank must
/// pass the same lists (same tensor count, sizes and element types, in the same order): one
/// small allreduce (on a device communicator through a buffer of `b`) first agrees on the
/// tensor count and bytes
/// (gradapt::agree_values), so a rank with a tensor more or less makes every rank throw
/// instead of leaving one waiting; then the communicator checks each tensor's size and type
/// (comm::threads always; comm::mpi with `check_sizes`; comm::nccl with
/// `check_sizes`, both on by default). With one rank nothing is sent and nothing changes.
///
/// Rounding: the communicator forms the sum (comm::threads accumulates in the compute type in
/// rank order and rounds to the storage type once; comm::mpi on 16-bit types rounds at each
/// step of its reduction tree), then the quotient is rounded once more.
/// 16-bit sums can overflow where the mean would not: with N ranks, `half` values above
/// 65504 / N in magnitude may sum to infinity. Averaging identical copies returns the same
/// bits only when every partial sum the engine forms is exact: comm::threads adds in rank
/// order, and a partial sum such as 3x can round.
///
/// Results are bitwise identical on every rank whenever the communicator returns the same
/// sum to every rank (comm::threads does by construction; MPI and NCCL allreduce algorithms
/// do in practice: every rank receives the one reduced value that the algorithm computed).
///
/// To average with one collective instead of one per tensor, pass views over the framework's
/// flat (bucketed) parameter storage.
///
/// @return the payload in bytes (payload_bytes(lists...))
template <communicator C, backend B, class... Ls>
requires std::same_as<typename C::space, typename B::space> &&
    (averageable_list<Ls, typename C::space>&&...)std::uint64_t
    average_models(C& comm, const B& b, const Ls&... lists) {
  static_assert(sizeof...(Ls) > 0, "gradapt::average_models needs at least one list of tensors");
  const int n = comm.size();
  if (n > 1) {
    {
      const auto tensors = (std::uint64_t{0} + ... + detail::sync::list_tensors(lists));
      const agreed_value v[] = {{"tensors", static_cast<double>(tensors)},
                                {"bytes", static_cast<double>(payload_bytes(lists...))}};
      agree_values(comm, b, "average_models", std::span<const agreed_value>(v));
    }
    (
        [&] {
          for (const auto& v : lists) comm.allreduce(v, reduce_op::sum);
        }(),
        ...);
    (b.apply_list(detail::sync::divide_by{n}, lists), ...);
  }
  return payload_bytes(lists...);
}

}  // namespace gradapt

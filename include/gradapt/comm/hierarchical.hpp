#pragma once
/// @file
/// `comm::hierarchy`: Horovod's hierarchical allreduce over any communicator with `split` (host
/// memory, or device memory with the backend of that memory: `comm::nccl` with
/// `gradapt::cuda`, whose `split` is `ncclCommSplit`). The world is
/// cut into equal groups of ranks (the ranks of one node, or consecutive ranks of a chosen
/// group size) by two `split`s: `local()` holds the ranks of this rank's group, `cross()` one
/// rank per group (the ranks with this rank's local rank). `allreduce` then runs three steps:
///
///  1. reduce_scatter inside the group: local rank j receives the group's reduction of block j
///     of the buffer (padded to a multiple of the group size in an internal scratch buffer);
///  2. allreduce of that block over `cross()`: block j reduced over all groups;
///  3. allgather inside the group: every rank gets every reduced block.
///
/// With n elements, L ranks per group and N groups, a bandwidth-optimal engine (ring or
/// recursive halving) sends per rank (L-1)/L·n elements in step 1, 2(N-1)/N·n/L in step 2 and
/// (L-1)/L·n in step 3: only step 2 crosses groups, and it carries 1/L of the buffer.
///
/// Order of a sum on `comm::threads` (each collective adds in rank order in the compute type
/// and rounds once): element i is
///
///     y_i = round_T( Σ_{k = 0..N-1} round_T( Σ_{j = 0..L-1} x_{rank(k, j), i} ) )
///
/// where group k's ranks are taken in local-rank order j, groups in group order k, each Σ adds
/// left to right in `compute_t<T>` (float for float, half and bfloat16; double for double)
/// starting from its first term, and rank(k, j) is the world rank with local rank j in group
/// k. The result is deterministic (the same bits on every rank and every run) but in general
/// not the bits of a flat `allreduce`, which adds all ranks left to right with one rounding;
/// for sums that are exact in every partial (e.g. small integers) both agree. `max` is exact
/// and equals the flat result (up to which of +0/-0 or which NaN is kept). With one group or
/// one rank per group the three steps collapse into one allreduce over `local()` or
/// `cross()`, which has the same order. Other engines (MPI) use their own order in each step.
///
/// Construction is collective over the world and agrees on the options with
/// `gradapt::agree_values`; `allreduce` agrees on its arguments (count, element type, op)
/// across the world before it starts unless `hierarchy_options::check_arguments` is off.
///
/// On a device communicator the three steps are enqueued on the communicator's stream, the
/// padding copies and the zero tail are backend element operations on the same stream, the
/// scratch is a backend buffer kept by the hierarchy, and the agreement words pass through the
/// backend's staging memory (gradapt::cuda's workspace): a repeated allreduce allocates
/// nothing. The argument agreement is a host wait: its words are
/// copied back before the data collectives are enqueued (off with `check_arguments = false`).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include "gradapt/backend/host.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt::comm {

/// Options of a `comm::hierarchy`. Every rank must pass the same `group_size` and
/// `check_arguments` (checked at construction).
struct hierarchy_options {
  /// Ranks per group. > 0: world ranks r with equal r / group_size form a group (consecutive
  /// ranks), and group_size must divide the world size. 0 (default): ranks with the same host
  /// name form a group, and every host must hold the same number of ranks.
  int group_size = 0;
  /// This rank's host name when grouping by host (group_size == 0); empty (default): the
  /// name gethostname() returns. Setting it simulates several nodes on one machine. At most
  /// 255 bytes, no NUL byte; must stay empty when group_size > 0.
  std::string host{};
  /// Before each allreduce, agree across the whole world on the element count, element type
  /// and reduction (one allreduce(max) of 9 doubles), so that a rank passing other arguments
  /// is an error on every rank. Off: a mismatch is caught by the communicator's own check in
  /// the group or the cross communicator where it shows, and ranks of other groups may wait in
  /// the next step until the communicator's watchdog fires. Default true.
  bool check_arguments = true;
};

namespace detail {

/// Longest host name a hierarchy accepts (POSIX HOST_NAME_MAX is at most 255).
inline constexpr std::size_t max_host_bytes = 255;
/// Bytes packed into one double of the host-name allgather (exact: 48 bits < 2^53).
inline constexpr std::size_t host_bytes_per_word = 6;
/// Doubles per rank in the host-name allgather.
inline constexpr std::size_t host_words =
    (max_host_bytes + 1 + host_bytes_per_word - 1) / host_bytes_per_word;

/// This machine's host name, or an error message in `bad`.
inline std::string local_host_name(std::string& bad) {
#if __has_include(<unistd.h>)
  char buf[max_host_bytes + 2] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') {
    bad = "gethostname() failed; set hierarchy_options::host or hierarchy_options::group_size";
    return {};
  }
  return std::string(buf);
#else
  bad =
      "gethostname() is not available on this platform; set hierarchy_options::host or "
      "hierarchy_options::group_size";
  return {};
#endif
}

/// Packs `name` (at most max_host_bytes bytes) into host_words doubles, 6 bytes each.
inline void pack_host(std::string_view name, double* words) {
  for (std::size_t w = 0; w < host_words; ++w) {
    std::uint64_t v = 0;
    for (std::size_t b = 0; b < host_bytes_per_word; ++b) {
      const std::size_t i = w * host_bytes_per_word + b;
      const auto byte = i < name.size() ? static_cast<unsigned char>(name[i]) : 0u;
      v |= static_cast<std::uint64_t>(byte) << (8 * b);
    }
    words[w] = static_cast<double>(v);
  }
}

/// The name packed by pack_host.
inline std::string unpack_host(const double* words) {
  std::string name;
  for (std::size_t w = 0; w < host_words; ++w) {
    const auto v = static_cast<std::uint64_t>(words[w]);
    for (std::size_t b = 0; b < host_bytes_per_word; ++b) {
      const auto c = static_cast<char>((v >> (8 * b)) & 0xffu);
      if (c == '\0') return name;
      name.push_back(c);
    }
  }
  return name;
}

}  // namespace detail

/// A world seen as equal groups of ranks (nodes), with Horovod's hierarchical allreduce (see
/// the file comment for the steps, their cost and the reduction order). `B` is the backend of
/// the communicator's memory (gradapt::host by default; the CUDA backend with comm::nccl): the
/// padding scratch and the staged agreement words are its buffers. Holds a copy of the world
/// handle and the two communicators made by `split`.
template <class C, class B = host>
requires communicator<C> && std::same_as<typename C::space, typename B::space> && std::copy_constructible<C>
class hierarchy {
 public:
  /// The memory space of the buffers it reduces.
  using space = typename C::space;

  /// Splits `world` into groups as `o` says. Collective over `world`: one agreement
  /// allreduce, an allgather of host names when grouping by host, and two splits.
  /// @throws gradapt::error on every rank when a rank's options differ from the others', when
  ///         group_size does not divide the world size (naming both), or when hosts hold
  ///         different numbers of ranks (naming the hosts and their counts); on this rank, and
  ///         naming it on the others, when its own options are invalid (negative group_size,
  ///         host set together with group_size, host name too long or with a NUL byte)
  explicit hierarchy(C& world, const hierarchy_options& o = {}, const B& backend = B{})
      : world_(world), backend_(backend), opt_(o), rank_(world.rank()), size_(world.size()) {
    std::string bad = local_checks();
    const agreed_value agreed[] = {{"hierarchy_options::group_size", static_cast<double>(opt_.group_size)},
                                   {"hierarchy_options::check_arguments", opt_.check_arguments ? 1.0 : 0.0}};
    agree(std::span<const agreed_value>(agreed), bad);
    int node = 0, local_rank = 0;
    if (opt_.group_size > 0) {
      node = rank_ / opt_.group_size;
      local_rank = rank_ % opt_.group_size;
      nodes_ = size_ / opt_.group_size;
    } else {
      group_by_host(node, local_rank);
    }
    node_ = node;
    local_ = world_.split(node, rank_);
    cross_ = world_.split(local_rank, node);
  }

  /// This rank in the world.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Ranks in the world.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This rank's group (node), 0 to nodes() - 1; groups are numbered in the order of their
  /// lowest world rank.
  [[nodiscard]] int node() const noexcept { return node_; }
  /// Number of groups (nodes).
  [[nodiscard]] int nodes() const noexcept { return nodes_; }
  /// This rank within its group: its position among the group's ranks in world-rank order.
  [[nodiscard]] int local_rank() const { return local_.rank(); }
  /// Ranks per group (equal for every group).
  [[nodiscard]] int local_size() const { return local_.size(); }
  /// The host name this rank was grouped by (empty when grouped by group_size).
  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  /// The options the hierarchy was built with.
  [[nodiscard]] const hierarchy_options& options() const noexcept { return opt_; }

  /// The ranks of this rank's group, ordered by world rank (so rank() here is local_rank()).
  [[nodiscard]] C& local() noexcept { return local_; }
  /// The ranks of this rank's group (const access).
  [[nodiscard]] const C& local() const noexcept { return local_; }
  /// One rank per group: those with this rank's local rank, ordered by group (rank() here is
  /// node()).
  [[nodiscard]] C& cross() noexcept { return cross_; }
  /// One rank per group (const access).
  [[nodiscard]] const C& cross() const noexcept { return cross_; }

  /// Element-wise sum or max over all ranks of the world, in place: reduce_scatter over
  /// local(), allreduce of this rank's block over cross(), allgather over local() (see the
  /// file comment for the reduction order). Collective over the world. When local_size()
  /// does not divide the element count, the buffer is copied into a scratch buffer padded
  /// with zeros; the scratch grows only when a larger buffer arrives, so repeated calls
  /// allocate nothing.
  /// @throws gradapt::error on every rank when ranks pass different element counts, element
  ///         types or ops, or when a rank passes an op other than sum or max (that rank names
  ///         the op, the others name that rank); without check_arguments, the op error is
  ///         thrown on the offending rank only and a mismatch is left to the communicators
  template <element T>
  requires(!std::is_const_v<T>) void allreduce(tensor_view<T, space> buf, reduce_op op) {
    const std::size_t n = buf.size();
    std::string bad;
    if (op != reduce_op::sum && op != reduce_op::max)
      bad = text("allreduce", "reduce_op ", static_cast<int>(op), " is neither sum nor max");
    if (opt_.check_arguments) {
      const agreed_value agreed[] = {
          {"element count", static_cast<double>(n)},
          {"element type (0 float32, 1 float64, 2 float16, 3 bfloat16)", static_cast<double>(dtype_of_v<T>)},
          {"reduce_op (0 sum, 1 max)", static_cast<double>(op)}};
      agree(std::span<const agreed_value>(agreed), bad, "comm::hierarchy::allreduce");
    } else if (!bad.empty()) {
      throw error(bad);
    }
    if (n == 0) return;
    const auto flat = tensor_view<T, space>::vector(buf.data(), static_cast<std::int64_t>(n));
    if (local_.size() == 1) {
      cross_.allreduce(flat, op);
      return;
    }
    if (nodes_ == 1) {
      local_.allreduce(flat, op);
      return;
    }
    const auto l = static_cast<std::size_t>(local_.size());
    const std::size_t b = (n + l - 1) / l;  // block per local rank
    const std::size_t m = b * l;            // padded length
    auto& s = scratch<T>();
    const std::size_t need = m == n ? b : m + b;
    if (s.size() < need) {
      if constexpr (on_host)
        s.resize(need);
      else
        s = backend_.template allocate<T>(need);
    }
    const auto block = view(s.data() + (m == n ? 0 : m), b);
    if (m == n) {
      local_.reduce_scatter(cview(buf.data(), n), block, op);
      cross_.allreduce(block, op);
      local_.allgather(cview(block.data(), b), flat);
    } else {
      const auto padded = view(s.data(), m);
      if constexpr (on_host) {
        std::copy_n(buf.data(), n, s.data());
        std::fill(s.data() + n, s.data() + m, T{});
      } else {
        backend_.apply(gradapt::detail::copy_to{}, view(s.data(), n), cview(buf.data(), n));
        backend_.apply(gradapt::detail::set_zero{}, view(s.data() + n, m - n));
      }
      local_.reduce_scatter(cview(s.data(), m), block, op);
      cross_.allreduce(block, op);
      local_.allgather(cview(block.data(), b), padded);
      if constexpr (on_host)
        std::copy_n(s.data(), n, buf.data());
      else
        backend_.apply(gradapt::detail::copy_to{}, flat, cview(s.data(), n));
    }
  }

 private:
  static constexpr bool on_host = std::same_as<space, host_space>;

  /// agree_values over the world (through the backend's staging memory on a device).
  void agree(std::span<const agreed_value> values, const std::string& bad,
             std::string_view who = "comm::hierarchy") {
    gradapt::detail::agree_values_with(world_, who, values, bad, [&](std::span<double> v) {
      gradapt::detail::allreduce_host_values(world_, backend_, v, reduce_op::max);
    });
  }

  template <class... A>
  std::string text(std::string_view op, A&&... a) const {
    return gradapt::detail::message("comm::hierarchy", op.empty() ? "" : "::", op, " on rank ", rank_, ": ",
                                    std::forward<A>(a)...);
  }

  /// This rank's own option errors ("" when valid); resolves host_ when grouping by host.
  std::string local_checks() {
    const int g = opt_.group_size;
    if (g < 0)
      return text("", "hierarchy_options::group_size is ", g, " (expected > 0, or 0 to group by host)");
    if (g > 0) {
      if (!opt_.host.empty())
        return text(
            "", "hierarchy_options::host is \"", opt_.host, "\" but group_size is ", g,
            " (set group_size to group consecutive ranks, or host with group_size 0 to group by host)");
      if (size_ % g != 0) {
        std::string divisors;
        for (int d = 1; d <= size_; ++d)
          if (size_ % d == 0) divisors.append(divisors.empty() ? "" : ", ").append(std::to_string(d));
        return text("", "hierarchy_options::group_size ", g, " does not divide the world size ", size_,
                    " (expected one of ", divisors, ")");
      }
      return {};
    }
    std::string bad;
    host_ = opt_.host.empty() ? detail::local_host_name(bad) : opt_.host;
    if (!bad.empty()) return text("", bad);
    if (host_.size() > detail::max_host_bytes)
      return text("", "the host name has ", host_.size(), " bytes (at most ", detail::max_host_bytes, ")");
    if (host_.find('\0') != std::string::npos) return text("", "the host name contains a NUL byte");
    return {};
  }

  /// Allgathers the host names; group = ranks with the same name, numbered by lowest rank.
  void group_by_host(int& node, int& local_rank) {
    const auto p = static_cast<std::size_t>(size_);
    std::vector<double> mine(detail::host_words), all(detail::host_words * p);
    detail::pack_host(host_, mine.data());
    if constexpr (on_host) {
      world_.allgather(cview(mine.data(), mine.size()), view(all.data(), all.size()));
    } else {  // once, at construction: through two backend buffers
      auto dm = backend_.template allocate<double>(mine.size());
      auto da = backend_.template allocate<double>(all.size());
      backend_.copy(tensor_view<const double, host_space>::vector(mine.data(), std::int64_t(mine.size())),
                    view(dm.data(), mine.size()));
      world_.allgather(cview(dm.data(), mine.size()), view(da.data(), all.size()));
      backend_.copy(cview(da.data(), all.size()),
                    tensor_view<double, host_space>::vector(all.data(), std::int64_t(all.size())));
    }
    std::vector<std::string> names(p);
    for (std::size_t r = 0; r < p; ++r) names[r] = detail::unpack_host(all.data() + r * detail::host_words);
    std::vector<int> first(p), count(p, 0), index(p, -1);  // first rank of r's host; per first rank
    int groups = 0;
    for (std::size_t r = 0; r < p; ++r) {
      first[r] = static_cast<int>(std::find(names.begin(), names.end(), names[r]) - names.begin());
      const auto f = static_cast<std::size_t>(first[r]);
      if (index[f] < 0) index[f] = groups++;
      ++count[f];
    }
    const auto me = static_cast<std::size_t>(rank_);
    const int l = count[static_cast<std::size_t>(first[me])];
    bool equal = true;
    for (std::size_t r = 0; r < p; ++r) equal = equal && count[static_cast<std::size_t>(first[r])] == l;
    if (!equal) {
      std::string list;
      int shown = 0;
      for (std::size_t r = 0; r < p; ++r) {
        if (first[r] != static_cast<int>(r)) continue;
        if (++shown > 16) {
          list.append(", ... (").append(std::to_string(groups - 16)).append(" more hosts)");
          break;
        }
        list.append(shown == 1 ? "" : ", ")
            .append("\"")
            .append(names[r])
            .append("\" ")
            .append(std::to_string(count[r]))
            .append(count[r] == 1 ? " rank" : " ranks");
      }
      gradapt::detail::fail("comm::hierarchy on rank ", rank_,
                            ": the hosts hold different numbers of ranks (", list,
                            "); the cross-node communicator needs the same number of ranks on every host "
                            "(start as many ranks on each host, or set hierarchy_options::group_size)");
    }
    node = index[static_cast<std::size_t>(first[me])];
    local_rank = 0;
    for (std::size_t r = 0; r < me; ++r) local_rank += first[r] == first[me] ? 1 : 0;
    nodes_ = groups;
  }

  template <class T>
  static tensor_view<T, space> view(T* p, std::size_t n) {
    return tensor_view<T, space>::vector(p, static_cast<std::int64_t>(n));
  }
  template <class T>
  static tensor_view<const T, space> cview(const T* p, std::size_t n) {
    return tensor_view<const T, space>::vector(p, static_cast<std::int64_t>(n));
  }
  template <class T>
  using buffer_t = decltype(std::declval<const B&>().template allocate<T>(std::size_t{}));
  template <class T>
  buffer_t<T>& scratch() {
    return std::get<buffer_t<T>>(scratch_);
  }

  C world_;
  B backend_;
  hierarchy_options opt_;
  int rank_ = 0;
  int size_ = 1;
  int node_ = 0;
  int nodes_ = 1;
  std::string host_;
  C local_ = world_;
  C cross_ = world_;
  std::tuple<buffer_t<float>, buffer_t<double>, buffer_t<half>, buffer_t<bfloat16>> scratch_;
};

}  // namespace gradapt::comm

#pragma once
/// @file
/// `gradapt::shard::partition_plan`: which rank owns which elements of a parameter list when
/// optimizer state is sharded over ranks (ZeRO, Rajbhandari et al. 2020). Deterministic from
/// (tensor sizes, world size, options), so every rank computes the same plan without talking,
/// printable, and saved with a sharded checkpoint so that a load can tell which layout the
/// shards were written in.
///
/// Three granularities:
///
/// - **element** (DeepSpeed's flat partition): the tensors are laid end to end in list order
///   in one flat index space of `total` elements; rank r owns the flat range
///   [r S, min((r + 1) S, total)), with S = ceil(total / (N a)) a for alignment a elements,
///   so every shard starts on an aligned element and no shard holds more than S elements. A
///   tensor may straddle ranks: its sums (trust ratios, norms, row and column statistics)
///   are assembled across the ranks that hold a piece of it. With `align_tensors`, every
///   tensor also starts at an aligned position of the flat space (up to a - 1 unused
///   positions follow each tensor), so every cut inside a tensor falls at a multiple of a
///   from the tensor's start: what the sharded step needs to reproduce a tensor's reductions
///   block by block (shard/optimizer.hpp).
/// - **tensor** (PyTorch ZeroRedundancyOptimizer's): whole tensors, largest first (ties: the
///   lower list index first) to the least-loaded rank (ties: the lower rank). The longest-
///   processing-time rule bounds the imbalance: the most loaded rank holds at most the least
///   loaded rank's elements plus the largest tensor.
/// - **unit** (for state kept per block, not per element: Shampoo's blocks): each tensor t is
///   cut only at multiples of its grain g_t elements from its start, into units of g_t
///   elements (the last one shorter); the units, in list order, go to ranks in contiguous runs:
///   a unit whose midpoint lies at flat position m goes to rank floor(m N / total). So a rank
///   holds consecutive units, each piece starts at a unit boundary, and no rank holds more than
///   total / N plus one unit. A grain of 0 keeps the tensor whole.
///
/// A rank's shard is an ordered list of pieces (tensor, offset, length), each a contiguous
/// range of one tensor, in list order; `shard_offset` is the piece's position in the rank's
/// shard buffer (pieces are packed, except for the unused positions `align_tensors` leaves).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/assign.hpp"
#include "gradapt/core/enum_name.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt::shard {

/// How a partition plan cuts the parameter list (see the file comment).
enum class granularity : std::uint8_t {
  element,  ///< one flat index space cut into aligned, equal ranges (tensors may straddle ranks)
  tensor,   ///< whole tensors, largest first to the least-loaded rank
  unit,     ///< contiguous runs of units, each tensor cut only at multiples of its grain
};

/// The name of a granularity ("element", "tensor").
constexpr std::string_view name(granularity g) {
  return gradapt::detail::enum_name(g, std::array<std::string_view, 3>{"element", "tensor", "unit"});
}

/// Options of a partition plan, with designated initialisers:
/// `partition_plan::make(sizes, world, {.mode = granularity::tensor})`.
struct partition_options {
  /// Element ranges (default) or whole tensors.
  granularity mode = granularity::element;
  /// Element granularity: every shard starts at a multiple of this many elements, >= 1
  /// (default 64: 256 bytes of float, a multiple of every SIMD width and of NCCL's alignment).
  std::size_t alignment = 64;
  /// Element granularity: start every tensor at a multiple of `alignment` in the flat index
  /// space (default false: tensors end to end).
  bool align_tensors = false;
};

/// One contiguous range of one tensor in a rank's shard.
struct piece {
  std::size_t tensor = 0;        ///< index of the tensor in the parameter list
  std::size_t offset = 0;        ///< first element of the range, within the tensor
  std::size_t length = 0;        ///< elements in the range (> 0)
  std::size_t shard_offset = 0;  ///< position of the range in the rank's shard buffer
  /// Same tensor, range and shard position.
  friend bool operator==(const piece&, const piece&) = default;
};

/// Which rank owns which elements (see the file comment). Built by `make`; immutable.
class partition_plan {
 public:
  /// The largest world size `load` accepts (2^20 ranks): a checkpoint's world size beyond it
  /// is taken for a damaged field.
  static constexpr std::uint64_t max_loaded_world = std::uint64_t{1} << 20;
  /// The most units a unit-granularity plan may cut (2^32): more is taken for a damaged grain.
  static constexpr std::size_t max_units = std::size_t{1} << 32;
  /// Kind and format version of the plan's section in a checkpoint.
  static constexpr std::string_view archive_kind = "gradapt.partition_plan";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The plan of `sizes` (elements per tensor, in list order) over `world` ranks; with
  /// granularity::unit, `grains` holds each tensor's grain (elements per unit, 0: the whole
  /// tensor), and is empty otherwise.
  /// @throws gradapt::error when world < 1, alignment is 0, the total overflows, or `grains`
  ///         does not hold one grain per tensor for granularity::unit (none otherwise)
  static partition_plan make(std::span<const std::size_t> sizes, int world, const partition_options& o = {},
                             std::span<const std::size_t> grains = {}) {
    gradapt::detail::require(world >= 1, "shard::partition_plan: world size is ", world, " (expected >= 1)");
    gradapt::detail::require(o.alignment >= 1,
                             "shard::partition_plan: partition_options::alignment is 0 "
                             "(expected >= 1 element; 1 means unaligned)");
    gradapt::detail::require(
        o.mode == granularity::element || o.mode == granularity::tensor || o.mode == granularity::unit,
        "shard::partition_plan: partition_options::mode is not a granularity");
    gradapt::detail::require(o.mode == granularity::unit ? grains.size() == sizes.size() : grains.empty(),
                             "shard::partition_plan: ", name(o.mode), " granularity with ", grains.size(),
                             " grain(s) for ", sizes.size(),
                             " tensor(s) (expected one per tensor for unit granularity, none otherwise)");
    partition_plan p;
    p.grains_.assign(grains.begin(), grains.end());
    p.opt_ = o;
    p.world_ = world;
    p.sizes_.assign(sizes.begin(), sizes.end());
    for (const std::size_t n : sizes) {
      gradapt::detail::require(n <= std::numeric_limits<std::size_t>::max() - p.total_,
                               "shard::partition_plan: the tensor sizes overflow std::size_t");
      p.total_ += n;
    }
    p.first_.assign(static_cast<std::size_t>(world) + 1, 0);
    if (o.mode == granularity::element)
      p.cut_elements();
    else if (o.mode == granularity::tensor)
      p.cut_tensors();
    else
      p.cut_units();
    return p;
  }

  /// Ranks the plan is for.
  [[nodiscard]] int world() const noexcept { return world_; }
  /// The options it was made with.
  [[nodiscard]] const partition_options& options() const noexcept { return opt_; }
  /// Tensors in the parameter list.
  [[nodiscard]] std::size_t tensors() const noexcept { return sizes_.size(); }
  /// Elements of tensor t.
  [[nodiscard]] std::size_t tensor_size(std::size_t t) const {
    check_tensor(t, "tensor_size");
    return sizes_[t];
  }
  /// Elements of all tensors.
  [[nodiscard]] std::size_t total() const noexcept { return total_; }
  /// Unit granularity: tensor t's grain (elements per unit, 0: whole); 0 for the others.
  [[nodiscard]] std::size_t grain(std::size_t t) const {
    check_tensor(t, "grain");
    return grains_.empty() ? 0 : grains_[t];
  }
  /// Element granularity: the elements each rank's range spans (S in the file comment; the
  /// last ranks may hold fewer). Tensor and unit granularity: the largest shard.
  [[nodiscard]] std::size_t shard_capacity() const noexcept { return capacity_; }

  /// The pieces of rank r's shard, in list order.
  [[nodiscard]] std::span<const piece> pieces(int r) const {
    check_rank(r, "pieces");
    const auto b = first_[static_cast<std::size_t>(r)], e = first_[static_cast<std::size_t>(r) + 1];
    return std::span<const piece>(pieces_).subspan(b, e - b);
  }
  /// Elements rank r holds.
  [[nodiscard]] std::size_t shard_size(int r) const {
    std::size_t n = 0;
    for (const piece& q : pieces(r)) n += q.length;
    return n;
  }
  /// The rank that owns element i of tensor t.
  /// @throws gradapt::error when t or i is out of range
  [[nodiscard]] int owner(std::size_t t, std::size_t i) const {
    check_tensor(t, "owner");
    gradapt::detail::require(i < sizes_[t], "shard::partition_plan::owner: element ", i, " of tensor ", t,
                             " is out of range (", sizes_[t], " elements)");
    for (int r = 0; r < world_; ++r)
      for (const piece& q : pieces(r))
        if (q.tensor == t && i >= q.offset && i < q.offset + q.length) return r;
    gradapt::detail::fail("shard::partition_plan::owner: internal error: element ", i, " of tensor ", t,
                          " has no owner");
  }

  /// A readable description: the options, then per rank its element count and pieces
  /// ("t3[0, 4096)" is elements 0 to 4095 of tensor 3).
  [[nodiscard]] std::string describe() const {
    std::string s("partition_plan: ");
    s.append(name(opt_.mode)).append(" granularity, ").append(std::to_string(world_)).append(" rank(s), ");
    s.append(std::to_string(sizes_.size())).append(" tensor(s), ").append(std::to_string(total_));
    s.append(" element(s)");
    if (opt_.mode == granularity::element)
      s.append(", alignment ")
          .append(std::to_string(opt_.alignment))
          .append(opt_.align_tensors ? " (tensors aligned)" : "")
          .append(", shard capacity ")
          .append(std::to_string(capacity_));
    for (int r = 0; r < world_; ++r) {
      s.append("\n  rank ").append(std::to_string(r)).append(": ").append(std::to_string(shard_size(r)));
      s.append(" element(s)");
      for (const piece& q : pieces(r)) {
        s.append(" t").append(std::to_string(q.tensor)).append("[").append(std::to_string(q.offset));
        s.append(", ").append(std::to_string(q.offset + q.length)).append(")");
      }
    }
    return s;
  }

  /// Writes the plan into the open section of `w`: granularity, alignment, world size, the
  /// tensor sizes and, for unit granularity, the grains (the pieces follow from them).
  void save(archive_writer& w) const {
    w.put("granularity", name(opt_.mode));
    w.put("alignment", static_cast<std::uint64_t>(opt_.alignment));
    w.put("align_tensors", static_cast<std::uint64_t>(opt_.align_tensors ? 1 : 0));
    w.put("world", static_cast<std::uint64_t>(world_));
    std::vector<std::uint64_t> sizes(sizes_.begin(), sizes_.end());
    w.put_tensor<std::uint64_t>("tensor_sizes", sizes);
    if (opt_.mode == granularity::unit) {
      std::vector<std::uint64_t> grains(grains_.begin(), grains_.end());
      w.put_tensor<std::uint64_t>("unit_grains", grains);
    }
  }

  /// Reads a plan written by `save` from the open section of `r` (and rebuilds its pieces).
  /// `check_sizes(sizes)` runs on the archived tensor sizes before the pieces are cut, so a
  /// caller that knows the sizes rejects a damaged one there (cutting a damaged size into
  /// units could take up to max_units iterations); it throws to reject.
  /// @throws gradapt::error when a field is missing, of another type or out of range, or what
  ///         `check_sizes` throws
  template <class CheckSizes>
  static partition_plan load(archive_reader& r, CheckSizes&& check_sizes) {
    const auto g = r.get<std::string>("granularity");
    partition_options o;
    if (g == name(granularity::element))
      o.mode = granularity::element;
    else if (g == name(granularity::tensor))
      o.mode = granularity::tensor;
    else if (g == name(granularity::unit))
      o.mode = granularity::unit;
    else
      gradapt::detail::fail("shard::partition_plan::load: granularity '", g,
                            "' is not element, tensor or unit");
    const auto a = r.get<std::uint64_t>("alignment");
    const auto world = r.get<std::uint64_t>("world");
    gradapt::detail::require(a >= 1 && a <= (std::uint64_t{1} << 40),
                             "shard::partition_plan::load: alignment ", a, " is out of range (1 to 2^40)");
    // The plan holds world + 1 offsets: a damaged count must not allocate gigabytes.
    gradapt::detail::require(world >= 1 && world <= max_loaded_world,
                             "shard::partition_plan::load: world size ", world, " is out of range (1 to ",
                             max_loaded_world, ")");
    o.alignment = static_cast<std::size_t>(a);
    const auto at = r.get<std::uint64_t>("align_tensors");
    gradapt::detail::require(at <= 1, "shard::partition_plan::load: align_tensors is ", at,
                             " (expected 0 or 1)");
    o.align_tensors = at == 1;
    const auto sizes64 = r.get_tensor<std::uint64_t>("tensor_sizes");
    const std::vector<std::size_t> sizes(sizes64.begin(), sizes64.end());
    check_sizes(std::span<const std::size_t>(sizes));
    std::vector<std::size_t> grains;
    if (o.mode == granularity::unit) {
      const auto g64 = r.get_tensor<std::uint64_t>("unit_grains");
      grains.assign(g64.begin(), g64.end());
    }
    return make(sizes, static_cast<int>(world), o, grains);
  }

  /// `load` without a check of the sizes (the archive's own plan, whatever its tensors).
  static partition_plan load(archive_reader& r) {
    return load(r, [](std::span<const std::size_t>) {});
  }

  /// Same options, world size, tensor sizes and grains (hence the same pieces).
  friend bool operator==(const partition_plan& a, const partition_plan& b) {
    return a.opt_.mode == b.opt_.mode && a.opt_.alignment == b.opt_.alignment &&
           a.opt_.align_tensors == b.opt_.align_tensors && a.world_ == b.world_ && a.sizes_ == b.sizes_ &&
           a.grains_ == b.grains_;
  }

 private:
  partition_plan() = default;

  void check_rank(int r, std::string_view fn) const {
    gradapt::detail::require(r >= 0 && r < world_, "shard::partition_plan::", fn, ": rank ", r,
                             " is out of range (expected 0 to ", world_ - 1, ")");
  }
  void check_tensor(std::size_t t, std::string_view fn) const {
    gradapt::detail::require(t < sizes_.size(), "shard::partition_plan::", fn, ": tensor ", t,
                             " is out of range (", sizes_.size(), " tensors)");
  }

  /// Element granularity: rank r owns flat [r S, (r + 1) S) ∩ [0, span), where span is the
  /// flat end of the last tensor (`total` unless `align_tensors` leaves gaps).
  void cut_elements() {
    const auto n = static_cast<std::size_t>(world_);
    const std::size_t a = opt_.alignment;
    constexpr std::size_t top = std::numeric_limits<std::size_t>::max();
    std::vector<std::size_t> start(sizes_.size(), 0);
    std::size_t span = 0;
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      if (opt_.align_tensors && span % a != 0) {
        gradapt::detail::require(span <= top - (a - span % a),
                                 "shard::partition_plan: the aligned flat range overflows std::size_t");
        span += a - span % a;
      }
      start[t] = span;
      gradapt::detail::require(sizes_[t] <= top - span,
                               "shard::partition_plan: the aligned flat range overflows std::size_t");
      span += sizes_[t];
    }
    // S = ceil(span / (n a)) a, without overflow: blocks of a elements, shared out evenly.
    const std::size_t blocks = span / a + (span % a != 0 ? 1 : 0);
    const std::size_t per_rank = blocks / n + (blocks % n != 0 ? 1 : 0);
    gradapt::detail::require(per_rank <= top / a / n,
                             "shard::partition_plan: the shards' flat range overflows std::size_t");
    capacity_ = per_rank * a;
    std::size_t t = 0;
    for (std::size_t r = 0; r < n; ++r) {
      first_[r] = pieces_.size();
      const std::size_t lo = std::min(span, r * capacity_);
      const std::size_t hi = std::min(span, lo + capacity_);
      while (t < sizes_.size() && start[t] + sizes_[t] <= lo) ++t;  // skips empty tensors too
      for (std::size_t u = t; u < sizes_.size() && start[u] < hi; ++u) {
        const std::size_t b = std::max(lo, start[u]), e = std::min(hi, start[u] + sizes_[u]);
        if (b < e) pieces_.push_back({u, b - start[u], e - b, b - lo});
      }
    }
    first_[n] = pieces_.size();
  }

  void cut_tensors() {
    const auto n = static_cast<std::size_t>(world_);
    std::vector<std::size_t> load(n, 0);
    const std::vector<int> rank_of =
        lpt_assign(std::span<const std::size_t>(sizes_), world_, std::span<std::size_t>(load));
    capacity_ = n > 0 ? *std::max_element(load.begin(), load.end()) : 0;
    for (std::size_t r = 0; r < n; ++r) {
      first_[r] = pieces_.size();
      std::size_t pos = 0;
      for (std::size_t t = 0; t < sizes_.size(); ++t)
        if (static_cast<std::size_t>(rank_of[t]) == r && sizes_[t] > 0) {
          pieces_.push_back({t, 0, sizes_[t], pos});
          pos += sizes_[t];
        }
    }
    first_[n] = pieces_.size();
  }

  /// Unit granularity: units in list order, each to the rank its midpoint's flat position
  /// falls in (see the file comment); a rank's consecutive units of a tensor form one piece.
  void cut_units() {
    const auto n = static_cast<std::size_t>(world_);
    std::size_t units = 0;
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      const std::size_t g = grains_[t] == 0 || grains_[t] > sizes_[t] ? sizes_[t] : grains_[t];
      units += g == 0 ? 0 : sizes_[t] / g + (sizes_[t] % g != 0 ? 1 : 0);
      gradapt::detail::require(units <= max_units,
                               "shard::partition_plan: the grains cut the tensors into more "
                               "than ",
                               max_units, " units (tensor ", t, ": ", sizes_[t], " elements, grain ",
                               grains_[t], ")");
    }
    std::vector<std::size_t> load(n, 0);
    std::vector<std::vector<piece>> per(n);
    std::size_t at = 0;  // flat position of the unit's start
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      const std::size_t size = sizes_[t], g = grains_[t] == 0 ? size : grains_[t];
      for (std::size_t o = 0; o < size; o += g) {
        const std::size_t len = std::min(g, size - o);
        // rank = floor((at + len / 2) N / total), in long double: at + len / 2 < total, and the
        // product may not fit in std::size_t.
        const long double mid = static_cast<long double>(at) + static_cast<long double>(len) / 2;
        auto r =
            static_cast<std::size_t>(mid * static_cast<long double>(n) / static_cast<long double>(total_));
        r = std::min(r, n - 1);
        auto& ps = per[r];
        if (!ps.empty() && ps.back().tensor == t && ps.back().offset + ps.back().length == o)
          ps.back().length += len;
        else
          ps.push_back({t, o, len, load[r]});
        load[r] += len;
        at += len;
      }
    }
    capacity_ = n > 0 ? *std::max_element(load.begin(), load.end()) : 0;
    for (std::size_t r = 0; r < n; ++r) {
      first_[r] = pieces_.size();
      pieces_.insert(pieces_.end(), per[r].begin(), per[r].end());
    }
    first_[n] = pieces_.size();
  }

  partition_options opt_{};
  int world_ = 1;
  std::vector<std::size_t> grains_;  ///< unit granularity: elements per unit of each tensor
  std::vector<std::size_t> sizes_;
  std::size_t total_ = 0;
  std::size_t capacity_ = 0;
  std::vector<piece> pieces_;       ///< every rank's pieces, rank by rank
  std::vector<std::size_t> first_;  ///< rank r's pieces are [first_[r], first_[r + 1])
};

}  // namespace gradapt::shard

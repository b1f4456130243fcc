#pragma once
/// @file
/// Internals of gradapt/shard/optimizer.hpp: the reading of old ranks' archives (written by
/// `sharded_state::save` on any world size) into this rank's new shard, for
/// `sharded_optimizer::load`: the checks of each archive against the plan, the parameters and
/// the chain, and the copies of the overlapping state and master values. Not a public
/// interface: names here may change without notice.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "gradapt/shard/detail/packing.hpp"
#include "gradapt/shard/partition.hpp"
#include "gradapt/shard/state.hpp"

namespace gradapt::detail::shard_k {

/// Reads old ranks' archives into a `sharded_state` (a friend of it).
struct checkpoint_reader {
  /// Copies what old rank `r`'s archive holds of this rank's new pieces.
  template <class B, class St, class PL>
  static void read_rank(const B& b, St& s, const shard::partition_plan& old, int r,
                        std::span<const std::byte> bytes, const PL& params, bool& have,
                        std::uint64_t& steps) {
    using Cs = typename St::chain_state_type;
    using Se = typename Cs::state_element;
    using Mt = typename St::master_type;
    archive_reader rd(bytes, St::archive_kind, St::archive_version);
    rd.begin("plan");
    const shard::partition_plan again =
        shard::partition_plan::load(rd, [&](std::span<const std::size_t> sizes) {
          bool same = sizes.size() == old.tensors();
          for (std::size_t t = 0; same && t < sizes.size(); ++t) same = sizes[t] == old.tensor_size(t);
          gradapt::detail::require(same, "sharded optimizer load: old rank ", r,
                                   "'s archive was written for other tensor sizes than old rank 0's");
        });
    rd.end();
    gradapt::detail::require(again == old, "sharded optimizer load: old rank ", r,
                             "'s archive was written with another partition plan than old rank 0's");
    gradapt::detail::require(rd.get<std::uint64_t>("rank") == static_cast<std::uint64_t>(r),
                             "sharded optimizer load: archive(", r, ") holds rank ",
                             rd.get<std::uint64_t>("rank"), "'s shard");
    const auto et = rd.get<std::string>("element_type");
    gradapt::detail::require(et == name(dtype_of_v<Se>), "sharded optimizer load: the checkpoint holds ", et,
                             " state but this state is ", name(dtype_of_v<Se>));
    const auto mt = rd.get<std::string>("master_type");
    gradapt::detail::require(mt == name(dtype_of_v<Mt>),
                             "sharded optimizer load: the checkpoint's master type is ", mt,
                             " but this state's is ", name(dtype_of_v<Mt>));
    gradapt::detail::require(
        rd.get<std::uint64_t>("stages") == Cs::plan::n &&
            rd.get<std::uint64_t>("buffers") == Cs::buffer_count(),
        "sharded optimizer load: the checkpoint was written by another optimizer (stage or "
        "buffer count differs)");
    gradapt::detail::require(
        rd.get<std::uint64_t>("active_stages") == s.st_.active_stages(),
        "sharded optimizer load: the checkpoint's active stages differ from this state's "
        "(same optimizer options, e.g. momentum on or off)");
    const auto k = rd.get<std::uint64_t>("steps");
    gradapt::detail::require(k < std::numeric_limits<std::uint64_t>::max(),
                             "sharded optimizer load: step count ", k, " cannot grow");
    gradapt::detail::require(!have || k == steps, "sharded optimizer load: old rank ", r, " saved step ", k,
                             " but another old rank saved step ", steps, " (archives of different steps)");
    have = true;
    steps = k;
    if constexpr (St::has_preconditioner) {
      rd.begin("preconditioner");
      s.st_.preconditioner().load_header(rd, k);
      rd.end();
    }
    const auto np = rd.get<std::uint64_t>("pieces");
    const auto pieces = old.pieces(r);
    gradapt::detail::require(np == pieces.size(), "sharded optimizer load: old rank ", r, "'s archive holds ",
                             np, " pieces but its plan gives ", pieces.size());
    std::vector<Se> host;
    std::vector<Mt> mhost;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const shard::piece& q = pieces[i];
      rd.begin(gradapt::detail::archive_impl::join("piece", "/", std::to_string(i)));
      const auto nm = rd.get<std::string>("name");
      gradapt::detail::require(nm == params[q.tensor].name, "sharded optimizer load: tensor ", q.tensor,
                               " is '", nm, "' in the checkpoint but '", params[q.tensor].name, "' here");
      gradapt::detail::require(
          rd.get<std::uint64_t>("tensor") == q.tensor && rd.get<std::uint64_t>("offset") == q.offset &&
              rd.get<std::uint64_t>("length") == q.length,
          "sharded optimizer load: old rank ", r, "'s piece ", i, " ('", nm, "') does not match its plan");
      const bool wanted = overlaps_any(std::span<const shard::piece>(&q, 1), s.plan_.pieces(s.rank_));
      for (std::size_t j = 0; j < Cs::buffer_count(); ++j) {
        const auto bufs = s.st_.buffer(j);
        if (bufs.empty()) continue;
        const std::string field = gradapt::detail::archive_impl::join("buffer", "", std::to_string(j));
        read_field(rd, field, host);
        if (!wanted) continue;
        for (const Se& x : host)
          gradapt::detail::require(
              std::isfinite(static_cast<double>(static_cast<compute_t<Se>>(x))),
              "sharded optimizer load: buffer ", j, " of '", nm,
              "' holds a non-finite value (a checkpoint of a diverged run cannot be resumed)");
        copy_into_units(b, s, q, j, std::span<const Se>(host));
      }
      if constexpr (St::has_preconditioner) {  // the old slice's blocks: those this rank holds copied
        rd.begin("preconditioner");
        std::size_t u = 0;
        while (u < s.units_.size() && s.units_[u].tensor != q.tensor) ++u;
        if (u < s.units_.size())
          s.st_.preconditioner().load_slice(b, rd, u, q.offset, q.length);
        else
          consume_section(rd);
        rd.end();
      }
      if constexpr (!std::is_same_v<Mt, typename PL::value_type>) {
        read_field(rd, "master", mhost);
        gradapt::detail::require(mhost.size() == q.length, "sharded optimizer load: piece '", nm, "' has ",
                                 mhost.size(), " master values for ", q.length, " elements");
        if (wanted)
          for (const shard::piece& mine : s.plan_.pieces(s.rank_)) {
            if (mine.tensor != q.tensor) continue;
            const std::size_t a = std::max(mine.offset, q.offset),
                              e = std::min(mine.offset + mine.length, q.offset + q.length);
            if (a < e)
              b.copy(tensor_view<const Mt, host_space>::vector(mhost.data() + (a - q.offset),
                                                               static_cast<std::int64_t>(e - a)),
                     vec<typename St::space, Mt>(s.master_.data() + mine.shard_offset + (a - mine.offset),
                                                 e - a));
          }
      }
      rd.end();
    }
    rd.finish();
  }

  /// Reads every field of the open section (an old slice of a tensor this rank holds no part
  /// of: the archive's CRC covers it, and `finish` wants every field read).
  static void consume_section(archive_reader& rd) {
    for (const std::string& f : rd.names()) {  // the types a slice writes (shampoo_checkpoint.hpp)
      const archive_field t = rd.type(f);
      const auto e = t == archive_field::tensor ? rd.tensor_info(f).element : archive_element::u64;
      if (t == archive_field::u64)
        (void)rd.get<std::uint64_t>(f);
      else if (t == archive_field::boolean)
        (void)rd.get<bool>(f);
      else if (t == archive_field::tensor && e == archive_element::i64)
        (void)rd.get_tensor<std::int64_t>(f);
      else if (t == archive_field::tensor && e == archive_element::float32)
        (void)rd.get_tensor<float>(f);
      else if (t == archive_field::tensor && e == archive_element::float64)
        (void)rd.get_tensor<double>(f);
      else
        gradapt::detail::fail("sharded optimizer load: field '", f,
                              "' of a preconditioner slice has a type no slice writes");
    }
  }

  /// Reads tensor field `name` into `out`, which holds one field at a time: a buffer that
  /// must grow is released first, so reading never holds two pieces' values.
  template <class T>
  static void read_field(archive_reader& rd, std::string_view name, std::vector<T>& out) {
    const archive_tensor_info info = rd.tensor_info(name);
    const auto n = static_cast<std::size_t>(info.elements);
    if (n > out.capacity()) {
      out.clear();
      out.shrink_to_fit();
      out.reserve(n);
    }
    out.resize(n);
    rd.get_tensor<T>(name, std::span<T>(out), info.shape);
  }

  /// Copies buffer j's values of old piece q (host, element-indexed from q.offset; for a
  /// factored tensor, its whole statistics) into the units of this rank that overlap it.
  template <class B, class St, class T>
  static void copy_into_units(const B& b, St& s, const shard::piece& q, std::size_t j,
                              std::span<const T> data) {
    const auto bufs = s.st_.buffer(j);
    for (std::size_t u = 0; u < s.units_.size(); ++u) {
      const shard::shard_unit& x = s.units_[u];
      if (x.tensor != q.tensor) continue;
      const auto& v = bufs[u];
      if (v.size() != x.length) {  // a factored tensor's statistics: whole on both sides
        gradapt::detail::require(data.size() == v.size(), "sharded optimizer load: buffer ", j, " of tensor ",
                                 q.tensor, " holds ", data.size(), " values but this state keeps ", v.size(),
                                 " (same factoring options)");
        b.copy(tensor_view<const T, host_space>::vector(data.data(), static_cast<std::int64_t>(data.size())),
               v);
        continue;
      }
      gradapt::detail::require(data.size() == q.length, "sharded optimizer load: buffer ", j, " of tensor ",
                               q.tensor, " holds ", data.size(), " values for ", q.length, " elements");
      const std::size_t a = std::max(x.offset, q.offset),
                        e = std::min(x.offset + x.length, q.offset + q.length);
      if (a >= e) continue;
      b.copy(tensor_view<const T, host_space>::vector(data.data() + (a - q.offset),
                                                      static_cast<std::int64_t>(e - a)),
             vec<typename St::space, T>(v.data() + (a - x.offset), e - a));
    }
  }
};

}  // namespace gradapt::detail::shard_k

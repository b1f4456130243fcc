#pragma once
/// @file
/// The checkpoint of `gradapt::shampoo_state`: `save` and `load` of one archive section
/// (per tensor its index, shape, layout and per block its statistics, roots, copies for the
/// roots in flight and failure counters; the graft state; the first moment), `load` checking
/// every field before it changes anything.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/linalg/factor_check.hpp"
#include "gradapt/optim/shampoo.hpp"

namespace gradapt {

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::save_header(archive_writer& w) const {
  w.put("format", static_cast<std::uint64_t>(format_version));
  w.put("element_type", name(dtype_of_v<compute_type>));
  w.put("graft", std::string(to_string(graft_)));
  w.put("beta1", beta1_);
  w.put("bias_correction", bias_correction_);
  w.put("spectrum", std::string(to_string(spectrum_)));
  w.put("preconditioner", std::string(to_string(preconditioner_)));
  w.put("roots_in_flight", pending_step_);
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::write_block(archive_writer& w, std::size_t t, std::size_t j,
                                            std::size_t label, const C* stats, const C* roots, const C* corr,
                                            const C* mrot, const C* snap) const {
  const auto& x = t_[t];
  const auto& bl = x.blocks[j];
  w.begin("block" + std::to_string(label));
  w.put_tensor<std::int64_t>("exponents", exponent_words(bl));
  for (std::size_t d = 0; d < bl.k && !bl.stats.empty(); ++d) {  // spectral descent keeps none
    const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
    const auto nn = static_cast<std::size_t>(bl.n[d] * bl.n[d]);
    const std::span<const compute_type> s(stats + bl.off[d], nn), r(roots + bl.off[d], nn);
    require_finite(s, x.name, label, "statistic");
    require_finite(r, x.name, label, "root");
    w.put_tensor<compute_type>("stat" + std::to_string(d), s, sh);
    w.put_tensor<compute_type>("root" + std::to_string(d), r, sh);
    if (pending_step_ != 0) {
      const std::span<const compute_type> c(snap + bl.off[d], s.size());
      require_finite(c, x.name, label, "statistic copy for the roots in flight");
      w.put_tensor<compute_type>("snap" + std::to_string(d), c, sh);
    }
  }
  if (!bl.corr.empty()) {
    const std::span<const compute_type> c(corr, bl.corr.size());
    require_finite(c, x.name, label, "corrected second moment");
    w.put_tensor<compute_type>("corrected", c);
  }
  if (!bl.mrot.empty()) {  // between steps always in the installed bases
    const std::span<const compute_type> m(mrot, bl.mrot.size());
    require_finite(m, x.name, label, "rotated first moment");
    w.put_tensor<compute_type>("rotated_moment", m);
  }
  w.put("ready", bl.ready);
  w.put("consecutive_failures", bl.consecutive);
  w.put("failures", bl.failures);
  w.end();
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::read_block(archive_reader& r, const std::string& pname, block_t& bl,
                                           std::size_t j, std::uint64_t in_flight) const {
  constexpr const char* who = "shampoo state load";
  r.begin("block" + std::to_string(j));
  const auto ex = r.get_tensor<std::int64_t>("exponents");
  detail::require(ex == exponent_words(bl), who, ": parameter '", pname, "' block ", j,
                  " has other root exponents in the checkpoint (inverse_exponent_override and "
                  "inverse_exponents must be those it was written with)");
  for (std::size_t d = 0; d < bl.k && !bl.stats.empty(); ++d) {
    const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
    const auto nn = static_cast<std::size_t>(bl.n[d] * bl.n[d]);
    const std::span<compute_type> s(bl.stats.data() + bl.off[d], nn), rt(bl.roots.data() + bl.off[d], nn);
    r.get_tensor<compute_type>("stat" + std::to_string(d), s, sh);
    r.get_tensor<compute_type>("root" + std::to_string(d), rt, sh);
    require_finite(std::span<const compute_type>(s), pname, j, "statistic", who);
    require_finite(std::span<const compute_type>(rt), pname, j, "root", who);
    const auto gram = [&](const compute_type* m, const char* what) {
      const std::string bad = detail::linalg::gram_violation(m, static_cast<std::size_t>(bl.n[d]));
      detail::require(bad.empty(), who, ": the ", what, " ", d, " of parameter '", pname, "' (block ", j,
                      ") ", bad);
    };
    gram(s.data(), "statistic");
    if (in_flight != 0) {
      const std::span<compute_type> c(bl.snap.data() + bl.off[d], nn);
      r.get_tensor<compute_type>("snap" + std::to_string(d), c, sh);
      require_finite(std::span<const compute_type>(c), pname, j, "statistic copy", who);
      gram(c.data(), "statistic copy");
    }
  }
  if (!bl.corr.empty()) {  // a sum of squares: finite and >= 0
    r.get_tensor<compute_type>("corrected", std::span<compute_type>(bl.corr));
    for (const compute_type v : bl.corr)
      detail::require(std::isfinite(v) && v >= 0, who, ": the corrected second moment of parameter '", pname,
                      "' (block ", j, ") holds ", v, " (expected finite values >= 0)");
  }
  if (!bl.mrot.empty()) {
    r.get_tensor<compute_type>("rotated_moment", std::span<compute_type>(bl.mrot));
    require_finite(std::span<const compute_type>(bl.mrot), pname, j, "rotated first moment", who);
    bl.mrot_valid = true;
  }
  bl.ready = r.get<bool>("ready");
  bl.consecutive = r.get<std::uint64_t>("consecutive_failures");
  bl.failures = r.get<std::uint64_t>("failures");
  detail::require(bl.consecutive < max_failures_ && bl.consecutive <= bl.failures, who, ": parameter '",
                  pname, "' block ", j, " has ", bl.consecutive, " consecutive failures of ", bl.failures,
                  " (expected fewer than max_consecutive_failures = ", max_failures_,
                  " and no more than the total)");
  r.end();
}

template <class L, class B, class V, class G>
std::uint64_t shampoo_state<L, B, V, G>::check_header(archive_reader& r, std::uint64_t steps) const {
  constexpr const char* who = "shampoo state load";
  const auto format = r.get<std::uint64_t>("format");
  detail::require(format == format_version, who, ": the checkpoint's Shampoo section has format ", format,
                  " but this library reads format ", format_version);
  const auto et = r.get<std::string>("element_type");
  detail::require(et == name(dtype_of_v<compute_type>), who, ": the checkpoint holds ", et,
                  " state but this state is ", name(dtype_of_v<compute_type>));
  const auto gr = r.get<std::string>("graft");
  detail::require(gr == to_string(graft_), who, ": the checkpoint's graft is '", gr,
                  "' but this state's is '", to_string(graft_),
                  "' (restore with the same shampoo_options::graft)");
  const auto b1 = r.get<double>("beta1");
  const auto bc = r.get<bool>("bias_correction");
  const auto sp = r.get<std::string>("spectrum");
  detail::require(b1 == beta1_ && bc == bias_correction_ && sp == to_string(spectrum_), who,
                  ": the checkpoint was written with beta1 ", b1, ", bias_correction ", bc, " and spectrum '",
                  sp, "' but this state has ", beta1_, ", ", bias_correction_, " and '", to_string(spectrum_),
                  "' (they shape the first moment and the roots; restore with the same shampoo_options)");
  const auto pc = r.get<std::string>("preconditioner");
  detail::require(pc == to_string(preconditioner_), who, ": the checkpoint's preconditioner is '", pc,
                  "' but this state's is '", to_string(preconditioner_),
                  "' (restore with the same shampoo_options::preconditioner)");
  const auto in_flight = r.get<std::uint64_t>("roots_in_flight");
  detail::require(in_flight == 0 || (staleness_ > 0 && in_flight <= steps && in_flight + staleness_ > steps),
                  who, ": the checkpoint has roots in flight, started at step ", in_flight, " of ", steps,
                  ", which this state (root_staleness ", staleness_,
                  ") would not install at a later step; restore with the root_staleness it was written with");
  return in_flight;
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::save(const B& b, archive_writer& w) const {
  save_header(w);
  w.put("tensors", static_cast<std::uint64_t>(t_.size()));
  for (std::size_t t = 0; t < t_.size(); ++t) {
    const auto& x = t_[t];
    w.begin(detail::archive_impl::join("tensor", "/", x.name));
    w.put("index", static_cast<std::uint64_t>(t));
    w.put_tensor<std::int64_t>("shape", x.shape);
    w.put_tensor<std::int64_t>("layout", layout_words(x.layout));
    for (std::size_t j = 0; j < x.blocks.size(); ++j) write_block_of(b, w, t, j, j);
    w.end();
  }
  std::vector<compute_type> tmp;  // a device buffer's values
  if (detail::shampoo_impl::graft_has_state(graft_))
    for (const auto& x : t_) {
      const auto v = host_values(b, x.graft, tmp);
      require_finite(v, x.name, 0, "graft state");
      w.put_tensor<compute_type>(detail::archive_impl::join("graft", "/", x.name), v, x.shape);
    }
  if (beta1_ > 0)
    for (const auto& x : t_) {
      const auto v = host_values(b, x.mom, tmp);
      require_finite(v, x.name, 0, "first moment");
      w.put_tensor<compute_type>(detail::archive_impl::join("first_moment", "/", x.name), v, x.shape);
    }
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::write_block_of(const B& b, archive_writer& w, std::size_t t, std::size_t j,
                                               std::size_t label) const {
  const auto& bl = t_[t].blocks[j];
  if constexpr (on_host) {
    (void)b;
    write_block(w, t, j, label, bl.stats.data(), bl.roots.data(), bl.corr.data(), bl.mrot.data(),
                bl.snap.data());
  } else {  // device memory: through host copies
    std::vector<compute_type> s(bl.stats.size()), r(bl.roots.size()), c(bl.corr.size()), m(bl.mrot.size()),
        sn(pending_step_ != 0 ? bl.snap.size() : 0);
    const auto get = [&](const buf& from, std::size_t at, std::vector<compute_type>& to) {
      const auto n = static_cast<std::int64_t>(to.size());
      if (n > 0)
        b.copy(tensor_view<const compute_type, typename B::space>::vector(from.data() + at, n),
               tensor_view<compute_type, host_space>::vector(to.data(), n));
    };
    get(dstats_, bl.at, s);
    get(droots_, bl.at, r);
    get(dcorr_, bl.at_e, c);
    get(dmrot_, bl.at_e, m);
    get(dsnap_, bl.at, sn);
    write_block(w, t, j, label, s.data(), r.data(), c.data(), m.data(), sn.data());
  }
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::block_to_device(const B& b, const block_t& bl) {
  if constexpr (!on_host) {
    const auto put_at = [&](const std::vector<compute_type>& from, buf& to, std::size_t at) {
      const auto n = static_cast<std::int64_t>(from.size());
      if (n > 0)
        b.copy(tensor_view<const compute_type, host_space>::vector(from.data(), n),
               tensor_view<compute_type, typename B::space>::vector(to.data() + at, n));
    };
    put_at(bl.stats, dstats_, bl.at);
    put_at(bl.roots, droots_, bl.at);
    put_at(bl.corr, dcorr_, bl.at_e);
    put_at(bl.mrot, dmrot_, bl.at_e);
    put_at(bl.snap, dsnap_, bl.at);  // root_staleness >= 1: the copies the roots in flight start from
  } else {
    (void)b;
    (void)bl;
  }
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::save_slice(const B& b, archive_writer& w, std::size_t t) const {
  const auto& x = tensor(t);
  w.put("first_block", static_cast<std::uint64_t>(x.first_block));
  w.put("blocks", static_cast<std::uint64_t>(x.blocks.size()));
  for (std::size_t j = 0; j < x.blocks.size(); ++j) write_block_of(b, w, t, j, x.first_block + j);
  std::vector<compute_type> tmp;  // a device buffer's values
  if (detail::shampoo_impl::graft_has_state(graft_)) {
    const auto v = host_values(b, x.graft, tmp);
    require_finite(v, x.name, 0, "graft state");
    w.put_tensor<compute_type>("graft", v);
  }
  if (beta1_ > 0) {
    const auto v = host_values(b, x.mom, tmp);
    require_finite(v, x.name, 0, "first moment");
    w.put_tensor<compute_type>("first_moment", v);
  }
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::load_header(archive_reader& r, std::uint64_t steps) {
  const auto in_flight = check_header(r, steps);
  steps_ = steps;
  failed_ = false;
  pending_step_ = in_flight;
  relaunch_ = in_flight != 0;
}

template <class L, class B, class V, class G>
void shampoo_state<L, B, V, G>::load_slice(const B& b, archive_reader& r, std::size_t t, std::size_t offset,
                                           std::size_t length) {
  constexpr const char* who = "shampoo state load";
  auto& x = t_.at(t);
  detail::require(x.sliced, "shampoo_state::load_slice: tensor ", t, " ('", x.name,
                  "') is not a slice (the state was not made by the sharded optimizer)");
  // The old slice's blocks: its rows of blocks, each `per_band` blocks of the whole tensor.
  std::size_t first = 0, count = 0;
  if (!x.layout.diagonal) {
    const std::size_t rows = x.band_rows * x.band;  // elements of one full row of blocks
    detail::require(offset % rows == 0 && (length % rows == 0 || offset + length == x.whole_size), who,
                    ": parameter '", x.name, "': the checkpoint's slice [", offset, ", ", offset + length,
                    ") cuts a block (rows of blocks of ", rows, " elements)");
    first = offset / rows * x.per_band;
    count = (length / rows + (length % rows != 0 ? 1 : 0)) * x.per_band;
  }
  const auto fb = r.get<std::uint64_t>("first_block");
  const auto nb = r.get<std::uint64_t>("blocks");
  detail::require(fb == first && nb == count, who, ": parameter '", x.name, "': the checkpoint's slice [",
                  offset, ", ", offset + length, ") holds blocks ", fb, " + ", nb, " but its layout gives ",
                  first, " + ", count, " (the blocking options must be those it was written with)");
  const std::uint64_t in_flight = pending_step_;
  block_t scratch;
  for (std::size_t j = first; j < first + count; ++j) {
    const bool mine = j >= x.first_block && j < x.first_block + x.blocks.size();
    // Every block is read and checked; a block of another slice goes through a copy of one of
    // this slice's (the blocks of one tensor share their factor count and kind).
    block_t* dst = mine ? &x.blocks[j - x.first_block] : nullptr;
    if (!mine) {
      detail::require(!x.blocks.empty(), who, ": parameter '", x.name, "' has no blocks here but block ", j,
                      " in the checkpoint");
      scratch = x.blocks[0];
      const auto& whole = x.whole_layout.blocks.at(j);
      for (std::size_t d = 0; d < scratch.k; ++d) scratch.n[d] = whole.size[d];
      std::size_t mats = 0, elems = 1;
      for (std::size_t d = 0; d < scratch.k; ++d) {
        scratch.off[d] = mats;
        mats += static_cast<std::size_t>(scratch.n[d] * scratch.n[d]);
        elems *= static_cast<std::size_t>(scratch.n[d]);
      }
      if (!scratch.stats.empty()) {
        scratch.stats.assign(mats, compute_type(0));
        scratch.roots.assign(mats, compute_type(0));
        if (in_flight != 0) scratch.snap.assign(mats, compute_type(0));
      }
      if (!scratch.corr.empty()) scratch.corr.assign(elems, compute_type(0));
      if (!scratch.mrot.empty()) scratch.mrot.assign(elems, compute_type(0));
      dst = &scratch;
    }
    read_block(r, x.name, *dst, j, in_flight);
    if (mine) block_to_device(b, *dst);
  }
  const auto copy_range = [&](const char* field, buf& to) {
    const auto v = r.get_tensor<compute_type>(field);
    detail::require(v.size() == length, who, ": parameter '", x.name, "': the checkpoint's ", field,
                    " holds ", v.size(), " values for the slice's ", length, " elements");
    for (const compute_type e : v)
      detail::require(std::isfinite(e), who, ": the ", field, " of parameter '", x.name,
                      "' holds a non-finite value (a checkpoint of a diverged run cannot be resumed)");
    const std::size_t a = std::max(offset, x.offset), e = std::min(offset + length, x.offset + x.size);
    if (a >= e) return;
    if constexpr (on_host) {
      for (std::size_t i = a; i < e; ++i) to[i - x.offset] = v[i - offset];
    } else {  // the shared range, copied into the device buffer
      const auto n = static_cast<std::int64_t>(e - a);
      b.copy(tensor_view<const compute_type, host_space>::vector(v.data() + (a - offset), n),
             tensor_view<compute_type, typename B::space>::vector(to.data() + (a - x.offset), n));
    }
  };
  if (detail::shampoo_impl::graft_has_state(graft_)) copy_range("graft", x.graft);
  if (beta1_ > 0) copy_range("first_moment", x.mom);
}

template <class L, class B, class V, class G>
template <class Commit>
void shampoo_state<L, B, V, G>::load(const B& b, archive_reader& r, std::uint64_t steps, Commit&& commit) {
  constexpr const char* who = "shampoo state load";
  if (worker_ && pending_step_ != 0 && !relaunch_) {  // the copies it reads may be replaced
    worker_->discard();
    relaunch_ = true;  // if the load fails, the same roots start again at the next step
  }
  const auto in_flight = check_header(r, steps);
  const auto count = r.get<std::uint64_t>("tensors");
  detail::require(count == t_.size(), who, ": the checkpoint holds ", count, " tensors but this state ",
                  t_.size(), " (restore for the same parameters)");
  // Everything is read into `next` first; the state changes only after every check passed.
  std::vector<std::vector<block_t>> next(t_.size());
  std::vector<std::vector<compute_type>> graft(t_.size());
  for (std::size_t t = 0; t < t_.size(); ++t) {
    const auto& x = t_[t];
    const std::string sec = detail::archive_impl::join("tensor", "/", x.name);
    detail::require(r.has(detail::archive_impl::join(sec, "/", "index")), who,
                    ": the checkpoint has no parameter '", x.name,
                    "' (restore for the same parameter names)");
    r.begin(sec);
    const auto index = r.get<std::uint64_t>("index");
    detail::require(index == t, who, ": parameter '", x.name, "' is tensor ", index,
                    " in the checkpoint but ", t, " here (restore for the same parameter order)");
    const auto shape = r.get_tensor<std::int64_t>("shape");
    detail::require(shape == x.shape, who, ": parameter '", x.name,
                    "' has another shape in the checkpoint (restore for the same parameter shapes)");
    const auto lay = r.get_tensor<std::int64_t>("layout");
    detail::require(lay == layout_words(x.layout), who, ": parameter '", x.name,
                    "' is cut into other blocks in the checkpoint (max_preconditioner_dim, merge_small_dims, "
                    "merge_from, precondition_1d and skip_preconditioning_dim_size_gt must be those the "
                    "checkpoint was written with)");
    next[t] = x.blocks;
    for (std::size_t j = 0; j < x.blocks.size(); ++j) read_block(r, x.name, next[t][j], j, in_flight);
    r.end();
  }
  if (detail::shampoo_impl::graft_has_state(graft_))
    for (std::size_t t = 0; t < t_.size(); ++t) {
      graft[t].resize(t_[t].graft.size());
      r.get_tensor<compute_type>(detail::archive_impl::join("graft", "/", t_[t].name),
                                 std::span<compute_type>(graft[t]), t_[t].shape);
      require_finite(std::span<const compute_type>(graft[t]), t_[t].name, 0, "graft state", who);
    }
  std::vector<std::vector<compute_type>> mom(t_.size());
  if (beta1_ > 0)
    for (std::size_t t = 0; t < t_.size(); ++t) {
      mom[t].resize(t_[t].mom.size());
      r.get_tensor<compute_type>(detail::archive_impl::join("first_moment", "/", t_[t].name),
                                 std::span<compute_type>(mom[t]), t_[t].shape);
      require_finite(std::span<const compute_type>(mom[t]), t_[t].name, 0, "first moment", who);
    }
  {  // an archive with fields this state would not read is rejected before anything changes
    std::size_t want = 9 + (detail::shampoo_impl::graft_has_state(graft_) ? t_.size() : 0) +
                       (beta1_ > 0 ? t_.size() : 0),
                own = 0;
    for (const auto& x : t_) {
      want += 3;
      for (const auto& bl : x.blocks) want += block_fields(bl, in_flight != 0);
    }
    own = r.names().size();
    detail::require(own == want, who, ": the checkpoint's Shampoo section holds ", own,
                    " fields but this state has ", want, " (written for other parameters or another layout)");
  }
  commit();  // the chain's buffers, all or nothing itself: throws before changing them
  for (std::size_t t = 0; t < t_.size(); ++t) {
    for (std::size_t j = 0; j < next[t].size(); ++j) {
      auto& bl = t_[t].blocks[j];
      bl.stats.swap(next[t][j].stats);
      bl.corr.swap(next[t][j].corr);
      bl.mrot.swap(next[t][j].mrot);
      bl.mrot_valid = true;
      bl.roots.swap(next[t][j].roots);
      if (in_flight != 0) bl.snap.swap(next[t][j].snap);
      bl.ready = next[t][j].ready;
      bl.consecutive = next[t][j].consecutive;
      bl.failures = next[t][j].failures;
    }
    if constexpr (on_host) {
      (void)b;
      if (detail::shampoo_impl::graft_has_state(graft_)) t_[t].graft.swap(graft[t]);
      if (beta1_ > 0) t_[t].mom.swap(mom[t]);
    } else {  // into the device buffers (read and checked above)
      const auto put = [&](const std::vector<compute_type>& from, buf& to) {
        const auto n = static_cast<std::int64_t>(from.size());
        b.copy(tensor_view<const compute_type, host_space>::vector(from.data(), n),
               tensor_view<compute_type, typename B::space>::vector(to.data(), n));
      };
      if (detail::shampoo_impl::graft_has_state(graft_)) put(graft[t], t_[t].graft);
      if (beta1_ > 0) put(mom[t], t_[t].mom);
      for (const auto& bl : t_[t].blocks) block_to_device(b, bl);  // statistics, roots, moments
    }
  }
  steps_ = steps;
  failed_ = false;
  pending_step_ = in_flight;
  relaunch_ = in_flight != 0;
}

}  // namespace gradapt

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
void shampoo_state<L, B, V, G>::save(const B&, archive_writer& w) const {
  w.put("format", static_cast<std::uint64_t>(format_version));
  w.put("element_type", name(dtype_of_v<compute_type>));
  w.put("graft", std::string(to_string(graft_)));
  w.put("beta1", beta1_);
  w.put("bias_correction", bias_correction_);
  w.put("spectrum", std::string(to_string(spectrum_)));
  w.put("preconditioner", std::string(to_string(preconditioner_)));
  w.put("roots_in_flight", pending_step_);
  w.put("tensors", static_cast<std::uint64_t>(t_.size()));
  for (std::size_t t = 0; t < t_.size(); ++t) {
    const auto& x = t_[t];
    w.begin(detail::archive_impl::join("tensor", "/", x.name));
    w.put("index", static_cast<std::uint64_t>(t));
    w.put_tensor<std::int64_t>("shape", x.shape);
    w.put_tensor<std::int64_t>("layout", layout_words(x.layout));
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      const auto& bl = x.blocks[j];
      w.begin("block" + std::to_string(j));
      w.put_tensor<std::int64_t>("exponents", exponent_words(bl));
      for (std::size_t d = 0; d < bl.k && !bl.stats.empty(); ++d) {  // spectral descent keeps none
        const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
        const std::span<const compute_type> s = statistic(t, j, d), r = root(t, j, d);
        require_finite(s, x.name, j, "statistic");
        require_finite(r, x.name, j, "root");
        w.put_tensor<compute_type>("stat" + std::to_string(d), s, sh);
        w.put_tensor<compute_type>("root" + std::to_string(d), r, sh);
        if (pending_step_ != 0) {
          const std::span<const compute_type> c(bl.snap.data() + bl.off[d], s.size());
          require_finite(c, x.name, j, "statistic copy for the roots in flight");
          w.put_tensor<compute_type>("snap" + std::to_string(d), c, sh);
        }
      }
      if (!bl.corr.empty()) {
        require_finite(std::span<const compute_type>(bl.corr), x.name, j, "corrected second moment");
        w.put_tensor<compute_type>("corrected", std::span<const compute_type>(bl.corr));
      }
      w.put("ready", bl.ready);
      w.put("consecutive_failures", bl.consecutive);
      w.put("failures", bl.failures);
      w.end();
    }
    w.end();
  }
  if (detail::shampoo_impl::graft_has_state(graft_))
    for (const auto& x : t_) {
      require_finite(std::span<const compute_type>(x.graft), x.name, 0, "graft state");
      w.put_tensor<compute_type>(detail::archive_impl::join("graft", "/", x.name),
                                 std::span<const compute_type>(x.graft), x.shape);
    }
  if (beta1_ > 0)
    for (const auto& x : t_) {
      require_finite(std::span<const compute_type>(x.mom), x.name, 0, "first moment");
      w.put_tensor<compute_type>(detail::archive_impl::join("first_moment", "/", x.name),
                                 std::span<const compute_type>(x.mom), x.shape);
    }
}

template <class L, class B, class V, class G>
template <class Commit>
void shampoo_state<L, B, V, G>::load(const B&, archive_reader& r, std::uint64_t steps, Commit&& commit) {
  constexpr const char* who = "shampoo state load";
  if (worker_ && pending_step_ != 0 && !relaunch_) {  // the copies it reads may be replaced
    worker_->discard();
    relaunch_ = true;  // if the load fails, the same roots start again at the next step
  }
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
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      auto& bl = next[t][j];
      r.begin("block" + std::to_string(j));
      const auto ex = r.get_tensor<std::int64_t>("exponents");
      detail::require(ex == exponent_words(bl), who, ": parameter '", x.name, "' block ", j,
                      " has other root exponents in the checkpoint (inverse_exponent_override and "
                      "inverse_exponents must be those it was written with)");
      for (std::size_t d = 0; d < bl.k && !bl.stats.empty(); ++d) {
        const std::int64_t sh[2] = {bl.n[d], bl.n[d]};
        const auto nn = static_cast<std::size_t>(bl.n[d] * bl.n[d]);
        const std::span<compute_type> s(bl.stats.data() + bl.off[d], nn), rt(bl.roots.data() + bl.off[d], nn);
        r.get_tensor<compute_type>("stat" + std::to_string(d), s, sh);
        r.get_tensor<compute_type>("root" + std::to_string(d), rt, sh);
        require_finite(std::span<const compute_type>(s), x.name, j, "statistic", who);
        require_finite(std::span<const compute_type>(rt), x.name, j, "root", who);
        const auto gram = [&](const compute_type* m, const char* what) {
          const std::string bad = detail::linalg::gram_violation(m, static_cast<std::size_t>(bl.n[d]));
          detail::require(bad.empty(), who, ": the ", what, " ", d, " of parameter '", x.name, "' (block ", j,
                          ") ", bad);
        };
        gram(s.data(), "statistic");
        if (in_flight != 0) {
          const std::span<compute_type> c(bl.snap.data() + bl.off[d], nn);
          r.get_tensor<compute_type>("snap" + std::to_string(d), c, sh);
          require_finite(std::span<const compute_type>(c), x.name, j, "statistic copy", who);
          gram(c.data(), "statistic copy");
        }
      }
      if (!bl.corr.empty()) {  // a sum of squares: finite and >= 0
        r.get_tensor<compute_type>("corrected", std::span<compute_type>(bl.corr));
        for (const compute_type v : bl.corr)
          detail::require(std::isfinite(v) && v >= 0, who, ": the corrected second moment of parameter '",
                          x.name, "' (block ", j, ") holds ", v, " (expected finite values >= 0)");
      }
      bl.ready = r.get<bool>("ready");
      bl.consecutive = r.get<std::uint64_t>("consecutive_failures");
      bl.failures = r.get<std::uint64_t>("failures");
      detail::require(bl.consecutive < max_failures_ && bl.consecutive <= bl.failures, who, ": parameter '",
                      x.name, "' block ", j, " has ", bl.consecutive, " consecutive failures of ",
                      bl.failures, " (expected fewer than max_consecutive_failures = ", max_failures_,
                      " and no more than the total)");
      r.end();
    }
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
      for (const auto& bl : x.blocks)
        want += (bl.stats.empty() ? 0 : (in_flight != 0 ? 3 : 2) * bl.k) + 4 + (bl.corr.empty() ? 0 : 1);
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
      bl.roots.swap(next[t][j].roots);
      if (in_flight != 0) bl.snap.swap(next[t][j].snap);
      bl.ready = next[t][j].ready;
      bl.consecutive = next[t][j].consecutive;
      bl.failures = next[t][j].failures;
    }
    if (detail::shampoo_impl::graft_has_state(graft_)) t_[t].graft.swap(graft[t]);
    if (beta1_ > 0) t_[t].mom.swap(mom[t]);
  }
  steps_ = steps;
  failed_ = false;
  pending_step_ = in_flight;
  relaunch_ = in_flight != 0;
}

}  // namespace gradapt

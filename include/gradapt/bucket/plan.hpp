#pragma once
/// @file
/// `gradapt::bucket::bucket_plan`: which gradients travel together in one fused collective
/// (Horovod's tensor fusion, PyTorch DDP's buckets). Deterministic from (tensor sizes and
/// element types, options, and optionally an observed ready order), so every rank builds the
/// same buckets without talking.
///
/// The rule (DDP's): walk the tensors in reverse registration order (the order in which a
/// backward pass usually produces their gradients), or in an observed ready order after
/// `rebuild`; keep one open bucket per element type; add each tensor to the open bucket of its
/// type, and close that bucket once it holds at least the cap (`first_cap_bytes` for the first
/// bucket of the plan, `cap_bytes` after it). A tensor is never split: one larger than the cap
/// fills a bucket of its own. Buckets are numbered in the order they close (the open ones
/// close at the end, in element-type order); collectives launch in that order on every rank,
/// so gradients that become ready in another order on another rank cannot make ranks wait in
/// different collectives.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt::bucket {

/// Options of a bucket plan, with designated initialisers:
/// `bucket_plan::make(tensors, {.cap_bytes = 25 << 20})`.
struct bucket_options {
  /// A bucket closes once it holds at least this many bytes, >= 1. Default 25 MiB (DDP's
  /// `bucket_cap_mb`).
  std::size_t cap_bytes = std::size_t{25} << 20;
  /// The cap of the plan's first bucket, >= 1, so that the first collective starts early in
  /// the backward pass. Default 1 MiB (DDP's first bucket).
  std::size_t first_cap_bytes = std::size_t{1} << 20;
};

/// A tensor as the plan sees it: its element count and element type.
struct tensor_info {
  std::size_t size = 0;         ///< elements
  dtype type = dtype::float32;  ///< element type (one element type per bucket)
};

/// One fused collective: tensors of one element type, in the order they are packed.
struct bucket {
  dtype type = dtype::float32;       ///< element type of every tensor in it
  std::vector<std::size_t> tensors;  ///< tensor indices, in packing order
  std::vector<std::size_t> offsets;  ///< each tensor's first element in the fused buffer
  std::size_t elements = 0;          ///< elements of the fused buffer
  /// Bytes of the fused buffer.
  [[nodiscard]] std::size_t bytes() const { return elements * size_of(type); }
};

/// Where a tensor lives in the plan.
struct location {
  std::size_t bucket = 0;  ///< bucket index
  std::size_t offset = 0;  ///< first element in the bucket's fused buffer
};

/// The buckets of a parameter list (see the file comment). Built by `make` or `rebuild`.
class bucket_plan {
 public:
  /// The plan for `tensors` (in registration order), walked in reverse registration order.
  /// @throws gradapt::error when a cap is 0
  static bucket_plan make(std::span<const tensor_info> tensors, const bucket_options& o = {}) {
    std::vector<std::size_t> order(tensors.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
    return build(tensors, order, o, "make");
  }

  /// The plan for `tensors` walked in `ready_order`, the order in which their gradients were
  /// observed to become ready (DDP's rebuild after the first iteration). Every rank must pass
  /// the same order (the framework agrees on it, e.g. rank 0's by broadcast).
  /// @throws gradapt::error when `ready_order` is not a permutation of the tensor indices
  ///         (naming a missing or repeated index) or a cap is 0
  static bucket_plan rebuild(std::span<const tensor_info> tensors, std::span<const std::size_t> ready_order,
                             const bucket_options& o = {}) {
    gradapt::detail::require(ready_order.size() == tensors.size(),
                             "bucket_plan::rebuild: the ready order lists ", ready_order.size(),
                             " tensors but the plan has ", tensors.size(), " (list every tensor once)");
    std::vector<char> seen(tensors.size(), 0);
    for (const std::size_t t : ready_order) {
      gradapt::detail::require(t < tensors.size(), "bucket_plan::rebuild: tensor ", t,
                               " in the ready order is out of range (", tensors.size(), " tensors)");
      gradapt::detail::require(seen[t] == 0, "bucket_plan::rebuild: tensor ", t,
                               " appears twice in the ready order (list every tensor once)");
      seen[t] = 1;
    }
    return build(tensors, std::vector<std::size_t>(ready_order.begin(), ready_order.end()), o, "rebuild");
  }

  /// The buckets, in launch order.
  [[nodiscard]] std::span<const bucket> buckets() const noexcept { return buckets_; }
  /// Tensors in the plan.
  [[nodiscard]] std::size_t tensors() const noexcept { return where_.size(); }
  /// The bucket and offset of tensor t.
  /// @throws gradapt::error when t is out of range
  [[nodiscard]] location where(std::size_t t) const {
    gradapt::detail::require(t < where_.size(), "bucket_plan::where: tensor ", t, " is out of range (",
                             where_.size(), " tensors)");
    return where_[t];
  }
  /// The options the plan was built with.
  [[nodiscard]] const bucket_options& options() const noexcept { return opt_; }

  /// A readable description: per bucket its element type, bytes and tensors.
  [[nodiscard]] std::string describe() const {
    std::string s("bucket_plan: ");
    s.append(std::to_string(buckets_.size())).append(" bucket(s) for ").append(std::to_string(where_.size()));
    s.append(" tensor(s)");
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const bucket& k = buckets_[b];
      s.append("\n  bucket ").append(std::to_string(b)).append(": ").append(name(k.type)).append(", ");
      s.append(std::to_string(k.bytes())).append(" bytes, tensors");
      for (const std::size_t t : k.tensors) s.append(" ").append(std::to_string(t));
    }
    return s;
  }

  /// Same buckets (tensors, order and types).
  friend bool operator==(const bucket_plan& a, const bucket_plan& b) {
    if (a.buckets_.size() != b.buckets_.size()) return false;
    for (std::size_t i = 0; i < a.buckets_.size(); ++i)
      if (a.buckets_[i].type != b.buckets_[i].type || a.buckets_[i].tensors != b.buckets_[i].tensors)
        return false;
    return true;
  }

 private:
  static bucket_plan build(std::span<const tensor_info> tensors, const std::vector<std::size_t>& order,
                           const bucket_options& o, std::string_view fn) {
    gradapt::detail::require(o.cap_bytes >= 1, "bucket_plan::", fn,
                             ": bucket_options::cap_bytes is 0 (expected >= 1 byte)");
    gradapt::detail::require(o.first_cap_bytes >= 1, "bucket_plan::", fn,
                             ": bucket_options::first_cap_bytes is 0 (expected >= 1 byte)");
    for (std::size_t t = 0; t < tensors.size(); ++t)
      gradapt::detail::require(tensors[t].size <= std::numeric_limits<std::size_t>::max() / 8,
                               "bucket_plan::", fn, ": tensor ", t, " has ", tensors[t].size,
                               " elements (too many to count in bytes)");
    bucket_plan p;
    p.opt_ = o;
    p.where_.resize(tensors.size());
    constexpr std::size_t types = 4;
    std::optional<bucket> open[types];
    const auto close = [&](std::size_t k) {
      for (std::size_t i = 0; i < open[k]->tensors.size(); ++i)
        p.where_[open[k]->tensors[i]] = {p.buckets_.size(), open[k]->offsets[i]};
      p.buckets_.push_back(std::move(*open[k]));
      open[k].reset();
    };
    for (const std::size_t t : order) {
      const auto k = static_cast<std::size_t>(tensors[t].type);
      gradapt::detail::require(k < types, "bucket_plan::", fn, ": tensor ", t,
                               " has an unknown element type");
      if (!open[k]) open[k] = bucket{tensors[t].type, {}, {}, 0};
      bucket& b = *open[k];
      b.tensors.push_back(t);
      b.offsets.push_back(b.elements);
      gradapt::detail::require(tensors[t].size <= std::numeric_limits<std::size_t>::max() - b.elements,
                               "bucket_plan::", fn, ": a bucket's element count overflows std::size_t");
      b.elements += tensors[t].size;
      const std::size_t cap = p.buckets_.empty() ? o.first_cap_bytes : o.cap_bytes;
      if (b.bytes() >= cap) close(k);
    }
    for (std::size_t k = 0; k < types; ++k)
      if (open[k]) close(k);
    return p;
  }

  bucket_options opt_{};
  std::vector<bucket> buckets_;
  std::vector<location> where_;
};

}  // namespace gradapt::bucket

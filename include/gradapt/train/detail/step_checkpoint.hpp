#pragma once
/// @file
/// `train::data_parallel_step`'s checkpoints: the bodies of `save`, `load` and `restore` (on
/// the same or another number of ranks, every state slot) and the archive sections they read
/// and write. Included by train/data_parallel_step.hpp, whose class declares these members
/// (not for direct inclusion).
#ifndef GRADAPT_TRAIN_STEP
#error \
    "gradapt/train/detail/step_checkpoint.hpp is part of gradapt/train/data_parallel_step.hpp: include that header"
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt::train {

GRADAPT_TRAIN_STEP_TEMPLATE
std::vector<std::byte> GRADAPT_TRAIN_STEP::save() const {
  archive_writer w{archive_kind, archive_version};
  w.put("ranks", static_cast<std::uint64_t>(comm_->size()));
  w.put("slots", slot_mask());
  w.put("tensors", static_cast<std::uint64_t>(tensors_));
  w.put("elements", static_cast<std::uint64_t>(total_));
  w.begin("settings");
  w.put("lr", settings_.lr);
  w.put("local_batch", settings_.local_batch);
  w.put("accumulation_steps", static_cast<std::int64_t>(settings_.accumulation_steps));
  w.put("period", settings_.period);
  w.put("synchronous", settings_.synchronous);
  w.put_tensor("rank_batches", std::span<const double>(settings_.rank_batches));
  w.end();
  w.put("calls", calls_);
  put_metrics(w, last_);
  w.put("global_batch", last_.global_batch);
  w.begin("optimizer");
  if constexpr (has_sharded_state) {  // this rank's shard, as the sharded optimizer saves it
    const std::vector<std::byte> shard = state_->save(backend_);
    w.put("shard", std::string_view(reinterpret_cast<const char*>(shard.data()), shard.size()));
  } else {
    state_.save(backend_, w);
  }
  w.end();
  for_each_section(*this, [&](const char* section, const auto& st) { put_section(w, section, st); });
  return w.finish();
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::restore(std::span<const std::byte> bytes, rescale_rule rule) {
  static_assert(!has_sharded_state,
                "train::data_parallel_step::restore: with zero_state the state is in every old rank's "
                "checkpoint; pass them as restore(archive_source, rule)");
  const std::vector<std::byte> backup = save();
  std::string bad;
  try {
    load_impl(bytes, &rule);
  } catch (const error& e) {
    bad = e.what();
    load_impl(backup, nullptr);
  }
  agree_on_restore(bytes, rule, bad, [&] { load_impl(backup, nullptr); });
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::restore(const archive_source& archive, rescale_rule rule) {
  if constexpr (has_sharded_state) {
    restore_sharded(archive, rule);
  } else {
    std::span<const std::byte> bytes;
    std::string bad;
    try {
      bytes = archive(0);
    } catch (const std::exception& e) {
      bad = detail::message(
          "train::data_parallel_step::restore on rank ", comm_->rank(),
          ": the archive source threw for old rank 0: ", gradapt::detail::without_prefix(e.what()));
    }
    if (bad.empty()) {
      restore(bytes, rule);
    } else {
      agree_on_restore({}, rule, bad, [] {});
    }
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::load(std::span<const std::byte> bytes) {
  if constexpr (has_sharded_state) {
    load_sharded(bytes);
    return;
  }
  // A damaged, truncated or foreign archive is rejected by the reader (checksum, kind,
  // version, index) before anything changes; only a later mismatch needs the backup.
  (void)archive_reader{bytes, archive_kind, archive_version};
  const std::vector<std::byte> backup = save();
  try {
    load_impl(bytes, nullptr);
  } catch (...) {
    load_impl(backup, nullptr);
    throw;
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <class Self, class F>
void GRADAPT_TRAIN_STEP::for_each_section(Self& self, F&& f) {
  if constexpr (has_loss_scaling) f("loss_scaler", self.scaler_);
  if constexpr (has_adascale) {
    f("noise_scale", self.adapt_.gns);
    f("adascale", self.adapt_.ada);
  }
  if constexpr (has_local_sgd) f("local_sgd", *self.sync_.driver);
  if constexpr (saves_state<combiner_type>) f("combine", *self.combiner_);
  if constexpr (has_preconditioner && saves_state<preconditioner_type>) f("precondition", *self.pre_);
  std::size_t h = 0;
  self.for_each_hook([&](auto& hook) {
    if constexpr (saves_state<std::remove_cvref_t<decltype(hook)>>) f(hook_section(h).c_str(), hook);
    ++h;
  });
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <class State>
void GRADAPT_TRAIN_STEP::put_section(archive_writer& w, const char* section, const State& st) {
  w.begin(section);
  st.save(w);
  w.end();
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::put_metrics(archive_writer& w, const step_metrics& m) {
  w.begin("metrics");
  put_fields(w, m, step_metrics::archive_fields());
  w.end();
}

GRADAPT_TRAIN_STEP_TEMPLATE
step_metrics GRADAPT_TRAIN_STEP::get_metrics(archive_reader& r) {
  r.begin("metrics");
  const step_metrics m = get_fields(r, step_metrics::archive_fields());
  r.end();
  return m;
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::load_impl(std::span<const std::byte> bytes, const rescale_rule* resize,
                                   std::string_view* shard, std::uint64_t* old_ranks) {
  constexpr const char* fn = "train::data_parallel_step::load";
  archive_reader r{bytes, archive_kind, archive_version};
  const auto expect = [&](const char* field, const char* what, std::uint64_t want, const char* hint) {
    const auto got = r.get<std::uint64_t>(field);
    detail::require(got == want, fn, ": the checkpoint's ", what, " is ", got, " but this step's is ", want,
                    " (", hint, ")");
  };
  const auto saved_ranks = r.get<std::uint64_t>("ranks");
  const auto ranks = static_cast<std::uint64_t>(comm_->size());
  detail::require(resize || saved_ranks == ranks, fn, ": the checkpoint's rank count is ", saved_ranks,
                  " but this step's is ", ranks,
                  " (restore on as many ranks as saved, or resize with restore(bytes, rescale_rule))");
  detail::require(saved_ranks >= 1, fn, ": the checkpoint's rank count is 0");
  expect("slots",
         "slot mask (1 loss scaling, 2 a combiner other than allreduce_mean, 4 AdaScale, 8 LocalSGD, 16 "
         "a preconditioner, 32 zero_state<1>, 64 zero_state<2>, 128 bucket_reduce)",
         slot_mask(), "restore into a step built with the same policies");
  expect("tensors", "tensor count", static_cast<std::uint64_t>(tensors_), "restore for the same parameters");
  expect("elements", "element count", static_cast<std::uint64_t>(total_), "restore for the same parameters");
  step_settings s;
  r.begin("settings");
  s.lr = r.get<double>("lr");
  s.local_batch = r.get<double>("local_batch");
  s.accumulation_steps = r.get<int>("accumulation_steps");
  s.period = r.get<std::int64_t>("period");
  if (r.version() >= 2) {
    s.synchronous = r.get<bool>("synchronous");
    s.rank_batches = r.get_tensor<double>("rank_batches");
  }
  r.end();
  detail::require(std::isfinite(s.lr) && s.lr >= 0.0, fn, ": the checkpoint's learning rate is ", s.lr,
                  " (expected finite and >= 0)");
  detail::require(std::isfinite(s.local_batch) && s.local_batch > 0.0 && s.accumulation_steps >= 1, fn,
                  ": the checkpoint's batch settings are local_batch ", s.local_batch,
                  ", accumulation_steps ", s.accumulation_steps, " (expected finite > 0 and >= 1)");
  const auto calls = r.get<std::uint64_t>("calls");
  detail::require(calls < std::numeric_limits<std::uint64_t>::max(), fn, ": step counter ", calls,
                  " cannot grow");
  step_metrics m = get_metrics(r);
  if (r.version() >= 2) m.global_batch = r.get<double>("global_batch");
  detail::require(s.rank_batches.empty() || s.rank_batches.size() == saved_ranks, fn,
                  ": the checkpoint's rank_batches holds ", s.rank_batches.size(), " sizes for ", saved_ranks,
                  " ranks");
  for (const double b : s.rank_batches)
    detail::require(std::isfinite(b) && b > 0.0, fn, ": the checkpoint's rank_batches holds ", b,
                    " (expected finite sizes > 0)");
  if (resize) s = rescaled(s, *resize, saved_ranks, ranks);
  if constexpr (!has_settable_period)
    detail::require(s.period == 0, fn, ": the checkpoint's period is ", s.period,
                    " but this step has no fixed LocalSGD period");
  if constexpr (has_local_sgd && has_settable_period)
    detail::require(s.period >= 1, fn, ": the checkpoint's period is ", s.period, " (expected >= 1)");
  // Apply (component loads validate their own sections).
  r.begin("optimizer");
  if constexpr (has_sharded_state) {
    detail::require(shard != nullptr, fn, ": a sharded state loads through load()");
    *shard = r.get<std::string_view>("shard");  // loaded by load_sharded, collectively
  } else {
    state_.load(backend_, r);
  }
  r.end();
  if constexpr (has_local_sgd && has_settable_period) {
    if (s.period != sync_.schedule.options().period) {
      sync_.schedule = with_period(s.period);
      sync_.driver.emplace(*comm_, sync_.options, sync_.schedule);
    }
  }
  for_each_section(*this, [&](const char* section, auto& st) { load_section(r, section, st); });
  r.finish();
  settings_ = s;
  calls_ = calls;
  last_ = m;
  busy_ = -1.0;
  rank_times_.clear();
  rank_busy_.clear();
  if constexpr (has_local_sgd) sync_.was_synchronous = settings_.synchronous;
  if (old_ranks != nullptr) *old_ranks = saved_ranks;
  std::fill(marked_.begin(), marked_.end(), char{0});  // a load starts a step afresh
  mark_error_.clear();
  nonfinite_ = 0.0;
  local_sq_ = 0.0;
  marks_ = 0;
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::load_sharded(std::span<const std::byte> bytes) {
  constexpr const char* fn = "train::data_parallel_step::load";
  const std::vector<std::byte> backup = save();
  const auto undo = [&] {
    std::string_view ignored;
    load_impl(backup, nullptr, &ignored);
  };
  std::string_view shard;
  std::string bad;
  try {
    load_impl(bytes, nullptr, &shard);
  } catch (const error& e) {
    bad = detail::message(fn, " on rank ", comm_->rank(), ": ", gradapt::detail::without_prefix(e.what()));
    undo();
  }
  try {
    agree(fn, std::span<const agreed_value>(), bad);
  } catch (...) {
    if (bad.empty()) undo();
    throw;
  }
  const int me = comm_->rank();
  const std::span<const std::byte> mine(reinterpret_cast<const std::byte*>(shard.data()), shard.size());
  try {
    // This rank's checkpoint holds its own shard; on the same plan no other old rank's
    // shard overlaps this rank's, and old rank 0's archive is read only for the plan, which
    // every rank's archive holds.
    state_ = sharded_->load(*comm_, backend_, *params_, [&](int r) -> std::span<const std::byte> {
      detail::require(r == me || r == 0, fn, " on rank ", me,
                      ": the checkpoint's partition differs from this step's (old rank ", r,
                      "'s shard is needed); load a checkpoint saved with the same world size and "
                      "zero_state options, or restore(archive_source, rule) from every old rank's");
      return mine;
    });
  } catch (...) {
    undo();
    throw;
  }
  last_.state_bytes = state_bytes();
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <class Undo>
void GRADAPT_TRAIN_STEP::agree_on_restore(std::span<const std::byte> bytes, rescale_rule rule,
                                          const std::string& bad, Undo undo) {
  // (Not the archive's CRC32C: a CRC over bytes that end with their own CRC is a constant.)
  const std::uint64_t hash = gradapt::detail::hash_bytes(0x9E3779B97F4A7C15ull, bytes.data(), bytes.size());
  try {
    const agreed_value v[] = {
        {"checkpoint (a 52-bit hash of its bytes; each rank's own save() differs when the loop passed "
         "per-rank "
         "losses or with LocalSGD: pass old rank 0's bytes to every rank, or every old rank's through "
         "restore(archive_source, rule))",
         static_cast<double>(hash >> 12)},
        {"checkpoint size in bytes", static_cast<double>(bytes.size())},
        {"rescale rule", static_cast<double>(rule)}};
    agree("train::data_parallel_step::restore", std::span<const agreed_value>(v), bad);
  } catch (...) {
    if (bad.empty()) undo();
    throw;
  }
}

GRADAPT_TRAIN_STEP_TEMPLATE
void GRADAPT_TRAIN_STEP::restore_sharded(const archive_source& archive, rescale_rule rule) {
  constexpr const char* fn = "train::data_parallel_step::restore";
  const std::vector<std::byte> backup = save();
  const auto undo = [&] {
    std::string_view ignored;
    load_impl(backup, nullptr, &ignored);
  };
  const int me = comm_->rank();
  std::span<const std::byte> first;
  std::string_view first_shard;  // read again below, where the sharded load asks for old rank 0
  std::string bad;
  std::uint64_t old_ranks = 0;
  try {
    first = archive(0);
    load_impl(first, &rule, &first_shard, &old_ranks);
  } catch (const std::exception& e) {  // also what the archive source throws
    bad = detail::message(fn, " on rank ", me,
                          ": old rank 0's checkpoint: ", gradapt::detail::without_prefix(e.what()));
    undo();
    first = {};
  }
  agree_on_restore(first, rule, bad, undo);
  try {
    // Old rank r's shard is read in place from its checkpoint (a view into the bytes the
    // source returned, used by the sharded load before it asks for the next old rank).
    state_ = sharded_->load(*comm_, backend_, *params_, [&](int r) -> std::span<const std::byte> {
      detail::require(r >= 0 && static_cast<std::uint64_t>(r) < old_ranks, fn, " on rank ", me, ": old rank ",
                      r, " is outside the checkpoint's world of ", old_ranks, " ranks");
      const std::string_view v = shard_in(archive(r), r, old_ranks);
      return {reinterpret_cast<const std::byte*>(v.data()), v.size()};
    });
  } catch (...) {  // thrown on every rank by the sharded optimizer's agreement
    undo();
    throw;
  }
  last_.state_bytes = state_bytes();
}

GRADAPT_TRAIN_STEP_TEMPLATE
std::string_view GRADAPT_TRAIN_STEP::shard_in(std::span<const std::byte> bytes, int r,
                                              std::uint64_t old_ranks) const {
  constexpr const char* fn = "train::data_parallel_step::restore";
  std::uint64_t n = 0, calls = 0;
  std::string_view shard;
  try {
    archive_reader rd{bytes, archive_kind, archive_version};
    n = rd.get<std::uint64_t>("ranks");
    calls = rd.get<std::uint64_t>("calls");
    rd.begin("optimizer");
    shard = rd.get<std::string_view>("shard");
  } catch (const error& e) {
    detail::fail(fn, ": old rank ", r, "'s checkpoint: ", gradapt::detail::without_prefix(e.what()));
  }
  detail::require(n == old_ranks, fn, ": old rank ", r, "'s checkpoint was saved on ", n,
                  " ranks but old rank 0's on ", old_ranks, " (checkpoints of different runs)");
  detail::require(calls == calls_, fn, ": old rank ", r, "'s checkpoint is of step ", calls,
                  " but old rank 0's of step ", calls_, " (checkpoints of different steps)");
  return shard;
}

GRADAPT_TRAIN_STEP_TEMPLATE
step_settings GRADAPT_TRAIN_STEP::rescaled(step_settings s, rescale_rule rule, std::uint64_t n,
                                           std::uint64_t m) {
  constexpr const char* fn = "train::data_parallel_step::restore";
  if (n != m && !s.rank_batches.empty()) {
    // Per-rank sizes do not carry to another world: their mean becomes every rank's local
    // batch (the same global batch on n ranks), then the rule applies.
    double sum = 0.0;
    for (const double b : s.rank_batches) sum += b;
    s.local_batch = sum / static_cast<double>(n);
    s.rank_batches.clear();
  }
  switch (rule) {
    case rescale_rule::keep_global_batch: {
      const auto micro = static_cast<std::uint64_t>(s.accumulation_steps) * n;
      detail::require(micro % m == 0, fn, ": keep_global_batch: ", s.accumulation_steps,
                      " accumulation steps on ", n, " ranks are ", micro, " micro-batches per step, which ",
                      m,
                      " ranks cannot split evenly (choose linear_lr, sqrt_lr or adascale, or a world size "
                      "dividing ",
                      micro, ")");
      detail::require(micro / m <= static_cast<std::uint64_t>(std::numeric_limits<int>::max()), fn,
                      ": keep_global_batch: ", micro / m, " accumulation steps");
      s.accumulation_steps = static_cast<int>(micro / m);
      return s;
    }
    case rescale_rule::linear_lr:
      s.lr = s.lr * double(m) / double(n);
      return s;
    case rescale_rule::sqrt_lr:
      s.lr = s.lr * std::sqrt(double(m) / double(n));
      return s;
    case rescale_rule::adascale:
      detail::require(has_adascale, fn,
                      ": rescale_rule::adascale needs the adapt slot's adascale_policy (its gain follows "
                      "the new global batch); choose another rule");
      return s;
  }
  detail::fail(fn, ": rescale rule ", int(rule), " (expected a rescale_rule)");
}

GRADAPT_TRAIN_STEP_TEMPLATE
template <class State>
void GRADAPT_TRAIN_STEP::load_section(archive_reader& r, const char* section, State& st) {
  detail::require(!r.names(section).empty(), "train::data_parallel_step::load: the checkpoint has no ",
                  section, " state (written by a step with other policies?)");
  r.begin(section);
  st.load(r);
  r.end();
}

}  // namespace gradapt::train

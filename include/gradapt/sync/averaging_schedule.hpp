#pragma once
/// @file
/// The contract between local_sgd and the policies that decide when (and in which group) the
/// model is averaged: fixed_period, adaptive_period and hierarchical_period satisfy it, and a
/// framework may write its own.

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "gradapt/core/archive.hpp"

namespace gradapt {

/// What a schedule learns at an averaging round: the rank means (over the whole world) of the
/// training loss and the learning rate that the ranks passed to local_sgd::step. Only
/// schedules with `uses_loss` receive meaningful values; the others get zeros.
struct round_observation {
  double loss = 0.0;  ///< rank-mean training loss at this round (may be inf/NaN)
  double lr = 0.0;    ///< rank-mean learning rate at this round (> 0 and finite)
};

/// A local SGD averaging schedule.
///
/// Local steps are counted c = 1, 2, ... from the first step after the synchronous phase.
/// After each local step, `due(c)` names the level whose group averages now (or −1). Level
/// `l` averages in consecutive groups of `group_size(l, world)` ranks (the last level of every
/// schedule is the whole world). At a round, local_sgd computes `advance(c, level, obs)`, a
/// new state with no side effect, averages the model, and only then installs the state with
/// `commit`: a round that throws leaves the schedule unchanged. `state`/`restore` copy the
/// complete state as plain data, and `save`/`load` carry it in a state archive
/// (core/archive.hpp); `restore` and `load` check it against the local-step count it belongs
/// to, and `load` is all or nothing.
template <class S>
concept averaging_schedule = requires(S& s, const S& cs, std::uint64_t c, std::size_t level, int world,
                                      const round_observation& obs, const typename S::state_type& st) {
  typename S::state_type;
  { S::uses_loss } -> std::convertible_to<bool>;
  { cs.levels() } -> std::convertible_to<std::size_t>;
  { cs.group_size(level, world) } -> std::convertible_to<int>;
  { cs.due(c) } -> std::convertible_to<int>;
  { cs.advance(c, level, obs) } -> std::same_as<typename S::state_type>;
  s.commit(st);
  { cs.state() } -> std::convertible_to<typename S::state_type>;
  s.restore(st, c);
}
&&requires(S& s, const S& cs, archive_writer& w, archive_reader& r, std::uint64_t c) {
  cs.save(w);
  s.load(r, c);
};

}  // namespace gradapt

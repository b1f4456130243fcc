#pragma once
/// @file
/// whole_world_schedule: the part of an averaging_schedule shared by the one-level schedules
/// (fixed_period, adaptive_period): one level that averages the whole world, the options, a
/// state struct with the local step `next_due` of the next round, and its archive section.

#include <cstddef>
#include <cstdint>

#include "gradapt/core/archive.hpp"
#include "gradapt/core/configured.hpp"

namespace gradapt {

/// CRTP base of a one-level averaging schedule built from `Options` whose complete state is
/// the plain struct `State` (with a `next_due` member and `State::archive_fields()`).
/// `Derived` inherits the constructors of `configured` (`using whole_world_schedule::
/// whole_world_schedule;`), provides what `configured` needs (`name`, `validated`, `start`),
/// `advance` and a validating `restore(const State&, std::uint64_t local_steps)`.
template <class Derived, class Options, class State>
class whole_world_schedule : public configured<Derived, Options, State> {
  using base = configured<Derived, Options, State>;

 public:
  /// `T(options)` (throws gradapt::error naming an option out of range) and `T({})` (the
  /// default options).
  using base::base;

  /// The options this schedule was built with.
  const Options& options() const { return opt_; }

  /// One level: the whole world.
  std::size_t levels() const { return 1; }
  /// The averaging group is the whole world.
  int group_size(std::size_t, int world) const { return world; }
  /// Level 0 when a round is due after local step c (c >= 1), -1 otherwise.
  int due(std::uint64_t c) const { return c == st_.next_due ? 0 : -1; }

  /// Installs a state returned by advance().
  void commit(const State& s) { st_ = s; }
  /// The complete state (plain data).
  const State& state() const { return st_; }
  /// Writes the state's fields into the open section of `w`.
  void save(archive_writer& w) const { put_fields(w, st_, State::archive_fields()); }
  /// Reads what `save` wrote and restores it for a run at `local_steps` (all or nothing).
  void load(archive_reader& r, std::uint64_t local_steps) {
    const State s = get_fields(r, State::archive_fields());
    r.finish_section();
    static_cast<Derived&>(*this).restore(s, local_steps);
  }

 protected:
  using base::opt_;
  using base::st_;
};

}  // namespace gradapt

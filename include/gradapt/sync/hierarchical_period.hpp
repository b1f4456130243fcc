#pragma once
/// @file
/// Hierarchical averaging periods for local SGD: small groups of ranks (a node, a rack)
/// average often, larger groups rarely, the whole world least often. The idea and the
/// {period: group size} description follow PyTorch's HierarchicalModelAverager
/// (torch.distributed.algorithms.model_averaging.hierarchical_model_averager), which points to
/// post-local SGD (Lin, Stich, Patel and Jaggi 2018, "Don't Use Large Mini-Batches, Use Local
/// SGD") and to hierarchical SGD (arXiv:2010.12998).
///
/// Semantics here (and where they differ from PyTorch):
///  - Levels are {period p_l, group size g_l} with p_0 < p_1 < ... strictly increasing. After
///    local step c (counted 1, 2, ... from the end of the synchronous phase), the level that
///    averages is the one with the LARGEST period dividing c; no level averages when none
///    divides c. Only that level runs: its groups contain the smaller levels' groups, so the
///    smaller averages would be redundant (PyTorch: the same rule).
///  - Groups are consecutive ranks: level l puts rank r in group ⌊r / g_l⌋ (made with
///    comm.split(⌊r / g_l⌋, r)). PyTorch (dist.new_subgroups) requires g_l to divide the world
///    size; gradapt also accepts a world size that g_l does not divide, and then the last group
///    of the level is smaller (5 ranks, g = 2: {0, 1}, {2, 3}, {4}). Each group averages over its
///    own member count.
///  - Groups must nest: g_{l+1} must be a multiple of g_l unless level l + 1 is the whole world.
///    The last level must be the whole world (PyTorch: the last group size must equal the
///    world size); `hierarchical_level::world` (−1) names it without knowing the rank count.
///  - PyTorch tests divisibility of its 0-based global step counter, which includes the
///    warm-up steps: with warmup_steps = 100 and period 4 it averages right after the first
///    local step (step 100). gradapt tests the count of local steps, so every level's first
///    round comes exactly one period after local SGD begins.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/sync/averaging_schedule.hpp"

namespace gradapt {

/// One level of a hierarchy: average in groups of `group_size` consecutive ranks every
/// `period` local steps (unless a larger level averages at that step).
struct hierarchical_level {
  /// Group size meaning "every rank of the communicator".
  static constexpr int world = -1;
  std::int64_t period = 1;  ///< local steps between rounds of this level (>= 1)
  int group_size = world;   ///< ranks per group (>= 1), or `world`
};

/// Hyperparameters of hierarchical_period, e.g.
/// `{.levels = {{.period = 2, .group_size = 4}, {.period = 8, .group_size = hierarchical_level::world}}}`.
///
/// | name   | type                            | default | meaning                                  |
/// |--------|---------------------------------|---------|------------------------------------------|
/// | levels | std::vector<hierarchical_level> | {}      | {period, group size}, periods increasing, |
/// |        |                                 |         | last level the whole world; 1 to 8 levels |
struct hierarchical_period_options {
  std::vector<hierarchical_level> levels;  ///< from the smallest period to the largest
};

/// hierarchical_period has no state beyond its options: the level of step c depends on c alone.
struct hierarchical_period_state {};

/// Largest number of levels a hierarchy may have (local_sgd keeps per-level counters in a
/// fixed array).
inline constexpr std::size_t max_average_levels = 8;

/// Hierarchical periods: at local step c the level with the largest period dividing c averages
/// in its groups (see the file comment for the exact semantics and the differences from
/// PyTorch's HierarchicalModelAverager).
class hierarchical_period {
 public:
  using options_type = hierarchical_period_options;  ///< the hyperparameters (hierarchical_period_options)
  using state_type = hierarchical_period_state;      ///< what state() returns and restore() takes (empty)
  /// This schedule does not read the training loss.
  static constexpr bool uses_loss = false;

  /// Checks what can be checked without the rank count (local_sgd checks group sizes, nesting
  /// and the last level against its communicator).
  /// @throws gradapt::error for no levels, more than max_average_levels, a period < 1,
  ///         periods not strictly increasing, or a group size that is neither >= 1 nor `world`.
  explicit hierarchical_period(hierarchical_period_options options) : opt_(std::move(options)) {
    const auto& lv = opt_.levels;
    detail::require(!lv.empty(), "hierarchical_period: no levels (expected at least one {period, group_size}",
                    ", the last one averaging the whole world)");
    detail::require(lv.size() <= max_average_levels, "hierarchical_period: ", lv.size(),
                    " levels (expected at most ", max_average_levels, ")");
    for (std::size_t l = 0; l < lv.size(); ++l) {
      detail::require(lv[l].period >= 1, "hierarchical_period: level ", l, " has period ", lv[l].period,
                      " (expected >= 1 local steps)");
      detail::require(l == 0 || lv[l].period > lv[l - 1].period, "hierarchical_period: level ", l,
                      " has period ", lv[l].period, " but level ", l - 1, " has ", (l ? lv[l - 1].period : 0),
                      " (expected strictly increasing periods, smallest first)");
      detail::require(lv[l].group_size >= 1 || lv[l].group_size == hierarchical_level::world,
                      "hierarchical_period: level ", l, " has group size ", lv[l].group_size,
                      " (expected >= 1 ranks, or hierarchical_level::world = -1)");
    }
  }

  /// The options this schedule was built with.
  const hierarchical_period_options& options() const { return opt_; }
  /// The options every rank must share, named for local_sgd's round agreement.
  template <std::size_t N>
  void agreed_options(agreed_list<N>& out) const {
    out.push("hierarchical_period levels", static_cast<double>(opt_.levels.size()));
    for (const auto& l : opt_.levels) {
      out.push("hierarchical_period level period", static_cast<double>(l.period));
      out.push("hierarchical_period level group_size", static_cast<double>(l.group_size));
    }
  }

  /// Number of levels.
  std::size_t levels() const { return opt_.levels.size(); }
  /// Period of level l.
  std::int64_t period(std::size_t level) const { return opt_.levels.at(level).period; }
  /// Ranks per group at level l in a world of `world` ranks (`world` for the `world` marker;
  /// group sizes above the rank count are returned as given and rejected by local_sgd).
  int group_size(std::size_t level, int world) const {
    const int g = opt_.levels.at(level).group_size;
    return g == hierarchical_level::world ? world : g;
  }
  /// The level with the largest period dividing c (c >= 1), or -1 when none does.
  int due(std::uint64_t c) const {
    for (std::size_t l = opt_.levels.size(); l-- > 0;)
      if (c % static_cast<std::uint64_t>(opt_.levels[l].period) == 0) return static_cast<int>(l);
    return -1;
  }

  /// Stateless: the state after any round is the empty state.
  hierarchical_period_state advance(std::uint64_t, std::size_t, const round_observation&) const { return {}; }
  /// Nothing to install.
  void commit(const hierarchical_period_state&) {}
  /// The (empty) state.
  hierarchical_period_state state() const { return {}; }
  /// Nothing to restore.
  void restore(const hierarchical_period_state&, std::uint64_t) {}
  /// Writes nothing: the schedule keeps no state.
  void save(archive_writer&) const {}
  /// Reads nothing; rejects a section that holds fields (another schedule's state).
  void load(archive_reader& r, std::uint64_t) { r.finish_section(); }

 private:
  hierarchical_period_options opt_;
};

}  // namespace gradapt

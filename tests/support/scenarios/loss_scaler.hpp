#pragma once
// loss_scaler::unscale across ranks, written once over the communicator: the threads tests
// (tests/test_loss_scaler.cpp) run each scenario inside run_threads, the MPI tests
// (tests/mpi/test_mpi_loss_scaler.cpp) on MPI_COMM_WORLD. Assertions go through rank_check.hpp,
// which is safe on rank threads and in one-thread MPI processes alike; nothing here uses
// Catch2's INFO or CAPTURE, whose message stack is shared by all threads.
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "rank_check.hpp"

namespace loss_scaler_scenario {

/// Bitwise equality of two scaler states.
inline bool same_state(const gradapt::loss_scaler_state& a, const gradapt::loss_scaler_state& b) {
  return std::bit_cast<std::uint64_t>(a.scale) == std::bit_cast<std::uint64_t>(b.scale) &&
         a.growth_tracker == b.growth_tracker && a.hysteresis_left == b.hysteresis_left &&
         a.steps == b.steps && a.skipped == b.skipped && a.backoffs == b.backoffs && a.growths == b.growths;
}

/// Every rank takes the same decision and keeps the same scale as one serial scaler fed the OR
/// of all ranks' overflows, for three gradient forms: half gradients, bfloat16 gradients into
/// float master buffers, and bfloat16 gradients alone. `overflow_at(rank, size, step)` says
/// where a rank's gradients hold an inf or NaN. Gradients are multiples of 1/8 times the scale,
/// so unscaling is exact; at least one step must be skipped.
template <class Comm, class Overflow>
void ranks_agree_on_overflows(Comm& comm, const gradapt::loss_scaler_options& o, int steps,
                              Overflow&& overflow_at) {
  const int n = comm.size(), r = comm.rank();
  const auto any_overflow = [&](int step) {
    for (int q = 0; q < n; ++q)
      if (overflow_at(q, n, step)) return true;
    return false;
  };
  gradapt::loss_scaler serial(o), s(o), m(o), p(o);
  const gradapt::host backend{.threads = 1};
  std::vector<gradapt::half> a(29), b(3);
  std::vector<gradapt::bfloat16> c(17), d(33), e(7);
  std::vector<float> master(17);
  const std::vector<gradapt::tensor_view<gradapt::half>> grads{gradapt::host_view(a), gradapt::host_view(b)};
  const std::vector<gradapt::tensor_view<gradapt::bfloat16>> grads16{gradapt::host_view(c)};
  const std::vector<gradapt::tensor_view<float>> masters{gradapt::host_view(master)};
  const std::vector<gradapt::tensor_view<gradapt::bfloat16>> plain16{gradapt::host_view(d),
                                                                     gradapt::host_view(e)};
  for (int k = 0; k < steps; ++k) {
    const bool expect = serial.update(any_overflow(k));
    const float sc = static_cast<float>(s.scale());
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = gradapt::half(sc * static_cast<float>(i % 9) / 8.0f);
    for (auto& v : b) v = gradapt::half(-sc);
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = gradapt::bfloat16(sc * static_cast<float>(i) / 4.0f);
    for (auto& v : d) v = gradapt::bfloat16(static_cast<float>(p.scale()));
    for (auto& v : e) v = gradapt::bfloat16(-static_cast<float>(p.scale()));
    if (overflow_at(r, n, k)) {
      b[static_cast<std::size_t>(k) % b.size()] = gradapt::half(k % 2 ? INFINITY : NAN);
      c[static_cast<std::size_t>(k) % c.size()] = gradapt::bfloat16(-INFINITY);
      e[static_cast<std::size_t>(k) % e.size()] = gradapt::bfloat16(NAN);
    }
    const bool step = s.unscale(backend, comm, grads);  // collectives: outside the assertion lock
    const bool step_m = m.unscale(backend, comm, grads16, masters);
    const bool step_p = p.unscale(backend, comm, plain16);
    // No INFO here: Catch2's message stack is not thread-safe, and this runs on rank threads.
    RANK_REQUIRE(step == expect);
    RANK_REQUIRE(step_m == expect);
    RANK_REQUIRE(step_p == expect);
    RANK_REQUIRE(s.scale() == serial.scale());
    RANK_REQUIRE(m.scale() == serial.scale());
    RANK_REQUIRE(p.scale() == serial.scale());
    if (step) {
      for (std::size_t i = 0; i < a.size(); ++i)
        RANK_REQUIRE(static_cast<float>(a[i]) == static_cast<float>(i % 9) / 8.0f);
      for (std::size_t i = 0; i < c.size(); ++i) RANK_REQUIRE(master[i] == static_cast<float>(i) / 4.0f);
      RANK_REQUIRE(static_cast<float>(d[0]) == 1.0f);
    }
  }
  RANK_REQUIRE(s.skipped() == serial.skipped());
  RANK_REQUIRE(s.skipped() > 0);
}

/// A master buffer one element short on rank `culprit`: that rank names the sizes, every other
/// rank names the count of ranks with invalid input; the state is unchanged everywhere and the
/// next valid call steps.
template <class Comm>
void invalid_master_on_one_rank(Comm& comm, int culprit) {
  const gradapt::host backend{.threads = 1};
  gradapt::loss_scaler s;
  std::vector<gradapt::half> g(10);
  std::vector<float> m(comm.rank() == culprit ? 9 : 10);
  const std::vector<gradapt::tensor_view<gradapt::half>> grads{gradapt::host_view(g)};
  const std::vector<gradapt::tensor_view<float>> master{gradapt::host_view(m)};
  const auto before = s.state();
  if (comm.rank() == culprit)
    RANK_REQUIRE_THROWS_WITH(s.unscale(backend, comm, grads, master),
                             Catch::Matchers::Contains("has 10 elements but master tensor 0 has 9"));
  else
    RANK_REQUIRE_THROWS_WITH(s.unscale(backend, comm, grads, master),
                             Catch::Matchers::Contains("1 other rank(s) passed invalid input"));
  RANK_REQUIRE(same_state(s.state(), before));
  RANK_REQUIRE(s.steps() == 0);
  // The world is still usable afterwards.
  m.resize(10);
  const std::vector<gradapt::tensor_view<float>> master_ok{gradapt::host_view(m)};
  const bool step = s.unscale(backend, comm, grads, master_ok);  // collective: outside the lock
  RANK_REQUIRE(step);
}

}  // namespace loss_scaler_scenario

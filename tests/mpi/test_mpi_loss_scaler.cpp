// loss_scaler and sharded clip_by_global_norm over comm::mpi (1 to 5 ranks). The overflow
// flag travels in one MPI_Allreduce: every rank must take the same decision and keep the same
// scale as a serial scaler fed the OR of all ranks' overflows. Gradient values are multiples
// of 1/8 scaled by powers of two, so unscaling is exact and sums of squares are exact in any
// order (the sharded norm equals the serial one bit for bit).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/precision/loss_scaler.hpp"

namespace {

bool overflow_at(int rank, int size, int step) {
  // The last rank overflows on a pattern; rank 0 additionally on step 9 (two ranks at once).
  return (rank == size - 1 && (step % 4 == 1 || step == 6 || step == 7)) || (rank == 0 && step == 9);
}

bool any_overflow(int size, int step) {
  for (int r = 0; r < size; ++r)
    if (overflow_at(r, size, step)) return true;
  return false;
}

}  // namespace

TEST_CASE("mpi: loss_scaler ranks agree on overflows of any rank", "[mpi][loss_scaler]") {
  gradapt::comm::mpi comm;
  const int n = comm.size(), r = comm.rank();
  const gradapt::loss_scaler_options o{.init_scale = 512, .growth_interval = 3, .hysteresis = 2};
  gradapt::loss_scaler serial(o), s(o), m(o);
  const gradapt::host backend{.threads = 1};
  std::vector<gradapt::half> a(29), b(3);
  std::vector<gradapt::bfloat16> c(17);
  std::vector<float> master(17);
  const std::vector<gradapt::tensor_view<gradapt::half>> grads{gradapt::host_view(a), gradapt::host_view(b)};
  const std::vector<gradapt::tensor_view<gradapt::bfloat16>> grads16{gradapt::host_view(c)};
  const std::vector<gradapt::tensor_view<float>> masters{gradapt::host_view(master)};
  for (int k = 0; k < 24; ++k) {
    const bool expect = serial.update(any_overflow(n, k));
    const float sc = static_cast<float>(s.scale());
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = gradapt::half(sc * static_cast<float>(i % 9) / 8.0f);
    for (auto& v : b) v = gradapt::half(-sc);
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = gradapt::bfloat16(sc * static_cast<float>(i) / 4.0f);
    if (overflow_at(r, n, k)) {
      b[static_cast<std::size_t>(k) % b.size()] = gradapt::half(k % 2 ? INFINITY : NAN);
      c[static_cast<std::size_t>(k) % c.size()] = gradapt::bfloat16(-INFINITY);
    }
    INFO("rank " << r << " of " << n << ", step " << k);
    const bool step = s.unscale(backend, comm, grads);
    const bool step_m = m.unscale(backend, comm, grads16, masters);
    REQUIRE(step == expect);
    REQUIRE(step_m == expect);
    REQUIRE(s.scale() == serial.scale());
    REQUIRE(m.scale() == serial.scale());
    if (step) {
      for (std::size_t i = 0; i < a.size(); ++i)
        REQUIRE(static_cast<float>(a[i]) == static_cast<float>(i % 9) / 8.0f);
      for (std::size_t i = 0; i < c.size(); ++i) REQUIRE(master[i] == static_cast<float>(i) / 4.0f);
    }
  }
  REQUIRE(s.skipped() == serial.skipped());
  REQUIRE(s.skipped() > 0);
}

TEST_CASE("mpi: loss_scaler invalid input on rank 0 makes every rank throw", "[mpi][loss_scaler]") {
  gradapt::comm::mpi comm;
  const gradapt::host backend{.threads = 1};
  gradapt::loss_scaler s;
  std::vector<gradapt::half> g(6);
  std::vector<float> master(comm.rank() == 0 ? 5 : 6);
  const std::vector<gradapt::tensor_view<gradapt::half>> grads{gradapt::host_view(g)};
  const std::vector<gradapt::tensor_view<float>> masters{gradapt::host_view(master)};
  if (comm.rank() == 0)
    REQUIRE_THROWS_WITH(s.unscale(backend, comm, grads, masters),
                        Catch::Matchers::Contains("master tensor 0 has 5"));
  else
    REQUIRE_THROWS_WITH(s.unscale(backend, comm, grads, masters),
                        Catch::Matchers::Contains("1 other rank(s) passed invalid input"));
  REQUIRE(s.steps() == 0);
}

TEST_CASE("mpi: sharded clip_by_global_norm equals the serial clip bit for bit", "[mpi][clip]") {
  gradapt::comm::mpi comm;
  const int n = comm.size();
  const std::size_t tensors = 2 * static_cast<std::size_t>(n) + 1;
  const auto value = [](std::size_t t, std::size_t i) {
    return static_cast<float>(static_cast<int>((t * 13 + i * 5) % 33) - 16) / 8.0f;
  };
  std::vector<std::vector<float>> all(tensors);
  for (std::size_t t = 0; t < tensors; ++t)
    for (std::size_t i = 0; i < 5 + 11 * t; ++i) all[t].push_back(value(t, i));
  // Serial reference on every rank: the whole list.
  auto whole = all;
  std::vector<gradapt::tensor_view<float>> whole_views;
  for (auto& v : whole) whole_views.push_back(gradapt::host_view(v));
  const gradapt::host backend{.threads = 1};
  const double serial = gradapt::clip_by_global_norm(backend, whole_views, 2.0);
  // This rank's shard: tensors rank, rank + n, ...
  std::vector<std::vector<float>> mine;
  std::vector<std::size_t> ids;
  for (std::size_t t = static_cast<std::size_t>(comm.rank()); t < tensors; t += static_cast<std::size_t>(n)) {
    mine.push_back(all[t]);
    ids.push_back(t);
  }
  std::vector<gradapt::tensor_view<float>> views;
  for (auto& v : mine) views.push_back(gradapt::host_view(v));
  const double norm = gradapt::clip_by_global_norm(backend, comm, views, 2.0);
  REQUIRE(std::memcmp(&norm, &serial, sizeof norm) == 0);
  REQUIRE(norm > 2.0);
  for (std::size_t k = 0; k < ids.size(); ++k)
    REQUIRE(std::memcmp(mine[k].data(), whole[ids[k]].data(), mine[k].size() * sizeof(float)) == 0);
}

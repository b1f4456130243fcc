// loss_scaler and sharded clip_by_global_norm over comm::mpi (1 to 5 ranks). The overflow
// flag travels in one MPI_Allreduce: every rank must take the same decision and keep the same
// scale as a serial scaler fed the OR of all ranks' overflows. Gradient values are multiples
// of 1/8 scaled by powers of two, so unscaling is exact and sums of squares are exact in any
// order (the sharded norm equals the serial one bit for bit). The loss_scaler scenarios are
// shared with the threads tests (tests/support/scenarios/loss_scaler.hpp).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/mpi.hpp"
#include "gradapt/optim/clip.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "scenarios/loss_scaler.hpp"

namespace gradapt_test_mpi_loss_scaler {

TEST_CASE("mpi: loss_scaler ranks agree on overflows of any rank", "[mpi][loss_scaler]") {
  gradapt::comm::mpi comm;
  // The last rank overflows on a pattern; rank 0 additionally on step 9 (two ranks at once).
  loss_scaler_scenario::ranks_agree_on_overflows(
      comm, {.init_scale = 512, .growth_interval = 3, .hysteresis = 2}, 24, [](int rank, int size, int step) {
        return (rank == size - 1 && (step % 4 == 1 || step == 6 || step == 7)) || (rank == 0 && step == 9);
      });
}

TEST_CASE("mpi: loss_scaler invalid input on rank 0 makes every rank throw", "[mpi][loss_scaler]") {
  gradapt::comm::mpi comm;
  loss_scaler_scenario::invalid_master_on_one_rank(comm, 0);
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

}  // namespace gradapt_test_mpi_loss_scaler

// The composed step (train::data_parallel_step) on the CUDA backend with a one-rank NCCL
// communicator, against the same step on the host (gradapt::host, comm::single): the loss
// scaler (its flags in device memory; an overflow at step 3), replicated state with LocalSGD,
// zero_state<2> and bucket_reduce with gradients marked during the "backward pass", Adasum
// (its workspace over backend buffers) and hierarchical_reduce (comm::hierarchy over
// ncclCommSplit), each saved after step 4 and loaded into a fresh step. The slot logic
// these paths share with the host runs on 1 to 3 ranks through the device-tagged host backend in
// tests/test_train_device_path.cpp.
//
// Compiled wherever nvcc and NCCL are found; skipped (exit 77) without a GPU.

#include <nccl.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "gradapt/comm/nccl.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "nccl_one_rank.cuh"

namespace gradapt_test_cuda_train_step {

using namespace gradapt_test;
namespace train = gradapt::train;

namespace {

using one_rank = nccl_one_rank;

const std::vector<std::size_t> sizes{4096 + 5, 7, 33 * 65, 1};

/// Parameters and this step's gradients, multiples of 2^-10, on the host.
std::vector<std::vector<float>> initial(std::size_t salt) {
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v(sizes[t]);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(static_cast<int>((i * 37 + t * 11 + salt * 101) % 1024) - 512) / 1024.0f;
    out.push_back(v);
  }
  return out;
}

struct host_model {
  std::vector<std::vector<float>> p = initial(0), g = initial(1);
  gradapt::param_list<float, float> params;
  host_model() {
    for (std::size_t t = 0; t < sizes.size(); ++t)
      params.add("w" + std::to_string(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]));
  }
};

struct device_model {
  std::vector<dvec<float>> p, g;
  gradapt::param_list<float, float, device_space> params;
  device_model() {
    for (const auto& v : initial(0)) p.push_back(to_device(v));
    for (const auto& v : initial(1)) g.push_back(to_device(v));
    for (std::size_t t = 0; t < sizes.size(); ++t)
      params.add("w" + std::to_string(t), view(p[t]), view(g[t]));
  }
};

/// Step k's gradient of tensor t times the loss scale (inf at step 3, tensor 1).
std::vector<float> grad_at(std::size_t t, int k, double scale) {
  auto g = initial(static_cast<std::size_t>(k) + 1)[t];
  for (auto& x : g) x = static_cast<float>(x * scale);
  if (k == 3 && t == 1) g[0] = std::numeric_limits<float>::infinity();
  return g;
}

template <class Step>
train::step_metrics host_step(Step& s, host_model& m, int k) {
  for (std::size_t t = 0; t < sizes.size(); ++t) m.g[t] = grad_at(t, k, s.loss_scale());
  if constexpr (Step::marks_gradients)
    for (std::size_t t = sizes.size(); t-- > 0;) s.mark_ready(t);
  return s.step();
}

/// With `backward` (not null), the gradients are copied in asynchronously on that stream, the
/// communicator's producer: the step must order its reads after them by events.
template <class Step>
train::step_metrics device_step(Step& s, device_model& m, int k, cudaStream_t backward = nullptr) {
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto g = grad_at(t, k, s.loss_scale());
    if (backward != nullptr)
      GRADAPT_CUDA_CHECK(cudaMemcpyAsync(thrust::raw_pointer_cast(m.g[t].data()), g.data(),
                                         g.size() * sizeof(float), cudaMemcpyHostToDevice, backward));
    else
      m.g[t] = to_device(g);
  }
  if constexpr (Step::marks_gradients)
    for (std::size_t t = sizes.size(); t-- > 0;) s.mark_ready(t);
  return s.step();
}

/// 8 steps on the host and on the device, each through a save after step 4 and a load; with
/// `producer`, the device's gradients are written on a second stream, the communicator's
/// nccl_options::producer.
template <class Make>
void matches_host(Make&& make, bool producer = false) {
  one_rank r;
  cudaStream_t backward = nullptr;
  if (producer) GRADAPT_CUDA_CHECK(cudaStreamCreate(&backward));
  gradapt::comm::nccl dc(
      r.handle, r.stream,
      producer ? gradapt::comm::nccl_options{.producer = backward} : gradapt::comm::nccl_options{});
  const gradapt::cuda db{.stream = r.stream};
  gradapt::comm::single hc;
  const gradapt::host hb{.threads = 1};
  host_model h;
  device_model d;
  std::vector<train::step_metrics> want, got;
  {
    auto hs = make(hc, hb, h.params, 0.05);
    auto ds = make(dc, db, d.params, 0.05);
    for (int k = 1; k <= 4; ++k) {
      want.push_back(host_step(hs, h, k));
      got.push_back(device_step(ds, d, k, backward));
    }
    auto hs2 = make(hc, hb, h.params, 0.5);
    auto ds2 = make(dc, db, d.params, 0.5);
    hs2.load(hs.save());
    ds2.load(ds.save());
    for (int k = 5; k <= 8; ++k) {
      want.push_back(host_step(hs2, h, k));
      got.push_back(device_step(ds2, d, k, backward));
    }
  }
  db.synchronize();
  if (backward != nullptr) {
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(backward));
    GRADAPT_CUDA_CHECK(cudaStreamDestroy(backward));
  }
  for (std::size_t k = 0; k < want.size(); ++k) {
    INFO("step " << k + 1);
    CHECK(got[k].found_inf == want[k].found_inf);
    CHECK(got[k].loss_scale == want[k].loss_scale);
    CHECK(got[k].optimizer_steps == want[k].optimizer_steps);
    CHECK(got[k].averaged == want[k].averaged);
  }
  REQUIRE(want[2].found_inf);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const auto dp = to_host(d.p[t]);
    for (std::size_t i = 0; i < dp.size(); ++i)  // FMA contraction on the device: to rounding
      REQUIRE(std::abs(dp[i] - h.p[t][i]) <= 1e-5f * (1.0f + std::abs(h.p[t][i])));
  }
}

}  // namespace

TEST_CASE("the composed step on the CUDA backend and NCCL equals the host step: scaler, LocalSGD",
          "[cuda][train]") {
  matches_host([](auto& comm, const auto& b, const auto& params, double lr) {
    return train::make_data_parallel_step(
        comm, b, params, gradapt::adamw({.lr = 1e-2, .weight_decay = 0.01}), {.lr = lr, .local_batch = 8},
        gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}),
        train::local_sgd_policy{{.start_step = 2}, gradapt::fixed_period({.period = 2})});
  });
}

TEST_CASE("the composed step on the CUDA backend and NCCL equals the host step: zero_state<2>, scaler",
          "[cuda][train]") {
  matches_host([](auto& comm, const auto& b, const auto& params, double lr) {
    return train::make_data_parallel_step(comm, b, params, gradapt::sgd({.lr = 0.05, .momentum = 0.9}),
                                          {.lr = lr, .local_batch = 8},
                                          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}),
                                          train::zero_state<2>{.sharding = {.buckets = {.cap_bytes = 8192}}});
  });
}

TEST_CASE("the composed step on the CUDA backend and NCCL equals the host step: bucket_reduce, scaler",
          "[cuda][train]") {
  matches_host([](auto& comm, const auto& b, const auto& params, double lr) {
    return train::make_data_parallel_step(comm, b, params, gradapt::sgd({.lr = 0.05, .momentum = 0.9}),
                                          {.lr = lr, .local_batch = 8},
                                          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}),
                                          train::bucket_reduce{.buckets = {.cap_bytes = 8192}});
  });
}

TEST_CASE(
    "the composed step on the CUDA backend and NCCL equals the host step: bucket_reduce, gradients written "
    "on a producer stream",
    "[cuda][train]") {
  matches_host(
      [](auto& comm, const auto& b, const auto& params, double lr) {
        return train::make_data_parallel_step(
            comm, b, params, gradapt::sgd({.lr = 0.05, .momentum = 0.9}), {.lr = lr, .local_batch = 8},
            gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}),
            train::bucket_reduce{.buckets = {.cap_bytes = 8192}});
      },
      true);
}

TEST_CASE("the composed step on the CUDA backend and NCCL equals the host step: adasum_combine, scaler",
          "[cuda][train]") {
  matches_host([](auto& comm, const auto& b, const auto& params, double lr) {
    return train::make_data_parallel_step(
        comm, b, params, gradapt::adamw({.lr = 1e-2}), {.lr = lr, .local_batch = 8},
        gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}), train::adasum_combine{});
  });
}

TEST_CASE("the composed step on the CUDA backend and NCCL equals the host step: hierarchical_reduce, scaler",
          "[cuda][train]") {
  // One rank: the hierarchy's two splits (ncclCommSplit) and its staged host-name allgather run;
  // the reduction collapses to an allreduce over one rank.
  matches_host([](auto& comm, const auto& b, const auto& params, double lr) {
    return train::make_data_parallel_step(
        comm, b, params, gradapt::adamw({.lr = 1e-2}), {.lr = lr, .local_batch = 8},
        gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 2}), train::hierarchical_reduce{});
  });
}

}  // namespace gradapt_test_cuda_train_step

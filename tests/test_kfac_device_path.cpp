// gradapt::kfac with its state in device memory, run on the host through the device-tagged
// element backend, communicator and linear algebra of support/host_as_device.hpp and
// host_as_device_linalg.hpp: the same K-FAC on gradapt::host with host_lapack and on the device
// path must give the same bits, step by step:
//  1. alone, for the eigen, prediv and inverse methods, float and double decompositions over
//     float factors, layers with and without a bias, two micro-batches per factor update, a loss
//     scale, KL clipping, factor and inverse updates at different frequencies, through a
//     checkpoint saved from the device state and loaded into a fresh one (and into a host state);
//  2. on 2 ranks (the factor terms allreduced through the device-tagged communicator, every
//     rank decomposing every layer after the factors' agreement): the host step's bits; a rank
//     that skips a layer's accumulate is an error on every rank; grad_worker_fraction < 1 throws
//     at init naming the option;
//  3. in the precondition slot of train::data_parallel_step (kfac_policy, SGD with momentum,
//     the loss scaler) on 1 and 2 ranks against the host step, through the step's checkpoint;
//  4. with a communicator whose sums differ between a factor's two triangles, the factors stay
//     symmetric bit for bit (and their checkpoint loads);
//  5. against the long double re-run of support/kfac_ld_reference (the check test_linalg_cuda
//     runs on a GPU, support/kfac_reference_run.hpp), in double: eigen, prediv and inverse.
#include "catch.hpp"

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "gradapt/train/kfac_policy.hpp"
#include "host_as_device.hpp"
#include "host_as_device_linalg.hpp"
#include "kfac_reference_run.hpp"
#include "rank_check.hpp"
#include "scenarios/train_kfac.hpp"

namespace gradapt_test_kfac_device_path {

using Catch::Matchers::Contains;
using gradapt::device_space;
using gradapt::kfac;
using gradapt::kfac_grad;
using gradapt::kfac_layer;
using gradapt::kfac_method;
using gradapt::kfac_options;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;

namespace {

const kfac_layer layers[] = {{"fc1", 6, 5, true}, {"fc2", 5, 4, false}, {"fc3", 4, 3, true}};
constexpr std::int64_t rows = 7;

// The scenario's generator and bitwise comparison.
using train_kfac_scenario::same_bits;
using train_kfac_scenario::uniform;

// One rank's inputs of step s: per layer two micro-batches of a and g, and the gradients.
struct batch {
  std::vector<std::vector<float>> a, g, w, b;
  batch(int rank, int s) {
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      const auto& x = layers[l];
      const auto seed = static_cast<std::uint64_t>(1000 * s + 100 * rank + 10 * static_cast<int>(l));
      for (int m = 0; m < 2; ++m) {
        a.push_back(uniform(static_cast<std::size_t>(rows * x.in), seed + 1 + static_cast<unsigned>(m), 1.0));
        // g carries the loss scale 8.
        g.push_back(
            uniform(static_cast<std::size_t>(rows * x.out), seed + 3 + static_cast<unsigned>(m), 8.0));
      }
      // The averaged gradients: the same on every rank.
      const auto gseed = static_cast<std::uint64_t>(7000 * s + 10 * static_cast<int>(l));
      w.push_back(uniform(static_cast<std::size_t>(x.out * x.in), gseed + 5, 0.5));
      b.push_back(x.bias ? uniform(static_cast<std::size_t>(x.out), gseed + 6, 0.1) : std::vector<float>{});
    }
  }
  std::vector<float> flat() const {
    std::vector<float> v;
    for (std::size_t l = 0; l < w.size(); ++l) {
      v.insert(v.end(), w[l].begin(), w[l].end());
      v.insert(v.end(), b[l].begin(), b[l].end());
    }
    return v;
  }
};

template <class Sp>
tensor_view<const float, Sp> cmat(const std::vector<float>& v, std::int64_t r, std::int64_t c) {
  return tensor_view<const float, Sp>(v.data(), {r, c});
}

// One K-FAC step of state `st` (in memory Sp) on batch `in`, with or without a communicator;
// `skip` drops layer 1's accumulate (a rank that forgets one). Returns the rewritten gradients.
template <class Sp, class St, class Comm>
std::vector<float> one_step(const kfac& kf, St& st, Comm* comm, int rank, int s, bool skip = false) {
  batch in(rank, s);
  if (kf.factor_update_due(st))
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      if (skip && l == 1) continue;
      for (int m = 0; m < 2; ++m)
        kf.accumulate(st, l, cmat<Sp>(in.a[2 * l + static_cast<std::size_t>(m)], rows, layers[l].in),
                      cmat<Sp>(in.g[2 * l + static_cast<std::size_t>(m)], rows, layers[l].out), 8.0);
    }
  std::vector<kfac_grad<float, Sp>> grads;
  for (std::size_t l = 0; l < std::size(layers); ++l)
    grads.push_back({tensor_view<float, Sp>(in.w[l].data(), {layers[l].out, layers[l].in}),
                     layers[l].bias ? tensor_view<float, Sp>::vector(in.b[l].data(), layers[l].out)
                                    : tensor_view<float, Sp>()});
  if constexpr (std::is_same_v<Comm, std::nullptr_t>)
    kf.step(st, grads, 0.05);
  else
    kf.step(*comm, st, grads, 0.05);
  return in.flat();
}

kfac_options option_set(int k) {
  kfac_options o{.factor_decay = 0.9, .factor_update_steps = 2, .inv_update_steps = 3, .damping = 0.01};
  if (k == 1) o.prediv_eigenvalues = true;
  if (k == 2) o.method = kfac_method::inverse;
  if (k == 3) o.kl_clip = 0;
  return o;
}

// Host and device states step by step: the gradients' bits, the factors' bits.
template <class D>
void alone(const kfac_options& o) {
  const kfac kf(o);
  const host_as_device::backend db;
  const host_as_device::linalg dla;
  auto hs = kf.init<float, D>(gradapt::host_lapack{}, layers);
  auto ds = kf.init<float, D>(db, dla, layers);
  std::vector<std::byte> saved;
  for (int s = 1; s <= 10; ++s) {
    INFO("step " << s);
    const auto h = one_step<gradapt::host_space>(kf, hs, static_cast<std::nullptr_t*>(nullptr), 0, s);
    const auto d = one_step<device_space>(kf, ds, static_cast<std::nullptr_t*>(nullptr), 0, s);
    REQUIRE(same_bits(h, d));
    CHECK(hs.last_kl_scale() == ds.last_kl_scale());
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      const auto ha = hs.factor_a(l), da = ds.factor_a(l);
      REQUIRE(std::vector<float>(ha.begin(), ha.end()) == std::vector<float>(da.begin(), da.end()));
      const auto hg = hs.factor_g(l), dg = ds.factor_g(l);
      REQUIRE(std::vector<float>(hg.begin(), hg.end()) == std::vector<float>(dg.begin(), dg.end()));
    }
    if (s == 5) {
      // The device state's checkpoint is the host state's, byte for byte.
      saved = ds.save();
      REQUIRE(saved == hs.save());
      ds = kf.init<float, D>(db, dla, layers);
      ds.load(saved);
      auto again = kf.init<float, D>(gradapt::host_lapack{}, layers);
      again.load(saved);
      hs = std::move(again);
    }
  }
  CHECK(ds.steps() == 10);
  CHECK(ds.decompositions() == hs.decompositions());
}

}  // namespace

TEST_CASE("kfac with its state in device memory: the host state's bits, through a checkpoint",
          "[kfac][device]") {
  for (int k = 0; k < 4; ++k) {
    INFO("option set " << k);
    alone<float>(option_set(k));
    alone<double>(option_set(k));
  }
}

TEST_CASE(
    "kfac in device memory on 2 ranks: the host state's bits; a missing accumulate is an error on every rank",
    "[kfac][device][dist]") {
  for (int k = 0; k < 3; ++k) {
    INFO("option set " << k);
    const kfac kf(option_set(k));
    run_threads(2, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
      const host_as_device::backend db;
      const host_as_device::linalg dla;
      host_as_device::comm dc{&c};
      auto hs = kf.init<float>(gradapt::host_lapack{}, layers);
      auto ds = kf.init<float>(db, dla, layers);
      for (int s = 1; s <= 7; ++s) {
        const auto h = one_step<gradapt::host_space>(kf, hs, &c, c.rank(), s);
        const auto d = one_step<device_space>(kf, ds, &dc, c.rank(), s);
        RANK_REQUIRE(same_bits(h, d));
      }
      RANK_CHECK(ds.save() == hs.save());
      // Every rank decomposes every layer in device memory.
      RANK_CHECK(ds.owner(0) == c.rank());
      RANK_CHECK(ds.holds(2));
    });
  }
  // Step 9 updates the factors; rank 1 forgets layer 1: an error on both ranks, naming the layer.
  const kfac kf(option_set(0));
  run_threads(2, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
    const host_as_device::backend db;
    const host_as_device::linalg dla;
    host_as_device::comm dc{&c};
    auto ds = kf.init<float>(db, dla, layers);
    for (int s = 1; s <= 8; ++s) one_step<device_space>(kf, ds, &dc, c.rank(), s);
    RANK_REQUIRE_THROWS_WITH(one_step<device_space>(kf, ds, &dc, c.rank(), 9, c.rank() == 1),
                             Contains("layer 'fc2' got a and g on 1 of 2 ranks"));
  });
}

TEST_CASE(
    "kfac in device memory against a long double re-run: eigen, prediv and inverse, through a checkpoint",
    "[kfac][device]") {
  const host_as_device::backend db;
  const host_as_device::linalg dla;
  for (const auto& [method, prediv] :
       {std::pair{kfac_method::eigen, false}, std::pair{kfac_method::eigen, true},
        std::pair{kfac_method::inverse, false}}) {
    const double worst =
        gradapt_test::kfac_against_ld<device_space>(db, dla, host_as_device::memory{}, method, prediv);
    INFO("method " << int(method) << ", prediv " << prediv << ": largest relative difference " << worst);
    CHECK(worst <= 1e-12);
  }
}

namespace {
// The device-tagged communicator, except that a sum of floats comes back with its odd elements
// scaled by 1 + 2⁻²⁰: the two triangles of a factor's terms then differ, as when a collective
// adds them in different orders (NCCL's rings, MPI's segments).
struct skewed_comm : host_as_device::comm {
  template <class T>
  void allreduce(tensor_view<T, device_space> buf, gradapt::reduce_op op) {
    host_as_device::comm::allreduce(buf, op);
    if constexpr (std::is_same_v<T, float>)
      for (std::size_t e = 1; e < buf.size(); e += 2) buf.data()[e] *= 1.0f + 0x1p-20f;
  }
  skewed_comm split(int color, int key) { return skewed_comm{host_as_device::comm::split(color, key)}; }
};
}  // namespace

TEST_CASE("kfac in device memory: the factors stay symmetric bit for bit when the triangles are summed apart",
          "[kfac][device][dist]") {
  const kfac kf(option_set(0));
  run_threads(2, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
    const host_as_device::backend db;
    const host_as_device::linalg dla;
    skewed_comm dc{{&c}};
    auto ds = kf.init<float>(db, dla, layers);
    for (int s = 1; s <= 5; ++s) one_step<device_space>(kf, ds, &dc, c.rank(), s);
    for (std::size_t l = 0; l < std::size(layers); ++l) {
      const auto a = ds.factor_a(l);
      const auto n = static_cast<std::size_t>(layers[l].in + (layers[l].bias ? 1 : 0));
      bool symmetric = true;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < i; ++j) symmetric = symmetric && a[i * n + j] == a[j * n + i];
      RANK_CHECK(symmetric);
    }
    // So the checkpoint, whose load demands symmetric factors, loads.
    const auto saved = ds.save();
    auto again = kf.init<float>(db, dla, layers);
    std::string what;
    try {
      again.load(saved);
    } catch (const std::exception& e) {
      what = e.what();
    }
    RANK_CHECK(what.empty());
  });
}

TEST_CASE("kfac's inverse method on 1 × 1 layers: its scratch holds the eigenproblems and a scaled basis",
          "[kfac][device]") {
  // The inverse method's scratch is at its tightest for 1 × 1 factors (5 values against the
  // products' 1); under the address sanitizer an overrun fails here.
  const kfac kf({.damping = 0.1, .method = kfac_method::inverse});
  const kfac_layer tiny[] = {{"t", 1, 1, false}};
  const host_as_device::backend db;
  const host_as_device::linalg dla;
  auto hs = kf.init<float>(gradapt::host_lapack{}, tiny);
  auto ds = kf.init<float>(db, dla, tiny);
  for (int s = 1; s <= 3; ++s) {
    const std::vector<float> a{0.5f, -1.0f}, g{2.0f, 1.0f};
    std::vector<float> wh{0.25f * float(s)}, wd = wh;
    kf.accumulate(hs, 0, cmat<gradapt::host_space>(a, 2, 1), cmat<gradapt::host_space>(g, 2, 1));
    kf.accumulate(ds, 0, cmat<device_space>(a, 2, 1), cmat<device_space>(g, 2, 1));
    const kfac_grad<float> hg[] = {{tensor_view<float>(wh.data(), {1, 1})}};
    const kfac_grad<float, device_space> dg[] = {{tensor_view<float, device_space>(wd.data(), {1, 1})}};
    kf.step(hs, hg, 0.1);
    kf.step(ds, dg, 0.1);
    REQUIRE(same_bits(wh, wd));
    CHECK(wh[0] != 0.25f * float(s));
  }
}

TEST_CASE("kfac in device memory: what runs on the host only throws at init, naming the option",
          "[kfac][device]") {
  const host_as_device::backend db;
  const host_as_device::linalg dla;
  const kfac kf({.grad_worker_fraction = 0.5});
  REQUIRE_THROWS_WITH(kf.init<float>(db, dla, layers),
                      Contains("grad_worker_fraction is 0.5") && Contains("device memory"));
  CHECK_NOTHROW(kf.init<float>(gradapt::host_lapack{}, layers));
}

namespace {

// The 2-layer MLP of train_kfac_scenario (its parameters added out of layer order), the
// composed step with kfac_policy on the host and on the device path.
using train_kfac_scenario::mlp;

const auto& mlp_layers = train_kfac_scenario::layers;

// 8 composed steps (an overflow at step 4 on the last rank skips that step everywhere), saved
// after 5 and loaded into a fresh step.
template <class Sp, class Comm, class B, class PL, class Init>
std::vector<float> composed(Comm& comm, const B& b, mlp& m, const PL& params, const kfac& kf, Init init) {
  namespace train = gradapt::train;
  const auto make = [&] {
    return train::make_data_parallel_step(comm, b, params, gradapt::sgd({.lr = 0.1, .momentum = 0.9}),
                                          {.lr = 0.1},
                                          train::kfac_policy(kf, init(), train_kfac_scenario::mapping()),
                                          gradapt::loss_scaler({.init_scale = 1024, .growth_interval = 3}));
  };
  const auto run = [&](auto& step, int s) {
    m.backward(comm.rank(), s, step.loss_scale());
    if (s == 4 && comm.rank() == comm.size() - 1) m.gw1[0] = std::numeric_limits<float>::infinity();
    auto& pre = step.preconditioner();
    if (pre.factor_update_due()) {
      namespace sc = train_kfac_scenario;
      pre.accumulate(0, cmat<Sp>(m.a1, sc::rows, sc::in), cmat<Sp>(m.g1, sc::rows, sc::hid),
                     step.loss_scale());
      pre.accumulate(1, cmat<Sp>(m.a2, sc::rows, sc::hid), cmat<Sp>(m.g2, sc::rows, sc::out),
                     step.loss_scale());
    }
    step.step({.loss = 1.0 / s});
  };
  std::vector<std::byte> saved;
  {
    auto step = make();
    for (int s = 1; s <= 5; ++s) run(step, s);
    saved = step.save();
  }
  auto step = make();
  step.load(saved);
  for (int s = 6; s <= 8; ++s) run(step, s);
  return m.flat();
}

}  // namespace

TEST_CASE("kfac_policy in the composed step on device memory equals the host step, through a checkpoint",
          "[kfac][device][train]") {
  const kfac kf({.factor_update_steps = 1, .inv_update_steps = 2, .damping = 0.01, .kl_clip = 0.01});
  for (const int n : {1, 2}) {
    INFO(n << " ranks");
    run_threads(n, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
      const gradapt::host hb{.threads = 1};
      const host_as_device::backend db;
      const host_as_device::linalg dla;
      host_as_device::comm dc{&c};
      mlp h, d;
      const auto dparams = host_as_device::on_device(d.params);
      const auto hp = composed<gradapt::host_space>(
          c, hb, h, h.params, kf, [&] { return kf.init<float>(gradapt::host_lapack{}, mlp_layers); });
      const auto dp =
          composed<device_space>(dc, db, d, dparams, kf, [&] { return kf.init<float>(db, dla, mlp_layers); });
      RANK_REQUIRE(same_bits(hp, dp));
    });
  }
}

}  // namespace gradapt_test_kfac_device_path

// The Shampoo stage's spectral descent (Muon: transform::scale_by_shampoo with preconditioner
// spectral_descent), its root-inverse Shampoo (statistics, eigen roots and products) and its
// eigenvalue-corrected Shampoo (eigendecomposition or QR-refreshed bases) on device memory, run on the host
// through the device-tagged element backend, communicator and linear algebra of support/host_as_device.hpp
// and host_as_device_linalg.hpp: the same chain (stage, weight decay, momentum, learning rate) on
// gradapt::host with host_lapack and on the device path must give the same bits, step by step, through a
// checkpoint saved at step 6 and loaded into a fresh state (the graft state and first moment copied out of
// and back into backend buffers), and with the distributed step's agreement staged through the backend.
//
// The tensors cover a wide and a tall matrix (the aspect scaling), a matrix cut into several
// blocks whose runs are not contiguous (max_preconditioner_dim 8), a rank-3 tensor merged to a
// matrix and a 1-D bias the graft preconditions alone. The option sets cover no graft and no
// first moment (Muon's defaults), Adam's graft on the blocks with a bias-corrected first moment,
// and RMSProp's graft on the diagonal tensors only with momentum and Nesterov; root-inverse
// Shampoo runs three option sets (root_option_sets) the same way, and on two ranks, where the
// statistics' agreement turns differing gradients into an error on every rank; three
// eigenvalue-corrected sets (corrected_option_sets: eigh bases, and SOAP's QR refresh) run on
// one rank, the first on two. Last, the same
// stage as the composed step's optimizer (train::data_parallel_step with the loss scaler and
// LocalSGD) on 1 to 3 device-tagged ranks against the host step.
#include "catch.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "host_as_device.hpp"
#include "host_as_device_linalg.hpp"
#include "rank_check.hpp"
#include "rank_errors.hpp"
#include "sanitizer.hpp"
#include "scenarios/train_combinations.hpp"
#include "shampoo_ld_reference.hpp"
#include "shampoo_reference_run.hpp"

namespace gradapt_test_shampoo_device_path {

using Catch::Matchers::Contains;
using gradapt::device_space;
using gradapt::shampoo_options;
using gradapt::tensor_view;
using gradapt::comm::run_threads;
using gradapt::comm::threads;
namespace tr = gradapt::transform;

namespace {

/// The preset's chain (gradapt::shampoo) with linear-algebra backend L (and, unless
/// `no_root_linalg`, another L for the background roots).
template <class L>
auto family_chain(const shampoo_options& o, bool no_root_linalg = false) {
  tr::scale_by_shampoo<L> pre;
  pre.options = o;
  if (!no_root_linalg) pre.root_linalg = L{};
  return gradapt::chain<tr::scale_by_shampoo<L>, tr::add_decayed_weights, tr::trace,
                        tr::scale_by_learning_rate>(std::move(pre), gradapt::detail::optim::decay_stage(o),
                                                    gradapt::detail::optim::momentum_stage(o),
                                                    gradapt::detail::optim::lr_stage(o));
}

const std::vector<std::vector<std::int64_t>> shapes{{6, 9}, {9, 6}, {20, 7}, {4, 5, 6}, {7}};

/// Parameters and gradients of `shapes` in host memory, as host or device-tagged views.
struct model {
  std::vector<std::vector<float>> p, g;
  gradapt::param_list<float> params;
  model() {
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::int64_t n = 1;
      for (const auto d : shapes[t]) n *= d;
      p.emplace_back(static_cast<std::size_t>(n));
      g.emplace_back(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < p[t].size(); ++i) p[t][i] = 0.01f * float(int((i * 7 + t) % 13) - 6);
      params.add("w" + std::to_string(t), tensor_view<float>(p[t].data(), shapes[t]),
                 tensor_view<float>(g[t].data(), shapes[t]));
    }
  }
  /// Gradients of step k: multiples of 2^-8 in [-1, 1), different per tensor, step and rank.
  void grads(int k, int rank = 0) {
    for (std::size_t t = 0; t < g.size(); ++t)
      for (std::size_t i = 0; i < g[t].size(); ++i)
        g[t][i] = float(int((i * 37 + t * 11 + unsigned(k) * 53 + unsigned(rank) * 5) % 512) - 256) / 256.0f;
  }
  bool same_bits(const model& o) const {
    for (std::size_t t = 0; t < p.size(); ++t)
      if (std::memcmp(p[t].data(), o.p[t].data(), p[t].size() * sizeof(float)) != 0) return false;
    return true;
  }
};

std::vector<shampoo_options> option_sets() {
  std::vector<shampoo_options> out;
  shampoo_options muon = gradapt::spectral_descent_defaults();
  muon.lr = 0.02;
  muon.max_preconditioner_dim = 8;
  out.push_back(muon);
  shampoo_options adam = muon;
  adam.graft = gradapt::shampoo_graft::adam;
  adam.graft_preconditioned = true;
  adam.beta1 = 0.9;
  adam.bias_correction = true;
  adam.weight_decay = 1e-3;
  out.push_back(adam);
  shampoo_options rms = muon;
  rms.graft = gradapt::shampoo_graft::rmsprop;
  rms.graft_preconditioned = false;
  rms.beta1 = 0.5;
  rms.bias_correction = false;
  rms.momentum = 0.9;
  rms.nesterov = true;
  rms.newton_schulz.steps = 3;
  out.push_back(rms);
  return out;
}

/// Root-inverse Shampoo: Distributed Shampoo's defaults (shifted spectrum, absolute ridge,
/// bias-corrected first moment, 1-D tensors on blocks) with Adam's graft on the blocks;
/// gradapt's defaults (clamped spectrum, relative ridge, AdaGrad's graft) with roots every
/// third step from step 2 and momentum; and statistics every second step, bias-corrected with
/// beta2 0.9, one exponent for every factor, no merging, RMSProp's graft and an absolute ridge.
std::vector<shampoo_options> root_option_sets() {
  std::vector<shampoo_options> out;
  shampoo_options peer = gradapt::distributed_shampoo_defaults();
  peer.max_preconditioner_dim = 8;
  peer.beta2 = 0.99;
  peer.root.epsilon = 1e-6;
  peer.graft = gradapt::shampoo_graft::adam;
  peer.graft_preconditioned = true;
  out.push_back(peer);
  shampoo_options ours;
  ours.lr = 0.01;
  ours.max_preconditioner_dim = 8;
  ours.precondition_frequency = 3;
  ours.start_preconditioning_step = 2;
  ours.momentum = 0.9;
  ours.weight_decay = 1e-3;
  out.push_back(ours);
  shampoo_options third = ours;
  third.statistics_frequency = 2;
  third.precondition_frequency = 2;
  third.inverse_exponent_override = 2;
  third.merge_small_dims = false;
  third.bias_correction = true;
  third.beta2 = 0.9;
  third.beta1 = 0.5;
  third.graft = gradapt::shampoo_graft::rmsprop;
  third.root.ridge = gradapt::ridge_kind::absolute;
  third.root.epsilon = 1e-4;
  out.push_back(third);
  return out;
}

/// Eigenvalue-corrected Shampoo with eigendecompositions: the preset (bias-corrected first
/// moment, β2 0.95) with its bases refreshed every third step; and no first moment, the fourth
/// root of V (corrected_exponent 4), Adam's graft on the blocks and momentum.
std::vector<shampoo_options> corrected_option_sets() {
  std::vector<shampoo_options> out;
  shampoo_options preset = gradapt::eigenvalue_corrected_defaults();
  preset.max_preconditioner_dim = 8;
  preset.precondition_frequency = 3;
  out.push_back(preset);
  shampoo_options quartic = preset;
  quartic.beta1 = 0;
  quartic.precondition_frequency = 2;
  quartic.corrected_exponent = 4;
  quartic.graft = gradapt::shampoo_graft::adam;
  quartic.graft_preconditioned = true;
  quartic.momentum = 0.9;
  out.push_back(quartic);
  // SOAP: the QR refresh from the current bases, two iterations (the first refresh reorders
  // the columns).
  shampoo_options soap = gradapt::soap_defaults();
  soap.max_preconditioner_dim = 8;
  soap.precondition_frequency = 2;
  soap.qr_iterations = 2;
  out.push_back(soap);
  return out;
}

/// 12 steps of `opt` on (b, params), saved after step 6 and loaded into a fresh state; with
/// `comm`, the distributed step. Returns the root computations of the second state's steps and
/// whether every preconditioned block holds roots at the end.
template <class Opt, class B, class PL, class Comm>
std::pair<std::uint64_t, bool> twelve_steps(const Opt& opt, const B& b, const PL& params, model& m,
                                            Comm* comm, int rank) {
  std::vector<std::byte> saved;
  {
    auto st = opt.init(b, params);
    for (int k = 1; k <= 6; ++k) {
      m.grads(k, rank);
      if (comm)
        opt.step(*comm, b, params, st);
      else
        opt.step(b, params, st);
    }
    saved = st.save(b);
  }
  auto st = opt.init(b, params);
  st.load(b, saved);
  for (int k = 7; k <= 12; ++k) {
    m.grads(k, rank);
    if (comm)
      opt.step(*comm, b, params, st);
    else
      opt.step(b, params, st);
  }
  const auto& pre = st.preconditioner();
  bool ready = true;
  for (std::size_t t = 0; t < pre.tensors(); ++t)
    for (std::size_t j = 0; j < pre.layout(t).blocks.size(); ++j) ready = ready && pre.block(t, j).ready;
  return {pre.root_computations(), ready};
}

/// The chain with options `o` on gradapt::host with host_lapack and on the device path, 12
/// steps each through a checkpoint: the same bits, every tensor moved, and the same root
/// computations; returns the device run's (root computations, every block ready).
std::pair<std::uint64_t, bool> host_and_device(const shampoo_options& o) {
  const auto host_opt = family_chain<gradapt::host_lapack>(o);
  const auto dev_opt = family_chain<host_as_device::linalg>(o);
  model h, d;
  const gradapt::host hb{.threads = 1};
  const host_as_device::backend db;
  const auto dparams = host_as_device::on_device(d.params);
  const auto hr = twelve_steps(host_opt, hb, h.params, h, static_cast<threads*>(nullptr), 0);
  const auto dr = twelve_steps(dev_opt, db, dparams, d, static_cast<host_as_device::comm*>(nullptr), 0);
  CHECK(h.same_bits(d));
  CHECK(dr == hr);
  // The step moved every tensor (the comparison is not of two untouched models).
  const model fresh;
  for (std::size_t t = 0; t < h.p.size(); ++t) CHECK(h.p[t] != fresh.p[t]);
  return dr;
}

/// The same on `ranks` ranks (the distributed step, the same gradients on every rank: a
/// distributed Shampoo step takes averaged ones): the same bits and, the roots divided among
/// the ranks alike, the same root computations on each rank.
void host_and_device_on_ranks(const shampoo_options& o, int ranks = 2) {
  run_threads(ranks, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
    const auto host_opt = family_chain<gradapt::host_lapack>(o);
    const auto dev_opt = family_chain<host_as_device::linalg>(o);
    model h, d;
    const gradapt::host hb{.threads = 1};
    const host_as_device::backend db;
    host_as_device::comm dc{&c};
    const auto dparams = host_as_device::on_device(d.params);
    const auto hr = twelve_steps(host_opt, hb, h.params, h, &c, 0);
    const auto dr = twelve_steps(dev_opt, db, dparams, d, &dc, 0);
    RANK_REQUIRE(h.same_bits(d));
    RANK_REQUIRE(dr == hr);
  });
}

/// The messages of a first distributed device step on two ranks where `mine` changes rank 1's
/// options and `grads_by_rank` gives the ranks different gradients.
std::vector<std::string> first_step_errors(const shampoo_options& o, void (*mine)(shampoo_options&, int),
                                           bool grads_by_rank) {
  return gradapt_test::errors_of(2, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
    shampoo_options own = o;
    mine(own, c.rank());
    const auto dev_opt = family_chain<host_as_device::linalg>(own);
    model d;
    const host_as_device::backend db;
    host_as_device::comm dc{&c};
    const auto dparams = host_as_device::on_device(d.params);
    auto st = dev_opt.init(db, dparams);
    d.grads(1, grads_by_rank ? c.rank() : 0);
    dev_opt.step(dc, db, dparams, st);
  });
}

/// The device chain sharded by block (`sharded_optimizer`, the device-tagged communicator and
/// backend) on this rank's gradients, against the unsharded host chain on their mean: 8 steps,
/// the state saved after step 4 and loaded into a new sharded state on the same ranks (blocks,
/// roots, moments and graft state copied out of and back into the backend's buffers); the
/// same bits every step.
void sharded_matches(threads& c, const shampoo_options& o, const gradapt::shard::sharded_options& so) {
  const auto host_opt = family_chain<gradapt::host_lapack>(o);
  const auto dev_opt = family_chain<host_as_device::linalg>(o);
  const gradapt::host hb{.threads = 1};
  const host_as_device::backend db;
  host_as_device::comm dc{&c};
  model ref, sh;
  const auto dparams = host_as_device::on_device(sh.params);
  auto rst = host_opt.init(hb, ref.params);
  const gradapt::shard::sharded_optimizer sopt(dev_opt, so);
  auto sst = sopt.init(dc, db, dparams);
  for (int k = 1; k <= 8; ++k) {
    ref.grads(k, c.rank());
    sh.grads(k, c.rank());
    for (const auto& g : ref.params.grads()) c.allreduce(g, gradapt::reduce_op::sum);
    if (c.size() > 1) hb.apply_list(gradapt::detail::divide_by_ranks{c.size()}, ref.params.grads());
    host_opt.step(hb, ref.params, rst);
    if (k == 5) {  // through a checkpoint: every rank reads every rank's archive
      const auto mine = sst.save(db);
      std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(c.size()));
      for (int r = 0; r < c.size(); ++r) {
        double n = r == c.rank() ? static_cast<double>(mine.size()) : 0.0;
        c.broadcast(tensor_view<double>::vector(&n, 1), r);
        std::vector<double> words(static_cast<std::size_t>(n + 7) / 8, 0.0);
        if (r == c.rank()) std::memcpy(words.data(), mine.data(), mine.size());
        c.broadcast(gradapt::host_view(words), r);
        auto& a = all[static_cast<std::size_t>(r)];
        a.resize(static_cast<std::size_t>(n));
        std::memcpy(a.data(), words.data(), a.size());
      }
      sst = sopt.load(dc, db, dparams,
                      [&](int r) { return std::span<const std::byte>(all.at(static_cast<std::size_t>(r))); });
    }
    sopt.step(dc, db, dparams, sst);
    RANK_REQUIRE(ref.same_bits(sh));
  }
}

}  // namespace

TEST_CASE(
    "the Shampoo family on device memory, sharded by block: the unsharded host chain's bits on 1 to 3 "
    "ranks, through a checkpoint",
    "[shampoo][device][shard]") {
  const gradapt::shard::sharded_options rows{.partition = {.mode = gradapt::shard::granularity::unit}};
  const gradapt::shard::sharded_options tensors{.partition = {.mode = gradapt::shard::granularity::tensor}};
  // Under a sanitizer (which repeats the same code) up to 2 ranks.
  const int worlds = gradapt_test::under_sanitizer ? 2 : 3;
  for (int n = 1; n <= worlds; ++n) {
    INFO(n << " ranks");
    run_threads(n, {.timeout = std::chrono::seconds(120)}, [&](threads& c) {
      sharded_matches(c, root_option_sets()[0], rows);
      sharded_matches(c, root_option_sets()[1], tensors);
      sharded_matches(c, corrected_option_sets()[0], rows);
      sharded_matches(c, option_sets()[1], tensors);
    });
  }
}

TEST_CASE("shampoo spectral descent on device memory: the host chain's bits, through a checkpoint",
          "[shampoo][device]") {
  for (const auto& o : option_sets()) {
    INFO("graft " << to_string(o.graft) << ", beta1 " << o.beta1 << ", momentum " << o.momentum);
    host_and_device(o);
  }
}

TEST_CASE("shampoo spectral descent on device memory, distributed: agreement through the backend",
          "[shampoo][device][dist]") {
  host_and_device_on_ranks(option_sets()[1]);
  // A rank with another Newton–Schulz step count throws on every rank, through the staged
  // agreement.
  const auto what = first_step_errors(
      option_sets()[1],
      [](shampoo_options& m, int rank) {
        if (rank == 1) m.newton_schulz.steps = 4;
      },
      false);
  for (const auto& w : what) CHECK_THAT(w, Contains("newton_schulz.steps"));
}

TEST_CASE("shampoo root_inverse on device memory: the host chain's bits, through a checkpoint",
          "[shampoo][device]") {
  for (const auto& o : root_option_sets()) {
    INFO("spectrum " << to_string(o.spectrum) << ", graft " << to_string(o.graft) << ", beta1 " << o.beta1);
    const auto dr = host_and_device(o);
    // Roots were computed after the checkpoint, and every block uses them.
    CHECK(dr.first > 0);
    CHECK(dr.second);
  }
}

TEST_CASE("eigenvalue-corrected shampoo on device memory: the host chain's bits, through a checkpoint",
          "[shampoo][device]") {
  for (const auto& o : corrected_option_sets()) {
    INFO("beta1 " << o.beta1 << ", corrected_exponent " << o.corrected_exponent << ", eigenbasis "
                  << to_string(o.eigenbasis));
    CHECK(host_and_device(o).first > 0);
  }
  // On two ranks (every rank refreshes every block's bases).
  host_and_device_on_ranks(corrected_option_sets()[0]);
}

TEST_CASE(
    "shampoo root_inverse on device memory, distributed: the roots divided among the ranks and "
    "exchanged, the statistics agreed",
    "[shampoo][device][dist]") {
  const auto o = root_option_sets()[0];
  host_and_device_on_ranks(o);
  if (!gradapt_test::under_sanitizer) host_and_device_on_ranks(root_option_sets()[1], 3);
  // A rank whose gradients differ (so its statistics do) throws on every rank at the first
  // roots, naming the statistics' hash; and so does another root.epsilon.
  for (const auto& w : first_step_errors(
           o, [](shampoo_options&, int) {}, true))
    CHECK_THAT(w, Contains("statistics (hash)"));
  const auto eps = first_step_errors(
      o,
      [](shampoo_options& m, int rank) {
        if (rank == 1) m.root.epsilon = 1e-5;
      },
      false);
  for (const auto& w : eps) CHECK_THAT(w, Contains("root.epsilon"));
}

namespace {
/// A linear-algebra backend whose eigh throws while `fail` is set (a CUDA error, a lost device
/// on one rank).
template <class Base>
struct failing : Base {
  bool fail = false;
  template <class V, class W>
  bool eigh(V a, V w, W& ws) const {
    if (fail) throw gradapt::error("injected eigh failure");
    return Base::eigh(a, w, ws);
  }
};

/// Every rank's error when rank 1's roots throw (in the step, or in the background thread with
/// root_staleness 1) within 6 distributed steps of the chain on (Space's) backends.
template <bool Device>
std::vector<std::string> roots_throw_on_rank_1(std::uint64_t stale) {
  using L = std::conditional_t<Device, failing<host_as_device::linalg>, failing<gradapt::host_lapack>>;
  auto o = root_option_sets()[1];
  o.root_staleness = stale;
  return gradapt_test::errors_of(2, {.timeout = std::chrono::seconds(60)}, [&](threads& c) {
    auto opt = family_chain<L>(o);
    auto& stage = opt.template stage<0>();
    (stale == 0 ? stage.linalg.fail : stage.root_linalg->fail) = c.rank() == 1;
    model m;
    if constexpr (Device) {
      const host_as_device::backend db;
      host_as_device::comm dc{&c};
      const auto dparams = host_as_device::on_device(m.params);
      auto st = opt.init(db, dparams);
      for (int k = 1; k <= 6; ++k) {
        m.grads(k);
        opt.step(dc, db, dparams, st);
      }
    } else {
      const gradapt::host hb{.threads = 1};
      auto st = opt.init(hb, m.params);
      for (int k = 1; k <= 6; ++k) {
        m.grads(k);
        opt.step(c, hb, m.params, st);
      }
    }
  });
}
}  // namespace

TEST_CASE(
    "shampoo, distributed: a rank whose roots throw (in the step or in the background thread) makes "
    "every rank throw, naming it, in host and device memory",
    "[shampoo][device][dist]") {
  for (const std::uint64_t stale : {0, 1}) {
    INFO("root_staleness " << stale);
    for (const auto& errs : {roots_throw_on_rank_1<true>(stale), roots_throw_on_rank_1<false>(stale)}) {
      REQUIRE(errs.size() == 2);
      CHECK_THAT(errs[1], Contains("injected eigh failure"));
      CHECK_THAT(errs[0], Contains("shampoo::step") && Contains("rank 1"));
    }
  }
}

TEST_CASE(
    "shampoo's background roots on device memory (root_staleness 1 and 2, root_linalg's thread): the host "
    "chain's bits through a checkpoint with roots in flight, on 1 and 2 ranks",
    "[shampoo][device]") {
  for (const std::uint64_t stale : {1, 2}) {
    INFO("root_staleness " << stale);
    for (auto o : root_option_sets()) {
      o.root_staleness = stale;
      o.precondition_frequency = std::max(o.precondition_frequency, stale);
      const auto [computed, ready] = host_and_device(o);
      CHECK(computed > 0);
      CHECK(ready);
    }
  }
  auto o = root_option_sets()[0];
  o.root_staleness = 1;
  host_and_device_on_ranks(o);
  if (!gradapt_test::under_sanitizer) host_and_device_on_ranks(o, 3);
  // The roots ran on root_linalg, whose thread entered its device once.
  const auto dev_opt = family_chain<host_as_device::linalg>(o);
  model d;
  const host_as_device::backend db;
  const auto dparams = host_as_device::on_device(d.params);
  {
    auto st = dev_opt.init(db, dparams);
    for (int k = 1; k <= 4; ++k) {
      d.grads(k);
      dev_opt.step(db, dparams, st);
    }
    CHECK(st.preconditioner().root_computations() > 0);
  }
  CHECK(dev_opt.template stage<0>().root_linalg->entered->load() == 1);
  CHECK(dev_opt.template stage<0>().linalg.entered->load() == 0);
}

TEST_CASE(
    "shampoo on device memory against the long double re-run (test_linalg_cuda's, here through the "
    "device-tagged backends): roots in the step, one step stale, and eigenvalue-corrected, through a "
    "checkpoint",
    "[shampoo][device]") {
  using ref_t = gradapt_test::shampoo_ld_reference;
  const host_as_device::backend db;
  const host_as_device::linalg la;
  for (const int mode : {0, 1, 2}) {  // roots in the step, one step stale, eigenvalue-corrected
    INFO("mode " << mode);
    shampoo_options o;
    o.graft = gradapt::shampoo_graft::none;
    o.precondition_1d = false;
    o.root.ridge = gradapt::ridge_kind::absolute;
    o.root.epsilon = 1e-6;
    o.root_staleness = mode == 1 ? 1 : 0;
    if (mode == 2) {
      o.preconditioner = gradapt::shampoo_preconditioner::eigenvalue_corrected;
      o.eigenbasis = gradapt::shampoo_eigenbasis::eigh;
      o.root.ridge = gradapt::ridge_kind::relative;
      o.root.epsilon = 1e-4;
    }
    const auto r = gradapt_test::shampoo_against_ld<device_space>(
        db, la, mode == 1 ? std::optional<host_as_device::linalg>(host_as_device::linalg{}) : std::nullopt,
        host_as_device::memory{}, o, [&](ref_t& ref, const std::vector<double>& g) {
          return mode == 0   ? ref.direction(g)
                 : mode == 1 ? ref.stale_direction(g)
                             : ref.corrected_direction(g);
        });
    // Stale roots of a rank-deficient factor meet the next gradient's components in its null
    // space, scaled by ε^(-1/4) on each side, where the roots carry the eigensolver's roundoff
    // (u·λ_max) against ε: a looser bound (a wrong step gives differences of order 1).
    INFO("largest difference " << r.worst);
    CHECK(r.worst <= (mode == 1 ? 1e-8 : 1e-9));
    CHECK(r.root_computations > 0);
  }
}

TEST_CASE("shampoo on device memory: what stays in host memory throws at init, naming the option",
          "[shampoo][device]") {
  model d;
  const host_as_device::backend db;
  const auto dparams = host_as_device::on_device(d.params);
  CHECK_NOTHROW(family_chain<host_as_device::linalg>(gradapt::soap_defaults()).init(db, dparams));
  shampoo_options newton;
  newton.root.method = gradapt::root_method::coupled_newton;
  REQUIRE_THROWS_WITH(family_chain<host_as_device::linalg>(newton).init(db, dparams),
                      Contains("root.method eigen") && Contains("coupled_newton"));
  shampoo_options stale;
  stale.root_staleness = 1;
  REQUIRE_THROWS_WITH(family_chain<host_as_device::linalg>(stale, true).init(db, dparams),
                      Contains("root_staleness is 1") && Contains("root_linalg"));
  CHECK_NOTHROW(family_chain<host_as_device::linalg>(stale).init(db, dparams));
  // The host keeps both.
  const gradapt::host hb{.threads = 1};
  model h;
  CHECK_NOTHROW(family_chain<gradapt::host_lapack>(newton).init(hb, h.params));
  CHECK_NOTHROW(family_chain<gradapt::host_lapack>(stale).init(hb, h.params));
}

TEST_CASE(
    "the composed step with Muon, Shampoo (roots in the step or in the background) or "
    "eigenvalue-corrected Shampoo on device memory equals the host step, replicated or sharded by block",
    "[shampoo][device][train]") {
  namespace scenario = train_combinations_scenario;
  using sharded_scenario::model;
  shampoo_options muon = gradapt::spectral_descent_defaults();
  muon.lr = 1e-2;
  muon.max_preconditioner_dim = 64;
  muon.graft = gradapt::shampoo_graft::adam;
  muon.graft_preconditioned = true;
  muon.beta1 = 0.9;
  muon.momentum = 0.5;
  muon.weight_decay = 1e-3;
  muon.scale_by_aspect = true;
  shampoo_options roots = gradapt::distributed_shampoo_defaults();
  roots.lr = 1e-2;
  roots.max_preconditioner_dim = 16;
  roots.root.epsilon = 1e-6;
  roots.graft = gradapt::shampoo_graft::adam;
  roots.momentum = 0.5;
  shampoo_options corrected = gradapt::eigenvalue_corrected_defaults();
  corrected.lr = 1e-2;
  corrected.max_preconditioner_dim = 16;
  corrected.precondition_frequency = 2;
  shampoo_options stale = roots;  // the roots in the background thread (root_linalg's)
  stale.root_staleness = 1;
  std::vector<shampoo_options> sets{muon, roots, corrected};
  if (!gradapt_test::under_sanitizer) sets.push_back(stale);  // (the sanitizers run its own case above)
  for (const auto& o : sets) {
    INFO("preconditioner " << to_string(o.preconditioner) << ", root_staleness " << o.root_staleness);
    const auto host_opt = family_chain<gradapt::host_lapack>(o);
    const auto dev_opt = family_chain<host_as_device::linalg>(o);
    // 12 steps (an overflow at step 5 on the last rank), saved after 6 and loaded into a fresh
    // step (under a sanitizer 8, saved after 4); with the replicated state and LocalSGD, or with
    // the state sharded by block (zero_state<1>).
    constexpr int total = gradapt_test::under_sanitizer ? 8 : 12;
    const auto through_save = [](auto& comm, const auto& b, model<float>& m, const auto& params,
                                 const auto& opt, const auto& state, auto local) {
      constexpr bool with_local = decltype(local)::value;
      std::vector<std::byte> saved;
      {
        auto s = scenario::make_step<true, false, with_local>(comm, b, params, opt, state,
                                                              gradapt::train::one_buffer_reduce{},
                                                              gradapt::train::allreduce_mean{}, 1e-2);
        for (int k = 1; k <= total / 2; ++k) scenario::one_step(s, m, comm, k);
        saved = s.save();
      }
      auto s = scenario::make_step<true, false, with_local>(comm, b, params, opt, state,
                                                            gradapt::train::one_buffer_reduce{},
                                                            gradapt::train::allreduce_mean{}, 0.5);
      s.load(saved);
      for (int k = total / 2 + 1; k <= total; ++k) scenario::one_step(s, m, comm, k);
    };
    const auto rows = [&](const auto& state, auto local, std::initializer_list<int> worlds) {
      for (const int n : worlds) {
        INFO(n << " ranks");
        run_threads(n, {.timeout = std::chrono::seconds(120)}, [&](threads& c) {
          const gradapt::host hb{.threads = 1};
          const host_as_device::backend db;
          host_as_device::comm dc{&c};
          model<float> h, d;
          const auto dparams = host_as_device::on_device(d.params);
          through_save(c, hb, h, h.params, host_opt, state, local);
          through_save(dc, db, d, dparams, dev_opt, state, local);
          for (std::size_t t = 0; t < h.p.size(); ++t)
            RANK_REQUIRE(sharded_scenario::same_bits(h.p[t], d.p[t]));
        });
      }
    };
    // Under a sanitizer (which repeats the same code) 2 ranks only.
    if (gradapt_test::under_sanitizer) {
      rows(gradapt::train::replicated_state{}, std::true_type{}, {2});
      rows(gradapt::train::zero_state<1>{}, std::false_type{}, {2});
    } else {
      rows(gradapt::train::replicated_state{}, std::true_type{}, {1, 2, 3});
      rows(gradapt::train::zero_state<1>{}, std::false_type{}, {2, 3});
    }
  }
}

}  // namespace gradapt_test_shampoo_device_path

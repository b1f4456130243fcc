// K-FAC in the precondition slot of train::data_parallel_step (train/kfac_policy.hpp), on
// host_lapack and comm::threads ranks, for a 2-layer MLP (4 → 5, tanh, → 3, both with biases)
// whose parameters are added to the list out of layer order (the mapping is not the identity).
//
// What is checked, and against what (the scenario: tests/support/scenarios/train_kfac.hpp):
//  - the composed step (kfac_policy, SGD with momentum), with one-buffer, bucketed
//    (bucket_reduce, gradients marked in the backward's order) and hierarchical reduction
//    (hierarchical_reduce, one group: the flat sum's order), against the sequence
//    written out: allreduce-sum and divide by the rank count, kfac::step(comm, ...) at the lr,
//    the optimizer's step; bit for bit in the parameters and in the K-FAC state (its archive),
//    on 1, 2 and 3 ranks, with factor and inverse updates at several frequencies and both
//    methods;
//  - an overflow step (loss scaler, an inf on one rank, a and g already accumulated) leaves the
//    K-FAC state's steps, factors and decompositions unchanged, and the run then equals one that
//    never had that step (the accumulated terms were discarded, not carried over);
//  - the K-FAC state is in the step's checkpoint: a run continued from it equals the
//    uninterrupted one;
//  - a mapping that does not fit the parameter list throws gradapt::error naming the layer, on
//    every rank.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradapt/gradapt.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"
#include "gradapt/train/kfac_policy.hpp"
#include "rank_check.hpp"
#include "scenarios/train_kfac.hpp"

namespace gradapt_test_train_kfac {

using Catch::Matchers::Contains;
using threads = gradapt::comm::threads;
using namespace train_kfac_scenario;

TEST_CASE("kfac_policy: the composed step equals allreduce-mean, kfac::step(comm) and the optimizer by hand",
          "[train][kfac]") {
  const gradapt::kfac_options configs[] = {
      {.factor_update_steps = 1, .inv_update_steps = 1},
      {.factor_update_steps = 2, .inv_update_steps = 3},
      {.factor_update_steps = 3, .inv_update_steps = 2, .damping = 0.01, .method = kfac_method::inverse},
  };
  constexpr int steps = 7;
  for (int n = 1; n <= 3; ++n)
    for (const auto& o : configs) {
      INFO(n << " ranks, factor_update_steps " << o.factor_update_steps << ", inv_update_steps "
             << o.inv_update_steps);
      const kfac kf(o);
      std::vector<result> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n)),
          c(static_cast<std::size_t>(n)), h(static_cast<std::size_t>(n));
      std::vector<std::vector<float>> plain(static_cast<std::size_t>(n));
      gradapt::comm::run_threads(n, [&](threads& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        a[r] = run_composed(comm, kf, steps);
        b[r] = run_by_hand(comm, kf, steps);
        // Buckets of one or two tensors, marked in the backward's order.
        c[r] = run_composed(comm, kf, steps, train::bucket_reduce{.buckets = {.cap_bytes = 64}});
        // One group of every rank: the hierarchy's sum is the flat one, in the same order.
        h[r] = run_composed(comm, kf, steps, train::hierarchical_reduce{.hierarchy = {.group_size = n}});
        plain[r] = run_plain(comm, steps);
      });
      for (std::size_t r = 0; r < a.size(); ++r) {
        INFO("rank " << r);
        REQUIRE(a[r].kfac_steps == steps);
        REQUIRE(b[r].kfac_steps == steps);
        REQUIRE(same_bits(a[r].params, b[r].params));
        REQUIRE(a[r].kfac_state == b[r].kfac_state);
        REQUIRE(same_bits(c[r].params, b[r].params));
        REQUIRE(c[r].kfac_state == b[r].kfac_state);
        REQUIRE(same_bits(h[r].params, b[r].params));
        REQUIRE(h[r].kfac_state == b[r].kfac_state);
        REQUIRE(same_bits(a[r].params, a[0].params));  // the replicas agree
        // K-FAC changed the trajectory.
        REQUIRE_FALSE(same_bits(a[r].params, plain[r]));
      }
    }
}

TEST_CASE("kfac_policy: an overflow step leaves the K-FAC state untouched and discards its terms",
          "[train][kfac]") {
  // Factor updates at K-FAC steps 1, 3, 5 (calls 1, 3, 5 without the overflow); the overflow
  // hits call 3, whose a and g were accumulated (with the inf in g on the last rank).
  const kfac kf({.factor_update_steps = 2, .inv_update_steps = 2});
  const gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 1000});
  for (int n = 1; n <= 2; ++n) {
    INFO(n << " ranks");
    gradapt::comm::run_threads(n, [&](threads& comm) {
      const int r = comm.rank();
      mlp x, y;
      auto sx = train::make_data_parallel_step(
          comm, gradapt::host{.threads = 1}, x.params, make_opt(), {.lr = lr},
          train::kfac_policy(kf, kf.init<double>(la, layers), mapping()), scaler);
      auto sy = train::make_data_parallel_step(
          comm, gradapt::host{.threads = 1}, y.params, make_opt(), {.lr = lr},
          train::kfac_policy(kf, kf.init<double>(la, layers), mapping()), scaler);
      for (int s = 1; s <= 2; ++s) {
        composed_step(sx, x, r, s);
        composed_step(sy, y, r, s);
      }
      // The overflow step on x.
      const auto before = sx.preconditioner().state().save();
      const auto params_before = x.flat();
      x.backward(r, 3, sx.loss_scale());
      auto& pre = sx.preconditioner();
      RANK_REQUIRE(pre.factor_update_due());
      if (r == n - 1) {
        x.g1[0] = std::numeric_limits<float>::infinity();  // the backward pass overflowed here
        x.gw1[0] = std::numeric_limits<float>::infinity();
      }
      for (std::size_t l = 0; l < 2; ++l) pre.accumulate(l, x.a(l), x.g(l), sx.loss_scale());
      const auto& m = sx.step({.loss = 1.0 / 3});
      RANK_REQUIRE(m.found_inf);
      RANK_REQUIRE(!m.stepped);
      RANK_REQUIRE(sx.loss_scale() == 512.0);
      RANK_REQUIRE(pre.state().steps() == 2);
      RANK_REQUIRE(pre.state().save() == before);  // factors, decompositions, counters
      RANK_REQUIRE(same_bits(x.flat(), params_before));
      RANK_REQUIRE(pre.factor_update_due());  // the factor update is due again
      // x retries step 3 and goes on; y never had the overflow. The loss scales differ by a
      // power of two, which the unscale and K-FAC's division by the scale remove exactly.
      for (int s = 3; s <= 5; ++s) {
        composed_step(sx, x, r, s);
        composed_step(sy, y, r, s);
      }
      RANK_REQUIRE(sx.preconditioner().state().steps() == 5);
      RANK_REQUIRE(sx.preconditioner().state().save() == sy.preconditioner().state().save());
      RANK_REQUIRE(same_bits(x.flat(), y.flat()));
      RANK_REQUIRE(sx.metrics().optimizer_steps == 5);
    });
  }
}

TEST_CASE("kfac_policy: the K-FAC state is in the step's checkpoint", "[train][kfac]") {
  const kfac kf({.factor_update_steps = 2, .inv_update_steps = 3});
  gradapt::comm::run_threads(2, [&](threads& comm) {
    const int r = comm.rank();
    mlp a;
    auto sa = make_step(comm, a, kf);
    for (int s = 1; s <= 3; ++s) composed_step(sa, a, r, s);
    const auto ckpt = sa.save();
    const auto p3 = a.flat();
    for (int s = 4; s <= 6; ++s) composed_step(sa, a, r, s);

    mlp b;
    b.assign(p3);
    auto sb = make_step(comm, b, kf);
    sb.load(ckpt);
    RANK_REQUIRE(sb.preconditioner().state().steps() == 3);
    for (int s = 4; s <= 6; ++s) composed_step(sb, b, r, s);
    RANK_REQUIRE(same_bits(a.flat(), b.flat()));
    RANK_REQUIRE(sa.preconditioner().state().save() == sb.preconditioner().state().save());

    // A step without the preconditioner rejects the checkpoint (slot mask).
    mlp c;
    auto sc =
        train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, c.params, make_opt(), {.lr = lr});
    RANK_REQUIRE_THROWS_WITH(sc.load(ckpt), Contains("slot mask"));
  });
}

TEST_CASE("kfac_policy: a mapping that does not fit throws naming the layer, on every rank",
          "[train][kfac]") {
  const kfac kf({});
  using P = train::kfac_params;
  struct bad_case {
    std::vector<P> map;
    const char* message;
  };
  const bad_case cases[] = {
      {{{.weight = 9, .bias = 2}, {.weight = 0, .bias = 3}}, "layer 'fc1' names parameter 9 as its weight"},
      {{{.weight = 1, .bias = 2}, {.weight = 0, .bias = 7}}, "layer 'fc2' names parameter 7 as its bias"},
      {{{.weight = 0, .bias = 2}, {.weight = 1, .bias = 3}},
       "layer 'fc1' has a weight of out 5 × in 4 but its weight parameter 0 ('fc2.weight') has shape [3, 5]"},
      {{{.weight = 1, .bias = 3}, {.weight = 0, .bias = 2}},
       "layer 'fc1' has a bias of 5 but its bias parameter 3 ('fc2.bias') has shape [3]"},
      {{{.weight = 1}, {.weight = 0, .bias = 3}},
       "layer 'fc1' is registered with a bias but its mapping names no bias parameter"},
      {{{.weight = 1, .bias = 2}, {.weight = 1, .bias = 3}},
       "layer 'fc2' names parameter 1 ('fc1.weight') as its weight, which another mapping already names"},
      {{{.weight = 1, .bias = 2}}, "1 parameter mappings for 2 K-FAC layers"},
  };
  gradapt::comm::run_threads(2, [&](threads& comm) {
    for (const auto& c : cases) {
      mlp net;
      RANK_REQUIRE_THROWS_WITH(train::make_data_parallel_step(
                                   comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                   train::kfac_policy(kf, kf.init<double>(la, layers), c.map)),
                               Contains(c.message));
    }
    // A layer without a bias whose mapping names one.
    {
      mlp net;
      const kfac_layer nobias[] = {{"fc1", in, hid, false}, {"fc2", hid, out, true}};
      RANK_REQUIRE_THROWS_WITH(
          train::make_data_parallel_step(comm, gradapt::host{.threads = 1}, net.params, make_opt(),
                                         {.lr = lr},
                                         train::kfac_policy(kf, kf.init<double>(la, nobias), mapping())),
          Contains("layer 'fc1' is registered without a bias but its mapping names bias parameter 2"));
    }
    // A mapping wrong on one rank only: every rank throws, none waits.
    {
      mlp net;
      auto map = mapping();
      if (comm.rank() == 1) map[0].weight = 9;
      RANK_REQUIRE_THROWS_WITH(train::make_data_parallel_step(
                                   comm, gradapt::host{.threads = 1}, net.params, make_opt(), {.lr = lr},
                                   train::kfac_policy(kf, kf.init<double>(la, layers), map)),
                               Contains("kfac_policy parameter mapping"));
    }
  });
}

}  // namespace gradapt_test_train_kfac

// libFuzzer target for every state's load(): the loss scaler, the noise scale (single and
// grouped), AdaScale, LocalSGD (each schedule), the optimizer states (AdamW, LAMB, Adafactor,
// SM3), K-FAC's state, Shampoo's and SOAP's chain states, the sharded optimizer state (AdamW, ZeRO;
// Shampoo sharded by block), the data-parallel train step, replicated and with zero_state<2> (on
// comm::single), an elastic job's policies and the straggler detector. Input layout:
//
//   byte 0   which state (modulo the number of states)
//   byte 1   mode: even = the rest is the archive as is; odd = the rest is XORed, cyclically,
//            into a valid archive of that state and the CRC32C is recomputed, so the fuzzer
//            reaches the field parser and the value checks behind the checksum
//   rest     the archive, or the XOR pattern
//
// tests/fuzz/seeds holds one input per state (its index, XOR mode, zeros: the valid archive
// itself), from which scripts/fuzz.sh starts.
//
// Every load must either succeed or throw gradapt::error; after a throw the state must save
// the same bytes as before (all or nothing); after a success, saving and loading again must
// reproduce the same bytes. Anything else aborts (a finding). Built with
// -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh, which runs it for a short time.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "checkpoint_model.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/core/crc32c.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/elastic/policy.hpp"
#include "gradapt/elastic/straggler.hpp"
#include "gradapt/linalg/host_lapack.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/kfac.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "gradapt/optim/sm3.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "gradapt/scaling/adascale.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "gradapt/stats/gradient_noise_scale.hpp"
#include "gradapt/sync/local_sgd.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace {

using bytes = std::vector<std::byte>;

using gradapt_test::model;

/// One state under test: its current bytes, and a load.
struct target {
  std::function<bytes()> save;
  std::function<void(std::span<const std::byte>)> load;
};

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_load: %s\n", what);
  std::abort();
}

void check(const target& t, std::span<const std::byte> input) {
  const bytes before = t.save();
  try {
    t.load(input);
  } catch (const gradapt::error&) {
    if (t.save() != before) finding("a rejected load changed the state");
    return;
  }
  const bytes after = t.save();
  t.load(after);
  if (t.save() != after) finding("save -> load -> save is not the identity");
  t.load(before);  // the next input starts from the same state
}

template <class Opt>
target optimizer_target(Opt opt) {
  struct holder {
    model m;
    gradapt::host b{.threads = 1};
    Opt opt;
    decltype(std::declval<Opt&>().init(std::declval<gradapt::host&>(), std::declval<model&>().params)) st;
    explicit holder(Opt o) : opt(std::move(o)), st(opt.init(b, m.params)) {
      for (int t = 1; t <= 2; ++t) {
        m.grads(t);
        opt.step(b, m.params, st, {.lr = 1e-2});
      }
    }
  };
  auto h = std::make_shared<holder>(std::move(opt));
  return {[h] { return h->st.save(h->b); }, [h](std::span<const std::byte> in) { h->st.load(h->b, in); }};
}

template <class S>
target simple_target(std::shared_ptr<S> s) {
  return {[s] { return s->save(); }, [s](std::span<const std::byte> in) { s->load(in); }};
}

template <class Schedule>
target local_sgd_target(Schedule schedule) {
  struct holder {
    gradapt::comm::single comm;
    std::vector<float> x = std::vector<float>(7, 1.0f);
    std::vector<gradapt::tensor_view<float>> xs{gradapt::host_view(x)};
    gradapt::local_sgd<gradapt::comm::single, Schedule> lsgd;
    explicit holder(Schedule s) : lsgd(comm, {.start_step = 1}, s) {
      for (int t = 0; t < 5; ++t) {
        if constexpr (Schedule::uses_loss)
          lsgd.step(comm, gradapt::host{}, {.loss = 1.0 / (1 + t), .lr = 0.1}, std::span(xs));
        else
          lsgd.step(comm, gradapt::host{}, std::span(xs));
      }
    }
  };
  auto h = std::make_shared<holder>(schedule);
  return {[h] { return h->lsgd.save(); }, [h](std::span<const std::byte> in) { h->lsgd.load(in); }};
}

// A straggler detector that flagged rank 2 (window 6, persistence 2) after 9 steps.
target straggler_target() {
  auto d = std::make_shared<gradapt::elastic::straggler_detector>(
      4, gradapt::elastic::straggler_options{.window = 6, .persistence = 2});
  for (int t = 0; t < 9; ++t) {
    const double times[4] = {1.0 + 0.01 * t, 1.02, t % 2 ? 4.0 : 1.01, 0.99};
    d->observe(std::span<const double>(times));
  }
  return {[d] { return d->save(); }, [d](std::span<const std::byte> in) { d->load(in); }};
}

target train_step_target() {
  struct holder {
    gradapt::comm::single comm;
    model m;
    decltype(gradapt::train::make_data_parallel_step(
        std::declval<gradapt::comm::single&>(), gradapt::host{}, std::declval<model&>().params,
        gradapt::lamb({.weight_decay = 0.01}), gradapt::train::step_settings{}, gradapt::loss_scaler{},
        gradapt::train::adascale_policy{})) step;
    holder()
        : step(gradapt::train::make_data_parallel_step(
              comm, gradapt::host{}, m.params, gradapt::lamb({.weight_decay = 0.01}),
              {.lr = 0.01, .local_batch = 8}, gradapt::loss_scaler({.init_scale = 256.0}),
              gradapt::train::adascale_policy{.base_batch = 8})) {
      for (int t = 1; t <= 2; ++t) {
        m.grads(t);
        step.step({.loss = 1.0});
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->step.save(); }, [h](std::span<const std::byte> in) { h->step.load(in); }};
}

target sharded_target() {
  struct holder {
    gradapt::comm::single comm;
    model m;
    gradapt::host b{.threads = 1};
    gradapt::shard::sharded_optimizer<gradapt::adamw> opt{gradapt::adamw({.weight_decay = 0.01}), {}};
    decltype(opt.init(comm, b, m.params)) st;
    holder() : st(opt.init(comm, b, m.params)) {
      for (int t = 1; t <= 2; ++t) {
        m.grads(t);
        opt.step(comm, b, m.params, st, {.lr = 1e-2});
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->st.save(h->b); },
          [h](std::span<const std::byte> in) {
            h->st = h->opt.load(h->comm, h->b, h->m.params, [in](int) { return in; });
          }};
}

target zero_step_target() {
  struct holder {
    gradapt::comm::single comm;
    model m;
    decltype(gradapt::train::make_data_parallel_step(std::declval<gradapt::comm::single&>(), gradapt::host{},
                                                     std::declval<model&>().params, gradapt::adamw({}),
                                                     gradapt::train::step_settings{}, gradapt::loss_scaler{},
                                                     gradapt::train::zero_state<2>{})) step;
    holder()
        : step(gradapt::train::make_data_parallel_step(
              comm, gradapt::host{}, m.params, gradapt::adamw({}), {.lr = 0.01},
              gradapt::loss_scaler({.init_scale = 256.0}), gradapt::train::zero_state<2>{})) {
      for (int t = 1; t <= 2; ++t) {
        m.grads(t);
        for (std::size_t k = m.params.size(); k-- > 0;) step.mark_ready(k);
        step.step({.loss = 1.0});
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->step.save(); }, [h](std::span<const std::byte> in) { h->step.load(in); }};
}

target grouped_noise_target() {
  struct holder {
    model m;
    gradapt::grouped_noise_scale gns{{.smoothing = 0.8}, m.params};
    holder() {
      std::vector<double> local(gns.slots()), global(gns.slots());
      for (int t = 1; t <= 3; ++t) {
        for (std::size_t k = 0; k < local.size(); ++k) {
          local[k] = 0.5 + 0.1 * t + 0.01 * static_cast<double>(k);
          global[k] = 0.3 + 0.05 * t;
        }
        gns.update_reduced(local, global, 4, {.micro_batch = 8});
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->gns.save(); }, [h](std::span<const std::byte> in) { h->gns.load(in); }};
}

target kfac_target() {
  struct holder {
    gradapt::host_lapack la{};
    gradapt::kfac kf{{.inv_update_steps = 2}};
    std::vector<gradapt::kfac_layer> layers{{"fc", 3, 2, true}};
    decltype(kf.init<float>(la, layers)) st;
    holder() : st(kf.init<float>(la, layers)) {
      std::vector<float> w(6, 0.1f), bias(2, 0.0f), a(15), g(10);
      for (int t = 0; t < 3; ++t) {
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.1f * float((i * 7 + t) % 5) - 0.2f;
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.05f * float((i * 3 + t) % 7) - 0.1f;
        kf.accumulate(st, 0, gradapt::tensor_view<const float>(a.data(), {5, 3}),
                      gradapt::tensor_view<const float>(g.data(), {5, 2}));
        const gradapt::kfac_grad<float> grads[] = {
            {gradapt::tensor_view<float>(w.data(), {2, 3}), gradapt::tensor_view<float>(bias.data(), {2})}};
        kf.step(st, std::span(grads), 0.1);
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->st.save(); }, [h](std::span<const std::byte> in) { h->st.load(in); }};
}

// Shampoo, or with `soap` its eigenvalue-corrected member (QR refreshes: eigenbases and the
// corrected second moment in the archive).
target shampoo_target(bool soap = false) {
  struct holder {
    model m;
    gradapt::host b{.threads = 1};
    gradapt::shampoo opt;
    explicit holder(bool soap)
        : opt([soap] {
            gradapt::shampoo_options o = soap ? gradapt::soap_defaults() : gradapt::shampoo_options{};
            o.lr = 0.02;
            o.max_preconditioner_dim = 4;
            o.beta1 = 0.9;
            if (soap) o.root.epsilon = 1e-6;
            return o;
          }()),
          st(opt.init(b, m.params)) {
      for (int t = 1; t <= 3; ++t) {
        m.grads(t);
        opt.step(b, m.params, st);
      }
    }
    decltype(opt.init(b, m.params)) st;
  };
  auto h = std::make_shared<holder>(soap);
  return {[h] { return h->st.save(h->b); }, [h](std::span<const std::byte> in) { h->st.load(h->b, in); }};
}

// Shampoo sharded by block (shard::sharded_optimizer on comm::single): the header and every
// piece's blocks and elements.
target sharded_shampoo_target() {
  struct holder {
    gradapt::comm::single comm;
    model m;
    gradapt::host b{.threads = 1};
    gradapt::shard::sharded_optimizer<gradapt::shampoo> opt{
        gradapt::shampoo({.lr = 0.02, .max_preconditioner_dim = 4, .beta1 = 0.9}), {}};
    decltype(opt.init(comm, b, m.params)) st;
    holder() : st(opt.init(comm, b, m.params)) {
      for (int t = 1; t <= 3; ++t) {
        m.grads(t);
        opt.step(comm, b, m.params, st);
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->st.save(h->b); },
          [h](std::span<const std::byte> in) {
            h->st = h->opt.load(h->comm, h->b, h->m.params, [in](int) { return in; });
          }};
}

target job_policies_target() {
  struct holder {
    gradapt::comm::single comm;
    model m;
    decltype(gradapt::train::make_data_parallel_step(std::declval<gradapt::comm::single&>(), gradapt::host{},
                                                     std::declval<model&>().params, gradapt::adamw({}),
                                                     gradapt::train::step_settings{})) step;
    gradapt::elastic::adaptive_job<decltype(step), gradapt::elastic::sync_switch_policy> job;
    holder()
        : step(gradapt::train::make_data_parallel_step(comm, gradapt::host{}, m.params, gradapt::adamw({}),
                                                       {.lr = 0.01, .local_batch = 8})),
          job(step, gradapt::elastic::sync_switch_policy({.warmup = 3})) {
      for (int t = 1; t <= 6; ++t) {
        m.grads(t);
        job.step({.ready_seconds = 0.01 * t});
      }
    }
  };
  auto h = std::make_shared<holder>();
  return {[h] { return h->job.save_policies(); },
          [h](std::span<const std::byte> in) { h->job.load_policies(in); }};
}

std::vector<target>& targets() {
  static std::vector<target> all = [] {
    std::vector<target> t;
    auto scaler = std::make_shared<gradapt::loss_scaler>(gradapt::loss_scaler_options{.growth_interval = 3});
    for (int k = 0; k < 5; ++k) (void)scaler->update(k == 2);
    t.push_back(simple_target(scaler));
    auto gns = std::make_shared<gradapt::gradient_noise_scale>(gradapt::gradient_noise_scale_options{});
    for (int k = 1; k <= 3; ++k) gns->update(0.5 + 0.1 * k, 8.0, 0.2 + 0.01 * k, 32.0);
    t.push_back(simple_target(gns));
    auto ada = std::make_shared<gradapt::adascale>(gradapt::adascale_options{.scale = 4.0});
    for (int k = 0; k < 3; ++k) ada->advance(*gns, 8.0);
    t.push_back(simple_target(ada));
    t.push_back(local_sgd_target(gradapt::fixed_period({.period = 2})));
    t.push_back(local_sgd_target(gradapt::adaptive_period({.initial_period = 2, .max_period = 8})));
    t.push_back(local_sgd_target(gradapt::hierarchical_period(
        {.levels = {{.period = 2, .group_size = 1},
                    {.period = 4, .group_size = gradapt::hierarchical_level::world}}})));
    t.push_back(optimizer_target(gradapt::adamw({.weight_decay = 0.01})));
    t.push_back(optimizer_target(gradapt::lamb({.weight_decay = 0.01})));
    t.push_back(optimizer_target(gradapt::adafactor({.min_dim_size_to_factor = 2, .momentum = 0.9})));
    t.push_back(optimizer_target(gradapt::sm3({.momentum = 0.9})));
    t.push_back(train_step_target());
    t.push_back(sharded_target());
    t.push_back(zero_step_target());
    t.push_back(grouped_noise_target());
    t.push_back(kfac_target());
    t.push_back(shampoo_target());
    t.push_back(shampoo_target(true));
    t.push_back(job_policies_target());
    t.push_back(straggler_target());
    t.push_back(sharded_shampoo_target());
    return t;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  auto& all = targets();
  const target& t = all[data[0] % all.size()];
  const auto* rest = reinterpret_cast<const std::byte*>(data + 2);
  const std::size_t n = size - 2;
  if ((data[1] & 1) == 0) {
    check(t, std::span<const std::byte>(rest, n));
    return 0;
  }
  bytes mutated = t.save();
  for (std::size_t i = 0; i < n; ++i) mutated[(i * 131 + data[1] / 2) % mutated.size()] ^= rest[i];
  if (mutated.size() >= 4) {
    const std::uint32_t crc = gradapt::crc32c(std::span<const std::byte>(mutated.data(), mutated.size() - 4));
    for (int k = 0; k < 4; ++k)
      mutated[mutated.size() - 4 + k] = static_cast<std::byte>((crc >> (8 * k)) & 0xffu);
  }
  check(t, mutated);
  return 0;
}

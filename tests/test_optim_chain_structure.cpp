// Optimizer chains and presets (optim/): structure, checkpoints and errors.
//
//  - the pass structure (which lists each backend call reads and writes), through a recording
//    backend; custom chains (block-RMS clipping, debiased ema, parameter block RMS, relative
//    step, lr-coupled decay) against their formulas;
//  - save/restore: training continues bit for bit, and bad checkpoints are rejected;
//  - every error message names what is wrong.
#include "chain_fixtures.hpp"

namespace gradapt_test_optim_chain_structure {

using namespace chain_test;

// ---- pass structure ----------------------------------------------------------------------------

namespace {

/// One backend call: what it was and, per list, whether the backend may write it.
struct call_record {
  std::string op;
  std::vector<bool> mutable_lists;
  bool operator==(const call_record&) const = default;
};

/// Forwards to gradapt::host and records every element-wise call.
struct recording_backend {
  using space = gradapt::host_space;
  host inner{.threads = 1};
  std::vector<call_record>* log = nullptr;

  template <class L>
  static bool is_mutable() {
    using V = std::remove_cvref_t<std::ranges::range_value_t<L>>;
    return !std::is_const_v<typename V::element_type>;
  }
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, space>... v) const {
    log->push_back({"apply", {!std::is_const_v<Ts>...}});
    inner.apply(f, v...);
  }
  template <class F, class... Ls>
  void apply_list(F f, const Ls&... ls) const {
    log->push_back({"apply_list", {is_mutable<Ls>()...}});
    inner.apply_list(f, ls...);
  }
  template <class F, class... Ls>
  auto apply_reduce_list(F f, std::span<double> out, const Ls&... ls) const {
    log->push_back({"apply_reduce_list", {is_mutable<Ls>()...}});
    return inner.apply_reduce_list(f, out, ls...);
  }
  template <class T>
  double reduce(gradapt::reduction op, tensor_view<T, space> x) const {
    return inner.reduce(op, x);
  }
  template <class L>
  double reduce(gradapt::reduction op, const L& xs, std::span<double> out) const {
    return inner.reduce(op, xs, out);
  }
  template <class T, class U>
  double dot(tensor_view<T, space> x, tensor_view<U, space> y) const {
    return inner.dot(x, y);
  }
  template <class L1, class L2>
  double dot(const L1& x, const L2& y, std::span<double> out) const {
    return inner.dot(x, y, out);
  }
  void synchronize() const {}
  template <gradapt::element T>
  auto allocate(std::size_t n) const {
    return inner.allocate<T>(n);
  }
  template <class T>
  void copy(tensor_view<const T, space> s, tensor_view<T, space> d) const {
    inner.copy(s, d);
  }
};
static_assert(gradapt::optimizer_backend<recording_backend>);
static_assert(gradapt::optimizer_backend<host>);

template <class Opt>
std::vector<call_record> record_step(const Opt& opt) {
  std::vector<float> p(100, 1.0f), g(100, 0.1f), p2(7, 1.0f), g2(7, 0.2f);
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(p), gradapt::host_view(g));
  params.add("b", gradapt::host_view(p2), gradapt::host_view(g2));
  std::vector<call_record> log;
  recording_backend b{.log = &log};
  auto st = opt.init(b, params);
  log.clear();
  opt.step(b, params, st);
  return log;
}

}  // namespace

TEST_CASE("each preset makes the fewest passes and writes only what it must", "[optim][passes]") {
  using R = std::vector<call_record>;
  // The final pass (the one that writes p) is an apply_reduce_list on the host: it also sums
  // the updated parameters per tensor, the per-step finiteness check (chain_state).
  // AdamW: one pass reading p, g, m, v and writing p, m, v.
  REQUIRE(record_step(gradapt::adamw()) == R{{"apply_reduce_list", {true, false, true, true}}});
  // SGD: momentum 0 keeps no buffer; with momentum one buffer.
  REQUIRE(record_step(gradapt::sgd()) == R{{"apply_reduce_list", {true, false}}});
  REQUIRE(record_step(gradapt::sgd({.momentum = 0.9})) == R{{"apply_reduce_list", {true, false, true}}});
  // LAMB: (1) p, g read, m, v advanced, norms summed; (2) factors; (3) p written from p, m, v
  // (the gradient is not read again: the Adam direction is rebuilt from m and v).
  REQUIRE(record_step(gradapt::lamb()) == R{{"apply_reduce_list", {false, false, true, true}},
                                            {"apply_list", {true}},
                                            {"apply_reduce_list", {true, false, false}}});
  // LAMB with global clipping: one read pass over g first (and a one-element finalize).
  REQUIRE(record_step(gradapt::lamb({.max_grad_norm = 1.0})) ==
          R{{"apply_reduce_list", {false}},
            {"apply", {true}},
            {"apply_reduce_list", {false, false, true, true}},
            {"apply_list", {true}},
            {"apply_reduce_list", {true, false, false}}});
  // LARS: norms of p and g (read only), then p, g read and p, momentum written.
  REQUIRE(record_step(gradapt::lars()) == R{{"apply_reduce_list", {false, false}},
                                            {"apply_list", {true}},
                                            {"apply_reduce_list", {true, false, true}}});
  REQUIRE(record_step(gradapt::lars({.momentum = 0})) == R{{"apply_reduce_list", {false, false}},
                                                           {"apply_list", {true}},
                                                           {"apply_reduce_list", {true, false}}});
  // A custom chain with two barriers: block-RMS clipping then the trust ratio.
  namespace tf = gradapt::transform;
  gradapt::chain<tf::clip_by_block_rms, tf::scale_by_adam, tf::scale_by_trust_ratio,
                 tf::scale_by_learning_rate>
      c{tf::clip_by_block_rms{.threshold = 0.05}, tf::scale_by_adam{}, tf::scale_by_trust_ratio{},
        tf::scale_by_learning_rate{.lr = 0.1}};
  REQUIRE(record_step(c) == R{{"apply_reduce_list", {false}},
                              {"apply_list", {true}},
                              {"apply_reduce_list", {false, false, true, true}},
                              {"apply_list", {true}},
                              {"apply_reduce_list", {true, false, false}}});
}

TEST_CASE("a custom chain with block-RMS clipping matches its formula", "[optim][chain]") {
  namespace tf = gradapt::transform;
  // clip_by_block_rms then SGD: u = g / max(1, rms(g) / c), p ← p − η u.
  std::vector<float> p{1, 2, 3, 4}, g{3, -4, 0, 0}, p2{1, 1}, g2{0.01f, 0.01f};
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(p), gradapt::host_view(g));
  params.add("b", gradapt::host_view(p2), gradapt::host_view(g2));
  gradapt::chain<tf::clip_by_block_rms, tf::scale_by_learning_rate> c{tf::clip_by_block_rms{.threshold = 0.5},
                                                                      tf::scale_by_learning_rate{.lr = 1.0}};
  host b{};
  auto st = c.init(b, params);
  c.step(b, params, st);
  const double rms = std::sqrt((9.0 + 16.0) / 4.0);  // 2.5: clipped by 0.5 / 2.5
  REQUIRE(close(p[0], 1 - 3 * 0.5 / rms, 1e-6));
  REQUIRE(close(p[1], 2 + 4 * 0.5 / rms, 1e-6));
  REQUIRE(close(p2[0], 1 - 0.01, 1e-6));  // rms 0.01 < 0.5: untouched
}

TEST_CASE("ema with debias, parameter block RMS, relative step and lr-coupled decay follow their formulas",
          "[optim][chain]") {
  namespace tf = gradapt::transform;
  // u = EMA(g) / (1 − β^t); u ← u · max(rms(p), min_scale); u ← η_t s u with η_t = min(η, 1/√t);
  // u ← u + λ η s p (times_lr: the step's η, not η_t; s the group's lr_scale); p ← p − u.
  std::vector<float> pa{1, 2, 3, 4}, ga{1, -2, 0.5f, 4}, pb{2, -2}, gb{0.25f, -1};
  gradapt::param_list<float> params;
  params.add("a", gradapt::host_view(pa), gradapt::host_view(ga));
  const std::size_t slow = params.add_group("slow", {.lr_scale = 0.5, .weight_decay = std::nullopt});
  params.add("b", gradapt::host_view(pb), gradapt::host_view(gb), {}, slow);
  const double beta = 0.5, lam = 0.1, eta = 0.9;
  gradapt::chain c{tf::ema{.decay = beta, .debias = true}, tf::scale_by_param_block_rms{.min_scale = 1e-3},
                   tf::scale_by_learning_rate{.flip_sign = false, .relative_step = true},
                   tf::add_decayed_weights{.weight_decay = lam, .times_lr = true}, tf::scale{.factor = -1}};
  host b{};
  auto st = c.init(b, params);
  std::vector<std::vector<double>> p = {{1, 2, 3, 4}, {2, -2}}, m = {{0, 0, 0, 0}, {0, 0}};
  const std::vector<std::vector<double>> g = {{1, -2, 0.5, 4}, {0.25, -1}};
  const double s[2] = {1.0, 0.5};
  for (int t = 1; t <= 3; ++t) {
    c.step(b, params, st, {.lr = eta});
    const double eta_t = std::min(eta, 1 / std::sqrt(double(t)));
    for (std::size_t k = 0; k < 2; ++k) {
      double ss = 0;
      for (double v : p[k]) ss += v * v;
      const double scale = std::max(std::sqrt(ss / double(p[k].size())), 1e-3);
      for (std::size_t i = 0; i < p[k].size(); ++i) {
        m[k][i] = (1 - beta) * g[k][i] + beta * m[k][i];
        const double u =
            m[k][i] / (1 - std::pow(beta, t)) * scale * eta_t * s[k] + lam * eta * s[k] * p[k][i];
        p[k][i] -= u;
      }
    }
    for (std::size_t i = 0; i < pa.size(); ++i) REQUIRE(close(pa[i], p[0][i], 1e-5));
    for (std::size_t i = 0; i < pb.size(); ++i) REQUIRE(close(pb[i], p[1][i], 1e-5));
  }
  // The parameter scale's measure reads p only, but ema before it keeps state: its pass still
  // advances ema (it is not a p-only pass).
  using P = decltype(c)::plan;
  static_assert(!P::measure_only(0, P::mask_of(3)));
  REQUIRE_THROWS_WITH((gradapt::chain{tf::ema{.decay = -0.1}}), Contains("decay"));
  REQUIRE_THROWS_WITH(c.step(b, params, st, {.lr = -1.0}), Contains("learning rate"));
}

TEST_CASE("presets reject a negative learning rate; a chain of one's own may ascend", "[optim][chain]") {
  namespace tf = gradapt::transform;
  std::vector<float> p = {1, -2, 3, 0.5f}, g = {0.5f, 0.25f, -1, 2};
  const std::vector<float> p0 = p;
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(p), gradapt::host_view(g));
  host b{};
  const auto check = [&](const auto& opt, const char* name) {
    CAPTURE(name);
    auto st = opt.init(b, params);
    REQUIRE_THROWS_WITH(opt.step(b, params, st, {.lr = -0.1}),
                        Contains("learning rate is -0.1") && Contains("expected >= 0"));
    REQUIRE(p == p0);  // rejected before any element moved
    REQUIRE(st.steps() == 0);
    opt.step(b, params, st, {.lr = 0.0});  // zero is allowed
    p = p0;
  };
  check(gradapt::sgd({.lr = 0.1, .momentum = 0.9}), "sgd");
  check(gradapt::adamw(), "adamw");
  check(gradapt::lamb(), "lamb");
  check(gradapt::lars(), "lars");
  REQUIRE_THROWS_WITH(gradapt::sgd({.lr = -0.1}), Contains("lr is -0.1") && Contains("expected >= 0"));
  REQUIRE_THROWS_WITH(gradapt::adamw({.lr = -1e-3}), Contains("expected >= 0"));
  // A chain of one's own: allow_negative defaults to true, so η = -0.5 with the sign flip ascends:
  // p ← p + 0.5 g.
  gradapt::chain up{tf::scale_by_learning_rate{.lr = 1.0}};
  auto st = up.init(b, params);
  up.step(b, params, st, {.lr = -0.5});
  for (std::size_t i = 0; i < p.size(); ++i) REQUIRE(p[i] == p0[i] + 0.5f * g[i]);
  REQUIRE_THROWS_WITH((gradapt::chain{tf::scale_by_learning_rate{.lr = -1.0, .allow_negative = false}}),
                      Contains("lr is -1"));
}

// ---- save / restore ----------------------------------------------------------------------------

namespace {

template <class Opt>
void check_round_trip(const Opt& opt, int threads) {
  problem<float, float> a(standard_specs(), 43);
  host b{.threads = threads};
  auto st = opt.init(b, a.params);
  for (int s = 1; s <= 3; ++s) {
    a.make_grads(s);
    opt.step(b, a.params, st, {.lr = 0.01});
  }
  const auto bytes = st.save(b);
  const auto p_saved = a.p;
  for (int s = 4; s <= 6; ++s) {
    a.make_grads(s);
    opt.step(b, a.params, st, {.lr = 0.01});
  }
  // A fresh problem and state, restored from the bytes.
  problem<float, float> c(standard_specs(), 43);
  for (std::size_t t = 0; t < c.p.size(); ++t)
    std::copy(p_saved[t].begin(), p_saved[t].end(), c.p[t].begin());
  auto st2 = opt.init(b, c.params);
  st2.load(b, bytes);
  REQUIRE(st2.steps() == 3);
  for (int s = 4; s <= 6; ++s) {
    c.make_grads(s);
    opt.step(b, c.params, st2, {.lr = 0.01});
  }
  for (std::size_t t = 0; t < c.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
  REQUIRE(st2.save(b) == st.save(b));
}

}  // namespace

TEST_CASE("save and restore continue bit for bit", "[optim][checkpoint]") {
  for (int threads : {1, 2}) {
    check_round_trip(gradapt::adamw({.weight_decay = 0.01}), threads);
    check_round_trip(gradapt::lamb({.weight_decay = 0.01, .max_grad_norm = 1.0}), threads);
    check_round_trip(gradapt::lars({.weight_decay = 0.01, .nesterov = true}), threads);
    check_round_trip(gradapt::sgd({.momentum = 0.9}), threads);
    check_round_trip(gradapt::sgd(), threads);
  }
}

TEST_CASE("a state is move-only and keeps working after a move", "[optim][checkpoint]") {
  problem<float, float> a(standard_specs(), 59), c(standard_specs(), 59);
  host b{};
  gradapt::lamb opt({.weight_decay = 0.01});
  auto s1 = opt.init(b, a.params);
  static_assert(!std::is_copy_constructible_v<decltype(s1)> &&
                std::is_nothrow_move_constructible_v<decltype(s1)>);
  auto s2 = opt.init(b, c.params);
  a.make_grads(1);
  c.make_grads(1);
  opt.step(b, a.params, s1);
  opt.step(b, c.params, s2);
  auto moved = std::move(s2);  // the views into the moved buffers stay valid
  a.make_grads(2);
  c.make_grads(2);
  opt.step(b, a.params, s1);
  opt.step(b, c.params, moved);
  for (std::size_t t = 0; t < a.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
}

TEST_CASE("bad checkpoints are rejected with the reason", "[optim][checkpoint][errors]") {
  problem<float, float> a(standard_specs(), 47);
  host b{};
  gradapt::adamw opt;
  auto st = opt.init(b, a.params);
  a.make_grads(1);
  opt.step(b, a.params, st);
  const auto bytes = st.save(b);
  auto st2 = opt.init(b, a.params);
  // Truncated, trailing bytes, not a checkpoint, another kind of state.
  REQUIRE_THROWS_WITH(st2.load(b, std::span(bytes).first(bytes.size() - 5)), Contains("checksum mismatch"));
  auto longer = bytes;
  longer.push_back(std::byte{0});
  REQUIRE_THROWS_WITH(st2.load(b, longer), Contains("checksum mismatch"));
  auto garbled = bytes;
  garbled[0] = std::byte{'x'};
  REQUIRE_THROWS_WITH(st2.load(b, garbled), Contains("not a gradapt state archive"));
  REQUIRE_THROWS_WITH(st2.load(b, std::span(bytes).first(3)), Contains("too few"));
  REQUIRE_THROWS_WITH(st2.load(b, gradapt::loss_scaler{}.save()),
                      Contains("'gradapt.loss_scaler' archive, expected 'gradapt.optimizer'"));
  // A well-formed archive whose values do not fit: a non-finite moment, a step count that
  // cannot grow.
  const auto rewrite = [&](auto&& edit) {
    gradapt::archive_reader r{bytes, "gradapt.optimizer", 1};
    gradapt::archive_writer w{"gradapt.optimizer", 1};
    for (const auto& n : r.names()) {
      switch (r.type(n)) {
        case gradapt::archive_field::u64: {
          auto v = r.get<std::uint64_t>(n);
          edit(n, v);
          w.put(n, v);
          break;
        }
        case gradapt::archive_field::string:
          w.put(n, r.get<std::string>(n));
          break;
        case gradapt::archive_field::tensor: {
          const auto info = r.tensor_info(n);
          if (info.element == gradapt::archive_element::i64) {
            w.put_tensor<std::int64_t>(n, r.get_tensor<std::int64_t>(n), info.shape);
          } else {
            auto v = r.get_tensor<float>(n);
            edit(n, v);
            w.put_tensor<float>(n, v, info.shape);
          }
          break;
        }
        default:
          FAIL("unexpected field type");
      }
    }
    return w.finish();
  };
  const auto nan_moment = rewrite([](const std::string& n, auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::vector<float>>)
      if (n.rfind("buffer1/", 0) == 0 && !v.empty()) v.back() = std::numeric_limits<float>::quiet_NaN();
  });
  REQUIRE_THROWS_WITH(st2.load(b, nan_moment), Contains("holds a non-finite value"));
  const auto huge_steps = rewrite([](const std::string& n, auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::uint64_t>)
      if (n == "steps") v = std::numeric_limits<std::uint64_t>::max();
  });
  REQUIRE_THROWS_WITH(st2.load(b, huge_steps), Contains("cannot grow"));
  REQUIRE(st2.steps() == 0);
  // Other element type, other sizes, other active stages, other optimizer.
  problem<double, double> d(standard_specs(), 47);
  auto sd = opt.init(b, d.params);
  REQUIRE_THROWS_WITH(sd.load(b, bytes), Contains("holds float32 state but this state is float64"));
  auto specs = standard_specs();
  specs[0].shape = {38};
  problem<float, float> other(specs, 47);
  auto so = opt.init(b, other.params);
  REQUIRE_THROWS_WITH(so.load(b, bytes),
                      Contains("has shape [") && Contains("in the checkpoint but [38] here"));
  gradapt::sgd plain, heavy({.momentum = 0.9});
  auto sp = plain.init(b, a.params);
  auto sh = heavy.init(b, a.params);
  REQUIRE_THROWS_WITH(sh.load(b, sp.save(b)), Contains("active-stage mask"));
  gradapt::lamb lamb;
  auto sl = lamb.init(b, a.params);
  // The message names both optimizers' stages.
  REQUIRE_THROWS_WITH(sl.load(b, bytes), Contains("stage count is 3 (its stages: chain<") &&
                                             Contains("but this state's is 5 (chain<") &&
                                             Contains("scale_by_trust_ratio"));
  // A failed load leaves the state usable and unchanged.
  REQUIRE(st2.steps() == 0);
  st2.load(b, bytes);
  REQUIRE(st2.steps() == 1);
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("invalid options name the public algorithm and option", "[optim][errors]") {
  REQUIRE_THROWS_WITH(gradapt::adamw({.b1 = 1.0}),
                      StartsWith("gradapt: adamw: b1 is 1 (expected 0 <= b1 < 1"));
  REQUIRE_THROWS_WITH(gradapt::adamw({.b2 = -0.1}), StartsWith("gradapt: adamw: b2 is -0.1"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.b1 = 1}), StartsWith("gradapt: lamb: b1 is 1"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.eps = -1e-6}), StartsWith("gradapt: lamb: eps is -1e-06"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.lr = std::nan("")}), StartsWith("gradapt: lamb: lr is nan"));
  REQUIRE_THROWS_WITH(
      gradapt::lamb({.min_trust_ratio = 10, .max_trust_ratio = 0.01}),
      StartsWith("gradapt: lamb: the clamp [min_trust_ratio, max_trust_ratio] is [10, 0.01]"));
  REQUIRE_THROWS_WITH(gradapt::lamb({.max_grad_norm = -1}), StartsWith("gradapt: lamb: max_grad_norm is -1"));
  REQUIRE_THROWS_WITH(gradapt::lars({.trust_coefficient = 0}),
                      StartsWith("gradapt: lars: trust_coefficient is 0"));
  REQUIRE_THROWS_WITH(gradapt::lars({.momentum = 1.5}), StartsWith("gradapt: lars: momentum is 1.5"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.momentum = -0.5}), StartsWith("gradapt: sgd: momentum is -0.5"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.nesterov = true}),
                      StartsWith("gradapt: sgd: nesterov is set but momentum is 0"));
  REQUIRE_THROWS_WITH(gradapt::sgd({.weight_decay = INFINITY}),
                      StartsWith("gradapt: sgd: weight_decay is inf"));
}

TEST_CASE("the ({}) forms give the default options", "[optim][usability]") {
  // Each is an exact match for the empty braces (not ambiguous with the move constructor).
  problem<float, float> a(standard_specs(), 61), c(standard_specs(), 61);
  host b{};
  const auto same_step = [&](const auto& x, const auto& y) {
    auto sx = x.init(b, a.params);
    auto sy = y.init(b, c.params);
    a.make_grads(1);
    c.make_grads(1);
    x.step(b, a.params, sx);
    y.step(b, c.params, sy);
    for (std::size_t t = 0; t < a.p.size(); ++t) REQUIRE(same_bits(a.p[t], c.p[t]));
  };
  same_step(gradapt::sgd({}), gradapt::sgd());
  same_step(gradapt::adamw({}), gradapt::adamw());
  same_step(gradapt::lamb({}), gradapt::lamb());
  same_step(gradapt::lars({}), gradapt::lars());
  REQUIRE(gradapt::loss_scaler({}).scale() == gradapt::loss_scaler().scale());
  REQUIRE_THROWS_WITH(gradapt::lamb({gradapt::lamb_options{}, gradapt::lamb_options{}}),
                      Contains("lamb: 2 option sets given (expected one)"));
}

TEST_CASE("mismatched parameters, states and learning rates are rejected", "[optim][errors]") {
  problem<float, float> a(standard_specs(), 53);
  host b{};
  gradapt::lamb opt;
  auto st = opt.init(b, a.params);
  // A list with another tensor count, or another size.
  auto fewer = standard_specs();
  fewer.pop_back();
  problem<float, float> f(fewer, 53);
  REQUIRE_THROWS_WITH(opt.step(b, f.params, st), Contains("holds 8 tensors but the state was created for 9"));
  auto bigger = standard_specs();
  bigger[1].shape = {33, 18};
  problem<float, float> g(bigger, 53);
  REQUIRE_THROWS_WITH(opt.step(b, g.params, st),
                      Contains("parameter 'w2d.weight' (tensor 1) has 594 elements but the state holds 561"));
  // A learning rate that is not finite.
  REQUIRE_THROWS_WITH(opt.step(b, a.params, st, {.lr = INFINITY}),
                      Contains("the step's learning rate is inf"));
  // Options that switch a stage on or off after init.
  gradapt::sgd sgd({.momentum = 0.9});
  auto ss = sgd.init(b, a.params);
  sgd.stage<1>().decay = 0.0;
  REQUIRE_THROWS_WITH(sgd.step(b, a.params, ss),
                      Contains("{stage 1 off} but the state was created with {stage 1 on}"));
  sgd.stage<1>().decay = 0.5;  // another momentum is fine
  sgd.step(b, a.params, ss);
  REQUIRE(ss.steps() == 1);
  REQUIRE(st.steps() == 0);  // failed steps do not count
  REQUIRE_THROWS_WITH(st.buffer(2), Contains("index 2 out of range (2 buffer(s))"));
}

namespace {
/// A stage that declares only what is particular to it: no traits, no validate, no
/// per-tensor constants (every trait takes its default: element-wise, stateless, required).
struct halve {
  template <class C>
  struct kernel {
    template <class V>
    GRADAPT_HD void update(V& u, const V&, const double*) const {
      u = u * V(C(0.5));
    }
    template <class V>
    GRADAPT_HD void replay(V& u, const V&, const double*) const {
      u = u * V(C(0.5));
    }
  };
  template <class C>
  kernel<C> prepare(const gradapt::step_context&) const {
    return {};
  }
};
}  // namespace

TEST_CASE("a stage declaring only its kernel takes the trait defaults", "[optim][chain]") {
  using traits = gradapt::detail::optim::stage_traits<halve>;
  static_assert(traits::buffers == 0 && traits::tensor_slots == 0 && !traits::barrier && !traits::optional &&
                !traits::replay_ignores_input && traits::uses_param && !traits::factored_state);
  // halve → lr 0.1 is SGD at lr 0.05 (halving is exact, and float(0.05) is float(0.1) / 2).
  problem<float, float> a({{"w", {33, 7}}, {"b", {7}}}, 5), b({{"w", {33, 7}}, {"b", {7}}}, 5);  // group 0
  host be{.threads = 2};
  const gradapt::chain mine{halve{}, gradapt::transform::scale_by_learning_rate{.lr = 0.1}};
  const auto sgd = gradapt::sgd({.lr = 0.05});
  auto sa = mine.init(be, a.params);
  auto sb = sgd.init(be, b.params);
  REQUIRE(sa.buffer_count() == 0);
  for (int s = 1; s <= 3; ++s) {
    a.make_grads(s);
    b.make_grads(s);
    mine.step(be, a.params, sa);
    sgd.step(be, b.params, sb);
  }
  for (std::size_t t = 0; t < a.p.size(); ++t)
    REQUIRE(std::memcmp(a.p[t].data(), b.p[t].data(), a.p[t].size() * sizeof(float)) == 0);
}

}  // namespace gradapt_test_optim_chain_structure

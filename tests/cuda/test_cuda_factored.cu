// The factored optimizers on the CUDA backend (Adafactor, SM3) and the two backend operations
// they need (cuda::reduce_factored, cuda::apply_factored).
//
//  - reduce_factored's row and column sums of exact-valued data (k/8) equal plain host loops
//    bit for bit (any order gives the same exact sums), its maxima always do;
//  - apply_factored's element results equal the host loop, its sum equals it for exact data;
//  - adafactor (optax defaults, momentum, torch form) and sm3 over a mixed list of 1-D, 2-D,
//    3-D and 4-D tensors follow gradapt::host to within float rounding (nvcc contracts to fma
//    and sums in another fixed order, so the bits differ);
//  - a device checkpoint round-trips: training continues bit for bit;
//  - apply_factored_sum leaves apply_factored's sum in device memory;
//  - adafactor and sm3 steps capture into a CUDA graph (the capture fails on any host
//    synchronisation, copy to the host or allocation), and the graph gives the direct step's
//    bits;
//  - adafactor and sm3 (chains run tensor by tensor) follow gradapt::host in their state
//    buffers too, over the mixed list plus empty tensors, for four (three) option sets; a
//    device checkpoint continues bit for bit (and a fresh state would not); a step captures
//    into a CUDA graph that gives the direct step's bits.
//
// Compiled wherever nvcc is found; skipped (exit 77) without a GPU.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_test_support.cuh"
#include "factored_layout.hpp"
#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/sm3.hpp"

namespace gradapt_test_cuda_factored {

using namespace gradapt_test;

static_assert(gradapt::factored_backend<gradapt::cuda>);
static_assert(gradapt::factored_backend<gradapt::host>);

namespace {

struct square_term {
  GRADAPT_HD double operator()(float r, float c, float v) const { return static_cast<double>(r * c * v * v); }
};
struct scale_rc {
  GRADAPT_HD float operator()(float r, float c, float& y) const {
    y = y * r * c;
    return y;
  }
};

std::vector<float> exact_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> k(-16, 16);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(k(rng)) / 8.0f;
  return v;
}

struct host_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> p, g;
};

std::vector<host_tensor> mixed(unsigned seed) {
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
      {"bias", {37}},          {"scalar", {}},           {"big", {515, 257}},        {"wide", {130, 300}},
      {"cube", {3, 140, 129}}, {"apart", {150, 2, 130}}, {"four", {129, 2, 131, 3}}, {"small", {16, 24}},
      {"unit", {1, 300, 1}}};
  std::vector<host_tensor> out;
  unsigned s = seed;
  for (const auto& [name, shape] : shapes) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    out.push_back({name, shape, random_values<float>(n, s++, -1.0, 1.0), std::vector<float>(n)});
  }
  return out;
}

/// `mixed` plus two empty tensors: 0 x 200, and 130 x 0 x 140, whose shape the optax rule
/// would factor (its two largest dims are >= 128) were it not empty.
std::vector<host_tensor> mixed_with_empty(unsigned seed) {
  auto out = mixed(seed);
  out.insert(out.begin() + 3, host_tensor{"empty", {0, 200}, {}, {}});
  out.push_back(host_tensor{"none", {130, 0, 140}, {}, {}});
  return out;
}

void fill_grads(std::vector<host_tensor>& ts, unsigned seed) {
  unsigned s = seed;
  for (auto& t : ts) t.g = random_values<float>(t.p.size(), s++, -0.125, 0.125);
}

/// Two device copies of the parameters of `h` (`pa`, `pb`) sharing one gradient buffer `dg`
/// (a copy of the gradients of `h`), and the lists `a` over pa and `b` over pb.
struct twin_lists {
  std::vector<dvec<float>> pa, pb, dg;
  gradapt::param_list<float, float, device_space> a, b;
  explicit twin_lists(const std::vector<host_tensor>& h) {
    for (const auto& t : h) {
      pa.push_back(to_device(t.p));
      pb.push_back(to_device(t.p));
      dg.push_back(to_device(t.g));
    }
    for (std::size_t i = 0; i < h.size(); ++i) {
      const auto shp = std::span<const std::int64_t>(h[i].shape);
      a.add(h[i].name, tensor_view<float, device_space>(thrust::raw_pointer_cast(pa[i].data()), shp),
            tensor_view<float, device_space>(thrust::raw_pointer_cast(dg[i].data()), shp));
      b.add(h[i].name, tensor_view<float, device_space>(thrust::raw_pointer_cast(pb[i].data()), shp),
            tensor_view<float, device_space>(thrust::raw_pointer_cast(dg[i].data()), shp));
    }
  }
  twin_lists(const twin_lists&) = delete;
  twin_lists& operator=(const twin_lists&) = delete;
};

/// The default of host_vs_device's `check`: nothing beyond the parameters.
struct no_state_check {
  template <class HS, class DS>
  void operator()(const HS&, const DS&) const {}
};

/// Runs `Opt` for `steps` steps on the host and on the device from the same start and
/// gradients (tensors from `shapes`); calls `check(host state, device state)` after the last
/// step, and returns the largest parameter difference relative to the largest movement.
template <class Opt, class Check = no_state_check>
double host_vs_device(const Opt& opt, int steps, std::vector<host_tensor> (*shapes)(unsigned) = mixed,
                      Check check = {}) {
  auto h = shapes(1);
  const auto start = h;
  gradapt::param_list<float> hp;
  for (auto& t : h)
    hp.add(t.name, tensor_view<float>(t.p.data(), std::span<const std::int64_t>(t.shape)),
           tensor_view<float>(t.g.data(), std::span<const std::int64_t>(t.shape)));
  std::vector<dvec<float>> dp, dg;
  for (auto& t : h) {
    dp.push_back(to_device(t.p));
    dg.push_back(to_device(t.g));
  }
  gradapt::param_list<float, float, device_space> dpl;
  for (std::size_t i = 0; i < h.size(); ++i)
    dpl.add(h[i].name,
            tensor_view<float, device_space>(thrust::raw_pointer_cast(dp[i].data()),
                                             std::span<const std::int64_t>(h[i].shape)),
            tensor_view<float, device_space>(thrust::raw_pointer_cast(dg[i].data()),
                                             std::span<const std::int64_t>(h[i].shape)));
  gradapt::host hb{.threads = 2};
  gradapt::cuda cb{};
  auto hs = opt.init(hb, hp);
  auto ds = opt.init(cb, dpl);
  for (int s = 1; s <= steps; ++s) {
    fill_grads(h, 100u * static_cast<unsigned>(s));
    for (std::size_t i = 0; i < h.size(); ++i) thrust::copy(h[i].g.begin(), h[i].g.end(), dg[i].begin());
    // h[i].g was reassigned: rebuild the host list's views
    gradapt::param_list<float> hp2;
    for (auto& t : h)
      hp2.add(t.name, tensor_view<float>(t.p.data(), std::span<const std::int64_t>(t.shape)),
              tensor_view<float>(t.g.data(), std::span<const std::int64_t>(t.shape)));
    opt.step(hb, hp2, hs);
    opt.step(cb, dpl, ds);
  }
  cb.synchronize();
  check(hs, ds);
  double move = 0, err = 0;
  for (std::size_t i = 0; i < h.size(); ++i) {
    const auto d = to_host(dp[i]);
    for (std::size_t k = 0; k < d.size(); ++k) {
      REQUIRE(std::isfinite(d[k]));
      move = std::max(move, std::fabs(double(h[i].p[k]) - double(start[i].p[k])));
      err = std::max(err, std::fabs(double(h[i].p[k]) - double(d[k])));
    }
  }
  REQUIRE(move > 0);
  return err / move;
}

}  // namespace

TEST_CASE("cuda reduce_factored and apply_factored match host loops", "[cuda][factored]") {
  gradapt::cuda cb{};
  for (auto d : {std::array<std::int64_t, 5>{2, 5, 3, 7, 4}, std::array<std::int64_t, 5>{1, 300, 1, 1029, 1},
                 std::array<std::int64_t, 5>{1, 1, 1, 5000, 1}}) {
    const std::size_t A = std::size_t(d[0]), X = std::size_t(d[1]), B = std::size_t(d[2]),
                      Y = std::size_t(d[3]), C = std::size_t(d[4]);
    const auto x = exact_values(A * X * B * Y * C, 3);
    const auto rv = exact_values(A * X * B * C, 4);
    const auto cv = exact_values(A * B * Y * C, 5);
    std::vector<double> wy(rv.size(), 0), wx(cv.size(), 0), my(rv.size(), -INFINITY),
        mx(cv.size(), -INFINITY);
    std::vector<float> wyv(x.size());
    double wsum = 0;
    for_each_factored(d, [&](std::size_t e, std::size_t iy, std::size_t ix) {
      const double t = square_term{}(rv[iy], cv[ix], x[e]);
      wy[iy] += t;
      wx[ix] += t;
      my[iy] = std::max(my[iy], t);
      mx[ix] = std::max(mx[ix], t);
      wyv[e] = x[e] * rv[iy] * cv[ix];
      wsum += wyv[e];
    });
    auto dx = to_device(x);
    auto dr = to_device(rv);
    auto dc = to_device(cv);
    dvec<double> oy(wy.size()), ox(wx.size());
    cb.reduce_factored(square_term{}, d, cview(dr), cview(dc), cview(dx), view(oy), view(ox));
    REQUIRE(to_host(oy) == wy);
    REQUIRE(to_host(ox) == wx);
    cb.reduce_factored(square_term{}, d, cview(dr), cview(dc), cview(dx), view(oy), view(ox),
                       gradapt::reduce_op::max);
    REQUIRE(to_host(oy) == my);
    REQUIRE(to_host(ox) == mx);
    auto dy = to_device(x);
    const double s = cb.apply_factored(scale_rc{}, d, cview(dr), cview(dc), view(dy));
    REQUIRE(to_host(dy) == wyv);
    REQUIRE(s == wsum);
    // apply_factored_sum leaves the same sum in device memory (no host round trip).
    dvec<double> dsum(1, -1.0);
    auto dy2 = to_device(x);
    cb.apply_factored_sum(scale_rc{}, d, cview(dr), cview(dc), view(dsum), view(dy2));
    REQUIRE(to_host(dy2) == wyv);
    REQUIRE(to_host(dsum)[0] == wsum);
  }
  {
    dvec<double> dsum(1, -1.0);
    dvec<float> empty;
    cb.apply_factored_sum(scale_rc{}, {1, 0, 1, 0, 1}, tensor_view<const float, device_space>(),
                          tensor_view<const float, device_space>(), view(dsum), view(empty));
    REQUIRE(to_host(dsum)[0] == 0.0);
    dvec<double> none_sum;
    REQUIRE_THROWS_WITH(
        cb.apply_factored_sum(scale_rc{}, {1, 0, 1, 0, 1}, tensor_view<const float, device_space>(),
                              tensor_view<const float, device_space>(), view(none_sum), view(empty)),
        Catch::Matchers::Contains("sum view is empty"));
  }
  dvec<float> x(10);
  dvec<double> o(3);
  const tensor_view<const float, device_space> none;
  REQUIRE_THROWS_WITH(
      cb.reduce_factored(square_term{}, {1, 3, 1, 3, 1}, none, none, cview(x), view(o), view(o)),
      Catch::Matchers::Contains("hold 9 elements but the tensor has 10"));
}

TEST_CASE("cuda adafactor and sm3 follow the host backend", "[cuda][factored][optim]") {
  for (const auto& o : {gradapt::adafactor_options{}, gradapt::adafactor_options{.lr = 0.05, .momentum = 0.9},
                        gradapt::torch_adafactor_options(0.01, 1e-3, 0.1)}) {
    const double d = host_vs_device(gradapt::adafactor(o), 4);
    WARN("adafactor lr " << o.lr << ": device vs host " << d << " of the movement");
    REQUIRE(d <= 1e-4);
  }
  for (const auto& o : {gradapt::sm3_options{.lr = 0.1}, gradapt::sm3_options{.lr = 0.05, .momentum = 0.0}}) {
    const double d = host_vs_device(gradapt::sm3(o), 4);
    WARN("sm3 lr " << o.lr << ": device vs host " << d << " of the movement");
    REQUIRE(d <= 1e-4);
  }
}

TEST_CASE("cuda adafactor checkpoints continue bit for bit", "[cuda][factored][optim]") {
  auto h = mixed(7);
  twin_lists tw(h);
  auto &dp = tw.pa, &dp2 = tw.pb, &dg = tw.dg;
  auto &a = tw.a, &b = tw.b;
  gradapt::cuda cb{};
  gradapt::adafactor opt({.lr = 0.02, .momentum = 0.5});
  auto sa = opt.init(cb, a);
  for (int s = 1; s <= 2; ++s) {
    fill_grads(h, 9u * static_cast<unsigned>(s));
    for (std::size_t i = 0; i < h.size(); ++i) thrust::copy(h[i].g.begin(), h[i].g.end(), dg[i].begin());
    opt.step(cb, a, sa);
  }
  for (std::size_t i = 0; i < h.size(); ++i) dp2[i] = dp[i];
  auto sb = opt.init(cb, b);
  sb.load(cb, sa.save(cb));
  for (int s = 3; s <= 4; ++s) {
    fill_grads(h, 9u * static_cast<unsigned>(s));
    for (std::size_t i = 0; i < h.size(); ++i) thrust::copy(h[i].g.begin(), h[i].g.end(), dg[i].begin());
    opt.step(cb, a, sa);
    opt.step(cb, b, sb);
  }
  for (std::size_t i = 0; i < h.size(); ++i) {
    const auto x = to_host(dp[i]), y = to_host(dp2[i]);
    for (std::size_t k = 0; k < x.size(); ++k) REQUIRE(bits(x[k]) == bits(y[k]));
  }
  REQUIRE(sa.save(cb) == sb.save(cb));
}

namespace {

/// Steps `opt` once directly on list `a` and once through a CUDA graph captured from the
/// backend's stream on twin list `b` (same start, same gradients, same state): the capture
/// fails if the step synchronises with the host, copies to the host or allocates, and the
/// graph's launch must give the direct step's bits.
/// With `warm_up = false` the captured step is the first after init (which sizes the
/// backend's workspace).
template <class Opt>
void step_captures(const Opt& opt, std::vector<host_tensor> (*shapes)(unsigned) = mixed,
                   bool warm_up = true) {
  auto h = shapes(11);
  fill_grads(h, 5);
  twin_lists tw(h);
  auto &pa = tw.pa, &pb = tw.pb;
  auto &a = tw.a, &b = tw.b;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  gradapt::cuda cb{.stream = stream};
  auto sa = opt.init(cb, a);
  auto sb = opt.init(cb, b);
  if (warm_up) {
    opt.step(cb, a, sa);
    opt.step(cb, b, sb);
    cb.synchronize();
  }

  capture_and_launch(stream, [&] { opt.step(cb, b, sb); });  // before the direct step: see warm_up
  opt.step(cb, a, sa);
  for (std::size_t i = 0; i < h.size(); ++i) {
    const auto x = to_host(pa[i]), y = to_host(pb[i]);
    for (std::size_t k = 0; k < x.size(); ++k) REQUIRE(bits(x[k]) == bits(y[k]));
  }
  REQUIRE(sa.save(cb) == sb.save(cb));
  cudaStreamDestroy(stream);
}

}  // namespace

TEST_CASE("cuda adafactor and sm3 steps never wait for the host (they capture into a CUDA graph)",
          "[cuda][factored][optim]") {
  step_captures(gradapt::adafactor(gradapt::adafactor_options{}));
  step_captures(gradapt::adafactor(gradapt::adafactor_options{.lr = 0.05, .momentum = 0.9}));
  step_captures(gradapt::adafactor(gradapt::torch_adafactor_options(0.01, 1e-3, 0.1)));
  step_captures(gradapt::adafactor(gradapt::adafactor_options{.multiply_by_parameter_scale = false}));
  step_captures(gradapt::sm3(gradapt::sm3_options{.lr = 0.1}));
  // The first step after init captures too: init sizes the workspace.
  step_captures(gradapt::adafactor(gradapt::adafactor_options{}), mixed, false);
  step_captures(gradapt::adafactor(), mixed, false);
  step_captures(gradapt::sm3(gradapt::sm3_options{.lr = 0.1}), mixed, false);
}

// ---- adafactor's state buffers, checkpoints and graphs over more option sets --------------------

namespace {

/// A chain state's buffers in host memory: [buffer j][tensor t] (inactive stages' are empty).
template <class St>
std::vector<std::vector<std::vector<float>>> chain_buffers(const St& st) {
  std::vector<std::vector<std::vector<float>>> out(St::buffer_count());
  for (std::size_t j = 0; j < St::buffer_count(); ++j)
    for (const auto& v : st.buffer(j)) {
      std::vector<float> h(static_cast<std::size_t>(v.size()));
      if constexpr (std::is_same_v<typename St::space, device_space>) {
        if (!h.empty())
          REQUIRE(cudaMemcpy(h.data(), v.data(), v.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
      } else {
        std::copy(v.data(), v.data() + v.size(), h.begin());
      }
      out[j].push_back(std::move(h));
    }
  return out;
}

/// host_vs_device's check for chains: the host and device states have the same layout (step
/// count, active stages, which tensors are factored, buffer sizes) and every buffer of every
/// tensor agrees within `tol` of that tensor's largest host magnitude; the worst ratio seen
/// goes to `*worst`.
struct chain_states_agree {
  double tol;
  double* worst;
  template <class HS, class DS>
  void operator()(const HS& hs, const DS& ds) const {
    REQUIRE(hs.steps() == ds.steps());
    REQUIRE(hs.active_stages() == ds.active_stages());
    REQUIRE(hs.tensors() == ds.tensors());
    REQUIRE(hs.state_elements() == ds.state_elements());
    for (std::size_t t = 0; t < hs.tensors(); ++t) REQUIRE(hs.factored(t) == ds.factored(t));
    const auto h = chain_buffers(hs), d = chain_buffers(ds);
    for (std::size_t j = 0; j < h.size(); ++j) {
      REQUIRE(h[j].size() == d[j].size());
      for (std::size_t t = 0; t < h[j].size(); ++t) {
        INFO("state buffer " << j << ", tensor " << t);
        REQUIRE(h[j][t].size() == d[j][t].size());
        double top = 0, err = 0;
        for (std::size_t k = 0; k < h[j][t].size(); ++k) {
          REQUIRE(std::isfinite(d[j][t][k]));
          top = std::max(top, std::fabs(double(h[j][t][k])));
          err = std::max(err, std::fabs(double(h[j][t][k]) - double(d[j][t][k])));
        }
        REQUIRE(err <= tol * top);
        if (top > 0) *worst = std::max(*worst, err / top);
      }
    }
  }
};

struct named_options {
  const char* name;
  gradapt::adafactor_options o;
};

/// Option sets that switch the chain's stages differently: optax's defaults (clipping, the
/// parameter scale), momentum with weight decay, torch's form (relative step, last-two
/// factoring of every matrix, the eps clamp, lr-coupled decay), and strong clipping without
/// the parameter scale over more factored tensors.
std::vector<named_options> chain_option_sets() {
  return {{"optax defaults", {}},
          {"lr 0.05, momentum 0.9, weight decay 1e-3", {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}},
          {"torch form", gradapt::torch_adafactor_options(0.01, 1e-3, 0.1)},
          {"clipping 0.3, min dim 16, no parameter scale",
           {.lr = 0.02,
            .min_dim_size_to_factor = 16,
            .clipping_threshold = 0.3,
            .multiply_by_parameter_scale = false}}};
}

}  // namespace

TEST_CASE("cuda adafactor (chain state) follows the host backend", "[cuda][factored][optim][chain]") {
  for (const auto& [name, o] : chain_option_sets()) {
    INFO(name);
    double state = 0;
    const double d =
        host_vs_device(gradapt::adafactor(o), 4, mixed_with_empty, chain_states_agree{1e-4, &state});
    WARN("adafactor, " << name << ": device vs host " << d << " of the movement, state buffers " << state
                       << " of their largest element");
    REQUIRE(d <= 1e-4);
  }
}

namespace {

/// Trains chain `opt` two steps on the device, saves its state, restores it into a fresh state
/// for twin parameters and steps both twice more: the same bits (parameters and checkpoint).
/// A third list continues from the same parameters with a fresh state (what a lost checkpoint
/// gives): it must differ, or the comparison proves nothing.
template <class Opt>
void chain_checkpoint_continues(const Opt& opt) {
  auto h = mixed_with_empty(7);
  std::vector<dvec<float>> dp, dg, dp2, dp3;
  for (auto& t : h) {
    dp.push_back(to_device(t.p));
    dp2.push_back(to_device(t.p));
    dp3.push_back(to_device(t.p));
    dg.push_back(to_device(t.g));
  }
  // a: trained throughout; b: restored from a's checkpoint; c: a fresh state from a's parameters.
  gradapt::param_list<float, float, device_space> a, b, c;
  for (std::size_t i = 0; i < h.size(); ++i) {
    const auto shp = std::span<const std::int64_t>(h[i].shape);
    const auto gv = tensor_view<float, device_space>(thrust::raw_pointer_cast(dg[i].data()), shp);
    a.add(h[i].name, tensor_view<float, device_space>(thrust::raw_pointer_cast(dp[i].data()), shp), gv);
    b.add(h[i].name, tensor_view<float, device_space>(thrust::raw_pointer_cast(dp2[i].data()), shp), gv);
    c.add(h[i].name, tensor_view<float, device_space>(thrust::raw_pointer_cast(dp3[i].data()), shp), gv);
  }
  gradapt::cuda cb{};
  auto sa = opt.init(cb, a);
  for (int s = 1; s <= 2; ++s) {
    fill_grads(h, 9u * static_cast<unsigned>(s));
    for (std::size_t i = 0; i < h.size(); ++i) thrust::copy(h[i].g.begin(), h[i].g.end(), dg[i].begin());
    opt.step(cb, a, sa);
  }
  for (std::size_t i = 0; i < h.size(); ++i) {
    dp2[i] = dp[i];
    dp3[i] = dp[i];
  }
  auto sb = opt.init(cb, b);
  sb.load(cb, sa.save(cb));
  REQUIRE(sb.steps() == 2);
  auto sc = opt.init(cb, c);
  for (int s = 3; s <= 4; ++s) {
    fill_grads(h, 9u * static_cast<unsigned>(s));
    for (std::size_t i = 0; i < h.size(); ++i) thrust::copy(h[i].g.begin(), h[i].g.end(), dg[i].begin());
    opt.step(cb, a, sa);
    opt.step(cb, b, sb);
    opt.step(cb, c, sc);
  }
  std::size_t fresh_differs = 0;
  for (std::size_t i = 0; i < h.size(); ++i) {
    const auto x = to_host(dp[i]), y = to_host(dp2[i]), z = to_host(dp3[i]);
    for (std::size_t k = 0; k < x.size(); ++k) {
      REQUIRE(bits(x[k]) == bits(y[k]));
      fresh_differs += bits(x[k]) != bits(z[k]) ? 1 : 0;
    }
  }
  REQUIRE(fresh_differs > 0);
  REQUIRE(sa.save(cb) == sb.save(cb));
}

}  // namespace

TEST_CASE("cuda adafactor (chain state) checkpoints continue bit for bit", "[cuda][factored][optim][chain]") {
  chain_checkpoint_continues(gradapt::adafactor({.lr = 0.02, .momentum = 0.5, .weight_decay = 1e-3}));
}

TEST_CASE("cuda adafactor (chain state) steps never wait for the host (they capture into a CUDA graph)",
          "[cuda][factored][optim][chain]") {
  for (const auto& [name, o] : chain_option_sets()) {
    INFO(name);
    step_captures(gradapt::adafactor(o), mixed_with_empty);
  }
  // No barrier at all (clipping and the parameter scale off): one pass per tensor.
  INFO("no clipping, no parameter scale");
  step_captures(gradapt::adafactor({.clipping_threshold = std::numeric_limits<double>::infinity(),
                                    .multiply_by_parameter_scale = false}),
                mixed_with_empty);
}

// ---- sm3: scale_by_sm3 → ema → scale_by_learning_rate ---------------------------------------------

namespace {

struct named_sm3_options {
  const char* name;
  gradapt::sm3_options o;
};

/// The option sets of the host's sm3 test: defaults (momentum 0.9, b2 = 1), no momentum
/// (the ema stage off), and b2 = 0.9 with a large eps (the weighted accumulator).
std::vector<named_sm3_options> sm3_option_sets() {
  return {{"defaults (momentum 0.9)", {}},
          {"lr 0.1, momentum 0", {.lr = 0.1, .momentum = 0.0}},
          {"lr 0.05, momentum 0.5, b2 0.9, eps 1e-4", {.lr = 0.05, .momentum = 0.5, .b2 = 0.9, .eps = 1e-4}}};
}

}  // namespace

TEST_CASE("cuda sm3 (chain state) follows the host backend", "[cuda][factored][optim][chain]") {
  for (const auto& [name, o] : sm3_option_sets()) {
    INFO(name);
    double state = 0;
    const double d = host_vs_device(gradapt::sm3(o), 4, mixed_with_empty, chain_states_agree{1e-4, &state});
    WARN("sm3, " << name << ": device vs host " << d << " of the movement, state buffers " << state
                 << " of their largest element");
    REQUIRE(d <= 1e-4);
  }
}

TEST_CASE("cuda sm3 (chain state) checkpoints continue bit for bit", "[cuda][factored][optim][chain]") {
  for (const auto& [name, o] : sm3_option_sets()) {
    INFO(name);
    chain_checkpoint_continues(gradapt::sm3(o));
  }
}

TEST_CASE("cuda sm3 (chain state) steps never wait for the host (they capture into a CUDA graph)",
          "[cuda][factored][optim][chain]") {
  for (const auto& [name, o] : sm3_option_sets()) {
    INFO(name);
    step_captures(gradapt::sm3(o), mixed_with_empty);
  }
}

}  // namespace gradapt_test_cuda_factored

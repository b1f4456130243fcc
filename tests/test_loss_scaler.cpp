// Dynamic loss scaling (precision/loss_scaler.hpp).
//
// References:
//  - PyTorch torch.amp.GradScaler: scale sequences over scripted overflow patterns, and the
//    fused unscale kernel's output bits for float32 / float16 / bfloat16 (tests/data/loss_scaler,
//    written by tests/data/make_loss_scaler_refs.py);
//  - DeepSpeed's DynamicLossScaler: the hysteresis semantics, step by step, and the step at
//    which it refuses to back off below min_scale (same data directory);
//  - closed forms: power-of-two unscaling is exact (ldexp), and whether a product is
//    non-finite once stored is checked against the element type's own conversion for every
//    16-bit pattern.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/gradapt.hpp"
#include "gradapt/precision/loss_scaler.hpp"
#include "peer_data.hpp"
#include "rank_check.hpp"
#include "scenarios/loss_scaler.hpp"

using Catch::Matchers::Contains;
using gradapt::bfloat16;
using gradapt::half;
using gradapt::host_space;
using gradapt::loss_scaler;
using gradapt::loss_scaler_options;
using gradapt::tensor_view;

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_loss_scaler {

namespace {

constexpr double flt_max = static_cast<double>(std::numeric_limits<float>::max());
constexpr double flt_min = static_cast<double>(std::numeric_limits<float>::min());

std::string data_path(const std::string& name) { return gradapt_test::test_data_path("loss_scaler/" + name); }

std::ifstream open_data(const std::string& name) {
  std::ifstream f(data_path(name));
  if (!f)
    FAIL("cannot open " << data_path(name) << " (run from the repository or set GRADAPT_TEST_DATA_DIR)");
  return f;
}

double hex_double(const std::string& s) { return std::strtod(s.c_str(), nullptr); }

template <class T>
T from_bits(unsigned long b) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<float>(static_cast<std::uint32_t>(b));
  else
    return T::from_bits(static_cast<std::uint16_t>(b));
}

template <class T>
std::uint32_t to_bits(T v) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(v);
  else
    return v.bits;
}

template <class T>
bool finite(T v) {
  return std::isfinite(static_cast<float>(v));
}

using exact::make;

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, half>) return "float16";
  if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  return "float64";
}

/// A backend that forwards to the host backend but has no apply_reduce_list: exercises the
/// flag form of the pass that backends without a fused apply + reduce (CUDA) take.
struct host_unfused {
  using space = host_space;
  gradapt::host h;
  template <class F, class... Ts>
  void apply(F f, tensor_view<Ts, space>... v) const {
    h.apply(f, v...);
  }
  template <class F, class... Ls>
  requires(gradapt::view_list<Ls, space>&&...) void apply_list(F f, const Ls&... ls) const {
    h.apply_list(f, ls...);
  }
  template <class T>
  double reduce(gradapt::reduction op, tensor_view<T, space> x) const {
    return h.reduce(op, x);
  }
  template <class L>
  requires gradapt::view_list<L, space>
  double reduce(gradapt::reduction op, const L& xs, std::span<double> out) const {
    return h.reduce(op, xs, out);
  }
  template <class T, class U>
  double dot(tensor_view<T, space> x, tensor_view<U, space> y) const {
    return h.dot(x, y);
  }
  template <class L1, class L2>
  requires gradapt::view_list<L1, space> && gradapt::view_list<L2, space>
  double dot(const L1& x, const L2& y, std::span<double> out) const { return h.dot(x, y, out); }
  void synchronize() const {}
};
static_assert(gradapt::backend<host_unfused>);
static_assert(!gradapt::detail::loss_scale::fused_apply_reduce<
              host_unfused, gradapt::detail::loss_scale::unscale_count_inplace<float>,
              std::vector<tensor_view<float>>>);
static_assert(gradapt::detail::loss_scale::fused_apply_reduce<
              gradapt::host, gradapt::detail::loss_scale::unscale_count_inplace<float>,
              std::vector<tensor_view<float>>>);

/// One flat buffer cut into tensors of the given sizes (empty ones included).
template <class T>
struct flat_list {
  std::vector<T> data;
  std::vector<std::size_t> offsets;
  std::vector<tensor_view<T>> views;
  flat_list(std::vector<T> values, const std::vector<std::size_t>& sizes) : data(std::move(values)) {
    std::size_t off = 0;
    for (std::size_t s : sizes) {
      offsets.push_back(off);
      views.push_back(tensor_view<T>::vector(data.data() + off, static_cast<std::int64_t>(s)));
      off += s;
    }
    REQUIRE(off == data.size());
  }
};

/// Sizes summing to n, with empty tensors, singletons and tensors of 7, 8 and 97 elements.
std::vector<std::size_t> mixed_sizes(std::size_t n) {
  std::vector<std::size_t> s = {1, 0, 7, 8, 0, 97, 1, 300, 0};
  std::size_t used = 0;
  for (auto v : s) used += v;
  REQUIRE(used < n);
  s.push_back(n - used);
  return s;
}

struct torch_unscale_ref {
  double scale = 0;
  float inv = 0;
  int found_inf = 0;
  std::vector<unsigned long> in, out;
};

torch_unscale_ref read_unscale(const std::string& name) {
  auto f = open_data(name);
  torch_unscale_ref r;
  std::string k1, scale, k2, inv, k3, k4;
  std::size_t n = 0;
  f >> k1 >> scale >> k2 >> inv >> k3 >> r.found_inf >> k4 >> n;
  REQUIRE(k1 == "scale");
  r.scale = hex_double(scale);
  r.inv = std::bit_cast<float>(static_cast<std::uint32_t>(std::stoul(inv, nullptr, 16)));
  for (std::size_t i = 0; i < n; ++i) {
    std::string a, b;
    f >> a >> b;
    r.in.push_back(std::stoul(a, nullptr, 16));
    r.out.push_back(std::stoul(b, nullptr, 16));
  }
  REQUIRE(r.in.size() == n);
  return r;
}

loss_scaler_options wide(loss_scaler_options o) {
  o.min_scale = flt_min;
  o.max_scale = flt_max;
  return o;
}

using loss_scaler_scenario::same_state;

}  // namespace

// ---- the policy against PyTorch and DeepSpeed ---------------------------------------------------

TEST_CASE("loss_scaler: scale sequence equals torch.amp.GradScaler over scripted overflows",
          "[loss_scaler][torch]") {
  auto f = open_data("torch_scale.txt");
  std::string tag;
  int configs = 0;
  const gradapt::host backend{.threads = 1};
  gradapt::comm::single comm;
  while (f >> tag) {
    REQUIRE(tag == "config");
    std::string name, init, growth, backoff, max_scale;
    std::int64_t interval = 0;
    int steps = 0;
    f >> name >> init >> growth >> backoff >> interval >> max_scale >> steps;
    loss_scaler_options o{.init_scale = hex_double(init),
                          .growth_factor = hex_double(growth),
                          .backoff_factor = hex_double(backoff),
                          .growth_interval = interval};
    o = wide(o);
    o.max_scale = hex_double(max_scale);
    loss_scaler scaler(o);
    for (int k = 0; k < steps; ++k) {
      std::string st, scale_after;
      int i = 0, bad = 0, stepped = 0;
      std::int64_t tracker = 0;
      f >> st >> i >> bad >> stepped >> scale_after >> tracker;
      REQUIRE(st == "step");
      // The gradient the script fed PyTorch: 0.25 S everywhere, element i % 5 NaN or inf.
      std::vector<float> g(5, static_cast<float>(0.25 * scaler.scale()));
      if (bad) g[static_cast<std::size_t>(i % 5)] = i % 3 == 0 ? NAN : INFINITY;
      const std::vector<tensor_view<float>> grads{gradapt::host_view(g)};
      const bool step = scaler.unscale(backend, comm, grads);
      INFO(name << " step " << i << ": scale " << scaler.scale() << " vs torch " << hex_double(scale_after));
      REQUIRE(step == (stepped == 1));
      REQUIRE(std::bit_cast<std::uint64_t>(scaler.scale()) ==
              std::bit_cast<std::uint64_t>(hex_double(scale_after)));
      REQUIRE(scaler.state().growth_tracker == tracker);
      if (step) REQUIRE(std::fabs(g[0] - 0.25f) <= 1e-7f);  // unscaled: 0.25 S / S (exact for powers of two)
    }
    ++configs;
  }
  REQUIRE(configs == 4);
}

TEST_CASE("loss_scaler: hysteresis equals DeepSpeed's DynamicLossScaler", "[loss_scaler][deepspeed]") {
  auto f = open_data("deepspeed_hysteresis.txt");
  std::string line;
  std::getline(f, line);  // "# deepspeed <version>"
  std::string tag;
  int configs = 0;
  while (f >> tag) {
    REQUIRE(tag == "config");
    std::string name, init, min_scale;
    std::int64_t window = 0;
    int h = 0, consecutive = 0, steps = 0;
    f >> name >> init >> window >> min_scale >> h >> consecutive >> steps;
    loss_scaler scaler({.init_scale = hex_double(init),
                        .growth_interval = window,
                        .hysteresis = h,
                        .consecutive_hysteresis = consecutive == 1,
                        .min_scale = hex_double(min_scale),
                        .max_scale = flt_max});
    int compared = 0, raised = 0;
    for (int k = 0; k < steps; ++k) {
      std::string st, scale_after;
      int i = 0, bad = 0, hyst = 0, raise = 0, cmp = 0;
      f >> st >> i >> bad >> scale_after >> hyst >> raise >> cmp;
      REQUIRE(st == "step");
      INFO(name << " step " << i << " overflow " << bad);
      if (raise) {
        const auto before = scaler.state();
        REQUIRE_THROWS_WITH(static_cast<void>(scaler.update(bad == 1)),
                            Contains("minimum loss scale") && Contains("min_scale"));
        REQUIRE(same_state(scaler.state(), before));  // a throw changes nothing
        ++raised;
        continue;
      }
      REQUIRE(scaler.update(bad == 1) == (bad == 0));
      if (cmp) {
        INFO("scale " << scaler.scale() << " vs " << hex_double(scale_after) << ", hysteresis "
                      << scaler.state().hysteresis_left << " vs " << hyst);
        REQUIRE(scaler.scale() == hex_double(scale_after));
        REQUIRE(scaler.state().hysteresis_left == hyst);
        ++compared;
      }
    }
    REQUIRE(compared > 5);
    if (name == "h2") REQUIRE(raised == 1);
    ++configs;
  }
  REQUIRE(configs == 4);
}

TEST_CASE("loss_scaler: hysteresis H tolerates H-1 overflows, then backs off on each", "[loss_scaler]") {
  // Closed form of the rule for one long overflow burst after a clean start.
  for (int h : {1, 2, 3, 5}) {
    loss_scaler s({.init_scale = 1024, .growth_interval = 100, .hysteresis = h, .min_scale = 1});
    for (int k = 1; k <= 8; ++k) {
      REQUIRE_FALSE(s.update(true));
      const int backoffs = std::max(0, k - (h - 1));
      INFO("H " << h << ", overflow " << k);
      REQUIRE(s.scale() == std::ldexp(1024.0, -backoffs));
      REQUIRE(s.state().hysteresis_left == std::max(1, h - k));
      REQUIRE(s.skipped() == static_cast<std::uint64_t>(k));
      REQUIRE(s.backoffs() == static_cast<std::uint64_t>(backoffs));
    }
  }
  // Without consecutive refills, clean steps between overflows do not restore the budget...
  loss_scaler a({.init_scale = 1024, .growth_interval = 100, .hysteresis = 3});
  REQUIRE_FALSE(a.update(true));
  REQUIRE(a.update(false));
  REQUIRE_FALSE(a.update(true));
  REQUIRE(a.scale() == 1024);
  REQUIRE_FALSE(a.update(true));
  REQUIRE(a.scale() == 512);
  // ...with them, they do.
  loss_scaler b(
      {.init_scale = 1024, .growth_interval = 100, .hysteresis = 3, .consecutive_hysteresis = true});
  for (int k = 0; k < 10; ++k) {
    REQUIRE_FALSE(b.update(true));
    REQUIRE_FALSE(b.update(true));
    REQUIRE(b.update(false));
  }
  REQUIRE(b.scale() == 1024);
  REQUIRE(b.backoffs() == 0);
}

TEST_CASE("loss_scaler: growth after growth_interval clean steps; overflows restart the count",
          "[loss_scaler]") {
  loss_scaler s({.init_scale = 256, .growth_interval = 4});
  for (int k = 1; k <= 12; ++k) {
    REQUIRE(s.update(false));
    REQUIRE(s.scale() == std::ldexp(256.0, k / 4));
  }
  for (int k = 0; k < 3; ++k) REQUIRE(s.update(false));
  REQUIRE_FALSE(s.update(true));  // the 4th step overflows: no growth, and the count restarts
  REQUIRE(s.scale() == 1024);
  for (int k = 0; k < 3; ++k) REQUIRE(s.update(false));
  REQUIRE(s.scale() == 1024);
  REQUIRE(s.update(false));
  REQUIRE(s.scale() == 2048);
  REQUIRE(s.growths() == 4);
  REQUIRE(s.steps() == 20);
}

TEST_CASE("loss_scaler: an overflow at min_scale throws and changes nothing", "[loss_scaler]") {
  loss_scaler s({.init_scale = 4096, .min_scale = 1024});
  REQUIRE_FALSE(s.update(true));
  REQUIRE_FALSE(s.update(true));
  REQUIRE(s.scale() == 1024);
  const auto before = s.state();
  REQUIRE_THROWS_WITH(static_cast<void>(s.update(true)), Contains("minimum loss scale 1024") &&
                                                             Contains("lower min_scale") &&
                                                             Contains("step 3"));
  REQUIRE(same_state(s.state(), before));
  // A clean step afterwards proceeds normally.
  REQUIRE(s.update(false));
  // Back-off is clamped at min_scale when it would jump below it, then the next overflow throws.
  loss_scaler c({.init_scale = 1000, .min_scale = 300});
  REQUIRE_FALSE(c.update(true));
  REQUIRE(c.scale() == 500);
  REQUIRE_FALSE(c.update(true));
  REQUIRE(c.scale() == 300);
  REQUIRE_THROWS_WITH(static_cast<void>(c.update(true)), Contains("minimum loss scale 300"));
  // With hysteresis the tolerated overflow at min_scale does not throw (DeepSpeed's rule).
  loss_scaler h({.init_scale = 1, .hysteresis = 2, .min_scale = 1});
  REQUIRE_FALSE(h.update(true));
  REQUIRE_THROWS_WITH(static_cast<void>(h.update(true)), Contains("minimum loss scale"));
}

TEST_CASE("loss_scaler: growth is capped at max_scale and never reaches inf", "[loss_scaler]") {
  loss_scaler s({.init_scale = 1 << 18, .growth_factor = 3, .growth_interval = 1, .max_scale = 1 << 20});
  REQUIRE(s.update(false));
  REQUIRE(s.scale() == 786432);  // 3 * 2^18
  REQUIRE(s.update(false));
  REQUIRE(s.scale() == 1 << 20);  // 3 * 786432 > 2^20: capped
  REQUIRE(s.update(false));
  REQUIRE(s.scale() == 1 << 20);
  // At the top of float: 2^126 * 4 is inf in float; the cap is the largest finite float.
  loss_scaler t(
      {.init_scale = std::ldexp(1.0, 126), .growth_factor = 4, .growth_interval = 1, .max_scale = flt_max});
  for (int k = 0; k < 5; ++k) {
    REQUIRE(t.update(false));
    REQUIRE(t.scale() == flt_max);
    REQUIRE(std::isfinite(t.inv_scale()));
    REQUIRE(t.inv_scale() > 0.0f);
  }
}

TEST_CASE("loss_scaler: options are validated with actionable messages", "[loss_scaler]") {
  REQUIRE_THROWS_WITH(loss_scaler({.growth_factor = 1.0}), Contains("growth_factor is 1"));
  REQUIRE_THROWS_WITH(loss_scaler({.growth_factor = NAN}), Contains("growth_factor"));
  REQUIRE_THROWS_WITH(loss_scaler({.backoff_factor = 1.0}), Contains("backoff_factor is 1"));
  REQUIRE_THROWS_WITH(loss_scaler({.backoff_factor = 0.0}), Contains("backoff_factor"));
  REQUIRE_THROWS_WITH(loss_scaler({.growth_interval = 0}), Contains("growth_interval is 0"));
  REQUIRE_THROWS_WITH(loss_scaler({.hysteresis = 0}), Contains("hysteresis is 0"));
  REQUIRE_THROWS_WITH(loss_scaler({.min_scale = 0}), Contains("min_scale is 0"));
  REQUIRE_THROWS_WITH(loss_scaler({.max_scale = INFINITY}), Contains("max_scale is inf"));
  REQUIRE_THROWS_WITH(loss_scaler({.max_scale = 1e39}), Contains("max_scale"));
  REQUIRE_THROWS_WITH(loss_scaler({.min_scale = 8, .max_scale = 4}), Contains("exceeds max_scale"));
  REQUIRE_THROWS_WITH(loss_scaler({.init_scale = 1 << 25}), Contains("init_scale is 3.35544e+07"));
  REQUIRE_THROWS_WITH(loss_scaler({.init_scale = 0.5}), Contains("init_scale is 0.5"));
  // Values are kept in float precision (documented): 0.1 becomes float(0.1).
  const loss_scaler s({.init_scale = 1000.1, .min_scale = 0.1});
  REQUIRE(s.scale() == static_cast<double>(1000.1f));
  REQUIRE(s.options().min_scale == static_cast<double>(0.1f));
  REQUIRE(s.inv_scale() == static_cast<float>(1.0 / static_cast<double>(1000.1f)));
}

TEST_CASE("loss_scaler: save/load round trip continues bit-identically", "[loss_scaler][state]") {
  const loss_scaler_options o{.init_scale = 3000,
                              .growth_factor = 1.5,
                              .backoff_factor = 0.4,
                              .growth_interval = 5,
                              .hysteresis = 3,
                              .min_scale = 1e-30};
  const auto pattern = [](int k) { return (k * 7919 % 13) < 3; };  // about 23% overflows
  loss_scaler ref(o);
  for (int k = 0; k < 97; ++k) static_cast<void>(ref.update(pattern(k)));
  const auto saved = ref.state();
  REQUIRE(saved.skipped > 0);
  loss_scaler resumed(o);
  resumed.restore(saved);
  REQUIRE(same_state(resumed.state(), saved));
  for (int k = 97; k < 300; ++k) {
    REQUIRE(ref.update(pattern(k)) == resumed.update(pattern(k)));
    REQUIRE(same_state(ref.state(), resumed.state()));
  }
  // States that do not fit the options are refused.
  auto bad = saved;
  bad.growth_tracker = 5;
  REQUIRE_THROWS_WITH(resumed.restore(bad), Contains("growth_tracker 5"));
  bad = saved;
  bad.hysteresis_left = 4;
  REQUIRE_THROWS_WITH(resumed.restore(bad), Contains("hysteresis_left 4"));
  bad = saved;
  bad.scale = 0.1;  // not a float value
  REQUIRE_THROWS_WITH(resumed.restore(bad), Contains("not a float value"));
  bad = saved;
  bad.skipped = bad.steps + 1;
  REQUIRE_THROWS_WITH(resumed.restore(bad), Contains("inconsistent counters"));
}

// ---- the fused pass against PyTorch's kernel -----------------------------------------------------

TEMPLATE_TEST_CASE(
    "unscale: fused pass equals torch's _amp_foreach_non_finite_check_and_unscale_ bit for bit",
    "[loss_scaler][unscale][torch]", float, half, bfloat16) {
  for (const char* tag : {"s3000", "s65536", "small"}) {
    const auto ref = read_unscale(std::string("torch_unscale_") + type_name<TestType>() + "_" + tag + ".txt");
    std::vector<TestType> in;
    for (auto b : ref.in) in.push_back(from_bits<TestType>(b));
    REQUIRE(static_cast<float>(1.0 / ref.scale) == ref.inv);  // GradScaler's float(1 / double(S))
    // Independent count: elements of PyTorch's output that are not finite (PyTorch itself
    // only flags non-finite inputs: with 1/S > 1, "small", products also overflow).
    std::size_t torch_nonfinite = 0, input_nonfinite = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      torch_nonfinite += !finite(from_bits<TestType>(ref.out[i]));
      input_nonfinite += !finite(in[i]);
    }
    REQUIRE((input_nonfinite > 0) == (ref.found_inf == 1));
    for (int threads : {1, 2}) {
      const auto sizes = mixed_sizes(in.size());
      // Fused pass (apply_reduce_list) with per-tensor counts.
      flat_list<TestType> fused(in, sizes);
      std::vector<double> per(sizes.size(), -1.0);
      const double count = gradapt::unscale_count_nonfinite(gradapt::host{.threads = threads}, fused.views,
                                                            ref.inv, std::span<double>(per));
      // Flag form (backends without the fused operation).
      flat_list<TestType> flagged(in, sizes);
      float flag = 0.0f;
      gradapt::unscale_flag_nonfinite(host_unfused{{.threads = threads}}, flagged.views, ref.inv,
                                      tensor_view<float>::scalar(&flag));
      INFO(type_name<TestType>() << " " << tag << ", " << threads << " thread(s)");
      for (std::size_t i = 0; i < in.size(); ++i) {
        INFO("element " << i << ": in " << std::hex << ref.in[i] << " torch " << ref.out[i] << " gradapt "
                        << to_bits(fused.data[i]));
        if (std::isnan(static_cast<float>(from_bits<TestType>(ref.out[i])))) {
          // NaN bits are not part of either contract: PyTorch's vectorised bfloat16 store
          // writes 0xffff for every NaN, its scalar store 0x7fc0. Both must be NaN.
          REQUIRE(std::isnan(static_cast<float>(fused.data[i])));
          REQUIRE(std::isnan(static_cast<float>(flagged.data[i])));
        } else {
          REQUIRE(to_bits(fused.data[i]) == ref.out[i]);
          REQUIRE(to_bits(flagged.data[i]) == ref.out[i]);
        }
      }
      REQUIRE(count == static_cast<double>(torch_nonfinite));
      REQUIRE(flag == (torch_nonfinite > 0 ? 1.0f : 0.0f));
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        std::size_t c = 0;
        for (std::size_t i = fused.offsets[t]; i < fused.offsets[t] + sizes[t]; ++i)
          c += !finite(from_bits<TestType>(ref.out[i]));
        REQUIRE(per[t] == static_cast<double>(c));
      }
    }
  }
}

TEMPLATE_TEST_CASE("unscale: 16-bit gradients into fp32 master buffers equal torch bit for bit",
                   "[loss_scaler][unscale][torch]", half, bfloat16) {
  const auto ref = read_unscale(std::string("torch_unscale_master_") + type_name<TestType>() + ".txt");
  std::vector<TestType> in;
  for (auto b : ref.in) in.push_back(from_bits<TestType>(b));
  const auto sizes = mixed_sizes(in.size());
  std::size_t torch_nonfinite = 0;
  for (auto b : ref.out)
    torch_nonfinite += !std::isfinite(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
  for (int threads : {1, 2}) {
    flat_list<TestType> grads(in, sizes);
    flat_list<float> master(std::vector<float>(in.size(), -7.0f), sizes);
    std::vector<double> per(sizes.size());
    const double count = gradapt::unscale_count_nonfinite(gradapt::host{.threads = threads}, grads.views,
                                                          master.views, ref.inv, std::span<double>(per));
    flat_list<float> master2(std::vector<float>(in.size(), -7.0f), sizes);
    float flag = 0.0f;
    gradapt::unscale_flag_nonfinite(host_unfused{{.threads = threads}}, grads.views, master2.views, ref.inv,
                                    tensor_view<float>::scalar(&flag));
    for (std::size_t i = 0; i < in.size(); ++i) {
      INFO("element " << i);
      REQUIRE(std::bit_cast<std::uint32_t>(master.data[i]) == ref.out[i]);
      REQUIRE(std::bit_cast<std::uint32_t>(master2.data[i]) == ref.out[i]);
      REQUIRE(to_bits(grads.data[i]) == ref.in[i]);  // gradients only read
    }
    REQUIRE(count == static_cast<double>(torch_nonfinite));
    REQUIRE(flag == (torch_nonfinite > 0 ? 1.0f : 0.0f));
  }
}

// ---- injected non-finite values, boundaries, the threaded path --------------------------------

TEMPLATE_TEST_CASE("unscale: one injected inf/NaN anywhere is found once, everything else is exact",
                   "[loss_scaler][unscale]", float, half, bfloat16) {
  // Tensors: empty ones, singletons, a block boundary and one above the threaded-path size.
  const std::vector<std::size_t> sizes = {0, 1, 5, 0, 8, 9, 4099, 0, 131089, 3};
  std::size_t n = 0;
  for (auto s : sizes) n += s;
  std::vector<TestType> base(n);
  for (std::size_t i = 0; i < n; ++i)
    base[i] = make<TestType>(static_cast<double>(static_cast<int>(i % 61) - 30) / 8.0);
  // Every tensor's first and last element, plus the middle of the large one.
  std::vector<std::size_t> positions;
  std::size_t off = 0;
  for (auto s : sizes) {
    if (s) positions.push_back(off), positions.push_back(off + s - 1);
    off += s;
  }
  positions.push_back(14 + 4099 + 65536);
  const float inv = 0x1p-10f;  // power of two: every unscaled finite value is exact (ldexp)
  const gradapt::host host2{.threads = 2};
  for (std::size_t pos : positions) {
    for (double bad :
         {static_cast<double>(INFINITY), -static_cast<double>(INFINITY), static_cast<double>(NAN)}) {
      flat_list<TestType> g(base, sizes);
      g.data[pos] = make<TestType>(bad);
      std::vector<double> per(sizes.size());
      const double count = gradapt::unscale_count_nonfinite(host2, g.views, inv, std::span<double>(per));
      INFO("position " << pos << ", value " << bad);
      REQUIRE(count == 1.0);
      std::size_t t = 0;
      while (!(pos >= g.offsets[t] && pos < g.offsets[t] + sizes[t])) ++t;
      REQUIRE(per[t] == 1.0);
      REQUIRE_FALSE(finite(g.data[pos]));
      if (std::isinf(bad)) REQUIRE((static_cast<float>(g.data[pos]) > 0) == (bad > 0));
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i)
        if (i != pos)
          wrong += static_cast<double>(static_cast<float>(g.data[i])) !=
                   std::ldexp(static_cast<double>(static_cast<float>(base[i])), -10);
      REQUIRE(wrong == 0);
      flat_list<TestType> h(base, sizes);
      h.data[pos] = make<TestType>(bad);
      float flag = 0.0f;
      gradapt::unscale_flag_nonfinite(host_unfused{{.threads = 2}}, h.views, inv,
                                      tensor_view<float>::scalar(&flag));
      REQUIRE(flag == 1.0f);
    }
  }
  // Clean list, and an empty list.
  flat_list<TestType> clean(base, sizes);
  REQUIRE(gradapt::unscale_count_nonfinite(host2, clean.views, inv) == 0.0);
  const std::vector<tensor_view<TestType>> none;
  REQUIRE(gradapt::unscale_count_nonfinite(host2, none, inv) == 0.0);
  float flag = 0.0f;
  gradapt::unscale_flag_nonfinite(host_unfused{}, none, inv, tensor_view<float>::scalar(&flag));
  REQUIRE(flag == 0.0f);
}

TEMPLATE_TEST_CASE("unscale: the non-finite test agrees with the element type's own rounding, every pattern",
                   "[loss_scaler][unscale]", half, bfloat16) {
  // For every 16-bit pattern x and several factors: flagged exactly when store(x * inv) is
  // not finite, including finite products that round up to inf (65520 for half).
  for (float inv : {1.0f, 0x1p-3f, 3.0f, 0x1p+4f, 1.0f / 3.0f, 65535.0f}) {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const TestType x = TestType::from_bits(static_cast<std::uint16_t>(b));
      float v = static_cast<float>(x) * inv;
      const bool flagged = gradapt::detail::loss_scale::nonfinite_when_stored<TestType>(v);
      TestType stored;
      gradapt::store(stored, v);
      if (flagged == finite(stored)) FAIL("pattern " << b << " times " << inv << ": flagged " << flagged);
    }
  }
  // Float: the largest finite float passes, its overflow does not.
  REQUIRE_FALSE(gradapt::detail::loss_scale::nonfinite_when_stored<float>(std::numeric_limits<float>::max()));
  REQUIRE(
      gradapt::detail::loss_scale::nonfinite_when_stored<float>(std::numeric_limits<float>::max() * 2.0f));
  REQUIRE(gradapt::detail::loss_scale::nonfinite_when_stored<float>(NAN));
}

TEST_CASE("unscale: fp16 overflow of the unscaled product (scale < 1) skips the step",
          "[loss_scaler][unscale]") {
  // S = 1/4: 1/S = 4 turns finite fp16 gradients above 16380 into inf. PyTorch's check looks
  // at the input only and would step on the inf; gradapt checks the stored result.
  loss_scaler s({.init_scale = 0.25, .min_scale = 0x1p-6});
  REQUIRE(s.inv_scale() == 4.0f);
  const gradapt::host backend{.threads = 1};
  gradapt::comm::single comm;
  std::vector<half> g = {half(1.0f), half(16376.0f), half(-2.5f)};  // 16376 * 4 = 65504: finite
  std::vector<tensor_view<half>> grads{gradapt::host_view(g)};
  REQUIRE(s.unscale(backend, comm, grads));
  REQUIRE(static_cast<float>(g[1]) == 65504.0f);
  REQUIRE(s.scale() == 0.25);
  g = {half(1.0f), half(20000.0f), half(-2.5f)};
  REQUIRE_FALSE(s.unscale(backend, comm, grads));
  REQUIRE(std::isinf(static_cast<float>(g[1])));
  REQUIRE(s.scale() == 0.125);
  // Into fp32 master buffers the same gradient is fine.
  loss_scaler m({.init_scale = 0.25, .min_scale = 0x1p-6});
  g = {half(1.0f), half(20000.0f), half(-2.5f)};
  std::vector<float> master(3);
  std::vector<tensor_view<float>> masters{gradapt::host_view(master)};
  REQUIRE(m.unscale(backend, comm, grads, masters));
  REQUIRE(master[1] == 80000.0f);
  // bfloat16 overflows only past float's range.
  loss_scaler b({.init_scale = 0.25, .min_scale = 0x1p-6});
  std::vector<bfloat16> gb = {bfloat16(1e38f), bfloat16(1.0f)};
  std::vector<tensor_view<bfloat16>> grads_b{gradapt::host_view(gb)};
  REQUIRE_FALSE(b.unscale(backend, comm, grads_b));
}

// ---- the collective entry point -------------------------------------------------------------------

TEST_CASE("unscale: the param_list, master and workspace forms agree; the step allocates nothing",
          "[loss_scaler][unscale]") {
  std::vector<float> w1(40), w2(9);
  std::vector<half> g1(40), g2(9);
  for (std::size_t i = 0; i < g1.size(); ++i) g1[i] = half(static_cast<float>(i) * 8.0f);
  for (std::size_t i = 0; i < g2.size(); ++i) g2[i] = half(-static_cast<float>(i) * 16.0f);
  gradapt::param_list<float, half> params;
  params.add("w1", gradapt::host_view(w1), gradapt::host_view(g1));
  params.add("w2", gradapt::host_view(w2), gradapt::host_view(g2));
  const gradapt::host backend{.threads = 2};
  gradapt::comm::single comm;
  std::vector<float> m1(40), m2(9);
  const std::vector<tensor_view<float>> master{gradapt::host_view(m1), gradapt::host_view(m2)};
  loss_scaler into({.init_scale = 8});
  REQUIRE(into.unscale(backend, comm, params.grads(), master));
  for (std::size_t i = 0; i < m1.size(); ++i) REQUIRE(m1[i] == static_cast<float>(i));
  for (std::size_t i = 0; i < m2.size(); ++i) REQUIRE(m2[i] == -2.0f * static_cast<float>(i));
  // Workspace (flag) form on host memory gives the same bits as the param_list form.
  auto g1b = g1;
  auto g2b = g2;
  const std::vector<tensor_view<half>> copies{gradapt::host_view(g1b), gradapt::host_view(g2b)};
  loss_scaler a({.init_scale = 8}), b({.init_scale = 8});
  float ws[2] = {5.0f, 5.0f};
  REQUIRE(a.unscale(backend, comm, params));
  REQUIRE(b.unscale(backend, comm, copies, tensor_view<float>::vector(ws, 2)));
  REQUIRE(ws[0] == 0.0f);
  REQUIRE(std::memcmp(g1.data(), g1b.data(), g1.size() * sizeof(half)) == 0);
  REQUIRE(std::memcmp(g2.data(), g2b.data(), g2.size() * sizeof(half)) == 0);
  REQUIRE(same_state(a.state(), b.state()));
  g1b[3] = half(INFINITY);
  REQUIRE_FALSE(b.unscale(backend, comm, copies, tensor_view<float>::vector(ws, 2)));
  REQUIRE(ws[0] == 1.0f);
  REQUIRE_THROWS_WITH(static_cast<void>(b.unscale(backend, comm, copies, tensor_view<float>::vector(ws, 1))),
                      Contains("workspace has 1 floats"));
  // Steady state: no allocation in the fused in-place, master and workspace forms.
  const std::size_t allocs_before = alloc_counter::on_this_thread();
  const bool s1 = a.unscale(backend, comm, params);
  const bool s2 = into.unscale(backend, comm, params.grads(), master);
  const bool s3 = b.unscale(backend, comm, copies, tensor_view<float>::vector(ws, 2));
  const std::size_t allocs = alloc_counter::on_this_thread() - allocs_before;
  REQUIRE(s1);
  REQUIRE(s2);
  REQUIRE_FALSE(s3);
  if (alloc_counter::enabled) REQUIRE(allocs == 0);
  // Mismatched master lists are refused with the sizes named.
  const std::vector<tensor_view<float>> short_master{gradapt::host_view(m1)};
  REQUIRE_THROWS_WITH(static_cast<void>(into.unscale(backend, comm, params.grads(), short_master)),
                      Contains("2 gradient tensors but 1 master-gradient tensors"));
  const std::vector<tensor_view<float>> wrong{gradapt::host_view(m2), gradapt::host_view(m1)};
  REQUIRE_THROWS_WITH(static_cast<void>(into.unscale(backend, comm, params.grads(), wrong)),
                      Contains("gradient tensor 0 has 40 elements but master tensor 0 has 9"));
}

TEST_CASE("unscale: ranks agree on an overflow on one rank (threads, 1 to 8 ranks)",
          "[loss_scaler][threads]") {
  for (int n = 1; n <= 8; ++n) {
    const int culprit = (n - 1) / 2;
    gradapt::comm::run_threads(n, [&](gradapt::comm::threads& comm) {
      loss_scaler_scenario::ranks_agree_on_overflows(
          comm, {.init_scale = 1024, .growth_interval = 3, .hysteresis = 2}, 30,
          [culprit](int r, int, int step) {
            return r == culprit && (step % 5 == 2 || step == 11 || step == 12);
          });
    });
  }
}

TEST_CASE("unscale: invalid input on one rank makes every rank throw (threads, 3 ranks)",
          "[loss_scaler][threads]") {
  gradapt::comm::run_threads(
      3, [&](gradapt::comm::threads& comm) { loss_scaler_scenario::invalid_master_on_one_rank(comm, 1); });
}

TEST_CASE("unscale: the pass functions reject bad arguments with the sizes named", "[loss_scaler][unscale]") {
  const gradapt::host h{.threads = 1};
  std::vector<float> a(5), b(3), m(4);
  const std::vector<tensor_view<float>> grads{gradapt::host_view(a), gradapt::host_view(b)};
  double per3[3];
  REQUIRE_THROWS_WITH(gradapt::unscale_count_nonfinite(h, grads, 0.0f), Contains("inv_scale is 0"));
  REQUIRE_THROWS_WITH(gradapt::unscale_count_nonfinite(h, grads, INFINITY), Contains("inv_scale is inf"));
  REQUIRE_THROWS_WITH(gradapt::unscale_count_nonfinite(h, grads, 1.0f, std::span<double>(per3, 3)),
                      Contains("per_tensor has 3 slots for 2 tensors"));
  const std::vector<tensor_view<float>> masters{gradapt::host_view(m), gradapt::host_view(b)};
  REQUIRE_THROWS_WITH(gradapt::unscale_count_nonfinite(h, grads, masters, 1.0f),
                      Contains("gradient tensor 0 has 5 elements but master tensor 0 has 4"));
  float flag = 0.0f;
  REQUIRE_THROWS_WITH(
      gradapt::unscale_flag_nonfinite(h, grads, masters, 1.0f, tensor_view<float>::scalar(&flag)),
      Contains("master tensor 0 has 4"));
  REQUIRE_THROWS_WITH(gradapt::unscale_flag_nonfinite(h, grads, NAN, tensor_view<float>::scalar(&flag)),
                      Contains("inv_scale is nan"));
  REQUIRE_THROWS_WITH(gradapt::unscale_flag_nonfinite(h, grads, 1.0f, tensor_view<float>{}),
                      Contains("the flag view is empty"));
}

}  // namespace gradapt_test_loss_scaler

// Prints the exact bits of every preset's parameters and state (Adafactor and SM3: parameters,
// on 1, 2 and 3 threads) after a few steps on fixed
// pseudo-random data (float, double, bfloat16 and half parameters; sizes that leave scalar
// tails after the packs). Built twice, with the explicit pack path and with
// -DGRADAPT_NO_VECTOR_EXTENSIONS (scalar functor calls); ctest compares the outputs byte for
// byte, the pack build run as it is (AVX2 where the CPU has it) and with GRADAPT_HOST_AVX2=0
// (16-byte packs), because the paths promise identical results.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/optim/adafactor.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/optim/lamb.hpp"
#include "gradapt/optim/lars.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/sm3.hpp"
#include "support/counter_random.hpp"

namespace {

/// "t<index>", built by appending (GCC 12 at -O3 warns a false -Wrestrict in "t" + std::string).
std::string tensor_name(std::size_t t) {
  std::string s = "t";
  s += std::to_string(t);
  return s;
}

gradapt_test::splitmix64_stream rng{0x243f6a8885a308d3ull};
double next() {  // splitmix64 -> [-1, 1) with a spread of magnitudes
  const std::uint64_t z = rng();
  return gradapt_test::signed_unit(z) * std::ldexp(1.0, static_cast<int>(z & 7) - 4);
}

template <class T>
void print(const char* what, const std::vector<T>& v) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the bytes, then the first elements
  const auto* b = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ b[i]) * 1099511628211ull;
  std::printf("%s %zu %016" PRIx64, what, v.size(), h);
  for (std::size_t i = 0; i < v.size() && i < 3; ++i) {
    std::uint64_t e = 0;
    std::memcpy(&e, &v[i], sizeof(T));
    std::printf(" %" PRIx64, e);
  }
  std::printf("\n");
}

template <class V, class G, class Opt>
void run(const char* name, const Opt& opt) {
  const std::vector<std::size_t> sizes{0, 1, 5, 8, 13, 4099, 70001, 300007};
  std::vector<std::vector<V>> p(sizes.size());
  std::vector<std::vector<G>> g(sizes.size());
  gradapt::param_list<V, G> params;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    p[t].resize(sizes[t]);
    g[t].resize(sizes[t]);
    for (auto& x : p[t]) gradapt::store(x, static_cast<gradapt::compute_t<V>>(next()));
    params.add(tensor_name(t), gradapt::host_view(p[t]), gradapt::host_view(g[t]),
               {.skip_weight_decay = t == 2, .skip_trust_ratio = t == 3});
  }
  gradapt::host backend{.threads = 2};
  auto st = opt.init(backend, params);
  for (int s = 0; s < 3; ++s) {
    for (auto& t : g)
      for (auto& x : t) gradapt::store(x, static_cast<gradapt::compute_t<G>>(next() * 0.1));
    opt.step(backend, params, st, {.lr = 0.01 * (s + 1)});
  }
  std::printf("== %s\n", name);
  for (const auto& t : p) print("p", t);
  for (std::size_t j = 0; j < st.buffer_count(); ++j)
    for (const auto& v : st.buffer(j)) {
      std::vector<typename std::remove_cvref_t<decltype(v)>::value_type> copy(v.data(), v.data() + v.size());
      print("state", copy);
    }
}

/// Adafactor and SM3 on factored and unfactored shapes (odd sizes, a rank-3 tensor with a
/// trailing dim, tensors above and below the host's one-thread task size), parameters only.
/// Returns an FNV-1a hash of all parameters; the data depend only on the fixed seed, so every
/// thread count must give the same hash.
template <class Opt>
std::uint64_t run_factored(const char* name, const Opt& opt, int threads) {
  rng.state = 0x13198a2e03707344ull;
  const std::vector<std::vector<std::int64_t>> shapes = {{300, 257}, {37, 45},    {130, 129}, {3, 140, 150},
                                                         {1000},     {129, 3000}, {5},        {128, 128, 2},
                                                         {700, 200}, {0},         {1, 130}};
  std::vector<std::vector<float>> p(shapes.size()), g(shapes.size());
  gradapt::param_list<float> params;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    std::size_t n = 1;
    for (auto d : shapes[t]) n *= static_cast<std::size_t>(d);
    p[t].resize(n);
    g[t].resize(n);
    for (auto& x : p[t]) x = static_cast<float>(next());
    params.add(tensor_name(t), gradapt::tensor_view<float>(p[t].data(), shapes[t]),
               gradapt::tensor_view<float>(g[t].data(), shapes[t]));
  }
  gradapt::host backend{.threads = threads};
  auto st = opt.init(backend, params);
  for (int s = 0; s < 3; ++s) {
    for (auto& t : g)
      for (auto& x : t) x = static_cast<float>(next() * 0.1);
    opt.step(backend, params, st, {.lr = 0.01 * (s + 1)});
  }
  std::printf("== %s (threads %d)\n", name, threads);
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& t : p) {
    print("p", t);
    const auto* b = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.size() * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

template <class V, class G>
void all(const char* type) {
  const std::string t(type);
  run<V, G>((t + " sgd").c_str(), gradapt::sgd({.momentum = 0.9, .nesterov = true, .weight_decay = 0.01}));
  run<V, G>((t + " adamw").c_str(), gradapt::adamw({.eps_root = 1e-9, .weight_decay = 0.01}));
  run<V, G>(
      (t + " lamb").c_str(),
      gradapt::lamb(
          {.weight_decay = 0.01, .max_grad_norm = 0.5, .min_trust_ratio = 0.01, .max_trust_ratio = 10}));
  run<V, G>((t + " lars").c_str(), gradapt::lars({.weight_decay = 0.01, .nesterov = true}));
  run<V, G>((t + " lars paper").c_str(),
            gradapt::lars(
                {.weight_decay = 0.01, .denominator = gradapt::transform::lars_denominator::sum_of_norms}));
}

}  // namespace

int main() {
  // The path this process runs (compare_outputs.cmake checks it where a test asks for one).
#if defined(GRADAPT_HOST_AVX2)
  std::fprintf(stderr, "host path: %s\n",
               gradapt::simd::detail::cpu_has_avx2() ? "32-byte AVX2 packs" : "16-byte packs");
#elif defined(GRADAPT_HOST_VECTOR)
  std::fprintf(stderr, "host path: 16-byte packs\n");
#else
  std::fprintf(stderr, "host path: scalar\n");
#endif
  std::vector<std::uint64_t> first;
  for (int threads : {1, 2, 3}) {
    const std::uint64_t h[] = {
        run_factored("adafactor", gradapt::adafactor({.lr = 1e-2}), threads),
        run_factored("adafactor torch",
                     gradapt::adafactor(gradapt::torch_adafactor_options(1e-2, 1e-3, 0.01)), threads),
        run_factored("adafactor momentum",
                     gradapt::adafactor({.lr = 1e-2, .momentum = 0.9, .weight_decay = 1e-3}), threads),
        run_factored("adafactor relative",
                     gradapt::adafactor({.lr = 3e-3,
                                         .relative_step = true,
                                         .clipping_threshold = 0.5,
                                         .multiply_by_parameter_scale = false}),
                     threads),
        run_factored("sm3", gradapt::sm3({.lr = 1e-2}), threads),
        run_factored("sm3 no momentum", gradapt::sm3({.lr = 1e-2, .momentum = 0.0}), threads)};
    if (first.empty()) first.assign(std::begin(h), std::end(h));
    for (std::size_t k = 0; k < first.size(); ++k)
      if (h[k] != first[k]) {
        std::fprintf(stderr, "factored case %zu: %d threads give other bits than 1 thread\n", k, threads);
        return 1;
      }
  }
  all<float, float>("float");
  all<double, double>("double");
  all<float, gradapt::bfloat16>("float/bf16");
  all<float, gradapt::half>("float/half");
  all<gradapt::bfloat16, gradapt::bfloat16>("bf16");
  all<gradapt::half, gradapt::half>("half");
  return 0;
}

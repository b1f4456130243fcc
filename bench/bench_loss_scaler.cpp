// The loss scaler's unscale pass on a 100M-element gradient list shaped like an 8-layer,
// d = 1024 transformer (qkv, out, two FFN matrices, biases and norms per layer: 64 tensors,
// 100.7 M elements), compiled the way a consumer compiles gradapt (plain -O2).
//
// Kernels (effective bandwidth = the fewest bytes the pass must move / time):
//   fused_fp32        in place, fp32: read + write 4 B each        ->  8 B/element
//   fused_fp16        in place, fp16: read + write 2 B each        ->  4 B/element
//   fused_fp16_master fp16 grads read, fp32 master written         ->  6 B/element
//   fused_bf16        in place, bf16 (cheap conversions, for contrast) 4 B/element
//   flag_fp32         the flag form (apply_list + a flag store), fp32, 8 B/element
//   twopass_fp32      apply_list unscale, then reduce(count_nonfinite): what fusing saves
//                     (still credited with 8 B/element: the bytes the job needs)
//
// Every iteration times, back to back: the STREAM triad on three separate 100.7 M-float
// arrays (12 B/element), the kernel's own-stream roof (a plain loop with the same read and
// write streams: x *= s in place for fp32; a 16-bit in-place xor for fp16; an int16 -> float
// conversion for the master form), and the kernel. The counters are medians of the
// per-iteration ratios kernel / triad and kernel / roof. The scale alternates between 2 and
// 1/2, so the values neither drift into subnormals nor overflow.
//
// cached_<kernel>: the same calls on 16 Ki elements (in L1/L2), 1 thread: seconds per
// element of the element loop alone (per_element; not in the table).
//
//   bench_loss_scaler [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/precision/loss_scaler.hpp"

namespace {

/// Tensor sizes of 8 transformer layers with d = 1024, FFN 4096.
std::vector<std::size_t> layer_sizes() {
  std::vector<std::size_t> s;
  for (int l = 0; l < 8; ++l)
    for (std::size_t n :
         {std::size_t{3} * 1024 * 1024, std::size_t{3} * 1024, std::size_t{1024} * 1024, std::size_t{1024},
          std::size_t{1024}, std::size_t{1024}, std::size_t{4096} * 1024, std::size_t{4096}})
      s.push_back(n);
  return s;
}

std::size_t total(const std::vector<std::size_t>& s) {
  std::size_t n = 0;
  for (auto v : s) n += v;
  return n;
}

struct data_t {
  std::vector<std::size_t> sizes = layer_sizes();
  std::size_t n = total(sizes);
  std::vector<float> g32, m32, a, b, c;
  std::vector<gradapt::half> g16;
  std::vector<gradapt::bfloat16> gb16;
  std::vector<gradapt::tensor_view<float>> v32, vm;
  std::vector<gradapt::tensor_view<gradapt::half>> v16;
  std::vector<gradapt::tensor_view<gradapt::bfloat16>> vb16;
  data_t() : g32(n), m32(n), a(n, 1.0f), b(n, 2.0f), c(n, 0.5f), g16(n), gb16(n) {
    for (std::size_t i = 0; i < n; ++i) {
      g32[i] = 1.0f + static_cast<float>(i % 1021) / 1024.0f;
      g16[i] = gradapt::half(g32[i]);
      gb16[i] = gradapt::bfloat16(g32[i]);
    }
    std::size_t off = 0;
    for (auto s : sizes) {
      const auto len = static_cast<std::int64_t>(s);
      v32.push_back(gradapt::tensor_view<float>::vector(g32.data() + off, len));
      vm.push_back(gradapt::tensor_view<float>::vector(m32.data() + off, len));
      v16.push_back(gradapt::tensor_view<gradapt::half>::vector(g16.data() + off, len));
      vb16.push_back(gradapt::tensor_view<gradapt::bfloat16>::vector(gb16.data() + off, len));
      off += s;
    }
  }
};
data_t& data() {
  static data_t d;
  return d;
}

// ---- plain loops: the triad and the own-stream roofs ----------------------------------------
void triad(int t) {
  auto& d = data();
  float* __restrict a = d.a.data();
  const float* __restrict b = d.b.data();
  const float* __restrict c = d.c.data();
  const std::size_t n = d.n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
  benchmark::ClobberMemory();
}
void roof_scale32(int t, float s) {  // read + write the same fp32 array
  float* __restrict x = data().a.data();
  const std::size_t n = data().n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) x[i] *= s;
  benchmark::ClobberMemory();
}
void roof_xor16(int t) {  // read + write the same 2-byte array
  auto* __restrict x = reinterpret_cast<std::uint16_t*>(data().g16.data());
  const std::size_t n = data().n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<std::uint16_t>(x[i] ^ 0x0001u);
  benchmark::ClobberMemory();
}
void roof_widen(int t) {  // read 2 bytes, write 4 bytes
  const auto* __restrict x = reinterpret_cast<const std::int16_t*>(data().g16.data());
  float* __restrict m = data().c.data();
  const std::size_t n = data().n;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n; ++i) m[i] = static_cast<float>(x[i]);
  benchmark::ClobberMemory();
}

// ---- the kernels ---------------------------------------------------------------------------
int flip = 0;
float next_inv() { return (flip++ & 1) ? 2.0f : 0.5f; }

void fused_fp32(int t) {
  benchmark::DoNotOptimize(
      gradapt::unscale_count_nonfinite(gradapt::host{.threads = t}, data().v32, next_inv()));
}
void fused_fp16(int t) {
  benchmark::DoNotOptimize(
      gradapt::unscale_count_nonfinite(gradapt::host{.threads = t}, data().v16, next_inv()));
}
void fused_bf16(int t) {
  benchmark::DoNotOptimize(
      gradapt::unscale_count_nonfinite(gradapt::host{.threads = t}, data().vb16, next_inv()));
}
void fused_fp16_master(int t) {
  benchmark::DoNotOptimize(
      gradapt::unscale_count_nonfinite(gradapt::host{.threads = t}, data().v16, data().vm, next_inv()));
}
void flag_fp32(int t) {
  float flag = 0.0f;
  gradapt::unscale_flag_nonfinite(gradapt::host{.threads = t}, data().v32, next_inv(),
                                  gradapt::tensor_view<float>::scalar(&flag));
  benchmark::DoNotOptimize(flag);
}
struct scale_only {
  float s;
  void operator()(float& g) const { g *= s; }
};
void twopass_fp32(int t) {
  const gradapt::host h{.threads = t};
  h.apply_list(scale_only{next_inv()}, data().v32);
  benchmark::DoNotOptimize(h.reduce(gradapt::reduction::count_nonfinite, data().v32, std::span<double>{}));
}

enum class roof { scale32, xor16, widen };

template <class Kernel>
void paired(benchmark::State& st, roof r, double bytes_per_element, Kernel kernel) {
  using clock = std::chrono::steady_clock;
  const int t = static_cast<int>(st.range(0));
  const double n = static_cast<double>(data().n);
  const auto secs = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  std::vector<double> vs_triad, vs_roof, gbs;
  float s = 0.5f;
  for (auto _ : st) {
    const auto t0 = clock::now();
    triad(t);
    const auto t1 = clock::now();
    if (r == roof::scale32)
      roof_scale32(t, s = 1.0f / s);
    else if (r == roof::xor16)
      roof_xor16(t);
    else
      roof_widen(t);
    const auto t2 = clock::now();
    kernel(t);
    const auto t3 = clock::now();
    const double roof_bytes = (r == roof::scale32 ? 8.0 : r == roof::xor16 ? 4.0 : 6.0) * n;
    const double k = bytes_per_element * n / secs(t2, t3);
    vs_triad.push_back(k / (12.0 * n / secs(t0, t1)));
    vs_roof.push_back(k / (roof_bytes / secs(t1, t2)));
    gbs.push_back(k * 1e-9);
    st.SetIterationTime(secs(t2, t3));
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  st.counters["GBps"] = median(gbs);
  st.counters["vs_triad"] = median(vs_triad);
  st.counters["vs_roof"] = median(vs_roof);
}

void BM_fused_fp32(benchmark::State& st) { paired(st, roof::scale32, 8.0, fused_fp32); }
void BM_flag_fp32(benchmark::State& st) { paired(st, roof::scale32, 8.0, flag_fp32); }
void BM_twopass_fp32(benchmark::State& st) { paired(st, roof::scale32, 8.0, twopass_fp32); }
void BM_fused_fp16(benchmark::State& st) { paired(st, roof::xor16, 4.0, fused_fp16); }
void BM_fused_bf16(benchmark::State& st) { paired(st, roof::xor16, 4.0, fused_bf16); }
void BM_fused_fp16_master(benchmark::State& st) { paired(st, roof::widen, 6.0, fused_fp16_master); }

#define GRADAPT_PAIRED(fn) \
  BENCHMARK(fn)->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(15)
GRADAPT_PAIRED(BM_fused_fp32);
GRADAPT_PAIRED(BM_flag_fp32);
GRADAPT_PAIRED(BM_twopass_fp32);
GRADAPT_PAIRED(BM_fused_fp16);
GRADAPT_PAIRED(BM_fused_fp16_master);
GRADAPT_PAIRED(BM_fused_bf16);

// ---- compute cost with the data in cache: 1 thread, 16 Ki elements, seconds per element ----
// (what the element loop itself costs, nearly independent of other load on the machine)
template <class T, bool Master>
void BM_cached(benchmark::State& st) {
  constexpr std::size_t n = 16384;
  std::vector<T> g(n);
  std::vector<float> m(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = T(1.0f + static_cast<float>(i % 1021) / 1024.0f);
  const std::vector<gradapt::tensor_view<T>> gv{gradapt::tensor_view<T>::vector(g.data(), n)};
  const std::vector<gradapt::tensor_view<float>> mv{gradapt::tensor_view<float>::vector(m.data(), n)};
  const gradapt::host h{.threads = 1};
  float inv = 2.0f;
  for (auto _ : st) {
    double c;
    if constexpr (Master)
      c = gradapt::unscale_count_nonfinite(h, gv, mv, inv);
    else
      c = gradapt::unscale_count_nonfinite(h, gv, inv);
    benchmark::DoNotOptimize(c);
    inv = 1.0f / inv;
  }
  st.counters["per_element"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_cached<float, false>)->Name("BM_cached_fp32");
BENCHMARK(BM_cached<gradapt::half, false>)->Name("BM_cached_fp16");
BENCHMARK(BM_cached<gradapt::bfloat16, false>)->Name("BM_cached_bf16");
BENCHMARK(BM_cached<gradapt::half, true>)->Name("BM_cached_fp16_master");

class table_reporter : public benchmark::ConsoleReporter {
 public:
  struct row {
    double gbs, vs_triad, vs_roof;
  };
  std::map<std::string, row> rows;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Iteration && r.counters.count("vs_roof"))
        rows[r.run_name.function_name.substr(3) + "/" + r.run_name.args] = {
            r.counters.at("GBps").value, r.counters.at("vs_triad").value, r.counters.at("vs_roof").value};
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("gradient list: %zu tensors, %.1f M elements\n", data().sizes.size(),
              static_cast<double>(data().n) * 1e-6);
  table_reporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  std::printf("\nMedians of 15 paired iterations (triad, own-stream roof, kernel back to back).\n");
  std::printf("%-22s %7s %8s %10s %10s\n", "kernel", "threads", "GB/s", "vs triad", "vs roof");
  for (const auto& [name, r] : rep.rows) {
    const auto slash = name.find('/');
    std::printf("%-22s %7s %8.1f %10.2f %10.2f\n", name.substr(0, slash).c_str(),
                name.substr(slash + 1).c_str(), r.gbs, r.vs_triad, r.vs_roof);
  }
  benchmark::Shutdown();
  return 0;
}

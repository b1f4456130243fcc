// Host backend throughput against plain loops of the same size, measured in the same run.
//
// Every kernel reports bytes moved per second (bytes read + bytes written, per call). At the
// end a table gives each kernel's rate over the triad rate at the same thread count, and over
// the roof that fits the kernel: a plain `y += s * x` loop with the same streams for apply
// (triad writes a separate array and pays a read-for-ownership that its byte count hides),
// and a plain vectorised read-only sum for the one-stream reductions. The plain loops are written to be as
// fast as a compiler makes them here (restrict pointers, `omp simd`), so the ratios are not flattered.
//
//   bench_host [--benchmark_filter=...]     default: fp32, 16 Mi elements (64 MiB) per vector
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"

namespace {

constexpr std::size_t n_elems = std::size_t{16} << 20;  // 64 MiB of fp32 per vector

struct buffers {
  std::vector<float> a, b, c;
  buffers() : a(n_elems, 1.0f), b(n_elems, 2.0f), c(n_elems, 0.5f) {}
};
buffers& data() {
  static buffers d;
  return d;
}

void finish(benchmark::State& st, double bytes_per_call) {
  st.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_call * static_cast<double>(st.iterations())));
}

// ---- plain reference loops ----------------------------------------------------------------
void triad_loop(int t) {
  auto& d = data();
  float* __restrict a = d.a.data();
  const float* __restrict b = d.b.data();
  const float* __restrict c = d.c.data();
  const float s = 0.5f;
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n_elems; ++i) a[i] = b[i] + s * c[i];
  benchmark::ClobberMemory();
}
void plain_axpy_loop(int t) {
  auto& d = data();
  float* __restrict y = d.a.data();
  const float* __restrict x = d.c.data();
#pragma omp parallel for simd schedule(static) num_threads(t)
  for (std::size_t i = 0; i < n_elems; ++i) y[i] += 0.5f * x[i];
  benchmark::ClobberMemory();
}
float read_sum_loop(int t) {
  const float* __restrict b = data().b.data();
  float s = 0;
#pragma omp parallel for simd schedule(static) num_threads(t) reduction(+ : s)
  for (std::size_t i = 0; i < n_elems; ++i) s += b[i];
  return s;
}

void BM_copy(benchmark::State& st) {
  const int t = static_cast<int>(st.range(0));
  auto& d = data();
  for (auto _ : st) {
    float* __restrict a = d.a.data();
    const float* __restrict b = d.b.data();
#pragma omp parallel for simd schedule(static) num_threads(t)
    for (std::size_t i = 0; i < n_elems; ++i) a[i] = b[i];
    benchmark::ClobberMemory();
  }
  finish(st, 2.0 * 4 * n_elems);
}

void BM_triad(benchmark::State& st) {
  for (auto _ : st) triad_loop(static_cast<int>(st.range(0)));
  finish(st, 3.0 * 4 * n_elems);
}

// The same streams as apply_axpy (read y and x, write y in place): the honest roof for it.
void BM_plain_axpy(benchmark::State& st) {
  for (auto _ : st) plain_axpy_loop(static_cast<int>(st.range(0)));
  finish(st, 3.0 * 4 * n_elems);
}

void BM_read_sum(benchmark::State& st) {  // one read stream, float accumulation: the read roof
  for (auto _ : st) benchmark::DoNotOptimize(read_sum_loop(static_cast<int>(st.range(0))));
  finish(st, 4.0 * n_elems);
}

// ---- gradapt host backend -----------------------------------------------------------------
void BM_apply_axpy(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  auto& d = data();
  const auto y = gradapt::host_view(d.a);
  const gradapt::tensor_view<const float> x = gradapt::host_view(d.c);
  for (auto _ : st) {
    h.apply([](float& yy, float xx) { yy += 0.5f * xx; }, y, x);
    benchmark::ClobberMemory();
  }
  finish(st, 3.0 * 4 * n_elems);
}

void BM_sum_squares(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().b);
  for (auto _ : st) benchmark::DoNotOptimize(h.reduce(gradapt::reduction::sum_squares, x));
  finish(st, 4.0 * n_elems);
}

void BM_dot(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().b), y = gradapt::host_view(data().c);
  for (auto _ : st) benchmark::DoNotOptimize(h.dot(x, y));
  finish(st, 8.0 * n_elems);
}

void BM_max_abs(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().b);
  for (auto _ : st) benchmark::DoNotOptimize(h.reduce(gradapt::reduction::max_abs, x));
  finish(st, 4.0 * n_elems);
}

// 100 tensors of mixed sizes summing to the same 16 Mi elements: the multi-tensor paths.
struct tensor_set {
  std::vector<gradapt::tensor_view<float>> ys;
  std::vector<gradapt::tensor_view<const float>> xs;
  tensor_set() {
    auto& d = data();
    std::size_t off = 0;
    for (int t = 0; t < 100; ++t) {
      const std::size_t n = t == 99 ? n_elems - off : (t % 3 == 0 ? 400000 : 2000 + 97 * t);
      ys.push_back(gradapt::tensor_view<float>::vector(d.a.data() + off, static_cast<std::int64_t>(n)));
      xs.push_back(gradapt::tensor_view<const float>::vector(d.c.data() + off, static_cast<std::int64_t>(n)));
      off += n;
    }
  }
};
tensor_set& tensors() {
  static tensor_set s;
  return s;
}

void BM_apply_list_axpy(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  auto& s = tensors();
  for (auto _ : st) {
    h.apply_list([](float& yy, float xx) { yy += 0.5f * xx; }, s.ys, s.xs);
    benchmark::ClobberMemory();
  }
  finish(st, 3.0 * 4 * n_elems);
}

void BM_list_sum_squares(benchmark::State& st) {
  gradapt::host h{.threads = static_cast<int>(st.range(0))};
  auto& s = tensors();
  std::vector<double> per(s.xs.size());
  for (auto _ : st) benchmark::DoNotOptimize(h.reduce(gradapt::reduction::sum_squares, s.xs, per));
  finish(st, 4.0 * n_elems);
}

// ---- paired measurements ------------------------------------------------------------------
// Each iteration times triad, the kernel's own-stream roof and the kernel back to back; the
// counters are medians of the per-iteration ratios. On a shared machine whose bandwidth drifts
// between benchmarks, this is the robust form of "ratio measured in the same run".
enum class roof { axpy, read };

template <class Kernel>
void paired(benchmark::State& st, roof r, double kernel_bytes, Kernel kernel) {
  using clock = std::chrono::steady_clock;
  const int t = static_cast<int>(st.range(0));
  std::vector<double> vs_triad, vs_roof;
  const auto secs = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  for (auto _ : st) {
    const auto t0 = clock::now();
    triad_loop(t);
    const auto t1 = clock::now();
    if (r == roof::axpy)
      plain_axpy_loop(t);
    else
      benchmark::DoNotOptimize(read_sum_loop(t));
    const auto t2 = clock::now();
    kernel(t);
    const auto t3 = clock::now();
    const double roof_bytes = r == roof::axpy ? 12.0 * n_elems : 4.0 * n_elems;
    const double k = kernel_bytes / secs(t2, t3);
    vs_triad.push_back(k / (12.0 * n_elems / secs(t0, t1)));
    vs_roof.push_back(k / (roof_bytes / secs(t1, t2)));
    st.SetIterationTime(secs(t2, t3));
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  st.counters["ratio_vs_triad"] = median(vs_triad);
  st.counters["ratio_vs_roof"] = median(vs_roof);
  finish(st, kernel_bytes);
}

void PAIR_sum_squares(benchmark::State& st) {
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().b);
  paired(st, roof::read, 4.0 * n_elems, [&](int t) {
    benchmark::DoNotOptimize(gradapt::host{.threads = t}.reduce(gradapt::reduction::sum_squares, x));
  });
}
void PAIR_list_sum_squares(benchmark::State& st) {
  auto& s = tensors();
  std::vector<double> per(s.xs.size());
  paired(st, roof::read, 4.0 * n_elems, [&](int t) {
    benchmark::DoNotOptimize(gradapt::host{.threads = t}.reduce(gradapt::reduction::sum_squares, s.xs, per));
  });
}
void PAIR_apply_axpy(benchmark::State& st) {
  const auto y = gradapt::host_view(data().a);
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().c);
  paired(st, roof::axpy, 12.0 * n_elems, [&](int t) {
    gradapt::host{.threads = t}.apply([](float& yy, float xx) { yy += 0.5f * xx; }, y, x);
    benchmark::ClobberMemory();
  });
}
void PAIR_apply_list_axpy(benchmark::State& st) {
  auto& s = tensors();
  paired(st, roof::axpy, 12.0 * n_elems, [&](int t) {
    gradapt::host{.threads = t}.apply_list([](float& yy, float xx) { yy += 0.5f * xx; }, s.ys, s.xs);
    benchmark::ClobberMemory();
  });
}
void PAIR_max_abs(benchmark::State& st) {
  const gradapt::tensor_view<const float> x = gradapt::host_view(data().b);
  paired(st, roof::read, 4.0 * n_elems, [&](int t) {
    benchmark::DoNotOptimize(gradapt::host{.threads = t}.reduce(gradapt::reduction::max_abs, x));
  });
}

#define GRADAPT_PAIRED(fn) \
  BENCHMARK(fn)->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(41)
GRADAPT_PAIRED(PAIR_sum_squares);
GRADAPT_PAIRED(PAIR_list_sum_squares);
GRADAPT_PAIRED(PAIR_apply_axpy);
GRADAPT_PAIRED(PAIR_apply_list_axpy);
GRADAPT_PAIRED(PAIR_max_abs);

#define GRADAPT_BENCH(fn)             \
  BENCHMARK(fn)                       \
      ->Arg(1)                        \
      ->Arg(2)                        \
      ->UseRealTime()                 \
      ->Unit(benchmark::kMillisecond) \
      ->MinTime(0.3)                  \
      ->Repetitions(5)                \
      ->ReportAggregatesOnly(true)
GRADAPT_BENCH(BM_copy);
GRADAPT_BENCH(BM_triad);
GRADAPT_BENCH(BM_plain_axpy);
GRADAPT_BENCH(BM_read_sum);
GRADAPT_BENCH(BM_apply_axpy);
GRADAPT_BENCH(BM_apply_list_axpy);
GRADAPT_BENCH(BM_sum_squares);
GRADAPT_BENCH(BM_list_sum_squares);
GRADAPT_BENCH(BM_dot);
GRADAPT_BENCH(BM_max_abs);

// Collects the median bytes/s of every benchmark to print the ratio table.
class ratio_reporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> median;                    // "BM_triad/1" -> bytes/s
  std::map<std::string, std::pair<double, double>> pairs;  // "PAIR_x/1" -> (vs triad, vs roof)
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs)
      if (r.run_name.function_name.rfind("PAIR_", 0) == 0 && r.run_type == Run::RT_Iteration)
        pairs[r.run_name.function_name + "/" + r.run_name.args] = {r.counters.at("ratio_vs_triad").value,
                                                                   r.counters.at("ratio_vs_roof").value};
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        const auto it = r.counters.find("bytes_per_second");
        if (it != r.counters.end())
          median[r.run_name.function_name + "/" + r.run_name.args] = it->second.value;
      }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ratio_reporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  std::printf("\nfp32, %zu Mi elements per vector; medians of 5 repetitions; GB/s = bytes moved / s\n",
              n_elems >> 20);
  std::printf("%-22s %7s %8s %8s %10s %10s\n", "kernel", "threads", "GB/s", "triad", "ratio", "vs roof");
  for (const char* t : {"1", "2"}) {
    const double triad = rep.median["BM_triad/" + std::string(t)];
    const double read = rep.median["BM_read_sum/" + std::string(t)];
    const double axpy = rep.median["BM_plain_axpy/" + std::string(t)];
    for (const char* k :
         {"BM_copy", "BM_triad", "BM_plain_axpy", "BM_read_sum", "BM_apply_axpy", "BM_apply_list_axpy",
          "BM_sum_squares", "BM_list_sum_squares", "BM_dot", "BM_max_abs"}) {
      const auto it = rep.median.find(std::string(k) + "/" + t);
      if (it == rep.median.end() || triad <= 0) continue;
      const std::string name(k);
      const bool one_stream =
          name == "BM_sum_squares" || name == "BM_list_sum_squares" || name == "BM_max_abs";
      const bool axpy_like = name == "BM_apply_axpy" || name == "BM_apply_list_axpy";
      const double roof = one_stream ? read : axpy_like ? axpy : triad;
      std::printf("%-22s %7s %8.1f %8.1f %10.2f %10.2f%s\n", k + 3, t, it->second * 1e-9, triad * 1e-9,
                  it->second / triad, it->second / roof,
                  one_stream  ? " (roof: read_sum)"
                  : axpy_like ? " (roof: plain_axpy)"
                              : "");
    }
  }
  std::printf(
      "\nPaired: each of 41 iterations runs triad, the kernel's own-stream roof and the kernel back\n"
      "to back; medians of the per-iteration ratios.\n");
  std::printf("%-22s %7s %12s %12s\n", "kernel", "threads", "vs triad", "vs roof");
  for (const auto& [name, v] : rep.pairs) {
    const auto slash = name.find('/');
    std::printf("%-22s %7s %12.2f %12.2f\n", name.substr(5, slash - 5).c_str(),
                name.substr(slash + 1).c_str(), v.first, v.second);
  }
  benchmark::Shutdown();
  return 0;
}

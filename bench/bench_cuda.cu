// CUDA backend bandwidth on 64 MiB of fp32 (16 Mi elements), against trivial kernels timed in
// the same run:
//   copy         dst = src                          (2 streams: the plain-copy roof)
//   axpy_roof    y = a * x + y, hand-written        (3 streams: the same streams as axpy)
//   apply_axpy   gradapt::cuda::apply(y = a*x + y)  (3 streams)
//   sum_squares  gradapt::cuda::reduce(sum_squares) (1 stream, returns a host double)
//   sum_squares_to  gradapt::cuda::reduce_to        (1 stream, result stays on the device)
// Each reports bytes_per_second (bytes moved / GPU time from CUDA events) and the program
// prints the ratios to the copy kernel and to the hand-written axpy. Exits 0 with a message
// on a machine without a usable GPU.

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <map>
#include <string>

#include "gradapt/backend/cuda.cuh"

namespace {

constexpr std::size_t n_elements = (std::size_t{64} << 20) / sizeof(float);

struct axpy {
  float a;
  GRADAPT_HD void operator()(float& y, float x) const { y = a * x + y; }
};

__global__ void copy_kernel(const float* __restrict__ src, float* __restrict__ dst, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += stride)
    dst[i] = src[i];
}

__global__ void axpy_kernel(float a, const float* __restrict__ x, float* __restrict__ y, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += stride)
    y[i] = a * x[i] + y[i];
}

__global__ void fill_kernel(float* p, std::size_t n, float v) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += stride) p[i] = v;
}

/// Device buffers and a stream shared by all benchmarks.
struct fixture {
  float* x = nullptr;
  float* y = nullptr;
  float* z = nullptr;
  double* result = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  unsigned grid = 0;

  fixture() {
    GRADAPT_CUDA_CHECK(cudaStreamCreate(&stream));
    GRADAPT_CUDA_CHECK(cudaEventCreate(&start));
    GRADAPT_CUDA_CHECK(cudaEventCreate(&stop));
    GRADAPT_CUDA_CHECK(cudaMalloc(&x, n_elements * sizeof(float)));
    GRADAPT_CUDA_CHECK(cudaMalloc(&y, n_elements * sizeof(float)));
    GRADAPT_CUDA_CHECK(cudaMalloc(&z, n_elements * sizeof(float)));
    GRADAPT_CUDA_CHECK(cudaMalloc(&result, sizeof(double)));
    int device = 0, sms = 0;
    GRADAPT_CUDA_CHECK(cudaGetDevice(&device));
    GRADAPT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    grid = static_cast<unsigned>(sms) * 8;
    fill_kernel<<<grid, 256, 0, stream>>>(x, n_elements, 0.5f);
    fill_kernel<<<grid, 256, 0, stream>>>(y, n_elements, 0.25f);
    GRADAPT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  ~fixture() {
    cudaFree(x);
    cudaFree(y);
    cudaFree(z);
    cudaFree(result);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  gradapt::tensor_view<float, gradapt::device_space> view(float* p) const {
    return gradapt::tensor_view<float, gradapt::device_space>::vector(p,
                                                                      static_cast<std::int64_t>(n_elements));
  }
};

fixture* fx = nullptr;
std::map<std::string, double> bandwidth;  // bytes per second of the last run of each benchmark

/// Times `body` with CUDA events per iteration (manual time) and records bytes/s.
template <class Body>
void run(benchmark::State& state, const char* name, double bytes_per_iteration, Body&& body) {
  gradapt::cuda backend{.stream = fx->stream};
  backend.reserve(1 << 20, 1 << 12);
  body(backend);  // warm-up: first launch, workspace
  GRADAPT_CUDA_CHECK(cudaStreamSynchronize(fx->stream));
  double seconds = 0.0;
  for (auto _ : state) {
    GRADAPT_CUDA_CHECK(cudaEventRecord(fx->start, fx->stream));
    body(backend);
    GRADAPT_CUDA_CHECK(cudaEventRecord(fx->stop, fx->stream));
    GRADAPT_CUDA_CHECK(cudaEventSynchronize(fx->stop));
    float ms = 0.0f;
    GRADAPT_CUDA_CHECK(cudaEventElapsedTime(&ms, fx->start, fx->stop));
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  const double bytes = bytes_per_iteration * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  if (seconds > 0) bandwidth[name] = bytes / seconds;
}

void bm_copy(benchmark::State& state) {
  run(state, "copy", 2.0 * n_elements * sizeof(float), [](const gradapt::cuda&) {
    copy_kernel<<<fx->grid, 256, 0, fx->stream>>>(fx->x, fx->z, n_elements);
    GRADAPT_CUDA_CHECK_LAUNCH("copy_kernel");
  });
}

void bm_axpy_roof(benchmark::State& state) {
  run(state, "axpy_roof", 3.0 * n_elements * sizeof(float), [](const gradapt::cuda&) {
    axpy_kernel<<<fx->grid, 256, 0, fx->stream>>>(1e-3f, fx->x, fx->y, n_elements);
    GRADAPT_CUDA_CHECK_LAUNCH("axpy_kernel");
  });
}

void bm_apply_axpy(benchmark::State& state) {
  run(state, "apply_axpy", 3.0 * n_elements * sizeof(float), [](const gradapt::cuda& b) {
    const gradapt::tensor_view<const float, gradapt::device_space> x = fx->view(fx->x);
    b.apply(axpy{1e-3f}, fx->view(fx->y), x);
  });
}

void bm_sum_squares(benchmark::State& state) {
  run(state, "sum_squares", 1.0 * n_elements * sizeof(float), [](const gradapt::cuda& b) {
    benchmark::DoNotOptimize(b.reduce(gradapt::reduction::sum_squares, fx->view(fx->x)));
  });
}

void bm_sum_squares_to(benchmark::State& state) {
  run(state, "sum_squares_to", 1.0 * n_elements * sizeof(float), [](const gradapt::cuda& b) {
    b.reduce_to(gradapt::reduction::sum_squares, fx->view(fx->x),
                gradapt::tensor_view<double, gradapt::device_space>::vector(fx->result, 1));
  });
}

}  // namespace

BENCHMARK(bm_copy)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_axpy_roof)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_apply_axpy)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_sum_squares)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_sum_squares_to)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("bench_cuda: skipped, no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount reports 0");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  {
    fixture f;
    fx = &f;
    benchmark::RunSpecifiedBenchmarks();
    fx = nullptr;
  }
  benchmark::Shutdown();

  const auto ratio = [](const char* a, const char* b) {
    const auto ia = bandwidth.find(a);
    const auto ib = bandwidth.find(b);
    if (ia == bandwidth.end() || ib == bandwidth.end()) return;
    std::printf("%-15s / %-10s = %.3f  (%.1f GB/s vs %.1f GB/s)\n", a, b, ia->second / ib->second,
                ia->second * 1e-9, ib->second * 1e-9);
  };
  std::printf("\nbandwidth ratios (64 MiB fp32, same run):\n");
  ratio("apply_axpy", "axpy_roof");
  ratio("apply_axpy", "copy");
  ratio("axpy_roof", "copy");
  ratio("sum_squares", "copy");
  ratio("sum_squares_to", "copy");
  return 0;
}

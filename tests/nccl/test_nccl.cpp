// Tests of gradapt::comm::nccl on a one-rank communicator (ncclCommInitAll over device 0):
// every operation for float, double, half and bfloat16, split, barrier and the error paths.
// Compiled by the host compiler; nccl_nvcc_ops.cu runs the same header through nvcc.
// Without a CUDA device the program prints why and exits 77, which ctest reports as skipped.
#include "catch.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch_session.hpp"
#include "gradapt/comm/nccl.hpp"
#include "nccl_nvcc_ops.hpp"
#include "thrown_message.hpp"

// Element types are spelled gradapt::half / gradapt::bfloat16: <nccl.h> pulls in CUDA's
// <cuda_fp16.h>, which declares a global `half` (= __half) that a using-declaration would
// make ambiguous.
using gradapt::device_space;
using gradapt::reduce_op;
using gradapt::comm::nccl;
using gradapt::comm::nccl_options;

namespace {

ncclComm_t g_handle = nullptr;
cudaStream_t g_stream = nullptr;

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
T make(double v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return static_cast<T>(v);
  else
    return T(static_cast<float>(v));
}

template <class T>
double value(T x) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return static_cast<double>(x);
  else
    return static_cast<double>(static_cast<float>(x));
}

// Exact in every element type: multiples of 1/4 in [-1, 1.5].
template <class T>
std::vector<T> pattern(std::size_t n, int shift = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = make<T>(0.25 * static_cast<double>((i + static_cast<std::size_t>(shift)) % 11) - 1.0);
  return v;
}

template <class T>
std::vector<double> values(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(value(x));
  return out;
}

/// Device memory holding n elements of T, freed on destruction.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n_ != 0) cuda_ok(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "cudaMalloc");
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  ~device_buffer() { cudaFree(p_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void upload(const std::vector<T>& host) {
    if (n_ != 0)
      cuda_ok(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  /// Waits for the test stream, then copies the buffer to the host.
  std::vector<T> download() const {
    cuda_ok(cudaStreamSynchronize(g_stream), "cudaStreamSynchronize");
    std::vector<T> host(n_);
    if (n_ != 0)
      cuda_ok(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return host;
  }
  gradapt::tensor_view<T, device_space> view() const {
    return gradapt::tensor_view<T, device_space>::vector(p_, static_cast<std::int64_t>(n_));
  }
  gradapt::tensor_view<const T, device_space> cview() const { return view(); }
  /// Elements [off, off + n) as a view.
  gradapt::tensor_view<T, device_space> part(std::size_t off, std::size_t n) const {
    return gradapt::tensor_view<T, device_space>::vector(p_ + off, static_cast<std::int64_t>(n));
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// The message of the gradapt::error f throws, or "no error".
template <class F>
std::string error_of(F&& f) {
  return gradapt_test::thrown_message(std::forward<F>(f));
}

std::vector<nccl_options> option_sets() { return {nccl_options{}, nccl_options{.check_sizes = false}}; }

}  // namespace

TEST_CASE("nccl communicator reports rank, size, device and stream", "[nccl]") {
  nccl c{g_handle, g_stream};
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.device() == 0);
  CHECK(c.native() == g_handle);
  CHECK(c.stream() == g_stream);
  CHECK(c.options().check_sizes);  // the agreement is on by default
}

TEMPLATE_TEST_CASE("nccl operations on one rank", "[nccl]", float, double, gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  for (const nccl_options& opts : option_sets()) {
    nccl c{g_handle, g_stream, opts};
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{37}}) {
      const auto input = pattern<T>(n);
      const auto want = values(input);

      device_buffer<T> x(input);
      c.allreduce(x.view(), reduce_op::sum);
      CHECK(values(x.download()) == want);
      c.allreduce(x.view(), reduce_op::max);
      CHECK(values(x.download()) == want);
      c.broadcast(x.view(), 0);
      CHECK(values(x.download()) == want);

      device_buffer<T> y(n);
      c.allgather(x.cview(), y.view());
      CHECK(values(y.download()) == want);
      c.allgather(x.cview(), x.view());  // in place: send is recv's block 0
      CHECK(values(x.download()) == want);

      device_buffer<T> z(n);
      c.reduce_scatter(y.cview(), z.view(), reduce_op::sum);
      CHECK(values(z.download()) == want);
      c.reduce_scatter(y.cview(), y.view(), reduce_op::max);  // in place: recv is send's block 0
      CHECK(values(y.download()) == want);

      const auto other = pattern<T>(n, 5);
      device_buffer<T> s(other);
      c.exchange(0, s.cview(), z.view());
      CHECK(values(z.download()) == values(other));
      c.exchange(0, z.cview(), z.view());  // the same memory: nothing to do
      CHECK(values(z.download()) == values(other));

      c.barrier();
    }
  }
}

TEMPLATE_TEST_CASE("nccl header compiled by nvcc runs every operation", "[nccl]", float, double,
                   gradapt::half, gradapt::bfloat16) {
  using T = TestType;
  nccl c{g_handle, g_stream};
  const auto input = pattern<T>(19, 3);
  device_buffer<T> buf(input);
  device_buffer<T> tmp(input.size());
  nccltest::nvcc_ops<T>(c, buf.view(), tmp.view());
  CHECK(values(buf.download()) == values(input));
  CHECK(values(tmp.download()) == values(input));
}

TEST_CASE("nccl split makes an owned one-rank communicator", "[nccl]") {
  for (const nccl_options& opts : option_sets()) {
    nccl c{g_handle, g_stream, opts};
    std::optional<nccl> keep;
    {
      nccl sub = c.split(0, 5);
      CHECK(sub.size() == 1);
      CHECK(sub.rank() == 0);
      CHECK(sub.native() != c.native());
      CHECK(sub.stream() == c.stream());
      CHECK(sub.options().check_sizes == opts.check_sizes);
      keep = sub;  // the copy keeps the new handle alive
    }
    const auto input = pattern<float>(8);
    device_buffer<float> x(input);
    keep->allreduce(x.view(), reduce_op::sum);
    CHECK(values(x.download()) == values(input));
    nccl nested = keep->split(3, 0);
    nested.broadcast(x.view(), 0);
    nested.barrier();
    CHECK(values(x.download()) == values(input));
  }
  // The wrapped handle is never destroyed by the communicators built on it.
  int count = 0;
  CHECK(ncclCommCount(g_handle, &count) == ncclSuccess);
  CHECK(count == 1);
}

TEST_CASE("nccl argument errors name the operation, the rank and the sizes", "[nccl][errors]") {
  for (const nccl_options& opts : option_sets()) {
    nccl c{g_handle, g_stream, opts};
    device_buffer<float> a(4), b(4), big(9);
    const std::string p = "gradapt: comm::nccl ";

    for (const int peer : {1, -1}) {
      CHECK(error_of([&] { c.exchange(peer, a.cview(), b.view()); }) ==
            p + "exchange on rank 0: peer " + std::to_string(peer) + " is out of range (expected 0 to 0)");
    }
    CHECK(error_of([&] { c.exchange(0, a.cview(), big.view()); }) ==
          p + "exchange on rank 0: send has 4 elements but recv has 9 (exchange needs equal sizes)");
    CHECK(error_of([&] { c.exchange(0, big.part(0, 4), big.part(2, 4)); }) ==
          p + "exchange on rank 0: send and recv partly overlap; pass separate buffers or the same buffer");

    for (const int root : {1, -1}) {
      CHECK(error_of([&] { c.broadcast(a.view(), root); }) ==
            p + "broadcast on rank 0: root " + std::to_string(root) + " is out of range (expected 0 to 0)");
    }

    CHECK(error_of([&] { c.allgather(a.cview(), big.view()); }) ==
          p + "allgather on rank 0: recv has 9 elements but must have size() * send.size() = 1 * 4 = 4");
    CHECK(error_of([&] { c.allgather(big.part(1, 4), big.part(0, 4)); }) ==
          p + "allgather on rank 0: send overlaps recv; it may only be recv's own block at offset rank() * "
              "send.size() = 0");
    CHECK(error_of([&] { c.reduce_scatter(big.cview(), a.view(), reduce_op::sum); }) ==
          p + "reduce_scatter on rank 0: send has 9 elements but must have size() * recv.size() = 1 * 4 = 4");
    CHECK(error_of([&] { c.reduce_scatter(big.part(0, 4), big.part(2, 4), reduce_op::max); }) ==
          p + "reduce_scatter on rank 0: send overlaps recv; recv may only be send's own block at offset "
              "rank() * "
              "recv.size() = 0");

    CHECK(error_of([&] { static_cast<void>(c.split(-1, 0)); }) ==
          p + "split on rank 0: color -1 is negative (expected a color >= 0)");

    // The communicator still works after every error.
    const auto input = pattern<float>(4);
    a.upload(input);
    c.allreduce(a.view(), reduce_op::sum);
    CHECK(values(a.download()) == values(input));
  }
  CHECK(error_of([] {
          nccl c{nullptr, g_stream};
        }) ==
        "gradapt: comm::nccl: the ncclComm_t handle is null; pass an initialised communicator "
        "(ncclCommInitRank, "
        "ncclCommInitAll or ncclCommSplit)");
}

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::cout << "gradapt NCCL tests skipped: no CUDA device ("
              << (e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount reports 0 devices") << ")\n";
    return 77;
  }
  const int device = 0;
  cudaSetDevice(device);
  if (const ncclResult_t r = ncclCommInitAll(&g_handle, 1, &device); r != ncclSuccess) {
    std::cerr << "gradapt NCCL tests: ncclCommInitAll over device 0 failed: " << ncclGetErrorString(r)
              << '\n';
    return 1;
  }
  if (cudaStreamCreate(&g_stream) != cudaSuccess) {
    std::cerr << "gradapt NCCL tests: cudaStreamCreate failed\n";
    return 1;
  }
  const int result = gradapt_test::run_catch(argc, argv);
  cudaStreamDestroy(g_stream);
  ncclCommDestroy(g_handle);
  return result;
}

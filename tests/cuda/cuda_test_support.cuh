#pragma once
// Helpers shared by the CUDA tests: device buffers (Thrust), views over them, bit-level
// comparisons and random data. Host references are plain loops in each test; nothing here
// depends on gradapt's host backend.

#include <thrust/copy.h>
#include <thrust/device_vector.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "gradapt/backend/cuda.cuh"
#include "thrown_message.hpp"

namespace gradapt_test {

// Names every CUDA test uses (each does `using namespace gradapt_test;`).
using gradapt::compute_t;
using gradapt::device_space;
using gradapt::host_space;
using gradapt::tensor_view;

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
dvec<T> to_device(const std::vector<T>& h) {
  return dvec<T>(h.begin(), h.end());
}

template <class T>
std::vector<T> to_host(const dvec<T>& d) {
  std::vector<T> h(d.size());
  thrust::copy(d.begin(), d.end(), h.begin());
  return h;
}

template <class T>
gradapt::tensor_view<T, gradapt::device_space> view(dvec<T>& d) {
  return gradapt::tensor_view<T, gradapt::device_space>::vector(thrust::raw_pointer_cast(d.data()),
                                                                static_cast<std::int64_t>(d.size()));
}

template <class T>
gradapt::tensor_view<const T, gradapt::device_space> cview(const dvec<T>& d) {
  return gradapt::tensor_view<const T, gradapt::device_space>::vector(thrust::raw_pointer_cast(d.data()),
                                                                      static_cast<std::int64_t>(d.size()));
}

/// The bits of a stored element, for exact comparisons (NaN == NaN with the same payload).
template <class T>
auto bits(T v) {
  using U = std::conditional_t<sizeof(T) == 8, std::uint64_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
  U u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

/// `n` random elements of T drawn from [lo, hi) and rounded into T.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed, double lo = -2.0, double hi = 2.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) gradapt::store(x, static_cast<gradapt::compute_t<T>>(dist(rng)));
  return v;
}

/// Elements k/8 for small integers k: sums, products by powers of two and small integer
/// offsets stay exact in every element type, so device and host results compare bitwise.
template <class T>
std::vector<T> eighths(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::vector<T> v(n);
  for (auto& x : v) gradapt::store(x, static_cast<gradapt::compute_t<T>>(dist(rng) / 8.0));
  return v;
}

/// The elements of `f` stored on the device as half (`dh`) and bfloat16 (`db`) have the bits of
/// the host's conversions.
inline void require_host_conversions(const std::vector<float>& f, const dvec<gradapt::half>& dh,
                                     const dvec<gradapt::bfloat16>& db) {
  const auto gh = to_host(dh);
  const auto gb = to_host(db);
  for (std::size_t i = 0; i < f.size(); ++i) {
    INFO("float bits " << bits(f[i]));
    REQUIRE(gh[i].bits == gradapt::detail::float_to_half_bits(f[i]));
    REQUIRE(gb[i].bits == gradapt::detail::float_to_bfloat16_bits(f[i]));
  }
}

/// The message of the gradapt::error `fn` throws ("" if it throws nothing).
template <class F>
std::string error_of(F&& f) {
  return gradapt_test::thrown_message(std::forward<F>(f), "");
}

/// Sizes that exercise chunk edges: empty, one element, around one and several chunks.
inline std::vector<std::size_t> edge_sizes() {
  constexpr std::size_t C = gradapt::chunking::chunk_elements;
  return {0, 1, 7, 255, 256, 257, C - 1, C, C + 1, 3 * C + 17, (std::size_t{1} << 20) + 3};
}

/// Sizes of a list of `count` tensors: empty, scalars, exact chunk multiples and odd sizes.
inline std::vector<std::size_t> list_sizes(std::size_t count, std::uint64_t seed) {
  constexpr std::size_t C = gradapt::chunking::chunk_elements;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> kind(0, 6);
  std::uniform_int_distribution<std::size_t> small(2, 3000);
  std::uniform_int_distribution<std::size_t> mult(1, 3);
  std::vector<std::size_t> s(count);
  for (auto& n : s) {
    switch (kind(rng)) {
      case 0:
        n = 0;
        break;
      case 1:
        n = 1;
        break;
      case 2:
        n = C * mult(rng);
        break;
      case 3:
        n = C * mult(rng) + 1;
        break;
      default:
        n = small(rng);
        break;
    }
  }
  return s;
}

/// Runs `step()` while `stream` is captured into a CUDA graph in global mode, so any host
/// synchronisation, copy to the host or allocation inside it fails the capture (and the CUDA
/// check in gradapt throws); then launches the graph once and waits for it. REQUIREs that
/// nothing threw and the capture succeeded: the proof that a step never waits for the host.
template <class Fn>
void capture_and_launch(cudaStream_t stream, Fn&& step) {
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  std::string thrown;
  try {
    step();
  } catch (const std::exception& e) {
    thrown = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  INFO("exception during capture: " << thrown);
  REQUIRE(thrown.empty());
  REQUIRE(ended == cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace gradapt_test

// Prints the exact bits of host-backend reductions over fixed pseudo-random data. Built twice,
// with the explicit vector path and with -DGRADAPT_NO_VECTOR_EXTENSIONS; ctest compares the two
// outputs byte for byte (the two paths promise identical results).
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "support/counter_random.hpp"

namespace {
gradapt_test::splitmix64_stream rng{0x9e3779b97f4a7c15ull};
double next() {  // splitmix64 -> [-1, 1) with a spread of magnitudes
  const std::uint64_t z = rng();
  return gradapt_test::signed_unit(z) * static_cast<double>(1u << (z & 15));
}
void print(const char* what, std::size_t n, double v) {
  std::uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  std::printf("%s %zu %016" PRIx64 "\n", what, n, b);
}
template <class T>
void run(const char* type) {
  for (std::size_t n : {0, 1, 7, 8, 9, 4095, 4096, 4097, 8192 * 3 + 5, 1048576 + 333}) {
    std::vector<T> x(n), y(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<T>(next()), y[i] = static_cast<T>(next());
    for (int threads : {1, 2}) {
      gradapt::host h{.threads = threads};
      std::printf("%s threads=%d\n", type, threads);
      print("sum", n, h.reduce(gradapt::reduction::sum, gradapt::host_view(x)));
      print("sum_squares", n, h.reduce(gradapt::reduction::sum_squares, gradapt::host_view(x)));
      print("max_abs", n, h.reduce(gradapt::reduction::max_abs, gradapt::host_view(x)));
      print("dot", n, h.dot(gradapt::host_view(x), gradapt::host_view(y)));
    }
  }
}
}  // namespace

int main() {
  run<float>("float");
  run<double>("double");
  return 0;
}

#pragma once
// Every data operation of the communicator contract on exact inputs, written once over the
// communicator: the MPI tests (tests/mpi/test_mpi_ops.cpp) run each scenario under every
// mpi_options set on 1 to 5 ranks, the threads test (tests/test_comm.cpp) on 1 to 8 threads
// ranks. Assertions go through rank_check.hpp (safe on rank threads).
//
// Every input is a small dyadic rational (a multiple of 1/4 below 16 in magnitude), so it is
// exact in half and bfloat16, and every partial sum over the ranks is exact too: results do
// not depend on the order in which an engine combines ranks, and each expected value is
// computed here in closed form or by a plain loop in double.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "exact_values.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/tensor_view.hpp"
#include "rank_check.hpp"

namespace comm_ops {

using exact::make;
using exact::value;

/// Summed input of rank r at index i: in [-1/2, 3] for r < 5, a multiple of 1/4.
inline double a(int r, std::size_t i) { return 0.5 * (r + 1) + 0.25 * static_cast<double>(i % 7) - 1.0; }

/// Maxed input of rank r at index i: the largest value moves between ranks with i.
inline double b(int r, std::size_t i) {
  return 0.5 * static_cast<double>((static_cast<std::size_t>(r) * 3 + i) % 5) - 1.0;
}

/// n elements of T with element i = f(i).
template <class T, class F>
std::vector<T> fill(std::size_t n, F&& f) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(f(i));
  return v;
}

/// The values of a vector, widened to double (for readable Catch2 comparisons).
template <class T>
std::vector<double> values(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = value(v[i]);
  return out;
}

/// Reference values: element i = f(i), rounded through T as the test's inputs are.
template <class T, class F>
std::vector<double> expect(std::size_t n, F&& f) {
  return values(fill<T>(n, std::forward<F>(f)));
}

/// Read-only host view of a vector.
template <class T>
gradapt::tensor_view<const T> cview(const std::vector<T>& v) {
  return gradapt::tensor_view<const T>::vector(v.data(), static_cast<std::int64_t>(v.size()));
}

/// Writable host view of a vector.
template <class T>
gradapt::tensor_view<T> view(std::vector<T>& v) {
  return gradapt::tensor_view<T>::vector(v.data(), static_cast<std::int64_t>(v.size()));
}

/// Partner of rank r in round k of a round-robin over the ring: (k - r) mod n. The pairing is
/// symmetric (the partner's partner is r), so over rounds k = 0..n-1 every rank exchanges once
/// with every rank, itself included.
inline int partner(int r, int k, int n) { return ((k - r) % n + n) % n; }

/// Buffer sizes of the allreduce, broadcast and exchange scenarios.
inline constexpr std::size_t sizes[] = {0, 1, 37};

/// allreduce sums and maxes exact values.
template <class T, class Comm>
void allreduce_sum_max(Comm& c) {
  const int r = c.rank();
  const int p = c.size();
  for (const std::size_t n : sizes) {
    auto x = fill<T>(n, [&](std::size_t i) { return a(r, i); });
    c.allreduce(view(x), gradapt::reduce_op::sum);
    // sum over q < p of a(q, i) = p(p+1)/4 + p (i mod 7)/4 - p
    RANK_CHECK(values(x) == expect<T>(n, [&](std::size_t i) {
                 return 0.25 * p * (p + 1) + 0.25 * p * static_cast<double>(i % 7) - p;
               }));

    auto y = fill<T>(n, [&](std::size_t i) { return b(r, i); });
    c.allreduce(view(y), gradapt::reduce_op::max);
    RANK_CHECK(values(y) == expect<T>(n, [&](std::size_t i) {
                 double m = b(0, i);
                 for (int q = 1; q < p; ++q) m = std::max(m, b(q, i));
                 return m;
               }));
  }
}

/// broadcast copies the root's buffer, from every root.
template <class T, class Comm>
void broadcast_every_root(Comm& c) {
  for (int root = 0; root < c.size(); ++root) {
    for (const std::size_t n : sizes) {
      auto x = fill<T>(n, [&](std::size_t i) { return a(c.rank(), i); });
      c.broadcast(view(x), root);
      RANK_CHECK(values(x) == expect<T>(n, [&](std::size_t i) { return a(root, i); }));
    }
  }
}

/// allgather places rank r's block at offset r * n: separate buffers (const and mutable send
/// views) and in place.
template <class T, class Comm>
void allgather_blocks(Comm& c) {
  const int r = c.rank();
  const auto p = static_cast<std::size_t>(c.size());
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
    const auto want = expect<T>(p * n, [&](std::size_t j) { return a(static_cast<int>(j / n), j % n); });
    const auto send = fill<T>(n, [&](std::size_t i) { return a(r, i); });

    std::vector<T> recv(p * n, make<T>(99));
    c.allgather(cview(send), view(recv));
    RANK_CHECK(values(recv) == want);
    auto send_copy = send;
    std::vector<T> recv2(p * n, make<T>(99));
    c.allgather(view(send_copy), view(recv2));
    RANK_CHECK(values(recv2) == want);

    // In place: send is recv's own block.
    std::vector<T> inplace(p * n, make<T>(99));
    for (std::size_t i = 0; i < n; ++i) inplace[static_cast<std::size_t>(r) * n + i] = send[i];
    c.allgather(gradapt::tensor_view<const T>::vector(inplace.data() + static_cast<std::size_t>(r) * n,
                                                      static_cast<std::int64_t>(n)),
                view(inplace));
    RANK_CHECK(values(inplace) == want);
  }
}

/// reduce_scatter gives rank r the reduced block r, summed and maxed.
template <class T, class Comm>
void reduce_scatter_blocks(Comm& c) {
  const int r = c.rank();
  const int p = c.size();
  for (const std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{4}}) {
    const std::size_t base = static_cast<std::size_t>(r) * m;
    const auto send_a = fill<T>(static_cast<std::size_t>(p) * m, [&](std::size_t j) { return a(r, j); });
    std::vector<T> recv(m, make<T>(99));
    c.reduce_scatter(cview(send_a), view(recv), gradapt::reduce_op::sum);
    RANK_CHECK(values(recv) == expect<T>(m, [&](std::size_t i) {
                 double s = 0;
                 for (int q = 0; q < p; ++q) s += a(q, base + i);
                 return s;
               }));

    const auto send_b = fill<T>(static_cast<std::size_t>(p) * m, [&](std::size_t j) { return b(r, j); });
    c.reduce_scatter(cview(send_b), view(recv), gradapt::reduce_op::max);
    RANK_CHECK(values(recv) == expect<T>(m, [&](std::size_t i) {
                 double mx = b(0, base + i);
                 for (int q = 1; q < p; ++q) mx = std::max(mx, b(q, base + i));
                 return mx;
               }));
  }
}

/// exchange pairs every rank with every rank around the ring, itself included; with
/// `in_place` also with one buffer as send and recv (comm::mpi accepts that, comm::threads
/// rejects overlapping buffers).
template <class T, class Comm>
void exchange_round_robin(Comm& c, bool in_place) {
  const int r = c.rank();
  const int p = c.size();
  for (int k = 0; k < p; ++k) {
    const int peer = partner(r, k, p);
    for (const std::size_t n : sizes) {
      const auto send = fill<T>(n, [&](std::size_t i) { return a(r, i + static_cast<std::size_t>(k)); });
      const auto want = expect<T>(n, [&](std::size_t i) { return a(peer, i + static_cast<std::size_t>(k)); });
      std::vector<T> recv(n, make<T>(99));
      c.exchange(peer, cview(send), view(recv));
      RANK_CHECK(values(recv) == want);

      if (in_place) {  // the same buffer as send and recv
        auto both = send;
        c.exchange(peer, cview(both), view(both));
        RANK_CHECK(values(both) == want);
      }
    }
  }
}

}  // namespace comm_ops

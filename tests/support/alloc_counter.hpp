#pragma once
// The tests' allocation counter. It replaces the global unaligned operator new / delete family
// (plain, array and nothrow new; every delete) and counts each allocation per thread and in the
// whole process, and the heap bytes each thread holds (a block stays charged to the thread that
// allocated it until it is freed, on whatever thread) with their peak. The replaceable functions
// are defined once per executable, in support/alloc_counter.cpp, which tests/CMakeLists.txt
// links into every test executable whose sources include this header (in a test group, every
// test of the group then runs on the counting functions, which forward to malloc and free).
//
// The whole family is replaced so that allocation and deallocation always pair (AddressSanitizer
// checks the pairs); the functions are out of line so that GCC does not pair an inlined free()
// with `new` (-Wmismatched-new-delete). Clang's ThreadSanitizer runtime defines operator new
// itself: there the replacement is compiled out and `alloc_counter::enabled` is false, so a
// test reads `enabled` before it asserts on a count.
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRADAPT_TEST_ALLOC_COUNTER 0
#endif
#endif
#ifndef GRADAPT_TEST_ALLOC_COUNTER
#define GRADAPT_TEST_ALLOC_COUNTER 1
#endif

namespace alloc_counter {

/// True where operator new is replaced and the counts are meaningful.
inline constexpr bool enabled = GRADAPT_TEST_ALLOC_COUNTER != 0;

namespace detail {
inline thread_local std::size_t this_thread = 0;
inline std::atomic<long> process{0};
// Byte accounts: a slot per thread (threads beyond `slots` share slots modulo it).
inline constexpr std::size_t slots = 64;
inline std::atomic<long long> live[slots];
inline std::atomic<long long> peak[slots];
inline std::atomic<std::size_t> next_slot{0};
inline std::size_t my_slot() {
  static thread_local const std::size_t slot = next_slot.fetch_add(1) % slots;
  return slot;
}
}  // namespace detail

/// Allocations made by the calling thread so far.
inline std::size_t on_this_thread() { return detail::this_thread; }
/// Allocations made by every thread (OpenMP workers and rank threads included) so far.
inline long in_process() { return detail::process.load(std::memory_order_relaxed); }

/// Heap bytes the calling thread allocated and that are not yet freed.
inline long long live_bytes() { return detail::live[detail::my_slot()].load(); }
/// Starts a peak window for the calling thread: its peak is reset to its live bytes, which
/// are returned.
inline long long start_peak() {
  const std::size_t s = detail::my_slot();
  const long long now = detail::live[s].load();
  detail::peak[s].store(now);
  return now;
}
/// The calling thread's highest live bytes since its last `start_peak`.
inline long long peak_bytes() { return detail::peak[detail::my_slot()].load(); }

}  // namespace alloc_counter

#if GRADAPT_TEST_ALLOC_COUNTER
namespace alloc_counter::detail {
// Each block carries a header: its size and the slot it is charged to.
inline constexpr std::size_t header = 2 * alignof(std::max_align_t);

[[gnu::noinline]] inline void* counted_malloc(std::size_t n) noexcept {
  ++this_thread;
  process.fetch_add(1, std::memory_order_relaxed);
  void* raw = std::malloc(n + header);
  if (raw == nullptr) return nullptr;
  const std::size_t s = my_slot();
  auto* h = static_cast<std::size_t*>(raw);
  h[0] = n;
  h[1] = s;
  const long long now = live[s].fetch_add(static_cast<long long>(n)) + static_cast<long long>(n);
  long long p = peak[s].load();
  while (now > p && !peak[s].compare_exchange_weak(p, now)) {
  }
  return static_cast<unsigned char*>(raw) + header;
}

[[gnu::noinline]] inline void counted_free(void* q) noexcept {
  if (q == nullptr) return;
  void* raw = static_cast<unsigned char*>(q) - header;
  const auto* h = static_cast<const std::size_t*>(raw);
  live[h[1]].fetch_sub(static_cast<long long>(h[0]));
  std::free(raw);
}
}  // namespace alloc_counter::detail
#endif

// The replacements themselves: compiled once per executable, by support/alloc_counter.cpp
// (tests/CMakeLists.txt adds it to every test executable whose sources include this header).
#if GRADAPT_TEST_ALLOC_COUNTER && defined(GRADAPT_TEST_ALLOC_COUNTER_DEFINITIONS)
[[gnu::noinline]] void* operator new(std::size_t n) {
  if (void* p = alloc_counter::detail::counted_malloc(n)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void* operator new[](std::size_t n) {
  if (void* p = alloc_counter::detail::counted_malloc(n)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return alloc_counter::detail::counted_malloc(n);
}
[[gnu::noinline]] void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return alloc_counter::detail::counted_malloc(n);
}
[[gnu::noinline]] void operator delete(void* p) noexcept { alloc_counter::detail::counted_free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { alloc_counter::detail::counted_free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept {
  alloc_counter::detail::counted_free(p);
}
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept {
  alloc_counter::detail::counted_free(p);
}
[[gnu::noinline]] void operator delete(void* p, const std::nothrow_t&) noexcept {
  alloc_counter::detail::counted_free(p);
}
[[gnu::noinline]] void operator delete[](void* p, const std::nothrow_t&) noexcept {
  alloc_counter::detail::counted_free(p);
}
#endif

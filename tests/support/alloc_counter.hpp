#pragma once
// The tests' allocation counter. It replaces the global unaligned operator new / delete family
// (plain, array and nothrow new; every delete) and counts each allocation per thread and in the
// whole process. Include it in exactly ONE translation unit of a test executable: it defines
// the replaceable functions.
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
}  // namespace detail

/// Allocations made by the calling thread so far.
inline std::size_t on_this_thread() { return detail::this_thread; }
/// Allocations made by every thread (OpenMP workers and rank threads included) so far.
inline long in_process() { return detail::process.load(std::memory_order_relaxed); }

}  // namespace alloc_counter

#if GRADAPT_TEST_ALLOC_COUNTER
namespace alloc_counter::detail {
[[gnu::noinline]] inline void* counted_malloc(std::size_t n) noexcept {
  ++this_thread;
  process.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
}  // namespace alloc_counter::detail

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
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#endif

#pragma once
// Whether this translation unit is built with AddressSanitizer or ThreadSanitizer (GCC's
// __SANITIZE_*__ macros, Clang's __has_feature). Tests that repeat the same code over many world
// sizes run fewer of them under a sanitizer: it looks for memory, UB and race errors, which
// every world size reaches on the same code, at several times the default preset's cost.

namespace gradapt_test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool under_sanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool under_sanitizer = true;
#else
inline constexpr bool under_sanitizer = false;
#endif
#else
inline constexpr bool under_sanitizer = false;
#endif

}  // namespace gradapt_test

#pragma once
// Catch2 v3 when found, Debian's v2 single header otherwise; tests use only the common subset.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define GRADAPT_CATCH3 1
#else
#include <catch2/catch.hpp>
#define GRADAPT_CATCH3 0
#endif

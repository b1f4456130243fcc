// Catch2 v2 main for test executables that need no special start-up.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

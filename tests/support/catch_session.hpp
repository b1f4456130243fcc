#pragma once
// Catch's session, compiled once per build (support/catch_session.cpp, the library
// gradapt_test_session): the host tests' main (support/main.cpp) and the runners of the MPI,
// CUDA and NCCL tests call it instead of each compiling Catch's implementation (with Catch2 v2,
// CATCH_CONFIG_RUNNER in a translation unit compiles all of it: 20-40 s per compiler run).
namespace gradapt_test {

/// Catch::Session().run(argc, argv): the command line, then the tests; Catch's exit status.
int run_catch(int argc, char** argv);

/// As run_catch, except that a --list-* command returns 0 (Catch2 v2 returns the number of
/// listed items, which is not a failure).
int run_catch_lists_ok(int argc, char** argv);

}  // namespace gradapt_test

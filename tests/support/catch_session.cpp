// Catch's implementation and session, compiled once per build (gradapt_test_session in
// tests/CMakeLists.txt): see catch_session.hpp.
#define CATCH_CONFIG_RUNNER
#include "catch_session.hpp"

#include "catch.hpp"

namespace gradapt_test {

int run_catch(int argc, char** argv) { return Catch::Session().run(argc, argv); }

int run_catch_lists_ok(int argc, char** argv) {
  Catch::Session session;
  int result = session.applyCommandLine(argc, argv);
  if (result == 0) {
    result = session.run();
#if !GRADAPT_CATCH3
    // Catch2 v2 returns the number of listed items for --list-* commands: not a failure.
    const Catch::ConfigData& cfg = session.configData();
    if (cfg.listTests || cfg.listTestNamesOnly || cfg.listTags || cfg.listReporters) result = 0;
#endif
  }
  return result;
}

}  // namespace gradapt_test

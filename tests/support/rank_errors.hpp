#pragma once
// Runs a body on n comm::threads ranks and collects what each rank threw, for tests in which
// ranks that disagree must all throw.
#include <cstddef>
#include <string>
#include <vector>

#include "gradapt/comm/threads.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt_test {

/// Runs `body(comm)` on n threads ranks (with `options`, e.g. a short watchdog timeout) and
/// returns every rank's gradapt::error message ("" for a rank that did not throw).
template <class F>
std::vector<std::string> errors_of(int n, const gradapt::comm::threads_options& options, F&& body) {
  std::vector<std::string> what(static_cast<std::size_t>(n));
  gradapt::comm::run_threads(n, options, [&](gradapt::comm::threads& comm) {
    try {
      body(comm);
    } catch (const gradapt::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return what;
}

}  // namespace gradapt_test

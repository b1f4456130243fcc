// Paired rounds for Google Benchmark: each iteration times a triad loop, a plain loop with the
// kernel's own streams ("roof") and the kernel, back to back on the same data, so the ratios
// compare runs that saw the same machine state (other processes, frequency, page cache).
// The benchmark's manual time is the kernel's; the counters are medians over the iterations:
//
//   GBps       the kernel's effective bandwidth: the fewest bytes it must move / its time
//   triad_GBps the triad's bandwidth (12 bytes per element)
//   vs_triad   per-iteration kernel / triad bandwidth
//   vs_roof    per-iteration kernel / roof bandwidth
//
// `table_reporter` prints the console output and then one table of those medians, with an
// optional floor per benchmark (an issue's done-when) and whether it was met.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace gradapt_bench {

inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// Bytes per element of each timed loop, and the element count they apply to.
struct paired_bytes {
  double elements;  ///< elements each loop runs over
  double kernel;    ///< fewest bytes per element the kernel must move
  double roof;      ///< bytes per element the roof loop moves
};

/// Runs the benchmark's iterations as paired rounds (see the file comment).
template <class Triad, class Roof, class Kernel>
void paired_rounds(benchmark::State& st, const paired_bytes& b, Triad&& triad, Roof&& roof, Kernel&& kernel) {
  using clock = std::chrono::steady_clock;
  const auto secs = [](clock::time_point x, clock::time_point y) {
    return std::chrono::duration<double>(y - x).count();
  };
  std::vector<double> gbs, tri, vs_triad, vs_roof;
  for (auto _ : st) {
    const auto t0 = clock::now();
    triad();
    const auto t1 = clock::now();
    roof();
    const auto t2 = clock::now();
    kernel();
    const auto t3 = clock::now();
    const double k = b.kernel * b.elements / secs(t2, t3);
    const double t = 12.0 * b.elements / secs(t0, t1);
    gbs.push_back(k * 1e-9);
    tri.push_back(t * 1e-9);
    vs_triad.push_back(k / t);
    vs_roof.push_back(k / (b.roof * b.elements / secs(t1, t2)));
    st.SetIterationTime(secs(t2, t3));
  }
  st.counters["GBps"] = median_of(gbs);
  st.counters["triad_GBps"] = median_of(tri);
  st.counters["vs_triad"] = median_of(vs_triad);
  st.counters["vs_roof"] = median_of(vs_roof);
}

/// Removes `--rounds=N` from argv (before benchmark::Initialize) and returns N (or `fallback`).
inline int take_rounds(int& argc, char** argv, int fallback) {
  int rounds = fallback;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--rounds=", 9) == 0)
      rounds = std::max(1, std::atoi(argv[i] + 9));
    else
      argv[out++] = argv[i];
  }
  argc = out;
  return rounds;
}

/// Registers `fn` as paired-round benchmark `name` at 1 and 2 threads (its argument), timed
/// manually in milliseconds, `rounds` iterations.
inline void register_paired(const char* name, void (*fn)(benchmark::State&), int rounds) {
  benchmark::RegisterBenchmark(name, fn)
      ->Arg(1)
      ->Arg(2)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(rounds);
}

/// Console output, then a table of the paired counters with floors.
class table_reporter : public benchmark::ConsoleReporter {
 public:
  struct row {
    double ms, gbs, triad_gbs, vs_triad, vs_roof;
  };
  /// Floors on vs_triad by benchmark name (without arguments), checked at `floor_threads`.
  std::map<std::string, double> floors;
  int floor_threads = 2;

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred)
        rows_.push_back(
            {r.run_name.function_name,
             r.run_name.args,
             {r.GetAdjustedRealTime(), r.counters.at("GBps").value, r.counters.at("triad_GBps").value,
              r.counters.at("vs_triad").value, r.counters.at("vs_roof").value}});
    ConsoleReporter::ReportRuns(runs);
  }

  /// Prints the table; returns the number of floors missed.
  int print_table(const char* bytes_note) const {
    std::printf("\n%-22s %7s %9s %9s %10s %9s %8s %8s\n", "step", "threads", "ms", "eff GB/s", "triad GB/s",
                "vs triad", "vs roof", "floor");
    int missed = 0;
    for (const auto& [name, args, r] : rows_) {
      const auto f = floors.find(name);
      std::string verdict = "-";
      if (f != floors.end() && args == std::to_string(floor_threads)) {
        const bool met = r.vs_triad >= f->second;
        missed += met ? 0 : 1;
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2f %s", f->second, met ? "met" : "MISSED");
        verdict = buf;
      }
      std::printf("%-22s %7s %9.1f %9.1f %10.1f %9.2f %8.2f %8s\n", name.c_str(), args.c_str(), r.ms, r.gbs,
                  r.triad_gbs, r.vs_triad, r.vs_roof, verdict.c_str());
    }
    std::printf(
        "\n%s\nvs triad / vs roof: medians of per-iteration ratios to the triad loop and to a plain "
        "loop with the step's own streams, timed back to back.\n",
        bytes_note);
    return missed;
  }

 private:
  struct entry {
    std::string name, args;
    row r;
  };
  std::vector<entry> rows_;
};

}  // namespace gradapt_bench

#!/usr/bin/env bash
# Builds tests/fuzz/fuzz_load.cpp with clang's libFuzzer, AddressSanitizer and UBSan, and runs
# it for a short time as a regression guard for every state's load():
#
#   scripts/fuzz.sh [SECONDS=60] [BUILD_DIR=build/fuzz]
#
# A finding (a crash, a sanitizer report, a rejected load that changed the state, or a save /
# load round trip that is not the identity) fails the script; libFuzzer writes the input that
# caused it to BUILD_DIR/crash-*.
#
# GRADAPT_FUZZ_STEP=build only compiles BUILD_DIR/fuzz_load; GRADAPT_FUZZ_STEP=run only runs the
# one compiled before (scripts/test-all.sh compiles it while the presets build); unset, both.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
seconds=${1:-60}
out=${2:-build/fuzz}
step=${GRADAPT_FUZZ_STEP:-all}
mkdir -p "$out/corpus"
launcher=()
[ -n "${GRADAPT_COMPILE_LOG:-}" ] && launcher=(scripts/compile-cpu.sh)
# -g1: line tables, so a sanitizer report names files and lines; full debug info (-g) adds about
# a fifth to the compile and nothing to the reports.
if [ "$step" != run ]; then
  "${launcher[@]}" clang++ -std=c++20 -O1 -g1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Itests/support tests/fuzz/fuzz_load.cpp -o "$out/fuzz_load" -llapack -lopenblas
fi
if [ "$step" = build ]; then
  exit 0
fi
cd "$out"
# The checked-in seeds (tests/fuzz/seeds: one per state, "XOR nothing into its valid archive")
# start the run at every state's valid archive; new inputs go to corpus/.
seeds="$root/tests/fuzz/seeds"
./fuzz_load -max_total_time="$seconds" -max_len=4096 -seed=20261125 -print_final_stats=1 corpus "$seeds"

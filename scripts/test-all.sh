#!/usr/bin/env bash
# The whole test suite: the default build (host, MPI under mpirun with 1 to 5 ranks, and the
# CUDA/NCCL tests compiled when nvcc is found, skipping at run time without a GPU, and packed for
# a GPU machine by scripts/gpu-check.sh build), then the
# host tests again under AddressSanitizer + UBSan and under ThreadSanitizer; a short libFuzzer
# run over every state's load(); Doxygen; then Conan's `conan create` with test_package.
#
# Every phase's wall time, and the compile CPU time of each build (user + system seconds of every
# compiler and linker process, recorded by scripts/compile-cpu.sh as the builds' launcher into
# build/compile-cpu/<phase>.log), are printed as the run goes and summed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
run_start=$(date +%s)
phase_lines=()
mkdir -p build/compile-cpu
rm -f build/compile-cpu/*.log
export CMAKE_CXX_COMPILER_LAUNCHER=$PWD/scripts/compile-cpu.sh
export CMAKE_CUDA_COMPILER_LAUNCHER=$PWD/scripts/compile-cpu.sh
export CMAKE_CXX_LINKER_LAUNCHER=$PWD/scripts/compile-cpu.sh
# phase NAME COMMAND...: runs COMMAND, its compiles logged to build/compile-cpu/NAME.log, and
# records its wall time and compile CPU time.
phase() {
  local name=$1 start cpu
  shift
  start=$(date +%s)
  GRADAPT_COMPILE_LOG=$PWD/build/compile-cpu/$name.log "$@"
  cpu=0
  [ -f "build/compile-cpu/$name.log" ] && cpu=$(scripts/compile-cpu.sh --sum "build/compile-cpu/$name.log")
  phase_lines+=("$(printf '%-14s %6d s wall %7d s compile CPU' "$name" $(($(date +%s) - start)) "$cpu")")
  echo "==== time: ${phase_lines[-1]}"
}
summary() {
  local total cpu=0
  total=$(($(date +%s) - run_start))
  if compgen -G "build/compile-cpu/*.log" >/dev/null; then
    cpu=$(scripts/compile-cpu.sh --sum build/compile-cpu/*.log)
  fi
  echo "==== time by phase (wall; compile CPU = user + system seconds of every compiler and linker)"
  printf '%s\n' "${phase_lines[@]}"
  printf 'whole run      %6d s wall (%d min) %7d s compile CPU\n' "$total" $((total / 60)) "$cpu"
  if [ "$total" -gt 2700 ]; then
    echo "test-all: over the 45-minute budget (docs/design.md, Build and packaging): $((total / 60)) min"
  fi
}
# The fuzz job's two steps each keep one core busy: its compile (one clang process, about 3
# minutes) runs in the background while the presets build, and its 60 s run in the background
# while Doxygen and Conan (mostly one core each) use the other core. Each background job has its
# own process group (job control on for that job only), stopped if this script fails first.
mkdir -p build/fuzz
echo "==== fuzz: compiling build/fuzz/fuzz_load in the background (scripts/fuzz.sh)"
fuzz_start=$(date +%s)
set -m
GRADAPT_COMPILE_LOG=$PWD/build/compile-cpu/fuzz-build.log GRADAPT_FUZZ_STEP=build ./scripts/fuzz.sh 60 \
  > build/fuzz/build.log 2>&1 &
fuzz_pid=$!
set +m
trap 'kill -- "-$fuzz_pid" 2>/dev/null || true; summary' EXIT
# Each preset's configure + build and its tests, as `cmake --workflow --preset P --fresh` runs
# them, timed apart.
build_preset() { cmake --preset "$1" --fresh && cmake --build --preset "$1"; }
for preset in default asan tsan; do
  echo "==== preset: $preset"
  phase "$preset-build" build_preset "$preset"
  # The GPU check's build step packs the CUDA/NCCL binaries this build compiled (docs/gpu.md).
  if [ "$preset" = default ]; then phase gpu-pack ./scripts/gpu-check.sh build build/default; fi
  phase "$preset-test" ctest --preset "$preset"
done
fuzz_status=0
wait "$fuzz_pid" || fuzz_status=$?
fuzz_cpu=$(scripts/compile-cpu.sh --sum build/compile-cpu/fuzz-build.log 2>/dev/null || echo 0)
phase_lines+=("$(printf '%-14s %6s   (background, done %d s into the run) %d s compile CPU' fuzz-build "" $(($(date +%s) - fuzz_start)) "$fuzz_cpu")")
cat build/fuzz/build.log
if [ "$fuzz_status" -ne 0 ]; then
  echo "test-all: the fuzzer did not compile (scripts/fuzz.sh, exit status $fuzz_status)"
  exit 1
fi
echo "==== fuzz: every state's load() under libFuzzer + ASan/UBSan for 60 s (scripts/fuzz.sh), in the background"
set -m
GRADAPT_FUZZ_STEP=run ./scripts/fuzz.sh 60 > build/fuzz/fuzz.log 2>&1 &
fuzz_pid=$!
set +m
echo "==== docs: Doxygen over every public header; any warning fails (WARN_AS_ERROR in docs/Doxyfile.in)"
command -v doxygen >/dev/null || { echo "test-all: doxygen not found (scripts/setup-debian.sh installs it)"; exit 1; }
docs() {
  cmake -S . -B build/docs -G Ninja -DGRADAPT_BUILD_TESTS=OFF -DGRADAPT_BUILD_EXAMPLES=OFF \
    -DGRADAPT_BUILD_BENCH=OFF -DGRADAPT_INSTALL=OFF -DGRADAPT_WITH_CUDA=OFF >/dev/null
  cmake --build build/docs --target docs
}
phase docs docs
echo "==== packaging: conan create (the CMake install, find_package and vcpkg port layout are ctests)"
phase conan ./scripts/test-conan.sh
echo "==== fuzz (scripts/fuzz.sh, started before docs): its output"
fuzz_status=0
fuzz_wait_start=$(date +%s)
wait "$fuzz_pid" || fuzz_status=$?
phase_lines+=("$(printf '%-14s %6d s wall after docs and conan' fuzz-run $(($(date +%s) - fuzz_wait_start)))")
cat build/fuzz/fuzz.log
if [ "$fuzz_status" -ne 0 ]; then
  echo "test-all: scripts/fuzz.sh failed (exit status $fuzz_status)"
  exit 1
fi
trap - EXIT
summary
echo "test-all: every preset and the packaging test passed"

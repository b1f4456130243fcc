#!/usr/bin/env bash
# The whole test suite: the default build (host, MPI under mpirun with 1 to 5 ranks, and the
# CUDA/NCCL tests compiled when nvcc is found, skipping at run time without a GPU), then the
# host tests again under AddressSanitizer + UBSan and under ThreadSanitizer; a short libFuzzer
# run over every state's load(); Doxygen; then Conan's `conan create` with test_package.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# The fuzz job's two steps each keep one core busy: its compile (one clang process, about 3
# minutes) runs in the background while the presets build, and its 60 s run in the background
# while Doxygen and Conan (mostly one core each) use the other core. Each background job has its
# own process group (job control on for that job only), stopped if this script fails first.
mkdir -p build/fuzz
echo "==== fuzz: compiling build/fuzz/fuzz_load in the background (scripts/fuzz.sh)"
set -m
GRADAPT_FUZZ_STEP=build ./scripts/fuzz.sh 60 > build/fuzz/build.log 2>&1 &
fuzz_pid=$!
set +m
trap 'kill -- "-$fuzz_pid" 2>/dev/null || true' EXIT
for preset in default asan tsan; do
  echo "==== workflow preset: $preset"
  cmake --workflow --preset "$preset" --fresh
done
fuzz_status=0
wait "$fuzz_pid" || fuzz_status=$?
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
cmake -S . -B build/docs -G Ninja -DGRADAPT_BUILD_TESTS=OFF -DGRADAPT_BUILD_EXAMPLES=OFF \
  -DGRADAPT_BUILD_BENCH=OFF -DGRADAPT_INSTALL=OFF -DGRADAPT_WITH_CUDA=OFF >/dev/null
cmake --build build/docs --target docs
echo "==== packaging: conan create (the CMake install, find_package and vcpkg port layout are ctests)"
./scripts/test-conan.sh
echo "==== fuzz (scripts/fuzz.sh, started before docs): its output"
fuzz_status=0
wait "$fuzz_pid" || fuzz_status=$?
trap - EXIT
cat build/fuzz/fuzz.log
if [ "$fuzz_status" -ne 0 ]; then
  echo "test-all: scripts/fuzz.sh failed (exit status $fuzz_status)"
  exit 1
fi
echo "test-all: every preset and the packaging test passed"

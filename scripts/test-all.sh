#!/usr/bin/env bash
# The whole test suite: the default build (host, MPI under mpirun with 1 to 5 ranks, and the
# CUDA/NCCL tests compiled when nvcc is found, skipping at run time without a GPU), then the
# host tests again under AddressSanitizer + UBSan and under ThreadSanitizer; a short libFuzzer
# run over every state's load(); Doxygen; then Conan's `conan create` with test_package.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
for preset in default asan tsan; do
  echo "==== workflow preset: $preset"
  cmake --workflow --preset "$preset" --fresh
done
echo "==== fuzz: every state's load() under libFuzzer + ASan/UBSan for 60 s (scripts/fuzz.sh)"
./scripts/fuzz.sh 60
echo "==== docs: Doxygen over every public header; any warning fails (WARN_AS_ERROR in docs/Doxyfile.in)"
command -v doxygen >/dev/null || { echo "test-all: doxygen not found (scripts/setup-debian.sh installs it)"; exit 1; }
cmake -S . -B build/docs -G Ninja -DGRADAPT_BUILD_TESTS=OFF -DGRADAPT_BUILD_EXAMPLES=OFF \
  -DGRADAPT_BUILD_BENCH=OFF -DGRADAPT_INSTALL=OFF -DGRADAPT_WITH_CUDA=OFF >/dev/null
cmake --build build/docs --target docs
echo "==== packaging: conan create (the CMake install, find_package and vcpkg port layout are ctests)"
./scripts/test-conan.sh
echo "test-all: every preset and the packaging test passed"

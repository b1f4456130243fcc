#!/usr/bin/env bash
# The whole test suite: the default build (host, MPI under mpirun with 1 to 5 ranks, and the
# CUDA/NCCL tests compiled when nvcc is found, skipping at run time without a GPU), then the
# host tests again under AddressSanitizer + UBSan and under ThreadSanitizer; then Conan's
# `conan create` with test_package.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
for preset in default asan tsan; do
  echo "==== workflow preset: $preset"
  cmake --workflow --preset "$preset" --fresh
done
echo "==== packaging: conan create (the CMake install, find_package and vcpkg port layout are ctests)"
./scripts/test-conan.sh
echo "test-all: every preset and the packaging test passed"

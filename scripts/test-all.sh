#!/usr/bin/env bash
# The whole test suite: the default build (host, MPI under mpirun with 1 to 5 ranks, and the
# CUDA/NCCL tests compiled when nvcc is found, skipping at run time without a GPU), then the
# host tests again under AddressSanitizer + UBSan and under ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
for preset in default asan tsan; do
  echo "==== workflow preset: $preset"
  cmake --workflow --preset "$preset" --fresh
done
echo "test-all: every preset passed"

#!/usr/bin/env bash
# Builds and runs the demo: data-parallel training on N in-process ranks (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cmake --preset default >/dev/null
cmake --build --preset default --target data_parallel_sgd >/dev/null
exec ./build/default/examples/data_parallel_sgd "$@"

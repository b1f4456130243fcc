#!/usr/bin/env bash
# Builds and runs the demo (examples/demo.cpp): the digits MLP trained data-parallel with the
# composed train/ step (LAMB, AdaScale, gradient noise scale, fp16 dynamic loss scaling) on N
# in-process ranks (default 4; pass --ranks N). One progress line per epoch; demo.csv and
# demo.svg are written to build/default/demo/ (or --out DIR).
#
# Under MPI (a build with MPI found), the same binary runs one rank per process:
#   mpirun -np 4 build/default/examples/demo --mpi
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ ! -f build/default/build.ninja ]; then
  cmake --preset default >/dev/null
fi
cmake --build --preset default --target demo >/dev/null
out=build/default/demo
mkdir -p "$out"
exec ./build/default/examples/demo --out "$out" "$@"

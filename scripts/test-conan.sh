#!/usr/bin/env bash
# Conan 2: `conan create` of the header-only package with its test_package, offline (no remote
# is needed: the recipe has no requirements), once plain, once with the MPI component and once
# with the linalg component (BLAS/LAPACK from the system).
# Conan comes from PyPI into build/tools (scripts/setup-debian.sh installs it); its cache lives
# in build/conan-home so the user's ~/.conan2 is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
CONAN="${CONAN:-build/tools/bin/conan}"
if [ ! -x "$CONAN" ]; then
  echo "test-conan: $CONAN not found (run scripts/setup-debian.sh)" >&2
  exit 1
fi
export CONAN_HOME="$PWD/build/conan-home"
"$CONAN" profile detect --force >/dev/null
"$CONAN" create . -s compiler.cppstd=20 --build=missing --no-remote
if command -v mpicxx >/dev/null; then
  "$CONAN" create . -s compiler.cppstd=20 --build=missing --no-remote -o 'gradapt/*:with_mpi=True'
fi
if [ -e /usr/lib/x86_64-linux-gnu/liblapack.so ] || [ -e /usr/lib/liblapack.so ] || [ -e /usr/lib64/liblapack.so ]; then
  "$CONAN" create . -s compiler.cppstd=20 --build=missing --no-remote -o 'gradapt/*:with_linalg=True'
fi
echo "test-conan: conan create passed"

#!/usr/bin/env bash
# Installs what gradapt's build, tests, examples and benches need on Debian 12, from Debian's
# own packages. The CUDA toolkit is optional: when nvcc is on PATH or in /usr/local/cuda/bin,
# the CUDA backend's tests and benches are compiled too.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential g++ clang libclang-rt-14-dev cmake ninja-build pkg-config \
  catch2 libbenchmark-dev libopenmpi-dev openmpi-bin libomp-dev \
  libxsimd-dev libeigen3-dev libxtensor-dev libtorch-dev libopenblas-dev \
  doxygen python3 python3-venv >/dev/null
# Conan 2 (for the packaging test) from PyPI, in a virtual environment under build/.
cd "$(dirname "$0")/.."
if [ ! -x build/tools/bin/conan ]; then
  python3 -m venv build/tools
  build/tools/bin/pip install -q --disable-pip-version-check "conan>=2,<3"
fi
echo "setup-debian: build dependencies installed"

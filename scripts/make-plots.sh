#!/usr/bin/env bash
# Regenerates every plot (and the CSV files committed beside them) under docs/algorithms/img/
# by building and running the examples that write them:
#
#   adascale_digits  -> adascale_digits.svg                      (docs/algorithms/adascale.md)
#   comm_strategies  -> comm_strategies_steps.svg, comm_strategies_bytes.svg, comm_strategies.csv
#                                                  (docs/algorithms/adasum.md, local-sgd.md)
#   goodput_adapt    -> goodput_adapt.svg, noise_scale_digits.svg
#                                                  (docs/algorithms/goodput.md, gradient-noise-scale.md)
#   loss_scale_trace -> loss_scale_trace.svg, loss_scale_trace.csv (docs/algorithms/loss-scaling.md)
#   demo             -> demo.svg                                  (docs/algorithms/train-step.md)
#   optimizer_memory -> optimizer_memory.svg, optimizer_memory.csv (docs/algorithms/adafactor-sm3.md)
#   shampoo_digits   -> shampoo_digits_steps.svg, shampoo_digits_time.svg, shampoo_digits.csv
#                                                  (docs/algorithms/shampoo.md; needs BLAS/LAPACK)
#   kfac_digits      -> kfac_digits_steps.svg, kfac_digits_time.svg, kfac_digits.csv
#                                                  (docs/algorithms/kfac.md; needs BLAS/LAPACK)
#
# Every example runs with its defaults, as the pages describe. All but goodput_adapt,
# shampoo_digits and kfac_digits are deterministic (fixed seeds, fixed reduction orders): with unchanged sources
# their files come out byte-identical to the committed ones. goodput_adapt is not: it times its
# own steps and its batch-size decisions follow the measured times, so its two plots change from
# run to run (and with the machine's load); the committed ones come from one run described in
# goodput.md. shampoo_digits and kfac_digits record the wall time of their steps: their time
# plots and the seconds column of their CSVs change from run to run, while their losses and
# accuracies (the steps plots) are the same bits for a given BLAS/LAPACK library, CPU and thread
# count (they run with OPENBLAS_NUM_THREADS=1); the committed files come from one run each,
# described in shampoo.md and kfac.md.
#
# Usage: scripts/make-plots.sh [--out DIR] [--build DIR] [--skip-timed]
#   --out DIR     where the files go (default docs/algorithms/img). With another directory the
#                 script also says, file by file, whether the result equals the committed one.
#   --build DIR   build directory (default build/plots; configured if needed)
#   --skip-timed  leave out goodput_adapt, shampoo_digits and kfac_digits (their plots depend
#                 on timing; goodput_adapt needs Eigen, the other two BLAS/LAPACK)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

out=docs/algorithms/img
build=build/plots
skip_timed=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --build) build=${2:?--build needs a directory}; shift 2 ;;
    --skip-timed) skip_timed=1; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "make-plots: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

targets=(adascale_digits comm_strategies loss_scale_trace demo optimizer_memory)
[ "$skip_timed" = 1 ] || targets+=(goodput_adapt shampoo_digits kfac_digits)

# Plain -O2 with debug info (the flags a consumer typically uses), without tests, benches, docs.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADAPT_WITH_CUDA=OFF \
  -DGRADAPT_BUILD_TESTS=OFF -DGRADAPT_BUILD_BENCH=OFF -DGRADAPT_BUILD_DOCS=OFF -DGRADAPT_INSTALL=OFF \
  -DGRADAPT_BUILD_EXAMPLES=ON -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON >/dev/null
cmake --build "$build" --target "${targets[@]}" -j2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
produced=()
run() {  # run <example> <file>...: runs build/examples/<example> --out <work>, keeps the files
  local example=$1
  shift
  echo "==== $example"
  local t0=$SECONDS
  "$build/examples/$example" --out "$work" | tail -n 3
  echo "     ($((SECONDS - t0)) s)"
  for f in "$@"; do
    [ -s "$work/$f" ] || { echo "make-plots: $example did not write $f" >&2; exit 1; }
    cp "$work/$f" "$out/$f"
    produced+=("$f")
  done
}
run adascale_digits adascale_digits.svg
run comm_strategies comm_strategies_steps.svg comm_strategies_bytes.svg comm_strategies.csv
run loss_scale_trace loss_scale_trace.svg loss_scale_trace.csv
run demo demo.svg
run optimizer_memory optimizer_memory.svg optimizer_memory.csv
[ "$skip_timed" = 1 ] || run goodput_adapt goodput_adapt.svg noise_scale_digits.svg
[ "$skip_timed" = 1 ] ||
  OPENBLAS_NUM_THREADS=1 run shampoo_digits shampoo_digits_steps.svg shampoo_digits_time.svg shampoo_digits.csv
[ "$skip_timed" = 1 ] ||
  OPENBLAS_NUM_THREADS=1 run kfac_digits kfac_digits_steps.svg kfac_digits_time.svg kfac_digits.csv

echo "==== compared with the committed files (git HEAD)"
for f in "${produced[@]}"; do
  if git cat-file -e "HEAD:docs/algorithms/img/$f" 2>/dev/null; then
    if git show "HEAD:docs/algorithms/img/$f" | cmp -s - "$out/$f"; then
      echo "  same     $f"
    else
      echo "  differs  $f"
    fi
  else
    echo "  new      $f"
  fi
done
echo "make-plots: wrote ${#produced[@]} files into $out"

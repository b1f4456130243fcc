#!/usr/bin/env bash
# gradapt against PyTorch DDP on a LibTorch transformer (docs/performance.md, "LibTorch
# transformer against PyTorch DDP"), in one command:
#
#   scripts/compare-ddp.sh            # STEPS=200 SEEDS="1 2" RANKS="2 4" by default
#   STEPS=300 SEEDS="1 2 3" scripts/compare-ddp.sh
#
# 1. installs what is missing: Debian's python3-torch (1.13.1, the same libtorch_cpu as
#    libtorch-dev, so both sides run the same kernels) and python3-matplotlib for
#    /usr/bin/python3; libtorch-dev, Open MPI and cmake/ninja when absent (apt-get, as root);
# 2. configures build/compare-ddp (Release at -O2, warnings as errors, as the default preset)
#    and builds only the torch_transformer example;
# 3. runs, for every data seed and world size, examples/torch_transformer.cpp under mpirun
#    (gradapt: ZeRO-2, AdamW, loss scaling; one process per rank) and bench/ddp_transformer.py
#    (DistributedDataParallel over gloo, torch.optim.AdamW) with the same model, initial
#    weights, batches and hyperparameters, interleaved so both sides see the same machine load
#    (the order alternates with the seed). Both run unbound, one thread per rank
#    (OMP_NUM_THREADS=1); 4 ranks on a 2-core machine are oversubscribed on both sides alike;
# 4. writes each run's CSV (step, loss, step seconds) and log, build/compare-ddp/summary.md
#    (step time, optimizer-state bytes per rank, final losses, the run-to-run spread and the
#    ratios) and docs/img/ddp_transformer_loss.png (bench/plot_ddp_transformer.py).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
steps=${STEPS:-200}
seeds=${SEEDS:-"1 2"}
ranks=${RANKS:-"2 4"}
out=build/compare-ddp
py=/usr/bin/python3

# ---- 1. what is missing ----------------------------------------------------------------------
need=()
"$py" -c 'import torch' 2>/dev/null || need+=(python3-torch)
"$py" -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
[ -e /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ] || need+=(libtorch-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin libopenmpi-dev)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
if [ ${#need[@]} -gt 0 ]; then
  echo "compare-ddp: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

# ---- 2. build the example --------------------------------------------------------------------
cmake -S . -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DGRADAPT_WARNINGS_AS_ERRORS=ON -DGRADAPT_WITH_MPI=ON -DGRADAPT_WITH_CUDA=OFF \
  -DGRADAPT_BUILD_TESTS=OFF -DGRADAPT_BUILD_BENCH=OFF -DGRADAPT_BUILD_DOCS=OFF -DGRADAPT_INSTALL=OFF >"$out.configure.log" 2>&1 ||
  { cat "$out.configure.log"; exit 1; }
mv "$out.configure.log" "$out/configure.log"
nice cmake --build "$out" --target torch_transformer
exe=$out/examples/torch_transformer
[ -x "$exe" ] || { echo "compare-ddp: $exe was not built (LibTorch or MPI not found: see $out/configure.log)"; exit 1; }

# ---- 3. the runs ------------------------------------------------------------------------------
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi_flags=(--bind-to none)
mpirun --version 2>&1 | grep -q "Open MPI" && mpi_flags+=(--oversubscribe)
gradapt_run() {  # <ranks> <seed>
  local tag=gradapt_np$1_seed$2
  mpirun "${mpi_flags[@]}" -np "$1" "$exe" --steps "$steps" --data-seed "$2" --csv "$out/$tag.csv" >"$out/$tag.log" 2>&1 ||
    { cat "$out/$tag.log"; exit 1; }
  echo "  $tag: $(grep -h 'mean step time' "$out/$tag.log" | cut -d'(' -f1)"
}
ddp_run() {  # <ranks> <seed>
  local tag=ddp_np$1_seed$2
  "$py" bench/ddp_transformer.py --ranks "$1" --steps "$steps" --data-seed "$2" --csv "$out/$tag.csv" >"$out/$tag.log" 2>&1 ||
    { cat "$out/$tag.log"; exit 1; }
  echo "  $tag: $(grep -h 'mean step time' "$out/$tag.log" | cut -d'(' -f1)"
}
echo "compare-ddp: $steps steps, data seeds $seeds, ranks $ranks on $(nproc --all) cores ($(uname -m), load $(cut -d' ' -f1-3 /proc/loadavg))"
rm -f "$out"/gradapt_np*_seed*.* "$out"/ddp_np*_seed*.*
i=0
for seed in $seeds; do
  for n in $ranks; do
    if [ $((i % 2)) -eq 0 ]; then gradapt_run "$n" "$seed"; ddp_run "$n" "$seed"
    else ddp_run "$n" "$seed"; gradapt_run "$n" "$seed"; fi
    i=$((i + 1))
  done
done

# ---- 4. summary and plot ----------------------------------------------------------------------
mkdir -p docs/img
"$py" bench/plot_ddp_transformer.py --dir "$out" --png docs/img/ddp_transformer_loss.png --summary "$out/summary.md"
cat "$out/summary.md"

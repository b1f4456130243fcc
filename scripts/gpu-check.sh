#!/usr/bin/env bash
# gradapt's GPU check, in two steps (docs/gpu.md).
#
#   build [BUILD_DIR]   here, on a machine with nvcc (no GPU needed): builds, in the configured
#                       build BUILD_DIR (default build/default, which compiles the CUDA targets
#                       when nvcc is found), every CUDA and NCCL test and bench target that is
#                       not yet built, and packs the binaries, this script and a manifest of the
#                       shared libraries they need into build/gpu-pack (at most 60 MiB). A build
#                       configured without CUDA is skipped (exit 0). test-all.sh runs this step
#                       after the default preset, so it compiles nothing a second time.
#   run                 on the GPU machine, from the repository root with build/gpu-pack carried
#                       there: finds the CUDA runtime, cuBLAS, cuSOLVER and NCCL (a CUDA toolkit,
#                       or the NVIDIA Python wheels), runs every test binary and then the bench
#                       with a timeout each, within a budget of GPU_CHECK_BUDGET seconds (default
#                       420: the whole run stays under 8 minutes), and writes one report:
#                       each binary's pass / fail / skip / timeout with its Catch totals, the
#                       failing assertions, and the bench's rows. Into $OUT when set (the device
#                       tool's folder), else build/gpu-pack. Exit code 77 from a test is "no GPU".
#
# The binaries are built for CMAKE_CUDA_ARCHITECTURES (gradapt's default: 90, SASS for H100/H200)
# with the local toolkit; the GPU machine's driver must accept that CUDA version (13.x needs a
# 580+ driver). The pack carries the CUDA runtime (libcudart) it was built with, so the GPU machine
# needs the driver and, where the binaries use them, cuBLAS, cuSOLVER and NCCL.
set -u
step=${1:-}
here=$(cd "$(dirname "$0")" && pwd)
limit_mib=60

case "$step" in
build)
  root=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null) || { echo "gpu-check: run build inside the checkout"; exit 2; }
  bdir=${2:-$root/build/default}
  [ -f "$bdir/CMakeCache.txt" ] || { echo "gpu-check: no configured build in $bdir (cmake --preset default first)"; exit 2; }
  if ! grep -q '^GRADAPT_WITH_CUDA:BOOL=ON' "$bdir/CMakeCache.txt"; then
    echo "gpu-check: $bdir was configured without CUDA (no nvcc): nothing to pack"
    exit 0
  fi
  targets=$(cmake --build "$bdir" --target help 2>/dev/null |
    grep -oE '^(test_cuda_[a-z0-9_]+|test_linalg_cuda|gradapt_nccl_tests|bench_cuda)\b' | sort -u)
  [ -n "$targets" ] || { echo "gpu-check: no CUDA targets in $bdir"; exit 2; }
  # shellcheck disable=SC2086
  cmake --build "$bdir" --target $targets || { echo "gpu-check: build failed"; exit 1; }
  pack=$root/build/gpu-pack
  rm -rf "$pack"
  mkdir -p "$pack/bin"
  for t in $targets; do
    f=$(find "$bdir" -type f -name "$t" -perm -u+x | head -1)
    [ -n "$f" ] || continue
    cp "$f" "$pack/bin/"
    strip --strip-debug "$pack/bin/$t" 2>/dev/null || true
  done
  cp "$here/gpu-check.sh" "$pack/gpu-check.sh"
  # Libraries a GPU machine without Debian's packages may lack (the C++ runtime, OpenMP, Google
  # Benchmark, the CUDA runtime of the toolkit that built the binaries) travel in lib/; glibc,
  # the driver, cuBLAS, cuSOLVER and NCCL are the machine's.
  mkdir -p "$pack/lib"
  for b in "$pack"/bin/*; do
    ldd "$b" 2>/dev/null | awk '/=> \// {print $3}' |
      grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda|libcublas[A-Za-z]*|libcusolver|libcusparse|libnccl|libnvJitLink)\.so' |
      while read -r lib; do cp -nL "$lib" "$pack/lib/" 2>/dev/null || true; done
  done
  {
    echo "built $(date -u +%Y-%m-%dT%H:%MZ) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
    echo "device code: $(grep -ohE 'generate-code=arch=[^ ]+' "$bdir"/build.ninja 2>/dev/null | sort -u | tr '\n' ' ')"
    echo "carried in lib/: $(ls "$pack/lib" | tr '\n' ' ')"
    for b in "$pack"/bin/*; do
      echo "$(basename "$b"): needs $(ldd "$b" 2>/dev/null | awk '/=>/ {print $1}' |
        grep -E 'cuda|cublas|cusolver|nccl|nvrtc|nvJit' | sort | tr '\n' ' ')glibc $(objdump -T "$b" 2>/dev/null |
        grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -1)"
    done
  } > "$pack/manifest.txt"
  size=$(du -sm "$pack" | cut -f1)
  echo "gpu-check: packed $(ls "$pack/bin" | wc -l) binaries into build/gpu-pack (${size} MiB)"
  cat "$pack/manifest.txt"
  [ "$size" -le "$limit_mib" ] || { echo "gpu-check: the pack is over $limit_mib MiB; carry fewer binaries"; exit 1; }
  echo "next, on a GPU machine: bash build/gpu-pack/gpu-check.sh run (device tool: carry [\"build/gpu-pack\"])"
  ;;
run)
  out=${OUT:-$here}
  budget=${GPU_CHECK_BUDGET:-420}
  report=$out/report.txt
  logs=$out/logs
  mkdir -p "$logs"
  libdirs=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && libdirs="$libdirs:$d"
  done
  for py in python3 python; do
    command -v "$py" >/dev/null || continue
    site=$("$py" -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
    for s in $site; do
      for d in "$s"/nvidia/*/lib "$s"/nvidia/*/lib64; do [ -d "$d" ] && libdirs="$libdirs:$d"; done
    done
    break
  done
  export LD_LIBRARY_PATH="$here/lib${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  start_all=$(date +%s)
  {
    echo "gradapt gpu-check run, $(date -u +%Y-%m-%dT%H:%MZ)"
    [ -f "$here/manifest.txt" ] && sed 's/^/  /' "$here/manifest.txt"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
    else
      echo "gpu: nvidia-smi not found"
    fi
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    for b in "$here"/bin/*; do
      missing=$(ldd "$b" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
      [ -z "$missing" ] || echo "$(basename "$b"): libraries not found: $missing"
    done
    echo
  } > "$report"
  pass=0; fail=0; skip=0; late=0
  # Tests first (the bench last: it only measures what the tests have shown to work).
  for b in $(ls "$here"/bin/* | grep -v '/bench_') $(ls "$here"/bin/bench_* 2>/dev/null); do
    name=$(basename "$b")
    limit=120
    args=()
    case $name in
      bench_*) limit=150; args=(--benchmark_min_time=0.05s) ;;
      gradapt_nccl_tests) limit=90 ;;
    esac
    left=$((budget - ($(date +%s) - start_all)))
    if [ "$left" -lt 20 ]; then
      echo "$name: not run (the run's budget of ${budget}s is spent)" >> "$report"
      late=$((late + 1))
      continue
    fi
    [ "$limit" -le "$left" ] || limit=$left
    log=$logs/$name.log
    start=$(date +%s)
    timeout "$limit" "$b" "${args[@]}" > "$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    # bench_cuda exits 0 with "skipped" when it finds no device: a skip, not a pass.
    [ "$rc" -eq 0 ] && grep -q '^bench_cuda: skipped' "$log" && rc=77
    case $rc in
      0) pass=$((pass + 1)); verdict=pass ;;
      77) skip=$((skip + 1)); verdict="skip (no usable GPU)" ;;
      124) fail=$((fail + 1)); verdict="timeout after ${limit}s" ;;
      *) fail=$((fail + 1)); verdict="FAIL (exit $rc)" ;;
    esac
    {
      echo "$name: $verdict, ${secs}s; $(grep -E 'test cases|All tests passed|SKIPPED|skipped' "$log" | tail -1)"
      case $name in
        bench_*) grep -E '^(bm_|BM_)' "$log" | sed 's/^/    /' ;;
        *) [ "$rc" -eq 0 ] || grep -E -A4 'FAILED|error|Error' "$log" | head -40 | sed 's/^/    /' ;;
      esac
      [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || tail -15 "$log" | sed 's/^/    | /'
    } >> "$report"
  done
  echo >> "$report"
  echo "summary: $pass passed, $fail failed, $skip skipped, $late not run; $(($(date +%s) - start_all))s" >> "$report"
  tar -czf "$out/logs.tgz" -C "$out" logs 2>/dev/null || true
  cat "$report"
  [ "$fail" -eq 0 ] && [ "$late" -eq 0 ]
  ;;
*)
  echo "usage: scripts/gpu-check.sh build [BUILD_DIR] | run   (see the comment at its top)"
  exit 2
  ;;
esac

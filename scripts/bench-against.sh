#!/usr/bin/env bash
# Times bench/bench_factored of this tree against the same bench of another commit, built side
# by side with the same flags (plain -O2 and OpenMP, as a consumer builds) and run interleaved:
# old, new, old, new, ... so that both see the same machine load. Prints, per row present in
# both (adafactor, adafactor_torch, sm3, sm3_momentum), the median step time of each side over
# the runs and their ratio.
#
#   scripts/bench-against.sh REV [RUNS=5] [THREADS=2] [ROUNDS=9]
#
# Needs g++, Google Benchmark (libbenchmark-dev) and git; writes only under a temporary folder.
set -euo pipefail
rev=${1:?usage: scripts/bench-against.sh REV [RUNS] [THREADS] [ROUNDS]}
runs=${2:-5}
threads=${3:-2}
rounds=${4:-9}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/old"
git -C "$here" archive "$rev" include bench | tar -x -C "$work/old"
build() {  # build <tree> <out>
  g++ -std=c++20 -O2 -fopenmp -I"$1/include" -I"$1/bench" "$1/bench/bench_factored.cpp" -o "$2" \
    -lbenchmark -lpthread
}
build "$work/old" "$work/bench_old" &
build "$here" "$work/bench_new" &
wait

# One run: "<row> <ms>" per row of the bench's table at $threads threads.
run() {
  "$1" --rounds="$rounds" --benchmark_filter="/$threads/" 2>/dev/null |
    awk -v t="$threads" '$2 == t && $3 ~ /^[0-9.]+$/ {print $1, $3}'
}
for i in $(seq "$runs"); do
  run "$work/bench_old" | sed 's/^/old /' >> "$work/times"
  run "$work/bench_new" | sed 's/^/new /' >> "$work/times"
done

echo "bench_factored, $threads threads, $runs interleaved runs of $rounds rounds each: $rev (old) vs this tree (new)"
printf '%-18s %12s %12s %10s\n' row "old ms" "new ms" "new/old"
for row in adafactor adafactor_torch sm3 sm3_momentum; do
  o=$(awk -v r="$row" '$1 == "old" && $2 == r {print $3}' "$work/times" | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
  n=$(awk -v r="$row" '$1 == "new" && $2 == r {print $3}' "$work/times" | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
  [ -n "$o" ] && [ -n "$n" ] || continue
  printf '%-18s %12.1f %12.1f %10.3f\n' "$row" "$o" "$n" "$(awk -v a="$n" -v b="$o" 'BEGIN {print a / b}')"
done

#!/usr/bin/env bash
# Compiler and linker launcher that records CPU time (scripts/test-all.sh sets it as
# CMAKE_CXX_COMPILER_LAUNCHER, CMAKE_CUDA_COMPILER_LAUNCHER and CMAKE_CXX_LINKER_LAUNCHER):
# runs the command and appends one line to $GRADAPT_COMPILE_LOG (when set):
#   <user + system CPU seconds of the command and its children> <output file>
# Summed with `scripts/compile-cpu.sh --sum LOG...`.
if [ "${1:-}" = --sum ]; then
  shift
  awk '{ s += $1 } END { printf "%.0f\n", s }' "$@"
  exit 0
fi
out=""
prev=""
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  prev=$a
done
"$@"
rc=$?
if [ -n "${GRADAPT_COMPILE_LOG:-}" ]; then
  case $out in /*) ;; *) out=$PWD/$out ;; esac
  # `times` (in this shell, not a pipeline's subshell): the shell's own user and system time,
  # then its finished children's.
  t=$(mktemp)
  times > "$t"
  awk -v out="$out" 'NR == 2 {
      n = 0
      for (i = 1; i <= 2; ++i) { split($i, p, /[ms]/); n += p[1] * 60 + p[2] }
      printf "%.2f %s\n", n, out }' "$t" >> "$GRADAPT_COMPILE_LOG"
  rm -f "$t"
fi
exit $rc

#!/usr/bin/env bash
# Instructions per operation of each contender on the GPU-heap workload and the VMA replica,
# counted by callgrind inside the timed loops only (`replay` and `run_replica`), so setup and
# checking are left out. Deterministic, unlike the times.
#
# Usage: vb-bench/callgrind.sh [rows, default "0 1 2 3 4"] (rows as in VB_ONLY).
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-"0 1 2 3 4"}
cargo build --release -p vb-bench --quiet
bin=target/release/vb-bench
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
names=("tagalloc Balanced" "tagalloc MinTime" "tagalloc MinMemory" "offset-allocator 0.2" "rlsf 0.2 (in-band)" "range-alloc 0.1")

# Sum of the instructions callgrind collected (the "summary:" line of its output file).
collected() { grep '^summary:' "$1" | awk '{print $2}'; }

echo "| allocator | GPU heap: instructions/op | replica align 1 | align 16 | align 64 | align 256 |"
echo "|---|---:|---:|---:|---:|---:|"
for k in $rows; do
  VB_ONLY=$k valgrind --tool=callgrind --callgrind-out-file="$out/gpu.$k" \
    --toggle-collect='*gpu*replay*' "$bin" gpu --reps 1 --timing-only >"$out/gpu.$k.txt" 2>/dev/null
  ops=$(grep -o '[0-9]* operations' "$out/gpu.$k.txt" | awk '{print $1}')
  gpu=$(collected "$out/gpu.$k")
  line="| ${names[$k]} | $(awk -v i="$gpu" -v n="$ops" 'BEGIN{printf "%.1f", i/n}')"
  for align in 1 16 64 256; do
    # One replica run per alignment (the bench warms up with a first run: 2 runs, both
    # counted): 7200 + 14400 + the remaining frees per run.
    VB_ONLY=$k VB_ALIGNS=$align valgrind --tool=callgrind --callgrind-out-file="$out/rep.$k.$align" \
      --toggle-collect='*run_replica*' "$bin" replica --reps 1 >"$out/rep.$k.$align.txt" 2>/dev/null
    ops=$(grep -o "operations timed: [0-9]*" "$out/rep.$k.$align.txt" | awk "{print \$3}")
    ir=$(collected "$out/rep.$k.$align")
    line="$line | $(awk -v i="$ir" -v n="$ops" 'BEGIN{printf "%.1f", i/n}')"
  done
  echo "$line |"
done

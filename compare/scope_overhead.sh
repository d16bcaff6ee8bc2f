#!/usr/bin/env bash
# What a scoped tag costs a small alloc+free pair through the global allocator, measured
# side by side: `examples/scope_pairs.rs` in one process per mode, the modes interleaved
# round by round so that a noisy neighbour slows them alike. Prints the median and minimum
# ns of the timed thread's CPU time per pair of each mode (time another process holds the
# CPU is not counted) and the ratios of the medians to `untagged` (a process that never
# enters a tag).
#
#   bash compare/scope_overhead.sh        # 21 rounds
#   bash compare/scope_overhead.sh 41
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-21}
pairs=${PAIRS:-20000000}
modes="untagged tags-on scoped scoped-far enter"
cargo build --quiet --release --example scope_pairs
bin=target/release/examples/scope_pairs

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
minimum() { sort -g | head -1; }

declare -A runs=()
for _ in $(seq "$rounds"); do
  for m in $modes; do
    ns=$("$bin" "$m" "$pairs" | sed -E 's/.*: ([0-9.]+) ns per pair.*/\1/')
    runs[$m]="${runs[$m]:-} $ns"
  done
done
base=$(tr ' ' '\n' <<<"${runs[untagged]}" | grep . | median)
printf '%-12s %10s %10s %14s\n' mode median min "÷ untagged"
for m in $modes; do
  med=$(tr ' ' '\n' <<<"${runs[$m]}" | grep . | median)
  min=$(tr ' ' '\n' <<<"${runs[$m]}" | grep . | minimum)
  ratio=$(awk -v a="$med" -v b="$base" 'BEGIN {printf "%.3f", a / b}')
  printf '%-12s %10s %10s %14s\n' "$m" "$med" "$min" "$ratio"
done
echo "($rounds interleaved rounds of $pairs pairs; ns of thread CPU time per pair; 'enter' is one enter+leave)"

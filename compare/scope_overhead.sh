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
#   LAYOUTS=10 bash compare/scope_overhead.sh 3
#
# Code placement moves a pair of a few nanoseconds by more than a scope costs: one build of
# the same code read 1.08x and another 1.29x on the same machine. With LAYOUTS=N the
# example is linked N times with its functions in a different order each time (lld's
# `--shuffle-sections`, seeds 1..N), every mode runs in every layout, and the report gives
# each mode's ratio to `untagged` per layout (medians of the rounds) and the median and
# range of those ratios over the layouts: the figure to quote.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-21}
pairs=${PAIRS:-20000000}
layouts=${LAYOUTS:-1}
modes="untagged tags-on scoped scoped-far enter"

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
minimum() { sort -g | head -1; }
maximum() { sort -g | tail -1; }

bins=()
if [ "$layouts" -le 1 ]; then
  cargo build --quiet --release --example scope_pairs
  bins=(target/release/examples/scope_pairs)
else
  mkdir -p target/scope_layouts
  for seed in $(seq "$layouts"); do
    if ! cargo rustc --quiet --release --example scope_pairs -- \
      -C "link-arg=-Wl,--shuffle-sections=.text*=$seed" 2>target/scope_layouts/link.err; then
      echo "scope_overhead.sh: the linker refused --shuffle-sections (lld is needed for LAYOUTS):" >&2
      tail -3 target/scope_layouts/link.err >&2
      exit 1
    fi
    cp target/release/examples/scope_pairs "target/scope_layouts/scope_pairs-$seed"
    bins+=("target/scope_layouts/scope_pairs-$seed")
  done
  # Leave the ordinary build as it was.
  cargo build --quiet --release --example scope_pairs
fi

declare -A runs=()
for _ in $(seq "$rounds"); do
  for i in "${!bins[@]}"; do
    for m in $modes; do
      ns=$("${bins[$i]}" "$m" "$pairs" | sed -E 's/.*: ([0-9.]+) ns per pair.*/\1/')
      runs[$i,$m]="${runs[$i,$m]:-} $ns"
    done
  done
done

if [ "$layouts" -le 1 ]; then
  base=$(tr ' ' '\n' <<<"${runs[0,untagged]}" | grep . | median)
  printf '%-12s %10s %10s %14s\n' mode median min "÷ untagged"
  for m in $modes; do
    med=$(tr ' ' '\n' <<<"${runs[0,$m]}" | grep . | median)
    min=$(tr ' ' '\n' <<<"${runs[0,$m]}" | grep . | minimum)
    ratio=$(awk -v a="$med" -v b="$base" 'BEGIN {printf "%.3f", a / b}')
    printf '%-12s %10s %10s %14s\n' "$m" "$med" "$min" "$ratio"
  done
  echo "($rounds interleaved rounds of $pairs pairs; ns of thread CPU time per pair; 'enter' is one enter+leave)"
  exit 0
fi

printf '%-12s %14s %12s %22s\n' mode "median ns" "÷ untagged" "range over layouts"
declare -A ratios=()
for m in $modes; do
  all=""
  for i in "${!bins[@]}"; do
    med=$(tr ' ' '\n' <<<"${runs[$i,$m]}" | grep . | median)
    base=$(tr ' ' '\n' <<<"${runs[$i,untagged]}" | grep . | median)
    all="$all $med"
    ratios[$m]="${ratios[$m]:-} $(awk -v a="$med" -v b="$base" 'BEGIN {printf "%.3f", a / b}')"
  done
  ns=$(tr ' ' '\n' <<<"$all" | grep . | median)
  r=$(tr ' ' '\n' <<<"${ratios[$m]}" | grep . | median)
  lo=$(tr ' ' '\n' <<<"${ratios[$m]}" | grep . | minimum)
  hi=$(tr ' ' '\n' <<<"${ratios[$m]}" | grep . | maximum)
  printf '%-12s %14s %12s %22s\n' "$m" "$ns" "$r" "$lo–$hi"
done
echo "($layouts link layouts × $rounds interleaved rounds of $pairs pairs; ns of thread CPU time per"
echo " pair, median over layouts of each layout's median; ratios per layout, then their median;"
echo " 'enter' is one enter+leave, its ratio not meaningful)"

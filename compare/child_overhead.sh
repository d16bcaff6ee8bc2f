#!/usr/bin/env bash
# Child allocator overhead over its parent, measured side by side: alloc+free pairs through
# the SystemAllocator and through a child of it (`examples/child_pairs.rs`), one process per
# run, the two interleaved round by round so that a noisy neighbour slows both alike.
# Prints, per case, the median and minimum ns per pair of each and the ratios of the medians:
# the child's (which also counts requested bytes, a figure the SystemAllocator does not keep)
# and the lean child's (declared `requested_bytes: false`: every other figure, as the
# SystemAllocator keeps) over the SystemAllocator's.
#
#   bash compare/child_overhead.sh            # 21 rounds
#   bash compare/child_overhead.sh 31 grandchild   # more rounds; also a child of the child
#
# Cases (modes of the example): small pairs with the layout known at compile time (`const`,
# as for `Box<T>`) or hidden per call (`opaque`); batches of 64 allocations then 64 frees
# (`batch`); bigger pairs with one layout for the whole loop (`hoisted`). Small pairs are not
# run `hoisted`: there the compiler moves the SystemAllocator's size check and class lookup
# out of the loop, which it does not for the child's larger code, so the two would not be
# doing the same work.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-21}
extra=${2:-}
whos="system child lean${extra:+ $extra}"
cargo build --quiet --release --example child_pairs
bin=target/release/examples/child_pairs

# mode size pairs
cases=(
  "const 16 20000000"
  "opaque 16 20000000"
  "batch 16 20000000"
  "batch 1024 10000000"
  "hoisted 16384 2000000"
  "opaque 16384 2000000"
  "hoisted 262144 2000000"
  "hoisted 1048576 2000000"
  "hoisted 2097152 2000000"
  "hoisted 4194304 1000000"
)

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
minimum() { sort -g | head -1; }

printf '%-8s %8s' mode size
for w in $whos; do printf ' | %19s' "$w med / min"; done
printf ' | child/system | lean/system\n'
for case in "${cases[@]}"; do
  read -r mode size pairs <<<"$case"
  declare -A runs=()
  for _ in $(seq "$rounds"); do
    for w in $whos; do
      ns=$("$bin" "$w" "$size" "$pairs" "$mode" | sed -E 's/.*: ([0-9.]+) ns per pair.*/\1/')
      runs[$w]="${runs[$w]:-} $ns"
    done
  done
  printf '%-8s %8s' "$mode" "$size"
  for w in $whos; do
    med=$(tr ' ' '\n' <<<"${runs[$w]}" | grep . | median)
    min=$(tr ' ' '\n' <<<"${runs[$w]}" | grep . | minimum)
    printf ' | %10.2f / %6.2f' "$med" "$min"
    eval "med_$w=$med"
  done
  # shellcheck disable=SC2154 # set by the eval above
  awk -v c="$med_child" -v l="$med_lean" -v s="$med_system" \
    'BEGIN {printf " | %12.3f | %11.3f\n", c / s, l / s}'
  unset runs
done

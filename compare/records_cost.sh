#!/usr/bin/env bash
# What records and budgets cost, with tagalloc as the global allocator: instructions per
# operation under callgrind (deterministic: (Ir(n) - Ir(0)) / n, one process per case, see
# `examples/records_cost.rs`) and, with `--time`, ns per operation (medians of interleaved
# runs). Prints each mode's figure and its ratio to records off.
#
#   bash compare/records_cost.sh            # instructions
#   bash compare/records_cost.sh --time 11  # and 11 interleaved timed rounds
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=0
[ "${1:-}" = "--time" ] && rounds=${2:-11}
cargo build --quiet --release --example records_cost
bin=target/release/examples/records_cost
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

instructions() { # workload mode ops
  valgrind --tool=callgrind --callgrind-out-file="$tmp/cg" "$bin" "$1" "$2" "$3" >/dev/null 2>&1
  grep -E '^(summary|totals):' "$tmp/cg" | head -1 | awk '{print $2}'
}
per_op() { # workload mode ops
  local a b
  a=$(instructions "$1" "$2" 0)
  b=$(instructions "$1" "$2" "$3")
  awk -v a="$a" -v b="$b" -v n="$3" 'BEGIN {printf "%.1f", (b - a) / n}'
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

cases=(
  "child-pairs off sample basic warn fail"
  "churn-256 off sample basic full"
  "churn-100000 off sample basic full"
)
for case in "${cases[@]}"; do
  read -r workload modes <<<"$case"
  ops=200000
  [ "$workload" = "churn-100000" ] && ops=100000
  base=""
  for mode in $modes; do
    ir=$(per_op "$workload" "$mode" "$ops")
    [ -z "$base" ] && base=$ir
    line=$(printf '%-13s %-7s %9s instr/op  %6s x' "$workload" "$mode" "$ir" \
      "$(awk -v a="$ir" -v b="$base" 'BEGIN {printf "%.2f", a / b}')")
    if [ "$rounds" -gt 0 ]; then
      runs=""
      for _ in $(seq "$rounds"); do
        runs="$runs $("$bin" "$workload" "$mode" 1000000 | sed -E 's/.*: ([0-9.]+) ns.*/\1/')"
      done
      line="$line  $(tr ' ' '\n' <<<"$runs" | grep . | median) ns/op"
    fi
    echo "$line"
  done
done

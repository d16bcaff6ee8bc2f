#!/usr/bin/env bash
# Workloads, tagalloc against tagalloc-scoped, over N link layouts: the workload binary of
# each is linked N times with its functions in another order (lld's --shuffle-sections, seeds
# 1..N), and every layout runs both binaries ROUNDS times, interleaved. Prints, per workload
# and layout, the median CPU ms of each and their ratio, then per workload the median ratio
# over layouts and its range, and (for several workloads) the geometric mean of those medians.
# One build's ratio is a draw of its layout on this machine (docs/performance.md, "The pair
# over link layouts"); the median over layouts is the figure to quote.
#
#   LAYOUTS=8 ROUNDS=5 bash compare/workload_layouts.sh small
#   LAYOUTS=8 ROUNDS=5 bash compare/workload_layouts.sh small,churn,realloc   # built once
#   LAYOUTS=8 ROUNDS=5 bash compare/workload_layouts.sh all                   # every workload
set -euo pipefail
cd "$(dirname "$0")/.."
workloads=${1:?usage: workload_layouts.sh <workload>[,<workload>...] | all}
layouts=${LAYOUTS:-8}
rounds=${ROUNDS:-5}
dir=target/workload_layouts
export CARGO_TARGET_DIR=$PWD/$dir/target
mkdir -p "$dir"
for seed in $(seq 1 "$layouts"); do
  for alloc in tagalloc tagalloc-scoped; do
    if ! cargo rustc --quiet --release -p compare --bin workload --features "alloc-$alloc" -- \
      -C "link-arg=-Wl,--shuffle-sections=.text*=$seed" 2>"$dir/link.err"; then
      echo "workload_layouts.sh: the build or link failed (lld is needed):" >&2
      cat "$dir/link.err" >&2
      exit 1
    fi
    cp "$CARGO_TARGET_DIR/release/workload" "$dir/w-$alloc-$seed"
  done
done
python3 - "$dir" "$workloads" "$rounds" "$layouts" <<'PY'
import math, random, re, statistics, subprocess, sys
d, wls, rounds, layouts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if wls == "all":
    wls = "small,churn,realloc,collections,prodcons,larson,threads,shortlived,large,fragment"
def cpu_ms(binary, wl):
    out = subprocess.run([binary, wl], capture_output=True, text=True, check=True).stdout
    return float(re.search(r"cpu_ms=([\d.]+)", out).group(1))
medians = []
for wl in wls.split(","):
    ratios = []
    for s in range(1, layouts + 1):
        times = {"tagalloc": [], "tagalloc-scoped": []}
        for r in range(rounds):
            order = list(times)
            random.Random(r * 100 + s).shuffle(order)
            for a in order:
                times[a].append(cpu_ms(f"{d}/w-{a}-{s}", wl))
        u, sc = statistics.median(times["tagalloc"]), statistics.median(times["tagalloc-scoped"])
        ratios.append(sc / u)
        print(f"{wl} layout {s}: untagged {u:.1f} ms, scoped {sc:.1f} ms, ratio {sc / u:.3f}",
              flush=True)
    medians.append(statistics.median(ratios))
    print(f"{wl}: scoped / untagged, median over {layouts} layouts {medians[-1]:.3f}"
          f" (range {min(ratios):.3f}-{max(ratios):.3f}; {rounds} rounds per layout, CPU ms)",
          flush=True)
if len(medians) > 1:
    geomean = math.exp(sum(map(math.log, medians)) / len(medians))
    print(f"geometric mean of the {len(medians)} medians: {geomean:.3f}; highest {max(medians):.3f}")
PY

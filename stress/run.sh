#!/usr/bin/env bash
# Stress runs: what CI's single pass of the tests cannot show. Each stage found real bugs
# that single runs had passed by luck (see the README's "Stress and sanitizers" section).
#
#   bash stress/run.sh                 # every stage (about 60 minutes on 2 cores, measured
#                                      # 2026-12-05, Miri 24 and fuzzing 12 of them)
#   bash stress/run.sh models threads  # some stages
#
# Stages:
#   models    the proptest model tests with many more cases (STRESS_CASES, default 20000)
#   threads   the multi-threaded tests, release build, STRESS_ROUNDS times (default 15)
#   fork      fork while other threads allocate, STRESS_FORKS rounds (default 1000)
#   budget    threads racing to fill a Fail budget through its lanes, STRESS_BUDGET_RUNS
#             runs (default 2000; each must end at most at the limit, within a block of it)
#   valgrind  every test binary (and the demo) under valgrind memcheck, if installed
#   tsan      every test binary and the examples built with ThreadSanitizer (nightly with
#             rust-src); skips fork, fork_pools (TSan cannot fork a threaded process),
#             purge and tag_memory (their RSS checks count TSan's shadow memory)
#   miri      Miri on every pure-algorithm module, the HPHA heap's tests included
#   loom      the loom models (loom/) with up to STRESS_LOOM_PREEMPTIONS preemptions
#             (default 10; CI runs 5)
#   fuzz      each cargo-fuzz target in fuzz/ for STRESS_FUZZ_SECS seconds (default 120) on
#             its committed corpus, if `cargo fuzz` is installed (see docs/testing.md)
#
# A binary still running after STRESS_TIMEOUT seconds (default 900) under valgrind or TSan
# counts as failed (exit 124): a stall is a finding too (one was, see the README).
# Exits non-zero if any stage failed; failing logs are kept under target/stress/.
set -uo pipefail
cd "$(dirname "$0")/.."

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(models threads fork budget valgrind tsan miri loom fuzz)
logs=target/stress
limit=${STRESS_TIMEOUT:-900}
mkdir -p "$logs"
failures=()

note() { printf '== %s\n' "$*"; }
fail() {
  failures+=("$1")
  printf '!! FAILED: %s (log: %s)\n' "$1" "${2:-}"
}

# The test executables of a `cargo test --no-run` build (extra arguments passed on), one per
# line, as `name path`.
test_binaries() {
  cargo test --release --no-run --message-format=json "$@" 2>/dev/null |
    grep -o '"executable":"[^"]*"' | sed -E 's/"executable":"(.*)"/\1/' |
    while read -r path; do
      name=$(basename "$path" | sed -E 's/-[0-9a-f]{16}$//')
      echo "$name $path"
    done
}

THREAD_TESTS=(global_threads thread_churn child_threads thread_pool_threads records_threads
  child_lanes lane_transitions lane_transitions_global budget_edges pools shard_slots
  records_buffers records_report child_requested_off scoped scoped_threads budget_lanes child_sampled guarded)

stage_models() {
  local cases=${STRESS_CASES:-20000}
  note "models: $cases cases each"
  for t in hpha_model pool_model thread_pool_model child_model scoped_model; do
    local log=$logs/models_$t.log
    if PROPTEST_CASES=$cases cargo test --release --test "$t" >"$log" 2>&1; then
      echo "ok   $t"
    else
      fail "models $t" "$log"
    fi
  done
}

stage_threads() {
  local rounds=${STRESS_ROUNDS:-15}
  note "threads: $rounds rounds of ${#THREAD_TESTS[@]} binaries"
  local args=()
  for t in "${THREAD_TESTS[@]}"; do args+=(--test "$t"); done
  cargo test --release --no-run "${args[@]}" >/dev/null 2>&1 || {
    fail "threads build"
    return
  }
  for round in $(seq "$rounds"); do
    for t in "${THREAD_TESTS[@]}"; do
      local log=$logs/threads_${t}_$round.log
      if cargo test --release --test "$t" >"$log" 2>&1; then
        rm -f "$log"
      else
        fail "threads $t (round $round)" "$log"
      fi
    done
    echo "round $round done"
  done
}

stage_fork() {
  local rounds=${STRESS_FORKS:-1000}
  note "fork: $rounds rounds"
  local log=$logs/fork_pools.log
  if FORK_POOLS_ROUNDS=$rounds cargo test --release --test fork_pools >"$log" 2>&1 &&
    cargo test --release --test fork >>"$log" 2>&1; then
    echo "ok   fork, fork_pools"
  else
    fail "fork" "$log"
  fi
}

stage_budget() {
  local runs=${STRESS_BUDGET_RUNS:-2000}
  note "budget: $runs runs of the Fail budget race"
  local bin
  bin=$(test_binaries --test budget_lanes | awk '{print $2}' | head -1)
  [ -n "$bin" ] || {
    fail "budget build"
    return
  }
  local log=$logs/budget_race.log failed=0
  : >"$log"
  for _ in $(seq "$runs"); do
    "$bin" threads_racing --test-threads=1 >>"$log" 2>&1 || failed=$((failed + 1))
  done
  if [ "$failed" -eq 0 ]; then
    echo "ok   budget race ($runs runs)"
    rm -f "$log"
  else
    fail "budget race ($failed of $runs runs)" "$log"
  fi
}

stage_valgrind() {
  if ! command -v valgrind >/dev/null; then
    note "valgrind: not installed, skipped"
    return
  fi
  note "valgrind memcheck over every test binary"
  cargo build --release --example demo >/dev/null 2>&1
  local list
  list=$(test_binaries --lib --tests)
  list+=$'\n'"demo target/release/examples/demo"
  while read -r name path; do
    [ -n "$name" ] || continue
    local log=$logs/valgrind_$name.log started=$SECONDS
    # --fair-sched=yes: valgrind's default thread lock lets a thread in a tight loop starve
    # the rest (docs/testing.md, "Stress and sanitizers").
    if LANE_TRANSITIONS_SECS=2 FORK_POOLS_ROUNDS=30 timeout "$limit" \
      valgrind -q --fair-sched=yes --error-exitcode=9 --suppressions=stress/valgrind.supp \
      "$path" >"$log" 2>&1; then
      echo "ok   $name ($((SECONDS - started)) s)"
    else
      fail "valgrind $name" "$log"
    fi
  done <<<"$list"
}

stage_miri() {
  if ! cargo +nightly miri --version >/dev/null 2>&1; then
    note "miri: not installed (rustup +nightly component add miri rust-src), skipped"
    return
  fi
  note "miri: every pure-algorithm module, the HPHA heap's tests included (CI skips those)"
  local log=$logs/miri.log
  if MIRIFLAGS="-Zmiri-strict-provenance" cargo +nightly miri test --lib -- schema:: sync:: fatal:: \
    virtual_block:: records::config:: records::sample:: records::mode:: records::map:: >"$log" 2>&1; then
    echo "ok   miri"
  else
    fail "miri" "$log"
  fi
}

stage_loom() {
  local bound=${STRESS_LOOM_PREEMPTIONS:-10}
  note "loom: the concurrency models with up to $bound preemptions"
  local log=$logs/loom.log
  if LOOM_MAX_PREEMPTIONS=$bound cargo test -p tagalloc-loom --release >"$log" 2>&1; then
    echo "ok   loom"
  else
    fail "loom" "$log"
  fi
}

stage_tsan() {
  local target
  target=$(rustc +nightly -vV 2>/dev/null | sed -n 's/^host: //p')
  if [ -z "$target" ] || ! rustup +nightly component list --installed 2>/dev/null | grep -q rust-src; then
    note "tsan: needs a nightly toolchain with rust-src, skipped"
    return
  fi
  note "tsan: building the tests and examples with ThreadSanitizer ($target)"
  local dir=target/stress-tsan
  local build=(cargo +nightly build -Zbuild-std --target "$target" --release)
  export RUSTFLAGS="-Zsanitizer=thread" CARGO_TARGET_DIR=$dir
  if ! "${build[@]}" --tests --examples >"$logs/tsan_build.log" 2>&1; then
    unset RUSTFLAGS CARGO_TARGET_DIR
    fail "tsan build" "$logs/tsan_build.log"
    return
  fi
  local list
  list=$(cargo +nightly test -Zbuild-std --target "$target" --release --no-run \
    --message-format=json --lib --tests 2>/dev/null |
    grep -o '"executable":"[^"]*"' | sed -E 's/"executable":"(.*)"/\1/')
  unset RUSTFLAGS CARGO_TARGET_DIR
  for e in demo records; do list+=$'\n'"$dir/$target/release/examples/$e"; done
  while read -r path; do
    [ -n "$path" ] || continue
    local name
    name=$(basename "$path" | sed -E 's/-[0-9a-f]{16}$//')
    case $name in fork | fork_pools | purge | tag_memory) continue ;; esac
    local log=$logs/tsan_$name.log started=$SECONDS
    # allocator_may_return_null: some tests ask `System` for impossible sizes on purpose.
    # TAGALLOC_TEST_NO_FORK: tests that also fork (scoped_threads) skip their forks here.
    TAGALLOC_TEST_NO_FORK=1 LANE_TRANSITIONS_SECS=2 TSAN_OPTIONS="halt_on_error=0 allocator_may_return_null=1" \
      timeout "$limit" "$path" >"$log" 2>&1
    local rc=$? races
    races=$(grep -c 'WARNING: ThreadSanitizer' "$log")
    if [ "$rc" -eq 0 ] && [ "$races" -eq 0 ]; then
      echo "ok   $name ($((SECONDS - started)) s)"
    else
      fail "tsan $name (exit $rc, $races reports)" "$log"
    fi
  done <<<"$list"
}

stage_fuzz() {
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    note "fuzz: cargo-fuzz not installed (cargo install cargo-fuzz), skipped"
    return
  fi
  local secs=${STRESS_FUZZ_SECS:-120}
  local targets=(hpha pools child virtual_block global_threads)
  note "fuzz: ${#targets[@]} targets, $secs s each"
  # Debug assertions on (-a): tagalloc's own checks (double frees, headers) run too.
  if ! (cd fuzz && cargo +nightly fuzz build -O -a) >"$logs/fuzz_build.log" 2>&1; then
    fail "fuzz build" "$logs/fuzz_build.log"
    return
  fi
  for t in "${targets[@]}"; do
    local log=$logs/fuzz_$t.log started=$SECONDS
    # New inputs go to a scratch directory, so the committed corpus only changes on purpose.
    local scratch=target/stress/fuzz_corpus_$t
    mkdir -p "$scratch"
    if (cd fuzz && cargo +nightly fuzz run -O -a "$t" "../$scratch" "corpus/$t" -- \
      -max_total_time="$secs" -rss_limit_mb=4096) >"$log" 2>&1; then
      echo "ok   $t ($((SECONDS - started)) s, $(grep -o 'Done [0-9]* runs' "$log" | tail -1))"
    else
      fail "fuzz $t (artifacts in fuzz/artifacts/$t)" "$log"
    fi
  done
}

for stage in "${stages[@]}"; do
  case $stage in
  models | threads | fork | budget | valgrind | tsan | miri | loom | fuzz)
    started=$SECONDS
    "stage_$stage"
    note "$stage: $((SECONDS - started)) s"
    ;;
  *)
    echo "unknown stage: $stage" >&2
    exit 2
    ;;
  esac
done

if [ ${#failures[@]} -eq 0 ]; then
  note "stress: all stages passed (${stages[*]})"
else
  note "stress: ${#failures[@]} failure(s)"
  printf '   %s\n' "${failures[@]}"
  exit 1
fi

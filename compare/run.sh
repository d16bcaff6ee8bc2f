#!/usr/bin/env bash
# The allocator comparison: builds the workload binaries once per allocator (release) and runs
# them interleaved. Options are passed on: see `bash compare/run.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --release --quiet -p compare --bin compare -- "$@"

#!/usr/bin/env bash
# Instructions per small alloc+free under valgrind's callgrind, for every allocator.
# Options are passed on: see `bash compare/run.sh --help` (e.g. --n 100000, --allocators).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
exec cargo run --release --quiet -p compare --bin compare -- callgrind "$@"

#!/usr/bin/env bash
# Runs the measurements behind bench/RESULTS.md: `rds-bench rtt` and `rds-bench tput`, three
# times each, rdsd spawned with --idle spin, its poll thread on CPU 1 and the app on CPU 0.
# Raw output goes to bench/results/ (or $OUT_DIR), one file per run, with the machine's load
# before and after each run.
#
#     CARGO_TARGET_DIR=/work/target-bench bench/measure.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUNS="${RUNS:-3}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results}"
mkdir -p "$OUT_DIR"

cargo build --release -p rdsd -p rdsctl -p rds-bench -p hugepage-setup
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)"
BIN="${TARGET_DIR:-$ROOT/target}/release"

load() {
    echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    # Second top sample: CPU use over the last second (ps would give lifetime averages).
    echo "# busiest processes now: $(top -bn2 -d1 -w 200 | awk '/^top/{n++} n==2 && /^ *[0-9]+ /{if (c++ < 4) printf "%s(%s%%) ", $12, $9}')"
}

run() {
    local name=$1
    shift
    local f="$OUT_DIR/$name.txt"
    {
        echo "# $*"
        load
        "$@"
        load
    } 2>&1 | tee "$f"
}

for i in $(seq 1 "$RUNS"); do
    run "rtt-$i" "$BIN/rds-bench" rtt --spawn-rdsd "$BIN/rdsd" --poll-core 1 --app-core 0 \
        --count 100000 --warmup 10000 --size 64 --baseline both
    run "tput-$i" "$BIN/rds-bench" tput --spawn-rdsd "$BIN/rdsd" --poll-core 1 --app-core 0 \
        --count 2000000 --size 64 --baseline both
done
grep -h '^RESULT' "$OUT_DIR"/*.txt

#!/usr/bin/env bash
# Instructions per message moved by rdsd's poll threads, with one poll thread and with two
# (issue 18), counted by callgrind: a sender process sends COUNT messages of LEN bytes to a
# receiver process on the same host. With two poll threads the two apps sit on different
# threads, so every message crosses between them (tx ring -> pair ring -> rx ring).
#
# Counted: instructions executed inside PollCore::drain_tx (taking messages off tx rings and
# routing them: loopback delivery, or forwarding into a pair ring), PollCore::drain_fabric
# (taking forwarded messages and notes from other threads) and the end of a pass (column
# "publish": publishing pair rings and waking a parked thread, ShardLink::publish_rings and
# ShardLink::ring_sleepers_after_fence, ShardLink::publish before 2026-12-06; and, since then,
# the wake checks of the apps' blocked threads, SocketTable::wake_pending_after_fence, which
# drain_tx made itself before), inclusive, summed over all poll threads, divided by COUNT. Idle passes that find nothing add a few instructions per open socket; the apps'
# own instructions are not counted (they run outside rdsd).
#
# usage: bench/shards-callgrind.sh [COUNT] [LEN]   (release build: cargo build --release)
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-100000}
len=${2:-64}
bin=${BIN:-target/release}
out=${OUT:-target/shards-callgrind}
mkdir -p "$out"
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }

run() {
    local threads=$1 sock="$out/rdsd-$1.sock" args=()
    for _ in $(seq "$threads"); do args+=(--poll-core -2); done
    rm -f "$out/callgrind.$threads".*
    valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$threads.%p" -q \
        "$bin/rdsd" --control-socket "$sock" --control-core -2 "${args[@]}" --log warn \
        --state-file "$out/state-$threads" &
    local rdsd=$!
    for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
    RDSD_SOCKET=$sock "$bin/rds-testapp" recv 127.0.0.1:7001 "$count" > "$out/recv.log" &
    local recv=$!
    for _ in $(seq 600); do grep -q bound "$out/recv.log" 2>/dev/null && break; sleep 0.1; done
    RDSD_SOCKET=$sock "$bin/rds-testapp" send 127.0.0.1:7000 127.0.0.1:7001 "$count" "$len" > /dev/null
    wait "$recv"
    kill -TERM "$rdsd"
    wait "$rdsd" || true
    # Inclusive cost of each function in the whole profile (toggling collection per function
    # is not per thread in callgrind, so it can't separate two poll threads).
    local ir
    ir=$(callgrind_annotate --inclusive=yes --threshold=100 "$out/callgrind.$threads".* |
        awk '{v = $1; gsub(",", "", v); v += 0}
             /PollCore::drain_tx( |$)/ {if (v > tx) tx = v}
             /PollCore::drain_fabric( |$)/ {if (v > fab) fab = v}
             /ShardLink::publish( |$)/ {if (v > pub) pub = v}
             /ShardLink::publish_rings( |$)/ {if (v > rings) rings = v}
             /ShardLink::ring_sleepers_after_fence( |$)/ {if (v > sl) sl = v}
             /SocketTable::wake_pending_after_fence( |$)/ {if (v > wk) wk = v}
             END {printf "%d %d %d\n", tx, fab, pub + rings + sl + wk}')
    read -r tx fab pub <<< "$ir"
    ir=$((tx + fab + pub))
    printf '| %d | %d | %d B | %d | %d | %d | %d |\n' "$threads" "$count" "$len" \
        $((tx / count)) $((fab / count)) $((pub / count)) $((ir / count))
}

echo "| poll threads | messages | size | drain_tx | drain_fabric | publish | per message |"
echo "|---|---|---|---|---|---|---|"
run 1
run 2

#!/usr/bin/env bash
# Instructions the apps spend per message in shm-api (issue 18, item 2: the library publishes
# its tx ring once per batch, and releases its rx ring once per batch), counted by callgrind:
# `rds-bench tput` (one way, 64 B) against a running rdsd, once one message per call
# (`Socket::send_to`, `Socket::recv_from`) and once per batch of BATCH (`Socket::send_batch`,
# sendmmsg in the C ABI; `Socket::recv_batch`, recvmmsg: whatever is queued, up to BATCH).
# Counted: the inclusive instructions of `Socket::send_inner` (one per message) or
# `Socket::send_batch`, and of `Socket::recv_msg` or `Socket::recv_batch` (non-blocking: the
# calls that found nothing queued are in it), divided by the messages; rdsd is not under
# callgrind (its share is `bench/shards-callgrind.sh`).
#
# usage: bench/batch-callgrind.sh [COUNT] [BATCH...]   (release build: cargo build --release)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/callgrind-per.sh
count=${1:-200000}
shift || true
batches=${*:-"1 8 32"}
bin=${BIN:-target/release}
out=${OUT:-target/batch-callgrind}
mkdir -p "$out"
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
sock="$out/rdsd.sock"
rm -f "$sock"
"$bin/rdsd" --control-socket "$sock" --control-core -2 --poll-core -2 --log warn \
    --idle backoff --state-file "$out/state" &
rdsd=$!
trap 'kill -TERM $rdsd 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
echo "| messages per call | send: shm-api instructions per message | relative | receive: shm-api instructions per message | relative |"
echo "|---|---|---|---|---|"
base=
rbase=
for b in $batches; do
    rm -f "$out/callgrind.$b".*
    valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$b.%p" -q \
        "$bin/rds-bench" tput --socket "$sock" --count "$count" --size 64 --batch "$b" \
        > "$out/tput-$b.log"
    annotated=$(callgrind_annotate --inclusive=yes --threshold=100 "$out/callgrind.$b".* 2>/dev/null)
    send=$(inclusive_per "$annotated" "$count" 'shm_api::socket::Socket::send_(inner|batch)( |$)')
    recv=$(inclusive_per "$annotated" "$count" 'shm_api::socket::Socket::recv_(msg|batch)( |$)')
    base=${base:-$send}
    rbase=${rbase:-$recv}
    awk -v b="$b" -v p="$send" -v base="$base" -v r="$recv" -v rbase="$rbase" \
        'BEGIN {printf "| %d | %d | %.2f | %d | %.2f |\n", b, p, p / base, r, r / rbase}'
done

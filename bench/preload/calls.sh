#!/usr/bin/env bash
# Calls per second of librdsd's C ABI with 1..N threads of one process, each on its own socket
# (bench/preload/calls.c: non-blocking receives on an empty socket, so the fd lookup and the
# socket's own lock are what is measured, and what one thread's calls cost the others), next
# to the same receives on AF_UNIX SOCK_SEQPACKET in the same invocation; ROUNDS times
# interleaved. Prints each RESULT line and, per thread count, the medians and
# "RATIO calls threads=T rds_per_unix=X" (calls per second, rdsd over AF_UNIX).
#   bash bench/preload/calls.sh [COUNT] [ROUNDS] [THREADS...]   (defaults 2000000, 3, "1 2")
#   CALL=name: getsockname instead of the empty receive (the fd lookup alone).
#   BIN=<dir with rdsd and librdsd.so> (default target/release, built here)
set -euo pipefail
cd "$(dirname "$0")/../.."
count="${1:-2000000}"
rounds="${2:-3}"
shift 2 2>/dev/null || shift $#
threads="${*:-1 2}"
bin="${BIN:-target/release}"
[ -n "${BIN:-}" ] || cargo build --release -q -p rdsd -p rdsd-capi
tmp="$(mktemp -d)"
sock="$tmp/rdsd.sock"
trap 'kill "$rdsd_pid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
ln -s "$(realpath "$bin")/librdsd.so" "$tmp/librdsd.so.0"
cc -O2 -pthread -I shm-api/capi/include -o "$tmp/calls" bench/preload/calls.c \
    -L"$bin" -lrdsd -Wl,-rpath,"$tmp"
# rdsd's poll thread parks (backoff): nothing is sent, so it has nothing to do.
"$bin/rdsd" --control-socket "$sock" --idle backoff --poll-core -2 --control-core -2 --log warn \
    --state-file "$tmp/state" &
rdsd_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
export RDSD_SOCKET="$sock"
out="$tmp/results"
for _ in $(seq "$rounds"); do
    for t in $threads; do
        "$tmp/calls" rds "$t" "$count" "${CALL:-recv}" | tee -a "$out"
        "$tmp/calls" unix "$t" "$count" "${CALL:-recv}" | tee -a "$out"
    done
done
python3 - "$out" <<'PY'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.search(r"impl=(\w+) call=\w+ threads=(\d+) .*calls_per_s=(\d+)", line)
    if m:
        runs.setdefault((int(m.group(2)), m.group(1)), []).append(int(m.group(3)))
for t in sorted({k[0] for k in runs}):
    rds, unix = statistics.median(runs[(t, "rds")]), statistics.median(runs[(t, "unix")])
    print(f"median calls/s threads={t}: rds {rds:,.0f}  unix {unix:,.0f}")
    print(f"RATIO calls threads={t} rds_per_unix={rds / unix:.2f}")
PY

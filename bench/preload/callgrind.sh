#!/usr/bin/env bash
# Instructions a C ABI send costs beyond shm-api's own (the fd lookup, the error mapping),
# counted by callgrind: bench/preload/pingpong.c built -DUSE_CAPI, spin mode, against a
# running rdsd. Each round trip makes exactly two `rdsd_sendto` calls (a send never waits
# here); their inclusive instructions over the calls, next to `Socket::send_msg`'s inside them.
# Valgrind counts a locked instruction as one: what the lookup's locks cost in waiting (a
# locked instruction drains the store buffer, after a send the store that published the tx
# ring) is not in these figures; what they take in instructions is.
#   bash bench/preload/callgrind.sh [COUNT]        (default 20000)
#   BIN=<dir with rdsd, librdsd.so> (default target/release, built here)
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/callgrind-per.sh
count="${1:-20000}"
warmup=$((count / 10))
bin="${BIN:-target/release}"
[ -n "${BIN:-}" ] || cargo build --release -q -p rdsd -p rdsd-capi
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
tmp="$(mktemp -d)"
sock="$tmp/rdsd.sock"
trap 'kill "$rdsd_pid" 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
ln -s "$(realpath "$bin")/librdsd.so" "$tmp/librdsd.so.0"
cc -O2 -g -DUSE_CAPI -I shm-api/capi/include -o "$tmp/pp-capi" bench/preload/pingpong.c \
    -L"$bin" -lrdsd -Wl,-rpath,"$tmp"
"$bin/rdsd" --control-socket "$sock" --idle backoff --poll-core -2 --control-core -2 --log warn \
    --state-file "$tmp/state" &
rdsd_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
RDSD_SOCKET="$sock" valgrind --tool=callgrind --callgrind-out-file="$tmp/cg.out" -q \
    "$tmp/pp-capi" spin "$count" "$warmup" 64
annotated=$(callgrind_annotate --inclusive=yes --threshold=100 "$tmp/cg.out" 2>/dev/null); [ -z "${KEEP:-}" ] || cp "$tmp/cg.out" "$KEEP"
calls=$((2 * (count + warmup)))
capi=$(inclusive_per "$annotated" "$calls" ':rdsd_sendto( |$)')
inner=$(inclusive_per "$annotated" "$calls" ':shm_api::socket::Socket::send_msg( |$)')
echo "RESULT capi_send instructions_per_call=$capi shm_api_send_msg=$inner wrapper=$((capi - inner)) calls=$calls"

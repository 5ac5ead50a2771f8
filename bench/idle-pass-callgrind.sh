#!/usr/bin/env bash
# What an open socket that sends nothing costs a poll pass, counted by callgrind: one rdsd (one
# poll thread, `--idle spin`, no network transport), one app holding N bound sockets open and
# idle; the profile is zeroed once the sockets are bound and dumped SECS seconds later. Printed
# per N: the passes counted and the instructions per pass (PollCore::run_once, inclusive), and
# the difference per socket against N = 0. Needs valgrind.
#
# usage: [SECS=2] bench/idle-pass-callgrind.sh [N ...]   (default: 0 1 16 64)
#        (release build: cargo build --release -p rdsd --bins &&
#         cargo build --release -p rdsd-tests --bin rds-testapp; or BIN= a folder with both)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release}
out=${OUT:-target/idle-pass-callgrind}
secs=${SECS:-2}
counts=("$@")
((${#counts[@]})) || counts=(0 1 16 64)
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)

# measure N: prints "passes instructions-per-pass".
measure() {
    local n=$1 sock="$out/rdsd.sock" rdsd app
    rm -f "$out"/callgrind.* "$sock"
    valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.%p" -q \
        "$bin/rdsd" --control-socket "$sock" --control-core -2 --poll-core -2 --idle spin \
        --max-sockets-per-app 128 --log warn --state-file "$out/state" &
    rdsd=$!
    for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
    if ((n > 0)); then
        RDSD_SOCKET=$sock "$bin/rds-testapp" hold 127.0.0.1:7000 "$n" >"$out/hold.log" &
        app=$!
        for _ in $(seq 600); do grep -q bound "$out/hold.log" 2>/dev/null && break; sleep 0.1; done
        grep -q bound "$out/hold.log" || { echo "idle-pass-callgrind.sh: $n sockets not bound" >&2; exit 1; }
    fi
    callgrind_control -z "$rdsd" >/dev/null 2>&1
    sleep "$secs"
    callgrind_control -d "$rdsd" >/dev/null 2>&1
    [[ -z "${app:-}" ]] || { kill "$app"; wait "$app" 2>/dev/null || true; }
    kill -TERM "$rdsd"
    wait "$rdsd" || true
    local dump
    dump=$(ls "$out"/callgrind.*.1)
    local incl calls
    incl=$(callgrind_annotate --auto=no --inclusive=yes --threshold=100 "$dump" 2>/dev/null |
        awk '{v = $1; gsub(",", "", v); v += 0} /PollCore::run_once( |$)/ {if (v > m) m = v} END {printf "%d\n", m}')
    calls=$(awk '/^c?fn=/ {l = $0; sub(/^c?fn=/, "", l); id = l; sub(/ .*/, "", id); nm = l;
                           sub(/^\([0-9]+\) ?/, "", nm); if (nm != "") name[id] = nm;
                           if ($0 ~ /^cfn=/) cur = name[id]; next}
                 /^calls=/ {split($1, c, "="); if (cur ~ /PollCore::run_once$/) s += c[2]}
                 END {printf "%d\n", s}' "$dump")
    ((calls > 0)) || { echo "idle-pass-callgrind.sh: no pass counted" >&2; exit 1; }
    echo "$calls $((incl / calls))"
}

echo "| open idle sockets | passes counted | instructions per pass | per socket, against 0 |"
echo "|---|---|---|---|"
base=
for n in "${counts[@]}"; do
    read -r passes per <<<"$(measure "$n")"
    [[ -n "$base" ]] || { ((n == 0)) && base=$per; }
    if [[ -n "$base" ]] && ((n > 0)); then
        extra=$(awk -v p="$per" -v b="$base" -v n="$n" 'BEGIN {printf "%.1f", (p - b) / n}')
    else
        extra="-"
    fi
    echo "| $n | $passes | $per | $extra |"
done

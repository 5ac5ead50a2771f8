#!/usr/bin/env bash
# The C ABI's 64 B round trip (bench/preload/pingpong.c built -DUSE_CAPI) through two builds of
# librdsd, alternated ROUNDS times, each run on a fresh rdsd of its own build: on a shared
# machine whose speed drifts by minutes, only runs alternated in the same minutes compare.
#   bash bench/preload/alternate.sh BEFORE_DIR AFTER_DIR [ROUNDS] [MODE]
# The dirs hold rdsd and librdsd.so (a release build's target/release). MODE: spin (default)
# or block. As measure.sh: the poll core spins on CPU $POLL_CPU (1), the app runs on $APP_CPU (0).
# Prints "before|after RESULT pingpong ..." per run, then each side's p50s and median.
set -euo pipefail
cd "$(dirname "$0")/../.."
before="${1:?usage: alternate.sh BEFORE_DIR AFTER_DIR [ROUNDS] [MODE]}"
after="${2:?usage: alternate.sh BEFORE_DIR AFTER_DIR [ROUNDS] [MODE]}"
rounds="${3:-6}"
mode="${4:-spin}"
tmp="$(mktemp -d)"
pid=
trap '[ -z "$pid" ] || kill "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
for side in before after; do
    dir="${!side}"
    mkdir -p "$tmp/$side"
    ln -s "$(realpath "$dir")/librdsd.so" "$tmp/$side/librdsd.so.0"
    cc -O2 -DUSE_CAPI -I shm-api/capi/include -o "$tmp/$side/pp" bench/preload/pingpong.c \
        -L"$dir" -lrdsd -Wl,-rpath,"$tmp/$side"
done
for _ in $(seq "$rounds"); do
    for side in before after; do
        dir="${!side}"
        sock="$tmp/$side/rdsd.sock"
        "$dir/rdsd" --control-socket "$sock" --idle spin --poll-core "${POLL_CPU:-1}" \
            --control-core -2 --log warn --state-file "$tmp/$side/state" &
        pid=$!
        for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
        RDSD_SOCKET="$sock" taskset -c "${APP_CPU:-0}" "$tmp/$side/pp" "$mode" 100000 10000 64 |
            sed "s/^/$side /" | tee -a "$tmp/results"
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        pid=
        rm -f "$sock"
    done
done
for side in before after; do
    grep "^$side " "$tmp/results" | grep -o 'p50_ns=[0-9]*' | cut -d= -f2 | sort -n |
        awk -v s="$side" '{v[NR] = $1} END {printf "%s p50_ns: ", s; for (i = 1; i <= NR; i++) printf "%d ", v[i]; printf "(median %d)\n", v[int((NR + 1) / 2)]}'
done

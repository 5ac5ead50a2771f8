#!/usr/bin/env bash
# Multicast groups across hosts (issue 20): messages/s of a group whose owner (host A) and
# members (host B, and one on A) sit on two hosts, next to unicast RDS from A to one socket on
# B, in the same invocation. Two network namespaces joined by a veth pair, one rdsd each on
# kernel TCP; host B's rdsd has `--group-owner 239.78.0.0/16=10.78.0.1`.
#
#   group    one sender on A sends COUNT messages of LEN bytes to 239.78.0.1:5000; MEMBERS
#            members on B and one on A receive them all (checked: count and one order)
#   unicast  the same sender sends COUNT messages of LEN bytes to one socket on B
#
# Each row: the time from the sender's start until the last receiver has the last message,
# and COUNT divided by it (ROUNDS rounds, alternating, median). Process start-up (a few ms)
# is inside the time: use COUNT of 10^5 or more. Timing on a shared machine moves by a factor
# of two: read the ratio of the two rows of one invocation.
#
# usage: bench/group-hosts-bench.sh [COUNT] [LEN] [MEMBERS] [ROUNDS]   (root; BIN= a release dir)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[[ "$(id -u)" -eq 0 ]] || { echo "group-hosts-bench.sh: needs root (network namespaces)" >&2; exit 1; }
count=${1:-100000}
len=${2:-64}
members=${3:-2}
rounds=${4:-3}
if [[ -z "${BIN:-}" ]]; then
    cargo build --release -q -p rdsd -p rdsd-tests --bin rdsd --bin rds-testapp
    BIN="$ROOT/target/release"
fi
IP="$(command -v "${IP:-ip}")" || { echo "group-hosts-bench.sh: no ip(8) (iproute2)" >&2; exit 1; }
tag="rgh$$"
A="${tag}a" B="${tag}b" out="/tmp/$tag"
mkdir -p "$out"
pids=()
cleanup() {
    # Apps started inside a round's command substitution are not in `pids`: every process
    # of the two namespaces goes.
    for ns in "$A" "$B"; do
        for p in $("$IP" netns pids "$ns" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    done
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    "$IP" netns del "$A" 2>/dev/null || true
    "$IP" netns del "$B" 2>/dev/null || true
    rm -rf "$out"
}
trap cleanup EXIT
"$IP" netns add "$A"
"$IP" netns add "$B"
"$IP" link add eth0 netns "$A" type veth peer name eth0 netns "$B"
for i in 1 2; do
    ns=$A && ((i == 2)) && ns=$B
    "$IP" -n "$ns" addr add "10.78.0.$i/24" dev eth0
    "$IP" -n "$ns" link set eth0 up
    "$IP" -n "$ns" link set lo up
done
daemon() { # daemon NS I EXTRA...
    local ns=$1 i=$2
    shift 2
    "$IP" netns exec "$ns" "$BIN/rdsd" --control-socket "$out/$ns.sock" --state-file "$out/$ns.rxseq" \
        --local-addr "10.78.0.$i/32" --local-addr 127.0.0.0/8 --log warn "$@" &
    pids+=($!)
    for _ in $(seq 300); do [[ -S "$out/$ns.sock" ]] && return; sleep 0.05; done
    echo "rdsd in $ns did not start" >&2
    exit 1
}
daemon "$A" 1
daemon "$B" 2 --group-owner 239.78.0.0/16=10.78.0.1
app() { # app NS LOG ARGS... (in the background, stdout to LOG)
    local ns=$1 log=$2
    shift 2
    "$IP" netns exec "$ns" env RDSD_SOCKET="$out/$ns.sock" "$BIN/rds-testapp" "$@" >"$log" &
    pids+=($!)
}
wait_line() { # wait_line FILE PREFIX...: until every FILE has a line starting with PREFIX
    local prefix=$1
    shift
    for f in "$@"; do
        until grep -q "^$prefix" "$f" 2>/dev/null; do
            if grep -q "^FAIL" "$f" 2>/dev/null; then
                echo "$f: $(cat "$f")" >&2
                exit 1
            fi
            sleep 0.001
        done
    done
}
now() { date +%s%N; }
g=239.78.0.1:5000
app "$A" "$out/creator" group-create 10.78.0.1:7000 "$g" 1
wait_line created "$out/creator"
# One round: the time for COUNT messages to reach every receiver, in ns.
listed() { "$BIN/rdsctl" -s "$out/$A.sock" info -g --json 2>/dev/null | grep -q '"10.78.0.2"'; }
round_group() {
    local r=$1 logs=() port
    port=$((7100 + r * 20))
    # The last round's members left: the owner forgot host B (else its late Leave could
    # remove the host while this round runs).
    while listed; do sleep 0.01; done
    app "$A" "$out/m-a-$r" group-member "10.78.0.1:$port" "$g" 0 4194304 1 "$count"
    logs+=("$out/m-a-$r")
    for k in $(seq "$members"); do
        app "$B" "$out/m-b-$r-$k" group-member "10.78.0.2:$((port + k))" "$g" 0 4194304 1 "$count"
        logs+=("$out/m-b-$r-$k")
    done
    wait_line joined "${logs[@]}"
    # The owner has host B once its join arrived.
    until listed; do sleep 0.01; done
    local t0
    t0=$(now)
    app "$A" "$out/s-g-$r" send "10.78.0.1:$((port + 19))" "$g" "$count" "$len" hold
    wait_line done "${logs[@]}"
    echo $(($(now) - t0))
    # One order everywhere: every member printed the same digest.
    local d
    d=$(for f in "${logs[@]}"; do grep '^done' "$f"; done | sort -u | wc -l)
    [[ "$d" == 1 ]] || { echo "members disagree: $(cat "${logs[@]}")" >&2; exit 1; }
}
round_unicast() {
    local r=$1 port
    port=$((8100 + r * 20))
    app "$B" "$out/r-u-$r" recv "10.78.0.2:$port" "$count" 4194304
    wait_line bound "$out/r-u-$r"
    local t0
    t0=$(now)
    app "$A" "$out/s-u-$r" send "10.78.0.1:$((port + 1))" "10.78.0.2:$port" "$count" "$len" hold
    wait_line received "$out/r-u-$r"
    echo $(($(now) - t0))
}
# A warm-up of each (connections up, paths negotiated).
count_main=$count
count=2000
round_group 0 >/dev/null
round_unicast 0 >/dev/null
count=$count_main
tg=() tu=()
for r in $(seq "$rounds"); do
    tg+=("$(round_group "$r")")
    tu+=("$(round_unicast "$r")")
done
median() { printf '%s\n' "$@" | sort -n | sed -n "$((($# + 1) / 2))p"; }
mg=$(median "${tg[@]}") mu=$(median "${tu[@]}")
echo "| what | messages | receivers | median time | messages/s | messages/s ÷ unicast |"
echo "|---|---|---|---|---|---|"
awk -v c="$count" -v n="$members" -v g="$mg" -v u="$mu" 'BEGIN {
    printf "| group, owner on A, %d member(s) on B + 1 on A | %d | %d | %.1f ms | %.0f k | %.2f |\n", n, c, n + 1, g / 1e6, c / g * 1e6, u / g
    printf "| unicast A -> B, one socket | %d | 1 | %.1f ms | %.0f k | 1.00 |\n", c, u / 1e6, c / u * 1e6
}'
ms() { for t in "$@"; do awk -v t="$t" 'BEGIN {printf " %.1f", t / 1e6}'; done; }
echo "rounds, ms: group$(ms "${tg[@]}"); unicast$(ms "${tu[@]}")"

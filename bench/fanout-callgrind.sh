#!/usr/bin/env bash
# Instructions rdsd's poll thread spends per fanned-out message (issue 20), counted by
# callgrind: `rds-bench fanout` against an rdsd under callgrind, once with a multicast group
# (one send_to(group) per message) and once with N unicast sends per message, N members.
#
# Counted: PollCore::drain_tx inclusive (taking messages off tx rings, the group decision,
# the copies into the members' rx rings and the wake-ups of members asleep in recv), divided
# by the messages of the run; it includes drain_tx's look at every open socket in passes that
# find nothing (more sockets, more such passes while 64 members wake up: an upper bound). The
# group's SocketTable::group_send_as inclusive (decision, copies, wake-ups; `group_send` is
# inlined into its callers) runs only for a message: compared with the unicast upper bound it
# favours the group. The apps' own instructions are not counted.
#
# usage: bench/fanout-callgrind.sh ["MEMBERS..."] [MESSAGES]   (release build: cargo build --release)
set -euo pipefail
cd "$(dirname "$0")/.."
member_list=${1:-"1 4 16 64"}
messages=${2:-3000}
lat=100
warm=10
bin=${BIN:-target/release}
out=${OUT:-target/fanout-callgrind}
mkdir -p "$out"
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }

run() {
    local imp=$1 members=$2 sock="$out/rdsd-$1.sock"
    rm -f "$out/callgrind.$imp".* "$sock"
    valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$imp.%p" -q \
        "$bin/rdsd" --control-socket "$sock" --control-core -2 --poll-core -2 --log warn \
        --idle backoff --state-file "$out/state-$imp" &
    local rdsd=$!
    for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
    "$bin/rds-bench" fanout --socket "$sock" --members "$members" --impls "$imp" \
        --messages "$messages" --latency-count "$lat" --warmup "$warm" --window 64 \
        > "$out/fanout-$imp.log"
    kill -TERM "$rdsd"
    wait "$rdsd" || true
    # Inclusive costs (the largest entry of each function: callgrind_annotate lists a function
    # once per source file its inlined code comes from).
    callgrind_annotate --inclusive=yes --threshold=100 "$out/callgrind.$imp".* 2>/dev/null |
        awk -v m=$((messages + lat + warm)) -v imp="$imp" '{v = $1; gsub(",", "", v); v += 0}
             /PollCore::drain_tx( |$)/ {if (v > tx) tx = v}
             /SocketTable>::group_send(_as)?( |$)/ {if (v > gs) gs = v}
             END {printf "%s %d %d %d\n", imp, m, tx / m, gs / m}'
}

echo "| members | messages | group: drain_tx per message | unicast: drain_tx per fan-out | unicast: per send | group message in unicast sends | group: group_send per message | group_send in unicast sends |"
echo "|---|---|---|---|---|---|---|---|"
for members in $member_list; do
    read -r _ msgs gtx ggs < <(run group "$members")
    read -r _ _ utx _ < <(run rds "$members")
    awk -v n="$members" -v m="$msgs" -v gtx="$gtx" -v utx="$utx" -v ggs="$ggs" \
        'BEGIN {printf "| %d | %d | %d | %d | %d | %.2f | %d | %.2f |\n", n, m, gtx, utx,
                utx / n, gtx / (utx / n), ggs, ggs / (utx / n)}'
done

#!/usr/bin/env bash
# What an idle pass of a poll thread costs, by the number of poll threads (issue 18): rdsd with
# N poll threads, no app, spinning (--idle spin), under callgrind for 4 s after a 2 s start;
# instructions per PollCore::run_once, summed over the threads, and of those in
# PollCore::drain_fabric (taking from the other threads; called only when one sent something).
# Each other poll thread adds its pair ring and note queue to every pass.
#
# usage: [BIN=target/release] [THREADS="1 2 4 8"] bench/shards-idle-callgrind.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release}
out=${OUT:-target/shards-idle-callgrind}
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
mkdir -p "$out"
echo "| poll threads | passes | instructions per pass | of which drain_fabric |"
echo "|---|---|---|---|"
for n in ${THREADS:-1 2 4 8}; do
    rm -f "$out"/cg.* "$out/s.sock"
    args=()
    for _ in $(seq "$n"); do args+=(--poll-core -2); done
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.%p" -q "$bin/rdsd" \
        --control-socket "$out/s.sock" --state-file "$out/state" "${args[@]}" --control-core -2 \
        --log warn --idle spin 2>"$out/rdsd.log" &
    p=$!
    for _ in $(seq 300); do [ -S "$out/s.sock" ] && break; sleep 0.1; done
    sleep 2
    callgrind_control -z "$p" >/dev/null 2>&1
    sleep 4
    callgrind_control -d "$p" >/dev/null 2>&1
    kill -TERM "$p"
    wait "$p" || true
    # calls and inclusive cost of the functions called from PollCore::pass / run_once.
    awk -v n="$n" '
        /^fn=/ { cur = $0; sub(/^fn=\([0-9]+\) ?/, "", cur); id = $0; sub(/^fn=/, "", id); sub(/ .*/, "", id);
                 if (cur != "") name[id] = cur; else cur = name[id]; next }
        /^cfn=/ { c = $0; sub(/^cfn=\([0-9]+\) ?/, "", c); id = $0; sub(/^cfn=/, "", id); sub(/ .*/, "", id);
                  if (c != "") name[id] = c; else c = name[id]; callee = c; next }
        /^calls=/ { split($1, a, "="); ncalls = a[2]; getline; split($0, b, " ");
                    if (callee ~ /PollCore::run_once$/) { runs += ncalls; run_incl += b[2] }
                    if (callee ~ /PollCore::drain_fabric$/) { fab_incl += b[2] }
                    next }
        END { printf "| %d | %d | %d | %d |\n", n, runs, runs ? run_incl / runs : 0, runs ? fab_incl / runs : 0 }
    ' "$out"/cg.*.1
done

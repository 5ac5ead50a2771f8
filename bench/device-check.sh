#!/usr/bin/env bash
# Every timed figure issues 17 and 18 ask for, in one call sized for a lent many-core host
# (about 7 minutes on 16 CPUs with the defaults; the step limits add up to 590 s, under a
# device call's 600), from bench/bundle.sh's folder, as root:
#
#     rdsd-bundle/device-check.sh OUTDIR
#
# Steps (STEPS, default all, in this order; each under its own time limit, so one that hangs
# costs its limit and the rest still run):
#   pinned    bench/pinned-bench.sh: memif, af_packet (dpdk), af_xdp and rdsd on kernel TCP
#             against kernel TCP, 1 and 8 paths: 64 B RTT, 64 KiB RTT, 4 x 16 in flight, 1 MiB
#             one way, the per-hop breakdown (issue 17's table; af_xdp: the 64 B RTT only).
#   sourceport the 64 B RTT with 8 paths again with --path-choice source-port (Linux's choice:
#             a reply on another path than its request, so its ACK cannot ride on it): what
#             the default since 2026-11-28 (port-pair) saves.
#   scaling   bench/scaling-bench.sh: 1, 2, 4 poll threads x 1, 2, 4, 8, 16 app threads per
#             side against AF_UNIX (issue 18's table), one attachment per task.
#   socket    the same with PLACEMENT=socket (one attachment per side) for 8 and 16 threads.
#   wakeup    rds-bench blocking: a receiver woken after 60 ms of idle, p50/p99 (issue 18),
#             with idle = backoff and idle = watch.
#   tput      rds-bench tput: one app one way, 64 B, one message a call and batches of 32,
#             rdsd spinning and in its default idle mode (backoff, where sends check the
#             sleep flag with no fence: the light doorbell), msgs/s (issue 18: >= 10 M).
#             Sender on APP_CPU (default 5), receiver on RX_CPU (7), poll thread on POLL_CPU.
#   capi      the C ABI: bench/preload/calls.c (non-blocking receives on empty sockets, then
#             getsockname, one socket per thread, 1 2 4 8 threads, against the same on
#             AF_UNIX: what one call costs and whether threads' calls cost each other; the fd
#             lookup takes no lock) and bench/preload/pingpong.c
#             (64 B round trip through librdsd, spin and block), app on APP_CPU, next to
#             rds-bench rtt (the Rust API) on the same rdsd.
# Output, two files (a device call brings back at most 8): OUTDIR/summary.txt (every table,
# with the host and the commands) and OUTDIR/raw.tar.gz (JSON per run, logs).
# Environment: SECS (per transport, default 2), STEPS, and the placement knobs of the two
# scripts (defaults for 16 CPUs). Tested on the 2-core VM with every CPU knob set to -2 or
# 0-1 and SECS=1: a check that it runs end to end, not figures.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?usage: device-check.sh OUTDIR}"
mkdir -p "$out/raw"
out="$(cd "$out" && pwd)"
scripts="$here"
: "${BIN:?BIN: the folder with rdsd, rds-bench and rdsctl, set by the bundle wrapper}"
SECS="${SECS:-2}"
STEPS="${STEPS:-pinned sourceport scaling socket wakeup tput capi}"
summary="$out/summary.txt"
: >"$summary"
log() { echo "$*" | tee -a "$summary"; }

log "# device-check $(date -u +%Y-%m-%dT%H:%M:%SZ): $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(uname -r)"
# The CPU knobs name CPU ids; rdsd refuses one outside its CPU set (a container's cpuset).
log "# CPU set: $(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)"
log "# SECS=$SECS STEPS=\"$STEPS\""

# run NAME LIMIT_S ENV... -- COMMAND...: one step, its output into the summary.
run() {
    local name="$1" limit="$2"
    shift 2
    local envs=()
    while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
    shift
    log ""
    log "== $name (limit ${limit}s): ${envs[*]} $*"
    local t0=$SECONDS
    env "${envs[@]}" timeout --kill-after=10 "$limit" "$@" >"$out/raw/$name.out" 2>"$out/raw/$name.err"
    local rc=$?
    # The tables (the lines that start with | or #), not the per-run chatter; all of a short
    # step's output.
    if [[ "$name" == wakeup || "$name" == tput || "$name" == capi ]]; then
        cat "$out/raw/$name.out" >>"$summary"
    else
        grep -E '^(\||#)' "$out/raw/$name.out" >>"$summary"
    fi
    log "== $name: rc $rc, $((SECONDS - t0)) s"
    [[ $rc -eq 0 ]] || tail -5 "$out/raw/$name.err" | sed 's/^/   stderr: /' | tee -a "$summary"
}

for s in $STEPS; do
    case "$s" in
        pinned)
            run pinned 290 OUTDIR="$out/raw/pinned" -- bash "$scripts/pinned-bench.sh" -T "$SECS" ;;
        sourceport)
            run sourceport 45 OUTDIR="$out/raw/sourceport" WORKLOADS=rtt64 PATHS_LIST=8 \
                TRANSPORTS="memif dpdk tcp" \
                RDSD_ARGS="--path-choice source-port" \
                -- bash "$scripts/pinned-bench.sh" -T "$SECS" ;;
        scaling)
            run scaling 120 OUTDIR="$out/raw/scaling" -- bash "$scripts/scaling-bench.sh" -T "$SECS" ;;
        socket)
            run socket 60 OUTDIR="$out/raw/socket" PLACEMENT=socket THREADS="8 16" \
                -- bash "$scripts/scaling-bench.sh" -T "$SECS" ;;
        wakeup)
            # The poll thread and the app on CPUs of their own (POLL_CPU, default 3).
            # Both idle modes that park: backoff (two wake-ups after a park) and watch (no
            # park while a receiver sleeps).
            run wakeup 45 -- bash -c 'for idle in backoff watch; do
                "$0" blocking --spawn-rdsd "$1" --idle "$idle" --count 10000 --idle-secs 1 \
                    --wake-samples 100 --poll-core "${POLL_CPU:-3}"; done' "$BIN/rds-bench" "$BIN/rdsd" ;;
        tput)
            run tput 20 -- bash -c 'for idle in spin backoff; do for b in 1 32; do
                "$0" tput --spawn-rdsd "$1" --poll-core "${POLL_CPU:-3}" \
                    --app-core "${APP_CPU:-5}" --receiver-core "${RX_CPU:-7}" --idle "$idle" \
                    --count 3000000 --size 64 --batch "$b" --baseline none |
                    grep -E "^RESULT tput impl=rdsd" | sed "s/^/idle=$idle batch=$b /"
                done; done' "$BIN/rds-bench" "$BIN/rdsd" ;;
        capi)
            run capi 10 -- bash -c 'sock=$(mktemp -u /tmp/rdsd-capi.XXXXXX)
                "$1/rdsd" --control-socket "$sock" --idle spin --poll-core "${POLL_CPU:-3}" \
                    --control-core -2 --log warn --state-file "$sock.state" & pid=$!
                trap "kill $pid 2>/dev/null; rm -f $sock.state*" EXIT
                for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
                export RDSD_SOCKET="$sock"
                for call in recv name; do for t in 1 2 4 8; do for impl in rds unix; do
                    "$1/capi-calls" "$impl" "$t" 1000000 "$call"; done; done; done
                for mode in spin block; do
                    taskset -c "${APP_CPU:-5}" "$1/capi-pingpong" "$mode" 100000 10000 64; done
                "$1/rds-bench" rtt --socket "$sock" --count 100000 --warmup 10000 --size 64 \
                    --app-core "${APP_CPU:-5}" --baseline none | grep "^RESULT rtt"' _ "$BIN" ;;
        *) log "device-check.sh: unknown step $s" ;;
    esac
done
tar czf "$out/raw.tar.gz" -C "$out" raw && rm -rf "$out/raw"
log ""
log "# done: $summary, $out/raw.tar.gz"

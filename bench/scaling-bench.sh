#!/usr/bin/env bash
# The scaling table of issue 18: a host's RDS message rate against its poll threads. One rdsd
# with P poll threads (P in POLL_LIST), then for each T in THREADS one rds-bench --pair
# invocation with T tasks per side, each task attached on its own (--attach-per-task: an app
# each, as one MPI rank per process is, so rdsd spreads them over its poll threads), 64 B
# requests and acks, 16 in flight per task, rdsd and AF_UNIX SOCK_SEQPACKET (the baseline) in
# the same invocation. Prints one table: round trips per second per (T, P), AF_UNIX's (from the
# P = 1 runs' invocations, and every other one in the JSON), rdsd ÷ AF_UNIX and P ÷ P=1.
#
#     bash bench/scaling-bench.sh [-T SECS]          # from a checkout (builds release)
#     BIN=rdsd-bundle/bin bash bench/scaling-bench.sh  # prebuilt binaries (bench/bundle.sh)
#
# Placement (environment, defaults for a 16-CPU host; CPUs 0-1 left to the system):
#   POLL_CPUS=2,3,4,5  (the first P are rdsd's poll threads; -2 = not pinned)
#   CTRL_CPU=1  APP_CPUS=6-15  (both sides' tasks, taskset)
# Other knobs: POLL_LIST="1 2 4", THREADS="1 2 4 8 16", IDLE=spin (rdsd), MODE=busy (apps;
# or blocking), YIELD=0 (busy apps' --yield-every; 0 = pure spinning), DEPTH=16,
# OUTDIR (one JSON per run; default /tmp/scaling-bench.N). PLACEMENT=socket: rdsd places
# sockets, not apps (--placement socket), and rds-bench attaches once per side, as a
# multi-threaded process (or one under the preload library) does: its library spreads the
# tasks' sockets over the poll threads.
# On a small host (the 2-core VM): POLL_CPUS=-2,-2,-2,-2 CTRL_CPU=-2 APP_CPUS=0-1 IDLE=backoff
# MODE=blocking YIELD=8 THREADS="1 2 4": a check that it runs, not a scaling figure (every
# thread shares two CPUs).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SECS=4
while [[ $# -gt 0 ]]; do
    case "$1" in
        -T) SECS="$2"; shift 2 ;;
        *) echo "scaling-bench.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
POLL_CPUS="${POLL_CPUS:-2,3,4,5}"
CTRL_CPU="${CTRL_CPU:-1}"
APP_CPUS="${APP_CPUS:-6-15}"
POLL_LIST="${POLL_LIST:-1 2 4}"
THREADS="${THREADS:-1 2 4 8 16}"
IDLE="${IDLE:-spin}"
MODE="${MODE:-busy}"
YIELD="${YIELD:-0}"
DEPTH="${DEPTH:-16}"
OUTDIR="${OUTDIR:-/tmp/scaling-bench.$$}"
mkdir -p "$OUTDIR"
if [[ -z "${BIN:-}" ]]; then
    (cd "$HERE/.." && cargo build --release -q -p rdsd -p rds-bench -p rdsctl)
    BIN="$HERE/../target/release"
fi
IFS=, read -r -a polls <<<"$POLL_CPUS"
echo "# host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(uname -r)"
echo "# placement: poll $POLL_CPUS (first P), control $CTRL_CPU, apps $APP_CPUS; rdsd --idle $IDLE; apps $MODE (yield every $YIELD); sockets placed by ${PLACEMENT:-app}; ${SECS}s per transport"

DIR="$(mktemp -d /tmp/scaling-bench-rdsd.XXXXXX)"
RDSD_PID=""
stop_rdsd() {
    if [[ -n "$RDSD_PID" ]]; then
        kill "$RDSD_PID" 2>/dev/null || true
        wait "$RDSD_PID" 2>/dev/null || true
        RDSD_PID=""
    fi
}
trap 'stop_rdsd; rm -rf "$DIR"' EXIT

for p in $POLL_LIST; do
    if (( p > ${#polls[@]} )); then
        echo "scaling-bench.sh: $p poll threads need $p entries in POLL_CPUS ($POLL_CPUS)" >&2
        exit 2
    fi
    args=()
    for ((i = 0; i < p; i++)); do args+=(--poll-core "${polls[$i]}"); done
    attach=(--attach-per-task)
    if [[ "${PLACEMENT:-app}" == socket ]]; then
        args+=(--placement socket)
        attach=()
    fi
    sock="$DIR/rdsd-$p.sock"
    "$BIN/rdsd" --control-socket "$sock" --state-file "$DIR/state-$p" "${args[@]}" \
        --control-core "$CTRL_CPU" --idle "$IDLE" --log warn >"$DIR/rdsd-$p.log" 2>&1 &
    RDSD_PID=$!
    for _ in $(seq 100); do [[ -S "$sock" ]] && break; sleep 0.1; done
    [[ -S "$sock" ]] || { cat "$DIR/rdsd-$p.log" >&2; exit 1; }
    for t in $THREADS; do
        f="$OUTDIR/t$t-p$p.json"
        if ! taskset -c "$APP_CPUS" "$BIN/rds-bench" --pair --socket "$sock" "${attach[@]}" \
            -t "$t" -d "$DEPTH" -q 64 -a 64 -T "$SECS" --transports rds,unix \
            --mode "$MODE" --yield-every "$YIELD" -z --json >"$f" 2>"$f.err"; then
            echo "# t=$t p=$p failed: $(tail -1 "$f.err")" >&2
        fi
    done
    stop_rdsd
done

python3 - "$OUTDIR" "$POLL_LIST" "$THREADS" <<'EOF'
import json, os, sys
out, polls, threads = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def runs(t, p):
    try:
        return {r["transport"]: r for r in json.load(open(os.path.join(out, f"t{t}-p{p}.json")))["runs"]}
    except Exception:
        return None
k = lambda v: f"{v / 1e6:.2f} M" if v >= 1e6 else f"{v / 1e3:.0f} k"
head = ["app threads per side"] + [f"rdsd, {p} poll" for p in polls] + ["AF_UNIX"] + \
    [f"rdsd {p} poll ÷ AF_UNIX" for p in polls] + [f"{p} poll ÷ 1 poll" for p in polls[1:]]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for t in threads:
    rds, unix = {}, []
    for p in polls:
        r = runs(t, p)
        if r and "rds" in r:
            rds[p] = r["rds"]["msgs_per_s"]
        if r and "unix" in r:
            unix.append(r["unix"]["msgs_per_s"])
    u = max(unix) if unix else None
    row = [t] + [k(rds[p]) if p in rds else "failed" for p in polls] + [k(u) if u else "failed"]
    row += [f"{rds[p] / u:.2f}×" if p in rds and u else "" for p in polls]
    base = rds.get(polls[0])
    row += [f"{rds[p] / base:.2f}×" if p in rds and base else "" for p in polls[1:]]
    print("| " + " | ".join(str(x) for x in row) + " |")
print()
print("AF_UNIX: the best of its runs for that thread count (one per poll-thread setting, each in")
print("the same invocation as rdsd's). Round trips per second (acks received).")
EOF
echo "# JSON per run: $OUTDIR"

#!/usr/bin/env bash
# What a path costs: bench/netns-bench.sh (rdsd on kernel TCP between two namespaces, kernel
# TCP baseline in the same invocation) with 1 and with 8 paths, for one or more builds of the
# binaries, runs interleaved; then the same runs with `strace -c` on the active rdsd's poll
# thread (rdsd-poll-0) for 2 s, to count its system calls per round trip (divided by its
# sendmsg calls: one request written per round trip). Prints a summary. Needs root, strace,
# python3.
#
#     BINS="before=/tmp/bin-before after=/tmp/bin-after" REPS=10 bash bench/paths-bench.sh OUT
#
# Environment: BINS (label=folder with rdsd, rds-bench, rdsctl; default: this tree's release
# build, built), REPS (clean runs per build and path count, default 5), STRACE_REPS (default 3),
# PATHS_LIST (default "1 8"); further rds-bench flags in ARGS (default: 64 B request, 64 B ack,
# 1 in flight, blocking apps, 5 s).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: paths-bench.sh OUTDIR}"
mkdir -p "$OUT"
if [[ -z "${BINS:-}" ]]; then
    (cd "$ROOT" && cargo build --release -q -p rdsd -p rds-bench -p rdsctl)
    BINS="this=$ROOT/target/release"
fi
ARGS="${ARGS:--T 5 -t 1 -d 1 -q 64 -a 64 --transports rds,tcp --mode blocking -z}"
run() { # label dir paths outdir strace
    local label=$1 bin=$2 paths=$3 out=$4 st=$5 sp=
    mkdir -p "$out"
    if [[ $st = 1 ]]; then
        (
            sleep 3
            tid=
            for p in $(pgrep -x rdsd); do
                tr '\0' ' ' <"/proc/$p/cmdline" | grep -q "rsb[0-9]*a.sock" || continue
                for t in /proc/"$p"/task/*; do
                    [[ "$(cat "$t/comm")" = rdsd-poll-0 ]] && tid=${t##*/}
                done
            done
            if [[ -n "$tid" ]]; then
                timeout -s INT 2 strace -c -p "$tid" -o "$out/strace.txt" 2>/dev/null || true
            fi
        ) &
        sp=$!
    fi
    # shellcheck disable=SC2086
    BIN="$bin" PATHS="$paths" bash "$ROOT/bench/netns-bench.sh" $ARGS >"$out/output.txt" 2>&1 || true
    if [[ -n "$sp" ]]; then wait "$sp" || true; fi
    echo "$label paths=$paths $(basename "$out") done"
}
for rep in $(seq "${REPS:-5}"); do
    for paths in ${PATHS_LIST:-1 8}; do
        for lb in $BINS; do run "${lb%%=*}" "${lb#*=}" "$paths" "$OUT/${lb%%=*}-p$paths-r$rep" 0; done
    done
done
for rep in $(seq "${STRACE_REPS:-3}"); do
    for paths in ${PATHS_LIST:-1 8}; do
        for lb in $BINS; do run "${lb%%=*}" "${lb#*=}" "$paths" "$OUT/${lb%%=*}-p$paths-s$rep" 1; done
    done
done
python3 - "$OUT" <<'EOF'
import os, re, statistics, sys
out = sys.argv[1]
runs = {}
for d in sorted(os.listdir(out)):
    m = re.fullmatch(r"(.+)-p(\d+)-([rs])(\d+)", d)
    if m:
        runs.setdefault((m[1], int(m[2]), m[3]), []).append(os.path.join(out, d))
print("64 B RTT p50 (us): rdsd, kernel TCP same run, ratio; medians over runs")
for (label, paths, kind), dirs in sorted(runs.items()):
    if kind != "r":
        continue
    rows = []
    for d in dirs:
        t = open(os.path.join(d, "output.txt")).read()
        p = dict((k, float(v)) for k, v in re.findall(r"^  (rdsd|kernel TCP) \(\w+\)\s+[\d.]+ k\s+([\d.]+) us", t, re.M))
        if len(p) == 2:
            rows.append((p["rdsd"], p["kernel TCP"], p["rdsd"] / p["kernel TCP"]))
    if rows:
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"  {label:8} {paths} paths, {len(rows)} runs: rdsd {med[0]:.1f}  kernel TCP {med[1]:.1f}  ratio {med[2]:.2f}"
              f"  (rdsd runs: {' '.join(f'{r[0]:.1f}' for r in rows)})")
print("active rdsd poll thread, syscalls per round trip under strace (one line per run)")
for (label, paths, kind), dirs in sorted(runs.items()):
    if kind != "s":
        continue
    for d in dirs:
        f = os.path.join(d, "strace.txt")
        if not os.path.exists(f):
            continue
        m = {}
        for l in open(f):
            x = l.split()
            if len(x) >= 5 and x[3].isdigit() and x[-1] not in ("total", "syscall"):
                m[x[-1]] = int(x[3])
        rt = m.get("sendmsg", 0) or 1
        cols = " ".join(f"{k} {m.get(k, 0) / rt:.2f}" for k in ("recvfrom", "ioctl", "epoll_wait", "sched_yield", "futex"))
        print(f"  {label:8} {paths} paths: {rt} round trips; {cols}; all {sum(m.values()) / rt:.1f}")
EOF

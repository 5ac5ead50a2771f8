#!/usr/bin/env bash
# The pinned comparison of issue 17 on a many-core host: two rdsd in two network namespaces
# (bench/netns-bench.sh) with every thread on a CPU of its own and `--idle spin`, each rdsd
# transport next to kernel TCP between the same namespaces in the same invocation, then one
# table of ratios. Needs root and >= 14 CPUs with the default placement.
#
#     bash bench/pinned-bench.sh [-T SECS]        # from a checkout (builds release)
#     rdsd-bundle/run.sh [-T SECS]                # from bench/bundle.sh's folder
#
# Placement (environment, defaults for a 16-CPU host; CPUs 0-1 left to the system):
#   POLL_CPUS=3,9  CTRL_CPUS=2,8  APP_CPUS_A=4-7  APP_CPUS_B=10-13
# Other knobs: TRANSPORTS="memif dpdk af_xdp tcp" (dpdk = net_af_packet, af_xdp = net_af_xdp, over a veth), PATHS_LIST="1 8",
# WORKLOADS="rtt64 rtt64k pipe oneway1m hops" (hops: 64 B requests, 96 B acks with
# rds-bench --breakdown and rdsd --trace-hops: where a round trip's time goes), OUTDIR (JSON per run; default /tmp/pinned-bench.N),
# RDSD_ARGS (extra flags for both rdsd, e.g. "--path-choice source-port": Linux's path choice,
# replies on other paths than their requests, see bench/RESULTS.md).
# Each line of the table: rdsd's figure, kernel TCP's from the same rds-bench invocation (same
# CPUs for the app tasks), and rdsd ÷ kernel (for latency < 1 is better for rdsd; for rates
# > 1 is better).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SECS=4
while [[ $# -gt 0 ]]; do
    case "$1" in
        -T) SECS="$2"; shift 2 ;;
        *) echo "pinned-bench.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
export POLL_CPUS="${POLL_CPUS:-3,9}" CTRL_CPUS="${CTRL_CPUS:-2,8}"
export APP_CPUS_A="${APP_CPUS_A:-4-7}" APP_CPUS_B="${APP_CPUS_B:-10-13}"
export IDLE=spin
TRANSPORTS="${TRANSPORTS:-memif dpdk af_xdp tcp}"
PATHS_LIST="${PATHS_LIST:-1 8}"
WORKLOADS="${WORKLOADS:-rtt64 rtt64k pipe oneway1m hops}"
OUTDIR="${OUTDIR:-/tmp/pinned-bench.$$}"
mkdir -p "$OUTDIR"
if [[ -z "${BIN:-}" ]]; then
    (cd "$HERE/.." && cargo build --release -q -p rdsd -p rds-bench -p rdsctl)
    export BIN="$HERE/../target/release"
fi
echo "# host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(uname -r)"
echo "# placement: poll $POLL_CPUS, control $CTRL_CPUS, apps $APP_CPUS_A / $APP_CPUS_B, idle spin, ${SECS}s per transport"

# PROFILE=1 (needs perf; a bundle made with PERF=1 has it): during each rtt64 run, sample the
# sending rdsd's poll thread for 2 s and keep the flat profile next to the JSON (.perf.txt).
PERF="${PERF:-perf}"
profile_poll() {
    local out="$1" pid="" tid=""
    for _ in $(seq 300); do
        pgrep -f 'rds-bench -s 10.77.0.2' >/dev/null && break
        sleep 0.1
    done
    sleep 0.5
    pid=$(pgrep -f 'rdsd --control-socket /tmp/rsb[0-9]*a.sock' | head -1)
    [[ -n "$pid" ]] || return 0
    for t in /proc/"$pid"/task/*; do
        [[ "$(cat "$t/comm")" == rdsd-poll-0 ]] && tid="${t##*/}"
    done
    [[ -n "$tid" ]] || return 0
    "$PERF" record -e cpu-clock -F 10000 -t "$tid" -o "$out.data" -- sleep 2 >/dev/null 2>&1 || return 0
    "$PERF" report -i "$out.data" --stdio --no-children --sort symbol 2>/dev/null |
        grep -E '^ +[0-9.]+%' | head -40 >"$out.perf.txt"
    rm -f "$out.data"
}

flags_of() {
    case "$1" in
        rtt64) echo "-t 1 -d 1 -q 64 -a 64" ;;
        rtt64k) echo "-t 1 -d 1 -q 65536 -a 64" ;;
        pipe) echo "-t 4 -d 16 -q 64 -a 64" ;;
        oneway1m) echo "-t 1 -d 8 -q 1048576 -a 64 -o" ;;
        hops) echo "-t 1 -d 1 -q 64 -a 96 --breakdown" ;;
        *) echo "pinned-bench.sh: unknown workload $1" >&2; exit 2 ;;
    esac
}
for w in $WORKLOADS; do
    for t in $TRANSPORTS; do
        for p in $PATHS_LIST; do
            # Large transfers and the pipeline only where the issue asks for them.
            [[ "$w" = rtt64 || "$w" = hops || "$p" = "${PATHS_LIST##* }" ]] || continue
            [[ "$w" = rtt64 || "$w" = hops || "$t" != dpdk ]] || continue
            [[ "$w" = rtt64 || "$t" != af_xdp ]] || continue
            f="$OUTDIR/$w-$t-$p.json"
            # A spinning leftover on a pinned CPU would time-slice with the run (4 ms steps).
            if pgrep -x rdsd >/dev/null; then
                echo "# WARNING: an rdsd is already running: $(pgrep -ax rdsd | head -3 | tr '\n' ';')" >&2
            fi
            echo "# $w over $t, $p paths" >&2
            # shellcheck disable=SC2046
            trace=""
            [[ "$w" != hops ]] || trace=1
            prof=""
            if [[ -n "${PROFILE:-}" && "$w" = rtt64 ]]; then
                profile_poll "$OUTDIR/$w-$t-$p" &
                prof=$!
            fi
            if ! TRACE_HOPS="$trace" TRANSPORT="$t" PATHS="$p" bash "$HERE/netns-bench.sh" -T "$SECS" $(flags_of "$w") \
                --transports rds,tcp --yield-every 0 --mode busy -z --json >"$f" 2>"$f.err"; then
                echo "# FAILED: $w over $t, $p paths (see $f.err)" >&2
                tail -5 "$f.err" >&2 || true
            fi
            [[ -z "$prof" ]] || wait "$prof" || true
        done
    done
done
if ! command -v python3 >/dev/null; then
    echo "# no python3 here: raw JSON per run in $OUTDIR"
    exit 0
fi
python3 - "$OUTDIR" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print("| workload | rdsd transport | paths | rdsd | kernel TCP, same run | rdsd ÷ kernel TCP |")
print("|---|---|---|---|---|---|")
names = {"memif": "DPDK memif (smoltcp)", "dpdk": "DPDK af_packet (smoltcp)",
         "af_xdp": "DPDK af_xdp (smoltcp)", "tcp": "kernel TCP"}
order = {"rtt64": 0, "rtt64k": 1, "pipe": 2, "oneway1m": 3, "hops": 4}
breakdowns = []
def key(f):
    w, t, p = os.path.basename(f)[:-5].split("-")
    return (order.get(w, 9), w, list(names).index(t) if t in names else 9, int(p))
for f in sorted(glob.glob(os.path.join(out, "*.json")), key=key):
    w, t, p = os.path.basename(f)[:-5].split("-")
    try:
        runs = {r["transport"]: r for r in json.load(open(f))["runs"]}
        rds, tcp = runs["rds"], runs["tcp"]
    except Exception as e:  # a failed run: say so in the table
        print(f"| {w} | {names.get(t, t)} | {p} | failed ({type(e).__name__}) | | |")
        continue
    if w == "hops":
        breakdowns.append((t, p, rds))
        continue
    if w == "oneway1m":
        g = lambda r: r["msgs_per_s"] * 1048576 * 8 / 1e9
        a, b = g(rds), g(tcp)
        print(f"| 1 MiB one-way | {names[t]} | {p} | {a:.2f} Gbit/s | {b:.2f} Gbit/s | {a / b:.2f}× |")
    elif w == "pipe":
        a, b = rds["msgs_per_s"], tcp["msgs_per_s"]
        print(f"| 64 B, 4 tasks × 16 in flight | {names[t]} | {p} | {a / 1e3:.0f} k rt/s | {b / 1e3:.0f} k rt/s | {a / b:.2f}× |")
    else:
        a, b = rds["latency_us"]["p50"], tcp["latency_us"]["p50"]
        label = "64 B RTT p50" if w == "rtt64" else "64 KiB RTT p50"
        print(f"| {label} | {names[t]} | {p} | {a:.2f} µs | {b:.2f} µs | {a / b:.2f}× |")
if breakdowns:
    print()
    print("Where a 64 B round trip goes (rds-bench --breakdown, 96 B acks; p50 of each hop in µs, "
          "and the mean round trip):")
    print()
    hops = [h["hop"].split(" (")[0] + (" (" + h["hop"].split(" (")[1].split(":")[0].rstrip(")") + ")" if " (" in h["hop"] else "")
            for h in breakdowns[0][2]["breakdown"]["hops"]]
    print("| rdsd transport | paths | " + " | ".join(hops) + " | RTT p50 |")
    print("|---|---|" + "---|" * len(hops) + "---|")
    for t, p, r in breakdowns:
        b = r.get("breakdown") or {"hops": []}
        cells = " | ".join(f"{h['p50_us']:.2f}" for h in b["hops"])
        print(f"| {names.get(t, t)} | {p} | {cells} | {r['latency_us']['p50']:.2f} |")
EOF

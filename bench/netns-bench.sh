#!/usr/bin/env bash
# rds-bench between two "hosts": two network namespaces joined by a veth pair (10.77.0.1 and
# 10.77.0.2), one rdsd in each (RDS/TCP between them), a passive rds-bench in the second and
# the active rds-bench in the first. The kernel baselines (--transports tcp,udp) run between
# the same two namespaces over the same veth, in the same invocation. Needs root.
#
#     bash bench/netns-bench.sh [rds-bench active-side flags...]
#     bash bench/netns-bench.sh -T 5 --transports rds,tcp,udp --mode both
#
# Environment: BIN (folder with rdsd and rds-bench; default: build release and use it),
# IDLE (rdsd idle strategy, default backoff), PATHS (TCP paths per peer, default 8),
# POLL_CORE (both rdsd's poll core, default -2 = unpinned; POLL_CPUS below is per side), TRANSPORT (tcp, the default: rdsd's
# kernel-TCP transport; dpdk: each rdsd on a DPDK net_af_packet port on its end of a second
# veth pair, whose addresses 10.78.0.1/.2 the kernel does not have; af_xdp: the same with a DPDK
# net_af_xdp port (an AF_XDP socket and XDP program on each end, MTU 1778); memif: each rdsd on
# a DPDK net_memif port, the two joined by a memif socket file; the
# control connection and the kernel baselines stay on 10.77.0.x).
# Placement (pinned runs on a many-core host; default: unpinned): POLL_CPUS="A,B" (each rdsd's
# poll thread), CTRL_CPUS="A,B" (each rdsd's control thread), APP_CPUS_A / APP_CPUS_B (taskset
# CPU lists of the active / passive rds-bench: their app tasks run there, the kernel baselines
# included, so rdsd and the kernel get the same placement). EAL_ARGS: extra EAL arguments for
# the DPDK transports, one string (e.g. "-d /bundle/pmds" for a bundle, bench/bundle.sh).
# TRACE_HOPS=1: both rdsd stamp traced messages (for rds-bench --breakdown, the per-hop latency).
# IP: the ip(8) to use (a bundle ships its own for hosts without iproute2).
# STATS="name,name": print those counters of both rdsd after the run (e.g. rx_publishes), and
# the kernel TCP segments of each namespace (tcp_InSegs, tcp_OutSegs).
# THREADS=1: print each rdsd's poll threads after the run (`rdsctl threads -i 0`: what each
# served and moved; with RDSD_ARGS="--poll-core -2" each rdsd runs two poll threads).
# RDSD_ARGS: extra arguments for both rdsd (e.g. "--path-choice source-port"). DPDK_EXTRA: lines
# added to both rdsd's [dpdk] section (e.g. "ack_delay_us = 200"). AF_XDP_ARGS: appended to the
# af_xdp vdev (e.g. ",busy_budget=64": the driver's preferred busy polling, which rdsd turns off).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[[ "$(id -u)" -eq 0 ]] || { echo "netns-bench.sh: needs root (network namespaces)" >&2; exit 1; }
if [[ -z "${BIN:-}" ]]; then
    cargo build --release -q -p rdsd -p rds-bench -p rdsctl
    TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)"
    BIN="${TARGET_DIR:-$ROOT/target}/release"
fi
IP="$(command -v "${IP:-ip}")" || { echo "netns-bench.sh: no ip(8): install iproute2 or set IP= (a bundle has bin/ip)" >&2; exit 1; }
cpu_of() { # cpu_of "A,B" index -> the CPU for that side, or -2 (unpinned)
    local list="$1" i="$2"
    [[ -n "$list" ]] || { echo -2; return; }
    IFS=, read -r -a c <<<"$list"
    ((${#c[@]} > 1)) || i=0 # one value: both sides
    echo "${c[$i]:--2}"
}
# Pinned app sides: taskset execs the command, so $! stays the process that cleanup kills.
pin_a=() pin_b=()
[[ -z "${APP_CPUS_A:-}" ]] || pin_a=(taskset -c "$APP_CPUS_A")
[[ -z "${APP_CPUS_B:-}" ]] || pin_b=(taskset -c "$APP_CPUS_B")
tag="rsb$$"
A="${tag}a" B="${tag}b"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    "$IP" netns del "$A" 2>/dev/null || true
    "$IP" netns del "$B" 2>/dev/null || true
    rm -f "/tmp/$A.sock" "/tmp/$B.sock" "/tmp/$A.rxseq" "/tmp/$B.rxseq" "/tmp/$A.ports" \
        "/tmp/$B.ports" "/tmp/$A.toml" "/tmp/$B.toml" "/tmp/$tag.memif"
}
trap cleanup EXIT
"$IP" netns add "$A"
"$IP" netns add "$B"
"$IP" link add eth0 netns "$A" type veth peer name eth0 netns "$B"
"$IP" -n "$A" addr add 10.77.0.1/24 dev eth0
"$IP" -n "$B" addr add 10.77.0.2/24 dev eth0
for n in "$A" "$B"; do
    "$IP" -n "$n" link set eth0 up
    "$IP" -n "$n" link set lo up
done
TRANSPORT="${TRANSPORT:-tcp}"
if [[ "$TRANSPORT" = dpdk || "$TRANSPORT" = af_xdp ]]; then
    "$IP" link add dp0 netns "$A" type veth peer name dp0 netns "$B"
    # Jumbo frames (rdsd takes the interface's MTU for af_packet and af_xdp); VETH_MTU=1500
    # for standard. DPDK 22.11's af_xdp carries an MTU of 1778 at most (AF_XDP_MAX_MTU).
    mtu="${VETH_MTU:-9000}"
    [[ "$TRANSPORT" = dpdk ]] || mtu="${VETH_MTU:-1778}"
    for n in "$A" "$B"; do "$IP" -n "$n" link set dp0 mtu "$mtu" up; done
fi
rds_a=10.77.0.1 rds_b=10.77.0.2
for n in a b; do
    ns="${tag}$n"
    i=$([ $n = a ] && echo 1 || echo 2)
    local_args=(--local-addr "10.77.0.$i/32")
    case "$TRANSPORT" in
        tcp) ;;
        dpdk) vdev="net_af_packet0,iface=dp0" ;;
        af_xdp) vdev="net_af_xdp0,iface=dp0${AF_XDP_ARGS:-}" ;;
        memif) vdev="net_memif0,role=$([ $n = a ] && echo server || echo client),id=0,socket=/tmp/$tag.memif,socket-abstract=no" ;;
        *) echo "netns-bench.sh: TRANSPORT must be tcp, dpdk, af_xdp or memif" >&2; exit 1 ;;
    esac
    if [[ "$TRANSPORT" != tcp ]]; then
        printf '[dpdk]\nvdev = "%s"\naddr = "10.78.0.%s/24"\n' "$vdev" "$i" >"/tmp/$ns.toml"
        [[ -z "${DPDK_EXTRA:-}" ]] || printf '%s\n' "$DPDK_EXTRA" >>"/tmp/$ns.toml"
        if [[ -n "${EAL_ARGS:-}" ]]; then
            read -r -a extra <<<"$EAL_ARGS"
            printf 'eal_args = [' >>"/tmp/$ns.toml"
            printf '"%s", ' "${extra[@]}" >>"/tmp/$ns.toml"
            printf ']\n' >>"/tmp/$ns.toml"
        fi
        local_args=(--config "/tmp/$ns.toml")
        rds_a=10.78.0.1 rds_b=10.78.0.2
    fi
    side=$([ $n = a ] && echo 0 || echo 1)
    "$IP" netns exec "$ns" "$BIN/rdsd" --control-socket "/tmp/$ns.sock" --state-file "/tmp/$ns.rxseq" \
        "${local_args[@]}" --paths "${PATHS:-8}" --idle "${IDLE:-backoff}" \
        --poll-core "$(cpu_of "${POLL_CPUS:-${POLL_CORE:-}}" $side)" \
        --control-core "$(cpu_of "${CTRL_CPUS:-}" $side)" ${TRACE_HOPS:+--trace-hops} --log warn \
        ${RDSD_ARGS:-} &
    pids+=($!)
done
for n in "$A" "$B"; do
    for _ in $(seq 100); do [[ -S "/tmp/$n.sock" ]] && break; sleep 0.1; done
    [[ -S "/tmp/$n.sock" ]] || { echo "netns-bench.sh: rdsd in $n did not start" >&2; exit 1; }
done
if [[ "$TRANSPORT" != tcp ]]; then
    # A DPDK port (memif above all: the client attaches to the server's socket) takes a moment
    # to come up: wait until an RDS ping between the two rdsd is answered.
    for i in $(seq 60); do
        if "$IP" netns exec "$A" "$BIN/rdsctl" -s "/tmp/$A.sock" ping "$rds_b" -I "$rds_a" -c 1 -W 1 \
            >/dev/null 2>&1; then
            break
        fi
        ((i < 60)) || { echo "netns-bench.sh: no RDS ping answered over $TRANSPORT" >&2; exit 1; }
    done
fi
"${pin_b[@]}" "$IP" netns exec "$B" "$BIN/rds-bench" -p 4000 -r 10.77.0.2 --rds-addr "$rds_b" --socket "/tmp/$B.sock" \
    --quiet >/dev/null &
passive=$!
pids+=("$passive")
"${pin_a[@]}" "$IP" netns exec "$A" "$BIN/rds-bench" -s 10.77.0.2 -r 10.77.0.1 --rds-addr "$rds_a" -p 4000 \
    --socket "/tmp/$A.sock" "$@"
wait "$passive"
if [[ -n "${STATS:-}" ]]; then
    # STATS=name,name: those counters of each rdsd after the run (e.g. rx_publishes,tcp_delivered).
    for n in "$A" "$B"; do
        echo "rdsd $([ "$n" = "$A" ] && echo active || echo passive):"
        "$IP" netns exec "$n" "$BIN/rdsctl" -s "/tmp/$n.sock" stats | grep -E "^(${STATS//,/|}) " || true
        # Kernel TCP segments of the namespace (both rdsd's connections and the baselines').
        "$IP" netns exec "$n" awk '/^Tcp:/ { if (!h) { split($0, k); h = 1 } else for (i = 2; i <= NF; i++) if (k[i] == "InSegs" || k[i] == "OutSegs") printf "tcp_%s %s\n", k[i], $i }' /proc/net/snmp
    done
fi
if [[ -n "${THREADS:-}" ]]; then
    for n in "$A" "$B"; do
        echo "rdsd $([ "$n" = "$A" ] && echo active || echo passive):"
        "$IP" netns exec "$n" "$BIN/rdsctl" -s "/tmp/$n.sock" threads -i 0 || true
    done
fi

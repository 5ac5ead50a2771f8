#!/usr/bin/env bash
# Instructions per message on the userspace-TCP path (issue 17): smoltcp over a DPDK port,
# counted by callgrind, next to the local path's (the same apps through one rdsd, measured in
# the same invocation, as bench/shards-callgrind.sh does with one poll thread).
#
# userspace TCP: two rdsd in two network namespaces joined by a DPDK memif port pair
# (TRANSPORT=memif, the default) or by af_packet ports on a veth pair (TRANSPORT=af_packet; or
# af_xdp ports, TRANSPORT=af_xdp, MTU 1778),
# PATHS mprds paths (default 1), both rdsd under callgrind (EAL runs under valgrind: --no-huge,
# --no-pci); a sender app in the first namespace sends COUNT messages of LEN bytes one way to a
# receiver app in the second. local: one rdsd, both apps on 127.0.0.1. Needs root, valgrind,
# DPDK 22.11. With PATHS=8 the one sending socket hashes onto one path: the other seven are
# connected and idle, which is what the 8-path figure measures (their cost per pass).
#
# Counted: each rdsd's poll thread, from the receiver's first message (after a one-message
# warm-up that brings the path up) to its last: the profile is zeroed (callgrind_control -z)
# before the sender starts and dumped (-d) when the receiver has everything; start-up (EAL,
# connects) and the apps' own instructions (they run outside rdsd) are not counted; idle
# passes in between are, as in the local figure. Columns, inclusive instructions per message:
#   pass       PollCore::run_once, everything the poll thread did (passes/msg: its calls)
#   drain_tx   PollCore::drain_tx: the app tx-ring drain (the local delivery into the rx ring,
#              or the hand-off to the protocol endpoint, Endpoint::send)
#   ep send    <Endpoint as Transport>::send: RDS header, copy into a pool buffer, queueing
#   dpdk poll  <DpdkTransport as Transport>::poll: the userspace-TCP transport's share of a
#              pass: the endpoint's transmit (Endpoint::transmit: messages into the TCP socket),
#              smoltcp (in poll_aux), reads, parsing and delivery
#   ep tx      Endpoint::transmit: RDS framing written into smoltcp's socket buffer
#   iface      UtcpLink::poll_aux, the link's share of every pass: smoltcp's interface
#              (ingress: frames to sockets; egress, socket_egress its own column, when
#              something may go out; the device's rx and tx tokens) and the listener checks
#   rx burst   rdsd_rte_eth_rx_burst (DPDK rx burst: the memif/af_packet PMD)
#   tx burst   rdsd_rte_eth_tx_burst (DPDK tx burst)
#   read       UtcpLink::read: bytes out of the TCP socket (receiver)
#   deliver    <SocketTable as Upcalls>::deliver: into the app's rx ring (receiver)
#   clock      clock_gettime (vDSO; std's Timespec::now or rdsd's MonotonicClock) +
#              Timespec::sub_timespec: clock reads and
#              Instant arithmetic, all callers
#
# MODE=pingpong: COUNT round trips instead (rds-testapp ping / echo: the second app sends each
# message back), every figure per round trip; each rdsd then sends one message and receives one
# per round trip, with the ACKs that go with them. RDSD_ARGS: extra flags for the two DPDK rdsd
# (e.g. "--path-choice source-port"); DPDK_EXTRA: lines added to their [dpdk] section (e.g.
# "ack_delay_us = 200").
#
# CROSS=1 (issue 18): each DPDK rdsd runs two poll threads, the port on thread 0 and a
# placeholder app holding thread 0's place, so the measured apps land on thread 1 and every
# message crosses between the threads (a send as a forwarded envelope, or from
# tcp_zero_copy_min on as a SendRef; a delivery forwarded back). The crossing counters are
# printed after the run.
#
# usage: [PATHS=1|8] [TRANSPORT=memif|af_packet|af_xdp] [MODE=stream|pingpong] [CROSS=1] bench/utcp-callgrind.sh [COUNT] [LEN]
#        (release build: cargo build --release -p rdsd -p rdsctl --bins &&
#         cargo build --release -p rdsd-tests --bin rds-testapp;
#         or BIN= a folder with rdsd, rdsctl and rds-testapp)
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-20000}
len=${2:-64}
bin=${BIN:-target/release}
out=${OUT:-target/utcp-callgrind}
transport=${TRANSPORT:-memif}
paths=${PATHS:-1}
[[ -n "${ANALYZE_ONLY:-}" || "$(id -u)" -eq 0 ]] || { echo "utcp-callgrind.sh: needs root (network namespaces)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
tag="ucg$$"
A="${tag}a" B="${tag}b"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    rm -f "/tmp/$tag.memif"
}
trap cleanup EXIT

# cg NETNS SIDE ARGS...: rdsd under callgrind in NETNS ("" = this one), control socket $out/SIDE.sock.
cg() {
    local ns=$1 side=$2
    shift 2
    local pre=()
    [[ -z "$ns" ]] || pre=(ip netns exec "$ns")
    "${pre[@]}" valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$side.%p" -q \
        "$bin/rdsd" --control-socket "$out/$side.sock" --state-file "$out/$side.rxseq" \
        --poll-core -2 --control-core -2 --log warn "$@" 2>"$out/rdsd-$side.log" &
    pids+=($!)
    for _ in $(seq 600); do [ -S "$out/$side.sock" ] && break; sleep 0.1; done
    [ -S "$out/$side.sock" ] || { echo "utcp-callgrind.sh: rdsd $side did not start" >&2; cat "$out/rdsd-$side.log" >&2; exit 1; }
}

# stream SEND_NS SEND_SIDE SRC RECV_NS RECV_SIDE DST N: N messages one way, profile zeroed
# before and dumped after (every rdsd in pids).
stream() {
    local sns=(ip netns exec "$1") rns=(ip netns exec "$4") n=$7
    [[ -n "$1" ]] || sns=()
    [[ -n "$4" ]] || rns=()
    local rcmd=(recv "$6" "$n") scmd=(send "$3" "$6" "$n" "$len")
    [[ "${MODE:-stream}" != pingpong ]] || rcmd=(echo "$6" "$n") scmd=(ping "$3" "$6" "$n" "$len")
    RDSD_SOCKET=$out/$5.sock "${rns[@]}" "$bin/rds-testapp" "${rcmd[@]}" >"$out/recv.log" &
    local recv=$!
    for _ in $(seq 600); do grep -q bound "$out/recv.log" 2>/dev/null && break; sleep 0.1; done
    [[ -z "${ZERO:-}" ]] || for p in "${pids[@]}"; do callgrind_control -z "$p" >/dev/null 2>&1; done
    RDSD_SOCKET=$out/$2.sock "${sns[@]}" "$bin/rds-testapp" "${scmd[@]}" >/dev/null
    wait "$recv"
    [[ -z "${ZERO:-}" ]] || for p in "${pids[@]}"; do callgrind_control -d "$p" >/dev/null 2>&1; done
}

# idle_window: the same rdsd, no traffic for 2 s: each rdsd's second dump (*.2) holds only
# passes that found nothing (the cost of an empty pass).
idle_window() {
    for p in "${pids[@]}"; do callgrind_control -z "$p" >/dev/null 2>&1; done
    sleep 2
    for p in "${pids[@]}"; do callgrind_control -d "$p" >/dev/null 2>&1; done
}

stop() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
}

measure() {
    rm -f "$out"/callgrind.* "$out"/*.sock "$out"/*.log "$out"/*rxseq
    # The local path: one rdsd, both apps on the host.
    cg "" local
    stream "" local 127.0.0.1:7000 "" local 127.0.0.1:7001 1
    ZERO=1 stream "" local 127.0.0.1:7000 "" local 127.0.0.1:7001 "$count"
    idle_window
    stop

    # The userspace-TCP path.
    ip netns add "$A"
    ip netns add "$B"
    for n in "$A" "$B"; do ip -n "$n" link set lo up; done
    if [[ "$transport" = af_packet || "$transport" = af_xdp ]]; then
        ip link add dp0 netns "$A" type veth peer name dp0 netns "$B"
        # Jumbo frames (rdsd takes the interface's MTU for af_packet); VETH_MTU=1500 for standard.
        # af_xdp: 1778 at most (eal::AF_XDP_MAX_MTU).
        mtu="${VETH_MTU:-9000}"
        [[ "$transport" = af_packet ]] || mtu="${VETH_MTU:-1778}"
        for n in "$A" "$B"; do ip -n "$n" link set dp0 mtu "$mtu" up; done
    fi
    for side in a b; do
        i=$([ $side = a ] && echo 1 || echo 2)
        case "$transport" in
            memif) vdev="net_memif0,role=$([ $side = a ] && echo server || echo client),id=0,socket=/tmp/$tag.memif,socket-abstract=no" ;;
            af_packet) vdev="net_af_packet0,iface=dp0" ;;
            af_xdp) vdev="net_af_xdp0,iface=dp0" ;;
            *) echo "utcp-callgrind.sh: TRANSPORT must be memif, af_packet or af_xdp" >&2; exit 1 ;;
        esac
        printf '[dpdk]\nvdev = "%s"\naddr = "10.79.0.%s/24"\nfile_prefix = "%s"\n' \
            "$vdev" "$i" "$tag$side" >"$out/$side.toml"
        [[ -z "${DPDK_EXTRA:-}" ]] || printf '%s\n' "$DPDK_EXTRA" >>"$out/$side.toml"
        # A one-way stream from one socket uses one TCP connection whatever the path count;
        # with PATHS > 1 the others are up and idle.
        cross=()
        [[ -z "${CROSS:-}" ]] || cross=(--poll-core -2)
        # shellcheck disable=SC2086
        cg "$tag$side" "$side" -c "$out/$side.toml" --paths "$paths" "${cross[@]}" ${RDSD_ARGS:-}
        if [[ -n "${CROSS:-}" ]]; then
            # The first app goes to the thread with the fewest apps (thread 0): this one stays.
            RDSD_SOCKET=$out/$side.sock ip netns exec "$tag$side" "$bin/rds-testapp" recv \
                "10.79.0.$i:7999" 1000000000 >"$out/holder-$side.log" &
            pids+=($!)
            for _ in $(seq 600); do grep -q bound "$out/holder-$side.log" 2>/dev/null && break; sleep 0.1; done
        fi
    done
    for i in $(seq 120); do
        ip netns exec "$A" "$bin/rdsctl" -s "$out/a.sock" ping 10.79.0.2 -I 10.79.0.1 -c 1 -W 1 >/dev/null 2>&1 && break
        ((i < 120)) || { echo "utcp-callgrind.sh: no RDS ping answered over $transport" >&2; exit 1; }
    done
    stream "$A" a 10.79.0.1:7000 "$B" b 10.79.0.2:7001 1
    # Every path up before counting (connecting paths are not idle ones).
    for i in $(seq 600); do
        up=$(ip netns exec "$A" "$bin/rdsctl" -s "$out/a.sock" stats 2>/dev/null | awk '$1 == "dpdk_path_up" {print $2}')
        ((${up:-0} >= paths)) && break
        ((i < 600)) || { echo "utcp-callgrind.sh: $paths paths not up over $transport (${up:-0})" >&2; exit 1; }
        sleep 0.1
    done
    ZERO=1 stream "$A" a 10.79.0.1:7000 "$B" b 10.79.0.2:7001 "$count"
    if [[ -n "${CROSS:-}" ]]; then
        for side in a b; do
            ns=$([ $side = a ] && echo "$A" || echo "$B")
            echo "crossing counters, rdsd $side:" >"$out/cross-$side.txt"
            ip netns exec "$ns" "$bin/rdsctl" -s "$out/$side.sock" stats |
                grep -E '^(tx_in_place|tx_in_place_crossed) ' >>"$out/cross-$side.txt" || true
            # The sockets' and the connection's poll threads (column Poll).
            ip netns exec "$ns" "$bin/rdsctl" -s "$out/$side.sock" info -k -n >>"$out/cross-$side.txt" || true
        done
    fi
    idle_window
    stop
}
# ANALYZE_ONLY=1: print the tables again from the dumps already in OUT.
[[ -n "${ANALYZE_ONLY:-}" ]] || measure

# incl SIDE REGEX [PART]: the inclusive cost of a function matching REGEX in SIDE's dump PART
# (1: the stream, 2: the idle window). callgrind_annotate lists a function once per source file
# it has lines from (inlining); the largest entry is the whole function.
incl() {
    callgrind_annotate --auto=no --inclusive=yes --threshold=100 "$out"/callgrind."$1".*."${3:-1}" 2>/dev/null |
        awk -v re="$2" '{v = $1; gsub(",", "", v); v += 0} $0 ~ re {if (v > m) m = v} END {printf "%d\n", m}'
}
per() { echo $(( $(incl "$1" "$2") / count )); }
# calls SIDE REGEX [PART]: how many times functions matching REGEX were called.
calls() {
    awk -v re="$2" '/^c?fn=/ {l = $0; sub(/^c?fn=/, "", l); id = l; sub(/ .*/, "", id); n = l;
                              sub(/^\([0-9]+\) ?/, "", n); if (n != "") name[id] = n;
                              if ($0 ~ /^cfn=/) cur = name[id]; next}
                    /^calls=/ {split($1, c, "="); if (cur ~ re) s += c[2]}
                    END {printf "%d\n", s}' "$out"/callgrind."$1".*."${3:-1}"
}
pass_re='PollCore::run_once( |$)'
# work SIDE: "passes/msg empty-pass pass work": work = pass - passes/msg x empty pass, the
# instructions a message adds beyond the fixed cost of the passes that carried it.
work() {
    local passes ipass icalls
    passes=$(calls "$1" 'PollCore::run_once$')
    ipass=$(incl "$1" "$pass_re" 2)
    icalls=$(calls "$1" 'PollCore::run_once$' 2)
    awk -v p="$passes" -v n="$count" -v i="$ipass" -v c="$icalls" -v t="$(incl "$1" "$pass_re")" 'BEGIN {
        e = c ? i / c : 0; printf "%.2f %d %d %d\n", p / n, e, t / n, (t - p * e) / n }'
}
row() { # row SIDE LABEL
    local clock w
    clock=$(( ($(incl "$1" ':clock_gettime') + $(incl "$1" 'Timespec>::sub_timespec( |$)')) / count ))
    read -r -a w <<<"$(work "$1")"
    printf '| %s | %s | %s | %s | **%s** | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d |\n' \
        "$2" "${w[0]}" "${w[1]}" "${w[2]}" "${w[3]}" \
        "$(per "$1" 'PollCore::drain_tx( |$)')" \
        "$(per "$1" 'Endpoint<L,C> as rdsd::seam::Transport>::send( |$)')" \
        "$(per "$1" 'DpdkTransport as rdsd::seam::Transport>::poll( |$)')" \
        "$(per "$1" 'Endpoint<L,C>::transmit( |$)')" \
        "$(per "$1" 'UtcpLink<D,C> as rdsd::protocol::link::Link>::poll_aux( |$)')" \
        "$(per "$1" 'smoltcp::iface::interface::Interface::socket_egress( |$)')" \
        "$(per "$1" 'rdsd_rte_eth_rx_burst( |$)')" \
        "$(per "$1" 'rdsd_rte_eth_tx_burst( |$)')" \
        "$(per "$1" 'UtcpLink<D,C> as rdsd::protocol::link::Link>::read( |$)')" \
        "$(per "$1" 'SocketTable as rdsd::seam::Upcalls>::deliver( |$)')" \
        "$clock"
}
if [[ "${MODE:-stream}" = pingpong ]]; then
    echo "$count round trips of $len B (transport: $transport, paths: $paths${RDSD_ARGS:+, $RDSD_ARGS}${DPDK_EXTRA:+, $DPDK_EXTRA}); instructions per round trip, inclusive (the msg columns are per round trip)"
else
    echo "$count messages of $len B one way (transport: $transport, paths: $paths${RDSD_ARGS:+, $RDSD_ARGS}${DPDK_EXTRA:+, $DPDK_EXTRA}); instructions per message, inclusive"
fi
if [[ -n "${CROSS:-}" ]]; then
    echo
    cat "$out"/cross-a.txt "$out"/cross-b.txt 2>/dev/null || true
fi
echo
echo "| rdsd | passes/msg | empty pass | pass | work | drain_tx | ep send | dpdk poll | ep tx | iface | egress | rx burst | tx burst | read | deliver | clock |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
row local "local (one rdsd)"
row a "userspace TCP, sender"
row b "userspace TCP, receiver"
read -r -a l <<<"$(work local)"
read -r -a a <<<"$(work a)"
read -r -a b <<<"$(work b)"
echo
awk -v lp="${l[2]}" -v lw="${l[3]}" -v p="$((a[2] + b[2]))" -v w="$((a[3] + b[3]))" 'BEGIN {
    printf "userspace TCP, both rdsd: pass %d = %.1fx local (%d); work %d = %.1fx local (%d)\n", p, p / lp, lp, w, w / lw, lw }'

#!/usr/bin/env bash
# RDS/TCP between two network namespaces through two rdsds, next to kernel TCP between the
# same namespaces, in one run:  bash bench/netns-bench.sh [COUNT]   (root; builds release)
set -euo pipefail
cd "$(dirname "$0")/.."
count="${1:-20000}"
cargo build --release -q -p rdsd -p rds-bench
tag="rnb$$"
cleanup() {
    kill $(jobs -p) 2>/dev/null || true
    wait 2>/dev/null || true
    ip netns del "${tag}a" 2>/dev/null || true
    ip netns del "${tag}b" 2>/dev/null || true
    rm -f "/tmp/${tag}a.sock" "/tmp/${tag}b.sock" "/tmp/${tag}a.rxseq" "/tmp/${tag}b.rxseq" "/tmp/${tag}.toml"
}
trap cleanup EXIT
ip netns add "${tag}a"; ip netns add "${tag}b"
ip link add eth0 netns "${tag}a" type veth peer name eth0 netns "${tag}b"
ip -n "${tag}a" addr add 10.77.0.1/24 dev eth0; ip -n "${tag}b" addr add 10.77.0.2/24 dev eth0
for n in a b; do ip -n "${tag}$n" link set eth0 up; ip -n "${tag}$n" link set lo up; done
# Optional idle tuning for experiments: SPIN_US=<µs> YIELD_US=<µs> PATHS=<1..8>.
conf="/tmp/${tag}.toml"
: > "$conf"
[ -n "${SPIN_US:-}" ] && echo "spin_us = $SPIN_US" >> "$conf"
[ -n "${YIELD_US:-}" ] && echo "yield_us = $YIELD_US" >> "$conf"
pids=()
for n in a b; do
    ip=10.77.0.$([ $n = a ] && echo 1 || echo 2)
    ip netns exec "${tag}$n" target/release/rdsd --control-socket "/tmp/${tag}$n.sock" \
        --config "$conf" --paths "${PATHS:-8}" \
        --local-addr "$ip/32" --idle ${IDLE:-spin} --poll-core "${POLL_CORE:--2}" --control-core -2 \
        --log warn &
    pids+=($!)
done
for n in a b; do
    for _ in $(seq 100); do [ -S "/tmp/${tag}$n.sock" ] && break; sleep 0.1; done
done
# APP_CORE=N pins the benchmark process (taskset), for placement experiments.
app_pin=()
[ -n "${APP_CORE:-}" ] && app_pin=(taskset -c "$APP_CORE")
"${app_pin[@]}" target/release/rds-netbench --a-sock "/tmp/${tag}a.sock" --b-sock "/tmp/${tag}b.sock" \
    --a-ns "${tag}a" --b-ns "${tag}b" --a-ip 10.77.0.1 --b-ip 10.77.0.2 --count "$count" \
    --a-pid "${pids[0]}" --b-pid "${pids[1]}"

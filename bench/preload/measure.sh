#!/usr/bin/env bash
# The 64 B local round trip through librdsd-preload.so (bench/preload/pingpong.c, plain socket
# API, under rdsd-run) and through librdsd's C ABI (the same program built -DUSE_CAPI), next to
# the Rust API's (`rds-bench rtt`, the same A -> B -> A loop in one thread), all on one rdsd in
# one invocation, ROUNDS times interleaved; prints each RESULT line and the medians' ratios.
#   bash bench/preload/measure.sh [COUNT] [ROUNDS]      (defaults 100000 and 3)
set -euo pipefail
cd "$(dirname "$0")/../.."
count="${1:-100000}"
rounds="${2:-3}"
warmup=$((count / 10))
t=target/release
cargo build --release -q -p rdsd -p rds-bench -p rdsd-capi -p rdsd-preload
tmp="$(mktemp -d)"
sock="$tmp/rdsd.sock"
trap 'kill "$rdsd_pid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
cc -O2 -o "$tmp/pp-preload" bench/preload/pingpong.c
# The loader looks for the soname, librdsd.so.0 (install.sh makes that link; cargo does not).
ln -s "$PWD/$t/librdsd.so" "$tmp/librdsd.so.0"
cc -O2 -DUSE_CAPI -I shm-api/capi/include -o "$tmp/pp-capi" bench/preload/pingpong.c \
    -L"$t" -lrdsd -Wl,-rpath,"$tmp"
# As rds-bench rtt spawns it: the poll core spins on CPU $POLL_CPU (default 1); every app runs
# on CPU $APP_CPU (default 0). Unpinned, the round trip is bimodal on 2 CPUs (about 0.6 us when
# the app and the poll core sit on different CPUs, 2.3 us when they share one), which would
# swamp the differences measured here.
poll_cpu="${POLL_CPU:-1}"
app_cpu="${APP_CPU:-0}"
"$t/rdsd" --control-socket "$sock" --idle spin --poll-core "$poll_cpu" --control-core -2 --log warn &
rdsd_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
export RDSD_SOCKET="$sock"
out="$tmp/results"
for r in $(seq "$rounds"); do
    "$t/rds-bench" rtt --socket "$sock" --count "$count" --warmup "$warmup" --size 64 \
        --app-core "$app_cpu" --baseline none | grep '^RESULT rtt ' | sed 's/^RESULT rtt /RESULT rust /' | tee -a "$out"
    for mode in spin block; do
        taskset -c "$app_cpu" "$t/rdsd-run" "$tmp/pp-preload" "$mode" "$count" "$warmup" 64 | tee -a "$out"
        taskset -c "$app_cpu" "$tmp/pp-capi" "$mode" "$count" "$warmup" 64 | tee -a "$out"
    done
done
python3 - "$out" <<'PY'
import re, statistics, sys
p50 = {}
for line in open(sys.argv[1]):
    m = re.search(r"p50_ns=(\d+)", line)
    if not m:
        continue
    if line.startswith("RESULT rust"):
        key = "rust spin"
    else:
        impl = re.search(r"impl=(\w+)", line).group(1)
        key = impl + " " + re.search(r"mode=(\w+)", line).group(1)
    p50.setdefault(key, []).append(int(m.group(1)))
med = {k: statistics.median(v) for k, v in p50.items()}
for k, v in sorted(med.items()):
    print(f"median p50 {k:14s} {v:8.0f} ns  (runs: {p50[k]})")
print(f"RATIO preload/rust spin = {med['preload spin'] / med['rust spin']:.3f}")
print(f"RATIO capi/rust spin    = {med['capi spin'] / med['rust spin']:.3f}")
print(f"RATIO preload/capi spin = {med['preload spin'] / med['capi spin']:.3f}")
print(f"RATIO preload/capi block = {med['preload block'] / med['capi block']:.3f}")
PY

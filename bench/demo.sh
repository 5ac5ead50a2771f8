#!/usr/bin/env bash
# rdsd demo: build everything, reserve huge pages, start rdsd with its embedded default
# configuration, run rds-bench against it next to the kernel baselines (locally, then between
# two network namespaces with an rdsd each), print the comparison tables and the plots' paths,
# show rdsd's status, stop it. DEMO_SECS (default 3) sets the seconds per run, DEMO_OUT the
# folder for the JSON and SVG files. `--dpdk` (or DEMO_TRANSPORT=dpdk) runs the part between the
# namespaces over the kernel-bypass transport: each rdsd on a DPDK net_af_packet port
# (userspace TCP on smoltcp) instead of kernel TCP.
#
# Meant for a fresh Debian 12 machine, run as root, from the repository root or anywhere:
#     sudo bench/demo.sh
# Safe to run again: it installs only what is missing and leaves a running rdsd alone.
set -euo pipefail

say() { printf '\n==> %s\n' "$*"; }
warn() { printf 'demo.sh: warning: %s\n' "$*" >&2; }
die() { printf 'demo.sh: error: %s\n' "$*" >&2; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[[ -f Cargo.toml && -d dataplane && -d bench ]] || die "cannot find the rdsd repository around $0"

TRANSPORT="${DEMO_TRANSPORT:-tcp}"
for arg in "$@"; do
    case "$arg" in
        --dpdk) TRANSPORT=dpdk ;;
        *) die "unknown argument $arg (usage: bench/demo.sh [--dpdk])" ;;
    esac
done

IS_ROOT=0
[[ "$(id -u)" -eq 0 ]] && IS_ROOT=1

# --- 1. system packages (only what is missing) -------------------------------------------
say "checking build dependencies (dataplane/install-build-deps.sh)"
if ! bash dataplane/install-build-deps.sh; then
    die "could not install the build dependencies; run this script as root (sudo $0)"
fi

# --- 2. Rust toolchain ------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null 2>&1; then
    cat >&2 <<'EOF'
demo.sh: error: cargo (the Rust toolchain) is not installed. Install it with rustup:
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
    . "$HOME/.cargo/env"
then run this script again (rdsd needs Rust 1.91 or newer, see README.md).
EOF
    exit 1
fi
echo "using $(cargo --version)"

# --- 3. build ---------------------------------------------------------------------------
say "building (cargo build --release --workspace --bins)"
cargo build --release --workspace --bins
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)"
BIN="${TARGET_DIR:-$ROOT/target}/release"
for b in rdsd rdsctl rds-bench hugepage-setup; do
    [[ -x "$BIN/$b" ]] || die "$BIN/$b was not built"
done

# --- 4. huge pages (optional: rdsd falls back to 4 KiB pages) -----------------------------
say "reserving huge pages (hugepage-setup --pages 512)"
if ! "$BIN/hugepage-setup" --pages 512; then
    warn "no huge pages; rdsd will use 4 KiB pages (a little slower)"
fi

# --- 5. start rdsd ----------------------------------------------------------------------
WORK="$(mktemp -d /tmp/rdsd-demo.XXXXXX)"
RDSD_PID=""
cleanup() {
    local rc=$?
    if [[ -n "$RDSD_PID" ]] && kill -0 "$RDSD_PID" 2>/dev/null; then
        echo "stopping rdsd (pid $RDSD_PID)"
        kill -TERM "$RDSD_PID" 2>/dev/null || true
        wait "$RDSD_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

SOCK=/run/rdsd/rdsd.sock
if "$BIN/rdsctl" -s "$SOCK" status >/dev/null 2>&1; then
    echo "an rdsd is already serving $SOCK: leaving it alone and starting a private one"
    SOCK="$WORK/rdsd.sock"
elif ((!IS_ROOT)); then
    echo "not root: using a private control socket instead of $SOCK"
    SOCK="$WORK/rdsd.sock"
fi

say "starting rdsd (embedded default configuration) on $SOCK"
"$BIN/rdsd" --control-socket "$SOCK" 2>"$WORK/rdsd.log" &
RDSD_PID=$!
for ((i = 0; ; i++)); do
    if "$BIN/rdsctl" -s "$SOCK" status >/dev/null 2>&1; then
        break
    fi
    if ! kill -0 "$RDSD_PID" 2>/dev/null; then
        cat "$WORK/rdsd.log" >&2
        RDSD_PID=""
        die "rdsd exited during start-up (its log is above)"
    fi
    ((i < 300)) || { cat "$WORK/rdsd.log" >&2; die "rdsd did not answer on $SOCK within 30 s"; }
    sleep 0.1
done
echo "rdsd is up (pid $RDSD_PID)"

# --- 6. traffic: rds-bench against this rdsd, next to the kernel baselines -------------
SECS="${DEMO_SECS:-3}"
OUT="${DEMO_OUT:-/tmp/rdsd-demo-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
say "rds-bench, local: rdsd vs kernel TCP, UDP and AF_UNIX seqpacket (64 B requests and acks, ${SECS} s per run)"
"$BIN/rds-bench" --pair --socket "$SOCK" -T "$SECS" -q 64 -a 64 --baselines --mode both -z \
    --out "$OUT/local" --title "rdsd demo, local"

if ((IS_ROOT)) && command -v ip >/dev/null 2>&1; then
    say "rds-bench between two network namespaces: rdsd RDS/TCP (transport: $TRANSPORT) vs kernel TCP and UDP over a veth pair"
    TRANSPORT="$TRANSPORT" BIN="$BIN" bash bench/netns-bench.sh -T "$SECS" -q 64 -a 64 --transports rds,tcp,udp --mode both -z \
        --out "$OUT/netns" --title "rdsd demo, two namespaces"
else
    echo "(not root: skipping the run between two network namespaces)"
fi
say "plots and JSON"
ls "$OUT"/*/latency-cdf.svg "$OUT"/*/throughput.svg "$OUT"/*/results.json

say "rdsctl status"
"$BIN/rdsctl" -s "$SOCK" status
say "rdsctl threads (what each poll thread served and moved)"
"$BIN/rdsctl" -s "$SOCK" threads -i 0

# --- 7. stop ----------------------------------------------------------------------------
say "stopping rdsd"
kill -TERM "$RDSD_PID"
status=0
wait "$RDSD_PID" || status=$?
RDSD_PID=""
if ((status != 0)); then
    cat "$WORK/rdsd.log" >&2
    die "rdsd exited with status $status"
fi
echo "rdsd stopped cleanly"
say "demo finished"

#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 root shell or CI:
#   bash tests/run.sh
# Installs what it needs (apt packages, hugepages) idempotently, builds every binary, runs
# every crate's tests (unit, property, simulated-pair, integration with real rdsd processes),
# then the ring model checks (loom) and the Miri run where the nightly toolchain has Miri.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

log "system packages"
need=()
# The VM lab (tests/tests/interop.rs, tests/vmlab/README.md) also needs qemu, a static busybox,
# kmod (depmod), static libc for the guest programs and linux-libc-dev (linux/rds.h); the guest
# kernel itself is fetched with `apt-get download` into /var/cache/rdsd-vmlab, never installed.
# rdsctl's tests (tests/tests/rdsctl.rs) parse the Prometheus text with python3-prometheus-client
# and check the systemd unit with systemd-analyze (package systemd).
# The preload tests (tests/tests/preload.rs) run Debian's python3 under rdsd-run and build C
# programs with cc and pkg-config.
# The RDMA transport (dataplane/verbs-sys, tests/tests/rdma.rs) builds against rdma-core's
# libibverbs-dev and librdmacm-dev; its VM-lab test copies the rxe provider (ibverbs-providers),
# `rdma` (iproute2) and ibv_rc_pingpong (ibverbs-utils) into the guests; perftest is for the
# RDMA benchmarks.
for p in build-essential pkg-config iproute2 nftables \
    qemu-system-x86 busybox-static kmod libc6-dev linux-libc-dev \
    python3 python3-prometheus-client systemd \
    libibverbs-dev librdmacm-dev ibverbs-providers ibverbs-utils rdma-core perftest strace; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
else
    echo "all present"
fi
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust (>= 1.91) with rustup, then rerun" >&2
    exit 1
fi

log "build dependencies (dpdk-sys and verbs-sys: bindgen against DPDK and rdma-core)"
bash dataplane/install-build-deps.sh

log "cbindgen (tests of shm-api/capi: the checked-in rdsd.h is up to date)"
# Pinned: another version may format the header differently.
cbindgen --version 2>/dev/null | grep -qx 'cbindgen 0.29.4' || cargo install cbindgen --version 0.29.4 --locked

log "build"
# Everything, the C ABI and preload cdylibs included (tests/tests/preload.rs runs them).
cargo build --workspace

log "lints"
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --workspace --all-targets -q -- -D warnings
else
    echo "clippy not installed (rustup component add clippy); skipping lints"
fi

log "hugepages"
# rdsd falls back to 4 KiB pages when none are free; the suite passes either way.
as_root target/debug/hugepage-setup --pages 256 || echo "no hugepages reserved; regions will use 4 KiB pages"

log "tests"
cargo test --workspace --no-fail-fast

log "ring model checks"
bash shm-api/check-ring-models.sh

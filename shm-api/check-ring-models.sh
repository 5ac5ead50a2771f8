#!/usr/bin/env bash
# Model checks for the shared-memory record ring (src/ring.rs):
#   1. loom: tests/loom_ring.rs (every interleaving of producer/consumer, data races on every
#      ring byte, hostile counters, a side dying mid-operation; the commit point of a group
#      fan-out, src/gate.rs).
#   2. Miri: the ring unit tests (undefined behaviour, provenance, data races).
# Exits non-zero if either fails. If Miri (or the rust-src it needs) is not available, the Miri
# part prints "SKIP: miri unavailable" and does not fail the script.
#
# Environment (defaults):
#   LOOM_TARGET_DIR=target/loom   MIRI_TARGET_DIR=target/miri
#   LOOM_MAX_PREEMPTIONS=<n>            deepen/shallow every loom model (else per-model bounds)
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2   # workspace root

LOOM_TARGET_DIR="${LOOM_TARGET_DIR:-target/loom}"
MIRI_TARGET_DIR="${MIRI_TARGET_DIR:-target/miri}"

status=0

echo "== loom: tests/loom_ring.rs"
start=$SECONDS
if RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$LOOM_TARGET_DIR" \
    cargo test -p shm-api --test loom_ring --release; then
    echo "== loom: OK ($((SECONDS - start)) s)"
else
    echo "== loom: FAILED ($((SECONDS - start)) s)"
    status=1
fi

echo "== miri: ring unit tests"
miri_ok=1
if ! cargo +nightly miri --version >/dev/null 2>&1; then
    miri_ok=0
elif ! rustup +nightly component list --installed 2>/dev/null | grep -q '^rust-src'; then
    # Miri needs rust-src to build its sysroot; try to get it once.
    rustup +nightly component add rust-src >/dev/null 2>&1 || miri_ok=0
fi
if [ "$miri_ok" = 1 ] && ! CARGO_TARGET_DIR="$MIRI_TARGET_DIR" cargo +nightly miri setup >/dev/null 2>&1; then
    miri_ok=0
fi
if [ "$miri_ok" = 0 ]; then
    echo "SKIP: miri unavailable"
else
    start=$SECONDS
    if CARGO_TARGET_DIR="$MIRI_TARGET_DIR" cargo +nightly miri test -p shm-api --lib ring::; then
        echo "== miri: OK ($((SECONDS - start)) s)"
    else
        echo "== miri: FAILED ($((SECONDS - start)) s)"
        status=1
    fi
fi

exit "$status"

#!/usr/bin/env bash
# Model checks for the shared-memory record ring (src/ring.rs):
#   1. loom: tests/loom_ring.rs (every interleaving of producer/consumer, data races on every
#      ring byte, hostile counters, a side dying mid-operation; the commit point of a group
#      fan-out, src/gate.rs).
#   2. Miri: the ring unit tests (undefined behaviour, provenance, data races), and the
#      threaded tests of src/bias_lock.rs and capi/src/slots.rs.
# Exits non-zero if either fails. Miri (nightly, with rust-src) is installed when missing; if
# that fails, CI (CI set) fails, and elsewhere the Miri part prints "SKIP: miri unavailable".
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

echo "== miri: ring, bias_lock and capi slots unit tests"
miri_ok=1
if ! cargo +nightly miri --version >/dev/null 2>&1 \
    || ! rustup +nightly component list --installed 2>/dev/null | grep -q '^rust-src'; then
    # Nightly with Miri and the rust-src it builds its sysroot from (idempotent).
    if ! cargo +nightly --version >/dev/null 2>&1; then
        rustup toolchain install nightly --profile minimal >/dev/null 2>&1
    fi
    rustup +nightly component add miri rust-src >/dev/null 2>&1
    cargo +nightly miri --version >/dev/null 2>&1 || miri_ok=0
fi
if [ "$miri_ok" = 1 ] && ! CARGO_TARGET_DIR="$MIRI_TARGET_DIR" cargo +nightly miri setup >/dev/null 2>&1; then
    miri_ok=0
fi
if [ "$miri_ok" = 0 ] && [ -n "${CI:-}" ] && [ "${CI}" != 0 ] && [ "${CI}" != false ]; then
    # In CI a missing prerequisite fails; it is never a silent skip.
    echo "== miri: FAILED: Miri could not be installed (rustup +nightly component add miri rust-src)"
    status=1
elif [ "$miri_ok" = 0 ]; then
    echo "SKIP: miri unavailable (rustup +nightly component add miri rust-src)"
else
    start=$SECONDS
    # The ring, the socket's biased lock and the C ABI's lock-free fd slots (both with
    # threads; a broken protocol is a data race or a use after free Miri reports).
    if CARGO_TARGET_DIR="$MIRI_TARGET_DIR" cargo +nightly miri test -p shm-api --lib -- ring:: bias_lock:: \
        && CARGO_TARGET_DIR="$MIRI_TARGET_DIR" cargo +nightly miri test -p rdsd-capi --lib slots::; then
        echo "== miri: OK ($((SECONDS - start)) s)"
    else
        echo "== miri: FAILED ($((SECONDS - start)) s)"
        status=1
    fi
fi

exit "$status"

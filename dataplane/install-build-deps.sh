#!/usr/bin/env bash
# Installs (idempotently) the Debian 12 packages that building the workspace needs, for the
# demo (bench/demo.sh) and the test suite (tests/run.sh) alike:
#   build-essential pkg-config      C toolchain (the dpdk-sys and verbs-sys shims), pkg-config
#   clang libclang-dev libdpdk-dev  dpdk-sys: bindgen against DPDK 22.11 (dpdk-sys/install-deps.sh)
#   libibverbs-dev librdmacm-dev    verbs-sys: bindgen against rdma-core's verbs and rdma_cm
# Usage: bash dataplane/install-build-deps.sh   (as root, or with sudo available)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

pkgs=(build-essential pkg-config libibverbs-dev librdmacm-dev)
need=()
for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else echo "install-build-deps: need root to install: ${need[*]}" >&2; return 1
    fi
}
if [ "${#need[@]}" -gt 0 ]; then
    echo "install-build-deps: installing ${need[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
else
    echo "install-build-deps: ${pkgs[*]} present"
fi
bash "$here/dpdk-sys/install-deps.sh"

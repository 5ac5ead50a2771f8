#!/usr/bin/env bash
# Installs (idempotently) the Debian 12 packages the dpdk-sys crate needs to build and test:
#   clang libclang-dev  bindgen's libclang
#   pkg-config          finds libdpdk.pc
#   libdpdk-dev         DPDK 22.11 headers and libraries (pulls in the PMDs, net_null included)
# Usage: bash dataplane/dpdk-sys/install-deps.sh   (as root, or with sudo available)
set -euo pipefail

pkgs=(clang libclang-dev pkg-config libdpdk-dev)
need=()
for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ "${#need[@]}" -eq 0 ]; then
    echo "dpdk-sys: build dependencies present (${pkgs[*]})"
    exit 0
fi

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else echo "dpdk-sys: need root to install: ${need[*]}" >&2; return 1
    fi
}

echo "dpdk-sys: installing ${need[*]}"
as_root apt-get update -qq
# --no-install-recommends: the recommends (e.g. the dpdk tools, python3) are not needed to
# build or test the crate.
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
pkg-config --exists libdpdk || { echo "dpdk-sys: pkg-config still cannot find libdpdk" >&2; exit 1; }
echo "dpdk-sys: libdpdk $(pkg-config --modversion libdpdk) ready"

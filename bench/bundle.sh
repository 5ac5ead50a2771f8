#!/usr/bin/env bash
# Packs what the pinned benchmark needs into one folder (and a .tar.gz beside it) for a host
# that has neither the Rust toolchain nor DPDK nor iproute2 (a many-core box to measure on):
#
#     bash bench/bundle.sh [OUT_DIR]          # default: target/rdsd-bundle
#     # on the other host, as root:
#     tar xzf rdsd-bundle.tar.gz && rdsd-bundle/run.sh      # = bench/pinned-bench.sh
#     rdsd-bundle/scaling.sh                                 # = bench/scaling-bench.sh
#     rdsd-bundle/device-check.sh OUTDIR                     # = bench/device-check.sh: all
#                                                            #   of it in one call (~7 min)
#
# Layout: bin/ (rdsd, rds-bench, rdsctl: release builds; capi-calls and capi-pingpong, C
# programs on librdsd; ip and strace from this machine),
# lib/ (every shared library those and the PMDs need, except glibc's own, which the target
# host has in a newer version), pmds/ (DPDK 22.11 drivers: memif, af_packet, af_xdp, tap, the ring
# mempool), bench/ (the scripts), env.sh (LD_LIBRARY_PATH, BIN, IP, EAL_ARGS="-d pmds").
# Known traps, handled here:
# * EAL's `-d DIR` loads only files named `*.so` (it skips `librte_*.so.23`): PMDs are copied
#   under their `.so` name.
# * librte_bus_vdev (and bus_pci) must be loaded exactly once: a second copy registers a
#   second vdev bus and every vdev probe fails. They stay out of pmds/ and are found through
#   the PMDs' DT_NEEDED in lib/.
# * On a host that has this DPDK installed, EAL also loads the host's driver directory by
#   itself (its compiled-in RTE_EAL_PMD_PATH), so the buses would load twice: env.sh then
#   uses the host's DPDK instead of lib/ and pmds/.
# Environment: BIN (folder with rdsd, rds-bench, rdsctl and librdsd.so already built: skips
# the build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-$ROOT/target/rdsd-bundle}"
if [[ -z "${BIN:-}" ]]; then
    cargo build --release -q -p rdsd -p rds-bench -p rdsctl -p rdsd-capi
    BIN="$ROOT/target/release"
fi
PMD_SRC=$(pkg-config --variable=pmdsdir libdpdk 2>/dev/null || true)
[[ -d "$PMD_SRC" ]] || PMD_SRC=$(ls -d /usr/lib/x86_64-linux-gnu/dpdk/pmds-* | head -1)
rm -rf "$OUT"
mkdir -p "$OUT"/{bin,lib,pmds,bench}
cp "$BIN"/rdsd "$BIN"/rds-bench "$BIN"/rdsctl "$OUT/bin/"
# The C ABI (librdsd) and two C programs on it (bench/preload/: calls, pingpong), found by
# their rpath in lib/ under the soname.
cp "$BIN/librdsd.so" "$OUT/lib/librdsd.so.0"
for prog in calls pingpong; do
    cc -O2 -pthread -DUSE_CAPI -I shm-api/capi/include -o "$OUT/bin/capi-$prog" \
        "bench/preload/$prog.c" "$OUT/lib/librdsd.so.0" -Wl,-rpath,'$ORIGIN/../lib'
done
# Debug info off (symbols stay, for perf): the bundle must travel light.
strip --strip-debug "$OUT"/bin/rdsd "$OUT"/bin/rds-bench "$OUT"/bin/rdsctl "$OUT/lib/librdsd.so.0"
tools=(ip strace)
# PERF=1: perf(1) too, for profiling the poll thread (pinned-bench.sh PROFILE=1); +30 MB.
[[ -z "${PERF:-}" ]] || tools+=(perf)
for t in "${tools[@]}"; do
    p=$(command -v "$t") || { echo "bundle.sh: $t not found (apt-get install iproute2 strace)" >&2; exit 1; }
    cp "$p" "$OUT/bin/"
done
for d in net_memif net_af_packet net_af_xdp net_tap mempool_ring; do
    cp -L "$PMD_SRC/librte_$d.so" "$OUT/pmds/librte_$d.so"
done
# af_xdp's XDP programs: libxdp loads them from files at run time (LIBXDP_OBJECT_PATH in env.sh).
mkdir -p "$OUT/bpf"
cp /usr/lib/x86_64-linux-gnu/bpf/{xsk_def_xdp_prog*,xdp-dispatcher}.o "$OUT/bpf/" ||
    { echo "bundle.sh: libxdp's XDP programs not found (apt-get install libxdp1)" >&2; exit 1; }
# glibc's own libraries come from the target host (its glibc is newer than Debian 12's).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv)'
for elf in "$OUT"/bin/* "$OUT"/pmds/*.so; do
    ldd "$elf" | awk '/=> \// {print $1, $3}' | while read -r name path; do
        [[ "$name" =~ $skip ]] && continue
        [[ -e "$OUT/lib/$name" ]] || cp -L "$path" "$OUT/lib/$name"
    done
done
cp bench/netns-bench.sh bench/pinned-bench.sh bench/scaling-bench.sh bench/device-check.sh \
    "$OUT/bench/"
# The driver directory the bundled EAL loads by itself when it exists (its RTE_EAL_PMD_PATH).
pmd_default=$(strings "$OUT/lib/librte_eal.so.23" | grep -m1 -E '^/.*/dpdk/pmds-' || true)
echo "pmd_default=\"$pmd_default\"" >"$OUT/env.sh"
cat >>"$OUT/env.sh" <<'EOF'
# Sourced by run.sh: the bundle's binaries, libraries and DPDK drivers.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export BIN="$here/bin" IP="$here/bin/ip" STRACE="$here/bin/strace" PERF="$here/bin/perf"
export LIBXDP_OBJECT_PATH="$here/bpf"
if [ -n "$pmd_default" ] && [ -d "$pmd_default" ]; then
    # This host has the same DPDK installed: EAL loads its drivers from there by itself, and
    # a bus loaded both from there and from lib/ registers twice (EAL panics: "tailq is
    # already registered"). The host's DPDK it is, then, with its own libraries.
    echo "rdsd-bundle: this host has DPDK's $pmd_default; using the host's DPDK libraries and drivers" >&2
    export EAL_ARGS=""
else
    export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export EAL_ARGS="-d $here/pmds"
fi
EOF
cat >"$OUT/run.sh" <<'EOF'
#!/usr/bin/env bash
# The pinned benchmark from the bundle (arguments and environment: bench/pinned-bench.sh).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/env.sh"
exec bash "$here/bench/pinned-bench.sh" "$@"
EOF
cat >"$OUT/scaling.sh" <<'EOF'
#!/usr/bin/env bash
# The poll-thread scaling table from the bundle (arguments and environment:
# bench/scaling-bench.sh; needs taskset, util-linux).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/env.sh"
exec bash "$here/bench/scaling-bench.sh" "$@"
EOF
cat >"$OUT/device-check.sh" <<'EOF'
#!/usr/bin/env bash
# Every timed figure of issues 17 and 18 in one call (bench/device-check.sh): OUTDIR gets
# summary.txt and raw.tar.gz.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/env.sh"
exec bash "$here/bench/device-check.sh" "$@"
EOF
chmod +x "$OUT/run.sh" "$OUT/scaling.sh" "$OUT/device-check.sh"
tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1)), $OUT.tar.gz ($(du -sh "$OUT.tar.gz" | cut -f1))"

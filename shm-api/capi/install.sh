#!/usr/bin/env bash
# Installs librdsd (C ABI), its header and pkg-config file, and the preload library with
# rdsd-run under a prefix:
#   shm-api/capi/install.sh [--prefix /usr/local] [--from target/release]
#   -> PREFIX/include/rdsd.h, PREFIX/lib/librdsd.so.0.1.0 (+ .so.0, .so links), librdsd.a,
#      PREFIX/lib/pkgconfig/rdsd.pc, PREFIX/lib/librdsd-preload.so, PREFIX/bin/rdsd-run
# Without --from it builds them first (cargo build --release). Afterwards
# `pkg-config --cflags --libs rdsd` works (set PKG_CONFIG_PATH=PREFIX/lib/pkgconfig for a
# prefix pkg-config does not search).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
prefix=/usr/local
from=""
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix="$2"; shift 2 ;;
        --prefix=*) prefix="${1#--prefix=}"; shift ;;
        --from) from="$2"; shift 2 ;;
        --from=*) from="${1#--from=}"; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -z "$from" ]; then
    (cd "$root" && cargo build --release -p rdsd-capi -p rdsd-preload)
    from="$root/target/release"
fi
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -1)"
major="${version%%.*}"
for f in librdsd.so librdsd.a librdsd_preload.so rdsd-run; do
    [ -e "$from/$f" ] || { echo "install.sh: $from/$f missing (cargo build -p rdsd-capi -p rdsd-preload)" >&2; exit 1; }
done
install -d "$prefix/include" "$prefix/lib/pkgconfig" "$prefix/bin"
install -m 0644 "$here/include/rdsd.h" "$prefix/include/rdsd.h"
install -m 0755 "$from/librdsd.so" "$prefix/lib/librdsd.so.$version"
ln -sfn "librdsd.so.$version" "$prefix/lib/librdsd.so.$major"
ln -sfn "librdsd.so.$major" "$prefix/lib/librdsd.so"
install -m 0644 "$from/librdsd.a" "$prefix/lib/librdsd.a"
install -m 0755 "$from/librdsd_preload.so" "$prefix/lib/librdsd-preload.so"
install -m 0755 "$from/rdsd-run" "$prefix/bin/rdsd-run"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" "$here/rdsd.pc.in" > "$prefix/lib/pkgconfig/rdsd.pc"
echo "installed librdsd $version under $prefix"

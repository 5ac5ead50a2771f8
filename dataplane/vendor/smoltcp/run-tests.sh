#!/usr/bin/env bash
# smoltcp's own library tests on the vendored, patched source, rdsd's patch tests among them
# (PATCHES.md). They need smoltcp's dev-dependencies, which the trimmed Cargo.toml here leaves
# out, so they run in a copy of the published 0.14.0 crate (fetched from crates.io) whose
# src/ and build.rs are replaced by these: first with every feature (the default set), then
# with rdsd's. Run by tests/run.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=${SMOLTCP_TEST_DIR:-${TMPDIR:-/tmp}/rdsd-smoltcp-tests}
version=0.14.0
mkdir -p "$work/fetch/src"
cat >"$work/fetch/Cargo.toml" <<TOML
[package]
name = "fetch-smoltcp"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
smoltcp = "=$version"

[workspace]
TOML
echo 'fn main() {}' >"$work/fetch/src/main.rs"
cargo fetch -q --manifest-path "$work/fetch/Cargo.toml"
published=$(cargo metadata --manifest-path "$work/fetch/Cargo.toml" --format-version 1 |
    python3 -c 'import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "smoltcp":
        print(p["manifest_path"].rsplit("/", 1)[0])')
[[ -d "$published" ]] || { echo "smoltcp $version not found in cargo's registry" >&2; exit 1; }
rm -rf "$work/crate"
cp -r "$published" "$work/crate"
chmod -R u+w "$work/crate"
rm -rf "$work/crate/src"
cp -r "$here/src" "$work/crate/src"
cp "$here/build.rs" "$work/crate/build.rs"
cd "$work/crate"
export CARGO_TARGET_DIR="$work/target"
cargo test --lib -q
cargo test --lib -q --no-default-features \
    --features "medium-ethernet proto-ipv4 socket-tcp socket-tcp-cubic std"

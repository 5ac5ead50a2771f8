//! The test-only fault hooks (`dataplane/src/fault.rs`) exist only in the fault-injection build:
//! the ordinary rdsd has no `--fault` flag and does not even contain the hooks' names, so
//! nothing can arm them there; the build the hook tests use does, and refuses a bad hook.

use rdsd_tests::{rdsd_bin, rdsd_fault_bin};
use std::process::Command;

const HOOKS: [&str; 4] = [
    "stall-poll-ms",
    "rdma-qp-error-every",
    "die-in-fanout",
    "stall-in-fanout",
];

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// rdsd `args`, expected to exit with 2 (a usage or configuration error): its stderr.
fn refused(bin: std::path::PathBuf, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(["--control-socket", "/nonexistent/rdsd-fault-hooks.sock"])
        .args(args)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn only_the_fault_injection_build_has_the_hooks() {
    let plain = std::fs::read(rdsd_bin()).expect("read rdsd");
    let faulty = std::fs::read(rdsd_fault_bin()).expect("read the fault-injection rdsd");
    for hook in HOOKS {
        assert!(
            !contains(&plain, hook.as_bytes()),
            "{hook} is in the ordinary rdsd binary"
        );
        assert!(
            contains(&faulty, hook.as_bytes()),
            "{hook} is missing from the fault-injection build"
        );
    }
    let e = refused(rdsd_bin(), &["--fault", "stall-poll-ms=10"]);
    assert!(
        e.contains("--fault"),
        "the ordinary build has no such flag: {e}"
    );
}

#[test]
fn the_fault_build_refuses_a_bad_hook() {
    let e = refused(rdsd_fault_bin(), &["--fault", "stall-poll=10"]);
    assert!(
        e.contains("unknown hook") && e.contains("stall-poll-ms"),
        "{e}"
    );
    let e = refused(rdsd_fault_bin(), &["--fault", "die-in-fanout=0"]);
    assert!(e.contains("not a count above 0"), "{e}");
    let e = refused(rdsd_fault_bin(), &["--fault", "rdma-qp-error-every"]);
    assert!(e.contains("NAME=VALUE"), "{e}");
}

//! End-to-end smoke test: the micro-benchmark subcommands against a spawned rdsd, with tiny
//! counts (the default rds-stress mode is tested in `stress.rs`).
//! Needs the `rdsd` binary next to `rds-bench` (`cargo build -p rdsd` for the same profile);
//! skipped otherwise.

use std::path::Path;
use std::process::Command;

fn run(args: &[&str]) -> String {
    let exe = env!("CARGO_BIN_EXE_rds-bench");
    let out = Command::new(exe)
        .args(args)
        .output()
        .expect("run rds-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "rds-bench {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn every_subcommand_runs() {
    require_rdsd();
    // Nothing pinned: tests share the machine.
    let out = run(&[
        "rtt",
        "--poll-core",
        "-2",
        "--peer-core",
        "-2",
        "--count",
        "300",
        "--warmup",
        "10",
        "--baseline",
        "both",
    ]);
    assert!(
        out.contains("RESULT rtt impl=rdsd size=64 count=300 "),
        "{out}"
    );
    assert!(out.contains("RESULT rtt impl=unix-block"), "{out}");
    assert!(out.contains("RESULT rtt impl=unix-spin"), "{out}");
    assert!(
        out.contains("RESULT rtt_ratio baseline=unix-block"),
        "{out}"
    );

    // One message per send, and sendmmsg-style batches of 8 (`Socket::send_batch`).
    for batch in ["1", "8"] {
        let out = run(&[
            "tput",
            "--poll-core",
            "-2",
            "--peer-core",
            "-2",
            "--count",
            "20000",
            "--size",
            "100",
            "--batch",
            batch,
        ]);
        assert!(
            out.contains("RESULT tput impl=rdsd size=100 count=20000 "),
            "{out}"
        );
        assert!(out.contains("RESULT tput impl=unix-block"), "{out}");
    }

    let out = run(&[
        "blocking",
        "--poll-core",
        "-2",
        "--count",
        "300",
        "--wake-samples",
        "5",
        "--idle-secs",
        "0.3",
    ]);
    assert!(
        out.contains("--idle backoff"),
        "measured on rdsd's default: {out}"
    );
    let wake = out
        .lines()
        .find(|l| l.starts_with("RESULT wake "))
        .unwrap_or_else(|| panic!("{out}"));
    let parks: u64 = wake
        .rsplit("parks=")
        .next()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{wake}"));
    assert!(
        parks >= 5,
        "rdsd parked before every wake-up sample: {wake}"
    );
    assert!(out.contains("RESULT blocking rdsd_p50_ns="), "{out}");
    assert!(out.contains("RESULT idle cpu_alone_pct="), "{out}");
}

fn require_rdsd() {
    let rdsd = Path::new(env!("CARGO_BIN_EXE_rds-bench")).with_file_name("rdsd");
    rdsd_tests::require!(
        if rdsd.exists() {
            Ok(())
        } else {
            Err(format!("{} is not built", rdsd.display()))
        },
        "cargo build --workspace --bins (tests/run.sh does it)"
    );
}

/// `key=value` out of a RESULT line.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}

/// Tiny fan-out: every implementation, two group sizes; every member must have received every
/// message (rds-bench checks each sequence number and source; here the counts).
#[test]
fn fanout_every_member_gets_every_message() {
    require_rdsd();
    let (warmup, latency, messages) = (5u64, 20u64, 300u64);
    let out = run(&[
        "fanout",
        "--poll-core",
        "-2",
        "--members",
        "1,3",
        "--warmup",
        &warmup.to_string(),
        "--latency-count",
        &latency.to_string(),
        "--messages",
        &messages.to_string(),
        "--window",
        "8",
    ]);
    let per_member = warmup + latency + messages;
    for imp in ["group", "rds-unicast", "unix-seqpacket", "iceoryx2"] {
        for n in [1u64, 3] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("RESULT fanout impl={imp} members={n} ")))
                .unwrap_or_else(|| panic!("no {imp} row for {n} members:\n{out}"));
            assert_eq!(field(line, "expected"), per_member * n, "{line}");
            assert_eq!(field(line, "delivered"), per_member * n, "{line}");
        }
    }
    // One group send per message, one delivery per member: rdsd did the fan-out.
    let counters = out
        .lines()
        .find(|l| l.starts_with("RESULT fanout_counters "))
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(field(counters, "group_sends"), 2 * per_member, "{counters}");
    assert_eq!(
        field(counters, "group_deliveries"),
        4 * per_member,
        "{counters}"
    );
    assert_eq!(field(counters, "group_drops_full"), 0, "{counters}");
    assert!(out.contains("RESULT fanout_target members=3 "), "{out}");
}

#[test]
fn bad_arguments_are_refused() {
    let exe = env!("CARGO_BIN_EXE_rds-bench");
    let out = Command::new(exe)
        .args(["rtt", "--app-core", "4096", "--socket", "/nonexistent"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("CPU 4096 is not one this process may run on"));
    let out = Command::new(exe)
        .args([
            "tput",
            "--socket",
            "/nonexistent/rdsd.sock",
            "--baseline",
            "none",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot attach"));
}

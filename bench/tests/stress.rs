//! rds-bench's rds-stress mode, end to end: `--pair` starts a passive rds-bench and an rdsd of
//! its own (the `rdsd` binary next to `rds-bench`: `cargo build -p rdsd` first, as the test
//! command does), then drives real traffic through rdsd and the kernel baselines.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_rds-bench")
}

fn need_rdsd() {
    let rdsd = Path::new(exe()).with_file_name("rdsd");
    assert!(
        rdsd.exists(),
        "{} is not built: run `cargo build -p rdsd` (tests/run.sh builds every binary first)",
        rdsd.display()
    );
}

/// Runs rds-bench with `args` (and `env`); nothing pinned, rdsd started by --pair.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(exe());
    c.args(args).env_remove("RDS_BENCH_TEST_CORRUPT_EVERY");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run rds-bench")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> String {
    let o = run(args, &[]);
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "rds-bench {args:?} failed ({}):\n{out}\n{err}",
        o.status
    );
    out
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rds-bench-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A per-second or average line: 7 numbers under `tsks tx/s rx/s tx+rx K/s tx us/c rtt us cpu %`.
fn numbers(line: &str) -> Option<Vec<f64>> {
    let v: Option<Vec<f64>> = line
        .trim_end_matches("(average)")
        .split_whitespace()
        .map(|w| w.parse().ok())
        .collect();
    v.filter(|v| v.len() == 7)
}

#[test]
fn text_report_has_per_second_average_and_percentile_lines() {
    need_rdsd();
    let out = ok(&[
        "--pair",
        "-T",
        "2",
        "-t",
        "2",
        "-d",
        "2",
        "-q",
        "512",
        "-a",
        "32",
        "--transports",
        "rds,tcp",
        "--show-histogram",
    ]);
    let sections: Vec<&str> = out.split("== ").skip(1).collect();
    assert_eq!(sections.len(), 2, "one section per transport:\n{out}");
    for (sec, name) in sections.iter().zip([
        "rdsd (busy-poll apps): 2 tasks, depth 2, 512 B requests, 32 B acks, 2 s",
        "kernel TCP (busy-poll apps)",
    ]) {
        assert!(sec.starts_with(name), "{sec}");
        let lines: Vec<&str> = sec.lines().collect();
        let h = lines
            .iter()
            .position(|l| {
                l.split_whitespace().collect::<Vec<_>>()
                    == [
                        "tsks", "tx/s", "rx/s", "tx+rx", "K/s", "tx", "us/c", "rtt", "us", "cpu",
                        "%",
                    ]
            })
            .unwrap_or_else(|| panic!("no column header:\n{sec}"));
        let per_sec: Vec<Vec<f64>> = lines[h + 1..]
            .iter()
            .take_while(|l| !l.contains("(average)"))
            .map(|l| numbers(l).unwrap_or_else(|| panic!("not a report line: {l:?}\n{sec}")))
            .collect();
        assert_eq!(per_sec.len(), 2, "one line per second:\n{sec}");
        for v in &per_sec {
            assert_eq!(v[0], 2.0, "tsks column");
            assert!(
                v[1] > 0.0 && v[2] > 0.0,
                "traffic both ways every second: {v:?}"
            );
            assert!(v[5] > 0.0, "rtt us: {v:?}");
        }
        let avg = lines
            .iter()
            .find(|l| l.ends_with("(average)"))
            .and_then(|l| numbers(l))
            .unwrap_or_else(|| panic!("no (average) line:\n{sec}"));
        assert!(avg[2] > 0.0 && avg[5] > 0.0, "{avg:?}");
        let mut last = 0.0;
        for p in ["p50", "p90", "p99", "p99.9", "p99.99", "max"] {
            let v: f64 = lines
                .iter()
                .find_map(|l| {
                    let w: Vec<&str> = l.split_whitespace().collect();
                    (w.len() == 2 && w[0] == p)
                        .then(|| w[1].parse().ok())
                        .flatten()
                })
                .unwrap_or_else(|| panic!("no {p} line:\n{sec}"));
            assert!(v >= last && v > 0.0, "{p} = {v} after {last}");
            last = v;
        }
        assert!(sec.contains("rtt histogram (us):"), "{sec}");
    }
    let cmp = out
        .split("comparison")
        .nth(1)
        .unwrap_or_else(|| panic!("no comparison:\n{out}"));
    let tcp = cmp
        .lines()
        .find(|l| l.trim_start().starts_with("kernel TCP (busy-poll)"))
        .unwrap_or_else(|| panic!("{cmp}"));
    assert!(
        tcp.matches('x').count() >= 3,
        "ratios next to the baseline: {tcp}"
    );
}

#[test]
fn summary_only_blocking_and_busy_modes() {
    need_rdsd();
    let out = ok(&[
        "--pair",
        "-T",
        "1",
        "-z",
        "--mode",
        "both",
        "--transports",
        "rds,unix",
    ]);
    assert!(
        !out.contains("tsks       tx/s"),
        "-z prints no per-second lines:\n{out}"
    );
    assert_eq!(out.matches("(average)").count(), 4, "{out}");
    for t in [
        "== rdsd (busy-poll apps)",
        "== rdsd (blocking apps)",
        "== AF_UNIX seqpacket (busy-poll apps)",
        "== AF_UNIX seqpacket (blocking apps)",
    ] {
        assert!(out.contains(t), "missing {t}:\n{out}");
    }
    assert!(
        out.contains("AF_UNIX seqpacket (blocking)"),
        "comparison row for the blocking mode:\n{out}"
    );
}

#[test]
fn json_and_plots() {
    need_rdsd();
    let dir = tmpdir("json");
    let out = ok(&[
        "--pair",
        "-T",
        "2",
        "--json",
        "--transports",
        "rds,udp",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let v: Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{out}"));
    assert_eq!(v["tool"], "rds-bench");
    assert_eq!(v["params"]["tasks"], 1);
    assert_eq!(v["params"]["req_bytes"], 1024);
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["transport"], "rds");
    assert_eq!(runs[1]["transport"], "udp");
    for r in runs {
        assert_eq!(r["mode"], "busy-poll");
        assert_eq!(r["per_second"].as_array().map(Vec::len), Some(2), "{r}");
        for k in [
            "tsks",
            "tx_per_s",
            "rx_per_s",
            "tx_rx_kib_per_s",
            "tx_us_per_call",
            "rtt_us",
            "cpu_pct",
        ] {
            assert!(r["average"][k].is_number(), "average.{k} in {r}");
            assert!(
                r["per_second"][0][k].is_number(),
                "per_second[0].{k} in {r}"
            );
        }
        for k in ["p50", "p90", "p99", "p99.9", "p99.99", "max"] {
            assert!(
                r["latency_us"][k].as_f64().is_some_and(|x| x > 0.0),
                "latency_us.{k} in {r}"
            );
        }
        assert!(r["msgs_per_s"].as_f64().is_some_and(|x| x > 0.0));
        assert_eq!(r["verify_errors"], 0);
    }
    let c = &v["comparison"][0];
    assert_eq!(c["baseline"], "udp");
    assert!(
        c["msgs_per_s_ratio"].as_f64().is_some_and(|x| x > 0.0),
        "{c}"
    );
    assert!(c["p50_ratio"].as_f64().is_some_and(|x| x > 0.0), "{c}");
    for k in ["latency_cdf", "throughput"] {
        let p = v["plots"][k]
            .as_str()
            .unwrap_or_else(|| panic!("plots.{k}"));
        let svg = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}"));
        assert!(
            svg.contains("<svg") && svg.contains("polyline"),
            "{p} is an SVG with lines"
        );
        assert!(
            svg.contains("rdsd (busy-poll)") && svg.contains("kernel UDP (busy-poll)"),
            "legend in {p}"
        );
    }
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(file, v, "results.json is what --json printed");
    assert!(std::fs::read_to_string(dir.join("summary.md"))
        .unwrap()
        .contains("| **rdsd (busy-poll)** |"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn one_way_counts_what_the_passive_side_received() {
    need_rdsd();
    let out = ok(&[
        "--pair",
        "-T",
        "1",
        "-o",
        "-z",
        "-v",
        "--json",
        "--transports",
        "rds,tcp",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    for r in v["runs"].as_array().unwrap() {
        let sent = r["sent"].as_u64().unwrap();
        let got = r["passive"]["rx"].as_u64().unwrap();
        assert!(sent > 100, "{r}");
        // Reliable transports: everything sent arrived (the end-of-run fence waits for it).
        assert_eq!(got, sent, "{r}");
        assert_eq!(r["latency_us"]["count"], 0, "no round trips one-way");
        assert_eq!(r["passive"]["verify_errors"], 0);
    }
}

#[test]
fn verification_catches_a_corrupted_payload() {
    need_rdsd();
    let env = [("RDS_BENCH_TEST_CORRUPT_EVERY", "20")];
    let args = [
        "--pair",
        "-T",
        "1",
        "-z",
        "-v",
        "--json",
        "--transports",
        "rds,tcp",
    ];
    let o = run(&args, &env);
    let (out, err) = text(&o);
    assert!(
        !o.status.success(),
        "a corrupted payload must fail the run:\n{out}\n{err}"
    );
    assert!(err.contains("payload verification failed"), "{err}");
    assert!(err.contains("payload byte"), "says which byte: {err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}"));
    for r in v["runs"].as_array().unwrap() {
        let bad = r["verify_errors"].as_u64().unwrap();
        let acks = r["latency_us"]["count"].as_u64().unwrap();
        assert!(
            bad > 0 && bad <= acks / 19 + 1,
            "about one in 20 acks corrupted: {bad} of {acks} ({})",
            r["transport"]
        );
    }
    // The same corruption goes unnoticed without -v, and -v alone finds nothing wrong.
    let o = run(&["--pair", "-T", "1", "-z", "--transports", "rds"], &env);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = run(
        &["--pair", "-T", "1", "-z", "-v", "--transports", "rds"],
        &[],
    );
    assert!(o.status.success(), "{:?}", text(&o));
}

#[test]
fn bad_flags_are_refused_clearly() {
    for (args, want) in [
        (
            &["-s", "127.0.0.1", "-q", "10"][..],
            "-q 10: a request must be between 24 bytes",
        ),
        (
            &["-s", "127.0.0.1", "-a", "2000000"][..],
            "-a 2000000: an ack must be between",
        ),
        (
            &["-s", "127.0.0.1", "-t", "0"][..],
            "-t 0: tasks must be between",
        ),
        (
            &["-s", "127.0.0.1", "-d", "0"][..],
            "-d 0: depth must be between",
        ),
        (&["-s", "127.0.0.1", "-T", "0"][..], "-T 0"),
        (
            &["--pair", "-q", "70000", "--transports", "udp"][..],
            "do not fit in one kernel UDP datagram",
        ),
        (
            &["-s", "127.0.0.1", "--transports", "sctp"][..],
            "invalid value 'sctp' for '--transports",
        ),
        (
            &["-s", "not-an-address"][..],
            "invalid value 'not-an-address'",
        ),
        (&["--bogus"][..], "unexpected argument '--bogus'"),
        (&["--pair", "-s", "127.0.0.1"][..], "cannot be used with"),
    ] {
        let o = run(args, &[]);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{args:?} was accepted:\n{out}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in:\n{err}");
        assert!(out.is_empty(), "{args:?} printed a report:\n{out}");
    }
}

#[test]
fn missing_rdsd_is_a_clear_error() {
    for args in [
        &[
            "-s",
            "127.0.0.1",
            "-T",
            "1",
            "--socket",
            "/nonexistent/rdsd.sock",
        ][..],
        &["--pair", "-T", "1", "--socket", "/nonexistent/rdsd.sock"][..],
        &["-p", "0", "--socket", "/nonexistent/rdsd.sock"][..],
    ] {
        let o = run(args, &[]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}:\n{out}\n{err}");
        assert!(
            err.contains("cannot attach to rdsd at /nonexistent/rdsd.sock")
                && err.contains("is rdsd running"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn between_two_network_namespaces() {
    need_rdsd();
    rdsd_tests::require!(rdsd_tests::root(), rdsd_tests::AS_ROOT);
    let bin = Path::new(exe()).parent().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("netns-bench.sh");
    let o = Command::new("bash")
        .arg(&script)
        .args([
            "-T",
            "1",
            "-q",
            "64",
            "-a",
            "64",
            "-v",
            "--json",
            "--transports",
            "rds,tcp,udp",
        ])
        .env("BIN", bin)
        .env_remove("RDS_BENCH_TEST_CORRUPT_EVERY")
        .output()
        .expect("run netns-bench.sh");
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "netns-bench.sh failed ({}):\n{out}\n{err}",
        o.status
    );
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}:\n{out}\n{err}"));
    assert_eq!(v["params"]["local"], "10.77.0.1");
    assert_eq!(v["params"]["peer"], "10.77.0.2:4000");
    let kinds: Vec<&str> = v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["rds", "tcp", "udp"]);
    for r in v["runs"].as_array().unwrap() {
        assert!(r["latency_us"]["count"].as_u64().unwrap() > 10, "{r}");
        assert_eq!(r["verify_errors"], 0, "{r}");
    }
    assert!(v["comparison"].as_array().is_some_and(|c| c.len() == 2));
}

/// `--breakdown`: every round trip is traced by the rdsd that `--pair` starts (with
/// `--trace-hops`), and the seven hops add up to the round trip (they telescope: each hop ends
/// where the next begins), so the sum of the hop means is the mean round trip.
#[test]
fn breakdown_traces_every_round_trip_and_its_hops_add_up() {
    need_rdsd();
    let out = ok(&[
        "--pair",
        "-T",
        "1",
        "-q",
        "64",
        "-a",
        "96",
        "--breakdown",
        "--json",
    ]);
    let doc: Value = serde_json::from_str(&out).expect("JSON document");
    let run = &doc["runs"][0];
    let b = &run["breakdown"];
    let hops = b["hops"].as_array().expect("hops");
    assert_eq!(hops.len(), 7, "{b}");
    assert_eq!(b["untraced"], 0, "an rdsd stamp is missing: {b}");
    let rtts = run["latency_us"]["count"].as_u64().unwrap();
    assert!(rtts > 0);
    for h in hops {
        assert_eq!(
            h["count"].as_u64(),
            Some(rtts),
            "every round trip traced: {h}"
        );
    }
    let sum: f64 = hops.iter().map(|h| h["mean_us"].as_f64().unwrap()).sum();
    let mean = run["latency_us"]["mean"].as_f64().unwrap();
    assert!(
        (sum - mean).abs() <= 0.01 * mean + 0.01,
        "hop means sum to {sum} µs, the mean round trip is {mean} µs"
    );
}

#[test]
fn breakdown_refuses_messages_too_short_for_the_trace_block() {
    need_rdsd();
    let o = run(
        &["--pair", "-T", "1", "-q", "64", "-a", "64", "--breakdown"],
        &[],
    );
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(err.contains("--breakdown needs"), "{err}");
}

/// `--attach-per-task`: every task of both sides attaches on its own (an app each), so an rdsd
/// with several poll threads spreads them; the traffic is the same.
#[test]
fn attach_per_task_gives_every_task_an_app_of_its_own() {
    need_rdsd();
    let dir = tmpdir("per-task");
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("rdsd.sock");
    let bin = Path::new(exe()).with_file_name("rdsd");
    let mut rdsd = Command::new(&bin)
        .arg("--control-socket")
        .arg(&sock)
        .arg("--state-file")
        .arg(dir.join("state"))
        .args([
            "--poll-core",
            "-2",
            "--poll-core",
            "-2",
            "--control-core",
            "-2",
        ])
        .args(["--hugepages", "off", "--log", "warn"])
        .spawn()
        .expect("start rdsd");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !sock.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let s = sock.to_str().unwrap();
    let out = ok(&[
        "--pair",
        "--socket",
        s,
        "--attach-per-task",
        "-t",
        "3",
        "-T",
        "1",
        "-z",
        "--json",
        "--mode",
        "blocking",
        "--transports",
        "rds",
    ]);
    let doc: Value = serde_json::from_str(&out).expect("json");
    assert!(
        doc["runs"][0]["msgs_per_s"].as_f64().unwrap() > 0.0,
        "{doc}"
    );
    let stats = Command::new(Path::new(exe()).with_file_name("rdsctl"))
        .args(["-s", s, "stats"])
        .output()
        .expect("rdsctl");
    let stats = String::from_utf8_lossy(&stats.stdout).into_owned();
    let _ = rdsd.kill();
    let _ = rdsd.wait();
    let _ = std::fs::remove_dir_all(&dir);
    // --pair's check, then per side one check and one per task.
    assert!(
        stats.lines().any(|l| l == "apps_attached 9"),
        "3 tasks per side, each attached: {stats}"
    );
}

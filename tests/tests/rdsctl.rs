//! `rdsctl` against real rdsd processes: the shape of every subcommand's output (text and
//! `--json`), `info`'s sections with live sockets and connections, `ping` to a local address
//! (answered by the loopback transport) and between two rdsd in network namespaces, bad flags,
//! a missing rdsd, a socket we may not use, the Prometheus text and the HTTP metrics endpoint
//! checked with a real parser (Python's prometheus_client), systemd's readiness message, the
//! unit file checked with `systemd-analyze verify`, and `rdsd --print-default-config`.

use rdsd_tests::netns::Lab;
use rdsd_tests::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn rdsctl_bin() -> PathBuf {
    let p = bin_dir().join("rdsctl");
    assert!(
        p.exists(),
        "{} missing: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// What one rdsctl run printed.
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "rdsctl printed no JSON ({e}):\n{}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    fn ok(self) -> Out {
        assert_eq!(
            self.code, 0,
            "rdsctl failed:\nstdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        self
    }
}

fn run(mut cmd: Command) -> Out {
    let o = cmd.stdin(Stdio::null()).output().expect("run rdsctl");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `rdsctl -s SOCKET args...`
fn rdsctl(socket: &Path, args: &[&str]) -> Out {
    let mut c = Command::new(rdsctl_bin());
    c.arg("-s").arg(socket).args(args).env_remove("RDSD_SOCKET");
    run(c)
}

fn counters_of(doc: &Value) -> &serde_json::Map<String, Value> {
    doc["counters"].as_object().expect("counters object")
}

/// Lines `   N: U usec` of a ping; returns (N, U) of each.
fn ping_replies(stdout: &str) -> Vec<(u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let (seq, rest) = l.trim().split_once(": ")?;
            let us = rest.strip_suffix(" usec")?;
            Some((seq.parse().ok()?, us.parse().ok()?))
        })
        .collect()
}

#[test]
fn status_and_stats_text_and_json() {
    let d = Daemon::start(&[]);
    let o = rdsctl(&d.socket, &["status"]).ok();
    let first = o.stdout.lines().next().unwrap();
    assert!(
        first.starts_with(&format!(
            "rdsd at {}: up (pid {}",
            d.socket.display(),
            d.pid()
        )),
        "{first}"
    );
    assert!(first.contains("local addresses 127.0.0.0/8"), "{first}");
    // The test daemons' poll threads are unpinned (`--poll-core -2`), as is their control thread.
    let n = rdsd_tests::poll_threads();
    let polls = vec!["unpinned"; n].join(", ");
    let threads = format!(
        "{n} poll thread{} ({polls}; idle backoff), control thread unpinned",
        if n == 1 { "" } else { "s" }
    );
    assert!(first.contains(&threads), "{first}");
    // No subcommand = status.
    let again = rdsctl(&d.socket, &[]).ok().stdout;
    let upto = |l: &str| l.split(", up ").next().unwrap().to_string();
    assert_eq!(upto(again.lines().next().unwrap()), upto(first));
    // Every other status line is a non-zero counter.
    for l in o.stdout.lines().skip(1) {
        let (_, v) = l.trim().split_once(' ').expect("name value");
        assert_ne!(v.parse::<u64>().unwrap(), 0, "{l}");
    }
    let j = rdsctl(&d.socket, &["status", "--json"]).ok().json();
    assert_eq!(j["up"], Value::Bool(true));
    assert_eq!(j["rdsd"]["pid"].as_u64(), Some(d.pid() as u64));
    assert_eq!(j["socket"].as_str(), Some(d.socket.to_str().unwrap()));
    assert!(counters_of(&j).values().all(|v| v.as_u64() != Some(0)));

    let stats = rdsctl(&d.socket, &["stats"]).ok().stdout;
    let names: Vec<&str> = stats
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("name value");
            v.parse::<u64>().expect("number");
            k
        })
        .collect();
    assert!(names.len() >= 40, "{stats}");
    assert!(names.contains(&"loop_pings") && names.contains(&"tcp_delivered"));
    let j = rdsctl(&d.socket, &["--json", "stats"]).ok().json();
    let keys: Vec<&str> = counters_of(&j).keys().map(String::as_str).collect();
    assert_eq!(
        keys, names,
        "--json lists the same counters in the same order"
    );
    // Formats that exclude each other.
    let o = rdsctl(&d.socket, &["stats", "--prometheus", "--json"]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("choose one"), "{}", o.stderr);
}

#[test]
fn info_sections_show_live_sockets_and_queues() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    let rx = r.socket().unwrap();
    rx.set_recv_buffer_size(50_000).unwrap();
    rx.bind(lo(4100)).unwrap();
    rx.set_cong_monitor(true).unwrap();
    let tx = r.socket().unwrap();
    tx.bind(lo(4101)).unwrap();
    for _ in 0..3 {
        tx.send_to(&[7u8; 100], lo(4100)).unwrap();
    }
    wait_for(
        || {
            rdsctl(&d.socket, &["--json", "info", "-r"]).ok().json()["recv_queue"]["bytes"].as_u64()
                == Some(300)
        },
        Duration::from_secs(10),
        "300 bytes in the receive queue",
    );
    let doc = rdsctl(&d.socket, &["--json", "info", "-k", "-r", "-s", "-t"])
        .ok()
        .json();
    assert_eq!(doc["schema"].as_u64(), Some(1));
    assert!(doc.get("counters").is_none() && doc.get("connections").is_none());
    assert_eq!(doc["rdsd"]["transports"], serde_json::json!(["loopback"]));
    let socks = doc["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 2, "{socks:?}");
    let s = socks
        .iter()
        .find(|s| s["port"] == 4100)
        .expect("the receiver");
    assert_eq!(s["addr"].as_str(), Some("127.0.0.1"));
    assert_eq!(s["rx_queued_bytes"].as_u64(), Some(300));
    assert_eq!(s["rx_pending"], Value::Bool(true));
    assert_eq!(s["cong_monitor"], Value::Bool(true));
    assert_eq!(s["congested"], Value::Bool(false));
    assert_eq!(s["rcvbuf"].as_u64(), Some(50_000));
    assert_eq!(s["sndbuf"].as_u64(), Some(106_496));
    assert_eq!(s["pid"].as_u64(), Some(std::process::id() as u64));
    let t = socks
        .iter()
        .find(|s| s["port"] == 4101)
        .expect("the sender");
    assert_eq!(
        t["tx_queued_bytes"].as_u64(),
        Some(0),
        "loopback released it"
    );
    assert_eq!(t["cong_monitor"], Value::Bool(false));
    let q = &doc["recv_queue"];
    assert_eq!(
        (q["sockets"].as_u64(), q["bytes"].as_u64()),
        (Some(1), Some(300))
    );
    assert_eq!(q["entries"][0]["port"].as_u64(), Some(4100));
    assert_eq!(doc["send_queue"]["socket_bytes"].as_u64(), Some(0));
    assert_eq!(doc["send_queue"]["msgs"].as_u64(), Some(0));
    assert_eq!(doc["retransmit_queue"]["msgs"].as_u64(), Some(0));

    // The text tables.
    let text = rdsctl(&d.socket, &["info", "-k"]).ok().stdout;
    let row: Vec<&str> = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("4100"))
        .unwrap_or_else(|| panic!("no row for port 4100:\n{text}"))
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..7],
        ["127.0.0.1", "4100", "50000", "106496", "300", "0", "-"]
    );
    assert_eq!(row[7], "yes", "cong monitor column: {row:?}");
    assert_eq!(row[8], std::process::id().to_string());
    let text = rdsctl(&d.socket, &["info", "-r"]).ok().stdout;
    assert!(
        text.starts_with("Receive queue: 1 socket(s), 300 byte(s) unread\n"),
        "{text}"
    );
    // Every section without a flag.
    let all = rdsctl(&d.socket, &["info"]).ok().stdout;
    for title in [
        "RDS counters:",
        "RDS sockets:",
        "RDS connections:",
        "RDS paths:",
        "Receive queue:",
        "Send queue:",
        "Retransmit queue:",
    ] {
        assert!(all.contains(title), "no {title} in:\n{all}");
    }
    let doc = rdsctl(&d.socket, &["info", "--json"]).ok().json();
    for k in [
        "counters",
        "counter_help",
        "sockets",
        "connections",
        "recv_queue",
        "send_queue",
        "retransmit_queue",
    ] {
        assert!(doc.get(k).is_some(), "no {k} in {doc}");
    }
    assert_eq!(
        counters_of(&doc)["sockets_opened"].as_u64(),
        Some(2),
        "counters are current"
    );
    // Reading drains the queue, and info sees it.
    let mut buf = [0u8; 200];
    for _ in 0..3 {
        assert_eq!(rx.recv(&mut buf).unwrap(), 100);
    }
    let doc = rdsctl(&d.socket, &["--json", "info", "-r"]).ok().json();
    assert_eq!(doc["recv_queue"]["bytes"].as_u64(), Some(0));
}

/// A listing longer than one control datagram (64 KiB) comes whole, as the kernel's rds-info
/// tables do: rdsctl and the library (the C ABI's `RDS_INFO_*`) get it in a memory file
/// attached to the reply, where rdsd used to cut it.
#[test]
fn info_longer_than_a_datagram_comes_whole() {
    // About 220 B of JSON a socket, less with short pids: 600 is twice one datagram anywhere.
    let sockets = 600u16;
    let cfg = config_file(&format!(
        "max_sockets_per_app = {sockets}\nhugepages = \"off\"\n"
    ));
    let d = Daemon::start(&["-c", cfg.to_str().unwrap()]);
    let r = d.attach();
    let socks: Vec<_> = (0..sockets)
        .map(|i| {
            let s = r.socket().unwrap();
            s.bind(lo(21000 + i)).unwrap();
            s
        })
        .collect();
    let doc = rdsctl(&d.socket, &["--json", "info", "-k"]).ok().json();
    let listed = doc["sockets"].as_array().unwrap();
    assert_eq!(listed.len(), socks.len());
    assert!(doc.get("sockets_truncated").is_none());
    let whole = serde_json::to_vec(&doc).unwrap().len();
    assert!(
        whole > 64 * 1024,
        "the document ({whole} B) fits one datagram: test nothing"
    );
    let text = rdsctl(&d.socket, &["info", "-k"]).ok().stdout;
    assert!(
        text.contains(&(21000 + sockets - 1).to_string()) && !text.contains("not shown"),
        "{text}"
    );
    // The library's reader, which the C ABI's tables use.
    let lib: Value =
        serde_json::from_str(&shm_api::info_at(&d.socket, shm_api::ctrl::INFO_SOCKETS).unwrap())
            .unwrap();
    assert_eq!(lib["sockets"].as_array().unwrap().len(), socks.len());
    let c = counters_of(&rdsctl(&d.socket, &["--json", "stats"]).ok().json()).clone();
    assert_eq!(c["ctrl_info_whole"].as_u64(), Some(3), "{c:?}");
    assert_eq!(c["ctrl_info_cut"].as_u64(), Some(0));
    // A client that does not ask for the whole document still gets one datagram, cut.
    let cut = info_cut_without_whole(&d.socket);
    assert!(cut > 0 && cut < sockets as u64, "{cut} cut");
}

/// The `sockets_truncated` count of an Info reply asked without `INFO_WHOLE` (as an older
/// library asks), read straight off the control socket.
fn info_cut_without_whole(socket: &Path) -> u64 {
    use shm_api::ctrl::{Reply, Request, INFO_SOCKETS, MAX_DATAGRAM};
    use std::os::fd::AsRawFd;
    let sock = shm_api::sys::connect_seqpacket(socket).unwrap();
    let req = Request::Info {
        sections: INFO_SOCKETS,
    };
    shm_api::sys::send_with_fds(sock.as_raw_fd(), &req.encode(1), &[]).unwrap();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (n, fds) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
    assert!(fds.is_empty());
    let reply = Reply::decode(&buf[..n]).unwrap();
    let doc: Value = serde_json::from_slice(&reply.body).unwrap();
    doc["sockets_truncated"].as_u64().unwrap_or(0)
}

#[test]
fn info_and_stats_show_groups_members_and_their_counters() {
    use shm_api::ctrl::FilterRule;
    use shm_api::{GroupFilter, GroupFlags};
    use std::net::{Ipv4Addr, SocketAddrV4};
    let metrics = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start(&["--metrics-listen", &metrics]);
    let r = d.attach();
    let group = SocketAddrV4::new(Ipv4Addr::new(239, 1, 2, 3), 5000);
    let creator = r.socket().unwrap();
    creator.bind(lo(4300)).unwrap();
    creator.group_create(group).unwrap();
    // A plain member that takes only the creator's messages, and one with both flags.
    let plain = r.socket().unwrap();
    plain.bind(lo(4301)).unwrap();
    plain.group_join(group, GroupFlags::NONE).unwrap();
    let only_creator = GroupFilter::Only(vec![FilterRule {
        addr: Ipv4Addr::LOCALHOST,
        prefix_len: 32,
        first_port: 4300,
        last_port: 4300,
    }]);
    plain.group_set_filter(group, &only_creator).unwrap();
    let both = r.socket().unwrap();
    both.bind(lo(4302)).unwrap();
    both.group_join(group, GroupFlags::DROP_WHEN_FULL | GroupFlags::LOOPBACK)
        .unwrap();
    // 3 sends from the creator reach both members; 1 from `both` reaches only itself
    // (LOOPBACK), and `plain`'s filter rejects it.
    for i in 0..3u8 {
        creator.send_to(&[i; 64], group).unwrap();
    }
    both.send_to(b"mine", group).unwrap();
    let mut buf = [0u8; 128];
    for i in 0..3u8 {
        assert_eq!(plain.recv_from(&mut buf).unwrap(), (64, lo(4300)));
        assert_eq!(buf[0], i);
        assert_eq!(both.recv_from(&mut buf).unwrap(), (64, lo(4300)));
    }
    assert_eq!(both.recv_from(&mut buf).unwrap(), (4, lo(4302)));

    let doc = rdsctl(&d.socket, &["--json", "info", "-g"]).ok().json();
    assert!(doc.get("sockets").is_none() && doc.get("counters").is_none());
    let groups = doc["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 1, "{groups:?}");
    let g = &groups[0];
    assert_eq!(
        (g["addr"].as_str(), g["port"].as_u64(), g["shard"].as_u64()),
        (Some("239.1.2.3"), Some(5000), Some(0))
    );
    assert!(g["epoch"].as_u64().unwrap() >= 1);
    let pid = std::process::id() as u64;
    let c = &g["creator"];
    assert_eq!(
        (c["addr"].as_str(), c["port"].as_u64(), c["pid"].as_u64()),
        (Some("127.0.0.1"), Some(4300), Some(pid))
    );
    let m = g["members"].as_array().unwrap();
    assert_eq!(m.len(), 2, "{m:?}");
    assert_eq!(
        (m[0]["port"].as_u64(), m[1]["port"].as_u64()),
        (Some(4301), Some(4302))
    );
    assert_eq!(m[0]["addr"].as_str(), Some("127.0.0.1"));
    assert_eq!(m[0]["pid"].as_u64(), Some(pid));
    assert_eq!(m[0]["flags"].as_u64(), Some(0));
    assert_eq!(
        (m[0]["loopback"].as_bool(), m[0]["drop_when_full"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(m[0]["filter"].as_str(), Some("only 127.0.0.1/32:4300"));
    assert_eq!(
        m[1]["flags"].as_u64(),
        Some(u64::from(
            (GroupFlags::DROP_WHEN_FULL | GroupFlags::LOOPBACK).bits()
        ))
    );
    assert_eq!(
        (m[1]["loopback"].as_bool(), m[1]["drop_when_full"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(m[1]["filter"].as_str(), Some("all"));
    let n = |k: &str| g[k].as_u64().unwrap_or_else(|| panic!("no {k} in {g}"));
    assert_eq!(
        (
            n("last_seq"),
            n("sends"),
            n("deliveries"),
            n("drops_full"),
            n("filtered")
        ),
        (4, 4, 7, 0, 1)
    );

    // The text table: one row for the group, one line per member.
    let text = rdsctl(&d.socket, &["info", "--groups"]).ok().stdout;
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[0], ["RDS", "groups:"], "{text}");
    let epoch = g["epoch"].to_string();
    assert_eq!(
        rows[2],
        [
            "239.1.2.3",
            "5000",
            &epoch,
            "2",
            "4",
            "4",
            "7",
            "0",
            "1",
            "127.0.0.1:4300"
        ],
        "{text}"
    );
    let pid = pid.to_string();
    assert_eq!(
        rows[3],
        [
            "member",
            "127.0.0.1:4301",
            "flags",
            "-",
            "pid",
            &pid,
            "filter",
            "only",
            "127.0.0.1/32:4300"
        ],
        "{text}"
    );
    assert_eq!(
        rows[4],
        [
            "member",
            "127.0.0.1:4302",
            "flags",
            "loopback,drop_when_full",
            "pid",
            &pid,
            "filter",
            "all"
        ],
        "{text}"
    );
    // Every section without a flag includes the groups.
    assert!(rdsctl(&d.socket, &["info"])
        .ok()
        .stdout
        .contains("RDS groups:"));
    let all = rdsctl(&d.socket, &["info", "--json"]).ok().json();
    assert_eq!(all["groups"].as_array().map(Vec::len), Some(1));

    // The counters: `rdsctl stats`, its JSON, Info's counters and the Prometheus text.
    let stats = rdsctl(&d.socket, &["stats"]).ok().stdout;
    let stat = |k: &str| {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {k} in:\n{stats}"))
    };
    let expect = [
        ("group_sends", 4),
        ("group_deliveries", 7),
        ("group_drops_full", 0),
        ("group_filtered", 1),
        ("group_no_group", 0),
        ("groups_created", 1),
        ("group_members_closed", 0),
    ];
    for (k, v) in expect {
        assert_eq!(stat(k), v, "{k}");
    }
    stat("group_blocked");
    let j = rdsctl(&d.socket, &["--json", "info", "-c"]).ok().json();
    let prom = rdsctl(&d.socket, &["stats", "--prometheus"]).ok().stdout;
    let (samples, _) = prometheus_parse(&prom).unwrap_or_else(|e| panic!("{e}\n{prom}"));
    let http = http_get(&metrics, "/metrics");
    let (_, body) = http.split_once("\r\n\r\n").expect("HTTP head");
    let (served, _) = prometheus_parse(body).unwrap_or_else(|e| panic!("{e}\n{body}"));
    for (k, v) in expect {
        assert_eq!(counters_of(&j)[k].as_u64(), Some(v), "{k}");
        assert!(
            j["counter_help"][k].as_str().is_some_and(|h| !h.is_empty()),
            "{k}"
        );
        let m = format!("rdsd_{k}_total");
        assert_eq!(samples[&m].as_f64(), Some(v as f64), "{k}");
        assert_eq!(served[&m].as_f64(), Some(v as f64), "{k} over HTTP");
    }
    assert!(
        prom.contains("# TYPE rdsd_group_sends_total counter\n"),
        "{prom}"
    );

    // Closing the creator keeps the group (it has members); closing them ends it.
    drop(creator);
    drop(plain);
    drop(both);
    wait_for(
        || {
            let doc = rdsctl(&d.socket, &["--json", "info", "-g"]).ok().json();
            doc["groups"].as_array().is_some_and(Vec::is_empty)
        },
        Duration::from_secs(10),
        "the group to end with its last socket",
    );
    assert_eq!(d.stat("group_members_closed"), 2);
}

/// rdsd on two poll threads, and an app on each (`apps[k]` on thread k).
fn two_threads_an_app_each() -> (Daemon, Vec<shm_api::Rdsd>) {
    let d = Daemon::start(&["--poll-core", "-2", "--poll-core", "-2"]);
    let mut apps: Vec<_> = (0..2).map(|_| d.attach()).collect();
    apps.sort_by_key(|a| a.poll_thread());
    assert_eq!(
        apps.iter().map(|a| a.poll_thread()).collect::<Vec<_>>(),
        [0, 1]
    );
    (d, apps)
}

#[test]
fn info_lists_the_groups_ordered_by_shard_0_with_senders_on_every_poll_thread() {
    use shm_api::GroupFlags;
    use std::net::{Ipv4Addr, SocketAddrV4};
    // One app per poll thread: shard 0's owns two groups with a member each, and each app
    // sends one message to each group.
    let (d, apps) = two_threads_an_app_each();
    let group = |i: u16| SocketAddrV4::new(Ipv4Addr::new(239, 9, 9, 1 + i as u8), 6000);
    let mut socks = Vec::new();
    for i in 0..2u16 {
        let c = apps[0].socket().unwrap();
        c.bind(lo(4400 + 2 * i)).unwrap();
        c.group_create(group(i)).unwrap();
        let m = apps[0].socket().unwrap();
        m.bind(lo(4401 + 2 * i)).unwrap();
        m.group_join(group(i), GroupFlags::LOOPBACK).unwrap();
        socks.extend([c, m]);
    }
    let far = apps[1].socket().unwrap();
    far.bind(lo(4410)).unwrap();
    for i in 0..2u16 {
        socks[0].send_to(b"x", group(i)).unwrap();
        far.send_to(b"y", group(i)).unwrap();
    }
    let mut buf = [0u8; 8];
    for i in 0..2 {
        for _ in 0..2 {
            socks[2 * i + 1].recv_from(&mut buf).unwrap();
        }
    }
    let doc = rdsctl(&d.socket, &["--json", "info", "-g"]).ok().json();
    let groups = doc["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 2, "{groups:?}");
    for (i, g) in groups.iter().enumerate() {
        assert_eq!(g["addr"].as_str(), Some(&*format!("239.9.9.{}", 1 + i)));
        assert_eq!(g["shard"].as_u64(), Some(0), "{g}");
        assert_eq!(g["creator"]["port"].as_u64(), Some(4400 + 2 * i as u64));
        assert_eq!(g["members"][0]["port"].as_u64(), Some(4401 + 2 * i as u64));
        assert_eq!(g["members"][0]["addr"].as_str(), Some("127.0.0.1"));
        assert_eq!(
            (g["sends"].as_u64(), g["deliveries"].as_u64()),
            (Some(2), Some(2))
        );
        assert_eq!(g["full"].as_bool(), Some(false));
    }
    // The counters are summed over the poll threads.
    assert_eq!(d.stat("group_sends"), 4);
    assert_eq!(d.stat("groups_created"), 2);
}

/// The counter `k` of row `thread` of `rdsctl threads --json`.
fn thread_counter(doc: &Value, thread: usize, k: &str) -> u64 {
    doc["threads"][thread]["counters"][k].as_u64().unwrap_or(0)
}

#[test]
fn threads_show_what_each_poll_thread_serves_and_moves() {
    let (d, apps) = two_threads_an_app_each();
    let (a, b) = (apps[0].socket().unwrap(), apps[1].socket().unwrap());
    let a2 = apps[0].socket().unwrap();
    a.bind(lo(4500)).unwrap();
    b.bind(lo(4501)).unwrap();
    a2.bind(lo(4502)).unwrap();
    // 100 messages from thread 0 to thread 1, 30 back, 50 within thread 0.
    let mut buf = [0u8; 16];
    for (from, to, to_addr, n) in [
        (&a, &b, lo(4501), 100),
        (&b, &a, lo(4500), 30),
        (&a, &a2, lo(4502), 50),
    ] {
        for _ in 0..n {
            from.send_to(b"m", to_addr).unwrap();
            to.recv_from(&mut buf).unwrap();
        }
    }
    // A poll thread publishes its pass counters every 256 passes and when it parks.
    let mut doc = Value::Null;
    wait_for(
        || {
            doc = rdsctl(&d.socket, &["--json", "threads", "-i", "0"])
                .ok()
                .json();
            thread_counter(&doc, 0, "shard_records_out") == 100
                && thread_counter(&doc, 1, "shard_records_in") == 100
                && thread_counter(&doc, 1, "shard_records_out") == 30
                && thread_counter(&doc, 0, "shard_records_in") == 30
                && (0..2).all(|k| thread_counter(&doc, k, "poll_busy_passes") > 0)
        },
        Duration::from_secs(10),
        "the crossings counted on each poll thread",
    );
    let rows = doc["threads"].as_array().expect("threads");
    assert_eq!(rows.len(), 2, "{doc}");
    for (k, (apps, socks)) in [(1, 2), (1, 1)].into_iter().enumerate() {
        assert_eq!(rows[k]["thread"].as_u64(), Some(k as u64));
        assert_eq!(rows[k]["apps"].as_u64(), Some(apps), "{doc}");
        assert_eq!(rows[k]["sockets"].as_u64(), Some(socks), "{doc}");
        let busy = rows[k]["busy_percent"].as_f64().expect("busy_percent");
        assert!(busy > 0.0 && busy <= 100.0, "{doc}");
        assert!(
            thread_counter(&doc, k, "poll_passes") >= thread_counter(&doc, k, "poll_busy_passes")
        );
    }
    // The thread rows add up to the daemon's counters.
    for name in ["shard_records_out", "loop_delivered", "poll_passes"] {
        let sum = thread_counter(&doc, 0, name) + thread_counter(&doc, 1, name);
        assert!(
            sum <= d.stat(name),
            "{name}: threads {sum}, rdsd {}",
            d.stat(name)
        );
    }
    assert_eq!(d.stat("shard_records_out"), 130);
    // Text: rates over an interval, and totals in `info -T`.
    let text = rdsctl(&d.socket, &["threads", "-i", "0.2"]).ok().stdout;
    assert!(
        text.starts_with("RDS poll threads (per second, over 0.20 s):"),
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .count(),
        2,
        "{text}"
    );
    let text = rdsctl(&d.socket, &["info", "-T"]).ok().stdout;
    assert!(
        text.contains("RDS poll threads (totals since rdsd started):"),
        "{text}"
    );
    assert!(text.contains("crossout"), "{text}");
    assert!(text.contains("allocs") && text.contains("locks"), "{text}");
    // One poll thread: one row, nothing crosses.
    let one = Daemon::start(&["--poll-core", "-2"]);
    let app = one.attach();
    let (x, y) = (app.socket().unwrap(), app.socket().unwrap());
    x.bind(lo(4503)).unwrap();
    y.bind(lo(4504)).unwrap();
    x.send_to(b"m", lo(4504)).unwrap();
    y.recv_from(&mut buf).unwrap();
    let doc = rdsctl(&one.socket, &["--json", "threads", "-i", "0"])
        .ok()
        .json();
    assert_eq!(doc["threads"].as_array().map(Vec::len), Some(1), "{doc}");
    assert_eq!(doc["threads"][0]["sockets"].as_u64(), Some(2), "{doc}");
    assert_eq!(thread_counter(&doc, 0, "shard_records_out"), 0);
}

#[test]
fn ping_a_local_address_is_answered_by_loopback() {
    let d = Daemon::start(&[]);
    let o = rdsctl(&d.socket, &["ping", "127.0.0.1", "-c", "3", "-i", "0.05"]).ok();
    assert!(
        o.stdout.starts_with("RDS ping 127.0.0.1 from 127.0.0.1:"),
        "{}",
        o.stdout
    );
    let replies = ping_replies(&o.stdout);
    assert_eq!(
        replies.iter().map(|r| r.0).collect::<Vec<_>>(),
        [1, 2, 3],
        "{}",
        o.stdout
    );
    assert!(replies.iter().all(|r| r.1 < 1_000_000), "{replies:?}");
    assert!(
        o.stdout.contains("3 sent, 3 received, 0% loss"),
        "{}",
        o.stdout
    );
    assert_eq!(d.stat("loop_pings"), 3);
    // Another local address answers from itself; JSON.
    let j = rdsctl(
        &d.socket,
        &["--json", "ping", "127.0.0.2", "-c", "2", "-i", "0.01"],
    )
    .ok()
    .json();
    assert_eq!(j["target"].as_str(), Some("127.0.0.2"));
    assert_eq!(j["source"].as_str(), Some("127.0.0.2"));
    assert_eq!(
        (j["sent"].as_u64(), j["received"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(j["replies"].as_array().unwrap().len(), 2);
    assert!(j["rtt_us"]["max"].as_u64().unwrap() < 1_000_000);
    assert_eq!(d.stat("loop_pings"), 5);
    // A destination nobody answers: no route from a loopback-only rdsd. Non-zero status.
    let t = Instant::now();
    let o = rdsctl(
        &d.socket,
        &["ping", "10.255.255.1", "-c", "2", "-i", "0.05", "-W", "0.2"],
    );
    assert_eq!(o.code, 1, "{} {}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains("no reply from 10.255.255.1"),
        "{}",
        o.stderr
    );
    assert!(ping_replies(&o.stdout).is_empty());
    assert!(
        o.stdout.contains("2 sent, 0 received, 100% loss"),
        "{}",
        o.stdout
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let j = rdsctl(
        &d.socket,
        &["--json", "ping", "10.255.255.1", "-c", "1", "-W", "0.1"],
    );
    assert_eq!(j.code, 1);
    assert_eq!(j.json()["received"].as_u64(), Some(0));
    // A source rdsd does not own.
    let o = rdsctl(
        &d.socket,
        &["ping", "127.0.0.1", "-c", "1", "-I", "10.9.9.9"],
    );
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("bind 10.9.9.9"), "{}", o.stderr);
}

#[test]
fn ping_and_info_between_two_rdsd() {
    require!(root(), AS_ROOT);
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let (a0, a1) = (h0.addr.to_string(), h1.addr.to_string());
    // Default source: rdsd's first local address (the host's).
    let o = rdsctl(
        &h0.d().socket,
        &["ping", &a1, "-c", "3", "-i", "0.1", "-W", "5"],
    )
    .ok();
    assert!(
        o.stdout.starts_with(&format!("RDS ping {a1} from {a0}:")),
        "{}",
        o.stdout
    );
    assert_eq!(ping_replies(&o.stdout).len(), 3, "{}", o.stdout);
    wait_until(
        Duration::from_secs(10),
        "the peer's engine to count the pings (exact: summed lazily)",
        || h1.d().exact_stat("tcp_pings_received"),
        |&n| n >= 3,
    );
    // And back, with -I.
    let j = rdsctl(
        &h1.d().socket,
        &[
            "--json", "ping", &a0, "-c", "2", "-i", "0.05", "-W", "5", "-I", &a1,
        ],
    )
    .ok()
    .json();
    assert_eq!(j["received"].as_u64(), Some(2), "{j}");
    assert_eq!(j["source"].as_str(), Some(a1.as_str()));

    let doc = rdsctl(&h0.d().socket, &["--json", "info", "-n", "-p"])
        .ok()
        .json();
    assert!(doc.get("sockets").is_none() && doc.get("counters").is_none());
    assert_eq!(
        doc["rdsd"]["transports"],
        serde_json::json!(["loopback", "tcp"])
    );
    let conns = doc["connections"].as_array().unwrap();
    let c = conns
        .iter()
        .find(|c| c["faddr"].as_str() == Some(&a1))
        .unwrap_or_else(|| panic!("no connection to {a1}: {doc}"));
    assert_eq!(c["laddr"].as_str(), Some(a0.as_str()));
    assert_eq!(c["transport"].as_str(), Some("tcp"));
    assert_eq!(c["state"].as_str(), Some("up"));
    assert_eq!(
        c["active"],
        Value::Bool(true),
        "the smaller address connects"
    );
    assert_eq!(c["npaths"].as_u64(), Some(8));
    assert_ne!(c["generation"].as_u64(), Some(0));
    assert_ne!(c["peer_generation"].as_u64(), Some(0));
    let paths = c["paths"].as_array().unwrap();
    assert!(
        paths.iter().any(|p| p["index"] == 0 && p["state"] == "up"),
        "{c}"
    );
    let sent: u64 = paths
        .iter()
        .map(|p| p["next_tx_seq"].as_u64().unwrap().saturating_sub(1))
        .sum();
    assert!(sent >= 3, "three pings were numbered: {c}");
    assert!(paths
        .iter()
        .all(|p| p["unacked_bytes"].is_u64() || p["state"] != "up"));
    // The peer's side of the same connection: passive, with the pongs numbered.
    let doc1 = rdsctl(&h1.d().socket, &["--json", "info", "-n", "-p"])
        .ok()
        .json();
    let c1 = doc1["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["faddr"].as_str() == Some(&a0))
        .expect("connection on the peer")
        .clone();
    assert_eq!(c1["active"], Value::Bool(false));
    assert_eq!(c1["peer_generation"], c["generation"]);
    // -n without -p leaves the paths out; the text tables carry the same rows.
    let doc = rdsctl(&h0.d().socket, &["--json", "info", "-n"])
        .ok()
        .json();
    assert!(doc["connections"][0].get("paths").is_none());
    let text = rdsctl(&h0.d().socket, &["info", "-n", "-p"]).ok().stdout;
    assert!(
        text.lines().any(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.len() == 9 && w[..5] == [a0.as_str(), a1.as_str(), "tcp", "up", "yes"]
        }),
        "{text}"
    );
    assert!(
        text.lines().any(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // The last column: the path's TCP ports, ours (path 0: a multiple of 8, SPORT_IDX)
            // to the peer's rds_tcp port.
            let ports = w.last().and_then(|p| p.split_once('>'));
            w.len() == 11
                && w[..4] == [a0.as_str(), a1.as_str(), "0", "up"]
                && ports.is_some_and(|(l, r)| {
                    l.parse::<u16>().is_ok_and(|l| l % 8 == 0) && r == "16385"
                })
        }),
        "{text}"
    );
    // -m: the message listings (nothing queued now: the headers only), not in the default.
    let text = rdsctl(&h0.d().socket, &["info", "-m"]).ok().stdout;
    assert!(text.starts_with("RDS messages:\n"), "{text}");
    let all = rdsctl(&h0.d().socket, &["info"]).ok().stdout;
    assert!(!all.contains("RDS messages:"), "{all}");
}

#[test]
fn bad_flags_are_usage_errors() {
    let sock = Path::new("/nonexistent/rdsd.sock");
    for args in [
        &["info", "-x"][..],
        &["ping"],
        &["ping", "not-an-address"],
        &["ping", "127.0.0.1", "-c", "0"],
        &["ping", "127.0.0.1", "-i", "soon"],
        &["stats", "--prom"],
        &["frobnicate"],
    ] {
        let o = rdsctl(sock, args);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(o.stderr.starts_with("error:"), "{args:?}: {}", o.stderr);
        assert!(o.stdout.is_empty());
    }
    let o = rdsctl(sock, &["--json", "ping", "127.0.0.1"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(o.stderr.contains("give -c COUNT"), "{}", o.stderr);
    let o = run({
        let mut c = Command::new(rdsctl_bin());
        c.arg("--help");
        c
    });
    assert_eq!(o.code, 0);
    for sub in ["status", "stats", "info", "ping"] {
        assert!(o.stdout.contains(sub), "{}", o.stdout);
    }
    assert!(o.stdout.contains("Exit status"));
}

#[test]
fn a_missing_rdsd_is_reported_clearly() {
    let dir = std::env::temp_dir().join(format!("rdsctl-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("rdsd.sock");
    for args in [
        &["status"][..],
        &["stats"],
        &["info"],
        &["ping", "127.0.0.1"],
    ] {
        let o = rdsctl(&sock, args);
        assert_eq!(o.code, 3, "{args:?}: {}", o.stderr);
        assert!(
            o.stderr
                .contains("rdsd is not running: no control socket at")
                && o.stderr.contains(sock.to_str().unwrap()),
            "{}",
            o.stderr
        );
    }
    let j = rdsctl(&sock, &["--json", "info"]);
    assert_eq!(j.code, 3);
    assert_eq!(j.json()["kind"].as_str(), Some("not_running"));
    // A stale socket: the file is there, nobody listens.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let o = rdsctl(&sock, &["status"]);
    assert_eq!(o.code, 3, "{}", o.stderr);
    assert!(o.stderr.contains("stale"), "{}", o.stderr);
    // $RDSD_SOCKET is the default.
    let o = run({
        let mut c = Command::new(rdsctl_bin());
        c.arg("status").env("RDSD_SOCKET", dir.join("other.sock"));
        c
    });
    assert_eq!(o.code, 3);
    assert!(o.stderr.contains("other.sock"), "{}", o.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_socket_we_may_not_use_is_permission_denied() {
    require!(root(), AS_ROOT);
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = std::env::temp_dir().join(format!("rdsctl-perm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let sock = dir.join("rdsd.sock");
    let mut child = Command::new(rdsd_bin())
        .arg("--control-socket")
        .arg(&sock)
        .args(["--poll-core", "-2", "--control-core", "-2", "--log", "warn"])
        .spawn()
        .unwrap();
    wait_for(
        || rdsctl(&sock, &["status"]).code == 0,
        Duration::from_secs(20),
        "rdsd",
    );
    // The binary must be reachable by nobody (a private target dir would make this test lie).
    let bin = rdsctl_bin();
    let o = run({
        let mut c = Command::new(&bin);
        c.arg("-s").arg(&sock).arg("status").uid(65534).gid(65534);
        c
    });
    let o2 = run({
        let mut c = Command::new(&bin);
        c.arg("-s")
            .arg(&sock)
            .args(["--json", "ping", "127.0.0.1", "-c", "1"])
            .uid(65534)
            .gid(65534);
        c
    });
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(o.code, 4, "{} {}", o.stdout, o.stderr);
    assert!(
        o.stderr
            .contains("permission denied on rdsd's control socket"),
        "{}",
        o.stderr
    );
    assert_eq!(o2.code, 4, "{}", o2.stderr);
    assert_eq!(o2.json()["kind"].as_str(), Some("permission_denied"));
}

/// A Python 3 that can `import prometheus_client`, installed once if missing (apt
/// python3-prometheus-client, else pip). Panics loudly if neither works.
fn python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let has = |py: &str| {
            Command::new(py)
                .args(["-c", "import prometheus_client.parser"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let find = || {
            ["/usr/bin/python3", "python3"]
                .into_iter()
                .find(|p| has(p))
                .map(PathBuf::from)
        };
        if let Some(p) = find() {
            return p;
        }
        eprintln!("installing python3-prometheus-client (apt) for the Prometheus parser");
        let _ = Command::new("apt-get")
            .args(["install", "-y", "-qq", "python3-prometheus-client"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status();
        if let Some(p) = find() {
            return p;
        }
        let _ = Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--break-system-packages",
                "prometheus_client",
            ])
            .status();
        find().expect(
            "NO PROMETHEUS PARSER: neither apt's python3-prometheus-client nor pip's \
             prometheus_client could be installed; the Prometheus text cannot be checked",
        )
    })
}

/// Parses exposition text with prometheus_client; returns (sample name -> value, family name
/// -> type), or the parser's error.
type Json = serde_json::Map<String, Value>;

fn prometheus_parse(text: &str) -> Result<(Json, Json), String> {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
samples, types = {}, {}
for f in text_string_to_metric_families(sys.stdin.read()):
    types[f.name] = f.type
    for s in f.samples:
        key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
        samples[key] = s.value
print(json.dumps({"samples": samples, "types": types}))
"#;
    let mut c = Command::new(python())
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python");
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let v: Value = serde_json::from_slice(&o.stdout).expect("parser output");
    Ok((
        v["samples"].as_object().unwrap().clone(),
        v["types"].as_object().unwrap().clone(),
    ))
}

/// Checks a parsed exposition against the `name value` counters.
fn check_exposition(text: &str, plain: &str) {
    let (samples, types) = prometheus_parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let mut n = 0;
    for l in plain.lines() {
        let (k, _) = l.split_once(' ').unwrap();
        let m = format!("rdsd_{k}_total");
        assert!(samples.contains_key(&m), "no {m} in the parsed text");
        // The family of a counter is named without `_total`.
        assert_eq!(types[&format!("rdsd_{k}")].as_str(), Some("counter"), "{k}");
        n += 1;
    }
    assert!(n >= 40);
    assert_eq!(samples["rdsd_up"].as_f64(), Some(1.0));
    assert_eq!(types["rdsd_up"].as_str(), Some("gauge"));
    let version = format!(
        "rdsd_build_info{{\"version\": \"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(samples[&version].as_f64(), Some(1.0), "{samples:?}");
    assert!(samples["rdsd_start_time_seconds"].as_f64().unwrap() > 1.6e9);
    // Each poll thread's series of the few counters kept per thread.
    let threads = poll_threads();
    for (name, _) in shm_api::ctrl::THREAD_METRICS {
        let m = format!("rdsd_thread_{name}_total");
        assert_eq!(
            types[&format!("rdsd_thread_{name}")].as_str(),
            Some("counter"),
            "{name}"
        );
        for k in 0..threads {
            let key = format!("{m}{{\"thread\": \"{k}\"}}");
            assert!(samples.contains_key(&key), "no {key} in the parsed text");
        }
        assert!(!samples.contains_key(&format!("{m}{{\"thread\": \"{threads}\"}}")));
    }
    // Every line is a HELP, a TYPE, or a sample; every counter has both.
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("# HELP rdsd_"))
            .count(),
        n + 3 + shm_api::ctrl::THREAD_METRICS.len()
    );
}

#[test]
fn prometheus_text_parses_with_a_real_parser() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    let s = r.socket().unwrap();
    s.bind(lo(4200)).unwrap();
    s.send_to(b"x", lo(4200)).unwrap();
    let mut buf = [0u8; 8];
    s.recv(&mut buf).unwrap();
    let text = rdsctl(&d.socket, &["stats", "--prometheus"]).ok().stdout;
    let plain = rdsctl(&d.socket, &["stats"]).ok().stdout;
    check_exposition(&text, &plain);
    let (samples, _) = prometheus_parse(&text).unwrap();
    assert_eq!(samples["rdsd_loop_delivered_total"].as_f64(), Some(1.0));
    assert_eq!(samples["rdsd_sockets_opened_total"].as_f64(), Some(1.0));
    assert!(text.contains(
        "# HELP rdsd_loop_delivered_total Messages delivered by the loopback transport.\n\
         # TYPE rdsd_loop_delivered_total counter\n"
    ));
    // The parser is real: it rejects a broken exposition.
    assert!(prometheus_parse("rdsd_x_total{version=\"1} 1\n").is_err());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(addr: &str, path: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    s
}

#[test]
fn metrics_endpoint_serves_the_counters_over_http() {
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start(&["--metrics-listen", &addr]);
    let r = d.attach();
    let s = r.socket().unwrap();
    s.bind(lo(4300)).unwrap();
    let resp = http_get(&addr, "/metrics");
    let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP head");
    assert!(head.starts_with("HTTP/1.0 200 OK\r\n"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .expect("length")
        .parse()
        .unwrap();
    assert_eq!(len, body.len());
    check_exposition(body, &rdsctl(&d.socket, &["stats"]).ok().stdout);
    let (samples, _) = prometheus_parse(body).unwrap();
    assert_eq!(samples["rdsd_sockets_opened_total"].as_f64(), Some(1.0));
    assert_eq!(
        samples["rdsd_apps_attached_total"].as_f64(),
        Some(2.0),
        "Daemon::start's readiness probe, and this test"
    );
    assert!(http_get(&addr, "/other").starts_with("HTTP/1.0 404"));
    // rdsctl tells where the metrics are.
    let st = rdsctl(&d.socket, &["status"]).ok().stdout;
    assert!(
        st.contains(&format!("metrics at http://{addr}/metrics")),
        "{st}"
    );
    // Off by default: another rdsd serves nothing there once this one is gone.
    drop(s);
    drop(r);
    drop(d);
    let d2 = Daemon::start(&[]);
    assert!(std::net::TcpStream::connect(&addr).is_err());
    let j = rdsctl(&d2.socket, &["--json", "status"]).ok().json();
    assert_eq!(j["rdsd"]["metrics_listen"], Value::Null);
    // A metrics address that can't be bound stops rdsd at start, with the reason.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    let busy_sock = std::env::temp_dir().join(format!("rdsctl-busy-{}.sock", std::process::id()));
    let o = Command::new(rdsd_bin())
        .arg("--control-socket")
        .arg(&busy_sock)
        .args(["--poll-core", "-2", "--control-core", "-2"])
        .args(["--metrics-listen", &busy_addr])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&busy_sock);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("metrics_listen"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn rdsd_tells_systemd_it_is_ready_and_stopping() {
    use std::os::unix::net::UnixDatagram;
    let path = std::env::temp_dir().join(format!("rdsd-notify-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let rx = UnixDatagram::bind(&path).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let d = Daemon::start_env(&[("NOTIFY_SOCKET", path.to_str().unwrap())], &[]);
    let mut buf = [0u8; 512];
    // A signal to this test process (another test's child exiting) may interrupt the wait.
    let recv = |buf: &mut [u8]| loop {
        match rx.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => break r,
        }
    };
    let n = recv(&mut buf).expect("a notification");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    let lines: Vec<&str> = msg.lines().collect();
    assert_eq!(lines[0], "READY=1", "{msg}");
    assert!(
        lines.contains(&format!("MAINPID={}", d.pid()).as_str()),
        "{msg}"
    );
    d.signal(libc::SIGTERM);
    let n = recv(&mut buf).expect("a second notification");
    assert_eq!(&buf[..n], b"STOPPING=1");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn systemd_unit_verifies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dist = root.join("dataplane/dist");
    let unit = std::fs::read_to_string(dist.join("rdsd.service")).unwrap();
    // What the issue asks of the unit, checked whatever systemd-analyze can do here.
    for line in [
        "Type=notify",
        "Restart=on-failure",
        "Requires=hugepage-setup.service",
        "After=hugepage-setup.service network-online.target",
        "ExecStart=/usr/local/bin/rdsd --config /etc/rdsd/rdsd.toml",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "rdsd.service lacks {line:?}"
        );
    }
    let hp = std::fs::read_to_string(dist.join("hugepage-setup.service")).unwrap();
    assert!(hp.contains("Type=oneshot") && hp.contains("RemainAfterExit=yes"));
    let Ok(v) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!(
            "\n!!!!! systemd-analyze IS NOT INSTALLED: rdsd.service was NOT verified by systemd \
             (apt-get install systemd); only its required lines were checked !!!!!\n"
        );
        return;
    };
    eprintln!(
        "{}",
        String::from_utf8_lossy(&v.stdout)
            .lines()
            .next()
            .unwrap_or("")
    );
    // A private root: the system's own unit files, ours under /etc/systemd/system, and the
    // binaries where ExecStart names them, so `verify` checks everything, executables too.
    let tmp = std::env::temp_dir().join(format!("rdsd-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let etc = tmp.join("etc/systemd/system");
    let bin = tmp.join("usr/local/bin");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(tmp.join("usr/lib/systemd")).unwrap();
    let cp = Command::new("cp")
        .args(["-r", "/usr/lib/systemd/system"])
        .arg(tmp.join("usr/lib/systemd/"))
        .status()
        .unwrap();
    assert!(cp.success());
    for u in ["rdsd.service", "hugepage-setup.service"] {
        std::fs::copy(dist.join(u), etc.join(u)).unwrap();
    }
    let verify = |what: &str| {
        let o = Command::new("systemd-analyze")
            .arg("verify")
            .arg(format!("--root={}", tmp.display()))
            .arg(what)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // Without the binaries, verify must fail: the check is real.
    let (ok, err) = verify("/etc/systemd/system/rdsd.service");
    assert!(!ok && err.contains("/usr/local/bin/rdsd"), "{err}");
    std::fs::copy(rdsd_bin(), bin.join("rdsd")).unwrap();
    std::fs::copy(bin_dir().join("hugepage-setup"), bin.join("hugepage-setup")).unwrap();
    for u in ["rdsd.service", "hugepage-setup.service"] {
        let (ok, err) = verify(&format!("/etc/systemd/system/{u}"));
        assert!(ok, "systemd-analyze verify {u}:\n{err}");
        let ours: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("rdsd") || l.contains("hugepage"))
            .collect();
        assert!(ours.is_empty(), "warnings about {u}:\n{err}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn print_default_config_is_the_documented_default() {
    let o = Command::new(rdsd_bin())
        .arg("--print-default-config")
        .output()
        .unwrap();
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    for key in [
        "control_socket = \"/run/rdsd/rdsd.sock\"",
        "local_addrs = [\"127.0.0.0/8\"]",
        "metrics_listen = \"\"",
    ] {
        assert!(text.lines().any(|l| l == key), "no {key:?} in:\n{text}");
    }
    // Documented: a comment precedes every key.
    let lines: Vec<&str> = text.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        if !l.starts_with('#') && l.contains(" = ") {
            let prev = lines[..i].iter().rev().find(|p| !p.is_empty());
            assert!(
                prev.is_some_and(|p| p.starts_with('#') || p.contains(" = ")),
                "undocumented key {l:?}"
            );
        }
    }
    // The printed default is a valid config file.
    let f = config_file(&text);
    let d = Daemon::start(&["-c", f.to_str().unwrap()]);
    let j = rdsctl(&d.socket, &["--json", "status"]).ok().json();
    assert_eq!(j["rdsd"]["local_addrs"], serde_json::json!(["127.0.0.0/8"]));
    let _ = std::fs::remove_file(f);
}

#[test]
fn info_waits_for_a_stalled_poll_core_but_counters_do_not() {
    // TEST hook: the poll core sleeps 1.5 s (longer than hello_timeout_ms, which an rdsctl
    // connection waiting for a snapshot must not trip) on a SetRcvBuf of TEST_STALL_RCVBUF.
    // One poll thread whatever RDSD_TESTS_POLL_THREADS says: the stall is observed on
    // rdsd-poll-0, and with two the app may sit on the other one.
    let d = Daemon::start_with_faults(&[("stall-poll-ms", "1500")], &["--poll-core", "-2"]);
    let r = d.attach();
    let s = r.socket().unwrap();
    s.bind(lo(4400)).unwrap();
    let staller = std::thread::spawn(move || {
        s.set_recv_buffer_size(shm_api::ctrl::TEST_STALL_RCVBUF as usize)
            .unwrap();
        s
    });
    wait_for(
        || d.poll_core_stalled(),
        Duration::from_secs(10),
        "the poll core to stall",
    );
    let c = rdsctl(&d.socket, &["--json", "info", "-c"]).ok().json();
    assert!(
        d.poll_core_stalled() && !staller.is_finished(),
        "counters need no snapshot: they came back while the poll core was stalled"
    );
    assert!(c.get("counters").is_some() && c.get("sockets").is_none());
    let k = rdsctl(&d.socket, &["--json", "info", "-k"]).ok().json();
    assert!(
        !d.poll_core_stalled(),
        "the snapshot waited for the poll core"
    );
    let socks = k["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 1);
    assert_eq!(
        socks[0]["rcvbuf"].as_u64(),
        Some(shm_api::ctrl::TEST_STALL_RCVBUF as u64),
        "taken after the stalled command"
    );
    drop(staller.join().unwrap());
    assert_eq!(d.stat("hello_timeouts"), 0);
}

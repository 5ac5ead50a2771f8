//! What a round trip costs the poll core on the kernel-TCP transport, counted, never timed:
//! an idle path must cost nothing, so 8 paths cost what 1 path costs.
//!
//! Two rdsd in network namespaces; one socket on each side plays ping-pong (64 B), which uses
//! one path whatever the path count. Counted per round trip on each daemon: path reads
//! (`tcp_path_reads`, a `recv` each), path visits (`tcp_path_visits`) and acknowledgement queries (`tcp_ack_queries`, a
//! `SIOCOUTQ` ioctl each), and with `strace -c` on the active side's poll thread the
//! `recvfrom` and `ioctl` calls themselves. Before readiness came from epoll, 8 paths cost a
//! `recv` per path per pass: at least 16 reads per round trip per daemon.
//!
//! And what an open socket that sends nothing costs a pass: no look into its tx ring.

use rdsd_tests::netns::Lab;
use rdsd_tests::*;
use std::net::SocketAddrV4;
use std::time::Duration;

const ROUND_TRIPS: u64 = 1000;
const WARM_UP: u64 = 50;

/// Counters of both daemons, exact ([`Daemon::exact_stats`]: the transport sums them lazily).
/// The reads cost each poll core a pass or two, without a path visit: nothing next to the
/// 1000 round trips counted.
fn counters(lab: &Lab) -> [[u64; 4]; 2] {
    let read = |i: usize| {
        let s = lab.hosts[i].d().exact_stats();
        [
            stat_from(&s, "tcp_passes"),
            stat_from(&s, "tcp_path_reads"),
            stat_from(&s, "tcp_ack_queries"),
            stat_from(&s, "tcp_path_visits"),
        ]
    };
    [read(0), read(1)]
}

/// Per round trip and daemon: (passes, path reads, ack queries, path visits); plus the active poll
/// thread's (recvfrom, ioctl) per round trip when strace is there.
struct Cost {
    per_rt: [[f64; 4]; 2],
    syscalls: Option<(f64, f64)>,
}

/// Two hosts with rdsd started with `args`, and a ping-pong between `ports` on them, warmed up.
fn warm_ping_pong(args: &[&str], ports: (u16, u16)) -> (Lab, PingPong) {
    let lab = Lab::new(2, 2, args);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let (a0, a1): (SocketAddrV4, SocketAddrV4) = (
        h0.at(ports.0).parse().unwrap(),
        h1.at(ports.1).parse().unwrap(),
    );
    let total = WARM_UP + ROUND_TRIPS;
    let mut pp = PingPong::start(h0.d(), a0, h1.d(), a1, total, Duration::from_secs(10));
    for seq in 0..WARM_UP {
        pp.round_trip(seq);
    }
    (lab, pp)
}

fn ping_pong(paths: &str) -> Cost {
    let (lab, mut pp) = warm_ping_pong(&["--paths", paths], (7300, 7300));
    let h0 = &lab.hosts[0];
    let want: u64 = paths.parse().unwrap();
    assert_eq!(h0.d().stat("tcp_path_up"), want, "{want} paths up");
    let strace = PollThreadSyscalls::attach(h0.d());
    let before = counters(&lab);
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    let after = counters(&lab);
    let syscalls = strace.map(|st| {
        let (text, m) = st.finish();
        let per = |k: &str| m.get(k).copied().unwrap_or(0) as f64 / ROUND_TRIPS as f64;
        eprintln!("{paths} paths, active poll thread:\n{text}");
        (per("recvfrom"), per("ioctl"))
    });
    pp.finish();
    let mut per_rt = [[0.0; 4]; 2];
    for d in 0..2 {
        for k in 0..4 {
            per_rt[d][k] = (after[d][k] - before[d][k]) as f64 / ROUND_TRIPS as f64;
        }
    }
    eprintln!(
        "{paths} paths, per round trip [passes, path reads, ack queries, path visits]: active {:?}, passive {:?}; strace (recvfrom, ioctl): {syscalls:?}",
        per_rt[0], per_rt[1]
    );
    Cost { per_rt, syscalls }
}

#[test]
fn an_idle_path_costs_no_syscall() {
    let one = ping_pong("1");
    let eight = ping_pong("8");
    for (d, side) in ["active", "passive"].iter().enumerate() {
        let (r1, r8) = (one.per_rt[d][1], eight.per_rt[d][1]);
        let (q1, q8) = (one.per_rt[d][2], eight.per_rt[d][2]);
        // One message in per round trip: read once (a short read empties the socket), more
        // when a message arrives in two segments or an event only says the send queue emptied.
        assert!(r1 <= 3.0, "{side}, 1 path: {r1} path reads per round trip");
        assert!(
            r8 <= r1 + 1.0 && r8 <= 3.0,
            "{side}, 8 paths: {r8} path reads per round trip (1 path: {r1}): an idle path is read again"
        );
        // One query after each input; the backoff adds about log2(RTT / 100 µs) more while a
        // reply is late. Queried every pass, it would be one per pass.
        assert!(q1 <= 8.0, "{side}, 1 path: {q1} ack queries per round trip");
        assert!(
            q8 <= 8.0,
            "{side}, 8 paths: {q8} ack queries per round trip"
        );
        // A pass visits a path only for work: the read, the write, the ack queries. Visiting
        // every path every pass would be 8 per pass.
        let (v1, v8) = (one.per_rt[d][3], eight.per_rt[d][3]);
        assert!(
            v1 <= 12.0,
            "{side}, 1 path: {v1} path visits per round trip"
        );
        assert!(
            v8 <= v1 + 3.0 && v8 <= 12.0,
            "{side}, 8 paths: {v8} path visits per round trip (1 path: {v1}): idle paths are visited"
        );
    }
    if let (Some((rv1, io1)), Some((rv8, io8))) = (one.syscalls, eight.syscalls) {
        assert!(rv1 <= 3.0, "1 path: {rv1} recvfrom per round trip");
        assert!(
            rv8 <= rv1 + 1.0 && rv8 <= 3.0,
            "8 paths: {rv8} recvfrom per round trip (1 path: {rv1})"
        );
        assert!(
            io1 <= 8.0 && io8 <= 8.0,
            "ioctl per round trip: {io1}, {io8}"
        );
    }
}

/// Kernel TCP segments each namespace sent per round trip of a 64 B ping-pong between
/// different ports on two hosts with 8 paths (`path_choice` as given, or rdsd's default).
fn segments_per_round_trip(path_choice: Option<&str>) -> [f64; 2] {
    let mut args = vec!["--paths", "8"];
    if let Some(choice) = path_choice {
        args.extend(["--path-choice", choice]);
    }
    let (lab, mut pp) = warm_ping_pong(&args, (7301, 7302));
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let out = || [h0.kernel_tcp_stat("OutSegs"), h1.kernel_tcp_stat("OutSegs")];
    let before = out();
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    let after = out();
    pp.finish();
    let per = [0, 1].map(|i| (after[i] - before[i]) as f64 / ROUND_TRIPS as f64);
    let name = path_choice.unwrap_or("default");
    eprintln!("path_choice {name}: TCP segments sent per round trip {per:?}");
    per
}

/// With several paths a reply should go back on its request's TCP connection, so each segment
/// acknowledges the other direction's: one segment per message, as with 1 path. rdsd's
/// default path choice (by the pair of ports) does so. By the sender's port (Linux's choice,
/// `--path-choice source-port`) the reply of port 7302 takes another path than the request
/// of port 7301, and each message then draws a pure ACK segment of its own.
#[test]
fn a_reply_on_its_requests_path_costs_no_ack_segment() {
    let by_port = segments_per_round_trip(Some("source-port"));
    let by_default = segments_per_round_trip(None);
    for (i, side) in ["active", "passive"].iter().enumerate() {
        assert!(
            by_default[i] <= 1.1,
            "{side}, default path choice: {} segments per round trip (1 with 1 path)",
            by_default[i]
        );
        // By source port these two ports take different paths: up to a pure ACK per message
        // (2.0 in most runs; fewer when the kernel delays and merges ACKs, so not a bound).
        assert!(
            by_port[i] + 0.05 >= by_default[i],
            "{side}: {} segments by source port, {} by default (port pair)",
            by_port[i],
            by_default[i]
        );
    }
}

/// An idle pass asks no path whether it is ready: a path found not ready is not asked again
/// until an `epoll_wait` marks a path ready (`Link::ready_epoch`), so with 8 paths up and no
/// traffic a pass costs what it costs with one (`tcp_path_checks`; before, every path was
/// asked every pass).
#[test]
fn an_idle_pass_asks_no_path() {
    let (lab, mut pp) = warm_ping_pong(&["--paths", "8"], (7302, 7302));
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    pp.finish();
    wait_until(
        Duration::from_secs(30),
        "8 paths up on the connecting daemon",
        || lab.hosts[0].d().stat("tcp_path_up"),
        |&up| up >= 8,
    );
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    assert_idle_passes_ask_no_path([h0.d(), h1.d()], "tcp", 8);
}

/// With several poll threads, an idle pass takes nothing from the others: it checks each
/// other thread's note queue and pair ring with a few loads and never calls `drain_fabric`
/// (`fabric_drains`; before, every pass of every thread did, about 270 instructions per other
/// thread, `bench/shards-idle-callgrind.sh`). A message that crosses is taken by a drain.
#[test]
fn an_idle_pass_with_four_poll_threads_drains_no_other_thread() {
    let d = Daemon::start(&[
        "--poll-core",
        "-2",
        "--poll-core",
        "-2",
        "--poll-core",
        "-2",
        "--poll-core",
        "-2",
    ]);
    let read = || {
        let s = d.exact_stats();
        (stat_from(&s, "poll_passes"), stat_from(&s, "fabric_drains"))
    };
    let (p0, f0) = read();
    std::thread::sleep(Duration::from_millis(300));
    let (p1, f1) = read();
    eprintln!(
        "4 idle poll threads: {} drains in {} passes",
        f1 - f0,
        p1 - p0
    );
    assert!(p1 > p0, "the stats reads cost passes");
    assert_eq!(f1, f0, "drains in {} idle passes", p1 - p0);

    // Two apps (each on the thread with the fewest apps: different threads): a message
    // between them crosses, and its release comes back.
    let mut recv = d.app(&["recv", "127.0.0.1:7310", "1"]);
    recv.expect("bound");
    let mut sender = d.app(&["send", "127.0.0.1:7311", "127.0.0.1:7310", "1", "64"]);
    sender.expect("sent 1");
    recv.expect("received");
    let (p2, f2) = read();
    eprintln!(
        "one crossing message: {} drains in {} passes",
        f2 - f1,
        p2 - p1
    );
    assert!(
        (1..=4).contains(&(f2 - f1)),
        "{} drains for one message in {} passes",
        f2 - f1,
        p2 - p1
    );
}

/// An app holding 64 sockets open and idle: a pass looks into none of their tx rings
/// (`tx_ring_visits`), it only compares each ring's producer position with the one it last saw
/// (`SocketTable::next_published`). Before, every pass called `drain_tx` for every open socket:
/// 64 visits a pass. Then one message from one of them: one visit.
#[test]
fn an_idle_socket_costs_a_pass_no_ring_visit() {
    let d = Daemon::start(&["--max-sockets-per-app", "64"]);
    let mut holder = d.app(&["hold", "127.0.0.1:7300", "64"]);
    holder.expect("bound");
    let read = || {
        let s = d.exact_stats();
        (
            stat_from(&s, "poll_passes"),
            stat_from(&s, "tx_ring_visits"),
        )
    };
    let (p0, v0) = read();
    std::thread::sleep(Duration::from_millis(300));
    let (p1, v1) = read();
    eprintln!(
        "64 idle sockets: {} ring visits in {} passes",
        v1 - v0,
        p1 - p0
    );
    assert!(p1 > p0, "the stats reads cost a pass");
    assert_eq!(v1, v0, "ring visits in {} idle passes", p1 - p0);

    // One message from another app's socket to one of the held ones: its ring is visited,
    // the 64 idle ones still are not.
    let mut sender = d.app(&["send", "127.0.0.1:7400", "127.0.0.1:7300", "1", "64"]);
    sender.expect("sent 1");
    // "sent" means on the sender's ring: the counters may be read in the pass before the one
    // that takes it (a pass answers commands before it looks at the rings).
    let (p2, v2) = rdsd_tests::wait_until(
        Duration::from_secs(10),
        "the sender's ring visited",
        read,
        |&(_, v)| v > v1,
    );
    eprintln!("one message: {} ring visits in {} passes", v2 - v1, p2 - p1);
    assert!(
        (1..=2).contains(&(v2 - v1)),
        "{} ring visits for one message in {} passes",
        v2 - v1,
        p2 - p1
    );
}

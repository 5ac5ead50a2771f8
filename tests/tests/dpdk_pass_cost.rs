//! What a round trip costs the poll core on the userspace-TCP (smoltcp over DPDK) transport,
//! counted, never timed: an idle path must cost nothing, so 8 paths cost what 1 path costs.
//! The DPDK counterpart of `pass_cost.rs`.
//!
//! Two rdsd in network namespaces on `net_memif` ports (one the memif server, one the client;
//! the frames go through memif's shared memory). One socket on each side plays ping-pong
//! (64 B), which uses one path whatever the path count. Counted per round trip on each daemon
//! from its exact counters: passes, path visits (`dpdk_path_visits`), acknowledgement queries
//! (`dpdk_ack_queries`), frames sent (`dpdk_tx_packets`), transmit bursts (`dpdk_tx_bursts`),
//! smoltcp egress runs (`dpdk_egress_runs`), the sockets they dispatched
//! (`dpdk_egress_sockets`), those they examined to find them (`dpdk_egress_examined`) and the
//! sockets the ingress asked to take a segment (`dpdk_ingress_examined`). An
//! idle path that is visited, that sends a frame, or whose socket smoltcp's egress looks at,
//! each pass shows up as at least one more per pass with 8 paths (with 8 paths rdsd keeps 16
//! listening sockets and 8 path sockets; unpatched smoltcp dispatched all 24 in every egress
//! run, and the first patch still examined all 24 to skip the idle ones).
//!
//! Needs root (namespaces) and DPDK's memif PMD (`librte-net-memif23`, pulled in by
//! `libdpdk-dev`, which `tests/run.sh` installs through `dataplane/install-build-deps.sh`).

use rdsd_tests::netns::VethPair;
use rdsd_tests::*;
use std::net::SocketAddrV4;
use std::time::Duration;

const ROUND_TRIPS: u64 = 1000;
const WARM_UP: u64 = 50;

const DPDK_INSTALL: &str =
    "run as root with DPDK 22.11 installed: sudo -E bash tests/run.sh (dataplane/install-build-deps.sh)";

const NAMES: [&str; 9] = [
    "dpdk_passes",
    "dpdk_path_visits",
    "dpdk_ack_queries",
    "dpdk_tx_packets",
    "dpdk_tx_bursts",
    "dpdk_egress_runs",
    "dpdk_egress_sockets",
    "dpdk_egress_examined",
    "dpdk_ingress_examined",
];

/// Counters of both daemons, exact ([`Daemon::exact_stats`]). The reads cost each poll core a
/// pass or two without a path visit: nothing next to the round trips counted.
fn counters(d: [&Daemon; 2]) -> [[u64; 9]; 2] {
    d.map(|d| {
        let s = d.exact_stats();
        NAMES.map(|n| stat_from(&s, n))
    })
}

/// Per round trip and daemon, in the order of [`NAMES`], with more `[dpdk]` lines and rdsd
/// flags for both daemons.
fn ping_pong_with(paths: u8, dpdk_lines: &str, extra: &[&str]) -> [[f64; 9]; 2] {
    let pair = VethPair::new();
    // One memif socket per run: the tests run in parallel.
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let sock = std::env::temp_dir().join(format!(
        "rdsd-memif-cost-{}-{paths}-{run}.sock",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&sock);
    let d0 = pair.memif_daemon_with(0, &sock, paths, dpdk_lines, extra);
    let d1 = pair.memif_daemon_with(1, &sock, paths, dpdk_lines, extra);
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7400),
        SocketAddrV4::new(pair.addr(1), 7400),
    );
    let total = WARM_UP + ROUND_TRIPS;
    let mut pp = PingPong::start(&d0, a0, &d1, a1, total, Duration::from_secs(20));
    for seq in 0..WARM_UP {
        pp.round_trip(seq);
    }
    // Every path up before counting: connecting paths are not idle ones.
    let want = u64::from(paths);
    wait_until(
        Duration::from_secs(30),
        "every path up on the connecting daemon",
        || d0.stat("dpdk_path_up"),
        |&up| up >= want,
    );
    let before = counters([&d0, &d1]);
    for seq in WARM_UP..WARM_UP + ROUND_TRIPS {
        pp.round_trip(seq);
    }
    let after = counters([&d0, &d1]);
    pp.finish();
    let mut per_rt = [[0.0; 9]; 2];
    for d in 0..2 {
        for k in 0..9 {
            per_rt[d][k] = (after[d][k] - before[d][k]) as f64 / ROUND_TRIPS as f64;
        }
    }
    eprintln!(
        "memif, {paths} path(s), per round trip {NAMES:?}: active {:?}, passive {:?}",
        per_rt[0], per_rt[1]
    );
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
    per_rt
}

/// [`ping_pong_with`], whose failure (printed above) also names the install step: a missing DPDK or
/// memif PMD shows up as an rdsd that does not start.
fn run(paths: u8) -> [[f64; 9]; 2] {
    run_with(paths, "", &[])
}

fn run_with(paths: u8, dpdk_lines: &str, extra: &[&str]) -> [[f64; 9]; 2] {
    std::panic::catch_unwind(|| ping_pong_with(paths, dpdk_lines, extra)).unwrap_or_else(|_| {
        panic!("the {paths}-path run failed (above); if rdsd's DPDK port did not start: {DPDK_INSTALL}")
    })
}

/// With a delayed-ACK timer (200 µs by default) the request's ACK rides on the reply: one
/// frame per message instead of two (the data and a pure ACK, `ack_delay_us = 0`). 8 paths,
/// chosen by the port pair so that the reply takes the request's path (both sockets use port
/// 7400 here, so by source port it would too). The timer is long for the test (2 ms): a debug
/// rdsd on a loaded 2-CPU machine must still answer within it.
#[test]
fn a_delayed_ack_rides_on_the_reply() {
    require!(root(), DPDK_INSTALL);
    let at_once = run_with(8, "ack_delay_us = 0", &[]);
    let delayed = run_with(8, "ack_delay_us = 2000", &["--path-choice", "port-pair"]);
    for (d, side) in ["active", "passive"].iter().enumerate() {
        let (f0, f1) = (at_once[d][3], delayed[d][3]);
        assert!(
            f1 <= 1.5,
            "{side}: {f1} frames sent per round trip with a delayed ACK"
        );
        assert!(
            f1 < f0,
            "{side}: {f1} frames with a delayed ACK, {f0} without"
        );
        // And one socket dispatched per round trip, for the write: the request in (its ACK
        // delayed) is recorded by smoltcp's ingress and the read of it opens no window, so
        // neither makes the socket due (vendored smoltcp, PATCHES.md items 7 and 8; 2.0
        // before them).
        let s1 = delayed[d][6];
        assert!(
            s1 <= 1.5,
            "{side}: {s1} sockets dispatched per round trip with a delayed ACK"
        );
        // Its acknowledgements are asked for once, after the reply (which carries them) came
        // in: a segment sent acknowledges nothing, so the write's dispatch does not bring the
        // path back for them (smoltcp patch item 9, `take_fed`; 2.0 queries and 3.0 path
        // visits per round trip before it).
        let (q1, v1) = (delayed[d][2], delayed[d][1]);
        assert!(
            q1 <= 1.5 && v1 <= 2.5,
            "{side}: {q1} ack queries, {v1} path visits per round trip with a delayed ACK"
        );
    }
}

#[test]
fn an_idle_dpdk_path_costs_nothing() {
    require!(root(), DPDK_INSTALL);
    let one = run(1);
    let eight = run(8);
    for (d, side) in ["active", "passive"].iter().enumerate() {
        let [p1, v1, q1, f1, b1, _e1, s1, x1, i1] = one[d];
        let [p8, v8, q8, f8, b8, e8, s8, x8, i8] = eight[d];
        // A pass visits a path only for work (input, a receiver to resume, frames to send,
        // acknowledgements to ask for): the one busy path at most once a pass, plus the odd
        // path whose timer or ACK falls due. How many passes a round trip takes depends on the
        // load, so the bound is per pass; visiting every path every pass would be 8 per pass.
        assert!(
            v1 <= p1 + 4.0,
            "{side}, 1 path: {v1} path visits per round trip in {p1} passes"
        );
        assert!(
            v8 <= p8 + 4.0,
            "{side}, 8 paths: {v8} path visits per round trip in {p8} passes: idle paths are visited"
        );
        assert!(
            q1 <= p1 + 4.0 && q8 <= p8 + 4.0,
            "{side}: ack queries per round trip {q1} in {p1} passes, {q8} in {p8} passes"
        );
        // Acknowledgements are read only after a segment came in for the path's socket: about
        // 1 per round trip (the reply carries the request's ACK), 2 when the delayed-ACK timer
        // beats the reply, however many passes wait for it (every pass with a message
        // unacknowledged before).
        assert!(
            q1 <= 3.0 && q8 <= 3.0,
            "{side}: ack queries per round trip {q1} (1 path, {p1} passes), {q8} (8 paths, {p8} passes)"
        );
        assert!(
            v1 <= 5.0 && v8 <= 5.0,
            "{side}: path visits per round trip {v1} (1 path, {p1} passes), {v8} (8 paths, {p8} passes)"
        );
        // One request or reply out per round trip and the ACK of the peer's; an idle path sends
        // nothing (smoltcp keep-alive is off, and its timers fire only for unacked data).
        assert!(f1 <= 4.0, "{side}, 1 path: {f1} frames sent per round trip");
        assert!(
            f8 <= f1 + 1.0 && f8 <= 4.0,
            "{side}, 8 paths: {f8} frames sent per round trip (1 path: {f1}): idle paths send"
        );
        assert!(
            b8 <= b1 + 1.0 && b8 <= 4.0,
            "{side}, 8 paths: {b8} transmit bursts per round trip (1 path: {b1})"
        );
        // smoltcp's egress dispatches the busy path's socket (its write, the peer's segment
        // to acknowledge), not the idle paths' nor the listeners: about as many sockets per
        // round trip with 8 paths as with 1, and about one per egress run.
        assert!(
            s8 <= s1 + 1.0,
            "{side}, 8 paths: {s8} sockets dispatched per round trip (1 path: {s1}): idle \
             sockets are walked"
        );
        assert!(
            s8 <= e8 * 1.5 + 0.5,
            "{side}, 8 paths: {s8} sockets dispatched per round trip in {e8} egress runs"
        );
        // Nor does the egress walk the idle sockets to skip them: it examines the due ones
        // and, when its time comes, the busy socket's timer; all 24 only after a neighbour was
        // learned.
        assert!(
            x8 <= x1 + 1.0,
            "{side}, 8 paths: {x8} sockets examined per round trip (1 path: {x1}): idle \
             sockets are walked"
        );
        // And a segment in goes to its socket by its port pair, not through the 16 listeners
        // made before it (vendored smoltcp, PATCHES.md item 6): one socket asked per segment.
        assert!(
            i8 <= i1 + 0.5 && i8 <= f8 + 1.0,
            "{side}, 8 paths: the ingress asked {i8} sockets per round trip (1 path: {i1}; \
             {f8} frames sent, as many received)"
        );
    }
}

/// Frames sent by `d0` and received by `d1` per 64 KiB message from `a0` to `a1`, 200
/// messages one way after one to warm up; each arrives intact.
fn frames_per_64k(d0: &Daemon, d1: &Daemon, a0: SocketAddrV4, a1: SocketAddrV4) -> (f64, f64) {
    const MESSAGES: u64 = 200;
    let (r0, r1) = (d0.attach(), d1.attach());
    let (s0, s1) = (r0.socket().unwrap(), r1.socket().unwrap());
    s0.bind(a0).unwrap();
    s1.bind(a1).unwrap();
    s1.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    let msg: Vec<u8> = (0..65536u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut buf = vec![0u8; 65536];
    // Warm up: the connection up, and one message through.
    s0.send_to(&msg, a1).unwrap();
    assert_eq!(s1.recv_from(&mut buf).unwrap(), (65536, a0));
    let before = (d0.exact_stats(), d1.exact_stats());
    for _ in 0..MESSAGES {
        s0.send_to(&msg, a1).unwrap();
        let (n, from) = s1.recv_from(&mut buf).unwrap();
        assert_eq!((n, from), (65536, a0));
        assert!(buf == msg, "the message arrived intact");
    }
    let after = (d0.exact_stats(), d1.exact_stats());
    let per = |a: &str, b: &str, name: &str| {
        (stat_from(a, name) - stat_from(b, name)) as f64 / MESSAGES as f64
    };
    (
        per(&after.0, &before.0, "dpdk_tx_packets"),
        per(&after.1, &before.1, "dpdk_rx_packets"),
    )
}

/// A 64 KiB message crosses memif in jumbo frames: rdsd sizes memif's buffers and its mbufs for
/// `dpdk.mtu` (9000) itself, past the 1518 bytes DPDK 22.11's memif driver reports to ethdev.
/// 65 584 bytes (header and payload) in segments of up to 8 960: 8 frames, against 45 with
/// standard frames. Counted on the sender (`dpdk_tx_packets`, its data frames and the odd
/// ACK) and the receiver (`dpdk_rx_packets`).
#[test]
fn a_64k_message_crosses_memif_in_jumbo_frames() {
    require!(root(), DPDK_INSTALL);
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-jumbo-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let d0 = pair.memif_daemon_with(0, &sock, 1, "", &[]);
    let d1 = pair.memif_daemon_with(1, &sock, 1, "", &[]);
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7401),
        SocketAddrV4::new(pair.addr(1), 7401),
    );
    let (sent, received) = frames_per_64k(&d0, &d1, a0, a1);
    eprintln!("64 KiB over memif: {sent} frames sent, {received} received per message");
    assert!(
        sent <= 12.0 && received <= 12.0,
        "{sent} frames sent and {received} received per 64 KiB message: not jumbo frames \
         (45 or more with 1500-byte frames)"
    );
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
}

/// The same over `net_af_packet` on a veth pair whose MTU is 9000: rdsd sizes the packet
/// rings' frames (`framesz`) and the mbufs for `dpdk.mtu` and takes the interface's MTU,
/// past the 1518 bytes DPDK 22.11's af_packet driver reports. On a 1500-byte veth the same
/// daemons stay at standard frames (the interface's MTU bounds rdsd's).
#[test]
fn a_64k_message_crosses_af_packet_in_jumbo_frames_on_a_jumbo_veth() {
    require!(root(), DPDK_INSTALL);
    for (mtu, most, least) in [(9000u16, 12.0, 0.0), (1500, 60.0, 44.0)] {
        let pair = VethPair::new();
        pair.set_mtu(mtu);
        let d0 = pair.af_packet_daemon_with(0, 1, "", &[]);
        let d1 = pair.af_packet_daemon_with(1, 1, "", &[]);
        let (a0, a1) = (
            SocketAddrV4::new(pair.addr(0), 7405),
            SocketAddrV4::new(pair.addr(1), 7405),
        );
        let (sent, received) = frames_per_64k(&d0, &d1, a0, a1);
        eprintln!(
            "64 KiB over af_packet, veth MTU {mtu}: {sent} frames sent, {received} received per \
             message"
        );
        assert!(
            (least..=most).contains(&sent) && (least..=most).contains(&received),
            "veth MTU {mtu}: {sent} frames sent and {received} received per 64 KiB message \
             (expected {least}..={most})"
        );
    }
}

/// A sender whose send buffer is at least half used flags its messages
/// `RDS_FLAG_ACK_REQUIRED` (the kernel's rule), and the receiving rdsd acknowledges them at
/// once instead of waiting for its delayed-ACK timer (4 ms here): the sender gets its bytes
/// back without waiting. Counted on the receiver (`dpdk_acks_forced`: reads that took a
/// flagged message, each followed by an immediate ACK): a sender with a 4 KiB send buffer
/// streaming 1 KiB messages flags most of them; one message in flight at a time with the
/// default send buffer (104 KiB) flags none.
#[test]
fn a_sender_short_of_send_buffer_is_acknowledged_at_once() {
    require!(root(), DPDK_INSTALL);
    const MESSAGES: u64 = 300;
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-ackreq-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let lines = "ack_delay_us = 4000";
    let d0 = pair.memif_daemon_with(0, &sock, 1, lines, &[]);
    let d1 = pair.memif_daemon_with(1, &sock, 1, lines, &[]);
    let (r0, r1) = (d0.attach(), d1.attach());
    let a1 = SocketAddrV4::new(pair.addr(1), 7402);
    let s1 = r1.socket().unwrap();
    s1.bind(a1).unwrap();
    s1.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    // Room for the whole stream: the receiver reads only after the last send.
    s1.set_recv_buffer_size(4 << 20).unwrap();
    let msg = vec![0x5a_u8; 1024];
    let mut buf = vec![0u8; 2048];
    // `lockstep`: each message waits for the previous one to arrive (one in flight).
    let mut stream = |port: u16, sndbuf: Option<usize>, lockstep: bool| -> f64 {
        let s0 = r0.socket().unwrap();
        s0.bind(SocketAddrV4::new(pair.addr(0), port)).unwrap();
        if let Some(b) = sndbuf {
            s0.set_send_buffer_size(b).unwrap();
        }
        s0.set_send_timeout(Some(Duration::from_secs(20))).unwrap();
        // Warm up: the path up, one message through.
        s0.send_to(&msg, a1).unwrap();
        assert_eq!(s1.recv_from(&mut buf).unwrap().0, 1024);
        let before = d1.exact_stats();
        for _ in 0..MESSAGES {
            s0.send_to(&msg, a1).unwrap();
            if lockstep {
                assert_eq!(s1.recv_from(&mut buf).unwrap().0, 1024);
            }
        }
        for _ in 0..if lockstep { 0 } else { MESSAGES } {
            assert_eq!(s1.recv_from(&mut buf).unwrap().0, 1024);
        }
        let forced = stat_from(&d1.exact_stats(), "dpdk_acks_forced")
            - stat_from(&before, "dpdk_acks_forced");
        forced as f64 / MESSAGES as f64
    };
    let small = stream(7403, Some(4096), false);
    let one_at_a_time = stream(7404, None, true);
    eprintln!(
        "acks forced per message: send buffer 4 KiB {small}, one in flight with the default \
         send buffer {one_at_a_time}"
    );
    // A read takes several flagged messages at once, each read forces one ACK.
    assert!(
        small >= 0.1,
        "{small} forced ACKs per message from a sender with a 4 KiB send buffer"
    );
    assert_eq!(
        one_at_a_time, 0.0,
        "one 1 KiB message in flight never uses half of the default send buffer"
    );
    drop((s1, r0, r1, d0, d1));
    let _ = std::fs::remove_file(&sock);
}

/// An idle pass asks no path whether it is ready: a path the link found not ready is not
/// asked again until the link's readiness epoch moves (smoltcp touched a socket), so with 8
/// paths up and no traffic a pass costs what it costs with none (`dpdk_path_checks`; before,
/// every path's socket was asked every pass: 8 per pass here).
#[test]
fn an_idle_pass_asks_no_path() {
    require!(root(), DPDK_INSTALL);
    let paths = 8;
    let pair = VethPair::new();
    let sock = std::env::temp_dir().join(format!("rdsd-memif-idle-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let d0 = pair.memif_daemon_with(0, &sock, paths, "", &[]);
    let d1 = pair.memif_daemon_with(1, &sock, paths, "", &[]);
    let (a0, a1) = (
        SocketAddrV4::new(pair.addr(0), 7400),
        SocketAddrV4::new(pair.addr(1), 7400),
    );
    let mut pp = PingPong::start(&d0, a0, &d1, a1, WARM_UP, Duration::from_secs(20));
    for seq in 0..WARM_UP {
        pp.round_trip(seq);
    }
    pp.finish();
    wait_until(
        Duration::from_secs(30),
        "every path up on the connecting daemon",
        || d0.stat("dpdk_path_up"),
        |&up| up >= u64::from(paths),
    );
    assert_idle_passes_ask_no_path([&d0, &d1], "dpdk", paths);
    drop((d0, d1));
    let _ = std::fs::remove_file(&sock);
}

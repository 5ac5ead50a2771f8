//! Delivery guarantees under pressure, between two "hosts" in network namespaces (RDS over
//! kernel TCP): a receiver whose rx ring fills, 1 MiB messages to a slow reader, a receiving
//! rdsd restarted again and again mid-stream (also right after its ACKs were lost), and
//! congestion-map traffic per connection.
//! Every test is bounded in time: a hang fails it instead of blocking the suite.

use rdsd_tests::netns::{self, Lab};
use rdsd_tests::*;
use shm_api::Socket;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// Counter `name`, or `None` if this rdsd has no such counter (for diagnostics only: the set
/// of counters is changing).
fn stat_opt(d: &Daemon, name: &str) -> Option<u64> {
    let s = d.attach().stats().expect("stats");
    s.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// `name=value` for each counter that exists, for the test log.
fn show(d: &Daemon, names: &[&str]) -> String {
    names
        .iter()
        .map(|n| match stat_opt(d, n) {
            Some(v) => format!("{n}={v}"),
            None => format!("{n}=(none)"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Host 1's `cong_marked`, `cong_cleared`, `tcp_cong_maps_sent`, `tcp_path_down` once its
/// congestion traffic to host 0 is over: every mark is cleared, every map host 1 sent has
/// reached host 0 (`tcp_cong_maps_received`), and no map is pending. Each read is exact
/// ([`Daemon::exact_stats`]); two reads always have a whole poll-core pass between them, and a
/// pending map goes out in the first pass after the change, so two equal reads that meet the
/// conditions leave no map unsent.
fn congestion_quiet(h1: &Daemon, h0: &Daemon) -> Vec<u64> {
    let read = || {
        let s = h1.exact_stats();
        let ours: Vec<u64> = [
            "cong_marked",
            "cong_cleared",
            "tcp_cong_maps_sent",
            "tcp_path_down",
        ]
        .iter()
        .map(|n| stat_from(&s, n))
        .collect();
        (ours, h0.exact_stat("tcp_cong_maps_received"))
    };
    let mut last = read();
    let (_, (ours, _)) = wait_until(
        Duration::from_secs(20),
        "host 1's congestion maps to settle: (previous, latest) reads of ([marked, cleared, \
         maps sent, path downs], host 0's maps received)",
        || {
            let now = read();
            (std::mem::replace(&mut last, now.clone()), now)
        },
        |(prev, now)| {
            let (ours, received) = now;
            prev == now && ours[0] == ours[1] && ours[2] == *received
        },
    );
    ours
}

/// The numbers of a recv-resilient-count report,
/// "got G gaps N missing M dups D reorders R restarts K last L timeout T", by name.
fn fields(done: &str) -> std::collections::HashMap<&str, i64> {
    done.split_whitespace()
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|kv| (kv[0], kv[1].parse().expect("number")))
        .collect()
}

/// What a receiver saw of one sender's sequence 0, 1, 2, ...
#[derive(Default)]
struct Tally {
    got: u64,
    gaps: u64,
    missing: u64,
    dups: u64,
    reorders: u64,
    corrupt: u64,
    last: Option<u64>,
    seen: std::collections::HashSet<u64>,
    notes: Vec<String>,
}

impl Tally {
    fn note(&mut self, s: String) {
        if self.notes.len() < 10 {
            self.notes.push(s);
        }
    }

    fn add(&mut self, seq: u64) {
        self.got += 1;
        match self.last {
            Some(p) if seq <= p => {
                if self.seen.contains(&seq) {
                    self.dups += 1;
                    self.note(format!("duplicate {seq} after {p}"));
                } else {
                    self.reorders += 1;
                    self.note(format!("reordered {seq} after {p}"));
                }
            }
            _ => {
                let expect = self.last.map_or(0, |p| p + 1);
                if seq != expect {
                    self.gaps += 1;
                    self.missing += seq - expect;
                    self.note(format!("gap: {seq} after {:?}", self.last));
                }
                self.last = Some(seq);
            }
        }
        self.seen.insert(seq);
    }

    fn summary(&self) -> String {
        format!(
            "got {} gaps {} missing {} dups {} reorders {} corrupt {} last {:?}; {:?}",
            self.got,
            self.gaps,
            self.missing,
            self.dups,
            self.reorders,
            self.corrupt,
            self.last,
            self.notes
        )
    }

    fn exactly_once_in_order(&self, count: u64) -> bool {
        self.got == count
            && self.gaps == 0
            && self.dups == 0
            && self.reorders == 0
            && self.corrupt == 0
            && self.last == Some(count - 1)
    }
}

/// Receives from `s` until sequence `last` arrives or nothing comes for `idle`; `pause` before
/// each receive (a slow reader). Each payload must be `seq_payload(seq, len)` exactly when
/// `len` is given.
fn drain(s: &Socket, last: u64, idle: Duration, pause: Duration, len: Option<usize>) -> Tally {
    s.set_recv_timeout(Some(idle)).unwrap();
    let mut buf = vec![0u8; (1 << 20) + 1];
    let mut t = Tally::default();
    loop {
        if !pause.is_zero() {
            // A slow reader (load, not synchronisation).
            std::thread::sleep(pause);
        }
        let n = match s.recv_from(&mut buf) {
            Ok((n, _)) => n,
            Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => {
                t.note(format!("nothing for {idle:?} after {:?}", t.last));
                return t;
            }
            Err(e) => panic!("recv: {e}"),
        };
        if n < 8 {
            t.corrupt += 1;
            t.note(format!("{n}-byte message"));
            continue;
        }
        let seq = payload_seq(&buf[..n]);
        if let Some(len) = len {
            if n != len || buf[..n] != seq_payload(seq, len)[..] {
                t.corrupt += 1;
                t.note(format!("message {seq}: {n} bytes, content differs"));
            }
        }
        t.add(seq);
        if seq >= last {
            return t;
        }
    }
}

/// rdsd flags for two poll threads with apps placed by `placement` ("app" or "socket"),
/// whatever `RDSD_TESTS_POLL_THREADS` and `RDSD_TESTS_PLACEMENT` say.
fn two_poll_threads(placement: &str) -> [&str; 6] {
    [
        "--poll-core",
        "-2",
        "--poll-core",
        "-2",
        "--placement",
        placement,
    ]
}

/// `rds-testapp send-bounded` on `from`: `count` messages of `len` bytes from its port `sport`
/// to `dst`, with SO_SNDBUF `sndbuf`, failing past `timeout_ms`; returned once it is sending.
fn start_sender(
    from: &netns::Host,
    sport: u16,
    dst: &str,
    count: u64,
    len: usize,
    sndbuf: usize,
    timeout_ms: u32,
) -> App {
    let mut app = from.d().app(&[
        "send-bounded",
        &from.at(sport),
        dst,
        &count.to_string(),
        &len.to_string(),
        &sndbuf.to_string(),
        &timeout_ms.to_string(),
    ]);
    app.expect_within("sending", Duration::from_secs(10));
    app
}

/// The receiver's rx ring (2 MiB) fills while its SO_RCVBUF (64 MiB) never congests the port:
/// rdsd must stop reading that path (TCP then pushes back on the sender) rather than drop
/// messages TCP already acknowledged. (With several poll threads, when the connection is
/// another thread's than the receiver's, the overflow waits in the receiver's backlog in rdsd
/// instead, `poll/backlog.rs`, and the path may never pause: either way nothing is lost.)
#[test]
fn full_receiver_ring_loses_nothing() {
    const COUNT: u64 = 3000;
    const LEN: usize = 4096;
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r = h1.d().attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(64 << 20).unwrap();
    rcv.bind(addr(&h1.at(9500))).unwrap();
    // 12 MiB of messages, 6 times what the ring holds; SO_SNDBUF is not the limit.
    let mut snd = start_sender(h0, 9501, &h1.at(9500), COUNT, LEN, 16 << 20, 30_000);
    // The receiver reads nothing until its full ring paused the path (or overflowed into
    // its backlog).
    let held = || h1.d().exact_stat("rx_paused") + h1.d().exact_stat("rx_backlogged");
    wait_until(
        Duration::from_secs(30),
        "host 1 to pause the path to the full ring",
        held,
        |&n| n >= 1,
    );
    eprintln!(
        "before draining: host 1 {}",
        show(
            h1.d(),
            &[
                "tcp_delivered",
                "drop_rx_ring_full",
                "rx_ring_full",
                "rx_paused",
                "rx_backlogged"
            ]
        )
    );
    let t = drain(
        &rcv,
        COUNT - 1,
        Duration::from_secs(5),
        Duration::ZERO,
        Some(LEN),
    );
    eprintln!("drained: {}", t.summary());
    let counters = [
        "tcp_delivered",
        "rx_ring_full",
        "rx_paused",
        "rx_resumed",
        "tcp_path_down",
        "tcp_path_errors",
        "tcp_retransmits",
        "tcp_drop_dup_seq",
        "tcp_drop_bad_header",
        "tcp_drop_unknown",
    ];
    eprintln!("host 1 {}", show(h1.d(), &counters));
    eprintln!("host 0 {}", show(h0.d(), &counters));
    assert!(
        t.exactly_once_in_order(COUNT),
        "every message exactly once, in order: {}",
        t.summary()
    );
    let sent = snd.expect_within("sent", Duration::from_secs(15));
    assert!(sent.starts_with(&COUNT.to_string()), "{sent}");
    assert!(
        held() >= 1,
        "the full ring paused the path (or filled a backlog)"
    );
}

/// 40 messages of the largest size (1 MiB) to a receiver that reads one every 50 ms.
#[test]
fn one_mib_messages_to_a_slow_receiver() {
    const COUNT: u64 = 40;
    const LEN: usize = 1 << 20;
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r = h1.d().attach();
    let rcv = r.socket().unwrap(); // default SO_RCVBUF
    rcv.bind(addr(&h1.at(9510))).unwrap();
    let mut snd = start_sender(h0, 9511, &h1.at(9510), COUNT, LEN, 4 << 20, 30_000);
    let start = Instant::now();
    let t = drain(
        &rcv,
        COUNT - 1,
        Duration::from_secs(8),
        Duration::from_millis(50),
        Some(LEN),
    );
    eprintln!("after {:?}: {}", start.elapsed(), t.summary());
    eprintln!(
        "host 1 {}",
        show(
            h1.d(),
            &[
                "tcp_delivered",
                "drop_rx_ring_full",
                "rx_ring_full",
                "rx_paused",
                "cong_marked",
                "tcp_drop_oversize",
                "tcp_path_down"
            ]
        )
    );
    assert!(
        t.exactly_once_in_order(COUNT),
        "every 1 MiB message exactly once, in order, intact: {}",
        t.summary()
    );
    let sent = snd.expect_within("sent", Duration::from_secs(15));
    assert!(sent.starts_with(&COUNT.to_string()), "{sent}");
}

/// The receiving host's rdsd is SIGKILLed and restarted five times while host 0 streams small
/// messages fast. The re-attached app may miss messages (at most one gap per restart), but
/// must never see one twice or out of order, though the sender resends (RETRANSMITTED) what
/// it had not seen acknowledged when the connection dropped.
///
/// The window for such a duplicate is small (the killed rdsd read a segment whose delayed ACK
/// had not left yet, and unread data made the close a reset). Measured: about 1 duplicate in
/// 50 kills on an idle 2-core machine (the test then mostly passes), 1 in 5 while another build
/// loads it (mostly fails). `receiver_restart_after_lost_acks_no_duplicates` widens the window
/// and fails every time.
#[test]
fn receiver_restart_loop_no_duplicates() {
    restart_stream(60_000, 5, 9520, false, None);
}

/// Streams `count` messages from host 0 to host 1 while host 1's rdsd is SIGKILLed and
/// restarted `restarts` times; with `lose_acks_first`, host 1's TCP acknowledgements are lost
/// before each kill (until host 0 resends for want of them) and the killed rdsd's sockets are
/// destroyed (`ss -K`), so the sender resends what host 1 had delivered. The first kill comes at
/// 1/(restarts+2) of the stream; each later one at the next such fraction, or, with
/// `kill_after: Some(n)`, as soon as the restarted rdsd delivered `n` messages (while the
/// sender may still be resending what the previous incarnations delivered). Asserts
/// exactly-once in order, one gap per restart.
fn restart_stream(
    count: u64,
    restarts: u64,
    port: u16,
    lose_acks_first: bool,
    kill_after: Option<u64>,
) {
    let mut lab = Lab::new(2, 2, &[]);
    if lose_acks_first {
        // The namespace's first nftables table takes long to load: load one before the stream,
        // so that the ACKs are lost mid-stream.
        lose_acks(&lab.hosts[1], true);
        lose_acks(&lab.hosts[1], false);
    }
    let (a0, a1) = (lab.hosts[0].at(port + 1), lab.hosts[1].at(port));
    let mut r = lab.hosts[1].d().app(&[
        "recv-resilient-count",
        &a1,
        &(count - 1).to_string(),
        "8000",
    ]);
    r.expect_within("bound", Duration::from_secs(10));
    let mut s = lab.hosts[0]
        .d()
        .app(&["send-resilient", &a0, &a1, &count.to_string(), "20"]);
    s.expect_within("sending", Duration::from_secs(10));
    let start = Instant::now();
    let (mut restored, mut dups_dropped) = (0, 0);
    let mut this_incarnation = |d: &Daemon| {
        // Exact: the duplicate count is summed lazily.
        let counters = d.exact_stats();
        restored += stat_from(&counters, "tcp_rx_state_restored");
        dups_dropped += stat_from(&counters, "tcp_drop_dup_seq");
    };
    // Delivered by the incarnations killed so far.
    let mut earlier = 0;
    for k in 0..restarts {
        // The kills are spread over the stream by what host 1 delivered (kill k+1 at
        // (k+1)/(restarts+2) of it), so each comes mid-stream however fast the stream runs.
        let milestone = (k + 1) * count / (restarts + 2);
        match kill_after {
            Some(n) if k > 0 => wait_delivered(lab.hosts[1].d(), n),
            _ => wait_delivered(lab.hosts[1].d(), milestone.saturating_sub(earlier)),
        }
        if lose_acks_first {
            // The stream pauses while `nft` runs (slow on a loaded machine): the loss must
            // start mid-stream.
            s.signal(libc::SIGSTOP);
        }
        if k > 0 {
            this_incarnation(lab.hosts[1].d());
        }
        if lose_acks_first {
            // Host 1 goes on reading and delivering while its ACKs are lost, until host 0's
            // TCP, acknowledged nothing, times out and sends again: by then host 1 delivered
            // all that host 0 could send unacknowledged.
            let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
            let resent = h0.kernel_tcp_stat("RetransSegs");
            lose_acks(h1, true);
            s.signal(libc::SIGCONT);
            let base = h1.d().stat("tcp_delivered");
            wait_until(
                Duration::from_secs(10),
                "host 0's TCP to resend for want of ACKs (RetransSegs)",
                || h0.kernel_tcp_stat("RetransSegs"),
                |&n| n > resent,
            );
            eprintln!(
                "ACKs lost: host 1 delivered {} meanwhile",
                h1.d().stat("tcp_delivered") - base,
            );
        }
        let delivered = lab.hosts[1].d().stat("tcp_delivered");
        let downs = lab.hosts[0].d().stat("tcp_path_down");
        lab.hosts[1].daemon.as_mut().unwrap().kill();
        earlier += delivered;
        if lose_acks_first {
            lab.hosts[1].exec(&["ss", "-K", "-t", "-n", "sport = :16385"]);
            lose_acks(&lab.hosts[1], false);
        } else {
            // The killed rdsd's sockets closed: host 0 sees its paths go down.
            wait_until(
                Duration::from_secs(10),
                "host 0 to see the killed receiver's paths go down",
                || lab.hosts[0].d().stat("tcp_path_down"),
                |&n| n > downs,
            );
        }
        lab.hosts[1].daemon.as_mut().unwrap().spawn();
        eprintln!(
            "kill {} at {:?}: the killed rdsd had delivered {delivered}",
            k + 1,
            start.elapsed()
        );
        // The sender reconnects within its backoff (up to 1 s on a loaded machine): the new
        // incarnation must have restored the state before it is killed in turn.
        wait_for(
            || lab.hosts[1].d().stat("tcp_rx_state_restored") >= 1,
            Duration::from_secs(10),
            "the restarted receiver's connection",
        );
    }
    let mut anomalies = Vec::new();
    let done = loop {
        let l = r.expect_within("", Duration::from_secs(30));
        if let Some(rest) = l.strip_prefix("done") {
            break rest.trim().to_string();
        }
        if l.starts_with("anomaly") {
            anomalies.push(l);
        }
    };
    this_incarnation(lab.hosts[1].d());
    eprintln!("receiver after {:?}: {done}", start.elapsed());
    for a in &anomalies {
        eprintln!("  {a}");
    }
    eprintln!(
        "host 0 {}; host 1: receive state restored {restored} times, {dups_dropped} resends dropped",
        show(
            lab.hosts[0].d(),
            &[
                "tcp_retransmits",
                "tcp_peer_restarts",
                "tcp_path_down",
                "tcp_path_mismaps"
            ]
        )
    );
    let f = fields(&done);
    assert_eq!(f["timeout"], 0, "the stream reached its end: {done}");
    assert_eq!(f["last"], count as i64 - 1, "{done}");
    // Under load an app can sleep through two kills and re-attach once.
    assert!(
        (1..=restarts as i64).contains(&f["restarts"]),
        "the receiver re-attached after the restarts: {done}"
    );
    assert_eq!(f["dups"], 0, "no message delivered twice: {done}");
    assert_eq!(f["reorders"], 0, "no message out of order: {done}");
    assert!(
        f["gaps"] <= restarts as i64,
        "at most one gap per restart: {done}"
    );
    assert_eq!(
        restored, restarts,
        "every restart restored the receive state"
    );
    if lose_acks_first {
        assert!(
            dups_dropped > 0,
            "the sender's resends were dropped as duplicates"
        );
    }
    let sent = s.expect_within("sent", Duration::from_secs(20));
    assert!(sent.starts_with(&count.to_string()), "{sent}");
}

/// With 8 paths to one peer, each change of the local congestion map should reach the peer
/// once per connection (coalesced), not once per path.
#[test]
fn congestion_maps_are_coalesced_per_connection() {
    const COUNT: u64 = 100;
    let lab = Lab::new(2, 2, &["--paths", "8"]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    // Traffic from 16 ports brings every path up.
    let mut sink = h1.d().app(&["recv-multi", &h1.at(9530), "1600"]);
    sink.expect_within("bound", Duration::from_secs(10));
    let ip0 = h0.addr.to_string();
    let mut multi = h0
        .d()
        .app(&["multi-send", &ip0, "9540", "16", &h1.at(9530), "100"]);
    assert_eq!(
        sink.expect_within("received", Duration::from_secs(20)),
        "1600 sources 16"
    );
    assert_eq!(multi.wait_within(Duration::from_secs(10)), Some(0));
    wait_for(
        || h0.d().stat("tcp_path_up") == 8 && h1.d().stat("tcp_accepts") == 8,
        Duration::from_secs(10),
        "8 paths up",
    );
    let before = congestion_quiet(h1.d(), h0.d());

    // A receiver with a 4 KiB SO_RCVBUF that reads in bursts every 150 ms: the blocking sender,
    // one message per millisecond, fills it (congested), waits, the burst drains it (cleared),
    // and so on.
    let r = h1.d().attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(4096).unwrap();
    rcv.bind(addr(&h1.at(9550))).unwrap();
    rcv.set_nonblocking(true).unwrap();
    let mut snd = h0.d().app(&[
        "send-bounded",
        &h0.at(9551),
        &h1.at(9550),
        &COUNT.to_string(),
        "512",
        "0",
        "20000",
        "1000",
    ]);
    snd.expect_within("sending", Duration::from_secs(10));
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    let mut next = 0u64;
    while next < COUNT {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "received only {next} of {COUNT}"
        );
        // Paces the reader's bursts (the load this test is about, not synchronisation).
        std::thread::sleep(Duration::from_millis(150));
        loop {
            match rcv.recv_from(&mut buf) {
                Ok((n, _)) => {
                    assert_eq!(payload_seq(&buf[..n]), next);
                    next += 1;
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => break,
                Err(e) => panic!("recv: {e}"),
            }
        }
    }
    let sent = snd.expect_within("sent", Duration::from_secs(10));
    assert!(sent.starts_with(&COUNT.to_string()), "{sent}");
    let after = congestion_quiet(h1.d(), h0.d());
    let d: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let changes = d[0] + d[1];
    eprintln!(
        "host 1: {changes} congestion changes (marked {} cleared {}), {} maps sent, {} path downs",
        d[0], d[1], d[2], d[3]
    );
    assert!(changes >= 2, "the receiver really was congested: {d:?}");
    assert_eq!(d[3], 0, "no path went down (a path coming up sends a map)");
    assert!(
        d[2] >= 1,
        "the peer was told about the changes: {} maps",
        d[2]
    );
    assert!(
        d[2] <= changes,
        "{} maps sent for {changes} congestion changes on one connection (8 paths)",
        d[2]
    );
}

/// Waits until `d`'s transport delivered `at_least` messages (since it started).
fn wait_delivered(d: &Daemon, at_least: u64) {
    wait_until(
        Duration::from_secs(30),
        "the receiving host to deliver the stream",
        || d.stat("tcp_delivered"),
        |&n| n >= at_least,
    );
}

/// Drops every segment host 1's RDS/TCP sockets send (ACKs included) while `on`.
fn lose_acks(h: &netns::Host, on: bool) {
    if on {
        h.nft(
            "table ip ackloss {
            chain out {
                type filter hook output priority 0; policy accept;
                tcp sport 16385 drop
            }
        }",
        );
    } else {
        h.nft("delete table ip ackloss");
    }
}

/// The deterministic form of `receiver_restart_loop_no_duplicates`: before each SIGKILL, the
/// receiving host's TCP acknowledgements are lost until host 0 resends (while its rdsd goes on
/// reading and delivering), and the orphaned TCP sockets of the killed rdsd are destroyed (`ss -K`) before
/// the loss ends, so the sender never learns that those messages arrived. It resends them with
/// RETRANSMITTED to the restarted rdsd: the re-attached app must still not see them twice.
#[test]
fn receiver_restart_after_lost_acks_no_duplicates() {
    restart_stream(30_000, 3, 9560, true, None);
}

/// `receiver_restart_after_lost_acks_no_duplicates` with the second and later kills about 100
/// deliveries after the restart before them, while the sender still resends (RETRANSMITTED)
/// what the earlier incarnations delivered and is still connecting paths > 0 (their SYN-ACKs
/// are lost with the ACKs). Before host 0 handled a connect that the restarted rdsd answers
/// first (it takes it for its path 0; dataplane/docs/protocol.md, "Restart policy"), 3 runs in 56 on a
/// loaded 2-core VM delivered 122–162 duplicates.
#[test]
fn receiver_restart_soon_after_restart_no_duplicates() {
    restart_stream(30_000, 4, 9570, true, Some(100));
}

/// A slow receiver X on host 1 (SO_RCVBUF 64 MiB, never congested) reads nothing while host 0
/// sends it `count` messages of 4 KiB; host 1's connection to host 0 has one path, so every
/// socket of host 1 shares it. Then host 0 sends one message to Y, beside X on host 1, and one
/// to Z on host 2 (another connection): Z's always arrives while X reads nothing. Y's arrives
/// too while X's backlog in rdsd is below its share (8 MiB; `poll/backlog.rs`), wherever X's
/// poll thread is; past the share the path pauses (`rx_held_for_backlog`, kernel TCP's window
/// holds the rest) and Y's message waits until X reads. Then X reads all, once and in order.
fn slow_receiver_on_a_shared_path(count: u64, past_share: bool) {
    const LEN: usize = 4096;
    let lab = Lab::new(3, 3, &["--paths", "1"]);
    let (h0, h1, h2) = (&lab.hosts[0], &lab.hosts[1], &lab.hosts[2]);
    let (r1, r2) = (h1.d().attach(), h2.d().attach());
    let x = r1.socket().unwrap();
    x.set_recv_buffer_size(64 << 20).unwrap();
    x.bind(addr(&h1.at(9600))).unwrap();
    let y = r1.socket().unwrap();
    y.bind(addr(&h1.at(9601))).unwrap();
    let z = r2.socket().unwrap();
    z.bind(addr(&h2.at(9602))).unwrap();
    let mut flood = start_sender(h0, 9603, &h1.at(9600), count, LEN, 16 << 20, 60_000);
    if past_share {
        wait_for(
            || h1.d().exact_stat("rx_held_for_backlog") >= 1,
            Duration::from_secs(30),
            "host 1 to pause the path once X's backlog passed its share",
        );
    } else {
        // All of it on host 1: the sender's last message is in X's ring or backlog.
        flood.expect_within("sent", Duration::from_secs(30));
        wait_for(
            || h1.d().exact_stat("rx_backlogged") + 1 >= count - (2 << 20) / LEN as u64,
            Duration::from_secs(30),
            "X's overflow in its backlog",
        );
    }
    let r0 = h0.d().attach();
    let s = r0.socket().unwrap();
    s.bind(addr(&h0.at(9604))).unwrap();
    s.send_to(&seq_payload(1, 64), addr(&h1.at(9601))).unwrap();
    s.send_to(&seq_payload(2, 64), addr(&h2.at(9602))).unwrap();
    let mut buf = [0u8; 256];
    z.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    let (n, _) = z.recv_from(&mut buf).expect("host 2 is not held up by X");
    assert_eq!(payload_seq(&buf[..n]), 2);
    if past_share {
        // The path stays paused until X reads, however long we look.
        y.set_recv_timeout(Some(Duration::from_secs(1))).unwrap();
        let e = y.recv_from(&mut buf).expect_err("Y shares the paused path");
        assert_eq!(e.raw_os_error(), Some(libc::ETIMEDOUT));
    } else {
        y.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
        let (n, _) = y
            .recv_from(&mut buf)
            .expect("Y is not held up by X's backlog");
        assert_eq!(payload_seq(&buf[..n]), 1);
    }
    assert_eq!(h1.d().exact_stat("rx_backlog_capped"), 0);
    let t = drain(
        &x,
        count - 1,
        Duration::from_secs(10),
        Duration::ZERO,
        Some(LEN),
    );
    assert!(t.exactly_once_in_order(count), "X: {}", t.summary());
    if past_share {
        y.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
        let (n, _) = y.recv_from(&mut buf).expect("Y's message once X drained");
        assert_eq!(payload_seq(&buf[..n]), 1);
        flood.expect_within("sent", Duration::from_secs(30));
    }
    eprintln!(
        "host 1: {}",
        show(
            h1.d(),
            &[
                "rx_backlogged",
                "rx_held_for_backlog",
                "rx_paused",
                "rx_resumed"
            ]
        )
    );
}

/// 8 MiB to X: its ring (2 MiB) and a backlog below its share. Before backlogs on the
/// connection owner's thread, Y's message waited until X read whenever X's thread owned the
/// connection (the path paused at the full ring).
#[test]
fn a_full_ring_holds_up_no_socket_on_its_path() {
    slow_receiver_on_a_shared_path(2000, false);
}

/// 16 MiB to X: past its share the path pauses, and only the sockets on it wait.
#[test]
fn paused_path_delays_only_sockets_that_share_it() {
    slow_receiver_on_a_shared_path(4000, true);
}

/// Host 1 runs two poll threads, and its receiver X sits on the one that does not own the
/// connection to host 0. X (SO_RCVBUF 1 GiB, never congested) reads nothing while host 0 sends
/// it 16 MiB of 4 KiB messages: past its ring (2 MiB) the overflow waits in X's backlog, and
/// past X's share (8 MiB) the path pauses, as it does for a full ring on one thread, so this
/// thread's backlogs stay far from their cap. (Before, the backlog took all 16 MiB, and a
/// peer could fill it to the 64 MiB cap, which then stopped the ring between the two threads
/// for every socket.) Then X reads everything exactly once, in order.
#[test]
fn a_receiver_backed_up_past_its_share_pauses_the_network_path() {
    const COUNT: u64 = 4000;
    const LEN: usize = 4096;
    let lab = Lab::new(
        2,
        2,
        &[&["--paths", "1"][..], &two_poll_threads("app")].concat(),
    );
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let (ra, rb) = (h1.d().attach(), h1.d().attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    // The connection first: the address pair decides its poll thread.
    let probe = ra.socket().unwrap();
    probe.bind(addr(&h1.at(9650))).unwrap();
    probe
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let r0 = h0.d().attach();
    let s = r0.socket().unwrap();
    s.bind(addr(&h0.at(9651))).unwrap();
    s.send_to(b"hello", addr(&h1.at(9650))).unwrap();
    let mut buf = [0u8; 64];
    probe.recv_from(&mut buf).expect("the connection comes up");
    let owner = h1.d().info_json(&["-n"])["connections"][0]["shard"]
        .as_u64()
        .expect("the connection's poll thread");
    let r = if ra.poll_thread() as u64 == owner {
        &rb
    } else {
        &ra
    };
    let x = r.socket().unwrap();
    x.set_recv_buffer_size(1 << 30).unwrap();
    x.bind(addr(&h1.at(9652))).unwrap();
    let mut flood = start_sender(h0, 9653, &h1.at(9652), COUNT, LEN, 32 << 20, 60_000);
    // (The path may pause before, a moment at a time, while the ring between the threads is
    // full.)
    wait_for(
        || h1.d().exact_stat("rx_held_for_backlog") >= 1,
        Duration::from_secs(30),
        "host 1 to pause the path once X's backlog passed its share",
    );
    let counters = [
        "rx_backlogged",
        "rx_backlog_capped",
        "rx_held_for_backlog",
        "rx_paused",
        "rx_resumed",
    ];
    eprintln!("host 1 before draining: {}", show(h1.d(), &counters));
    let share = (8 << 20) / LEN as u64;
    assert!(
        h1.d().exact_stat("rx_backlogged") >= share,
        "X's backlog reached its share"
    );
    assert!(h1.d().stat("rx_paused") >= 1);
    assert_eq!(h1.d().exact_stat("rx_backlog_capped"), 0);
    let t = drain(
        &x,
        COUNT - 1,
        Duration::from_secs(10),
        Duration::ZERO,
        Some(LEN),
    );
    assert!(t.exactly_once_in_order(COUNT), "{}", t.summary());
    flood.expect_within("sent", Duration::from_secs(30));
    eprintln!("host 1 after: {}", show(h1.d(), &counters));
}

/// Sizes of the zero-copy exchange, cycled: either side of `tcp_zero_copy_min` (16 KiB) and
/// up to the 1 MiB maximum.
const ZC_SIZES: [usize; 7] = [100, 16_383, 16_384, 4096, 65_536, 1 << 20, 200_000];

/// Sends `count` messages of [`ZC_SIZES`] from host 0 to host 1 (kernel TCP, 2 paths) with rdsd
/// started with `extra`, checks that each arrives once, in order, with its size and contents,
/// and returns host 0's `tx_in_place` and the number of messages of 16 KiB or more.
fn zero_copy_exchange(extra: &[&str], count: u64) -> (u64, u64) {
    let lab = Lab::new(2, 2, extra);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r1 = h1.d().attach();
    let rcv = r1.socket().unwrap();
    rcv.set_recv_buffer_size(16 << 20).unwrap();
    rcv.bind(addr(&h1.at(9530))).unwrap();
    let dst = addr(&h1.at(9530));
    let r0 = h0.d().attach();
    let snd = r0.socket().unwrap();
    snd.set_send_buffer_size(8 << 20).unwrap();
    snd.set_send_timeout(Some(Duration::from_secs(30))).unwrap();
    snd.bind(addr(&h0.at(9531))).unwrap();
    let size = |seq: u64| ZC_SIZES[(seq % ZC_SIZES.len() as u64) as usize];
    let receiver = std::thread::spawn(move || {
        rcv.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; (1 << 20) + 1];
        for seq in 0..count {
            let (n, _) = rcv
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("message {seq} of {count}: {e}"));
            assert_eq!(payload_seq(&buf[..n]), seq, "exactly once, in order");
            assert_eq!(n, size(seq), "message {seq}'s size");
            assert!(
                buf[..n] == seq_payload(seq, n)[..],
                "message {seq} ({n} B) arrived with other contents"
            );
        }
    });
    for seq in 0..count {
        snd.send_to(&seq_payload(seq, size(seq)), dst)
            .unwrap_or_else(|e| panic!("send {seq}: {e}"));
    }
    receiver
        .join()
        .expect("the receiver saw every message intact");
    let big = (0..count).filter(|&s| size(s) >= 16_384).count() as u64;
    let st = h1.d().exact_stats();
    let (reads, direct) = (
        stat_from(&st, "tcp_path_reads"),
        stat_from(&st, "tcp_path_direct_reads"),
    );
    eprintln!("host 1 reads {reads}, of them straight into a payload {direct}");
    // The 1 MiB and 200 000-byte messages are longer than the endpoint's 64 KiB read buffer:
    // their rest is received straight into the reassembly buffer.
    assert!(direct > 0, "no read went straight into a payload");
    eprintln!(
        "host 0 {}",
        show(
            h0.d(),
            &[
                "tx_in_place",
                "tcp_sent",
                "regions_drained_late",
                "tcp_path_down"
            ]
        )
    );
    (h0.d().stat("tx_in_place"), big)
}

/// Messages from 16 KiB up are written to kernel TCP straight from the app's tx ring
/// (`tcp_zero_copy_min`, no copy into rdsd first), the smaller ones copied; all arrive intact,
/// once, in order. 70 messages hold about 13 MiB, six times the 2 MiB tx ring: the ring space
/// the in-place messages pin comes back as TCP acknowledges them, or the sender would stall.
#[test]
fn large_messages_leave_the_tx_ring_in_place_and_arrive_intact() {
    let (in_place, big) = zero_copy_exchange(&[], 70);
    // With several poll threads too: a send from another thread than the connection's owner
    // crosses to it in place (`SendRef`).
    assert_eq!(
        in_place, big,
        "every message of 16 KiB or more went in place, no other"
    );
}

/// `tcp_zero_copy_min = 0`: every message is copied, as before zero copy on TCP.
#[test]
fn zero_copy_off_copies_every_message() {
    let cfg = config_file("tcp_zero_copy_min = 0\n");
    let (in_place, _) = zero_copy_exchange(&["-c", cfg.to_str().unwrap()], 21);
    assert_eq!(in_place, 0);
}

/// Twelve ranks each send a last 64 KiB message (in place: `tcp_zero_copy_min`) to host 1 and
/// are SIGKILLed while host 1's TCP acknowledgements are lost, so their messages are still in
/// flight (queued or unacknowledged) when they go: each region stays mapped (drains) until its
/// message is acknowledged, and none is cancelled. With a drain limit of 8 regions, as when only
/// RDMA sent in place, the last four ranks' messages were cancelled. When the
/// acknowledgements flow again, all twelve arrive, intact.
#[test]
fn ranks_that_exit_together_still_deliver_their_last_large_messages() {
    const RANKS: u64 = 12;
    const LEN: usize = 65_536;
    let lab = Lab::new(2, 2, &["--paths", "1"]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r1 = h1.d().attach();
    let rcv = r1.socket().unwrap();
    rcv.set_recv_buffer_size(16 << 20).unwrap();
    rcv.bind(addr(&h1.at(9620))).unwrap();
    rcv.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    // The connection is up before the acknowledgements stop.
    let r0 = h0.d().attach();
    let warm = r0.socket().unwrap();
    warm.bind(addr(&h0.at(9621))).unwrap();
    warm.send_to(&seq_payload(u64::MAX, 64), addr(&h1.at(9620)))
        .unwrap();
    let mut buf = vec![0u8; LEN + 1];
    let (n, _) = rcv.recv_from(&mut buf).expect("the warm-up message");
    assert_eq!(payload_seq(&buf[..n]), u64::MAX);
    lose_acks(h1, true);
    for rank in 0..RANKS {
        let mut app = h0.d().app(&[
            "send-bounded",
            &h0.at(9630 + rank as u16),
            &h1.at(9620),
            "1",
            &LEN.to_string(),
            "0",
            "20000",
        ]);
        app.expect_within("sent", Duration::from_secs(10));
        // Killed once rdsd holds its message in place (not before: a socket that closes with
        // its message still on the ring may send it by copy).
        wait_until(
            Duration::from_secs(10),
            "host 0 to take the rank's message in place",
            || h0.d().stat("tx_in_place"),
            |&n| n > rank,
        );
        app.kill();
    }
    // rdsd notices each exit on its own time: every region must be draining before the loss ends.
    let late = wait_until(
        Duration::from_secs(10),
        "host 0 to keep every departed rank's region mapped",
        || h0.d().stat("regions_drained_late"),
        |&n| n >= RANKS,
    );
    let cancels = h0.d().stat("drain_cancels");
    lose_acks(h1, false);
    let mut got = Vec::new();
    while (got.len() as u64) < RANKS {
        let (n, from) = rcv
            .recv_from(&mut buf)
            .unwrap_or_else(|e| panic!("{} of {RANKS} last messages: {e}", got.len()));
        assert_eq!(n, LEN);
        assert!(buf[..n] == seq_payload(0, LEN)[..], "intact from {from}");
        got.push(from.port());
    }
    got.sort_unstable();
    eprintln!(
        "regions drained late {late}, drain cancels {cancels}; host 0 {}",
        show(
            h0.d(),
            &["tx_in_place", "regions_drained_late", "drain_cancels"]
        )
    );
    assert_eq!(cancels, 0, "no rank's message was cancelled");
    assert_eq!(late, RANKS, "each rank's region waited for its message");
    assert_eq!(got, (0..RANKS).map(|r| 9630 + r as u16).collect::<Vec<_>>());
}

/// Two poll threads at both ends, one process's two sockets on different threads (placement by
/// socket): one of them sends from another thread than the one that owns the connection (kernel
/// TCP connections are sharded by address pair). Its 64 KiB messages cross to the owner in
/// place (`SendRef`: no copy into the pair ring, none into a pool buffer), the other socket's go
/// in place on its own thread; both streams arrive intact, once, in order.
#[test]
fn large_sends_from_another_poll_thread_cross_to_the_connection_owner_in_place() {
    const EACH: u64 = 40;
    const LEN: usize = 65_536;
    let lab = Lab::new(2, 2, &two_poll_threads("socket"));
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r1 = h1.d().attach();
    let rcv = r1.socket().unwrap();
    rcv.set_recv_buffer_size(16 << 20).unwrap();
    rcv.bind(addr(&h1.at(9640))).unwrap();
    let dst = addr(&h1.at(9640));
    let r0 = h0.d().attach();
    let senders: Vec<Socket> = (0..2u16)
        .map(|k| {
            let s = r0.socket().unwrap();
            s.set_send_buffer_size(4 << 20).unwrap();
            s.bind(addr(&h0.at(9641 + k))).unwrap();
            s
        })
        .collect();
    let receiver = std::thread::spawn(move || {
        rcv.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; LEN + 1];
        let mut next = [0u64; 2];
        for _ in 0..2 * EACH {
            let (n, from) = rcv.recv_from(&mut buf).expect("every message");
            let k = usize::from(from.port() - 9641);
            let seq = payload_seq(&buf[..n]);
            assert_eq!(seq, next[k], "sender {k}: exactly once, in order");
            assert!(n == LEN && buf[..n] == seq_payload(seq, LEN)[..], "intact");
            next[k] += 1;
        }
    });
    for seq in 0..EACH {
        for s in &senders {
            s.send_to(&seq_payload(seq, LEN), dst).unwrap();
        }
    }
    receiver
        .join()
        .expect("both streams intact, once, in order");
    eprintln!(
        "host 0 {}",
        show(
            h0.d(),
            &[
                "tx_in_place",
                "tx_in_place_crossed",
                "tx_in_place_forwarded"
            ]
        )
    );
    assert_eq!(
        h0.d().stat("tx_in_place"),
        2 * EACH,
        "every message in place"
    );
    assert_eq!(
        h0.d().stat("tx_in_place_crossed"),
        EACH,
        "one socket's messages crossed to the owner in place"
    );
    assert_eq!(
        h0.d().stat("tx_in_place_forwarded"),
        EACH,
        "and the owner's kernel-TCP link wrote them from the sender's ring"
    );
}

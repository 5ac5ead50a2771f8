//! The exactly-once suite (`suite/mod.rs`) over the userspace-TCP link (`transport::utcp`,
//! smoltcp) on an in-memory Ethernet segment (`utcp::memwire`): a clean wire, a lossy one
//! (drop, duplication, reordering), path cuts (every socket of one side aborted), and a
//! blackout of the wire (retransmission timeouts, no path lost). The lossy runs also measure
//! how long smoltcp takes to resend a lost data segment (its RTO and fast retransmit); run
//! with `--nocapture` to see the numbers.
//!
//! Everything runs on a virtual clock shared by the wire, both links (smoltcp's timers) and
//! both endpoints: a pass of the pair is 100 µs of virtual time, waits are bounded by passes,
//! and no test sleeps. Delays measured here (RTOs, resends, a run's length) are virtual time:
//! the same on a loaded machine as on an idle one, and the same every run.

mod suite;

use rdsd::protocol::{Clock, VirtualClock};
use rdsd::transport::utcp::memwire::{Faults, Hub, Port, WireStats};
use rdsd::transport::utcp::{AbortSwitch, UtcpConfig, UtcpLink};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use suite::{run, suite, LabClock, MakeLink, Run, Wait};

/// The link of these tests: smoltcp on the in-memory wire, on a virtual clock.
type MemLink = UtcpLink<Port, VirtualClock>;

fn init_tracing() {
    // RUST_LOG=rdsd=debug shows the link's and the endpoint's events of a failing run.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// How `cut` severs the paths.
#[derive(Clone, Copy)]
enum Cut {
    /// Abort every socket of that side (RSTs to the peer).
    Abort,
    /// Drop every frame on the wire for a while.
    Blackout(Duration),
}

struct Lab {
    hub: Hub,
    clock: VirtualClock,
    switches: HashMap<u32, AbortSwitch>,
    cut: Cut,
    /// Links made so far: each gets its own smoltcp seed (ISNs, ephemeral ports), the same in
    /// every run.
    made: u64,
    /// The links' delayed-ACK timer (`UtcpConfig::ack_delay`).
    ack_delay: Option<Duration>,
    /// `UtcpConfig::congestion_control` (on unless a test turns it off, as memif does).
    congestion_control: bool,
}

impl Lab {
    fn new(faults: Faults, seed: u64, cut: Cut) -> Lab {
        init_tracing();
        let clock = VirtualClock::new();
        let hub = Hub::with_clock(clock.clone());
        hub.set_faults(faults, seed);
        Lab {
            hub,
            clock,
            switches: HashMap::new(),
            cut,
            made: 0,
            ack_delay: None,
            congestion_control: true,
        }
    }
}

impl Lab {
    /// A link as `make` builds it, with `tweak` applied to its configuration.
    fn make_with(&mut self, addr: u32, tweak: impl FnOnce(&mut UtcpConfig)) -> MemLink {
        let ip = Ipv4Addr::from(addr);
        let o = ip.octets();
        // A restarted side comes back with the same MAC (the peer's ARP cache stays right).
        let mut cfg = UtcpConfig::new([0x02, 0, o[0], o[1], o[2], o[3]], ip, 8);
        tweak(&mut cfg);
        self.made += 1;
        cfg.seed = self.made.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(addr);
        let link = UtcpLink::with_clock(self.hub.port(), cfg, self.clock.clone());
        self.switches.insert(addr, link.abort_switch());
        link
    }
}

impl MakeLink for Lab {
    type L = MemLink;
    type C = VirtualClock;
    fn clock(&self) -> VirtualClock {
        self.clock.clone()
    }
    fn make(&mut self, addr: u32) -> MemLink {
        let (ack_delay, cc) = (self.ack_delay, self.congestion_control);
        self.make_with(addr, |c| {
            c.ack_delay = ack_delay;
            c.congestion_control = cc;
        })
    }
    fn cut(&mut self, addr: u32) {
        match self.cut {
            Cut::Abort => {
                if let Some(s) = self.switches.get(&addr) {
                    s.trip();
                }
            }
            Cut::Blackout(d) => self.hub.blackout(d),
        }
    }
}

const LOSSY: Faults = Faults {
    drop_ppm: 200,   // 2%
    dup_ppm: 100,    // 1%
    reorder_ppm: 50, // 0.5%
};

/// Prints what the wires did; `elapsed`: the virtual time the runs took.
fn report(tag: &str, hubs: &[Hub], elapsed: Duration) -> WireStats {
    let mut all = WireStats::default();
    for h in hubs {
        let s = h.stats();
        all.frames += s.frames;
        all.dropped += s.dropped;
        all.duplicated += s.duplicated;
        all.reordered += s.reordered;
        all.retransmit_delays.extend(s.retransmit_delays);
        all.largest_frame = all.largest_frame.max(s.largest_frame);
        all.data_segments += s.data_segments;
        all.timestamped_data_segments += s.timestamped_data_segments;
    }
    let d = &mut all.retransmit_delays;
    d.sort();
    let pct = |p: usize| {
        d.get((d.len() * p / 100).min(d.len().saturating_sub(1)))
            .copied()
    };
    eprintln!(
        "{tag}: {elapsed:?} of virtual time; frames {} dropped {} duplicated {} reordered {}; \
         dropped data segments resent: {} (min {:?}, median {:?}, p90 {:?}, max {:?})",
        all.frames,
        all.dropped,
        all.duplicated,
        all.reordered,
        d.len(),
        d.first(),
        pct(50),
        pct(90),
        d.last(),
    );
    let buckets = [1u64, 5, 10, 20, 50, 100, 200, 500, 1000, 10_000];
    let mut line = String::new();
    let mut lo = 0;
    for b in buckets {
        let n = d
            .iter()
            .filter(|x| x.as_millis() as u64 >= lo && (x.as_millis() as u64) < b)
            .count();
        line += &format!(" [{lo},{b}) ms: {n};");
        lo = b;
    }
    eprintln!("{tag}: resend delay histogram:{line}");
    eprintln!(
        "{tag}: largest frame {} B; data segments {}, with timestamps {}",
        all.largest_frame, all.data_segments, all.timestamped_data_segments
    );
    all
}

/// Runs the suite with labs built by `make`, then reports what the wires did.
fn suite_with(tag: &str, make: impl Fn() -> Lab) -> WireStats {
    let labs = Arc::new(Mutex::new(Vec::new()));
    let l2 = labs.clone();
    suite(
        move || {
            let lab = make();
            l2.lock()
                .unwrap()
                .push((lab.hub.clone(), lab.clock.clone()));
            lab
        },
        tag,
    );
    let labs = labs.lock().unwrap().clone();
    let hubs: Vec<Hub> = labs.iter().map(|(h, _)| h.clone()).collect();
    let elapsed = labs.iter().map(|(_, c)| c.elapsed()).sum();
    report(tag, &hubs, elapsed)
}

/// Also proves that smoltcp 0.14 sizes segments with the 12-byte timestamp option right:
/// every data segment carries timestamps and the largest frames are exactly the MTU (with
/// 0.12 such segments exceeded the MTU, were not sent, and the stream stalled).
#[test]
fn utcp_passes_the_exactly_once_suite() {
    let w = suite_with("utcp-clean", || Lab::new(Faults::default(), 1, Cut::Abort));
    assert!(w.data_segments > 0);
    assert_eq!(
        w.timestamped_data_segments, w.data_segments,
        "every data segment carries TCP timestamps"
    );
    assert_eq!(
        w.largest_frame, 1514,
        "full-size segments fill the 1500 B MTU"
    );
}

/// Jumbo frames (a 9000 B MTU, as on memif or a veth): segments fill it, timestamps included.
#[test]
fn utcp_passes_the_suite_with_jumbo_frames() {
    let w = suite_with("utcp-jumbo", || {
        let lab = Lab::new(Faults::default(), 21, Cut::Abort);
        lab.hub.set_mtu(9000);
        lab
    });
    assert_eq!(w.timestamped_data_segments, w.data_segments);
    assert_eq!(
        w.largest_frame, 9014,
        "full-size segments fill the 9000 B MTU"
    );
}

#[test]
fn utcp_passes_the_suite_under_loss_duplication_and_reordering() {
    suite_with("utcp-lossy", || Lab::new(LOSSY, 0x5eed, Cut::Abort));
}

/// Without congestion control (memif's default, `[dpdk] congestion_control`): retransmission
/// does not depend on it, so loss, duplication and reordering still lose nothing.
#[test]
fn utcp_passes_the_suite_under_loss_without_congestion_control() {
    suite_with("utcp-lossy-no-cc", || {
        let mut lab = Lab::new(LOSSY, 0x5eee, Cut::Abort);
        lab.congestion_control = false;
        lab
    });
}

fn cut_run(tag: &str, lab: &mut Lab) -> WireStats {
    let o = run(lab, Run::path_cut(), tag);
    assert_eq!(o.gaps, 0, "{tag}: no gap after a path cut");
    report(tag, std::slice::from_ref(&lab.hub), lab.clock.elapsed())
}

#[test]
fn utcp_survives_path_cuts() {
    cut_run("utcp-cut", &mut Lab::new(Faults::default(), 2, Cut::Abort));
    for seed in 3..13 {
        cut_run(
            &format!("utcp-cut-lossy-{seed}"),
            &mut Lab::new(LOSSY, seed, Cut::Abort),
        );
    }
}

/// Queues message `seq` of 100 bytes from A:`sport` to B:7000 on `ea`.
fn send_100(
    ea: &mut rdsd::protocol::Endpoint<MemLink, VirtualClock>,
    ta: &mut suite::Table,
    sport: u16,
    seq: u64,
    ack_required: bool,
) {
    use rdsd::seam::{MsgBytes, OutMsg, SendOutcome, Transport};
    let p = suite::payload(sport, seq, 100);
    let m = OutMsg {
        laddr: suite::A,
        faddr: suite::B,
        sport,
        dport: 7000,
        payload: MsgBytes::from_slice(&p),
        token: 1,
        in_place: None,
        ack_required,
    };
    assert_eq!(ea.send(ta, m), SendOutcome::Queued);
}

/// A cut while the receiver is full: B's paused path reads nothing, so it does not notice
/// that its socket was aborted. A reconnects that path and sends on the new connection, and
/// B's TCP acknowledges those bytes before B's endpoint accepts it. B used to refuse the
/// connection (its path looked busy) with a reset; A took the acknowledged bytes as delivered
/// and released their messages: lost. Deterministic: while B's receiver stays full, every
/// reconnect of A was refused, and B's endpoint accepts within 16 passes of a connection being established.
#[test]
fn utcp_reconnect_while_the_receiver_is_full_loses_nothing() {
    use suite::{Hosts, A, B};
    let mut lab = Lab::new(Faults::default(), 8, Cut::Abort);
    let mut h = Hosts::new(&mut lab, 1, 2, None);
    let sport = 1000;
    let send = |ea: &mut _, ta: &mut _, seq| send_100(ea, ta, sport, seq, false);
    let a_idle = |h: &mut Hosts<MemLink, VirtualClock>| {
        h.a.connection(A, B)
            .is_some_and(|c| c.unacked_messages(0) == 0 && c.queued_messages(0) == 0)
    };
    let limit = Duration::from_secs(10);
    // B's receiver takes 2 and holds the rest; B's TCP acknowledges all of it.
    for seq in 0..10 {
        send(&mut h.a, &mut h.ta, seq);
    }
    h.pump_until(0, limit, "B full, A acknowledged", |h| {
        h.tb.full_answers > 0 && a_idle(h)
    });
    // The cut, and more messages while B's receiver stays full.
    lab.cut(B);
    for seq in 10..20 {
        send(&mut h.a, &mut h.ta, seq);
    }
    for _ in 0..5 {
        h.pump(0);
    }
    h.pump_until(0, limit, "A's messages acknowledged", a_idle);
    // A's new connection is up and its bytes are acknowledged; B's endpoint accepts it
    // within 16 passes.
    for _ in 0..64 {
        h.pump(0);
    }
    // Now the receiver drains: every message arrives, once, in order.
    h.pump_until(64, limit, "all 20 delivered", |h| {
        h.seen.per_sport.get(&sport).map_or(0, Vec::len) >= 20
    });
    h.seen.check(&HashMap::from([(sport, 20u64)]), false);
}

/// With a delayed ACK, a message flagged `RDS_FLAG_ACK_REQUIRED` (its sender's send buffer
/// half used) is acknowledged in the receiver's next pass; one without the flag waits for the
/// timer. Passes without a clock tick: no timer can fire, so only the flag can bring the ACK.
#[test]
fn utcp_acknowledges_an_ack_required_message_at_once() {
    use rdsd::seam::Transport;
    use suite::{Hosts, A, B};
    let mut lab = Lab::new(Faults::default(), 12, Cut::Abort);
    lab.ack_delay = Some(Duration::from_millis(50));
    let mut h = Hosts::new(&mut lab, 1, 1 << 20, None);
    let sport = 1000;
    let send = |ea: &mut _, ta: &mut _, seq, ack| send_100(ea, ta, sport, seq, ack);
    let unacked = |h: &Hosts<MemLink, VirtualClock>| {
        h.a.connection(A, B)
            .map_or(usize::MAX, |c| c.unacked_messages(0) + c.queued_messages(0))
    };
    let delivered = |h: &Hosts<MemLink, VirtualClock>| {
        h.tb.queues.get(&7000).map_or(0, |q| q.len())
            + h.seen.per_sport.get(&sport).map_or(0, Vec::len)
    };
    let still = |h: &mut Hosts<MemLink, VirtualClock>| {
        for _ in 0..32 {
            h.a.poll(&mut h.ta);
            h.b.poll(&mut h.tb);
        }
    };
    let limit = Duration::from_secs(5);
    // The path up, the first message delivered and acknowledged (by the timer).
    send(&mut h.a, &mut h.ta, 0, false);
    h.pump_until(0, limit, "warm-up", |h| unacked(h) == 0);
    for (seq, ack_required) in [(1, false), (2, true), (3, false), (4, true)] {
        let before = delivered(&h);
        send(&mut h.a, &mut h.ta, seq, ack_required);
        still(&mut h);
        assert_eq!(
            delivered(&h),
            before + 1,
            "message {seq} delivered without a tick"
        );
        if ack_required {
            assert_eq!(unacked(&h), 0, "message {seq}: acknowledged at once");
        } else {
            assert_eq!(unacked(&h), 1, "message {seq}: its ACK waits for the timer");
            h.pump_until(0, limit, "the delayed ACK", |h| unacked(h) == 0);
        }
    }
}

/// The wire goes dark for 300 ms mid-stream: smoltcp backs off and resends, the paths stay
/// up, nothing is lost or doubled.
#[test]
fn utcp_survives_a_blackout() {
    cut_run(
        "utcp-blackout",
        &mut Lab::new(
            Faults::default(),
            4,
            Cut::Blackout(Duration::from_millis(300)),
        ),
    );
}

/// smoltcp's egress walk (every socket, listeners included) runs only when something may go
/// out: idle passes skip it, input brings it back, a read only when it opens the window
/// (smoltcp's own test of that: `rdsd_a_read_costs_a_dispatch_only_when_it_opens_the_window`).
#[test]
fn utcp_idle_passes_skip_the_egress_walk() {
    use rdsd::protocol::{Link, Read, Write};
    let mut lab = Lab::new(Faults::default(), 7, Cut::Abort);
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &lab.clock, Duration::from_secs(5));
    // Settle (last ACKs), then the clock stands still: no input, no change, no timer due.
    for _ in 0..10 {
        a.poll_aux();
        b.poll_aux();
    }
    let (ea, eb) = (a.egress_runs(), b.egress_runs());
    for _ in 0..1000 {
        a.poll_aux();
        b.poll_aux();
    }
    assert_eq!(
        (a.egress_runs(), b.egress_runs()),
        (ea, eb),
        "idle passes walk no sockets"
    );
    // A write goes out at a's next pass; its arrival makes b walk (its ACK).
    assert_eq!(a.write(&mut pa, &[&[7u8; 100]]), Write::Wrote(100));
    a.poll_aux();
    assert_eq!(a.egress_runs(), ea + 1, "a written socket is walked");
    b.poll_aux();
    assert_eq!(b.egress_runs(), eb + 1, "input is answered");
    let mut buf = [0u8; 256];
    let Read::Data(got) = b.read(&mut pb, &mut buf) else {
        panic!("b reads the 100 bytes")
    };
    assert_eq!(got.len(), 100);
    b.poll_aux();
    assert_eq!(
        b.egress_runs(),
        eb + 1,
        "a read that opens no window leaves nothing to send: no egress (smoltcp patch item 7)"
    );
}

/// `write` copies the slices straight into smoltcp's send buffer, one `Socket::send` per
/// contiguous stretch of free space: with a 1000-byte buffer, writes of up to eight slices
/// (empty ones among them) end mid-slice and wrap around the ring's end, and the peer reads
/// exactly the stream the writes reported taken.
#[test]
fn utcp_partial_writes_around_the_ring_end_keep_the_stream_exact() {
    use rdsd::protocol::{Link, Read, Write};
    let mut lab = Lab::new(Faults::default(), 9, Cut::Abort);
    let mut a = lab.make_with(suite::A, |cfg| cfg.tx_buf = 1000);
    let mut b = lab.make(suite::B);
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &lab.clock, Duration::from_secs(5));
    let stream: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let (mut taken, mut got) = (0, Vec::new());
    let (mut partial, mut blocked) = (0, 0);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n) as usize
    };
    let mut buf = vec![0u8; 4096];
    let mut wait = Wait::new(
        &lab.clock,
        Duration::from_secs(60),
        "the whole stream arrives",
    );
    while got.len() < stream.len() {
        if taken < stream.len() {
            let mut slices: Vec<&[u8]> = Vec::new();
            let mut at = taken;
            for _ in 0..1 + next(8) {
                let len = if next(4) == 0 { 0 } else { next(300) };
                let end = (at + len).min(stream.len());
                slices.push(&stream[at..end]);
                at = end;
            }
            let offered = at - taken;
            match a.write(&mut pa, &slices) {
                Write::Wrote(n) => {
                    assert!(n > 0 && n <= offered, "wrote {n} of {offered}");
                    partial += usize::from(n < offered);
                    taken += n;
                }
                Write::WouldBlock => blocked += usize::from(offered > 0),
                Write::Closed => panic!("the path closed"),
            }
        }
        a.poll_aux();
        b.poll_aux();
        if let Read::Data(d) = b.read(&mut pb, &mut buf) {
            got.extend_from_slice(d);
        }
        wait.pass();
    }
    assert_eq!(taken, stream.len());
    assert!(got == stream, "the peer reads the stream written, in order");
    assert!(
        partial > 10 && blocked > 0,
        "partial {partial}, blocked {blocked}"
    );
}

/// smoltcp's egress per 64 B round trip on one busy path, with `paths` paths up between two
/// links (the others connected and idle), the busy one the last: (egress runs, sockets
/// dispatched, sockets examined by the egress, sockets examined by the ingress) per round
/// trip, both links together.
fn egress_per_round_trip(paths: usize) -> (f64, f64, f64, f64) {
    use rdsd::protocol::{ConnectPoll, Link};
    use rdsd::transport::utcp::UtcpPath;
    const ROUND_TRIPS: u64 = 200;
    let mut lab = Lab::new(Faults::default(), 8, Cut::Abort);
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let (mut pa, mut pb) = (Vec::new(), Vec::new());
    for k in 0..paths {
        let mut p = a.connect(suite::A, suite::B, k).unwrap();
        let mut wait = Wait::new(&lab.clock, Duration::from_secs(5), "a path up");
        let acc = loop {
            a.poll_aux();
            b.poll_aux();
            if a.poll_connect(&mut p) == ConnectPoll::Up {
                if let Some(acc) = b.accept() {
                    break acc;
                }
            }
            wait.pass();
        };
        pa.push(p);
        pb.push(acc.path);
    }
    // Settle (last ACKs); the clock stands still from here: no timer comes due.
    for _ in 0..10 {
        a.poll_aux();
        b.poll_aux();
    }
    let busy = paths - 1;
    let count = |a: &MemLink, b: &MemLink| {
        (
            a.egress_runs() + b.egress_runs(),
            a.egress_visits() + b.egress_visits(),
            a.egress_examined() + b.egress_examined(),
            a.ingress_examined() + b.ingress_examined(),
        )
    };
    // One 64 B message from `from` to `to` on the busy path, as the endpoint does it: the
    // write leaves at the end of the pass, the peer polls until it reads it.
    fn hop(from: &mut MemLink, fp: &mut UtcpPath, to: &mut MemLink, tp: &mut UtcpPath) {
        use rdsd::protocol::{Link, Read, Write};
        from.poll_aux();
        assert_eq!(from.write(fp, &[&[9u8; 64]]), Write::Wrote(64));
        from.end_pass(true);
        let mut buf = [0u8; 128];
        for _ in 0..10 {
            to.poll_aux();
            if to.path_ready(tp) {
                let Read::Data(got) = to.read(tp, &mut buf) else {
                    panic!("the message is there")
                };
                assert_eq!(got.len(), 64);
                to.end_pass(false);
                return;
            }
            to.end_pass(false);
        }
        panic!("the message did not arrive in 10 passes");
    }
    let before = count(&a, &b);
    for _ in 0..ROUND_TRIPS {
        hop(&mut a, &mut pa[busy], &mut b, &mut pb[busy]);
        hop(&mut b, &mut pb[busy], &mut a, &mut pa[busy]);
    }
    let after = count(&a, &b);
    let per = |x: u64, y: u64| (x - y) as f64 / ROUND_TRIPS as f64;
    (
        per(after.0, before.0),
        per(after.1, before.1),
        per(after.2, before.2),
        per(after.3, before.3),
    )
}

/// smoltcp's egress dispatches the sockets that may have something to send, not every socket:
/// a round trip on one path with 8 paths up (each link: 8 path sockets and 8 listeners)
/// dispatches as many sockets as with 1 path, examines as many to find them (no timer comes
/// due: the clock stands still), and the ingress asks as many sockets to take a segment. Unpatched smoltcp dispatched all of them each egress
/// run, and the first patch still walked them all to skip the idle ones (vendored smoltcp,
/// PATCHES.md item 4).
#[test]
fn utcp_idle_paths_cost_the_egress_nothing() {
    let (runs1, socks1, seen1, in1) = egress_per_round_trip(1);
    let (runs8, socks8, seen8, in8) = egress_per_round_trip(8);
    eprintln!(
        "per round trip, both links: 1 path: {runs1} egress runs, {socks1} sockets dispatched, \
         {seen1} examined, {in1} asked by ingress; 8 paths: {runs8} runs, {socks8} dispatched, \
         {seen8} examined, {in8} asked by ingress"
    );
    // The busy path's socket is the last one made, after 16 listeners: the ingress finds it by
    // its port pair (PATCHES.md item 6), not by asking every socket before it.
    assert!(
        in8 <= in1 + 0.5,
        "8 paths: the ingress asked {in8} sockets per round trip, 1 path: {in1}"
    );
    assert!(
        seen8 <= seen1 + 0.5,
        "8 paths: {seen8} sockets examined per round trip, 1 path: {seen1}"
    );
    assert!(
        socks8 <= socks1 + 0.5,
        "8 paths: {socks8} sockets dispatched per round trip, 1 path: {socks1}"
    );
    assert!(
        socks8 <= runs8 * 1.5,
        "8 paths: {socks8} sockets dispatched in {runs8} egress runs per round trip"
    );
}

/// A 1 MiB RDS message (and its header) fits the default buffers and window (window scaling):
/// the receiver holds all of it before reading a byte. And acknowledgements are per pass,
/// not per segment: smoltcp 0.14 takes a pass's whole burst in, then sends one ACK per socket
/// (0.12 with no ACK delay answered every segment with its own ACK frame).
#[test]
fn utcp_window_holds_a_mib_and_acks_are_per_pass() {
    use rdsd::protocol::{Link, Read, Write};
    let mut lab = Lab::new(Faults::default(), 6, Cut::Abort);
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &lab.clock, Duration::from_secs(5));
    let msg = vec![0x5au8; (1 << 20) + 48];
    assert_eq!(
        a.write(&mut pa, &[&msg]),
        Write::Wrote(msg.len()),
        "the send buffer takes a whole 1 MiB message"
    );
    let before = lab.hub.stats();
    let mut b_passes = 0u64;
    // The clock stands still here: this counts passes and frames, no timer is wanted.
    let queued = |b: &MemLink| b.socket_states().iter().map(|s| s.4).max().unwrap_or(0);
    while queued(&b) < msg.len() {
        a.poll_aux();
        b.poll_aux();
        b_passes += 1;
        assert!(
            b_passes < 100_000,
            "the whole message reaches b's window unread"
        );
    }
    let w = lab.hub.stats();
    let (segs, acks) = (
        w.data_segments - before.data_segments,
        w.pure_acks - before.pure_acks,
    );
    eprintln!(
        "1 MiB + 48 B: {segs} data segments, {acks} pure ACKs, {b_passes} receiver passes, \
         {:.1} segments per ACK",
        segs as f64 / acks.max(1) as f64
    );
    assert!(acks <= b_passes, "at most one ACK per receiver pass");
    assert!(
        segs >= 4 * acks,
        "ACKs coalesced: {segs} segments, {acks} ACKs"
    );
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0;
    while got < msg.len() {
        match b.read(&mut pb, &mut buf) {
            Read::Data(d) => got += d.len(),
            _ => panic!("the queued message reads back"),
        }
    }
}

/// How long smoltcp takes to resend a lost segment when nothing follows it (no duplicate
/// ACKs, so no fast retransmit: the RTO), on a fresh path and after the RTT estimate has
/// converged on this wire (microseconds). The numbers go to the module doc of `utcp`.
#[test]
fn utcp_rto_after_a_single_tail_loss() {
    use rdsd::protocol::{Link, Read, Write};
    let mut lab = Lab::new(Faults::default(), 5, Cut::Abort);
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &lab.clock, Duration::from_secs(5));
    let cfg = UtcpConfig::new([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 0, 0, 1), 8);
    let rto = a.retransmission_timeout(&pa);
    eprintln!("utcp RTO after the handshake's RTT sample: {rto:?}");
    assert!(
        rto >= cfg.rto_min && rto < Duration::from_secs(1),
        "the handshake's sample sets an RTO above the configured floor and under RFC 6298's \
         1 s (smoltcp 0.14 unpatched): {rto:?}"
    );
    let msg = [7u8; 1000];
    let mut buf = vec![0u8; 4096];
    // One message from a to b; `lose` drops its first transmission. Returns the virtual time
    // until b has it all (to a pass: 100 µs).
    let clock = lab.clock.clone();
    let mut one = |lose: bool| {
        if lose {
            lab.hub.drop_next_data(1);
        }
        let t = clock.now();
        assert_eq!(a.write(&mut pa, &[&msg]), Write::Wrote(msg.len()));
        let mut got = 0;
        let mut wait = Wait::new(&clock, Duration::from_secs(5), "resent within 5 s");
        loop {
            a.poll_aux();
            b.poll_aux();
            if let Read::Data(d) = b.read(&mut pb, &mut buf) {
                got += d.len();
            }
            if got == msg.len() {
                break;
            }
            wait.pass();
        }
        let took = clock.now().saturating_duration_since(t);
        // Let the ACK reach a before the next round.
        for _ in 0..3 {
            a.poll_aux();
            b.poll_aux();
            clock.tick();
        }
        took
    };
    let fresh = one(true);
    let mut clean = Vec::new();
    for _ in 0..200 {
        clean.push(one(false));
    }
    let mut warm = Vec::new();
    for _ in 0..20 {
        warm.push(one(true));
        for _ in 0..20 {
            one(false);
        }
    }
    clean.sort();
    warm.sort();
    let rto = a.retransmission_timeout(&pa);
    eprintln!("utcp RTO after warm-up: {rto:?}");
    assert!(
        rto < Duration::from_secs(1),
        "on a microsecond wire the RTO is below RFC 6298's 1 s floor (smoltcp 0.14 unpatched): {rto:?}"
    );
    eprintln!(
        "utcp RTO: first data segment lost on a fresh path: resent and delivered after {fresh:?}; \
         lossless delivery median {:?}; single tail loss after warm-up (20 runs): min {:?}, \
         median {:?}, max {:?}",
        clean[clean.len() / 2],
        warm[0],
        warm[warm.len() / 2],
        warm[warm.len() - 1],
    );
    assert!(warm[warm.len() / 2] < Duration::from_millis(500));
    // Virtual time makes the resend exact: the RTO expires, the segment goes again, b has it.
    assert!(
        warm.iter()
            .all(|&d| d >= cfg.rto_min && d <= rto + suite::TICK),
        "a lost tail is resent when the RTO expires, not before and not later: {warm:?}"
    );
}

/// Two runs of the same lab (wire faults, seeds, virtual clock) are the same run: the same
/// frames on the wire, the same losses, resent after the same delays, in the same virtual time.
#[test]
fn utcp_lossy_run_replays_exactly() {
    let once = || {
        let mut lab = Lab::new(LOSSY, 3, Cut::Abort);
        let w = cut_run("utcp-replay", &mut lab);
        (
            w.frames,
            w.dropped,
            w.retransmit_delays,
            lab.clock.elapsed(),
        )
    };
    let first = once();
    assert!(first.1 > 0, "the wire lost frames");
    assert_eq!(once(), first);
}

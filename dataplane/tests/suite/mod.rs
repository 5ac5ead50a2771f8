//! The exactly-once suite shared by every link under the protocol layer: two `Endpoint`s
//! driven through `seam::Transport`, a fake socket table on the `Upcalls` side, and runs with
//! full receive queues, path cuts and a restart of the receiving endpoint. Each link's test
//! file provides a [`MakeLink`] lab and calls [`suite`] (or [`run`] for its own cases).
//!
//! Time: a lab whose links are in memory runs on a [`VirtualClock`] shared by the endpoints,
//! the links and the wire. Every pass of the pair moves it one [`TICK`], and a wait is bounded
//! by passes: no sleep, and the same run every time. A lab on real sockets or a real device
//! runs on the [`MonotonicClock`]; its waits have a wall-clock deadline, and an idle pass parks
//! on the endpoints' descriptors (as the poll core does) instead of sleeping.

#![allow(dead_code)]

use rds_proto::wire::CongMap;
use rdsd::prefix::Prefix;
use rdsd::protocol::{
    Clock, Endpoint, EndpointConfig, Link, MonotonicClock, RxStateFile, VirtualClock,
};
use rdsd::seam::{Delivered, Incoming, MsgBytes, OutMsg, SendOutcome, Transport, Upcalls};
use rdsd::stats::Stats;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

// ----- time ---------------------------------------------------------------------------------------

/// Virtual time that passes between two passes of a pair on a virtual clock.
pub const TICK: Duration = Duration::from_micros(100);

/// The clock a lab runs on.
pub trait LabClock: Clock + Clone + 'static {
    /// The virtual clock, if this is one.
    fn as_virtual(&self) -> Option<&VirtualClock>;
    /// Between two passes: a virtual clock moves one [`TICK`]; real time passes by itself.
    fn tick(&self) {
        if let Some(v) = self.as_virtual() {
            v.advance(TICK);
        }
    }
}

impl LabClock for VirtualClock {
    fn as_virtual(&self) -> Option<&VirtualClock> {
        Some(self)
    }
}

impl LabClock for MonotonicClock {
    fn as_virtual(&self) -> Option<&VirtualClock> {
        None
    }
}

/// A wait for an observable condition that fails the test once `limit` of the lab's time is
/// spent: on a virtual clock `limit / TICK` passes, on the real clock a wall-clock deadline.
pub struct Wait<C: LabClock> {
    clock: C,
    what: String,
    limit: Duration,
    passes: u64,
    deadline: std::time::Instant,
}

impl<C: LabClock> Wait<C> {
    pub fn new(clock: &C, limit: Duration, what: impl Into<String>) -> Wait<C> {
        Wait {
            clock: clock.clone(),
            what: what.into(),
            limit,
            passes: 0,
            deadline: std::time::Instant::now() + limit,
        }
    }

    /// Counts one more pass that did not see the condition.
    pub fn check(&mut self) {
        self.passes += 1;
        if self.clock.as_virtual().is_some() {
            let max = (self.limit.as_nanos() / TICK.as_nanos()) as u64;
            assert!(
                self.passes <= max,
                "{}: not within {max} passes ({:?} of virtual time)",
                self.what,
                self.limit
            );
        } else {
            assert!(
                std::time::Instant::now() < self.deadline,
                "{}: not within {:?}",
                self.what,
                self.limit
            );
        }
    }

    /// [`Wait::check`], then lets time pass for a loop that polls links itself: one tick of a
    /// virtual clock, or the CPU to other threads on the real one.
    pub fn pass(&mut self) {
        self.check();
        if self.clock.as_virtual().is_some() {
            self.clock.tick();
        } else {
            std::thread::yield_now();
        }
    }
}

// ----- the socket-table side -------------------------------------------------------------------

/// A fake socket table: every destination port has a receive queue of bounded length.
pub struct Table {
    pub capacity: usize,
    /// Ordered by port, so that a virtual-clock run drains in the same order every time.
    pub queues: BTreeMap<u16, VecDeque<(u32, u16, Vec<u8>)>>,
    /// Delivered, not yet published: (port, source address, source port, payload).
    unpublished: Vec<(u16, u32, u16, Vec<u8>)>,
    pub released: u64,
    pub full_answers: u64,
    pub map: CongMap,
    /// The endpoint's receive-state file, if it keeps one: every publish must be recorded
    /// there before its receivers are woken (a wake-up is a syscall, where a SIGKILL lands).
    pub state: Option<PathBuf>,
    /// The file's bytes at the last publish that made something readable.
    at_publish: Option<Vec<u8>>,
    /// Wake-ups that found the publish before them recorded.
    pub wakes_after_record: u64,
}

impl Table {
    pub fn new(capacity: usize) -> Table {
        Table {
            capacity,
            queues: BTreeMap::new(),
            unpublished: Vec::new(),
            released: 0,
            full_answers: 0,
            map: CongMap::new(),
            state: None,
            at_publish: None,
            wakes_after_record: 0,
        }
    }

    /// A table whose endpoint keeps its receive state in `state`.
    pub fn recording(capacity: usize, state: Option<PathBuf>) -> Table {
        Table {
            state,
            ..Table::new(capacity)
        }
    }

    /// Takes up to `n` messages off every queue (a slow receiver draining).
    pub fn drain(&mut self, n: usize, into: &mut Vec<(u32, u16, u16, Vec<u8>)>) {
        for (&dport, q) in self.queues.iter_mut() {
            for _ in 0..n {
                let Some((faddr, sport, p)) = q.pop_front() else {
                    break;
                };
                into.push((faddr, sport, dport, p));
            }
        }
    }
}

impl Upcalls for Table {
    fn deliver(&mut self, m: Incoming<'_>) -> Delivered {
        let waiting = self.unpublished.iter().filter(|u| u.0 == m.dport).count();
        let queued = self.queues.get(&m.dport).map_or(0, VecDeque::len);
        if queued + waiting >= self.capacity {
            self.full_answers += 1;
            return Delivered::Full;
        }
        let mut v = Vec::new();
        m.payload.copy_into(&mut v);
        self.unpublished.push((m.dport, m.faddr, m.sport, v));
        Delivered::Yes
    }
    /// As rdsd's rings: the app sees nothing an endpoint delivered until it publishes (an
    /// endpoint that forgets to stalls the suite).
    fn publish_deliveries(&mut self) {
        if let Some(f) = self.state.as_ref().filter(|_| !self.unpublished.is_empty()) {
            self.at_publish = Some(std::fs::read(f).expect("read the receive-state file"));
        }
        for (dport, faddr, sport, v) in self.unpublished.drain(..) {
            self.queues
                .entry(dport)
                .or_default()
                .push_back((faddr, sport, v));
        }
    }
    fn wake_receivers(&mut self) {
        let (Some(f), Some(before)) = (&self.state, self.at_publish.take()) else {
            return;
        };
        let now = std::fs::read(f).expect("read the receive-state file");
        assert!(
            now != before,
            "receivers woken before their deliveries were recorded"
        );
        self.wakes_after_record += 1;
    }
    fn release(&mut self, _token: u64, len: u64) {
        self.released += len;
    }
    fn local_map(&self, _laddr: u32) -> &CongMap {
        &self.map
    }
    fn peer_map_changed(&mut self, _faddr: u32, _map: &CongMap) {}
    fn uncongested(&mut self, _mask: u64) {}
}

// ----- the two hosts -----------------------------------------------------------------------------

pub const A: u32 = 0x7f00_0001; // 127.0.0.1
pub const B: u32 = 0x7f00_0002; // 127.0.0.2

pub trait MakeLink {
    type L: Link;
    /// The clock of this lab's links and endpoints.
    type C: LabClock;
    fn clock(&self) -> Self::C;
    /// A link for `addr` on [`MakeLink::clock`].
    fn make(&mut self, addr: u32) -> Self::L;
    /// Severs every path of `addr`'s endpoint from the outside (a link cut).
    fn cut(&mut self, _addr: u32) {}
    /// Lets the links acknowledge everything consumed (an idle receiver's explicit ack).
    fn settle(&mut self) {}
}

pub fn state_file(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rdsd-eo-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.join("rx.state")
}

/// An endpoint for `addr` on `clock`, and the counters it publishes (`Stats::tcp`, by
/// `publish_counters`); `seed` fixes its generation and RNGs (a restarted endpoint takes a new
/// one).
pub fn endpoint<L: Link, C: Clock>(
    link: L,
    addr: u32,
    npaths: u8,
    state: Option<PathBuf>,
    clock: C,
    seed: u64,
) -> (Endpoint<L, C>, Arc<Stats>) {
    let me = Prefix {
        addr: Ipv4Addr::from(addr),
        len: 32,
    };
    let cfg = EndpointConfig {
        name: "test",
        routes: vec!["0.0.0.0/0".parse().unwrap()],
        local: vec![me],
        npaths,
        path_choice: Default::default(),
        state: state.map(|p| RxStateFile::open_shared(&p).expect("state file")),
    };
    let stats = Arc::new(Stats::default());
    let ep = Endpoint::with_clock(link, cfg, stats.clone(), |s| &s.tcp, clock, seed);
    (ep, stats)
}

/// A's message from port `sport` to B's port 7000 (token: the port).
pub fn message(sport: u16, payload: &[u8]) -> OutMsg<'_> {
    OutMsg {
        laddr: A,
        faddr: B,
        sport,
        dport: 7000,
        payload: MsgBytes::from_slice(payload),
        token: u64::from(sport),
        in_place: None,
        ack_required: false,
    }
}

pub fn payload(sport: u16, seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(seq % 251) as u8; len.max(10)];
    v[..2].copy_from_slice(&sport.to_le_bytes());
    v[2..10].copy_from_slice(&seq.to_le_bytes());
    v
}

/// What the receiving app saw, per sender port: sequence numbers in arrival order.
#[derive(Default)]
pub struct Seen {
    pub per_sport: HashMap<u16, Vec<u64>>,
}

impl Seen {
    pub fn take(&mut self, msgs: Vec<(u32, u16, u16, Vec<u8>)>) {
        for (faddr, sport, _dport, p) in msgs {
            assert_eq!(faddr, A);
            assert_eq!(u16::from_le_bytes([p[0], p[1]]), sport);
            let seq = u64::from_le_bytes(p[2..10].try_into().unwrap());
            assert!(
                p[10..].iter().all(|&b| b == (seq % 251) as u8),
                "payload intact"
            );
            self.per_sport.entry(sport).or_default().push(seq);
        }
    }

    /// Exactly once and in order; returns the number of gaps (0 unless `gaps_allowed`).
    pub fn check(&self, sent: &HashMap<u16, u64>, gaps_allowed: bool) -> usize {
        let mut gaps = 0;
        for (&sport, &n) in sent {
            let got = self.per_sport.get(&sport).map_or(&[][..], |v| &v[..]);
            for w in got.windows(2) {
                assert!(w[0] < w[1], "port {sport}: duplicate or reordering: {w:?}");
                if w[1] != w[0] + 1 {
                    gaps += 1;
                }
            }
            if !gaps_allowed {
                assert_eq!(
                    got.len() as u64,
                    n,
                    "port {sport}: every message arrives (missing {:?})",
                    (0..n).filter(|q| !got.contains(q)).collect::<Vec<_>>()
                );
            } else {
                assert_eq!(
                    got.last().copied(),
                    Some(n - 1),
                    "port {sport}: tail arrives"
                );
            }
        }
        gaps
    }
}

pub struct Run {
    pub sockets: u16,
    pub per_socket: u64,
    pub len: usize,
    pub npaths: u8,
    /// Receiver queue length (messages) before it answers Full.
    pub capacity: usize,
    /// Cut every path after this many sends.
    pub cut_at: Option<u64>,
    /// Restart the receiving endpoint (with its persisted state) after this many sends.
    pub restart_at: Option<u64>,
    pub persist: bool,
}

impl Run {
    /// The path-cut case every link runs: 8 sockets × 100 messages over 4 paths, a receiver
    /// that holds 4 per port, every path cut after 300 sends.
    pub fn path_cut() -> Run {
        Run {
            sockets: 8,
            per_socket: 100,
            len: 100,
            npaths: 4,
            capacity: 4,
            cut_at: Some(300),
            restart_at: None,
            persist: false,
        }
    }
}

pub struct Outcome {
    pub gaps: usize,
    pub full_answers: u64,
    pub dups_dropped: u64,
    pub restored: u64,
    /// Receiver wake-ups that found the deliveries before them recorded (persisted runs).
    pub wakes_after_record: u64,
}

/// The two endpoints, their apps' tables and what B's app received.
pub struct Hosts<L: Link, C: LabClock> {
    pub a: Endpoint<L, C>,
    pub b: Endpoint<L, C>,
    pub ta: Table,
    pub tb: Table,
    pub seen: Seen,
    pub clock: C,
}

/// Seeds of the endpoints (generation numbers, connection RNGs): fixed, so that a run on a
/// virtual clock is the same run every time. A restarted B takes the next one.
pub const SEED_A: u64 = 0xa;
pub const SEED_B: u64 = 0xb0;

impl<L: Link, C: LabClock> Hosts<L, C> {
    /// A and B on `lab`'s clock; B's app holds `capacity` messages per port, and B keeps its
    /// receive state in `state`.
    pub fn new<M: MakeLink<L = L, C = C>>(
        lab: &mut M,
        npaths: u8,
        capacity: usize,
        state: Option<PathBuf>,
    ) -> Hosts<L, C> {
        let clock = lab.clock();
        Hosts {
            a: endpoint(lab.make(A), A, npaths, None, clock.clone(), SEED_A).0,
            b: endpoint(lab.make(B), B, npaths, state.clone(), clock.clone(), SEED_B).0,
            ta: Table::new(1 << 20),
            tb: Table::recording(capacity, state.clone()),
            seen: Seen::default(),
            clock,
        }
    }

    /// One pass of each endpoint, then B's app takes up to `drain` messages per port, then
    /// the clock ticks. Returns the work done (the passes' work and the messages taken).
    pub fn pump(&mut self, drain: usize) -> usize {
        let mut work = self.a.poll(&mut self.ta) + self.b.poll(&mut self.tb);
        let mut got = Vec::new();
        self.tb.drain(drain, &mut got);
        work += got.len();
        self.seen.take(got);
        self.clock.tick();
        work
    }

    /// Pumps until `done` holds; fails the test once `limit` of the lab's time is spent.
    pub fn pump_until(
        &mut self,
        drain: usize,
        limit: Duration,
        what: &str,
        mut done: impl FnMut(&mut Self) -> bool,
    ) {
        let mut wait = Wait::new(&self.clock, limit, what);
        while !done(self) {
            let work = self.pump(drain);
            wait.check();
            if work == 0 && self.clock.as_virtual().is_none() {
                self.park();
            }
        }
    }

    /// Real clock, nothing done: waits for input on either endpoint's descriptors or their
    /// next timeout (at most 1 ms), as a parked poll core does. Links without descriptors (a
    /// DPDK device) yield the CPU instead.
    fn park(&self) {
        let mut fds = Vec::new();
        self.a.park_fds(&mut fds);
        self.b.park_fds(&mut fds);
        if fds.is_empty() {
            std::thread::yield_now();
            return;
        }
        let timeout = [self.a.next_timeout(), self.b.next_timeout()]
            .into_iter()
            .flatten()
            .fold(Duration::from_millis(1), Duration::min);
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd entries.
        unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                timeout.as_millis() as libc::c_int,
            )
        };
    }
}

pub fn run<M: MakeLink>(lab: &mut M, r: Run, tag: &str) -> Outcome {
    let state = r.persist.then(|| state_file(tag));
    let mut h = Hosts::new(lab, r.npaths, r.capacity, state.clone());
    let clock = h.clock.clone();
    let mut sent: HashMap<u16, u64> = HashMap::new();
    let total = u64::from(r.sockets) * r.per_socket;
    let mut full_answers = 0;
    let (mut dups, mut restored, mut wakes) = (0, 0, 0);
    for k in 0..total {
        let sport = 1000 + (k % u64::from(r.sockets)) as u16;
        let seq = sent.entry(sport).or_insert(0);
        let p = payload(sport, *seq, r.len);
        *seq += 1;
        let out = h.a.send(&mut h.ta, message(sport, &p));
        assert_eq!(out, SendOutcome::Queued);
        // A slow receiver: it drains one message per port per pass while A sends.
        h.pump(1);
        if r.cut_at == Some(k) {
            lab.cut(B);
        }
        if r.restart_at == Some(k) {
            // The restart must find state to restore: wait until B delivered something (a
            // link may accept asynchronously, e.g. TCP's accept thread).
            let limit = Duration::from_secs(10);
            h.pump_until(1, limit, "B delivers before its restart", |h| {
                !h.seen.per_sport.is_empty()
            });
            full_answers += h.tb.full_answers;
            wakes += h.tb.wakes_after_record;
            let Hosts { a, b, ta, seen, .. } = h;
            drop(b);
            lab.cut(B);
            // The app's queue and anything rdsd held in memory die with it.
            let b = endpoint(
                lab.make(B),
                B,
                r.npaths,
                state.clone(),
                clock.clone(),
                SEED_B + 1,
            )
            .0;
            h = Hosts {
                a,
                b,
                ta,
                tb: Table::recording(r.capacity, state.clone()),
                seen,
                clock: clock.clone(),
            };
        }
    }
    let released = total * r.len.max(10) as u64;
    h.pump_until(
        64,
        Duration::from_secs(30),
        &format!("{tag}: stalled"),
        |h| {
            lab.settle();
            let delivered = sent.iter().all(|(s, &n)| {
                h.seen
                    .per_sport
                    .get(s)
                    .is_some_and(|v| v.last() == Some(&(n - 1)))
            });
            delivered && h.ta.released == released
        },
    );
    // Give retransmissions a moment (50 passes; on a virtual clock 5 ms, the userspace TCP
    // link's RTO floor) to show up as duplicates, if any.
    for _ in 0..50 {
        h.pump(64);
    }
    full_answers += h.tb.full_answers;
    wakes += h.tb.wakes_after_record;
    if let Some(c) = h.b.connection(B, A) {
        dups += c.counters().rx_drop_dup_seq;
    }
    restored += u64::from(h.b.restored_connections());
    let gaps = h.seen.check(&sent, r.restart_at.is_some());
    Outcome {
        gaps,
        full_answers,
        dups_dropped: dups,
        restored,
        wakes_after_record: wakes,
    }
}

pub fn suite<M: MakeLink>(mut new_lab: impl FnMut() -> M, name: &str) {
    // Full receive queues: the path pauses, nothing is lost, order holds.
    let o = run(
        &mut new_lab(),
        Run {
            sockets: 8,
            per_socket: 100,
            len: 300,
            npaths: 4,
            capacity: 4,
            cut_at: None,
            restart_at: None,
            persist: false,
        },
        &format!("{name}-full"),
    );
    assert!(o.full_answers > 0, "{name}: the receiver was full at times");
    assert_eq!(o.gaps, 0);

    // 1 MiB-class messages (here 60 KB, what one frame of the mock holds) through a one-slot
    // receiver.
    let o = run(
        &mut new_lab(),
        Run {
            sockets: 2,
            per_socket: 20,
            len: 60_000,
            npaths: 2,
            capacity: 1,
            cut_at: None,
            restart_at: None,
            persist: false,
        },
        &format!("{name}-large"),
    );
    assert_eq!(o.gaps, 0);

    // The receiving endpoint restarts mid-stream and comes back with its persisted state: no
    // duplicate, no reordering, at most one gap per socket (what its app had not read yet).
    let o = run(
        &mut new_lab(),
        Run {
            sockets: 4,
            per_socket: 150,
            len: 64,
            npaths: 2,
            capacity: 16,
            cut_at: None,
            restart_at: Some(301),
            persist: true,
        },
        &format!("{name}-restart"),
    );
    assert_eq!(o.restored, 1, "{name}: the receive state was restored");
    assert!(
        o.wakes_after_record > 0,
        "{name}: the endpoint wakes its receivers after it records (`Upcalls::wake_receivers`)"
    );
    assert!(o.gaps <= 4, "{name}: at most one gap per socket");
}

/// Connects path 0 from `a` to `b` and returns (a's path, b's accepted path), polling both
/// links until the handshake is done or `limit` of `clock`'s time has passed.
pub fn handshake<L: Link, C: LabClock>(
    a: &mut L,
    b: &mut L,
    clock: &C,
    limit: Duration,
) -> (L::Path, L::Path) {
    use rdsd::protocol::ConnectPoll;
    let mut pa = a.connect(A, B, 0).unwrap();
    let mut wait = Wait::new(clock, limit, "handshake");
    loop {
        a.poll_aux();
        b.poll_aux();
        if a.poll_connect(&mut pa) == ConnectPoll::Up {
            if let Some(acc) = b.accept() {
                return (pa, acc.path);
            }
        }
        wait.pass();
    }
}

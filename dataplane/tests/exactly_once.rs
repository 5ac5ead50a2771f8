//! One exactly-once suite for every link under the shared protocol layer (DESIGN §1a):
//!
//! * `MockMessageLink`: an in-memory, message-framed link shaped like RDMA RC (whole frames per
//!   read and write, a credit limit per path, acknowledgement only when the peer has consumed a
//!   frame and says so, lazily). It proves the seam fits a message-oriented transport.
//! * `TcpLink`: the kernel-TCP link, two endpoints on 127.0.0.1 and 127.0.0.2 in this process.
//!
//! Each case drives two `Endpoint`s through `seam::Transport` with a fake socket table (the
//! `Upcalls` side) and checks that every message sent is delivered exactly once and in order
//! per (socket, destination), through full receive rings, path drops and a restart of the
//! receiving endpoint with its persisted receive state.

use rds_proto::wire::CongMap;
use rdsd::config::Prefix;
use rdsd::protocol::{
    Accepted, ConnectPoll, Endpoint, EndpointConfig, Framing, Link, PoolBuf, Read, Write,
};
use rdsd::seam::{Delivered, Incoming, MsgBytes, OutMsg, SendOutcome, Transport, Upcalls};
use rdsd::stats::Stats;
use rdsd::transport::tcp::TcpLink;
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// ----- the socket-table side -------------------------------------------------------------------

/// A fake socket table: every destination port has a receive queue of bounded length.
struct Table {
    capacity: usize,
    queues: HashMap<u16, VecDeque<(u32, u16, Vec<u8>)>>,
    released: u64,
    full_answers: u64,
    map: CongMap,
}

impl Table {
    fn new(capacity: usize) -> Table {
        Table {
            capacity,
            queues: HashMap::new(),
            released: 0,
            full_answers: 0,
            map: CongMap::new(),
        }
    }

    /// Takes up to `n` messages off every queue (a slow receiver draining).
    fn drain(&mut self, n: usize, into: &mut Vec<(u32, u16, u16, Vec<u8>)>) {
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
        let q = self.queues.entry(m.dport).or_default();
        if q.len() >= self.capacity {
            self.full_answers += 1;
            return Delivered::Full;
        }
        let mut v = Vec::new();
        m.payload.copy_into(&mut v);
        q.push_back((m.faddr, m.sport, v));
        Delivered::Yes
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

// ----- the mock message-framed link ----------------------------------------------------------

/// Frames in flight on one direction of one channel.
#[derive(Default)]
struct Pipe {
    frames: VecDeque<Vec<u8>>,
    /// Frame bytes the receiver consumed and acknowledged (RDS/IB: h_ack).
    acked: u64,
    consumed: u64,
    consumed_frames: u64,
}

struct Channel {
    /// [0]: connector → acceptor, [1]: acceptor → connector.
    pipes: [Pipe; 2],
    closed: bool,
    established: bool,
}

#[derive(Default)]
struct Net {
    channels: Vec<Channel>,
    /// Pending inbound connections per listening address: (channel, from, peer port).
    listen: HashMap<u32, VecDeque<(usize, u32, u16)>>,
    next_port: u16,
    /// Frames a receiver consumes before it acknowledges them (lazy acks, as with credits).
    ack_every: u64,
}

struct MockMessageLink {
    net: Arc<Mutex<Net>>,
    addr: u32,
    credits: usize,
}

struct MockPath {
    chan: usize,
    /// Which pipe we send on.
    side: usize,
}

impl Link for MockMessageLink {
    type Path = MockPath;
    type Payload = PoolBuf;
    const FRAMING: Framing = Framing::Message;

    fn payload(&mut self, bytes: MsgBytes<'_>) -> PoolBuf {
        PoolBuf::copy_of(bytes)
    }

    fn accept(&mut self) -> Option<Accepted<MockPath>> {
        let mut net = self.net.lock().unwrap();
        let (chan, faddr, peer_port) = net.listen.get_mut(&self.addr)?.pop_front()?;
        net.channels[chan].established = true;
        Some(Accepted {
            path: MockPath { chan, side: 1 },
            laddr: self.addr,
            faddr,
            peer_port,
        })
    }

    fn connect(&mut self, laddr: u32, faddr: u32, _path: usize) -> std::io::Result<MockPath> {
        let mut net = self.net.lock().unwrap();
        let chan = net.channels.len();
        net.channels.push(Channel {
            pipes: Default::default(),
            closed: false,
            established: false,
        });
        net.next_port = net.next_port.wrapping_add(1);
        let port = net.next_port;
        net.listen
            .entry(faddr)
            .or_default()
            .push_back((chan, laddr, port));
        Ok(MockPath { chan, side: 0 })
    }

    fn poll_connect(&mut self, p: &mut MockPath) -> ConnectPoll {
        let net = self.net.lock().unwrap();
        let c = &net.channels[p.chan];
        if c.closed {
            ConnectPoll::Failed
        } else if c.established {
            ConnectPoll::Up
        } else {
            ConnectPoll::Pending
        }
    }

    fn doorbell(&mut self, _laddr: u32, _faddr: u32) {}

    fn read<'a>(&'a mut self, p: &mut MockPath, buf: &'a mut [u8]) -> Read<'a> {
        let mut net = self.net.lock().unwrap();
        let ack_every = net.ack_every.max(1);
        let c = &mut net.channels[p.chan];
        if c.closed {
            return Read::Closed;
        }
        let pipe = &mut c.pipes[1 - p.side];
        let Some(frame) = pipe.frames.pop_front() else {
            return Read::WouldBlock;
        };
        pipe.consumed += frame.len() as u64;
        pipe.consumed_frames += 1;
        if pipe.consumed_frames.is_multiple_of(ack_every) {
            pipe.acked = pipe.consumed;
        }
        // A message link hands over one whole frame; the endpoint's buffer is 64 KiB, and this
        // suite's frames fit.
        assert!(frame.len() <= buf.len());
        buf[..frame.len()].copy_from_slice(&frame);
        Read::Data(&buf[..frame.len()])
    }

    fn write(&mut self, p: &mut MockPath, slices: &[&[u8]]) -> Write {
        let mut net = self.net.lock().unwrap();
        let c = &mut net.channels[p.chan];
        if c.closed {
            return Write::Closed;
        }
        let pipe = &mut c.pipes[p.side];
        if pipe.frames.len() >= self.credits {
            return Write::WouldBlock;
        }
        assert!(
            (1..=2).contains(&slices.len()) && slices[0].len() == 48,
            "a message link gets exactly one whole frame"
        );
        let f = slices.concat();
        let n = f.len();
        pipe.frames.push_back(f);
        Write::Wrote(n)
    }

    fn acked(&mut self, p: &MockPath, _written: u64) -> Option<u64> {
        let net = self.net.lock().unwrap();
        Some(net.channels[p.chan].pipes[p.side].acked)
    }

    fn close(&mut self, p: MockPath, _reset: bool) {
        let mut net = self.net.lock().unwrap();
        net.channels[p.chan].closed = true;
    }
}

// ----- the two hosts -----------------------------------------------------------------------------

const A: u32 = 0x7f00_0001; // 127.0.0.1
const B: u32 = 0x7f00_0002; // 127.0.0.2
static TCP_PORT: AtomicU16 = AtomicU16::new(0);

trait MakeLink {
    type L: Link;
    fn make(&mut self, addr: u32) -> Self::L;
    /// Severs every path of `addr`'s endpoint from the outside (a link cut).
    fn cut(&mut self, _addr: u32) {}
    /// Lets the links acknowledge everything consumed (an idle receiver's explicit ack).
    fn settle(&mut self) {}
}

struct MockLab {
    net: Arc<Mutex<Net>>,
    credits: usize,
}

impl MakeLink for MockLab {
    type L = MockMessageLink;
    fn make(&mut self, addr: u32) -> MockMessageLink {
        MockMessageLink {
            net: self.net.clone(),
            addr,
            credits: self.credits,
        }
    }
    fn cut(&mut self, _addr: u32) {
        let mut net = self.net.lock().unwrap();
        for c in net.channels.iter_mut() {
            c.closed = true;
        }
    }
    fn settle(&mut self) {
        let mut net = self.net.lock().unwrap();
        for c in net.channels.iter_mut() {
            for p in c.pipes.iter_mut() {
                p.acked = p.consumed;
            }
        }
    }
}

struct TcpLab {
    port: u16,
}

impl MakeLink for TcpLab {
    type L = TcpLink;
    fn make(&mut self, addr: u32) -> TcpLink {
        TcpLink::listen(SocketAddrV4::new(Ipv4Addr::from(addr), self.port)).unwrap()
    }
}

fn state_file(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rdsd-eo-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d.join("rx.state")
}

fn endpoint<L: Link>(link: L, addr: u32, npaths: u8, state: Option<PathBuf>) -> Endpoint<L> {
    let me = Prefix {
        addr: Ipv4Addr::from(addr),
        len: 32,
    };
    let cfg = EndpointConfig {
        name: "test",
        routes: vec!["0.0.0.0/0".parse().unwrap()],
        local: vec![me],
        npaths,
        state_file: state,
    };
    Endpoint::new(link, cfg, Arc::new(Stats::default()), |s| &s.tcp).unwrap()
}

fn payload(sport: u16, seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(seq % 251) as u8; len.max(10)];
    v[..2].copy_from_slice(&sport.to_le_bytes());
    v[2..10].copy_from_slice(&seq.to_le_bytes());
    v
}

/// What the receiving app saw, per sender port: sequence numbers in arrival order.
#[derive(Default)]
struct Seen {
    per_sport: HashMap<u16, Vec<u64>>,
}

impl Seen {
    fn take(&mut self, msgs: Vec<(u32, u16, u16, Vec<u8>)>) {
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
    fn check(&self, sent: &HashMap<u16, u64>, gaps_allowed: bool) -> usize {
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
                assert_eq!(got.len() as u64, n, "port {sport}: every message arrives");
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

struct Run {
    sockets: u16,
    per_socket: u64,
    len: usize,
    npaths: u8,
    /// Receiver queue length (messages) before it answers Full.
    capacity: usize,
    /// Cut every path after this many sends.
    cut_at: Option<u64>,
    /// Restart the receiving endpoint (with its persisted state) after this many sends.
    restart_at: Option<u64>,
    persist: bool,
}

struct Outcome {
    gaps: usize,
    full_answers: u64,
    dups_dropped: u64,
    restored: u64,
}

fn pump<L: Link>(
    a: &mut Endpoint<L>,
    b: &mut Endpoint<L>,
    ta: &mut Table,
    tb: &mut Table,
    seen: &mut Seen,
    drain: usize,
) {
    a.poll(ta);
    b.poll(tb);
    let mut got = Vec::new();
    tb.drain(drain, &mut got);
    seen.take(got);
}

fn run<M: MakeLink>(lab: &mut M, r: Run, tag: &str) -> Outcome {
    let state = r.persist.then(|| state_file(tag));
    let mut ea = endpoint(lab.make(A), A, r.npaths, None);
    let mut eb = endpoint(lab.make(B), B, r.npaths, state.clone());
    let (mut ta, mut tb) = (Table::new(1 << 20), Table::new(r.capacity));
    let mut seen = Seen::default();
    let mut sent: HashMap<u16, u64> = HashMap::new();
    let total = u64::from(r.sockets) * r.per_socket;
    let mut full_answers = 0;
    let (mut dups, mut restored) = (0, 0);
    for k in 0..total {
        let sport = 1000 + (k % u64::from(r.sockets)) as u16;
        let seq = sent.entry(sport).or_insert(0);
        let p = payload(sport, *seq, r.len);
        *seq += 1;
        let out = ea.send(
            &mut ta,
            OutMsg {
                laddr: A,
                faddr: B,
                sport,
                dport: 7000,
                payload: MsgBytes::from_slice(&p),
                token: u64::from(sport),
            },
        );
        assert_eq!(out, SendOutcome::Queued);
        // A slow receiver: it drains one message per port per pass while A sends.
        pump(&mut ea, &mut eb, &mut ta, &mut tb, &mut seen, 1);
        if r.cut_at == Some(k) {
            lab.cut(B);
        }
        if r.restart_at == Some(k) {
            full_answers += tb.full_answers;
            drop(eb);
            lab.cut(B);
            // The app's queue and anything rdsd held in memory die with it.
            tb = Table::new(r.capacity);
            eb = endpoint(lab.make(B), B, r.npaths, state.clone());
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        pump(&mut ea, &mut eb, &mut ta, &mut tb, &mut seen, 64);
        lab.settle();
        let done = sent.iter().all(|(s, &n)| {
            seen.per_sport
                .get(s)
                .is_some_and(|v| v.last() == Some(&(n - 1)))
        });
        if done && ta.released == total * r.len.max(10) as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "{tag}: stalled");
        std::thread::sleep(Duration::from_micros(200));
    }
    // Give retransmissions a moment to show up as duplicates, if any.
    for _ in 0..50 {
        pump(&mut ea, &mut eb, &mut ta, &mut tb, &mut seen, 64);
    }
    full_answers += tb.full_answers;
    if let Some(c) = eb.connection(B, A) {
        dups += c.counters().rx_drop_dup_seq;
    }
    restored += u64::from(eb.restored_connections());
    let gaps = seen.check(&sent, r.restart_at.is_some());
    Outcome {
        gaps,
        full_answers,
        dups_dropped: dups,
        restored,
    }
}

fn suite<M: MakeLink>(mut new_lab: impl FnMut() -> M, name: &str) {
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
    assert!(o.gaps <= 4, "{name}: at most one gap per socket");
}

#[test]
fn mock_message_link_passes_the_exactly_once_suite() {
    suite(
        || MockLab {
            net: Arc::new(Mutex::new(Net {
                ack_every: 3,
                ..Net::default()
            })),
            credits: 4,
        },
        "mock",
    );
}

#[test]
fn tcp_link_passes_the_exactly_once_suite() {
    suite(
        || TcpLab {
            port: 20000
                + (std::process::id() % 20000) as u16
                + TCP_PORT.fetch_add(1, Ordering::Relaxed),
        },
        "tcp",
    );
}

#[test]
fn mock_message_link_survives_path_cuts() {
    let o = run(
        &mut MockLab {
            net: Arc::new(Mutex::new(Net {
                ack_every: 5,
                ..Net::default()
            })),
            credits: 4,
        },
        Run {
            sockets: 8,
            per_socket: 100,
            len: 100,
            npaths: 4,
            capacity: 4,
            cut_at: Some(300),
            restart_at: None,
            persist: false,
        },
        "mock-cut",
    );
    assert_eq!(o.gaps, 0);
}

/// The receiving endpoint restarts mid-stream; frames it consumed but had not acknowledged are
/// retransmitted by the sender. With the persisted receive state they are dropped as duplicates;
/// without it the app sees them twice (shown below, so this test can fail).
#[test]
fn receiver_restart_with_persisted_state_sees_no_duplicate() {
    let lab = || MockLab {
        net: Arc::new(Mutex::new(Net {
            ack_every: 8,
            ..Net::default()
        })),
        credits: 16,
    };
    let run_it = |persist: bool, tag: &str| {
        let r = Run {
            sockets: 4,
            per_socket: 200,
            len: 64,
            npaths: 1,
            capacity: 64,
            cut_at: None,
            restart_at: Some(401),
            persist,
        };
        std::panic::catch_unwind(move || run(&mut lab(), r, tag))
    };
    let o = run_it(true, "restart-persist").expect("no duplicate with persisted state");
    assert_eq!(o.restored, 1, "the new endpoint restored its receive state");
    assert!(
        o.dups_dropped > 0,
        "the sender's retransmissions were dropped"
    );
    assert!(o.gaps <= 4, "at most one gap per socket");
    let without = run_it(false, "restart-volatile");
    assert!(
        without.is_err(),
        "without persisted state the restarted receiver delivers duplicates"
    );
}

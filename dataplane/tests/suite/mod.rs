//! The exactly-once suite shared by every link under the protocol layer: two `Endpoint`s
//! driven through `seam::Transport`, a fake socket table on the `Upcalls` side, and runs with
//! full receive queues, path cuts and a restart of the receiving endpoint. Each link's test
//! file provides a [`MakeLink`] lab and calls [`suite`] (or [`run`] for its own cases).

#![allow(dead_code)]

use rds_proto::wire::CongMap;
use rdsd::prefix::Prefix;
use rdsd::protocol::{Endpoint, EndpointConfig, Link};
use rdsd::seam::{Delivered, Incoming, MsgBytes, OutMsg, SendOutcome, Transport, Upcalls};
use rdsd::stats::Stats;
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ----- the socket-table side -------------------------------------------------------------------

/// A fake socket table: every destination port has a receive queue of bounded length.
pub struct Table {
    pub capacity: usize,
    pub queues: HashMap<u16, VecDeque<(u32, u16, Vec<u8>)>>,
    pub released: u64,
    pub full_answers: u64,
    pub map: CongMap,
}

impl Table {
    pub fn new(capacity: usize) -> Table {
        Table {
            capacity,
            queues: HashMap::new(),
            released: 0,
            full_answers: 0,
            map: CongMap::new(),
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

// ----- the two hosts -----------------------------------------------------------------------------

pub const A: u32 = 0x7f00_0001; // 127.0.0.1
pub const B: u32 = 0x7f00_0002; // 127.0.0.2

pub trait MakeLink {
    type L: Link;
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

pub fn endpoint<L: Link>(link: L, addr: u32, npaths: u8, state: Option<PathBuf>) -> Endpoint<L> {
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
}

pub fn pump<L: Link>(
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

pub fn run<M: MakeLink>(lab: &mut M, r: Run, tag: &str) -> Outcome {
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
                in_place: None,
            },
        );
        assert_eq!(out, SendOutcome::Queued);
        // A slow receiver: it drains one message per port per pass while A sends.
        pump(&mut ea, &mut eb, &mut ta, &mut tb, &mut seen, 1);
        if r.cut_at == Some(k) {
            lab.cut(B);
        }
        if r.restart_at == Some(k) {
            // The restart must find state to restore: wait until B delivered something (a
            // link may accept asynchronously, e.g. TCP's accept thread).
            let until = Instant::now() + Duration::from_secs(10);
            while seen.per_sport.is_empty() && Instant::now() < until {
                pump(&mut ea, &mut eb, &mut ta, &mut tb, &mut seen, 1);
                std::thread::sleep(Duration::from_micros(200));
            }
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
    assert!(o.gaps <= 4, "{name}: at most one gap per socket");
}

/// Connects path 0 from `a` to `b` and returns (a's path, b's accepted path), polling both
/// links until the handshake is done or `limit` has passed.
pub fn handshake<L: Link>(a: &mut L, b: &mut L, limit: Duration) -> (L::Path, L::Path) {
    use rdsd::protocol::ConnectPoll;
    let mut pa = a.connect(A, B, 0).unwrap();
    let deadline = Instant::now() + limit;
    loop {
        a.poll_aux();
        b.poll_aux();
        if a.poll_connect(&mut pa) == ConnectPoll::Up {
            if let Some(acc) = b.accept() {
                return (pa, acc.path);
            }
        }
        assert!(Instant::now() < deadline, "handshake within {limit:?}");
        std::thread::sleep(Duration::from_micros(100));
    }
}

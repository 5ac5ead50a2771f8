//! The exactly-once suite (`suite/mod.rs`, shared by every link under the protocol layer,
//! DESIGN §1a) over two links:
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
//!
//! The mock runs on a virtual clock (passes, no sleeps, the same run every time); kernel TCP on
//! the real one (waits on its descriptors, with deadlines).

mod suite;

use rdsd::protocol::{
    Accepted, ConnectPoll, Framing, Link, MonotonicClock, PoolBuf, Read, VirtualClock, Write,
};
use rdsd::seam::MsgBytes;
use rdsd::transport::tcp::TcpLink;
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use suite::{run, suite, MakeLink, Run};

static TCP_PORT: AtomicU16 = AtomicU16::new(0);

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
    /// Moves on with everything that can make a path ready (a frame written, a connection
    /// made or accepted, a close): `Link::ready_epoch` of links made `with_readiness`.
    epoch: u64,
}

/// `READS_AFTER`: as RDMA, the "device" reads a written frame until the peer has consumed it
/// (`Link::READS_AFTER_WRITE`, `Link::read_done`).
struct MockMessageLink<const READS_AFTER: bool = false> {
    net: Arc<Mutex<Net>>,
    addr: u32,
    credits: usize,
    /// `None`: every path is ready every pass (the default `path_ready`). `Some(epoch)`: a
    /// path is ready only until `poll_connect` saw it up, once closed, or with a frame to
    /// read; with `epoch` the link reports `Net::epoch` as its readiness epoch.
    readiness: Option<bool>,
}

struct MockPath {
    chan: usize,
    /// Which pipe we send on.
    side: usize,
    /// Accepted, or `poll_connect` reported it up (a path is ready until then).
    up: bool,
}

impl<const READS_AFTER: bool> Link for MockMessageLink<READS_AFTER> {
    type Path = MockPath;
    type Payload = PoolBuf;
    const FRAMING: Framing = Framing::Message;
    const READS_AFTER_WRITE: bool = READS_AFTER;

    fn read_done(&self, p: &MockPath) -> Option<u64> {
        let net = self.net.lock().unwrap();
        Some(net.channels[p.chan].pipes[p.side].consumed)
    }

    fn payload(&mut self, bytes: MsgBytes<'_>) -> PoolBuf {
        PoolBuf::copy_of(bytes)
    }

    fn path_ready(&self, p: &MockPath) -> bool {
        if self.readiness.is_none() {
            return true;
        }
        let net = self.net.lock().unwrap();
        let c = &net.channels[p.chan];
        !p.up || c.closed || !c.pipes[1 - p.side].frames.is_empty()
    }

    fn ready_epoch(&self) -> Option<u64> {
        self.readiness
            .filter(|&epoch| epoch)
            .map(|_| self.net.lock().unwrap().epoch)
    }

    fn accept(&mut self) -> Option<Accepted<MockPath>> {
        let mut net = self.net.lock().unwrap();
        let (chan, faddr, peer_port) = net.listen.get_mut(&self.addr)?.pop_front()?;
        net.channels[chan].established = true;
        net.epoch += 1;
        Some(Accepted {
            path: MockPath {
                chan,
                side: 1,
                up: true,
            },
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
        net.epoch += 1;
        Ok(MockPath {
            chan,
            side: 0,
            up: false,
        })
    }

    fn poll_connect(&mut self, p: &mut MockPath) -> ConnectPoll {
        let net = self.net.lock().unwrap();
        let c = &net.channels[p.chan];
        if c.closed {
            ConnectPoll::Failed
        } else if c.established {
            p.up = true;
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
        net.epoch += 1;
        Write::Wrote(n)
    }

    fn acked(&mut self, p: &MockPath, _written: u64) -> Option<u64> {
        let net = self.net.lock().unwrap();
        Some(net.channels[p.chan].pipes[p.side].acked)
    }

    fn close(&mut self, p: MockPath, _reset: bool) {
        let mut net = self.net.lock().unwrap();
        net.channels[p.chan].closed = true;
        net.epoch += 1;
    }
}

struct MockLab {
    net: Arc<Mutex<Net>>,
    credits: usize,
    clock: VirtualClock,
    readiness: Option<bool>,
}

impl MockLab {
    fn new(ack_every: u64, credits: usize) -> MockLab {
        MockLab {
            net: Arc::new(Mutex::new(Net {
                ack_every,
                ..Net::default()
            })),
            credits,
            clock: VirtualClock::new(),
            readiness: None,
        }
    }

    /// Links whose paths are ready only with something to read (or a connect or close to
    /// see), with a readiness epoch (`epoch`) or without.
    fn with_readiness(ack_every: u64, credits: usize, epoch: bool) -> MockLab {
        MockLab {
            readiness: Some(epoch),
            ..MockLab::new(ack_every, credits)
        }
    }
}

impl MakeLink for MockLab {
    type L = MockMessageLink;
    type C = VirtualClock;
    fn clock(&self) -> VirtualClock {
        self.clock.clone()
    }
    fn make(&mut self, addr: u32) -> MockMessageLink {
        MockMessageLink {
            net: self.net.clone(),
            addr,
            credits: self.credits,
            readiness: self.readiness,
        }
    }
    fn cut(&mut self, _addr: u32) {
        let mut net = self.net.lock().unwrap();
        for c in net.channels.iter_mut() {
            c.closed = true;
        }
        net.epoch += 1;
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
    clock: MonotonicClock,
}

impl MakeLink for TcpLab {
    type L = TcpLink;
    type C = MonotonicClock;
    fn clock(&self) -> MonotonicClock {
        self.clock
    }
    fn make(&mut self, addr: u32) -> TcpLink {
        TcpLink::listen(SocketAddrV4::new(Ipv4Addr::from(addr), self.port)).unwrap()
    }
}

#[test]
fn mock_message_link_passes_the_exactly_once_suite() {
    suite(|| MockLab::new(3, 4), "mock");
}

#[test]
fn tcp_link_passes_the_exactly_once_suite() {
    suite(
        || TcpLab {
            port: 20000
                + (std::process::id() % 20000) as u16
                + TCP_PORT.fetch_add(1, Ordering::Relaxed),
            clock: MonotonicClock::new(),
        },
        "tcp",
    );
}

/// The suite again with paths that are ready only with something to read and a readiness
/// epoch: the endpoint skips the paths it found not ready until the epoch moves, and still
/// loses, doubles and reorders nothing (its debug check compares every skipped path with
/// `path_ready`).
#[test]
fn mock_link_with_a_readiness_epoch_passes_the_exactly_once_suite() {
    suite(|| MockLab::with_readiness(3, 4, true), "mock-epoch");
    let o = run(
        &mut MockLab::with_readiness(5, 4, true),
        Run::path_cut(),
        "mock-epoch-cut",
    );
    assert_eq!(o.gaps, 0);
}

/// Idle passes ask no path whether it is ready while the link's readiness epoch stands; a
/// link without one has every present path asked every pass (`path_checks`).
#[test]
fn idle_passes_ask_no_path_while_the_readiness_epoch_stands() {
    use rdsd::seam::Transport;
    use suite::{endpoint, LabClock, Table, A, B, SEED_A, SEED_B};
    let asks = |epoch: bool| {
        let mut lab = MockLab::with_readiness(1, 16, epoch);
        let clock = lab.clock();
        let (mut a, stats) = endpoint(lab.make(A), A, 4, None, clock.clone(), SEED_A);
        let (mut b, _) = endpoint(lab.make(B), B, 4, None, clock.clone(), SEED_B);
        let (mut ta, mut tb) = (Table::new(1 << 20), Table::new(64));
        // Four messages from four ports: the paths come up and carry them.
        for sport in 1000..1004u16 {
            let p = suite::payload(sport, 0, 64);
            a.send(&mut ta, suite::message(sport, &p));
        }
        let mut got = Vec::new();
        for _ in 0..5000 {
            a.poll(&mut ta);
            b.poll(&mut tb);
            tb.drain(64, &mut got);
            clock.tick();
        }
        assert_eq!(got.len(), 4, "delivered");
        let read = |a: &rdsd::protocol::Endpoint<MockMessageLink, VirtualClock>| {
            a.publish_counters();
            let t = &stats.tcp;
            (
                t.passes.load(Ordering::Relaxed),
                t.path_checks.load(Ordering::Relaxed),
                t.path_up.load(Ordering::Relaxed) + t.accepts.load(Ordering::Relaxed),
            )
        };
        let (p0, c0, up) = read(&a);
        for _ in 0..1000 {
            a.poll(&mut ta);
            b.poll(&mut tb);
            clock.tick();
        }
        let (p1, c1, _) = read(&a);
        (p1 - p0, c1 - c0, up)
    };
    let (passes, with, up) = asks(true);
    assert!(up >= 4, "A's 4 paths came up ({up})");
    assert!(
        with * 10 <= passes,
        "{with} readiness asks in {passes} idle passes with an epoch"
    );
    let (passes, without, _) = asks(false);
    assert!(
        without >= 4 * passes,
        "without an epoch every path is asked every pass: {without} in {passes} passes"
    );
}

#[test]
fn mock_message_link_survives_path_cuts() {
    let o = run(&mut MockLab::new(5, 4), Run::path_cut(), "mock-cut");
    assert_eq!(o.gaps, 0);
}

/// The receiving endpoint restarts mid-stream; frames it consumed but had not acknowledged are
/// retransmitted by the sender. With the persisted receive state they are dropped as duplicates;
/// without it the app sees them twice (shown below, so this test can fail).
#[test]
fn receiver_restart_with_persisted_state_sees_no_duplicate() {
    let lab = || MockLab::new(8, 16);
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

/// RDS_CANCEL_SENT_TO of messages already written, over a link whose device still reads them
/// after the write (RDMA: a posted SEND reads the payload, in place from the app's ring, until
/// it completes). Their bytes go back to the app only once the device is done with them (here:
/// once the peer consumed the frames); over a link that copies at write (TCP), at once.
#[test]
fn cancelled_messages_are_released_only_once_the_device_has_read_them() {
    use rdsd::seam::Transport;
    use suite::{endpoint, LabClock, Table, A, B, SEED_A, SEED_B};
    fn scenario<const READS_AFTER: bool>() -> (u64, u64, u64) {
        // Acknowledgements only every 1000 frames: nothing is released by an ack here.
        let mut lab = MockLab::new(1000, 16);
        let clock = lab.clock();
        let link = MockMessageLink::<READS_AFTER> {
            net: lab.net.clone(),
            addr: A,
            credits: 16,
            readiness: None,
        };
        let (mut a, stats) = endpoint(link, A, 1, None, clock.clone(), SEED_A);
        let (mut b, _) = endpoint(lab.make(B), B, 1, None, clock.clone(), SEED_B);
        let (mut ta, mut tb) = (Table::new(1 << 20), Table::new(1 << 20));
        let mut got = Vec::new();
        // The path comes up and carries a first message.
        let warm = suite::payload(999, 0, 64);
        a.send(&mut ta, suite::message(999, &warm));
        for _ in 0..2000 {
            a.poll(&mut ta);
            b.poll(&mut tb);
            tb.drain(64, &mut got);
            clock.tick();
            if !got.is_empty() {
                break;
            }
        }
        assert_eq!(got.len(), 1, "the path is up");
        // Three messages written, the peer reading nothing yet.
        let msgs: Vec<_> = (0..3).map(|i| suite::payload(1000, i, 500)).collect();
        for m in &msgs {
            a.send(&mut ta, suite::message(1000, m));
        }
        for _ in 0..10 {
            a.poll(&mut ta);
            clock.tick();
        }
        assert_eq!(ta.released, 0, "nothing acknowledged");
        a.cancel(A, 1000, Some((B, 7000)));
        a.poll(&mut ta);
        let at_cancel = ta.released;
        // The peer consumes the frames: the device is done with them.
        for _ in 0..200 {
            b.poll(&mut tb);
            a.poll(&mut ta);
            clock.tick();
        }
        let held = stats
            .tcp
            .cancels_held_for_device
            .load(std::sync::atomic::Ordering::Relaxed);
        (at_cancel, ta.released, held)
    }
    let all = 3 * 500;
    assert_eq!(
        scenario::<false>(),
        (all, all, 0),
        "copied at write: released at once"
    );
    assert_eq!(
        scenario::<true>(),
        (0, all, 3),
        "read after write: released once read, not before (and counted)"
    );
}

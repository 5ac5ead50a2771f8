//! Two poll threads in one test thread, stepped by hand: the order in which one shard's
//! messages and requests reach the shard that owns their connection.

use super::*;
use crate::seam::Upcalls;
use proptest::prelude::*;
use shm_api::ring::{Producer, RawRing, RecordHeader};
use std::sync::Mutex;

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

/// What a shard's network transport was asked, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    /// A message queued (never acknowledged: the peer is dead), by its first payload bytes.
    Queued {
        sport: u16,
        dport: u16,
        tag: [u8; 6],
    },
    /// RDS_CANCEL_SENT_TO reached the transport.
    Cancel {
        sport: u16,
        dest: Option<(u32, u16)>,
    },
}

/// The peer's messages on their way in: (local port, payload).
type Arrivals = Arc<Mutex<std::collections::VecDeque<(u16, Vec<u8>)>>>;

/// A network transport to a peer that never acknowledges: it queues every message and
/// forgets those a cancel names (each shard has one, as with kernel TCP on every poll
/// thread). The peer's own messages (to a local port) come in, in order, on the shard that
/// polls `arrivals`: the connection's owner.
struct DeadPeer {
    shard: usize,
    log: Arc<Mutex<Vec<(usize, Event)>>>,
    arrivals: Option<Arrivals>,
}

impl Transport for DeadPeer {
    fn name(&self) -> &'static str {
        "dead-peer"
    }
    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        dest == PEER
    }
    fn send(&mut self, _up: &mut dyn Upcalls, m: OutMsg<'_>) -> SendOutcome {
        let mut bytes = Vec::new();
        m.payload.copy_into(&mut bytes);
        let mut tag = [0u8; 6];
        let n = bytes.len().min(6);
        tag[..n].copy_from_slice(&bytes[..n]);
        let e = Event::Queued {
            sport: m.sport,
            dport: m.dport,
            tag,
        };
        self.log.lock().unwrap().push((self.shard, e));
        SendOutcome::Queued
    }
    fn poll(&mut self, up: &mut dyn Upcalls) -> usize {
        let Some(arrivals) = &self.arrivals else {
            return 0;
        };
        let mut q = arrivals.lock().unwrap();
        let mut n = 0;
        // As a network path: a full receiver stops the read, to be retried.
        while let Some((dport, payload)) = q.front() {
            let m = crate::seam::Incoming {
                laddr: u32::from(LOCAL),
                faddr: u32::from(PEER),
                sport: 5000,
                dport: *dport,
                payload: MsgBytes::from_slice(payload),
            };
            if up.deliver(m) == crate::seam::Delivered::Full {
                break;
            }
            q.pop_front();
            n += 1;
        }
        if n > 0 {
            up.publish_deliveries();
            up.wake_receivers();
        }
        n
    }
    fn cancel(&mut self, _laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        let e = Event::Cancel { sport, dest };
        self.log.lock().unwrap().push((self.shard, e));
    }
}

struct Rig {
    cores: Vec<PollCore>,
    chans: Arc<Channels>,
    log: Arc<Mutex<Vec<(usize, Event)>>>,
    /// Messages from the peer, for the owner of the connection to it to take.
    arrivals: Arrivals,
    /// The poll thread that owns the connection to the peer.
    owner: usize,
    seq: u64,
    _dir: std::path::PathBuf,
}

impl Rig {
    fn new() -> Rig {
        Rig::with_shards(2)
    }

    /// `n` poll threads, each owning the kernel-TCP-like connections the fabric's owners give it.
    fn with_shards(n: usize) -> Rig {
        let (cfg, dir) = super::inplace_tests::test_config("shards", n);
        assert_eq!(cfg.net_shards(), n, "every shard owns some connections");
        let daemon = Arc::new(DaemonRegion::create(false).unwrap());
        let chans = Arc::new(Channels::with_shards(cfg.max_apps as usize, n));
        let doorbells = (0..n)
            .map(|_| Arc::new(shm_api::sys::eventfd().unwrap()))
            .collect();
        // Placed by the symmetric hash, as before owners were placed by load: the owner of the
        // one peer's connection varies with `n` (balanced, it would always be thread 0).
        let owners = Arc::new(crate::transport::ConnOwners::with(n, false));
        let fabric = Arc::new(shard::Fabric::new(
            doorbells,
            daemon.view(),
            None,
            owners.clone(),
        ));
        let wake = Arc::new(shm_api::sys::eventfd().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let arrivals = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        let owner = owners.owner(u32::from(LOCAL), u32::from(PEER));
        let cores = (0..n)
            .map(|k| {
                let stats = Arc::new(Stats::default());
                let lo: Box<dyn Transport> =
                    Box::new(crate::transport::loopback::Loopback::new(&cfg, &stats));
                let t: Box<dyn Transport> = Box::new(DeadPeer {
                    shard: k,
                    log: log.clone(),
                    arrivals: (k == owner).then(|| arrivals.clone()),
                });
                PollCore::shard(
                    cfg.clone(),
                    stats,
                    daemon.clone(),
                    chans.clone(),
                    wake.clone(),
                    vec![lo, t],
                    fabric.clone(),
                    k,
                )
            })
            .collect();
        Rig {
            cores,
            chans,
            log,
            arrivals,
            owner,
            seq: 0,
            _dir: dir,
        }
    }

    /// Runs `cmd` on shard `k` (one pass) and returns its answer.
    fn cmd(&mut self, k: usize, cmd: Cmd) -> CmdReply {
        self.seq += 1;
        let seq = self.seq;
        if !matches!(cmd, Cmd::Detach { .. }) {
            self.chans.arm(cmd.app(), seq);
        }
        assert!(self.chans.cmds[k].push((seq, cmd)).is_ok());
        self.cores[k].run_once();
        let (s, _, reply) = self.chans.replies.pop().expect("an answer");
        assert_eq!(s, seq);
        reply
    }

    fn request(&mut self, k: usize, app: usize, req: Request) -> u64 {
        self.try_request(k, app, req)
            .unwrap_or_else(|e| panic!("{req:?} failed: errno {e}"))
    }

    fn try_request(&mut self, k: usize, app: usize, req: Request) -> Result<u64, i32> {
        match self.cmd(
            k,
            Cmd::Request {
                app,
                req,
                readiness: None,
            },
        ) {
            CmdReply::Reply(r) if r.errno == 0 => Ok(r.value),
            CmdReply::Reply(r) => Err(r.errno),
            _ => panic!("not a reply"),
        }
    }

    /// A group request of app `app` on shard `k`: shard `k` forwards it to shard 0, which
    /// answers it. Panics unless it succeeds.
    fn group_request(&mut self, k: usize, app: usize, req: Request) {
        self.seq += 1;
        let seq = self.seq;
        self.chans.arm(app, seq);
        let cmd = Cmd::Request {
            app,
            req,
            readiness: None,
        };
        assert!(self.chans.cmds[k].push((seq, cmd)).is_ok());
        for _ in 0..3 {
            self.cores[k].run_once();
            self.cores[0].run_once();
        }
        let (s, _, reply) = self.chans.replies.pop().expect("answered");
        assert!(
            s == seq && matches!(reply, CmdReply::Reply(r) if r.errno == 0),
            "{req:?}"
        );
    }

    /// App `app` on shard `k` with one socket bound at `LOCAL:port`: its slot and tx ring.
    fn app_with_socket(&mut self, k: usize, app: usize, port: u16) -> (u32, RawRing) {
        let (slots, _) = self.app_with_sockets(k, app, &[port]);
        slots[0]
    }

    /// App `app` on shard `k` with a socket bound at `LOCAL:port` for each of `ports`: each
    /// one's slot and tx ring, and the rx rings.
    fn app_with_sockets(
        &mut self,
        k: usize,
        app: usize,
        ports: &[u16],
    ) -> (Vec<(u32, RawRing)>, Vec<RawRing>) {
        let region = super::inplace_tests::test_region();
        let rings: Vec<RawRing> = (0..4).map(|s| region.tx_ring(s)).collect();
        let rx: Vec<RawRing> = (0..4).map(|s| region.rx_ring(s)).collect();
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let attached = self.cmd(
            k,
            Cmd::Attach {
                app,
                region,
                doorbell: a.into(),
                uid: 1000,
            },
        );
        assert!(matches!(attached, CmdReply::Attached));
        let mut socks = Vec::new();
        let mut rxs = Vec::new();
        for &port in ports {
            let slot = self.request(k, app, Request::SocketOpen) as u32;
            let bind = Request::Bind {
                slot,
                addr: LOCAL,
                port,
            };
            self.request(k, app, bind);
            socks.push((slot, rings[slot as usize]));
            rxs.push(rx[slot as usize]);
        }
        (socks, rxs)
    }

    /// What the transports of shard `k` were asked, in order.
    fn events(&self, k: usize) -> Vec<Event> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|e| e.0 == k)
            .map(|e| e.1.clone())
            .collect()
    }
}

/// Pushes `payload` to `LOCAL:port` onto tx ring `p` until it is full, then publishes:
/// how many went.
fn fill_tx_ring(p: &mut Producer<RawRing>, port: u16, payload: &[u8]) -> u64 {
    let header = RecordHeader::data(payload.len() as u32, u32::from(LOCAL), port);
    let mut n = 0;
    while p.push(header, payload).is_ok() {
        n += 1;
    }
    p.publish();
    n
}

/// RDS_CANCEL_SENT_TO on a socket whose connection another poll thread owns: the messages it
/// sent before the cancel are already on their way to the owner (in the pair ring between the
/// two threads) when the cancel request comes. The cancel must reach the owner's transport
/// after them, or they are queued after it, to a dead peer, and their send-buffer bytes never
/// come back (the CI failure of `multihost.rs::cancel_sent_to_a_dead_peer_frees_the_send_buffer`
/// with two poll threads: the cancel travelled as a note, which the owner read before the pair
/// ring).
#[test]
fn a_cancel_reaches_the_connection_owner_after_the_messages_sent_before_it() {
    let mut rig = Rig::new();
    let owner = rig.owner;
    let app_shard = 1 - owner;
    let (slot, ring) = rig.app_with_socket(app_shard, 0, 4000);
    let mut p = Producer::new(ring);
    for tag in 0..5u8 {
        let h = RecordHeader::data(100, u32::from(PEER), 5000);
        p.push(h, &[tag; 100]).unwrap();
    }
    p.publish();
    // The app's shard takes them and forwards them to the owner.
    rig.cores[app_shard].run_once();
    // The cancel request, served by the app's shard before the owner ran.
    let cancel = Request::CancelSentTo {
        slot,
        dest: Some((PEER, 5000)),
    };
    rig.request(app_shard, 0, cancel);
    for _ in 0..3 {
        rig.cores[owner].run_once();
    }
    let events = rig.events(owner);
    let cancel_at = events
        .iter()
        .position(|e| matches!(e, Event::Cancel { .. }))
        .unwrap_or_else(|| panic!("the cancel never reached the owner: {events:?}"));
    let queued_after: Vec<_> = events[cancel_at..]
        .iter()
        .filter(|e| matches!(e, Event::Queued { .. }))
        .collect();
    assert!(
        queued_after.is_empty(),
        "messages sent before the cancel were queued after it (never released): {events:?}"
    );
    assert_eq!(
        events[..cancel_at].len(),
        5,
        "every message reached the owner before the cancel: {events:?}"
    );
}

/// `idle = "watch"`: a thread that finds a receiver asleep on its sockets tells the others
/// through the fabric, so that none parks while it sleeps (a message for it may have to cross
/// from another thread); the bit is cleared by that thread's next look once nobody waits.
#[test]
fn a_receiver_asleep_on_one_thread_keeps_every_thread_watching() {
    use shm_api::layout::RECV_WAITER;
    let mut rig = Rig::new();
    rig.app_with_socket(1, 0, 4000);
    let sleep = |core: &PollCore, asleep: bool| {
        core.table.for_each_sock(|_, _, ctl| {
            if asleep {
                ctl.waiters.fetch_add(RECV_WAITER, Ordering::SeqCst);
            } else {
                ctl.waiters.fetch_sub(RECV_WAITER, Ordering::SeqCst);
            }
        })
    };
    assert!(!rig.cores[0].receivers_waiting());
    assert!(!rig.cores[1].receivers_waiting());
    sleep(&rig.cores[1], true);
    assert!(
        !rig.cores[0].receivers_waiting(),
        "thread 1 has not looked yet"
    );
    assert!(rig.cores[1].receivers_waiting(), "its own receiver");
    assert!(rig.cores[0].receivers_waiting(), "thread 1's bit");
    sleep(&rig.cores[1], false);
    assert!(
        rig.cores[0].receivers_waiting(),
        "the bit stays until thread 1 looks again"
    );
    assert!(!rig.cores[1].receivers_waiting());
    assert!(!rig.cores[0].receivers_waiting());
}

/// A receiver H on thread 1 that reads nothing, fed by sender S on thread 0 with messages that
/// cross by copy: past H's ring its backlog grows to its share (64 KiB in unit tests), then H's
/// flag holds S's later messages on S's own tx ring, and the pair ring goes on (sender T's
/// message to H's neighbour arrives). Once H reads, S's messages all arrive, once and in order.
#[test]
fn a_backed_up_receiver_holds_up_its_senders_not_the_pair_ring() {
    backed_up_receiver(1);
}

/// The same with H on S's own thread: past H's ring its backlog grows to its share, then S
/// waits on its tx ring (before backlogs on one thread it waited at the full ring at once).
#[test]
fn a_backed_up_receiver_of_its_senders_thread_holds_up_only_them() {
    backed_up_receiver(0);
}

/// S and T on thread 0, H and its neighbour on thread `h_shard`.
fn backed_up_receiver(h_shard: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    const LEN: usize = 8 << 10;
    let mut rig = Rig::new();
    let (_, s_ring) = rig.app_with_socket(0, 0, 4000);
    let (_, t_ring) = rig.app_with_socket(0, 2, 4200);
    let (_, rx) = rig.app_with_sockets(h_shard, 1, &[4100, 4101]);
    let (mut h, mut o) = (
        shm_api::ring::Consumer::new(rx[0]),
        shm_api::ring::Consumer::new(rx[1]),
    );
    let mut s = Producer::new(s_ring);
    let msg = |seq: u32| {
        let mut m = vec![0u8; LEN];
        m[..4].copy_from_slice(&seq.to_le_bytes());
        m
    };
    // S fills its tx ring again and again, the threads take turns, H reads nothing.
    let mut sent = 0u32;
    for _ in 0..40 {
        while s
            .push(
                RecordHeader::data(LEN as u32, u32::from(LOCAL), 4100),
                &msg(sent),
            )
            .is_ok()
        {
            sent += 1;
        }
        s.publish();
        rig.cores[0].run_once();
        rig.cores[1].run_once();
    }
    let held = rig.cores[0].table.stats().tx_held_for_backlog.load(Relaxed);
    let parked = rig.cores[h_shard].table.stats().rx_backlogged.load(Relaxed);
    assert!(held > 0, "S never waited for H ({parked} parked)");
    // H's ring (2 MiB), its share and what was on its way when its flag rose: S's tx ring, not
    // the backlog, holds the rest.
    assert!(
        parked * (LEN as u64) < (64 << 10) + 2 * (64 * LEN as u64),
        "{parked} messages parked"
    );
    assert_eq!(
        rig.cores[h_shard]
            .table
            .stats()
            .rx_backlog_capped
            .load(Relaxed),
        0
    );
    // T's message to H's neighbour is not held up behind S's.
    let mut t = Producer::new(t_ring);
    t.push(RecordHeader::data(5, u32::from(LOCAL), 4101), b"other")
        .unwrap();
    t.publish();
    for _ in 0..3 {
        rig.cores[0].run_once();
        rig.cores[1].run_once();
    }
    let rec = o.peek().unwrap().expect("T's message past H's backlog");
    assert_eq!(rec.header.len, 5);
    // H reads: every message of S, once, in order.
    let mut next = 0u32;
    for _ in 0..2000 {
        while let Some(rec) = h.peek().unwrap() {
            let mut b = [0u8; 4];
            h.read_payload(&rec, &mut b);
            assert_eq!(u32::from_le_bytes(b), next, "once and in order");
            next += 1;
            h.consume(&rec);
        }
        h.release();
        rig.cores[0].run_once();
        rig.cores[1].run_once();
        if next == sent {
            break;
        }
    }
    assert_eq!(next, sent, "every message of S arrived");
}

/// A message crossing to another thread stays its sender's (SO_SNDBUF) until that thread takes
/// it off the pair ring, so a pair ring cannot absorb megabytes unseen; taken, it is in its
/// receiver's queue, its rx ring or, while that is full, its backlog, and its bytes are given
/// back either way, as the kernel's loopback does once a message is queued for its receiver.
#[test]
fn a_crossing_message_is_its_senders_until_the_other_thread_takes_it() {
    use std::sync::atomic::Ordering::{Acquire, Relaxed};
    const LEN: usize = 8 << 10;
    let mut rig = Rig::new();
    let (slot, s_ring) = rig.app_with_socket(0, 0, 4000);
    let _ = rig.app_with_sockets(1, 1, &[4100]);
    let released = |rig: &Rig| {
        rig.cores[0]
            .table
            .ctl(SockRef { app: 0, slot })
            .tx_released_bytes
            .load(Acquire)
    };
    let mut s = Producer::new(s_ring);
    let push_all = |s: &mut Producer<RawRing>| fill_tx_ring(s, 4100, &[7u8; LEN]);
    // Only the sender's thread runs: everything it took waits in the pair ring, still the
    // sender's.
    let first = push_all(&mut s);
    for _ in 0..3 {
        rig.cores[0].run_once();
    }
    assert_eq!(
        released(&rig),
        0,
        "released before the other thread took anything"
    );
    // The receiving thread takes them (its ring has room); the release notes come back.
    for _ in 0..10 {
        rig.cores[1].run_once();
        rig.cores[0].run_once();
    }
    assert_eq!(released(&rig), first * LEN as u64);
    // The receiver reads nothing: past its ring (2 MiB) the rest waits in its backlog, and
    // those bytes come back to the sender too.
    let mut sent = first;
    for _ in 0..20 {
        sent += push_all(&mut s);
        rig.cores[0].run_once();
        rig.cores[1].run_once();
        rig.cores[0].run_once();
    }
    let parked = rig.cores[1].table.stats().rx_backlogged.load(Relaxed);
    assert!(parked > 0, "nothing waited in the backlog ({sent} sent)");
    assert!(
        released(&rig) > 2 << 20,
        "only {} bytes released: the backlog's messages are still the sender's",
        released(&rig)
    );
}

/// Messages of 16 KiB and more cross in place: the pair ring carries references into the
/// sender's tx ring. A sender app that leaves before the receiving thread has taken them loses
/// none: its region stays mapped (Detach answers `None`, `regions_drained_late`) until that
/// thread has copied the last, whose release lets it go.
#[test]
fn an_app_that_leaves_with_references_in_the_pair_ring_loses_nothing() {
    use std::sync::atomic::Ordering::Relaxed;
    const LEN: usize = 32 << 10;
    let mut rig = Rig::new();
    let (_, s_ring) = rig.app_with_socket(0, 0, 4000);
    let (_, rx) = rig.app_with_sockets(1, 1, &[4100]);
    let mut s = Producer::new(s_ring);
    for i in 0..20u8 {
        s.push(
            RecordHeader::data(LEN as u32, u32::from(LOCAL), 4100),
            &[i; LEN],
        )
        .unwrap();
    }
    s.publish();
    rig.cores[0].run_once();
    let gone = rig.cmd(0, Cmd::Detach { app: 0 });
    assert!(
        matches!(gone, CmdReply::Detached(None)),
        "the region goes while references to it are in the pair ring"
    );
    assert_eq!(
        rig.cores[0]
            .table
            .stats()
            .regions_drained_late
            .load(Relaxed),
        1
    );
    for _ in 0..4 {
        rig.cores[1].run_once();
        rig.cores[0].run_once();
    }
    let mut h = shm_api::ring::Consumer::new(rx[0]);
    let mut buf = vec![0u8; LEN];
    for i in 0..20u8 {
        let rec = h.peek().unwrap().expect("every message arrived");
        assert_eq!(rec.header.len as usize, LEN);
        h.read_payload(&rec, &mut buf);
        assert!(buf.iter().all(|&b| b == i), "message {i} whole");
        h.consume(&rec);
    }
    rig.cores[0].table.assert_nothing_left(0);
}

/// `deliver` keeps the last binding it found: a port whose socket closed and that a socket
/// of another slot then bound gets the next message in the new socket (a stale binding would
/// name the closed slot, and the message would be dropped as sent to no socket). One poll
/// thread: the loopback path.
#[test]
fn a_port_bound_again_gets_its_messages_in_the_new_socket() {
    use std::sync::atomic::Ordering::Relaxed;
    let mut rig = Rig::with_shards(1);
    let (_, s_ring) = rig.app_with_socket(0, 0, 4000);
    // Slots 0, 1, 2 of app 1.
    let (socks, rx) = rig.app_with_sockets(0, 1, &[4100, 4101, 4102]);
    let mut s = Producer::new(s_ring);
    let mut send = |rig: &mut Rig, b: u8| {
        s.push(RecordHeader::data(1, u32::from(LOCAL), 4100), &[b])
            .unwrap();
        s.publish();
        rig.cores[0].run_once();
    };
    let read = |ring: RawRing| {
        let mut c = shm_api::ring::Consumer::new(ring);
        let mut got = Vec::new();
        while let Some(rec) = c.peek().unwrap() {
            let mut b = [0u8; 1];
            c.read_payload(&rec, &mut b);
            got.push(b[0]);
            c.consume(&rec);
        }
        c.release();
        got
    };
    send(&mut rig, 1);
    assert_eq!(read(rx[0]), vec![1]);
    // Slot 1 closes and opens again (the lowest free slot); then port 4100's socket (slot 0)
    // closes and slot 1 binds port 4100.
    rig.request(0, 1, Request::Close { slot: socks[1].0 });
    let slot = rig.request(0, 1, Request::SocketOpen) as u32;
    assert_eq!(slot, socks[1].0);
    rig.request(0, 1, Request::Close { slot: socks[0].0 });
    rig.request(
        0,
        1,
        Request::Bind {
            slot,
            addr: LOCAL,
            port: 4100,
        },
    );
    send(&mut rig, 2);
    assert_eq!(read(rx[1]), vec![2], "the message reached the new socket");
    assert_eq!(
        rig.cores[0].table.stats().drop_unbound_dest.load(Relaxed),
        0
    );
}

/// Where a message of the model goes: a socket of the model (app, socket), or the dead peer's
/// port `5000 + n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum To {
    Local(usize, usize),
    Remote(u16),
}

#[derive(Clone, Debug)]
enum Op {
    /// Socket `sock` of app `app` sends one message of `len` bytes: 16, 20 KiB (large enough
    /// to cross between threads in place, from the sender's tx ring) or 600 KiB (a receiver
    /// that does not read for four of them has a full rx ring, and what follows waits in its
    /// backlog).
    Send {
        app: usize,
        sock: usize,
        to: To,
        len: usize,
    },
    /// Poll thread `shard` (modulo the threads there are) makes `passes` passes.
    Run { shard: usize, passes: u8 },
    /// RDS_CANCEL_SENT_TO of the peer's port `5000 + port`.
    Cancel { app: usize, sock: usize, port: u16 },
    /// The app reads everything its socket has received.
    Read { app: usize, sock: usize },
    /// The app closes its socket: what it sent before is still delivered (or queued);
    /// what is on its way to it may be dropped.
    Close { app: usize, sock: usize },
    /// The app exits (detaches) with whatever it sent still on its way.
    Exit { app: usize },
    /// The peer sends one message to socket `sock` of app `app`.
    Arrive { app: usize, sock: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let to = prop_oneof![
        (0..2usize, 0..2usize).prop_map(|(a, s)| To::Local(a, s)),
        (0..2u16).prop_map(To::Remote),
    ];
    prop_oneof![
        24 => (0..2usize, 0..2usize, to, prop_oneof![5 => Just(16), 3 => Just(20 << 10), 2 => Just(1 << 20)])
            .prop_map(|(app, sock, to, len)| Op::Send { app, sock, to, len }),
        16 => (0..3usize, 1..4u8).prop_map(|(shard, passes)| Op::Run { shard, passes }),
        4 => (0..2usize, 0..2usize, 0..2u16).prop_map(|(app, sock, port)| Op::Cancel { app, sock, port }),
        8 => (0..2usize, 0..2usize).prop_map(|(app, sock)| Op::Read { app, sock }),
        1 => (0..2usize, 0..2usize).prop_map(|(app, sock)| Op::Close { app, sock }),
        1 => (0..2usize).prop_map(|app| Op::Exit { app }),
        6 => (0..2usize, 0..2usize).prop_map(|(app, sock)| Op::Arrive { app, sock }),
    ]
}

/// (app, socket) of the model; `PEER_SOCK` stands for the peer's port 5000.
type Sock = (usize, usize);
const PEER_SOCK: Sock = (0xee, 0);
/// What each receiver expects next from each sender: (sender, receiver) → number.
type Expected = std::collections::HashMap<(Sock, Sock), u32>;

const APPS: usize = 2;
const SOCKS: usize = 2;

fn port_of(app: usize, sock: usize) -> u16 {
    4000 + (app * SOCKS + sock) as u16
}

/// Two or three poll threads, app k on thread k (k < 2), two sockets each; random sends to
/// each other's sockets and to a dead peer (whose connection thread 0 owns with two threads,
/// thread 2, neither app's, with three), messages from the
/// peer, random passes of either thread, random RDS_CANCEL_SENT_TO, reads, closes and exits.
/// Checked against a model:
/// - local and from the peer: every message to a socket that stays open arrives once, in
///   order per (sender, receiver);
/// - remote, at the connection owner's transport: every message is queued at most once, in
///   order per (sender, destination); each cancel reaches it after every message its socket
///   sent before the cancel that reached it at all, and before every message sent after the
///   cancel; every message sent after a socket's last cancel to that port is queued.
#[test]
fn cross_thread_order_and_cancels_hold_against_a_model() {
    let config = ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    // Three threads: the connection's owner may be neither app's.
    // A hog: a socket that reads nothing until the end, so that its rx ring fills and what
    // follows for it waits in its backlog while the others go on.
    let hog = proptest::option::of((0..APPS, 0..SOCKS));
    proptest!(config, |(ops in proptest::collection::vec(op(), 1..300), shards in 2..4usize, hog in hog)| {
        run_model(&ops, shards, hog);
    });
}

fn run_model(ops: &[Op], shards: usize, hog: Option<Sock>) {
    let mut rig = Rig::with_shards(shards);
    let owner = rig.owner;
    let mut tx: Vec<Vec<(u32, Producer<RawRing>)>> = Vec::new();
    let mut rx: Vec<Vec<shm_api::ring::Consumer<RawRing>>> = Vec::new();
    for app in 0..APPS {
        let ports: Vec<u16> = (0..SOCKS).map(|s| port_of(app, s)).collect();
        let (socks, rxs) = rig.app_with_sockets(app, app, &ports);
        tx.push(
            socks
                .into_iter()
                .map(|(slot, r)| (slot, Producer::new(r)))
                .collect(),
        );
        rx.push(rxs.into_iter().map(shm_api::ring::Consumer::new).collect());
    }
    // The model: each socket numbers its messages; what each receiver expects next from each
    // sender; what each sender sent to each destination; the cancels (sender, port, the
    // sender's next number when it cancelled).
    let mut next_seq = [[0u32; SOCKS]; APPS];
    let mut expect = Expected::default();
    let mut sent: std::collections::HashMap<(Sock, To), Vec<u32>> = Default::default();
    let mut cancels: Vec<(Sock, u16, u32)> = Vec::new();
    let mut closed = [[false; SOCKS]; APPS];
    let mut peer_seq = 0u32;
    let read = |rx: &mut Vec<Vec<shm_api::ring::Consumer<RawRing>>>,
                expect: &mut Expected,
                app: usize,
                sock: usize| {
        let c = &mut rx[app][sock];
        let mut took = false;
        while let Some(rec) = c.peek().expect("a sound rx ring") {
            let mut b = [0u8; 6];
            c.read_payload(&rec, &mut b);
            let (from, seq) = (
                (b[0] as usize, b[1] as usize),
                u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
            );
            let port = if from == PEER_SOCK {
                5000
            } else {
                port_of(from.0, from.1)
            };
            assert_eq!(rec.header.port, port, "the sender's port");
            let e = expect.entry((from, (app, sock))).or_insert(0);
            assert!(
                seq >= *e,
                "{from:?} -> {:?}: message {seq} again or out of order (expected {})",
                (app, sock),
                *e
            );
            // Numbers are per sender: those to other destinations are skipped.
            *e = seq + 1;
            c.consume(&rec);
            took = true;
        }
        if took {
            c.release();
        }
    };
    for op in ops {
        let (Op::Send { app, sock, .. }
        | Op::Cancel { app, sock, .. }
        | Op::Read { app, sock }
        | Op::Close { app, sock }) = *op
        else {
            match *op {
                Op::Run { shard, passes } => {
                    for _ in 0..passes {
                        rig.cores[shard % shards].run_once();
                    }
                }
                Op::Arrive { app, sock } => {
                    let seq = peer_seq;
                    peer_seq += 1;
                    let mut payload = vec![0u8; 16];
                    payload[0] = PEER_SOCK.0 as u8;
                    payload[2..6].copy_from_slice(&seq.to_le_bytes());
                    rig.arrivals
                        .lock()
                        .unwrap()
                        .push_back((port_of(app, sock), payload));
                    sent.entry((PEER_SOCK, To::Local(app, sock)))
                        .or_default()
                        .push(seq);
                }
                Op::Exit { app } if !closed[app].contains(&false) => {}
                Op::Exit { app } => {
                    let gone = rig.cmd(app, Cmd::Detach { app });
                    assert!(matches!(gone, CmdReply::Detached(_)));
                    closed[app] = [true; SOCKS];
                }
                _ => unreachable!(),
            }
            continue;
        };
        if closed[app][sock] {
            continue; // a closed socket does nothing more
        }
        match *op {
            Op::Send { app, sock, to, len } => {
                let seq = next_seq[app][sock];
                let (addr, port) = match to {
                    To::Local(a, s) => (LOCAL, port_of(a, s)),
                    To::Remote(p) => (PEER, 5000 + p),
                };
                let mut payload = vec![0u8; len];
                payload[0] = app as u8;
                payload[1] = sock as u8;
                payload[2..6].copy_from_slice(&seq.to_le_bytes());
                let p = &mut tx[app][sock].1;
                let h = RecordHeader::data(payload.len() as u32, u32::from(addr), port);
                if p.push(h, &payload).is_ok() {
                    p.publish();
                    next_seq[app][sock] += 1;
                    sent.entry(((app, sock), to)).or_default().push(seq);
                }
            }
            Op::Run { .. } | Op::Exit { .. } | Op::Arrive { .. } => unreachable!("above"),
            Op::Cancel { app, sock, port } => {
                let req = Request::CancelSentTo {
                    slot: tx[app][sock].0,
                    dest: Some((PEER, 5000 + port)),
                };
                if rig.try_request(app, app, req).is_ok() {
                    cancels.push(((app, sock), port, next_seq[app][sock]));
                }
            }
            Op::Read { app, sock } if hog == Some((app, sock)) => {}
            Op::Read { app, sock } => read(&mut rx, &mut expect, app, sock),
            Op::Close { app, sock } => {
                let slot = tx[app][sock].0;
                rig.request(app, app, Request::Close { slot });
                closed[app][sock] = true;
            }
        }
    }
    // Let everything settle (a hog's backlog may hold many rings' worth).
    for _ in 0..200 {
        for core in rig.cores.iter_mut() {
            core.run_once();
        }
        for (app, socks) in closed.iter().enumerate() {
            for (sock, &gone) in socks.iter().enumerate() {
                if !gone {
                    read(&mut rx, &mut expect, app, sock);
                }
            }
        }
    }
    for core in &rig.cores {
        assert!(
            !core.table.has_backlog(),
            "every backlog was delivered or dropped"
        );
    }
    // Local: everything arrived (in order and once was checked as it came).
    for (&(from, to), seqs) in &sent {
        if let To::Local(a, s) = to {
            if closed[a][s] {
                continue; // what was on its way to it may be dropped
            }
            let got = expect.get(&(from, (a, s))).copied().unwrap_or(0);
            let last = *seqs.last().unwrap();
            assert_eq!(
                got,
                last + 1,
                "{from:?} -> {to:?}: the last message {last} arrived"
            );
        }
    }
    // Remote, at the owner.
    let events = rig.events(owner);
    let mut queued_at: std::collections::HashMap<(Sock, u16, u32), usize> = Default::default();
    let mut cancel_at: std::collections::HashMap<(Sock, u16), Vec<usize>> = Default::default();
    let src_of = |sport: u16| {
        let i = (sport - 4000) as usize;
        (i / SOCKS, i % SOCKS)
    };
    for (i, e) in events.iter().enumerate() {
        match *e {
            Event::Queued { sport, dport, tag } => {
                let from = src_of(sport);
                assert_eq!((tag[0] as usize, tag[1] as usize), from);
                let seq = u32::from_le_bytes([tag[2], tag[3], tag[4], tag[5]]);
                let prev = queued_at.insert((from, dport - 5000, seq), i);
                assert!(
                    prev.is_none(),
                    "{from:?} message {seq} queued twice: {events:?}"
                );
            }
            // Every destination: an app that exits with messages held in place.
            Event::Cancel { dest: None, .. } => {}
            Event::Cancel {
                sport,
                dest: Some((_, dport)),
            } => {
                cancel_at
                    .entry((src_of(sport), dport - 5000))
                    .or_default()
                    .push(i);
            }
        }
    }
    let mut nth: std::collections::HashMap<(Sock, u16), usize> = Default::default();
    for &(from, port, upto) in &cancels {
        let n = nth.entry((from, port)).or_insert(0);
        let at = cancel_at[&(from, port)][*n];
        *n += 1;
        for (&(f, p, seq), &q) in &queued_at {
            if (f, p) != (from, port) {
                continue;
            }
            if seq < upto {
                assert!(
                    q < at,
                    "{from:?} message {seq}, sent before a cancel, queued after it: {events:?}"
                );
            } else {
                assert!(
                    q > at,
                    "{from:?} message {seq}, sent after a cancel, queued before it: {events:?}"
                );
            }
        }
    }
    for (&(from, to), seqs) in &sent {
        let To::Remote(port) = to else { continue };
        let after = cancels
            .iter()
            .filter(|c| (c.0, c.1) == (from, port))
            .map(|c| c.2)
            .max()
            .unwrap_or(0);
        let mut last_q = None;
        for &seq in seqs {
            let q = queued_at.get(&(from, port, seq)).copied();
            if seq >= after {
                assert!(
                    q.is_some(),
                    "{from:?} message {seq} to port {port} was lost: {events:?}"
                );
            }
            if let Some(q) = q {
                assert!(
                    last_q.is_none_or(|l| l < q),
                    "{from:?} to {port}: out of order: {events:?}"
                );
                last_q = Some(q);
            }
        }
    }
}

/// Credit for group copies across threads (`group_credit.rs`): a member M of thread 1 in a
/// group that thread 0 orders gets room kept in its rx ring as soon as it joins. A local
/// sender T of thread 1 then fills M's ring with unicast while M reads nothing: the unicast
/// stops short of the kept room (the rest waits in M's backlog, then on T's ring), and S's
/// group messages from thread 0 all fit in it: no copy waits on thread 1 and every fan-out
/// commits. Without the kept room each copy found the ring full and waited, and with the
/// first one every later fan-out of every group. When M leaves, thread 0 gives the room back.
/// And the fan-outs need not wait for each other's commit: up to `GATES` at once.
#[test]
fn a_member_of_another_thread_keeps_room_for_the_groups_copies() {
    use crate::poll::table::CREDIT_CHUNK;
    use std::sync::atomic::Ordering::Relaxed;
    let g = Ipv4Addr::new(239, 9, 9, 9);
    let mut rig = Rig::new();
    let (s_slot, s_ring) = rig.app_with_socket(0, 0, 4000);
    rig.request(
        0,
        0,
        Request::GroupCreate {
            slot: s_slot,
            addr: g,
            port: 7000,
            flags: 0,
        },
    );
    let (t_slot_ring, rx) = rig.app_with_sockets(1, 1, &[4100, 4200]);
    let (m_slot, t_ring) = (t_slot_ring[0].0, t_slot_ring[1].1);
    let mut m = shm_api::ring::Consumer::new(rx[0]);
    // SO_RCVBUF above the ring: M is never congested, only full.
    let big = Request::SetRcvBuf {
        slot: m_slot,
        bytes: 1 << 30,
    };
    rig.request(1, 1, big);
    // M's join goes to thread 0 (which answers it) as a note; thread 1 keeps room once asked.
    let join = Request::GroupJoin {
        slot: m_slot,
        addr: g,
        port: 7000,
        flags: 0,
        update: false,
    };
    rig.group_request(1, 1, join);
    let m_ref = SockRef {
        app: 1,
        slot: m_slot,
    };
    let reserved = |rig: &mut Rig| rig.cores[1].table.sock(m_ref).unwrap().group_reserved;
    assert_eq!(reserved(&mut rig), CREDIT_CHUNK, "room kept at the join");
    let asks = rig.cores[0].table.stats().group_credit_asks.load(Relaxed);
    assert_eq!(asks, 0, "the join brought its credit along");
    assert_eq!(
        rig.cores[0].table.group_remote_credit(m_ref),
        Some(CREDIT_CHUNK)
    );
    // T fills M's ring with unicast (8 KiB each) until T is held.
    const LEN: usize = 8 << 10;
    let mut t = Producer::new(t_ring);
    let mut unicast = 0u32;
    for _ in 0..400 {
        unicast += fill_tx_ring(&mut t, 4100, &[1u8; LEN]) as u32;
        rig.cores[1].run_once();
        rig.cores[0].run_once();
    }
    let t1 = rig.cores[1].table.stats();
    assert!(
        t1.tx_held_for_backlog.load(Relaxed) > 0,
        "T held ({unicast} sent)"
    );
    // S sends 30 group messages of 8 KiB (charged 2 records each: about 490 KiB).
    let mut s = Producer::new(s_ring);
    for i in 0..30u32 {
        let mut msg = vec![0u8; LEN];
        msg[..4].copy_from_slice(&i.to_le_bytes());
        s.push(RecordHeader::data(LEN as u32, u32::from(g), 7000), &msg)
            .unwrap();
    }
    s.publish();
    // A fan-out with a copy on the other thread commits a thread round trip later (a round of
    // passes); up to `GATES` of them are uncommitted at once, so the 30 take a few rounds, not
    // 30 (one fan-out per round before the gates per slot).
    let mut rounds = 0;
    while rig.cores[0].table.stats().group_sends.load(Relaxed) < 30 && rounds < 100 {
        rig.cores[0].run_once();
        rig.cores[1].run_once();
        rounds += 1;
    }
    assert!(
        rounds <= 30usize.div_ceil(shm_api::gate::GATES) + 2,
        "{rounds} rounds"
    );
    for _ in 0..3 {
        rig.cores[0].run_once();
        rig.cores[1].run_once();
    }
    let (t0, t1) = (rig.cores[0].table.stats(), rig.cores[1].table.stats());
    assert_eq!(
        t0.group_sends.load(Relaxed),
        30,
        "every fan-out decided: blocked {}, asks {}, grants {}, reserved {}",
        t0.group_blocked.load(Relaxed),
        t0.group_credit_asks.load(Relaxed),
        t1.group_credit_grants.load(Relaxed),
        rig.cores[1]
            .table
            .sock(SockRef {
                app: 1,
                slot: m_slot
            })
            .unwrap()
            .group_reserved
    );
    assert_eq!(t1.group_copies_waited.load(Relaxed), 0, "every copy fitted");
    // M's ring: the unicast first, then the 30 copies, all committed.
    let (mut uni, mut copies) = (0u32, 0u32);
    for _ in 0..400 {
        while let Some(rec) = m.peek().unwrap() {
            if rec.header.flags & shm_api::layout::RX_FLAG_GROUP != 0 {
                let mut b = [0u8; 4];
                m.read_payload(&rec, &mut b);
                assert_eq!(u32::from_le_bytes(b), copies, "the group's order");
                copies += 1;
            } else {
                uni += 1;
            }
            m.consume(&rec);
        }
        m.release();
        rig.cores[0].run_once();
        rig.cores[1].run_once();
        if uni == unicast && copies == 30 {
            break;
        }
    }
    assert_eq!((uni, copies), (unicast, 30));
    // M leaves: thread 0 gives its credit back, and thread 1 keeps nothing for it.
    let leave = Request::GroupLeave {
        slot: m_slot,
        addr: g,
        port: 7000,
    };
    rig.group_request(1, 1, leave);
    assert_eq!(reserved(&mut rig), 0, "the room given back");
}

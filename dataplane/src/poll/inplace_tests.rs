//! The poll core with a zero-copy transport: ring space held until release, out-of-order
//! releases, slot pinning after close, and a region kept mapped after its app went; and which
//! tx rings a pass takes from.

use super::*;
use crate::config::{HugepageMode, Overrides};
use crate::seam::{Delivered, Incoming, SendOutcome, Upcalls};
use shm_api::ring::{Producer, PushError, RawRing, RecordHeader};
use std::sync::Mutex;

/// What the fake transport saw, shared with the test.
#[derive(Default)]
struct Seen {
    /// (token, payload address, length, offered in place)
    msgs: Vec<(u64, usize, usize, bool)>,
    /// Tokens the test wants released on the next poll: (token, len).
    to_release: Vec<(u64, u64)>,
    attached: Vec<(u64, usize, usize)>,
    detached: Vec<u64>,
    cancels: Vec<(u32, u16)>,
    /// Messages the test wants delivered on the next poll, as one network read: (port, payload).
    to_deliver: Vec<(u16, Vec<u8>)>,
    /// (rx_publishes, app_wakeups) after that read's `publish_deliveries`, then after its
    /// `wake_receivers`.
    at_publish: Option<(u64, u64)>,
    at_wake: Option<(u64, u64)>,
}

/// Takes every message in place (when offered) and releases what the test says; delivers what
/// the test says as a network transport does (deliver, publish, record, wake).
struct FakeZeroCopy(Arc<Mutex<Seen>>, Arc<Stats>);

impl Transport for FakeZeroCopy {
    fn name(&self) -> &'static str {
        "fake-zc"
    }
    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        dest.octets()[0] == 10
    }
    fn zero_copy(&self) -> bool {
        true
    }
    fn send(&mut self, _up: &mut dyn Upcalls, m: OutMsg<'_>) -> SendOutcome {
        let mut s = self.0.lock().unwrap();
        s.msgs.push((
            m.token,
            m.payload.as_ptr() as usize,
            m.payload.len(),
            m.in_place.is_some(),
        ));
        if m.in_place.is_some() {
            SendOutcome::QueuedInPlace
        } else {
            SendOutcome::Queued
        }
    }
    fn poll(&mut self, up: &mut dyn Upcalls) -> usize {
        let todo = std::mem::take(&mut self.0.lock().unwrap().to_release);
        for (t, len) in &todo {
            up.release(*t, *len);
        }
        let read = std::mem::take(&mut self.0.lock().unwrap().to_deliver);
        for (port, payload) in &read {
            let m = Incoming {
                laddr: u32::from(Ipv4Addr::new(10, 0, 0, 1)),
                faddr: u32::from(Ipv4Addr::new(10, 0, 0, 2)),
                sport: 5000,
                dport: *port,
                payload: MsgBytes::from_slice(payload),
            };
            assert_eq!(up.deliver(m), Delivered::Yes);
        }
        if !read.is_empty() {
            let counts = || {
                (
                    self.1.rx_publishes.load(Ordering::Relaxed),
                    self.1.app_wakeups.load(Ordering::Relaxed),
                )
            };
            up.publish_deliveries();
            self.0.lock().unwrap().at_publish = Some(counts());
            up.wake_receivers();
            self.0.lock().unwrap().at_wake = Some(counts());
        }
        todo.len() + read.len()
    }
    fn region_attached(&mut self, id: u64, base: *const u8, len: usize) {
        self.0
            .lock()
            .unwrap()
            .attached
            .push((id, base as usize, len));
    }
    fn region_detached(&mut self, id: u64) {
        self.0.lock().unwrap().detached.push(id);
    }
    fn cancel(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        assert!(dest.is_none());
        self.0.lock().unwrap().cancels.push((laddr, sport));
    }
}

struct Rig {
    core: PollCore,
    chans: Arc<Channels>,
    seen: Arc<Mutex<Seen>>,
    seq: u64,
    _dir: std::path::PathBuf,
}

/// The configuration of a test poll core: local address 10.0.0.1, no hugepages, 4 sockets per
/// app, `poll_threads` poll threads, its state file in a directory of its own (returned, to
/// keep) named by `tag`, the process and the test thread.
pub(super) fn test_config(tag: &str, poll_threads: usize) -> (Arc<Config>, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "rdsd-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let over = Overrides {
        state_file: Some(dir.join("state")),
        local_addrs: vec!["10.0.0.1/32".into()],
        hugepages: Some(HugepageMode::Off),
        max_sockets_per_app: Some(4),
        poll_cores: vec![-2; poll_threads],
        // Small, so that the model of `shard_tests` meets it often.
        backlog_share: Some(64 << 10),
        ..Default::default()
    };
    (Arc::new(Config::load(None, &over).unwrap()), dir)
}

/// A fresh app region of the test configuration's geometry (4 sockets, 4 KiB pages).
pub(super) fn test_region() -> AppRegion {
    let over = Overrides {
        max_sockets_per_app: Some(4),
        ..Default::default()
    };
    let cfg = Config::load(None, &over).unwrap();
    AppRegion::create("rdsd-poll-test", cfg.geometry(), HugepageMode::Off).unwrap()
}

impl Rig {
    fn new() -> Rig {
        let (cfg, dir) = test_config("inplace", 1);
        let stats = Arc::new(Stats::default());
        let daemon = Arc::new(DaemonRegion::create(false).unwrap());
        let chans = Arc::new(Channels::new(cfg.max_apps as usize));
        // SAFETY: eventfd with valid flags; the fd is owned from here on.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(wake >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake) });
        let seen = Arc::new(Mutex::new(Seen::default()));
        let t: Box<dyn Transport> = Box::new(FakeZeroCopy(seen.clone(), stats.clone()));
        let core = PollCore::new(cfg, stats, daemon, chans.clone(), wake, vec![t]);
        Rig {
            core,
            chans,
            seen,
            seq: 0,
            _dir: dir,
        }
    }

    fn cmd(&mut self, cmd: Cmd) -> CmdReply {
        self.seq += 1;
        let seq = self.seq;
        if !matches!(cmd, Cmd::Detach { .. }) {
            self.chans.arm(cmd.app(), seq);
        }
        assert!(self.chans.cmds[0].push((seq, cmd)).is_ok());
        self.core.run_once();
        let (s, _, reply) = self.chans.replies.pop().expect("an answer");
        assert_eq!(s, seq);
        reply
    }

    fn request(&mut self, app: usize, req: Request) -> u64 {
        match self.cmd(Cmd::Request {
            app,
            req,
            readiness: None,
        }) {
            CmdReply::Reply(r) => {
                assert_eq!(r.errno, 0, "request failed");
                r.value
            }
            _ => panic!("not a reply"),
        }
    }

    /// Attaches app `app`; returns its region's base and the tx rings of its 4 slots.
    fn attach(&mut self, app: usize) -> Vec<RawRing> {
        self.attach_as(app, 1000)
    }

    fn attach_as(&mut self, app: usize, uid: u32) -> Vec<RawRing> {
        let region = test_region();
        let rings = (0..4).map(|s| region.tx_ring(s)).collect();
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let reply = self.cmd(Cmd::Attach {
            app,
            region,
            doorbell: a.into(),
            uid,
        });
        assert!(matches!(reply, CmdReply::Attached));
        rings
    }

    fn open_bound(&mut self, app: usize, port: u16) -> u32 {
        let slot = self.request(app, Request::SocketOpen) as u32;
        self.request(
            app,
            Request::Bind {
                slot,
                addr: Ipv4Addr::new(10, 0, 0, 1),
                port,
            },
        );
        slot
    }
}

fn push(p: &mut Producer<RawRing>, len: usize, fill: u8) -> Result<(), PushError> {
    let r = p.push(
        RecordHeader::data(len as u32, u32::from(Ipv4Addr::new(10, 0, 0, 2)), 5000),
        &vec![fill; len],
    );
    p.publish();
    r
}

/// Reads `len` bytes at `addr` (a held record in the test's own mapping).
fn bytes_at(addr: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: the region is mapped for the test's duration and the record is held (nobody
    // writes it); a raw copy into our own buffer.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), len) };
    v
}

#[test]
fn ring_space_stays_held_until_each_in_place_message_is_released() {
    let mut rig = Rig::new();
    let rings = rig.attach(0);
    assert_eq!(
        rig.seen.lock().unwrap().attached.len(),
        1,
        "registered at attach"
    );
    let slot = rig.open_bound(0, 4000);
    let mut p = Producer::new(rings[slot as usize]);
    // Fill the ring with 64 KiB messages, each with its own byte.
    let len = 64 * 1024;
    let mut n = 0u8;
    while push(&mut p, len, n).is_ok() {
        n += 1;
        rig.core.run_once();
    }
    rig.core.run_once();
    let msgs = rig.seen.lock().unwrap().msgs.clone();
    assert_eq!(msgs.len(), n as usize);
    assert!(msgs.iter().all(|m| m.3), "every message offered in place");
    assert!(n >= 4, "{n} messages fit");
    // Everything was consumed, nothing released: the ring stays full for the app.
    for _ in 0..3 {
        rig.core.run_once();
        assert_eq!(push(&mut p, len, 0xee), Err(PushError::Full));
    }
    // The held bytes are intact where the transport reads them.
    for (i, m) in msgs.iter().enumerate() {
        assert!(
            bytes_at(m.1, m.2).iter().all(|&b| b == i as u8),
            "message {i}"
        );
    }
    // Out of order: the second message is released first. Send-buffer bytes come back, but
    // no ring space (the first still pins the oldest record).
    let ctl = |rig: &Rig| {
        rig.core
            .table
            .ctl(SockRef { app: 0, slot })
            .tx_released_bytes
            .load(Ordering::Acquire)
    };
    rig.seen
        .lock()
        .unwrap()
        .to_release
        .push((msgs[1].0, len as u64));
    rig.core.run_once();
    assert_eq!(ctl(&rig), len as u64);
    assert_eq!(push(&mut p, len, 0xee), Err(PushError::Full));
    // Now the first: two records' space comes back, enough for one more message.
    rig.seen
        .lock()
        .unwrap()
        .to_release
        .push((msgs[0].0, len as u64));
    rig.core.run_once();
    assert_eq!(ctl(&rig), 2 * len as u64);
    push(&mut p, len, 0xaa).expect("space released");
    // The third message, still held, was not overwritten by the new one.
    assert!(bytes_at(msgs[2].1, len).iter().all(|&b| b == 2));
    assert_eq!(
        rig.core.table.stats().tx_in_place.load(Ordering::Relaxed),
        n as u64
    );
}

#[test]
fn a_closed_sockets_slot_and_a_gone_apps_region_wait_for_their_releases() {
    let mut rig = Rig::new();
    let rings = rig.attach(0);
    let slot = rig.open_bound(0, 4000);
    let mut p = Producer::new(rings[slot as usize]);
    push(&mut p, 100, 7).unwrap();
    rig.core.run_once();
    let token = rig.seen.lock().unwrap().msgs[0].0;
    // Close it: its slot is pinned by the held message, so the next socket gets another.
    rig.request(0, Request::Close { slot });
    let other = rig.request(0, Request::SocketOpen) as u32;
    assert_ne!(other, slot, "a pinned slot is not reused");
    // The app goes: its region is kept (not handed back) while the message is out.
    match rig.cmd(Cmd::Detach { app: 0 }) {
        CmdReply::Detached(r) => assert!(r.is_none(), "the region must stay mapped"),
        _ => panic!("not a detach reply"),
    }
    assert_eq!(rig.core.table.draining_count(), 1);
    assert!(rig.seen.lock().unwrap().detached.is_empty());
    // A new app may take the index meanwhile.
    let _rings2 = rig.attach(0);
    // The last release unmaps the old region and tells the transport.
    rig.seen.lock().unwrap().to_release.push((token, 100));
    rig.core.run_once();
    rig.core.run_once();
    assert_eq!(rig.core.table.draining_count(), 0);
    let s = rig.seen.lock().unwrap();
    assert_eq!(s.detached, vec![s.attached[0].0]);
}

/// Apps of `uids`, in turn, each leave with one message in place still out; returns which of
/// them had it cancelled (caps: `all` regions draining, `of_uid` of one uid).
fn leave_with_messages_out(all: usize, of_uid: usize, uids: &[u32]) -> Vec<bool> {
    let mut rig = Rig::new();
    rig.core.table.set_drain_caps(all, of_uid);
    let mut cancelled = Vec::new();
    for (k, &uid) in uids.iter().enumerate() {
        let rings = rig.attach_as(0, uid);
        let port = 4000 + k as u16;
        let slot = rig.open_bound(0, port);
        let mut p = Producer::new(rings[slot as usize]);
        push(&mut p, 100, 1).unwrap();
        rig.core.run_once();
        match rig.cmd(Cmd::Detach { app: 0 }) {
            CmdReply::Detached(r) => assert!(r.is_none(), "kept mapped while the message is out"),
            _ => panic!("not a detach reply"),
        }
        let mut s = rig.seen.lock().unwrap();
        let me = (u32::from(Ipv4Addr::new(10, 0, 0, 1)), port);
        cancelled.push(s.cancels.contains(&me));
        s.cancels.clear();
    }
    let cancels = cancelled.iter().filter(|&&c| c).count() as u64;
    assert_eq!(
        rig.core.table.stats().drain_cancels.load(Ordering::Relaxed),
        cancels
    );
    cancelled
}

#[test]
fn past_max_draining_a_departing_apps_in_place_messages_are_cancelled() {
    // Three may drain in all: the fourth app's message is cancelled, whatever its uid.
    assert_eq!(
        leave_with_messages_out(3, 100, &[1000, 1001, 1002, 1003]),
        [false, false, false, true]
    );
}

#[test]
fn past_its_uids_share_a_departing_apps_in_place_messages_are_cancelled() {
    // Two of one uid may drain: its third is cancelled, another uid's and root's are not.
    assert_eq!(
        leave_with_messages_out(100, 2, &[1000, 1000, 1000, 1001, 0, 0, 0]),
        [false, false, true, false, false, false, false]
    );
}

/// A pass takes only from the tx rings whose app published since the last pass (one load per
/// open socket finds them), and comes back to a ring it left records on.
#[test]
fn a_pass_takes_only_from_rings_with_news() {
    let mut rig = Rig::new();
    let rings = rig.attach(0);
    let slots: Vec<u32> = (0..3).map(|k| rig.open_bound(0, 4000 + k)).collect();
    let mut producers: Vec<_> = slots
        .iter()
        .map(|&s| Producer::new(rings[s as usize]))
        .collect();
    let at = |rig: &Rig, slot: u32| {
        (0..3)
            .find(|&i| rig.core.table.open_sock_at(i) == Some(SockRef { app: 0, slot }))
            .expect("open")
    };
    let taken = |rig: &Rig| rig.seen.lock().unwrap().msgs.len();
    assert_eq!(rig.core.table.next_published(0), None, "nothing sent yet");

    push(&mut producers[1], 8, 1).unwrap();
    let i1 = at(&rig, slots[1]);
    assert_eq!(
        rig.core.table.next_published(0),
        Some((
            i1,
            SockRef {
                app: 0,
                slot: slots[1]
            }
        ))
    );
    rig.core.run_once();
    assert_eq!(taken(&rig), 1);
    assert_eq!(
        rig.core.table.next_published(0),
        None,
        "seen after the drain"
    );

    // Pushed but not published: nothing to see yet.
    producers[0]
        .push(
            RecordHeader::data(8, u32::from(Ipv4Addr::new(10, 0, 0, 2)), 5000),
            &[0; 8],
        )
        .unwrap();
    assert_eq!(rig.core.table.next_published(0), None);
    producers[0].publish();
    push(&mut producers[2], 8, 2).unwrap();
    let (i0, i2) = (at(&rig, slots[0]), at(&rig, slots[2]));
    let first = rig
        .core
        .table
        .next_published(0)
        .expect("two rings with news")
        .0;
    assert_eq!(first, i0.min(i2));
    assert_eq!(
        rig.core.table.next_published(first + 1).map(|x| x.0),
        Some(i0.max(i2))
    );
    rig.core.run_once();
    assert_eq!(taken(&rig), 3);
    assert_eq!(rig.core.table.next_published(0), None);

    // More than one burst: the pass leaves records, and the next pass comes back for them.
    for k in 0..TX_BATCH + 5 {
        producers[1]
            .push(
                RecordHeader::data(8, u32::from(Ipv4Addr::new(10, 0, 0, 2)), 5000),
                &[k as u8; 8],
            )
            .unwrap();
    }
    producers[1].publish();
    rig.core.run_once();
    assert_eq!(taken(&rig), 3 + TX_BATCH);
    assert_eq!(
        rig.core.table.next_published(0).map(|x| x.0),
        Some(i1),
        "records left behind are news"
    );
    rig.core.run_once();
    assert_eq!(taken(&rig), 3 + TX_BATCH + 5);
    assert_eq!(rig.core.table.next_published(0), None);
    for _ in 0..3 {
        rig.core.run_once();
    }
    assert_eq!(taken(&rig), 3 + TX_BATCH + 5, "no message taken twice");
}

/// A network read's deliveries become readable at `publish_deliveries` without waking anyone
/// (stores only), and their blocked receivers are woken at `wake_receivers`: the transport
/// records the deliveries in between, so a SIGKILL in the wake-up's syscall finds them
/// recorded (`endpoint::record_delivered`).
#[test]
fn a_publish_wakes_nobody_until_the_transport_says() {
    let mut rig = Rig::new();
    let _rings = rig.attach(0);
    let slot = rig.open_bound(0, 4000);
    let to = SockRef { app: 0, slot };
    // A receiver blocked in recv.
    rig.core
        .table
        .ctl(to)
        .waiters
        .fetch_or(shm_api::layout::RECV_WAITERS, Ordering::SeqCst);
    rig.seen.lock().unwrap().to_deliver = vec![(4000, vec![1; 64]), (4000, vec![2; 64])];
    rig.core.run_once();
    let s = rig.seen.lock().unwrap();
    assert_eq!(s.at_publish, Some((1, 0)), "published once, nobody woken");
    assert_eq!(s.at_wake, Some((1, 1)), "woken at wake_receivers");
    drop(s);
    assert_eq!(
        rig.core
            .table
            .ctl(to)
            .rx_produced_bytes
            .load(Ordering::Acquire),
        128
    );
}

//! Two poll threads in one test thread, stepped by hand: the order in which one shard's
//! messages and requests reach the shard that owns their connection.

use super::*;
use crate::config::{HugepageMode, Overrides};
use crate::seam::Upcalls;
use shm_api::ring::{Producer, RawRing, RecordHeader};
use std::sync::Mutex;

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

/// What a shard's network transport was asked, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    /// A message queued (never acknowledged: the peer is dead), by its first payload byte.
    Queued { sport: u16, tag: u8 },
    /// RDS_CANCEL_SENT_TO reached the transport.
    Cancel {
        sport: u16,
        dest: Option<(u32, u16)>,
    },
}

/// A network transport to a peer that never answers: it queues every message and forgets
/// those a cancel names (each shard has one, as with kernel TCP on every poll thread).
struct DeadPeer {
    shard: usize,
    log: Arc<Mutex<Vec<(usize, Event)>>>,
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
        let e = Event::Queued {
            sport: m.sport,
            tag: bytes[0],
        };
        self.log.lock().unwrap().push((self.shard, e));
        SendOutcome::Queued
    }
    fn poll(&mut self, _up: &mut dyn Upcalls) -> usize {
        0
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
    seq: u64,
    _dir: std::path::PathBuf,
}

impl Rig {
    fn new() -> Rig {
        let dir = std::env::temp_dir().join(format!(
            "rdsd-shards-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let over = Overrides {
            state_file: Some(dir.join("state")),
            local_addrs: vec!["10.0.0.1/32".into()],
            hugepages: Some(HugepageMode::Off),
            max_sockets_per_app: Some(4),
            poll_cores: vec![-1, -1],
            ..Default::default()
        };
        let cfg = Arc::new(Config::load(None, &over).unwrap());
        assert_eq!(cfg.net_shards(), 2, "every shard owns some connections");
        let daemon = Arc::new(DaemonRegion::create(false).unwrap());
        let chans = Arc::new(Channels::with_shards(cfg.max_apps as usize, 2));
        let doorbells = (0..2)
            .map(|_| Arc::new(shm_api::sys::eventfd().unwrap()))
            .collect();
        let fabric = Arc::new(shard::Fabric::new(doorbells, daemon.view(), None));
        let wake = Arc::new(shm_api::sys::eventfd().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let cores = (0..2)
            .map(|k| {
                let t: Box<dyn Transport> = Box::new(DeadPeer {
                    shard: k,
                    log: log.clone(),
                });
                PollCore::shard(
                    cfg.clone(),
                    Arc::new(Stats::default()),
                    daemon.clone(),
                    chans.clone(),
                    wake.clone(),
                    vec![t],
                    fabric.clone(),
                    k,
                )
            })
            .collect();
        Rig {
            cores,
            chans,
            log,
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
        match self.cmd(
            k,
            Cmd::Request {
                app,
                req,
                readiness: None,
            },
        ) {
            CmdReply::Reply(r) => {
                assert_eq!(r.errno, 0, "{req:?} failed");
                r.value
            }
            _ => panic!("not a reply"),
        }
    }

    /// App `app` on shard `k` with one socket bound at `LOCAL:port`: its tx ring.
    fn app_with_socket(&mut self, k: usize, app: usize, port: u16) -> (u32, RawRing) {
        let cfg = Config::load(
            None,
            &Overrides {
                max_sockets_per_app: Some(4),
                ..Default::default()
            },
        )
        .unwrap();
        let region =
            AppRegion::create("rdsd-shards-test", cfg.geometry(), HugepageMode::Off).unwrap();
        let rings: Vec<RawRing> = (0..4).map(|s| region.tx_ring(s)).collect();
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
        let slot = self.request(k, app, Request::SocketOpen) as u32;
        let bind = Request::Bind {
            slot,
            addr: LOCAL,
            port,
        };
        self.request(k, app, bind);
        (slot, rings[slot as usize])
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
    let owner = crate::config::conn_shard(2, u32::from(LOCAL), u32::from(PEER));
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

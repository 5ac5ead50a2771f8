//! The control engine on a made-up clock, with a fake host: no socket, no region, no thread.

use super::*;
use crate::config::Overrides;
use crate::poll::snapshot::{GroupMemberSnapshot, GroupSnapshot, GroupSockSnapshot, SockSnapshot};
use shm_api::ctrl::{INFO_SOCKETS, LEGACY_REPLY_HEADER_LEN};
use std::collections::HashMap;
use std::time::Duration;

/// Regions and descriptors are numbers; claim words are a map, as in `poll::Channels`.
#[derive(Default)]
struct Fake {
    claims: HashMap<usize, u64>,
    regions: u32,
    /// The shard each attachment was made for, in order.
    attached_to: Vec<usize>,
    withdraw_calls: usize,
    /// Memory files made (Info documents longer than a datagram); fd = 700 + index.
    documents: Vec<Vec<u8>>,
    /// `document` fails with this errno.
    refuse_documents: Option<i32>,
}

impl Fake {
    /// A poll thread takes command `seq` of `app` (as `Channels::take`).
    fn take(&mut self, app: usize, seq: u64) -> bool {
        let c = self.claims.entry(app).or_default();
        let won = *c == seq;
        if won {
            *c = 0;
        }
        won
    }
}

impl Host for Fake {
    type Region = u32;
    type Fd = u32;
    type Readiness = ();

    fn attachment(&mut self, _pid: i32, shard: usize) -> Result<Attachment<Self>, i32> {
        self.regions += 1;
        self.attached_to.push(shard);
        let r = self.regions;
        Ok(Attachment {
            region: r,
            fds: [100 + r, 200 + r, 300 + r],
            doorbell: 400 + r,
            info: HelloInfo {
                region_len: 4096,
                daemon_region_len: 4096,
                hugetlb: 0,
                poll_threads: 1,
                placement: 0,
            },
        })
    }

    fn readiness(&mut self) -> Result<(u32, ()), i32> {
        Ok((999, ()))
    }

    fn arm(&mut self, app: usize, seq: u64) {
        self.claims.insert(app, seq);
    }

    fn withdraw(&mut self, app: usize, seq: u64) -> bool {
        self.withdraw_calls += 1;
        self.take(app, seq)
    }

    fn document(&mut self, bytes: &[u8]) -> Result<u32, i32> {
        if let Some(errno) = self.refuse_documents {
            return Err(errno);
        }
        self.documents.push(bytes.to_vec());
        Ok(699 + self.documents.len() as u32)
    }
}

/// What a command was, for assertions.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Attach(u32),
    Detach,
    Request(Request),
    Snapshot(usize),
    /// A snapshot with the queued messages listed (`INFO_MESSAGES`).
    SnapshotListing(usize),
}

/// An action, in a form tests compare.
#[derive(Debug, PartialEq)]
enum Seen {
    Send {
        conn: usize,
        reply: Reply,
        fds: Vec<u32>,
    },
    Close {
        conn: usize,
        farewell: Option<Reply>,
    },
    Queue {
        shard: usize,
        seq: u64,
        app: usize,
        kind: Kind,
    },
    Free(u32),
}

struct Rig {
    e: Engine<Fake>,
    stats: Arc<Stats>,
    t0: Instant,
}

const PID: i32 = 4242;
const USER: u32 = 1000;

fn rig(shards: usize, capacity: usize, tune: impl FnOnce(&mut Config)) -> Rig {
    let mut cfg = Config::load(None, &Overrides::default()).expect("default config");
    cfg.max_apps = 8;
    cfg.max_apps_per_uid = 8;
    cfg.max_regions_per_uid = 8;
    cfg.hello_timeout = Duration::from_secs(1);
    cfg.control_timeout = Duration::from_secs(10);
    cfg.reply_timeout = Duration::from_secs(1);
    tune(&mut cfg);
    let stats = Arc::new(Stats::default());
    let started = Started::now();
    let e = Engine::new(
        Arc::new(cfg),
        stats.clone(),
        Fake::default(),
        shards,
        capacity,
        started,
    );
    Rig {
        e,
        stats,
        t0: Instant::now(),
    }
}

fn count(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

impl Rig {
    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    /// The actions queued so far (every Send goes out).
    fn actions(&mut self) -> Vec<Seen> {
        let mut out = Vec::new();
        while let Some(a) = self.e.next_action() {
            out.push(match a {
                Action::Send { conn, bytes, fds } => Seen::Send {
                    conn,
                    reply: Reply::decode(&bytes).expect("a reply"),
                    fds,
                },
                Action::Close { conn, farewell } => Seen::Close {
                    conn,
                    farewell: farewell.map(|b| Reply::decode(&b).expect("a reply")),
                },
                Action::Queue { shard, seq, cmd } => Seen::Queue {
                    shard,
                    seq,
                    app: cmd.app(),
                    kind: match cmd {
                        Command::Attach {
                            region, doorbell, ..
                        } => {
                            assert_eq!(doorbell, 400 + region);
                            Kind::Attach(region)
                        }
                        Command::Detach { .. } => Kind::Detach,
                        Command::Request { req, .. } => Kind::Request(req),
                        Command::Snapshot {
                            shard,
                            messages: false,
                            ..
                        } => Kind::Snapshot(shard),
                        Command::Snapshot { shard, .. } => Kind::SnapshotListing(shard),
                    },
                },
                Action::FreeRegion(r) => Seen::Free(r),
            });
        }
        out
    }

    fn request(&mut self, ms: u64, conn: usize, id: u64, req: Request) {
        self.e.received(self.at(ms), conn, &req.encode(id));
    }

    /// The one command queued since the last look: (shard, seq, kind).
    fn queued(&mut self) -> (usize, u64, Kind) {
        match self.actions().as_slice() {
            [Seen::Queue {
                shard, seq, kind, ..
            }] => (*shard, *seq, kind.clone()),
            other => panic!("expected one Queue, got {other:?}"),
        }
    }

    /// The one reply sent since the last look.
    fn reply(&mut self, conn: usize) -> Reply {
        match self.actions().as_slice() {
            [Seen::Send { conn: c, reply, .. }] if *c == conn => reply.clone(),
            other => panic!("expected one reply to {conn}, got {other:?}"),
        }
    }

    /// Accepts an app of `uid` and attaches it at `ms`: (its index, its shard).
    fn attach(&mut self, ms: u64, uid: u32) -> (usize, usize) {
        self.attach_asking(ms, uid, None)
    }

    /// [`Rig::attach`] with a Hello that asks for poll thread `shard`.
    fn attach_asking(&mut self, ms: u64, uid: u32, shard: Option<u8>) -> (usize, usize) {
        let i = self.e.accept(self.at(ms), PID, uid).expect("accepted");
        self.request(
            ms,
            i,
            1,
            Request::Hello {
                version: LAYOUT_VERSION,
                shard,
            },
        );
        let (shard, seq, kind) = self.queued();
        assert!(matches!(kind, Kind::Attach(_)));
        assert!(self.e.host_mut().take(i, seq));
        self.e.answer(self.at(ms), seq, i, Answer::Attached);
        let r = self.reply(i);
        assert_eq!((r.errno, r.id), (0, 1));
        (i, shard)
    }
}

const BIND: Request = Request::Bind {
    slot: 0,
    addr: std::net::Ipv4Addr::LOCALHOST,
    port: 4000,
};

#[test]
fn a_silent_connection_is_closed_at_its_hello_deadline() {
    let mut r = rig(1, 64, |_| {});
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    assert_eq!(r.e.interest(i), Some(Interest::Read));
    assert_eq!(r.e.next_deadline(), Some(r.at(1000)));
    r.e.tick(r.at(999));
    assert!(r.actions().is_empty());
    r.e.tick(r.at(1000));
    assert_eq!(
        r.actions(),
        [Seen::Close {
            conn: i,
            farewell: Some(Reply::err(libc::ETIMEDOUT)),
        }]
    );
    assert_eq!(count(&r.stats.hello_timeouts), 1);
    assert_eq!(r.e.interest(i), None);
    // Hello in time: no deadline left.
    let j = r.e.accept(r.at(2000), PID, USER).unwrap();
    r.request(
        2500,
        j,
        1,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    r.actions();
    r.e.tick(r.at(60_000));
    assert!(r.actions().iter().all(|a| !matches!(a, Seen::Close { .. })));
}

#[test]
fn a_command_not_taken_in_time_is_withdrawn_and_answered_etimedout() {
    let mut r = rig(1, 64, |_| {});
    let (i, _) = r.attach(0, USER);
    r.request(100, i, 7, BIND);
    let (_, seq, kind) = r.queued();
    assert_eq!(kind, Kind::Request(BIND));
    assert_eq!(r.e.interest(i), Some(Interest::Hangup));
    assert_eq!(r.e.next_deadline(), Some(r.at(10_100)));
    r.e.tick(r.at(10_099));
    assert!(r.actions().is_empty());
    r.e.tick(r.at(10_100));
    let reply = r.reply(i);
    assert_eq!((reply.errno, reply.id), (libc::ETIMEDOUT, 7));
    assert_eq!(count(&r.stats.ctrl_timeouts), 1);
    // The poll thread skips it later: nothing more is said, and it is not a stale answer.
    assert!(!r.e.host_mut().take(i, seq));
    r.e.answer(r.at(20_000), seq, i, Answer::Withdrawn(None));
    assert!(r.actions().is_empty());
    assert_eq!(count(&r.stats.ctrl_stale_replies), 0);
    assert_eq!(r.e.interest(i), Some(Interest::Read));
}

#[test]
fn a_command_already_taken_is_waited_for_however_late() {
    let mut r = rig(1, 64, |_| {});
    let (i, _) = r.attach(0, USER);
    r.request(100, i, 8, BIND);
    let (_, seq, _) = r.queued();
    assert!(r.e.host_mut().take(i, seq));
    r.e.tick(r.at(10_100));
    assert!(r.actions().is_empty());
    assert_eq!(count(&r.stats.ctrl_timeouts), 0);
    // No deadline any more for it: the loop does not spin on it.
    assert_eq!(r.e.next_deadline(), None);
    r.e.tick(r.at(3_600_000));
    assert!(r.actions().is_empty());
    r.e.answer(r.at(3_600_001), seq, i, Answer::Reply(Reply::ok(4000)));
    let reply = r.reply(i);
    assert_eq!((reply.errno, reply.value, reply.id), (0, 4000, 8));
}

#[test]
fn an_answer_after_its_app_left_is_stale_and_the_detach_frees_the_region() {
    let mut r = rig(1, 64, |_| {});
    let (i, _) = r.attach(0, USER);
    r.request(100, i, 9, BIND);
    let (_, seq, _) = r.queued();
    r.e.hung_up(i);
    let acts = r.actions();
    assert_eq!(
        acts[0],
        Seen::Close {
            conn: i,
            farewell: None
        }
    );
    let Seen::Queue {
        seq: detach,
        kind: Kind::Detach,
        ..
    } = acts[1]
    else {
        panic!("expected a Detach, got {acts:?}");
    };
    r.e.answer(r.at(200), seq, i, Answer::Reply(Reply::ok(4000)));
    assert!(r.actions().is_empty());
    assert_eq!(count(&r.stats.ctrl_stale_replies), 1);
    // The slot stays taken until the region is back.
    assert_eq!(r.e.interest(i), None);
    r.e.answer(r.at(300), detach, i, Answer::Detached(Some(1)));
    assert_eq!(r.actions(), [Seen::Free(1)]);
    assert_eq!(r.e.accept(r.at(400), PID, USER), Ok(i));
}

#[test]
fn an_attach_withdrawn_on_hang_up_still_counts_until_its_region_is_back() {
    let mut r = rig(1, 64, |c| c.max_regions_per_uid = 1);
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    r.request(
        0,
        i,
        1,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    let (_, seq, _) = r.queued();
    r.e.hung_up(i);
    assert_eq!(
        r.actions(),
        [Seen::Close {
            conn: i,
            farewell: None
        }]
    );
    assert_eq!(r.e.host_mut().withdraw_calls, 1);
    let j = r.e.accept(r.at(1), PID, USER).unwrap();
    r.request(
        1,
        j,
        2,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    let refused = r.reply(j);
    assert_eq!(
        (refused.errno, refused.value, refused.id),
        (libc::EDQUOT, 1, 2)
    );
    r.e.answer(r.at(2), seq, i, Answer::Withdrawn(Some(1)));
    assert_eq!(r.actions(), [Seen::Free(1)]);
    r.request(
        3,
        j,
        3,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    assert!(matches!(r.queued().2, Kind::Attach(_)));
}

#[test]
fn max_apps_refuses_with_eusers_and_the_limit() {
    let mut r = rig(1, 64, |c| c.max_apps = 2);
    assert_eq!(r.e.accept(r.at(0), PID, USER), Ok(0));
    assert_eq!(r.e.accept(r.at(0), PID, 0), Ok(1));
    // Root too: max_apps binds everyone.
    for uid in [USER, 0] {
        let bytes = r.e.accept(r.at(0), PID, uid).unwrap_err();
        let refusal = Reply::decode(&bytes).unwrap();
        assert_eq!(
            (refusal.errno, refusal.value, refusal.id),
            (libc::EUSERS, 2, 0)
        );
    }
    assert_eq!(count(&r.stats.attach_refused_max_apps), 2);
    assert_eq!(count(&r.stats.attach_refused), 2);
    r.e.hung_up(0);
    assert_eq!(r.e.accept(r.at(1), PID, USER), Ok(0));
}

#[test]
fn max_apps_per_uid_refuses_with_edquot_but_not_root() {
    let mut r = rig(1, 64, |c| c.max_apps_per_uid = 2);
    for _ in 0..2 {
        r.e.accept(r.at(0), PID, USER).unwrap();
    }
    let refusal = Reply::decode(&r.e.accept(r.at(0), PID, USER).unwrap_err()).unwrap();
    assert_eq!(
        (refusal.errno, refusal.value, refusal.id),
        (libc::EDQUOT, 2, 0)
    );
    assert_eq!(count(&r.stats.attach_refused_uid_apps), 1);
    // Another user has its own count; root has none.
    r.e.accept(r.at(0), PID, USER + 1).unwrap();
    for _ in 0..3 {
        r.e.accept(r.at(0), PID, 0).unwrap();
    }
    assert_eq!(count(&r.stats.attach_refused_uid_apps), 1);
}

#[test]
fn max_regions_per_uid_refuses_hello_with_edquot_but_not_root() {
    let mut r = rig(1, 64, |c| c.max_regions_per_uid = 2);
    r.attach(0, USER);
    // Attaching (not answered yet) holds a region too.
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    r.request(
        0,
        i,
        1,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    r.queued();
    let j = r.e.accept(r.at(0), PID, USER).unwrap();
    r.request(
        0,
        j,
        5,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    let refusal = r.reply(j);
    assert_eq!(
        (refusal.errno, refusal.value, refusal.id),
        (libc::EDQUOT, 2, 5)
    );
    assert_eq!(count(&r.stats.attach_refused_uid_regions), 1);
    for _ in 0..3 {
        r.attach(0, 0);
    }
    assert_eq!(count(&r.stats.attach_refused_uid_regions), 1);
}

#[test]
fn commands_beyond_the_answer_queue_wait_in_the_backlog() {
    let mut r = rig(1, 2, |_| {});
    let conns: Vec<usize> = (0..3)
        .map(|_| r.e.accept(r.at(0), PID, USER).unwrap())
        .collect();
    for &i in &conns {
        r.request(
            0,
            i,
            10 + i as u64,
            Request::Info {
                sections: INFO_SOCKETS,
            },
        );
    }
    let queued: Vec<u64> = r
        .actions()
        .into_iter()
        .map(|a| match a {
            Seen::Queue { seq, .. } => seq,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(queued.len(), 2, "the third waits");
    let snap = || {
        Box::new(PollSnapshot {
            shards_seen: 1,
            ..Default::default()
        })
    };
    r.e.answer(r.at(1), queued[0], conns[0], Answer::Snapshot(snap()));
    assert_eq!(r.reply(conns[0]).id, 10);
    r.e.tick(r.at(1));
    let (_, third, kind) = r.queued();
    assert_eq!(kind, Kind::Snapshot(0));
    r.e.answer(r.at(2), queued[1], conns[1], Answer::Snapshot(snap()));
    r.e.answer(r.at(2), third, conns[2], Answer::Snapshot(snap()));
    assert_eq!(r.actions().len(), 2);
}

#[test]
fn a_command_that_never_left_the_backlog_times_out_without_a_withdrawal() {
    let mut r = rig(1, 1, |_| {});
    let (a, _) = r.attach(0, USER);
    let b = r.e.accept(r.at(0), PID, USER).unwrap();
    r.request(0, a, 1, BIND);
    r.queued();
    r.request(
        0,
        b,
        2,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    assert!(r.actions().is_empty(), "the Attach waits in the backlog");
    let calls = r.e.host_mut().withdraw_calls;
    r.e.tick(r.at(10_000));
    let acts = r.actions();
    // Both time out; the backlogged Attach's region is freed here, never withdrawn.
    assert!(acts.contains(&Seen::Free(2)), "{acts:?}");
    assert!(acts.iter().any(|x| matches!(x,
        Seen::Send { conn, reply, .. } if *conn == b && reply.errno == libc::ETIMEDOUT)));
    assert_eq!(r.e.host_mut().withdraw_calls, calls + 1, "only a's");
}

#[test]
fn new_apps_go_to_the_least_loaded_poll_thread() {
    let mut r = rig(3, 64, |_| {});
    let shards: Vec<usize> = (0..4).map(|_| r.attach(0, USER).1).collect();
    assert_eq!(shards, [0, 1, 2, 0]);
    // The app on shard 2 leaves: its shard counts it until the Detach is answered.
    let leaving = 2;
    r.e.hung_up(leaving);
    let acts = r.actions();
    let Some(&Seen::Queue {
        shard: 2,
        seq: detach,
        kind: Kind::Detach,
        ..
    }) = acts.get(1)
    else {
        panic!("expected a Detach on shard 2: {acts:?}");
    };
    // Loads 2, 1, 1 (not 2, 1, 0): ties go to the lowest.
    assert_eq!(r.attach(1, USER), (4, 1));
    r.e.answer(r.at(2), detach, leaving, Answer::Detached(Some(3)));
    assert_eq!(r.actions(), [Seen::Free(3)]);
    // Loads 2, 2, 0; the freed index is reused.
    assert_eq!(r.attach(3, USER), (leaving, 2));
    assert_eq!(r.attach(3, USER).1, 2);
    assert_eq!(r.attach(3, USER).1, 0);
    let asked = r.e.host_mut().attached_to.clone();
    assert_eq!(asked, [0, 1, 2, 0, 1, 2, 2, 0]);
    // Requests go to the app's own poll thread.
    r.request(4, 2, 3, BIND);
    assert_eq!(r.queued().0, 2);
}

#[test]
fn placement_by_socket_puts_an_attachment_on_the_poll_thread_it_asks_for() {
    use crate::config::Placement;
    let mut r = rig(3, 64, |c| c.placement = Placement::Socket);
    // Asked for: honoured, whatever the load.
    let asked: Vec<usize> = [2, 2, 1, 0]
        .map(|k| r.attach_asking(0, USER, Some(k)).1)
        .to_vec();
    assert_eq!(asked, [2, 2, 1, 0]);
    // Not asked (an older library, or a first attachment): the least loaded. Out of range:
    // the same.
    assert_eq!(r.attach_asking(0, USER, None).1, 0);
    assert_eq!(r.attach_asking(0, USER, Some(3)).1, 1);
    // By app (the default) a request is ignored.
    let mut r = rig(3, 64, |_| {});
    let shards: Vec<usize> = [2, 2, 2]
        .map(|k| r.attach_asking(0, USER, Some(k)).1)
        .to_vec();
    assert_eq!(shards, [0, 1, 2]);
}

/// Only an Info that asks for the message listings has the poll threads build them (they cost
/// the poll core a walk of every queue): every shard's snapshot command says so.
#[test]
fn only_the_messages_section_asks_the_poll_threads_for_listings() {
    let mut r = rig(2, 64, |_| {});
    let i = r.e.accept(r.at(0), 77, 0).unwrap();
    for (id, sections, listing) in [(1, 0, false), (2, shm_api::ctrl::INFO_MESSAGES, true)] {
        r.request(500, i, id, Request::Info { sections });
        for shard in 0..2 {
            let (to, seq, kind) = r.queued();
            let want = if listing {
                Kind::SnapshotListing(shard)
            } else {
                Kind::Snapshot(shard)
            };
            assert_eq!((to, kind), (shard, want));
            let snap = PollSnapshot {
                shards_seen: shard + 1,
                ..Default::default()
            };
            r.e.answer(r.at(600), seq, i, Answer::Snapshot(Box::new(snap)));
        }
        let reply = r.reply(i);
        assert_eq!((reply.errno, reply.id), (0, id));
        let doc: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(doc.get("send_messages").is_some(), listing);
    }
}

/// A document longer than one datagram: cut to fit without `INFO_WHOLE` (the `*_truncated`
/// count says by how much), whole in a memory file with it (the reply's value is its length,
/// the body empty, one fd attached); when no memory file can be made, cut and counted.
#[test]
fn a_long_info_document_travels_whole_in_a_memory_file_when_asked() {
    use shm_api::ctrl::{INFO_WHOLE, MAX_DATAGRAM};
    let mut r = rig(1, 64, |_| {});
    let (app, _) = r.attach(0, USER);
    let i = r.e.accept(r.at(0), 77, 0).unwrap();
    let sockets = 3000;
    let snap = || PollSnapshot {
        sockets: (0..sockets)
            .map(|slot| SockSnapshot {
                app,
                slot,
                ..Default::default()
            })
            .collect(),
        shards_seen: 1,
        ..Default::default()
    };
    for (id, whole, refuse) in [
        (1, false, None),
        (2, true, None),
        (3, true, Some(libc::EMFILE)),
    ] {
        r.e.host_mut().refuse_documents = refuse;
        let sections = INFO_SOCKETS | if whole { INFO_WHOLE } else { 0 };
        r.request(500, i, id, Request::Info { sections });
        let (_, seq, _) = r.queued();
        r.e.answer(r.at(600), seq, i, Answer::Snapshot(Box::new(snap())));
        let actions: [Seen; 1] = r.actions().try_into().expect("one reply");
        let [Seen::Send { reply, fds, .. }] = actions else {
            panic!("not a reply");
        };
        assert_eq!((reply.errno, reply.id), (0, id));
        let doc: serde_json::Value = if whole && refuse.is_none() {
            assert_eq!(fds, [700]);
            assert!(reply.body.is_empty());
            let file = &r.e.host_mut().documents[0];
            assert_eq!(reply.value, file.len() as u64);
            assert!(file.len() > MAX_DATAGRAM);
            serde_json::from_slice(file).unwrap()
        } else {
            assert!(fds.is_empty());
            assert!(reply.body.len() <= MAX_DATAGRAM);
            serde_json::from_slice(&reply.body).unwrap()
        };
        let listed = doc["sockets"].as_array().unwrap().len() as u64;
        let cut = doc
            .get("sockets_truncated")
            .map_or(0, |v| v.as_u64().unwrap());
        assert_eq!(listed + cut, sockets as u64);
        assert_eq!(
            cut == 0,
            whole && refuse.is_none(),
            "request {id}: {cut} cut"
        );
    }
    assert_eq!(count(&r.stats.ctrl_info_cut), 1);
    assert_eq!(count(&r.stats.ctrl_info_whole), 1);
    // INFO_WHOLE alone means every summary section, as 0 does.
    r.request(
        700,
        i,
        4,
        Request::Info {
            sections: INFO_WHOLE,
        },
    );
    assert_eq!(r.queued().2, Kind::Snapshot(0));
}

#[test]
fn info_gathers_a_snapshot_from_every_poll_thread_in_turn() {
    let mut r = rig(3, 64, |_| {});
    let (app, _) = r.attach(0, USER);
    let i = r.e.accept(r.at(0), 77, 0).unwrap();
    r.request(500, i, 42, Request::Info { sections: 0 });
    let sock = |slot| SockSnapshot {
        app,
        slot,
        ..Default::default()
    };
    for shard in 0..3 {
        let (to, seq, kind) = r.queued();
        assert_eq!((to, kind), (shard, Kind::Snapshot(shard)));
        // Waiting for the snapshot does not count as silence.
        r.e.tick(r.at(5_000));
        assert!(r.actions().is_empty());
        // Every poll thread orders groups of its own (the last shard's first).
        let group = GroupSnapshot {
            shard,
            addr: std::net::Ipv4Addr::new(239, 0, 0, 3 - shard as u8),
            port: 5000,
            epoch: 1,
            creator: None,
            owner: None,
            members: vec![GroupMemberSnapshot {
                sock: GroupSockSnapshot {
                    app,
                    slot: shard as u32,
                    ..Default::default()
                },
                filter: "all".into(),
                ..Default::default()
            }],
            last_seq: 9,
            sends: 9,
            deliveries: 9,
            drops_full: 0,
            filtered: 0,
            full: false,
        };
        let snap = PollSnapshot {
            sockets: vec![sock(shard as u32)],
            groups: vec![group],
            transports: if shard == 0 { vec!["loopback"] } else { vec![] },
            shards_seen: shard + 1,
            ..Default::default()
        };
        r.e.answer(r.at(5_000), seq, i, Answer::Snapshot(Box::new(snap)));
    }
    let reply = r.reply(i);
    assert_eq!((reply.errno, reply.id), (0, 42));
    let doc: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    let socks = doc["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 3);
    for (k, s) in socks.iter().enumerate() {
        assert_eq!(s["slot"], k);
        assert_eq!(
            (s["pid"].as_i64(), s["uid"].as_u64()),
            (Some(PID as i64), Some(1000))
        );
    }
    let groups = doc["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 3, "{groups:?}");
    for (k, g) in groups.iter().enumerate() {
        assert_eq!(g["addr"], format!("239.0.0.{}", k + 1), "sorted by address");
        assert_eq!(g["shard"], 2 - k);
        let m = &g["members"][0];
        assert_eq!(
            (m["slot"].as_u64(), m["pid"].as_i64()),
            (Some(2 - k as u64), Some(PID as i64))
        );
    }
    assert_eq!(doc["rdsd"]["transports"], serde_json::json!(["loopback"]));
    // One entry per configured poll thread, its CPU or null where it is not pinned.
    let cpus = doc["rdsd"]["poll_cpus"].as_array().expect("poll_cpus");
    assert!(
        !cpus.is_empty() && cpus.iter().all(|c| c.is_u64() || c.is_null()),
        "{cpus:?}"
    );
    assert_eq!(doc["rdsd"]["idle"], "backoff");
    assert_eq!(
        doc["rdsd"]["uptime_s"].as_f64().map(|u| u >= 5.0),
        Some(true)
    );
    // The answer starts a fresh hello_timeout.
    assert_eq!(r.e.next_deadline(), Some(r.at(6_000)));
}

#[test]
fn malformed_requests_are_counted_and_answered_einval() {
    let mut r = rig(1, 64, |_| {});
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    r.e.received(r.at(0), i, &[1, 2, 3]);
    let bad = r.reply(i);
    assert_eq!((bad.errno, bad.id), (libc::EINVAL, 0));
    let mut frame = BIND.encode(77);
    frame[0] = 0xee;
    r.e.received(r.at(0), i, &frame);
    let bad = r.reply(i);
    assert_eq!((bad.errno, bad.id), (libc::EINVAL, 77));
    // A Hello whose version does not fit in 32 bits.
    let mut frame = Request::Hello {
        version: 0,
        shard: None,
    }
    .encode(78);
    frame[20] = 1;
    r.e.received(r.at(0), i, &frame);
    assert_eq!(r.reply(i).errno, libc::EINVAL);
    r.e.received(r.at(0), i, &[0u8; 4096]);
    assert_eq!(r.reply(i).errno, libc::EINVAL);
    assert_eq!(count(&r.stats.ctrl_bad_requests), 4);
    // Well formed but too early.
    r.request(0, i, 79, BIND);
    let early = r.reply(i);
    assert_eq!((early.errno, early.id), (libc::ENOTCONN, 79));
    assert_eq!(count(&r.stats.ctrl_bad_requests), 4);
}

#[test]
fn a_v1_hello_is_told_its_library_is_too_old() {
    let mut r = rig(1, 64, |_| {});
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    let frame = Request::Hello {
        version: 1,
        shard: None,
    }
    .encode_v1();
    r.e.received(r.at(0), i, &frame);
    let Some(Action::Send { bytes, .. }) = r.e.next_action() else {
        panic!("expected a reply");
    };
    assert_eq!(bytes.len(), LEGACY_REPLY_HEADER_LEN);
    assert_eq!(
        i32::from_le_bytes(bytes[..4].try_into().unwrap()),
        libc::EPROTONOSUPPORT
    );
}

#[test]
fn a_reply_left_unread_past_reply_timeout_disconnects() {
    let mut r = rig(1, 64, |_| {});
    let (i, _) = r.attach(0, USER);
    r.request(0, i, 3, Request::Stats);
    let Some(Action::Send { bytes, fds, .. }) = r.e.next_action() else {
        panic!("expected a reply");
    };
    r.e.send_blocked(r.at(100), i, bytes, fds);
    assert_eq!(r.e.interest(i), Some(Interest::Write));
    assert_eq!(
        r.e.outbox(i).map(|(b, _)| Reply::decode(b).unwrap().id),
        Some(3)
    );
    assert_eq!(r.e.next_deadline(), Some(r.at(1_100)));
    // Room came: read again.
    r.e.outbox_sent(i);
    assert_eq!(r.e.interest(i), Some(Interest::Read));
    r.request(2_000, i, 4, Request::Stats);
    let Some(Action::Send { bytes, fds, .. }) = r.e.next_action() else {
        panic!("expected a reply");
    };
    r.e.send_blocked(r.at(2_000), i, bytes, fds);
    r.e.tick(r.at(2_999));
    assert!(r.actions().is_empty());
    r.e.tick(r.at(3_000));
    let acts = r.actions();
    assert_eq!(
        acts[0],
        Seen::Close {
            conn: i,
            farewell: None
        }
    );
    assert!(matches!(
        acts[1],
        Seen::Queue {
            kind: Kind::Detach,
            ..
        }
    ));
    assert_eq!(count(&r.stats.ctrl_unread_disconnects), 1);
}

#[test]
fn socket_open_hands_the_pollable_fd_only_on_success() {
    let mut r = rig(1, 64, |_| {});
    let (i, _) = r.attach(0, USER);
    for (errno, fds) in [(0, vec![999]), (libc::EMFILE, vec![])] {
        r.request(0, i, 5, Request::SocketOpen);
        let (_, seq, _) = r.queued();
        let answer = if errno == 0 {
            Reply::ok(3)
        } else {
            Reply::err(errno)
        };
        r.e.answer(r.at(1), seq, i, Answer::Reply(answer));
        let acts = r.actions();
        let [Seen::Send { fds: sent, .. }] = acts.as_slice() else {
            panic!("{acts:?}");
        };
        assert_eq!(*sent, fds);
    }
}

#[test]
fn a_second_hello_is_eisconn_and_a_taken_attach_is_detached_on_hang_up() {
    let mut r = rig(2, 64, |_| {});
    r.attach(0, USER);
    let i = r.e.accept(r.at(0), PID, USER).unwrap();
    r.request(
        0,
        i,
        1,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    let (shard, seq, _) = r.queued();
    assert_eq!(shard, 1);
    // No second Hello while one is in flight (the connection is not read, but a
    // misbehaving shell must not double-attach either).
    r.request(
        0,
        i,
        2,
        Request::Hello {
            version: LAYOUT_VERSION,
            shard: None,
        },
    );
    let again = r.reply(i);
    assert_eq!((again.errno, again.id), (libc::EISCONN, 2));
    // The poll thread took the Attach: hanging up cannot withdraw it, so a Detach follows
    // on the same poll thread and the index stays reserved until it is answered.
    assert!(r.e.host_mut().take(i, seq));
    r.e.hung_up(i);
    let acts = r.actions();
    assert!(
        matches!(
            acts.as_slice(),
            [
                Seen::Close { .. },
                Seen::Queue {
                    shard: 1,
                    kind: Kind::Detach,
                    ..
                }
            ]
        ),
        "{acts:?}"
    );
    r.e.answer(r.at(1), seq, i, Answer::Attached);
    assert!(r.actions().is_empty());
    assert_eq!(count(&r.stats.ctrl_stale_replies), 1);
    assert_ne!(r.e.accept(r.at(2), PID, USER), Ok(i));
}

//! The control thread's rules, without I/O: what to answer each client, what to ask the poll
//! threads, when to give up waiting. `mod.rs` owns the sockets, SCM_RIGHTS and poll(2); it
//! feeds this engine events with the time they happened (`now`) and carries out the
//! [`Action`]s it queues, so every rule here runs in unit tests on a made-up clock.
//!
//! Events: a connection accepted ([`Engine::accept`]), a datagram ([`Engine::received`]), a
//! poll thread's answer ([`Engine::answer`]), a reply that did not fit or went out
//! ([`Engine::send_blocked`], [`Engine::outbox_sent`]), a hang-up ([`Engine::hung_up`]), the
//! passing of time ([`Engine::tick`]). What must be decided at once goes through [`Host`]:
//! creating an app's region and descriptors (the reply's errno depends on it) and the claim
//! word (whether a command was withdrawn decides between ETIMEDOUT and waiting on), so the
//! engine never sits half-way through a step waiting for a result the shell always has.

use super::info::{self, Started};
use crate::config::{Config, Placement};
use crate::poll::snapshot::PollSnapshot;
use crate::stats::Stats;
use shm_api::ctrl::{
    frame_id, HelloInfo, Reply, Request, INFO_ALL, INFO_COUNTERS, INFO_MESSAGES, INFO_WHOLE,
    LEGACY_REQUEST_LEN, MAX_INFO_DOCUMENT, REQUEST_LEN,
};
use shm_api::layout::LAYOUT_VERSION;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// What the engine needs done synchronously: each answer decides the rest of the same step.
pub trait Host {
    /// An app region (`AppRegion`).
    type Region;
    /// A descriptor handed to an app or kept by rdsd (`OwnedFd`).
    type Fd;
    /// A socket's readiness state for the poll core (`poll::readiness::Readiness`).
    type Readiness;
    /// A new region for app `pid`, served by poll thread `shard`, with the app's descriptors;
    /// `Err(errno)` refuses the Hello with that errno.
    fn attachment(&mut self, pid: i32, shard: usize) -> Result<Attachment<Self>, i32>;
    /// A pollable fd for a new socket: (the app's end, rdsd's state); `Err(errno)`.
    fn readiness(&mut self) -> Result<(Self::Fd, Self::Readiness), i32>;
    /// `seq` is app `app`'s withdrawable command about to be queued (the claim word).
    fn arm(&mut self, app: usize, seq: u64);
    /// Withdraws command `seq` of `app`: true if no poll thread took it (none ever will).
    fn withdraw(&mut self, app: usize, seq: u64) -> bool;
    /// A sealed memory file holding `bytes` (an Info document longer than one datagram);
    /// `Err(errno)`.
    fn document(&mut self, bytes: &[u8]) -> Result<Self::Fd, i32>;
}

/// What a Hello needs: the region, the app's three descriptors (region, daemon region, its
/// doorbell end), rdsd's doorbell end, and the Hello reply's body.
pub struct Attachment<H: Host + ?Sized> {
    /// The app's region, for the poll thread.
    pub region: H::Region,
    /// Sent to the app with the Hello reply.
    pub fds: [H::Fd; 3],
    /// rdsd's end of the app's doorbell, for the poll thread.
    pub doorbell: H::Fd,
    /// The Hello reply's body.
    pub info: HelloInfo,
}

/// A command for a poll thread (`poll::Cmd`, over the host's resources).
pub enum Command<H: Host> {
    /// A new app. Withdrawable.
    Attach {
        app: usize,
        region: H::Region,
        doorbell: H::Fd,
        /// The app's uid (SO_PEERCRED): who may join the groups it creates.
        uid: u32,
    },
    /// The app is gone. Never withdrawn.
    Detach { app: usize },
    /// A request of an attached app. Withdrawable.
    Request {
        app: usize,
        req: Request,
        readiness: Option<H::Readiness>,
    },
    /// Introspection from poll thread `shard`; `messages`: with the queued messages listed
    /// (the `Info` section `messages`, costlier). Withdrawable.
    Snapshot {
        app: usize,
        shard: usize,
        messages: bool,
    },
}

impl<H: Host> Command<H> {
    /// The app (connection) this command concerns.
    pub fn app(&self) -> usize {
        match *self {
            Command::Attach { app, .. }
            | Command::Detach { app }
            | Command::Request { app, .. }
            | Command::Snapshot { app, .. } => app,
        }
    }
}

/// A poll thread's answer to a [`Command`] (`poll::CmdReply`).
pub enum Answer<H: Host> {
    /// To a Request.
    Reply(Reply),
    /// To Detach: the region to free.
    Detached(Option<H::Region>),
    /// To Attach.
    Attached,
    /// The command was withdrawn before any poll thread took it; an Attach's region comes back.
    Withdrawn(Option<H::Region>),
    /// To Snapshot.
    Snapshot(Box<PollSnapshot>),
}

/// What the shell must do, in order.
pub enum Action<H: Host> {
    /// Send a reply to connection `conn` without blocking; if it does not fit, hand it back
    /// with [`Engine::send_blocked`]; if the connection failed, call [`Engine::hung_up`].
    Send {
        conn: usize,
        bytes: Vec<u8>,
        fds: Vec<H::Fd>,
    },
    /// Close connection `conn`, first sending `farewell` if any (best effort, never waited for).
    Close {
        conn: usize,
        farewell: Option<Vec<u8>>,
    },
    /// Push onto poll thread `shard`'s command queue (it has room: see [`Engine::requeue`]),
    /// then ring its doorbell.
    Queue {
        shard: usize,
        seq: u64,
        cmd: Command<H>,
    },
    /// Release a region off the poll core (counted in `regions_freed`).
    FreeRegion(H::Region),
}

/// Which readiness to poll a connection for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interest {
    /// Its next request.
    Read,
    /// Room for the reply waiting in its outbox.
    Write,
    /// Nothing but a hang-up: its request is with a poll thread.
    Hangup,
}

/// What a connection waits for from a poll thread.
enum Waiting<H: Host> {
    /// An ordinary request; SocketOpen carries the app's end of the readiness pair.
    Request { pollable: Option<H::Fd> },
    /// Attach: the descriptors and body of the Hello reply.
    Attach { fds: [H::Fd; 3], info: HelloInfo },
    /// Info: a snapshot from each poll thread in turn (shard 0, with the transports, first),
    /// for these sections (`ctrl::INFO_*`); `gathered` is what came so far.
    Info {
        sections: u32,
        gathered: Option<Box<PollSnapshot>>,
    },
}

/// The one command of a connection in flight.
struct Pending<H: Host> {
    seq: u64,
    /// The app's request id, echoed in the reply.
    id: u64,
    deadline: Instant,
    /// Withdrawal failed: a poll thread has taken it, so its answer is coming.
    taken: bool,
    what: Waiting<H>,
}

/// A reply that did not fit in the client's socket yet.
struct Outbox<H: Host> {
    bytes: Vec<u8>,
    fds: Vec<H::Fd>,
    since: Instant,
}

struct Conn<H: Host> {
    pid: i32,
    uid: u32,
    /// Until a Hello has been accepted: when the connection is closed for silence.
    hello_by: Option<Instant>,
    attached: bool,
    pending: Option<Pending<H>>,
    outbox: Option<Outbox<H>>,
}

impl<H: Host> Conn<H> {
    fn holds_region(&self) -> bool {
        self.attached
            || matches!(
                self.pending,
                Some(Pending {
                    what: Waiting::Attach { .. },
                    ..
                })
            )
    }
}

enum Slot<H: Host> {
    Free,
    Conn(Box<Conn<H>>),
    /// The connection is gone; a poll thread still owes the answer to Detach `seq` (the
    /// region). The slot (the app index) is not reused until then.
    Detaching {
        seq: u64,
        uid: u32,
    },
}

/// The control thread's state: connections (by app index), commands in flight, limits.
pub struct Engine<H: Host> {
    cfg: Arc<Config>,
    stats: Arc<Stats>,
    host: H,
    /// Poll threads.
    shards: usize,
    /// Most commands outstanding at once (the answer queue's capacity).
    capacity: usize,
    /// Per app index: the poll thread (shard) serving that app.
    app_shard: Vec<usize>,
    slots: Vec<Slot<H>>,
    /// Commands not yet on a queue (kept while `outstanding` is at `capacity`).
    backlog: VecDeque<(u64, Command<H>)>,
    /// Commands on a queue or being run whose answers have not come back yet.
    outstanding: usize,
    /// Withdrawn Attach commands whose regions have not come back yet: (seq, uid).
    withdrawn: Vec<(u64, u32)>,
    next_seq: u64,
    started: Started,
    actions: VecDeque<Action<H>>,
}

impl<H: Host> Engine<H> {
    /// `cfg.max_apps` connection slots, `shards` poll threads, at most `capacity` commands
    /// outstanding.
    pub fn new(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        host: H,
        shards: usize,
        capacity: usize,
        started: Started,
    ) -> Engine<H> {
        let n = cfg.max_apps as usize;
        Engine {
            cfg,
            stats,
            host,
            shards: shards.max(1),
            capacity,
            app_shard: vec![0; n],
            slots: (0..n).map(|_| Slot::Free).collect(),
            backlog: VecDeque::new(),
            outstanding: 0,
            withdrawn: Vec::new(),
            next_seq: 1,
            started,
            actions: VecDeque::new(),
        }
    }

    /// The host (tests drive their fake through it).
    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// The next thing to do, in order.
    pub fn next_action(&mut self) -> Option<Action<H>> {
        self.actions.pop_front()
    }

    /// What to poll connection `i` for; `None` if there is no connection `i`.
    pub fn interest(&self, i: usize) -> Option<Interest> {
        let c = self.conn_ref(i)?;
        // One request at a time per connection: don't read the next before the current one
        // is answered and its reply is out.
        Some(if c.outbox.is_some() {
            Interest::Write
        } else if c.pending.is_none() {
            Interest::Read
        } else {
            Interest::Hangup
        })
    }

    /// The reply waiting for room in connection `i`'s socket: (bytes, descriptors).
    pub fn outbox(&self, i: usize) -> Option<(&[u8], &[H::Fd])> {
        let o = self.conn_ref(i)?.outbox.as_ref()?;
        Some((&o.bytes, &o.fds))
    }

    /// The outbox of connection `i` went out.
    pub fn outbox_sent(&mut self, i: usize) {
        if let Some(c) = self.conn(i) {
            c.outbox = None;
        }
    }

    /// A [`Action::Send`] did not fit: it waits in the outbox from `now`.
    pub fn send_blocked(&mut self, now: Instant, i: usize, bytes: Vec<u8>, fds: Vec<H::Fd>) {
        let Some(c) = self.conn(i) else { return };
        if c.outbox.is_some() {
            // Never queue more than one reply (can't happen: see `send`).
            return self.drop_unread(i);
        }
        c.outbox = Some(Outbox {
            bytes,
            fds,
            since: now,
        });
    }

    /// The earliest time [`Engine::tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        for slot in &self.slots {
            let Slot::Conn(c) = slot else { continue };
            if let Some(t) = c.hello_by.filter(|_| c.pending.is_none()) {
                at(t);
            }
            if let Some(p) = c.pending.as_ref().filter(|p| !p.taken) {
                at(p.deadline);
            }
            if let Some(o) = &c.outbox {
                at(o.since + self.cfg.reply_timeout);
            }
        }
        next
    }

    /// Drops every connection and queued command (shutdown).
    pub fn stop(&mut self) {
        self.backlog.clear();
        self.slots.clear();
        self.actions.clear();
    }

    fn conn(&mut self, i: usize) -> Option<&mut Conn<H>> {
        match self.slots.get_mut(i) {
            Some(Slot::Conn(c)) => Some(c),
            _ => None,
        }
    }

    fn conn_ref(&self, i: usize) -> Option<&Conn<H>> {
        match self.slots.get(i) {
            Some(Slot::Conn(c)) => Some(c),
            _ => None,
        }
    }

    fn conns_of(&self, uid: u32) -> u32 {
        self.slots
            .iter()
            .filter(|s| matches!(s, Slot::Conn(c) if c.uid == uid))
            .count() as u32
    }

    fn regions_of(&self, uid: u32) -> u32 {
        let held = self
            .slots
            .iter()
            .filter(|s| match s {
                Slot::Conn(c) => c.uid == uid && c.holds_region(),
                Slot::Detaching { uid: u, .. } => *u == uid,
                Slot::Free => false,
            })
            .count();
        (held + self.withdrawn.iter().filter(|w| w.1 == uid).count()) as u32
    }

    /// A connection from (`pid`, `uid`): its index, or the refusal (a reply with id 0 and the
    /// limit as its value) to send before closing it.
    pub fn accept(&mut self, now: Instant, pid: i32, uid: u32) -> Result<usize, Vec<u8>> {
        let refuse = |errno: i32, limit: u32| {
            Stats::bump(&self.stats.attach_refused);
            let mut r = Reply::err(errno);
            r.value = limit as u64;
            r.encode()
        };
        let Some(i) = self.slots.iter().position(|s| matches!(s, Slot::Free)) else {
            tracing::warn!(
                pid,
                uid,
                max_apps = self.cfg.max_apps,
                "refusing app: max_apps reached"
            );
            Stats::bump(&self.stats.attach_refused_max_apps);
            return Err(refuse(libc::EUSERS, self.cfg.max_apps));
        };
        if uid != 0 && self.conns_of(uid) >= self.cfg.max_apps_per_uid {
            tracing::warn!(
                pid,
                uid,
                max_apps_per_uid = self.cfg.max_apps_per_uid,
                "refusing app: its uid is at max_apps_per_uid"
            );
            Stats::bump(&self.stats.attach_refused_uid_apps);
            return Err(refuse(libc::EDQUOT, self.cfg.max_apps_per_uid));
        }
        tracing::debug!(pid, uid, app = i, "control connection");
        self.slots[i] = Slot::Conn(Box::new(Conn {
            pid,
            uid,
            hello_by: Some(now + self.cfg.hello_timeout),
            attached: false,
            pending: None,
            outbox: None,
        }));
        Ok(i)
    }

    /// Connection `i` hung up or failed.
    pub fn hung_up(&mut self, i: usize) {
        self.disconnect(i, None);
    }

    fn disconnect(&mut self, i: usize, farewell: Option<Vec<u8>>) {
        let Some(slot) = self.slots.get_mut(i) else {
            return;
        };
        let Slot::Conn(c) = std::mem::replace(slot, Slot::Free) else {
            return;
        };
        self.actions.push_back(Action::Close { conn: i, farewell });
        let mut detach = c.attached;
        if let Some(p) = &c.pending {
            if let Some(pos) = self.backlog.iter().position(|(s, _)| *s == p.seq) {
                let (_, cmd) = self.backlog.remove(pos).expect("present");
                if let Command::Attach { region, .. } = cmd {
                    self.actions.push_back(Action::FreeRegion(region));
                }
            } else if matches!(p.what, Waiting::Attach { .. }) {
                if self.host.withdraw(i, p.seq) {
                    self.withdrawn.push((p.seq, c.uid));
                } else {
                    detach = true;
                }
            }
            // A pushed request's answer will find nobody (a stale answer); the Detach after
            // it closes whatever it opened.
        }
        if detach {
            let seq = self.next_seq();
            self.slots[i] = Slot::Detaching { seq, uid: c.uid };
            self.enqueue(seq, Command::Detach { app: i });
            tracing::info!(pid = c.pid, uid = c.uid, app = i, "app detached");
        }
        // Dropping `c` drops what it waited for (descriptors never sent).
    }

    /// A datagram from connection `i`.
    pub fn received(&mut self, now: Instant, i: usize, datagram: &[u8]) {
        let Some(c) = self.conn_ref(i) else { return };
        let attached = c.attached;
        let n = datagram.len();
        let mut frame = [0u8; REQUEST_LEN];
        let len = n.min(REQUEST_LEN);
        frame[..len].copy_from_slice(&datagram[..len]);
        if n == LEGACY_REQUEST_LEN {
            if let Ok(req) = Request::decode_legacy(&frame[..n]) {
                return self.serve_legacy(i, req);
            }
        }
        let (id, req) = match Request::decode(datagram) {
            Ok(r) => r,
            Err(_) => {
                Stats::bump(&self.stats.ctrl_bad_requests);
                let r = Reply::err(libc::EINVAL).with_id(frame_id(&frame[..len]));
                return self.send(i, r.encode(), Vec::new());
            }
        };
        match req {
            Request::Hello { version, shard } => self.hello(now, i, id, version, shard),
            Request::Stats => {
                let mut r = Reply::ok(0).with_id(id);
                r.body = self.stats.render().into_bytes();
                self.send(i, r.encode(), Vec::new());
            }
            Request::Info { sections } => {
                let sections = if sections & !INFO_WHOLE == 0 {
                    INFO_ALL | sections
                } else {
                    sections
                };
                if sections & !(INFO_COUNTERS | INFO_WHOLE) == 0 {
                    // Counters only: no need to bother a poll thread.
                    let (r, fds) = self.info_reply(now, sections, None);
                    self.send(i, r.with_id(id).encode(), fds);
                } else {
                    self.submit(
                        now,
                        i,
                        id,
                        Command::Snapshot {
                            app: i,
                            shard: 0,
                            messages: sections & INFO_MESSAGES != 0,
                        },
                        Waiting::Info {
                            sections,
                            gathered: None,
                        },
                    );
                }
            }
            _ if !attached => self.send(
                i,
                Reply::err(libc::ENOTCONN).with_id(id).encode(),
                Vec::new(),
            ),
            Request::SocketOpen => match self.host.readiness() {
                Ok((app_end, state)) => self.submit(
                    now,
                    i,
                    id,
                    Command::Request {
                        app: i,
                        req,
                        readiness: Some(state),
                    },
                    Waiting::Request {
                        pollable: Some(app_end),
                    },
                ),
                Err(errno) => {
                    let r = Reply::err(errno).with_id(id);
                    self.send(i, r.encode(), Vec::new())
                }
            },
            _ => self.submit(
                now,
                i,
                id,
                Command::Request {
                    app: i,
                    req,
                    readiness: None,
                },
                Waiting::Request { pollable: None },
            ),
        }
    }

    /// A v1 client (24-byte frames, no ids): tell a v1 library clearly that it is too old,
    /// and keep a v1 `rdsctl` working.
    fn serve_legacy(&mut self, i: usize, req: Request) {
        let r = match req {
            Request::Hello { version, .. } => {
                let pid = self.conn_ref(i).map_or(-1, |c| c.pid);
                tracing::warn!(
                    pid,
                    app_version = version,
                    LAYOUT_VERSION,
                    "refusing app: v1 control protocol (library too old)"
                );
                Stats::bump(&self.stats.attach_refused);
                let mut r = Reply::err(libc::EPROTONOSUPPORT);
                r.value = LAYOUT_VERSION as u64;
                r
            }
            _ => {
                let mut r = Reply::ok(0);
                r.body = self.stats.render().into_bytes();
                r
            }
        };
        self.send(i, r.encode_legacy(), Vec::new());
    }

    fn hello(&mut self, now: Instant, i: usize, id: u64, version: u32, asked: Option<u8>) {
        let refuse = |errno: i32| Reply::err(errno).with_id(id).encode();
        let Some(c) = self.conn(i) else { return };
        if c.attached || c.pending.is_some() {
            return self.send(i, refuse(libc::EISCONN), Vec::new());
        }
        let (pid, uid) = (c.pid, c.uid);
        if version != LAYOUT_VERSION {
            tracing::warn!(
                pid,
                app_version = version,
                LAYOUT_VERSION,
                "refusing app: shm layout mismatch"
            );
            Stats::bump(&self.stats.attach_refused);
            let mut r = Reply::err(libc::EPROTONOSUPPORT).with_id(id);
            r.value = LAYOUT_VERSION as u64;
            return self.send(i, r.encode(), Vec::new());
        }
        c.hello_by = None;
        if uid != 0 && self.regions_of(uid) >= self.cfg.max_regions_per_uid {
            tracing::warn!(
                pid,
                uid,
                max_regions_per_uid = self.cfg.max_regions_per_uid,
                "refusing app: its uid is at max_regions_per_uid"
            );
            Stats::bump(&self.stats.attach_refused);
            Stats::bump(&self.stats.attach_refused_uid_regions);
            let mut r = Reply::err(libc::EDQUOT).with_id(id);
            r.value = self.cfg.max_regions_per_uid as u64;
            return self.send(i, r.encode(), Vec::new());
        }
        let shard = match asked.map(usize::from) {
            Some(k) if self.cfg.placement == Placement::Socket && k < self.shards => k,
            _ => self.pick_shard(),
        };
        let a = match self.host.attachment(pid, shard) {
            Ok(a) => a,
            Err(errno) => {
                Stats::bump(&self.stats.attach_refused);
                return self.send(i, refuse(errno), Vec::new());
            }
        };
        self.app_shard[i] = shard;
        self.submit(
            now,
            i,
            id,
            Command::Attach {
                app: i,
                region: a.region,
                doorbell: a.doorbell,
                uid,
            },
            Waiting::Attach {
                fds: a.fds,
                info: a.info,
            },
        );
    }

    /// The poll thread for a new app: the one serving the fewest apps (ties: the lowest), so
    /// that one rank per core spreads over the poll threads.
    fn pick_shard(&self) -> usize {
        let load = self.apps_per_shard();
        (0..load.len()).min_by_key(|&k| load[k]).unwrap_or(0)
    }

    /// Apps each poll thread serves (those leaving count until their region is back).
    fn apps_per_shard(&self) -> Vec<u32> {
        let mut load = vec![0u32; self.shards];
        for (i, s) in self.slots.iter().enumerate() {
            let counts = match s {
                Slot::Conn(c) => c.holds_region(),
                Slot::Detaching { .. } => true,
                Slot::Free => false,
            };
            if counts {
                load[self.app_shard[i]] += 1;
            }
        }
        load
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Sends a withdrawable command for connection `i`, which waits for its answer.
    fn submit(&mut self, now: Instant, i: usize, id: u64, cmd: Command<H>, what: Waiting<H>) {
        let seq = self.next_seq();
        let deadline = now + self.cfg.control_timeout;
        let Some(c) = self.conn(i) else { return };
        c.pending = Some(Pending {
            seq,
            id,
            deadline,
            taken: false,
            what,
        });
        self.host.arm(i, seq);
        self.enqueue(seq, cmd);
    }

    /// Queues a command for a poll thread (sent as soon as the queues have room).
    fn enqueue(&mut self, seq: u64, cmd: Command<H>) {
        self.backlog.push_back((seq, cmd));
        self.flush_backlog();
    }

    fn flush_backlog(&mut self) {
        while self.outstanding < self.capacity {
            let Some((seq, cmd)) = self.backlog.pop_front() else {
                break;
            };
            // Introspection names its poll thread; the rest goes to the app's.
            let shard = match cmd {
                Command::Snapshot { shard, .. } => shard,
                ref c => self.app_shard[c.app()],
            };
            self.outstanding += 1;
            self.actions.push_back(Action::Queue { shard, seq, cmd });
        }
    }

    /// A [`Action::Queue`] found its queue full (cannot happen while every queue holds as
    /// many as the answer queue: nothing is lost if it does). Tried again at the next event.
    pub fn requeue(&mut self, seq: u64, cmd: Command<H>) {
        self.outstanding = self.outstanding.saturating_sub(1);
        self.backlog.push_front((seq, cmd));
    }

    /// A poll thread's answer to command `seq` of `app`: matched to what waits for it.
    pub fn answer(&mut self, now: Instant, seq: u64, app: usize, reply: Answer<H>) {
        self.outstanding = self.outstanding.saturating_sub(1);
        let reply = match reply {
            Answer::Withdrawn(region) => {
                // Expected: we withdrew it and answered ETIMEDOUT already.
                self.withdrawn.retain(|w| w.0 != seq);
                if let Some(r) = region {
                    self.actions.push_back(Action::FreeRegion(r));
                }
                return;
            }
            r => r,
        };
        match self.slots.get_mut(app) {
            Some(Slot::Detaching { seq: s, .. }) if *s == seq => {
                if let Answer::Detached(Some(region)) = reply {
                    self.actions.push_back(Action::FreeRegion(region));
                }
                self.slots[app] = Slot::Free;
                tracing::debug!(app, "app slot free");
                return;
            }
            Some(Slot::Conn(c)) if c.pending.as_ref().is_some_and(|p| p.seq == seq) => {
                let p = c.pending.take().expect("pending");
                return self.respond(now, app, p, reply);
            }
            _ => {}
        }
        // Nobody waits for it (its connection went away): never sent to anyone.
        Stats::bump(&self.stats.ctrl_stale_replies);
        tracing::debug!(seq, app, "discarding a stale poll-core answer");
        if let Answer::Detached(Some(region)) = reply {
            self.actions.push_back(Action::FreeRegion(region));
        }
    }

    fn respond(&mut self, now: Instant, i: usize, p: Pending<H>, reply: Answer<H>) {
        match (p.what, reply) {
            (Waiting::Request { pollable }, Answer::Reply(r)) => {
                let fds = match pollable {
                    Some(fd) if r.errno == 0 => vec![fd],
                    _ => Vec::new(),
                };
                self.send(i, r.with_id(p.id).encode(), fds);
            }
            (Waiting::Info { sections, gathered }, Answer::Snapshot(snap)) => {
                let snap = match gathered {
                    None => snap,
                    Some(mut g) => {
                        g.shards_seen = snap.shards_seen;
                        g.sockets.extend(snap.sockets);
                        g.groups.extend(snap.groups);
                        // Each shard's own connections (kernel TCP on several poll threads).
                        g.connections.extend(snap.connections);
                        for t in snap.transports {
                            if !g.transports.contains(&t) {
                                g.transports.push(t);
                            }
                        }
                        g
                    }
                };
                let next = snap.shards_seen;
                if next < self.shards {
                    let cmd = Command::Snapshot {
                        app: i,
                        shard: next,
                        messages: sections & INFO_MESSAGES != 0,
                    };
                    let what = Waiting::Info {
                        sections,
                        gathered: Some(snap),
                    };
                    return self.submit(now, i, p.id, cmd, what);
                }
                // A client without Hello (rdsctl) gets a fresh hello_timeout from its answer
                // (the wait for the poll threads is not its silence).
                let fresh = now + self.cfg.hello_timeout;
                if let Some(t) = self.conn(i).and_then(|c| c.hello_by.as_mut()) {
                    *t = fresh;
                }
                let (r, fds) = self.info_reply(now, sections, Some(*snap));
                self.send(i, r.with_id(p.id).encode(), fds);
            }
            (Waiting::Attach { fds, info }, Answer::Attached) => {
                let Some(c) = self.conn(i) else { return };
                c.attached = true;
                tracing::info!(pid = c.pid, uid = c.uid, app = i, "app attached");
                let mut r = Reply::ok(0).with_id(p.id);
                r.body = info.encode();
                self.send(i, r.encode(), fds.into());
            }
            _ => {
                tracing::error!(app = i, "poll core answered a command with the wrong kind");
                self.send(i, Reply::err(libc::EIO).with_id(p.id).encode(), Vec::new());
            }
        }
    }

    /// The Info reply for `sections` (`snap` is `None` for counters only), with each
    /// socket's pid and uid filled in from its connection: the document in the body, or,
    /// when the client takes it whole (`INFO_WHOLE`) and it is longer than a datagram, in a
    /// memory file attached to the reply (value: its length).
    fn info_reply(
        &mut self,
        now: Instant,
        sections: u32,
        snap: Option<PollSnapshot>,
    ) -> (Reply, Vec<H::Fd>) {
        let max = if sections & INFO_WHOLE != 0 {
            MAX_INFO_DOCUMENT
        } else {
            info::MAX_BODY
        };
        let snap = snap.map(|mut s| {
            s.apps_per_shard = self.apps_per_shard();
            s
        });
        let doc = info::document(
            &self.cfg,
            &self.stats,
            &self.started,
            now,
            sections,
            snap,
            |app| self.conn_ref(app).map(|c| (c.pid, c.uid)),
        );
        let mut body = info::fit(doc, max);
        if body.len() > info::MAX_BODY {
            match self.host.document(&body) {
                Ok(fd) => {
                    Stats::bump(&self.stats.ctrl_info_whole);
                    return (Reply::ok(body.len() as u64), vec![fd]);
                }
                Err(errno) => {
                    Stats::bump(&self.stats.ctrl_info_cut);
                    tracing::warn!(
                        errno,
                        bytes = body.len(),
                        "no memory file for a long Info document: cut to one datagram"
                    );
                    body = info::refit(&body, info::MAX_BODY);
                }
            }
        }
        let mut r = Reply::ok(0);
        r.body = body;
        (r, Vec::new())
    }

    /// Queues a reply; the shell sends it without ever blocking.
    fn send(&mut self, i: usize, bytes: Vec<u8>, fds: Vec<H::Fd>) {
        let Some(c) = self.conn_ref(i) else { return };
        if c.outbox.is_some() {
            // Can't happen (a connection with an outbox is not read), but never queue more.
            return self.drop_unread(i);
        }
        self.actions.push_back(Action::Send {
            conn: i,
            bytes,
            fds,
        });
    }

    fn drop_unread(&mut self, i: usize) {
        if let Some(c) = self.conn_ref(i) {
            tracing::warn!(
                pid = c.pid,
                uid = c.uid,
                app = i,
                "disconnecting a client that does not read its control replies"
            );
        }
        Stats::bump(&self.stats.ctrl_unread_disconnects);
        self.disconnect(i, None);
    }

    /// Time passed: closes connections past their deadlines, withdraws commands no poll thread
    /// took in time, and queues what the queues have room for.
    pub fn tick(&mut self, now: Instant) {
        self.check_deadlines(now);
        self.flush_backlog();
    }

    fn check_deadlines(&mut self, now: Instant) {
        let reply_timeout = self.cfg.reply_timeout;
        for i in 0..self.slots.len() {
            let Some(c) = self.conn(i) else { continue };
            if c.outbox
                .as_ref()
                .is_some_and(|o| now >= o.since + reply_timeout)
            {
                self.drop_unread(i);
                continue;
            }
            // An Info in flight (rdsctl never says Hello) has its own deadline, control_timeout.
            if c.pending.is_none() && c.hello_by.is_some_and(|t| now >= t) {
                tracing::warn!(
                    pid = c.pid,
                    uid = c.uid,
                    "closing a control connection that sent no Hello in time"
                );
                Stats::bump(&self.stats.hello_timeouts);
                let bye = Reply::err(libc::ETIMEDOUT).encode();
                self.disconnect(i, Some(bye));
                continue;
            }
            let uid = c.uid;
            let Some(p) = c.pending.as_mut().filter(|p| !p.taken && now >= p.deadline) else {
                continue;
            };
            let seq = p.seq;
            let is_attach = matches!(p.what, Waiting::Attach { .. });
            if let Some(pos) = self.backlog.iter().position(|(s, _)| *s == seq) {
                // Never reached a poll thread.
                let (_, cmd) = self.backlog.remove(pos).expect("present");
                if let Command::Attach { region, .. } = cmd {
                    self.actions.push_back(Action::FreeRegion(region));
                }
            } else if self.host.withdraw(i, seq) {
                if is_attach {
                    self.withdrawn.push((seq, uid));
                }
            } else {
                // A poll thread is running it: its answer is coming, however late.
                if let Some(p) = self.conn(i).and_then(|c| c.pending.as_mut()) {
                    p.taken = true;
                }
                continue;
            }
            let p = self
                .conn(i)
                .and_then(|c| c.pending.take())
                .expect("pending");
            Stats::bump(&self.stats.ctrl_timeouts);
            tracing::warn!(
                app = i,
                timeout_ms = self.cfg.control_timeout.as_millis() as u64,
                "poll core did not take a command in time; withdrawn, app told ETIMEDOUT"
            );
            self.send(
                i,
                Reply::err(libc::ETIMEDOUT).with_id(p.id).encode(),
                Vec::new(),
            );
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

//! The control thread: the Unix SOCK_SEQPACKET control socket, attach (regions passed with
//! SCM_RIGHTS), forwarding of socket operations to the poll core, app death and eviction.
//!
//! Everything slow lives here: memfd creation, mmap/munmap, socketpairs, logging. The poll core
//! gets finished objects through a lock-free queue and answers through another.
//!
//! The thread never blocks on one client: it is a single poll(2) loop over the listener and
//! every connection, and
//! * a request that needs the poll core is queued with a sequence number and the connection
//!   waits (we stop reading it) while every other connection is served; the answer is matched
//!   by (sequence, app), echoes the app's request id, and a late or stray answer is discarded;
//!   a command the poll core has not taken within `control_timeout` is withdrawn (nothing is
//!   done) and answered ETIMEDOUT; one it has taken is waited for however long it takes;
//! * replies are sent with MSG_DONTWAIT; a reply that does not fit waits in a one-reply outbox
//!   and the connection is not read meanwhile; a client that leaves it there for
//!   `reply_timeout` is disconnected (`ctrl_unread_disconnects`);
//! * a connection must say Hello within `hello_timeout` (`hello_timeouts`; rdsctl, which
//!   never does, asks Stats and Info: the wait for an Info's snapshot does not count, and its
//!   answer starts a fresh `hello_timeout`); a full rdsd
//!   answers EUSERS, a uid over its limits EDQUOT (with the limit as the reply's value), in a
//!   reply with id 0 before closing; root (uid 0) is not limited per uid, only by `max_apps`;
//! * every loop over client input is bounded per pass (accepts, one request per connection).

pub mod info;
pub mod metrics;
pub mod notify;

use crate::config::Config;
use crate::poll::{readiness, Channels, Cmd, CmdReply};
use crate::shm::region::{AppRegion, DaemonRegion};
use crate::stats::Stats;
use anyhow::{bail, Context, Result};
use shm_api::ctrl::{
    frame_id, HelloInfo, Reply, Request, LEGACY_REQUEST_LEN, MAX_DATAGRAM, REQUEST_LEN,
};
use shm_api::layout::{DAEMON_REGION_LEN, LAYOUT_VERSION};
use shm_api::sys;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections accepted per pass of the loop.
const ACCEPTS_PER_PASS: usize = 64;
/// Longest the loop sleeps in poll(2) (it also wakes for every deadline and poll-core answer).
const MAX_WAIT: Duration = Duration::from_millis(200);

/// What a connection waits for from the poll core.
enum Waiting {
    /// An ordinary request; SocketOpen carries the app's end of the readiness pair.
    Request { pollable: Option<OwnedFd> },
    /// Attach: the descriptors and body of the Hello reply.
    Attach { fds: [OwnedFd; 3], info: HelloInfo },
    /// Info: a snapshot from each poll thread in turn (shard 0, with the transports, first),
    /// for these sections (`ctrl::INFO_*`); `gathered` is what came so far.
    Info {
        sections: u32,
        gathered: Option<Box<crate::poll::snapshot::PollSnapshot>>,
    },
}

/// The one command of a connection in flight on the poll core.
struct Pending {
    seq: u64,
    /// The app's request id, echoed in the reply.
    id: u64,
    deadline: Instant,
    /// Withdrawal failed: the poll core has taken it, so its answer is coming.
    taken: bool,
    what: Waiting,
}

/// A reply that did not fit in the client's socket yet.
struct Outbox {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    since: Instant,
}

struct Conn {
    /// Unique for the life of rdsd (a slot index is reused).
    serial: u64,
    fd: OwnedFd,
    pid: i32,
    uid: u32,
    /// Until a Hello has been accepted: when the connection is closed for silence.
    hello_by: Option<Instant>,
    attached: bool,
    pending: Option<Pending>,
    outbox: Option<Outbox>,
}

impl Conn {
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

enum Slot {
    Free,
    Conn(Box<Conn>),
    /// The connection is gone; the poll core still owes the answer to Detach `seq` (the
    /// region). The slot (the app index) is not reused until then.
    Detaching {
        seq: u64,
        uid: u32,
    },
}

/// The control thread's state.
pub struct Control {
    cfg: Arc<Config>,
    stats: Arc<Stats>,
    daemon: Arc<DaemonRegion>,
    chans: Arc<Channels>,
    /// Per poll thread: wakes it when parked (rdsd's own eventfds, never passed to an app).
    doorbells: Vec<Arc<OwnedFd>>,
    /// Per app index: the poll thread (shard) serving that app.
    app_shard: Vec<usize>,
    /// The poll core rings this when answers or evictions are queued (rdsd's own).
    wake: Arc<OwnedFd>,
    listener: OwnedFd,
    path: PathBuf,
    slots: Vec<Slot>,
    /// Commands not yet on the queue (kept while `outstanding` is at the queue's capacity).
    backlog: VecDeque<(u64, Cmd)>,
    /// Commands on the queue or being run whose answers we have not taken yet.
    outstanding: usize,
    /// Withdrawn Attach commands whose regions have not come back yet: (seq, uid).
    withdrawn: Vec<(u64, u32)>,
    next_seq: u64,
    next_serial: u64,
    buf: Vec<u8>,
    shutdown: Arc<AtomicBool>,
    poll_alive: Arc<AtomicBool>,
    /// When this rdsd started (for `rdsctl info`).
    started: info::Started,
}

/// The peer's (pid, uid), as the kernel recorded them at connect(2).
fn peer_cred(fd: RawFd) -> (i32, u32) {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut _,
            &mut len,
        )
    };
    if r == 0 {
        (cred.pid, cred.uid)
    } else {
        (-1, u32::MAX)
    }
}

/// Creates the listening control socket at `path` (mode 0660, optional group).
pub fn listen(path: &Path, group: Option<&str>) -> Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if sys::connect_seqpacket(path).is_ok() {
            bail!("another rdsd is already serving {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    // SAFETY: plain socket(2), checked and owned.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket(AF_UNIX, SOCK_SEQPACKET)");
    }
    // SAFETY: fresh fd.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        bail!("control socket path too long: {}", path.display());
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: valid address of the stated length.
    if unsafe {
        libc::bind(
            fd,
            &addr as *const _ as *const _,
            std::mem::size_of::<libc::sockaddr_un>() as u32,
        )
    } < 0
    {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("bind {}", path.display()));
    }
    // SAFETY: listen on our bound socket.
    if unsafe { libc::listen(fd, 128) } < 0 {
        return Err(std::io::Error::last_os_error()).context("listen");
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    if let Some(g) = group {
        let cg = std::ffi::CString::new(g)?;
        // SAFETY: getgrnam returns a pointer to static storage or null; read gr_gid immediately.
        let gid = unsafe {
            let gr = libc::getgrnam(cg.as_ptr());
            if gr.is_null() {
                bail!("control_group {g:?} does not exist");
            }
            (*gr).gr_gid
        };
        let cpath = std::ffi::CString::new(bytes)?;
        // SAFETY: valid path; uid -1 leaves the owner alone.
        if unsafe { libc::chown(cpath.as_ptr(), u32::MAX, gid) } < 0 {
            return Err(std::io::Error::last_os_error()).context("chown control socket");
        }
    }
    Ok(sock)
}

impl Control {
    /// Sets up the control thread's state around an already listening socket.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        daemon: Arc<DaemonRegion>,
        chans: Arc<Channels>,
        doorbells: Vec<Arc<OwnedFd>>,
        wake: Arc<OwnedFd>,
        listener: OwnedFd,
        shutdown: Arc<AtomicBool>,
        poll_alive: Arc<AtomicBool>,
    ) -> Control {
        let n = cfg.max_apps as usize;
        let path = cfg.control_socket.clone();
        Control {
            cfg,
            stats,
            daemon,
            chans,
            doorbells,
            app_shard: vec![0; n],
            wake,
            listener,
            path,
            slots: (0..n).map(|_| Slot::Free).collect(),
            backlog: VecDeque::new(),
            outstanding: 0,
            withdrawn: Vec::new(),
            next_seq: 1,
            next_serial: 1,
            buf: vec![0u8; MAX_DATAGRAM],
            shutdown,
            poll_alive,
            started: info::Started::now(),
        }
    }

    fn conn(&mut self, i: usize) -> Option<&mut Conn> {
        match self.slots.get_mut(i) {
            Some(Slot::Conn(c)) => Some(c),
            _ => None,
        }
    }

    /// Serves until shutdown.
    pub fn run(&mut self) {
        // The control socket listens and the poll core runs: tell systemd (Type=notify).
        let ready = format!(
            "READY=1\nSTATUS=serving {}\nMAINPID={}",
            self.path.display(),
            std::process::id()
        );
        match notify::notify(&ready) {
            Ok(true) => tracing::info!("told systemd we are ready"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)"),
        }
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut idx: Vec<(usize, u64)> = Vec::new();
        while !self.shutdown.load(Ordering::Relaxed) && self.poll_alive.load(Ordering::Relaxed) {
            pfds.clear();
            idx.clear();
            pfds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            pfds.push(libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for (i, slot) in self.slots.iter().enumerate() {
                if let Slot::Conn(c) = slot {
                    // One request at a time per connection: don't read the next before the
                    // current one is answered and its reply is out.
                    let events = if c.outbox.is_some() {
                        libc::POLLOUT
                    } else if c.pending.is_none() {
                        libc::POLLIN
                    } else {
                        0
                    };
                    pfds.push(libc::pollfd {
                        fd: c.fd.as_raw_fd(),
                        events,
                        revents: 0,
                    });
                    idx.push((i, c.serial));
                }
            }
            let wait = self.next_deadline().map_or(MAX_WAIT, |d| {
                d.saturating_duration_since(Instant::now()).min(MAX_WAIT)
            });
            // Round up so a deadline is never polled for repeatedly with 0 ms.
            let ms = wait.as_micros().div_ceil(1000) as libc::c_int;
            // SAFETY: pfds is a valid array of pollfd.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            if pfds[1].revents != 0 {
                // Our own eventfd: non-blocking by construction, no app can reach it.
                sys::eventfd_drain(self.wake.as_raw_fd());
            }
            self.take_evictions();
            self.take_replies();
            for (k, &(i, serial)) in idx.iter().enumerate() {
                let rev = pfds[k + 2].revents;
                if rev == 0 || !matches!(&self.slots[i], Slot::Conn(c) if c.serial == serial) {
                    continue;
                }
                if rev & libc::POLLOUT != 0 {
                    self.flush(i);
                } else if rev & libc::POLLIN != 0 {
                    self.serve(i);
                } else if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                    self.disconnect(i);
                }
            }
            if pfds[0].revents & libc::POLLIN != 0 {
                self.accept_all();
            }
            self.check_deadlines(Instant::now());
            self.flush_backlog();
        }
        let _ = notify::notify("STOPPING=1");
        // The poll thread stops too and frees the regions it holds; connections close here.
        self.backlog.clear();
        self.slots.clear();
        let _ = std::fs::remove_file(&self.path);
    }

    fn next_deadline(&self) -> Option<Instant> {
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

    fn take_evictions(&mut self) {
        while let Some(app) = self.chans.evictions.pop() {
            if let Some(c) = self.conn(app) {
                // SAFETY: shutdown on an fd we own. The app sees its control socket close:
                // a clear "rdsd dropped you".
                unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
    }

    fn take_replies(&mut self) {
        while let Some((seq, app, reply)) = self.chans.replies.pop() {
            self.outstanding = self.outstanding.saturating_sub(1);
            self.complete(seq, app, reply);
        }
    }

    fn free_region(&self, region: AppRegion) {
        if region.release() {
            Stats::bump(&self.stats.regions_freed);
        }
    }

    /// An answer from the poll core: match it to what waits for it, by (seq, app).
    fn complete(&mut self, seq: u64, app: usize, reply: CmdReply) {
        let reply = match reply {
            CmdReply::Withdrawn(region) => {
                // Expected: we withdrew it and answered ETIMEDOUT already.
                self.withdrawn.retain(|w| w.0 != seq);
                if let Some(r) = region {
                    self.free_region(r);
                }
                return;
            }
            r => r,
        };
        match self.slots.get(app) {
            Some(Slot::Detaching { seq: s, .. }) if *s == seq => {
                if let CmdReply::Detached(Some(region)) = reply {
                    self.free_region(region);
                }
                self.slots[app] = Slot::Free;
                tracing::debug!(app, "app slot free");
                return;
            }
            Some(Slot::Conn(c)) if c.pending.as_ref().is_some_and(|p| p.seq == seq) => {
                let p = self
                    .conn(app)
                    .and_then(|c| c.pending.take())
                    .expect("pending");
                return self.answer(app, p, reply);
            }
            _ => {}
        }
        // Nobody waits for it (its connection went away): never sent to anyone.
        Stats::bump(&self.stats.ctrl_stale_replies);
        tracing::debug!(seq, app, "discarding a stale poll-core answer");
        if let CmdReply::Detached(Some(region)) = reply {
            self.free_region(region);
        }
    }

    fn answer(&mut self, i: usize, p: Pending, reply: CmdReply) {
        match (p.what, reply) {
            (Waiting::Request { pollable }, CmdReply::Reply(r)) => {
                let fds = match pollable {
                    Some(fd) if r.errno == 0 => vec![fd],
                    _ => Vec::new(),
                };
                self.send(i, r.with_id(p.id).encode(), fds);
            }
            (Waiting::Info { sections, gathered }, CmdReply::Snapshot(snap)) => {
                let snap = match gathered {
                    None => snap,
                    Some(mut g) => {
                        g.shards_seen = snap.shards_seen;
                        g.sockets.extend(snap.sockets);
                        g
                    }
                };
                let next = snap.shards_seen;
                if next < self.doorbells.len() {
                    let cmd = Cmd::Snapshot {
                        app: i,
                        shard: next,
                    };
                    let what = Waiting::Info {
                        sections,
                        gathered: Some(snap),
                    };
                    return self.submit(i, p.id, cmd, what);
                }
                // A client without Hello (rdsctl) gets a fresh hello_timeout from its answer
                // (the wait for the poll core is not its silence).
                let fresh = Instant::now() + self.cfg.hello_timeout;
                if let Some(t) = self.conn(i).and_then(|c| c.hello_by.as_mut()) {
                    *t = fresh;
                }
                let r = self.info_reply(sections, Some(*snap)).with_id(p.id);
                self.send(i, r.encode(), Vec::new());
            }
            (Waiting::Attach { fds, info }, CmdReply::Attached) => {
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

    /// Sends a reply without ever blocking; what doesn't fit waits in the outbox.
    fn send(&mut self, i: usize, bytes: Vec<u8>, fds: Vec<OwnedFd>) {
        let Some(c) = self.conn(i) else { return };
        if c.outbox.is_some() {
            // Can't happen (a connection with an outbox is not read), but never queue more.
            return self.drop_unread(i);
        }
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        match sys::send_with_fds_flags(c.fd.as_raw_fd(), &bytes, &raw, libc::MSG_DONTWAIT) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                c.outbox = Some(Outbox {
                    bytes,
                    fds,
                    since: Instant::now(),
                });
            }
            Err(_) => self.disconnect(i),
        }
    }

    fn flush(&mut self, i: usize) {
        let Some(c) = self.conn(i) else { return };
        let Some(o) = c.outbox.take() else { return };
        let raw: Vec<RawFd> = o.fds.iter().map(|f| f.as_raw_fd()).collect();
        match sys::send_with_fds_flags(c.fd.as_raw_fd(), &o.bytes, &raw, libc::MSG_DONTWAIT) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => c.outbox = Some(o),
            Err(_) => self.disconnect(i),
        }
    }

    fn drop_unread(&mut self, i: usize) {
        if let Some(c) = self.conn(i) {
            tracing::warn!(
                pid = c.pid,
                uid = c.uid,
                app = i,
                "disconnecting a client that does not read its control replies"
            );
        }
        Stats::bump(&self.stats.ctrl_unread_disconnects);
        self.disconnect(i);
    }

    fn check_deadlines(&mut self, now: Instant) {
        let reply_timeout = self.cfg.reply_timeout;
        let stats = self.stats.clone();
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
                Stats::bump(&stats.hello_timeouts);
                let bye = Reply::err(libc::ETIMEDOUT).encode();
                let _ = sys::send_with_fds_flags(c.fd.as_raw_fd(), &bye, &[], libc::MSG_DONTWAIT);
                self.disconnect(i);
                continue;
            }
            let Some(p) = c.pending.as_mut().filter(|p| !p.taken && now >= p.deadline) else {
                continue;
            };
            let (seq, uid) = (p.seq, c.uid);
            if let Some(pos) = self.backlog.iter().position(|(s, _)| *s == seq) {
                // Never reached the poll core.
                let (_, cmd) = self.backlog.remove(pos).expect("present");
                if let Cmd::Attach { region, .. } = cmd {
                    self.free_region(region);
                }
            } else if self.chans.withdraw(i, seq) {
                if let Some(Pending {
                    what: Waiting::Attach { .. },
                    ..
                }) = self.conn(i).and_then(|c| c.pending.as_ref())
                {
                    self.withdrawn.push((seq, uid));
                }
            } else {
                // The poll core is running it: its answer is coming, however late.
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

    /// Queues a command for the poll core (sent as soon as the queues have room).
    fn enqueue(&mut self, seq: u64, cmd: Cmd) {
        self.backlog.push_back((seq, cmd));
        self.flush_backlog();
    }

    fn flush_backlog(&mut self) {
        let mut pushed = 0u64;
        while self.outstanding < self.chans.replies.capacity() {
            let Some(item) = self.backlog.pop_front() else {
                break;
            };
            // Introspection names its poll thread; the rest goes to the app's.
            let shard = match item.1 {
                Cmd::Snapshot { shard, .. } => shard,
                ref c => self.app_shard[c.app()],
            };
            match self.chans.cmds[shard].push(item) {
                Ok(()) => {
                    self.outstanding += 1;
                    pushed |= 1 << shard;
                }
                Err(back) => {
                    self.backlog.push_front(back);
                    break;
                }
            }
        }
        for (k, d) in self.doorbells.iter().enumerate() {
            if pushed & (1 << k) != 0 {
                sys::eventfd_signal(d.as_raw_fd());
            }
        }
    }

    /// The poll thread for a new app: the one serving the fewest apps (ties: the lowest), so
    /// that one rank per core spreads over the poll threads.
    fn pick_shard(&self) -> usize {
        let mut load = vec![0u32; self.doorbells.len()];
        for (i, s) in self.slots.iter().enumerate() {
            let counts = match s {
                Slot::Conn(c) => {
                    c.attached
                        || matches!(
                            c.pending,
                            Some(Pending {
                                what: Waiting::Attach { .. },
                                ..
                            })
                        )
                }
                Slot::Detaching { .. } => true,
                Slot::Free => false,
            };
            if counts {
                load[self.app_shard[i]] += 1;
            }
        }
        (0..load.len()).min_by_key(|&k| load[k]).unwrap_or(0)
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Sends a withdrawable command for connection `i`, which waits for its answer.
    fn submit(&mut self, i: usize, id: u64, cmd: Cmd, what: Waiting) {
        let seq = self.next_seq();
        let deadline = Instant::now() + self.cfg.control_timeout;
        let Some(c) = self.conn(i) else { return };
        c.pending = Some(Pending {
            seq,
            id,
            deadline,
            taken: false,
            what,
        });
        self.chans.arm(i, seq);
        self.enqueue(seq, cmd);
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

    fn accept_all(&mut self) {
        for _ in 0..ACCEPTS_PER_PASS {
            // SAFETY: accept4 on our listener; the result is checked and owned.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd < 0 {
                return;
            }
            // SAFETY: fresh fd from accept4.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let (pid, uid) = peer_cred(fd.as_raw_fd());
            let refuse = |errno: i32, limit: u32| {
                Stats::bump(&self.stats.attach_refused);
                let mut r = Reply::err(errno);
                r.value = limit as u64;
                let _ =
                    sys::send_with_fds_flags(fd.as_raw_fd(), &r.encode(), &[], libc::MSG_DONTWAIT);
            };
            let Some(i) = self.slots.iter().position(|s| matches!(s, Slot::Free)) else {
                tracing::warn!(
                    pid,
                    uid,
                    max_apps = self.cfg.max_apps,
                    "refusing app: max_apps reached"
                );
                Stats::bump(&self.stats.attach_refused_max_apps);
                refuse(libc::EUSERS, self.cfg.max_apps);
                continue;
            };
            if uid != 0 && self.conns_of(uid) >= self.cfg.max_apps_per_uid {
                tracing::warn!(
                    pid,
                    uid,
                    max_apps_per_uid = self.cfg.max_apps_per_uid,
                    "refusing app: its uid is at max_apps_per_uid"
                );
                Stats::bump(&self.stats.attach_refused_uid_apps);
                refuse(libc::EDQUOT, self.cfg.max_apps_per_uid);
                continue;
            }
            tracing::debug!(pid, uid, app = i, "control connection");
            let serial = self.next_serial;
            self.next_serial += 1;
            self.slots[i] = Slot::Conn(Box::new(Conn {
                serial,
                fd,
                pid,
                uid,
                hello_by: Some(Instant::now() + self.cfg.hello_timeout),
                attached: false,
                pending: None,
                outbox: None,
            }));
        }
    }

    fn disconnect(&mut self, i: usize) {
        let Slot::Conn(c) = std::mem::replace(&mut self.slots[i], Slot::Free) else {
            return;
        };
        let mut detach = c.attached;
        if let Some(p) = &c.pending {
            if let Some(pos) = self.backlog.iter().position(|(s, _)| *s == p.seq) {
                let (_, cmd) = self.backlog.remove(pos).expect("present");
                if let Cmd::Attach { region, .. } = cmd {
                    self.free_region(region);
                }
            } else if matches!(p.what, Waiting::Attach { .. }) {
                if self.chans.withdraw(i, p.seq) {
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
            self.enqueue(seq, Cmd::Detach { app: i });
            tracing::info!(pid = c.pid, uid = c.uid, app = i, "app detached");
        }
        // Dropping `c` closes the connection.
    }

    fn serve(&mut self, i: usize) {
        let Some(fd) = self.conn(i).map(|c| c.fd.as_raw_fd()) else {
            return;
        };
        // Descriptors a client attaches are taken and closed here.
        let (n, _fds) = match sys::recv_with_fds(fd, &mut self.buf, libc::MSG_DONTWAIT) {
            Ok((0, _)) => return self.disconnect(i),
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => return self.disconnect(i),
        };
        let mut frame = [0u8; REQUEST_LEN];
        let len = n.min(REQUEST_LEN);
        frame[..len].copy_from_slice(&self.buf[..len]);
        if n == LEGACY_REQUEST_LEN {
            if let Ok(req) = Request::decode_legacy(&frame[..n]) {
                return self.serve_legacy(i, req);
            }
        }
        let (id, req) = match Request::decode(&self.buf[..n]) {
            Ok(r) => r,
            Err(_) => {
                Stats::bump(&self.stats.ctrl_bad_requests);
                let r = Reply::err(libc::EINVAL).with_id(frame_id(&frame[..len]));
                return self.send(i, r.encode(), Vec::new());
            }
        };
        let attached = self.conn(i).is_some_and(|c| c.attached);
        match req {
            Request::Hello { version } => self.hello(i, id, version),
            Request::Stats => {
                let mut r = Reply::ok(0).with_id(id);
                r.body = self.stats.render().into_bytes();
                self.send(i, r.encode(), Vec::new());
            }
            Request::Info { sections } => {
                let sections = if sections == 0 {
                    shm_api::ctrl::INFO_ALL
                } else {
                    sections
                };
                if sections & !shm_api::ctrl::INFO_COUNTERS == 0 {
                    // Counters only: no need to bother the poll core.
                    let r = self.info_reply(sections, None).with_id(id);
                    self.send(i, r.encode(), Vec::new());
                } else {
                    self.submit(
                        i,
                        id,
                        Cmd::Snapshot { app: i, shard: 0 },
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
            Request::SocketOpen => match readiness::create() {
                Ok((app_end, state)) => self.submit(
                    i,
                    id,
                    Cmd::Request {
                        app: i,
                        req,
                        readiness: Some(state),
                    },
                    Waiting::Request {
                        pollable: Some(app_end),
                    },
                ),
                Err(e) => {
                    let r = Reply::err(e.raw_os_error().unwrap_or(libc::ENOMEM)).with_id(id);
                    self.send(i, r.encode(), Vec::new())
                }
            },
            _ => self.submit(
                i,
                id,
                Cmd::Request {
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
            Request::Hello { version } => {
                let pid = self.conn(i).map_or(-1, |c| c.pid);
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

    fn hello(&mut self, i: usize, id: u64, version: u32) {
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
        let shard = self.pick_shard();
        let region = match AppRegion::create(
            &format!("rdsd-app-{pid}"),
            self.cfg.geometry(),
            self.cfg.hugepages,
        ) {
            Ok(mut r) => {
                r.set_poll_shard(shard as u32);
                self.app_shard[i] = shard;
                r
            }
            Err(e) => {
                tracing::error!(pid, error = %e, "cannot create app region");
                Stats::bump(&self.stats.attach_refused);
                let errno = e.raw_os_error().unwrap_or(libc::ENOMEM);
                return self.send(i, refuse(errno), Vec::new());
            }
        };
        tracing::debug!(
            pid,
            app = i,
            bytes = region.len(),
            pages = if region.hugetlb() {
                "hugetlbfs 2 MiB"
            } else {
                "4 KiB + MADV_HUGEPAGE"
            },
            "app region created"
        );
        let info = HelloInfo {
            region_len: region.len() as u64,
            daemon_region_len: DAEMON_REGION_LEN as u64,
            hugetlb: region.hugetlb() as u32,
        };
        // The app's own descriptors: the region, its own description of the daemon region,
        // and its end of its own doorbell (rdsd keeps the other end).
        let fds = region.fd().try_clone().and_then(|region_fd| {
            let daemon_fd = self.daemon.fd_for_app()?;
            let (app_end, daemon_end) = sys::socketpair(libc::SOCK_DGRAM)?;
            Ok(([region_fd, daemon_fd, app_end], daemon_end))
        });
        let (fds, doorbell) = match fds {
            Ok(x) => x,
            Err(e) => {
                Stats::bump(&self.stats.attach_refused);
                self.free_region(region);
                let errno = e.raw_os_error().unwrap_or(libc::EMFILE);
                return self.send(i, refuse(errno), Vec::new());
            }
        };
        self.submit(
            i,
            id,
            Cmd::Attach {
                app: i,
                region,
                doorbell,
            },
            Waiting::Attach { fds, info },
        );
    }
}

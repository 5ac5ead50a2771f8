//! The control thread: the Unix SOCK_SEQPACKET control socket, attach (regions passed with
//! SCM_RIGHTS), forwarding of socket operations to the poll core, app death and eviction.
//!
//! Everything slow lives here: memfd creation, mmap/munmap, socketpairs, logging. The poll core
//! gets finished objects through a lock-free queue and answers through another.
//!
//! The rules below live in `engine.rs` ([`engine::Engine`], no I/O, unit-tested on a made-up
//! clock); this file keeps the sockets, SCM_RIGHTS, region creation ([`engine::Host`]) and
//! poll(2), feeds the engine what happened and carries out what it asks.
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

pub mod engine;
pub mod info;
pub mod metrics;
pub mod notify;

use crate::config::Config;
use crate::poll::{readiness, Channels, Cmd, CmdReply};
use crate::shm::region::{AppRegion, DaemonRegion};
use crate::stats::Stats;
use anyhow::{bail, Context, Result};
use engine::{Action, Answer, Attachment, Command, Engine, Host, Interest};
use shm_api::ctrl::{HelloInfo, MAX_DATAGRAM};
use shm_api::layout::DAEMON_REGION_LEN;
use shm_api::sys;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections accepted per pass of the loop.
const ACCEPTS_PER_PASS: usize = 64;
/// Longest the loop sleeps in poll(2) (it also wakes for every deadline and poll-core answer).
const MAX_WAIT: Duration = Duration::from_millis(200);

/// The engine's [`Host`] in rdsd: regions, descriptors and the claim words of [`Channels`].
struct Syscalls {
    cfg: Arc<Config>,
    stats: Arc<Stats>,
    daemon: Arc<DaemonRegion>,
    chans: Arc<Channels>,
}

fn free_region(stats: &Stats, region: AppRegion) {
    if region.release() {
        Stats::bump(&stats.regions_freed);
    }
}

impl Host for Syscalls {
    type Region = AppRegion;
    type Fd = OwnedFd;
    type Readiness = readiness::Readiness;

    fn attachment(&mut self, pid: i32, shard: usize) -> Result<Attachment<Self>, i32> {
        let mut region = match AppRegion::create(
            &format!("rdsd-app-{pid}"),
            self.cfg.geometry(),
            self.cfg.hugepages,
        ) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(pid, error = %e, "cannot create app region");
                return Err(e.raw_os_error().unwrap_or(libc::ENOMEM));
            }
        };
        region.set_poll_shard(shard as u32);
        tracing::debug!(
            pid,
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
            poll_threads: self.cfg.poll_cores.len() as u32,
            placement: self.cfg.placement.code(),
        };
        // The app's own descriptors: the region, its own description of the daemon region,
        // and its end of its own doorbell (rdsd keeps the other end).
        let fds = region.fd().try_clone().and_then(|region_fd| {
            let daemon_fd = self.daemon.fd_for_app()?;
            let (app_end, daemon_end) = sys::socketpair(libc::SOCK_DGRAM)?;
            Ok(([region_fd, daemon_fd, app_end], daemon_end))
        });
        match fds {
            Ok((fds, doorbell)) => Ok(Attachment {
                region,
                fds,
                doorbell,
                info,
            }),
            Err(e) => {
                free_region(&self.stats, region);
                Err(e.raw_os_error().unwrap_or(libc::EMFILE))
            }
        }
    }

    fn readiness(&mut self) -> Result<(OwnedFd, readiness::Readiness), i32> {
        readiness::create().map_err(|e| e.raw_os_error().unwrap_or(libc::ENOMEM))
    }

    fn arm(&mut self, app: usize, seq: u64) {
        self.chans.arm(app, seq);
    }

    fn withdraw(&mut self, app: usize, seq: u64) -> bool {
        self.chans.withdraw(app, seq)
    }

    fn document(&mut self, bytes: &[u8]) -> Result<OwnedFd, i32> {
        crate::shm::region::sealed_copy("rdsd-info", bytes)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::ENOMEM))
    }
}

fn to_cmd(c: Command<Syscalls>) -> Cmd {
    match c {
        Command::Attach {
            app,
            region,
            doorbell,
            uid,
        } => Cmd::Attach {
            app,
            region,
            doorbell,
            uid,
        },
        Command::Detach { app } => Cmd::Detach { app },
        Command::Request {
            app,
            req,
            readiness,
        } => Cmd::Request {
            app,
            req,
            readiness,
        },
        Command::Snapshot {
            app,
            shard,
            messages,
        } => Cmd::Snapshot {
            app,
            shard,
            messages,
        },
    }
}

fn from_cmd(c: Cmd) -> Command<Syscalls> {
    match c {
        Cmd::Attach {
            app,
            region,
            doorbell,
            uid,
        } => Command::Attach {
            app,
            region,
            doorbell,
            uid,
        },
        Cmd::Detach { app } => Command::Detach { app },
        Cmd::Request {
            app,
            req,
            readiness,
        } => Command::Request {
            app,
            req,
            readiness,
        },
        Cmd::Snapshot {
            app,
            shard,
            messages,
        } => Command::Snapshot {
            app,
            shard,
            messages,
        },
    }
}

fn to_answer(r: CmdReply) -> Answer<Syscalls> {
    match r {
        CmdReply::Reply(r) => Answer::Reply(r),
        CmdReply::Detached(r) => Answer::Detached(r),
        CmdReply::Attached => Answer::Attached,
        CmdReply::Withdrawn(r) => Answer::Withdrawn(r),
        CmdReply::Snapshot(s) => Answer::Snapshot(s),
    }
}

/// An open control connection: its socket, and a serial unique for the life of rdsd (a slot
/// index is reused).
struct Link {
    serial: u64,
    fd: OwnedFd,
}

/// The control thread: sockets and poll(2) around the [`Engine`].
pub struct Control {
    stats: Arc<Stats>,
    chans: Arc<Channels>,
    /// Per poll thread: wakes it when parked (rdsd's own eventfds, never passed to an app).
    doorbells: Vec<Arc<OwnedFd>>,
    /// The poll core rings this when answers or evictions are queued (rdsd's own).
    wake: Arc<OwnedFd>,
    listener: OwnedFd,
    path: PathBuf,
    /// Per app index: the connection's socket, while the engine has a connection there.
    links: Vec<Option<Link>>,
    engine: Engine<Syscalls>,
    next_serial: u64,
    buf: Vec<u8>,
    shutdown: Arc<AtomicBool>,
    poll_alive: Arc<AtomicBool>,
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
        let host = Syscalls {
            cfg: cfg.clone(),
            stats: stats.clone(),
            daemon,
            chans: chans.clone(),
        };
        let engine = Engine::new(
            cfg,
            stats.clone(),
            host,
            doorbells.len(),
            chans.replies.capacity(),
            info::Started::now(),
        );
        Control {
            stats,
            chans,
            doorbells,
            wake,
            listener,
            path,
            links: (0..n).map(|_| None).collect(),
            engine,
            next_serial: 1,
            buf: vec![0u8; MAX_DATAGRAM],
            shutdown,
            poll_alive,
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
            for (i, link) in self.links.iter().enumerate() {
                let Some(link) = link else { continue };
                let events = match self.engine.interest(i) {
                    Some(Interest::Write) => libc::POLLOUT,
                    Some(Interest::Read) => libc::POLLIN,
                    Some(Interest::Hangup) | None => 0,
                };
                pfds.push(libc::pollfd {
                    fd: link.fd.as_raw_fd(),
                    events,
                    revents: 0,
                });
                idx.push((i, link.serial));
            }
            let wait = self.engine.next_deadline().map_or(MAX_WAIT, |d| {
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
                if rev == 0 || self.links[i].as_ref().is_none_or(|l| l.serial != serial) {
                    continue;
                }
                if rev & libc::POLLOUT != 0 {
                    self.flush(i);
                } else if rev & libc::POLLIN != 0 {
                    self.serve(i);
                } else if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                    self.engine.hung_up(i);
                }
                self.carry_out();
            }
            if pfds[0].revents & libc::POLLIN != 0 {
                self.accept_all();
            }
            self.engine.tick(Instant::now());
            self.carry_out();
        }
        let _ = notify::notify("STOPPING=1");
        // The poll thread stops too and frees the regions it holds; connections close here.
        self.engine.stop();
        self.links.clear();
        let _ = std::fs::remove_file(&self.path);
    }

    /// Does what the engine asked, in order (a send that does not fit, or fails, goes back
    /// to it at once), then rings the doorbells of the poll threads that got commands.
    fn carry_out(&mut self) {
        let mut pushed = 0u64;
        while let Some(action) = self.engine.next_action() {
            match action {
                Action::Send { conn, bytes, fds } => {
                    let Some(link) = self.links.get(conn).and_then(Option::as_ref) else {
                        continue;
                    };
                    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
                    let sent = sys::send_with_fds_flags(
                        link.fd.as_raw_fd(),
                        &bytes,
                        &raw,
                        libc::MSG_DONTWAIT,
                    );
                    match sent {
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            self.engine.send_blocked(Instant::now(), conn, bytes, fds)
                        }
                        Err(_) => self.engine.hung_up(conn),
                    }
                }
                Action::Close { conn, farewell } => {
                    // Dropping the link closes the connection.
                    let Some(link) = self.links.get_mut(conn).and_then(Option::take) else {
                        continue;
                    };
                    if let Some(bye) = farewell {
                        let fd = link.fd.as_raw_fd();
                        let _ = sys::send_with_fds_flags(fd, &bye, &[], libc::MSG_DONTWAIT);
                    }
                }
                Action::Queue { shard, seq, cmd } => {
                    match self.chans.cmds[shard].push((seq, to_cmd(cmd))) {
                        Ok(()) => pushed |= 1 << shard,
                        Err((seq, back)) => self.engine.requeue(seq, from_cmd(back)),
                    }
                }
                Action::FreeRegion(region) => free_region(&self.stats, region),
            }
        }
        for (k, d) in self.doorbells.iter().enumerate() {
            if pushed & (1 << k) != 0 {
                sys::eventfd_signal(d.as_raw_fd());
            }
        }
    }

    fn take_evictions(&mut self) {
        while let Some(app) = self.chans.evictions.pop() {
            if let Some(link) = self.links.get(app).and_then(Option::as_ref) {
                // SAFETY: shutdown on an fd we own. The app sees its control socket close:
                // a clear "rdsd dropped you".
                unsafe { libc::shutdown(link.fd.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
    }

    fn take_replies(&mut self) {
        while let Some((seq, app, reply)) = self.chans.replies.pop() {
            self.engine
                .answer(Instant::now(), seq, app, to_answer(reply));
            self.carry_out();
        }
    }

    /// Sends connection `i`'s outbox, if its socket has room now.
    fn flush(&mut self, i: usize) {
        let Some(link) = self.links.get(i).and_then(Option::as_ref) else {
            return;
        };
        let Some((bytes, fds)) = self.engine.outbox(i) else {
            return;
        };
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        match sys::send_with_fds_flags(link.fd.as_raw_fd(), bytes, &raw, libc::MSG_DONTWAIT) {
            Ok(_) => self.engine.outbox_sent(i),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => self.engine.hung_up(i),
        }
    }

    /// Reads one request of connection `i`.
    fn serve(&mut self, i: usize) {
        let Some(link) = self.links.get(i).and_then(Option::as_ref) else {
            return;
        };
        // Descriptors a client attaches are taken and closed here.
        let (n, _fds) =
            match sys::recv_with_fds(link.fd.as_raw_fd(), &mut self.buf, libc::MSG_DONTWAIT) {
                Ok((0, _)) => return self.engine.hung_up(i),
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => return self.engine.hung_up(i),
            };
        self.engine.received(Instant::now(), i, &self.buf[..n]);
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
            match self.engine.accept(Instant::now(), pid, uid) {
                Ok(i) => {
                    let serial = self.next_serial;
                    self.next_serial += 1;
                    self.links[i] = Some(Link { serial, fd });
                }
                Err(refusal) => {
                    let raw = fd.as_raw_fd();
                    let _ = sys::send_with_fds_flags(raw, &refusal, &[], libc::MSG_DONTWAIT);
                }
            }
        }
    }
}

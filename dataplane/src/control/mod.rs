//! The control thread: the Unix SOCK_SEQPACKET control socket, attach (regions passed with
//! SCM_RIGHTS), forwarding of socket operations to the poll core, app death and eviction.
//!
//! Everything slow lives here: memfd creation, mmap/munmap, socketpairs, logging. The poll core
//! gets finished objects through a lock-free queue and answers through another.

use crate::config::Config;
use crate::poll::{readiness, Channels, Cmd, CmdReply};
use crate::shm::region::{AppRegion, DaemonRegion};
use crate::stats::Stats;
use anyhow::{bail, Context, Result};
use shm_api::ctrl::{HelloInfo, Reply, Request, MAX_DATAGRAM};
use shm_api::layout::{DAEMON_REGION_LEN, LAYOUT_VERSION};
use shm_api::sys;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Conn {
    fd: OwnedFd,
    pid: i32,
    attached: bool,
}

/// The control thread's state.
pub struct Control {
    cfg: Arc<Config>,
    stats: Arc<Stats>,
    daemon: Arc<DaemonRegion>,
    chans: Arc<Channels>,
    doorbell: Arc<OwnedFd>,
    wake: Arc<OwnedFd>,
    listener: OwnedFd,
    path: PathBuf,
    conns: Vec<Option<Conn>>,
    shutdown: Arc<AtomicBool>,
    poll_alive: Arc<AtomicBool>,
}

fn peer_pid(fd: RawFd) -> i32 {
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
        cred.pid
    } else {
        -1
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
        doorbell: Arc<OwnedFd>,
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
            doorbell,
            wake,
            listener,
            path,
            conns: (0..n).map(|_| None).collect(),
            shutdown,
            poll_alive,
        }
    }

    /// Serves until shutdown. Detaches every app on the way out.
    pub fn run(&mut self) {
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut idx: Vec<usize> = Vec::new();
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
            for (i, c) in self.conns.iter().enumerate() {
                if let Some(c) = c {
                    pfds.push(libc::pollfd {
                        fd: c.fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    idx.push(i);
                }
            }
            // SAFETY: pfds is a valid array of pollfd.
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 200) };
            if n <= 0 {
                continue;
            }
            if pfds[1].revents != 0 {
                sys::eventfd_drain(self.wake.as_raw_fd());
                while let Some(app) = self.chans.evictions.pop() {
                    if let Some(c) = &self.conns[app] {
                        // The app sees its control socket close: a clear "rdsd dropped you".
                        // SAFETY: shutdown on an fd we own.
                        unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
                    }
                }
            }
            if pfds[0].revents & libc::POLLIN != 0 {
                self.accept_all();
            }
            for (k, &i) in idx.iter().enumerate() {
                let rev = pfds[k + 2].revents;
                if rev == 0 {
                    continue;
                }
                if rev & libc::POLLIN != 0 {
                    self.serve(i);
                } else if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                    self.disconnect(i);
                }
            }
        }
        for i in 0..self.conns.len() {
            if self.conns[i].is_some() {
                self.disconnect(i);
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }

    fn accept_all(&mut self) {
        loop {
            // SAFETY: accept4 on our listener; the result is checked and owned.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                return;
            }
            // SAFETY: fresh fd from accept4.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let pid = peer_pid(fd.as_raw_fd());
            match self.conns.iter().position(|c| c.is_none()) {
                Some(i) => {
                    tracing::debug!(pid, app = i, "control connection");
                    self.conns[i] = Some(Conn {
                        fd,
                        pid,
                        attached: false,
                    });
                }
                None => {
                    tracing::warn!(pid, "refusing app: max_apps reached");
                    Stats::bump(&self.stats.attach_refused);
                    let _ =
                        sys::send_with_fds(fd.as_raw_fd(), &Reply::err(libc::EUSERS).encode(), &[]);
                }
            }
        }
    }

    fn disconnect(&mut self, i: usize) {
        let Some(c) = self.conns[i].take() else {
            return;
        };
        if c.attached {
            if let Some(CmdReply::Detached(region)) = self.exec(Cmd::Detach { app: i }) {
                // Unmapped here, off the poll core.
                drop(region);
            }
            tracing::info!(pid = c.pid, app = i, "app detached");
        }
    }

    /// Runs one command on the poll core and waits for its answer.
    fn exec(&self, mut cmd: Cmd) -> Option<CmdReply> {
        loop {
            match self.chans.cmds.push(cmd) {
                Ok(()) => break,
                Err(back) => {
                    cmd = back;
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        sys::eventfd_signal(self.doorbell.as_raw_fd());
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.chans.replies.pop() {
                return Some(r);
            }
            if !self.poll_alive.load(Ordering::Relaxed) || start.elapsed() > Duration::from_secs(10)
            {
                tracing::error!("poll core did not answer a command");
                return None;
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn reply(&self, i: usize, r: &Reply, fds: &[RawFd]) {
        if let Some(c) = &self.conns[i] {
            let _ = sys::send_with_fds(c.fd.as_raw_fd(), &r.encode(), fds);
        }
    }

    fn serve(&mut self, i: usize) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let fd = match &self.conns[i] {
            Some(c) => c.fd.as_raw_fd(),
            None => return,
        };
        let (n, _fds) = match sys::recv_with_fds(fd, &mut buf, libc::MSG_DONTWAIT) {
            Ok((0, _)) => return self.disconnect(i),
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => return self.disconnect(i),
        };
        let req = match Request::decode(&buf[..n]) {
            Ok(r) => r,
            Err(_) => {
                Stats::bump(&self.stats.ctrl_bad_requests);
                return self.reply(i, &Reply::err(libc::EINVAL), &[]);
            }
        };
        let attached = self.conns[i].as_ref().is_some_and(|c| c.attached);
        match req {
            Request::Hello { version } => self.hello(i, version, attached),
            Request::Stats => {
                let mut r = Reply::ok(0);
                r.body = self.stats.render().into_bytes();
                self.reply(i, &r, &[]);
            }
            _ if !attached => self.reply(i, &Reply::err(libc::ENOTCONN), &[]),
            Request::SocketOpen => {
                let (app_end, state) = match readiness::create() {
                    Ok(x) => x,
                    Err(e) => {
                        return self.reply(
                            i,
                            &Reply::err(e.raw_os_error().unwrap_or(libc::ENOMEM)),
                            &[],
                        )
                    }
                };
                match self.exec(Cmd::Request {
                    app: i,
                    req,
                    readiness: Some(state),
                }) {
                    Some(CmdReply::Reply(r)) if r.errno == 0 => {
                        self.reply(i, &r, &[app_end.as_raw_fd()])
                    }
                    Some(CmdReply::Reply(r)) => self.reply(i, &r, &[]),
                    _ => self.reply(i, &Reply::err(libc::EIO), &[]),
                }
            }
            _ => match self.exec(Cmd::Request {
                app: i,
                req,
                readiness: None,
            }) {
                Some(CmdReply::Reply(r)) => self.reply(i, &r, &[]),
                _ => self.reply(i, &Reply::err(libc::EIO), &[]),
            },
        }
    }

    fn hello(&mut self, i: usize, version: u32, attached: bool) {
        if attached {
            return self.reply(i, &Reply::err(libc::EISCONN), &[]);
        }
        let pid = self.conns[i].as_ref().map_or(-1, |c| c.pid);
        if version != LAYOUT_VERSION {
            tracing::warn!(
                pid,
                app_version = version,
                LAYOUT_VERSION,
                "refusing app: shm layout mismatch"
            );
            Stats::bump(&self.stats.attach_refused);
            let mut r = Reply::err(libc::EPROTONOSUPPORT);
            r.value = LAYOUT_VERSION as u64;
            return self.reply(i, &r, &[]);
        }
        let region = match AppRegion::create(
            &format!("rdsd-app-{pid}"),
            self.cfg.geometry(),
            self.cfg.hugepages,
        ) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(pid, error = %e, "cannot create app region");
                Stats::bump(&self.stats.attach_refused);
                return self.reply(
                    i,
                    &Reply::err(e.raw_os_error().unwrap_or(libc::ENOMEM)),
                    &[],
                );
            }
        };
        tracing::info!(
            pid,
            app = i,
            bytes = region.len(),
            pages = if region.hugetlb() {
                "hugetlbfs 2 MiB"
            } else {
                "4 KiB + MADV_HUGEPAGE"
            },
            "app attached"
        );
        let info = HelloInfo {
            region_len: region.len() as u64,
            daemon_region_len: DAEMON_REGION_LEN as u64,
            hugetlb: region.hugetlb() as u32,
        };
        let region_fd = match region.fd().try_clone() {
            Ok(fd) => fd,
            Err(_) => return self.reply(i, &Reply::err(libc::EMFILE), &[]),
        };
        if !matches!(
            self.exec(Cmd::Attach { app: i, region }),
            Some(CmdReply::Attached)
        ) {
            return self.reply(i, &Reply::err(libc::EIO), &[]);
        }
        if let Some(c) = self.conns[i].as_mut() {
            c.attached = true;
        }
        let mut r = Reply::ok(0);
        r.body = info.encode();
        self.reply(
            i,
            &r,
            &[
                region_fd.as_raw_fd(),
                self.daemon.fd().as_raw_fd(),
                self.doorbell.as_raw_fd(),
            ],
        );
    }
}

//! One message channel per task, the same for rdsd and the kernel baselines: `send` one message,
//! `recv` one message. Busy-polling channels never block (`Ok(false)` / `Ok(None)` = try
//! again); blocking ones sleep in the kernel (or in rdsd's futex) for at most [`SLICE`], so that
//! the task still sees the end of the run.

use crate::unix::{big_buffers, recv, send};
use crate::util::would_block;
use anyhow::{bail, Context, Result};
use shm_api::{Rdsd, Socket};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How one side's RDS channels attach to rdsd.
pub enum Attach {
    /// One attachment (one app) for every task of the side.
    Shared(Rdsd),
    /// An attachment per task (an app each, as one MPI rank per process is): rdsd spreads
    /// new apps over its poll threads, so the tasks do too. The path is rdsd's control socket.
    PerTask(PathBuf),
}

impl Attach {
    /// A bound RDS channel for one task.
    fn open(&self, local: Ipv4Addr, blocking: bool) -> Result<(RdsChan, SocketAddrV4)> {
        match self {
            Attach::Shared(rdsd) => RdsChan::open(rdsd, local, blocking),
            Attach::PerTask(socket) => {
                // The socket keeps its attachment alive.
                let rdsd = Rdsd::attach_at(socket).with_context(|| {
                    format!("a task cannot attach to rdsd at {}", socket.display())
                })?;
                RdsChan::open(&rdsd, local, blocking)
            }
        }
    }
}

/// How long a blocking call sleeps before it looks at the clock and the stop flag.
pub const SLICE: Duration = Duration::from_millis(100);

/// Kernel socket buffers asked for (capped by net.core.[rw]mem_max).
const KERNEL_BUF: i32 = 4 << 20;

/// What carries the messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Kind {
    /// rdsd (shm-api sockets).
    Rds,
    /// Kernel TCP, one connection per task, 4-byte length framing, TCP_NODELAY.
    Tcp,
    /// Kernel UDP, one socket pair per task.
    Udp,
    /// AF_UNIX SOCK_SEQPACKET, one connection per task (same host only).
    Unix,
}

impl Kind {
    pub fn key(self) -> &'static str {
        match self {
            Kind::Rds => "rds",
            Kind::Tcp => "tcp",
            Kind::Udp => "udp",
            Kind::Unix => "unix",
        }
    }

    pub fn from_key(s: &str) -> Option<Kind> {
        [Kind::Rds, Kind::Tcp, Kind::Udp, Kind::Unix]
            .into_iter()
            .find(|k| k.key() == s)
    }

    pub fn label(self) -> &'static str {
        match self {
            Kind::Rds => "rdsd",
            Kind::Tcp => "kernel TCP",
            Kind::Udp => "kernel UDP",
            Kind::Unix => "AF_UNIX seqpacket",
        }
    }

    /// Delivers every message exactly once and in order (UDP may drop).
    pub fn reliable(self) -> bool {
        self != Kind::Udp
    }

    /// Largest message the transport carries in one datagram.
    pub fn max_msg(self) -> usize {
        match self {
            Kind::Udp => 65_507,
            _ => shm_api::layout::MAX_MSG_SIZE,
        }
    }
}

/// One end of a task's conversation.
pub trait Chan: Send {
    /// Sends one message: to the connected peer, or (server side) to whoever sent the last
    /// message. `Ok(false)`: no room now (busy-poll) or none within [`SLICE`] (blocking).
    fn send(&mut self, buf: &[u8]) -> io::Result<bool>;
    /// Receives one message into `buf`. `Ok(None)`: nothing yet.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>>;
}

// ---- rdsd ---------------------------------------------------------------------------------

/// An rdsd socket: a client sends to a fixed peer, a server answers the last sender.
pub struct RdsChan {
    sock: Socket,
    peer: Option<SocketAddrV4>,
    server: bool,
}

impl RdsChan {
    /// A socket bound to `local:0`, with big buffers so that congestion does not throttle the
    /// run (the rings bound what is in flight), blocking (with [`SLICE`]) or not.
    pub fn open(rdsd: &Rdsd, local: Ipv4Addr, blocking: bool) -> Result<(RdsChan, SocketAddrV4)> {
        let sock = rdsd.socket().context("cannot open an rdsd socket")?;
        sock.bind(SocketAddrV4::new(local, 0)).with_context(|| {
            format!("cannot bind an rdsd socket to {local} (is it one of rdsd's --local-addr?)")
        })?;
        sock.set_send_buffer_size(16 << 20)?;
        sock.set_recv_buffer_size(16 << 20)?;
        if blocking {
            sock.set_recv_timeout(Some(SLICE))?;
            sock.set_send_timeout(Some(SLICE))?;
        } else {
            sock.set_nonblocking(true)?;
        }
        let addr = sock.local_addr().context("bound socket has no address")?;
        Ok((
            RdsChan {
                sock,
                peer: None,
                server: true,
            },
            addr,
        ))
    }

    /// Makes this a client of `peer`.
    pub fn to(mut self, peer: SocketAddrV4) -> RdsChan {
        self.peer = Some(peer);
        self.server = false;
        self
    }
}

fn rds_again(e: &io::Error) -> bool {
    would_block(e) || e.raw_os_error() == Some(libc::ETIMEDOUT)
}

impl Chan for RdsChan {
    fn send(&mut self, buf: &[u8]) -> io::Result<bool> {
        let Some(to) = self.peer else {
            return Err(io::Error::other("no peer to answer yet"));
        };
        match self.sock.send_to(buf, to) {
            Ok(_) => Ok(true),
            Err(e) if rds_again(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match self.sock.recv_from(buf) {
            Ok((n, from)) => {
                if self.server {
                    self.peer = Some(from);
                }
                Ok(Some(n))
            }
            Err(e) if rds_again(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

// ---- kernel sockets -----------------------------------------------------------------------

/// A kernel socket: UDP, AF_UNIX SOCK_SEQPACKET (one message per call) or TCP (a byte stream:
/// each message goes out as a 4-byte little-endian length and the bytes).
pub struct FdChan {
    fd: OwnedFd,
    blocking: bool,
    stream: bool,
    /// UDP server: the last sender, answered by `send`.
    peer: Option<(libc::sockaddr_storage, libc::socklen_t)>,
    udp_server: bool,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    wbuf: Vec<u8>,
    woff: usize,
}

fn setopt(fd: RawFd, level: i32, opt: i32, val: &[u8]) -> io::Result<()> {
    // SAFETY: `val` is valid for reads of its length for the duration of the call.
    let rc = unsafe { libc::setsockopt(fd, level, opt, val.as_ptr().cast(), val.len() as u32) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_timeouts(fd: RawFd) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: SLICE.as_micros() as libc::suseconds_t,
    };
    // SAFETY: a timeval is plain old data; we pass its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&tv as *const libc::timeval).cast::<u8>(),
            std::mem::size_of::<libc::timeval>(),
        )
    };
    setopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, bytes)?;
    setopt(fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, bytes)
}

impl FdChan {
    fn new(fd: OwnedFd, blocking: bool, stream: bool, udp_server: bool) -> Result<FdChan> {
        let raw = fd.as_raw_fd();
        big_buffers(raw, KERNEL_BUF);
        if stream {
            setopt(
                raw,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                &1i32.to_ne_bytes(),
            )
            .context("TCP_NODELAY")?;
        }
        if blocking {
            set_timeouts(raw).context("SO_RCVTIMEO/SO_SNDTIMEO")?;
        }
        Ok(FdChan {
            fd,
            blocking,
            stream,
            peer: None,
            udp_server,
            rbuf: if stream {
                vec![0; 2 * (shm_api::layout::MAX_MSG_SIZE + 4)]
            } else {
                Vec::new()
            },
            rstart: 0,
            rend: 0,
            wbuf: Vec::new(),
            woff: 0,
        })
    }

    fn flags(&self) -> i32 {
        if self.blocking {
            0
        } else {
            libc::MSG_DONTWAIT
        }
    }

    /// Writes what is pending of the stream; true when nothing is left.
    fn flush(&mut self, flags: i32) -> io::Result<bool> {
        while self.woff < self.wbuf.len() {
            match send(self.fd.as_raw_fd(), &self.wbuf[self.woff..], flags) {
                Ok(n) => self.woff += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.wbuf.clear();
        self.woff = 0;
        Ok(true)
    }

    /// A whole frame from the stream buffer, if there is one.
    fn take_frame(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let have = self.rend - self.rstart;
        if have < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(
            self.rbuf[self.rstart..self.rstart + 4]
                .try_into()
                .expect("4 bytes"),
        ) as usize;
        if len > buf.len() || len + 4 > self.rbuf.len() / 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("TCP frame of {len} bytes does not fit"),
            ));
        }
        if have < 4 + len {
            return Ok(None);
        }
        buf[..len].copy_from_slice(&self.rbuf[self.rstart + 4..self.rstart + 4 + len]);
        self.rstart += 4 + len;
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        }
        Ok(Some(len))
    }
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the peer closed the connection",
    )
}

impl Chan for FdChan {
    fn send(&mut self, buf: &[u8]) -> io::Result<bool> {
        let fd = self.fd.as_raw_fd();
        if self.stream {
            if !self.flush(self.flags())? {
                return Ok(false);
            }
            self.wbuf
                .extend_from_slice(&(buf.len() as u32).to_le_bytes());
            self.wbuf.extend_from_slice(buf);
            // The frame is ours now; what the kernel does not take goes out on later calls.
            self.flush(self.flags())?;
            return Ok(true);
        }
        let r = if let (true, Some((sa, len))) = (self.udp_server, self.peer.as_ref()) {
            // SAFETY: `buf` and the stored address are valid for the call.
            let n = unsafe {
                libc::sendto(
                    fd,
                    buf.as_ptr().cast(),
                    buf.len(),
                    self.flags() | libc::MSG_NOSIGNAL,
                    (sa as *const libc::sockaddr_storage).cast(),
                    *len,
                )
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        } else {
            send(fd, buf, self.flags())
        };
        match r {
            Ok(_) => Ok(true),
            Err(e) if would_block(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let fd = self.fd.as_raw_fd();
        if self.stream {
            self.flush(libc::MSG_DONTWAIT)?;
            if let Some(n) = self.take_frame(buf)? {
                return Ok(Some(n));
            }
            if self.rstart > 0 {
                self.rbuf.copy_within(self.rstart..self.rend, 0);
                self.rend -= self.rstart;
                self.rstart = 0;
            }
            let flags = self.flags();
            let end = self.rend;
            match recv(fd, &mut self.rbuf[end..], flags) {
                Ok(0) => return Err(eof()),
                Ok(n) => self.rend += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
            return self.take_frame(buf);
        }
        let r = if self.udp_server {
            // SAFETY: zeroed sockaddr_storage is a valid (empty) address.
            let mut sa: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // SAFETY: `buf`, `sa` and `len` are valid for writes of the sizes given.
            let n = unsafe {
                libc::recvfrom(
                    fd,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    self.flags(),
                    (&mut sa as *mut libc::sockaddr_storage).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                self.peer = Some((sa, len));
                Ok(n as usize)
            }
        } else {
            recv(fd, buf, self.flags())
        };
        match r {
            // Every message carries a header: 0 bytes is the end of a SEQPACKET connection.
            Ok(0) => Err(eof()),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

// ---- setting up each kind -------------------------------------------------------------------

/// A server-side endpoint set: what the passive side opened for one run.
pub enum Listening {
    /// One socket per task, each with its address.
    Sockets(Vec<Box<dyn Chan>>, Vec<String>),
    /// One listener; tasks connect to it.
    Tcp(TcpListener),
    Unix(OwnedFd, TempPath),
}

impl Listening {
    /// The addresses the active side needs, one word each.
    pub fn addrs(&self) -> Result<Vec<String>> {
        Ok(match self {
            Listening::Sockets(_, a) => a.clone(),
            Listening::Tcp(l) => vec![l.local_addr()?.to_string()],
            Listening::Unix(_, p) => vec![p.0.display().to_string()],
        })
    }

    /// The task channels, accepting `tasks` connections where needed (10 s at most).
    pub fn into_chans(self, tasks: u32, blocking: bool) -> Result<Vec<Box<dyn Chan>>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out: Vec<Box<dyn Chan>> = Vec::new();
        match self {
            Listening::Sockets(v, _) => return Ok(v),
            Listening::Tcp(l) => {
                l.set_nonblocking(true)?;
                while out.len() < tasks as usize {
                    match l.accept() {
                        Ok((s, _)) => {
                            s.set_nonblocking(false)?;
                            let fd = OwnedFd::from(s);
                            out.push(Box::new(FdChan::new(fd, blocking, true, false)?));
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            if Instant::now() > deadline {
                                bail!("only {} of {tasks} TCP connections within 10 s", out.len());
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Err(e) => return Err(e).context("TCP accept"),
                    }
                }
            }
            Listening::Unix(l, path) => {
                while out.len() < tasks as usize {
                    let mut p = libc::pollfd {
                        fd: l.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut p, 1, 10) };
                    // SAFETY: accept4 on our listening socket, no address wanted.
                    let fd = unsafe {
                        libc::accept4(
                            l.as_raw_fd(),
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                        )
                    };
                    if fd >= 0 {
                        // SAFETY: a fresh descriptor from accept4.
                        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                        clear_nonblock(fd.as_raw_fd())?;
                        out.push(Box::new(FdChan::new(fd, blocking, false, false)?));
                    } else if Instant::now() > deadline {
                        bail!(
                            "only {} of {tasks} AF_UNIX connections within 10 s",
                            out.len()
                        );
                    }
                }
                drop(path);
            }
        }
        Ok(out)
    }
}

/// A socket path removed when dropped.
pub struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn clear_nonblock(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn unix_addr(path: &Path) -> Result<libc::sockaddr_un> {
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = path.as_os_str().as_encoded_bytes();
    if b.len() >= sa.sun_path.len() {
        bail!("AF_UNIX path too long: {}", path.display());
    }
    for (d, s) in sa.sun_path.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    Ok(sa)
}

fn seqpacket_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("socket(AF_UNIX, SOCK_SEQPACKET)");
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Passive side: opens what `kind` needs on `local` for `tasks` tasks.
pub fn listen(
    kind: Kind,
    rdsd: Option<&Attach>,
    local: Ipv4Addr,
    tasks: u32,
    blocking: bool,
) -> Result<Listening> {
    Ok(match kind {
        Kind::Rds => {
            let rdsd = rdsd.context("this passive side is not attached to rdsd")?;
            let mut chans: Vec<Box<dyn Chan>> = Vec::new();
            let mut addrs = Vec::new();
            for _ in 0..tasks {
                let (c, a) = rdsd.open(local, blocking)?;
                chans.push(Box::new(c));
                addrs.push(a.to_string());
            }
            Listening::Sockets(chans, addrs)
        }
        Kind::Udp => {
            let mut chans: Vec<Box<dyn Chan>> = Vec::new();
            let mut addrs = Vec::new();
            for _ in 0..tasks {
                let s = UdpSocket::bind(SocketAddrV4::new(local, 0))
                    .with_context(|| format!("UDP bind {local}"))?;
                addrs.push(s.local_addr()?.to_string());
                chans.push(Box::new(FdChan::new(
                    OwnedFd::from(s),
                    blocking,
                    false,
                    true,
                )?));
            }
            Listening::Sockets(chans, addrs)
        }
        Kind::Tcp => Listening::Tcp(
            TcpListener::bind(SocketAddrV4::new(local, 0))
                .with_context(|| format!("TCP listen on {local}"))?,
        ),
        Kind::Unix => {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "rds-bench-{}-{}.seqpacket",
                std::process::id(),
                N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            let _ = std::fs::remove_file(&path);
            let fd = seqpacket_socket()?;
            let sa = unix_addr(&path)?;
            // SAFETY: bind/listen with a valid sockaddr_un on our own socket.
            let ok = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&sa as *const libc::sockaddr_un).cast(),
                    std::mem::size_of::<libc::sockaddr_un>() as u32,
                ) == 0
                    && libc::listen(fd.as_raw_fd(), 128) == 0
            };
            if !ok {
                return Err(io::Error::last_os_error())
                    .with_context(|| format!("AF_UNIX listen on {}", path.display()));
            }
            Listening::Unix(fd, TempPath(path))
        }
    })
}

/// Active side: one channel to the passive side's `addrs` per task.
pub fn connect(
    kind: Kind,
    rdsd: Option<&Attach>,
    local: Ipv4Addr,
    addrs: &[String],
    tasks: u32,
    blocking: bool,
) -> Result<Vec<Box<dyn Chan>>> {
    let mut out: Vec<Box<dyn Chan>> = Vec::new();
    let need = match kind {
        Kind::Rds | Kind::Udp => tasks as usize,
        Kind::Tcp | Kind::Unix => 1,
    };
    if addrs.len() != need {
        bail!(
            "the passive side sent {} addresses for {kind:?}, expected {need}",
            addrs.len()
        );
    }
    for i in 0..tasks as usize {
        match kind {
            Kind::Rds => {
                let rdsd = rdsd.context("not attached to rdsd")?;
                let peer: SocketAddrV4 = addrs[i]
                    .parse()
                    .context("bad RDS address from the passive side")?;
                let (c, _) = rdsd.open(local, blocking)?;
                out.push(Box::new(c.to(peer)));
            }
            Kind::Udp => {
                let s = UdpSocket::bind(SocketAddrV4::new(local, 0))
                    .with_context(|| format!("UDP bind {local}"))?;
                s.connect(&addrs[i]).context("UDP connect")?;
                out.push(Box::new(FdChan::new(
                    OwnedFd::from(s),
                    blocking,
                    false,
                    false,
                )?));
            }
            Kind::Tcp => {
                let s = TcpStream::connect(&addrs[0])
                    .with_context(|| format!("TCP connect to {}", addrs[0]))?;
                out.push(Box::new(FdChan::new(
                    OwnedFd::from(s),
                    blocking,
                    true,
                    false,
                )?));
            }
            Kind::Unix => {
                let fd = seqpacket_socket()?;
                let sa = unix_addr(Path::new(&addrs[0]))?;
                // SAFETY: connect with a valid sockaddr_un on our own socket.
                let rc = unsafe {
                    libc::connect(
                        fd.as_raw_fd(),
                        (&sa as *const libc::sockaddr_un).cast(),
                        std::mem::size_of::<libc::sockaddr_un>() as u32,
                    )
                };
                if rc != 0 {
                    return Err(io::Error::last_os_error()).with_context(|| {
                        format!("AF_UNIX connect to {} (same host only)", addrs[0])
                    });
                }
                out.push(Box::new(FdChan::new(fd, blocking, false, false)?));
            }
        }
    }
    Ok(out)
}

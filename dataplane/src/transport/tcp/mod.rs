//! The kernel-TCP transport: a [`Link`] over kernel sockets under the shared protocol layer.
//!
//! One non-blocking `TCP_NODELAY` socket per path, bound to the RDS source address (RDS
//! addresses are implied by the TCP endpoints) and, for our connects, to a source port with
//! `port % 8 == path` (SPORT_IDX, as recent kernels; `SourcePorts`); a listener on 16385; readiness from one
//! edge-triggered `epoll` instance for every path socket, asked once per pass (`begin_pass`),
//! so that an idle path costs no syscall; `recv(MSG_DONTWAIT)` of a ready path until it is
//! drained; `sendmsg` of header + payload with partial writes; acknowledgement as bytes written
//! minus `SIOCOUTQ` (asked by the endpoint after input or with backoff), and
//! `TCP_INFO.tcpi_bytes_acked` one last time before a path is reported down. Only I/O lives
//! here: connections, sequencing and congestion are the protocol layer's (`crate::protocol`).

use crate::config::Config;
use crate::protocol::{
    Accepted, ConnectPoll, Endpoint, Framing, InPlaceBytes, Link, Payload, PoolBuf, Read,
    RxStateFile, Write,
};
use crate::seam::MsgBytes;
use crate::stats::Stats;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

/// Most slices gathered into one `sendmsg` (the protocol layer gathers up to 32 frames).
const MAX_IOV: usize = 64;
/// How long a doorbell connection may stay open.
const DOORBELL_TTL: Duration = Duration::from_secs(1);
/// One non-blocking `sendmsg` of the first `N` (at most) of `slices`; its return value.
fn sendmsg_gather<const N: usize>(fd: RawFd, slices: &[&[u8]]) -> isize {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; N];
    let n = slices.len().min(N);
    for (v, s) in iov.iter_mut().zip(&slices[..n]) {
        v.iov_base = s.as_ptr() as *mut _;
        v.iov_len = s.len();
    }
    // SAFETY: msghdr is plain old data; all-zero is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut _;
    msg.msg_iovlen = n;
    // SAFETY: the iovecs point into the caller's live slices for this call only; the kernel
    // only reads them.
    unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) }
}

/// Readiness events taken by one `epoll_wait` (more are taken by a second call).
const EVENTS: usize = 64;

/// Builds the kernel-TCP transport when the configuration talks to the network: one endpoint
/// per poll thread of `Config::net_shards` (`stats`: theirs, in order), each owning the
/// connections `owners` gives it. They share the listener (its thread hands each
/// accepted connection to its owner) and the receive-state file.
pub fn build(
    cfg: &Config,
    stats: &[Arc<Stats>],
    owners: &Arc<crate::transport::ConnOwners>,
) -> std::io::Result<Vec<Endpoint<TcpLink>>> {
    if !cfg.wants_network() {
        return Ok(Vec::new());
    }
    debug_assert!(owners.shards() <= stats.len(), "a poll thread per owner");
    let links = TcpLink::listen_sharded(
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, cfg.tcp_port),
        owners.clone(),
        cfg.local_addrs.clone(),
    )?;
    let state = RxStateFile::open_shared(&cfg.state_file)?;
    Ok(links
        .into_iter()
        .zip(stats)
        .map(|(mut link, stats)| {
            link.zero_copy_min = cfg.tcp_zero_copy_min;
            let ep = crate::transport::endpoint_config("tcp", &cfg.tcp_routes, cfg, &state);
            Endpoint::new(link, ep, stats.clone(), |s| &s.tcp)
        })
        .collect())
}

/// One path: a connected (or connecting) TCP socket.
pub struct TcpPath {
    sock: Socket,
}

/// Kernel TCP sockets for every path of every connection.
pub struct TcpLink {
    port: u16,
    /// Inbound connections, accepted (and given their options) by a thread of their own
    /// (`transport::handoff`, which owns the listener): polling the listener from the poll
    /// core would be an `accept4` syscall every few passes, even with no TCP traffic at all.
    accepted: crate::transport::handoff::Handoff<Accepted<TcpPath>>,
    doorbells: Vec<(Socket, std::time::Instant)>,
    /// Every path socket, edge-triggered (input, output, hang-up), keyed by descriptor.
    epoll: OwnedFd,
    /// Per descriptor: an event arrived and no read has found the socket drained since.
    ready: Vec<bool>,
    /// Moves on with every pass whose `epoll_wait` marked a path ready: the only way a path
    /// found not ready becomes ready (`Link::ready_epoch`).
    ready_epoch: u64,
    /// Path sockets in the epoll set (watched, not yet closed): with none, a pass makes no
    /// `epoll_wait` (an rdsd whose traffic all goes over DPDK pays no syscall for kernel TCP).
    watched: usize,
    events: Vec<libc::epoll_event>,
    /// Source ports of our connects, `port % 8 == path` (SPORT_IDX).
    ports: SourcePorts,
    /// Payloads of at least this many bytes are written from the app's ring (`tcp_zero_copy_min`).
    zero_copy_min: Option<usize>,
}

/// Source ports for our connects, chosen as recent kernels choose them (spec §6.2) so that
/// the endpoint can announce SPORT_IDX: the low end of the kernel's ephemeral range aligned up
/// to 8, then groups of 8 walked round-robin, port `group base + path`, the next group when
/// a bind finds the port taken. A passive peer then maps each connection to its path by that
/// port. Without it, an rdsd restarted on the passive side maps connections in accept order,
/// and one of ours for a path above a path it still believes up (idle, so it never learned
/// that the peer died) landed on a lower index: its resends were judged against that path's
/// restored sequence numbers and delivered again (`delivery.rs::receiver_restart_after_lost_acks_no_duplicates`).
#[derive(Debug)]
struct SourcePorts {
    /// First port of group 0 (a multiple of 8).
    base: u32,
    /// Whole groups of 8 in the range.
    groups: u32,
    /// The next group to try.
    next: u32,
}

impl SourcePorts {
    /// Most binds one connect tries before it fails (and is retried after the backoff).
    const TRIES: u32 = 64;

    /// The range of `/proc/sys/net/ipv4/ip_local_port_range` (this network namespace's), or
    /// Linux's default; `seed` spreads several links' walks over the range.
    fn new(seed: u32) -> SourcePorts {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| {
                let mut it = s.split_whitespace().map(|v| v.parse::<u16>().ok());
                Some((it.next()??, it.next()??))
            });
        SourcePorts::in_range(range.unwrap_or((32768, 60999)), seed)
    }

    fn in_range((lo, hi): (u16, u16), seed: u32) -> SourcePorts {
        let base = u32::from(lo).div_ceil(8) * 8;
        let groups = ((u32::from(hi) + 1).saturating_sub(base) / 8).max(1);
        // A range narrower than 8 ports: group 0 of the default range instead.
        let base = if u32::from(hi) + 1 < base + 8 {
            32768
        } else {
            base
        };
        SourcePorts {
            base,
            groups,
            next: seed % groups,
        }
    }

    /// The next candidate port for `path`.
    fn next(&mut self, path: usize) -> u16 {
        let g = self.next;
        self.next = (g + 1) % self.groups;
        (self.base + 8 * g + (path % 8) as u32) as u16
    }
}

/// Options of every data socket, as the kernel's rds_tcp sets them (spec §6.1): no Nagle, and
/// keepalive (idle 5 s, interval 5 s, 5 probes) so that a peer that died without a FIN is
/// noticed and its paths go down; otherwise the passive side would keep a dead path up and
/// reset every reconnect of the rebooted peer.
fn data_socket_options(s: &Socket) -> std::io::Result<()> {
    s.set_nonblocking(true)?;
    s.set_nodelay(true)?;
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(5))
        .with_retries(5);
    s.set_tcp_keepalive(&ka)
}

fn new_stream(laddr: u32, sport: u16) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
    data_socket_options(&s)?;
    s.bind(&SockAddr::from(SocketAddrV4::new(
        Ipv4Addr::from(laddr),
        sport,
    )))?;
    Ok(s)
}

/// A connect from `laddr`, source port `sport` (0: an ephemeral one).
fn connect_nonblocking(laddr: u32, sport: u16, faddr: u32, port: u16) -> std::io::Result<Socket> {
    let s = new_stream(laddr, sport)?;
    match s.connect(&SockAddr::from(SocketAddrV4::new(
        Ipv4Addr::from(faddr),
        port,
    ))) {
        Ok(()) => Ok(s),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(s),
        Err(e) => Err(e),
    }
}

/// Bytes the kernel still holds unacknowledged in the send queue (SIOCOUTQ).
fn outq(fd: RawFd) -> Option<u64> {
    let mut v: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one int into `v`.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut v) };
    (r == 0 && v >= 0).then_some(v as u64)
}

/// Bytes of this connection the peer has acknowledged (`tcpi_bytes_acked`, Linux >= 4.1).
/// Unlike bytes written minus SIOCOUTQ it stays right after a reset, when the send queue has
/// been purged: read it one last time before reporting a path down, so that messages the peer
/// did acknowledge are not resent to its restarted successor as duplicates.
fn bytes_acked(fd: RawFd) -> Option<u64> {
    const OFFSET: usize = 120; // struct tcp_info: ... u64 pacing_rate, max_pacing_rate, bytes_acked
    let mut buf = [0u8; 256];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into our buffer and updates `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr() as *mut _,
            &mut len,
        )
    };
    if r != 0 || (len as usize) < OFFSET + 8 {
        return None;
    }
    Some(u64::from_ne_bytes(
        buf[OFFSET..OFFSET + 8].try_into().expect("8 bytes"),
    ))
}

fn errno_is_transient() -> bool {
    matches!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EAGAIN) | Some(libc::EINTR)
    )
}

/// Accepts one waiting connection and gives it the data-socket options (the accept thread).
fn accept_one(l: &Socket) -> Option<Accepted<TcpPath>> {
    loop {
        let (sock, peer) = l.accept().ok()?;
        let peer = peer.as_socket_ipv4();
        let local = sock.local_addr().ok().and_then(|a| a.as_socket_ipv4());
        let (Some(peer), Some(local)) = (peer, local) else {
            continue;
        };
        if data_socket_options(&sock).is_err() {
            continue;
        }
        return Some(Accepted {
            path: TcpPath { sock },
            laddr: u32::from(*local.ip()),
            faddr: u32::from(*peer.ip()),
            peer_port: peer.port(),
        });
    }
}

impl TcpLink {
    /// Listens on `addr` (port 16385 on every address in rdsd).
    pub fn listen(addr: SocketAddrV4) -> std::io::Result<TcpLink> {
        let one = Arc::new(crate::transport::ConnOwners::with(1, true));
        let mut links = TcpLink::listen_sharded(addr, one, Vec::new())?;
        Ok(links.pop().expect("one link"))
    }

    /// One link per poll thread that drives the network (`owners.shards()` of them) behind one
    /// listener on `addr`: the accept thread hands each connection to the link of the shard
    /// that owns its address pair (`owners`, which the senders' threads ask too), so every
    /// socket of a connection is polled by its owner only; one the endpoints refuse (its local
    /// address not in `local`, or its peer's in it) goes to shard 0 and is placed nowhere.
    pub fn listen_sharded(
        addr: SocketAddrV4,
        owners: Arc<crate::transport::ConnOwners>,
        local: Vec<crate::prefix::Prefix>,
    ) -> std::io::Result<Vec<TcpLink>> {
        let shards = owners.shards();
        let l = Socket::new(Domain::IPV4, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
        l.set_reuse_address(true)?;
        l.set_nonblocking(true)?;
        l.set_nodelay(true)?;
        l.bind(&SockAddr::from(addr))?;
        l.listen(64)?;
        tracing::info!(%addr, shards, "RDS/TCP listening");
        let fd = l.as_raw_fd();
        let ends = crate::transport::handoff::Handoff::spawn_sharded(
            "rdsd-tcp-accept",
            fd,
            shards,
            move |a: &Accepted<TcpPath>| owners.owner_of_inbound(a.laddr, a.faddr, &local),
            move |push| {
                while let Some(a) = accept_one(&l) {
                    push(a);
                }
            },
        )?;
        ends.into_iter()
            .enumerate()
            .map(|(shard, accepted)| {
                // SAFETY: epoll_create1 takes no pointers; a non-negative result is a new
                // descriptor that nothing else owns.
                let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
                if ep < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: `ep` was just created and is owned by nobody else.
                let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
                Ok(TcpLink {
                    port: addr.port(),
                    accepted,
                    doorbells: Vec::new(),
                    epoll,
                    ready: Vec::new(),
                    ready_epoch: 0,
                    watched: 0,
                    events: vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS],
                    // Spread over the range by process and shard, so that threads and a
                    // restarted rdsd start on other ports than the last one.
                    ports: SourcePorts::new(
                        std::process::id().wrapping_mul(2_654_435_761)
                            ^ (shard as u32).wrapping_mul(97),
                    ),
                    zero_copy_min: Some(crate::protocol::TCP_ZERO_COPY_MIN),
                })
            })
            .collect()
    }

    /// Watches a new path socket. Edge-triggered: an event is queued on each arrival of data,
    /// connect completion, freed send space, hang-up or error; adding a socket that is already
    /// readable queues one at once. Closing the socket removes it (it is never duplicated).
    fn watch(&mut self, sock: &Socket) -> std::io::Result<()> {
        let fd = sock.as_raw_fd();
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
            u64: fd as u64,
        };
        // SAFETY: `ev` is a valid epoll_event for the call; both descriptors are open.
        let r =
            unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let i = fd as usize;
        if self.ready.len() <= i {
            self.ready.resize(i + 1, false);
        }
        // A stale mark of an earlier socket with this descriptor would cost one read at most;
        // the kernel reports what this one has already.
        self.ready[i] = false;
        self.watched += 1;
        Ok(())
    }

    fn set_ready(&mut self, fd: RawFd, ready: bool) {
        if let Some(r) = self.ready.get_mut(fd as usize) {
            *r = ready;
        }
    }
}

impl Link for TcpLink {
    type Path = TcpPath;
    type Payload = Payload;
    const FRAMING: Framing = Framing::Stream;
    const READS_INTO_BUFFER: bool = true;
    const SPORT_IDX: bool = true;

    fn payload(&mut self, bytes: MsgBytes<'_>) -> Payload {
        Payload::Copy(PoolBuf::copy_of(bytes))
    }

    fn zero_copy(&self) -> bool {
        self.zero_copy_min.is_some()
    }

    fn zero_copy_min(&self) -> usize {
        self.zero_copy_min.unwrap_or(usize::MAX)
    }

    fn payload_in_place(&mut self, bytes: MsgBytes<'_>, _region: u64) -> Option<Payload> {
        // Any region: `write` hands the bytes to the kernel (`sendmsg`), which copies them.
        let min = self.zero_copy_min?;
        // SAFETY: offered in place (`OutMsg::in_place`): the poll core keeps the region
        // mapped and the ring space unused until the message is released, which the engine
        // does only once every byte of its frame was written (even when it is cancelled).
        (bytes.len() >= min).then(|| Payload::InPlace(unsafe { InPlaceBytes::new(bytes) }))
    }

    fn accept(&mut self) -> Option<Accepted<TcpPath>> {
        loop {
            let a = self.accepted.pop()?;
            match self.watch(&a.path.sock) {
                Ok(()) => return Some(a),
                Err(e) => tracing::warn!(error = %e, "cannot watch an accepted path; dropped"),
            }
        }
    }

    fn connect(&mut self, laddr: u32, faddr: u32, path: usize) -> std::io::Result<TcpPath> {
        let mut last = None;
        for _ in 0..SourcePorts::TRIES {
            let sport = self.ports.next(path);
            match connect_nonblocking(laddr, sport, faddr, self.port) {
                Ok(sock) => {
                    self.watch(&sock)?;
                    return Ok(TcpPath { sock });
                }
                // Taken here (EADDRINUSE), or this 4-tuple is (EADDRNOTAVAIL): the next group.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EADDRINUSE) | Some(libc::EADDRNOTAVAIL)
                    ) =>
                {
                    last = Some(e)
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EADDRINUSE)))
    }

    fn poll_connect(&mut self, p: &mut TcpPath) -> ConnectPoll {
        let fd = p.sock.as_raw_fd();
        let rev = shm_api::sys::poll_one(fd, libc::POLLOUT, 0).unwrap_or(libc::POLLERR);
        if rev == 0 {
            // Not yet: the completion queues an event.
            self.set_ready(fd, false);
            return ConnectPoll::Pending;
        }
        match p.sock.take_error() {
            Ok(None) if rev & libc::POLLOUT != 0 => ConnectPoll::Up,
            _ => ConnectPoll::Failed,
        }
    }

    fn doorbell(&mut self, laddr: u32, faddr: u32) {
        if let Ok(s) = connect_nonblocking(laddr, 0, faddr, self.port) {
            self.doorbells
                .push((s, std::time::Instant::now() + DOORBELL_TTL));
        }
    }

    fn begin_pass(&mut self) {
        if self.watched == 0 {
            return;
        }
        loop {
            // SAFETY: `events` holds EVENTS entries the kernel may fill; timeout 0 never blocks.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    self.events.as_mut_ptr(),
                    EVENTS as libc::c_int,
                    0,
                )
            };
            if n <= 0 {
                return;
            }
            self.ready_epoch += 1;
            for i in 0..n as usize {
                let fd = self.events[i].u64 as RawFd;
                self.set_ready(fd, true);
            }
            if (n as usize) < EVENTS {
                return;
            }
        }
    }

    fn ready_epoch(&self) -> Option<u64> {
        Some(self.ready_epoch)
    }

    fn path_ready(&self, p: &TcpPath) -> bool {
        self.ready
            .get(p.sock.as_raw_fd() as usize)
            .copied()
            .unwrap_or(true)
    }

    fn read<'a>(&'a mut self, p: &mut TcpPath, buf: &'a mut [u8]) -> Read<'a> {
        let fd = p.sock.as_raw_fd();
        // SAFETY: recv writes at most buf.len() bytes into our own buffer.
        let n = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr() as *mut _,
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => Read::Closed,
            n if n > 0 => {
                if (n as usize) < buf.len() {
                    // A short read emptied the receive queue (backlog included); whatever
                    // arrives from now on queues a new edge, so no EAGAIN read is needed.
                    self.set_ready(fd, false);
                }
                Read::Data(&buf[..n as usize])
            }
            _ if errno_is_transient() => {
                self.set_ready(fd, false);
                Read::WouldBlock
            }
            _ => Read::Closed,
        }
    }

    fn write(&mut self, p: &mut TcpPath, slices: &[&[u8]]) -> Write {
        // A ping-pong's write is one frame: 4 iovecs to set up, not 64 (1 KiB of stores).
        let n = if slices.len() <= 4 {
            sendmsg_gather::<4>(p.sock.as_raw_fd(), slices)
        } else {
            sendmsg_gather::<MAX_IOV>(p.sock.as_raw_fd(), slices)
        };
        match n {
            n if n >= 0 => Write::Wrote(n as usize),
            _ if errno_is_transient() => Write::WouldBlock,
            _ => Write::Closed,
        }
    }

    fn acked(&mut self, p: &TcpPath, written: u64) -> Option<u64> {
        outq(p.sock.as_raw_fd()).map(|q| written.saturating_sub(q))
    }

    fn final_acked(&mut self, p: &TcpPath, _written: u64) -> Option<u64> {
        bytes_acked(p.sock.as_raw_fd())
    }

    fn endpoints(&self, p: &TcpPath) -> Option<(SocketAddrV4, SocketAddrV4)> {
        let v4 = |a: std::io::Result<SockAddr>| a.ok()?.as_socket_ipv4();
        Some((v4(p.sock.local_addr())?, v4(p.sock.peer_addr())?))
    }

    fn close(&mut self, p: TcpPath, reset: bool) {
        // Dropping the socket (below) takes it out of the epoll set.
        self.watched = self.watched.saturating_sub(1);
        if reset {
            let _ = p.sock.set_linger(Some(Duration::ZERO));
        }
    }

    fn is_quiet(&self) -> bool {
        self.watched == 0 && self.doorbells.is_empty() && self.accepted.is_empty()
    }

    fn poll_aux(&mut self) -> usize {
        if self.doorbells.is_empty() {
            return 0;
        }
        let now = std::time::Instant::now();
        self.doorbells.retain(|(s, deadline)| {
            let rev =
                shm_api::sys::poll_one(s.as_raw_fd(), libc::POLLOUT, 0).unwrap_or(libc::POLLERR);
            rev == 0 && now < *deadline
        });
        0
    }

    fn acks_need_polling(&self) -> bool {
        true
    }

    fn ack_query_is_syscall(&self) -> bool {
        true
    }

    fn park_fds(&self, out: &mut Vec<libc::pollfd>) {
        // Readable while an event is queued for any path socket: one descriptor for all.
        out.push(libc::pollfd {
            fd: self.epoll.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        out.push(libc::pollfd {
            fd: self.accepted.fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        if self.accepted.arm() {
            // Connections are waiting already: wake at once (the eventfd was just reset).
            out.push(libc::pollfd {
                fd: self.accepted.fd(),
                events: libc::POLLOUT,
                revents: 0,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_ports_say_their_path_and_walk_the_range() {
        let mut p = SourcePorts::in_range((32768, 60999), 0);
        assert_eq!((p.base, p.groups), (32768, 3529));
        let ports: Vec<u16> = (0..8).map(|path| p.next(path)).collect();
        for (path, port) in ports.iter().enumerate() {
            assert_eq!(usize::from(*port) % 8, path);
        }
        // Round-robin over the groups: no port again before the range is walked.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3529 {
            assert!(seen.insert(p.next(3)));
        }
        assert!(!seen.insert(p.next(3)));
        // An unaligned low end is aligned up; the last group ends inside the range.
        let mut p = SourcePorts::in_range((1025, 1049), 5);
        assert_eq!((p.base, p.groups), (1032, 2));
        for _ in 0..4 {
            let port = p.next(7);
            assert!((1032..=1049).contains(&port) && port % 8 == 7, "{port}");
        }
        // A range without a whole group of 8 falls back to the default range's first group.
        let mut p = SourcePorts::in_range((40001, 40003), 0);
        assert_eq!(p.next(2), 32770);
    }

    #[test]
    fn a_connect_binds_a_source_port_that_says_its_path() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let lo = u32::from(Ipv4Addr::LOCALHOST);
        let mut ports = SourcePorts::new(7);
        for path in 0..8 {
            let sport = ports.next(path);
            let s = connect_nonblocking(lo, sport, lo, port).unwrap();
            let local = s.local_addr().unwrap().as_socket_ipv4().unwrap();
            assert_eq!(usize::from(local.port()) % 8, path);
        }
    }

    #[test]
    fn data_sockets_have_the_kernels_keepalive() {
        let s = new_stream(u32::from(Ipv4Addr::LOCALHOST), 0).unwrap();
        assert!(s.keepalive().unwrap());
        assert_eq!(s.keepalive_time().unwrap(), Duration::from_secs(5));
        assert_eq!(s.keepalive_interval().unwrap(), Duration::from_secs(5));
        assert_eq!(s.keepalive_retries().unwrap(), 5);
        assert!(s.nodelay().unwrap());
    }

    /// Polls `f` with a pass before each try (up to 5 s).
    fn after_passes<T>(link: &mut TcpLink, mut f: impl FnMut(&mut TcpLink) -> Option<T>) -> T {
        let limit = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            link.begin_pass();
            if let Some(v) = f(link) {
                return v;
            }
            assert!(std::time::Instant::now() < limit, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_link_is_quiet_only_with_no_path_and_nothing_to_accept() {
        let port = 30000 + ((std::process::id() + 7) % 20000) as u16;
        let lo = u32::from(Ipv4Addr::LOCALHOST);
        let mut link = TcpLink::listen(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
        assert!(
            link.is_quiet(),
            "a listener alone: the endpoint may skip its pass"
        );
        let client = link.connect(lo, lo, 0).unwrap();
        assert!(!link.is_quiet(), "a path");
        let accepted = after_passes(&mut link, |l| l.accept()).path;
        link.close(client, true);
        assert!(!link.is_quiet(), "the accepted path");
        link.close(accepted, true);
        assert!(link.is_quiet());
        // A connection waiting in the accept handoff is work.
        let _peer = std::net::TcpStream::connect(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        after_passes(&mut link, |l| (!l.is_quiet()).then_some(()));
    }

    #[test]
    fn a_path_is_ready_only_while_input_waits() {
        let port = 30000 + (std::process::id() % 20000) as u16;
        let lo = u32::from(Ipv4Addr::LOCALHOST);
        let mut link = TcpLink::listen(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
        let mut client = link.connect(lo, lo, 0).unwrap();
        after_passes(&mut link, |l| {
            (l.path_ready(&client) && l.poll_connect(&mut client) == ConnectPoll::Up).then_some(())
        });
        let mut server = after_passes(&mut link, |l| l.accept()).path;
        let mut buf = [0u8; 64];
        // Connected, nothing sent: neither side is ready once the events are taken.
        for _ in 0..3 {
            link.begin_pass();
            if link.path_ready(&server) {
                assert!(matches!(link.read(&mut server, &mut buf), Read::WouldBlock));
            }
            if link.path_ready(&client) {
                assert!(matches!(link.read(&mut client, &mut buf), Read::WouldBlock));
            }
        }
        link.begin_pass();
        assert!(!link.path_ready(&server) && !link.path_ready(&client));
        // Input makes the receiving path ready; a short read drains it without an EAGAIN read.
        assert_eq!(link.write(&mut client, &[b"ping"]), Write::Wrote(4));
        after_passes(&mut link, |l| l.path_ready(&server).then_some(()));
        assert!(matches!(
            link.read(&mut server, &mut buf),
            Read::Data(b"ping")
        ));
        assert!(!link.path_ready(&server));
        link.begin_pass();
        assert!(!link.path_ready(&server));
        // The peer's close is input too.
        drop(client);
        after_passes(&mut link, |l| l.path_ready(&server).then_some(()));
        assert!(matches!(link.read(&mut server, &mut buf), Read::Closed));
    }
}

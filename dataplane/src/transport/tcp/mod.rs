//! The kernel-TCP transport: a thin I/O adapter under the sans-IO engine (`rds_proto`).
//!
//! One `rds_proto::Connection` per (local address, peer address); one non-blocking TCP socket
//! per path. Each pass of the poll core, for every path: finish a pending connect, read what
//! arrived (`recv(MSG_DONTWAIT)`, no epoll) and feed it to the engine, write what the engine
//! has queued (`writev` of header + payload, partial writes allowed), and report TCP's
//! acknowledgement progress as bytes written minus `SIOCOUTQ`, which is the delivery point of
//! RDS/TCP (spec §6.4). Engine events become socket operations (connect, close, the doorbell
//! connect of the larger address) or poll-core actions (release send-buffer bytes, wake
//! senders on remote un-congestion).
//!
//! Payloads are copied out of the app's tx ring into buffers recycled through a per-thread
//! pool, so steady state allocates nothing; the engine keeps them until TCP acknowledges them.

use crate::config::Config;
use crate::config::Prefix;
use crate::poll::PollCore;
use crate::stats::Stats;
use crate::transport::{NetTransport, OutMsg};
use rds_proto::{Connection, Event, Instant};
use rustc_hash::FxHashMap;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::cell::RefCell;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

const MAX_PATHS: usize = 8;
/// Bytes read from one TCP socket per pass (fairness between paths).
const READ_BUDGET: usize = 256 * 1024;
/// Most recycled payload buffers kept.
const POOL_MAX: usize = 4096;

thread_local! {
    static POOL: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A payload buffer that returns to the poll thread's pool when the engine drops it.
#[derive(Debug)]
pub struct PoolBuf(Vec<u8>);

impl PoolBuf {
    fn copy_of(src: &[u8]) -> PoolBuf {
        let mut v = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
        v.clear();
        v.extend_from_slice(src);
        PoolBuf(v)
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        // Large buffers are not worth keeping (a 1 MiB message is rare).
        if v.capacity() <= 64 * 1024 {
            POOL.with(|p| {
                let mut p = p.borrow_mut();
                if p.len() < POOL_MAX {
                    p.push(v);
                }
            });
        }
    }
}

struct PathSock {
    sock: Socket,
    connecting: bool,
}

struct Conn {
    engine: Connection<PoolBuf>,
    paths: [Option<PathSock>; MAX_PATHS],
    laddr: u32,
    faddr: u32,
    maps_seen: u64,
}

/// All RDS/TCP connections of this poll core.
pub struct TcpTransport {
    routes: Vec<Prefix>,
    port: u16,
    npaths: u8,
    generation: u32,
    listener: Option<Socket>,
    conns: Vec<Conn>,
    index: FxHashMap<(u32, u32), usize>,
    doorbells: Vec<(Socket, Instant)>,
    rxbuf: Vec<u8>,
    epoch: std::time::Instant,
    seed: u64,
    pass: u32,
}

fn now_since(epoch: std::time::Instant) -> Instant {
    Instant::from_nanos(epoch.elapsed().as_nanos() as u64)
}

fn new_stream(laddr: u32) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
    s.set_nonblocking(true)?;
    s.set_nodelay(true)?;
    s.bind(&SockAddr::from(SocketAddrV4::new(Ipv4Addr::from(laddr), 0)))?;
    Ok(s)
}

fn connect_nonblocking(s: &Socket, faddr: u32, port: u16) -> std::io::Result<()> {
    match s.connect(&SockAddr::from(SocketAddrV4::new(
        Ipv4Addr::from(faddr),
        port,
    ))) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Bytes the kernel still holds unacknowledged in the send queue (SIOCOUTQ).
fn outq(fd: RawFd) -> Option<u64> {
    let mut v: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one int.
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

enum Io {
    Progress(usize),
    Idle,
    Down,
}

impl TcpTransport {
    /// Listens on `cfg.tcp_port` (all addresses) when the configuration talks to the network.
    pub fn new(cfg: &Config) -> std::io::Result<Option<TcpTransport>> {
        if !cfg.wants_network() {
            return Ok(None);
        }
        let l = Socket::new(Domain::IPV4, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
        l.set_reuse_address(true)?;
        l.set_nonblocking(true)?;
        l.set_nodelay(true)?;
        l.bind(&SockAddr::from(SocketAddrV4::new(
            Ipv4Addr::UNSPECIFIED,
            cfg.tcp_port,
        )))?;
        l.listen(64)?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64);
        let mut generation = (seed ^ (seed >> 29) ^ u64::from(std::process::id())) as u32;
        if generation == 0 {
            generation = 1;
        }
        tracing::info!(
            port = cfg.tcp_port,
            generation,
            paths = cfg.paths,
            "RDS/TCP listening"
        );
        Ok(Some(TcpTransport {
            routes: cfg.tcp_routes.clone(),
            port: cfg.tcp_port,
            npaths: cfg.paths,
            generation,
            listener: Some(l),
            conns: Vec::with_capacity(64),
            index: FxHashMap::default(),
            doorbells: Vec::new(),
            rxbuf: vec![0u8; 64 * 1024],
            epoch: std::time::Instant::now(),
            seed,
            pass: 0,
        }))
    }

    fn conn_for(&mut self, core: &mut PollCore, laddr: u32, faddr: u32) -> Option<usize> {
        if let Some(&i) = self.index.get(&(laddr, faddr)) {
            return Some(i);
        }
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut c = rds_proto::Config::new(
            Ipv4Addr::from(laddr),
            Ipv4Addr::from(faddr),
            self.generation,
            self.seed,
        );
        c.npaths = self.npaths;
        let engine = match Connection::new(c) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "cannot create RDS connection");
                return None;
            }
        };
        // The library tests remote congestion in the daemon region too: give the peer a map.
        if core.ref_cong_entry(faddr).is_err() {
            tracing::warn!(peer = %Ipv4Addr::from(faddr), "congestion table full; peer congestion not mirrored");
        }
        tracing::info!(local = %Ipv4Addr::from(laddr), peer = %Ipv4Addr::from(faddr), "new RDS/TCP connection");
        self.conns.push(Conn {
            engine,
            paths: Default::default(),
            laddr,
            faddr,
            maps_seen: 0,
        });
        let i = self.conns.len() - 1;
        self.index.insert((laddr, faddr), i);
        Some(i)
    }

    fn accept(&mut self, core: &mut PollCore, now: Instant) -> usize {
        let mut n = 0;
        loop {
            let Some(l) = &self.listener else { return n };
            let (sock, peer) = match l.accept() {
                Ok(x) => x,
                Err(_) => return n,
            };
            n += 1;
            let peer = peer.as_socket_ipv4();
            let local = sock.local_addr().ok().and_then(|a| a.as_socket_ipv4());
            let (Some(peer), Some(local)) = (peer, local) else {
                continue;
            };
            if core.cfg.is_local(*peer.ip()) || !core.cfg.is_local(*local.ip()) {
                // Local traffic uses loopback (spec §6.2); refuse.
                Stats::bump(&core.stats.tcp_accepts_refused);
                continue;
            }
            let _ = sock.set_nonblocking(true);
            let _ = sock.set_nodelay(true);
            let Some(i) = self.conn_for(core, u32::from(*local.ip()), u32::from(*peer.ip())) else {
                continue;
            };
            let c = &mut self.conns[i];
            match c.engine.handle_accepted(now, peer.port()) {
                Ok(path) => {
                    Stats::bump(&core.stats.tcp_accepts);
                    c.paths[path] = Some(PathSock {
                        sock,
                        connecting: false,
                    });
                }
                Err(_) => {
                    // Reset (linger 0), as the kernel does for the side that must connect.
                    let _ = sock.set_linger(Some(Duration::ZERO));
                    Stats::bump(&core.stats.tcp_accepts_refused);
                }
            }
            self.drain_events(core, i, now);
        }
    }

    fn reap_doorbells(&mut self, now: Instant) {
        self.doorbells.retain(|(s, deadline)| {
            let rev =
                shm_api::sys::poll_one(s.as_raw_fd(), libc::POLLOUT, 0).unwrap_or(libc::POLLERR);
            rev == 0 && now < *deadline
        });
    }

    fn path_down(&mut self, core: &mut PollCore, i: usize, path: usize, now: Instant) {
        let c = &mut self.conns[i];
        if let Some(ps) = c.paths[path].take() {
            if !ps.connecting {
                if let Some(acked) = bytes_acked(ps.sock.as_raw_fd()) {
                    c.engine
                        .handle_acked(path, acked.min(c.engine.stream_offset(path)));
                }
            }
            Stats::bump(&core.stats.tcp_path_down);
        }
        let _ = c.engine.handle_path_down(now, path);
    }

    fn poll_conn(&mut self, core: &mut PollCore, i: usize, now: Instant) -> usize {
        let mut work = 0;
        if self.conns[i]
            .engine
            .poll_timeout()
            .is_some_and(|t| t <= now)
        {
            self.conns[i].engine.handle_timeout(now);
            work += 1;
        }
        work += self.drain_events(core, i, now);
        for path in 0..MAX_PATHS {
            if self.conns[i].paths[path].is_none() {
                continue;
            }
            match self.poll_path(core, i, path, now) {
                Io::Progress(n) => work += n,
                Io::Idle => {}
                Io::Down => {
                    self.path_down(core, i, path, now);
                    work += 1;
                }
            }
        }
        work += self.drain_events(core, i, now);
        let c = &mut self.conns[i];
        let seen = c.engine.counters().cong_map_received;
        if seen != c.maps_seen {
            c.maps_seen = seen;
            core.mirror_peer_map(c.faddr, c.engine.peer_congestion_map().as_bytes());
        }
        work
    }

    fn poll_path(&mut self, core: &mut PollCore, i: usize, path: usize, now: Instant) -> Io {
        let c = &mut self.conns[i];
        let ps = c.paths[path].as_mut().expect("checked");
        let fd = ps.sock.as_raw_fd();
        if ps.connecting {
            let rev = shm_api::sys::poll_one(fd, libc::POLLOUT, 0).unwrap_or(libc::POLLERR);
            if rev == 0 {
                return Io::Idle;
            }
            match ps.sock.take_error() {
                Ok(None) if rev & libc::POLLOUT != 0 => {
                    ps.connecting = false;
                    if c.engine.handle_connected(now, path).is_err() {
                        return Io::Down;
                    }
                    Stats::bump(&core.stats.tcp_path_up);
                    return Io::Progress(1);
                }
                _ => return Io::Down,
            }
        }
        let mut work = 0;
        // Receive.
        let mut budget = READ_BUDGET;
        while budget > 0 {
            // SAFETY: recv into our own buffer.
            let n = unsafe {
                libc::recv(
                    fd,
                    self.rxbuf.as_mut_ptr() as *mut _,
                    self.rxbuf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n == 0 {
                return Io::Down;
            }
            if n < 0 {
                let e = std::io::Error::last_os_error().raw_os_error();
                if e == Some(libc::EAGAIN) || e == Some(libc::EINTR) {
                    break;
                }
                return Io::Down;
            }
            let n = n as usize;
            budget = budget.saturating_sub(n);
            work += 1;
            let (laddr, faddr) = (c.laddr, c.faddr);
            c.engine
                .handle_stream_data(now, path, &self.rxbuf[..n], |d| {
                    core.deliver_remote(laddr, faddr, d.sport, d.dport, d.payload);
                });
            if c.engine.path_state(path) != rds_proto::PathState::Up {
                // The engine dropped the path (malformed input): its Close event follows.
                return Io::Progress(work);
            }
        }
        // Transmit.
        let local_map = core.local_map(c.laddr);
        while let Some(chunk) = c.engine.poll_transmit_chunk(now, path, local_map) {
            let iov = [
                libc::iovec {
                    iov_base: chunk.header.as_ptr() as *mut _,
                    iov_len: chunk.header.len(),
                },
                libc::iovec {
                    iov_base: chunk.payload.as_ptr() as *mut _,
                    iov_len: chunk.payload.len(),
                },
            ];
            let want = chunk.len();
            let mut msg: libc::msghdr = unsafe_zeroed_msghdr();
            msg.msg_iov = iov.as_ptr() as *mut _;
            msg.msg_iovlen = 2;
            // SAFETY: the iovecs point into the engine's live buffers for this call only.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n < 0 {
                let e = std::io::Error::last_os_error().raw_os_error();
                if e == Some(libc::EAGAIN) || e == Some(libc::EINTR) {
                    break;
                }
                return Io::Down;
            }
            c.engine.advance_transmit(path, n as usize);
            work += 1;
            if (n as usize) < want {
                break;
            }
        }
        // Delivery confirmation: what TCP has acknowledged.
        if c.engine.unacked_messages(path) > 0 {
            if let Some(q) = outq(fd) {
                let written = c.engine.stream_offset(path);
                c.engine.handle_acked(path, written.saturating_sub(q));
            }
        }
        if work > 0 {
            Io::Progress(work)
        } else {
            Io::Idle
        }
    }

    fn drain_events(&mut self, core: &mut PollCore, i: usize, now: Instant) -> usize {
        let mut n = 0;
        while let Some(ev) = self.conns[i].engine.poll_event() {
            n += 1;
            let (laddr, faddr) = (self.conns[i].laddr, self.conns[i].faddr);
            match ev {
                Event::Connect { path } => {
                    Stats::bump(&core.stats.tcp_connects);
                    match new_stream(laddr)
                        .and_then(|s| connect_nonblocking(&s, faddr, self.port).map(|()| s))
                    {
                        Ok(sock) => {
                            self.conns[i].paths[path] = Some(PathSock {
                                sock,
                                connecting: true,
                            })
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, path, "connect failed");
                            let _ = self.conns[i].engine.handle_path_down(now, path);
                        }
                    }
                }
                Event::Doorbell => {
                    if let Ok(s) = new_stream(laddr) {
                        if connect_nonblocking(&s, faddr, self.port).is_ok() {
                            self.doorbells.push((s, now + Duration::from_secs(1)));
                        }
                    }
                }
                Event::Close { path } => self.path_down(core, i, path, now),
                Event::Released { token, len } => core.release_token(token, len as u64),
                Event::CongestionChanged { uncongested_mask } => {
                    core.mirror_peer_map(
                        faddr,
                        self.conns[i].engine.peer_congestion_map().as_bytes(),
                    );
                    self.conns[i].maps_seen = self.conns[i].engine.counters().cong_map_received;
                    core.remote_uncongested(uncongested_mask);
                }
                Event::PathsNegotiated { npaths } => {
                    tracing::info!(peer = %Ipv4Addr::from(faddr), npaths, "paths negotiated");
                }
                Event::PeerRestarted { .. } => {
                    tracing::info!(peer = %Ipv4Addr::from(faddr), "peer restarted");
                    Stats::bump(&core.stats.tcp_peer_restarts);
                }
            }
        }
        n
    }
}

impl NetTransport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        self.routes.iter().any(|p| p.contains(dest))
    }

    fn send(&mut self, core: &mut PollCore, m: OutMsg<'_>) -> bool {
        let Some(i) = self.conn_for(core, m.laddr, m.faddr) else {
            return false;
        };
        let now = now_since(self.epoch);
        self.conns[i]
            .engine
            .send(now, m.sport, m.dport, PoolBuf::copy_of(m.payload), m.token)
            .is_ok()
    }

    /// One pass over every connection and path. Returns the work done.
    fn poll(&mut self, core: &mut PollCore) -> usize {
        let now = now_since(self.epoch);
        let mut work = 0;
        self.pass = self.pass.wrapping_add(1);
        if self.pass % 16 == 0 || self.conns.is_empty() {
            work += self.accept(core, now);
        }
        if !self.doorbells.is_empty() {
            self.reap_doorbells(now);
        }
        for i in 0..self.conns.len() {
            work += self.poll_conn(core, i, now);
        }
        work
    }

    /// Drops queued and unacknowledged messages from `sport` on `laddr` to `dest`
    /// (`None` = every destination). Each comes back as a release.
    fn cancel(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        for c in self.conns.iter_mut().filter(|c| c.laddr == laddr) {
            match dest {
                Some((a, p)) if a == c.faddr => {
                    c.engine.cancel_sent_to(sport, p);
                }
                Some(_) => {}
                None => {
                    c.engine.cancel_socket(sport);
                }
            }
        }
    }

    /// Our local map for `laddr` changed: send it on every path of every connection from it.
    fn local_congestion_changed(&mut self, laddr: u32) {
        for c in self.conns.iter_mut().filter(|c| c.laddr == laddr) {
            c.engine.local_congestion_changed();
        }
    }

    /// Descriptors to watch while the poll core parks.
    fn park_fds(&self, out: &mut Vec<libc::pollfd>) {
        if let Some(l) = &self.listener {
            out.push(libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        for c in &self.conns {
            for p in c.paths.iter().flatten() {
                let events = if p.connecting {
                    libc::POLLOUT
                } else {
                    libc::POLLIN
                };
                out.push(libc::pollfd {
                    fd: p.sock.as_raw_fd(),
                    events,
                    revents: 0,
                });
            }
        }
    }

    /// Earliest engine timer, as a park timeout.
    fn next_timeout(&self) -> Option<Duration> {
        let now = now_since(self.epoch);
        let has_unacked = self
            .conns
            .iter()
            .any(|c| (0..MAX_PATHS).any(|p| c.engine.unacked_messages(p) > 0));
        if has_unacked {
            // Acknowledgements don't wake poll(); look again soon.
            return Some(Duration::from_millis(1));
        }
        self.conns
            .iter()
            .filter_map(|c| c.engine.poll_timeout())
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    /// Sums the engines' counters into the daemon's (published now and then, not per message).
    fn publish_counters(&self, stats: &Stats) {
        let mut sum = rds_proto::Counters::default();
        for c in &self.conns {
            let k = c.engine.counters();
            sum.tx_messages += k.tx_messages;
            sum.tx_retransmits += k.tx_retransmits;
            sum.rx_messages += k.rx_messages;
            sum.rx_delivered += k.rx_delivered;
            sum.rx_drop_bad_header += k.rx_drop_bad_header;
            sum.rx_drop_oversize += k.rx_drop_oversize;
            sum.rx_drop_dup_seq += k.rx_drop_dup_seq;
            sum.rx_drop_unknown += k.rx_drop_unknown;
            sum.rx_truncated += k.rx_truncated;
            sum.rx_bad_exthdr += k.rx_bad_exthdr;
            sum.path_errors += k.path_errors;
            sum.reconnects += k.reconnects;
            sum.cong_map_sent += k.cong_map_sent;
            sum.cong_map_received += k.cong_map_received;
            sum.pings_received += k.pings_received;
        }
        let set = |c: &std::sync::atomic::AtomicU64, v: u64| c.store(v, Ordering::Relaxed);
        set(&stats.tcp_tx_messages, sum.tx_messages);
        set(&stats.tcp_retransmits, sum.tx_retransmits);
        set(&stats.tcp_rx_messages, sum.rx_messages);
        set(
            &stats.tcp_drop_bad_header,
            sum.rx_drop_bad_header + sum.rx_bad_exthdr,
        );
        set(&stats.tcp_drop_oversize, sum.rx_drop_oversize);
        set(&stats.tcp_drop_dup_seq, sum.rx_drop_dup_seq);
        set(
            &stats.tcp_drop_unknown,
            sum.rx_drop_unknown + sum.rx_truncated,
        );
        set(&stats.tcp_path_errors, sum.path_errors);
        set(&stats.tcp_reconnects, sum.reconnects);
        set(&stats.tcp_cong_maps_sent, sum.cong_map_sent);
        set(&stats.tcp_cong_maps_received, sum.cong_map_received);
        set(&stats.tcp_pings_received, sum.pings_received);
    }
}

fn unsafe_zeroed_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
    unsafe { std::mem::zeroed() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_recycles_buffers() {
        let a = PoolBuf::copy_of(&[1, 2, 3]);
        let cap_ptr = a.0.as_ptr();
        drop(a);
        let b = PoolBuf::copy_of(&[4, 5]);
        assert_eq!(b.as_ref(), &[4, 5]);
        assert_eq!(b.0.as_ptr(), cap_ptr, "the dropped buffer was reused");
    }
}

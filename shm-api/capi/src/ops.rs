//! The socket calls on rdsd sockets, with Linux RDS's errno values: `Err(errno)`.
//!
//! Pointer arguments follow the contract of the libc call of the same name.

use crate::table::{self, Entry};
use libc::{c_int, c_ulong, c_void, msghdr, size_t, sockaddr, socklen_t};
use shm_api::ctrl::FilterRule;
use shm_api::{GroupFilter, GroupFlags, RecvFlags, RecvMsg};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// SOL_RDS option numbers (uapi/linux/rds.h).
const RDS_CANCEL_SENT_TO: c_int = 1;
const RDS_GET_MR: c_int = 2;
const RDS_FREE_MR: c_int = 3;
const RDS_RECVERR: c_int = 5;
const RDS_CONG_MONITOR: c_int = 6;
const SO_RDS_TRANSPORT: c_int = 8;
const RDS_TRANS_IB: c_int = 0;
const RDS_TRANS_TCP: c_int = 2;
const RDS_TRANS_NONE: c_int = !0;
const RDS_CMSG_CONG_UPDATE: c_int = 5;
/// Oracle's `RDS_CONN_RESET` shares number 8 with `SO_RDS_TRANSPORT` (told apart by length).
const ORACLE_CONN_RESET_LEN: socklen_t = 12;
const RDS_INFO_FIRST: c_int = 10000;
const RDS_INFO_LAST: c_int = 10017;
/// `struct rds_info_counter`: `u8 name[32]; u64 value;` packed.
const INFO_COUNTER_LEN: usize = 40;
/// The first of the IPv6 tables (`RDS6_INFO_CONNECTIONS`); each is its v4 table's id + 10.
const RDS6_INFO_FIRST: c_int = 10011;
/// `rds_info_connection` flags.
const INFO_CONN_CONNECTING: u8 = 2;
const INFO_CONN_CONNECTED: u8 = 4;
const SIOCRDSSETTOS: c_ulong = 0x89E0;
const SIOCRDSGETTOS: c_ulong = 0x89E1;

/// An io::Error from shm-api as an errno.
fn os(e: io::Error) -> i32 {
    if shm_api::is_daemon_gone(&e) {
        return libc::ECONNRESET;
    }
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// The socket behind `fd` for this call (read in place, no lock: `slots`).
fn entry(fd: c_int) -> Result<table::Ref<Entry>, i32> {
    table::read(fd).ok_or(libc::EBADF)
}

/// Opens a socket; see `rdsd_socket`.
pub fn socket(domain: c_int, ty: c_int, protocol: c_int) -> Result<c_int, i32> {
    if domain != crate::RDSD_AF_RDS {
        return Err(libc::EAFNOSUPPORT);
    }
    if ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) != libc::SOCK_SEQPACKET || protocol != 0 {
        return Err(libc::ESOCKTNOSUPPORT);
    }
    let rdsd = table::rdsd()?;
    let sock = rdsd.socket().map_err(os)?;
    let cmd = if ty & libc::SOCK_CLOEXEC != 0 {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    let fd = raw_fcntl(sock.pollable_fd_unsynced(), cmd, 0);
    if fd < 0 {
        return Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EMFILE));
    }
    if ty & libc::SOCK_NONBLOCK != 0 {
        let _ = sock.set_nonblocking(true);
        set_fd_nonblock_flag(fd, true);
    }
    let e = Arc::new(Entry {
        sock,
        generation: table::fork_generation(),
        transport: AtomicI32::new(RDS_TRANS_NONE),
        tos: AtomicU8::new(0),
        timeouts_us: [AtomicU64::new(0), AtomicU64::new(0)],
    });
    match table::insert(fd, e) {
        Ok(old) => {
            if let Some(old) = old {
                table::release(old);
            }
            Ok(fd)
        }
        Err(err) => {
            // SAFETY: our own dup, never handed out.
            unsafe { libc::close(fd) };
            Err(err)
        }
    }
}

/// fcntl(2) as a raw syscall: the preload library defines `fcntl`, and these calls must not
/// come back through it.
fn raw_fcntl(fd: c_int, cmd: c_int, arg: c_int) -> c_int {
    // SAFETY: fcntl with an int argument; no pointers involved.
    unsafe { libc::syscall(libc::SYS_fcntl, fd, cmd, arg) as c_int }
}

/// Sets or clears O_NONBLOCK on the open file description (so F_GETFL tells the truth).
fn set_fd_nonblock_flag(fd: c_int, on: bool) {
    let fl = raw_fcntl(fd, libc::F_GETFL, 0);
    if fl >= 0 {
        let nfl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        raw_fcntl(fd, libc::F_SETFL, nfl);
    }
}

/// Reads an IPv4 address from a `sockaddr_in` (or a v4-mapped `sockaddr_in6`).
unsafe fn read_addr(addr: *const sockaddr, len: socklen_t) -> Result<SocketAddrV4, i32> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sockaddr_in>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller guarantees `len` readable bytes; sa_family is the first field.
    let family = unsafe { std::ptr::read_unaligned(addr as *const libc::sa_family_t) };
    match family as c_int {
        libc::AF_INET => {
            // SAFETY: at least sizeof(sockaddr_in) bytes (checked above).
            let a = unsafe { std::ptr::read_unaligned(addr as *const libc::sockaddr_in) };
            Ok(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: at least sizeof(sockaddr_in6) bytes (checked).
            let a = unsafe { std::ptr::read_unaligned(addr as *const libc::sockaddr_in6) };
            let ip6 = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            let ip = ip6.to_ipv4_mapped().ok_or(libc::EAFNOSUPPORT)?;
            Ok(SocketAddrV4::new(ip, u16::from_be(a.sin6_port)))
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// Writes a `sockaddr_in` the way the kernel does: truncated to `*len`, `*len` = full size.
unsafe fn write_addr(a: SocketAddrV4, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    // SAFETY: sockaddr_in is plain data; zeroed is valid.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as libc::sa_family_t;
    sin.sin_port = a.port().to_be();
    sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
    let full = std::mem::size_of::<libc::sockaddr_in>();
    // SAFETY: the caller gives `*len` writable bytes at `addr` and a valid `len`.
    unsafe {
        let n = (*len as usize).min(full);
        std::ptr::copy_nonoverlapping(&sin as *const _ as *const u8, addr as *mut u8, n);
        *len = full as socklen_t;
    }
}

/// bind(2).
pub unsafe fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> Result<c_int, i32> {
    let e = entry(fd)?;
    // SAFETY: forwarded contract.
    let a = unsafe { read_addr(addr, len) }?;
    e.socket()?.bind(a).map_err(os)?;
    Ok(0)
}

/// connect(2): records the default destination.
pub unsafe fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> Result<c_int, i32> {
    let e = entry(fd)?;
    // SAFETY: forwarded contract.
    let a = unsafe { read_addr(addr, len) }?;
    e.socket()?.connect(a).map_err(os)?;
    Ok(0)
}

/// getsockname(2).
pub unsafe fn getsockname(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> Result<c_int, i32> {
    let e = entry(fd)?;
    let a = e
        .socket()?
        .local_addr()
        .unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
    // SAFETY: forwarded contract.
    unsafe { write_addr(a, addr, len) };
    Ok(0)
}

/// getpeername(2).
pub unsafe fn getpeername(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> Result<c_int, i32> {
    let e = entry(fd)?;
    let a = e.socket()?.peer_addr().map_err(os)?;
    // SAFETY: forwarded contract.
    unsafe { write_addr(a, addr, len) };
    Ok(0)
}

/// A blocking call that ran out its SO_SNDTIMEO/SO_RCVTIMEO fails with EAGAIN on Linux.
fn timeout_is_eagain(e: i32) -> i32 {
    if e == libc::ETIMEDOUT {
        libc::EAGAIN
    } else {
        e
    }
}

fn send_bytes(
    e: &Entry,
    buf: &[u8],
    dest: Option<SocketAddrV4>,
    flags: c_int,
) -> Result<usize, i32> {
    // As rds_sendmsg: any flag but these is EOPNOTSUPP.
    if flags & !(libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC | libc::MSG_ZEROCOPY) != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    e.socket()?
        .send_msg(buf, dest, flags & libc::MSG_DONTWAIT != 0)
        .map_err(|err| timeout_is_eagain(os(err)))
}

/// sendto(2) (send(2) with a null address).
pub unsafe fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> Result<usize, i32> {
    let e = entry(fd)?;
    let dest = if addr.is_null() {
        None
    } else {
        // SAFETY: forwarded contract.
        Some(unsafe { read_addr(addr, addrlen) }?)
    };
    let bytes = if len == 0 {
        &[][..]
    } else {
        // SAFETY: the caller gives `len` readable bytes at `buf`.
        unsafe { std::slice::from_raw_parts(buf as *const u8, len) }
    };
    send_bytes(&e, bytes, dest, flags)
}

thread_local! {
    static GATHER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The iovecs of `msg` (empty if none).
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: usize) -> &'a [libc::iovec] {
    if iov.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the caller gives `n` iovecs at `iov`.
        unsafe { std::slice::from_raw_parts(iov, n) }
    }
}

/// sendmsg(2). Control messages at SOL_RDS (RDMA, atomics, Oracle async send) are not
/// supported: EOPNOTSUPP.
pub unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> Result<usize, i32> {
    let e = entry(fd)?;
    if msg.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller gives a valid msghdr.
    let m = unsafe { &*msg };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        // SAFETY: a valid control buffer of msg_controllen bytes.
        let mut c = unsafe { libc::CMSG_FIRSTHDR(m) };
        while !c.is_null() {
            // SAFETY: CMSG_FIRSTHDR/NXTHDR return headers inside the buffer.
            if unsafe { (*c).cmsg_level } == crate::RDSD_SOL_RDS {
                return Err(libc::EOPNOTSUPP);
            }
            // SAFETY: as above.
            c = unsafe { libc::CMSG_NXTHDR(m, c) };
        }
    }
    let dest = if m.msg_name.is_null() || m.msg_namelen == 0 {
        None
    } else {
        // SAFETY: forwarded contract (msg_namelen bytes at msg_name).
        Some(unsafe { read_addr(m.msg_name as *const sockaddr, m.msg_namelen) }?)
    };
    // SAFETY: forwarded contract.
    let iov = unsafe { iovecs(m.msg_iov, m.msg_iovlen) };
    if iov.len() == 1 {
        // SAFETY: one iovec of iov_len readable bytes.
        let b = unsafe { std::slice::from_raw_parts(iov[0].iov_base as *const u8, iov[0].iov_len) };
        return send_bytes(&e, b, dest, flags);
    }
    GATHER.with(|g| {
        let mut g = g.borrow_mut();
        g.clear();
        for v in iov {
            if v.iov_len > 0 {
                // SAFETY: each iovec has iov_len readable bytes.
                g.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
        }
        send_bytes(&e, &g, dest, flags)
    })
}

/// The first `vlen` mmsghdrs at `msgvec`, at most 1024 (UIO_MAXIOV, as Linux); none for a
/// `vlen` of 0, EFAULT for a null vector.
///
/// # Safety
/// `msgvec` points to `vlen` valid mmsghdrs that nothing else uses during the borrow.
unsafe fn mmsg_vec<'a>(
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
) -> Result<&'a mut [libc::mmsghdr], i32> {
    let n = (vlen as usize).min(1024);
    if n == 0 {
        return Ok(&mut []);
    }
    if msgvec.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(msgvec, n) })
}

/// sendmmsg(2): the messages go to rdsd as one batch (`Socket::send_batch`: one release of
/// the tx ring and at most one doorbell). Each `msg_len` is set for the messages sent; the
/// count is returned, or the first message's error if none was sent. At most 1024 messages
/// per call (UIO_MAXIOV, as Linux).
pub unsafe fn sendmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> Result<usize, i32> {
    let e = entry(fd)?;
    if flags & !(libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC | libc::MSG_ZEROCOPY) != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: forwarded contract.
    let msgs = unsafe { mmsg_vec(msgvec, vlen) }?;
    let n = msgs.len();
    if n == 0 {
        return Ok(0);
    }
    // Payloads: single iovecs in place; gathered ones copied into one buffer first.
    enum Payload<'a> {
        InPlace(&'a [u8]),
        Gathered(std::ops::Range<usize>),
    }
    let mut gathered: Vec<u8> = Vec::new();
    let mut spans: Vec<(Payload<'_>, Option<SocketAddrV4>)> = Vec::with_capacity(n);
    let mut first_err = None;
    for m in msgs.iter() {
        let h = &m.msg_hdr;
        let dest = if h.msg_name.is_null() || h.msg_namelen == 0 {
            Ok(None)
        } else {
            // SAFETY: forwarded contract (msg_namelen bytes at msg_name).
            unsafe { read_addr(h.msg_name as *const sockaddr, h.msg_namelen) }.map(Some)
        };
        let dest = match dest {
            Ok(d) => d,
            Err(err) => {
                first_err = Some(err);
                break;
            }
        };
        // SAFETY: forwarded contract.
        let iov = unsafe { iovecs(h.msg_iov, h.msg_iovlen) };
        if iov.len() == 1 {
            let (base, n) = (iov[0].iov_base as *const u8, iov[0].iov_len);
            // SAFETY: one iovec of iov_len readable bytes, alive for this call.
            let b = unsafe { std::slice::from_raw_parts(base, n) };
            spans.push((Payload::InPlace(b), dest));
        } else {
            let start = gathered.len();
            for v in iov.iter().filter(|v| v.iov_len > 0) {
                // SAFETY: each iovec has iov_len readable bytes.
                gathered.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
            spans.push((Payload::Gathered(start..gathered.len()), dest));
        }
    }
    let batch: Vec<(&[u8], Option<SocketAddrV4>)> = spans
        .iter()
        .map(|(p, d)| {
            let b = match p {
                Payload::InPlace(b) => *b,
                Payload::Gathered(r) => &gathered[r.clone()],
            };
            (b, *d)
        })
        .collect();
    if batch.is_empty() {
        return Err(first_err.unwrap_or(libc::EINVAL));
    }
    let sent = e
        .socket()?
        .send_batch(&batch, flags & libc::MSG_DONTWAIT != 0)
        .map_err(|err| timeout_is_eagain(os(err)))?;
    for (m, (b, _)) in msgs.iter_mut().zip(&batch).take(sent) {
        m.msg_len = b.len() as libc::c_uint;
    }
    Ok(sent)
}

fn recv_flags(flags: c_int) -> RecvFlags {
    RecvFlags {
        peek: flags & libc::MSG_PEEK != 0,
        trunc: flags & libc::MSG_TRUNC != 0,
        dontwait: flags & libc::MSG_DONTWAIT != 0,
    }
}

/// The errno of a receive that failed; an empty non-blocking one (EAGAIN) first waits one
/// `pause`. Programs written for the kernel poll in a bare loop (`while (recv(..,
/// MSG_DONTWAIT) < 0)`), since there a call is a syscall; here an empty call is ~50 ns of
/// loads, and such a loop reads the ring's producer line so often that rdsd's poll core,
/// which writes it, waits for it: the C round trip was ~5% slower with a call this fast than
/// with the one that had four locked instructions (bench/preload/alternate.sh), and the pause
/// gives that back (`rds-bench` pauses in its own loop).
fn recv_error(err: io::Error) -> i32 {
    let e = timeout_is_eagain(os(err));
    if e == libc::EAGAIN {
        std::hint::spin_loop();
    }
    e
}

fn recv_bytes(e: &Entry, buf: &mut [u8], flags: c_int) -> Result<RecvMsg, i32> {
    e.socket()?
        .recv_msg(buf, recv_flags(flags))
        .map_err(recv_error)
}

/// recvfrom(2) (recv(2) with null address pointers). A congestion notification sets
/// `*addrlen` to 0.
pub unsafe fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> Result<usize, i32> {
    let e = entry(fd)?;
    let bytes = if len == 0 || buf.is_null() {
        &mut [][..]
    } else {
        // SAFETY: the caller gives `len` writable bytes at `buf`.
        unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, len) }
    };
    let m = recv_bytes(&e, bytes, flags)?;
    match m.from {
        // SAFETY: forwarded contract.
        Some(a) => unsafe { write_addr(a, addr, addrlen) },
        None if !addrlen.is_null() => {
            // SAFETY: forwarded contract.
            unsafe { *addrlen = 0 }
        }
        None => {}
    }
    Ok(m.len)
}

/// recvmsg(2).
pub unsafe fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> Result<usize, i32> {
    let e = entry(fd)?;
    if msg.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller gives a valid msghdr.
    let m = unsafe { &mut *msg };
    // SAFETY: forwarded contract.
    let iov = unsafe { iovecs(m.msg_iov, m.msg_iovlen) };
    let got = if iov.len() == 1 {
        // SAFETY: forwarded contract (one iovec).
        recv_bytes(&e, unsafe { iov_bytes(&iov[0]) }, flags)?
    } else {
        let mut tmp = vec![0u8; gathered_len(iov)];
        let got = recv_bytes(&e, &mut tmp, flags)?;
        // SAFETY: forwarded contract.
        unsafe { scatter(&tmp[..got.len.min(tmp.len())], iov) };
        got
    };
    // SAFETY: forwarded contract.
    unsafe { fill_msghdr(m, &got) };
    Ok(got.len)
}

/// The writable bytes of one iovec (none for a null or empty one).
///
/// # Safety
/// `v` describes `iov_len` writable bytes that nothing else uses during the borrow.
unsafe fn iov_bytes<'a>(v: &libc::iovec) -> &'a mut [u8] {
    if v.iov_len == 0 || v.iov_base.is_null() {
        &mut [][..]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(v.iov_base as *mut u8, v.iov_len) }
    }
}

/// What a receive into several iovecs is received into first: their total, at most a
/// message's largest size.
fn gathered_len(iov: &[libc::iovec]) -> usize {
    iov.iter()
        .map(|v| v.iov_len)
        .fold(0usize, usize::saturating_add)
        .min(shm_api::layout::MAX_MSG_SIZE)
}

/// Copies `bytes` across `iov` in order.
///
/// # Safety
/// Each iovec describes `iov_len` writable bytes.
unsafe fn scatter(mut bytes: &[u8], iov: &[libc::iovec]) {
    for v in iov {
        if v.iov_base.is_null() {
            // The kernel would say EFAULT; skipping it never writes through null.
            continue;
        }
        let n = bytes.len().min(v.iov_len);
        if n > 0 {
            // SAFETY: the caller's contract; n <= iov_len.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.iov_base as *mut u8, n) };
        }
        bytes = &bytes[n..];
    }
}

/// The rest of a msghdr after a receive: msg_flags (MSG_TRUNC, MSG_CTRUNC), the sender's
/// address, and RDS_CMSG_CONG_UPDATE for a congestion notification.
///
/// # Safety
/// `msg_name` (when not null) has `msg_namelen` writable bytes, and `msg_control` (when not
/// null) `msg_controllen`.
unsafe fn fill_msghdr(m: &mut msghdr, got: &RecvMsg) {
    m.msg_flags = if got.truncated { libc::MSG_TRUNC } else { 0 };
    match got.from {
        Some(a) if !m.msg_name.is_null() => {
            // SAFETY: msg_namelen writable bytes at msg_name.
            unsafe { write_addr(a, m.msg_name as *mut sockaddr, &mut m.msg_namelen) }
        }
        _ => m.msg_namelen = 0,
    }
    let controllen = m.msg_controllen;
    m.msg_controllen = 0;
    if let Some(mask) = got.cong_update {
        // SAFETY: pure size arithmetic.
        let space = unsafe { libc::CMSG_SPACE(8) } as usize;
        if m.msg_control.is_null() || controllen < space {
            m.msg_flags |= libc::MSG_CTRUNC;
        } else {
            m.msg_controllen = space;
            // SAFETY: the control buffer has `controllen >= space` bytes, so the first header
            // and its 8 data bytes fit.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(m);
                (*c).cmsg_level = crate::RDSD_SOL_RDS;
                (*c).cmsg_type = RDS_CMSG_CONG_UPDATE;
                (*c).cmsg_len = libc::CMSG_LEN(8) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u64, mask);
            }
        }
    }
}

/// recvmmsg(2), with Linux's semantics: up to `vlen` messages (at most 1024, UIO_MAXIOV),
/// each `msg_len` set; without MSG_WAITFORONE a blocking call waits until all `vlen` have
/// come, with it only for the first; `timeout` is checked (and set to what is left) after
/// each message received, never while waiting, as Linux does (so a call with a timeout
/// takes its messages one at a time). The first message's error is returned if none came; an error after that ends
/// the call with the count (the next call meets it again). The messages already queued are
/// taken as one batch (`Socket::recv_batch`: one release of the rx ring), not one call each.
pub unsafe fn recvmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> Result<usize, i32> {
    let e = entry(fd)?;
    let deadline = if timeout.is_null() {
        None
    } else {
        // SAFETY: the caller gives a valid timespec.
        let t = unsafe { *timeout };
        if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
            return Err(libc::EINVAL);
        }
        Some(Instant::now() + Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
    };
    // SAFETY: forwarded contract.
    let msgs = unsafe { mmsg_vec(msgvec, vlen) }?;
    let n = msgs.len();
    if n == 0 {
        return Ok(0);
    }
    let mut got = 0;
    let mut flags = flags;
    // With a timeout, one message at a time: Linux looks at the clock after each.
    let step = if deadline.is_some() { 1 } else { n };
    while got < n {
        let upto = (got + step).min(n);
        // SAFETY: forwarded contract.
        match unsafe { recv_batch_into(&e, &mut msgs[got..upto], flags) } {
            Ok(k) => got += k,
            Err(err) if got == 0 => return Err(err),
            Err(_) => break,
        }
        if flags & libc::MSG_WAITFORONE != 0 {
            flags |= libc::MSG_DONTWAIT;
        }
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            // SAFETY: checked non-null above.
            unsafe {
                (*timeout).tv_sec = left.as_secs() as libc::time_t;
                (*timeout).tv_nsec = left.subsec_nanos() as libc::c_long;
            }
            if left.is_zero() {
                break;
            }
        }
    }
    Ok(got)
}

/// Receives a batch into `msgs` (at least one message, waiting for it as recvmsg does, or
/// an error), filling each mmsghdr as recvmsg fills its msghdr.
///
/// # Safety
/// As recvmsg(2) for each mmsghdr.
unsafe fn recv_batch_into(
    e: &Entry,
    msgs: &mut [libc::mmsghdr],
    flags: c_int,
) -> Result<usize, i32> {
    let sock = e.socket()?;
    let rflags = recv_flags(flags);
    let iovs: Vec<&[libc::iovec]> = msgs
        .iter()
        .map(|m| {
            // SAFETY: forwarded contract (each mmsghdr's iovec array).
            unsafe { iovecs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen) }
        })
        .collect();
    // A payload lands in its single iovec directly, unless that iovec overlaps another's
    // (apps may give every message the same buffer: two `&mut` over one byte must not
    // exist); those and several iovecs take a scratch buffer, scattered afterwards.
    let mut direct: Vec<bool> = iovs.iter().map(|v| v.len() == 1).collect();
    let mut spans: Vec<(usize, usize, usize)> = iovs
        .iter()
        .enumerate()
        .filter(|(_, v)| v.len() == 1 && v[0].iov_len > 0 && !v[0].iov_base.is_null())
        .map(|(i, v)| (v[0].iov_base as usize, v[0].iov_len, i))
        .collect();
    spans.sort_unstable();
    let mut end = 0usize;
    for &(start, len, i) in &spans {
        if start < end {
            direct[i] = false;
        } else {
            end = start.saturating_add(len);
        }
    }
    let mut scratch: Vec<Vec<u8>> = iovs
        .iter()
        .zip(&direct)
        .map(|(v, &d)| {
            if d {
                Vec::new()
            } else {
                vec![0u8; gathered_len(v)]
            }
        })
        .collect();
    let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(msgs.len());
    for ((v, &d), tmp) in iovs.iter().zip(&direct).zip(scratch.iter_mut()) {
        bufs.push(if d {
            // SAFETY: forwarded contract; no other buffer of this batch overlaps it.
            unsafe { iov_bytes(&v[0]) }
        } else {
            &mut tmp[..]
        });
    }
    let mut out = vec![RecvMsg::default(); msgs.len()];
    let k = sock
        .recv_batch(&mut bufs, &mut out, rflags)
        .map_err(recv_error)?;
    drop(bufs);
    for (i, (m, got)) in msgs.iter_mut().zip(&out).take(k).enumerate() {
        if !direct[i] {
            let tmp = &scratch[i];
            // SAFETY: forwarded contract.
            unsafe { scatter(&tmp[..got.len.min(tmp.len())], iovs[i]) };
        }
        // SAFETY: forwarded contract.
        unsafe { fill_msghdr(&mut m.msg_hdr, got) };
        m.msg_len = got.len as libc::c_uint;
    }
    Ok(k)
}

unsafe fn read_int(val: *const c_void, len: socklen_t) -> Result<c_int, i32> {
    if val.is_null() || (len as usize) < std::mem::size_of::<c_int>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: at least 4 readable bytes (checked).
    Ok(unsafe { std::ptr::read_unaligned(val as *const c_int) })
}

/// Reads a `T` from an option value of at least `need` bytes (EINVAL if shorter or null).
unsafe fn read_opt<T: Copy>(val: *const c_void, len: socklen_t, need: usize) -> Result<T, i32> {
    if val.is_null() || (len as usize) < need {
        return Err(libc::EINVAL);
    }
    let mut t = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: the caller gives `len >= need` readable bytes at `val`; T is plain C data, valid
    // zeroed, so the bytes past `need` (rules a filter does not use) stay zero.
    unsafe {
        std::ptr::copy_nonoverlapping(
            val as *const u8,
            t.as_mut_ptr() as *mut u8,
            need.min(std::mem::size_of::<T>()),
        );
        Ok(t.assume_init())
    }
}

/// A group address from a `sockaddr_in`: EINVAL unless AF_INET (Linux's MCAST_JOIN_GROUP
/// answers EINVAL for a group of another family, not EAFNOSUPPORT); shm-api checks the range.
fn group_addr(sin: &libc::sockaddr_in) -> Result<SocketAddrV4, i32> {
    if sin.sin_family as c_int != libc::AF_INET {
        return Err(libc::EINVAL);
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

/// The value of RDSD_GROUP_CREATE / RDSD_GROUP_LEAVE.
unsafe fn read_group(val: *const c_void, len: socklen_t) -> Result<SocketAddrV4, i32> {
    // SAFETY: forwarded contract.
    let sin: libc::sockaddr_in =
        unsafe { read_opt(val, len, std::mem::size_of::<libc::sockaddr_in>()) }?;
    group_addr(&sin)
}

/// The value of RDSD_GROUP_JOIN / RDSD_GROUP_SET_FLAGS; unknown flag bits are EINVAL.
unsafe fn read_group_req(
    val: *const c_void,
    len: socklen_t,
) -> Result<(SocketAddrV4, GroupFlags), i32> {
    // SAFETY: forwarded contract.
    let r: crate::rdsd_group_req =
        unsafe { read_opt(val, len, std::mem::size_of::<crate::rdsd_group_req>()) }?;
    if r.flags & !(crate::RDSD_GROUP_LOOPBACK | crate::RDSD_GROUP_DROP_WHEN_FULL) != 0 {
        return Err(libc::EINVAL);
    }
    Ok((group_addr(&r.group)?, GroupFlags::from_bits(r.flags)))
}

/// The value of RDSD_GROUP_FILTER: `len` must cover the header and `nrules` rules (the
/// header alone for RDSD_GROUP_FILTER_ALL).
unsafe fn read_group_filter(
    val: *const c_void,
    len: socklen_t,
) -> Result<(SocketAddrV4, GroupFilter), i32> {
    let head = std::mem::offset_of!(crate::rdsd_group_filter, rules);
    // SAFETY: forwarded contract; only the header is read.
    let h: crate::rdsd_group_filter = unsafe { read_opt(val, len, head) }?;
    let g = group_addr(&h.group)?;
    if h.mode == crate::RDSD_GROUP_FILTER_ALL {
        return Ok((g, GroupFilter::All));
    }
    let n = h.nrules as usize;
    if n == 0 || n > crate::RDSD_GROUP_FILTER_MAX_RULES {
        return Err(libc::EINVAL);
    }
    let need = head + n * std::mem::size_of::<crate::rdsd_group_rule>();
    // SAFETY: forwarded contract; the header and `n` rules are read.
    let f: crate::rdsd_group_filter = unsafe { read_opt(val, len, need) }?;
    let rules = f.rules[..n]
        .iter()
        .map(|r| FilterRule {
            addr: Ipv4Addr::from(u32::from_be(r.addr.s_addr)),
            prefix_len: r.prefix_len,
            first_port: r.first_port,
            last_port: r.last_port,
        })
        .collect();
    match h.mode {
        crate::RDSD_GROUP_FILTER_ONLY => Ok((g, GroupFilter::Only(rules))),
        crate::RDSD_GROUP_FILTER_EXCEPT => Ok((g, GroupFilter::Except(rules))),
        _ => Err(libc::EINVAL),
    }
}

unsafe fn read_timeval(val: *const c_void, len: socklen_t) -> Result<Option<Duration>, i32> {
    if val.is_null() || (len as usize) < std::mem::size_of::<libc::timeval>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: a whole timeval is readable (checked).
    let tv = unsafe { std::ptr::read_unaligned(val as *const libc::timeval) };
    if tv.tv_usec < 0 || tv.tv_usec >= 1_000_000 {
        return Err(libc::EDOM);
    }
    if tv.tv_sec < 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) {
        return Ok(None);
    }
    Ok(Some(
        Duration::from_secs(tv.tv_sec as u64) + Duration::from_micros(tv.tv_usec as u64),
    ))
}

/// SO_RCVTIMEO/SO_SNDTIMEO in both the old and the 64-bit-time numbers (the same layout on
/// 64-bit targets).
const SO_RCVTIMEO_NEW: c_int = 66;
const SO_SNDTIMEO_NEW: c_int = 67;

/// setsockopt(2).
pub unsafe fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> Result<c_int, i32> {
    let e = entry(fd)?;
    let s = e.socket()?;
    match (level, name) {
        (libc::SOL_SOCKET, libc::SO_SNDBUF | libc::SO_SNDBUFFORCE) => {
            // SAFETY: forwarded contract.
            let v = unsafe { read_int(val, len) }?;
            s.set_send_buffer_size(v.max(0) as usize).map_err(os)?;
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF | libc::SO_RCVBUFFORCE) => {
            // SAFETY: forwarded contract.
            let v = unsafe { read_int(val, len) }?;
            s.set_recv_buffer_size(v.max(0) as usize).map_err(os)?;
        }
        (libc::SOL_SOCKET, libc::SO_REUSEADDR | libc::SO_REUSEPORT) => {
            // SAFETY: forwarded contract.
            unsafe { read_int(val, len) }?;
        }
        (libc::SOL_SOCKET, libc::SO_SNDTIMEO | SO_SNDTIMEO_NEW) => {
            // SAFETY: forwarded contract.
            let t = unsafe { read_timeval(val, len) }?;
            s.set_send_timeout(t).map_err(os)?;
            e.timeouts_us[0].store(t.map_or(0, |d| d.as_micros() as u64), Ordering::Relaxed);
        }
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | SO_RCVTIMEO_NEW) => {
            // SAFETY: forwarded contract.
            let t = unsafe { read_timeval(val, len) }?;
            s.set_recv_timeout(t).map_err(os)?;
            e.timeouts_us[1].store(t.map_or(0, |d| d.as_micros() as u64), Ordering::Relaxed);
        }
        (crate::RDSD_SOL_RDS, RDS_CANCEL_SENT_TO) => {
            if s.local_addr().is_none() {
                return Err(libc::ENOTCONN);
            }
            // SAFETY: forwarded contract.
            let a = unsafe { read_addr(val as *const sockaddr, len) }?;
            s.cancel_sent_to(Some(a)).map_err(os)?;
        }
        // Asks for notifications of failed RDMA operations; there are none without RDMA ops.
        (crate::RDSD_SOL_RDS, RDS_RECVERR) => {
            // SAFETY: forwarded contract.
            unsafe { read_int(val, len) }?;
        }
        (crate::RDSD_SOL_RDS, RDS_CONG_MONITOR) => {
            // SAFETY: forwarded contract.
            let v = unsafe { read_int(val, len) }?;
            s.set_cong_monitor(v != 0).map_err(os)?;
        }
        (crate::RDSD_SOL_RDS, SO_RDS_TRANSPORT) if len == ORACLE_CONN_RESET_LEN => {}
        (crate::RDSD_SOL_RDS, SO_RDS_TRANSPORT) => {
            // SAFETY: forwarded contract.
            let t = unsafe { read_int(val, len) }?;
            if s.local_addr().is_some() || e.transport.load(Ordering::Relaxed) != RDS_TRANS_NONE {
                return Err(libc::EOPNOTSUPP);
            }
            // rdsd picks the transport by destination; both kinds it serves are accepted.
            if t != RDS_TRANS_TCP && t != RDS_TRANS_IB {
                return Err(libc::EINVAL);
            }
            e.transport.store(t, Ordering::Relaxed);
        }
        (crate::RDSD_SOL_RDS, crate::RDSD_GROUP_CREATE)
            if len as usize >= std::mem::size_of::<crate::rdsd_group_req>() =>
        {
            // SAFETY: forwarded contract (the length covers a struct rdsd_group_req).
            let r: crate::rdsd_group_req =
                unsafe { read_opt(val, len, std::mem::size_of::<crate::rdsd_group_req>()) }?;
            let g = group_addr(&r.group)?;
            match r.flags {
                0 => s.group_create(g),
                crate::RDSD_GROUP_OPEN => s.group_create_open(g),
                _ => return Err(libc::EINVAL),
            }
            .map_err(os)?;
        }
        (crate::RDSD_SOL_RDS, crate::RDSD_GROUP_CREATE) => {
            // SAFETY: forwarded contract.
            let g = unsafe { read_group(val, len) }?;
            s.group_create(g).map_err(os)?;
        }
        (crate::RDSD_SOL_RDS, crate::RDSD_GROUP_LEAVE) => {
            // SAFETY: forwarded contract.
            let g = unsafe { read_group(val, len) }?;
            s.group_leave(g).map_err(os)?;
        }
        (crate::RDSD_SOL_RDS, crate::RDSD_GROUP_JOIN | crate::RDSD_GROUP_SET_FLAGS) => {
            // SAFETY: forwarded contract.
            let (g, flags) = unsafe { read_group_req(val, len) }?;
            if name == crate::RDSD_GROUP_JOIN {
                s.group_join(g, flags).map_err(os)?;
            } else {
                s.group_set_flags(g, flags).map_err(os)?;
            }
        }
        (crate::RDSD_SOL_RDS, crate::RDSD_GROUP_FILTER) => {
            // SAFETY: forwarded contract.
            let (g, filter) = unsafe { read_group_filter(val, len) }?;
            s.group_set_filter(g, &filter).map_err(os)?;
        }
        (crate::RDSD_SOL_RDS, RDS_GET_MR | RDS_FREE_MR) => return Err(libc::ENOPROTOOPT),
        // Linux RDS hands other SOL_SOCKET options to the generic socket layer, which accepts
        // them (SO_PRIORITY, SO_KEEPALIVE, SO_LINGER, ...); none changes what RDS does.
        (libc::SOL_SOCKET, _) => {}
        _ => return Err(libc::ENOPROTOOPT),
    }
    Ok(0)
}

unsafe fn put_int(v: c_int, val: *mut c_void, len: *mut socklen_t) -> Result<c_int, i32> {
    if val.is_null() || len.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: forwarded contract: `*len` writable bytes at `val`.
    unsafe {
        if (*len as usize) < std::mem::size_of::<c_int>() {
            return Err(libc::EINVAL);
        }
        std::ptr::write_unaligned(val as *mut c_int, v);
        *len = std::mem::size_of::<c_int>() as socklen_t;
    }
    Ok(0)
}

unsafe fn put_timeval(us: u64, val: *mut c_void, len: *mut socklen_t) -> Result<c_int, i32> {
    if val.is_null() || len.is_null() {
        return Err(libc::EFAULT);
    }
    let tv = libc::timeval {
        tv_sec: (us / 1_000_000) as libc::time_t,
        tv_usec: (us % 1_000_000) as libc::suseconds_t,
    };
    let n = std::mem::size_of::<libc::timeval>();
    // SAFETY: forwarded contract.
    unsafe {
        if (*len as usize) < n {
            return Err(libc::EINVAL);
        }
        std::ptr::write_unaligned(val as *mut libc::timeval, tv);
        *len = n as socklen_t;
    }
    Ok(0)
}

/// rdsd's counters as `struct rds_info_counter` records.
fn info_counters() -> Result<Vec<u8>, i32> {
    let text = table::rdsd()?.stats().map_err(os)?;
    let mut out = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(name), Some(value)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(value) = value.parse::<u64>() else {
            continue;
        };
        let mut rec = [0u8; INFO_COUNTER_LEN];
        let n = name.len().min(31);
        rec[..n].copy_from_slice(&name.as_bytes()[..n]);
        rec[32..].copy_from_slice(&value.to_ne_bytes());
        out.extend_from_slice(&rec);
    }
    Ok(out)
}

/// An RDS_INFO table: which listing, in the v4 record layout or the IPv6 one (`RDS6_INFO_*`:
/// the same fields with `struct in6_addr` addresses; rdsd's IPv4 addresses are v4-mapped
/// there, as the kernel's v6 tables list its IPv4 entries).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Table {
    Sockets,
    Connections,
    SendMessages,
    RetransMessages,
    RecvMessages,
    TcpSockets,
    IbConnections,
}

impl Table {
    /// The table of RDS_INFO id `name`, and whether it is an IPv6 one.
    fn of(name: c_int) -> Option<(Table, bool)> {
        let t = match name - RDS_INFO_FIRST {
            6 | 15 => Table::Sockets,
            1 | 11 => Table::Connections,
            3 | 12 => Table::SendMessages,
            4 | 13 => Table::RetransMessages,
            5 | 14 => Table::RecvMessages,
            7 | 16 => Table::TcpSockets,
            8 | 17 => Table::IbConnections,
            _ => return None,
        };
        Some((t, name >= RDS6_INFO_FIRST))
    }

    /// Bytes of one record (the kernel's packed structs: the v6 connection and TCP socket
    /// records have no `tos`).
    fn record_len(self, v6: bool) -> usize {
        match (self, v6) {
            (Table::Sockets, false) => 28,
            (Table::Sockets, true) => 52,
            (Table::Connections, false) => 42,
            (Table::Connections, true) => 65,
            (Table::SendMessages | Table::RetransMessages | Table::RecvMessages, false) => 26,
            (Table::SendMessages | Table::RetransMessages | Table::RecvMessages, true) => 50,
            (Table::TcpSockets, false) => 41,
            (Table::TcpSockets, true) => 64,
            // Not packed: `tos`, `sl`, two bytes of padding, then `cache_allocs`.
            (Table::IbConnections, false) => 68,
            (Table::IbConnections, true) => 92,
        }
    }

    /// The records, from rdsd's `Info` document.
    fn records(self, v6: bool) -> Result<Vec<u8>, i32> {
        use shm_api::ctrl::{INFO_CONNECTIONS, INFO_MESSAGES, INFO_PATHS, INFO_SOCKETS};
        let sections = match self {
            Table::Sockets => INFO_SOCKETS,
            Table::Connections | Table::TcpSockets | Table::IbConnections => {
                INFO_CONNECTIONS | INFO_PATHS
            }
            _ => INFO_MESSAGES,
        };
        let doc = shm_api::info_at(&table::control_path(), sections).map_err(os)?;
        let v: serde_json::Value = serde_json::from_str(&doc).map_err(|_| libc::EIO)?;
        let rdma = v["rdsd"]["transports"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t == "rdma"));
        if self == Table::IbConnections && !rdma {
            // As a kernel without the RDMA transport: no such table.
            return Err(libc::ENOPROTOOPT);
        }
        let mut out = Vec::new();
        let rec = Records { out: &mut out, v6 };
        match self {
            Table::Sockets => rec.sockets(&v),
            Table::Connections => rec.connections(&v),
            Table::TcpSockets => rec.tcp_sockets(&v),
            Table::IbConnections => rec.ib_connections(&v),
            Table::SendMessages => rec.messages(&v["send_messages"]),
            Table::RetransMessages => rec.messages(&v["retrans_messages"]),
            Table::RecvMessages => rec.messages(&v["recv_messages"]),
        }
        debug_assert!(out.len().is_multiple_of(self.record_len(v6)));
        Ok(out)
    }
}

/// Writes RDS_INFO records: addresses as 4 bytes, or 16 (v4-mapped) for the v6 tables.
struct Records<'a> {
    out: &'a mut Vec<u8>,
    v6: bool,
}

fn json_addr(v: &serde_json::Value) -> Ipv4Addr {
    v.as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or(Ipv4Addr::UNSPECIFIED)
}

impl Records<'_> {
    fn addr(&mut self, a: Ipv4Addr) {
        if self.v6 {
            self.out.extend_from_slice(&a.to_ipv6_mapped().octets());
        } else {
            self.out.extend_from_slice(&a.octets());
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }

    /// Every socket rdsd serves (all processes, as the kernel's table): `rds_info_socket`.
    /// rdsd does not know an app's connected address: 0.
    fn sockets(mut self, v: &serde_json::Value) {
        for s in v["sockets"].as_array().into_iter().flatten() {
            let num = |k: &str| s[k].as_u64().unwrap_or(0);
            self.bytes(&(num("sndbuf") as u32).to_ne_bytes());
            self.addr(json_addr(&s["addr"]));
            self.addr(Ipv4Addr::UNSPECIFIED);
            self.bytes(&(num("port") as u16).to_be_bytes());
            self.bytes(&[0; 2]);
            self.bytes(&(num("rcvbuf") as u32).to_ne_bytes());
            self.bytes(&(num("app") << 32 | num("slot")).to_ne_bytes());
        }
    }

    /// Every RDS connection of rdsd's network transports: `rds_info_connection`, path 0's
    /// sequence numbers and state, as the kernel reports (SENDING, a transient lock in the
    /// kernel, is never set).
    fn connections(mut self, v: &serde_json::Value) {
        for c in v["connections"].as_array().into_iter().flatten() {
            let path0 = c["paths"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["index"].as_u64() == Some(0));
            let seq = |k: &str| path0.and_then(|p| p[k].as_u64()).unwrap_or(0);
            let flags = match path0.and_then(|p| p["state"].as_str()) {
                Some("up") => INFO_CONN_CONNECTED,
                Some("connecting") => INFO_CONN_CONNECTING,
                _ => 0,
            };
            let mut transport = [0u8; 16];
            let name = c["transport"].as_str().unwrap_or("").as_bytes();
            let n = name.len().min(15);
            transport[..n].copy_from_slice(&name[..n]);
            self.bytes(&seq("next_tx_seq").to_ne_bytes());
            self.bytes(&seq("next_rx_seq").to_ne_bytes());
            self.addr(json_addr(&c["laddr"]));
            self.addr(json_addr(&c["faddr"]));
            self.bytes(&transport);
            self.bytes(&[flags]);
            if !self.v6 {
                self.bytes(&[0]); // tos
            }
        }
    }

    /// Every TCP connection carrying an RDS path (kernel or userspace TCP):
    /// `rds_info_tcp_socket`. The three sequence fields are offsets in the path's stream, not
    /// the TCP sequence numbers the kernel reports (rdsd keeps no initial sequence number):
    /// bytes written (`last_sent_nxt` and `last_expected_una`) and bytes the peer acknowledged
    /// (`last_seen_una`), modulo 2^32.
    fn tcp_sockets(mut self, v: &serde_json::Value) {
        for c in v["connections"].as_array().into_iter().flatten() {
            for p in c["paths"].as_array().into_iter().flatten() {
                let (Some(lport), Some(pport)) =
                    (p["local_port"].as_u64(), p["peer_port"].as_u64())
                else {
                    continue;
                };
                let num = |k: &str| p[k].as_u64().unwrap_or(0);
                let written = num("tx_stream_bytes");
                let acked = written.saturating_sub(num("unacked_bytes"));
                self.addr(json_addr(&c["laddr"]));
                self.bytes(&(lport as u16).to_be_bytes());
                self.addr(json_addr(&c["faddr"]));
                self.bytes(&(pport as u16).to_be_bytes());
                self.bytes(&num("rx_header_rem").to_ne_bytes());
                self.bytes(&num("rx_payload_rem").to_ne_bytes());
                self.bytes(&(written as u32).to_ne_bytes());
                self.bytes(&(written as u32).to_ne_bytes());
                self.bytes(&(acked as u32).to_ne_bytes());
                if !self.v6 {
                    self.bytes(&[0]); // tos
                }
            }
        }
    }

    /// Every connection of rdsd's RDMA transport: `rds_info_rdma_connection`, the queue pair of
    /// its lowest path that has one (GIDs zero while none does). rdsd registers no memory for
    /// RDMA operations, uses no service level or tos and caches no receive buffers: those
    /// fields read 0.
    fn ib_connections(mut self, v: &serde_json::Value) {
        for c in v["connections"].as_array().into_iter().flatten() {
            if c["transport"] != "rdma" {
                continue;
            }
            let qp = c["paths"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["rdma"].is_object())
                .min_by_key(|p| p["index"].as_u64())
                .map(|p| &p["rdma"]);
            let gid = |k: &str| {
                qp.and_then(|q| q[k].as_str())
                    .and_then(|g| g.parse::<std::net::Ipv6Addr>().ok())
                    .map_or([0; 16], |g| g.octets())
            };
            let num = |k: &str| qp.and_then(|q| q[k].as_u64()).unwrap_or(0) as u32;
            self.addr(json_addr(&c["laddr"]));
            self.addr(json_addr(&c["faddr"]));
            self.bytes(&gid("src_gid"));
            self.bytes(&gid("dst_gid"));
            for k in ["max_send_wr", "max_recv_wr", "max_send_sge"] {
                self.bytes(&num(k).to_ne_bytes());
            }
            self.bytes(&[0; 8]); // rdma_mr_max, rdma_mr_size
            self.bytes(&[0; 4]); // tos, sl, padding
            self.bytes(&[0; 4]); // cache_allocs
        }
    }

    /// One of rdsd's message listings: `rds_info_message`. Received messages carry no
    /// sequence number in rdsd's rings: 0.
    fn messages(mut self, list: &serde_json::Value) {
        for m in list.as_array().into_iter().flatten() {
            let num = |k: &str| m[k].as_u64().unwrap_or(0);
            self.bytes(&num("seq").to_ne_bytes());
            self.bytes(&(num("len") as u32).to_ne_bytes());
            self.addr(json_addr(&m["laddr"]));
            self.addr(json_addr(&m["faddr"]));
            self.bytes(&(num("lport") as u16).to_be_bytes());
            self.bytes(&(num("fport") as u16).to_be_bytes());
            self.bytes(&[0, 0]); // flags, tos
        }
    }
}

/// The RDS_INFO protocol: copies `recs` if `*len` holds them (returning `item`), else ENOSPC;
/// `*len` = the bytes of the table either way.
unsafe fn put_info(
    recs: &[u8],
    item: usize,
    val: *mut c_void,
    len: *mut socklen_t,
) -> Result<c_int, i32> {
    // SAFETY: forwarded contract of getsockopt(2): `*len` writable bytes at `val`.
    unsafe {
        let have = *len as usize;
        *len = recs.len() as socklen_t;
        if have < recs.len() {
            return Err(libc::ENOSPC);
        }
        if !recs.is_empty() {
            if val.is_null() {
                return Err(libc::EFAULT);
            }
            std::ptr::copy_nonoverlapping(recs.as_ptr(), val as *mut u8, recs.len());
        }
    }
    Ok(item as c_int)
}

/// getsockopt(2).
pub unsafe fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> Result<c_int, i32> {
    let e = entry(fd)?;
    let s = e.socket()?;
    if len.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: every arm writes through `val`/`len`, which the caller guarantees (getsockopt(2)'s
    // contract, forwarded by this function's own safety contract).
    unsafe {
        match (level, name) {
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
                put_int((s.send_buffer_size() * 2) as c_int, val, len)
            }
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
                put_int((s.recv_buffer_size() * 2) as c_int, val, len)
            }
            (libc::SOL_SOCKET, libc::SO_TYPE) => put_int(libc::SOCK_SEQPACKET, val, len),
            (libc::SOL_SOCKET, libc::SO_DOMAIN) => put_int(crate::RDSD_AF_RDS, val, len),
            (libc::SOL_SOCKET, libc::SO_PROTOCOL) => put_int(0, val, len),
            (libc::SOL_SOCKET, libc::SO_ERROR | libc::SO_REUSEADDR) => put_int(0, val, len),
            (libc::SOL_SOCKET, libc::SO_SNDTIMEO | SO_SNDTIMEO_NEW) => {
                put_timeval(e.timeouts_us[0].load(Ordering::Relaxed), val, len)
            }
            (libc::SOL_SOCKET, libc::SO_RCVTIMEO | SO_RCVTIMEO_NEW) => {
                put_timeval(e.timeouts_us[1].load(Ordering::Relaxed), val, len)
            }
            (crate::RDSD_SOL_RDS, SO_RDS_TRANSPORT) => {
                put_int(e.transport.load(Ordering::Relaxed), val, len)
            }
            (crate::RDSD_SOL_RDS, crate::RDSD_INFO_COUNTERS) => {
                put_info(&info_counters()?, INFO_COUNTER_LEN, val, len)
            }
            (crate::RDSD_SOL_RDS, RDS_INFO_FIRST..=RDS_INFO_LAST) if Table::of(name).is_some() => {
                let (t, v6) = Table::of(name).expect("checked");
                put_info(&t.records(v6)?, t.record_len(v6), val, len)
            }
            // CONNECTION_STATS, IWARP_CONNECTIONS: ENOPROTOOPT, as a kernel without them.
            (crate::RDSD_SOL_RDS, RDS_INFO_FIRST..=RDS_INFO_LAST) => Err(libc::ENOPROTOOPT),
            _ => Err(libc::ENOPROTOOPT),
        }
    }
}

/// O_NONBLOCK.
pub fn set_nonblocking(fd: c_int, on: bool) -> Result<(), i32> {
    let e = entry(fd)?;
    e.socket()?.set_nonblocking(on).map_err(os)?;
    set_fd_nonblock_flag(fd, on);
    Ok(())
}

/// Turns readiness on for `fd` (idempotent; one request to rdsd the first time).
pub fn enable_readiness(fd: c_int) -> Result<(), i32> {
    let e = entry(fd)?;
    e.socket()?.pollable_fd().map_err(os)?;
    Ok(())
}

/// ioctl(2): FIONREAD, FIONBIO, SIOCRDSSETTOS, SIOCRDSGETTOS; ENOTTY otherwise.
pub unsafe fn ioctl(fd: c_int, request: c_ulong, arg: usize) -> Result<c_int, i32> {
    let e = entry(fd)?;
    let s = e.socket()?;
    let p = arg as *mut c_void;
    if p.is_null() {
        return Err(libc::EFAULT);
    }
    match request {
        libc::FIONREAD => {
            let flags = RecvFlags {
                peek: true,
                trunc: true,
                dontwait: true,
            };
            let n = match s.recv_msg(&mut [], flags) {
                Ok(m) => m.len,
                Err(err) if err.raw_os_error() == Some(libc::EAGAIN) => 0,
                Err(err) => return Err(os(err)),
            };
            // SAFETY: FIONREAD writes an int at `arg`.
            unsafe { std::ptr::write_unaligned(p as *mut c_int, n as c_int) };
        }
        libc::FIONBIO => {
            // SAFETY: FIONBIO reads an int at `arg`.
            let on = unsafe { std::ptr::read_unaligned(p as *const c_int) } != 0;
            set_nonblocking(fd, on)?;
        }
        SIOCRDSSETTOS => {
            // SAFETY: SIOCRDSSETTOS reads a u8 at `arg`.
            e.tos.store(unsafe { *(p as *const u8) }, Ordering::Relaxed);
        }
        SIOCRDSGETTOS => {
            // SAFETY: SIOCRDSGETTOS writes a u8 at `arg`.
            unsafe { *(p as *mut u8) = e.tos.load(Ordering::Relaxed) };
        }
        _ => return Err(libc::ENOTTY),
    }
    Ok(0)
}

/// Makes `newfd` (already a dup of `oldfd`, made by the caller) stand for the same socket.
/// A socket `newfd` stood for before (dup2 over it) is released.
pub fn adopt_dup(oldfd: c_int, newfd: c_int) -> Result<(), i32> {
    let Some(e) = table::get(oldfd) else {
        return Ok(());
    };
    if let Some(old) = table::insert(newfd, e)? {
        table::release(old);
    }
    Ok(())
}

/// Forgets `fd` as a socket (it was closed or replaced by the kernel), releasing its reference.
pub fn forget(fd: c_int) {
    if let Some(e) = table::remove(fd) {
        table::release(e);
    }
}

/// True if a receive on `fd` would not block now (a message, a notification, or an error to
/// report). Shared memory only: the readiness fd can lag the ring by a pass of rdsd's poll
/// core, so poll/select wrappers confirm a POLLIN with this.
pub fn has_input(fd: c_int) -> bool {
    let Some(e) = table::get(fd) else {
        return true;
    };
    let Ok(s) = e.socket() else {
        return true;
    };
    let flags = RecvFlags {
        peek: true,
        trunc: true,
        dontwait: true,
    };
    !matches!(s.recv_msg(&mut [], flags), Err(err) if err.raw_os_error() == Some(libc::EAGAIN))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rds_info_rdma_connection` (68 bytes, not packed) and its v6 form (92): addresses,
    /// the lowest path's GIDs and QP sizes; only RDMA connections are listed.
    #[test]
    fn ib_connection_records_have_the_kernels_layout() {
        let doc = serde_json::json!({"connections": [
            {"transport": "tcp", "laddr": "10.0.0.1", "faddr": "10.0.0.3", "paths": []},
            {"transport": "rdma", "laddr": "10.0.0.1", "faddr": "10.0.0.2", "paths": [
                {"index": 3, "rdma": {"src_gid": "fe80::1", "dst_gid": "fe80::2",
                    "max_send_wr": 9, "max_recv_wr": 8, "max_send_sge": 2}},
                {"index": 1, "rdma": {"src_gid": "fe80::a", "dst_gid": "fe80::b",
                    "max_send_wr": 65, "max_recv_wr": 64, "max_send_sge": 2}},
                {"index": 0}
            ]}
        ]});
        for v6 in [false, true] {
            let mut out = Vec::new();
            Records { out: &mut out, v6 }.ib_connections(&doc);
            let len = Table::IbConnections.record_len(v6);
            assert_eq!(out.len(), len);
            let a = if v6 { 16 } else { 4 };
            let addr = |at: usize| {
                let b = &out[at..at + a];
                if v6 {
                    let o: [u8; 16] = b.try_into().unwrap();
                    std::net::Ipv6Addr::from(o).to_ipv4_mapped().unwrap()
                } else {
                    Ipv4Addr::new(b[0], b[1], b[2], b[3])
                }
            };
            assert_eq!(addr(0), Ipv4Addr::new(10, 0, 0, 1));
            assert_eq!(addr(a), Ipv4Addr::new(10, 0, 0, 2));
            let gid = |at: usize| {
                std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&out[at..at + 16]).unwrap())
            };
            assert_eq!(gid(2 * a), "fe80::a".parse::<std::net::Ipv6Addr>().unwrap());
            assert_eq!(
                gid(2 * a + 16),
                "fe80::b".parse::<std::net::Ipv6Addr>().unwrap()
            );
            let u32_at = |at: usize| u32::from_ne_bytes(out[at..at + 4].try_into().unwrap());
            let wr = 2 * a + 32;
            assert_eq!([u32_at(wr), u32_at(wr + 4), u32_at(wr + 8)], [65, 64, 2]);
            // rdma_mr_max, rdma_mr_size, tos, sl, padding, cache_allocs.
            assert!(out[wr + 12..].iter().all(|&b| b == 0));
        }
    }
}

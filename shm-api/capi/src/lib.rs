//! librdsd: the C ABI of rdsd.
//!
//! An RDS socket is a file descriptor (`rdsd_socket(AF_RDS, SOCK_SEQPACKET, 0)`); the calls
//! mirror the socket API and report errors through `errno` with the values Linux RDS gives.
//! The fd is a real kernel fd: after [`rdsd_poll_fd`] (or through the preload library, on the
//! first poll/select/epoll_ctl that names it) it is readable while a message or notification
//! is queued and writable while there is send-buffer room, so it mixes with other fds in
//! poll/epoll. Data moves through shared memory with no syscall (shm-api).
//!
//! Multicast groups (224.0.0.0/4 plus a port) are rdsd's extension: `RDSD_GROUP_*` options
//! at `SOL_RDS` ([`RDSD_GROUP_CREATE`] to [`RDSD_GROUP_FILTER`], 10001 to 10005) with
//! [`rdsd_group_req`] and [`rdsd_group_filter`] as values; sends to a group address go to every
//! member or none (README.md, "Multicast groups").
//!
//! The header `include/rdsd.h` is generated from this file by cbindgen. The Rust functions in
//! [`ops`] are the same calls for the preload library (`shm-api/preload`).

#![allow(clippy::missing_safety_doc)] // each C function documents its pointer contract

mod fork;
pub mod ops;
mod slots;
pub mod table;

use libc::{
    c_int, c_ulong, c_void, in_addr, msghdr, size_t, sockaddr, sockaddr_in, socklen_t, ssize_t,
};

/// The address family of RDS (`AF_RDS`/`PF_RDS`).
pub const RDSD_AF_RDS: c_int = 21;
/// The socket option level of RDS (`SOL_RDS`).
pub const RDSD_SOL_RDS: c_int = 276;
/// `getsockopt(SOL_RDS, RDSD_INFO_COUNTERS)`: rdsd's counters as `struct rds_info_counter`
/// records (32-byte NUL-padded name, u64 value).
pub const RDSD_INFO_COUNTERS: c_int = 10000;

// Multicast groups (rdsd's extension; README.md, "Multicast groups"): a group is an address in
// 224.0.0.0/4 with a port not 0. `sendto`/`sendmsg`/`connect` to it send to the group: each
// message reaches every eligible member or none, all members see one order, and a
// non-blocking send fails with EAGAIN while a member without RDSD_GROUP_DROP_WHEN_FULL is full
// (a blocking one waits). Members receive with the sender's socket address as the source. The
// options below are `setsockopt(fd, SOL_RDS, ...)` numbers; with a malformed option value
// (optlen too short, `sin_family` not AF_INET, an address outside 224.0.0.0/4, port 0, an
// unknown flag or filter mode, more than 16 rules) they fail with EINVAL, as Linux's
// MCAST_JOIN_GROUP does for a group that is not AF_INET.

/// `setsockopt(SOL_RDS, RDSD_GROUP_CREATE, &(struct sockaddr_in){group}, sizeof)`: creates the
/// group; it lives while this socket is open or it has members. The creator does not join.
/// Sockets of the creator's uid (and root) may join it; with
/// `&(struct rdsd_group_req){group, RDSD_GROUP_OPEN}` and its size, any uid may. EADDRINUSE if
/// it exists, ENOBUFS past rdsd's limits (64 groups per process, 64 group addresses).
pub const RDSD_GROUP_CREATE: c_int = 10001;
/// `setsockopt(SOL_RDS, RDSD_GROUP_JOIN, &(struct rdsd_group_req){group, flags}, sizeof)`:
/// joins the group with `RDSD_GROUP_*` flags. The socket must be bound (ENOTCONN); ENOENT if
/// there is no such group, EADDRINUSE if already a member, ENOBUFS past rdsd's member limit,
/// EACCES if the creator had another uid and did not create it open.
pub const RDSD_GROUP_JOIN: c_int = 10002;
/// `setsockopt(SOL_RDS, RDSD_GROUP_LEAVE, &(struct sockaddr_in){group}, sizeof)`: leaves the
/// group. EADDRNOTAVAIL if not a member, ENOENT if there is no such group. Closing the socket
/// leaves all its groups.
pub const RDSD_GROUP_LEAVE: c_int = 10003;
/// `setsockopt(SOL_RDS, RDSD_GROUP_SET_FLAGS, &(struct rdsd_group_req){group, flags}, sizeof)`:
/// replaces the flags of this socket's membership. EADDRNOTAVAIL if not a member.
pub const RDSD_GROUP_SET_FLAGS: c_int = 10004;
/// `setsockopt(SOL_RDS, RDSD_GROUP_FILTER, &(struct rdsd_group_filter){...}, len)`: replaces
/// this socket's filter on the group, for every later message. `len` may stop after the
/// `nrules` rules used. EADDRNOTAVAIL if not a member.
pub const RDSD_GROUP_FILTER: c_int = 10005;

/// Create flag (`RDSD_GROUP_CREATE` with a `struct rdsd_group_req`): sockets of any uid may
/// join.
pub const RDSD_GROUP_OPEN: u32 = 1;
/// Membership flag: the member receives what its own socket sends to the group.
pub const RDSD_GROUP_LOOPBACK: u32 = 1;
/// Membership flag: while its receive buffer is full the member is skipped (and counted)
/// instead of holding the group back.
pub const RDSD_GROUP_DROP_WHEN_FULL: u32 = 2;

/// Filter mode: every message (the rules are ignored).
pub const RDSD_GROUP_FILTER_ALL: u32 = 0;
/// Filter mode: only messages from senders matching one of the rules.
pub const RDSD_GROUP_FILTER_ONLY: u32 = 1;
/// Filter mode: every message except those from senders matching one of the rules.
pub const RDSD_GROUP_FILTER_EXCEPT: u32 = 2;
/// The most rules in a filter.
pub const RDSD_GROUP_FILTER_MAX_RULES: usize = 16;

/// The option value of RDSD_GROUP_JOIN and RDSD_GROUP_SET_FLAGS.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdsd_group_req {
    /// The group (AF_INET, an address in 224.0.0.0/4, a port not 0).
    pub group: sockaddr_in,
    /// `RDSD_GROUP_LOOPBACK` | `RDSD_GROUP_DROP_WHEN_FULL`; other bits are EINVAL.
    pub flags: u32,
}

/// One filter rule: senders bound to an address in `addr/prefix_len` and a port in
/// `first_port..=last_port`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdsd_group_rule {
    /// The prefix's address, in network byte order (as `sin_addr`).
    pub addr: in_addr,
    /// Prefix length, 0 to 32 (0 matches every address).
    pub prefix_len: u8,
    /// Zero.
    pub pad: [u8; 3],
    /// First port of the range, in host byte order.
    pub first_port: u16,
    /// Last port of the range (included), in host byte order; not below `first_port`.
    pub last_port: u16,
}

/// The option value of RDSD_GROUP_FILTER; the option length may end after `rules[nrules - 1]`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdsd_group_filter {
    /// The group.
    pub group: sockaddr_in,
    /// `RDSD_GROUP_FILTER_ALL`, `_ONLY` or `_EXCEPT`.
    pub mode: u32,
    /// Rules used: 1 to 16 for ONLY and EXCEPT, ignored for ALL.
    pub nrules: u32,
    /// The rules.
    pub rules: [rdsd_group_rule; RDSD_GROUP_FILTER_MAX_RULES],
}

/// Sets this thread's errno (the preload library's wrappers use these three too).
pub fn set_errno(e: i32) {
    // SAFETY: __errno_location returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// An int-returning call's result: the value, or -1 with errno set.
pub fn ret_int(r: Result<c_int, i32>) -> c_int {
    r.unwrap_or_else(|e| {
        set_errno(e);
        -1
    })
}

/// A length-returning call's result: the length, or -1 with errno set.
pub fn ret_len(r: Result<usize, i32>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// Opens an RDS socket: `domain` must be `AF_RDS` (21), `type` `SOCK_SEQPACKET` (with
/// `SOCK_NONBLOCK`/`SOCK_CLOEXEC` allowed), `protocol` 0. Attaches to rdsd on first use
/// (`$RDSD_SOCKET`, else /run/rdsd/rdsd.sock); EAFNOSUPPORT if rdsd can't be reached.
#[no_mangle]
pub extern "C" fn rdsd_socket(domain: c_int, type_: c_int, protocol: c_int) -> c_int {
    ret_int(ops::socket(domain, type_, protocol))
}

/// Binds to a specific local IPv4 address (`struct sockaddr_in`; port 0 picks one).
#[no_mangle]
pub unsafe extern "C" fn rdsd_bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the caller passes `len` readable bytes at `addr` (as for bind(2)).
    ret_int(unsafe { ops::bind(fd, addr, len) })
}

/// Sets the default destination for `rdsd_send` (a group address too: then every send goes
/// to the group, and the fd's POLLOUT follows the group's members).
#[no_mangle]
pub unsafe extern "C" fn rdsd_connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: as for connect(2).
    ret_int(unsafe { ops::connect(fd, addr, len) })
}

/// The bound address (0.0.0.0:0 while unbound).
#[no_mangle]
pub unsafe extern "C" fn rdsd_getsockname(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> c_int {
    // SAFETY: as for getsockname(2).
    ret_int(unsafe { ops::getsockname(fd, addr, len) })
}

/// The destination set by `rdsd_connect`; ENOTCONN if none.
#[no_mangle]
pub unsafe extern "C" fn rdsd_getpeername(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> c_int {
    // SAFETY: as for getpeername(2).
    ret_int(unsafe { ops::getpeername(fd, addr, len) })
}

/// Sends one message to the connected destination.
#[no_mangle]
pub unsafe extern "C" fn rdsd_send(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: as for send(2).
    ret_len(unsafe { ops::sendto(fd, buf, len, flags, std::ptr::null(), 0) })
}

/// Sends one message to `addr` (`struct sockaddr_in`). Returns `len`, or -1 with errno
/// ENOBUFS (destination congested, non-blocking), EAGAIN (send buffer full, non-blocking),
/// EMSGSIZE, ENOTCONN (unbound), EINVAL. To a group address (224.0.0.0/4): EAGAIN
/// (non-blocking) while a member without RDSD_GROUP_DROP_WHEN_FULL is full, and nobody has
/// received the message; a blocking send waits.
#[no_mangle]
pub unsafe extern "C" fn rdsd_sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> ssize_t {
    // SAFETY: as for sendto(2).
    ret_len(unsafe { ops::sendto(fd, buf, len, flags, addr, addrlen) })
}

/// Sends one message gathered from `msg->msg_iov` to `msg->msg_name`.
#[no_mangle]
pub unsafe extern "C" fn rdsd_sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: as for sendmsg(2).
    ret_len(unsafe { ops::sendmsg(fd, msg, flags) })
}

/// sendmmsg(2): sends up to `vlen` messages (at most 1024) as one batch to rdsd, setting each
/// `msg_len`; returns how many were sent, or -1 with errno if none was.
#[no_mangle]
pub unsafe extern "C" fn rdsd_sendmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> c_int {
    // SAFETY: as for sendmmsg(2).
    ret_int(unsafe { ops::sendmmsg(fd, msgvec, vlen, flags) }.map(|n| n as c_int))
}

/// Receives one message (MSG_PEEK, MSG_TRUNC, MSG_DONTWAIT as in rds(7)).
#[no_mangle]
pub unsafe extern "C" fn rdsd_recv(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: as for recv(2).
    ret_len(unsafe {
        ops::recvfrom(
            fd,
            buf,
            len,
            flags,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })
}

/// Receives one message and its sender. A congestion notification (RDS_CONG_MONITOR) reads
/// as 0 bytes with an empty address; use `rdsd_recvmsg` to get its RDS_CMSG_CONG_UPDATE.
#[no_mangle]
pub unsafe extern "C" fn rdsd_recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> ssize_t {
    // SAFETY: as for recvfrom(2).
    ret_len(unsafe { ops::recvfrom(fd, buf, len, flags, addr, addrlen) })
}

/// Receives one message scattered into `msg->msg_iov`; the sender in `msg->msg_name`,
/// MSG_TRUNC in `msg->msg_flags`, RDS_CMSG_CONG_UPDATE (a u64 port mask) in the control data.
#[no_mangle]
pub unsafe extern "C" fn rdsd_recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: as for recvmsg(2).
    ret_len(unsafe { ops::recvmsg(fd, msg, flags) })
}

/// recvmmsg(2): receives up to `vlen` messages (at most 1024), setting each `msg_len` and
/// filling each `msg_hdr` as `rdsd_recvmsg` does; returns how many came, or -1 with errno if
/// none did. Linux's rules: without MSG_WAITFORONE a blocking call waits for all `vlen`, with
/// it for the first only; `timeout` (may be NULL) is checked after messages arrive, not while
/// waiting. What is already queued is taken as one batch (one release of the rx ring).
#[no_mangle]
pub unsafe extern "C" fn rdsd_recvmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    // SAFETY: as for recvmmsg(2).
    ret_int(unsafe { ops::recvmmsg(fd, msgvec, vlen, flags, timeout) }.map(|n| n as c_int))
}

/// SOL_SOCKET: SO_SNDBUF, SO_RCVBUF (and their FORCE forms), SO_REUSEADDR (no effect),
/// SO_SNDTIMEO, SO_RCVTIMEO; other SOL_SOCKET options are accepted with no effect, as the
/// kernel's generic layer does. SOL_RDS: RDS_CANCEL_SENT_TO, RDS_CONG_MONITOR, RDS_RECVERR,
/// SO_RDS_TRANSPORT, and rdsd's group options RDSD_GROUP_CREATE, RDSD_GROUP_JOIN,
/// RDSD_GROUP_LEAVE, RDSD_GROUP_SET_FLAGS, RDSD_GROUP_FILTER; anything else: ENOPROTOOPT.
#[no_mangle]
pub unsafe extern "C" fn rdsd_setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: as for setsockopt(2).
    ret_int(unsafe { ops::setsockopt(fd, level, name, val, len) })
}

/// The options of `rdsd_setsockopt` (SO_SNDBUF/SO_RCVBUF read back twice the value set, as
/// Linux), SO_TYPE, SO_DOMAIN, SO_PROTOCOL, SO_ERROR, and the SOL_RDS RDS_INFO tables
/// (counters, sockets, connections, send/retransmit/receive messages, TCP sockets and, with
/// the RDMA transport, IB connections; each also as its RDS6_INFO table) in the kernel's record
/// layouts: returns the record size and sets `*len` to the bytes written, or fails with ENOSPC
/// and `*len` = the bytes needed.
#[no_mangle]
pub unsafe extern "C" fn rdsd_getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    // SAFETY: as for getsockopt(2).
    ret_int(unsafe { ops::getsockopt(fd, level, name, val, len) })
}

/// FIONREAD (length of the next message, 0 if none), FIONBIO, SIOCRDSSETTOS/SIOCRDSGETTOS.
#[no_mangle]
pub unsafe extern "C" fn rdsd_ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` points to the int (or u8 for the TOS calls) the request reads or writes.
    ret_int(unsafe { ops::ioctl(fd, request, arg as usize) })
}

/// O_NONBLOCK on (non-zero) or off: later sends and receives fail with EAGAIN (or ENOBUFS)
/// instead of blocking.
#[no_mangle]
pub extern "C" fn rdsd_set_nonblocking(fd: c_int, on: c_int) -> c_int {
    ret_int(ops::set_nonblocking(fd, on != 0).map(|()| 0))
}

/// Makes `fd` pollable (POLLIN: a message or notification is queued; POLLOUT: send-buffer
/// room) and returns it. Costs rdsd a syscall per readiness change from then on, so it is
/// opt-in. rdsd brings the fd up to date on its next pass after a receive, so a POLLIN seen
/// right after one may be stale: receive with MSG_DONTWAIT (or `rdsd_set_nonblocking`) after
/// poll or epoll and wait again on EAGAIN. (The preload library's poll, select and
/// epoll_wait confirm each POLLIN against the ring themselves.)
#[no_mangle]
pub extern "C" fn rdsd_poll_fd(fd: c_int) -> c_int {
    ret_int(ops::enable_readiness(fd).map(|()| fd))
}

/// Closes the socket: its port, queued messages and fd are released.
#[no_mangle]
pub extern "C" fn rdsd_close(fd: c_int) -> c_int {
    match table::remove(fd) {
        Some(e) => {
            // SAFETY: `fd` is the app's own dup; the socket keeps a private one.
            let r = unsafe { libc::close(fd) };
            table::release(e);
            r
        }
        None => {
            set_errno(libc::EBADF);
            -1
        }
    }
}

/// 1 if `fd` is an rdsd socket of this process, else 0.
#[no_mangle]
pub extern "C" fn rdsd_is_socket(fd: c_int) -> c_int {
    table::is_ours(fd) as c_int
}

//! librdsd-preload.so: runs unmodified AF_RDS programs on rdsd (`rdsd-run PROGRAM ARGS...`).
//!
//! `socket(AF_RDS, SOCK_SEQPACKET, 0)` returns a real fd (the socket's pollable fd, see
//! librdsd); every call below checks whether its fd is one of those (one atomic load, and
//! nothing at all before the first AF_RDS socket) and either serves it through librdsd or
//! passes it untouched to the next definition (libc), found with `dlsym(RTLD_NEXT)`.
//! poll/select/epoll_ctl pass through too, after turning readiness on for the rdsd fds they
//! name, so mixed sets of rdsd and kernel fds are waited on by the kernel itself; poll,
//! select and epoll_wait then confirm an rdsd fd's POLLIN against its ring (`epoll.rs`).
//! Sets of rdsd fds only, asking for input, are answered from the rings when one has a
//! message: no system call.
//!
//! fcntl and ioctl are variadic in C; they are defined here with one word-sized third
//! argument, which is how the x86-64 and AArch64 Linux ABIs pass an int or pointer variadic
//! argument.

#![allow(clippy::missing_safety_doc)] // each function has the contract of its libc namesake

mod epoll;

use libc::{
    c_int, c_ulong, c_void, epoll_event, fd_set, msghdr, nfds_t, pollfd, sigset_t, size_t,
    sockaddr, socklen_t, ssize_t, timespec, timeval,
};
use rdsd::{ops, ret_int as int, ret_len as len, set_errno, table};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The next definition of `$name` (libc's), resolved once. dlsym does not call any function
/// defined here, so resolving during a program's initialisation cannot recurse.
macro_rules! next {
    ($name:ident : fn($($t:ty),*) -> $r:ty) => {{
        static ADDR: AtomicUsize = AtomicUsize::new(0);
        let mut a = ADDR.load(Ordering::Relaxed);
        if a == 0 {
            a = resolve(concat!(stringify!($name), "\0"));
            ADDR.store(a, Ordering::Relaxed);
        }
        // SAFETY: `a` is the address of libc's function of this name, whose C signature is
        // the one given.
        #[allow(unused_unsafe)]
        let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> $r>(a) };
        f
    }};
}

fn resolve(name: &'static str) -> usize {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT is a valid pseudo-handle.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const _) };
    if p.is_null() {
        let msg = b"librdsd-preload: a libc function is missing (dlsym RTLD_NEXT)\n";
        // SAFETY: raw write(2) syscall of a static buffer, then exit: no libc state needed.
        unsafe {
            libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len());
            libc::_exit(127);
        }
    }
    p as usize
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    if domain == rdsd::RDSD_AF_RDS {
        return int(ops::socket(domain, ty, protocol));
    }
    // SAFETY: libc's socket.
    unsafe { next!(socket: fn(c_int, c_int, c_int) -> c_int)(domain, ty, protocol) }
}

#[no_mangle]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, l: socklen_t) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: bind's contract.
        return int(unsafe { ops::bind(fd, addr, l) });
    }
    // SAFETY: libc's bind.
    unsafe { next!(bind: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, l) }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, l: socklen_t) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: connect's contract.
        return int(unsafe { ops::connect(fd, addr, l) });
    }
    // SAFETY: libc's connect.
    unsafe { next!(connect: fn(c_int, *const sockaddr, socklen_t) -> c_int)(fd, addr, l) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, l: *mut socklen_t) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: getsockname's contract.
        return int(unsafe { ops::getsockname(fd, addr, l) });
    }
    // SAFETY: libc's getsockname.
    unsafe { next!(getsockname: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int)(fd, addr, l) }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, l: *mut socklen_t) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: getpeername's contract.
        return int(unsafe { ops::getpeername(fd, addr, l) });
    }
    // SAFETY: libc's getpeername.
    unsafe { next!(getpeername: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int)(fd, addr, l) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: send's contract.
        return len(unsafe { ops::sendto(fd, buf, n, flags, std::ptr::null(), 0) });
    }
    // SAFETY: libc's send.
    unsafe { next!(send: fn(c_int, *const c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    al: socklen_t,
) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: sendto's contract.
        return len(unsafe { ops::sendto(fd, buf, n, flags, addr, al) });
    }
    // SAFETY: libc's sendto.
    unsafe {
        next!(sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t)(
            fd, buf, n, flags, addr, al,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: sendmsg's contract.
        return len(unsafe { ops::sendmsg(fd, msg, flags) });
    }
    // SAFETY: libc's sendmsg.
    unsafe { next!(sendmsg: fn(c_int, *const msghdr, c_int) -> ssize_t)(fd, msg, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: sendmmsg's contract.
        return len(unsafe { ops::sendmmsg(fd, msgvec, vlen, flags) }) as c_int;
    }
    // SAFETY: libc's sendmmsg.
    unsafe {
        next!(sendmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int) -> c_int)(
            fd, msgvec, vlen, flags,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: recvmmsg's contract.
        return len(unsafe { ops::recvmmsg(fd, msgvec, vlen, flags, timeout) }) as c_int;
    }
    // SAFETY: libc's recvmmsg.
    unsafe {
        next!(recvmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int, *mut libc::timespec) -> c_int)(
            fd, msgvec, vlen, flags, timeout,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: write's contract.
        return len(unsafe { ops::sendto(fd, buf, n, 0, std::ptr::null(), 0) });
    }
    // SAFETY: libc's write.
    unsafe { next!(write: fn(c_int, *const c_void, size_t) -> ssize_t)(fd, buf, n) }
}

/// A msghdr with just an iovec array, for readv/writev.
fn iov_msg(iov: *const libc::iovec, cnt: c_int) -> msghdr {
    // SAFETY: msghdr is plain data; zeroed is valid.
    let mut m: msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov as *mut libc::iovec;
    m.msg_iovlen = cnt.max(0) as usize;
    m
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> ssize_t {
    if table::is_ours(fd) {
        let m = iov_msg(iov, cnt);
        // SAFETY: writev's contract: `cnt` iovecs.
        return len(unsafe { ops::sendmsg(fd, &m, 0) });
    }
    // SAFETY: libc's writev.
    unsafe { next!(writev: fn(c_int, *const libc::iovec, c_int) -> ssize_t)(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: recv's contract.
        let r = unsafe {
            ops::recvfrom(
                fd,
                buf,
                n,
                flags,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        return len(r);
    }
    // SAFETY: libc's recv.
    unsafe { next!(recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    al: *mut socklen_t,
) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: recvfrom's contract.
        return len(unsafe { ops::recvfrom(fd, buf, n, flags, addr, al) });
    }
    // SAFETY: libc's recvfrom.
    unsafe {
        next!(recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t)(
            fd, buf, n, flags, addr, al,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: recvmsg's contract.
        return len(unsafe { ops::recvmsg(fd, msg, flags) });
    }
    // SAFETY: libc's recvmsg.
    unsafe { next!(recvmsg: fn(c_int, *mut msghdr, c_int) -> ssize_t)(fd, msg, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: read's contract.
        let r = unsafe { ops::recvfrom(fd, buf, n, 0, std::ptr::null_mut(), std::ptr::null_mut()) };
        return len(r);
    }
    // SAFETY: libc's read.
    unsafe { next!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> ssize_t {
    if table::is_ours(fd) {
        let mut m = iov_msg(iov, cnt);
        // SAFETY: readv's contract: `cnt` iovecs.
        return len(unsafe { ops::recvmsg(fd, &mut m, 0) });
    }
    // SAFETY: libc's readv.
    unsafe { next!(readv: fn(c_int, *const libc::iovec, c_int) -> ssize_t)(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: recv's contract, with the smaller of the two lengths.
        return unsafe { recv(fd, buf, n.min(buflen), flags) };
    }
    // SAFETY: libc's __recv_chk.
    unsafe {
        next!(__recv_chk: fn(c_int, *mut c_void, size_t, size_t, c_int) -> ssize_t)(
            fd, buf, n, buflen, flags,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    al: *mut socklen_t,
) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: recvfrom's contract, with the smaller of the two lengths.
        return unsafe { recvfrom(fd, buf, n.min(buflen), flags, addr, al) };
    }
    // SAFETY: libc's __recvfrom_chk.
    unsafe {
        next!(__recvfrom_chk: fn(c_int, *mut c_void, size_t, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t)(
            fd, buf, n, buflen, flags, addr, al,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if table::is_ours(fd) {
        // SAFETY: read's contract, with the smaller of the two lengths.
        return unsafe { read(fd, buf, n.min(buflen)) };
    }
    // SAFETY: libc's __read_chk.
    unsafe {
        next!(__read_chk: fn(c_int, *mut c_void, size_t, size_t) -> ssize_t)(fd, buf, n, buflen)
    }
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    l: socklen_t,
) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: setsockopt's contract.
        return int(unsafe { ops::setsockopt(fd, level, name, val, l) });
    }
    // SAFETY: libc's setsockopt.
    unsafe {
        next!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
            fd, level, name, val, l,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    l: *mut socklen_t,
) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: getsockopt's contract.
        return int(unsafe { ops::getsockopt(fd, level, name, val, l) });
    }
    // SAFETY: libc's getsockopt.
    unsafe {
        next!(getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int)(
            fd, level, name, val, l,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if table::is_ours(fd) {
        // RDS sockets have no shutdown (sock_no_shutdown).
        set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    // SAFETY: libc's shutdown.
    unsafe { next!(shutdown: fn(c_int, c_int) -> c_int)(fd, how) }
}

/// fcntl on an rdsd fd: F_SETFL's O_NONBLOCK also sets the socket's mode; F_DUPFD* make a new
/// fd for the same socket. Everything runs on the real fd too, so F_GETFL/F_GETFD tell the
/// truth and FD_CLOEXEC is the kernel's.
unsafe fn fcntl_any(
    real: unsafe extern "C" fn(c_int, c_int, usize) -> c_int,
    fd: c_int,
    cmd: c_int,
    arg: usize,
) -> c_int {
    // SAFETY: libc's fcntl with the caller's argument word.
    let r = unsafe { real(fd, cmd, arg) };
    if r >= 0 && matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) {
        epoll::note_dup(fd);
    }
    if r >= 0 && table::is_ours(fd) {
        match cmd {
            libc::F_SETFL => {
                if let Err(e) = ops::set_nonblocking(fd, arg as c_int & libc::O_NONBLOCK != 0) {
                    set_errno(e);
                    return -1;
                }
            }
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
                if let Err(e) = ops::adopt_dup(fd, r) {
                    // SAFETY: the dup just made; the caller never saw it.
                    unsafe { next!(close: fn(c_int) -> c_int)(r) };
                    set_errno(e);
                    return -1;
                }
            }
            _ => {}
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let real = next!(fcntl: fn(c_int, c_int, usize) -> c_int);
    // SAFETY: fcntl's contract.
    unsafe { fcntl_any(real, fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let real = next!(fcntl64: fn(c_int, c_int, usize) -> c_int);
    // SAFETY: fcntl's contract.
    unsafe { fcntl_any(real, fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: usize) -> c_int {
    if table::is_ours(fd) {
        // SAFETY: ioctl's contract for the requests served.
        return int(unsafe { ops::ioctl(fd, request, arg) });
    }
    // SAFETY: libc's ioctl.
    unsafe { next!(ioctl: fn(c_int, c_ulong, usize) -> c_int)(fd, request, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let e = table::remove(fd);
    // SAFETY: libc's close.
    let r = unsafe { next!(close: fn(c_int) -> c_int)(fd) };
    if r == 0 {
        epoll::note_close(fd);
    }
    if let Some(e) = e {
        table::release(e);
    }
    r
}

/// close_range(2) (glibc 2.34): the kernel closes the fds; the rdsd sockets among them are
/// forgotten and released as `close` does. With CLOSE_RANGE_CLOEXEC nothing is closed now.
#[no_mangle]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    // SAFETY: libc's close_range.
    let r = unsafe {
        next!(close_range: fn(libc::c_uint, libc::c_uint, c_int) -> c_int)(first, last, flags)
    };
    if r == 0 && flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        forget_range(first, last);
    }
    r
}

/// closefrom(3) (glibc 2.34): closes every fd from `low` on; the rdsd sockets among them are
/// forgotten and released as `close` does. (glibc's closefrom calls close_range inside libc,
/// where no preload reaches, hence its own wrapper.)
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: libc's closefrom.
    unsafe { next!(closefrom: fn(c_int) -> ())(low) };
    forget_range(low.max(0) as libc::c_uint, libc::c_uint::MAX);
}

/// Forgets the rdsd sockets numbered `first..=last` after the kernel closed those fds.
fn forget_range(first: libc::c_uint, last: libc::c_uint) {
    epoll::note_close_range(first, last);
    if !table::any() {
        return;
    }
    let last = (last as usize).min(table::MAX_FD - 1);
    for fd in first as usize..=last {
        if table::is_ours(fd as c_int) {
            ops::forget(fd as c_int);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: libc's dup.
    let r = unsafe { next!(dup: fn(c_int) -> c_int)(fd) };
    adopt(fd, r)
}

/// After a dup-like call: `newfd` stands for what `fd` stood for (or for nothing).
fn adopt(fd: c_int, newfd: c_int) -> c_int {
    if newfd < 0 {
        return newfd;
    }
    epoll::note_dup(fd);
    if !table::any() {
        return newfd;
    }
    // The kernel closed whatever newfd was (dup2/dup3 onto an rdsd fd).
    if fd != newfd {
        ops::forget(newfd);
    }
    if let Err(e) = ops::adopt_dup(fd, newfd) {
        // SAFETY: the dup just made; the caller never saw it.
        unsafe { next!(close: fn(c_int) -> c_int)(newfd) };
        set_errno(e);
        return -1;
    }
    newfd
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, newfd: c_int) -> c_int {
    // SAFETY: libc's dup2.
    let r = unsafe { next!(dup2: fn(c_int, c_int) -> c_int)(fd, newfd) };
    if r >= 0 && r != fd {
        // The kernel closed whatever newfd was, an epoll fd perhaps.
        epoll::note_close(r);
    }
    adopt(fd, r)
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, newfd: c_int, flags: c_int) -> c_int {
    // SAFETY: libc's dup3.
    let r = unsafe { next!(dup3: fn(c_int, c_int, c_int) -> c_int)(fd, newfd, flags) };
    if r >= 0 {
        epoll::note_close(r);
    }
    adopt(fd, r)
}

/// Turns readiness on for every rdsd fd in `fds` before the kernel waits on them; true if
/// there was one.
unsafe fn arm_pollfds(fds: *const pollfd, n: nfds_t) -> bool {
    if !table::any() || fds.is_null() {
        return false;
    }
    let mut any = false;
    // SAFETY: poll's contract: `n` pollfds at `fds`.
    for p in unsafe { std::slice::from_raw_parts(fds, n as usize) } {
        if table::is_ours(p.fd) {
            let _ = ops::enable_readiness(p.fd);
            any = true;
        }
    }
    any
}

/// When every fd of the set is rdsd's and asks for input only, and one has a message on its
/// ring: the answer without the kernel (the ring says it; a receive loop that polls before each
/// `recvfrom` would otherwise make a `poll` per message). `None`: ask the kernel.
unsafe fn input_ready_without_kernel(fds: *mut pollfd, n: nfds_t) -> Option<c_int> {
    const IN: i16 = libc::POLLIN | libc::POLLRDNORM;
    if fds.is_null() || n == 0 {
        return None;
    }
    // SAFETY: poll's contract: `n` pollfds at `fds`.
    let set = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    if set
        .iter()
        .any(|p| p.events & !IN != 0 || !table::is_ours(p.fd))
    {
        return None;
    }
    let mut ready = 0;
    for p in set.iter_mut() {
        p.revents = if ops::has_input(p.fd) {
            p.events & IN
        } else {
            0
        };
        ready += c_int::from(p.revents != 0);
    }
    (ready > 0).then_some(ready)
}

/// select's counterpart of [`input_ready_without_kernel`]: only a read set, every fd in it
/// rdsd's, one with a message on its ring; the read set is then left with those that have one.
unsafe fn read_set_ready_without_kernel(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
) -> Option<c_int> {
    if r.is_null() || nfds <= 0 || nfds as usize > libc::FD_SETSIZE {
        return None;
    }
    for set in [w, e] {
        // SAFETY: select's contract: fd_sets of FD_SETSIZE bits, `nfds` within them (checked
        // above); so for every FD_ISSET and FD_CLR below.
        if !set.is_null() && (0..nfds).any(|fd| unsafe { libc::FD_ISSET(fd, set) }) {
            return None;
        }
    }
    // The answer goes into a copy: the caller's set stays as it was when the kernel is asked.
    // SAFETY: `r` is a valid fd_set (select's contract).
    let mut answer = unsafe { *r };
    let mut ready = 0;
    for fd in 0..nfds {
        // SAFETY: as above.
        if unsafe { libc::FD_ISSET(fd, r) } {
            if !table::is_ours(fd) {
                return None;
            }
            if ops::has_input(fd) {
                ready += 1;
            } else {
                // SAFETY: as above, on the copy.
                unsafe { libc::FD_CLR(fd, &mut answer) };
            }
        }
    }
    if ready == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { *r = answer };
    Some(ready)
}

/// rdsd updates a readiness fd on its next pass after the app drains the ring, so a POLLIN
/// seen right after a receive may be stale: it is confirmed against the ring (no syscall).
/// Returns the corrected count.
unsafe fn confirm_pollfds(fds: *mut pollfd, n: nfds_t, mut count: c_int) -> c_int {
    const IN: i16 = libc::POLLIN | libc::POLLRDNORM;
    // SAFETY: poll's contract: `n` pollfds at `fds`.
    for p in unsafe { std::slice::from_raw_parts_mut(fds, n as usize) } {
        if p.revents & IN != 0 && table::is_ours(p.fd) && !ops::has_input(p.fd) {
            p.revents &= !IN;
            if p.revents == 0 {
                count -= 1;
            }
        }
    }
    count
}

/// Runs `wait(remaining)` until it reports something that holds after `confirm`, or the
/// timeout (None = forever) runs out.
fn wait_confirmed(
    timeout: Option<Duration>,
    mut wait: impl FnMut(Option<Duration>) -> c_int,
    mut confirm: impl FnMut(c_int) -> c_int,
) -> c_int {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let r = wait(left);
        if r <= 0 {
            return r;
        }
        let r = confirm(r);
        if r > 0 || left.is_some_and(|l| l.is_zero()) {
            return r;
        }
        // Only stale readiness: rdsd catches up within a pass; let it run.
        std::thread::yield_now();
    }
}

fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

fn to_ms(d: Option<Duration>) -> c_int {
    d.map_or(-1, |d| d.as_millis().min(c_int::MAX as u128) as c_int)
}

unsafe fn ts_timeout(ts: *const timespec) -> Option<Duration> {
    if ts.is_null() {
        return None;
    }
    // SAFETY: a valid timespec (ppoll's contract).
    let t = unsafe { *ts };
    Some(Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    ))
}

fn to_ts(d: Duration) -> timespec {
    timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let real = next!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int);
    // SAFETY: poll's contract.
    if !unsafe { arm_pollfds(fds, n) } {
        // SAFETY: libc's poll.
        return unsafe { real(fds, n, timeout) };
    }
    // SAFETY: poll's contract.
    if let Some(ready) = unsafe { input_ready_without_kernel(fds, n) } {
        return ready;
    }
    wait_confirmed(
        ms_timeout(timeout),
        // SAFETY: libc's poll on the caller's array.
        |left| unsafe { real(fds, n, to_ms(left)) },
        // SAFETY: the caller's array.
        |r| unsafe { confirm_pollfds(fds, n, r) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<pollfd>()) < n as usize {
        // Let libc report the overflow as the fortified build expects.
        // SAFETY: libc's __poll_chk.
        return unsafe {
            next!(__poll_chk: fn(*mut pollfd, nfds_t, c_int, size_t) -> c_int)(
                fds, n, timeout, fdslen,
            )
        };
    }
    // SAFETY: poll's contract (the length was checked).
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sig: *const sigset_t,
) -> c_int {
    let real = next!(ppoll: fn(*mut pollfd, nfds_t, *const timespec, *const sigset_t) -> c_int);
    // SAFETY: ppoll's contract.
    if !unsafe { arm_pollfds(fds, n) } {
        // SAFETY: libc's ppoll.
        return unsafe { real(fds, n, ts, sig) };
    }
    // Not with a signal mask: ppoll would apply it, and deliver what it unblocks, even when a
    // descriptor is ready at once.
    if sig.is_null() {
        // SAFETY: ppoll's contract.
        if let Some(ready) = unsafe { input_ready_without_kernel(fds, n) } {
            return ready;
        }
    }
    wait_confirmed(
        // SAFETY: ppoll's contract.
        unsafe { ts_timeout(ts) },
        |left| {
            let t = left.map(to_ts);
            let tp = t
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const timespec);
            // SAFETY: libc's ppoll on the caller's array and mask.
            unsafe { real(fds, n, tp, sig) }
        },
        // SAFETY: the caller's array.
        |r| unsafe { confirm_pollfds(fds, n, r) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    sig: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<pollfd>()) < n as usize {
        // SAFETY: libc's __ppoll_chk reports the overflow.
        return unsafe {
            next!(__ppoll_chk: fn(*mut pollfd, nfds_t, *const timespec, *const sigset_t, size_t) -> c_int)(
                fds, n, ts, sig, fdslen,
            )
        };
    }
    // SAFETY: ppoll's contract (the length was checked).
    unsafe { ppoll(fds, n, ts, sig) }
}

/// Turns readiness on for every rdsd fd in the three sets; true if there was one.
unsafe fn arm_fdsets(nfds: c_int, sets: [*mut fd_set; 3]) -> bool {
    if !table::any() {
        return false;
    }
    let mut any = false;
    let top = (nfds.max(0) as usize).min(libc::FD_SETSIZE);
    for fd in 0..top as c_int {
        if !table::is_ours(fd) {
            continue;
        }
        let set_has = |s: &*mut libc::fd_set| {
            // SAFETY: select's contract: each non-null set is a valid fd_set.
            !s.is_null() && unsafe { libc::FD_ISSET(fd, *s) }
        };
        if sets.iter().any(set_has) {
            let _ = ops::enable_readiness(fd);
            any = true;
        }
    }
    any
}

/// Clears stale read bits of rdsd fds (see [`confirm_pollfds`]); the corrected count.
unsafe fn confirm_readfds(nfds: c_int, r: *mut fd_set, mut count: c_int) -> c_int {
    if r.is_null() {
        return count;
    }
    let top = (nfds.max(0) as usize).min(libc::FD_SETSIZE);
    for fd in 0..top as c_int {
        // SAFETY: a valid fd_set (select's contract).
        if table::is_ours(fd) && unsafe { libc::FD_ISSET(fd, r) } && !ops::has_input(fd) {
            // SAFETY: as above.
            unsafe { libc::FD_CLR(fd, r) };
            count -= 1;
        }
    }
    count
}

/// select and pselect: `real(sets, remaining)` on copies of the caller's sets, retried while
/// only stale read bits came back.
unsafe fn select_confirmed(
    nfds: c_int,
    sets: [*mut fd_set; 3],
    timeout: Option<Duration>,
    mut real: impl FnMut([*mut fd_set; 3], Option<Duration>) -> c_int,
) -> c_int {
    // SAFETY: each non-null set is a valid fd_set (select's contract).
    let saved: [Option<fd_set>; 3] = sets.map(|s| (!s.is_null()).then(|| unsafe { *s }));
    wait_confirmed(
        timeout,
        |left| {
            for (s, v) in sets.iter().zip(saved.iter()) {
                if let Some(v) = v {
                    // SAFETY: restores the caller's set before each try.
                    unsafe { **s = *v };
                }
            }
            real(sets, left)
        },
        // SAFETY: the caller's read set.
        |r| unsafe { confirm_readfds(nfds, sets[0], r) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    t: *mut timeval,
) -> c_int {
    let real =
        next!(select: fn(c_int, *mut fd_set, *mut fd_set, *mut fd_set, *mut timeval) -> c_int);
    // SAFETY: select's contract.
    if !unsafe { arm_fdsets(nfds, [r, w, e]) } {
        // SAFETY: libc's select.
        return unsafe { real(nfds, r, w, e, t) };
    }
    // SAFETY: select's contract.
    if let Some(ready) = unsafe { read_set_ready_without_kernel(nfds, r, w, e) } {
        return ready;
    }
    let timeout = (!t.is_null()).then(|| {
        // SAFETY: a valid timeval (select's contract).
        let tv = unsafe { *t };
        Duration::from_secs(tv.tv_sec.max(0) as u64)
            + Duration::from_micros(tv.tv_usec.max(0) as u64)
    });
    // SAFETY: select's contract.
    unsafe {
        select_confirmed(nfds, [r, w, e], timeout, |s, left| {
            let mut tv = left.map(|d| timeval {
                tv_sec: d.as_secs() as libc::time_t,
                tv_usec: d.subsec_micros() as libc::suseconds_t,
            });
            let tp = tv
                .as_mut()
                .map_or(std::ptr::null_mut(), |v| v as *mut timeval);
            real(nfds, s[0], s[1], s[2], tp)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    t: *const timespec,
    sig: *const sigset_t,
) -> c_int {
    let real = next!(pselect: fn(c_int, *mut fd_set, *mut fd_set, *mut fd_set, *const timespec, *const sigset_t) -> c_int);
    // SAFETY: pselect's contract.
    if !unsafe { arm_fdsets(nfds, [r, w, e]) } {
        // SAFETY: libc's pselect.
        return unsafe { real(nfds, r, w, e, t, sig) };
    }
    // As ppoll: not with a signal mask to apply.
    if sig.is_null() {
        // SAFETY: pselect's contract.
        if let Some(ready) = unsafe { read_set_ready_without_kernel(nfds, r, w, e) } {
            return ready;
        }
    }
    // SAFETY: pselect's contract.
    unsafe {
        select_confirmed(nfds, [r, w, e], ts_timeout(t), |s, left| {
            let ts = left.map(to_ts);
            let tp = ts
                .as_ref()
                .map_or(std::ptr::null(), |v| v as *const timespec);
            real(nfds, s[0], s[1], s[2], tp, sig)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: libc's epoll_create.
    let r = unsafe { next!(epoll_create: fn(c_int) -> c_int)(size) };
    if r >= 0 {
        epoll::note_create(r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: libc's epoll_create1.
    let r = unsafe { next!(epoll_create1: fn(c_int) -> c_int)(flags) };
    if r >= 0 {
        epoll::note_create(r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    if op != libc::EPOLL_CTL_DEL && table::is_ours(fd) {
        if let Err(e) = ops::enable_readiness(fd) {
            set_errno(e);
            return -1;
        }
    }
    // SAFETY: libc's epoll_ctl.
    let r = unsafe {
        next!(epoll_ctl: fn(c_int, c_int, c_int, *mut epoll_event) -> c_int)(epfd, op, fd, ev)
    };
    if r == 0 {
        // SAFETY: epoll_ctl's contract: a valid event for ADD and MOD (ignored for DEL).
        let e = (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { *ev });
        epoll::note_ctl(epfd, op, fd, e);
    }
    r
}

/// epoll_wait and its kin: `real(remaining)` retried while only stale EPOLLINs of rdsd
/// sockets came back (see `epoll`).
unsafe fn epoll_confirmed(
    epfd: c_int,
    events: *mut epoll_event,
    timeout: Option<Duration>,
    real: impl FnMut(Option<Duration>) -> c_int,
) -> c_int {
    wait_confirmed(
        timeout,
        real,
        // SAFETY: epoll_wait filled the first `r` events.
        |r| unsafe { epoll::confirm(epfd, events, r) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    let real = next!(epoll_wait: fn(c_int, *mut epoll_event, c_int, c_int) -> c_int);
    if !epoll::may_confirm(epfd) {
        // SAFETY: libc's epoll_wait.
        return unsafe { real(epfd, events, max, timeout) };
    }
    // SAFETY: epoll_wait's contract.
    if let Some(ready) = unsafe { epoll::ready_from_rings(epfd, events, max) } {
        return ready;
    }
    // SAFETY: epoll_wait's contract; libc's epoll_wait on the caller's array.
    unsafe {
        epoll_confirmed(epfd, events, ms_timeout(timeout), |left| {
            real(epfd, events, max, to_ms(left))
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    sig: *const sigset_t,
) -> c_int {
    let real =
        next!(epoll_pwait: fn(c_int, *mut epoll_event, c_int, c_int, *const sigset_t) -> c_int);
    if !epoll::may_confirm(epfd) {
        // SAFETY: libc's epoll_pwait.
        return unsafe { real(epfd, events, max, timeout, sig) };
    }
    // As ppoll: not with a signal mask to apply.
    if sig.is_null() {
        // SAFETY: epoll_pwait's contract.
        if let Some(ready) = unsafe { epoll::ready_from_rings(epfd, events, max) } {
            return ready;
        }
    }
    // SAFETY: epoll_pwait's contract; libc's epoll_pwait on the caller's array and mask.
    unsafe {
        epoll_confirmed(epfd, events, ms_timeout(timeout), |left| {
            real(epfd, events, max, to_ms(left), sig)
        })
    }
}

/// epoll_pwait2 (glibc 2.35): a timespec timeout, NULL for none.
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    ts: *const timespec,
    sig: *const sigset_t,
) -> c_int {
    let real = next!(epoll_pwait2: fn(c_int, *mut epoll_event, c_int, *const timespec, *const sigset_t) -> c_int);
    if !epoll::may_confirm(epfd) {
        // SAFETY: libc's epoll_pwait2.
        return unsafe { real(epfd, events, max, ts, sig) };
    }
    if sig.is_null() {
        // SAFETY: epoll_pwait2's contract.
        if let Some(ready) = unsafe { epoll::ready_from_rings(epfd, events, max) } {
            return ready;
        }
    }
    // SAFETY: epoll_pwait2's contract; libc's epoll_pwait2 on the caller's array and mask.
    unsafe {
        epoll_confirmed(epfd, events, ts_timeout(ts), |left| {
            let t = left.map(to_ts);
            let tp = t
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const timespec);
            real(epfd, events, max, tp, sig)
        })
    }
}

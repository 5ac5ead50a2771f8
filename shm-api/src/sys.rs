//! Thin, checked wrappers over the few Linux calls both sides use: memfd, mmap, futex,
//! SCM_RIGHTS, socketpair. All of them are slow-path only, except `futex_wake`, which runs only
//! when a peer thread has announced that it sleeps.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Size of a huge page on this machine (2 MiB on x86-64).
pub const HUGE_PAGE: usize = 2 << 20;

/// Creates a memfd of `len` bytes. With `huge`, backed by hugetlbfs (MFD_HUGETLB).
pub fn memfd(name: &str, len: usize, huge: bool) -> io::Result<OwnedFd> {
    let cname =
        std::ffi::CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut flags = libc::MFD_CLOEXEC;
    if huge {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: a valid NUL-terminated name; the returned fd is checked and then owned.
    let fd = cvt(unsafe { libc::memfd_create(cname.as_ptr(), flags) })?;
    // SAFETY: `fd` is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on our own fd.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
    Ok(fd)
}

/// A shared mapping, unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the layout's
// atomics and ring protocol, never by Rust references to non-atomic data.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared. `writable` false maps it read-only.
    pub fn new(fd: RawFd, len: usize, writable: bool, populate: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let mut flags = libc::MAP_SHARED;
        if populate {
            flags |= libc::MAP_POPULATE;
        }
        // SAFETY: a fresh mapping chosen by the kernel; the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p as *mut u8).expect("mmap never returns null"),
            len,
        })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: mappings have a length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Asks for transparent huge pages (for regions that could not get hugetlbfs pages).
    pub fn advise_hugepage(&self) -> io::Result<()> {
        // SAFETY: advice on our own mapping.
        cvt(unsafe { libc::madvise(self.ptr.as_ptr() as *mut _, self.len, libc::MADV_HUGEPAGE) })?;
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; nothing borrows it past the owner's life.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut _, self.len) };
    }
}

/// Blocks while `*word == expected`, at most `timeout`. Returns on wake, change, timeout or signal.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a valid, aligned u32 for the call's duration. FUTEX_WAIT (not PRIVATE)
    // because the word lives in memory shared with another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            0usize,
            0u32,
        );
    }
}

/// What [`futex_wait_either`] returned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum EitherWake {
    /// `first` was woken or had changed, or the wait timed out or was interrupted.
    First,
    /// `second` was woken, or had changed before the call.
    Second,
}

/// Set once `futex_waitv` (Linux 5.16) turned out to be missing: waits then use `first` only.
static NO_FUTEX_WAITV: AtomicBool = AtomicBool::new(false);

/// Blocks while `*first == first_expected` and `*second == second_expected`, at most `timeout`:
/// one sleep on two shared futexes (`futex_waitv`). A wake-up of either ends it. Kernels older
/// than 5.16 lack the call; there it waits on `first` alone (and never reports `Second`).
pub fn futex_wait_either(
    first: &AtomicU32,
    first_expected: u32,
    second: &AtomicU32,
    second_expected: u32,
    timeout: Option<Duration>,
) -> EitherWake {
    if NO_FUTEX_WAITV.load(Ordering::Relaxed) {
        futex_wait(first, first_expected, timeout);
        return EitherWake::First;
    }
    /// `struct futex_waitv` of `<linux/futex.h>`.
    #[repr(C)]
    struct FutexWaitv {
        val: u64,
        uaddr: u64,
        flags: u32,
        reserved: u32,
    }
    /// FUTEX2_SIZE_U32, without FUTEX2_PRIVATE: the words are shared between processes.
    const FUTEX2_SIZE_U32: u32 = 0x02;
    let waiters = [
        FutexWaitv {
            val: first_expected.into(),
            uaddr: first.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32,
            reserved: 0,
        },
        FutexWaitv {
            val: second_expected.into(),
            uaddr: second.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32,
            reserved: 0,
        },
    ];
    // futex_waitv takes an absolute deadline on the clock it is given.
    let deadline = timeout.map(|d| {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid timespec to write.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let nanos = now.tv_nsec as u64 + u64::from(d.subsec_nanos());
        libc::timespec {
            tv_sec: now
                .tv_sec
                .saturating_add(d.as_secs().min(i32::MAX as u64) as libc::time_t)
                .saturating_add((nanos / 1_000_000_000) as libc::time_t),
            tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
        }
    });
    let ts_ptr = deadline
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `waiters` is a valid array of two `futex_waitv` whose words are aligned u32s that
    // outlive the call; `ts_ptr` is null or a valid timespec; flags must be 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex_waitv,
            waiters.as_ptr(),
            2u32,
            0u32,
            ts_ptr,
            libc::CLOCK_MONOTONIC,
        )
    };
    match r {
        1 => EitherWake::Second,
        -1 => match io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOSYS) => {
                NO_FUTEX_WAITV.store(true, Ordering::Relaxed);
                futex_wait(first, first_expected, timeout);
                EitherWake::First
            }
            // A word had changed before the call: say which, so the caller does not sleep
            // again at once on a stale value.
            Some(libc::EAGAIN) if second.load(Ordering::Relaxed) != second_expected => {
                EitherWake::Second
            }
            _ => EitherWake::First,
        },
        _ => EitherWake::First,
    }
}

/// The CPUs the calling thread may run on, ascending: its affinity mask, which taskset, a
/// cgroup cpuset (Slurm, containers) or systemd's `CPUAffinity=` narrow. rdsd resolves its CPU
/// settings against it, and rds-bench against the same set, so the two agree on what `-1`
/// names. Every online CPU if the mask cannot be read.
pub fn affinity_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    let cpus: Vec<usize> = if rc == 0 {
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `i` is below CPU_SETSIZE, so the bit lies inside `set`.
            .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
            .collect()
    } else {
        Vec::new()
    };
    if cpus.is_empty() {
        return (0..online_cpus()).collect();
    }
    cpus
}

/// CPUs online on the host, whatever this process's CPU set.
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize
}

/// membarrier(2) commands used here (linux/membarrier.h).
const MEMBARRIER_CMD_QUERY: libc::c_int = 0;
const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

fn membarrier(cmd: libc::c_int) -> io::Result<libc::c_long> {
    // SAFETY: membarrier takes two integers and touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0u32, 0i32) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Whether this kernel offers expedited global barriers (Linux 4.16).
pub fn membarrier_global_supported() -> bool {
    membarrier(MEMBARRIER_CMD_QUERY)
        .is_ok_and(|m| m & MEMBARRIER_CMD_GLOBAL_EXPEDITED as libc::c_long != 0)
}

/// Registers this process for [`membarrier_global`]: its running threads then take part in
/// every such barrier (an interrupt each, only when a barrier is made).
pub fn membarrier_register() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED).map(|_| ())
}

/// A full memory barrier on every running thread of every registered process, and this one.
pub fn membarrier_global() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED).map(|_| ())
}

/// Registers this process for [`membarrier_private`] (Linux 4.14).
pub fn membarrier_private_register() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED).map(|_| ())
}

/// A full memory barrier on every running thread of this process (an interrupt to each CPU
/// that runs one), and this one. Needs [`membarrier_private_register`] first.
pub fn membarrier_private() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED).map(|_| ())
}

/// Wakes every thread, in any process, waiting on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

/// Creates a non-blocking, close-on-exec eventfd.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is checked and owned.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
    // SAFETY: fresh fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd (ignores EAGAIN: the counter is already non-zero).
pub fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64.
    unsafe { libc::write(fd, &one as *const u64 as *const _, 8) };
}

/// Resets an eventfd to 0.
pub fn eventfd_drain(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a valid u64; the fd is non-blocking.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut _, 8) };
}

/// Sends one datagram without blocking, whatever the descriptor's file status flags say
/// (MSG_DONTWAIT acts on this call only; MSG_NOSIGNAL: no SIGPIPE).
pub fn send_dontwait(fd: RawFd, data: &[u8]) -> io::Result<usize> {
    // SAFETY: sends `data.len()` bytes from a live buffer.
    let n = unsafe {
        libc::send(
            fd,
            data.as_ptr() as *const _,
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Receives one datagram without blocking, whatever the descriptor's file status flags say
/// (a datagram longer than `buf` is truncated and its rest discarded).
pub fn recv_dontwait(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: receives into a live buffer of `buf.len()` bytes.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr() as *mut _,
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A connected pair of AF_UNIX sockets of `ty` (close-on-exec).
pub fn socketpair(ty: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for two descriptors.
    cvt(unsafe { libc::socketpair(libc::AF_UNIX, ty | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) })?;
    // SAFETY: both fds are fresh and owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Most descriptors passed in one control message.
pub const MAX_FDS: usize = 4;

/// Sends `data` with `fds` attached (SCM_RIGHTS) on a connected seqpacket socket.
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    send_with_fds_flags(sock, data, fds, 0)
}

/// [`send_with_fds`] with extra `sendmsg` flags (`MSG_DONTWAIT`: never block, whatever the
/// descriptor's O_NONBLOCK says). MSG_NOSIGNAL is always added.
pub fn send_with_fds_flags(
    sock: RawFd,
    data: &[u8],
    fds: &[RawFd],
    flags: libc::c_int,
) -> io::Result<usize> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut _,
        iov_len: data.len(),
    };
    let mut cmsg_buf = [0u64; 8]; // 64 bytes, aligned; enough for MAX_FDS ints
                                  // SAFETY: msghdr is plain data; zeroed is a valid initial state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE((fds.len() * 4) as u32) } as usize;
        assert!(space <= std::mem::size_of_val(&cmsg_buf));
        msg.msg_control = cmsg_buf.as_mut_ptr() as *mut _;
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `space` valid bytes, so the first header fits; the
        // data copy writes exactly fds.len() ints inside CMSG_LEN.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | flags) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Receives one message into `buf`, taking ownership of any descriptors attached.
/// Returns 0 bytes on EOF.
pub fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    flags: libc::c_int,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut _,
        iov_len: buf.len(),
    };
    let mut cmsg_buf = [0u64; 8];
    // SAFETY: zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.as_mut_ptr() as *mut _;
    msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
    // SAFETY: all pointers in msg are live for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with well-formed headers up to msg_controllen; we
    // walk them with the CMSG macros and take each fd exactly once.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..data_len / 4 {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control message truncated",
        ));
    }
    Ok((n as usize, fds))
}

/// `poll(2)` on one descriptor; returns the revents (0 on timeout).
pub fn poll_one(
    fd: RawFd,
    events: libc::c_short,
    timeout_ms: libc::c_int,
) -> io::Result<libc::c_short> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.revents)
    }
}

/// Sets or clears O_NONBLOCK.
pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let flags = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) })?;
    Ok(())
}

/// Connects a SOCK_SEQPACKET socket to the Unix socket at `path`.
pub fn connect_seqpacket(path: &std::path::Path) -> io::Result<std::os::unix::net::UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: plain socket(2); the fd is checked and then owned.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own. UnixStream is only used as an owned fd holder here.
    let sock =
        unsafe { <std::os::unix::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_un is valid; we fill sun_path within bounds below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: addr is a valid sockaddr_un of the given length.
    let r = unsafe {
        libc::connect(
            fd,
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_un>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Waits on both words in a thread; `poke` (run once the waiter sleeps) must end the wait
    /// with `want`.
    fn wait_ended_by(poke: impl Fn(&AtomicU32, &AtomicU32), want: EitherWake) {
        let words = Arc::new([AtomicU32::new(7), AtomicU32::new(9)]);
        let w = words.clone();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid takes no argument and cannot fail.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) };
            tid_tx.send(tid).unwrap();
            futex_wait_either(&w[0], 7, &w[1], 9, Some(Duration::from_secs(30)))
        });
        // Wait on state: the waiter's own thread is inside futex_waitv (syscall 449). Only
        // that thread: another test's thread may pass through futex_waitv meanwhile.
        let tid = tid_rx.recv().unwrap();
        let syscall = format!("/proc/{}/task/{tid}/syscall", std::process::id());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(&syscall).is_ok_and(|s| s.starts_with("449 ")) {
            assert!(std::time::Instant::now() < deadline, "waiter never slept");
            std::thread::yield_now();
        }
        // A thread seen in the syscall may not be queued on the words yet (preempted on its
        // way in): poke again until it returns (a wake changes no word, so repeats are free).
        while !waiter.is_finished() {
            poke(&words[0], &words[1]);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(waiter.join().unwrap(), want);
    }

    #[test]
    fn a_wake_of_either_word_ends_the_wait() {
        wait_ended_by(|_, b| futex_wake(b), EitherWake::Second);
        wait_ended_by(|a, _| futex_wake(a), EitherWake::First);
    }

    #[test]
    fn a_stale_value_returns_at_once_and_says_which() {
        let (a, b) = (AtomicU32::new(1), AtomicU32::new(2));
        let t = Duration::from_secs(30);
        assert_eq!(futex_wait_either(&a, 1, &b, 3, Some(t)), EitherWake::Second);
        assert_eq!(futex_wait_either(&a, 0, &b, 2, Some(t)), EitherWake::First);
    }

    #[test]
    fn the_timeout_ends_the_wait() {
        let (a, b) = (AtomicU32::new(1), AtomicU32::new(2));
        let r = futex_wait_either(&a, 1, &b, 2, Some(Duration::from_millis(1)));
        assert_eq!(r, EitherWake::First);
    }
}

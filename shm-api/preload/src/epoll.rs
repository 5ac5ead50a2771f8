//! epoll for rdsd fds: a stale EPOLLIN is confirmed against the ring, as poll and select do.
//!
//! rdsd updates a socket's readiness fd on its next pass after the app drains the ring, so an
//! epoll_wait right after a receive can report EPOLLIN with nothing to read, and a blocking
//! receive would then wait for the next message. epoll reports the caller's `data`, not the
//! fd, so every registration made through `epoll_ctl` is remembered (epoll fd, fd, data,
//! events) to tell which events are an rdsd socket's. An EPOLLIN is dropped only when it is
//! certain to be stale:
//! - its `data` names exactly one registration of that epoll fd, and that fd is an rdsd
//!   socket whose ring holds nothing (a peek, no syscall);
//! - the registration is level-triggered: the kernel reports it again while the readiness fd
//!   stays readable, so a message that lands after the peek is reported on the next try. An
//!   edge-triggered one is left as it is (rdsd may not raise another edge for a message that
//!   lands between the peek and its next pass);
//! - a one-shot registration whose only event was dropped is armed again (EPOLL_CTL_MOD), as
//!   it was before the kernel disarmed it.
//!
//! Registrations this library did not see (made by raw syscalls, before an exec, or through a
//! dup of the epoll fd) are not known: events of an epoll fd with such a registration may
//! still be stale, never wrongly dropped unless one of them shares its `data` with an rdsd
//! socket's registration.
//!
//! **Answered from the rings** (no system call): an `epoll_wait` on an epoll fd this library
//! saw created (`epoll_create`, `epoll_create1`) whose every registration is an rdsd socket
//! asking for input only, level-triggered (`EPOLLIN`, `EPOLLRDNORM`, `EPOLLRDHUP`,
//! `EPOLLWAKEUP`; at most [`RING_ANSWER_MAX`] of them), returns the registrations whose ring
//! holds a message, if one does, as `poll` and `select` do; the kernel is asked otherwise,
//! or when a signal mask is given. The first registration looked at moves on by one each
//! call, so that a `maxevents` smaller than the ready set starves none. Such an epoll fd is
//! known whole only while every registration went through `epoll_ctl` here: a dup of it, or
//! a fork (whose child shares the instance and may register a kernel fd this process never
//! sees), turns it back to the kernel for good, and so does a registered kernel fd closed
//! without `EPOLL_CTL_DEL` (another fd may hold its file, and the kernel its registration):
//! no kernel fd registered behind the library's back can be starved by rdsd sockets that
//! always have input. What it cannot see it cannot guard against (`shm-api/docs/c-abi.md`):
//! a raw `epoll_ctl` system call; the epoll fd sent to another process over a Unix socket, or
//! inherited by one started with vfork or posix_spawn (which run no fork handlers), that
//! registers kernel fds in it.

use libc::{c_int, epoll_event};
use rdsd::{ops, table};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

const IN: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
const ET: u32 = libc::EPOLLET as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;

/// The most registrations an epoll fd may have for `epoll_wait` to be answered from the rings
/// (each call peeks every ring; past this many the kernel's ready list is cheaper).
pub(crate) const RING_ANSWER_MAX: usize = 64;
/// The events a registration may ask for and still be answered from its ring.
const RING_ANSWERABLE: u32 = IN | (libc::EPOLLRDHUP | libc::EPOLLWAKEUP) as u32;

/// Forks seen (bumped before each fork, in the parent: the child inherits the count).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn before_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// One registration: the caller's data, its events, and whether its readiness can be read
/// from its ring (decided when it was made: a close forgets it before the number is reused).
#[derive(Clone, Copy)]
struct Registration {
    data: u64,
    events: u32,
    from_ring: bool,
}

/// The registrations of one epoll fd.
#[derive(Default)]
struct Epoll {
    by_fd: HashMap<c_int, Registration>,
    /// data → the fds registered with it.
    by_data: HashMap<u64, Vec<c_int>>,
    /// Made by `epoll_create*` here, never dup'd: every registration is known.
    whole: bool,
    /// `FORKS` when it was made: a fork since shares it with a child.
    forks: u64,
    /// Registrations whose readiness the rings cannot tell (a kernel fd, or events beyond
    /// level-triggered input).
    kernel_only: usize,
    /// Where the next ring answer starts looking.
    cursor: usize,
}

impl Epoll {
    /// `EPOLL_CTL_DEL` (or a registration made again).
    fn remove(&mut self, fd: c_int) -> Option<Registration> {
        let r = self.by_fd.remove(&fd)?;
        self.kernel_only -= usize::from(!r.from_ring);
        if let Some(fds) = self.by_data.get_mut(&r.data) {
            fds.retain(|&f| f != fd);
            if fds.is_empty() {
                self.by_data.remove(&r.data);
            }
        }
        Some(r)
    }

    /// `fd` was closed. The kernel drops its registration only if no other fd (a dup, a
    /// forked child's copy, one passed over a Unix socket) holds the file open, which cannot
    /// be told from here: a kernel fd's registration stays counted as kernel-only (so the
    /// epoll fd stays the kernel's), an rdsd socket's is forgotten (its number may come back
    /// as another socket, which must not be reported in its place).
    fn forget_closed(&mut self, fd: c_int) {
        if self.remove(fd).is_some_and(|r| !r.from_ring) {
            self.kernel_only += 1;
        }
    }

    fn insert(&mut self, fd: c_int, data: u64, events: u32) {
        self.remove(fd);
        let from_ring = events & IN != 0 && events & !RING_ANSWERABLE == 0 && table::is_ours(fd);
        self.kernel_only += usize::from(!from_ring);
        self.by_fd.insert(
            fd,
            Registration {
                data,
                events,
                from_ring,
            },
        );
        self.by_data.entry(data).or_default().push(fd);
    }

    /// The one fd registered with `data` and its events; None if none or several.
    fn only(&self, data: u64) -> Option<(c_int, u32)> {
        match self.by_data.get(&data).map(Vec::as_slice) {
            Some(&[fd]) => self.by_fd.get(&fd).map(|r| (fd, r.events)),
            _ => None,
        }
    }

    /// Whether `epoll_wait` may be answered from the rings (module doc).
    fn answers_from_rings(&self) -> bool {
        self.whole
            && self.forks == FORKS.load(Ordering::Relaxed)
            && self.kernel_only == 0
            && (1..=RING_ANSWER_MAX).contains(&self.by_fd.len())
    }
}

/// Every epoll fd's registrations; `None` until the first registration.
static EPOLLS: Mutex<Option<HashMap<c_int, Epoll>>> = Mutex::new(None);
/// Bit `epfd`: an rdsd socket was registered with that epoll fd (until it is closed), so its
/// epoll_wait has something to confirm. A bit test, so that a busy epoll loop of a program
/// takes no lock for epoll fds without rdsd sockets.
static HAS_OURS: [AtomicU64; table::MAX_FD / 64] =
    [const { AtomicU64::new(0) }; table::MAX_FD / 64];

fn has_ours(epfd: c_int) -> bool {
    (0..table::MAX_FD as c_int).contains(&epfd)
        && HAS_OURS[epfd as usize / 64].load(Ordering::Acquire) & (1 << (epfd % 64)) != 0
}

fn set_has_ours(epfd: c_int, on: bool) {
    if (0..table::MAX_FD as c_int).contains(&epfd) {
        let bit = 1u64 << (epfd % 64);
        let word = &HAS_OURS[epfd as usize / 64];
        if on {
            word.fetch_or(bit, Ordering::Release);
        } else {
            word.fetch_and(!bit, Ordering::Release);
        }
    }
}

/// Some epoll fd is known (`close` then forgets it).
static ANY_EPOLL: AtomicBool = AtomicBool::new(false);

fn epolls() -> std::sync::MutexGuard<'static, Option<HashMap<c_int, Epoll>>> {
    EPOLLS.lock().unwrap_or_else(|p| p.into_inner())
}

/// After a successful `epoll_ctl(epfd, op, fd, ev)`: remembers what it registered.
pub(crate) fn note_ctl(epfd: c_int, op: c_int, fd: c_int, ev: Option<epoll_event>) {
    let mut g = epolls();
    let map = g.get_or_insert_with(HashMap::new);
    ANY_EPOLL.store(true, Ordering::Relaxed);
    let ep = map.entry(epfd).or_default();
    match (op, ev) {
        (libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD, Some(e)) => {
            let (data, events) = (e.u64, e.events);
            ep.insert(fd, data, events);
            if table::is_ours(fd) {
                set_has_ours(epfd, true);
            }
        }
        _ => {
            ep.remove(fd);
        }
    }
}

/// After a successful `epoll_create*`: `epfd` is a new epoll instance whose every
/// registration this library will see (until a dup or a fork).
pub(crate) fn note_create(epfd: c_int) {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a prepare handler that only bumps an atomic.
        unsafe { libc::pthread_atfork(Some(before_fork), None, None) };
    });
    let mut g = epolls();
    ANY_EPOLL.store(true, Ordering::Relaxed);
    set_has_ours(epfd, false);
    g.get_or_insert_with(HashMap::new).insert(
        epfd,
        Epoll {
            whole: true,
            forks: FORKS.load(Ordering::Relaxed),
            ..Epoll::default()
        },
    );
}

/// `fd` was dup'd: if it is an epoll fd, registrations can now be made through the copy.
pub(crate) fn note_dup(fd: c_int) {
    if ANY_EPOLL.load(Ordering::Relaxed) {
        if let Some(ep) = epolls().as_mut().and_then(|m| m.get_mut(&fd)) {
            ep.whole = false;
        }
    }
}

/// `fd` was closed: if it was an epoll fd, its registrations went with it; its registrations
/// in other epoll fds are forgotten (`Epoll::forget_closed`).
pub(crate) fn note_close(fd: c_int) {
    if ANY_EPOLL.load(Ordering::Relaxed) {
        if let Some(map) = epolls().as_mut() {
            // One lookup per epoll fd: a program's every close comes through here.
            map.remove(&fd);
            for ep in map.values_mut() {
                ep.forget_closed(fd);
            }
        }
        set_has_ours(fd, false);
    }
}

/// `first..=last` were closed (close_range, closefrom): epoll fds among them are forgotten,
/// and so are registrations of them.
pub(crate) fn note_close_range(first: libc::c_uint, last: libc::c_uint) {
    if ANY_EPOLL.load(Ordering::Relaxed) {
        let closed = |fd: c_int| fd >= 0 && (first..=last).contains(&(fd as libc::c_uint));
        if let Some(map) = epolls().as_mut() {
            map.retain(|&fd, ep| {
                if closed(fd) {
                    set_has_ours(fd, false);
                    return false;
                }
                let gone: Vec<c_int> = ep.by_fd.keys().copied().filter(|&f| closed(f)).collect();
                for f in gone {
                    ep.forget_closed(f);
                }
                true
            });
        }
    }
}

/// Answers `epoll_wait(epfd, events, max)` from the rings when the module's rules allow it
/// and one registration's ring holds a message: how many events were written. None: ask the
/// kernel.
///
/// # Safety
/// `events` points to room for `max` `epoll_event`s (epoll_wait's contract).
pub(crate) unsafe fn ready_from_rings(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
) -> Option<c_int> {
    if max <= 0 || events.is_null() {
        return None;
    }
    // The registrations, copied under the lock; the rings are looked at after it.
    let mut regs = [(0 as c_int, 0u64, 0u32); RING_ANSWER_MAX];
    let (n, start) = {
        let mut g = epolls();
        let ep = g.as_mut()?.get_mut(&epfd)?;
        if !ep.answers_from_rings() {
            return None;
        }
        let n = ep.by_fd.len();
        for (slot, (&fd, r)) in regs.iter_mut().zip(ep.by_fd.iter()) {
            *slot = (fd, r.data, r.events);
        }
        let start = ep.cursor % n;
        ep.cursor = start + 1;
        (n, start)
    };
    // SAFETY: the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
    let mut ready = 0;
    for i in 0..n {
        let (fd, data, registered) = regs[(start + i) % n];
        if ops::has_input(fd) {
            out[ready] = epoll_event {
                events: registered & IN,
                u64: data,
            };
            ready += 1;
            if ready == out.len() {
                break;
            }
        }
    }
    (ready > 0).then_some(ready as c_int)
}

/// Whether `epoll_wait` on `epfd` may report an rdsd socket's EPOLLIN that needs confirming.
pub(crate) fn may_confirm(epfd: c_int) -> bool {
    has_ours(epfd)
}

/// Drops the stale EPOLLIN of rdsd sockets from the first `n` of `events` (the module's rules),
/// moving the events kept to the front; returns how many were kept.
///
/// # Safety
/// `events` points to at least `n` initialised `epoll_event`s (epoll_wait's result).
pub(crate) unsafe fn confirm(epfd: c_int, events: *mut epoll_event, n: c_int) -> c_int {
    // SAFETY: the caller's contract.
    let evs = unsafe { std::slice::from_raw_parts_mut(events, n.max(0) as usize) };
    // Which registration each EPOLLIN event is, under one lock; the rings are looked at after.
    let mut regs = [None; 64];
    {
        let g = epolls();
        let ep = g.as_ref().and_then(|m| m.get(&epfd));
        for (i, e) in evs.iter().enumerate().take(regs.len()) {
            if e.events & IN != 0 {
                regs[i] = ep.and_then(|ep| ep.only(e.u64));
            }
        }
    }
    let mut kept = 0;
    for i in 0..evs.len() {
        let (mut bits, data) = (evs[i].events, evs[i].u64);
        if bits & IN != 0 {
            // Past the first 64 events of one call, nothing is confirmed (kept as reported).
            let reg = regs.get(i).copied().flatten();
            if let Some((fd, registered)) = reg {
                if registered & ET == 0 && table::is_ours(fd) && !ops::has_input(fd) {
                    bits &= !IN;
                    if bits == 0 {
                        if registered & ONESHOT != 0 {
                            rearm(epfd, fd, data, registered);
                        }
                        continue;
                    }
                }
            }
        }
        evs[kept] = epoll_event {
            events: bits,
            u64: data,
        };
        kept += 1;
    }
    kept as c_int
}

/// Arms a one-shot registration again after its only event was dropped as stale.
fn rearm(epfd: c_int, fd: c_int, data: u64, events: u32) {
    let mut e = epoll_event { events, u64: data };
    // SAFETY: the raw syscall (not the wrapper: nothing to note), on a valid event.
    unsafe {
        libc::syscall(
            libc::SYS_epoll_ctl,
            epfd,
            libc::EPOLL_CTL_MOD,
            fd,
            &mut e as *mut epoll_event,
        );
    }
}

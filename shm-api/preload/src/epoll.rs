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

use libc::{c_int, epoll_event};
use rdsd::{ops, table};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

const IN: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
const ET: u32 = libc::EPOLLET as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;

/// The registrations of one epoll fd.
#[derive(Default)]
struct Epoll {
    /// fd → (data, events).
    by_fd: HashMap<c_int, (u64, u32)>,
    /// data → the fds registered with it.
    by_data: HashMap<u64, Vec<c_int>>,
}

impl Epoll {
    fn remove(&mut self, fd: c_int) {
        if let Some((data, _)) = self.by_fd.remove(&fd) {
            if let Some(fds) = self.by_data.get_mut(&data) {
                fds.retain(|&f| f != fd);
                if fds.is_empty() {
                    self.by_data.remove(&data);
                }
            }
        }
    }

    fn insert(&mut self, fd: c_int, data: u64, events: u32) {
        self.remove(fd);
        self.by_fd.insert(fd, (data, events));
        self.by_data.entry(data).or_default().push(fd);
    }

    /// The one fd registered with `data` and its events; None if none or several.
    fn only(&self, data: u64) -> Option<(c_int, u32)> {
        match self.by_data.get(&data).map(Vec::as_slice) {
            Some(&[fd]) => self.by_fd.get(&fd).map(|&(_, ev)| (fd, ev)),
            _ => None,
        }
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
        _ => ep.remove(fd),
    }
}

/// `fd` was closed: if it was an epoll fd, its registrations went with it.
pub(crate) fn note_close(fd: c_int) {
    if ANY_EPOLL.load(Ordering::Relaxed) {
        if let Some(map) = epolls().as_mut() {
            map.remove(&fd);
        }
        set_has_ours(fd, false);
    }
}

/// `first..=last` were closed (close_range, closefrom): epoll fds among them are forgotten.
pub(crate) fn note_close_range(first: libc::c_uint, last: libc::c_uint) {
    if ANY_EPOLL.load(Ordering::Relaxed) {
        if let Some(map) = epolls().as_mut() {
            map.retain(|&fd, _| {
                let closed = fd >= 0 && (first..=last).contains(&(fd as libc::c_uint));
                if closed {
                    set_has_ours(fd, false);
                }
                !closed
            });
        }
    }
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

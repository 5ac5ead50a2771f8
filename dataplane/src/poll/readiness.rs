//! Keeping a socket's pollable fd in step with its rings.
//!
//! The app's fd is one end of an `AF_UNIX SOCK_DGRAM` socketpair; rdsd holds the other end and
//! a dup of the app's end. An eventfd can't be used: it can be readable-only, writable-only or
//! both, but never neither, and "nothing to read and the send buffer full" is a real state.
//! With the pair:
//! * POLLIN on the app end = a datagram waits in its receive queue. rdsd sends one from its end
//!   to set it and reads it back through its dup to clear it.
//! * POLLOUT on the app end = its send-buffer use is low. Its SO_SNDBUF is the minimum, so one
//!   1500-byte datagram sent through the dup (parked in rdsd's receive queue) clears POLLOUT, and
//!   rdsd reading it sets POLLOUT again.
//!
//! These calls run on the poll core only on state changes, and only for sockets whose app asked
//! for the fd. That is the one documented exception to "no syscall on the poll core".
//!
//! The app can write into rdsd's end (its end's peer) as fast as it likes, so every drain is
//! bounded ([`MAX_DRAIN`] datagrams per call): a flooding app can only spoil its own fd's
//! readiness, never keep the poll core in a loop. Every call uses MSG_DONTWAIT, so nothing
//! depends on the O_NONBLOCK flag of the description rdsd shares with that one app.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// Descriptors rdsd keeps for one socket's readiness.
pub struct Readiness {
    app_end_dup: OwnedFd,
    daemon_end: OwnedFd,
    readable: bool,
    writable: bool,
}

/// Makes the socketpair for a new socket: (fd for the app, rdsd's state).
pub fn create() -> std::io::Result<(OwnedFd, Readiness)> {
    let (app_end, daemon_end) = shm_api::sys::socketpair(libc::SOCK_DGRAM)?;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a valid int on our own fd; the kernel rounds 1 up to its minimum.
    unsafe {
        libc::setsockopt(
            app_end.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &one as *const _ as *const _,
            std::mem::size_of::<libc::c_int>() as u32,
        );
    }
    let app_end_dup = app_end.try_clone()?;
    Ok((
        app_end,
        Readiness {
            app_end_dup,
            daemon_end,
            readable: false,
            writable: true,
        },
    ))
}

/// Most datagrams one drain reads: more than rdsd itself ever queues on a socket (one), few
/// enough that a flood costs a pass a bounded number of syscalls.
pub const MAX_DRAIN: usize = 16;

fn send_dontwait(fd: RawFd, len: usize) {
    let buf = [0u8; 1500];
    let _ = shm_api::sys::send_dontwait(fd, &buf[..len.min(buf.len())]);
}

/// Reads what is queued on `fd`, at most [`MAX_DRAIN`] datagrams. Returns false if it stopped
/// at the bound with more queued (an app is flooding).
pub fn drain(fd: RawFd) -> bool {
    let mut buf = [0u8; 16];
    for _ in 0..MAX_DRAIN {
        // Datagrams longer than `buf` are truncated: only their count matters.
        if shm_api::sys::recv_dontwait(fd, &mut buf).is_err() {
            return true;
        }
    }
    false
}

impl Readiness {
    /// Brings the fd to (`readable`, `writable`), with syscalls only for what changed. Returns
    /// false if a drain stopped at its bound (see [`drain`]).
    pub fn sync(&mut self, readable: bool, writable: bool) -> bool {
        let mut complete = true;
        if readable != self.readable {
            if readable {
                send_dontwait(self.daemon_end.as_raw_fd(), 1);
            } else {
                complete &= drain(self.app_end_dup.as_raw_fd());
            }
            self.readable = readable;
        }
        if writable != self.writable {
            if writable {
                complete &= drain(self.daemon_end.as_raw_fd());
            } else {
                send_dontwait(self.app_end_dup.as_raw_fd(), 1500);
            }
            self.writable = writable;
        }
        complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revents(fd: RawFd) -> libc::c_short {
        shm_api::sys::poll_one(fd, libc::POLLIN | libc::POLLOUT, 0).unwrap()
    }

    #[test]
    fn all_four_states_are_visible_to_poll() {
        let (app, mut r) = create().unwrap();
        let fd = app.as_raw_fd();
        assert_eq!(revents(fd), libc::POLLOUT);
        r.sync(true, true);
        assert_eq!(revents(fd), libc::POLLIN | libc::POLLOUT);
        r.sync(true, false);
        assert_eq!(revents(fd), libc::POLLIN);
        r.sync(false, false);
        assert_eq!(revents(fd), 0);
        r.sync(false, true);
        assert_eq!(revents(fd), libc::POLLOUT);
    }

    #[test]
    fn a_flood_into_rdsds_end_costs_a_bounded_drain() {
        let (app, mut r) = create().unwrap();
        let big: libc::c_int = 4 << 20;
        // SAFETY: setsockopt with a valid int on our own fd.
        unsafe {
            libc::setsockopt(
                app.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                &big as *const _ as *const _,
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
        // The app also clears O_NONBLOCK on its end: rdsd's calls must not care.
        shm_api::sys::set_nonblocking(app.as_raw_fd(), false).unwrap();
        let mut sent = 0;
        while sent < 200 && shm_api::sys::send_dontwait(app.as_raw_fd(), &[7]).is_ok() {
            sent += 1;
        }
        assert!(sent > MAX_DRAIN, "queued {sent}");
        r.sync(false, false);
        assert!(!r.sync(false, true), "the drain stops at its bound");
        r.sync(true, false);
        r.sync(false, false);
    }
}

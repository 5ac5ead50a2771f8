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

fn send_dontwait(fd: RawFd, len: usize) {
    let buf = [0u8; 1500];
    // SAFETY: sends `len` (<= 1500) bytes from a valid buffer.
    unsafe {
        libc::send(
            fd,
            buf.as_ptr() as *const _,
            len.min(buf.len()),
            libc::MSG_DONTWAIT,
        )
    };
}

fn drain(fd: RawFd) {
    let mut buf = [0u8; 1500];
    // SAFETY: receives into a valid buffer; non-blocking, so the loop ends at EAGAIN.
    while unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr() as *mut _,
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    } >= 0
    {}
}

impl Readiness {
    /// Brings the fd to (`readable`, `writable`), with syscalls only for what changed.
    pub fn sync(&mut self, readable: bool, writable: bool) {
        if readable != self.readable {
            if readable {
                send_dontwait(self.daemon_end.as_raw_fd(), 1);
            } else {
                drain(self.app_end_dup.as_raw_fd());
            }
            self.readable = readable;
        }
        if writable != self.writable {
            if writable {
                drain(self.daemon_end.as_raw_fd());
            } else {
                send_dontwait(self.app_end_dup.as_raw_fd(), 1500);
            }
            self.writable = writable;
        }
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
}

//! A raw control-socket client for hostile tests: it speaks the control protocol frame by frame
//! (no `shm-api` attach), so a test can send what it likes, when it likes, and read (or never
//! read) the replies.

use shm_api::ctrl::{Reply, Request, MAX_DATAGRAM};
use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// One control connection.
pub struct RawClient {
    /// The connected SOCK_SEQPACKET socket.
    pub sock: UnixStream,
    next_id: Cell<u64>,
}

impl RawClient {
    /// Connects (no Hello).
    pub fn connect(path: &Path) -> io::Result<RawClient> {
        Ok(RawClient {
            sock: shm_api::sys::connect_seqpacket(path)?,
            next_id: Cell::new(1),
        })
    }

    /// The socket's descriptor.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Sends one request frame with a fresh id; returns the id.
    pub fn send(&self, req: &Request) -> io::Result<u64> {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        shm_api::sys::send_with_fds(self.fd(), &req.encode(id), &[])?;
        Ok(id)
    }

    /// Sends raw bytes as one frame, without waiting.
    pub fn send_bytes_dontwait(&self, b: &[u8]) -> io::Result<()> {
        // SAFETY: sends `b.len()` bytes from a live buffer on our own socket.
        let n = unsafe {
            libc::send(
                self.fd(),
                b.as_ptr() as *const _,
                b.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Receives one reply, waiting at most `limit`: `Ok(None)` on timeout, an error with kind
    /// `UnexpectedEof` if rdsd closed the connection.
    pub fn recv(&self, limit: Duration) -> io::Result<Option<(Reply, Vec<OwnedFd>)>> {
        let rev = shm_api::sys::poll_one(self.fd(), libc::POLLIN, limit.as_millis() as i32)?;
        if rev == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let (n, fds) = shm_api::sys::recv_with_fds(self.fd(), &mut buf, libc::MSG_DONTWAIT)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "rdsd hung up"));
        }
        let r = Reply::decode(&buf[..n])
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad reply"))?;
        Ok(Some((r, fds)))
    }

    /// Sends `req` and waits up to `limit` for a reply, which must answer this request (its
    /// id) or be a refusal of the connection (id 0); anything else is an `InvalidData` error.
    pub fn call(
        &self,
        req: &Request,
        limit: Duration,
    ) -> io::Result<Option<(Reply, Vec<OwnedFd>)>> {
        let id = self.send(req)?;
        let r = self.recv(limit)?;
        if let Some((reply, _)) = &r {
            if reply.id != id && reply.id != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("reply {reply:?} does not answer request {id}"),
                ));
            }
        }
        Ok(r)
    }

    /// Hello with this library's layout version; returns the reply and descriptors.
    pub fn hello(&self, limit: Duration) -> io::Result<Option<(Reply, Vec<OwnedFd>)>> {
        self.call(
            &Request::Hello {
                version: shm_api::layout::LAYOUT_VERSION,
                shard: None,
            },
            limit,
        )
    }
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the new soft limit.
pub fn raise_nofile() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
    }
    r.rlim_cur
}

/// Reads a number from a sysfs/procfs file.
pub fn read_num(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Blocks allocated to the file behind `fd` (`st_blocks`, 512-byte units).
pub fn fd_blocks(fd: RawFd) -> u64 {
    // SAFETY: fstat into a zeroed stat struct.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return 0;
        }
        st.st_blocks as u64
    }
}

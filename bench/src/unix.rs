//! The baseline: AF_UNIX SOCK_SEQPACKET through the kernel, the same message sizes and counts.

use crate::util::{
    check_payload, new_histogram, pin, stamp, Backoff, Latency, Throughput, STALL_LIMIT,
};
use anyhow::{bail, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::Instant;

/// How the baseline waits for a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Baseline {
    /// Classic: blocking send/recv (the receiver sleeps in the kernel and is woken).
    Block,
    /// Both sides busy-poll with MSG_DONTWAIT (no sleeps, still a syscall per attempt).
    Spin,
    /// Run both variants.
    Both,
    /// Skip the baseline.
    None,
}

impl Baseline {
    /// The variants to run: `false` = blocking, `true` = spinning.
    pub fn variants(self) -> &'static [bool] {
        match self {
            Baseline::Block => &[false],
            Baseline::Spin => &[true],
            Baseline::Both => &[false, true],
            Baseline::None => &[],
        }
    }
}

/// A human name for one variant.
pub fn label(spin: bool, what: &str) -> String {
    format!(
        "AF_UNIX seqpacket {what}, {}",
        if spin { "busy-poll" } else { "blocking" }
    )
}

/// A connected SOCK_SEQPACKET pair, both ends close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded, so both are fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn cvt(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One send(2); EINTR is retried.
pub(crate) fn send(fd: RawFd, buf: &[u8], flags: i32) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes for the duration of the call.
        let r = cvt(unsafe {
            libc::send(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                flags | libc::MSG_NOSIGNAL,
            )
        });
        match r {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// One recv(2); EINTR is retried.
pub(crate) fn recv(fd: RawFd, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid and writable for `buf.len()` bytes for the duration of the call.
        let r = cvt(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) });
        match r {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// Blocking, or MSG_DONTWAIT retried until it goes through.
fn send_msg(fd: RawFd, buf: &[u8], spin: bool, bo: &mut Backoff) -> Result<u64> {
    if !spin {
        send(fd, buf, 0).context("AF_UNIX send")?;
        return Ok(0);
    }
    let mut retries = 0;
    let mut since = None;
    loop {
        match send(fd, buf, libc::MSG_DONTWAIT) {
            Ok(_) => return Ok(retries),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                retries += 1;
                bo.snooze();
                if bo.should_check()
                    && since.get_or_insert_with(Instant::now).elapsed() > STALL_LIMIT
                {
                    bail!("AF_UNIX send: no room for {STALL_LIMIT:?}");
                }
            }
            Err(e) => return Err(e).context("AF_UNIX send"),
        }
    }
}

/// Blocking, or MSG_DONTWAIT retried until a message arrives. 0 bytes with `size` > 0 means
/// the peer closed.
fn recv_msg(fd: RawFd, buf: &mut [u8], spin: bool, bo: &mut Backoff) -> Result<usize> {
    if !spin {
        return recv(fd, buf, 0).context("AF_UNIX recv");
    }
    let mut since = None;
    loop {
        match recv(fd, buf, libc::MSG_DONTWAIT) {
            Ok(n) => return Ok(n),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                bo.snooze();
                if bo.should_check()
                    && since.get_or_insert_with(Instant::now).elapsed() > STALL_LIMIT
                {
                    bail!("AF_UNIX recv: nothing for {STALL_LIMIT:?}");
                }
            }
            Err(e) => return Err(e).context("AF_UNIX recv"),
        }
    }
}

/// Sets SO_SNDBUF and SO_RCVBUF (the kernel caps them at net.core.[wr]mem_max) and returns
/// the effective SO_SNDBUF.
pub(crate) fn big_buffers(fd: RawFd, bytes: i32) -> i32 {
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid int option value of the size passed.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>() as u32,
            )
        };
    }
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes of the sizes given.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&mut v as *mut i32).cast(),
            &mut len,
        )
    };
    v
}

/// Ping-pong with a separate echo process (this binary re-executed as `__unix-echo`), the peer
/// pinned to `peer_core` (anywhere with `None`). The calling thread stays where it is (on
/// `app_core`). Busy-polling sides that may share a core yield every 64 misses.
pub fn rtt(
    count: u64,
    warmup: u64,
    size: usize,
    app_core: Option<usize>,
    peer_core: Option<usize>,
    spin: bool,
) -> Result<Latency> {
    let yield_every = match (app_core, peer_core) {
        (Some(a), Some(p)) if a != p => 0,
        _ => 64,
    };
    let (mine, theirs) = seqpacket_pair()?;
    // SAFETY: fcntl on a descriptor we own. The peer's end must survive exec, so its
    // close-on-exec flag goes; no other thread of rds-bench spawns processes at this point.
    if unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
        return Err(io::Error::last_os_error()).context("fcntl(F_SETFD)");
    }
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__unix-echo")
        .arg("--fd")
        .arg(theirs.as_raw_fd().to_string());
    if let Some(c) = peer_core {
        cmd.arg("--core").arg(c.to_string());
    }
    if spin {
        cmd.arg("--spin")
            .arg("--yield-every")
            .arg(yield_every.to_string());
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .spawn()
        .context("cannot start the AF_UNIX echo process")?;
    drop(theirs);
    let fd = mine.as_raw_fd();
    let res = (|| -> Result<Latency> {
        let mut msg = vec![0x3Cu8; size];
        let mut buf = vec![0u8; size + 64];
        let mut hist = new_histogram();
        let mut bo = Backoff::yielding(yield_every);
        let mut start = Instant::now();
        for i in 0..warmup + count {
            stamp(&mut msg, i);
            if i == warmup {
                start = Instant::now();
            }
            let t0 = Instant::now();
            send_msg(fd, &msg, spin, &mut bo)?;
            let n = recv_msg(fd, &mut buf, spin, &mut bo)?;
            let dt = t0.elapsed();
            if n == 0 && size > 0 {
                bail!("the AF_UNIX echo process went away");
            }
            check_payload(&buf, n, size, i)?;
            if i >= warmup {
                hist.saturating_record(dt.as_nanos().max(1) as u64);
            }
        }
        Ok(Latency::from_histogram(&hist, start.elapsed()))
    })();
    // Closing our end makes the echo's recv return 0: it exits.
    drop(mine);
    if res.is_err() {
        let _ = child.kill();
    }
    let st = child.wait()?;
    let lat = res?;
    if !st.success() {
        bail!("AF_UNIX echo process exited with {st}");
    }
    Ok(lat)
}

/// `__unix-echo`: echoes every message on `fd` until the other end closes.
pub fn echo_main(fd: RawFd, core: Option<usize>, spin: bool, yield_every: u32) -> Result<()> {
    // SAFETY: the parent passed us this descriptor (inherited across exec) to own; nothing else
    // in this process uses it.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    pin(core);
    let fd = sock.as_raw_fd();
    let mut buf = vec![0u8; 1 << 20];
    let mut bo = Backoff::yielding(yield_every);
    loop {
        let n = match recv_msg(fd, &mut buf, spin, &mut bo) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) => {
                // The parent is gone (ECONNRESET) or we stalled: nothing left to echo.
                if spin {
                    return Ok(());
                }
                return Err(e);
            }
        };
        match send_msg(fd, &buf[..n], spin, &mut bo) {
            Ok(_) => {}
            Err(e)
                if e.root_cause()
                    .downcast_ref::<io::Error>()
                    .and_then(|e| e.raw_os_error())
                    == Some(libc::EPIPE) =>
            {
                return Ok(())
            }
            Err(e) => return Err(e),
        }
    }
}

/// One-way stream between two threads of this process over a SOCK_SEQPACKET pair: the sender
/// on `sender_core`, the receiver on `receiver_core`.
pub fn tput(
    count: u64,
    size: usize,
    sender_core: Option<usize>,
    receiver_core: Option<usize>,
    spin: bool,
) -> Result<(Throughput, i32)> {
    if count < 2 {
        bail!("--count must be at least 2");
    }
    let (a, b) = seqpacket_pair()?;
    let sndbuf = big_buffers(a.as_raw_fd(), 16 << 20);
    big_buffers(b.as_raw_fd(), 16 << 20);
    let go = Barrier::new(2);
    std::thread::scope(|s| {
        let rx = s.spawn(|| -> Result<(Instant, Instant)> {
            pin(receiver_core);
            go.wait();
            let fd = b.as_raw_fd();
            let r = (|| -> Result<(Instant, Instant)> {
                let mut buf = vec![0u8; size + 64];
                let mut bo = Backoff::yielding(64);
                let n = recv_msg(fd, &mut buf, spin, &mut bo)?;
                let first = Instant::now();
                check_payload(&buf, n, size, 0)?;
                for i in 1..count {
                    let n = recv_msg(fd, &mut buf, spin, &mut bo)?;
                    check_payload(&buf, n, size, i)?;
                }
                Ok((first, Instant::now()))
            })();
            if r.is_err() {
                // SAFETY: shutdown(2) on a descriptor we own. It unblocks a sender waiting
                // for room that will never come.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
            r
        });
        let tx = s.spawn(|| -> Result<u64> {
            pin(sender_core);
            go.wait();
            let fd = a.as_raw_fd();
            let mut msg = vec![0xC3u8; size];
            let mut bo = Backoff::yielding(64);
            let mut retries = 0;
            for i in 0..count {
                stamp(&mut msg, i);
                retries += send_msg(fd, &msg, spin, &mut bo)?;
            }
            Ok(retries)
        });
        let tx = tx.join().expect("sender thread panicked");
        if tx.is_err() {
            // SAFETY: shutdown(2) on a descriptor we own. It unblocks a receiver waiting for
            // messages that will never come.
            unsafe { libc::shutdown(a.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let rx = rx.join().expect("receiver thread panicked");
        let retries = tx.context("AF_UNIX sender")?;
        let (first, last) = rx.context("AF_UNIX receiver")?;
        Ok((
            Throughput {
                count,
                size,
                elapsed: last - first,
                retries,
            },
            sndbuf,
        ))
    })
}

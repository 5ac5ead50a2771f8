//! The process's RDS sockets, found by file descriptor; the attachment to rdsd; fork.
//!
//! Every socket is reached through an fd the app owns: a dup of the socket's pollable fd (one
//! end of the readiness socketpair rdsd keeps in step). `Socket` keeps its own copy, private
//! and close-on-exec, so the app closing, dup2-ing over or reusing its numbers never touches
//! it. Lookups cost one atomic load for an fd that is not ours (a bitmap), and for one that is
//! a load of its slot between two plain stores to the calling thread's own record (`slots`:
//! no lock, no reference count, nothing written that another thread reads in its calls);
//! nothing is looked up at all until the first RDS socket.

pub use crate::slots::Ref;
use crate::slots::Slots;
use shm_api::{Rdsd, Socket};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// fds at or above this are never RDS sockets (socket() fails with EMFILE instead).
pub const MAX_FD: usize = 1 << 16;

/// What the C ABI keeps per socket beyond `shm_api::Socket`.
pub struct Entry {
    /// The socket.
    pub sock: Socket,
    /// The fork generation that created it (see [`fork_generation`]).
    pub generation: u64,
    /// SO_RDS_TRANSPORT as set (`RDS_TRANS_NONE` = !0 until then).
    pub transport: AtomicI32,
    /// SIOCRDSSETTOS.
    pub tos: AtomicU8,
    /// SO_SNDTIMEO / SO_RCVTIMEO in microseconds (0 = none), for getsockopt.
    pub timeouts_us: [AtomicU64; 2],
}

impl Entry {
    /// The socket, or EBADFD for one inherited across fork: its rings and control connection
    /// belong to the parent.
    pub fn socket(&self) -> Result<&Socket, i32> {
        if self.generation == fork_generation() {
            Ok(&self.sock)
        } else {
            Err(libc::EBADFD)
        }
    }
}

static ANY: AtomicBool = AtomicBool::new(false);
static BITS: [AtomicU64; MAX_FD / 64] = [const { AtomicU64::new(0) }; MAX_FD / 64];
/// Every fd's slot, read without a lock (`slots`: 512 KiB of zeroed address space; only the
/// pages of fds in use are touched).
static SLOTS: Slots<Entry, MAX_FD> = Slots::new();
pub use crate::fork::fork_generation;

/// True once this process has opened an RDS socket (before that nothing is ever looked up).
#[inline]
pub fn any() -> bool {
    ANY.load(Ordering::Relaxed)
}

/// True if `fd` is one of ours. One atomic load.
#[inline]
pub fn is_ours(fd: RawFd) -> bool {
    if !any() || fd < 0 || fd as usize >= MAX_FD {
        return false;
    }
    let i = fd as usize;
    BITS[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0
}

/// The entry behind `fd`, if it is one of ours, for the duration of a call: read in place,
/// without a lock (see `slots`).
#[inline]
pub fn read(fd: RawFd) -> Option<Ref<Entry>> {
    if !is_ours(fd) {
        return None;
    }
    SLOTS.read(fd as usize)
}

/// The entry behind `fd`, if it is one of ours, as a counted reference (to keep).
pub fn get(fd: RawFd) -> Option<Arc<Entry>> {
    if !is_ours(fd) {
        return None;
    }
    SLOTS.get(fd as usize)
}

/// Makes `fd` stand for `entry`. EMFILE past [`MAX_FD`]. An entry `fd` stood for before (a
/// dup2 target) is returned for [`release`], once no call uses it in place.
pub fn insert(fd: RawFd, entry: Arc<Entry>) -> Result<Option<Arc<Entry>>, i32> {
    if fd < 0 || fd as usize >= MAX_FD {
        return Err(libc::EMFILE);
    }
    let i = fd as usize;
    ANY.store(true, Ordering::Relaxed);
    let old = SLOTS.replace(i, Some(entry));
    BITS[i / 64].fetch_or(1 << (i % 64), Ordering::Release);
    Ok(old)
}

/// Forgets `fd`; returns what it stood for (to [`release`]), once no call uses it in place.
pub fn remove(fd: RawFd) -> Option<Arc<Entry>> {
    if !is_ours(fd) {
        return None;
    }
    let i = fd as usize;
    BITS[i / 64].fetch_and(!(1 << (i % 64)), Ordering::Release);
    SLOTS.replace(i, None)
}

/// Drops one fd's reference. The last one closes the socket in rdsd, except for a socket
/// inherited across fork, whose control connection is the parent's: the child only forgets it.
pub fn release(entry: Arc<Entry>) {
    if entry.generation != fork_generation() {
        std::mem::forget(entry);
    } else {
        drop(entry);
    }
}

/// rdsd's control socket: `$RDSD_SOCKET`, else the default.
pub fn control_path() -> std::path::PathBuf {
    std::env::var_os("RDSD_SOCKET")
        .map(Into::into)
        .unwrap_or_else(|| shm_api::DEFAULT_CONTROL_SOCKET.into())
}

static ATTACHMENT: Mutex<Option<(u64, Rdsd)>> = Mutex::new(None);
static WARNED: AtomicBool = AtomicBool::new(false);

/// This process's attachment to rdsd, made on first use (and again in a forked child, which
/// must not share its parent's control connection). If rdsd can't be reached, says so on
/// stderr once and answers EAFNOSUPPORT, the errno of a kernel without RDS.
pub fn rdsd() -> Result<Rdsd, i32> {
    crate::fork::watch();
    let mut a = ATTACHMENT.lock().unwrap_or_else(|p| p.into_inner());
    let generation = fork_generation();
    if let Some((g, r)) = a.as_ref() {
        if *g == generation {
            return Ok(r.clone());
        }
    }
    // The parent's attachment (if inherited) is only forgotten: dropping it would close
    // nothing of the parent's, but its sockets may still reference it.
    if let Some(old) = a.take() {
        std::mem::forget(old);
    }
    match Rdsd::attach() {
        Ok(r) => {
            *a = Some((generation, r.clone()));
            Ok(r)
        }
        Err(e) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                let path = control_path().display().to_string();
                eprintln!(
                    "librdsd: rdsd is not reachable at {path} ({}); AF_RDS sockets fail with \
                     EAFNOSUPPORT (start rdsd, or set RDSD_SOCKET to its control socket)",
                    shm_api::explain(&e)
                );
            }
            Err(libc::EAFNOSUPPORT)
        }
    }
}

//! Small `MAP_SHARED` files that outlive the daemon (receive sequence numbers, bound ports):
//! plain stores into the mapping persist without a syscall, and a SIGKILLed rdsd loses nothing
//! the page cache holds. Each file is rdsd's alone: mode 0600, `flock`ed so two daemons cannot
//! share it.

use memmap2::MmapMut;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// A locked file of exactly `len` bytes, mapped shared.
pub struct LockedMap {
    pub map: MmapMut,
    /// Holds the lock; `None` for an anonymous map (fuzzing and tests only).
    _file: Option<File>,
    /// The file was created or had the wrong size (it is all zeros now).
    pub fresh: bool,
}

impl LockedMap {
    /// Opens (or creates) `path`, locks it for this process, sizes it to `len` (zeroing it if
    /// its size was different) and maps it.
    pub fn open(path: &Path, len: usize) -> io::Result<LockedMap> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        // SAFETY: flock on our own descriptor.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("{} is in use by another rdsd: {e}", path.display()),
            ));
        }
        let fresh = file.metadata()?.len() != len as u64;
        if fresh {
            file.set_len(0)?;
            file.set_len(len as u64)?;
        }
        // SAFETY: the file is ours (locked, 0600) and sized to `len`; no one truncates it while
        // mapped.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(LockedMap {
            map,
            _file: Some(file),
            fresh,
        })
    }

    /// An anonymous map of `len` bytes starting with `bytes` (the rest zero), as if a file
    /// with that content had been opened: the parsers' view of a hostile state file, without
    /// touching the file system (fuzz targets and tests).
    #[cfg(any(test, fuzzing))]
    pub fn from_bytes(bytes: &[u8], len: usize) -> io::Result<LockedMap> {
        let mut map = MmapMut::map_anon(len)?;
        let n = bytes.len().min(len);
        map[..n].copy_from_slice(&bytes[..n]);
        Ok(LockedMap {
            map,
            _file: None,
            fresh: false,
        })
    }
}

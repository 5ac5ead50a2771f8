//! The receive state that survives an rdsd restart: per connection (local address, peer
//! address), the peer's generation and, per path, the sequence number after the last message
//! delivered to a socket.
//!
//! It lives in a small `MAP_SHARED` file (by default next to the control socket, under /run), so
//! a plain store on the delivery path persists it: no syscall, and a SIGKILLed rdsd loses
//! nothing the kernel's page cache holds. After a restart the protocol layer seeds each new
//! connection with it, and the peer's retransmissions at or below it are dropped as duplicates
//! (spec §7) instead of being delivered a second time.
//!
//! The file is rdsd's alone ([`LockedMap`]); a file of the wrong size or magic is
//! reinitialised. Several poll threads share one file (each writes only the slots of the
//! connections it owns; claiming a slot takes a lock, at connection setup only).

use crate::quiet::Mutex;
use crate::statefile::LockedMap;
use rds_proto::wire::MAX_PATHS;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

const MAGIC: u64 = u64::from_le_bytes(*b"RDSDRXSQ");
const VERSION: u32 = 1;
/// Connections remembered; beyond that, new connections are not persisted (and counted).
pub const SLOTS: usize = 1024;
const HEADER: usize = 64;

/// One connection's record. Only rdsd maps the file, so references into it are sound.
#[repr(C)]
struct Slot {
    laddr: AtomicU32,
    faddr: AtomicU32,
    peer_generation: AtomicU32,
    used: AtomicU32,
    next_rx_seq: [AtomicU64; MAX_PATHS],
}

const SLOT_LEN: usize = std::mem::size_of::<Slot>();
const FILE_LEN: usize = HEADER + SLOTS * SLOT_LEN;

/// The mapped state file.
pub struct RxStateFile {
    file: LockedMap,
    /// Slots claimed (a prefix of the file): the lock serialises claims.
    used: Mutex<usize>,
}

// SAFETY: MmapMut is Send; the mapping is only read and written through the atomics of its
// slots (`slot`), and slots are claimed under `used`'s lock.
unsafe impl Send for RxStateFile {}
// SAFETY: as for Send: through `&self`, the mapping is touched only by atomic loads and stores
// and by claims under the lock; each claimed slot's stores come from the one poll thread that
// owns its connection.
unsafe impl Sync for RxStateFile {}

impl std::fmt::Debug for RxStateFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RxStateFile({} slots used)", self.used())
    }
}

impl RxStateFile {
    /// Opens (or creates) the file and locks it for this process.
    pub fn open(path: &Path) -> io::Result<RxStateFile> {
        Ok(RxStateFile::adopt(LockedMap::open(path, FILE_LEN)?))
    }

    /// [`RxStateFile::open`], to be shared by the endpoints of several poll threads.
    pub fn open_shared(path: &Path) -> io::Result<Arc<RxStateFile>> {
        RxStateFile::open(path).map(Arc::new)
    }

    /// A state file whose first bytes are `bytes` (fuzz targets and tests).
    #[cfg(any(test, fuzzing))]
    pub fn from_bytes(bytes: &[u8]) -> io::Result<RxStateFile> {
        Ok(RxStateFile::adopt(LockedMap::from_bytes(bytes, FILE_LEN)?))
    }

    /// Checks what `file` holds: a file of the wrong size, magic, version or slot count is
    /// reinitialised, never trusted.
    fn adopt(mut file: LockedMap) -> RxStateFile {
        let (fresh, map) = (file.fresh, &mut file.map);
        let valid = !fresh
            && map[..8] == MAGIC.to_le_bytes()
            && map[8..12] == VERSION.to_le_bytes()
            && map[12..16] == (SLOTS as u32).to_le_bytes();
        if !valid {
            map.fill(0);
            map[..8].copy_from_slice(&MAGIC.to_le_bytes());
            map[8..12].copy_from_slice(&VERSION.to_le_bytes());
            map[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        }
        let f = RxStateFile {
            file,
            used: Mutex::new(0),
        };
        let used = (0..SLOTS)
            .take_while(|&i| f.slot(i).used.load(Ordering::Relaxed) != 0)
            .count();
        *f.claims() = used;
        f
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, usize> {
        // A panic while claiming leaves a consistent count (it is written last).
        self.used.lock()
    }

    /// Connections with a slot.
    pub fn used(&self) -> usize {
        *self.claims()
    }

    fn slot(&self, i: usize) -> &Slot {
        assert!(i < SLOTS);
        // SAFETY: i < SLOTS, so the slot lies inside the mapping; the mapping is page-aligned
        // and HEADER and SLOT_LEN are multiples of 8, so the atomics are aligned; every bit
        // pattern is a valid Slot.
        unsafe { &*(self.file.map.as_ptr().add(HEADER + i * SLOT_LEN) as *const Slot) }
    }

    /// The slot of a connection, claiming a free one for a new connection; `None` when full.
    pub fn slot_for(&self, laddr: u32, faddr: u32) -> Option<usize> {
        let mut used = self.claims();
        if let Some(i) = (0..*used).find(|&i| {
            let s = self.slot(i);
            s.laddr.load(Ordering::Relaxed) == laddr && s.faddr.load(Ordering::Relaxed) == faddr
        }) {
            return Some(i);
        }
        if *used == SLOTS {
            return None;
        }
        let i = *used;
        let s = self.slot(i);
        s.laddr.store(laddr, Ordering::Relaxed);
        s.faddr.store(faddr, Ordering::Relaxed);
        s.peer_generation.store(0, Ordering::Relaxed);
        for q in &s.next_rx_seq {
            q.store(0, Ordering::Relaxed);
        }
        s.used.store(1, Ordering::Release);
        *used += 1;
        Some(i)
    }

    /// What was persisted for a slot: (peer generation, next sequence per path).
    pub fn load(&self, i: usize) -> (u32, [u64; MAX_PATHS]) {
        let s = self.slot(i);
        let seqs = std::array::from_fn(|p| s.next_rx_seq[p].load(Ordering::Relaxed));
        (s.peer_generation.load(Ordering::Relaxed), seqs)
    }

    /// The engine knows the peer's generation `generation` (0 = not yet). A new non-zero value
    /// is stored at once, not at the next delivery: a crash before that delivery must not
    /// restore "unknown", or the peer's next restart would go unnoticed. When it replaces an
    /// older non-zero value the peer restarted, and its old numbers are void.
    #[inline]
    pub fn learned(&self, i: usize, generation: u32) {
        let s = self.slot(i);
        let stored = s.peer_generation.load(Ordering::Relaxed);
        if generation == 0 || generation == stored {
            return;
        }
        if stored != 0 {
            for q in &s.next_rx_seq {
                q.store(0, Ordering::Relaxed);
            }
        }
        s.peer_generation.store(generation, Ordering::Relaxed);
    }

    /// A message with sequence `seq`, accepted while the peer's generation was `generation`,
    /// was delivered on `path`: a load and one or two plain stores.
    #[inline]
    pub fn delivered(&self, i: usize, path: usize, generation: u32, seq: u64) {
        self.learned(i, generation);
        let s = self.slot(i);
        s.next_rx_seq[path % MAX_PATHS].store(seq.saturating_add(1), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_survives_reopen_and_a_second_opener_is_refused() {
        let dir = std::env::temp_dir().join(format!("rdsd-persist-{}", std::process::id()));
        let path = dir.join("rx.state");
        let _ = std::fs::remove_file(&path);
        {
            let f = RxStateFile::open(&path).unwrap();
            let a = f.slot_for(1, 2).unwrap();
            let b = f.slot_for(1, 3).unwrap();
            assert_ne!(a, b);
            assert_eq!(f.slot_for(1, 2), Some(a));
            f.delivered(a, 3, 77, 41);
            f.delivered(b, 0, 9, 5);
            // The peer of b restarted (generation 9 -> 10): its old numbers are void.
            f.learned(b, 10);
            f.delivered(b, 1, 10, 2);
            f.learned(b, 0);
            assert!(
                RxStateFile::open(&path).is_err(),
                "locked by the first opener"
            );
        }
        let f = RxStateFile::open(&path).unwrap();
        let a = f.slot_for(1, 2).unwrap();
        let (gen, seqs) = f.load(a);
        assert_eq!(gen, 77);
        assert_eq!(seqs[3], 42);
        assert_eq!(seqs[0], 0);
        let b = f.slot_for(1, 3).unwrap();
        assert_eq!(f.load(b), (10, [0, 3, 0, 0, 0, 0, 0, 0]));
        drop(f);
        // A scribbled file is reinitialised, not trusted.
        std::fs::write(&path, b"garbage").unwrap();
        let f = RxStateFile::open(&path).unwrap();
        let a = f.slot_for(1, 2).unwrap();
        assert_eq!(f.load(a), (0, [0; MAX_PATHS]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

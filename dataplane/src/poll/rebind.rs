//! The rebind grace: after a restart, messages for a port that an app had bound explicitly in
//! the previous incarnation wait (the path pauses, as for a full ring) until an app binds it
//! again or the grace period ends, instead of being dropped as sent to an unbound port.
//!
//! An app re-attaches and re-binds within milliseconds of the restart, but the peer resends
//! at once: without the grace everything that arrived in between was lost (VM-lab test f1
//! lost 80-100 messages per SIGKILL under a 500 msg/s kernel sender). The ports are a bitmap
//! in a small file next to the receive-state file (`<state_file>` with extension `ports`),
//! written with plain stores when a socket binds or closes, so a SIGKILL keeps it. Ephemeral
//! binds (port 0) are not recorded: no app can expect to get the same port back.

use crate::statefile::LockedMap;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

const WORDS: usize = 65536 / 64;
const FILE_LEN: usize = WORDS * 8;

pub struct BoundPorts {
    file: LockedMap,
    /// Ports bound when the previous incarnation ended.
    before: Box<[u64; WORDS]>,
    /// End of the grace period (`None`: over, or nothing to wait for).
    until: Option<Instant>,
}

fn bit(port: u16) -> (usize, u64) {
    (usize::from(port) / 64, 1u64 << (port % 64))
}

impl BoundPorts {
    /// Opens the file, takes over the previous incarnation's ports, and starts recording ours.
    pub fn open(path: &Path, grace: Duration) -> io::Result<BoundPorts> {
        Ok(BoundPorts::adopt(LockedMap::open(path, FILE_LEN)?, grace))
    }

    /// A ports file whose first bytes are `bytes` (fuzz targets and tests).
    #[cfg(any(test, fuzzing))]
    pub fn from_bytes(bytes: &[u8], grace: Duration) -> io::Result<BoundPorts> {
        Ok(BoundPorts::adopt(
            LockedMap::from_bytes(bytes, FILE_LEN)?,
            grace,
        ))
    }

    fn adopt(mut file: LockedMap, grace: Duration) -> BoundPorts {
        let mut before = Box::new([0u64; WORDS]);
        for (w, chunk) in before.iter_mut().zip(file.map.chunks_exact(8)) {
            *w = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
        }
        file.map.fill(0);
        let waiting = before.iter().any(|&w| w != 0);
        BoundPorts {
            file,
            before,
            until: (waiting && !grace.is_zero()).then(|| Instant::now() + grace),
        }
    }

    /// Ports bound before the restart (for the log).
    pub fn expected(&self) -> usize {
        self.before.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Should a message for unbound `port` wait?
    pub fn holds(&mut self, port: u16) -> bool {
        let Some(until) = self.until else {
            return false;
        };
        if Instant::now() >= until {
            self.until = None;
            return false;
        }
        let (w, b) = bit(port);
        self.before[w] & b != 0
    }

    /// An app bound `port` explicitly.
    pub fn bound(&mut self, port: u16) {
        self.set(port, true);
    }

    /// No socket is bound to `port` any more.
    pub fn unbound(&mut self, port: u16) {
        self.set(port, false);
        let (w, b) = bit(port);
        // Closed again after the restart: nothing to wait for on it.
        self.before[w] &= !b;
    }

    fn set(&mut self, port: u16, on: bool) {
        let (w, b) = bit(port);
        let at = w * 8;
        let word = &mut self.file.map[at..at + 8];
        let mut v = u64::from_ne_bytes((&*word).try_into().expect("8 bytes"));
        if on {
            v |= b;
        } else {
            v &= !b;
        }
        word.copy_from_slice(&v.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_bound_before_a_restart_wait_for_the_grace_period() {
        let dir = std::env::temp_dir().join(format!("rdsd-rebind-{}", std::process::id()));
        let path = dir.join("t.ports");
        let _ = std::fs::remove_file(&path);
        let mut first = BoundPorts::open(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(first.expected(), 0);
        assert!(!first.holds(7000), "a fresh file holds nothing");
        first.bound(7000);
        first.bound(7001);
        first.unbound(7001);
        first.bound(65535);
        drop(first); // as if killed: the file keeps the bits
        let mut second = BoundPorts::open(&path, Duration::from_millis(300)).unwrap();
        assert_eq!(second.expected(), 2);
        assert!(second.holds(7000));
        assert!(second.holds(65535));
        assert!(!second.holds(7001), "closed before the restart");
        assert!(!second.holds(7002));
        // A socket that binds and closes again after the restart ends the wait for its port.
        second.bound(65535);
        second.unbound(65535);
        assert!(!second.holds(65535));
        std::thread::sleep(Duration::from_millis(350));
        assert!(!second.holds(7000), "the grace period is over");
        drop(second);
        // The second incarnation bound nothing that stayed: a third expects nothing.
        let third = BoundPorts::open(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(third.expected(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Zero-copy sends: tx-ring records a transport sends in place, straight from the app's
//! region, and the ring space they pin until the peer acknowledges them.
//!
//! A record offered in place gets a *hold*: a slab entry whose index is the message's token
//! (with [`IN_PLACE`] set). If the transport takes it in place, the hold joins its socket's
//! FIFO and the ring's consumer releases space only up to the oldest unreleased hold (holds of
//! one socket can be released out of order: different peers, different paths). The app's
//! region and the socket's slot are pinned as long as holds on them are out: a closed socket's
//! slot is not reused, and a departed app's region stays mapped ("draining") until its last
//! hold is released. Fixed capacities: when the slab or a socket's FIFO is full, the message is
//! simply copied, as for transports without zero copy.

use super::sock_ref::SockRef;

/// Marks a token as a hold index rather than a socket reference (`token_of` never sets it).
pub(super) const IN_PLACE: u64 = 1 << 63;
/// Holds per poll core (each a message sent in place and not yet acknowledged).
pub(super) const MAX_HOLDS: usize = 16 * 1024;
/// Holds per socket (its FIFO is allocated at open).
pub(super) const SOCK_HOLDS: usize = 512;
// Regions of departed apps kept mapped for their in-place messages, per poll thread: at most
// `max_apps` in all (`SocketTable::max_draining`) and at most `max_regions_per_uid` of one uid
// (root: no per-uid cap), so that apps that leave messages to an unreachable peer and exit
// cannot pile up regions: draining at most doubles what one user's attached apps may hold.
// Past either cap, a departing app's outstanding in-place messages are cancelled instead (what
// Linux RDS does to the queue of every closed socket). The cap was 8 regions while only RDMA
// sent in place; with TCP in place too, 8 cancelled the last messages of the 9th of many ranks
// that exit together (an MPI job's end).

/// One message offered in place.
#[derive(Clone, Copy, Debug)]
pub(super) struct Hold {
    /// The region (attach id) its bytes are in.
    pub region: u64,
    pub sock: SockRef,
    pub gen: u32,
    /// Ring position of its record.
    pub pos: u64,
    /// Taken in place (in its socket's FIFO, pinning slot and region); false: copied.
    pub placed: bool,
    /// Released, waiting to leave the FIFO behind older holds.
    pub done: bool,
}

/// The slab of holds.
pub(super) struct Holds {
    slots: Vec<Hold>,
    free: Vec<u32>,
}

impl Holds {
    pub fn new() -> Holds {
        let empty = Hold {
            region: 0,
            sock: SockRef { app: 0, slot: 0 },
            gen: 0,
            pos: 0,
            placed: false,
            done: false,
        };
        Holds {
            slots: vec![empty; MAX_HOLDS],
            free: (0..MAX_HOLDS as u32).rev().collect(),
        }
    }

    /// A new hold, or `None` when the slab is full (the message is then copied).
    pub fn take(&mut self, h: Hold) -> Option<u32> {
        let i = self.free.pop()?;
        self.slots[i as usize] = h;
        Some(i)
    }

    pub fn get(&self, i: u32) -> &Hold {
        &self.slots[i as usize]
    }

    pub fn get_mut(&mut self, i: u32) -> &mut Hold {
        &mut self.slots[i as usize]
    }

    pub fn put(&mut self, i: u32) {
        debug_assert!(!self.free.contains(&i));
        self.free.push(i);
    }

    /// Holds out.
    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        MAX_HOLDS - self.free.len()
    }
}

/// The hold index a token carries, if it is an in-place token.
pub(super) fn hold_of_token(token: u64) -> Option<u32> {
    (token & IN_PLACE != 0).then_some((token & 0xffff_ffff) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_hands_out_each_index_once_and_refuses_when_full() {
        let mut h = Holds::new();
        let proto = *h.get(0);
        let mut seen = std::collections::HashSet::new();
        while let Some(i) = h.take(proto) {
            assert!(seen.insert(i));
        }
        assert_eq!(seen.len(), MAX_HOLDS);
        assert_eq!(h.in_use(), MAX_HOLDS);
        h.put(7);
        assert_eq!(h.take(proto), Some(7));
        assert_eq!(hold_of_token(IN_PLACE | 7), Some(7));
        assert_eq!(hold_of_token(7), None);
    }
}

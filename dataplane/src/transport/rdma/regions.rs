//! The app regions that every poll thread's RDMA link may send from.
//!
//! Each poll thread registers its own apps' regions (at attach) on the devices' PDs, which
//! all threads share. A large message from an app of one thread to a connection that another
//! thread owns crosses as a reference into the sender's tx ring (`SendRef`); the owner's QP
//! sends it from there only if it knows the region's lkey for its device. The registering
//! thread publishes each region's keys here ([`RegionDirectory`]); the others keep a
//! [`RegionReplica`] that they refresh when the directory's version moved (one load per
//! lookup; a copy of the list, under the lock, only after an attach or a detach).
//!
//! Why a lookup is never stale: a region is withdrawn (detach) before it is unmapped, and
//! published before its app can send from it, so a replica refreshed at a lookup, after the
//! message that is looked up was sent, holds exactly the regions that are mapped and
//! registered then; the message's own region stays registered until its send completed and
//! the peer acknowledged it (its hold on the tx ring).

use crate::quiet::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// One region's keys: its range, and its lkey on each device (by context).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionKeys {
    pub id: u64,
    pub base: usize,
    pub len: usize,
    /// (device context, lkey).
    pub keys: Vec<(usize, u32)>,
}

impl RegionKeys {
    fn contains(&self, p: usize, len: usize) -> bool {
        p >= self.base
            && p.checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }

    fn lkey(&self, ctx: usize) -> Option<u32> {
        self.keys.iter().find(|(c, _)| *c == ctx).map(|&(_, k)| k)
    }
}

/// Every thread's registered app regions.
#[derive(Debug, Default)]
pub struct RegionDirectory {
    list: Mutex<Vec<RegionKeys>>,
    /// Moves on with every change; a replica whose copy is older refreshes.
    version: AtomicU64,
}

impl RegionDirectory {
    /// Publishes a region's keys (or replaces them: a device added later).
    pub fn publish(&self, r: RegionKeys) {
        let mut l = self.list.lock();
        l.retain(|o| o.id != r.id);
        l.push(r);
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Withdraws region `id` (before it is unmapped).
    pub fn withdraw(&self, id: u64) {
        let mut l = self.list.lock();
        let before = l.len();
        l.retain(|o| o.id != id);
        if l.len() != before {
            self.version.fetch_add(1, Ordering::Release);
        }
    }
}

/// One thread's copy of the directory, sorted by address.
#[derive(Debug, Default)]
pub struct RegionReplica {
    version: u64,
    list: Vec<RegionKeys>,
}

impl RegionReplica {
    /// The region holding all of `p..p + len`, from a copy as new as `dir`.
    pub fn find(&mut self, dir: &RegionDirectory, p: *const u8, len: usize) -> Option<&RegionKeys> {
        let v = dir.version.load(Ordering::Acquire);
        if v != self.version {
            // Cold: after an attach or a detach on some thread.
            let l = dir.list.lock();
            self.list.clone_from(&l);
            self.version = dir.version.load(Ordering::Acquire);
            drop(l);
            self.list.sort_unstable_by_key(|r| r.base);
        }
        let p = p as usize;
        // The last region starting at or below `p` (regions never overlap: each is a mapping).
        let i = self.list.partition_point(|r| r.base <= p).checked_sub(1)?;
        let r = &self.list[i];
        r.contains(p, len).then_some(r)
    }

    /// The lkey on device `ctx` of the region holding all of `p..p + len`.
    pub fn lkey(
        &mut self,
        dir: &RegionDirectory,
        p: *const u8,
        len: usize,
        ctx: usize,
    ) -> Option<u32> {
        self.find(dir, p, len)?.lkey(ctx)
    }

    /// True if `p..p + len` lies in a region registered on every one of `ctxs`.
    pub fn covers(
        &mut self,
        dir: &RegionDirectory,
        p: *const u8,
        len: usize,
        mut ctxs: impl Iterator<Item = usize>,
    ) -> bool {
        self.find(dir, p, len)
            .is_some_and(|r| ctxs.all(|c| r.lkey(c).is_some()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(id: u64, base: usize, len: usize, ctxs: &[usize]) -> RegionKeys {
        RegionKeys {
            id,
            base,
            len,
            keys: ctxs
                .iter()
                .map(|&c| (c, 1000 * id as u32 + c as u32))
                .collect(),
        }
    }

    #[test]
    fn a_replica_finds_what_is_published_and_nothing_withdrawn() {
        let dir = RegionDirectory::default();
        let mut rep = RegionReplica::default();
        let at = |a: usize| a as *const u8;
        assert_eq!(rep.lkey(&dir, at(0x1000), 8, 7), None, "nothing published");
        dir.publish(keys(1, 0x10_000, 0x1000, &[7]));
        dir.publish(keys(2, 0x30_000, 0x1000, &[7, 9]));
        assert_eq!(
            rep.lkey(&dir, at(0x10_000), 0x1000, 7),
            Some(1007),
            "the whole region"
        );
        assert_eq!(rep.lkey(&dir, at(0x30_800), 16, 9), Some(2009));
        assert_eq!(
            rep.lkey(&dir, at(0x10_800), 0x1000, 7),
            None,
            "past its end"
        );
        assert_eq!(rep.lkey(&dir, at(0x20_000), 8, 7), None, "between regions");
        assert_eq!(
            rep.lkey(&dir, at(0x0_f000), 8, 7),
            None,
            "below every region"
        );
        assert_eq!(
            rep.lkey(&dir, at(usize::MAX - 4), 8, 7),
            None,
            "no overflow"
        );
        assert_eq!(
            rep.lkey(&dir, at(0x10_000), 8, 9),
            None,
            "not on that device"
        );
        assert!(rep.covers(&dir, at(0x30_000), 8, [7, 9].into_iter()));
        assert!(!rep.covers(&dir, at(0x10_000), 8, [7, 9].into_iter()));
        // Withdrawn, then another region mapped at the same address: the replica, asked
        // again, knows only the new one.
        dir.withdraw(1);
        assert_eq!(rep.lkey(&dir, at(0x10_000), 8, 7), None, "withdrawn");
        dir.publish(keys(3, 0x10_000, 0x2000, &[7]));
        assert_eq!(rep.lkey(&dir, at(0x11_000), 8, 7), Some(3007));
        // A device added later: the region's keys replaced, not duplicated.
        dir.publish(keys(3, 0x10_000, 0x2000, &[7, 9]));
        assert_eq!(rep.lkey(&dir, at(0x11_000), 8, 9), Some(3009));
        assert_eq!(rep.list.len(), 2);
        let v = dir.version.load(Ordering::Relaxed);
        dir.withdraw(42);
        assert_eq!(
            dir.version.load(Ordering::Relaxed),
            v,
            "withdrawing nothing changes nothing"
        );
    }
}

//! The commit point of a multicast fan-out, shared by rdsd (the writer) and the library (the
//! reader): a group copy in a member's rx ring may be read only once the fan-out that pushed it
//! is committed, so that rdsd dying between two members' publishes leaves the message read by
//! nobody.
//!
//! Per member slot, [`GATES`] gate entries, each naming one group copy: `end` (the ring
//! position just past it) and `stamp` (the number of the fan-out that pushed it), used in
//! turn; per rdsd, `commit` (every fan-out up to it has all its copies published). The writer,
//! for fan-out `g`: for each member, push the copy, [`gate`] it in the slot's next entry,
//! publish the ring; once every copy of `g` and of every fan-out before it is published,
//! [`commit`]`(g)`. At most [`GATES`] fan-outs are uncommitted at once, so an entry is taken
//! again only when the copy it named is committed, and [`pending`] is exact: a record is
//! pending if an entry names it with a stamp above the commit; if none names it any more, its
//! entry was taken again after its commit. Generic over the atomics so that loom checks it
//! (`tests/loom_ring.rs`, `group_gate_*`).

use crate::sync::{AtomicU64, Ordering};

/// Gate entries per slot: how many fan-outs may be uncommitted at once (a fan-out whose
/// copies cross poll threads waits a thread round trip for its commit; the next ones need not).
pub const GATES: usize = 8;

/// One gate entry: a group copy and its fan-out.
#[cfg_attr(not(loom), repr(C))]
pub struct Gate {
    /// Ring position just past the copy. Stored before `stamp`.
    pub end: AtomicU64,
    /// The fan-out that pushed it.
    pub stamp: AtomicU64,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            end: AtomicU64::new(0),
            stamp: AtomicU64::new(0),
        }
    }
}

/// Names the copy just pushed (ending at ring position `end`) as fan-out `stamp`'s, in entry
/// `gate`, before the ring is published. End first: a reader that sees a newer stamp in the
/// entry sees its newer end, and a newer end means the entry's previous copy was committed.
#[inline]
pub fn gate(gate: &Gate, end: u64, stamp: u64) {
    gate.end.store(end, Ordering::Release);
    gate.stamp.store(stamp, Ordering::Release);
}

/// Makes every copy of fan-out `stamp`, and of every fan-out before it, readable (after all
/// their copies are published).
#[inline]
pub fn commit(commit_word: &AtomicU64, stamp: u64) {
    commit_word.store(stamp, Ordering::Release);
}

/// Whether the group copy whose record ends at `record_end` (seen published) is uncommitted:
/// an entry names it with a stamp above the commit. Stamp before end in each entry: a stamp
/// newer than the copy's comes with a newer end (stored before it, both with release).
#[inline]
pub fn pending(gates: &[Gate], commit_word: &AtomicU64, record_end: u64) -> bool {
    for g in gates {
        let stamp = g.stamp.load(Ordering::Acquire);
        let end = g.end.load(Ordering::Acquire);
        if end == record_end {
            return stamp > commit_word.load(Ordering::Acquire);
        }
    }
    false
}

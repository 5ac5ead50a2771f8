//! The commit point of a multicast fan-out, shared by rdsd (the writer) and the library (the
//! reader): a group copy in a member's rx ring may be read only once the fan-out that pushed it
//! is committed, so that rdsd dying between two members' publishes leaves the message read by
//! nobody.
//!
//! Three words: per member slot, `end` (the ring position just past the slot's last group
//! copy) and `stamp` (the number of the fan-out that pushed it); per rdsd, `commit` (the last
//! fan-out whose copies are all published). The writer, for fan-out `g`: for each member,
//! push the copy, [`gate`] it, publish the ring; then [`commit`]`(g)`; and only then starts
//! fan-out `g + 1`. So only a slot's last copy can be uncommitted, and [`pending`] is exact.
//! Generic over the atomics so that loom checks it (`tests/loom_ring.rs`, `group_gate_*`).

use crate::sync::{AtomicU64, Ordering};

/// Names the copy just pushed (ending at ring position `end`) as fan-out `stamp`'s, before
/// the ring is published. End first: a reader that sees a newer end sees everything the
/// writer did before it, the previous fan-out's commit included.
#[inline]
pub fn gate(end_word: &AtomicU64, stamp_word: &AtomicU64, end: u64, stamp: u64) {
    end_word.store(end, Ordering::Release);
    stamp_word.store(stamp, Ordering::Release);
}

/// Makes every copy of fan-out `stamp` readable (after every member's ring is published).
#[inline]
pub fn commit(commit_word: &AtomicU64, stamp: u64) {
    commit_word.store(stamp, Ordering::Release);
}

/// Whether the group copy whose record ends at `record_end` (seen published) is uncommitted:
/// it is its slot's gated copy and its stamp is above the commit. A stamp newer than the
/// record's comes with a newer end (stored before it, both with release), and a newer end
/// means the record's own fan-out was committed before it.
#[inline]
pub fn pending(
    end_word: &AtomicU64,
    stamp_word: &AtomicU64,
    commit_word: &AtomicU64,
    record_end: u64,
) -> bool {
    let stamp = stamp_word.load(Ordering::Acquire);
    let end = end_word.load(Ordering::Acquire);
    end == record_end && stamp > commit_word.load(Ordering::Acquire)
}

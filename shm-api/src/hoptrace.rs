//! The latency-breakdown trace block (issue 17): where a message spends its time, hop by hop.
//!
//! A benchmark that wants the breakdown (`rds-bench --breakdown`) ends each message with a
//! 40-byte block: a magic word and four `CLOCK_MONOTONIC` nanosecond stamps. The sending app
//! writes the magic and [`Slot::AppSend`]; an rdsd started with `trace_hops` stamps
//! [`Slot::Pickup`] when its poll core takes the message from the sender's tx ring and
//! [`Slot::Deliver`] when its poll core has copied it into the receiver's rx ring; the
//! receiving app reads the clock once more. All stamps come from one clock, so the hops are
//! exact between namespaces of one host (the benchmark's setup); across hosts they need
//! synchronised clocks. rdsd looks at the last 40 bytes only when `trace_hops` is on and
//! changes nothing else: without the magic a message is left alone.

/// Bytes of the block at the end of a traced message.
pub const BLOCK: usize = 40;
/// The first word of a block, little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RDSHOP01");

/// A stamp in the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The sending app, just before its `send`.
    AppSend = 1,
    /// The sender's rdsd: its poll core took the message from the tx ring.
    Pickup = 2,
    /// The receiver's rdsd: the message is in the receiver's rx ring (before publishing).
    Deliver = 3,
}

/// Offset of `slot` in a message of `len` bytes (which must be at least [`BLOCK`]).
pub fn offset(len: usize, slot: Slot) -> usize {
    len - BLOCK + 8 * slot as usize
}

/// Nanoseconds of `CLOCK_MONOTONIC` (a vDSO call, no syscall).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into our struct.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Starts a block at the end of `msg`: the magic, `AppSend` = `t`, the other stamps 0.
/// False (and nothing written) if `msg` is shorter than a block.
pub fn begin(msg: &mut [u8], t: u64) -> bool {
    let Some(at) = msg.len().checked_sub(BLOCK) else {
        return false;
    };
    msg[at..at + 8].copy_from_slice(&MAGIC.to_le_bytes());
    msg[at + 8..at + 16].copy_from_slice(&t.to_le_bytes());
    msg[at + 16..].fill(0);
    true
}

/// The stamps of a traced message (`[AppSend, Pickup, Deliver]`), if it carries a block.
pub fn read(msg: &[u8]) -> Option<[u64; 3]> {
    let at = msg.len().checked_sub(BLOCK)?;
    let word = |i: usize| u64::from_le_bytes(msg[at + 8 * i..at + 8 * i + 8].try_into().unwrap());
    (word(0) == MAGIC).then(|| [word(1), word(2), word(3)])
}

/// Stamps `slot` with the current time if the `len` bytes at `ptr` end with a block.
///
/// # Safety
/// `ptr..ptr + len` must be mapped and writable for this call. The bytes may be shared with
/// another process (an app's ring): they are only copied, never referenced, so a concurrent
/// writer can spoil the stamp but not rdsd.
pub unsafe fn stamp_shared(ptr: *mut u8, len: usize, slot: Slot) {
    if len < BLOCK {
        return;
    }
    let mut magic = [0u8; 8];
    // SAFETY: `len >= BLOCK`, so the magic word lies inside the caller's mapped range.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(len - BLOCK), magic.as_mut_ptr(), 8) };
    if u64::from_le_bytes(magic) != MAGIC {
        return;
    }
    let t = now_ns().to_le_bytes();
    // SAFETY: the slot's 8 bytes lie inside the block, inside the caller's writable range.
    unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), ptr.add(offset(len, slot)), 8) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_begun_stamped_and_read_back() {
        let mut m = vec![7u8; 64];
        assert!(begin(&mut m, 11));
        assert_eq!(read(&m), Some([11, 0, 0]));
        // SAFETY: `m` is our own buffer of 64 bytes.
        unsafe { stamp_shared(m.as_mut_ptr(), m.len(), Slot::Pickup) };
        // SAFETY: as above.
        unsafe { stamp_shared(m.as_mut_ptr(), m.len(), Slot::Deliver) };
        let [a, p, d] = read(&m).unwrap();
        assert_eq!(a, 11);
        assert!(p > 0 && d >= p);
        assert!(
            m[..24].iter().all(|&b| b == 7),
            "bytes before the block are untouched"
        );
    }

    #[test]
    fn messages_without_a_block_are_left_alone() {
        let mut short = vec![1u8; BLOCK - 1];
        assert!(!begin(&mut short, 5));
        // SAFETY: our own buffer.
        unsafe { stamp_shared(short.as_mut_ptr(), short.len(), Slot::Pickup) };
        assert!(short.iter().all(|&b| b == 1));
        let mut plain = vec![2u8; 64];
        // SAFETY: our own buffer.
        unsafe { stamp_shared(plain.as_mut_ptr(), plain.len(), Slot::Deliver) };
        assert!(plain.iter().all(|&b| b == 2));
        assert_eq!(read(&plain), None);
    }
}

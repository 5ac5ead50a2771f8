//! Single-producer / single-consumer ring of variable-length records, built to live in memory
//! shared by two processes that do not trust each other.
//!
//! * Positions are monotonic `u64` byte counters (never pointers), so the ring means the same in
//!   every address space and a wrapped index can't be confused with an empty ring.
//! * The producer and consumer counters sit on their own 128-byte lines (no false sharing, even
//!   with the adjacent-line prefetcher).
//! * Records are `[RecordHeader (16 B)][payload][pad to 16 B]` and never straddle the end of the
//!   data area: a `PAD` record fills the tail instead. With 16-byte alignment every gap at the end
//!   is at least one header long.
//! * Batching: `push` and `consume` only move private cursors; `publish` / `release` make a whole
//!   batch visible with one release store.
//! * The consumer copies the header out, then checks it against the published producer position
//!   before trusting any length. A peer that scribbles on the ring gets [`RingCorrupt`], never an
//!   out-of-bounds access.
//!
//! The algorithm is generic over [`RingMemory`] so the same code runs on a shared mapping
//! ([`RawRing`]), in Miri on the heap, and under loom (see `tests/loom_ring.rs`).

use crate::sync::{AtomicU64, Ordering};

/// Bytes of every record header.
pub const RECORD_HEADER_LEN: usize = 16;
/// Alignment of every record.
pub const RECORD_ALIGN: usize = 16;

/// A message record.
pub const KIND_DATA: u16 = 1;
/// Filler that skips to the end of the data area.
pub const KIND_PAD: u16 = 2;

/// Fixed header in front of every record. Little-endian on the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordHeader {
    /// Payload length in bytes.
    pub len: u32,
    /// `KIND_DATA` or `KIND_PAD`.
    pub kind: u16,
    /// Per-direction flags (see `layout`).
    pub flags: u16,
    /// IPv4 address in host order: destination on tx rings, source on rx rings.
    pub addr: u32,
    /// RDS port: destination on tx rings, source on rx rings.
    pub port: u16,
    /// Spare; zero today.
    pub aux: u16,
}

impl RecordHeader {
    /// A data record header.
    pub fn data(len: u32, addr: u32, port: u16) -> Self {
        RecordHeader {
            len,
            kind: KIND_DATA,
            flags: 0,
            addr,
            port,
            aux: 0,
        }
    }

    #[inline]
    fn to_bytes(self) -> [u8; RECORD_HEADER_LEN] {
        let mut b = [0u8; RECORD_HEADER_LEN];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4..6].copy_from_slice(&self.kind.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.addr.to_le_bytes());
        b[12..14].copy_from_slice(&self.port.to_le_bytes());
        b[14..16].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    #[inline]
    fn from_bytes(b: &[u8; RECORD_HEADER_LEN]) -> Self {
        RecordHeader {
            len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            kind: u16::from_le_bytes([b[4], b[5]]),
            flags: u16::from_le_bytes([b[6], b[7]]),
            addr: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            port: u16::from_le_bytes([b[12], b[13]]),
            aux: u16::from_le_bytes([b[14], b[15]]),
        }
    }
}

/// Bytes a record with `payload_len` bytes of payload takes on the ring.
pub const fn record_size(payload_len: usize) -> usize {
    RECORD_HEADER_LEN + ((payload_len + RECORD_ALIGN - 1) & !(RECORD_ALIGN - 1))
}

/// Where a ring's counters and bytes live.
pub trait RingMemory {
    /// Bytes produced so far (written by the producer only).
    fn producer(&self) -> &AtomicU64;
    /// Bytes consumed so far (written by the consumer only).
    fn consumer(&self) -> &AtomicU64;
    /// Size of the data area: a power of two, a multiple of [`RECORD_ALIGN`].
    fn capacity(&self) -> usize;
    /// Copies `src` to `off` in the data area. Callers guarantee `off + src.len() <= capacity`.
    fn write(&self, off: usize, src: &[u8]);
    /// Copies from `off` in the data area into `dst`. Callers guarantee the range is in bounds.
    fn read(&self, off: usize, dst: &mut [u8]);
}

/// Why a push did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushError {
    /// Not enough free space now; retry after the consumer releases.
    Full,
    /// The record can never fit in this ring.
    TooLarge,
}

/// The peer broke the ring protocol; the ring can't be used any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingCorrupt(pub &'static str);

impl std::fmt::Display for RingCorrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ring corrupt: {}", self.0)
    }
}

/// The writing end. Exactly one per ring.
pub struct Producer<M: RingMemory> {
    mem: M,
    head: u64,
    cached_tail: u64,
}

impl<M: RingMemory> Producer<M> {
    /// Takes the producing end of `mem`, continuing from its published position.
    ///
    /// Both counters live in memory the peer can write, so they are validated like everything
    /// else: a misaligned producer position, or a consumer position that is not within one
    /// capacity behind it, leaves the ring permanently "full" (every push answers
    /// [`PushError::Full`]) instead of letting `push` index outside a record slot.
    pub fn new(mem: M) -> Self {
        let head = mem.producer().load(Ordering::Relaxed);
        // Start with no free space: `refresh_tail` only adopts a consumer position it validated.
        let cached_tail = head.wrapping_sub(mem.capacity() as u64);
        let mut p = Producer {
            mem,
            head,
            cached_tail,
        };
        let _ = p.refresh_tail();
        p
    }

    /// The memory behind this ring.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    fn refresh_tail(&mut self) -> Result<(), PushError> {
        let tail = self.mem.consumer().load(Ordering::Acquire);
        // A consumer can't be ahead of what was produced; treat nonsense as "no space". A
        // misaligned head (only possible if the peer scribbled the producer counter before
        // `new`) would let a record or pad straddle the end of the data area: also "no space".
        if self.head.wrapping_sub(tail) > self.mem.capacity() as u64
            || !self.head.is_multiple_of(RECORD_ALIGN as u64)
        {
            return Err(PushError::Full);
        }
        self.cached_tail = tail;
        Ok(())
    }

    fn free(&self) -> usize {
        // Positions are free-running u64 counters: wrapping arithmetic throughout (the
        // invariant `head - cached_tail <= capacity` holds modulo 2^64).
        self.mem.capacity() - self.head.wrapping_sub(self.cached_tail) as usize
    }

    /// Bytes free for records right now (refreshing the consumer position).
    pub fn free_bytes(&mut self) -> usize {
        if self.refresh_tail().is_err() {
            return 0;
        }
        self.free()
    }

    /// Whether [`push_with`](Self::push_with) would take a record of `payload_len` bytes now
    /// (the pad it may need at the end of the ring included). A multicast fan-out asks this of
    /// every member before it writes to any, so that its pushes all succeed.
    ///
    /// The consumer's position is read only when the space last seen is too small: it lives on
    /// the consumer's cache line, and a fan-out asks every member.
    pub fn fits(&mut self, payload_len: usize) -> bool {
        if record_size(payload_len) > self.mem.capacity() {
            return false;
        }
        let need = self.room_needed(payload_len);
        self.free() >= need || (self.refresh_tail().is_ok() && self.free() >= need)
    }

    /// [`fits`](Self::fits) with `keep` bytes left free after the push: rdsd keeps that much
    /// of a group member's ring for copies it promised the thread that orders the groups.
    pub fn fits_leaving(&mut self, payload_len: usize, keep: usize) -> bool {
        if keep == 0 {
            return self.fits(payload_len);
        }
        let need = self.room_needed(payload_len).saturating_add(keep);
        need <= self.mem.capacity()
            && (self.free() >= need || (self.refresh_tail().is_ok() && self.free() >= need))
    }

    /// Free bytes a push of `payload_len` bytes needs from the current position, the pad at
    /// the end of the ring included: what [`fits`](Self::fits) compares with the free space.
    pub fn room_needed(&self, payload_len: usize) -> usize {
        let cap = self.mem.capacity();
        let total = record_size(payload_len);
        let to_end = cap - ((self.head as usize) & (cap - 1));
        if total > to_end {
            to_end + total
        } else {
            total
        }
    }

    /// True if nothing pushed is still unconsumed (as far as the consumer has released).
    pub fn is_drained(&mut self) -> bool {
        self.refresh_tail().is_ok() && self.cached_tail == self.head
    }

    /// Appends a record whose payload is written by `fill(memory, offset)`. Not visible to the
    /// consumer until [`publish`](Self::publish). A `Full` answer publishes everything pushed
    /// before it: a producer that is full is about to wait, and the consumer must see the batch
    /// (and any pad written to make room) to free space.
    ///
    /// Inlined into the poll loop: the common case (the record fits before the end of the lap,
    /// in space already known free) is a few instructions; the rest is [`Self::make_room`].
    #[inline]
    pub fn push_with(
        &mut self,
        header: RecordHeader,
        fill: impl FnOnce(&M, usize),
    ) -> Result<(), PushError> {
        let cap = self.mem.capacity();
        let total = record_size(header.len as usize);
        let idx = (self.head as usize) & (cap - 1);
        if total > cap - idx || self.free() < total {
            self.make_room(total)?;
        }
        let idx = (self.head as usize) & (cap - 1);
        self.mem.write(idx, &header.to_bytes());
        fill(&self.mem, idx + RECORD_HEADER_LEN);
        self.head = self.head.wrapping_add(total as u64);
        Ok(())
    }

    /// [`Self::push_with`]'s slow path: pads to the end of the lap and refreshes the
    /// consumer's position until `total` bytes fit at the head.
    #[cold]
    #[inline(never)]
    fn make_room(&mut self, total: usize) -> Result<(), PushError> {
        let cap = self.mem.capacity();
        if total > cap {
            return Err(PushError::TooLarge);
        }
        let idx = (self.head as usize) & (cap - 1);
        let to_end = cap - idx;
        if total > to_end {
            // Fill the tail with a PAD record first; it becomes reclaimable on its own, so a
            // record of up to `cap` bytes always fits eventually.
            if self.free() < to_end {
                self.refresh_tail()?;
                if self.free() < to_end {
                    self.publish();
                    return Err(PushError::Full);
                }
            }
            let pad = RecordHeader {
                len: (to_end - RECORD_HEADER_LEN) as u32,
                kind: KIND_PAD,
                ..RecordHeader::default()
            };
            self.mem.write(idx, &pad.to_bytes());
            self.head = self.head.wrapping_add(to_end as u64);
            if self.free() < total {
                self.refresh_tail()?;
                if self.free() < total {
                    self.publish();
                    return Err(PushError::Full);
                }
            }
        } else if self.free() < total {
            self.refresh_tail()?;
            if self.free() < total {
                self.publish();
                return Err(PushError::Full);
            }
        }
        Ok(())
    }

    /// Appends a record carrying `payload` (`header.len` is set from it).
    #[inline]
    pub fn push(&mut self, mut header: RecordHeader, payload: &[u8]) -> Result<(), PushError> {
        header.len = u32::try_from(payload.len()).map_err(|_| PushError::TooLarge)?;
        self.push_with(header, |mem, off| mem.write(off, payload))
    }

    /// Position just past the last record pushed (published or not; monotonic).
    pub fn position(&self) -> u64 {
        self.head
    }

    /// Makes everything pushed so far visible to the consumer.
    pub fn publish(&mut self) {
        self.mem.producer().store(self.head, Ordering::Release);
    }
}

/// A record seen by the consumer. Its payload stays in the ring until consumed and released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The header, copied out and validated.
    pub header: RecordHeader,
    /// Offset of the payload in the data area.
    pub payload_offset: usize,
    next: u64,
}

impl Record {
    /// Ring position just past this record (monotonic, comparable with producer positions).
    pub fn end(&self) -> u64 {
        self.next
    }
}

impl<M: RingMemory> Producer<M> {
    /// The headers of the data records published and not yet released by the consumer,
    /// oldest first, at most `max` (introspection: `RDS_INFO_RECV_MESSAGES`). The consumer's
    /// position and the bytes are the peer's to write: an out-of-range or misaligned position
    /// lists nothing, and a record that does not parse ends the list.
    pub fn unconsumed(&self, max: usize, mut f: impl FnMut(&RecordHeader)) {
        let cap = self.mem.capacity();
        let head = self.mem.producer().load(Ordering::Acquire);
        let mut pos = self.mem.consumer().load(Ordering::Acquire);
        if head.wrapping_sub(pos) > cap as u64 || !pos.is_multiple_of(RECORD_ALIGN as u64) {
            return;
        }
        let mut n = 0;
        while pos != head && n < max {
            let idx = (pos as usize) & (cap - 1);
            let to_end = cap - idx;
            let avail = head.wrapping_sub(pos) as usize;
            let mut raw = [0u8; RECORD_HEADER_LEN];
            self.mem.read(idx, &mut raw);
            let header = RecordHeader::from_bytes(&raw);
            let step = match header.kind {
                KIND_PAD if header.len as usize + RECORD_HEADER_LEN == to_end => to_end,
                KIND_DATA => {
                    let total = record_size(header.len as usize);
                    if header.len as usize > cap || total > to_end {
                        return;
                    }
                    f(&header);
                    n += 1;
                    total
                }
                _ => return,
            };
            if step > avail {
                return;
            }
            pos = pos.wrapping_add(step as u64);
        }
    }
}

/// The reading end. Exactly one per ring.
pub struct Consumer<M: RingMemory> {
    mem: M,
    tail: u64,
    cached_head: u64,
    /// Start of the oldest consumed record still in use in place (a zero-copy send reads it
    /// until the peer acknowledges it): space from here on is not handed back.
    held_from: Option<u64>,
}

impl<M: RingMemory> Consumer<M> {
    /// Takes the consuming end of `mem`, continuing from its released position.
    pub fn new(mem: M) -> Self {
        let tail = mem.consumer().load(Ordering::Relaxed);
        Consumer {
            mem,
            tail,
            cached_head: tail,
            held_from: None,
        }
    }

    /// The memory behind this ring.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    fn refresh_head(&mut self) -> Result<(), RingCorrupt> {
        let head = self.mem.producer().load(Ordering::Acquire);
        let avail = head.wrapping_sub(self.tail);
        if avail > self.mem.capacity() as u64 {
            return Err(RingCorrupt("producer position out of range"));
        }
        if !avail.is_multiple_of(RECORD_ALIGN as u64) {
            return Err(RingCorrupt("producer position misaligned"));
        }
        // `tail` comes from the shared consumer counter when `new` attaches, so the peer may
        // have made it misaligned; a header read at a misaligned tail could run past the end of
        // the data area (fewer than RECORD_HEADER_LEN bytes left before the wrap).
        if !self.tail.is_multiple_of(RECORD_ALIGN as u64) {
            return Err(RingCorrupt("consumer position misaligned"));
        }
        self.cached_head = head;
        Ok(())
    }

    /// True when the producer has published nothing past this consumer's position: one load
    /// of its position, validated by nobody (a [`peek`](Self::peek) validates what there is).
    /// For a poll loop over many rings, most of them empty most of the time.
    #[inline]
    pub fn nothing_published(&self) -> bool {
        self.mem.producer().load(Ordering::Relaxed) == self.tail
    }

    /// The next record, if one is published. Skips padding. Validates everything it reads.
    ///
    /// Bounded work whatever the peer does: the published position is read at most once per
    /// call, so a producer that keeps publishing PAD records (each skips to the end of a lap)
    /// can't keep this loop spinning; what it published meanwhile is seen by the next call.
    ///
    /// Inlined into the poll loop: a data record already known published is a few checks; an
    /// empty view, a pad or a bad record is [`Self::peek_slow`].
    #[inline]
    pub fn peek(&mut self) -> Result<Option<Record>, RingCorrupt> {
        if self.cached_head != self.tail {
            let cap = self.mem.capacity();
            let avail = self.cached_head.wrapping_sub(self.tail) as usize;
            let idx = (self.tail as usize) & (cap - 1);
            let mut raw = [0u8; RECORD_HEADER_LEN];
            self.mem.read(idx, &mut raw);
            let header = RecordHeader::from_bytes(&raw);
            let total = record_size(header.len as usize);
            if header.kind == KIND_DATA
                && header.len as usize <= cap
                && total <= cap - idx
                && total <= avail
            {
                return Ok(Some(Record {
                    header,
                    payload_offset: idx + RECORD_HEADER_LEN,
                    next: self.tail.wrapping_add(total as u64),
                }));
            }
        }
        self.peek_slow()
    }

    /// [`Self::peek`] in full: refreshes the published position, skips pads, validates. Not
    /// cold: every burst ends here, with a look at the producer's position.
    #[inline(never)]
    fn peek_slow(&mut self) -> Result<Option<Record>, RingCorrupt> {
        let cap = self.mem.capacity();
        let mut refreshed = false;
        loop {
            if self.cached_head == self.tail {
                if refreshed {
                    return Ok(None);
                }
                refreshed = true;
                self.refresh_head()?;
                if self.cached_head == self.tail {
                    return Ok(None);
                }
            }
            let avail = self.cached_head.wrapping_sub(self.tail) as usize;
            let idx = (self.tail as usize) & (cap - 1);
            let to_end = cap - idx;
            let mut raw = [0u8; RECORD_HEADER_LEN];
            self.mem.read(idx, &mut raw);
            let header = RecordHeader::from_bytes(&raw);
            match header.kind {
                KIND_PAD => {
                    if header.len as usize + RECORD_HEADER_LEN != to_end || to_end > avail {
                        return Err(RingCorrupt("bad pad record"));
                    }
                    self.tail = self.tail.wrapping_add(to_end as u64);
                    // Hand the pad back at once: a producer waiting for a large record may need
                    // exactly this space, and pads are rare (one per lap).
                    self.release();
                }
                KIND_DATA => {
                    let total = record_size(header.len as usize);
                    if header.len as usize > cap || total > to_end || total > avail {
                        return Err(RingCorrupt("record length out of range"));
                    }
                    return Ok(Some(Record {
                        header,
                        payload_offset: idx + RECORD_HEADER_LEN,
                        next: self.tail.wrapping_add(total as u64),
                    }));
                }
                _ => return Err(RingCorrupt("unknown record kind")),
            }
        }
    }

    /// Copies up to `dst.len()` payload bytes of `record` into `dst`; returns how many.
    pub fn read_payload(&self, record: &Record, dst: &mut [u8]) -> usize {
        let n = dst.len().min(record.header.len as usize);
        self.mem.read(record.payload_offset, &mut dst[..n]);
        n
    }

    /// Position of the next unread byte (monotonic).
    pub fn position(&self) -> u64 {
        self.tail
    }

    /// The producer's published position, as last seen (monotonic).
    pub fn published(&self) -> u64 {
        self.cached_head
    }

    /// Drops `record` (which must be the one `peek` returned last).
    pub fn consume(&mut self, record: &Record) {
        debug_assert!({
            let step = record.next.wrapping_sub(self.tail);
            step != 0 && step <= self.cached_head.wrapping_sub(self.tail)
        });
        self.tail = record.next;
    }

    /// Hands consumed space back to the producer, up to the oldest held record (see
    /// [`Consumer::hold_from`]).
    pub fn release(&mut self) {
        let upto = self.held_from.unwrap_or(self.tail);
        self.mem.consumer().store(upto, Ordering::Release);
    }

    /// Free bytes as the producer sees them: the capacity less what lies between the released
    /// position and the producer's published one. The producer's position is the peer's to
    /// write: out of range reads as no room.
    pub fn producer_free(&self) -> usize {
        let head = self.mem.producer().load(Ordering::Acquire);
        let released = self.mem.consumer().load(Ordering::Relaxed);
        let used = head.wrapping_sub(released);
        (self.mem.capacity() as u64).saturating_sub(used) as usize
    }

    /// Keeps consumed records from `pos` on out of the producer's reach (`None`: nothing is
    /// held). `pos` is the start of a consumed record, at or after the last released position;
    /// it takes effect at the next [`Consumer::release`].
    pub fn hold_from(&mut self, pos: Option<u64>) {
        debug_assert!(pos.is_none_or(|p| p <= self.tail));
        self.held_from = pos;
    }

    /// True if nothing is published beyond what was consumed.
    pub fn is_empty(&mut self) -> Result<bool, RingCorrupt> {
        if self.cached_head != self.tail {
            return Ok(false);
        }
        self.refresh_head()?;
        Ok(self.cached_head == self.tail)
    }
}

#[cfg(not(loom))]
pub use raw::{RawRing, RingHeader, RING_HEADER_LEN};

#[cfg(not(loom))]
mod raw {
    use super::RingMemory;
    use std::ptr::NonNull;
    use std::sync::atomic::AtomicU64;

    /// The two counters at the start of every ring in shared memory. The padding is atomic
    /// too: the peer may write any byte of the header, so a `&RingHeader` must cover nothing
    /// but interior-mutable memory.
    #[repr(C, align(128))]
    pub struct RingHeader {
        /// Bytes produced.
        pub producer: AtomicU64,
        _pad0: [AtomicU64; 15],
        /// Bytes consumed.
        pub consumer: AtomicU64,
        _pad1: [AtomicU64; 15],
    }

    /// Bytes taken by [`RingHeader`]; the data area follows it.
    pub const RING_HEADER_LEN: usize = std::mem::size_of::<RingHeader>();
    const _: () = assert!(RING_HEADER_LEN == 256);

    /// A ring in memory this process does not own exclusively (a shared mapping, or a test
    /// buffer): a header pointer and a data pointer.
    #[derive(Clone, Copy, Debug)]
    pub struct RawRing {
        header: NonNull<RingHeader>,
        data: NonNull<u8>,
        capacity: usize,
    }

    // SAFETY: a RawRing is only a pair of pointers into memory that outlives it (the caller of
    // `new` promises that); the counters are atomics and data accesses are ordered by them.
    unsafe impl Send for RawRing {}
    // SAFETY: as above; every shared access goes through atomics or the SPSC protocol.
    unsafe impl Sync for RawRing {}

    impl RawRing {
        /// # Safety
        /// `base` must point to `RING_HEADER_LEN + capacity` bytes, 128-byte aligned, that stay
        /// mapped and writable for the life of the returned value and of every copy of it.
        /// `capacity` must be a power of two and a multiple of 16.
        pub unsafe fn new(base: NonNull<u8>, capacity: usize) -> Self {
            assert!(capacity.is_power_of_two() && capacity >= super::RECORD_ALIGN);
            assert_eq!(base.as_ptr() as usize % 128, 0);
            RawRing {
                header: base.cast(),
                // SAFETY: within the allocation the caller described.
                data: unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_HEADER_LEN)) },
                capacity,
            }
        }

        /// Start of the data area (for copies straight between two rings).
        #[inline]
        pub fn data_ptr(&self) -> *mut u8 {
            self.data.as_ptr()
        }

        #[inline]
        fn header(&self) -> &RingHeader {
            // SAFETY: `new`'s contract keeps the header mapped. The peer may write any byte of
            // it at any time, which a reference tolerates only because every byte of
            // RingHeader, padding included, is an atomic: nothing behind it is immutable.
            unsafe { self.header.as_ref() }
        }
    }

    impl RingMemory for RawRing {
        #[inline]
        fn producer(&self) -> &AtomicU64 {
            &self.header().producer
        }
        #[inline]
        fn consumer(&self) -> &AtomicU64 {
            &self.header().consumer
        }
        #[inline]
        fn capacity(&self) -> usize {
            self.capacity
        }
        #[inline]
        fn write(&self, off: usize, src: &[u8]) {
            assert!(off <= self.capacity && src.len() <= self.capacity - off);
            // SAFETY: in bounds (checked above). The SPSC protocol gives the producer exclusive
            // use of this range until it publishes; a peer that breaks the protocol can only
            // make the bytes garbage, which the reader validates.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.as_ptr().add(off), src.len())
            }
        }
        #[inline]
        fn read(&self, off: usize, dst: &mut [u8]) {
            assert!(off <= self.capacity && dst.len() <= self.capacity - off);
            // SAFETY: in bounds (checked above); the range was published to us with Acquire.
            // The bytes are treated as untrusted input by every caller.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data.as_ptr().add(off),
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            }
        }
    }

    /// A ring on the heap with the same layout as a shared one, for tests and Miri.
    pub struct HeapRing {
        buf: Vec<u128>,
        ring: RawRing,
    }

    impl HeapRing {
        /// A zeroed ring of `capacity` data bytes.
        pub fn new(capacity: usize) -> Self {
            let words = (super::RING_HEADER_LEN + capacity).div_ceil(16) + 8;
            let mut buf = vec![0u128; words];
            let start = buf.as_mut_ptr().cast::<u8>();
            let addr = start as usize;
            let skip = ((addr + 127) & !127) - addr;
            // Derive the aligned pointer from `buf`'s own pointer (no integer-to-pointer cast),
            // so it keeps the allocation's provenance and Miri can check every access.
            // SAFETY: `skip < 128` and `buf` has 128 spare bytes, so this stays in bounds.
            let base = unsafe { NonNull::new_unchecked(start.add(skip)) };
            // SAFETY: `buf` is large enough for the aligned header + data, lives as long as the
            // HeapRing, and is never reallocated.
            let ring = unsafe { RawRing::new(base, capacity) };
            HeapRing { buf, ring }
        }

        /// The ring, to hand to a producer and a consumer.
        pub fn ring(&self) -> RawRing {
            let _ = self.buf.len();
            self.ring
        }
    }
}

#[cfg(not(loom))]
pub use raw::HeapRing;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    fn pair(cap: usize) -> (HeapRing, Producer<RawRing>, Consumer<RawRing>) {
        let heap = HeapRing::new(cap);
        let p = Producer::new(heap.ring());
        let c = Consumer::new(heap.ring());
        (heap, p, c)
    }

    fn pop(c: &mut Consumer<RawRing>) -> Option<(RecordHeader, Vec<u8>)> {
        let rec = c.peek().expect("valid")?;
        let mut v = vec![0; rec.header.len as usize];
        c.read_payload(&rec, &mut v);
        c.consume(&rec);
        c.release();
        Some((rec.header, v))
    }

    /// `fits_leaving` is `fits` with `keep` bytes left over, the pad at the end included;
    /// a keep of 0 is `fits`.
    #[test]
    fn fits_leaving_keeps_room_after_the_push() {
        let (_h, mut p, mut c) = pair(256);
        // 48-byte records (16 header + 32 payload).
        assert!(p.fits_leaving(32, 208) && !p.fits_leaving(32, 209));
        for _ in 0..4 {
            p.push(RecordHeader::data(32, 0, 0), &[0; 32]).unwrap();
        }
        p.publish();
        // 192 used, 64 to the end: one more record leaves 16.
        assert!(p.fits_leaving(32, 16) && !p.fits_leaving(32, 17));
        assert_eq!(p.fits_leaving(32, 0), p.fits(32));
        // Two consumed: 160 free, but the next record after one more needs the pad first.
        pop(&mut c).unwrap();
        pop(&mut c).unwrap();
        p.push(RecordHeader::data(32, 0, 0), &[0; 32]).unwrap();
        p.publish();
        // 16 to the end: a 48-byte record needs 16 of pad and 48, of the 112 free.
        assert!(p.fits_leaving(32, 48) && !p.fits_leaving(32, 49));
        assert!(!p.fits_leaving(32, 1 << 20), "never more than the ring");
    }

    #[test]
    fn held_records_stay_out_of_the_producers_reach() {
        let (_h, mut p, mut c) = pair(256);
        // Three 48-byte records (16 header + 32 payload) fill 144 of 256 bytes.
        for i in 0..3u8 {
            p.push(RecordHeader::data(32, 0, 0), &[i; 32]).unwrap();
        }
        p.publish();
        let first = c.position();
        let r0 = c.peek().unwrap().unwrap();
        c.consume(&r0);
        // Record 0 is sent in place: held from its start while the others are consumed.
        c.hold_from(Some(first));
        for _ in 0..2 {
            let r = c.peek().unwrap().unwrap();
            c.consume(&r);
        }
        c.release();
        // Only 256 - 144 bytes are free: a 128-byte record does not fit.
        assert_eq!(
            p.push(RecordHeader::data(112, 0, 0), &[9; 112]),
            Err(PushError::Full)
        );
        // The held record's bytes are intact.
        let mut v = [0u8; 32];
        c.read_payload(&r0, &mut v);
        assert_eq!(v, [0; 32]);
        // The hold ends (the peer acknowledged it): all the space comes back.
        c.hold_from(None);
        c.release();
        p.push(RecordHeader::data(112, 0, 0), &[9; 112]).unwrap();
    }

    #[test]
    fn fits_answers_what_push_then_does() {
        let (_h, mut p, mut c) = pair(256);
        for i in 0..2000usize {
            let len = (i * 37) % 300;
            let fits = p.fits(len);
            let pushed = p.push(RecordHeader::data(0, 0, 0), &vec![1; len]);
            assert_eq!(
                fits,
                pushed.is_ok(),
                "record {i} of {len} bytes: {pushed:?}"
            );
            p.publish();
            if i % 3 != 0 {
                pop(&mut c);
            }
        }
    }

    #[test]
    fn unconsumed_lists_what_the_consumer_has_not_released_and_trusts_nothing() {
        let (h, mut p, mut c) = pair(256);
        let list = |p: &Producer<RawRing>| {
            let mut v = Vec::new();
            p.unconsumed(100, |r| v.push((r.len, r.port)));
            v
        };
        // Across the wrap: 48-byte records, some consumed, a pad at the end of the lap.
        for i in 0..7u16 {
            p.push(RecordHeader::data(32, 1, i), &[0; 32]).unwrap();
            p.publish();
            if i < 4 {
                pop(&mut c);
            }
        }
        assert_eq!(list(&p), [(32, 4), (32, 5), (32, 6)]);
        let mut few = 0;
        p.unconsumed(2, |_| few += 1);
        assert_eq!(few, 2, "at most max");
        // A consumer position the peer scribbled (misaligned, or ahead of the producer).
        let ring = h.ring();
        let real = ring.consumer().load(Ordering::Relaxed);
        ring.consumer().store(real + 1, Ordering::Relaxed);
        assert!(list(&p).is_empty());
        ring.consumer().store(real + 4096, Ordering::Relaxed);
        assert!(list(&p).is_empty());
        ring.consumer().store(real, Ordering::Relaxed);
        assert_eq!(list(&p).len(), 3);
    }

    /// What POLLOUT relies on:    /// What POLLOUT relies on: once the producer-visible free space reaches the room a failed
    /// push named, the retry goes; or, when the record waits behind a pad that did not fit
    /// (room capped at the capacity), the retry writes the pad and the next named room does.
    #[test]
    fn room_named_by_a_failed_push_is_enough_for_the_retry() {
        let cap = 256;
        let (_h, mut p, mut c) = pair(cap);
        let mut retries_behind_a_pad = 0;
        for i in 0..3000usize {
            let len = (i * 53) % 230;
            if p.push(RecordHeader::data(0, 0, 0), &vec![1; len]).is_ok() {
                p.publish();
                if i % 4 == 0 {
                    pop(&mut c);
                }
                continue;
            }
            let named = p.room_needed(len);
            let mut attempts = 0;
            loop {
                let want = p.room_needed(len).min(cap);
                while c.producer_free() < want {
                    // A pop that finds only a pad frees it and returns nothing.
                    if pop(&mut c).is_none() {
                        assert!(
                            c.producer_free() >= want,
                            "record {i}: empty ring too small"
                        );
                    }
                }
                attempts += 1;
                if p.push(RecordHeader::data(0, 0, 0), &vec![2; len]).is_ok() {
                    break;
                }
                assert!(named > cap && attempts == 1, "record {i} of {len} bytes");
            }
            retries_behind_a_pad += usize::from(attempts > 1);
            p.publish();
        }
        assert!(retries_behind_a_pad > 0, "the pad case was exercised");
    }

    #[test]
    fn push_pop_roundtrip_with_wrap() {
        let (_h, mut p, mut c) = pair(256);
        let mut oracle = VecDeque::new();
        for i in 0..1000u32 {
            let len = (i as usize * 7) % 100;
            let payload: Vec<u8> = (0..len).map(|b| (b as u32 + i) as u8).collect();
            match p.push(RecordHeader::data(0, i, i as u16), &payload) {
                Ok(()) => {
                    p.publish();
                    oracle.push_back((i, payload));
                }
                Err(PushError::Full) => {}
                Err(e) => panic!("{e:?}"),
            }
            if i % 3 == 0 {
                while let Some((h, v)) = pop(&mut c) {
                    let (oi, ov) = oracle.pop_front().expect("oracle has it");
                    assert_eq!(h.addr, oi);
                    assert_eq!(v, ov);
                }
            }
        }
        assert!(!oracle.is_empty() || c.is_empty().unwrap());
    }

    #[test]
    fn largest_record_fits_from_any_position() {
        let (_h, mut p, mut c) = pair(1024);
        for shift in [0usize, 16, 500, 1008] {
            p.push(
                RecordHeader::data(0, 0, 0),
                &vec![1; shift.saturating_sub(16)],
            )
            .ok();
            p.publish();
            while pop(&mut c).is_some() {}
            let big = vec![7u8; 1024 - RECORD_HEADER_LEN];
            // Either it fits now or after the consumer skips the pad.
            if p.push(RecordHeader::data(0, 1, 1), &big) == Err(PushError::Full) {
                assert!(pop(&mut c).is_none());
                p.push(RecordHeader::data(0, 1, 1), &big)
                    .expect("fits after pad");
            }
            p.publish();
            let (h, v) = pop(&mut c).expect("big record");
            assert_eq!(h.addr, 1);
            assert_eq!(v, big);
        }
        assert_eq!(
            p.push(RecordHeader::data(0, 0, 0), &vec![0; 1024]),
            Err(PushError::TooLarge)
        );
    }

    #[test]
    fn batch_is_invisible_until_published() {
        let (_h, mut p, mut c) = pair(256);
        p.push(RecordHeader::data(0, 1, 1), b"a").unwrap();
        p.push(RecordHeader::data(0, 2, 2), b"b").unwrap();
        assert!(c.peek().unwrap().is_none());
        p.publish();
        assert_eq!(pop(&mut c).unwrap().1, b"a");
        assert_eq!(pop(&mut c).unwrap().1, b"b");
    }

    /// `nothing_published` says "empty" exactly when `peek` would find nothing: before a
    /// publish, and once everything published was consumed; a record peeked but left on the
    /// ring (a blocked destination) keeps it non-empty.
    #[test]
    fn nothing_published_agrees_with_peek() {
        let (_h, mut p, mut c) = pair(256);
        assert!(c.nothing_published());
        p.push(RecordHeader::data(0, 1, 1), b"a").unwrap();
        assert!(c.nothing_published(), "pushed, not published");
        p.publish();
        assert!(!c.nothing_published());
        assert!(c.peek().unwrap().is_some());
        assert!(!c.nothing_published(), "peeked, not consumed");
        assert_eq!(pop(&mut c).unwrap().1, b"a");
        assert!(c.nothing_published());
        assert!(c.peek().unwrap().is_none());
    }

    #[test]
    fn full_until_released() {
        let (_h, mut p, mut c) = pair(64);
        p.push(RecordHeader::data(0, 0, 0), &[0; 16]).unwrap();
        p.push(RecordHeader::data(0, 0, 0), &[0; 16]).unwrap();
        assert_eq!(
            p.push(RecordHeader::data(0, 0, 0), &[0; 1]),
            Err(PushError::Full)
        );
        p.publish();
        let r = c.peek().unwrap().unwrap();
        c.consume(&r);
        assert_eq!(
            p.push(RecordHeader::data(0, 0, 0), &[0; 1]),
            Err(PushError::Full)
        );
        c.release();
        p.push(RecordHeader::data(0, 0, 0), &[0; 1]).unwrap();
    }

    #[test]
    fn garbage_is_detected_not_trusted() {
        let heap = HeapRing::new(256);
        let ring = heap.ring();
        let mut c = Consumer::new(ring);
        ring.producer().store(10_000, Ordering::Release);
        assert!(c.peek().is_err(), "producer beyond capacity");
        ring.producer().store(8, Ordering::Release);
        let mut c = Consumer::new(ring);
        assert!(c.peek().is_err(), "misaligned producer");
        // A header claiming a huge length.
        let mut c = Consumer::new(ring);
        ring.write(0, &RecordHeader::data(u32::MAX, 0, 0).to_bytes());
        ring.producer().store(32, Ordering::Release);
        assert!(c.peek().is_err(), "huge length");
        // Unknown kind.
        let mut c = Consumer::new(ring);
        let mut h = RecordHeader::data(0, 0, 0);
        h.kind = 77;
        ring.write(0, &h.to_bytes());
        assert!(c.peek().is_err(), "unknown kind");
        // A pad that does not reach the end.
        let mut c = Consumer::new(ring);
        h.kind = KIND_PAD;
        h.len = 0;
        ring.write(0, &h.to_bytes());
        assert!(c.peek().is_err(), "short pad");
    }

    /// The peer can scribble both counters before an end (re)attaches with `new`: the consumer
    /// must answer `RingCorrupt` (not read a header across the end of the data area), the
    /// producer must answer `Full` (not write a pad across it), and neither may overflow.
    #[test]
    fn attach_to_scribbled_counters_never_panics() {
        let positions = [
            0u64,
            8,
            48,
            56,
            1 << 40,
            u64::MAX - 15,
            u64::MAX - 7,
            u64::MAX,
        ];
        for &tail in &positions {
            for delta in [0u64, 8, 16, 32, 64, 80, u64::MAX - 15] {
                let heap = HeapRing::new(64);
                let ring = heap.ring();
                let head = tail.wrapping_add(delta);
                ring.consumer().store(tail, Ordering::Release);
                ring.producer().store(head, Ordering::Release);
                let mut c = Consumer::new(ring);
                for _ in 0..4 {
                    match c.peek() {
                        Ok(Some(r)) => c.consume(&r),
                        Ok(None) | Err(_) => break,
                    }
                }
                let mut p = Producer::new(ring);
                for len in [0usize, 20, 5, 40, 0, 1] {
                    match p.push(RecordHeader::data(0, 0, 0), &vec![9; len]) {
                        Ok(()) | Err(PushError::Full) => {}
                        Err(e) => panic!("{e:?}"),
                    }
                }
                p.publish();
                let _ = p.free_bytes();
                let _ = p.is_drained();
            }
        }
        // A sane attach far along the u64 counter space works across the 2^64 wrap.
        let heap = HeapRing::new(64);
        let ring = heap.ring();
        ring.consumer().store(u64::MAX - 31, Ordering::Release);
        ring.producer().store(u64::MAX - 31, Ordering::Release);
        let mut p = Producer::new(ring);
        let mut c = Consumer::new(ring);
        for i in 0..10u32 {
            if p.push(RecordHeader::data(0, i, 0), &[i as u8; 20]) == Err(PushError::Full) {
                // The pad at the end of the lap was published; skipping it frees the space.
                assert!(pop(&mut c).is_none());
                p.push(RecordHeader::data(0, i, 0), &[i as u8; 20])
                    .expect("fits after pad");
            }
            p.publish();
            let (h, v) = pop(&mut c).expect("record");
            assert_eq!((h.addr, v), (i, vec![i as u8; 20]));
        }
    }

    /// A peer that publishes another lap of padding every time the consumer reads a header:
    /// `peek` must still return (each call reads the published position once).
    struct LappingPeer {
        ring: RawRing,
    }

    impl RingMemory for LappingPeer {
        fn producer(&self) -> &AtomicU64 {
            self.ring.producer()
        }
        fn consumer(&self) -> &AtomicU64 {
            self.ring.consumer()
        }
        fn capacity(&self) -> usize {
            self.ring.capacity()
        }
        fn write(&self, off: usize, src: &[u8]) {
            self.ring.write(off, src)
        }
        fn read(&self, off: usize, dst: &mut [u8]) {
            self.ring.read(off, dst);
            // Right behind the consumer's back: one more whole lap, which is one PAD record.
            self.ring
                .producer()
                .fetch_add(self.ring.capacity() as u64, Ordering::Release);
        }
    }

    #[test]
    fn a_peer_publishing_pads_forever_cannot_hold_peek() {
        let heap = HeapRing::new(256);
        let ring = heap.ring();
        let pad = RecordHeader {
            len: 256 - RECORD_HEADER_LEN as u32,
            kind: KIND_PAD,
            ..RecordHeader::default()
        };
        ring.write(0, &pad.to_bytes());
        ring.producer().store(256, Ordering::Release);
        let mut c = Consumer::new(LappingPeer { ring });
        for _ in 0..3 {
            assert_eq!(c.peek(), Ok(None), "returns after the lap it saw");
        }
        assert!(c.position() >= 3 * 256, "and consumed the pads it saw");
    }

    #[test]
    fn two_threads_stream() {
        let heap = HeapRing::new(512);
        let mut p = Producer::new(heap.ring());
        let mut c = Consumer::new(heap.ring());
        let n = if cfg!(miri) { 200u32 } else { 20_000 };
        std::thread::scope(|s| {
            s.spawn(move || {
                let mut i = 0u32;
                while i < n {
                    let payload = i.to_le_bytes().repeat((i % 9) as usize);
                    if p.push(RecordHeader::data(0, i, 0), &payload).is_ok() {
                        i += 1;
                        if i.is_multiple_of(4) {
                            p.publish();
                        }
                    } else {
                        p.publish();
                        std::thread::yield_now();
                    }
                }
                p.publish();
            });
            let mut expect = 0u32;
            while expect < n {
                match c.peek().unwrap() {
                    Some(r) => {
                        assert_eq!(r.header.addr, expect);
                        let mut v = vec![0; r.header.len as usize];
                        c.read_payload(&r, &mut v);
                        assert_eq!(v, expect.to_le_bytes().repeat((expect % 9) as usize));
                        c.consume(&r);
                        c.release();
                        expect += 1;
                    }
                    None => std::thread::yield_now(),
                }
            }
        });
    }

    proptest::proptest! {
        // Under Miri: few cases, and no failure-persistence file (it needs getcwd, which Miri's
        // isolation refuses).
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: if cfg!(miri) { 2 } else { 64 },
            failure_persistence: if cfg!(miri) {
                None
            } else {
                proptest::prelude::ProptestConfig::default().failure_persistence
            },
            ..proptest::prelude::ProptestConfig::default()
        })]
        /// Arbitrary interleavings of push / publish / pop match a VecDeque oracle.
        #[test]
        fn matches_vecdeque_oracle(ops in proptest::collection::vec((0u8..4, 0usize..200), 1..300)) {
            let (_h, mut p, mut c) = pair(512);
            let mut pushed: VecDeque<Vec<u8>> = VecDeque::new();
            let mut published = 0usize;
            let mut seq = 0u8;
            for (op, len) in ops {
                match op {
                    0 | 1 => {
                        let payload = vec![seq; len];
                        match p.push(RecordHeader::data(0, 0, 0), &payload) {
                            Ok(()) => { pushed.push_back(payload); seq = seq.wrapping_add(1); }
                            // A Full push publishes the batch.
                            Err(PushError::Full) => published = pushed.len(),
                            Err(PushError::TooLarge) => proptest::prop_assert!(false),
                        }
                    }
                    2 => { p.publish(); published = pushed.len(); }
                    _ => {
                        match pop(&mut c) {
                            Some((_, v)) => {
                                proptest::prop_assert!(published > 0);
                                proptest::prop_assert_eq!(Some(v), pushed.pop_front());
                                published -= 1;
                            }
                            None => proptest::prop_assert_eq!(published, 0),
                        }
                    }
                }
            }
        }
    }
}

//! The shared-memory layout both sides agree on. Bumping anything here bumps [`LAYOUT_VERSION`].
//!
//! Two kinds of region:
//! * **App region** (one per attached process, read-write for that app only): a header, then
//!   `max_sockets` socket slots. A slot is a control block followed by a tx ring (app → rdsd)
//!   and an rx ring (rdsd → app).
//! * **Daemon region** (one per rdsd, mapped read-only by every app): the poll core's sleep flag
//!   and the congestion maps, so the library's congestion check is one bit test.
//!
//! Every field written by the app is untrusted input to rdsd.

#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// "RDSDSHM1", little-endian.
pub const SHM_MAGIC: u64 = u64::from_le_bytes(*b"RDSDSHM1");
/// Version of this layout and of the control protocol (2: request ids in the control protocol,
/// one doorbell socket per app instead of a shared eventfd; 5: group copies are gated by a
/// commit, [`RX_FLAG_GROUP`]; 6: eight gates a slot, so fan-outs need not wait for the last
/// one's commit, `crate::gate`; 7: `waiters` off the app's hot line, which rdsd reads only
/// when its cached copy says the receive buffer may be full, and `DaemonHeader::park_barrier`).
pub const LAYOUT_VERSION: u32 = 7;
/// Largest RDS payload (`RDS_MAX_MSG_SIZE`).
pub const MAX_MSG_SIZE: usize = 1 << 20;
/// Default `SO_SNDBUF` / `SO_RCVBUF` (half of Linux's usual `wmem_default`, as RDS uses).
pub const DEFAULT_BUF: u32 = 106_496;
/// Smallest buffer size accepted by the setters.
pub const MIN_BUF: u32 = 1024;
/// Largest buffer size accepted by the setters.
pub const MAX_BUF: u32 = 1 << 30;
/// Bytes in one congestion map (one bit per RDS port).
pub const CONG_MAP_BYTES: usize = 8192;
/// Entries in the daemon region's congestion table (local and peer addresses).
pub const CONG_ENTRIES: usize = 256;

/// Header at offset 0 of an app region. Written once by rdsd before the region is sent.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AppRegionHeader {
    /// [`SHM_MAGIC`].
    pub magic: u64,
    /// [`LAYOUT_VERSION`].
    pub version: u32,
    /// Number of socket slots.
    pub max_sockets: u32,
    /// Total mapped length.
    pub region_len: u64,
    /// Offset of slot 0.
    pub slots_offset: u64,
    /// Bytes per slot.
    pub slot_len: u64,
    /// Data bytes of each tx ring.
    pub tx_ring_capacity: u32,
    /// Data bytes of each rx ring.
    pub rx_ring_capacity: u32,
    /// The poll thread (shard) that serves this app's sockets: its sleep flag is
    /// [`DaemonView::sleeping`]`(poll_shard)`.
    pub poll_shard: u32,
    /// Zero.
    pub reserved: u32,
}

/// Offset of slot 0 in an app region.
pub const SLOTS_OFFSET: usize = 4096;
/// Bytes of the control block at the start of each slot.
pub const SLOT_CONTROL_LEN: usize = 512;

/// What one thread blocked in a receive adds to [`SlotControl::waiters`].
pub const RECV_WAITER: u32 = 1;
/// What one thread blocked in a send (for room or for un-congestion) adds to
/// [`SlotControl::waiters`].
pub const SEND_WAITER: u32 = 1 << 16;
/// The bits of [`SlotControl::waiters`] that count receivers.
pub const RECV_WAITERS: u32 = SEND_WAITER - 1;
/// The bits of [`SlotControl::waiters`] that count senders.
pub const SEND_WAITERS: u32 = !RECV_WAITERS;

/// Per-socket control block. Each group of fields has one writer.
///
/// Each side reads the other's hot line only when it must: the app writes its first line on
/// every send or receive, and rdsd reads it only when a cached copy says the receive buffer
/// may be over `SO_RCVBUF`; the words rdsd checks after every publish (`waiters`) sit on the
/// app's second line, written only around a sleep. Likewise the library reads
/// `tx_released_bytes` only when the value it last saw leaves no send-buffer room (v7).
///
/// Every byte of it, padding included, is an atomic: the app can write any of them at any time,
/// so rdsd may hold a `&SlotControl` (all of it interior-mutable) but must never see a plain
/// field here.
#[cfg(not(loom))]
#[repr(C, align(128))]
pub struct SlotControl {
    // -- written by the app on every send or receive (its hot line) --
    /// Payload bytes the app has queued on the tx ring, ever.
    pub tx_sent_bytes: AtomicU64,
    /// Payload bytes the app has taken off the rx ring, ever.
    pub rx_consumed_bytes: AtomicU64,
    _pad_a: [AtomicU64; 6],
    // -- written by the app rarely: around a sleep, on a full ring, on ENOBUFS --
    /// App threads blocked on `wake_seq`: [`RECV_WAITER`] per receiver, [`SEND_WAITER`] per
    /// sender, so rdsd wakes only those its change concerns (v4: a release of send-buffer
    /// bytes no longer wakes a thread that waits to receive).
    pub waiters: AtomicU32,
    /// Free tx-ring bytes the app's last send that found the ring full needs (0 after a send
    /// went): POLLOUT also waits for them. The ring can fill before SO_SNDBUF does, since
    /// messages sent in place keep their ring space until acknowledged. 0 = no such wait, so
    /// a library that never writes it sees the old readiness.
    pub tx_ring_want: AtomicU32,
    /// Ports (bit = port % 64) whose un-congestion the app wants reported (set on ENOBUFS).
    pub cong_interest: AtomicU64,
    _pad_b: [AtomicU64; 6],
    // -- written by rdsd --
    /// Payload bytes rdsd has released from the send buffer (delivered, acked, cancelled, dropped).
    pub tx_released_bytes: AtomicU64,
    /// Payload bytes rdsd has put on the rx ring, ever.
    pub rx_produced_bytes: AtomicU64,
    /// Futex word: bumped on every event a blocked app thread may wait for.
    pub wake_seq: AtomicU32,
    _pad_c: AtomicU32,
    /// Congestion-update mask for monitor mode (rdsd ORs bits in, the app takes them).
    pub cong_notify: AtomicU64,
    /// The last group copies ([`RX_FLAG_GROUP`]) pushed into the rx ring and their fan-outs,
    /// entries used in turn (`crate::gate`; compared with [`DaemonView::group_commit`]).
    pub group_gates: [crate::gate::Gate; crate::gate::GATES],
    _pad_d: [AtomicU64; 12],
}

/// Rx record flag: a multicast group copy. It may be read only once its fan-out is committed:
/// unless a gate of its slot ([`SlotControl::group_gates`]) names it with a stamp above
/// [`DaemonView::group_commit`]. rdsd pushes and publishes the copy into every member's
/// ring, then commits with one store; if it dies between the two, no member reads the
/// message (all or none across a crash).
pub const RX_FLAG_GROUP: u16 = 1;

/// Whether the group copy whose record ends at `record_end` is still uncommitted (not to be
/// read yet; never, if rdsd died): [`crate::gate::pending`] on this slot's words.
#[cfg(not(loom))]
pub fn group_copy_pending(ctl: &SlotControl, daemon: &DaemonView, record_end: u64) -> bool {
    crate::gate::pending(&ctl.group_gates, daemon.group_commit(), record_end)
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<SlotControl>() <= SLOT_CONTROL_LEN);
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<SlotControl>() == 384);
// The app's hot line, its rare line and rdsd's line each start a cache line.
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(SlotControl, waiters) == 64);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(SlotControl, tx_released_bytes) == 128);

/// Layout of one app region, derived from its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionGeometry {
    /// Socket slots.
    pub max_sockets: u32,
    /// Data bytes of each tx ring.
    pub tx_ring_capacity: u32,
    /// Data bytes of each rx ring.
    pub rx_ring_capacity: u32,
}

/// Ring header size (two cache-line-padded counters).
pub const RING_HEADER_LEN: usize = 256;

impl RegionGeometry {
    /// Bytes of one slot: control block, tx ring, rx ring, rounded to a page.
    pub fn slot_len(&self) -> usize {
        let raw = SLOT_CONTROL_LEN
            + RING_HEADER_LEN
            + self.tx_ring_capacity as usize
            + RING_HEADER_LEN
            + self.rx_ring_capacity as usize;
        raw.div_ceil(4096) * 4096
    }

    /// Offset of slot `i`'s control block.
    pub fn slot_offset(&self, i: u32) -> usize {
        SLOTS_OFFSET + i as usize * self.slot_len()
    }

    /// Offset of slot `i`'s tx ring header.
    pub fn tx_ring_offset(&self, i: u32) -> usize {
        self.slot_offset(i) + SLOT_CONTROL_LEN
    }

    /// Offset of slot `i`'s rx ring header.
    pub fn rx_ring_offset(&self, i: u32) -> usize {
        self.tx_ring_offset(i) + RING_HEADER_LEN + self.tx_ring_capacity as usize
    }

    /// Bytes of the whole region, rounded up to `align` (the page size backing it).
    pub fn region_len(&self, align: usize) -> usize {
        (SLOTS_OFFSET + self.max_sockets as usize * self.slot_len()).div_ceil(align) * align
    }

    /// Checks the numbers a header claims before anything is derived from them.
    pub fn validate(&self) -> Result<(), &'static str> {
        let ring_ok =
            |c: u32| c.is_power_of_two() && c as usize >= crate::ring::record_size(MAX_MSG_SIZE);
        if !ring_ok(self.tx_ring_capacity) || !ring_ok(self.rx_ring_capacity) {
            return Err("ring capacity must be a power of two that holds a 1 MiB message");
        }
        if self.max_sockets == 0 || self.max_sockets > 4096 {
            return Err("max_sockets out of range");
        }
        Ok(())
    }
}

/// Header of the daemon region (read-only for apps).
#[cfg(not(loom))]
#[repr(C, align(128))]
pub struct DaemonHeader {
    /// [`SHM_MAGIC`].
    pub magic: u64,
    /// [`LAYOUT_VERSION`].
    pub version: u32,
    /// Non-zero when the poll core may park: apps then ring the doorbell after queueing work.
    pub may_sleep: AtomicU32,
    /// Non-zero when every poll thread, between raising its sleep flag and its last look at
    /// its inputs before it parks, makes `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)` (v7;
    /// unused from layout 3 to 6). A process registered for those barriers
    /// ([`crate::sys::membarrier_register`]) may then read a sleep flag after publishing with
    /// no fence of its own: the barrier orders its publish against the flag for it, so only
    /// a parking poll thread pays, not every send.
    pub park_barrier: AtomicU32,
    /// Bumped on every congestion-map change.
    pub cong_seq: AtomicU32,
    _pad: [u8; 104],
}

/// Poll threads (shards) one rdsd runs at most: one sleep flag each, a cache line apart, between
/// the header and the congestion table.
pub const MAX_POLL_THREADS: usize = 31;
/// Offset of shard 0's sleep flag in the daemon region.
pub const SLEEP_FLAGS_OFFSET: usize = 128;

/// Offset of the congestion table (entries) in the daemon region.
pub const CONG_TABLE_OFFSET: usize = 4096;
const _: () = assert!(SLEEP_FLAGS_OFFSET + MAX_POLL_THREADS * 128 <= CONG_TABLE_OFFSET);
/// Offset of the group commit word ([`DaemonView::group_commit`]), on a cache line of its own
/// after the congestion table.
pub const GROUP_COMMIT_OFFSET: usize = CONG_TABLE_OFFSET + CONG_ENTRIES * 8;
/// Offset of the first congestion map in the daemon region.
pub const CONG_MAPS_OFFSET: usize = 8192;
const _: () = assert!(GROUP_COMMIT_OFFSET + 128 <= CONG_MAPS_OFFSET);
/// Bytes of the daemon region.
pub const DAEMON_REGION_LEN: usize = CONG_MAPS_OFFSET + CONG_ENTRIES * CONG_MAP_BYTES;

/// One row of the congestion table: which address map `i` belongs to (0 = free).
#[cfg(not(loom))]
#[repr(C)]
pub struct CongEntry {
    /// IPv4 address in host order, or 0.
    pub addr: AtomicU32,
    /// Reserved.
    pub flags: AtomicU32,
}

/// Typed view of a mapped daemon region.
#[cfg(not(loom))]
#[derive(Clone, Copy)]
pub struct DaemonView {
    base: *mut u8,
}

// SAFETY: a DaemonView only points at atomics in a mapping that its owner keeps alive.
#[cfg(not(loom))]
unsafe impl Send for DaemonView {}
// SAFETY: as above; all access is through atomics.
#[cfg(not(loom))]
unsafe impl Sync for DaemonView {}

#[cfg(not(loom))]
impl DaemonView {
    /// # Safety
    /// `base` must point to a mapping of at least [`DAEMON_REGION_LEN`] bytes, page aligned, that
    /// outlives the view. Apps may map it read-only: they must only call the read methods.
    pub unsafe fn new(base: *mut u8) -> Self {
        DaemonView { base }
    }

    /// The header.
    pub fn header(&self) -> &DaemonHeader {
        // SAFETY: offset 0, aligned, inside the mapping (see `new`); only atomics inside.
        unsafe { &*(self.base as *const DaemonHeader) }
    }

    /// Non-zero while poll thread `shard` is parked (or about to park): an app it serves rings
    /// its doorbell after queueing work. Each flag has a cache line of its own, so one poll
    /// thread parking does not disturb the apps of another.
    pub fn sleeping(&self, shard: usize) -> &AtomicU32 {
        assert!(shard < MAX_POLL_THREADS);
        // SAFETY: in bounds (asserted: 128 + 31 * 128 <= CONG_TABLE_OFFSET), aligned, atomics.
        unsafe { &*(self.base.add(SLEEP_FLAGS_OFFSET + shard * 128) as *const AtomicU32) }
    }

    /// The last multicast fan-out committed by the poll thread that orders the groups (shard
    /// 0): a group copy stamped above it is not to be read yet ([`group_copy_pending`]).
    pub fn group_commit(&self) -> &AtomicU64 {
        // SAFETY: in bounds and 128-byte aligned (const-asserted above), an atomic only.
        unsafe { &*(self.base.add(GROUP_COMMIT_OFFSET) as *const AtomicU64) }
    }

    /// Row `i` of the congestion table.
    pub fn entry(&self, i: usize) -> &CongEntry {
        assert!(i < CONG_ENTRIES);
        // SAFETY: in bounds (asserted), 8-byte aligned, atomics only.
        unsafe { &*(self.base.add(CONG_TABLE_OFFSET + i * 8) as *const CongEntry) }
    }

    /// Map `i` as 1024 little-endian u64 words (port P = bit P%64 of word P/64).
    pub fn map(&self, i: usize) -> &[AtomicU64] {
        assert!(i < CONG_ENTRIES);
        // SAFETY: in bounds (asserted), 8-byte aligned, atomics only.
        unsafe {
            std::slice::from_raw_parts(
                self.base.add(CONG_MAPS_OFFSET + i * CONG_MAP_BYTES) as *const AtomicU64,
                CONG_MAP_BYTES / 8,
            )
        }
    }

    /// Index of the map for `addr`, if there is one.
    pub fn find(&self, addr: u32) -> Option<usize> {
        if addr == 0 {
            return None;
        }
        (0..CONG_ENTRIES).find(|&i| self.entry(i).addr.load(Ordering::Acquire) == addr)
    }

    /// Is `addr:port` congested? `hint` caches the table index between calls.
    pub fn is_congested(&self, addr: u32, port: u16, hint: &mut usize) -> bool {
        let idx = if *hint < CONG_ENTRIES && self.entry(*hint).addr.load(Ordering::Acquire) == addr
        {
            *hint
        } else {
            match self.find(addr) {
                Some(i) => {
                    *hint = i;
                    i
                }
                None => return false,
            }
        };
        let word = self.map(idx)[port as usize / 64].load(Ordering::Acquire);
        word & (1u64 << (port % 64)) != 0
    }
}

/// `RDS_CONG_MONITOR` mask bit for a port.
pub const fn cong_monitor_bit(port: u16) -> u64 {
    1u64 << (port % 64)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_consistent() {
        let g = RegionGeometry {
            max_sockets: 4,
            tx_ring_capacity: 2 << 20,
            rx_ring_capacity: 2 << 20,
        };
        g.validate().unwrap();
        assert_eq!(g.slot_offset(1) - g.slot_offset(0), g.slot_len());
        assert!(g.rx_ring_offset(0) + RING_HEADER_LEN + (2 << 20) <= g.slot_offset(1));
        assert_eq!(g.tx_ring_offset(0) % 128, 0);
        assert_eq!(g.rx_ring_offset(0) % 128, 0);
        assert!(g.region_len(2 << 20).is_multiple_of(2 << 20));
        let bad = RegionGeometry {
            tx_ring_capacity: 1 << 20,
            ..g
        };
        assert!(
            bad.validate().is_err(),
            "a 1 MiB ring can't hold a 1 MiB message + header"
        );
    }

    #[test]
    fn ring_header_len_matches_ring_module() {
        assert_eq!(RING_HEADER_LEN, crate::ring::RING_HEADER_LEN);
    }
}

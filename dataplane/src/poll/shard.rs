//! Shards: what several poll threads share, and how a message crosses from one to another.
//!
//! Each poll thread (`poll_cores`, shard `k`) owns the apps the control thread gave it: their
//! sockets, rings, bindings and doorbells. Shard 0 also owns every network transport. Shards
//! share no socket state; what crosses between them travels through the [`Fabric`]:
//!
//! - **Messages**, one single-producer ring per ordered pair of shards (`from → to`), on the
//!   heap, with the same record format as the apps' rings: a delivery to a socket of another
//!   shard ([`Envelope::Deliver`]: a local send, or a message shard 0 took from the network),
//!   and a send from a socket of shard `k` to a remote host ([`Envelope::Send`], `k → 0`).
//!   The payload is copied once into the pair ring, then once more into the receiver's rx ring.
//!   A full pair ring is back-pressure: the sender's message stays on its tx ring
//!   (`Blocked`), a network path pauses (`Full`). The receiving shard stops reading a pair ring
//!   at a message its destination cannot take yet (its rx ring is full), so order holds.
//! - **Notes** ([`Note`]), one bounded queue per pair, never dropped (a note that finds the
//!   queue full waits in the sender's stash): the release of a forwarded send's bytes
//!   (`0 → k`), a congestion bit of shard `k`'s port for the maps shard 0 sends to peers, an
//!   uncongestion to wake blocked senders everywhere, a cancel for shard 0's transports.
//! - **The bind directory** ([`Directory`]): every binding `(addr, port) → shard`, and the
//!   congestion-table entries of the daemon region, under one mutex taken only by bind, close
//!   and the first use of an address. Each shard routes from its own replica, refreshed when
//!   the directory's version moved (one load per pass) and before it calls a destination
//!   unbound.
//!
//! Producers publish once per pass and ring the doorbell of a shard that sleeps (its flag in
//! the daemon region, `DaemonView::sleeping`), as apps do. One poll thread: no rings, no notes,
//! the directory only for binds.

use super::rebind::BoundPorts;
use crate::quiet::Mutex;
use crossbeam_queue::ArrayQueue;
use rustc_hash::FxHashMap;
use shm_api::layout::DaemonView;
use shm_api::ring::{Consumer, HeapRing, Producer, PushError, RawRing, Record, RecordHeader};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};

/// Data bytes of each pair ring: one 1 MiB message and its envelope always fit.
pub const PAIR_RING_BYTES: usize = 2 << 20;
/// Bytes of closing sockets' messages a shard keeps for full pair rings (`set_closing`):
/// past it they are dropped, so apps that close sockets towards a receiver that never reads
/// cannot grow rdsd's memory without bound.
const MAX_KEPT_BYTES: usize = 64 << 20;
/// Notes queued per pair before the sender stashes them.
const NOTES_PER_PAIR: usize = 1 << 14;
/// Token bit of a send forwarded by another shard: its release goes back to that shard.
pub(super) const FORWARDED: u64 = 1 << 62;
const SHARD_SHIFT: u32 = 56;
const SHARD_MASK: u64 = 0x3f << SHARD_SHIFT;
/// Bytes of the envelope in front of each payload in a pair ring (a 64-byte message still
/// takes 112 bytes of ring: records are padded to 16).
const ENVELOPE_LEN: usize = 32;
const KIND_DELIVER: u8 = 1;
const KIND_SEND: u8 = 2;
const KIND_GROUP_DELIVER: u8 = 3;
const KIND_DELIVER_REF: u8 = 4;
const KIND_SEND_REF: u8 = 5;
const KIND_CANCEL: u8 = 6;
/// `SendRef`'s `ack_required`, above the 21 bits of a length of at most 1 MiB.
const REF_ACK_REQUIRED: u32 = 1 << 23;

/// The token shard 0 carries for a send forwarded from `shard` (token `t` there).
pub(super) fn forwarded_token(shard: usize, t: u64) -> u64 {
    debug_assert!(t & (FORWARDED | SHARD_MASK) == 0);
    FORWARDED | ((shard as u64) << SHARD_SHIFT) | t
}

/// `(shard, token there)` of a forwarded token. The token there may be a hold
/// (`inplace::IN_PLACE`, a `SendRef`): a hold of this shard never has `FORWARDED`.
pub(super) fn unforward(token: u64) -> Option<(usize, u64)> {
    (token & FORWARDED != 0).then_some({
        (
            ((token & SHARD_MASK) >> SHARD_SHIFT) as usize,
            token & !(FORWARDED | SHARD_MASK),
        )
    })
}

/// A small message between shards (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Note {
    /// `len` bytes of the send carrying `token` are released (acknowledged, dropped).
    Release { token: u64, len: u64 },
    /// A local port's congestion bit changed (for the maps shard 0 sends to peers).
    CongBit { addr: u32, port: u16, on: bool },
    /// Ports (monitor mask) are uncongested: wake blocked senders and monitors.
    Uncongested { mask: u64 },
    /// A group request of socket `member` (incarnation `gen`, bound to `bound`) of another
    /// shard, for shard 0, which orders every group and answers control command `seq` of
    /// `app` itself.
    GroupOp {
        seq: u64,
        app: usize,
        uid: u32,
        member: super::SockRef,
        gen: u32,
        bound: Option<(u32, u16)>,
        req: shm_api::ctrl::Request,
        /// A join's credit, granted with it (`group_credit.rs`): room kept in the member's rx
        /// ring for shard 0's copies, so that its first copies are charged too.
        credit: u64,
    },
    /// A socket of another shard that made group requests closed: it leaves its groups.
    GroupSockClosed { member: super::SockRef, gen: u32 },
    /// (k → 0) One copy of fan-out `stamp` is published, gated, in a member's ring of shard k
    /// (or its member is gone): shard 0 commits the fan-out once every copy is.
    GroupPublished { stamp: u64 },
    /// (0 → k) Fan-outs up to `stamp` are committed: wake the members they reached.
    GroupCommitted { stamp: u64 },
    /// (k → 0) A copy of fan-out `stamp` waits for a full member (`backlog.rs`): the fan-out
    /// may wait long, so group messages of other shards' sockets are parked meanwhile rather
    /// than hold their pair rings.
    GroupCopyWaiting { stamp: u64 },
    /// (0 → k) Keep at least `need` bytes, up to `want`, of member `token`'s rx ring for
    /// shard 0's group copies (`group_credit.rs`).
    GroupCreditAsk { token: u64, need: u64, want: u64 },
    /// (k → 0) `bytes` of member `token`'s rx ring are kept for shard 0's group copies.
    GroupCredit { token: u64, bytes: u64 },
    /// (0 → k) Shard 0 no longer needs `bytes` of what member `token`'s ring keeps for it.
    GroupCreditBack { token: u64, bytes: u64 },
}

/// What a pair ring carries, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Envelope {
    /// Deliver to the socket bound at `(laddr, dport)` on the receiving shard; `token`
    /// (non-zero for a local sender) gets the bytes back once they are in the rx ring.
    Deliver {
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        token: u64,
    },
    /// Send to a remote host through shard 0's transports; `token` names the sender there.
    /// `ack_required`: as [`crate::seam::OutMsg::ack_required`].
    Send {
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        token: u64,
        ack_required: bool,
    },
    /// A group message (already numbered by shard 0) for member `token` (socket and
    /// incarnation, `table::token_of`) of the receiving shard, bound at `(laddr, dport)`;
    /// dropped if that socket is gone. `stamp` names its fan-out (`shm_api::gate`), which
    /// shard 0 commits once this copy is published. `charge`: what shard 0 took from the
    /// member's credit for it (`group_credit.rs`; 0 if none), given back by the ring's keep.
    GroupDeliver {
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        token: u64,
        stamp: u64,
        charge: u32,
    },
    /// `Deliver` of a message that stays where it lies, `len` bytes at `ptr` in the sender's
    /// tx ring, whose space hold `token` keeps (the record is the envelope alone). The
    /// receiving shard copies it from there and releases the hold with `Note::Release`:
    /// one copy instead of two for large messages between shards.
    DeliverRef {
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        token: u64,
        ptr: u64,
        len: u32,
    },
    /// `Send` of a message that stays where it lies (as `DeliverRef`): the receiving shard's
    /// transport writes it from the sender's tx ring (or copies it from there), and its
    /// release (`Note::Release` of hold `token`) gives the ring space back. Large messages
    /// from another shard than the connection's owner cross with no copy.
    SendRef {
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        token: u64,
        ptr: u64,
        len: u32,
        ack_required: bool,
    },
    /// RDS_CANCEL_SENT_TO of `laddr:sport` (`dest`: `None` = every destination) for the
    /// receiving shard's transports. A record, not a note: it must reach the connection's
    /// owner after every `Send` the socket's shard forwarded before it (notes are read before
    /// the pair rings, so a cancel note overtook them, and they were queued after it).
    Cancel {
        laddr: u32,
        sport: u16,
        dest: Option<(u32, u16)>,
    },
}

/// What the connection's owner needs of a forwarded send (`Send` or `SendRef`).
#[derive(Clone, Copy, Debug)]
pub(super) struct SendParts {
    /// Sender's address and port.
    pub src: (u32, u16),
    /// Destination address and port.
    pub dst: (u32, u16),
    /// The sender's token on its shard (a hold for `SendRef`).
    pub token: u64,
    pub ack_required: bool,
    /// The payload lies in the sender's tx ring (`SendRef`), held there until the release.
    pub in_place: bool,
}

impl Envelope {
    /// The fields of a `Send` or `SendRef`; `None` for the other kinds.
    pub(super) fn send_parts(&self) -> Option<SendParts> {
        match *self {
            Envelope::Send {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ack_required,
            }
            | Envelope::SendRef {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ack_required,
                ..
            } => Some(SendParts {
                src: (laddr, sport),
                dst: (faddr, dport),
                token,
                ack_required,
                in_place: matches!(self, Envelope::SendRef { .. }),
            }),
            _ => None,
        }
    }

    fn emit(&self) -> [u8; ENVELOPE_LEN] {
        let mut len_of_ref = 0u32;
        let (kind, laddr, faddr, sport, dport, token, stamp) = match *self {
            Envelope::Deliver {
                laddr,
                faddr,
                sport,
                dport,
                token,
            } => (KIND_DELIVER, laddr, faddr, sport, dport, token, 0),
            Envelope::Send {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ack_required,
            } => (
                KIND_SEND,
                laddr,
                faddr,
                sport,
                dport,
                token,
                u64::from(ack_required),
            ),
            Envelope::GroupDeliver {
                laddr,
                faddr,
                sport,
                dport,
                token,
                stamp,
                charge,
            } => {
                len_of_ref = charge;
                (KIND_GROUP_DELIVER, laddr, faddr, sport, dport, token, stamp)
            }
            Envelope::DeliverRef {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ptr,
                len,
            } => {
                len_of_ref = len;
                (KIND_DELIVER_REF, laddr, faddr, sport, dport, token, ptr)
            }
            Envelope::SendRef {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ptr,
                len,
                ack_required,
            } => {
                debug_assert!(len < REF_ACK_REQUIRED);
                len_of_ref = len | if ack_required { REF_ACK_REQUIRED } else { 0 };
                (KIND_SEND_REF, laddr, faddr, sport, dport, token, ptr)
            }
            Envelope::Cancel { laddr, sport, dest } => {
                let (faddr, dport) = dest.unwrap_or((0, 0));
                let has_dest = u64::from(dest.is_some());
                (KIND_CANCEL, laddr, faddr, sport, dport, has_dest, 0)
            }
        };
        let mut b = [0u8; ENVELOPE_LEN];
        b[0] = kind;
        // A message is at most 1 MiB (and a charge at most `CREDIT_CHUNK`): 24 bits hold it.
        debug_assert!(len_of_ref < 1 << 24);
        b[1..4].copy_from_slice(&len_of_ref.to_le_bytes()[..3]);
        b[4..8].copy_from_slice(&laddr.to_le_bytes());
        b[8..12].copy_from_slice(&faddr.to_le_bytes());
        b[12..14].copy_from_slice(&sport.to_le_bytes());
        b[14..16].copy_from_slice(&dport.to_le_bytes());
        b[16..24].copy_from_slice(&token.to_le_bytes());
        b[24..32].copy_from_slice(&stamp.to_le_bytes());
        b
    }

    /// Pair rings are written only by rdsd's own threads; a bad envelope is a bug, not input.
    /// Inlined into `open_record` (one call site): out of line, the enum came back through
    /// memory.
    #[inline(always)]
    fn parse(b: &[u8; ENVELOPE_LEN]) -> Envelope {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"));
        let (laddr, faddr, sport, dport) = (u32_at(4), u32_at(8), u16_at(12), u16_at(14));
        let token = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let stamp = u64::from_le_bytes(b[24..32].try_into().expect("8 bytes"));
        match b[0] {
            KIND_DELIVER => Envelope::Deliver {
                laddr,
                faddr,
                sport,
                dport,
                token,
            },
            KIND_SEND => Envelope::Send {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ack_required: stamp != 0,
            },
            KIND_GROUP_DELIVER => Envelope::GroupDeliver {
                laddr,
                faddr,
                sport,
                dport,
                token,
                stamp,
                charge: u32::from_le_bytes([b[1], b[2], b[3], 0]),
            },
            KIND_DELIVER_REF => Envelope::DeliverRef {
                laddr,
                faddr,
                sport,
                dport,
                token,
                ptr: stamp,
                len: u32::from_le_bytes([b[1], b[2], b[3], 0]),
            },
            KIND_SEND_REF => {
                let len = u32::from_le_bytes([b[1], b[2], b[3], 0]);
                Envelope::SendRef {
                    laddr,
                    faddr,
                    sport,
                    dport,
                    token,
                    ptr: stamp,
                    len: len & !REF_ACK_REQUIRED,
                    ack_required: len & REF_ACK_REQUIRED != 0,
                }
            }
            KIND_CANCEL => Envelope::Cancel {
                laddr,
                sport,
                dest: (token != 0).then_some((faddr, dport)),
            },
            k => unreachable!("pair ring record of kind {k}"),
        }
    }
}

/// A binding in the directory: the shard whose socket is bound there, and that socket's
/// "backed up" flag, which its shard raises while the socket's backlog is past its share
/// (`backlog.rs`): a local sender of another shard then waits on its own tx ring, as a sender
/// of the receiver's shard does past the share, instead of growing the backlog.
#[derive(Clone, Debug)]
pub(super) struct Bound {
    pub(super) shard: u8,
    pub(super) backed_up: Arc<AtomicBool>,
}

/// Every binding and congestion-table entry of the daemon (see the module docs).
#[derive(Default)]
pub struct Directory {
    /// `(addr, port)` → the socket bound there.
    pub(super) binds: FxHashMap<(u32, u16), Bound>,
    /// Address → (congestion-table index in the daemon region, references from all shards).
    pub(super) cong: FxHashMap<u32, (usize, u32)>,
    /// Ports bound before a restart, and the record of ours (`None`: no state file).
    pub(super) rebind: Option<BoundPorts>,
    /// An immutable copy of `binds` for the shards' replicas (several shards only): taking it
    /// is a reference count, so a bind storm costs the binding shard, not every shard.
    published: Arc<FxHashMap<(u32, u16), Bound>>,
}

/// The ports bound before a restart (`<state_file>.ports`), for the rebind grace; `None`
/// (logged) without a usable state file.
pub fn open_rebind(cfg: &crate::config::Config) -> Option<BoundPorts> {
    match BoundPorts::open(&cfg.state_file.with_extension("ports"), cfg.rebind_grace) {
        Ok(r) => {
            if r.expected() > 0 {
                tracing::info!(
                    ports = r.expected(),
                    grace = ?cfg.rebind_grace,
                    "messages for ports bound before the restart wait for their apps"
                );
            }
            Some(r)
        }
        Err(e) => {
            tracing::warn!("no rebind grace: {e}");
            None
        }
    }
}

/// What the poll threads share (one per rdsd).
pub struct Fabric {
    n: usize,
    /// `rings[from * n + to]`; empty with one shard.
    rings: Vec<HeapRing>,
    /// `notes[from * n + to]`; empty with one shard.
    notes: Vec<ArrayQueue<Note>>,
    /// Per shard: the eventfd that wakes it when parked (the control thread rings it too).
    doorbells: Vec<Arc<OwnedFd>>,
    dview: DaemonView,
    dir: Mutex<Directory>,
    dir_version: AtomicU64,
    /// `idle = "watch"`: bit per shard that last found an app thread asleep in a receive on
    /// its sockets (written by that shard's idle look only, at most once a millisecond).
    watching: AtomicU64,
    /// Which shard owns each network connection (shared with the kernel-TCP accept thread).
    pub(super) owners: Arc<crate::transport::ConnOwners>,
}

impl Fabric {
    /// The fabric of `doorbells.len()` shards.
    pub fn new(
        doorbells: Vec<Arc<OwnedFd>>,
        dview: DaemonView,
        rebind: Option<BoundPorts>,
        owners: Arc<crate::transport::ConnOwners>,
    ) -> Fabric {
        let n = doorbells.len();
        let pairs = if n > 1 { n * n } else { 0 };
        Fabric {
            n,
            // A ring to oneself stays empty (and untouched: its pages are never faulted in).
            rings: (0..pairs).map(|_| HeapRing::new(PAIR_RING_BYTES)).collect(),
            notes: (0..pairs)
                .map(|_| ArrayQueue::new(NOTES_PER_PAIR))
                .collect(),
            doorbells,
            dview,
            dir: Mutex::new(Directory {
                rebind,
                ..Directory::default()
            }),
            dir_version: AtomicU64::new(0),
            watching: AtomicU64::new(0),
            owners,
        }
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.n
    }

    /// The directory, for a bind, a close or a new congestion entry. Never on the fast path.
    pub(super) fn dir(&self) -> MutexGuard<'_, Directory> {
        // A poll thread that panicked holding it has taken rdsd down already.
        self.dir.lock()
    }

    /// Call after changing the directory's bindings, with the directory still locked.
    pub(super) fn binds_changed(&self, dir: &mut Directory) {
        if self.n > 1 {
            dir.published = Arc::new(dir.binds.clone());
            self.dir_version.fetch_add(1, Ordering::Release);
        }
    }

    /// Shard `k`'s end: its producers and consumers.
    pub fn link(self: &Arc<Fabric>, k: usize) -> ShardLink {
        let n = self.n;
        let ring = |from: usize, to: usize| self.rings.get(from * n + to).map(|r| r.ring());
        ShardLink {
            shard: k,
            out: (0..n)
                .filter_map(|to| ring(k, to).map(Producer::new))
                .collect(),
            inp: (0..n)
                .filter_map(|from| ring(from, k).map(Consumer::new))
                .collect(),
            stalled: 0,
            dirty: 0,
            stash: VecDeque::with_capacity(1024),
            kept: VecDeque::new(),
            closing: false,
            kept_bytes: 0,
            release: None,
            replica: Arc::default(),
            replica_version: u64::MAX,
            last_owner: None,
            waited_on_receiver: false,
            records_out: 0,
            records_in: 0,
            fabric: self.clone(),
        }
    }
}

/// One shard's end of the fabric.
pub struct ShardLink {
    pub(super) shard: usize,
    /// `out[to]` (an unused one for `to == shard`).
    out: Vec<Producer<RawRing>>,
    /// `inp[from]`.
    pub(super) inp: Vec<Consumer<RawRing>>,
    /// Bit per input ring stopped at a message its destination cannot take yet.
    pub(super) stalled: u64,
    /// Bit per shard this pass sent something to (publish and wake at the end of the pass).
    dirty: u64,
    /// Notes that found their queue full, oldest first, with their target.
    stash: VecDeque<(usize, Note)>,
    /// Messages of closing sockets that found their pair ring full, oldest first.
    kept: VecDeque<(usize, Envelope, Vec<u8>)>,
    /// See `set_closing`.
    closing: bool,
    /// Payload bytes in `kept` (at most `MAX_KEPT_BYTES`).
    kept_bytes: usize,
    /// Releases for local senders of other shards, coalesced while they name the same socket
    /// (one note per burst, not per message): (shard, token, bytes).
    release: Option<(usize, u64, u64)>,
    /// Bindings as last read from the directory.
    replica: Arc<FxHashMap<(u32, u16), Bound>>,
    replica_version: u64,
    /// The last binding `owner` found in `replica` (cleared when it changes): a sender mostly
    /// sends to the same port again, and the hash lookup was about 60 instructions a message.
    last_owner: Option<((u32, u16), Bound)>,
    /// A local send of this pass waited because its receiver is backed up (`Bound`): a parked
    /// thread looks again soon (the receiver's reads wake only the receiver's thread).
    pub(super) waited_on_receiver: bool,
    /// Records pushed into the other shards' pair rings, and taken from theirs (the
    /// `shard_records_out` and `_in` counters, published with the poll core's).
    pub(super) records_out: u64,
    pub(super) records_in: u64,
    pub(super) fabric: Arc<Fabric>,
}

impl ShardLink {
    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.fabric.n
    }

    /// `idle = "watch"`: records whether this shard has an app thread asleep in a receive
    /// (`mine`); true if this or another shard has one, so that none parks while a sender's
    /// message for it may have to cross a parked thread first.
    pub(super) fn watching(&self, mine: bool) -> bool {
        let bit = 1u64 << self.shard;
        let all = self.fabric.watching.load(Ordering::Relaxed);
        let all = match (all & bit != 0, mine) {
            (false, true) => self.fabric.watching.fetch_or(bit, Ordering::Relaxed) | bit,
            (true, false) => self.fabric.watching.fetch_and(!bit, Ordering::Relaxed) & !bit,
            _ => all,
        };
        all != 0
    }

    /// Refreshes the replica of the bindings if the directory changed. `force`: even if the
    /// version was seen (it is a load either way; the copy happens only on change).
    #[inline]
    pub(super) fn refresh(&mut self) -> bool {
        let v = self.fabric.dir_version.load(Ordering::Acquire);
        if v == self.replica_version {
            return false;
        }
        let dir = self.fabric.dir();
        self.replica = dir.published.clone();
        self.replica_version = self.fabric.dir_version.load(Ordering::Acquire);
        drop(dir);
        self.last_owner = None;
        true
    }

    /// The shard bound at `(addr, port)`, if another one, and whether that socket is backed
    /// up (see [`Bound`]).
    #[inline]
    pub(super) fn owner(&mut self, addr: u32, port: u16) -> Option<(usize, bool)> {
        if !matches!(&self.last_owner, Some((key, _)) if *key == (addr, port)) {
            self.look_up_owner(addr, port);
        }
        let (_, b) = self.last_owner.as_ref()?;
        let shard = usize::from(b.shard);
        (shard != self.shard).then(|| (shard, b.backed_up.load(Ordering::Relaxed)))
    }

    /// `owner` past its one-entry cache: the replica, refreshed first if the port is not in it
    /// (bound just now on another shard); the binding found is cached (none: the cache is
    /// emptied).
    #[cold]
    fn look_up_owner(&mut self, addr: u32, port: u16) {
        if !self.replica.contains_key(&(addr, port)) {
            self.refresh();
        }
        self.last_owner = self
            .replica
            .get(&(addr, port))
            .map(|b| ((addr, port), b.clone()));
    }

    /// Queues a message for shard `to`: `Err(())` if its ring is full (try again later).
    pub(super) fn forward(
        &mut self,
        to: usize,
        env: Envelope,
        payload: &crate::seam::MsgBytes<'_>,
    ) -> Result<(), ()> {
        self.dirty |= 1 << to;
        // Behind kept messages to the same shard: wait (order), or keep this one too.
        if !self.has_kept(to) && push(&mut self.out[to], env, payload).is_ok() {
            self.records_out += 1;
        } else {
            if !self.closing {
                return Err(());
            }
            if self.kept_bytes + payload.len() > MAX_KEPT_BYTES {
                // Closing sockets of apps whose receivers never read: stop keeping (their
                // messages are dropped and counted, as without several shards).
                return Err(());
            }
            let mut bytes = Vec::new();
            payload.copy_into(&mut bytes);
            self.kept_bytes += bytes.len();
            self.kept.push_back((to, env, bytes));
        }
        Ok(())
    }

    /// Queues an in-place delivery (`Envelope::DeliverRef`) for shard `to`: `Err(())` if its
    /// ring is full or copies wait before it (try again later, or copy). Never kept: the
    /// caller copies instead while a socket closes.
    pub(super) fn forward_ref(&mut self, to: usize, env: Envelope) -> Result<(), ()> {
        debug_assert!(matches!(
            env,
            Envelope::DeliverRef { .. } | Envelope::SendRef { .. }
        ));
        self.dirty |= 1 << to;
        if self.closing || self.has_kept(to) {
            return Err(());
        }
        let head = env.emit();
        let header = RecordHeader::data(ENVELOPE_LEN as u32, 0, 0);
        match self.out[to].push_with(header, |mem, off| {
            shm_api::ring::RingMemory::write(mem, off, &head)
        }) {
            Ok(()) => {
                self.records_out += 1;
                Ok(())
            }
            Err(PushError::Full) => Err(()),
            Err(PushError::TooLarge) => unreachable!("an envelope fits"),
        }
    }

    /// True while a closing socket's messages are kept rather than refused (`set_closing`).
    pub(super) fn is_closing(&self) -> bool {
        self.closing
    }

    /// Whether messages for shard `to` wait in the kept queue (its pair ring was full).
    /// Almost always empty: one test, not a `VecDeque` walk, per forwarded message.
    #[inline]
    pub(super) fn has_kept(&self, to: usize) -> bool {
        !self.kept.is_empty() && self.kept.iter().any(|k| k.0 == to)
    }

    /// Queues a message that must go (a group message already numbered, a `Cancel`): kept in
    /// order if the pair ring is full. `Err(())` only past `MAX_KEPT_BYTES` (never for an
    /// envelope without payload).
    pub(super) fn forward_or_keep(
        &mut self,
        to: usize,
        env: Envelope,
        payload: &crate::seam::MsgBytes<'_>,
    ) -> Result<(), ()> {
        let closing = std::mem::replace(&mut self.closing, true);
        let r = self.forward(to, env, payload);
        self.closing = closing;
        r
    }

    /// While set, a message that finds its pair ring full is copied and kept (sent first, in
    /// order, as soon as there is room) instead of refused: a closing socket's sent messages
    /// are delivered, not dropped, whatever the other shard's backlog. Bounded by one tx ring
    /// per closing socket; allocates only then.
    pub(super) fn set_closing(&mut self, on: bool) {
        self.closing = on;
    }

    /// Moves kept messages into their pair rings while there is room; true if some remain.
    pub(super) fn flush_kept(&mut self) -> bool {
        let mut blocked = 0u64;
        let mut i = 0;
        while i < self.kept.len() {
            let (to, env, ref bytes) = self.kept[i];
            if blocked & (1 << to) == 0 {
                let payload = crate::seam::MsgBytes::from_slice(bytes);
                if push(&mut self.out[to], env, &payload).is_ok() {
                    self.records_out += 1;
                    self.dirty |= 1 << to;
                    self.kept_bytes -= bytes.len();
                    self.kept.remove(i);
                    continue;
                }
                blocked |= 1 << to;
            }
            i += 1;
        }
        !self.kept.is_empty()
    }

    /// Queues a note for shard `to`; never lost (stashed while its queue is full).
    pub(super) fn note(&mut self, to: usize, note: Note) {
        debug_assert!(to != self.shard);
        self.dirty |= 1 << to;
        if !self.stash.is_empty()
            || self.fabric.notes[self.shard * self.fabric.n + to]
                .push(note)
                .is_err()
        {
            self.stash.push_back((to, note));
        }
    }

    /// `len` bytes of the local sender `token` of shard `to` are delivered: release them (the
    /// note goes out when the next release names another socket, or at `flush_release`).
    #[inline]
    pub(super) fn release(&mut self, to: usize, token: u64, len: u64) {
        match self.release.as_mut() {
            Some((t, k, n)) if *t == to && *k == token => *n += len,
            _ => {
                self.flush_release();
                self.release = Some((to, token, len));
            }
        }
    }

    /// Sends the coalesced release, if any.
    #[inline]
    pub(super) fn flush_release(&mut self) {
        if let Some((to, token, len)) = self.release.take() {
            self.note(to, Note::Release { token, len });
        }
    }

    /// Queues a note for every other shard.
    pub(super) fn note_all(&mut self, note: Note) {
        let (n, me) = (self.fabric.n, self.shard);
        for to in (0..n).filter(|&t| t != me) {
            self.note(to, note);
        }
    }

    /// True when no other shard has published a note or a pair-ring record for this one:
    /// per other shard two loads of the note queue and one of the ring's producer position.
    #[inline]
    pub(super) fn inputs_idle(&self) -> bool {
        let (n, me) = (self.fabric.n, self.shard);
        (0..n).all(|from| {
            from == me
                || (self.fabric.notes[from * n + me].is_empty()
                    && self.inp[from].nothing_published())
        })
    }

    /// The next note from shard `from`.
    pub(super) fn take_note(&self, from: usize) -> Option<Note> {
        let q = &self.fabric.notes[from * self.fabric.n + self.shard];
        // Most passes find no note: two loads, not a pop (about 35 instructions when empty).
        if q.is_empty() {
            return None;
        }
        q.pop()
    }

    /// Retries stashed notes; true if some are still waiting.
    pub(super) fn flush_stash(&mut self) -> bool {
        while let Some(&(to, note)) = self.stash.front() {
            if self.fabric.notes[self.shard * self.fabric.n + to]
                .push(note)
                .is_err()
            {
                return true;
            }
            self.dirty |= 1 << to;
            self.stash.pop_front();
        }
        false
    }

    /// Anything for the end of the pass: stashed notes, kept messages, pair rings or note
    /// queues written this pass. Most passes have none: three tests instead of three calls.
    #[inline]
    pub(super) fn has_output(&self) -> bool {
        self.dirty != 0 || !self.stash.is_empty() || !self.kept.is_empty()
    }

    /// End of a pass, first half: the pair rings this pass wrote to become visible (stores);
    /// true if there was one. The caller then makes a SeqCst fence, which pairs with the one a
    /// parking shard makes between raising its flag and its last look at its inputs (the
    /// same protocol as an app's doorbell), and calls [`Self::ring_sleepers_after_fence`].
    #[inline(never)]
    pub(super) fn publish_rings(&mut self) -> bool {
        if self.dirty == 0 {
            return false;
        }
        for to in 0..self.fabric.n {
            if self.dirty & (1 << to) != 0 {
                self.out[to].publish();
            }
        }
        true
    }

    /// End of a pass, second half (after the fence): rings the doorbell of each shard written
    /// to that sleeps.
    #[inline(never)]
    pub(super) fn ring_sleepers_after_fence(&mut self) {
        for to in 0..self.fabric.n {
            if self.dirty & (1 << to) != 0
                && self.fabric.dview.sleeping(to).load(Ordering::Relaxed) != 0
            {
                shm_api::sys::eventfd_signal(self.fabric.doorbells[to].as_raw_fd());
            }
        }
        self.dirty = 0;
    }

    /// Work that makes a parked shard wake on a timer: stalled input, stashed notes.
    pub(super) fn needs_retry(&self) -> bool {
        self.stalled != 0
            || !self.stash.is_empty()
            || !self.kept.is_empty()
            || self.waited_on_receiver
    }
}

/// Appends one message to a pair ring (not yet published); `Err` if it is full.
fn push(
    out: &mut Producer<RawRing>,
    env: Envelope,
    payload: &crate::seam::MsgBytes<'_>,
) -> Result<(), ()> {
    let len = ENVELOPE_LEN + payload.len();
    let head = env.emit();
    let header = RecordHeader::data(len as u32, 0, 0);
    let pushed = out.push_with(header, |mem, off| {
        shm_api::ring::RingMemory::write(mem, off, &head);
        // SAFETY: `off + ENVELOPE_LEN .. off + len` lies in the pair ring's data area, reserved
        // for this record; the source is an app ring, a receive buffer or a kept copy, never
        // this ring.
        unsafe { payload.copy_to(mem.data_ptr().add(off + ENVELOPE_LEN)) };
    });
    match pushed {
        Ok(()) => Ok(()),
        Err(PushError::Full) => Err(()),
        Err(PushError::TooLarge) => unreachable!("pair rings hold the largest message"),
    }
}

/// A record of a pair ring: its envelope and where its payload lies: after the envelope, or,
/// for an in-place delivery (returned as `Envelope::Deliver` with the hold's token) or send
/// (`Envelope::SendRef`), in the sending app's tx ring, which the hold keeps mapped and
/// unwritten until the release. Inlined into `drain_fabric`: out of line, its envelope was
/// returned through memory (−39 instructions a crossing message, `bench/shards-callgrind.sh`).
#[inline]
pub(super) fn open_record(ring: &Consumer<RawRing>, rec: &Record) -> (Envelope, *const u8, usize) {
    assert!(
        rec.header.len as usize >= ENVELOPE_LEN,
        "pair ring record shorter than its envelope"
    );
    // One fixed-size read (`read_payload`'s variable length cost a memcpy call per record).
    // SAFETY: `payload_offset + header.len`, the envelope included, was validated against the
    // data area, which the fabric keeps allocated for as long as this shard's link exists.
    let head: [u8; ENVELOPE_LEN] = unsafe {
        ring.memory()
            .data_ptr()
            .add(rec.payload_offset)
            .cast::<[u8; ENVELOPE_LEN]>()
            .read_unaligned()
    };
    let env = Envelope::parse(&head);
    if let Envelope::DeliverRef {
        laddr,
        faddr,
        sport,
        dport,
        token,
        ptr,
        len,
    } = env
    {
        let env = Envelope::Deliver {
            laddr,
            faddr,
            sport,
            dport,
            token,
        };
        return (env, ptr as usize as *const u8, len as usize);
    }
    if let Envelope::SendRef { ptr, len, .. } = env {
        return (env, ptr as usize as *const u8, len as usize);
    }
    let len = rec.header.len as usize - ENVELOPE_LEN;
    // SAFETY: the consumer validated `payload_offset + header.len` against the data area,
    // which the fabric keeps allocated for as long as this shard's link exists.
    let ptr = unsafe {
        ring.memory()
            .data_ptr()
            .add(rec.payload_offset + ENVELOPE_LEN)
            .cast_const()
    };
    (env, ptr, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        for e in [
            Envelope::Deliver {
                laddr: 0x7f00_0001,
                faddr: 0x0a00_0002,
                sport: 4000,
                dport: 5000,
                token: 0,
            },
            Envelope::Send {
                laddr: 1,
                faddr: 2,
                sport: 3,
                dport: 4,
                token: 0x0123_4567_89ab,
                ack_required: true,
            },
            Envelope::GroupDeliver {
                laddr: 5,
                faddr: 6,
                sport: 7,
                dport: 8,
                token: 9,
                stamp: 0x0102_0304_0506_0708,
                charge: 512 << 10,
            },
            Envelope::DeliverRef {
                laddr: 10,
                faddr: 11,
                sport: 12,
                dport: 13,
                token: 1 << 63 | 14,
                ptr: 0x7f12_3456_7000,
                len: 1 << 20,
            },
            Envelope::SendRef {
                laddr: 15,
                faddr: 16,
                sport: 17,
                dport: 18,
                token: 1 << 63 | 19,
                ptr: 0x7f12_3456_8000,
                len: 1 << 20,
                ack_required: true,
            },
            Envelope::SendRef {
                laddr: 20,
                faddr: 21,
                sport: 22,
                dport: 23,
                token: 1 << 63 | 24,
                ptr: 0x7f12_3456_9000,
                len: 16 << 10,
                ack_required: false,
            },
            Envelope::Cancel {
                laddr: 25,
                sport: 26,
                dest: Some((27, 28)),
            },
            Envelope::Cancel {
                laddr: 29,
                sport: 30,
                dest: None,
            },
        ] {
            assert_eq!(Envelope::parse(&e.emit()), e);
        }
    }

    #[test]
    fn forwarded_tokens_name_their_shard() {
        let t = (1023u64 << 44) | (4095 << 32) | 0xffff_ffff;
        let f = forwarded_token(30, t);
        assert_eq!(unforward(f), Some((30, t)));
        assert_eq!(unforward(t), None);
        assert_eq!(unforward(super::super::inplace::IN_PLACE | 7), None);
        // A forwarded in-place send's hold goes back to its shard as the hold it is.
        let hold = super::super::inplace::IN_PLACE | 7;
        assert_eq!(unforward(forwarded_token(3, hold)), Some((3, hold)));
    }
}

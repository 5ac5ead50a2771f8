//! The transport seam (DESIGN §1a): the only types a transport and the poll core share.
//!
//! * [`Transport`]: what the poll core asks of a transport (send a message, one pass of I/O,
//!   cancel, congestion changes, park descriptors, counters).
//! * [`Upcalls`]: what a transport asks of the poll core's socket table (deliver a message,
//!   release send-buffer bytes, mirror a peer's congestion map, wake senders of uncongested
//!   ports, read the local map). It is the narrow interface a transport sees instead of the
//!   poll core itself.
//! * [`MsgBytes`]: a payload that may live in an app's shared memory, which must never be
//!   turned into a Rust reference (the app can write it at any time): it is only copied.
//!
//! `poll/` and `transport/` both depend on this module and never on each other (the poll core
//! receives its transports as a list built by `transport::build`).

use rds_proto::wire::CongMap;
use std::marker::PhantomData;
use std::net::Ipv4Addr;
use std::time::Duration;

/// Payload bytes handed across the seam, valid for the duration of one call.
///
/// The bytes may live in an app's tx ring, which the app can scribble concurrently; building a
/// `&[u8]` over them would be undefined behaviour, so this type only offers copies.
#[derive(Clone, Copy, Debug)]
pub struct MsgBytes<'a> {
    ptr: *const u8,
    len: usize,
    _life: PhantomData<&'a [u8]>,
}

impl<'a> MsgBytes<'a> {
    /// Bytes owned by rdsd (a receive buffer, a test vector).
    pub fn from_slice(s: &'a [u8]) -> MsgBytes<'a> {
        MsgBytes {
            ptr: s.as_ptr(),
            len: s.len(),
            _life: PhantomData,
        }
    }

    /// Bytes in shared memory.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay mapped and inside one allocation for `'a`. Its contents may
    /// change under us; readers only copy them.
    pub unsafe fn from_shared(ptr: *const u8, len: usize) -> MsgBytes<'a> {
        MsgBytes {
            ptr,
            len,
            _life: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the bytes start (for a zero-copy transport that hands the address to a device;
    /// never to be read through a reference).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// True for a zero-length message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the bytes to `dst`.
    ///
    /// # Safety
    /// `dst..dst + len` must be valid for writes and must not overlap the source.
    pub unsafe fn copy_to(&self, dst: *mut u8) {
        // SAFETY: the source range is valid for 'a (constructor contract); the destination is
        // the caller's (this function's contract). A raw copy never forms a reference.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst, self.len) }
    }

    /// Appends a copy to `v`.
    pub fn append_to(&self, v: &mut Vec<u8>) {
        let at = v.len();
        v.reserve(self.len);
        // SAFETY: `v` has room for `len` more bytes after reserve, and rdsd's own vector
        // cannot overlap the source; the new length covers exactly the bytes just written.
        unsafe {
            self.copy_to(v.as_mut_ptr().add(at));
            v.set_len(at + self.len);
        }
    }

    /// Replaces `v`'s contents with a copy (reusing its capacity).
    pub fn copy_into(&self, v: &mut Vec<u8>) {
        v.clear();
        v.reserve(self.len);
        // SAFETY: `v` has room for `len` bytes after reserve, and rdsd's own vector cannot
        // overlap the source; the new length covers exactly the bytes just written.
        unsafe {
            self.copy_to(v.as_mut_ptr());
            v.set_len(self.len);
        }
    }
}

/// A message arriving for a local socket.
#[derive(Clone, Copy, Debug)]
pub struct Incoming<'a> {
    /// Local (destination) address.
    pub laddr: u32,
    /// Peer (source) address.
    pub faddr: u32,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Payload.
    pub payload: MsgBytes<'a>,
}

/// What became of a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    /// It is in the receiver's rx ring.
    Yes,
    /// The receiver's rx ring is full: keep the message and try again later (a network
    /// transport pauses the path; loopback leaves it on the sender's ring).
    Full,
    /// Nobody is bound there (rds(7): silently dropped; already counted).
    NoSocket,
}

/// The poll core's socket table, as a transport sees it.
pub trait Upcalls {
    /// Puts a message in the rx ring of the socket bound at `laddr:dport`.
    fn deliver(&mut self, msg: Incoming<'_>) -> Delivered;
    /// Makes every delivery so far visible to its receivers. While a transport polls,
    /// deliveries may wait unpublished, so that a receiver's ring is published once per
    /// burst; a transport calls this before it records them as delivered (the receive state
    /// that survives a restart must never run ahead of what the receivers can read), and
    /// [`Upcalls::wake_receivers`] after. Stores only: nothing here enters the kernel.
    fn publish_deliveries(&mut self) {}
    /// Wakes the blocked receivers of what [`Upcalls::publish_deliveries`] published (a
    /// syscall each). Apart from the publish so that the record of the deliveries comes
    /// between: a SIGKILL that lands while rdsd is in the kernel, or preempted on its way out
    /// (the woken app may take the CPU), then finds them recorded. What a transport leaves
    /// unwoken is woken at the end of its poll.
    fn wake_receivers(&mut self) {}
    /// A message sent with `token` left the transport for good (acknowledged or cancelled):
    /// give its `len` bytes back to the sender's send buffer.
    fn release(&mut self, token: u64, len: u64);
    /// Our current congestion map for a local address (all clear if none is bound there).
    fn local_map(&self, laddr: u32) -> &CongMap;
    /// A peer's congestion map changed: mirror it where the apps test it.
    fn peer_map_changed(&mut self, faddr: u32, map: &CongMap);
    /// A peer cleared congestion on ports `mask` (bit = port % 64): wake senders and monitors.
    fn uncongested(&mut self, mask: u64);
}

/// One message handed to a transport. The payload is valid for the call only: a transport that
/// keeps it copies it (or, for a zero-copy transport, keeps the ring space; see DESIGN §1a).
#[derive(Clone, Copy, Debug)]
pub struct OutMsg<'a> {
    /// Sender's bound address.
    pub laddr: u32,
    /// Destination address.
    pub faddr: u32,
    /// Sender's bound port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Payload.
    pub payload: MsgBytes<'a>,
    /// Comes back through [`Upcalls::release`] when a queued message is acknowledged or
    /// cancelled.
    pub token: u64,
    /// `Some(region id)` when the poll core lets the transport keep the payload in place: the
    /// bytes lie in that app region (see [`Transport::region_attached`]) and stay untouched
    /// until `token` is released, if `send` answers [`SendOutcome::QueuedInPlace`].
    pub in_place: Option<u64>,
    /// The sender's send buffer is at least half used with this message (the kernel's rule):
    /// the receiver should acknowledge it at once (`RDS_FLAG_ACK_REQUIRED`), not delay the
    /// ACK that gives the bytes back.
    pub ack_required: bool,
}

/// What a transport did with a message from [`Transport::send`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutcome {
    /// Handed to the receiver already (its send-buffer bytes are free now).
    Delivered,
    /// Taken; the bytes come back through [`Upcalls::release`].
    Queued,
    /// Taken without a copy (only when `in_place` was offered): the payload is read from the
    /// app's ring until [`Upcalls::release`], and the ring space is not reused before then.
    QueuedInPlace,
    /// The destination can't take it now: leave it on the sender's ring and retry.
    Blocked,
    /// Dropped (already counted by whoever dropped it).
    Dropped,
}

/// A transport under the poll core: loopback, kernel TCP, later DPDK and RDMA.
///
/// `send` and `poll` never block; steady state allocates nothing. Everything a transport
/// learns from the wire reaches the sockets through [`Upcalls`].
pub trait Transport: Send {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// True if this transport carries traffic to `dest` (the first transport that does wins).
    fn routes_to(&self, dest: Ipv4Addr) -> bool;
    /// Takes one message.
    fn send(&mut self, up: &mut dyn Upcalls, msg: OutMsg<'_>) -> SendOutcome;
    /// True if this transport sends payloads in place from app memory (zero copy): the poll
    /// core then offers `in_place` in [`OutMsg`].
    fn zero_copy(&self) -> bool {
        false
    }
    /// With [`Transport::zero_copy`]: the smallest payload the poll core offers in place.
    fn zero_copy_min(&self) -> usize {
        0
    }
    /// An app region was mapped (at attach): a zero-copy transport registers it once, here.
    ///
    /// `base..base + len` stays mapped until [`Transport::region_detached`] with the same id,
    /// which comes only after every message sent in place from it was released.
    fn region_attached(&mut self, _id: u64, _base: *const u8, _len: usize) {}
    /// The region is about to be unmapped; no message refers to it any more.
    fn region_detached(&mut self, _id: u64) {}
    /// One pass of I/O; returns the work done (0 = idle).
    fn poll(&mut self, _up: &mut dyn Upcalls) -> usize {
        0
    }
    /// RDS_CANCEL_SENT_TO: drop what `laddr:sport` queued for `dest` (`None` = everything);
    /// each dropped message comes back through [`Upcalls::release`] on a later poll.
    fn cancel(&mut self, _laddr: u32, _sport: u16, _dest: Option<(u32, u16)>) {}
    /// Our congestion map for `laddr` changed.
    fn local_congestion_changed(&mut self, _laddr: u32) {}
    /// Descriptors whose readiness must wake a parked poll core.
    fn park_fds(&self, _out: &mut Vec<libc::pollfd>) {}
    /// Longest the poll core may park before `poll` must run again.
    fn next_timeout(&self) -> Option<Duration> {
        None
    }
    /// Makes the transport's counters exact in the daemon's stats (they may be summed lazily).
    fn publish_counters(&self) {}
    /// Introspection (`rdsctl info`): appends one entry per connection. Called by the poll
    /// core only when the control thread asked for a snapshot (between passes, never in
    /// steady state), so it may allocate. Transports without connections keep the default.
    /// `listed`: how many more queued messages the snapshot may list (a budget shared by every
    /// transport of the poll thread, [`MAX_LISTED`]); lower it by those listed.
    fn snapshot(&mut self, _out: &mut Vec<ConnSnapshot>, _listed: &mut usize) {}
}

/// One path of a connection, as `rdsctl info -p` shows it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PathSnapshot {
    /// Path index (0..8).
    pub index: usize,
    /// `down`, `connecting`, `up`, `disconnecting` or `error`.
    pub state: &'static str,
    /// Next sequence number to be assigned on this path.
    pub next_tx_seq: u64,
    /// Next sequence number expected from the peer on this path.
    pub next_rx_seq: u64,
    /// Messages waiting to be written (send queue).
    pub queued_msgs: usize,
    /// Messages written and not yet acknowledged (retransmit queue).
    pub unacked_msgs: usize,
    /// Bytes written on the path's current transport connection.
    pub tx_stream_bytes: u64,
    /// Of those, bytes the transport has not confirmed (in flight; stream links only).
    pub unacked_bytes: Option<u64>,
    /// Reading stopped because a receiver's rx ring is full.
    pub rx_paused: bool,
    /// The path's transport connection: local and peer port (TCP; `None` for RDMA, or while
    /// no connection stands).
    pub local_port: Option<u16>,
    /// See `local_port`.
    pub peer_port: Option<u16>,
    /// Header bytes the message being received still needs (0 between messages).
    pub rx_header_rem: usize,
    /// Payload bytes the message being received still needs.
    pub rx_payload_rem: usize,
    /// The path's RDMA queue pair (`RDS_INFO_IB_CONNECTIONS`); `None` on other transports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaPathInfo>,
    /// The data messages waiting to be written, oldest first, within the snapshot's budget
    /// (the `Info` section `messages`, `RDS_INFO_SEND_MESSAGES`).
    #[serde(skip)]
    pub send_messages: Vec<rds_proto::MessageInfo>,
    /// The data messages written and not yet acknowledged, likewise
    /// (`RDS_INFO_RETRANS_MESSAGES`).
    #[serde(skip)]
    pub retrans_messages: Vec<rds_proto::MessageInfo>,
}

/// A path's RDMA queue pair, for introspection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RdmaPathInfo {
    /// The local port's GID rdma_cm resolved (a 128-bit GID, written as an IPv6 address).
    pub src_gid: std::net::Ipv6Addr,
    /// The peer's GID.
    pub dst_gid: std::net::Ipv6Addr,
    /// Send work requests the QP holds.
    pub max_send_wr: u32,
    /// Receive work requests the QP holds.
    pub max_recv_wr: u32,
    /// Scatter-gather entries per send.
    pub max_send_sge: u32,
}

/// Most queued messages one poll thread's snapshot lists of those received (rx rings) and,
/// separately, of those to send (every path's send and retransmit queues): it is built on the
/// poll core between two passes, so a million queued messages must not stall it or take its
/// memory. 16 Ki entries take the poll core well under a millisecond; the `Info` document that
/// carries them (about 150 bytes of JSON each) travels whole in a memory file
/// (`ctrl::INFO_WHOLE`).
pub const MAX_LISTED: usize = 16 * 1024;

/// One RDS connection (local address, peer address) of a network transport.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ConnSnapshot {
    /// Transport name (`tcp`).
    pub transport: &'static str,
    /// The poll thread that owns the connection and polls its paths (set by the poll core).
    pub shard: usize,
    /// Local address.
    pub laddr: Ipv4Addr,
    /// Peer address.
    pub faddr: Ipv4Addr,
    /// `up` (some path up), `connecting`, or `down`.
    pub state: &'static str,
    /// True when we connect (the smaller address).
    pub active: bool,
    /// Our generation number (GEN_NUM).
    pub generation: u32,
    /// The peer's generation number (0 while unknown).
    pub peer_generation: u32,
    /// Negotiated paths (`None` before the handshake).
    pub npaths: Option<u8>,
    /// Every path that is not idle (down, with nothing queued and nothing received).
    pub paths: Vec<PathSnapshot>,
}

//! The general layer: one deterministic state machine per RDS connection (local address, peer
//! address) over a stream transport, with 1..=8 paths. See the crate docs for the I/O contract.
//!
//! # Generation numbers and peer restarts
//!
//! Each side announces a random non-zero generation (`GEN_NUM`) in its handshake probes.
//! When a peer announces a generation different from the one we stored, it has restarted:
//!
//! * **Receive side:** `next_rx_seq` is reset to 0 on every path, so the fresh peer's numbering
//!   (which starts again at 1) is accepted.
//! * **Send side:** unlike the kernel (which flushes), we keep every queued and unacknowledged
//!   message and keep our sequence numbering running. A restarted peer has `next_rx_seq = 0`
//!   and accepts any number, so continuing the numbering can never make it drop a resend,
//!   whereas restarting at 1 could collide with numbers already on the wire. Unacknowledged
//!   messages are resent with `RETRANSMITTED` when their path reconnects.
//! * **Ordering of the reset:** a fresh connection queues its probe as the very first message
//!   on path 0 (sequence 1), so a surviving peer processes the new generation before any data
//!   on path 0; and the fresh side sends no data on paths > 0 until the peer's probe *pong*
//!   proves that the peer has processed our probe. Probes are processed even if their sequence
//!   number looks old, and never move `next_rx_seq` (deviation: the kernel applies the
//!   duplicate rule to them).
//!
//! The resulting guarantee, with TCP acknowledgement as the delivery point: a receiving
//! application never sees a duplicate or a reordering; across a restart it can see one gap
//! (messages the restarted side had accepted but not yet handed to TCP, or had received from
//! TCP but not yet delivered).
//!
//! # Restarts of our own daemon: restored receive state
//!
//! The guarantee above assumes the sender learns, before a restarted receiver comes back,
//! which bytes it consumed. After a crash that acknowledgement can be lost: the surviving
//! peer then resends, flagged `RETRANSMITTED`, messages we had already delivered, and a fresh
//! connection (`next_rx_seq = 0`) would deliver them again. To prevent that, the I/O layer
//! persists, per connection, the peer generation and one past the last sequence number
//! delivered to a socket on each path, and hands them to [`Connection::restore_rx_state`]
//! after the restart; the duplicate rule then drops exactly the resends we had delivered
//! (the persistence rule and the reasoning are on that method). A peer that restarted too
//! announces a new generation, and the rule above (reset `next_rx_seq` on a generation
//! change) discards the restored numbers before its data matters. [`Connection::rx_state`]
//! shows the current state. The numbers are per path, so both sides must agree on which
//! connection is which path: a connect of ours for a path > 0 that the restarted peer answers
//! first would be its path 0 (see [`Connection::handle_connected`], which closes it before it
//! carries data).
//!
//! # Congestion maps
//!
//! One pending-map flag per connection (spec §8): a path coming up or
//! [`Connection::local_congestion_changed`] sets it, and the next frame started on any up
//! path ([`Connection::poll_transmit_chunk`] with no frame in progress, or
//! [`Connection::poll_transmit_slices`] behind the frames already started) is the map (a copy
//! of the caller's current map), which clears the flag; [`Connection::has_pending_transmit`]
//! reports it on every up path until then. A path holds one map snapshot, so it starts no
//! frame while a map is pending and its previous map frame is not completely written. A path
//! that goes down with its map frame started but not completely written sets the flag again.
//! Maps carry sequence number 0 and are never retransmitted.
//!
//! # Doorbell pacing
//!
//! The passive side rings [`Event::Doorbell`] while it has data queued and path 0 is down: the
//! first time at once, then never less than a bound after the previous doorbell. The bound
//! starts at [`Config::doorbell_min`] and doubles after each doorbell up to
//! [`Config::reconnect_max`]; the actual interval is in `[bound, 1.5 * bound)`, capped at
//! `reconnect_max` but never below the bound. The pacing is reset when path 0 comes up.

mod config;
mod event;
mod path;
mod timers;

pub use config::{Config, ConfigError, PathChoice};
pub use event::{
    AcceptError, Counters, Delivery, Event, PathError, Received, SendError, SendFlags,
    TransmitChunk, TransmitSlices,
};
pub use path::PathState;

/// One data message of a path's queues, as [`Connection::message_info`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageInfo {
    /// Its sequence number on the path.
    pub seq: u64,
    /// Payload bytes.
    pub len: u32,
    /// Sending port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

use crate::rng::SplitMix64;
use crate::time::Instant;
use crate::wire::{
    flags, CongMap, ExtHeader, ExtHeaders, FrameRef, HeaderRepr, CONG_MAP_BYTES, LIVENESS_PORT,
    MAX_MSG_SIZE, MAX_PATHS, PROBE_PORT,
};
use path::{frame_slices, Body, Control, Message, RxPath, TxPath};
use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::time::Duration;
use timers::{Liveness, Timers};

/// One RDS connection to one peer. `P` is the payload type of queued messages (anything that
/// derefs to bytes: `Vec<u8>`, `bytes::Bytes`, a handle into a shared-memory buffer).
#[derive(Debug)]
pub struct Connection<P> {
    config: Config,
    /// Our address is the smaller one: we connect every path (spec §6.2).
    active: bool,
    /// Someone wants this connection (a send, `open`, or an inbound connection).
    opened: bool,
    tx: Vec<TxPath<P>>,
    /// Bit `p`: path `p` has queued or unacknowledged messages or started frames (see
    /// [`Connection::paths_with_work`]); kept where those lists change.
    busy: u8,
    rx: Vec<RxPath>,
    rng: SplitMix64,
    /// Negotiated path count; `None` until a probe or pong arrives.
    npaths: Option<u8>,
    /// Peer's generation number, 0 while unknown.
    peer_generation: u32,
    /// The peer announced SPORT_IDX in its latest probe.
    peer_sport_idx: bool,
    /// A probe pong arrived: the peer has processed our generation.
    peer_knows_our_generation: bool,
    /// A probe pong arrived since path 0 last came up; gates connects of paths > 0.
    path0_confirmed: bool,
    /// After routing changed, data on paths > 0 waits until the peer has processed what path 0
    /// carried before the switch (per-socket order across the switch).
    fanout_barrier: Option<Barrier>,
    /// Paths (bits) that may hold written messages a cancel left for the device to finish
    /// (`Config::hold_cancelled_written`); cleared by a look that finds none.
    cancel_held: u8,
    /// Probe pings started on the current path-0 connection.
    path0_pings_started: u32,
    /// Probe pongs (not flagged RETRANSMITTED) received on the current path-0 connection.
    path0_pongs_received: u32,
    peer_map: CongMap,
    /// Our congestion map must go out: set when a path comes up and on
    /// [`Connection::local_congestion_changed`], cleared when one up path starts the map frame
    /// (spec §8: one map per connection, on whichever path transmits first).
    cong_pending: bool,
    events: VecDeque<Event>,
    counters: Counters,
    /// Passive side: the minimum interval after the next doorbell (0 until the first one since
    /// path 0 was last up).
    doorbell_bound: Duration,
    /// Passive side: no doorbell before this instant (`None`: one may ring at once).
    doorbell_next: Option<Instant>,
    /// Reconnect backoff, doorbell, path-0 data gate and liveness check, with their earliest
    /// deadline cached.
    timers: Timers,
    /// Passive side: no liveness check starts before this instant.
    liveness_next: Option<Instant>,
}

/// The fan-out barrier: after the path count changes, a socket's messages may move from path 0
/// to another path, and must not overtake what path 0 still carries for it. TCP's
/// acknowledgement is not enough (acknowledged bytes can still wait in the peer's socket buffer,
/// or in a receiver that paused the path because a ring was full), so a probe ping is queued on
/// path 0 behind everything sent before the switch: its pong proves the peer has processed all
/// of it. Data on paths > 0 waits for both the acknowledgement and the pong. A multipath peer
/// always answers a probe ping (spec §9), however long it takes (a paused receiver answers
/// once it drains), so there is no timeout. A ping is never resent with RETRANSMITTED (a peer
/// that had processed it would drop the copy as a duplicate and never answer): after a path-0
/// drop the barrier takes a fresh ping, queued behind what is resent.
#[derive(Debug, Clone, Copy)]
struct Barrier {
    /// Highest path-0 sequence number queued before the switch.
    upto: u64,
    /// Sequence number of the barrier ping (a fresh one after every path-0 drop).
    ping_seq: u64,
    /// Its ordinal among the probe pings started on the current path-0 connection: the pong
    /// with the same ordinal answers it (the peer answers pings in order on the same path).
    ping_ordinal: Option<u32>,
    /// The pong arrived.
    confirmed: bool,
}

/// Which frame starts next on a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NextFrame {
    CongMap,
    Message,
}

/// Deterministic hash of a bound port (a 32-bit avalanche mix), for path selection.
fn port_hash(port: u16) -> u32 {
    mix32(u32::from(port))
}

/// The same hash of an unordered pair of ports.
fn port_pair_hash(a: u16, b: u16) -> u32 {
    let (lo, hi) = (a.min(b), a.max(b));
    mix32(u32::from(lo) << 16 | u32::from(hi))
}

fn mix32(x: u32) -> u32 {
    let mut x = x ^ 0x9e37_79b9;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^ (x >> 16)
}

fn push_released<P: AsRef<[u8]>>(events: &mut VecDeque<Event>, msg: &Message<P>) {
    if let Body::Data { token, .. } = msg.body {
        events.push_back(Event::Released {
            token,
            len: msg.len(),
        });
    }
}

impl<P: AsRef<[u8]>> Connection<P> {
    /// Creates the connection. Nothing happens on the wire until [`Connection::open`],
    /// [`Connection::send`] or an inbound connection.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let active = u32::from(config.local_addr) < u32::from(config.peer_addr);
        let mut conn = Connection {
            active,
            opened: false,
            tx: (0..MAX_PATHS).map(|_| TxPath::new()).collect(),
            busy: 0,
            rx: (0..MAX_PATHS).map(|_| RxPath::new()).collect(),
            rng: SplitMix64::new(config.rng_seed),
            npaths: None,
            peer_generation: 0,
            peer_sport_idx: false,
            peer_knows_our_generation: false,
            path0_confirmed: false,
            fanout_barrier: None,
            cancel_held: 0,
            path0_pings_started: 0,
            path0_pongs_received: 0,
            peer_map: CongMap::new(),
            cong_pending: false,
            events: VecDeque::new(),
            counters: Counters::default(),
            doorbell_bound: Duration::ZERO,
            doorbell_next: None,
            timers: Timers::new(),
            liveness_next: None,
            config,
        };
        // The probe is the first message of path 0, so a peer that knew an earlier generation
        // of ours resets its receive state before it reads any of our data.
        conn.queue_control(0, Control::ProbePing);
        Ok(conn)
    }

    // ----- accessors -----------------------------------------------------------------------

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Our address.
    pub fn local_addr(&self) -> Ipv4Addr {
        self.config.local_addr
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Ipv4Addr {
        self.config.peer_addr
    }

    /// What the message being received on `path` still needs: (header bytes, payload bytes)
    /// ([`rds_proto::wire::deframe::Deframer::remaining`](crate::wire::deframe::Deframer::remaining)).
    pub fn rx_remaining(&self, path: usize) -> (usize, usize) {
        self.rx.get(path).map_or((0, 0), |r| r.deframer.remaining())
    }

    /// True when we are the connecting (smaller-address) side.
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// State of a path (`Down` for indices >= 8).
    pub fn path_state(&self, path: usize) -> PathState {
        self.tx.get(path).map_or(PathState::Down, |t| t.state)
    }

    /// Negotiated number of paths, `None` before the handshake.
    pub fn npaths(&self) -> Option<u8> {
        self.npaths
    }

    /// Paths in use for routing: the negotiated count, or 1 before the handshake.
    pub fn npaths_effective(&self) -> usize {
        self.npaths.map_or(1, usize::from)
    }

    /// The peer's generation number, 0 while unknown.
    pub fn peer_generation(&self) -> u32 {
        self.peer_generation
    }

    /// Receive state for introspection and persistence checks: the peer's generation (0 while
    /// unknown) and `next_rx_seq` of every path. See [`Connection::restore_rx_state`].
    pub fn rx_state(&self) -> (u32, [u64; MAX_PATHS]) {
        let mut next = [0u64; MAX_PATHS];
        for (slot, rx) in next.iter_mut().zip(&self.rx) {
            *slot = rx.next_rx_seq;
        }
        (self.peer_generation, next)
    }

    /// Restores the receive state persisted by an earlier incarnation of this daemon, so that
    /// a peer that kept running does not get messages delivered twice after *our* restart.
    /// Call it right after [`Connection::new`], before any other input.
    ///
    /// `peer_generation` is the peer generation the persisted numbers belong to (0 = unknown)
    /// and `next_rx_seq[p]` is one past the sequence number of the last message of path `p`
    /// that really reached a socket (0 when none). The I/O layer maintains them so:
    ///
    /// * on each delivery, once the socket has the message: if [`Delivery::peer_generation`]
    ///   is non-zero and differs from the stored non-zero generation, zero every stored path
    ///   number; store the generation if non-zero; store `sequence + 1` for
    ///   [`Delivery::path`]. (Storing before the socket has it would turn a crash in between
    ///   into a lost message; storing after can only cost that one message, never duplicate
    ///   it.)
    /// * after each call that fed input, compare [`Connection::peer_generation`] with the
    ///   stored generation: if it is non-zero and differs, store it, zeroing every stored path
    ///   number if the stored one was non-zero ([`Event::PeerRestarted`] reports the latter
    ///   case; learning the first generation has no event). Do it before passing more input.
    ///   This keeps what the previous incarnation knew when it had not delivered anything
    ///   since: without it, a peer restart would go unnoticed.
    ///
    /// What it guarantees:
    ///
    /// * **The peer kept running** (it announces the same generation, or none): it resends
    ///   every message whose TCP acknowledgement it did not see, flagged `RETRANSMITTED`, with
    ///   its original number. Those we had delivered are below the restored `next_rx_seq` and
    ///   are dropped by the duplicate rule; the others are at or above it (a path's messages
    ///   reach us in sequence order) and are delivered. So the application sees no duplicate
    ///   and no reordering; it can miss only messages our transport had acknowledged but we had
    ///   not yet delivered.
    /// * **The peer restarted too and announces a new generation:** if our previous
    ///   incarnation never processed that generation, the new peer's probe is still the first
    ///   message it has for us on path 0 (the first message of a fresh connection, resent first
    ///   while unacknowledged), and its data on other paths waits for our pong; so the ordinary
    ///   generation logic resets `next_rx_seq` of every path to 0 before any of its data, the
    ///   restored numbers are discarded, and the new peer's messages are delivered. If our
    ///   previous incarnation processed it, the stored state already belongs to the new
    ///   generation (rules above). A crash after our transport acknowledged that probe but
    ///   before the new generation was stored leaves stale numbers; the new peer's resends
    ///   that precede its next probe on path 0 would be judged against them, but an rdsd peer
    ///   puts its generation on every resend of path 0, so the numbers are discarded first. A
    ///   kernel peer does not (the residual window: a loss, never a duplicate).
    /// * **The peer sends no `GEN_NUM`** (classic kernels, e.g. Debian's 6.1, put only `NPATHS`
    ///   in the probe): the restored numbers are kept, which is safe because the duplicate rule
    ///   only drops messages that are flagged `RETRANSMITTED` *and* below `next_rx_seq`. A
    ///   non-retransmitted message sets `next_rx_seq` to its number + 1, possibly backwards, as
    ///   in the kernel, so a restarted classic peer numbering again from 1 is delivered. The
    ///   only loss is the kernel's own between classic peers: a restarted classic peer whose
    ///   *first* messages on a path reach us as retransmissions below the old number. The same
    ///   holds for numbers restored with generation 0 (never learned): a later generation is a
    ///   first one, not a restart, as for a connection that was never restored.
    /// * **Path indices of a peer without `GEN_NUM`** (the 6.1 kernel, which has no SPORT_IDX
    ///   either): it reconnects all its paths at once after our restart, and we number them
    ///   first-free in accept order, so its path `k` may come back as our path `j` and its
    ///   resends would be judged by another path's number (a message delivered twice: VM lab
    ///   f1). So with generation 0 every path restores the highest number of all: a resend
    ///   below it is dropped whatever its path. The cost is a loss, never a duplicate: resends
    ///   of a less busy path that we had not delivered, in the gap at the restart.
    pub fn restore_rx_state(&mut self, peer_generation: u32, next_rx_seq: [u64; MAX_PATHS]) {
        self.peer_generation = peer_generation;
        let highest = next_rx_seq.iter().copied().max().unwrap_or(0);
        for (rx, next) in self.rx.iter_mut().zip(next_rx_seq) {
            rx.next_rx_seq = if peer_generation == 0 { highest } else { next };
        }
    }

    /// Counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Whether the peer's latest congestion map marks `port` congested (check before sending
    /// to it: `ENOBUFS`).
    pub fn peer_port_congested(&self, port: u16) -> bool {
        self.peer_map.test(port)
    }

    /// The peer's latest congestion map.
    pub fn peer_congestion_map(&self) -> &CongMap {
        &self.peer_map
    }

    /// The path a message from port `sport` to port `dport` takes right now.
    pub fn route(&self, sport: u16, dport: u16) -> usize {
        match self.npaths {
            Some(n) if n > 1 => {
                let h = match self.config.path_choice {
                    PathChoice::SourcePort => port_hash(sport),
                    // Symmetric: the reply takes the request's path.
                    PathChoice::PortPair => port_pair_hash(sport, dport),
                };
                (h % u32::from(n)) as usize
            }
            _ => 0,
        }
    }

    /// Next sequence number to be assigned on a path.
    pub fn next_tx_seq(&self, path: usize) -> u64 {
        self.tx.get(path).map_or(0, |t| t.next_tx_seq)
    }

    /// Next sequence number expected on a path.
    pub fn next_rx_seq(&self, path: usize) -> u64 {
        self.rx.get(path).map_or(0, |r| r.next_rx_seq)
    }

    /// Messages waiting for transmission on a path.
    pub fn queued_messages(&self, path: usize) -> usize {
        self.tx.get(path).map_or(0, |t| t.queue.len())
    }

    /// Messages sent on a path and not yet acknowledged.
    pub fn unacked_messages(&self, path: usize) -> usize {
        self.tx.get(path).map_or(0, |t| t.unacked.len())
    }

    /// The data messages of a path, oldest first: those waiting to be written (`unacked`
    /// false, `RDS_INFO_SEND_MESSAGES`) or those written and not yet acknowledged (true,
    /// `RDS_INFO_RETRANS_MESSAGES`). Control messages (pings, pongs, maps) are not listed.
    pub fn message_info(
        &self,
        path: usize,
        unacked: bool,
    ) -> impl Iterator<Item = MessageInfo> + '_ {
        let tx = self.tx.get(path);
        let list = tx.map(|t| if unacked { &t.unacked } else { &t.queue });
        list.into_iter()
            .flatten()
            .filter(|m| matches!(m.body, Body::Data { .. }) && !m.cancelled)
            .map(|m| MessageInfo {
                seq: m.seq,
                len: m.len() as u32,
                sport: m.sport,
                dport: m.dport,
            })
    }

    /// Bytes handed to the transport on the path's current connection.
    pub fn stream_offset(&self, path: usize) -> u64 {
        self.tx.get(path).map_or(0, |t| t.stream_offset)
    }

    /// True when any message (data or control) is queued or unacknowledged on any path.
    pub fn has_pending_messages(&self) -> bool {
        self.tx.iter().any(TxPath::has_pending_messages)
    }

    /// True when an application message is queued or unacknowledged on any path.
    pub fn has_pending_data(&self) -> bool {
        self.tx.iter().any(TxPath::has_pending_data)
    }

    /// May the front of `path`'s queue start now?
    fn data_allowed(&self, path: usize) -> bool {
        if path == 0 {
            self.timers.path0_gate().is_none()
                || self.tx[0]
                    .queue
                    .front()
                    .is_some_and(|m| matches!(m.body, Body::Control(_)))
        } else {
            self.peer_knows_our_generation
                && self.fanout_barrier.is_none()
                && self.tx[path].wait_pongs_above.is_none()
        }
    }

    /// True when [`Connection::poll_transmit_chunk`] (or [`Connection::poll_transmit_slices`]
    /// with room for a frame) would return bytes for this path.
    pub fn has_pending_transmit(&self, path: usize) -> bool {
        let Some(tx) = self.tx.get(path) else {
            return false;
        };
        tx.state == PathState::Up
            && (!tx.frames.is_empty()
                || self.cong_pending
                || (!tx.queue.is_empty() && self.data_allowed(path)))
    }

    /// The paths an I/O layer may have to visit for the engine's sake, bit `p` for path `p`:
    /// those with queued or unacknowledged messages or started frames, and every path while a
    /// congestion map is pending. A superset of the paths where
    /// [`Connection::has_pending_transmit`] or [`Connection::unacked_messages`] says so, in
    /// O(1): an I/O layer with several paths tests only these.
    pub fn paths_with_work(&self) -> u8 {
        self.debug_check_busy();
        if self.cong_pending {
            u8::MAX
        } else {
            self.busy
        }
    }

    /// Recomputes `path`'s bit of `busy` after its lists changed.
    fn sync_busy(&mut self, path: usize) {
        let bit = 1u8 << path;
        if self.tx[path].is_idle() {
            self.busy &= !bit;
        } else {
            self.busy |= bit;
        }
    }

    /// `busy` against the lists (debug builds).
    fn debug_check_busy(&self) {
        if cfg!(debug_assertions) {
            let busy = self
                .tx
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.is_idle())
                .fold(0u8, |m, (p, _)| m | 1 << p);
            assert_eq!(self.busy, busy, "busy paths mask out of date");
        }
    }

    // ----- events and timers ----------------------------------------------------------------

    /// Next action or notification for the I/O layer.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether [`Connection::poll_event`] has something (a pass with nothing to drain costs
    /// one test).
    #[inline]
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// When [`Connection::handle_timeout`] should next be called (cached: O(1)).
    #[inline]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.debug_check_paths_scheduled();
        self.timers.next()
    }

    /// Runs expired timers (reconnect backoff, doorbell, path-0 data gate, liveness check).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.timers.next().is_none_or(|at| at > now) {
            return;
        }
        for path in 0..MAX_PATHS {
            match self.timers.reconnect_at(path) {
                Some(at) if at <= now => {
                    self.timers.set_reconnect_at(path, None);
                    if self.wants_path(path) && self.tx[path].state == PathState::Down {
                        self.start_connect(path);
                    }
                }
                _ => {}
            }
        }
        if self.timers.doorbell_at().is_some_and(|at| at <= now) {
            self.maybe_ring_doorbell(now);
        }
        if self.timers.path0_gate().is_some_and(|at| at <= now) {
            // A peer that never answers pings (ping_enable off): send without the proof.
            self.timers.set_path0_gate(None);
            self.counters.path0_gate_timeouts += 1;
        }
        if let Some(check) = self.timers.liveness().filter(|l| l.deadline <= now) {
            // No pong: nothing of the peer's RDS is behind this stream any more (its TCP may
            // still be acknowledged, by a rebooted host's stack or a middlebox).
            self.timers.set_liveness(None);
            for path in 0..MAX_PATHS {
                if check.waiting[path] && self.tx[path].state == PathState::Up {
                    self.counters.stale_paths_closed += 1;
                    self.close_path(now, path);
                }
            }
        }
    }

    // ----- connection management --------------------------------------------------------------

    /// Declares the connection wanted: the active side starts connecting path 0 (and later the
    /// other paths). The passive side waits for the peer. [`Connection::send`] implies this.
    ///
    /// O(1) once opened (every send calls it): while `opened` holds, every change that can
    /// make a path wanted schedules it (see `schedule_paths`), so there is nothing to do.
    #[inline]
    pub fn open(&mut self, now: Instant) {
        if self.opened {
            self.debug_check_paths_scheduled();
            return;
        }
        self.opened = true;
        self.schedule_paths(now);
    }

    /// Asks the I/O layer to close every path and stops reconnecting until the next
    /// [`Connection::open`] or send. Queued and unacknowledged messages are kept.
    pub fn close(&mut self, now: Instant) {
        self.opened = false;
        for path in 0..MAX_PATHS {
            self.timers.set_reconnect_at(path, None);
            // A deliberate close is no failure: reopening connects at once.
            self.tx[path].backoff_bound = Duration::ZERO;
            self.close_path(now, path);
        }
        self.timers.set_doorbell_at(None);
    }

    /// Asks the I/O layer to close one path (`Event::Close`); it must then call
    /// [`Connection::handle_path_down`]. No effect on a path that is down or already closing.
    pub fn close_path(&mut self, _now: Instant, path: usize) {
        if let Some(tx) = self.tx.get_mut(path) {
            if matches!(tx.state, PathState::Up | PathState::Connecting) {
                tx.state = PathState::Disconnecting;
                self.events.push_back(Event::Close { path });
            }
        }
    }

    /// The TCP connection for `path` (from an `Event::Connect`) is established.
    pub fn handle_connected(&mut self, now: Instant, path: usize) -> Result<(), PathError> {
        let tx = self.tx.get(path).ok_or(PathError::InvalidPath(path))?;
        if tx.state != PathState::Connecting {
            return Err(PathError::WrongState(path));
        }
        self.path_up(now, path);
        if path > 0 {
            // The connect may have been answered by a restarted peer (a SYN in flight across
            // its restart), which takes the first connection it accepts for its path 0. That
            // peer sends its probe ping on this path, which closes it (`handle_probe`); until
            // a pong on path 0 answers a ping started now, this path sends nothing the peer
            // would judge by sequence number (only maps), so a mismapped connection can never
            // make it judge resends against another path's numbers (duplicates or losses).
            self.tx[path].wait_pongs_above = Some(self.path0_pings_started);
            if self.tx[0].state == PathState::Up
                && !self.tx[0].queue.iter().any(Message::is_probe_ping)
            {
                self.queue_control(0, Control::ProbePing);
            }
            // Paths connect one at a time, in index order (see `wants_path`).
            self.schedule_paths(now);
        }
        Ok(())
    }

    /// The listener accepted a TCP connection from the peer's address, coming from TCP source
    /// port `peer_tcp_sport`. Returns the path it now serves, or why it must be reset or wait.
    /// Without SPORT_IDX (classic first-free mapping), a connection while every path is up
    /// starts a liveness check of those paths and waits for it (see `check_liveness`).
    pub fn handle_accepted(
        &mut self,
        now: Instant,
        peer_tcp_sport: u16,
    ) -> Result<usize, AcceptError> {
        if self.active {
            // The larger side rang the doorbell: connect back on path 0 now.
            self.counters.accepts_rejected += 1;
            self.opened = true;
            if self.tx[0].state == PathState::Down {
                self.timers.set_reconnect_at(0, None);
                self.start_connect(0);
            }
            // Opened now (after a `close`): the other paths it wants, as `open` would.
            self.schedule_paths(now);
            return Err(AcceptError::WeConnect);
        }
        let n = self.npaths_effective();
        let path = if self.peer_sport_idx && self.npaths.is_some() {
            // The peer binds source ports with port % 8 == path index.
            let p = usize::from(peer_tcp_sport) % MAX_PATHS;
            if p >= n {
                self.counters.accepts_rejected += 1;
                return Err(AcceptError::NoFreePath);
            }
            if self.tx[p].state != PathState::Down {
                self.counters.accepts_rejected += 1;
                return Err(AcceptError::PathBusy(p));
            }
            p
        } else {
            match (0..n).find(|&p| self.tx[p].state == PathState::Down) {
                Some(p) => p,
                None => {
                    self.check_liveness(now);
                    if self.timers.liveness().is_some() || self.npaths.is_none() {
                        // Before the handshake, the peer may connect its paths > 0 as soon as
                        // it has our probe (the kernel does), before we have its answer: the
                        // connection waits for the path count rather than being reset.
                        return Err(AcceptError::CheckingPaths);
                    }
                    self.counters.accepts_rejected += 1;
                    return Err(AcceptError::NoFreePath);
                }
            }
        };
        self.counters.accepts += 1;
        self.opened = true;
        self.path_up(now, path);
        self.tx[path].peer_tcp_sport = Some(peer_tcp_sport);
        Ok(path)
    }

    /// Passive side, classic mapping: the peer (the active side) connects a path only when it
    /// has none up for it, so with all of ours up at least one is stale from its point of view:
    /// it restarted without a FIN (a rebooted host), or a reset never reached us. TCP
    /// keepalive takes 30 s to find it, so every up path gets a liveness ping and, after
    /// [`Config::liveness_timeout`] without its pong, is closed. Meanwhile the new connection
    /// is kept unread ([`AcceptError::CheckingPaths`], the spec's recent-kernel stash rather
    /// than the classic reset) and takes the first path the check frees: the peer's TCP may
    /// have had bytes acknowledged on it that a reset would lose (the 6.1 kernel's only
    /// handshake ping, whose loss leaves its sender waiting for a pong forever; VM lab f4).
    /// One check at a time, and at most one per timeout however often the peer retries.
    fn check_liveness(&mut self, now: Instant) {
        if self.active
            || self.timers.liveness().is_some()
            || self.liveness_next.is_some_and(|t| t > now)
        {
            return;
        }
        let mut waiting = [false; MAX_PATHS];
        for (path, wait) in waiting.iter_mut().enumerate() {
            if self.tx[path].state == PathState::Up {
                *wait = true;
                self.queue_control(path, Control::LivenessPing);
            }
        }
        if !waiting.iter().any(|&w| w) {
            return;
        }
        self.counters.liveness_checks += 1;
        let deadline = now + self.config.liveness_timeout;
        self.timers
            .set_liveness(Some(Liveness { deadline, waiting }));
        self.liveness_next = Some(deadline);
    }

    /// The transport of `path` is gone (connect failed, reset, closed, or after an
    /// `Event::Close`). Unacknowledged messages go back to the front of the path's queue and
    /// will be resent with `RETRANSMITTED`; the active side schedules a reconnect.
    pub fn handle_path_down(&mut self, now: Instant, path: usize) -> Result<(), PathError> {
        let tx = self.tx.get_mut(path).ok_or(PathError::InvalidPath(path))?;
        if tx.state == PathState::Down {
            return Ok(());
        }
        let was_connected = tx.state != PathState::Connecting;
        if tx
            .up_since
            .take()
            .is_some_and(|at| now.saturating_duration_since(at) >= self.config.reconnect_max)
        {
            // A connection that lived (even an idle one the peer never spoke on) was no
            // refusal: reconnect at once.
            tx.backoff_bound = Duration::ZERO;
        }
        if tx.writing_cong_map() {
            // The partial (or unwritten) map is lost with the stream: another path sends it.
            self.cong_pending = true;
        }
        tx.state = PathState::Down;
        // Started frames die with the stream, written or not; their messages are unacked and
        // go back to the queue below, in order, like every unacknowledged message.
        tx.clear_frames();
        while let Some(mut msg) = tx.unacked.pop_back() {
            if msg.cancelled {
                push_released(&mut self.events, &msg);
                continue;
            }
            if msg.is_probe_ping() || msg.is_liveness_ping() {
                // Never resent: a peer that processed it drops a RETRANSMITTED copy as a
                // duplicate and would never pong. The new connection gets a fresh ping (a
                // liveness ping none: the check was about this stream).
                continue;
            }
            msg.retransmit = true;
            if path == 0 && self.config.send_gen_num && msg.ext.iter().next().is_none() {
                // Resends go ahead of the fresh probe on the new connection; a peer that lost
                // track of our generation (it crashed and restored older numbers) learns it
                // from them before judging them (`learn_generation`). Kernels act only on
                // RDMA records in data headers and skip this one.
                let _ = msg.ext.push(ExtHeader::GenNum(self.config.generation));
            }
            tx.queue.push_front(msg);
        }
        let rx = &mut self.rx[path];
        if !rx.deframer.is_idle() {
            self.counters.rx_truncated += 1;
        }
        rx.deframer.reset();
        if was_connected {
            self.counters.paths_down += 1;
        }
        tx.peer_tcp_sport = None;
        tx.wait_pongs_above = None;
        tx.queue.retain(|m| !m.is_liveness_ping());
        self.sync_busy(path);
        self.timers.liveness_path_done(path);
        if path == 0 {
            self.path0_confirmed = false;
            self.timers.set_path0_gate(None);
            // Pings and pongs are counted per path-0 connection. An unanswered barrier ping
            // that was never started is still queued and gets its ordinal when written; a
            // started one was dropped above, so a fresh one goes behind what is resent.
            self.path0_pings_started = 0;
            self.path0_pongs_received = 0;
            if let Some(b) = self.fanout_barrier.filter(|b| !b.confirmed) {
                let pending = self.tx[0].queue.iter().any(|m| m.seq == b.ping_seq);
                let ping_seq = if pending {
                    b.ping_seq
                } else {
                    self.queue_control(0, Control::ProbePing)
                };
                if let Some(b) = self.fanout_barrier.as_mut() {
                    b.ping_seq = ping_seq;
                    b.ping_ordinal = None;
                }
            }
            // Pongs are counted afresh on the next path-0 connection, which starts after every
            // path that waits came up: its first pong will do.
            for t in &mut self.tx {
                if t.wait_pongs_above.is_some() {
                    t.wait_pongs_above = Some(0);
                }
            }
        } else if self.active {
            // Path 0 may be a dead connection to a peer that restarted; before connecting a
            // path > 0 again, a fresh pong on path 0 must prove the peer knows our path count
            // and source-port scheme, or it could map this path's connection to its path 0.
            self.require_path0_confirmation();
        }
        if path >= self.npaths_effective() {
            self.reroute_queue(path);
        }
        self.refresh_barrier();
        if self.active {
            self.schedule_paths(now);
        } else {
            self.maybe_ring_doorbell(now);
        }
        Ok(())
    }

    fn require_path0_confirmation(&mut self) {
        self.path0_confirmed = false;
        let path0 = &self.tx[0];
        if path0.state == PathState::Up && !path0.queue.iter().any(Message::is_probe_ping) {
            self.queue_control(0, Control::ProbePing);
        }
    }

    /// Paths > 0 connect one at a time, in index order: a passive peer without SPORT_IDX maps
    /// connections to its first free path in accept order, and with parallel connects a lost
    /// SYN swaps two paths, whose resends the peer then judges against the other path's
    /// sequence numbers and drops (seen in the userspace-TCP path-cut suite).
    fn wants_path(&self, path: usize) -> bool {
        self.active
            && self.opened
            && path < self.npaths_effective()
            && (path == 0 || self.path0_confirmed)
            && (1..path).all(|p| self.tx[p].state == PathState::Up)
    }

    /// Active side: make sure every wanted path that is down is connecting or has a timer.
    ///
    /// Once it has run, that holds until an input of `wants_path`, a path's state or a
    /// reconnect timer changes, and only these changes can make a down path without a timer
    /// wanted; each schedules again:
    ///
    /// * `opened` becoming true: [`Connection::open`], [`Connection::handle_accepted`];
    /// * the path count: `set_npaths` (every probe and pong, which also confirms path 0);
    /// * a path going down: [`Connection::handle_path_down`];
    /// * a path > 0 coming up (the next one may connect): [`Connection::handle_connected`]
    ///   (path 0 coming up clears the confirmation, which paths > 0 wait for);
    /// * a reconnect timer expiring: [`Connection::handle_timeout`] connects the path if it
    ///   is wanted and down.
    ///
    /// The other changes only take wants away (`close`, `close_path`, a failed path, path 0
    /// down or unconfirmed) or leave no path down without a timer (a connect, a timer set).
    /// So [`Connection::open`] on an opened connection, every send, has nothing to do; debug
    /// builds check it there and in [`Connection::poll_timeout`].
    fn schedule_paths(&mut self, now: Instant) {
        if !self.active || !self.opened {
            return;
        }
        // `wants_path` is false from the path count on.
        for path in 0..self.npaths_effective() {
            let tx = &self.tx[path];
            if tx.state == PathState::Down
                && self.timers.reconnect_at(path).is_none()
                && self.wants_path(path)
            {
                self.schedule_reconnect(now, path);
            }
        }
    }

    /// Debug builds: no wanted path is down without a reconnect timer (what `schedule_paths`
    /// establishes and every state change keeps).
    #[inline]
    fn debug_check_paths_scheduled(&self) {
        if cfg!(debug_assertions) {
            for path in 0..MAX_PATHS {
                assert!(
                    !(self.tx[path].state == PathState::Down
                        && self.timers.reconnect_at(path).is_none()
                        && self.wants_path(path)),
                    "path {path} is wanted and down with no reconnect scheduled"
                );
            }
        }
    }

    /// Kernel backoff: first attempt at once with the bound set to the minimum; later ones
    /// after a random delay in [0, bound), the bound doubling up to the maximum.
    fn schedule_reconnect(&mut self, now: Instant, path: usize) {
        let (min, max) = (self.config.reconnect_min, self.config.reconnect_max);
        let bound = self.tx[path].backoff_bound;
        if bound.is_zero() {
            self.tx[path].backoff_bound = min;
            self.start_connect(path);
        } else {
            let delay = Duration::from_nanos(self.rng.below(duration_nanos(bound)));
            self.timers.set_reconnect_at(path, Some(now + delay));
            self.tx[path].backoff_bound = bound.saturating_mul(2).min(max);
        }
    }

    fn start_connect(&mut self, path: usize) {
        let tx = &mut self.tx[path];
        tx.state = PathState::Connecting;
        self.counters.connect_attempts += 1;
        if tx.was_up {
            self.counters.reconnects += 1;
        }
        self.events.push_back(Event::Connect { path });
    }

    fn path_up(&mut self, now: Instant, path: usize) {
        let tx = &mut self.tx[path];
        tx.state = PathState::Up;
        tx.stream_offset = 0;
        tx.acked_offset = 0;
        tx.clear_frames();
        // The backoff is reset by the first frame the peer sends on this connection, not here:
        // a peer that refuses the connection after TCP's handshake would otherwise see a
        // reconnect storm.
        tx.was_up = true;
        tx.up_since = Some(now);
        self.sync_busy(path);
        self.cong_pending = true;
        self.rx[path].deframer.reset();
        self.counters.paths_up += 1;
        self.timers.set_reconnect_at(path, None);
        if path == 0 {
            self.path0_confirmed = false;
            self.doorbell_bound = Duration::ZERO;
            self.doorbell_next = None;
            self.timers.set_doorbell_at(None);
            // The data gate (see the crate's deviations): only when nothing queued is a
            // resend, since control messages overtake queued data under it, and a resend
            // behind a newer sequence number would be taken for a duplicate; and not while a
            // fan-out barrier needs its ping behind the data.
            let tx = &self.tx[0];
            let gate = !tx.queue.iter().any(|m| m.retransmit) && self.fanout_barrier.is_none();
            self.timers
                .set_path0_gate(gate.then_some(now + self.config.reconnect_max));
            if gate {
                // Control messages that never went out go ahead of the data now, in order.
                let queue = &mut self.tx[0].queue;
                let mut ahead = 0;
                for i in 0..queue.len() {
                    if matches!(queue[i].body, Body::Control(_)) {
                        if let Some(m) = queue.remove(i) {
                            queue.insert(ahead, m);
                        }
                        ahead += 1;
                    }
                }
            }
            if !self.tx[0].has_probe_pending() {
                self.queue_control(0, Control::ProbePing);
            }
        }
    }

    /// Passive side: with data waiting and path 0 down, ask the I/O layer to poke the peer
    /// (kernel: a connect attempt that the smaller side resets). The first doorbell since path
    /// 0 was last up rings at once; after a doorbell at `t` the next one waits until at least
    /// `t + bound`, the bound starting at [`Config::doorbell_min`] and doubling up to
    /// [`Config::reconnect_max`]. Otherwise the timer is (re)armed for the earliest allowed time.
    fn maybe_ring_doorbell(&mut self, now: Instant) {
        if self.active || self.tx[0].state == PathState::Up || !self.has_pending_data() {
            self.timers.set_doorbell_at(None);
            return;
        }
        if let Some(next) = self.doorbell_next.filter(|&next| next > now) {
            self.timers.set_doorbell_at(Some(next));
            return;
        }
        self.events.push_back(Event::Doorbell);
        self.counters.doorbells += 1;
        let max = self.config.reconnect_max;
        let bound = if self.doorbell_bound.is_zero() {
            self.config.doorbell_min
        } else {
            self.doorbell_bound
        };
        // Jitter only above the bound, so that many connections do not ring in lockstep:
        // the interval is in [bound, 1.5 * bound), capped at the maximum but never below bound.
        let jitter = Duration::from_nanos(self.rng.below(duration_nanos(bound / 2)));
        let interval = (bound + jitter).min(max).max(bound);
        let next = now + interval;
        self.doorbell_next = Some(next);
        self.timers.set_doorbell_at(Some(next));
        self.doorbell_bound = bound.saturating_mul(2).min(max);
    }

    // ----- sending ---------------------------------------------------------------------------

    /// Queues a message from local port `sport` to the peer's port `dport`. `token` comes back
    /// in `Event::Released` once TCP has acknowledged the message or it was cancelled.
    /// Returns the path it was queued on. The congestion check (`ENOBUFS`) and send-buffer
    /// accounting are the caller's ([`Connection::peer_port_congested`]).
    pub fn send(
        &mut self,
        now: Instant,
        sport: u16,
        dport: u16,
        payload: P,
        token: u64,
    ) -> Result<usize, SendError> {
        self.send_with(now, sport, dport, payload, token, SendFlags::default())
    }

    /// [`Connection::send`] with `flags`: `ack_required` puts `RDS_FLAG_ACK_REQUIRED` in the
    /// header, for a sender whose send buffer is at least half used (spec §7), so that a
    /// receiver that delays its acknowledgements sends this one at once.
    pub fn send_with(
        &mut self,
        now: Instant,
        sport: u16,
        dport: u16,
        payload: P,
        token: u64,
        flags: SendFlags,
    ) -> Result<usize, SendError> {
        let len = payload.as_ref().len();
        if len > MAX_MSG_SIZE as usize {
            return Err(SendError::TooLarge { len });
        }
        if sport == 0 || sport == PROBE_PORT {
            return Err(SendError::ReservedPort);
        }
        let path = self.route(sport, dport);
        let tx = &mut self.tx[path];
        let seq = tx.take_seq();
        tx.queue.push_back(Message {
            seq,
            sport,
            dport,
            ext: ExtHeaders::new(),
            body: Body::Data { payload, token },
            retransmit: false,
            ack_required: flags.ack_required,
            cancelled: false,
            ack_end: 0,
        });
        self.busy |= 1 << path;
        self.open(now);
        self.maybe_ring_doorbell(now);
        Ok(path)
    }

    fn probe_ext(&self) -> ExtHeaders {
        let mut records = [None; 3];
        records[0] = Some(ExtHeader::NPaths(u16::from(self.config.npaths)));
        if self.config.send_gen_num {
            records[1] = Some(ExtHeader::GenNum(self.config.generation));
        }
        if self.config.sport_idx {
            // Last, as the spec advises for a type the peer may not know.
            records[2] = Some(ExtHeader::SportIdx(0));
        }
        let mut ext = ExtHeaders::new();
        for record in records.into_iter().flatten() {
            // 3 + 5 + 2 bytes always fit in 16.
            let _ = ext.push(record);
        }
        ext
    }

    fn queue_control(&mut self, path: usize, control: Control) -> u64 {
        self.queue_control_to(path, control, 0)
    }

    fn queue_control_to(&mut self, path: usize, control: Control, pong_dport: u16) -> u64 {
        let (sport, dport, ext) = match control {
            Control::ProbePing => (PROBE_PORT, 0, self.probe_ext()),
            Control::ProbePong => (0, PROBE_PORT, self.probe_ext()),
            Control::Pong => (0, pong_dport, ExtHeaders::new()),
            Control::LivenessPing => (LIVENESS_PORT, 0, ExtHeaders::new()),
        };
        let gated = path == 0 && self.timers.path0_gate().is_some();
        let tx = &mut self.tx[path];
        let seq = tx.take_seq();
        let msg = Message {
            seq,
            sport,
            dport,
            ext,
            body: Body::Control(control),
            retransmit: false,
            ack_required: false,
            cancelled: false,
            ack_end: 0,
        };
        if gated {
            // Ahead of the waiting data, behind earlier control messages.
            let at = tx
                .queue
                .iter()
                .position(|m| matches!(m.body, Body::Data { .. }));
            tx.queue.insert(at.unwrap_or(tx.queue.len()), msg);
        } else {
            tx.queue.push_back(msg);
        }
        self.busy |= 1 << path;
        seq
    }

    /// Drops every queued or unacknowledged message from local port `sport` to peer port
    /// `dport` (`RDS_CANCEL_SENT_TO`), emitting `Event::Released` for each. Returns how many.
    /// A message whose frame was started but is not completely written (partly written, or
    /// returned by [`Connection::poll_transmit_slices`] behind another frame) is released once
    /// its frame is complete, since the stream cannot be cut mid-message.
    pub fn cancel_sent_to(&mut self, sport: u16, dport: u16) -> usize {
        self.cancel_matching(sport, Some(dport))
    }

    /// Drops every queued or unacknowledged message from local port `sport` (socket closed).
    pub fn cancel_socket(&mut self, sport: u16) -> usize {
        self.cancel_matching(sport, None)
    }

    fn cancel_matching(&mut self, sport: u16, dport: Option<u16>) -> usize {
        let matches = |m: &Message<P>| {
            matches!(m.body, Body::Data { .. })
                && !m.cancelled
                && m.sport == sport
                && dport.unwrap_or(m.dport) == m.dport
        };
        let mut count = 0;
        let hold = self.config.hold_cancelled_written;
        let events = &mut self.events;
        for (path, tx) in self.tx.iter_mut().enumerate() {
            tx.queue.retain(|m| {
                if matches(m) {
                    push_released(events, m);
                    count += 1;
                    false
                } else {
                    true
                }
            });
            // The last `message_frames` messages have started frames that are not completely
            // written: the stream cannot be cut there, so they are released once written.
            let first_started = tx.unacked.len() - tx.message_frames;
            let mut index = 0;
            let held = &mut self.cancel_held;
            tx.unacked.retain_mut(|m| {
                index += 1;
                if !matches(m) {
                    return true;
                }
                count += 1;
                if index > first_started || hold {
                    // Being written (or, `hold`, maybe still read by the device).
                    m.cancelled = true;
                    if hold {
                        *held |= 1 << path;
                    }
                    return true;
                }
                push_released(events, m);
                false
            });
        }
        self.counters.cancelled += count as u64;
        for path in 0..MAX_PATHS {
            self.sync_busy(path);
        }
        self.refresh_barrier();
        count
    }

    /// The local congestion map changed: the current map goes out once, on the first up path
    /// that transmits between two messages (spec §8). Several changes before that transmit
    /// pass cost one map.
    pub fn local_congestion_changed(&mut self) {
        self.cong_pending = true;
    }

    // ----- transmit ----------------------------------------------------------------------------

    /// The remaining bytes of the first started frame on `path` (the one being written),
    /// starting the next frame (the connection's pending congestion map first, then the queue)
    /// if none is started. `None` when there is nothing to send. `local_map` is the current map
    /// of our address; it is copied when a map frame starts, and the map is then no longer
    /// pending on the other paths. Report what the socket took with
    /// [`Connection::advance_transmit`]. [`Connection::poll_transmit_slices`] is the same for
    /// several frames at once.
    pub fn poll_transmit_chunk(
        &mut self,
        _now: Instant,
        path: usize,
        local_map: &CongMap,
    ) -> Option<TransmitChunk<'_>> {
        let tx = self.tx.get(path)?;
        if tx.state != PathState::Up {
            return None;
        }
        if tx.frames.is_empty() {
            if let Some((kind, _)) = self.next_frame(path) {
                self.start_frame(path, kind, local_map);
            }
        }
        let (header, payload) = self.tx[path].chunk()?;
        Some(TransmitChunk { header, payload })
    }

    /// The remaining bytes of up to `max_frames` frames of `path`, as byte slices in stream
    /// order, for one vectored write (`writev`/`sendmsg`): first the frames already started
    /// (the partly written one first), then new frames started now by the rules of
    /// [`Connection::poll_transmit_chunk`] (the pending congestion map first, then queued
    /// messages). Each frame contributes its remaining header and payload slices, empty slices
    /// omitted; a new frame is started only if all its slices fit in `out`. Returns how many
    /// slices were written at the start of `out` and their total length (0 and 0: nothing to
    /// send).
    ///
    /// Report what the socket took with [`Connection::advance_transmit`]; it may complete
    /// several frames and end anywhere in a later one. Frames that were returned but not
    /// written stay started: the next call returns them again first (other calls may happen in
    /// between, e.g. a cancel, which releases such a message only once its frame is written).
    /// Nothing is allocated per call once the path's frame list has grown to `max_frames`.
    ///
    /// While a congestion map is pending and this path is still writing an earlier map, no
    /// new frame starts on this path (one map snapshot per path; the map goes before later
    /// messages).
    pub fn poll_transmit_slices<'a>(
        &'a mut self,
        _now: Instant,
        path: usize,
        local_map: &CongMap,
        max_frames: usize,
        out: &mut [&'a [u8]],
    ) -> TransmitSlices {
        let Some(tx) = self.tx.get(path) else {
            return TransmitSlices::default();
        };
        if tx.state != PathState::Up {
            return TransmitSlices::default();
        }
        let started = tx.frames.len().min(max_frames);
        let mut slots: usize = tx
            .frames
            .iter()
            .take(started)
            .map(|f| f.slices_left())
            .sum();
        for _ in started..max_frames {
            let Some((kind, need)) = self.next_frame(path) else {
                break;
            };
            if slots + need > out.len() {
                break;
            }
            self.start_frame(path, kind, local_map);
            slots += need;
        }
        let this: &'a Self = self;
        let (slices, bytes) = this.tx[path].fill_slices(max_frames, out);
        TransmitSlices { slices, bytes }
    }

    /// The frame that would start next on up path `path` after those already started, and
    /// the slices it takes: the pending map (unless this path still writes one), else the
    /// next queued message if data may go on this path.
    fn next_frame(&self, path: usize) -> Option<(NextFrame, usize)> {
        let tx = &self.tx[path];
        if self.cong_pending {
            if tx.writing_cong_map() {
                return None;
            }
            return Some((NextFrame::CongMap, frame_slices(CONG_MAP_BYTES)));
        }
        if !self.data_allowed(path) {
            return None;
        }
        let msg = tx.queue.front()?;
        Some((NextFrame::Message, frame_slices(msg.len())))
    }

    /// Starts the frame chosen by [`Connection::next_frame`] and counts it.
    fn start_frame(&mut self, path: usize, kind: NextFrame, local_map: &CongMap) {
        let tx = &mut self.tx[path];
        match kind {
            NextFrame::CongMap => {
                self.cong_pending = false;
                tx.start_cong_map(local_map);
                self.counters.cong_map_sent += 1;
            }
            NextFrame::Message => {
                if let Some(msg) = tx.start_message() {
                    let c = &mut self.counters;
                    c.tx_messages += 1;
                    c.tx_bytes += msg.len() as u64;
                    if msg.retransmit {
                        c.tx_retransmits += 1;
                    }
                    let (seq, is_ping) = (msg.seq, msg.is_probe_ping());
                    match msg.body {
                        Body::Control(Control::ProbePing) => c.probes_sent += 1,
                        Body::Control(Control::Pong | Control::ProbePong) => c.pongs_sent += 1,
                        Body::Control(Control::LivenessPing) | Body::Data { .. } => {}
                    }
                    if path == 0 && is_ping {
                        self.path0_pings_started += 1;
                        let ordinal = self.path0_pings_started;
                        if let Some(b) = self.fanout_barrier.as_mut() {
                            if b.ping_ordinal.is_none() && seq >= b.ping_seq {
                                b.ping_ordinal = Some(ordinal);
                            }
                        }
                    }
                }
            }
        }
        self.busy |= 1 << path;
        self.tx[path].debug_check();
    }

    /// The transport accepted `n` bytes of what [`Connection::poll_transmit_chunk`] or
    /// [`Connection::poll_transmit_slices`] last returned for `path` (bytes beyond the started
    /// frames are ignored). Completes frames in order; the last one may stay partly written.
    pub fn advance_transmit(&mut self, path: usize, n: usize) {
        let Some(tx) = self.tx.get_mut(path) else {
            return;
        };
        let events = &mut self.events;
        tx.advance(n, self.config.hold_cancelled_written, |msg| {
            push_released(events, &msg)
        });
        self.sync_busy(path);
    }

    /// True if `path` may hold written messages that were cancelled and wait for
    /// [`Connection::release_cancelled_read`] (`Config::hold_cancelled_written`).
    #[inline]
    pub fn holds_cancelled(&self, path: usize) -> bool {
        path < MAX_PATHS && self.cancel_held & (1 << path) != 0
    }

    /// `Config::hold_cancelled_written`: the device has finished reading `path`'s stream up to
    /// `read_done` (RDMA: the sends that completed). Cancelled messages whose frames are
    /// complete and end there are released (`Event::Released`). Returns how many.
    pub fn release_cancelled_read(&mut self, path: usize, read_done: u64) -> usize {
        let Some(tx) = self.tx.get_mut(path) else {
            return 0;
        };
        let complete = tx.unacked.len() - tx.message_frames;
        let (mut index, mut released, mut left) = (0, 0, false);
        let events = &mut self.events;
        tx.unacked.retain(|m| {
            index += 1;
            if !m.cancelled {
                return true;
            }
            if index <= complete && m.ack_end <= read_done {
                push_released(events, m);
                released += 1;
                return false;
            }
            left = true;
            true
        });
        if !left {
            self.cancel_held &= !(1 << path);
        }
        if released > 0 {
            self.sync_busy(path);
            if path == 0 {
                self.refresh_barrier();
            }
        }
        released
    }

    /// Copies as many bytes as fit into `buf` (possibly spanning frames) and counts them as
    /// handed to the transport. Returns the number of bytes written. For partial socket writes
    /// keep the unwritten tail in your own buffer, or use [`Connection::poll_transmit_slices`]
    /// or [`Connection::poll_transmit_chunk`].
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        path: usize,
        local_map: &CongMap,
        buf: &mut [u8],
    ) -> usize {
        let mut filled = 0;
        while filled < buf.len() {
            let Some(chunk) = self.poll_transmit_chunk(now, path, local_map) else {
                break;
            };
            let out = &mut buf[filled..];
            let h = chunk.header.len().min(out.len());
            out[..h].copy_from_slice(&chunk.header[..h]);
            let p = chunk.payload.len().min(out.len() - h);
            out[h..h + p].copy_from_slice(&chunk.payload[..p]);
            self.advance_transmit(path, h + p);
            filled += h + p;
        }
        filled
    }

    /// TCP has acknowledged the first `acked_offset` bytes of the path's current connection
    /// (bytes written minus `SIOCOUTQ` for kernel TCP, `snd_una` for a userspace stack).
    /// Messages whose last byte is covered are released.
    pub fn handle_acked(&mut self, path: usize, acked_offset: u64) {
        let Some(tx) = self.tx.get_mut(path) else {
            return;
        };
        if tx.state != PathState::Up {
            return;
        }
        let acked = acked_offset.min(tx.stream_offset);
        if acked <= tx.acked_offset {
            return;
        }
        tx.acked_offset = acked;
        while tx.unacked.front().is_some_and(|m| m.ack_end <= acked) {
            if let Some(msg) = tx.unacked.pop_front() {
                if matches!(msg.body, Body::Data { .. }) && !msg.cancelled {
                    self.counters.acked += 1;
                }
                push_released(&mut self.events, &msg);
            }
        }
        self.sync_busy(path);
        if path == 0 {
            self.refresh_barrier();
        }
    }

    fn refresh_barrier(&mut self) {
        if let Some(b) = self.fanout_barrier {
            let acked = !matches!(self.tx[0].oldest_pending_seq(), Some(s) if s <= b.upto);
            if acked && b.confirmed {
                self.fanout_barrier = None;
            }
        }
    }

    // ----- receive ----------------------------------------------------------------------------

    /// The rest of the payload `path` is receiving, for a reader that receives straight into
    /// it instead of through its own buffer (then [`Connection::rx_payload_filled`], and
    /// [`Connection::receive`] with no bytes for the message once it is complete). Empty unless
    /// the path is up and in the middle of a payload.
    pub fn rx_payload_room(&mut self, path: usize) -> &mut [u8] {
        match (self.tx.get(path), self.rx.get_mut(path)) {
            (Some(t), Some(rx)) if t.state == PathState::Up => rx.deframer.payload_room(),
            _ => &mut [],
        }
    }

    /// `n` bytes of [`Connection::rx_payload_room`] were received.
    pub fn rx_payload_filled(&mut self, path: usize, n: usize) {
        if let Some(rx) = self.rx.get_mut(path) {
            rx.deframer.payload_filled(n);
        }
    }

    /// Feeds stream bytes received on `path`. Processes at most one complete message; call
    /// again with `&data[consumed..]` until all is consumed. Control messages (pings, probes,
    /// congestion maps) are handled internally; a message for a local socket is returned,
    /// borrowing `data` or the path's reassembly buffer (no allocation in steady state).
    ///
    /// Malformed input (`h_len` above 1 MiB) drops the path (`Event::Close`), bumps a counter
    /// and consumes everything. Bytes for a path that is not up are discarded.
    pub fn receive<'a>(&'a mut self, now: Instant, path: usize, data: &'a [u8]) -> Received<'a> {
        let all = Received {
            consumed: data.len(),
            delivery: None,
        };
        if !matches!(self.tx.get(path), Some(t) if t.state == PathState::Up) {
            if !data.is_empty() {
                self.counters.rx_drop_unknown += 1;
            }
            return all;
        }
        let (used, frame) = match self.rx[path].deframer.advance(data) {
            Ok(result) => result,
            Err(_) => {
                self.counters.rx_drop_oversize += 1;
                self.fail_path(path);
                return all;
            }
        };
        let Some(frame) = frame else {
            return Received {
                consumed: used,
                delivery: None,
            };
        };
        if !self.process_frame(now, path, &frame, data) {
            return Received {
                consumed: used,
                delivery: None,
            };
        }
        let header = frame.header;
        let payload = self.rx[path].deframer.payload(&frame, data);
        Received {
            consumed: used,
            delivery: Some(Delivery {
                path,
                sequence: header.sequence,
                peer_generation: self.peer_generation,
                sport: header.sport,
                dport: header.dport,
                retransmitted: header.flags & flags::RETRANSMITTED != 0,
                ack_required: header.flags & flags::ACK_REQUIRED != 0,
                payload,
            }),
        }
    }

    /// Feeds all of `data` received on `path`, calling `deliver` for each message for a
    /// local socket.
    pub fn handle_stream_data(
        &mut self,
        now: Instant,
        path: usize,
        data: &[u8],
        mut deliver: impl FnMut(Delivery<'_>),
    ) {
        let mut rest = data;
        while !rest.is_empty() {
            let received = self.receive(now, path, rest);
            if let Some(delivery) = received.delivery {
                deliver(delivery);
            }
            rest = &rest[received.consumed..];
        }
    }

    fn fail_path(&mut self, path: usize) {
        self.counters.path_errors += 1;
        self.tx[path].state = PathState::Error;
        self.events.push_back(Event::Close { path });
    }

    /// Applies one complete message; true if it must be delivered to a socket.
    fn process_frame(&mut self, now: Instant, path: usize, frame: &FrameRef, data: &[u8]) -> bool {
        let h = frame.header;
        // The peer's RDS layer took this connection: the next reconnect may be immediate.
        self.tx[path].backoff_bound = Duration::ZERO;
        self.counters.rx_messages += 1;
        self.counters.rx_bytes += u64::from(h.len);

        if h.is_cong_bitmap() {
            // Maps bypass sequencing entirely.
            if h.len as usize != CONG_MAP_BYTES {
                self.counters.rx_drop_bad_header += 1;
                return false;
            }
            let payload = self.rx[path].deframer.payload(frame, data);
            match self.peer_map.update(payload) {
                Ok(mask) => {
                    self.counters.cong_map_received += 1;
                    if mask != 0 {
                        self.events.push_back(Event::CongestionChanged {
                            uncongested_mask: mask,
                        });
                    }
                }
                Err(_) => self.counters.rx_drop_bad_header += 1,
            }
            return false;
        }

        let probe_ping = h.sport == PROBE_PORT && h.dport == 0;
        let probe_pong = h.sport == 0 && h.dport == PROBE_PORT;
        if probe_ping || probe_pong {
            self.handle_probe(now, path, &h, probe_ping);
            return false;
        }

        if path == 0 && h.flags & flags::RETRANSMITTED != 0 {
            let generation = h.exthdr.iter().find_map(|r| match r {
                ExtHeader::GenNum(g) => Some(g),
                _ => None,
            });
            if let Some(g) = generation {
                self.learn_generation(now, g);
            }
        }
        let rx = &mut self.rx[path];
        if h.flags & flags::RETRANSMITTED != 0 && h.sequence < rx.next_rx_seq {
            self.counters.rx_drop_dup_seq += 1;
            return false;
        }
        // May move backwards for a non-retransmitted message, as in the kernel.
        rx.next_rx_seq = h.sequence.saturating_add(1);

        if h.dport == 0 {
            if h.sport == 0 {
                self.counters.rx_drop_unknown += 1;
            } else {
                self.counters.pings_received += 1;
                self.queue_control_to(path, Control::Pong, h.sport);
            }
            return false;
        }
        if h.sport == 0 {
            if h.dport == LIVENESS_PORT && h.len == 0 && self.liveness_answered(path) {
                return false;
            }
            self.counters.pongs_received += 1;
        }
        self.counters.rx_delivered += 1;
        true
    }

    /// A pong to [`LIVENESS_PORT`] arrived on `path`: true (and the path is alive) when the
    /// path's liveness ping waited for it.
    fn liveness_answered(&mut self, path: usize) -> bool {
        self.timers.liveness_path_done(path)
    }

    fn handle_probe(&mut self, now: Instant, path: usize, h: &HeaderRepr, is_ping: bool) {
        if is_ping {
            self.counters.probe_pings_received += 1;
        } else {
            self.counters.probe_pongs_received += 1;
        }
        let (mut offered, mut generation, mut sport_idx) = (None, None, false);
        let mut records = h.exthdr.iter();
        for record in records.by_ref() {
            match record {
                ExtHeader::NPaths(n) => offered = Some(n),
                ExtHeader::GenNum(g) => generation = Some(g),
                ExtHeader::SportIdx(_) => sport_idx = true,
                ExtHeader::Unknown(_) => self.counters.rx_ext_unknown += 1,
                _ => {}
            }
        }
        if records.stopped_on_invalid() {
            self.counters.rx_bad_exthdr += 1;
        }

        if let Some(new) = generation {
            self.learn_generation(now, new);
        }
        if is_ping && path > 0 && self.active {
            // Only a peer's path 0 carries its probe pings: it restarted and took our
            // connection for this path as its path 0 (see `handle_connected`). Close it
            // unanswered; its path 0 is then free for ours.
            self.counters.path_mismaps += 1;
            self.close_path(now, path);
            return;
        }
        self.peer_sport_idx = sport_idx;
        if sport_idx && !self.active {
            self.close_mismapped_paths(now);
        }

        if is_ping {
            self.queue_control(path, Control::ProbePong);
        } else {
            self.peer_knows_our_generation = true;
            if path == 0 {
                self.path0_confirmed = true;
                self.timers.set_path0_gate(None);
                if h.flags & flags::RETRANSMITTED == 0 {
                    self.path0_pongs_received += 1;
                    let pongs = self.path0_pongs_received;
                    for tx in &mut self.tx {
                        if tx.wait_pongs_above.is_some_and(|n| pongs > n) {
                            tx.wait_pongs_above = None;
                        }
                    }
                    if let Some(b) = self.fanout_barrier.as_mut() {
                        if b.ping_ordinal.is_some_and(|o| pongs >= o) {
                            b.confirmed = true;
                        }
                    }
                    self.refresh_barrier();
                }
            }
        }
        // No NPATHS: a legacy or single-path peer.
        let offered = offered.unwrap_or(1).clamp(1, MAX_PATHS as u16) as u8;
        self.set_npaths(now, offered.min(self.config.npaths));
    }

    /// Passive side, once the peer announced SPORT_IDX: a connection accepted before we knew
    /// (classic first-free mapping) whose source port says another path is dropped, as recent
    /// kernels do; the peer reconnects it.
    fn close_mismapped_paths(&mut self, now: Instant) {
        for path in 0..MAX_PATHS {
            let tx = &self.tx[path];
            let mismapped = tx
                .peer_tcp_sport
                .is_some_and(|s| usize::from(s) % MAX_PATHS != path);
            if tx.state == PathState::Up && mismapped {
                self.counters.path_mismaps += 1;
                self.close_path(now, path);
            }
        }
    }

    /// The peer announced generation `new` (in a probe, or on a resend on path 0): a change
    /// from a known one is a restart. Path 0 is read one connection after the other, so a
    /// resend of a dead incarnation can never follow its successor's announcement.
    fn learn_generation(&mut self, now: Instant, new: u32) {
        if new == 0 {
            return;
        }
        let old = self.peer_generation;
        if old != 0 && old != new {
            self.peer_restarted(now, old, new);
        }
        self.peer_generation = new;
    }

    fn peer_restarted(&mut self, now: Instant, old: u32, new: u32) {
        self.counters.peer_restarts += 1;
        self.events.push_back(Event::PeerRestarted {
            old_generation: old,
            new_generation: new,
        });
        for rx in self.rx.iter_mut() {
            rx.next_rx_seq = 0;
        }
        if self.active {
            // A path > 0 connecting, or up and still waiting for its pong, was connected before
            // the new peer's probe (the first message on its path 0): to the old peer, or, a
            // SYN in flight across the restart, to the new one, which took it for its first
            // free path, maybe another one (see `handle_connected`). It connects again, in
            // order, after the new peer's pong. A confirmed path goes to the old peer: it fails
            // by itself, and what it received is still read.
            for path in 1..MAX_PATHS {
                let tx = &self.tx[path];
                if tx.state == PathState::Connecting || tx.wait_pongs_above.is_some() {
                    self.close_path(now, path);
                }
            }
        }
    }

    fn set_npaths(&mut self, now: Instant, n: u8) {
        let old_effective = self.npaths_effective();
        if self.npaths != Some(n) {
            self.npaths = Some(n);
            self.events.push_back(Event::PathsNegotiated { npaths: n });
            let effective = usize::from(n);
            if effective != old_effective {
                // Sockets may now hash to another path: data on paths > 0 waits until the peer
                // has processed what path 0 carried before the switch (see `Barrier`).
                let upto = self.tx[0].next_tx_seq.saturating_sub(1);
                self.fanout_barrier = Some(self.barrier_ping(upto));
                for path in effective..MAX_PATHS {
                    self.reroute_queue(path);
                }
                self.refresh_barrier();
            }
        }
        if self.active {
            self.schedule_paths(now);
        }
    }

    /// The barrier for a switch after path-0 sequence `upto`: a probe ping already pending on
    /// path 0 behind every message but pongs serves (the handshake's own ping, usually);
    /// otherwise a new one is queued.
    fn barrier_ping(&mut self, upto: u64) -> Barrier {
        let tx = &self.tx[0];
        let last = tx
            .unacked
            .iter()
            .map(|m| (m, true))
            .chain(tx.queue.iter().map(|m| (m, false)))
            .rev()
            .find(|(m, _)| !matches!(m.body, Body::Control(Control::Pong | Control::ProbePong)));
        let (ping_seq, ping_ordinal) = match last {
            Some((m, started)) if m.is_probe_ping() => {
                // A started ping is the latest one started on this connection.
                (m.seq, started.then_some(self.path0_pings_started))
            }
            _ => {
                let seq = self.queue_control(0, Control::ProbePing);
                // Behind the data even under the path-0 data gate: that is its purpose.
                let queue = &mut self.tx[0].queue;
                if let Some(at) = queue.iter().position(|m| m.seq == seq) {
                    if let Some(ping) = queue.remove(at) {
                        queue.push_back(ping);
                    }
                }
                (seq, None)
            }
        };
        let confirmed = ping_ordinal.is_some_and(|o| self.path0_pongs_received >= o);
        Barrier {
            upto,
            ping_seq,
            ping_ordinal,
            confirmed,
        }
    }

    /// Moves the queued messages of a path that is no longer in use to the path their socket
    /// hashes to now, with fresh sequence numbers there (the peer never saw them on that
    /// path). Control messages for the old path are dropped.
    fn reroute_queue(&mut self, path: usize) {
        if path < self.npaths_effective() || self.tx[path].queue.is_empty() {
            return;
        }
        let queue = std::mem::take(&mut self.tx[path].queue);
        for mut msg in queue {
            if !matches!(msg.body, Body::Data { .. }) {
                continue;
            }
            let target = self.route(msg.sport, msg.dport);
            let tx = &mut self.tx[target];
            msg.seq = tx.take_seq();
            msg.retransmit = false;
            tx.queue.push_back(msg);
            self.busy |= 1 << target;
        }
        self.sync_busy(path);
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

//! Sans-IO protocol engine of rdsd: RDS (Reliable Datagram Sockets) over stream transports,
//! wire-compatible with the Linux kernel's `rds_tcp`.
//!
//! The crate performs no I/O, reads no clock, spawns no thread and draws no randomness except
//! from a seeded [`rng::SplitMix64`]: given the same inputs it produces the same outputs, which
//! is what lets `tests/` simulate two hosts, lossy links and restarts deterministically.
//!
//! * [`wire`]: the 48-byte header ([`wire::HeaderPacket`] / [`wire::HeaderRepr`]), extension
//!   headers with the kernel reader's quirks, the RFC 1071 header checksum, the stream
//!   [`wire::Deframer`], and congestion maps ([`wire::CongMap`]).
//! * [`conn`]: [`Connection`], one state machine per (local address, peer address) with 1..=8
//!   paths (one TCP connection each).
//! * [`time::Instant`]: opaque virtual time (u64 nanoseconds).
//!
//! # State machine
//!
//! Each path is `Down → Connecting → Up`, and goes to `Error` (malformed input) or
//! `Disconnecting` (local close) before returning to `Down` when the transport reports it gone.
//! The numerically smaller address is the *active* side: it connects every path and reconnects
//! with the kernel's backoff (first attempt at once, then a random delay in `[0, bound)` with
//! the bound doubling from 1 ms to 1 s, reset when the path comes up). The larger address is
//! *passive*: it only accepts, and while it has data to send with path 0 down it emits
//! [`Event::Doorbell`] (a connect the smaller side resets before connecting back), at most once
//! per interval: the first at once, then never sooner than a bound after the previous one, the
//! bound starting at [`Config::doorbell_min`] (10 ms) and doubling up to
//! [`Config::reconnect_max`] (a jitter only lengthens it, by less than half), reset when path 0
//! comes up.
//!
//! When path 0 comes up both sides send a handshake probe (sport 1 → dport 0 ping carrying
//! `NPATHS`, `GEN_NUM` and optionally `SPORT_IDX`), answered by a pong (sport 0 → dport 1).
//! The connection then uses `min(our offer, peer offer)` paths; the active side connects paths
//! 1.. only after a pong on the current path-0 connection. A socket's messages go on path
//! `hash(sport) % npaths` (path 0 before the handshake); each path numbers its messages from 1
//! when they are queued.
//!
//! Congestion maps follow the kernel (spec §8): the connection has **one** pending-map flag,
//! set when any path comes up and on [`Connection::local_congestion_changed`]. The first up
//! path that transmits between two messages sends the current map and clears the flag, so
//! one change costs one 8 KiB map per connection, not one per path. If that path goes down
//! while writing the map, the flag is set again and another path sends it.
//!
//! Delivery is confirmed by TCP: a message is released ([`Event::Released`]) when the
//! transport's acknowledged stream offset passes its last byte. When a path goes down, its
//! unacknowledged messages go back to the front of its queue and are resent with
//! `RETRANSMITTED` and their original numbers; the receiver drops a `RETRANSMITTED` message
//! whose number is below the next expected one. Peer restarts are handled with generation
//! numbers; the policy is described in [`conn`]. A restart of *our* daemon can keep the
//! receive state (peer generation and next expected number per path) through
//! [`Connection::restore_rx_state`], so a surviving peer's resends of messages we had already
//! delivered are dropped instead of delivered twice.
//!
//! # I/O contract
//!
//! The transport (kernel TCP, or later a userspace TCP) owns the sockets and must:
//!
//! 1. Create one [`Connection`] per (local, peer) pair with a [`Config`] (random non-zero
//!    generation chosen once per daemon start, RNG seed). If an earlier run of the daemon
//!    persisted receive state for this pair, call [`Connection::restore_rx_state`] at once,
//!    before any other input. Call [`Connection::open`] or just [`Connection::send`].
//! 2. After every call, drain [`Connection::poll_event`]:
//!    * [`Event::Connect`]: open a TCP connection from the local address (with
//!      [`Config::sport_idx`], from a source port with `port % 8 == path`) to `peer:16385`; on
//!      success call [`Connection::handle_connected`], on failure
//!      [`Connection::handle_path_down`].
//!    * [`Event::Doorbell`]: open a throw-away connection to `peer:16385` and close it.
//!    * [`Event::Close`]: close that path's socket, then call `handle_path_down`.
//!    * [`Event::Released`]: return `len` bytes to the sending socket's send buffer.
//!    * [`Event::PeerRestarted`]: a notification; if you persist receive state, the new
//!      generation must already be stored (step 6).
//!    * [`Event::CongestionChanged`], [`Event::PathsNegotiated`]: notifications (wake
//!      congestion waiters, update stats).
//! 3. On an inbound connection from the peer's address call [`Connection::handle_accepted`]
//!    with the peer's TCP source port; on `Err` reset the socket (linger 0).
//! 4. When a path's socket is writable and [`Connection::has_pending_transmit`] holds, write
//!    with one of:
//!    * [`Connection::poll_transmit_slices`] (vectored, preferred for small messages): fills a
//!      caller-provided array of `&[u8]` (e.g. `[&[]; 64]` on the stack) with the remaining
//!      header and payload slices of up to `max_frames` frames in stream order (the frames
//!      already started first, then new ones), to pass as the iovecs of **one**
//!      `writev`/`sendmsg`. Nothing is allocated per call in steady state.
//!    * [`Connection::poll_transmit_chunk`]: the header and payload slices of the one frame
//!      being written.
//!    * [`Connection::poll_transmit`]: copies into your buffer and counts the bytes as written.
//!
//!    After a vectored or chunk write, report the bytes the socket took with
//!    [`Connection::advance_transmit`] before polling again; the count may span several frames
//!    and end anywhere inside one (the rest is returned first by the next poll). Frames that
//!    were returned but not written stay committed to the stream: their messages are already
//!    unacknowledged messages of the path (resent if it goes down; a cancel releases them once
//!    their frame is written). Pass the current local congestion map; call
//!    [`Connection::local_congestion_changed`] whenever a local port's bit flips.
//! 5. Report TCP acknowledgement progress with [`Connection::handle_acked`]: bytes written on
//!    this socket minus `SIOCOUTQ` (or `snd_una` − ISN on a userspace stack), counted from the
//!    moment the path came up. Read it at least before reporting the path down.
//! 6. Feed received bytes to [`Connection::handle_stream_data`] (callback per delivery) or
//!    [`Connection::receive`] (pull, one message per call). Deliveries borrow the input or a
//!    per-path buffer; nothing is allocated per message in steady state. To survive a restart
//!    without duplicates, persist after each message has reached its socket its
//!    [`Delivery::peer_generation`] and `sequence + 1` for its [`Delivery::path`], and after
//!    each call any change of [`Connection::peer_generation`] (the exact rule is on
//!    [`Connection::restore_rx_state`]).
//! 7. Report a dead socket (EOF, RST, error other than EAGAIN, keepalive timeout) with
//!    [`Connection::handle_path_down`].
//! 8. Call [`Connection::handle_timeout`] when [`Connection::poll_timeout`] expires.
//!
//! Sending sockets check [`Connection::peer_port_congested`] themselves (`ENOBUFS`) and do
//! their own send-buffer accounting; [`Connection::send`] only refuses payloads above 1 MiB
//! and the reserved source ports 0 and 1.
//!
//! # Deviations from the kernel
//!
//! * Incoming `h_len` above 1 MiB drops the path (the kernel buffers up to 4 GiB).
//! * Probes (ping and pong) are processed whatever their sequence number and never move
//!   `next_rx_seq`; the kernel applies the duplicate rule to them.
//! * On a peer generation change, unacknowledged messages are kept and resent, and our
//!   numbering keeps running (the kernel flushes and restarts at 1). See [`conn`].
//! * A fresh connection queues its probe as the first message of path 0; data on paths > 0
//!   waits until a probe pong proves the peer has our generation, and after the path count
//!   changes it waits until the peer has *processed* what path 0 carried before the switch:
//!   TCP's acknowledgement of it and the pong to a probe ping queued behind it (recent kernels
//!   only wait for their own catch-up, which TCP acknowledgement does not prove: acknowledged
//!   bytes can still wait in the peer's socket buffer, or in a receiver that paused the path
//!   because a ring was full, and a socket's later messages on another path would overtake
//!   them).
//! * **Path-0 data gate.** On a path-0 connection whose queue holds no resend, data waits for
//!   the pong to the probe ping (at most `reconnect_max`, then it goes anyway and
//!   `path0_gate_timeouts` counts it); control messages (the probe, pongs) go ahead of it. The
//!   kernel sends at once and counts TCP's acknowledgement as delivery, but the 6.1 kernel, as
//!   the larger address, can drop an accepted path 0 whose bytes TCP acknowledged before its
//!   RDS layer took the socket (its own doorbell connect races the accept): those messages are
//!   lost (VM-lab test a3). The pong proves its RDS layer owns the connection. Overtaking
//!   only first-time messages is safe: the duplicate rule applies to RETRANSMITTED ones, which
//!   is why a queue with a resend is not gated (the race stays open there, see the VM lab's
//!   README).
//! * The active side reconnects paths > 0 only after a pong on the current path-0 connection,
//!   including after an isolated drop of such a path (it re-probes on path 0).
//! * The reconnect backoff is reset by the first frame the peer sends on a connection, or when
//!   a connection that lived at least `reconnect_max` drops (the kernel resets it when the
//!   connection comes up: against a peer that accepts and then refuses, the 6.1 kernel retried
//!   about 400 times a second).
//! * The active side connects paths > 0 one at a time, in index order (the kernel connects
//!   them all at once): a passive peer without SPORT_IDX takes its first free path in accept
//!   order, so a lost SYN would swap two paths and the peer would drop their resends as
//!   duplicates, judged against the other path's sequence numbers.
//! * **A path > 0 that comes up waits for a fresh pong.** Until a pong on path 0 answers a
//!   probe ping started after the path came up, the active side sends only congestion maps on
//!   it, and a probe ping arriving on a path > 0 closes that path (`path_mismaps`). A connect
//!   in flight while the passive peer restarts (its SYN lost, then answered by the new
//!   incarnation) is otherwise taken for the new peer's path 0 (first free path); our path 0
//!   then becomes its path 1, and the resends of path 0 are judged against path 1's numbers:
//!   delivered a second time after a restore of the receive state
//!   ([`Connection::restore_rx_state`]), or dropped. The restarted peer's first message on its
//!   path 0 is its probe ping, so the mismapped connection is closed before it carries data.
//!   For the same reason a new peer generation closes every path > 0 still connecting or
//!   unconfirmed (a late SYN would land on the new peer's first free path, maybe another
//!   one); confirmed ones go to the old peer and fail by themselves.
//! * Path choice is `hash(sport) % npaths` (the kernel uses `jhash & (npaths - 1)`); the hash is
//!   local-only. Prefer power-of-two path counts with kernel peers.
//! * Passive path mapping with `SPORT_IDX` uses `sport % 8` (equal to the kernel's
//!   `sport % npaths` for power-of-two counts); a busy path refuses the connection instead of
//!   stashing it. Without `SPORT_IDX` the first free path is used, like classic kernels.
//! * The passive side re-rings the doorbell while it has data queued and path 0 is down (the
//!   kernel only does so on sendmsg and at the end of a path-0 shutdown), at most once per
//!   interval of [`Config::doorbell_min`] doubling to [`Config::reconnect_max`].
//! * Pongs are queued messages retransmitted like data (as in the kernel). A probe ping is
//!   never resent: a peer that processed it would drop a RETRANSMITTED copy and never answer,
//!   so a reconnected path 0 gets a fresh ping, queued behind what is resent.
//! * Receive state can outlive the daemon ([`Connection::restore_rx_state`]); the kernel
//!   loses it when the module is reloaded.
//! * Checksums, `h_ack` and `h_credit` are neither set nor checked (as kernel TCP).
//! * `ACK_REQUIRED` is put on the wire on TCP too, but only where the caller asks
//!   ([`Connection::send_with`]: rdsd asks when the sending socket's send buffer is half used,
//!   the kernel's rule) and never on a congestion map (receivers test its flags for exact
//!   equality): kernel TCP receivers ignore the bit, rdsd's userspace TCP then acknowledges at
//!   once instead of delaying the ACK. No per-path packet or byte budgets (the kernel's
//!   IB-only bookkeeping), no RDMA extensions acted upon, no FIN-drain shutdown.
//!
//! # Known limits
//!
//! * If the acknowledgement of bytes the peer already consumed is lost together with a reset
//!   connection **and** the peer restarts before the resend, the restarted peer delivers that
//!   message again, unless it restored its persisted receive state (an rdsd peer using
//!   [`Connection::restore_rx_state`]); a kernel peer cannot.
//! * Restored receive state is only as fresh as the store: if a kernel peer restarted and our
//!   daemon crashes after our TCP acknowledged the peer's new-generation probe but before the
//!   I/O layer stored that generation, the stale numbers can drop resends of the restarted
//!   peer that precede its next probe (a loss, never a duplicate). An rdsd peer closes this
//!   window: its resends on path 0 carry `GEN_NUM` (kernels act on no data-header record but
//!   RDMA ones), and a changed generation there resets the numbers before the resend is
//!   judged. With classic (non-`SPORT_IDX`) multipath peers, restored numbers follow
//!   our path indices, which may disagree with the peer's after reconnects (see below).
//! * A receiver that has not learned a surviving sender's generation yet (it restarted, and the
//!   sender's probe on the new path-0 connection queues behind its resends) takes a later
//!   sender restart for the first generation learned and keeps its numbers; that restarted
//!   sender's resends below them are dropped (a loss, never a duplicate). Restoring the
//!   generation with [`Connection::restore_rx_state`] avoids this after our own restarts.
//! * Maps of successive congestion changes can go out on different paths and reach the peer
//!   out of order, as with the kernel; a stale map then stays until the next change or the
//!   next path coming up.
//! * A peer restart that *lowers* the path count moves messages queued on vanished paths to
//!   their new path; messages that were unacknowledged on such a path are moved only when the
//!   path is reported down and can then be reordered after newer messages of the same socket.
//! * With classic (non-`SPORT_IDX`) peers and several paths, path indices on the two sides can
//!   disagree after reconnects, as between classic kernels.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod conn;
pub mod rng;
pub mod time;
pub mod wire;

pub use conn::{
    AcceptError, Config, ConfigError, Connection, Counters, Delivery, Event, MessageInfo,
    PathChoice, PathError, PathState, Received, SendError, SendFlags, TransmitChunk,
    TransmitSlices,
};
pub use time::Instant;

//! What the engine reports to the I/O layer.

use core::fmt;

/// Actions and notifications for the I/O layer, drained with
/// [`super::Connection::poll_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Open a TCP connection for `path`: bind to the local address (and, with
    /// [`super::Config::sport_idx`], a source port with `port % 8 == path`), connect to
    /// `peer:16385`, then call [`super::Connection::handle_connected`] or, on failure,
    /// [`super::Connection::handle_path_down`].
    Connect {
        /// Path index.
        path: usize,
    },
    /// Passive side only: open a TCP connection to `peer:16385` and close it as soon as it is
    /// established or fails. The peer resets it and connects back (spec §6.2). Not tied to
    /// any path; do not report its outcome.
    Doorbell,
    /// Close the transport of `path` (protocol error or local request), then call
    /// [`super::Connection::handle_path_down`].
    Close {
        /// Path index.
        path: usize,
    },
    /// A message left the engine for good (acknowledged by TCP, or cancelled): release its
    /// `len` payload bytes from the sender's send-buffer accounting.
    Released {
        /// The token given to [`super::Connection::send`].
        token: u64,
        /// Payload length.
        len: usize,
    },
    /// A peer congestion-map update cleared some bits. Bit `P % 64` stands for port P.
    CongestionChanged {
        /// Ports (mod 64) that went from congested to uncongested.
        uncongested_mask: u64,
    },
    /// The number of paths in use changed (handshake completed or renegotiated).
    PathsNegotiated {
        /// Paths now in use.
        npaths: u8,
    },
    /// The peer announced a different generation number: it restarted.
    PeerRestarted {
        /// Generation we knew.
        old_generation: u32,
        /// Generation just announced.
        new_generation: u32,
    },
}

/// A message for a local socket, borrowed from the input or the path's reassembly buffer.
///
/// `path`, `sequence` and `peer_generation` are what the I/O layer persists for
/// [`super::Connection::restore_rx_state`] once the message has really reached a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery<'a> {
    /// Path it arrived on.
    pub path: usize,
    /// Its sequence number.
    pub sequence: u64,
    /// The peer generation the engine knew when it accepted the message (0 = unknown), i.e.
    /// [`super::Connection::peer_generation`] at that point of the stream. A generation change
    /// announced earlier in the same input is already reflected here, even though its
    /// [`Event::PeerRestarted`] is only drained after the call.
    pub peer_generation: u32,
    /// Source RDS port (source address = the peer address).
    pub sport: u16,
    /// Destination RDS port (destination address = the local address).
    pub dport: u16,
    /// The sender marked it as a resend.
    pub retransmitted: bool,
    /// The sender asked for a prompt acknowledgement (`RDS_FLAG_ACK_REQUIRED`: its send
    /// buffer is half used); a transport that delays its acknowledgements sends one now.
    pub ack_required: bool,
    /// The payload.
    pub payload: &'a [u8],
}

/// Options of [`super::Connection::send_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendFlags {
    /// Put `RDS_FLAG_ACK_REQUIRED` in the header (see [`Delivery::ack_required`]).
    pub ack_required: bool,
}

/// Result of [`super::Connection::receive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received<'a> {
    /// Bytes of the input consumed; pass the rest in the next call.
    pub consumed: usize,
    /// A message to deliver, if this call completed one.
    pub delivery: Option<Delivery<'a>>,
}

/// The remaining bytes of the frame being transmitted on a path (header first, then payload).
/// Write them (e.g. with `writev`), then report how many the socket took with
/// [`super::Connection::advance_transmit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmitChunk<'a> {
    /// Remaining header bytes (possibly empty).
    pub header: &'a [u8],
    /// Remaining payload bytes (possibly empty).
    pub payload: &'a [u8],
}

impl TransmitChunk<'_> {
    /// Total remaining bytes.
    pub fn len(&self) -> usize {
        self.header.len() + self.payload.len()
    }

    /// True when nothing remains (never returned by the engine).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Result of [`super::Connection::poll_transmit_slices`]: what was written into the caller's
/// slice array.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransmitSlices {
    /// Slices written at the start of the array, in stream order (none is empty).
    pub slices: usize,
    /// Their total length in bytes.
    pub bytes: usize,
}

impl TransmitSlices {
    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.slices == 0
    }
}

/// Engine counters, in the spirit of the kernel's `rds-info -c`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Messages whose header was written (including control messages and retransmits).
    pub tx_messages: u64,
    /// Payload bytes of those messages.
    pub tx_bytes: u64,
    /// Messages resent after a reconnect (with `RETRANSMITTED`).
    pub tx_retransmits: u64,
    /// Complete messages read from the stream.
    pub rx_messages: u64,
    /// Payload bytes of those messages.
    pub rx_bytes: u64,
    /// Messages handed to local sockets.
    pub rx_delivered: u64,
    /// Congestion maps with `h_len != 8192` (ignored, stream kept).
    pub rx_drop_bad_header: u64,
    /// `h_len` above 1 MiB: the path was dropped.
    pub rx_drop_oversize: u64,
    /// Retransmitted messages below `next_rx_seq`, dropped as duplicates.
    pub rx_drop_dup_seq: u64,
    /// Messages nobody handles (ping from port 0) or bytes on a path that is not up.
    pub rx_drop_unknown: u64,
    /// Partial messages discarded when a path went down.
    pub rx_truncated: u64,
    /// Unknown extension types seen in probes.
    pub rx_ext_unknown: u64,
    /// Probes whose extension area the reader could not walk to its end.
    pub rx_bad_exthdr: u64,
    /// Paths dropped for malformed input.
    pub path_errors: u64,
    /// Connections closed because the two sides disagree on their path: on the passive side,
    /// the peer's source port (SPORT_IDX) named another path; on the active side, the peer
    /// sent a probe ping on a path > 0 (it restarted and took that connection for its path 0).
    pub path_mismaps: u64,
    /// `Event::Connect` emitted.
    pub connect_attempts: u64,
    /// `Event::Connect` emitted for a path that had been up before.
    pub reconnects: u64,
    /// Paths that came up.
    pub paths_up: u64,
    /// Paths that went down.
    pub paths_down: u64,
    /// Accepted inbound connections.
    pub accepts: u64,
    /// Refused inbound connections.
    pub accepts_rejected: u64,
    /// Doorbell connects requested.
    pub doorbells: u64,
    /// Congestion maps sent.
    pub cong_map_sent: u64,
    /// Congestion maps received and applied.
    pub cong_map_received: u64,
    /// Pings (dport 0) answered.
    pub pings_received: u64,
    /// Pongs sent in answer.
    pub pongs_sent: u64,
    /// Pongs (sport 0) delivered to sockets.
    pub pongs_received: u64,
    /// Handshake probe pings sent.
    pub probes_sent: u64,
    /// Handshake probe pings received.
    pub probe_pings_received: u64,
    /// Handshake probe pongs received.
    pub probe_pongs_received: u64,
    /// Generation changes seen.
    pub peer_restarts: u64,
    /// Messages cancelled.
    pub cancelled: u64,
    /// Messages released after TCP acknowledgement.
    pub acked: u64,
    /// Path-0 connections whose data stopped waiting for the first pong at the deadline
    /// (the peer never answered the probe ping).
    pub path0_gate_timeouts: u64,
    /// Liveness checks started: the peer connected while none of our paths was free.
    pub liveness_checks: u64,
    /// Up paths closed because their liveness ping got no pong in time (dead peers, e.g. one
    /// that rebooted without a FIN).
    pub stale_paths_closed: u64,
}

/// Why [`super::Connection::send`] refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// Payload above 1 MiB (`EMSGSIZE`).
    TooLarge {
        /// The payload length.
        len: usize,
    },
    /// Source port 0 or 1 (not bindable; 1 is the probe port).
    ReservedPort,
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::TooLarge { len } => write!(f, "payload of {len} bytes exceeds 1 MiB"),
            SendError::ReservedPort => write!(f, "source port 0 and 1 are reserved"),
        }
    }
}

impl std::error::Error for SendError {}

/// Why [`super::Connection::handle_accepted`] refused an inbound connection. Reset the socket
/// (linger 0), except for [`AcceptError::PathBusy`] and [`AcceptError::CheckingPaths`], where
/// the connection may be kept unread and offered again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptError {
    /// Our address is the smaller one, so we connect; the engine has started (or is
    /// running) its own connect on path 0.
    WeConnect,
    /// The path the peer's source port maps to is in use.
    PathBusy(usize),
    /// No path is free.
    NoFreePath,
    /// No path is free and a liveness check of our paths runs (classic mapping; see
    /// [`super::Connection::handle_accepted`]): keep the connection unread and offer it again;
    /// it takes the first path the check frees. Resetting it would lose what the peer's TCP
    /// already had acknowledged on it (the kernel's one handshake ping, for one).
    CheckingPaths,
}

impl fmt::Display for AcceptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcceptError::WeConnect => {
                write!(f, "the smaller address connects; reset and connect back")
            }
            AcceptError::PathBusy(p) => write!(f, "path {p} is busy"),
            AcceptError::NoFreePath => write!(f, "no free path"),
            AcceptError::CheckingPaths => write!(f, "no free path while a liveness check runs"),
        }
    }
}

impl std::error::Error for AcceptError {}

/// A path-level call that does not fit the path's state (an I/O-layer bug or a stale report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// Index >= 8.
    InvalidPath(usize),
    /// The path is not in the state the call expects.
    WrongState(usize),
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathError::InvalidPath(p) => write!(f, "invalid path index {p}"),
            PathError::WrongState(p) => write!(f, "path {p} is in the wrong state"),
        }
    }
}

impl std::error::Error for PathError {}

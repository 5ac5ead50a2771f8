//! Per-path state: the send queue, the unacknowledged list, the frames started and not yet
//! completely written, and the receive side.

use crate::time::Instant;
use crate::wire::{flags, CongMap, Deframer, ExtHeaders, HeaderRepr, CONG_MAP_BYTES, HEADER_LEN};
use std::collections::VecDeque;
use std::time::Duration;

/// Path life cycle (spec §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathState {
    /// No transport. The active side may have a reconnect timer running.
    Down,
    /// `Event::Connect` issued, waiting for `handle_connected` or `handle_path_down`.
    Connecting,
    /// Established: bytes flow.
    Up,
    /// A local close was requested (`Event::Close`), waiting for `handle_path_down`.
    Disconnecting,
    /// Malformed input was seen (`Event::Close`), waiting for `handle_path_down`.
    Error,
}

/// Engine-generated messages with no payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    /// sport 1 -> dport 0 with NPATHS/GEN_NUM.
    ProbePing,
    /// sport 0 -> dport 1 with NPATHS/GEN_NUM.
    ProbePong,
    /// sport 0 -> pinger's port.
    Pong,
    /// sport [`crate::wire::LIVENESS_PORT`] -> dport 0, no extension: a plain ping whose pong
    /// proves that the peer's RDS still reads and writes this path.
    LivenessPing,
}

#[derive(Debug)]
pub(crate) enum Body<P> {
    Data { payload: P, token: u64 },
    Control(Control),
}

#[derive(Debug)]
pub(crate) struct Message<P> {
    pub seq: u64,
    pub sport: u16,
    pub dport: u16,
    pub ext: ExtHeaders,
    pub body: Body<P>,
    /// Set when the message goes back to the queue after a path drop.
    pub retransmit: bool,
    /// `RDS_FLAG_ACK_REQUIRED` on the wire: its sender's send buffer is half used, so the
    /// receiver should acknowledge it at once (spec §7).
    pub ack_required: bool,
    /// Cancelled while its frame was being written; released once the frame is out.
    pub cancelled: bool,
    /// Stream offset just past the message's last byte, set when its header is written.
    pub ack_end: u64,
}

impl<P: AsRef<[u8]>> Message<P> {
    pub fn payload(&self) -> &[u8] {
        match &self.body {
            Body::Data { payload, .. } => payload.as_ref(),
            Body::Control(_) => &[],
        }
    }

    pub fn len(&self) -> usize {
        self.payload().len()
    }

    pub fn is_probe_ping(&self) -> bool {
        matches!(self.body, Body::Control(Control::ProbePing))
    }

    pub fn is_liveness_ping(&self) -> bool {
        matches!(self.body, Body::Control(Control::LivenessPing))
    }

    pub fn header(&self) -> HeaderRepr {
        HeaderRepr {
            sequence: self.seq,
            ack: 0,
            // Bounded by MAX_MSG_SIZE at send time.
            len: self.len() as u32,
            sport: self.sport,
            dport: self.dport,
            flags: if self.retransmit {
                flags::RETRANSMITTED
            } else {
                0
            } | if self.ack_required {
                flags::ACK_REQUIRED
            } else {
                0
            },
            credit: 0,
            exthdr: self.ext,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// A message of `unacked`: the message frames of [`TxPath::frames`] are the last
    /// [`TxPath::message_frames`] messages of `unacked`, in the same order.
    Message,
    /// The path's `cong_snapshot` (at most one map frame per path at a time).
    CongMap,
}

/// A frame that was started (its message is in `unacked`, or it is the path's map) and is not
/// completely written yet. The header bytes live here; the payload is borrowed from the message
/// or the snapshot when the frame's slices are handed out.
#[derive(Debug, Clone)]
pub(crate) struct FrameInProgress {
    pub kind: FrameKind,
    pub header: [u8; HEADER_LEN],
    pub total: usize,
    pub written: usize,
}

impl FrameInProgress {
    /// Non-empty slices this frame still needs (remaining header, remaining payload).
    pub fn slices_left(&self) -> usize {
        usize::from(self.written < HEADER_LEN)
            + usize::from(self.total > self.written.max(HEADER_LEN))
    }

    /// Remaining header and payload of this frame, given its whole payload.
    fn remaining<'a>(&'a self, payload: &'a [u8]) -> (&'a [u8], &'a [u8]) {
        let header = self
            .header
            .get(self.written.min(HEADER_LEN)..)
            .unwrap_or(&[]);
        let payload = payload
            .get(self.written.saturating_sub(HEADER_LEN)..)
            .unwrap_or(&[]);
        (header, payload)
    }
}

/// Slots a new frame with `payload_len` payload bytes takes in a slice array.
pub(crate) fn frame_slices(payload_len: usize) -> usize {
    1 + usize::from(payload_len > 0)
}

#[derive(Debug)]
pub(crate) struct TxPath<P> {
    pub state: PathState,
    /// Messages waiting for transmission, retransmits first.
    pub queue: VecDeque<Message<P>>,
    /// Messages whose header went out, oldest first, waiting for TCP acknowledgement.
    pub unacked: VecDeque<Message<P>>,
    pub next_tx_seq: u64,
    /// Bytes handed to the transport on the current connection.
    pub stream_offset: u64,
    pub acked_offset: u64,
    /// Frames started and not completely written, in stream order: the first one may be
    /// partly written, the others are untouched. The capacity is kept across connections.
    pub frames: VecDeque<FrameInProgress>,
    /// How many of `frames` are message frames (the last ones of `unacked`).
    pub message_frames: usize,
    /// Stream offset just past the last started frame: `stream_offset` plus the unwritten
    /// bytes of `frames`.
    pub start_offset: u64,
    /// Copy of the local map taken when a map frame starts, so a change mid-write cannot tear it.
    pub cong_snapshot: Option<CongMap>,
    pub backoff_bound: Duration,
    pub was_up: bool,
    /// When the current connection came up (for the reconnect backoff).
    pub up_since: Option<Instant>,
    /// Passive side: TCP source port of the accepted connection serving this path.
    pub peer_tcp_sport: Option<u16>,
    /// Active side, a path > 0 not yet confirmed: its queue waits until more probe pongs than
    /// this arrived on the current path-0 connection, i.e. one answering a ping started after
    /// this path came up (see `Connection::handle_connected`); `None` once one did.
    pub wait_pongs_above: Option<u32>,
}

impl<P: AsRef<[u8]>> TxPath<P> {
    pub fn new() -> Self {
        TxPath {
            state: PathState::Down,
            queue: VecDeque::new(),
            unacked: VecDeque::new(),
            next_tx_seq: 1,
            stream_offset: 0,
            acked_offset: 0,
            frames: VecDeque::new(),
            message_frames: 0,
            start_offset: 0,
            cong_snapshot: None,
            backoff_bound: Duration::ZERO,
            was_up: false,
            up_since: None,
            peer_tcp_sport: None,
            wait_pongs_above: None,
        }
    }

    pub fn take_seq(&mut self) -> u64 {
        let seq = self.next_tx_seq;
        self.next_tx_seq = self.next_tx_seq.saturating_add(1);
        seq
    }

    pub fn has_pending_messages(&self) -> bool {
        !self.queue.is_empty() || !self.unacked.is_empty()
    }

    /// Nothing queued, unacknowledged or started.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.unacked.is_empty() && self.frames.is_empty()
    }

    pub fn has_pending_data(&self) -> bool {
        let is_data = |m: &Message<P>| matches!(m.body, Body::Data { .. });
        self.queue.iter().any(is_data) || self.unacked.iter().any(is_data)
    }

    /// A congestion-map frame is started and not completely written on this path.
    pub fn writing_cong_map(&self) -> bool {
        self.frames.iter().any(|f| f.kind == FrameKind::CongMap)
    }

    /// Forgets the started frames (a new connection, or the old one is gone). Their messages
    /// stay in `unacked`.
    pub fn clear_frames(&mut self) {
        self.frames.clear();
        self.message_frames = 0;
        self.start_offset = self.stream_offset;
    }

    /// Index in `unacked` of the message of the first message frame.
    fn first_frame_message(&self) -> usize {
        self.unacked.len() - self.message_frames
    }

    pub fn has_probe_pending(&self) -> bool {
        self.queue
            .iter()
            .chain(self.unacked.iter())
            .any(Message::is_probe_ping)
    }

    /// Lowest sequence number still queued or unacknowledged (lists are in sequence order).
    pub fn oldest_pending_seq(&self) -> Option<u64> {
        self.unacked.front().or(self.queue.front()).map(|m| m.seq)
    }

    /// Payload of a started frame; `message` is its message's index in `unacked`.
    fn frame_payload(&self, kind: FrameKind, message: usize) -> &[u8] {
        match kind {
            FrameKind::Message => self.unacked.get(message).map_or(&[], |m| m.payload()),
            FrameKind::CongMap => self
                .cong_snapshot
                .as_ref()
                .map_or(&[], |m| &m.as_bytes()[..]),
        }
    }

    /// The remaining bytes of the first started frame.
    pub fn chunk(&self) -> Option<(&[u8], &[u8])> {
        let frame = self.frames.front()?;
        Some(frame.remaining(self.frame_payload(frame.kind, self.first_frame_message())))
    }

    /// Writes the non-empty remaining slices of the first `max_frames` started frames into
    /// `out`, in stream order, until it is full. Returns (slices, bytes).
    pub fn fill_slices<'a>(&'a self, max_frames: usize, out: &mut [&'a [u8]]) -> (usize, usize) {
        let (mut slices, mut bytes) = (0, 0);
        let mut message = self.first_frame_message();
        for frame in self.frames.iter().take(max_frames) {
            let payload = self.frame_payload(frame.kind, message);
            if frame.kind == FrameKind::Message {
                message += 1;
            }
            let (header, payload) = frame.remaining(payload);
            for part in [header, payload] {
                if part.is_empty() {
                    continue;
                }
                let Some(slot) = out.get_mut(slices) else {
                    return (slices, bytes);
                };
                *slot = part;
                slices += 1;
                bytes += part.len();
            }
        }
        (slices, bytes)
    }

    /// Counts `n` more bytes as written (at most what the started frames hold), completing
    /// frames in order. A completed message frame whose message was cancelled meanwhile takes
    /// the message out of `unacked` and hands it to `released`, unless `hold` (the device
    /// reads it after this: `Config::hold_cancelled_written`).
    pub fn advance(&mut self, mut n: usize, hold: bool, mut released: impl FnMut(Message<P>)) {
        while n > 0 {
            let Some(frame) = self.frames.front_mut() else {
                break;
            };
            let take = n.min(frame.total - frame.written);
            frame.written += take;
            self.stream_offset += take as u64;
            n -= take;
            if frame.written < frame.total {
                break;
            }
            let kind = frame.kind;
            self.frames.pop_front();
            if kind == FrameKind::Message {
                let index = self.first_frame_message();
                self.message_frames -= 1;
                if !hold && self.unacked.get(index).is_some_and(|m| m.cancelled) {
                    if let Some(msg) = self.unacked.remove(index) {
                        released(msg);
                    }
                }
            }
        }
        self.debug_check();
    }

    /// Internal consistency of the started frames (debug builds).
    pub fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let left: usize = self.frames.iter().map(|f| f.total - f.written).sum();
            assert_eq!(self.start_offset, self.stream_offset + left as u64);
            let messages = self
                .frames
                .iter()
                .filter(|f| f.kind == FrameKind::Message)
                .count();
            assert_eq!(self.message_frames, messages);
            assert!(self.message_frames <= self.unacked.len());
            assert!(self.frames.iter().skip(1).all(|f| f.written == 0));
            assert!(
                self.frames
                    .iter()
                    .filter(|f| f.kind == FrameKind::CongMap)
                    .count()
                    <= 1
            );
        }
    }

    /// Starts a congestion-map frame from the caller's current local map, after the frames
    /// already started. The path must not be writing another map (one snapshot per path).
    pub fn start_cong_map(&mut self, local_map: &CongMap) {
        debug_assert!(!self.writing_cong_map());
        let snapshot = self.cong_snapshot.get_or_insert_with(CongMap::new);
        snapshot.clone_from(local_map);
        let header = HeaderRepr {
            flags: flags::CONG_BITMAP,
            len: CONG_MAP_BYTES as u32,
            ..HeaderRepr::default()
        };
        let total = HEADER_LEN + CONG_MAP_BYTES;
        self.start_offset += total as u64;
        self.frames.push_back(FrameInProgress {
            kind: FrameKind::CongMap,
            header: header.to_bytes(),
            total,
            written: 0,
        });
    }

    /// Moves the next queued message into `unacked` and starts its frame after the frames
    /// already started; its `ack_end` counts their unwritten bytes.
    pub fn start_message(&mut self) -> Option<&Message<P>> {
        let mut msg = self.queue.pop_front()?;
        let total = HEADER_LEN + msg.len();
        self.start_offset += total as u64;
        msg.ack_end = self.start_offset;
        self.frames.push_back(FrameInProgress {
            kind: FrameKind::Message,
            header: msg.header().to_bytes(),
            total,
            written: 0,
        });
        self.message_frames += 1;
        self.unacked.push_back(msg);
        self.unacked.back()
    }
}

#[derive(Debug)]
pub(crate) struct RxPath {
    pub deframer: Deframer,
    pub next_rx_seq: u64,
}

impl RxPath {
    pub fn new() -> Self {
        RxPath {
            deframer: Deframer::new(),
            next_rx_seq: 0,
        }
    }
}

//! Per-path state: the send queue, the unacknowledged list, the frame being written, and the
//! receive side.

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
            },
            credit: 0,
            exthdr: self.ext,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// The message at the back of `unacked`.
    Message,
    CongMap,
}

#[derive(Debug, Clone)]
pub(crate) struct FrameInProgress {
    pub kind: FrameKind,
    pub header: [u8; HEADER_LEN],
    pub total: usize,
    pub written: usize,
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
    pub frame: Option<FrameInProgress>,
    /// Copy of the local map taken when a map frame starts, so a change mid-write cannot tear it.
    pub cong_snapshot: Option<CongMap>,
    pub backoff_bound: Duration,
    pub reconnect_at: Option<Instant>,
    pub was_up: bool,
    /// Passive side: TCP source port of the accepted connection serving this path.
    pub peer_tcp_sport: Option<u16>,
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
            frame: None,
            cong_snapshot: None,
            backoff_bound: Duration::ZERO,
            reconnect_at: None,
            was_up: false,
            peer_tcp_sport: None,
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

    pub fn has_pending_data(&self) -> bool {
        let is_data = |m: &Message<P>| matches!(m.body, Body::Data { .. });
        self.queue.iter().any(is_data) || self.unacked.iter().any(is_data)
    }

    /// A congestion-map frame is being written on this path.
    pub fn writing_cong_map(&self) -> bool {
        matches!(
            self.frame,
            Some(FrameInProgress {
                kind: FrameKind::CongMap,
                ..
            })
        )
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

    /// The remaining bytes of the frame in progress.
    pub fn chunk(&self) -> Option<(&[u8], &[u8])> {
        let frame = self.frame.as_ref()?;
        let payload: &[u8] = match frame.kind {
            FrameKind::Message => self.unacked.back().map_or(&[], |m| m.payload()),
            FrameKind::CongMap => self
                .cong_snapshot
                .as_ref()
                .map_or(&[], |m| &m.as_bytes()[..]),
        };
        let header = frame
            .header
            .get(frame.written.min(HEADER_LEN)..)
            .unwrap_or(&[]);
        let payload = payload
            .get(frame.written.saturating_sub(HEADER_LEN)..)
            .unwrap_or(&[]);
        Some((header, payload))
    }

    /// Starts a congestion-map frame from the caller's current local map.
    pub fn start_cong_map(&mut self, local_map: &CongMap) {
        let snapshot = self.cong_snapshot.get_or_insert_with(CongMap::new);
        snapshot.clone_from(local_map);
        let header = HeaderRepr {
            flags: flags::CONG_BITMAP,
            len: CONG_MAP_BYTES as u32,
            ..HeaderRepr::default()
        };
        self.frame = Some(FrameInProgress {
            kind: FrameKind::CongMap,
            header: header.to_bytes(),
            total: HEADER_LEN + CONG_MAP_BYTES,
            written: 0,
        });
    }

    /// Moves the next queued message into `unacked` and starts its frame.
    pub fn start_message(&mut self) -> Option<&Message<P>> {
        let mut msg = self.queue.pop_front()?;
        let total = HEADER_LEN + msg.len();
        msg.ack_end = self.stream_offset + total as u64;
        self.frame = Some(FrameInProgress {
            kind: FrameKind::Message,
            header: msg.header().to_bytes(),
            total,
            written: 0,
        });
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

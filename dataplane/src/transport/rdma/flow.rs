//! The data-path rules of one RDMA path, without I/O: credits, fragmentation of outgoing
//! frames into SENDs, reassembly of received fragments, the mapping of `h_ack` and send
//! completions onto the stream offsets of [`Link::acked`](crate::protocol::Link::acked), the
//! ACK-only frame, and the path's timers.
//!
//! [`PathFlow`] is deterministic: it never polls a CQ and never reads the clock. The shell in
//! `mod.rs` polls completions and hands them to [`PathFlow::on_completion`], passes `now` in,
//! and lends it the path's [`QueuePair`]: the registered slots and the post calls, the only
//! side effects the rules have. `tests` drive two flows over a fake queue pair that reorders
//! completions across the send and receive queues, loses RNR'd sends to nobody and errors QPs.

use super::wire::{self, FragHdr, FRAG, HDR};
use crate::protocol::Write;
use rds_proto::wire::MAX_MSG_SIZE;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

/// Tag on send work-request ids (receive ids are the slot index).
pub const SEND_TAG: u64 = 1 << 63;
/// The ACK-only frame's work-request id.
pub const ACK_WR_ID: u64 = SEND_TAG | u32::MAX as u64;
/// A path with frames waiting for the peer and no completion for this long is declared dead.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(5);
/// An inbound connect from a peer we hold paths to marks those paths stale after this long.
pub const STALE_AFTER: Duration = Duration::from_secs(1);

/// A work completion, copied out of the CQ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub ok: bool,
    pub status: u32,
    pub byte_len: u32,
}

/// A payload fragment sent in place: the second scatter-gather entry of its SEND.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlaceSge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// What the rules need of a queue pair: its registered slots and the post calls.
///
/// Slots: `recv` receive buffers and `send` send slots of [`wire::SLOT`] bytes, plus one
/// header-sized ACK slot.
pub trait QueuePair {
    /// A completed receive slot's bytes (not posted: the device does not write it now).
    fn recv_slot(&self, slot: u32) -> &[u8];
    /// A free send slot, to fill.
    fn send_slot_mut(&mut self, slot: u32) -> &mut [u8];
    /// The ACK-only frame's slot (at most one ACK in flight).
    fn ack_slot_mut(&mut self) -> &mut [u8];
    /// Posts receive buffer `slot` (work-request id = `slot`).
    fn post_recv(&mut self, slot: u32) -> std::io::Result<()>;
    /// Posts a SEND of the first `bytes` of send slot `slot`, then `extra` if any.
    fn post_send(
        &mut self,
        wr_id: u64,
        slot: u32,
        bytes: u32,
        extra: Option<InPlaceSge>,
    ) -> std::io::Result<()>;
    /// Posts a SEND of the ACK slot's header.
    fn post_ack(&mut self, wr_id: u64) -> std::io::Result<()>;
}

/// Where a path is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathState {
    Connecting,
    Up,
    Dead,
}

/// A filled send slot waiting for a credit.
#[derive(Clone, Copy, Debug)]
struct Pending {
    slot: u32,
    /// Bytes in the slot (the header, plus the payload chunk unless it is sent in place).
    bytes: u32,
    extra: Option<InPlaceSge>,
    /// First and last fragment of its frame.
    first: bool,
    last: bool,
}

/// One path's flow state (see the module doc).
pub struct PathFlow {
    state: PathState,
    /// When the path was created (connect and doorbell timeouts).
    born: Instant,
    /// When the connection was established.
    up_since: Option<Instant>,
    /// Last time a completion arrived (for the stall check).
    last_progress: Instant,
    /// A completion arrived, or something was posted, since the last stall check.
    progressed: bool,
    // --- send side ---
    free_send: Vec<u32>,
    /// Filled slots waiting for a credit, in order.
    tx_pending: VecDeque<Pending>,
    /// Frames (not fragments) in `tx_pending`.
    frames_queued: u32,
    /// Frames posted since one asked for an ack.
    since_ack_req: u32,
    /// Whether the frame being posted asks for an ack (decided at its first fragment).
    ack_req_cur: bool,
    /// Per send slot: the end offset of the frame whose last fragment it carries (0: not a
    /// last fragment), so a send completion moves `completed`.
    slot_end: Vec<u64>,
    /// Frame bytes whose sends have completed (RC completes in order): with `acked`, what the
    /// protocol layer may release (a payload sent in place must not be reused before both).
    completed: u64,
    /// Frames written: (sequence, frame end offset).
    sent: VecDeque<(u64, u64)>,
    written: u64,
    acked: u64,
    credits: u32,
    /// Credit-based flow control: on unless the peer's private data offered 0 credits (the
    /// kernel's RDS/IB default, sysctl `flow_control` off): then every SEND goes out and a
    /// receiver without a posted buffer answers RNR, which the sender's QP retries.
    flow_control: bool,
    ack_inflight: bool,
    // --- receive side ---
    /// Completed receive slots not yet processed: (slot, bytes).
    rx_done: VecDeque<(u32, u32)>,
    /// Posted receive buffers not yet advertised.
    posted_unadv: u32,
    /// Sequence of the last frame read (our `h_ack`).
    last_rx_seq: u64,
    /// Frames read since `h_ack` was last sent.
    rx_unacked: u32,
    asm: Vec<u8>,
    asm_first: Option<FragHdr>,
    asm_ready: bool,
    cur: Vec<u8>,
}

/// The counters a stall report logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowSnapshot {
    pub unacked: usize,
    pub pending: usize,
    pub credits: u32,
    pub free_send: usize,
    pub ack_inflight: bool,
    pub posted_unadv: u32,
    pub rx_done: usize,
    pub asm_ready: bool,
}

impl PathFlow {
    /// A path being set up (no slots yet), created at `now`.
    pub fn new(now: Instant) -> PathFlow {
        PathFlow {
            state: PathState::Connecting,
            born: now,
            up_since: None,
            last_progress: now,
            progressed: false,
            free_send: Vec::new(),
            tx_pending: VecDeque::new(),
            frames_queued: 0,
            since_ack_req: 0,
            ack_req_cur: false,
            slot_end: Vec::new(),
            completed: 0,
            sent: VecDeque::new(),
            written: 0,
            acked: 0,
            credits: 0,
            flow_control: true,
            ack_inflight: false,
            rx_done: VecDeque::new(),
            posted_unadv: 0,
            last_rx_seq: 0,
            rx_unacked: 0,
            asm: Vec::new(),
            asm_first: None,
            asm_ready: false,
            cur: Vec::new(),
        }
    }

    /// Takes the slots of a new QP: every send slot is free, every receive buffer is posted
    /// (they are the initial credits granted in the private data).
    pub fn attach<Q: QueuePair>(
        &mut self,
        qp: &mut Q,
        recv_n: u32,
        send_n: u32,
    ) -> std::io::Result<()> {
        self.free_send = (0..send_n).rev().collect();
        self.slot_end = vec![0; send_n as usize];
        for s in 0..recv_n {
            qp.post_recv(s)?;
        }
        Ok(())
    }

    /// The peer's initial credits, from its private data: `Some(0)` turns flow control off;
    /// `None` (no private data) assumes `ours`, what we granted.
    pub fn peer_credits(&mut self, offered: Option<u32>, ours: u32) {
        match offered {
            Some(c) => {
                self.credits = c;
                self.flow_control = c > 0;
            }
            None => self.credits = ours,
        }
    }

    /// The connection is established.
    pub fn established(&mut self, now: Instant) {
        self.state = PathState::Up;
        self.up_since = Some(now);
    }

    /// The path is down (a connection event, a timeout, a stale path).
    pub fn kill(&mut self) {
        self.state = PathState::Dead;
    }

    pub fn state(&self) -> PathState {
        self.state
    }

    /// How long ago the path was created.
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.born)
    }

    /// Up for longer than [`STALE_AFTER`]: an inbound connect from the same peer replaces it.
    pub fn stale(&self, now: Instant) -> bool {
        self.state == PathState::Up
            && self
                .up_since
                .is_some_and(|t| now.saturating_duration_since(t) > STALE_AFTER)
    }

    /// What the protocol layer may release: the frames the peer acknowledged and whose sends
    /// completed (a payload sent in place must stay put until both).
    pub fn acked(&self) -> u64 {
        self.acked.min(self.completed)
    }

    /// Frame bytes whose sends completed: the device reads nothing of them any more.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Frame bytes taken by [`PathFlow::write`].
    #[cfg(test)]
    pub fn written(&self) -> u64 {
        self.written
    }

    pub fn snapshot(&self) -> FlowSnapshot {
        FlowSnapshot {
            unacked: self.sent.len(),
            pending: self.tx_pending.len(),
            credits: self.credits,
            free_send: self.free_send.len(),
            ack_inflight: self.ack_inflight,
            posted_unadv: self.posted_unadv,
            rx_done: self.rx_done.len(),
            asm_ready: self.asm_ready,
        }
    }

    /// Applies one completion. A failed one (a QP error flushes every posted request) takes
    /// the path down: what it carried is beyond `acked()`, so the protocol layer resends it.
    pub fn on_completion(&mut self, wc: Completion) {
        self.progressed = true;
        if !wc.ok {
            if self.state == PathState::Up {
                tracing::info!(status = wc.status, "rdma: completion error: path down");
            }
            self.state = PathState::Dead;
            return;
        }
        if wc.wr_id & SEND_TAG != 0 {
            if wc.wr_id == ACK_WR_ID {
                self.ack_inflight = false;
            } else {
                let slot = (wc.wr_id & !SEND_TAG) as u32;
                let end = std::mem::take(&mut self.slot_end[slot as usize]);
                self.completed = self.completed.max(end);
                self.free_send.push(slot);
            }
        } else {
            self.rx_done.push_back((wc.wr_id as u32, wc.byte_len));
        }
    }

    /// The stall check, once per housekeeping pass of an established path: frames are
    /// waiting for the peer (unacknowledged, or held back for credits) and nothing at all
    /// (a completion or a post since the last check, or the caller's `progressed`) happened
    /// for [`STALL_TIMEOUT`]. Then the
    /// path is dead even if the QP has not said so (seen with Soft-RoCE after a link flap),
    /// as kernel TCP's keepalive would say. Returns true when it declares the path dead.
    pub fn check_stall(&mut self, now: Instant, progressed: bool) -> bool {
        let waiting = !self.sent.is_empty() || !self.tx_pending.is_empty();
        let progressed = std::mem::take(&mut self.progressed) || progressed;
        if progressed || !waiting {
            self.last_progress = now;
            false
        } else if now.saturating_duration_since(self.last_progress) > STALL_TIMEOUT {
            self.state = PathState::Dead;
            true
        } else {
            false
        }
    }

    /// Fragments one frame (`hdr`, then `payload`) into send slots: max(1, ceil(len/4096))
    /// SENDs, each starting with a copy of the header. With `lkey` the payload lies in a
    /// registered app region and each chunk is its SEND's second scatter-gather entry;
    /// otherwise it is copied into the slots. Takes the whole frame or nothing.
    pub fn write<Q: QueuePair>(
        &mut self,
        qp: &mut Q,
        hdr: &[u8],
        payload: &[u8],
        lkey: Option<u32>,
    ) -> Write {
        if self.state == PathState::Dead {
            return Write::Closed;
        }
        debug_assert!(hdr.len() == HDR);
        let nfrag = wire::fragments(payload.len());
        if self.free_send.len() < nfrag {
            return Write::WouldBlock;
        }
        let seq = FragHdr::parse(hdr).map_or(0, |h| h.seq);
        let n = HDR + payload.len();
        let end = self.written + n as u64;
        let mut chunks = payload.chunks(FRAG);
        for k in 0..nfrag {
            let slot = self.free_send.pop().expect("counted");
            let chunk = chunks.next().unwrap_or(&[]);
            let buf = qp.send_slot_mut(slot);
            buf[..HDR].copy_from_slice(hdr);
            let extra = match lkey {
                Some(lkey) => Some(InPlaceSge {
                    addr: chunk.as_ptr() as u64,
                    len: chunk.len() as u32,
                    lkey,
                }),
                None => {
                    // SAFETY: `chunk` is valid for reads for its length (a pooled copy, or
                    // app memory kept mapped while the message is queued) and the slot has
                    // room for FRAG bytes after the header; a raw copy forms no reference
                    // to bytes an app may be writing.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            chunk.as_ptr(),
                            buf[HDR..].as_mut_ptr(),
                            chunk.len(),
                        )
                    };
                    None
                }
            };
            let in_slot = if extra.is_some() {
                HDR
            } else {
                HDR + chunk.len()
            };
            self.slot_end[slot as usize] = if k + 1 == nfrag { end } else { 0 };
            self.tx_pending.push_back(Pending {
                slot,
                bytes: in_slot as u32,
                extra,
                first: k == 0,
                last: k + 1 == nfrag,
            });
        }
        self.frames_queued += 1;
        self.written = end;
        self.sent.push_back((seq, end));
        self.progress(qp);
        Write::Wrote(n)
    }

    /// True when [`PathFlow::read`] has a frame.
    pub fn has_frame(&self) -> bool {
        self.asm_ready
    }

    /// The next whole received frame, if one is reassembled: hands it to the protocol layer
    /// (its sequence becomes our `h_ack`), then continues with the fragments behind it.
    pub fn read<Q: QueuePair>(&mut self, qp: &mut Q) -> Option<&[u8]> {
        if !self.asm_ready {
            return None;
        }
        std::mem::swap(&mut self.cur, &mut self.asm);
        self.asm.clear();
        self.asm_ready = false;
        if let Some(h) = self.asm_first.take() {
            if h.seq != 0 {
                self.last_rx_seq = h.seq;
            }
        }
        self.rx_unacked += 1;
        // Continue with the fragments behind it (and send the ack if one is due).
        self.progress(qp);
        Some(&self.cur)
    }

    /// Applies a received header's ack and credits.
    fn on_header(&mut self, h: &FragHdr) {
        // Saturating: a peer that keeps granting (with flow control off nothing spends them)
        // must not wrap the count.
        self.credits = self.credits.saturating_add(u32::from(h.credit));
        let mut end = None;
        while let Some(&(seq, e)) = self.sent.front() {
            if seq > h.ack {
                break;
            }
            end = Some(e);
            self.sent.pop_front();
        }
        if let Some(e) = end {
            self.acked = self.acked.max(e);
        }
    }

    /// A SEND may go: the last credit only for a frame that carries a credit update, so that
    /// the two sides can never both sit at zero credits holding each other's updates.
    fn may_send(&self) -> bool {
        !self.flow_control || self.credits >= 2 || (self.credits == 1 && self.posted_unadv > 0)
    }

    /// Processes received fragments (until a whole frame waits for `read`), posts what the
    /// credits allow, and sends an ACK-only frame when needed. Returns work done.
    pub fn progress<Q: QueuePair>(&mut self, qp: &mut Q) -> usize {
        let mut work = 0;
        while !self.asm_ready && self.state != PathState::Dead {
            let Some((slot, len)) = self.rx_done.pop_front() else {
                break;
            };
            work += 1;
            let buf = qp.recv_slot(slot);
            let len = (len as usize).min(buf.len());
            let Some(h) = FragHdr::parse(&buf[..len]) else {
                self.state = PathState::Dead;
                break;
            };
            let data = &buf[HDR..len];
            let mut bad = false;
            if h.is_ack_only() {
                // May arrive between two fragments of a message (the peer sends its ACK while
                // the rest of the message waits for credits): only its ack and credits count.
                bad = !data.is_empty();
            } else if let Some(first) = self.asm_first {
                if !h.same_message(&first) {
                    bad = true;
                } else {
                    self.asm.extend_from_slice(data);
                }
            } else if h.len > MAX_MSG_SIZE {
                // The engine refuses it anyway: do not buffer up to 4 GiB for a peer first.
                bad = true;
            } else {
                self.asm.clear();
                self.asm.extend_from_slice(&buf[..len]);
                self.asm_first = Some(h);
            }
            if bad || data.len() > FRAG {
                tracing::debug!("rdma: fragment does not match its message: path down");
                self.state = PathState::Dead;
                break;
            }
            self.on_header(&h);
            if let Some(first) = self.asm_first {
                let need = HDR + first.len as usize;
                if self.asm.len() > need {
                    self.state = PathState::Dead;
                    break;
                }
                if self.asm.len() == need {
                    self.asm_ready = true;
                }
            }
            if qp.post_recv(slot).is_err() {
                self.state = PathState::Dead;
                break;
            }
            self.posted_unadv += 1;
        }
        if self.state != PathState::Up {
            return work;
        }
        // Sends: the last credit only for a frame that carries a credit update.
        while let Some(&Pending {
            slot,
            bytes,
            extra,
            first,
            last,
        }) = self.tx_pending.front()
        {
            if !self.may_send() {
                break;
            }
            let adv = self.posted_unadv.min(255);
            let buf = qp.send_slot_mut(slot);
            if first {
                // ACK_REQUIRED (spec §7): every MAX_UNACKED frames and on the last frame of a
                // burst, so that a receiver that acks only when asked (the kernel's RDS/IB)
                // never leaves us waiting. Never on a congestion map (flags exactly 0x01).
                self.ack_req_cur = !wire::is_cong_map(buf)
                    && (self.since_ack_req + 1 >= wire::MAX_UNACKED || self.frames_queued == 1);
                self.since_ack_req = if self.ack_req_cur {
                    0
                } else {
                    self.since_ack_req + 1
                };
            }
            wire::stamp(
                &mut buf[..HDR],
                self.last_rx_seq,
                adv as u8,
                self.ack_req_cur,
            );
            if qp
                .post_send(SEND_TAG | u64::from(slot), slot, bytes, extra)
                .is_err()
            {
                self.state = PathState::Dead;
                return work;
            }
            self.tx_pending.pop_front();
            if last {
                self.frames_queued -= 1;
            }
            if self.flow_control {
                self.credits -= 1;
            }
            self.posted_unadv -= adv;
            self.rx_unacked = 0;
            work += 1;
        }
        let want_ack = self.rx_unacked > 0 || self.posted_unadv >= wire::CREDIT_ACK_THRESHOLD;
        if want_ack && !self.ack_inflight && self.may_send() {
            let adv = self.posted_unadv.min(255);
            wire::ack_only(qp.ack_slot_mut(), self.last_rx_seq, adv as u8);
            if qp.post_ack(ACK_WR_ID).is_err() {
                self.state = PathState::Dead;
                return work;
            }
            self.ack_inflight = true;
            if self.flow_control {
                self.credits -= 1;
            }
            self.posted_unadv -= adv;
            self.rx_unacked = 0;
            work += 1;
        }
        self.progressed |= work > 0;
        work
    }
}

//! A receiver's backlog: messages from other poll threads that found its rx ring full.
//!
//! A pair ring between two poll threads carries messages for every socket of the receiving
//! thread, in one FIFO. Stopping at a record whose receiver's ring is full would hold up every
//! record behind it: one receiver that stops reading (with SO_RCVBUF above its ring, so never
//! congested) would cut off the other sockets of its thread from the sending thread. So such a
//! record is copied into the receiver's backlog and the pair ring moves on.
//!
//! - **Order:** once a socket has a backlog, every later message from the fabric for it joins
//!   the backlog, and the backlog reaches the ring (oldest first) before anything else from the
//!   fabric does; so what one sender sends it stays in order.
//! - **Bounds:** the sender's bytes are released (its SO_SNDBUF) only once the message is in the
//!   rx ring, as without a backlog; the backlog counts as queued for SO_RCVBUF, so the port is
//!   marked congested once ring and backlog pass it (senders then get ENOBUFS, peers see the
//!   map); and all backlogs of a thread hold at most `MAX_BACKLOG_BYTES`, past which a pair ring
//!   waits at the record as before (`rx_backlog_capped`).
//! - **Cost:** nothing while no ring is full: one branch per forwarded delivery and one per
//!   pass (`backlogged` is empty). Parking allocates: only for a receiver already behind.

use super::*;

/// Payload bytes (plus `PARKED_OVERHEAD` each) all backlogs of one poll thread may hold.
pub(in crate::poll) const MAX_BACKLOG_BYTES: usize = 64 << 20;

/// What a parked message is charged on top of its payload, so that a flood of empty
/// messages is bounded too.
const PARKED_OVERHEAD: usize = 64;

/// Messages moved from a backlog to its rx ring per socket and pass.
const BACKLOG_BATCH: usize = 64;

/// One message waiting in a backlog.
pub(in crate::poll) struct Parked {
    faddr: u32,
    sport: u16,
    bytes: Box<[u8]>,
    /// The sending shard and the sender's token (0: nothing to release).
    from: usize,
    token: u64,
}

impl Parked {
    fn charge(&self) -> usize {
        self.bytes.len() + PARKED_OVERHEAD
    }
}

impl SocketTable {
    /// A message from the fabric for `to`: into its rx ring, or into its backlog if the ring is
    /// full or a backlog is already there. `Full` only when this thread's backlogs are full.
    pub(super) fn deliver_or_park(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
    ) -> Delivered {
        let queued = match self.sock(to) {
            Some(s) => !s.backlog.is_empty(),
            None => return Delivered::NoSocket,
        };
        if !queued {
            let d = self.deliver_to(to, faddr, sport, payload);
            if d != Delivered::Full {
                return d;
            }
        }
        let len = payload.len();
        if self.backlog_total + len + PARKED_OVERHEAD > MAX_BACKLOG_BYTES {
            Stats::bump(&self.stats.rx_backlog_capped);
            return Delivered::Full;
        }
        let mut bytes = Vec::with_capacity(len);
        payload.copy_into(&mut bytes);
        let (from, token) = self.fabric_sender;
        let p = Parked {
            faddr,
            sport,
            bytes: bytes.into_boxed_slice(),
            from,
            token,
        };
        self.backlog_total += p.charge();
        let s = self.sock(to).expect("open");
        s.backlog.push_back(p);
        s.backlog_bytes += len as u64;
        if !queued {
            self.backlogged.push(to);
        }
        self.parked = true;
        Stats::bump(&self.stats.rx_backlogged);
        self.mark_if_over(to);
        Delivered::Yes
    }

    /// While `on`, a socket is closing (or its app leaving): what it sent that finds a local
    /// receiver's ring full is parked in that receiver's backlog (its sender's bytes are
    /// released at once: they die with the socket), as a send that returned success is
    /// delivered even if its sender closes right after.
    pub(in crate::poll) fn set_closing_sender(&mut self, on: bool) {
        self.closing_sender = on;
        self.fabric_sender = (self.shard, 0);
    }

    /// True while some socket has a backlog: a parked poll thread wakes on a short timer to
    /// move it (the app's reads ring no doorbell).
    #[inline]
    pub(in crate::poll) fn has_backlog(&self) -> bool {
        !self.backlogged.is_empty()
    }

    /// Moves backlogs into their rx rings, oldest first, as far as the rings have room (at most
    /// `BACKLOG_BATCH` messages a socket), releasing each message's sender. Returns the number
    /// moved. Called at the start of a pass while `has_backlog`.
    pub(in crate::poll) fn drain_backlogs(&mut self) -> usize {
        let mut moved = 0;
        let mut i = 0;
        self.begin_rx_burst();
        while i < self.backlogged.len() {
            let r = self.backlogged[i];
            for _ in 0..BACKLOG_BATCH {
                let Some(s) = self.sock(r) else { break };
                let fits = match s.backlog.front() {
                    Some(p) => s.rx.fits(p.bytes.len()),
                    None => false,
                };
                if !fits {
                    break;
                }
                let p = s.backlog.pop_front().expect("a front");
                s.backlog_bytes -= p.bytes.len() as u64;
                self.backlog_total -= p.charge();
                let d = self.deliver_to(r, p.faddr, p.sport, &MsgBytes::from_slice(&p.bytes));
                debug_assert_eq!(d, Delivered::Yes, "checked to fit");
                self.release_parked(&p);
                moved += 1;
            }
            if self.sock(r).is_some_and(|s| !s.backlog.is_empty()) {
                i += 1;
            } else {
                self.backlogged.swap_remove(i);
            }
        }
        self.end_rx_burst();
        if moved > 0 {
            if let Some(l) = self.link.as_mut() {
                l.flush_release();
            }
        }
        moved
    }

    /// A closing socket's backlog is dropped (as its unread ring is), its senders released.
    pub(super) fn drop_backlog(&mut self, r: SockRef, s: &mut Sock) {
        if s.backlog.is_empty() {
            return;
        }
        for p in std::mem::take(&mut s.backlog) {
            self.backlog_total -= p.charge();
            self.release_parked(&p);
            Stats::bump(&self.stats.drop_socket_closed);
        }
        s.backlog_bytes = 0;
        self.backlogged.retain(|&x| x != r);
        if let Some(l) = self.link.as_mut() {
            l.flush_release();
        }
    }

    fn release_parked(&mut self, p: &Parked) {
        if p.token != 0 {
            if let Some(l) = self.link.as_mut() {
                l.release(p.from, p.token, p.bytes.len() as u64);
            }
        }
    }

    /// Marks `to` congested if its ring and backlog hold more than its SO_RCVBUF.
    fn mark_if_over(&mut self, to: SockRef) {
        let consumed = self.ctl(to).rx_consumed_bytes.load(Ordering::Acquire);
        let Some(s) = self.sock(to) else { return };
        let queued = s.rx_produced.saturating_sub(consumed) + s.backlog_bytes;
        if queued > u64::from(s.rcvbuf) && !s.congested {
            self.mark_congested(to);
        }
    }
}

impl Sock {
    /// The backlog for `rdsctl info`: (length, source address, source port) of each message,
    /// oldest first, at most `max`.
    pub(in crate::poll) fn backlog_listing(&self, max: usize, out: &mut Vec<(u32, Ipv4Addr, u16)>) {
        for p in self.backlog.iter().take(max) {
            out.push((p.bytes.len() as u32, Ipv4Addr::from(p.faddr), p.sport));
        }
    }
}

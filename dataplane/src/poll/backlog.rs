//! A receiver's backlog: messages that found its rx ring full.
//!
//! A pair ring between two poll threads carries messages for every socket of the receiving
//! thread, in one FIFO. Stopping at a record whose receiver's ring is full would hold up every
//! record behind it: one receiver that stops reading (with SO_RCVBUF above its ring, so never
//! congested) would cut off the other sockets of its thread from the sending thread. So such a
//! record is copied into the receiver's backlog and the pair ring moves on. The same holds on
//! the receiver's own thread (`deliver_or_park`'s `here`): a local sender's message, or a
//! network path's, waits in the backlog rather than hold up the sender's later messages to
//! other destinations or the other sockets on the path, as the kernel's receive queue grows up
//! to SO_RCVBUF.
//!
//! - **Order:** once a socket has a backlog, every later message for it joins the backlog, and
//!   the backlog reaches the ring (oldest first) before anything else does; so what one sender
//!   sends it stays in order.
//! - **Bounds:** a parked message is the receiver's (its sender's bytes are released, as the
//!   kernel's loopback releases them once the message is in the receiver's queue; a pair ring's
//!   records stay the sender's until the receiving thread takes them, so SO_SNDBUF still
//!   covers the crossing); the backlog counts as queued for SO_RCVBUF, so the port is
//!   marked congested once ring and backlog pass it (senders then get ENOBUFS, peers see the
//!   map); and all backlogs of a thread hold at most `MAX_BACKLOG_BYTES`, past which a pair ring
//!   waits at the record as before (`rx_backlog_capped`).
//! - **Shares:** a socket whose backlog passes `backlog_share` (config; or that has one while
//!   all pass `BACKED_UP_TOTAL_BYTES`) raises the flag of its binding (`shard::Bound`); a local
//!   sender of another thread then waits on its own tx ring, as one of this thread waits for a
//!   full rx ring, and a network delivery for it pauses its path, as a full ring does on the
//!   connection owner's thread. So a receiver that never reads, with a huge SO_RCVBUF, holds
//!   up its senders, not the pair ring: only what was on its way when the flag rose, and a
//!   closing sender's last messages, grow a backlog past its share.
//! - **Cost:** nothing while no ring is full: one branch per forwarded delivery and one per
//!   pass (`backlogged` is empty). Parking allocates: only for a receiver already behind.
//!
//! **Group waits** are the same for the group messages of other threads' sockets, which shard 0
//! decides in pair-ring order: one that a full member (without DROP_WHEN_FULL) blocks is parked
//! with its sender's later group messages behind it, as a local sender's would wait on its own
//! tx ring, and the pair ring goes on. A fan-out that waits for its copies on other threads
//! (`GroupSent::Busy`, a thread round trip) still holds the ring for that moment.
//!
//! **Group copy waits** are the other direction: a copy of shard 0's fan-out for a member of
//! this thread whose ring is full waits here, and the ring from shard 0 goes on. Shard 0 hears
//! that the copy is published only once it is in the member's ring, so the fan-out still
//! commits only when every copy is in (a crash before that shows the message to nobody);
//! meanwhile the groups wait, as a full member holds its group back on one thread, and shard 0
//! (told by `Note::GroupCopyWaiting`) parks other threads' group messages as group waits
//! instead of letting them hold their pair rings behind the stuck fan-out.

use super::*;

/// Payload bytes (plus `PARKED_OVERHEAD` each) all backlogs of one poll thread may hold.
pub(in crate::poll) const MAX_BACKLOG_BYTES: usize = crate::config::MAX_BACKLOG_SHARE as usize;

/// What a parked message is charged on top of its payload, so that a flood of empty
/// messages is bounded too.
const PARKED_OVERHEAD: usize = 64;

/// Messages moved from a backlog to its rx ring per socket and pass.
const BACKLOG_BATCH: usize = 64;

/// Past this much in all backlogs of a thread, every socket with a backlog is past its share.
const BACKED_UP_TOTAL_BYTES: usize = MAX_BACKLOG_BYTES / 2;

/// One message waiting in a backlog.
pub(in crate::poll) struct Parked {
    faddr: u32,
    sport: u16,
    bytes: Box<[u8]>,
}

/// A copy of shard 0's fan-out `stamp` for member `token` of this shard, whose ring was full.
pub(in crate::poll) struct GroupCopyWait {
    token: u64,
    faddr: u32,
    sport: u16,
    stamp: u64,
    bytes: Box<[u8]>,
}

/// A group message of another shard's socket, blocked by a full member.
pub(in crate::poll) struct GroupWait {
    from: usize,
    /// The sender's token: names the socket (and its incarnation) to keep its order.
    token: u64,
    src: (u32, u16),
    group: (u32, u16),
    bytes: Box<[u8]>,
}

impl SocketTable {
    /// A message for `to`: into its rx ring, or into its backlog if the ring is full or a
    /// backlog is already there (so that what one sender sends stays in order).
    ///
    /// `here`: a delivery made on this thread (a local sender's, or the network's on the
    /// connection owner's thread). Parking it means that a receiver that stops reading holds up
    /// neither its thread's other receivers (a local sender's later messages to them) nor the
    /// sockets that share its network path, as in the kernel, whose receive queue grows up to
    /// SO_RCVBUF; past the receiver's share it is `Full` instead (the local sender waits on its
    /// tx ring, the path pauses). Otherwise it came from the fabric (or from a closing sender):
    /// parked whatever the share; `Full` only past this thread's backlogs' cap. A parked
    /// message is in its receiver's queue: its sender's bytes are released as for a delivery.
    /// Always inlined: it is every local delivery's (as `deliver_to`).
    #[inline(always)]
    pub(super) fn deliver_or_park(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        here: bool,
    ) -> Delivered {
        // Almost always no socket of this thread has a backlog: no lookup then.
        let queued =
            !self.backlogged.is_empty() && self.sock(to).is_some_and(|s| !s.backlog.is_empty());
        if !queued {
            let d = self.deliver_to(to, faddr, sport, payload);
            if d != Delivered::Full {
                return d;
            }
        }
        self.park(to, faddr, sport, payload, queued, here)
    }

    /// The slow half of [`Self::deliver_or_park`]: parks a copy of `payload` in `to`'s backlog
    /// (`queued`: it has one already), or answers `Full` past the share (`here`) or the cap.
    #[cold]
    #[inline(never)]
    fn park(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        queued: bool,
        here: bool,
    ) -> Delivered {
        let (total, share) = (self.backlog_total, self.cfg.backlog_share);
        let Some(s) = self.sock(to) else {
            return Delivered::NoSocket;
        };
        if here && (share == 0 || s.past_share(total, share)) {
            let local = self
                .cfg
                .local_addrs
                .iter()
                .any(|p| p.contains(faddr.into()));
            Stats::bump(if local {
                &self.stats.tx_held_for_backlog
            } else {
                &self.stats.rx_held_for_backlog
            });
            return Delivered::Full;
        }
        let Some(bytes) = self.keep_copy(payload) else {
            return Delivered::Full;
        };
        let len = payload.len();
        let p = Parked {
            faddr,
            sport,
            bytes,
        };
        let s = self.sock(to).expect("open");
        s.backlog.push_back(p);
        s.backlog_bytes += len as u64;
        if !queued {
            self.backlogged.push(to);
        }
        Stats::bump(&self.stats.rx_backlogged);
        self.mark_if_over(to);
        self.update_backed_up(to);
        Delivered::Yes
    }

    /// Raises or lowers `r`'s backed-up flag by its backlog now: up while it is past
    /// `backlog_share`, or while it has one and all backlogs are past
    /// `BACKED_UP_TOTAL_BYTES`. Every pass with backlogs calls it for each (`drain_backlogs`).
    fn update_backed_up(&mut self, r: SockRef) {
        let (total, share) = (self.backlog_total, self.cfg.backlog_share);
        let Some(s) = self.sock(r) else { return };
        let up = s.past_share(total, share);
        if let Some(f) = s
            .backed_up
            .as_ref()
            .filter(|f| f.load(Ordering::Relaxed) != up)
        {
            f.store(up, Ordering::Relaxed);
        }
    }

    /// While `on`, a socket is closing (or its app leaving): what it sent that finds a local
    /// receiver's ring full is parked in that receiver's backlog whatever its share, as a send
    /// that returned success is delivered even if its sender closes right after.
    pub(in crate::poll) fn set_closing_sender(&mut self, on: bool) {
        self.closing_sender = on;
    }

    /// True while some socket has a backlog or a group message waits: a parked poll thread
    /// wakes on a short timer to move them (the app's reads ring no doorbell).
    #[inline]
    pub(in crate::poll) fn has_backlog(&self) -> bool {
        !self.backlogged.is_empty()
            || !self.group_waits.is_empty()
            || !self.group_copy_waits.is_empty()
            || !self.credit_asks.is_empty()
    }

    /// A copy of shard 0's fan-out `stamp` for member `token` of this shard: into its ring now
    /// (published gated, shard 0 told), or waiting here while the ring is full (behind that
    /// member's earlier waiting copies). False only past the backlogs' cap (the ring from
    /// shard 0 then waits at it).
    pub(in crate::poll) fn group_copy_or_wait(
        &mut self,
        token: u64,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        stamp: u64,
    ) -> bool {
        let behind = !self.group_copy_waits.is_empty()
            && self.group_copy_waits.iter().any(|w| w.token == token);
        if !behind
            && self.group_deliver_forwarded(token, faddr, sport, payload, stamp) != Delivered::Full
        {
            return true;
        }
        let Some(bytes) = self.keep_copy(payload) else {
            return false;
        };
        self.group_copy_waits.push_back(GroupCopyWait {
            token,
            faddr,
            sport,
            stamp,
            bytes,
        });
        Stats::bump(&self.stats.group_copies_waited);
        // The fan-out may now wait long: shard 0 parks other threads' group messages
        // meanwhile instead of letting them hold their pair rings.
        if let Some(l) = self.link.as_mut() {
            l.note(0, Note::GroupCopyWaiting { stamp });
        }
        true
    }

    /// Pushes waiting group copies whose members have room now, oldest first, each member's in
    /// order. Returns how many went.
    fn retry_group_copy_waits(&mut self) -> usize {
        let mut done = 0;
        let mut blocked = std::mem::take(&mut self.group_waits_blocked);
        blocked.clear();
        let mut i = 0;
        while i < self.group_copy_waits.len() {
            let token = self.group_copy_waits[i].token;
            if blocked.contains(&(0, token)) {
                i += 1;
                continue;
            }
            // Looked at first: a full ring costs no retry (nor a count of `rx_ring_full`).
            let (r, gen) = sock_of_token(token);
            let len = self.group_copy_waits[i].bytes.len();
            if self
                .sock(r)
                .is_some_and(|s| s.gen == gen && !s.rx.fits(len))
            {
                blocked.push((0, token));
                i += 1;
                continue;
            }
            let w = self.group_copy_waits.remove(i).expect("in range");
            let payload = MsgBytes::from_slice(&w.bytes);
            let d = self.group_deliver_forwarded(w.token, w.faddr, w.sport, &payload, w.stamp);
            debug_assert_ne!(d, Delivered::Full, "checked to fit");
            self.uncharge(&w.bytes);
            done += 1;
        }
        self.group_waits_blocked = blocked;
        done
    }

    /// A group message from socket `token` of shard `from`: decided now, or parked behind that
    /// sender's earlier ones or a full member. False only if the pair ring must wait (a
    /// fan-out in progress, or the backlogs full).
    pub(in crate::poll) fn group_send_forwarded(
        &mut self,
        from: usize,
        token: u64,
        src: (u32, u16),
        group: (u32, u16),
        payload: &MsgBytes<'_>,
    ) -> bool {
        let behind = !self.group_waits.is_empty()
            && self
                .group_waits
                .iter()
                .any(|w| (w.from, w.token) == (from, token));
        if !behind {
            let sender = sock_of_token(token).0;
            match self.group_send(sender, src, group.0, group.1, payload) {
                GroupSent::Done => {
                    self.release_to(from, token, payload.len());
                    return true;
                }
                GroupSent::Busy => return false,
                GroupSent::Blocked => Stats::bump(&self.stats.group_blocked),
            }
        }
        let Some(bytes) = self.keep_copy(payload) else {
            return false;
        };
        self.group_waits.push_back(GroupWait {
            from,
            token,
            src,
            group,
            bytes,
        });
        Stats::bump(&self.stats.group_parked);
        true
    }

    /// Decides the parked group messages again, oldest first, each sender's in its order (one
    /// blocked, its later ones wait). Returns how many were decided.
    fn retry_group_waits(&mut self) -> usize {
        let mut decided = 0;
        let mut blocked = std::mem::take(&mut self.group_waits_blocked);
        blocked.clear();
        let mut i = 0;
        while i < self.group_waits.len() {
            let key = (self.group_waits[i].from, self.group_waits[i].token);
            if blocked.contains(&key) {
                i += 1;
                continue;
            }
            let w = self.group_waits.remove(i).expect("in range");
            let payload = MsgBytes::from_slice(&w.bytes);
            match self.group_send(
                sock_of_token(w.token).0,
                w.src,
                w.group.0,
                w.group.1,
                &payload,
            ) {
                GroupSent::Done => {
                    self.uncharge(&w.bytes);
                    self.release_to(w.from, w.token, w.bytes.len());
                    decided += 1;
                }
                GroupSent::Busy => {
                    self.group_waits.insert(i, w);
                    break;
                }
                GroupSent::Blocked => {
                    self.group_waits.insert(i, w);
                    blocked.push(key);
                    i += 1;
                }
            }
        }
        self.group_waits_blocked = blocked;
        decided
    }

    /// Moves backlogs into their rx rings, oldest first, as far as the rings have room (at most
    /// `BACKLOG_BATCH` messages a socket), releasing each message's sender. Returns the number
    /// moved. Called at the start of a pass while `has_backlog`.
    pub(in crate::poll) fn drain_backlogs(&mut self) -> usize {
        let mut moved = 0;
        if !self.credit_asks.is_empty() {
            self.grant_group_credits();
        }
        if !self.group_waits.is_empty() {
            moved += self.retry_group_waits();
        }
        if !self.group_copy_waits.is_empty() {
            moved += self.retry_group_copy_waits();
        }
        let mut i = 0;
        self.begin_rx_burst();
        while i < self.backlogged.len() {
            let r = self.backlogged[i];
            for _ in 0..BACKLOG_BATCH {
                let Some(s) = self.sock(r) else { break };
                let keep = s.group_reserved as usize;
                let fits = match s.backlog.front() {
                    Some(p) => s.rx.fits_leaving(p.bytes.len(), keep),
                    None => false,
                };
                if !fits {
                    break;
                }
                let p = s.backlog.pop_front().expect("a front");
                s.backlog_bytes -= p.bytes.len() as u64;
                self.uncharge(&p.bytes);
                let d = self.deliver_to(r, p.faddr, p.sport, &MsgBytes::from_slice(&p.bytes));
                debug_assert_eq!(d, Delivered::Yes, "checked to fit");
                moved += 1;
            }
            self.update_backed_up(r);
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

    /// A closing socket's backlog is dropped (as its unread ring is).
    pub(super) fn drop_backlog(&mut self, r: SockRef, s: &mut Sock) {
        if s.backlog.is_empty() {
            return;
        }
        for p in std::mem::take(&mut s.backlog) {
            self.uncharge(&p.bytes);
            Stats::bump(&self.stats.drop_socket_closed);
        }
        s.backlog_bytes = 0;
        if let Some(f) = &s.backed_up {
            f.store(false, Ordering::Relaxed);
        }
        self.backlogged.retain(|&x| x != r);
    }

    /// A copy of `payload` charged to this thread's backlogs (its length and
    /// `PARKED_OVERHEAD`; given back with [`Self::uncharge`]), or `None` (counted) past
    /// `MAX_BACKLOG_BYTES`.
    fn keep_copy(&mut self, payload: &MsgBytes<'_>) -> Option<Box<[u8]>> {
        let charge = payload.len() + PARKED_OVERHEAD;
        if self.backlog_total + charge > MAX_BACKLOG_BYTES {
            Stats::bump(&self.stats.rx_backlog_capped);
            return None;
        }
        let mut bytes = Vec::with_capacity(payload.len());
        payload.copy_into(&mut bytes);
        self.backlog_total += charge;
        Some(bytes.into_boxed_slice())
    }

    /// Gives back what [`Self::keep_copy`] charged for `bytes`.
    fn uncharge(&mut self, bytes: &[u8]) {
        self.backlog_total -= bytes.len() + PARKED_OVERHEAD;
    }

    /// Gives `len` bytes back to the sender `token` (0: none) of shard `from`.
    fn release_to(&mut self, from: usize, token: u64, len: usize) {
        if token != 0 {
            if let Some(l) = self.link.as_mut() {
                l.release(from, token, len as u64);
            }
        }
    }

    /// Marks `to` congested if its ring and backlog hold more than its SO_RCVBUF.
    fn mark_if_over(&mut self, to: SockRef) {
        let Some(app) = self.apps.get_mut(to.app).and_then(|a| a.as_mut()) else {
            return;
        };
        let Some(s) = app.socks[to.slot as usize].as_mut() else {
            return;
        };
        let ctl = app.region.slot_control(to.slot);
        if !s.congested && s.over_rcvbuf(ctl, &self.stats.rx_consumed_reads) {
            self.mark_congested(to);
        }
    }
}

impl Sock {
    /// True while this socket's backlog is past its share: `share` bytes, or any
    /// backlog while all of this thread's (`total`) pass `BACKED_UP_TOTAL_BYTES`.
    #[inline]
    fn past_share(&self, total: usize, share: u64) -> bool {
        !self.backlog.is_empty() && (total >= BACKED_UP_TOTAL_BYTES || self.backlog_bytes >= share)
    }

    /// Whether more than SO_RCVBUF is queued for the app (ring and backlog). The app's
    /// consumed count is read (and `reads` bumped) only when the count last read says so: it
    /// sits on the line the app writes at every receive, and an honest app's only grows, so
    /// the old count can only overstate the queue.
    #[inline]
    pub(in crate::poll) fn over_rcvbuf(
        &mut self,
        ctl: &SlotControl,
        reads: &std::sync::atomic::AtomicU64,
    ) -> bool {
        let limit = u64::from(self.rcvbuf);
        if self.queued(self.consumed_seen) <= limit {
            return false;
        }
        Stats::bump_mine(reads);
        self.consumed_seen = ctl.rx_consumed_bytes.load(Ordering::Acquire);
        self.queued(self.consumed_seen) > limit
    }

    /// Bytes queued for the app, `consumed` being what it says it has read: the rx ring's
    /// unread ones and the backlog (what SO_RCVBUF bounds and `rdsctl info` shows).
    #[inline]
    pub(in crate::poll) fn queued(&self, consumed: u64) -> u64 {
        self.rx_produced.saturating_sub(consumed) + self.backlog_bytes
    }

    /// The backlog for `rdsctl info`: (length, source address, source port) of each message,
    /// oldest first, at most `max`.
    pub(in crate::poll) fn backlog_listing(&self, max: usize, out: &mut Vec<(u32, Ipv4Addr, u16)>) {
        for p in self.backlog.iter().take(max) {
            out.push((p.bytes.len() as u32, Ipv4Addr::from(p.faddr), p.sport));
        }
    }
}

//! Ring space kept for group copies that cross poll threads ("credits"). A child of `table`.
//!
//! Shard 0 orders every group and decides a fan-out only if every member takes the copy. For
//! its own members it asks their rx rings (`Producer::fits`), exactly. A member of another
//! shard has its ring written by that shard only, so shard 0 cannot look: it used to guess
//! (not congested, so room), and a copy that then found the ring full waited on the member's
//! shard, and with it the fan-out's commit and every later fan-out of *every* group, until
//! that member read. Now the member's shard keeps part of its ring for shard 0's copies and
//! tells shard 0 how much (`Note::GroupCredit`):
//!
//! - a join takes credit along (`group_credit_with_join`, in its `Note::GroupOp`; shard 0
//!   gives it back if the join fails);
//! - shard 0 counts a remote member as having room only while its credit covers the copy
//!   (`charge`); it takes the charge from the credit when it sends the copy, and asks for
//!   more (`Note::GroupCreditAsk`) when the credit runs low or a message was blocked by it;
//! - the member's shard grants what its ring has free beyond what it keeps already, and keeps
//!   it: its own pushes (unicast, backlogs) leave that much free (`Sock::group_reserved`,
//!   `Producer::fits_leaving`), so a copy that arrives always fits; the copy's charge comes
//!   off what is kept;
//! - credit shard 0 no longer needs (the member left its groups) goes back
//!   (`Note::GroupCreditBack`).
//!
//! So a member that stops reading blocks its own groups' sends on shard 0, exactly as a full
//! member of shard 0 does, and every other group goes on. A message too large to be charged
//! (`charge` above `CREDIT_CHUNK`), and a copy for a member that has had no credit yet (its
//! ring was full when it joined), keep the old rule: sent while the member is not congested,
//! its copy waiting on the member's shard if the ring is full.

use super::{sock_of_token, token_of, Note, SockRef, SocketTable};
use crate::stats::Stats;

/// What shard 0 asks a member's shard to keep: a few large copies' worth of a 2 MiB ring.
pub(in crate::poll) const CREDIT_CHUNK: u64 = 512 << 10;

/// Ring bytes charged for a copy of `len` bytes, whatever the ring's position then: the
/// record, and the pad before it if it wraps (less than one record).
pub(super) fn charge(len: usize) -> u64 {
    2 * shm_api::ring::record_size(len) as u64
}

/// Whether a copy of `len` bytes goes by credit (else by the old rule).
pub(super) fn charged(len: usize) -> bool {
    charge(len) <= CREDIT_CHUNK
}

/// What shard 0 knows of a remote member's credit.
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::poll) struct Credit {
    /// Bytes granted and not yet charged.
    pub bytes: u64,
    /// An ask is out (no second one until it is answered).
    pub asking: bool,
    /// A grant came: from then on a copy goes only with credit for it.
    pub granted: bool,
}

impl SocketTable {
    /// Shard 0: asks `x`'s shard for credit for member `r` if it has less than `need` bytes
    /// (or less than half a chunk: topped up before a stream runs dry), unless an ask is out.
    pub(super) fn group_credit_top_up(&mut self, r: SockRef, need: u64) {
        let Some(x) = self.groups_remote_mut(r) else {
            return;
        };
        let have = x.credit.bytes;
        if x.credit.asking || (have >= need && have >= CREDIT_CHUNK / 2) {
            return;
        }
        x.credit.asking = true;
        let (shard, gen) = (x.shard, x.gen);
        let note = Note::GroupCreditAsk {
            token: token_of(r, gen),
            need: need.saturating_sub(have).max(1),
            want: CREDIT_CHUNK
                .saturating_sub(have)
                .max(need.saturating_sub(have)),
        };
        Stats::bump(&self.stats.group_credit_asks);
        if let Some(l) = self.link.as_mut() {
            l.note(shard, note);
        }
    }

    /// Shard 0: `bytes` of credit for member `token` arrived. Kept if that member is still a
    /// remote member in that incarnation, else given back.
    pub(in crate::poll) fn group_credit_granted(&mut self, from: usize, token: u64, bytes: u64) {
        let (r, gen) = sock_of_token(token);
        match self.groups_remote_mut(r) {
            Some(x) if x.shard == from && x.gen == gen => {
                x.credit.bytes += bytes;
                x.credit.asking = false;
                x.credit.granted = true;
            }
            _ => {
                if let Some(l) = self.link.as_mut() {
                    l.note(from, Note::GroupCreditBack { token, bytes });
                }
            }
        }
    }

    /// Shard 0: remote member `r` of shard `shard` (incarnation `gen`) is forgotten with
    /// `credit` still granted: give it back.
    pub(super) fn group_credit_return(
        &mut self,
        r: SockRef,
        shard: usize,
        gen: u32,
        credit: Credit,
    ) {
        if credit.bytes == 0 {
            return;
        }
        if let Some(l) = self.link.as_mut() {
            l.note(
                shard,
                Note::GroupCreditBack {
                    token: token_of(r, gen),
                    bytes: credit.bytes,
                },
            );
        }
    }

    /// Member's shard: shard 0 asks for at least `need` bytes of member `token`'s ring, up to
    /// `want`. Granted now if the ring has that much free beyond what it keeps, else once it
    /// has (`grant_group_credits`, each pass while one waits).
    pub(in crate::poll) fn group_credit_ask(&mut self, token: u64, need: u64, want: u64) {
        let (r, gen) = sock_of_token(token);
        let Some(s) = self.sock(r).filter(|s| s.gen == gen) else {
            // Gone: shard 0 hears of the close.
            return;
        };
        s.credit_ask = Some((need, want.max(need)));
        if !self.grant_group_credit(r) && !self.credit_asks.contains(&r) {
            self.credit_asks.push(r);
        }
    }

    /// Member's shard: answers `r`'s ask if its ring has room for it now; true if answered
    /// (or nothing to answer).
    fn grant_group_credit(&mut self, r: SockRef) -> bool {
        let Some(s) = self.sock(r) else {
            return true;
        };
        let Some((need, want)) = s.credit_ask else {
            return true;
        };
        let free = (s.rx.free_bytes() as u64).saturating_sub(s.group_reserved);
        if free < need {
            return false;
        }
        let grant = want.min(free);
        s.group_reserved += grant;
        s.credit_ask = None;
        let token = token_of(r, s.gen);
        Stats::bump(&self.stats.group_credit_grants);
        if let Some(l) = self.link.as_mut() {
            l.note(
                0,
                Note::GroupCredit {
                    token,
                    bytes: grant,
                },
            );
        }
        true
    }

    /// Member's shard, each pass while asks wait: answers those whose rings have room now.
    pub(super) fn grant_group_credits(&mut self) {
        let mut i = 0;
        while i < self.credit_asks.len() {
            if self.grant_group_credit(self.credit_asks[i]) {
                self.credit_asks.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Member's shard: `r` asks to join a group: the credit its join takes along to shard 0,
    /// kept now (none if shard 0 holds credit for it already, from another of its groups).
    pub(in crate::poll) fn group_credit_with_join(&mut self, r: SockRef) -> u64 {
        let Some(s) = self.sock(r).filter(|s| s.group_reserved == 0) else {
            return 0;
        };
        let free = s.rx.free_bytes() as u64;
        let grant = CREDIT_CHUNK.min(free);
        s.group_reserved = grant;
        if grant > 0 {
            Stats::bump(&self.stats.group_credit_grants);
        }
        grant
    }

    /// Member's shard: shard 0 gives back `bytes` it kept in member `token`'s ring.
    pub(in crate::poll) fn group_credit_back(&mut self, token: u64, bytes: u64) {
        let (r, gen) = sock_of_token(token);
        if let Some(s) = self.sock(r).filter(|s| s.gen == gen) {
            s.group_reserved = s.group_reserved.saturating_sub(bytes);
        }
    }

    /// Member's shard: a copy for member `token` arrived, charged `charge` bytes of its
    /// credit by shard 0: that much of the ring is no longer kept (the copy takes it now, or
    /// waits for room as an uncharged one does).
    pub(in crate::poll) fn group_credit_spent(&mut self, token: u64, charge: u32) {
        if charge == 0 {
            return;
        }
        let (r, gen) = sock_of_token(token);
        if let Some(s) = self.sock(r).filter(|s| s.gen == gen) {
            s.group_reserved = s.group_reserved.saturating_sub(u64::from(charge));
        }
    }
}

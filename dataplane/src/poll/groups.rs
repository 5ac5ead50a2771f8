//! The poll thread's multicast groups: `crate::group::GroupTable` (the sans-IO rules) wired to
//! the socket table, which is the only writer of every member's rx ring. A child of `table`
//! (it keeps the table's invariants with the table's private fields).
//!
//! - **Fan-out** (`group_send`): the decision asks every eligible member whether its rx ring
//!   takes the record now (`Producer::fits`) and whether it is below SO_RCVBUF (not
//!   congested); on `Deliver` the record is pushed into every target before anything else
//!   happens on this thread, so a message is in all of them or in none. On `Blocked` it stays
//!   at the head of the sender's tx ring and is decided again on a later pass.
//! - **Flow control**: a group is *full* while one member without DROP_WHEN_FULL is congested
//!   (its queue above SO_RCVBUF, until it falls below half, as a unicast port). A full group
//!   sets the bit of its `addr:port` in the daemon region's congestion table, which every
//!   sender's library already tests before a send: a blocking send waits, a non-blocking one
//!   gets EAGAIN, POLLOUT of a socket connected to the group clears. The bit follows the
//!   members' congestion, joins, leaves and closes (`refresh_full`).
//! - **Lifetime**: a group holds a reference on its address's congestion entry from create to
//!   death; closing a socket (and an app's death or eviction) leaves all its groups.

use super::group_credit::{charge, charged, Credit, CREDIT_CHUNK};
use super::group_hosts::{member_host, GroupHosts};
use super::{token_of, App, Envelope, Note, ShardLink, SockRef, SocketTable};
use crate::group::wire::GroupMsg;
use crate::group::{
    Filter, GroupAddr, GroupError, GroupTable, MemberFlags, SendDecision, Sender, SenderRule,
};
use crate::seam::{Delivered, MsgBytes};
use crate::stats::Stats;
use rustc_hash::{FxHashMap, FxHashSet};
use shm_api::ctrl::{FilterMode, FilterStep};
use shm_api::layout::cong_monitor_bit;
use std::collections::VecDeque;
use std::net::Ipv4Addr;

/// A filter arriving one rule per request (`FilterStep`).
struct Staging {
    group: GroupAddr,
    mode: FilterMode,
    count: u8,
    rules: Vec<SenderRule>,
}

/// A creator or member of shard 0's groups served by another poll thread: what shard 0
/// knows of it (from its `Note::GroupOp`, kept current by `Note::CongBit`).
#[derive(Clone, Copy, Debug)]
pub(in crate::poll) struct Remote {
    /// Its poll thread.
    pub shard: usize,
    /// Its socket's incarnation there.
    pub gen: u32,
    /// Its bound address.
    pub bound: Option<(u32, u16)>,
    /// Whether its port is congested (queue above SO_RCVBUF).
    pub congested: bool,
    /// Ring space its shard keeps for this shard's copies (`group_credit.rs`).
    pub credit: Credit,
}

/// Groups one app may have created at once: a group holds its address's congestion entry and
/// every send scans it, so one app must not take them all.
const MAX_GROUPS_PER_APP: u32 = 64;
/// Multicast addresses that groups may use at once: each holds one of the daemon region's 256
/// congestion entries, which local addresses and peers need too.
const MAX_GROUP_ADDRS: usize = 64;

/// Who created a group, and who may join it.
#[derive(Clone, Copy, Debug)]
struct Meta {
    /// The creator's app (its count of created groups).
    app: usize,
    /// The creator's uid.
    uid: u32,
    /// Any uid may join (`GROUP_CREATE_OPEN`).
    open: bool,
}

/// One shard's groups and what the glue keeps beside them.
pub(super) struct Groups {
    table: GroupTable<SockRef>,
    /// Groups whose bit is set in the daemon region (a member without DROP_WHEN_FULL is
    /// congested).
    full: FxHashSet<GroupAddr>,
    /// The targets of the fan-out in progress (kept for its capacity).
    targets: Vec<SockRef>,
    /// The groups of a socket whose state changed (kept for its capacity).
    scratch: Vec<GroupAddr>,
    /// Filters being assembled, per member socket.
    staging: FxHashMap<SockRef, Staging>,
    /// Creators and members of other poll threads (shard 0 only).
    remote: FxHashMap<SockRef, Remote>,
    /// Their bound addresses, for the congestion notes of their shards.
    remote_by_addr: FxHashMap<(u32, u16), SockRef>,
    /// Creator and access of every live group.
    meta: FxHashMap<GroupAddr, Meta>,
    /// Live groups created, per app.
    per_app: FxHashMap<usize, u32>,
    /// Live groups per multicast address.
    addrs: FxHashMap<u32, u32>,
    /// Fan-outs made so far: the stamp of the last one, which the daemon region's
    /// `group_commit` reaches once its copies are all published.
    fanouts: u64,
    /// Shard 0: the fan-outs not committed yet, oldest first: each waits for its copies on
    /// other poll threads, or for an earlier one (commits go in order). At most
    /// `shm_api::gate::GATES`, so a slot's gate is taken again only after its copy's commit.
    window: VecDeque<Awaiting>,
    /// Emptied vectors of members to wake, kept for their capacity.
    spare: Vec<Vec<SockRef>>,
    /// Another shard: the members it published copies for, with their fan-out's stamp, until
    /// shard 0 says that fan-out is committed (then they are woken).
    published: Vec<(SockRef, u64)>,
    /// Shard 0: remote members whose credit a fan-out or a blocked send left short (kept for
    /// its capacity).
    short: Vec<SockRef>,
}

/// A fan-out of shard 0 not committed yet.
#[derive(Debug)]
struct Awaiting {
    stamp: u64,
    /// Copies not yet reported published.
    copies_left: u32,
    /// The shards that have copies (told of the commit).
    shards: u64,
    /// A copy waits for a full member (`Note::GroupCopyWaiting`): group messages meanwhile
    /// are `Blocked` (parked, when from another shard), not `Busy`.
    stuck: bool,
    /// Its members on this thread, woken at its commit.
    local: Vec<SockRef>,
}

impl Groups {
    /// Panics unless the table's invariants hold and, with `empty`, no group is left (the
    /// fuzzing harness, once its only app is gone).
    #[cfg(any(test, fuzzing))]
    pub(super) fn check(&self, empty: bool) {
        self.table.check_invariants();
        if empty {
            assert!(self.table.is_empty(), "no group outlives its sockets");
            assert!(self.full.is_empty() && self.staging.is_empty());
            assert!(self.remote.is_empty() && self.remote_by_addr.is_empty());
            assert!(self.meta.is_empty() && self.per_app.is_empty() && self.addrs.is_empty());
            assert!(self.window.is_empty() && self.published.is_empty());
        }
    }

    pub(super) fn new() -> Groups {
        Groups {
            table: GroupTable::default(),
            full: FxHashSet::default(),
            targets: Vec::new(),
            scratch: Vec::new(),
            staging: FxHashMap::default(),
            remote: FxHashMap::default(),
            remote_by_addr: FxHashMap::default(),
            meta: FxHashMap::default(),
            per_app: FxHashMap::default(),
            addrs: FxHashMap::default(),
            fanouts: 0,
            window: VecDeque::new(),
            spare: Vec::new(),
            published: Vec::new(),
            short: Vec::new(),
        }
    }
}

/// What became of a tx record sent to a group.
pub(in crate::poll) enum GroupSent {
    /// Delivered to every target, or dropped and counted: its bytes are free.
    Done,
    /// A member without DROP_WHEN_FULL has no room, or the member host of a group another
    /// host owns has no window left: leave it on the ring (another thread's sender: park it,
    /// `backlog.rs`).
    Blocked,
    /// The last fan-out waits for its copies on other poll threads (a thread round trip):
    /// try again in a moment.
    Busy,
}

fn group_addr(addr: Ipv4Addr, port: u16) -> Result<GroupAddr, i32> {
    GroupAddr::new(u32::from(addr), port).map_err(GroupError::errno)
}

/// Whether member `m` takes a record of `len` bytes now: below SO_RCVBUF and room in its rx
/// ring. A member whose socket is gone has "room": the delivery skips it (closes leave their
/// groups at once, so this is only a guard).
fn member_room(
    apps: &mut [Option<App>],
    remote: &FxHashMap<SockRef, Remote>,
    link: Option<&ShardLink>,
    hosts: &GroupHosts,
    m: SockRef,
    len: usize,
) -> bool {
    if let Some(h) = member_host(m) {
        // Another host: room while its window is not full.
        return hosts.room(h);
    }
    // (Most groups have no member on another shard: skip the hash then.)
    if let Some(x) = (!remote.is_empty()).then(|| remote.get(&m)).flatten() {
        // Another shard's socket: not congested, nothing waiting for room towards its shard
        // (the copy goes into the pair ring, or is kept until it fits), and room kept for the
        // copy in its ring (`group_credit.rs`; not checked for a message too large for
        // credit, nor before the member's first credit arrived: the old rule, the copy waiting
        // on its shard if the ring is full).
        return !x.congested
            && link.is_none_or(|l| !l.has_kept(x.shard))
            && (!charged(len) || !x.credit.granted || x.credit.bytes >= charge(len));
    }
    let Some(s) = apps
        .get_mut(m.app)
        .and_then(|a| a.as_mut())
        .filter(|a| !a.evicted)
        .and_then(|a| a.socks.get_mut(m.slot as usize))
        .and_then(|s| s.as_mut())
    else {
        return true;
    };
    !s.congested && s.rx.fits(len)
}

impl SocketTable {
    /// The groups this shard orders (snapshots).
    pub(in crate::poll) fn groups(&self) -> &GroupTable<SockRef> {
        &self.groups.table
    }

    /// GroupCreate: `r` creates `addr:port`.
    fn group_create(
        &mut self,
        r: SockRef,
        uid: u32,
        addr: Ipv4Addr,
        port: u16,
        flags: u32,
    ) -> Result<(), i32> {
        let g = group_addr(addr, port)?;
        if flags & !shm_api::ctrl::GROUP_CREATE_OPEN != 0 {
            return Err(libc::EINVAL);
        }
        if self.group_owner(g).is_some() {
            // `group_owners` says another host orders it: create it there.
            return Err(libc::EADDRNOTAVAIL);
        }
        if self.groups.table.exists(g) {
            return Err(libc::EADDRINUSE);
        }
        let mine = self.groups.per_app.get(&r.app).copied().unwrap_or(0);
        let new_addr = !self.groups.addrs.contains_key(&g.addr());
        if mine >= MAX_GROUPS_PER_APP || (new_addr && self.groups.addrs.len() >= MAX_GROUP_ADDRS) {
            return Err(libc::ENOBUFS);
        }
        // The group's full bit lives in its address's congestion entry.
        self.ref_cong_entry(g.addr())?;
        if let Err(e) = self.groups.table.create(g, r) {
            self.unref_cong_entry(g.addr());
            return Err(e.errno());
        }
        Stats::bump(&self.stats.groups_created);
        self.groups.meta.insert(
            g,
            Meta {
                app: r.app,
                uid,
                open: flags & shm_api::ctrl::GROUP_CREATE_OPEN != 0,
            },
        );
        *self.groups.per_app.entry(r.app).or_default() += 1;
        *self.groups.addrs.entry(g.addr()).or_default() += 1;
        Ok(())
    }

    /// Whether `g` is full (its bit set: a member without DROP_WHEN_FULL is congested).
    pub(in crate::poll) fn group_full(&self, g: GroupAddr) -> bool {
        self.groups.full.contains(&g)
    }

    /// A group request (create, join, leave, filter) on shard 0, which orders every group:
    /// of its own socket `r` (`remote` None), or of socket `r` of another shard, as its
    /// `Note::GroupOp` describes it. Success registers a remote socket, so that its close,
    /// its congestion and its deliveries find it.
    pub(in crate::poll) fn group_op(
        &mut self,
        r: SockRef,
        remote: Option<(Remote, u32)>,
        req: shm_api::ctrl::Request,
    ) -> Result<(), i32> {
        use shm_api::ctrl::Request;
        debug_assert_eq!(self.shard, 0, "shard 0 orders every group");
        let uid = match remote {
            Some((_, uid)) => uid,
            None => self.app_uid(r.app),
        };
        let remote = remote.map(|(x, _)| x);
        let res = match req {
            Request::GroupCreate {
                addr, port, flags, ..
            } => self.group_create(r, uid, addr, port, flags),
            Request::GroupJoin {
                addr,
                port,
                flags,
                update,
                ..
            } => {
                let bound = match remote {
                    Some(x) => x.bound,
                    None => self.sock(r).and_then(|s| s.bound),
                };
                self.group_join(r, uid, bound, addr, port, flags, update)
            }
            Request::GroupLeave { addr, port, .. } => self.group_leave(r, addr, port),
            Request::GroupFilter {
                addr, port, step, ..
            } => self.group_filter(r, addr, port, step),
            _ => Err(libc::EINVAL),
        };
        let registered = res.is_ok() && !self.groups.table.groups_of(r).is_empty();
        if let (false, Some(x)) = (registered, remote) {
            // The credit a failed join took along goes back.
            self.group_credit_return(r, x.shard, x.gen, x.credit);
        }
        if let (true, Some(mut x)) = (registered, remote) {
            if let Some(old) = self.groups.remote.get(&r) {
                if (old.shard, old.gen) == (x.shard, x.gen) {
                    // Known already (another group, new flags): its credit stays, with
                    // what this request brought.
                    x.credit.bytes += old.credit.bytes;
                    x.credit.asking = old.credit.asking;
                    x.credit.granted |= old.credit.granted;
                    x.congested = old.congested;
                }
            }
            if let Some(old) = self.groups.remote.insert(r, x) {
                if (old.shard, old.gen) != (x.shard, x.gen) {
                    self.group_credit_return(r, old.shard, old.gen, old.credit);
                }
            }
            if let Some(b) = x.bound {
                self.groups.remote_by_addr.insert(b, r);
            }
            if matches!(req, Request::GroupJoin { .. }) {
                // A member: room in its ring for the copies to come (a creator that is no
                // member gets none, and keeps its whole ring).
                self.group_credit_top_up(r, 0);
            }
            // A member that joined congested makes the group full at once.
            self.groups_member_congestion(r);
        }
        res
    }

    /// Shard 0: socket `r` of shard `shard` (incarnation `gen`) closed.
    pub(in crate::poll) fn groups_remote_closed(&mut self, r: SockRef, shard: usize, gen: u32) {
        match self.groups.remote.get(&r) {
            Some(x) if x.shard == shard && x.gen == gen => {}
            // Not known, or an older incarnation whose index a newer socket took meanwhile.
            _ => return,
        }
        self.groups_socket_closed(r);
    }

    /// Shard 0: the congestion of another shard's port `(addr, port)` changed.
    pub(in crate::poll) fn groups_remote_congestion(&mut self, addr: u32, port: u16, on: bool) {
        let Some(&r) = self.groups.remote_by_addr.get(&(addr, port)) else {
            return;
        };
        if let Some(x) = self.groups.remote.get_mut(&r) {
            x.congested = on;
        }
        self.groups_member_congestion(r);
    }

    /// The credit of a group's socket of another shard (snapshots).
    pub(in crate::poll) fn group_remote_credit(&self, r: SockRef) -> Option<u64> {
        self.groups.remote.get(&r).map(|x| x.credit.bytes)
    }

    /// The bound address of a group's socket of another shard (snapshots).
    pub(in crate::poll) fn group_remote_bound(&self, r: SockRef) -> Option<(u32, u16)> {
        self.groups.remote.get(&r).and_then(|x| x.bound)
    }

    /// A copy of shard 0's fan-out `stamp` for member `token` of this shard: `Full` while its
    /// ring has no room (the pair ring waits), `NoSocket` if that socket is gone. Otherwise
    /// the copy is published gated (unreadable until shard 0 commits `stamp`), and shard 0
    /// hears that it is (also when the member is gone: nothing to wait for).
    pub(in crate::poll) fn group_deliver_forwarded(
        &mut self,
        token: u64,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        stamp: u64,
    ) -> Delivered {
        let (r, gen) = super::sock_of_token(token);
        let d = match self.sock(r) {
            Some(s) if s.gen == gen => {
                if !s.rx.fits(payload.len()) {
                    Stats::bump(&self.stats.rx_ring_full);
                    return Delivered::Full;
                }
                if self.push_group_copy(r, faddr, sport, payload, stamp) {
                    self.groups.published.push((r, stamp));
                    Delivered::Yes
                } else {
                    Delivered::NoSocket
                }
            }
            _ => Delivered::NoSocket,
        };
        self.link
            .as_mut()
            .expect("copies come from shard 0")
            .note(0, Note::GroupPublished { stamp });
        if d == Delivered::Yes {
            self.test_fanout_faults();
        }
        d
    }

    /// Shard 0: one copy of fan-out `stamp` on another poll thread is published (or its member
    /// is gone). Fan-outs whose copies are all published commit in order: every copy readable
    /// at once, the local members woken, the other shards told to wake theirs.
    pub(in crate::poll) fn group_copy_published(&mut self, stamp: u64) {
        let Some(a) = self.groups.window.iter_mut().find(|a| a.stamp == stamp) else {
            debug_assert!(false, "a copy of fan-out {stamp} that nobody awaits");
            return;
        };
        a.copies_left -= 1;
        self.commit_ready();
    }

    /// Shard 0: commits the fan-outs at the front of the window whose copies are all
    /// published (one store for all: the last one's stamp).
    fn commit_ready(&mut self) {
        let mut last = None;
        let mut shards = 0u64;
        let mut woken = std::mem::take(&mut self.groups.targets);
        woken.clear();
        while self
            .groups
            .window
            .front()
            .is_some_and(|a| a.copies_left == 0)
        {
            let mut a = self.groups.window.pop_front().expect("a front");
            last = Some(a.stamp);
            shards |= a.shards;
            woken.append(&mut a.local);
            self.groups.spare.push(a.local);
        }
        if let Some(stamp) = last {
            shm_api::gate::commit(self.dview.group_commit(), stamp);
            self.wake_group_members(woken.iter().copied());
            let link = self.link.as_mut().expect("copies on other shards");
            for k in (1..64).filter(|k| shards & (1 << k) != 0) {
                link.note(k, Note::GroupCommitted { stamp });
            }
        }
        woken.clear();
        self.groups.targets = woken;
    }

    /// Shard 0: a copy of fan-out `stamp` waits for a full member on another shard.
    pub(in crate::poll) fn group_copy_waiting(&mut self, stamp: u64) {
        if let Some(a) = self.groups.window.iter_mut().find(|a| a.stamp == stamp) {
            a.stuck = true;
        }
    }

    /// Another shard: fan-outs up to `stamp` are committed; wake the members of this shard
    /// they reached.
    pub(in crate::poll) fn group_committed(&mut self, stamp: u64) {
        let mut published = std::mem::take(&mut self.groups.published);
        self.wake_group_members(
            published
                .iter()
                .filter(|&&(_, s)| s <= stamp)
                .map(|&(r, _)| r),
        );
        published.retain(|&(_, s)| s > stamp);
        self.groups.published = published;
    }

    /// Owner: member host `m` joins `g`. Across hosts only groups created open may be
    /// joined (this host cannot vouch for another host's uids). The errno of a refusal, or 0.
    pub(super) fn group_host_join(&mut self, g: GroupAddr, m: SockRef) -> i32 {
        match self.groups.meta.get(&g) {
            // Not created here (or only mirrored here).
            None => return libc::ENOENT,
            Some(meta) if !meta.open => return libc::EACCES,
            Some(_) => {}
        }
        match self.groups.table.join(g, m, MemberFlags::NONE, Filter::All) {
            Ok(()) | Err(GroupError::AlreadyMember) => {
                self.refresh_full(g);
                0
            }
            Err(e) => e.errno(),
        }
    }

    /// Owner: member host `m` has no member of `g` left.
    pub(super) fn group_host_leave(&mut self, g: GroupAddr, m: SockRef) {
        if self.groups.table.leave(g, m).is_ok() {
            self.group_changed(g);
        }
    }

    /// Member host: the owner refused our join of `g`: every local membership of it ends.
    pub(super) fn group_dissolve(&mut self, g: GroupAddr) {
        let members: Vec<SockRef> = self
            .groups
            .table
            .group(g)
            .map(|v| v.members.iter().map(|m| m.sock).collect())
            .unwrap_or_default();
        for r in members {
            let _ = self.groups.table.leave(g, r);
            if self.groups.table.groups_of(r).is_empty() {
                self.forget_remote(r);
            }
        }
        self.group_changed(g);
    }

    /// Shard 0: `r` (if another shard's) is in no group any more: forgotten, its credit given
    /// back.
    fn forget_remote(&mut self, r: SockRef) {
        if let Some(x) = self.groups.remote.remove(&r) {
            if let Some(b) = x.bound {
                self.groups.remote_by_addr.remove(&b);
            }
            self.group_credit_return(r, x.shard, x.gen, x.credit);
        }
    }

    /// Shard 0: what it knows of another shard's group socket `r`.
    pub(super) fn groups_remote_mut(&mut self, r: SockRef) -> Option<&mut Remote> {
        self.groups.remote.get_mut(&r)
    }

    /// The group socket of another poll thread bound at `bound`, if one made group requests.
    pub(super) fn group_remote_sock(&self, bound: (u32, u16)) -> Option<SockRef> {
        self.groups.remote_by_addr.get(&bound).copied()
    }

    /// GroupJoin: `r` (bound) joins `addr:port`, or changes its flags (`update`).
    #[allow(clippy::too_many_arguments)]
    fn group_join(
        &mut self,
        r: SockRef,
        uid: u32,
        bound: Option<(u32, u16)>,
        addr: Ipv4Addr,
        port: u16,
        flags: u32,
        update: bool,
    ) -> Result<(), i32> {
        let g = group_addr(addr, port)?;
        let flags = MemberFlags::from_bits(flags).map_err(GroupError::errno)?;
        if bound.is_none() {
            // A member receives: like any receiver it needs an address.
            return Err(libc::ENOTCONN);
        }
        let owner = self.group_owner(g);
        let done = if update {
            self.groups.table.set_flags(g, r, flags)
        } else if let Some(owner) = owner {
            // Ordered by another host: this host's mirror of it (the owner decides who may
            // join: only groups created open).
            let fresh = !self.groups.table.exists(g);
            self.groups
                .table
                .join_open(g, r, flags, Filter::All)
                .map_err(GroupError::errno)?;
            if fresh {
                self.mirror_opened(g, owner, bound.expect("checked").0);
            }
            Ok(())
        } else if self
            .groups
            .meta
            .get(&g)
            .is_some_and(|m| !m.open && uid != m.uid && uid != 0)
        {
            // Its members read what anyone sends it: the creator's uid decides, as a socket
            // file's owner does.
            return Err(libc::EACCES);
        } else {
            self.groups.table.join(g, r, flags, Filter::All)
        };
        done.map_err(GroupError::errno)?;
        self.refresh_full(g);
        Ok(())
    }

    /// GroupLeave.
    fn group_leave(&mut self, r: SockRef, addr: Ipv4Addr, port: u16) -> Result<(), i32> {
        let g = group_addr(addr, port)?;
        self.groups.table.leave(g, r).map_err(GroupError::errno)?;
        self.groups.staging.remove(&r);
        if self.groups.table.groups_of(r).is_empty() {
            self.forget_remote(r);
        }
        self.group_changed(g);
        Ok(())
    }

    /// GroupFilter: one rule of `r`'s new filter on `addr:port`; the filter replaces the old
    /// one when its last rule arrives.
    fn group_filter(
        &mut self,
        r: SockRef,
        addr: Ipv4Addr,
        port: u16,
        step: FilterStep,
    ) -> Result<(), i32> {
        let g = group_addr(addr, port)?;
        let rule = || {
            SenderRule::new(
                u32::from(step.rule.addr),
                step.rule.prefix_len,
                step.rule.first_port,
                step.rule.last_port,
            )
            .map_err(GroupError::errno)
        };
        let filter = match step.mode {
            FilterMode::All => {
                self.groups.staging.remove(&r);
                Filter::All
            }
            _ => {
                let rule = rule()?;
                if step.index == 0 {
                    self.groups.staging.insert(
                        r,
                        Staging {
                            group: g,
                            mode: step.mode,
                            count: step.count,
                            rules: Vec::with_capacity(step.count.into()),
                        },
                    );
                }
                let st = self.groups.staging.get_mut(&r).ok_or(libc::EINVAL)?;
                let in_order = st.group == g
                    && st.mode == step.mode
                    && st.count == step.count
                    && st.rules.len() == usize::from(step.index);
                if !in_order {
                    self.groups.staging.remove(&r);
                    return Err(libc::EINVAL);
                }
                st.rules.push(rule);
                if st.rules.len() < usize::from(st.count) {
                    // Not complete yet: checked as far as it goes (the member exists).
                    return match self.groups.table.group(g) {
                        None => Err(libc::ENOENT),
                        Some(v) if !v.members.iter().any(|m| m.sock == r) => {
                            Err(libc::EADDRNOTAVAIL)
                        }
                        Some(_) => Ok(()),
                    };
                }
                let st = self.groups.staging.remove(&r).expect("staged");
                let rules = st.rules.into_boxed_slice();
                match st.mode {
                    FilterMode::Only => Filter::Only(rules),
                    _ => Filter::Except(rules),
                }
            }
        };
        self.groups
            .table
            .set_filter(g, r, filter)
            .map_err(GroupError::errno)
    }

    /// GroupConnect: `r`'s default destination is group `addr:port` (POLLOUT follows its
    /// full bit), or no group (`addr` unspecified).
    pub(in crate::poll) fn group_connect(
        &mut self,
        r: SockRef,
        addr: Ipv4Addr,
        port: u16,
    ) -> Result<(), i32> {
        let dest = if addr.is_unspecified() {
            None
        } else {
            Some(group_addr(addr, port)?)
        };
        self.sock(r).expect("live").group_dest = dest;
        Ok(())
    }

    /// `r` is closing: it leaves every group it created or joined.
    pub(super) fn groups_socket_closed(&mut self, r: SockRef) {
        self.groups.staging.remove(&r);
        let mut list = std::mem::take(&mut self.groups.scratch);
        list.clear();
        list.extend_from_slice(self.groups.table.groups_of(r));
        if list.is_empty() {
            self.groups.scratch = list;
            return;
        }
        for g in &list {
            if self
                .groups
                .table
                .group(*g)
                .is_some_and(|v| v.members.iter().any(|m| m.sock == r))
            {
                Stats::bump(&self.stats.group_members_closed);
            }
        }
        self.groups.table.close_socket(r);
        self.forget_remote(r);
        for &g in &list {
            self.group_changed(g);
        }
        self.groups.scratch = list;
    }

    /// `r`'s congestion changed: the groups it is in may have become full or free.
    pub(super) fn groups_member_congestion(&mut self, r: SockRef) {
        if self.groups.table.groups_of(r).is_empty() {
            return;
        }
        let mut list = std::mem::take(&mut self.groups.scratch);
        list.clear();
        list.extend_from_slice(self.groups.table.groups_of(r));
        for &g in &list {
            self.refresh_full(g);
        }
        self.groups.scratch = list;
    }

    /// After a leave or a close: a dead group gives its congestion reference back; a live
    /// one may be free now.
    fn group_changed(&mut self, g: GroupAddr) {
        if self.groups.table.exists(g) {
            self.refresh_full(g);
            return;
        }
        if self.mirror_closed(g) {
            // A mirror holds no congestion entry and has no creator.
            if self.groups.full.remove(&g) {
                self.set_group_bit(g, false);
            }
            return;
        }
        if self.groups.full.remove(&g) {
            self.set_group_bit(g, false);
        }
        self.unref_cong_entry(g.addr());
        if let Some(m) = self.groups.meta.remove(&g) {
            if let Some(n) = self.groups.per_app.get_mut(&m.app) {
                *n -= 1;
                if *n == 0 {
                    self.groups.per_app.remove(&m.app);
                }
            }
            if let Some(n) = self.groups.addrs.get_mut(&g.addr()) {
                *n -= 1;
                if *n == 0 {
                    self.groups.addrs.remove(&g.addr());
                }
            }
        }
    }

    /// Brings `g`'s full bit in line with its members.
    fn refresh_full(&mut self, g: GroupAddr) {
        let (apps, remote) = (&self.apps, &self.groups.remote);
        let congested = |m: SockRef| {
            if let Some(x) = remote.get(&m) {
                return x.congested;
            }
            apps.get(m.app)
                .and_then(|a| a.as_ref())
                .and_then(|a| a.socks.get(m.slot as usize))
                .and_then(|s| s.as_ref())
                .is_some_and(|s| s.congested)
        };
        let full = matches!(
            self.groups.table.any_blocker(g, |m| !congested(m)),
            Ok(Some(_))
        );
        if full == self.groups.full.contains(&g) {
            return;
        }
        if full {
            self.groups.full.insert(g);
        } else {
            self.groups.full.remove(&g);
        }
        self.set_group_bit(g, full);
        if !full {
            // Blocked senders and POLLOUT waiters look again.
            self.wake_uncongested(cong_monitor_bit(g.port()));
        }
    }

    /// Sets or clears `g`'s bit in the daemon region (not a local port: no transport hears
    /// of it, no peer gets it in a congestion map).
    fn set_group_bit(&mut self, g: GroupAddr, on: bool) {
        self.set_region_cong_bit(g.addr(), g.port(), on);
    }

    /// Shard 0: a send to `g` was blocked: its remote members with less credit than `need`
    /// ask their shards for more (at most one ask out per member).
    fn ask_credit_for(&mut self, g: GroupAddr, need: u64) {
        let mut short = std::mem::take(&mut self.groups.short);
        short.clear();
        if let Some(v) = self.groups.table.group(g) {
            short.extend(v.members.iter().map(|m| m.sock).filter(|r| {
                self.groups
                    .remote
                    .get(r)
                    .is_some_and(|x| x.credit.bytes < need && !x.credit.asking)
            }));
        }
        for &r in &short {
            self.group_credit_top_up(r, need);
        }
        short.clear();
        self.groups.short = short;
    }

    /// The copy of fan-out `stamp` for member `to` of shard `x.shard`; true if it is on its
    /// way (in the pair ring, or kept until it fits), so that shard will report it published.
    fn forward_group_copy(
        &mut self,
        to: SockRef,
        x: Remote,
        src: (u32, u16),
        payload: &MsgBytes<'_>,
        stamp: u64,
        charge: u32,
    ) -> bool {
        let Some((laddr, dport)) = x.bound else {
            return false;
        };
        let env = Envelope::GroupDeliver {
            laddr,
            faddr: src.0,
            sport: src.1,
            dport,
            token: token_of(to, x.gen),
            stamp,
            charge,
        };
        let link = self
            .link
            .as_mut()
            .expect("remote members exist with several shards");
        if link.forward_or_keep(x.shard, env, payload).is_err() {
            // rdsd keeps 64 MiB for that shard already: it has not read for that long.
            Stats::bump(&self.stats.group_remote_lost);
            return false;
        }
        true
    }

    /// One message from `from` (bound to `src`) to group `addr:port`: fan it out to every
    /// eligible member or to none; to a group another host orders, send it to that host.
    pub(in crate::poll) fn group_send(
        &mut self,
        from: SockRef,
        src: (u32, u16),
        addr: u32,
        port: u16,
        payload: &MsgBytes<'_>,
    ) -> GroupSent {
        let Ok(g) = GroupAddr::new(addr, port) else {
            Stats::bump(&self.stats.group_no_group);
            return GroupSent::Done;
        };
        self.group_send_as(from, src, g, payload, false)
    }

    /// [`Self::group_send`] of a decoded group; `numbered` for a message another host sent
    /// here to be fanned out (an owner's `Data`, a member host's `Send` to its owner): never
    /// sent on to another owner.
    pub(super) fn group_send_as(
        &mut self,
        from: SockRef,
        src: (u32, u16),
        g: GroupAddr,
        payload: &MsgBytes<'_>,
        numbered: bool,
    ) -> GroupSent {
        if let Some(owner) = self.group_owner(g).filter(|_| !numbered) {
            if !self.hosts.room(owner) {
                return GroupSent::Blocked;
            }
            Stats::bump(&self.stats.group_host_sends);
            let head = GroupMsg::Send {
                group: g,
                from: src,
                payload: &[],
            };
            self.queue_to_host(owner, src.0, head, Some(payload));
            return GroupSent::Done;
        }
        if !self.groups.window.is_empty() {
            // Fan-outs wait for their copies on other poll threads (a thread round trip, or a
            // full member's reads). One that may wait long blocks the groups; otherwise up to
            // `GATES` may be uncommitted at once, each taking one gate of its members' slots.
            if self.groups.window.iter().any(|a| a.stuck) {
                return GroupSent::Blocked;
            }
            if self.groups.window.len() >= shm_api::gate::GATES {
                return GroupSent::Busy;
            }
        }
        let len = payload.len();
        let sender = Sender {
            sock: from,
            addr: src.0,
            port: src.1,
        };
        let (apps, link, hosts) = (&mut self.apps, self.link.as_ref(), &self.hosts);
        let Groups {
            table,
            remote,
            targets,
            ..
        } = &mut self.groups;
        let mut targets = std::mem::take(targets);
        targets.clear();
        let decision = table.send(g, sender, len, |m| {
            member_room(apps, remote, link, hosts, m, len)
        });
        let seq;
        match decision {
            Err(_) => {
                Stats::bump(&self.stats.group_no_group);
                self.groups.targets = targets;
                return GroupSent::Done;
            }
            Ok(SendDecision::Blocked { .. }) => {
                // Counted once per wait: a local sender here, a sender of another shard when
                // its message is parked (`backlog.rs`).
                if let Some(s) = self.sock(from).filter(|s| !s.group_blocked) {
                    s.group_blocked = true;
                    Stats::bump(&self.stats.group_blocked);
                }
                self.groups.targets = targets;
                if charged(len) && !self.groups.remote.is_empty() {
                    self.ask_credit_for(g, charge(len));
                }
                return GroupSent::Blocked;
            }
            Ok(SendDecision::Deliver(d)) => {
                seq = d.seq;
                let st = &self.stats;
                Stats::bump_mine(&st.group_sends);
                Stats::add_mine(&st.group_deliveries, d.targets.len() as u64);
                Stats::add_mine(&st.group_drops_full, d.skipped_full.into());
                Stats::add_mine(&st.group_filtered, d.filtered.into());
            }
        }
        // The decision's targets are ours now (no copy); the table keeps our spare vector.
        self.groups.table.swap_targets(&mut targets);
        if let Some(s) = self.sock(from) {
            s.group_blocked = false;
        }
        // Every copy, here or on another poll thread, is gated by this fan-out's stamp and
        // published; then one commit store makes them readable together: a crash of rdsd
        // between two publishes leaves the message read by nobody.
        self.groups.fanouts += 1;
        let stamp = self.groups.fanouts;
        let copies = targets.len();
        let mut away = Awaiting {
            stamp,
            copies_left: 0,
            shards: 0,
            stuck: false,
            local: Vec::new(),
        };
        if self.host_links() > 0 && targets.iter().any(|&t| member_host(t).is_some()) {
            targets.retain(|&to| {
                let Some(host) = member_host(to) else {
                    return true;
                };
                // A member host: the numbered message goes there once, in the group's order.
                Stats::bump(&self.stats.group_host_data);
                let head = GroupMsg::Data {
                    group: g,
                    seq,
                    from: src,
                    payload: &[],
                };
                self.queue_to_host(host, 0, head, Some(payload));
                false
            });
        }
        if !self.groups.remote.is_empty() {
            targets.retain(|&to| {
                let Some(&x) = self.groups.remote.get(&to) else {
                    return true;
                };
                // A member of another shard: its copy crosses in the pair ring, in order,
                // charged to its credit if it goes by credit.
                let c = if charged(len) && x.credit.bytes >= charge(len) {
                    charge(len)
                } else {
                    0
                };
                if self.forward_group_copy(to, x, src, payload, stamp, c as u32) {
                    away.copies_left += 1;
                    away.shards |= 1 << x.shard;
                    let x = self.groups.remote.get_mut(&to).expect("looked up above");
                    x.credit.bytes -= c;
                    if x.credit.bytes < CREDIT_CHUNK / 2 && !x.credit.asking {
                        self.groups.short.push(to);
                    }
                }
                false
            });
            let mut short = std::mem::take(&mut self.groups.short);
            for &r in &short {
                self.group_credit_top_up(r, 0);
            }
            short.clear();
            self.groups.short = short;
        }
        // Every target said it fits, and nothing ran on this thread since: every push
        // succeeds. Committed now if nothing else waits for a commit; else in order, once the
        // other shards report its copies and the earlier fan-outs' published
        // (`group_copy_published`), and its local members woken then.
        let commit = away.copies_left == 0 && self.groups.window.is_empty();
        self.fan_out_copies(&mut targets, src.0, src.1, payload, stamp, copies, commit);
        if !commit {
            away.local = self.groups.spare.pop().unwrap_or_default();
            std::mem::swap(&mut away.local, &mut targets);
            self.groups.window.push_back(away);
        }
        self.groups.targets = targets;
        GroupSent::Done
    }
}

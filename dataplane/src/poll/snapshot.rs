//! Introspection snapshots (`rdsctl info`): the sockets and multicast groups of the table and
//! the connections and paths of every transport, copied out by the poll core for the control
//! thread.
//!
//! The control thread asks with [`super::Cmd::Snapshot`] through the ordinary command queue, so
//! the poll core builds a snapshot only between two passes, when such a command is waiting:
//! the steady-state path gains nothing (no lock, no allocation, no syscall, not even a flag
//! test beyond the queue pop it already does). The snapshot is owned data handed back in
//! [`super::CmdReply::Snapshot`]; the control thread adds what it knows (pids, uids) and
//! serialises it off the poll core.

use super::PollCore;
use crate::group::MemberFlags;
use crate::seam::ConnSnapshot;
use rustc_hash::FxHashMap;
use shm_api::ring::RingMemory;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;

/// One open socket.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SockSnapshot {
    /// App index (the control connection's slot).
    pub app: usize,
    /// The poll thread serving it.
    pub shard: usize,
    /// Socket slot in the app's region.
    pub slot: u32,
    /// The app's pid (filled in by the control thread).
    pub pid: i32,
    /// The app's uid (filled in by the control thread).
    pub uid: u32,
    /// Bound address, if bound.
    pub addr: Option<Ipv4Addr>,
    /// Bound port (0 if unbound).
    pub port: u16,
    /// SO_RCVBUF (congestion threshold).
    pub rcvbuf: u32,
    /// SO_SNDBUF.
    pub sndbuf: u32,
    /// Payload bytes delivered to the rx ring and not yet read by the app.
    pub rx_queued_bytes: u64,
    /// True if the rx ring holds unread records (zero-length messages count).
    pub rx_pending: bool,
    /// Payload bytes the app sent that rdsd has not released yet: still on the tx ring,
    /// queued in a transport, or unacknowledged by the peer.
    pub tx_queued_bytes: u64,
    /// The port is marked congested (rx queue above SO_RCVBUF).
    pub congested: bool,
    /// Of `rx_queued_bytes`, those waiting in rdsd behind a full rx ring (its backlog:
    /// messages from other poll threads).
    pub rx_backlog_bytes: u64,
    /// The backlog is past its share: local senders on other poll threads wait on their own
    /// tx rings, and network paths to it pause (`poll/backlog.rs`).
    pub backed_up: bool,
    /// RDS_CONG_MONITOR is on.
    pub cong_monitor: bool,
    /// The app asked for a pollable readiness fd.
    pub pollable: bool,
    /// The messages on the rx ring the app has not read, oldest first, within the snapshot's
    /// budget ([`crate::seam::MAX_LISTED`]): (length, sender address, sender port) (the `Info`
    /// section `messages`, `RDS_INFO_RECV_MESSAGES`).
    #[serde(skip)]
    pub rx_messages: Vec<(u32, Ipv4Addr, u16)>,
}

/// A socket of a group (its creator or a member), by its bound address.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GroupSockSnapshot {
    /// App index (the control connection's slot).
    pub app: usize,
    /// Socket slot in the app's region.
    pub slot: u32,
    /// The app's pid (filled in by the control thread).
    pub pid: i32,
    /// Bound address, if bound.
    pub addr: Option<Ipv4Addr>,
    /// Bound port (0 if unbound).
    pub port: u16,
}

/// One membership of a group.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GroupMemberSnapshot {
    /// The member socket.
    #[serde(flatten)]
    pub sock: GroupSockSnapshot,
    /// Its `GROUP_*` flag bits (`shm_api::ctrl::GROUP_LOOPBACK`, `GROUP_DROP_WHEN_FULL`).
    pub flags: u32,
    /// LOOPBACK: it receives what its own socket sends to the group.
    pub loopback: bool,
    /// DROP_WHEN_FULL: skipped (and counted) while full instead of holding the group back.
    pub drop_when_full: bool,
    /// Its filter: `all`, `only RULE,...` or `except RULE,...` (a rule is
    /// `addr/prefix:first-last`).
    pub filter: String,
    /// A member of another poll thread: the room its thread keeps in its rx ring for the
    /// copies to come, not yet charged (`group_credit.rs`); absent for the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit: Option<u64>,
}

/// One multicast group of a poll thread.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GroupSnapshot {
    /// The poll thread that orders it.
    pub shard: usize,
    /// Group address (224.0.0.0/4).
    pub addr: Ipv4Addr,
    /// Group port.
    pub port: u16,
    /// Which incarnation (a group created again gets a new epoch and starts at seq 1).
    pub epoch: u64,
    /// The creator's socket, while it is open.
    pub creator: Option<GroupSockSnapshot>,
    /// The host that orders it, if another host does (this host mirrors it for its local
    /// members); `None`: ordered here.
    pub owner: Option<Ipv4Addr>,
    /// Members, in the order they joined. A member host of a group ordered here is one
    /// member: app `usize::MAX`, the host's address, port `GROUP_PORT`.
    pub members: Vec<GroupMemberSnapshot>,
    /// Sequence number of the last message delivered (0: none yet).
    pub last_seq: u64,
    /// Messages numbered and delivered (to zero or more members).
    pub sends: u64,
    /// Copies delivered (one per target).
    pub deliveries: u64,
    /// DROP_WHEN_FULL members skipped for lack of room.
    pub drops_full: u64,
    /// Members whose filter rejected a message.
    pub filtered: u64,
    /// A member without DROP_WHEN_FULL is congested: senders wait (EAGAIN, no POLLOUT).
    pub full: bool,
}

/// What the poll core copies out for `rdsctl info`.
#[derive(Clone, Debug, Default)]
pub struct PollSnapshot {
    /// Open sockets, by app and slot.
    pub sockets: Vec<SockSnapshot>,
    /// Connections of every network transport.
    pub connections: Vec<ConnSnapshot>,
    /// Multicast groups of every poll thread asked so far, by address and port.
    pub groups: Vec<GroupSnapshot>,
    /// Transports, in routing order.
    pub transports: Vec<&'static str>,
    /// Poll threads whose sockets are in `sockets` (the control thread asks each in turn).
    pub shards_seen: usize,
    /// Apps each poll thread serves (filled in by the control thread, which places them).
    pub apps_per_shard: Vec<u32>,
}

impl PollCore {
    /// Copies out sockets, groups, connections and paths (slow path: on a Snapshot command
    /// only).
    pub(super) fn snapshot(&mut self, messages: bool) -> PollSnapshot {
        let mut out = PollSnapshot {
            shards_seen: self.table.shard() + 1,
            ..PollSnapshot::default()
        };
        // Received and sent messages have a budget each: a slow reader's full ring does not
        // hide the send queues.
        let budget = if messages { crate::seam::MAX_LISTED } else { 0 };
        let mut listed = budget;
        self.table.for_each_sock(|r, s, ctl| {
            // App-written numbers: only ever shown, never trusted.
            let consumed = ctl.rx_consumed_bytes.load(Ordering::Acquire);
            let sent = ctl.tx_sent_bytes.load(Ordering::Acquire);
            let rx = s.rx.memory();
            out.sockets.push(SockSnapshot {
                app: r.app,
                shard: self.table.shard(),
                slot: r.slot,
                pid: 0,
                uid: 0,
                addr: s.bound.map(|b| Ipv4Addr::from(b.0)),
                port: s.bound.map_or(0, |b| b.1),
                rcvbuf: s.rcvbuf,
                sndbuf: s.sndbuf,
                rx_queued_bytes: s.queued(consumed),
                rx_pending: rx.producer().load(Ordering::Relaxed)
                    != rx.consumer().load(Ordering::Acquire)
                    || !s.backlog.is_empty(),
                tx_queued_bytes: sent.saturating_sub(s.released),
                congested: s.congested,
                rx_backlog_bytes: s.backlog_bytes,
                backed_up: s
                    .backed_up
                    .as_ref()
                    .is_some_and(|f| f.load(Ordering::Relaxed)),
                cong_monitor: s.monitor,
                pollable: s.readiness_on,
                rx_messages: {
                    let mut v = Vec::new();
                    s.rx.unconsumed(listed, |h| v.push((h.len, Ipv4Addr::from(h.addr), h.port)));
                    // Then those waiting in rdsd behind them (`backlog.rs`).
                    s.backlog_listing(listed - v.len(), &mut v);
                    listed -= v.len();
                    v
                },
            });
        });
        self.snapshot_groups(&mut out);
        let mut sends_listed = budget;
        for t in self.transports.iter_mut() {
            out.transports.push(t.name());
            t.snapshot(&mut out.connections, &mut sends_listed);
        }
        for c in out.connections.iter_mut() {
            c.shard = self.table.shard();
        }
        out
    }
}

impl PollCore {
    /// This shard's groups, sorted by address and port; sockets named by the bound addresses
    /// `out.sockets` already holds.
    fn snapshot_groups(&self, out: &mut PollSnapshot) {
        let bound: FxHashMap<(usize, u32), (Option<Ipv4Addr>, u16)> = out
            .sockets
            .iter()
            .map(|s| ((s.app, s.slot), (s.addr, s.port)))
            .collect();
        let sock = |r: super::SockRef| {
            if let Some(host) = super::table::member_host(r) {
                return GroupSockSnapshot {
                    app: r.app,
                    slot: 0,
                    pid: 0,
                    addr: Some(Ipv4Addr::from(host)),
                    port: crate::group::wire::GROUP_PORT,
                };
            }
            let (addr, port) = bound.get(&(r.app, r.slot)).copied().unwrap_or_else(|| {
                // A socket of another poll thread (shard 0 orders every group).
                self.table
                    .group_remote_bound(r)
                    .map_or((None, 0), |(a, p)| (Some(Ipv4Addr::from(a)), p))
            });
            GroupSockSnapshot {
                app: r.app,
                slot: r.slot,
                pid: 0,
                addr,
                port,
            }
        };
        let shard = self.table.shard();
        let start = out.groups.len();
        for g in self.table.groups().groups() {
            out.groups.push(GroupSnapshot {
                shard,
                addr: Ipv4Addr::from(g.addr.addr()),
                port: g.addr.port(),
                epoch: g.epoch,
                creator: g.creator.map(sock),
                owner: self.table.group_mirror_owner(g.addr),
                members: g
                    .members
                    .iter()
                    .map(|m| GroupMemberSnapshot {
                        sock: sock(m.sock),
                        flags: m.flags.bits(),
                        loopback: m.flags.contains(MemberFlags::LOOPBACK),
                        drop_when_full: m.flags.contains(MemberFlags::DROP_WHEN_FULL),
                        filter: m.filter.to_string(),
                        credit: self.table.group_remote_credit(m.sock),
                    })
                    .collect(),
                last_seq: g.last_seq,
                sends: g.counters.sends,
                deliveries: g.counters.deliveries,
                drops_full: g.counters.drops_full,
                filtered: g.counters.filtered,
                full: self.table.group_full(g.addr),
            });
        }
        out.groups[start..].sort_by_key(|g| (g.addr, g.port));
    }
}

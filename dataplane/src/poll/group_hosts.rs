//! Multicast groups with members on several hosts (issue 20): the group table of `groups.rs`
//! wired to other hosts' rdsd, over RDS itself (`crate::group::wire`, port `GROUP_PORT`). A
//! child of `table`; shard 0 only (it owns the groups and the network transports).
//!
//! - **Who orders a group.** Its *owner*: the host where it was created. `group_owners` (the
//!   configuration) names the owner of the groups ordered elsewhere; every other group is
//!   local, as before.
//! - **A member host.** A join here to a group owned elsewhere opens a *mirror* (a group of
//!   the local table without a creator, `GroupTable::join_open`) and sends `Join` to the owner;
//!   the last local member leaving sends `Leave`. A local send to such a group goes to the
//!   owner as `Send` (with the sender's address and port): it is not delivered here before the
//!   owner numbers it. The owner's `Data` is fanned out to the mirror's local members like a
//!   local message (flags, filters, DROP_WHEN_FULL and the commit point apply here), in the
//!   owner's order; a member host that cannot take it yet answers `Full`, so the RDS path
//!   pauses and the message waits at the owner (nothing is lost).
//! - **The owner** keeps each member host as one member of the group (`host_member`); a
//!   decision that reaches it queues one `Data` for that host, in the group's order.
//! - **Flow control.** A member host has room while the bytes queued for it and not yet
//!   acknowledged by its rdsd stay within `HOST_WINDOW`: an unreachable or slow host holds
//!   the group back (its sends block, as for a full local member) until RDS reconnects and
//!   its messages are acknowledged.
//! - **The outbox.** A decision may run inside a transport's delivery upcall, where no
//!   transport can be called, so messages for hosts are queued per host (`HostLink::out`, a
//!   buffer kept between passes: no allocation in steady state) and handed to the transport
//!   at the end of the pass (`PollCore::flush_group_out`).

use super::{token_of, SockRef, SocketTable};
use crate::config::Config;
use crate::group::wire::{GroupMsg, GROUP_PORT, MAX_HEADER};
use crate::group::GroupAddr;
use crate::seam::{Delivered, Incoming, MsgBytes};
use crate::stats::Stats;
use rustc_hash::FxHashMap;
use std::net::Ipv4Addr;

/// The app index of a member that is a whole host (its `slot` is the host's address).
const HOST_APP: usize = usize::MAX;
/// The app index of the sender of a message that another host's app sent.
const REMOTE_SENDER_APP: usize = usize::MAX - 1;
/// The app bits of a release token for bytes queued to a host: no app has that index
/// (`max_apps` ≤ 4095), and it fits the token's 12 app bits, so a token forwarded to the
/// shard that owns the host's connection (`shard::forwarded_token`) comes back intact.
const TOKEN_APP: usize = 0xfff;
/// Hosts this host exchanges group messages with (a token names one in 12 bits).
const MAX_HOSTS: usize = 4096;
/// Bytes queued for a member host and not yet acknowledged before the group waits for it.
const HOST_WINDOW: u64 = 8 << 20;

/// The member that stands for host `addr` in the owner's group table.
pub(super) fn host_member(addr: u32) -> SockRef {
    SockRef {
        app: HOST_APP,
        slot: addr,
    }
}

/// The host a member stands for, if it is one.
pub(in crate::poll) fn member_host(m: SockRef) -> Option<u32> {
    (m.app == HOST_APP).then_some(m.slot)
}

/// The sender of a message another host's app sent: matches no local membership, so every
/// member gets it (its own host's LOOPBACK rule applies there).
pub(super) fn remote_sender() -> SockRef {
    SockRef {
        app: REMOTE_SENDER_APP,
        slot: 0,
    }
}

/// The host link a release token names, if it is one of ours.
pub(super) fn host_of_token(r: SockRef) -> Option<u16> {
    (r.app == TOKEN_APP).then_some(r.slot as u16)
}

fn host_token(i: u16) -> u64 {
    token_of(
        SockRef {
            app: TOKEN_APP,
            slot: u32::from(i),
        },
        0,
    )
}

/// What this host sends to one other host.
struct HostLink {
    addr: u32,
    /// Our address towards it (the RDS connection's local end).
    laddr: u32,
    /// Bytes handed to the transport and not yet acknowledged (released).
    unacked: u64,
    /// Messages queued for the end of the pass: `[len: u32 LE][bytes]` each.
    out: Vec<u8>,
}

/// A group another host orders, with local members.
#[derive(Clone, Copy, Debug)]
struct Mirror {
    owner: u32,
}

/// Shard 0's state for groups across hosts.
pub(super) struct GroupHosts {
    /// `group_owners` as (network, mask, owner), host order.
    owners: Vec<(u32, u32, u32)>,
    links: Vec<HostLink>,
    index: FxHashMap<u32, u16>,
    mirrors: FxHashMap<GroupAddr, Mirror>,
    /// Some link has queued messages.
    pending: bool,
    /// A received message, copied out of its (possibly shared) buffer to be parsed.
    wire_in: Vec<u8>,
}

impl GroupHosts {
    pub(super) fn new(cfg: &Config) -> GroupHosts {
        GroupHosts {
            owners: cfg
                .group_owners
                .iter()
                .map(|&(p, o)| {
                    let mask = u32::MAX.checked_shl(32 - u32::from(p.len)).unwrap_or(0);
                    (u32::from(p.addr) & mask, mask, u32::from(o))
                })
                .collect(),
            links: Vec::new(),
            index: FxHashMap::default(),
            mirrors: FxHashMap::default(),
            pending: false,
            wire_in: Vec::new(),
        }
    }

    /// Whether host `addr` takes another message of the group now.
    pub(super) fn room(&self, addr: u32) -> bool {
        self.index.get(&addr).is_none_or(|&i| {
            let l = &self.links[usize::from(i)];
            l.unacked + l.out.len() as u64 <= HOST_WINDOW
        })
    }
}

impl SocketTable {
    /// The host that orders `g`, if another host does.
    pub(super) fn group_owner(&self, g: GroupAddr) -> Option<u32> {
        self.hosts
            .owners
            .iter()
            .find(|&&(net, mask, _)| g.addr() & mask == net)
            .map(|&(_, _, o)| o)
    }

    /// The owner of `g` if this host mirrors it (has local members of a group owned elsewhere).
    pub(in crate::poll) fn group_mirror_owner(&self, g: GroupAddr) -> Option<Ipv4Addr> {
        self.hosts.mirrors.get(&g).map(|m| Ipv4Addr::from(m.owner))
    }

    fn host_link(&mut self, addr: u32, laddr: u32) -> Option<u16> {
        if let Some(&i) = self.hosts.index.get(&addr) {
            return Some(i);
        }
        if self.hosts.links.len() >= MAX_HOSTS {
            return None;
        }
        let i = self.hosts.links.len() as u16;
        self.hosts.links.push(HostLink {
            addr,
            laddr,
            unacked: 0,
            out: Vec::new(),
        });
        self.hosts.index.insert(addr, i);
        Some(i)
    }

    /// Queues `msg` (its header; then `payload`, if any) for host `addr`, sent from our
    /// address `laddr` if this is the first message to that host.
    pub(super) fn queue_to_host(
        &mut self,
        addr: u32,
        laddr: u32,
        msg: GroupMsg<'_>,
        payload: Option<&MsgBytes<'_>>,
    ) {
        let Some(i) = self.host_link(addr, laddr) else {
            Stats::bump(&self.stats.group_host_lost);
            return;
        };
        let mut head = [0u8; MAX_HEADER];
        let (n, _) = msg.emit_header(&mut head);
        let len = n + payload.map_or(0, MsgBytes::len);
        let out = &mut self.hosts.links[usize::from(i)].out;
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&head[..n]);
        if let Some(p) = payload {
            p.append_to(out);
        }
        self.hosts.pending = true;
    }

    /// Whether messages wait for [`Self::take_host_out`] (one flag test per pass otherwise).
    #[inline]
    pub(in crate::poll) fn group_out_pending(&self) -> bool {
        self.hosts.pending
    }

    /// The flusher takes every link's messages (those it cannot send come back with
    /// [`Self::put_host_out`], which raises the flag again).
    pub(in crate::poll) fn group_out_taken(&mut self) {
        self.hosts.pending = false;
    }

    /// Hosts with a link (indices for [`Self::take_host_out`]).
    pub(in crate::poll) fn host_links(&self) -> u16 {
        self.hosts.links.len() as u16
    }

    /// Host `i`'s queued messages, for the poll core to hand to a transport: `(addr, laddr,
    /// token, bytes)`; give the buffer back with [`Self::put_host_out`].
    pub(in crate::poll) fn take_host_out(&mut self, i: u16) -> Option<(u32, u32, u64, Vec<u8>)> {
        let l = &mut self.hosts.links[usize::from(i)];
        if l.out.is_empty() {
            return None;
        }
        Some((l.addr, l.laddr, host_token(i), std::mem::take(&mut l.out)))
    }

    /// Gives back host `i`'s buffer: its first `sent` bytes went to the transport; the rest
    /// waits for the next pass.
    pub(in crate::poll) fn put_host_out(&mut self, i: u16, mut buf: Vec<u8>, sent: usize) {
        let l = &mut self.hosts.links[usize::from(i)];
        buf.drain(..sent);
        if !l.out.is_empty() {
            buf.extend_from_slice(&l.out);
        }
        if !buf.is_empty() {
            self.hosts.pending = true;
        }
        l.out = buf;
    }

    /// `len` bytes are about to be handed to the transport for host link `i` (counted before
    /// the call: a transport may release them within it).
    pub(in crate::poll) fn group_host_sending(&mut self, i: u16, len: u64) {
        self.hosts.links[usize::from(i)].unacked += len;
    }

    /// The transport acknowledged (or gave up on) `len` bytes queued to host link `i`.
    pub(in crate::poll) fn group_host_released(&mut self, i: u16, len: u64) {
        if let Some(l) = self.hosts.links.get_mut(usize::from(i)) {
            l.unacked = l.unacked.saturating_sub(len);
        }
    }

    /// A local socket (bound at `laddr`) opened the mirror of `g`, owned by `owner`.
    pub(super) fn mirror_opened(&mut self, g: GroupAddr, owner: u32, laddr: u32) {
        self.hosts.mirrors.insert(g, Mirror { owner });
        self.queue_to_host(owner, laddr, GroupMsg::Join { group: g }, None);
    }

    /// `g` died here: if it was a mirror, tell its owner that this host has no member left.
    /// True if it was one.
    pub(super) fn mirror_closed(&mut self, g: GroupAddr) -> bool {
        let Some(m) = self.hosts.mirrors.remove(&g) else {
            return false;
        };
        self.queue_to_host(m.owner, 0, GroupMsg::Leave { group: g }, None);
        true
    }

    /// A message to the group port (the transports' delivery upcall).
    pub(super) fn group_wire_in(&mut self, m: &Incoming<'_>) -> Delivered {
        if m.sport != GROUP_PORT || self.shard != 0 {
            // Only rdsd speaks from the group port (apps may not bind it).
            Stats::bump(&self.stats.group_wire_bad);
            return Delivered::NoSocket;
        }
        let mut buf = std::mem::take(&mut self.hosts.wire_in);
        m.payload.copy_into(&mut buf);
        let d = match GroupMsg::parse(&buf) {
            Ok(msg) => self.group_wire_msg(m.laddr, m.faddr, msg),
            Err(_) => {
                Stats::bump(&self.stats.group_wire_bad);
                Delivered::NoSocket
            }
        };
        self.hosts.wire_in = buf;
        d
    }

    fn group_wire_msg(&mut self, laddr: u32, host: u32, msg: GroupMsg<'_>) -> Delivered {
        let g = msg.group();
        match msg {
            GroupMsg::Join { .. } => {
                // Only the owner answers; a host that thinks we own a group we do not gets
                // ENOENT (or EACCES: across hosts, only groups created open).
                let errno = if self.group_owner(g).is_some() {
                    libc::ENOENT
                } else {
                    self.group_host_join(g, host_member(host))
                };
                if errno == 0 {
                    Stats::bump(&self.stats.group_host_joins);
                }
                self.queue_to_host(
                    host,
                    laddr,
                    GroupMsg::Joined {
                        group: g,
                        errno: errno as u32,
                    },
                    None,
                );
            }
            GroupMsg::Leave { .. } => self.group_host_leave(g, host_member(host)),
            GroupMsg::Joined { errno, .. } => {
                // Joined (errno 0) needs nothing; a refusal ends our mirror.
                let ours = self.hosts.mirrors.get(&g).is_some_and(|m| m.owner == host);
                if ours && errno != 0 {
                    Stats::bump(&self.stats.group_host_refused);
                    tracing::warn!(
                        group = %Ipv4Addr::from(g.addr()), port = g.port(),
                        owner = %Ipv4Addr::from(host), errno,
                        "the owner refused this host's join: its members here are dropped"
                    );
                    self.group_dissolve(g);
                }
            }
            GroupMsg::Send { from, payload, .. } => {
                if self.group_owner(g).is_some() {
                    // Not ours to order (the hosts disagree on the owner): never sent on.
                    Stats::bump(&self.stats.group_host_lost);
                    return Delivered::NoSocket;
                }
                if !self.groups().exists(g) {
                    // Gone here (or never created, or we restarted): the sender's host drops
                    // its mirror, as for a refused join.
                    Stats::bump(&self.stats.group_no_group);
                    let refusal = GroupMsg::Joined {
                        group: g,
                        errno: libc::ENOENT as u32,
                    };
                    self.queue_to_host(host, laddr, refusal, None);
                    return Delivered::Yes;
                }
                let payload = MsgBytes::from_slice(payload);
                if !matches!(
                    self.group_send_as(remote_sender(), from, g, &payload, true),
                    super::GroupSent::Done
                ) {
                    return Delivered::Full;
                }
            }
            GroupMsg::Data { from, payload, .. } => {
                if self.hosts.mirrors.get(&g).is_none_or(|m| m.owner != host) {
                    // No member of it here (any more): stop the owner sending.
                    Stats::bump(&self.stats.group_host_lost);
                    self.queue_to_host(host, laddr, GroupMsg::Leave { group: g }, None);
                    return Delivered::Yes;
                }
                // The sender's own membership here (LOOPBACK) if it is a local socket.
                let sender = self
                    .binds
                    .get(&from)
                    .copied()
                    .or_else(|| self.group_remote_sock(from))
                    .unwrap_or_else(remote_sender);
                let payload = MsgBytes::from_slice(payload);
                if !matches!(
                    self.group_send_as(sender, from, g, &payload, true),
                    super::GroupSent::Done
                ) {
                    return Delivered::Full;
                }
            }
        }
        Delivered::Yes
    }
}

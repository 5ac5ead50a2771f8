//! Multicast groups on RDS sockets (rdsd's extension; the multicast Unix sockets proposal):
//! a message sent to a group reaches every eligible member or none, all members see the
//! group's messages in one order, and a full member holds the group back unless it joined
//! with [`GroupFlags::DROP_WHEN_FULL`]. A group is an address in 224.0.0.0/4 plus a port;
//! `send_to(group)` sends to it and members receive with `recv_from`, the source being the
//! sender's socket. rdsd's poll thread, the only writer of every member's receive ring, is
//! the group's sequencer (dataplane/docs/groups.md, "Multicast groups").

use super::{errno, Socket};
use crate::ctrl::{
    FilterMode, FilterRule, FilterStep, Request, GROUP_CREATE_OPEN, GROUP_DROP_WHEN_FULL,
    GROUP_FILTER_MAX_RULES, GROUP_LOOPBACK,
};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::ops::BitOr;

/// Flags of one membership.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupFlags(u32);

impl GroupFlags {
    /// Neither flag: the socket's own sends skip it, and a full buffer holds the group back.
    pub const NONE: GroupFlags = GroupFlags(0);
    /// The member receives what its own socket sends to the group.
    pub const LOOPBACK: GroupFlags = GroupFlags(GROUP_LOOPBACK);
    /// Skipped (and counted) while its receive buffer is full, instead of blocking the group.
    pub const DROP_WHEN_FULL: GroupFlags = GroupFlags(GROUP_DROP_WHEN_FULL);

    /// Flags from their bits (rdsd refuses unknown bits with EINVAL).
    pub const fn from_bits(bits: u32) -> GroupFlags {
        GroupFlags(bits)
    }

    /// The bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
}

impl BitOr for GroupFlags {
    type Output = GroupFlags;
    fn bitor(self, rhs: GroupFlags) -> GroupFlags {
        GroupFlags(self.0 | rhs.0)
    }
}

/// Which of a group's messages a member receives, by sender.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum GroupFilter {
    /// Every message.
    #[default]
    All,
    /// Only messages from senders matching one of the rules (at most 16).
    Only(Vec<FilterRule>),
    /// Every message except those from senders matching one of the rules (at most 16).
    Except(Vec<FilterRule>),
}

/// Whether `addr` names a group (224.0.0.0/4).
pub fn is_group(addr: SocketAddrV4) -> bool {
    addr.ip().is_multicast()
}

fn check_group(group: SocketAddrV4) -> io::Result<()> {
    if !is_group(group) || group.port() == 0 {
        return Err(errno(libc::EINVAL));
    }
    Ok(())
}

impl Socket {
    /// Creates `group` (224.0.0.0/4, port not 0), which sockets of this process's uid (and
    /// root) may join. The socket does not join it; the group lives while this socket is open
    /// or it has members. EADDRINUSE if it exists, ENOBUFS past rdsd's limits (64 groups per
    /// process, 64 group addresses per host), EINVAL for an address outside 224.0.0.0/4.
    pub fn group_create(&self, group: SocketAddrV4) -> io::Result<()> {
        self.group_create_flags(group, 0)
    }

    /// Like [`Socket::group_create`], but sockets of any uid may join.
    pub fn group_create_open(&self, group: SocketAddrV4) -> io::Result<()> {
        self.group_create_flags(group, GROUP_CREATE_OPEN)
    }

    fn group_create_flags(&self, group: SocketAddrV4, flags: u32) -> io::Result<()> {
        check_group(group)?;
        self.client.request(Request::GroupCreate {
            slot: self.slot,
            addr: *group.ip(),
            port: group.port(),
            flags,
        })?;
        Ok(())
    }

    /// Joins `group` (the socket must be bound: ENOTCONN otherwise). ENOENT if there is no
    /// such group, EADDRINUSE if already a member, ENOBUFS past rdsd's member limit, EACCES
    /// if the group's creator had another uid and did not make it open (root may join any).
    pub fn group_join(&self, group: SocketAddrV4, flags: GroupFlags) -> io::Result<()> {
        self.group_join_inner(group, flags, false)
    }

    /// Changes the flags of this socket's membership of `group` (EADDRNOTAVAIL if none).
    pub fn group_set_flags(&self, group: SocketAddrV4, flags: GroupFlags) -> io::Result<()> {
        self.group_join_inner(group, flags, true)
    }

    fn group_join_inner(
        &self,
        group: SocketAddrV4,
        flags: GroupFlags,
        update: bool,
    ) -> io::Result<()> {
        check_group(group)?;
        self.client.request(Request::GroupJoin {
            slot: self.slot,
            addr: *group.ip(),
            port: group.port(),
            flags: flags.bits(),
            update,
        })?;
        Ok(())
    }

    /// Leaves `group`. EADDRNOTAVAIL if not a member, ENOENT if there is no such group.
    pub fn group_leave(&self, group: SocketAddrV4) -> io::Result<()> {
        check_group(group)?;
        self.client.request(Request::GroupLeave {
            slot: self.slot,
            addr: *group.ip(),
            port: group.port(),
        })?;
        Ok(())
    }

    /// Replaces this socket's filter on `group`, at once for every later message (rdsd
    /// applies it when all its rules have arrived). EINVAL for more than 16 rules, an empty
    /// rule list, a prefix longer than 32 or a port range backwards.
    pub fn group_set_filter(&self, group: SocketAddrV4, filter: &GroupFilter) -> io::Result<()> {
        check_group(group)?;
        let (mode, rules) = match filter {
            GroupFilter::All => (FilterMode::All, &[][..]),
            GroupFilter::Only(r) => (FilterMode::Only, &r[..]),
            GroupFilter::Except(r) => (FilterMode::Except, &r[..]),
        };
        if mode != FilterMode::All && (rules.is_empty() || rules.len() > GROUP_FILTER_MAX_RULES)
            || rules
                .iter()
                .any(|r| r.prefix_len > 32 || r.first_port > r.last_port)
        {
            return Err(errno(libc::EINVAL));
        }
        let steps: Vec<FilterStep> = if mode == FilterMode::All {
            vec![FilterStep::all()]
        } else {
            rules
                .iter()
                .enumerate()
                .map(|(i, &rule)| FilterStep {
                    mode,
                    index: i as u8,
                    count: rules.len() as u8,
                    rule,
                })
                .collect()
        };
        for step in steps {
            self.client.request(Request::GroupFilter {
                slot: self.slot,
                addr: *group.ip(),
                port: group.port(),
                step,
            })?;
        }
        Ok(())
    }

    /// Tells rdsd whether the default destination is a group (its POLLOUT then follows the
    /// group's flow control).
    pub(super) fn group_connect(&self, dest: Option<SocketAddrV4>) -> io::Result<()> {
        let d = dest.filter(|d| is_group(*d));
        self.client.request(Request::GroupConnect {
            slot: self.slot,
            addr: d.map_or(Ipv4Addr::UNSPECIFIED, |d| *d.ip()),
            port: d.map_or(0, |d| d.port()),
        })?;
        Ok(())
    }
}

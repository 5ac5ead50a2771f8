//! Local multicast groups (issue 20): the rules of the multicast Unix sockets proposal on RDS
//! sockets, as a deterministic state machine without I/O (`poll/groups.rs` wires it to the
//! poll thread; [`wire`] is the protocol between hosts for members on other hosts).
//!
//! A group is an RDS address in 224.0.0.0/4 plus a port ([`GroupAddr`]). A socket creates it,
//! sockets join and leave it; it lives while its creator's socket is open or it has members. A
//! socket may be in several groups; closing it (or its app's death) leaves them all. Each
//! membership has [`MemberFlags`] (LOOPBACK, DROP_WHEN_FULL) and a [`Filter`].
//!
//! [`GroupTable::send`] is the sequencer's decision for one message, made by the poll thread
//! that owns the group, which is also the only writer of its members' rx rings: given which
//! members have room (a closure the caller supplies), it answers either
//! [`SendDecision::Deliver`] — a per-group sequence number and the exact targets, every one of
//! which has room, so the caller's enqueues all succeed (all or none) — or
//! [`SendDecision::Blocked`] — a member without DROP_WHEN_FULL has no room, nobody gets the
//! message, the caller leaves it on the sender's tx ring (a blocking send waits, a non-blocking
//! one gets EAGAIN). Joins, leaves and deaths are applied between two decisions, never inside
//! one, so a message reaches exactly the eligible members of the moment it is numbered; the
//! sequence number of that moment is the group's one total order, whatever the senders.
//!
//! Who is eligible for a message from sender S: every member except S's own membership without
//! LOOPBACK, and except members whose filter rejects it (counted in `filtered`; they never hold
//! the group back). Of those, a member without room is skipped if it has DROP_WHEN_FULL
//! (counted in `drops_full`) and blocks the send otherwise.
//!
//! Errors ([`GroupError::errno`]) follow the nearest unicast or IP-multicast analogue: a group
//! address outside 224.0.0.0/4 (or port 0), unknown flags or a bad filter: EINVAL; creating a
//! group that exists: EADDRINUSE (as a second bind of one addr:port); joining twice: EADDRINUSE
//! (as `IP_ADD_MEMBERSHIP`); no such group: ENOENT (as connecting an AF_UNIX socket to a
//! missing path); leaving a group one is not in: EADDRNOTAVAIL (as `IP_DROP_MEMBERSHIP`); past
//! the table's limits: ENOBUFS (as `IP_ADD_MEMBERSHIP` past `igmp_max_memberships`). A send to
//! a group that does not exist comes back as ENOENT too, but the app's `sendto` has returned by
//! the time the poll thread decides, so the caller drops it and counts it as a unicast send to
//! an unbound port (`drop_unbound_dest`).
//!
//! Steady state allocates nothing: the targets of a decision live in a buffer the table keeps
//! (capacity grows to the largest group once); memberships allocate at join only.

mod filter;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
pub mod wire;

pub use filter::{Filter, FilterInput, SenderRule};

use rustc_hash::FxHashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::net::Ipv4Addr;
use std::ops::BitOr;

/// A group's address: an IPv4 multicast address (host order) and a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupAddr {
    addr: u32,
    port: u16,
}

impl GroupAddr {
    /// `addr:port` if `addr` is in 224.0.0.0/4 and `port` is not 0; EINVAL otherwise.
    pub fn new(addr: u32, port: u16) -> Result<GroupAddr, GroupError> {
        if !Ipv4Addr::from(addr).is_multicast() || port == 0 {
            return Err(GroupError::NotMulticast);
        }
        Ok(GroupAddr { addr, port })
    }

    /// Whether an RDS destination is a group's (the poll thread's routing test).
    pub fn is_group_addr(addr: u32) -> bool {
        Ipv4Addr::from(addr).is_multicast()
    }

    /// The address (host order).
    pub fn addr(self) -> u32 {
        self.addr
    }

    /// The port.
    pub fn port(self) -> u16 {
        self.port
    }
}

/// Flags of one membership.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemberFlags(u32);

impl MemberFlags {
    /// No flag: the sender does not receive its own messages, and a full buffer blocks the
    /// group.
    pub const NONE: MemberFlags = MemberFlags(0);
    /// The member receives the messages its own socket sends to the group.
    pub const LOOPBACK: MemberFlags = MemberFlags(1);
    /// The member is skipped (and the skip counted) when it has no room, instead of holding
    /// the group back.
    pub const DROP_WHEN_FULL: MemberFlags = MemberFlags(2);
    const KNOWN: u32 = 3;

    /// Flags as an app passes them; EINVAL for an unknown bit.
    pub fn from_bits(bits: u32) -> Result<MemberFlags, GroupError> {
        if bits & !Self::KNOWN != 0 {
            return Err(GroupError::BadFlags);
        }
        Ok(MemberFlags(bits))
    }

    /// The bits, as an app passes them.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: MemberFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for MemberFlags {
    type Output = MemberFlags;
    fn bitor(self, rhs: MemberFlags) -> MemberFlags {
        MemberFlags(self.0 | rhs.0)
    }
}

/// Why a group operation failed; [`GroupError::errno`] is what the app sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupError {
    /// Not an address in 224.0.0.0/4, or port 0 (EINVAL).
    NotMulticast,
    /// A flag bit rdsd does not know (EINVAL).
    BadFlags,
    /// A filter rule that cannot match as written (EINVAL).
    BadFilter,
    /// The group exists already (EADDRINUSE).
    GroupExists,
    /// The socket is a member already (EADDRINUSE).
    AlreadyMember,
    /// No such group (ENOENT).
    NoSuchGroup,
    /// The socket is not a member of that group (EADDRNOTAVAIL).
    NotMember,
    /// The table holds [`GroupLimits::max_groups`] groups (ENOBUFS).
    TooManyGroups,
    /// The group holds [`GroupLimits::max_members`] members (ENOBUFS).
    TooManyMembers,
}

impl GroupError {
    /// The errno an app sees.
    pub fn errno(self) -> i32 {
        match self {
            GroupError::NotMulticast | GroupError::BadFlags | GroupError::BadFilter => libc::EINVAL,
            GroupError::GroupExists | GroupError::AlreadyMember => libc::EADDRINUSE,
            GroupError::NoSuchGroup => libc::ENOENT,
            GroupError::NotMember => libc::EADDRNOTAVAIL,
            GroupError::TooManyGroups | GroupError::TooManyMembers => libc::ENOBUFS,
        }
    }
}

/// Bounds on what apps can make the poll thread hold and scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimits {
    /// Groups at once in one table.
    pub max_groups: usize,
    /// Members of one group (a send scans them all).
    pub max_members: usize,
}

impl Default for GroupLimits {
    fn default() -> GroupLimits {
        GroupLimits {
            max_groups: 4096,
            max_members: 1024,
        }
    }
}

/// Counters of decisions made (never of blocked attempts, which a waiting sender repeats).
/// Plain fields: the poll thread adds them into its `Stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupCounters {
    /// Messages numbered and delivered (to zero or more members).
    pub sends: u64,
    /// Copies delivered (one per target).
    pub deliveries: u64,
    /// Members skipped for lack of room because of DROP_WHEN_FULL.
    pub drops_full: u64,
    /// Members whose filter rejected a message.
    pub filtered: u64,
}

impl GroupCounters {
    fn add(&mut self, d: &GroupCounters) {
        self.sends += d.sends;
        self.deliveries += d.deliveries;
        self.drops_full += d.drops_full;
        self.filtered += d.filtered;
    }
}

/// The sending socket of a message: its name in the caller's table and its bound address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sender<M> {
    /// The socket (its own membership is skipped unless it has LOOPBACK).
    pub sock: M,
    /// Its bound address (host order).
    pub addr: u32,
    /// Its bound port.
    pub port: u16,
}

/// One membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member<M> {
    /// The member socket.
    pub sock: M,
    /// Its flags.
    pub flags: MemberFlags,
    /// Its filter.
    pub filter: Filter,
}

/// One group, as [`GroupTable::groups`] shows it (`rdsctl info`).
#[derive(Debug)]
pub struct GroupView<'a, M> {
    /// The group's address.
    pub addr: GroupAddr,
    /// Which incarnation: a group that dies and is created again gets a new epoch and starts
    /// its sequence numbers at 1 again.
    pub epoch: u64,
    /// The creator's socket, while it is open.
    pub creator: Option<M>,
    /// Members in the order they joined.
    pub members: &'a [Member<M>],
    /// The sequence number of the last message delivered (0: none yet).
    pub last_seq: u64,
    /// This incarnation's counters.
    pub counters: GroupCounters,
}

/// The decision for one message.
#[derive(Debug, PartialEq, Eq)]
pub enum SendDecision<'a, M> {
    /// Every member in `targets` has room and gets the message; enqueue it into each, then
    /// release the sender's bytes once.
    Deliver(Delivery<'a, M>),
    /// `by` (no DROP_WHEN_FULL) has no room: nobody gets the message, nothing was numbered.
    /// Retry once `by` (or any member) drained.
    Blocked {
        /// The first member found without room.
        by: M,
    },
}

/// A numbered message and where it goes.
#[derive(Debug, PartialEq, Eq)]
pub struct Delivery<'a, M> {
    /// The group's incarnation ([`GroupView::epoch`]).
    pub epoch: u64,
    /// The message's place in the group's total order: 1, 2, 3... per epoch.
    pub seq: u64,
    /// The members that get it, in join order.
    pub targets: &'a [M],
    /// Eligible members skipped for lack of room (DROP_WHEN_FULL).
    pub skipped_full: u32,
    /// Members whose filter rejected it.
    pub filtered: u32,
}

struct Group<M> {
    epoch: u64,
    creator: Option<M>,
    members: Vec<Member<M>>,
    last_seq: u64,
    counters: GroupCounters,
}

impl<M> Group<M> {
    fn is_dead(&self) -> bool {
        self.creator.is_none() && self.members.is_empty()
    }
}

/// What one scan of a group's members found.
enum Scan<M> {
    Clear { skipped_full: u32, filtered: u32 },
    Blocked(M),
}

/// Goes over `members` for a message from `sender`; pushes the targets into `targets` if given.
fn scan<M: Copy + Eq>(
    members: &[Member<M>],
    sender: &Sender<M>,
    len: usize,
    room: &mut impl FnMut(M) -> bool,
    mut targets: Option<&mut Vec<M>>,
) -> Scan<M> {
    let input = FilterInput {
        src_addr: sender.addr,
        src_port: sender.port,
        len,
    };
    let (mut skipped_full, mut filtered) = (0, 0);
    for m in members {
        if m.sock == sender.sock && !m.flags.contains(MemberFlags::LOOPBACK) {
            continue;
        }
        if !m.filter.accepts(&input) {
            filtered += 1;
        } else if room(m.sock) {
            if let Some(t) = targets.as_deref_mut() {
                t.push(m.sock);
            }
        } else if m.flags.contains(MemberFlags::DROP_WHEN_FULL) {
            skipped_full += 1;
        } else {
            return Scan::Blocked(m.sock);
        }
    }
    Scan::Clear {
        skipped_full,
        filtered,
    }
}

/// The groups one poll thread orders, and their members. `M` names a socket in the caller's
/// table (the poll thread's `SockRef`).
pub struct GroupTable<M> {
    groups: FxHashMap<GroupAddr, Group<M>>,
    /// Every group a socket created or joined (what closing it touches).
    by_socket: FxHashMap<M, Vec<GroupAddr>>,
    limits: GroupLimits,
    epochs: u64,
    /// The targets of the last decision (kept for its capacity).
    targets: Vec<M>,
    /// Totals over every group, dead ones included.
    pub counters: GroupCounters,
}

impl<M: Copy + Eq + Hash + Debug> Default for GroupTable<M> {
    fn default() -> Self {
        GroupTable::new(GroupLimits::default())
    }
}

impl<M: Copy + Eq + Hash + Debug> GroupTable<M> {
    /// An empty table.
    pub fn new(limits: GroupLimits) -> GroupTable<M> {
        GroupTable {
            groups: FxHashMap::default(),
            by_socket: FxHashMap::default(),
            limits,
            epochs: 0,
            targets: Vec::new(),
            counters: GroupCounters::default(),
        }
    }

    fn note_socket(&mut self, sock: M, group: GroupAddr) {
        let list = self.by_socket.entry(sock).or_default();
        if !list.contains(&group) {
            list.push(group);
        }
    }

    /// Forgets `group` in `sock`'s list if `sock` neither created nor joined it any more.
    fn unnote_socket(&mut self, sock: M, group: GroupAddr) {
        let still = self
            .groups
            .get(&group)
            .is_some_and(|g| g.creator == Some(sock) || g.members.iter().any(|m| m.sock == sock));
        if still {
            return;
        }
        if let Some(list) = self.by_socket.get_mut(&sock) {
            list.retain(|g| *g != group);
            if list.is_empty() {
                self.by_socket.remove(&sock);
            }
        }
    }

    fn remove_if_dead(&mut self, group: GroupAddr) {
        if self.groups.get(&group).is_some_and(Group::is_dead) {
            self.groups.remove(&group);
        }
    }

    /// `creator` creates `group` (it does not join it). EADDRINUSE if the group exists,
    /// ENOBUFS past [`GroupLimits::max_groups`].
    pub fn create(&mut self, group: GroupAddr, creator: M) -> Result<(), GroupError> {
        if self.groups.contains_key(&group) {
            return Err(GroupError::GroupExists);
        }
        self.open(group, Some(creator))?;
        self.note_socket(creator, group);
        Ok(())
    }

    /// A new, empty incarnation of `group`. ENOBUFS past [`GroupLimits::max_groups`].
    fn open(&mut self, group: GroupAddr, creator: Option<M>) -> Result<(), GroupError> {
        if self.groups.len() >= self.limits.max_groups {
            return Err(GroupError::TooManyGroups);
        }
        self.epochs += 1;
        self.groups.insert(
            group,
            Group {
                epoch: self.epochs,
                creator,
                members: Vec::new(),
                last_seq: 0,
                counters: GroupCounters::default(),
            },
        );
        Ok(())
    }

    /// `sock` joins `group`. ENOENT if there is no such group, EADDRINUSE if it is a member,
    /// ENOBUFS past [`GroupLimits::max_members`], EINVAL for a filter
    /// with more than [`Filter::MAX_RULES`] rules.
    pub fn join(
        &mut self,
        group: GroupAddr,
        sock: M,
        flags: MemberFlags,
        filter: Filter,
    ) -> Result<(), GroupError> {
        filter.check()?;
        let g = self.groups.get_mut(&group).ok_or(GroupError::NoSuchGroup)?;
        if g.members.iter().any(|m| m.sock == sock) {
            return Err(GroupError::AlreadyMember);
        }
        if g.members.len() >= self.limits.max_members {
            return Err(GroupError::TooManyMembers);
        }
        g.members.push(Member {
            sock,
            flags,
            filter,
        });
        self.note_socket(sock, group);
        Ok(())
    }

    /// Like [`Self::join`], but a missing group is opened without a creator first: a host's
    /// mirror of a group another host orders (it lives while it has members). ENOBUFS past
    /// [`GroupLimits::max_groups`].
    pub fn join_open(
        &mut self,
        group: GroupAddr,
        sock: M,
        flags: MemberFlags,
        filter: Filter,
    ) -> Result<(), GroupError> {
        if !self.groups.contains_key(&group) {
            filter.check()?;
            self.open(group, None)?;
        }
        let r = self.join(group, sock, flags, filter);
        self.remove_if_dead(group);
        r
    }

    fn member_mut(&mut self, group: GroupAddr, sock: M) -> Result<&mut Member<M>, GroupError> {
        let g = self.groups.get_mut(&group).ok_or(GroupError::NoSuchGroup)?;
        g.members
            .iter_mut()
            .find(|m| m.sock == sock)
            .ok_or(GroupError::NotMember)
    }

    /// Replaces a membership's filter (from the next decision on). EINVAL for more than
    /// [`Filter::MAX_RULES`] rules.
    pub fn set_filter(
        &mut self,
        group: GroupAddr,
        sock: M,
        filter: Filter,
    ) -> Result<(), GroupError> {
        filter.check()?;
        self.member_mut(group, sock)?.filter = filter;
        Ok(())
    }

    /// Replaces a membership's flags (from the next decision on).
    pub fn set_flags(
        &mut self,
        group: GroupAddr,
        sock: M,
        flags: MemberFlags,
    ) -> Result<(), GroupError> {
        self.member_mut(group, sock)?.flags = flags;
        Ok(())
    }

    /// `sock` leaves `group` (which dies if it was the last member and the creator is gone).
    /// ENOENT if there is no such group, EADDRNOTAVAIL if `sock` is not a member.
    pub fn leave(&mut self, group: GroupAddr, sock: M) -> Result<(), GroupError> {
        let g = self.groups.get_mut(&group).ok_or(GroupError::NoSuchGroup)?;
        let at = g
            .members
            .iter()
            .position(|m| m.sock == sock)
            .ok_or(GroupError::NotMember)?;
        g.members.remove(at);
        self.unnote_socket(sock, group);
        self.remove_if_dead(group);
        Ok(())
    }

    /// `sock` closed: it leaves every group and stops being a creator. Returns how many groups
    /// it was in (as creator or member).
    pub fn close_socket(&mut self, sock: M) -> usize {
        let Some(list) = self.by_socket.remove(&sock) else {
            return 0;
        };
        for &group in &list {
            if let Some(g) = self.groups.get_mut(&group) {
                g.members.retain(|m| m.sock != sock);
                if g.creator == Some(sock) {
                    g.creator = None;
                }
            }
            self.remove_if_dead(group);
        }
        list.len()
    }

    /// An app died: every socket for which `of_app` is true is closed ([`Self::close_socket`]).
    /// Returns how many sockets were in a group.
    pub fn app_died(&mut self, of_app: impl Fn(M) -> bool) -> usize {
        let dead: Vec<M> = self
            .by_socket
            .keys()
            .copied()
            .filter(|s| of_app(*s))
            .collect();
        for s in &dead {
            self.close_socket(*s);
        }
        dead.len()
    }

    /// The decision for one message of `len` bytes from `sender` to `group`; `room(member)`
    /// says whether that member's receive buffer takes it now. ENOENT if there is no such group.
    ///
    /// On `Deliver` the message is numbered and counted; the caller must then enqueue it into
    /// every target before the table changes (nothing else in between: that is what makes it
    /// all or none). On `Blocked` nothing changed.
    pub fn send(
        &mut self,
        group: GroupAddr,
        sender: Sender<M>,
        len: usize,
        mut room: impl FnMut(M) -> bool,
    ) -> Result<SendDecision<'_, M>, GroupError> {
        let g = self.groups.get_mut(&group).ok_or(GroupError::NoSuchGroup)?;
        self.targets.clear();
        let (skipped_full, filtered) =
            match scan(&g.members, &sender, len, &mut room, Some(&mut self.targets)) {
                Scan::Blocked(by) => return Ok(SendDecision::Blocked { by }),
                Scan::Clear {
                    skipped_full,
                    filtered,
                } => (skipped_full, filtered),
            };
        g.last_seq += 1;
        let d = GroupCounters {
            sends: 1,
            deliveries: self.targets.len() as u64,
            drops_full: skipped_full.into(),
            filtered: filtered.into(),
        };
        g.counters.add(&d);
        self.counters.add(&d);
        Ok(SendDecision::Deliver(Delivery {
            epoch: g.epoch,
            seq: g.last_seq,
            targets: &self.targets,
            skipped_full,
            filtered,
        }))
    }

    /// Exchanges the targets of the last [`Self::send`] with `v` (a caller that keeps them past
    /// the decision, without copying; both vectors keep their capacity).
    pub fn swap_targets(&mut self, v: &mut Vec<M>) {
        std::mem::swap(&mut self.targets, v);
    }

    /// Who would block a message of `len` bytes from `sender` now (the same answer as
    /// [`Self::send`] would give, without deciding): POLLOUT towards `group` is clear iff this
    /// is `Ok(None)`.
    pub fn blocked_by(
        &self,
        group: GroupAddr,
        sender: Sender<M>,
        len: usize,
        mut room: impl FnMut(M) -> bool,
    ) -> Result<Option<M>, GroupError> {
        let g = self.groups.get(&group).ok_or(GroupError::NoSuchGroup)?;
        Ok(match scan(&g.members, &sender, len, &mut room, None) {
            Scan::Blocked(by) => Some(by),
            Scan::Clear { .. } => None,
        })
    }

    /// A member without DROP_WHEN_FULL and without room, whoever sends: the conservative,
    /// sender-independent form of [`Self::blocked_by`] (it ignores filters and LOOPBACK), for
    /// a per-group "full" bit that every sender's library can test as it tests a congestion
    /// bit.
    pub fn any_blocker(
        &self,
        group: GroupAddr,
        mut room: impl FnMut(M) -> bool,
    ) -> Result<Option<M>, GroupError> {
        let g = self.groups.get(&group).ok_or(GroupError::NoSuchGroup)?;
        Ok(g.members
            .iter()
            .find(|m| !m.flags.contains(MemberFlags::DROP_WHEN_FULL) && !room(m.sock))
            .map(|m| m.sock))
    }

    /// Whether `group` exists.
    pub fn exists(&self, group: GroupAddr) -> bool {
        self.groups.contains_key(&group)
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True without groups.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The groups `sock` created or joined.
    pub fn groups_of(&self, sock: M) -> &[GroupAddr] {
        self.by_socket.get(&sock).map_or(&[], Vec::as_slice)
    }

    /// One group, for `rdsctl info`.
    pub fn group(&self, group: GroupAddr) -> Option<GroupView<'_, M>> {
        self.groups.get(&group).map(|g| Self::view(group, g))
    }

    /// Every group (in no particular order), for `rdsctl info`.
    pub fn groups(&self) -> impl Iterator<Item = GroupView<'_, M>> {
        self.groups.iter().map(|(a, g)| Self::view(*a, g))
    }

    fn view(addr: GroupAddr, g: &Group<M>) -> GroupView<'_, M> {
        GroupView {
            addr,
            epoch: g.epoch,
            creator: g.creator,
            members: &g.members,
            last_seq: g.last_seq,
            counters: g.counters,
        }
    }

    /// Panics unless the socket index and the groups agree: every live group has a creator or
    /// a member, nobody is in a group twice, and `by_socket` lists exactly each socket's groups.
    pub fn check_invariants(&self) {
        let mut expected: FxHashMap<M, Vec<GroupAddr>> = FxHashMap::default();
        for (addr, g) in &self.groups {
            assert!(!g.is_dead(), "{addr:?} has no creator and no member");
            for (i, m) in g.members.iter().enumerate() {
                assert!(
                    !g.members[..i].iter().any(|o| o.sock == m.sock),
                    "{:?} twice in {addr:?}",
                    m.sock
                );
                expected.entry(m.sock).or_default().push(*addr);
            }
            if let Some(c) = g.creator {
                let list = expected.entry(c).or_default();
                if !list.contains(addr) {
                    list.push(*addr);
                }
            }
        }
        assert_eq!(expected.len(), self.by_socket.len(), "sockets in the index");
        for (s, mut want) in expected {
            let mut have = self.by_socket.get(&s).cloned().unwrap_or_default();
            want.sort();
            have.sort();
            assert_eq!(want, have, "the index for {s:?}");
        }
    }
}

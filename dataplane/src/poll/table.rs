//! The socket table: every app, socket, binding and congestion bit of one poll core. Transports
//! reach it only through [`Upcalls`].

use super::inplace::{hold_of_token, Hold, Holds, SOCK_HOLDS};
use super::readiness::Readiness;
use super::shard::{self, Envelope, Fabric, Note, ShardLink};
use super::{Channels, Cmd};
use crate::config::Config;
use crate::seam::{Delivered, Incoming, MsgBytes, Upcalls};
use crate::shm::region::{wake_slot_after_fence, AppRegion, DaemonRegion};
use crate::stats::Stats;
use rds_proto::wire::CongMap;
use rustc_hash::{FxHashMap, FxHashSet};
use shm_api::layout::{cong_monitor_bit, DaemonView, SlotControl, CONG_ENTRIES};
use shm_api::layout::{RECV_WAITERS, RX_FLAG_GROUP, SEND_WAITERS};
use shm_api::ring::{Consumer, Producer, PushError, RawRing, Record, RecordHeader, RingMemory};
use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// An open socket, with what a pass needs to tell in one load whether its app published
/// since rdsd last looked: a copy of its tx ring's handle (the region stays mapped while the
/// socket is open) and the consumer's position then.
#[derive(Clone, Copy)]
struct OpenSock {
    r: SockRef,
    tx: RawRing,
    /// The tx consumer's position when last looked at. Never ahead of it (positions only
    /// grow), so a producer position equal to it means nothing new is published.
    seen: u64,
}

/// Outstanding RDS_CANCEL_SENT_TO markers per socket.
pub(super) const MAX_CANCELS: usize = 8;

pub use super::sock_ref::SockRef;

#[path = "backlog.rs"]
mod backlog;
pub(super) use backlog::{GroupCopyWait, GroupWait, Parked};
#[path = "groups.rs"]
mod groups;
use groups::Groups;
#[path = "group_hosts.rs"]
mod group_hosts;

#[path = "group_credit.rs"]
mod group_credit;
use crate::group::wire::GROUP_PORT;
pub(super) use group_credit::Credit;
#[cfg(test)]
pub(super) use group_credit::CREDIT_CHUNK;
pub(in crate::poll) use group_hosts::member_host;
use group_hosts::GroupHosts;
pub(super) use groups::{GroupSent, Remote};

#[derive(Clone, Copy)]
pub(super) struct Cancel {
    pub dest: Option<(u32, u16)>,
    pub upto: u64,
}

/// A record on a socket's tx ring, as the poll core hands it on (`SocketTable::tx_record`).
pub(super) struct TxRecord<'m> {
    /// Its bytes where they lie, in the sender's tx ring.
    pub payload: MsgBytes<'m>,
    /// The sending socket's incarnation (for its token).
    pub gen: u32,
    /// Where the record starts on the ring (for an in-place hold).
    pub pos: u64,
    /// The sender's region (for an in-place send).
    pub region_id: u64,
}

/// What became of a detached app (`SocketTable::detach`).
pub(super) enum Detached {
    /// None was attached at that index.
    Absent,
    /// Its region, no longer needed: to unmap, and to name to the transports as gone.
    Unmapped { region_id: u64, region: AppRegion },
    /// Its region stays mapped until messages sent in place from it are released. `cancel`:
    /// the bound addresses whose in-place messages the transports must cancel (too many
    /// regions draining already), mostly empty.
    Draining { cancel: Vec<(u32, u16)> },
}

/// rdsd's view of one socket.
pub(super) struct Sock {
    pub gen: u32,
    pub tx: Consumer<RawRing>,
    pub rx: Producer<RawRing>,
    pub bound: Option<(u32, u16)>,
    pub rcvbuf: u32,
    pub sndbuf: u32,
    pub monitor: bool,
    pub released: u64,
    /// Bytes taken off the tx ring (`taken - released`: what the transports still hold).
    pub taken: u64,
    pub rx_produced: u64,
    /// The app's `rx_consumed_bytes` as last read (`Sock::over_rcvbuf`).
    pub consumed_seen: u64,
    pub congested: bool,
    pub cancels: [Cancel; MAX_CANCELS],
    pub ncancels: usize,
    pub readiness: Option<Readiness>,
    pub readiness_on: bool,
    /// Holds of records sent in place, oldest first (capacity SOCK_HOLDS, allocated at open).
    pub holds: VecDeque<u32>,
    /// The group the app connected the socket to (its POLLOUT follows the group's full bit).
    pub group_dest: Option<crate::group::GroupAddr>,
    /// The record at the head of the tx ring waits for a full group (counted once per wait).
    pub group_blocked: bool,
    /// It made group requests that shard 0 handled (its close must reach shard 0).
    pub grouped: bool,
    /// Messages from other poll threads that found the rx ring full, oldest first
    /// (`backlog.rs`); `backlog_bytes` is their payload, counted as queued for SO_RCVBUF.
    pub backlog: VecDeque<Parked>,
    pub backlog_bytes: u64,
    /// The flag of its binding in the directory (`shard::Bound`): raised while the backlog is
    /// past its share, so that local senders of other threads wait on their own tx rings.
    pub backed_up: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Bytes of the rx ring kept free for shard 0's group copies (`group_credit.rs`): this
    /// shard's own pushes leave them free.
    pub group_reserved: u64,
    /// Shard 0's ask for more (at least, at most) not answered yet: the ring had too little.
    pub credit_ask: Option<(u64, u64)>,
    /// The gate (of the slot's `shm_api::gate::GATES`) its next group copy takes.
    pub next_gate: usize,
}

/// One attached process.
struct App {
    pub region: AppRegion,
    /// Unique per attach: names the region to the transports (`region_attached`).
    pub region_id: u64,
    /// Per socket slot, messages sent in place from its ring and not yet released: the slot
    /// is not reused (its ring reset) before this is 0.
    pub pins: Vec<u32>,
    /// Bound addresses of closed sockets whose in-place messages are still out (to cancel
    /// them if the region cannot be kept, see `SocketTable::max_draining`).
    pub pinned_binds: Vec<(u32, u16)>,
    pub socks: Vec<Option<Sock>>,
    pub evicted: bool,
    /// rdsd's end of this app's doorbell: an AF_UNIX SOCK_DGRAM socketpair whose other end
    /// only this app holds. A socketpair rather than an eventfd: the two ends are separate
    /// open file descriptions, so the app's fcntl (O_NONBLOCK) or reads on its end can't reach
    /// ours, and we read ours with MSG_DONTWAIT (non-blocking per call, whatever the flags),
    /// bounded per park (`readiness::drain`). A futex word in the region would not do: a parked
    /// core must also wait on transport sockets, and poll(2) can't wait on futexes.
    pub doorbell: std::os::fd::OwnedFd,
    /// Its uid (SO_PEERCRED): who may join the groups its sockets create.
    pub uid: u32,
}

/// Receivers one burst of local deliveries remembers before it publishes early (a burst
/// moves at most `TX_BATCH` messages, so this is never reached in steady state).
const RX_BURST_TARGETS: usize = super::TX_BATCH;
/// Wake checks a pass gathers before it makes them (`SocketTable::wakes`); past this many it
/// fences and checks early rather than grow.
const WAKES_CAP: usize = 4 * RX_BURST_TARGETS;

/// The sockets of one poll core. It keeps its invariants itself (its fields are private):
/// - `open_socks` lists every open socket, `readiness_socks` those with readiness on and
///   `congested` those marked congested (`open_sock`, `enable_readiness`, `close_sock_now`);
/// - a bound socket is in `binds` and in the shards' directory, and references its address's
///   congestion entry (`bind`, `close_sock_now`);
/// - an app's region stays mapped while it is in `apps` or `draining` (`attach`, `detach`,
///   `release_hold`), and `regions_gone` names each one unmapped off `draining`; an app
///   leaves `apps` with every socket closed, so no `open_socks` entry outlives its ring.
pub struct SocketTable {
    cfg: Arc<Config>,
    stats: Arc<Stats>,
    _daemon: Arc<DaemonRegion>,
    dview: DaemonView,
    apps: Vec<Option<App>>,
    binds: FxHashMap<(u32, u16), SockRef>,
    /// The last binding `deliver` found (a stream mostly goes to one port): cleared whenever
    /// `binds` changes, so it is never stale.
    last_bind: Option<((u32, u16), SockRef)>,
    cong_entries: FxHashMap<u32, (usize, u32)>,
    /// Peers whose congestion map has an entry in the daemon region.
    peer_entries: FxHashSet<u32>,
    congested: Vec<SockRef>,
    readiness_socks: Vec<SockRef>,
    /// Every open socket, so a pass visits what exists instead of every slot of every app.
    open_socks: Vec<OpenSock>,
    chans: Arc<Channels>,
    control_wake: Arc<std::os::fd::OwnedFd>,
    rng: u64,
    next_gen: u32,
    local_maps: FxHashMap<u32, CongMap>,
    empty_map: CongMap,
    /// Local addresses whose map changed since the transports last heard.
    cong_changed: Vec<u32>,
    /// What the poll threads share: the bind directory (with the rebind grace) and, with
    /// several, the rings and notes between them (`shard.rs`).
    fabric: Arc<Fabric>,
    /// This poll thread's index.
    shard: usize,
    /// This shard's end of the fabric; `None` with one poll thread.
    link: Option<ShardLink>,
    /// Poll threads with a kernel-TCP transport, each owning the connections
    /// `fabric.owners` gives it (1: shard 0 drives every network transport): its count, kept
    /// here for the send path.
    net_shards: usize,
    /// The owners this thread asked `fabric.owners` for (a connection never moves), and the
    /// last one: a send to a remote host takes no lock, and mostly no lookup either.
    owners_seen: FxHashMap<(u32, u32), u8>,
    last_net_owner: ((u32, u32), usize),
    /// Set while delivering what another shard forwarded: never forwarded again.
    from_fabric: bool,
    /// Set while a closing socket's messages move (`set_closing_sender`): one that finds a
    /// local receiver's ring full waits in its backlog rather than die with the sender.
    closing_sender: bool,
    /// Sockets with a backlog, and the bytes charged for all backlogs and group waits
    /// (`backlog.rs`).
    backlogged: Vec<SockRef>,
    backlog_total: usize,
    /// Group messages of other shards' sockets that a full member blocks, oldest first.
    group_waits: VecDeque<GroupWait>,
    /// Scratch for the retries of group waits and group copy waits: the senders (members)
    /// found blocked in this retry.
    group_waits_blocked: Vec<(usize, u64)>,
    /// Copies of shard 0's fan-outs for members of this shard whose rings were full.
    group_copy_waits: VecDeque<GroupCopyWait>,
    /// Members whose shard-0 credit ask waits for room in their rings (`group_credit.rs`).
    credit_asks: Vec<SockRef>,
    /// Messages offered in place (zero copy), see `inplace`.
    holds: Holds,
    /// Apps gone while messages sent in place from their regions were still out: kept
    /// mapped until the last is released.
    draining: Vec<App>,
    /// Most regions draining at once (`max_apps`), and of one uid but root's
    /// (`max_regions_per_uid`; see `inplace`): past either a departing app's in-place messages
    /// are cancelled.
    max_draining: usize,
    max_draining_of_uid: usize,
    /// Regions unmapped since the transports last heard (`region_detached`).
    regions_gone: Vec<u64>,
    next_region: u64,
    /// The multicast groups this shard orders (`groups.rs`).
    groups: Groups,
    /// Their members on other hosts, and the groups other hosts order (`group_hosts.rs`).
    hosts: GroupHosts,
    /// TEST ONLY (`crate::fault::die_in_fanout`): fan-outs left before rdsd kills itself
    /// between two of a fan-out's publishes.
    test_die_in_fanout: Option<u64>,
    /// TEST ONLY (`crate::fault::stall_in_fanout`): while this file exists, a fan-out stops
    /// between two publishes.
    test_stall_in_fanout: Option<std::path::PathBuf>,
    /// Set while the poll thread moves one sender's burst (`begin_rx_burst`).
    rx_burst_on: bool,
    /// The receivers that burst pushed into, and the bytes each got (published at its end).
    rx_burst: Vec<(SockRef, usize)>,
    /// Sockets whose rings this pass published or released, with the kinds of blocked threads
    /// (`RECV_WAITERS`, `SEND_WAITERS`) that may now go on: their `waiters` are read after one
    /// SeqCst fence for all of them, at the end of the pass (`PollCore::pass`) or after a
    /// network read is recorded (`Upcalls::wake_receivers`), not after a fence each. A fence
    /// waits for the pass's stores to reach the other cores (the receiver polls the line its
    /// ring's producer position is on), so one per publish made the poll thread wait out a
    /// cross-core round trip per burst and per sender.
    wakes: Vec<(SockRef, u32)>,
}

impl SocketTable {
    /// An empty table.
    pub(super) fn new(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        daemon: Arc<DaemonRegion>,
        chans: Arc<Channels>,
        control_wake: Arc<std::os::fd::OwnedFd>,
        fabric: Arc<Fabric>,
        shard: usize,
    ) -> SocketTable {
        let max_apps = cfg.max_apps as usize;
        let max_draining_of_uid = cfg.max_regions_per_uid as usize;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            ^ (shard as u64) << 48;
        let hosts = GroupHosts::new(&cfg);
        SocketTable {
            link: (fabric.shards() > 1).then(|| fabric.link(shard)),
            net_shards: {
                debug_assert!(fabric.owners.shards() <= fabric.shards());
                fabric.owners.shards()
            },
            owners_seen: FxHashMap::default(),
            // (0, 0) is no connection: a first send always asks.
            last_net_owner: ((0, 0), 0),
            fabric,
            shard,
            from_fabric: false,
            closing_sender: false,
            backlogged: Vec::new(),
            backlog_total: 0,
            group_waits: VecDeque::new(),
            group_waits_blocked: Vec::new(),
            group_copy_waits: VecDeque::new(),
            credit_asks: Vec::new(),
            dview: daemon.view(),
            _daemon: daemon,
            cfg,
            stats,
            apps: (0..max_apps).map(|_| None).collect(),
            binds: FxHashMap::default(),
            last_bind: None,
            cong_entries: FxHashMap::default(),
            peer_entries: FxHashSet::default(),
            congested: Vec::with_capacity(1024),
            readiness_socks: Vec::with_capacity(1024),
            open_socks: Vec::with_capacity(1024),
            chans,
            control_wake,
            rng: seed | 1,
            next_gen: 1,
            local_maps: FxHashMap::default(),
            empty_map: CongMap::new(),
            cong_changed: Vec::with_capacity(256),
            holds: Holds::new(),
            draining: Vec::new(),
            max_draining: max_apps,
            max_draining_of_uid,
            regions_gone: Vec::with_capacity(64),
            next_region: 1,
            groups: Groups::new(),
            hosts,
            test_die_in_fanout: crate::fault::die_in_fanout(),
            test_stall_in_fanout: crate::fault::stall_in_fanout(),
            rx_burst_on: false,
            rx_burst: Vec::with_capacity(RX_BURST_TARGETS),
            wakes: Vec::with_capacity(WAKES_CAP),
        }
    }

    #[inline]
    pub(super) fn cfg(&self) -> &Config {
        &self.cfg
    }

    #[inline]
    pub(super) fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The shared daemon region (sleep flags, congestion maps).
    #[inline]
    pub(super) fn dview(&self) -> DaemonView {
        self.dview
    }

    /// This poll thread's index.
    #[inline]
    pub(super) fn shard(&self) -> usize {
        self.shard
    }

    /// See the field: 1, or every poll thread drives kernel TCP for the connections it owns.
    pub(super) fn net_shards(&self) -> usize {
        self.net_shards
    }

    /// The poll thread whose transports carry messages from `laddr` to the remote `faddr`.
    #[inline]
    pub(super) fn net_owner(&mut self, laddr: u32, faddr: u32) -> usize {
        if self.net_shards == 1 {
            return 0;
        }
        if self.last_net_owner.0 == (laddr, faddr) {
            return self.last_net_owner.1;
        }
        self.net_owner_slow(laddr, faddr)
    }

    #[cold]
    fn net_owner_slow(&mut self, laddr: u32, faddr: u32) -> usize {
        let k = match self.owners_seen.get(&(laddr, faddr)) {
            Some(&k) => usize::from(k),
            None => {
                // Once per connection on this thread: the shared table, under its lock.
                let k = self.fabric.owners.owner(laddr, faddr);
                self.owners_seen.insert((laddr, faddr), k as u8);
                k
            }
        };
        self.last_net_owner = ((laddr, faddr), k);
        k
    }

    /// This shard's end of the fabric; `None` with one poll thread.
    #[inline]
    pub(super) fn link(&self) -> Option<&ShardLink> {
        self.link.as_ref()
    }

    #[inline]
    pub(super) fn link_mut(&mut self) -> Option<&mut ShardLink> {
        self.link.as_mut()
    }

    /// The next command the control thread queued for this poll thread.
    #[inline]
    pub(super) fn next_cmd(&self) -> Option<(u64, Cmd)> {
        // Almost every pass finds none: `is_empty` is two loads, a `pop` on an empty queue
        // about 35 instructions.
        let q = &self.chans.cmds[self.shard];
        if q.is_empty() {
            None
        } else {
            q.pop()
        }
    }

    /// The `i`-th open socket. Closing one (an eviction) moves another into its place: a
    /// caller walking the list looks at the same index again when its socket is gone.
    #[inline]
    pub(super) fn open_sock_at(&self, i: usize) -> Option<SockRef> {
        self.open_socks.get(i).map(|o| o.r)
    }

    /// The first open socket at index `from` or later whose app published on its tx ring
    /// since [`SocketTable::mark_seen`], with its index. An idle socket costs a pass one load
    /// and compare here (the walk through `apps` and the call cost about 75).
    #[inline]
    pub(super) fn next_published(&self, from: usize) -> Option<(usize, SockRef)> {
        let rest = self.open_socks.get(from..)?;
        let k = rest
            .iter()
            .position(|o| o.tx.producer().load(Ordering::Relaxed) != o.seen)?;
        Some((from + k, rest[k].r))
    }

    /// Notes where the `i`-th open socket's tx consumer stands, after a drain.
    pub(super) fn mark_seen(&mut self, i: usize) {
        let o = &mut self.open_socks[i];
        if let Some(s) = self
            .apps
            .get(o.r.app)
            .and_then(|a| a.as_ref())
            .and_then(|a| a.socks.get(o.r.slot as usize))
            .and_then(|s| s.as_ref())
        {
            o.seen = s.tx.position();
        }
    }

    /// Socket slots of `app` (0 while none is attached there).
    pub(super) fn slots(&self, app: usize) -> usize {
        self.apps[app].as_ref().map_or(0, |a| a.socks.len())
    }

    /// Local addresses whose congestion map changed since the transports last heard.
    #[inline]
    pub(super) fn drain_cong_changed(&mut self) -> std::vec::Drain<'_, u32> {
        self.cong_changed.drain(..)
    }

    /// Regions unmapped since the transports last heard (`Transport::region_detached`).
    #[inline]
    pub(super) fn drain_regions_gone(&mut self) -> std::vec::Drain<'_, u64> {
        self.regions_gone.drain(..)
    }

    /// Attach: `app`'s region enters the table, with no socket yet. Returns the region's id
    /// (unique per attach; it names the region to the transports) and the region.
    pub(super) fn attach(
        &mut self,
        app: usize,
        region: AppRegion,
        doorbell: std::os::fd::OwnedFd,
        uid: u32,
    ) -> (u64, &AppRegion) {
        let region_id = self.next_region;
        self.next_region += 1;
        let n = region.geometry().max_sockets as usize;
        Stats::bump(&self.stats.apps_attached);
        let a = self.apps[app].insert(App {
            region,
            region_id,
            pins: vec![0; n],
            pinned_binds: Vec::new(),
            socks: (0..n).map(|_| None).collect(),
            evicted: false,
            doorbell,
            uid,
        });
        (region_id, &a.region)
    }

    /// Detach, once `app`'s sockets are closed: the app leaves the table. A region that
    /// messages sent in place still pin stays mapped (draining) until their last release.
    pub(super) fn detach(&mut self, app: usize) -> Detached {
        Stats::bump(&self.stats.apps_detached);
        // The open-socket list holds copies of its sockets' ring handles (`OpenSock`).
        debug_assert!(
            !self.open_socks.iter().any(|o| o.r.app == app),
            "an app leaves with its sockets closed"
        );
        let Some(mut a) = self.apps.get_mut(app).and_then(|a| a.take()) else {
            return Detached::Absent;
        };
        if a.pins.iter().all(|&p| p == 0) {
            return Detached::Unmapped {
                region_id: a.region_id,
                region: a.region,
            };
        }
        // The app index is free for a new app meanwhile. With too many regions draining
        // already, its in-place messages are cancelled (the caller tells the transports): more
        // than `max_apps` in all, or as many of its uid's as `max_regions_per_uid` (root: no
        // per-uid cap), so draining at most doubles what one user's attached apps may hold.
        let of_uid = self.draining.iter().filter(|d| d.uid == a.uid).count();
        let uid_cap = if a.uid == 0 {
            usize::MAX
        } else {
            self.max_draining_of_uid
        };
        let cancel = if self.draining.len() >= self.max_draining || of_uid >= uid_cap {
            Stats::bump(&self.stats.drain_cancels);
            std::mem::take(&mut a.pinned_binds)
        } else {
            Vec::new()
        };
        Stats::bump(&self.stats.regions_drained_late);
        self.draining.push(a);
        Detached::Draining { cancel }
    }

    /// SocketOpen for `app` (attached, not evicted): a fresh socket in a free slot, listed
    /// as open. Returns its slot.
    pub(super) fn open_sock(
        &mut self,
        app: usize,
        readiness: Option<Readiness>,
    ) -> Result<u32, i32> {
        let a = self.apps[app].as_mut().expect("attached");
        // A slot whose ring still holds messages sent in place is not reused yet.
        let slot = (0..a.socks.len())
            .find(|&i| a.socks[i].is_none() && a.pins[i] == 0)
            .ok_or(libc::EMFILE)? as u32;
        a.region.reset_slot(slot);
        let gen = self.next_gen;
        self.next_gen = self.next_gen.wrapping_add(1).max(1);
        a.socks[slot as usize] = Some(Sock {
            gen,
            tx: Consumer::new(a.region.tx_ring(slot)),
            rx: Producer::new(a.region.rx_ring(slot)),
            bound: None,
            rcvbuf: shm_api::layout::DEFAULT_BUF,
            sndbuf: shm_api::layout::DEFAULT_BUF,
            monitor: false,
            released: 0,
            taken: 0,
            rx_produced: 0,
            consumed_seen: 0,
            congested: false,
            cancels: [Cancel {
                dest: None,
                upto: 0,
            }; MAX_CANCELS],
            ncancels: 0,
            readiness,
            readiness_on: false,
            holds: VecDeque::with_capacity(SOCK_HOLDS),
            group_dest: None,
            group_blocked: false,
            grouped: false,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            backed_up: None,
            group_reserved: 0,
            credit_ask: None,
            next_gate: 0,
        });
        let tx = &a.socks[slot as usize].as_ref().expect("just opened").tx;
        self.open_socks.push(OpenSock {
            r: SockRef { app, slot },
            tx: *tx.memory(),
            seen: tx.position(),
        });
        Stats::bump(&self.stats.sockets_opened);
        Ok(slot)
    }

    /// Bind: open, unbound socket `r` to `addr:port`, or to a free port when `port` is 0;
    /// returns the port. The binding enters this table and the shards' directory together
    /// and references `addr`'s congestion entry (`close_sock_now` undoes all three).
    pub(super) fn bind(&mut self, r: SockRef, addr: Ipv4Addr, port: u16) -> Result<u16, i32> {
        if addr.is_unspecified() || addr.is_broadcast() || addr.is_multicast() || port == 1 {
            return Err(libc::EINVAL);
        }
        if port == GROUP_PORT {
            // rdsd's own: the group protocol between hosts.
            return Err(libc::EADDRINUSE);
        }
        if self.sock(r).expect("live").bound.is_some() {
            return Err(libc::EINVAL);
        }
        if !self.cfg.is_local(addr) {
            return Err(libc::EADDRNOTAVAIL);
        }
        let a = u32::from(addr);
        let explicit = port != 0;
        self.ref_cong_entry(a)?;
        let rand = if explicit { 0 } else { self.next_rand() };
        // Every shard's bindings are in the directory: one owner per address and port.
        let mut dir = self.fabric.dir();
        let port = if explicit {
            Some(port).filter(|p| !dir.binds.contains_key(&(a, *p)))
        } else {
            free_port(&dir.binds, a, rand)
        };
        let Some(port) = port else {
            drop(dir);
            self.unref_cong_entry(a);
            return Err(libc::EADDRINUSE);
        };
        let backed_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
        dir.binds.insert(
            (a, port),
            shard::Bound {
                shard: self.shard as u8,
                backed_up: backed_up.clone(),
            },
        );
        if let Some(rb) = dir.rebind.as_mut().filter(|_| explicit) {
            rb.bound(port);
        }
        self.fabric.binds_changed(&mut dir);
        drop(dir);
        self.binds.insert((a, port), r);
        self.last_bind = None;
        let s = self.sock(r).expect("live");
        s.bound = Some((a, port));
        s.backed_up = Some(backed_up);
        Ok(port)
    }

    /// EnableReadiness: `r`'s readiness fd follows its state from now on (`sync_readiness`).
    pub(super) fn enable_readiness(&mut self, r: SockRef) -> Result<(), i32> {
        let s = self.sock(r).ok_or(libc::EBADF)?;
        if s.readiness.is_none() {
            return Err(libc::EBADF);
        }
        if !s.readiness_on {
            s.readiness_on = true;
            self.readiness_socks.push(r);
        }
        Ok(())
    }

    /// Calls `f` for every socket of every app not evicted, with its slot's control block
    /// (off the message path: snapshots, wake-ups after congestion).
    /// True if an app thread sleeps in a receive on one of this thread's sockets (its
    /// `waiters`, which the app writes: a hint, which at worst keeps a `Watch` poll thread
    /// awake).
    pub(super) fn receivers_waiting(&self) -> bool {
        let mut any = false;
        self.for_each_sock(|_, _, ctl| {
            any |= ctl.waiters.load(Ordering::Relaxed) & RECV_WAITERS != 0;
        });
        any
    }

    pub(super) fn for_each_sock(&self, mut f: impl FnMut(SockRef, &Sock, &SlotControl)) {
        for (app, a) in self.apps.iter().enumerate() {
            let Some(a) = a.as_ref().filter(|a| !a.evicted) else {
                continue;
            };
            for (slot, s) in a.socks.iter().enumerate() {
                let Some(s) = s else { continue };
                let slot = slot as u32;
                f(SockRef { app, slot }, s, a.region.slot_control(slot));
            }
        }
    }

    /// The record `rec`, just peeked off `from`'s tx ring: its payload where it lies, and
    /// what names its sender to a transport.
    ///
    /// # Safety
    /// `rec` was peeked, and not yet consumed, off `from`'s tx ring, and the payload view is
    /// dropped before `from`'s app leaves the table (within the caller's handling of `rec`;
    /// a transport that keeps the bytes in place longer does so under a hold, `inplace`).
    #[inline]
    pub(super) unsafe fn tx_record<'m>(&self, from: SockRef, rec: &Record) -> TxRecord<'m> {
        let app = self.apps[from.app].as_ref().expect("sender app");
        let sock = app.socks[from.slot as usize].as_ref();
        // The socket's consumer holds the ring already (no new view per message).
        let data = match sock {
            Some(s) => s.tx.memory().data_ptr(),
            None => app.region.tx_ring(from.slot).data_ptr(),
        };
        // SAFETY: the ring consumer validated payload_offset + len against the data area,
        // which stays mapped while the app is in the table (the caller's promise).
        let payload =
            unsafe { MsgBytes::from_shared(data.add(rec.payload_offset), rec.header.len as usize) };
        TxRecord {
            payload,
            gen: sock.map_or(0, |s| s.gen),
            // After `peek`, the consumer's position is the start of this record.
            pos: sock.map_or(0, |s| s.tx.position()),
            region_id: app.region_id,
        }
    }

    pub(super) fn chans(&self) -> &Channels {
        &self.chans
    }

    /// Tells the control thread that answers (or evictions) are queued for it.
    pub(super) fn wake_control(&self) {
        shm_api::sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&*self.control_wake));
    }

    /// Adds every live app's doorbell to a park's poll set; returns how many it added (they
    /// come first in `out`).
    pub(super) fn doorbell_fds(&self, out: &mut Vec<libc::pollfd>) -> usize {
        let before = out.len();
        for a in self.apps.iter().flatten().filter(|a| !a.evicted) {
            out.push(libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&a.doorbell),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        out.len() - before
    }

    /// After a park: empties the doorbells that rang, at most `readiness::MAX_DRAIN` rings each
    /// (a flooding app keeps the core from sleeping, never from working).
    pub(super) fn drain_doorbells(&self, fds: &[libc::pollfd]) {
        for p in fds.iter().filter(|p| p.revents != 0) {
            if !super::readiness::drain(p.fd) {
                Stats::bump(&self.stats.drain_capped);
            }
        }
    }

    pub(super) fn sock(&mut self, r: SockRef) -> Option<&mut Sock> {
        self.apps
            .get_mut(r.app)?
            .as_mut()?
            .socks
            .get_mut(r.slot as usize)?
            .as_mut()
    }

    pub(super) fn ctl(&self, r: SockRef) -> &SlotControl {
        self.apps[r.app]
            .as_ref()
            .expect("live app")
            .region
            .slot_control(r.slot)
    }

    /// Publishes a socket's released send-buffer bytes and wakes a blocked sender.
    pub(super) fn publish_released(&mut self, r: SockRef) {
        let Some(s) = self.sock(r) else { return };
        s.tx.release();
        let released = s.released;
        let ctl = self.ctl(r);
        ctl.tx_released_bytes.store(released, Ordering::Release);
        self.want_wake(r, SEND_WAITERS);
    }

    /// `r`'s blocked threads of kind `whom` may go on: checked with the pass's other wake-ups
    /// (see `wakes`).
    #[inline]
    pub(super) fn want_wake(&mut self, r: SockRef, whom: u32) {
        // Only the newest entry is merged (one socket's ring published twice in a row): a
        // duplicate further back costs one more load of `waiters`, less than a search.
        if let Some(e) = self.wakes.last_mut().filter(|(w, _)| *w == r) {
            e.1 |= whom;
            return;
        }
        if self.wakes.len() == WAKES_CAP {
            self.wake_pending();
        }
        self.wakes.push((r, whom));
    }

    /// Whether wake checks are waiting for the end of the pass.
    #[inline]
    pub(super) fn has_pending_wakes(&self) -> bool {
        !self.wakes.is_empty()
    }

    /// Makes the gathered wake checks: one fence, then each socket's `waiters` (a futex wake
    /// where a thread of that kind sleeps).
    #[inline]
    pub(super) fn wake_pending(&mut self) {
        if self.wakes.is_empty() {
            return;
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        self.wake_pending_after_fence();
    }

    /// [`Self::wake_pending`] for a caller that made the fence (the end of a pass, which
    /// shares it with the other poll threads' doorbells). Never inlined: a symbol of its own
    /// for `bench/shards-callgrind.sh`.
    #[inline(never)]
    pub(super) fn wake_pending_after_fence(&mut self) {
        if self.wakes.is_empty() {
            return;
        }
        Stats::bump_mine(&self.stats.wake_fences);
        for i in 0..self.wakes.len() {
            let (r, whom) = self.wakes[i];
            let Some(app) = self.apps.get(r.app).and_then(|a| a.as_ref()) else {
                continue;
            };
            if app.socks[r.slot as usize].is_some()
                && wake_slot_after_fence(app.region.slot_control(r.slot), whom)
            {
                Stats::bump_mine(&self.stats.app_wakeups);
            }
        }
        self.wakes.clear();
    }

    /// `to`'s queue went above SO_RCVBUF: mark its port congested (and its groups full).
    fn mark_congested(&mut self, to: SockRef) {
        let s = self.sock(to).expect("receiver open");
        s.congested = true;
        let (addr, port) = s.bound.expect("receivers are bound");
        self.set_cong_bit(addr, port, true);
        self.congested.push(to);
        Stats::bump(&self.stats.cong_marked);
        self.groups_member_congestion(to);
    }

    fn set_cong_bit(&mut self, addr: u32, port: u16, on: bool) {
        if self.net_shards > 1 {
            // Every shard sends the maps to the peers of the connections it owns.
            self.local_cong_changed(addr, port, on);
            if let Some(l) = self.link.as_mut() {
                l.note_all(Note::CongBit { addr, port, on });
            }
        } else {
            match self.link.as_mut().filter(|l| l.shard != 0) {
                // Shard 0 keeps the maps its transports send to peers.
                Some(l) => l.note(0, Note::CongBit { addr, port, on }),
                None => self.local_cong_changed(addr, port, on),
            }
        }
        self.set_region_cong_bit(addr, port, on);
    }

    /// Sets or clears `addr:port`'s bit in the daemon region's congestion table, which every
    /// sender's library tests before a send (nothing if `addr` has no entry there).
    pub(super) fn set_region_cong_bit(&self, addr: u32, port: u16, on: bool) {
        let Some(&(idx, _)) = self.cong_entries.get(&addr) else {
            return;
        };
        let word = &self.dview.map(idx)[port as usize / 64];
        if on {
            word.fetch_or(1 << (port % 64), Ordering::AcqRel);
        } else {
            word.fetch_and(!(1 << (port % 64)), Ordering::AcqRel);
        }
        self.dview.header().cong_seq.fetch_add(1, Ordering::Release);
    }

    /// Shard 0: a local port's congestion changed; tell the transports (`cong_changed`).
    pub(super) fn local_cong_changed(&mut self, addr: u32, port: u16, on: bool) {
        let map = self.local_maps.entry(addr).or_default();
        map.set_congested(port, on);
        if !self.cong_changed.contains(&addr) {
            self.cong_changed.push(addr);
        }
    }

    /// Clears congestion on ports whose queue fell below half of SO_RCVBUF. Inline: every pass
    /// asks, and almost always nothing is congested.
    #[inline]
    pub(super) fn check_congested(&mut self) -> usize {
        if self.congested.is_empty() {
            return 0;
        }
        self.check_congested_slow()
    }

    #[inline(never)]
    fn check_congested_slow(&mut self) -> usize {
        let mut cleared = 0;
        let mut i = 0;
        while i < self.congested.len() {
            let r = self.congested[i];
            let below = match self.apps.get_mut(r.app).and_then(|a| a.as_mut()) {
                Some(a) => match a.socks[r.slot as usize].as_mut() {
                    Some(s) => {
                        let ctl = a.region.slot_control(r.slot);
                        s.consumed_seen = ctl.rx_consumed_bytes.load(Ordering::Acquire);
                        s.queued(s.consumed_seen) < (s.rcvbuf / 2) as u64
                    }
                    None => true,
                },
                None => true,
            };
            if below {
                self.congested.swap_remove(i);
                if let Some(s) = self.sock(r) {
                    s.congested = false;
                    let (addr, port) = s.bound.expect("bound");
                    self.uncongest(addr, port);
                    self.groups_member_congestion(r);
                }
                cleared += 1;
            } else {
                i += 1;
            }
        }
        cleared
    }

    /// Clears a port's bit and wakes blocked senders and monitors.
    fn uncongest(&mut self, addr: u32, port: u16) {
        self.set_cong_bit(addr, port, false);
        Stats::bump(&self.stats.cong_cleared);
        self.wake_uncongested(cong_monitor_bit(port));
    }

    /// Wakes blocked senders and monitors of `mask` on every shard (theirs may send here).
    fn wake_uncongested(&mut self, mask: u64) {
        self.notify_uncongested(mask);
        if let Some(l) = self.link.as_mut() {
            l.note_all(Note::Uncongested { mask });
        }
    }

    /// Wakes every blocked app thread and posts `bit` to monitors that asked for it: the
    /// notifications first, then one fence, then every socket's wake check (a fence per socket
    /// made an un-congestion cost a cross-core round trip per open socket of the thread).
    pub(super) fn notify_uncongested(&mut self, bit: u64) {
        self.for_each_sock(|_, s, ctl| {
            if s.monitor {
                let hit = ctl.cong_interest.load(Ordering::Acquire) & bit;
                if hit != 0 {
                    ctl.cong_interest.fetch_and(!hit, Ordering::AcqRel);
                    ctl.cong_notify.fetch_or(hit, Ordering::AcqRel);
                    Stats::bump(&self.stats.cong_notifications);
                }
            }
        });
        std::sync::atomic::fence(Ordering::SeqCst);
        self.for_each_sock(|_, _, ctl| {
            if wake_slot_after_fence(ctl, RECV_WAITERS | SEND_WAITERS) {
                Stats::bump_mine(&self.stats.app_wakeups);
            }
        });
    }

    /// Brings the readiness fds of the sockets that asked for one up to date.
    #[inline]
    pub(super) fn sync_readiness(&mut self) {
        if !self.readiness_socks.is_empty() {
            self.sync_readiness_fds();
        }
    }

    fn sync_readiness_fds(&mut self) {
        for i in 0..self.readiness_socks.len() {
            let r = self.readiness_socks[i];
            let Some(app) = self.apps.get_mut(r.app).and_then(|a| a.as_mut()) else {
                continue;
            };
            let ctl = app.region.slot_control(r.slot);
            let Some(s) = app.socks[r.slot as usize].as_mut() else {
                continue;
            };
            let sent = ctl.tx_sent_bytes.load(Ordering::Acquire);
            // The ring can fill before SO_SNDBUF (in-place sends hold their space until
            // acknowledged): then the app names the room its failed send needs.
            let want = ctl.tx_ring_want.load(Ordering::Relaxed) as usize;
            let writable = sent.wrapping_sub(s.released) < s.sndbuf as u64
                && (want == 0 || s.tx.producer_free() >= want.min(s.tx.memory().capacity()))
                && s.group_dest.is_none_or(|g| {
                    // The bit in the daemon region: shard 0 sets it for every shard's senders.
                    let mut hint = usize::MAX;
                    !self.dview.is_congested(g.addr(), g.port(), &mut hint)
                });
            // Positions, not byte counts: zero-length messages count too.
            let rx = s.rx.memory();
            let pending =
                rx.producer().load(Ordering::Relaxed) != rx.consumer().load(Ordering::Acquire);
            let readable = pending || (s.monitor && ctl.cong_notify.load(Ordering::Acquire) != 0);
            if let Some(rd) = s.readiness.as_mut() {
                if !rd.sync(readable, writable) {
                    Stats::bump(&self.stats.drain_capped);
                }
            }
        }
    }

    /// Evicts an app that broke the shared-memory protocol: its sockets close at once (nothing
    /// of its rings is trusted any more) and the control thread hangs up on it.
    pub(super) fn evict(&mut self, app: usize, why: &'static str) {
        let Some(a) = self.apps[app].as_mut() else {
            return;
        };
        if a.evicted {
            return;
        }
        tracing::warn!(
            app,
            why,
            "evicting app: it broke the shared-memory protocol"
        );
        a.evicted = true;
        Stats::bump(&self.stats.apps_evicted);
        let n = a.socks.len();
        for slot in 0..n {
            self.close_sock_now(SockRef {
                app,
                slot: slot as u32,
            });
        }
        let _ = self.chans.evictions.push(app);
        self.wake_control();
    }

    /// `app`'s uid (`u32::MAX`, nobody's, if it is not attached).
    pub(super) fn app_uid(&self, app: usize) -> u32 {
        self.apps
            .get(app)
            .and_then(|a| a.as_ref())
            .map_or(u32::MAX, |a| a.uid)
    }

    pub(super) fn is_evicted(&self, app: usize) -> bool {
        self.apps
            .get(app)
            .and_then(|a| a.as_ref())
            .is_none_or(|a| a.evicted)
    }

    /// Closes a socket without moving anything more off its tx ring. Returns its bound
    /// address, if any.
    pub(super) fn close_sock_now(&mut self, r: SockRef) -> Option<(u32, u16)> {
        let app = self.apps.get_mut(r.app).and_then(|a| a.as_mut())?;
        let mut s = app.socks[r.slot as usize].take()?;
        self.drop_backlog(r, &mut s);
        // Released holds waiting behind older ones are done with; the others stay pinned
        // (slot and region) until their release.
        for &h in &s.holds {
            if self.holds.get(h).done {
                self.holds.put(h);
            }
        }
        // Whatever the app queued and rdsd never took dies with the socket (counted). At most
        // one ring's worth: the app may keep publishing while we walk.
        let start = s.tx.position();
        let cap = s.tx.memory().capacity() as u64;
        while s.tx.position().wrapping_sub(start) < cap {
            let Ok(Some(rec)) = s.tx.peek() else { break };
            s.tx.consume(&rec);
            Stats::bump(&self.stats.drop_socket_closed);
        }
        Stats::bump(&self.stats.sockets_closed);
        if let (Some(b), Some(a)) = (s.bound, self.apps.get_mut(r.app).and_then(|a| a.as_mut())) {
            if a.pins[r.slot as usize] > 0 {
                a.pinned_binds.push(b);
            }
        }
        self.readiness_socks.retain(|x| *x != r);
        self.open_socks.retain(|x| x.r != r);
        if s.congested {
            self.congested.retain(|x| *x != r);
        }
        if let Some(b) = s.bound {
            self.binds.remove(&b);
            self.last_bind = None;
            {
                let mut dir = self.fabric.dir();
                dir.binds.remove(&b);
                if !dir.binds.keys().any(|&(_, port)| port == b.1) {
                    if let Some(r) = dir.rebind.as_mut() {
                        r.unbound(b.1);
                    }
                }
                self.fabric.binds_changed(&mut dir);
            }
            if s.congested {
                self.uncongest(b.0, b.1);
            }
            self.unref_cong_entry(b.0);
        }
        self.groups_socket_closed(r);
        if s.grouped {
            if let Some(l) = self.link.as_mut().filter(|l| l.shard != 0) {
                l.note(
                    0,
                    Note::GroupSockClosed {
                        member: r,
                        gen: s.gen,
                    },
                );
            }
        }
        s.bound
    }

    /// A hold for the record at `pos` of `r`'s tx ring, if both the slab and the socket's
    /// FIFO have room (otherwise the message is copied). Returns its token.
    pub(super) fn offer_hold(&mut self, r: SockRef, pos: u64) -> Option<u64> {
        let app = self.apps.get(r.app)?.as_ref()?;
        let s = app.socks.get(r.slot as usize)?.as_ref()?;
        if s.holds.len() >= SOCK_HOLDS {
            return None;
        }
        let h = Hold {
            region: app.region_id,
            sock: r,
            gen: s.gen,
            pos,
            placed: false,
            done: false,
        };
        self.holds
            .take(h)
            .map(|i| super::inplace::IN_PLACE | u64::from(i))
    }

    /// The transport took the offered hold in place: pin the slot and the ring space.
    pub(super) fn place_hold(&mut self, token: u64) {
        let Some(h) = hold_of_token(token) else {
            return;
        };
        let hold = self.holds.get_mut(h);
        hold.placed = true;
        let (r, pos) = (hold.sock, hold.pos);
        let Some(app) = self.apps.get_mut(r.app).and_then(|a| a.as_mut()) else {
            return;
        };
        app.pins[r.slot as usize] += 1;
        let s = app.socks[r.slot as usize].as_mut().expect("sending socket");
        if s.holds.is_empty() {
            s.tx.hold_from(Some(pos));
        }
        s.holds.push_back(h);
        Stats::bump_mine(&self.stats.tx_in_place);
    }

    /// The offered hold was not used (delivered, dropped or blocked): forget it.
    pub(super) fn drop_hold(&mut self, token: u64) {
        if let Some(h) = hold_of_token(token) {
            self.holds.put(h);
        }
    }

    /// A message sent with an in-place token was acknowledged or cancelled.
    fn release_hold(&mut self, h: u32, len: u64) {
        let hold = *self.holds.get(h);
        let r = hold.sock;
        if !hold.placed {
            // It was copied after all: an ordinary release.
            self.holds.put(h);
            self.release(token_of(r, hold.gen), len);
            return;
        }
        // Unpin the slot, in the live app or in a draining one.
        let live = self
            .apps
            .get_mut(r.app)
            .and_then(|a| a.as_mut())
            .filter(|a| a.region_id == hold.region);
        let app = match live {
            Some(a) => a,
            None => {
                let Some(k) = self
                    .draining
                    .iter()
                    .position(|a| a.region_id == hold.region)
                else {
                    self.holds.put(h);
                    return;
                };
                let a = &mut self.draining[k];
                a.pins[r.slot as usize] -= 1;
                self.holds.put(h);
                if a.pins.iter().all(|&p| p == 0) {
                    // Its last message is through: unmap it now.
                    let a = self.draining.swap_remove(k);
                    self.regions_gone.push(a.region_id);
                    tracing::debug!(region = a.region_id, "drained app region unmapped");
                    drop(a);
                }
                return;
            }
        };
        app.pins[r.slot as usize] -= 1;
        let sock = app.socks[r.slot as usize]
            .as_mut()
            .filter(|s| s.gen == hold.gen);
        let Some(s) = sock else {
            // Its socket closed meanwhile: nothing to publish.
            self.holds.put(h);
            return;
        };
        self.holds.get_mut(h).done = true;
        while let Some(&front) = s.holds.front() {
            if !self.holds.get(front).done {
                break;
            }
            s.holds.pop_front();
            self.holds.put(front);
        }
        let front = s.holds.front().map(|&f| self.holds.get(f).pos);
        s.tx.hold_from(front);
        s.tx.release();
        s.released += len;
        let released = s.released;
        let ctl = app.region.slot_control(r.slot);
        ctl.tx_released_bytes.store(released, Ordering::Release);
        self.want_wake(r, SEND_WAITERS);
    }

    /// References `addr`'s congestion map in the daemon region (this shard's count; the
    /// entry itself is shared by all shards, see `shard::Directory`).
    pub(super) fn ref_cong_entry(&mut self, addr: u32) -> Result<(), i32> {
        if let Some(e) = self.cong_entries.get_mut(&addr) {
            e.1 += 1;
            return Ok(());
        }
        let mut dir = self.fabric.dir();
        let idx = match dir.cong.get_mut(&addr) {
            Some(e) => {
                e.1 += 1;
                e.0
            }
            None => {
                let idx = (0..CONG_ENTRIES)
                    .find(|i| !dir.cong.values().any(|e| e.0 == *i))
                    .ok_or(libc::ENOBUFS)?;
                for w in self.dview.map(idx) {
                    w.store(0, Ordering::Relaxed);
                }
                self.dview.entry(idx).addr.store(addr, Ordering::Release);
                dir.cong.insert(addr, (idx, 1));
                idx
            }
        };
        self.cong_entries.insert(addr, (idx, 1));
        Ok(())
    }

    pub(super) fn unref_cong_entry(&mut self, addr: u32) {
        let Some(e) = self.cong_entries.get_mut(&addr) else {
            return;
        };
        e.1 -= 1;
        if e.1 > 0 {
            return;
        }
        self.cong_entries.remove(&addr);
        if self.local_maps.get(&addr).is_some_and(|m| m.is_clear()) {
            self.local_maps.remove(&addr);
        }
        let mut dir = self.fabric.dir();
        if let Some(g) = dir.cong.get_mut(&addr) {
            g.1 -= 1;
            if g.1 == 0 {
                let idx = g.0;
                dir.cong.remove(&addr);
                self.dview.entry(idx).addr.store(0, Ordering::Release);
            }
        }
    }

    /// A delivery to a socket of another shard goes there through the fabric: `Yes` once
    /// queued, `Full` while the pair ring is full or the socket is backed up. `None`: not bound
    /// on another shard.
    fn forward_delivery(&mut self, m: &Incoming<'_>) -> Option<Delivered> {
        if self.from_fabric {
            return None;
        }
        let (to, backed_up) = self.link.as_mut()?.owner(m.laddr, m.dport)?;
        if backed_up {
            // The receiver's backlog is past its share (`backlog.rs`): the path pauses, as for
            // a full ring on the receiver's own thread (below its share the path goes on, and
            // the peer stops at the congestion map once past SO_RCVBUF).
            Stats::bump(&self.stats.rx_held_for_backlog);
            return Some(Delivered::Full);
        }
        Some(self.forward_to(to, m))
    }

    /// A message from the network into the pair ring to shard `to` (`Full`: the ring is).
    fn forward_to(&mut self, to: usize, m: &Incoming<'_>) -> Delivered {
        let env = Envelope::Deliver {
            laddr: m.laddr,
            faddr: m.faddr,
            sport: m.sport,
            dport: m.dport,
            token: 0,
        };
        let Some(l) = self.link.as_mut() else {
            return Delivered::NoSocket;
        };
        match l.forward(to, env, &m.payload) {
            Ok(()) => Delivered::Yes,
            Err(()) => Delivered::Full,
        }
    }

    /// Delivers a message shard `from` forwarded (never forwarded again: a binding that
    /// moved meanwhile drops it, as a close would), and releases the sender's `token` (0:
    /// none) once it is delivered (into the rx ring or, while that is full, the receiver's
    /// backlog: the receiver's queue either way) or dropped.
    #[inline(always)]
    pub(super) fn deliver_forwarded(
        &mut self,
        m: Incoming<'_>,
        from: usize,
        token: u64,
    ) -> Delivered {
        let len = m.payload.len() as u64;
        self.from_fabric = true;
        let d = self.deliver(m);
        self.from_fabric = false;
        if d != Delivered::Full && token != 0 {
            if let Some(l) = self.link.as_mut() {
                l.release(from, token, len);
            }
        }
        d
    }

    /// Copies one message into `to`'s rx ring and wakes its receivers: `Full` if the ring has
    /// no room now, `NoSocket` if `to` is gone. Always inlined: it is every local delivery's
    /// (a call of its own cost 25 instructions a message, `bench/shards-callgrind.sh`).
    #[inline(always)]
    pub(super) fn deliver_to(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
    ) -> Delivered {
        let d = self.push_rx(to, faddr, sport, payload);
        if d == Delivered::Yes {
            if self.rx_burst_on {
                self.note_rx_burst(to, payload.len());
            } else {
                self.publish_rx(to, payload.len());
            }
        }
        d
    }

    /// From now until [`Self::end_rx_burst`], deliveries push without publishing: the poll
    /// thread is moving one sender's burst (or a transport is polling: what one read of a
    /// network path holds, `Upcalls::publish_deliveries`), and each receiver's ring is
    /// published (and its receivers woken, its congestion checked) once at the end instead of
    /// per message.
    #[inline]
    pub(super) fn begin_rx_burst(&mut self) {
        debug_assert!(self.rx_burst.is_empty());
        self.rx_burst_on = true;
    }

    /// Publishes every ring the burst pushed into (their receivers are woken with the pass's
    /// other wake-ups, `wakes`).
    #[inline]
    pub(super) fn end_rx_burst(&mut self) {
        self.rx_burst_on = false;
        if !self.rx_burst.is_empty() {
            self.flush_rx_burst();
        }
    }

    fn note_rx_burst(&mut self, to: SockRef, len: usize) {
        // A burst reaches one or a few receivers: a scan from the newest is cheaper than a map.
        if let Some(e) = self.rx_burst.iter_mut().rev().find(|(r, _)| *r == to) {
            e.1 += len;
            return;
        }
        if self.rx_burst.len() == self.rx_burst.capacity() {
            // A local burst has at most TX_BATCH messages; a network read that reaches more
            // receivers publishes those so far rather than grow (woken with the rest, after
            // the read is recorded).
            self.publish_rx_burst_unwoken();
        }
        self.rx_burst.push((to, len));
    }

    fn flush_rx_burst(&mut self) {
        let mut burst = std::mem::take(&mut self.rx_burst);
        for &(to, len) in &burst {
            self.publish_rx(to, len);
        }
        burst.clear();
        self.rx_burst = burst;
    }

    /// The first half of [`Upcalls::publish_deliveries`]: every ring of the burst so far
    /// becomes readable (plain stores, no syscall); its receivers wait in `wakes`.
    fn publish_rx_burst_unwoken(&mut self) {
        for i in 0..self.rx_burst.len() {
            let (to, len) = self.rx_burst[i];
            if self.publish_rx_quiet(to, len) {
                self.want_wake(to, RECV_WAITERS);
            }
        }
        self.rx_burst.clear();
    }

    /// The first half of [`Self::deliver_to`]: the record is in `to`'s rx ring but not
    /// visible to the app until [`Self::publish_rx`].
    pub(super) fn push_rx(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
    ) -> Delivered {
        let len = payload.len();
        let header = RecordHeader::data(len as u32, faddr, sport);
        let Some(app) = self.apps.get_mut(to.app).and_then(|a| a.as_mut()) else {
            return Delivered::NoSocket;
        };
        let Some(sock) = app.socks[to.slot as usize].as_mut() else {
            return Delivered::NoSocket;
        };
        if sock.group_reserved > 0 && !sock.rx.fits_leaving(len, sock.group_reserved as usize) {
            // The rest is kept for group copies shard 0 was promised (`group_credit.rs`).
            Stats::bump(&self.stats.rx_ring_full);
            return Delivered::Full;
        }
        let pushed = push_copy(&mut sock.rx, header, payload, self.cfg.trace_hops);
        match pushed {
            Ok(()) => Delivered::Yes,
            Err(PushError::Full) => {
                Stats::bump(&self.stats.rx_ring_full);
                Delivered::Full
            }
            Err(PushError::TooLarge) => {
                // Rings are sized to hold the largest message; a smaller one is a config bug.
                Stats::bump(&self.stats.drop_no_route);
                Delivered::NoSocket
            }
        }
    }

    /// The second half of [`Self::deliver_to`]: publishes what was pushed into `to`'s rx ring
    /// (the last record being `len` bytes), wakes its receivers and marks congestion.
    #[inline]
    pub(super) fn publish_rx(&mut self, to: SockRef, len: usize) {
        if self.publish_rx_quiet(to, len) {
            self.wake_rx(to);
        }
    }

    /// Makes what was pushed into `to`'s rx ring readable and marks its port congested above
    /// SO_RCVBUF: loads and stores only, never a syscall, so that a transport can record the
    /// deliveries right after (a SIGKILL cannot land between the two unless it interrupts
    /// these few instructions). False if `to` is gone.
    #[inline]
    fn publish_rx_quiet(&mut self, to: SockRef, len: usize) -> bool {
        let Some(app) = self.apps.get_mut(to.app).and_then(|a| a.as_mut()) else {
            return false;
        };
        let Some(sock) = app.socks[to.slot as usize].as_mut() else {
            return false;
        };
        sock.rx.publish();
        Stats::bump_mine(&self.stats.rx_publishes);
        sock.rx_produced += len as u64;
        let ctl = app.region.slot_control(to.slot);
        ctl.rx_produced_bytes
            .store(sock.rx_produced, Ordering::Release);
        if !sock.congested && sock.over_rcvbuf(ctl, &self.stats.rx_consumed_reads) {
            self.mark_congested(to);
        }
        true
    }

    /// After a publish into `to`'s ring: its blocked receivers are woken with the pass's
    /// other wake-ups (`wakes`).
    #[inline]
    fn wake_rx(&mut self, to: SockRef) {
        self.want_wake(to, RECV_WAITERS);
    }

    /// A multicast fan-out's copies into this thread's `targets` (each checked to have room
    /// for `payload`, nothing ran since): for each, [`Self::push_group_copy`]. With `commit`,
    /// then the commit (one store: every copy readable at once, `shm_api::gate`) and the
    /// wake-ups; without, shard 0 commits once the copies on other poll threads are published
    /// too (`groups.rs`). A target whose socket is gone is dropped from `targets` (closes
    /// leave their groups at once, so this is only a guard). `copies` counts the fan-out's
    /// copies on every thread (for the test-only fault hooks).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn fan_out_copies(
        &mut self,
        targets: &mut Vec<SockRef>,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        stamp: u64,
        copies: usize,
        commit: bool,
    ) {
        let mut kept = 0;
        for i in 0..targets.len() {
            let to = targets[i];
            if !self.push_group_copy(to, faddr, sport, payload, stamp) {
                continue;
            }
            targets[kept] = to;
            kept += 1;
            if copies > 1 && kept == 1 {
                self.test_fanout_faults();
            }
        }
        targets.truncate(kept);
        if commit {
            // The commit point: one store makes every copy readable.
            shm_api::gate::commit(self.dview.group_commit(), stamp);
            self.wake_group_members(targets.iter().copied());
        }
    }

    /// One group copy into `to`'s rx ring (checked to have room): flagged [`RX_FLAG_GROUP`],
    /// its slot's gate naming it with fan-out `stamp`, the ring published. False if `to` is
    /// gone.
    #[inline]
    pub(super) fn push_group_copy(
        &mut self,
        to: SockRef,
        faddr: u32,
        sport: u16,
        payload: &MsgBytes<'_>,
        stamp: u64,
    ) -> bool {
        let len = payload.len();
        let mut header = RecordHeader::data(len as u32, faddr, sport);
        header.flags = RX_FLAG_GROUP;
        let Some(app) = self.apps.get_mut(to.app).and_then(|a| a.as_mut()) else {
            return false;
        };
        let Some(sock) = app.socks[to.slot as usize].as_mut() else {
            return false;
        };
        if push_copy(&mut sock.rx, header, payload, self.cfg.trace_hops).is_err() {
            debug_assert!(false, "{to:?} refused a checked group copy");
            Stats::bump(&self.stats.rx_ring_full);
            return false;
        }
        let ctl = app.region.slot_control(to.slot);
        // The slot's gates in turn: at most `GATES` fan-outs are uncommitted (`groups.rs`), so
        // the copy this one's gate named before is committed.
        let gate = &ctl.group_gates[sock.next_gate % shm_api::gate::GATES];
        sock.next_gate = sock.next_gate.wrapping_add(1);
        shm_api::gate::gate(gate, sock.rx.position(), stamp);
        sock.rx.publish();
        sock.rx_produced += len as u64;
        ctl.rx_produced_bytes
            .store(sock.rx_produced, Ordering::Release);
        true
    }

    /// After a commit: wakes the members that sleep in recv and marks those above SO_RCVBUF
    /// congested.
    pub(super) fn wake_group_members(&mut self, members: impl Iterator<Item = SockRef>) {
        // Pairs with the receivers' fence between announcing they wait and looking again.
        std::sync::atomic::fence(Ordering::SeqCst);
        for to in members {
            let Some(app) = self.apps.get_mut(to.app).and_then(|a| a.as_mut()) else {
                continue;
            };
            let Some(sock) = app.socks[to.slot as usize].as_mut() else {
                continue;
            };
            let ctl = app.region.slot_control(to.slot);
            if wake_slot_after_fence(ctl, RECV_WAITERS) {
                Stats::bump_mine(&self.stats.app_wakeups);
            }
            if !sock.congested && sock.over_rcvbuf(ctl, &self.stats.rx_consumed_reads) {
                self.mark_congested(to);
            }
        }
    }

    /// TEST ONLY (`crate::fault`): a crash, or a stall, between two publishes of a fan-out.
    pub(super) fn test_fanout_faults(&mut self) {
        if let Some(n) = &mut self.test_die_in_fanout {
            *n = n.saturating_sub(1);
            if *n == 0 {
                crate::fault::die_now();
            }
        }
        if let Some(path) = &self.test_stall_in_fanout {
            while path.exists() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    pub(super) fn next_rand(&mut self) -> u64 {
        // xorshift64: only used to pick the start of the free-port search.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
}

/// Pushes a record carrying `payload` onto a receiver's rx ring (not yet published), stamped
/// for the latency breakdown when `trace` is on.
#[inline]
fn push_copy(
    rx: &mut Producer<RawRing>,
    header: RecordHeader,
    payload: &MsgBytes<'_>,
    trace: bool,
) -> Result<(), PushError> {
    let len = payload.len();
    rx.push_with(header, |mem, off| {
        // SAFETY: `off..off + len` lies in the receiver's rx ring data area (reserved by the
        // producer for a record of `len` bytes); the source is a separate buffer or another
        // ring (rings never overlap, even for a socket sending to itself).
        unsafe { payload.copy_to(mem.data_ptr().add(off)) };
        if trace {
            // SAFETY: the same `len` bytes we just wrote, not yet published to the app.
            unsafe {
                shm_api::hoptrace::stamp_shared(
                    mem.data_ptr().add(off),
                    len,
                    shm_api::hoptrace::Slot::Deliver,
                )
            };
        }
    })
}

impl Upcalls for SocketTable {
    fn deliver(&mut self, m: Incoming<'_>) -> Delivered {
        if m.dport == GROUP_PORT {
            if self.shard != 0 && !self.from_fabric {
                // Shard 0 keeps the groups: the host's connection may be this shard's.
                return self.forward_to(0, &m);
            }
            return self.group_wire_in(&m);
        }
        let key = (m.laddr, m.dport);
        let found = match self.last_bind {
            Some((k, r)) if k == key => Some(r),
            _ => self
                .binds
                .get(&key)
                .copied()
                .inspect(|&r| self.last_bind = Some((key, r))),
        };
        let Some(to) = found else {
            if let Some(d) = self.forward_delivery(&m) {
                return d;
            }
            if self
                .fabric
                .dir()
                .rebind
                .as_mut()
                .is_some_and(|r| r.holds(m.dport))
            {
                // Its app is re-attaching after our restart: wait (the path pauses).
                Stats::bump(&self.stats.rx_held_for_rebind);
                return Delivered::Full;
            }
            // rds(7): a datagram to an unbound port is silently dropped.
            Stats::bump(&self.stats.drop_unbound_dest);
            return Delivered::NoSocket;
        };
        let here = !(self.from_fabric || self.closing_sender);
        self.deliver_or_park(to, m.faddr, m.sport, &m.payload, here)
    }

    #[inline]
    fn publish_deliveries(&mut self) {
        if !self.rx_burst.is_empty() {
            self.publish_rx_burst_unwoken();
        }
    }

    #[inline]
    fn wake_receivers(&mut self) {
        // Right after the transport recorded the read (see "Restart policy"), not at the end
        // of the pass: the other transports may take a while.
        self.wake_pending();
    }

    fn release(&mut self, token: u64, len: u64) {
        if let Some((from, t)) = shard::unforward(token) {
            if let Some(l) = self.link.as_mut() {
                l.note(from, Note::Release { token: t, len });
            }
            return;
        }
        if let Some(h) = hold_of_token(token) {
            self.release_hold(h, len);
            return;
        }
        let (r, gen) = sock_of_token(token);
        if let Some(host) = group_hosts::host_of_token(r) {
            self.group_host_released(host, len);
            return;
        }
        let Some(s) = self.sock(r) else { return };
        if s.gen != gen {
            return;
        }
        s.released += len;
        let released = s.released;
        let ctl = self.ctl(r);
        ctl.tx_released_bytes.store(released, Ordering::Release);
        self.want_wake(r, SEND_WAITERS);
    }

    fn local_map(&self, addr: u32) -> &CongMap {
        self.local_maps.get(&addr).unwrap_or(&self.empty_map)
    }

    fn peer_map_changed(&mut self, faddr: u32, map: &CongMap) {
        if !self.peer_entries.contains(&faddr) {
            if self.ref_cong_entry(faddr).is_err() {
                tracing::warn!(peer = %std::net::Ipv4Addr::from(faddr), "congestion table full; peer congestion not mirrored");
                return;
            }
            self.peer_entries.insert(faddr);
        }
        let Some(&(idx, _)) = self.cong_entries.get(&faddr) else {
            return;
        };
        for (w, chunk) in self
            .dview
            .map(idx)
            .iter()
            .zip(map.as_bytes().chunks_exact(8))
        {
            w.store(
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                Ordering::Release,
            );
        }
        self.dview.header().cong_seq.fetch_add(1, Ordering::Release);
    }

    fn uncongested(&mut self, mask: u64) {
        self.wake_uncongested(mask);
    }
}

/// A port of `addr` nobody binds, searched from a random start (ports 2..=65535).
fn free_port(binds: &FxHashMap<(u32, u16), shard::Bound>, addr: u32, rand: u64) -> Option<u16> {
    let start = 2 + (rand % 65534) as u32;
    (0..65534u32)
        .map(|i| (2 + (start - 2 + i) % 65534) as u16)
        .find(|&p| p != GROUP_PORT && !binds.contains_key(&(addr, p)))
}

/// The token a network transport carries for a message: which socket (and which incarnation
/// of that slot) gets the bytes back when it is released.
pub(super) fn token_of(r: SockRef, gen: u32) -> u64 {
    ((r.app as u64) << 44) | ((r.slot as u64 & 0xfff) << 32) | gen as u64
}

pub(super) fn sock_of_token(t: u64) -> (SockRef, u32) {
    (
        SockRef {
            app: (t >> 44) as usize,
            slot: ((t >> 32) & 0xfff) as u32,
        },
        t as u32,
    )
}

/// Read-only views for the unit tests and the fuzzing harness.
#[cfg(any(test, fuzzing))]
impl SocketTable {
    /// `app`'s region, while attached.
    pub(super) fn region(&self, app: usize) -> Option<&AppRegion> {
        self.apps.get(app)?.as_ref().map(|a| &a.region)
    }

    /// Regions kept mapped for messages sent in place from apps gone.
    #[cfg(test)]
    /// Tests: smaller drain caps (in all, of one uid) than the configuration's.
    #[cfg(test)]
    pub(super) fn set_drain_caps(&mut self, all: usize, of_uid: usize) {
        self.max_draining = all;
        self.max_draining_of_uid = of_uid;
    }

    pub(super) fn draining_count(&self) -> usize {
        self.draining.len()
    }

    /// Panics if `app` or anything of an app (socket, binding, readiness entry, draining
    /// region) is left: for a harness whose only app is `app`, just detached.
    pub(super) fn assert_nothing_left(&self, app: usize) {
        assert!(self.apps[app].is_none(), "the app is gone");
        assert!(self.open_socks.is_empty(), "no socket outlives its app");
        assert!(self.binds.is_empty(), "no bind outlives its app");
        assert!(
            self.readiness_socks.is_empty(),
            "no readiness entry outlives its app"
        );
        assert!(self.draining.is_empty(), "nothing drains");
        assert!(
            self.backlogged.is_empty()
                && self.group_waits.is_empty()
                && self.group_copy_waits.is_empty()
                && self.backlog_total == 0,
            "no backlog outlives its socket"
        );
        self.groups.check(true);
    }
}

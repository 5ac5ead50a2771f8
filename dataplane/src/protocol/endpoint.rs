//! The shared protocol layer: every RDS connection of one network transport, over any [`Link`].
//!
//! It owns what is the same for kernel TCP, userspace TCP and RDMA: the connection table, our
//! generation number and the RNG seeding each connection, dispatch of engine events to link
//! operations, peer congestion-map mirroring, counter summing, the restart-safe receive state,
//! and the rule that an accepted message is never dropped: when a receiver's rx ring is full
//! the path stops reading (the message waits here; TCP's window or RDMA credits push back).

use super::link::{Accepted, ConnectPoll, Framing, Link, Read, Write};
use super::persist::RxStateFile;
use crate::clock::{Clock, MonotonicClock};
use crate::prefix::Prefix;
use crate::seam::{Delivered, Incoming, MsgBytes, OutMsg, SendOutcome, Transport, Upcalls};
use crate::stats::{NetStats, Stats};
use rds_proto::wire::MAX_PATHS;
use rds_proto::{AcceptError, Connection, Event, Instant, PathState, SendFlags};
use rustc_hash::FxHashMap;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Bytes read from one path per pass (fairness between paths).
const READ_BUDGET: usize = 256 * 1024;
/// Accepted connections that may wait for their path at once (beyond: refused).
const MAX_PARKED: usize = 64;
/// Size of the shared receive buffer of stream links.
const RXBUF: usize = 64 * 1024;
/// Frames gathered into one write on a stream link (one `sendmsg` for up to 32 messages).
const GATHER_FRAMES: usize = 32;
/// Links whose acknowledgement query is a syscall ([`Link::ack_query_is_syscall`]): a path with
/// unacknowledged messages and no input asks again after this long, doubling while nothing new
/// is acknowledged, up to [`ACK_POLL_MAX`]. Input on the path asks at once (a reply usually
/// carries the ACK), and so does every pass while acknowledgements keep coming (a stream).
const ACK_POLL_MIN: Duration = Duration::from_micros(100);
/// The longest wait between two acknowledgement queries of a path with unacknowledged
/// messages; a parked core wakes within it (`next_timeout`).
const ACK_POLL_MAX: Duration = Duration::from_millis(1);

/// What an endpoint is configured with.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// Short name for logs ("tcp").
    pub name: &'static str,
    /// Destinations this transport carries.
    pub routes: Vec<Prefix>,
    /// This host's RDS addresses: inbound connections must arrive on one, and never come
    /// from one (local traffic is loopback's).
    pub local: Vec<Prefix>,
    /// Paths offered per peer (1..=8).
    pub npaths: u8,
    /// Which path a message takes.
    pub path_choice: rds_proto::PathChoice,
    /// Where the receive state survives restarts (`None`: not persisted); shared by the
    /// endpoints of several poll threads, each writing the slots of its own connections.
    pub state: Option<Arc<RxStateFile>>,
}

/// Which group of the daemon's counters an endpoint bumps.
pub type StatsGroup = fn(&Stats) -> &NetStats;

/// A message accepted from the wire that its receiver could not take yet.
#[derive(Debug, Default)]
struct RxHold {
    /// The message waiting for room: (sport, dport, sequence, peer generation), payload in
    /// `held_bytes`.
    held: Option<(u16, u16, u64, u32)>,
    held_bytes: Vec<u8>,
    /// Received bytes not yet given to the engine, from `stash_pos` on.
    stash: Vec<u8>,
    stash_pos: usize,
}

impl RxHold {
    fn is_paused(&self) -> bool {
        self.held.is_some() || self.stash_pos < self.stash.len()
    }
}

struct PathSlot<P> {
    io: P,
    connecting: bool,
}

/// When a path's acknowledged offset is next worth a query (links with costly queries).
#[derive(Clone, Copy, Debug, Default)]
struct AckPoll {
    at: Instant,
    gap: Duration,
}

struct Conn<L: Link> {
    engine: Connection<L::Payload>,
    paths: [Option<PathSlot<L::Path>>; MAX_PATHS],
    rx: [RxHold; MAX_PATHS],
    /// The transport died while received bytes still wait in `rx`: the engine keeps the path
    /// up (so they can be processed) and hears of the drop once they are.
    dead: [bool; MAX_PATHS],
    /// Bit `p`: path `p` may be dead or paused (set by `path_down`, kept by `poll_conn`), so
    /// that `poll_conn` skips the others' checks.
    rx_marked: u8,
    /// Bit `p`: `paths[p]` is `Some` (kept where `paths` changes, checked in `poll_conn`), so
    /// that `poll_conn` looks only at paths that exist or are marked.
    present: u8,
    /// Bit `p`: `path_ready` said path `p` was not ready while the link's `ready_epoch` was
    /// `quiet_epoch`; until that changes, `poll_conn` does not ask again (idle paths cost it
    /// nothing).
    quiet: u8,
    quiet_epoch: u64,
    /// The peer generation last handed to the receive-state file (`learn_generation`).
    learned: u32,
    acks: [AckPoll; MAX_PATHS],
    laddr: u32,
    faddr: u32,
    maps_seen: u64,
    persist: Option<usize>,
}

/// One transport's RDS connections over a [`Link`]; a [`Transport`] for the poll core. It reads
/// the time from `C` (the monotonic clock in the daemon, a virtual one in tests).
pub struct Endpoint<L: Link, C: Clock = MonotonicClock> {
    link: L,
    cfg: EndpointConfig,
    generation: u32,
    seed: u64,
    conns: Vec<Conn<L>>,
    index: FxHashMap<(u32, u32), usize>,
    /// The last connection `conn_for` found (connections are never removed, so an index
    /// stays right): a stream of sends to one peer skips the hash lookup.
    last_conn: Option<((u32, u32), usize)>,
    rxbuf: Vec<u8>,
    clock: C,
    pass: u32,
    stats: Arc<Stats>,
    group: StatsGroup,
    persist: Option<Arc<RxStateFile>>,
    restored: u32,
    /// What passes cost, published with the other counters (`NetStats::passes` ...).
    cost: PassCost,
    /// This pass wrote on some path (for [`Link::end_pass`]).
    wrote: bool,
    /// Accepted connections waiting for their path: the old connection of that path still has
    /// received bytes to process, or a liveness check may free one (`AcceptError::
    /// CheckingPaths`). Never reset instead: the peer's TCP may already have had
    /// bytes of the new connection acknowledged, and RDS/TCP takes a TCP acknowledgement as
    /// delivery.
    parked: Vec<Accepted<L::Path>>,
}

/// Work counted per pass, kept here and published lazily (no atomic per event).
#[derive(Default)]
struct PassCost {
    passes: u64,
    path_visits: u64,
    path_checks: u64,
    reads: u64,
    /// Of those, reads straight into the engine's reassembly buffer.
    direct_reads: u64,
    ack_queries: u64,
    acks_forced: u64,
}

/// What one gathered write of a path's frames did.
enum WriteStep {
    /// Nothing to write, or no room: the path waits.
    Nothing,
    /// Everything offered was taken: there may be more to write.
    All,
    /// Part of it was taken: no room for more now.
    Part,
}

/// One gathered write of up to `N / 2` of `path`'s frames (a frame takes at most two slices,
/// its header and its payload); `Err` when the link's connection is closed.
fn write_frames<L: Link, const N: usize>(
    engine: &mut Connection<L::Payload>,
    link: &mut L,
    io: &mut L::Path,
    now: Instant,
    path: usize,
    local_map: &rds_proto::wire::CongMap,
) -> Result<WriteStep, ()> {
    let max_frames = match L::FRAMING {
        Framing::Stream => GATHER_FRAMES,
        Framing::Message => 1,
    };
    let mut slices: [&[u8]; N] = [&[]; N];
    let t = engine.poll_transmit_slices(now, path, local_map, max_frames, &mut slices);
    if t.is_empty() {
        return Ok(WriteStep::Nothing);
    }
    match link.write(io, &slices[..t.slices]) {
        Write::Wrote(n) => {
            debug_assert!(L::FRAMING == Framing::Stream || n == t.bytes);
            engine.advance_transmit(path, n);
            Ok(if n < t.bytes {
                WriteStep::Part
            } else {
                WriteStep::All
            })
        }
        Write::WouldBlock => Ok(WriteStep::Nothing),
        Write::Closed => Err(()),
    }
}

fn ip(a: u32) -> Ipv4Addr {
    Ipv4Addr::from(a)
}

/// A path state as `rdsctl info` prints it.
fn path_state_name(s: PathState) -> &'static str {
    match s {
        PathState::Down => "down",
        PathState::Connecting => "connecting",
        PathState::Up => "up",
        PathState::Disconnecting => "disconnecting",
        PathState::Error => "error",
    }
}

fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 32)
}

impl<L: Link> Endpoint<L> {
    /// An endpoint over `link` on the monotonic clock, with a random seed.
    pub fn new(link: L, cfg: EndpointConfig, stats: Arc<Stats>, group: StatsGroup) -> Endpoint<L> {
        Endpoint::with_clock(
            link,
            cfg,
            stats,
            group,
            MonotonicClock::new(),
            random_seed(),
        )
    }
}

impl<L: Link, C: Clock> Endpoint<L, C> {
    /// An endpoint over `link` that reads the time from `clock`. Our generation number and the
    /// seeds of the connections' RNGs derive from `seed` (a test passes a fixed one to replay a
    /// run; a restarted endpoint needs a new one, or its peer does not see the restart).
    pub fn with_clock(
        link: L,
        cfg: EndpointConfig,
        stats: Arc<Stats>,
        group: StatsGroup,
        clock: C,
        seed: u64,
    ) -> Endpoint<L, C> {
        let mut generation = (seed ^ (seed >> 29)) as u32;
        if generation == 0 {
            generation = 1;
        }
        let persist = cfg.state.clone();
        tracing::info!(
            transport = cfg.name,
            generation,
            paths = cfg.npaths,
            persisted = persist.is_some(),
            "RDS endpoint ready"
        );
        Endpoint {
            link,
            cfg,
            generation,
            seed,
            conns: Vec::with_capacity(64),
            index: FxHashMap::default(),
            last_conn: None,
            rxbuf: vec![0u8; RXBUF],
            clock,
            pass: 0,
            stats,
            group,
            persist,
            restored: 0,
            cost: PassCost::default(),
            wrote: false,
            parked: Vec::new(),
        }
    }

    /// Connections whose receive state came from the state file.
    pub fn restored_connections(&self) -> u32 {
        self.restored
    }

    /// Our generation number (GEN_NUM), new at every start.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The link, for tests and diagnostics.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The engine of the connection (laddr, faddr), if any.
    pub fn connection(&self, laddr: u32, faddr: u32) -> Option<&Connection<L::Payload>> {
        self.index
            .get(&(laddr, faddr))
            .map(|&i| &self.conns[i].engine)
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn net(&self) -> &NetStats {
        (self.group)(&self.stats)
    }

    fn is_local(&self, a: u32) -> bool {
        self.cfg.local.iter().any(|p| p.contains(ip(a)))
    }

    fn conn_for(&mut self, laddr: u32, faddr: u32) -> Option<usize> {
        match self.last_conn {
            Some((k, i)) if k == (laddr, faddr) => return Some(i),
            _ => {}
        }
        if let Some(&i) = self.index.get(&(laddr, faddr)) {
            self.last_conn = Some(((laddr, faddr), i));
            return Some(i);
        }
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut c = rds_proto::Config::new(ip(laddr), ip(faddr), self.generation, self.seed);
        c.npaths = self.cfg.npaths;
        c.path_choice = self.cfg.path_choice;
        c.sport_idx = L::SPORT_IDX;
        c.hold_cancelled_written = L::READS_AFTER_WRITE;
        let mut engine = match Connection::new(c) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "cannot create RDS connection");
                return None;
            }
        };
        let persist = self.persist.as_ref().and_then(|f| f.slot_for(laddr, faddr));
        if let (Some(f), Some(slot)) = (&self.persist, persist) {
            let (peer_generation, next_rx_seq) = f.load(slot);
            if next_rx_seq.iter().any(|&s| s != 0) {
                engine.restore_rx_state(peer_generation, next_rx_seq);
                self.restored += 1;
                Stats::bump(&self.net().rx_state_restored);
                tracing::info!(peer = %ip(faddr), peer_generation, ?next_rx_seq, "receive state restored");
            }
        }
        tracing::info!(transport = self.cfg.name, local = %ip(laddr), peer = %ip(faddr), "new RDS connection");
        self.conns.push(Conn {
            engine,
            paths: Default::default(),
            rx: Default::default(),
            dead: [false; MAX_PATHS],
            rx_marked: 0,
            present: 0,
            quiet: 0,
            quiet_epoch: 0,
            learned: 0,
            acks: Default::default(),
            laddr,
            faddr,
            maps_seen: 0,
            persist,
        });
        let i = self.conns.len() - 1;
        self.index.insert((laddr, faddr), i);
        Some(i)
    }

    fn accept(&mut self, up: &mut dyn Upcalls, now: Instant) -> usize {
        let mut n = 0;
        // Parked connections first, in the order they came.
        let mut parked = std::mem::take(&mut self.parked).into_iter();
        loop {
            let (accepted, waited) = match parked.next() {
                Some(a) => (a, true),
                None => match self.link.accept() {
                    Some(a) => {
                        n += 1;
                        (a, false)
                    }
                    None => break,
                },
            };
            let (laddr, faddr, peer_port) = (accepted.laddr, accepted.faddr, accepted.peer_port);
            if self.is_local(faddr) || !self.is_local(laddr) {
                // Local traffic uses loopback (spec §6.2); refuse.
                Stats::bump(&self.net().accepts_refused);
                self.link.close(accepted.path, true);
                continue;
            }
            let Some(i) = self.conn_for(laddr, faddr) else {
                self.link.close(accepted.path, true);
                continue;
            };
            if self.conns[i].dead.iter().any(|&d| d) {
                // A path of this connection died with received bytes still to process: the
                // peer's new connection would start a new stream before the old one's tail is
                // delivered (and its engine state reset under it). It waits.
                self.park(accepted, waited);
                continue;
            }
            let mut r = self.conns[i].engine.handle_accepted(now, peer_port);
            if let Err(AcceptError::PathBusy(p)) = r {
                // The peer opened a new connection for path `p` (SPORT_IDX): it gave the old
                // one up, which we have not noticed yet (a paused path reads nothing, and a
                // reset only shows when the socket is read or written). Take the old one down
                // now; if it still holds bytes to process, the new one waits for them.
                let c = &self.conns[i];
                if c.paths[p].as_ref().is_some_and(|s| !s.connecting) {
                    self.path_down(i, p, now);
                }
                if self.conns[i].dead[p] {
                    self.park(accepted, waited);
                    continue;
                }
                r = self.conns[i].engine.handle_accepted(now, peer_port);
            }
            let c = &mut self.conns[i];
            match r {
                Ok(p) => {
                    Stats::bump(&(self.group)(&self.stats).accepts);
                    c.paths[p] = Some(PathSlot {
                        io: accepted.path,
                        connecting: false,
                    });
                    c.present |= 1 << p;
                    c.quiet &= !(1 << p);
                    c.dead[p] = false;
                }
                Err(AcceptError::PathBusy(_) | AcceptError::CheckingPaths) => {
                    self.park(accepted, waited)
                }
                Err(_) => {
                    // Reset, as the kernel does for the side that must connect.
                    Stats::bump(&(self.group)(&self.stats).accepts_refused);
                    self.link.close(accepted.path, true);
                }
            }
            self.drain_events(up, i, now);
        }
        n
    }

    /// Keeps an accepted connection until its path is free (see `parked`); refuses it when too
    /// many wait.
    fn park(&mut self, accepted: Accepted<L::Path>, waited: bool) {
        if self.parked.len() >= MAX_PARKED {
            Stats::bump(&self.net().accepts_refused);
            self.link.close(accepted.path, true);
            return;
        }
        if !waited {
            tracing::debug!(peer_port = accepted.peer_port, "accept waits for its path");
        }
        self.parked.push(accepted);
    }

    /// Closes a path's I/O and tells the engine, unless received bytes must still be processed.
    fn path_down(&mut self, i: usize, path: usize, now: Instant) {
        let c = &mut self.conns[i];
        c.rx_marked |= 1 << path;
        c.present &= !(1 << path);
        c.quiet &= !(1 << path);
        if let Some(mut ps) = c.paths[path].take() {
            if !ps.connecting {
                let written = c.engine.stream_offset(path);
                if let Some(acked) = self.link.final_acked(&ps.io, written) {
                    c.engine.handle_acked(path, acked.min(written));
                }
                if c.engine.path_state(path) == PathState::Up {
                    // The transport died (a failed write, a reset), not the protocol: what it
                    // received and acknowledged but we had not read yet (a paused path, or a
                    // read budget spent) was confirmed to the peer, which will not resend it.
                    // Take it before closing, and deliver it from the stash below.
                    let hold = &mut c.rx[path];
                    while let Read::Data(d) = self.link.read(&mut ps.io, &mut self.rxbuf) {
                        if hold.stash_pos == hold.stash.len() {
                            hold.stash.clear();
                            hold.stash_pos = 0;
                        }
                        hold.stash.extend_from_slice(d);
                        Stats::bump(&self.stats.rx_drained_at_path_down);
                    }
                }
            }
            self.link.close(ps.io, false);
            Stats::bump(&(self.group)(&self.stats).path_down);
        }
        tracing::debug!(
            path,
            state = ?c.engine.path_state(path),
            stashed = c.rx[path].stash.len() - c.rx[path].stash_pos,
            held = c.rx[path].held.is_some(),
            "path down"
        );
        if c.rx[path].stash_pos < c.rx[path].stash.len()
            && c.engine.path_state(path) == PathState::Up
        {
            // TCP acknowledged these bytes to the peer: process them before the engine forgets
            // the stream (path_down resets its deframer).
            c.dead[path] = true;
            return;
        }
        c.dead[path] = false;
        let _ = c.engine.handle_path_down(now, path);
    }

    fn poll_conn(&mut self, up: &mut dyn Upcalls, i: usize, now: Instant) -> usize {
        let mut work = 0;
        if self.conns[i]
            .engine
            .poll_timeout()
            .is_some_and(|t| t <= now)
        {
            self.conns[i].engine.handle_timeout(now);
            work += 1;
        }
        work += self.drain_events(up, i, now);
        let costly_acks = self.link.ack_query_is_syscall();
        // Why the masks keep the visits the same: every test below but the link's reads state
        // that only `rx_marked` (dead, paused) or `paths_with_work` (frames, queued or
        // unacknowledged messages, a pending map) can make true, so a path in neither mask
        // would fail them all. Only a visit changes them: they are read again after one. An
        // idle path costs a bit test, and `path_ready` only when the link's epoch moved.
        let mut marked_paths = self.conns[i].rx_marked | self.conns[i].engine.paths_with_work();
        debug_assert!(
            (0..MAX_PATHS)
                .all(|p| self.conns[i].paths[p].is_some() == (self.conns[i].present >> p & 1 != 0)),
            "present out of step with paths"
        );
        // Paths found not ready stay so while the link's readiness epoch stands (a link
        // without one: none is known).
        let epoch = self.link.ready_epoch();
        {
            let c = &mut self.conns[i];
            if epoch != Some(c.quiet_epoch) {
                c.quiet = 0;
            }
            c.quiet_epoch = epoch.unwrap_or(0);
            debug_assert!(
                (0..MAX_PATHS).all(|p| c.quiet >> p & 1 == 0
                    || c.paths[p]
                        .as_ref()
                        .is_some_and(|ps| !self.link.path_ready(&ps.io))),
                "a path known quiet is ready"
            );
        }
        // A path neither present nor marked fails every test below, and so does a quiet one
        // that is not marked: only the others are looked at, in order (a visit may mark a
        // later path).
        let mut next = 0;
        loop {
            let c = &self.conns[i];
            let rest = u32::from(marked_paths | c.present & !c.quiet) >> next;
            if rest == 0 {
                break;
            }
            let path = next + rest.trailing_zeros() as usize;
            next = path + 1;
            let bit = 1u8 << path;
            let marked = marked_paths & bit != 0;
            let mut quiet = false;
            let visit = match &c.paths[path] {
                None => marked && (c.dead[path] || c.rx[path].held.is_some()),
                // Only a path with work: input (or connect progress), a receiver to resume,
                // frames to send, or acknowledgements worth asking for.
                Some(ps) => {
                    self.cost.path_checks += 1;
                    self.link.path_ready(&ps.io) || {
                        quiet = true;
                        marked
                            && (c.dead[path]
                                || c.rx[path].is_paused()
                                || c.engine.has_pending_transmit(path)
                                || (c.engine.unacked_messages(path) > 0
                                    && (!costly_acks || now >= c.acks[path].at)
                                    && self.link.acks_may_have_moved(&ps.io)))
                    }
                }
            };
            if !visit {
                let c = &mut self.conns[i];
                if quiet {
                    c.quiet |= bit;
                }
                if marked && c.rx_marked & bit != 0 && !c.dead[path] && !c.rx[path].is_paused() {
                    c.rx_marked &= !bit;
                }
                continue;
            }
            // The visit may change what the link answers for this path.
            self.conns[i].quiet &= !bit;
            self.cost.path_visits += 1;
            match self.poll_path(up, i, path, now) {
                Ok(n) => work += n,
                Err(()) => {
                    self.path_down(i, path, now);
                    work += 1;
                }
            }
            // The visit (a receiver full again, a transport gone) may have paused the path or
            // left it dead, or released it.
            let c = &mut self.conns[i];
            if c.dead[path] || c.rx[path].is_paused() {
                c.rx_marked |= bit;
            } else {
                c.rx_marked &= !bit;
            }
            marked_paths = c.rx_marked | c.engine.paths_with_work();
        }
        work += self.drain_events(up, i, now);
        let c = &mut self.conns[i];
        debug_assert!(
            (0..MAX_PATHS).all(|p| c.rx_marked & 1 << p != 0 || !c.dead[p] && !c.rx[p].is_paused()),
            "a dead or paused path outside rx_marked"
        );
        let seen = c.engine.counters().cong_map_received;
        if seen != c.maps_seen {
            c.maps_seen = seen;
            up.peer_map_changed(c.faddr, c.engine.peer_congestion_map());
        }
        work
    }

    /// Delivers what waits on a paused path; true when the path may read again.
    fn resume(&mut self, up: &mut dyn Upcalls, i: usize, path: usize, now: Instant) -> bool {
        let c = &mut self.conns[i];
        let hold = &mut c.rx[path];
        if let Some((sport, dport, seq, generation)) = hold.held {
            let msg = Incoming {
                laddr: c.laddr,
                faddr: c.faddr,
                sport,
                dport,
                payload: MsgBytes::from_slice(&hold.held_bytes),
            };
            if up.deliver(msg) == Delivered::Full {
                return false;
            }
            hold.held = None;
            Stats::bump(&self.stats.rx_resumed);
            Stats::bump(&(self.group)(&self.stats).delivered);
            up.publish_deliveries();
            if let (Some(f), Some(slot)) = (&self.persist, c.persist) {
                f.delivered(slot, path, generation, seq);
            }
            up.wake_receivers();
        }
        if hold.stash_pos < hold.stash.len() {
            let stash = std::mem::take(&mut hold.stash);
            let pos = hold.stash_pos;
            let cx = Ctx::new(now, path, self.persist.as_deref(), &self.stats, self.group);
            let id = (c.laddr, c.faddr, c.persist);
            // Its bytes left the link's buffer when they were read: an ACK_REQUIRED among them
            // was answered by that read's pass, or waits at most the link's delayed ACK.
            let (used, _) = feed(&mut c.engine, &mut c.rx[path], id, up, cx, &stash[pos..]);
            let hold = &mut c.rx[path];
            if hold.held.is_some() {
                // Paused again: the rest of the stash waits, in place.
                hold.stash = stash;
                hold.stash_pos = pos + used;
                return false;
            }
            hold.stash = stash;
            hold.stash.clear();
            hold.stash_pos = 0;
        }
        if c.dead[path] {
            c.dead[path] = false;
            let _ = c.engine.handle_path_down(now, path);
        }
        true
    }

    /// One path's I/O: finish a connect, deliver what waits, read (if the link says the path
    /// is ready), write (if the engine has frames), read acknowledgements (when worth it).
    /// `Err` means the path's transport is gone.
    fn poll_path(
        &mut self,
        up: &mut dyn Upcalls,
        i: usize,
        path: usize,
        now: Instant,
    ) -> Result<usize, ()> {
        let mut work = 0;
        let c = &mut self.conns[i];
        if let Some(ps) = c.paths[path].as_mut().filter(|p| p.connecting) {
            if !self.link.path_ready(&ps.io) {
                return Ok(0);
            }
            return match self.link.poll_connect(&mut ps.io) {
                ConnectPoll::Pending => Ok(0),
                ConnectPoll::Failed => Err(()),
                ConnectPoll::Up => {
                    ps.connecting = false;
                    if c.engine.handle_connected(now, path).is_err() {
                        return Err(());
                    }
                    Stats::bump(&(self.group)(&self.stats).path_up);
                    Ok(1)
                }
            };
        }
        if c.rx[path].is_paused() {
            if !self.resume(up, i, path, now) {
                // Still full: read nothing (the peer's window closes), but keep writing.
                return self.transmit(up, i, path, now, false);
            }
            work += 1;
        }
        let c = &mut self.conns[i];
        let Some(ps) = c.paths[path].as_mut() else {
            return Ok(work);
        };
        let mut budget = READ_BUDGET;
        let mut input = false;
        let mut ack_required = false;
        // A path stays ready until a read finds it drained; one left ready by the budget is
        // read again next pass.
        while budget > 0 && self.link.path_ready(&ps.io) {
            self.cost.reads += 1;
            // The rest of a payload longer than our buffer is received straight into the
            // engine's reassembly buffer (one copy fewer, fewer reads; a read into ours would
            // have held nothing but payload either way). Then `data` is empty: feeding it hands
            // over the message if that read completed it.
            let data: &[u8] =
                if L::READS_INTO_BUFFER && c.engine.rx_payload_room(path).len() >= RXBUF {
                    let room = c.engine.rx_payload_room(path);
                    let n = match self.link.read(&mut ps.io, room) {
                        Read::Data(d) => d.len(),
                        Read::WouldBlock => break,
                        Read::Closed => return Err(()),
                    };
                    c.engine.rx_payload_filled(path, n);
                    self.cost.direct_reads += 1;
                    budget = budget.saturating_sub(n.max(1));
                    &[]
                } else {
                    match self.link.read(&mut ps.io, &mut self.rxbuf) {
                        Read::Data(d) => {
                            budget = budget.saturating_sub(d.len().max(1));
                            d
                        }
                        Read::WouldBlock => break,
                        Read::Closed => return Err(()),
                    }
                };
            input = true;
            work += 1;
            let cx = Ctx::new(now, path, self.persist.as_deref(), &self.stats, self.group);
            let id = (c.laddr, c.faddr, c.persist);
            let (used, asked) = feed(&mut c.engine, &mut c.rx[path], id, up, cx, data);
            ack_required |= asked;
            if c.rx[path].held.is_some() {
                let hold = &mut c.rx[path];
                hold.stash.clear();
                hold.stash.extend_from_slice(&data[used..]);
                hold.stash_pos = 0;
                break;
            }
            if c.engine.path_state(path) != PathState::Up {
                // The engine dropped the path (malformed input): its Close event follows.
                return Ok(work);
            }
        }
        if ack_required {
            self.cost.acks_forced += 1;
            self.link.ack_now(&mut ps.io);
        }
        Ok(work + self.transmit(up, i, path, now, input)?)
    }

    /// Writes what the engine has for `path`, then reads its acknowledgements if worth it
    /// (`input`: the path received bytes this pass, which usually carry an ACK).
    fn transmit(
        &mut self,
        up: &mut dyn Upcalls,
        i: usize,
        path: usize,
        now: Instant,
        input: bool,
    ) -> Result<usize, ()> {
        let c = &mut self.conns[i];
        let Some(ps) = c.paths[path].as_mut() else {
            return Ok(0);
        };
        let mut work = 0;
        let local_map = up.local_map(c.laddr);
        // Most visits of a busy path are for its acknowledgements: no frame to build then.
        while c.engine.has_pending_transmit(path) {
            // Most writes carry one frame: 4 slices to fill, not the 64 a backlog takes (which
            // cost ~190 instructions to initialise). Fewer slices only mean more writes.
            let (engine, link, io) = (&mut c.engine, &mut self.link, &mut ps.io);
            let step = if engine.queued_messages(path) <= 1 {
                write_frames::<L, 4>(engine, link, io, now, path, local_map)
            } else {
                write_frames::<L, { 2 * GATHER_FRAMES }>(engine, link, io, now, path, local_map)
            };
            match step? {
                WriteStep::Nothing => break,
                WriteStep::All => {
                    self.wrote = true;
                    work += 1;
                }
                WriteStep::Part => {
                    self.wrote = true;
                    work += 1;
                    break;
                }
            }
        }
        let unacked = c.engine.unacked_messages(path);
        if unacked == 0 {
            return Ok(work);
        }
        if L::READS_AFTER_WRITE && c.engine.holds_cancelled(path) {
            // Cancelled messages the device may still have been reading: free once it is not.
            if let Some(done) = self.link.read_done(&ps.io) {
                let released = c.engine.release_cancelled_read(path, done);
                (self.group)(&self.stats)
                    .cancels_held_for_device
                    .fetch_add(released as u64, Ordering::Relaxed);
                work += released;
            }
        }
        let costly = self.link.ack_query_is_syscall();
        let poll = &mut c.acks[path];
        if costly && !input && now < poll.at || !self.link.acks_may_have_moved(&ps.io) {
            return Ok(work);
        }
        let written = c.engine.stream_offset(path);
        self.cost.ack_queries += 1;
        if let Some(acked) = self.link.acked(&ps.io, written) {
            c.engine.handle_acked(path, acked.min(written));
        }
        if costly {
            let left = c.engine.unacked_messages(path);
            if left == 0 {
                // All acknowledged: what is written next cannot be acknowledged at once.
                *poll = AckPoll {
                    at: now + ACK_POLL_MIN,
                    gap: ACK_POLL_MIN,
                };
            } else if left < unacked {
                // Acknowledgements are flowing (a stream): ask again next pass.
                *poll = AckPoll {
                    at: now,
                    gap: ACK_POLL_MIN,
                };
            } else {
                let gap = poll.gap.clamp(ACK_POLL_MIN, ACK_POLL_MAX);
                *poll = AckPoll {
                    at: now + gap,
                    gap: (gap * 2).min(ACK_POLL_MAX),
                };
            }
        }
        Ok(work)
    }

    /// Handles the engine's events of connection `i`, then stores its peer generation (see
    /// `Connection::restore_rx_state`). Most passes have none: one test and the store's check.
    #[inline]
    fn drain_events(&mut self, up: &mut dyn Upcalls, i: usize, now: Instant) -> usize {
        if !self.conns[i].engine.has_events() {
            self.learn_generation(i);
            return 0;
        }
        self.drain_events_slow(up, i, now)
    }

    /// Hands a new peer generation to the receive-state file. Only this connection writes its
    /// slot's generation, so an unchanged one is skipped without touching the file.
    #[inline]
    fn learn_generation(&mut self, i: usize) {
        let c = &mut self.conns[i];
        let generation = c.engine.peer_generation();
        if generation == c.learned {
            return;
        }
        c.learned = generation;
        if let (Some(f), Some(slot)) = (&self.persist, c.persist) {
            f.learned(slot, generation);
        }
    }

    #[inline(never)]
    fn drain_events_slow(&mut self, up: &mut dyn Upcalls, i: usize, now: Instant) -> usize {
        let mut n = 0;
        while let Some(ev) = self.conns[i].engine.poll_event() {
            n += 1;
            let (laddr, faddr) = (self.conns[i].laddr, self.conns[i].faddr);
            match ev {
                Event::Connect { path } => {
                    Stats::bump(&self.net().connects);
                    match self.link.connect(laddr, faddr, path) {
                        Ok(io) => {
                            let c = &mut self.conns[i];
                            c.paths[path] = Some(PathSlot {
                                io,
                                connecting: true,
                            });
                            c.present |= 1 << path;
                            c.quiet &= !(1 << path);
                            c.dead[path] = false;
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, path, "connect failed");
                            let _ = self.conns[i].engine.handle_path_down(now, path);
                        }
                    }
                }
                Event::Doorbell => self.link.doorbell(laddr, faddr),
                Event::Close { path } => {
                    // Bytes after a protocol error are garbage; forget them.
                    let hold = &mut self.conns[i].rx[path];
                    hold.stash.clear();
                    hold.stash_pos = 0;
                    self.path_down(i, path, now);
                }
                Event::Released { token, len } => up.release(token, len as u64),
                Event::CongestionChanged { uncongested_mask } => {
                    let c = &mut self.conns[i];
                    c.maps_seen = c.engine.counters().cong_map_received;
                    up.peer_map_changed(faddr, c.engine.peer_congestion_map());
                    up.uncongested(uncongested_mask);
                }
                Event::PathsNegotiated { npaths } => {
                    tracing::info!(peer = %ip(faddr), npaths, "paths negotiated");
                }
                Event::PeerRestarted { .. } => {
                    // The stored generation (and with it the void old numbers) is updated
                    // below, after every call, with `learned`.
                    tracing::info!(peer = %ip(faddr), "peer restarted");
                    Stats::bump(&self.net().peer_restarts);
                }
            }
        }
        self.learn_generation(i);
        n
    }
}

/// What [`feed`] needs besides the connection.
struct Ctx<'a> {
    now: Instant,
    path: usize,
    persist: Option<&'a RxStateFile>,
    stats: &'a Stats,
    net: &'a NetStats,
}

impl<'a> Ctx<'a> {
    fn new(
        now: Instant,
        path: usize,
        persist: Option<&'a RxStateFile>,
        stats: &'a Stats,
        group: StatsGroup,
    ) -> Ctx<'a> {
        Ctx {
            now,
            path,
            persist,
            stats,
            net: group(stats),
        }
    }
}

/// Gives `data` (received on `cx.path`) to the engine and delivers what completes. Stops at
/// the first message the receiver cannot take, which it keeps in the path's hold; returns the
/// bytes of `data` consumed, and whether a message asked for a prompt acknowledgement
/// (`RDS_FLAG_ACK_REQUIRED`).
fn feed<P: AsRef<[u8]>>(
    engine: &mut Connection<P>,
    hold: &mut RxHold,
    (laddr, faddr, slot): (u32, u32, Option<usize>),
    up: &mut dyn Upcalls,
    cx: Ctx<'_>,
    data: &[u8],
) -> (usize, bool) {
    let persist = cx.persist.zip(slot);
    // The newest delivery's (generation, sequence): recorded once, after the publish.
    let mut newest = None;
    let mut off = 0;
    let mut ack_required = false;
    // At least once: with no bytes, a payload received in place may be complete.
    loop {
        let r = engine.receive(cx.now, cx.path, &data[off..]);
        off += r.consumed;
        if let Some(d) = r.delivery {
            ack_required |= d.ack_required;
            let msg = Incoming {
                laddr,
                faddr,
                sport: d.sport,
                dport: d.dport,
                payload: MsgBytes::from_slice(d.payload),
            };
            if up.deliver(msg) == Delivered::Full {
                hold.held_bytes.clear();
                hold.held_bytes.extend_from_slice(d.payload);
                hold.held = Some((d.sport, d.dport, d.sequence, d.peer_generation));
                Stats::bump(&cx.stats.rx_paused);
                record_delivered(up, persist, cx.path, newest);
                return (off, ack_required);
            }
            Stats::bump_mine(&cx.net.delivered);
            newest = Some((d.peer_generation, d.sequence));
        }
        if engine.path_state(cx.path) != PathState::Up {
            off = data.len();
            break;
        }
        if off >= data.len() {
            break;
        }
    }
    record_delivered(up, persist, cx.path, newest);
    (off, ack_required)
}

/// Up to `budget` items of `it`, the budget lowered by those taken.
fn list_within<T>(it: impl Iterator<Item = T>, budget: &mut usize) -> Vec<T> {
    let v: Vec<T> = it.take(*budget).collect();
    *budget -= v.len();
    v
}

/// Publishes what one read delivered, stores its newest sequence number in the receive state,
/// then wakes the receivers. Publish first, so that a crash between the two can cost a
/// duplicate (the peer resends what the new rdsd does not know was delivered) but never a
/// message the state says was delivered and no receiver could read; wake last, because a
/// wake-up is a syscall, where a SIGKILL is most likely to land (and the woken app may preempt
/// us on the way out). Sequence numbers only grow within a generation, and a new generation
/// voids the old numbers, so the newest stands for all.
fn record_delivered(
    up: &mut dyn Upcalls,
    persist: Option<(&RxStateFile, usize)>,
    path: usize,
    newest: Option<(u32, u64)>,
) {
    let Some((generation, seq)) = newest else {
        return;
    };
    up.publish_deliveries();
    if let Some((f, slot)) = persist {
        f.delivered(slot, path, generation, seq);
    }
    up.wake_receivers();
}

impl<L: Link, C: Clock> Transport for Endpoint<L, C> {
    fn name(&self) -> &'static str {
        self.cfg.name
    }

    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        self.cfg.routes.iter().any(|p| p.contains(dest))
    }

    fn send(&mut self, _up: &mut dyn Upcalls, m: OutMsg<'_>) -> SendOutcome {
        let Some(i) = self.conn_for(m.laddr, m.faddr) else {
            Stats::bump(&self.stats.drop_no_route);
            return SendOutcome::Dropped;
        };
        let now = self.now();
        let in_place = m
            .in_place
            .and_then(|region| self.link.payload_in_place(m.payload, region));
        let queued = if in_place.is_some() {
            SendOutcome::QueuedInPlace
        } else {
            SendOutcome::Queued
        };
        let payload = in_place.unwrap_or_else(|| self.link.payload(m.payload));
        let flags = SendFlags {
            ack_required: m.ack_required,
        };
        match self.conns[i]
            .engine
            .send_with(now, m.sport, m.dport, payload, m.token, flags)
        {
            Ok(_) => queued,
            Err(_) => {
                Stats::bump(&self.stats.drop_no_route);
                SendOutcome::Dropped
            }
        }
    }

    fn poll(&mut self, up: &mut dyn Upcalls) -> usize {
        self.pass = self.pass.wrapping_add(1);
        self.cost.passes += 1;
        if self.conns.is_empty() && self.parked.is_empty() && self.link.is_quiet() {
            // Nothing to poll (an idle kernel-TCP transport beside DPDK): no clock, no accept.
            return 0;
        }
        let now = self.now();
        let mut work = 0;
        self.link.begin_pass();
        self.wrote = false;
        if self.pass.is_multiple_of(16) || self.conns.is_empty() || !self.parked.is_empty() {
            work += self.accept(up, now);
        }
        work += self.link.poll_aux();
        for i in 0..self.conns.len() {
            work += self.poll_conn(up, i, now);
        }
        self.link.end_pass(self.wrote);
        work
    }

    fn zero_copy(&self) -> bool {
        self.link.zero_copy()
    }

    fn zero_copy_min(&self) -> usize {
        self.link.zero_copy_min()
    }

    fn region_attached(&mut self, id: u64, base: *const u8, len: usize) {
        self.link.region_attached(id, base, len);
    }

    fn region_detached(&mut self, id: u64) {
        self.link.region_detached(id);
    }

    fn cancel(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        for c in self.conns.iter_mut().filter(|c| c.laddr == laddr) {
            match dest {
                Some((a, p)) if a == c.faddr => {
                    c.engine.cancel_sent_to(sport, p);
                }
                Some(_) => {}
                None => {
                    c.engine.cancel_socket(sport);
                }
            }
        }
    }

    fn local_congestion_changed(&mut self, laddr: u32) {
        for c in self.conns.iter_mut().filter(|c| c.laddr == laddr) {
            c.engine.local_congestion_changed();
        }
    }

    fn park_fds(&self, out: &mut Vec<libc::pollfd>) {
        self.link.park_fds(out);
        for c in &self.conns {
            for (p, slot) in c.paths.iter().enumerate() {
                // A paused path is not watched: its data is already here.
                if let Some(s) = slot.as_ref().filter(|_| !c.rx[p].is_paused()) {
                    self.link.park_fd(&s.io, s.connecting, out);
                }
            }
        }
    }

    fn next_timeout(&self) -> Option<Duration> {
        let now = self.now();
        let waiting = self
            .conns
            .iter()
            .any(|c| c.rx.iter().any(RxHold::is_paused));
        let unacked = self.link.acks_need_polling()
            && self
                .conns
                .iter()
                .any(|c| (0..MAX_PATHS).any(|p| c.engine.unacked_messages(p) > 0));
        if waiting || unacked {
            // Neither a receiver draining its ring nor a TCP acknowledgement wakes poll().
            return Some(Duration::from_millis(1));
        }
        self.conns
            .iter()
            .filter_map(|c| c.engine.poll_timeout())
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    fn snapshot(&mut self, out: &mut Vec<crate::seam::ConnSnapshot>, listed: &mut usize) {
        use crate::seam::{ConnSnapshot, PathSnapshot};
        for c in &self.conns {
            let e = &c.engine;
            let mut paths = Vec::new();
            for p in 0..MAX_PATHS {
                let state = e.path_state(p);
                let (rx_header_rem, rx_payload_rem) = e.rx_remaining(p);
                let ps = PathSnapshot {
                    index: p,
                    state: path_state_name(state),
                    next_tx_seq: e.next_tx_seq(p),
                    next_rx_seq: e.next_rx_seq(p),
                    queued_msgs: e.queued_messages(p),
                    unacked_msgs: e.unacked_messages(p),
                    tx_stream_bytes: e.stream_offset(p),
                    unacked_bytes: None,
                    rx_paused: c.rx[p].is_paused(),
                    local_port: None,
                    peer_port: None,
                    rx_header_rem,
                    rx_payload_rem,
                    rdma: None,
                    send_messages: list_within(e.message_info(p, false), listed),
                    retrans_messages: list_within(e.message_info(p, true), listed),
                };
                let idle = state == PathState::Down
                    && ps.queued_msgs == 0
                    && ps.unacked_msgs == 0
                    && ps.next_tx_seq <= 1
                    && ps.next_rx_seq == 0;
                if !idle || p == 0 {
                    paths.push(ps);
                }
            }
            for ps in &mut paths {
                let ends = c.paths[ps.index]
                    .as_ref()
                    .filter(|s| !s.connecting)
                    .and_then(|s| self.link.endpoints(&s.io));
                if let Some((local, peer)) = ends {
                    (ps.local_port, ps.peer_port) = (Some(local.port()), Some(peer.port()));
                }
                ps.rdma = c.paths[ps.index]
                    .as_ref()
                    .filter(|s| !s.connecting)
                    .and_then(|s| self.link.rdma_info(&s.io));
            }
            if L::FRAMING == Framing::Stream {
                // A read-only query (SIOCOUTQ for kernel TCP), as `transmit` makes each pass.
                for ps in &mut paths {
                    if let Some(slot) = c.paths[ps.index].as_ref().filter(|s| !s.connecting) {
                        ps.unacked_bytes = self
                            .link
                            .acked(&slot.io, ps.tx_stream_bytes)
                            .map(|a| ps.tx_stream_bytes.saturating_sub(a));
                    }
                }
            }
            let states: Vec<PathState> = (0..MAX_PATHS).map(|p| e.path_state(p)).collect();
            let state = if states.contains(&PathState::Up) {
                "up"
            } else if states.contains(&PathState::Connecting) {
                "connecting"
            } else {
                "down"
            };
            out.push(ConnSnapshot {
                transport: self.cfg.name,
                shard: 0,
                laddr: ip(c.laddr),
                faddr: ip(c.faddr),
                state,
                active: e.is_active(),
                generation: self.generation,
                peer_generation: e.peer_generation(),
                npaths: e.npaths(),
                paths,
            });
        }
    }

    fn publish_counters(&self) {
        type Get = fn(&rds_proto::Counters) -> u64;
        let n = self.net();
        let fields: [(&std::sync::atomic::AtomicU64, Get); 17] = [
            (&n.tx_messages, |k| k.tx_messages),
            (&n.retransmits, |k| k.tx_retransmits),
            (&n.rx_messages, |k| k.rx_messages),
            (&n.drop_bad_header, |k| {
                k.rx_drop_bad_header + k.rx_bad_exthdr
            }),
            (&n.drop_oversize, |k| k.rx_drop_oversize),
            (&n.drop_dup_seq, |k| k.rx_drop_dup_seq),
            (&n.drop_unknown, |k| k.rx_drop_unknown + k.rx_truncated),
            (&n.path_errors, |k| k.path_errors),
            (&n.path_mismaps, |k| k.path_mismaps),
            (&n.reconnects, |k| k.reconnects),
            (&n.cong_maps_sent, |k| k.cong_map_sent),
            (&n.cong_maps_received, |k| k.cong_map_received),
            (&n.pings_received, |k| k.pings_received),
            (&n.doorbells, |k| k.doorbells),
            (&n.path0_gate_timeouts, |k| k.path0_gate_timeouts),
            (&n.liveness_checks, |k| k.liveness_checks),
            (&n.stale_paths_closed, |k| k.stale_paths_closed),
        ];
        for (counter, get) in fields {
            let sum = self.conns.iter().map(|c| get(c.engine.counters())).sum();
            counter.store(sum, Ordering::Relaxed);
        }
        n.passes.store(self.cost.passes, Ordering::Relaxed);
        n.path_visits
            .store(self.cost.path_visits, Ordering::Relaxed);
        n.path_checks
            .store(self.cost.path_checks, Ordering::Relaxed);
        n.path_reads.store(self.cost.reads, Ordering::Relaxed);
        n.path_direct_reads
            .store(self.cost.direct_reads, Ordering::Relaxed);
        n.ack_queries
            .store(self.cost.ack_queries, Ordering::Relaxed);
        n.acks_forced
            .store(self.cost.acks_forced, Ordering::Relaxed);
    }
}

//! RDS over RDMA: a message-framed [`Link`] over reliable-connected queue pairs (spec §12).
//!
//! * **Connection setup** with rdma_cm on port 18634 (port space TCP), one RC QP per path. The
//!   REQ and REP carry the kernel's IPv4 private data (32 bytes: addresses, version 3.1, ack
//!   sequence, initial credits). Which side connects, the doorbell and the path count are the
//!   shared protocol layer's (the smaller-address rule); a doorbell here is a connect whose
//!   result is ignored (the peer's engine refuses it and connects back).
//! * **Poll threads**: one link per poll thread that drives the network (`Config::net_shards`),
//!   with the connections `transport::ConnOwners` gives it and every path of each; one rdma_cm
//!   channel and listener for all, whose event thread routes each event to its link
//!   (`route_event`). Everything below is per link.
//! * **Memory**: one PD per device, shared by every path and by the app regions of the
//!   thread's apps, each registered once at attach (`region_attached`) for zero-copy sends.
//!   One CQ per device, shared by every path's sends and receives (a work request's id carries its path's tag), so
//!   a pass polls one CQ whatever the path count. Each path owns one registered area cut into
//!   `recv_buffers + send_slots` slots of 4144 bytes (`[48-byte header][4096 bytes]`). All
//!   receive slots are posted at creation; a slot is re-posted once its fragment is copied
//!   out, and at most one frame is reassembled ahead of the protocol layer's read, so a paused
//!   receiver stops granting credits and the sender stalls (bounded memory).
//! * **Framing**: a frame from the engine (`[header][payload]`) goes out as
//!   max(1, ceil(len/4096)) SENDs, each starting with a copy of the header (in a send slot)
//!   whose `h_ack` and `h_credit` are stamped (and checksum refreshed) when the fragment is
//!   posted. A payload in an app region (zero copy) is the SEND's second scatter-gather entry,
//!   read by the device from the app's ring; any other payload is copied into the slot.
//!   Received fragments are checked against the first (sequence, length, ports) and
//!   reassembled into one frame for [`Link::read`].
//! * **Credits**: a SEND consumes one credit; the receiver advertises re-posted buffers in
//!   `h_credit` (<= 255 per header); the last credit is kept for a frame that carries a credit
//!   update. The initial credits come from the private data.
//! * **Acknowledgement**: `h_ack` = the sequence of the last frame the protocol layer read on
//!   this path. The sender maps it onto frame offsets (the `acked` offset the engine uses to
//!   release messages), so credits and acks fit the shared layer's stream-offset model. When
//!   there is nothing to piggyback, an ACK-only frame (ports 0/0, no payload) goes out, at most
//!   one in flight.
//! * **Polling**: each pass starts by draining the CQ (`begin_pass`, no syscall), hands each
//!   completion to its path's flow and moves those flows forward; a path is read only when its
//!   flow holds a whole frame (`path_ready`), so an idle path costs nothing. rdma_cm's event
//!   channel is read by a thread of its own (`transport::handoff`), which hands events over through a
//!   lock-free queue: the passes make no syscall for rdma_cm either. Before the core parks,
//!   the CQ is armed and its completion channel fd, and the event thread's eventfd, join the
//!   poll set.
//! * **Release**: `acked()` is min(frames the peer acknowledged, frames whose SENDs completed),
//!   so a message sent in place is released (and its ring space reused) only after both.
//!
//! The data-path rules (framing, credits, acknowledgement, the stall timer) are `flow.rs`'s
//! `PathFlow`, without I/O; this module is the shell that calls rdma_cm and verbs, reads the
//! clock and feeds it.
//!
//! Not done (documented in dataplane/docs/transports.md): SRQ, RDMA WRITE, inline sends, IPv6, the 4.x
//! version negotiation, and a sender-side ack_seq in the private data (0 is sent: the engine's
//! duplicate rule covers retransmissions).

pub mod config;
mod flow;
mod regions;
mod verbs;
pub mod wire;

pub use config::{RawRdma, RdmaConfig};

use crate::config::Config;
use crate::prefix::Prefix;
use crate::protocol::{
    Accepted, ConnectPoll, Endpoint, Framing, InPlaceBytes, Link, Payload, PoolBuf, Read,
    RxStateFile, Write,
};
use crate::seam::MsgBytes;
use crate::stats::Stats;
use crate::transport::ConnOwners;
use flow::{PathFlow, PathState};
use regions::{RegionDirectory, RegionKeys, RegionReplica};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use verbs::{Cm, CmContext, CmEvent, CmEventKind, Device, Mr, Pds, Qp};
use wire::{PrivData, HDR};

/// Builds the RDMA transport (the configuration has an `[rdma]` section, `r`): an endpoint
/// for each poll thread that drives network transports (`owners.shards()`), each with the
/// connections `owners` gives it, every path of each (its QPs, on its own PD and CQ).
pub fn build(
    cfg: &Config,
    r: &RdmaConfig,
    stats: &[Arc<Stats>],
    owners: &Arc<ConnOwners>,
) -> std::io::Result<Vec<Endpoint<RdmaLink>>> {
    debug_assert!(owners.shards() <= stats.len(), "a poll thread per owner");
    // Only messages of `tcp_zero_copy_min` or more cross to another thread as a reference
    // into the sender's tx ring (`SendRef`); smaller ones are copies.
    let foreign_min = cfg.tcp_zero_copy_min.unwrap_or(usize::MAX);
    let links = RdmaLink::listen_sharded(r, owners.clone(), cfg.local_addrs.clone(), foreign_min)?;
    let mut state = cfg.state_file.clone().into_os_string();
    state.push(".rdma");
    let state = RxStateFile::open_shared(std::path::Path::new(&state))?;
    Ok(links
        .into_iter()
        .zip(stats)
        .map(|(link, stats)| {
            let ep = crate::transport::endpoint_config("rdma", &r.routes, cfg, &state);
            Endpoint::new(link, ep, stats.clone(), |s| &s.rdma)
        })
        .collect())
}

/// How long a doorbell connection may live.
const DOORBELL_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// An outgoing connection that is not established after this long is given up (the protocol
/// layer retries with backoff): rdma_cm's own REQ retries can take much longer.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Timeout for address and route resolution (ms).
const RESOLVE_MS: i32 = 2000;
/// Passes between two housekeeping rounds over the paths (timeouts of seconds).
const HOUSEKEEPING_EVERY: u32 = 16;

/// Work request ids on the shared CQ: bits 0..32 are the flow's (slot, ack), bit 63 its send
/// flag; the path's table index goes in bits 32..48 and the low 15 bits of its generation in
/// bits 48..63, so that a completion left by a destroyed QP is recognised and dropped.
const TAG_MASK: u64 = 0x7fff_ffff_0000_0000;
const MAX_CONNS: usize = 1 << 16;

fn tag(idx: usize, gen: u32) -> u64 {
    debug_assert!(idx < MAX_CONNS);
    (idx as u64) << 32 | (u64::from(gen) & 0x7fff) << 48
}

/// (table index, generation's low 15 bits, the flow's own id).
fn untag(wr_id: u64) -> (usize, u32, u64) {
    (
        (wr_id >> 32 & 0xffff) as usize,
        (wr_id >> 48 & 0x7fff) as u32,
        wr_id & !TAG_MASK,
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Ours, from `connect`.
    Active,
    /// A doorbell: destroyed when it resolves either way.
    Doorbell,
    /// Inbound, waiting for ESTABLISHED before `accept` hands it over.
    PassivePending,
    /// Inbound, handed over.
    Passive,
}

/// One path: the connection handle, its QP and the QP's data-path rules.
struct Conn {
    gen: u32,
    role: Role,
    cm: verbs::CmId,
    qp: Option<Qp>,
    laddr: u32,
    faddr: u32,
    peer_port: u16,
    /// Credits, fragments, acks, the path's state and timers (`flow.rs`).
    flow: PathFlow,
    /// In `RdmaLink::touched` this pass.
    touched: bool,
    /// The endpoint knows the path is up (`poll_connect` said so, or `accept` handed it
    /// over): until then `path_ready` stays true, so that it asks.
    reported_up: bool,
    /// What `acked` last answered.
    acked_reported: u64,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The QP goes before its CQ/MR/PD (the `qp` field) and the id (the `cm` field).
        if self.qp.is_some() {
            self.cm.destroy_qp();
        }
    }
}

/// A path handle: an index into the link's table, with its generation.
#[derive(Debug)]
pub struct RdmaPath {
    idx: usize,
    gen: u32,
}

/// RDMA RC queue pairs for every path of the connections one poll thread owns.
pub struct RdmaLink {
    /// Kept alive: the listening id (poll thread 0's link holds it).
    _listener: Option<verbs::CmId>,
    /// The poll thread this link runs on: its ids' events come to it (`CmContext::shard`).
    shard: usize,
    port: u16,
    recv_n: u32,
    send_n: u32,
    conns: Vec<Option<Box<Conn>>>,
    gen: u32,
    /// rdma_cm's events, read by a thread of their own (`transport::handoff`): reading the
    /// event channel is a `read(2)`; that thread also acknowledges each event at once, so
    /// `rdma_destroy_id` on the poll core never waits for it. One channel for every poll
    /// thread: the thread hands each event to the link that made its id (`CmContext`), and a
    /// connect request to the owner of its connection (`route_event`).
    events: crate::transport::handoff::Handoff<CmEvent>,
    accepted: VecDeque<usize>,
    /// Completions polled while arming, before parking (see `park_fds`), still tagged.
    early: std::cell::RefCell<Vec<flow::Completion>>,
    /// Paths that got completions this pass (indices into `conns`); its capacity follows the
    /// table's, so a pass never allocates.
    touched: Vec<usize>,
    /// Completions of one CQ poll, kept here: a fresh array per pass would be 768 bytes to
    /// initialise on every pass, busy or not.
    wcs: [flow::Completion; 32],
    /// Completions handled by this pass's `begin_pass` (reported as work by `poll_aux`).
    completions: usize,
    /// Moves on whenever a path may have become ready (`Link::ready_epoch`): completions
    /// handled, an rdma_cm event, housekeeping (a timeout, the keepalive), a connection
    /// started, reported up or destroyed, a region detached.
    ready_epoch: u64,
    passes: u32,
    ready_fd: std::os::fd::OwnedFd,
    /// TEST ONLY (`crate::fault::rdma_qp_error_every`): every N-th frame written moves its
    /// path's QP to the error state, mid-stream. `None` without the `fault-injection` feature.
    qp_error_every: Option<u64>,
    frames_written: u64,
    /// Next candidate source port (see `source_port`).
    next_port: u16,
    zero_copy: bool,
    /// This thread's app regions, registered on every device (zero copy). After `conns`: no
    /// QP sends from them when they are deregistered.
    regions: Vec<Region>,
    /// Every thread's regions (`regions.rs`): a message forwarded by another poll thread as a
    /// reference into its app's tx ring (`SendRef`) is sent from there too.
    foreign: RegionReplica,
    /// Payloads below this size never lie in another thread's region (`SendRef`'s threshold,
    /// `tcp_zero_copy_min`): `write` looks no further for them.
    foreign_min: usize,
    /// What the poll threads' links share: the PDs and the region directory.
    shared: Arc<Shared>,
    /// After `conns` and `regions`: their PDs go last. Each poll thread's own PD and CQ per
    /// device (the device contexts are librdmacm's, shared).
    devices: Vec<Device>,
    /// Last: the channel goes with the last link (after every id on it, and after the event
    /// thread, which the first link's `events` joins).
    cm: Arc<Cm>,
}

/// What every poll thread's RDMA link shares.
#[derive(Default)]
struct Shared {
    /// One PD per device for the process (an MR is usable by any QP on its PD).
    pds: Pds,
    /// The app regions each thread registered, with their lkeys.
    regions: RegionDirectory,
}

/// The poll thread an rdma_cm event is for: the one whose link made the id; for a connect
/// request (a new id), the owner of its connection, named by the request's private data
/// (`ConnOwners::owner_of_inbound`: one the endpoints refuse goes to thread 0).
fn route_event(ev: &CmEvent, owners: &ConnOwners, local: &[Prefix]) -> usize {
    if let Some(c) = ev.context {
        return c.shard;
    }
    if ev.kind != CmEventKind::ConnectRequest {
        return 0;
    }
    ev.private
        .as_deref()
        .and_then(PrivData::decode)
        .filter(PrivData::compatible)
        .map_or(0, |pd| owners.owner_of_inbound(pd.daddr, pd.saddr, local))
}

impl RdmaLink {
    /// Opens rdma_cm, listens on `cfg.port` on every RDMA device, and makes one link for
    /// each poll thread `owners` places connections on (`local`: this host's RDS addresses;
    /// `foreign_min`: the smallest message another thread forwards by reference).
    pub fn listen_sharded(
        cfg: &RdmaConfig,
        owners: Arc<ConnOwners>,
        local: Vec<Prefix>,
        foreign_min: usize,
    ) -> std::io::Result<Vec<RdmaLink>> {
        let cm = Arc::new(Cm::new()?);
        let listener = cm.listen(cfg.port)?;
        let cm2 = cm.clone();
        let shards = owners.shards();
        let ends = crate::transport::handoff::Handoff::spawn_sharded(
            "rdsd-rdma-cm",
            cm.fd(),
            shards,
            move |ev: &CmEvent| route_event(ev, &owners, &local),
            move |push| {
                while let Some(ev) = cm2.get_event() {
                    push(ev);
                }
            },
        )?;
        tracing::info!(port = cfg.port, shards, "RDS/RDMA listening");
        let mut listener = Some(listener);
        let shared = Arc::new(Shared::default());
        ends.into_iter()
            .enumerate()
            .map(|(shard, events)| {
                // Every device's PD up front, so that app regions are registered once, at
                // attach (each poll thread registers its own apps' regions).
                let devices = Device::all(&shared.pds)?;
                // SAFETY: eventfd with a valid flag set; the fd is owned from here on.
                let fd = unsafe { libc::eventfd(1, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: `fd` is a fresh descriptor nobody else owns.
                let ready_fd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
                Ok(RdmaLink {
                    cm: cm.clone(),
                    _listener: listener.take(),
                    shard,
                    port: cfg.port,
                    recv_n: cfg.recv_buffers,
                    send_n: cfg.send_slots,
                    conns: Vec::new(),
                    gen: 1,
                    events,
                    accepted: VecDeque::new(),
                    early: Default::default(),
                    touched: Vec::new(),
                    wcs: [flow::Completion::default(); 32],
                    completions: 0,
                    ready_epoch: 0,
                    passes: 0,
                    ready_fd,
                    qp_error_every: crate::fault::rdma_qp_error_every(),
                    frames_written: 0,
                    // Spread restarts over the range, so a restarted rdsd does not reuse the
                    // ports of its previous incarnation's QPs, and the poll threads apart, so
                    // that they do not take turns finding each other's ports in use.
                    next_port: 49152
                        + ((std::process::id() as usize + shard * 2003) % 16000) as u16,
                    zero_copy: cfg.zero_copy,
                    regions: Vec::new(),
                    foreign: RegionReplica::default(),
                    foreign_min,
                    shared: shared.clone(),
                    devices,
                })
            })
            .collect()
    }

    fn insert(&mut self, c: Conn) -> std::io::Result<usize> {
        let b = Box::new(c);
        if let Some(i) = self.conns.iter().position(Option::is_none) {
            self.conns[i] = Some(b);
            Ok(i)
        } else if self.conns.len() < MAX_CONNS {
            self.conns.push(Some(b));
            self.touched
                .reserve(self.conns.len().saturating_sub(self.touched.len()));
            Ok(self.conns.len() - 1)
        } else {
            Err(std::io::Error::other("rdma: too many paths"))
        }
    }

    fn new_conn(
        &mut self,
        role: Role,
        cm: verbs::CmId,
        laddr: u32,
        faddr: u32,
        now: Instant,
    ) -> Conn {
        self.gen = self.gen.wrapping_add(1).max(1);
        Conn {
            gen: self.gen,
            role,
            cm,
            qp: None,
            laddr,
            faddr,
            peer_port: 0,
            flow: PathFlow::new(now),
            touched: false,
            reported_up: false,
            acked_reported: 0,
        }
    }

    /// Starts a connection; for a path, from a source port with `port % 8 == path`
    /// (SPORT_IDX: the peer maps the QP to its path by that port, so a reconnect of several
    /// paths at once can never pair them differently on the two sides).
    fn start(
        &mut self,
        role: Role,
        laddr: u32,
        faddr: u32,
        path: Option<usize>,
    ) -> std::io::Result<usize> {
        self.moved();
        let mut tries = 0;
        loop {
            let sport = path.map_or(0, |k| self.source_port(k));
            let id = self.cm.create_id()?;
            let c = self.new_conn(role, id, laddr, faddr, Instant::now());
            let i = self.insert(c)?;
            let c = self.conns[i].as_mut().expect("just inserted");
            c.cm.set_context(CmContext {
                shard: self.shard,
                idx: i,
                gen: c.gen,
            });
            match c
                .cm
                .resolve_addr(laddr, sport, faddr, self.port, RESOLVE_MS)
            {
                Ok(()) => return Ok(i),
                Err(e) => {
                    self.destroy(i);
                    tries += 1;
                    if sport == 0 || e.kind() != std::io::ErrorKind::AddrInUse || tries >= 64 {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The next source port for `path` in the ephemeral range, with `port % 8 == path`.
    fn source_port(&mut self, path: usize) -> u16 {
        loop {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { 49152 } else { p + 1 };
            if usize::from(p) % 8 == path % 8 {
                return p;
            }
        }
    }

    fn conn(&mut self, p: &RdmaPath) -> Option<&mut Conn> {
        self.conns
            .get_mut(p.idx)
            .and_then(|c| c.as_deref_mut())
            .filter(|c| c.gen == p.gen)
    }

    fn destroy(&mut self, i: usize) {
        self.moved();
        if let Some(c) = self.conns.get_mut(i).and_then(Option::take) {
            // Also after a QP error: the DREQ tells the peer, whose QP may not have noticed
            // (it sees an error only when it sends), to take its side of the path down too.
            if c.qp.is_some() {
                c.cm.disconnect();
            }
            drop(c);
        }
        self.accepted.retain(|&a| a != i);
    }

    /// Creates path `i`'s QP and its resources on its device (growing the device's CQ to hold
    /// every QP's completions) and posts every receive buffer.
    fn setup_qp(&mut self, i: usize) -> std::io::Result<()> {
        let (recv_n, send_n) = (self.recv_n, self.send_n);
        let c = self.conns[i].as_deref().expect("a live path");
        let ctx = Qp::device_of(&c.cm)?;
        let k = match self.devices.iter().position(|d| d.context() == ctx) {
            Some(k) => k,
            None => {
                // A device that appeared after start: the PD on it, and this thread's app
                // regions on that (published again with the new keys).
                let d = Device::open(ctx, &self.shared.pds)?;
                for r in self.regions.iter_mut() {
                    r.register(&d);
                    self.shared.regions.publish(r.keys());
                }
                self.devices.push(d);
                self.devices.len() - 1
            }
        };
        // Room for every QP on the device, this one, and one more QP's worth for completions a
        // destroyed QP may have left behind until the next pass drains them.
        let on_device = self
            .conns
            .iter()
            .flatten()
            .filter(|c| c.qp.as_ref().is_some_and(|q| q.context() == ctx))
            .count();
        let per_qp = Qp::completions_needed(recv_n, send_n);
        let dev = &mut self.devices[k];
        dev.cq_for((on_device + 2) * per_qp)?;
        let dev = &self.devices[k];
        let cq = dev.cq().expect("made above");
        let c = self.conns[i].as_deref_mut().expect("a live path");
        let mut qp = Qp::new(&c.cm, dev, cq, recv_n, send_n, tag(i, c.gen))?;
        c.flow.attach(&mut qp, recv_n, send_n)?;
        c.qp = Some(qp);
        Ok(())
    }

    /// Hands one completion (still tagged) to its path's flow; a completion of a path that is
    /// gone (its QP destroyed) is dropped.
    fn dispatch(&mut self, wc: flow::Completion) {
        let (i, gen, wr_id) = untag(wc.wr_id);
        let Some(c) = self
            .conns
            .get_mut(i)
            .and_then(|c| c.as_deref_mut())
            .filter(|c| c.gen & 0x7fff == gen && c.qp.is_some())
        else {
            return;
        };
        c.flow.on_completion(flow::Completion { wr_id, ..wc });
        self.completions += 1;
        if !c.touched {
            c.touched = true;
            self.touched.push(i);
        }
    }

    /// Handles every rdma_cm event the event thread has handed over (no syscall).
    fn poll_cm(&mut self) -> usize {
        let mut n = 0;
        while let Some(ev) = self.events.pop() {
            n += 1;
            self.handle_cm(ev);
        }
        if n > 0 {
            self.moved();
        }
        n
    }

    /// Some path may have become ready (see `ready_epoch`).
    fn moved(&mut self) {
        self.ready_epoch = self.ready_epoch.wrapping_add(1);
    }

    fn handle_cm(&mut self, ev: CmEvent) {
        tracing::debug!(kind = ?ev.kind, status = ev.status, context = ?ev.context, "rdma: cm event");
        if ev.kind == CmEventKind::ConnectRequest {
            self.on_connect_request(ev);
            return;
        }
        let Some(CmContext { idx: i, gen, shard }) = ev.context else {
            return;
        };
        debug_assert_eq!(
            shard, self.shard,
            "the event thread routes by the id's owner"
        );
        let recv_n = self.recv_n;
        let Some(c) = self.conns.get_mut(i).and_then(|c| c.as_deref_mut()) else {
            return;
        };
        if c.gen != gen {
            return;
        }
        match ev.kind {
            CmEventKind::AddrResolved => {
                if c.cm.resolve_route(RESOLVE_MS).is_err() {
                    c.flow.kill();
                }
            }
            CmEventKind::RouteResolved => {
                let ok = self.setup_qp(i).and_then(|()| {
                    let c = self.conns[i].as_deref().expect("a live path");
                    let pd = PrivData::new(c.laddr, c.faddr, 0, recv_n).encode();
                    c.cm.connect(&pd)
                });
                if let Err(e) = ok {
                    tracing::info!(error = %e, "rdma: connect failed");
                    if let Some(c) = self.conns[i].as_deref_mut() {
                        c.flow.kill();
                    }
                }
            }
            CmEventKind::Established => {
                if c.role == Role::Active || c.role == Role::Doorbell {
                    match ev.private.as_deref().and_then(PrivData::decode) {
                        Some(p) if p.compatible() => c.flow.peer_credits(Some(p.credit), recv_n),
                        // A peer that sends no private data: assume what we granted.
                        None => c.flow.peer_credits(None, recv_n),
                        Some(p) => {
                            tracing::warn!(
                                major = p.major,
                                minor = p.minor,
                                "rdma: incompatible peer version"
                            );
                            c.flow.kill();
                            return;
                        }
                    }
                }
                c.flow.established(Instant::now());
                if c.role == Role::PassivePending {
                    c.role = Role::Passive;
                    self.accepted.push_back(i);
                }
                if c.role == Role::Doorbell {
                    // An rdsd peer rejects doorbells at the CM level; this peer accepted a
                    // connect from the larger address, as the kernel's RDS/IB does (there,
                    // whoever has traffic connects). Tearing it down would drop the peer's
                    // only connection: keep it as the path, as if it were accepted.
                    tracing::info!(peer = %std::net::Ipv4Addr::from(c.faddr), "rdma: the peer accepted our doorbell: keeping it as the path");
                    c.role = Role::Passive;
                    self.accepted.push_back(i);
                }
            }
            CmEventKind::Disconnected
            | CmEventKind::Rejected
            | CmEventKind::Unreachable
            | CmEventKind::AddrError
            | CmEventKind::RouteError
            | CmEventKind::ConnectError
            | CmEventKind::DeviceRemoval => {
                tracing::info!(kind = ?ev.kind, status = ev.status, role = ?c.role, peer = %std::net::Ipv4Addr::from(c.faddr), "rdma: path event");
                let doorbell = c.role == Role::Doorbell || c.role == Role::PassivePending;
                c.flow.kill();
                if doorbell {
                    self.destroy(i);
                }
            }
            CmEventKind::Other => {}
            CmEventKind::ConnectRequest => unreachable!(),
        }
    }

    fn on_connect_request(&mut self, ev: CmEvent) {
        let Some(id) = ev.new_id else { return };
        let pd = ev.private.as_deref().and_then(PrivData::decode);
        let Some(pd) = pd.filter(PrivData::compatible) else {
            tracing::info!(?pd, "rdma: rejecting a connection with an unknown version");
            id.reject(wire::REJ_INCOMPAT);
            return;
        };
        // The peer connects to us while we hold established paths to it: it lost its side (a
        // QP error it saw and we did not: an RC QP notices only when it sends, and its DREQ
        // may have been lost with the link). This is its doorbell (we connect) or its
        // reconnect (we accept). Take ours down so that the protocol layer reconnects, or
        // accepts the peer's next try, and retransmits. A path established within the last
        // second is spared (a doorbell that crossed our connect). With several paths all of
        // them go: the request does not say which path it replaces.
        let now = Instant::now();
        for c in self.conns.iter_mut().flatten() {
            if matches!(c.role, Role::Active | Role::Passive)
                && c.flow.stale(now)
                && (c.laddr, c.faddr) == (pd.daddr, pd.saddr)
            {
                tracing::info!(peer = %std::net::Ipv4Addr::from(c.faddr), "rdma: the peer reconnects: dropping our stale path");
                c.flow.kill();
            }
        }
        let peer_port = id.peer_port();
        if pd.saddr > pd.daddr {
            // A doorbell: the peer has the larger address, so we connect. Rejected at the CM
            // level (the peer gets no QP), and handed to the protocol layer as a dead accepted
            // path, whose refusal (we are the side that connects) starts our connect.
            id.reject(wire::REJ_DOORBELL);
            let mut c = self.new_conn(Role::Passive, id, pd.daddr, pd.saddr, now);
            c.flow.kill();
            c.peer_port = peer_port;
            let Ok(i) = self.insert(c) else { return };
            let c = self.conns[i].as_mut().expect("just inserted");
            c.cm.set_context(CmContext {
                shard: self.shard,
                idx: i,
                gen: c.gen,
            });
            self.accepted.push_back(i);
            return;
        }
        let c = self.new_conn(Role::PassivePending, id, pd.daddr, pd.saddr, now);
        let Ok(i) = self.insert(c) else {
            tracing::warn!("rdma: too many paths: refusing a connection");
            return;
        };
        let recv_n = self.recv_n;
        let c = self.conns[i].as_mut().expect("just inserted");
        c.cm.set_context(CmContext {
            shard: self.shard,
            idx: i,
            gen: c.gen,
        });
        c.peer_port = peer_port;
        c.flow.peer_credits(Some(pd.credit), recv_n);
        let ok = self.setup_qp(i).and_then(|()| {
            let c = self.conns[i].as_deref().expect("a live path");
            let ours = PrivData::new(c.laddr, c.faddr, 0, recv_n).encode();
            c.cm.accept(&ours)
        });
        if let Err(e) = ok {
            tracing::info!(error = %e, "rdma: accept failed");
            self.destroy(i);
        }
    }
}

impl Link for RdmaLink {
    type Path = RdmaPath;
    type Payload = Payload;
    const SPORT_IDX: bool = true;
    // A posted SEND reads its payload (in place: the app's ring) until it completes.
    const READS_AFTER_WRITE: bool = true;
    const FRAMING: Framing = Framing::Message;

    fn payload(&mut self, bytes: MsgBytes<'_>) -> Payload {
        Payload::Copy(PoolBuf::copy_of(bytes))
    }

    fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    fn payload_in_place(&mut self, bytes: MsgBytes<'_>, region: u64) -> Option<Payload> {
        // Only from a region every device has registered (else `write` would have to copy):
        // this thread's, or (a message another thread forwarded) one that thread registered.
        let (p, len) = (bytes.as_ptr(), bytes.len());
        let ok = match self.regions.iter().find(|r| r.id == region) {
            Some(r) => r.mrs.len() == self.devices.len() && r.contains(p, len),
            None => {
                len >= self.foreign_min
                    && self.foreign.covers(
                        &self.shared.regions,
                        p,
                        len,
                        self.devices.iter().map(|d| d.context() as usize),
                    )
            }
        };
        ok.then(|| {
            // SAFETY: offered in place (`OutMsg::in_place`): the sender's poll core (this one,
            // or the one that forwarded it, holding it until our release note) keeps the
            // region mapped and the ring space unused until the message is released.
            Payload::InPlace(unsafe { InPlaceBytes::new(bytes) })
        })
    }

    fn region_attached(&mut self, id: u64, base: *const u8, len: usize) {
        if !self.zero_copy {
            return;
        }
        let mut r = Region {
            id,
            base: base as usize,
            len,
            mrs: Vec::new(),
        };
        for d in &self.devices {
            r.register(d);
        }
        self.shared.regions.publish(r.keys());
        self.regions.push(r);
    }

    fn region_detached(&mut self, id: u64) {
        // Every message from it was released (those other threads sent from it included), so
        // no send from it is in flight. Withdrawn before it is unmapped.
        self.shared.regions.withdraw(id);
        self.regions.retain(|r| r.id != id);
    }

    fn accept(&mut self) -> Option<Accepted<RdmaPath>> {
        self.poll_cm();
        let i = self.accepted.pop_front()?;
        self.moved();
        let c = self.conns[i].as_mut()?;
        c.reported_up = true;
        Some(Accepted {
            path: RdmaPath { idx: i, gen: c.gen },
            laddr: c.laddr,
            faddr: c.faddr,
            peer_port: c.peer_port,
        })
    }

    fn rdma_info(&self, p: &RdmaPath) -> Option<crate::seam::RdmaPathInfo> {
        let c = self
            .conns
            .get(p.idx)
            .and_then(|c| c.as_deref())
            .filter(|c| c.gen == p.gen && c.qp.is_some())?;
        let (src, dst) = c.cm.gids();
        // As `Qp::new` sized the QP.
        Some(crate::seam::RdmaPathInfo {
            src_gid: src.into(),
            dst_gid: dst.into(),
            max_send_wr: self.send_n + 1,
            max_recv_wr: self.recv_n,
            max_send_sge: 2,
        })
    }

    fn connect(&mut self, laddr: u32, faddr: u32, path: usize) -> std::io::Result<RdmaPath> {
        let idx = self.start(Role::Active, laddr, faddr, Some(path))?;
        let gen = self.conns[idx].as_ref().expect("started").gen;
        Ok(RdmaPath { idx, gen })
    }

    fn poll_connect(&mut self, p: &mut RdmaPath) -> ConnectPoll {
        self.poll_cm();
        let Some(c) = self.conn(p) else {
            return ConnectPoll::Failed;
        };
        match c.flow.state() {
            PathState::Connecting => ConnectPoll::Pending,
            PathState::Up => {
                c.reported_up = true;
                self.moved();
                ConnectPoll::Up
            }
            _ => ConnectPoll::Failed,
        }
    }

    fn doorbell(&mut self, laddr: u32, faddr: u32) {
        let _ = self.start(Role::Doorbell, laddr, faddr, None);
    }

    fn begin_pass(&mut self) {
        // Taken and put back empty, so its allocation is reused.
        let mut early = std::mem::take(&mut *self.early.borrow_mut());
        for wc in early.drain(..) {
            self.dispatch(wc);
        }
        *self.early.borrow_mut() = early;
        for k in 0..self.devices.len() {
            while let Some(cq) = self.devices[k].cq() {
                let got = cq.poll(&mut self.wcs);
                for j in 0..got {
                    let wc = self.wcs[j];
                    self.dispatch(wc);
                }
                if got < self.wcs.len() {
                    break;
                }
            }
        }
        // Move the flows that got completions forward: receives into frames, sends that
        // waited for credits, acks that are due. The others have nothing new.
        for n in 0..self.touched.len() {
            let i = self.touched[n];
            if let Some(c) = self.conns[i].as_deref_mut() {
                c.touched = false;
                if let Some(qp) = c.qp.as_mut() {
                    c.flow.progress(qp);
                }
            }
        }
        self.touched.clear();
        if self.completions > 0 {
            self.moved();
        }
    }

    fn ready_epoch(&self) -> Option<u64> {
        Some(self.ready_epoch)
    }

    fn path_ready(&self, p: &RdmaPath) -> bool {
        match self
            .conns
            .get(p.idx)
            .and_then(|c| c.as_deref())
            .filter(|c| c.gen == p.gen)
        {
            // Connecting, up but not yet reported, dead or gone: the endpoint's poll says
            // which.
            Some(c) if c.reported_up && c.flow.state() == PathState::Up => c.flow.has_frame(),
            _ => true,
        }
    }

    fn read<'a>(&'a mut self, p: &mut RdmaPath, _buf: &'a mut [u8]) -> Read<'a> {
        let Some(c) = self.conn(p) else {
            return Read::Closed;
        };
        let dead = c.flow.state() == PathState::Dead;
        match c.qp.as_mut().and_then(|qp| c.flow.read(qp)) {
            Some(frame) => Read::Data(frame),
            None if dead => Read::Closed,
            None => Read::WouldBlock,
        }
    }

    fn write(&mut self, p: &mut RdmaPath, slices: &[&[u8]]) -> Write {
        let (regions, foreign, shared) = (&self.regions, &mut self.foreign, &self.shared);
        let foreign_min = self.foreign_min;
        let Some(c) = self
            .conns
            .get_mut(p.idx)
            .and_then(|c| c.as_deref_mut())
            .filter(|c| c.gen == p.gen)
        else {
            return Write::Closed;
        };
        if c.flow.state() == PathState::Dead {
            return Write::Closed;
        }
        let Some(qp) = c.qp.as_mut() else {
            return Write::WouldBlock;
        };
        let hdr = slices[0];
        let payload: &[u8] = slices.get(1).copied().unwrap_or(&[]);
        debug_assert!(hdr.len() == HDR && slices.len() <= 2);
        // In place when the payload lies in an app region registered on this QP's device: one
        // of this thread's, or, for a large one, another thread's (a forwarded `SendRef`).
        let ctx = qp.context();
        let (at, len) = (payload.as_ptr(), payload.len());
        let lkey = match regions.iter().find(|r| r.contains(at, len)) {
            Some(r) => r.lkey(ctx),
            None if len >= foreign_min => foreign.lkey(&shared.regions, at, len, ctx as usize),
            None => None,
        };
        let n = match c.flow.write(qp, hdr, payload, lkey) {
            Write::Wrote(n) => n,
            other => return other,
        };
        // Resends do not count: an error on every N-th resend would fail each new QP again
        // before anything is acknowledged.
        let resend = hdr.len() >= HDR
            && rds_proto::wire::HeaderPacket::new_unchecked(&hdr[..HDR]).flags()
                & rds_proto::wire::flags::RETRANSMITTED
                != 0;
        if !resend {
            self.frames_written += 1;
        }
        if let Some(every) = self.qp_error_every {
            if !resend && self.frames_written.is_multiple_of(every) {
                let c = self.conns[p.idx].as_deref().expect("checked");
                if let Some(Err(e)) = c.qp.as_ref().map(Qp::force_error) {
                    tracing::warn!(error = %e, "rdma: test hook: ibv_modify_qp(ERR) failed");
                } else {
                    tracing::warn!(
                        frame = self.frames_written,
                        "rdma: test hook: QP forced into error"
                    );
                }
            }
        }
        Write::Wrote(n)
    }

    fn acked(&mut self, p: &RdmaPath, _written: u64) -> Option<u64> {
        let c = self.conn(p)?;
        // Released only once the peer has it and our send is complete (zero copy).
        c.acked_reported = c.flow.acked();
        Some(c.acked_reported)
    }

    fn read_done(&self, p: &RdmaPath) -> Option<u64> {
        self.conns
            .get(p.idx)
            .and_then(|c| c.as_deref())
            .filter(|c| c.gen == p.gen)
            .map(|c| c.flow.completed())
    }

    fn acks_may_have_moved(&self, p: &RdmaPath) -> bool {
        self.conns
            .get(p.idx)
            .and_then(|c| c.as_deref())
            .filter(|c| c.gen == p.gen)
            .is_none_or(|c| c.flow.acked() != c.acked_reported)
    }

    fn close(&mut self, p: RdmaPath, reset: bool) {
        if self.conn(&p).is_some() {
            if reset {
                tracing::debug!(idx = p.idx, "rdma: refusing a path");
            }
            self.destroy(p.idx);
        }
    }

    fn poll_aux(&mut self) -> usize {
        let work = self.poll_cm() + std::mem::take(&mut self.completions);
        self.passes = self.passes.wrapping_add(1);
        if !self.passes.is_multiple_of(HOUSEKEEPING_EVERY) {
            return work;
        }
        // Timeouts and the keepalive may kill a path below.
        self.moved();
        let now = Instant::now();
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_ref() else {
                continue;
            };
            let age = c.flow.age(now);
            if c.role == Role::Doorbell && age > DOORBELL_TTL {
                self.destroy(i);
                continue;
            }
            if c.flow.state() == PathState::Connecting && age > CONNECT_TIMEOUT {
                tracing::info!(role = ?c.role, peer = %std::net::Ipv4Addr::from(c.faddr), "rdma: connection timed out");
                if c.role == Role::PassivePending {
                    self.destroy(i);
                } else if let Some(c) = self.conns[i].as_mut() {
                    c.flow.kill();
                }
                continue;
            }
            if c.qp.is_some() && c.flow.state() == PathState::Up {
                let Some(c) = self.conns[i].as_deref_mut() else {
                    continue;
                };
                // The keepalive (`PathFlow::check_stall`); the protocol layer reconnects and
                // retransmits. Completions (paused paths' acks and credits included) were
                // handled by `begin_pass`.
                if c.flow.check_stall(now, false) {
                    tracing::info!(
                        peer = %std::net::Ipv4Addr::from(c.faddr),
                        flow = ?c.flow.snapshot(),
                        "rdma: no progress: path down"
                    );
                }
            }
        }
        work
    }

    fn park_fds(&self, out: &mut Vec<libc::pollfd>) {
        out.push(libc::pollfd {
            fd: self.events.fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        let mut early = self.early.borrow_mut();
        for cq in self.devices.iter().filter_map(Device::cq) {
            // Consume the channel's events, re-arm, then catch what completed meanwhile.
            cq.drain_channel();
            cq.arm();
            let mut wcs = [flow::Completion::default(); 16];
            loop {
                let got = cq.poll(&mut wcs);
                early.extend_from_slice(&wcs[..got]);
                if got < wcs.len() {
                    break;
                }
            }
            out.push(libc::pollfd {
                fd: cq.channel_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let cm_waiting = self.events.arm();
        if !early.is_empty() || cm_waiting {
            // Completions or rdma_cm events are waiting: do not sleep.
            out.push(libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.ready_fd),
                events: libc::POLLIN,
                revents: 0,
            });
        }
    }
}

/// An app region registered on every device (zero copy).
struct Region {
    id: u64,
    base: usize,
    len: usize,
    /// (device, its registration): the lkey of a send from this region.
    mrs: Vec<(*mut verbs_sys::ibv_context, Mr)>,
}

// SAFETY: the context pointers are only compared, never dereferenced here; the MRs are Send.
unsafe impl Send for Region {}

impl Region {
    fn register(&mut self, d: &Device) {
        match Mr::register(d, self.base as *const u8, self.len) {
            Ok(mr) => self.mrs.push((d.context(), mr)),
            // Sends from it are copied on that device (payload_in_place declines).
            Err(e) => {
                tracing::warn!(error = %e, region = self.id, "rdma: app region not registered")
            }
        }
    }

    fn contains(&self, p: *const u8, len: usize) -> bool {
        let p = p as usize;
        p >= self.base && p + len <= self.base + self.len
    }

    /// Its keys, for the other threads (`regions.rs`).
    fn keys(&self) -> RegionKeys {
        RegionKeys {
            id: self.id,
            base: self.base,
            len: self.len,
            keys: self
                .mrs
                .iter()
                .map(|(c, m)| (*c as usize, m.lkey()))
                .collect(),
        }
    }

    fn lkey(&self, ctx: *mut verbs_sys::ibv_context) -> Option<u32> {
        self.mrs
            .iter()
            .find(|(c, _)| *c == ctx)
            .map(|(_, m)| m.lkey())
    }
}

#[cfg(test)]
mod tag_tests {
    use super::{flow, tag, untag, TAG_MASK};

    #[test]
    fn a_tag_names_the_path_and_leaves_the_flows_id_intact() {
        for (idx, gen) in [(0usize, 1u32), (7, 0x8001), (65_535, u32::MAX)] {
            for id in [0u64, 63, flow::SEND_TAG | 319, flow::ACK_WR_ID] {
                assert_eq!(id & TAG_MASK, 0, "the flow's ids leave the tag bits free");
                assert_eq!(untag(id | tag(idx, gen)), (idx, gen & 0x7fff, id));
            }
        }
    }
}

#[cfg(test)]
mod route_tests {
    use super::{route_event, CmContext, CmEvent, CmEventKind, ConnOwners, PrivData};

    fn ev(kind: CmEventKind, context: Option<CmContext>, private: Option<Vec<u8>>) -> CmEvent {
        CmEvent {
            kind,
            status: 0,
            context,
            new_id: None,
            private,
        }
    }

    #[test]
    fn events_go_to_the_thread_that_made_the_id_and_requests_to_the_connections_owner() {
        let owners = ConnOwners::with(3, true);
        let local = vec!["10.0.0.1/32".parse().unwrap()];
        let (me, a, b) = (0x0a00_0001u32, 0x0a00_0002u32, 0x0a00_0003u32);
        // An id's own events: its maker's thread, whatever the owners say.
        for shard in 0..3 {
            let c = CmContext {
                shard,
                idx: 9,
                gen: 4,
            };
            assert_eq!(
                route_event(
                    &ev(CmEventKind::Established, Some(c), None),
                    &owners,
                    &local
                ),
                shard
            );
        }
        // Requests from two peers: each to its connection's owner (placed by load), every
        // path's request for one connection to the same thread, as a send would place it.
        let req = |from: u32| {
            ev(
                CmEventKind::ConnectRequest,
                None,
                Some(PrivData::new(from, me, 0, 64).encode().to_vec()),
            )
        };
        let ka = route_event(&req(a), &owners, &local);
        let kb = route_event(&req(b), &owners, &local);
        assert_ne!(ka, kb, "two peers, two threads");
        assert_eq!(route_event(&req(a), &owners, &local), ka);
        assert_eq!(
            owners.owner(me, a),
            ka,
            "a send from here finds the same owner"
        );
        assert_eq!(owners.owner(me, b), kb);
        // A request for an address that is not ours, or without usable private data, goes to
        // thread 0 (which refuses it) and places nothing.
        let foreign = ev(
            CmEventKind::ConnectRequest,
            None,
            Some(PrivData::new(a, 0x0b00_0001, 0, 64).encode().to_vec()),
        );
        assert_eq!(route_event(&foreign, &owners, &local), 0);
        assert_eq!(
            route_event(
                &ev(CmEventKind::ConnectRequest, None, Some(vec![1, 2])),
                &owners,
                &local
            ),
            0
        );
        assert_eq!(
            route_event(&ev(CmEventKind::DeviceRemoval, None, None), &owners, &local),
            0
        );
        assert_eq!(
            owners.owner(me, 0x0a00_0004),
            3 - ka - kb,
            "the refused requests placed nothing: the third thread is still the least loaded"
        );
    }
}

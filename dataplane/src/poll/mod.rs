//! The poll core: a pinned thread that owns every socket, the bind table and the congestion
//! state. It drains the apps' tx rings, routes each message to a transport (loopback today),
//! fills rx rings, marks and clears congestion, and serves control commands that the control
//! thread forwards through a lock-free queue.
//!
//! Steady state makes no allocation, takes no lock and makes no syscall, except `futex_wake`
//! when an app thread announced it sleeps, and readiness-fd updates for sockets whose app asked
//! for a pollable fd (see `readiness`).

pub mod idle;
pub mod readiness;

use crate::config::Config;
use crate::shm::region::{wake_slot, AppRegion, DaemonRegion};
use crate::stats::Stats;
use crate::transport::loopback;
use crate::transport::tcp::TcpTransport;
use crate::transport::{NetTransport, OutMsg};
use crossbeam_queue::ArrayQueue;
use rds_proto::wire::CongMap;
use rustc_hash::FxHashMap;
use shm_api::ctrl::{Reply, Request};
use shm_api::layout::{
    cong_monitor_bit, DaemonView, SlotControl, CONG_ENTRIES, MAX_BUF, MAX_MSG_SIZE, MIN_BUF,
};
use shm_api::ring::{Consumer, Producer, RawRing, Record, RingMemory};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Records taken from one tx ring per pass, so one busy socket can't starve the others.
const TX_BATCH: usize = 64;
/// Outstanding RDS_CANCEL_SENT_TO markers per socket.
const MAX_CANCELS: usize = 8;

/// Work for the poll core, from the control thread.
pub enum Cmd {
    /// A new app and its region (index chosen by the control thread).
    Attach { app: usize, region: AppRegion },
    /// The app is gone: release everything and hand the region back.
    Detach { app: usize },
    /// A request from an attached app. `readiness` is set for SocketOpen.
    Request {
        app: usize,
        req: Request,
        readiness: Option<readiness::Readiness>,
    },
}

/// The poll core's answer to a [`Cmd`].
pub enum CmdReply {
    /// Answer to a Request.
    Reply(Reply),
    /// Answer to Detach: the region to unmap off the poll core.
    Detached(Option<AppRegion>),
    /// Answer to Attach.
    Attached,
}

/// Queues between the control thread and the poll core.
pub struct Channels {
    /// Control → poll.
    pub cmds: ArrayQueue<Cmd>,
    /// Poll → control.
    pub replies: ArrayQueue<CmdReply>,
    /// Apps the poll core evicted for breaking the ring protocol.
    pub evictions: ArrayQueue<usize>,
}

impl Channels {
    /// Bounded queues (commands are synchronous, so a few slots suffice).
    pub fn new(max_apps: usize) -> Channels {
        Channels {
            cmds: ArrayQueue::new(16),
            replies: ArrayQueue::new(16),
            evictions: ArrayQueue::new(max_apps.max(1)),
        }
    }
}

/// Where a socket lives: app index and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRef {
    /// Index in the app table.
    pub app: usize,
    /// Slot in that app's region.
    pub slot: u32,
}

#[derive(Clone, Copy)]
struct Cancel {
    dest: Option<(u32, u16)>,
    upto: u64,
}

/// rdsd's view of one socket.
pub struct Sock {
    gen: u32,
    pub(crate) tx: Consumer<RawRing>,
    pub(crate) rx: Producer<RawRing>,
    pub(crate) bound: Option<(u32, u16)>,
    pub(crate) rcvbuf: u32,
    sndbuf: u32,
    monitor: bool,
    released: u64,
    pub(crate) rx_produced: u64,
    pub(crate) congested: bool,
    cancels: [Cancel; MAX_CANCELS],
    ncancels: usize,
    readiness: Option<readiness::Readiness>,
    readiness_on: bool,
}

/// One attached process.
pub struct App {
    pub(crate) region: AppRegion,
    pub(crate) socks: Vec<Option<Sock>>,
    evicted: bool,
}

/// What happened to one message.
pub enum Outcome {
    /// Handed to the destination.
    Delivered,
    /// The destination can't take it now; keep it and retry.
    Blocked,
    /// Dropped (already counted).
    Dropped,
    /// Taken by a network transport; its bytes are released when the peer's TCP acknowledges.
    Queued,
}

/// The poll core's state.
pub struct PollCore {
    pub(crate) cfg: Arc<Config>,
    pub(crate) stats: Arc<Stats>,
    _daemon: Arc<DaemonRegion>,
    pub(crate) dview: DaemonView,
    pub(crate) apps: Vec<Option<App>>,
    pub(crate) binds: FxHashMap<(u32, u16), SockRef>,
    cong_entries: FxHashMap<u32, (usize, u32)>,
    pub(crate) congested: Vec<SockRef>,
    readiness_socks: Vec<SockRef>,
    chans: Arc<Channels>,
    control_wake: Arc<std::os::fd::OwnedFd>,
    rng: u64,
    next_gen: u32,
    pub(crate) net: Option<Box<dyn NetTransport>>,
    local_maps: FxHashMap<u32, CongMap>,
    empty_map: CongMap,
    cong_changed: Vec<u32>,
    passes: u32,
}

fn ip(a: u32) -> Ipv4Addr {
    Ipv4Addr::from(a)
}

impl PollCore {
    /// A poll core with no apps.
    pub fn new(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        daemon: Arc<DaemonRegion>,
        chans: Arc<Channels>,
        control_wake: Arc<std::os::fd::OwnedFd>,
    ) -> std::io::Result<PollCore> {
        let max_apps = cfg.max_apps as usize;
        let dview = daemon.view();
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let net = TcpTransport::new(&cfg)?.map(|t| Box::new(t) as Box<dyn NetTransport>);
        Ok(PollCore {
            cfg,
            stats,
            _daemon: daemon,
            dview,
            apps: (0..max_apps).map(|_| None).collect(),
            binds: FxHashMap::default(),
            cong_entries: FxHashMap::default(),
            congested: Vec::with_capacity(1024),
            readiness_socks: Vec::with_capacity(1024),
            chans,
            control_wake,
            rng: seed | 1,
            next_gen: 1,
            net,
            local_maps: FxHashMap::default(),
            empty_map: CongMap::new(),
            cong_changed: Vec::with_capacity(256),
            passes: 0,
        })
    }

    /// One pass over everything. Returns the amount of work done (0 = idle).
    pub fn run_once(&mut self) -> usize {
        let mut work = 0;
        while let Some(cmd) = self.chans.cmds.pop() {
            let reply = self.handle_cmd(cmd);
            // The control thread waits for exactly one reply per command.
            let _ = self.chans.replies.push(reply);
            work += 1;
        }
        for a in 0..self.apps.len() {
            let nslots = match &self.apps[a] {
                Some(app) if !app.evicted => app.socks.len() as u32,
                _ => continue,
            };
            for slot in 0..nslots {
                work += self.drain_tx(SockRef { app: a, slot });
            }
        }
        if !self.congested.is_empty() {
            work += self.check_congested();
        }
        if let Some(mut tcp) = self.net.take() {
            work += tcp.poll(self);
            for addr in self.cong_changed.drain(..) {
                tcp.local_congestion_changed(addr);
            }
            self.passes = self.passes.wrapping_add(1);
            if self.passes % 256 == 0 {
                tcp.publish_counters(&self.stats);
            }
            self.net = Some(tcp);
        } else {
            self.cong_changed.clear();
        }
        if !self.readiness_socks.is_empty() {
            self.sync_readiness();
        }
        work
    }

    fn sock(&mut self, r: SockRef) -> Option<&mut Sock> {
        self.apps
            .get_mut(r.app)?
            .as_mut()?
            .socks
            .get_mut(r.slot as usize)?
            .as_mut()
    }

    fn ctl(&self, r: SockRef) -> &SlotControl {
        self.apps[r.app]
            .as_ref()
            .expect("live app")
            .region
            .slot_control(r.slot)
    }

    /// Moves up to TX_BATCH messages off one socket's tx ring.
    fn drain_tx(&mut self, from: SockRef) -> usize {
        let mut done = 0;
        while done < TX_BATCH {
            let Some(s) = self.sock(from) else {
                return done;
            };
            let pos = s.tx.position();
            s.ncancels = prune_cancels(&mut s.cancels, s.ncancels, pos);
            let rec = match s.tx.peek() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    self.evict(from.app, e.0);
                    return done;
                }
            };
            if rec.header.len as usize > MAX_MSG_SIZE {
                self.evict(from.app, "message longer than 1 MiB");
                return done;
            }
            let dest = (rec.header.addr, rec.header.port);
            let cancelled = s.cancels[..s.ncancels]
                .iter()
                .any(|c| rec.end() <= c.upto && c.dest.is_none_or(|d| d == dest));
            let sender = s.bound;
            let outcome = if cancelled {
                Stats::bump(&self.stats.drop_cancelled);
                Outcome::Dropped
            } else if let Some(src) = sender {
                self.route(from, src, &rec)
            } else {
                Stats::bump(&self.stats.drop_unbound_sender);
                Outcome::Dropped
            };
            if let Outcome::Blocked = outcome {
                Stats::bump(&self.stats.rx_ring_full);
                break;
            }
            let s = self.sock(from).expect("sender still open");
            s.tx.consume(&rec);
            if !matches!(outcome, Outcome::Queued) {
                s.released += rec.header.len as u64;
            }
            done += 1;
        }
        if done > 0 {
            let s = self.sock(from).expect("sender open");
            s.tx.release();
            let released = s.released;
            let ctl = self.ctl(from);
            ctl.tx_released_bytes.store(released, Ordering::Release);
            wake_slot(ctl);
        }
        done
    }

    /// Picks the transport for one message.
    fn route(&mut self, from: SockRef, src: (u32, u16), rec: &Record) -> Outcome {
        let dest = ip(rec.header.addr);
        if self.cfg.is_local(dest) {
            return loopback::deliver(self, from, src, rec);
        }
        if self.net.as_ref().is_some_and(|n| n.routes_to(dest)) {
            let Some(mut tcp) = self.net.take() else {
                unreachable!()
            };
            let len = rec.header.len as usize;
            let app = self.apps[from.app].as_ref().expect("sender app");
            let ring = app.region.tx_ring(from.slot);
            let gen = app.socks[from.slot as usize].as_ref().map_or(0, |s| s.gen);
            // SAFETY: the ring consumer validated payload_offset + len against the data area;
            // the slice lives only for this call, while the region stays mapped.
            let payload =
                unsafe { std::slice::from_raw_parts(ring.data_ptr().add(rec.payload_offset), len) };
            let token = token_of(from, gen);
            let msg = OutMsg {
                laddr: src.0,
                faddr: rec.header.addr,
                sport: src.1,
                dport: rec.header.port,
                payload,
                token,
            };
            let ok = tcp.send(self, msg);
            self.net = Some(tcp);
            return if ok {
                Outcome::Queued
            } else {
                Stats::bump(&self.stats.drop_no_route);
                Outcome::Dropped
            };
        }
        Stats::bump(&self.stats.drop_no_route);
        Outcome::Dropped
    }

    /// A network transport finished with a message (acknowledged or cancelled): give its
    /// bytes back to the sender's send buffer, unless that socket is gone.
    pub(crate) fn release_token(&mut self, token: u64, len: u64) {
        let (r, gen) = sock_of_token(token);
        let Some(s) = self.sock(r) else { return };
        if s.gen != gen {
            return;
        }
        s.released += len;
        let released = s.released;
        let ctl = self.ctl(r);
        ctl.tx_released_bytes.store(released, Ordering::Release);
        wake_slot(ctl);
    }

    /// A message from a peer for `laddr:dport`.
    pub(crate) fn deliver_remote(
        &mut self,
        laddr: u32,
        faddr: u32,
        sport: u16,
        dport: u16,
        payload: &[u8],
    ) {
        let Some(&to) = self.binds.get(&(laddr, dport)) else {
            Stats::bump(&self.stats.drop_unbound_dest);
            return;
        };
        let Some(app) = self.apps[to.app].as_mut() else {
            return;
        };
        let Some(sock) = app.socks[to.slot as usize].as_mut() else {
            return;
        };
        match sock
            .rx
            .push(shm_api::ring::RecordHeader::data(0, faddr, sport), payload)
        {
            Ok(()) => {
                sock.rx.publish();
                sock.rx_produced += payload.len() as u64;
                let produced = sock.rx_produced;
                let ctl = app.region.slot_control(to.slot);
                ctl.rx_produced_bytes.store(produced, Ordering::Release);
                wake_slot(ctl);
                Stats::bump(&self.stats.tcp_delivered);
                self.after_enqueue(to);
            }
            Err(_) => Stats::bump(&self.stats.drop_rx_ring_full),
        }
    }

    /// Our current congestion map for a local address (all clear if none is bound there).
    pub(crate) fn local_map(&self, addr: u32) -> &CongMap {
        self.local_maps.get(&addr).unwrap_or(&self.empty_map)
    }

    /// Copies a peer's congestion map into the daemon region, where senders test it.
    pub(crate) fn mirror_peer_map(
        &mut self,
        faddr: u32,
        bytes: &[u8; shm_api::layout::CONG_MAP_BYTES],
    ) {
        let Some(&(idx, _)) = self.cong_entries.get(&faddr) else {
            return;
        };
        for (w, chunk) in self.dview.map(idx).iter().zip(bytes.chunks_exact(8)) {
            w.store(
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                Ordering::Release,
            );
        }
        self.dview.header().cong_seq.fetch_add(1, Ordering::Release);
    }

    /// A peer cleared congestion on ports `mask` (bit = port % 64): wake senders, tell monitors.
    pub(crate) fn remote_uncongested(&mut self, mask: u64) {
        self.notify_uncongested(mask);
    }

    /// After a message was queued on `to`: mark its port congested above SO_RCVBUF.
    pub(crate) fn after_enqueue(&mut self, to: SockRef) {
        let consumed = self.ctl(to).rx_consumed_bytes.load(Ordering::Acquire);
        let s = self.sock(to).expect("receiver open");
        let queued = s.rx_produced.saturating_sub(consumed);
        if queued > s.rcvbuf as u64 && !s.congested {
            s.congested = true;
            let (addr, port) = s.bound.expect("receivers are bound");
            self.set_cong_bit(addr, port, true);
            self.congested.push(to);
            Stats::bump(&self.stats.cong_marked);
        }
    }

    fn set_cong_bit(&mut self, addr: u32, port: u16, on: bool) {
        let map = self.local_maps.entry(addr).or_default();
        map.set_congested(port, on);
        // Recorded even while the transport is taken out for its own poll (deliveries from the
        // network mark ports then); the map goes out after that poll.
        if !self.cong_changed.contains(&addr) {
            self.cong_changed.push(addr);
        }
        if let Some(&(idx, _)) = self.cong_entries.get(&addr) {
            let word = &self.dview.map(idx)[port as usize / 64];
            if on {
                word.fetch_or(1 << (port % 64), Ordering::AcqRel);
            } else {
                word.fetch_and(!(1 << (port % 64)), Ordering::AcqRel);
            }
            self.dview.header().cong_seq.fetch_add(1, Ordering::Release);
        }
    }

    /// Clears congestion on ports whose queue fell below half of SO_RCVBUF.
    fn check_congested(&mut self) -> usize {
        let mut cleared = 0;
        let mut i = 0;
        while i < self.congested.len() {
            let r = self.congested[i];
            let below = match self
                .apps
                .get(r.app)
                .and_then(|a| a.as_ref())
                .and_then(|a| a.socks[r.slot as usize].as_ref())
            {
                Some(s) => {
                    let consumed = self.ctl(r).rx_consumed_bytes.load(Ordering::Acquire);
                    s.rx_produced.saturating_sub(consumed) < (s.rcvbuf / 2) as u64
                }
                None => true,
            };
            if below {
                self.congested.swap_remove(i);
                if let Some(s) = self.sock(r) {
                    s.congested = false;
                    let (addr, port) = s.bound.expect("bound");
                    self.uncongest(addr, port);
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
        self.notify_uncongested(cong_monitor_bit(port));
    }

    /// Wakes every blocked app thread and posts `bit` to monitors that asked for it.
    fn notify_uncongested(&mut self, bit: u64) {
        for a in self.apps.iter().flatten().filter(|a| !a.evicted) {
            for (slot, s) in a.socks.iter().enumerate() {
                let Some(s) = s else { continue };
                let ctl = a.region.slot_control(slot as u32);
                if s.monitor {
                    let hit = ctl.cong_interest.load(Ordering::Acquire) & bit;
                    if hit != 0 {
                        ctl.cong_interest.fetch_and(!hit, Ordering::AcqRel);
                        ctl.cong_notify.fetch_or(hit, Ordering::AcqRel);
                        Stats::bump(&self.stats.cong_notifications);
                    }
                }
                wake_slot(ctl);
            }
        }
    }

    fn sync_readiness(&mut self) {
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
            let writable = sent.wrapping_sub(s.released) < s.sndbuf as u64;
            // Positions, not byte counts: zero-length messages count too.
            let rx = s.rx.memory();
            let pending =
                rx.producer().load(Ordering::Relaxed) != rx.consumer().load(Ordering::Acquire);
            let readable = pending || (s.monitor && ctl.cong_notify.load(Ordering::Acquire) != 0);
            if let Some(rd) = s.readiness.as_mut() {
                rd.sync(readable, writable);
            }
        }
    }

    fn evict(&mut self, app: usize, why: &'static str) {
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
        self.release_app_sockets(app);
        let _ = self.chans.evictions.push(app);
        shm_api::sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&*self.control_wake));
    }

    fn release_app_sockets(&mut self, app: usize) {
        let n = self.apps[app].as_ref().map_or(0, |a| a.socks.len());
        for slot in 0..n {
            self.close_sock(SockRef {
                app,
                slot: slot as u32,
            });
        }
    }

    fn close_sock(&mut self, r: SockRef) {
        // A send that returned success is delivered even if the sender closes (or exits) right
        // after it: move what can still move before the socket goes.
        if self
            .apps
            .get(r.app)
            .and_then(|a| a.as_ref())
            .is_some_and(|a| !a.evicted)
        {
            while self.drain_tx(r) > 0 {}
        }
        let Some(app) = self.apps.get_mut(r.app).and_then(|a| a.as_mut()) else {
            return;
        };
        let Some(mut s) = app.socks[r.slot as usize].take() else {
            return;
        };
        // Whatever the app queued and rdsd never took dies with the socket.
        while let Ok(Some(rec)) = s.tx.peek() {
            s.tx.consume(&rec);
            Stats::bump(&self.stats.drop_socket_closed);
        }
        Stats::bump(&self.stats.sockets_closed);
        self.readiness_socks.retain(|x| *x != r);
        if s.congested {
            self.congested.retain(|x| *x != r);
        }
        if let Some(b) = s.bound {
            self.binds.remove(&b);
            if s.congested {
                self.uncongest(b.0, b.1);
            }
            self.unref_cong_entry(b.0);
        }
    }

    pub(crate) fn ref_cong_entry(&mut self, addr: u32) -> Result<(), i32> {
        if let Some(e) = self.cong_entries.get_mut(&addr) {
            e.1 += 1;
            return Ok(());
        }
        let used: Vec<usize> = self.cong_entries.values().map(|e| e.0).collect();
        let idx = (0..CONG_ENTRIES)
            .find(|i| !used.contains(i))
            .ok_or(libc::ENOBUFS)?;
        for w in self.dview.map(idx) {
            w.store(0, Ordering::Relaxed);
        }
        self.dview.entry(idx).addr.store(addr, Ordering::Release);
        self.cong_entries.insert(addr, (idx, 1));
        Ok(())
    }

    fn unref_cong_entry(&mut self, addr: u32) {
        if let Some(e) = self.cong_entries.get_mut(&addr) {
            e.1 -= 1;
            if e.1 == 0 {
                let idx = e.0;
                self.cong_entries.remove(&addr);
                self.local_maps.remove(&addr);
                self.dview.entry(idx).addr.store(0, Ordering::Release);
            }
        }
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64: only used to pick the start of the free-port search.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn handle_cmd(&mut self, cmd: Cmd) -> CmdReply {
        match cmd {
            Cmd::Attach { app, region } => {
                let n = region.geometry().max_sockets as usize;
                self.apps[app] = Some(App {
                    region,
                    socks: (0..n).map(|_| None).collect(),
                    evicted: false,
                });
                Stats::bump(&self.stats.apps_attached);
                CmdReply::Attached
            }
            Cmd::Detach { app } => {
                self.release_app_sockets(app);
                Stats::bump(&self.stats.apps_detached);
                CmdReply::Detached(
                    self.apps
                        .get_mut(app)
                        .and_then(|a| a.take())
                        .map(|a| a.region),
                )
            }
            Cmd::Request {
                app,
                req,
                readiness,
            } => CmdReply::Reply(match self.handle_request(app, req, readiness) {
                Ok(v) => Reply::ok(v),
                Err(e) => Reply::err(e),
            }),
        }
    }

    fn live_sock(&mut self, app: usize, slot: u32) -> Result<SockRef, i32> {
        let r = SockRef { app, slot };
        match self.sock(r) {
            Some(_) => Ok(r),
            None => Err(libc::EBADF),
        }
    }

    fn handle_request(
        &mut self,
        app: usize,
        req: Request,
        readiness: Option<readiness::Readiness>,
    ) -> Result<u64, i32> {
        match self.apps.get(app).and_then(|a| a.as_ref()) {
            Some(a) if !a.evicted => {}
            _ => return Err(libc::ECONNRESET),
        }
        match req {
            Request::Hello { .. } | Request::Stats => Err(libc::EINVAL),
            Request::SocketOpen => {
                let a = self.apps[app].as_mut().expect("checked");
                let slot = a
                    .socks
                    .iter()
                    .position(|s| s.is_none())
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
                    rx_produced: 0,
                    congested: false,
                    cancels: [Cancel {
                        dest: None,
                        upto: 0,
                    }; MAX_CANCELS],
                    ncancels: 0,
                    readiness,
                    readiness_on: false,
                });
                Stats::bump(&self.stats.sockets_opened);
                Ok(slot as u64)
            }
            Request::Bind { slot, addr, port } => {
                let r = self.live_sock(app, slot)?;
                if addr.is_unspecified() || addr.is_broadcast() || addr.is_multicast() || port == 1
                {
                    return Err(libc::EINVAL);
                }
                if self.sock(r).expect("live").bound.is_some() {
                    return Err(libc::EINVAL);
                }
                if !self.cfg.is_local(addr) {
                    return Err(libc::EADDRNOTAVAIL);
                }
                let a = u32::from(addr);
                let port = if port == 0 { self.free_port(a)? } else { port };
                if self.binds.contains_key(&(a, port)) {
                    return Err(libc::EADDRINUSE);
                }
                self.ref_cong_entry(a)?;
                self.binds.insert((a, port), r);
                self.sock(r).expect("live").bound = Some((a, port));
                Ok(port as u64)
            }
            Request::SetRcvBuf { slot, bytes } => {
                let r = self.live_sock(app, slot)?;
                self.sock(r).expect("live").rcvbuf = bytes.clamp(MIN_BUF, MAX_BUF);
                Ok(0)
            }
            Request::SetSndBuf { slot, bytes } => {
                let r = self.live_sock(app, slot)?;
                self.sock(r).expect("live").sndbuf = bytes.clamp(MIN_BUF, MAX_BUF);
                Ok(0)
            }
            Request::SetCongMonitor { slot, on } => {
                let r = self.live_sock(app, slot)?;
                self.sock(r).expect("live").monitor = on;
                Ok(0)
            }
            Request::CancelSentTo { slot, dest } => {
                let r = self.live_sock(app, slot)?;
                let s = self.sock(r).expect("live");
                if s.bound.is_none() {
                    return Err(libc::ENOTCONN);
                }
                // Everything published so far is "already sent" from the app's point of view.
                // The producer position is app-written: a lie only cancels the liar's own messages.
                let upto = s.tx.memory().producer().load(Ordering::Acquire);
                if s.ncancels == MAX_CANCELS {
                    return Err(libc::EAGAIN);
                }
                let n = s.ncancels;
                let dest = dest.map(|(a, p)| (u32::from(a), p));
                s.cancels[n] = Cancel { dest, upto };
                s.ncancels += 1;
                let (laddr, sport) = s.bound.expect("checked");
                if let Some(tcp) = self.net.as_mut() {
                    tcp.cancel(laddr, sport, dest);
                }
                Ok(0)
            }
            Request::EnableReadiness { slot } => {
                let r = self.live_sock(app, slot)?;
                let s = self.sock(r).expect("live");
                if s.readiness.is_none() {
                    return Err(libc::EBADF);
                }
                if !s.readiness_on {
                    s.readiness_on = true;
                    self.readiness_socks.push(r);
                }
                Ok(0)
            }
            Request::Close { slot } => {
                let r = self.live_sock(app, slot)?;
                self.close_sock(r);
                Ok(0)
            }
        }
    }

    fn free_port(&mut self, addr: u32) -> Result<u16, i32> {
        let start = 2 + (self.next_rand() % 65534) as u32;
        for i in 0..65534u32 {
            let p = (2 + (start - 2 + i) % 65534) as u16;
            if !self.binds.contains_key(&(addr, p)) {
                return Ok(p);
            }
        }
        Err(libc::EADDRINUSE)
    }
}

/// The token a network transport carries for a message: which socket (and which incarnation
/// of that slot) gets the bytes back when it is released.
fn token_of(r: SockRef, gen: u32) -> u64 {
    ((r.app as u64) << 44) | ((r.slot as u64 & 0xfff) << 32) | gen as u64
}

fn sock_of_token(t: u64) -> (SockRef, u32) {
    (
        SockRef {
            app: (t >> 44) as usize,
            slot: ((t >> 32) & 0xfff) as u32,
        },
        t as u32,
    )
}

/// Drops cancel markers the consumer has moved past; returns the new count.
fn prune_cancels(c: &mut [Cancel; MAX_CANCELS], n: usize, pos: u64) -> usize {
    let mut k = 0;
    for i in 0..n {
        if c[i].upto > pos {
            c[k] = c[i];
            k += 1;
        }
    }
    k
}

/// Runs the poll core until `shutdown`, waiting per the configured idle strategy.
pub fn run(mut core: PollCore, mut idle: idle::Idle, shutdown: Arc<AtomicBool>) {
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(256);
    while !shutdown.load(Ordering::Relaxed) {
        let work = core.run_once();
        if idle.idle(work) {
            // About to park: announce it, then look once more so no doorbell is missed.
            let dview = core.dview;
            let h = dview.header();
            h.poll_sleeping.store(1, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            let work = core.run_once();
            if work == 0 {
                Stats::bump(&core.stats.poll_parks);
                fds.clear();
                let mut timeout = None;
                if let Some(tcp) = &core.net {
                    // Counters are summed lazily; make them exact before sleeping.
                    tcp.publish_counters(&core.stats);
                    tcp.park_fds(&mut fds);
                    timeout = tcp.next_timeout();
                }
                idle.park(&mut fds, timeout);
            }
            h.poll_sleeping.store(0, Ordering::Relaxed);
            idle.reset();
        }
    }
}

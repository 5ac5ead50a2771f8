//! The poll core: a pinned thread that owns the socket table (`table.rs`: every socket, the
//! bind table and the congestion state) and a list of transports handed to it (`crate::seam`).
//! It drains the apps' tx rings, routes each message to the first transport that carries its
//! destination, runs each transport's I/O pass (transports reach the sockets only through
//! `seam::Upcalls`), clears congestion, and serves control commands that the control thread
//! forwards through a lock-free queue.
//!
//! Steady state makes no allocation, takes no lock and makes no syscall, except `futex_wake`
//! when an app thread announced it sleeps, and readiness-fd updates for sockets whose app asked
//! for a pollable fd (see `readiness`).

#[cfg(any(test, fuzzing))]
pub mod fuzzing;
pub mod idle;
mod inplace;
#[cfg(test)]
mod inplace_tests;
pub mod readiness;
pub mod rebind;
mod routes;
pub mod shard;
#[cfg(test)]
mod shard_tests;
pub mod snapshot;
mod sock_ref;
mod table;

use crate::config::Config;
use crate::group::wire::GROUP_PORT;
use crate::seam::{MsgBytes, OutMsg, SendOutcome, Transport};
use crate::shm::region::{AppRegion, DaemonRegion};
use crate::stats::Stats;
use crossbeam_queue::ArrayQueue;
use shm_api::ctrl::{Reply, Request};
use shm_api::layout::{MAX_BUF, MAX_MSG_SIZE, MIN_BUF};
use shm_api::ring::{Record, RingMemory};
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use table::{token_of, Cancel, Detached, MAX_CANCELS};
pub use table::{SockRef, SocketTable};

/// Records taken from one tx ring per pass, so one busy socket can't starve the others.
const TX_BATCH: usize = 64;

/// Commands taken from the control queue per pass (the queue is bounded too; this keeps one
/// pass short whatever the control thread queued).
const CMDS_PER_PASS: usize = 64;

/// Work for the poll core, from the control thread. Every command travels with a sequence
/// number (`seq`, unique for the life of rdsd) and its answer comes back with the same number
/// and app index, so the control thread matches answers to requests whatever order or delay
/// they come in.
pub enum Cmd {
    /// A new app, its region and rdsd's end of its doorbell (index chosen by the control
    /// thread). Withdrawable.
    Attach {
        app: usize,
        region: AppRegion,
        doorbell: OwnedFd,
        /// The app's uid (who may join the groups it creates).
        uid: u32,
    },
    /// The app is gone: release everything and hand the region back. Never withdrawn.
    Detach { app: usize },
    /// A request from an attached app. `readiness` is set for SocketOpen. Withdrawable.
    Request {
        app: usize,
        req: Request,
        readiness: Option<readiness::Readiness>,
    },
    /// Introspection for control connection `app` (attached or not): copy out sockets,
    /// connections and paths (`snapshot.rs`) of poll thread `shard`, with the queued messages
    /// listed if `messages`. Withdrawable.
    Snapshot {
        app: usize,
        shard: usize,
        messages: bool,
    },
}

impl Cmd {
    /// The app this command concerns.
    pub fn app(&self) -> usize {
        match *self {
            Cmd::Attach { app, .. }
            | Cmd::Detach { app }
            | Cmd::Request { app, .. }
            | Cmd::Snapshot { app, .. } => app,
        }
    }
}

/// The poll core's answer to a [`Cmd`].
pub enum CmdReply {
    /// Answer to a Request.
    Reply(Reply),
    /// Answer to Detach: the region to unmap off the poll core.
    Detached(Option<AppRegion>),
    /// Answer to Attach.
    Attached,
    /// The control thread withdrew the command before the poll core took it: nothing was done.
    /// A withdrawn Attach hands its region back, to be freed off the poll core.
    Withdrawn(Option<AppRegion>),
    /// Answer to Snapshot.
    Snapshot(Box<snapshot::PollSnapshot>),
}

/// Queues between the control thread and the poll threads (one command queue per shard).
///
/// Withdrawal: before queueing a withdrawable command the control thread *arms* its `seq` in
/// the app's claim word. The poll core *takes* a command by swapping that word from `seq` to 0
/// before doing anything; the control thread *withdraws* one that waited too long by the same
/// swap. Exactly one of them wins, so a command is either done (and its answer awaited, however
/// late) or provably not done (and its app told ETIMEDOUT).
pub struct Channels {
    /// Control → poll thread `k`: `cmds[k]`, (seq, command).
    pub cmds: Box<[ArrayQueue<(u64, Cmd)>]>,
    /// Poll threads → control: (seq, app, answer).
    pub replies: ArrayQueue<(u64, usize, CmdReply)>,
    /// Apps the poll core evicted for breaking the ring protocol.
    pub evictions: ArrayQueue<usize>,
    /// Per app index: the seq of its withdrawable command in flight, 0 if none.
    claims: Box<[AtomicU64]>,
}

impl Channels {
    /// Bounded queues: at most one request and one detach in flight per app slot, plus slack
    /// for withdrawn commands the poll core has yet to skip. The control thread never has more
    /// commands outstanding than `replies` holds, so no answer is ever lost.
    pub fn new(max_apps: usize) -> Channels {
        Channels::with_shards(max_apps, 1)
    }

    /// Channels for `shards` poll threads.
    pub fn with_shards(max_apps: usize, shards: usize) -> Channels {
        let cap = 2 * max_apps.max(1) + 16;
        Channels {
            cmds: (0..shards.max(1)).map(|_| ArrayQueue::new(cap)).collect(),
            replies: ArrayQueue::new(cap),
            evictions: ArrayQueue::new(max_apps.max(1)),
            claims: (0..max_apps.max(1)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Control side: `seq` is the withdrawable command of `app` about to be queued.
    pub fn arm(&self, app: usize, seq: u64) {
        self.claims[app].store(seq, Ordering::Release);
    }

    /// Control side: withdraws command `seq` of `app`; true if the poll core had not taken it
    /// (it never will), false if it has (its answer will come).
    pub fn withdraw(&self, app: usize, seq: u64) -> bool {
        self.claims[app]
            .compare_exchange(seq, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Poll side: takes command `seq` of `app`; false if it was withdrawn.
    fn take(&self, app: usize, seq: u64) -> bool {
        self.claims.get(app).is_some_and(|c| {
            c.compare_exchange(seq, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }
}

/// The poll core's state: its socket table and its transports.
pub struct PollCore {
    table: SocketTable,
    /// The table's counters too (a second handle: the loopback delivery counts beside a
    /// mutable borrow of the table).
    stats: Arc<Stats>,
    transports: Vec<Box<dyn Transport>>,
    /// Which of `transports` carries each recent destination.
    routes: routes::RouteCache,
    passes: u64,
    /// Tx rings looked into (`drain_tx` calls), published as `tx_ring_visits`.
    tx_visits: u64,
    /// `drain_fabric` calls, published as `fabric_drains`.
    fabric_drains: u64,
    /// Passes that found work (`poll_busy_passes`).
    busy_passes: u64,
    /// The last park ran out its safety timeout with no doorbell: a tx ring found published
    /// in the next pass is a doorbell its app did not ring (`parks_doorbell_missed`).
    silent_park: bool,
    /// The time of the last pass, if it read the clock (for the idle strategy).
    pass_time: Option<rds_proto::Instant>,
    /// TEST ONLY: `crate::fault::poll_stall` (`None` without the `fault-injection` feature).
    test_stall: Option<std::time::Duration>,
}

/// From this size on, a message for a socket of another poll thread crosses in place (its
/// bytes stay in the sender's tx ring until the receiving thread copied them): below it, the
/// copy into the pair ring costs less than the hold and the release note per message.
const CROSS_IN_PLACE_MIN: usize = 16 << 10;
/// The region id a forwarded in-place send carries (`OutMsg::in_place`): the bytes lie in an app
/// region of another poll thread, which this thread's transports were never told of.
const FOREIGN_REGION: u64 = u64::MAX;

/// What happened to one message taken off a tx ring.
enum Outcome {
    /// Its bytes are free now (delivered, or dropped and counted).
    Done,
    /// A transport holds it (a copy, or in place with its ring space held); its bytes come
    /// back through `Upcalls::release`.
    Queued,
    /// The destination can't take it now; leave it on the ring.
    Blocked,
}

impl PollCore {
    /// A poll core with no apps, driving `transports` (see `transport::build`).
    pub fn new(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        daemon: Arc<DaemonRegion>,
        chans: Arc<Channels>,
        control_wake: Arc<std::os::fd::OwnedFd>,
        transports: Vec<Box<dyn Transport>>,
    ) -> PollCore {
        let fabric = Arc::new(shard::Fabric::new(
            vec![Arc::new(shm_api::sys::eventfd().expect("eventfd"))],
            daemon.view(),
            shard::open_rebind(&cfg),
            Arc::new(crate::transport::ConnOwners::with(1, true)),
        ));
        PollCore::shard(
            cfg,
            stats,
            daemon,
            chans,
            control_wake,
            transports,
            fabric,
            0,
        )
    }

    /// Poll thread `shard` of several sharing `fabric` (shard 0 drives the transports; the
    /// others get loopback only).
    #[allow(clippy::too_many_arguments)]
    pub fn shard(
        cfg: Arc<Config>,
        stats: Arc<Stats>,
        daemon: Arc<DaemonRegion>,
        chans: Arc<Channels>,
        control_wake: Arc<std::os::fd::OwnedFd>,
        transports: Vec<Box<dyn Transport>>,
        fabric: Arc<shard::Fabric>,
        shard: usize,
    ) -> PollCore {
        for t in &transports {
            tracing::info!(transport = t.name(), shard, "transport ready");
        }
        PollCore {
            table: SocketTable::new(
                cfg,
                stats.clone(),
                daemon,
                chans,
                control_wake,
                fabric,
                shard,
            ),
            stats,
            transports,
            routes: routes::RouteCache::new(),
            passes: 0,
            tx_visits: 0,
            fabric_drains: 0,
            busy_passes: 0,
            silent_park: false,
            pass_time: None,
            test_stall: crate::fault::poll_stall(),
        }
    }

    /// The shared daemon region view (sleep flag).
    fn dview(&self) -> shm_api::layout::DaemonView {
        self.table.dview()
    }

    /// One pass over everything. Returns the amount of work done (0 = idle).
    pub fn run_once(&mut self) -> usize {
        // One clock reading serves the whole pass (the endpoints, smoltcp).
        let pass = crate::clock::PassTime::begin();
        let work = self.pass();
        self.busy_passes += u64::from(work > 0);
        self.pass_time = pass.end();
        work
    }

    /// The time of the last pass, if anything in it read the clock.
    pub fn pass_time(&self) -> Option<rds_proto::Instant> {
        self.pass_time
    }

    fn pass(&mut self) -> usize {
        let mut work = 0;
        // Messages parked at a full rx ring go first (`backlog.rs`).
        if self.table.has_backlog() {
            work += self.table.drain_backlogs();
        }
        if let Some(link) = self.table.link_mut() {
            link.refresh();
            link.waited_on_receiver = false;
            if link.inputs_idle() {
                // Most passes: nothing from any other shard (so nothing stalled either).
                link.stalled = 0;
                link.flush_release();
            } else {
                work += self.drain_fabric();
            }
        }
        let mut replies = 0;
        while work < CMDS_PER_PASS {
            let Some((seq, cmd)) = self.table.next_cmd() else {
                break;
            };
            let app = cmd.app();
            // `None`: shard 0 answers (a group request, see `forward_group_request`).
            if let Some(reply) = self.handle_cmd(seq, cmd) {
                self.reply(seq, app, reply);
                replies += 1;
            }
            work += 1;
        }
        // Only for answers: other work (a crossing message, a backlog) is no news for the
        // control thread, and this wake-up is a `write` (it was one per crossing message and
        // per release note: `tests/tests/quiet.rs`). Evictions and the group answers given in
        // `drain_fabric` wake it themselves.
        if replies > 0 {
            self.table.wake_control();
        }
        // Only open sockets whose app published: a pass costs a load per open socket, not a
        // scan of every slot of every app.
        let mut i = 0;
        let before_tx = work;
        while let Some((at, r)) = self.table.next_published(i) {
            i = at;
            if !self.table.is_evicted(r.app) {
                work += self.drain_tx(r);
            }
            // An eviction removes the app's sockets from the list: look at index i again.
            if self.table.open_sock_at(i) == Some(r) {
                self.table.mark_seen(i);
                i += 1;
            }
        }
        if std::mem::take(&mut self.silent_park) && work > before_tx {
            Stats::bump(&self.table.stats().parks_doorbell_missed);
        }
        work += self.table.check_congested();
        // The local deliveries' receivers and senders: woken before the transports run, with
        // one fence for every burst above.
        self.table.wake_pending();
        // Group messages for other hosts: those of this pass's sends before the transports
        // run (they go out in this pass), those their deliveries made after.
        if self.table.group_out_pending() {
            work += self.flush_group_out();
        }
        // Network receive publishes per read (the endpoint calls `publish_deliveries`), not
        // per message; what a transport leaves unpublished is published here.
        self.table.begin_rx_burst();
        for t in self.transports.iter_mut() {
            work += t.poll(&mut self.table);
        }
        self.table.end_rx_burst();
        if self.table.group_out_pending() {
            work += self.flush_group_out();
        }
        for addr in self.table.drain_cong_changed() {
            for t in self.transports.iter_mut() {
                t.local_congestion_changed(addr);
            }
        }
        for id in self.table.drain_regions_gone() {
            for t in self.transports.iter_mut() {
                t.region_detached(id);
            }
        }
        self.passes = self.passes.wrapping_add(1);
        if self.passes.is_multiple_of(256) {
            self.publish_counters();
        }
        self.table.sync_readiness();
        let rings = match self.table.link_mut().filter(|l| l.has_output()) {
            Some(l) => {
                l.flush_stash();
                l.flush_kept();
                l.publish_rings()
            }
            None => false,
        };
        if rings || self.table.has_pending_wakes() {
            // One fence for the pass: every ring it published is visible before it reads who
            // sleeps (apps' `waiters`, other poll threads' sleep flags).
            std::sync::atomic::fence(Ordering::SeqCst);
            self.table.wake_pending_after_fence();
            if rings {
                if let Some(l) = self.table.link_mut() {
                    l.ring_sleepers_after_fence();
                }
            }
        }
        work
    }

    fn reply(&self, seq: u64, app: usize, reply: CmdReply) {
        // The control thread keeps no more commands outstanding than `replies` holds.
        if self.table.chans().replies.push((seq, app, reply)).is_err() {
            tracing::error!(seq, app, "control reply queue full; answer lost");
        }
    }

    /// Takes what other shards sent: notes, then messages, in order per pair ring, stopping
    /// at one whose destination cannot take it yet. Called only for a pass that found input
    /// (`ShardLink::inputs_idle`: an idle pass checks each other shard with three loads).
    /// Never inlined: a symbol of its own for profiles (`bench/shards-callgrind.sh`).
    #[inline(never)]
    fn drain_fabric(&mut self) -> usize {
        self.fabric_drains += 1;
        let Some(link) = self.table.link_mut() else {
            return 0;
        };
        let (me, n) = (link.shard, link.shards());
        let mut work = 0;
        for from in (0..n).filter(|&f| f != me) {
            while let Some(note) = self.table.link().and_then(|l| l.take_note(from)) {
                work += 1;
                self.apply_note(from, note);
            }
        }
        let mut inp = std::mem::take(&mut self.table.link_mut().expect("link").inp);
        let mut stalled = 0u64;
        let mut records = 0u64;
        for (from, ring) in inp.iter_mut().enumerate().filter(|&(f, _)| f != me) {
            // An idle pair ring costs one load: no burst bookkeeping, no validated peek.
            if ring.nothing_published() {
                continue;
            }
            let mut taken = 0;
            // One burst per pair ring: each receiver's rx ring is published once, at its end.
            self.table.begin_rx_burst();
            while taken < TX_BATCH {
                let rec = match ring.peek() {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => unreachable!("pair ring {from}->{me}: {}", e.0),
                };
                let (env, ptr, len) = shard::open_record(ring, &rec);
                // SAFETY: `open_record` bounds the payload inside the ring's data area, which
                // stays allocated (the fabric) and unwritten (not consumed yet) for this call;
                // or, for an in-place delivery, inside the sender's tx ring as its shard
                // validated it, which the sender's hold keeps mapped (a departed app's region
                // drains) and out of its producer's reach until this shard's release note.
                let payload = unsafe { MsgBytes::from_shared(ptr, len) };
                if !self.take_forwarded(from, env, payload) {
                    stalled |= 1 << from;
                    break;
                }
                ring.consume(&rec);
                taken += 1;
            }
            self.table.end_rx_burst();
            if taken > 0 {
                ring.release();
                work += taken;
                records += taken as u64;
            }
        }
        let link = self.table.link_mut().expect("link");
        link.inp = inp;
        link.stalled = stalled;
        link.records_in += records;
        link.flush_release();
        work
    }

    fn apply_note(&mut self, from: usize, note: shard::Note) {
        use crate::seam::Upcalls as _;
        match note {
            shard::Note::Release { token, len } => self.table.release(token, len),
            shard::Note::CongBit { addr, port, on } => {
                self.table.local_cong_changed(addr, port, on);
                self.table.groups_remote_congestion(addr, port, on);
            }
            shard::Note::GroupOp {
                seq,
                app,
                uid,
                member,
                gen,
                bound,
                req,
                credit,
            } => {
                let remote = table::Remote {
                    shard: from,
                    gen,
                    bound,
                    congested: false,
                    credit: table::Credit {
                        bytes: credit,
                        asking: false,
                        granted: credit > 0,
                    },
                };
                let res = self.table.group_op(member, Some((remote, uid)), req);
                self.reply(
                    seq,
                    app,
                    CmdReply::Reply(match res {
                        Ok(()) => Reply::ok(0),
                        Err(e) => Reply::err(e),
                    }),
                );
                self.table.wake_control();
            }
            shard::Note::GroupSockClosed { member, gen } => {
                self.table.groups_remote_closed(member, from, gen)
            }
            shard::Note::Uncongested { mask } => self.table.notify_uncongested(mask),
            shard::Note::GroupPublished { stamp } => self.table.group_copy_published(stamp),
            shard::Note::GroupCommitted { stamp } => self.table.group_committed(stamp),
            shard::Note::GroupCopyWaiting { stamp } => self.table.group_copy_waiting(stamp),
            shard::Note::GroupCreditAsk { token, need, want } => {
                self.table.group_credit_ask(token, need, want)
            }
            shard::Note::GroupCredit { token, bytes } => {
                self.table.group_credit_granted(from, token, bytes)
            }
            shard::Note::GroupCreditBack { token, bytes } => {
                self.table.group_credit_back(token, bytes)
            }
        }
    }

    /// One message from shard `from`; false if it must wait (its destination is full).
    fn take_forwarded(&mut self, from: usize, env: shard::Envelope, payload: MsgBytes<'_>) -> bool {
        match env {
            shard::Envelope::DeliverRef { .. } => {
                unreachable!("open_record hands in-place deliveries over as Deliver")
            }
            shard::Envelope::GroupDeliver {
                faddr,
                sport,
                token,
                stamp,
                charge,
                ..
            } => {
                // A full member's copy waits on this shard (`backlog.rs`), not in the ring.
                let taken = self
                    .table
                    .group_copy_or_wait(token, faddr, sport, &payload, stamp);
                if taken {
                    // What shard 0 charged for it comes off the room its ring keeps.
                    self.table.group_credit_spent(token, charge);
                }
                taken
            }
            shard::Envelope::Deliver {
                laddr,
                faddr,
                sport,
                dport,
                token,
            } => {
                let len = payload.len() as u64;
                let m = crate::seam::Incoming {
                    laddr,
                    faddr,
                    sport,
                    dport,
                    payload,
                };
                // Releases `token` once delivered (into the ring or the backlog) or dropped.
                match self.table.deliver_forwarded(m, from, token) {
                    crate::seam::Delivered::Full => return false,
                    // A local sender's (token 0: from the network, which the connection's
                    // owner counted as its transport's delivery when it forwarded it).
                    crate::seam::Delivered::Yes if token != 0 => {
                        Stats::bump_mine(&self.table.stats().loop_delivered);
                        Stats::add_mine(&self.table.stats().loop_bytes, len);
                    }
                    crate::seam::Delivered::Yes | crate::seam::Delivered::NoSocket => {}
                }
                true
            }
            shard::Envelope::Send { .. } | shard::Envelope::SendRef { .. } => {
                let parts = env.send_parts().expect("a send");
                self.send_forwarded(from, parts, payload)
            }
            shard::Envelope::Cancel { laddr, sport, dest } => {
                for t in self.transports.iter_mut() {
                    t.cancel(laddr, sport, dest);
                }
                true
            }
        }
    }

    /// A send from shard `from` to a remote host (or a group) that this shard carries: to its
    /// transport with a forwarded token, whose release goes back as a note. `parts.in_place`: the
    /// payload lies in the sender's tx ring (`SendRef`), held there until that release, so the
    /// transport may keep it in place too. False if it must wait (its transport is full).
    fn send_forwarded(
        &mut self,
        from: usize,
        parts: shard::SendParts,
        payload: MsgBytes<'_>,
    ) -> bool {
        let shard::SendParts {
            src: (laddr, sport),
            dst: (faddr, dport),
            token,
            ack_required,
            in_place,
        } = parts;
        let len = payload.len() as u64;
        let dest = Ipv4Addr::from(faddr);
        let release = |table: &mut SocketTable| {
            if let Some(l) = table.link_mut() {
                l.note(from, shard::Note::Release { token, len });
            }
        };
        if dest.is_multicast() {
            // A group message from a socket of another shard: decided here, in the order of
            // the pair ring; one that a full member blocks waits parked (`backlog.rs`).
            return self.table.group_send_forwarded(
                from,
                token,
                (laddr, sport),
                (faddr, dport),
                &payload,
            );
        }
        let route = self.routes.get(faddr, &self.transports, self.table.cfg());
        let Some(t) = route.transport.map(|i| &mut self.transports[i]) else {
            Stats::bump(&self.table.stats().drop_no_route);
            release(&mut self.table);
            return true;
        };
        // The sender's region is not this shard's: the TCP links send from it; RDMA finds its
        // keys in the directory of every thread's regions (`rdma/regions.rs`).
        let in_place = (in_place && t.zero_copy() && payload.len() >= t.zero_copy_min())
            .then_some(FOREIGN_REGION);
        let msg = OutMsg {
            laddr,
            faddr,
            sport,
            dport,
            payload,
            token: shard::forwarded_token(from, token),
            in_place,
            ack_required,
        };
        match t.send(&mut self.table, msg) {
            SendOutcome::Queued => true,
            SendOutcome::QueuedInPlace => {
                Stats::bump_mine(&self.table.stats().tx_in_place_forwarded);
                true
            }
            SendOutcome::Blocked => false,
            SendOutcome::Delivered | SendOutcome::Dropped => {
                release(&mut self.table);
                true
            }
        }
    }

    /// Hands the group messages queued for other hosts (`group_hosts.rs`) to the transports
    /// (called when `group_out_pending`: a pass without them costs one flag test).
    #[cold]
    #[inline(never)]
    fn flush_group_out(&mut self) -> usize {
        self.table.group_out_taken();
        let mut work = 0;
        for i in 0..self.table.host_links() {
            let Some((addr, laddr, token, buf)) = self.table.take_host_out(i) else {
                continue;
            };
            let owner = self.table.net_owner(laddr, addr);
            let mut at = 0;
            while at + 4 <= buf.len() {
                let n = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
                let payload = MsgBytes::from_slice(&buf[at + 4..at + 4 + n]);
                self.table.group_host_sending(i, n as u64);
                let outcome = if owner != self.table.shard() {
                    // The host's connection is another shard's: its release comes back as a
                    // note (`Upcalls::release` of the forwarded token).
                    let env = shard::Envelope::Send {
                        laddr,
                        faddr: addr,
                        sport: GROUP_PORT,
                        dport: GROUP_PORT,
                        token,
                        ack_required: false,
                    };
                    match self
                        .table
                        .link_mut()
                        .expect("several shards")
                        .forward(owner, env, &payload)
                    {
                        Ok(()) => SendOutcome::Queued,
                        Err(()) => SendOutcome::Blocked,
                    }
                } else if let Some(i) = self
                    .routes
                    .get(addr, &self.transports, self.table.cfg())
                    .transport
                {
                    let t = &mut self.transports[i];
                    let msg = OutMsg {
                        laddr,
                        faddr: addr,
                        sport: GROUP_PORT,
                        dport: GROUP_PORT,
                        payload,
                        token,
                        in_place: None,
                        ack_required: false,
                    };
                    t.send(&mut self.table, msg)
                } else {
                    SendOutcome::Dropped
                };
                match outcome {
                    SendOutcome::Queued | SendOutcome::QueuedInPlace => {}
                    // Kept, in order, for the next pass.
                    SendOutcome::Blocked => {
                        self.table.group_host_released(i, n as u64);
                        break;
                    }
                    SendOutcome::Delivered | SendOutcome::Dropped => {
                        self.table.group_host_released(i, n as u64);
                        Stats::bump(&self.table.stats().group_host_lost)
                    }
                }
                at += 4 + n;
                work += 1;
            }
            self.table.put_host_out(i, buf, at);
        }
        work
    }

    /// `idle = "watch"`: an app thread sleeps in a receive on this thread's sockets or,
    /// with several poll threads, on another's as last looked (`ShardLink::watching`).
    fn receivers_waiting(&self) -> bool {
        let mine = self.table.receivers_waiting();
        match self.table.link() {
            Some(l) => l.watching(mine),
            None => mine,
        }
    }

    fn publish_counters(&self) {
        for t in &self.transports {
            t.publish_counters();
        }
        let stats = self.table.stats();
        let (out, inp) = self
            .table
            .link()
            .map_or((0, 0), |l| (l.records_out, l.records_in));
        for (counter, value) in [
            (&stats.poll_passes, self.passes),
            (&stats.tx_ring_visits, self.tx_visits),
            (&stats.fabric_drains, self.fabric_drains),
            (&stats.poll_busy_passes, self.busy_passes),
            (&stats.shard_records_out, out),
            (&stats.shard_records_in, inp),
            (&stats.poll_allocations, crate::quiet::allocations()),
            (&stats.poll_locks, crate::quiet::locks()),
        ] {
            counter.store(value, Ordering::Relaxed);
        }
    }

    /// Moves up to TX_BATCH messages off one socket's tx ring, as one burst: each local
    /// receiver's rx ring is published once, at its end.
    fn drain_tx(&mut self, from: SockRef) -> usize {
        self.tx_visits += 1;
        // A pass calls this only for a ring with news (`SocketTable::next_published`); a close
        // calls it until the ring is empty: one load of the producer's position, not the
        // burst bookkeeping and a validated `peek` (~100 instructions), when it is.
        if self
            .table
            .sock(from)
            .is_none_or(|s| s.tx.nothing_published())
        {
            return 0;
        }
        self.table.begin_rx_burst();
        let done = self.drain_tx_burst(from);
        self.table.end_rx_burst();
        done
    }

    fn drain_tx_burst(&mut self, from: SockRef) -> usize {
        let mut done = 0;
        while done < TX_BATCH {
            let Some(s) = self.table.sock(from) else {
                return done;
            };
            let pos = s.tx.position();
            s.ncancels = prune_cancels(&mut s.cancels, s.ncancels, pos);
            let rec = match s.tx.peek() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    self.table.evict(from.app, e.0);
                    return done;
                }
            };
            if rec.header.len as usize > MAX_MSG_SIZE {
                self.table.evict(from.app, "message longer than 1 MiB");
                return done;
            }
            let dest = (rec.header.addr, rec.header.port);
            let cancelled = s.cancels[..s.ncancels]
                .iter()
                .any(|c| rec.end() <= c.upto && c.dest.is_none_or(|d| d == dest));
            let sender = s.bound;
            // The kernel's rule (spec §7): once the bytes out, this one's included, reach half
            // the send buffer, the receiver is asked to acknowledge at once.
            let held = s.taken.saturating_sub(s.released) + u64::from(rec.header.len);
            let ack_required = 2 * held >= u64::from(s.sndbuf);
            let outcome = if cancelled {
                Stats::bump(&self.table.stats().drop_cancelled);
                Outcome::Done
            } else if let Some(src) = sender {
                self.route(from, src, &rec, ack_required)
            } else {
                Stats::bump(&self.table.stats().drop_unbound_sender);
                Outcome::Done
            };
            if let Outcome::Blocked = outcome {
                break;
            }
            let s = self.table.sock(from).expect("sender still open");
            s.tx.consume(&rec);
            s.taken += u64::from(rec.header.len);
            if let Outcome::Done = outcome {
                s.released += rec.header.len as u64;
            }
            done += 1;
        }
        if done > 0 {
            self.table.publish_released(from);
        }
        done
    }

    /// Hands one message to the first transport that carries its destination (or, for an
    /// address in 224.0.0.0/4, to the group's fan-out).
    /// `ack_required`: the sender's send buffer is half used ([`OutMsg::ack_required`]).
    fn route(
        &mut self,
        from: SockRef,
        src: (u32, u16),
        rec: &Record,
        ack_required: bool,
    ) -> Outcome {
        let dest = Ipv4Addr::from(rec.header.addr);
        if dest.is_multicast() && self.table.shard() != 0 {
            // Shard 0 owns and orders every group: the message crosses in this ring's order.
            return self.forward_send(0, from, src, rec, false);
        }
        if dest.is_multicast() {
            // SAFETY: as below: peeked, not consumed, its app in the table for this call.
            let sent = unsafe { self.table.tx_record(from, rec) };
            return match self.table.group_send(
                from,
                src,
                rec.header.addr,
                rec.header.port,
                &sent.payload,
            ) {
                table::GroupSent::Done => Outcome::Done,
                table::GroupSent::Blocked | table::GroupSent::Busy => Outcome::Blocked,
            };
        }
        let route = self
            .routes
            .get(rec.header.addr, &self.transports, self.table.cfg());
        if self.table.link().is_some() {
            if route.local {
                if let Some(o) = self.forward_local(from, src, rec) {
                    return o;
                }
            }
            if self.table.net_shards() > 1 {
                // The connection to a remote host is one shard's: the message takes its ring.
                let owner = self.table.net_owner(src.0, rec.header.addr);
                if owner != self.table.shard() && !route.local {
                    return self.forward_send(owner, from, src, rec, ack_required);
                }
            }
        }
        if route.local && rec.header.port != 0 {
            // A socket of this host on this thread (or none bound): the loopback transport's
            // delivery, called directly rather than through `dyn Transport` and back through
            // `dyn Upcalls` (a crossing message is delivered directly on its receiver's thread
            // too, `drain_fabric`). Port 0 (a ping) goes to the transport.
            // SAFETY: as below: peeked, not consumed, its app in the table for this call.
            let sent = unsafe { self.table.tx_record(from, rec) };
            if self.table.cfg().trace_hops {
                stamp_pickup(&sent.payload);
            }
            let token = token_of(from, sent.gen);
            let msg = out_msg(src, rec, sent.payload, token, None, ack_required);
            return match crate::transport::loopback::deliver(&mut self.table, &self.stats, msg) {
                SendOutcome::Blocked => Outcome::Blocked,
                _ => Outcome::Done,
            };
        }
        let Some(t) = route.transport.map(|i| &mut self.transports[i]) else {
            if self.table.shard() != 0 && self.table.net_shards() == 1 {
                return self.forward_send(0, from, src, rec, ack_required);
            }
            Stats::bump(&self.table.stats().drop_no_route);
            return Outcome::Done;
        };
        // SAFETY: `rec` was just peeked off `from`'s ring and is consumed after this call;
        // `from`'s app stays in the table for this whole call (the transport reaches the
        // table only through `Upcalls`, which never removes an app).
        let sent = unsafe { self.table.tx_record(from, rec) };
        let hold = if t.zero_copy() && sent.payload.len() >= t.zero_copy_min() {
            self.table.offer_hold(from, sent.pos)
        } else {
            None
        };
        if self.table.cfg().trace_hops {
            stamp_pickup(&sent.payload);
        }
        let token = hold.unwrap_or_else(|| token_of(from, sent.gen));
        let in_place = hold.map(|_| sent.region_id);
        let msg = out_msg(src, rec, sent.payload, token, in_place, ack_required);
        let outcome = t.send(&mut self.table, msg);
        match (outcome, hold) {
            // A copy made under an in-place token is released through the same token.
            (SendOutcome::Queued, _) => Outcome::Queued,
            (SendOutcome::QueuedInPlace, Some(h)) => {
                self.table.place_hold(h);
                Outcome::Queued
            }
            (SendOutcome::QueuedInPlace, None) => {
                debug_assert!(false, "{}: in place without an offer", t.name());
                Outcome::Queued
            }
            (o, h) => {
                if let Some(h) = h {
                    self.table.drop_hold(h);
                }
                match o {
                    SendOutcome::Blocked => Outcome::Blocked,
                    _ => Outcome::Done,
                }
            }
        }
    }

    /// A send to a socket of this host that another shard owns: into the pair ring, with the
    /// sender's token, so its send buffer is released only once the message is in the
    /// receiver's rx ring (SO_SNDBUF covers the crossing, as it covers a network path).
    /// `None`: not bound on another shard (loopback, or no socket: the transports decide).
    /// The destination is an address of this host.
    fn forward_local(&mut self, from: SockRef, src: (u32, u16), rec: &Record) -> Option<Outcome> {
        let (addr, port) = (rec.header.addr, rec.header.port);
        if port == 0 {
            return None;
        }
        let link = self.table.link_mut()?;
        let (to, backed_up) = link.owner(addr, port)?;
        let closing = link.is_closing();
        if backed_up && !closing {
            // The receiver's backlog is past its share (`backlog.rs`): wait here, as a sender
            // of its own thread waits for its full ring, so that a receiver that never reads
            // cannot fill this thread's backlogs. (A closing sender's messages go on into the
            // backlog: they are delivered, not dropped, once their socket is gone.)
            link.waited_on_receiver = true;
            Stats::bump(&self.table.stats().tx_held_for_backlog);
            return Some(Outcome::Blocked);
        }
        // SAFETY: as in `route`: peeked, not consumed, its app in the table for this call.
        let sent = unsafe { self.table.tx_record(from, rec) };
        if self.table.cfg().trace_hops {
            stamp_pickup(&sent.payload);
        }
        if sent.payload.len() >= CROSS_IN_PLACE_MIN && !closing {
            // Large: the receiving shard copies it straight from this tx ring, whose space a
            // hold keeps until its release note (one copy instead of two).
            if let Some(hold) = self.table.offer_hold(from, sent.pos) {
                let env = shard::Envelope::DeliverRef {
                    laddr: addr,
                    faddr: src.0,
                    sport: src.1,
                    dport: port,
                    token: hold,
                    ptr: sent.payload.as_ptr() as usize as u64,
                    len: sent.payload.len() as u32,
                };
                let link = self.table.link_mut().expect("checked");
                return Some(match link.forward_ref(to, env) {
                    Ok(()) => {
                        self.table.place_hold(hold);
                        Outcome::Queued
                    }
                    Err(()) => {
                        self.table.drop_hold(hold);
                        Outcome::Blocked
                    }
                });
            }
        }
        let env = shard::Envelope::Deliver {
            laddr: addr,
            faddr: src.0,
            sport: src.1,
            dport: port,
            token: token_of(from, sent.gen),
        };
        let link = self.table.link_mut().expect("checked");
        Some(match link.forward(to, env, &sent.payload) {
            Ok(()) => Outcome::Queued,
            Err(()) => Outcome::Blocked,
        })
    }

    /// A send to a remote host (or a group) from a shard that does not carry it: to shard
    /// `to`, whose transport gives the bytes back (`Note::Release`) when the peer
    /// acknowledged them.
    fn forward_send(
        &mut self,
        to: usize,
        from: SockRef,
        src: (u32, u16),
        rec: &Record,
        ack_required: bool,
    ) -> Outcome {
        // SAFETY: as in `route`: peeked, not consumed, its app in the table for this call.
        let sent = unsafe { self.table.tx_record(from, rec) };
        let closing = self.table.link().is_some_and(|l| l.is_closing());
        let zero_copy = self
            .table
            .cfg()
            .tcp_zero_copy_min
            .is_some_and(|min| sent.payload.len() >= min);
        if zero_copy && !closing && !Ipv4Addr::from(rec.header.addr).is_multicast() {
            // Large: the owner's transport takes it straight from this tx ring, whose space a
            // hold keeps until the release note (no copy into the pair ring, and none on the
            // owner for a transport that sends in place).
            if let Some(hold) = self.table.offer_hold(from, sent.pos) {
                let env = shard::Envelope::SendRef {
                    laddr: src.0,
                    faddr: rec.header.addr,
                    sport: src.1,
                    dport: rec.header.port,
                    token: hold,
                    ptr: sent.payload.as_ptr() as usize as u64,
                    len: sent.payload.len() as u32,
                    ack_required,
                };
                let link = self.table.link_mut().expect("several shards have a link");
                return match link.forward_ref(to, env) {
                    Ok(()) => {
                        self.table.place_hold(hold);
                        Stats::bump_mine(&self.table.stats().tx_in_place_crossed);
                        Outcome::Queued
                    }
                    Err(()) => {
                        self.table.drop_hold(hold);
                        Outcome::Blocked
                    }
                };
            }
        }
        let env = shard::Envelope::Send {
            laddr: src.0,
            faddr: rec.header.addr,
            sport: src.1,
            dport: rec.header.port,
            token: token_of(from, sent.gen),
            ack_required,
        };
        let link = self.table.link_mut().expect("several shards have a link");
        match link.forward(to, env, &sent.payload) {
            Ok(()) => Outcome::Queued,
            Err(()) => Outcome::Blocked,
        }
    }

    /// RDS_CANCEL_SENT_TO (or a drain cancel) for every transport, other shards' included.
    fn cancel_everywhere(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        for t in self.transports.iter_mut() {
            t.cancel(laddr, sport, dest);
        }
        // Behind this socket's sends in each pair ring (see `Envelope::Cancel`).
        let env = shard::Envelope::Cancel { laddr, sport, dest };
        let all = self.table.net_shards() > 1;
        if let Some(l) = self.table.link_mut() {
            let (me, n) = (l.shard, l.shards());
            let none = MsgBytes::from_slice(&[]);
            for k in (0..n).filter(|&k| k != me && (all || k == 0)) {
                // Kept in order if the ring is full: it carries no bytes, and a socket has at
                // most `MAX_CANCELS` outstanding.
                let kept = l.forward_or_keep(k, env, &none);
                debug_assert!(kept.is_ok(), "an envelope alone is always kept");
            }
        }
    }

    fn close_sock(&mut self, r: SockRef) {
        // A send that returned success is delivered even if the sender closes (or exits) right
        // after it: move what can still move before the socket goes. Bounded by one ring's worth
        // of bytes: another thread of the app may keep publishing while we drain.
        if !self.table.is_evicted(r.app) {
            if let Some(s) = self.table.sock(r) {
                let start = s.tx.position();
                let cap = s.tx.memory().capacity() as u64;
                // Messages for another shard whose pair ring is full are kept, not refused.
                if let Some(l) = self.table.link_mut() {
                    l.set_closing(true);
                }
                // And those for a local receiver whose ring is full wait in its backlog.
                self.table.set_closing_sender(true);
                while self.drain_tx(r) > 0 {
                    match self.table.sock(r) {
                        Some(s) if s.tx.position().wrapping_sub(start) < cap => {}
                        _ => break,
                    }
                }
                if let Some(l) = self.table.link_mut() {
                    l.set_closing(false);
                }
                self.table.set_closing_sender(false);
            }
        }
        self.table.close_sock_now(r);
    }

    fn release_app_sockets(&mut self, app: usize) {
        let n = self.table.slots(app);
        for slot in 0..n {
            self.close_sock(SockRef {
                app,
                slot: slot as u32,
            });
        }
    }

    fn handle_cmd(&mut self, seq: u64, cmd: Cmd) -> Option<CmdReply> {
        Some(match cmd {
            Cmd::Attach {
                app,
                region,
                doorbell,
                uid,
            } => {
                if !self.table.chans().take(app, seq) {
                    return Some(CmdReply::Withdrawn(Some(region)));
                }
                let (region_id, region) = self.table.attach(app, region, doorbell, uid);
                for t in self.transports.iter_mut() {
                    // Registration (zero-copy transports) happens here, once per app.
                    t.region_attached(region_id, region.base(), region.len());
                }
                CmdReply::Attached
            }
            Cmd::Detach { app } => {
                self.release_app_sockets(app);
                match self.table.detach(app) {
                    Detached::Absent => CmdReply::Detached(None),
                    // Messages sent in place from its region are still out: the table keeps
                    // it mapped until they are through, or has them cancelled.
                    Detached::Draining { cancel } => {
                        for (laddr, sport) in cancel {
                            self.cancel_everywhere(laddr, sport, None);
                        }
                        CmdReply::Detached(None)
                    }
                    Detached::Unmapped { region_id, region } => {
                        for t in self.transports.iter_mut() {
                            t.region_detached(region_id);
                        }
                        CmdReply::Detached(Some(region))
                    }
                }
            }
            Cmd::Request {
                app,
                req,
                readiness,
            } => {
                if !self.table.chans().take(app, seq) {
                    return Some(CmdReply::Withdrawn(None));
                }
                if self.forward_group_request(seq, app, req) {
                    return None;
                }
                CmdReply::Reply(match self.handle_request(app, req, readiness) {
                    Ok(v) => Reply::ok(v),
                    Err(e) => Reply::err(e),
                })
            }
            Cmd::Snapshot { app, messages, .. } => {
                if !self.table.chans().take(app, seq) {
                    return Some(CmdReply::Withdrawn(None));
                }
                // Counters summed lazily by the transports are made exact for the same view.
                self.publish_counters();
                CmdReply::Snapshot(Box::new(self.snapshot(messages)))
            }
        })
    }

    /// On a shard other than 0, a group request (create, join, leave, filter) of a live
    /// socket goes to shard 0, which orders every group, as a note with what it needs to know
    /// of the socket; shard 0 answers the control thread. True if it went.
    fn forward_group_request(&mut self, seq: u64, app: usize, req: Request) -> bool {
        let slot = match req {
            Request::GroupCreate { slot, .. }
            | Request::GroupJoin { slot, .. }
            | Request::GroupLeave { slot, .. }
            | Request::GroupFilter { slot, .. } => slot,
            _ => return false,
        };
        if self.table.shard() == 0 || self.table.is_evicted(app) {
            return false;
        }
        let member = SockRef { app, slot };
        let Some(s) = self.table.sock(member) else {
            return false;
        };
        s.grouped = true;
        let (gen, bound, congested) = (s.gen, s.bound, s.congested);
        // A join takes its credit along (given back by shard 0 if the join fails).
        let credit = if matches!(req, Request::GroupJoin { .. }) {
            self.table.group_credit_with_join(member)
        } else {
            0
        };
        let uid = self.table.app_uid(app);
        let note = shard::Note::GroupOp {
            seq,
            app,
            uid,
            member,
            gen,
            bound,
            req,
            credit,
        };
        let (addr_port, link) = (bound, self.table.link_mut().expect("several shards"));
        link.note(0, note);
        if let (true, Some((addr, port))) = (congested, addr_port) {
            // Shard 0 learns the member's congestion from the notes that follow.
            link.note(
                0,
                shard::Note::CongBit {
                    addr,
                    port,
                    on: true,
                },
            );
        }
        true
    }

    fn live_sock(&mut self, app: usize, slot: u32) -> Result<SockRef, i32> {
        let r = SockRef { app, slot };
        match self.table.sock(r) {
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
        if self.table.is_evicted(app) {
            return Err(libc::ECONNRESET);
        }
        match req {
            Request::Hello { .. } | Request::Stats | Request::Info { .. } => Err(libc::EINVAL),
            Request::SocketOpen => self.table.open_sock(app, readiness).map(u64::from),
            Request::Bind { slot, addr, port } => {
                let r = self.live_sock(app, slot)?;
                self.table.bind(r, addr, port).map(u64::from)
            }
            Request::SetRcvBuf { slot, bytes } => {
                let r = self.live_sock(app, slot)?;
                if let (Some(d), shm_api::ctrl::TEST_STALL_RCVBUF) = (self.test_stall, bytes) {
                    tracing::warn!(
                        ms = d.as_millis() as u64,
                        "TEST HOOK: stalling the poll core"
                    );
                    std::thread::sleep(d);
                }
                self.table.sock(r).expect("live").rcvbuf = bytes.clamp(MIN_BUF, MAX_BUF);
                Ok(0)
            }
            Request::SetSndBuf { slot, bytes } => {
                let r = self.live_sock(app, slot)?;
                self.table.sock(r).expect("live").sndbuf = bytes.clamp(MIN_BUF, MAX_BUF);
                Ok(0)
            }
            Request::SetCongMonitor { slot, on } => {
                let r = self.live_sock(app, slot)?;
                self.table.sock(r).expect("live").monitor = on;
                Ok(0)
            }
            Request::CancelSentTo { slot, dest } => {
                let r = self.live_sock(app, slot)?;
                let s = self.table.sock(r).expect("live");
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
                self.cancel_everywhere(laddr, sport, dest);
                Ok(0)
            }
            Request::EnableReadiness { slot } => {
                let r = self.live_sock(app, slot)?;
                self.table.enable_readiness(r)?;
                Ok(0)
            }
            Request::Close { slot } => {
                let r = self.live_sock(app, slot)?;
                self.close_sock(r);
                Ok(0)
            }
            Request::GroupCreate { slot, .. }
            | Request::GroupJoin { slot, .. }
            | Request::GroupLeave { slot, .. }
            | Request::GroupFilter { slot, .. } => {
                // Shard 0 (other shards forward these, `forward_group_request`).
                let r = self.live_sock(app, slot)?;
                self.table.group_op(r, None, req).map(|()| 0)
            }
            Request::GroupConnect { slot, addr, port } => {
                let r = self.live_sock(app, slot)?;
                self.table.group_connect(r, addr, port).map(|()| 0)
            }
        }
    }
}

/// The message a transport is handed for `rec`, taken off the tx ring of the socket bound at
/// `src`.
#[inline(always)]
fn out_msg<'a>(
    src: (u32, u16),
    rec: &Record,
    payload: MsgBytes<'a>,
    token: u64,
    in_place: Option<u64>,
    ack_required: bool,
) -> OutMsg<'a> {
    OutMsg {
        laddr: src.0,
        faddr: rec.header.addr,
        sport: src.1,
        dport: rec.header.port,
        payload,
        token,
        in_place,
        ack_required,
    }
}

/// Hop trace (`trace_hops`): stamps a message's pickup, still in its sender's tx ring.
fn stamp_pickup(payload: &MsgBytes<'_>) {
    // SAFETY: the bytes lie in the sender's mapped, writable tx ring (the view comes from
    // `SocketTable::tx_record`, built from the ring's `*mut` data pointer); it is the app's own
    // published record, which only this core reads, and the stamp is only copied in.
    unsafe {
        shm_api::hoptrace::stamp_shared(
            payload.as_ptr().cast_mut(),
            payload.len(),
            shm_api::hoptrace::Slot::Pickup,
        )
    };
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
        if idle.idle(work, core.pass_time()) {
            if idle.watches() && core.receivers_waiting() {
                Stats::bump(&core.table.stats().parks_withheld);
                idle.stay_awake();
                continue;
            }
            // About to park: announce it, then look once more so no doorbell is missed.
            let dview = core.dview();
            let sleeping = dview.sleeping(core.table.shard());
            sleeping.store(1, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            // Apps check the flag after a publish with no fence of their own
            // (`DaemonHeader::park_barrier`): this barrier orders their publishes against it.
            // Without it a send just before could go unseen, so stay awake.
            if dview.header().park_barrier.load(Ordering::Relaxed) != 0
                && shm_api::sys::membarrier_global().is_err()
            {
                sleeping.store(0, Ordering::Relaxed);
                Stats::bump(&core.table.stats().park_barrier_failures);
                continue;
            }
            let work = core.run_once();
            if work == 0 {
                Stats::bump(&core.table.stats().poll_parks);
                fds.clear();
                // Every attached app's own doorbell wakes us (see `SocketTable::doorbell_fds`).
                let napps = core.table.doorbell_fds(&mut fds);
                // Counters are summed lazily; make them exact before sleeping.
                core.publish_counters();
                // Input stopped at a full receiver, notes waiting for room, or a backlog: look
                // again soon.
                let retry =
                    core.table.link().is_some_and(|l| l.needs_retry()) || core.table.has_backlog();
                let mut timeout = retry.then_some(std::time::Duration::from_millis(1));
                for t in &core.transports {
                    t.park_fds(&mut fds);
                    timeout = match (timeout, t.next_timeout()) {
                        (Some(a), Some(b)) => Some(std::cmp::min(a, b)),
                        (a, b) => a.or(b),
                    };
                }
                core.silent_park = idle.park(&mut fds, timeout);
                core.table.drain_doorbells(&fds[..napps]);
            } else {
                idle.reset();
            }
            sleeping.store(0, Ordering::Relaxed);
            // No reset after a park: a wake-up that finds no work (the park timeout, an app's
            // liveness check) parks again at once instead of spinning and yielding anew; the
            // next pass that does work restarts the backoff.
        }
    }
}
